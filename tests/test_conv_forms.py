"""The forms a convolution takes on the CPU (onnxtrain/lower/ops/conv.py): XLA's convolution, one product of the
patches (1x1 kernels, strided and deep ones), either with the kernel in ONNX's order (a trained weight) or in
the convolution's (a constant, layout.KernelLast). Every form gives the reference's values, and PyTorch's
gradients for the input and the kernel."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from onnx import TensorProto, helper

import onnxtrain
from onnxtrain.lower.ops.conv import Geometry, prefers_patches
from nodes import graph_model, run_both, value

torch = pytest.importorskip("torch")

SEED = 7

# (input channels, output channels, kernel, stride, dilation, pads (begin, begin, end, end), size, batch, patches)
CASES = {
    "strided 3x3 over 64 channels": (64, 8, 3, 2, 1, (1, 1, 1, 1), 9, 2, True),
    "deep 3x3 over 256 channels": (256, 4, 3, 1, 1, (1, 1, 1, 1), 5, 2, True),
    "1x1, strided, padded at the end": (16, 8, 1, 2, 1, (0, 0, 1, 1), 7, 3, True),
    "dilated strided 3x3 over 64 channels": (64, 6, 3, 2, 2, (2, 1, 2, 1), 11, 2, True),
    "strided 3x3 over 16 channels": (16, 8, 3, 2, 1, (1, 1, 1, 1), 9, 2, True),
    "a first layer's strided 7x7 over 3 channels (trained kernels only)": (3, 8, 7, 2, 1, (3, 3, 3, 3), 16, 2, True),
    "shallower 3x3: XLA's convolution": (32, 8, 3, 1, 1, (1, 1, 1, 1), 8, 2, False),
}


def case_model(rng, c_in, c_out, k, stride, dilation, pads, size, batch):
    x = rng.standard_normal((batch, c_in, size, size)).astype(np.float32)
    w = (rng.standard_normal((c_out, c_in, k, k)) / np.sqrt(c_in * k * k)).astype(np.float32)
    b = rng.standard_normal(c_out).astype(np.float32)
    node = helper.make_node("Conv", ["X", "W", "B"], ["Y"], strides=[stride] * 2, dilations=[dilation] * 2,
                            pads=list(pads))
    model = graph_model([node], [value("X", TensorProto.FLOAT, list(x.shape))], ["Y"], {"W": w, "B": b})
    return model, x, w, b


@pytest.mark.parametrize("case", CASES)
def test_each_form_matches_the_reference_and_pytorchs_gradients(case: str):
    *shape, patches = CASES[case]
    c_in, c_out, k, stride, dilation, pads, size, batch = shape
    geometry = Geometry((stride,) * 2, ((pads[0], pads[2]), (pads[1], pads[3])), (dilation,) * 2)
    assert prefers_patches((batch, size, size, c_in), np.empty((k, k, c_in, c_out)), geometry) == patches
    rng = np.random.default_rng(SEED)
    model, x, w, b = case_model(rng, *shape)
    ours, theirs = run_both(model, {"X": x})  # the kernel a constant: stored in the convolution's order
    np.testing.assert_allclose(ours[0], theirs[0], rtol=1e-4, atol=1e-4)

    fn, params = onnxtrain.load(model, check=False).jax_function()  # the kernel in ONNX's order, differentiated
    cotangent = rng.standard_normal(ours[0].shape).astype(np.float32)

    def loss(p: dict, x: jax.Array) -> jax.Array:
        return (fn(p, {"X": x})["Y"] * cotangent).sum()

    grads, grad_x = jax.grad(loss, argnums=(0, 1))(params, x)
    xt, wt, bt = (torch.tensor(v, requires_grad=True) for v in (x, w, b))
    padded = torch.nn.functional.pad(xt, (pads[1], pads[3], pads[0], pads[2]))
    y = torch.nn.functional.conv2d(padded, wt, bt, stride=stride, dilation=dilation)
    (y * torch.from_numpy(cotangent)).sum().backward()
    np.testing.assert_allclose(np.asarray(fn(params, {"X": x})["Y"]), y.detach().numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(grads["W"]), wt.grad.numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(grads["B"]), bt.grad.numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(grad_x), xt.grad.numpy(), rtol=1e-4, atol=1e-4)


# XLA's convolution in the geometries its forward pass and gradients take, compiled with the options onnxtrain
# gives a CPU program with convolutions (program.py: Eigen's convolution instead of YNNPACK's): (input channels,
# output channels, groups, kernel, stride, dilation, spatial size, batch). The gradients are convolutions too
# (an input gradient is a transposed convolution: XLA's lhs dilation where strided).
XLA_CASES = {
    "3x3 over 64 channels at 16x16": (64, 64, 1, (3, 3), (1, 1), (1, 1), (16, 16), 2),
    "strided 3x3": (16, 32, 1, (3, 3), (2, 2), (1, 1), (15, 15), 2),
    "dilated 3x3": (8, 8, 1, (3, 3), (1, 1), (2, 2), (12, 12), 1),
    "grouped 3x3": (16, 24, 4, (3, 3), (1, 1), (1, 1), (10, 10), 2),
    "1-D width 5": (12, 20, 1, (5,), (1,), (1,), (30,), 3),
    "3-D 3x3x3": (4, 6, 1, (3, 3, 3), (1, 1, 1), (1, 1, 1), (6, 7, 8), 2),
}


@pytest.mark.parametrize("case", XLA_CASES)
def test_xla_convolution_under_the_cpu_options_matches_the_default_compile_and_pytorch(case: str):
    from types import SimpleNamespace

    from jax import lax

    from onnxtrain.program import compiler_options

    c_in, c_out, groups, kernel, stride, dilation, size, batch = XLA_CASES[case]
    options = compiler_options([SimpleNamespace(op_type="Conv", domain="")], "cpu")
    assert options.get("xla_cpu_experimental_ynn_fusion_type"), "no YNNPACK option to check (jaxlib refuses it?)"
    rng = np.random.default_rng(SEED)
    x = rng.standard_normal((batch, c_in, *size)).astype(np.float32)
    w = (rng.standard_normal((c_out, c_in // groups, *kernel)) / np.sqrt(c_in * np.prod(kernel))).astype(np.float32)
    pads = [(d * (k - 1) // 2,) * 2 for k, d in zip(kernel, dilation)]

    def conv(x, w):
        return lax.conv_general_dilated(x, w, stride, pads, rhs_dilation=dilation, feature_group_count=groups)

    y_shape = jax.eval_shape(conv, x, w).shape
    cotangent = rng.standard_normal(y_shape).astype(np.float32)

    def forward_and_gradients(x, w, g):
        y, pullback = jax.vjp(conv, x, w)
        return (y, *pullback(g))

    lowered = jax.jit(forward_and_gradients).lower(x, w, cotangent)
    ours = lowered.compile(compiler_options=options)(x, w, cotangent)
    default = lowered.compile()(x, w, cotangent)

    xt, wt = (torch.tensor(v, requires_grad=True) for v in (x, w))
    torch_conv = getattr(torch.nn.functional, f"conv{len(kernel)}d")
    y = torch_conv(xt, wt, stride=stride, padding=[p for p, _ in pads], dilation=dilation, groups=groups)
    (y * torch.from_numpy(cotangent)).sum().backward()
    for got, base, theirs in zip(ours, default, (y.detach(), xt.grad, wt.grad)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(base), rtol=1e-5, atol=1e-4)
        np.testing.assert_allclose(np.asarray(got), theirs.numpy(), rtol=1e-4, atol=1e-4)
