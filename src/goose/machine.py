"""What machine goose runs on: the CPU's name (for reports), its feature flags (for the kernel variants) and its
identity (for caches of measurements); and handing the C heap's free memory back to the system (`trim_heap`)."""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import subprocess
from pathlib import Path


@functools.lru_cache(maxsize=1)
def _cpuinfo_fields() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty where there is none; read once per process)."""
    fields: dict[str, str] = {}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return fields
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip().lower(), value.strip())
    return fields


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (/proc/cpuinfo's `flags`; empty where there is none)."""
    return frozenset(_cpuinfo_fields().get("flags", "").split())


@functools.lru_cache(maxsize=1)
def cpu_name() -> str:
    """The CPU's model name from `lscpu` (or /proc/cpuinfo), else what `platform` knows."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.strip().lower().startswith("model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return _cpuinfo_fields().get("model name") or platform.processor() or platform.machine()


@functools.lru_cache(maxsize=1)
def cpu_identity() -> str:
    """The CPU as a cached measurement depends on it: model name, family, model and stepping (a VM's model name
    alone, e.g. "AMD EPYC", covers several generations), and the CPUs this process may run on."""
    f = _cpuinfo_fields()
    parts = [f.get("model name") or platform.processor() or platform.machine(), f"family={f.get('cpu family', '?')}",
             f"model={f.get('model', '?')}", f"stepping={f.get('stepping', '?')}"]
    try:
        parts.append(f"cpus={len(os.sched_getaffinity(0))}")
    except (AttributeError, OSError):
        parts.append(f"cpus={os.cpu_count()}")
    return " ".join(parts)


@functools.lru_cache(maxsize=1)
def glibc():
    """glibc's C library (for `mallopt`, `malloc_trim`), or None where the process runs on another libc."""
    try:
        lib = ctypes.CDLL("libc.so.6")
        lib.mallopt, lib.malloc_trim  # noqa: B018 - both exist only in glibc
        return lib
    except (OSError, AttributeError):
        return None


def trim_heap() -> bool:
    """Hand the memory the C allocator holds free back to the system (glibc's ``malloc_trim(0)``). A long-running
    engine's heap keeps what its freed tensors held: measured, 186 MiB of a process's 424 MiB growth over 1,100
    requests were free memory kept so. False where there is no glibc (nothing done)."""
    lib = glibc()
    if lib is None:
        return False
    lib.malloc_trim(0)
    return True
