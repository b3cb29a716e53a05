"""A simulated asynchronous device: CUDA stream semantics on the CPU, for tests.

It implements the :class:`~offload_adam.runtime.device.Device` interface, with device memory
that code can tell from host memory: its tensors are on a device of their own, ``simgpu:N``
(:mod:`~offload_adam.testing.simbackend`), so an operation that mixes them with CPU tensors
raises as on a GPU, and only copies cross. The clients run unchanged on it, with the hazards of a
real GPU kept. The rooms:

* :mod:`~offload_adam.testing.simbackend`: the device type (``simgpu``) and its tensors;
* :mod:`~offload_adam.testing.simstreams`: side streams, events, user streams, device contexts;
* :mod:`~offload_adam.testing.hb`: the happens-before checker;
* this module: the device (:class:`SimulatedDevice`), its host memory (:class:`SimHost`) and its
  caching allocator (:class:`SimAllocator`).

What it models:

* **Side streams** (``d2h``, ``h2d``, ``h2d_now``): FIFO worker threads that run their operations
  after a random, seeded delay; a copy reads its source when it runs, not when it is queued.
* **The compute stream.** The current stream is the calling thread: its device operations run at
  once, and a wait of the current stream on an event (``current_waits``) is honoured at the
  thread's next operation on device memory, not as an immediate host wait (inside a backward,
  whose operations run on autograd's device thread, at once). While :meth:`SimulatedDevice.lazy`
  is entered the waits are lazy (without it, ``current_waits`` waits at once). User streams
  (:meth:`SimulatedDevice.stream`, entered with :meth:`SimulatedDevice.use_stream`) are other
  compute streams, ordered with the default one only through events.
* **Happens-before** (``check_ordering``, :mod:`~offload_adam.testing.hb`): every copy is
  checked against the compute and the copies it must follow, and against the allocation of the
  memory it writes.
* **The caching allocator** (``empty``). Memory freed is reused by the next allocation on the
  stream that allocated it (the current stream, or the side stream entered with
  ``torch.cuda.stream``), at once, poisoned with NaN; memory a ``keep_until_done`` holds for
  another stream only once that stream has passed the point where it was freed. A reuse while
  another stream may still use the memory (not ordered, not held) is a violation; a copy still
  queued into it clobbers the new owner, as on a GPU. Memory handed out keeps its previous
  owner's accesses, and the allocation is a write of the allocating stream: a write into it from
  another stream must follow an event of that stream recorded after the allocation.
* **Host memory.** A host buffer (``host_buffer``, ``staging``: pinned) released while a queued
  copy still uses it is a violation (on a GPU: a DMA into unregistered, freed pages); freed device
  memory a queued copy reads gives NaN. An asynchronous copy whose host side is not pinned (the
  destination of a ``d2h`` copy, the source of one to the device) is counted, and a violation in
  ``strict`` mode; ``copy_blocking`` (cold paths) may use pageable memory. A copy whose sides are
  not a host and a device tensor as its stream says (a ``d2h`` copy from host memory, an ``h2d``
  copy into it) raises.
* **Devices.** A thread has a current device (``cuda``, a model of ``torch.cuda``'s device and
  stream contexts and of the primary contexts they create); work for device N entered from a
  thread whose current device is 0 touches device 0 (a context there), which is a violation.
* **Costs** (:meth:`SimulatedDevice.counters`): host waits on the compute stream, live events,
  pin registrations, pageable copies, so tests can assert they stay bounded from step to step.

Writes into device tensors go through an alias with its own version counter, and the target's
version is bumped when the copy is queued, as CUDA's ``copy_`` bumps it at launch.
"""

from __future__ import annotations

import contextlib
import ctypes
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..runtime.device import Meter, on_device, on_stream
from . import simbackend
from .hb import OrderChecker, _Access, _History, _join, _Lane, bump_version
from .simbackend import SimTensor, mem
from .simstreams import SimCuda, SimEvent, UserStream, _local, _Stream


@contextlib.contextmanager
def _host_section() -> Iterator[None]:
    """The simulator's own tensor work: not the compute stream's."""
    _local.host_section += 1
    try:
        yield
    finally:
        _local.host_section -= 1


# -- host memory ------------------------------------------------------------------------------------


@dataclass
class _HostAlloc:
    memory: Tensor | None  # the simulator's own reference: valid for copies after a release
    dead: bool = False
    nbytes: int = 0
    pinned: bool = True  # host_empty memory is not, until pin()


