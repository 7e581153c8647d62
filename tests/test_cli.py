"""Every CLI subcommand run as a subprocess, with one user mistake each (one line, exit status 2)."""

from __future__ import annotations

import argparse
import errno
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import pytest

import onnxtrain
import onnxtrain.cli
import onnxtrain.engine
from onnxtrain import host_memory
from onnxtrain.export import saved_step_count
from test_parameters import conv

EXAMPLE = Path(onnxtrain.__file__).parent / "examples"
MODEL, DATA = EXAMPLE / "regression.onnx", EXAMPLE / "regression.npz"


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "onnxtrain.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=300, env=env)


def assert_user_error(result: subprocess.CompletedProcess, fragment: str) -> None:
    assert result.returncode == 2, result
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith("onnxtrain: error:") and fragment in result.stderr, result.stderr


def test_info():
    result = cli("info", MODEL)
    assert result.returncode == 0, result.stderr
    assert "input: X float[batch, 2]" in result.stdout
    assert "state: train.step int64[] (training_info[0])" in result.stdout
    assert "algorithm 0: feeds target float[batch, 1], learning_rate float[]; updates" in result.stdout
    assert "ai.onnx.preview.training::Adam" not in result.stdout  # main graph ops only
    assert_user_error(cli("info", "missing.onnx"), "missing.onnx")


def test_infer(tmp_path):
    x = np.array([[0.5, -1.0]], np.float32)
    np.save(tmp_path / "x.npy", x)
    result = cli("infer", MODEL, "--input", f"X={tmp_path / 'x.npy'}", "--output-dir", tmp_path)
    assert result.returncode == 0, result.stderr
    expected = np.asarray(onnxtrain.load(MODEL).infer({"X": x})["Y"])
    np.testing.assert_array_equal(np.load(tmp_path / "Y.npy"), expected)
    np.save(tmp_path / "bad.npy", x.astype(np.float64))
    assert_user_error(cli("infer", MODEL, "--input", f"X={tmp_path / 'bad.npy'}"), "expected dtype float")


