"""The training loop: batches in, train steps out, loss history kept without a host sync per step."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

import numpy as np

from .authoring import LEARNING_RATE
from .dtypes import TRAINING_FLOAT_TYPES
from .engine import Engine
from .errors import CheckpointError, DivergenceError, ExportError, FeedError, OnnxTrainError
from .export import check_export_target
from .optimizers import is_integer, micro_batches_per_update


def array_batches(
    arrays: Mapping[str, np.ndarray], batch_size: int | None = None, shuffle: bool = True, seed: int = 0,
    start: int = 0,
) -> Iterator[dict[str, np.ndarray]]:
    """Endless minibatches over arrays that share their first dimension (epoch after epoch); `batch_size` None
    is the whole data, a larger one too. `start`: the number of batches to pass over, drawn but not built, so a
    run resumed at step `start` takes the batches the uninterrupted run took from there."""
    if batch_size is not None and batch_size < 1:
        raise OnnxTrainError(f"batch_size must be a positive number of rows (or None: all of them), got {batch_size}")
    if not is_integer(start) or start < 0:
        raise OnnxTrainError(f"start must be a number of batches >= 0, got {start!r}")
    if not isinstance(arrays, Mapping) or not arrays:
        raise FeedError(f"array_batches takes a mapping {{input name: array}} with at least one array, not "
                        f"{type(arrays).__name__} {arrays!r:.80}")
    # a list stays a list (its rows go to the feed as Python values, which take the input's declared type), any
    # other value is an array
    arrays = {name: a if isinstance(a, list) else np.asarray(a) for name, a in arrays.items()}
    scalars = sorted(name for name, a in arrays.items() if np.ndim(a) == 0)
    if scalars:
        raise FeedError(f"the data arrays {scalars} are scalars: each needs a first dimension of rows")
    sizes = {name: len(a) for name, a in arrays.items()}
    if len(set(sizes.values())) != 1:
        raise FeedError(f"data arrays differ in their first dimension: {sizes}")
    n = next(iter(sizes.values()))
    if n == 0:
        raise FeedError(f"the data arrays {sorted(sizes)} have no rows")
    batch_size = min(batch_size or n, n)
    rng = np.random.default_rng(seed)
    epochs, skipped = divmod(start, n // batch_size)  # full batches only: one compiled shape
    for _ in range(epochs if shuffle else 0):
        rng.permutation(n)  # the epoch's order, drawn as the run that took its batches drew it
    while True:
        order = rng.permutation(n) if shuffle else np.arange(n)
        for row in range(skipped * batch_size, n - batch_size + 1, batch_size):
            index = order[row : row + batch_size]
            yield {name: [a[i] for i in index] if isinstance(a, list) else a[index] for name, a in arrays.items()}
        skipped = 0


def loss_output(engine: Engine, algorithm: int = 0) -> str | None:
    """The algorithm graph's first scalar float output: what a training loop reports as the loss."""
    for output in engine.algorithms[algorithm].graph.outputs:
        if output.shape == () and output.elem_type in TRAINING_FLOAT_TYPES:
            return output.name
    return None


def step_outputs(engine: Engine, algorithm: int) -> list[str]:
    """What train_step(algorithm=) returns: the outputs of both graphs that update_binding does not assign."""
    chosen = engine.algorithms[algorithm]
    bound = set(chosen.update_binding.values())
    return [o.name for o in engine.graph.outputs + chosen.graph.outputs if o.name not in bound]


def check_options(engine: Engine, algorithm: int, loss: str | None, intervals: Mapping[str, int]) -> None:
    engine.check_algorithm(algorithm)
    available = step_outputs(engine, algorithm)
    if loss is not None and loss not in available:
        raise OnnxTrainError(f"loss {loss!r} is not an output of train step {algorithm}; it returns {available}")
    for name, value in intervals.items():
        if value < 1:
            raise OnnxTrainError(f"{name} must be a positive number of steps, got {value}")


