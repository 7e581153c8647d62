"""make_trainable(train_mode=True): a PyTorch export trains as `module.train()` does, checked against PyTorch."""

from __future__ import annotations

import dataclasses
import io
import warnings

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper
import pytest
import torch

import onnxtrain
from onnxtrain.errors import AuthoringError, FeedError, OnnxTrainError
from onnxtrain.lower import registry

BATCH, CLASSES = 8, 5


class ResNetLike(torch.nn.Module):
    """conv-bn-relu, a residual block of two conv-bn (a grouped convolution, then a depthwise one whose BatchNorm
    has MobileNet's eps 1e-3 and momentum 0.01), global average pool, linear."""

    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.stem = torch.nn.Sequential(torch.nn.Conv2d(3, 6, 3, padding=1), torch.nn.BatchNorm2d(6), torch.nn.ReLU())
        self.conv1, self.bn1 = torch.nn.Conv2d(6, 6, 3, padding=1, groups=2), torch.nn.BatchNorm2d(6, momentum=0.3)
        self.conv2 = torch.nn.Conv2d(6, 6, 3, padding=1, groups=6)
        self.bn2 = torch.nn.BatchNorm2d(6, eps=1e-3, momentum=0.01)
        self.dropout = torch.nn.Dropout(dropout)
        self.fc = torch.nn.Linear(6, CLASSES)

    def forward(self, x):
        h = self.stem(x)
        r = self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(h)))))
        h = torch.relu(h + r)
        return self.fc(self.dropout(h.mean(dim=(2, 3))))


def data(steps: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [((rng.normal(size=(BATCH, 3, 8, 8)) * 2 + 1).astype(np.float32),
             rng.integers(0, CLASSES, BATCH).astype(np.int64)) for _ in range(steps)]


def module(dropout: float = 0.0) -> ResNetLike:
    torch.manual_seed(0)
    m = ResNetLike(dropout)
    with torch.no_grad():  # running statistics away from their (0, 1) start, so that using them shows
        for bn in (m.stem[1], m.bn1, m.bn2):
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 2.0)
            # distinct values: TorchScript's export shares equal initializers (all-ones scales), tying them
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-0.5, 0.5)
    return m


EXPORTS = {
    # the default exports fold eval-mode BatchNorm into the Conv before it: these flags keep it
    "torchscript-eval": dict(dynamo=False, do_constant_folding=False),
    "torchscript-train": dict(dynamo=False, training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False),
    "dynamo-eval": dict(dynamo=True, optimize=False),
}


def export(m: torch.nn.Module, how: str, **flags) -> onnx.ModelProto:
    m.train(how.endswith("train"))
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(m, (torch.zeros(BATCH, 3, 8, 8),), f, input_names=["x"], output_names=["logits"],
                          opset_version=18, **{**EXPORTS.get(how, {}), **flags})
    m.eval()
    return onnx.load_from_string(f.getvalue())


def torch_training(m: torch.nn.Module, batches, optimizer: str, lr: float) -> list[float]:
    m.train()
    opt = torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9 if optimizer == "momentum" else 0.0)
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(m(torch.from_numpy(x)), torch.from_numpy(y))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    m.eval()
    return losses


@pytest.mark.parametrize("how,optimizer,remat", [("torchscript-eval", "sgd", False), ("dynamo-eval", "momentum", False),
                                                 ("torchscript-train", "momentum", False),
                                                 ("dynamo-eval", "sgd", True)])  # running statistics from segments
