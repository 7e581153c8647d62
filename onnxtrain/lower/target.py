"""The platform a program is traced for, read by lowerings whose fastest form differs between XLA's backends.

A lowering that only picks between two computations of the same inputs could use `jax.lax.platform_dependent`,
but the first-layer convolution decides more than that: on the CPU it hands the pool after it a way to compute
it at each window offset, and the pool then reads it four times. Under `platform_dependent` every other backend
would take those four reads too, and differentiating them gives four kernel-gradient convolutions where one
would do (a small CNN's train step on a GPU ran many more kernels than a hand-written one). So the platform is
chosen where the program is traced: the engine knows the devices it places the program on.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterator

import jax

_PLATFORM: ContextVar[str | None] = ContextVar("onnxtrain_target_platform", default=None)


def target_platform() -> str:
    """"cpu", "gpu", "tpu", ...: the platform being traced for (JAX's default backend outside `targeting`)."""
    return _PLATFORM.get() or jax.default_backend()


@contextmanager
def targeting(platform: str) -> Iterator[None]:
    token = _PLATFORM.set(platform)
    try:
        yield
    finally:
        _PLATFORM.reset(token)
