"""JAX's persistent compilation cache, on by default so a second process compiles nothing it compiled before.

The folder is `$ONNXTRAIN_CACHE_DIR`, else `~/.cache/onnxtrain/xla`; set ONNXTRAIN_CACHE_DIR to an empty string
to turn it off. A cache folder the user configured in JAX itself is left alone.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax

_configured = False


def enable_compilation_cache() -> str | None:
    """Point JAX at the cache folder once per process; returns the folder in use (None when off)."""
    global _configured
    current = jax.config.jax_compilation_cache_dir
    if _configured or current:
        return current
    _configured = True
    folder = os.environ.get("ONNXTRAIN_CACHE_DIR", str(Path.home() / ".cache" / "onnxtrain" / "xla"))
    if not folder:
        return None
    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return folder
