"""Host memory (onnxtrain/host_memory.py), each in a fresh process (the settings are the whole process's and must
come before its threads allocate). retain_freed_memory: a compiled program's temporaries are reused from step to
step instead of being faulted in anew (counted, not timed: the process's minor page faults per call). Otherwise
the heap's free pages go back to the system after each compile (resident memory, read from /proc). And in this
process: a long run's program is planned with its temporaries in heaps malloc reuses (program.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import onnx
import pytest
from jax.experimental import serialize_executable
from onnx import TensorProto, helper, numpy_helper

import onnxtrain
from onnxtrain import host_memory, program

PROGRAM = """
import resource, sys
if sys.argv[1] == "retain":
    import onnxtrain
    assert onnxtrain.retain_freed_memory()
import jax, jax.numpy as jnp, numpy as np
step = jax.jit(lambda x: (lambda y: y.sum(0) + y.max(0))(x @ x.T))  # y, 4096 x 4096, is a 64 MB temporary
x = jnp.asarray(np.random.default_rng(0).standard_normal((4096, 512), np.float32))
step(x).block_until_ready(); step(x).block_until_ready()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    step(x).block_until_ready()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 5)
"""

# 200 MB of the heap freed between blocks that stay (as a compiler leaves it), then a model loaded and run
TRIM_PROGRAM = """
import ctypes, sys
import numpy as np
from onnx import TensorProto, helper
import onnxtrain
from onnxtrain import host_memory
if sys.argv[1] == "retain":
    assert onnxtrain.retain_freed_memory()
# this small model compiles in less than the 0.1 s that a real one takes; "store-only": no trim after compiles
host_memory.TRIM_AFTER_SECONDS = float("inf") if sys.argv[1] == "store-only" else 0.0
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
blocks = [libc.malloc(100_000) for _ in range(4000)]  # below glibc's mapping threshold: from the heap
for block in blocks:
    ctypes.memset(block, 1, 100_000)
for block in blocks[::2]:  # every other one: each freed block lies between two that stay
    libc.free(block)

def resident_mb():
    status = open("/proc/self/status").read()
    return int(status.split("VmRSS:")[1].split()[0]) / 1024

before = resident_mb()
graph = helper.make_graph([helper.make_node("Add", ["X", "X"], ["Y"])], "add",
                          [helper.make_tensor_value_info("X", TensorProto.FLOAT, [4])],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [4])])
