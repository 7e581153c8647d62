"""A train step that fails while it runs (here: out of memory on a batch too large), or before it runs because JAX
cannot lower its program, leaves the state as it was."""

from __future__ import annotations

import dataclasses
import json
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Callable

import jax
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxtrain
import onnxtrain.engine
from onnxtrain.errors import StepError
from onnxtrain.lower import registry
from training_models import matmul_sgd

EXAMPLE = Path(onnxtrain.__file__).parent / "examples"

# Run in a child process whose address space is capped just above what it uses after a small step: the big
# batch's program (compiled before the cap, so only its run needs memory) cannot allocate its temporaries.
CHILD = """
import json, resource, sys
import numpy as np
import onnxtrain
import onnxtrain.engine
from onnxtrain.errors import StepError

engine = onnxtrain.load(sys.argv[1], seed=0)
engine.init()
small = {k: v[:8] for k, v in np.load(sys.argv[2]).items()}
for _ in range(int(sys.argv[4])):
    engine.train_step(small)
before = {n: np.array(v) for n, v in engine.state.items()}
rows = 4_000_000  # each hidden activation of the batch: 4e6 x 32 float32 = 512 MB
huge = {"X": np.ones((rows, 2), np.float32), "target": np.ones((rows, 1), np.float32)}
engine.lower(huge, algorithm=0).compile()
size = int(next(l for l in open("/proc/self/status") if l.startswith("VmSize")).split()[1]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (size + 256 * 2**20,) * 2)
try:
    engine.train_step(huge)
    error = None
except StepError as exc:
    error = str(exc)
unchanged = all(np.array_equal(np.asarray(engine.state[n]), v) for n, v in before.items())
engine.export(sys.argv[3])
engine.train_step(small)
print(json.dumps({"error": error, "unchanged": unchanged, "steps": engine.step_count}))
"""


# 2 steps before: the failing step runs on a copy of the state. None: no step has changed the state since init,
# so the step runs on the state itself and the engine rebuilds it (init again) when the failure took it.
@pytest.mark.parametrize("steps_before", [2, 0])
def test_an_out_of_memory_step_leaves_the_state_and_training_goes_on(tmp_path, steps_before):
    out = tmp_path / "after.onnx"
    env = {"MALLOC_ARENA_MAX": "2", "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(Path(onnxtrain.__file__).parents[1]),
           "ONNXTRAIN_CACHE_DIR": ""}
    result = subprocess.run([sys.executable, "-c", CHILD, EXAMPLE / "regression.onnx", EXAMPLE / "regression.npz",
                             out, str(steps_before)], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.splitlines()[-1])
    assert report["error"], report
    failed = steps_before + 1
    assert f"train step {failed} (algorithm 0) failed while running (the state is as before it)" in report["error"]
    assert "RESOURCE_EXHAUSTED" in report["error"]
    assert report["unchanged"] and report["steps"] == failed
    # the export after the failure holds the state before the failed step, as a run without it has it
    exported = onnx.load(out)
    assert {p.key: p.value for p in exported.metadata_props}.get("onnxtrain.step", "0") == str(steps_before)
    reference = onnxtrain.load(EXAMPLE / "regression.onnx", seed=0)
    reference.init()
    small = {k: v[:8] for k, v in np.load(EXAMPLE / "regression.npz").items()}
    for _ in range(steps_before):
        reference.train_step(small)
    saved = {t.name: numpy_helper.to_array(t) for g in [exported.graph] + [i.algorithm for i in exported.training_info]
             for t in g.initializer}
    for name, value in reference.state.items():
        np.testing.assert_array_equal(saved[name], np.asarray(value), err_msg=name)


def interrupted_as_the_step_returns(engine: onnxtrain.Engine) -> None:
    """Make train step 0's program send this process SIGINT as its launch returns: Python runs the handler at the
    next instruction, as it does for a Ctrl-C that arrived while the step ran (where it lands nearly always)."""
    program = engine._train[0]

    def launch_then_interrupt(*args, **kwargs):
        result = program(*args, **kwargs)
        signal.raise_signal(signal.SIGINT)
        return result

    engine._train[0] = launch_then_interrupt


