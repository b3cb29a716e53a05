"""Activations offloaded: the tensors a forward saves for backward go to pinned host memory
(or NVMe) during the forward and come back during the backward, ahead of need.

A pack hook (``torch.autograd.graph.saved_tensors_hooks``) sees each tensor the forward saves.
Kept as they are: tensors whose storage is under ``min_bytes``, parameters and views of them
(leaves that require a gradient), tensors not on the device, wrapper subclasses. Every other one is offloaded **by
storage**: a storage saved twice, or through two views, is copied once, and each saved tensor
comes back as the same view of the restored storage.

- **Out.** The d2h side stream waits an event of the compute stream recorded at the save,
  copies the storage's bytes into a region of the :class:`HostPool` (pinned slabs from the
  runtime's arena, first-fit, regions reused once their tensors are freed: no per-tensor
  pinning, no power-of-two rounding) and keeps the device storage alive until the copy has run;
  the caching allocator may then reuse it.
- **Back.** Unpacking a saved tensor (the backward needs it) copies its storage into fresh
  device memory on the h2d side stream unless a prefetch did; the compute stream waits that
  copy's event (a stream wait, timed: ``stall_s``); the ``prefetch`` storages saved just before
  it (what the backward needs next) are copied too. A region is reused only after the copies
  that read it (the d2h stream waits the h2d stream's event of its release).
- **NVMe** (``storage="nvme"``): a region whose d2h copy has run is written to a file of a run
  directory (I/O engine, ``O_DIRECT``) and released once written; a load reads it back into a
  region (the host waits the read: ``io_wait_s``), copies it up and releases that region after
  the copy. The file space of a freed storage is reused; the files go at ``close()``.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch import Tensor

from ..runtime.device import Device, Meter, stream_device
from ..runtime.pager import ALIGN, RunDir
from ..runtime.pinned import PinnedArena

STORAGES = ("cpu", "nvme")
SLAB = 64 << 20  # bytes of a pinned slab or a file segment (a larger storage gets one its size)


def _align(n: int, a: int) -> int:
    return -(-n // a) * a


class FreeList:
    """First-fit allocation of byte ranges in segments made on demand by ``grow(nbytes)`` (the
    new segment's number and size, at least ``nbytes``): pinned slabs, file segments. Freed ranges merge with their neighbours."""

    def __init__(self, grow: Callable[[int], tuple[int, int]], align: int) -> None:
        self.grow = grow
        self.align = align
        self.free: dict[int, list[tuple[int, int]]] = {}  # segment -> sorted (start, end) free

    def alloc(self, nbytes: int) -> tuple[int, int]:
        n = _align(max(nbytes, 1), self.align)
        for seg, spans in self.free.items():
            for k, (a, b) in enumerate(spans):
                if b - a >= n:
                    spans[k : k + 1] = [(a + n, b)] if b - a > n else []
                    return seg, a
        seg, size = self.grow(n)
        self.free[seg] = [(n, size)] if size > n else []
        return seg, 0

    def release(self, seg: int, start: int, nbytes: int) -> None:
        end = start + _align(max(nbytes, 1), self.align)
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


class HostPool:
    """Pinned host regions for offloaded storages (see the module documentation)."""

    def __init__(self, device: Device, align: int) -> None:
        self.arena = PinnedArena(device)
        self.slabs: list[Tensor] = []
        self.list = FreeList(self._slab, align)

    def _slab(self, n: int) -> tuple[int, int]:
        # Slabs grow with what is held (1 MiB, then the total so far, up to SLAB): a small
        # model's activations take little more than they need.
        n = max(n, min(SLAB, max(1 << 20, sum(t.numel() for t in self.slabs))))
        self.slabs.append(self.arena.alloc(n, torch.uint8, align=ALIGN))
        return len(self.slabs) - 1, n

    @property
    def nbytes(self) -> int:
        return self.arena.nbytes

    def alloc(self, nbytes: int) -> tuple[Tensor, tuple[int, int]]:
        seg, off = self.list.alloc(nbytes)
        return self.slabs[seg][off : off + nbytes], (seg, off)

    def release(self, where: tuple[int, int], nbytes: int) -> None:
        self.list.release(where[0], where[1], nbytes)


@dataclass(eq=False)
class _Item:
    """One offloaded storage."""

    ptr: int  # its storage's address when saved
    nbytes: int
    d2h_event: Any
    probe: Any  # a weak reference to a tensor of the storage: the storage lives while it does
    host: Tensor | None = None  # its host region (NVMe: until written)
    where: tuple[int, int] | None = None  # the region's place in the pool
    file: tuple[int, int] | None = None  # NVMe: (segment, offset) of its bytes
    writing: Any = None  # NVMe: the write's ticket
    refs: int = 0  # saved tensors packed from it and alive
    unpacked: int = 0
    dev: Tensor | None = None  # its bytes back on the device (uint8), until unpacked
    h2d_event: Any = None
    freed: bool = False
    prev: _Item | None = None  # the storage saved just before it and still alive
    next: _Item | None = None


@dataclass(eq=False)
class _Packed:
    """What autograd keeps of an offloaded saved tensor."""

    item: _Item
    dtype: torch.dtype
    shape: torch.Size
    stride: tuple[int, ...]
    offset: int


@dataclass
class _Stats:
    offloaded_bytes: int = 0
    kept_bytes: int = 0
    d2h_bytes: int = 0
    h2d_bytes: int = 0
    offloaded_tensors: int = 0
    kept_tensors: int = 0
    deduplicated_tensors: int = 0
    loads: int = 0
    prefetched: int = 0
    read_bytes: int = 0
    write_bytes: int = 0
    io_wait_s: float = 0.0
    stalls: list[tuple[Any, Any]] = field(default_factory=list)


class ActivationOffload:
    """The handle :func:`offload_activations` returns (see the module documentation)."""

    def __init__(
        self, device: Device, *, min_bytes: int, prefetch: int, storage: str, nvme_dir: Any, modules: list[torch.nn.Module]
    ) -> None:
        self.device = device
        self.min_bytes = min_bytes
        self.prefetch = prefetch
        self.storage = storage
        self.meter = Meter()
        self.nvme_dir = nvme_dir
        self.run: RunDir | None = None  # NVMe: made at the first offload, removed when nothing is saved
        self.pool = HostPool(device, ALIGN if storage == "nvme" else 512)
        self.files: list[int] = []
        self.disk = FreeList(self._segment, ALIGN)
        self.lock = threading.RLock()
        self.items: dict[int, _Item] = {}  # saved and alive, in the order saved (by id)
        self.last: _Item | None = None  # the last one saved (the tail of the prev/next chain)
        self.by_ptr: dict[int, _Item] = {}
        self.writes: list[_Item] = []  # NVMe: regions to write once their d2h copy has run
        self.free_event: Any = None  # the h2d copies that read a region before its release
        self.stats = _Stats()
        self._hooks: list[Any] = []  # saved_tensors_hooks contexts entered, innermost last
        for m in modules:
            if not isinstance(m, torch.nn.Module):
                raise TypeError(f"modules: expected nn.Modules, got a {type(m).__name__}")
        self._handles = [h for m in modules for h in self._attach(m)]
        self.closed = False

    # -- the hooks ------------------------------------------------------------------------------

    def _enter(self) -> None:
        ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        ctx.__enter__()
        self._hooks.append(ctx)

    def _exit(self) -> None:
        if self._hooks:
            self._hooks.pop().__exit__(None, None, None)

    def _attach(self, m: torch.nn.Module) -> list[Any]:
        return [
            m.register_forward_pre_hook(lambda *_: self._enter()),
            m.register_forward_hook(lambda *_: self._exit(), always_call=True),
        ]

    def __enter__(self) -> ActivationOffload:
        if self.closed:
            raise RuntimeError("offload_activations: this handle is closed")
        if not self._handles:
            self._enter()
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self._handles:
            self._exit()
        with self.lock:
            self._maybe_remove_files()

    def _maybe_remove_files(self) -> None:
        """NVMe: once the context has ended and every saved tensor is gone (the backward has
        run), the run directory goes (a next forward makes a new one)."""
        if self.run is not None and not self._hooks and not self.items:
            self._write_behind(all_of_them=True)
            self.run.close()
            self.run, self.files, self.disk = None, [], FreeList(self._segment, ALIGN)

    # -- out ------------------------------------------------------------------------------------

    def _keep(self, t: Tensor) -> bool:
        if t.device != self.device.torch_device or t.layout != torch.strided:
            return True  # a host tensor already, or no plain storage to copy
        if type(t).__torch_dispatch__ is not Tensor.__torch_dispatch__:
            return True  # a wrapper subclass
        base = t._base if t._base is not None else t
        if isinstance(base, torch.nn.Parameter) or (base.is_leaf and base.requires_grad):
            return True  # a parameter, or a view of one (F.linear saves weight.t())
        return t.untyped_storage().nbytes() < self.min_bytes

    def _pack(self, t: Tensor) -> Any:
        if self._keep(t):
            self.stats.kept_bytes += t.numel() * t.element_size()
            self.stats.kept_tensors += 1
            return t
        with self.lock:
            st = t.untyped_storage()
            ptr = st.data_ptr()
            item = self.by_ptr.get(ptr)
            if item is not None:
                alive = item.probe()
                if item.freed or alive is None or alive.untyped_storage().data_ptr() != ptr:
                    item = None  # that storage may be gone and its memory reused
            if item is None:
                item = self._offload(t, st)
                self.by_ptr[ptr] = item
            else:
                self.stats.deduplicated_tensors += 1
            item.refs += 1
            packed = _Packed(item, t.dtype, t.shape, t.stride(), int(t.storage_offset()))
            weakref.finalize(packed, self._dropped, item)
            if self.storage == "nvme":
                self._write_behind()
            return packed

    def _offload(self, t: Tensor, st: Any) -> _Item:
        dev = self.device
        nbytes = st.nbytes()
        host, where = self.pool.alloc(nbytes)
        src = torch.empty(0, dtype=torch.uint8, device=t.device).set_(st)
        # After the work that made the tensor (the compute stream, now), and after the copies
        # that read a released region (this one may be it).
        dev.stream_waits(dev.d2h, dev.record_current())
        if self.free_event is not None:
            dev.stream_waits(dev.d2h, self.free_event)
        with torch.profiler.record_function("offload_adam.activations_d2h"):
            dev.copy([(host, src)], dev.d2h)
        ev = dev.record(dev.d2h)
        dev.keep_until_done(src, dev.d2h)  # the device storage stays until its copy has run
        item = _Item(st.data_ptr(), nbytes, ev, weakref.ref(t), host=host, where=where)
        self.items[id(item)] = item
        item.prev = self.last
        if self.last is not None:
            self.last.next = item
        self.last = item
        self.stats.offloaded_bytes += nbytes
        self.stats.d2h_bytes += nbytes
        self.stats.offloaded_tensors += 1
        if self.storage == "nvme":
            self.writes.append(item)
        return item

    def _release_region(self, item: _Item) -> None:
        if item.where is not None:
            self.pool.release(item.where, item.nbytes)
            item.host, item.where = None, None
            self.free_event = self.device.record(self.device.h2d)

    def _dropped(self, item: _Item) -> None:
        """A saved tensor was freed by autograd (its graph is gone)."""
        with self.lock:
            item.refs -= 1
            if item.refs > 0 or item.freed:
                return
            item.freed = True
            item.dev = None
            del self.items[id(item)]
            if item.prev is not None:
                item.prev.next = item.next
            if item.next is not None:
                item.next.prev = item.prev
            if self.last is item:
                self.last = item.prev
            item.prev = item.next = None
            if self.by_ptr.get(item.ptr) is item:
                del self.by_ptr[item.ptr]
            if item.writing is not None:
                self._wait(item.writing)
                item.writing = None
            if item in self.writes:
                self.writes.remove(item)  # (a later d2h copy into the region follows its copy)
            self._release_region(item)
            if item.file is not None:
                self.disk.release(item.file[0], item.file[1], item.nbytes)
                item.file = None
            self._maybe_remove_files()

    # -- NVMe -----------------------------------------------------------------------------------

    def _segment(self, size: int) -> tuple[int, int]:
        size = max(size, SLAB)
        if self.run is None:
            self.run = RunDir(self.nvme_dir)
        self.run.check_space(size, "offload_activations(storage='nvme')")
        fid, _ = self.run.open(f"activations-{len(self.files)}.bin", size)
        self.files.append(fid)
        return len(self.files) - 1, size

    def _wait(self, ticket: Any) -> None:
        t0 = time.perf_counter()
        ticket.wait()
        self.stats.io_wait_s += time.perf_counter() - t0

    def _write_behind(self, all_of_them: bool = False) -> None:
        """Writes the regions whose d2h copy has run (all of them: waiting for the copies);
        releases the regions whose write has completed."""
        for item in list(self.writes):
            if not all_of_them and not self.device.query(item.d2h_event):
                continue
            self.device.host_wait(item.d2h_event)
            self.writes.remove(item)
            assert item.host is not None
            seg, off = self.disk.alloc(item.nbytes)
            item.file = (seg, off)
            assert self.run is not None
            n = _align(item.nbytes, ALIGN)
            region = torch.empty(0, dtype=torch.uint8).set_(item.host.untyped_storage(), item.host.storage_offset(), (n,), (1,))
            item.writing = self.run.io.submit([(True, self.files[seg], region, off)])
            self.stats.write_bytes += n
        for item in self.items.values():
            if item.writing is not None and (all_of_them or item.writing.done()):
                self._wait(item.writing)
                item.writing = None
                if item.dev is None:
                    self._release_region(item)

    def _host_of(self, item: _Item) -> Tensor:
        """The item's bytes in a host region: its own, or NVMe read back into a new one."""
        if item.host is not None:
            if item.writing is not None:
                self._wait(item.writing)  # (the write reads the region; both may proceed, but
                item.writing = None  # the region is then the item's until the h2d copy)
            if item in self.writes:
                self.writes.remove(item)  # not written yet: brought back from its region
            return item.host
        assert self.run is not None and item.file is not None
        host, where = self.pool.alloc(item.nbytes)
        # The region may have been another's: the host writes it only after the copies that
        # read it (h2d) and the copies that wrote it (d2h) have run.
        dev = self.device
        if self.free_event is not None:
            dev.host_wait(self.free_event)
        dev.host_wait(dev.record(dev.d2h))
        n = _align(item.nbytes, ALIGN)
        region = torch.empty(0, dtype=torch.uint8).set_(host.untyped_storage(), host.storage_offset(), (n,), (1,))
        self._wait(self.run.io.submit([(False, self.files[item.file[0]], region, item.file[1])]))
        self.stats.read_bytes += n
        item.host, item.where = host, where
        return host

    # -- back -----------------------------------------------------------------------------------

    def _load(self, item: _Item) -> None:
        dev = self.device
        host = self._host_of(item)
        buf = dev.empty(item.nbytes, torch.uint8, self.meter)
        dev.stream_waits(dev.h2d, item.d2h_event)  # the region holds the bytes
        with torch.profiler.record_function("offload_adam.activations_h2d"):
            dev.copy([(buf, host)], dev.h2d)
        item.dev = buf
        item.h2d_event = dev.record(dev.h2d)
        self.stats.h2d_bytes += item.nbytes
        self.stats.loads += 1
        if item.file is not None:
            self._release_region(item)  # it stays on the disk; the region only held the read

    def _unpack(self, packed: Any) -> Tensor:
        if not isinstance(packed, _Packed):
            return packed  # kept
        dev = self.device
        with self.lock:
            item = packed.item
            if item.dev is None:
                self._load(item)
            buf, event = item.dev, item.h2d_event
            assert buf is not None
            item.unpacked += 1
            if item.unpacked % item.refs == 0:
                item.dev = None  # each saved tensor had it: a second backward loads it again
            # What the backward needs next: the storages saved just before this one.
            nxt = item.prev
            for _ in range(self.prefetch):
                if nxt is None:
                    break
                if nxt.dev is None and nxt.unpacked < nxt.refs:
                    self._load(nxt)
                    self.stats.prefetched += 1
                nxt = nxt.prev
        e0 = dev.record_current(timing=True)
        dev.current_waits(event)
        self.stats.stalls.append((e0, dev.record_current(timing=True)))
        return torch.empty(0, dtype=packed.dtype, device=buf.device).set_(buf.untyped_storage(), packed.offset, packed.shape, packed.stride)

    # -- reports and the end --------------------------------------------------------------------

    def report(self) -> dict[str, Any]:
        """Since the handle was made (or :meth:`reset_stats`): ``offloaded_bytes`` and
        ``offloaded_tensors`` (storages copied out, each once), ``kept_bytes`` and
        ``kept_tensors`` (saved as they were: small, parameters, host tensors),
        ``deduplicated_tensors`` (saved again from a storage already out), ``d2h_bytes``,
        ``h2d_bytes``, ``loads``, ``prefetched``, ``stall_s`` (time the compute waited for a
        tensor to come back, from events around each wait); and now: ``host_pinned_bytes``
        (the pool), ``gpu_peak_bytes`` (device memory of storages brought back, the most at
        once); with NVMe ``write_bytes``, ``read_bytes``, ``io_wait_s``."""
        st = self.stats
        out: dict[str, Any] = {f.name: getattr(st, f.name) for f in fields(st) if f.name != "stalls"}
        out["stall_s"] = sum(self.device.elapsed(e0, e1) or 0.0 for e0, e1 in st.stalls)
        out.update(host_pinned_bytes=self.pool.nbytes, gpu_peak_bytes=self.meter.peak, storage=self.storage)
        return out

    def reset_stats(self) -> None:
        """Starts the counters of ``report()`` afresh (the peak too, from what is held now)."""
        self.stats = _Stats()
        self.meter.peak = self.meter.current

    def close(self) -> None:
        """Removes the module hooks; with NVMe, waits for the writes and removes the files.
        Saved tensors of a graph not yet run backward must not outlive it with NVMe."""
        if self.closed:
            return
        for h in self._handles:
            h.remove()
        self._handles = []
        with self.lock:
            self._write_behind(all_of_them=True)
        self.device.drain()
        if self.run is not None:
            self.run.close()
            self.run = None
        self.closed = True

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass


def offload_activations(
    min_bytes: int = 1 << 20,
    prefetch: int = 2,
    storage: str = "cpu",
    nvme_dir: Any = None,
    *,
    modules: Any = None,
    device: Any = None,
) -> ActivationOffload:
    """Offloads what a forward saves for backward to pinned host memory (or an SSD) and brings
    it back ahead of the backward (the design: ``offload_adam.activations.offload``).

    ``with offload_activations(...) as ao: loss = model(x)``, then ``loss.backward()`` inside or
    outside the ``with``, then ``ao.report()``. With ``modules`` (a module or a list), only what
    those modules' forwards save is offloaded, whenever they run, until ``close()``. Each
    offloaded byte crosses PCIe twice per step: use it when activations, not weights, fill the
    GPU (long sequences, large batches).

    For example::

        with offload_adam.offload_activations() as ao:
            loss = model(x)
        loss.backward()
        print(ao.report())

    Args:
        min_bytes: storages smaller than this many bytes stay on the device (default: 1 MiB,
            ``1 << 20``).
        prefetch: storages copied back ahead of the one the backward needs (default: 2).
        storage: ``"cpu"`` (pinned host memory; the default) or ``"nvme"`` (written under
            ``nvme_dir`` behind the forward, read back during the backward).
        nvme_dir: with ``storage="nvme"`` (and only then): an existing directory on an SSD
            (default: None).
        modules: restrict the offload to what these modules save (default: None, everything
            the forward inside the ``with`` saves).
        device: the CUDA device of the activations (default: None, the current one; inside
            ``offload_adam.testing.simulated_device()``, the simulated device).

    Returns:
        The ``ActivationOffload`` handle (a context manager; ``report()``, ``reset_stats()``,
        ``close()``).
    """
    if isinstance(min_bytes, bool) or not isinstance(min_bytes, int) or min_bytes < 0:
        raise ValueError(f"min_bytes must be an integer >= 0, got {min_bytes!r}")
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"prefetch must be an integer >= 0, got {prefetch!r}")
    if storage not in STORAGES:
        raise ValueError(f"storage must be one of {STORAGES}, got {storage!r}")
    if storage == "nvme" and nvme_dir is None:
        raise ValueError("nvme_dir: storage='nvme' needs a directory (on an SSD)")
    if storage == "cpu" and nvme_dir is not None:
        raise ValueError("nvme_dir is only for storage='nvme'")
    if storage == "nvme" and not (isinstance(nvme_dir, (str, os.PathLike)) and os.path.isdir(nvme_dir)):
        raise ValueError(f"nvme_dir: {nvme_dir!r} is not a directory")
    mods = [] if modules is None else [modules] if isinstance(modules, torch.nn.Module) else list(modules)
    dev = stream_device(device, "offload_activations moves a GPU's activations")
    return ActivationOffload(dev, min_bytes=min_bytes, prefetch=prefetch, storage=storage, nvme_dir=nvme_dir, modules=mods)
