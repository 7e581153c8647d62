"""A Gather or Slice of rows computed on those rows, back through the ops that made them
(onnxtrain/lower/selection.py): inference against onnx's reference, training against PyTorch loops, where the
selection must stop, and the compiled programs holding the small products instead of the whole ones (so these
tests fail if the selection stops being followed)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import onnxtrain
from nodes import run_both

RNG = np.random.default_rng(0)
BATCH, POSITIONS, HIDDEN, INNER, VOCABULARY = 2, 5, 4, 6, 7
FULL_PRODUCT = f"f32[{BATCH * POSITIONS},{VOCABULARY}]"  # the head's product over every position, flattened


def rand(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


WEIGHTS = {"W1": rand(HIDDEN, INNER), "W2": rand(INNER, VOCABULARY)}
FEEDS = {"X": rand(BATCH, POSITIONS, HIDDEN)}

# selection node (reading "logits"), its extra initializers, and the selection as NumPy indexing
SELECTIONS = {
    "last position": (helper.make_node("Gather", ["logits", "last"], ["Z"], axis=1),
                      {"last": np.array(-1, np.int64)}, lambda y: y[:, -1]),
    "two positions": (helper.make_node("Gather", ["logits", "some"], ["Z"], axis=-2),
                      {"some": np.array([[0, 3]], np.int64)}, lambda y: y[:, [[0, 3]]]),
    "one sample": (helper.make_node("Gather", ["logits", "first"], ["Z"], axis=0),
                   {"first": np.array([1], np.int64)}, lambda y: y[[1]]),
    "slice of positions": (helper.make_node("Slice", ["logits", "starts", "ends", "axes"], ["Z"]),
                           {"starts": np.array([-2], np.int64), "ends": np.array([2**62], np.int64),
                            "axes": np.array([1], np.int64)}, lambda y: y[:, -2:]),
}
# selections that are not reordered: along the vocabulary axis (W's own); of most rows (nothing to gain)
KEPT = {
    "vocabulary axis": (helper.make_node("Gather", ["logits", "last"], ["Z"], axis=-1),
                        {"last": np.array(-1, np.int64)}, lambda y: y[..., -1]),
    "most positions": (helper.make_node("Slice", ["logits", "starts", "ends", "axes"], ["Z"]),
                       {"starts": np.array([0], np.int64), "ends": np.array([-1], np.int64),
                        "axes": np.array([1], np.int64)}, lambda y: y[:, :-1]),
}


def selected_shape(pick) -> list[int]:
    return list(pick(np.zeros((BATCH, POSITIONS, VOCABULARY))).shape)


def head_model(select: onnx.NodeProto, extra: dict[str, np.ndarray], pick, also_output_logits: bool = False,
               opset: int = 18) -> onnx.ModelProto:
    """X [batch, positions, hidden] -> Tanh(X W1) W2 = logits [batch, positions, vocabulary] -> Z, a selection."""
    nodes = [helper.make_node("MatMul", ["X", "W1"], ["xw"]), helper.make_node("Tanh", ["xw"], ["hidden"]),
             helper.make_node("MatMul", ["hidden", "W2"], ["logits"]), select]
    outputs = [helper.make_tensor_value_info("Z", TensorProto.FLOAT, selected_shape(pick))]
    if also_output_logits:
        outputs.append(helper.make_tensor_value_info("logits", TensorProto.FLOAT, [BATCH, POSITIONS, VOCABULARY]))
    graph = helper.make_graph(
        nodes, "head", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [BATCH, POSITIONS, HIDDEN])],
        outputs, [numpy_helper.from_array(v, k) for k, v in {**WEIGHTS, **extra}.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def compiled_text(engine: onnxtrain.Engine, feeds: dict, algorithm: int | None = None) -> str:
    return engine.lower(feeds, algorithm).compile().as_text()


@pytest.mark.parametrize("case", [*SELECTIONS, *KEPT])
def test_inference_matches_the_reference(case):
    select, extra, pick = {**SELECTIONS, **KEPT}[case]
    ours, theirs = run_both(head_model(select, extra, pick), FEEDS)
    assert ours[0].shape == theirs[0].shape
    np.testing.assert_allclose(ours[0], theirs[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", SELECTIONS)
def test_the_program_multiplies_only_the_selected_rows(case):
    select, extra, pick = SELECTIONS[case]
    engine = onnxtrain.load(head_model(select, extra, pick))
    assert FULL_PRODUCT not in compiled_text(engine, FEEDS)


@pytest.mark.parametrize("case", KEPT)
def test_selections_not_worth_reordering_leave_the_product_whole(case):
    select, extra, pick = KEPT[case]
    assert FULL_PRODUCT in compiled_text(onnxtrain.load(head_model(select, extra, pick)), FEEDS)


def test_a_product_read_elsewhere_is_computed_whole_and_both_outputs_are_right():
    select, extra, pick = SELECTIONS["last position"]
    model = head_model(select, extra, pick, also_output_logits=True)
    ours, theirs = run_both(model, FEEDS)
    for mine, ref in zip(ours, theirs):
        np.testing.assert_allclose(mine, ref, rtol=1e-5, atol=1e-6)
    assert FULL_PRODUCT in compiled_text(onnxtrain.load(model), FEEDS)


def trains_as_pytorch(model: onnx.ModelProto, weights: dict[str, np.ndarray], forward, target_shape,
                      remat: bool | str = False) -> tuple[onnxtrain.Engine, dict]:
    """Three SGD steps of `model` on MSE (mean) against torch.optim.SGD on `forward(params, X)`, the same
    computation written in PyTorch; the engine and its feeds, for a look at the compiled step."""
    lr, steps = 0.1, 3
    engine = onnxtrain.load(onnxtrain.make_trainable(model, loss="mse", optimizer="sgd", learning_rate=lr,
                                                     trainable=list(weights)), remat=remat)
    target = rand(*target_shape)
    feeds = {**FEEDS, "target": target}
    for _ in range(steps):
        engine.train_step(feeds)
    params = {k: torch.tensor(v, requires_grad=True) for k, v in weights.items()}
    optimizer = torch.optim.SGD(params.values(), lr=lr)
    for _ in range(steps):
        optimizer.zero_grad()
        prediction = forward(params, torch.tensor(FEEDS["X"]))
        torch.nn.functional.mse_loss(prediction, torch.tensor(target)).backward()
        optimizer.step()
    for name, value in params.items():
        np.testing.assert_allclose(np.asarray(engine.state[name]), value.detach().numpy(), rtol=1e-4, atol=1e-5,
                                   err_msg=name)
    return engine, feeds


@pytest.mark.parametrize("case", [*SELECTIONS, *KEPT])
def test_training_matches_a_pytorch_loop(case):
    select, extra, pick = {**SELECTIONS, **KEPT}[case]
    engine, feeds = trains_as_pytorch(head_model(select, extra, pick), WEIGHTS,
                                      lambda p, x: pick(torch.tanh(x @ p["W1"]) @ p["W2"]), selected_shape(pick))
    if case in SELECTIONS:
        assert FULL_PRODUCT not in compiled_text(engine, feeds, algorithm=0)


# A transformer-like last layer: X -> a = LayerNorm(X W1) -> y = LayerNorm(a + Tanh(a W2)) -> logits = y W3; the
# selection then reaches back to X (a is read twice, both inside what is computed on rows).
LAYER_WEIGHTS = {"W1": rand(HIDDEN, INNER), "s1": rand(INNER), "b1": rand(INNER), "W2": rand(INNER, INNER),
                 "s2": rand(INNER), "b2": rand(INNER), "W3": rand(INNER, VOCABULARY)}
FIRST = {"first": np.array(0, np.int64)}


def layer_model(extra_nodes=(), extra_weights=None, extra_outputs=(), norm_axis: int = -1,
                select=None, selected: tuple[int, ...] = (BATCH, VOCABULARY), opset: int = 18) -> onnx.ModelProto:
    n = helper.make_node
    nodes = [n("MatMul", ["X", "W1"], ["xw"]),
             n("LayerNormalization", ["xw", "s1", "b1"], ["a"], axis=-1),
             n("MatMul", ["a", "W2"], ["f"]), n("Tanh", ["f"], ["g"]), n("Add", ["a", "g"], ["r"]),
             *extra_nodes,
             n("LayerNormalization", ["r", "s2", "b2"], ["y"], axis=norm_axis),
             n("MatMul", ["y", "W3"], ["logits"]),
             select or n("Gather", ["logits", "first"], ["Z"], axis=1)]
    outputs = [helper.make_tensor_value_info("Z", TensorProto.FLOAT, list(selected))]
    outputs += [helper.make_tensor_value_info(name, TensorProto.FLOAT, shape) for name, shape in extra_outputs]
    weights = {**LAYER_WEIGHTS, **FIRST, **(extra_weights or {})}
    graph = helper.make_graph(
        nodes, "layer", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [BATCH, POSITIONS, HIDDEN])],
        outputs, [numpy_helper.from_array(v, k) for k, v in weights.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def assert_matches_reference(model: onnx.ModelProto) -> None:
    ours, theirs = run_both(model, FEEDS)
    for mine, ref in zip(ours, theirs):
        assert mine.shape == ref.shape
        np.testing.assert_allclose(mine, ref, rtol=1e-4, atol=1e-5)


def full(width: int) -> str:
    """An HLO shape of a whole [batch * positions, width] product."""
    return f"f32[{BATCH * POSITIONS},{width}]"


def test_a_last_layer_is_computed_on_the_selected_rows_only():
    model = layer_model()
    assert_matches_reference(model)
    text = compiled_text(onnxtrain.load(model), FEEDS)
    assert not any(full(width) in text for width in (INNER, VOCABULARY))


@pytest.mark.parametrize("remat", [False, True, "attention"])
def test_a_last_layer_trains_as_a_pytorch_loop(remat):
    # recomputed (remat=True), the nodes run in segments JAX traces apart: a selection reaching into an earlier
    # segment's values would leak them out of their trace
    norm = torch.nn.functional.layer_norm

    def forward(p: dict, x: torch.Tensor) -> torch.Tensor:
        a = norm(x @ p["W1"], (INNER,), p["s1"], p["b1"])
        y = norm(a + torch.tanh(a @ p["W2"]), (INNER,), p["s2"], p["b2"])
        return (y @ p["W3"])[:, 0]

    engine, feeds = trains_as_pytorch(layer_model(), LAYER_WEIGHTS, forward, (BATCH, VOCABULARY), remat)
    if remat is not True:  # recomputed in segments, rows are followed within the selection's segment only
        assert full(INNER) not in compiled_text(engine, feeds, algorithm=0)


def test_a_value_read_outside_is_computed_whole_and_selected_where_it_stands():
    # `a` is also summed by another node: it is computed whole (and the product before it), then selected
    model = layer_model([helper.make_node("ReduceSum", ["a"], ["side"])], extra_outputs=[("side", [1, 1, 1])])
    assert_matches_reference(model)
    assert full(INNER) in compiled_text(onnxtrain.load(model), FEEDS)


@pytest.mark.parametrize("case", ["positions broadcast", "size-1 broadcast", "normalized from a positive axis"])
def test_ops_that_do_not_take_rows_alone_stop_the_selection_with_the_same_numbers(case):
    n = helper.make_node
    if case == "positions broadcast":  # [positions, inner] added to [batch, positions, inner]: it reaches the axis
        model = layer_model([n("Add", ["r", "P"], ["rp"]), n("Identity", ["rp"], ["r2"])],
                            {"P": rand(POSITIONS, INNER)})
    elif case == "size-1 broadcast":  # a [1, 1, inner] operand of the same rank
        model = layer_model([n("Mul", ["r", "S"], ["rp"])], {"S": rand(1, 1, INNER)})
    else:  # LayerNormalization axis=2 counts from the front: a scalar Gather's rows have one axis fewer
        model = layer_model(norm_axis=2)
    if case != "normalized from a positive axis":  # the block's output goes on from the extra node's
        graph = model.graph
        for node in graph.node:
            if node.op_type == "LayerNormalization" and node.input[0] == "r":
                node.input[0] = "r2" if case == "positions broadcast" else "rp"
    assert_matches_reference(model)


def test_a_positive_normalization_axis_still_takes_rows_that_keep_their_rank():
    select = helper.make_node("Gather", ["logits", "some"], ["Z"], axis=1)
    model = layer_model(norm_axis=2, select=select, selected=(BATCH, 2, VOCABULARY),
                        extra_weights={"some": np.array([0, 3], np.int64)})
    assert_matches_reference(model)
    assert full(INNER) not in compiled_text(onnxtrain.load(model), FEEDS)


# GPT-2's and T5's forms: a Conv1D as Reshape to rows, Gemm, Reshape back; an RMS norm (ReduceMean over the last
# axis) with its weight as the first operand of Mul
RMS_WEIGHTS = {"W1": rand(HIDDEN, INNER), "c1": rand(INNER), "scale": rand(INNER), "W3": rand(INNER, VOCABULARY)}


def rms_model() -> onnx.ModelProto:
    n = helper.make_node
    nodes = [n("Reshape", ["X", "rows_shape"], ["flat"]), n("Gemm", ["flat", "W1", "c1"], ["mm"]),
             n("Reshape", ["mm", "back_shape"], ["h"]), n("Pow", ["h", "two"], ["sq"]),
             n("ReduceMean", ["sq", "last_axis"], ["ms"], keepdims=1), n("Add", ["ms", "eps"], ["mse"]),
             n("Sqrt", ["mse"], ["rms"]), n("Reciprocal", ["rms"], ["inv"]), n("Mul", ["h", "inv"], ["normed"]),
             n("Mul", ["scale", "normed"], ["y"]), n("MatMul", ["y", "W3"], ["logits"]),
             n("Gather", ["logits", "last"], ["Z"], axis=1)]
    weights = {**RMS_WEIGHTS, "rows_shape": np.array([-1, HIDDEN], np.int64),
               "back_shape": np.array([BATCH, POSITIONS, INNER], np.int64), "two": np.array(2.0, np.float32),
               "last_axis": np.array([-1], np.int64), "eps": np.array(1e-6, np.float32),
               "last": np.array(-1, np.int64)}
    graph = helper.make_graph(
        nodes, "rms", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [BATCH, POSITIONS, HIDDEN])],
        [helper.make_tensor_value_info("Z", TensorProto.FLOAT, [BATCH, VOCABULARY])],
        [numpy_helper.from_array(v, k) for k, v in weights.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_rows_are_followed_through_reshapes_gemm_and_a_reduction():
    model = rms_model()
    assert_matches_reference(model)
    text = compiled_text(onnxtrain.load(model), FEEDS)
    assert not any(full(width) in text for width in (INNER, VOCABULARY))


def test_the_rms_model_trains_as_a_pytorch_loop():
    def forward(p: dict, x: torch.Tensor) -> torch.Tensor:
        h = (x.reshape(-1, HIDDEN) @ p["W1"] + p["c1"]).reshape(BATCH, POSITIONS, INNER)
        y = p["scale"] * (h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6))
        return (y @ p["W3"])[:, -1]

    engine, feeds = trains_as_pytorch(rms_model(), RMS_WEIGHTS, forward, (BATCH, VOCABULARY))
    assert full(INNER) not in compiled_text(engine, feeds, algorithm=0)


class LastPosition(torch.nn.Module):
    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.model(*inputs)[:, -1]


@pytest.mark.parametrize("dynamo", [True, False], ids=["dynamo", "torchscript"])
def test_an_exported_language_model_keeping_its_last_position_trains_as_pytorch_on_that_position(dynamo, tmp_path):
    """GPT-2 with its own head (the word embedding then trains by rows too: lower/sparse_update.py), exported by
    both of PyTorch's exporters, trained by SGD on the last position's logits against a PyTorch loop."""
    pytest.importorskip("transformers")
    pytest.importorskip("onnxscript")
    from zoo_models import BATCH as batch, SEQ as length, VOCAB as vocabulary, gpt2, mask

    rng = np.random.default_rng(1)
    inputs = (rng.integers(0, vocabulary, (batch, length)).astype(np.int64), mask())
    labels = rng.integers(0, vocabulary, batch).astype(np.int64)
    torch.manual_seed(0)
    module = LastPosition(gpt2(tied=False)).eval()
    torch.onnx.export(module, tuple(torch.from_numpy(a) for a in inputs), tmp_path / "model.onnx", dynamo=dynamo)
    model = onnx.load(tmp_path / "model.onnx")
    lr, steps = 0.1, 3
    engine = onnxtrain.load(onnxtrain.make_trainable(model, loss="cross_entropy", optimizer="sgd",
                                                     learning_rate=lr))
    feeds = {**dict(zip([i.name for i in model.graph.input], inputs)), "target": labels}
    losses = [float(engine.train_step(feeds)["loss"]) for _ in range(steps)]
    optimizer = torch.optim.SGD(module.parameters(), lr=lr)
    expected = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(module(*(torch.from_numpy(a) for a in inputs)),
                                                 torch.from_numpy(labels))
        loss.backward()
        optimizer.step()
        expected.append(loss.item())
    np.testing.assert_allclose(losses, expected, rtol=1e-4)
    text = compiled_text(engine, feeds, algorithm=0)
    assert f"f32[{batch * length},{vocabulary}]" not in text and f"f32[{batch},{length},{vocabulary}]" not in text


def random_chain(seed: int) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """X [2, 6, 4] through 2-7 random row-wise steps (products, biases, activations, residual adds of an earlier
    value, norms, an RMS norm, reshapes to rows and back, size-1 and per-position broadcasts), then a random
    Gather, Slice or GatherND along axis 0 or 1; sometimes another node reads an intermediate value too."""
    rng = np.random.default_rng(seed)
    n = helper.make_node
    batch, length = 2, 6
    nodes, weights, values = [], {}, {"X": 4}  # 3-D values by width (for residual adds)
    current, width = "X", 4

    def weight(name: str, array: np.ndarray) -> str:
        weights[name] = array.astype(np.float32) if array.dtype.kind == "f" else array
        return name

    for k in range(int(rng.integers(2, 8))):
        out, kind = f"v{k}", rng.choice(["matmul", "gemm rows", "bias", "relu", "residual", "norm", "rms",
                                          "ones", "positions"])
        if kind == "matmul":
            wide = int(rng.integers(3, 7))
            nodes.append(n("MatMul", [current, weight(f"w{k}", rng.standard_normal((width, wide)))], [out]))
            width = wide
        elif kind == "gemm rows":  # Reshape to rows, Gemm, Reshape back: GPT-2's Conv1D
            wide = int(rng.integers(3, 7))
            nodes += [n("Reshape", [current, weight(f"r{k}", np.array([-1, width]))], [f"{out}r"]),
                      n("Gemm", [f"{out}r", weight(f"w{k}", rng.standard_normal((width, wide))),
                                 weight(f"c{k}", rng.standard_normal(wide))], [f"{out}g"]),
                      n("Reshape", [f"{out}g", weight(f"s{k}", np.array([batch, length, wide]))], [out])]
            width = wide
        elif kind == "bias":
            nodes.append(n("Add", [current, weight(f"b{k}", rng.standard_normal(width))], [out]))
        elif kind == "relu":
            nodes.append(n("Relu", [current], [out]))
        elif kind == "residual":
            earlier = [v for v, w in values.items() if w == width]
            nodes.append(n("Add", [str(rng.choice(earlier)), current], [out]))
        elif kind == "norm":
            nodes.append(n("LayerNormalization", [current, weight(f"g{k}", rng.standard_normal(width)),
                                                  weight(f"b{k}", rng.standard_normal(width))], [out],
                           axis=int(rng.choice([-1, 2, 1]))))
        elif kind == "rms":
            nodes += [n("Mul", [current, current], [f"{out}s"]),
                      n("ReduceMean", [f"{out}s", weight(f"a{k}", np.array([-1]))], [f"{out}m"], keepdims=1),
                      n("Add", [f"{out}m", weight(f"e{k}", np.array(1e-3))], [f"{out}e"]),
                      n("Sqrt", [f"{out}e"], [f"{out}q"]), n("Div", [current, f"{out}q"], [out])]
        elif kind == "ones":  # [1, 1, width]: broadcasts over the rows, as the same rank
            nodes.append(n("Mul", [weight(f"o{k}", rng.standard_normal((1, 1, width))), current], [out]))
        else:  # [length, width]: reaches the positions axis, so a selection along it stops here
            nodes.append(n("Add", [current, weight(f"p{k}", rng.standard_normal((length, width)))], [out]))
        values[out] = width
        current = out
    outputs = [helper.make_tensor_value_info("Z", TensorProto.FLOAT, None)]
    if rng.random() < 0.3:  # another reader of an intermediate value
        read = str(rng.choice([v for v in values if v != "X"]))
        nodes.append(n("ReduceSum", [read], ["side"], keepdims=0))
        outputs.append(helper.make_tensor_value_info("side", TensorProto.FLOAT, None))
    kind = rng.choice(["gather", "gather list", "gather samples", "slice", "slice back", "gather nd"])
    if kind == "gather nd":  # (sample, position) pairs
        pairs = np.stack([rng.integers(-batch, batch, 3), rng.integers(-length, length, 3)], axis=-1)
        nodes.append(n("GatherND", [current, weight("i", pairs)], ["Z"]))
    elif kind == "gather":
        nodes.append(n("Gather", [current, weight("i", np.array(int(rng.integers(-length, length))))], ["Z"],
                       axis=int(rng.choice([1, -2]))))
    elif kind == "gather list":
        nodes.append(n("Gather", [current, weight("i", rng.integers(-length, length, (1, 2)))], ["Z"], axis=1))
    elif kind == "gather samples":
        nodes.append(n("Gather", [current, weight("i", np.array([-1]))], ["Z"], axis=0))
    else:
        start, end, step = (-1, -(2**62), -2) if kind == "slice back" else (int(rng.integers(-length, 2)), 2**62, 2)
        nodes.append(n("Slice", [current, weight("st", np.array([start])), weight("en", np.array([end])),
                                 weight("ax", np.array([1])), weight("sp", np.array([step]))], ["Z"]))
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("X", TensorProto.FLOAT,
                                                                             [batch, length, 4])],
                              outputs, [numpy_helper.from_array(v, k) for k, v in weights.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    return model, {"X": rng.standard_normal((batch, length, 4)).astype(np.float32)}


@pytest.mark.parametrize("seed", range(40))
def test_random_chains_of_row_wise_ops_give_the_reference_numbers(seed):
    model, feeds = random_chain(seed)
    ours, theirs = run_both(model, feeds)
    for mine, ref in zip(ours, theirs):
        assert mine.shape == ref.shape
        np.testing.assert_allclose(mine, ref, rtol=1e-4, atol=1e-4)


def test_a_sequence_classifier_picking_each_last_token_trains_as_pytorch_on_those_tokens(tmp_path):
    """GPT2ForSequenceClassification scores every position and keeps each sequence's last non-padding token:
    `logits[arange(batch), last]`, a GatherND at indices the graph computes from the ids (dynamo export; with
    one layer, whose feed-forward then runs on the two kept tokens alone)."""
    pytest.importorskip("transformers")
    pytest.importorskip("onnxscript")
    from transformers import GPT2Config, GPT2ForSequenceClassification
    from zoo_models import perturbed

    class Logits(torch.nn.Module):
        def __init__(self, model: torch.nn.Module):
            super().__init__()
            self.model = model

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.model(input_ids=ids).logits

    config = GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=4, n_positions=32, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, pad_token_id=0, num_labels=3)
    torch.manual_seed(0)
    module = Logits(perturbed(GPT2ForSequenceClassification(config))).eval()
    ids = torch.randint(1, 64, (2, 8))
    ids[0, 5:] = 0  # padding: the first sequence's last token is at position 4
    labels = torch.tensor([0, 2])
    torch.onnx.export(module, (ids,), tmp_path / "model.onnx", dynamo=True)
    model = onnx.load(tmp_path / "model.onnx")
    assert any(node.op_type == "GatherND" for node in model.graph.node)
    engine = onnxtrain.load(onnxtrain.make_trainable(model, loss="cross_entropy", optimizer="sgd",
                                                     learning_rate=0.1))
    feeds = {model.graph.input[0].name: ids.numpy(), "target": labels.numpy()}
    losses = [float(engine.train_step(feeds)["loss"]) for _ in range(3)]
    optimizer, expected = torch.optim.SGD(module.parameters(), lr=0.1), []
    for _ in range(3):
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(module(ids), labels)
        loss.backward()
        optimizer.step()
        expected.append(loss.item())
    np.testing.assert_allclose(losses, expected, rtol=1e-4)
    assert "f32[16,128]" not in compiled_text(engine, feeds, algorithm=0)  # the feed-forward over all 16 tokens


@pytest.mark.parametrize("op,indices", [("Gather", np.array([5], np.int64)), ("GatherND", np.array([[0, 7]], np.int64))])
def test_an_index_out_of_range_is_the_selections_own_error_with_rows_followed_or_not(op, indices):
    """A selection of a row-wise op's result plans on the rows, before the node runs; an index out of range is
    still the node's own error, worded as where nothing precedes it."""
    messages = []
    for data in ("R", "X"):  # the Relu's rows are followed; the graph input has no producer to follow
        graph = helper.make_graph(
            [helper.make_node("Relu", ["X"], ["R"]), helper.make_node(op, [data, "I"], ["Y"])], "g",
            [helper.make_tensor_value_info("X", TensorProto.FLOAT, [2, 4, 3])],
            [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, 4, 3] if op == "Gather" else [1, 3])],
            [numpy_helper.from_array(indices, "I")])
        engine = onnxtrain.load(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
        with pytest.raises(onnxtrain.errors.NodeError, match=f"{op}: IndexError: index") as raised:
            engine.infer({"X": rand(2, 4, 3)})
        messages.append(str(raised.value).split("IndexError: ")[1])
    assert messages[0] == messages[1]
