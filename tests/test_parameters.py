"""make_trainable's default trainable set (onnxtrain/parameters.py) on graphs shaped like the exporters' output:
an RNN's lifted initial state and a folded attention mask are settings, zero-initialized weights stay parameters,
and a BatchNorm folded into a Conv is warned about. tests/test_zoo.py checks the same on real exports."""

from __future__ import annotations

import io
import warnings

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxtrain
from onnxtrain.parameters import select_trainable


def model_of(nodes: list[onnx.NodeProto], inputs: dict[str, list[int]], initializers: dict[str, np.ndarray],
             output: str = "Y") -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs.items()],
        [helper.make_tensor_value_info(output, TensorProto.FLOAT, None)],
        [numpy_helper.from_array(a.astype(np.float32), n) for n, a in initializers.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def default_set(model: onnx.ModelProto) -> list[str]:
    with warnings.catch_warnings():
        warnings.simplefilter("error", onnxtrain.ParameterizationWarning)
        return select_trainable(model, None)


@pytest.mark.parametrize("op, gates, states", [("LSTM", 4, ["h0", "c0"]), ("GRU", 3, ["h0"]), ("RNN", 1, ["h0"])])
def test_a_recurrence_initial_state_is_a_setting(op, gates, states):
    """dynamo lifts PyTorch's zero initial state (h0 and c0 share one val_N) into an initializer; PyTorch never
    trains it, so it is no parameter, whatever its values."""
    rng = np.random.default_rng(0)
    hidden = 4
    weights = {"W": rng.normal(size=(1, gates * hidden, 3)), "R": rng.normal(size=(1, gates * hidden, hidden)),
               "B": rng.normal(size=(1, 2 * gates * hidden))}
    state = {"h0": rng.normal(size=(1, 2, hidden)), "c0": rng.normal(size=(1, 2, hidden))}
    node = helper.make_node(op, ["X", "W", "R", "B", "", *states], ["", "Y"], hidden_size=hidden)
    model = model_of([node], {"X": [5, 2, 3]}, {**weights, **{s: state[s] for s in states}})
    assert default_set(model) == ["W", "R", "B"]


def keras_lstm(producer: str = "tf2onnx", recurrent_bias: float = 0.0) -> onnx.ModelProto:
    """A Keras LSTM as tf2onnx 1.17 converts it (from_keras): the zero initial state is tf.zeros of the batch's
    size, Expand(0-d zero, shape), read as both h0 and c0; B is Keras's one bias [4h] followed by the zero
    recurrent half tf2onnx adds (`recurrent_bias` everywhere instead, for a model with a real one)."""
    rng = np.random.default_rng(5)
    hidden = 3
    nodes = [helper.make_node("Expand", ["zeros", "state_shape"], ["h0"]),
             helper.make_node("LSTM", ["X", "W", "R", "B", "", "h0", "h0"], ["", "Y"], hidden_size=hidden)]
    model = model_of(nodes, {"X": [5, 2, 4]}, {
        "zeros": np.zeros(()), "W": rng.normal(size=(1, 4 * hidden, 4)),
        "R": rng.normal(size=(1, 4 * hidden, hidden)),
        "B": np.concatenate([rng.normal(size=(1, 4 * hidden)), np.full((1, 4 * hidden), recurrent_bias)], 1)})
    model.graph.initializer.append(numpy_helper.from_array(np.array([1, 2, hidden]), "state_shape"))
    model.producer_name = producer
    return model


def test_a_fill_value_expanded_to_a_run_time_shape_is_a_setting():
    """tf2onnx converts tf.zeros / tf.ones of a run-time shape (TensorFlow's Fill) to Expand(0-d value, shape):
    a Keras LSTM's or GRU's zero initial state, and the unit scale and zero shift tf_keras's LayerNormalization
    normalizes with through a BatchNormalization before its own gamma and beta. Keras trains none of them (its
    trainable weights: kernel, recurrent_kernel, bias; gamma, beta); the default set had trained all three, and 5
    SGD steps of a converted Keras LSTM text model, GRU model and Transformer block left Keras's losses by up to
    2e-6, 8e-6 and 7e-2 (tf_keras 2.21, tf2onnx 1.17)."""
    assert default_set(keras_lstm()) == ["W", "R", "B"]
    rng = np.random.default_rng(6)
    nodes = [helper.make_node("Expand", ["ones", "channels"], ["scale"]),
             helper.make_node("Expand", ["zeros", "channels"], ["shift"]),
             helper.make_node("ReduceMean", ["X"], ["mean"], axes=[0, 2], keepdims=0),
             helper.make_node("Sub", ["X", "mean"], ["centred"]),  # the variance a LayerNormalization computes
             helper.make_node("Mul", ["centred", "centred"], ["squares"]),
             helper.make_node("ReduceMean", ["squares"], ["var"], axes=[0, 2], keepdims=0),
             helper.make_node("BatchNormalization", ["X", "scale", "shift", "mean", "var"], ["N"]),
             helper.make_node("Mul", ["N", "gamma"], ["G"]), helper.make_node("Add", ["G", "beta"], ["Y"])]
    model = model_of(nodes, {"X": [1, 6, 4]}, {"ones": np.ones(()), "zeros": np.zeros(()),
                                                "gamma": rng.normal(size=4), "beta": rng.normal(size=4)})
    model.graph.initializer.append(numpy_helper.from_array(np.array([6]), "channels"))
    model.producer_name = "tf2onnx"
    assert default_set(model) == ["gamma", "beta"]


def test_a_torchscript_export_of_an_expanded_0d_parameter_trains_it():
    """The fill-value rule is tf2onnx's: TorchScript exports `alpha.expand(batch, 4)` of a 0-d parameter as the
    same Expand(0-d initializer, run-time shape) with no record, and PyTorch trains alpha (it had been left out
    silently while the rule held for every producer). Two SGD steps against PyTorch's."""
    torch = pytest.importorskip("torch")

    class Shifted(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.alpha = torch.nn.Linear(4, 4), torch.nn.Parameter(torch.tensor(0.5))

        def forward(self, x):
            return self.lin(x) + self.alpha.expand(x.shape[0], 4)

    torch.manual_seed(0)
    module, x, target = Shifted(), torch.randn(3, 4), torch.randn(3, 4)
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (x,), buffer, dynamo=False, input_names=["x"], dynamic_axes={"x": {0: "b"}})
    model = onnx.load_from_string(buffer.getvalue())
    assert any(n.op_type == "Expand" and n.input[0] == "alpha" for n in model.graph.node)
    engine = onnxtrain.load(onnxtrain.make_trainable(model, loss="mse", optimizer="sgd", learning_rate=0.1))
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    for _ in range(2):
        engine.train_step({"x": x.numpy(), "target": target.numpy()})
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(module(x), target).backward()
        optimizer.step()
    np.testing.assert_allclose(float(engine.state["alpha"]), module.alpha.item(), rtol=1e-6)


@pytest.mark.parametrize("producer", ["tf2onnx", "pytorch"])
def test_a_recurrent_bias_added_by_the_converter_trains_as_the_source_models_one_bias(producer):
    """tf2onnx gives a Keras LSTM's one bias b a zero recurrent half Rb in B; every gate adds Wb + Rb, so training
    both halves had moved b twice as far per SGD step as Keras (5 steps of a converted Keras LSTM text model:
    losses 1.0381, 1.0115, 0.9869, 0.9640 after the first, Keras's 1.0387, 1.0126, 0.9885, 0.9661), which was only
    warned about. Rb's gradient is now zero: Rb stays zero and Wb trains as b, as PyTorch's LSTM does with a
    frozen zero bias_hh. A PyTorch export's B holds bias_ih and bias_hh, two parameters: a zero bias_hh trains."""
    import torch
    model = keras_lstm(producer)
    model.graph.output[0].CopyFrom(helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, 2, 3]))  # Y_h
    # named: the 0-d zero state is a fill value in tf2onnx's conversions alone
    engine = onnxtrain.load(onnxtrain.make_trainable(model, loss="mse", optimizer="sgd", learning_rate=0.5,
                                                     trainable=["W", "R", "B"]))
    w, r, b = (numpy_helper.to_array(t)[0] for t in model.graph.initializer if t.name in ("W", "R", "B"))
    gates = np.r_[0:3, 6:12, 3:6]  # ONNX's gates i, o, f, c in torch's order i, f, c, o (hidden 3)
    lstm = torch.nn.LSTM(4, 3)
    with torch.no_grad():
        for p, value in zip(lstm.parameters(), [w[gates], r[gates], b[:12][gates], b[12:][gates]]):
            p.copy_(torch.from_numpy(value))
    lstm.bias_hh_l0.requires_grad_(producer != "tf2onnx")  # Keras's one bias: bias_ih alone
    optimizer = torch.optim.SGD([p for p in lstm.parameters() if p.requires_grad], lr=0.5)
    rng = np.random.default_rng(7)
    for _ in range(3):
        x, y = rng.normal(size=(5, 2, 4)).astype(np.float32), rng.normal(size=(1, 2, 3)).astype(np.float32)
        loss = float(engine.train_step({"X": x, "target": y})["loss"])
        optimizer.zero_grad()
        expected = torch.nn.functional.mse_loss(lstm(torch.from_numpy(x))[1][0], torch.from_numpy(y))
        expected.backward()
        optimizer.step()
        np.testing.assert_allclose(loss, expected.item(), rtol=1e-5)
    trained = np.asarray(engine.state["B"])[0]
    np.testing.assert_allclose(trained[:12][gates], lstm.bias_ih_l0.detach().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(trained[12:][gates], lstm.bias_hh_l0.detach().numpy(), rtol=1e-5, atol=1e-6)
    assert (producer == "tf2onnx") == (not np.any(trained[12:]))


def test_an_all_zero_converted_recurrent_bias_is_warned_about():
    """tf2onnx writes zeros for the bias of a Keras LSTM(use_bias=False), which has none: trained, B's input half
    moves, so an all-zero B of tf2onnx's is warned about (a Keras LSTM's default bias has its forget gate at 1)."""
    model = keras_lstm()
    model.graph.initializer[3].CopyFrom(numpy_helper.from_array(np.zeros((1, 24), np.float32), "B"))
    with pytest.warns(onnxtrain.ParameterizationWarning, match=r"^B: a recurrence's B that is all zeros"):
        assert select_trainable(model, None) == ["W", "R", "B"]
    assert default_set(keras_lstm(recurrent_bias=0.5)) == ["W", "R", "B"]


def additive(shape: tuple[int, ...], value: float = 0.0) -> onnx.ModelProto:
    """Y = MatMul(Add(X, A), M) with A an all-`value` initializer of `shape` and M a random matrix."""
    nodes = [helper.make_node("Add", ["X", "A"], ["S"]), helper.make_node("MatMul", ["S", "M"], ["Y"])]
    return model_of(nodes, {"X": [2, 1, 8, 8]}, {"A": np.full(shape, value),
                                                 "M": np.random.default_rng(1).normal(size=(8, 8))})


def test_a_folded_attention_mask_is_a_setting():
    """dynamo folds an all-visible attention mask into a [batch, 1, query, key] tensor of zeros added to the
    scores (BERT's, ViT's): a constant of the export's batch, not a parameter."""
    assert default_set(additive((2, 1, 8, 8))) == ["M"]
    assert default_set(additive((2, 1, 8, 8), -1.0)) == ["M"]


def test_a_0d_value_read_as_a_fill_value_and_by_elementwise_arithmetic_is_a_setting():
    """The dynamo optimizer merges equal scalars: MobileBERT's export reads one 0.0 as its trigram Pad's fill value
    and as its masks' Where operand. Either reader alone made it a setting; the two together had made it a
    parameter, which training moved (tests/zoo_models.py's mobilebert, dynamo)."""
    nodes = [helper.make_node("Pad", ["X", "pads", "F"], ["P"]), helper.make_node("MatMul", ["P", "M"], ["S"]),
             helper.make_node("Greater", ["S", "F"], ["positive"]),
             helper.make_node("Where", ["positive", "F", "S"], ["Y"])]
    pads = numpy_helper.from_array(np.array([0, 0, 0, 1], np.int64), "pads")
    model = model_of(nodes, {"X": [2, 4]}, {"F": np.zeros(()), "M": np.ones((5, 3))})
    model.graph.initializer.append(pads)
    assert default_set(model) == ["M"]


@pytest.mark.parametrize("shape", [(1, 8, 8), (1, 1, 8, 8), (8, 8), (8,)])
def test_a_zero_initialized_parameter_added_to_activations_stays_a_parameter(shape):
    """A position embedding [1, n, d] or bias broadcasts over the batch (leading axis 1) or has rank < 3: a
    freshly zero-initialized one is still trained."""
    assert default_set(additive(shape)) == ["A", "M"]


def rotary(positions: int, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """Llama's cos and sin tables [1, 1, positions, dim] (float32 arithmetic, as PyTorch computes them)."""
    inv_freq = (1.0 / 10000 ** (np.arange(0, dim, 2, dtype=np.float32) / dim)).astype(np.float32)
    angles = np.arange(positions, dtype=np.float32)[:, None] * inv_freq[None, :]
    angles = np.concatenate([angles, angles], axis=1)
    return np.cos(angles)[None, None], np.sin(angles)[None, None]


def test_rotary_and_sinusoidal_position_tables_are_settings():
    """The cos and sin tables a rotary attention multiplies queries by (Llama's, lifted by the dynamo exporter),
    and a sinusoidal position embedding added to activations (Whisper's frozen one, 1,500 positions), are
    computed from positions, never trained; a weight whose rows merely start at 0 or 1 stays a parameter."""
    cos, sin = rotary(8, 8)
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Mul", ["X", "C"], ["XC"]), helper.make_node("Mul", ["X", "S"], ["XS"]),
             helper.make_node("Add", ["XC", "XS"], ["R"]), helper.make_node("Mul", ["R", "G"], ["Y"])]
    start_like = rng.normal(size=(8, 8))
    start_like[0] = [0, 1] * 4  # starts as a sinusoid would, then does not continue as one
    model = model_of(nodes, {"X": [2, 4, 8, 8]}, {"C": cos, "S": sin, "G": start_like})
    assert default_set(model) == ["G"]
    times = np.arange(1500, dtype=np.float32)[:, None] * np.exp(-np.log(10000) / 15 * np.arange(16)).astype(
        np.float32)
    whisper = np.concatenate([np.sin(times), np.cos(times)], axis=1)
    add = [helper.make_node("Add", ["X", "P"], ["S"]), helper.make_node("MatMul", ["S", "M"], ["Y"])]
    model = model_of(add, {"X": [2, 1500, 32]}, {"P": whisper, "M": rng.normal(size=(32, 32))})
    assert default_set(model) == ["M"]
    model = model_of(add, {"X": [2, 1500, 32]}, {"P": whisper + 0.02 * rng.normal(size=whisper.shape),
                                                 "M": rng.normal(size=(32, 32))})
    assert default_set(model) == ["P", "M"]  # a learned embedding initialised with sinusoids, once trained


def test_a_rotary_angle_table_read_by_cos_and_sin_is_a_setting():
    """TorchScript folds a rotary attention that computes its tables in forward (ESM's) up to the angles
    outer(arange(n), inv_freq) that Cos and Sin read; PyTorch trains none of it. A weight read by Sin that does
    not grow from a row of zeros by its second row stays a parameter, and so does an angle table read by Mul."""
    inv_freq = (1.0 / 10000 ** (np.arange(0, 8, 2, dtype=np.float32) / 8)).astype(np.float32)
    angles = np.arange(8, dtype=np.float32)[:, None] * np.concatenate([inv_freq, inv_freq])[None, :]
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Cos", ["A"], ["C"]), helper.make_node("Sin", ["A"], ["S"]),
             helper.make_node("Mul", ["X", "C"], ["XC"]), helper.make_node("Mul", ["X", "S"], ["XS"]),
             helper.make_node("Add", ["XC", "XS"], ["R"]), helper.make_node("Mul", ["R", "G"], ["Y"])]
    model = model_of(nodes, {"X": [2, 4, 8, 8]}, {"A": angles[None], "G": rng.normal(size=(8, 8))})
    assert default_set(model) == ["G"]
    near = angles.copy()
    near[3] += 0.01 * rng.normal(size=8)  # a trained weight read by Sin and Cos: no exact ramp
    assert default_set(model_of(nodes, {"X": [2, 4, 8, 8]}, {"A": near[None], "G": rng.normal(size=(8, 8))})) == [
        "A", "G"]
    product = [helper.make_node("Mul", ["X", "A"], ["Y"])]  # a ramp read by no Sin or Cos
    assert default_set(model_of(product, {"X": [2, 8, 4]}, {"A": angles[:, :4]})) == ["A"]


