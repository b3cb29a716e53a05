"""The routed experts' bytes, with the expert as the unit: where a fused experts module's
parameters live while its weights are offloaded, and the cache that serves them from RAM.

A fused experts module (``experts.py``: transformers' ``gate_up_proj`` ``[E, 2I, H]``,
``down_proj`` ``[E, H, I]``, their biases) is stored as ``E`` **units**, one per expert: the
expert's slice of each fused parameter (a quantized one's inner tensors, sliced: ``qdata[e]``,
``scale[e]``, as issue 24 stored a quantized parameter's) one after the other, each on a
``TENSOR_ALIGN`` (256-byte) boundary. A unit is what one routed expert needs, whole: read in one
transfer, cached as one, copied to a device as one (the GPU cache of issue 34's point 4 is
another tier of the same units).

- ``storage="cpu"``: every unit in one host allocation (pinned where the host memory of the
  offload is: with a device), each at its own offset; nothing is read, every use is a hit.
- ``storage="nvme"``: every unit a range of its own file in its own run directory of the page
  store (``runtime/pages.py``), starting on a 4096-byte boundary, written with its own CRC-32C
  and read alone (``O_DIRECT``: the page cache stays flat), into a slot of the RAM cache.

The RAM cache (``storage="nvme"``) is a segmented LRU (SLRU, as Caffeine's main space): a unit
read enters a probation segment; a unit used again while cached moves to the protected segment
(at most 80% of the cache), whose least recently used unit falls back to probation; a miss evicts
the least recently used unit of probation first. A unit used once (a rare expert) so never
displaces the experts used again and again (the frequency prior), in O(1) a use. Its slots
are ``capacity`` units (what ``host_budget_gb`` leaves, ``experts.py``) plus ``READ_AHEAD``
slots that a call's misses are read into ahead of their compute (with no cache, a unit is
forgotten once computed: each use of an expert is then a read)."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..runtime.device import swap
from ..runtime.pages import ALIGN, IoStats, PageStore, aligned_empty
from ..runtime.pinned import PinnedArena, align_up
from .blocks import TENSOR_ALIGN, Part, wrapped

READ_AHEAD = 4  # slots a call's misses are read into ahead of their compute, beside the cache's
PROTECTED = 0.8  # the share of the cache the units used more than once may take


@dataclass
class ExpertParam:
    """One fused parameter of an experts module, as its units hold it: ``parts``, the expert's
    slice of it (the parameter's ``[e]``; a quantized one's inner tensors, sliced), at their
    offsets in the unit."""

    name: str  # the attribute on its module
    param: torch.nn.Parameter
    parts: list[Part]
    kind: type | None = None  # a wrapped parameter's type (its expert's, ``param[e]``)
    ctx: Any = None  # the flatten context of one expert's slice
    shape: tuple[int, ...] = ()  # one expert's shape and strides
    stride: tuple[int, ...] = ()
    full_attrs: list[str] = field(default_factory=list)  # the whole parameter's inner tensors (wrapped)
    full_ctx: Any = None

    def expert(self, e: int) -> list[Tensor]:
        """Expert ``e``'s tensors (its slice, or its slice's inner tensors), where they are now."""
        p = self.param
        if self.kind is None:
            return [p.detach()[e]]
        pe = p[e]
        return [getattr(pe, q.attr) for q in self.parts]  # type: ignore[arg-type]

    def weight(self, unit: Tensor) -> Tensor:
        """The expert's weight over ``unit``'s bytes: a plain tensor, or the parameter's type
        rebuilt over its inner tensors there (what ``param[e]`` is, bitwise)."""
        views = [q.view(unit) for q in self.parts]
        if self.kind is None:
            return views[0]
        inner = {q.attr: v for q, v in zip(self.parts, views)}
        out: Tensor = self.kind.__tensor_unflatten__(inner, self.ctx, torch.Size(self.shape), self.stride)  # type: ignore[attr-defined]
        return out

    def whole(self, units: list[Tensor]) -> torch.nn.Parameter:
        """The fused parameter again, from every expert's unit (``close()``): tensors of its own."""
        p = self.param
        stacked = [torch.stack([q.view(u) for u in units]) for q in self.parts]
        if self.kind is None:
            return torch.nn.Parameter(stacked[0], requires_grad=p.requires_grad)
        inner = dict(zip(self.full_attrs, stacked))
        full = type(p).__tensor_unflatten__(inner, self.full_ctx, torch.Size(self.shape_of_whole(len(units))), None)  # type: ignore[attr-defined]
        return torch.nn.Parameter(full, requires_grad=p.requires_grad)

    def shape_of_whole(self, experts: int) -> tuple[int, ...]:
        return (experts, *self.shape)


