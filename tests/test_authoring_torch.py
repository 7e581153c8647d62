"""make_trainable's default trainable set on real exports of both PyTorch exporters (dynamo=True, the default,
and the TorchScript one) trains what PyTorch trains: the loss sequence and the trained model's outputs equal
the same PyTorch loop's. Parameters are first set to distinct values, since exporters merge equal-valued ones
(asserted as a warning separately). Where an exporter changes the parameterisation so that no engine could
match (an untied embedding), the test asserts the warning instead."""

from __future__ import annotations

import io
import warnings

import numpy as np
import onnx
import pytest

import onnxtrain
from onnxtrain.errors import AuthoringError

torch = pytest.importorskip("torch")
F = torch.nn.functional

LR = 0.1
STEPS = 4


class Block(torch.nn.Module):
    """Pre-norm self-attention + tanh-GELU feed-forward: LayerNorm, a scale, the GELU's constants."""

    def __init__(self, d: int = 16, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.ff = torch.nn.Sequential(torch.nn.Linear(d, 2 * d), torch.nn.GELU(approximate="tanh"),
                                      torch.nn.Linear(2 * d, d))
        self.head = torch.nn.Linear(d, 5)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).reshape(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attention = torch.softmax(q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5, dim=-1)
        x = x + self.proj((attention @ v).transpose(1, 2).reshape(b, t, d))
        return self.head(x + self.ff(self.norm2(x)))


class TinyGPT2(torch.nn.Module):
    """transformers' GPT-2 (one layer, tied embedding and LM head) returning the logits [batch, seq, vocab]."""

    def __init__(self, layers: int = 1, heads: int = 2, positions: int = 16, attention_dropout: float = 0.0):
        super().__init__()
        transformers = pytest.importorskip("transformers")
        config = transformers.GPT2Config(n_layer=layers, n_embd=32, n_head=heads, vocab_size=64,
                                         n_positions=positions, resid_pdrop=0.0, embd_pdrop=0.0,
                                         attn_pdrop=attention_dropout)
        self.lm = transformers.GPT2LMHeadModel(config).eval()

    def forward(self, ids):
        # an explicit mask keeps transformers off the packed-sequence check, which TorchScript cannot export
        return self.lm(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits


def perturbed(module: "torch.nn.Module") -> "torch.nn.Module":
    """Every parameter distinct and non-zero (fresh biases are all 0 and norm scales all 1: exporters merge them)."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.2 + 0.05)
    return module.eval()


def export(module, x, exporter: str) -> onnx.ModelProto:
    """exporter: "dynamo" (torch.onnx.export's default), "dynamo-exact" (optimize=False) or "torchscript"."""
    if exporter == "torchscript":
        buffer = io.BytesIO()
        torch.onnx.export(module, (x,), buffer, dynamo=False, input_names=["X"], output_names=["Y"],
                          opset_version=17)
        return onnx.load_from_string(buffer.getvalue())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporter's own deprecation chatter
        program = torch.onnx.export(module, (x,), dynamo=True, optimize=exporter == "dynamo", input_names=["X"],
                                    output_names=["Y"], verbose=False)
    return program.model_proto


def train_both(module, model, x, target, torch_loss, remat=False, **options):
    """STEPS of SGD in PyTorch and in onnxtrain from the same start; the loss sequences and engine."""
    engine = onnxtrain.load(onnxtrain.make_trainable(model, optimizer="sgd", learning_rate=LR, **options),
                            remat=remat)
    losses = [float(engine.train_step({"X": x, "target": target})["loss"]) for _ in range(STEPS)]
    optimizer = torch.optim.SGD(module.parameters(), lr=LR)
    expected = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        value = torch_loss(module(torch.from_numpy(x)), torch.from_numpy(target))
        value.backward()
        optimizer.step()
        expected.append(value.item())
    return losses, expected, engine


def assert_trains_like_pytorch(module, model, x, target, torch_loss, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("error", onnxtrain.ParameterizationWarning)
        losses, expected, engine = train_both(module, model, x, target, torch_loss, **options)
    np.testing.assert_allclose(losses, expected, rtol=1e-4)
    assert expected[-1] < expected[0] - 1e-3  # the steps moved the weights
    with torch.no_grad():
        trained = module(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(np.asarray(engine.infer({"X": x})["Y"]), trained, rtol=1e-4, atol=1e-5)
    for name, p in module.named_parameters():  # those the exporter kept under their own names
        if name in engine.state:
            np.testing.assert_allclose(np.asarray(engine.state[name]), p.detach().numpy(), rtol=1e-4, atol=1e-6,
                                       err_msg=name)


@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
def test_block_with_gelu_and_layernorm_trains_like_pytorch(exporter):
    torch.manual_seed(0)
    module = perturbed(Block())
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 5, 16)).astype(np.float32)
    target = rng.integers(0, 5, size=(2, 5)).astype(np.int64)
    model = export(module, torch.from_numpy(x), exporter)
    assert_trains_like_pytorch(module, model, x, target,
                               lambda y, t: F.cross_entropy(y.transpose(1, 2), t),
                               loss="cross_entropy", class_axis=-1)


@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
def test_mlp_trains_like_pytorch_with_bce(exporter):
    torch.manual_seed(0)
    module = perturbed(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 3)))
    rng = np.random.default_rng(1)
    x = rng.normal(size=(6, 4)).astype(np.float32)
    target = rng.integers(0, 2, size=(6, 3)).astype(np.float32)
    assert_trains_like_pytorch(module, export(module, torch.from_numpy(x), exporter), x, target,
                               F.binary_cross_entropy_with_logits, loss="bce_logits")


def test_one_output_regression_head_trains_its_one_element_bias():
    """Linear(4, 1) on [batch, seq, 4]: the dynamo exporter adds its bias [1] with an Add, where its lifted
    constants are 0-d; the bias is a parameter and trains."""
    torch.manual_seed(0)
    module = perturbed(torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 1)))
    rng = np.random.default_rng(5)
    x = rng.normal(size=(2, 3, 4)).astype(np.float32)
    target = rng.normal(size=(2, 3, 1)).astype(np.float32)
    model = export(module, torch.from_numpy(x), "dynamo")
    assert ("Add", [1]) in [(n.op_type, list(onnx.numpy_helper.to_array(t).shape)) for n in model.graph.node
                            for t in model.graph.initializer if t.name in n.input]
    assert_trains_like_pytorch(module, model, x, target, F.mse_loss, loss="mse")


