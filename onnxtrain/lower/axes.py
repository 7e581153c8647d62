"""Axis arguments: ONNX counts a negative axis from the end."""

from __future__ import annotations


def normalize_axis(axis: int, rank: int, what: str = "axis") -> int:
    """`axis` in [-rank, rank-1] as a non-negative index; a clear error outside that range."""
    if not -rank <= axis < rank:
        raise ValueError(f"{what} {axis} is out of range for a tensor of rank {rank}")
    return axis % rank
