"""Real-size models: onnxtrain against PyTorch eager on BERT-base, GPT-2, T5-small, ResNet-18, MobileNetV3-small.

    python benchmarks/realsize.py [--models bert-base,gpt2,...] [--batch 2] [--steps 10] [--exporter dynamo]
                                  [--mixed-precision bfloat16|float16] [--remat | --remat-attention] [--retain]
                                  [--huge-pages] [--jax]
                                  [--device cpu|gpu]
                                  [--quick] [--write]

Each model (benchmarks/realsize_models.py, random weights) is exported once by `torch.onnx.export` (`--exporter
dynamo`, PyTorch's default, or `torchscript`) into benchmarks/.realsize/ and reused by later runs. onnxtrain
trains it with `make_trainable(loss="cross_entropy", class_axis=-1, optimizer="sgd", trainable=<the module's
parameter names>)`, PyTorch with `cross_entropy`, `backward` and `torch.optim.SGD` on the same module. The default
set leaves out the cases marked untimed (`gpt2-lm`: GPT-2 trained as a language model, at every position; name it
in `--models`). The train step and inference
are timed in this process in rounds alternating between the two (and the inference of the export itself, loaded
without training, against the same PyTorch inference), each ratio also per round, lowest to highest (what
the host's noise did to it); the first train step (cold, and with a warm
persistent compilation cache) and the peak resident memory in a fresh process per peer. `--mixed-precision`
adds a train step and a peak memory row per model in that type: onnxtrain's `load(mixed_precision=...)` against
PyTorch's step under `torch.autocast(device, dtype)`. `--remat` adds onnxtrain's train step and peak memory with
`load(remat=True)` (the backward pass recomputes the forward values) against PyTorch's plain step;
`--remat-attention` the same with `load(remat="attention")` (only the attentions' scores and probabilities
recomputed). `--retain` adds
both peers' train step (timed in one process of their own) and peak memory with glibc's malloc keeping freed
memory for reuse (onnxtrain.retain_freed_memory's settings, for the whole process: both peers have them);
`--huge-pages` the same with malloc in transparent huge pages (`GLIBC_TUNABLES=glibc.malloc.hugetlb=1`, what
`onnxtrain train` starts itself with). `--jax` adds
a column for the same model written by hand in JAX + optax, where one exists (GPT-2: jax_gpt2.py, BERT-base:
jax_bert.py). `--device gpu`
runs onnxtrain on JAX's GPU and PyTorch on CUDA (float32 products in full float32 for both: PyTorch's TF32 is
turned off), and measures peak GPU memory (the allocators' peak bytes in use) instead of resident memory.
`--write` puts the table into benchmarks/README.md between the realsize markers of its device.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import numpy as np

# torch and the model definitions are imported where needed, never in an onnxtrain measurement process: its peak
# memory is onnxtrain's alone, as in a user's process that loads an .onnx file
sys.path.insert(0, str(Path(__file__).parent))
from host import MALLOC_ENV, child_result, cpu_name, memory_kib  # noqa: E402

HERE = Path(__file__).parent
EXPORTS = HERE / ".realsize"
README = HERE / "README.md"
LR = 1e-3
ROUNDS = 5  # alternating rounds of the timed calls
REMAT_FLAGS = {True: "--remat", "attention": "--remat-attention"}  # load's remat modes, as this script's flags
REMAT_ROWS = {True: "remat", "attention": "attention recomputed"}
DEVICE = {"name": "cpu"}  # --device, set by main before any peer is built: "cpu" or "gpu"
# Timed rows are a long run's steady state: onnxtrain plans a program's temporaries in heaps from its hundredth
# call on the CPU (onnxtrain/program.py), here from its second, so the first call is still the first step
# measured. Memory rows are short runs (a few steps, the engine's own default), but for the two "long run" ones,
# whose processes switch at their second step (one cold, one with the store of programs filled): their peak
# includes that second compile and the plan's own memory.
SPLIT_AFTER_CALLS = 2


def switch_to_heaps_early() -> None:
    """This process's onnxtrain programs plan their temporaries in heaps from their second call (see above)."""
    import onnxtrain.program

    onnxtrain.program.SPLIT_AFTER_CALLS = SPLIT_AFTER_CALLS


