"""Training over routed experts stored per expert (issue 34, point 6): peft's LoRA adapters on the
attention (and, on DeepSeek-V3, on the shared experts) over a frozen bf16 base whose routed
experts stay on the host (``device="cpu"``, and the simulated device with the model moved there).
12 steps of offload_adam.AdamW on the adapters are bitwise the same training with the base
resident (``experts_implementation="eager"``, the experts frozen); the backward through an expert
run on the host gives only the input its gradient and saves none of the experts' weights."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import offload_adam
from offload_adam import testing

from helpers import to_device
from test_weights import nvme_dir  # noqa: F401 (a fixture: a temporary directory, left empty)

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
transformers.utils.logging.set_verbosity_error()
pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 128
STEPS = 12


def qwen3_moe(seed: int) -> torch.nn.Module:
    """Hidden 40, expert width 18 (gate_up [36, 40], down [40, 18]: no other weight, activation
    (at most 16 rows) or adapter of these tests has either shape or its transpose), 8 experts, 2
    routed."""
    torch.manual_seed(seed)
    cfg = transformers.Qwen3MoeConfig(
        num_hidden_layers=2, hidden_size=40, intermediate_size=48, moe_intermediate_size=18, num_attention_heads=4,
        num_key_value_heads=2, head_dim=10, num_experts=8, num_experts_per_tok=2, vocab_size=VOCAB,
        max_position_embeddings=64, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
    )  # fmt: skip
    return transformers.Qwen3MoeForCausalLM(cfg)


def deepseek_v3(seed: int) -> torch.nn.Module:
    """Shared experts (3 experts wide: [51, 40]) and grouped routing (2 groups, 1 kept); routed
    experts gate_up [34, 40], down [40, 17]."""
    torch.manual_seed(seed)
    cfg = transformers.DeepseekV3Config(
        num_hidden_layers=2, hidden_size=40, intermediate_size=48, moe_intermediate_size=17, num_attention_heads=4,
        num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
        n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=3, first_k_dense_replace=0,
        vocab_size=VOCAB, max_position_embeddings=64,
    )  # fmt: skip
    return transformers.DeepseekV3ForCausalLM(cfg)


def gpt_oss(seed: int) -> torch.nn.Module:
    """Transposed experts with biases, interleaved gate/up and a clamped gate of its own
    (``_apply_gate``): gate_up [40, 36], down [18, 40]; biases made non-zero."""
    torch.manual_seed(seed)
    cfg = transformers.GptOssConfig(
        num_hidden_layers=2, hidden_size=40, intermediate_size=18, num_attention_heads=4, num_key_value_heads=2,
        head_dim=10, num_local_experts=8, num_experts_per_tok=2, vocab_size=VOCAB, max_position_embeddings=64,
        layer_types=["sliding_attention", "full_attention"], sliding_window=16,
    )  # fmt: skip
    m = transformers.GptOssForCausalLM(cfg)
    for n, p in m.named_parameters():
        if n.endswith("bias") or n.endswith("sinks"):  # (initialised to zeros: made to count)
            torch.nn.init.normal_(p, std=0.02)
    return m


MODELS = {"qwen3_moe": qwen3_moe, "deepseek_v3": deepseek_v3, "gpt_oss": gpt_oss}
TARGETS = {"qwen3_moe": ["q_proj", "v_proj"], "deepseek_v3": ["q_b_proj", "kv_b_proj"], "gpt_oss": ["q_proj", "v_proj"]}  # peft's: the attention's


def lora_model(name: str, seed: int = 0) -> torch.nn.Module:
    """The bf16 model with experts_implementation="eager" (the reference's), its base frozen and
    peft's adapters on (B random: the adapters' gradients are not zero from the first step)."""
    model = MODELS[name](seed).to(torch.bfloat16).train()
    model.set_experts_implementation("eager")
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS[name], lora_dropout=0.0, init_lora_weights=False)
    out: torch.nn.Module = peft.get_peft_model(model, cfg)
    # DeepSeek-V3's shared experts get peft's LoRA linear by hand: peft 0.21 takes a target named
    # gate_proj, up_proj or down_proj, on a transformers 5 MoE model, for the fused routed experts'
    # gate_up_proj/down_proj (its conversion of transformers 4 adapters), never the shared experts'.
    for layer in model.model.layers if name == "deepseek_v3" else []:
        shared = layer.mlp.shared_experts
        for proj in ("gate_proj", "up_proj", "down_proj"):
            setattr(shared, proj, peft.tuners.lora.Linear(getattr(shared, proj), "default", config=cfg, r=4, lora_alpha=8))
    return out


def adapters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def routed(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if ".experts." in n}


def expert_shapes(model: torch.nn.Module) -> set[tuple[int, ...]]:
    """One expert's weights' shapes (``gate_up_proj[e]``, ``down_proj[e]``) and their transposes
    (not the biases': a vector of the hidden size is saved by every norm)."""
    shapes = {tuple(p.shape[1:]) for p in routed(model).values() if p.dim() == 3}
    return shapes | {s[::-1] for s in shapes}


def data(seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (2, 9), generator=g) for _ in range(STEPS)]