@pytest.fixture
def ctrl_c():
    """Python's Ctrl-C handler, as a terminal's Ctrl-C finds it. A test session started as a background job (CI's)
    has SIGINT ignored, as POSIX has a shell's background jobs: Python then installs no handler, and these tests
    had been skipped there. KeyboardInterrupt is raised in the main thread only."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("Ctrl-C's KeyboardInterrupt is raised in the main thread")
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


# 2 steps before: the step donates the state, so the interrupt waits until the engine holds the step's result.
# 0: the first step after init is not held back (it may compile for minutes): the state is rebuilt as init made it.
@pytest.mark.usefixtures("ctrl_c")
@pytest.mark.parametrize("steps_before", [2, 0])
def test_ctrl_c_during_a_step_leaves_a_whole_state(steps_before):
    small = {k: v[:8] for k, v in np.load(EXAMPLE / "regression.npz").items()}
    engine = onnxtrain.load(EXAMPLE / "regression.onnx", seed=0)
    engine.init()
    for _ in range(steps_before):
        engine.train_step(small)
    interrupted_as_the_step_returns(engine)
    with pytest.raises(KeyboardInterrupt):
        engine.train_step(small)
    taken = steps_before + 1 if steps_before else 0  # a held step completes; a first one is undone
    assert engine.step_count == taken
    reference = onnxtrain.load(EXAMPLE / "regression.onnx", seed=0)  # the same steps, uninterrupted
    reference.init()
    for _ in range(taken):
        reference.train_step(small)
    for name, value in reference.state.items():
        np.testing.assert_array_equal(np.asarray(engine.state[name]), np.asarray(value), err_msg=name)


def interrupted_at(instruction: int, call: Callable[[], None], functions: set[str]) -> bool:
    """Run `call`, sending this process SIGINT at its `instruction`-th bytecode instruction run in these functions
    of onnxtrain's engine.py (the handler runs where Python next checks for signals, as for a Ctrl-C that arrived
    there); whether the call ran that many. A KeyboardInterrupt is the call's end."""
    engine_py = onnxtrain.engine.__file__
    count = 0

    def per_instruction(frame, event, arg):
        nonlocal count
        if event == "opcode":
            count += 1
            if count == instruction:
                signal.raise_signal(signal.SIGINT)
        return per_instruction

    def per_call(frame, event, arg):
        if frame.f_code.co_filename != engine_py or frame.f_code.co_name not in functions:
            return None
        frame.f_trace_opcodes = True
        return per_instruction

    sys.settrace(per_call)
    try:
        call()
    except KeyboardInterrupt:
        pass
    finally:
        sys.settrace(None)
    return count >= instruction


# what load_state, reset and init run in engine.py, besides themselves (not their comprehensions, which build values)
STATE_CHANGES = {"reset", "_put_stored_state", "_stored_state", "_assign", "__enter__", "__exit__", "__call__"}


# load_state, reset and init assign a new state and its step count: a Ctrl-C between the two had left the new state
# with the old count (load_state: the state of step 3, counted 1), which a checkpoint then recorded
@pytest.mark.usefixtures("ctrl_c")
@pytest.mark.parametrize("call", ["load_state", "reset", "init"])
def test_ctrl_c_anywhere_in_a_state_change_leaves_the_engine_old_or_new_never_both(tmp_path, call):
    small = {k: v[:8] for k, v in np.load(EXAMPLE / "regression.npz").items()}

    def trained(steps: int) -> onnxtrain.Engine:
        engine = onnxtrain.load(EXAMPLE / "regression.onnx", seed=0)
        engine.init()
        for _ in range(steps):
            engine.train_step(small)
        return engine

    trained(3).save_state(tmp_path / "new.npz")
    engine = trained(1)
    engine.save_state(tmp_path / "old.npz")
    old = (1, {name: np.array(value) for name, value in engine.state.items()})
    reference = onnxtrain.load(EXAMPLE / "regression.onnx", seed=0)  # what the call makes, uninterrupted
    if call == "load_state":
        reference.load_state(tmp_path / "new.npz")
    elif call == "init":
        reference.init()
    new = (reference.step_count, {name: np.array(value) for name, value in reference.state.items()})
    assert not all(np.array_equal(old[1][name], new[1][name]) for name in old[1])
    change = {"load_state": lambda: engine.load_state(tmp_path / "new.npz"), "reset": engine.reset,
              "init": engine.init}[call]
    instruction = 0
    outcomes = set()
    while True:
        instruction += 1
        engine.load_state(tmp_path / "old.npz")
        interrupted = interrupted_at(instruction, change, {call, *STATE_CHANGES})
        count, state = engine.step_count, {name: np.array(value) for name, value in engine.state.items()}
        is_old, is_new = ((count == c and all(np.array_equal(state[n], v[n]) for n in v)) for c, v in (old, new))
        assert is_old or is_new, f"interrupted at instruction {instruction}: step count {count}, state neither"
        outcomes.add("old" if is_old else "new")
        if not interrupted:
            break
    assert outcomes == {"old", "new"}  # interrupts landed before the change and after it


