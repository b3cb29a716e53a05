"""The host state of one param group.

A :class:`GroupState` owns a group's layout (where each parameter's state sits in the flat
buffers), the buffers themselves, the native ``StateSet`` over them (imported once through
DLPack), and the views that ``optimizer.state[p]`` hands out. The same class serves every
parameter kind: CPU parameters are updated in place from their own ``.grad``; offloaded
parameters get their gradients in host landing buffers and their weights back by copy. Where
the state lives between steps is the tier's business (``tier.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .. import _native
from ..runtime.device import Device
from ..runtime.pinned import PinnedArena
from .schema import BYTE_STATES, COMP_KEY, MASTER_KEY, MOMENT, Codec, buffer_dtype, codec_for, is_dense, moments, view
from .shards import as_dtensor, row_blocks

# Gradient landing buffers, by gradient dtype (the native layer's kinds 0, 1, 2).
KINDS = (torch.float32, torch.bfloat16, torch.float16)
LOW_PRECISION = (torch.bfloat16, torch.float16)
SLOT_ALIGN = _native.LANES  # slots start on a SIMD block boundary
_MOMENT_ALIGN = 64  # bytes: each slot of uint8 moment buffers starts on a cache line


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


@dataclass(eq=False)
class Slot:
    """One parameter of a group: where its state sits (the Rust layout's ``Slot``: its first
    element in the state buffers, its length, its gradient's landing slot) and what the Python
    side keeps of it. The group's :attr:`GroupState.slots` are in parameter order; the native
    set and the engine name a slot by its index there."""

    param: Tensor  # what the kernel steps: the parameter, or a DTensor's local shard
    key: Tensor  # what the optimizer's groups and `state` hold: the parameter, or the DTensor
    name: str  # for errors: "parameter 'w' of param group 0 (shape ..., dtype)"
    home: Tensor | None  # its weights' host copy, written in place (streamed by offload_weights)
    stand_in: Tensor | None  # a CPU parameter not dense in memory: its contiguous copy (see stand_in)
    stand_version: int  # the parameter's version when the stand-in last matched it
    kahan: bool  # bfloat16 weights updated in place with Kahan compensation, no fp32 master
    codec: Codec  # how its moments are stored (see schema.py)
    offset: int  # its first element in the state buffers (masters, float moments)
    moment_offset: int  # its first element in the moment buffers (their own layout in bytes)
    len: int  # its elements (a complex parameter: twice its numel)
    landing: tuple[int, int] | None  # offloaded: (landing buffer, first element)

    @property
    def dtensor(self) -> bool:
        """A DTensor parameter (FSDP2), stepped through its local shard."""
        return self.key is not self.param


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
    Each parameter is a :class:`Slot` of :attr:`slots`.
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
        params = list(params)
        # What the optimizer's param groups and `state` hold: the parameters themselves, or for a
        # DTensor (FSDP2) the DTensor whose local shard `params[i]` is.
        keys = list(keys) if keys is not None else params
        self.has_dtensor = keys is not params  # known once: the step checks it per group
        self.device = device
        self.streamed = device is not None
        homes = list(homes) if homes is not None else [None] * len(params)
        if self.streamed:
            for p, name, home in zip(params, names, homes):
                if p.dtype not in KINDS:
                    raise TypeError(f"{name}: dtype {p.dtype} cannot be offloaded (float32, bfloat16, float16)")
                if home is None and not p.is_contiguous():
                    raise ValueError(f"{name}: an offloaded parameter must be contiguous")
        # CPU parameters not dense in memory: the kernel steps a contiguous stand-in (see stand_in).
        stand_ins: list[Tensor | None] = [None] * len(params)
        if not self.streamed:
            stand_ins = [stand_in(p, name) for p, name in zip(params, names)]
        # A DTensor's shard gets 8-bit moments only where every rank's does (see row_blocks).
        unquantized = {i for i, (k, p) in enumerate(zip(keys, params)) if k is not p and not row_blocks(k)}
        lay = layout(
            [(p.numel(), p.dtype) for p in params], bucket_bytes=bucket_bytes, page_align=page_align,
            state_dtype=state_dtype, unquantized=unquantized,
        )  # fmt: skip
        self.buckets, self.total = lay.buckets, lay.total
        # bfloat16 weights without a master (master_dtype=torch.bfloat16): updated in place
        # (CPU parameters, or a home's host copy) with Kahan compensation.
        if master_dtype == torch.bfloat16 and self.streamed:
            for p, name, h in zip(params, names, homes):
                if p.dtype == torch.bfloat16 and h is None:
                    raise ValueError(
                        f"{name}: master_dtype=torch.bfloat16 needs the weights on the host to update them in place: "
                        "CPU parameters, or weights streamed by offload_weights; an offloaded parameter keeps an fp32 master"
                    )
        self.slots = [
            Slot(
                param=p, key=k, name=name, home=h, stand_in=d, stand_version=p._version if not self.streamed else 0,
                kahan=master_dtype == torch.bfloat16 and p.dtype == torch.bfloat16 and (not self.streamed or h is not None),
                codec=lay.codecs[i], offset=lay.offsets[i], moment_offset=lay.moment_offsets[i], len=lay.lens[i],
                landing=lay.landing_slots[i] if self.streamed else None,
            )
            for i, (p, k, name, h, d) in enumerate(zip(params, keys, names, homes, stand_ins))
        ]  # fmt: skip
        self.stand_slots = [i for i, d in enumerate(stand_ins) if d is not None]  # the step visits only these
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
        need = any((self.streamed or s.param.dtype in LOW_PRECISION) and not s.kahan for s in self.slots)
        self.master = self._state_alloc(self.total, torch.float32) if need else None
        self.comp = self._state_alloc(self.total, torch.bfloat16) if any(s.kahan for s in self.slots) else None  # zeros (paged: read as zeros)
        in_bytes = state_dtype in BYTE_STATES
        moment_slots = [(s.moment_offset, s.codec.native) for s in self.slots] if in_bytes else None
        self.steps = torch.zeros(len(params), dtype=torch.float32)
        self.landing: list[Tensor | None] = [None] * len(KINDS)
        lens, offsets = [s.len for s in self.slots], [s.offset for s in self.slots]
        if self.streamed:
            self.landing = [alloc(n, KINDS[k]) if n is not None else None for k, n in enumerate(lay.landing)]
            self.native = _native.StateSet(
                lens, offsets, names, self.exp_avg, self.exp_avg_sq, self.steps, self.master,
                self.max_exp_avg_sq, landing=self.landing, landing_slots=lay.landing_slots,
                params=homes if any(h is not None for h in homes) else None, moments=moment_slots, comp=self.comp,
            )  # fmt: skip
        else:
            self.native = _native.StateSet(
                lens, offsets, names, self.exp_avg, self.exp_avg_sq, self.steps, self.master,
                self.max_exp_avg_sq, params=[d if d is not None else p for p, d in zip(params, stand_ins)],
                moments=moment_slots, comp=self.comp,
            )  # fmt: skip

    def __len__(self) -> int:
        return len(self.slots)

    @property
    def names(self) -> list[str]:
        """Each slot's name, in slot order."""
        return [s.name for s in self.slots]

    # -- what state[p] hands out --------------------------------------------------------------

    def has_master(self, i: int) -> bool:
        """Whether ``state[p]`` has parameter ``i``'s fp32 master: in the master buffer
        (offloaded, or a bfloat16/float16 CPU parameter), or its float32 home (the host copy
        the step writes in place is the master); a float32 CPU parameter is its own master."""
        s = self.slots[i]
        return self.master is not None and not s.kahan and (self.streamed or s.param.dtype in LOW_PRECISION)

    def moment_buffers(self) -> dict[str, Tensor]:
        """The group's moment buffers, by the schema's names (the amsgrad maximum if it has one)."""
        bufs = {"exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq, "max_exp_avg_sq": self.max_exp_avg_sq}
        return {k: b for k, b in bufs.items() if b is not None}

    def views(self, i: int) -> dict[str, Tensor]:
        """Views into the flat buffers of parameter ``i``'s state (local shards for a DTensor),
        as its codec shows them (see ``schema.py``)."""
        # Shaped (and strided) like the parameter; a hosted one like its home (its data, a view
        # that moves with its streaming, has any strides).
        s = self.slots[i]
        home, d = s.home, s.stand_in
        p = home if home is not None else d if d is not None else s.param
        out: dict[str, Tensor] = {"step": self.steps[i]}
        for key, buf in self.moment_buffers().items():
            out.update(s.codec.views(buf, s.moment_offset, MOMENT[key], p, rows=s.dtensor))
        if self.has_master(i):
            assert self.master is not None
            out[MASTER_KEY] = home if home is not None and p.dtype == torch.float32 else view(self.master, s.offset, p)
        if s.kahan:
            assert self.comp is not None
            out[COMP_KEY] = view(self.comp, s.offset, p)
        return out

    def entry(self, i: int) -> dict[str, Tensor]:
        """The ``state[p]`` entry of parameter ``i``: :meth:`views`, as DTensors of the
        parameter's mesh and placements for a DTensor parameter (as torch's AdamW keeps them)."""
        v = self.views(i)
        s = self.slots[i]
        if not s.dtensor:
            return v
        return {n: t if n == "step" else as_dtensor(n, t, s.key) for n, t in v.items()}

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
            s = self.slots[i]
            d, p = s.stand_in, s.param
            assert d is not None
            if p._version != s.stand_version:
                d.copy_(p)
            g = p.grad
            d.grad = None if g is None else g if g.is_contiguous() else g.contiguous()
        return self.stand_slots

    def unbind_stand_ins(self, bound: list[int]) -> None:
        """After a step (also a failed one: a slot is updated whole or not at all): the weights
        back into the parameters."""
        for i in bound:
            s = self.slots[i]
            d, p = s.stand_in, s.param
            assert d is not None
            d.grad = None
            p.copy_(d)
            s.stand_version = p._version

    # -- offloaded parameters -----------------------------------------------------------------

    def grad_slot(self, i: int) -> Tensor:
        """The host landing slot of parameter ``i``'s gradient, shaped like the parameter."""
        s = self.slots[i]
        assert s.landing is not None
        k, off = s.landing
        buf = self.landing[k]
        assert buf is not None
        p = s.param
        return buf[off : off + p.numel()].view(p.shape)

    def master_view(self, i: int) -> Tensor:
        assert self.master is not None
        s = self.slots[i]
        p = s.param
        return self.master[s.offset : s.offset + p.numel()].view(p.shape)

    def copy_src(self, i: int) -> Tensor | None:
        """Where parameter ``i``'s updated weights are copied back from (None: written into its
        home, nothing to copy): pinned host memory, as an asynchronous copy needs."""
        s = self.slots[i]
        if s.home is not None:
            return None
        return self.master_view(i) if s.param.dtype == torch.float32 and not self.paged_masters else self.grad_slot(i)

    def stages_copyback(self, i: int) -> bool:
        """Whether parameter ``i``'s updated master is copied into its landing slot after the step
        (an fp32 weight whose master is paged: the copy back reads pinned memory, not the page;
        a low-precision one has its rounded copy written there by the kernel)."""
        s = self.slots[i]
        return s.home is None and s.param.dtype == torch.float32 and self.paged_masters

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
        offsets = [s.offset for s in self.slots]
        if self.exp_avg.dtype != torch.uint8:
            return [(self.total, offsets, (*keys, "master", "comp"))]
        out: list[tuple[int, list[int], tuple[str, ...]]] = [(self.exp_avg.numel(), [s.moment_offset for s in self.slots], keys)]
        if self.master is not None or self.comp is not None:
            out.append((self.total, offsets, ("master", "comp")))
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
        tight = sum(s.param.numel() * ((2 if s.kahan else 4) + s.param.element_size()) + k * s.codec.nbytes(s.len) for s in self.slots)
        return held, tight