def train(model: torch.nn.Module, batches: list[torch.Tensor], h: Any = None) -> tuple[Any, list[tuple[int, ...]], list[dict[str, Any]]]:
    """12 steps of offload_adam.AdamW on the adapters; the shapes of what each forward saved for
    its backward, and each step's report (``h``: the offload)."""
    opt = offload_adam.AdamW(adapters(model), lr=1e-2, weight_decay=0.01)
    saved: list[tuple[int, ...]] = []
    reports = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(tuple(t.shape))
        return t

    for x in batches:
        if h is not None:
            h.reset_stats()
        x = to_device(x) if str(next(iter(adapters(model))).device) != "cpu" else x
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(input_ids=x[:, :-1]).logits.float()
            loss = torch.nn.functional.cross_entropy(out.flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        if h is not None:
            reports.append(h.report())
    return opt, saved, reports


@contextlib.contextmanager
def where(device: str, seed: int) -> Iterator[Any]:
    """``"cpu"``: nothing; ``"simgpu"``: the simulated device (its violations checked at the end)."""
    if device == "cpu":
        yield None
        return
    with testing.simulated_device(seed=seed, max_delay_s=0.001) as sim:
        yield sim
    assert sim.violations == []


CASES = [
    ("qwen3_moe", "cpu", "cpu"),
    ("qwen3_moe", "simgpu", "cpu"),
    ("qwen3_moe", "simgpu+cache", "cpu"),
    ("qwen3_moe", "simgpu+checkpointing", "cpu"),
    ("qwen3_moe", "simgpu", "nvme"),
    ("deepseek_v3", "cpu", "cpu"),
    ("deepseek_v3", "simgpu", "nvme"),
    ("gpt_oss", "simgpu", "cpu"),
]  # (device="cpu" with storage="nvme" would stream the adapters from the SSD too, which the optimizer refuses)


@pytest.mark.parametrize("name,device,storage", CASES, ids=["-".join(c) for c in CASES])
def test_lora_over_host_experts_trains_bitwise_as_over_the_base_resident(name: str, device: str, storage: str, nvme_dir: Any) -> None:
    """The adapters and their optimizer state after 12 steps bitwise the resident training's (on
    the same device); the experts get no gradient and stay as they were; no forward saved an
    expert's weight for the backward (its backward reads the unit from the store again: on the
    SSD with no RAM cache, every routed expert is read again, a miss); every routed expert of a
    forward runs once in its backward. ``simgpu+cache``: with gpu_budget_gb, a device expert cache
    of every unit (point 4) beside; training runs the experts on the host all the same.
    ``simgpu+checkpointing``: transformers' gradient checkpointing (non-reentrant) on both twins:
    the backward runs each layer's forward again, its experts too."""
    model = lora_model(name)
    checkpointing = device.endswith("+checkpointing")
    device = device.removesuffix("+checkpointing")
    if checkpointing:
        model.base_model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ref = copy.deepcopy(model)
    before = {n: p.detach().clone() for n, p in routed(model).items()}
    batches = data()
    cache = device.endswith("+cache")
    device = device.removesuffix("+cache")
    with where(device, 3) as sim:
        if sim is not None:
            ref.to(sim.torch_device)
        ref_opt, ref_saved, _ = train(ref, batches)
        ref.cpu()
    assert checkpointing or expert_shapes(model) & set(ref_saved)  # (the check below can see a saved expert weight)
    kw: dict[str, Any] = {"device": "cpu"} if device == "cpu" else {"resident": lambda n, p: p.requires_grad}
    kw |= {"nvme_dir": nvme_dir} if storage == "nvme" else {}
    kw |= {"gpu_budget_gb": 0.01} if cache else {}
    with where(device, 3):
        h = offload_adam.offload_weights(model, storage=storage, native_matmul=False, **kw)
        assert (h.report()["expert_gpu_units"] == h.report()["expert_units"]) if cache else "expert_gpu_units" in h.report()
        opt, saved, reports = train(model, batches, h)
        h.close()
    assert not expert_shapes(model) & set(saved), ("an expert's weight was saved for the backward", expert_shapes(model) & set(saved))
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        if p.requires_grad:
            assert torch.equal(p, q), n
        else:
            assert p.grad is None, n
    for n, p in routed(model).items():
        assert torch.equal(p, before[n]), n
    got, want = opt.state_dict()["state"], ref_opt.state_dict()["state"]
    assert got.keys() == want.keys() and len(got) == len(adapters(model))
    for i in got:
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(got[i][key], want[i][key]), (i, key)
    for r in reports:
        fwd, bwd = r["experts"]["prompt"], r["experts"]["backward"]
        runs = 2 if checkpointing else 1  # (the forward's experts, and their recompute in the backward)
        assert fwd["experts"] > 0 and fwd["experts"] == runs * bwd["experts"] and fwd["calls"] == runs * bwd["calls"], r["experts"]
        if storage == "nvme":  # (no RAM cache: host_budget_gb not given)
            assert bwd["misses"] == bwd["experts"] and bwd["read_bytes"] > 0, bwd
        assert fwd["gpu_hits"] == fwd["copied"] == 0, fwd


def test_a_routed_experts_parameter_left_trainable_is_refused_naming_it() -> None:
    """The resident model would give it a gradient, its units cannot: refused at the forward that
    builds a graph (not at offload_weights: peft may freeze the base after it), before the
    backward and the step, the adapters unchanged; under torch.no_grad() it runs."""
    model = lora_model("qwen3_moe", 4)
    h = offload_adam.offload_weights(model, device="cpu", native_matmul=False)
    x = data(4)[0]
    experts = model.base_model.model.model.layers[0].mlp.experts
    lora = adapters(model)
    before = [p.detach().clone() for p in lora]
    experts.down_proj.requires_grad_(True)
    name = r"base_model\.model\.model\.layers\.0\.mlp\.experts\.down_proj"
    with pytest.raises(ValueError, match=rf"model: {name} requires a gradient, .*freeze it with requires_grad_\(False\)"):
        model(input_ids=x[:, :-1])
    assert all(p.grad is None for p in lora) and all(torch.equal(p, q) for p, q in zip(lora, before))
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=x[:, :-1]).logits).all()
    experts.down_proj.requires_grad_(False)
    model(input_ids=x[:, :-1]).logits.float().sum().backward()  # frozen again: it trains
    assert all(p.grad is not None for p in lora)
    h.close()