def test_a_save_after_a_step_lost_the_state_names_it_and_load_state_restores(tmp_path):
    """A later step (its shapes run before) donates the state; failing while it runs (the device failing) takes the
    state with it, as its StepError says. A save then raised JAX's 'Array has been deleted'; it is a StateError
    saying what happened, the checkpoint on disk untouched, and load_state of it trains on as a fresh load would."""
    from onnxtrain.errors import StateError

    engine = onnxtrain.load(matmul_sgd(0.1))
    x = np.array([[1.0, 2.0], [3.0, -1.0]], np.float32)
    feeds = {"X": x, "target": x @ np.array([[1.0], [-3.0]], np.float32)}
    engine.train_step(feeds)
    engine.export(tmp_path / "ckpt.onnx")
    engine.save_state(tmp_path / "ckpt.npz")
    saved = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    program = engine._train[0]

    def fails_while_running(carry, *args, **kwargs):  # what XLA leaves: the donated buffers deleted, an error
        jax.tree.map(lambda value: value.delete(), carry)
        raise jax.errors.JaxRuntimeError("INTERNAL: the device failed (simulated)")

    engine._train[0] = fails_while_running
    with pytest.raises(StepError, match=r"train step 2 \(algorithm 0\) failed while running \(the state was donated "
                                        r"to it and is lost\): INTERNAL: the device failed"):
        engine.train_step(feeds)
    for save, path in ((engine.save_state, "ckpt.npz"), (engine.export, "ckpt.onnx")):
        with pytest.raises(StateError, match=rf"cannot {save.__name__}: the engine's state \('W'\) was lost with a "
                                             r"train step that failed while running"):
            save(tmp_path / path)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == saved
    engine._train[0] = program
    engine.load_state(tmp_path / "ckpt.onnx")
    engine.train_step(feeds)
    reference = onnxtrain.load(tmp_path / "ckpt.onnx")
    reference.train_step(feeds)
    assert engine.step_count == reference.step_count == 2
    for name, value in reference.state.items():
        np.testing.assert_array_equal(np.asarray(engine.state[name]), np.asarray(value), err_msg=name)