def test_trains_like_torch_train_mode(how, optimizer, remat, tmp_path):
    batches, lr = data(5), 0.1
    m = module()
    model = onnxtrain.make_trainable(export(m, how), loss="cross_entropy", optimizer=optimizer, learning_rate=lr,
                                     train_mode=True)
    engine = onnxtrain.load(model, remat=remat)
    losses = [float(engine.train_step({"x": x, "target": y})["loss"]) for x, y in batches]
    expected = torch_training(m, batches, optimizer, lr)
    np.testing.assert_allclose(losses, expected, rtol=1e-4)
    for name, buffer in m.state_dict().items():
        if "running" in name:
            np.testing.assert_allclose(np.asarray(engine.state[name]), buffer.numpy(), rtol=1e-4, atol=1e-6,
                                       err_msg=name)
    # inference: the updated running statistics, as torch's eval() uses them
    x = batches[0][0]
    with torch.no_grad():
        reference = m(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(np.asarray(engine.infer({"x": x})["logits"]), reference, rtol=1e-4, atol=1e-5)
    path = tmp_path / "trained.onnx"
    engine.export(path)
    exported = onnx.load(path)
    batch_norms = [n for n in exported.graph.node if n.op_type == "BatchNormalization"]
    assert batch_norms and all(onnx.helper.get_attribute_value(a) == 0 for n in batch_norms for a in n.attribute
                               if a.name == "training_mode")
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(session.run(["logits"], {"x": x})[0], reference, rtol=1e-4, atol=1e-5)


def test_a_fresh_torchscript_export_shares_no_running_statistics():
    """TorchScript's export shares equal initializers: a fresh model's BatchNorms read one zero mean and one unit
    variance through Identity nodes. Each still gets and updates its own running statistics."""
    m = ResNetLike()
    model = export(m, "torchscript-eval")
    assert any(n.op_type == "Identity" for n in model.graph.node)
    engine = onnxtrain.load(onnxtrain.make_trainable(model, loss="cross_entropy", optimizer="sgd", train_mode=True))
    (x, y), = data(1)
    engine.train_step({"x": x, "target": y})
    torch_training(m, [(x, y)], "sgd", 1e-3)
    for name, buffer in m.state_dict().items():
        if "running" in name:
            np.testing.assert_allclose(np.asarray(engine.state[name]), buffer.numpy(), rtol=1e-4, atol=1e-6)


def test_dropout_drops_in_train_steps_only():
    m = module(dropout=0.5)
    model = onnxtrain.make_trainable(export(m, "torchscript-train"), loss="cross_entropy", optimizer="sgd",
                                     learning_rate=0.0, train_mode=True)
    assert any(n.op_type == "Dropout" for n in model.graph.node)
    engine = onnxtrain.load(model)
    (x, y), = data(1)
    with torch.no_grad():
        reference = m(torch.from_numpy(x)).numpy()  # eval: no dropout, running statistics
    for _ in range(2):
        np.testing.assert_allclose(np.asarray(engine.infer({"x": x})["logits"]), reference, rtol=1e-4, atol=1e-5)
    # with a zero learning rate only the dropout masks (and the running statistics) change between steps;
    # the loss without dropping, on batch statistics, is torch's train-mode loss with dropout off
    m.train()
    m.dropout.p = 0.0
    with torch.no_grad():
        undropped = float(torch.nn.functional.cross_entropy(m(torch.from_numpy(x)), torch.from_numpy(y)))
    losses = [float(engine.train_step({"x": x, "target": y})["loss"]) for _ in range(3)]
    assert all(abs(loss - undropped) > 1e-3 for loss in losses) and len(set(losses)) == 3


@pytest.mark.parametrize("how", ["torchscript-train", "dynamo-eval"])
def test_a_train_step_returns_the_training_pass_outputs_and_computes_no_eval_forward(how):
    """A train step returns the inference graph's outputs too. With train_mode they had been an eval-mode forward
    pass computed beside the training one (whose Dropouts, lacking a training_mode input, dropped as well, so
    they were neither pass). They are the training pass's now, as `model(x)` in a PyTorch loop under train():
    PyTorch's train-mode logits before the update (batch statistics), the loss the cross-entropy of those very
    logits (the same Dropout mask), and the compiled step holds one forward pass, not two."""
    m = module(dropout=0.5 if how.endswith("train") else 0.0)
    exported = export(m, how)
    (x, y), = data(1)
    engine = onnxtrain.load(onnxtrain.make_trainable(exported, loss="cross_entropy", optimizer="sgd",
                                                     learning_rate=0.1, train_mode=True))
    outputs = engine.train_step({"x": x, "target": y})
    logits = np.asarray(outputs["logits"], np.float64)
    np.testing.assert_array_equal(logits, np.asarray(outputs["train/logits"]))
    log_prob = logits - np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1, keepdims=True)) \
        - logits.max(1, keepdims=True)
    np.testing.assert_allclose(float(outputs["loss"]), -log_prob[np.arange(BATCH), y].mean(), rtol=1e-5)
    if not how.endswith("train"):  # no Dropout: PyTorch's train-mode forward pass itself
        with torch.no_grad():
            expected = m.train()(torch.from_numpy(x)).numpy()
        m.eval()
        np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-5)
        return
    # without train_mode the train-mode export trains as exported (batch statistics, dropping, no running
    # statistics): one training forward pass and its gradients, and the step with train_mode computes as much
    # more as its running statistics' updates, where the eval-mode forward pass added an inference's flops
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "normalize with the batch's statistics ... export ... in eval() mode"
        plain = onnxtrain.load(onnxtrain.make_trainable(exported, loss="cross_entropy", optimizer="sgd"))

    def flops(e: onnxtrain.Engine, algorithm: int | None = 0) -> float:
        feeds = {"x": x, "target": y} if algorithm is not None else {"x": x}
        return e.lower(feeds, algorithm=algorithm).compile().cost_analysis()["flops"]

    assert flops(engine) < flops(plain) + 0.1 * flops(engine, algorithm=None)


