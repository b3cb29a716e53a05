"""A simulated asynchronous device: CUDA stream semantics on the CPU, for tests.

It implements the :class:`~offload_adam.runtime.device.Device` interface, so the engine runs unchanged
on CPU parameters ("device" tensors) and host buffers, with the hazards of a real GPU kept:

* each side stream is a FIFO worker thread that runs its operations after a random, seeded
  delay; a copy reads its source when it runs, not when it is queued;
* an event completes when its stream reaches it; a stream or the host can wait on it;
* the current stream is the calling thread: its device operations run at once, and a wait of
  the current stream on an event (``current_waits``) is honoured at the thread's next device
  operation, not as an immediate host wait (inside a backward, whose kernels run in C++ unseen
  by the mode, at once). A device operation is a torch call that reads or
  writes device memory (a storage a queued copy has read or written: the parameters, their
  gradients); metadata, views, property access, host buffers and other CPU tensors (a
  checkpoint) are host work. While :meth:`SimulatedDevice.lazy` is entered, a torch-function
  mode sees every call of the thread (without it, ``current_waits`` waits at once);
* a device tensor freed while a queued copy still reads it (a GPU gradient dropped without
  ``keep_until_done``) is poisoned: the copy writes NaN, as a reused block would give garbage;
* a host buffer released while a queued copy still uses it is recorded in ``violations``
  (on a GPU: a DMA into unregistered, freed pages);
* with ``copies_on_demand`` (benchmarks) a stream runs its work only when something waits for
  it, so that simulated copies never take the cores the kernel runs on.

Writes into device tensors go through an alias with its own version counter, and the target's
version is bumped when the copy is queued, as CUDA's ``copy_`` bumps it at launch.
"""

from __future__ import annotations

import contextlib
import ctypes
import queue
import random
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from ..runtime.device import Meter


def _bump_version(t: Tensor) -> None:
    set_version = torch._C._autograd._unsafe_set_version_counter
    try:
        set_version((t,), (t._version + 1,))
    except TypeError:  # torch < 2.6 takes one tensor
        set_version(t, t._version + 1)  # type: ignore[arg-type]


class SimEvent:
    """Completes when its stream reaches it; an event of the current stream (``deps``) when
    all the events the current stream waits for have completed."""

    def __init__(self, deps: Sequence[SimEvent] | None = None) -> None:
        self._done = threading.Event()
        self._deps = deps
        self._stream: _Stream | None = None
        self._index = 0
        self._created = time.perf_counter()
        self._time: float | None = None

    def _complete(self) -> None:
        self._time = time.perf_counter()
        self._done.set()

    def time(self) -> float | None:
        """When it completed (an event of the current stream: when its waits had, or when it
        was recorded, the later); None before."""
        if self._deps is None:
            return self._time if self._done.is_set() else None
        times = [d.time() for d in self._deps]
        if any(t is None for t in times):
            return None
        return max([self._created, *[t for t in times if t is not None]])

    def wait(self) -> None:
        if self._deps is None:
            if self._stream is not None:
                self._stream.demand(self._index)
            self._done.wait()
        else:
            for d in self._deps:
                d.wait()

    def query(self) -> bool:
        return self._done.is_set() if self._deps is None else all(d.query() for d in self._deps)


@dataclass
class _HostAlloc:
    memory: Tensor | None  # the simulator's own reference: valid for copies after a release
    dead: bool = False


@dataclass
class _Ref:
    """What a queued copy holds of one tensor."""

    alias: Tensor | None = None  # shares the storage; its own version counter
    alloc: _HostAlloc | None = None  # set for host buffers
    weak: Any = None  # weak reference to the storage of a device tensor the copy reads
    geometry: tuple[Any, ...] = ()  # (dtype, storage offset, shape, stride) of that tensor


class _Stream:
    def __init__(self, dev: SimulatedDevice, name: str, seed: int) -> None:
        self.dev = dev
        self.name = name
        self._rng = random.Random(seed)
        self._q: queue.Queue[Callable[[], None] | None] = queue.Queue()
        # Operations are numbered from 1; with copies on demand, the thread runs operation n only
        # once something waits for an event at or after n.
        self._cv = threading.Condition()
        self._submitted = 0
        self._wanted = 0
        self.max_delay_s: float | None = None  # this stream's own delay bound (else the device's)
        self._thread = threading.Thread(target=self._loop, name=f"sim-{name}", daemon=True)
        self._thread.start()

    def submit(self, op: Callable[[], None]) -> int:
        if self.dev.closed:
            op()
            return 0
        with self._cv:
            self._submitted += 1
            n = self._submitted
        self._q.put(op)
        return n

    def demand(self, n: int) -> None:
        with self._cv:
            if n > self._wanted:
                self._wanted = n
                self._cv.notify_all()

    def _loop(self) -> None:
        _local.stream_thread = True
        ran = 0
        while True:
            op = self._q.get()
            if op is None:
                return
            ran += 1
            if self.dev.copies_on_demand:
                with self._cv:
                    self._cv.wait_for(lambda: self._wanted >= ran)
            delay = self.dev.max_delay_s if self.max_delay_s is None else self.max_delay_s
            if delay > 0:
                threading.Event().wait(self._rng.uniform(0.0, delay))
            try:
                op()
            except BaseException as e:  # recorded for the test to see
                self.dev.violations.append(f"{self.name}: {e!r}")

    def stop(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=30)

    def __repr__(self) -> str:
        return f"<sim stream {self.name}>"


