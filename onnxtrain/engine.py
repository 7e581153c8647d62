"""The stateful shell around the pure step functions of steps.py: placement, compiled programs, state buffers.

    engine.init(seed)              state <- steps.init(...)
    engine.train_step(feeds, k)    state, outputs <- steps.train_step(...)     state donated: updated in place
    engine.infer(feeds)            outputs <- steps.infer(...)

Each is one jitted program per input signature (program.py); this class holds the state between calls.

An engine may be shared between threads: `lock` serialises every call that reads or replaces the state buffers,
so a step never donates buffers another call is using.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import operator
import os
import signal
import threading
import weakref
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Mapping, Sequence

# signal.getsignal tries to make a Python handler a member of its Handlers enum (a ValueError raised and caught:
# 2.6 us a call); CPython's C module it wraps answers in 0.02 us, and every held train step asks. That module is
# private: where an interpreter lacks it, the public function answers the same, slower.
try:
    from _signal import getsignal as handler_of
except ImportError:
    from signal import getsignal as handler_of

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
import onnx

from .cache import enable_compilation_cache
from .dtypes import HOST_ONLY_DTYPES, is_float
from .errors import ExternalDataError, ModelLoadError, OptionError, StateError, StepError
from .executables import COMPILE_TIME_THRESHOLD, ExecutableStore, model_digest
from .export import (check_export_target, replaced_by_export, save_atomic, saved_step_count, stored_state,
                     with_initializers, with_state, without_state_bytes, without_zero_state)
from .external_data import ExternalValues
from .feeds import FeedChecker
from .lower.autocast import MixedPrecision, check_master_weights, mixed_precision_of
from .optimizers import is_integer
from .lower.folding import load_time_constants
from .ir import Graph, Node, ValueInfo
from .lower.build import build_graph, model_resolver, raise_if_missing
from .lower.layout import KernelLast, kernel_only_weights
from .lower.ops.training import REMAT_MODES
from .model import ModelSource, StateFile, check_model, read_model, same_file, state_tensors
from .placement import Placement, host_array
from .program import Program, raised_in_trace, tracing
from . import steps
from .state.bindings import Algorithm, parse_training_info, state_owners
from .state.store import load_checkpoint, save_npz

# Float inputs an op reads when it is traced (they set its output's shape or its sampling plan); Split-1's sizes
# are typed like its data (T, float), later versions' are int64 (static anyway)
TRACE_TIME_FLOAT_INPUTS = {("Resize", 1), ("Resize", 2), ("Upsample", 1), ("Split", 1)}


def trace_time_reads(nodes: Sequence[Node]) -> set[str]:
    """The names `nodes` read at TRACE_TIME_FLOAT_INPUTS (the dynamo exporter writes Resize's scales as an
    initializer, the TorchScript exporter as a Constant node)."""
    return {name for node in nodes for index, name in enumerate(node.inputs)
            if not node.domain and (node.op_type, index) in TRACE_TIME_FLOAT_INPUTS}


MAIN_THREAD = threading.main_thread().ident


class HeldInterrupts:
    """Ctrl-C held back while a train step's new state is in flight, and while the engine assigns a new state with
    its step count (Engine._assign): within the block, the main thread's Python SIGINT handler only records the
    signal, and it runs once the block ends. A step donates the state buffers to XLA, and Python runs a signal
    handler at the first instruction after a call returns: a KeyboardInterrupt there dropped the step's result with
    the old state already deleted (a Ctrl-C during a loop of steps lost every weight, 30 times in 30). Installed at
    the first held step, the handler stays and passes signals on to the one it wraps outside the block (installing
    and restoring it at each step cost 10 us); a handler set later is wrapped at the next step. SIG_DFL and SIG_IGN
    run no Python code: nothing to hold."""

    def __init__(self) -> None:
        self.wrapped: Callable[[int, Any], Any] | None = None
        self.depth = 0
        self.pending: tuple[int, Any] | None = None

    def __call__(self, signum: int, frame: Any) -> None:
        if self.depth:
            self.pending = (signum, frame)
        elif self.wrapped is not None:
            self.wrapped(signum, frame)

    def __enter__(self) -> None:
        if threading.get_ident() != MAIN_THREAD:
            return  # Python runs handlers in the main thread only: an interrupt never lands in this one
        current = handler_of(signal.SIGINT)
        if current is not self and callable(current):
            self.wrapped = current
            signal.signal(signal.SIGINT, self)
        self.depth += 1

    def __exit__(self, *exc: Any) -> None:
        if threading.get_ident() != MAIN_THREAD:
            return
        self.depth -= 1
        if not self.depth and self.pending is not None:
            (signum, frame), self.pending = self.pending, None
            self(signum, frame)  # the wrapped handler: KeyboardInterrupt, now that the state is the step's


HELD_INTERRUPTS = HeldInterrupts()


def on_device(name: str, value: np.ndarray, state: set[str], static: set[str]) -> bool:
    """Whether an initializer lives on the device (traced) or stays a NumPy constant (static). State always
    lives there; so do float weights, so they are not baked into the executable. Integer/bool/string constants
    are static so shape arithmetic on them folds, and so are the float types XLA has no buffer for
    (HOST_ONLY_DTYPES: their ops compute on the host), float constants an op reads at trace time (`static`:
    trace_time_reads), and float scalars that are not state: an exporter's constants (GELU's exponent 3.0 and
    coefficients, a norm's exponent 2.0) compile in as literals, so Pow by 3.0 is two multiplies, not XLA's
    exp-log pow (GPT-2's inference: 44 -> 4 ms of its ~330 in those kernels). (Small vectors stay traced: a
    BatchNorm's statistics folded at trace time rounded differently.)"""
    return name in state or (device_float(value.dtype) and value.size > 1 and name not in static)


def device_float(dtype: np.dtype) -> bool:
    """A float type XLA has buffers for (not one of HOST_ONLY_DTYPES)."""
    return is_float(dtype) and np.dtype(dtype) not in HOST_ONLY_DTYPES


def check_seed(seed: Any) -> None:
    """OptionError unless `seed` is an integer that jax.random.key takes (64 bits, signed or not)."""
    if not is_integer(seed) or not -2**63 <= seed < 2**64:
        raise OptionError(f"seed must be an integer of at most 64 bits, got {type(seed).__name__} {seed!r}")


# jax.lax.Precision's names, which every platform computes (the GPU's choice of passes); the other names JAX takes
# are algorithm presets (jax.lax.DotAlgorithmPreset: "BF16_BF16_F32", "F16_F16_F32"...), which fix the operand
# types and only some platforms compute
PRECISION_NAMES = frozenset({"default", "high", "highest", "bfloat16", "tensorfloat32", "float32"})


def check_matmul_precision(precision: Any, device: jax.Device, mixed_precision: MixedPrecision | None) -> None:
    """OptionError unless JAX takes `precision` as its matmul precision (the engine sets it while tracing) and,
    for an algorithm preset, mixed precision is off (a preset converts the operands to its own types: under
    mixed_precision="float16", "BF16_BF16_F32" had rounded the products' operands to bfloat16) and `device`'s
    platform lowers a float32 product at it (the CPU lowers no "F16_F16_F32": the first step had raised JAX's
    ValueError)."""
    try:
        with jax.default_matmul_precision(precision):
            pass
    except (ValueError, TypeError) as exc:
        raise OptionError(f"matmul_precision={precision!r} is not a precision JAX knows ({exc})") from exc
    if precision is None or precision in PRECISION_NAMES:
        return
    if mixed_precision is not None:
        raise OptionError(f"matmul_precision={precision!r} is an algorithm preset, which sets the products' operand "
                          f"types, and mixed_precision={jnp.dtype(mixed_precision.dtype).name!r} sets them too: use "
                          f"one of them (with mixed precision, matmul_precision is one of {sorted(PRECISION_NAMES)})")
    operand = jax.device_put(np.zeros((2, 2), np.float32), device)
    try:
        with jax.default_matmul_precision(precision):
            jax.jit(jnp.matmul).lower(operand, operand)
    except ValueError as exc:
        raise OptionError(f"matmul_precision={precision!r} is an algorithm preset that the {device.platform} "
                          f"cannot compute ({exc})") from exc


# What JAX raises when it cannot lower or compile a traced program: NotImplementedError for an operation without a
# lowering rule on this platform ("MLIR translation rule for primitive ... not found for platform cpu"), ValueError
# or TypeError from a rule that refuses its operands. They come before the launch, so nothing ran; an op's own
# lowering failing in the trace is already a NodeError naming its node (lower/walker.py), and onnxtrain's errors
# are none of these types. They had come out of train_step and infer as they were, not as the documented StepError.
# One raised in the trace outside any node (program.raised_in_trace) is a bug of onnxtrain's: it comes out as itself,
# not as the model's program failing to lower.
LOWERING_ERRORS = (NotImplementedError, ValueError, TypeError)


def lowering_failure(call: str, exc: Exception, state: str = "") -> StepError:
    """The StepError for `call` (what failed: "train step 3 (algorithm 0)", "infer") whose program JAX could not
    lower or compile (`exc`, one of LOWERING_ERRORS); `state`: what became of the state, when the call updates it."""
    return StepError(f"{call} failed before it ran: JAX could not lower or compile its program{state}: "
                     f"{type(exc).__name__}: {first_line(exc)}")


def first_line(exc: Exception) -> str:
    return (str(exc).splitlines() or [""])[0]


def feed_lists(graphs: list[Graph]) -> tuple[list[ValueInfo], list[ValueInfo]]:
    """(required, optional) feeds of a concatenation of graphs: an input with an initializer is optional."""
    initialized = {name for g in graphs for name in g.initializers}
    inputs = [i for g in graphs for i in g.inputs]
    return [i for i in inputs if i.name not in initialized], [i for i in inputs if i.name in initialized]


class Engine:
    """An ONNX model lowered to JAX, with its training state.

    `infer(feeds)` runs ModelProto.graph with the current state and changes nothing; `init(seed)` and
    `train_step(feeds, algorithm)` run the TrainingInfoProto graphs and assign state through their bindings.

    Nothing an engine holds refers back to it (its programs' bodies take the step model, their store is reached
    through a weak reference, `_rebuild` is called with the engine), so an engine no longer referenced is freed
    at once, its state and programs with it. In a reference cycle it waited for Python's full collection: a
    notebook cell re-running `engine = onnxtrain.load(...)` kept each replaced engine's state and executables
    (the zoo's BERT: 9 engines and 550 MB resident before one came).
    """

    def __init__(
        self, model: onnx.ModelProto, seed: int = 0, check: bool = True, devices: Sequence[jax.Device] | None = None,
        matmul_precision: str = "highest", shard_state: bool = False, mixed_precision: str | None = None,
        loss_scale: float | None = None, remat: bool | str = False, zero_state: frozenset[str] = frozenset(),
        source_file: Path | None = None, state_checksums: Mapping[str, int] | None = None,
        external: ExternalValues | None = None,
    ):
        """`zero_state`: state variables `model` holds without their bytes, which are all zero
        (export.without_zero_state; `load` does so for a model it read itself). `source_file`: the file `model`
        was read from, no one else holding `model`, with `state_checksums` (the CRC-32 of its state variables'
        raw_data, from without_zero_state): once the state is on the device, the engine keeps its initial values
        in that file instead of in memory (model.StateFile). `external`: reads the state variables `model` keeps
        in external data (`load` keeps them there: model.read_model's `keep`)."""
        self.mixed_precision = mixed_precision_of(mixed_precision, loss_scale)  # lower/autocast.py
        check_master_weights(self.mixed_precision, model)
        if remat not in REMAT_MODES:
            raise OptionError(f"remat={remat!r} is not one of False, True or 'attention'")
        self._placement = Placement(devices, shard_state)
        check_matmul_precision(matmul_precision, self._placement.device, self.mixed_precision)
        check_seed(seed)
        if check:
            check_model(model)
        self.model = model
        self._source_file = source_file
        self._zero_state = zero_state
        self._external = external
        resolver = model_resolver(model, zero_state, external)
        self.graph = build_graph(model.graph, resolver)
        self._output_names = tuple(o.name for o in self.graph.outputs)  # read by every infer
        self.algorithms: list[Algorithm] = parse_training_info(model, self.graph, resolver)
        raise_if_missing(resolver)
        self.functions = resolver.functions
        self.seed = seed
        self.step_count = saved_step_count(model)
        # The device copy of step_count that seeds random streams, made on the first train step. A step that
        # draws no random numbers does not advance it (one kernel less); it is then behind (`_step_behind`) and
        # put again before the next step that draws, so a step's stream depends on step_count alone, which is
        # what a checkpoint saves: resuming draws what an uninterrupted run draws.
        self._step: jax.Array | None = None
        self._step_behind = False
        # per algorithm, what its trace found: "draws", whether its step draws random numbers (kept with the
        # program in the store of compiled programs, which a later process reads instead of tracing)
        self._notes: list[dict[str, Any]] = [{} for _ in self.algorithms]
        self._ran: set[tuple] = set()  # (algorithm, feed signature) that completed a step once
        # How to rebuild the state exactly as it is without a copy of it, while no step has changed it since
        # load, reset or init: then the first step of a new shape needs no safety copy (see train_step). A call
        # taking the engine, not a bound method: the engine holds it, and must not be in a reference cycle (see
        # Engine).
        self._rebuild: Callable[[Engine], None] | None = operator.methodcaller("_put_stored_state", self.step_count)
        self.lock = threading.RLock()

        # the built graphs by owner, as bindings.owner_graphs keys the protos: the state's and the placement's one map
        graphs = {None: self.graph, **{a.index: a.graph for a in self.algorithms}}
        self.state_owner = state_owners(model, graphs)
        self.required_inputs, self.optional_inputs = feed_lists([self.graph])
        self._infer_feeds = FeedChecker(self.required_inputs, self.optional_inputs)
        self._train_feeds = [FeedChecker(*feed_lists([self.graph, a.graph]), rows_required=True)
                             for a in self.algorithms]
        self._declared = {i.name: i for g in [self.graph] + [a.graph for a in self.algorithms] for i in g.inputs}
        self.matmul_precision = matmul_precision

        # Each graph's device-resident initializers move from its `initializers` (NumPy, decoded by build_graph
        # for this engine alone) to the device one at a time: the host never holds a second decoded copy of
        # the weights, at load or after (`reset` decodes the initial state from `model` again). What stays in
        # `initializers` is the static constants the traces read.
        owned = set(self.state_owner)
        static = trace_time_reads([n for graph in graphs.values() for n in graph.nodes])
        moving = {owner: [n for n, v in graph.initializers.items() if on_device(n, v, owned, static)]
                  for owner, graph in graphs.items()}
        # a constant kernel that only convolutions read is stored once in their order (lower/layout.py)
        kernels = set() if self._placement.platform != "cpu" else kernel_only_weights(
            self.graph.nodes, [n for a in self.algorithms for n in a.graph.nodes], set(moving[None]) - owned)

        def place(owner: int | None, name: str) -> Any:
            value = graphs[owner].initializers.pop(name)
            if owner is None and name in kernels:
                return KernelLast(self._put(name, KernelLast.of(value).data))
            return self._put(name, value)

        placed = {owner: {n: place(owner, n) for n in names} for owner, names in moving.items()}
        # the initializers every program takes as arguments: a trace never reads their values
        self._arguments = owned | {n for names in moving.values() for n in names}
        self._state = {n: placed[owner].pop(n) for n, owner in self.state_owner.items()}
        # Whether the state holds exactly the model's stored values (load, reset, and nothing since): a reset
        # then has nothing to read again (a file-loaded engine would read the whole file for it).
        self._holds_stored = True
        self._state_file: StateFile | None = None
        if source_file is not None:  # the state is on the device now: its initial bytes can stay in the file
            self.model, checksums = without_state_bytes(model, self.state_owner, zero_state, state_checksums or {})
            self._state_file = StateFile(source_file, checksums) if checksums else None
        self._main_consts, self._main_static = placed[None], self.graph.initializers
        self._algorithm_consts = [placed[a.index] for a in self.algorithms]
        self._algorithm_static = [a.graph.initializers for a in self.algorithms]
        with jax.enable_x64(True):
            self._key = jax.random.key(seed)
            with tracing(matmul_precision, self._placement.platform):  # float constants: see lower/constants.py
                hoisted = load_time_constants(list(graphs.values()), [g.initializers for g in graphs.values()])
            self._main_hoisted, *self._algorithm_hoisted = [self._placement.put(h) for h in hoisted]

        self._model = steps.StepModel(self.graph, tuple(self.algorithms), self.functions, self._main_static,
                                      tuple(self._algorithm_static), self._placement.keep_layout,
                                      self.mixed_precision, remat)
        self._infer = self._infer_program()
        self._train = [self._train_program(k) for k in range(len(self.algorithms))]
        self._copied = [tuple(steps.copied_outputs(self._model, k).items()) for k in range(len(self.algorithms))]
        self._init = self._init_program()

    def _put(self, name: str, value: np.ndarray) -> jax.Array:
        """`value` on the device, its copy there complete: until then the transfer keeps the host array alive, and
        a whole model's host arrays in flight at once (the puts return before their copies end) raised BERT-base's
        load peak from 1,111 to 1,233-1,477 MB, for 0.3 s less of a 2.6 s load."""
        with jax.enable_x64(True):
            return self._placement.put({name: value}, donated=name in self.state_owner)[name].block_until_ready()

    # ----- the pure functions (steps.py) as programs: compiled once per signature -----

    def _infer_program(self) -> Program:
        model = self._model  # not `self`: the program would hold the engine in a cycle (see Engine)

        def body(state, consts, key, feeds, static_feeds):
            return {}, steps.infer(model, state, consts, key, {**static_feeds, **feeds})

        return Program(body, self.graph.nodes, self._placement.platform, matmul_precision=self.matmul_precision,
                       constants=self._main_hoisted, store=self._store_reader(), name="infer")

    def _train_program(self, k: int) -> Program:
        model, notes = self._model, self._notes[k]

        def body(carry, consts, k_consts, key, feeds, static_feeds):
            result = steps.train_step(model, k, *carry, consts, k_consts, key, {**static_feeds, **feeds})
            notes["draws"] = result.draws
            return (result.state, result.step), result.outputs

        return Program(body, self.graph.nodes + self.algorithms[k].graph.nodes, self._placement.platform,
                       donate=(0,), matmul_precision=self.matmul_precision,
                       constants={**self._main_hoisted, **self._algorithm_hoisted[k]},
                       store=self._store_reader(), name=f"train {k}", notes=notes)

    def _init_program(self) -> Program:
        model = self._model

        def body(state, key, feeds, static_feeds):
            return steps.init(model, state, key), {}

        return Program(body, (), self._placement.platform, matmul_precision=self.matmul_precision,
                       store=self._store_reader(), name="init")

    def _store_reader(self) -> Callable[[], ExecutableStore | None]:
        """`_executable_store` as the engine's programs ask for it (on first use), through a weak reference: a
        program runs only within a call of its engine's, which is then alive."""
        engine = weakref.ref(self)
        return lambda: engine()._executable_store

    @functools.cached_property
    def _executable_store(self) -> ExecutableStore | None:
        """Where this engine's compiled programs are kept for later processes (executables.py): beside JAX's
        persistent compilation cache, when it has a local folder, for an engine on one device. Its fingerprint
        is everything a trace reads but the arguments: the model without the values of the initializers that
        are arguments, the engine's options, the device, the versions of JAX, onnx and NumPy, JAX's settings
        (and, added by the store, onnxtrain's sources)."""
        folder = jax.config.jax_compilation_cache_dir
        if not folder or "://" in folder or self._placement.parallel or jax.config.jax_default_device is not None:
            return None  # a remote cache, several devices, or a default device this engine does not name
        if COMPILE_TIME_THRESHOLD is None:  # JAX's cache could serve a program the store misses: not storable
            return None
        device = self._placement.devices[0] if self._placement.devices else jax.devices()[0]
        settings = (self.matmul_precision, self.mixed_precision, self._model.remat, self._placement.shard_state,
                    device.platform, device.device_kind, device.client.platform_version, jax.__version__,
                    jaxlib.__version__, onnx.__version__, np.__version__,  # onnx's schemas, NumPy's static folding
                    os.environ.get("XLA_FLAGS", ""), sorted(jax.config.values.items()))
        model = model_digest(self.model, self._arguments)
        fingerprint = hashlib.sha256(model + repr(settings).encode()).digest()
        return ExecutableStore(Path(folder), fingerprint, device)

    # ----- the stateful API -----

    def __repr__(self) -> str:
        size = sum(int(np.prod(v.shape)) for v in self._state.values())
        return (
            f"<onnxtrain.Engine inputs={self.input_names} outputs={self.output_names} "
            f"state={len(self._state)} variables ({size:,} values) algorithms={len(self.algorithms)} "
            f"step={self.step_count}>"
        )

    @property
    def input_names(self) -> list[str]:
        return [i.name for i in self.required_inputs]

    @property
    def output_names(self) -> list[str]:
        return list(self._output_names)

    @property
    def state(self) -> Mapping[str, jax.Array]:
        """The current state variables (read-only). train_step donates these buffers: copy a value
        (np.array(engine.state[name])) to keep it across steps."""
        return MappingProxyType(self._state)

    @property
    def batch_sharding(self) -> jax.sharding.NamedSharding | None:
        """How batched feeds are split over the engine's devices (None on one device). A NumPy feed is the
        whole batch; on several hosts, each can feed just its own rows as
        `jax.make_array_from_process_local_data(engine.batch_sharding, local_rows)`."""
        return self._placement.batch_sharding

    @property
    def trace_count(self) -> int:
        """How many times any graph was traced (compiled), or read compiled from the store of an earlier process
        (executables.py); a repeated input signature adds nothing."""
        return self._infer.trace_count + self._init.trace_count + sum(p.trace_count for p in self._train)

    def check_feeds(self, feeds: Mapping[str, Any], algorithm: int | None = None) -> dict[str, Any]:
        """Validate feeds for `infer` (algorithm None) or for `train_step(algorithm=k)`; FeedError if wrong."""
        return (self._infer_feeds if algorithm is None else self._train_feed_checker(algorithm))(feeds)

    def _train_feed_checker(self, algorithm: int) -> FeedChecker:
        """`train_step(algorithm=k)`'s FeedChecker, once `algorithm` is checked (StateError if it is none)."""
        self.check_algorithm(algorithm)
        return self._train_feeds[algorithm]

    def check_algorithm(self, algorithm: int) -> None:
        """StateError unless `algorithm` indexes one of the model's TrainingInfoProtos."""
        if type(algorithm) is not int and not is_integer(algorithm):  # (the ABC's check costs a microsecond)
            raise StateError(f"algorithm is the index of a TrainingInfoProto, an int: got {type(algorithm).__name__} "
                             f"{algorithm!r}")
        if not self.algorithms:
            raise StateError("the model carries no TrainingInfoProto, so it has no train step "
                             "(make-trainable adds one)")
        if not 0 <= algorithm < len(self.algorithms):
            raise StateError(
                f"algorithm {algorithm} does not exist: the model has {len(self.algorithms)} TrainingInfoProto(s)"
            )

    def infer(self, feeds: Mapping[str, Any]) -> dict[str, Any]:
        """Run ModelProto.graph on `feeds` with the current state; returns {output name: array}."""
        checked = self._placement.feeds(self.check_feeds(feeds), self._declared)
        with self.lock:  # launched on the state of one moment: a step in another thread waits to donate it
            try:
                _, outputs = self._infer(self._state, self._main_consts, self._key, feeds=checked)
            except LOWERING_ERRORS as exc:
                if raised_in_trace(exc):
                    raise
                raise lowering_failure("infer", exc) from exc
            except jax.errors.JaxRuntimeError as exc:  # out of memory at launch (a Tile to 192 TB): as train_step
                raise StepError(f"infer failed while running (the state is unchanged): {first_line(exc)}") from exc
        return {name: outputs[name] for name in self._output_names}

    def train_step(self, feeds: Mapping[str, Any], algorithm: int = 0) -> dict[str, Any]:
        """Evaluate ModelProto.graph + training_info[algorithm].algorithm and assign via update_binding.

        Returns the outputs of both graphs as device arrays (no host sync), except those that update_binding
        assigns to state: read those from `state`.

        A step that fails while it runs raises StepError and leaves the state as it was, when it is the first
        step with its algorithm and feed shapes (a batch too large for the device's memory is a new shape):
        that step is waited for, and runs on a copy of the state, unless no step has run since load, `reset`
        or `init` (the state is then rebuilt as they made it: no copy of the weights is needed at the very
        first step, where memory peaks). Later steps donate the state buffers and run asynchronously; one that
        fails at run time (the device failing, memory taken by something else) loses the state."""
        checked, signature = self._train_feed_checker(algorithm).checked(feeds)
        checked = self._placement.feeds(checked, self._declared)
        with self.lock:
            (state, step), *constants = self._train_arguments(algorithm)
            first = signature is None or (algorithm, signature) not in self._ran
            self._holds_stored = False  # donated to the step, then replaced by its result
            if first and self._rebuild is None:  # the copy is donated: the state survives whatever the step meets
                with jax.enable_x64(True):
                    state, step = jax.tree.map(jnp.copy, (state, step))
            # a first step may compile for minutes: Ctrl-C stops it at once, its state a copy or rebuilt; a later
            # step donates the state itself, so an interrupt waits until its result is the engine's state
            with contextlib.nullcontext() if first else HELD_INTERRUPTS:
                try:
                    (state, step), outputs = self._train[algorithm]((state, step), *constants, feeds=checked)
                    if first:
                        jax.block_until_ready((state, outputs))
                except KeyboardInterrupt:  # in a first step (later ones hold it back): the copy went, or rebuild
                    self._recover()
                    raise
                except jax.errors.JaxRuntimeError as exc:
                    raise StepError(f"{self._this_step(algorithm)} failed while running ({self._recover()}): "
                                    f"{first_line(exc)}") from exc
                except LOWERING_ERRORS as exc:
                    if raised_in_trace(exc):  # before anything ran, as a NodeError: the state is as it was
                        raise
                    raise lowering_failure(self._this_step(algorithm), exc, f" ({self._recover()})") from exc
                if first and signature is not None:
                    self._ran.add((algorithm, signature))
                self._state, self._step = state, step
                self._rebuild = None
                self._step_behind |= not self._notes[algorithm]["draws"]
                self.step_count += 1
        for name, copy in self._copied[algorithm]:  # the step returned each once (steps.copied_outputs)
            outputs[copy] = outputs[name]
        return outputs

    def _this_step(self, algorithm: int) -> str:
        return f"train step {self.step_count + 1} (algorithm {algorithm})"

    def _recover(self) -> str:
        """Rebuild the state a failed or interrupted step took, where `_rebuild` can (it is then as before the
        step), and say what became of it, as it is (whether the buffers went with the step depends on the
        platform and the failure)."""
        lost = any(v.is_deleted() for v in self._state.values())
        if lost and self._rebuild is not None:
            self._rebuild(self)
            lost = False
        return "the state was donated to it and is lost" if lost else "the state is as before it"

    def lower(self, feeds: Mapping[str, Any], algorithm: int | None = None) -> jax.stages.Lowered:
        """The XLA program that `infer(feeds)` (algorithm None) or `train_step(feeds, algorithm)` runs, lowered
        without running it: `.as_text()` is its StableHLO, and `.compile()` gives `memory_analysis()` (the bytes
        of its arguments, outputs and temporaries on the device) and `cost_analysis()`."""
        checked = self._placement.feeds(self.check_feeds(feeds, algorithm), self._declared)
        with self.lock:
            if algorithm is None:
                return self._infer.lower(self._state, self._main_consts, self._key, feeds=checked)
            return self._train[algorithm].lower(*self._train_arguments(algorithm), feeds=checked)

    def _train_arguments(self, algorithm: int) -> tuple:
        # the step count lives on the device between steps: no host transfer per step, except before a step that
        # (for all we know before its first trace) draws, after steps that left it behind
        if self._step is None or (self._step_behind and self._notes[algorithm].get("draws", True)):
            self._step_behind = False
            with jax.enable_x64(True):
                # (modulo 2**32, as the device's uint32 counter wraps: a count past it, from a checkpoint or an
                # exported model's metadata, had been an OverflowError)
                self._step = self._placement.put({"step": np.uint32(self.step_count % 2**32)})["step"]
        return (self._state, self._step), self._main_consts, self._algorithm_consts[algorithm], self._key

    def reset(self) -> None:
        """Every state variable back to its initializer value (the spec's pre-initialized state)."""
        with self.lock:
            self._assign(self._stored_state(), 0, True, operator.methodcaller("reset"))

    def _put_stored_state(self, step_count: int) -> None:
        """The model's stored state on the device again, with `step_count` (`_rebuild` after load)."""
        self._assign(self._stored_state(), step_count, True, self._rebuild)

    def _stored_state(self) -> dict[str, jax.Array]:
        """The model's stored state on the device: the engine's own where it holds it, else read again and put."""
        if self._holds_stored:
            return self._state
        model = self.model if self._state_file is None else self._state_file.read()
        stored = stored_state(model, self.state_owner, self._zero_state, self._external)
        return {name: self._put(name, value) for name, value in stored}

    def _assign(self, state: dict[str, jax.Array], step_count: int, holds_stored: bool,
                rebuild: Callable[[Engine], None] | None) -> None:
        """Replace the state and everything that goes with it as one change that a Ctrl-C cannot split: its
        KeyboardInterrupt is held until all are assigned (HELD_INTERRUPTS, as for a train step). One raised
        between had left a new state with the old step count (so the random streams and the checkpoints' count of
        another run), or a rebuild that made another state. The new values are built before: an interrupt
        while they are (a file read, a device transfer) leaves the engine as it was."""
        with HELD_INTERRUPTS:
            self._state, self._holds_stored, self.step_count, self._step, self._rebuild = (
                state, holds_stored, step_count, None, rebuild)

    def init(self, seed: int | None = None) -> None:
        """Reset, then run every TrainingInfoProto.initialization in order and assign its bindings."""
        if seed is not None:
            check_seed(seed)
        with self.lock:
            stored = self._stored_state()  # reset's, assigned with the initialization's result: one change
            with jax.enable_x64(True):
                key = jax.random.key(self.seed if seed is None else seed)
            initialized = stored
            if any(algorithm.initialization is not None for algorithm in self.algorithms):
                initialized, _ = self._init(stored, key, feeds={})
            self._assign(initialized, 0, initialized is stored, operator.methodcaller("init", seed))

    def jax_function(self) -> tuple[Callable[[Mapping[str, Any], Mapping[str, Any]], dict[str, Any]], dict]:
        """`fn, params`: ModelProto.graph as a pure function `fn(params, feeds) -> {output: array}`, jittable
        and differentiable in `params` (every float initializer and state variable of the main graph).

        It traces under JAX's x64 mode so ONNX's int64/double values keep their dtypes."""
        consts = {n: v.as_onnx() if isinstance(v, KernelLast) else v for n, v in self._main_consts.items()}
        # the small float constants the engine's own programs compile in (on_device) are parameters here too
        small = {n: self._put(n, v) for n, v in self._main_static.items() if device_float(v.dtype)}
        params = {**small, **consts, **{n: v for n, v in self._state.items() if self.state_owner[n] is None}}

        def fn(params: Mapping[str, Any], feeds: Mapping[str, Any]) -> dict[str, Any]:
            with jax.enable_x64(True), tracing(self.matmul_precision, self._placement.platform):
                return steps.infer(self._model, params, {}, self._key, feeds)

        return fn, params

    # ----- checkpoints and export -----

    def save_state(self, path: str | Path) -> None:
        """A light checkpoint: the state and step count in a NumPy .npz (no pickle), written to exactly `path`
        (no suffix added) and atomically: a crash during the save leaves the previous checkpoint intact. Not over
        the file this engine was loaded from: an .npz holds no graph, so that model would be lost."""
        if isinstance(path, (str, os.PathLike)) and self._source_file and same_file(Path(path), self._source_file):
            raise StateError(f"save_state would replace {str(path)!r}, the model this engine was loaded from, with a "
                             "state checkpoint (.npz), which holds no graph: name another file, or export(path) "
                             "to write the model with its trained state")
        with self.lock:  # one moment's state: a step in another thread would donate these buffers
            self._refuse_lost_state("save_state")
            state, meta = {name: host_array(v) for name, v in self._state.items()}, {"step": self.step_count}
        save_npz(path, state, meta)

    def load_state(self, path: str | Path) -> None:
        """Restore a checkpoint of this model, in place (nothing is compiled again): a save_state .npz, or a model
        `export` wrote (fit's `checkpoint`, `onnxtrain train -o`), whose state variables (its TrainingInfoProtos'
        binding keys) and step count are read from its initializers and metadata, its external data as `load`
        reads it. It must hold exactly the model's state variables, each with its shape and dtype (StateError
        listing every difference otherwise: a checkpoint of another model too); any refusal, a damaged file
        included, leaves the state and step count unchanged."""
        values, step = load_checkpoint(path)
        missing = sorted(set(self._state) - set(values))
        unknown = sorted(set(values) - set(self._state))
        mismatched = [
            f"{name!r} is {value.dtype}{list(value.shape)}, the model's is "
            f"{np.dtype(self._state[name].dtype)}{list(self._state[name].shape)}"
            for name, value in values.items()
            if name in self._state and (value.shape, value.dtype) != (
                tuple(self._state[name].shape), np.dtype(self._state[name].dtype))
        ]
        problems = ([f"lacks state variables {missing}"] if missing else []) + (
            [f"holds unknown state variables {unknown}"] if unknown else []) + mismatched
        if problems:
            raise StateError(f"checkpoint {str(path)!r} does not fit this model: " + "; ".join(problems))
        step_count = int(step)
        with self.lock, jax.enable_x64(True):
            self._assign({**self._state, **self._placement.put(values)}, step_count, False, None)

    def export(self, path: str | Path, external_data: bool | None = None) -> None:
        """Write a copy of the model whose initializers hold the current state, atomically. External data
        (external_data=True, or automatically past protobuf's 2 GiB) goes to `<name>.<16 hex>.data` beside it,
        a new name at each export: the model file and its data are always both the old or both the new."""
        check_export_target(path)
        with self.lock:
            self._refuse_lost_state("export")
            self._hold_initial_state(Path(path))
            model, pending = with_state(self.model, self._state, self.state_owner, self.step_count)
            save_atomic(model, Path(path), external_data, pending)

    def _refuse_lost_state(self, call: str) -> None:
        """StateError for `call`, a save, when a train step that failed while running took the state with it (its
        StepError said so): a save had raised JAX's "Array has been deleted", naming neither cause nor remedy."""
        lost = [name for name, value in self._state.items() if value.is_deleted()]
        if lost:
            raise StateError(f"cannot {call}: the engine's state ({', '.join(map(repr, lost[:3]))}"
                             f"{', ...' if len(lost) > 3 else ''}) was lost with a train step that failed while "
                             "running (its StepError says so); load_state(checkpoint), reset() or init() gives it one")

    def _hold_initial_state(self, path: Path) -> None:
        """Keep in memory the initial state that reset reads from the files an export to `path` replaces. A file
        changed since load is left as it is: reset could not read it anyway (and says so), and the export needs
        none of its bytes. Refusing the export had lost the trained state, advising to load the model again."""
        if self._state_file is not None and self._state_file.is_file(path):
            with contextlib.suppress(ModelLoadError):
                self.model, self._state_file = self._state_file.read(), None
        if self._external is not None:
            with contextlib.suppress(ExternalDataError):
                self._external.inline_files(self.model, replaced_by_export(path))


def load(
    source: ModelSource, seed: int = 0, check: bool = True, devices: Sequence[jax.Device] | None = None,
    matmul_precision: str = "highest", shard_state: bool = False, mixed_precision: str | None = None,
    loss_scale: float | None = None, remat: bool | str = False,
) -> Engine:
    """Read an ONNX model (path, bytes or ModelProto), validate it and bind every node to its lowering.

    `devices`: run data parallel over these devices (batched feeds split along their first axis, state
    replicated); default: JAX's default device. `shard_state`: with several devices, split each state variable
    and float weight along its longest axis the device count divides instead of replicating it (FSDP-style: a
    device holds 1/n of the weights and optimizer moments; XLA gathers them where a step needs them).
    `matmul_precision`: "highest" computes float32 matrix products in full float32 as ONNX specifies; "default"
    lets a GPU use TF32 (faster, ~1e-3 relative error).
    `mixed_precision`: "bfloat16" or "float16" computes the float32 matrix products (MatMul, Gemm, Einsum, Conv,
    ConvTranspose, Attention) in that type with float32 accumulation, as torch.autocast does; weights, gradients
    and optimizer state stay float32. `loss_scale` (float16 only, default 2**12): the static factor the backward
    pass is seeded with so float16 gradients do not underflow (onnxtrain/lower/autocast.py).
    `remat`: a train step keeps only about sqrt(n) of its forward pass's values for the backward pass and
    recomputes the rest there, segment by segment (activation checkpointing, onnxtrain/lower/ops/training.py):
    less memory for long sequences and deep models, for about one more forward pass of compute. `remat=
    "attention"` recomputes only each attention's scores and probabilities (batch x heads x length^2 values
    each), from the queries, keys, values and mask that the backward pass keeps anyway, as PyTorch's fused
    attention keeps none: for a few percent more compute."""
    enable_compilation_cache()
    model, folder = read_model(source, keep=state_tensors)
    zero_state: frozenset[str] = frozenset()
    checksums: dict[str, int] = {}
    # absolute: reset reads it again, maybe after the caller changed the working directory
    source_file = None if isinstance(source, (onnx.ModelProto, bytes, bytearray)) else Path(source).absolute()
    if not isinstance(source, onnx.ModelProto):  # read here, so no one else holds it: its zero state can go
        if check:
            check_model(model)
            check = False
        model, zero_state, checksums = without_zero_state(model, checksummed=source_file is not None)
    return Engine(model, seed=seed, check=check, devices=devices, matmul_precision=matmul_precision,
                  shard_state=shard_state, mixed_precision=mixed_precision, loss_scale=loss_scale, remat=remat,
                  zero_state=zero_state, source_file=source_file, state_checksums=checksums,
                  external=None if folder is None else ExternalValues(folder))



def jax_function(source: ModelSource, seed: int = 0):
    """`fn, params = jax_function(model)`: see Engine.jax_function. Train `params` with any optax optimizer,
    then write them back with `export_params(model, params, path)`. `params` holds every float initializer, the
    constants exporters store beside the weights included (BatchNorm's running statistics, exponents, mask fill
    values): train only the parameters, `names = set(parameter_names(model))`, with `optax.multi_transform(
    {"train": optimizer, "keep": optax.set_to_zero()}, {n: "train" if n in names else "keep" for n in params})`
    (optax.masked passes the others' gradients through as updates), or their gradients move those constants too."""
    return load(source, seed=seed).jax_function()


def export_params(source: ModelSource, params: Mapping[str, Any], path: str | Path) -> None:
    """Write `source` with its main-graph initializers replaced by `params`, atomically."""
    model, _ = read_model(source)
    save_atomic(with_initializers(model, params), path)  # which checks `path` before it writes