class SimHost:
    """Host memory handed to clients (pinned buffers, memory to pin, staging): the client's
    tensor does not own its memory, the simulator keeps it, so that a copy queued before the
    client released it still finds valid memory (and records the violation) instead of crashing;
    the release is seen when the client's storage dies."""

    def __init__(self, dev: SimulatedDevice) -> None:
        self.dev = dev
        self.allocs: dict[int, _HostAlloc] = {}

    def label(self, ptr: int) -> str | None:
        alloc = self.allocs.get(ptr)
        return None if alloc is None else f"host buffer of {alloc.nbytes} bytes"

    def alloc_of(self, t: Tensor) -> _HostAlloc | None:
        if isinstance(t, SimTensor):
            return None
        try:
            return self.allocs.get(t.untyped_storage().data_ptr())
        except Exception:  # a tensor without storage
            return None

    def new(self, n: int, dtype: torch.dtype, zero: bool) -> Tensor:
        with _host_section():
            memory = torch.zeros(n, dtype=dtype) if zero else torch.empty(n, dtype=dtype)
            nbytes = memory.untyped_storage().nbytes()
            if nbytes == 0:  # nothing to register or keep (a CUDA device takes empty(0) too)
                return memory
            raw = (ctypes.c_char * nbytes).from_address(memory.data_ptr())
            t = torch.frombuffer(raw, dtype=torch.uint8)[:nbytes].view(dtype)
        alloc = _HostAlloc(memory, nbytes=nbytes, pinned=False)
        ptr = t.untyped_storage().data_ptr()
        self.allocs[ptr] = alloc
        weakref.finalize(t.untyped_storage(), self.release, alloc, ptr)
        return t

    def pin(self, t: Tensor) -> None:
        if t.untyped_storage().nbytes() == 0:
            return
        alloc = self.alloc_of(t)
        assert alloc is not None and not alloc.pinned, "pin() takes a host_empty buffer, once"
        with on_device(self.dev.cuda, self.dev.index):
            self.dev.cuda.register()
        self.dev.counts["registrations"] += 1
        alloc.pinned = True

    def release(self, alloc: _HostAlloc, ptr: int) -> None:
        if self.dev.release_waits and not _local.stream_thread:
            self.dev.drain()
        alloc.dead = True
        alloc.memory = None
        if self.allocs.get(ptr) is alloc:
            del self.allocs[ptr]
            self.dev.order.forget_host(ptr)


# -- device memory ----------------------------------------------------------------------------------


@dataclass(eq=False)
class _Block:
    """Device memory of ``empty``: the simulator owns it; a client's tensor is a view without
    ownership, so its release is seen and the memory can be handed to the next allocation."""

    memory: Tensor  # uint8, the simulator's
    nbytes: int
    lane: str  # the stream it was allocated on (its pool)
    history: _History
    live: bool = True  # a client holds it
    kept: list[tuple[_Stream, int]] = field(default_factory=list)  # keep_until_done: (stream, op) at the call
    waiting: list[SimEvent] = field(default_factory=list)  # freed: reusable once these complete


