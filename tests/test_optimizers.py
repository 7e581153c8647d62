"""make_trainable's optimizers against PyTorch loops: torch.optim.Adam, AdamW (with and without no-decay groups),
Adagrad, SGD with momentum and weight decay, torch.nn.utils.clip_grad_norm_, and gradient accumulation against one
big batch. The model is a small MLP with a LayerNorm, written with onnx.helper under the torch module's parameter
names and holding its weights (what torch.onnx.export(..., dynamo=True, optimize=False) keeps, without its cost)."""

from __future__ import annotations

import re
import subprocess
import sys
import warnings

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxtrain
from onnxtrain.errors import AuthoringError

torch = pytest.importorskip("torch")

LR = 0.01
STEPS = 5
BATCH = 8
# Adam moves every weight by about LR per step whatever its gradient, so a weight passing near 0 has no
# meaningful relative error: float32 rounding of those moves shows as ~1e-8 absolute (measured: at most 6e-8)
ATOL = 1e-5 * LR


def module() -> "torch.nn.Module":
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.LayerNorm(16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 3))


def onnx_model(m: "torch.nn.Module") -> onnx.ModelProto:
    nodes = [
        helper.make_node("Gemm", ["X", "0.weight", "0.bias"], ["h0"], transB=1),
        helper.make_node("LayerNormalization", ["h0", "1.weight", "1.bias"], ["h1"], axis=-1, epsilon=1e-5),
        helper.make_node("Tanh", ["h1"], ["h2"]),
        helper.make_node("Gemm", ["h2", "3.weight", "3.bias"], ["Y"], transB=1),
    ]
    weights = [numpy_helper.from_array(p.detach().numpy().copy(), n) for n, p in m.named_parameters()]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 6])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", 3])], weights)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def batches(count: int, rows: int = BATCH) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(1)
    return [(rng.normal(size=(rows, 6)).astype(np.float32), rng.normal(size=(rows, 3)).astype(np.float32))
            for _ in range(count)]


def train_onnxtrain(data, rates=None, **options) -> tuple[list[float], dict[str, np.ndarray], onnxtrain.Engine]:
    model = onnxtrain.make_trainable(onnx_model(module()), loss="mse", learning_rate=LR, **options)
    onnx.checker.check_model(model)
    engine = onnxtrain.load(model)
    losses = []
    for i, (x, t) in enumerate(data):
        feeds = {"X": x, "target": t} if rates is None else {"X": x, "target": t, "learning_rate": rates[i]}
        losses.append(float(engine.train_step(feeds)["loss"]))
    return losses, {n: np.asarray(v) for n, v in engine.state.items()}, engine


def train_torch(data, make_optimizer, max_norm: float | None = None,
                m: "torch.nn.Module | None" = None) -> tuple[list[float], dict, list[float]]:
    """Each step of `m` (default: module()): loss, backward, clip_grad_norm_ if asked, optimizer step; returns the
    losses, the final parameters and the total gradient norms clip_grad_norm_ saw."""
    m = m or module()
    optimizer = make_optimizer(m)
    losses, norms = [], []
    for x, t in data:
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(m(torch.from_numpy(x)), torch.from_numpy(t))
        loss.backward()
        if max_norm is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm)))
        optimizer.step()
        losses.append(loss.item())
    return losses, {n: p.detach().numpy() for n, p in m.named_parameters()}, norms


def groups(m: "torch.nn.Module", exempt, weight_decay: float) -> list[dict]:
    """torch's parameter groups as Hugging Face's Trainer builds them: decayed, and exempt from decay."""
    named = list(m.named_parameters())
    return [{"params": [p for n, p in named if not exempt(n, p)], "weight_decay": weight_decay},
            {"params": [p for n, p in named if exempt(n, p)], "weight_decay": 0.0}]


def assert_same_training(ours, theirs) -> None:
    np.testing.assert_allclose(ours[0], theirs[0], rtol=1e-5)
    for name, value in theirs[1].items():
        np.testing.assert_allclose(ours[1][name], value, rtol=1e-5, atol=ATOL, err_msg=name)


def rank_at_most_1(name, p) -> bool:
    return p.ndim <= 1


