"""The argument checks the clients share, each error naming the argument: a directory
(``nvme_dir``), a budget in GiB or MiB (finite, within :data:`MAX_GIB`), and a thread count within
the CPUs this process may use. They only read their arguments: a client calls them before it
changes anything."""

from __future__ import annotations

import math
import os
from typing import Any

# The largest budget taken, in GiB: 1 PiB, more memory than any machine has. A budget is a limit
# (``gpu_budget_gb=1e6``: everything that fits), so any size up to this is accepted; beyond it the
# bytes would not fit the integers the budgets become (``1e300`` GiB, ``inf``).
MAX_GIB = float(1 << 20)


def cpu_count() -> int:
    """The CPUs this process may run on: its affinity set (``os.sched_getaffinity``), else the
    machine's CPUs."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # (no affinity on this platform)
        return os.cpu_count() or 1


def threads(value: Any, name: str = "num_threads", *, optional: bool = True) -> int:
    """``value`` checked as a thread count: an int from 1 to :func:`cpu_count` (the words of the
    error allow None where ``optional``: the caller took None before). More threads than CPUs only
    compete for them (a pool of 4096 threads on two CPUs): refused, naming the count."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1{' or None' if optional else ''}, got {value!r}")
    cpus = cpu_count()
    if value > cpus:
        raise ValueError(
            f"{name}={value} is more than the {cpus} CPU{'s' if cpus != 1 else ''} this process may use "
            f"(os.sched_getaffinity): at most {cpus}"
        )
    return value


def default_threads(torch_threads: int) -> int:
    """The default thread count: torch's (``torch.get_num_threads()``), at most :func:`cpu_count`."""
    return max(1, min(torch_threads, cpu_count()))


def size(value: Any, name: str, unit: str = "GiB", *, positive: bool = False, optional: bool = False) -> float:
    """``value`` checked as a budget of ``unit`` (GiB or MiB): a real number (not a bool or a
    string: ``TypeError``), finite, at least 0 (above 0 where ``positive``) and at most
    :data:`MAX_GIB` GiB (``ValueError``). ``optional``: the words of the error allow None (the
    caller took None before)."""
    bound = ">= 0" if not positive else "> 0"
    words = f"{name} must be a number {bound} (of {unit}){' or None' if optional else ''}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{words}, got {value!r} ({type(value).__name__})")
    most = MAX_GIB if unit == "GiB" else MAX_GIB * 1024
    if not (value > 0 if positive else value >= 0):  # (NaN too)
        raise ValueError(f"{words}, got {value!r}")
    if not math.isfinite(value) or value > most:
        raise ValueError(f"{name} must be a finite number of {unit}, at most {most:.0f} (1 PiB), got {value!r}")
    return float(value)


def directory(value: Any, name: str = "nvme_dir") -> str:
    """``value`` checked as an existing directory: a ``str``, an ``os.PathLike`` or ``bytes`` (a
    path as the OS gives it, decoded by ``os.fsdecode``), returned as a ``str``."""
    if isinstance(value, bytes) or (isinstance(value, os.PathLike) and isinstance(os.fspath(value), bytes)):
        path = os.fsdecode(value)
    elif isinstance(value, (str, os.PathLike)):
        path = os.fspath(value)
    else:
        raise TypeError(f"{name} must be a path (str, bytes or os.PathLike) of an existing directory, got {value!r} ({type(value).__name__})")
    if not path or not os.path.isdir(path):
        raise ValueError(f"{name}: {path!r} is not a directory")
    return str(path)
