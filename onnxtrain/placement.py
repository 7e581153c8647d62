"""Where arrays live: one device, or data parallel over several (batch split; state replicated or split).

Data parallelism uses JAX's own machinery: state and weights are replicated with a NamedSharding, or with
`shard_state` each split along one axis over the devices (as FSDP/ZeRO keep weights and optimizer moments: a
device holds 1/n of them); batched feeds are split along their first axis, and XLA's SPMD partitioner turns the
one jitted step into a per-device program with the collectives (the gradient all-reduce, and with split state
the all-gathers of the weights a product needs) inserted for us. The same code runs multi-host after
`jax.distributed.initialize()`.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .errors import FeedError, OptionError
from .ir import ValueInfo

BATCH_AXIS = "batch"


class Placement:
    def __init__(self, devices: Sequence[jax.Device] | None = None, shard_state: bool = False):
        if devices is not None and (isinstance(devices, (str, jax.Device))
                                    or not all(isinstance(d, jax.Device) for d in devices)):
            raise OptionError(f"devices is a list of JAX devices (e.g. jax.devices()[:2]), not {devices!r:.80}")
        self.devices = list(devices) if devices else None
        if self.devices and len(self.devices) > 1:
            self.mesh = Mesh(np.array(self.devices), (BATCH_AXIS,))
            self.replicated = NamedSharding(self.mesh, PartitionSpec())
            self.batch_sharding = NamedSharding(self.mesh, PartitionSpec(BATCH_AXIS))
        else:
            self.replicated = self.batch_sharding = None
        self.shard_state = shard_state and self.parallel  # split over one device is the whole array

    @property
    def platform(self) -> str:
        """The platform programs are compiled for: the devices', or JAX's default backend's."""
        return self.devices[0].platform if self.devices else jax.default_backend()

    @functools.cached_property
    def device(self) -> jax.Device:
        """The device of a one-device placement: the one given, else where jax.device_put puts an array (JAX's
        default device: jax_default_device, a device or a platform's name, or the first device). Read once: the
        state was put there at load."""
        if self.devices:
            return self.devices[0]
        default = jax.config.jax_default_device
        return jax.devices(default)[0] if isinstance(default, str) else default or jax.devices()[0]

    @property
    def parallel(self) -> bool:
        return self.batch_sharding is not None

    def sharding(self, shape: Sequence[int]) -> NamedSharding | None:
        """Replicated, or with shard_state split along the longest axis the device count divides (the first of
        equals); an array with no such axis (a scalar, a short bias) stays whole on every device."""
        if not self.shard_state:
            return self.replicated
        axes = [axis for axis, size in enumerate(shape) if size and size % len(self.devices) == 0]
        if not axes:
            return self.replicated
        axis = max(axes, key=lambda a: shape[a])
        return NamedSharding(self.mesh, PartitionSpec(*[BATCH_AXIS if a == axis else None for a in range(len(shape))]))

    def put(self, values: Mapping[str, Any], donated: bool = False) -> dict[str, jax.Array]:
        """Weights and state: on the default device, or on every device (whole, or split with shard_state).
        `donated`: arrays a step donates (the state), put as buffers that XLA owns. On the CPU, jax.device_put
        adopts a NumPy array that happens to be 64-byte aligned as the device buffer instead of copying it, and
        XLA cannot donate a buffer it does not own: a first step would hold the old state beside the new."""
        placed = {}
        for name, value in values.items():
            target = self.devices[0] if self.devices and not self.parallel else self.sharding(np.shape(value))
            array = jax.device_put(value, target)
            if donated and self.platform == "cpu" and adopted(array, value):  # (other platforms copy to device)
                # a copy between buffers: jnp.array(copy=True) compiled a program per shape (MobileNetV3-small's
                # load: 80 MB more resident)
                array = jax.device_put(array, target, may_alias=False)
            placed[name] = array
        return placed

    def keep_layout(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """Inside a traced step: each new state value laid out as `put` lays it out, so the step's output state
        is split like its input (the donated buffers are reused, and the state stays split step after step)."""
        if not self.shard_state:
            return dict(state)
        return {n: jax.lax.with_sharding_constraint(v, self.sharding(v.shape)) if np.ndim(v) else v
                for n, v in state.items()}

    def feeds(self, feeds: Mapping[str, Any], declared: Mapping[str, ValueInfo]) -> dict[str, Any]:
        """Batched feeds (first dimension symbolic or unknown) are split over the devices; others replicated. On
        one device, a jax array on another device is copied to it: the compiled program refused it (a ValueError
        about shardings), and a numpy array is put where the program runs anyway."""
        if not self.parallel:
            # (a per-call path: numpy feeds pass at once, and an uncommitted array goes where the program runs)
            elsewhere = [name for name, value in feeds.items()
                         if isinstance(value, jax.Array) and value.committed and value.devices() != {self.device}]
            return {**feeds, **{name: jax.device_put(feeds[name], self.device) for name in elsewhere}}
        placed = {}
        for name, value in feeds.items():
            if value is None or isinstance(value, list) or getattr(value, "dtype", None) == object:
                placed[name] = value
                continue
            info = declared.get(name)
            batched = np.ndim(value) > 0 and (info is None or not info.shape or not isinstance(info.shape[0], int))
            if batched and np.shape(value)[0] % len(self.devices):
                raise FeedError(
                    f"feed {name!r}: batch size {np.shape(value)[0]} is not divisible by the {len(self.devices)} "
                    f"devices it is split over"
                )
            # in x64 mode, as the step traces: outside it device_put makes an int64 feed int32 (labels: a
            # cross-entropy's Equal with its int64 ignore_index was refused as mixing types)
            with jax.enable_x64(True):
                placed[name] = jax.device_put(value, self.batch_sharding if batched else self.replicated)
        return placed


def adopted(array: jax.Array, source: Any) -> bool:
    """Whether jax.device_put made `source`'s memory (a NumPy array's) a buffer of `array`."""
    if not isinstance(source, np.ndarray) or not source.nbytes:
        return False
    start = source.ctypes.data
    return any(start <= shard.data.unsafe_buffer_pointer() < start + source.nbytes for shard in array.addressable_shards)


def host_array(value: Any) -> np.ndarray:
    """A value as a NumPy array; one split across hosts (shard_state on several hosts) is gathered first, a
    collective that every host must join."""
    if isinstance(value, jax.Array) and not value.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(value, tiled=True))
    return np.asarray(value)
