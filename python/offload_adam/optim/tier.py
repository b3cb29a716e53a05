"""The tier: where a param group's optimizer state lives between steps.

The engine brackets every access to a bucket's state with ``make_resident`` and ``release``, so
a tier that keeps the state elsewhere pages it in and out without the engine changing.
:class:`HostTier` keeps it in host memory. :class:`NvmeTier` keeps it on an SSD through the
runtime's :class:`~offload_adam.runtime.pager.Pager`: each group is a family of the pager (the
buffers the group declares, ``GroupState.paged_buffers``), each bucket of the group one page, so
the state of bucket k+1 is read while the kernel steps bucket k and bucket k-1 is written back.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Protocol

import torch
from torch import Tensor

from ..runtime.pager import Family, Pager
from ..runtime.pages import PageStore, aligned_empty
from .state import SLOT_ALIGN, GroupState

PAGE_ALIGN = 2048  # elements: each bucket's state starts on 4096 bytes of a 2-byte state, 8192 of a 4-byte one


def _no_copies() -> None:
    pass


class Tier(Protocol):
    """Where a group's state lives between steps (see the module documentation).

    The engine calls ``make_resident(group, slots)`` before it reads or writes those slots'
    state (moments, amsgrad maximum, masters) and ``release(group, slots, copies_done, wrote)``
    after (``wrote`` False: the state was only read, a checkpoint).
    Copies back to the device may still be reading the masters (and bf16/fp16 landing slots)
    when ``release`` is called: a tier calls ``copies_done()`` (a host wait) before it reuses
    that memory."""

    stable_views: bool  # whether the views of state[p] stay valid between steps
    page_align: int  # elements: where each bucket's state starts in the buffers
    batch_bytes: int  # gradient bytes of offloaded buckets stepped in one native call
    state_alloc: Callable[[int, torch.dtype], Tensor] | None  # allocates the state buffers

    @property
    def stats(self) -> Mapping[str, float]:
        """Running I/O counters: bytes read and written, seconds waited for the disk."""
        ...

    def attach(self, group: GroupState) -> None: ...

    def chunks(self, group: GroupState) -> list[range] | None:
        """The slots of a CPU group's native calls, in order (None: one call for all)."""
        ...

    def end_step(self) -> None:
        """After every bucket of a step (writes back, raises a deferred I/O error)."""
        ...

    def memory(self) -> dict[str, int]: ...

    def close(self) -> None: ...

    def make_resident(self, group: GroupState, slots: Sequence[int]) -> None: ...

    def release(
        self, group: GroupState, slots: Sequence[int], copies_done: Callable[[], None] = _no_copies, wrote: bool = True
    ) -> None: ...


class HostTier:
    """State in host memory: always resident, nothing to page."""

    stable_views = True
    page_align = SLOT_ALIGN
    batch_bytes = 256 << 20
    state_alloc: Callable[[int, torch.dtype], Tensor] | None = None
    stats: Mapping[str, float] = MappingProxyType({})  # no I/O

    def chunks(self, group: GroupState) -> list[range] | None:
        return None

    def end_step(self) -> None:
        pass

    def memory(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        pass

    def attach(self, group: GroupState) -> None:
        pass

    def make_resident(self, group: GroupState, slots: Sequence[int]) -> None:
        pass

    def release(
        self, group: GroupState, slots: Sequence[int], copies_done: Callable[[], None] = _no_copies, wrote: bool = True
    ) -> None:
        pass


class NvmeTier:
    """State on NVMe, paged bucket by bucket through a window of host memory (see the module
    documentation and ``runtime/pager.py``)."""

    stable_views = False
    page_align = PAGE_ALIGN
    batch_bytes = 0  # one bucket per native call: the window holds a few buckets, not a batch

    def __init__(
        self,
        nvme_dir: str,
        *,
        host_budget_bytes: int = 0,
        read_ahead: int = 2,
        write_behind: int = 2,
        io: str | None = None,
    ) -> None:
        if read_ahead < 0 or write_behind < 1:
            raise ValueError(f"read_ahead must be >= 0 and write_behind >= 1, got {read_ahead}, {write_behind}")
        self.store = PageStore(nvme_dir, io=io)
        self.pager = Pager(
            self.store, host_budget_bytes=host_budget_bytes, read_ahead=read_ahead, write_behind=write_behind,
            corrupt_hint="; restore the optimizer from a checkpoint",
        )  # fmt: skip
        self.state_alloc: Callable[[int, torch.dtype], Tensor] | None = aligned_empty
        self.families: dict[int, dict[str, Family]] = {}  # id(group) -> the family of each buffer key
        self.page_of: dict[int, list[list[int]]] = {}  # id(group) -> pages of each slot (one per family)

    @property
    def path(self) -> str:
        return self.store.path

    @property
    def stats(self) -> Mapping[str, float]:
        return self.pager.stats

    def attach(self, group: GroupState) -> None:
        """One family per layout of the group's paged buffers (``GroupState.paged_layouts``),
        each bucket a page of each, added bucket by bucket so that read-ahead follows the step.
        On error (a file that cannot be allocated) nothing is added: the files made are removed."""
        mark = self.pager.mark()
        try:
            self._attach(group)
        except BaseException:
            self.pager.rollback(mark)
            raise

    def _attach(self, group: GroupState) -> None:
        fams: dict[str, Family] = {}
        layouts = []
        bufs = group.paged_buffers()
        for j, (total, offsets, keys) in enumerate(group.paged_layouts()):
            fam = self.pager.family(f"group{len(self.families)}" + (f"-{j}" if j else ""), total)
            for key in keys:
                fams[key] = fam
                if key in bufs:
                    self.pager.add_buffer(fam, key, bufs[key])
            layouts.append((fam, total, offsets))
        by_bucket = []
        for k, rng in enumerate(group.buckets):
            first, last = group.names[rng.start], group.names[rng.stop - 1]
            label = f"the state of bucket {k} ({first}" + (f" .. {last})" if last != first else ")")
            pages = []
            for fam, total, offsets in layouts:
                end = offsets[group.buckets[k + 1].start] if k + 1 < len(group.buckets) else total
                pages += self.pager.add_pages(fam, [(offsets[rng.start], end, label)], "the optimizer state")
            by_bucket.append(pages)
        self.families[id(group)] = fams
        self.page_of[id(group)] = [by_bucket[k] for k, rng in enumerate(group.buckets) for _ in rng]

    def _pages(self, group: GroupState, slots: Sequence[int]) -> list[int]:
        fams = self.families[id(group)]
        for key, buf in group.paged_buffers().items():
            if key not in fams[key].buffers:  # created since (amsgrad switched on): zeros until written
                self.pager.add_buffer(fams[key], key, buf)
        of = self.page_of[id(group)]
        return sorted({pg for i in slots for pg in of[i]})

    def make_resident(self, group: GroupState, slots: Sequence[int]) -> None:
        self.pager.make_resident(self._pages(group, slots))

    def release(
        self, group: GroupState, slots: Sequence[int], copies_done: Callable[[], None] = _no_copies, wrote: bool = True
    ) -> None:
        self.pager.release(self._pages(group, slots), copies_done, wrote)

    def end_step(self) -> None:
        self.pager.end_step()

    def chunks(self, group: GroupState) -> list[range] | None:
        return list(group.buckets)

    def memory(self) -> dict[str, int]:
        return self.pager.memory()

    def bytes_per_step(self) -> int:
        """Bytes read and written per step: each paged page once in, once out."""
        return 2 * self.memory()["nvme_bytes"]

    def close(self) -> None:
        self.pager.close()
        self.store.close()
