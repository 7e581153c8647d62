"""Mixed precision (`load(..., mixed_precision=...)`): the products compute in bfloat16/float16 with float32
accumulation and return the compute type's rounding, everything else and the whole state stay float32, float16
gradients are loss-scaled."""

from __future__ import annotations

import warnings

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import onnxtrain
from onnxtrain.errors import OptionError
from onnxtrain.program import YNNPACK_WITH_CONVOLUTION, convolution_options, known_options
from training_models import linear_regression

torch = pytest.importorskip("torch")
import zoo_models as zoo  # noqa: E402 - needs torch

STEPS = 50


def rounded(array: np.ndarray) -> np.ndarray:
    """float32 values rounded to bfloat16 (round to nearest even) and back: what a bfloat16 product reads."""
    return array.astype(ml_dtypes.bfloat16).astype(np.float32)


def product_model(node: onnx.NodeProto, x_shape, weights: dict[str, np.ndarray], y_shape, opset: int = 21):
    graph = helper.make_graph([node], "product", [helper.make_tensor_value_info("X", TensorProto.FLOAT, x_shape)],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, y_shape)],
                              [numpy_helper.from_array(v, n) for n, v in weights.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def cases(rng: np.random.Generator):
    """(ONNX product, X) with its weights: every product kind autocast, and MatMul's batched-activation path."""
    normal = lambda *shape: rng.normal(size=shape).astype(np.float32)  # noqa: E731
    yield (product_model(helper.make_node("MatMul", ["X", "W"], ["Y"]), [2, 5, 64], {"W": normal(64, 16)},
                         [2, 5, 16]), normal(2, 5, 64))
    yield (product_model(helper.make_node("Gemm", ["X", "W", "C"], ["Y"], transB=1, alpha=0.5),
                         [4, 64], {"W": normal(8, 64), "C": normal(8)}, [4, 8]), normal(4, 64))
    yield (product_model(helper.make_node("Einsum", ["X", "W"], ["Y"], equation="bij,jk->bik"), [2, 3, 64],
                         {"W": normal(64, 6)}, [2, 3, 6]), normal(2, 3, 64))
    # 8 channels x 3x3 taps: past the few-channel convolutions computed as float32 multiply-adds
    yield (product_model(helper.make_node("Conv", ["X", "W", "B"], ["Y"], pads=[1, 1, 1, 1]), [1, 8, 6, 6],
                         {"W": normal(4, 8, 3, 3), "B": normal(4)}, [1, 4, 6, 6]), normal(1, 8, 6, 6))


BFLOAT16_ULP = 2.0**-7  # bfloat16's spacing relative to a value (8 significant bits)


def assert_bfloat16_rounding_of(y: np.ndarray, exact: np.ndarray) -> None:
    """`y` is `exact` (a float64 result) rounded to bfloat16: every value a bfloat16 one, each within half a
    bfloat16 step of `exact` (a float32 accumulation in another order may round a value near a tie the other way:
    one step)."""
    assert np.array_equal(rounded(y), y)
    np.testing.assert_allclose(y, exact, rtol=BFLOAT16_ULP, atol=1e-6)


@pytest.mark.parametrize("index", range(3), ids=["matmul", "gemm", "einsum"])
def test_products_compute_on_bfloat16_operands_and_return_their_rounded_product(index):
    """As torch.autocast's products: NumPy's product of the operands rounded to bfloat16, accumulated in float32
    and rounded to bfloat16 (Gemm: its product so, then alpha and the float32 bias); the float32 result on the
    unrounded operands is not it."""
    model, x = list(cases(np.random.default_rng(index)))[index]
    y = np.asarray(onnxtrain.load(model, mixed_precision="bfloat16").infer({"X": x})["Y"])
    assert y.dtype == np.float32
    w = rounded(numpy_helper.to_array(model.graph.initializer[0])).astype(np.float64)
    if model.graph.node[0].op_type == "Gemm":  # transB=1, alpha=0.5: the rounded product, halved, plus C
        product = rounded((rounded(x) @ w.T).astype(np.float32))
        np.testing.assert_allclose(y, product * 0.5 + numpy_helper.to_array(model.graph.initializer[1]),
                                   rtol=BFLOAT16_ULP, atol=1e-6)
    else:
        assert_bfloat16_rounding_of(y, rounded(x).astype(np.float64) @ w)
    (full,) = ReferenceEvaluator(model).run(None, {"X": x})
    assert np.max(np.abs(full - y)) > 1e-3  # bfloat16's rounding (2**-9 relative) shows at this size


def test_on_the_cpu_a_convolution_stays_float32():
    """XLA-CPU converts bfloat16 convolutions to float32 ones (lower/ops/conv.py), so on the CPU a convolution
    under mixed precision that XLA computes is the reference evaluator's float32 one, not a product of rounded
    operands (traced for a GPU it is: test_traced_for_a_gpu_a_convolution_...; a product of patches is:
    test_on_the_cpu_a_patches_convolution_...)."""
    model, x = list(cases(np.random.default_rng(3)))[3]
    y = np.asarray(onnxtrain.load(model, mixed_precision="bfloat16").infer({"X": x})["Y"])
    (expected,) = ReferenceEvaluator(model).run(None, {"X": x})
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("x_shape, w_shape, attributes", [
    ((1, 16, 8, 8), (8, 16, 3, 3), {"strides": [2, 2], "pads": [1, 1, 0, 0]}),  # strided, padded on one side
    ((2, 32, 5, 5), (6, 32, 1, 1), {}),  # 1x1 (past the few-channel ones computed as multiply-adds)
    ((1, 256, 5, 5), (4, 256, 3, 3), {"dilations": [2, 2], "pads": [2, 2, 2, 2]}),  # deep, few positions
    # stride 1 over 128 channels: products of shifted rows
    ((2, 128, 5, 4), (128, 128, 3, 3), {"pads": [1, 1, 1, 1]}),
    ((1, 128, 7, 6), (128, 128, 3, 2), {"dilations": [2, 1], "pads": [2, 0, 1, 1]}),  # dilated, padded unevenly
], ids=["strided", "1x1", "deep-dilated", "shifted-rows", "shifted-rows-dilated"])
def test_on_the_cpu_a_patches_convolution_and_its_gradients_are_products_of_bfloat16_operands(
        x_shape, w_shape, attributes):
    """The dense convolutions XLA-CPU computes as one product of their patches (lower/ops/conv.py's
    prefers_patches), or as products of shifted rows of the input (shifts_rows), compute it and both its gradient
    products on bfloat16 operands in YNNPACK's dot: the output is PyTorch's float64 convolution of the rounded
    input and kernel (plus the float32 bias), the input's gradient its transposed convolution of the rounded
    output gradient and kernel, the kernel's the product of the rounded input and output gradient, each
    accumulated in float32; compiled with the options of both of the engine's plans (lower/program.py: YNNPACK's
    fusions differ between them)."""
    jax = pytest.importorskip("jax")
    rng = np.random.default_rng(11)
    normal = lambda *shape: rng.normal(size=shape).astype(np.float32)  # noqa: E731
    w, b, x = normal(*w_shape), normal(w_shape[0]), normal(*x_shape)
    pads = attributes.get("pads", [0, 0, 0, 0])  # ONNX's: the begins, then the ends

    def convolution(x, w):  # PyTorch's float64 convolution, padded as ONNX pads
        padded = torch.nn.functional.pad(x, (pads[1], pads[3], pads[0], pads[2]))
        return torch.nn.functional.conv2d(padded, w, stride=attributes.get("strides", 1),
                                          dilation=attributes.get("dilations", 1))

    full = convolution(torch.from_numpy(x).double(), torch.from_numpy(w).double()).numpy()
    node = helper.make_node("Conv", ["X", "W", "B"], ["Y"], **attributes)
    model = product_model(node, list(x_shape), {"W": w, "B": b}, list(full.shape))
    fn, params = onnxtrain.load(model, mixed_precision="bfloat16").jax_function()
    cotangent = normal(*full.shape)

    def outputs(p, x):
        gradients = jax.grad(lambda p, x: (fn(p, {"X": x})["Y"] * cotangent).sum(), argnums=(0, 1))(p, x)
        return fn(p, {"X": x})["Y"], gradients

    xt, wt = (torch.from_numpy(rounded(v)).double().requires_grad_() for v in (x, w))
    product = convolution(xt, wt)
    product.backward(torch.from_numpy(rounded(cotangent)).double())
    # the one-block plan's options, the plan in heaps'
    for options in (convolution_options(), convolution_options() | known_options(YNNPACK_WITH_CONVOLUTION)):
        y, (grads, grad_x) = jax.jit(outputs).lower(params, x).compile(compiler_options=options)(params, x)
        y = np.asarray(y) - b[:, None, None]
        for value, expected in ((y, product), (grad_x, xt.grad), (grads["W"], wt.grad)):
            expected = expected.detach().numpy()
            np.testing.assert_allclose(np.asarray(value), expected, rtol=1e-4, atol=1e-5 * np.abs(expected).max())
        assert np.max(np.abs(full - y)) > 1e-3  # bfloat16's rounding shows at this size: not float32's convolution


@pytest.mark.parametrize("channels, outputs, stride, size", [(16, 8, 2, 9), (128, 128, 1, 5)],
                         ids=["patches", "shifted-rows"])
def test_second_derivatives_pass_through_the_bfloat16_patches_convolution(channels, outputs, stride, size):
    """The bfloat16 product of patches, and the products of shifted rows (stride 1 over 128 channels), have their
    own gradient rule (custom_vjp), which reverse mode differentiates again: jax.grad of jax.grad (what a
    Gradient of a Gradient computes) is PyTorch's float64 second derivative of the rounded operands, to
    bfloat16's rounding of the gradients the products read (measured: 3e-3 of the largest value); forward mode
    stops there, as docs/semantics.md says."""
    jax = pytest.importorskip("jax")
    rng = np.random.default_rng(12)
    out = (size - 1) // stride + 1
    w, x, c, d = (rng.normal(size=s).astype(np.float32) for s in (
        (outputs, channels, 3, 3), (2, channels, size, size), (2, outputs, out, out), (2, channels, size, size)))
    node = helper.make_node("Conv", ["X", "W"], ["Y"], strides=[stride, stride], pads=[1, 1, 1, 1])
    fn, params = onnxtrain.load(product_model(node, list(x.shape), {"W": w}, list(c.shape)),
                                mixed_precision="bfloat16").jax_function()

    def energy(p, x):
        return (c * fn(p, {"X": x})["Y"] ** 2).sum()

    def outer(p, x):  # d . d(energy)/dx
        return (d * jax.grad(energy, argnums=1)(p, x)).sum()

    grads, grad_x = jax.jit(jax.grad(outer, argnums=(0, 1)))(params, x)
    xt, wt = (torch.from_numpy(rounded(v)).double().requires_grad_() for v in (x, w))
    y = torch.nn.functional.conv2d(xt, wt, stride=stride, padding=1)
    (inner,) = torch.autograd.grad((torch.from_numpy(c).double() * y**2).sum(), xt, create_graph=True)
    expected = torch.autograd.grad((torch.from_numpy(d).double() * inner).sum(), (wt, xt))
    for value, exact in zip((grads["W"], grad_x), expected):
        exact = exact.numpy()
        np.testing.assert_allclose(np.asarray(value), exact, rtol=0, atol=1e-2 * np.abs(exact).max())
    with pytest.raises(Exception, match="forward-mode"):
        jax.jvp(lambda x: fn(params, {"X": x})["Y"], (x,), (d,))


@pytest.mark.parametrize("index", range(2), ids=["matmul", "gemm"])
def test_a_weights_gradient_is_the_bfloat16_product_of_the_rounded_input_and_gradient(index):
    """The weight's gradient of a mixed-precision MatMul / Gemm (linalg.weight_product: the input's transpose
    copied row-major, so XLA-CPU keeps the product in bfloat16) is x^T g on bfloat16-rounded operands,
    accumulated in float32 and rounded to bfloat16, as torch.autocast's backward computes it; the input's
    gradient is g W^T likewise."""
    jax = pytest.importorskip("jax")
    model, x = list(cases(np.random.default_rng(index)))[index]
    fn, params = onnxtrain.load(model, mixed_precision="bfloat16").jax_function()
    cotangent = np.random.default_rng(9).normal(size=np.asarray(fn(params, {"X": x})["Y"]).shape).astype(np.float32)
    grads, grad_x = jax.grad(lambda p, x: (fn(p, {"X": x})["Y"] * cotangent).sum(), argnums=(0, 1))(params, x)
    w = numpy_helper.to_array(model.graph.initializer[0])
    g = rounded(cotangent * (0.5 if index else 1.0)).reshape(-1, cotangent.shape[-1])  # Gemm's alpha = 0.5
    x2 = rounded(x).reshape(-1, x.shape[-1])
    expected = rounded(x2.T @ g)
    np.testing.assert_allclose(np.asarray(grads["W"]), expected.T if index else expected, rtol=1e-2, atol=1e-2)
    kernel = rounded(w.T if index else w)
    np.testing.assert_allclose(np.asarray(grad_x).reshape(x2.shape), rounded(g @ kernel.T), rtol=1e-2, atol=1e-2)


def test_attention_rounds_both_products_and_keeps_its_softmax_float32():
    """NumPy: scores of the bfloat16-rounded Q and K rounded to bfloat16, a float32 softmax, its probabilities
    rounded to bfloat16 times the rounded V, rounded to bfloat16."""
    rng = np.random.default_rng(7)
    q, k, v = (rng.normal(size=(1, 2, 5, 16)).astype(np.float32) for _ in range(3))
    graph = helper.make_graph([helper.make_node("Attention", ["Q", "K", "V"], ["Y"])], "attention",
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 2, 5, 16]) for n in "QKV"],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, 2, 5, 16])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    y = np.asarray(onnxtrain.load(model, mixed_precision="bfloat16").infer({"Q": q, "K": k, "V": v})["Y"])
    # the scale 1/4 (head size 16) is applied as 1/2 to each of Q and K: powers of two, exact in any type
    scores = rounded((rounded(q).astype(np.float64) @ np.swapaxes(rounded(k), -1, -2)).astype(np.float32)) / 4
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs = (probs / probs.sum(-1, keepdims=True)).astype(np.float32)
    assert_bfloat16_rounding_of(y, rounded(probs).astype(np.float64) @ rounded(v))


