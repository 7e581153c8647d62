"""retain_freed_memory (onnxtrain/host_memory.py): a compiled program's temporaries are reused from step to step
instead of being faulted in anew. Counted, not timed: the process's minor page faults per call, each in a fresh
process (the setting is the whole process's and must come before its threads allocate)."""

from __future__ import annotations

import subprocess
import sys

import pytest

PROGRAM = """
import resource, sys
if sys.argv[1] == "retain":
    import onnxtrain
    assert onnxtrain.retain_freed_memory()
import jax, jax.numpy as jnp, numpy as np
step = jax.jit(lambda x: (jnp.tanh(x @ x.T) @ x).sum())  # a 4096 x 4096 temporary: 64 MB
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
    plain, retained = faults_per_call("plain"), faults_per_call("retain")
    assert plain > 2000, f"expected fresh pages for the temporaries at every call, saw {plain} faults"
    assert retained < plain / 20, (plain, retained)