def test_a_rotary_attention_computing_its_tables_in_forward_trains_its_parameters_alone():
    """A real TorchScript export of a rotary attention that makes its angles from an inv_freq buffer in forward
    (ESM's): the default set holds exactly the module's parameters, not the folded angle table."""
    torch = pytest.importorskip("torch")

    class Rotary(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, 8, 2).float() / 8))
            self.query, self.head = torch.nn.Linear(8, 8), torch.nn.Linear(8, 3)

        def forward(self, x):
            freqs = torch.arange(x.shape[1]).float()[:, None] * self.inv_freq  # positions times inv_freq, as ESM
            angles = torch.cat([freqs, freqs], dim=-1)
            q = self.query(x)
            rotated = torch.cat([-q[..., 4:], q[..., :4]], dim=-1)
            return self.head(q * angles.cos() + rotated * angles.sin())

    assert_default_set_is_the_parameters(Rotary(), torch.randn(2, 8, 8), dynamo=False)


def test_running_statistics_deduplicated_through_identity_are_settings():
    """TorchScript's exporter keeps one of equal initializers and reads it through Identity nodes where the others
    were read: two fresh BatchNorms' zero running means and unit variances, which are then read by a
    BatchNormalization and an Identity. They stay settings, as PyTorch's buffers (PatchTST's BatchNorm1d)."""
    torch = pytest.importorskip("torch")
    module = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Tanh(),
                                 torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 3))
    assert_default_set_is_the_parameters(module, torch.randn(4, 6), dynamo=False)


