"""Convolutions (Conv, ConvTranspose, ConvInteger, QLinearConv, DeformConv); their window geometry is
lower/window.py, shared with the pools.

Layout: ONNX tensors are channels-first; XLA's CPU convolution is fastest channels-last, so every convolution
runs on (N, *spatial, C) activations with a (*spatial, I, O) kernel and hands its result on channels-last
(lower/layout.py), as do the pools and Resize: the elementwise ops between them keep that layout, so an
activation is transposed only where an op needs it channels-first (a channels-first pool between two
convolutions made a small CNN's train step twice as slow).
"""

from __future__ import annotations

import math
import operator
from functools import partial, reduce
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..autocast import compute_dtype, low_precision
from ..layout import (
    CHANNELS_LAST, ChannelsLast, Grid, KernelLast, channels_first, channels_last, kernel_last, kernel_last_axes,
    strided,
)
from ..registry import op, versions
from ..sampling import gather_taps, linear_taps
from ..target import target_platform
from ..window import (
    Window, check_auto_pad, explicit_pads, sliding_window, spatial_param, split_padding, window_views,
)


class Geometry(NamedTuple):
    """A convolution's window walk, hashable so custom_vjp can take it as a static argument."""

    strides: tuple[int, ...]
    padding: tuple[tuple[int, int], ...]  # explicit (begin, end) per spatial axis
    dilations: tuple[int, ...]
    groups: int = 1


def convolve(
    x,
    w,
    strides: Sequence[int],
    padding: Sequence[tuple[int, int]],
    dilations: Sequence[int],
    groups: int,
    input_dilation: Sequence[int] | None = None,
    accumulate=None,
    bias=None,
):
    """ONNX-layout convolution (x: N,C,*S, possibly held channels-last; w: O,C/groups,*K, possibly held as a
    KernelLast) plus an optional bias, computed and returned channels-last."""
    if x.shape[1] != w.shape[1] * groups:
        raise ValueError(f"X has {x.shape[1]} channels, W expects {w.shape[1]} per group x {groups} groups")
    if w.shape[0] % groups:
        raise ValueError(f"W's {w.shape[0]} output channels do not divide into {groups} groups")
    geometry = Geometry(tuple(strides), tuple(tuple(p) for p in padding), tuple(dilations), groups)
    x = channels_last(x)
    # the kernel's shape channels-last, (*K, I, O), whichever way it is stored
    last = jax.ShapeDtypeStruct(tuple(w.shape[a] for a in kernel_last_axes(w.ndim)), w.dtype)
    cpu = target_platform() == "cpu"  # elsewhere XLA's (cuDNN's) convolution is the fast one

    def biased(y):  # channels-last: the bias broadcasts along the minor axis
        return y if bias is None else y + jnp.asarray(bias).astype(y.dtype)

    depthwise_or_dense = groups == 1 or groups == x.shape[-1]
    if depthwise_or_dense and not input_dilation and accumulate is None and is_shallow(last, groups) and cpu:
        w = kernel_last(w)

        def at(grid: Grid | None):
            return biased(shallow_convolution(x, w, geometry, grid))

        return ChannelsLast(at(None), at)
    stored_last = isinstance(w, KernelLast)
    dense = groups == 1 and not input_dilation and accumulate is None
    if dense and cpu and prefers_patches(x.shape, last, geometry, constant=stored_last):
        return ChannelsLast(biased(patches_convolution(x, w.data if stored_last else w, last, stored_last, geometry)))
    if (dense and cpu and not stored_last and compute_dtype(x, w) == jnp.bfloat16
            and shifts_rows(x.shape, last, geometry)):
        return ChannelsLast(biased(rounded_shifted_product(x, w, geometry, jnp.bfloat16)))
    w = kernel_last(w)
    # Under mixed precision a convolution computes in the compute type, except on the CPU: there XLA converts
    # bfloat16 convolutions to float32 ones (Eigen's, YNNPACK's and oneDNN's alike, jaxlib 0.10.2), so rounding
    # would cost precision and time (ResNet-18's train step 1.21-1.26x the float32 one, MobileNetV3-small's
    # 1.02-1.12x); only a product of patches (rounded_patches_product) or of shifted rows (rounded_shifted_product)
    # computes in bfloat16 there.
    if accumulate is None and not cpu:
        (x, w), accumulate = low_precision(x, w)
        if accumulate is not None and target_platform() == "gpu":
            # cuDNN convolves half-precision operands into their own type (accumulating in float32 inside): asked
            # for a float32 result, XLA-GPU converted both operands back to float32 and ran float32 kernels, so
            # ResNet-18's bfloat16 step was no faster than its float32 one (H100). The result rounded to the
            # compute type, as torch.autocast's convolution returns it; float32 from there, as ONNX declares it.
            return ChannelsLast(biased(xla_convolution(x, w, geometry, input_dilation).astype(accumulate)))
    return ChannelsLast(biased(xla_convolution(x, w, geometry, input_dilation, accumulate)))