class Warp(torch.nn.Module):
    """A spatial transformer: a learned affine theta, affine_grid and grid_sample, then an adaptive average pool
    to sizes that do not divide the input's (8 -> 3 x 5: windows of unequal sizes)."""

    def __init__(self):
        super().__init__()
        self.theta, self.identity = torch.nn.Linear(3 * 8 * 8, 6), torch.nn.Parameter(torch.zeros(6))
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.head = torch.nn.Linear(4 * 3 * 5, 5)

    def forward(self, x):
        theta = self.identity + 0.1 * self.theta(x.flatten(1))
        grid = F.affine_grid(theta.view(-1, 2, 3), list(x.shape), align_corners=False)
        warped = F.grid_sample(x, grid, align_corners=False)
        return self.head(F.adaptive_avg_pool2d(torch.tanh(self.conv(warped)), (3, 5)).flatten(1))


def test_affine_grid_and_an_adaptive_pool_train_like_pytorch():
    """The dynamo exporter folds what PyTorch's decompositions compute from shapes alone into initializers:
    affine_grid's base grid [64, 3, 1] and the adaptive pool's window sizes; trained, they changed the model."""
    torch.manual_seed(0)
    module = perturbed(Warp())
    rng = np.random.default_rng(6)
    x = rng.normal(size=(2, 3, 8, 8)).astype(np.float32)
    target = rng.integers(0, 5, size=2).astype(np.int64)
    model = export(module, torch.from_numpy(x), "dynamo")
    assert_trains_like_pytorch(module, model, x, target, F.cross_entropy, loss="cross_entropy")


def lm_batch():
    rng = np.random.default_rng(2)
    ids = rng.integers(0, 64, size=(2, 8)).astype(np.int64)
    labels = np.concatenate([ids[:, 1:], np.full((2, 1), -100)], axis=1)  # next token; HF's -100 at the end
    labels[0, 2] = -100  # and one masked token inside
    return ids, labels


def lm_loss(logits, labels):
    return F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100)


@pytest.mark.parametrize("remat", [False, True])
def test_gpt2_exported_exactly_trains_like_pytorch(remat):
    """dynamo=True, optimize=False keeps GPT-2's tied embedding as one initializer read twice (Gather and the LM
    head's Transpose): its one update is the sum of both gradients, as in PyTorch. The LM loss averages over the
    labels that are not -100. With remat the backward pass recomputes the forward one in segments."""
    module = perturbed(TinyGPT2())
    ids, labels = lm_batch()
    model = export(module, torch.from_numpy(ids), "dynamo-exact")
    tied = [t.name for t in model.graph.initializer if t.name.endswith(("wte.weight", "lm_head.weight"))]
    assert len(tied) == 1
    assert_trains_like_pytorch(module, model, ids, labels, lm_loss, remat=remat, loss="cross_entropy",
                               class_axis=-1, ignore_index=-100)


