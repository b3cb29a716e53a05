"""``python -m offload_adam bench --placement DIR``: a model larger than its RAM budget run on the
CPU, measured in one run.

A Llama-shaped bf16 model built from a config with random weights (about 1B parameters by
default, ``--placement-params``), a 128-token prompt then 32 greedy tokens at batch 1, every
configuration on the CPU (``device="cpu"``):

(a) the model resident in RAM, plain torch;
(b) ours, ``storage="nvme"`` under DIR with ``host_budget_gb`` at 25% of the weights: the other
    blocks read ahead from the SSD (``O_DIRECT``) into a RAM ring of ``prefetch + 1`` pages of a
    layer (the head, larger, kept in RAM), the embedding's rows read alone;
(c) ours, ``storage="cpu"``: every block in RAM (the offload's overhead on the CPU), in
    alternating rounds with (a) (``--rounds``; the ratio per round, and its median);
(d) accelerate's disk offload on the CPU: the same 25% on ``"cpu"`` in a ``device_map``, the rest
    ``"disk"`` in an ``offload_folder`` (memory-mapped files), where accelerate is installed.

With ``--quantize int8`` (or ``fp8``), in the same run:

(e) ours as (b), the weights quantized as they load (``quantize=`` torchao's weight-only config),
    at the same host budget in bytes: tokens/s, TTFT, bytes per token from the SSD and their
    bound, and its decode rate over (b)'s (target: at least 1.7x while disk-bound); then the CPU
    decode of an 8B-class shape against llama.cpp (``linear_bench``'s model comparison).

Each gives time to first token (TTFT), decode tokens/s, the growth of the process's peak
resident memory over the run and of its files' page cache (``mincore``); (b) also its bound:
the bytes per token it reads from the SSD (``token_bytes``: the pages of the blocks on it, one
4 KiB unit of the embedding) over this disk's ``O_DIRECT`` read rate (measured here, through
the same I/O engine), the host's time waiting for the disk and running blocks. Targets: (b) at least 0.85 of its bound, (c) at least 0.95x
(a), (b)'s page cache at most 5% of the bytes it read. The CPU's 1-row bf16 matmul is also
measured against the host's read bandwidth: below 0.7 of it, torch's kernel, not the offload,
bounds a decode step from RAM.
"""

from __future__ import annotations

import copy
import gc
import os
import time
from typing import Any

import torch

from ..weights import costs
from ..runtime.pages import page_cache_bytes

GiB = 1 << 30


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def _reset_peak() -> int:
    """Resets the process's peak resident memory (``clear_refs``); the resident memory now."""
    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return _status("VmRSS")


def _thread_cpu() -> dict[str, float]:
    """CPU seconds of this process's threads so far, by thread name (``/proc/self/task``): the I/O
    engine's io_uring driver (``offload-adam-ur``), the native kernel's pool (``offload-adam-N``),
    and ``python``: the interpreter's threads (the main one, torch's OpenMP workers, the CRC pool)."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for t in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{t}/stat") as f:
                s = f.read()
        except OSError:
            continue
        name = s[s.index("(") + 1 : s.rindex(")")]
        fields = s[s.rindex(")") + 2 :].split()
        key = "kernel pool" if name.startswith("offload-adam-") and name[13:].isdigit() else name
        out[key] = out.get(key, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def _dir_cache(path: str) -> int:
    """Bytes of the files under ``path`` in the page cache."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += page_cache_bytes(os.path.join(root, name))
            except OSError:
                pass
    return total