def test_a_train_step_returns_the_training_pass_outputs_once_from_its_executable():
    """A train step returns each training-pass output under its name and under the copy's, `train/NAME`. The step
    had returned the one value under both names from its jitted function, which XLA gives two buffers (a copy a
    step: an LM's logits, its largest output, twice in memory); the engine now adds the second name itself. The
    values are PyTorch's train-mode forward pass, and the executable's outputs hold them once beside the state."""
    m = batch_norm_1d()
    x, y = rows(512, 0)  # logits of 10 kB, the state's weights and statistics under 1 kB
    exported = exported_rows(m, 512, dynamo=True, optimize=False)
    engine = onnxtrain.load(onnxtrain.make_trainable(exported, loss="cross_entropy", optimizer="sgd", learning_rate=0.1,
                                                     train_mode=True))
    feeds = {"x": x, "target": y}
    output_bytes = engine.lower(feeds, 0).compile().memory_analysis().output_size_in_bytes
    state_bytes = sum(np.asarray(v).nbytes for v in engine.state.values())
    outputs = engine.train_step(feeds)
    with torch.no_grad():
        expected = m.train()(torch.from_numpy(x)).numpy()
    m.eval()
    np.testing.assert_allclose(np.asarray(outputs["logits"]), expected, rtol=1e-5, atol=1e-6)
    assert output_bytes - state_bytes < 1.5 * expected.nbytes, (output_bytes, state_bytes, expected.nbytes)
    assert outputs["train/logits"] is outputs["logits"]


def test_a_train_step_traces_no_eval_mode_forward_pass(monkeypatch):
    """Nothing reads the inference graph's eval-mode forward pass in a train_mode step, which returns the training
    pass's outputs (copied_outputs). XLA dropped it as dead code, but the step still walked and traced its every
    node: 0.1-0.2 s of a 6-layer BERT's 0.9 s lowering. The step walks the inference graph's nodes it reads alone now
    (ir.live): its trace lowers the training copy's BatchNormalization (batch statistics) and never the eval-mode
    one, which infer lowers, and the step is PyTorch's train() step."""
    key = ("", "BatchNormalization", 15)
    batch_norm = registry.lookup(*key)
    modes = []  # training_mode of each BatchNormalization lowered

    def recorded(*args, **attributes):
        modes.append(attributes["training_mode"])
        return batch_norm.fn(*args, **attributes)

    monkeypatch.setitem(registry._REGISTRY, key, dataclasses.replace(batch_norm, fn=recorded))
    m = batch_norm_1d()
    x, y = rows(16, 0)
    exported = exported_rows(m, 16, dynamo=False, do_constant_folding=False)
    engine = onnxtrain.load(onnxtrain.make_trainable(exported, loss="cross_entropy", optimizer="sgd", learning_rate=0.1,
                                                     train_mode=True))
    for program in (engine._infer, engine._train[0]):
        program.store = lambda: None  # traced here, not read from an earlier process's store
    outputs = engine.train_step({"x": x, "target": y})
    assert modes and set(modes) == {1}
    engine.infer({"x": x})
    assert modes[-1] == 0
    optimizer = torch.optim.SGD(m.train().parameters(), lr=0.1)
    logits = m(torch.from_numpy(x))
    loss = torch.nn.functional.cross_entropy(logits, torch.from_numpy(y))
    loss.backward()
    optimizer.step()
    np.testing.assert_allclose(np.asarray(outputs["logits"]), logits.detach().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(outputs["loss"]), loss.item(), rtol=1e-5)
    for name, value in m.state_dict().items():
        if not name.endswith("num_batches_tracked"):
            np.testing.assert_allclose(np.asarray(engine.state[name]), value.numpy(), rtol=1e-5, atol=1e-6,
                                       err_msg=name)