def xla_convolution(x, w, geometry: Geometry, input_dilation: Sequence[int] | None = None, accumulate=None):
    """XLA's convolution of channels-last x (N, *S, C) with a (*K, I, O) kernel."""
    rank = x.ndim - 2
    spatial = tuple(range(1, rank + 1))
    numbers = lax.ConvDimensionNumbers(
        lhs_spec=(0, rank + 1, *spatial), rhs_spec=(rank + 1, rank, *range(rank)), out_spec=(0, rank + 1, *spatial)
    )
    return lax.conv_general_dilated(
        x,
        w,
        window_strides=geometry.strides,
        padding=geometry.padding,
        lhs_dilation=tuple(input_dilation) if input_dilation else None,
        rhs_dilation=geometry.dilations,
        dimension_numbers=numbers,
        feature_group_count=geometry.groups,
        preferred_element_type=accumulate,
    )


# The largest contraction (input channels x kernel taps) for which XLA-CPU runs a dense convolution faster as
# multiply-adds of shifted views than as its convolution: a first layer (1 channel 5x5, 3 channels 3x3), where
# XLA-CPU's convolution is 3-10x slower than the arithmetic warrants (benchmarks/README.md). A depthwise
# convolution (one input channel per group) is 10-35x slower in XLA-CPU than as multiply-adds, whatever its
# channels; its kernel only has to stay small enough to unroll.
SHALLOW_CONTRACTION = 27
DEPTHWISE_TAPS = 64


# Where XLA-CPU's convolution loses to one matrix product of the patches (the kernel taps' shifted views side by
# side, as im2col builds them). Train step (input and kernel gradients, SGD's update) ÷ XLA's, 2 cores, batch
# 2 / 16: a 1x1 kernel 0.43-0.73 / 0.44; a 3x3 one strided over 16-256 channels 0.28-0.81 / 0.39-0.67; a first
# layer's strided 5x5 / 7x7 over 3 channels (kernel gradient only) 0.43-0.54 / 0.69; a 3x3 one over 256
# channels at 14x14 0.67 / 1.30, over 512 at 7x7 0.28 / 0.67, over 64-128 channels 1.5: deep layers of few
# positions. The patches are kept for the kernel's gradient: at most PATCHES_ELEMENTS of them.
PATCHES_STRIDED_CONTRACTION = 144  # taps x input channels
PATCHES_FEW_CHANNELS = 4  # input channels of a strided first layer
PATCHES_CONTRACTION = 2304
PATCHES_POSITIONS = 1024  # batch x output positions, with PATCHES_CONTRACTION
PATCHES_ELEMENTS = 2**23


def prefers_patches(x_shape: Sequence[int], w, geometry: Geometry, constant: bool = False) -> bool:
    """x_shape: (N, *S, C); w: (*kernel, I, O) (its shape only); `constant`: a kernel nothing differentiates
    (a KernelLast), for which a first layer's patches only slow the forward pass (ResNet-18's by 6 ms)."""
    taps = math.prod(w.shape[:-2])
    if taps == 1:
        return True
    contraction = taps * w.shape[-2]
    out = [(size + b + e - (k - 1) * d - 1) // s + 1 for size, (b, e), k, d, s in
           zip(x_shape[1:-1], geometry.padding, w.shape[:-2], geometry.dilations, geometry.strides)]
    positions = x_shape[0] * math.prod(out)
    if positions * contraction > PATCHES_ELEMENTS:
        return False
    strided = all(s > 1 for s in geometry.strides)
    first_layer = w.shape[-2] <= PATCHES_FEW_CHANNELS and not constant
    return (strided and (contraction >= PATCHES_STRIDED_CONTRACTION or first_layer)) or (
        contraction >= PATCHES_CONTRACTION and positions <= PATCHES_POSITIONS)


