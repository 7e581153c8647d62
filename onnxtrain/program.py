"""One pure function per graph (or graph concatenation), jitted once per input signature.

A `Program` owns the cache: jax.jit keys on shapes and dtypes itself; the only thing added to the key is the
values of feeds that must be static (strings, and inputs a node needs at compile time such as a Reshape shape
fed as a graph input), which are found on the first trace and then compiled per distinct value.
"""

from __future__ import annotations

import functools
import gc
import os
import warnings
import weakref
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Mapping, Sequence

import jax
import numpy as np

from .dtypes import host_only
from .errors import StaticValueRequired
from .executables import ExecutableStore, jax_cache_unwritten, self_contained
from .host_memory import trim_after_compiles, trim_heap
from .lower.constants import hoisting
from .lower.target import targeting
from .ir import Node


def hashable(value: Any) -> Any:
    """A hashable stand-in for a static feed: strings, maps (dicts) and arrays of either, or plain arrays."""
    if isinstance(value, dict):
        return tuple(sorted((hashable(k), hashable(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(hashable(v) for v in value)
    if isinstance(value, (np.ndarray, np.generic)):
        if value.dtype == object:
            return (value.shape, tuple(hashable(v) for v in value.ravel().tolist()))
        return (value.dtype.str, value.shape, value.tobytes())
    return value


def static_key(values: Mapping[str, Any]) -> tuple:
    return tuple((name, hashable(values[name])) for name in sorted(values))


def as_static(value: Any) -> Any:
    """A feed as a trace-time value: NumPy for a tensor, a list of NumPy arrays for a sequence."""
    if isinstance(value, list):
        return [as_static(v) for v in value]
    return value if value is None or isinstance(value, dict) else np.asarray(value)


def graph_inputs_feeding(value_name: str, nodes: Sequence[Node], inputs: set[str]) -> set[str]:
    """The graph inputs among the ancestors of `value_name`."""
    producer = {out: node for node in nodes for out in node.outputs if out}
    found, stack, seen = set(), [value_name], set()
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        if name in inputs:
            found.add(name)
        node = producer.get(name)
        if node is not None:
            stack.extend(n for n in node.inputs if n)
    return found


@contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the span: tracing allocates objects by the hundred thousand, and
    the collections they set off scanned the whole heap (jax, onnx, and in the benchmarks PyTorch): 0.17 s of the
    benchmark transformer's 0.56 s trace. Whatever became garbage meanwhile is collected afterwards."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@contextmanager
def tracing(matmul_precision: str, platform: str) -> Iterator[None]:
    """Around a graph's trace: what the lowerings read while tracing (so it is set here, not around every call of
    the compiled program), with the collector paused."""
    with jax.default_matmul_precision(matmul_precision), targeting(platform), gc_paused():
        yield


# XLA-CPU's fusion emitters (MLIR, its default) held 2-3x the memory of its older loop emitters while compiling a
# CNN's train step, and the process kept it: peak resident memory MobileNetV3-small 883 -> 377 MB, ResNet-18
# 575 -> 347 MB, compile 6.3 -> 4.6 s and 2.3 -> 1.5 s, steps within noise. A transformer compiled twice as long
# with the older emitters and T5-small's step ran 8 % longer, so only programs with convolutions take them.
CONVOLUTIONS = frozenset({"Conv", "ConvTranspose"})
LOOP_EMITTERS = {"xla_cpu_use_fusion_emitters": False}

# XLA-CPU hands a convolution to YNNPACK by default (jaxlib 0.10: the library fusion kinds "individual dot",
# "reduce" and "individual convolution"); its Eigen convolution, the kind left out here, is faster on most of a
# CNN's shapes: forward and both gradients 0.64-0.95x the time over ResNet-18's (0.75x for 3x3 over 64 channels
# at 56x56, 1.14x over 128 at 28x28); ResNet-18's inference 0.89x, its train step 0.87-1.00x, MobileNetV3-small's
# 0.91-1.00x; same numbers within float32 rounding (benchmarks/README.md). Set only where this XLA knows it.
YNNPACK_WITHOUT_CONVOLUTION = {
    "xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT,LIBRARY_FUSION_TYPE_REDUCE"}
# The plan in heaps (SPLIT_HEAPS, below) is compiled with YNNPACK's convolutions again: with them ResNet-18's
# long-run train step ran 0.913x and 0.888x its time with Eigen's (AMD EPYC host, two engines alternating in one
# process), where with the one-block plan the two libraries measured 0.98x (and Eigen's the faster on the Intel
# host, whose comparison predates the plan in heaps); MobileNetV3-small 1.06x and 1.00x, noise: few of its
# convolutions are XLA's own (benchmarks/README.md). YNNPACK takes 64-channel convolutions, not 16-channel ones.
YNNPACK_WITH_CONVOLUTION = {
    "xla_cpu_experimental_ynn_fusion_type":
        "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT,LIBRARY_FUSION_TYPE_REDUCE,LIBRARY_FUSION_TYPE_INDIVIDUAL_CONVOLUTION"}


@functools.cache
def accepted(option: str, value: Any) -> bool:
    """Whether XLA's CPU compiler takes `option=value` (an unknown option or enum value fails a compile)."""
    scalar = jax.device_put(np.float32(0), jax.devices("cpu")[0])
    try:
        jax.jit(lambda x: x + 1).lower(scalar).compile(compiler_options={option: value})
    except jax.errors.JaxRuntimeError:
        return False
    return True


# XLA-CPU's default schedule orders a program for concurrency, so a train step's independent products run side by
# side: a weight gradient (Eigen) beside an input gradient (YNNPACK), each library with its own pool of a thread
# per core. Scheduled in sequence instead, the products take the cores in turn: train step ÷ the concurrent
# schedule, alternating in one process on 2 cores, BERT-base 0.93-0.97 (three runs), GPT-2 0.93, T5-small 0.98,
# ResNet-18 0.98-1.01 and MobileNetV3-small 0.99; 0.98-1.06 while the host was busier; the same numbers bit for
# bit (benchmarks/README.md).
SEQUENTIAL_SCHEDULE = {"xla_cpu_enable_concurrency_optimized_scheduler": False}

# A trained weight is donated to its own update and also read by the backward pass's products. XLA-CPU's copy
# insertion copied every such weight at the start of a step (BERT-base: 75 copies, 352 MB; ResNet-18: 19); with
# its region analysis it finds the reads come first and updates in place: step temporaries ResNet-18 101.7 ->
# 89.0 MB, BERT-base 270.2 -> 264.7 MB, train step 0.93-1.01x (BERT-base and ResNet-18, both orders), the same
# numbers bit for bit (benchmarks/README.md).
IN_PLACE_UPDATES = {"xla_cpu_copy_insertion_use_region_analysis": True}
CPU_OPTIONS = {**SEQUENTIAL_SCHEDULE, **IN_PLACE_UPDATES}

# XLA-CPU plans a run's temporaries as one block (ResNet-18's train step at batch 2: 89 MB, BERT-base's 265 MB),
# which glibc maps afresh for every run and unmaps after (a block over 32 MiB, allocated by XLA's threads), so each
# step faults in every page of it: ~22,000 faults and 50-60 ms of kernel time a ResNet-18 step. Planned in heaps
# of 16 MiB, the blocks mostly come back from malloc's free lists: train step ÷ one block, alternating in one
# process, ResNet-18 0.88, BERT-base 0.93, GPT-2 0.89, T5-small 0.93, MobileNetV3-small 0.79 (ResNet-18 0.94 and
# BERT-base 0.90 with malloc in huge pages; benchmarks/README.md). XLA-CPU cannot serialize an executable planned
# so ("Multiple temp buffer allocations"), so the store of programs and JAX's cache keep the one-block plan, and a
# program that has run SPLIT_AFTER_CALLS times, a long run by then, is traced and compiled once more in heaps: at
# that call ResNet-18 2-2.4 s, T5-small 4.9, GPT-2 5.4, BERT-base 6.2, MobileNetV3-small 10.3, won back within
# 45 (GPT-2) to 500 (MobileNetV3-small) more steps. Same computation, same numbers bit for bit.
SPLIT_HEAPS = {"xla_multiheap_size_constraint_per_heap": 16 << 20}
SPLIT_ABOVE_BYTES = 32 << 20  # glibc's largest mmap threshold: a smaller block comes back from its free lists
SPLIT_AFTER_CALLS = 100

# absl's levels, as jax maps its own jax_logging_level onto them (XLA logs through absl)
ABSL_LEVELS = {"DEBUG": 0, "INFO": 0, "WARN": 1, "WARNING": 1, "ERROR": 2, "CRITICAL": 3, "FATAL": 3}


def process_log_level() -> int:
    """XLA's minimum log level in this process: jax_logging_level's where set, else TF_CPP_MIN_LOG_LEVEL's (jax
    sets 1, warnings and up, on import where the user did not), else absl's default (everything)."""
    configured = jax.config.jax_logging_level
    if configured in ABSL_LEVELS:
        return ABSL_LEVELS[configured]
    try:
        return int(os.environ.get("TF_CPP_MIN_LOG_LEVEL", "0"))
    except ValueError:
        return 0


@contextmanager
def xla_warnings_off() -> Iterator[None]:
    """XLA's warnings kept off stderr for the span. Planning in heaps, XLA warns once for each temporary larger
    than a heap (GPT-2's logits, 154 MB: seven lines), though such a buffer just gets a block of its own; at the
    hundredth step of a user's loop they would only puzzle. The level is absl's, reached through jaxlib's
    internals: where those move, the lines show."""
    try:
        from jax._src.lib import utils

        set_level = utils.absl_set_min_log_level
    except (ImportError, AttributeError):
        yield
        return
    set_level(ABSL_LEVELS["ERROR"])
    try:
        yield
    finally:
        set_level(process_log_level())


def known_options(options: dict[str, Any]) -> dict[str, Any]:
    """The options this XLA takes (an older or newer one may not know an option or enum value)."""
    return {k: v for k, v in options.items() if accepted(k, v)}


def convolution_options() -> dict[str, Any]:
    """XLA-CPU's options for a program with convolutions."""
    return {**LOOP_EMITTERS, **known_options({**CPU_OPTIONS, **YNNPACK_WITHOUT_CONVOLUTION})}


def has_convolutions(nodes: Sequence[Node]) -> bool:
    return any(node.op_type in CONVOLUTIONS and not node.domain for node in nodes)


def compiler_options(nodes: Sequence[Node], platform: str) -> dict[str, Any]:
    """XLA options for the program of `nodes` on `platform` (jax.jit's compiler_options)."""
    if platform != "cpu":
        return {}
    if has_convolutions(nodes):
        return convolution_options()
    return known_options(CPU_OPTIONS)


def split_options(nodes: Sequence[Node]) -> dict[str, Any]:
    """What the plan in heaps compiles with on top of the program's own options (empty: this XLA cannot plan
    so); later options override earlier ones in a compile."""
    options = known_options(SPLIT_HEAPS)
    if options and has_convolutions(nodes):
        options |= known_options(YNNPACK_WITH_CONVOLUTION)
    return options


def temporaries(executable: jax.stages.Compiled) -> int:
    """The bytes of temporaries XLA planned for one run (0 where it does not say)."""
    analysis = executable.memory_analysis()
    return 0 if analysis is None else analysis.temp_size_in_bytes


# Marks an exception raised by a program's body while JAX traced it, not by JAX's lowering or compile after: a
# model's node failing there is a NodeError already (lower/walker.py), so a plain TypeError or ValueError from the
# trace is a bug of onnxtrain's, which the engine lets through as itself instead of blaming the model's program
RAISED_IN_TRACE = "_onnxtrain_raised_in_trace"


def raised_in_trace(exc: BaseException) -> bool:
    """Whether `exc` came out of a program's trace (see RAISED_IN_TRACE)."""
    return getattr(exc, RAISED_IN_TRACE, False)


MANY_SIGNATURES = 8  # compiles of one program after which its caller is told how to stop them (count_trace)


class Program:
    """`body(*arrays, static_feeds) -> (state, outputs)`, compiled per static-feed values and input signature.

    String (and 6-bit float) outputs cannot leave a jitted function; they are static by construction (they only
    come from static values), so they are kept from the trace and merged back into the outputs after each call.
    """

    def __init__(
        self, body: Callable[..., Any], nodes: Sequence[Node], platform: str, donate: tuple = (),
        matmul_precision: str = "highest", constants: Mapping[str, Any] | None = None,
        store: Callable[[], ExecutableStore | None] | None = None, name: str = "",
        notes: dict[str, Any] | None = None,
    ):
        """`store`: the engine's store of compiled programs on disk (executables.py), made on first use; `name`
        tells this program's entries from the engine's other programs'; `notes`: a dict the body writes facts of
        its trace into (kept with a stored executable, and restored from it)."""
        self.body = body
        self.store = store
        self.name = name
        self.notes = notes if notes is not None else {}
        # per static key, the executables compiled by hand (to be stored) or read from the store, one per
        # argument signature, most recently used first; jax.jit's own cache serves what is not stored
        self.executables: dict[tuple, list[jax.stages.Compiled]] = {}
        self.constants = dict(constants or {})  # lower/constants.py: passed as the first argument of every call
        self.platform = platform
        self.matmul_precision = matmul_precision
        self.nodes = nodes
        self.donate = donate
        self.static_feeds: set[str] = set()
        self.cache: dict[tuple, Callable] = {}
        self.host_outputs: dict[tuple, dict[str, np.ndarray]] = {}
        self.trace_count = 0
        self.calls = 0  # of the CPU program without static feeds, up to SPLIT_AFTER_CALLS
        # the executable the last call without static feeds ran, once it no longer counts calls: a loop calls
        # one signature again and again, and the full path around it cost more than the launch (`__call__`)
        self.recent: jax.stages.Compiled | None = None
        trim_after_compiles()  # the compiler's freed heap goes back to the system (host_memory.py)

    def count_trace(self) -> None:
        """One more signature prepared; at MANY_SIGNATURES, a warning: each costs a compile (seconds to a minute)
        where a step costs milliseconds, and a loop feeding batches of ever new shapes (text padded to each batch's
        longest) spends its time compiling without a word."""
        self.trace_count += 1
        if self.trace_count == MANY_SIGNATURES:
            warnings.warn(f"onnxtrain's {self.name or 'program'!r} program has now been compiled for "
                          f"{MANY_SIGNATURES} signatures, one per new shape of its feeds (or value of a feed it "
                          "needs as a constant): pad batches to a few shapes, e.g. text to a multiple of 8 tokens, "
                          "so that the compiles stop", stacklevel=2)

    def _compiled(self, static: Mapping[str, Any]) -> tuple[Callable, tuple]:
        key = static_key(static)
        if key not in self.cache:
            self.cache[key] = self._jitted(static, key)
        return self.cache[key], key

    def _jitted(self, static: Mapping[str, Any], key: tuple, name: str = "traced") -> Callable:
        """The body specialised to `static` as a jax.jit function; `name` names its XLA module. The function
        reaches the program through a weak reference: the program keeps it (`cache`), and a reference cycle would
        keep the program's executables and constants after its engine went, until Python's full collection."""
        program = weakref.proxy(self)

        def traced(constants, *arrays):
            try:
                with tracing(program.matmul_precision, program.platform), hoisting(constants):
                    state, outputs = program.body(*arrays, static)
            except Exception as exc:  # jax.jit re-raises this very object
                setattr(exc, RAISED_IN_TRACE, True)
                raise
            program.count_trace()  # counted once complete: a trace that stops to specialise a feed is not one
            host = {n: v for n, v in outputs.items() if host_only(v)}
            program.host_outputs[key] = host
            return state, {n: v for n, v in outputs.items() if n not in host}

        traced.__name__ = traced.__qualname__ = name
        return jax.jit(traced, donate_argnums=tuple(i + 1 for i in self.donate),
                       compiler_options=compiler_options(self.nodes, self.platform) or None)

    def __call__(self, *arrays: Any, feeds: dict[str, Any]) -> Any:
        """`arrays` are positional pytrees; `feeds` is a dict of arrays split here into static and traced."""
        if self.recent is not None and not self.static_feeds:
            try:  # the executable checks the arguments' types and tree before it runs (or donates) anything
                with jax.enable_x64(True):
                    state, outputs = self.recent(self.constants, *arrays, feeds)
            except TypeError:  # another signature, or a host-only feed: the full path below decides
                self.recent = None
            else:
                host = self.host_outputs.get(())
                return state, {**outputs, **host} if host else outputs
        (state, outputs), key = self._specialised(
            lambda fn, key, traced: self._run(fn, key, (self.constants, *arrays, traced)), feeds)
        host = self.host_outputs.get(key)
        return state, {**outputs, **host} if host else outputs

    def lower(self, *arrays: Any, feeds: dict[str, Any]) -> jax.stages.Lowered:
        """What a call with these arguments runs, lowered and not run (donated buffers stay valid)."""
        return self._specialised(lambda fn, key, traced: fn.lower(self.constants, *arrays, traced), feeds)[0]

    def _run(self, fn: Callable, key: tuple, args: tuple) -> Any:
        """`fn(*args)`, through this program's own executables where it has one for `args`' signature (read
        from the store, planned in heaps after SPLIT_AFTER_CALLS calls, or, once calls no longer count, jax.jit's
        own: then `recent` launches it directly, store or not)."""
        known = self.executables.setdefault(key, [])
        if not key and self._counting():
            self.calls += 1
            if self.calls == SPLIT_AFTER_CALLS:
                self._split_heaps(fn, args, known)
        for i, executable in enumerate(known):
            try:
                result = executable(*args)
            except TypeError:  # compiled for another signature (jax checks before it runs anything)
                continue
            known.insert(0, known.pop(i))
            self._remember(key, executable)
            return result
        executable = None if self.store is None or key else self._prepared(key, args)
        if executable is None and (key or self._counting()):  # specialised to static feeds, or still counted
            return fn(*args)
        if executable is None:  # no store: jax.jit's in-memory caches hold the trace and the executable
            executable = fn.lower(*args).compile()
        known.insert(0, executable)
        result = executable(*args)
        self._remember(key, executable)
        return result

    def _remember(self, key: tuple, executable: jax.stages.Compiled) -> None:
        """`executable` serves the next calls directly, where nothing is static and the calls are no longer
        counted (a jax.jit function never does: it would trace a new signature past the static-feed checks)."""
        self.recent = None if key or self._counting() else executable

    def _counting(self) -> bool:
        """Whether calls still count towards the plan in heaps (the CPU's, up to SPLIT_AFTER_CALLS)."""
        return self.platform == "cpu" and self.calls < SPLIT_AFTER_CALLS

    def _split_heaps(self, fn: Callable, args: tuple, known: list[jax.stages.Compiled]) -> None:
        """Put first in `known` the program for `args` compiled with its temporaries in heaps, where its plan in
        one block (the stored executables', else jax.jit's own, which lowering again reads from jax's in-memory
        cache) is larger than malloc reuses."""
        options = split_options(self.nodes)
        if not options:
            return
        lowered = None if known else fn.lower(*args)  # a stored plan says its size without a trace
        if max(temporaries(plan) for plan in known or [lowered.compile()]) <= SPLIT_ABOVE_BYTES:
            return
        lowered = lowered or fn.lower(*args)
        # The plan it replaces goes before the compile, not after: an executable read from the store holds its
        # code and heap (MobileNetV3-small's, ~130 MB), and compiling beside it raised a long run's peak RSS from
        # 404 to 486 MB (420 without it). Should XLA refuse the new plan, `_run` reads the old one again.
        known[:] = [plan for plan in known if plan.args_info != lowered.args_info]
        with jax_cache_unwritten(), xla_warnings_off():  # JAX would try to keep it: XLA cannot serialize it
            try:
                split = lowered.compile(compiler_options=options)
            except jax.errors.JaxRuntimeError:  # a plan XLA cannot make: the one-block plan serves on
                return
        known.insert(0, split)

    def _prepared(self, key: tuple, args: tuple) -> jax.stages.Compiled | None:
        """The executable for `args`' signature: read from the store, else traced, compiled and stored."""
        store = self.store()
        if store is None:  # no cache folder, or an engine over several devices
            self.store = None
            return None
        entry = store.entry(self.name, args)
        loaded = store.load(entry)
        if loaded is not None:
            trim_heap()  # the read's freed memory, as after a compile
            self.count_trace()  # a program prepared, as a trace would have
            self.host_outputs[key] = loaded.host_outputs
            self.notes.update(loaded.notes)
            return loaded.executable
        lowered = self._jitted({}, key, entry.module).lower(*args)
        if not self_contained(lowered):
            return lowered.compile()
        with jax_cache_unwritten():  # the store keeps it
            executable = lowered.compile()
        store.save(entry, executable, self.host_outputs.get(key, {}), self.notes)
        # serializing leaves its working memory as free heap, which the step's temporaries (mapped blocks of their
        # own) do not reuse: MobileNetV3-small's first-run peak 477 -> 424 MB (the compile's, now)
        trim_heap()
        return executable

    def _specialised(self, use: Callable[[Callable, tuple, dict], Any],
                     feeds: dict[str, Any]) -> tuple[Any, tuple]:
        """`use(jitted, cache key, traced feeds)` and the cache key, the jitted program specialised to the values
        of the feeds that must be static (found, with a warning, by the first trace that needs them)."""
        while True:
            static = {n: as_static(v) for n, v in feeds.items() if n in self.static_feeds or host_only(v)}
            # the common case costs no copy: nothing static (this runs on every call)
            traced = {n: v for n, v in feeds.items() if n not in static} if static else feeds
            try:
                with jax.enable_x64(True):
                    fn, key = self._compiled(static)
                    return use(fn, key, traced), key
            except StaticValueRequired as exc:
                culprits = self.culprits(exc, traced)
                if not culprits:
                    raise
                warnings.warn(
                    f"{exc.node}: input {exc.what!r} depends on feed(s) {sorted(culprits)}; "
                    f"they are compiled in as constants, one compilation per distinct value",
                    stacklevel=3,
                )
                self.static_feeds |= culprits

    def culprits(self, exc: StaticValueRequired, traced: Mapping[str, Any]) -> set[str]:
        candidates = set(traced)
        if exc.value_name is not None:
            found = graph_inputs_feeding(exc.value_name, self.nodes, candidates)
            if found:
                return found
        # Raised inside a function body or subgraph: we cannot trace the dependency, so freeze every feed.
        return candidates
