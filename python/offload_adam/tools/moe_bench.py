"""``python -m offload_adam bench --moe DIR``: a mixture-of-experts model decoded on the CPU, each
configuration in its own process, measured in one run.

A Qwen3-MoE-shaped bf16 model built from a config (hidden 2048, 64 experts of width 768, 8 routed
per token, 5 layers, a 32000-token vocabulary: 1.74B parameters, 3.5 GB), random weights from a
fixed seed, written once as a safetensors checkpoint under DIR and reused; a 64-token prompt
then 32 greedy tokens at batch 1, ``--threads`` threads:

(a) the model resident in RAM, transformers' default experts implementation, and ``"eager"``
    (its per-expert loop: the reference every case's tokens are compared with);
(b) ours, ``offload_weights(model, device="cpu", checkpoint=DIR)``, storage ``cpu``;
(c) ours, storage ``nvme`` under DIR, ``host_budget_gb`` at 25% of the weights;
(d) accelerate's disk offload: ``load_checkpoint_and_dispatch`` with a ``device_map`` of
    ``"cpu"`` within the same 25% and ``"disk"`` for the rest (its ``offload_folder`` under DIR);
(e) llama.cpp (``llama-cpp-python``, where it is installed: a bench-only dependency) on the same
    weights written as GGUF (architecture ``qwen3moe``), bf16 and Q8_0, also kept under DIR.

Each case runs in a subprocess of its own (its peak RSS and page cache are its own): the
checkpoint's pages (and the case's own files') are dropped from the page cache
(``posix_fadvise(DONTNEED)``) before it loads and again after, then one short warm-up decode
(the offload records its order), then the timed prompt and decode. Per case: decode tokens/s,
time to first token (the prompt's forward), bytes read from the storage per decode token (the
process's ``/proc/self/io`` ``read_bytes`` over the decode), the expert cache's hit rate (from
``report()`` where it gives expert figures, else "n/a"), peak RSS (``VmHWM``), page-cache growth
of its files over the warm-up and the timed run (``mincore``; llama.cpp's and accelerate's mapped
files count in their RSS too), and the bound: tokens/s at most ``1 / max(SSD bytes per token /
O_DIRECT read rate, active bytes per token / host read rate)``, both rates measured in this run,
the active bytes those a token must read (the dense parts and its 8 experts per layer: the
embedding one row; Q8_0 at its 34 bytes per 32 weights). Each case's greedy tokens are compared
with (a) eager's (same, or the first token that differs).

The issue's targets are printed as ratios, not asserted: (b) at least 0.7 of its host-read bound
and at least 1.0x llama.cpp's bf16; (c) at least 0.8 of its disk bound with the page cache flat.
``--tiny`` runs the same harness on a tiny model in seconds (a test of the harness: its figures
mean nothing).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import subprocess
import sys
import time
import zlib
from dataclasses import asdict, dataclass
from typing import Any

import torch

from . import moe_plan

GiB = 1 << 30
SEED = 0


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    experts: int
    top_k: int
    expert_width: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @property
    def tag(self) -> str:
        return (
            f"qwen3moe-h{self.hidden}-l{self.layers}-e{self.experts}-k{self.top_k}-i{self.expert_width}-a{self.heads}x{self.head_dim}"
            f"-kv{self.kv_heads}-v{self.vocab}-s{SEED}"
        )


FULL = Shape(hidden=2048, layers=5, experts=64, top_k=8, expert_width=768, heads=32, kv_heads=4, head_dim=128, vocab=32000)
TINY = Shape(hidden=64, layers=4, experts=4, top_k=2, expert_width=32, heads=4, kv_heads=2, head_dim=16, vocab=256)

CASES = ("a-default", "a-eager", "b-ours-cpu", "c-ours-nvme", "d-accelerate-disk", "e-llama.cpp-bf16", "e-llama.cpp-q8_0")
TITLES = {
    "a-default": "(a) resident, transformers' default experts",
    "a-eager": "(a) resident, experts \"eager\" (reference)",
    "b-ours-cpu": "(b) ours, device cpu, storage cpu",
    "c-ours-nvme": "(c) ours, storage nvme, host budget 25%",
    "d-accelerate-disk": "(d) accelerate disk offload, cpu 25%",
    "e-llama.cpp-bf16": "(e) llama.cpp BF16 (GGUF qwen3moe)",
    "e-llama.cpp-q8_0": "(e) llama.cpp Q8_0 (GGUF qwen3moe)",
}
REFERENCE = "a-eager"


def config(shape: Shape) -> Any:
    """The Qwen3-MoE config of ``shape``: every layer MoE, top-k weights renormalized (as
    Qwen3-30B-A3B, and as llama.cpp's qwen3moe graph computes), untied head."""
    import transformers

    return transformers.Qwen3MoeConfig(  # type: ignore[call-arg]
        hidden_size=shape.hidden, num_hidden_layers=shape.layers, num_experts=shape.experts, num_experts_per_tok=shape.top_k,
        moe_intermediate_size=shape.expert_width, intermediate_size=shape.expert_width * shape.top_k,
        num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim, vocab_size=shape.vocab,
        norm_topk_prob=True, tie_word_embeddings=False, max_position_embeddings=512, decoder_sparse_step=1, mlp_only_layers=[],
        bos_token_id=1, eos_token_id=2, pad_token_id=0, dtype="bfloat16",
    )  # fmt: skip


def _empty_model(cfg: Any) -> Any:
    """The model with its parameters on the meta device (buffers real), bf16."""
    import accelerate  # type: ignore[import-untyped]
    import transformers

    transformers.utils.logging.set_verbosity_error()
    with accelerate.init_empty_weights():
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    return model.eval()


def _tensor(name: str, shape: torch.Size) -> torch.Tensor:
    """The bf16 value of parameter ``name``: norms 1, the rest normal(0, 0.02), each from a
    generator seeded by the bench's seed and the name (the same whatever the order of writing)."""
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(SEED * 1_000_003 + zlib.crc32(name.encode()))
    return torch.randn(shape, generator=g).mul_(0.02).to(torch.bfloat16)


def checkpoint(root: str, shape: Shape) -> str:
    """The checkpoint of ``shape`` under ``root`` (an HF folder: config.json, one safetensors shard
    per layer and one for the rest, their index), written once: a folder with its ``COMPLETE``
    marker is reused."""
    from safetensors.torch import save_file

    path = os.path.join(root, shape.tag)
    if os.path.exists(os.path.join(path, "COMPLETE")):
        return path
    os.makedirs(path, exist_ok=True)
    cfg = config(shape)
    model = _empty_model(cfg)
    groups: dict[str, list[tuple[str, torch.Size]]] = {}
    for n, p in model.named_parameters():
        key = f"layer{int(n.split('.')[2]):03d}" if n.startswith("model.layers.") else "rest"
        groups.setdefault(key, []).append((n, p.shape))
    index: dict[str, str] = {}
    total = 0
    for k, (key, items) in enumerate(sorted(groups.items())):
        fname = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {n: _tensor(n, s) for n, s in items}
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        save_file(tensors, os.path.join(path, fname), metadata={"format": "pt"})
        index.update({n: fname for n in tensors})
        del tensors
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": index}, f, indent=1)
    cfg.save_pretrained(path)
    with open(os.path.join(path, "COMPLETE"), "w") as f:
        f.write(json.dumps(asdict(shape)))
    return path


def _shards(ckpt: str) -> list[str]:
    return sorted(os.path.join(ckpt, f) for f in os.listdir(ckpt) if f.endswith(".safetensors"))


# --- GGUF --------------------------------------------------------------------------------------


def _gguf_tensors(shape: Shape) -> list[tuple[str, str, tuple[int, ...], str]]:
    """(GGUF name, HF parameter name, numpy shape, part) of every tensor, in the order written.
    ``part``: ``"gate"``/``"up"`` halves of the fused gate_up_proj, else ``""``. Names from
    gguf's constants for ``MODEL_ARCH.QWEN3MOE`` (``blk.{i}.ffn_gate_exps`` [E, I, H] ...)."""
    H, E, I, V, hd = shape.hidden, shape.experts, shape.expert_width, shape.vocab, shape.head_dim
    out: list[tuple[str, str, tuple[int, ...], str]] = [("token_embd.weight", "model.embed_tokens.weight", (V, H), "")]
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        out += [
            (f"blk.{i}.attn_norm.weight", p + "input_layernorm.weight", (H,), ""),
            (f"blk.{i}.attn_q.weight", p + "self_attn.q_proj.weight", (shape.heads * hd, H), ""),
            (f"blk.{i}.attn_k.weight", p + "self_attn.k_proj.weight", (shape.kv_heads * hd, H), ""),
            (f"blk.{i}.attn_v.weight", p + "self_attn.v_proj.weight", (shape.kv_heads * hd, H), ""),
            (f"blk.{i}.attn_output.weight", p + "self_attn.o_proj.weight", (H, shape.heads * hd), ""),
            (f"blk.{i}.attn_q_norm.weight", p + "self_attn.q_norm.weight", (hd,), ""),
            (f"blk.{i}.attn_k_norm.weight", p + "self_attn.k_norm.weight", (hd,), ""),
            (f"blk.{i}.ffn_norm.weight", p + "post_attention_layernorm.weight", (H,), ""),
            (f"blk.{i}.ffn_gate_inp.weight", p + "mlp.gate.weight", (E, H), ""),
            (f"blk.{i}.ffn_gate_exps.weight", p + "mlp.experts.gate_up_proj", (E, I, H), "gate"),
            (f"blk.{i}.ffn_up_exps.weight", p + "mlp.experts.gate_up_proj", (E, I, H), "up"),
            (f"blk.{i}.ffn_down_exps.weight", p + "mlp.experts.down_proj", (E, H, I), ""),
        ]
    out += [("output_norm.weight", "model.norm.weight", (H,), ""), ("output.weight", "lm_head.weight", (V, H), "")]
    return out


def write_gguf(ckpt: str, shape: Shape, path: str, qtype: str) -> str:
    """The checkpoint's weights as a llama.cpp GGUF of architecture ``qwen3moe`` at ``path``
    (``qtype`` ``"bf16"`` or ``"q8_0"``: the matrices, quantized by the ``gguf`` package; the norms
    float32; the router bf16 or Q8_0 as the matrices), one tensor at a time (the file's tensor
    infos first, then each tensor read from the checkpoint, converted and written: RAM for one
    fused experts tensor, not the model); a placeholder vocabulary (the bench feeds token ids).
    Written once: an existing file is reused."""
    import gguf  # type: ignore[import-untyped]
    import numpy as np
    from safetensors import safe_open

    from .linear_bench import gguf_placeholder_vocab

    if qtype not in ("bf16", "q8_0"):
        raise ValueError(f"qtype: 'bf16' or 'q8_0', got {qtype!r}")
    if os.path.exists(path):
        return path
    T = gguf.GGMLQuantizationType
    cfg = config(shape)
    tmp = path + ".partial"
    w = gguf.GGUFWriter(tmp, "qwen3moe")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(shape.hidden)
    w.add_block_count(shape.layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_expert_feed_forward_length(shape.expert_width)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_key_length(shape.head_dim)
    w.add_value_length(shape.head_dim)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_expert_count(shape.experts)
    w.add_expert_used_count(shape.top_k)
    w.add_vocab_size(shape.vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if qtype == "q8_0" else gguf.LlamaFileType.MOSTLY_BF16)
    gguf_placeholder_vocab(w, shape.vocab)
    specs = _gguf_tensors(shape)
    raw = T.Q8_0 if qtype == "q8_0" else T.BF16

    def is_matrix(np_shape: tuple[int, ...]) -> bool:
        return len(np_shape) >= 2

    for name, _, np_shape, _ in specs:
        if is_matrix(np_shape):
            byte_shape = gguf.quant_shape_to_byte_shape(np_shape, raw)
            nbytes = int(np.prod(byte_shape))
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), nbytes, raw_dtype=raw)
        else:
            w.add_tensor_info(name, np_shape, np.dtype(np.float32), int(np.prod(np_shape)) * 4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    with open(os.path.join(ckpt, "model.safetensors.index.json")) as f:
        where = json.load(f)["weight_map"]
    handles: dict[str, Any] = {}
    try:
        for name, hf, np_shape, part in specs:
            fname = where[hf]
            if fname not in handles:
                handles[fname] = safe_open(os.path.join(ckpt, fname), "pt")
            t = handles[fname].get_tensor(hf)
            if part:
                t = t[:, : shape.expert_width] if part == "gate" else t[:, shape.expert_width :]
            t = t.contiguous()
            if tuple(t.shape) != np_shape:
                raise ValueError(f"{hf}: shape {tuple(t.shape)}, the GGUF tensor {name} needs {np_shape}")
            if not is_matrix(np_shape):
                w.write_tensor_data(t.float().numpy())
            elif qtype == "q8_0":
                w.write_tensor_data(gguf.quants.quantize(t.float().numpy(), T.Q8_0))
            else:
                w.write_tensor_data(t.view(torch.uint8).numpy() if t.dim() else t.numpy())
            del t
    finally:
        handles.clear()
        w.close()
    os.replace(tmp, path)
    return path


# --- measuring, inside a case's process -------------------------------------------------------


def read_bytes() -> int:
    """Bytes this process caused to be read from storage (``/proc/self/io``: every thread's,
    O_DIRECT and page faults of mapped files included; page-cache hits not)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def _files(paths: list[str]) -> list[str]:
    out = []
    for p in paths:
        if os.path.isfile(p):
            out.append(p)
        elif os.path.isdir(p):
            for root, _, names in os.walk(p):
                out += [os.path.join(root, n) for n in names]
    return out


def drop_pages(paths: list[str]) -> None:
    """Drops the files' clean pages from the page cache (written ones first flushed):
    ``posix_fadvise(POSIX_FADV_DONTNEED)``; pages a process maps stay."""
    for p in _files(paths):
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            with contextlib.suppress(OSError):
                os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cached_bytes(paths: list[str]) -> int:
    from ..runtime.pages import page_cache_bytes

    total = 0
    for p in _files(paths):
        with contextlib.suppress(OSError):
            total += page_cache_bytes(p)
    return total


class _Torch:
    """Greedy decode of a transformers model with its KV cache."""

    def __init__(self, model: torch.nn.Module) -> None:
        from .weights_bench import _cache_key

        self.model, self.past, self.key = model, None, _cache_key(model)

    def reset(self) -> None:
        self.past = None

    @torch.no_grad()
    def feed(self, ids: list[int]) -> int:
        out = self.model(input_ids=torch.tensor([ids]), use_cache=True, **{self.key: self.past})
        self.past = out[self.key]
        return int(out.logits[0, -1].argmax())


class _Llama:
    """Greedy decode through llama-cpp-python's ``eval`` (the logits of the last token fed)."""

    def __init__(self, path: str, n_ctx: int, n_batch: int, threads: int) -> None:
        from llama_cpp import Llama  # type: ignore[import-not-found]

        self.llm = Llama(model_path=path, n_ctx=n_ctx, n_batch=n_batch, n_threads=threads, n_threads_batch=threads, verbose=False)

    def reset(self) -> None:
        self.llm.reset()

    def feed(self, ids: list[int]) -> int:
        import numpy as np

        self.llm.eval(ids)  # (without logits_all it keeps no scores: the context's last row, read here)
        return int(np.ctypeslib.as_array(self.llm._ctx.get_logits_ith(-1), shape=(self.llm.n_vocab(),)).argmax())


def _timed(dec: Any, prompt: list[int], tokens: int, files: list[str]) -> dict[str, Any]:
    """A short warm-up, then the prompt and ``tokens`` greedy tokens timed; page cache of
    ``files`` from before the warm-up to the end."""
    pc0 = cached_bytes(files)
    dec.reset()
    nxt = dec.feed(prompt[: min(8, len(prompt))])
    dec.feed([nxt])
    dec.reset()
    io0 = read_bytes()
    t0 = time.perf_counter()
    nxt = dec.feed(prompt)
    ttft = time.perf_counter() - t0
    io1 = read_bytes()
    got = [nxt]
    t1 = time.perf_counter()
    for _ in range(tokens - 1):
        nxt = dec.feed([nxt])
        got.append(nxt)
    dt = time.perf_counter() - t1
    io2 = read_bytes()
    return {
        "tokens": got, "ttft_s": ttft, "tokens_s": (tokens - 1) / max(dt, 1e-9), "prompt_read_bytes": io1 - io0,
        "decode_read_bytes": io2 - io1, "read_bytes_per_token": (io2 - io1) / max(tokens - 1, 1),
        "page_cache_growth_bytes": cached_bytes(files) - pc0,
    }  # fmt: skip


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (int, float, str, bool)) or x is None:
        return x
    return str(x)


