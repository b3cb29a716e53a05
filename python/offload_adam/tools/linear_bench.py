"""``python -m offload_adam bench --linear``: the CPU matmul of decode (``weights/hostmatmul.py``)
against torch and torchao, and the decode of a model against llama.cpp, in the same run.

1. Bandwidth: this machine's read (``sum`` of 512 MiB) and copy rates, the roofline of decode.
2. Layer: one decode row through the seven matrices of a Llama 8B-class layer (hidden 4096, FFN
   14336, GQA 32/8 heads: q, k, v, o, gate, up, down), round after round, the contenders' order
   rotating: torch bf16 ``F.linear``, torchao int8 weight-only (eager), ours bf16, int8, fp8 and
   int4 (torchao's CPU int4, ``PrototypeInt4WeightOnlyConfig``, groups of ``INT4_GROUP``; torch's
   own int4 kernel on the same weights beside it). Median time per layer, the weights' bytes over
   that time, the median per-round ratio to torch.
3. Rows: the crossover, the gate matrix at 1 to 64 rows (ours against torch bf16 and torchao).
4. Model (``--linear-model``): the issue's 4-layer model (hidden 4096, FFN 14336, vocab 32000,
   1.1B parameters, random weights), a 64-token prompt then one token at a time, tokens/s: torch
   bf16, torchao int8 eager, and ours (every ``nn.Linear`` at decode through the kernel) in bf16,
   int8, fp8 and int4 (torchao's int4 eager beside it); and llama.cpp (``llama-cpp-python``, where
   it installs) on the same weights written as GGUF with the ``gguf`` package, bf16, Q8_0 and
   Q4_0. ``kinds`` picks the weight formats (each a model in memory: all five hold about 6 GB).
   int8 and int4 are decoded twice: the kernel's blocks on its rayon pool, and on torch's own
   OpenMP team (``hostmatmul.LINEAR_OMP``), where the process has libgomp and threads > 1.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ..weights import hostmatmul as hm

HIDDEN, FFN, HEADS, KV_HEADS, VOCAB = 4096, 14336, 32, 8, 32000
INT4_GROUP = 128  # torchao's default group size (llama.cpp's Q4_0 has blocks of 32 with a float16 scale)
KINDS = ("bf16", "int8", "fp8", "int4")
LAYER = {"q": (4096, 4096), "k": (1024, 4096), "v": (1024, 4096), "o": (4096, 4096), "gate": (FFN, 4096), "up": (FFN, 4096), "down": (4096, FFN)}


def _median_time(f: Callable[[], object], reps: int) -> float:
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _interleaved(
    fns: dict[str, Callable[[], object]], rounds: int, base: str, times_out: dict[str, list[float]] | None = None
) -> dict[str, dict[str, float]]:  # fmt: skip
    """Each round times every contender once, the order rotating; medians and per-round ratios
    (``times_out``, if given, gets each contender's time per round)."""
    names = list(fns)
    times: dict[str, list[float]] = {n: [] for n in names}
    for f in fns.values():
        f()  # warm-up
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for n in order:
            t0 = time.perf_counter()
            fns[n]()
            times[n].append(time.perf_counter() - t0)
    out = {}
    for n in names:
        ratios = [b / t for b, t in zip(times[base], times[n])]
        out[n] = {
            "median_s": statistics.median(times[n]),
            "min_s": min(times[n]),
            "max_s": max(times[n]),
            "speedup_vs_base": statistics.median(ratios),
        }
    if times_out is not None:
        times_out.update(times)
    return out


def bandwidth(reps: int = 7) -> dict[str, float]:
    src = torch.ones(128 << 20)  # 512 MiB
    dst = torch.empty_like(src)
    read = src.numel() * 4 / _median_time(src.sum, reps) / 1e9
    copy = 2 * src.numel() * 4 / _median_time(lambda: dst.copy_(src), reps) / 1e9
    return {"read_GBps": read, "copy_GBps": copy}


def _torchao_int8(w: torch.Tensor) -> torch.nn.Linear | None:
    try:
        from torchao.quantization import Int8WeightOnlyConfig, quantize_  # type: ignore[import-untyped]
    except Exception as e:  # noqa: BLE001 (a peer that does not install here: said, skipped)
        print(f"   (skipped torchao: {type(e).__name__}: {e})")
        return None
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(w)
    quantize_(lin, Int8WeightOnlyConfig())
    return lin


def _int4_config(group: int = INT4_GROUP) -> Any:
    from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig  # type: ignore[import-untyped]

    return PrototypeInt4WeightOnlyConfig(group_size=group)


def _torchao_int4(w: torch.Tensor) -> torch.nn.Linear | None:
    """torchao's CPU int4 weight-only Linear of ``w`` (``Int4OpaqueTensor``), or None."""
    try:
        from torchao.quantization import quantize_
    except Exception as e:  # noqa: BLE001
        print(f"   (skipped torchao int4: {type(e).__name__}: {e})")
        return None
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(w)
    quantize_(lin, _int4_config())
    return lin


def _quantized(w: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """int8 and fp8 codes of ``w`` with per-row scales (what torchao's configs store)."""
    wf = w.float()
    amax = wf.abs().amax(1, keepdim=True).clamp_min(1e-12)
    s8 = amax / 127
    s_f8 = amax / 448
    return {
        "int8": ((wf / s8).round().clamp(-127, 127).to(torch.int8), s8),
        "fp8": ((wf / s_f8).to(torch.float8_e4m3fn), s_f8),
    }


def layer(rounds: int, threads: int, rows: int = 1) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    mats = {k: (torch.randn(n, i, generator=g) * 0.02).to(torch.bfloat16) for k, (n, i) in LAYER.items()}
    qs = {k: _quantized(w) for k, w in mats.items()}
    ao = {k: _torchao_int8(w) for k, w in mats.items()}
    ao4 = {k: _torchao_int4(w) for k, w in mats.items()}
    xs = {i: torch.randn(rows, i, generator=g).to(torch.bfloat16) for i in (HIDDEN, FFN)}
    fns: dict[str, Callable[[], object]] = {
        "torch bf16 F.linear": lambda: [F.linear(xs[w.shape[1]], w) for w in mats.values()],
        "ours bf16": lambda: [hm.linear(xs[w.shape[1]], w, num_threads=threads) for w in mats.values()],
        "ours int8": lambda: [hm.linear(xs[q.shape[1]], q, s, num_threads=threads) for q, s in (v["int8"] for v in qs.values())],
        "ours fp8": lambda: [hm.linear(xs[q.shape[1]], q, s, num_threads=threads) for q, s in (v["fp8"] for v in qs.values())],
    }
    mods = [m for m in ao.values() if m is not None]
    if len(mods) == len(ao):
        fns["torchao int8 weight-only (eager)"] = lambda: [m(xs[m.in_features]) for m in mods]
    mods4 = [m for m in ao4.values() if m is not None]
    if len(mods4) == len(ao4):
        w4: list[Any] = [m.weight for m in mods4]
        fns["ours int4"] = lambda: [
            hm.linear_int4(xs[w.shape[1]], w.qdata, w.scale_and_zero, group_size=INT4_GROUP, num_threads=threads) for w in w4
        ]
        fns["torchao int4 weight-only (eager)"] = lambda: [m(xs[m.in_features]) for m in mods4]
    times: dict[str, list[float]] = {}
    with torch.no_grad():
        res = _interleaved(fns, rounds, "torch bf16 F.linear", times)
    params = sum(n * i for n, i in LAYER.values())
    for name, r in res.items():
        per = 2 if "bf16" in name else 0.5 + 4 / INT4_GROUP if "int4" in name else 1
        r["GBps"] = params * per / r["median_s"] / 1e9
    if "ours int4" in res:
        # (the median of the per-round ratios of int4 to int8: the 1.8x)
        res["ours int4"]["vs_ours_int8"] = statistics.median(a / b for a, b in zip(times["ours int8"], times["ours int4"]))
    return res


def crossover(rounds: int, threads: int, rows_list: tuple[int, ...] = (1, 4, 8, 16, 32, 64)) -> dict[int, dict[str, float]]:
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(FFN, HIDDEN, generator=g) * 0.02).to(torch.bfloat16)
    q, s = _quantized(w)["int8"]
    ao = _torchao_int8(w)
    out = {}
    for rows in rows_list:
        x = torch.randn(rows, HIDDEN, generator=g).to(torch.bfloat16)
        fns: dict[str, Callable[[], object]] = {
            "torch bf16": lambda: F.linear(x, w),
            "ours bf16": lambda: hm.linear(x, w, num_threads=threads),
            "ours int8": lambda: hm.linear(x, q, s, num_threads=threads),
        }
        if ao is not None:
            fns["torchao int8"] = lambda: ao(x)
        with torch.no_grad():
            res = _interleaved(fns, rounds, "torch bf16")
        out[rows] = {n: r["median_s"] for n, r in res.items()}
    return out


# --- the model ---------------------------------------------------------------------------------


def _model(layers: int) -> torch.nn.Module:
    import transformers

    cfg = transformers.LlamaConfig(
        hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=layers, num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS, vocab_size=VOCAB, max_position_embeddings=1024,
    )  # fmt: skip
    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model: torch.nn.Module = transformers.LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    return model.eval()


def _torch_decoder(model: torch.nn.Module, prompt: torch.Tensor, tokens: int) -> Callable[[], tuple[float, float]]:
    """Prefill then ``tokens`` single-token steps (greedy); returns (TTFT s, decode s)."""
    from transformers import DynamicCache

    def run() -> tuple[float, float]:
        with torch.no_grad():
            cache = DynamicCache()
            t0 = time.perf_counter()
            out = model(prompt, past_key_values=cache, use_cache=True)
            tok = out.logits[:, -1:].argmax(-1)
            t1 = time.perf_counter()
            for _ in range(tokens):
                out = model(tok, past_key_values=cache, use_cache=True)
                tok = out.logits[:, -1:].argmax(-1)
            return t1 - t0, time.perf_counter() - t1

    return run


def gguf_placeholder_vocab(w: Any, vocab: int) -> None:
    """A placeholder vocabulary of ``vocab`` tokens (``<t0>``, ``<t1>``, ...; BOS 1, EOS 2) in the
    GGUF being written by ``w`` (a ``gguf.GGUFWriter``): the benches decode token ids, never text
    (this one's and moe_bench's)."""
    import gguf  # type: ignore[import-untyped]

    w.add_tokenizer_model("llama")
    w.add_token_list([f"<t{i}>".encode() for i in range(vocab)])
    w.add_token_scores([0.0] * vocab)
    w.add_token_types([gguf.TokenType.NORMAL] * vocab)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)