@pytest.mark.parametrize("op, weight_shape", [("MatMul", (2, 8, 8)), ("Conv", (2, 1, 3, 3))])
def test_zero_initialized_weights_of_products_stay_parameters(op, weight_shape):
    """LoRA's B and a zero-initialized Conv are all zeros of rank >= 3 too, but read by a product, not added."""
    node = helper.make_node(op, ["X", "Z"], ["Y"], **({"pads": [1, 1, 1, 1]} if op == "Conv" else {}))
    model = model_of([node], {"X": [2, 1, 8, 8]}, {"Z": np.zeros(weight_shape)})
    assert default_set(model) == ["Z"]


# op -> (its weight's shape, its attributes) reading X [2, 3, 8, 8] (Gemm: X [2, 3]) into 4 channels
FUSED = {"Conv": ((4, 3, 3, 3), {"pads": [1, 1, 1, 1]}), "ConvTranspose": ((3, 4, 2, 2), {"strides": [2, 2]}),
         "Gemm": ((4, 3), {"transB": 1})}


def conv(weight: str, bias: str, rule: str | None = None, op: str = "Conv") -> onnx.ModelProto:
    rng = np.random.default_rng(2)
    shape, attributes = FUSED[op]
    node = helper.make_node(op, ["X", weight, bias], ["Y"], **attributes)
    if rule:  # what the dynamo optimizer's rewriter records on the node it made
        helper.set_metadata_props(node, {"pkg.onnxscript.rewriter.rule_name": rule})
    return model_of([node], {"X": [2, 3] if op == "Gemm" else [2, 3, 8, 8]},
                    {weight: rng.normal(size=shape), bias: rng.normal(size=4)})


@pytest.mark.parametrize("weight, bias, rule, op", [
    ("stem.0.weight", "stem.0.weight_bias", None, "Conv"),  # dynamo's optimizer, a Conv without a bias
    ("stem.0.weight", "stem.0.bias", "FuseBatchNormIntoConv", "Conv"),  # dynamo's optimizer, a Conv's own bias
    ("onnx::Conv_62", "onnx::Conv_63", None, "Conv"),  # TorchScript's constant folding
    # tf2onnx's optimizer (a Keras Conv2D + BatchNormalization; the default trainable set had trained the fused
    # kernel unwarned, 5 SGD steps of a Keras CNN 6e-3 off Keras's losses)
    ("model/conv1/BiasAdd_weights_fused_bn", "model/conv1/BiasAdd_bias_fused_bn", None, "Conv"),
    # dynamo's optimizer folds a BatchNorm into a ConvTranspose (a DCGAN generator) and into a Linear's Gemm (an
    # MLP's Linear + BatchNorm1d) too
    ("net.0.weight", "net.0.weight_bias", None, "ConvTranspose"),
    ("net.0.weight", "net.0.bias", "FuseBatchNormIntoConvTranspose", "ConvTranspose"),
    ("mlp.0.weight", "mlp.0.bias", "FuseBatchNormIntoGemm", "Gemm")])
