"""The benchmark suite: onnxtrain against hand-written JAX + optax, PyTorch eager and ONNX Runtime.

    python benchmarks/run.py [--steps 200] [--batch 64] [--models mlp,cnn,transformer,lstm] [--quick] [--write]

Everything is timed in this one process, in rounds that alternate between the peers, except ONNX Runtime training:
it needs its own environment (see README.md), so benchmarks/ort_training.py times it there, in a child process,
right after the in-process peers' medians of that model. First calls and peak memory are measured in a fresh child
process per model and peer: a compile leaves caches behind (XLA's GPU autotuning results among them) that would
favour whichever peer compiles second, and a process's peak RSS cannot be shared. `--write` puts the table, the
machine and the command into benchmarks/README.md. See that file for what each row means.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import onnx
import onnxruntime
import optax
import torch
from onnx import TensorProto, helper

sys.path.insert(0, str(Path(__file__).parent))
import onnxtrain  # noqa: E402
from host import child_result, cpu_name, memory_kib  # noqa: E402
from models import MODELS, Bench, build  # noqa: E402
from peers import (BETA1, BETA2, EPS, LR, ON_GPU, ORT_PROVIDER, PEERS, PRECISION, TORCH_DEVICE, Batch,  # noqa: E402
                   first_call, interleaved, make_batch, set_precision)

HERE = Path(__file__).parent
# onnxruntime-training installs the same `onnxruntime` module as the inference package imported here: see README.md
ORT_TRAINING_PYTHON = Path(os.environ.get("ORT_TRAINING_PYTHON") or HERE / ".ort-training" / "bin" / "python")
README = HERE / "README.md"
# a GPU run's table has markers of its own, so the CPU table and the GPU table are rewritten independently
MARKER = "results-gpu" if ON_GPU else "results"
BEGIN, END = f"<!-- {MARKER}:begin -->", f"<!-- {MARKER}:end -->"
COLUMNS = {"onnxtrain": "onnxtrain", "jax": "JAX", "torch": "PyTorch", "ort": "ORT", "ort_training": "ORT training"}
PEER_ORDER = list(COLUMNS)


@dataclass
class Row:
    model: str
    measure: str
    values: dict[str, float]  # peer -> number, in the measure's unit
    notes: dict[str, str] = field(default_factory=dict)  # peer -> text shown after the number

    def cells(self) -> list[str]:
        shown = [fmt(self.values[p]) + self.notes.get(p, "") if p in self.values else "–" for p in PEER_ORDER]
        ours = self.values.get("onnxtrain")
        ratios = [f"{ours / self.values[p]:.2f}" if ours is not None and self.values.get(p) else "–"
                  for p in PEER_ORDER[1:]]
        return [self.model, self.measure, *shown, *ratios]


def fmt(value: float) -> str:
    """Three significant digits without an exponent."""
    for limit, digits in ((100, 0), (10, 1), (1, 2)):
        if abs(value) >= limit:
            return f"{value:.{digits}f}"
    return f"{value:.3f}"


def table(rows: list[Row]) -> str:
    header = ["model", "measurement", *COLUMNS.values(), *(f"÷ {name}" for name in list(COLUMNS.values())[1:])]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * 2 + "---:|" * (len(header) - 2)]
    return "\n".join(lines + ["| " + " | ".join(row.cells()) + " |" for row in rows])


# ----- measurements ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    steps: int  # timed calls per peer and measurement
    rounds: int  # alternations between the peers
    warmup: int  # untimed calls per peer after the first
    memory_steps: int  # train steps the fresh child runs after its peak is reset
    dispatch_calls: int  # calls per peer of the tiny model
    batch: int


def model_rows(name: str, plan: Plan) -> list[Row]:
    """Train step and inference medians of every peer; first-call times and peak memory of onnxtrain and JAX,
    each in a fresh process."""
    bench = build(name)
    data = make_batch(bench, plan.batch)
    peers = {peer: make(bench, data) for peer, make in PEERS.items()}
    calls = {(kind, peer): getattr(p, kind) for peer, p in peers.items() for kind in ("train", "infer")
             if getattr(p, kind) is not None}
    for call in calls.values():
        for _ in range(plan.warmup + 1):  # the first call compiles (or, for PyTorch and ORT, warms up)
            call()
    median = interleaved(calls, plan.steps, plan.rounds)
    ort = ort_training(name, bench, data, plan)  # right after, so the machine's drift between them is least
    fresh = {peer: fresh_child(name, peer, plan) for peer in ("onnxtrain", "jax")}
    first = {(kind, peer): fresh[peer][f"first_{kind}"] for peer in fresh for kind in ("train", "infer")}
    if ort:
        median["train", "ort_training"], first["train", "ort_training"] = ort["median"], ort["first"]
    temporaries = {peer: p.lower_train().compile().memory_analysis().temp_size_in_bytes / 2**20
                   for peer, p in peers.items() if p.lower_train is not None}
    rows = []
    for kind, label in (("train", "train step (ms)"), ("infer", "infer (ms)")):
        rows.append(Row(name, label, {p: median[(k, p)] * 1e3 for k, p in median if k == kind}))
    for kind, label in (("train", "first call, train step (s)"), ("infer", "first call, infer (s)")):
        rows.append(Row(name, label, {p: first[(k, p)] for k, p in first if k == kind}))
    rows.append(Row(name, "train step temporaries (MB, XLA's buffer plan)", temporaries))
    if not ON_GPU:  # the state and a step's temporaries live in GPU memory there, which the RSS does not see
        state_mb = fresh["jax"]["state"] / 2**20
        rows.append(Row(name, f"train peak RSS increase (MB; state {fmt(state_mb)} MB)",
                        {peer: r["increase"] / 2**20 for peer, r in fresh.items()},
                        {peer: f" ({r['increase'] / r['state']:.1f}× state)" for peer, r in fresh.items()}))
    return rows


def ort_training(name: str, bench: Bench, data: Batch, plan: Plan) -> dict[str, Any] | None:
    """ONNX Runtime training's train step, timed by ort_training.py under ORT_TRAINING_PYTHON with this plan and
    the suite's Adam settings: its JSON result, or None (after saying why) when there is none."""
    if not ORT_TRAINING_PYTHON.exists():
        print(f"# ORT training: not measured, no {ORT_TRAINING_PYTHON} (see benchmarks/README.md)", flush=True)
        return None
    with tempfile.TemporaryDirectory() as folder:
        model, batch = Path(folder) / "model.onnx", Path(folder) / "batch.npz"
        onnx.save(bench.model, model)
        np.savez(batch, x=data.x, y=data.y)
        command = [str(ORT_TRAINING_PYTHON), str(HERE / "ort_training.py"), str(model), str(batch),
                   "--steps", str(plan.steps), "--rounds", str(plan.rounds), "--warmup", str(plan.warmup),
                   "--lr", str(LR), "--betas", str(BETA1), str(BETA2), "--eps", str(EPS)]
        done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:  # a model ORT cannot train is a missing cell, not a failed suite
        reason = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        print(f"# ORT training, {name}: not measured: {reason}", flush=True)
        return None
    result = json.loads(done.stdout.strip().splitlines()[-1])
    threads = {"0": "ORT's default threads", "1": "1 thread"}
    per_setting = ", ".join(f"{seconds * 1e3:.3g} ms with {threads.get(t, t + ' threads')}"
                            for t, seconds in result["medians"].items())
    print(f"# ORT training {result['onnxruntime']}, {name}: {per_setting}; generate_artifacts "
          f"{result['artifacts']:.2f} s", flush=True)
    return result


