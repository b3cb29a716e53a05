"""A model's blocks: the units its weights are streamed in.

By default each child of a ``ModuleList`` of repeated layers (children of one class, with
parameters: an HF model's decoder layers) is a block, holding every parameter under it; each
remaining module with parameters of its own (embeddings, the final norm, the head) is a block of
those parameters. ``blocks=`` gives the user's own list of modules, each holding every parameter
under it. Blocks that share a parameter (an embedding tied to the head) are one block, stored
once, with several modules that run it.

Inside a block each tensor has an offset aligned to :data:`TENSOR_ALIGN` bytes, so that a block
is one contiguous run of bytes, on the host as in its device slot, copied in one transfer.

A parameter that is a traceable wrapper subclass (it implements ``__tensor_flatten__`` and
``__tensor_unflatten__``: torchao's quantized tensors are) is stored as its inner tensors, each
a part of the block at its own offset, in their own dtype (int8 data and a float32 scale: the
quantized bytes, never a dequantized copy). The subclass is rebuilt once over device tensors
(``__tensor_unflatten__``), so that it reports the device it runs on; each load then points its
inner tensors (the attributes ``__tensor_flatten__`` names) at their views of the slot, as a plain
parameter's ``.data`` is. A subclass that does not flatten cannot be streamed: an error names
the parameter and its type.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..runtime.device import device_for, set_data, swap, tensor_type
from ..runtime.pinned import align_up

TENSOR_ALIGN = 256  # bytes: every tensor of a block starts on it (as the caching allocator aligns: kernels see the same alignment)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def wrapped(t: Tensor) -> bool:
    """Whether ``t`` is a tensor subclass with tensors of its own (it flattens, or dispatches
    operators itself): not a plain tensor, nor a parameter (of a subclass that only adds Python
    attributes)."""
    cls = type(t)
    if cls is Tensor or cls is torch.nn.Parameter or _device_memory(t):
        return False
    dispatch = getattr(cls.__torch_dispatch__, "__func__", cls.__torch_dispatch__)
    return hasattr(cls, "__tensor_flatten__") or dispatch is not torch._C._disabled_torch_dispatch_impl


def _device_memory(t: Tensor) -> bool:
    """``t`` is the plain memory of a device the runtime streams through whose tensors are a
    Python subclass (its ``tensor_type``: the test suite's simulated GPU, whose tensors wrap host
    memory to tell it from the CPU's), what a plain CUDA tensor is on a GPU."""
    if t.device.type in ("cpu", "meta", "cuda"):
        return False
    try:
        dev = device_for(t.device)
    except ValueError:
        return False
    return dev is not None and type(t) is tensor_type(dev)


def _dense(t: Tensor) -> bool:
    """Whether ``t``'s elements fill their span of memory exactly once (a permutation of a
    contiguous tensor's strides)."""
    expect = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1):
        if stride != expect:
            return False
        expect *= size
    return True


@dataclass
class Part:
    """One tensor of a block's bytes: a plain parameter, or an inner tensor of a wrapped one."""

    attr: str | None  # the inner tensor's name (None: the parameter itself)
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...] | None = None  # an inner tensor's, if not contiguous (dense: a permutation)
    offset: int = 0  # bytes from the block's start
    nbytes: int = 0

    @property
    def numel(self) -> int:
        return int(torch.Size(self.shape).numel())

    def shaped(self, flat: Tensor) -> Tensor:
        """``flat`` (its elements, one dimension) seen with its shape and strides."""
        return flat.view(self.shape) if self.stride is None else flat.as_strided(self.shape, self.stride)

    def view(self, base: Tensor) -> Tensor:
        return self.shaped(base[self.offset : self.offset + self.nbytes].view(self.dtype))