# `onnxtrain infer MODEL ... | head -1`: the reader went away; that is no user error to report (it was "onnxtrain:
# error: [Errno 32] Broken pipe", exit status 2, as for an unreadable path), so the command ends quietly, 128 + SIGPIPE
def test_a_closed_stdout_ends_the_command_quietly():
    run = subprocess.Popen([sys.executable, "-m", "onnxtrain.cli", "info", MODEL], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    run.stdout.close()  # before the command writes anything: its first print finds no reader
    errors = run.stderr.read()
    assert run.wait(timeout=300) == 141 and errors == "", errors


# A warning is one line for the command's user, as an error is: Python's format had shown the file and line in
# onnxtrain that warned, and that line's source (`trainable = make_trainable(model, loss=args.loss, ...`)
def test_a_warning_is_one_line(tmp_path):
    onnx.save(conv("stem.0.weight", "stem.0.bias", "FuseBatchNormIntoConv"), tmp_path / "folded.onnx")
    result = cli("make-trainable", tmp_path / "folded.onnx", "-o", tmp_path / "out.onnx")
    assert result.returncode == 0 and (tmp_path / "out.onnx").exists(), result.stderr
    assert result.stderr.startswith("onnxtrain: warning: ParameterizationWarning: stem.0.weight (1 in all): "
                                    "BatchNorm folded into Conv"), result.stderr
    assert result.stderr.count("\n") == 1, result.stderr


# Every option says what it does (and its default where it has one) in --help
def test_a_warning_during_training_clears_the_progress_bar(capsys):
    """A warning while the bar is drawn (a checkpoint not written) is printed on a line of its own, the bar cleared
    before it and drawn again after: it was printed onto the bar's line."""
    from tqdm.auto import tqdm

    with tqdm(total=2) as bar:
        bar.update(1)
        onnxtrain.cli.show_warning("checkpoint not written", RuntimeWarning)
    error = capsys.readouterr().err
    assert re.search(r"\r *\ronnxtrain: warning: RuntimeWarning: checkpoint not written\n\r 50%", error), error


def test_every_option_has_a_help_text():
    subcommands = next(a for a in onnxtrain.cli.parser()._actions if isinstance(a, argparse._SubParsersAction))
    bare = [(name, action.option_strings) for name, command in subcommands.choices.items()
            for action in command._actions if action.option_strings and not action.help]
    assert not bare, bare


def test_train_on_two_devices_with_split_state_matches_one_device(tmp_path):
    two = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    args = ("train", MODEL, "--data", DATA, "--steps", 5, "--batch-size", 64)
    single = cli(*args, "-o", tmp_path / "one.onnx")
    split = cli(*args, "--devices", 2, "--shard-state", "-o", tmp_path / "two.onnx", env=two)
    assert single.returncode == 0 and split.returncode == 0, single.stderr + split.stderr
    assert "data parallel over 2 devices; state split" in split.stdout
    weights = [{t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(tmp_path / name).graph.initializer}
               for name in ("one.onnx", "two.onnx")]
    assert weights[0].keys() == weights[1].keys()
    for name, value in weights[0].items():
        np.testing.assert_allclose(weights[1][name], value, rtol=1e-5, atol=1e-6, err_msg=name)
    assert_user_error(cli(*args, "--devices", 3, env=two), "--devices 3: 2 cpu device(s) available")
    assert_user_error(cli(*args, "--shard-state"), "give --devices N with N > 1")


def test_train_writes_a_model_whose_loss_fell(tmp_path):
    out = tmp_path / "trained.onnx"
    result = cli("train", MODEL, "--data", DATA, "--steps", 60, "--batch-size", 64, "-o", out)
    assert result.returncode == 0, result.stderr
    first, last = (float(v) for v in result.stdout.split("loss ")[-1].split(" over")[0].split(" -> "))
    assert last < first
    onnx.checker.check_model(onnx.load(out))
    np.savez(tmp_path / "wrong.npz", X=np.zeros((4, 2), np.float32), Other=np.zeros((4, 1), np.float32))
    assert_user_error(
        cli("train", MODEL, "--data", tmp_path / "wrong.npz", "--steps", 1), "unknown feed name(s) ['Other']"
    )


def test_make_trainable_then_train(tmp_path):
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        [helper.make_node("MatMul", ["X", "W"], ["Y"])], "lin",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 2])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", 1])],
        [numpy_helper.from_array(np.zeros((2, 1), np.float32), "W")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "lin.onnx")
    result = cli("make-trainable", tmp_path / "lin.onnx", "--loss", "mse", "--optimizer", "sgd", "--lr", "0.1",
                 "-o", tmp_path / "lin_train.onnx")
    assert result.returncode == 0, result.stderr
    x = np.random.default_rng(0).normal(size=(32, 2)).astype(np.float32)
    np.savez(tmp_path / "d.npz", X=x, target=x @ np.array([[2.0], [-1.0]], np.float32))
    result = cli("train", tmp_path / "lin_train.onnx", "--data", tmp_path / "d.npz", "--steps", 200, "-o",
                 tmp_path / "done.onnx")
    assert result.returncode == 0, result.stderr
    w = {t.name: numpy_helper.to_array(t) for t in onnx.load(tmp_path / "done.onnx").graph.initializer}["W"]
    np.testing.assert_allclose(w, [[2.0], [-1.0]], atol=1e-3)
    assert_user_error(cli("make-trainable", tmp_path / "lin.onnx", "--optimizer", "rmsprop", "-o", tmp_path / "x.onnx"),
                      "optimizer must be one of")
    for rate in ("nan", "inf", "-1"):
        assert_user_error(cli("make-trainable", tmp_path / "lin.onnx", "--lr", rate, "-o", tmp_path / "x.onnx"),
                          "learning_rate must be a finite number >= 0")
    assert_user_error(cli("make-trainable", tmp_path / "lin.onnx", "--loss", "cross_entropy", "--class-axis", "3",
                          "-o", tmp_path / "x.onnx"), "class_axis=3 is not a class axis of prediction 'Y'")
    assert_user_error(cli("make-trainable", tmp_path / "lin.onnx", "--label-smoothing", "0.1", "-o",
                          tmp_path / "x.onnx"), "label_smoothing apply to loss='cross_entropy', not 'mse'")


