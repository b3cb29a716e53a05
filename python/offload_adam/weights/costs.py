"""The cost model of running a block: on the CPU from its host copy, or streamed to the GPU.

Measured once per machine and cached with the calibration (``runtime/calibration.py``, which
records when, on which CPU and under what load; a measurement under load is used, not stored):

* the host memory's read bandwidth (``host_read_gbs``);
* the CPU's matmul rate for a dtype at 1 and at 64 rows (``cpu_matmul_gflops``);
* the disk's ``O_DIRECT`` read rate (``disk_read_gbs``), when a directory on it is given;
* on a GPU, the pinned host-to-device bandwidth (``pcie_h2d_gbs``).

A call of a block of ``nbytes`` of weights (``params`` of them) over ``rows`` rows costs, on the
CPU, about ``max(nbytes / host read bandwidth, 2 * params * rows / CPU rate at that many rows)``
plus its crossing (``crossing_us``: the hidden states' copy to the host, its host wait, and the
output's copy back and its wait; a stated default, not yet measured on a GPU); streamed, about ``nbytes / PCIe bandwidth`` (the GPU's compute overlaps the copies). ``auto``
placement takes the cheaper, call by call: a decode step (one row) runs on the CPU where the
host reads faster than PCIe carries, a long prompt streams. ``python -m offload_adam calibrate``
measures and prints these figures. Each figure of a :class:`CostModel` says where it came from
(:meth:`CostModel.describe`; ``offload_weights(...).report()["cost_model"]``).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..runtime import calibration

log = logging.getLogger("offload_adam")

# Stated defaults where nothing was measured: PCIe 4.0 x16 in practice; a desktop's DDR5 read
# bandwidth; a CPU's bf16 GEMV/GEMM rates of a few cores.
DEFAULT_PCIE_GBS = 25.0
DEFAULT_HOST_GBS = 50.0
DEFAULT_CPU_GFLOPS = {"1": 30.0, "64": 500.0}
# A CPU-run call's crossing on a GPU machine (CUDA review, second pass, hazard 7): two blocking
# event waits, each waking tens of microseconds late, and two small copies. Stated, not measured.
DEFAULT_CROSSING_US = 60.0
MATMUL = calibration.MATMUL


@dataclass(frozen=True)
class CostModel:
    """Seconds per block call on the CPU and streamed (see the module documentation). Tests pass
    one in (``offload_weights(cost_model=...)``) to force the choices they want. ``sources``:
    where each figure came from (``"host_read_gbs"``, ``"pcie_h2d_gbs"``,
    ``"cpu_matmul_gflops[bfloat16]"``); a figure without one is the stated default."""

    host_read_gbs: float = DEFAULT_HOST_GBS
    pcie_h2d_gbs: float = DEFAULT_PCIE_GBS
    cpu_gflops: dict[str, dict[str, float]] = field(default_factory=dict)  # dtype name -> {"1": rate, "64": rate}
    crossing_us: float = DEFAULT_CROSSING_US  # a CPU-run call's moves to the host and back, on a GPU machine
    sources: dict[str, str] = field(default_factory=dict)

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
        compute = max(nbytes / (self.host_read_gbs * 1e9), 2.0 * params * max(rows, 1) / (self.cpu_rate(dtype, rows) * 1e9))
        return compute + self.crossing_us * 1e-6

    def stream_seconds(self, nbytes: int, params: int, rows: int, dtype: torch.dtype) -> float:
        return nbytes / (self.pcie_h2d_gbs * 1e9)

    def choose(self, nbytes: int, params: int, rows: int, dtype: torch.dtype) -> str:
        """``"cpu"`` or ``"stream"``, whichever costs less for this call."""
        cpu = self.cpu_seconds(nbytes, params, rows, dtype)
        return "cpu" if cpu < self.stream_seconds(nbytes, params, rows, dtype) else "stream"

    def describe(self, dtype: torch.dtype = torch.bfloat16) -> dict[str, str]:
        """Each figure the model costs ``dtype``'s calls with, and where it came from, in words."""
        name = str(dtype).removeprefix("torch.")
        by = self.cpu_gflops.get(name, DEFAULT_CPU_GFLOPS)
        default = "stated default (offload_adam.weights.costs)"
        mm = f"{MATMUL}[{name}]"
        return {
            "host_read_gbs": f"{self.host_read_gbs:.3g} GB/s ({self.sources.get('host_read_gbs', default)})",
            "pcie_h2d_gbs": f"{self.pcie_h2d_gbs:.3g} GB/s ({self.sources.get('pcie_h2d_gbs', default)})",
            mm: f"{by.get('1', DEFAULT_CPU_GFLOPS['1']):.3g} GFLOP/s at 1 row, {by.get('64', DEFAULT_CPU_GFLOPS['64']):.3g} at 64 "
            f"({self.sources.get(mm, default)})",
            "crossing_us": f"{self.crossing_us:.3g} us per call run on the CPU ({self.sources.get('crossing_us', default)})",
        }

    @classmethod
    def from_calibration(cls, figures: dict[str, Any], sources: dict[str, str] | None = None) -> CostModel:
        """The model of these figures (absent ones: the stated defaults); ``sources``: where each
        came from (see the class documentation)."""
        return cls(
            host_read_gbs=float(figures.get("host_read_gbs", DEFAULT_HOST_GBS)),
            pcie_h2d_gbs=float(figures.get("pcie_h2d_gbs", DEFAULT_PCIE_GBS)),
            cpu_gflops=dict(figures.get(MATMUL, {})),
            crossing_us=float(figures.get("crossing_us", DEFAULT_CROSSING_US)),
            sources=dict(sources or {}),
        )


