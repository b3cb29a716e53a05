"""The happens-before checker of the simulated device (CUDA's stream-sanitizer algorithm).

Since the simulated compute runs on the host, it has always finished when the next copy is
queued: a copy that overwrites memory compute may still read would go unseen. So every stream
keeps a vector clock: compute operations are stamped with their stream's epoch (each operation
on device memory, reported by the device backend, records what it reads and writes, in the
backward too), copies with their stream's operation number; an event carries its stream's clock,
a stream or host wait merges it. A copy that writes memory whose last reader or writer on
another stream it is not ordered after, or reads memory whose last writer it is not ordered
after, is a violation naming both. An allocation is a write of the allocating stream (memory
handed out again keeps its previous owner's accesses): a copy into it from another stream must
follow an event of the allocating stream recorded after the allocation.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .simbackend import mem

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




SIDE_STREAMS = ("d2h", "h2d", "h2d_now")


def bump_version(t: Tensor) -> None:
    """``t``'s version counter + 1 (CUDA's ``copy_`` bumps it at launch; a foreach op under a
    dispatch mode does not)."""
    set_version = torch._C._autograd._unsafe_set_version_counter
    try:
        set_version((t,), (t._version + 1,))
    except TypeError:  # torch < 2.6 takes one tensor
        set_version(t, t._version + 1)  # type: ignore[arg-type]


class OrderChecker:
    """The access histories of device memory and host buffers, the host's clock, and the checks
    of copies, compute and reuse against them. ``hosts(ptr)`` tells a registered host buffer's
    label by its storage address (None: device memory); ``violations`` receives what breaks."""

    def __init__(self, violations: list[str], hosts: Callable[[int], str | None], counts: dict[str, int]) -> None:
        self.violations = violations
        self.hosts = hosts
        self.counts = counts
        self.lock = threading.RLock()
        self.host_vc: Clock = {}
        self._histories: dict[int, tuple[Any, _History]] = {}  # storage ptr -> (weak storage, history)
        self._inserts = 0
        self.block_history: Callable[[int], _History | None] = lambda ptr: None  # the allocator's, by address

    def history(self, t: Tensor, create: bool = True) -> _History | None:
        """The access history of ``t``'s memory (device memory, or a host buffer)."""
        try:
            st = mem(t).untyped_storage()
        except Exception:
            return None
        ptr = st.data_ptr()
        if not ptr:
            return None
        h = self.block_history(ptr)
        if h is not None:
            return h
        found = self._histories.get(ptr)
        if found is not None and found[0]() is st:
            return found[1]
        if not create:
            return None
        host = self.hosts(ptr)
        label = host if host is not None else f"device memory of {st.nbytes()} bytes"
        h = _History(label)
        self._histories[ptr] = (weakref.ref(st), h)
        self._inserts += 1
        if self._inserts > 2 * len(self._histories) + 1000:
            self._histories = {k: v for k, v in self._histories.items() if v[0]() is not None}
            self._inserts = 0
        return h

    def forget_host(self, ptr: int) -> None:
        with self.lock:
            self._histories.pop(ptr, None)

    def compute_access(self, lane: _Lane, t: Tensor, write: bool, what: str) -> None:
        with self.lock:
            m = mem(t)
            if m.device.type != "cpu":
                return
            try:
                ptr = m.untyped_storage().data_ptr()
            except Exception:
                return
            if self.hosts(ptr) is not None:
                return  # host memory: not the compute stream's
            h = self.history(m)
            if h is not None:
                lo, hi = _span(m)
                h.record(_Access(lane.name, lane.n, what, lo, hi, write))

    def stamp(self, lane: _Lane, func: Any, args: Any, kwargs: Any) -> list[Tensor]:
        """Records what the compute operation ``func`` reads and writes (its tensor arguments by
        its schema); returns the written ones."""
        reads, writes, _ = _plan(func)

        def arg(i: int, name: str) -> Any:
            return args[i] if i < len(args) else kwargs.get(name)

        what = func.name().removeprefix("aten::")
        for i, n in reads:
            for t in _tensors(arg(i, n)):
                self.compute_access(lane, t, False, what)
        written = [t for i, n in writes for t in _tensors(arg(i, n))]
        for t in written:
            self.compute_access(lane, t, True, what)
        return written

    def stamp_fresh(self, lane: _Lane, func: Any, out: Any) -> None:
        """The fresh results of ``func``: written by it."""
        fresh = _plan(func)[2]
        if fresh:
            outs = out if isinstance(out, (tuple, list)) else (out,)
            what = func.name().removeprefix("aten::")
            for i in fresh:
                if i < len(outs):
                    for t in _tensors(outs[i]):
                        self.compute_access(lane, t, True, what)

    def check_copy(self, lane: _Lane, n: int, t: Tensor, write: bool, what: str) -> None:
        """The copy ``what`` (operation ``n`` of ``lane``) reads or writes ``t``'s memory: it must
        be ordered after the memory's last write on other streams (and, writing, its reads:
        the allocation of its memory is one)."""
        h = self.history(t)
        if h is None:
            return
        vc = lane.vc
        lo, hi = _span(mem(t))
        for a in h.conflicts(lo, hi, write):
            if a.lane != lane.name and vc.get(a.lane, 0) < a.n:
                verb = "writes" if write else "reads"
                kind = "op" if a.lane in SIDE_STREAMS else "epoch"
                self.violations.append(
                    f"{what} (op {n} of {lane.name}) {verb} bytes {lo}-{hi} of {h.label}, last used by {a.what} "
                    f"({kind} {a.n} of {a.lane}), which {lane.name} has not waited for (it waited {a.lane} up to "
                    f"{vc.get(a.lane, 0)})"
                )
        h.record(_Access(lane.name, n, what, lo, hi, write))

    def host_knows(self, vc: Clock, compute_lanes: Callable[[str], bool]) -> None:
        """The host has seen an event of clock ``vc`` complete: what it submits later follows it."""
        with self.lock:
            for k, v in vc.items():
                if compute_lanes(k) and v > self.host_vc.get(k, 0):
                    self.counts["host_waits_on_compute"] += 1
                    break
            self.host_vc = _join(self.host_vc, vc)

    def check_reuse(self, h: _History, freed_on: str, lane: _Lane) -> None:
        """Memory freed on ``freed_on`` handed to an allocation of ``lane``: no other stream may
        still use it."""
        vc = _join(lane.clock(), self.host_vc)
        for a in h.accesses:
            if a.lane != lane.name and vc.get(a.lane, 0) < a.n:
                self.violations.append(
                    f"{h.label} freed on {freed_on} and reused by the next allocation there while {a.what} (op {a.n} of "
                    f"{a.lane}) may still use it: keep_until_done (record_stream) missing"
                )
