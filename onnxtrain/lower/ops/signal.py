"""Signal processing: DFT, STFT, the cosine-sum windows and MelWeightMatrix.

ONNX stores a complex tensor as a real one with a trailing axis of 2 (real, imaginary); a real signal has a
trailing axis of 1. Transforms run in complex64 (complex128 for float64 inputs; XLA has no half-precision FFT)
and come back in the input's type. A real signal's full spectrum is its real FFT mirrored by conjugate symmetry:
half the work, and the imaginary parts at DC and Nyquist come out exactly zero rather than complex64 noise.
Lengths, axes and window sizes shape the output, so they are static.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax

from ...dtypes import np_dtype
from ..registry import op, versions
from ..values import Value, static_int

Array = Any  # a jax array or a NumPy array (static value)


def _to_complex(x: Array) -> Array:
    """The signal of an ONNX [..., 1] (real) or [..., 2] (complex) tensor, in the type the FFT runs in."""
    wide = np.float64 if np.dtype(x.dtype) == np.float64 else np.float32
    x = jnp.asarray(x).astype(wide)
    if x.shape[-1] == 1:
        return x[..., 0]
    if x.shape[-1] == 2:
        return lax.complex(x[..., 0], x[..., 1])
    raise ValueError(f"the last axis must be 1 (real) or 2 (complex), got {x.shape[-1]}")


def _from_complex(z: Array, dtype: np.dtype) -> Array:
    return jnp.stack([jnp.real(z), jnp.imag(z)], axis=-1).astype(dtype)


def dft(x: Array, length: int | None, axis: int, inverse: bool, onesided: bool) -> Array:
    rank = np.ndim(x)
    if not -rank <= axis < rank or axis % rank == rank - 1:
        raise ValueError(f"axis {axis} is out of range: the last of the {rank} axes holds real/imaginary parts")
    axis %= rank
    signal = _to_complex(x)
    if length is None:
        size = signal.shape[axis]
        length = 2 * (size - 1) if inverse and onesided else size
    if length < 1:
        raise ValueError(f"dft_length must be positive, got {length}")
    if inverse and onesided:  # a one-sided spectrum back to a real signal
        return jnp.fft.irfft(signal, n=length, axis=axis)[..., None].astype(x.dtype)
    if inverse:
        return _from_complex(jnp.fft.ifft(signal, n=length, axis=axis), x.dtype)
    if jnp.iscomplexobj(signal):
        spectrum = jnp.fft.fft(signal, n=length, axis=axis)
        if onesided:  # a complex input has no symmetry to exploit: keep the first half of the full spectrum
            spectrum = lax.slice_in_dim(spectrum, 0, length // 2 + 1, axis=axis)
        return _from_complex(spectrum, x.dtype)
    half = jnp.fft.rfft(signal, n=length, axis=axis)
    if onesided:
        return _from_complex(half, x.dtype)
    mirrored = jnp.conj(jnp.flip(lax.slice_in_dim(half, 1, (length + 1) // 2, axis=axis), axis=axis))
    return _from_complex(jnp.concatenate([half, mirrored], axis=axis), x.dtype)


@op("DFT", *versions("DFT", since=20))
def dft_20(
    input: Array, dft_length: Value = None, axis: Value = None, *, inverse: int = 0, onesided: int = 0  # noqa: A002
) -> Array:
    length = None if dft_length is None else static_int(dft_length, "dft_length")
    along = -2 if axis is None else static_int(axis, "axis")
    return dft(input, length, along, bool(inverse), bool(onesided))


@op("DFT", *versions("DFT", until=19))
def dft_17(
    input: Array, dft_length: Value = None, *, axis: int = 1, inverse: int = 0, onesided: int = 0  # noqa: A002
) -> Array:
    """Opset 17 takes the axis as an attribute; its default, 1, is the first axis after the batch."""
    return dft_20(input, dft_length, np.array(axis), inverse=inverse, onesided=onesided)


@op("STFT", *versions("STFT"))
def stft(
    signal: Array, frame_step: Value, window: Array | None = None, frame_length: Value = None, *, onesided: int = 1
) -> Array:
    if np.ndim(signal) != 3:
        raise ValueError(f"signal must have rank 3 ([batch, length, 1 or 2]), got shape {np.shape(signal)}")
    step = static_int(frame_step, "frame_step")
    if frame_length is not None:
        size = static_int(frame_length, "frame_length")
    else:
        size = np.shape(window)[0] if window is not None else np.shape(signal)[1]
    if window is not None and np.shape(window) != (size,):
        raise ValueError(f"window must be a vector of frame_length {size}, got shape {np.shape(window)}")
    if step < 1 or not 1 <= size <= np.shape(signal)[1]:
        length = np.shape(signal)[1]
        raise ValueError(f"frame_step {step} and frame_length {size} do not fit a signal of length {length}")
    frames = (np.shape(signal)[1] - size) // step + 1
    positions = np.arange(frames)[:, None] * step + np.arange(size)[None, :]
    framed = jnp.asarray(signal)[:, positions, :]  # [batch, frames, frame_length, 1 or 2]
    if window is not None:
        framed = framed * jnp.reshape(window, (size, 1)).astype(framed.dtype)
    return dft(framed, size, 2, inverse=False, onesided=bool(onesided))


# Cosine-sum windows: w[n] = sum_k (-1)^k a_k cos(2 pi k n / N), N = size (periodic) or size - 1 (symmetric).
WINDOWS: dict[str, tuple[float, ...]] = {
    "HannWindow": (0.5, 0.5),
    "HammingWindow": (25 / 46, 21 / 46),
    "BlackmanWindow": (0.42, 0.5, 0.08),
}


def _cosine_window(coefficients: tuple[float, ...]):
    def window(size: Value, *, output_datatype: int = 1, periodic: int = 1) -> Array:
        length = static_int(size, "size")
        if length < 0:
            raise ValueError(f"size must not be negative, got {length}")
        period = length if periodic else length - 1
        if period == 0:  # a symmetric window of one point has no period: its value is the peak (as in NumPy)
            return jnp.ones(length, np_dtype(output_datatype))
        phase = 2 * jnp.pi * jnp.arange(length, dtype=np.float64) / period
        values = sum((-1) ** k * a * jnp.cos(k * phase) for k, a in enumerate(coefficients))
        return values.astype(np_dtype(output_datatype))

    return window


for _name, _coefficients in WINDOWS.items():
    op(_name, *versions(_name))(_cosine_window(_coefficients))


def _hz_to_mel(hz: Array) -> Array:
    return 2595 * jnp.log10(1 + hz / 700)


def _mel_to_hz(mel: Array) -> Array:
    return 700 * (10 ** (mel / 2595) - 1)


@op("MelWeightMatrix", *versions("MelWeightMatrix"))
def mel_weight_matrix(
    num_mel_bins: Value,
    dft_length: Value,
    sample_rate: Value,
    lower_edge_hertz: Array,
    upper_edge_hertz: Array,
    *,
    output_datatype: int = 1,
) -> Array:
    """Triangular filters with peak 1 between mel-spaced points snapped down to spectrogram bins.

    The num_mel_bins + 2 edge points divide the mel range into num_mel_bins + 2 steps (the top edge itself is
    never reached) and map to bin floor((dft_length + 1) * hz / sample_rate), as ONNX Runtime and ONNX's
    reference do: the spec leaves the snapping open and models are exported against those.
    """
    bands = static_int(num_mel_bins, "num_mel_bins")
    length = static_int(dft_length, "dft_length")
    rate = static_int(sample_rate, "sample_rate")
    low = _hz_to_mel(jnp.asarray(lower_edge_hertz, np.float64))
    high = _hz_to_mel(jnp.asarray(upper_edge_hertz, np.float64))
    steps = jnp.arange(bands + 2, dtype=np.float64)
    edges = jnp.floor((length + 1) * _mel_to_hz(low + steps * (high - low) / (bands + 2)) / rate).astype(np.int64)
    left, center, right = edges[:-2], edges[1:-1], edges[2:]
    j = jnp.arange(length // 2 + 1)[:, None]
    rising = jnp.where(center == left, j == center, (j - left) / jnp.maximum(center - left, 1))
    rising = jnp.where((j >= left) & (j <= center), rising, 0)
    falling = (right - j) / jnp.maximum(right - center, 1)
    weights = jnp.where((j >= center) & (j < right), falling, rising)
    return weights.astype(np_dtype(output_datatype))
