"""A simulated asynchronous device: CUDA stream semantics on the CPU, for tests.

It implements the :class:`~offload_adam.runtime.device.Device` interface, so the clients run
unchanged on CPU parameters ("device" tensors) and host buffers, with the hazards of a real GPU
kept. What it models:

* **Side streams.** Each (``d2h``, ``h2d``, ``h2d_now``) is a FIFO worker thread that runs its operations
  after a random, seeded delay; a copy reads its source when it runs, not when it is queued. An
  event completes when its stream reaches it; a stream or the host can wait on it.
* **The compute stream.** The current stream is the calling thread: its device operations run at
  once, and a wait of the current stream on an event (``current_waits``) is honoured at the
  thread's next device operation, not as an immediate host wait (inside a backward, whose
  kernels run in C++ unseen by the mode, at once). A device operation is a torch call that reads
  or writes device memory (a storage a queued copy has read or written: the parameters, their
  gradients); metadata, views, property access, host buffers and other CPU tensors (a
  checkpoint) are host work. While :meth:`SimulatedDevice.lazy` is entered, a torch-function
  mode sees every call of the thread (without it, ``current_waits`` waits at once). User streams
  (:meth:`SimulatedDevice.stream`, entered with :meth:`SimulatedDevice.use_stream`) are other
  compute streams, ordered with the default one only through events.
* **Happens-before** (``check_ordering``). Since the compute runs on the host, it has always
  finished when the next copy is queued: a copy that overwrites memory compute may still read
  would go unseen. So every stream keeps a vector clock (CUDA's stream-sanitizer algorithm):
  compute operations are stamped with their stream's epoch (a torch-dispatch mode records what
  each operation reads and writes, in the backward too), copies with their stream's operation
  number; an event carries its stream's clock, a stream or host wait merges it. A copy that
  writes memory whose last reader or writer on another stream it is not ordered after, or reads
  memory whose last writer it is not ordered after, is a violation naming both.
* **The caching allocator** (``empty``). Memory freed is reused by the next allocation on the
  stream that allocated it, at once, poisoned with NaN; memory a ``keep_until_done`` holds for
  another stream only once that stream has passed the point where it was freed. A reuse while
  another stream may still use the memory (not ordered, not held) is a violation; a copy still
  queued into it clobbers the new owner, as on a GPU.
* **Host memory.** A host buffer (``host_buffer``, ``staging``: pinned) released while a queued
  copy still uses it is a violation (on a GPU: a DMA into unregistered, freed pages); freed device
  memory a queued copy reads gives NaN. An asynchronous copy whose host side is not pinned (the
  destination of a ``d2h`` copy, the source of one to the device) is counted, and a violation in
  ``strict`` mode; ``copy_blocking`` (cold paths) may use pageable memory.
* **Devices.** A thread has a current device (``cuda``, a model of ``torch.cuda``'s device and
  stream contexts and of the primary contexts they create). The device runs its copies through
  the runtime's own ``on_stream`` and registers host memory through ``on_device``, as the CUDA
  device does: leaving a stream context sets the device current when it was entered, so work for
  device N entered from a thread whose current device is 0 touches device 0 (a context there),
  which is a violation.
* **Costs** (:meth:`SimulatedDevice.counters`): host waits on the compute stream, live events,
  pin registrations, pageable copies, so tests can assert they stay bounded from step to step.
* With ``copies_on_demand`` (benchmarks) a stream runs its work only when something waits for
  it, so that simulated copies never take the cores the kernel runs on.

Writes into device tensors go through an alias with its own version counter, and the target's
version is bumped when the copy is queued, as CUDA's ``copy_`` bumps it at launch.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import itertools
import queue
import random
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..runtime.device import Meter, on_device, on_stream


def _bump_version(t: Tensor) -> None:
    set_version = torch._C._autograd._unsafe_set_version_counter
    try:
        set_version((t,), (t._version + 1,))
    except TypeError:  # torch < 2.6 takes one tensor
        set_version(t, t._version + 1)  # type: ignore[arg-type]


# -- happens-before -------------------------------------------------------------------------------

Clock = dict[str, int]


def _join(a: Clock, b: Clock) -> Clock:
    out = dict(a)
    for k, v in b.items():
        if v > out.get(k, 0):
            out[k] = v
    return out


class _Lane:
    """A stream in the happens-before order: its operations are numbered (``n``), and ``vc``
    holds, per other stream, the latest operation it is ordered after."""

    def __init__(self, name: str, compute: bool) -> None:
        self.name = name
        self.compute = compute
        self.n = 1 if compute else 0  # compute: the current epoch; a side stream: its last operation
        self.vc: Clock = {}

    def clock(self) -> Clock:
        c = dict(self.vc)
        c[self.name] = self.n
        return c


@dataclass
class _Access:
    lane: str
    n: int
    what: str
    lo: int  # bytes of the storage
    hi: int
    write: bool


def _span(t: Tensor) -> tuple[int, int]:
    """The bytes of its storage a tensor covers."""
    es = t.element_size()
    if t.numel() == 0:
        return 0, 0
    extent = 1 + sum((int(n) - 1) * abs(int(st)) for n, st in zip(t.shape, t.stride()))
    lo = int(t.storage_offset()) * es
    return lo, lo + extent * es


class _History:
    """The accesses to a piece of memory (byte ranges) that later ones may conflict with."""

    MAX = 512

    def __init__(self, label: str) -> None:
        self.label = label
        self.accesses: list[_Access] = []

    def conflicts(self, lo: int, hi: int, write: bool) -> list[_Access]:
        """Earlier accesses a new one over [lo, hi) must be ordered after: writes, and (for a
        write) reads."""
        return [a for a in self.accesses if a.lo < hi and lo < a.hi and (write or a.write)]

    def record(self, a: _Access) -> None:
        if a.write:
            # A write hides what it covers whole (already checked against it).
            self.accesses = [b for b in self.accesses if not (a.lo <= b.lo and b.hi <= a.hi)]
        else:
            self.accesses = [
                b for b in self.accesses if not (not b.write and b.lane == a.lane and a.lo <= b.lo and b.hi <= a.hi)
            ]
        self.accesses.append(a)
        if len(self.accesses) > self.MAX:
            del self.accesses[: len(self.accesses) - self.MAX]

    def forget(self, done: Clock) -> None:
        """Drops the accesses ``done`` covers (their streams have passed them)."""
        self.accesses = [a for a in self.accesses if done.get(a.lane, 0) < a.n]


class SimEvent:
    """Completes when its stream reaches it; an event of a compute stream (``deps``) when all
    the events that stream waits for have completed. ``vc``: its stream's clock when recorded."""

    _created = itertools.count()  # next() is atomic: events are made and collected on any thread
    _freed = itertools.count()

    def __init__(self, deps: Sequence[SimEvent] | None = None, vc: Clock | None = None) -> None:
        self._done = threading.Event()
        self._deps = deps
        self._stream: _Stream | None = None
        self._index = 0
        self._created_at = time.perf_counter()
        self._time: float | None = None
        self.vc: Clock = vc or {}
        next(SimEvent._created)

    def __del__(self) -> None:
        next(SimEvent._freed)

    @staticmethod
    def live() -> int:
        """Events alive in the process (created minus garbage)."""
        return next(copy.copy(SimEvent._created)) - next(copy.copy(SimEvent._freed))

    def _complete(self) -> None:
        self._time = time.perf_counter()
        self._done.set()

    def time(self) -> float | None:
        """When it completed (an event of a compute stream: when its waits had, or when it was
        recorded, the later); None before."""
        if self._deps is None:
            return self._time if self._done.is_set() else None
        times = [d.time() for d in self._deps]
        if any(t is None for t in times):
            return None
        return max([self._created_at, *[t for t in times if t is not None]])

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
    nbytes: int = 0
    pinned: bool = True  # host_empty memory is not, until pin()


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
        self.lane = _Lane(name, compute=False)
        self._rng = random.Random(seed)
        self._q: queue.Queue[Callable[[], None] | None] = queue.Queue()
        # Operations are numbered from 1; with copies on demand, the thread runs operation n only
        # once something waits for an event at or after n.
        self._cv = threading.Condition()
        self._wanted = 0
        self.ran = 0  # operations completed
        self.max_delay_s: float | None = None  # this stream's own delay bound (else the device's)
        self._thread = threading.Thread(target=self._loop, name=f"sim-{name}", daemon=True)
        self._thread.start()

    def submit(self, op: Callable[[], None]) -> int:
        """Queues ``op``; its number on this stream (the lane's clock is advanced by the
        caller, under the device's lock: ``SimulatedDevice._submit``)."""
        if self.dev.closed:
            op()
            return 0
        n = self.lane.n
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
            self.ran = ran

    def stop(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=30)

    def __repr__(self) -> str:
        return f"<sim stream {self.name}>"