class SimAllocator:
    """The caching allocator of ``empty`` (see the module documentation)."""

    def __init__(self, dev: SimulatedDevice) -> None:
        self.dev = dev
        self.blocks: dict[int, _Block] = {}  # base address -> block
        self.free: list[_Block] = []
        # Device memory allocated through `empty` for a client that counts it (a meter): current
        # and peak (what a client moves on the device for a call, unmetered, is not in it).
        self.allocated = Meter()

    def history(self, ptr: int) -> _History | None:
        blk = self.blocks.get(ptr)
        return blk.history if blk is not None and blk.live else None

    def live_block(self, t: Tensor) -> _Block | None:
        blk = self.blocks.get(mem(t).untyped_storage().data_ptr())
        return blk if blk is not None and blk.live else None

    def empty(self, n: int, dtype: torch.dtype, lane: _Lane) -> Tensor:
        dev = self.dev
        es = torch.empty((), dtype=dtype).element_size()
        nbytes = n * es
        label = f"device memory of {nbytes} bytes ({dtype})"
        with dev.order.lock:
            self.collect()
            # Not a block whose keep_until_done streams have not passed its free yet.
            blk = next((b for b in self.free if b.nbytes == nbytes and b.lane == lane.name and not b.waiting), None)
            if blk is not None:
                self.free.remove(blk)
                if dev.check_ordering:
                    dev.order.check_reuse(blk.history, blk.lane, lane)
                dev.counts["reuses"] += 1
                blk.history.label = label  # the previous owner's accesses stay
            else:
                with _host_section():
                    memory = torch.empty(max(nbytes, 1), dtype=torch.uint8)
                blk = _Block(memory, nbytes, lane.name, _History(label))
            blk.live, blk.kept, blk.waiting = True, [], []
            # The allocation writes the memory on its stream: another stream's write into it must
            # follow an event of this one recorded after it.
            blk.history.record(_Access(lane.name, lane.n, "the allocation", 0, max(nbytes, 1), True))
        with _host_section():
            raw = (ctypes.c_char * max(nbytes, 1)).from_address(blk.memory.data_ptr())
            t = torch.frombuffer(raw, dtype=torch.uint8)[:nbytes].view(dtype)
            # NaN, or for bytes a pattern that decodes to garbage in any dtype
            t.fill_(float("nan") if dtype.is_floating_point else 0xA5 if dtype == torch.uint8 else -1)
        self.blocks[blk.memory.data_ptr()] = blk
        weakref.finalize(t.untyped_storage(), self.freed, blk)
        return simbackend.wrap(t, dev.index)

    def freed(self, blk: _Block) -> None:
        """A client's memory of `empty` is garbage: back to its stream's pool, at once, or once
        the streams ``keep_until_done`` named have passed this point."""
        dev = self.dev
        with dev.order.lock:
            blk.live = False
            blk.waiting = [dev.record(s) for s, _ in blk.kept] if not dev.closed else []
            if not blk.kept:
                # Reusable at once: a copy still reading it reads garbage (here NaN: 0xFF bytes).
                with _host_section():
                    blk.memory.fill_(0xFF)
            blk.kept = []
            self.free.append(blk)

    def collect(self) -> None:
        for blk in self.free:
            if blk.waiting and all(e.query() for e in blk.waiting):
                # The allocator saw those streams pass the free: their uses are over.
                for e in blk.waiting:
                    blk.history.forget(e.vc)
                blk.waiting = []


# -- copies -----------------------------------------------------------------------------------------


@dataclass
class _Ref:
    """What a queued copy holds of one tensor."""

    alias: Tensor | None = None  # shares the storage; its own version counter
    alloc: _HostAlloc | None = None  # set for host buffers
    weak: Any = None  # weak reference to the storage of a device tensor the copy reads
    geometry: tuple[Any, ...] = ()  # (dtype, storage offset, shape, stride) of that tensor


def _compute_lane(name: str) -> bool:
    return name == "compute" or name.startswith("user")


def _sides(stream: _Stream, d: Tensor, s: Tensor) -> None:
    """A copy's sides as its stream says: d2h from the device to the host, h2d into the device."""
    if stream.name == "d2h":
        ok = isinstance(s, SimTensor) and not isinstance(d, SimTensor)
        want = "from device memory into host memory"
    else:
        ok = isinstance(d, SimTensor)
        want = "into device memory"
    if not ok:
        side = lambda t: t.device if not isinstance(t, SimTensor) else f"{t.device} (device memory)"  # noqa: E731
        raise ValueError(
            f"{stream.name}: a copy from {side(s)} to {side(d)} ({tuple(s.shape)} {s.dtype}); this stream copies {want}"
        )


class _Hooks:
    """What the device backend reports of each operation on the device's memory
    (:class:`~offload_adam.testing.simbackend.Hooks`)."""

    def __init__(self, dev: SimulatedDevice) -> None:
        self.dev = dev

    def before_op(self, func: Any, args: Any, kwargs: Any) -> None:
        """The thread's pending waits first; with ``check_ordering``, what it reads and writes
        recorded."""
        if _local.host_section:
            return
        if _local.pending:
            self.dev._honour()
        if self.dev.check_ordering:
            self.dev.order.stamp(self.dev._lane(), func, args, kwargs)

    def after_op(self, func: Any, out: Any) -> None:
        if self.dev.check_ordering and not _local.host_section:
            self.dev.order.stamp_fresh(self.dev._lane(), func, out)

    def host_sync(self) -> None:
        """A synchronous copy to the host (``.cpu()``, ``.item()``): the host has waited for the
        current stream, whose later operations start a new epoch."""
        with self.dev.order.lock:
            lane = self.dev._lane()
            self.dev.order.host_vc = _join(self.dev.order.host_vc, lane.clock())
            lane.n += 1


