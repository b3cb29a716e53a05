"""The device a GPU bench runs on: CUDA, or the simulated device for a dry run of the bench.

A dry run (``--simulate``: ``GPU_CHECK_DRY=1 .ci/gpu_check.sh`` in CI) runs the same code at tiny
sizes on :func:`offload_adam.testing.simulated_device` (its tensors on ``simgpu``, the CPU's memory),
so that a typo or an import error fails here and not on the GPU machine's one start. Its figures
mean nothing: the memory figures are None there (torch's allocator statistics are CUDA's), and a
copy the simulator finds unordered fails the run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def is_cuda(dev: torch.device) -> bool:
    return dev.type == "cuda"


def synchronize(dev: torch.device) -> None:
    """Waits for everything queued on ``dev`` (on the simulated device: its side streams)."""
    if is_cuda(dev):
        torch.cuda.synchronize(dev)
        return
    from ..runtime.device import device_for

    d = device_for(dev)
    if d is not None:
        d.synchronize()


def reset_peak(dev: torch.device) -> None:
    """Starts ``dev``'s peak of allocated memory afresh (CUDA only)."""
    if is_cuda(dev):
        torch.cuda.reset_peak_memory_stats(dev)


def allocated(dev: torch.device) -> int | None:
    """Bytes of tensors allocated on ``dev`` now (None off CUDA)."""
    return torch.cuda.memory_allocated(dev) if is_cuda(dev) else None


def peak(dev: torch.device) -> int | None:
    """The most bytes of tensors allocated on ``dev`` at once since :func:`reset_peak` (None off
    CUDA)."""
    return torch.cuda.max_memory_allocated(dev) if is_cuda(dev) else None


def gib(n: int | None) -> str:
    """``n`` bytes in GiB for a table, or "n/a" (a dry run)."""
    return "n/a" if n is None else f"{n / 2**30:.2f} GiB"


@contextlib.contextmanager
def device(simulate: bool) -> Iterator[torch.device]:
    """The bench's device: the current CUDA device, or with ``simulate`` the simulated one (its
    ordering violations, if any, raised at the end)."""
    if not simulate:
        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device here (--simulate runs the bench on the simulated device)")
        yield torch.device("cuda", torch.cuda.current_device())
        return
    from .. import testing

    with testing.simulated_device(max_delay_s=0.0) as sim:
        yield sim.torch_device
        sim.synchronize()
    if sim.violations:
        raise RuntimeError(f"the simulated device found {len(sim.violations)} unordered copies: {sim.violations[:3]}")