class UserStream:
    """A compute stream of the user's (``torch.cuda.Stream()``): enter it with
    :meth:`SimulatedDevice.use_stream`."""

    def __init__(self, name: str) -> None:
        self.lane = _Lane(name, compute=True)

    def __repr__(self) -> str:
        return f"<sim user stream {self.lane.name}>"


class _Local(threading.local):
    pending: list[SimEvent]
    lazy: list[SimulatedDevice]
    host_section: int
    stream_thread: bool
    user: dict[int, UserStream]  # id(device) -> the user stream entered
    current_device: int

    def __init__(self) -> None:
        self.pending = []
        self.lazy = []
        self.host_section = 0
        self.stream_thread = False
        self.user = {}
        self.current_device = 0


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


# Per aten operator: the positions (or names) of its tensor arguments read and written; views
# (an aliased argument not written) are neither.
_Plan = tuple[tuple[tuple[int, str], ...], tuple[tuple[int, str], ...], tuple[int, ...]]
_plans: dict[Any, _Plan] = {}


def _plan(func: Any) -> _Plan:
    p = _plans.get(func)
    if p is None:
        reads, writes = [], []
        for i, a in enumerate(func._schema.arguments):
            info = a.alias_info
            if info is not None and info.is_write:
                writes.append((i, a.name))
            elif info is None:
                reads.append((i, a.name))
        fresh = tuple(i for i, r in enumerate(func._schema.returns) if r.alias_info is None)
        p = _plans[func] = (tuple(reads), tuple(writes), fresh)
    return p