def expert_figures(report: dict[str, Any]) -> dict[str, Any]:
    """The expert figures of an offload's ``report()``: every entry under a key naming experts
    (``"expert..."``), and the hit rate: hits over hits and misses (the counts named ``hits`` and
    ``misses`` where there are such, else every count whose key names a hit or a miss: copied,
    computed on the CPU, read), of the ``"decode"`` phase where the figures are per phase, else
    of all. ``{"hit_rate": None}`` where the report has no expert figures (the
    layer-granular offload)."""
    found: dict[str, Any] = {}

    def walk(d: Any, path: tuple[str, ...]) -> None:
        if isinstance(d, dict):
            for k, v in d.items():
                walk(v, (*path, str(k)))
        elif isinstance(d, (int, float)) and not isinstance(d, bool) and any("expert" in p for p in path):
            found[".".join(path)] = d

    walk(report, ())
    out: dict[str, Any] = {"figures": found, "hit_rate": None}

    def count(word: str, keys: list[str]) -> float:
        last = [k for k in keys if "byte" not in k.rsplit(".", 1)[-1]]
        exact = [k for k in last if k.rsplit(".", 1)[-1] == word + "es" or k.rsplit(".", 1)[-1] == word + "s"]
        return float(sum(found[k] for k in exact or [k for k in last if word in k.rsplit(".", 1)[-1]]))

    decode = [k for k in found if ".decode." in f".{k}." or k.endswith(".decode")]
    for keys in (decode, list(found)):
        hits, misses = count("hit", keys), count("miss", keys)
        if hits + misses > 0:
            out["hit_rate"] = hits / (hits + misses)
            break
    return out


