"""Activations offloaded: the tensors a forward saves for backward go to pinned host memory
(or NVMe) during the forward and come back during the backward, ahead of need.

A pack hook (``torch.autograd.graph.saved_tensors_hooks``) sees each tensor the forward saves.
Kept as they are: tensors whose storage is under ``min_bytes``, parameters and views of them
(leaves that require a gradient), tensors not on the device, wrapper subclasses. Every other one is offloaded **by
storage**: a storage saved twice, or through two views, is copied once, and each saved tensor
comes back as the same view of the restored storage.

- **Out.** The d2h side stream waits an event of the compute stream recorded at the save (and the
  copies that used the region last), copies the storage's bytes into a region of the device's
  :class:`~offload_adam.runtime.pinned.SlabPool` (pinned slabs, first-fit, regions reused once
  their tensors are freed, shared by every handle: no per-tensor pinning, no power-of-two
  rounding, nothing pinned again by a handle made each step) and keeps the device storage alive
  until the copy has run; the caching allocator may then reuse it. Beyond
  ``max_inflight_bytes`` of storages whose copy has not run, the host waits for the oldest.
- **Back.** Unpacking a saved tensor (the backward needs it) copies its storage into fresh
  device memory on the h2d side stream unless a prefetch did; the compute stream waits that
  copy's event (a stream wait, timed: ``stall_s``); the ``prefetch`` storages saved just before
  it (what the backward needs next) are copied too, into buffers kept allocated until their copy
  has run (a graph dropped before its backward frees them early). A region is reused only after
  the copies that used it (its release carries their events: the next copy into it waits them).
- **NVMe** (``storage="nvme"``): a region whose d2h copy has run is written to a file of the
  runtime's page store (``runtime/pages.py``: a run directory, ``O_DIRECT``, a CRC-32C per range
  checked when it is read back, off this thread) and released once written; a load reads it back into a
  region (the host waits the read: ``io_wait_s``, and before it only the copies that used that
  region last), copies it up and releases that region after the copy. The file space of a freed
  storage is reused; the files go at ``close()``.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from collections import deque
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor

from ..runtime import checks
from ..runtime.device import Device, Meter, refuse_capture, stream_device, tensor_type
from ..runtime.pages import ALIGN, IoStats, PageFile, PageStore, Transfer
from ..runtime.pinned import FreeList, Region, align_up, slab_pool

STORAGES = ("cpu", "nvme")
SEGMENT = 64 << 20  # bytes of a file segment (a larger storage gets one its size)


@dataclass(eq=False)
class _Item:
    """One offloaded storage."""

    ptr: int  # its storage's address when saved
    nbytes: int
    d2h_event: Any
    probe: Any  # a weak reference to a tensor of the storage: the storage lives while it does
    region: Region | None = None  # its host region in the pool (NVMe: until written)
    file: tuple[int, int] | None = None  # NVMe: (segment, offset) of its bytes
    writing: Transfer | None = None  # NVMe: its write in flight
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
    inflight_peak_bytes: int = 0  # offloaded storages whose copy had not run yet, the most at once
    inflight_waits: int = 0  # host waits for copies, to stay under max_inflight_bytes
    stall_s: float = 0.0  # folded from the stall events whose both ends completed


class ActivationOffload:
    """The handle :func:`offload_activations` returns (see the module documentation)."""

    def __init__(
        self,
        device: Device,
        *,
        min_bytes: int,
        prefetch: int,
        storage: str,
        nvme_dir: Any,
        modules: list[torch.nn.Module],
        max_inflight_bytes: int,
    ) -> None:
        self.device = device
        # The class of the device's own tensors: a tensor of another class that dispatches itself
        # is a wrapper subclass, kept.
        self.plain = tensor_type(device)
        self.min_bytes = min_bytes
        self.prefetch = prefetch
        self.storage = storage
        self.max_inflight_bytes = max_inflight_bytes
        self.meter = Meter()
        self.nvme_dir = nvme_dir
        self.store: PageStore | None = None  # NVMe: made at the first offload, removed when nothing is saved
        self.io = IoStats()  # its reads, writes and waits (every store's)
        # The device's pool, shared by every handle: a handle made each step pins nothing new.
        self.pool = slab_pool(device, ALIGN if storage == "nvme" else 512)
        self.files: list[PageFile] = []
        self.disk = FreeList(self._segment, ALIGN)
        self.lock = threading.RLock()
        self.items: dict[int, _Item] = {}  # saved and alive, in the order saved (by id)
        self.last: _Item | None = None  # the last one saved (the tail of the prev/next chain)
        self.by_ptr: dict[int, _Item] = {}
        self.writes: list[_Item] = []  # NVMe: regions to write once their d2h copy has run
        self.inflight: deque[_Item] = deque()  # offloaded, their d2h copy maybe not run yet
        self.inflight_bytes = 0
        self.stalls: list[tuple[Any, Any]] = []  # (before, after) of compute waits not yet folded
        self.stats = _Stats()
        self._warned = False  # a tensor of another device of the same kind was kept (warned once)
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
        if self.store is not None and not self._hooks and not self.items:
            self._write_behind(all_of_them=True)
            self.store.close()
            self.store, self.files, self.disk = None, [], FreeList(self._segment, ALIGN)

    # -- out ------------------------------------------------------------------------------------

    def _keep(self, t: Tensor) -> bool:
        if t.device != self.device.torch_device or t.layout != torch.strided:
            if t.device.type == self.device.torch_device.type and t.device != self.device.torch_device and not self._warned:
                self._warned = True
                warnings.warn(
                    f"offload_activations: a tensor saved on {t.device} is kept there: this handle offloads "
                    f"{self.device.torch_device} (the current device when it was made); pass device={str(t.device)!r}",
                    stacklevel=3,
                )
            return True  # a host tensor already, another device's, or no plain storage to copy
        if type(t) is not self.plain and type(t).__torch_dispatch__ is not Tensor.__torch_dispatch__:
            return True  # a wrapper subclass (not the device's own tensors)
        base = t._base if t._base is not None else t
        if isinstance(base, torch.nn.Parameter) or (base.is_leaf and base.requires_grad):
            return True  # a parameter, or a view of one (F.linear saves weight.t())
        fn = base.grad_fn
        if fn is not None and fn.name() == "ToCopyBackward0":
            nxt = fn.next_functions
            var = getattr(nxt[0][0], "variable", None) if nxt and nxt[0][0] is not None else None
            if isinstance(var, torch.nn.Parameter):
                # autocast's cast of a resident weight: its cast cache holds it on the device
                # until autocast exits anyway, so a copy out would free nothing.
                return True
        return t.untyped_storage().nbytes() < self.min_bytes

    def _pack(self, t: Tensor) -> Any:
        refuse_capture(self.device, "offload_activations")
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
        region = self.pool.alloc(nbytes)
        src = t.detach().as_strided((nbytes // t.element_size(),), (1,), 0).view(torch.uint8)  # its whole storage
        # After the work that made the tensor (the compute stream, now), and after the copies
        # that used the region before (another storage's, released).
        dev.stream_waits(dev.d2h, dev.record_current())
        for e in region.after:
            dev.stream_waits(dev.d2h, e)
        with torch.profiler.record_function("offload_adam.activations_d2h"):
            dev.copy([(region.host, src)], dev.d2h)
        ev = dev.record(dev.d2h)
        dev.keep_until_done(src, dev.d2h)  # the device storage stays until its copy has run
        item = _Item(st.data_ptr(), nbytes, ev, weakref.ref(t), region=region)
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
        self._cap_inflight(item)
        return item

    def _cap_inflight(self, item: _Item) -> None:
        """Storages whose copy has not run stay allocated on the device (``keep_until_done``): a
        forward that saves faster than the copies drain would keep them all. Beyond
        ``max_inflight_bytes`` the host waits for the oldest copies."""
        dev = self.device
        self.inflight.append(item)
        self.inflight_bytes += item.nbytes
        while self.inflight and dev.query(self.inflight[0].d2h_event):
            self.inflight_bytes -= self.inflight.popleft().nbytes
        self.stats.inflight_peak_bytes = max(self.stats.inflight_peak_bytes, self.inflight_bytes)
        while self.inflight_bytes > self.max_inflight_bytes and len(self.inflight) > 1:
            oldest = self.inflight.popleft()
            dev.host_wait(oldest.d2h_event)
            self.inflight_bytes -= oldest.nbytes
            self.stats.inflight_waits += 1

    def _release_region(self, item: _Item) -> None:
        if item.region is not None:
            # Reusable once the copies that wrote it (d2h) and read it (h2d) have run: the next
            # user of these bytes waits for those, and only those.
            self.pool.release(item.region, item.d2h_event, item.h2d_event)
            item.region = None

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
                self._finish_write(item, retry=False)  # (its bytes are not wanted: an error does not matter)
            if item in self.writes:
                self.writes.remove(item)  # (a later d2h copy into the region follows its copy)
            self._release_region(item)
            if item.file is not None:
                self.files[item.file[0]].forget(item.file[1])
                self.disk.release(item.file[0], item.file[1], item.nbytes)
                item.file = None
            self._maybe_remove_files()

    # -- NVMe -----------------------------------------------------------------------------------

    def _segment(self, size: int) -> tuple[int, int]:
        size = max(size, SEGMENT)
        if self.store is None:
            self.store = PageStore(self.nvme_dir, stats=self.io)
        self.files.append(self.store.open(f"activations-{len(self.files)}.bin", size, "offload_activations(storage='nvme')"))
        return len(self.files) - 1, size

    @staticmethod
    def _label(item: _Item) -> str:
        return f"a saved storage of {item.nbytes} bytes"

    def _finish_write(self, item: _Item, retry: bool) -> OSError | None:
        """Waits for ``item``'s write. If it failed, its file range is given back (never read:
        it holds nothing) and its region, which still holds its bytes, stays the item's: to be
        written again (``retry``) or brought back from there. Returns the write's error."""
        w, item.writing = item.writing, None
        assert w is not None
        try:
            w.wait()
        except OSError as e:
            if item.file is not None:
                self.files[item.file[0]].forget(item.file[1])
                self.disk.release(item.file[0], item.file[1], item.nbytes)
                item.file = None
            if retry and item not in self.writes:
                self.writes.append(item)
            return e
        return None

    def _write_behind(self, all_of_them: bool = False) -> None:
        """Writes the regions whose d2h copy has run (all of them: waiting for the copies);
        releases the regions whose write has completed. A write that fails keeps its region
        (its bytes are never read from the disk) and is tried again at the next call; the
        first error is raised once every write of the call is accounted for."""
        for item in list(self.writes):
            if not all_of_them and not self.device.query(item.d2h_event):
                continue
            self.device.host_wait(item.d2h_event)
            assert item.region is not None
            host = item.region.host
            seg, off = self.disk.alloc(item.nbytes)  # (a disk without room raises: the item stays to write)
            n = align_up(item.nbytes, ALIGN)
            region = torch.empty(0, dtype=torch.uint8).set_(host.untyped_storage(), host.storage_offset(), (n,), (1,))
            try:
                item.writing = self.files[seg].write(off, region, self._label(item))
            except BaseException:
                self.disk.release(seg, off, item.nbytes)
                raise
            item.file = (seg, off)
            self.writes.remove(item)
        error = None
        for item in list(self.items.values()):
            if item.writing is not None and (all_of_them or item.writing.done()):
                e = self._finish_write(item, retry=True)
                if e is not None:
                    error = error or e
                elif item.dev is None:
                    self._release_region(item)
        if error is not None:
            raise error

    def _host_of(self, item: _Item) -> Tensor:
        """The item's bytes in a host region: its own, or NVMe read back into a new one."""
        if item.region is not None:
            if item.writing is not None:
                # (the write reads the region; both may proceed, but the region is then the
                # item's until the h2d copy; a failed write does not matter: the bytes are here)
                self._finish_write(item, retry=False)
            if item in self.writes:
                self.writes.remove(item)  # not written yet: brought back from its region
            return item.region.host
        assert item.file is not None
        if self.store is None:
            raise RuntimeError(
                "offload_activations: a saved tensor whose bytes were on the SSD is needed after close() removed its "
                "files: with storage='nvme', run the backward before closing the handle"
            )
        r = self.pool.alloc(item.nbytes)
        # The region may have been another's: the host writes it only after the copies that
        # used it last (their events, released with it), not after everything queued since.
        for e in r.after:
            self.device.host_wait(e)
        n = align_up(item.nbytes, ALIGN)
        region = torch.empty(0, dtype=torch.uint8).set_(r.host.untyped_storage(), r.host.storage_offset(), (n,), (1,))
        self.files[item.file[0]].read(item.file[1], region, self._label(item)).wait()
        item.region = r
        return r.host

    # -- back -----------------------------------------------------------------------------------

    def _load(self, item: _Item, now: bool) -> None:
        """Queues the copy of ``item`` back to the device; ``now``: the backward needs it at once
        (the device's stream of copies needed now, never behind a prefetch's wait), else a prefetch."""
        dev = self.device
        stream = dev.h2d_now if now else dev.h2d
        host = self._host_of(item)
        buf = dev.empty(item.nbytes, torch.uint8, self.meter)
        # The caching allocator hands out memory the compute freed at once: queued kernels may
        # still read it (an earlier node's activation or gradient). The copy waits for them
        # (CUDA review, second pass, hazard 2).
        dev.stream_waits(stream, dev.record_current())
        dev.stream_waits(stream, item.d2h_event)  # the region holds the bytes
        with torch.profiler.record_function("offload_adam.activations_h2d"):
            dev.copy([(buf, host)], stream)
        # The buffer may be dropped before its unpack (a graph freed, a backward that raised):
        # the caching allocator must not hand it out while this copy writes it.
        dev.keep_until_done(buf, stream)
        item.dev = buf
        item.h2d_event = dev.record(stream)
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
                self._load(item, now=True)
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
                    self._load(nxt, now=False)
                    self.stats.prefetched += 1
                nxt = nxt.prev
        e0 = dev.record_current(timing=True)
        dev.current_waits(event)
        with self.lock:
            self.stalls.append((e0, dev.record_current(timing=True)))
            if len(self.stalls) > 16:
                self._fold()
        return buf.view(packed.dtype).as_strided(packed.shape, packed.stride, packed.offset)

    # -- reports and the end --------------------------------------------------------------------

    def _fold(self, wait: bool = False) -> None:
        """Adds the stalls whose events completed to ``stall_s`` and drops their events (with
        ``wait``: all of them, after they complete)."""
        dev = self.device
        keep = []
        for e0, e1 in self.stalls:
            if wait:
                dev.host_wait(e1)
            t = dev.elapsed(e0, e1)
            if t is None:
                keep.append((e0, e1))
            else:
                self.stats.stall_s += t
        self.stalls = keep

    def flush(self) -> None:
        """``storage="nvme"``: writes every saved storage still in RAM to the SSD now (waiting
        for its copy out) and waits for the writes, releasing their RAM: between a forward and a
        late backward (an evaluation, a pause), the saved tensors then hold no RAM. Without it the
        regions are written behind as the forward saves, and a region whose copy had not run by
        the last save stays in RAM until it is unpacked."""
        if self.storage != "nvme":
            return
        with self.lock:
            if self.store is not None or self.writes:  # (the store is made at the first write)
                self._write_behind(all_of_them=True)

    def report(self) -> dict[str, Any]:
        """Since the handle was made (or :meth:`reset_stats`): ``offloaded_bytes`` and
        ``offloaded_tensors`` (storages copied out, each once), ``kept_bytes`` and
        ``kept_tensors`` (saved as they were: small, parameters, host tensors),
        ``deduplicated_tensors`` (saved again from a storage already out), ``d2h_bytes``,
        ``h2d_bytes``, ``loads``, ``prefetched``, ``stall_s`` (time the compute waited for a
        tensor to come back, from events around each wait), ``inflight_peak_bytes`` (storages
        whose copy out had not run, the most at once) and ``inflight_waits`` (host waits to stay
        under ``max_inflight_bytes``); and now: ``host_pinned_bytes`` (the device's pool, shared
        by every handle), ``gpu_peak_bytes`` (device memory of storages brought back, the most at
        once); with NVMe ``write_bytes``, ``read_bytes``, ``io_wait_s``."""
        with self.lock:
            self._fold(wait=True)
        st = self.stats
        out: dict[str, Any] = {f.name: getattr(st, f.name) for f in fields(st)}
        out.update(read_bytes=int(self.io.read_bytes), write_bytes=int(self.io.write_bytes), io_wait_s=self.io.io_wait_s)
        out.update(host_pinned_bytes=self.pool.nbytes, gpu_peak_bytes=self.meter.peak, storage=self.storage)
        return out

    def reset_stats(self) -> None:
        """Starts the counters of ``report()`` afresh (the peak too, from what is held now)."""
        with self.lock:
            self.stalls = []
        self.stats = _Stats()
        self.io.reset()
        self.meter.peak = self.meter.current

    def close(self) -> None:
        """Removes the module hooks; with NVMe, drops the writes not started (those saved
        storages stay in their RAM regions), waits for the writes in flight (their errors are
        not raised: the files go), then closes and removes the files. It never raises an I/O
        error, also after one (a full disk at ``flush()``). A saved tensor whose bytes were only
        on the SSD cannot be brought back afterwards (a clear error): with NVMe, run the backward
        of a graph before ``close()``."""
        if self.closed:
            return
        for h in self._handles:
            h.remove()
        self._handles = []
        with self.lock:
            self.writes = []
            for item in self.items.values():
                if item.writing is not None:
                    self._finish_write(item, retry=False)  # (its region stays: the file goes)
        self.device.drain()
        if self.store is not None:
            self.store.close()
            self.store = None
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
    max_inflight_bytes: int = 1 << 30,
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
        nvme_dir: with ``storage="nvme"`` (and only then): an existing directory on an SSD, a
            ``str``, ``os.PathLike`` or ``bytes`` path (default: None).
        modules: restrict the offload to what these modules save (default: None, everything
            the forward inside the ``with`` saves).
        device: the CUDA device of the activations (default: None, the current one; inside
            ``offload_adam.testing.simulated_device()``, the simulated device).
        max_inflight_bytes: bytes of saved storages whose copy to the host has not run yet
            (they stay allocated on the device meanwhile) beyond which the forward waits for the
            oldest copies (default 1 GiB).

    The pinned pool is the device's, shared by every handle: creating a handle per step pins
    nothing new (``with offload_activations() as ao:`` inside the loop is fine).

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
    if isinstance(max_inflight_bytes, bool) or not isinstance(max_inflight_bytes, int) or max_inflight_bytes < 0:
        raise ValueError(f"max_inflight_bytes must be an integer >= 0, got {max_inflight_bytes!r}")
    if storage == "nvme" and nvme_dir is None:
        raise ValueError("nvme_dir: storage='nvme' needs a directory (on an SSD)")
    if storage == "cpu" and nvme_dir is not None:
        raise ValueError("nvme_dir is only for storage='nvme'")
    if storage == "nvme":
        nvme_dir = checks.directory(nvme_dir, "nvme_dir")
    mods = [] if modules is None else [modules] if isinstance(modules, torch.nn.Module) else list(modules)
    dev = stream_device(device, "offload_activations moves a GPU's activations")
    return ActivationOffload(
        dev, min_bytes=min_bytes, prefetch=prefetch, storage=storage, nvme_dir=nvme_dir, modules=mods,
        max_inflight_bytes=max_inflight_bytes,
    )  # fmt: skip