def _leaves(t: Tensor) -> list[Tensor]:
    """``t``, or the inner tensors of a wrapper subclass (a quantized weight: the memory it
    reads is theirs), recursively."""
    flatten = getattr(t, "__tensor_flatten__", None)
    if flatten is None or type(t) in (Tensor, torch.nn.Parameter):
        return [t]
    return [leaf for name in flatten()[0] for leaf in _leaves(getattr(t, name))]


def _tensors(x: Any) -> list[Tensor]:
    if isinstance(x, Tensor):
        return _leaves(x)
    if isinstance(x, (list, tuple)):
        return [leaf for t in x if isinstance(t, Tensor) for leaf in _leaves(t)]
    return []


class _Stamp(TorchDispatchMode):
    """Records what each compute operation of this thread reads and writes (forward and
    backward), with the current stream's epoch: the happens-before check of the copies."""

    def __init__(self, dev: SimulatedDevice) -> None:
        super().__init__()
        self.dev = dev

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if _local.host_section:
            return func(*args, **kwargs)
        reads, writes, fresh = _plan(func)

        def arg(i: int, name: str) -> Any:
            return args[i] if i < len(args) else kwargs.get(name)

        written = [t for i, n in writes for t in _tensors(arg(i, n))]
        versions = [t._version for t in written] if func.name().startswith("aten::_foreach_") else None
        dev = self.dev
        what = func.name().removeprefix("aten::")
        for i, n in reads:
            for t in _tensors(arg(i, n)):
                dev._compute_access(t, False, what)
        for t in written:
            dev._compute_access(t, True, what)
        out = func(*args, **kwargs)
        if versions is not None:
            # A foreach op under a dispatch mode does not bump its outputs' version counters.
            for t, v in zip(written, versions):
                if t._version == v:
                    _bump_version(t)
        if fresh:
            outs = out if isinstance(out, (tuple, list)) else (out,)
            for i in fresh:
                if i < len(outs):
                    for t in _tensors(outs[i]):
                        dev._compute_access(t, True, what)
        return out