def _load_resident(ckpt: str, cfg: Any) -> Any:
    """The model with its weights in RAM: copies of the checkpoint's tensors (``load_file``'s own
    are views of the file's mapping, which the page cache may drop: read again from the SSD)."""
    from safetensors.torch import load_file

    model = _empty_model(cfg)
    for shard in _shards(ckpt):
        model.load_state_dict({k: v.clone() for k, v in load_file(shard).items()}, strict=False, assign=True)
    left = [n for n, p in model.named_parameters() if p.is_meta]
    if left:
        raise RuntimeError(f"the checkpoint under {ckpt} lacks {left[:3]}")
    return model


def _gguf(spec: dict[str, Any], name: str) -> list[str]:
    """The GGUF file an ``e-`` case reads (written by the parent), else nothing."""
    if not name.startswith("e-"):
        return []
    return [os.path.join(spec["dir"], f"{Shape(**spec['shape']).tag}-{name.rsplit('-', 1)[-1]}.gguf")]


def run_case(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    """One case, in this process: loads, measures, returns its figures (no bound: the parent
    computes it from the rates it measured)."""
    if name not in CASES:
        raise ValueError(f"case: one of {CASES}, got {name!r}")
    torch.set_num_threads(int(spec["threads"]))
    drop_pages([spec["checkpoint"], *_gguf(spec, name)])
    out: dict[str, Any] = {"case": name, "title": TITLES[name]}
    cleanup: list[Any] = []
    try:
        return _run_case(name, spec, out, cleanup)
    finally:
        for f in cleanup:
            f()


def _run_case(name: str, spec: dict[str, Any], out: dict[str, Any], cleanup: list[Any]) -> dict[str, Any]:
    shape = Shape(**spec["shape"])
    threads = int(spec["threads"])
    ckpt, prompt, tokens, budget = spec["checkpoint"], spec["prompt"], int(spec["tokens"]), float(spec["budget_bytes"])
    cfg = config(shape)
    own = _gguf(spec, name)  # the case's own files, beside the checkpoint
    handle = None
    t0 = time.perf_counter()
    if name in ("a-default", "a-eager"):
        model = _load_resident(ckpt, cfg)
        if name == "a-eager":
            model.set_experts_implementation("eager")
        out["experts_implementation"] = model.config._experts_implementation
        dec: Any = _Torch(model)
    elif name in ("b-ours-cpu", "c-ours-nvme"):
        import offload_adam

        model = _empty_model(cfg)
        kw: dict[str, Any] = {}
        if name == "c-ours-nvme":
            nvme = os.path.join(spec["dir"], "nvme")
            os.makedirs(nvme, exist_ok=True)
            own = [nvme]
            kw = dict(storage="nvme", nvme_dir=nvme, host_budget_gb=budget / GiB)
        # The weights read from the checkpoint as they are offloaded (checkpoint=: no second copy
        # in RAM, the routed experts too, one expert at a time). The layer-granular offload's RAM
        # ring (prefetch + 1 layers) counts in host_budget_gb: the most read-ahead the budget
        # holds, 2 (the default) where it fits. plan_weights says, building nothing; where none
        # fits, the case fails with its reason (no fallback: its figures would count a load).
        prefetch, src, why = _plan(model, ckpt, kw)
        if src is None:
            raise ValueError(why)
        out["loaded"] = "from the checkpoint (checkpoint=)"
        if kw:
            out["prefetch"] = prefetch
        handle = offload_adam.offload_weights(model, device="cpu", checkpoint=src, num_threads=threads, prefetch=prefetch, **kw)
        out["experts_implementation"] = model.config._experts_implementation
        dec = _Torch(model)
    elif name == "d-accelerate-disk":
        import shutil

        import accelerate

        model = _empty_model(cfg)
        folder = os.path.join(spec["dir"], "accelerate-offload")
        own = [folder]
        dmap = accelerate_device_map(model, budget)
        try:
            model = accelerate.load_checkpoint_and_dispatch(model, ckpt, device_map=dmap, offload_folder=folder, dtype=torch.bfloat16)
        finally:
            cleanup.append(lambda: shutil.rmtree(folder, ignore_errors=True))
        out["cpu_modules"] = sum(1 for v in dmap.values() if v == "cpu")
        out["disk_modules"] = sum(1 for v in dmap.values() if v == "disk")
        dec = _Torch(model)
    elif name.startswith("e-"):
        dec = _Llama(own[0], n_ctx=len(prompt) + tokens + 16, n_batch=len(prompt), threads=threads)
    else:
        raise ValueError(f"case: one of {CASES}, got {name!r}")
    out["setup_s"] = time.perf_counter() - t0
    gc.collect()
    drop_pages([ckpt, *own])
    out["rss_after_setup_bytes"] = _status("VmRSS")
    try:
        out.update(_timed(dec, prompt, tokens, [ckpt, *own]))
        out["peak_rss_bytes"] = _status("VmHWM")
        if handle is not None:
            rep = handle.report()
            out["report"] = {k: _jsonable(v) for k, v in rep.items() if k != "cost_model"}
            out["experts"] = expert_figures(rep)
    finally:
        if handle is not None:
            handle.close()
    return out


def _plan(model: Any, ckpt: str | None, kw: dict[str, Any]) -> tuple[Any, Any, str]:
    """(prefetch, checkpoint, "") of the first read-ahead of 2, 1, 0 (2 alone without a host
    budget) that ``plan_weights`` accepts for ``model`` from ``ckpt``; (None, None, why) where none is."""
    import offload_adam

    why = ""
    for prefetch in (2, 1, 0) if kw else (2,):
        try:
            offload_adam.plan_weights(model, device="cpu", checkpoint=ckpt, prefetch=prefetch, **kw)
            return prefetch, ckpt, ""
        except ValueError as e:
            why = str(e)
    return None, None, why


def accelerate_device_map(model: Any, budget: float) -> dict[str, str]:
    """accelerate's ``device_map`` within ``budget`` bytes of RAM as ours keeps it: the small
    modules, the embedding and the head first, then whole layers in order; the rest ``"disk"``."""
    inner = model.model
    size = lambda m: sum(p.numel() * 2 for p in m.parameters())  # noqa: E731 (bf16)
    mods = [("model.norm", inner.norm), ("model.rotary_emb", inner.rotary_emb), ("model.embed_tokens", inner.embed_tokens),
            ("lm_head", model.lm_head)] + [(f"model.layers.{i}", m) for i, m in enumerate(inner.layers)]  # fmt: skip
    left, out = budget, {}
    for n, m in mods:
        b = size(m)
        out[n] = "cpu" if b <= left else "disk"
        if b <= left:
            left -= b
    return out


# --- the parent: every case in a subprocess ---------------------------------------------------


def _subprocess(name: str, spec_path: str, out_path: str, timeout: float) -> dict[str, Any]:
    with contextlib.suppress(FileNotFoundError):
        os.remove(out_path)  # a former run's
    cmd = [sys.executable, "-m", "offload_adam.tools.moe_bench", "--case", name, "--spec", spec_path, "--out", out_path]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"case": name, "title": TITLES[name], "error": f"timed out after {timeout:.0f} s"}
    if r.returncode != 0 or not os.path.exists(out_path):
        tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
        return {"case": name, "title": TITLES[name], "error": f"exit {r.returncode}: " + " | ".join(tail)}
    with open(out_path) as f:
        return json.load(f)  # type: ignore[no-any-return]


