"""make_trainable on models exported from PyTorch, checked against PyTorch training loops (autograd for the
gradients, torch.optim for SGD / momentum / Nesterov / Adagrad / Adam). tests/test_optimizers.py covers AdamW,
weight decay, clipping and accumulation."""

from __future__ import annotations

import io
import warnings

import numpy as np
import onnx
import pytest

import onnxtrain

torch = pytest.importorskip("torch")
F = torch.nn.functional

LR = 0.05
EPS = 1e-6
STEPS = 20


def mlp() -> "torch.nn.Module":
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def cnn() -> "torch.nn.Module":
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3), torch.nn.ReLU(), torch.nn.MaxPool2d(2), torch.nn.Flatten(), torch.nn.Linear(36, 3)
    )


def separable() -> "torch.nn.Module":
    """Every convolution path onnxtrain has on CPU: a shallow dense layer, a depthwise one read by a pool at its
    window offsets, a 1x1 layer over six channels, and a wide one XLA convolves itself."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(2, 6, 3, padding=1), torch.nn.ReLU(),
        torch.nn.Conv2d(6, 6, 3, padding=1, groups=6), torch.nn.ReLU(), torch.nn.AvgPool2d(2),
        torch.nn.Conv2d(6, 4, 1), torch.nn.Tanh(), torch.nn.Conv2d(4, 3, 3, padding=1), torch.nn.ReLU(),
        torch.nn.MaxPool2d(2), torch.nn.Flatten(), torch.nn.Linear(6, 3),
    )


INPUTS = {"mlp": (mlp, (6, 4)), "cnn": (cnn, (6, 1, 8, 8)), "separable": (separable, (4, 2, 8, 6))}


def export(module, x) -> onnx.ModelProto:
    buffer = io.BytesIO()
    torch.onnx.export(module, (x,), buffer, dynamo=False, input_names=["X"], output_names=["Y"],
                      dynamic_axes={"X": {0: "N"}, "Y": {0: "N"}}, opset_version=17)
    return onnx.load_from_string(buffer.getvalue())


def torch_loss(kind: str, y, t):
    return {"mse": F.mse_loss, "cross_entropy": F.cross_entropy,
            "bce_logits": F.binary_cross_entropy_with_logits}[kind](y, t)


def targets(kind: str, rng, n: int):
    if kind == "cross_entropy":
        return rng.integers(0, 3, size=n).astype(np.int64)
    if kind == "bce_logits":
        return rng.integers(0, 2, size=(n, 3)).astype(np.float32)
    return rng.normal(size=(n, 3)).astype(np.float32)


def reference_training(module, optimizer: str, loss: str, x, t) -> dict[str, np.ndarray]:
    params = dict(module.named_parameters())
    torch_optimizers = {
        "sgd": lambda p: torch.optim.SGD(p, lr=LR),
        "momentum": lambda p: torch.optim.SGD(p, lr=LR, momentum=0.9),
        "nesterov": lambda p: torch.optim.SGD(p, lr=LR, momentum=0.9, nesterov=True),
        "adagrad": lambda p: torch.optim.Adagrad(p, lr=LR, eps=EPS),
        "adam": lambda p: torch.optim.Adam(p, lr=LR, eps=EPS),
    }
    opt = torch_optimizers[optimizer](params.values())
    for _ in range(STEPS):
        module.zero_grad()
        torch_loss(loss, module(torch.from_numpy(x)), torch.from_numpy(t)).backward()
        opt.step()
    return {k: p.detach().numpy() for k, p in params.items()}


@pytest.mark.parametrize("architecture", ["mlp", "cnn", "separable"])
@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "nesterov", "adagrad", "adam"])
@pytest.mark.parametrize("loss", ["mse", "cross_entropy", "bce_logits"])
def test_trainable_pytorch_export_matches_pytorch_training(architecture, optimizer, loss):
    build, shape = INPUTS[architecture]
    rng = np.random.default_rng(0)
    x = rng.normal(size=shape).astype(np.float32)
    t = targets(loss, rng, shape[0])
    module = build()
    model = export(module, torch.from_numpy(x))
    options = {"epsilon": EPS} if optimizer in ("adam", "adagrad") else {}
    trainable = onnxtrain.make_trainable(model, loss=loss, optimizer=optimizer, learning_rate=LR, **options)
    onnx.checker.check_model(trainable)
    engine = onnxtrain.load(trainable)
    engine.init()
    for _ in range(STEPS):
        engine.train_step({"X": x, "target": t})
    expected = reference_training(module, optimizer, loss, x, t)
    # Adam moves every weight by about `LR` per step whatever its gradient's size, so a near-zero gradient
    # that float32 rounds differently in XLA and in PyTorch shows as an absolute (not relative) difference:
    # at most 1.7e-5 (separable, cross_entropy: its ReLUs all die for three steps, then gradients of ~1e-4 restart
    # the moments, where torch's epsilon, added after the bias correction, damps them less than ONNX's op did).
    atol = 4e-4 * LR if optimizer == "adam" else 1e-6
    for name, value in expected.items():
        np.testing.assert_allclose(np.asarray(engine.state[name]), value, rtol=1e-4, atol=atol, err_msg=name)


def test_batch_normalization_statistics_stay_out_of_training(tmp_path):
    """An eval-mode export's BatchNormalization trains its scale and bias through its running statistics, as
    PyTorch trains a module in eval mode, and the statistics themselves are no parameters: no gradient moves them."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.ReLU(), torch.nn.BatchNorm2d(4),
                                 torch.nn.MaxPool2d(2), torch.nn.Flatten(), torch.nn.Linear(36, 3))
    with torch.no_grad():  # statistics far from 0 and 1, so using (or moving) them shows
        module[2].running_mean.uniform_(-0.5, 0.5)
        module[2].running_var.uniform_(0.5, 2.0)
    module.eval()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(6, 1, 8, 8)).astype(np.float32)
    t = targets("mse", rng, 6)
    statistics = {"2.running_mean": module[2].running_mean.numpy().copy(),
                  "2.running_var": module[2].running_var.numpy().copy()}
    trainable = onnxtrain.make_trainable(export(module, torch.from_numpy(x)), loss="mse", optimizer="sgd",
                                         learning_rate=LR)
    assert "BatchNormalization" in [n.op_type for n in trainable.graph.node]
    assert not set(statistics) & {b.key for b in trainable.training_info[0].update_binding}
    engine = onnxtrain.load(trainable)
    for _ in range(STEPS):
        engine.train_step({"X": x, "target": t})
    expected = reference_training(module, "sgd", "mse", x, t)
    assert {"2.weight", "2.bias"} <= set(expected)
    for name, value in expected.items():
        np.testing.assert_allclose(np.asarray(engine.state[name]), value, rtol=1e-4, atol=1e-6, err_msg=name)
    engine.export(tmp_path / "trained.onnx")
    exported = {i.name: onnx.numpy_helper.to_array(i) for i in onnx.load(tmp_path / "trained.onnx").graph.initializer}
    for name, value in statistics.items():
        np.testing.assert_array_equal(exported[name], value, err_msg=name)


