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
(with its tokens, which must be the same). Without a GPU the CPU runs the model
(``device="cpu"``: the real CPU path, not a simulation), and it says so.

With --sums DIR it loads the model `make demo` trained and saved there (examples/train_gpt.py:
sums of two numbers below 100), built empty and filled from its safetensors checkpoint by
offload_weights (storage "nvme" by default), and answers 100 sums such as "17+05=" (the model
writes the sum's digits lowest first, "220;"), checked against the same checkpoint loaded into RAM:
right answers show the model learned, identical ones that the weights arrived intact. It prints
the handle's own account (``repr(h)``, ``h.summary()``). `make generate` runs that.

examples:
    python examples/generate.py --sums runs/sums --storage nvme    # what make generate runs
    python examples/generate.py                                    # a random 0.16B Llama, every block streamed
    python examples/generate.py --checkpoint DIR --prompt "The capital of France is" --gpu-budget-gb 20
    python examples/generate.py --storage nvme --nvme-dir /mnt/nvme/scratch --prefetch 2
"""

from __future__ import annotations

import argparse
import copy
import os
import time
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
    ap.add_argument("--sums", metavar="DIR", help="answer sums with the model make demo saved in DIR (model.safetensors, config.json)")
    ap.add_argument("--placement", default="stream", choices=["stream", "cpu", "auto"], help="offload_weights(placement=...): where a block that is not resident runs (with a GPU)")
    ap.add_argument("--host-budget-gb", type=float, default=None, help="--storage nvme: GiB of RAM for blocks kept there instead of read from the SSD")
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
    if args.storage == "nvme" and not args.nvme_dir:
        args.nvme_dir = os.path.join("runs", "nvme")
        os.makedirs(args.nvme_dir, exist_ok=True)
    cuda = torch.cuda.is_available()
    where = f"CUDA, {torch.cuda.get_device_name()}" if cuda else "no GPU here: the CPU runs the model (device='cpu', the real CPU path)"
    if args.sums:
        sums(args, cuda, where)
        return
    args.tokenizer = tokenizer(args)
    if args.prompt is not None and args.tokenizer is None:
        ap.error("--prompt: text needs a tokenizer, and this model has none (use --checkpoint DIR with a tokenizer, or --prompt-len N)")
    run(args, cuda, where)


def offload_kwargs(args: argparse.Namespace, cuda: bool) -> dict[str, Any]:
    kw: dict[str, Any] = {"storage": args.storage, "prefetch": args.prefetch, "device": None if cuda else "cpu"}
    if cuda:
        kw.update(gpu_budget_gb=args.gpu_budget_gb, placement=args.placement)
    if args.storage == "nvme":
        kw.update(nvme_dir=args.nvme_dir, host_budget_gb=args.host_budget_gb)
    return kw


def read_rate(args: argparse.Namespace, cuda: bool) -> float | None:
    """The SSD's read rate for the bound with the CPU as the device: None where this machine's
    calibration has one (the summary reads it, and says where it came from), else measured now
    under the run's nvme_dir (not stored)."""
    if cuda or args.storage != "nvme":
        return None
    from offload_adam.runtime import calibration, costs

    if calibration.read().rate("disk_read_gbs") is not None:
        return None
    return costs.disk_read_gbs(args.nvme_dir, 256 << 20)


def sums(args: argparse.Namespace, cuda: bool, where: str) -> None:
    """The sums model of make demo, built empty, loaded through offload_weights from its checkpoint,
    asked 100 sums (see the module documentation)."""
    import json
    import sys

    from accelerate import init_empty_weights

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from train_gpt import ANSWER_LEN, GPT, PROMPT_LEN, VOCAB, encode, read_answer, sum_prompt

    ckpt = os.path.join(args.sums, "model.safetensors")
    if not os.path.exists(ckpt):
        raise SystemExit(f"--sums {args.sums}: no model.safetensors there; make demo trains and saves it")
    with open(os.path.join(args.sums, "config.json")) as f:
        cfg = json.load(f)
    with init_empty_weights():  # parameters on the meta device; the causal mask (a buffer) real
        model = GPT(cfg["vocab"], cfg["ctx"], cfg["d_model"], cfg["layers"], cfg["heads"]).to(getattr(torch, cfg["dtype"]))
    model.head.weight = model.tok.weight  # tied again: init_empty_weights re-creates each parameter it registers
    model.eval()
    print(f"the sums model of make demo: {cfg['layers']} layers, d_model {cfg['d_model']}, {cfg['dtype']}, from {ckpt}; device: {where}")
    t0 = time.perf_counter()
    h = offload_adam.offload_weights(model, checkpoint=ckpt, **offload_kwargs(args, cuda))
    print(f"offloaded in {time.perf_counter() - t0:.2f} s: {h!r}")
    g = torch.Generator().manual_seed(args.seed)
    pairs = [(a, b) for a, b in torch.randint(0, 100, (100, 2), generator=g).tolist()]
    dev = "cuda" if cuda else "cpu"
    timed = {"ttft": 0.0, "decode_s": 0.0}

    def answer(m: torch.nn.Module, timing: bool) -> list[str]:
        """Greedy answers to the 100 sums in one batch (every prompt has PROMPT_LEN characters),
        as the model writes them: the sum's digits lowest first, then ';' (train_gpt.sum_answer)."""
        x = torch.tensor([encode(sum_prompt(a, b)) for a, b in pairs], device=dev)
        with torch.no_grad():
            for step in range(ANSWER_LEN):
                sync(cuda)
                t = time.perf_counter()
                nxt = m(x)[:, -1].argmax(-1)
                sync(cuda)
                if timing:
                    timed["ttft" if step == 0 else "decode_s"] += time.perf_counter() - t
                x = torch.cat([x, nxt[:, None]], 1)
        return ["".join(VOCAB[i] for i in row[PROMPT_LEN:]) for row in x.tolist()]

    h.reset_stats()
    outs = answer(model, True)
    got = [read_answer(o) for o in outs]
    right = sum(s == a + b for s, (a, b) in zip(got, pairs))
    # The same checkpoint loaded into RAM the ordinary way: the answers must be the same, right or wrong.
    from safetensors.torch import load_model

    plain = GPT(cfg["vocab"], cfg["ctx"], cfg["d_model"], cfg["layers"], cfg["heads"]).to(getattr(torch, cfg["dtype"])).eval()
    load_model(plain, ckpt)
    same = answer(plain.to(dev), False) == outs
    wrong = [(a, b, s) for s, (a, b) in zip(got, pairs) if s != a + b]
    (a, b), shown = pairs[0], got[0]
    print(
        f"accuracy over 100 sums: {right}/100 (e.g. {a}+{b}={shown if shown is not None else '?'}, written {outs[0]!r}: "
        f"the digits lowest first)"
        + (f"; wrong: {', '.join(f'{x}+{y}={s}' for x, y, s in wrong[:3])}" if wrong else "")
        + "; answers "
        + ("identical to the checkpoint loaded into RAM: the weights arrived intact" if same else "DIFFER from the checkpoint loaded into RAM")
        + ("" if right >= 90 else " (the demo's model knows few sums: was it trained with fewer steps than make demo's?)")
    )
    if not same:
        raise SystemExit(1)
    forwards = ANSWER_LEN - 1
    print(h.summary(ttft_s=timed["ttft"], tokens_per_s=forwards * len(pairs) / max(timed["decode_s"], 1e-9), read_gbs=read_rate(args, cuda)))
    print("(tokens/s: the 100 sums in one batch; each forward reruns the whole context, this model has no KV cache)")
    h.close()


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
    kw = offload_kwargs(args, cuda)
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
    print(f"offloaded in {setup:.2f} s: {h!r}")
    print(h.summary(ttft_s=ttft, tokens_per_s=rate, read_gbs=read_rate(args, cuda)))
    if cuda:
        print(f"torch.cuda.max_memory_allocated: {torch.cuda.max_memory_allocated() / MiB:.1f} MiB")
    if resident is not None:
        same = torch.equal(resident["tokens"], toks.cpu())
        memory = f"VRAM peak {resident['peak'] / MiB:.1f} MiB" if cuda else f"weights in RAM {resident['peak'] / MiB:.1f} MiB"
        print(
            f"resident: time to first token {resident['ttft'] * 1e3:.1f} ms, decode {resident['rate']:.2f} tokens/s, "
            f"{memory}; tokens {'identical' if same else 'DIFFER'}"
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