y = onnxtrain.load(helper.make_model(graph)).infer({"X": np.ones(4, np.float32)})["Y"]
assert np.asarray(y).tolist() == [2.0] * 4
print(before - resident_mb())
"""

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")


def printed(program: str, mode: str, cache: Path | None = None, environment: dict | None = None) -> float:
    """The number `program` prints last, run in a fresh process with `mode` ("plain" or "retain"), the
    persistent caches in `cache` (None: the default folder) and `environment` (None: this process's)."""
    env = {**(environment or os.environ), **({"ONNXTRAIN_CACHE_DIR": str(cache)} if cache else {})}
    done = subprocess.run([sys.executable, "-c", program, mode], capture_output=True, text=True, timeout=300,
                          env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    return float(done.stdout.split()[-1])


def test_a_programs_temporaries_are_not_faulted_in_at_every_call():
    huge_pages = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if huge_pages.exists() and "[always]" in huge_pages.read_text():
        pytest.skip("transparent huge pages for every mapping: a fresh block costs a few faults, not one a page")
    plain, retained = printed(PROGRAM, "plain"), printed(PROGRAM, "retain")  # page faults per call
    assert plain > 16384, f"expected the 64 MB temporary's 16,384 pages faulted in at every call, saw {plain}"
    assert retained < plain / 20, (plain, retained)


def test_malloc_in_huge_pages_faults_a_programs_temporaries_in_2_mb_at_a_time():
    """What `onnxtrain train` starts itself with (host_memory.with_huge_pages): the same 64 MB temporary, mapped
    afresh at every call, in transparent huge pages (on the 2-core VM 20,500 -> 4,100-4,600 faults a call)."""
    plain_environment = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    huge = host_memory.with_huge_pages(plain_environment)
    if huge is None or "[always]" in host_memory.TRANSPARENT_HUGE_PAGES.read_text():
        pytest.skip("not glibc 2.35 or later, or transparent huge pages never or for every mapping")
    plain, in_huge_pages = (printed(PROGRAM, "plain", environment=e) for e in (plain_environment, huge))
    assert in_huge_pages < plain / 3, (plain, in_huge_pages)


def test_the_heaps_free_pages_go_back_to_the_system_after_a_compile_unless_retained(tmp_path):
    """The 200 MB freed inside the heap stay resident on their own (glibc trims only its top), and after a
    compile, or a read of the compiled program from the store of an earlier process, the process holds them no
    more; a process that retains freed memory keeps them."""
    for _ in ("compiled", "read from the store"):
        assert printed(TRIM_PROGRAM, "plain", tmp_path) > 120  # MB released, less what the model took
    assert printed(TRIM_PROGRAM, "retain") < 50


def test_the_heaps_free_pages_go_back_to_the_system_after_the_store_writes_a_program(tmp_path):
    """Serializing a program for the store leaves free heap as a compile does (MobileNetV3-small's first step
    peaked 53 MB higher for it): with no trim after compiles, writing the program to the store trims."""
    assert printed(TRIM_PROGRAM, "store-only", tmp_path) > 120



LAYERS, FEATURES, LR = 8, 128, 0.5


def deep_tanh_mlp(weights: list[np.ndarray]) -> onnx.ModelProto:
    """h_{i+1} = Tanh(h_i W_i), SGD on the mean squared error: a step keeps every layer's activations for the
    backward pass, at batch 8192 eight [8192, 128] arrays and their gradients, 36 MiB of temporaries in all."""
    nodes = [node for i in range(LAYERS) for node in (helper.make_node("MatMul", [f"h{i}", f"W{i}"], [f"p{i}"]),
                                                       helper.make_node("Tanh", [f"p{i}"], [f"h{i + 1}"]))]
    graph = helper.make_graph(
        nodes, "deep", [helper.make_tensor_value_info("h0", TensorProto.FLOAT, ["N", FEATURES])],
        [helper.make_tensor_value_info(f"h{LAYERS}", TensorProto.FLOAT, ["N", FEATURES])],
        [numpy_helper.from_array(w, f"W{i}") for i, w in enumerate(weights)])
    return onnxtrain.make_trainable(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]),
                                    loss="mse", optimizer="sgd", learning_rate=LR)


def numpy_sgd(weights: list[np.ndarray], x: np.ndarray, t: np.ndarray, steps: int) -> list[np.ndarray]:
    ws = [w.astype(np.float64) for w in weights]
    for _ in range(steps):
        hs = [x.astype(np.float64)]
        for w in ws:
            hs.append(np.tanh(hs[-1] @ w))
        g = 2 / t.size * (hs[-1] - t)  # d mean((h_L - T)^2) / d h_L
        for i in reversed(range(LAYERS)):
            g = g * (1 - hs[i + 1] ** 2)  # through Tanh
            g, ws[i] = g @ ws[i].T, ws[i] - LR * hs[i].T @ g
    return ws


def random_deep_mlp(batch: int) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """(weights, X, T)"""
    rng = np.random.default_rng(0)
    weights = [(rng.standard_normal((FEATURES, FEATURES)) / np.sqrt(FEATURES)).astype(np.float32)
               for _ in range(LAYERS)]
    x = rng.standard_normal((batch, FEATURES)).astype(np.float32)
    return weights, x, np.tanh(x)


@pytest.mark.parametrize("batch", [8192, 1024])
def test_a_long_run_plans_big_temporaries_in_heaps_with_the_same_numbers(monkeypatch, batch: int):
    """After SPLIT_AFTER_CALLS calls (3 here), a program whose temporaries are more than malloc reuses
    (SPLIT_ABOVE_BYTES: batch 8192, not 1024) is compiled again with them in heaps of 16 MiB (program.py). The
    program in use is then one XLA cannot serialize (its plan has several temporary blocks); its numbers are
    NumPy's SGD, and bit for bit those of the one-block plan."""
    weights, x, t = random_deep_mlp(batch)
    feeds = {"h0": jax.device_put(x), "target": jax.device_put(t)}
    steps = 5

    def trained(split_after: int) -> tuple[list[np.ndarray], list]:
        monkeypatch.setattr(program, "SPLIT_AFTER_CALLS", split_after)
        engine = onnxtrain.load(deep_tanh_mlp(weights))
        for _ in range(steps):
            engine.train_step(feeds)
        return [np.asarray(engine.state[f"W{i}"]) for i in range(LAYERS)], engine._train[0].executables[()]

    split, executables = trained(3)
    if batch > 1024:
        with pytest.raises(jax.errors.JaxRuntimeError, match="Multiple temp buffer"):
            serialize_executable.serialize(executables[0])
        assert len(executables) == 1  # the one-block plan it replaced is not kept
    else:
        for executable in executables:
            serialize_executable.serialize(executable)
    for w, reference in zip(split, numpy_sgd(weights, x, t, steps)):
        np.testing.assert_allclose(w, reference, rtol=1e-4, atol=1e-5)
    one_block, _ = trained(10**9)
    for w, same in zip(split, one_block):
        np.testing.assert_array_equal(w, same)


