"""The planner counts our optimizer's host bytes with the layout code the optimizer allocates
from: for real models it agrees with memory_report()."""

from __future__ import annotations

import pytest
import torch

from offload_adam import AdamW, testing
from offload_adam.tools.plan import main, optimizer_host_bytes


def _model(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(1000, 64), torch.nn.Linear(64, 256), torch.nn.Linear(256, 64)).to(dtype)


@pytest.mark.parametrize("streamed", [False, True], ids=["cpu", "offloaded"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16, torch.uint8, torch.float8_e4m3fn])
def test_planned_host_bytes_equal_memory_report(streamed: bool, dtype: torch.dtype, state_dtype: torch.dtype) -> None:
    m = _model(dtype)
    params = [(p.numel(), p.dtype) for p in m.parameters()]
    if streamed:
        with testing.simulated_device(seed=0, max_delay_s=0.0):
            opt = AdamW(m.parameters(), state_dtype=state_dtype, bucket_mb=0.05)
            held = opt.memory_report()["host_bytes"]
    else:
        opt = AdamW(m.parameters(), state_dtype=state_dtype, bucket_mb=0.05)
        held = opt.memory_report()["host_bytes"]
    planned = optimizer_host_bytes(params, state_dtype=state_dtype, streamed=streamed, bucket_bytes=int(0.05 * (1 << 20)))
    assert abs(planned - held) <= 0.01 * held, (planned, held)


def test_plan_command_prints_what_fits(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--params", "13e9", "--gpu-gb", "24", "--host-gb", "256", "--bf16-moments"]) == 0
    out = capsys.readouterr().out
    assert "torch.optim.AdamW on the GPU, DDP (fp32 weights, grads, moments): does not fit (GPU)" in out
    assert "FSDP2 + CPUOffloadPolicy + offload_adam (fp32 shards): fits" in out


class _Layers(torch.nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 64)) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for m in self.layers:
            x = m(x)
        return x


@pytest.mark.parametrize("compact", [False, True], ids=["fp32-state", "uint8-kahan"])
@pytest.mark.parametrize("prefetch", [1, 2])
def test_planned_streamed_weights_equal_what_offload_weights_allocates(prefetch: int, compact: bool) -> None:
    """The streamed-weights configurations: the ring the offload allocates, and on the host the
    pinned weights plus the optimizer's buffers (the step writes the weights in place)."""
    import offload_adam
    from offload_adam.tools.plan import streamed_ring_bytes

    torch.manual_seed(0)
    m = _Layers(4).to(torch.bfloat16)
    params = [(p.numel(), p.dtype) for p in m.parameters()]
    with testing.simulated_device(seed=0, max_delay_s=0.0):
        h = offload_adam.offload_weights(m, prefetch=prefetch)
        kw: dict = {"state_dtype": torch.uint8, "master_dtype": torch.bfloat16} if compact else {}
        opt = AdamW(m.parameters(), bucket_mb=0.05, **kw)
        rep = h.report()
        held = rep["host_pinned_bytes"] + opt.memory_report()["host_bytes"]
        layer = {b.nbytes for b in h.blocks}
        assert len(h.blocks) == 4 and len(layer) == 1
        assert rep["ring_bytes"] == streamed_ring_bytes(4, layer.pop(), prefetch)
        opt.close()
        h.close()
    planned = sum(n * 2 for n, _ in params) + optimizer_host_bytes(params, streamed=True, bucket_bytes=int(0.05 * (1 << 20)), **kw)
    assert abs(planned - held) <= 0.01 * held, (planned, held)


def test_plan_prints_the_streamed_weights_recipe(capsys: pytest.CaptureFixture[str]) -> None:
    # 8-bit moments: the 13B fine-tune with weights streamed fits in 128 GiB of RAM
    assert main(["--params", "13e9", "--gpu-gb", "24", "--host-gb", "128", "--state-dtype", "uint8"]) == 0
    out = capsys.readouterr().out
    assert "uint8 moments" in out
    assert "offload_weights + offload_adam offload='cpu', bf16 model, free_gradients (ring of 3 layers): fits" in out
    assert main(["--params", "13e9", "--gpu-gb", "24", "--host-gb", "128", "--state-dtype", "float8_e4m3fn"]) == 0
    out = capsys.readouterr().out
    assert "float8_e4m3fn moments" in out
    assert "offload_weights + offload_adam offload='cpu', bf16 model, free_gradients (ring of 3 layers): fits" in out
    assert main(["--params", "13e9", "--gpu-gb", "24", "--host-gb", "64", "--nvme-gb", "400", "--bf16-moments"]) == 0
    out = capsys.readouterr().out
    assert "offload_weights + offload_adam offload='nvme', bf16 model, free_gradients (ring of 3 layers): fits" in out
    assert "offload_weights + offload_adam offload='cpu', bf16 model, free_gradients (ring of 3 layers): does not fit (host)" in out
