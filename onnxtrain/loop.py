"""The training loop: batches in, train steps out, loss history kept without a host sync per step."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

import numpy as np

from .authoring import LEARNING_RATE
from .engine import Engine
from .errors import FeedError


def array_batches(
    arrays: Mapping[str, np.ndarray], batch_size: int | None = None, shuffle: bool = True, seed: int = 0
) -> Iterator[dict[str, np.ndarray]]:
    """Endless minibatches over arrays that share their first dimension (epoch after epoch)."""
    sizes = {name: len(a) for name, a in arrays.items()}
    if len(set(sizes.values())) != 1:
        raise FeedError(f"data arrays differ in their first dimension: {sizes}")
    n = next(iter(sizes.values()))
    batch_size = min(batch_size or n, n)
    rng = np.random.default_rng(seed)
    while True:
        order = rng.permutation(n) if shuffle else np.arange(n)
        for start in range(0, n - batch_size + 1, batch_size):  # full batches only: one compiled shape
            index = order[start : start + batch_size]
            yield {name: a[index] for name, a in arrays.items()}


def loss_output(engine: Engine, algorithm: int = 0) -> str | None:
    """The algorithm graph's first scalar float output: what a training loop reports as the loss."""
    for output in engine.algorithms[algorithm].algorithm.outputs:
        if output.shape == () and output.elem_type in (1, 10, 11, 16):
            return output.name
    return None


@dataclass
class History:
    """Loss at the logged steps, and whatever `evaluate` returned at the evaluated ones."""

    steps: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    eval_steps: list[int] = field(default_factory=list)
    metrics: list[dict[str, float]] = field(default_factory=list)


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
) -> History:
    """Run `steps` train steps over `batches`. The loss is read back (a host sync) every `log_every` steps.

    `learning_rate`: a value or a schedule `step -> rate`, fed as the algorithm input `learning_rate` (what
    make_trainable declares; a 0-d float32 feed, so a new rate never recompiles). `evaluate(engine)` runs every
    `eval_every` steps (use `engine.infer` inside it); `checkpoint` is exported every `checkpoint_every` steps
    and at the end."""
    from tqdm.auto import tqdm

    loss = loss or loss_output(engine, algorithm)
    schedule = learning_rate if callable(learning_rate) or learning_rate is None else (lambda _: learning_rate)
    history = History()
    iterator = iter(batches)
    first = next(iterator, None)
    if first is None:
        return history
    engine.check_feeds(first, algorithm)  # a wrong batch fails before the progress bar starts
    iterator = itertools.chain([first], iterator)
    bar = tqdm(total=steps, disable=not progress, unit="step")
    for step in range(steps):
        batch = next(iterator, None)
        if batch is None:
            break
        if schedule is not None:
            batch = {**batch, LEARNING_RATE: np.float32(schedule(engine.step_count))}
        outputs = engine.train_step(batch, algorithm=algorithm)
        last = step == steps - 1
        if loss is not None and (step % log_every == 0 or last):
            value = float(outputs[loss])
            history.steps.append(step)
            history.losses.append(value)
            bar.set_postfix({loss: f"{value:.5f}"})
        if evaluate is not None and ((step + 1) % eval_every == 0 or last):
            history.eval_steps.append(step)
            history.metrics.append(dict(evaluate(engine)))
        if checkpoint is not None and ((step + 1) % checkpoint_every == 0 or last):
            engine.export(checkpoint)
        bar.update(1)
    bar.close()
    return history
