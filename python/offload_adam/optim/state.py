"""The host state of one param group.

A :class:`GroupState` owns a group's layout (where each parameter's state sits in the flat
buffers), the buffers themselves, the native ``StateSet`` over them (imported once through
DLPack), and the views that ``optimizer.state[p]`` hands out. The same class serves every
parameter kind: CPU parameters are updated in place from their own ``.grad``; offloaded
parameters get their gradients in host landing buffers and their weights back by copy. Where
the state lives between steps is the tier's business (``tier.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .. import _native
from ..runtime.device import Device
from ..runtime.pinned import PinnedArena
from .schema import BYTE_STATES, COMP_KEY, MASTER_KEY, MIN_NUMEL, MOMENT, QBLOCK, Codec, buffer_dtype, codec_for, is_dense, moments, view

# Gradient landing buffers, by gradient dtype (the native layer's kinds 0, 1, 2).
KINDS = (torch.float32, torch.bfloat16, torch.float16)
LOW_PRECISION = (torch.bfloat16, torch.float16)
SLOT_ALIGN = _native.LANES  # slots start on a SIMD block boundary
_MOMENT_ALIGN = 64  # bytes: each slot of uint8 moment buffers starts on a cache line


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a DTensor (FSDP2's parameters), without importing torch.distributed."""
    return type(t).__name__ == "DTensor" and hasattr(t, "_local_tensor")


def same_sharding(t: Any, key: Tensor) -> bool:
    """Whether ``t`` is a DTensor of the DTensor parameter ``key``'s mesh and placements, so that
    its local shard lines up with ``key``'s."""
    return (
        is_dtensor(t) and is_dtensor(key) and t.placements == key.placements and t.device_mesh == key.device_mesh  # type: ignore[attr-defined]
    )


