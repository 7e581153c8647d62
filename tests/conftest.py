import sys
import zlib
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True)
def _reseed_module_rng(request):
    """A test module's shared `RNG` restarts from a seed derived from the test's name, so the numbers a test
    draws never depend on which tests ran before it in the same worker (pytest-xdist distributes them freely)."""
    module = request.module
    if isinstance(getattr(module, "RNG", None), np.random.Generator):
        module.RNG = np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))
    yield
