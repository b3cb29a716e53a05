"""``python -m offload_adam env``: what a bug report needs to know about this machine.

The package and Python versions, the CPU and the kernel's SIMD path, the NVMe tier's I/O backend
(io_uring, or threads where io_uring is refused), torch and CUDA, the memlock limit and the pinned
memory this process may hold, the calibration file, and the versions of the libraries the
package works with.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import resource
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

GiB = 1 << 30
PEERS = ("transformers", "accelerate", "torchao", "bitsandbytes", "lightning", "safetensors", "numpy")


def _limit(v: int) -> str:
    return "unlimited" if v == resource.RLIM_INFINITY else f"{v / GiB:.3g} GiB" if v >= GiB else f"{v // 1024} KiB"


def _meminfo() -> dict[str, int]:
    out = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            k, v = line.split(":", 1)
            parts = v.split()
            out[k] = int(parts[0]) * (1024 if len(parts) > 1 else 1)
    except OSError:
        pass
    return out


def _cgroup_room() -> tuple[int | None, str]:
    """Bytes the process's cgroup (v2) may still take, and what limits it; None where unlimited."""
    try:
        rel = next(
            line.split(":", 2)[2] for line in Path("/proc/self/cgroup").read_text().splitlines() if line.startswith("0::")
        )
        base = Path("/sys/fs/cgroup") / rel.lstrip("/")
        limit = (base / "memory.max").read_text().strip()
        if limit == "max":
            return None, "no cgroup memory limit"
        used = int((base / "memory.current").read_text())
        return max(int(limit) - used, 0), f"cgroup limit {int(limit) / GiB:.1f} GiB, {used / GiB:.1f} GiB used"
    except (OSError, StopIteration, ValueError, IndexError):
        return None, "no cgroup memory limit found"


def _kernel() -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", platform.release())
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def report() -> list[tuple[str, str]]:
    """The lines of the report, as (what, value)."""
    import torch

    import offload_adam
    from offload_adam import _native
    from offload_adam.runtime import calibration

    rows: list[tuple[str, str]] = []
    rows.append(("offload_adam", f"{offload_adam.__version__} ({Path(offload_adam.__file__).parent})"))
    rows.append(("python", f"{platform.python_version()} ({sys.executable})"))
    rows.append(("system", f"{platform.system()} {platform.release()} {platform.machine()}, glibc {platform.libc_ver()[1] or '?'}"))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    rows.append(("CPU", f"{calibration.cpu_model()}; {cores} cores for this process; torch threads {torch.get_num_threads()}"))
    forced = os.environ.get("OFFLOAD_ADAM_SIMD")
    rows.append(("SIMD path", f"{_native.simd_path()} (this CPU runs: {', '.join(_native.simd_paths())})" + (f"; forced by OFFLOAD_ADAM_SIMD={forced}" if forced else "")))
    try:
        io = _native.io_backend()
        words = {"uring": "io_uring", "threads": "threads (pread/pwrite): io_uring is refused here (a container's seccomp, or an old kernel)"}
        io_text = words.get(io, io) + (f"; forced by OFFLOAD_ADAM_IO={os.environ['OFFLOAD_ADAM_IO']}" if os.environ.get("OFFLOAD_ADAM_IO") else "")
    except Exception as e:  # noqa: BLE001 - a report shows what went wrong instead of stopping
        io_text = f"unavailable: {e}"
    rows.append(("I/O backend", io_text))
    cuda = torch.cuda.is_available()
    rows.append(("torch", f"{torch.__version__}, built with CUDA {torch.version.cuda or 'none'}; CUDA available: {'yes' if cuda else 'no'}"))
    if cuda:
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            rows.append((f"GPU {i}", f"{p.name}, {p.total_memory / GiB:.1f} GiB, compute capability {p.major}.{p.minor}"))
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    memlock = f"soft {_limit(soft)}, hard {_limit(hard)} (ulimit -l)"
    if soft != resource.RLIM_INFINITY and soft < GiB and _kernel() < (5, 12):
        memlock += (
            "; low for this kernel: io_uring counts its rings against it before Linux 5.12 (the threads backend takes "
            "over where io_uring is refused); raise it with ulimit -l unlimited, or docker run --ulimit memlock=-1"
        )
    rows.append(("memlock limit", memlock))
    mem = _meminfo()
    avail = mem.get("MemAvailable", 0)
    room, cg = _cgroup_room()
    rows.append(("memory", f"{mem.get('MemTotal', 0) / GiB:.1f} GiB total, {avail / GiB:.1f} GiB available; {cg}"))
    what, n = min([("the available RAM", avail)] + ([("the cgroup's room", room)] if room is not None else []), key=lambda x: x[1])
    rows.append((
        "pinned memory allowed",
        f"at most {n / GiB:.1f} GiB ({what}; pinned pages are never swapped out). The GPU driver or a container runtime "
        "may cap it lower (Docker Desktop on WSL2 does)" + ("; the pinning test below tries 64 MiB" if cuda else ""),
    ))  # fmt: skip
    if cuda:
        try:
            torch.empty(64 << 20, dtype=torch.uint8).pin_memory()
            rows.append(("pinning test", "64 MiB pinned"))
        except RuntimeError as e:
            rows.append(("pinning test", f"64 MiB could not be pinned: {e}"))
    try:
        measured = calibration.measurements()
        rows.append((
            "calibration",
            f"{calibration.path()}: "
            + ("; ".join(f"{', '.join(sorted(m.figures))} {m.describe()}" for m in measured) if measured else "none"),
        ))  # fmt: skip
    except ValueError as e:
        rows.append(("calibration", str(e)))
    found = []
    for name in PEERS:
        try:
            found.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            pass
    rows.append(("libraries", ", ".join(found) or "none of " + ", ".join(PEERS)))
    env = [f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("OFFLOAD_ADAM_")]
    rows.append(("environment", " ".join(env) or "no OFFLOAD_ADAM_* variable set"))
    return rows


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(
        prog="python -m offload_adam env",
        description="Prints what a bug report needs: versions, the SIMD path, the I/O backend, torch and CUDA, "
        "the memlock limit and the pinned memory allowed. Paste its output into the report.",
    ).parse_args(argv)
    rows = report()
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:>{width}}: {v}")
    return 0