@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
def test_gpt2_recomputing_its_attention_trains_like_pytorch_and_keeps_no_probabilities(exporter):
    """load(remat="attention") finds each layer's attention in the exporter's graph (the scores' MatMul, scale and
    mask, Softmax, the NaN guard of scaled_dot_product_attention's export, the MatMul with the values) and
    recomputes it in the backward pass: PyTorch's numbers, and a compiled step that plans fewer temporary bytes
    than without, by more than the probabilities of every layer (batch x heads x length^2 floats each)."""
    layers, heads, length = 2, 4, 128
    module = perturbed(TinyGPT2(layers, heads, length))
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 64, size=(2, length)).astype(np.int64)
    labels = np.concatenate([ids[:, 1:], np.full((2, 1), -100)], axis=1)
    model = export(module, torch.from_numpy(ids), exporter)
    options = dict(loss="cross_entropy", class_axis=-1, ignore_index=-100)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", onnxtrain.ParameterizationWarning)  # the untied LM head: trained apart
        trainable = onnxtrain.make_trainable(model, optimizer="sgd", learning_rate=LR, **options)

    def temporaries(remat) -> int:
        feeds = {"X": ids, "target": labels}
        return onnxtrain.load(trainable, remat=remat).lower(feeds, 0).compile().memory_analysis().temp_size_in_bytes

    probabilities = 2 * heads * length * length * 4
    assert temporaries(False) - temporaries("attention") > layers * probabilities
    if exporter == "dynamo":  # the untied LM head of a default export trains apart from the embedding
        model = export(module, torch.from_numpy(ids), "dynamo-exact")
        assert_trains_like_pytorch(module, model, ids, labels, lm_loss, remat="attention", **options)


def test_gpt2_recomputing_its_attention_with_dropout_draws_the_forward_pass_masks():
    """A train-mode export (make_trainable's train_mode=True) drops attention probabilities between the Softmax and
    the product with the values: remat="attention" recomputes that attention too (the Dropout had hidden it: the
    step kept the probabilities, as without remat), the step planning fewer temporary bytes by more than a
    layer's probabilities per layer (measured, 3 layers: 9.03 -> 5.60 MB, 6.5 probability tensors; one layer
    saves nothing, its backward holds them anyway), and the recomputed Dropout drops what the forward pass
    dropped: the same losses and weights as without remat, same seed (no other reference draws onnxtrain's
    masks)."""
    layers, heads, length = 3, 2, 256
    module = perturbed(TinyGPT2(layers, heads, length, attention_dropout=0.5)).train()
    ids = np.random.default_rng(3).integers(0, 64, size=(1, length)).astype(np.int64)
    labels = np.concatenate([ids[:, 1:], np.full((1, 1), -100)], axis=1)
    trainable = onnxtrain.make_trainable(export(module, torch.from_numpy(ids), "dynamo-exact"), optimizer="sgd",
                                         learning_rate=LR, loss="cross_entropy", class_axis=-1, train_mode=True)
    feeds = {"X": ids, "target": labels}
    engines = {remat: onnxtrain.load(trainable, seed=5, remat=remat) for remat in (False, "attention")}
    plans = {remat: e.lower(feeds, 0).compile().memory_analysis().temp_size_in_bytes for remat, e in engines.items()}
    assert plans[False] - plans["attention"] > layers * heads * length * length * 4, plans
    for _ in range(3):
        losses = [float(e.train_step(feeds)["loss"]) for e in engines.values()]
        np.testing.assert_allclose(losses[1], losses[0], rtol=1e-6)
    for name in engines[False].state:
        np.testing.assert_allclose(np.asarray(engines["attention"].state[name]),
                                   np.asarray(engines[False].state[name]), rtol=1e-5, atol=1e-7, err_msg=name)


@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
def test_gpt2_default_exports_untie_the_lm_head_and_make_trainable_says_so(exporter):
    """Both exporters' defaults give the LM head its own transposed copy of the embedding (which PyTorch trains
    as one tensor): no engine can match PyTorch on that, so make_trainable warns. The dynamo exporter's lifted
    constants (GELU's 0.5 / 0.044715 / 0.798, the exponent 3.0, the mask fill) stay out of training."""
    module = perturbed(TinyGPT2())
    ids, labels = lm_batch()
    model = export(module, torch.from_numpy(ids), exporter)
    with pytest.warns(onnxtrain.ParameterizationWarning, match="transposed copy"):
        trainable = onnxtrain.make_trainable(model, loss="cross_entropy", class_axis=-1, ignore_index=-100,
                                             optimizer="sgd", learning_rate=LR)
    trained = {b.key for b in trainable.training_info[0].update_binding}
    arrays = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    floats = {n for n, a in arrays.items() if a.dtype == np.float32}
    left_out = floats - trained
    scalars = sorted(float(arrays[n].item()) for n in left_out if arrays[n].size == 1)
    masks = [n for n in left_out if arrays[n].size > 1]
    if exporter == "dynamo":
        np.testing.assert_allclose(scalars, [0.0, 0.044715, 0.5, np.sqrt(2 / np.pi), 1.0, 3.0], rtol=1e-6)
        assert len(masks) == 1 and arrays[masks[0]].min() == np.finfo(np.float32).min
    else:
        assert not left_out  # TorchScript keeps its constants in Constant nodes
    engine = onnxtrain.load(trainable)
    for _ in range(STEPS):
        loss = float(engine.train_step({"X": ids, "target": labels})["loss"])
    assert np.isfinite(loss)  # the exponent 3.0 trained gave NaN gradients


def test_fresh_model_merged_by_the_exporter_warns():
    """A fresh model's LayerNorm scales are all 1: the dynamo exporter keeps one initializer for both norms."""
    torch.manual_seed(0)
    x = torch.zeros(2, 5, 16)
    model = export(Block().eval(), x, "dynamo")
    with pytest.warns(onnxtrain.ParameterizationWarning, match=r"norm1.weight \(every element 1, read by 2 nodes"):
        onnxtrain.make_trainable(model, loss="cross_entropy", class_axis=-1, optimizer="sgd")


