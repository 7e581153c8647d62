"""The `onnxtrain` command: info, infer, train. A user mistake is one clear line and exit status 2; a run that
fails (diverges, a step fails on the device, or its last checkpoint cannot be written: the disk full) is one clear
line and exit status 1. Never a traceback."""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import os
import signal
import sys
import threading
import warnings
import zipfile
from pathlib import Path
from typing import Iterator

import numpy as np

from .authoring import make_trainable
from .dtypes import type_name
from .engine import load
from .errors import CheckpointError, DivergenceError, ExportError, OnnxTrainError, StepError
from .export import check_export_target, save_atomic
from .host_memory import HUGE_PAGES, retain_freed_memory, with_huge_pages
from .lower.autocast import COMPUTE_DTYPES
from .loop import History, array_batches, check_finite, fit
from .model import read_model
from .optimizers import ACCUMULATE_BY

# what reading a user's .npy/.npz can raise: missing or unreadable, not NumPy's format, a damaged zip
UNREADABLE = (OSError, ValueError, EOFError, zipfile.BadZipFile)


def read_npz(option: str, path: str) -> dict[str, np.ndarray]:
    """The named arrays of a .npz file; anything else (a .npy, a model, a damaged archive) is a one-line error."""
    try:
        data = np.load(path, allow_pickle=False)
    except UNREADABLE as exc:
        # what np.load says of a file that is neither .npy nor .npz is about pickles, which it does not load
        reason = "not a .npz archive of named arrays" if "pickle" in str(exc) else str(exc)
        raise OnnxTrainError(f"{option}: cannot read {path!r} ({reason})") from exc
    if not isinstance(data, np.lib.npyio.NpzFile):
        raise OnnxTrainError(f"{option}: {path!r} is a single array (.npy); give a .npz whose arrays are named after "
                             f"the graph inputs (np.savez(path, X=..., target=...))")
    try:
        with data:
            return {name: data[name] for name in data.files}
    except UNREADABLE as exc:
        raise OnnxTrainError(f"{option}: cannot read {path!r} ({exc})") from exc


def cmd_info(args: argparse.Namespace) -> None:
    engine = load(args.model)
    print(f"model: {args.model}")
    opsets = ", ".join(f"{o.domain or 'ai.onnx'}={o.version}" for o in engine.model.opset_import)
    print(f"opsets: {opsets}")
    for kind, values in (("input", engine.graph.inputs), ("output", engine.graph.outputs)):
        for v in values:
            print(f"{kind}: {v.name} {describe(v)}")
    for name, value in engine.state.items():
        owner = engine.state_owner[name]
        where = "graph" if owner is None else f"training_info[{owner}]"
        print(f"state: {name} {np.dtype(value.dtype)}{list(value.shape)} ({where})")
    for algorithm in engine.algorithms:
        # typed, as the graph's inputs above: what --data must hold for a step (make-trainable's target)
        feeds = ", ".join(f"{i.name} {describe(i)}" for i in algorithm.graph.inputs)
        print(f"algorithm {algorithm.index}: feeds {feeds}; updates {sorted(algorithm.update_binding)}")
    ops = sorted({(n.domain or "ai.onnx", n.op_type) for n in engine.graph.nodes})
    print("ops: " + ", ".join(f"{d}::{o}" for d, o in ops))
    print("every op is supported")


def describe(value) -> str:
    if value.elem_type is None:
        return "(non-tensor)"
    shape = "?" if value.shape is None else "[" + ", ".join(str(d) for d in value.shape) + "]"
    return f"{type_name(value.elem_type)}{shape}"


def parse_inputs(items: list[str]) -> dict[str, np.ndarray]:
    feeds = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep:
            raise OnnxTrainError(f"--input {item!r}: expected NAME=FILE.npy")
        if name in feeds:
            raise OnnxTrainError(f"--input {name} is given twice")
        try:
            feeds[name] = np.load(path, allow_pickle=False)
        except UNREADABLE as exc:
            raise OnnxTrainError(f"--input {name}: cannot read {path!r} ({exc})") from exc
        if isinstance(feeds[name], np.lib.npyio.NpzFile):
            feeds[name].close()
            raise OnnxTrainError(f"--input {name}: {path!r} is a .npz archive; give a .npy file of one array")
    return feeds


def devices(count: int | None) -> list | None:
    """The first `count` of JAX's devices for --devices (None: JAX's default device)."""
    import jax

    if count is None:
        return None
    available = jax.devices()
    if not 1 <= count <= len(available):
        raise OnnxTrainError(
            f"--devices {count}: {len(available)} {available[0].platform} device(s) available "
            f"(on CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N makes N)"
        )
    return available[:count]


