"""``python -m offload_adam bench --train-weights``: training with streamed weights, same run.

A Llama-style bf16 model trains with ``offload_adam.AdamW(free_gradients=True)`` in three ways,
round after round interleaved (median step time of each):

- **streamed**: ``offload_weights(model)`` first, every block streamed in forward and again in
  backward, the step writing the host copy;
- **resident**: the model on the device, the optimizer offloading as without streamed weights;
- **FSDP2**: ``fully_shard(..., offload_policy=CPUOffloadPolicy())`` on one rank with our optimizer
  (on a GPU only; it needs a process group, made here with world size 1).

On a GPU (1B+ parameters) the targets are: streamed at most 0.8x FSDP2's step time, and at most
1.1x max(compute, PCIe bytes / bandwidth, CPU step), where compute is the resident run's forward
and backward, the bandwidth is a pinned host-to-device copy measured here, and the CPU step is
the kernel's time from ``last_step_stats``. Without a GPU the model is small and runs through the
simulated device: bytes and the breakdown are what a GPU would see, the times are the CPU's and
labelled as such.
"""

from __future__ import annotations

import contextlib
import copy
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .. import testing
from ..optim.optimizer import AdamW
from ..weights.offload import offload_weights
from .shapes import llama


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


class _Case:
    """One way of training: a model, its optimizer, and what it measured per step."""

    def __init__(self, name: str, model: torch.nn.Module, opt: AdamW, handle: Any = None, close: Callable[[], None] | None = None):
        self.name, self.model, self.opt, self.handle, self._close = name, model, opt, handle, close
        self.times: list[float] = []
        self.fwd_bwd: list[float] = []
        self.stats: list[dict[str, float]] = []
        self.reports: list[dict[str, Any]] = []

    def step(self, x: torch.Tensor, cuda: bool) -> None:
        if self.handle is not None:
            self.handle.reset_stats()
        _sync(cuda)
        t0 = time.perf_counter()
        out = self.model(x[:, :-1]).logits.float()
        torch.nn.functional.cross_entropy(out.flatten(0, 1), x[:, 1:].flatten()).backward()
        _sync(cuda)
        t1 = time.perf_counter()
        self.opt.step()
        self.opt.zero_grad()
        self.opt.synchronize()
        _sync(cuda)
        self.times.append(time.perf_counter() - t0)
        self.fwd_bwd.append(t1 - t0)
        self.stats.append(self.opt.last_step_stats)
        if self.handle is not None:
            self.reports.append(self.handle.report())

    def close(self) -> None:
        self.opt.close()
        if self.handle is not None:
            self.handle.close()
        if self._close is not None:
            self._close()


