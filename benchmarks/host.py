"""The machine a benchmark ran on, for the header of its table: the CPU model (cloud hosts change between runs,
and only ratios measured on one machine in one run compare)."""

from __future__ import annotations

import platform
import re
from pathlib import Path


def cpu_name() -> str:
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    found = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.M)
    return found.group(1).strip() if found else platform.processor() or platform.machine()
