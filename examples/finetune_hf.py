"""Fine-tune a Hugging Face causal LM that is larger than the GPU: its weights streamed to the GPU
block by block (offload_adam.offload_weights), its optimizer state in host RAM or on an SSD
(offload_adam.AdamW), in a plain training loop.

The model is built with AutoModelForCausalLM.from_config: a small Llama with random weights by
default (nothing is downloaded), or the config of an HF folder (--model DIR), built empty under
accelerate's init_empty_weights and filled from the folder's safetensors by offload_weights
(checkpoint=), so the weights are never in RAM twice. The data: with --text FILE, the file's text
cut into windows of --seq tokens by the folder's tokenizer; otherwise a task the model learns in a
few dozen steps (sequences that count upward, modulo the vocabulary). The script prints the loss,
what crossed PCIe per step, the optimizer's host (and NVMe) bytes and the time per step.

Without a GPU it runs through offload_adam's simulated device (CPU tensors stand for device
memory), and says so: its times are the CPU's, not a GPU's.

examples:
    python examples/finetune_hf.py                                       # random 4-layer Llama, state in RAM
    python examples/finetune_hf.py --offload nvme --nvme-dir /mnt/nvme/scratch --state-dtype uint8 --master-dtype bfloat16
    python examples/finetune_hf.py --model DIR --text train.txt --seq 512 --batch 4 --steps 200 --gpu-budget-gb 8
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Iterator

import torch

import offload_adam

MiB = 1 << 20
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


class _Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The docstring as written, and each flag's default."""


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python examples/finetune_hf.py", description=__doc__, formatter_class=_Help)
    ap.add_argument("--model", metavar="DIR", help="an HF folder (config.json, safetensors, tokenizer) to fine-tune instead of a random Llama")
    ap.add_argument("--layers", type=int, default=4, help="random model: decoder layers")
    ap.add_argument("--d-model", type=int, default=256, help="random model: hidden size (heads of 64)")
    ap.add_argument("--vocab", type=int, default=256, help="random model: vocabulary size")
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="the weights' dtype")
    ap.add_argument("--text", metavar="FILE", help="train on this text file (needs --model with a tokenizer); default: the counting task")
    ap.add_argument("--steps", type=int, default=40, help="optimizer steps")
    ap.add_argument("--batch", type=int, default=8, help="sequences per step")
    ap.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    ap.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (linear warm-up over 10%% of the steps, then cosine)")
    ap.add_argument("--clip", type=float, default=1.0, help="clip the gradients' total norm to this (opt.clip_grad_norm_)")
    ap.add_argument("--storage", "--offload", default="cpu", choices=["cpu", "nvme"], help="AdamW(storage=...): the state in host RAM or on an SSD (--offload: the former name)")
    ap.add_argument("--nvme-dir", metavar="DIR", help="--offload nvme: an existing directory on the SSD")
    ap.add_argument("--state-dtype", default="float32", choices=["float32", "bfloat16", "uint8"], help="AdamW(state_dtype=...): the moments")
    ap.add_argument("--master-dtype", default="float32", choices=["float32", "bfloat16"], help="AdamW(master_dtype=...): bfloat16 keeps no fp32 masters (Kahan compensation; bf16 weights)")
    ap.add_argument("--gpu-budget-gb", type=float, default=None, help="offload_weights(gpu_budget_gb=...): GiB of GPU for resident blocks and the ring (None: every block streamed)")
    ap.add_argument("--prefetch", type=int, default=2, help="offload_weights(prefetch=...): blocks copied ahead")
    ap.add_argument("--checkpointing", action="store_true", help="model.activation_checkpointing_enable() (gradient_checkpointing_enable in older transformers): recompute activations in backward")
    ap.add_argument("--offload-activations", action="store_true", help="offload_adam.offload_activations() around each forward")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random weights and the data")
    ap.add_argument("--save", metavar="DIR", help="save the fine-tuned model there as an HF folder, after the weights are back on the host")
    return ap


def build(args: argparse.Namespace) -> tuple[torch.nn.Module, dict[str, object]]:
    """The model on the CPU (or empty, to be filled by offload_weights) and offload_weights' extra arguments."""
    import transformers

    transformers.utils.logging.set_verbosity_error()
    dtype = DTYPES[args.dtype]
    if args.model:
        from accelerate import init_empty_weights

        with init_empty_weights():
            model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(args.model), dtype=dtype)
        model.tie_weights()  # as from_pretrained does
        return model, {"checkpoint": args.model}
    cfg = transformers.LlamaConfig(
        num_hidden_layers=args.layers, hidden_size=args.d_model, intermediate_size=int(2.75 * args.d_model) // 64 * 64,
        num_attention_heads=max(1, args.d_model // 64), num_key_value_heads=max(1, args.d_model // 256),
        vocab_size=args.vocab, max_position_embeddings=max(2048, args.seq),
    )  # fmt: skip
    torch.manual_seed(args.seed)
    return transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype), {}