class _Local(threading.local):
    pending: list[SimEvent]
    lazy: list[SimulatedDevice]
    host_section: int
    stream_thread: bool

    def __init__(self) -> None:
        self.pending = []
        self.lazy = []
        self.host_section = 0
        self.stream_thread = False


_local = _Local()


# Calls that read no tensor data (metadata, views): no device work, so no wait.
_NO_DEVICE_WORK = frozenset(
    "__get__ __set__ __delete__ __hash__ __len__ data_ptr detach dim element_size is_complex is_contiguous "
    "is_floating_point is_pinned ndimension nelement numel size storage_offset stride "
    "untyped_storage as_strided view view_as view_as_complex view_as_real".split()
)


class _HonourWaits(TorchFunctionMode):
    """Honours the current stream's pending waits before each device operation of this thread.

    A torch-function mode (not a dispatch mode, which changes how some in-place foreach ops
    count tensor versions): it sees every torch call of the thread's Python code."""

    def __init__(self, dev: SimulatedDevice) -> None:
        super().__init__()
        self.dev = dev

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if (
            _local.pending
            and not _local.host_section
            and getattr(func, "__name__", "") not in _NO_DEVICE_WORK
            and self.dev._is_device_op((args, kwargs))
        ):
            self.dev._honour()
        return func(*args, **kwargs)


