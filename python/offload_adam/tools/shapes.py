"""Model shapes the benchmarks step, and the Llama-style models they train."""

from __future__ import annotations

import torch

Shapes = list[tuple[int, ...]]


def gpt2_small_shapes() -> Shapes:
    """The 148 parameter tensors of GPT-2 small (124M parameters)."""
    d, vocab, ctx, layers = 768, 50257, 1024, 12
    shapes: Shapes = [(vocab, d), (ctx, d)]
    for _ in range(layers):
        shapes += [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]
    shapes += [(d,), (d,)]
    return shapes


def llama(layers: int, d: int, vocab: int, device: str, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """A Llama-style causal LM built from a config (transformers), random weights, in training
    mode: ``layers`` decoder layers of width ``d``, MLP 2.75 d, heads of 128, GQA by 4."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        num_hidden_layers=layers, hidden_size=d, intermediate_size=int(2.75 * d) // 64 * 64, num_attention_heads=max(1, d // 128),
        num_key_value_heads=max(1, d // 512), vocab_size=vocab, max_position_embeddings=4096,
    )  # fmt: skip
    with torch.device(device):
        model: torch.nn.Module = transformers.LlamaForCausalLM(cfg)
    return model.to(dtype).train()