def test_float64_products_and_one_operand_einsums_are_left_alone():
    """Only float32 products are autocast (as torch.autocast); a one-operand Einsum is a reduction, float32."""
    rng = np.random.default_rng(0)
    x, w = rng.normal(size=(3, 64)), rng.normal(size=(64, 5))
    graph = helper.make_graph([helper.make_node("MatMul", ["X", "W"], ["Y"])], "f64",
                              [helper.make_tensor_value_info("X", TensorProto.DOUBLE, [3, 64])],
                              [helper.make_tensor_value_info("Y", TensorProto.DOUBLE, [3, 5])],
                              [numpy_helper.from_array(w, "W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    y = onnxtrain.load(model, mixed_precision="bfloat16").infer({"X": x})["Y"]
    np.testing.assert_allclose(np.asarray(y), x @ w, rtol=1e-12)
    x32 = x.astype(np.float32)
    model = product_model(helper.make_node("Einsum", ["X"], ["Y"], equation="ij->i"), [3, 64], {}, [3])
    y = onnxtrain.load(model, mixed_precision="bfloat16").infer({"X": x32})["Y"]
    np.testing.assert_allclose(np.asarray(y), x32.astype(np.float64).sum(1), rtol=1e-5)


def test_traced_for_a_gpu_a_convolution_and_its_gradients_compute_in_the_compute_type():
    """cuDNN convolves bfloat16 operands into bfloat16 only (asked for float32, XLA-GPU ran float32 kernels:
    lower/ops/conv.py), so traced for a GPU every convolution of the differentiated program (forward, the
    input's and the kernel's gradients) reads and returns bfloat16, as torch.autocast's do; the value is
    PyTorch's float64 convolution of the rounded operands plus the float32 bias."""
    import jax

    from onnxtrain.lower.autocast import autocasting, mixed_precision_of
    from onnxtrain.lower.layout import channels_first
    from onnxtrain.lower.ops.conv import convolve
    from onnxtrain.lower.target import targeting

    model, x = list(cases(np.random.default_rng(3)))[3]
    w, b = (numpy_helper.to_array(t) for t in model.graph.initializer)

    def conv(x, w):
        with targeting("gpu"), autocasting(mixed_precision_of("bfloat16")):
            return channels_first(convolve(x, w, (1, 1), ((1, 1), (1, 1)), (1, 1), 1, bias=b))

    y = np.asarray(jax.jit(conv)(x, w))
    assert y.dtype == np.float32
    product = torch.nn.functional.conv2d(*(torch.from_numpy(rounded(v)).double() for v in (x, w)), padding=1)
    # compiled for the CPU, XLA computes the bfloat16 convolution in float32 and may drop the rounding after it
    # (its float-conversion simplifier): the result is the product of the rounded operands within the rounding
    np.testing.assert_allclose(y - b[:, None, None], product.numpy(), rtol=2**-8, atol=1e-5)

    def convolutions(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "conv_general_dilated":
                yield eqn
            for param in eqn.params.values():  # a jitted function's body
                if hasattr(param, "jaxpr"):
                    yield from convolutions(param.jaxpr)

    gradient = jax.make_jaxpr(jax.grad(lambda x, w: (conv(x, w) ** 2).sum(), argnums=(0, 1)))(x, w)
    found = list(convolutions(gradient.jaxpr))
    assert len(found) == 3  # forward, the input's gradient, the kernel's
    assert all(v.aval.dtype == ml_dtypes.bfloat16 for eqn in found for v in (*eqn.invars, *eqn.outvars))


@pytest.fixture(scope="module")
def gpt2():
    """zoo's two-layer GPT-2 (hidden 32), made trainable with Adam on next-token cross-entropy, and one batch."""
    module = zoo.ZOO["gpt2"].module()  # seeded: unseeded weights moved the curves' distance by 10x run to run
    rng = np.random.default_rng(0)
    ids, mask = zoo.tokens(rng), zoo.mask()
    labels = zoo.lm_labels(rng, (zoo.BATCH, zoo.SEQ, zoo.VOCAB))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporter's own chatter
        model = onnxtrain.from_torch(module, (torch.from_numpy(ids), torch.from_numpy(mask)),
                                     input_names=["input_ids", "attention_mask"], loss="cross_entropy",
                                     class_axis=-1, ignore_index=-100, optimizer="adam", learning_rate=1e-2)
    return module, model, {"input_ids": ids, "attention_mask": mask, "target": labels}


def losses(engine: onnxtrain.Engine, feeds) -> np.ndarray:
    return np.array([float(engine.train_step(feeds)["loss"]) for _ in range(STEPS)])


def test_float32_run_is_pytorchs_adam(gpt2):
    """The reference curve itself: onnxtrain's float32 run takes PyTorch's Adam steps (5 compared)."""
    module, model, feeds = gpt2
    engine = onnxtrain.load(model)
    ours = [float(engine.train_step(feeds)["loss"]) for _ in range(5)]
    optimizer = torch.optim.Adam(module.parameters(), lr=1e-2)
    args = (torch.from_numpy(feeds["input_ids"]), torch.from_numpy(feeds["attention_mask"]))
    theirs = []
    for _ in range(5):
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(module(*args).transpose(1, 2), torch.from_numpy(feeds["target"]),
                                                 ignore_index=-100)
        loss.backward()
        optimizer.step()
        theirs.append(loss.item())
    np.testing.assert_allclose(ours, theirs, rtol=1e-4)


@pytest.mark.parametrize("precision, remat", [("bfloat16", False), ("float16", False), ("float16", True)])
def test_mixed_precision_trains_a_transformer_like_float32(gpt2, precision, remat, tmp_path):
    """50 Adam steps on one batch (the loss falls from 4.2 to 0.004). Measured: the per-step relative difference
    from float32's curve is at most 0.9 % (bfloat16) and 0.13 % (float16); 3 % leaves room for other BLAS builds
    while a product left in float32 or computed wrong would still be caught by the exact checks above. With
    remat, float16's scaled seed passes through the recomputed segments' backward passes."""
    _, model, feeds = gpt2
    reference = losses(onnxtrain.load(model), feeds)
    engine = onnxtrain.load(model, mixed_precision=precision, remat=remat)
    curve = losses(engine, feeds)
    assert np.all(np.isfinite(curve))
    np.testing.assert_allclose(curve, reference, rtol=0.03)
    assert curve[-1] < 0.01 * curve[0]
    assert not np.array_equal(curve, reference)  # the products did compute in the low type
    # the master weights and the optimizer state stay float32, and the export is float32 ONNX that runs
    floats = {n for n, v in engine.state.items() if np.issubdtype(v.dtype, np.floating)}
    assert floats and all(engine.state[n].dtype == np.float32 for n in floats)
    engine.export(tmp_path / "trained.onnx")
    exported = onnx.load(tmp_path / "trained.onnx")
    onnx.checker.check_model(exported)
    assert {t.data_type for t in exported.graph.initializer if t.name in floats} == {TensorProto.FLOAT}
    inputs = {k: feeds[k] for k in ("input_ids", "attention_mask")}
    session = ort.InferenceSession(exported.SerializeToString(), providers=["CPUExecutionProvider"])
    (logits,) = session.run(None, inputs)
    np.testing.assert_allclose(np.asarray(onnxtrain.load(exported).infer(inputs)[engine.output_names[0]]), logits,
                               rtol=1e-4, atol=1e-4)


def sgd_gradient(loss_scale: float | None, precision: str | None = "float16") -> tuple[np.ndarray, np.ndarray]:
    """One SGD step (rate 1) from W = 0 of Y = X @ W + B, mean((Y - T)^2), with T ~ 1e-9: dW = -W_new, of
    order 1e-9, below float16's smallest subnormal (6e-8). Returns (dW, NumPy's float64 dW)."""
    rng = np.random.default_rng(3)
    x = rng.uniform(-1, 1, size=(8, 4)).astype(np.float32)
    t = (rng.uniform(0.5, 1.0, size=(8, 2)) * 1e-9).astype(np.float32)
    engine = onnxtrain.load(linear_regression(np.zeros((4, 2), np.float32), np.zeros(2, np.float32), 1.0),
                            mixed_precision=precision, loss_scale=loss_scale)
    engine.train_step({"X": x, "T": t})
    expected = -2 / t.size * x.astype(np.float64).T @ t.astype(np.float64)  # d mean((XW - T)^2)/dW at W = 0
    return -np.asarray(engine.state["W"]), expected


def test_float16_gradients_underflow_without_the_loss_scale_and_not_with_it():
    unscaled, expected = sgd_gradient(loss_scale=1.0)
    assert np.all(unscaled == 0) and np.all(expected != 0)
    scaled, expected = sgd_gradient(loss_scale=2.0**20)  # 1e-9 * 2**20 ~ 1e-3: float16's normal range
    np.testing.assert_allclose(scaled, expected, rtol=2e-3)  # X rounded to float16 (2**-11) and the product
    np.testing.assert_allclose(sgd_gradient(None, precision=None)[0], expected, rtol=1e-5)  # float32 needs none


def test_an_overflowing_float16_loss_scale_stops_fit_naming_the_scale():
    """A scale so large that the scaled gradient passes float16's 65504 makes the update infinite, as the same
    product in NumPy's float16 does; fit's DivergenceError names the loss scale (the likeliest cause under
    float16: the zoo's CLIP diverged at the default 2**12 and trained at 2**8), not only the learning rate."""
    from onnxtrain.errors import DivergenceError

    rng = np.random.default_rng(3)
    x = rng.uniform(-1, 1, size=(8, 4)).astype(np.float32)
    t = rng.uniform(0.5, 1.0, size=(8, 2)).astype(np.float32)
    scale = 2.0**20
    g = -2 / t.size * t * scale  # d mean((XW - T)^2)/dY at W = 0, scaled: the product's incoming gradient
    with np.errstate(over="ignore", invalid="ignore"):  # float16 overflows there
        assert not np.all(np.isfinite(x.T.astype(np.float16) @ g.astype(np.float16)))
    model = linear_regression(np.zeros((4, 2), np.float32), np.zeros(2, np.float32), 1.0)
    engine = onnxtrain.load(model, mixed_precision="float16", loss_scale=scale)
    with pytest.raises(DivergenceError, match=r"lower the loss scale \(load's loss_scale, CLI --loss-scale; "
                                              r"now 1\.04858e\+06"):
        onnxtrain.fit(engine, [{"X": x, "T": t}] * 3, steps=3, log_every=1, progress=False)
    engine = onnxtrain.load(model, mixed_precision="float16")  # the default scale trains the same data
    onnxtrain.fit(engine, [{"X": x, "T": t}] * 3, steps=3, log_every=1, progress=False)


@pytest.mark.parametrize("options, message", [
    ({"mixed_precision": "bf16"}, "mixed_precision='bf16' is not one of ['bfloat16', 'float16']"),
    ({"mixed_precision": "bfloat16", "loss_scale": 8.0}, "loss_scale only applies with mixed_precision='float16'"),
    ({"loss_scale": 8.0}, "loss_scale only applies with mixed_precision='float16'"),
    ({"mixed_precision": "float16", "loss_scale": 0.0}, "loss_scale=0.0 must be a finite number > 0"),
    ({"mixed_precision": "float16", "loss_scale": float("inf")}, "loss_scale=inf must be a finite number > 0"),
    # a dot algorithm preset fixes the products' operand types too ("BF16_BF16_F32" had rounded float16's to bfloat16)
    ({"mixed_precision": "float16", "matmul_precision": "BF16_BF16_F32"},
     "matmul_precision='BF16_BF16_F32' is an algorithm preset, which sets the products' operand types, and "
     "mixed_precision='float16' sets them too"),
])
def test_bad_options_raise_at_load(options, message):
    model = linear_regression(np.zeros((4, 2), np.float32), np.zeros(2, np.float32), 1.0)
    with pytest.raises(OptionError) as raised:
        onnxtrain.load(model, **options)
    assert message in str(raised.value)


@pytest.mark.parametrize("weights", ["bfloat16", "float16"])
def test_mixed_precision_of_half_precision_weights_is_refused(weights):
    """A module `.to(torch.bfloat16)` before its export has no float32 master weights and computes in its weights'
    type already: mixed precision had loaded and changed nothing, or (float16) scaled the loss of float16 gradients,
    which torch's GradScaler refuses ("Attempting to unscale FP16 gradients"). A float32 constant the exporter
    lifts beside the weights (the dynamo export of a bfloat16 Llama holds two) does not make them master copies."""
    elem = {"bfloat16": TensorProto.BFLOAT16, "float16": TensorProto.FLOAT16}[weights]
    w = np.ones((4, 2), ml_dtypes.bfloat16 if weights == "bfloat16" else np.float16)
    graph = helper.make_graph(
        [helper.make_node("Cast", ["half"], ["half_cast"], to=elem), helper.make_node("MatMul", ["X", "W"], ["XW"]),
         helper.make_node("Mul", ["XW", "half_cast"], ["Y"])], "half",
        [helper.make_tensor_value_info("X", elem, [3, 4])], [helper.make_tensor_value_info("Y", elem, [3, 2])],
        [numpy_helper.from_array(w, "W"), numpy_helper.from_array(np.array(0.5, np.float32), "half")])
    model = onnxtrain.make_trainable(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]),
                                     trainable=["W"], optimizer="sgd")
    for precision in ("bfloat16", "float16"):
        with pytest.raises(OptionError, match=f"mixed_precision='{precision}': the model's weights are {weights}, "
                                              "not float32 master copies"):
            onnxtrain.load(model, mixed_precision=precision)
    onnxtrain.load(model)  # trains in its weights' type, as PyTorch does


def test_cli_trains_in_bfloat16(tmp_path):
    from onnxtrain.cli import main

    model = linear_regression(np.zeros((4, 2), np.float32), np.zeros(2, np.float32), 0.1)
    onnx.save(model, tmp_path / "m.onnx")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 4)).astype(np.float32)
    np.savez(tmp_path / "d.npz", X=x, T=x @ rng.normal(size=(4, 2)).astype(np.float32))
    assert main(["train", str(tmp_path / "m.onnx"), "--data", str(tmp_path / "d.npz"), "--steps", "3",
                 "--no-init", "--mixed-precision", "bfloat16", "-o", str(tmp_path / "out.onnx")]) == 0
    trained = numpy_helper.to_array(next(t for t in onnx.load(tmp_path / "out.onnx").graph.initializer
                                         if t.name == "W"))
    assert trained.dtype == np.float32 and np.any(trained != 0)
    assert main(["train", str(tmp_path / "m.onnx"), "--data", str(tmp_path / "d.npz"), "--mixed-precision",
                 "bfloat16", "--loss-scale", "8"]) == 2