class SimulatedDevice:
    """CUDA stream semantics on the CPU (see the module documentation)."""

    def __init__(self, seed: int = 0, max_delay_s: float = 0.002, copies_on_demand: bool = False) -> None:
        self.torch_device = torch.device("cpu")
        self.max_delay_s = max_delay_s
        # Benchmarks: a stream runs its work only once something waits for it, so that the
        # simulated copies never take this machine's cores while the kernel runs (a GPU's copy
        # engine needs none).
        self.copies_on_demand = copies_on_demand
        self.closed = False
        self.violations: list[str] = []
        self.copied_bytes: dict[str, int] = {}  # bytes queued for copying, by stream name
        self._count_lock = threading.Lock()
        self._hosts: dict[int, _HostAlloc] = {}
        self._device_mem: dict[int, Any] = {}  # storages queued copies have used: device memory
        self.allocated = Meter()  # device memory allocated through `empty`, current and peak
        self.d2h = _Stream(self, "d2h", seed * 2 + 1)
        self.h2d = _Stream(self, "h2d", seed * 2 + 2)
        # Testing aid of the simulator itself: False models a release that does not wait for
        # queued copies (what CUDA's cudaHostUnregister does), to show that tests catch it.
        self.release_waits = True

    # -- the current stream -----------------------------------------------------------------

    @contextlib.contextmanager
    def lazy(self) -> Iterator[None]:
        """Makes ``current_waits`` lazy in this thread: honoured at its next device operation."""
        _local.lazy.append(self)
        try:
            with _HonourWaits(self):
                yield
        finally:
            self._honour()
            _local.lazy.remove(self)

    def _honour(self) -> None:
        pending, _local.pending = _local.pending, []
        for e in pending:
            e.wait()

    @contextlib.contextmanager
    def _host_section(self) -> Iterator[None]:
        _local.host_section += 1
        try:
            yield
        finally:
            _local.host_section -= 1

    def _alloc_of(self, t: Tensor) -> _HostAlloc | None:
        try:
            return self._hosts.get(t.untyped_storage().data_ptr())
        except Exception:  # a tensor without storage
            return None

    def _is_device_op(self, tree: Any) -> bool:
        for t in tree_flatten(tree)[0]:
            if not isinstance(t, Tensor):
                continue
            try:
                st = t.untyped_storage()
            except Exception:
                continue
            ref = self._device_mem.get(st.data_ptr())
            if ref is not None and ref() is st:
                return True
        return False

    def _note_device(self, t: Tensor) -> None:
        st = t.untyped_storage()
        self._device_mem[st.data_ptr()] = weakref.ref(st)

    # -- memory -----------------------------------------------------------------------------

    def host_buffer(self, n: int, dtype: torch.dtype) -> Tensor:
        # The client's tensor does not own its memory: the simulator keeps it, so that a copy
        # queued before the client released it still finds valid memory (and records the
        # violation) instead of crashing; the release is seen when the client's storage dies.
        with self._host_section():
            memory = torch.zeros(n, dtype=dtype)
            nbytes = memory.untyped_storage().nbytes()
            raw = (ctypes.c_char * max(nbytes, 1)).from_address(memory.data_ptr())
            t = torch.frombuffer(raw, dtype=torch.uint8)[:nbytes].view(dtype)
        alloc = _HostAlloc(memory)
        ptr = t.untyped_storage().data_ptr()
        self._hosts[ptr] = alloc
        weakref.finalize(t.untyped_storage(), self._release, alloc, ptr)
        return t

    def _release(self, alloc: _HostAlloc, ptr: int) -> None:
        if self.release_waits and not _local.stream_thread:
            self.drain()
        alloc.dead = True
        alloc.memory = None
        if self._hosts.get(ptr) is alloc:
            del self._hosts[ptr]

    def staging(self, like: Tensor) -> Tensor:
        return self.host_buffer(like.numel(), like.dtype).view(like.shape)

    # -- streams and events -----------------------------------------------------------------

    def _ref(self, t: Tensor, write: bool) -> _Ref:
        alloc = self._alloc_of(t)
        if alloc is None:
            self._note_device(t)
        if alloc is None and not write:
            # Held weakly: the storage's Python object lives exactly as long as the storage.
            return _Ref(weak=weakref.ref(t.untyped_storage()), geometry=(t.dtype, t.storage_offset(), t.shape, t.stride()))
        with self._host_section():
            if alloc is not None:
                # A host buffer: the copy holds the simulator's memory, not the client's storage
                # (holding that would keep the client's release from being seen).
                assert alloc.memory is not None, "a copy queued on a released host buffer"
                # The client's storage starts where the simulator's memory does.
                mem = alloc.memory
                alias = torch.empty(0, dtype=t.dtype).set_(mem.untyped_storage(), t.storage_offset(), t.shape, t.stride())
            else:
                alias = torch.empty(0, dtype=t.dtype).set_(t.untyped_storage(), t.storage_offset(), t.shape, t.stride())
        if alloc is None:
            # CUDA's copy_ bumps the version counter when it is launched, not when it runs.
            _bump_version(t)
        return _Ref(alias=alias, alloc=alloc)

    def copy(self, pairs: Sequence[tuple[Tensor, Tensor]], stream: Any) -> None:
        items = [(self._ref(d, True), self._ref(s, False)) for d, s in pairs]
        with self._count_lock:
            self.copied_bytes[stream.name] = self.copied_bytes.get(stream.name, 0) + sum(
                s.numel() * s.element_size() for _, s in pairs
            )

        def run() -> None:
            for d, s in items:
                assert d.alias is not None
                if d.alloc is not None and d.alloc.dead:
                    self.violations.append(f"{stream.name}: a copy wrote into a released host buffer")
                    continue
                if s.alloc is not None:
                    if s.alloc.dead:
                        self.violations.append(f"{stream.name}: a copy read a released host buffer")
                        d.alias.fill_(float("nan"))
                        continue
                    assert s.alias is not None
                    src = s.alias
                else:
                    storage = s.weak()
                    if storage is None:  # freed while the copy was queued: the block holds garbage
                        d.alias.fill_(float("nan"))
                        continue
                    dtype, offset, shape, stride = s.geometry
                    src = torch.empty(0, dtype=dtype).set_(storage, offset, shape, stride)
                d.alias.copy_(src)

        stream.submit(run)

    def empty(self, n: int, dtype: torch.dtype, meter: Meter | None = None) -> Tensor:
        """Device memory: a CPU tensor the simulator treats as device memory (waits of the
        current stream are honoured before operations on it), NaN-filled (never initialized; bytes
        0xA5)."""
        with self._host_section():
            # NaN, or for bytes a pattern that decodes to garbage in any dtype
            t = torch.full((n,), float("nan") if dtype.is_floating_point else 0xA5 if dtype == torch.uint8 else -1, dtype=dtype)
        self._note_device(t)
        self.allocated.track(t)
        return meter.track(t) if meter is not None else t

    def elapsed(self, start: Any, end: Any) -> float | None:
        t0, t1 = start.time(), end.time()
        return None if t0 is None or t1 is None else max(0.0, t1 - t0)

    def record(self, stream: Any, timing: bool = False) -> SimEvent:
        e = SimEvent()
        e._stream = stream
        e._index = stream.submit(e._complete)
        return e

    def record_current(self, timing: bool = False) -> SimEvent:
        return SimEvent(list(_local.pending))

    def stream_waits(self, stream: Any, event: Any) -> None:
        if event is not None:
            stream.submit(event.wait)

    def current_waits(self, event: Any) -> None:
        if event is None:
            return
        # Lazy only where the mode sees the thread's torch calls: a backward's kernels run in
        # C++ without passing through it, so a wait issued inside a backward is honoured now.
        if self in _local.lazy and not _local.stream_thread and torch._C._current_graph_task_id() == -1:
            _local.pending.append(event)
        else:
            event.wait()

    def host_wait(self, event: Any) -> None:
        if event is not None:
            event.wait()

    def query(self, event: Any) -> bool:
        return event is None or bool(event.query())

    def keep_until_done(self, t: Tensor, stream: Any) -> None:
        held = [t]
        stream.submit(held.clear)

    def thread_context(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def drain(self) -> None:
        for s in (self.d2h, self.h2d):
            self.record(s).wait()

    def close(self) -> None:
        """Completes the queued work and stops the stream threads; later work runs inline."""
        if self.closed:
            return
        self.drain()
        self.closed = True
        self.d2h.stop()
        self.h2d.stop()
