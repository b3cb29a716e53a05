"""The streams, events and device contexts of the simulated device.

* **Side streams** (``d2h``, ``h2d``, ``h2d_now``): each a FIFO worker thread that runs its
  operations after a random, seeded delay; a copy reads its source when it runs, not when it is
  queued. An event completes when its stream reaches it; a stream or the host can wait on it.
  With ``copies_on_demand`` (benchmarks) a stream runs its work only when something waits for
  it, so that simulated copies never take the cores the kernel runs on.
* **Compute streams**: the calling thread (the default stream), and user streams
  (:class:`UserStream`), ordered with the default one only through events.
* **Devices** (:class:`SimCuda`): a thread has a current device, a model of ``torch.cuda``'s
  device and stream contexts and of the primary contexts they create.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import queue
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from .hb import Clock, _Lane

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




class _Stream:
    def __init__(self, dev: Any, name: str, seed: int) -> None:
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
    lazy: list[Any]  # the simulated devices whose waits are lazy in this thread
    host_section: int
    stream_thread: bool
    user: dict[int, UserStream]  # id(device) -> the user stream entered
    side: dict[int, list[Any]]  # id(device) -> the side streams entered (torch.cuda.stream), innermost last
    current_device: int

    def __init__(self) -> None:
        self.pending = []
        self.lazy = []
        self.host_section = 0
        self.stream_thread = False
        self.user = {}
        self.side = {}
        self.current_device = 0


_local = _Local()




class SimCuda:
    """A model of ``torch.cuda``'s device and stream contexts for the runtime's ``on_device`` and
    ``on_stream``: a current device per thread (0 in a new thread), and the devices that have a
    primary context. ``device(i)`` sets ``i`` (its context created) and restores the previous
    device only if that one has a context already (``MaybeExchangeDevice``); leaving
    ``stream(s)`` sets the device that was current when it was entered (``_cuda_setStream``
    calls ``set_device``), creating its context."""

    def __init__(self, dev: Any) -> None:
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
        inside = _local.side.setdefault(id(self.dev), [])
        inside.append(s)  # allocations inside come from this stream's pool
        try:
            yield
        finally:
            inside.pop()
            self._set(entered, "leaving torch.cuda.stream: set_device of the stream current before")

    def register(self) -> None:
        """``cudaHostRegister`` runs in the current device's context."""
        if _local.current_device != self.dev.index:
            self._set(_local.current_device, "cudaHostRegister")


