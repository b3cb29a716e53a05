"""``python -m offload_adam bench --weights DIR``: weights offloaded, measured in the same run.

(a) The weights' NVMe read path against this disk's raw ``O_DIRECT`` read speed: the blocks of
    a bf16 model stored under DIR (``storage="nvme"``) are delivered into the pinned staging ring
    as the streamer asks for them (read ahead ``prefetch + 1`` blocks, a CRC-32C checked per
    block), round after round interleaved with a raw sequential read of the same file with the
    same I/O engine (large requests, all queued); the figure is the median of the per-round
    ratios of bytes per second. Target: at least 0.9 of raw.
(b) On a GPU: time to first token and tokens/s of a Llama-style model at batch 1 with every
    block streamed, ours (``offload_weights``, storage cpu) against accelerate's ``cpu_offload``
    and diffusers' ``apply_group_offloading(..., use_stream=True)``, on the same model and prompt,
    in the same process, beside the model resident on the GPU, and the host-to-device bound
    (bandwidth / streamed bytes per token). Per contender also its peak GPU memory (what it holds
    between calls plus the most a decode adds: ``torch.cuda.max_memory_allocated``) and whether
    its greedy tokens equal the resident model's. Targets: at least 1.5x the best peer, within
    1.1x of the bound. Without a GPU, owed; ``--simulate`` runs it at tiny sizes on the simulated
    device (a dry run of the bench).
"""

from __future__ import annotations

import copy
import statistics
import time
from typing import Any, cast

import torch

from ..runtime.pages import ALIGN, aligned_empty
from ..weights.blocks import find_blocks
from ..weights.storage import NvmeWeights
from . import benchdev