def learning_rate_at(schedule: Callable[[int], Any], update: int, step: int) -> float:
    """The schedule's rate for optimizer update `update` (fed with train step `step`): a finite number >= 0, as
    make_trainable's (a negative rate climbs the loss, a NaN one poisons every weight: neither can be a
    schedule's meaning)."""
    rate = schedule(update)
    try:  # a number, or a 0-d array (optax's schedules return jax arrays)
        value = float(rate) if not isinstance(rate, (str, bytes, bool)) and np.ndim(rate) == 0 else math.nan
    except (TypeError, ValueError):
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise OnnxTrainError(f"learning_rate at update {update} (train step {step}) is {rate!r}: it must be a "
                             "finite number >= 0")
    return value


def nonfinite_state(engine: Engine) -> list[str]:
    """The float state variables holding a NaN or an infinity (checked on the device; one sync per variable)."""
    import jax
    import jax.numpy as jnp

    with jax.enable_x64(True):  # a double stays a double
        return [n for n, v in engine.state.items()
                if jnp.issubdtype(v.dtype, jnp.inexact) and not jnp.isfinite(v).all()]


def check_finite(engine: Engine, step: int, losses: Mapping[str, float], state: bool = False) -> None:
    """DivergenceError naming the step if a loss (or with `state`, a float state variable) is NaN or infinite;
    `step`: the step's index in this fit call (the message names the engine's step count too)."""
    culprits = [f"loss {name!r} is {value}" for name, value in losses.items() if not np.isfinite(value)]
    if state and not culprits:
        culprits = [f"state variable(s) {names} hold NaN or infinity" for names in [nonfinite_state(engine)] if names]
    if culprits:
        advice = divergence_advice(engine)
        # a NaN loss over a finite state is what the data alone gives: a cross-entropy over no counted label is
        # torch's 0 / 0 with a zero gradient (the step changed nothing), a label past the classes a NaN sample;
        # "lower the learning rate" sent users after a divergence that had not happened (checked on failure only)
        if any(np.isnan(value) for value in losses.values()) and not nonfinite_state(engine):
            advice = (f"every state variable is finite, so the NaN may be the batch's: a cross_entropy batch whose "
                      f"labels are all ignore_index (the mean over no label, torch's NaN, with a zero gradient; "
                      f"drop such batches) or a label outside [0, classes); otherwise {advice}")
        raise DivergenceError(
            f"training diverged: {culprits[0]} after train step {engine.step_count} (step {step} of this fit); "
            f"nothing was written: {advice}"
        )


def divergence_advice(engine: Engine) -> str:
    """What to change. Under float16 the likeliest cause is the static loss scale: a scaled gradient past
    float16's largest value (65504) is infinite, and no step is skipped as PyTorch's GradScaler would
    (lower/autocast.py), so the scale is named first (CLIP's zoo model diverges at step 1 at 2**12, trains at 2**8)."""
    advice = "lower the learning rate, or restore the last checkpoint (engine.load_state(checkpoint))"
    precision = engine.mixed_precision
    if precision is not None and precision.loss_scale != 1.0:
        return (f"lower the loss scale (load's loss_scale, CLI --loss-scale; now {precision.loss_scale:g}: a scaled "
                f"float16 gradient past 65504 is infinite), or {advice}")
    return advice


@dataclass
class History:
    """Loss at the logged steps, and whatever `evaluate` returned at the evaluated ones. A step's number is the
    engine's step count before it (0 for a run's first step), so a resumed run's numbers go on from its checkpoint;
    it counts train steps, micro-batches under make_trainable's accumulate=k, not optimizer updates.
    `checkpoints`: the step count of each checkpoint written (a failed one is not)."""

    steps: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    eval_steps: list[int] = field(default_factory=list)
    metrics: list[dict[str, float]] = field(default_factory=list)
    checkpoints: list[int] = field(default_factory=list)