class SimCuda:
    """A model of ``torch.cuda``'s device and stream contexts for the runtime's ``on_device`` and
    ``on_stream``: a current device per thread (0 in a new thread), and the devices that have a
    primary context. ``device(i)`` sets ``i`` (its context created) and restores the previous
    device only if that one has a context already (``MaybeExchangeDevice``); leaving
    ``stream(s)`` sets the device that was current when it was entered (``_cuda_setStream``
    calls ``set_device``), creating its context."""

    def __init__(self, dev: SimulatedDevice) -> None:
        self.dev = dev
        self.contexts = {dev.index}

    def _set(self, i: int, why: str) -> None:
        if i not in self.contexts:
            self.contexts.add(i)
            self.dev.violations.append(
                f"device {i}: a context created by work for device {self.dev.index} ({why}): hundreds of MiB on GPU {i}"
            )
        _local.current_device = i

    def current_device(self) -> int:
        return _local.current_device

    @contextlib.contextmanager
    def device(self, i: Any) -> Iterator[None]:
        i = int(i)
        prev = _local.current_device
        self._set(i, "torch.cuda.device")
        try:
            yield
        finally:
            if prev in self.contexts:
                _local.current_device = prev

    @contextlib.contextmanager
    def stream(self, s: Any) -> Iterator[None]:
        entered = _local.current_device
        if entered != self.dev.index:
            # The stream's device is made current for the switch, and left again below.
            self._set(self.dev.index, "torch.cuda.stream")
        try:
            yield
        finally:
            self._set(entered, "leaving torch.cuda.stream: set_device of the stream current before")

    def register(self) -> None:
        """``cudaHostRegister`` runs in the current device's context."""
        if _local.current_device != self.dev.index:
            self._set(_local.current_device, "cudaHostRegister")


