"""asv suite: time and peak memory of one optimizer step, over size, dtype and threads, with
torch's fused AdamW as the reference benchmark, and the bare kernel on every SIMD path.

Run against the installed package: ``cd asv_bench && asv run --python=same --quick``.
"""

from __future__ import annotations

import torch

import offload_adam
from offload_adam import _native, testing

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _params(numel: int, dtype: torch.dtype, tensors: int = 8, device: torch.device | None = None) -> list[torch.nn.Parameter]:
    n = numel // tensors
    ps = []
    for _ in range(tensors):
        p = torch.nn.Parameter(torch.randn(n).to(dtype).to(device))
        p.grad = (torch.randn(n) * 1e-2).to(dtype).to(device)
        ps.append(p)
    return ps


class OptimizerStep:
    """``offload_adam.AdamW.step()`` on 8 tensors."""

    params = ([1_000_000, 16_000_000], list(DTYPES), [1, 2])
    param_names = ["numel", "dtype", "threads"]
    timeout = 300

    def setup(self, numel: int, dtype: str, threads: int) -> None:
        self.opt = offload_adam.AdamW(_params(numel, DTYPES[dtype]), lr=1e-4, num_threads=threads)
        self.opt.step()

    def time_step(self, numel: int, dtype: str, threads: int) -> None:
        self.opt.step()

    def peakmem_step(self, numel: int, dtype: str, threads: int) -> None:
        self.opt.step()


class TorchFusedStep:
    """Reference: ``torch.optim.AdamW(fused=True).step()`` on the same tensors."""

    params = ([1_000_000, 16_000_000], list(DTYPES), [1, 2])
    param_names = ["numel", "dtype", "threads"]
    timeout = 300

    def setup(self, numel: int, dtype: str, threads: int) -> None:
        torch.set_num_threads(threads)
        self.opt = torch.optim.AdamW(_params(numel, DTYPES[dtype]), lr=1e-4, fused=True)
        self.opt.step()

    def teardown(self, numel: int, dtype: str, threads: int) -> None:
        torch.set_num_threads(1)

    def time_step(self, numel: int, dtype: str, threads: int) -> None:
        self.opt.step()

    def peakmem_step(self, numel: int, dtype: str, threads: int) -> None:
        self.opt.step()


class ManySmallTensors:
    """1000 tensors of 10k elements: per-tensor overhead, ours against torch fused."""

    params = (["offload_adam", "torch_fused"],)
    param_names = ["optimizer"]

    def setup(self, which: str) -> None:
        ps = []
        for _ in range(1000):
            p = torch.nn.Parameter(torch.randn(10_000))
            p.grad = torch.randn(10_000)
            ps.append(p)
        if which == "offload_adam":
            self.opt: torch.optim.Optimizer = offload_adam.AdamW(ps, lr=1e-4)
        else:
            self.opt = torch.optim.AdamW(ps, lr=1e-4, fused=True)
        self.opt.step()

    def time_step(self, which: str) -> None:
        self.opt.step()


class OffloadedStep:
    """The offloaded path (buckets, landing buffers, copy-back) on 8 tensors through a simulated
    device whose copies run only when waited for; ``track_kernel_s`` is the kernel's part."""

    params = ([16_000_000], [2])
    param_names = ["numel", "threads"]
    timeout = 300

    def setup(self, numel: int, threads: int) -> None:
        with testing.simulated_device(max_delay_s=0.0, lazy=False, copies_on_demand=True, keep_open=True) as sim:
            self.ps = _params(numel, torch.float32, device=sim.torch_device)  # on the device, as on "cuda"
            self.opt = offload_adam.AdamW(self.ps, lr=1e-4, num_threads=threads, bucket_mb=8)
        self.opt.step()

    def time_step(self, numel: int, threads: int) -> None:
        self.opt.step()

    def track_kernel_s(self, numel: int, threads: int) -> float:
        self.opt.step()
        return self.opt.last_step_stats["cpu_step_s"]


class NvmeStep:
    """The NVMe tier (state in files under a temporary directory of the default temp dir, i.e.
    this machine's disk), fp32 and bf16 moments on 8 tensors; ``track_raw_share`` is the step's
    bytes moved per second over the disk's raw O_DIRECT bandwidth measured in setup."""

    params = ([16_000_000], ["float32", "bfloat16"])
    param_names = ["numel", "state_dtype"]
    timeout = 300

    def setup(self, numel: int, state_dtype: str) -> None:
        import tempfile

        from offload_adam.tools.nvme_bench import raw_bandwidth

        self.dir = tempfile.TemporaryDirectory(prefix="offload-adam-asv-")
        self.raw = raw_bandwidth(self.dir.name, 256 << 20, rounds=1)
        self.opt = offload_adam.AdamW(
            _params(numel, torch.float32), lr=1e-4, offload="nvme", nvme_dir=self.dir.name,
            state_dtype=DTYPES[state_dtype], bucket_mb=8,
        )  # fmt: skip
        self.opt.step()

    def teardown(self, numel: int, state_dtype: str) -> None:
        self.opt.close()
        self.dir.cleanup()

    def time_step(self, numel: int, state_dtype: str) -> None:
        self.opt.step()

    def track_raw_share(self, numel: int, state_dtype: str) -> float:
        import time

        t0 = time.perf_counter()
        self.opt.step()
        dt = time.perf_counter() - t0
        s = self.opt.last_step_stats
        return (s["read_bytes"] / self.raw["read_Bps"] + s["write_bytes"] / self.raw["write_Bps"]) / dt


class Kernel:
    """The bare kernel (``_native.adam_update``) on one flat buffer, per SIMD path."""

    params = (offload_adam.simd_paths(), ["float32", "bfloat16"])
    param_names = ["simd", "grad_dtype"]

    def setup(self, simd: str, grad_dtype: str) -> None:
        n = 4_000_000
        self.bufs = (torch.randn(n), (torch.randn(n) * 1e-2).to(DTYPES[grad_dtype]), torch.zeros(n), torch.zeros(n))
        self.simd = simd

    def time_adam_update(self, simd: str, grad_dtype: str) -> None:
        _native.adam_update(*self.bufs, step=1, simd=self.simd, num_threads=1)

    def time_grad_sq_norm(self, simd: str, grad_dtype: str) -> None:
        _native.grad_sq_norm([self.bufs[1]], simd=self.simd)