def write_checkpoint(engine: Engine, path: str | Path, history: History, since: int, retry_at: int | None) -> None:
    """Export `engine` to `path` and record it in `history` (whose checkpoints from `since` on are this fit call's,
    to `path`). A write that fails (the disk full, an I/O error, the folder gone: an ExportError) is a warning while
    a later checkpoint (`retry_at`, a step count) can try again, and CheckpointError at the last one (`retry_at`
    None).

    Why training goes on: an export is atomic, so `path` keeps the last good checkpoint, and the engine keeps the
    trained state; a disk that the user frees meanwhile (or another job's temporaries that go) then costs a long
    run nothing, where stopping threw away at once every step since that checkpoint, and the hours they took.
    A failure that persists ends the run at its last checkpoint, the file holding what stopping had left."""
    try:
        engine.export(path)
    except ExportError as exc:
        written = history.checkpoints[-1] if len(history.checkpoints) > since else None
        held = (f"{str(path)!r} still holds the checkpoint after {written} train steps" if written is not None
                else f"{str(path)!r} is as it was when training started")
        failed = f"checkpoint after {engine.step_count} train steps not written ({exc}); {held}"
        if retry_at is None:
            raise CheckpointError(f"{failed}; the engine holds the trained state: engine.export(path) elsewhere "
                                  "keeps it", written, str(exc)) from exc
        warnings.warn(f"{failed}; training goes on, and writes the next one after {retry_at} train steps: free "
                      "space (or fix the cause) by then", RuntimeWarning, stacklevel=3)
        return
    history.checkpoints.append(engine.step_count)