def cmd_infer(args: argparse.Namespace) -> None:
    if args.output_dir and not Path(args.output_dir).is_dir():
        raise OnnxTrainError(f"--output-dir {args.output_dir!r} is not an existing folder")
    engine = load(args.model, devices=devices(args.devices), mixed_precision=args.mixed_precision)
    outputs = engine.infer(parse_inputs(args.input))
    for name, value in outputs.items():
        array = np.asarray(value)
        if args.output_dir:
            np.save(Path(args.output_dir) / f"{name}.npy", array)
        print(f"{name}: {array.dtype}{list(array.shape)}\n{array}")


def cmd_train(args: argparse.Namespace) -> None:
    if args.output:
        check_export_target(args.output)
    if args.shard_state and (args.devices or 1) < 2:
        raise OnnxTrainError("--shard-state splits the state over several devices: give --devices N with N > 1")
    if args.retain_freed_memory and not retain_freed_memory():
        print("--retain-freed-memory: this C library does not take the setting (glibc only); training without it")
    if f"{HUGE_PAGES}=1" in os.environ.get("GLIBC_TUNABLES", ""):
        print(f"host memory: malloc in transparent huge pages ({HUGE_PAGES}=1)")
    if args.resume and not args.output:
        raise OnnxTrainError("--resume goes on from the model that -o writes: give -o PATH")
    resume = args.resume and Path(args.output).exists()
    engine = load(args.output if resume else args.model, seed=args.seed, devices=devices(args.devices),
                  shard_state=args.shard_state, mixed_precision=args.mixed_precision, loss_scale=args.loss_scale,
                  remat=args.remat)
    if engine.batch_sharding is not None:
        split = any(not v.sharding.is_fully_replicated for v in engine.state.values())
        print(f"data parallel over {args.devices} devices; state {'split' if split else 'replicated'}")
    if not args.output:
        print("no -o PATH: the trained model is not written")
    arrays = read_npz("--data", args.data)
    # -o's exported model holds the state, the optimizer's included, and the step count: the run goes on from
    # there, with the batches the uninterrupted run took next (the same --data, --batch-size and --seed)
    done = engine.step_count if resume else 0
    if resume:
        print(f"resuming from {args.output} at step {done} of {args.steps}")
    elif not args.no_init:
        engine.init()
    # (fit refuses a negative --steps: only a resumed run past it takes none)
    remaining = max(0, args.steps - done) if resume else args.steps
    history = History()  # passed in: the checkpoints written are known when fit raises
    try:
        with terminated_as_interrupted():
            fit(engine, array_batches(arrays, args.batch_size, seed=args.seed, start=done), remaining,
                algorithm=args.algorithm, loss=args.loss, log_every=max(1, args.steps // 20),
                checkpoint=args.output, checkpoint_every=args.checkpoint_every, on_log=print_loss, history=history)
    except DivergenceError as exc:  # its advice is the API's (engine.load_state): say the command line's too
        keep = (f"the same command with --resume goes on from {args.output} (the last checkpoint before it, "
                "where one was written)" if args.output
                else "-o PATH keeps checkpoints a run with --resume goes on from")
        raise DivergenceError(f"{exc}; on the command line: {keep}, and make-trainable's --lr sets a lower "
                              "rate") from exc
    except CheckpointError as exc:  # the last checkpoint (earlier ones were warned of, and training went on)
        raise checkpoint_lost(exc.reason, engine.step_count, args.output, history, done if resume else None) from exc
    except KeyboardInterrupt:
        if args.output and engine.step_count > done:  # the steps taken are kept, as at a checkpoint (finite)
            check_finite(engine, engine.step_count - done - 1, {}, state=True)
            try:
                engine.export(args.output)
            except ExportError as exc:
                raise checkpoint_lost(str(exc), engine.step_count, args.output, history,
                                      done if resume else None) from exc
            # a count, not a step number: the logs number steps from 0, so the last one taken is step_count - 1
            print(f"interrupted after {engine.step_count} train steps: wrote {args.output} (--resume goes on)")
        else:  # say so, where a user would look for the file
            print(f"interrupted after {engine.step_count} train steps: "
                  + ("none taken by this run, nothing written" if args.output else "nothing written (no -o)"))
        raise
    if history.losses:
        print(f"loss {history.losses[0]:.6f} -> {history.losses[-1]:.6f} over {remaining} steps")
    if resume and not remaining:  # -o holds this state already: rewriting it could only fail (a full disk)
        print(f"{args.output} holds {done} train steps already (--steps {args.steps}): nothing to train")
    elif args.output:
        if not remaining:  # fit wrote it at each checkpoint and at the end: here, nothing ran (--steps 0)
            engine.export(args.output)
        print(f"wrote {args.output}")


def checkpoint_lost(reason: str, step_count: int, output: str, history: History, resumed: int | None,
                    ) -> CheckpointError:
    """The error of a `train -o` whose write of the model after `step_count` steps failed (`reason`: the path and
    the system's reason): which checkpoint -o still holds (this run's last, or `resumed`'s step count where it
    wrote none) and how to go on. Exit status 1, a run's failure: the command line was right."""
    written = history.checkpoints[-1] if history.checkpoints else resumed
    if written is None:
        kept, then = f"no checkpoint of this run is in {output!r}", "run the command again"
    else:
        kept = f"{output!r} still holds the checkpoint after {written} train steps (the steps since are lost)"
        then = "the same command with --resume goes on from it"
    return CheckpointError(f"the model after {step_count} train steps was not written: {reason}; {kept}: free "
                           f"space there (or fix the cause), then {then}", written, reason)


@contextlib.contextmanager
def terminated_as_interrupted() -> Iterator[None]:
    """Within the block, SIGTERM (`kill`, a scheduler's preemption, `docker stop`) ends the run as Ctrl-C does, the
    steps taken written to -o: it had ended the process at once, the steps since the last checkpoint lost. It is
    passed on as SIGINT, whose KeyboardInterrupt the engine holds back while a step's new state is in flight (an
    exception raised there would lose the state). Only where SIGTERM is at its default and SIGINT has Python's
    handler (a background job ignores SIGINT: SIGTERM must still end it), in the main thread."""
    if (threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL
            or not callable(signal.getsignal(signal.SIGINT))):
        yield
        return
    signal.signal(signal.SIGTERM, lambda signum, frame: signal.raise_signal(signal.SIGINT))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def print_loss(step: int, loss: float) -> None:
    """A logged step's line as fit logs it (numbered as the engine counts), printed at once, through the progress
    bar (which it would otherwise break) and flushed, so a log file or pipe has it then, not when the run ends."""
    from tqdm.auto import tqdm

    tqdm.write(f"step {step:>6}  loss {loss:.6f}")
    sys.stdout.flush()


def cmd_make_trainable(args: argparse.Namespace) -> None:
    model, _ = read_model(args.model)
    given = (("alpha", args.alpha), ("beta", args.beta), ("epsilon", args.epsilon))
    options = {k: v for k, v in given if v is not None}
    trainable = make_trainable(model, loss=args.loss, optimizer=args.optimizer, learning_rate=args.lr,
                               trainable=args.trainable, prediction=args.prediction, ignore_index=args.ignore_index,
                               class_axis=args.class_axis, reinitialize=args.reinitialize,
                               train_mode=args.train_mode, weight_decay=args.weight_decay, no_decay=args.no_decay,
                               clip_grad_norm=args.clip_grad_norm, accumulate=args.accumulate,
                               accumulate_by=args.accumulate_by,
                               label_smoothing=args.label_smoothing, **options)
    save_atomic(trainable, Path(args.output))
    print(f"wrote {args.output}: loss {args.loss}, optimizer {args.optimizer}, learning rate {args.lr}")


def cmd_export(args: argparse.Namespace) -> None:
    engine = load(args.model)
    if args.state:
        try:
            engine.load_state(args.state)
        except UNREADABLE as exc:
            raise OnnxTrainError(f"--state: cannot read {args.state!r} ({exc})") from exc
    engine.export(args.output, external_data=args.external_data or None)
    print(f"wrote {args.output}")


DEVICES_HELP = "data parallel over the first N devices: each batch split between them"
MIXED_PRECISION_HELP = ("compute the float32 matrix products in this type with float32 accumulation; weights, "
                        "gradients and optimizer state stay float32")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="onnxtrain", description="Train and run ONNX models with JAX/XLA.")
    sub = p.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="inputs, outputs, state variables, training algorithms, ops")
    info.add_argument("model")
    info.set_defaults(run=cmd_info)
    infer = sub.add_parser("infer", help="run the inference graph")
    infer.add_argument("model")
    infer.add_argument("--input", action="append", default=[], metavar="NAME=FILE.npy",
                       help="feed graph input NAME from a .npy file (once per input)")
    infer.add_argument("--output-dir", help="also save each output as NAME.npy there")
    infer.add_argument("--devices", type=int, help=DEVICES_HELP)
    infer.add_argument("--mixed-precision", choices=sorted(COMPUTE_DTYPES), help=MIXED_PRECISION_HELP)
    infer.set_defaults(run=cmd_infer)
    train = sub.add_parser("train", help="train a model that carries TrainingInfoProto")
    train.add_argument("model")
    train.add_argument("--data", required=True, help=".npz whose arrays are named after the inputs a step feeds: "
                       "the graph's and the algorithm's (make-trainable's target; `onnxtrain info` lists them)")
    train.add_argument("--steps", type=int, default=100, help="train steps in all (default 100; with --resume, "
                       "those the resumed model took count)")
    train.add_argument("--batch-size", type=int, default=None, help="rows of --data a step takes, shuffled "
                       "each epoch, whose last partial batch is left out (default: all of them)")
    train.add_argument("--algorithm", type=int, default=0, help="the TrainingInfoProto to run (default 0)")
    train.add_argument("--loss", help="the output to report as the loss (default: first scalar output)")
    train.add_argument("--seed", type=int, default=0, help="seeds the initialization, random ops (Dropout) and "
                       "the batches' shuffling (default 0)")
    train.add_argument("--no-init", action="store_true", help="start from the model's initializers")
    train.add_argument("-o", "--output", help="write the trained model here, and every --checkpoint-every steps")
    train.add_argument("--checkpoint-every", type=int, default=1000, metavar="N",
                       help="with -o: write the model there every N steps too, so a killed run loses at most N "
                       "(default 1000); one that cannot be written (the disk full) is a warning, and the next tries "
                       "again (the last one's failure: exit status 1)")
    train.add_argument("--resume", action="store_true", help="with -o: if it exists, go on from it (state, "
                       "optimizer and step count) with the batches the uninterrupted run takes, up to --steps in all")
    train.add_argument("--devices", type=int, help=DEVICES_HELP)
    train.add_argument("--shard-state", action="store_true",
                       help="with --devices: split the weights and optimizer state over the devices")
    train.add_argument("--mixed-precision", choices=sorted(COMPUTE_DTYPES), help=MIXED_PRECISION_HELP)
    recompute = train.add_mutually_exclusive_group()
    recompute.add_argument("--remat", action="store_true", help="recompute the forward pass's values in the "
                           "backward pass instead of keeping them: less memory, about one more forward pass of compute")
    recompute.add_argument("--remat-attention", dest="remat", action="store_const", const="attention",
                           help="recompute only the attentions' scores and probabilities in the backward pass")
    train.add_argument("--retain-freed-memory", action="store_true",
                       help="keep freed host memory for reuse (glibc): no page faults for each step's temporaries "
                       "on the CPU (BERT-base: 0.2 s of kernel time a step), at a higher peak resident memory")
    train.add_argument("--loss-scale", type=float, help="with --mixed-precision float16: the static loss scale "
                       "(default 4096)")
    train.set_defaults(run=cmd_train)
    author = sub.add_parser("make-trainable", help="add a TrainingInfoProto (loss, Gradient, optimizer)")
    author.add_argument("model")
    author.add_argument("--loss", default="mse", help="mse, cross_entropy, bce_logits or output:NAME")
    author.add_argument("--optimizer", default="adam", help="sgd, momentum, nesterov, adagrad, adam or adamw")
    author.add_argument("--lr", type=float, default=1e-3, help="learning rate (default 0.001)")
    author.add_argument("--trainable", help="regular expression over the parameters' names (default: every "
                        "parameter, i.e. float initializers but the exporter's constants)")
    author.add_argument("--prediction", help="the output the loss compares with the target (default: the first)")
    author.add_argument("--class-axis", type=int, help="cross_entropy: the scores' class axis (default 1; -1 for "
                        "[batch, seq, vocab] logits)")
    author.add_argument("--ignore-index", type=int,
                        help="cross_entropy: the label to ignore (default: -100, as PyTorch)")
    author.add_argument("--label-smoothing", type=float, default=0.0, help="cross_entropy: torch's label_smoothing")
    # ONNX's names for the optimizer ops' attributes (ai.onnx.preview.training), which make_trainable takes
    author.add_argument("--alpha", type=float, help="adam, adamw: torch's betas[0] (default 0.9); momentum, "
                        "nesterov: torch's momentum (default 0.9)")
    author.add_argument("--beta", type=float, help="adam, adamw: torch's betas[1] (default 0.999); momentum, "
                        "nesterov: 1 - torch's dampening (default 1)")
    author.add_argument("--epsilon", type=float, help="adam, adamw, adagrad: torch's eps (default 1e-8; adagrad "
                        "1e-10)")
    author.add_argument("--weight-decay", type=float, help="torch.optim's weight_decay (adamw: decoupled, "
                        "default 0.01; others: L2, default 0)")
    author.add_argument("--no-decay", nargs="?", const=True, default=False, metavar="PATTERN",
                        help="exempt from weight decay: parameters whose names contain a match of PATTERN, or "
                        "without PATTERN every parameter of rank <= 1 (biases, norm weights)")
    author.add_argument("--clip-grad-norm", type=float, metavar="MAX_NORM", help="clip gradients by global norm")
    author.add_argument("--accumulate", type=int, default=1, metavar="K", help="one update per K micro-batches")
    author.add_argument("--accumulate-by", choices=ACCUMULATE_BY, default="items",
                        help="weigh each micro-batch by its loss's counted labels or elements (items: one step "
                        "on their union, as Hugging Face's Trainer) or alike (micro_batch: torch's "
                        "(loss / K).backward())")
    author.add_argument("--reinitialize", action="store_true", help="the initialization graph re-draws each "
                        "parameter as PyTorch's default initialization of the layer that reads it")
    author.add_argument("--train-mode", action="store_true", help="train as PyTorch's module.train(): "
                        "BatchNorm on batch statistics, running statistics updated, Dropout dropping")
    author.add_argument("-o", "--output", required=True, help="the training model to write")
    author.set_defaults(run=cmd_make_trainable)
    export = sub.add_parser("export", help="write the model with a state checkpoint applied")
    export.add_argument("model")
    export.add_argument("--state", help="a checkpoint: Engine.save_state's .npz, or an exported model (train -o)")
    export.add_argument("--external-data", action="store_true", help="write the weights to a .data file beside "
                        "the model (default: only past protobuf's 2 GiB)")
    export.add_argument("-o", "--output", required=True, help="the model to write")
    export.set_defaults(run=cmd_export)
    return p


