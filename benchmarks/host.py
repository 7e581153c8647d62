"""What the benchmarks share about the host: the machine a benchmark ran on, for the header of its table (the CPU
model: cloud hosts change between runs, and only ratios measured on one machine in one run compare), and how a
measurement runs in a process of its own."""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
from pathlib import Path
from typing import Any, Mapping

# glibc keeps freed blocks below its (adaptive) mmap threshold resident, so after a few steps the RSS would
# already include every transient buffer and the peak would not rise. A fixed small threshold makes each
# buffer of 64 KiB or more its own mapping, returned on free: RSS then follows what is live.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}


def cpu_name() -> str:
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    found = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.M)
    return found.group(1).strip() if found else platform.processor() or platform.machine()


def memory_kib(key: str) -> int:
    """This process's resident memory now ("VmRSS") or at its peak ("VmHWM"), from /proc (Linux). The peak is
    the process's own since it started its program: getrusage's ru_maxrss also counts the parent's resident
    memory at the fork, which a benchmark's child would report as its own."""
    return int(re.search(rf"^{key}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1))


def child_result(command: list[str], what: str, environment: Mapping[str, str] = MALLOC_ENV) -> dict[str, Any]:
    """Run `command` (a benchmark in child mode) in a fresh process with `environment` added to this one's, and
    return the JSON object it prints last; RuntimeError with the end of its error output if it fails."""
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **environment})
    if done.returncode:
        raise RuntimeError(f"{what} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])