@dataclass
class Entry:
    """One parameter of a block (under all its names, if it is tied), stored as its parts: the
    parameter itself, or a wrapper subclass's inner tensors."""

    param: torch.nn.Parameter
    names: list[str]
    parts: list[Part] = field(default_factory=list)
    ctx: Any = None  # a wrapper subclass's flatten context

    def __post_init__(self) -> None:
        p = self.param
        if not wrapped(p):
            self.parts = [Part(None, p.dtype, tuple(p.shape))]
            return
        flatten = getattr(p, "__tensor_flatten__", None)
        if flatten is None or not hasattr(type(p), "__tensor_unflatten__"):
            raise TypeError(
                f"{self.names[0]}: a {type(p).__name__} cannot be offloaded: a tensor subclass is streamed as its "
                "inner tensors, and this one does not implement __tensor_flatten__ and __tensor_unflatten__"
            )
        attrs, self.ctx = flatten()
        for a in attrs:
            t = getattr(p, a)
            if wrapped(t) or not _dense(t):
                raise TypeError(
                    f"{self.names[0]}: the inner tensor {a!r} of a {type(p).__name__} is a {type(t).__name__} of strides "
                    f"{tuple(t.stride())}: only plain inner tensors without gaps or overlaps in their memory are streamed"
                )
            self.parts.append(Part(a, t.dtype, tuple(t.shape), None if t.is_contiguous() else tuple(t.stride())))

    @property
    def wrapped(self) -> bool:
        return self.parts[0].attr is not None

    @property
    def offset(self) -> int:
        """Bytes from the block's start to its first part."""
        return self.parts[0].offset

    @property
    def nbytes(self) -> int:
        """Bytes its parts span, alignment between them included."""
        return self.parts[-1].offset + self.parts[-1].nbytes - self.parts[0].offset

    def view(self, base: Tensor) -> Tensor:
        """This (plain) parameter inside ``base``, the block's bytes (a uint8 tensor)."""
        assert not self.wrapped, self.names[0]
        return self.parts[0].view(base)

    def views(self, base: Tensor) -> list[Tensor]:
        """Its parts inside ``base``, the block's bytes."""
        return [q.view(base) for q in self.parts]

    def tensors(self) -> list[Tensor]:
        """Its parts where they are now."""
        if not self.wrapped:
            return [self.param.detach()]
        return [getattr(self.param, q.attr) for q in self.parts]  # type: ignore[arg-type]

    def bind(self, parts: list[Tensor]) -> None:
        """Points the parameter at ``parts`` (as :meth:`tensors` returns them): a plain one's
        ``.data``, a wrapped one's inner tensors."""
        if not self.wrapped:
            set_data(self.param, parts[0])
            return
        for q, t in zip(self.parts, parts):
            setattr(self.param, q.attr, t)  # type: ignore[arg-type]

    def attach(self, parts: list[Tensor]) -> Callable[[], None]:
        """:meth:`bind`, where a parameter cannot take new data: one on the meta device
        (``init_empty_weights``), or a wrapped one moving to another device (the device it
        reports is fixed at its construction). Its contents are then swapped for a parameter
        over ``parts``: the object stays, and with it every module holding it and every tie.
        Returns what puts the parameter back as it was (it holds its former tensors: dropped,
        they go)."""
        p = self.param
        if p.device.type == "meta" or (self.wrapped and p.device != parts[0].device):
            new = self.rebuild(parts)
            swap(p, new)  # (`new` holds what `p` was)
            return lambda: swap(p, new)
        old = self.tensors()
        self.bind(parts)
        return lambda: self.bind(old)

    def rebuild(self, parts: list[Tensor]) -> torch.nn.Parameter:
        """A new parameter of its type over ``parts`` (a wrapped one: the device it reports is
        theirs)."""
        p = self.param
        if not self.wrapped:
            return torch.nn.Parameter(parts[0], requires_grad=p.requires_grad)
        inner = {q.attr: t for q, t in zip(self.parts, parts)}
        t = type(p).__tensor_unflatten__(inner, self.ctx, p.shape, p.stride())  # type: ignore[attr-defined]
        return torch.nn.Parameter(t, requires_grad=p.requires_grad)


@dataclass
class Block:
    index: int
    name: str
    modules: list[torch.nn.Module]  # the modules whose forward runs this block
    entries: list[Entry] = field(default_factory=list)
    nbytes: int = 0  # the span of its tensors, alignment inside included
    layer: bool = False  # a child of a ModuleList of repeated layers

    @property
    def shared(self) -> bool:
        """Run by several modules (tied parameters): it may be needed at several points of a
        forward."""
        return len(self.modules) > 1

    @property
    def parts(self) -> list[Part]:
        return [q for e in self.entries for q in e.parts]

    def layout(self) -> None:
        off = 0
        for q in self.parts:
            q.offset = off
            q.nbytes = q.numel * torch.empty((), dtype=q.dtype).element_size()
            off = align_up(off + q.nbytes, TENSOR_ALIGN)
        last = self.parts[-1] if self.entries else None
        self.nbytes = last.offset + last.nbytes if last is not None else 0