def three_steps_switching_at_the_second(monkeypatch) -> tuple[onnxtrain.Engine, list, np.ndarray, np.ndarray]:
    """(engine, weights, X, T) after three steps of the deep MLP at batch 8192, its program switching at the
    second."""
    monkeypatch.setattr(program, "SPLIT_AFTER_CALLS", 2)
    weights, x, t = random_deep_mlp(8192)
    engine = onnxtrain.load(deep_tanh_mlp(weights))
    for _ in range(3):
        engine.train_step({"h0": x, "target": t})
    return engine, weights, x, t


def test_a_plan_in_heaps_that_xla_refuses_leaves_the_run_on_its_one_block_plan(monkeypatch):
    """The second plan is an optimisation: where XLA refuses to compile it (here, an option value it cannot
    parse), the step runs on its one-block plan (read from the store again where there is one), with NumPy's
    numbers."""
    known = program.known_options

    def refused(options: dict) -> dict:
        return {k: "many" for k in options} if options is program.SPLIT_HEAPS else known(options)

    monkeypatch.setattr(program, "known_options", refused)
    engine, weights, x, t = three_steps_switching_at_the_second(monkeypatch)
    for executable in engine._train[0].executables[()]:
        serialize_executable.serialize(executable)  # one block: serializable
    for i, reference in enumerate(numpy_sgd(weights, x, t, 3)):
        np.testing.assert_allclose(np.asarray(engine.state[f"W{i}"]), reference, rtol=1e-4, atol=1e-5)


def test_the_plan_in_heaps_compiles_after_the_one_block_plan_is_let_go(monkeypatch):
    """A long run's peak memory: an executable read from the store holds its code and heap (MobileNetV3-small's
    ~130 MB), so a program lets its one-block plan go before compiling the plan in heaps, not after."""
    monkeypatch.setattr(program, "SPLIT_AFTER_CALLS", 2)
    weights, x, t = random_deep_mlp(8192)
    engine = onnxtrain.load(deep_tanh_mlp(weights))
    engine.train_step({"h0": x, "target": t})
    known = engine._train[0].executables[()]
    if not known:
        pytest.skip("no store of compiled programs in this process (ONNXTRAIN_CACHE_DIR is empty)")
    program.known_options(program.SPLIT_HEAPS)  # its probe compiles a scalar program with the option: not counted
    held_at_compile = []
    compile_ = jax.stages.Lowered.compile

    def compile(lowered, compiler_options=None):
        if compiler_options and set(program.SPLIT_HEAPS) <= set(compiler_options):
            held_at_compile.append(len(known))
        return compile_(lowered, compiler_options=compiler_options)

    monkeypatch.setattr(jax.stages.Lowered, "compile", compile)
    for _ in range(2):
        engine.train_step({"h0": x, "target": t})
    assert held_at_compile == [0]
    assert len(known) == 1 and program.temporaries(known[0]) > 0
    with pytest.raises(jax.errors.JaxRuntimeError, match="Multiple temp buffer"):
        serialize_executable.serialize(known[0])
    for i, reference in enumerate(numpy_sgd(weights, x, t, 3)):
        np.testing.assert_allclose(np.asarray(engine.state[f"W{i}"]), reference, rtol=1e-4, atol=1e-5)