def batches(args: argparse.Namespace, vocab: int) -> Iterator[torch.Tensor]:
    """Token batches (batch, seq): windows of --text, or sequences counting upward from a random start."""
    g = torch.Generator().manual_seed(args.seed + 1)
    if args.text:
        import transformers

        tok = transformers.AutoTokenizer.from_pretrained(args.model)
        with open(args.text) as f:
            ids = torch.tensor(tok(f.read()).input_ids)
        if len(ids) <= args.seq:
            raise SystemExit(f"--text: {args.text} has {len(ids)} tokens, fewer than --seq {args.seq} + 1")
        while True:
            starts = torch.randint(0, len(ids) - args.seq, (args.batch,), generator=g)
            yield torch.stack([ids[s : s + args.seq] for s in starts.tolist()])
    while True:
        starts = torch.randint(0, vocab, (args.batch, 1), generator=g)
        yield (starts + torch.arange(args.seq)) % vocab


@contextlib.contextmanager
def _device() -> Iterator[tuple[str, torch.device | None]]:
    """(what the script runs on, where the inputs go): the GPU, or the simulated device."""
    if torch.cuda.is_available():
        yield f"CUDA, {torch.cuda.get_device_name()}", torch.device("cuda")
        return
    from offload_adam import testing

    with testing.simulated_device(max_delay_s=0.0, lazy=False) as sim:
        yield f"no GPU here: the simulated device, {sim.torch_device} (its memory the CPU's; the times are the CPU's, not a GPU's)", sim.torch_device


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if args.text and not args.model:
        ap.error("--text needs --model DIR (its tokenizer cuts the text)")
    if args.storage == "nvme" and not args.nvme_dir:
        ap.error("--storage nvme needs --nvme-dir, a directory on the SSD")
    with _device() as (where, inputs_to):
        run(args, where, inputs_to)
    return 0


def run(args: argparse.Namespace, where: str, inputs_to: torch.device | None) -> None:
    model, kw = build(args)
    n = sum(p.numel() for p in model.parameters())
    print(f"model: {type(model).__name__}, {n / 1e6:.1f}M parameters, {args.dtype}" + (f", from {args.model}" if args.model else ", random weights") + f"; device: {where}")
    if args.checkpointing:  # the older name where the newer is missing
        (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    # First the weights: to pinned host RAM, streamed to the device block by block.
    h = offload_adam.offload_weights(model, gpu_budget_gb=args.gpu_budget_gb, prefetch=args.prefetch, **kw)  # type: ignore[arg-type]
    # Then the optimizer over the streamed parameters: its step writes the host copy the next
    # forward streams. free_gradients: the GPU never holds more than a window of gradients.
    opt = offload_adam.AdamW(
        model.parameters(), lr=args.lr, weight_decay=0.0, free_gradients=True, storage=args.storage, nvme_dir=args.nvme_dir,
        state_dtype=getattr(torch, args.state_dtype), master_dtype=getattr(torch, args.master_dtype),
    )  # fmt: skip
    from transformers import get_cosine_schedule_with_warmup

    sched = get_cosine_schedule_with_warmup(opt, max(1, args.steps // 10), args.steps)
    model.train()
    vocab = model.config.vocab_size
    losses, times, up = [], [], []
    data = batches(args, vocab)
    for step in range(args.steps):
        x = next(data)
        if inputs_to is not None:
            x = x.to(inputs_to)
        h.reset_stats()
        t0 = time.perf_counter()
        with offload_adam.offload_activations() if args.offload_activations else contextlib.nullcontext():
            loss = model(input_ids=x, labels=x).loss  # HF shifts the labels
        loss.backward()
        opt.clip_grad_norm_(args.clip)
        opt.step()
        sched.step()
        opt.zero_grad()
        if inputs_to is not None and inputs_to.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        up.append(h.report()["h2d_bytes"])
        if step % max(1, args.steps // 10) == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {losses[-1]:.4f}  lr {sched.get_last_lr()[0]:.2e}")
    k = max(1, len(losses) // 5)
    print(
        f"loss: first {statistics.mean(losses[:k]):.4f}, last {statistics.mean(losses[-k:]):.4f} (means of {k} steps); "
        f"step {statistics.median(times[1:] or times) * 1e3:.1f} ms (median)"
    )
    print(f"weights streamed: {statistics.median(up) / MiB:.1f} MiB up per step; {h!r}")
    print(opt.summary())  # the optimizer's own account: parameters, the state's dtypes, bytes per tier
    opt.close()  # the optimizer first (its step writes the streamed weights' host copy)
    h.close()  # then the weights come back to the host, as ordinary tensors
    if args.save:
        model.save_pretrained(args.save)  # an HF folder: from_pretrained, generate.py --checkpoint
        print(f"saved to {args.save}")


if __name__ == "__main__":
    sys.exit(main())