class SimulatedDevice:
    """CUDA stream semantics on the CPU, with device memory of its own (see the module
    documentation)."""

    tensor_type = simbackend.SimTensor  # its memory's tensors: the product takes them for plain ones

    def __init__(
        self,
        seed: int = 0,
        max_delay_s: float = 0.002,
        copies_on_demand: bool = False,
        *,
        check_ordering: bool = False,
        strict: bool = False,
        index: int = 0,
    ) -> None:
        self.torch_device = simbackend.device(index)
        self.index = index
        self.max_delay_s = max_delay_s
        # Benchmarks: a stream runs its work only once something waits for it, so that the
        # simulated copies never take this machine's cores while the kernel runs (a GPU's copy
        # engine needs none).
        self.copies_on_demand = copies_on_demand
        self.check_ordering = check_ordering
        self.strict = strict
        self.closed = False
        self.violations: list[str] = []
        self.copied_bytes: dict[str, int] = {}  # bytes queued for copying, by stream name
        self.counts = {"host_waits_on_compute": 0, "registrations": 0, "staging": 0, "pageable_copies": 0, "reuses": 0}
        self.host = SimHost(self)
        self.order = OrderChecker(self.violations, self.host.label, self.counts)
        self.alloc = SimAllocator(self)
        self.order.block_history = self.alloc.history
        self.allocated = self.alloc.allocated
        self.compute = _Lane("compute", compute=True)
        self._users = 0
        self._user_lanes: list[_Lane] = []
        self.cuda = SimCuda(self)
        self.d2h = _Stream(self, "d2h", seed * 2 + 1)
        self.h2d = _Stream(self, "h2d", seed * 2 + 2)
        self.h2d_now = _Stream(self, "h2d_now", seed * 2 + 3 + 10**6)
        # Testing aid of the simulator itself: False models a release that does not wait for
        # queued copies (what CUDA's cudaHostUnregister does), to show that tests catch it.
        self.release_waits = True
        self.graph_capture = False  # a CUDA graph capture on the current stream (capturing())
        self.hooks = _Hooks(self)
        simbackend.attach(index, self.hooks)

    # -- the compute streams ------------------------------------------------------------------

    def stream(self) -> UserStream:
        """A new user stream (``torch.cuda.Stream()``)."""
        self._users += 1
        s = UserStream(f"user{self._users}")
        self._user_lanes.append(s.lane)
        return s

    @contextlib.contextmanager
    def use_stream(self, s: UserStream) -> Iterator[None]:
        """``with torch.cuda.stream(s)`` for the compute of this thread."""
        prev = _local.user.get(id(self))
        _local.user[id(self)] = s
        try:
            yield
        finally:
            if prev is None:
                del _local.user[id(self)]
            else:
                _local.user[id(self)] = prev

    def _lane(self) -> _Lane:
        u = _local.user.get(id(self))
        return u.lane if u is not None else self.compute

    def _alloc_lane(self) -> _Lane:
        """The stream an allocation comes from: a side stream entered with ``torch.cuda.stream``,
        else the current compute stream."""
        side = _local.side.get(id(self))
        return side[-1].lane if side else self._lane()

    @contextlib.contextmanager
    def lazy(self) -> Iterator[None]:
        """Makes ``current_waits`` lazy in this thread: honoured at its next operation on device
        memory."""
        _local.lazy.append(self)
        try:
            yield
        finally:
            self._honour()
            _local.lazy.remove(self)

    def _honour(self) -> None:
        pending, _local.pending = _local.pending, []
        for e in pending:
            e.wait()

    # -- memory -------------------------------------------------------------------------------

    def host_buffer(self, n: int, dtype: torch.dtype) -> Tensor:
        t = self.host.new(n, dtype, zero=True)
        self.host.pin(t)
        return t

    def host_empty(self, n: int, dtype: torch.dtype) -> Tensor:
        return self.host.new(n, dtype, zero=False)

    def pin(self, t: Tensor) -> None:
        self.host.pin(t)

    def staging(self, like: Tensor) -> Tensor:
        t = self.host_buffer(like.numel(), like.dtype).view(like.shape)
        self.counts["registrations"] -= 1  # torch's pinned caching allocator: no registration each time
        self.counts["staging"] += 1
        return t

    def empty(self, n: int, dtype: torch.dtype, meter: Meter | None = None) -> Tensor:
        """Device memory (``simgpu``), NaN-filled (never initialized; bytes 0xA5), reused from
        freed blocks of the same size and stream (see the module documentation)."""
        t = self.alloc.empty(n, dtype, self._alloc_lane())
        if meter is None:
            return t
        self.allocated.track(t)
        return meter.track(t)

    def keep_until_done(self, t: Tensor, stream: Any) -> None:
        blk = self.alloc.live_block(t)
        if blk is not None:
            with self.order.lock:
                blk.kept.append((stream, stream.lane.n))
            return
        held = [t]
        self._submit(stream, held.clear)

    # -- streams and events -----------------------------------------------------------------

    def _submit(self, stream: _Stream, op: Callable[[], None]) -> int:
        with self.order.lock:
            lane = stream.lane
            lane.vc = _join(lane.vc, self.order.host_vc)
            lane.n += 1
            return stream.submit(op)

    def copy(self, pairs: Sequence[tuple[Tensor, Tensor]], stream: Any) -> None:
        with on_stream(self.cuda, self.index, stream):
            _queue_copies(self, pairs, stream, blocking=False)

    def copy_blocking(self, pairs: Sequence[tuple[Tensor, Tensor]], stream: Any) -> None:
        with on_stream(self.cuda, self.index, stream):
            _queue_copies(self, pairs, stream, blocking=True)
        self.host_wait(self.record(stream))

    def elapsed(self, start: Any, end: Any) -> float | None:
        t0, t1 = start.time(), end.time()
        return None if t0 is None or t1 is None else max(0.0, t1 - t0)

    def record(self, stream: Any, timing: bool = False) -> SimEvent:
        e = SimEvent()
        e._stream = stream
        with self.order.lock:
            e._index = self._submit(stream, e._complete)
            e.vc = stream.lane.clock()
        return e

    def record_current(self, timing: bool = False) -> SimEvent:
        with self.order.lock:
            lane = self._lane()
            e = SimEvent(list(_local.pending), lane.clock())
            lane.n += 1
        return e

    def stream_waits(self, stream: Any, event: Any) -> None:
        if event is not None:
            with self.order.lock:
                stream.lane.vc = _join(stream.lane.vc, event.vc)
                self._submit(stream, event.wait)

    def current_waits(self, event: Any) -> None:
        if event is None:
            return
        with self.order.lock:
            lane = self._lane()
            lane.vc = _join(lane.vc, event.vc)
        # Lazy only in this thread's own code: a backward runs on autograd's device thread, so a
        # wait issued inside a backward is honoured now.
        if self in _local.lazy and not _local.stream_thread and torch._C._current_graph_task_id() == -1:
            _local.pending.append(event)
        else:
            event.wait()

    def host_wait(self, event: Any) -> None:
        if event is not None:
            event.wait()
            self.order.host_knows(event.vc, _compute_lane)

    def query(self, event: Any) -> bool:
        if event is None:
            return True
        done = bool(event.query())
        if done:
            self.order.host_knows(event.vc, _compute_lane)
        return done

    def thread_context(self) -> contextlib.AbstractContextManager[None]:
        return on_device(self.cuda, self.index)

    def capturing(self) -> bool:
        """Set ``self.graph_capture`` to model a CUDA graph capture on the current stream."""
        return self.graph_capture

    def drain(self) -> None:
        for s in (self.d2h, self.h2d, self.h2d_now):
            self.host_wait(self.record(s))

    def synchronize(self) -> None:
        """Every stream done, the compute streams too (``torch.cuda.synchronize``)."""
        self.drain()
        self._honour()
        with self.order.lock:
            for lane in [self.compute, *self._user_lanes]:
                self.order.host_vc = _join(self.order.host_vc, lane.clock())

    def hold(self, stream: Any) -> Callable[[], None]:
        """Stalls ``stream`` from its next operation until the returned function is called: a
        copy queued behind a wait that completes late (on a GPU, a prefetch waiting for a slot the
        compute still reads), for tests of what must not wait behind it."""
        gate = SimEvent()
        self.stream_waits(stream, gate)
        return gate._complete

    def counters(self) -> dict[str, int]:
        """Costs so far: ``host_waits_on_compute``, ``registrations`` (pinned host buffers),
        ``staging`` (cached pinned allocations), ``pageable_copies``, ``reuses`` (allocations
        served from freed memory), and ``live_events`` (events alive in the process)."""
        return {**self.counts, "live_events": SimEvent.live()}

    def close(self) -> None:
        """Completes the queued work and stops the stream threads; later work runs inline, and
        its tensors stay usable as plain memory."""
        if self.closed:
            return
        self.drain()
        self.closed = True
        for s in (self.d2h, self.h2d, self.h2d_now):
            s.stop()
        if simbackend._hooks.get(self.index) is self.hooks:
            simbackend.attach(self.index, None)


