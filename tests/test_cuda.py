"""GPU offload on a real CUDA device (skipped without one): the same loop as test_streaming.py,
with streams, events and pinned host memory."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from offload_adam import AdamW

pytestmark = pytest.mark.cuda


class Net(torch.nn.Module):
    def __init__(self, d: int = 256, layers: int = 4, vocab: int = 97) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(layers))
        self.head = torch.nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for layer in self.layers:
            h = torch.nn.functional.gelu(layer(h))
        return self.head(h)


def run(dtype: torch.dtype, **kw: Any) -> None:
    torch.manual_seed(0)
    a = Net().cuda().to(dtype)
    b = copy.deepcopy(a).float()
    ours = AdamW(a.parameters(), lr=1e-3, weight_decay=0.1, bucket_mb=0.25, **kw)
    ref = torch.optim.AdamW(b.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    for _ in range(20):
        x = torch.randint(0, 97, (8, 32), device="cuda")
        for m, o in ((a, ours), (b, ref)):
            o.zero_grad()
            loss = torch.nn.functional.cross_entropy(m(x).float().flatten(0, 1), x.flatten())
            loss.backward()
            o.step()
        if dtype != torch.float32:
            # torch in fp32 from our (rounded) weights and gradients is another trajectory:
            # compare the masters with torch only for fp32 models
            b.load_state_dict({k: v.float() for k, v in a.state_dict().items()})
    ours.synchronize()
    torch.cuda.synchronize()
    if dtype == torch.float32:
        for p, q in zip(a.parameters(), b.parameters()):
            assert (p - q).abs().max().item() <= 2e-5
    for p in a.parameters():
        st = ours.state[p]
        assert st["exp_avg"].device.type == "cpu" and st["master_param"].device.type == "cpu"
        assert st["exp_avg"].is_pinned()
        assert torch.equal(p.detach().cpu(), st["master_param"].to(dtype))


@pytest.mark.parametrize("mode", [{}, {"async_step": True}, {"free_gradients": True}])
def test_cuda_training_matches_torch(mode: dict[str, Any]) -> None:
    run(torch.float32, **mode)


def test_cuda_bf16_model_fp32_masters() -> None:
    run(torch.bfloat16)


def test_cuda_memory_holds_no_optimizer_state() -> None:
    torch.manual_seed(0)
    m = Net(d=1024, layers=8).cuda()
    before = torch.cuda.memory_allocated()
    opt = AdamW(m.parameters(), free_gradients=True, bucket_mb=4)
    x = torch.randint(0, 97, (4, 64), device="cuda")
    torch.cuda.reset_peak_memory_stats()
    m(x).float().sum().backward()
    opt.step()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= before + (1 << 20)
    assert opt.memory_report()["gpu_bytes"] == 0
    rep = opt.memory_report()
    assert rep["host_bytes"] <= 1.05 * rep["host_tight_bytes"]