def test_folded_batch_norm_is_refused_naming_the_export_flags():
    m = module()
    with pytest.raises(OnnxTrainError, match="do_constant_folding=False") as error:
        onnxtrain.make_trainable(export(m, "default", dynamo=True), loss="cross_entropy", train_mode=True)
    assert "export the module in train() mode" in str(error.value)  # an eval-mode export leaves Dropout out


def test_cli_option(tmp_path):
    from onnxtrain.cli import main

    source, target = tmp_path / "model.onnx", tmp_path / "trainable.onnx"
    onnx.save(export(module(), "torchscript-eval"), source)
    main(["make-trainable", str(source), "--loss", "cross_entropy", "--train-mode", "-o", str(target)])
    updated = {b.key for b in onnx.load(target).training_info[0].update_binding}
    assert {"stem.1.running_mean", "bn1.running_var"} <= updated


@pytest.mark.parametrize("train_mode", [False, True])
def test_batch_norm_gradients_as_accurate_as_pytorch(train_mode):
    """Scale and bias gradients against a float64 PyTorch reference: within a few times PyTorch float32's own
    error (its CPU kernels sum in float64; summed in float32 ours were 10-60x further off)."""
    import copy

    m = module()
    model = onnxtrain.make_trainable(export(m, "torchscript-eval"), loss="cross_entropy", optimizer="sgd",
                                     learning_rate=0.0, train_mode=train_mode)
    names = [n for n, _ in m.named_parameters() if n.startswith(("stem.1.", "bn"))]
    model.training_info[0].algorithm.output.extend(  # expose the Gradient node's outputs
        onnx.helper.make_tensor_value_info(f"{n}.grad", onnx.TensorProto.FLOAT, None) for n in names)
    (x, y), = data(1)
    ours = onnxtrain.load(model).train_step({"x": x, "target": y})

    def torch_gradients(dtype):
        reference = copy.deepcopy(m).to(dtype).train(train_mode)
        loss = torch.nn.functional.cross_entropy(reference(torch.from_numpy(x).to(dtype)), torch.from_numpy(y))
        loss.backward()
        return {n: p.grad.double().numpy() for n, p in reference.named_parameters()}

    exact, single = torch_gradients(torch.float64), torch_gradients(torch.float32)
    for n in names:
        error = lambda g: np.max(np.abs(g - exact[n])) / np.max(np.abs(exact[n]))  # noqa: E731
        assert error(np.asarray(ours[f"{n}.grad"])) <= 3 * error(single[n]) + 1e-7, n


def without_running_statistics() -> ResNetLike:
    """bn1 with track_running_stats=False: PyTorch normalizes it with the batch's statistics in eval mode too, and
    the exporters compute them in the graph (ReduceMean nodes feeding the node's mean and variance)."""
    m = module()
    m.bn1 = torch.nn.BatchNorm2d(6, track_running_stats=False)
    with torch.no_grad():
        m.bn1.weight.uniform_(0.5, 1.5)
        m.bn1.bias.uniform_(-0.5, 0.5)
    return m.eval()


@pytest.mark.parametrize("how", ["torchscript-eval", "dynamo-eval"])
def test_batch_norm_without_running_statistics_trains_like_torch(how):
    """It was refused ('the running mean ... is not an initializer'); the training copy keeps it as it is."""
    batches, lr = data(3), 0.1
    m = without_running_statistics()
    model = onnxtrain.make_trainable(export(m, how), loss="cross_entropy", optimizer="sgd", learning_rate=lr,
                                     train_mode=True)
    engine = onnxtrain.load(model)
    losses = [float(engine.train_step({"x": x, "target": y})["loss"]) for x, y in batches]
    np.testing.assert_allclose(losses, torch_training(m, batches, "sgd", lr), rtol=1e-4)
    assert "bn2.running_mean" in engine.state and not any(k.startswith("bn1.running") for k in engine.state)
    x = batches[0][0]
    with torch.no_grad():
        reference = m(torch.from_numpy(x)).numpy()  # eval, on bn1's batch statistics
    np.testing.assert_allclose(np.asarray(engine.infer({"x": x})["logits"]), reference, rtol=1e-4, atol=1e-5)