def _aligned(n: int) -> int:
    return -(-n // SLOT_ALIGN) * SLOT_ALIGN


def stand_in(p: Tensor, name: str) -> Tensor | None:
    """A CPU parameter that is not dense in memory (a strided view: every other column) is
    stepped through a contiguous copy of it, written back after each step (None: dense, it is
    stepped in place). One whose elements overlap cannot be updated elementwise at all."""
    if is_dense(p):
        return None
    if torch._debug_has_internal_overlap(p) == 1:
        raise ValueError(f"{name}: its elements overlap in memory (an expanded tensor): it cannot be updated in place")
    return p.detach().clone(memory_format=torch.contiguous_format)


@dataclass
class Layout:
    """Where a group's state sits: what :class:`GroupState` allocates, and what the planner
    (``python -m offload_adam plan``) counts, from one computation."""

    lens: list[int]  # elements of each slot (a complex parameter: twice its numel)
    buckets: list[range]  # consecutive parameters, up to `bucket_bytes` of gradient each
    offsets: list[int]  # first element of each slot in the state buffers
    total: int  # elements of each state buffer
    landing_slots: list[tuple[int, int]]  # offloaded: (landing buffer, first element) per slot
    landing: list[int | None]  # offloaded: elements of each landing buffer (KINDS), None if unused
    state_dtype: torch.dtype  # the moment buffers' dtype (uint8 for uint8 and float8_e4m3fn moments)
    codecs: list[Codec]  # how each slot stores its moments (see schema.py)
    moment_offsets: list[int]  # first element of each slot in the moment buffers
    moment_total: int  # elements of each moment buffer

    def moment_bytes(self) -> int:
        return self.moment_total * torch.empty((), dtype=self.state_dtype).element_size()

    def host_bytes(self, *, amsgrad: bool, master: bool, streamed: bool, comp: bool = False) -> int:
        """Bytes of the host buffers a group with this layout allocates (``comp``: a bfloat16
        Kahan compensation buffer)."""
        n = self.moment_bytes() * len(moments(amsgrad)) + (self.total * 4 if master else 0) + 4 * len(self.lens)
        n += self.total * 2 if comp else 0
        if streamed:
            n += sum(c * torch.empty((), dtype=KINDS[k]).element_size() for k, c in enumerate(self.landing) if c is not None)
        return n


def row_blocks(k: Tensor) -> bool:
    """Whether a DTensor parameter's shards all get 8-bit moments, with their blocks along whole
    rows: FSDP2's ``Shard(0)`` on one mesh dimension, rows of whole blocks of 256, and every
    rank's shard (``torch.chunk`` of the rows) at least ``MIN_NUMEL`` elements. Every rank then
    agrees on the codec (from the global shape alone), a block never straddles a shard, and the
    absmax shards as the parameter's rows do (``(rows, row // 256)``)."""
    from torch.distributed.tensor import Shard

    pl = k.placements  # type: ignore[attr-defined]
    if k.ndim < 2 or len(pl) != 1 or pl[0] != Shard(0):
        return False
    row = math.prod(k.shape[1:])
    if row % QBLOCK:
        return False
    world, rows = k.device_mesh.size(), k.shape[0]  # type: ignore[attr-defined]
    per = -(-rows // world)
    return all(max(0, min(rows, (r + 1) * per) - r * per) * row >= MIN_NUMEL for r in range(world))


def layout(
    params: Sequence[tuple[int, torch.dtype]], *, bucket_bytes: int, page_align: int = SLOT_ALIGN, state_dtype: torch.dtype = torch.float32,
    unquantized: set[int] = frozenset(),  # type: ignore[assignment]
) -> Layout:
    """The layout of a group of parameters given as (numel, dtype): buckets of ``bucket_bytes``
    of gradient, each bucket's state starting on a multiple of ``page_align`` elements, each slot
    on a SIMD block boundary; one landing buffer per gradient dtype for offloaded groups. Moments
    in uint8 buffers (``state_dtype=torch.uint8`` or ``torch.float8_e4m3fn``) have their own byte layout: each slot its
    codec's bytes on a cache line, each bucket on ``2 * page_align`` bytes (4 KiB pages on NVMe)."""
    sizes = [torch.empty((), dtype=dt).element_size() for _, dt in params]
    lens = [n * (2 if dt.is_complex else 1) for n, dt in params]
    buckets: list[range] = []
    first = size = 0
    for i, (n, _) in enumerate(params):
        size += n * sizes[i]
        if size >= bucket_bytes or i == len(params) - 1:
            buckets.append(range(first, i + 1))
            first, size = i + 1, 0
    starts = {b.start for b in buckets}
    offsets: list[int] = []
    total = 0
    for i, n in enumerate(lens):
        if i in starts:
            total = -(-total // page_align) * page_align
        offsets.append(total)
        total += _aligned(n)
    total = -(-total // page_align) * page_align
    used = [0] * len(KINDS)
    slots: list[tuple[int, int]] = []
    for n, dt in params:
        k = KINDS.index(dt) if dt in KINDS else 0
        slots.append((k, used[k]))
        used[k] += _aligned(n)
    landing = [used[k] if any(dt == KINDS[k] for _, dt in params) else None for k in range(len(KINDS))]
    codecs = [codec_for(state_dtype, 0 if i in unquantized else n, dt) for i, (n, (_, dt)) in enumerate(zip(lens, params))]
    if state_dtype not in BYTE_STATES:
        return Layout(lens, buckets, offsets, total, slots, landing, state_dtype, codecs, offsets, total)
    page = max(_MOMENT_ALIGN, 2 * page_align)
    moff: list[int] = []
    mtotal = 0
    for i, (n, c) in enumerate(zip(lens, codecs)):
        mtotal = -(-mtotal // (page if i in starts else _MOMENT_ALIGN)) * (page if i in starts else _MOMENT_ALIGN)
        moff.append(mtotal)
        mtotal += c.nbytes(n)
    mtotal = -(-mtotal // page) * page
    return Layout(lens, buckets, offsets, total, slots, landing, buffer_dtype(state_dtype), codecs, moff, mtotal)


class GroupState:
    """One param group's layout, flat host buffers, native state set and state views.

    ``device`` None: CPU parameters, weights written in place, gradients read from ``.grad``.
    Otherwise the parameters live on ``device``: buffers come from ``arena`` (pinned),
    gradients land in host landing buffers (one per gradient dtype) and the updated weights are
    copied back from the masters (float32) or from the landing slot, which the kernel overwrites
    with the rounded weights once it has read the gradient (bfloat16/float16). A parameter with
    a home (``homes[i]``: its host copy, the truth of a parameter whose weights are streamed to
    the device) is written in place into it instead (a float32 home is its own master; a
    bfloat16/float16 one gets the rounded weights in the same pass): nothing is copied back.
    """

    def __init__(
        self,
        params: list[Tensor],
        names: list[str],
        *,
        state_dtype: torch.dtype,
        amsgrad: bool,
        device: Device | None,
        arena: PinnedArena | None = None,
        bucket_bytes: int,
        page_align: int = SLOT_ALIGN,
        state_alloc: Callable[[int, torch.dtype], Tensor] | None = None,
        keys: list[Tensor] | None = None,
        homes: list[Tensor | None] | None = None,
        master_dtype: torch.dtype = torch.float32,
    ) -> None:
        self.params = list(params)
        # What the optimizer's param groups and `state` hold: the parameters themselves, or for a
        # DTensor (FSDP2) the DTensor whose local shard `params[i]` is.
        self.keys = list(keys) if keys is not None else self.params
        self.dtensor = [k is not p for k, p in zip(self.keys, self.params)]
        self.has_dtensor = keys is not None  # known once: the step checks it per group
        self.names = names
        self.device = device
        self.streamed = device is not None
        self.homes: list[Tensor | None] = list(homes) if homes is not None else [None] * len(params)
        if self.streamed:
            for p, name, home in zip(params, names, self.homes):
                if p.dtype not in KINDS:
                    raise TypeError(f"{name}: dtype {p.dtype} cannot be offloaded (float32, bfloat16, float16)")
                if home is None and not p.is_contiguous():
                    raise ValueError(f"{name}: an offloaded parameter must be contiguous")
        # CPU parameters not dense in memory: the kernel steps a contiguous stand-in (see stand_in).
        self.stand_ins: list[Tensor | None] = [None] * len(params)
        self.stand_versions: list[int] = [0] * len(params)
        if not self.streamed:
            self.stand_ins = [stand_in(p, name) for p, name in zip(params, names)]
            self.stand_versions = [p._version for p in params]
        self.stand_slots = [i for i, d in enumerate(self.stand_ins) if d is not None]  # the step visits only these
        # A DTensor's shard gets 8-bit moments only where every rank's does (see row_blocks).
        unquantized = {i for i, (k, d) in enumerate(zip(self.keys, self.dtensor)) if d and not row_blocks(k)}
        lay = layout(
            [(p.numel(), p.dtype) for p in params], bucket_bytes=bucket_bytes, page_align=page_align,
            state_dtype=state_dtype, unquantized=unquantized,
        )  # fmt: skip
        self.lens, self.buckets, self.offsets, self.total = lay.lens, lay.buckets, lay.offsets, lay.total
        self.codecs, self.moment_offsets = lay.codecs, lay.moment_offsets
        alloc: Callable[[int, torch.dtype], Tensor] = (
            arena.alloc if arena is not None else (lambda n, dt: torch.zeros(n, dtype=dt))
        )
        self._state_alloc = state_alloc or alloc
        # Masters in memory of a tier's own (NVMe pages: pageable, moved under the window), not
        # the pinned arena: an fp32 parameter's weights go back through its pinned landing slot.
        self.paged_masters = state_alloc is not None
        self.exp_avg = self._state_alloc(lay.moment_total, lay.state_dtype)
        self.exp_avg_sq = self._state_alloc(lay.moment_total, lay.state_dtype)
        self.max_exp_avg_sq = self._state_alloc(lay.moment_total, lay.state_dtype) if amsgrad else None
        # bfloat16 weights without a master (master_dtype=torch.bfloat16): updated in place
        # (CPU parameters, or a home's host copy) with Kahan compensation.
        self.kahan = [
            master_dtype == torch.bfloat16 and p.dtype == torch.bfloat16 and (not self.streamed or h is not None)
            for p, h in zip(params, self.homes)
        ]
        if master_dtype == torch.bfloat16 and self.streamed:
            for p, name, h in zip(params, names, self.homes):
                if p.dtype == torch.bfloat16 and h is None:
                    raise ValueError(
                        f"{name}: master_dtype=torch.bfloat16 needs the weights on the host to update them in place: "
                        "CPU parameters, or weights streamed by offload_weights; an offloaded parameter keeps an fp32 master"
                    )
        needs_master = [self.streamed or p.dtype in LOW_PRECISION for p in params]
        need = any(m and not k for m, k in zip(needs_master, self.kahan))
        self.master = self._state_alloc(self.total, torch.float32) if need else None
        self.comp = self._state_alloc(self.total, torch.bfloat16) if any(self.kahan) else None  # zeros (paged: read as zeros)
        in_bytes = state_dtype in BYTE_STATES
        slots = [(o, c.native) for o, c in zip(self.moment_offsets, self.codecs)] if in_bytes else None
        self.steps = torch.zeros(len(params), dtype=torch.float32)
        self.landing: list[Tensor | None] = [None] * len(KINDS)
        self.landing_slots: list[tuple[int, int]] = []
        if self.streamed:
            self.landing_slots = lay.landing_slots
            self.landing = [alloc(n, KINDS[k]) if n is not None else None for k, n in enumerate(lay.landing)]
            self.native = _native.StateSet(
                self.lens, self.offsets, names, self.exp_avg, self.exp_avg_sq, self.steps, self.master,
                self.max_exp_avg_sq, landing=self.landing, landing_slots=self.landing_slots,
                params=self.homes if any(h is not None for h in self.homes) else None, moments=slots, comp=self.comp,
            )  # fmt: skip
        else:
            self.native = _native.StateSet(
                self.lens, self.offsets, names, self.exp_avg, self.exp_avg_sq, self.steps, self.master,
                self.max_exp_avg_sq, params=[d if d is not None else p for p, d in zip(self.params, self.stand_ins)],
                moments=slots, comp=self.comp,
            )  # fmt: skip

    def __len__(self) -> int:
        return len(self.params)

    # -- what state[p] hands out --------------------------------------------------------------

    def has_master(self, i: int) -> bool:
        """Whether ``state[p]`` has parameter ``i``'s fp32 master: in the master buffer
        (offloaded, or a bfloat16/float16 CPU parameter), or its float32 home (the host copy
        the step writes in place is the master); a float32 CPU parameter is its own master."""
        return self.master is not None and not self.kahan[i] and (self.streamed or self.params[i].dtype in LOW_PRECISION)

    def moment_buffers(self) -> dict[str, Tensor]:
        """The group's moment buffers, by the schema's names (the amsgrad maximum if it has one)."""
        bufs = {"exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq, "max_exp_avg_sq": self.max_exp_avg_sq}
        return {k: b for k, b in bufs.items() if b is not None}

    def views(self, i: int) -> dict[str, Tensor]:
        """Views into the flat buffers of parameter ``i``'s state (local shards for a DTensor),
        as its codec shows them (see ``schema.py``)."""
        # Shaped (and strided) like the parameter; a hosted one like its home (its data, a view
        # that moves with its streaming, has any strides).
        home, d = self.homes[i], self.stand_ins[i]
        p = home if home is not None else d if d is not None else self.params[i]
        out: dict[str, Tensor] = {"step": self.steps[i]}
        codec, off = self.codecs[i], self.moment_offsets[i]
        for key, buf in self.moment_buffers().items():
            out.update(codec.views(buf, off, MOMENT[key], p, rows=self.dtensor[i]))
        if self.has_master(i):
            assert self.master is not None
            out[MASTER_KEY] = home if home is not None and p.dtype == torch.float32 else view(self.master, self.offsets[i], p)
        if self.kahan[i]:
            assert self.comp is not None
            out[COMP_KEY] = view(self.comp, self.offsets[i], p)
        return out

    def entry(self, i: int) -> dict[str, Tensor]:
        """The ``state[p]`` entry of parameter ``i``: :meth:`views`, as DTensors of the
        parameter's mesh and placements for a DTensor parameter (as torch's AdamW keeps them)."""
        v = self.views(i)
        if not self.dtensor[i]:
            return v
        from torch.distributed.tensor import DTensor

        k = self.keys[i]
        assert isinstance(k, DTensor)

        def dt(n: str, t: Tensor) -> Tensor:
            if n.endswith(("_absmax", "_scale")):  # one per 256 elements of each row (see row_blocks)
                per = math.prod(k.shape[1:]) // QBLOCK
                return DTensor.from_local(t, k.device_mesh, k.placements, run_check=False, shape=torch.Size((k.shape[0], per)), stride=(per, 1))
            return DTensor.from_local(t, k.device_mesh, k.placements, run_check=False, shape=k.shape, stride=k.stride())

        return {n: t if n == "step" else dt(n, t) for n, t in v.items()}

    def ensure_amsgrad(self) -> bool:
        """Allocates ``max_exp_avg_sq`` for a group whose ``amsgrad`` was switched on later:
        torch starts the maximum at zero for a fresh state; for an existing one the current
        ``exp_avg_sq`` is the best stand-in for the maximum so far. True if it was created."""
        if self.max_exp_avg_sq is not None:
            return False
        buf = self._state_alloc(self.exp_avg_sq.numel(), self.exp_avg_sq.dtype)
        buf.copy_(self.exp_avg_sq)  # same codecs, same map: the bytes carry over
        self.native.set_max_exp_avg_sq(buf)
        self.max_exp_avg_sq = buf
        return True

    # -- CPU parameters stepped through a stand-in ---------------------------------------------

    def bind_stand_ins(self) -> list[int]:
        """Before a step: each stand-in takes its parameter's value if the parameter was written
        since (a load into the model) and its gradient (contiguous, as AccumulateGrad makes
        the gradient of a parameter that is not dense). Returns the slots bound."""
        for i in self.stand_slots:
            d, p = self.stand_ins[i], self.params[i]
            assert d is not None
            if p._version != self.stand_versions[i]:
                d.copy_(p)
            g = p.grad
            d.grad = None if g is None else g if g.is_contiguous() else g.contiguous()
        return self.stand_slots

    def unbind_stand_ins(self, bound: list[int]) -> None:
        """After a step (also a failed one: a slot is updated whole or not at all): the weights
        back into the parameters."""
        for i in bound:
            d, p = self.stand_ins[i], self.params[i]
            assert d is not None
            d.grad = None
            p.copy_(d)
            self.stand_versions[i] = p._version

    # -- offloaded parameters -----------------------------------------------------------------

    def grad_slot(self, i: int) -> Tensor:
        """The host landing slot of parameter ``i``'s gradient, shaped like the parameter."""
        k, off = self.landing_slots[i]
        buf = self.landing[k]
        assert buf is not None
        p = self.params[i]
        return buf[off : off + p.numel()].view(p.shape)

    def master_view(self, i: int) -> Tensor:
        assert self.master is not None
        p = self.params[i]
        return self.master[self.offsets[i] : self.offsets[i] + p.numel()].view(p.shape)

    def copy_src(self, i: int) -> Tensor | None:
        """Where parameter ``i``'s updated weights are copied back from (None: written into its
        home, nothing to copy): pinned host memory, as an asynchronous copy needs."""
        if self.homes[i] is not None:
            return None
        return self.master_view(i) if self.params[i].dtype == torch.float32 and not self.paged_masters else self.grad_slot(i)

    def stages_copyback(self, i: int) -> bool:
        """Whether parameter ``i``'s updated master is copied into its landing slot after the step
        (an fp32 weight whose master is paged: the copy back reads pinned memory, not the page;
        a low-precision one has its rounded copy written there by the kernel)."""
        return self.homes[i] is None and self.params[i].dtype == torch.float32 and self.paged_masters

    # -- buffers ------------------------------------------------------------------------------

    def state_buffers(self) -> list[Tensor]:
        """The buffers a checkpoint load rewrites: moments, step counts, and the masters of CPU
        groups (an offloaded group's masters are taken from the checkpoint or the model)."""
        bufs = [self.exp_avg, self.exp_avg_sq, self.max_exp_avg_sq, self.steps, self.comp]
        if not self.streamed:
            bufs.append(self.master)
        return [t for t in bufs if t is not None]

    def paged_layouts(self) -> list[tuple[int, list[int], tuple[str, ...]]]:
        """The paged buffers by layout: (elements of each buffer, first element of each slot,
        the buffers' keys). Moments and masters share one, except uint8 moments (a byte layout
        of their own)."""
        keys = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
        if self.exp_avg.dtype != torch.uint8:
            return [(self.total, self.offsets, (*keys, "master", "comp"))]
        out: list[tuple[int, list[int], tuple[str, ...]]] = [(self.exp_avg.numel(), self.moment_offsets, keys)]
        if self.master is not None or self.comp is not None:
            out.append((self.total, self.offsets, ("master", "comp")))
        return out

    def paged_buffers(self) -> dict[str, Tensor]:
        """The buffers a tier may page (each with the layout's offsets): moments, amsgrad
        maximum, masters; not the step counts or landing buffers."""
        bufs = {
            "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq, "max_exp_avg_sq": self.max_exp_avg_sq,
            "master": self.master, "comp": self.comp,
        }  # fmt: skip
        return {k: b for k, b in bufs.items() if b is not None}

    def buffers(self) -> list[Tensor]:
        """Every host buffer of the group."""
        bufs = [self.exp_avg, self.exp_avg_sq, self.max_exp_avg_sq, self.master, self.comp, self.steps, *self.landing]
        return [t for t in bufs if t is not None]

    def memory(self, paged: bool = False) -> tuple[int, int]:
        """(host bytes held, tight bytes: for an offloaded parameter 4 B master + the moments +
        its gradient's landing slot; for a CPU group everything it holds). ``paged``: the state
        buffers are paged by the tier, which reports them; only the rest is counted."""
        bufs = self.buffers()
        if paged:
            state = {id(t) for t in self.paged_buffers().values()}
            held = sum(t.untyped_storage().nbytes() for t in bufs if id(t) not in state)
            return held, held
        held = sum(t.untyped_storage().nbytes() for t in bufs)
        if not self.streamed:
            return held, held
        k = len(self.moment_buffers())
        tight = sum(
            p.numel() * ((2 if kahan else 4) + p.element_size()) + k * c.nbytes(n)
            for p, c, n, kahan in zip(self.params, self.codecs, self.lens, self.kahan)
        )
        return held, tight
