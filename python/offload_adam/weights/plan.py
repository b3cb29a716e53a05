"""The plan of a weights offload: where every block lives and where it runs, decided before
anything is built (accelerate's ``infer_auto_device_map``, whose ``device_map`` a user prints,
edits and hands to ``dispatch_model``, which only builds).

A :class:`WeightPlan` lists the blocks (:class:`BlockPlan`: name, bytes, where it lives, where it
may run) and what follows from them: the device ring of slots the streamed blocks are copied
into, the RAM ring NVMe pages are read ahead into, and the bytes of each tier. It is pure: made
from the blocks' sizes and structure, the budgets and the placement, with no device and no
tensor (``tools/plan.py`` plans a model it only imagines with it). ``offload_weights`` builds
what its plan says; ``plan_weights`` returns the plan without building (``offload.py``).

Where a block lives (``home``):

- ``"device"``: resident on the device for the whole offload (a GPU only);
- ``"ram"``: in host memory: streamed to the device from the pinned copy, or, with the CPU as
  the device, run from there;
- ``"nvme"``: a page of a file on the SSD, read ahead into the RAM ring (``storage="nvme"``).

Where a block not resident on the device runs (``runs``): ``"device"`` (copied into the ring),
``"cpu"`` (from its host bytes: ``placement="cpu"``, an embedding looked up on the host, the CPU
as the device) or ``"per call"`` (``placement="auto"``). Training streams every block.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..runtime.pages import ALIGN
from ..runtime.pinned import align_up
from .blocks import TENSOR_ALIGN, Block

GiB = 1 << 30
EXPERT_READ_AHEAD = 4  # (expertstore.READ_AHEAD: the RAM cache's slots beside its capacity)
HOMES = ("device", "ram", "nvme")
DEFAULT_PREFETCH = 2  # offload_weights' default: capped without a word when fewer blocks stream


@dataclass
class BlockPlan:
    """One block of the plan. ``home`` may be edited; the rest describes the block."""

    index: int
    name: str
    nbytes: int  # its bytes as stored and streamed (quantized bytes where quantized)
    home: str = "ram"  # "device", "ram" or "nvme" (see the module documentation)
    layer: bool = False  # a layer of a ModuleList of repeated layers
    own_slot: bool = False  # needs a slot of its own in the ring (tied; or runs other blocks)
    lookup: bool = False  # an embedding: its rows are looked up on the host (inference)
    by_rows: bool = False  # a lookup whose rows can be read alone from the SSD (rows.readable)
    quantized: bool = False  # holds quantized parameters (tensor subclasses)
    off_device: str = "device"  # where it runs when not resident: "device", "cpu" or "per call"

    @property
    def runs(self) -> str:
        """Where it may run: ``"device"``, ``"cpu"`` or ``"per call"``."""
        return "device" if self.home == "device" else self.off_device


@dataclass(frozen=True)
class RingPlan:
    """The device ring for the streamed blocks (``ring.py`` allocates it): ``general`` slots of
    ``slot_bytes`` each, a slot of its own made at once for each of ``made`` and at its first
    copy for each of ``later``."""

    slot_bytes: int = 0
    general: int = 0
    made: frozenset[int] = frozenset()
    later: frozenset[int] = frozenset()
    on_demand: bool = False  # no general slot planned: each is made when first needed


def staging_slots(prefetch: int, blocks: int, on_device: bool) -> int:
    """Slots of the RAM ring NVMe pages are read into: a page being copied to the device (or run
    by the CPU) and ``prefetch`` read ahead, and never more than the ``blocks`` it serves (on a
    device, one more: a block's page still being copied while it is read again for the next pass)."""
    return max(1, min(prefetch + (2 if on_device else 1), blocks + (1 if on_device else 0)))


def own_slot_blocks(blocks: Sequence[Block]) -> set[int]:
    """Blocks that need a slot of their own: run by several modules (tied parameters), or
    holding parameters of a module that runs other blocks (they stay needed meanwhile)."""
    triggers = {id(m): b.index for b in blocks for m in b.modules}
    own = set()
    for b in blocks:
        if b.shared:
            own.add(b.index)
            continue
        if not b.layer:
            for m in b.modules:
                if any(id(c) in triggers and triggers[id(c)] != b.index for c in m.modules()):
                    own.add(b.index)
    return own


def host_only_blocks(blocks: Sequence[Block]) -> set[int]:
    """Blocks that are embeddings only: looked up on the host, never copied to the device."""
    return {b.index for b in blocks if b.modules and all(isinstance(m, torch.nn.Embedding) for m in b.modules)}


def describe(blocks: Sequence[Block]) -> list[BlockPlan]:
    """The blocks found in a model (``blocks.py``) as the plan sees them (every home ``"ram"``)."""
    from .rows import readable

    own, lookup = own_slot_blocks(blocks), host_only_blocks(blocks)
    return [
        BlockPlan(b.index, b.name, b.nbytes, layer=b.layer, own_slot=b.index in own, lookup=b.index in lookup,
                  quantized=any(e.wrapped for e in b.entries), by_rows=b.index in lookup and readable(b))
        for b in blocks
    ]  # fmt: skip


def ring_plan(blocks: Sequence[BlockPlan], streamed: Sequence[int], prefetch: int, general: bool = True) -> RingPlan:
    """The ring for ``streamed`` blocks. General slots are sized by the largest layer they serve;
    a block that is not a layer and is larger (a head, a large embedding) gets a slot of its own,
    made when it is first copied: an embedding looked up on the host takes one only if training
    copies it, and otherwise shares the general slots, which it then never takes for inference.
    ``general``: False when no call is expected to stream (placement ``"cpu"``): every slot is
    made on demand."""
    skip = {b for b in streamed if blocks[b].lookup}
    own = {b for b in streamed if blocks[b].own_slot}
    later = {b for b in own if b in skip}  # looked up on the host: a slot only if training copies it
    own -= later
    rest = [b for b in streamed if b not in own and b not in later]
    layers = [blocks[b].nbytes for b in rest if blocks[b].layer]
    size = max(layers) if layers else max((blocks[b].nbytes for b in rest), default=0)
    later |= {b for b in rest if blocks[b].nbytes > size}
    if not general:
        return RingPlan(size, 0, frozenset(), frozenset(later | own), on_demand=True)
    return RingPlan(size, min(prefetch + 1, len(rest) - len(later & set(rest))), frozenset(own), frozenset(later))


def ring_bytes(blocks: Sequence[BlockPlan], streamed: Sequence[int], prefetch: int, general: bool = True) -> int:
    """Device bytes of the ring for ``streamed`` blocks, every slot made (the slots of blocks
    looked up on the host are never made)."""
    r = ring_plan(blocks, streamed, prefetch, general)
    return r.general * r.slot_bytes + sum(blocks[b].nbytes for b in r.made | r.later if not blocks[b].lookup)


def page_bytes(blocks: Sequence[BlockPlan], which: Sequence[int]) -> int:
    """Bytes of a page of the RAM ring: the largest of ``which``, aligned."""
    return max((align_up(blocks[i].nbytes, ALIGN) for i in which), default=0)


@dataclass(frozen=True)
class HostRingPlan:
    """The RAM ring NVMe pages are read into: ``slots`` general pages of ``page`` bytes, a page of
    its own (``own``: block -> bytes) for each block larger than the general pages, and no page
    for the blocks whose rows are read instead (``rows``: embeddings looked up on the host)."""

    slots: int = 0
    page: int = 0
    own: tuple[tuple[int, int], ...] = ()
    rows: frozenset[int] = frozenset()

    @property
    def nbytes(self) -> int:
        return self.slots * self.page + sum(n for _, n in self.own)


def host_ring_plan(blocks: Sequence[BlockPlan], nvme: Sequence[int], prefetch: int, on_device: bool) -> HostRingPlan:
    """The RAM ring for the blocks ``nvme`` on the SSD. With a device, ``staging_slots`` pages of
    the largest block (each copied on from its page). With the CPU as the device the pages are
    sized by the largest layer: ``prefetch + 1`` of them (one run, ``prefetch`` read ahead),
    each block larger than that and no layer (a head, tied or not) gets a page of its own, kept
    between its runs, and an embedding whose rows can be read alone (``by_rows``) none: only the
    pages of the rows a call looks up are read (``rows.py``)."""
    if not nvme:
        return HostRingPlan()
    if on_device:
        return HostRingPlan(staging_slots(prefetch, len(nvme), True), page_bytes(blocks, nvme))
    rows = frozenset(i for i in nvme if blocks[i].by_rows)
    rest = [i for i in nvme if i not in rows]
    layers = [blocks[i].nbytes for i in rest if blocks[i].layer]
    size = max(layers) if layers else max((blocks[i].nbytes for i in rest), default=0)
    own = tuple((i, align_up(blocks[i].nbytes, ALIGN)) for i in rest if blocks[i].nbytes > size)
    general = [i for i in rest if blocks[i].nbytes <= size]
    slots = staging_slots(prefetch, len(general), False) if general else 0
    return HostRingPlan(slots, align_up(size, ALIGN) if general else 0, own, rows)


def choose_resident(
    blocks: Sequence[BlockPlan], budget: int | None, prefetch: int, buffers: int,
    ring: Callable[[list[int]], int] | None = None, what: str = "gpu_budget_gb", among: Sequence[int] | None = None,
    last: Sequence[int] = (),
) -> set[int]:  # fmt: skip
    """The blocks kept within ``budget`` bytes (None: none), after the ring: small blocks first
    (not layers, by size), then layers in order, then ``last`` (blocks whose streaming costs
    little: an embedding of which only the rows looked up are read). Raises if the ring alone
    (with the buffers, always resident) does not fit. ``ring``: the ring's bytes for the blocks
    left streamed (default: the device's); ``what`` names the budget in the error; ``among``:
    the blocks that may be kept (default: all)."""
    every = [b.index for b in blocks] if among is None else list(among)
    if budget is None:
        return set()
    at_end = set(last)
    ring_of = ring or (lambda streamed: ring_bytes(blocks, streamed, prefetch))

    def cost(res: set[int]) -> int:
        streamed = [i for i in every if i not in res]
        return buffers + sum(blocks[i].nbytes for i in res) + ring_of(streamed)

    if cost(set()) > budget:
        raise ValueError(
            f"{what}: {budget / GiB:.4g} GiB is smaller than the streaming ring with prefetch={prefetch} "
            f"({cost(set()) / GiB:.4g} GiB, buffers included)"
        )
    order = sorted((i for i in every if not blocks[i].layer and i not in at_end), key=lambda i: blocks[i].nbytes)
    order += [i for i in every if blocks[i].layer and i not in at_end] + [i for i in every if i in at_end]
    res: set[int] = set()
    for i in order:
        if cost(res | {i}) <= budget:
            res.add(i)
    return res


@dataclass(frozen=True)
class ExpertsPlan:
    """The routed experts' store (``expertstore.py``; not editable): ``units`` experts of
    ``modules`` fused experts modules, ``nbytes`` of weights, stored in ``home`` (``"ram"``: every
    unit in one host allocation of ``ram_bytes``; ``"nvme"``: each unit its own 4 KiB range,
    ``nvme_bytes`` in all, read into a RAM cache of ``cache_units`` units, ``ram_bytes`` with its
    read-ahead slots), and a device cache of ``gpu_units`` units (``gpu_bytes``). The names are
    ``report()``'s (``expert_units``, ``expert_bytes``...)."""

    modules: int
    units: int
    nbytes: int  # the units' bytes (each expert's slices, packed)
    unit_bytes: int  # the largest unit, as stored (aligned to the SSD's 4 KiB with nvme)
    home: str  # "ram" or "nvme"
    ram_bytes: int
    cache_units: int
    nvme_bytes: int
    gpu_units: int = 0
    gpu_bytes: int = 0

    def line(self) -> str:
        mib = 2**20
        where = (
            f"on the SSD {self.nvme_bytes / mib:.2f} MiB, RAM cache {self.cache_units} units ({self.ram_bytes / mib:.2f} MiB with its read-ahead)"
            if self.home == "nvme" else f"in RAM {self.ram_bytes / mib:.2f} MiB"
        )  # fmt: skip
        gpu = f", device cache {self.gpu_units} units ({self.gpu_bytes / mib:.2f} MiB)" if self.gpu_units else ""
        return f"routed experts: {self.modules} modules, {self.units} experts of {self.nbytes / mib:.2f} MiB {where}{gpu}"


def experts_plan(p: WeightPlan, layouts: Sequence[tuple[int, int]]) -> ExpertsPlan | None:
    """The expert store of ``layouts`` (each module's experts and packed unit bytes) under the
    plan ``p`` (its blocks' homes set): with NVMe, a RAM cache of what ``host_budget`` leaves after
    the plan's RAM tier and the read-ahead slots, in units of the largest; on a device with
    ``gpu_budget``, a device cache of what its device tier leaves (``offload.py`` builds these)."""
    if not layouts:
        return None
    units = sum(e for e, _ in layouts)
    nbytes = sum(e * u for e, u in layouts)
    nvme = p.storage == "nvme"
    if nvme:
        unit = max(align_up(u, ALIGN) for _, u in layouts)
        cache = 0
        if p.host_budget is not None:
            left = p.host_budget - p.tier_bytes()["ram"] - EXPERT_READ_AHEAD * unit
            cache = min(max(0, left // unit), units)
        ram = (cache + EXPERT_READ_AHEAD) * unit
        stored = sum(e * align_up(u, ALIGN) for e, u in layouts)
    else:
        unit = max(align_up(u, TENSOR_ALIGN) for _, u in layouts)
        cache, stored = 0, 0
        ram = sum(e * align_up(u, TENSOR_ALIGN) for e, u in layouts)
    gpu_units = 0
    gpu_unit = max(align_up(u, TENSOR_ALIGN) for _, u in layouts)
    if p.on_device and p.gpu_budget is not None:
        gpu_units = min(max(0, (p.gpu_budget - p.tier_bytes()["device"]) // gpu_unit), units)
    return ExpertsPlan(len(layouts), units, nbytes, unit, "nvme" if nvme else "ram", ram, cache, stored, gpu_units, gpu_units * gpu_unit)


@dataclass
class WeightPlan:
    """Where every block of a weights offload lives and runs (see the module documentation), as
    :func:`~offload_adam.plan_weights` returns it. ``blocks`` may be edited (a block's ``home``);
    :meth:`check` says whether the plan still fits its budgets, and
    ``offload_weights(model, plan=plan)`` builds exactly it. ``str(plan)`` is a table.

    Args:
        blocks: the blocks, each a :class:`BlockPlan`, in the model's order (``blocks[i].index == i``).
        device: ``"cpu"`` (the CPU runs the model) or the device's name, as ``"cuda:0"``.
        storage: where the streamed blocks live, ``"cpu"`` or ``"nvme"``.
        placement: ``"stream"``, ``"cpu"`` or ``"auto"`` (see ``offload_weights``).
        prefetch: the prefetch asked (``ahead``: the one used).
        gpu_budget: the device's budget in bytes (default: None, none).
        host_budget: the RAM budget in bytes, with ``storage="nvme"`` (default: None, none).
        buffer_bytes: the buffers' and the ``resident=`` parameters' bytes (default: 0).
        on_device: False when the CPU runs the model, without a device (default: True).
        args: the ``offload_weights`` arguments the plan was made with (default: empty).
        experts: the routed experts' store, an :class:`ExpertsPlan` (default: None, none).
    """

    blocks: list[BlockPlan]
    device: str  # "cpu" (the CPU runs the model) or the device's name ("cuda:0")
    storage: str  # "cpu" or "nvme": where streamed blocks live
    placement: str  # "stream", "cpu" or "auto"
    prefetch: int  # as asked (see :attr:`ahead` for what is used)
    gpu_budget: int | None = None  # bytes
    host_budget: int | None = None  # bytes
    buffer_bytes: int = 0  # buffers and parameters kept on the device (resident=)
    on_device: bool = True  # False: the CPU runs the model (no device)
    args: dict[str, Any] = field(default_factory=dict, repr=False)  # the offload_weights arguments it was made with
    experts: ExpertsPlan | None = None  # the routed experts' store (experts_plan)

    @property
    def resident(self) -> set[int]:
        """Blocks that never stream: on the device (a GPU), or in RAM (the CPU as the device)."""
        home = "device" if self.on_device else "ram"
        return {b.index for b in self.blocks if b.home == home}

    @property
    def streamed(self) -> list[int]:
        res = self.resident
        return [b.index for b in self.blocks if b.index not in res]

    @property
    def in_ram(self) -> set[int]:
        """Streamed blocks kept in RAM instead of on NVMe (``host_budget_gb``, on a GPU)."""
        if not self.on_device or self.storage != "nvme":
            return set()
        return {b.index for b in self.blocks if b.home == "ram"}

    @property
    def on_nvme(self) -> list[int]:
        return [b.index for b in self.blocks if b.home == "nvme"]

    @property
    def ahead(self) -> int:
        """The prefetch used: never more than the streamed blocks."""
        return min(self.prefetch, len(self.streamed))

    @property
    def ring(self) -> RingPlan:
        """The device ring (none without a device)."""
        if not self.on_device:
            return RingPlan()
        return ring_plan(self.blocks, self.streamed, self.ahead, self.placement != "cpu")

    @property
    def ring_bytes(self) -> int:
        """Device bytes of the ring with every planned slot made."""
        if not self.on_device:
            return 0
        return ring_bytes(self.blocks, self.streamed, self.ahead, self.placement != "cpu")

    @property
    def host_ring(self) -> HostRingPlan:
        """The RAM ring NVMe blocks are read into (see :func:`host_ring_plan`)."""
        return host_ring_plan(self.blocks, self.on_nvme, self.ahead, self.on_device)

    @property
    def host_ring_slots(self) -> int:
        """General pages of the RAM ring NVMe blocks are read into (0: nothing on NVMe)."""
        return self.host_ring.slots

    @property
    def host_ring_bytes(self) -> int:
        return self.host_ring.nbytes

    def tier_bytes(self) -> dict[str, int]:
        """Bytes of each tier: ``device`` (resident blocks, buffers, the ring), ``ram`` (blocks
        in host memory and the RAM ring), ``nvme`` (the pages on the SSD)."""
        size = {h: sum(b.nbytes for b in self.blocks if b.home == h) for h in HOMES}
        device = size["device"] + self.buffer_bytes + self.ring_bytes if self.on_device else 0
        ram = size["ram"] + self.host_ring_bytes + (0 if self.on_device else self.buffer_bytes)
        return {"device": device, "ram": ram, "nvme": sum(align_up(self.blocks[i].nbytes, ALIGN) for i in self.on_nvme)}

    # -- an edited plan -------------------------------------------------------------------------

    def homes(self) -> tuple[str, ...]:
        """Where a block may live under this plan's device and storage."""
        if self.on_device:
            return ("device", "ram", "nvme") if self.storage == "nvme" else ("device", "ram")
        return ("ram", "nvme") if self.storage == "nvme" else ("ram",)

    def check(self) -> None:
        """Raises ValueError naming the block if the plan cannot be built: a home this device and
        storage do not have, or blocks over a budget (with the ring they leave)."""
        allowed = self.homes()
        for i, b in enumerate(self.blocks):
            if b.index != i:
                raise ValueError(f"plan: block {b.name} has index {b.index} at place {i} of plan.blocks")
            if b.home not in allowed:
                raise ValueError(
                    f"plan: block {b.name}: home {b.home!r} is not one of {allowed} (device {self.device}, storage {self.storage!r})"
                )
        if self.on_device:
            self._fits(self.gpu_budget, "gpu_budget_gb", "device", self.buffer_bytes, self.ring_bytes)
            if self.storage == "nvme":
                self._fits(self.host_budget, "host_budget_gb", "ram", 0, self.host_ring_bytes)
        elif self.storage == "nvme":
            self._fits(self.host_budget, "host_budget_gb", "ram", self.buffer_bytes, self.host_ring_bytes)

    def _fits(self, budget: int | None, what: str, home: str, fixed: int, ring: int) -> None:
        if budget is None:
            return
        total = fixed + ring
        if total > budget:
            raise ValueError(
                f"plan: {what}: {budget / GiB:.4g} GiB is smaller than the ring the plan's streamed blocks need "
                f"({total / GiB:.4g} GiB with the buffers)"
            )
        mine = [b for b in self.blocks if b.home == home]
        # (in the order the planner keeps blocks: the one named is the first past the budget)
        for b in sorted((b for b in mine if not b.layer), key=lambda b: b.nbytes) + [b for b in mine if b.layer]:
            total += b.nbytes
            if total > budget:
                raise ValueError(
                    f"plan: block {b.name} ({b.nbytes / 2**20:.1f} MiB, home {home!r}) does not fit {what}="
                    f"{budget / GiB:.4g}: the blocks with home {home!r} up to it and the ring need {total / GiB:.4g} GiB"
                )

    # -- printed --------------------------------------------------------------------------------

    def totals(self) -> list[str]:
        """The lines of the table below the blocks: the device ring, the RAM ring, the bytes per tier."""
        mib = 2**20
        out: list[str] = []
        r = self.ring
        if self.on_device:
            own = len(r.made) + len(r.later)
            out.append(
                f"device ring: {r.general} slots of {r.slot_bytes / mib:.2f} MiB"
                + (f" and {own} of their own" if own else "") + f", {self.ring_bytes / mib:.2f} MiB at most"
            )  # fmt: skip
        if self.on_nvme:
            hr = self.host_ring
            mine = f" and {len(hr.own)} of their own ({sum(n for _, n in hr.own) / mib:.2f} MiB)" if hr.own else ""
            rows = f"; {len(hr.rows)} looked up by rows (no page)" if hr.rows else ""
            out.append(f"RAM ring: {hr.slots} pages of {hr.page / mib:.2f} MiB{mine}{rows}")
        tiers = self.tier_bytes()
        budgets = {"device": self.gpu_budget, "ram": self.host_budget}
        parts = []
        for t in HOMES:
            if t == "device" and not self.on_device:
                continue
            cap = budgets.get(t)
            parts.append(f"{t} {tiers[t] / mib:.2f} MiB" + (f" of {cap / mib:.2f}" if cap is not None else ""))
        out.append("bytes per tier: " + ", ".join(parts) + (f" (buffers {self.buffer_bytes / mib:.2f} MiB)" if self.buffer_bytes else ""))
        if self.experts is not None:
            out.append(self.experts.line() + " (beside the tiers above)")
        return out


    def __str__(self) -> str:
        mib = 2**20
        on = f"on {self.device}" if self.on_device else "on the CPU"
        lines = [
            f"WeightPlan: {len(self.blocks)} blocks {on}, storage={self.storage!r}, placement={self.placement!r}, "
            f"prefetch={self.ahead}" + (f" (asked {self.prefetch})" if self.ahead != self.prefetch else ""),
            f"  {'block':<32} {'MiB':>10}  {'lives':<6}  runs",
        ]
        for b in self.blocks:
            tag = " (quantized)" if b.quantized else ""
            lines.append(f"  {b.name[:32]:<32} {b.nbytes / mib:>10.2f}  {b.home:<6}  {b.runs}{tag}")
        return "\n".join(lines + self.totals())


def make_plan(
    blocks: list[BlockPlan], *, device: str, storage: str, placement: str, prefetch: int,
    gpu_budget: int | None = None, host_budget: int | None = None, buffer_bytes: int = 0, on_device: bool = True,
) -> WeightPlan:  # fmt: skip
    """The plan of ``blocks`` (their homes set here): on a device, whole blocks resident within
    ``gpu_budget`` after the ring, the rest streamed from RAM, or from NVMe with the blocks
    ``host_budget`` keeps in RAM; with the CPU as the device (``on_device=False``), every block in
    RAM, or with NVMe those ``host_budget`` keeps there. Raises ValueError if the ring alone
    does not fit a budget."""
    p = WeightPlan(blocks, device, storage, placement if on_device else "cpu", prefetch, gpu_budget, host_budget, buffer_bytes, on_device)
    every = [b.index for b in blocks]
    off = {"stream": "device", "cpu": "cpu", "auto": "per call"}[p.placement]
    for b in blocks:
        b.off_device = "cpu" if b.lookup or not p.on_device else off
    if p.on_device:
        general = p.placement != "cpu"
        res = choose_resident(blocks, gpu_budget, prefetch, buffer_bytes, ring=lambda s: ring_bytes(blocks, s, prefetch, general))
    elif storage == "cpu":
        res = set(every)  # the host is the device: every block in RAM, nothing to stream
    else:
        res = choose_resident(
            blocks, host_budget, prefetch, buffer_bytes, what="host_budget_gb",
            ring=lambda s: host_ring_plan(blocks, s, min(prefetch, len(s)), False).nbytes,
            last=[b.index for b in blocks if b.by_rows],
        )  # fmt: skip
    streamed = [i for i in every if i not in res]
    ahead = min(prefetch, len(streamed))
    in_ram: set[int] = set()
    if p.on_device and storage == "nvme" and host_budget is not None:
        in_ram = choose_resident(
            blocks, host_budget, ahead, 0, what="host_budget_gb", among=streamed,
            ring=lambda rest: staging_slots(ahead, len(rest), True) * page_bytes(blocks, rest),
        )  # fmt: skip
    for b in blocks:
        if b.index in res:
            b.home = "device" if p.on_device else "ram"
        else:
            b.home = "ram" if storage == "cpu" or b.index in in_ram else "nvme"
    return p


def warn_capped(p: WeightPlan, stacklevel: int) -> None:
    """More blocks ahead than there are to read: the rings never hold more than the streamed
    blocks (prefetch=10**9 would allocate slots until memory ran out). Where nothing streams
    (every block resident) there is no ring, and nothing to say."""
    n = len(p.streamed)
    if p.prefetch > n and p.prefetch > DEFAULT_PREFETCH and n:
        warnings.warn(
            f"offload_weights: prefetch={p.prefetch} is more than the {n} streamed block{'s' if n != 1 else ''}; capped at {n}",
            stacklevel=stacklevel + 1,
        )