def llama(params: float, seed: int = 0) -> Any:
    """A Llama-shaped bf16 model of about ``params`` parameters (hidden 2048, FFN 5632, grouped-
    query attention with 4 KV heads, a 32000-token vocabulary; the layers' count sets the size)."""
    import transformers

    transformers.utils.logging.set_verbosity_error()
    d, ffn, vocab = 2048, 5632, 32000
    per_layer = 2 * d * d + 2 * d * 256 + 3 * d * ffn
    layers = max(1, round((params - 2 * vocab * d) / per_layer))
    cfg = transformers.LlamaConfig(
        num_hidden_layers=layers, hidden_size=d, intermediate_size=ffn, num_attention_heads=32, num_key_value_heads=4,
        vocab_size=vocab, max_position_embeddings=512, tie_word_embeddings=False,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    model = model.to_empty(device="cpu").to(torch.bfloat16)  # type: ignore[arg-type]
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=g)
    model.model.rotary_emb = type(model.model.rotary_emb)(cfg)  # its inv_freq buffer, computed on the CPU
    return model.eval()


@torch.no_grad()
def decode(model: torch.nn.Module, x: torch.Tensor, tokens: int) -> tuple[torch.Tensor, float, float]:
    """Greedy decode with the default KV cache: (tokens, TTFT, tokens/s after the first)."""
    t0 = time.perf_counter()
    out = model(input_ids=x, use_cache=True)
    nxt = out.logits[:, -1:].argmax(-1)
    ttft = time.perf_counter() - t0
    past, got = out.past_key_values, [nxt]
    t1 = time.perf_counter()
    for _ in range(tokens - 1):
        out = model(input_ids=nxt, use_cache=True, past_key_values=past)
        past, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
        got.append(nxt)
    return torch.cat(got, 1), ttft, (tokens - 1) / max(time.perf_counter() - t1, 1e-9)


def _case(name: str, model: torch.nn.Module, x: torch.Tensor, tokens: int, files: str | None = None) -> dict[str, Any]:
    base = _reset_peak()
    toks, ttft, rate = decode(model, x, tokens)
    out = {"case": name, "ttft_s": ttft, "tokens_s": rate, "rss_growth_bytes": _status("VmHWM") - base, "tokens": toks}
    if files is not None:
        out["page_cache_bytes"] = _dir_cache(files)
    return out