class SimulatedDevice:
    """CUDA stream semantics on the CPU (see the module documentation)."""

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
        self.torch_device = torch.device("cpu")
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
        self._count_lock = threading.Lock()
        self._hosts: dict[int, _HostAlloc] = {}
        self._device_mem: dict[int, Any] = {}  # storages queued copies have used: device memory
        self.allocated = Meter()  # device memory allocated through `empty`, current and peak
        self._hb = threading.RLock()
        self.compute = _Lane("compute", compute=True)
        self._host_vc: Clock = {}
        self._histories: dict[int, tuple[Any, _History]] = {}  # storage ptr -> (weak storage, history)
        self._inserts = 0
        self._blocks: dict[int, _Block] = {}  # base address -> block of `empty`
        self._free: list[_Block] = []
        self._users = itertools.count(1)
        self._user_lanes: list[_Lane] = []
        self.counts = {"host_waits_on_compute": 0, "registrations": 0, "staging": 0, "pageable_copies": 0, "reuses": 0}
        self.cuda = SimCuda(self)
        self.d2h = _Stream(self, "d2h", seed * 2 + 1)
        self.h2d = _Stream(self, "h2d", seed * 2 + 2)
        self.h2d_now = _Stream(self, "h2d_now", seed * 2 + 3 + 10**6)
        # Testing aid of the simulator itself: False models a release that does not wait for
        # queued copies (what CUDA's cudaHostUnregister does), to show that tests catch it.
        self.release_waits = True
        self.graph_capture = False  # a CUDA graph capture on the current stream (capturing())

    # -- the compute streams ------------------------------------------------------------------

    def stream(self) -> UserStream:
        """A new user stream (``torch.cuda.Stream()``)."""
        s = UserStream(f"user{next(self._users)}")
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

    @contextlib.contextmanager
    def lazy(self) -> Iterator[None]:
        """Makes ``current_waits`` lazy in this thread: honoured at its next device operation;
        with ``check_ordering``, records the compute's reads and writes."""
        _local.lazy.append(self)
        try:
            with _HonourWaits(self), _Stamp(self) if self.check_ordering else contextlib.nullcontext():
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
        for t in (leaf for x in tree_flatten(tree)[0] if isinstance(x, Tensor) for leaf in _leaves(x)):
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

    # -- happens-before -----------------------------------------------------------------------

    def _history(self, t: Tensor, create: bool = True) -> _History | None:
        """The access history of ``t``'s memory (device memory, or a host buffer)."""
        try:
            st = t.untyped_storage()
        except Exception:
            return None
        ptr = st.data_ptr()
        if not ptr:
            return None
        blk = self._blocks.get(ptr)
        if blk is not None and blk.live:
            return blk.history
        found = self._histories.get(ptr)
        if found is not None and found[0]() is st:
            return found[1]
        if not create:
            return None
        alloc = self._hosts.get(ptr)
        label = f"host buffer of {alloc.nbytes} bytes" if alloc is not None else f"device memory of {st.nbytes()} bytes"
        h = _History(label)
        self._histories[ptr] = (weakref.ref(st), h)
        self._inserts += 1
        if self._inserts > 2 * len(self._histories) + 1000:
            self._histories = {k: v for k, v in self._histories.items() if v[0]() is not None}
            self._inserts = 0
        return h

    def _compute_access(self, t: Tensor, write: bool, what: str) -> None:
        if t.device.type != "cpu":
            return
        with self._hb:
            try:
                ptr = t.untyped_storage().data_ptr()
            except Exception:
                return
            if ptr in self._hosts:
                return  # host memory: not the compute stream's
            h = self._history(t)
            if h is not None:
                lane = self._lane()
                lo, hi = _span(t)
                h.record(_Access(lane.name, lane.n, what, lo, hi, write))

    def _check_copy(self, lane: _Lane, n: int, t: Tensor, write: bool, what: str) -> None:
        """The copy ``what`` (operation ``n`` of ``lane``) reads or writes ``t``'s memory: it must
        be ordered after the memory's last write on other streams (and, writing, its reads)."""
        h = self._history(t)
        if h is None:
            return
        vc = lane.vc
        lo, hi = _span(t)
        for a in h.conflicts(lo, hi, write):
            if a.lane != lane.name and vc.get(a.lane, 0) < a.n:
                verb = "writes" if write else "reads"
                kind = "op" if a.lane in ("d2h", "h2d", "h2d_now") else "epoch"
                self.violations.append(
                    f"{what} (op {n} of {lane.name}) {verb} bytes {lo}-{hi} of {h.label}, last used by {a.what} "
                    f"({kind} {a.n} of {a.lane}), which {lane.name} has not waited for (it waited {a.lane} up to "
                    f"{vc.get(a.lane, 0)})"
                )
        h.record(_Access(lane.name, n, what, lo, hi, write))

    def _submit(self, stream: _Stream, op: Callable[[], None]) -> int:
        with self._hb:
            lane = stream.lane
            lane.vc = _join(lane.vc, self._host_vc)
            lane.n += 1
            return stream.submit(op)

    def _host_knows(self, e: SimEvent) -> None:
        """The host has seen ``e`` complete: what it submits later follows e."""
        with self._hb:
            for k, v in e.vc.items():
                if k == self.compute.name or k.startswith("user"):
                    if v > self._host_vc.get(k, 0):
                        self.counts["host_waits_on_compute"] += 1
                        break
            self._host_vc = _join(self._host_vc, e.vc)

    # -- memory -----------------------------------------------------------------------------

    def host_buffer(self, n: int, dtype: torch.dtype) -> Tensor:
        # The client's tensor does not own its memory: the simulator keeps it, so that a copy
        # queued before the client released it still finds valid memory (and records the
        # violation) instead of crashing; the release is seen when the client's storage dies.
        t = self._host(n, dtype, zero=True)
        self.pin(t)
        return t

    def host_empty(self, n: int, dtype: torch.dtype) -> Tensor:
        return self._host(n, dtype, zero=False)

    def _host(self, n: int, dtype: torch.dtype, zero: bool) -> Tensor:
        with self._host_section():
            memory = torch.zeros(n, dtype=dtype) if zero else torch.empty(n, dtype=dtype)
            nbytes = memory.untyped_storage().nbytes()
            raw = (ctypes.c_char * max(nbytes, 1)).from_address(memory.data_ptr())
            t = torch.frombuffer(raw, dtype=torch.uint8)[:nbytes].view(dtype)
        alloc = _HostAlloc(memory, nbytes=nbytes, pinned=False)
        ptr = t.untyped_storage().data_ptr()
        self._hosts[ptr] = alloc
        weakref.finalize(t.untyped_storage(), self._release, alloc, ptr)
        return t

    def pin(self, t: Tensor) -> None:
        alloc = self._alloc_of(t)
        assert alloc is not None and not alloc.pinned, "pin() takes a host_empty buffer, once"
        if alloc.nbytes:
            with on_device(self.cuda, self.index):
                self.cuda.register()
            self.counts["registrations"] += 1
        alloc.pinned = True

    def _release(self, alloc: _HostAlloc, ptr: int) -> None:
        if self.release_waits and not _local.stream_thread:
            self.drain()
        alloc.dead = True
        alloc.memory = None
        if self._hosts.get(ptr) is alloc:
            del self._hosts[ptr]
            with self._hb:
                self._histories.pop(ptr, None)

    def staging(self, like: Tensor) -> Tensor:
        t = self.host_buffer(like.numel(), like.dtype).view(like.shape)
        self.counts["registrations"] -= 1  # torch's pinned caching allocator: no registration each time
        self.counts["staging"] += 1
        return t

    # -- streams and events -----------------------------------------------------------------

    def _ref(self, t: Tensor, write: bool) -> _Ref:
        alloc = self._alloc_of(t)
        blk = None
        if alloc is None:
            self._note_device(t)
            blk = self._blocks.get(t.untyped_storage().data_ptr())
            if blk is not None and not blk.live:
                blk = None
        if alloc is None and blk is None and not write:
            # Held weakly: the storage's Python object lives exactly as long as the storage.
            return _Ref(weak=weakref.ref(t.untyped_storage()), geometry=(t.dtype, t.storage_offset(), t.shape, t.stride()))
        with self._host_section():
            if alloc is not None or blk is not None:
                # A host buffer or memory of `empty`: the copy holds the simulator's memory, not
                # the client's storage (holding that would keep the client's release from being
                # seen; a late copy then writes into whoever holds the memory now).
                mem = alloc.memory if alloc is not None else blk.memory  # type: ignore[union-attr]
                assert mem is not None, "a copy queued on a released host buffer"
                alias = torch.empty(0, dtype=t.dtype).set_(mem.untyped_storage(), t.storage_offset(), t.shape, t.stride())
            else:
                alias = torch.empty(0, dtype=t.dtype).set_(t.untyped_storage(), t.storage_offset(), t.shape, t.stride())
        if alloc is None and write:
            # CUDA's copy_ bumps the version counter when it is launched, not when it runs.
            _bump_version(t)
        return _Ref(alias=alias, alloc=alloc)

    def _queue_copies(self, pairs: Sequence[tuple[Tensor, Tensor]], stream: Any, blocking: bool) -> None:
        items = [(self._ref(d, True), self._ref(s, False)) for d, s in pairs]
        with self._count_lock:
            self.copied_bytes[stream.name] = self.copied_bytes.get(stream.name, 0) + sum(
                s.numel() * s.element_size() for _, s in pairs
            )
        if not blocking:
            for (d, s), (dr, sr) in zip(pairs, items):
                host_side = dr if stream is self.d2h else sr
                if host_side.alloc is None or not host_side.alloc.pinned:
                    self.counts["pageable_copies"] += 1
                    if self.strict:
                        side = "destination" if stream is self.d2h else "source"
                        self.violations.append(
                            f"{stream.name}: an asynchronous copy whose host {side} is not pinned ({tuple(s.shape)} {s.dtype}): "
                            "on a GPU it is staged through driver buffers and blocks the calling thread"
                        )

        def run() -> None:
            for d, s in items:
                assert d.alias is not None
                if d.alloc is not None and d.alloc.dead:
                    self.violations.append(f"{stream.name}: a copy wrote into a released host buffer")
                    continue
                if s.alias is not None:
                    if s.alloc is not None and s.alloc.dead:
                        self.violations.append(f"{stream.name}: a copy read a released host buffer")
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

        with self._hb:
            n = self._submit(stream, run)
            if self.check_ordering:
                for d, s in pairs:
                    what = f"{stream.name} copy of {tuple(s.shape)} {s.dtype}"
                    # A blocking copy's host side is the host's own memory (pageable or pinned),
                    # ordered by the host; only its device side is checked.
                    if not (blocking and stream is not self.d2h):
                        self._check_copy(stream.lane, n, s, False, what)
                    if not (blocking and stream is self.d2h):
                        self._check_copy(stream.lane, n, d, True, what)

    def copy(self, pairs: Sequence[tuple[Tensor, Tensor]], stream: Any) -> None:
        with on_stream(self.cuda, self.index, stream):
            self._queue_copies(pairs, stream, blocking=False)

    def copy_blocking(self, pairs: Sequence[tuple[Tensor, Tensor]], stream: Any) -> None:
        with on_stream(self.cuda, self.index, stream):
            self._queue_copies(pairs, stream, blocking=True)
        self.host_wait(self.record(stream))

    def empty(self, n: int, dtype: torch.dtype, meter: Meter | None = None) -> Tensor:
        """Device memory: a CPU tensor the simulator treats as device memory (waits of the
        current stream are honoured before operations on it), NaN-filled (never initialized; bytes
        0xA5), reused from freed blocks of the same size and stream (see the module
        documentation)."""
        es = torch.empty((), dtype=dtype).element_size()
        nbytes = n * es
        lane = self._lane()
        with self._hb:
            self._collect()
            # Not a block whose keep_until_done streams have not passed its free yet.
            blk = next((b for b in self._free if b.nbytes == nbytes and b.lane == lane.name and not b.waiting), None)
            if blk is not None:
                self._free.remove(blk)
                self._check_reuse(blk, lane)
                self.counts["reuses"] += 1
            else:
                with self._host_section():
                    memory = torch.empty(max(nbytes, 1), dtype=torch.uint8)
                blk = _Block(memory, nbytes, lane.name, _History(f"device memory of {nbytes} bytes ({dtype})"))
            blk.history = _History(f"device memory of {nbytes} bytes ({dtype})")
            blk.live, blk.kept, blk.waiting = True, [], []
        with self._host_section():
            raw = (ctypes.c_char * max(nbytes, 1)).from_address(blk.memory.data_ptr())
            t = torch.frombuffer(raw, dtype=torch.uint8)[:nbytes].view(dtype)
            # NaN, or for bytes a pattern that decodes to garbage in any dtype
            t.fill_(float("nan") if dtype.is_floating_point else 0xA5 if dtype == torch.uint8 else -1)
        self._blocks[blk.memory.data_ptr()] = blk
        weakref.finalize(t.untyped_storage(), self._freed, blk)
        self._note_device(t)
        self.allocated.track(t)
        return meter.track(t) if meter is not None else t

    def _freed(self, blk: _Block) -> None:
        """A client's memory of `empty` is garbage: back to its stream's pool, at once, or once
        the streams ``keep_until_done`` named have passed this point."""
        with self._hb:
            blk.live = False
            blk.waiting = [self.record(s) for s, _ in blk.kept] if not self.closed else []
            if not blk.kept:
                # Reusable at once: a copy still reading it reads garbage (here NaN: 0xFF bytes).
                with self._host_section():
                    blk.memory.fill_(0xFF)
            blk.kept = []
            self._free.append(blk)

    def _collect(self) -> None:
        for blk in self._free:
            if blk.waiting and all(e.query() for e in blk.waiting):
                # The allocator saw those streams pass the free: their uses are over.
                for e in blk.waiting:
                    blk.history.forget(e.vc)
                blk.waiting = []

    def _check_reuse(self, blk: _Block, lane: _Lane) -> None:
        if not self.check_ordering:
            return
        vc = _join(lane.clock(), self._host_vc)
        h = blk.history
        for a in h.accesses:
            if a.lane != lane.name and vc.get(a.lane, 0) < a.n:
                self.violations.append(
                    f"{h.label} freed on {blk.lane} and reused by the next allocation there while {a.what} (op {a.n} of "
                    f"{a.lane}) may still use it: keep_until_done (record_stream) missing"
                )

    def elapsed(self, start: Any, end: Any) -> float | None:
        t0, t1 = start.time(), end.time()
        return None if t0 is None or t1 is None else max(0.0, t1 - t0)

    def record(self, stream: Any, timing: bool = False) -> SimEvent:
        e = SimEvent()
        e._stream = stream
        with self._hb:
            e._index = self._submit(stream, e._complete)
            e.vc = stream.lane.clock()
        return e

    def record_current(self, timing: bool = False) -> SimEvent:
        with self._hb:
            lane = self._lane()
            e = SimEvent(list(_local.pending), lane.clock())
            lane.n += 1
        return e

    def stream_waits(self, stream: Any, event: Any) -> None:
        if event is not None:
            with self._hb:
                stream.lane.vc = _join(stream.lane.vc, event.vc)
                self._submit(stream, event.wait)

    def current_waits(self, event: Any) -> None:
        if event is None:
            return
        with self._hb:
            lane = self._lane()
            lane.vc = _join(lane.vc, event.vc)
        # Lazy only where the mode sees the thread's torch calls: a backward's kernels run in
        # C++ without passing through it, so a wait issued inside a backward is honoured now.
        if self in _local.lazy and not _local.stream_thread and torch._C._current_graph_task_id() == -1:
            _local.pending.append(event)
        else:
            event.wait()

    def host_wait(self, event: Any) -> None:
        if event is not None:
            event.wait()
            self._host_knows(event)

    def query(self, event: Any) -> bool:
        if event is None:
            return True
        done = bool(event.query())
        if done:
            self._host_knows(event)
        return done

    def keep_until_done(self, t: Tensor, stream: Any) -> None:
        blk = self._blocks.get(t.untyped_storage().data_ptr())
        if blk is not None and blk.live:
            with self._hb:
                blk.kept.append((stream, stream.lane.n))
            return
        held = [t]
        self._submit(stream, held.clear)

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
        with self._hb:
            for lane in [self.compute, *self._user_lanes]:
                self._host_vc = _join(self._host_vc, lane.clock())

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
        """Completes the queued work and stops the stream threads; later work runs inline."""
        if self.closed:
            return
        self.drain()
        self.closed = True
        self.d2h.stop()
        self.h2d.stop()
        self.h2d_now.stop()