def test_a_batchnorm_folded_into_a_conv_is_warned_about(weight, bias, rule, op):
    with pytest.warns(onnxtrain.ParameterizationWarning, match=f"{weight} .*BatchNorm folded into Conv"):
        assert select_trainable(conv(weight, bias, rule, op), None) == [weight, bias]


@pytest.mark.parametrize("op", FUSED)
def test_a_conv_with_its_own_parameters_is_not_warned_about(op):
    assert default_set(conv("stem.0.weight", "stem.0.bias", "SomeOtherRule", op)) == ["stem.0.weight", "stem.0.bias"]


@pytest.mark.parametrize("layer", ["ConvTranspose2d", "Linear"])
def test_a_batchnorm_the_dynamo_export_folds_into_a_linear_or_transposed_conv_is_warned_about(layer):
    """The default dynamo export of Linear + BatchNorm1d (an MLP) and ConvTranspose2d + BatchNorm2d (a DCGAN
    generator) fuses the BatchNorm into the Gemm's or the ConvTranspose's weight and bias: their default set had
    trained the fused kernel silently, where PyTorch trains the layer's weight and BatchNorm's scale and shift."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("onnxscript")
    torch.manual_seed(0)
    first, x = ((torch.nn.Linear(6, 8), torch.randn(4, 6)) if layer == "Linear"
                else (torch.nn.ConvTranspose2d(6, 8, 2, 2), torch.randn(4, 6, 3, 3)))
    module = torch.nn.Sequential(first, torch.nn.BatchNorm1d(8) if layer == "Linear" else torch.nn.BatchNorm2d(8))
    with torch.no_grad():  # a trained BatchNorm's statistics
        module[1].running_mean.uniform_(-0.5, 0.5)
        module[1].running_var.uniform_(0.5, 2.0)
    model = torch.onnx.export(module.eval(), (x,), dynamo=True).model_proto
    with pytest.warns(onnxtrain.ParameterizationWarning, match=r"0\.weight .*BatchNorm folded into Conv"):
        onnxtrain.make_trainable(model, loss="mse", optimizer="sgd")


def recorded(node: onnx.NodeProto, call: str, args: str) -> onnx.NodeProto:
    """`node` with the dynamo exporter's record of the PyTorch call it comes from."""
    helper.set_metadata_props(node, {"pkg.torch.onnx.fx_node": f"%out : [num_users=1] = call_function[target="
                                                              f"torch.ops.aten.{call}](args = ({args}), kwargs = {{}})"})
    return node


SDPA_CALL = ("scaled_dot_product_attention.default", "%view_4, %view_5, %view_6")


@pytest.mark.parametrize("call, size, trained", [
    (SDPA_CALL, 1, ["M"]),  # the scale's square root, which the exporter multiplies the query and the key by
    (SDPA_CALL, 8, ["S", "M"]),  # larger: a learned query folded over the batch reaches those Muls too
    (("mul.Tensor", "%x, %p_alpha"), 1, ["S", "M"]),  # a learned [1] scale (ReZero's alpha)
    (None, 1, ["S", "M"]),  # no record (TorchScript): a [1] operand of a Mul may be a parameter
])
def test_a_constant_made_inside_a_recorded_call_is_a_setting(call, size, trained):
    """dynamo decomposes scaled_dot_product_attention with its scale as a [1] initializer (val_N, as it names
    folded weights): trained, it changed what nn.TransformerEncoderLayer and nn.MultiheadAttention compute."""
    mul = helper.make_node("Mul", ["X", "S"], ["P"])
    nodes = [recorded(mul, *call) if call else mul, helper.make_node("MatMul", ["P", "M"], ["Y"])]
    model = model_of(nodes, {"X": [2, 8]}, {"S": np.full(size, 0.59), "M": np.eye(8) + 0.1})
    assert default_set(model) == trained


def test_group_norms_unit_scales_are_settings():
    """dynamo decomposes group_norm into InstanceNormalization over the groups with unit scales and zero shifts
    (shared by every GroupNorm of as many groups, so merged), then applies the affine parameters by Mul and Add."""
    call = ("group_norm.default", "%conv2d, 2, %p_norm_weight, %p_norm_bias, 1e-05, False")
    nodes = [recorded(helper.make_node("Reshape", ["X", "shape"], ["G"]), *call),
             recorded(helper.make_node("InstanceNormalization", ["G", "ones", "zeros"], ["N"]), *call),
             recorded(helper.make_node("Mul", ["N", "gamma"], ["Y"]), *call)]
    model = model_of(nodes, {"X": [1, 4, 3]}, {"ones": np.ones(2), "zeros": np.zeros(2),
                                               "gamma": np.full((2, 1), 1.5)})
    model.graph.initializer.append(numpy_helper.from_array(np.array([1, 2, 6], np.int64), "shape"))
    assert default_set(model) == ["gamma"]


@pytest.mark.parametrize("call, op, arguments, trained", [
    # LayerNorm(elementwise_affine=False): ones and zeros of the decomposition's own; bias=False: zeros only
    ("layer_norm.default", "LayerNormalization", "%x, [8], None, None, 1e-05, False", ["M"]),
    ("layer_norm.default", "LayerNormalization", "%x, [8], %p_norm_weight, None, 1e-05, False", ["A", "M"]),
    ("layer_norm.default", "LayerNormalization", "%x, [8], %p_norm_weight, %p_norm_bias, 1e-05, False",
     ["A", "B", "M"]),
    # embedding_bag without per_sample_weights multiplies the looked-up rows by ones (mode and table aside)
    ("embedding_bag.padding_idx", "Mul", "%p_bag_weight, %view, %offsets, False, 1, False, None, False, None", ["M"]),
    ("embedding_bag.padding_idx", "Mul", "%p_bag_weight, %view, %offsets, False, 0, False, %p_w, False, None",
     ["A", "M"]),
])
def test_a_calls_default_for_an_argument_given_none_is_a_setting(call, op, arguments, trained):
    """Where the recorded call got None for an optional argument (a norm's weight and bias, embedding_bag's
    per_sample_weights), the dynamo exporter's decomposition reads a default of its own, folded into a val_N as
    it names folded weights; where the call got a parameter there, that input is the parameter."""
    inputs = ["X", "A", "B"] if op == "LayerNormalization" else ["X", "A"]
    nodes = [recorded(helper.make_node(op, inputs, ["N"]), call, arguments),
             helper.make_node("MatMul", ["N", "M"], ["Y"])]
    model = model_of(nodes, {"X": [2, 8]}, {"A": np.ones(8), "B": np.zeros(8), "M": np.eye(8) + 0.1})
    if op != "LayerNormalization":
        del model.graph.initializer[1]  # B
    assert default_set(model) == trained


