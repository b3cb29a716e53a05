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
                hit = next((self.tensors[n] for n in e.names if n in self.tensors), None)
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