def test_lora_on_the_routed_experts_parameters_is_refused_naming_the_wrapper() -> None:
    """peft's LoRA on the fused routed experts' parameters (target_parameters=, a ParamWrapper
    around the experts module that adds its delta to the fused parameter at each call) cannot run
    over experts stored per expert (frozen, the fused parameter a meta placeholder): refused at
    offload_weights, naming the wrapper, the model as it was (it failed in the first forward, deep
    in peft, on a meta tensor)."""
    model = MODELS["qwen3_moe"](5).to(torch.bfloat16).train()
    model.set_experts_implementation("eager")
    cfg = peft.LoraConfig(r=4, target_modules=["q_proj"], target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    pm = peft.get_peft_model(model, cfg)
    before = {n: (p.device, p.detach().clone()) for n, p in pm.state_dict().items()}
    wrapper = r"base_model\.model\.model\.layers\.0\.mlp\.experts\.base_layer \(ParamWrapper\)"
    with pytest.raises(ValueError, match=rf"model: {wrapper} wraps the routed experts base_model\.model\.model\.layers\.0\.mlp\.experts\.base_layer\.base_layer: an adapter"):
        offload_adam.offload_weights(pm, device="cpu", native_matmul=False)
    after = pm.state_dict()
    assert after.keys() == before.keys() and all(after[n].device == d and torch.equal(after[n], t) for n, (d, t) in before.items())
    assert model.config._experts_implementation == "eager"