@contextlib.contextmanager
def _one_rank_group() -> Iterator[None]:
    import torch.distributed as dist

    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("nccl", init_method=f"file://{os.path.join(d, 'pg')}", rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def _h2d_bandwidth() -> float:
    """Bytes per second of a 256 MiB pinned host-to-device copy (the best of 3)."""
    src = torch.empty(256 << 20, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty_like(src, device="cuda")
    best = 0.0
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        best = max(best, src.numel() / (time.perf_counter() - t0))
    return best


def _measure(
    *, layers: int, d: int, vocab: int, batch: int, seq: int, rounds: int, prefetch: int, cuda: bool, device: Any = "cpu"
) -> dict[str, Any]:
    """``device``: where the resident case and the batches go without CUDA (the simulated
    device's ``torch_device``, as a user moves them to "cuda")."""
    dev = "cuda" if cuda else device
    base = llama(layers, d, vocab, "cpu")
    n_params = sum(p.numel() for p in base.parameters())
    cases: list[_Case] = []
    m = copy.deepcopy(base)
    h = offload_weights(m, prefetch=prefetch)
    cases.append(_Case("streamed (offload_weights)", m, AdamW(m.parameters(), lr=1e-5, free_gradients=True), h))
    m = copy.deepcopy(base).to(dev)
    cases.append(_Case("resident, optimizer offloaded", m, AdamW(m.parameters(), lr=1e-5, free_gradients=True)))
    group = contextlib.ExitStack()
    if cuda:
        try:
            from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

            group.enter_context(_one_rank_group())
            m = copy.deepcopy(base)
            inner: Any = m.model
            for layer in inner.layers:
                fully_shard(layer, offload_policy=CPUOffloadPolicy())
            fully_shard(m, offload_policy=CPUOffloadPolicy())
            cases.append(_Case("FSDP2 + CPUOffloadPolicy + offload_adam", m, AdamW(m.parameters(), lr=1e-5), close=group.close))
        except Exception as e:  # reported, the other cases still run
            group.close()
            print(f"  FSDP2 + CPUOffloadPolicy: not measured ({type(e).__name__}: {e})")
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(1, vocab, (batch, seq + 1), generator=g).to(dev) for _ in range(rounds + 1)]
    for c in cases:
        c.step(data[0], cuda)  # warm-up: the order recorded, the state built
        c.times, c.fwd_bwd, c.stats, c.reports = [], [], [], []
    for x in data[1:]:
        for c in cases:
            c.step(x, cuda)
    out: dict[str, Any] = {"params": n_params, "layers": layers, "d": d, "batch": batch, "seq": seq, "cuda": cuda}
    for c in cases:
        out[c.name] = {
            "step_s": statistics.median(c.times),
            "fwd_bwd_s": statistics.median(c.fwd_bwd),
            "cpu_step_s": statistics.median(s.get("cpu_step_s", 0.0) for s in c.stats),
            "d2h_bytes": statistics.median(s.get("d2h_bytes", 0.0) for s in c.stats),
            "h2d_bytes_copy_back": statistics.median(s.get("h2d_bytes", 0.0) for s in c.stats),
        }
        if c.reports:
            rep = c.reports[-1]
            out[c.name].update(
                weights_h2d_bytes=statistics.median(r["h2d_bytes"] for r in c.reports),
                stall_s=statistics.median(r["stall_s"] for r in c.reports),
                gpu_peak_bytes=rep["gpu_peak_bytes"], gpu_resident_bytes=rep["gpu_resident_bytes"], ring_bytes=rep["ring_bytes"], streamed_bytes=rep["streamed_bytes"],
            )  # fmt: skip
        c.close()
    if cuda:
        out["h2d_Bps"] = _h2d_bandwidth()
    return out


def run(*, rounds: int, prefetch: int) -> dict[str, Any]:
    cuda = torch.cuda.is_available()
    if cuda:
        res = _measure(layers=16, d=2048, vocab=32000, batch=4, seq=512, rounds=rounds, prefetch=prefetch, cuda=True)
    else:
        with testing.simulated_device(max_delay_s=0.0, lazy=False) as sim:
            res = _measure(layers=4, d=256, vocab=2048, batch=2, seq=64, rounds=rounds, prefetch=prefetch, cuda=False, device=sim.torch_device)
    where = "GPU" if cuda else "SIMULATED device on the CPU: times are the CPU's, not a GPU's; the bytes are a GPU's"
    print(
        f"training with streamed weights, {res['params'] / 1e6:.1f}M bf16 parameters ({res['layers']} layers, d {res['d']}), "
        f"batch {res['batch']}x{res['seq']}, prefetch {prefetch}, median of {rounds} interleaved rounds; {where}"
    )
    for name, v in res.items():
        if not isinstance(v, dict):
            continue
        line = (
            f"  {name:40s} step {v['step_s'] * 1e3:9.1f} ms (forward+backward {v['fwd_bwd_s'] * 1e3:.1f}, kernel "
            f"{v['cpu_step_s'] * 1e3:.1f}); down {v['d2h_bytes'] / 2**20:.1f} MiB, copied back {v['h2d_bytes_copy_back'] / 2**20:.1f} MiB"
        )
        if "weights_h2d_bytes" in v:
            line += (
                f"; weights up {v['weights_h2d_bytes'] / 2**20:.1f} MiB ({v['weights_h2d_bytes'] / v['streamed_bytes']:.2f}x), "
                f"stalled {v['stall_s'] * 1e3:.1f} ms, streamer peak {v['gpu_peak_bytes'] / 2**20:.1f} MiB "
                f"(ring {v['ring_bytes'] / 2**20:.1f})"
            )
        print(line)
    s = res["streamed (offload_weights)"]
    fsdp = res.get("FSDP2 + CPUOffloadPolicy + offload_adam")
    if fsdp is not None:
        print(f"  streamed / FSDP2 step time {s['step_s'] / fsdp['step_s']:.2f}x (target <= 0.8x)")
    if cuda:
        compute = res["resident, optimizer offloaded"]["fwd_bwd_s"]
        pcie = (s["weights_h2d_bytes"] + s["d2h_bytes"]) / res["h2d_Bps"]
        bound = max(compute, pcie, s["cpu_step_s"])
        print(
            f"  bound max(compute {compute * 1e3:.1f}, PCIe {pcie * 1e3:.1f} at {res['h2d_Bps'] / 1e9:.1f} GB/s, CPU step "
            f"{s['cpu_step_s'] * 1e3:.1f}) ms: streamed at {s['step_s'] / bound:.2f}x of it (target <= 1.1x)"
        )
    else:
        print("  on a GPU (owed: none here): the step against FSDP2 + CPUOffloadPolicy and against the bound")
    return res