def expert_param(module_name: str, name: str, p: torch.nn.Parameter, experts: int) -> ExpertParam:
    """``p`` (a fused parameter ``[experts, ...]`` of an experts module) as its units hold it;
    a TypeError names it where one expert's slice cannot be stored alone."""
    full = f"{module_name}.{name}"
    if not wrapped(p):
        if not p.is_contiguous():
            raise TypeError(f"{full}: a fused experts parameter of strides {tuple(p.stride())} (not contiguous) cannot be stored per expert")
        return ExpertParam(name, p, [Part(None, p.dtype, tuple(p.shape[1:]))], shape=tuple(p.shape[1:]))
    flatten = getattr(p, "__tensor_flatten__", None)
    if flatten is None or not hasattr(type(p), "__tensor_unflatten__"):
        raise TypeError(f"{full}: a {type(p).__name__} cannot be stored per expert (it does not implement __tensor_flatten__)")
    full_attrs, full_ctx = flatten()
    try:
        pe = p[0]
    except Exception as err:  # noqa: BLE001 (any failure of the subclass's indexing: named)
        raise TypeError(f"{full}: a {type(p).__name__} whose experts cannot be sliced (p[0] raised {err!r})") from err
    attrs, ctx = pe.__tensor_flatten__()  # type: ignore[attr-defined]
    if list(attrs) != list(full_attrs):
        raise TypeError(f"{full}: one expert of a {type(p).__name__} flattens to {attrs}, the whole to {full_attrs}")
    parts = []
    for a in attrs:
        whole, one = getattr(p, a), getattr(pe, a)
        if tuple(whole.shape) != (experts, *one.shape) or not whole.is_contiguous() or wrapped(whole):
            raise TypeError(
                f"{full}: the inner tensor {a!r} of a {type(p).__name__} is {tuple(whole.shape)} (contiguous: "
                f"{whole.is_contiguous()}): not one slice per expert"
            )
        parts.append(Part(a, one.dtype, tuple(one.shape)))
    return ExpertParam(name, p, parts, type(pe), ctx, tuple(pe.shape), tuple(pe.stride()), list(full_attrs), full_ctx)


@dataclass
class ExpertsLayout:
    """One fused experts module: its parameters and the layout of its units."""

    index: int
    name: str
    module: torch.nn.Module
    experts: int
    params: list[ExpertParam]
    unit_bytes: int = 0

    def layout(self) -> None:
        off = 0
        for q in (q for ep in self.params for q in ep.parts):
            q.offset = off
            q.nbytes = q.numel * torch.empty((), dtype=q.dtype).element_size()
            off = align_up(off + q.nbytes, TENSOR_ALIGN)
        last = self.params[-1].parts[-1]
        self.unit_bytes = last.offset + last.nbytes

    @property
    def nbytes(self) -> int:
        return self.experts * self.unit_bytes

    def weights(self, unit: Tensor) -> dict[str, Tensor]:
        """One expert's weights over its unit's bytes, by parameter name."""
        return {ep.name: ep.weight(unit) for ep in self.params}


class _Slru:
    """The keys of the cached units and their slots, a segmented LRU (module documentation)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.protected_cap = int(capacity * PROTECTED)
        self.probation: OrderedDict[tuple[int, int], int] = OrderedDict()
        self.protected: OrderedDict[tuple[int, int], int] = OrderedDict()

    def __len__(self) -> int:
        return len(self.probation) + len(self.protected)

    def get(self, key: tuple[int, int]) -> int | None:
        return self.protected.get(key, self.probation.get(key))

    def used(self, key: tuple[int, int]) -> None:
        """``key``, cached, used again: into (or to the front of) the protected segment."""
        if key in self.protected:
            self.protected.move_to_end(key)
            return
        slot = self.probation.pop(key)
        self.protected[key] = slot
        while len(self.protected) > self.protected_cap:
            k, s = self.protected.popitem(last=False)
            self.probation[k] = s  # (the most recent of probation: it had been used twice)

    def add(self, key: tuple[int, int], slot: int) -> None:
        self.probation[key] = slot

    def victims(self) -> Iterator[tuple[tuple[int, int], int]]:
        """The cached units in the order they go: probation's least recent first."""
        yield from list(self.probation.items())
        yield from list(self.protected.items())

    def drop(self, key: tuple[int, int]) -> int:
        if key in self.probation:
            return self.probation.pop(key)
        return self.protected.pop(key)