def test_a_program_jax_cannot_lower_is_a_step_error_and_the_state_stays(monkeypatch):
    """JAX refusing to lower a step's program (here a primitive whose MLIR lowering rule raises ValueError, as a rule
    refuses operands its platform cannot compute, while `refuse` holds a message) is a StepError naming the step,
    JAX's error its __cause__ (it had come out of train_step and infer as it was); nothing ran, and once the
    program lowers, training goes on from the state before the failure: NumPy's SGD steps."""
    from jax.extend.core import Primitive
    from jax.interpreters import ad, mlir

    refuse: list[str] = []

    def lowering(ctx, x):
        if refuse:
            raise ValueError(refuse[0])
        return [x]

    identity = Primitive("onnxtrain_test_identity")  # an identity that XLA sees only through `lowering`
    identity.def_abstract_eval(lambda x: x)
    identity.def_impl(lambda x: x)
    ad.deflinear2(identity, lambda ct, x: [ct])
    mlir.register_lowering(identity, lowering)
    key = ("", "MatMul", 13)
    matmul = registry.lookup(*key)
    monkeypatch.setitem(registry._REGISTRY, key,
                        dataclasses.replace(matmul, fn=lambda a, b: identity.bind(matmul.fn(a, b))))
    engine = onnxtrain.load(matmul_sgd(0.1))
    for program in (engine._infer, engine._train[0]):
        program.store = lambda: None  # traced and lowered here, not read from an earlier process's store
    rng = np.random.default_rng(0)

    def batch(rows: int) -> dict[str, np.ndarray]:
        x = rng.normal(size=(rows, 2)).astype(np.float32)
        return {"X": x, "target": (x @ np.array([[1.0], [-3.0]])).astype(np.float32)}

    def sgd(w: np.ndarray, feeds: dict[str, np.ndarray]) -> np.ndarray:
        x, t = feeds["X"], feeds["target"]
        return w - 0.1 * x.T @ (2 * (x @ w - t) / t.size)

    w = np.zeros((2, 1))
    for _ in range(2):
        feeds = batch(4)
        engine.train_step(feeds)
        w = sgd(w, feeds)
    refuse.append("this platform cannot lower it")
    feeds = batch(8)  # new shapes: a new program to lower
    with pytest.raises(StepError, match=r"^train step 3 \(algorithm 0\) failed before it ran: JAX could not lower or "
                       r"compile its program \(the state is as before it\): ValueError: this platform cannot") as failed:
        engine.train_step(feeds)
    assert isinstance(failed.value.__cause__, ValueError)
    assert engine.step_count == 2
    np.testing.assert_allclose(np.asarray(engine.state["W"]), w, rtol=1e-5)
    with pytest.raises(StepError, match=r"^infer failed before it ran: .*ValueError: this platform cannot") as failed:
        engine.infer({"X": feeds["X"]})
    assert isinstance(failed.value.__cause__, ValueError)
    refuse.clear()
    engine.train_step(feeds)
    w = sgd(w, feeds)
    assert engine.step_count == 3
    np.testing.assert_allclose(np.asarray(engine.state["W"]), w, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(engine.infer({"X": feeds["X"]})["Y"]), feeds["X"] @ w, rtol=1e-5)


def test_a_type_error_of_onnxtrain_in_the_trace_comes_out_as_itself(monkeypatch):
    """A TypeError raised while a program is traced, outside any node (the walker makes a node's a NodeError), is a
    bug of onnxtrain's, not the model's program failing to lower: train_step and infer raise it as itself (it had
    been a StepError blaming JAX's lowering); nothing ran, so the state is as before and training goes on."""
    import onnxtrain.steps

    engine = onnxtrain.load(matmul_sgd(0.1))
    for program in (engine._infer, engine._train[0]):
        program.store = lambda: None  # traced here, not read from an earlier process's store
    x = np.array([[1.0, 2.0], [3.0, -1.0]], np.float32)
    feeds = {"X": x, "target": x @ np.array([[1.0], [-3.0]], np.float32)}
    bug = TypeError("a bug of onnxtrain's")

    def check_outputs(*args):
        raise bug

    real_check_outputs = onnxtrain.steps.check_outputs
    monkeypatch.setattr(onnxtrain.steps, "check_outputs", check_outputs)
    for call in (lambda: engine.train_step(feeds), lambda: engine.infer({"X": x})):
        with pytest.raises(TypeError) as raised:
            call()
        assert raised.value is bug
    assert engine.step_count == 0
    np.testing.assert_array_equal(np.asarray(engine.state["W"]), np.zeros((2, 1)))
    monkeypatch.setattr(onnxtrain.steps, "check_outputs", real_check_outputs)
    engine.train_step(feeds)
    w = 0.1 * x.T @ (2 * feeds["target"] / feeds["target"].size)  # SGD's first step from W = 0 on the MSE
    assert engine.step_count == 1
    np.testing.assert_allclose(np.asarray(engine.state["W"]), w, rtol=1e-5)


def test_an_infer_that_runs_out_of_memory_is_a_step_error():
    """A Tile to float32[2**44, 3] (192 TiB: under the 2**48 bytes a value may have, lower/walker.py, past any
    address space) fails to allocate when it runs: infer had let JAX's JaxRuntimeError out, not a StepError."""
    graph = helper.make_graph(
        [helper.make_node("Tile", ["x", "repeats"], ["y"])], "tile",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 3])],
        [numpy_helper.from_array(np.array([2**43, 1], np.int64), "repeats")])
    engine = onnxtrain.load(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    with pytest.raises(StepError, match=r"^infer failed while running \(the state is unchanged\): ") as failed:
        engine.infer({"x": np.ones((2, 3), np.float32)})
    assert isinstance(failed.value.__cause__, jax.errors.JaxRuntimeError)