def _layers(nbytes: float, d: int = 2048) -> torch.nn.Module:
    """A bf16 stack of Llama-sized MLP layers of about ``nbytes`` in all (uninitialized)."""
    per = 3 * d * 4 * d * 2
    n = max(2, int(nbytes // per))
    return torch.nn.ModuleList(
        torch.nn.Sequential(
            torch.nn.Linear(d, 4 * d, bias=False, dtype=torch.bfloat16, device="meta"),
            torch.nn.Linear(d, 4 * d, bias=False, dtype=torch.bfloat16, device="meta"),
            torch.nn.Linear(4 * d, d, bias=False, dtype=torch.bfloat16, device="meta"),
        )
        for _ in range(n)
    )


def read_path(nvme_dir: str, *, gb: float, prefetch: int, rounds: int) -> dict[str, Any]:
    model = _layers(gb * 1e9).to_empty(device="cpu")
    for p in model.parameters():
        p.data.fill_(0.5)
    blocks = find_blocks(model)
    src = NvmeWeights(None, None, nvme_dir, blocks, prefetch + 2)  # the host consumes the slots: no device
    try:
        for b in blocks:
            dst = src.staging(b)
            for e in b.entries:
                e.view(dst).copy_(e.param.detach())
            src.store_block(b)
        del model
        total = sum(-(-b.nbytes // ALIGN) * ALIGN for b in blocks)
        eng = src.io
        reqs_raw = []
        buf = aligned_empty(64 << 20, torch.uint8)
        req = 8 << 20
        for k in range(total // req):
            o = (k % 8) * req
            reqs_raw.append((False, src.file.fid, buf[o : o + req], k * req))
        raw_b = (total // req) * req
        ours: list[float] = []
        raw: list[float] = []
        ratio: list[float] = []
        for r in range(rounds + 1):
            t0 = time.perf_counter()
            eng.submit(reqs_raw).wait()
            t_raw = time.perf_counter() - t0
            t0 = time.perf_counter()
            for i, b in enumerate(blocks):
                for j in range(i + 1, min(i + prefetch + 2, len(blocks))):
                    if not src.start(blocks[j]):
                        break
                src.host(b)
                src.done(b, None)
            t_ours = time.perf_counter() - t0
            if r == 0:
                continue  # warm-up
            raw.append(raw_b / t_raw)
            ours.append(total / t_ours)
            ratio.append((total / t_ours) / (raw_b / t_raw))
        return {
            "bytes": total, "blocks": len(blocks), "prefetch": prefetch, "direct": eng.direct(src.file.fid),
            "backend": eng.backend, "raw_Bps": statistics.median(raw), "ours_Bps": statistics.median(ours),
            "ratio": statistics.median(ratio),
        }  # fmt: skip
    finally:
        src.close()


# -- (b) on a GPU ---------------------------------------------------------------------------------


def _llama(layers: int, d: int, vocab: int = 32000) -> torch.nn.Module:
    """A bf16 Llama, random weights, built without initializing it on the CPU first (seconds at 1B)."""
    from .gpu_placement_bench import llama

    ffn = int(2.6875 * d) // 256 * 256
    return llama({"hidden": d, "layers": layers, "ffn": ffn, "heads": d // 128, "kv_heads": max(1, d // 512), "vocab": vocab})


def _cache_key(model: torch.nn.Module) -> str:
    """The KV cache's argument (and output) name: ``cache`` in recent transformers, else
    ``past_key_values``."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _timed_generate(model: torch.nn.Module, x: torch.Tensor, tokens: int) -> tuple[float, float, torch.Tensor]:
    """(time to first token, tokens/s after it, the tokens) of a greedy decode with the KV cache."""
    dev = x.device
    with torch.no_grad():
        benchdev.synchronize(dev)
        t0 = time.perf_counter()
        out = model(input_ids=x, use_cache=True)
        nxt = out.logits[:, -1:].argmax(-1)
        benchdev.synchronize(dev)
        ttft = time.perf_counter() - t0
        key = _cache_key(model)
        past, got = out[key], [nxt]
        t1 = time.perf_counter()
        for _ in range(tokens - 1):
            out = model(input_ids=nxt, use_cache=True, **{key: past})
            past = out[key]
            nxt = out.logits[:, -1:].argmax(-1)
            got.append(nxt)
        benchdev.synchronize(dev)
        return ttft, (tokens - 1) / max(time.perf_counter() - t1, 1e-9), torch.cat(got, 1).cpu()


RESIDENT = "resident on the GPU, plain torch"
OURS = "offload_adam offload_weights"


def gpu_contenders(
    dev: torch.device, *, layers: int, d: int, tokens: int, prompt: int, prefetch: int, vocab: int = 32000, rounds: int = 3
) -> dict[str, Any]:  # fmt: skip
    """(b) on ``dev``: each contender on a copy of the same model, interleaved rounds. Per
    contender: median TTFT and tokens/s, its peak device memory (what it holds between calls plus
    the most a decode added; None off CUDA) and whether its tokens equal the resident model's.
    The resident model and ours must run; a peer that is not installed or fails is reported."""
    from ..weights import offload_weights

    base = _llama(layers, d, vocab)
    x = torch.randint(1, vocab, (1, prompt), device=dev)

    def resident(m: torch.nn.Module) -> Any:
        m.to(dev)
        return None

    def ours(m: torch.nn.Module) -> Any:
        return offload_weights(m, dev, prefetch=prefetch)

    def accel(m: torch.nn.Module) -> Any:
        from accelerate import cpu_offload  # type: ignore[import-untyped]

        return cpu_offload(m, execution_device=dev)

    def group_blocks(m: torch.nn.Module) -> Any:
        # block_level groups the top-level ModuleList's children: the decoder layers are under
        # m.model; the head is a leaf group of its own.
        from diffusers.hooks import apply_group_offloading

        inner, head = cast(torch.nn.Module, m.model), cast(torch.nn.Module, m.lm_head)
        apply_group_offloading(inner, onload_device=dev, offload_type="block_level", num_blocks_per_group=1, use_stream=True)
        apply_group_offloading(head, onload_device=dev, offload_type="leaf_level", use_stream=True)
        return None

    def group_leaves(m: torch.nn.Module) -> Any:
        from diffusers.hooks import apply_group_offloading

        apply_group_offloading(m, onload_device=dev, offload_type="leaf_level", use_stream=True)
        return None

    handles: dict[str, tuple[torch.nn.Module, Any]] = {}
    held: dict[str, int | None] = {}
    peers = (
        (RESIDENT, resident), (OURS, ours), ("accelerate cpu_offload", accel),
        ("diffusers group offloading, block_level", group_blocks), ("diffusers group offloading, leaf_level", group_leaves),
    )  # fmt: skip
    for name, make in peers:
        try:
            m = copy.deepcopy(base)
            benchdev.synchronize(dev)
            before = benchdev.allocated(dev)
            handles[name] = (m, make(m))
            _timed_generate(m, x, 3)  # warm-up: the order recorded, the kernels chosen
            benchdev.synchronize(dev)
            after = benchdev.allocated(dev)
            held[name] = None if after is None or before is None else after - before
        except Exception as e:  # a peer not installed or failing on this model: reported
            if name in (RESIDENT, OURS):
                raise
            handles.pop(name, None)
            print(f"  {name}: not measured ({type(e).__name__}: {e})")
    times: dict[str, dict[str, list[Any]]] = {name: {"ttft": [], "tps": [], "peak": [], "tokens": []} for name in handles}
    for _ in range(rounds):  # interleaved rounds
        for name, r in times.items():
            benchdev.synchronize(dev)
            benchdev.reset_peak(dev)
            start = benchdev.allocated(dev)
            ttft, tps, toks = _timed_generate(handles[name][0], x, tokens)
            top = benchdev.peak(dev)
            r["ttft"].append(ttft)
            r["tps"].append(tps)
            r["peak"].append(None if top is None or start is None else top - start)
            r["tokens"].append(toks)
    want = times[RESIDENT]["tokens"][0]
    out: dict[str, Any] = {}
    for name, r in times.items():
        h = held[name]
        peaks = [p for p in r["peak"] if p is not None]
        out[name] = {
            "ttft_s": statistics.median(r["ttft"]), "tokens_per_s": statistics.median(r["tps"]),
            "peak_gpu_bytes": None if h is None or not peaks else h + max(peaks),
            "same_tokens": all(torch.equal(t, want) for t in r["tokens"]),
        }  # fmt: skip
    h = handles[OURS][1]
    rep = h.report()
    out["bound_tokens_per_s"] = rep["h2d_bytes"] / max(rep["h2d_s"], 1e-9) / rep["streamed_bytes"] if rep["h2d_s"] else None
    h.close()
    return out


def run(nvme_dir: str, *, gb: float, prefetch: int, rounds: int, simulate: bool = False) -> dict[str, Any]:
    res = read_path(nvme_dir, gb=gb, prefetch=prefetch, rounds=rounds)
    print(
        f"(a) weights' NVMe read path under {nvme_dir} ({'O_DIRECT' if res['direct'] else 'buffered: no O_DIRECT here'}, "
        f"I/O backend {res['backend']}): {res['bytes'] / 1e9:.2f} GB in {res['blocks']} blocks, prefetch {prefetch}\n"
        f"    raw sequential read {res['raw_Bps'] / 1e9:.2f} GB/s, into the pinned ring {res['ours_Bps'] / 1e9:.2f} GB/s "
        f"=> {res['ratio']:.2f}x of raw (median of {rounds} interleaved rounds; target >= 0.9)"
    )
    out: dict[str, Any] = {"read_path": res}
    if not simulate and not torch.cuda.is_available():
        print("(b) tokens/s and TTFT against accelerate and diffusers: owed (needs a GPU; none here)")
        return out
    # a dry run (--simulate): the same code at tiny sizes on the simulated device
    size = dict(layers=2, d=128, vocab=512, tokens=4, prompt=8, rounds=1) if simulate else dict(layers=16, d=2048, vocab=32000, tokens=32, prompt=64, rounds=3)
    with benchdev.device(simulate) as dev:
        where = "the simulated device (a dry run: the figures mean nothing)" if simulate else torch.cuda.get_device_name(dev)
        print(
            f"(b) Llama {size['layers']}x{size['d']} bf16, vocab {size['vocab']}, every block streamed; prompt {size['prompt']} "
            f"tokens, {size['tokens']} greedy tokens at batch 1, {size['rounds']} interleaved rounds, on {where}"
        )
        g = gpu_contenders(dev, prefetch=prefetch, **size)
    out["gpu"] = g
    for name, v in g.items():
        if isinstance(v, dict):
            print(
                f"(b) {name:40s} TTFT {v['ttft_s'] * 1e3:8.1f} ms, {v['tokens_per_s']:7.2f} tokens/s, peak GPU "
                f"{benchdev.gib(v['peak_gpu_bytes']):>9}, tokens {'same' if v['same_tokens'] else 'DIFFER'} (against the resident model's)"
            )
    best = max((v["tokens_per_s"] for k, v in g.items() if isinstance(v, dict) and k not in (RESIDENT, OURS)), default=0.0)
    o = g[OURS]
    if best:
        print(f"    ours {o['tokens_per_s'] / best:.2f}x the best peer (target >= 1.5x)")
    if g["bound_tokens_per_s"]:
        print(f"    bound {g['bound_tokens_per_s']:.2f} tokens/s: ours at {g['bound_tokens_per_s'] / o['tokens_per_s']:.2f}x of it (target <= 1.1x)")
    return out
