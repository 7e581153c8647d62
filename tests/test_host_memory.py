"""retain_freed_memory (onnxtrain/host_memory.py): a compiled program's temporaries are reused from step to step
instead of being faulted in anew. Counted, not timed: the process's minor page faults per call, each in a fresh
process (the setting is the whole process's and must come before its threads allocate)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

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

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")


def faults_per_call(mode: str) -> float:
    done = subprocess.run([sys.executable, "-c", PROGRAM, mode], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return float(done.stdout.split()[-1])


def test_a_programs_temporaries_are_not_faulted_in_at_every_call():
    huge_pages = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if huge_pages.exists() and "[always]" in huge_pages.read_text():
        pytest.skip("transparent huge pages for every mapping: a fresh block costs a few faults, not one a page")
    plain, retained = faults_per_call("plain"), faults_per_call("retain")
    assert plain > 16384, f"expected the 64 MB temporary's 16,384 pages faulted in at every call, saw {plain}"
    assert retained < plain / 20, (plain, retained)