def test_momentum_none_is_warned():
    """PyTorch's momentum=None (a cumulative average) exports as momentum 1, which leaves the running statistics
    as they are: warned, not trained silently otherwise than PyTorch."""
    m = module()
    m.bn1.momentum = None
    with pytest.warns(UserWarning, match="momentum=None"):
        onnxtrain.make_trainable(export(m, "dynamo-eval"), loss="cross_entropy", train_mode=True)


def test_train_mode_export_without_train_mode_is_warned():
    """A TrainingMode.TRAINING export's BatchNormalizations normalize with batch statistics in infer too."""
    with pytest.warns(UserWarning, match="train_mode=True"):
        onnxtrain.make_trainable(export(module(), "torchscript-train"), loss="cross_entropy")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # statistics computed in the graph (track_running_stats=False) are not
        onnxtrain.make_trainable(export(without_running_statistics(), "torchscript-eval"), loss="cross_entropy")


@pytest.mark.parametrize("flags", [dict(dynamo=False, training=torch.onnx.TrainingMode.TRAINING),
                                   dict(dynamo=False, training=torch.onnx.TrainingMode.PRESERVE),
                                   dict(dynamo=True, optimize=False)], ids=["TRAINING", "PRESERVE", "dynamo"])
def test_train_mode_dropout_without_train_mode_is_warned(flags):
    """A train() module's Dropout is exported with a constant true training_mode, so it drops in infer too (ONNX's
    rule, which onnxtrain follows), while ONNX Runtime's inference and PyTorch's eval() drop nothing: warned, as
    for BatchNorm. A Dropout of ratio 0 (Hugging Face configs that turn dropout off) computes the same either way."""
    x, _ = rows(BATCH, 0)

    def exported(p: float) -> tuple[torch.nn.Module, onnx.ModelProto]:
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Dropout(p), torch.nn.Linear(6, CLASSES)).train()
        f = io.BytesIO()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(m, (torch.from_numpy(x),), f, input_names=["x"], output_names=["logits"],
                              opset_version=18, **flags)
        return m.eval(), onnx.load_from_string(f.getvalue())

    m, model = exported(0.5)
    with pytest.warns(UserWarning, match=r"Dropout \[.*drop .*train_mode=True"):
        trainable = onnxtrain.make_trainable(model, loss="cross_entropy")
    with torch.no_grad():
        reference = m(torch.from_numpy(x)).numpy()
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(session.run(["logits"], {"x": x})[0], reference, rtol=1e-5, atol=1e-6)
    assert not np.allclose(np.asarray(onnxtrain.load(trainable).infer({"x": x})["logits"]), reference, atol=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        onnxtrain.make_trainable(exported(0.0)[1], loss="cross_entropy")


def batch_norm_1d() -> torch.nn.Sequential:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.Linear(6, CLASSES))
    with torch.no_grad():
        m[1].running_mean.uniform_(-0.5, 0.5)
        m[1].running_var.uniform_(0.5, 2.0)
    return m.eval()


def rows(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 4)).astype(np.float32), rng.integers(0, CLASSES, n).astype(np.int64)


def exported_rows(m: torch.nn.Module, batch: int, **flags) -> onnx.ModelProto:
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(m.eval(), (torch.zeros(batch, 4),), f, input_names=["x"], output_names=["logits"],
                          opset_version=18, **flags)
    return onnx.load_from_string(f.getvalue())


@pytest.mark.parametrize("flags", [
    dict(dynamo=False, do_constant_folding=False, dynamic_axes={"x": {0: "batch"}}),
    dict(dynamo=True, optimize=False, dynamic_shapes=({0: torch.export.Dim("batch")},))], ids=["torchscript", "dynamo"])
