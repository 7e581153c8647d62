"""Where arrays live: one device, or data parallel over several (batch split, state replicated).

Data parallelism uses JAX's own machinery: state and weights are replicated with a NamedSharding, batched feeds
are split along their first axis, and XLA's SPMD partitioner turns the one jitted step into a per-device program
with the gradient all-reduce inserted for us. The same code runs multi-host after `jax.distributed.initialize()`.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .errors import FeedError
from .model import ValueInfo

BATCH_AXIS = "batch"


class Placement:
    def __init__(self, devices: Sequence[jax.Device] | None = None):
        self.devices = list(devices) if devices else None
        if self.devices and len(self.devices) > 1:
            mesh = Mesh(np.array(self.devices), (BATCH_AXIS,))
            self.replicated = NamedSharding(mesh, PartitionSpec())
            self.split = NamedSharding(mesh, PartitionSpec(BATCH_AXIS))
        else:
            self.replicated = self.split = None

    @property
    def parallel(self) -> bool:
        return self.split is not None

    def put(self, values: Mapping[str, Any]) -> dict[str, jax.Array]:
        """Weights and state: on the default device, or replicated on every device."""
        if self.devices and not self.parallel:
            return {n: jax.device_put(v, self.devices[0]) for n, v in values.items()}
        return {n: jax.device_put(v, self.replicated) for n, v in values.items()}

    def feeds(self, feeds: Mapping[str, Any], declared: Mapping[str, ValueInfo]) -> dict[str, Any]:
        """Batched feeds (first dimension symbolic or unknown) are split over the devices; others replicated."""
        if not self.parallel:
            return dict(feeds)
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
            placed[name] = jax.device_put(value, self.split if batched else self.replicated)
        return placed
