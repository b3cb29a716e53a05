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
from ..runtime.safetensors import Reader
from .blocks import Block

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


@dataclass
class Located:
    key: str  # its name in the checkpoint
    path: str
    entry: TensorEntry
    base: int  # where the file's data section starts


class Checkpoint:
    """The tensors of a checkpoint and where their bytes are (see the module documentation).
    Every file's header is read and checked here (``runtime.safetensors.Reader``), before any
    tensor is."""

    def __init__(self, path: Any) -> None:
        path = os.fspath(path)
        if os.path.isdir(path):
            index = os.path.join(path, INDEX)
            if os.path.isfile(index):
                with open(index) as f:
                    weight_map = json.load(f).get("weight_map")
                if not isinstance(weight_map, dict):
                    raise ValueError(f"checkpoint: {index} has no weight_map")
                files = sorted(set(weight_map.values()))
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
        self._io = None