def _repeated(m: torch.nn.Module) -> bool:
    kids = [c for c in m.children()]
    return (
        isinstance(m, torch.nn.ModuleList)
        and len(kids) >= 2
        and len({type(c) for c in kids}) == 1
        and any(True for _ in kids[0].parameters())
    )


def _groups(
    model: torch.nn.Module, blocks: list[torch.nn.Module] | None, keep: frozenset[int], names: dict[int, str]
) -> list[tuple[torch.nn.Module, list[torch.nn.Parameter], bool]]:
    """The candidate blocks, (module, its parameters not kept, whether a layer), before tied
    parameters merge them: the default's (each layer of a ModuleList of repeated layers, each
    other module with parameters of its own) or the user's ``blocks``, checked."""
    groups: list[tuple[torch.nn.Module, list[torch.nn.Parameter], bool]] = []  # (module, params, layer)
    if blocks is None:

        def visit(m: torch.nn.Module) -> None:
            if _repeated(m):
                for c in m.children():
                    groups.append((c, [p for p in c.parameters() if id(p) not in keep], True))
                return
            own = [p for p in m._parameters.values() if p is not None and id(p) not in keep]
            if own:
                groups.append((m, own, False))
            for c in m.children():
                visit(c)

        visit(model)
    else:
        seen: set[int] = set()
        for i, m in enumerate(blocks):
            if not isinstance(m, torch.nn.Module):
                raise TypeError(f"blocks[{i}]: expected an nn.Module, got {type(m).__name__}")
            if id(m) in seen:
                raise ValueError(f"blocks[{i}]: module {names.get(id(m), type(m).__name__)!r} is listed twice")
            if id(m) not in names:
                raise ValueError(f"blocks[{i}]: a {type(m).__name__} that is not a submodule of the model")
            seen.add(id(m))
            groups.append((m, [p for p in m.parameters() if id(p) not in keep], False))
    return groups


def find_blocks(model: torch.nn.Module, blocks: list[torch.nn.Module] | None = None, keep: frozenset[int] = frozenset()) -> list[Block]:
    """The blocks of ``model`` (see the module documentation), in the order of its modules;
    raises ValueError naming the culprit for a user list that misses parameters or names a
    module twice, or blocks whose parameters overlap. ``keep``: parameters (by ``id``) in no
    block (kept on the device: ``offload_weights(resident=...)``); a block left without
    parameters is none."""
    names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    groups = _groups(model, blocks, keep, names)
    groups = [g for g in groups if g[1]]  # (a module whose parameters are all kept)
    # Parameters under several entries: tied parameters merge their blocks; a user's blocks
    # must not overlap.
    owner: dict[int, int] = {}
    parent = list(range(len(groups)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for gi, (m, params, _) in enumerate(groups):
        for p in params:
            other = owner.setdefault(id(p), gi)
            if other != gi:
                if blocks is not None:
                    a, b = names.get(id(groups[other][0]), "?"), names.get(id(m), "?")
                    raise ValueError(f"blocks: {a!r} and {b!r} share parameters; a parameter belongs to one block")
                parent[root(gi)] = root(other)
    all_params = {id(p): (n, p) for n, p in model.named_parameters(remove_duplicate=False)}
    missing = [n for n, p in model.named_parameters() if id(p) not in owner and id(p) not in keep]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ValueError(f"blocks: these parameters are in no block: {shown}")
    qualified: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        qualified.setdefault(id(p), []).append(n)
    out: dict[int, Block] = {}
    for gi, (m, params, layer) in enumerate(groups):
        r = root(gi)
        b = out.get(r)
        if b is None:
            b = out[r] = Block(len(out), names.get(id(m), "") or "<model>", [], layer=layer)
        elif m not in b.modules:
            b.name += "+" + (names.get(id(m), "") or "<model>")
        if not any(m is x for x in b.modules):
            b.modules.append(m)
        have = {id(e.param) for e in b.entries}
        for p in params:
            if id(p) not in have:
                have.add(id(p))
                b.entries.append(Entry(p, qualified.get(id(p), [all_params.get(id(p), ("?", p))[0]])))
    result = list(out.values())
    for i, b in enumerate(result):
        b.index = i
        for e in b.entries:
            if not e.wrapped and e.param.dtype not in DTYPES:
                raise TypeError(f"{e.names[0]}: dtype {e.param.dtype} cannot be offloaded (float32, bfloat16, float16)")
        b.layout()
    return result