def test_export_applies_a_state_checkpoint(tmp_path):
    engine = onnxtrain.load(MODEL)
    engine.init(seed=3)
    engine.save_state(tmp_path / "state.npz")
    result = cli("export", MODEL, "--state", tmp_path / "state.npz", "-o", tmp_path / "out.onnx")
    assert result.returncode == 0, result.stderr
    exported = {t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(tmp_path / "out.onnx").graph.initializer}
    np.testing.assert_array_equal(exported["W1"], np.asarray(engine.state["W1"]))
    np.savez(tmp_path / "junk.npz", a=np.zeros(1))
    assert_user_error(cli("export", MODEL, "--state", tmp_path / "junk.npz", "-o", tmp_path / "o.onnx"), "junk.npz")


@pytest.mark.parametrize("flag", ["--remat", "--remat-attention", "--retain-freed-memory"])
def test_train_flags_keep_sgds_numbers(tmp_path, flag: str):
    """Recomputation and retained host memory change how a step runs, never what it computes: three SGD steps of
    a linear regression against NumPy's."""
    from onnx import numpy_helper

    from training_models import linear_regression

    rng = np.random.default_rng(0)
    w0, lr = rng.normal(size=(4, 2)).astype(np.float32), 0.1
    onnx.save(linear_regression(w0, np.zeros(2, np.float32), lr), tmp_path / "m.onnx")
    x = rng.normal(size=(32, 4)).astype(np.float32)
    t = x @ rng.normal(size=(4, 2)).astype(np.float32)
    np.savez(tmp_path / "d.npz", X=x, T=t)
    result = cli("train", tmp_path / "m.onnx", "--data", tmp_path / "d.npz", "--steps", 3, "--no-init", flag,
                 "-o", tmp_path / "out.onnx")
    assert result.returncode == 0, (result.stdout, result.stderr)
    w, b = w0.astype(np.float64), np.zeros(2)
    for _ in range(3):  # mean((XW + B - T)^2) over all 64 elements, plain SGD
        d = x @ w + b - t
        w, b = w - lr * 2 / d.size * x.T @ d, b - lr * 2 / d.size * d.sum(axis=0)
    trained = {t.name: numpy_helper.to_array(t) for t in onnx.load(tmp_path / "out.onnx").graph.initializer}
    np.testing.assert_allclose(trained["W"], w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(trained["B"], b, rtol=1e-5, atol=1e-6)


def environment_without_tunables() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}


def test_train_restarts_once_with_malloc_in_huge_pages(tmp_path):
    """glibc reads its tunables at process start only, so `onnxtrain train` starts itself again with them
    (onnxtrain.host_memory.with_huge_pages); the restarted process trains as before."""
    if host_memory.with_huge_pages(environment_without_tunables()) is None:
        pytest.skip("not glibc 2.35 or later, or no transparent huge pages on this kernel")
    out = tmp_path / "trained.onnx"
    result = cli("train", MODEL, "--data", DATA, "--steps", 20, "--batch-size", 64, "-o", out,
                 env=environment_without_tunables())
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("host memory: malloc in transparent huge pages") == 1, result.stdout
    first, last = (float(v) for v in result.stdout.split("loss ")[-1].split(" over")[0].split(" -> "))
    assert last < first


