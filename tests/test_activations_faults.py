"""Activations offloaded, when the backward raises (a hook's out-of-memory, a corrupted page, a
saved tensor gone with the files), on the simulated device, models and inputs moved there as to
"cuda". (torch aborted the process when a backward raised on a device type registered from
Python: the simulated device's guard takes the pending error off the thread, see
``offload_adam.testing.simbackend._Guard``.)"""

from __future__ import annotations

import os

import pytest
import torch
from helpers import to_device
from test_activations import _Chain, _open_under, nvme_dir  # noqa: F401 (nvme_dir: the fixture)

import offload_adam
from offload_adam import testing


def test_a_prefetched_buffer_dropped_before_its_unpack_is_not_reused_under_its_copy() -> None:
    """Finding 5: a backward that raises midway (an OOM-retry loop) drops the storages prefetched
    for it before their unpack; the buffers they were being copied into go back to the caching
    allocator, which must not hand them out while their copies still write them. The simulator
    reuses freed device memory at the next allocation of the compute stream and flags a reuse
    that no ``keep_until_done`` held."""
    with testing.simulated_device(seed=2, max_delay_s=0.02) as sim:
        m = to_device(_Chain())
        x = to_device(torch.randn(64, 64)).requires_grad_()
        with offload_adam.offload_activations(min_bytes=1024, prefetch=3) as ao:
            h = m(x)
            mid = m.layers[3].weight  # its gradient comes after the last layers' unpacks

            def boom(_: torch.Tensor) -> None:
                raise RuntimeError("out of memory (test)")

            hook = mid.register_hook(boom)
            with pytest.raises(RuntimeError, match="out of memory"):
                h.sum().backward()
            hook.remove()
            del h  # the graph, and the storages prefetched for it, go
            for _ in range(2):
                m(x).sum().backward()  # allocations of the same sizes on the compute stream
        assert ao.report()["prefetched"] > 0
        ao.close()
    assert sim.violations == []


def test_an_activation_page_carries_a_crc(nvme_dir: str) -> None:
    """The activations' NVMe ranges go through the runtime's page store, CRC included (they had
    none): a range corrupted on the disk is a clear error naming the file when it is read back."""
    with testing.simulated_device(seed=2, max_delay_s=0.0):
        m = to_device(_Chain())
        x = to_device(torch.randn(64, 64)).requires_grad_()
        with offload_adam.offload_activations(min_bytes=1024, storage="nvme", nvme_dir=nvme_dir, prefetch=0) as ao:
            loss = m(x).sum()
        ao.flush()  # every saved storage on the SSD, whether or not its copy out had run by the last save
        assert ao.store is not None and ao.report()["write_bytes"] > 0
        f = ao.files[0]
        with open(f.path, "r+b") as fh:
            fh.seek(4096 + 10)  # the second range
            fh.write(b"\x7f" * 4)
        with pytest.raises(OSError, match=r"activations-0\.bin: a saved storage of \d+ bytes is corrupted \(checksum mismatch\)"):
            loss.backward()
        del loss
        ao.close()


def test_a_saved_tensor_on_the_ssd_after_close_is_a_clear_error(nvme_dir: str) -> None:
    """close() closes the files (their space given back): a graph whose saved tensors were
    written there cannot run its backward afterwards, and says why."""
    with testing.simulated_device(seed=5, max_delay_s=0.0):
        m = to_device(_Chain())
        x = to_device(torch.randn(64, 64)).requires_grad_()
        with offload_adam.offload_activations(min_bytes=1024, storage="nvme", nvme_dir=nvme_dir, prefetch=0) as ao:
            loss = m(x).sum()
        ao.flush()
        ao.close()
        assert os.listdir(nvme_dir) == [] and _open_under(nvme_dir) == []
        with pytest.raises(RuntimeError, match="needed after close.. removed its files: with storage='nvme', run the backward before"):
            loss.backward()
