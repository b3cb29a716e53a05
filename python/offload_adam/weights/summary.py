"""What an offload of weights holds and did, in words: ``repr(handle)`` (one line: storage,
device, placement, bytes per tier) and ``handle.summary()`` (the account ``examples/generate.py``
prints: VRAM, RAM, page cache, bytes per forward, time to first token and tokens/s when given,
placement counts, the bound). Both read :meth:`WeightOffload.report` only; a figure that does not
apply is left out (no VRAM without a device, no placement counts without calls, no bytes per
forward without a forward)."""

from __future__ import annotations

from typing import Any

from ..runtime.units import size

def tiers(rep: dict[str, Any]) -> list[tuple[str, int]]:
    """The bytes each tier holds, only the tiers this offload has: VRAM (resident blocks and
    buffers, the ring), pinned RAM, RAM (blocks kept there, the CPU as the device), the RAM ring
    pages read ahead from the SSD, NVMe."""
    on_device = rep["device"] != "cpu"
    out: list[tuple[str, int]] = []
    if on_device:
        out += [("VRAM resident", rep["gpu_resident_bytes"]), ("VRAM ring", rep["ring_bytes"])]
        if rep["host_pinned_bytes"]:
            out.append(("pinned RAM", rep["host_pinned_bytes"]))
    if rep["host_resident_bytes"]:
        out.append(("RAM", rep["host_resident_bytes"]))
    if rep["host_ring_bytes"]:
        out.append(("RAM ring", rep["host_ring_bytes"]))
    if rep["storage"] == "nvme":
        out.append(("NVMe", rep["nvme_bytes"]))
    return out


def describe(rep: dict[str, Any], closed: bool) -> str:
    """``repr(handle)``: one line."""
    held = ", ".join(f"{k} {size(v)}" for k, v in tiers(rep))
    state = "closed; " if closed else ""
    return (
        f"<WeightOffload {state}storage={rep['storage']!r} device={rep['device']!r} placement={rep['placement']!r}: "
        f"{rep['blocks']} blocks, {rep['streamed_blocks']} streamed, prefetch {rep['prefetch']}; "
        f"weights {size(rep['weights_bytes'])}" + (f"; routed experts {size(rep['expert_bytes'])}" if "expert_bytes" in rep else "")
        + (f"; {held}" if held else "") + ">"
    )


def per_forward(rep: dict[str, Any]) -> tuple[float, str] | None:
    """The bytes one forward moved to run its blocks that are not resident, and what moved them
    (None where no forward has run since the last ``reset_stats()``, or nothing moved)."""
    if rep["passes"] <= 0:
        return None
    if rep["device"] != "cpu":
        moved, how = rep["h2d_bytes"] / rep["passes"], "host to device"
    else:
        moved, how = rep.get("read_bytes", 0) / rep["passes"], "read from the SSD"
    return (moved, how) if moved > 0 else None


def bound(rep: dict[str, Any], read_gbs: float | None) -> str | None:
    """The forwards per second the bytes moved per forward allow: over the measured host-to-device
    bandwidth of this run's copies on a device, over ``read_gbs`` (the SSD's read rate, GB/s:
    the caller's, else this machine's calibration) with the CPU as the device; None where
    nothing moved or no rate is known."""
    moved = per_forward(rep)
    if moved is None:
        return None
    if rep["device"] != "cpu":
        if rep["h2d_s"] <= 0:
            return None
        bw, what = rep["h2d_bytes"] / rep["h2d_s"], "host-to-device bandwidth of this run's copies"
    else:
        source = "measured by the caller"
        if read_gbs is None:
            from ..runtime import calibration

            cal = calibration.read()
            got = cal.rate("disk_read_gbs")
            if got is None:
                return "bound: no read rate of the SSD known (python -m offload_adam calibrate --nvme-dir DIR measures it)"
            read_gbs, source = got[0], f"calibration {cal.where}, {got[1].describe()}"
        bw, what = read_gbs * 1e9, f"O_DIRECT read rate ({source})"
    return f"bound: {what} {bw / 1e9:.2f} GB/s / {size(moved[0])} per forward = {bw / moved[0]:.1f} forwards/s"