@pytest.mark.parametrize("choice", [{"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, "--retain-freed-memory"])
def test_train_keeps_the_users_own_malloc_choice(choice: dict | str):
    """The user's own huge-page setting stands, and retained memory (a malloc policy of its own) is not mixed
    with huge pages."""
    if host_memory.with_huge_pages(environment_without_tunables()) is None:
        pytest.skip("not glibc 2.35 or later, or no transparent huge pages on this kernel")
    env = {**environment_without_tunables(), **(choice if isinstance(choice, dict) else {})}
    flags = [choice] if isinstance(choice, str) else []
    result = cli("train", MODEL, "--data", DATA, "--steps", 2, "--batch-size", 64, *flags, env=env)
    assert result.returncode == 0, result.stderr
    assert "host memory" not in result.stdout


def test_huge_pages_join_the_users_other_tunables(monkeypatch):
    if host_memory.glibc() is None or host_memory.glibc_version(host_memory.glibc()) < (2, 35):
        pytest.skip("glibc 2.35 or later")
    monkeypatch.setattr(host_memory, "TRANSPARENT_HUGE_PAGES", Path(os.devnull))  # reads "": not [never]
    added = host_memory.with_huge_pages({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2", "HOME": "/h"})
    assert added == {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1", "HOME": "/h"}
    assert host_memory.with_huge_pages({})["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"
    assert host_memory.with_huge_pages({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}) is None
    monkeypatch.setattr(host_memory, "glibc", lambda: None)  # another C library: nothing to set
    assert host_memory.with_huge_pages({}) is None


# The CLI with Python's Ctrl-C handler, as a terminal's Ctrl-C finds it: a test session started as a background job
# has SIGINT ignored (as POSIX has a shell's background jobs), a run inherited that and never stopped, and Python
# installs its handler only where SIGINT is at its default
INTERRUPTIBLE_CLI = ("import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
                     "runpy.run_module('onnxtrain.cli', run_name='__main__')")


# A run stopped at any moment (Ctrl-C, SIGTERM, then killed) and started again with the same command, --resume, ends
# with the model the uninterrupted run writes, bit for bit: -o holds the state, optimizer and step count (written
# every --checkpoint-every steps, and at a Ctrl-C or SIGTERM), and the batches go on where the stopped run was.
# (SIGTERM, a scheduler's preemption or `kill`, had ended the run at once, the steps since the checkpoint lost.)
def test_train_stopped_then_run_again_with_resume_ends_as_the_uninterrupted_run(tmp_path):
    out, steps = tmp_path / "out.onnx", 3000
    args = ["train", MODEL, "--data", DATA, "--steps", steps, "--batch-size", 64, "--checkpoint-every", 100,
            "--resume", "-o", out]
    kept = 0
    for stop in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
        written = out.stat().st_ino if out.exists() else None
        run = subprocess.Popen([sys.executable, "-c", INTERRUPTIBLE_CLI, *map(str, args)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
        while (out.stat().st_ino if out.exists() else None) == written and run.poll() is None:
            time.sleep(0.005)  # until the run's first checkpoint replaces -o (an atomic rename: a new inode)
        run.send_signal(stop)
        output, errors = run.communicate(timeout=300)
        # the run's first step is logged as it happens, flushed: a killed run's pipe has it too
        assert f"step {kept:>6}  loss " in output, output
        if stop != signal.SIGKILL:
            assert run.returncode == 130 and errors.endswith("onnxtrain: interrupted\n"), errors
            assert f"interrupted after {onnxtrain.load(out).step_count} train steps: wrote {out}" in output
        else:
            assert run.returncode == -signal.SIGKILL, errors
            assert f"resuming from {out} at step {kept} of {steps}" in output
        assert kept < onnxtrain.load(out).step_count < steps
        kept = onnxtrain.load(out).step_count
    result = cli(*args)
    assert result.returncode == 0, result.stderr
    assert f"resuming from {out} at step {kept} of {steps}" in result.stdout
    reference = onnxtrain.load(MODEL)  # what the command does, uninterrupted
    reference.init()
    onnxtrain.fit(reference, onnxtrain.array_batches(dict(np.load(DATA)), 64), steps, progress=False)
    resumed = onnxtrain.load(out)
    assert resumed.step_count == steps
    for name, value in reference.state.items():
        np.testing.assert_array_equal(np.asarray(resumed.state[name]), np.asarray(value), err_msg=name)


def test_train_without_an_output_says_that_nothing_is_written():
    result = cli("train", MODEL, "--data", DATA, "--steps", 2, "--batch-size", 64)
    assert result.returncode == 0, result.stderr
    assert "no -o PATH: the trained model is not written\n" in result.stdout, result.stdout


def reference_after(steps: int) -> onnxtrain.Engine:
    """What `train MODEL --data DATA --batch-size 64` holds after `steps` steps, uninterrupted."""
    reference = onnxtrain.load(MODEL)
    reference.init()
    onnxtrain.fit(reference, onnxtrain.array_batches(dict(np.load(DATA)), 64), steps, progress=False)
    return reference


def assert_holds(path: Path, reference: onnxtrain.Engine) -> None:
    written = onnxtrain.load(path)
    assert written.step_count == reference.step_count
    for name, value in reference.state.items():
        np.testing.assert_array_equal(np.asarray(written.state[name]), np.asarray(value), err_msg=name)


def disk_full_at(monkeypatch, step_counts: set[int]) -> None:
    """The exports of the model after these step counts fail as on a full disk: each fsync raises ENOSPC."""
    real_fsync, real_save = os.fsync, onnxtrain.engine.save_atomic
    full = False

    def fsync(descriptor: int) -> None:
        if full:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_fsync(descriptor)

    def save_atomic(model: onnx.ModelProto, *args, **kwargs) -> None:
        nonlocal full
        full = saved_step_count(model) in step_counts
        real_save(model, *args, **kwargs)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(onnxtrain.engine, "save_atomic", save_atomic)


TRAIN_6 = ["train", str(MODEL), "--data", str(DATA), "--steps", "6", "--batch-size", "64", "--checkpoint-every", "2"]


def test_train_goes_on_past_a_checkpoint_the_full_disk_refused(tmp_path, monkeypatch, capsys):
    """A checkpoint whose write fails (ENOSPC) had ended the run with exit status 2, a user mistake's, every step
    since the last checkpoint lost: it is a warning naming the write, the checkpoint -o still holds and the next
    try, and the run goes on; the next checkpoint, the disk freed, is the uninterrupted run's."""
    out = tmp_path / "out.onnx"
    disk_full_at(monkeypatch, {4})
    with pytest.warns(RuntimeWarning, match=r"checkpoint after 4 train steps not written \(cannot export to "
                      rf".*out\.onnx': \[Errno {errno.ENOSPC}\] No space left on device\); .*out\.onnx' still "
                      r"holds the checkpoint after 2 train steps; training goes on, and writes the next one after "
                      r"6 train steps"):
        assert onnxtrain.cli.main([*TRAIN_6, "-o", str(out)]) == 0
    monkeypatch.undo()
    assert f"wrote {out}" in capsys.readouterr().out
    assert os.listdir(tmp_path) == ["out.onnx"]
    assert_holds(out, reference_after(6))


@pytest.mark.parametrize("stop", ["last checkpoint", "ctrl-c"])
def test_train_whose_last_write_the_full_disk_refuses_names_the_checkpoint_kept(tmp_path, monkeypatch, capsys, stop):
    """The disk stays full: the run ends at its last write (or at a Ctrl-C's, after 5 steps) with exit status 1, a
    run's failure, naming the write, the checkpoint -o holds, and how to go on; --resume then ends as the
    uninterrupted run."""
    out = tmp_path / "out.onnx"
    disk_full_at(monkeypatch, {4, 5, 6})
    if stop == "ctrl-c":
        def interrupt_at_step_4(step: int, loss: float) -> None:
            if step == 4:
                raise KeyboardInterrupt

        monkeypatch.setattr(onnxtrain.cli, "print_loss", interrupt_at_step_4)
    with pytest.warns(RuntimeWarning, match="checkpoint after 4 train steps not written"):
        assert onnxtrain.cli.main([*TRAIN_6, "-o", str(out)]) == 1
    monkeypatch.undo()
    error = capsys.readouterr().err
    assert error.endswith(f"\nonnxtrain: error: the model after {5 if stop == 'ctrl-c' else 6} train steps was not "
                          f"written: cannot export to {str(out)!r}: [Errno {errno.ENOSPC}] No space left on device; "
                          f"{str(out)!r} still holds the checkpoint after 2 train steps (the steps since are lost): "
                          "free space there (or fix the cause), then the same command with --resume goes on from "
                          "it\n"), error
    assert os.listdir(tmp_path) == ["out.onnx"]
    assert_holds(out, reference_after(2))
    assert onnxtrain.cli.main([*TRAIN_6, "-o", str(out), "--resume"]) == 0
    assert_holds(out, reference_after(6))
    written = out.stat()
    disk_full_at(monkeypatch, set(range(7)))  # a finished run resumed again rewrites nothing, so nothing fails
    capsys.readouterr()
    assert onnxtrain.cli.main([*TRAIN_6, "-o", str(out), "--resume"]) == 0
    assert f"{out} holds 6 train steps already (--steps 6): nothing to train\n" in capsys.readouterr().out
    assert (out.stat().st_ino, out.stat().st_mtime_ns) == (written.st_ino, written.st_mtime_ns)
