"""Training with streamed weights against a training on the CPU: these stay on the simulated
device's former mode, whose device memory is the CPU's (``simulated_device(host_memory=True)``).
Their reference is a training on the CPU (bf16 weights updated in their host copy need the
weights on the host), which a model on the simulated device of its own is not bitwise: there
autograd takes the composite backward of some operations (``silu``'s: sigmoid and products, not
the CPU's ``silu_backward``), other bits than the CPU's (docs/limits.md)."""

from __future__ import annotations

import pytest
import torch
from test_weights_training import MODELS, batches, train, weights

import offload_adam
from offload_adam import testing


@pytest.mark.parametrize(
    "arch, dtype, seed, state_dtype",
    [("gpt2", torch.float32, 0, torch.uint8), ("llama", torch.bfloat16, 1, torch.uint8), ("llama", torch.bfloat16, 2, torch.float8_e4m3fn)],
)
def test_compact_state_trains_streamed_weights_bitwise_as_on_the_cpu(arch: str, dtype: torch.dtype, seed: int, state_dtype: torch.dtype) -> None:
    """8-bit or fp8 moments, and bf16 weights updated in their host copy with Kahan compensation
    (no fp32 master): the streamed training is bitwise the same model's training on the CPU (an
    offloaded resident twin would keep an fp32 master: master_dtype=torch.bfloat16 needs the
    weights on the host)."""
    kw = {"state_dtype": state_dtype, "master_dtype": torch.bfloat16}
    data = batches(12, seed)
    ref = MODELS[arch](dtype, seed)
    ropt = offload_adam.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1, bucket_mb=0.05, **kw)
    train(ref, ropt, data)
    with testing.simulated_device(host_memory=True, seed=seed, max_delay_s=0.001) as sim:
        model = MODELS[arch](dtype, seed)
        h = offload_adam.offload_weights(model, prefetch=1)
        opt = offload_adam.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, bucket_mb=0.05, **kw)
        train(model, opt, data)
        for (n, _), p, q in zip(model.named_parameters(), weights(model), ref.parameters()):
            assert torch.equal(p, q), n
        st, rst = opt.state_dict()["state"], ropt.state_dict()["state"]
        for k, v in rst.items():
            # A float32 home is its own master, which a streamed group's entry shows.
            assert set(st[k]) - set(v) <= {"master_param"}, k
            for key, t in v.items():
                bits = (lambda x: x.view(torch.uint8)) if t.dtype == torch.float8_e4m3fn else (lambda x: x)
                assert torch.equal(bits(st[k][key]), bits(t)), (k, key)
        keys = set().union(*(set(v) for v in st.values()))
        assert "exp_avg_codes" in keys and ("kahan_comp" in keys) == (dtype == torch.bfloat16)
        opt.close()
        h.close()
        assert sim.violations == []