# -- measuring ------------------------------------------------------------------------------------
# Each figure is the best of its repeats, after one warm-up call; the spread of the repeats
# (calibration.spread) says whether the machine was busy meanwhile.


def _repeat(call: Any, rounds: int) -> list[float]:
    """The seconds of ``rounds`` calls of ``call``, after one more as a warm-up."""
    call()
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        call()
        out.append(time.perf_counter() - t0)
    return out


def host_read_rates(nbytes: int = 512 << 20, rounds: int = 5) -> list[float]:
    """The host's read bandwidth of each repeat, GB/s: a sum over a buffer far larger than the
    caches, in transparent huge pages as the offload's host copies of the weights are
    (``pinned.advise_huge_pages``: in 4 KiB pages the sum's rate counts the page walks too)."""
    from ..runtime.pinned import advise_huge_pages

    x = torch.empty(nbytes // 4, dtype=torch.float32)
    advise_huge_pages(x)
    x.fill_(1.0)
    return [nbytes / s / 1e9 for s in _repeat(x.sum, rounds)]


def host_read_gbs(nbytes: int = 512 << 20, rounds: int = 5) -> float:
    """The host's read bandwidth, best of ``rounds`` (:func:`host_read_rates`)."""
    return max(host_read_rates(nbytes, rounds))


def cpu_matmul_rates(dtype: torch.dtype, rows: int, d: int = 4096, rounds: int = 5) -> list[float]:
    """The CPU's ``F.linear`` rate over ``rows`` rows of a ``d x d`` weight, each repeat, GFLOP/s."""
    w = torch.randn(d, d).to(dtype)
    x = torch.randn(rows, d).to(dtype)
    return [2.0 * rows * d * d / s / 1e9 for s in _repeat(lambda: torch.nn.functional.linear(x, w), rounds)]


def cpu_matmul_gflops(dtype: torch.dtype, rows: int, d: int = 4096, rounds: int = 5) -> float:
    """The CPU's ``F.linear`` rate, best of ``rounds`` (:func:`cpu_matmul_rates`)."""
    return max(cpu_matmul_rates(dtype, rows, d, rounds))


def disk_read_rates(nvme_dir: str, nbytes: int = 1 << 30, rounds: int = 3) -> list[float]:
    """The ``O_DIRECT`` read rate of the disk under ``nvme_dir`` through the I/O engine, each
    repeat, GB/s (a file of ``nbytes`` written, read back in one request ``rounds`` times, removed)."""
    from ..runtime.pages import PageStore, aligned_empty
    from ..runtime.pinned import align_up

    store = PageStore(nvme_dir)
    try:
        n = align_up(nbytes, 1 << 20)
        f = store.open("calibrate.bin", n, "calibrate")
        buf = aligned_empty(n, torch.uint8)
        buf.fill_(1)
        f.write(0, buf, "the calibration file").wait()
        out = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            f.read(0, buf, "the calibration file").wait()
            out.append(n / (time.perf_counter() - t0) / 1e9)
        return out
    finally:
        store.close()


def disk_read_gbs(nvme_dir: str, nbytes: int = 1 << 30) -> float:
    """The ``O_DIRECT`` read rate of the disk under ``nvme_dir``, best of 3 (:func:`disk_read_rates`)."""
    return max(disk_read_rates(nvme_dir, nbytes))


def pcie_h2d_rates(device: torch.device, nbytes: int = 256 << 20, rounds: int = 5) -> list[float]:
    """Pinned host-to-device bandwidth on a CUDA ``device``, each repeat, GB/s. The source is
    pinned by the device's ``cudaHostRegister`` and unregistered when it is freed: torch's pinned
    allocator (``pin_memory=True``) would keep its 256 MB for the life of the process (CUDA
    review, second pass, hazard 9)."""
    from ..runtime.device import device_for

    dev = device_for(device)
    assert dev is not None
    src = dev.host_buffer(nbytes, torch.uint8)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst.copy_(src, non_blocking=True)  # warm-up
    out = []
    for _ in range(rounds):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        dst.copy_(src, non_blocking=True)
        e1.record()
        e1.synchronize()
        out.append(nbytes / (e0.elapsed_time(e1) / 1e3) / 1e9)
    return out


def pcie_h2d_gbs(device: torch.device, nbytes: int = 256 << 20, rounds: int = 5) -> float:
    """Pinned host-to-device bandwidth on a CUDA ``device``, best of ``rounds``."""
    return max(pcie_h2d_rates(device, nbytes, rounds))


def measure(
    *, nvme_dir: str | None = None, dtypes: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float32), quick: bool = False,
    by: str = "python -m offload_adam calibrate", rounds: int = 5, say: Callable[[str], None] | None = None,
) -> calibration.Measurement:  # fmt: skip
    """This machine's figures (see the module documentation), each the best of ``rounds``
    repeats, with when, on which CPU and under what load they were measured (the 1-minute load
    average as it began: ``os.getloadavg``); ``quick``: smaller buffers; ``by``: who measured;
    ``say``: told what is measured before each measurement and its result after (``calibrate``
    prints it: the full run takes a minute and said nothing meanwhile)."""
    from .. import __version__

    load = os.getloadavg()[0]
    spreads: list[float] = []

    def best(what: str, unit: str, measure: Callable[[], list[float]]) -> float:
        if say is not None:
            say(f"measuring {what} ...")
        rates = measure()
        spreads.append(calibration.spread(rates))
        if say is not None:
            say(f"  {max(rates):.2f} {unit} (best of {len(rates)}, spread {calibration.spread(rates):.0%})")
        return max(rates)

    mib = 128 if quick else 512
    out: dict[str, Any] = {
        "host_read_gbs": best(f"the host memory's read bandwidth ({mib} MiB, {rounds} rounds)", "GB/s", lambda: host_read_rates(mib << 20, rounds))
    }
    d = 2048 if quick else 4096
    out[MATMUL] = {
        str(dt).removeprefix("torch."): {
            str(r): best(
                f"the CPU's {str(dt).removeprefix('torch.')} matmul of {r} row{'s' if r > 1 else ''} by {d}x{d} ({rounds} rounds)",
                "GFLOP/s", lambda dt=dt, r=r: cpu_matmul_rates(dt, r, d, rounds),  # type: ignore[misc]
            )
            for r in (1, 64)
        }
        for dt in dtypes
    }  # fmt: skip
    if nvme_dir is not None:
        size = (256 << 20) if quick else (1 << 30)
        out["disk_read_gbs"] = best(
            f"the SSD's O_DIRECT read rate (a {size >> 20} MiB file under {nvme_dir}, removed after)", "GB/s",
            lambda: disk_read_rates(nvme_dir, size),
        )  # fmt: skip
    if torch.cuda.is_available():
        cuda = torch.device("cuda", torch.cuda.current_device())
        out["pcie_h2d_gbs"] = best("PCIe host to device (pinned copies)", "GB/s", lambda: pcie_h2d_rates(cuda, rounds=rounds))
    return calibration.Measurement(
        figures=out, time=calibration.now(), cpu=calibration.cpu_model(), cores=os.cpu_count() or 1, load_avg=load,
        spread=max(spreads), repeats=rounds, by=by, version=__version__,
    )  # fmt: skip