def test_trained_export_runs_in_onnxruntime(tmp_path):
    ort = pytest.importorskip("onnxruntime")
    x = np.random.default_rng(1).normal(size=(6, 4)).astype(np.float32)
    model = export(mlp(), torch.from_numpy(x))
    engine = onnxtrain.load(onnxtrain.make_trainable(model, loss="mse", optimizer="adam", learning_rate=LR))
    engine.init()
    for _ in range(5):
        engine.train_step({"X": x, "target": np.zeros((6, 3), np.float32)})
    engine.export(tmp_path / "trained.onnx")
    session = ort.InferenceSession(str(tmp_path / "trained.onnx"), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(session.run(None, {"X": x})[0], np.asarray(engine.infer({"X": x})["Y"]),
                               rtol=1e-5, atol=1e-6)


def test_optax_through_jax_function_matches_pytorch(tmp_path):
    """jax_function + optax.sgd on a PyTorch export equals torch.optim.SGD; export_params writes it back."""
    import jax
    import optax

    rng = np.random.default_rng(2)
    x = rng.normal(size=(6, 4)).astype(np.float32)
    t = rng.normal(size=(6, 3)).astype(np.float32)
    module = mlp()
    model = export(module, torch.from_numpy(x))
    fn, params = onnxtrain.jax_function(model)
    optimizer = optax.sgd(LR)
    opt_state = optimizer.init(params)

    @jax.jit
    def step(params, opt_state):
        grads = jax.grad(lambda p: ((fn(p, {"X": x})["Y"] - t) ** 2).mean())(params)
        updates, opt_state = optimizer.update(grads, opt_state)
        return optax.apply_updates(params, updates), opt_state

    for _ in range(STEPS):
        params, opt_state = step(params, opt_state)
    expected = reference_training(module, "sgd", "mse", x, t)
    for name, value in expected.items():
        np.testing.assert_allclose(np.asarray(params[name]), value, rtol=1e-4, atol=1e-6, err_msg=name)
    onnxtrain.export_params(model, params, tmp_path / "tuned.onnx")
    reloaded = onnxtrain.load(tmp_path / "tuned.onnx")
    np.testing.assert_allclose(np.asarray(reloaded.infer({"X": x})["Y"]),
                               module(torch.from_numpy(x)).detach().numpy(), rtol=1e-5, atol=1e-6)


def linear_model(output_type: int = onnx.TensorProto.FLOAT, classes: int = 3) -> onnx.ModelProto:
    from onnx import TensorProto, helper, numpy_helper

    nodes = [helper.make_node("MatMul", ["X", "W"], ["Z"])]
    nodes.append(helper.make_node("Identity", ["Z"], ["Y"]) if output_type == TensorProto.FLOAT
                 else helper.make_node("ArgMax", ["Z"], ["Y"], axis=1, keepdims=0))
    graph = helper.make_graph(
        nodes, "linear", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("Y", output_type, ["N", classes] if output_type == TensorProto.FLOAT
                                       else ["N"])],
        [numpy_helper.from_array(np.full((4, classes), 0.1, np.float32), "W")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("options, message", [
    ({"learning_rate": float("nan")}, "learning_rate must be a finite number >= 0, got nan"),
    ({"learning_rate": True}, "learning_rate must be a finite number >= 0, got True"),
    ({"learning_rate": float("inf")}, "got inf"),
    ({"learning_rate": -0.1}, "got -0.1"),
    ({"loss": "hinge"}, "loss must be one of"),
    ({"loss": None}, "loss must be one of .* got None"),
    ({"loss": "output:L"}, "loss output 'L' is not a declared output of the model"),
    ({"loss": "mse", "ignore_index": -100}, "apply to loss='cross_entropy', not 'mse'"),
    ({"loss": "cross_entropy", "class_axis": 0}, "class_axis=0 is not a class axis"),
    ({"loss": "cross_entropy", "class_axis": 2}, "class_axis=2 is not a class axis"),
    ({"loss": "cross_entropy", "prediction": "Z2"}, "prediction 'Z2' is not a declared output"),
    ({"trainable": []}, "the list of names is empty"),
    ({"trainable": ["W", "W"]}, r"\['W'\] listed twice"),
    ({"trainable": "bias.*"}, "no parameter matches 'bias.*'"),
])
def test_make_trainable_refuses_options_that_do_not_fit(options, message):
    with pytest.raises(onnxtrain.errors.AuthoringError, match=message):
        onnxtrain.make_trainable(linear_model(), **options)


def test_a_model_without_outputs_needs_a_prediction_named():
    model = linear_model()
    del model.graph.output[:]
    with pytest.raises(onnxtrain.errors.AuthoringError, match="the model's graph declares no output, so there is no "
                       "prediction to train: name one with prediction="):
        onnxtrain.make_trainable(model)


@pytest.mark.parametrize("opset, options, message", [
    (5, {}, r"opset 7 or later \(Cast from 6, Mul from 7, Sub from 7\), and the model imports opset 5: convert it first"),
    (8, {"accumulate": 2}, r"opset 9 or later \(ConstantOfShape from 9, Where from 9\), and the model imports opset 8"),
])
def test_a_model_older_than_the_ops_the_training_graphs_write_is_refused_naming_them(opset, options, message):
    """The training graphs share the model's opset import: Cast-1 would read make_trainable's integer `to` as a
    string, Add-6 broadcast only with broadcast=1, and Where does not exist before opset 9."""
    model = linear_model()
    model.opset_import[0].version = opset
    with pytest.raises(onnxtrain.errors.AuthoringError, match=message):
        onnxtrain.make_trainable(model, loss="mse", optimizer="sgd", **options)


def test_an_opset_9_model_trains_as_numpy_computes_it():
    """Opset 9 has every op plain SGD on a mean squared error writes: the step is NumPy's."""
    model = linear_model()
    model.opset_import[0].version = 9
    engine = onnxtrain.load(onnxtrain.make_trainable(model, loss="mse", optimizer="sgd", learning_rate=0.5))
    x = np.random.default_rng(0).normal(size=(5, 4)).astype(np.float32)
    t = np.random.default_rng(1).normal(size=(5, 3)).astype(np.float32)
    w = np.full((4, 3), 0.1, np.float32)
    loss = engine.train_step({"X": x, "target": t})["loss"]
    np.testing.assert_allclose(loss, np.mean((x @ w - t) ** 2), rtol=1e-6)
    expected = w - 0.5 * x.T @ (2 * (x @ w - t) / t.size)
    np.testing.assert_allclose(np.asarray(engine.state["W"]), expected, rtol=1e-5)


@pytest.mark.parametrize("model", [None, "model.onnx", b"bytes"])
def test_make_trainable_names_what_it_takes(model):
    with pytest.raises(onnxtrain.errors.AuthoringError, match="make_trainable takes an onnx.ModelProto"):
        onnxtrain.make_trainable(model)


def test_a_numpy_scalar_learning_rate_is_a_number():
    model = onnxtrain.make_trainable(linear_model(), learning_rate=np.float32(0.25))
    rates = [t for t in model.training_info[0].algorithm.initializer if t.name == "learning_rate"]
    assert onnx.numpy_helper.to_array(rates[0]) == np.float32(0.25)


def test_loss_is_checked_against_the_declared_output():
    with pytest.raises(onnxtrain.errors.AuthoringError, match="prediction 'Y' is int64; the loss needs a float"):
        onnxtrain.make_trainable(linear_model(onnx.TensorProto.INT64), loss="cross_entropy")
    with pytest.raises(onnxtrain.errors.AuthoringError, match="one class on axis 1"):
        onnxtrain.make_trainable(linear_model(classes=1), loss="cross_entropy")


def test_cross_entropy_before_opset_12_is_refused_naming_the_conversion():
    """SoftmaxCrossEntropyLoss is an operator since opset 12: an opset-11 model (torch.onnx.export(...,
    opset_version=11)) had been given one that load then refused as unsupported. Refused at make_trainable, and the
    conversion it names trains as PyTorch's cross_entropy."""
    old = linear_model()
    old.opset_import[0].version = 11
    with pytest.raises(onnxtrain.errors.AuthoringError, match="needs opset 12 or later.*imports opset 11"):
        onnxtrain.make_trainable(old, loss="cross_entropy")
    onnxtrain.make_trainable(old, loss="mse")  # the other losses use opset-1 operators
    converted = onnx.version_converter.convert_version(old, 13)
    engine = onnxtrain.load(onnxtrain.make_trainable(converted, loss="cross_entropy", optimizer="sgd",
                                                     learning_rate=LR))
    x, y = np.random.default_rng(0).normal(size=(5, 4)).astype(np.float32), np.array([0, 1, 2, 1, 0])
    w = torch.full((4, 3), 0.1, requires_grad=True)
    expected = F.cross_entropy(torch.from_numpy(x) @ w, torch.from_numpy(y))
    expected.backward()
    np.testing.assert_allclose(float(engine.train_step({"X": x, "target": y})["loss"]), expected.item(), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(engine.state["W"]), (w - LR * w.grad).detach().numpy(), rtol=1e-6)


def test_cross_entropy_over_the_last_axis_with_ignored_labels_matches_pytorch():
    """[B, S, V] scores with [B, S] labels (class_axis=-1), -100 ignored by default: mean over the other labels, as
    F.cross_entropy(scores.transpose(1, 2), labels); its gradient too (one SGD step)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(3)
    w = rng.normal(size=(4, 6)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["X", "W"], ["Y"])], "lm",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["B", "S", 4])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["B", "S", 6])], [numpy_helper.from_array(w, "W")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    trainable = onnxtrain.make_trainable(model, loss="cross_entropy", class_axis=-1, optimizer="sgd",
                                         learning_rate=LR)  # ignore_index: torch's -100 by default
    target_type = trainable.training_info[0].algorithm.input[0].type.tensor_type
    assert [d.dim_param for d in target_type.shape.dim] == ["B", "S"]
    x = rng.normal(size=(2, 5, 4)).astype(np.float32)
    labels = rng.integers(0, 6, size=(2, 5)).astype(np.int64)
    labels[0, 1:4] = -100
    loss = onnxtrain.load(trainable).train_step({"X": x, "target": labels})["loss"]
    weight = torch.from_numpy(w).requires_grad_()
    expected = F.cross_entropy((torch.from_numpy(x) @ weight).transpose(1, 2), torch.from_numpy(labels))
    expected.backward()
    np.testing.assert_allclose(float(loss), expected.item(), rtol=1e-6)
    engine = onnxtrain.load(trainable)
    engine.train_step({"X": x, "target": labels})
    np.testing.assert_allclose(np.asarray(engine.state["W"]), w - LR * weight.grad.numpy(), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("opset", [17, 18])  # ReduceMean's axes: an attribute, then an input
@pytest.mark.parametrize("class_axis, ignore_index", [(1, None), (-1, -100), (1, 2)])
def test_label_smoothing_trains_as_pytorchs(opset, class_axis, ignore_index):
    """label_smoothing=0.1 as F.cross_entropy's: (1 - e) nll + e mean(-log_softmax) over the classes, both averaged
    over the labels that are not ignored; losses and weights over three SGD steps."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(opset + class_axis)
    w = rng.normal(size=(6, 5)).astype(np.float32)
    rows = [3, 4] if class_axis == -1 else [3]
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["X", "W"], ["Y"])], "scores",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [*rows, 6])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [*rows, 5])], [numpy_helper.from_array(w, "W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    engine = onnxtrain.load(onnxtrain.make_trainable(
        model, loss="cross_entropy", optimizer="sgd", learning_rate=0.5, label_smoothing=0.1,
        **({"class_axis": -1} if class_axis == -1 else {}), **({} if ignore_index is None else
                                                                {"ignore_index": ignore_index})))
    x = rng.normal(size=(*rows, 6)).astype(np.float32)
    labels = np.array([0, 2, 4] if class_axis == 1 else [[0, 1, 2, 3], [4, 0, 1, 2], [3, 4, 0, 1]], np.int64)
    labels.flat[1] = -100 if ignore_index is None else ignore_index  # None: torch's default, -100
    weight = torch.from_numpy(w.copy()).requires_grad_()
    optimizer = torch.optim.SGD([weight], lr=0.5)
    for _ in range(3):
        loss = float(engine.train_step({"X": x, "target": labels})["loss"])
        optimizer.zero_grad()
        scores = torch.from_numpy(x) @ weight
        expected = F.cross_entropy(scores.reshape(-1, 5), torch.from_numpy(labels).reshape(-1), label_smoothing=0.1,
                                   ignore_index=-100 if ignore_index is None else ignore_index)
        expected.backward()
        optimizer.step()
        np.testing.assert_allclose(loss, expected.item(), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(engine.state["W"]), weight.detach().numpy(), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_a_batch_whose_labels_are_all_ignored_leaves_the_weights_as_pytorchs(label_smoothing):
    """Every label -100 (a Hugging Face batch of prompts alone): torch's loss is 0 / 0, NaN, and its gradient zero,
    so an SGD step keeps the weights. The gradient had been NaN (1 / 0 times zero gradients) and the step made
    every weight NaN."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(3)
    w = rng.normal(size=(6, 5)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["X", "W"], ["Y"])], "scores",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [2, 3, 6])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [2, 3, 5])], [numpy_helper.from_array(w, "W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    engine = onnxtrain.load(onnxtrain.make_trainable(model, loss="cross_entropy", class_axis=-1, optimizer="sgd",
                                                     learning_rate=0.5, label_smoothing=label_smoothing))
    x, labels = rng.normal(size=(2, 3, 6)).astype(np.float32), np.full((2, 3), -100, np.int64)
    loss = float(engine.train_step({"X": x, "target": labels})["loss"])
    weight = torch.from_numpy(w.copy()).requires_grad_()
    expected = F.cross_entropy((torch.from_numpy(x) @ weight).reshape(-1, 5), torch.from_numpy(labels).reshape(-1),
                               label_smoothing=label_smoothing)
    expected.backward()
    assert np.isnan(loss) and np.isnan(expected.item())
    np.testing.assert_array_equal(np.asarray(engine.state["W"]), w - 0.5 * weight.grad.numpy())


@pytest.mark.parametrize("options, message", [
    ({"loss": "mse", "label_smoothing": 0.1}, "label_smoothing apply to loss='cross_entropy', not 'mse'"),
    ({"loss": "cross_entropy", "label_smoothing": 1.5}, r"label_smoothing must be a number in \[0, 1\], got 1.5"),
    ({"loss": "cross_entropy", "label_smoothing": "0.1"}, "label_smoothing must be a number"),
])
def test_a_wrong_label_smoothing_is_refused(options, message):
    with pytest.raises(onnxtrain.errors.AuthoringError, match=message):
        onnxtrain.make_trainable(linear_model(), **options)


def test_a_trainable_pattern_that_is_no_regular_expression_is_an_authoring_error():
    from onnxtrain.errors import AuthoringError

    with pytest.raises(AuthoringError, match=r"trainable 'W\(' is not a regular expression"):
        onnxtrain.make_trainable(linear_model(), trainable="W(")


def model_with_outputs(*names: str) -> onnx.ModelProto:
    """Z = X W, and outputs `names` among Z, loss = mean(Z^2) and target = 2 Z (what a module returning a dict
    {"loss": ..., "target": ...} exports under its keys)."""
    from onnx import TensorProto, helper, numpy_helper

    nodes = [helper.make_node("MatMul", ["X", "W"], ["Z"]), helper.make_node("Mul", ["Z", "Z"], ["sq"]),
             helper.make_node("ReduceMean", ["sq"], ["loss"], keepdims=0),
             helper.make_node("Add", ["Z", "Z"], ["target"])]
    shapes = {"Z": [2, 3], "loss": [], "target": [2, 3]}
    graph = helper.make_graph(
        nodes, "m", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, shapes[n]) for n in names],
        [numpy_helper.from_array(np.linspace(-1, 1, 12, dtype=np.float32).reshape(4, 3), "W")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_an_output_named_loss_is_the_loss_and_other_names_of_the_training_graph_are_refused():
    """loss="output:loss" on a 0-d output named "loss" (a Hugging Face model's) trains on it: the SGD step is
    NumPy's. A model value named as one the training graph defines (`target`) would shadow the fed target: refused
    when authoring, not a shape error at the first step."""
    x = np.random.default_rng(0).normal(size=(2, 4)).astype(np.float32)
    model = model_with_outputs("loss", "Z")
    w = onnx.numpy_helper.to_array(model.graph.initializer[0])
    engine = onnxtrain.load(onnxtrain.make_trainable(model, loss="output:loss", optimizer="sgd", learning_rate=0.1))
    loss = float(engine.train_step({"X": x})["loss"])
    z = x @ w
    np.testing.assert_allclose(loss, np.mean(z * z), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(engine.state["W"]), w - 0.1 * x.T @ (2 * z / z.size), rtol=1e-5)
    with pytest.raises(onnxtrain.errors.AuthoringError, match=r"already has values named \['loss', 'target'\]"):
        onnxtrain.make_trainable(model_with_outputs("Z", "target"), loss="mse")


def test_an_output_named_loss_in_train_mode_is_the_loss_of_the_train_mode_copy():
    """from_torch(hf_model, ..., kwargs={"labels": ...}, loss="output:loss", train_mode=True), as the README pairs
    them, was refused: the training graph computed its own `loss` from the train-mode copy's, beside the model's
    eval-mode output `loss`. The copy's 0-d `train/loss` is the algorithm's loss now (what fit logs), the model's
    `loss` staying what infer computes: NumPy's mean(Z^2) without the Dropout."""
    def with_dropout(loss_name: str) -> onnx.ModelProto:
        model = model_with_outputs("loss", "Z")
        model.graph.node[0].output[0] = "Z.in"  # Z = Dropout(X W): a train-mode export's
        model.graph.node.insert(1, onnx.helper.make_node("Dropout", ["Z.in"], ["Z"]))
        model.graph.node[3].output[0] = model.graph.output[0].name = loss_name
        return model

    x = np.random.default_rng(0).normal(size=(2, 4)).astype(np.float32)
    model = onnxtrain.make_trainable(with_dropout("loss"), loss="output:loss", optimizer="sgd", train_mode=True)
    assert model.training_info[0].algorithm.output[0].name == "train/loss"
    engine = onnxtrain.load(model)
    assert onnxtrain.loop.loss_output(engine) == "train/loss"
    z = x @ onnx.numpy_helper.to_array(model.graph.initializer[0])
    np.testing.assert_allclose(float(engine.infer({"X": x})["loss"]), np.mean(z * z), rtol=1e-6)
    # the Dropout (ratio 0.5) drops in the train step: its loss is another number
    trained = float(engine.train_step({"X": x})["train/loss"])
    assert np.isfinite(trained) and abs(trained - np.mean(z * z)) > 1e-3
    renamed = onnxtrain.make_trainable(with_dropout("model_loss"), loss="output:model_loss", train_mode=True)
    assert np.isfinite(float(onnxtrain.load(renamed).train_step({"X": x})["loss"]))


def skl2onnx_mlp_classifier(zipmap: bool = False) -> onnx.ModelProto:
    """An MLPClassifier(hidden_layer_sizes=(5,)) of 3 classes as skl2onnx 1.20 converts it: its outputs are the
    label (int64) and the probabilities, Softmax of the scores `add_result1` (through an Identity), which no
    output or value_info declares; or, by default (`zipmap`), a ZipMap's list of {class: probability} maps."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(3)
    nodes = [helper.make_node("MatMul", ["X", "coefficient"], ["mul_result"]),
             helper.make_node("Add", ["mul_result", "intercepts"], ["add_result"]),
             helper.make_node("Relu", ["add_result"], ["next_activations"]),
             helper.make_node("MatMul", ["next_activations", "coefficient1"], ["mul_result1"]),
             helper.make_node("Add", ["mul_result1", "intercepts1"], ["add_result1"]),
             helper.make_node("Softmax", ["add_result1"], ["out_activations_result"], name="Relu1"),
             helper.make_node("Identity", ["out_activations_result"], ["probabilities"]),
             helper.make_node("ArgMax", ["probabilities"], ["label"], axis=1, keepdims=0)]
    outputs = [helper.make_tensor_value_info("label", TensorProto.INT64, ["N"]),
               helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, ["N", 3])]
    if zipmap:
        nodes.append(helper.make_node("ZipMap", ["probabilities"], ["output_probability"], domain="ai.onnx.ml",
                                      classlabels_int64s=[0, 1, 2]))
        outputs[1] = helper.make_value_info("output_probability", helper.make_sequence_type_proto(
            helper.make_map_type_proto(TensorProto.INT64, helper.make_tensor_type_proto(TensorProto.FLOAT, []))))
    weights = {"coefficient": rng.normal(size=(4, 5)), "intercepts": rng.normal(size=5),
               "coefficient1": rng.normal(size=(5, 3)), "intercepts1": rng.normal(size=3)}
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 4])],
                              outputs, [numpy_helper.from_array(w.astype(np.float32), n) for n, w in weights.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.onnx.ml", 1)])


def test_a_converted_classifier_trains_on_the_scores_before_its_softmax():
    """A classifier converter's outputs are a label and probabilities; cross_entropy takes logits, so on the
    probabilities it applies its softmax again and trains toward another loss (skl2onnx's MLPClassifier: 1.14
    against the log-loss's 1.36), as torch's would on such a module: warned, naming the Softmax's input. That
    input, which no output declares, is a prediction (its type inferred): two SGD steps are NumPy's gradient of
    the log-loss."""
    model = skl2onnx_mlp_classifier()
    with pytest.warns(UserWarning, match=r"prediction 'probabilities' holds probabilities, the output of Softmax "
                      r"'Relu1': .* name its input: prediction='add_result1'"):
        onnxtrain.make_trainable(model, loss="cross_entropy", prediction="probabilities")
    engine = onnxtrain.load(onnxtrain.make_trainable(model, loss="cross_entropy", prediction="add_result1",
                                                     optimizer="sgd", learning_rate=0.5))
    rng = np.random.default_rng(4)
    x, y = rng.normal(size=(6, 4)).astype(np.float32), rng.integers(0, 3, 6)
    w0, b0, w1, b1 = (onnx.numpy_helper.to_array(t).astype(np.float64) for t in model.graph.initializer)
    for _ in range(2):
        loss = float(engine.train_step({"X": x, "target": y})["loss"])
        pre = x @ w0 + b0
        h = np.maximum(pre, 0)
        z = h @ w1 + b1
        p = np.exp(z - z.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        np.testing.assert_allclose(loss, -np.mean(np.log(p[np.arange(6), y])), rtol=1e-5)
        dz = (p - np.eye(3)[y]) / 6
        dh = dz @ w1.T * (pre > 0)
        w0, b0, w1, b1 = w0 - 0.5 * x.T @ dh, b0 - 0.5 * dh.sum(0), w1 - 0.5 * h.T @ dz, b1 - 0.5 * dz.sum(0)
    for name, expected in zip(["coefficient", "intercepts", "coefficient1", "intercepts1"], [w0, b0, w1, b1]):
        np.testing.assert_allclose(np.asarray(engine.state[name]), expected, rtol=1e-4, atol=1e-6)


def skl2onnx_binary_classifier(normalized: bool) -> onnx.ModelProto:
    """A binary linear classifier as skl2onnx 1.20 converts it for float64 inputs (zipmap=False): SGDClassifier's
    (MLPClassifier's alike) probabilities are Concat(Sub(1, p), p) of p = Sigmoid(score), its one score [N, 1];
    LogisticRegression's (`normalized`) are its one-vs-rest sigmoids normalized, Div(p, ReduceSum(Abs(p))), of
    scores [-z, z] (coefficients stored negated in the first column)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(8)
    coef, intercept = rng.normal(size=(4, 1)), rng.normal(size=(1, 1))
    if normalized:
        coef, intercept = np.concatenate([-coef, coef], 1), np.concatenate([-intercept, intercept], 1)
        tail = [helper.make_node("Sigmoid", ["score"], ["raw_scoressig"]),
                helper.make_node("Abs", ["raw_scoressig"], ["norm_abs"]),
                helper.make_node("ReduceSum", ["norm_abs", "axis"], ["norm"], keepdims=1),
                helper.make_node("Div", ["raw_scoressig", "norm"], ["probabilities"])]
    else:
        tail = [helper.make_node("Sigmoid", ["score"], ["sigmoid"]),
                helper.make_node("Sub", ["unity", "sigmoid"], ["sigmo_0"]),
                helper.make_node("Concat", ["sigmo_0", "sigmoid"], ["probabilities"], axis=1)]
    nodes = [helper.make_node("MatMul", ["X", "coef"], ["matmul_result"]),
             helper.make_node("Add", ["matmul_result", "intercept"], ["score"]), *tail,
             helper.make_node("ArgMax", ["probabilities"], ["label"], axis=1, keepdims=0)]
    graph = helper.make_graph(
        nodes, "linear", [helper.make_tensor_value_info("X", TensorProto.DOUBLE, ["N", 4])],
        [helper.make_tensor_value_info("label", TensorProto.INT64, ["N"]),
         helper.make_tensor_value_info("probabilities", TensorProto.DOUBLE, ["N", 2])],
        [numpy_helper.from_array(coef, "coef"), numpy_helper.from_array(intercept, "intercept"),
         numpy_helper.from_array(np.ones((), np.float64), "unity"), numpy_helper.from_array(np.array([1]), "axis")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)])


@pytest.mark.parametrize("loss", ["cross_entropy", "bce_logits"])
@pytest.mark.parametrize("normalized", [False, True])
def test_a_converted_binary_classifiers_probabilities_are_told_from_logits(normalized, loss):
    """skl2onnx's binary classifiers write their probabilities as Concat(1 - sigmoid, sigmoid) or as sigmoids
    normalized by their sum, which the warning about a logit loss on probabilities had not told (it looked through
    Identity alone): a cross-entropy on them trained toward another loss, unwarned. The warning names the sigmoid's
    input and bce_logits; the one score trained so is NumPy's logistic regression (one SGD step)."""
    model = skl2onnx_binary_classifier(normalized)
    hint = "$" if loss == "bce_logits" else ", loss='bce_logits'"
    with pytest.warns(UserWarning, match=r"prediction 'probabilities' holds probabilities, the output of Sigmoid "
                      r".* name its input: prediction='score'" + hint):
        onnxtrain.make_trainable(model, loss=loss, prediction="probabilities")
    if normalized or loss != "bce_logits":
        return
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainable = onnxtrain.make_trainable(model, loss="bce_logits", prediction="score", optimizer="sgd",
                                             learning_rate=0.5)
    x, y = np.random.default_rng(9).normal(size=(6, 4)), np.array([[0.0], [1], [1], [0], [1], [0]])
    w, b = (onnx.numpy_helper.to_array(t) for t in model.graph.initializer[:2])
    engine = onnxtrain.load(trainable)
    loss_value = float(engine.train_step({"X": x, "target": y})["loss"])
    p = 1 / (1 + np.exp(-(x @ w + b)))
    np.testing.assert_allclose(loss_value, -np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)), rtol=1e-10)
    np.testing.assert_allclose(np.asarray(engine.state["coef"]), w - 0.5 * x.T @ (p - y) / 6, rtol=1e-10)


def test_a_logit_loss_on_a_concat_of_other_values_is_not_warned_about():
    """Concat and Div hand probabilities on only in skl2onnx's forms (Sub(1, p) beside p; p over a ReduceSum):
    a Sigmoid's output concatenated with another feature is no probabilities of classes."""
    from onnx import TensorProto, helper

    model = skl2onnx_binary_classifier(normalized=False)
    graph = model.graph
    graph.node[3].CopyFrom(helper.make_node("Mul", ["unity", "sigmoid"], ["sigmo_0"]))
    assert [n.op_type for n in graph.node][2:5] == ["Sigmoid", "Mul", "Concat"]
    assert graph.output[1].type.tensor_type.elem_type == TensorProto.DOUBLE
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        onnxtrain.make_trainable(model, loss="cross_entropy", prediction="probabilities")


def test_a_converters_maps_or_attribute_weights_say_what_to_convert_instead():
    """skl2onnx's default classifier output is a ZipMap's list of maps, and its float32 LinearRegressor and
    LinearClassifier hold their coefficients as attributes, which no gradient reaches: the errors say so (they had
    said "is not a tensor" and "no parameter matches None (float initializers: [])")."""
    from onnx import TensorProto, helper

    with pytest.raises(onnxtrain.errors.AuthoringError, match=r"'output_probability' is a sequence_type, not a "
                       r"tensor; .*a ZipMap's list of \{class: probability\} maps: convert with .*'zipmap': False"):
        onnxtrain.make_trainable(skl2onnx_mlp_classifier(zipmap=True), loss="cross_entropy",
                                 prediction="output_probability")
    graph = helper.make_graph(
        [helper.make_node("LinearRegressor", ["X"], ["variable"], domain="ai.onnx.ml", coefficients=[0.5, -1.0],
                          intercepts=[0.25])],
        "linreg", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 2])],
        [helper.make_tensor_value_info("variable", TensorProto.FLOAT, ["N", 1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.onnx.ml", 1)])
    with pytest.raises(onnxtrain.errors.AuthoringError, match=r"its weights are attributes of its ai.onnx.ml nodes "
                       r"\(LinearRegressor\), which ONNX's Gradient does not differentiate.*float64"):
        onnxtrain.make_trainable(model, loss="mse")


def test_sparse_weights_say_they_are_not_trained():
    """A model whose only float weights are sparse initializers had been told "no parameter matches None (float
    initializers: [])"."""
    from onnx import TensorProto, helper

    values = helper.make_tensor("W", TensorProto.FLOAT, [2], [0.5, -1.0])
    indices = helper.make_tensor("W_indices", TensorProto.INT64, [2], [0, 3])
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["X", "W"], ["Y"])], "sparse",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 2])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", 2])],
        sparse_initializer=[helper.make_sparse_tensor(values, indices, [2, 2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(onnxtrain.errors.AuthoringError, match=r"its float weights \['W'\] are sparse initializers, "
                       r"which make_trainable does not train: store them as dense initializers"):
        onnxtrain.make_trainable(model, loss="mse")


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_an_export_without_its_weights_says_to_export_them(dynamo, tmp_path):
    """torch.onnx.export(..., export_params=False) leaves the weights out: TorchScript's exporter as graph inputs,
    the dynamo exporter's file reading them undefined. make_trainable had said "no parameter matches None (float
    initializers: [])", and, naming the weights, that they are no initializers of a PyTorch export without
    dynamo=True, optimize=False; both now name export_params. The export with them trains (the zoo's tests)."""
    path = tmp_path / "m.onnx"
    torch.onnx.export(mlp(), (torch.zeros(2, 4),), path, dynamo=dynamo, export_params=False, input_names=["X"])
    model = onnx.load(path)
    assert not model.graph.initializer
    with pytest.raises(onnxtrain.errors.AuthoringError, match="no parameter matches None .*export_params=False"):
        onnxtrain.make_trainable(model)
    if not dynamo:
        assert {"0.weight", "2.bias"} <= {i.name for i in model.graph.input}
        with pytest.raises(onnxtrain.errors.AuthoringError, match=r"\['0.weight'\] are graph inputs .*export_params"):
            onnxtrain.make_trainable(model, trainable=["0.weight"])


def test_a_float64_model_trains_with_a_float64_loss():
    """skl2onnx converts a LinearRegression for float64 inputs to MatMul and Add of float64 initializers (for
    float32, a LinearRegressor holding them as attributes): its loss is float64, which the training graph had
    declared float, refused at the first step ("output 'loss' ... is declared float but computes double"). Two SGD
    steps are NumPy's, in float64."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(7)
    coef, intercept = rng.normal(size=(3, 1)), rng.normal(size=1)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["X", "coef"], ["multiplied"]),
         helper.make_node("Add", ["multiplied", "intercept"], ["variable"])], "linreg",
        [helper.make_tensor_value_info("X", TensorProto.DOUBLE, ["N", 3])],
        [helper.make_tensor_value_info("variable", TensorProto.DOUBLE, ["N", 1])],
        [numpy_helper.from_array(coef, "coef"), numpy_helper.from_array(intercept, "intercept")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    engine = onnxtrain.load(onnxtrain.make_trainable(model, loss="mse", optimizer="sgd", learning_rate=0.25))
    x, t = rng.normal(size=(8, 3)), rng.normal(size=(8, 1))
    rate = float(np.float32(0.25))  # the rate is fed as a float32
    for _ in range(2):
        loss = engine.train_step({"X": x, "target": t})["loss"]
        z = x @ coef + intercept
        assert np.asarray(loss).dtype == np.float64
        np.testing.assert_allclose(float(loss), np.mean((z - t) ** 2), rtol=1e-12)
        dz = 2 * (z - t) / z.size
        coef, intercept = coef - rate * x.T @ dz, intercept - rate * dz.sum(0)
    np.testing.assert_allclose(np.asarray(engine.state["coef"]), coef, rtol=1e-12)
    np.testing.assert_allclose(np.asarray(engine.state["intercept"]), intercept, rtol=1e-12)


@pytest.mark.parametrize("dtype", [np.float64, np.float16])
def test_label_smoothing_keeps_a_half_or_double_models_loss_type(dtype):
    """The smoothed cross-entropy sums in float32 (float64 for a float64 model) and returns the scores' type, as
    the loss without smoothing does: the loss had been float32 whatever the scores, which a training graph
    declaring the prediction's type refused at the first step. The loss and one SGD step against torch's
    cross_entropy(label_smoothing=0.1) on the same scores, in float64 (float16: torch in float32 from the same
    float16 weights, to float16's precision)."""
    from onnx import helper, numpy_helper

    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    rng = np.random.default_rng(4)
    w = rng.normal(size=(6, 5)).astype(dtype)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["X", "W"], ["Y"])], "scores",
        [helper.make_tensor_value_info("X", elem, [4, 6])], [helper.make_tensor_value_info("Y", elem, [4, 5])],
        [numpy_helper.from_array(w, "W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    engine = onnxtrain.load(onnxtrain.make_trainable(model, loss="cross_entropy", optimizer="sgd",
                                                     learning_rate=0.5, label_smoothing=0.1))
    x, labels = rng.normal(size=(4, 6)).astype(dtype), np.array([0, 1, -100, 4])
    loss = engine.train_step({"X": x, "target": labels})["loss"]
    wide = np.float64 if dtype == np.float64 else np.float32
    weight = torch.from_numpy(w.astype(wide)).requires_grad_()
    expected = F.cross_entropy(torch.from_numpy(x.astype(wide)) @ weight, torch.from_numpy(labels),
                               label_smoothing=0.1)
    expected.backward()
    tolerance = 1e-12 if dtype == np.float64 else 2e-3
    assert np.asarray(loss).dtype == dtype
    np.testing.assert_allclose(float(loss), expected.item(), rtol=tolerance)
    np.testing.assert_allclose(np.asarray(engine.state["W"], wide), w - np.float32(0.5) * weight.grad.numpy(),
                               rtol=tolerance, atol=tolerance)