def exported(name: str, exporter: str, batch: int) -> Path:
    """The folder holding case `name`'s ONNX export (made once per torch version, exporter and batch; the dynamo
    exporter writes large weights to a .data file beside the model), the module's parameter names
    (parameters.json) and the feeds of the batch (feeds-<batch>.npz): what an onnxtrain measurement reads, without
    torch."""
    import torch
    from realsize_models import CASES, build

    # the exports have static shapes: one per batch size
    folder = EXPORTS / f"{name}-{exporter}-torch{torch.__version__}-batch{batch}"
    if not folder.exists():
        case, module = CASES[name], build(name)
        example = case.inputs(batch, np.random.default_rng(0))
        EXPORTS.mkdir(exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=EXPORTS))
        start = time.perf_counter()
        torch.onnx.export(module, tuple(torch.from_numpy(v) for v in example.values()), str(staging / "model.onnx"),
                          input_names=list(example), dynamo=exporter == "dynamo")
        staging.rename(folder)  # a killed export leaves only a hidden staging folder, never a half model
        print(f"# exported {name} with the {exporter} exporter in {time.perf_counter() - start:.0f} s", flush=True)
    if not (folder / "parameters.json").exists():
        (folder / "parameters.json").write_text(json.dumps([n for n, _ in build(name).named_parameters()]))
    if not (folder / f"feeds-{batch}.npz").exists():
        inputs, labels = feeds(name, batch)
        np.savez(folder / f"feeds-{batch}.npz", **inputs, target=labels)
    return folder