def llama_cpp_missing() -> str | None:
    """Why llama.cpp cannot run here (None: llama-cpp-python imports)."""
    try:
        import llama_cpp  # type: ignore[import-not-found]  # noqa: F401
    except Exception as e:  # noqa: BLE001 (absent or broken: said, skipped)
        return f"llama-cpp-python not installed ({type(e).__name__}: {e}); pip install llama-cpp-python to measure (e)"
    return None


def _bound(c: dict[str, Any], active: float, disk_gbs: float, host_gbs: float) -> None:
    """The case's bound: tokens/s at most 1 / max(SSD bytes per token / disk rate, active bytes
    per token / host rate)."""
    a = active * (34 / 32 / 2 if c["case"].endswith("q8_0") else 1.0)
    t_disk = c["read_bytes_per_token"] / (disk_gbs * 1e9)
    t_host = a / (host_gbs * 1e9)
    c["active_bytes_per_token"] = a
    c["bound_by"] = "disk" if t_disk > t_host else "host"
    c["bound_tokens_s"] = 1 / max(t_disk, t_host)
    c["of_bound"] = c["tokens_s"] / c["bound_tokens_s"]


def _same(tokens: list[int], ref: list[int] | None) -> str:
    if ref is None:
        return "n/a"
    for i, (a, b) in enumerate(zip(tokens, ref)):
        if a != b:
            return f"differ at {i}"
    return "same"


