"""Pinned host memory: what copies to and from a device read and write asynchronously.

torch's pinned allocator (``pin_memory()``, ``torch.empty(pin_memory=True)``) rounds every block
up to a power of two, 1.5-1.9x the bytes asked for. A :class:`PinnedArena` allocates exactly
what is asked (up to its alignment), through its device's ``host_buffer``: ordinary host memory
registered once (``cudaHostRegister`` on a GPU), released only after the device's streams have
drained, once it is garbage. The arena counts the bytes its client holds, for reports.

A :class:`SlabPool` carves regions out of an arena's slabs (first fit, reused once released, each
region remembering the device copies that used it last): one per device, shared by every client
that pins short-lived bytes (activations saved for backward), so that nothing is pinned twice and
a client made each step pins nothing new.
"""

from __future__ import annotations

import ctypes
import itertools
import sys
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .device import Device


def trim_host_memory() -> None:
    """Hands the host memory freed so far back to the system (glibc's ``malloc_trim``), after
    large short-lived buffers: once one is freed glibc serves allocations of up to its size from
    its heap instead of mapping them, and freed heap pages stay resident. Loading a 283 MB
    checkpoint quantized block by block grew the peak by 665 MB without it, 190 MB with it (this trim after each block).
    Elsewhere than Linux with glibc: nothing."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None).malloc_trim(0)
        except (OSError, AttributeError):  # (another C library)
            pass


HUGE_PAGE = 2 << 20  # a transparent huge page on x86-64 and arm64 (4 KiB base pages)
MADV_HUGEPAGE = 14  # <sys/mman.h> on Linux


def advise_huge_pages(t: Tensor) -> bool:
    """Asks Linux for transparent huge pages (``madvise(MADV_HUGEPAGE)``) over the whole 2 MiB
    pages inside ``t``'s memory, before it is first written: where transparent huge pages are in
    ``madvise`` mode (the default of many distributions) a large weight buffer is otherwise
    faulted in 4 KiB pages, and a decode that reads every byte once per token walks the page
    tables for each (the kernel's large-folio page cache maps a file that llama.cpp reads
    through ``mmap`` with 2 MiB entries: docs/benchmarks.md). Only advice: the memory and its
    contents are the same either way. Whether it was given (False elsewhere than Linux, or for
    less than one huge page)."""
    if not sys.platform.startswith("linux") or t.device.type != "cpu":
        return False
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    a, b = -(-start // HUGE_PAGE) * HUGE_PAGE, end // HUGE_PAGE * HUGE_PAGE
    if b <= a:
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.madvise(ctypes.c_void_p(a), ctypes.c_size_t(b - a), MADV_HUGEPAGE)) == 0
    except (OSError, AttributeError):  # (another C library)
        return False


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

    def alloc(self, n: int, dtype: torch.dtype, *, align: int = 64, pin: bool = True) -> Tensor:
        """``n`` zeroed elements of pinned host memory starting on an ``align``-byte boundary
        (4096 for O_DIRECT transfers; host memory is 64-byte aligned anyway). ``pin=False``:
        untouched memory, neither zeroed nor pinned, for the caller to fill and then :meth:`pin`
        (the offload's host copies of the weights: huge pages asked for, :func:`advise_huge_pages`)."""
        es = torch.empty((), dtype=dtype).element_size()
        if align % es:
            raise ValueError(f"align {align} is not a multiple of the element size {es}")
        extra = align // es if align > 64 else 0
        raw = self.device.host_buffer(n + extra, dtype) if pin else self.device.host_empty(n + extra, dtype)
        if not pin:
            advise_huge_pages(raw)  # (untouched: faulted in huge pages as the caller fills it)
        skip = (-raw.data_ptr() % align) // es
        key = next(self._numbers)
        self._live[key] = raw.untyped_storage().nbytes()
        weakref.finalize(raw.untyped_storage(), self._live.pop, key, None)
        return raw[skip : skip + n]

    def pin(self, t: Tensor) -> None:
        """Pins an allocation made with ``pin=False`` (once filled)."""
        self.device.pin(t)


def align_up(n: int, a: int) -> int:
    """``n`` rounded up to a multiple of ``a``."""
    return -(-n // a) * a


class FreeList:
    """First-fit allocation of byte ranges in segments made on demand by ``grow(nbytes)`` (the
    new segment's number and size, at least ``nbytes``): pinned slabs, file segments. Freed
    ranges merge with their neighbours."""

    def __init__(self, grow: Callable[[int], tuple[int, int]], align: int) -> None:
        self.grow = grow
        self.align = align
        self.free: dict[int, list[tuple[int, int]]] = {}  # segment -> sorted (start, end) free

    def alloc(self, nbytes: int) -> tuple[int, int]:
        n = align_up(max(nbytes, 1), self.align)
        for seg, spans in self.free.items():
            for k, (a, b) in enumerate(spans):
                if b - a >= n:
                    spans[k : k + 1] = [(a + n, b)] if b - a > n else []
                    return seg, a
        seg, size = self.grow(n)
        self.free[seg] = [(n, size)] if size > n else []
        return seg, 0

    def release(self, seg: int, start: int, nbytes: int) -> None:
        end = start + align_up(max(nbytes, 1), self.align)
        spans = self.free[seg]
        spans.append((start, end))
        spans.sort()
        merged: list[tuple[int, int]] = []
        for a, b in spans:
            if merged and merged[-1][1] == a:
                merged[-1] = (merged[-1][0], b)
            else:
                merged.append((a, b))
        self.free[seg] = merged


SLAB = 64 << 20  # bytes of a pinned slab (a larger request gets one its size)


@dataclass(eq=False)
class Region:
    """Pinned host bytes of a :class:`SlabPool`. ``after``: events of the device copies that
    used these bytes last (released with them, maybe still running): a new use of the region
    is ordered after them (a stream wait for a copy, a host wait for the host's own writes)."""

    host: Tensor  # uint8
    seg: int
    start: int
    nbytes: int
    after: list[Any]


class SlabPool:
    """Pinned host regions carved first-fit from slabs of an arena, reused once released: one per
    device and alignment in the process (:func:`slab_pool`), shared by every client and handle,
    so that a handle made each step pins nothing new. Slabs grow with what is held (1 MiB, then
    the total so far, up to :data:`SLAB`) and are kept for the process, as torch's caching host
    allocator keeps its blocks; :meth:`trim` gives back the slabs nothing uses."""

    def __init__(self, device: Device, align: int) -> None:
        self.device = device
        self.arena = PinnedArena(device)
        self.slabs: list[Tensor | None] = []
        self.list = FreeList(self._slab, align)
        self.lock = threading.RLock()
        self._used: list[tuple[int, int, int, Any]] = []  # (slab, start, end, event) of released ranges

    def _slab(self, n: int) -> tuple[int, int]:
        held = sum(t.numel() for t in self.slabs if t is not None)
        n = max(n, min(SLAB, max(1 << 20, held)))
        self.slabs.append(self.arena.alloc(n, torch.uint8, align=self.list.align if self.list.align > 64 else 64))
        return len(self.slabs) - 1, n

    @property
    def nbytes(self) -> int:
        """Pinned bytes the pool holds."""
        return self.arena.nbytes

    def alloc(self, nbytes: int) -> Region:
        with self.lock:
            seg, off = self.list.alloc(nbytes)
            end = off + align_up(max(nbytes, 1), self.list.align)
            q = self.device.query
            self._used = [u for u in self._used if not q(u[3])]
            after = [u[3] for u in self._used if u[0] == seg and u[1] < end and off < u[2]]
            slab = self.slabs[seg]
            assert slab is not None
            return Region(slab[off : off + nbytes], seg, off, nbytes, after)

    def release(self, r: Region, *events: Any) -> None:
        """``r`` is free again; ``events``: the device copies that may still use it."""
        with self.lock:
            end = r.start + align_up(max(r.nbytes, 1), self.list.align)
            for e in events:
                if e is not None:
                    self._used.append((r.seg, r.start, end, e))
            self.list.release(r.seg, r.start, r.nbytes)

    def trim(self) -> int:
        """Gives back the slabs no region uses (after the copies that used them); the bytes."""
        freed = 0
        with self.lock:
            for seg, spans in self.list.free.items():
                slab = self.slabs[seg]
                if slab is not None and spans == [(0, slab.numel())]:
                    for u in self._used:
                        if u[0] == seg:
                            self.device.host_wait(u[3])
                    self._used = [u for u in self._used if u[0] != seg]
                    freed += slab.numel()
                    self.slabs[seg] = None
                    spans.clear()  # the segment is gone: nothing is carved from it again
        return freed


_pools: weakref.WeakKeyDictionary[Any, dict[int, SlabPool]] = weakref.WeakKeyDictionary()
_pools_lock = threading.Lock()


def slab_pool(device: Device, align: int) -> SlabPool:
    """The process's :class:`SlabPool` of ``device`` for ``align``-byte regions (it lives as long
    as the device)."""
    with _pools_lock:
        by_align = _pools.setdefault(device, {})
        pool = by_align.get(align)
        if pool is None:
            pool = by_align[align] = SlabPool(device, align)
        return pool
