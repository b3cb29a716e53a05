"""Model shapes the benchmarks step."""

from __future__ import annotations

Shapes = list[tuple[int, ...]]


def gpt2_small_shapes() -> Shapes:
    """The 148 parameter tensors of GPT-2 small (124M parameters)."""
    d, vocab, ctx, layers = 768, 50257, 1024, 12
    shapes: Shapes = [(vocab, d), (ctx, d)]
    for _ in range(layers):
        shapes += [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]
    shapes += [(d,), (d,)]
    return shapes