def _median(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A case over its rounds: the round of the median decode rate (its other figures with it),
    and every round's rate, TTFT and token comparison; a round that failed is the case's error."""
    bad = [r for r in runs if "error" in r]
    if bad:
        return bad[0]
    ranked = sorted(runs, key=lambda r: r["tokens_s"])
    out = dict(ranked[(len(ranked) - 1) // 2])
    out["rounds_tokens_s"] = [r["tokens_s"] for r in runs]
    out["rounds_ttft_s"] = [r["ttft_s"] for r in runs]
    out["rounds_tokens_vs_eager"] = [r["tokens_vs_eager"] for r in runs]
    return out


def _ratio(a: dict[str, Any], b: dict[str, Any]) -> float:
    """The median over rounds of ``a``'s decode rate over ``b``'s in the same round."""
    import statistics

    return statistics.median(x / y for x, y in zip(a["rounds_tokens_s"], b["rounds_tokens_s"]))


def run(
    root: str, *, tiny: bool = False, cases: tuple[str, ...] = CASES, threads: int | None = None, prompt_len: int | None = None,
    tokens: int | None = None, isolate: bool = True, timeout: float = 3600.0, rounds: int = 1,
) -> dict[str, Any]:  # fmt: skip
    """Every case of ``cases`` (in a subprocess of its own unless ``isolate=False``), ``rounds``
    times in interleaved rounds, the rates, the table; returns what the JSON holds."""
    from ..weights import costs

    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")

    unknown = [n for n in cases if n not in CASES]
    if unknown:
        raise ValueError(f"cases: {unknown} unknown; the cases are {', '.join(CASES)}")
    if not os.path.isdir(root):
        raise ValueError(f"--moe {root}: not a folder")
    shape = TINY if tiny else FULL
    prompt_len = prompt_len or (8 if tiny else 64)
    tokens = tokens or (4 if tiny else 32)
    threads = threads or torch.get_num_threads()
    reused = os.path.exists(os.path.join(root, shape.tag, "COMPLETE"))
    ckpt = checkpoint(root, shape)
    figs = moe_plan.moe_figures(config(shape))
    assert figs is not None
    weights = sum(os.path.getsize(f) for f in _shards(ckpt))
    budget = 0.25 * figs.total_params * 2
    print(
        f"moe bench: Qwen3-MoE-shaped bf16, {figs.total_params / 1e9:.3f}B parameters ({figs.total_params * 2 / 1e9:.2f} GB), "
        f"{shape.layers} layers, hidden {shape.hidden}, {shape.experts} experts of width {shape.expert_width}, {shape.top_k} routed; "
        f"active {figs.active_params / 1e9:.3f}B per token ({figs.active_bytes / 1e6:.0f} MB read per decode token); "
        f"prompt {prompt_len} tokens, {tokens} greedy tokens, batch 1, {threads} threads; checkpoint {ckpt} "
        f"({'reused' if reused else 'written'}, {weights / 1e9:.2f} GB)"
    )
    miss = llama_cpp_missing()
    notes: list[str] = []
    todo = list(cases)
    if any(c.startswith("e-") for c in todo):
        if miss is not None:
            notes.append(f"(e) skipped: {miss}")
            todo = [c for c in todo if not c.startswith("e-")]
        else:
            for c in todo:
                if c.startswith("e-"):
                    q = c.rsplit("-", 1)[-1]
                    path = os.path.join(root, f"{shape.tag}-{q}.gguf")
                    had = os.path.exists(path)
                    write_gguf(ckpt, shape, path, q)
                    print(f"llama.cpp's GGUF ({q}): {path} ({'reused' if had else 'written'}, {os.path.getsize(path) / 1e9:.2f} GB)")
    disk = costs.disk_read_gbs(root, (64 << 20) if tiny else (1 << 30))
    host = costs.host_read_gbs((64 << 20) if tiny else (512 << 20))
    print(f"this machine: O_DIRECT read {disk:.2f} GB/s under {root}, host read {host:.2f} GB/s (measured now)")
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, shape.vocab, (prompt_len,), generator=g).tolist()
    spec = {"shape": asdict(shape), "checkpoint": ckpt, "dir": root, "prompt": prompt, "tokens": tokens, "threads": threads,
            "budget_bytes": budget}  # fmt: skip
    spec_path = os.path.join(root, "moe-bench-spec.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    per: dict[str, list[dict[str, Any]]] = {n: [] for n in todo}
    for rnd in range(rounds):  # interleaved rounds, the order rotating (the machine may be shared)
        k = rnd % len(todo) if todo else 0
        for name in todo[k:] + todo[:k]:
            print(f"  {TITLES[name]}{f' (round {rnd + 1} of {rounds})' if rounds > 1 else ''} ...", flush=True)
            if isolate:
                res = _subprocess(name, spec_path, os.path.join(root, f"moe-bench-{name}.json"), timeout)
            else:
                try:
                    res = run_case(name, spec)
                except Exception as e:  # noqa: BLE001 (a case that fails is reported, the others run)
                    res = {"case": name, "title": TITLES[name], "error": f"{type(e).__name__}: {e}"}
            if "error" in res:
                print(f"    failed: {res['error']}")
            per[name].append(res)
    ref = next((r["tokens"] for r in per.get(REFERENCE, []) if "tokens" in r), None)
    default = next((r["tokens"] for r in per.get("a-default", []) if "tokens" in r), None)
    for runs in per.values():
        for r in runs:
            if "error" not in r:
                _bound(r, figs.active_bytes, disk, host)
                r["tokens_vs_eager"] = _same(r["tokens"], ref)
                r["tokens_vs_default"] = _same(r["tokens"], default)
                r.setdefault("experts", {"hit_rate": None})
    results = [_median(runs) for runs in per.values()]
    out = {
        "model": {"shape": asdict(shape), "params": figs.total_params, "active_params": figs.active_params,
                  "active_bytes_per_token": figs.active_bytes, "checkpoint": ckpt, "checkpoint_bytes": weights,
                  "host_budget_bytes": budget, "expected_ssd_bytes_per_token_at_budget": figs.cache(budget).ssd_bytes_per_token},
        "run": {"prompt": prompt_len, "tokens": tokens, "threads": threads, "tiny": tiny, "isolated": isolate, "rounds": rounds},
        "machine": {"disk_read_gbs": disk, "host_read_gbs": host, "load_avg": os.getloadavg()},
        "cases": results, "notes": notes,
    }  # fmt: skip
    out["targets"] = _print(out)
    return out


def _print(res: dict[str, Any]) -> dict[str, Any]:
    M = 1e6
    hdr = (
        f"  {'case':<46} {'tok/s':>7} {'TTFT s':>7} {'SSD MB/tok':>10} {'hit':>5} {'peak RSS':>9} {'cache +':>8} "
        f"{'bound tok/s':>12} {'of bound':>8}  tokens vs eager"
    )
    print(hdr)
    by = {c["case"]: c for c in res["cases"]}
    for c in res["cases"]:
        if "error" in c:
            print(f"  {c['title']:<46} failed: {c['error']}")
            continue
        print(
            f"  {c['title']:<46} {c['tokens_s']:7.2f} {c['ttft_s']:7.2f} {c['read_bytes_per_token'] / M:10.1f} "
            f"{moe_plan.hit_rate_words(c['experts']['hit_rate']):>5} {c['peak_rss_bytes'] / GiB:6.2f} GiB "
            f"{c['page_cache_growth_bytes'] / M:6.0f}MB {c['bound_tokens_s']:7.2f} ({c['bound_by']}) {c['of_bound']:8.2f}  "
            f"{c['tokens_vs_eager']}{'; = default' + chr(39) + 's' if c['tokens_vs_eager'] != 'same' and c['tokens_vs_default'] == 'same' else ''}"
        )
    for n in res["notes"]:
        print(f"  {n}")
    t: dict[str, Any] = {}
    b, c, e = by.get("b-ours-cpu"), by.get("c-ours-nvme"), by.get("e-llama.cpp-bf16")
    if b is not None and "error" not in b:
        t["b_of_host_bound"] = b["of_bound"] if b["bound_by"] == "host" else None
        line = f"  targets: (b) at {b['of_bound']:.2f} of its {b['bound_by']}-read bound (target >= 0.7)"
        if e is not None and "error" not in e:
            t["b_over_llama_cpp_bf16"] = _ratio(b, e)
            line += f"; (b) {t['b_over_llama_cpp_bf16']:.2f}x llama.cpp BF16 (target >= 1.0x; median of per-round ratios)"
        else:
            line += "; (b) against llama.cpp BF16: not measured"
        print(line)
    if c is not None and "error" not in c:
        read = c["decode_read_bytes"] + c["prompt_read_bytes"]
        t["c_of_bound"] = c["of_bound"]
        t["c_page_cache_over_read"] = c["page_cache_growth_bytes"] / max(read, 1)
        ideal = res["model"]["expected_ssd_bytes_per_token_at_budget"]
        t["c_read_over_expected"] = c["read_bytes_per_token"] / ideal if ideal else None
        print(
            f"  targets: (c) (prefetch {c.get('prefetch')}) at {c['of_bound']:.2f} of its {c['bound_by']} bound (target >= 0.8); page cache grew "
            f"{t['c_page_cache_over_read']:.1%} of the {read / M:.0f} MB it read (target: flat); it read "
            f"{c['read_bytes_per_token'] / M:.1f} MB per token where an expert cache of its budget reads "
            f"{ideal / M:.1f} MB at a uniform routing (plan's figure)"
        )
    return t


def main(argv: list[str] | None = None) -> int:
    """A case's process: ``--case NAME --spec FILE --out FILE``."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m offload_adam.tools.moe_bench", description="one case of bench --moe (run by it)")
    ap.add_argument("--case", required=True, choices=CASES)
    ap.add_argument("--spec", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    with open(args.spec) as f:
        spec = json.load(f)
    res = run_case(args.case, spec)
    with open(args.out, "w") as f:
        json.dump(res, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
