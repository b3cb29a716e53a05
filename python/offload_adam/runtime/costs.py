"""The cost model of running a block: on the CPU from its host copy, or streamed to the GPU.

Measured once per machine and cached with the calibration (``runtime/calibration.py``):

* the host memory's read bandwidth (``host_read_gbs``);
* the CPU's matmul rate for a dtype at 1 and at 64 rows (``cpu_matmul_gflops``);
* the disk's ``O_DIRECT`` read rate (``disk_read_gbs``), when a directory on it is given;
* on a GPU, the pinned host-to-device bandwidth (``pcie_h2d_gbs``).

A call of a block of ``nbytes`` of weights (``params`` of them) over ``rows`` rows costs, on the
CPU, about ``max(nbytes / host read bandwidth, 2 * params * rows / CPU rate at that many rows)``;
streamed, about ``nbytes / PCIe bandwidth`` (the GPU's compute overlaps the copies). ``auto``
placement takes the cheaper, call by call: a decode step (one row) runs on the CPU where the
host reads faster than PCIe carries, a long prompt streams. ``python -m offload_adam calibrate``
measures and prints these figures.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from . import calibration

# Stated defaults where nothing was measured: PCIe 4.0 x16 in practice; a desktop's DDR5 read
# bandwidth; a CPU's bf16 GEMV/GEMM rates of a few cores.
DEFAULT_PCIE_GBS = 25.0
DEFAULT_HOST_GBS = 50.0
DEFAULT_CPU_GFLOPS = {"1": 30.0, "64": 500.0}


@dataclass(frozen=True)
class CostModel:
    """Seconds per block call on the CPU and streamed (see the module documentation). Tests pass
    one in (``offload_weights(cost_model=...)``) to force the choices they want."""

    host_read_gbs: float = DEFAULT_HOST_GBS
    pcie_h2d_gbs: float = DEFAULT_PCIE_GBS
    cpu_gflops: dict[str, dict[str, float]] = field(default_factory=dict)  # dtype name -> {"1": rate, "64": rate}

    def cpu_rate(self, dtype: torch.dtype, rows: int) -> float:
        """GFLOP/s of the CPU's matmul of ``rows`` rows, interpolated between 1 and 64 rows."""
        by = self.cpu_gflops.get(str(dtype).removeprefix("torch."), DEFAULT_CPU_GFLOPS)
        r1, r64 = by.get("1", DEFAULT_CPU_GFLOPS["1"]), by.get("64", DEFAULT_CPU_GFLOPS["64"])
        if rows <= 1:
            return r1
        if rows >= 64:
            return r64
        return r1 + (r64 - r1) * (rows - 1) / 63

    def cpu_seconds(self, nbytes: int, params: int, rows: int, dtype: torch.dtype) -> float:
        return max(nbytes / (self.host_read_gbs * 1e9), 2.0 * params * max(rows, 1) / (self.cpu_rate(dtype, rows) * 1e9))

    def stream_seconds(self, nbytes: int, params: int, rows: int, dtype: torch.dtype) -> float:
        return nbytes / (self.pcie_h2d_gbs * 1e9)

    def choose(self, nbytes: int, params: int, rows: int, dtype: torch.dtype) -> str:
        """``"cpu"`` or ``"stream"``, whichever costs less for this call."""
        cpu = self.cpu_seconds(nbytes, params, rows, dtype)
        return "cpu" if cpu < self.stream_seconds(nbytes, params, rows, dtype) else "stream"

    @classmethod
    def from_calibration(cls, figures: dict[str, Any]) -> CostModel:
        return cls(
            host_read_gbs=float(figures.get("host_read_gbs", DEFAULT_HOST_GBS)),
            pcie_h2d_gbs=float(figures.get("pcie_h2d_gbs", DEFAULT_PCIE_GBS)),
            cpu_gflops=dict(figures.get("cpu_matmul_gflops", {})),
        )


# -- measuring ------------------------------------------------------------------------------------


