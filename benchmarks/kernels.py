"""What one train step runs: XLA's kernels per step, with their time, for onnxtrain and the hand-written JAX step,
read from a `jax.profiler` trace of a few steps. On a GPU these are the device's kernels (cuBLAS and cuDNN
included); on the CPU, the thunks XLA's runtime executes.

    python benchmarks/kernels.py [--models mlp,cnn] [--steps 20] [--top 12]

Where a step is host-bound (a GPU running small models), the kernel count sets its time: benchmarks/README.md.
The counts are exact; the times carry the profiler's overhead and compare only within one run (on the CPU, where
XLA runs kernels on several threads at once, the peer profiled second measured up to 1.5x slower than first).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import sys
import tempfile
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).parent))
from models import MODELS, build  # noqa: E402
from peers import PEERS, make_batch  # noqa: E402

TRAINERS = ("onnxtrain", "jax")


def kernel_times(trace: Path) -> list[tuple[str, float]]:
    """(name, µs) of every kernel in a perfetto trace: the events of a device's process, or on the host the
    events of XLA's own threads that are not its runtime's bookkeeping (names with '::')."""
    events = json.loads(gzip.decompress(trace.read_bytes()))
    events = events["traceEvents"] if isinstance(events, dict) else events
    processes = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e["name"] == "thread_name"}

    def is_kernel(event: dict) -> bool:
        if processes.get(event["pid"], "").startswith("/device:"):
            return True
        thread = threads.get((event["pid"], event["tid"]), "")
        return thread.startswith("tf_XLA") and "::" not in event["name"]

    return [(e["name"], e.get("dur", 0.0)) for e in events if e.get("ph") == "X" and is_kernel(e)]


def profile(name: str, steps: int, top: int) -> None:
    bench = build(name)
    data = make_batch(bench, 64)
    for peer in TRAINERS:
        train = PEERS[peer](bench, data).train
        for _ in range(5):  # compiled, and past the first steps' one-time work
            train()
        with tempfile.TemporaryDirectory() as folder:
            with jax.profiler.trace(folder, create_perfetto_trace=True):
                for _ in range(steps):
                    train()
            kernels = kernel_times(next(Path(folder).rglob("*.json.gz")))
        per_name: dict[str, list[float]] = collections.defaultdict(list)
        for kernel, micros in kernels:
            per_name[kernel].append(micros)
        busy = sum(micros for _, micros in kernels) / steps
        print(f"{name} {peer}: {len(kernels) / steps:.0f} kernels per step, {busy:.0f} µs in them per step")
        for kernel, times in sorted(per_name.items(), key=lambda kv: -sum(kv[1]))[:top]:
            print(f"  {sum(times) / steps:9.1f} µs  x{len(times) / steps:<5.1f} {kernel[:90]}")


def main() -> None:
    args = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    args.add_argument("--models", default="mlp,cnn", help=f"comma-separated subset of {','.join(MODELS)}")
    args.add_argument("--steps", type=int, default=20, help="train steps in the trace")
    args.add_argument("--top", type=int, default=12, help="kernels listed per peer, by time")
    opts = args.parse_args()
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}")
    for name in opts.models.split(","):
        profile(name, opts.steps, opts.top)


if __name__ == "__main__":
    main()