def _median(cases: list[dict[str, Any]]) -> dict[str, Any]:
    """The round with the median decode rate (its TTFT and RSS with it), and every round's rate."""
    ranked = sorted(cases, key=lambda c: c["tokens_s"])
    out = dict(ranked[len(ranked) // 2])
    out["rounds_tokens_s"] = [c["tokens_s"] for c in cases]
    out["rounds_ttft_s"] = [c["ttft_s"] for c in cases]
    return out


def _nvme_case(
    name: str, model: torch.nn.Module, x: torch.Tensor, tokens: int, nvme_dir: str, disk: float, budget: int, prefetch: int,
    threads: int | None, **kw: Any,
) -> dict[str, Any]:  # fmt: skip
    """(b) or (e): ``model`` on the CPU from the SSD, ``budget`` bytes of it in RAM."""
    import offload_adam

    h = offload_adam.offload_weights(
        model, device="cpu", storage="nvme", nvme_dir=nvme_dir, prefetch=prefetch, host_budget_gb=budget / GiB,
        num_threads=threads, **kw,
    )  # fmt: skip
    decode(model, x[:, :8], 2)  # the first forward records the order
    h.reset_stats()
    cpu0, t0 = _thread_cpu(), time.perf_counter()
    out = _case(name, model, x, tokens)
    wall = time.perf_counter() - t0
    cpu1 = _thread_cpu()
    out["threads_cpu_s"] = {k: v - cpu0.get(k, 0.0) for k, v in cpu1.items() if v - cpu0.get(k, 0.0) >= 0.01}
    out["wall_s"] = wall
    r = h.report()
    out["page_cache_bytes"] = r["page_cache_bytes"]
    out["read_bytes"] = r["read_bytes"]
    per_token = token_bytes(h.plan)
    out["read_per_forward"] = r["read_bytes"] / max(r["passes"], 1)  # (the prompt's rows and the last read-ahead too)
    out["cpu_s"] = r["cpu_s"]
    out["matmuls"] = f"native {r['native_calls']}, torch {r['torch_calls']} (bf16 to the native kernel: {r['native_bf16']})"
    out["bound_tokens_s"] = disk * 1e9 / per_token
    out["of_bound"] = out["tokens_s"] / out["bound_tokens_s"]
    out["bytes_per_token"] = per_token
    out["calls"] = r["calls"]
    out["io_wait_s"] = r["io_wait_s"]
    h.close()
    return out


def token_bytes(plan: Any) -> int:
    """The bytes a decode token reads from the SSD under ``plan`` (batch 1): the page of each block
    on it, but the embeddings looked up by rows (one 4 KiB unit each) and the blocks with a page
    of their own (read once, kept)."""
    from ..runtime.pages import ALIGN

    hr = plan.host_ring
    own = {i for i, _ in hr.own}
    return sum(plan.blocks[i].nbytes for i in plan.on_nvme if i not in hr.rows and i not in own) + ALIGN * len(hr.rows)


def run(
    nvme_dir: str, *, params: float = 1e9, prompt: int = 128, tokens: int = 32, prefetch: int = 2, threads: int | None = None,
    rounds: int = 3, quantize: str | None = None,
) -> dict[str, Any]:  # fmt: skip
    import offload_adam

    model = llama(params)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    x = torch.randint(1, 32000, (1, prompt), generator=torch.Generator().manual_seed(1))
    print(
        f"placement bench: Llama-shaped bf16, {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters "
        f"({weights / GiB:.2f} GiB), {model.config.num_hidden_layers} layers; prompt {prompt} tokens, {tokens} greedy "
        f"tokens, batch 1, device cpu, {torch.get_num_threads()} threads"
    )
    disk = costs.disk_read_gbs(nvme_dir, 1 << 30)
    host = costs.host_read_gbs()
    gemv = costs.cpu_matmul_gflops(torch.bfloat16, 1)  # a 1-row bf16 matmul reads 2 bytes per 2 flops: GFLOP/s = GB/s
    print(f"this machine: O_DIRECT read {disk:.2f} GB/s, host read {host:.2f} GB/s, torch's 1-row bf16 matmul reads {gemv:.2f} GB/s "
          f"({gemv / host:.2f} of the host's read bandwidth{'; below 0.7: torch kernel-bound where the native kernel does not take bf16 (native_matmul)' if gemv < 0.7 * host else ''})")
    results: dict[str, Any] = {"params": sum(p.numel() for p in model.parameters()), "weights_bytes": weights, "disk_read_gbs": disk,
                               "host_read_gbs": host, "gemv_gbs": gemv, "cases": []}  # fmt: skip
    # (a) and (c) in alternating rounds (the machine is shared: the ratio of the medians counts).
    ours_c = copy.deepcopy(model)
    hc = offload_adam.offload_weights(ours_c, device="cpu", storage="cpu", num_threads=threads)
    rounds_a, rounds_c = [], []
    for _ in range(rounds):
        rounds_a.append(_case("(a) resident in RAM, plain torch", model, x, tokens))
        rounds_c.append(_case("(c) ours, storage cpu", ours_c, x, tokens))
    hc.close()
    del ours_c, hc
    a, c = _median(rounds_a), _median(rounds_c)
    results["cases"].append(a)

    budget = int(0.25 * weights)
    b = _nvme_case("(b) ours, storage nvme, host budget 25%", copy.deepcopy(model), x, tokens, nvme_dir, disk, budget, prefetch, threads)
    results["cases"].append(b)
    e: dict[str, Any] | None = None
    if quantize is not None:
        from torchao import quantization as tq  # type: ignore[import-untyped]

        config = {"int8": tq.Int8WeightOnlyConfig, "fp8": tq.Float8WeightOnlyConfig}[quantize]()
        e = _nvme_case(
            f"(e) ours as (b), {quantize} weight-only (quantize=), same budget", copy.deepcopy(model), x, tokens, nvme_dir,
            disk, budget, prefetch, threads, quantize=config,
        )  # fmt: skip
        results["cases"].append(e)

    results["cases"].append(c)

    try:
        import accelerate  # type: ignore[import-untyped]
    except ImportError:
        accelerate = None
    if accelerate is not None:
        folder = os.path.join(nvme_dir, "accelerate-offload")
        m = copy.deepcopy(model)
        names = [f"model.layers.{i}" for i in range(model.config.num_hidden_layers)]
        keep = int(0.25 * len(names))
        dmap = {"model.embed_tokens": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "disk"}
        dmap.update({n: "cpu" if i < keep else "disk" for i, n in enumerate(names)})
        m = accelerate.dispatch_model(m, device_map=dmap, offload_dir=folder)
        decode(m, x[:, :8], 2)
        d = _case("(d) accelerate disk offload (device_map 'disk', offload_folder)", m, x, tokens, files=folder)
        del m
        gc.collect()
        import shutil

        shutil.rmtree(folder, ignore_errors=True)
        results["cases"].append(d)

    ref = a["tokens"]
    for c_ in results["cases"]:
        c_["same_tokens"] = bool(torch.equal(c_.pop("tokens"), ref))
        line = (
            f"{c_['case']:<64} TTFT {c_['ttft_s']:7.2f} s  decode {c_['tokens_s']:6.2f} tokens/s  "
            f"peak RSS +{c_['rss_growth_bytes'] / GiB:5.2f} GiB"
        )
        if "page_cache_bytes" in c_:
            line += f"  page cache {c_['page_cache_bytes'] / 2**20:7.1f} MiB"
        line += "  tokens " + ("same" if c_["same_tokens"] else "DIFFER")
        print(line)
    print(
        f"(b): {b['bytes_per_token'] / GiB:.2f} GiB per token from the SSD; bound {b['bound_tokens_s']:.3f} tokens/s; "
        f"at {b['of_bound']:.2f} of it (target 0.85); page cache {b['page_cache_bytes'] / max(b['read_bytes'], 1):.2%} "
        f"of the {b['read_bytes'] / GiB:.1f} GiB read (target 5%); calls {b['calls']}; host waited {b['io_wait_s']:.1f} s for the disk, "
        f"ran blocks {b['cpu_s']:.1f} s; read {b['read_per_forward'] / GiB:.2f} GiB per forward"
    )
    print(
        f"(b) where the time goes, over its {b['wall_s']:.1f} s (prompt and decode): host waiting for the disk {b['io_wait_s']:.1f} s, "
        f"in blocks {b['cpu_s']:.1f} s; CPU seconds by thread: "
        + ", ".join(f"{k} {v:.1f}" for k, v in sorted(b["threads_cpu_s"].items(), key=lambda kv: -kv[1]))
        + f"; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; F.linear calls in blocks: {b['matmuls']}"
    )
    if e is not None:
        print(
            f"(e): {e['bytes_per_token'] / GiB:.2f} GiB per token from the SSD ({e['bytes_per_token'] / b['bytes_per_token']:.2f}x (b)'s); "
            f"bound {e['bound_tokens_s']:.3f} tokens/s; at {e['of_bound']:.2f} of it; decode {e['tokens_s'] / b['tokens_s']:.2f}x (b) "
            f"(target 1.7x), TTFT {e['ttft_s'] / b['ttft_s']:.2f}x (b)'s; tokens equal to bf16's: {e['same_tokens']} (quantized: "
            f"they may differ); calls {e['calls']}; host waited {e['io_wait_s']:.1f} s for the disk"
        )
        results["quantized_over_bf16"] = e["tokens_s"] / b["tokens_s"]
    ratios = sorted(y / x_ for x_, y in zip(a["rounds_tokens_s"], c["rounds_tokens_s"]))
    print(
        f"(c)/(a) decode, per round: {', '.join(f'{v:.2f}x' for v in ratios)}; median {ratios[len(ratios) // 2]:.2f}x (target 0.95x); "
        f"TTFT (a)/(c) {a['ttft_s'] / c['ttft_s']:.2f}x"
    )
    return results