def test_one_value_per_channel_is_refused_at_the_step(flags):
    """A batch of one into BatchNorm1d ([1, C]) under a dynamic batch: the running variance's n / (n - 1) was 1 / 0,
    which made it NaN for good. PyTorch raises; so does the train step (in its trace), before it changes any state,
    and the batches of 2 after it train as PyTorch's."""
    m = batch_norm_1d()
    x1, y1 = rows(1, 0)
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        m.train()(torch.from_numpy(x1))
    engine = onnxtrain.load(onnxtrain.make_trainable(exported_rows(m, 2, **flags), loss="cross_entropy",
                                                     optimizer="sgd", learning_rate=0.1, train_mode=True))
    before = {name: np.array(value) for name, value in engine.state.items()}
    with pytest.raises(FeedError, match=r"\[1, 6\] input, 1 value\(s\) per channel.*drop_last"):
        engine.train_step({"x": x1, "target": y1})
    for name, value in engine.state.items():
        np.testing.assert_array_equal(np.asarray(value), before[name], err_msg=name)
    batches = [rows(2, seed) for seed in (1, 2, 3)]
    losses = [float(engine.train_step({"x": x, "target": y})["loss"]) for x, y in batches]
    np.testing.assert_allclose(losses, torch_training(m, batches, "sgd", 0.1), rtol=1e-4)
    for name in ("1.running_mean", "1.running_var"):
        np.testing.assert_allclose(np.asarray(engine.state[name]), m.state_dict()[name].numpy(), rtol=1e-4, atol=1e-6)


def test_fixed_batch_of_one_is_refused_at_the_step_and_plain_onnx_is_not():
    """An export that fixes a batch of one is refused at its first train step (make_trainable had run shape
    inference over the whole model to refuse it). ONNX's own BatchNormalization(training_mode=1) takes one value
    per channel: only train_mode's record refuses it."""
    engine = onnxtrain.load(onnxtrain.make_trainable(exported_rows(batch_norm_1d(), 1, dynamo=False),
                                                     loss="cross_entropy", train_mode=True))
    with pytest.raises(FeedError, match="per channel"):
        engine.train_step(dict(zip(["x", "target"], rows(1, 0))))
    h = onnx.helper
    node = h.make_node("BatchNormalization", ["x", "scale", "bias", "mean", "var"],
                       ["y", "running_mean", "running_var"], training_mode=1, momentum=0.75)
    stats = [np.array([0.5, 2.0], np.float32), np.array([1.0, -1.0], np.float32),
             np.array([0.2, 0.3], np.float32), np.array([1.5, 0.5], np.float32)]
    shapes = {"x": [1, 2], "y": [1, 2], "running_mean": [2], "running_var": [2]}
    value = {n: h.make_tensor_value_info(n, onnx.TensorProto.FLOAT, d) for n, d in shapes.items()}
    graph = h.make_graph([node], "bn", [value["x"]], [value[n] for n in node.output],
                         [onnx.numpy_helper.from_array(v, n) for n, v in zip(node.input[1:], stats)])
    x = np.array([[3.0, -4.0]], np.float32)
    outputs = onnxtrain.load(h.make_model(graph, opset_imports=[h.make_opsetid("", 15)])).infer({"x": x})
    scale, bias, mean, var = stats  # the spec's: batch variance 0, running statistics averaged with momentum
    np.testing.assert_allclose(np.asarray(outputs["y"]), bias[None], atol=1e-6)
    np.testing.assert_allclose(np.asarray(outputs["running_mean"]), 0.75 * mean + 0.25 * x[0], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(outputs["running_var"]), 0.75 * var, rtol=1e-6)


def test_momentum_none_trains_the_cumulative_average_through_from_torch():
    """from_torch reads the module: a BatchNorm with momentum=None trains PyTorch's cumulative average (factor
    1 / num_batches_tracked, the count a state variable the step advances), from the count the module has reached;
    its running statistics had stayed as they were (warned, as make_trainable still warns without the module)."""
    m = batch_norm_1d()
    m[1].momentum = None
    m[1].num_batches_tracked.fill_(3)
    batches, lr = [rows(BATCH, seed) for seed in range(5)], 0.1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = onnxtrain.from_torch(m.eval(), (torch.zeros(BATCH, 4),), input_names=["x"], loss="cross_entropy",
                                     optimizer="sgd", learning_rate=lr, train_mode=True)
    assert not [w for w in caught if "momentum" in str(w.message)]
    with pytest.raises(AuthoringError, match=r"BatchNorm \['1'\] \(momentum=None\) is in train mode"):
        onnxtrain.from_torch(m.train(), (torch.zeros(BATCH, 4),), loss="cross_entropy", train_mode=True)
    m.eval()
    assert "1.num_batches_tracked" not in {t.name for t in model.graph.initializer}  # the train step's state alone
    assert "1.num_batches_tracked" in {t.name for t in model.training_info[0].algorithm.initializer}
    engine = onnxtrain.load(model)
    losses = [float(engine.train_step({"x": x, "target": y})["loss"]) for x, y in batches]
    np.testing.assert_allclose(losses, torch_training(m, batches, "sgd", lr), rtol=1e-4)
    for name in ("1.running_mean", "1.running_var", "1.num_batches_tracked"):
        np.testing.assert_allclose(np.asarray(engine.state[name]), m.state_dict()[name].numpy(), rtol=1e-4,
                                   atol=1e-6, err_msg=name)