def test_from_torch_trains_the_parameters_that_require_a_gradient():
    """from_torch exports with optimize=False and trains exactly the parameters PyTorch's loop trains: here all but
    the frozen head; the exporter's scale constant and the frozen head stay out."""
    torch.manual_seed(0)
    module = perturbed(Block())
    module.head.requires_grad_(False)
    rng = np.random.default_rng(4)
    x = rng.normal(size=(2, 5, 16)).astype(np.float32)
    target = rng.integers(0, 5, size=(2, 5)).astype(np.int64)
    with warnings.catch_warnings():
        warnings.simplefilter("error", onnxtrain.ParameterizationWarning)
        trainable = onnxtrain.from_torch(module, (torch.from_numpy(x),), input_names=["X"], output_names=["Y"],
                                         loss="cross_entropy", class_axis=-1, optimizer="sgd", learning_rate=LR)
    trained = {b.key for b in trainable.training_info[0].update_binding}
    assert trained == {n for n, p in module.named_parameters() if p.requires_grad}
    engine = onnxtrain.load(trainable)
    losses = [float(engine.train_step({"X": x, "target": target})["loss"]) for _ in range(STEPS)]
    optimizer = torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=LR)
    expected = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        value = F.cross_entropy(module(torch.from_numpy(x)).transpose(1, 2), torch.from_numpy(target))
        value.backward()
        optimizer.step()
        expected.append(value.item())
    np.testing.assert_allclose(losses, expected, rtol=1e-4)
    for name in trained:
        np.testing.assert_allclose(np.asarray(engine.state[name]), module.get_parameter(name).detach().numpy(),
                                   rtol=1e-4, atol=1e-6, err_msg=name)
    with torch.no_grad():
        np.testing.assert_allclose(np.asarray(engine.infer({"X": x})["Y"]), module(torch.from_numpy(x)).numpy(),
                                   rtol=1e-4, atol=1e-5)


def test_names_given_exactly():
    torch.manual_seed(0)
    module = perturbed(Block())
    model = export(module, torch.zeros(2, 5, 16), "dynamo")
    names = [t.name for t in model.graph.initializer if t.name.startswith("norm")]
    trainable = onnxtrain.make_trainable(model, loss="cross_entropy", class_axis=-1, optimizer="sgd",
                                         trainable=names)
    assert sorted(b.key for b in trainable.training_info[0].update_binding) == sorted(names)
    with pytest.raises(AuthoringError, match=r"\['head.scale'\] \(1\) are not initializers"):
        onnxtrain.make_trainable(model, trainable=names + ["head.scale"])
    shape = next(t.name for t in model.graph.initializer if t.data_type == onnx.TensorProto.INT64)
    with pytest.raises(AuthoringError, match="not float initializers"):
        onnxtrain.make_trainable(model, trainable=[shape])


class LossInForward(torch.nn.Module):
    """A Hugging Face-style head: forward computes its own loss from keyword `labels` and returns a mapping."""

    def __init__(self, label_smoothing: float = 0.0):
        super().__init__()
        self.body, self.head = torch.nn.Linear(4, 6), torch.nn.Linear(6, 3)
        self.label_smoothing = label_smoothing

    def forward(self, x, labels=None):
        hidden = torch.tanh(self.body(x))
        logits = self.head(hidden)
        loss = F.cross_entropy(logits, labels, label_smoothing=self.label_smoothing)
        return {"hidden": hidden, "logits": logits, "loss": loss, "scores": logits}


