"""Sliding-window geometry shared by the convolutions and the pools (their specs share these formulas):
kernel / strides / dilations / pads / auto_pad / ceil_mode -> each axis' output size and padding, and the
strided views a window's taps read."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Sequence

from jax import lax

AUTO_PADS = ("NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID")


def spatial_param(values: Sequence[int] | None, rank: int, default: int, name: str) -> tuple[int, ...]:
    """An attribute with one entry per spatial axis (strides, dilations, kernel_shape), defaulted."""
    if values is None or len(values) == 0:
        return (default,) * rank
    if len(values) != rank:
        raise ValueError(f"{name} has {len(values)} entries, the input has {rank} spatial axes")
    return tuple(int(v) for v in values)


def explicit_pads(pads: Sequence[int] | None, rank: int) -> tuple[tuple[int, int], ...]:
    """ONNX's [b1, b2, ..., e1, e2, ...] as ((b1, e1), (b2, e2), ...)."""
    if pads is None or len(pads) == 0:
        return ((0, 0),) * rank
    if len(pads) != 2 * rank:
        raise ValueError(f"pads has {len(pads)} entries, expected {2 * rank} (begin and end of each spatial axis)")
    return tuple((int(pads[i]), int(pads[i + rank])) for i in range(rank))


def split_padding(total: int, extra_at_end: bool) -> tuple[int, int]:
    """Split `total` padding in two halves; the odd one goes to the end (SAME_UPPER) or the beginning."""
    small, large = total // 2, total - total // 2
    return (small, large) if extra_at_end else (large, small)


def check_auto_pad(auto_pad: str) -> None:
    if auto_pad not in AUTO_PADS:
        raise ValueError(f"auto_pad must be one of {', '.join(AUTO_PADS)}, got {auto_pad!r}")


@dataclass(frozen=True)
class Window:
    """Where a sliding window visits one input: sizes per spatial axis, pads as ONNX declares them."""

    in_size: tuple[int, ...]
    kernel: tuple[int, ...]
    strides: tuple[int, ...]
    dilations: tuple[int, ...]
    pads: tuple[tuple[int, int], ...]  # explicit, or derived from auto_pad
    out: tuple[int, ...]

    @property
    def span(self) -> tuple[int, ...]:
        """The extent of one dilated window."""
        return tuple((k - 1) * d + 1 for k, d in zip(self.kernel, self.dilations))

    @property
    def exact_pads(self) -> tuple[tuple[int, int], ...]:
        """Pads whose padded input ends where the last window ends: ceil_mode grows the end, a window that does
        not fit any more shrinks it (negative), so XLA's floor rule yields exactly `out`."""
        return tuple(
            (begin, (o - 1) * s + span - size - begin)
            for (begin, _), o, s, span, size in zip(self.pads, self.out, self.strides, self.span, self.in_size)
        )

    @property
    def is_tiling(self) -> bool:
        """Non-overlapping windows with no padding: a reshape then a reduction does the job."""
        return (
            self.strides == self.kernel
            and all(d == 1 for d in self.dilations)
            and all(b == 0 and e <= 0 for b, e in self.exact_pads)
        )


def sliding_window(
    in_size: Sequence[int],
    kernel: Sequence[int],
    strides: Sequence[int] | None = None,
    dilations: Sequence[int] | None = None,
    pads: Sequence[int] | None = None,
    auto_pad: str = "NOTSET",
    ceil_mode: int = 0,
) -> Window:
    """The output size and padding of Conv and the pools (their specs share these formulas)."""
    check_auto_pad(auto_pad)
    rank = len(in_size)
    kernel = tuple(int(k) for k in kernel)
    strides = spatial_param(strides, rank, 1, "strides")
    dilations = spatial_param(dilations, rank, 1, "dilations")
    spans = [(k - 1) * d + 1 for k, d in zip(kernel, dilations)]
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        out = tuple(-(-size // s) for size, s in zip(in_size, strides))
        totals = [max(0, (o - 1) * s + span - size) for o, s, span, size in zip(out, strides, spans, in_size)]
        padding = tuple(split_padding(t, auto_pad == "SAME_UPPER") for t in totals)
    elif auto_pad == "VALID":
        padding = ((0, 0),) * rank
        out = tuple((size - span) // s + 1 for size, span, s in zip(in_size, spans, strides))
    else:
        padding = explicit_pads(pads, rank)
        out = tuple(
            _explicit_out(size, b, e, span, s, bool(ceil_mode))
            for size, (b, e), span, s in zip(in_size, padding, spans, strides)
        )
    if any(o < 1 for o in out):
        padded = tuple(size + b + e for size, (b, e) in zip(in_size, padding))
        raise ValueError(f"the window {kernel} (dilations {dilations}) does not fit the input {tuple(in_size)} "
                         f"padded to {padded} (pads {padding}, auto_pad {auto_pad})")
    return Window(tuple(int(s) for s in in_size), kernel, strides, dilations, padding, out)


def _explicit_out(size: int, begin: int, end: int, span: int, stride: int, ceil_mode: bool) -> int:
    room = size + begin + end - span
    if not ceil_mode:
        return room // stride + 1
    out = -(-room // stride) + 1
    if (out - 1) * stride >= size + begin:  # the last window would start in the end padding: drop it
        out -= 1
    return out


def window_views(padded, kernel: Sequence[int], strides: Sequence[int], dilations: Sequence[int],
                 out: Sequence[int], origin: Sequence[int] | None = None):
    """For each kernel offset, the strided view of channels-last `padded` (N, *spatial, C) that the offset's tap
    reads across all windows (the first window at `origin`): the (N, *out, C) operands of a convolution or
    pooling written as shifted slices."""
    origin = origin or (0,) * len(kernel)
    for offset in itertools.product(*[range(k) for k in kernel]):
        start = [0, *[o + j * d for o, j, d in zip(origin, offset, dilations)], 0]
        limit = [padded.shape[0], *[b + (o - 1) * s + 1 for b, o, s in zip(start[1:], out, strides)],
                 padded.shape[-1]]
        yield offset, lax.slice(padded, start, limit, (1, *strides, 1))
