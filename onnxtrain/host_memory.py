"""Keeping freed host memory for reuse: XLA-CPU's per-step temporaries without page faults (glibc only).

Each run of a compiled program on the CPU allocates its temporaries as one block (BERT-base's train step at batch
2: 361 MB) and frees it after. glibc serves a block that large from a fresh anonymous mapping, always when the
allocating thread is not the main thread (XLA's are not), and unmaps it when freed, so every step touches 92,000
new pages: on a 2-core VM 0.16-0.23 s of kernel time a step. With one malloc arena, no mappings and no trimming,
a freed block stays in the process's heap and the next step reuses it (0.02-0.04 s).

The setting is the whole process's (PyTorch and everything else in it allocate the same way) and the heap then
keeps its high-water mark and fragments (peak resident memory 1.1-1.7x measured), so onnxtrain does not impose it
on import: a training script with memory to spare calls `retain_freed_memory()` first thing, and `onnxtrain train
--retain-freed-memory` does.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

# (mallopt's parameter, from glibc's malloc.h; the same setting's environment variable; its value):
# M_ARENA_MAX 1: every thread allocates from the main heap (the other arenas map any block over 64 MB anew);
# M_MMAP_MAX 0: no block gets a mapping of its own, whatever its size;
# M_TRIM_THRESHOLD: freed memory at the heap's top stays, up to 2 GiB (mallopt takes an int).
SETTINGS = (
    (-8, "MALLOC_ARENA_MAX", 1),
    (-4, "MALLOC_MMAP_MAX_", 0),
    (-1, "MALLOC_TRIM_THRESHOLD_", 2**31 - 1),
)
# For a process started with the settings (its threads then never see another):
# `env MALLOC_ARENA_MAX=1 MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=2147483647 python ...`
ENVIRONMENT = {variable: str(value) for _, variable, value in SETTINGS}


def retain_freed_memory() -> bool:
    """Make this process keep the host memory it frees for its next allocations (glibc's mallopt), instead of
    returning it to the system and faulting it in again at the next step. Call it before the first computation
    (threads that already allocated keep their own heaps). The process's resident memory then stays at its peak,
    and that peak can be higher (a fragmented heap).
    Returns whether the C library took the settings (False off Linux or on another C library: nothing changed)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # glibc's own symbol: musl's mallopt does nothing
    except (OSError, AttributeError):
        return False
    return all(libc.mallopt(parameter, value) == 1 for parameter, _, value in SETTINGS)