def console() -> int:
    """The `onnxtrain` command. `train` restarts itself once, before any work, with malloc's huge pages on
    (host_memory.with_huge_pages: a step's temporaries fault in 2 MB at a time), since glibc reads that setting
    at process start only; GLIBC_TUNABLES naming glibc.malloc.hugetlb (=0 to refuse) is left as it is, and so is
    a run with --retain-freed-memory (no temporaries are faulted in anew to spare: one malloc policy at a time).
    A crash in native code (XLA, the C library) prints the Python stack it happened under (faulthandler); a
    warning is one line, as an error is."""
    faulthandler.enable()
    warnings.showwarning = show_warning  # the process's: main(), called in a caller's process, leaves theirs
    args = parser().parse_args()
    if args.run is cmd_train and not args.retain_freed_memory:
        environment = with_huge_pages(os.environ)
        if environment is not None:
            try:
                os.execve(sys.executable, [sys.executable, "-m", "onnxtrain.cli", *sys.argv[1:]], environment)
            except OSError:  # no interpreter to start again (an embedded one): train as the process is
                pass
    return run(args)


def main(argv: list[str] | None = None) -> int:
    return run(parser().parse_args(argv))


def show_warning(message: Warning | str, category: type[Warning], *_: object, **__: object) -> None:
    """A warning as one line for the command's user, as its errors are: Python's format added the file and line
    in onnxtrain that warned, and that line's source (`trainable = make_trainable(model, ...`). Through the
    progress bar, as a logged loss is: a checkpoint's warning in a run was printed onto the bar's line."""
    from tqdm.auto import tqdm

    tqdm.write(f"onnxtrain: warning: {category.__name__}: {message}", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    try:
        args.run(args)
    except (DivergenceError, StepError, CheckpointError) as exc:
        return fail(exc, 1)
    except KeyboardInterrupt:  # Ctrl-C: what was kept is said above, no traceback; 128 + SIGINT, as shells have it
        print("onnxtrain: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # stdout's reader stopped reading (`onnxtrain info MODEL | head`): not a user error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush of stdout stays quiet
        return 141  # 128 + SIGPIPE, as a tool that the signal ended (Python ignores it, to raise this instead)
    except (OnnxTrainError, OSError) as exc:  # OSError: a path the user gave (a folder to write in, a file)
        return fail(exc, 2)
    return 0


def fail(exc: Exception, status: int) -> int:
    print(f"onnxtrain: error: {exc}", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(console())