def own_loss_sgd_steps(module: torch.nn.Module, x: np.ndarray, labels: np.ndarray) -> list[float]:
    """The losses of STEPS plain SGD steps of PyTorch on the loss `module` returns for (x, labels=labels)."""
    optimizer = torch.optim.SGD(module.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        value = module(torch.from_numpy(x), labels=torch.from_numpy(labels))["loss"]
        value.backward()
        optimizer.step()
        losses.append(value.item())
    return losses


def test_from_torch_names_a_mapping_s_outputs_after_its_keys_and_takes_keyword_arguments():
    """kwargs= reaches forward as keyword arguments, and a returned dict's outputs are named after its keys (the
    exporter had named them `tanh`, `linear_1`, `cross_entropy_loss`), so loss="output:loss" names the loss forward
    computed: training on it is PyTorch's loop on the same loss."""
    torch.manual_seed(0)
    module = perturbed(LossInForward())
    rng = np.random.default_rng(5)
    x = rng.normal(size=(3, 4)).astype(np.float32)
    labels = np.array([0, 2, 1])
    trainable = onnxtrain.from_torch(module, (torch.from_numpy(x),), kwargs={"labels": torch.from_numpy(labels)},
                                     loss="output:loss", optimizer="sgd", learning_rate=LR)
    assert [o.name for o in trainable.graph.output] == ["hidden", "logits", "loss", "logits"]
    assert [i.name for i in trainable.graph.input] == ["x", "labels"]
    engine = onnxtrain.load(trainable)
    losses = [float(engine.train_step({"x": x, "labels": labels})["loss"]) for _ in range(STEPS)]
    np.testing.assert_allclose(losses, own_loss_sgd_steps(module, x, labels), rtol=1e-5)
    with torch.no_grad():
        np.testing.assert_allclose(np.asarray(engine.infer({"x": x, "labels": labels})["logits"]),
                                   module(torch.from_numpy(x), labels=torch.from_numpy(labels))["logits"].numpy(),
                                   rtol=1e-5, atol=1e-6)
    with pytest.raises(AuthoringError, match=r"pass keyword arguments as kwargs="):
        onnxtrain.from_torch(module, {"x": torch.from_numpy(x)}, loss="output:loss")


def test_a_loss_whose_label_smoothing_the_exporter_dropped_is_warned_and_its_advice_trains_as_torch():
    """torch 2.13's dynamo exporter writes F.cross_entropy(..., label_smoothing=0.2) as one SoftmaxCrossEntropyLoss,
    which has no smoothing: the model's loss is the unsmoothed one (ONNX Runtime's too), and loss="output:loss"
    had trained toward it unwarned. The warning names the options that train torch's loss."""
    torch.manual_seed(0)
    module = perturbed(LossInForward(label_smoothing=0.2))
    rng = np.random.default_rng(5)
    x = rng.normal(size=(3, 4)).astype(np.float32)
    labels = np.array([0, 2, 1])
    export = (module, (torch.from_numpy(x),))
    options = {"kwargs": {"labels": torch.from_numpy(labels)}, "optimizer": "sgd", "learning_rate": LR}
    advice = r"without its label_smoothing=0.2: .* loss='cross_entropy', label_smoothing=0.2, prediction='logits'"
    with pytest.warns(UserWarning, match=advice):
        dropped = onnxtrain.from_torch(*export, loss="output:loss", **options)
    outputs = onnxtrain.load(dropped).infer({"x": x, "labels": labels})
    np.testing.assert_allclose(float(outputs["loss"]), F.cross_entropy(
        torch.tensor(np.asarray(outputs["logits"])), torch.from_numpy(labels)).item(), rtol=1e-6)
    # the model's own loss node is still there, its output renamed off `loss` (the value forward returns as logits
    # and as scores takes the last of its names)
    with pytest.warns(UserWarning, match=advice):
        trainable = onnxtrain.from_torch(*export, loss="cross_entropy", label_smoothing=0.2, prediction="logits",
                                         output_names=["hidden", "scores", "own_loss", "logits"], **options)
    engine = onnxtrain.load(trainable)
    losses = [float(engine.train_step({"x": x, "labels": labels, "target": labels})["loss"]) for _ in range(STEPS)]
    np.testing.assert_allclose(losses, own_loss_sgd_steps(module, x, labels), rtol=1e-5)


class Pooled(torch.nn.Module):
    """A head over the positions of x [batch, length, 3], flattened (length fixed by the code) or averaged."""

    def __init__(self, flatten: bool):
        super().__init__()
        self.flatten = flatten
        self.head = torch.nn.Linear(4 * 3 if flatten else 3, 2)

    def forward(self, x):
        return self.head(x.reshape(x.shape[0], 4 * 3) if self.flatten else x.mean(1))


@pytest.mark.parametrize("flatten", [True, False])
def test_from_torch_warns_where_the_export_fixed_a_dimension_dynamic_shapes_names(flatten):
    """torch.export specializes a dimension the code makes constant (here a reshape by the example's length; nn.LSTM's
    length in torch 2.13) and torch.onnx.export exports it fixed without a word: the first batch of another length
    would be a FeedError saying the model fixes that size, after the user asked for it to vary."""
    pytest.importorskip("onnxscript")
    dims = ({0: torch.export.Dim("batch"), 1: torch.export.Dim("length")},)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = onnxtrain.from_torch(Pooled(flatten), (torch.zeros(2, 4, 3),), dynamic_shapes=dims, loss="mse")
    said = [str(w.message) for w in caught if str(w.message).startswith("from_torch")]
    length = model.graph.input[0].type.tensor_type.shape.dim[1]
    assert (length.dim_value == 4) == flatten  # what torch exported, which the warning must agree with
    assert said == ([r"from_torch: dynamic_shapes names ['length'], but the export fixed them to the example's "
                     r"sizes (x [batch, 4, 3]): torch.export specialized them (the model's code treats them as "
                     r"constants; torch 2.13 does so to an nn.LSTM's or nn.GRU's length from its second export in "
                     r"a process: export in a process of its own), so every batch must keep those sizes"]
                    if flatten else [])


class TiedHead(torch.nn.Module):
    """An embedding, a Linear + BatchNorm1d, and an output layer tied to the embedding."""

    def __init__(self):
        super().__init__()
        self.emb, self.lin, self.bn = torch.nn.Embedding(12, 8), torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8)
        self.head = torch.nn.Linear(8, 12, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(self.bn(torch.relu(self.lin(self.emb(ids)))))


def test_to_torch_writes_what_onnxtrain_trained_into_the_module():
    """from_torch, three SGD steps in train mode, then to_torch into a fresh copy: every parameter (the tied one
    once, under both names) and the BatchNorm's running statistics equal PyTorch's own three steps; the one buffer
    onnxtrain does not keep (num_batches_tracked, which a momentum BatchNorm does not read) is reported."""
    import copy

    module = perturbed(TiedHead())
    ids = np.array([1, 4, 7, 4, 11, 0], dtype=np.int64)
    target = np.array([3, 4, 5, 6, 7, 8], dtype=np.int64)
    engine = onnxtrain.load(onnxtrain.from_torch(copy.deepcopy(module), (torch.from_numpy(ids),),
                                                 loss="cross_entropy", optimizer="sgd", learning_rate=0.1,
                                                 train_mode=True))
    reference = copy.deepcopy(module).train()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(3):
        engine.train_step({"ids": ids, "target": target})
        optimizer.zero_grad()
        F.cross_entropy(reference(torch.from_numpy(ids)), torch.from_numpy(target)).backward()
        optimizer.step()
    fresh = copy.deepcopy(module)
    assert onnxtrain.to_torch(engine, fresh) == ["bn.num_batches_tracked"]
    assert fresh.head.weight is fresh.emb.weight
    trained = reference.state_dict()
    for name, value in fresh.state_dict().items():
        if name != "bn.num_batches_tracked":
            np.testing.assert_allclose(value.numpy(), trained[name].numpy(), rtol=1e-4, atol=1e-6, err_msg=name)
    assert not np.allclose(fresh.lin.weight.detach().numpy(), module.lin.weight.detach().numpy())


def test_to_torch_converts_to_the_module_s_dtype_and_refuses_another_shape():
    module = torch.nn.Linear(3, 2).to(torch.bfloat16)
    weight = np.arange(6, dtype=np.float32).reshape(2, 3) / 7
    assert onnxtrain.to_torch({"weight": weight}, module) == ["bias"]
    np.testing.assert_array_equal(module.weight.float().detach().numpy(),
                                  torch.from_numpy(weight).to(torch.bfloat16).float().numpy())
    with pytest.raises(onnxtrain.errors.StateError, match=r"'weight' holds shape \[3, 2\]"):
        onnxtrain.to_torch({"weight": weight.T, "bias": np.zeros(2, np.float32)}, module)
    assert module.bias.dtype == torch.bfloat16 and not module.bias.float().eq(0).all()  # nothing copied


def test_parameter_names_are_the_module_s_parameters_not_its_buffers():
    """What jax_function's params hold beyond the parameters (a BatchNorm's running statistics) stays out of
    parameter_names, so the optax recipe of jax_function's docstring trains the module's parameters only."""
    optax = pytest.importorskip("optax")
    module = perturbed(torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3), torch.nn.BatchNorm2d(3), torch.nn.Flatten(),
                                           torch.nn.Linear(12, 2)))
    x = np.random.default_rng(3).normal(size=(4, 2, 4, 4)).astype(np.float32)
    model = export(module, torch.from_numpy(x), "dynamo-exact")
    names = onnxtrain.parameter_names(model)
    assert sorted(names) == sorted(n for n, _ in module.named_parameters())
    fn, params = onnxtrain.jax_function(model)
    assert {"1.running_mean", "1.running_var"} <= set(params)
    optimizer = optax.multi_transform({"train": optax.sgd(0.1), "keep": optax.set_to_zero()},
                                      {n: "train" if n in names else "keep" for n in params})
    grads = {n: np.ones_like(v) for n, v in params.items()}
    updates, _ = optimizer.update(grads, optimizer.init(params), params)
    moved = optax.apply_updates(params, updates)
    assert {n for n in params if not np.array_equal(np.asarray(moved[n]), np.asarray(params[n]))} == set(names)


