"""The benchmark suite still runs end to end (a smoke run: it checks the table is printed, never the numbers)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import jax
import pytest

pytest.importorskip("torch")
pytest.importorskip("onnxruntime")

ROOT = Path(__file__).resolve().parent.parent


def test_run_quick_prints_the_table():
    command = [sys.executable, str(ROOT / "benchmarks" / "run.py"), "--quick", "--models", "mlp", "--steps", "4"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "| model | measurement | onnxtrain | JAX | PyTorch | ORT |" in out
    measurements = ["train step (ms)", "infer (ms)", "first call, train step (s)", "first call, infer (s)",
                    "train step temporaries"]
    if jax.default_backend() == "cpu":  # on an accelerator the state is in its memory, which RSS does not show
        measurements.append("train peak RSS increase")
    for measurement in measurements:
        assert f"| mlp | {measurement}" in out, out
    assert "dispatch overhead (µs" in out


def test_kernels_lists_each_peers_kernels_per_step():
    command = [sys.executable, str(ROOT / "benchmarks" / "kernels.py"), "--models", "mlp", "--steps", "3", "--top", "3"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    for peer in ("onnxtrain", "jax"):
        found = re.search(rf"^mlp {peer}: (\d+) kernels per step", done.stdout, re.M)
        assert found and int(found.group(1)) >= 10, done.stdout  # three products and their gradients at least


def test_realsize_quick_prints_the_table():
    command = [sys.executable, str(ROOT / "benchmarks" / "realsize.py"), "--quick", "--models", "resnet18",
               "--steps", "1", "--mixed-precision", "bfloat16", "--remat", "--retain", "--huge-pages"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| model | measurement | onnxtrain | PyTorch | ÷ PyTorch |" in done.stdout
    for measurement in ("train step (ms)", "infer (ms)", "first train step, cold (s)",
                        "first train step, warm cache (s)", "peak RSS (MB)", "train step, bfloat16 (ms)",
                        "peak RSS, bfloat16 (MB)", "train step, remat (ms)", "peak RSS, remat (MB)",
                        "train step, freed memory retained (ms)", "peak RSS, freed memory retained (MB)",
                        "train step, malloc in huge pages (ms)", "peak RSS, malloc in huge pages (MB)"):
        assert f"| resnet18 | {measurement} |" in done.stdout, done.stdout


def test_products_prints_the_table():
    command = [sys.executable, str(ROOT / "benchmarks" / "products.py"), "--tokens", "8", "--width", "16",
               "--steps", "2"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ") and "8, " in line]
    assert len(rows) == 9, done.stdout  # three forms of each of the layer's three weight shapes


def test_convolutions_prints_the_table():
    command = [sys.executable, str(ROOT / "benchmarks" / "convolutions.py"), "--layers", "4x6", "--steps", "2"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ") and "2, 4, 6" in line]
    assert len(rows) == 3, done.stdout  # forward, input gradient and kernel gradient of the one layer