def fresh_child(name: str, peer: str, plan: Plan) -> dict[str, float]:
    """`peer`'s first calls and train-step memory on model `name`, measured by `measure_fresh` in a new process."""
    command = [sys.executable, __file__, "--fresh-child", f"{name}:{peer}", "--batch", str(plan.batch),
               "--steps", str(plan.memory_steps), "--precision", PRECISION["matmul"]]
    return child_result(command, f"fresh child {name}:{peer}")


def measure_fresh(spec: str, batch: int, steps: int) -> None:
    """Prints {"first_train": s, "first_infer": s, "state": bytes, "increase": bytes}: the first train step's
    and then the first inference's time (after `warm_up`, so JAX's own first-compile setup is not billed to the
    peer), and the peak RSS over `steps` train steps minus the settled RSS before them, that is the memory one
    step allocates beyond the state it keeps (XLA's temporaries and any output that does not reuse a donated
    buffer). Compiling and three steps come before those, so compile-time memory is not counted."""
    name, peer_name = spec.split(":")
    warm_up()
    bench = build(name)
    peer = PEERS[peer_name](bench, make_batch(bench, batch))
    first = {"first_train": first_call(peer.train), "first_infer": first_call(peer.infer)}
    for _ in range(2):
        peer.train()
    gc.collect()
    time.sleep(0.5)  # XLA frees a step's temporaries on its own threads, a little after the step returns
    before = memory_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
    for _ in range(steps):
        peer.train()
        time.sleep(0.02)  # let this step's temporaries go before the next: the peak is one step's, not two
    increase = (memory_kib("VmHWM") - before) * 1024
    print(json.dumps({**first, "state": peer.state_bytes, "increase": increase}))