def feeds(name: str, batch: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
    from realsize_models import CASES

    case = CASES[name]
    rng = np.random.default_rng(1)
    inputs = case.inputs(batch, rng)
    return inputs, case.labels(batch, rng)


def onnxtrain_peer(folder: Path, batch: int, mixed: str | None = None,
                   remat: bool | str = False) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """(train step, infer) of onnxtrain on the export in `folder` (see `exported`), its products in `mixed`
    precision if given, recomputing in the backward pass with `remat`; trains exactly the module's named
    parameters where the export kept their names (the dynamo exporter does), else make_trainable's default set.
    The trainable model is written once beside the export and loaded from that file, as a training script loads
    what `onnxtrain make-trainable` wrote (the engine then keeps the initial state in the file, not in memory)."""
    import jax
    import onnx

    import onnxtrain
    from onnxtrain.executables import source_digest

    # made once per version of onnxtrain (what make_trainable writes may change), as `onnxtrain make-trainable`
    # writes it; the training script loads the file
    path = folder / f"trainable-{source_digest().hex()[:12]}.onnx"
    if not path.exists():
        for stale in folder.glob("trainable*.onnx"):  # another version's (each as large as the model)
            stale.unlink()
        model = onnx.load(folder / "model.onnx")
        initializers = {t.name for t in model.graph.initializer}
        parameters = json.loads((folder / "parameters.json").read_text())
        trainable = [n for n in parameters if n in initializers]
        if len(trainable) < len(parameters):
            print(f"# {folder.name}: {len(parameters) - len(trainable)} of {len(parameters)} parameters renamed by "
                  f"the exporter; onnxtrain trains make_trainable's default set", flush=True)
            trainable = None
        staging = folder / f".trainable.{os.getpid()}.onnx"
        onnx.save(onnxtrain.make_trainable(model, loss="cross_entropy", class_axis=-1, optimizer="sgd",
                                           learning_rate=LR, trainable=trainable), staging)
        staging.replace(path)
        del model
    engine = onnxtrain.load(path, mixed_precision=mixed, remat=remat)
    if jax.default_backend() != DEVICE["name"]:
        raise RuntimeError(f"--device {DEVICE['name']}, but JAX's default backend is {jax.default_backend()}")
    with np.load(folder / f"feeds-{batch}.npz") as data, jax.enable_x64(True):  # int64 ids and labels stay int64
        device = {k: jax.device_put(data[k]) for k in data.files}
    infer_feeds = {k: v for k, v in device.items() if k != "target"}
    return (lambda: jax.block_until_ready(engine.train_step(device)),
            lambda: jax.block_until_ready(engine.infer(infer_feeds)))


def served_peer(folder: Path, batch: int) -> Callable[[], Any]:
    """onnxtrain's `infer` of the export as it is (no training, so its weights are constants), as a user serving
    the model loads it."""
    import jax

    import onnxtrain

    engine = onnxtrain.load(folder / "model.onnx")
    with np.load(folder / f"feeds-{batch}.npz") as data, jax.enable_x64(True):
        feeds = {k: jax.device_put(data[k]) for k in data.files if k != "target"}
    return lambda: jax.block_until_ready(engine.infer(feeds))


def torch_peer(name: str, batch: int, mixed: str | None = None) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """(train step, infer) of PyTorch eager, returning once computed (CUDA runs asynchronously to Python: each call
    synchronises, as onnxtrain's blocks on its result); with `mixed`, the forward and loss under torch.autocast
    (the products in that type, float32 parameters and optimizer)."""
    import torch
    from realsize_models import build, cross_entropy

    device = torch.device("cuda" if DEVICE["name"] == "gpu" else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # ONNX's float32, as onnxtrain
    module = build(name).to(device)
    autocast = torch.autocast(device.type, dtype=getattr(torch, mixed)) if mixed else contextlib.nullcontext()
    optimizer = torch.optim.SGD(module.parameters(), lr=LR)
    inputs, labels = feeds(name, batch)
    args, target = [torch.from_numpy(v).to(device) for v in inputs.values()], torch.from_numpy(labels).to(device)

    def done(value: torch.Tensor) -> torch.Tensor:
        if device.type == "cuda":
            torch.cuda.synchronize()
        return value

    def train() -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        with autocast:
            loss = cross_entropy(module(*args), target)
        loss.backward()
        optimizer.step()
        return done(loss)

    def infer() -> torch.Tensor:
        with torch.no_grad():
            return done(module(*args))

    return train, infer


def jax_peer(name: str, folder: Path, batch: int) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """(train step, infer) of the hand-written JAX model of case `name` (JAX_PEERS) on the feeds saved beside the
    export."""
    module = importlib.import_module(JAX_PEERS[name])
    with np.load(folder / f"feeds-{batch}.npz") as data:
        return module.peer(data["input_ids"], data["target"], LR)


JAX_PEERS = {"gpt2": "jax_gpt2", "bert-base": "jax_bert"}  # the cases written by hand in JAX (--jax): modules
@dataclass(frozen=True)
class Row:
    model: str
    measurement: str
    ours: float
    theirs: float  # PyTorch's
    spread: tuple[float, float] | None = None  # a timing's ours ÷ theirs, lowest and highest over the rounds
    jax: float | None = None  # the hand-written JAX peer's, where it computes the same thing


def peer(name: str, which: str, folder: Path, batch: int, mixed: str | None = None,
         remat: bool | str = False) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """`which`: "onnxtrain", "torch" or "jax". `remat` is onnxtrain's: PyTorch's step stays the plain one it is
    compared with."""
    if which == "jax":
        return jax_peer(name, folder, batch)
    return onnxtrain_peer(folder, batch, mixed, remat) if which == "onnxtrain" else torch_peer(name, batch, mixed)


def device_peak(which: str) -> int:
    """Peak bytes in use on the GPU of this process: the allocator's count (JAX's or PyTorch's), which neither
    JAX's preallocated pool nor PyTorch's cached blocks inflate."""
    if which == "onnxtrain":
        import jax

        return jax.local_devices()[0].memory_stats()["peak_bytes_in_use"]
    import torch

    return torch.cuda.max_memory_allocated()


def timing_child(name: str, folder: Path, batch: int, steps: int) -> None:
    """Prints the train steps of both peers timed in alternating rounds in this process (started with
    onnxtrain.host_memory's settings: they are the whole process's, so both peers run with them)."""
    calls = {"ours": peer(name, "onnxtrain", folder, batch)[0], "theirs": peer(name, "torch", folder, batch)[0]}
    for call in calls.values():
        call()
    timed = Timings(calls, steps, min(ROUNDS, steps))
    print(json.dumps({"ours": timed.ms("ours"), "theirs": timed.ms("theirs"),
                      "spread": timed.spread("ours", "theirs")}))


def child(spec: str, folder: Path, batch: int, steps: int, mixed: str | None, remat: bool | str) -> None:
    """Prints {"first": s, "peak": bytes, "settled": bytes}: one peer's first train step (trace, compile and run
    for onnxtrain; the first eager step for PyTorch), its process's peak RSS (on a GPU: the peak of GPU memory in
    use) over building the model and `steps` train steps, and the RSS after them."""
    name, which = spec.split(":")
    if which == "timing":
        return timing_child(name, folder, batch, steps)
    train, _ = peer(name, which, folder, batch, mixed, remat)
    start = time.perf_counter()
    train()
    first = time.perf_counter() - start
    for _ in range(steps):
        train()
    if which != "torch" and "torch" in sys.modules:
        raise RuntimeError(f"the {which} measurement imported torch: its memory would count torch's")
    peak = device_peak(which) if DEVICE["name"] == "gpu" else memory_kib("VmHWM") * 1024
    print(json.dumps({"first": first, "peak": peak, "settled": memory_kib("VmRSS") * 1024}))


def process_settings() -> dict[str, tuple[str, dict[str, str]]]:
    """This script's flag -> (its rows' label, the environment both peers' processes start with)."""
    from onnxtrain.host_memory import ENVIRONMENT, HUGE_PAGES

    return {"retain": ("freed memory retained", ENVIRONMENT),
            "huge_pages": ("malloc in huge pages", {"GLIBC_TUNABLES": f"{HUGE_PAGES}=1"})}


def fresh(name: str, which: str, folder: Path, batch: int, steps: int, cache: str | None = None,
          mixed: str | None = None, remat: bool | str = False,
          environment: dict[str, str] | None = None, long_run: bool = False) -> dict[str, Any]:
    """`child` in a new process; `cache` is ONNXTRAIN_CACHE_DIR: None, an empty folder of the child's own (a first
    run with the default settings: the caches written, nothing read); "" disables the persistent cache and the
    store; `environment`: the process's allocator settings (one of `process_settings`) instead of MALLOC_ENV's;
    `long_run`: onnxtrain's programs switch to the plan in heaps at their second call (SPLIT_AFTER_CALLS)."""
    if cache is None:
        with tempfile.TemporaryDirectory() as empty:
            return fresh(name, which, folder, batch, steps, empty, mixed, remat, environment, long_run)
    command = [sys.executable, __file__, "--child", f"{name}:{which}", "--kit", str(folder), "--batch", str(batch),
               "--steps", str(steps), "--device", DEVICE["name"]] + (["--mixed-precision", mixed] if mixed else [])
    command += ([REMAT_FLAGS[remat]] if remat else []) + (["--long-run"] if long_run else [])
    environment = {**(MALLOC_ENV if environment is None else environment), "ONNXTRAIN_CACHE_DIR": cache}
    return child_result(command, f"fresh child {name}:{which}", environment)


def warm_child(name: str, folder: Path, batch: int, steps: int, mixed: str | None = None,
               remat: bool | str = False) -> dict[str, Any]:
    """onnxtrain's `child` in a process that finds its programs compiled: a first process compiles them into a
    cache of their own. The peak of the step itself, without the compiler's: on a GPU a cold process's peak holds
    the autotuner's trial buffers too (ResNet-18's float32 step: 2561 MB cold, 775 MB warm, on an H100)."""
    with tempfile.TemporaryDirectory() as cache:
        fresh(name, "onnxtrain", folder, batch, steps, cache, mixed, remat)
        return fresh(name, "onnxtrain", folder, batch, steps, cache, mixed, remat)


class Timings:
    """Seconds per call of each callable, timed in rounds alternating between them (drift hits all alike)."""

    def __init__(self, calls: dict[str, Callable[[], Any]], steps: int, rounds: int):
        self.rounds: dict[str, list[list[float]]] = {k: [] for k in calls}
        for _ in range(rounds):
            for key, call in calls.items():
                time.sleep(0.05)  # PyTorch's OpenMP workers spin after their last call and would slow the next peer
                call()  # untimed: the first call after another peer's turn runs on cold caches
                times = []
                for _ in range(max(1, steps // rounds)):
                    start = time.perf_counter()
                    call()
                    times.append(time.perf_counter() - start)
                self.rounds[key].append(times)

    def ms(self, key: str) -> float:
        """The median over every round."""
        return float(np.median(sum(self.rounds[key], []))) * 1e3

    def spread(self, ours: str, theirs: str) -> tuple[float, float]:
        """ours ÷ theirs per round (each round's medians), lowest and highest: what the host's noise did."""
        ratios = [np.median(a) / np.median(b) for a, b in zip(self.rounds[ours], self.rounds[theirs])]
        return float(min(ratios)), float(max(ratios))

    def row(self, model: str, measurement: str, ours: str, theirs: str) -> Row:
        return Row(model, measurement, self.ms(ours), self.ms(theirs), self.spread(ours, theirs))


def model_rows(name: str, exporter: str, batch: int, steps: int, rounds: int, mixed: str | None = None,
               remat: bool | str = False, with_jax: bool = False, settings: tuple[str, ...] = ()) -> list[Row]:
    """`with_jax`: also the hand-written JAX peer, where `name` has one (JAX_PEERS), in a column of its own;
    `settings`: keys of `process_settings`, each adding both peers' train step and peak memory under it."""
    folder = exported(name, exporter, batch)
    train_ot, infer_ot = onnxtrain_peer(folder, batch)
    train_pt, infer_pt = torch_peer(name, batch)
    calls = {"train onnxtrain": train_ot, "train torch": train_pt, "infer onnxtrain": infer_ot, "infer torch": infer_pt,
             "served onnxtrain": served_peer(folder, batch)}
    if mixed:  # timed in the same alternating rounds as the float32 peers
        calls["mixed onnxtrain"] = onnxtrain_peer(folder, batch, mixed)[0]
        calls["mixed torch"] = torch_peer(name, batch, mixed)[0]
    if remat:
        calls["remat onnxtrain"] = onnxtrain_peer(folder, batch, remat=remat)[0]
    with_jax = with_jax and name in JAX_PEERS
    if with_jax:
        calls["train jax"], calls["infer jax"] = jax_peer(name, folder, batch)
    for call in calls.values():
        call()  # compiles onnxtrain's programs; PyTorch's first eager calls
    timed = Timings(calls, steps, rounds)
    del calls, train_ot, infer_ot, train_pt, infer_pt
    memory_steps = 3
    with tempfile.TemporaryDirectory() as cache:
        cold = fresh(name, "onnxtrain", folder, batch, memory_steps, cache)  # and fills the caches
        warm = fresh(name, "onnxtrain", folder, batch, memory_steps, cache)
        warm_long_run = fresh(name, "onnxtrain", folder, batch, memory_steps, cache, long_run=True)
    long_run = fresh(name, "onnxtrain", folder, batch, memory_steps, long_run=True)
    torch_child = fresh(name, "torch", folder, batch, memory_steps, "")
    jax_child = fresh(name, "jax", folder, batch, memory_steps, "") if with_jax else None
    mb = 2**20
    memory = "peak GPU memory" if DEVICE["name"] == "gpu" else "peak RSS"
    rows = [
        timed.row(name, "train step (ms)", "train onnxtrain", "train torch"),
        timed.row(name, "infer (ms)", "infer onnxtrain", "infer torch"),
        timed.row(name, "infer, inference model (ms)", "served onnxtrain", "infer torch"),
        Row(name, "first train step, cold (s)", cold["first"], torch_child["first"]),
        Row(name, "first train step, warm cache (s)", warm["first"], torch_child["first"]),
        Row(name, f"{memory} (MB)", cold["peak"] / mb, torch_child["peak"] / mb),
        # the cold peak includes XLA's compiler; from a warm cache a process loads the executable instead
        Row(name, f"{memory}, warm cache (MB)", warm["peak"] / mb, torch_child["peak"] / mb),
        Row(name, f"{memory}, long run (MB)", long_run["peak"] / mb, torch_child["peak"] / mb),
        # the one-block plan read from the store, let go before the plan in heaps compiles (program.py)
        Row(name, f"{memory}, long run, warm cache (MB)", warm_long_run["peak"] / mb, torch_child["peak"] / mb),
    ]
    if jax_child:  # the JAX peer's column where it computes the same thing
        rows = [replace(row, jax=jax) for row, jax in zip(rows, [
            timed.ms("train jax"), timed.ms("infer jax"), timed.ms("infer jax"), jax_child["first"],
            None, jax_child["peak"] / mb, None, None, None])]
    if mixed:
        ours = warm_child(name, folder, batch, memory_steps, mixed=mixed)
        theirs = fresh(name, "torch", folder, batch, memory_steps, "", mixed)
        rows += [
            timed.row(name, f"train step, {mixed} (ms)", "mixed onnxtrain", "mixed torch"),
            Row(name, f"{memory}, {mixed}, warm cache (MB)", ours["peak"] / mb, theirs["peak"] / mb),
        ]
    if remat:
        ours = warm_child(name, folder, batch, memory_steps, remat=remat)
        rows += [
            timed.row(name, f"train step, {REMAT_ROWS[remat]} (ms)", "remat onnxtrain", "train torch"),
            Row(name, f"{memory}, {REMAT_ROWS[remat]}, warm cache (MB)", ours["peak"] / mb,
                torch_child["peak"] / mb),
        ]
    for setting in settings:
        label, environment = process_settings()[setting]
        timed_child = fresh(name, "timing", folder, batch, steps, "", environment=environment, long_run=True)
        ours = fresh(name, "onnxtrain", folder, batch, memory_steps, environment=environment)
        theirs = fresh(name, "torch", folder, batch, memory_steps, "", environment=environment)
        rows += [
            Row(name, f"train step, {label} (ms)", timed_child["ours"], timed_child["theirs"],
                tuple(timed_child["spread"])),
            Row(name, f"{memory}, {label} (MB)", ours["peak"] / mb, theirs["peak"] / mb),
        ]
    return rows


def table(rows: list[Row]) -> str:
    """Markdown; the hand-written JAX column only where a row has one."""
    jax = any(row.jax is not None for row in rows)
    lines = ["| model | measurement | onnxtrain | PyTorch | ÷ PyTorch | ÷ PyTorch per round |"
             + (" JAX | ÷ JAX |" if jax else ""),
             "|---|---|---:|---:|---:|---:|" + ("---:|---:|" if jax else "")]
    for row in rows:
        spread = f"{row.spread[0]:.2f}-{row.spread[1]:.2f}" if row.spread else "–"
        line = (f"| {row.model} | {row.measurement} | {row.ours:.4g} | {row.theirs:.4g} | "
                f"{row.ours / row.theirs:.2f} | {spread} |")
        if jax:
            line += f" {row.jax:.4g} | {row.ours / row.jax:.2f} |" if row.jax is not None else " – | – |"
        lines.append(line)
    return "\n".join(lines)


def write_readme(text: str) -> None:
    marker = "realsize-gpu" if DEVICE["name"] == "gpu" else "realsize"  # each device's table has markers of its own
    begin, end = f"<!-- {marker}:begin -->", f"<!-- {marker}:end -->"
    current = README.read_text()
    block = f"{begin}\n{text}\n{end}"
    if begin in current:
        head, rest = current.split(begin, 1)
        README.write_text(head + block + rest.split(end, 1)[1])
    else:
        README.write_text(current.rstrip() + "\n\n" + block + "\n")


def main(argv: list[str]) -> None:
    args = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    args.add_argument("--models", help="a comma-separated subset of benchmarks/realsize_models.py's cases "
                      "(default: all)")
    args.add_argument("--batch", type=int, default=2)
    args.add_argument("--steps", type=int, help="timed calls per peer and measurement (default 10, --quick 2)")
    args.add_argument("--exporter", choices=("dynamo", "torchscript"), default="dynamo")
    args.add_argument("--mixed-precision", choices=("bfloat16", "float16"),
                      help="also a train step and a peak memory row per model in this type (torch: autocast)")
    recompute = args.add_mutually_exclusive_group()
    recompute.add_argument("--remat", action="store_true",
                           help="also onnxtrain's train step and peak memory with load(remat=True), against "
                           "PyTorch's plain step")
    recompute.add_argument("--remat-attention", dest="remat", action="store_const", const="attention",
                           help="the same with load(remat='attention')")
    args.add_argument("--retain", action="store_true",
                      help="also the train step and peak memory of both peers in processes started with "
                      "onnxtrain.retain_freed_memory's settings (freed host memory kept for reuse)")
    args.add_argument("--huge-pages", action="store_true",
                      help="also the train step and peak memory of both peers in processes started with malloc in "
                      "transparent huge pages (glibc.malloc.hugetlb=1, as `onnxtrain train` runs)")
    args.add_argument("--jax", action="store_true",
                      help="also the hand-written JAX peer where a model has one (gpt2, bert-base: benchmarks/jax_*.py)")
    args.add_argument("--device", choices=("cpu", "gpu"), default="cpu",
                      help="where both peers compute: JAX's CPU and PyTorch's (default), or JAX's GPU and CUDA")
    args.add_argument("--quick", action="store_true", help="a smoke run: few steps, numbers not meaningful")
    args.add_argument("--write", action="store_true", help="update the realsize table in benchmarks/README.md")
    args.add_argument("--child", help=argparse.SUPPRESS)  # MODEL:PEER, run by `fresh`
    args.add_argument("--kit", type=Path, help=argparse.SUPPRESS)  # the child's export folder
    args.add_argument("--long-run", action="store_true", help=argparse.SUPPRESS)  # the child's: see fresh
    opts = args.parse_args(argv)
    DEVICE["name"] = opts.device
    if opts.device == "cpu":
        os.environ["JAX_PLATFORMS"] = "cpu"  # before JAX is imported, here and in the children
    if opts.child:
        if opts.long_run:
            switch_to_heaps_early()
        child(opts.child, opts.kit, opts.batch, opts.steps, opts.mixed_precision, opts.remat)
        return
    import torch
    from realsize_models import CASES

    switch_to_heaps_early()  # the timed peers of this process
    opts.models = opts.models or ",".join(name for name, case in CASES.items() if case.timed)
    unknown = set(opts.models.split(",")) - set(CASES)
    if unknown:
        args.error(f"unknown model(s) {sorted(unknown)}; choose from {','.join(CASES)}")
    load = os.getloadavg()
    steps = opts.steps or (2 if opts.quick else 10)
    rounds = 1 if opts.quick else ROUNDS
    rows = []
    for name in opts.models.split(","):
        print(f"# measuring {name} ...", flush=True)
        measured = model_rows(name, opts.exporter, opts.batch, steps, rounds, opts.mixed_precision, opts.remat,
                              opts.jax, tuple(k for k in process_settings() if getattr(opts, k)))
        print(table(measured), flush=True)  # each model's rows as they come: a run cut short keeps them
        rows += measured
    machine = f"{cpu_name()}, {os.cpu_count()} cores"
    if opts.device == "gpu":
        import jax

        machine = f"{torch.cuda.get_device_name()} ({machine}), jax {jax.__version__}"
    text = (f"Measured {time.strftime('%Y-%m-%d')} on {machine}, torch {torch.__version__}, "
            f"{opts.exporter} export, batch {opts.batch}, median of {steps} calls per peer in {rounds} alternating "
            f"rounds; load average at start {', '.join(f'{v:.2f}' for v in load)}.\n\n"
            f"Command: `python benchmarks/realsize.py{''.join(' ' + a for a in argv)}`\n\n{table(rows)}")
    print(text)
    if opts.write:
        write_readme(text)


if __name__ == "__main__":
    main(sys.argv[1:])
