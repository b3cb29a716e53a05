"""The offload runtime, on its own (it knows nothing of optimizers or weights): one device per
torch device, the pinned arena, the pager, the module schedule."""

from __future__ import annotations

import gc

import pytest
import torch

from offload_adam import testing
from offload_adam.runtime.device import device_for
from offload_adam.runtime.pinned import PinnedArena

# -- devices ------------------------------------------------------------------------------------


def test_cpu_tensors_have_no_device_unless_one_is_installed() -> None:
    assert device_for(torch.device("cpu")) is None
    with testing.simulated_device(max_delay_s=0.0) as sim:
        assert device_for(torch.device("cpu")) is sim
    assert device_for(torch.device("cpu")) is None
    with pytest.raises(ValueError, match="meta: not supported"):
        device_for(torch.device("meta"))


@pytest.mark.cuda
def test_one_cuda_device_per_torch_device() -> None:
    a, b = device_for(torch.device("cuda")), device_for(torch.device("cuda", torch.cuda.current_device()))
    assert a is b and a is not None and a.h2d is b.h2d


# -- the pinned arena ---------------------------------------------------------------------------


@pytest.mark.parametrize("align", [64, 4096])
def test_the_arena_allocates_exactly_what_is_asked_and_counts_it(align: int) -> None:
    with testing.simulated_device(max_delay_s=0.0) as sim:
        arena = PinnedArena(sim)
        n = 3 * 1000 + 7  # far from a power of two
        t = arena.alloc(n, torch.bfloat16, align=align)
        assert t.numel() == n and t.dtype == torch.bfloat16 and t.data_ptr() % align == 0
        assert bool((t == 0).all())
        slack = align if align > 64 else 0
        assert n * 2 <= arena.nbytes <= n * 2 + slack
        view = t[10:20]
        del t
        gc.collect()
        assert arena.nbytes > 0  # a view keeps the allocation
        del view
        gc.collect()
        assert arena.nbytes == 0


def test_an_allocation_is_released_only_after_the_copies_queued_on_it() -> None:
    """The simulator's release models cudaHostUnregister under a DMA: with the release waiting
    for the streams (as the CUDA device's finalizer does) no copy touches released memory."""
    with testing.simulated_device(max_delay_s=0.01) as sim:
        arena = PinnedArena(sim)
        src = arena.alloc(1000, torch.float32)
        src.fill_(3.0)
        dst = torch.zeros(1000)
        sim.copy([(dst, src)], sim.h2d)
        del src
        gc.collect()
        sim.drain()
        assert sim.violations == [] and bool((dst == 3.0).all())
