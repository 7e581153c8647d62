"""The store of compiled programs (onnxtrain/executables.py): a later process runs a stored train step without
tracing the graph, with the numbers a traced step gives, and never runs a program stored for another model,
option or feed signature. Each process here is a fresh one, as a user's next run is."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import helper

from training_models import linear_regression, tensor

# One process of a user's: load the model, run train steps, report the state, how many times one of the engine's
# programs was traced (JAX's trace events name the traced function), and the store's files.
CHILD = """
import json, os, sys
import jax, numpy as np
import onnxtrain
if "OTHER_VERSION" in os.environ:  # another onnxtrain: the store's entries are keyed on its sources
    import onnxtrain.executables
    onnxtrain.executables.source_digest = lambda: os.environ["OTHER_VERSION"].encode()
if "SERIALIZE_FAILS" in os.environ:  # XLA refuses to serialize the executable, as XLA-CPU does some
    import onnxtrain.executables

    def refuse(executable):
        raise jax.errors.JaxRuntimeError(os.environ["SERIALIZE_FAILS"])
    onnxtrain.executables.serialize_executable.serialize = refuse

if "NO_THRESHOLD" in os.environ:  # a JAX whose internals moved: compiles cannot be kept out of JAX's cache
    import onnxtrain.engine, onnxtrain.executables
    onnxtrain.engine.COMPILE_TIME_THRESHOLD = onnxtrain.executables.COMPILE_TIME_THRESHOLD = None

traces = []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, secs, fun_name="", **_: traces.append(fun_name)
    if event == "/jax/core/compile/jaxpr_trace_duration" and fun_name.startswith(("traced", "onnxtrain_")) else None)
path, rows, steps, options = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
engine = onnxtrain.load(path, **options)
rng = np.random.default_rng(0)
feeds = {"X": rng.standard_normal((rows, 3), np.float32), "T": rng.standard_normal((rows, 2), np.float32)}
for _ in range(steps):
    engine.train_step(feeds)
inferred = np.asarray(engine.infer({"X": feeds["X"]})["Y"]).tolist()
if len(sys.argv) > 5:
    engine.export(sys.argv[5])
print(json.dumps({"W": np.asarray(engine.state["W"]).tolist(), "B": np.asarray(engine.state["B"]).tolist(),
                  "infer": inferred, "traces": len(traces)}))
"""

W0 = np.arange(6, dtype=np.float32).reshape(3, 2) / 10
B0 = np.array([0.5, -0.5], np.float32)


def environment(cache: Path | None) -> dict[str, str]:
    """A child process's: the persistent caches in `cache` (None: off), on the CPU."""
    return {**os.environ, "ONNXTRAIN_CACHE_DIR": str(cache or ""), "JAX_PLATFORMS": "cpu"}


def run(path: Path, cache: Path | None, rows: int = 4, steps: int = 3, export: Path | None = None,
        version: str | None = None, serialize_error: str | None = None, no_threshold: bool = False,
        **options) -> dict:
    """CHILD's report; `cache` None: the persistent caches off; `export`: where the trained model goes;
    `version`: as if another version of onnxtrain ran; `serialize_error`: XLA's error for every serialization;
    `no_threshold`: as if JAX's internals had moved (executables.COMPILE_TIME_THRESHOLD)."""
    env = {**environment(cache), **({"OTHER_VERSION": version} if version else {}),
           **({"SERIALIZE_FAILS": serialize_error} if serialize_error else {}),
           **({"NO_THRESHOLD": "1"} if no_threshold else {})}
    command = [sys.executable, "-c", CHILD, str(path), str(rows), str(steps), json.dumps(options)]
    done = subprocess.run(command + ([str(export)] if export else []), capture_output=True, text=True, env=env,
                          cwd=Path(__file__).parent)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def numpy_sgd(lr: float, rows: int = 4, steps: int = 3) -> tuple[np.ndarray, np.ndarray]:
    """The same steps in float64 NumPy: loss mean((X W + B - T)^2)."""
    rng = np.random.default_rng(0)
    x, t = rng.standard_normal((rows, 3), np.float32), rng.standard_normal((rows, 2), np.float32)
    w, b = W0.astype(np.float64), B0.astype(np.float64)
    for _ in range(steps):
        d = 2 * (x @ w + b - t) / t.size
        w, b = w - lr * x.T @ d, b - lr * d.sum(axis=0)
    return w, b


def programs(cache: Path) -> list[Path]:
    return sorted((cache / "onnxtrain-programs").glob("*.program"))