def bias_or_norm(name, p) -> bool:  # Hugging Face's rule, by name: "1." is the LayerNorm
    return "bias" in name or name.startswith("1.")


CASES = {
    "adam": ({"optimizer": "adam"}, lambda m: torch.optim.Adam(m.parameters(), lr=LR)),
    "adam_betas_eps": ({"optimizer": "adam", "alpha": 0.8, "beta": 0.99, "epsilon": 1e-6},
                       lambda m: torch.optim.Adam(m.parameters(), lr=LR, betas=(0.8, 0.99), eps=1e-6)),
    "adam_l2_no_decay": ({"optimizer": "adam", "weight_decay": 0.5, "no_decay": True},
                         lambda m: torch.optim.Adam(groups(m, rank_at_most_1, 0.5), lr=LR)),
    "adamw_default": ({"optimizer": "adamw"}, lambda m: torch.optim.AdamW(m.parameters(), lr=LR)),
    "adamw_no_decay_rank": ({"optimizer": "adamw", "weight_decay": 2.0, "no_decay": True},
                            lambda m: torch.optim.AdamW(groups(m, rank_at_most_1, 2.0), lr=LR)),
    "adamw_no_decay_names": ({"optimizer": "adamw", "weight_decay": 2.0, "no_decay": r"bias|^1\."},
                             lambda m: torch.optim.AdamW(groups(m, bias_or_norm, 2.0), lr=LR)),
    # torch's eps 1e-10, not the Adagrad op's 1e-6 (which moved these weights up to 3e-4 relative in 5 steps)
    "adagrad": ({"optimizer": "adagrad"}, lambda m: torch.optim.Adagrad(m.parameters(), lr=LR)),
    "adagrad_decays": ({"optimizer": "adagrad", "decay_factor": 0.1, "epsilon": 1e-3, "weight_decay": 0.5},
                       lambda m: torch.optim.Adagrad(m.parameters(), lr=LR, lr_decay=0.1, eps=1e-3,
                                                     weight_decay=0.5)),
    "momentum_l2": ({"optimizer": "momentum", "weight_decay": 0.5, "no_decay": "bias"},
                    lambda m: torch.optim.SGD(groups(m, lambda n, p: "bias" in n, 0.5), lr=LR, momentum=0.9)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_optimizer_matches_torch(case):
    options, make_optimizer = CASES[case]
    data = batches(STEPS)
    assert_same_training(train_onnxtrain(data, **options), train_torch(data, make_optimizer))


def test_adam_first_step_is_torchs():
    """torch's first Adam step moves every weight by lr * sign(grad) (bias-corrected moments); ONNX's Adam op fed
    T = 0 skips the correction and moved it by ~3.16 lr (sqrt(1 - 0.999) / (1 - 0.9) is not applied)."""
    data = batches(1)
    before = {n: p.detach().numpy().copy() for n, p in module().named_parameters()}
    _, after, _ = train_onnxtrain(data, optimizer="adam")
    move = np.abs(after["3.weight"] - before["3.weight"])
    np.testing.assert_allclose(move, LR, rtol=1e-3)


class ReshapedParameters(torch.nn.Module if torch else object):
    """Parameters of rank 1 that exporters reshape for their readers: PReLU's slope and GroupNorm's scale and shift
    to [C, 1, 1] or [1, C, 1, 1], an LSTM's two biases concatenated into B [1, 8 * hidden] (W, R: [1, 4h, n])."""

    def __init__(self):
        super().__init__()
        self.conv, self.prelu, self.norm = torch.nn.Conv2d(3, 4, 3), torch.nn.PReLU(4), torch.nn.GroupNorm(2, 4)
        self.lstm, self.head = torch.nn.LSTM(4, 8, batch_first=True), torch.nn.Linear(8, 3)
        with torch.no_grad():  # no two parameters equal (exporters merge equal ones: GroupNorm's ones, PReLU's 0.25)
            for p in self.parameters():
                p.add_(0.1 * torch.randn(p.shape))

    def forward(self, x):
        h = self.norm(self.prelu(self.conv(x))).flatten(2).transpose(1, 2)
        return self.head(self.lstm(h)[0][:, -1])


@pytest.mark.parametrize("dynamo", [False, True])
def test_no_decay_goes_by_the_parameters_rank_before_the_export_reshaped_it(dynamo, tmp_path):
    """no_decay=True on a default export trains as torch's groups of p.ndim <= 1: the biases, PReLU and GroupNorm
    parameters reshaped by the exporter were decayed as tensors of rank 2-4."""
    torch.manual_seed(0)
    m = ReshapedParameters().eval()
    x, t = torch.randn(2, 3, 6, 6), torch.randn(2, 3)
    torch.onnx.export(m, (x,), tmp_path / "m.onnx", dynamo=dynamo)
    with warnings.catch_warnings():  # the export keeps one initializer per parameter: nothing to warn about
        warnings.simplefilter("error", onnxtrain.ParameterizationWarning)
        model = onnxtrain.make_trainable(onnx.load(tmp_path / "m.onnx"), loss="mse", optimizer="adamw",
                                         learning_rate=0.05, weight_decay=2.0, no_decay=True)
    engine = onnxtrain.load(model)
    feeds = {model.graph.input[0].name: x.numpy(), "target": t.numpy()}
    losses = [float(engine.train_step(feeds)["loss"]) for _ in range(STEPS)]
    expected, _, _ = train_torch([(x.numpy(), t.numpy())] * STEPS,
                                 lambda m: torch.optim.AdamW(groups(m, rank_at_most_1, 2.0), lr=0.05), m=m)
    np.testing.assert_allclose(losses, expected, rtol=1e-4)


class Tied(torch.nn.Module if torch else object):
    """An embedding tied to the output projection: named_parameters() calls the table embed.weight, the export keeps
    it as head.weight."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.norm, self.head = torch.nn.Embedding(10, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 10)
        self.head.weight = self.embed.weight
        with torch.no_grad():
            self.norm.weight.add_(0.1 * torch.randn(4))  # off 1 and 0: the export would merge equal values
            self.norm.bias.add_(0.1 * torch.randn(4))

    def forward(self, ids):
        return self.head(self.norm(self.embed(ids)))


def test_from_torch_searches_no_decay_in_the_names_torchs_groups_see():
    """A tied parameter's initializer has the name the exporter kept (head.weight); torch's groups, as Hugging Face's
    Trainer, search named_parameters()'s (embed.weight): r"bias|embed" exempts the table there, and had decayed it
    in from_torch. A pattern that matches the kept name alone exempts nothing in torch: refused, naming the names."""
    ids, target = torch.tensor([[1, 2, 3, 1]]), torch.randn(1, 4, 10, generator=torch.Generator().manual_seed(1))
    pattern = r"bias|embed"
    model = onnxtrain.from_torch(Tied(), (ids,), loss="mse", optimizer="adamw", learning_rate=0.05,
                                 weight_decay=2.0, no_decay=pattern)
    assert [t.name for t in model.graph.initializer if t.name.endswith(".weight")] == ["norm.weight", "head.weight"]
    engine = onnxtrain.load(model)
    losses = [float(engine.train_step({model.graph.input[0].name: ids.numpy(), "target": target.numpy()})["loss"])
              for _ in range(STEPS)]
    m = Tied()
    make = lambda m: torch.optim.AdamW(groups(m, lambda n, p: re.search(pattern, n), 2.0), lr=0.05)  # noqa: E731
    expected, parameters, _ = train_torch([(ids.numpy(), target.numpy())] * STEPS, make, m=m)
    np.testing.assert_allclose(losses, expected, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(engine.state["head.weight"]), parameters["embed.weight"], rtol=1e-5,
                               atol=ATOL)
    with pytest.raises(AuthoringError, match=r"match of 'head.weight' \(parameters: \['embed.weight', "):
        onnxtrain.from_torch(Tied(), (ids,), optimizer="adamw", no_decay="head.weight")


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_clip_grad_norm_matches_torch(optimizer):
    data = batches(STEPS)
    max_norm = 1.5
    make = {"adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=LR),
            "sgd": lambda m: torch.optim.SGD(m.parameters(), lr=LR)}[optimizer]
    theirs = train_torch(data, make, max_norm=max_norm)
    assert max(theirs[2]) > max_norm > min(theirs[2]), theirs[2]  # some steps clip, some do not
    assert_same_training(train_onnxtrain(data, optimizer=optimizer, clip_grad_norm=max_norm), theirs)


HALF = {"bfloat16": (TensorProto.BFLOAT16, ml_dtypes.bfloat16), "float16": (TensorProto.FLOAT16, np.float16)}


def train_half_precision_sum(dtype: str, gradients: list, make_optimizer, **options):
    """A bfloat16 or float16 weight w (a module `.to(torch.bfloat16)`) trained on the loss sum(w * c), whose
    gradient is c exactly in every engine, by onnxtrain and by torch: (engine, w, torch's optimizer)."""
    elem, np_dtype = HALF[dtype]
    as_numpy = lambda t: t.detach().float().numpy().astype(np_dtype)  # noqa: E731 - NumPy has no bfloat16 view
    w = torch.nn.Parameter(torch.linspace(-8, 8, 16, dtype=torch.float64).to(getattr(torch, dtype)))
    graph = helper.make_graph(
        [helper.make_node("Mul", ["w", "c"], ["wc"]), helper.make_node("ReduceSum", ["wc"], ["total"], keepdims=0)],
        "weighted_sum", [helper.make_tensor_value_info("c", elem, [16])],
        [helper.make_tensor_value_info("total", elem, [])], [numpy_helper.from_array(as_numpy(w), "w")])
    engine = onnxtrain.load(onnxtrain.make_trainable(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), loss="output:total", **options))
    optimizer = make_optimizer([w])
    for c in gradients:
        engine.train_step({"c": as_numpy(c)})
        optimizer.zero_grad()
        (w * c).sum().backward()
        optimizer.step()
    return engine, w, optimizer


@pytest.mark.parametrize("dtype", list(HALF))
def test_momentum_of_half_precision_weights_is_torchs(dtype):
    """torch.optim.SGD with momentum computes 0.9 v + g in float32 and rounds the velocity to the weights' type.
    The Momentum op computed in that type, alpha rounded to it first (bfloat16's 0.8984375): 20 steps after the
    last gradient the velocity was 3.9% below torch's (float16: 0.4%). With c = 0 torch's `add_` adds nothing, so
    its velocity is each step's one rounding of 0.9 v, as ours is now."""
    half = getattr(torch, dtype)
    gradients = [torch.linspace(-2, 2, 16, dtype=torch.float64).to(half)] + [torch.zeros(16, dtype=half)] * 20
    engine, w, optimizer = train_half_precision_sum(
        dtype, gradients, lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9), optimizer="momentum",
        learning_rate=0.01)
    velocity = optimizer.state[w]["momentum_buffer"].float().numpy()
    np.testing.assert_array_equal(np.asarray(engine.state["w.momentum_v"]).astype(np.float32), velocity)
    # the weights within a unit in the last place: torch steps by the rounded velocity, ours by the unrounded one
    np.testing.assert_allclose(np.asarray(engine.state["w"]).astype(np.float64), w.detach().double().numpy(),
                               rtol=torch.finfo(half).eps)


@pytest.mark.parametrize("dtype", list(HALF))
def test_adamw_decays_half_precision_weights_as_torch(dtype):
    """torch.optim.AdamW multiplies a bfloat16/float16 weight by 1 - lr * wd in float32 and rounds the product
    once; the factor rounded to the weight's type first decayed it by another amount every step (float16's
    0.99707 for 0.997, bfloat16's 0.99609). Here the decay is all that moves the weights (lr 1e-6)."""
    half = getattr(torch, dtype)
    gradients = [torch.linspace(-2, 2, 16, dtype=torch.float64).to(half)] * 30
    engine, w, _ = train_half_precision_sum(
        dtype, gradients, lambda p: torch.optim.AdamW(p, lr=1e-6, weight_decay=3000.0), optimizer="adamw",
        learning_rate=1e-6, weight_decay=3000.0)
    np.testing.assert_allclose(np.asarray(engine.state["w"]).astype(np.float64), w.detach().double().numpy(),
                               rtol=torch.finfo(half).eps)


def micro_batches(big: list[tuple[np.ndarray, np.ndarray]], k: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each batch in k equal parts, in order."""
    rows = len(big[0][0]) // k
    return [(x[i * rows:(i + 1) * rows], t[i * rows:(i + 1) * rows]) for x, t in big for i in range(k)]


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_accumulation_with_coupled_weight_decay_equals_one_big_batch(optimizer):
    """accumulate=2 with torch's coupled weight decay and no clipping: the decay joins the gradient once per update.
    The accumulators had carried the decayed gradient on (the decay wrote into the accumulated gradients' mapping),
    so every micro-batch added weight_decay * param: k times torch's decay."""
    k = 2
    big = batches(STEPS)
    losses, state, _ = train_onnxtrain(micro_batches(big, k), optimizer=optimizer, weight_decay=0.5, accumulate=k)
    make = {"sgd": lambda m: torch.optim.SGD(m.parameters(), lr=LR, weight_decay=0.5),
            "adam": lambda m: torch.optim.Adam(m.parameters(), lr=LR, weight_decay=0.5)}[optimizer]
    mean_losses = np.mean(np.reshape(losses, (STEPS, k)), axis=1)  # the big batch's mean loss
    assert_same_training((mean_losses, state), train_torch(big, make))


def test_accumulation_equals_one_big_batch():
    """accumulate=2 over micro-batches of 4 rows == torch on the batches of 8 they make (AdamW with no-decay
    groups, clipping, and a learning-rate schedule). Only the rate fed with an update's last micro-batch counts,
    so the first micro-batch gets a rate that would wreck training if it were used."""
    k, max_norm = 2, 0.5
    big = batches(STEPS)
    micro = micro_batches(big, k)
    schedule = [LR * (1 - u / STEPS) for u in range(STEPS)]
    rates = [np.float32(schedule[i // k]) if i % k == k - 1 else np.float32(100.0) for i in range(len(micro))]

    m = module()
    optimizer = torch.optim.AdamW(groups(m, rank_at_most_1, 1.0), lr=LR)
    expected_losses = []
    for u, (x, t) in enumerate(big):
        for group in optimizer.param_groups:
            group["lr"] = schedule[u]
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(m(torch.from_numpy(x)), torch.from_numpy(t))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm)
        optimizer.step()
        expected_losses.append(loss.item())
    losses, state, engine = train_onnxtrain(micro, rates=rates, optimizer="adamw", weight_decay=1.0, no_decay=True,
                                            clip_grad_norm=max_norm, accumulate=k)
    mean_losses = np.mean(np.reshape(losses, (STEPS, k)), axis=1)  # the big batch's mean loss
    assert_same_training((mean_losses, state), (expected_losses, {n: p.detach().numpy()
                                                                  for n, p in m.named_parameters()}))
    assert int(state["train.step"]) == STEPS  # Adam's step count advanced once per update
    engine.train_step({"X": micro[0][0], "target": micro[0][1], "learning_rate": np.float32(100.0)})
    for name in ("0.weight", "3.bias"):  # a first micro-batch only accumulates
        np.testing.assert_array_equal(np.asarray(engine.state[name]), state[name])


def test_fit_schedules_accumulated_updates_as_a_torch_scheduler(tmp_path):
    """fit's schedule numbers optimizer updates under accumulate=3, as torch's LambdaLR steps once per
    optimizer.step(): update u uses schedule(u). It had been called with engine.step_count, a count of
    micro-batches, so update u used schedule(3u + 2) (weights 1e-2 from torch's). The run stops inside an
    accumulation window and goes on from its exported checkpoint: the update count is the checkpoint's too."""
    k, updates = 3, 5
    micro = batches(k * updates, rows=4)
    m = module()
    optimizer = torch.optim.SGD(m.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda u: 0.5**u)
    for u in range(updates):
        optimizer.zero_grad()
        for x, t in micro[u * k:(u + 1) * k]:
            (torch.nn.functional.mse_loss(m(torch.from_numpy(x)), torch.from_numpy(t)) / k).backward()
        optimizer.step()
        scheduler.step()
    engine = onnxtrain.load(onnxtrain.make_trainable(onnx_model(module()), loss="mse", optimizer="sgd",
                                                     accumulate=k, accumulate_by="micro_batch"))
    feeds = [{"X": x, "target": t} for x, t in micro]
    schedule = lambda u: 0.1 * 0.5**u  # noqa: E731
    onnxtrain.fit(engine, feeds[:7], 7, learning_rate=schedule, progress=False)  # 2 updates and 1 micro-batch
    engine.export(tmp_path / "ckpt.onnx")
    resumed = onnxtrain.load(tmp_path / "ckpt.onnx")
    history = onnxtrain.fit(resumed, feeds[7:], len(feeds) - 7, learning_rate=schedule, log_every=3, progress=False)
    assert history.steps == [7, 9, 12, 14]  # train steps (micro-batches), numbered as the engine counts them
    for name, value in m.named_parameters():
        np.testing.assert_allclose(np.asarray(resumed.state[name]), value.detach().numpy(), rtol=1e-5, atol=1e-5,
                                   err_msg=name)


VOCAB, WIDTH, K = 7, 4, 3
# labels that count (not -100) in each micro-batch of 2 x 5 tokens, k=3 per update: counts far apart (an update's
# micro-batches weigh 10 : 3 : 6 by them, alike by the naive loop), one micro-batch with none
COUNTS = [10, 3, 6, 0, 8, 1, 5, 9, 2]


class TinyLM(torch.nn.Module if torch else object):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = torch.nn.Embedding(VOCAB, WIDTH), torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, ids):
        return self.head(torch.tanh(self.embed(ids)))


def tiny_lm_onnx(m: TinyLM) -> onnx.ModelProto:
    """TinyLM as its dynamo export keeps it (parameters under named_parameters()'s names), written directly."""
    nodes = [
        helper.make_node("Gather", ["embed.weight", "ids"], ["e"]),
        helper.make_node("Tanh", ["e"], ["h"]),
        helper.make_node("Transpose", ["head.weight"], ["w"], perm=[1, 0]),
        helper.make_node("MatMul", ["h", "w"], ["s"]),
        helper.make_node("Add", ["s", "head.bias"], ["logits"]),
    ]
    weights = [numpy_helper.from_array(p.detach().numpy().copy(), n) for n, p in m.named_parameters()]
    graph = helper.make_graph(nodes, "lm", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["N", "T"])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", "T", VOCAB])],
                              weights)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def lm_micro_batches(counts: list[int]) -> list[tuple[np.ndarray, np.ndarray]]:
    """(ids, labels) of 2 x 5 tokens, labels -100 but at counts[i] random positions (Hugging Face's padding)."""
    rng = np.random.default_rng(2)
    data = []
    for count in counts:
        ids, labels = rng.integers(0, VOCAB, (2, 5)), rng.integers(0, VOCAB, (2, 5))
        labels.reshape(-1)[rng.permutation(10)[count:]] = -100
        data.append((ids, labels))
    return data


def train_lm_onnxtrain(data, optimizer: str, **options) -> onnxtrain.Engine:
    model = onnxtrain.make_trainable(tiny_lm_onnx(TinyLM()), loss="cross_entropy", class_axis=-1,
                                     optimizer=optimizer, learning_rate=0.1, accumulate=K, **options)
    engine = onnxtrain.load(model)
    for ids, labels in data:
        engine.train_step({"ids": ids, "target": labels})
    return engine


def train_lm_torch(data, optimizer: str, rule: str, max_norm: float | None = None) -> dict[str, np.ndarray]:
    """The loops of Hugging Face's Trainer (>= 4.46: each micro-batch's summed loss over the update's count of
    labels that count, `num_items_in_batch`) and torch's naive one (each micro-batch's mean loss / k)."""
    m = TinyLM()
    make = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW}[optimizer]
    opt = make(m.parameters(), lr=0.1)
    for u in range(0, len(data), K):
        window = [(torch.from_numpy(ids), torch.from_numpy(labels)) for ids, labels in data[u:u + K]]
        items = sum(int((labels != -100).sum()) for _, labels in window)
        opt.zero_grad()
        for ids, labels in window:
            logits, labels = m(ids).reshape(-1, VOCAB), labels.reshape(-1)
            if rule == "items":
                loss = torch.nn.functional.cross_entropy(logits, labels, reduction="sum") / items
            else:
                loss = torch.nn.functional.cross_entropy(logits, labels) / K
            loss.backward()
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm)
        opt.step()
    return {n: p.detach().numpy() for n, p in m.named_parameters()}


@pytest.mark.parametrize("optimizer, max_norm", [("sgd", None), ("adamw", 0.5)])
def test_accumulation_of_padded_labels_trains_on_the_union_as_hugging_face(optimizer, max_norm):
    """accumulate=3 over micro-batches with different counts of -100 labels (one with none that count):
    accumulate_by="items" (the default) equals Hugging Face's Trainer, which divides the update's summed loss by
    its count of labels (one step on the union), and "micro_batch" torch's naive `(loss / k).backward()` loop. The
    default had been the naive loop, which weighs a micro-batch of 3 labels as one of 10."""
    data = lm_micro_batches(COUNTS)
    union = train_lm_torch(data, optimizer, "items", max_norm)
    naive = train_lm_torch(data, optimizer, "micro_batch", max_norm)
    assert max(np.max(np.abs(union[n] - naive[n])) for n in union) > 1e-2  # the data tell the two rules apart
    for rule, expected in (("items", union), ("micro_batch", naive)):
        engine = train_lm_onnxtrain(data, optimizer, clip_grad_norm=max_norm, accumulate_by=rule)
        assert int(engine.state["train.micro_step"]) == 0
        for name, value in expected.items():
            np.testing.assert_allclose(np.asarray(engine.state[name]), value, rtol=1e-5, atol=1e-6,
                                       err_msg=f"{rule} {name}")


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_accumulation_with_a_smaller_last_micro_batch_equals_one_big_batch(optimizer):
    """accumulate=3 over micro-batches of 4, 4 and 2 rows (a data set's last) with mse == torch on the batches of
    10 they make: each micro-batch weighs by its elements. Weighed alike, the 2 rows had counted as 4."""
    big = batches(STEPS, rows=10)
    micro = [(x[a:b], t[a:b]) for x, t in big for a, b in ((0, 4), (4, 8), (8, 10))]
    losses, state, _ = train_onnxtrain(micro, optimizer=optimizer, accumulate=3)
    make = {"sgd": lambda m: torch.optim.SGD(m.parameters(), lr=LR),
            "adam": lambda m: torch.optim.Adam(m.parameters(), lr=LR)}[optimizer]
    big_losses = np.average(np.reshape(losses, (STEPS, 3)), axis=1, weights=[4, 4, 2])
    assert_same_training((big_losses, state), train_torch(big, make))


def test_an_update_whose_labels_are_all_ignored_leaves_sgd_where_it_was():
    """An update whose 3 micro-batches hold only -100 labels: a zero gradient (torch's), not 0 / 0: SGD leaves the
    parameters as they were and no state variable is NaN."""
    data = lm_micro_batches([10, 3, 6, 0, 0, 0])
    engine = train_lm_onnxtrain(data[:3], "sgd")
    before = {n: np.asarray(v) for n, v in engine.state.items()}
    for ids, labels in data[3:]:
        engine.train_step({"ids": ids, "target": labels})
    for name, value in engine.state.items():
        assert not np.isnan(np.asarray(value)).any(), name
    for name in ("embed.weight", "head.weight", "head.bias"):
        np.testing.assert_array_equal(np.asarray(engine.state[name]), before[name])


def test_a_checkpoint_inside_an_accumulation_window_resumes_exactly(tmp_path):
    """save_state after two micro-batches of the second update holds their count (train.items_sum), so the resumed
    run ends where the uninterrupted run does, bit for bit (AdamW, clipped)."""
    data = lm_micro_batches(COUNTS)
    whole = train_lm_onnxtrain(data, "adamw", clip_grad_norm=0.5)
    first = train_lm_onnxtrain(data[:5], "adamw", clip_grad_norm=0.5)
    assert float(first.state["train.items_sum"]) == COUNTS[3] + COUNTS[4]
    first.save_state(tmp_path / "mid.npz")
    resumed = onnxtrain.load(onnxtrain.make_trainable(tiny_lm_onnx(TinyLM()), loss="cross_entropy", class_axis=-1,
                                                      optimizer="adamw", learning_rate=0.1, accumulate=K,
                                                      clip_grad_norm=0.5))
    resumed.load_state(tmp_path / "mid.npz")
    for ids, labels in data[5:]:
        resumed.train_step({"ids": ids, "target": labels})
    for name, value in whole.state.items():
        np.testing.assert_array_equal(np.asarray(resumed.state[name]), np.asarray(value), err_msg=name)


def test_a_loss_output_accumulates_each_micro_batch_alike():
    """loss="output:NAME": what the model's loss averages over is not in the graph, so accumulate_by="items" (the
    default) weighs its micro-batches alike, saying so: the training graph is accumulate_by="micro_batch"'s."""
    model = onnx_model(module())
    model.graph.node.append(helper.make_node("ReduceSumSquare", ["Y"], ["loss_out"], keepdims=0))
    model.graph.output.append(helper.make_tensor_value_info("loss_out", TensorProto.FLOAT, []))
    with pytest.warns(UserWarning, match="its 2 micro-batches weigh alike"):
        items = onnxtrain.make_trainable(model, loss="output:loss_out", accumulate=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said explicitly: no warning
        alike = onnxtrain.make_trainable(model, loss="output:loss_out", accumulate=2, accumulate_by="micro_batch")
    assert items.training_info[0] == alike.training_info[0]


@pytest.mark.parametrize("options, message", [
    ({"optimizer": "adam", "norm_coefficient": 0.1}, "norm_coefficient: use weight_decay="),
    ({"optimizer": "momentum", "epsilon": 0.1}, "optimizer 'momentum' has no option 'epsilon'"),
    ({"optimizer": "adam", "alpha": float("nan")}, "alpha must be a finite number"),
    ({"optimizer": "rmsprop"}, "optimizer must be one of"),
    ({"optimizer": "adamw", "beta": 1.0}, "Adam needs 0 <= alpha < 1, 0 <= beta < 1"),
    ({"optimizer": "adamw", "weight_decay": -1.0}, "weight_decay must be a finite number >= 0"),
    ({"optimizer": "adam", "no_decay": True}, "excludes parameters from a weight decay of 0"),
    ({"optimizer": "adamw", "no_decay": "LayerNorm"},
     "no_decay: no trainable parameter.s name contains.*no_decay=True"),
    ({"optimizer": "adamw", "no_decay": "("}, "is not a regular expression"),
    ({"optimizer": "adam", "clip_grad_norm": 0.0}, "clip_grad_norm must be a finite number > 0"),
    ({"optimizer": "adam", "accumulate": 0}, "accumulate must be an integer >= 1"),
    ({"optimizer": "adam", "accumulate": 2.0}, "accumulate must be an integer >= 1"),
    ({"optimizer": "adam", "accumulate": 2, "accumulate_by": "tokens"},
     "accumulate_by must be one of .'items', 'micro_batch'. .*got 'tokens'"),
])
def test_bad_optimizer_options_are_refused(options, message):
    with pytest.raises(AuthoringError, match=message.replace("(", r"\(")):
        onnxtrain.make_trainable(onnx_model(module()), **options)


@pytest.mark.parametrize("accumulate_by", [None, "micro_batch"])
def test_cli_passes_the_optimizer_options(accumulate_by, tmp_path):
    onnx.save(onnx_model(module()), tmp_path / "mlp.onnx")
    given = [] if accumulate_by is None else ["--accumulate-by", accumulate_by]
    result = subprocess.run([sys.executable, "-m", "onnxtrain.cli", "make-trainable", tmp_path / "mlp.onnx",
                             "--optimizer", "adamw", "--weight-decay", "0.5", "--no-decay", "--clip-grad-norm", "1",
                             "--accumulate", "3", *given, "-o", tmp_path / "out.onnx"], capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stderr
    expected = onnxtrain.make_trainable(onnx_model(module()), optimizer="adamw", weight_decay=0.5, no_decay=True,
                                        clip_grad_norm=1.0, accumulate=3, accumulate_by=accumulate_by or "items")
    assert onnx.load(tmp_path / "out.onnx").training_info[0] == expected.training_info[0]
