"""What a training forward saves of a streamed block, and the backward that brings it back.

While grad mode is on, a block's forward runs under saved-tensor hooks: a tensor autograd saves
that lies in a slot (a weight, or a view of one) is saved as a token (block, offset, shape), a
cast of a slot's parameter (autocast's) as a token that casts again, a streamed parameter that
is a wrapper subclass as a token of the parameter, anything else goes to the hooks outside (a
``torch.utils.checkpoint`` region's, an activation offload's) or is kept. In the backward,
unpacking a token activates the block again (loaded if needed, prefetched in backward order)
and gives a view of its slot; a block stays active in the backward until another block is
activated (or the backward ends), then it is released as in the forward. A checkpointed
block's recompute runs its forward inside the backward: that activation and the backward's own
are one, so the block crosses once for both.

Around a streamed block's forward: autocast's cast cache off (it would keep a copy of each fp32
weight it casts until the outermost autocast exits: the whole model on the device; a cast saved
for the backward is cast again from the slot then), and frozen quantized linears through
``FrozenLinear`` while a graph is built (``frozen.py``).

:class:`SavedWeights` is handed the streamer's verbs (acquire a block, deactivate it, end the
cycle) as weak callables, and the ring's and loader's lookups: it never imports the streamer.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Container
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..runtime.device import data_address, storage_address
from .blocks import Block, wrapped
from .frozen import FrozenLinearMode
from .hostmatmul import leave_mode
from .ring import Slot


@dataclass(frozen=True)
class _Token:
    """A saved tensor that lies in a slot: where it is in its block."""

    block: int
    offset: int  # elements of `dtype` from the block's start
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    versions: tuple[int, ...]


@dataclass(frozen=True)
class _Cast:
    """A saved tensor that is (a view of) a cast of a streamed parameter (autocast's: F.linear
    under torch.autocast saves the bf16 copy of an fp32 weight): cast again from the slot when
    unpacked, instead of holding the copy on the device until the backward."""

    block: int
    entry: int  # the parameter's place in its block
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int  # elements from the cast's start
    versions: tuple[int, ...]


@dataclass(frozen=True)
class _Param:
    """A saved streamed parameter that is a wrapper subclass (a frozen quantized weight a linear
    saves for its backward): the block is loaded again when it is unpacked."""

    block: int
    entry: int
    versions: tuple[int, ...]


@dataclass(frozen=True)
class _Outer:
    """A saved tensor handed to the saved-tensor hooks that were active outside ours."""

    packed: Any
    unpack: Callable[[Any], Tensor]


def in_backward() -> bool:
    return bool(torch._C._current_graph_task_id() != -1)


def weak(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` (a bound method) called through a weak reference to its object: a callback
    that does not keep the object alive (nothing happens once it is gone)."""
    ref = weakref.WeakMethod(method)  # type: ignore[arg-type]

    def call(*args: Any) -> Any:
        m = ref()
        return m(*args) if m is not None else None

    return call


@dataclass
class Lookups:
    """What the saved tensors read of the ring and the loader: whether a block runs now, its
    host copies' versions, the slot it is loaded into, the slot of a storage, a block's
    parameters as views of a slot."""

    running: Container[int]
    versions: Callable[[int], tuple[int, ...]]
    slot_of: Callable[[int], Slot]
    of_storage: Callable[[int], Slot | None]
    views: Callable[[Slot, int], list[list[Tensor]]]