@pytest.mark.filterwarnings("ignore:Error writing persistent compilation cache entry")  # the plan outside
def test_xlas_warnings_about_the_plan_in_heaps_stay_off_the_users_output(monkeypatch, capfd):
    """Planning in heaps smaller than some temporaries, XLA warns once for each such buffer; the engine keeps
    those lines off stderr, and XLA's warnings show again after."""
    if program.process_log_level() > program.ABSL_LEVELS["WARNING"]:
        pytest.skip("XLA's warnings are off in this process anyway")
    small_heaps = {"xla_multiheap_size_constraint_per_heap": 1 << 20}  # below the model's 4 MiB activations
    monkeypatch.setattr(program, "SPLIT_HEAPS", small_heaps)
    _, weights, x, _ = three_steps_switching_at_the_second(monkeypatch)
    assert "per-heap size limit" not in capfd.readouterr().err

    def two_layers(a, w):  # the same kind of plan, outside the engine: two 4 MiB temporaries
        h = jax.numpy.tanh(a @ w)
        return (jax.numpy.tanh(h @ w) * h).sum() + (h @ w.T).sum()

    jax.jit(two_layers).lower(x, weights[0]).compile(compiler_options=small_heaps)
    assert "per-heap size limit" in capfd.readouterr().err


def two_convolutions() -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """Y = Conv(Relu(Conv(X, W1) + B1), W2), 3x3 over 64 channels at 16x16 (stride 1 over few channels, so each
    stays XLA's own convolution, onnxtrain/lower/ops/conv.py; YNNPACK leaves those over 16 channels to Eigen),
    trained with SGD on the mean squared error; and its weights."""
    rng = np.random.default_rng(3)
    weights = {"W1": rng.standard_normal((64, 64, 3, 3)).astype(np.float32) * 0.05,
               "B1": rng.standard_normal(64).astype(np.float32) * 0.1,
               "W2": rng.standard_normal((64, 64, 3, 3)).astype(np.float32) * 0.05}
    graph = helper.make_graph(
        [helper.make_node("Conv", ["X", "W1", "B1"], ["a"], pads=[1, 1, 1, 1]), helper.make_node("Relu", ["a"], ["r"]),
         helper.make_node("Conv", ["r", "W2"], ["Y"], pads=[1, 1, 1, 1])], "convs",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 64, 16, 16])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", 64, 16, 16])],
        [numpy_helper.from_array(v, k) for k, v in weights.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return onnxtrain.make_trainable(model, loss="mse", optimizer="sgd", learning_rate=LR), weights


def test_a_convolution_program_planned_in_heaps_runs_ynnpacks_convolutions_with_pytorchs_numbers(monkeypatch):
    """The plan in heaps of a program with convolutions is compiled with YNNPACK's convolution fusion (program.py,
    YNNPACK_WITH_CONVOLUTION), where the one-block plan runs Eigen's convolution: the option reaches the compile
    (no convolution is left outside a library fusion), and the trained weights are PyTorch's SGD's."""
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(program, "SPLIT_AFTER_CALLS", 2)
    monkeypatch.setattr(program, "SPLIT_ABOVE_BYTES", 0)  # this small program is split too
    model, weights = two_convolutions()
    engine = onnxtrain.load(model)
    rng = np.random.default_rng(4)
    x, t = (rng.standard_normal((2, 64, 16, 16)).astype(np.float32) for _ in range(2))
    one_block = engine.lower({"X": x, "target": t}, algorithm=0).compile().as_text()
    steps = 4
    for _ in range(steps):
        engine.train_step({"X": x, "target": t})
    known = engine._train[0].executables[()]
    if not known:
        pytest.skip("no store of compiled programs in this process (ONNXTRAIN_CACHE_DIR is empty)")

    def top_level_convolutions(text: str) -> int:
        entry = text[text.index("\nENTRY"):]
        return entry.count(" convolution(")

    assert top_level_convolutions(one_block) > 0 and top_level_convolutions(known[0].as_text()) == 0
    params = {k: torch.tensor(v, requires_grad=True) for k, v in weights.items()}
    tx, tt = torch.from_numpy(x), torch.from_numpy(t)
    for _ in range(steps):
        a = torch.nn.functional.conv2d(tx, params["W1"], params["B1"], padding=1)
        y = torch.nn.functional.conv2d(torch.relu(a), params["W2"], padding=1)
        loss = torch.mean((y - tt) ** 2)
        for p in params.values():
            p.grad = None
        loss.backward()
        with torch.no_grad():
            for p in params.values():
                p -= LR * p.grad
    for name, p in params.items():
        np.testing.assert_allclose(np.asarray(engine.state[name]), p.detach().numpy(), rtol=1e-4, atol=1e-6)