class Sequence(torch.nn.Module):
    """Embedding (with a padding row), LSTM, LayerNorm and Linear over token ids."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(64, 16, padding_idx=0)
        self.lstm = torch.nn.LSTM(16, 12, batch_first=True)
        self.norm = torch.nn.LayerNorm(12)
        self.head = torch.nn.Linear(12, 40)

    def forward(self, ids):
        return self.head(self.norm(self.lstm(self.emb(ids))[0]))


class Image(torch.nn.Module):
    """Conv2d, PReLU (no rule: its slope keeps its value), BatchNorm2d (after the PReLU, so no exporter folds it
    into the Conv) and Linear."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.act = torch.nn.PReLU()
        self.bn = torch.nn.BatchNorm2d(8)
        self.head = torch.nn.Linear(8 * 6 * 6, 10)

    def forward(self, x):
        return self.head(self.bn(self.act(self.conv(x))).flatten(1))


def pytorch_draw(layer: "torch.nn.Module", name: str) -> tuple[str, float]:
    """(kind, bound or std) of torch's own reset_parameters for the parameter `name` of `layer`."""
    if isinstance(layer, torch.nn.Linear):
        return "uniform", 1 / np.sqrt(layer.in_features)
    if isinstance(layer, (torch.nn.Conv1d, torch.nn.Conv2d)):
        return "uniform", 1 / np.sqrt(layer.in_channels // layer.groups * np.prod(layer.kernel_size))
    if isinstance(layer, torch.nn.LSTM):
        return "uniform", 1 / np.sqrt(layer.hidden_size)
    if isinstance(layer, torch.nn.Embedding):
        return "normal", 1.0
    assert isinstance(layer, (torch.nn.LayerNorm, torch.nn.BatchNorm2d)), layer
    return ("ones" if name == "weight" else "zeros"), 0.0


def source_parameter(module: "torch.nn.Module", value: np.ndarray) -> tuple["torch.nn.Module", str]:
    """The layer and parameter an exported initializer was made from, found by its values (perturbed: all
    distinct), whatever the exporter named it, transposed or reordered it (TorchScript's LSTM gates, its
    pre-transposed MatMul weight, its one B from bias_ih and bias_hh)."""
    for layer in module.modules():
        for name, p in layer.named_parameters(recurse=False):
            if np.isin(value.ravel(), p.detach().numpy().ravel()).any():
                return layer, name
    raise AssertionError(f"no parameter holds the values of an initializer {value.shape}")


@pytest.mark.parametrize("exporter", ["dynamo-exact", "torchscript"])
@pytest.mark.parametrize("name", ["sequence", "image"])
def test_reinitialize_draws_what_pytorch_layers_draw(name, exporter):
    """reinitialize=True re-draws each parameter as torch's reset_parameters of the layer that reads it: the
    bounds are computed from the torch layers, the values drawn by the initialization graph (engine.init)."""
    torch.manual_seed(0)
    module = perturbed(Sequence() if name == "sequence" else Image())
    rng = np.random.default_rng(0)
    x = (rng.integers(0, 64, size=(4, 6)) if name == "sequence" else rng.normal(size=(4, 3, 6, 6))).astype(
        np.int64 if name == "sequence" else np.float32)
    model = export(module, torch.from_numpy(x), exporter)
    padding = {"padding_idx": {"emb.weight": 0}} if name == "sequence" and exporter == "torchscript" else {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainable = onnxtrain.make_trainable(model, optimizer="sgd", learning_rate=0.1, reinitialize=True, **padding)
    kept = [str(w.message) for w in caught if "not re-drawn" in str(w.message)]
    stored = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    slope = next(t for t, v in stored.items() if v.size == 1 and source_parameter(module, v)[0] is module.act) \
        if name == "image" else None
    assert kept == ([f"reinitialize=True: 1 parameters are not re-drawn and keep their values, as no PyTorch "
                     f"layer's initialization is known for how the graph reads them (onnxtrain/reinitialize.py): "
                     f"{slope}"] if slope else [])
    engine = onnxtrain.load(trainable)
    engine.init(seed=1)
    drawn = {p: np.asarray(engine.state[p]) for p in stored if p in engine.state}
    engine.init(seed=2)
    assert set(drawn) == {p for p in stored if "running_" not in p}  # every parameter, under either exporter
    for p, value in drawn.items():
        again = np.asarray(engine.state[p])
        if p == slope:
            np.testing.assert_array_equal(value, stored[p])
            continue
        kind, scale = pytorch_draw(*source_parameter(module, stored[p]))
        if kind in ("ones", "zeros"):
            np.testing.assert_array_equal(value, np.full(stored[p].shape, kind == "ones", np.float32), err_msg=p)
            continue
        assert not np.allclose(value, again), p  # another seed, other values
        if p == "emb.weight":  # nn.Embedding(padding_idx=0) starts its padding row at zero
            assert not value[0].any() and value[1:].all()
            value = value[1:]
        if kind == "uniform":
            assert np.abs(value).max() <= scale, p
            if value.size >= 64:  # the draw fills [-bound, bound] (a bias of 8 or 10 values may not)
                assert np.abs(value).max() > 0.8 * scale, p
                np.testing.assert_allclose(value.std(), scale / np.sqrt(3), rtol=0.15, err_msg=p)
        else:
            np.testing.assert_allclose(value.std(), scale, rtol=0.1, err_msg=p)
            assert abs(value.mean()) < 0.1 * scale, p
    rng_target = np.random.default_rng(1)
    y = np.asarray(engine.infer({"X": x})["Y"])
    target = rng_target.normal(size=y.shape).astype(np.float32)
    losses = [float(engine.train_step({"X": x, "target": target})["loss"]) for _ in range(5)]
    assert losses[-1] < losses[0], losses  # training from the re-drawn weights goes down


class Norms(torch.nn.Module):
    """LayerNorm, GroupNorm and (dynamo only: TorchScript cannot export it) RMSNorm, as the exporters decompose
    them: TorchScript's LayerNorm below opset 17 as Div by a Sqrt then Mul and Add, both exporters' GroupNorm as
    InstanceNormalization then Mul and Add ([C, 1] operands; the dynamo exporter's through Unsqueeze and
    CastLike), the dynamo exporter's RMSNorm as a Mul by Reciprocal(Sqrt) then by the scale."""

    def __init__(self, rms: bool):
        super().__init__()
        self.lin, self.norm, self.group = torch.nn.Linear(6, 8), torch.nn.LayerNorm(8), torch.nn.GroupNorm(2, 8)
        self.rms = torch.nn.RMSNorm(8) if rms else None

    def forward(self, x):
        y = self.group(self.norm(self.lin(x)).transpose(1, 2)).transpose(1, 2)
        return y if self.rms is None else self.rms(y)


@pytest.mark.parametrize("exporter", ["dynamo-exact", "torchscript"])
def test_reinitialize_sets_decomposed_norms_to_ones_and_zeros(exporter):
    module = perturbed(Norms(rms=exporter != "torchscript"))
    x = torch.randn(2, 3, 6)
    if exporter == "torchscript":
        buffer = io.BytesIO()
        torch.onnx.export(module, (x,), buffer, dynamo=False, input_names=["X"], output_names=["Y"], opset_version=13)
        model = onnx.load_from_string(buffer.getvalue())
    else:
        model = export(module, x, exporter)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no parameter left as it was
        engine = onnxtrain.load(onnxtrain.make_trainable(model, reinitialize=True))
    engine.init(seed=0)
    stored = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer if t.name in engine.state}
    for name, value in stored.items():
        layer, kind = source_parameter(module, value)
        drawn = np.asarray(engine.state[name])
        if isinstance(layer, torch.nn.Linear):
            assert np.abs(drawn).max() <= 1 / np.sqrt(layer.in_features) and np.unique(drawn).size == drawn.size
        else:
            np.testing.assert_array_equal(drawn, np.full(value.shape, kind == "weight", np.float32), err_msg=name)


def test_reinitialize_restarts_running_statistics_as_torch_resets_them():
    """With train_mode=True the running statistics are state the step updates: engine.init restarts them as
    BatchNorm.reset_parameters does (mean 0, variance 1, and the batch count momentum=None averages over 0), so
    the first step's running statistics are that batch's, as a re-initialized PyTorch module's after one step."""
    import copy

    module = perturbed(torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.BatchNorm1d(6, momentum=None)))
    with torch.no_grad():
        module[1].running_mean.fill_(0.5), module[1].running_var.fill_(2.0), module[1].num_batches_tracked.fill_(7)
    x = np.random.default_rng(0).normal(size=(8, 5)).astype(np.float32)
    engine = onnxtrain.load(onnxtrain.from_torch(copy.deepcopy(module), (torch.from_numpy(x),), optimizer="sgd",
                                                 learning_rate=0.0, train_mode=True, reinitialize=True))
    engine.init(seed=0)
    np.testing.assert_array_equal(np.asarray(engine.state["1.running_mean"]), np.zeros(6, np.float32))
    np.testing.assert_array_equal(np.asarray(engine.state["1.running_var"]), np.ones(6, np.float32))
    reference = copy.deepcopy(module)
    onnxtrain.to_torch(engine, reference)  # the re-drawn weights (learning rate 0: the step keeps them)
    reference[1].num_batches_tracked.zero_()
    engine.train_step({"input": x, "target": np.zeros((8, 6), np.float32)})
    reference.train()(torch.from_numpy(x))
    for name in ("running_mean", "running_var"):
        np.testing.assert_allclose(np.asarray(engine.state[f"1.{name}"]), getattr(reference[1], name).numpy(),
                                   rtol=1e-5, atol=1e-6, err_msg=name)


