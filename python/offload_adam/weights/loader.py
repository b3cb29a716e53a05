"""The per-block loader (vLLM's ``_ModuleOffloader``): a block's bytes copied from its source into
a ring slot, and its parameters pointed at that copy or at their placeholders.

A copy is queued on a side stream of the device (``h2d`` for a prefetch, ``h2d_now`` for a block
needed at once), after the slot's last use and its last copy, once the block's host copies are
not being written (an optimizer's step holds their fence); the source is told which event ends
the copy (a staging slot is reused after it). The compute stream waits for a copy with a stream
wait, never a host wait. Both are timed by events (``h2d_s``, ``stall_s``), folded as they
complete.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ..runtime.device import Device, Meter
from ..runtime.hosted import Home
from .blocks import Block
from .ring import Slot
from .storage import Sources


def placeholders(device: Device, blocks: Sequence[Block], meter: Meter) -> dict[int, list[list[Tensor]]]:
    """What each parameter of ``blocks`` (each of its parts) points to outside its block's
    forward: one NaN of its dtype on the device (a zero for integers), expanded to its shape (no
    memory of its own)."""
    one: dict[torch.dtype, Tensor] = {}
    out: dict[int, list[list[Tensor]]] = {}
    for b in blocks:
        ph = []
        for e in b.entries:
            parts = []
            for q in e.parts:
                if q.dtype not in one:
                    fill = float("nan") if q.dtype.is_floating_point else 0
                    one[q.dtype] = device.empty(1, q.dtype, meter).fill_(fill).view(())
                parts.append(one[q.dtype].expand(q.shape))
            ph.append(parts)
        out[b.index] = ph
    return out


class Loader:
    """Loads blocks of ``blocks`` from their ``sources`` into ring slots (see the module documentation)."""

    def __init__(
        self,
        device: Device,
        blocks: list[Block],
        sources: Sources,
        placeholders: dict[int, list[list[Tensor]]],
        homes: dict[int, list[Home]],
    ) -> None:
        self.device = device
        self.blocks = blocks
        self.sources = sources
        self.placeholders = placeholders
        self.homes = homes
        self.reset_stats()

    def versions(self, b: int) -> tuple[int, ...]:
        """The versions of ``b``'s host copies (an optimizer's step bumps them)."""
        return tuple(h.version for h in self.homes.get(b, ()))

    def views(self, slot: Slot, b: int) -> list[list[Tensor]]:
        """Block ``b``'s parameters (each as its parts) as views of ``slot``."""
        v = slot.views.get(b)
        if v is None:
            v = slot.views[b] = [e.views(slot.buf) for e in self.blocks[b].entries]
        return v

    def point(self, b: int, slot: Slot | None) -> None:
        """Block ``b``'s parameters := views of ``slot`` (None: their placeholders)."""
        views = self.placeholders[b] if slot is None else self.views(slot, b)
        for e, v in zip(self.blocks[b].entries, views):
            e.bind(v)

    def point_host(self, b: int, host: Tensor) -> None:
        """Block ``b``'s parameters := views of its host bytes ``host`` (it runs on the CPU)."""
        for e in self.blocks[b].entries:
            e.bind(e.views(host))

    def copy(self, b: int, slot: Slot, now: bool) -> Any:
        """Queues the copy of block ``b`` into ``slot``; returns its completion event. Raises
        (nothing queued) if the source cannot deliver its bytes (an I/O error, a bad CRC)."""
        dev = self.device
        stream = dev.h2d_now if now else dev.h2d
        blk = self.blocks[b]
        for h in self.homes.get(b, ()):
            h.ready.wait()
        src = self.sources.of(blk)
        host = src.host(blk)
        dev.stream_waits(stream, slot.free_event)
        dev.stream_waits(stream, slot.copy_event)  # (a copy of a block dropped, maybe on the other stream)
        e0 = dev.record(stream, timing=True)
        with torch.profiler.record_function("offload_adam.weights_h2d"):
            dev.copy([(slot.buf[: blk.nbytes], host[: blk.nbytes])], stream)
        e1 = dev.record(stream, timing=True)
        slot.copy_event = e1
        src.done(blk, e1)
        self._copies.append((e0, e1))
        self.stats["h2d_bytes"] += blk.nbytes
        self.stats["loads"] += 1
        slot.block = b
        return e1

    def count(self, what: str) -> None:
        """One more of ``what`` in ``stats`` (``on_demand`` loads, ``passes``)."""
        self.stats[what] += 1

    def wait(self, event: Any) -> None:
        """The compute stream waits for ``event`` (a stream wait), timed."""
        dev = self.device
        e0 = dev.record_current(timing=True)
        dev.current_waits(event)
        self._stalls.append((e0, dev.record_current(timing=True)))

    # -- timings --------------------------------------------------------------------------------

    def reset_stats(self) -> None:
        self.stats = {"h2d_bytes": 0, "loads": 0, "on_demand": 0, "passes": 0}
        self._copies: list[tuple[Any, Any]] = []  # (start, end) of copies not yet counted
        self._stalls: list[tuple[Any, Any]] = []  # compute stream before and after a wait
        self._h2d_s = self._stall_s = 0.0

    def fold(self) -> None:
        """Counts the timings that have completed (and drops their events)."""
        dev = self.device
        for pairs, attr in ((self._copies, "_h2d_s"), (self._stalls, "_stall_s")):
            keep = []
            total = getattr(self, attr)
            for a, b in pairs:
                t = dev.elapsed(a, b)
                if t is None:
                    keep.append((a, b))
                else:
                    total += t
            pairs[:] = keep
            setattr(self, attr, total)

    def timings(self) -> tuple[float, float]:
        """(seconds the copies took, seconds compute waited for them) since the last reset;
        waits for the copies in flight."""
        dev = self.device
        for _, e in self._copies:  # (on two streams: the last queued is not the last to run)
            dev.host_wait(e)
        t0 = time.perf_counter()
        self.fold()
        while (self._copies or self._stalls) and time.perf_counter() - t0 < 10:
            time.sleep(0.001)
            self.fold()
        return self._h2d_s, self._stall_s
