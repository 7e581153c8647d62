"""Host memory under glibc: freed memory kept for reuse on request, else handed back after each compile.

Each run of a compiled program on the CPU allocates its temporaries as one block (BERT-base's train step at batch
2: 361 MB) and frees it after. glibc serves a block that large from a fresh anonymous mapping, always when the
allocating thread is not the main thread (XLA's are not), and unmaps it when freed, so every step touches 92,000
new pages: on a 2-core VM 0.16-0.23 s of kernel time a step. With one malloc arena, no mappings and no trimming,
a freed block stays in the process's heap and the next step reuses it (0.02-0.04 s).

The setting is the whole process's (PyTorch and everything else in it allocate the same way) and the heap then
keeps its high-water mark and fragments (peak resident memory 1.1-1.7x measured), so onnxtrain does not impose it
on import: a training script with memory to spare calls `retain_freed_memory()` first thing, and `onnxtrain train
--retain-freed-memory` does.

A lighter way, with no memory kept: started with glibc's tunable `glibc.malloc.hugetlb=1`, a process gets those
blocks in transparent huge pages, a fault per 2 MB instead of per 4 kB (`with_huge_pages` gives the environment;
`onnxtrain train` starts itself with it).

The other way round, XLA's compiler leaves the heap fragmented: the memory it frees after a compile (or after
reading an executable from the persistent cache) sits between blocks that stay, where glibc never returns it
on its own. onnxtrain hands those free pages back after every compile of a tenth of a second or more
(`malloc_trim`, `trim_after_compiles`), unless the process retains freed memory: MobileNetV3-small's train
step peaked at 524 -> 473 MB compiled, 524 -> 430 MB read from the cache.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys
from pathlib import Path
from typing import Any, Mapping

import jax

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


# jax.monitoring's event at the end of a program's compile, or of its read from the persistent cache, with its
# seconds (jax._src.dispatch.BACKEND_COMPILE_EVENT)
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
# a shorter compile frees too little to be worth the heap walk (eager jax.numpy calls each compile one program)
TRIM_AFTER_SECONDS = 0.1
_RETAINING = {"on": False}  # retain_freed_memory took effect: freed memory stays, by the user's choice


@functools.cache
def glibc() -> Any:
    """The C library when it is glibc (mallopt and malloc_trim as glibc defines them), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # glibc's own symbol: musl's mallopt does nothing
    except (OSError, AttributeError):
        return None
    return libc


# glibc's tunable (2.35 on) that asks the kernel for transparent huge pages for malloc's mappings and heaps, where
# the kernel offers them on request ("madvise") or always: a step's temporaries then fault in 2 MB at a time
# (ResNet-18: 21,968 -> 570 faults a step, its step ~7% shorter, peak resident memory unchanged). glibc reads it
# at process start only, so only a command that starts the process can set it (cli.py).
HUGE_PAGES = "glibc.malloc.hugetlb"
TRANSPARENT_HUGE_PAGES = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def with_huge_pages(environment: Mapping[str, str]) -> dict[str, str] | None:
    """`environment` with malloc's huge pages added to GLIBC_TUNABLES, for a process to start with; None where
    that would change nothing or was decided already: not glibc 2.35 or later, the kernel's transparent huge
    pages off, or GLIBC_TUNABLES naming the tunable (the user's own value, 0 included, stands)."""
    libc = glibc()
    if libc is None or glibc_version(libc) < (2, 35):
        return None
    try:
        if "[never]" in TRANSPARENT_HUGE_PAGES.read_text():
            return None
    except OSError:
        return None
    tunables = environment.get("GLIBC_TUNABLES", "")
    if f"{HUGE_PAGES}=" in tunables:
        return None
    return {**environment, "GLIBC_TUNABLES": ":".join(filter(None, (tunables, f"{HUGE_PAGES}=1")))}


def glibc_version(libc: Any) -> tuple[int, ...]:
    libc.gnu_get_libc_version.restype = ctypes.c_char_p
    return tuple(int(part) for part in libc.gnu_get_libc_version().decode().split(".")[:2])


def trim_heap() -> None:
    """Return the heap's free pages to the system now, unless the process retains freed memory (nothing off
    glibc). Also after reading an executable from onnxtrain's own store (executables.py), which leaves the heap
    as reading one from JAX's cache does."""
    libc = glibc()
    if libc is not None and not _RETAINING["on"]:
        libc.malloc_trim(0)


def _trim(event: str, seconds: float, **_: Any) -> None:
    if event == COMPILE_EVENT and seconds >= TRIM_AFTER_SECONDS:
        trim_heap()


@functools.cache
def trim_after_compiles() -> None:
    """From now on, return the heap's free pages to the system after each compile that took 0.1 s or more
    (once per process; nothing off glibc)."""
    if glibc() is not None:
        jax.monitoring.register_event_duration_secs_listener(_trim)


def retain_freed_memory() -> bool:
    """Make this process keep the host memory it frees for its next allocations (glibc's mallopt), instead of
    returning it to the system and faulting it in again at the next step. Call it before the first computation
    (threads that already allocated keep their own heaps). The process's resident memory then stays at its peak,
    and that peak can be higher (a fragmented heap).
    Returns whether the C library took the settings (False off Linux or on another C library: nothing changed)."""
    libc = glibc()
    if libc is None:
        return False
    _RETAINING["on"] = all(libc.mallopt(parameter, value) == 1 for parameter, _, value in SETTINGS)
    return _RETAINING["on"]
