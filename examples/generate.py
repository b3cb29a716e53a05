"""Generate with a causal LM whose weights live on the host (pinned RAM or NVMe) and stream to the
GPU block by block: offload_adam.offload_weights.

The model is built from a config (Llama-style, random weights: no download) or loaded from an HF
folder (--checkpoint DIR: built empty with accelerate's init_empty_weights, the weights read
from the safetensors files straight into their storage). Where the folder has a tokenizer, the
prompt is text (--prompt) and the output is printed as text; otherwise the prompt is --prompt-len
random token ids. The script offloads the weights, generates greedily, and prints what a person
running a model larger than their GPU weighs: the VRAM peak, host and NVMe bytes, bytes moved host
to device per token, time to first token and tokens/s, the bound those imply (host-to-device
bandwidth / streamed bytes per token), and the same figures for the model resident when it fits
(with its tokens, which must be the same). Without a GPU it runs through offload_adam's simulated
device, and says so: its times are then the CPU's, not a GPU's.

examples:
    python examples/generate.py                                    # a random 0.16B Llama, every block streamed
    python examples/generate.py --checkpoint DIR --prompt "The capital of France is" --gpu-budget-gb 20
    python examples/generate.py --storage nvme --nvme-dir /mnt/nvme/scratch --prefetch 2
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import time
from collections.abc import Iterator
from typing import Any

import torch

import offload_adam

MiB = 1 << 20


def tokenizer(args: argparse.Namespace) -> Any:
    """The checkpoint folder's tokenizer, or None where it has none (or there is no folder)."""
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    if not args.checkpoint or not any(os.path.exists(os.path.join(args.checkpoint, n)) for n in names):
        return None
    import transformers

    return transformers.AutoTokenizer.from_pretrained(args.checkpoint)