def patches_convolution(x, kernel, last, stored_last: bool, geometry: Geometry):
    """A dense convolution of channels-last x as one product of its patches with the kernel: ONNX's (O, I, *K)
    or a KernelLast's (*K, I, O) data (`stored_last`); `last` has the kernel's (*K, I, O) shape. A large kernel
    (more outputs than half the positions) is read as ONNX stores it, against patches of (I, taps) columns, so
    neither it nor its gradient is transposed (ResNet-18's 512-channel layers: 0.37x the time of the taps-major
    form); otherwise the patches are taps-major, the cheaper layout to build (0.47-0.84x), against the kernel as
    (taps x I, O). Under bfloat16 mixed precision an ONNX-ordered kernel's product is rounded_patches_product
    (a first layer's excepted); a constant kernel, stored taps-major, keeps the float32 product."""
    compute = None if stored_last else compute_dtype(x, kernel)
    if compute == jnp.bfloat16 and last.shape[-2] > PATCHES_FEW_CHANNELS:
        return rounded_patches_product(x, kernel, geometry, compute)
    views = [view for _, view in _shallow_views(x, last, geometry, None)]
    positions, outputs = views[0].shape[:-1], last.shape[-1]
    if not stored_last and 2 * outputs >= math.prod(positions):
        patches, matrix, contract = jnp.stack(views, axis=-1), kernel.reshape(outputs, -1), 1
    else:
        taps_major = kernel if stored_last else kernel_last(kernel)
        patches, matrix, contract = jnp.concatenate(views, axis=-1), taps_major.reshape(-1, outputs), 0
    y = lax.dot_general(patches.reshape(math.prod(positions), -1), matrix, (((1,), (contract,)), ((), ())))
    return y.reshape(*positions, outputs)


# Under bfloat16 mixed precision on the CPU a product of patches and both its gradient products run on bfloat16
# operands with float32 accumulation (YNNPACK's dot, avx512_bf16), where XLA's convolutions are float32 ones:
# forward and both gradients ÷ the float32 patches product, one process on 2 cores, ResNet-18's 3x3 over 128-512
# channels (strided or not) 0.58-0.67x, its strided 1x1 ones 0.63-1.07x, the strided 3x3 over 64 channels
# 0.87x, MobileNetV3-small's 1x1 ones 0.55-1.13x; its train step 0.84-0.88x the one with these products in
# float32 (three runs), MobileNetV3-small's 0.98x (0.91-1.20 per round). A first layer's (3 channels, 7x7) 1.6-1.7x: it
# stays float32. XLA-CPU keeps a bfloat16 product only where each operand contracts its minor axis (else it
# converts both to float32): the kernel is read as ONNX stores it, against patches of (I, taps) columns (rounding
# a taps-major copy of a 512-channel kernel and its gradient made those layers 2.3x slower), and the kernel's
# gradient is the gradient's transpose, copied row-major, times the patches (benchmarks/README.md). The patches
# are built from the float32 input and rounded once (XLA-CPU converts bfloat16 concatenations to float32 and
# back), and the input's gradient sums its patches' gradient in float32.
@partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def rounded_patches_product(x, kernel, geometry: Geometry, compute):
    """A dense convolution of channels-last x with an ONNX-ordered (O, I, *K) kernel as one product of the
    patches and the kernel rounded to `compute` (bfloat16), accumulated in and returned as float32; its
    gradients likewise."""
    return _rounded_patches_forward(x, kernel, geometry, compute)[0]


def _patches(x, kernel, geometry: Geometry):
    """The patches of channels-last x, (positions, I x taps) as an ONNX kernel's rows read them, and their
    (N, *spatial) positions."""
    last = jax.ShapeDtypeStruct((*kernel.shape[2:], *kernel.shape[1::-1]), kernel.dtype)
    patches = jnp.stack([view for _, view in _shallow_views(x, last, geometry, None)], axis=-1)
    return patches.reshape(-1, math.prod(kernel.shape[1:])), patches.shape[:-2]