def test_defaults_of_norms_without_affine_parameters_and_of_embedding_bags_are_not_trained():
    """A real dynamo export: its default trainable set holds exactly the module's parameters (by value, a folded
    transpose too), not the ones and zeros that LayerNorm and GroupNorm without affine parameters and
    EmbeddingBag without per-sample weights decompose into (folded, and merged between the two bags)."""
    torch = pytest.importorskip("torch")

    class Module(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mean, self.sum = torch.nn.EmbeddingBag(16, 8, mode="mean"), torch.nn.EmbeddingBag(16, 8, mode="sum")
            self.layer_norm = torch.nn.LayerNorm(8, elementwise_affine=False)
            self.group_norm = torch.nn.GroupNorm(2, 8, affine=False)
            self.head = torch.nn.Linear(8, 3)

        def forward(self, ids):
            offsets = torch.tensor([0, 3])
            h = self.layer_norm(self.mean(ids, offsets) + self.sum(ids, offsets))
            return self.head(self.group_norm(h))

    assert_default_set_is_the_parameters(Module(), torch.tensor([1, 5, 2, 7, 3, 9]))


def test_the_zero_imaginary_part_of_a_cast_to_complex_is_not_trained():
    """FNet's token mixing, torch.fft.fftn(h, dim=(1, 2)).real of real hidden states: the dynamo exporter casts h
    to complex by concatenating zeros (the imaginary part) after it, folded into a val_N; those zeros are no
    parameter (the default set had trained them, with a ParameterizationWarning that they were merged biases)."""
    torch = pytest.importorskip("torch")

    class Module(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.head = torch.nn.Linear(4, 8), torch.nn.Linear(8, 3)

        def forward(self, x):
            return self.head(torch.fft.fftn(self.embed(x), dim=(1, 2)).real.mean(1))

    with warnings.catch_warnings():
        warnings.simplefilter("error", onnxtrain.ParameterizationWarning)
        assert_default_set_is_the_parameters(Module(), torch.randn(2, 6, 4))


def assert_default_set_is_the_parameters(module, *args, dynamo: bool = True) -> None:
    """The default trainable set of `module`'s dynamo (or TorchScript) export holds exactly its parameters: each chosen initializer
    equals one of them (itself or, folded, transposed), and each of them is chosen. The parameters are moved off
    their initial values first, so that none is merged with another or folded away (a zero bias)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("onnxscript")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=generator))
    module.eval()
    if dynamo:
        model = torch.onnx.export(module, args, dynamo=True).model_proto
    else:  # TorchScript's exporter returns no program: it writes the file
        buffer = io.BytesIO()
        torch.onnx.export(module, args, buffer, dynamo=False)
        model = onnx.load_from_string(buffer.getvalue())
    values = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    chosen = default_set(model)
    held = sorted(name for name, p in module.named_parameters() for c in chosen
                  if np.array_equal(values[c], p.detach().numpy()) or np.array_equal(values[c], p.detach().numpy().T))
    assert held == sorted(name for name, _ in module.named_parameters()) and len(chosen) == len(held), chosen


def test_a_factory_value_merged_across_layers_is_a_setting():
    """Two layers each starting a recurrence from torch.zeros (Mamba's selective scan): the dynamo exporter folds
    both values, %zeros and %zeros_1, into one initializer `zeros`, which PyTorch never trains."""
    torch = pytest.importorskip("torch")

    class Gated(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gates = torch.nn.ModuleList(torch.nn.Linear(6, 6) for _ in range(2))
            self.head = torch.nn.Linear(6, 3)

        def forward(self, x):  # [batch, steps, 6]
            for gate in self.gates:
                state = torch.zeros(x.shape[0], 6)
                for t in range(x.shape[1]):
                    state = torch.sigmoid(gate(x[:, t])) * state + x[:, t]
                x = x + state[:, None]
            return self.head(state)

    assert_default_set_is_the_parameters(Gated(), torch.randn(2, 3, 6))


def test_a_value_folded_from_what_forward_makes_is_a_setting():
    """PatchTST's scaler divides by the count of observed values, clamp_min(ones_like(x).sum(1), 1): the dynamo
    exporter folds it into a tensor named clamp_min, recording that it comes from ones_like and x alone."""
    torch = pytest.importorskip("torch")

    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.head = torch.nn.Linear(6, 3)

        def forward(self, x):  # [batch, steps, 6]
            return self.head(x.sum(1) / torch.ones_like(x).sum(1).clamp_min(1.0))

    assert_default_set_is_the_parameters(Scaled(), torch.randn(2, 5, 6))


@pytest.mark.parametrize("fill, trained", [("%zeros_like", ["M"]), ("%p_zeros_like", ["zeros_like", "M"])])
def test_the_value_of_a_factory_call_is_a_setting(fill, trained):
    """torch.zeros_like(mask) made into a float mask by masked_fill (nn.MultiheadAttention's key_padding_mask):
    the dynamo exporter folds it into an initializer named after the call, which its reader's record shows as an
    argument; a parameter of that name is recorded as its placeholder %p_<name>."""
    where = recorded(helper.make_node("Where", ["C", "zeros_like", "X"], ["W"]), "masked_fill.Scalar",
                     f"{fill}, %eq, -inf")
    nodes = [helper.make_node("Greater", ["X", "M"], ["C"]), where, helper.make_node("MatMul", ["W", "M"], ["Y"])]
    model = model_of(nodes, {"X": [8, 8]}, {"zeros_like": np.zeros((8, 8)), "M": np.eye(8) + 0.1})
    assert default_set(model) == trained


@pytest.mark.parametrize("call, trained", [("zeros.default", ["M"]), ("expand.default", ["fill", "M"])])
def test_the_fill_value_inside_a_factory_call_is_a_setting(call, trained):
    """torch.zeros(2, x.size(0), 16) under dynamic shapes (an RNN's initial state of the batch's size): the dynamo
    exporter cannot fold it, and makes it inside the recorded zeros call as Expand(a 0-d fill value, the size);
    a 0-d parameter expanded by a call of its own (x.expand) stays trainable."""
    nodes = [helper.make_node("Shape", ["X"], ["N"]),
             recorded(helper.make_node("Expand", ["fill", "N"], ["Z"]), call, "[%sym_size_int_2, 8]"),
             helper.make_node("Add", ["X", "Z"], ["S"]), helper.make_node("MatMul", ["S", "M"], ["Y"])]
    model = model_of(nodes, {"X": [2, 8]}, {"fill": np.array(0.0), "M": np.eye(8) + 0.1})
    assert default_set(model) == trained


@pytest.mark.parametrize("placeholder, trained", [("%b_norm_scale", ["M"]), ("%c_lifted_tensor_0", ["M"]),
                                                   ("%p_norm_scale", ["norm.scale", "M"])])
def test_a_buffer_is_a_setting(placeholder, trained):
    """A float buffer (register_buffer) keeps its name as an initializer, as a parameter does; the dynamo
    exporter's records tell them apart by torch.export's placeholders: b_<name> a buffer, p_<name> a parameter."""
    name = "norm.scale" if "norm" in placeholder else "lifted_tensor_0"
    nodes = [recorded(helper.make_node("Mul", ["X", name], ["S"]), "mul.Tensor", f"%linear, {placeholder}"),
             helper.make_node("MatMul", ["S", "M"], ["Y"])]
    model = model_of(nodes, {"X": [2, 8]}, {name: np.linspace(0.5, 1.5, 8), "M": np.eye(8) + 0.1})
    assert default_set(model) == trained


@pytest.mark.parametrize("data, trained", [("%zeros_1", ["M"]), ("%p_table", ["val_33", "M"])])
def test_a_factory_value_a_call_reads_transformed_is_a_setting(data, trained):
    """torch.zeros(2, 4, 8).index_add(1, index, v): dynamo's index_put scatters into the zeros with the indexed
    axis moved first, folded into a val_N, which only the argument it stands for (%zeros_1) tells apart from a
    parameter scattered into (%p_table)."""
    scatter = recorded(helper.make_node("ScatterND", ["val_33", "I", "X"], ["S"]), "index_put.default",
                       f"{data}, [None, %b_route], %mul, True")
    nodes = [helper.make_node("Cast", ["J"], ["I"], to=TensorProto.INT64), scatter,
             helper.make_node("MatMul", ["S", "M"], ["Y"])]
    model = model_of(nodes, {"X": [2, 8], "J": [2, 1]}, {"val_33": np.zeros((4, 8)), "M": np.eye(8) + 0.1})
    assert default_set(model) == trained


def test_tensors_a_module_makes_from_shapes_or_holds_as_buffers_are_not_trained():
    """A real dynamo export: the zeros a scatter_add and an index_add accumulate into and the float mask
    nn.MultiheadAttention makes of its key_padding_mask (zeros_like, masked_fill) are folded into initializers, and
    a float buffer is one: PyTorch never trains them (their gradients are not zero: all are added to or
    multiplied)."""
    torch = pytest.importorskip("torch")

    class Module(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attention = torch.nn.MultiheadAttention(8, 2, batch_first=True)
            self.head = torch.nn.Linear(8, 3)
            self.register_buffer("scale", torch.linspace(0.5, 1.5, 8))

        def forward(self, x, padding):
            out, _ = self.attention(x, x, x, key_padding_mask=padding)
            index = torch.tensor([0, 1, 0, 1]).view(1, 4, 1).expand(2, 4, 8)
            pooled = torch.zeros(2, 2, 8).scatter_add(1, index, out)
            pooled = pooled + torch.zeros(2, 2, 8).index_add(1, index[0, :, 0], out)
            return self.head(pooled * self.scale)

    assert_default_set_is_the_parameters(Module(), torch.randn(2, 4, 8), torch.tensor([[False] * 3 + [True]] * 2))


@pytest.mark.parametrize("weight, warned", [("%mul", True), ("%p_linear_weight", False)])
def test_a_folded_parametrization_is_warned_about(weight, warned):
    """weight_norm's g * v / |v|, computed by the source model and folded by the exporter into a val_N: the
    recorded linear's weight argument is that computed value, not a parameter's placeholder."""
    call = ("linear.default", f"%x, {weight}, %p_linear_bias")
    nodes = [recorded(helper.make_node("MatMul", ["X", "val_3"], ["P"]), *call),
             recorded(helper.make_node("Add", ["P", "linear.bias"], ["Y"]), *call)]
    model = model_of(nodes, {"X": [2, 3]}, {"val_3": np.arange(12.0).reshape(3, 4), "linear.bias": np.ones(4) / 3})
    with pytest.warns(onnxtrain.ParameterizationWarning, match=r"val_3 \(the weight %mul of linear.default\)") \
            if warned else warnings.catch_warnings():
        if not warned:
            warnings.simplefilter("error", onnxtrain.ParameterizationWarning)
        assert select_trainable(model, None) == ["val_3", "linear.bias"]


def selective_scan(decay: bool):
    """Mamba's parameters as its slow path reads them: a depthwise causal conv whose weight is stored [C, 1, K]
    and read as weight.squeeze(1).unsqueeze(1), and (`decay`) the decay A = -exp(A_log) unsqueezed."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("onnxscript")

    class SelectiveScan(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv1d(6, 6, 3, groups=6, padding=2)
            self.a_log = torch.nn.Parameter(torch.log(torch.arange(1.0, 7.0))) if decay else None
            self.head = torch.nn.Linear(6, 3)

        def forward(self, x):  # [batch, 6, steps]
            weight = self.conv.weight.squeeze(1).unsqueeze(1)
            h = torch.nn.functional.conv1d(x, weight, self.conv.bias, padding=2, groups=6)[..., :x.shape[-1]]
            if self.a_log is not None:
                h = h * (-torch.exp(self.a_log)).unsqueeze(-1)
            return self.head(h.mean(-1))

    return SelectiveScan(), torch.randn(2, 6, 8)


def test_a_view_of_a_parameter_read_as_a_weight_is_no_parametrization():
    """The dynamo exporter folds Mamba's conv weight.squeeze(1).unsqueeze(1) into an initializer `unsqueeze`,
    recorded as folded from the weight by views alone: it trains as the weight does, no warning."""
    assert_default_set_is_the_parameters(*selective_scan(decay=False))


def test_a_parameter_function_folded_under_a_view_is_warned_about():
    """-exp(A_log).unsqueeze(-1), folded into an initializer named after its last call, unsqueeze: the
    exporter's record of what it folded it from names exp, so training it is not training A_log."""
    import torch

    module, x = selective_scan(decay=True)
    model = torch.onnx.export(module.eval(), (x,), dynamo=True).model_proto
    with pytest.warns(onnxtrain.ParameterizationWarning, match=r"unsqueeze\w* \(folded from .*exp") as record:
        select_trainable(model, None)
    assert not any("conv1d" in str(w.message) for w in record), [str(w.message) for w in record]


@pytest.mark.parametrize("value, warned", [("%sigmoid", True), ("%p_sigmoid", False)])
def test_a_folded_function_of_a_parameter_is_warned_about(value, warned):
    """torch.sigmoid(self.decay), folded by the dynamo exporter into an initializer named after the call's result,
    as its reader's record shows it (%sigmoid): training that tensor is not training decay. A parameter named
    sigmoid is recorded as its placeholder p_sigmoid."""
    nodes = [recorded(helper.make_node("Mul", ["X", "sigmoid"], ["S"]), "mul.Tensor", f"%linear, {value}"),
             helper.make_node("MatMul", ["S", "M"], ["Y"])]
    model = model_of(nodes, {"X": [2, 8]}, {"sigmoid": np.linspace(0.2, 0.8, 8), "M": np.eye(8) + 0.1})
    with pytest.warns(onnxtrain.ParameterizationWarning, match=r"sigmoid \(the result of sigmoid, read by mul") \
            if warned else warnings.catch_warnings():
        if not warned:
            warnings.simplefilter("error", onnxtrain.ParameterizationWarning)
        assert select_trainable(model, None) == ["sigmoid", "M"]


@pytest.mark.parametrize("name, value, trained", [("exp", "%exp", ["exp", "M"]), ("exp", "2.0", ["M"]),
                                                  ("scalar_tensor_default", "%scalar_tensor_default", ["M"])])
def test_a_folded_0d_result_is_no_lifted_scalar(name, value, trained):
    """CLIP's x * self.logit_scale.exp(): the dynamo exporter folds exp(logit_scale) into a 0-d initializer
    named exp, which its reader's record shows as a result (%exp): trained, and warned about (its steps are not
    logit_scale's); left out as a lifted scalar, logit_scale never trained. A lifted scalar is a number in the
    record (2.0), or the tensor a decomposition makes of one (scalar_tensor)."""
    nodes = [recorded(helper.make_node("Mul", ["X", name], ["S"]), "mul.Tensor", f"%linear, {value}"),
             helper.make_node("MatMul", ["S", "M"], ["Y"])]
    model = model_of(nodes, {"X": [2, 8]}, {name: np.array(14.3), "M": np.eye(8) + 0.1})
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert select_trainable(model, None) == trained
    assert [str(w.message).split(":")[0] for w in record] == ["exp (the result of exp, read by mul.Tensor)"][
        :len(trained) - 1]


def test_folds_that_train_as_their_parameters_are_not_warned_about():
    """A real dynamo export of sigmoid(decay), warned about, beside folds whose SGD steps are the parameters' own:
    rows of a position table gathered at fixed positions (GPT-2's) and a shift by one (Gemma's RMSNorm scale)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("onnxscript")

    class Gates(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.decay = torch.nn.Parameter(torch.linspace(-1.0, 1.0, 8))
            self.scale = torch.nn.Parameter(torch.linspace(-0.1, 0.1, 8))
            self.positions = torch.nn.Embedding(16, 8)

        def forward(self, x):
            rows = self.positions(torch.arange(x.shape[0]))
            return (x + rows) * (1 + self.scale) * torch.sigmoid(self.decay)

    model = torch.onnx.export(Gates().eval(), (torch.randn(4, 8),), dynamo=True).model_proto
    with pytest.warns(onnxtrain.ParameterizationWarning) as record:
        select_trainable(model, None)
    assert [str(w.message).split(":")[0] for w in record] == ["sigmoid (the result of sigmoid, read by mul.Tensor)"]


def test_a_projection_of_a_parameter_folded_under_a_dynamic_batch_is_warned_about():
    """DeBERTa-v2's relative position keys pos_key_proj(rel_embeddings), repeated per sequence: a static export
    folds the repeat too (warned as equal slices), a dynamic batch leaves the Tile to run time and folds the
    projection alone, a [span, d] tensor of neither parameter, recorded as folded from `linear`. A Bilinear's
    weight, reshaped by a shape the exporter read off run-time activations (layer_norm's output, recorded among
    what it was folded from too), is the parameter itself: no warning."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("onnxscript")

    class RelativeKeys(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.table = torch.nn.Parameter(torch.randn(6, 8))
            self.pos_key = torch.nn.Linear(8, 8)
            self.norm = torch.nn.LayerNorm(8, elementwise_affine=False)
            self.bilinear = torch.nn.Bilinear(8, 8, 4)

        def forward(self, x):  # [batch, 6, 8]
            keys = self.pos_key(self.table).repeat(x.shape[0], 1, 1)
            return self.bilinear(self.norm(x), x).mean(1) + (x * keys).sum(-1).mean(-1, keepdim=True)

    torch.manual_seed(0)
    module, x = RelativeKeys().eval(), torch.randn(2, 6, 8)
    batch = torch.export.Dim("batch", min=1, max=64)
    model = torch.onnx.export(module, (x,), dynamo=True, dynamic_shapes=({0: batch},)).model_proto
    with torch.no_grad():
        projected = module.pos_key(module.table).numpy()
    folded = [t.name for t in model.graph.initializer if t.dims == [1, *projected.shape]
              and np.allclose(numpy_helper.to_array(t)[0], projected, rtol=1e-5, atol=1e-6)]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert set(folded) < set(select_trainable(model, None))
    assert [str(w.message).split(":")[0] for w in record] == [f"{folded[0]} (folded from linear)"]


def test_a_folded_constant_made_in_forward_is_no_parameter_function():
    """The dynamo exporter folds DeBERTa's sqrt(torch.tensor(d) * scale), a 0-d tensor the model makes in forward,
    into an initializer named sqrt, as it folds CLIP's logit_scale.exp() into exp: its record of what each was
    folded from (a lifted constant; the parameter model.logit_scale) tells the constant, left out unwarned, from
    the parameter's function, trained and warned about. Checked against what PyTorch's module holds."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("onnxscript")

    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(8, 8)

        def forward(self, x):
            return self.proj(x) / torch.sqrt(torch.tensor(x.size(-1), dtype=torch.float) * 2)

    class Contrastive(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Scaled()
            self.logit_scale = torch.nn.Parameter(torch.tensor(2.659))

        def forward(self, x):
            return self.inner(x) @ x.T * self.logit_scale.exp()

    model = torch.onnx.export(Contrastive().eval(), (torch.randn(4, 8),), dynamo=True).model_proto
    values = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    np.testing.assert_allclose(values["sqrt"], np.sqrt(16.0), rtol=1e-6)
    np.testing.assert_allclose(values["exp"], np.exp(2.659), rtol=1e-6)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        chosen = select_trainable(model, None)
    assert "exp" in chosen and "sqrt" not in chosen
    assert [str(w.message).split(":")[0] for w in record] == ["exp (the result of exp, read by mul.Tensor)"]


@pytest.mark.parametrize("copies, expected", [
    ("row", r"P \(along axis 0\): equal slices"),  # BERT's token-type row broadcast over the batch [2, 8, 32]
    ("block", r"P \(along axis 0, blocks of 4\): equal slices"),  # DeBERTa's position keys, repeat(batch, 1, 1)
    (None, None)])
def test_a_parameter_folded_into_copies_is_warned_about(copies, expected):
    """The dynamo exporter folds a parameter's broadcast into one tensor whose copies would train apart: a row
    repeated along the batch, or DeBERTa-v2's relative position keys [heads, span, d] repeated per sequence and
    bmm'ed as [batch * heads, span, d], where slices 4-7 repeat slices 0-3 but no slice repeats the first."""
    rng = np.random.default_rng(3)
    weight = {"row": np.broadcast_to(rng.normal(size=(1, 6, 4)), (2, 6, 4)),
              "block": np.tile(rng.normal(size=(4, 6, 4)), (2, 1, 1)), None: rng.normal(size=(8, 6, 4))}[copies]
    model = model_of([helper.make_node("MatMul", ["X", "P"], ["Y"])], {"X": [len(weight), 3, 6]}, {"P": weight})
    with pytest.warns(onnxtrain.ParameterizationWarning, match=expected) if expected else warnings.catch_warnings():
        if not expected:
            warnings.simplefilter("error", onnxtrain.ParameterizationWarning)
        assert select_trainable(model, None) == ["P"]


@pytest.mark.parametrize("heads", [4, 12])
@pytest.mark.parametrize("shift, trained", [(0.0, ["M"]), (1e-3, ["S", "M"])])
def test_alibi_slopes_are_settings(heads, shift, trained):
    """Bloom's ALiBi slopes [heads, 1] (transformers' own, 12 heads past a power of two), which the dynamo exporter
    folds into an initializer multiplying the key positions; the same values moved (a trained weight) stay one."""
    bloom = pytest.importorskip("transformers.models.bloom.modeling_bloom")
    slopes = bloom._get_alibi_slopes(heads, "cpu").numpy()[:, None] + shift
    nodes = [helper.make_node("Mul", ["S", "X"], ["P"]), helper.make_node("MatMul", ["P", "M"], ["Y"])]
    model = model_of(nodes, {"X": [2, 1, 8]}, {"S": slopes, "M": np.eye(8) + 0.1})
    assert default_set(model) == trained


def base_grid(height: int, width: int, align_corners: bool) -> np.ndarray:
    """affine_grid's base grid [height * width, 3, 1] as PyTorch's decomposition builds it: x, y and a 1."""
    def ramp(n: int) -> np.ndarray:
        return np.linspace(-1, 1, n) * (1 if align_corners else (n - 1) / n) if n > 1 else np.zeros(1)

    y, x = np.meshgrid(ramp(height), ramp(width), indexing="ij")
    return np.stack([x.ravel(), y.ravel(), np.ones(height * width)], axis=1)[:, :, None]


@pytest.mark.parametrize("align_corners", [False, True])
def test_affine_grids_base_grid_is_a_setting(align_corners):
    """The dynamo exporter folds affine_grid's base grid into an initializer that multiplies theta; a [n, 3, 1]
    weight of other values stays a parameter."""
    rng = np.random.default_rng(3)
    nodes = [helper.make_node("Mul", ["G", "X"], ["P"]), helper.make_node("Mul", ["P", "W"], ["Y"])]
    grid = base_grid(4, 5, align_corners)
    model = model_of(nodes, {"X": [2, 1, 3, 2]}, {"G": grid, "W": grid + 0.02 * rng.normal(size=grid.shape)})
    assert default_set(model) == ["W"]


@pytest.mark.parametrize("divisor, trained", [([18, 18, 24, 18], ["M"]), ([1.5, 2.0, 1.0, 3.0], ["D", "M"]),
                                              ([1, 1, 1, 1], ["D", "M"])])
def test_an_adaptive_pools_window_sizes_are_settings(divisor, trained):
    """An adaptive average pool with windows of unequal sizes divides each window's sum by its size, a float
    tensor the dynamo exporter folds; a learned divisor holds fractions, or starts as one repeated value."""
    nodes = [helper.make_node("Div", ["X", "D"], ["P"]), helper.make_node("MatMul", ["P", "M"], ["Y"])]
    model = model_of(nodes, {"X": [2, 4]}, {"D": np.array(divisor), "M": np.eye(4) + 0.1})
    assert default_set(model) == trained


def relative_position_index(window: int) -> np.ndarray:
    """Swin's relative_position_index [window², window²]: each query-key pair's offset (dy, dx) as one index."""
    coords = np.stack(np.meshgrid(np.arange(window), np.arange(window), indexing="ij")).reshape(2, -1)
    offsets = coords[:, :, None] - coords[:, None, :] + window - 1
    return offsets[0] * (2 * window - 1) + offsets[1]


def added_to_scores(bias: np.ndarray) -> onnx.ModelProto:
    """Y = MatMul(X + bias, M): a bias [1, heads, n, n] added to attention scores."""
    heads, n = bias.shape[1], bias.shape[-1]
    nodes = [helper.make_node("Add", ["X", "B"], ["S"]), helper.make_node("MatMul", ["S", "M"], ["Y"])]
    return model_of(nodes, {"X": [2, heads, n, n]}, {"B": bias, "M": np.random.default_rng(5).normal(size=(n, n))})


def test_a_folded_gather_of_a_relative_position_bias_table_is_warned_about():
    """TorchScript's constant folding turns Swin's relative_position_bias_table[relative_position_index] into a
    [1, heads, 16, 16] initializer holding the table's 49 values per head 256 times: each copy would train apart,
    where PyTorch sums their gradients into the table."""
    table = np.random.default_rng(4).normal(0, 0.02, size=(49, 2)).astype(np.float32)
    gathered = table[relative_position_index(4)].transpose(2, 0, 1)[None]
    with pytest.warns(onnxtrain.ParameterizationWarning, match=r"B \(512 values, 98 distinct\): .*repeated values"):
        assert select_trainable(added_to_scores(gathered), None) == ["B", "M"]


@pytest.mark.parametrize("values", ["trained", "pruned", "bfloat16", "identity"])
def test_weights_that_repeat_values_by_design_are_not_warned_about(values):
    """A trained float32 weight, one pruned to 70% zeros, one trained in bfloat16 and stored in float32 (it repeats
    at bfloat16's precision), and a fresh identity initialization (a few values) are not folded gathers."""
    rng = np.random.default_rng(6)
    pruned = rng.normal(0, 0.02, size=(1, 2, 16, 16))
    pruned[np.abs(pruned) < np.quantile(np.abs(pruned), 0.7)] = 0
    weight = {"trained": rng.normal(0, 0.02, size=(1, 2, 16, 16)), "pruned": pruned,
              "bfloat16": rng.normal(0, 0.02, size=(1, 2, 16, 16)).astype(ml_dtypes.bfloat16).astype(np.float32),
              "identity": np.broadcast_to(np.eye(16), (1, 2, 16, 16)) + np.arange(2)[None, :, None, None]}[values]
    assert default_set(added_to_scores(weight)) == ["B", "M"]


def test_a_fresh_bidirectional_recurrences_equal_direction_slices_are_not_warned_about():
    """A fresh Keras Bidirectional LSTM's B holds the same bias for both directions (zeros, the forget gate at 1):
    slices along a recurrence's direction axis, not a broadcast an exporter folded."""
    rng, hidden = np.random.default_rng(6), 3
    bias = np.zeros((1, 8 * hidden))
    bias[0, 2 * hidden:3 * hidden] = 1.0  # the forget gate (ONNX orders them i, o, f, c): Keras's unit forget bias
    model = model_of([helper.make_node("LSTM", ["X", "W", "R", "B"], ["Y"], hidden_size=hidden,
                                       direction="bidirectional")], {"X": [5, 2, 4]},
                     {"W": rng.normal(size=(2, 4 * hidden, 4)), "R": rng.normal(size=(2, 4 * hidden, hidden)),
                      "B": np.concatenate([bias, bias])})
    with warnings.catch_warnings():
        warnings.simplefilter("error", onnxtrain.ParameterizationWarning)
        assert select_trainable(model, None) == ["W", "R", "B"]