@pytest.mark.parametrize("layer, warned", [("MatMul", False), ("Conv", True)])
def test_a_model_with_dropout_and_no_batch_norm_is_warned_only_where_a_convolution_could_have_folded_one(
        layer, warned):
    """A transformer has no BatchNorm to lose; a CNN without one may be an export that folded them."""
    weight = np.full((4, 4, 1, 1) if layer == "Conv" else (4, 4), 0.1, np.float32)
    shape = [2, 4, 3, 3] if layer == "Conv" else [2, 4]
    graph = helper.make_graph(
        [helper.make_node(layer, ["x", "w"], ["h"]), helper.make_node("Dropout", ["h", "ratio"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
        [numpy_helper.from_array(weight, "w"), numpy_helper.from_array(np.array(0.1, np.float32), "ratio")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        onnxtrain.make_trainable(model, loss="mse", train_mode=True)
    assert any("no BatchNormalization node" in str(w.message) for w in caught) == warned


def tiny_bert(dropout: float) -> torch.nn.Module:
    """A BertForSequenceClassification of one layer, random weights of seed 0 whatever `dropout`."""
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=16, num_labels=3,
                        hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    torch.manual_seed(0)
    return BertForSequenceClassification(config)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_a_hugging_face_model_s_own_loss_trains_in_train_mode(dropout):
    """from_torch(hf_model, ..., kwargs={"labels": ...}, loss="output:loss", train_mode=True) was refused: the
    training graph's loss, the train-mode copy's, clashed with the model's eval-mode output `loss`. The copy's
    `train/loss` is the algorithm's loss: fit logs it, and without dropout SGD is PyTorch's loop on
    model(**batch).loss (a Dropout of ratio 1e-30 stays in the export and drops nothing). With dropout, the steps
    drop and infer is the trained module's eval()."""
    pytest.importorskip("transformers")
    rng = np.random.default_rng(0)
    batches = [{"input_ids": rng.integers(0, 50, (4, 6)), "labels": rng.integers(0, 3, 4)} for _ in range(3)]
    tensors = [{k: torch.from_numpy(v) for k, v in b.items()} for b in batches]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: "Exporting a model while it is in training mode"
        model = onnxtrain.from_torch(tiny_bert(dropout or 1e-30).train(), (tensors[0]["input_ids"],),
                                     kwargs={"labels": tensors[0]["labels"]}, loss="output:loss", train_mode=True,
                                     optimizer="sgd", learning_rate=0.5)
    engine = onnxtrain.load(model)
    reference = tiny_bert(dropout)
    if not dropout:
        history = onnxtrain.fit(engine, batches, steps=3, log_every=1, progress=False)
        optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
        expected = []
        for feed in tensors:
            optimizer.zero_grad()
            loss = reference(**feed).loss
            loss.backward()
            optimizer.step()
            expected.append(loss.item())
        np.testing.assert_allclose(history.losses, expected, rtol=1e-5)
        return
    outputs = engine.train_step(batches[0])
    with torch.no_grad():
        before = reference.eval()(**tensors[0]).loss.item()
    assert abs(float(outputs["train/loss"]) - before) > 1e-4  # dropped
    np.testing.assert_array_equal(outputs["loss"], outputs["train/loss"])  # the step's `loss` is the training pass's
    history = onnxtrain.fit(engine, batches[1:], steps=2, log_every=1, progress=False)
    assert np.isfinite(history.losses).all()
    onnxtrain.to_torch(engine, reference)
    with torch.no_grad():
        trained = reference.eval()(**tensors[0])
    inferred = engine.infer(batches[0])
    np.testing.assert_allclose(np.asarray(inferred["logits"]), trained.logits.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(inferred["loss"]), trained.loss.item(), rtol=1e-5)
    assert abs(trained.loss.item() - before) > 1e-4  # the weights moved
