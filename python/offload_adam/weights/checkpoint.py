"""Weights loaded from a checkpoint straight into their storage, block by block.

``checkpoint=`` is a ``.safetensors`` file, or a folder (as ``save_pretrained`` writes it) with
``model.safetensors`` or a sharded ``model.safetensors.index.json``. Each parameter is found
under one of its names (a tied parameter under any), checked (present, same shape and dtype)
before anything is read, and its bytes are read by the Rust I/O engine from the file straight
into the block's place: the pinned host copy, an NVMe staging slot, or a transfer buffer for a
resident block. Nothing is materialised whole: a model larger than RAM needs the window only.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from .. import _native
from ..runtime.safetensors import Entry as TensorEntry
from ..runtime.safetensors import Reader, json_kind
from .blocks import Block

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


@dataclass
class Located:
    key: str  # its name in the checkpoint
    path: str
    entry: TensorEntry
    base: int  # where the file's data section starts


def checkpoint_path(checkpoint: Any) -> str:
    """``checkpoint=`` as a path, or a TypeError naming the argument."""
    if isinstance(checkpoint, (str, os.PathLike)):
        path = os.fspath(checkpoint)
        if isinstance(path, str):
            return path
    raise TypeError(
        f"checkpoint must be a path (str or os.PathLike) to a .safetensors file or a folder, got {type(checkpoint).__name__}"
    )


def shards(folder: str, index: str) -> list[str]:
    """The files a sharded checkpoint's index names, checked: the index is a JSON object whose
    ``weight_map`` maps tensor names to file names inside ``folder``. A file outside it (an
    absolute path, or one climbing out with ``..``) is refused: the package opens only what the
    user named. Only the names are checked, not where symbolic links lead (a Hugging Face cache's
    snapshot folder links to blobs outside it)."""
    try:
        with open(index, "rb") as f:
            doc = json.loads(f.read().decode("utf-8"))
    except ValueError as err:
        raise ValueError(f"checkpoint: {index} is not JSON ({err})") from None
    if not isinstance(doc, dict):
        raise ValueError(f"checkpoint: {index} is {json_kind(doc)}, not a JSON object with a weight_map")
    weight_map = doc.get("weight_map")
    if not isinstance(weight_map, dict):
        got = "has no weight_map" if weight_map is None else f"has a weight_map that is {json_kind(weight_map)}"
        raise ValueError(f"checkpoint: {index} {got}, not an object of tensor names to file names")
    files: set[str] = set()
    for name, file in weight_map.items():
        if not isinstance(file, str):
            raise ValueError(f"checkpoint: {index}: weight_map[{name!r}] is {json_kind(file)}, not a file name")
        if os.path.isabs(file) or os.path.normpath(file).split(os.sep)[0] == os.pardir:
            raise ValueError(
                f"checkpoint: {index}: weight_map[{name!r}] names {file!r}, outside the checkpoint's folder: "
                "refused (only files inside the folder given are opened)"
            )
        files.add(file)
    return sorted(files)


class Checkpoint:
    """The tensors of a checkpoint and where their bytes are (see the module documentation).
    Every file's header is read and checked here (``runtime.safetensors.Reader``), before any
    tensor is: a tensor in two shards is refused too."""

    def __init__(self, path: Any) -> None:
        path = checkpoint_path(path)
        if os.path.isdir(path):
            index = os.path.join(path, INDEX)
            if os.path.isfile(index):
                files = shards(path, index)
            elif os.path.isfile(os.path.join(path, SINGLE)):
                files = [SINGLE]
            else:
                raise ValueError(f"checkpoint: {path!r} has neither {INDEX} nor {SINGLE}")
            files = [os.path.join(path, f) for f in files]
        elif os.path.isfile(path):
            files = [path]
        else:
            raise ValueError(f"checkpoint: {path!r} is neither a file nor a directory")
        self.path = path
        self.tensors: dict[str, Located] = {}
        for fp in files:
            if not os.path.isfile(fp):
                raise ValueError(f"checkpoint: shard {fp!r} of {path!r} is missing")
            r = Reader(fp)
            try:
                for name, e in r.entries.items():
                    if name in self.tensors:
                        raise ValueError(f"checkpoint: tensor {name!r} is in two files of {path!r}: {self.tensors[name].path} and {fp}")
                    self.tensors[name] = Located(name, fp, e, r.base)
            finally:
                r.close()
        self._io: _native.IoEngine | None = None  # made at the first read
        self._files: dict[str, int] = {}

    @property
    def io(self) -> _native.IoEngine:
        if self._io is None:
            self._io = _native.IoEngine()
        return self._io

    def locate_experts(self, layouts: list[Any]) -> ExpertSources:
        """Where each routed expert of ``layouts`` (``expertstore.ExpertsLayout``) is: each fused
        parameter under its own name (``[E, ...]``, an expert's slice read alone), or per expert
        under the names of ``PER_EXPERT`` (gate then up concatenated, as transformers fuses them).
        Raises one error listing every problem; a quantized parameter is refused (build the model
        unquantized)."""
        out = ExpertSources()
        bad: list[str] = []
        for lay in layouts:
            for ep in lay.params:
                if ep.kind is not None or len(ep.parts) != 1:
                    bad.append(f"{lay.name}.{ep.name} is a {ep.kind.__name__ if ep.kind else 'quantized tensor'}: build the model unquantized to fill its experts from a checkpoint")
                    continue
                q = ep.parts[0]
                transposed = bool(getattr(lay.module, "is_transposed", False))
                per, why = _locate_param(self.tensors, lay.name, lay.experts, ep.name, q.dtype, tuple(q.shape), q.offset, transposed)
                if per is None:
                    bad.append(str(why))
                    continue
                out.pieces[(lay.index, ep.name)] = per
                out.used.update(loc.key for pieces in per for loc, *_ in pieces)
        if bad:
            raise ValueError(f"checkpoint {self.path!r} does not match the model's routed experts:\n  " + "\n  ".join(bad))
        return out

    def read_pieces(self, pieces: list[Piece], unit: Tensor) -> None:
        """One expert's ``pieces`` read into ``unit`` (its bytes, uint8), each at its offset."""
        reqs = [(False, self._file(loc.path), unit[at : at + n], loc.base + loc.entry.begin + off) for loc, off, n, at in pieces]
        try:
            self.io.submit(reqs).wait()
        except OSError as err:
            raise OSError(err.errno, f"offload_adam: reading the checkpoint's routed experts ({pieces[0][0].key}): {err.strerror}") from None

    def locate(self, blocks: list[Block], known: set[str]) -> dict[int, Located]:
        """Each parameter's tensor (by ``id``), checked: present under one of its names, with
        its shape and dtype. ``known``: every name of the model's state (its parameters, tied
        ones under each name, and its buffers). Raises one error listing every problem, as
        torch's strict ``load_state_dict`` does: missing and unexpected tensors, shape and dtype
        mismatches."""
        out: dict[int, Located] = {}
        missing: list[str] = []
        bad: list[str] = []
        dtypes: set[tuple[Any, Any]] = set()
        for b in blocks:
            for e in b.entries:
                hit = next((self.tensors[a] for n in e.names for a in _prefixes(n) if a in self.tensors), None)
                if hit is None:
                    missing.append(e.names[0])
                    continue
                p = e.param
                if e.wrapped:
                    bad.append(
                        f"{e.names[0]!r} is a {type(p).__name__} (a quantized tensor's parts) and {hit.key!r} one "
                        f"{hit.entry.dtype} tensor: build the model unquantized and pass quantize= to quantize it as it loads"
                    )
                elif tuple(hit.entry.shape) != tuple(p.shape):
                    bad.append(
                        f"size mismatch for {hit.key!r}: the checkpoint has {hit.entry.dtype} of shape "
                        f"{tuple(hit.entry.shape)}, the model's parameter {e.names[0]!r} is {p.dtype} of shape {tuple(p.shape)}"
                    )
                elif hit.entry.dtype != p.dtype:
                    bad.append(
                        f"dtype mismatch for {hit.key!r}: the checkpoint has {hit.entry.dtype} of shape "
                        f"{tuple(hit.entry.shape)}, the model's parameter {e.names[0]!r} is {p.dtype} of shape {tuple(p.shape)}"
                    )
                    dtypes.add((hit.entry.dtype, p.dtype))
                else:
                    out[id(p)] = hit
        known = known | {a for n in known for a in _prefixes(n)}
        unexpected = sorted(k for k in self.tensors if k not in known)
        if missing or unexpected or bad:
            lines = []
            if missing:
                lines.append("missing tensor(s) for parameter(s): " + ", ".join(map(repr, missing)))
            if unexpected:
                lines.append("unexpected tensor(s), in no parameter or buffer of the model: " + ", ".join(map(repr, unexpected)))
            lines += bad
            if dtypes:
                want = ", ".join(sorted({str(c) for c, _ in dtypes}))
                lines.append(
                    f"to load a checkpoint in {want}, build the empty model in that dtype (e.g. "
                    f"`with init_empty_weights(): model = cls(config).to({want})`, or from_config(config, torch_dtype=...)): "
                    "offload_weights does not convert"
                )
            raise ValueError(f"checkpoint {self.path!r} does not match the model:\n  " + "\n  ".join(lines))
        return out

    def _file(self, path: str) -> int:
        fid = self._files.get(path)
        if fid is None:
            fid, _ = self.io.open_read(path)
            self._files[path] = fid
        return fid

    def read_block(self, b: Block, where: dict[int, Located], dst: Tensor) -> None:
        """Reads block ``b``'s parameters into ``dst`` (its bytes, uint8), each at its offset."""
        reqs = []
        for e in b.entries:
            loc = where[id(e.param)]
            reqs.append((False, self._file(loc.path), dst[e.offset : e.offset + e.nbytes], loc.base + loc.entry.begin))
        try:
            self.io.submit(reqs).wait()
        except OSError as err:
            raise OSError(err.errno, f"offload_adam: reading the checkpoint for block {b.name}: {err.strerror}") from None

    def close(self) -> None:
        for fid in self._files.values():
            self.io.close_file(fid)
        self._files = {}
        if self._io is not None:
            self._io.close()  # its threads and io_uring too, now rather than at garbage collection
        self._io = None


# -- routed experts (experts.py, expertstore.py) ---------------------------------------------------

# The per-expert names real checkpoints give a fused experts parameter's expert (transformers 5
# fuses them as it loads, by its conversion mapping: ``MergeModulelist(dim=0)`` then
# ``Concatenate(dim=1)`` of the gate's and the up projection's lists, gate first): for each fused
# parameter, the alternatives, each the names of the per-expert tensors concatenated along their
# first dimension (Qwen2/3-MoE, DeepSeek-V2/V3, OLMoE, GLM-4-MoE...: gate_proj, up_proj,
# down_proj; Mixtral, MiniMax: w1, w3, w2).
PER_EXPERT: dict[str, tuple[tuple[str, ...], ...]] = {
    "gate_up_proj": (("gate_proj.weight", "up_proj.weight"), ("w1.weight", "w3.weight")),
    "down_proj": (("down_proj.weight",), ("w2.weight",)),
    "up_proj": (("up_proj.weight",), ("w3.weight",)),
}
# Module renamings of those checkpoints (the mapping's ``WeightRenaming``): Mixtral's hub files
# name the sparse block ``block_sparse_moe``, transformers 5's model ``mlp``.
RENAMES = ((".mlp.", ".block_sparse_moe."),)

# Where one expert's bytes of one fused parameter are: (tensor, its byte offset in the tensor,
# bytes, the byte offset in the expert's unit).
Piece = tuple[Located, int, int, int]


def _prefixes(module: str) -> list[str]:
    """``module`` (a module's or tensor's name) and its names in the checkpoints of ``RENAMES``."""
    out = [module]
    for ours, theirs in RENAMES:
        dotted = f".{module}."
        if ours in dotted:
            out.append(dotted.replace(ours, theirs)[1:-1])
    return out


def _nbytes(dtype: Any, shape: tuple[int, ...]) -> int:
    import torch

    n = 1
    for s in shape:
        n *= s
    return n * torch.empty((), dtype=dtype).element_size()


class ExpertSources:
    """Where each routed expert's bytes are in a checkpoint (see :meth:`Checkpoint.locate_experts`):
    ``pieces[(layout, parameter)][e]``, read one expert at a time; ``used``, the checkpoint's
    names they take."""

    def __init__(self) -> None:
        self.pieces: dict[tuple[int, str], list[list[Piece]]] = {}
        self.used: set[str] = set()


def _locate_param(tensors: dict[str, Located], module: str, experts: int, name: str, dtype: Any,
                  shape: tuple[int, ...], offset: int, transposed: bool) -> tuple[list[list[Piece]] | None, str | None]:  # fmt: skip
    """One fused parameter's pieces, per expert: the fused tensor under the model's own name, or
    the per-expert tensors; (None, why) if neither fits."""
    full = f"{module}.{name}"
    one = _nbytes(dtype, shape)
    hit = tensors.get(full)
    if hit is not None:
        if tuple(hit.entry.shape) != (experts, *shape) or hit.entry.dtype != dtype:
            return None, (
                f"{'size' if tuple(hit.entry.shape) != (experts, *shape) else 'dtype'} mismatch for {full!r}: the checkpoint has "
                f"{hit.entry.dtype} of shape {tuple(hit.entry.shape)}, the model's parameter is {dtype} of shape {(experts, *shape)}"
            )
        return [[(hit, e * one, one, offset)] for e in range(experts)], None
    for prefix in _prefixes(module):
        for names in PER_EXPERT.get(name, ()):
            if f"{prefix}.0.{names[0]}" not in tensors:
                continue
            if transposed or len(shape) != 2 or shape[0] % len(names):
                return None, (
                    f"{full}: the checkpoint has it per expert ({prefix}.0.{names[0]}, ...) and the model's experts are "
                    f"{'transposed' if transposed else f'of shape {shape}'}: only [E, out, in] experts are filled from per-expert tensors"
                )
            each = (shape[0] // len(names), shape[1])
            per: list[list[Piece]] = []
            for e in range(experts):
                pieces: list[Piece] = []
                for i, n in enumerate(names):
                    key = f"{prefix}.{e}.{n}"
                    loc = tensors.get(key)
                    if loc is None:
                        return None, f"missing tensor {key!r} for the routed experts parameter {full!r} (found per expert)"
                    if tuple(loc.entry.shape) != each or loc.entry.dtype != dtype:
                        return None, (
                            f"mismatch for {key!r}: the checkpoint has {loc.entry.dtype} of shape {tuple(loc.entry.shape)}, "
                            f"expert {e}'s part of {full!r} is {dtype} of shape {each}"
                        )
                    pieces.append((loc, 0, one // len(names), offset + i * (one // len(names))))
                per.append(pieces)
            return per, None
    return None, f"missing tensor(s) for the routed experts parameter {full!r} (neither fused nor per expert)"