# -- copies (queued by SimulatedDevice.copy and copy_blocking) ----------------------------------------


def _ref(dev: SimulatedDevice, t: Tensor, write: bool) -> _Ref:
    alloc = dev.host.alloc_of(t)
    m = mem(t)
    blk = None if alloc is not None else dev.alloc.live_block(t)
    if alloc is None and blk is None and not write:
        # Held weakly: the storage's Python object lives exactly as long as the storage.
        return _Ref(weak=weakref.ref(m.untyped_storage()), geometry=(m.dtype, m.storage_offset(), m.shape, m.stride()))
    with _host_section():
        if alloc is not None or blk is not None:
            # A host buffer or memory of `empty`: the copy holds the simulator's memory, not
            # the client's storage (holding that would keep the client's release from being
            # seen; a late copy then writes into whoever holds the memory now).
            owned = alloc.memory if alloc is not None else blk.memory  # type: ignore[union-attr]
            assert owned is not None, "a copy queued on a released host buffer"
            alias = torch.empty(0, dtype=m.dtype).set_(owned.untyped_storage(), m.storage_offset(), m.shape, m.stride())
        else:
            alias = torch.empty(0, dtype=m.dtype).set_(m.untyped_storage(), m.storage_offset(), m.shape, m.stride())
    if alloc is None and write:
        # CUDA's copy_ bumps the version counter when it is launched, not when it runs.
        bump_version(t)
    return _Ref(alias=alias, alloc=alloc)