class WeightsAsRead(torch.nn.Module):
    """The forms Hugging Face's Mamba reads its layers in: a depthwise Conv1d's weight through Squeeze and
    Unsqueeze, and a Linear's weight as MatMul's A (dt_proj.weight @ x) with its bias added after."""

    def __init__(self):
        super().__init__()
        self.conv, self.proj = torch.nn.Conv1d(6, 6, 3, groups=6, padding=1), torch.nn.Linear(6, 4)

    def forward(self, x):
        h = F.conv1d(x, self.conv.weight.squeeze(1).unsqueeze(1), self.conv.bias, padding=1, groups=6)
        return self.proj.weight @ h + self.proj.bias[:, None]


def test_reinitialize_reads_a_weight_as_its_node_contracts_it():
    module = perturbed(WeightsAsRead())
    x = torch.randn(2, 6, 5)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # every parameter re-drawn
        trainable = onnxtrain.make_trainable(export(module, x, "dynamo-exact"), reinitialize=True)
    engine = onnxtrain.load(trainable)
    engine.init(seed=0)
    highs = {node.output[0]: onnx.helper.get_attribute_value(next(a for a in node.attribute if a.name == "high"))
             for node in trainable.training_info[0].initialization.node if node.op_type == "RandomUniform"}
    for name, p in module.named_parameters():
        kind, bound = pytorch_draw(*source_parameter(module, p.detach().numpy()))
        assert kind == "uniform" and highs[f"{name}.init"] == pytest.approx(bound), name  # conv: 1/sqrt(1 * 3)
        assert np.abs(np.asarray(engine.state[name])).max() <= bound, name
