"""Pinned host memory: what copies to and from a device read and write asynchronously.

torch's pinned allocator (``pin_memory()``, ``torch.empty(pin_memory=True)``) rounds every block
up to a power of two, 1.5-1.9x the bytes asked for. A :class:`PinnedArena` allocates exactly
what is asked (up to its alignment), through its device's ``host_buffer``: ordinary host memory
registered once (``cudaHostRegister`` on a GPU), released only after the device's streams have
drained, once it is garbage. The arena counts the bytes its client holds, for reports.
"""

from __future__ import annotations

import itertools
import weakref

import torch
from torch import Tensor

from .device import Device


class PinnedArena:
    """Exact-size pinned host allocations of one client of ``device``."""

    def __init__(self, device: Device) -> None:
        self.device = device
        self._live: dict[int, int] = {}  # allocation number -> its bytes, while alive
        self._numbers = itertools.count()

    @property
    def nbytes(self) -> int:
        """Bytes of this arena's allocations still alive."""
        return sum(self._live.values())

    def alloc(self, n: int, dtype: torch.dtype, *, align: int = 64) -> Tensor:
        """``n`` zeroed elements of pinned host memory starting on an ``align``-byte boundary
        (4096 for O_DIRECT transfers; host memory is 64-byte aligned anyway)."""
        es = torch.empty((), dtype=dtype).element_size()
        if align % es:
            raise ValueError(f"align {align} is not a multiple of the element size {es}")
        extra = align // es if align > 64 else 0
        raw = self.device.host_buffer(n + extra, dtype)
        skip = (-raw.data_ptr() % align) // es
        key = next(self._numbers)
        self._live[key] = raw.untyped_storage().nbytes()
        weakref.finalize(raw.untyped_storage(), self._live.pop, key, None)
        return raw[skip : skip + n]
