"""``python -m offload_adam bench --gpu-placement``: the placements on a GPU, measured in one run.

A 1B Llama built from a config with random weights (hidden 2048, 16 layers, FFN 8192, 32 heads
with 8 KV heads, a 32000-token vocabulary, untied head: 1.1B parameters), in bf16 and quantized
int8 (torchao's ``Int8WeightOnlyConfig``, where torchao is importable), offloaded with
``gpu_budget_gb`` at the streaming ring plus a quarter of its own weights (that quarter resident,
the rest streamed or run on the CPU; the same budget under every placement), a
512-token prompt then 64 greedy tokens at batch 1, under each placement in turn:

- ``stream``: every call of a block not resident copies it to the GPU;
- ``cpu``: every such call runs on the CPU from the block's host bytes (the hidden states and the
  KV cache cross instead; quantized weights on the native kernel);
- ``auto``: per call, whichever the cost model says is cheaper (``weights/costs.py``).

Per case: time to first token (TTFT), decode tokens/s, peak GPU memory (``max_memory_allocated``
over the offload and the decode, less what was allocated before it), and of ``report()``: the
calls per phase and side, ``hidden_bytes``, ``kv_bytes``, ``h2d_bytes``, ``native_calls``; and
whether the tokens equal ``stream``'s of the same dtype (a CPU-run call rounds differently from
the GPU's kernels: tokens may part, which the flag shows). No target: these are the figures
``placement="auto"`` is judged by on a GPU. Each case is printed (and handed to ``progress``)
as it ends, so that a run stopped at its time limit keeps what it measured.

``--simulate`` runs the same code at tiny sizes on the simulated device (a dry run of the bench:
the figures mean nothing).
"""

from __future__ import annotations

import copy
import gc
from collections.abc import Callable
from typing import Any

import torch

from . import benchdev
from .weights_bench import _timed_generate

GiB = 1 << 30

FULL = {"hidden": 2048, "layers": 16, "ffn": 8192, "heads": 32, "kv_heads": 8, "vocab": 32000, "prompt": 512, "tokens": 64}
TINY = {"hidden": 64, "layers": 8, "ffn": 128, "heads": 4, "kv_heads": 2, "vocab": 256, "prompt": 16, "tokens": 4}
PLACEMENTS = ("stream", "cpu", "auto")


def llama(size: dict[str, int], seed: int = 0) -> torch.nn.Module:
    """A bf16 Llama of these dimensions on the CPU, random weights: N(0, 0.02) for the matrices,
    the norms' weights 1 (as transformers initializes them), built on the meta device (no
    initialization of 1B parameters in fp32 first)."""
    import transformers

    transformers.utils.logging.set_verbosity_error()
    cfg = transformers.LlamaConfig(
        num_hidden_layers=size["layers"], hidden_size=size["hidden"], intermediate_size=size["ffn"],
        num_attention_heads=size["heads"], num_key_value_heads=size["kv_heads"], vocab_size=size["vocab"],
        max_position_embeddings=max(2048, size.get("prompt", 0) + size.get("tokens", 0)), tie_word_embeddings=False,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    with torch.device("meta"):
        model: Any = transformers.LlamaForCausalLM(cfg)
    # drawn on the GPU where there is one (the CPU's generator draws one value at a time: 12 s for
    # 1B), then kept on the CPU
    where = "cuda" if torch.cuda.is_available() else "cpu"
    model = model.to(torch.bfloat16).to_empty(device=where)
    g = torch.Generator(device=where).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.02, generator=g)
            else:
                p.fill_(1.0)
    model = model.cpu()
    if where == "cuda":
        torch.cuda.empty_cache()
    model.model.rotary_emb = type(model.model.rotary_emb)(cfg)  # its inv_freq buffer, computed on the CPU
    return model.eval()


def weight_bytes(model: torch.nn.Module) -> int:
    """The bytes of the model's parameters as stored: a quantized one's inner tensors."""
    total = 0
    for p in model.parameters():
        if type(p) is torch.nn.Parameter:
            total += p.numel() * p.element_size()
        else:
            names, _ = p.__tensor_flatten__()  # type: ignore[attr-defined]
            total += sum(getattr(p, n).numel() * getattr(p, n).element_size() for n in names)
    return total


def budget_gb(model: torch.nn.Module, prefetch: int) -> float:
    """The ``gpu_budget_gb`` that keeps a quarter of ``model``'s weights resident beside the ring
    (and the buffers) ``placement="stream"`` makes; the same budget for every placement ("cpu"
    makes no general slots, and keeps more resident within it)."""
    from ..weights.blocks import find_blocks
    from ..weights.plan import describe, ring_bytes

    blocks = describe(find_blocks(model))
    ring = ring_bytes(blocks, [b.index for b in blocks], prefetch)
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    return (ring + buffers + 0.25 * weight_bytes(model)) / GiB