def _queue_copies(dev: SimulatedDevice, pairs: Sequence[tuple[Tensor, Tensor]], stream: Any, blocking: bool) -> None:
    """Queues the copies ``pairs`` on ``stream`` (see the module documentation)."""
    for d, s in pairs:
        _sides(stream, d, s)
    items = [(_ref(dev, d, True), _ref(dev, s, False)) for d, s in pairs]
    with dev.order.lock:
        dev.copied_bytes[stream.name] = dev.copied_bytes.get(stream.name, 0) + sum(
            s.numel() * s.element_size() for _, s in pairs
        )
    if not blocking:
        for (d, s), (dr, sr) in zip(pairs, items):
            host_side = dr if stream is dev.d2h else sr
            if host_side.alloc is None or not host_side.alloc.pinned:
                dev.counts["pageable_copies"] += 1
                if dev.strict:
                    side = "destination" if stream is dev.d2h else "source"
                    dev.violations.append(
                        f"{stream.name}: an asynchronous copy whose host {side} is not pinned ({tuple(s.shape)} {s.dtype}): "
                        "on a GPU it is staged through driver buffers and blocks the calling thread"
                    )

    def run() -> None:
        for d, s in items:
            assert d.alias is not None
            if d.alloc is not None and d.alloc.dead:
                dev.violations.append(f"{stream.name}: a copy wrote into a released host buffer")
                continue
            if s.alias is not None:
                if s.alloc is not None and s.alloc.dead:
                    dev.violations.append(f"{stream.name}: a copy read a released host buffer")
                    d.alias.fill_(float("nan"))
                    continue
                src = s.alias
            else:
                storage = s.weak()
                if storage is None:  # freed while the copy was queued: the block holds garbage
                    d.alias.fill_(float("nan"))
                    continue
                dtype, offset, shape, stride = s.geometry
                src = torch.empty(0, dtype=dtype).set_(storage, offset, shape, stride)
            d.alias.copy_(src)

    with dev.order.lock:
        n = dev._submit(stream, run)
        if dev.check_ordering:
            for d, s in pairs:
                what = f"{stream.name} copy of {tuple(s.shape)} {s.dtype}"
                # A blocking copy's host side is the host's own memory (pageable or pinned),
                # ordered by the host; only its device side is checked.
                if not (blocking and stream is not dev.d2h):
                    dev.order.check_copy(stream.lane, n, s, False, what)
                if not (blocking and stream is dev.d2h):
                    dev.order.check_copy(stream.lane, n, d, True, what)


__all__ = ["SimAllocator", "SimEvent", "SimHost", "SimulatedDevice", "UserStream"]