def fit(
    engine: Engine,
    batches: Iterable[Mapping[str, Any]],
    steps: int,
    algorithm: int = 0,
    loss: str | None = None,
    log_every: int = 10,
    progress: bool = True,
    learning_rate: float | Callable[[int], float] | None = None,
    evaluate: Callable[[Engine], Mapping[str, float]] | None = None,
    eval_every: int = 100,
    checkpoint: str | Path | None = None,
    checkpoint_every: int = 1000,
    history: History | None = None,
    on_log: Callable[[int, float], Any] | None = None,
) -> History:
    """Run `steps` more train steps over `batches`. The loss is read back (a host sync) every `log_every` steps.

    Steps are numbered as the engine counts them (`engine.step_count`, which a checkpoint restores), not from 0
    in each call: History's step numbers and the `log_every`, `eval_every` and `checkpoint_every` phases are
    those of the whole run, so a run resumed from a checkpoint logs, evaluates and checkpoints at the steps the
    uninterrupted run did (a call also logs its first and last steps). `steps` is the number this call takes:
    to end a resumed run at step `total`, pass `total - engine.step_count`; batches that end sooner end the call
    sooner, their last step being its last (logged, evaluated and checkpointed as such).

    `learning_rate`: a value or a schedule `update -> rate`, fed as the algorithm input `learning_rate` (what
    make_trainable declares; a 0-d float32 feed, so a new rate never recompiles); each rate must be a finite
    number >= 0 (a 0-d array too, as optax's schedules return), checked before its step. The schedule is called
    with the number of optimizer updates done before the step, as a PyTorch scheduler steps once per
    optimizer.step(): under make_trainable's accumulate=k, `engine.step_count // k` (updates 0, 1, ... are
    schedule(0), schedule(1), ..., the rate fed with an update's k-th micro-batch being the one used); otherwise
    the step's number. `steps`, the step numbers and the intervals below count train steps (micro-batches under
    accumulate=k). The loss is logged at the steps numbered 0, log_every, 2 * log_every... (a step's number is
    the count of steps before it);
    `evaluate(engine)` runs (use `engine.infer` inside it) and `checkpoint` is exported after every `eval_every` /
    `checkpoint_every` steps taken, so after the steps numbered eval_every - 1, 2 * eval_every - 1... (History's
    eval_steps), and both at the end.

    `history`: a History to append to instead of a new one, so that what a run logged stays with the caller when
    it stops early (a Ctrl-C in a notebook, a DivergenceError); `on_log(step, loss)` is called at each logged
    step as it happens (`onnxtrain train` prints its lines so, where a log file had seen none until the end).

    A NaN or infinite loss (read where it is logged, and at each checkpoint) raises DivergenceError naming
    the step; a checkpoint is written only when the loss and every float state variable are finite, so a
    diverged run never overwrites the last good one. A checkpoint that cannot be written (the disk full) is a
    RuntimeWarning and training goes on, the next checkpoint trying again; the last one's failure raises
    CheckpointError (`write_checkpoint`). `history.checkpoints` lists the step counts of those written."""
    from tqdm.auto import tqdm

    check_options(engine, algorithm, loss,
                  {"log_every": log_every, "eval_every": eval_every, "checkpoint_every": checkpoint_every})
    if not is_integer(steps) or steps < 0:
        raise OnnxTrainError(f"steps must be a number of steps >= 0, got {steps!r}")
    if checkpoint is not None:
        check_export_target(checkpoint)
    loss = loss or loss_output(engine, algorithm)
    schedule = learning_rate if callable(learning_rate) or learning_rate is None else (lambda _: learning_rate)
    # a schedule numbers optimizer updates, as torch's; it had been fed micro-batch counts, so that under
    # accumulate=k update u used schedule(u * k + k - 1) where a PyTorch loop uses schedule(u)
    per_update = micro_batches_per_update(engine.model.training_info[algorithm].algorithm)
    history = History() if history is None else history
    try:
        iterator = iter(batches)
    except TypeError as exc:
        raise FeedError(f"batches are an iterable of feed mappings, not {type(batches).__name__}") from exc
    first = next(iterator, None)
    if first is None:
        return history
    engine.check_feeds(first, algorithm)  # a wrong batch fails before the progress bar starts
    # the run's step numbers: a call that goes on from a checkpoint keeps the uninterrupted run's phases (they had
    # restarted at 0, so a run resumed at step 2310 checkpointed at 2410 where the uninterrupted one did at 2400)
    start = engine.step_count
    written_before = len(history.checkpoints)  # a History passed in holds earlier calls' checkpoints, maybe elsewhere
    with tqdm(initial=start, total=start + steps, disable=not progress, unit="step") as bar:
        batch = first
        for step in range(start, start + steps):
            if schedule is not None:
                rate = learning_rate_at(schedule, engine.step_count // per_update, engine.step_count)
                batch = {**batch, LEARNING_RATE: np.float32(rate)}
            outputs = engine.train_step(batch, algorithm=algorithm)
            # the call's last step is where `steps` ends or where the batches do: logged, evaluated and checkpointed
            # either way (a finite iterable shorter than `steps` had ended the call with none of them)
            batch = next(iterator, None) if step < start + steps - 1 else None
            last = batch is None
            if loss is not None and (step % log_every == 0 or step == start or last):
                value = float(outputs[loss])
                check_finite(engine, step - start, {loss: value})
                history.steps.append(step)
                history.losses.append(value)
                bar.set_postfix({loss: f"{value:.5f}"})
                if on_log is not None:
                    on_log(step, value)
            if evaluate is not None and ((step + 1) % eval_every == 0 or last):
                history.eval_steps.append(step)
                history.metrics.append(dict(evaluate(engine)))
            if checkpoint is not None and ((step + 1) % checkpoint_every == 0 or last):
                check_finite(engine, step - start, {loss: float(outputs[loss])} if loss else {}, state=True)
                write_checkpoint(engine, checkpoint, history, written_before, None if last else min(
                    (engine.step_count // checkpoint_every + 1) * checkpoint_every, start + steps))
            bar.update(1)
            if last:
                break
    return history