def build(args: argparse.Namespace) -> torch.nn.Module:
    import transformers

    transformers.utils.logging.set_verbosity_error()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    if args.checkpoint:
        from accelerate import init_empty_weights

        cfg = transformers.AutoConfig.from_pretrained(args.checkpoint)
        with init_empty_weights():
            model = transformers.AutoModelForCausalLM.from_config(cfg).to(dtype)
        model.tie_weights()  # as from_pretrained does: init_empty_weights re-creates each registered parameter
        return model.eval()
    heads = max(1, args.d_model // 64)
    cfg = transformers.LlamaConfig(
        num_hidden_layers=args.layers, hidden_size=args.d_model, intermediate_size=int(2.75 * args.d_model) // 64 * 64,
        num_attention_heads=heads, num_key_value_heads=max(1, heads // 4), vocab_size=args.vocab,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(args.seed)
    return transformers.LlamaForCausalLM(cfg).to(dtype).eval()


def sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def _cache_key(model: torch.nn.Module) -> str:
    """The KV cache's argument (and output) name: ``cache`` in recent transformers, else
    ``past_key_values``."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@torch.no_grad()
def generate(model: torch.nn.Module, x: torch.Tensor, tokens: int, cuda: bool) -> tuple[torch.Tensor, float, float]:
    """Greedy decode with the KV cache: (tokens, time to first token, tokens/s after it)."""
    sync(cuda)
    t0 = time.perf_counter()
    out = model(input_ids=x, use_cache=True)
    nxt = out.logits[:, -1:].argmax(-1)
    sync(cuda)
    ttft = time.perf_counter() - t0
    key = _cache_key(model)
    past, got = out[key], [nxt]
    t1 = time.perf_counter()
    for _ in range(tokens - 1):
        out = model(input_ids=nxt, use_cache=True, **{key: past})
        past, nxt = out[key], out.logits[:, -1:].argmax(-1)
        got.append(nxt)
    sync(cuda)
    rate = (tokens - 1) * x.shape[0] / max(time.perf_counter() - t1, 1e-9)
    return torch.cat(got, 1), ttft, rate


class _Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The docstring as written, and each flag's default."""


def main() -> None:
    ap = argparse.ArgumentParser(prog="python examples/generate.py", description=__doc__, formatter_class=_Help)
    ap.add_argument("--checkpoint", metavar="DIR", help="an HF folder (config.json, safetensors, and a tokenizer if it has one) to load instead of a random model")
    ap.add_argument("--layers", type=int, default=8, help="random model: decoder layers")
    ap.add_argument("--d-model", type=int, default=1024, help="random model: hidden size (heads of 64, a quarter as many KV heads)")
    ap.add_argument("--vocab", type=int, default=32000, help="random model: vocabulary size")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"], help="the weights' dtype")
    ap.add_argument("--storage", default="cpu", choices=["cpu", "nvme"], help="offload_weights(storage=...): pinned host RAM or files on an SSD")
    ap.add_argument("--nvme-dir", metavar="DIR", help="--storage nvme: an existing directory on the SSD")
    ap.add_argument("--gpu-budget-gb", type=float, default=None, help="offload_weights(gpu_budget_gb=...): GiB of GPU for the offload; whole blocks stay resident as far as they fit (None: every block streamed)")
    ap.add_argument("--prefetch", type=int, default=2, help="offload_weights(prefetch=...): blocks copied ahead of the one running")
    ap.add_argument("--tokens", type=int, default=32, help="new tokens to generate (greedy, with the KV cache)")
    ap.add_argument("--prompt", default=None, help="the prompt as text (needs the checkpoint's tokenizer; default with one: \"The capital of France is\")")
    ap.add_argument("--prompt-len", type=int, default=64, help="without a tokenizer: the prompt's length in random token ids")
    ap.add_argument("--batch", type=int, default=1, help="sequences generated together (the same prompt)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random weights and the random prompt")
    ap.add_argument("--no-resident", action="store_true", help="skip the comparison with the model resident on the device")
    args = ap.parse_args()
    args.tokenizer = tokenizer(args)
    if args.prompt is not None and args.tokenizer is None:
        ap.error("--prompt: text needs a tokenizer, and this model has none (use --checkpoint DIR with a tokenizer, or --prompt-len N)")
    cuda = torch.cuda.is_available()
    with _device(cuda) as where:
        run(args, cuda, where)


@contextlib.contextmanager
def _device(cuda: bool) -> Iterator[str]:
    if cuda:
        yield f"CUDA, {torch.cuda.get_device_name()}"
        return
    from offload_adam import testing

    with testing.simulated_device(max_delay_s=0.0, lazy=False, keep_open=True):
        yield "no GPU here: the simulated device (CPU tensors as device memory; the times are the CPU's, not a GPU's)"


def run(args: argparse.Namespace, cuda: bool, where: str) -> None:
    model = build(args)
    n = sum(p.numel() for p in model.parameters())
    tok = args.tokenizer
    if tok is not None:
        text = args.prompt if args.prompt is not None else "The capital of France is"
        x = tok([text] * args.batch, return_tensors="pt").input_ids
    else:
        g = torch.Generator().manual_seed(args.seed + 1)
        x = torch.randint(1, model.config.vocab_size, (args.batch, args.prompt_len), generator=g)
    print(
        f"model: {type(model).__name__}, {n / 1e9:.3f}B parameters, {args.dtype}"
        + (f", from {args.checkpoint}" if args.checkpoint else ", random weights")
        + f"; prompt {args.batch}x{x.shape[1]} tokens" + (" (tokenized)" if tok is not None else " (random ids)")
        + f", {args.tokens} new tokens; device: {where}"
    )
    resident: dict[str, Any] | None = None
    if not args.no_resident:
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        fits = not cuda or weights < 0.8 * torch.cuda.mem_get_info()[0]
        if fits:
            ref = resident_copy(model, args)
            if cuda:
                ref = ref.cuda()
                torch.cuda.reset_peak_memory_stats()
            toks, ttft, rate = generate(ref, x.to("cuda" if cuda else "cpu"), args.tokens, cuda)
            resident = {"tokens": toks.cpu(), "ttft": ttft, "rate": rate, "peak": torch.cuda.max_memory_allocated() if cuda else weights}
            del ref
            if cuda:
                torch.cuda.empty_cache()
    kw: dict[str, Any] = {"storage": args.storage, "prefetch": args.prefetch, "gpu_budget_gb": args.gpu_budget_gb}
    if args.storage == "nvme":
        kw["nvme_dir"] = args.nvme_dir
    if args.checkpoint:
        kw["checkpoint"] = args.checkpoint
    t0 = time.perf_counter()
    h = offload_adam.offload_weights(model, **kw)
    setup = time.perf_counter() - t0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    xs = x.to("cuda" if cuda else "cpu")
    generate(model, xs, 2, cuda)  # the first forward records the order
    h.reset_stats()
    toks, ttft, rate = generate(model, xs, args.tokens, cuda)
    rep = h.report()
    passes = max(rep["passes"], 1)
    per_token = rep["h2d_bytes"] / passes
    bw = rep["h2d_bytes"] / rep["h2d_s"] if rep["h2d_s"] > 0 else float("nan")
    bound = bw / rep["streamed_bytes"] * args.batch if rep["streamed_bytes"] else float("inf")
    print(
        f"offload: storage {args.storage}, prefetch {args.prefetch}, {rep['streamed_blocks']} of {rep['blocks']} blocks streamed "
        f"({rep['streamed_bytes'] / MiB:.1f} MiB), resident {rep['gpu_resident_bytes'] / MiB:.1f} MiB, ring {rep['ring_bytes'] / MiB:.1f} MiB; "
        f"set up in {setup:.2f} s"
    )
    print(
        f"VRAM peak of the offload {rep['gpu_peak_bytes'] / MiB:.1f} MiB"
        + (f" (torch.cuda.max_memory_allocated, activations and KV cache included: {torch.cuda.max_memory_allocated() / MiB:.1f} MiB)" if cuda else "")
        + f"; host pinned {rep['host_pinned_bytes'] / MiB:.1f} MiB; NVMe {rep['nvme_bytes'] / MiB:.1f} MiB"
    )
    print(
        f"host to device: {per_token / MiB:.1f} MiB per forward (per token), copies at {bw / 1e9:.2f} GB/s, "
        f"compute waited {rep['stall_s'] * 1e3:.1f} ms for weights over {passes} forwards"
        + (f"; disk read {rep['read_bytes'] / MiB:.1f} MiB, host waited {rep['io_wait_s'] * 1e3:.1f} ms" if args.storage == "nvme" else "")
    )
    print(
        f"time to first token {ttft * 1e3:.1f} ms, decode {rate:.2f} tokens/s; "
        f"bound (H2D bandwidth / streamed bytes per token) {bound:.2f} tokens/s: decode at {rate / bound:.2f} of it"
    )
    if resident is not None:
        same = torch.equal(resident["tokens"], toks.cpu())
        print(
            f"resident: time to first token {resident['ttft'] * 1e3:.1f} ms, decode {resident['rate']:.2f} tokens/s, "
            f"VRAM peak {resident['peak'] / MiB:.1f} MiB; tokens {'identical' if same else 'DIFFER'}"
        )
        if not same:
            raise SystemExit(1)
    if tok is not None:
        print(f"output: {tok.decode(torch.cat([x[0], toks[0].cpu()]), skip_special_tokens=True)!r}")
    h.close()


def resident_copy(model: torch.nn.Module, args: argparse.Namespace) -> torch.nn.Module:
    """The same model with its weights in memory: a copy of the random one, or the checkpoint
    read by transformers (the offloaded one is still empty)."""
    if not args.checkpoint:
        return copy.deepcopy(model)
    import transformers

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    return transformers.AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=dtype).eval()


if __name__ == "__main__":
    main()
