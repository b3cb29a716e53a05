"""``python -m offload_adam bench --activations``: activations offloaded, measured in the same run.

On a GPU: a Llama-style bf16 model's forward and backward, round after round interleaved, with
nothing offloaded, with ours (``offload_activations``), with torch's
``save_on_cpu(pin_memory=True)`` and with torchtune's ``OffloadActivations`` (when installed):
the peak GPU memory of each (``max_memory_allocated``) and its median time. Targets: at least
torchtune's memory saving, at no more than its time. Without a GPU the model is small and runs
through the simulated device: the bytes kept and moved are what a GPU would see (labelled so).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from .. import testing
from ..activations import offload_activations
from .shapes import llama


def _step(model: torch.nn.Module, x: torch.Tensor, ctx: Callable[[], Any]) -> Any:
    with ctx() as h:
        out = model(x[:, :-1]).logits.float()
        loss = torch.nn.functional.cross_entropy(out.flatten(0, 1), x[:, 1:].flatten())
    loss.backward()
    model.zero_grad(set_to_none=True)
    return h


def gpu(*, layers: int, d: int, batch: int, seq: int, rounds: int, min_bytes: int) -> dict[str, Any]:
    model = llama(layers, d, 32000, "cuda")
    x = torch.randint(1, 32000, (batch, seq + 1), device="cuda")
    ours = offload_activations(min_bytes=min_bytes)
    ways: dict[str, Callable[[], Any]] = {
        "none": contextlib.nullcontext,
        "offload_adam offload_activations": lambda: ours,
        "torch save_on_cpu(pin_memory=True)": lambda: torch.autograd.graph.save_on_cpu(pin_memory=True),
    }
    try:
        from torchtune.training import OffloadActivations  # type: ignore[import-not-found]

        ways["torchtune OffloadActivations"] = lambda: OffloadActivations(min_offload_size=min_bytes)
    except Exception as e:  # not installed: reported
        print(f"  torchtune OffloadActivations: not measured ({type(e).__name__}: {e})")
    times: dict[str, list[float]] = {k: [] for k in ways}
    peaks: dict[str, int] = {}
    for name, ctx in ways.items():  # warm-up, and each one's peak alone
        _step(model, x, ctx)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        _step(model, x, ctx)
        torch.cuda.synchronize()
        peaks[name] = torch.cuda.max_memory_allocated() - base
    for _ in range(rounds):
        for name, ctx in ways.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            _step(model, x, ctx)
            torch.cuda.synchronize()
            times[name].append(time.perf_counter() - t0)
    out: dict[str, Any] = {n: {"peak_bytes": peaks[n], "step_s": statistics.median(times[n])} for n in ways}
    out["ours_report"] = ours.report()
    ours.close()
    return out


def simulated(*, rounds: int, min_bytes: int) -> dict[str, Any]:
    with testing.simulated_device(max_delay_s=0.0, lazy=False) as sim:
        # fp32: the CPU's bf16 matmuls are slow; the model and the batch on the device as to "cuda"
        model = llama(4, 256, 2048, "cpu", torch.float32).to(sim.torch_device)
        x = torch.randint(1, 2048, (4, 257)).to(sim.torch_device)
        ao = offload_activations(min_bytes=min_bytes)
        _step(model, x, lambda: ao)
        ao.reset_stats()
        t: list[float] = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            _step(model, x, lambda: ao)
            t.append(time.perf_counter() - t0)
        rep = ao.report()
        ao.close()
    return {"report": {k: v / rounds if k.endswith("_bytes") and k not in ("host_pinned_bytes", "gpu_peak_bytes") else v for k, v in rep.items()}, "step_s": statistics.median(t)}


def run(*, rounds: int, min_bytes: int = 1 << 20) -> dict[str, Any]:
    if torch.cuda.is_available():
        res = gpu(layers=8, d=2048, batch=4, seq=1024, rounds=rounds, min_bytes=min_bytes)
        print(f"activations offloaded, Llama-style 8 layers d 2048 bf16, batch 4x1024, median of {rounds} interleaved rounds (GPU)")
        none = res["none"]
        for name, v in res.items():
            if name == "ours_report":
                continue
            saved = none["peak_bytes"] - v["peak_bytes"]
            print(
                f"  {name:38s} peak {v['peak_bytes'] / 2**30:6.2f} GiB (saved {saved / 2**30:5.2f}), "
                f"forward+backward {v['step_s'] * 1e3:8.1f} ms ({v['step_s'] / none['step_s']:.2f}x)"
            )
        tt = res.get("torchtune OffloadActivations")
        ours = res["offload_adam offload_activations"]
        if tt is not None:
            print(
                f"  ours against torchtune: memory saved {(none['peak_bytes'] - ours['peak_bytes']) / max(1, none['peak_bytes'] - tt['peak_bytes']):.2f}x "
                f"(target >= 1), time {ours['step_s'] / tt['step_s']:.2f}x (target <= 1)"
            )
        return res
    res = simulated(rounds=rounds, min_bytes=1024)  # a small model's tensors are small
    r = res["report"]
    saved = r["offloaded_bytes"] + r["kept_bytes"]
    print(
        "activations offloaded, Llama-style 4 layers d 256 fp32, batch 4x256, min_bytes 1024; SIMULATED device on the CPU: the bytes are a "
        "GPU's, the times the CPU's (a GPU run owes the memory and time against torchtune and save_on_cpu)\n"
        f"  per step: saved for backward {saved / 2**20:.1f} MiB: offloaded {r['offloaded_bytes'] / 2**20:.1f} MiB "
        f"({r['offloaded_bytes'] / max(1, saved):.0%}) in {r['offloaded_tensors']:.0f} storages, kept {r['kept_bytes'] / 2**20:.2f} MiB; "
        f"d2h {r['d2h_bytes'] / 2**20:.1f} MiB, h2d {r['h2d_bytes'] / 2**20:.1f} MiB; restored at most "
        f"{r['gpu_peak_bytes'] / 2**20:.1f} MiB at once; pinned host {r['host_pinned_bytes'] / 2**20:.1f} MiB; "
        f"forward+backward {res['step_s'] * 1e3:.0f} ms (CPU)"
    )
    return res