def experts(rep: dict[str, Any]) -> str:
    """The routed experts (``weights/experts.py``): where their units live, the caches, and per
    phase what was computed and read."""
    where = f"on the SSD {size(rep['expert_nvme_bytes'])}, RAM cache {rep['expert_cache_units']} units" if rep["expert_nvme_bytes"] else "in RAM"
    if rep.get("expert_gpu_units"):
        where += f", device cache {rep['expert_gpu_units']} units ({size(rep['expert_gpu_bytes'])})"
    out = f"routed experts: {rep['expert_modules']} modules, {rep['expert_units']} experts of {size(rep['expert_bytes'])} {where}"
    for ph, st in rep["experts"].items():
        if st["calls"]:
            out += (
                f"; {ph}: {st['experts']} experts over {st['calls']} calls, RAM hits {st['hits']}, misses {st['misses']} "
                f"({size(st['read_bytes'])} read)"
            )
            if st["gpu_hits"] or st["copied"] or st["cpu_computed"] or st.get("streamed"):
                out += f", device hits {st['gpu_hits']}, copied {st['copied']}, on the CPU {st['cpu_computed']}"
                if st.get("streamed"):
                    out += f", streamed {st['streamed']}"
    return out


def summary(rep: dict[str, Any], *, ttft_s: float | None = None, tokens_per_s: float | None = None, read_gbs: float | None = None) -> str:
    """``handle.summary()``: the offload's account, a line per subject (see the module
    documentation)."""
    on_device = rep["device"] != "cpu"
    where = rep["device"] if on_device else "cpu (the CPU runs the model)"
    lines = [
        f"offload_weights: storage {rep['storage']}, device {where}, placement {rep['placement']}; {rep['blocks']} blocks, "
        f"{rep['streamed_blocks']} streamed ({size(rep['streamed_bytes'])} of {size(rep['weights_bytes'])}), prefetch {rep['prefetch']}"
    ]
    if on_device:
        lines.append(
            f"VRAM: peak of the offload {size(rep['gpu_peak_bytes'])} (resident blocks and buffers {size(rep['gpu_resident_bytes'])}, "
            f"ring {size(rep['ring_bytes'])})"
        )
    ram = [f"peak RSS of this process {size(rep['host_rss_peak_bytes'])}"]
    if on_device and rep["host_pinned_bytes"]:
        ram.append(f"pinned copy {size(rep['host_pinned_bytes'])}")
    if rep["host_resident_bytes"]:
        ram.append(f"blocks and buffers kept in RAM {size(rep['host_resident_bytes'])}")
    if rep["host_ring_bytes"]:
        ram.append(f"RAM ring {size(rep['host_ring_bytes'])}")
    lines.append("RAM: " + ", ".join(ram))
    if rep["storage"] == "nvme":
        lines.append(f"NVMe: {size(rep['nvme_bytes'])}; page cache of the offload's files {size(rep['page_cache_bytes'])}")
    if "expert_units" in rep:
        lines.append(experts(rep))
    moved = per_forward(rep)
    if moved is not None:
        waits = f"; compute waited {rep['stall_s'] * 1e3:.1f} ms for weights" if on_device else ""
        if rep["storage"] == "nvme":
            waits += f"; host waited {rep.get('io_wait_s', 0.0) * 1e3:.1f} ms for the disk"
        lines.append(f"per forward: {size(moved[0])} {moved[1]}, over {rep['passes']} forwards{waits}")
    elif rep["streamed_blocks"] == 0:
        lines.append("per forward: nothing moved (every block resident)")
    timing = []
    if ttft_s is not None:
        timing.append(f"time to first token {ttft_s * 1e3:.1f} ms")
    if tokens_per_s is not None:
        timing.append(f"{tokens_per_s:.2f} tokens/s")
    if timing:
        lines.append(", ".join(timing))
    calls = rep["calls"]
    if any(n for phase in calls.values() for n in phase.values()):
        counts = "; ".join(
            f"{ph} " + ", ".join(f"{n} {'streamed' if kind == 'stream' else 'on the CPU'}" for kind, n in c.items() if n)
            for ph, c in calls.items() if any(c.values())
        )  # fmt: skip
        line = f"block calls: {counts}"
        if rep["cpu_s"] > 0:
            line += f"; {rep['cpu_s']:.3f} s in blocks run on the CPU"
        if rep["native_calls"] or rep["torch_calls"]:
            line += f" (matmuls: {rep['native_calls']} native kernel, {rep['torch_calls']} torch)"
        lines.append(line)
    if rep.get("cost_model"):
        lines.append("placement='auto' cost model: " + "; ".join(f"{k} {v}" for k, v in rep["cost_model"].items()))
    b = bound(rep, read_gbs)
    if b is not None:
        lines.append(b)
    return "\n".join(lines)