def assert_sgd(result: dict, lr: float, rows: int = 4) -> None:
    w, b = numpy_sgd(lr, rows)
    np.testing.assert_allclose(result["W"], w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(result["B"], b, rtol=1e-5, atol=1e-6)


def test_a_later_process_runs_the_stored_step_without_tracing_it(tmp_path):
    path = tmp_path / "linear.onnx"
    onnx.save(linear_regression(W0, B0, lr=0.1), path)
    first = run(path, tmp_path / "cache")
    assert first["traces"] >= 2 and len(programs(tmp_path / "cache")) == 2  # the train step and inference
    assert_sgd(first, 0.1)
    later = run(path, tmp_path / "cache")
    assert later["traces"] == 0
    assert later == {**first, "traces": 0}


def test_a_checkpoint_exported_after_training_runs_the_stored_step(tmp_path):
    """Its weights and step count differ from the model's, which the programs take as arguments: resuming from
    it traces nothing, and continues the NumPy run."""
    path = tmp_path / "linear.onnx"
    onnx.save(linear_regression(W0, B0, lr=0.1), path)
    run(path, tmp_path / "cache", export=tmp_path / "trained.onnx")
    resumed = run(tmp_path / "trained.onnx", tmp_path / "cache")
    assert resumed["traces"] == 0
    w, b = numpy_sgd(0.1, steps=6)
    np.testing.assert_allclose(resumed["W"], w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(resumed["B"], b, rtol=1e-5, atol=1e-6)


def test_a_stored_program_serves_only_its_model_options_and_feed_shapes(tmp_path):
    """The learning rate is a constant the trace compiles in: a model that differs only there, an option, or
    another batch size is traced anew, never served the stored program."""
    cache = tmp_path / "cache"
    for lr in (0.1, 0.05):
        onnx.save(linear_regression(W0, B0, lr=lr), tmp_path / f"lr{lr}.onnx")
    assert_sgd(run(tmp_path / "lr0.1.onnx", cache), 0.1)
    other = run(tmp_path / "lr0.05.onnx", cache)
    assert other["traces"] >= 2
    assert_sgd(other, 0.05)
    rows = run(tmp_path / "lr0.1.onnx", cache, rows=8)
    assert rows["traces"] >= 2
    assert_sgd(rows, 0.1, rows=8)
    bf16 = run(tmp_path / "lr0.1.onnx", cache, mixed_precision="bfloat16")
    assert bf16["traces"] >= 2
    assert len(programs(cache)) == 8
    for lr, rows in ((0.1, 4), (0.05, 4), (0.1, 8)):
        again = run(tmp_path / f"lr{lr}.onnx", cache, rows=rows)
        assert again["traces"] == 0
        assert_sgd(again, lr, rows)


def test_a_new_version_stores_its_programs_in_its_first_process(tmp_path):
    """Another version of onnxtrain keys its entries on its own sources: its first process traces and compiles
    (JAX's cache must not serve it the older version's program, which would then never be stored), and its
    later processes run the stored steps without tracing, with the same numbers."""
    path = tmp_path / "linear.onnx"
    onnx.save(linear_regression(W0, B0, lr=0.1), path)
    cache = tmp_path / "cache"
    first = run(path, cache)
    other = run(path, cache, version="next")
    assert other["traces"] >= 2 and other == {**first, "traces": other["traces"]}
    assert len(programs(cache)) == 4
    assert run(path, cache, version="next") == {**first, "traces": 0}


def jax_entries(cache: Path, module: str) -> list[str]:
    """The files of JAX's persistent cache for the XLA modules whose names start with `module`."""
    return [p.name for p in cache.glob(f"jit_{module}*")]


def test_a_stored_program_is_not_also_kept_in_jaxs_cache(tmp_path):
    """Written to both, each compile serialized the executable twice and each program was on disk twice."""
    path = tmp_path / "linear.onnx"
    onnx.save(linear_regression(W0, B0, lr=0.1), path)
    run(path, tmp_path / "cache")
    assert len(programs(tmp_path / "cache")) == 2
    assert jax_entries(tmp_path / "cache", "onnxtrain_") == []
    assert jax_entries(tmp_path / "cache", "")  # JAX's cache is on: it keeps the engine's small helpers


def test_without_a_way_to_keep_programs_out_of_jaxs_cache_there_is_no_store(tmp_path):
    """JAX's cache could then serve a program the store misses, which would be stored without its kernels: the
    engine keeps no store, and JAX's cache serves the next process as it did before the store."""
    path = tmp_path / "linear.onnx"
    onnx.save(linear_regression(W0, B0, lr=0.1), path)
    for _ in range(2):
        result = run(path, tmp_path / "cache", no_threshold=True)
        assert_sgd(result, 0.1)
        assert result["traces"] >= 2
    assert programs(tmp_path / "cache") == []
    assert jax_entries(tmp_path / "cache", "traced")  # jax.jit of the engine's programs


def test_a_program_xla_cannot_serialize_trains_and_is_not_stored(tmp_path):
    """XLA-CPU refuses to serialize some executables (one planned in several temporary blocks: "Multiple temp
    buffer allocations found"); the store is best effort, so the step still runs and the program is traced again
    in the next process."""
    path = tmp_path / "linear.onnx"
    onnx.save(linear_regression(W0, B0, lr=0.1), path)
    for _ in range(2):
        result = run(path, tmp_path / "cache", serialize_error="INTERNAL: Multiple temp buffer allocations found")
        assert_sgd(result, 0.1)
        assert result["traces"] >= 2
    assert programs(tmp_path / "cache") == []


def test_a_damaged_store_is_a_miss_not_a_failure(tmp_path):
    """The damaged files are traced and compiled again, and stored whole: the next process traces nothing."""
    path = tmp_path / "linear.onnx"
    onnx.save(linear_regression(W0, B0, lr=0.1), path)
    cache = tmp_path / "cache"
    first = run(path, cache)
    for file in programs(cache):  # a disk that filled up, another version's file, a stray write
        file.write_bytes(file.read_bytes()[: len(file.read_bytes()) // 2])
    damaged = run(path, cache)
    assert damaged["traces"] >= 2 and damaged == {**first, "traces": damaged["traces"]}
    assert run(path, cache) == {**first, "traces": 0}


def test_a_stored_step_draws_the_random_numbers_a_traced_one_does(tmp_path):
    """Whether a step draws random numbers is found by its trace and decides how the engine advances its random
    stream: a stored step keeps that with it, so its dropout masks are those of the traced step's process."""
    model = linear_regression(W0, B0, lr=0.1)
    algorithm = model.training_info[0].algorithm
    sub = next(node for node in algorithm.node if node.op_type == "Sub")
    sub.output[0] = "D_all"
    algorithm.node.insert(1, helper.make_node("Dropout", ["D_all", "ratio", "train"], ["D"]))
    algorithm.initializer.extend([tensor("ratio", np.float32(0.5)), tensor("train", np.bool_(True))])
    path = tmp_path / "dropout.onnx"
    onnx.save(model, path)
    first = run(path, tmp_path / "cache", steps=4)
    later = run(path, tmp_path / "cache", steps=4)
    assert later["traces"] == 0 and later == {**first, "traces": 0}
    uncached = run(path, None, steps=4)  # no store: every process traces
    assert uncached["traces"] >= 2 and uncached == {**first, "traces": uncached["traces"]}
    assert not np.allclose(first["W"], numpy_sgd(0.1, steps=4)[0])  # the masks did drop values


def test_no_cache_folder_stores_nothing(tmp_path):
    path = tmp_path / "linear.onnx"
    onnx.save(linear_regression(W0, B0, lr=0.1), path)
    for _ in range(2):
        result = run(path, None)
        assert result["traces"] >= 2
        assert_sgd(result, 0.1)
    assert not any(tmp_path.glob("**/*.program"))


def test_the_store_keeps_the_programs_used_last_within_its_size(tmp_path):
    from onnxtrain.executables import prune

    for age, name in enumerate(["newest", "middle", "oldest"]):
        path = tmp_path / f"{name}.program"
        path.write_bytes(b"x" * 100)
        os.utime(path, (1e9 - age * 60, 1e9 - age * 60))
    (tmp_path / "other.file").write_bytes(b"x" * 1000)  # not the store's
    for name, age in (("killed", 7200), ("writing", 60)):  # staging files: of a write killed, of one under way
        staged = tmp_path / f".{name}.program.0123456789abcdef.tmp"
        staged.write_bytes(b"x")
        os.utime(staged, (1e9 - age, 1e9 - age))
    prune(tmp_path, 250, now=1e9)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".writing.program.0123456789abcdef.tmp", "middle.program", "newest.program", "other.file"]


DETERMINANT = """
import sys
import numpy as np
from onnx import TensorProto, helper
import onnxtrain
graph = helper.make_graph([helper.make_node("Det", ["X"], ["Y"])], "det",
                          [helper.make_tensor_value_info("X", TensorProto.FLOAT, [2, 4, 4])],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [2])])
x = np.random.default_rng(0).standard_normal((2, 4, 4)).astype(np.float32)
print(np.abs(np.asarray(onnxtrain.load(helper.make_model(graph)).infer({"X": x})["Y"]) - np.linalg.det(x)).max())
"""


def test_a_program_that_calls_jaxlibs_kernels_is_not_stored(tmp_path):
    """A determinant lowers to LAPACK's LU factorization, a kernel of jaxlib's that the lowering sets up: read
    without tracing, the program crashed the process. It is traced in every process instead, and compiled once:
    JAX's cache keeps it."""
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", DETERMINANT], capture_output=True, text=True,
                              env=environment(tmp_path))
        assert done.returncode == 0, done.stderr[-2000:]
        assert float(done.stdout.split()[-1]) < 1e-4
    assert programs(tmp_path) == []
    assert len(jax_entries(tmp_path, "onnxtrain_")) == 1