def warm_up() -> None:
    """Compile one small value_and_grad + optax step, so that what JAX initializes on its first compile is not
    billed to whichever peer happens to compile first."""
    optimizer = optax.adam(1e-3)
    params = {"w": jnp.ones((4, 4))}

    @jax.jit
    def step(params: dict, opt_state: Any) -> tuple:
        grads = jax.grad(lambda p: jnp.sum(jnp.tanh(p["w"] @ p["w"])))(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    jax.block_until_ready(step(params, optimizer.init(params)))


def dispatch_rows(plan: Plan) -> list[Row]:
    """Per-call time of onnxtrain infer on one Add of two [4] tensors against a bare jax.jit of the same."""
    x = helper.make_tensor_value_info
    graph = helper.make_graph([helper.make_node("Add", ["A", "B"], ["C"])], "add",
                              [x("A", TensorProto.FLOAT, [4]), x("B", TensorProto.FLOAT, [4])],
                              [x("C", TensorProto.FLOAT, [4])])
    engine = onnxtrain.load(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    add = jax.jit(lambda a, b: a + b)
    a, b = jnp.arange(4, dtype=jnp.float32), jnp.ones(4, jnp.float32)
    calls = {"onnxtrain": lambda: jax.block_until_ready(engine.infer({"A": a, "B": b})),
             "jax": lambda: jax.block_until_ready(add(a, b))}
    for call in calls.values():
        for _ in range(max(10, plan.warmup)):
            call()
    median = {peer: seconds * 1e6 for peer, seconds in interleaved(calls, plan.dispatch_calls, plan.rounds).items()}
    return [Row("add [4]", "infer per call (µs)", median),
            Row("add [4]", "dispatch overhead (µs, onnxtrain − jax.jit)", {"onnxtrain": median["onnxtrain"]
                                                                            - median["jax"]})]


# ----- report --------------------------------------------------------------------------------------------------


def machine() -> str:
    cpu = cpu_name()
    training = ""
    if ORT_TRAINING_PYTHON.exists():  # the script's --version answers only where the training API imports
        probe = subprocess.run([str(ORT_TRAINING_PYTHON), str(HERE / "ort_training.py"), "--version"],
                               capture_output=True, text=True)
        training = f", onnxruntime-training {probe.stdout.strip()}" if probe.returncode == 0 else ""
    accelerator = f"{jax.devices()[0].device_kind} ({jax.default_backend()}), " if ON_GPU else ""
    return (f"{accelerator}{cpu}, {os.cpu_count()} cores; Python {platform.python_version()}, jax "
            f"{jax.__version__}, torch {torch.__version__} on {TORCH_DEVICE.type}, onnxruntime "
            f"{onnxruntime.__version__} ({ORT_PROVIDER}){training}, onnxtrain {getattr(onnxtrain, '__version__', '?')}")


def report(rows: list[Row], plan: Plan, argv: list[str], load: tuple[float, ...], precision: str) -> str:
    return "\n".join([
        f"Measured {datetime.date.today().isoformat()} on {machine()}; load average (1, 5, 15 min) at start "
        f"{', '.join(f'{v:.2f}' for v in load)}.",
        "",
        f"Command: `python benchmarks/run.py{''.join(' ' + a for a in argv)}` (batch {plan.batch}, median of "
        f"{plan.steps} calls per peer in {plan.rounds} interleaved rounds; {precision} float32 matrix "
        "products).",
        "",
        table(rows),
    ])


def write_readme(text: str) -> None:
    """Replace what lies between the result markers of benchmarks/README.md (append them if absent)."""
    current = README.read_text() if README.exists() else ""
    block = f"{BEGIN}\n{text}\n{END}"
    if BEGIN in current and END in current:
        head, rest = current.split(BEGIN, 1)
        updated = head + block + rest.split(END, 1)[1]
    else:
        updated = current.rstrip() + ("\n\n" if current else "") + block + "\n"
    README.write_text(updated)


def parse(argv: list[str]) -> argparse.Namespace:
    args = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    args.add_argument("--steps", type=int, help="timed calls per peer (default 200, --quick 10)")
    args.add_argument("--batch", type=int, default=64)
    args.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {','.join(MODELS)}")
    args.add_argument("--quick", action="store_true", help="a smoke run: few steps, numbers not meaningful")
    args.add_argument("--precision", choices=("highest", "default"), default="highest",
                      help="float32 matrix products of every peer: full float32, or TF32 where the GPU has it")
    args.add_argument("--write", action="store_true", help="update the table in benchmarks/README.md")
    args.add_argument("--fresh-child", help=argparse.SUPPRESS)  # MODEL:PEER, run by fresh_child
    opts = args.parse_args(argv)
    unknown = set(opts.models.split(",")) - set(MODELS)
    if unknown:
        args.error(f"unknown model(s) {sorted(unknown)}; choose from {','.join(MODELS)}")
    return opts


def main(argv: list[str]) -> None:
    opts = parse(argv)
    set_precision(opts.precision)
    if opts.fresh_child:
        measure_fresh(opts.fresh_child, opts.batch, opts.steps)
        return
    load = os.getloadavg()  # before this run adds its own
    steps = opts.steps or (10 if opts.quick else 200)
    plan = Plan(steps=steps, rounds=2 if opts.quick else 20, warmup=1 if opts.quick else 5,
                memory_steps=3 if opts.quick else 20, dispatch_calls=steps * 10, batch=opts.batch)
    print(f"# {machine()}", flush=True)
    warm_up()
    rows = dispatch_rows(plan)
    for name in opts.models.split(","):
        print(f"# measuring {name} ...", flush=True)
        rows += model_rows(name, plan)
    text = report(rows, plan, argv, load, opts.precision)
    print(text)
    if opts.write:
        write_readme(text)
        print(f"# wrote {README.name}")


if __name__ == "__main__":
    main(sys.argv[1:])
