"""A model's blocks: the units its weights are streamed in.

By default each child of a ``ModuleList`` of repeated layers (children of one class, with
parameters: an HF model's decoder layers) is a block, holding every parameter under it; each
remaining module with parameters of its own (embeddings, the final norm, the head) is a block of
those parameters. ``blocks=`` gives the user's own list of modules, each holding every parameter
under it. Blocks that share a parameter (an embedding tied to the head) are one block, stored
once, with several modules that run it.

Inside a block each tensor has an offset aligned to :data:`TENSOR_ALIGN` bytes, so that a block
is one contiguous run of bytes, on the host as in its device slot, copied in one transfer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..runtime.pinned import align_up

TENSOR_ALIGN = 256  # bytes: every tensor of a block starts on it (as the caching allocator aligns: kernels see the same alignment)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class Entry:
    """One parameter of a block (under all its names, if it is tied)."""

    param: torch.nn.Parameter
    names: list[str]
    offset: int = 0  # bytes from the block's start
    nbytes: int = 0

    def view(self, base: Tensor) -> Tensor:
        """This parameter inside ``base``, the block's bytes (a uint8 tensor)."""
        p = self.param
        return base[self.offset : self.offset + self.nbytes].view(p.dtype).view(p.shape)


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

    def layout(self) -> None:
        off = 0
        for e in self.entries:
            e.offset = off
            e.nbytes = e.param.numel() * e.param.element_size()
            off = align_up(off + e.nbytes, TENSOR_ALIGN)
        self.nbytes = self.entries[-1].offset + self.entries[-1].nbytes if self.entries else 0


def _repeated(m: torch.nn.Module) -> bool:
    kids = [c for c in m.children()]
    return (
        isinstance(m, torch.nn.ModuleList)
        and len(kids) >= 2
        and len({type(c) for c in kids}) == 1
        and any(True for _ in kids[0].parameters())
    )


def find_blocks(model: torch.nn.Module, blocks: list[torch.nn.Module] | None = None) -> list[Block]:
    """The blocks of ``model`` (see the module documentation), in the order of its modules;
    raises ValueError naming the culprit for a user list that misses parameters or names a
    module twice, or blocks whose parameters overlap."""
    names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    groups: list[tuple[torch.nn.Module, list[torch.nn.Parameter], bool]] = []  # (module, params, layer)
    if blocks is None:

        def visit(m: torch.nn.Module) -> None:
            if _repeated(m):
                for c in m.children():
                    groups.append((c, list(c.parameters()), True))
                return
            own = [p for p in m._parameters.values() if p is not None]
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
            groups.append((m, list(m.parameters()), False))
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
    missing = [n for n, p in model.named_parameters() if id(p) not in owner]
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
            if e.param.dtype not in DTYPES:
                raise TypeError(f"{e.names[0]}: dtype {e.param.dtype} cannot be offloaded (float32, bfloat16, float16)")
        b.layout()
    return result