# Figures measured by this process that were not stored (under load): measured once per process.
_UNSTORED: dict[str, dict[str, Any]] = {}


def cached_model(dtype: torch.dtype) -> CostModel:
    """The cost model of ``placement="auto"``: this CPU's calibrated figures, and what they lack
    for ``dtype`` measured now (quickly: the first ``auto`` of a machine takes a second or two)
    and stored, saying so (logger ``offload_adam``, WARNING) and where; a measurement under load
    is used for this process only, and said so too. The model's ``sources`` say where each
    figure came from."""
    cal = calibration.read()
    name = str(dtype).removeprefix("torch.")
    figs = dict(cal.figures)
    sources = {k: f"calibration {cal.where}, {m.describe()}" for k, m in cal.source.items()}
    if "host_read_gbs" not in figs or name not in figs.get(MATMUL, {}):
        new = _UNSTORED.get(name)
        if new is None:
            m = measure(dtypes=(dtype,), quick=True, by="placement='auto'")
            try:
                where = calibration.store(m)
            except calibration.Unsettled as e:
                log.warning("offload_adam: placement='auto' measured this machine (%s) for this process only: %s", m.describe(), e)
                said = f"measured now, not stored: {calibration.unsettled(m)}"
            except OSError as e:  # a read-only home: measured again next time
                log.warning("offload_adam: placement='auto' measured this machine (%s); it could not be stored: %s", m.describe(), e)
                said = f"measured now, not stored: {e}"
            else:
                log.warning("offload_adam: placement='auto' measured this machine (%s) and stored it in %s", m.describe(), where)
                said = f"calibration {where}, {m.describe()}"
            new = {"figures": m.figures, "said": said}
            if not said.startswith("calibration"):
                _UNSTORED[name] = new
        figs["host_read_gbs"] = new["figures"]["host_read_gbs"]
        figs[MATMUL] = {**figs.get(MATMUL, {}), **new["figures"][MATMUL]}
        sources["host_read_gbs"] = sources[f"{MATMUL}[{name}]"] = new["said"]
    return CostModel.from_calibration(figs, sources)