def _write_gguf(model: Any, path: str, qtype: str) -> None:
    """The model's weights as a llama.cpp GGUF (architecture llama), bf16, Q8_0 or Q4_0 matrices
    (quantized by the ``gguf`` package), float32 norms; a placeholder vocabulary."""
    import gguf  # type: ignore[import-untyped]
    import numpy as np

    T = gguf.GGMLQuantizationType
    cfg = model.config
    w = gguf.GGUFWriter(path, "llama")
    w.add_context_length(1024)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    ftypes = {"q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}
    w.add_file_type(ftypes.get(qtype, gguf.LlamaFileType.MOSTLY_BF16))
    gguf_placeholder_vocab(w, cfg.vocab_size)

    def mat(name: str, t: torch.Tensor) -> None:
        t = t.detach().contiguous()
        if qtype in ("q8_0", "q4_0"):
            qt = T.Q8_0 if qtype == "q8_0" else T.Q4_0
            w.add_tensor(name, gguf.quants.quantize(t.float().numpy(), qt), raw_dtype=qt)
        else:
            w.add_tensor(name, t.to(torch.bfloat16).view(torch.uint8).numpy(), raw_dtype=T.BF16)

    def vec(name: str, t: torch.Tensor) -> None:
        w.add_tensor(name, t.detach().float().numpy().astype(np.float32))

    m = model.model
    mat("token_embd.weight", m.embed_tokens.weight)
    for i, lay in enumerate(m.layers):
        a, mlp = lay.self_attn, lay.mlp
        for key, t in (("attn_q", a.q_proj), ("attn_k", a.k_proj), ("attn_v", a.v_proj), ("attn_output", a.o_proj),
                       ("ffn_gate", mlp.gate_proj), ("ffn_up", mlp.up_proj), ("ffn_down", mlp.down_proj)):  # fmt: skip
            mat(f"blk.{i}.{key}.weight", t.weight)
        vec(f"blk.{i}.attn_norm.weight", lay.input_layernorm.weight)
        vec(f"blk.{i}.ffn_norm.weight", lay.post_attention_layernorm.weight)
    vec("output_norm.weight", m.norm.weight)
    mat("output.weight", model.lm_head.weight)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _llama_cpp_decoder(path: str, prompt: list[int], tokens: int, threads: int) -> Callable[[], tuple[float, float]]:
    from llama_cpp import Llama  # type: ignore[import-not-found]

    llm = Llama(model_path=path, n_ctx=256, n_batch=64, n_threads=threads, n_threads_batch=threads, verbose=False)
    nxt = [(7 * i + 3) % VOCAB for i in range(tokens)]  # the tokens' values do not change the work

    def run() -> tuple[float, float]:
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        t1 = time.perf_counter()
        for t in nxt:
            llm.eval([t])
        return t1 - t0, time.perf_counter() - t1

    return run


def model_decode(
    *, rounds: int, threads: int, layers: int, prompt_len: int, tokens: int, gguf_dir: str | None, kinds: tuple[str, ...] = KINDS,
    torchao_eager: bool = True,
) -> dict[str, Any]:  # fmt: skip
    from torchao.quantization import Float8WeightOnlyConfig, Int8WeightOnlyConfig, quantize_

    bf16 = _model(layers)
    prompt = torch.randint(3, VOCAB, (1, prompt_len), generator=torch.Generator().manual_seed(2))
    runs: dict[str, Callable[[], tuple[float, float]]] = {}
    runs["torch bf16"] = _torch_decoder(bf16, prompt, tokens)

    def ours(model: torch.nn.Module, omp: bool = False) -> Callable[[], tuple[float, float]]:
        inner = _torch_decoder(model, prompt, tokens)

        def run() -> tuple[float, float]:
            before, hm.LINEAR_OMP = hm.LINEAR_OMP, omp  # (the kernel's blocks on torch's OpenMP team, or its own pool)
            try:
                with hm.NativeMatmul(bf16=True):  # (the dispatch offload_weights' CPU-run blocks use)
                    return inner()
            finally:
                hm.LINEAR_OMP = before

        return run

    from .. import _native

    team = _native.omp_available() and threads > 1

    if "bf16" in kinds:
        runs["ours bf16"] = ours(bf16)
        if team:
            runs["ours bf16 (torch's OpenMP team)"] = ours(bf16, omp=True)
    def quantized(kind: str, config: Any, eager_tokens: int | None = None, on_team: bool = False) -> None:
        """The model quantized by torchao's ``config``: ours on it; torchao's eager decode of
        ``eager_tokens`` (where given and asked for); ours on torch's OpenMP team (``on_team``,
        where the process has one)."""
        m = _model(layers)
        quantize_(m, config)
        if torchao_eager and eager_tokens is not None:
            runs[f"torchao {kind} weight-only (eager)"] = _torch_decoder(m, prompt, eager_tokens)
        runs[f"ours {kind}"] = ours(m)
        if on_team and team:
            runs[f"ours {kind} (torch's OpenMP team)"] = ours(m, omp=True)

    if "int8" in kinds:
        quantized("int8", Int8WeightOnlyConfig(), max(2, tokens // 8), on_team=True)
    if "fp8" in kinds:
        quantized("fp8", Float8WeightOnlyConfig())
    if "int4" in kinds:
        quantized("int4", _int4_config(), max(2, tokens // 4), on_team=True)
    notes: list[str] = []
    tmp = None
    try:
        import llama_cpp  # type: ignore[import-not-found]  # noqa: F401

        tmp = tempfile.TemporaryDirectory(dir=gguf_dir)
        ggufs = {"bf16": "bf16", "int8": "q8_0", "int4": "q4_0"}
        for q in (ggufs[k] for k in kinds if k in ggufs):
            p = os.path.join(tmp.name, f"model-{q}.gguf")
            _write_gguf(bf16, p, q)
            runs[f"llama.cpp {q.upper()}"] = _llama_cpp_decoder(p, prompt[0].tolist(), tokens, threads)
    except Exception as e:  # noqa: BLE001 (llama.cpp does not install or run here: said, skipped)
        notes.append(f"llama.cpp not measured: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    steps = {n: (max(2, tokens // (4 if "int4" in n else 8)) if n.startswith("torchao") else tokens) for n in runs}
    rec: dict[str, list[tuple[float, float]]] = {n: [] for n in runs}
    for f in runs.values():
        f()  # warm-up
    names = list(runs)
    for r in range(rounds):
        for n in names[r % len(names) :] + names[: r % len(names)]:
            rec[n].append(runs[n]())
    out: dict[str, Any] = {"notes": notes, "results": {}}
    base = [steps["torch bf16"] / d for _, d in rec["torch bf16"]]
    for n, vals in rec.items():
        tps = [steps[n] / d for _, d in vals]
        out["results"][n] = {
            "tokens_per_s": statistics.median(tps),
            "tokens_per_s_range": (min(tps), max(tps)),
            "ttft_s": statistics.median(t for t, _ in vals),
            "vs_torch_bf16": statistics.median(a / b for a, b in zip(tps, base)),
        }
    for ours_n, peer in (
        ("ours int8", "llama.cpp Q8_0"), ("ours bf16", "llama.cpp BF16"), ("ours int4", "llama.cpp Q4_0"), ("ours int4", "ours int8"),
        ("ours int8 (torch's OpenMP team)", "llama.cpp Q8_0"), ("ours int4 (torch's OpenMP team)", "llama.cpp Q4_0"),
        ("ours int8 (torch's OpenMP team)", "ours int8"), ("ours int4 (torch's OpenMP team)", "ours int4"),
        ("ours bf16 (torch's OpenMP team)", "llama.cpp BF16"), ("ours bf16 (torch's OpenMP team)", "torch bf16"),
        ("ours bf16 (torch's OpenMP team)", "ours bf16"), ("ours int4 (torch's OpenMP team)", "ours int8 (torch's OpenMP team)"),
    ):  # fmt: skip
        if peer in rec and ours_n in rec:
            per = [(steps[ours_n] / a[1]) / (steps[peer] / b[1]) for a, b in zip(rec[ours_n], rec[peer])]
            out["results"][ours_n][f"vs_{peer}"] = statistics.median(per)  # per-round ratio of tokens/s
    if tmp is not None:
        tmp.cleanup()
    return out


def run(
    *, rounds: int, threads: int, model: bool, layers: int = 4, tokens: int = 16, gguf_dir: str | None = None,
    kinds: tuple[str, ...] = KINDS, torchao_eager: bool = True,
) -> dict[str, Any]:  # fmt: skip
    from .. import _native

    print(f"linear bench: {threads} threads, SIMD path {_native.simd_path()}, MAX_ROWS {hm.MAX_ROWS}")
    res: dict[str, Any] = {"bandwidth": bandwidth()}
    bw = res["bandwidth"]
    print(f"  memory: read {bw['read_GBps']:.1f} GB/s, copy {bw['copy_GBps']:.1f} GB/s (read + write)")
    res["layer"] = layer(rounds, threads)
    print("  one decode row through a Llama 8B-class layer (q k v o gate up down), median of rounds:")
    for n, r in res["layer"].items():
        print(
            f"    {n:<34} {r['median_s'] * 1e3:7.2f} ms ({r['min_s'] * 1e3:.2f}-{r['max_s'] * 1e3:.2f})  "
            f"{r['GBps']:5.1f} GB/s of weights  {r['speedup_vs_base']:5.2f}x torch bf16"
            + (f", {r['vs_ours_int8']:.2f}x ours int8" if "vs_ours_int8" in r else "")
        )
    res["rows"] = crossover(max(3, rounds // 2), threads)
    print("  rows of the gate matrix (14336 x 4096), ms:")
    for rows, r in res["rows"].items():
        print(f"    {rows:3d} rows: " + "  ".join(f"{n} {t * 1e3:.2f}" for n, t in r.items()))
    if model:
        m = model_decode(
            rounds=max(2, rounds // 2), threads=threads, layers=layers, prompt_len=64, tokens=tokens, gguf_dir=gguf_dir, kinds=kinds,
            torchao_eager=torchao_eager,
        )  # fmt: skip
        res["model"] = m
        print(f"  decode after a 64-token prompt, {layers} layers of hidden 4096 / FFN 14336, vocab 32000:")
        for n, r in m["results"].items():
            lo, hi = r["tokens_per_s_range"]
            print(
                f"    {n:<34} {r['tokens_per_s']:6.2f} tokens/s ({lo:.2f}-{hi:.2f})  TTFT {r['ttft_s']:.2f} s  "
                f"{r['vs_torch_bf16']:5.2f}x torch bf16"
                + "".join(f", {v:.2f}x {k[3:]}" for k, v in r.items() if k.startswith(("vs_llama", "vs_ours")))
            )
        for note in m["notes"]:
            print(f"    {note}")
    return res