class SavedWeights:
    """The training side of the streamed blocks (see the module documentation). ``acquire``,
    ``deactivate`` and ``end_cycle``: the streamer's verbs (a block needed now; an activation
    over; the cycle over)."""

    def __init__(
        self, blocks: list[Block], streamed: list[int], look: Lookups,
        acquire: Callable[[int], Any], deactivate: Callable[[int], None], end_cycle: Callable[[], None],
    ) -> None:  # fmt: skip
        self.blocks = blocks
        self.look = look
        self.acquire = acquire
        self.deactivate = deactivate
        self.end_cycle = end_cycle
        self.param_entry: dict[int, tuple[int, int]] = {
            id(e.param): (b, k) for b in streamed for k, e in enumerate(blocks[b].entries)
        }
        # Frozen wrapped parameters (quantized bases) per block: their linears go through
        # FrozenLinear while the block's forward builds a graph.
        self.frozen: dict[int, set[int]] = {}
        for b in streamed:
            ids = {id(e.param) for e in blocks[b].entries if e.wrapped and not e.param.requires_grad}
            if ids:
                self.frozen[b] = ids
        self.modes: dict[int, list[FrozenLinearMode]] = {}  # id(module) -> the modes it entered
        self.cache_state: dict[int, list[bool]] = {}  # id(module) -> autocast cache flags to restore
        self.pushed: dict[int, int] = {}  # id(module) -> saved-tensor hooks it pushed (to pop after it)
        self.graph = False  # this cycle's forward built a graph: a backward may follow
        self.backward = False  # this cycle's backward has started
        self.trained = False  # this cycle had a backward (a step may follow)
        self.open: set[int] = set()  # active in the backward until another block is

    # -- around a streamed block's forward ------------------------------------------------------

    def enter(self, module: torch.nn.Module) -> None:
        """Before ``module``'s forward (a streamed block's): autocast's cast cache off."""
        self.cache_state.setdefault(id(module), []).append(torch.is_autocast_cache_enabled())
        torch.set_autocast_cache_enabled(False)

    def building(self, module: torch.nn.Module, b: int) -> None:
        """``module`` (block ``b``) runs with grad mode on: its saved tensors through our hooks,
        its frozen quantized linears through ``FrozenLinear``."""
        self._push_hooks()
        self.pushed[id(module)] = self.pushed.get(id(module), 0) + 1
        if b in self.frozen:
            mode = FrozenLinearMode(self.frozen[b])
            mode.__enter__()
            self.modes.setdefault(id(module), []).append(mode)

    def leave(self, module: torch.nn.Module) -> None:
        """After ``module``'s forward: what :meth:`enter` and :meth:`building` changed, put back."""
        flags = self.cache_state.get(id(module))
        if flags:
            torch.set_autocast_cache_enabled(flags.pop())
            if not flags:
                del self.cache_state[id(module)]
        modes = self.modes.get(id(module))
        if modes:
            # By identity: on device="cpu" the CPU-run call's NativeMatmul, entered after it
            # (global hooks run before a module's own), may still be above it on the stack
            # (CUDA review, second pass, 9: __exit__ popped that one, a mode leaked per call).
            leave_mode(modes.pop())
            if not modes:
                del self.modes[id(module)]
        n = self.pushed.get(id(module), 0)
        if n:
            torch._C._autograd._pop_saved_tensors_default_hooks()
            if n == 1:
                del self.pushed[id(module)]
            else:
                self.pushed[id(module)] = n - 1

    # -- the cycle ------------------------------------------------------------------------------

    def building_graph(self) -> None:
        """A forward activation under grad mode: a backward may follow."""
        self.graph = True

    def cycle_ended(self) -> bool:
        """The cycle is over; returns whether it had a backward (a step may follow)."""
        trained = self.trained
        self.graph = self.trained = False
        return trained

    # -- the backward ---------------------------------------------------------------------------

    def backward_activate(self, b: int) -> None:
        """A backward activation (a token unpacked, a checkpointed block recomputed): ``b`` stays
        active until another block is activated in the backward, or the backward ends."""
        if not self.backward:
            self.backward = self.trained = True
            me = weakref.ref(self)

            def done() -> None:
                s = me()
                if s is not None:
                    s.end_backward()

            torch.autograd.Variable._execution_engine.queue_callback(done)  # type: ignore[attr-defined]
        if b in self.open:
            return
        self.close_open()
        self.acquire(b)
        self.open.add(b)

    def close_open(self) -> None:
        """The blocks a backward activated are done (it moved on, or ended)."""
        for c in list(self.open):
            self.open.discard(c)
            self.deactivate(c)

    def end_backward(self) -> None:
        if not self.backward:
            return
        self.close_open()
        self.backward = False
        self.end_cycle()

    # -- the saved-tensor hooks -----------------------------------------------------------------

    def _push_hooks(self) -> None:
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        me = weakref.ref(self)

        def pack(t: Tensor) -> Any:
            s = me()
            if wrapped(t):  # (no storage of its own) a streamed parameter: streamed again for the backward
                where = s.param_entry.get(id(t)) if s is not None else None
                if s is not None and where is not None and where[0] in s.look.running:
                    return _Param(where[0], where[1], s.look.versions(where[0]))
                return _Outer(outer[0](t), outer[1]) if outer is not None else t
            slot = s.look.of_storage(storage_address(t)) if s is not None else None
            if s is not None and slot is not None and slot.block is not None and t.device == slot.buf.device:
                b = slot.block
                es = t.element_size()
                off = data_address(t) - data_address(slot.buf)
                return _Token(b, off // es, t.dtype, tuple(t.shape), tuple(t.stride()), s.look.versions(b))
            cast = s._cast_of(t) if s is not None else None
            if cast is not None:
                return cast
            if outer is not None:
                return _Outer(outer[0](t), outer[1])
            return t

        def unpack(x: Any) -> Tensor:
            if isinstance(x, (_Token, _Cast, _Param)):
                s = me()
                if s is None:
                    raise RuntimeError("offload_adam: the weights' streamer is gone (offload closed?) before the backward")
                return s._unpack(x)
            if isinstance(x, _Outer):
                return x.unpack(x.packed)
            return x  # type: ignore[no-any-return]

        torch._C._autograd._push_saved_tensors_default_hooks(pack, unpack)

    def _cast_of(self, t: Tensor) -> _Cast | None:
        """``t`` as a cast of a running block's parameter (a view of ``p.to(dtype)``), or None."""
        base = t._base if t._base is not None else t
        fn = base.grad_fn
        if fn is None or fn.name() != "ToCopyBackward0" or not base.is_contiguous():
            return None
        nxt = fn.next_functions
        var = getattr(nxt[0][0], "variable", None) if nxt and nxt[0][0] is not None else None
        if var is None:
            return None
        where = self.param_entry.get(id(var))
        if where is None or where[0] not in self.look.running or base.shape != var.shape:
            return None
        b, k = where
        return _Cast(b, k, t.dtype, tuple(t.shape), tuple(t.stride()), int(t.storage_offset()), self.look.versions(b))

    def _unpack(self, tok: _Token | _Cast | _Param) -> Tensor:
        if tok.versions != self.look.versions(tok.block):
            raise RuntimeError(
                f"offload_adam: the weights of block {self.blocks[tok.block].name} were written (an optimizer step) "
                "between the forward that used them and its backward"
            )
        self.backward_activate(tok.block)
        if isinstance(tok, _Param):
            return self.blocks[tok.block].entries[tok.entry].param  # (its parts point at the slot now)
        slot = self.look.slot_of(tok.block)
        if isinstance(tok, _Cast):
            cast = self.look.views(slot, tok.block)[tok.entry][0].to(tok.dtype)
            return torch.as_strided(cast, tok.size, tok.stride, tok.offset)
        return torch.as_strided(slot.as_dtype(tok.dtype), tok.size, tok.stride, tok.offset)