class ExpertStore:
    """Every unit of the ``layouts`` (see the module documentation): in host memory
    (``nvme_dir`` None) or on the SSD with a RAM cache of ``capacity`` units."""

    FILE = "experts.bin"

    def __init__(self, layouts: list[ExpertsLayout], arena: PinnedArena, nvme_dir: Any, capacity: int, io: str | None = None) -> None:
        self.layouts = layouts
        self.arena = arena
        self.offset: dict[int, int] = {}  # layout index -> offset of its first unit (RAM or file)
        self.stride: dict[int, int] = {}  # bytes between a layout's units
        self.nvme = nvme_dir is not None
        align = ALIGN if self.nvme else TENSOR_ALIGN
        total = 0
        for lay in layouts:
            self.offset[lay.index] = total
            self.stride[lay.index] = align_up(lay.unit_bytes, align)
            total += lay.experts * self.stride[lay.index]
        self.total = total
        self.stats = IoStats()
        self.store: PageStore | None = None
        self.buf: Tensor | None = None
        self.slots: list[Tensor] = []
        self.capacity = capacity if self.nvme else 0
        self.cache = _Slru(self.capacity)
        self.held: dict[int, int] = {}  # slot -> uses in progress (never evicted meanwhile)
        self.reading: dict[int, Any] = {}  # slot -> its read in flight
        self.key_of: dict[int, tuple[int, int]] = {}  # slot -> the unit it holds
        self.free: list[int] = []
        self.fresh: set[tuple[int, int]] = set()  # units read and not yet used (their use is a miss)
        if self.nvme:
            self.store = PageStore(nvme_dir, io=io, stats=self.stats)
            try:
                self.file = self.store.open(self.FILE, total, "offload_weights' routed experts")
            except BaseException:
                self.store.close()
                raise
            self.slot_bytes = max(self.stride.values(), default=ALIGN)
        else:
            self.buf = arena.alloc(total, torch.uint8, pin=False)
            self.slot_bytes = 0
        self.reset_stats()

    # -- set-up and close -------------------------------------------------------------------------

    def _unit(self, lay: ExpertsLayout, e: int) -> int:
        return self.offset[lay.index] + e * self.stride[lay.index]

    def _what(self, lay: ExpertsLayout, e: int) -> str:
        return f"the unit of expert {e} of {lay.name}"

    def fill(self, lay: ExpertsLayout) -> None:
        """``lay``'s parameters' bytes into their units (written to the SSD, waited for)."""
        stride = self.stride[lay.index]
        if self.buf is not None:
            base = self.offset[lay.index]
            staged = self.buf[base : base + lay.experts * stride]
        else:
            staged = aligned_empty(lay.experts * stride, torch.uint8)
        for e in range(lay.experts):
            unit = staged[e * stride : (e + 1) * stride]
            for ep in lay.params:
                for q, t in zip(ep.parts, ep.expert(e)):
                    q.view(unit).copy_(t)
            if self.buf is None:
                unit[lay.unit_bytes :].zero_()
        if self.buf is None:
            writes = [
                self.file.write(self._unit(lay, e), staged[e * stride : (e + 1) * stride], self._what(lay, e)) for e in range(lay.experts)
            ]
            for w in writes:
                w.wait()

    def fill_from(self, lay: ExpertsLayout, read: Callable[[int, Tensor], None]) -> None:
        """``lay``'s units filled by ``read(e, unit)`` (a checkpoint's reader: ``checkpoint.py``),
        one expert at a time: into its place in RAM, or into one unit's buffer written to the SSD
        (waited for) before the next is read: never more than one unit is staged, so a model
        larger than RAM is stored from its checkpoint."""
        stride = self.stride[lay.index]
        if self.buf is not None:
            for e in range(lay.experts):
                o = self._unit(lay, e)
                read(e, self.buf[o : o + lay.unit_bytes])
            return
        unit = aligned_empty(stride, torch.uint8)
        unit[lay.unit_bytes :].zero_()
        for e in range(lay.experts):
            read(e, unit[: lay.unit_bytes])
            self.file.write(self._unit(lay, e), unit, self._what(lay, e)).wait()

    def pin(self) -> None:
        """Every unit filled: the RAM copy pinned (copies from it are asynchronous); the cache's
        slots made."""
        if self.buf is not None:
            self.arena.pin(self.buf)
        else:
            n = self.capacity + READ_AHEAD
            self.slots = [self.arena.alloc(self.slot_bytes, torch.uint8, align=ALIGN) for _ in range(n)]
            self.free = list(range(n))

    def read(self, lay: ExpertsLayout, e: int) -> Tensor:
        """Unit ``e`` of ``lay``, read now into a tensor of its own (``close()``)."""
        if self.buf is not None:
            o = self._unit(lay, e)
            return self.buf[o : o + lay.unit_bytes]
        out = aligned_empty(self.stride[lay.index], torch.uint8)
        self.file.read(self._unit(lay, e), out, self._what(lay, e)).wait()
        return out[: lay.unit_bytes]

    def restore(self, lay: ExpertsLayout, params: list[ExpertParam] | None = None) -> None:
        """``lay``'s parameters (``params``: those; the same objects) back over tensors of their
        own, read from the units (an ``OSError`` if one cannot be read: nothing is changed then)."""
        units = [self.read(lay, e) for e in range(lay.experts)]
        news = [(ep, ep.whole(units)) for ep in (lay.params if params is None else params)]
        for ep, new in news:
            swap(ep.param, new)

    @property
    def ram_bytes(self) -> int:
        """Host bytes: every unit (``storage="cpu"``), or the cache's slots."""
        if self.buf is not None:
            return self.total
        return len(self.slots) * self.slot_bytes

    @property
    def nvme_bytes(self) -> int:
        return self.total if self.nvme else 0

    def page_cache_bytes(self) -> int:
        return self.store.page_cache_bytes() if self.store is not None else 0

    def close(self) -> None:
        for t in list(self.reading.values()):
            try:
                t.wait()
            except OSError:
                pass
        self.reading.clear()
        self.slots = []
        self.buf = None
        if self.store is not None:
            self.store.close()
            self.store = None

    # -- run time -------------------------------------------------------------------------------

    def reset_stats(self) -> None:
        self.stats.reset()
        self.hits = 0
        self.misses = 0

    def units(self, lay: ExpertsLayout, experts: list[int]) -> Generator[tuple[int, Tensor], None, None]:
        """Each of ``experts`` (of ``lay``) with its unit's bytes, in their order, each valid
        until the next is asked for: from RAM, the cache, or read (the misses a few ahead)."""
        if self.buf is not None:
            for e in experts:
                self.hits += 1
                o = self._unit(lay, e)
                yield e, self.buf[o : o + lay.unit_bytes]
            return
        keys = [(lay.index, e) for e in experts]
        try:
            for i, key in enumerate(keys):
                for ahead in keys[i + 1 : i + READ_AHEAD]:
                    if self.cache.get(ahead) is None and not self._start(lay, ahead):
                        break
                slot = self.cache.get(key)
                if slot is None:
                    slot = self._start(lay, key)
                    assert slot is not None, "a slot is always free for the unit computed now"
                if key in self.fresh:  # read for this use (now or ahead): a miss
                    self.fresh.discard(key)
                    self.misses += 1
                    self._wait(slot)
                else:
                    self.hits += 1
                    self.cache.used(key)
                self.held[slot] = self.held.get(slot, 0) + 1
                try:
                    yield key[1], self.slots[slot][: lay.unit_bytes]
                finally:
                    self.held[slot] -= 1
                    if not self.held[slot]:
                        del self.held[slot]
        finally:
            self._trim()

    def _start(self, lay: ExpertsLayout, key: tuple[int, int]) -> int | None:
        """Starts reading unit ``key`` into a slot (its slot), or None if none can be taken now."""
        slot = self._take()
        if slot is None:
            return None
        self.key_of[slot] = key
        self.cache.add(key, slot)
        self.fresh.add(key)
        e = key[1]
        self.reading[slot] = self.file.read(self._unit(lay, e), self.slots[slot][: self.stride[lay.index]], self._what(lay, e))
        return slot

    def _wait(self, slot: int) -> None:
        t = self.reading.pop(slot, None)
        if t is None:
            return
        try:
            t.wait()
        except BaseException:
            self._forget(slot)
            self.free.append(slot)
            raise

    def _forget(self, slot: int) -> None:
        key = self.key_of.pop(slot)
        self.cache.drop(key)
        self.fresh.discard(key)

    def _take(self) -> int | None:
        """A free slot, else the cache's first victim not in use (its unit forgotten)."""
        if self.free:
            return self.free.pop()
        for key, slot in self.cache.victims():
            if slot in self.held or slot in self.reading:
                continue
            self._forget(slot)
            return slot
        return None

    def _trim(self) -> None:
        """The cache back to its capacity once a call is done: the victims forgotten."""
        for key, slot in self.cache.victims():
            if len(self.cache) <= self.capacity:
                break
            if slot in self.held or slot in self.reading:
                continue
            self._forget(slot)
            self.free.append(slot)