def host_read_gbs(nbytes: int = 512 << 20, rounds: int = 5) -> float:
    """The host's read bandwidth: a sum over a buffer far larger than the caches, best of
    ``rounds``."""
    x = torch.ones(nbytes // 4, dtype=torch.float32)
    best = 0.0
    for _ in range(rounds):
        t0 = time.perf_counter()
        x.sum()
        best = max(best, nbytes / (time.perf_counter() - t0) / 1e9)
    return best


def cpu_matmul_gflops(dtype: torch.dtype, rows: int, d: int = 4096, rounds: int = 5) -> float:
    """The CPU's ``F.linear`` rate over ``rows`` rows of a ``d x d`` weight, best of ``rounds``."""
    w = torch.randn(d, d).to(dtype)
    x = torch.randn(rows, d).to(dtype)
    torch.nn.functional.linear(x, w)  # warm-up
    best = 0.0
    for _ in range(rounds):
        t0 = time.perf_counter()
        torch.nn.functional.linear(x, w)
        best = max(best, 2.0 * rows * d * d / (time.perf_counter() - t0) / 1e9)
    return best


def disk_read_gbs(nvme_dir: str, nbytes: int = 1 << 30) -> float:
    """The ``O_DIRECT`` read rate of the disk under ``nvme_dir`` through the I/O engine (a file of
    ``nbytes`` written, read back in one request, removed)."""
    from .pages import PageStore
    from .pinned import align_up

    store = PageStore(nvme_dir)
    try:
        n = align_up(nbytes, 1 << 20)
        f = store.open("calibrate.bin", n, "calibrate")
        from .pages import aligned_empty

        buf = aligned_empty(n, torch.uint8)
        buf.fill_(1)
        f.write(0, buf, "the calibration file").wait()
        t0 = time.perf_counter()
        f.read(0, buf, "the calibration file").wait()
        return n / (time.perf_counter() - t0) / 1e9
    finally:
        store.close()


def pcie_h2d_gbs(device: torch.device, nbytes: int = 256 << 20, rounds: int = 5) -> float:
    """Pinned host-to-device bandwidth on a CUDA ``device``, best of ``rounds``."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    best = 0.0
    for _ in range(rounds):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        dst.copy_(src, non_blocking=True)
        e1.record()
        e1.synchronize()
        best = max(best, nbytes / (e0.elapsed_time(e1) / 1e3) / 1e9)
    return best


def measure(*, nvme_dir: str | None = None, dtypes: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float32), quick: bool = False) -> dict[str, Any]:
    """This machine's figures (see the module documentation); ``quick``: smaller buffers."""
    out: dict[str, Any] = {"host_read_gbs": host_read_gbs(128 << 20 if quick else 512 << 20)}
    d = 2048 if quick else 4096
    out["cpu_matmul_gflops"] = {
        str(dt).removeprefix("torch."): {str(r): cpu_matmul_gflops(dt, r, d) for r in (1, 64)} for dt in dtypes
    }
    if nvme_dir is not None:
        out["disk_read_gbs"] = disk_read_gbs(nvme_dir, (256 << 20) if quick else (1 << 30))
    if torch.cuda.is_available():
        out["pcie_h2d_gbs"] = pcie_h2d_gbs(torch.device("cuda", torch.cuda.current_device()))
    return out


def store(figures: dict[str, Any]) -> str:
    """Merges ``figures`` into the calibration file; its path."""
    path = calibration.path()
    path.parent.mkdir(parents=True, exist_ok=True)
    data = calibration.load() if path.exists() else {}
    data.update(figures)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return str(path)


def cached_model(dtype: torch.dtype) -> CostModel:
    """The cost model from the calibration file, measuring (quickly) and storing what it lacks
    for ``dtype``: the first ``placement="auto"`` of a machine takes a second or two."""
    figs = calibration.load()
    name = str(dtype).removeprefix("torch.")
    if "host_read_gbs" not in figs or name not in figs.get("cpu_matmul_gflops", {}):
        new = measure(dtypes=(dtype,), quick=True)
        rates = dict(figs.get("cpu_matmul_gflops", {}))
        rates.update(new["cpu_matmul_gflops"])
        new["cpu_matmul_gflops"] = rates
        try:
            store(new)
        except OSError:
            pass  # a read-only home: measured again next time
        figs = {**figs, **new}
    return CostModel.from_calibration(figs)
