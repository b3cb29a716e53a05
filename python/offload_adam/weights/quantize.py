"""Quantize on load: ``offload_weights(model, checkpoint=..., quantize=config)``.

Each block's full-precision tensors are read from the checkpoint into one host buffer of the
block, its modules quantized (a torchao config through torchao's ``quantize_``, imported only
then; or the user's callable, applied to each module of the block), and the buffer dropped: the
parameters left unquantized (norms, embeddings a config skips) get their own copy first. The
host so holds the quantized blocks done so far and one full-precision block (with what the
quantization makes while it runs), never the full-precision model; the offload then stores the
quantized model block by block as it stores any model built on the host. Without a checkpoint
the model's own weights are quantized, block by block, in place.

What a config does to tied parameters is its own: torchao quantizes a head's ``Linear`` and
leaves the embedding it was tied to, as ``quantize_`` on the whole model does.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch

from ..runtime.pinned import trim_host_memory
from .blocks import find_blocks
from .checkpoint import Checkpoint

Quantizer = Callable[[torch.nn.Module], Any]


def quantizer(quantize: Any) -> Quantizer:
    """``quantize`` as a function of a module: a callable as it is; anything else is a torchao
    config, applied by torchao's ``quantize_``. Raises ValueError naming ``quantize`` if torchao
    is not installed."""
    if callable(quantize):
        fn: Quantizer = quantize
        return fn
    try:
        quantize_ = importlib.import_module("torchao.quantization").quantize_
    except ImportError as err:
        raise ValueError(
            f"quantize: {type(quantize).__name__} is not callable, so it is taken for a torchao config, and torchao "
            f"cannot be imported ({err}): pip install torchao, or pass a function of a module"
        ) from None
    return lambda module: quantize_(module, quantize)


def quantize_blocks(
    model: torch.nn.Module, blocks: list[torch.nn.Module] | None, checkpoint: Any, fn: Quantizer, keep: frozenset[int] = frozenset()
) -> None:  # fmt: skip
    """Quantizes ``model`` block by block, each block's weights read from ``checkpoint`` first
    (if given) into one buffer (see the module documentation); ``keep``: parameters in no block."""
    found = find_blocks(model, blocks, keep)
    ck = Checkpoint(checkpoint) if checkpoint is not None else None
    try:
        where = ck.locate(found, set(model.state_dict(keep_vars=True))) if ck is not None else None
        for b in found:
            if ck is not None:
                buf = torch.empty(b.nbytes, dtype=torch.uint8)
                ck.read_block(b, where, buf)  # type: ignore[arg-type]
                for e in b.entries:
                    e.attach(e.views(buf))
            for m in b.modules:
                fn(m)
            if ck is not None:
                # Off the buffer, so that it goes: the parameters the quantization left get their
                # own copy, those it replaced let go of it.
                live = {id(p) for m in b.modules for p in m.parameters()}
                for e in b.entries:
                    if not e.wrapped and e.param.untyped_storage().data_ptr() == buf.data_ptr():
                        e.param.data = e.param.data.clone() if id(e.param) in live else e.param.data.new_empty(0)
                del buf
            b.entries.clear()
            trim_host_memory()
    finally:
        if ck is not None:
            ck.close()