def case(base: torch.nn.Module, dev: torch.device, placement: str, x: torch.Tensor, tokens: int, prefetch: int = 2) -> dict[str, Any]:
    """One placement on a copy of ``base``, a quarter of its weights resident on ``dev``."""
    import offload_adam

    model = copy.deepcopy(base)
    budget = budget_gb(model, prefetch)
    gc.collect()
    benchdev.synchronize(dev)
    before = benchdev.allocated(dev)
    benchdev.reset_peak(dev)
    h = offload_adam.offload_weights(model, dev, placement=placement, gpu_budget_gb=budget, prefetch=prefetch)
    try:
        _timed_generate(model, x[:, :8], 2)  # the first forward records the order (and "auto" measures this machine)
        h.reset_stats()
        ttft, rate, toks = _timed_generate(model, x, tokens)
        top = benchdev.peak(dev)
        r = h.report()
    finally:
        h.close()
    del model
    return {
        "placement": placement, "gpu_budget_gb": budget, "ttft_s": ttft, "tokens_per_s": rate,
        "peak_gpu_bytes": None if top is None or before is None else top - before,
        "gpu_resident_bytes": r["gpu_resident_bytes"], "ring_bytes": r["ring_bytes"], "calls": r["calls"],
        "h2d_bytes": r["h2d_bytes"], "hidden_bytes": r["hidden_bytes"], "kv_bytes": r["kv_bytes"],
        "native_calls": r["native_calls"], "torch_calls": r["torch_calls"], "cpu_s": r["cpu_s"], "tokens": toks,
    }  # fmt: skip


def _line(dtype: str, c: dict[str, Any]) -> str:
    calls = " ".join(f"{ph} {v.get('stream', 0)}s/{v.get('cpu', 0)}c" for ph, v in c["calls"].items())
    return (
        f"{dtype:<5} {c['placement']:<7} TTFT {c['ttft_s'] * 1e3:8.1f} ms  decode {c['tokens_per_s']:7.2f} tokens/s  "
        f"peak GPU {benchdev.gib(c['peak_gpu_bytes']):>9}  resident {c['gpu_resident_bytes'] / GiB:5.2f} GiB  h2d {c['h2d_bytes'] / GiB:6.2f} GiB  hidden {c['hidden_bytes'] / 2**20:7.1f} MiB  "
        f"kv {c['kv_bytes'] / 2**20:7.1f} MiB  native calls {c['native_calls']:5d}  calls (stream/cpu) {calls}  "
        f"tokens {'same as stream' if c['same_tokens'] else 'DIFFER from stream'}"
    )


def run(simulate: bool = False, progress: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Every placement in bf16, then in int8 (torchao importable); ``progress`` gets the results so
    far after each case."""
    size = TINY if simulate else FULL
    base = llama(size)
    params = sum(p.numel() for p in base.parameters())
    results: dict[str, Any] = {"params": params, "size": size, "cases": []}
    models: list[tuple[str, Callable[[], torch.nn.Module]]] = [("bf16", lambda: base)]
    try:
        from torchao import quantization as tq  # type: ignore[import-untyped]

        def int8() -> torch.nn.Module:
            m = copy.deepcopy(base)
            tq.quantize_(m, tq.Int8WeightOnlyConfig())
            return m

        models.append(("int8", int8))
    except Exception as e:  # not installed, or a wheel built for another torch that fails to import
        print(f"int8: not measured (torchao does not import: {type(e).__name__}: {e})")
    with benchdev.device(simulate) as dev:
        where = "the simulated device (a dry run: the figures mean nothing)" if simulate else torch.cuda.get_device_name(dev)
        print(
            f"GPU placement bench: Llama {size['layers']}x{size['hidden']} (FFN {size['ffn']}, vocab {size['vocab']}), "
            f"{params / 1e6:.1f}M parameters; a quarter of the weights resident; prompt {size['prompt']} tokens, "
            f"{size['tokens']} greedy tokens, batch 1; on {where}, {torch.get_num_threads()} CPU threads",
            flush=True,
        )
        x = torch.randint(1, size["vocab"], (1, size["prompt"]), generator=torch.Generator().manual_seed(1)).to(dev)
        for dtype, make in models:
            try:
                model = make()
            except Exception as e:  # torchao's quantization failing here: said, the bf16 cases kept
                if dtype == "bf16":
                    raise
                print(f"{dtype}: not measured (quantizing failed: {type(e).__name__}: {e})", flush=True)
                continue
            results[f"{dtype}_weights_bytes"] = weight_bytes(model)
            stream: torch.Tensor | None = None
            for placement in PLACEMENTS:
                c = case(model, dev, placement, x, size["tokens"])
                toks = c.pop("tokens")
                if placement == "stream":
                    stream = toks
                c["same_tokens"] = bool(stream is not None and torch.equal(toks, stream))
                c["dtype"] = dtype
                results["cases"].append(c)
                print(_line(dtype, c), flush=True)
                if progress is not None:
                    progress(results)
            del model
    return results