def _rounded_patches_forward(x, kernel, geometry: Geometry, compute):
    patches, positions = _patches(x, kernel, geometry)
    patches, kernel = patches.astype(compute), kernel.astype(compute)
    matrix = kernel.reshape(kernel.shape[0], -1)
    y = lax.dot_general(patches, matrix, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return y.reshape(*positions, kernel.shape[0]), (x, patches, kernel)


def _rounded_patches_backward(geometry: Geometry, compute, residuals, grad):
    x, patches, kernel = residuals
    grad = grad.reshape(-1, grad.shape[-1]).astype(compute)
    _, col2im = jax.vjp(lambda x: _patches(x, kernel, geometry)[0], x)
    x_grad = col2im(jnp.dot(grad, kernel.reshape(kernel.shape[0], -1), preferred_element_type=jnp.float32))[0]
    return x_grad, jnp.dot(row_major(grad.T), patches, preferred_element_type=jnp.float32).reshape(kernel.shape)


rounded_patches_product.defvjp(_rounded_patches_forward, _rounded_patches_backward)


def row_major(a):
    """A copy of `a` (a transpose) laid out row-major: the copy a flat array, whose layout XLA cannot transpose
    back, so a product reads it contracting its minor axis (which keeps a bfloat16 product bfloat16)."""
    return jnp.reshape(lax.optimization_barrier(jnp.reshape(a, (-1,))), a.shape)


# A stride-1 convolution over at least SHIFTED_CHANNELS input and output channels that prefers no patches
# (ResNet-18's 3x3 over 128 channels at 28x28: too many positions) computes under bfloat16 mixed precision on the
# CPU as the sum of each kernel tap's product with the input's rows shifted by that tap: the padded input
# flattened to rows (batch x padded positions, channels), a tap a row offset on that grid, the positions past a
# row's end computed and dropped. No patches are built: XLA-CPU builds them slowly (a bfloat16 concatenation
# converted to float32 and back; 64 channels at 56x56 as rounded_patches_product 2.2-2.9x its float32
# convolution). The forward pass is one product with every tap's kernel side by side, its column blocks summed
# shifted; the input's gradient a product per tap (as one product 2.2x at 56x56: a float32 temporary 9x the
# input's size); the kernel's a product per tap of the gradient's row-major transpose and the shifted rows.
# Forward and both gradients ÷ XLA's float32 convolution, batch 2, alternating in one process on 2 cores:
# 128 channels at 28x28 0.76x (0.68-0.82) YNNPACK's, 0.57x Eigen's (the patches product 0.91-0.98x); ResNet-18's
# bfloat16 train step 0.94-0.97x (five runs, either plan). Over 64 channels at 56x56 it ran 1.08-1.11x (the 9
# kernel-gradient products of 64 x 64 outputs: 7.1 ms against XLA's 5.4) and the train step lost its gain, and
# at 256 channels at 14x14 1.2x the patches product, so those keep XLA's float32 convolution and the patches
# (benchmarks/README.md).
SHIFTED_CHANNELS = 128


def shifts_rows(x_shape: Sequence[int], w, geometry: Geometry) -> bool:
    """x_shape: (N, *S, C); w: (*kernel, I, O) (its shape only). The products' float32 terms (rows x taps x
    channels, summed only once all are computed) are held to the patches' budget, PATCHES_ELEMENTS."""
    rows = x_shape[0] * math.prod(size + b + e for size, (b, e) in zip(x_shape[1:-1], geometry.padding))
    return (all(s == 1 for s in geometry.strides) and min(w.shape[-2:]) >= SHIFTED_CHANNELS
            and rows * math.prod(w.shape[:-2]) * max(w.shape[-2:]) <= PATCHES_ELEMENTS)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def rounded_shifted_product(x, kernel, geometry: Geometry, compute):
    """A stride-1 dense convolution of channels-last x with an ONNX-ordered (O, I, *K) kernel as a sum over the
    kernel's taps of products of shifted rows of x and the tap's (O, I) kernel, both rounded to `compute`
    (bfloat16), accumulated in and returned as float32; its gradients likewise."""
    return _rounded_shifted_forward(x, kernel, geometry, compute)[0]


def _offsets(grid: Sequence[int], taps: Sequence[int], geometry: Geometry) -> list[int]:
    """Each kernel tap's row offset (row-major over `taps`) on the rows of a padded (N, *grid) input."""
    steps = [math.prod(grid[a + 1:]) for a in range(len(grid))]
    return [sum(t * d * step for t, d, step in zip(tap, geometry.dilations, steps)) for tap in np.ndindex(*taps)]


def _shifted_products(rows, kernels, offsets: Sequence[int], count: int, one_product: bool):
    """The sum over taps t of rows[offsets[t]:][:count] times kernels[t] (T, P, Q), contracting Q and rows'
    channels, accumulated in float32: one product with every tap's kernel whose column blocks are summed
    shifted, or a product per tap."""
    contract = (((1,), (1,)), ((), ()))
    if one_product:
        products = lax.dot_general(rows, kernels.reshape(-1, kernels.shape[-1]), contract,
                                   preferred_element_type=jnp.float32)
        width = kernels.shape[1]
        terms = [products[o:o + count, t * width:(t + 1) * width] for t, o in enumerate(offsets)]
    else:
        terms = [lax.dot_general(rows[o:o + count], k, contract, preferred_element_type=jnp.float32)
                 for o, k in zip(offsets, kernels)]
    return reduce(operator.add, terms)


def _on_grid(rows, shape: Sequence[int], corner: Sequence[int], size: Sequence[int]):
    """The first rows of a padded input's (N, *padded spatial) `shape` (the rest zero) as (N, *size, C) from
    `corner`."""
    rows = jnp.pad(rows, ((0, math.prod(shape) - rows.shape[0]), (0, 0))).reshape(*shape, -1)
    return lax.slice(rows, (0, *corner, 0), (shape[0], *[c + n for c, n in zip(corner, size)], rows.shape[-1]))


def _taps_first(kernel, axes: tuple[int, int]):
    """An (O, I, *K) kernel as (taps, its axes[0], its axes[1]), copied row-major."""
    moved = jnp.transpose(kernel, (*range(2, kernel.ndim), *axes))
    return row_major(moved.reshape(-1, *moved.shape[-2:]))


def _rounded_shifted_forward(x, kernel, geometry: Geometry, compute):
    kernel = kernel.astype(compute)
    padded = lax.pad(x.astype(compute), np.zeros((), compute),
                     [(0, 0, 0), *[(b, e, 0) for b, e in geometry.padding], (0, 0, 0)])
    rows, grid = padded.reshape(-1, x.shape[-1]), padded.shape[1:-1]
    offsets = _offsets(grid, kernel.shape[2:], geometry)
    y = _shifted_products(rows, _taps_first(kernel, (0, 1)), offsets, rows.shape[0] - offsets[-1],
                          one_product=True)
    out = [g - (k - 1) * d for g, k, d in zip(grid, kernel.shape[2:], geometry.dilations)]
    return _on_grid(y, padded.shape[:-1], (0,) * len(out), out), (rows, kernel)


def _rounded_shifted_backward(geometry: Geometry, compute, residuals, grad):
    rows, kernel = residuals
    out = grad.shape[1:-1]
    grid = [o + (k - 1) * d for o, k, d in zip(out, kernel.shape[2:], geometry.dilations)]
    offsets = _offsets(grid, kernel.shape[2:], geometry)
    span, count = offsets[-1], rows.shape[0] - offsets[-1]
    # the gradient on the rows of the grid (zero past each row's outputs)
    grad = jnp.pad(grad.astype(compute), [(0, 0), *[(0, g - o) for g, o in zip(grid, out)], (0, 0)])
    grad = grad.reshape(-1, grad.shape[-1])[:count]
    # padded input row q gets gradient row q - offset times the tap's transposed kernel
    x_rows = _shifted_products(jnp.pad(grad, ((span, span), (0, 0))), _taps_first(kernel, (1, 0)),
                               [span - o for o in offsets], rows.shape[0], one_product=False)
    x_grad = _on_grid(x_rows, (rows.shape[0] // math.prod(grid), *grid),
                      [b for b, _ in geometry.padding], [g - b - e for g, (b, e) in zip(grid, geometry.padding)])
    grad_t = row_major(grad.T)
    kernel_grad = [jnp.dot(grad_t, rows[o:o + count], preferred_element_type=jnp.float32) for o in offsets]
    return x_grad, jnp.stack(kernel_grad, axis=-1).reshape(kernel.shape)


rounded_shifted_product.defvjp(_rounded_shifted_forward, _rounded_shifted_backward)


def is_shallow(w, groups: int) -> bool:
    """w: (*kernel, in per group, out), channels-last."""
    if w.dtype not in (jnp.float32, jnp.float64):  # half precision must accumulate wider
        return False
    if groups == 1:
        return math.prod(w.shape[:-1]) <= SHALLOW_CONTRACTION
    return w.shape[-2] == 1 and math.prod(w.shape[:-2]) <= DEPTHWISE_TAPS


def _shallow_views(x, w, geometry: Geometry, grid: Grid | None):
    """The shifted views of each kernel tap, for the output positions of `grid` (all of them if None); for a
    depthwise convolution each input channel repeated for the outputs of its group."""
    padded = lax.pad(x, np.zeros((), x.dtype), [(0, 0, 0), *[(b, e, 0) for b, e in geometry.padding], (0, 0, 0)])
    if grid is None:
        spans = [(k - 1) * d + 1 for k, d in zip(w.shape[:-2], geometry.dilations)]
        out = [(size - span) // s + 1 for size, span, s in zip(padded.shape[1:-1], spans, geometry.strides)]
        grid = ((0,) * len(out), (1,) * len(out), tuple(out))
    starts, steps, counts = grid
    # output position p reads padded input p * stride + tap * dilation
    outer = tuple(p * s for p, s in zip(starts, geometry.strides))
    multiplier = w.shape[-1] // geometry.groups
    for offset, view in window_views(padded, w.shape[:-2], [t * s for t, s in zip(steps, geometry.strides)],
                                     geometry.dilations, counts, outer):
        yield offset, jnp.repeat(view, multiplier, axis=-1) if geometry.groups > 1 and multiplier > 1 else view


def _multiply_adds(x, w, geometry: Geometry, grid: Grid | None):
    total = None
    for offset, view in _shallow_views(x, w, geometry, grid):
        if geometry.groups > 1:  # depthwise: output channel o reads (its repeat of) one input channel
            terms = [view * w[(*offset, 0)]]
        else:
            terms = [view[..., c:c + 1] * w[(*offset, c)] for c in range(view.shape[-1])]
        for term in terms:
            total = term if total is None else total + term
    return total


@partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def shallow_convolution(x, w, geometry: Geometry, grid: Grid | None = None):
    """A convolution over few input channels, or a depthwise one (channels-last x, kernel (*K, I, O)), as a
    sum of broadcast multiplies of shifted views, at the output positions of `grid` (all if None): XLA fuses
    them into one loop."""
    return _multiply_adds(x, w, geometry, grid)


def _xla_convolution_at(x, w, geometry: Geometry, grid: Grid | None):
    y = xla_convolution(x, w, geometry)
    return y if grid is None else strided(y, grid)


def _shallow_forward(x, w, geometry: Geometry, grid: Grid | None):
    return shallow_convolution(x, w, geometry, grid), (x, w)


def _shallow_backward(geometry: Geometry, grid: Grid | None, residuals, grad):
    """The kernel's gradient from the same views: one product with the output gradient (im2col), or for a
    depthwise kernel one sum per tap. XLA's own ran a full-size convolution per pool window offset, over an
    output gradient that is mostly zeros. The input's gradient (dead code in a first layer): XLA's
    convolution's for a dense kernel, the multiply-adds' own for a depthwise one (XLA's is the slow kind)."""
    x, w = residuals
    views = [view for _, view in _shallow_views(x, w, geometry, grid)]
    batch_axes = tuple(range(grad.ndim - 1))
    if geometry.groups > 1:
        dw = jnp.stack([jnp.sum(view * grad, axis=batch_axes) for view in views])
        dx_of = partial(_multiply_adds, w=w, geometry=geometry, grid=grid)
    else:
        # The patches built taps-and-channels by positions, the layout the product reads: concatenated along
        # the channels, XLA-CPU copied them into it (a small CNN's train step 7-15 % slower)
        positions = math.prod(grad.shape[:-1])
        patches = jnp.stack([jnp.moveaxis(view, -1, 0) for view in views]).reshape(-1, positions)
        dw = jnp.dot(patches, grad.reshape(positions, grad.shape[-1]))
        dx_of = partial(_xla_convolution_at, w=w, geometry=geometry, grid=grid)
    _, pullback = jax.vjp(dx_of, x)
    return pullback(grad)[0], jnp.reshape(dw, w.shape).astype(w.dtype)


shallow_convolution.defvjp(_shallow_forward, _shallow_backward)


def conv_window(x, w, kernel_shape, strides, dilations, pads, auto_pad) -> Window:
    if x.ndim < 3:
        raise ValueError(f"X must have a batch, a channel and at least one spatial axis, got shape {x.shape}")
    if w.ndim != x.ndim:
        raise ValueError(f"W has rank {w.ndim}, X has rank {x.ndim}")
    if kernel_shape and tuple(kernel_shape) != tuple(w.shape[2:]):
        raise ValueError(f"kernel_shape {list(kernel_shape)} does not match W's spatial shape {list(w.shape[2:])}")
    return sliding_window(x.shape[2:], w.shape[2:], strides, dilations, pads, auto_pad)


@op("Conv", *versions("Conv"), layout=CHANNELS_LAST)
def conv(X, W, B=None, *, auto_pad="NOTSET", dilations=None, group=1, kernel_shape=None, pads=None, strides=None):
    window = conv_window(X, W, kernel_shape, strides, dilations, pads, auto_pad)
    return convolve(X, W.astype(X.dtype), window.strides, window.exact_pads, window.dilations, group, bias=B)


def integer_operand(v, zero_point, channel_axis_size: int | None = None):
    """v - zero_point as exact float64 integers; a 1-D zero point of length `channel_axis_size` applies per
    output channel."""
    v = jnp.asarray(v).astype(jnp.float64)
    if zero_point is None:
        return v
    zp = jnp.asarray(zero_point).astype(jnp.float64)
    if zp.ndim == 1 and zp.shape[0] != 1:
        if zp.shape[0] != channel_axis_size:
            raise ValueError(f"a per-channel zero point has {zp.shape[0]} entries for {channel_axis_size} channels")
        zp = jnp.reshape(zp, (-1,) + (1,) * (v.ndim - 1))
    else:
        zp = jnp.reshape(zp, ())
    return v - zp


def integer_conv(x, x_zero_point, w, w_zero_point, auto_pad, dilations, group, kernel_shape, pads, strides, bias=None):
    """The int32 accumulation shared by ConvInteger and QLinearConv (zero points pad as zeros). It runs as a
    float64 convolution: exact (8-bit products summed stay far below 2**53), 10x faster than XLA's integer one
    on CPU, and the only one GPUs have (cuDNN takes int8 operands, not zero-point-shifted ones)."""
    window = conv_window(x, w, kernel_shape, strides, dilations, pads, auto_pad)
    xi = integer_operand(x, x_zero_point)
    wi = integer_operand(w, w_zero_point, w.shape[0])
    y = convolve(xi, wi, window.strides, window.exact_pads, window.dilations, group, bias=bias)
    return channels_first(y).astype(jnp.int32)


@op("ConvInteger", *versions("ConvInteger"))
def conv_integer(
    x, w, x_zero_point=None, w_zero_point=None, *, auto_pad="NOTSET", dilations=None, group=1, kernel_shape=None,
    pads=None, strides=None,
):
    return integer_conv(x, x_zero_point, w, w_zero_point, auto_pad, dilations, group, kernel_shape, pads, strides)


@op("QLinearConv", *versions("QLinearConv"))
def qlinear_conv(
    x, x_scale, x_zero_point, w, w_scale, w_zero_point, y_scale, y_zero_point, B=None, *, auto_pad="NOTSET",
    dilations=None, group=1, kernel_shape=None, pads=None, strides=None,
):
    acc = integer_conv(x, x_zero_point, w, w_zero_point, auto_pad, dilations, group, kernel_shape, pads, strides, B)
    w_scale = jnp.asarray(w_scale)
    if w_scale.size > 1:
        w_scale = jnp.reshape(w_scale, (1, -1) + (1,) * (acc.ndim - 2))
    scale_dtype = jnp.result_type(x_scale, w_scale, y_scale)
    multiplier = jnp.asarray(x_scale).astype(scale_dtype) * w_scale.astype(scale_dtype) / jnp.asarray(y_scale)
    out_dtype = jnp.asarray(y_zero_point).dtype if y_zero_point is not None else jnp.asarray(x).dtype
    y = jnp.round(acc.astype(scale_dtype) * multiplier)  # round half to even, as the spec asks
    if y_zero_point is not None:
        y = y + jnp.asarray(y_zero_point).astype(scale_dtype)
    info = jnp.iinfo(out_dtype)
    return jnp.clip(y, info.min, info.max).astype(out_dtype)


def transpose_padding(
    size: int, span: int, stride: int, extra: int, pad: tuple[int, int], target: int | None, extra_at_end: bool
) -> tuple[int, int]:
    """ConvTranspose's pads on one axis: explicit, or derived from output_shape / SAME (the target size)."""
    if target is None:
        return pad
    total = stride * (size - 1) + extra + span - target
    if total < 0:  # a target larger than the full output: grow it at the end, as output_padding does
        return (0, total)
    return split_padding(total, extra_at_end)


def conv_transpose_op(legacy_split: bool):
    """ConvTranspose; `legacy_split` is opset 1's rule for splitting an odd derived pad (the reverse of 11's)."""

    def conv_transpose(
        X, W, B=None, *, auto_pad="NOTSET", dilations=None, group=1, kernel_shape=None, output_padding=None,
        output_shape=None, pads=None, strides=None,
    ):
        check_auto_pad(auto_pad)
        rank = X.ndim - 2
        if W.ndim != X.ndim:
            raise ValueError(f"W has rank {W.ndim}, X has rank {X.ndim}")
        if X.shape[1] != W.shape[0]:
            raise ValueError(f"X has {X.shape[1]} channels, W has {W.shape[0]} input channels")
        kernel = tuple(W.shape[2:])
        if kernel_shape and tuple(kernel_shape) != kernel:
            raise ValueError(f"kernel_shape {list(kernel_shape)} does not match W's spatial shape {list(kernel)}")
        strides = spatial_param(strides, rank, 1, "strides")
        dilations = spatial_param(dilations, rank, 1, "dilations")
        extras = spatial_param(output_padding, rank, 0, "output_padding")
        padding = explicit_pads(pads, rank) if auto_pad == "NOTSET" else ((0, 0),) * rank
        targets: list[int | None] = [None] * rank
        if output_shape:
            targets = [int(t) for t in output_shape][-rank:]
        elif auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            targets = [size * s for size, s in zip(X.shape[2:], strides)]
        extra_at_end = (auto_pad == "SAME_UPPER") != legacy_split
        spans = [(k - 1) * d + 1 for k, d in zip(kernel, dilations)]
        padding = [
            transpose_padding(size, span, s, e, p, t, extra_at_end)
            for size, span, s, e, p, t in zip(X.shape[2:], spans, strides, extras, padding, targets)
        ]
        # a transposed convolution is a convolution of the stride-dilated input with the flipped, transposed kernel
        conv_padding = [(span - 1 - b, span - 1 - e + extra) for span, (b, e), extra in zip(spans, padding, extras)]
        c_in, m_per_group = W.shape[0], W.shape[1]
        w = jnp.reshape(W, (group, c_in // group, m_per_group, *kernel))
        w = jnp.swapaxes(w, 1, 2).reshape((group * m_per_group, c_in // group, *kernel))
        w = jnp.flip(w, axis=tuple(range(2, rank + 2)))
        return convolve(
            X, w.astype(X.dtype), (1,) * rank, conv_padding, dilations, group, input_dilation=strides, bias=B
        )

    return conv_transpose


op("ConvTranspose", 1, layout=CHANNELS_LAST)(conv_transpose_op(legacy_split=True))
conv_transpose = op("ConvTranspose", *versions("ConvTranspose", since=11), layout=CHANNELS_LAST)(
    conv_transpose_op(legacy_split=False)
)


def deform_conv_impl(X, W, offset, B, mask, *, dilations, group, kernel_shape, offset_group, pads, strides):
    rank = X.ndim - 2
    n, c = X.shape[:2]
    kernel = tuple(W.shape[2:])
    if kernel_shape and tuple(kernel_shape) != kernel:
        raise ValueError(f"kernel_shape {list(kernel_shape)} does not match W's spatial shape {list(kernel)}")
    window = sliding_window(X.shape[2:], kernel, strides, dilations, pads)
    taps = math.prod(kernel)
    out = tuple(offset.shape[2:])
    if out != window.out:
        raise ValueError(f"offset's spatial shape {out} is not the convolution's output shape {window.out}")
    if offset.shape[1] != offset_group * taps * rank:
        raise ValueError(f"offset has {offset.shape[1]} channels, expected offset_group x prod(kernel) x {rank}")
    if c % offset_group:
        raise ValueError(f"{c} input channels do not divide into offset_group={offset_group}")
    offset = jnp.reshape(offset, (n, offset_group, taps, rank, *out))
    # where each kernel tap lands before the learned offsets: (rank, taps, *out)
    kernel_grid = np.stack(np.meshgrid(*[np.arange(k) * d for k, d in zip(kernel, window.dilations)], indexing="ij"))
    kernel_grid = kernel_grid.reshape(rank, taps)
    output_grid = np.stack(
        np.meshgrid(*[np.arange(o) * s - b for o, s, (b, _) in zip(out, window.strides, window.pads)], indexing="ij")
    )
    base = np.swapaxes(kernel_grid.reshape(rank, taps, *([1] * rank)) + output_grid[:, None], 0, 1)
    coords = offset + jnp.asarray(base, offset.dtype)  # (n, offset_group, taps, rank, *out)
    q = taps * math.prod(out)
    axis_taps = [
        linear_taps(jnp.reshape(coords[:, :, :, a], (n, offset_group, q)), X.shape[2 + a]) for a in range(rank)
    ]
    x = jnp.reshape(X, (n, offset_group, c // offset_group, -1))
    sampled = gather_taps(x, axis_taps, X.shape[2:])  # (n, offset_group, c/offset_group, taps * prod(out))
    sampled = jnp.reshape(sampled, (n, offset_group, c // offset_group, taps, -1))
    if mask is not None:
        sampled = sampled * jnp.reshape(mask, (n, offset_group, 1, taps, -1)).astype(sampled.dtype)
    sampled = jnp.reshape(sampled, (n, group, c // group, taps, -1))
    weights = jnp.reshape(W, (group, W.shape[0] // group, c // group, taps)).astype(sampled.dtype)
    y = jnp.reshape(jnp.einsum("ngcto,gmct->ngmo", sampled, weights), (n, W.shape[0], *out))
    if B is None:
        return y
    return y + jnp.reshape(B, (1, -1) + (1,) * rank).astype(y.dtype)


@op("DeformConv", *versions("DeformConv"))
def deform_conv(
    X, W, offset, B=None, mask=None, *, dilations=None, group=1, kernel_shape=None, offset_group=1, pads=None,
    strides=None,
):
    return deform_conv_impl(
        X, W, offset, B, mask, dilations=dilations, group=group, kernel_shape=kernel_shape,
        offset_group=offset_group, pads=pads, strides=strides,
    )
