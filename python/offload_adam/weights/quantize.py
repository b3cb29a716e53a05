"""Quantize on load: ``offload_weights(model, checkpoint=..., quantize=config)``.

Each block's full-precision tensors are read from the checkpoint into one host buffer of the
block, its modules quantized (a torchao config through torchao's ``quantize_``, imported only
then; or the user's callable, applied to each module of the block), and the buffer dropped: the
parameters left unquantized (norms, embeddings a config skips) get their own copy first. The
host so holds the quantized blocks done so far and one full-precision block (with what the
quantization makes while it runs), never the full-precision model; the offload then stores the
quantized model block by block as it stores any model built on the host. Without a checkpoint
the model's own weights are quantized, block by block, in place; their full-precision tensors
are kept until the offload is complete, so that a failure puts them back (``undo.py``): the host
then holds the model and its quantized copy at once. A failure (``quantize=`` raising at some
block, or leaving a dtype that cannot be offloaded) leaves every parameter as it was: on the
meta device when read from a checkpoint.

What a config does to tied parameters is its own: torchao quantizes a head's ``Linear`` and
leaves the embedding it was tied to, as ``quantize_`` on the whole model does.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from typing import Any

import torch

from ..runtime.pinned import trim_host_memory
from .blocks import DTYPES, find_blocks, wrapped
from .checkpoint import Checkpoint
from .undo import Undo

# A function of (module, the ids of the parameters resident= keeps): quantizes the module's
# linears, leaving the modules that hold kept parameters (a LoRA adapter's lora_A/lora_B linears,
# which a torchao config would quantize with the base).
Quantizer = Callable[[torch.nn.Module, frozenset[int]], Any]


def _holds_kept(module: torch.nn.Module, keep: frozenset[int]) -> bool:
    return any(id(p) in keep for p in module.parameters(recurse=False))


def host_kernels(config: Any) -> Any:
    """``config`` with torchao's own kernels where it would pick them by the GPU: a config's
    ``kernel_preference`` AUTO chooses mslk's quantize kernel when mslk is installed on a GPU of
    compute capability 9.0 or more, and would run it on the host tensors ``quantize=`` hands it
    (CUDA review, second pass, hazard 9). The weight keeps TORCH for its matmuls."""
    pref = getattr(config, "kernel_preference", None)
    if pref is None or getattr(pref, "name", "") != "AUTO" or not dataclasses.is_dataclass(config):
        return config
    return dataclasses.replace(config, kernel_preference=type(pref).TORCH)  # type: ignore[type-var]


def quantizer(quantize: Any) -> Quantizer:
    """``quantize`` as a function of a module: a callable as it is; anything else is a torchao
    config, applied by torchao's ``quantize_``. Raises, naming ``quantize``, before anything
    changes: ValueError if torchao is not installed; TypeError for a class (a config's, not an
    instance) and for what torchao's ``quantize_`` does not take as a config (tried on an empty
    module)."""
    if isinstance(quantize, type):
        name = quantize.__name__
        raise TypeError(
            f"quantize: {name} is a class: pass an instance, {name}() (a torchao config), or a function of a module"
        )
    if callable(quantize):
        user = quantize
        return lambda module, keep: user(module)
    try:
        quantize_ = importlib.import_module("torchao.quantization").quantize_
    except ImportError as err:
        raise ValueError(
            f"quantize: {type(quantize).__name__} is not callable, so it is taken for a torchao config, and torchao "
            f"cannot be imported ({err}): pip install torchao, or pass a function of a module"
        ) from None
    try:
        quantize_(torch.nn.Module(), quantize)  # (a config changes nothing here; torchao refuses anything else)
    except Exception as err:
        raise TypeError(
            f"quantize: {quantize!r} (of type {type(quantize).__name__}) is neither a torchao config (an instance, such as "
            "torchao.quantization.Int8WeightOnlyConfig()) nor a function of a module"
        ) from err
    config = host_kernels(quantize)
    linear = importlib.import_module("torchao.quantization.quant_api")._is_linear  # quantize_'s default filter
    return lambda module, keep: quantize_(module, config, filter_fn=lambda m, fqn: linear(m) and not _holds_kept(m, keep))


def quantize_blocks(
    model: torch.nn.Module, blocks: list[torch.nn.Module] | None, checkpoint: Any, fn: Quantizer, keep: frozenset[int],
    undo: Undo,
) -> None:  # fmt: skip
    """Quantizes ``model`` block by block, each block's weights read from ``checkpoint`` first
    (if given) into one buffer (see the module documentation); ``keep``: parameters in no block.
    ``undo`` records how to put each parameter back: on the meta device (read from the
    checkpoint), else its full-precision tensors, kept. An error of ``fn`` gets a note naming the
    block; a parameter ``fn`` leaves in a dtype that cannot be offloaded is a TypeError naming
    it and ``quantize``."""
    found = find_blocks(model, blocks, keep)
    names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    ck = Checkpoint(checkpoint) if checkpoint is not None else None
    try:
        where = ck.locate(found, set(model.state_dict(keep_vars=True))) if ck is not None else None
        for b in found:
            if ck is not None:
                buf = torch.empty(b.nbytes, dtype=torch.uint8)
                ck.read_block(b, where, buf)  # type: ignore[arg-type]
                for e in b.entries:
                    undo.keep(e.param, e.attach(e.views(buf)))  # (back to the meta device)
            for m in b.modules:
                for p in m.parameters():
                    undo.hold(p)  # (the full-precision tensors of a model on the host)
            kept = {n for m in b.modules for n, p in m.named_parameters(prefix=names.get(id(m), "")) if id(p) in keep}
            try:
                for m in b.modules:
                    fn(m, keep)
            except Exception as err:
                err.add_note(f"offload_adam: raised by quantize= on block {b.name}; the model is as it was before offload_weights")
                raise
            for m in b.modules:
                for n, p in m.named_parameters(prefix=names.get(id(m), "")):
                    if wrapped(p) and n in kept:
                        raise TypeError(
                            f"quantize: it quantized {n}, which resident= keeps on the device as a plain tensor: "
                            "leave the modules of kept parameters out of quantize= (a torchao config does)"
                        )
            for m in b.modules:
                for n, p in m.named_parameters(prefix=names.get(id(m), "")):
                    if not wrapped(p) and p.dtype not in DTYPES:
                        raise TypeError(
                            f"quantize: {n} is {p.dtype} after it: offload_weights stores {', '.join(map(str, DTYPES))} "
                            "tensors and quantized ones (tensor subclasses that flatten, as torchao's)"
                        )
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
