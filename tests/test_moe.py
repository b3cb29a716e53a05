"""Mixture of experts (issue 34): the fused routed experts of transformers' MoE models stored per
expert and run through the experts interface (``weights/experts.py``, ``weights/expertstore.py``).
Exact against the resident model run with ``experts_implementation="eager"`` (transformers' own
per-expert loop): logits and a 24-token greedy generate, bitwise, on Qwen3-MoE, Mixtral and
DeepSeek-V3 (shared experts, grouped routing) and gpt-oss (transposed experts with biases and a
gate of their own) built from small configs."""

from __future__ import annotations

import contextlib
import copy
import functools
from typing import Any

import pytest
import torch

import offload_adam
from offload_adam import testing
from offload_adam.runtime.pages import ALIGN
from offload_adam.runtime.pinned import align_up
from offload_adam.weights.costs import CostModel
from offload_adam.weights.experts import NAME, run_native
from offload_adam.weights.expertstore import READ_AHEAD, _Slru

from helpers import to_device, to_host
from test_weights import nvme_dir  # noqa: F401 (a fixture)
from test_weights import run  # (the logits of one forward and the tokens of a greedy generate)

transformers = pytest.importorskip("transformers")

VOCAB = 128


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def qwen() -> torch.nn.Module:
    c = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=128,
    )  # fmt: skip
    return transformers.Qwen3MoeForCausalLM(c)


def mixtral() -> torch.nn.Module:
    c = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=12, num_experts_per_tok=3, max_position_embeddings=128,
    )  # fmt: skip
    return transformers.MixtralForCausalLM(c)


def deepseek() -> torch.nn.Module:
    c = transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=16,
        num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1, kv_lora_rank=16, q_lora_rank=None,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, max_position_embeddings=128,
    )  # fmt: skip
    return transformers.DeepseekV3ForCausalLM(c)


def gpt_oss() -> torch.nn.Module:
    """Transposed, interleaved gate/up with biases and a clamped gate of its own (``_apply_gate``)."""
    c = transformers.GptOssConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=128,
        layer_types=["sliding_attention", "full_attention"], sliding_window=16,
    )  # fmt: skip
    m = transformers.GptOssForCausalLM(c)
    for n, p in m.named_parameters():
        if n.endswith("bias") or n.endswith("sinks"):  # (initialised to zeros: made to count)
            torch.nn.init.normal_(p, std=0.02)
    return m


MODELS = {"qwen3moe": qwen, "mixtral": mixtral, "deepseek_v3": deepseek, "gpt_oss": gpt_oss}


def model(arch: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    m = MODELS[arch]().to(torch.bfloat16).eval()
    m.set_experts_implementation("eager")
    return m


def prompt(seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (1, 8), generator=g)


@functools.cache
def reference(arch: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The resident model's run on ``prompt()`` with transformers' eager experts loop."""
    return run(model(arch), prompt())


def same(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> bool:
    return torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def experts_modules(m: torch.nn.Module) -> list[torch.nn.Module]:
    return [x for x in m.modules() if hasattr(x, "has_gate") and hasattr(x, "gate_up_proj")]


def unit_bytes(m: torch.nn.Module) -> int:
    """One expert's bytes as stored on the SSD (its slice of each fused parameter, each on 256
    bytes, the unit on 4 KiB)."""
    e = experts_modules(m)[0]
    sizes = [p[0].numel() * p.element_size() for p in e._parameters.values() if p is not None and p.shape[0] == e.num_experts]
    return align_up(sum(align_up(n, 256) for n in sizes[:-1]) + sizes[-1], ALIGN)


def h_unit(m: torch.nn.Module) -> int:
    """One expert's bytes in a device slot (each part on 256 bytes, the slot too)."""
    e = experts_modules(m)[0]
    sizes = [p[0].numel() * p.element_size() for p in e._parameters.values() if p is not None and p.shape[0] == e.num_experts]
    return align_up(sum(align_up(n, 256) for n in sizes), 256)


def host_budget(m: torch.nn.Module, nvme_dir: str, cache: str) -> float | None:
    """``host_budget_gb`` that keeps every dense block in RAM and leaves the expert cache
    ``cache`` units ("none": no budget, no cache; "small": 3; "all": every expert)."""
    if cache == "none":
        return None
    plan = offload_adam.plan_weights(m, device="cpu", storage="nvme", nvme_dir=nvme_dir, host_budget_gb=1.0)
    units = {"small": 3, "all": 10_000}[cache]
    return (plan.tier_bytes()["ram"] + (READ_AHEAD + units) * unit_bytes(m)) / 2**30


# -- the CPU as the device ----------------------------------------------------------------------


CPU_CASES = [
    ("qwen3moe", "cpu", "none"),
    ("mixtral", "cpu", "none"),
    ("deepseek_v3", "cpu", "none"),
    ("qwen3moe", "nvme", "none"),
    ("mixtral", "nvme", "small"),
    ("deepseek_v3", "nvme", "all"),
    ("qwen3moe", "nvme", "small"),
    ("deepseek_v3", "nvme", "none"),
    ("gpt_oss", "nvme", "small"),
    ("gpt_oss", "cpu", "none"),
]


@pytest.mark.parametrize("arch,storage,cache", CPU_CASES)
def test_the_cpu_as_the_device_is_bitwise_the_eager_experts_loop(arch: str, storage: str, cache: str, nvme_dir: str) -> None:
    """device="cpu", native_matmul=False: only the routed experts are read (from RAM, or from the
    SSD through the expert cache) and computed, with transformers' eager operations: logits and
    tokens bitwise the resident model's; close() switches the experts back and hands the fused
    parameters back, the same objects, bitwise."""
    m = model(arch)
    before = {n: p for n, p in m.named_parameters()}
    values = {n: p.detach().clone() for n, p in before.items()}
    kw: dict[str, Any] = {"nvme_dir": nvme_dir, "host_budget_gb": host_budget(m, nvme_dir, cache)} if storage == "nvme" else {}
    h = offload_adam.offload_weights(m, device="cpu", storage=storage, native_matmul=False, **kw)
    assert m.config._experts_implementation == NAME
    assert all(e.gate_up_proj.device.type == "meta" for e in experts_modules(m))  # in no block: stored per expert
    assert same(run(m, prompt()), reference(arch))
    r = h.report()
    units = r["expert_units"]
    routed = sum(ph["experts"] for ph in r["experts"].values())
    hits = sum(ph["hits"] for ph in r["experts"].values())
    misses = sum(ph["misses"] for ph in r["experts"].values())
    assert routed == hits + misses and r["experts"]["decode"]["calls"] > 0
    assert r["experts"]["decode"]["torch"] == r["experts"]["decode"]["calls"]  # native_matmul=False
    if storage == "cpu":
        assert misses == 0 and r["expert_nvme_bytes"] == 0
    else:
        assert sum(ph["read_bytes"] for ph in r["experts"].values()) == misses * unit_bytes(m)
        cap = r["expert_cache_units"]
        if cache == "none":
            assert cap == 0 and hits == 0  # every routed expert read each time
        elif cache == "small":
            assert cap == 3 and r["expert_ram_bytes"] == (3 + READ_AHEAD) * unit_bytes(m)
        else:
            assert cap == units and misses <= units  # each unit read at most once
    h.close()
    assert m.config._experts_implementation == "eager"
    for n, p in m.named_parameters():
        assert p is before[n] and type(p) is torch.nn.Parameter and torch.equal(p, values[n]), n


def test_a_decode_token_reads_the_missed_experts_and_the_dense_blocks_only(nvme_dir: str) -> None:
    """From the SSD without a RAM budget: each decode token reads its routed experts (a miss
    each, exactly their units' bytes) and the dense blocks (at most once a token, plus the pages
    the RAM ring reads ahead for the next), not the other experts; the page cache stays flat
    (O_DIRECT)."""
    m = model("deepseek_v3")
    h = offload_adam.offload_weights(m, device="cpu", storage="nvme", nvme_dir=nvme_dir, native_matmul=False)
    steps = 4
    with torch.no_grad():
        out = m(prompt(), use_cache=True)
        h.reset_stats()
        for _ in range(steps):
            out = m(out.logits[:, -1:].argmax(-1), cache=out.past_key_values, use_cache=True)
    r = h.report()
    assert "routed experts: 2 modules, 32 experts" in h.summary() and "routed experts" in repr(h)
    dec = r["experts"]["decode"]
    k, layers = m.config.num_experts_per_tok, len(experts_modules(m))
    assert dec["calls"] == steps * layers and dec["misses"] == dec["experts"] <= steps * k * layers
    assert dec["read_bytes"] == dec["misses"] * unit_bytes(m)
    dense = sum(align_up(b.nbytes, ALIGN) for b in h.plan.blocks if b.home == "nvme")
    assert r["read_bytes"] <= steps * dense + h.plan.host_ring_bytes
    e = m.config.n_routed_experts
    assert dec["read_bytes"] <= steps * k / e * r["expert_bytes"]  # the routed share of the experts, not all
    assert r["page_cache_bytes"] <= 0.05 * (r["read_bytes"] + dec["read_bytes"])
    h.close()


# -- the native kernel -----------------------------------------------------------------------------


def _routing(m: torch.nn.Module) -> tuple[list[torch.Tensor], list[Any]]:
    """The top-k indices each experts module is called with (recorded), and the hooks."""
    seen: list[torch.Tensor] = []
    hooks = [e.register_forward_pre_hook(lambda mod, args: seen.append(to_host(args[1]).clone())) for e in experts_modules(m)]
    return seen, hooks


@torch.no_grad()
def _decode(m: torch.nn.Module, tokens: torch.Tensor, start: int) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """Logits and routing of each decode step over ``tokens`` (teacher-forced from ``start``)."""
    seen, hooks = _routing(m)
    out = m(tokens[:, :start], use_cache=True)
    cache = out.past_key_values
    logits, routes = [], []
    for i in range(start, tokens.shape[1]):
        seen.clear()
        out = m(tokens[:, i : i + 1], cache=cache, use_cache=True)
        cache = out.past_key_values
        logits.append(to_host(out.logits[:, -1]).float())
        routes.append(list(seen))
    for hk in hooks:
        hk.remove()
    return logits, routes


def _quantize(m: torch.nn.Module, kind: str) -> None:
    from torchao.quantization import Float8WeightOnlyConfig, FqnToConfig, Int8WeightOnlyConfig, quantize_

    cfg = Int8WeightOnlyConfig() if kind == "int8" else Float8WeightOnlyConfig()
    names = {f"{n}.{p}": cfg for n, e in m.named_modules() if e in experts_modules(m) for p in ("gate_up_proj", "down_proj")}
    quantize_(m, FqnToConfig(names), filter_fn=None)


def _dequantized(p: torch.Tensor) -> torch.Tensor:
    """A torchao int8/fp8 weight's exact values in float64: ``(qdata - zero_point) * scale``."""
    attrs, _ = p.__tensor_flatten__()  # type: ignore[attr-defined]
    q = p.qdata.double()  # type: ignore[attr-defined]
    if "zero_point" in attrs:
        q = q - p.zero_point.double()  # type: ignore[attr-defined]
    return q * p.scale.double()  # type: ignore[attr-defined]


EXACT = "offload_adam_test_exact64"


def _exact64(self: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts of the quantized weights computed exactly (float64 from their int8/fp8 values
    and scales, the result rounded once to the model's dtype): the gated SiLU layout."""
    gate_up, down = self._exact_weights
    x = hidden_states.double()
    out = torch.zeros_like(x)
    for e in sorted(top_k_index.unique().tolist()):
        rows, k = torch.where(top_k_index == e)
        gate, up = (x[rows] @ gate_up[e].T).chunk(2, dim=-1)
        out.index_add_(0, rows, ((torch.nn.functional.silu(gate) * up) @ down[e].T) * top_k_weights[rows, k, None].double())
    return out.to(hidden_states.dtype)


def _exact_model(arch: str, kind: str) -> torch.nn.Module:
    """The resident model with quantized experts whose experts run :func:`_exact64`."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS[EXACT] = _exact64
    m = model(arch)
    _quantize(m, kind)
    for e in experts_modules(m):
        e._exact_weights = (_dequantized(e.gate_up_proj), _dequantized(e.down_proj))
    m.set_experts_implementation(EXACT)
    return m


def _agrees(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("arch,kind", [("qwen3moe", "bf16"), ("deepseek_v3", "bf16"), ("mixtral", "int8"), ("qwen3moe", "fp8")])
def test_the_native_kernel_agrees_where_the_routing_does(arch: str, kind: str, capsys: pytest.CaptureFixture[str]) -> None:
    """native_matmul=True: each decode step's experts run on the one-call kernel; its logits are
    within 1e-2 of the largest of the reference wherever every layer routed the token to the same
    experts (a near-tie in a top-k flips under any change of rounding: such steps are counted and
    printed, not compared). bf16: the reference is the resident eager model. Quantized experts
    (torchao's int8 and fp8 weight-only, quantized before the call with FqnToConfig, read as
    int8/fp8 with their scales): the reference is the exact result (the same quantized weights'
    experts in float64), and the kernel is no farther from it than the resident eager model
    (torchao's CPU path, which rounds each dequantized weight to bf16 first) plus one bf16 unit
    (2**-8) of the largest logit."""
    ref, m = model(arch), model(arch)
    if kind != "bf16":
        _quantize(ref, kind)
        _quantize(m, kind)
    tokens = reference(arch)[1]
    resident, resident_routes = _decode(ref, tokens, 8)
    if kind == "bf16":
        want, want_routes = resident, resident_routes
    else:
        want, want_routes = _decode(_exact_model(arch, kind), tokens, 8)
    h = offload_adam.offload_weights(m, device="cpu", native_matmul=True)
    got, got_routes = _decode(m, tokens, 8)
    r = h.report()
    h.close()
    assert r["experts"]["decode"]["native"] == r["experts"]["decode"]["calls"] > 0
    flips = 0
    kernel_dev, resident_dev = [], []
    for g, w, res, gr, wr, rr in zip(got, want, resident, got_routes, want_routes, resident_routes):
        if _agrees(rr, wr):
            resident_dev.append(float((res - w).abs().max() / w.abs().max()))
        if not _agrees(gr, wr):
            flips += 1
            continue
        kernel_dev.append(float((g - w).abs().max() / w.abs().max()))
        assert kernel_dev[-1] <= 1e-2, (arch, kind)
    assert flips < len(got) // 2
    if kind != "bf16":
        assert resident_dev and max(kernel_dev) <= max(resident_dev) + 2**-8, (arch, kind, max(kernel_dev), max(resident_dev))
    with capsys.disabled():
        extra = f"; of the largest logit from exact: kernel {max(kernel_dev):.4f}, resident eager {max(resident_dev):.4f}" if kind != "bf16" else ""
        print(f"\n{arch} {kind}: routing flipped at {flips} of {len(got)} decode steps{extra}")


def test_run_native_skips_minus_one_and_sums_the_weighted_experts() -> None:
    """run_native (the one-call kernel's signature): out[r] = sum_k w[r,k] * down[u] (silu(g) * up),
    index -1 skipped, against float64 within bf16's rounding."""
    g = torch.Generator().manual_seed(0)
    h, i, n = 64, 32, 3
    gate_up = [torch.randn(2 * i, h, generator=g).bfloat16() for _ in range(n)]
    down = [torch.randn(h, i, generator=g).bfloat16() for _ in range(n)]
    x = torch.randn(2, h, generator=g).bfloat16()
    index = torch.tensor([[0, 2], [1, -1]])
    weights = torch.rand(2, 2, generator=g).bfloat16()
    out = torch.empty_like(x)
    run_native(x, gate_up, down, index, weights, out=out)
    want = torch.zeros(2, h, dtype=torch.float64)
    for r in range(2):
        for k in range(2):
            u = int(index[r, k])
            if u < 0:
                continue
            gu = gate_up[u].double() @ x[r].double()
            a = torch.nn.functional.silu(gu[:i]) * gu[i:]
            want[r] += weights[r, k].double() * (down[u].double() @ a)
    assert (out.double() - want).abs().max() <= 2e-2 * want.abs().max()


# -- quantized experts ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind,storage", [("int8", "nvme"), ("fp8", "cpu")])
def test_quantized_experts_are_stored_per_expert_and_bitwise(kind: str, storage: str, nvme_dir: str) -> None:
    """torchao's int8/fp8 weight-only experts (FqnToConfig on the 3D parameters): stored per
    expert as their inner tensors' slices, run bitwise as the resident quantized model's eager
    loop, and handed back as the same quantized parameters."""
    ref, m = model("qwen3moe"), model("qwen3moe")
    _quantize(ref, kind)
    _quantize(m, kind)
    e = experts_modules(m)[0]
    cls, inner = type(e.gate_up_proj), {a: getattr(e.gate_up_proj, a).clone() for a in e.gate_up_proj.__tensor_flatten__()[0]}
    want = run(ref, prompt())
    kw: dict[str, Any] = {"nvme_dir": nvme_dir} if storage == "nvme" else {}
    h = offload_adam.offload_weights(m, device="cpu", storage=storage, native_matmul=False, **kw)
    assert h.report()["expert_bytes"] < sum(p.numel() * 2 for x in experts_modules(ref) for p in (x.gate_up_proj, x.down_proj))
    assert same(run(m, prompt()), want)
    h.close()
    assert type(e.gate_up_proj) is cls
    assert all(torch.equal(getattr(e.gate_up_proj, a), t) for a, t in inner.items())


# -- the switch, bad input, failures ---------------------------------------------------------------


def test_a_model_sharing_the_config_runs_its_former_implementation() -> None:
    """A second model built from the same config object (its experts switched with it) but not
    offloaded runs the implementation the config named before: the eager loop, bitwise."""
    m = model("qwen3moe")
    torch.manual_seed(0)
    twin = type(m)(m.config).to(torch.bfloat16).eval()
    twin.load_state_dict(m.state_dict())
    h = offload_adam.offload_weights(m, device="cpu", native_matmul=False)
    assert twin.config._experts_implementation == NAME
    assert same(run(twin, prompt()), reference("qwen3moe"))
    h.close()


def test_bad_input_is_named_before_anything_changes() -> None:
    m = model("qwen3moe")
    name = next(n for n, p in m.named_parameters() if n.endswith("experts.gate_up_proj"))
    with pytest.raises(ValueError, match=rf"resident: {name} is a routed experts parameter"):
        offload_adam.offload_weights(m, device="cpu", resident=lambda n, p: n == name)
    assert m.config._experts_implementation == "eager" and not hasattr(m, "_offload_adam_weights")
    assert same(run(m, prompt()), reference("qwen3moe"))


def test_a_graph_through_the_experts_on_a_device_carries_their_gradient() -> None:
    """On a device the experts run on the host: a forward building a graph through them (the
    experts frozen, the rest trainable) gives every layer before them its gradient through the
    experts' path too, bitwise the resident eager model's (issue 34's point 6: weights/expertgrad.py;
    before it, the copies across carried no gradient, and the call was refused)."""
    m = model("qwen3moe").train()
    ref = copy.deepcopy(m)
    for x in (m, ref):
        for n, p in x.named_parameters():
            p.requires_grad_(".experts." not in n)

    def grads(x: torch.nn.Module) -> dict[str, torch.Tensor]:
        x(to_device(prompt()), labels=to_device(prompt())).loss.backward()
        return {n: to_host(p.grad) for n, p in x.named_parameters() if p.requires_grad}

    with testing.simulated_device(seed=0, max_delay_s=0.0) as sim:
        ref.to(sim.torch_device)
        want = grads(ref)
    with testing.simulated_device(seed=0, max_delay_s=0.0) as sim:
        h = offload_adam.offload_weights(m, native_matmul=False)
        got = grads(m)
        h.close()
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want), [n for n in want if not torch.equal(got[n], want[n])]


def test_a_failure_storing_the_experts_puts_the_model_back(monkeypatch: pytest.MonkeyPatch, nvme_dir: str) -> None:
    """An error while the experts are stored (the second module's write) leaves the model as it
    was: the same parameters, bitwise, its experts implementation unchanged, no file left."""
    from offload_adam.weights import expertstore

    m = model("deepseek_v3")
    before = {n: (p, p.detach().clone()) for n, p in m.named_parameters()}
    fill = expertstore.ExpertStore.fill

    def failing(self: Any, lay: Any) -> None:
        if lay.index == 1:
            raise OSError(28, "No space left on device (simulated)")
        fill(self, lay)

    monkeypatch.setattr(expertstore.ExpertStore, "fill", failing)
    with pytest.raises(OSError, match="simulated"):
        offload_adam.offload_weights(m, device="cpu", storage="nvme", nvme_dir=nvme_dir)
    assert m.config._experts_implementation == "eager"
    for n, p in m.named_parameters():
        assert p is before[n][0] and torch.equal(p, before[n][1]), n


def test_the_cache_keeps_experts_used_again_over_experts_used_once() -> None:
    """The segmented LRU: a unit used twice is protected; a scan of units used once evicts the
    other units of probation first."""
    c = _Slru(4)
    for k in range(4):
        c.add((0, k), k)
    c.used((0, 0))
    c.used((0, 1))  # 0 and 1 used twice: protected
    order = [key for key, _ in c.victims()]
    assert order[:2] == [(0, 2), (0, 3)] and set(order[2:]) == {(0, 0), (0, 1)}
    c.drop((0, 2))
    c.add((0, 9), 2)  # a new unit: probation's most recent
    assert [key for key, _ in c.victims()][:2] == [(0, 3), (0, 9)]


# -- placements on the simulated device ------------------------------------------------------------


class RowsModel(CostModel):
    """Decode steps on the CPU, prompts streamed."""

    def choose(self, nbytes: int, params: int, rows: int, dtype: torch.dtype) -> str:
        return "cpu" if rows <= 1 else "stream"


@pytest.mark.parametrize("arch,placement,storage", [
    ("qwen3moe", "stream", "cpu"),
    ("deepseek_v3", "cpu", "nvme"),
    ("mixtral", "auto", "cpu"),
    ("deepseek_v3", "auto", "cpu"),
    ("gpt_oss", "stream", "nvme"),
])  # fmt: skip
def test_placements_on_a_device_are_bitwise_the_eager_experts_loop(arch: str, placement: str, storage: str, nvme_dir: str) -> None:
    """On the simulated device the dense parts stream or run on the CPU as placed; the routed
    experts run on the host from their units (a streamed layer's hidden states cross for them):
    bitwise the resident eager model. DeepSeek-V3's router holds a buffer of its own
    (``e_score_correction_bias``): a layer run on the CPU reads its host copy."""
    m = model(arch)
    want = reference(arch)
    kw: dict[str, Any] = {"nvme_dir": nvme_dir} if storage == "nvme" else {}
    with testing.simulated_device(seed=1, max_delay_s=0.001) as sim:
        h = offload_adam.offload_weights(
            m, placement=placement, storage=storage, native_matmul=False, **kw,
            **({"cost_model": RowsModel()} if placement == "auto" else {}),
        )  # fmt: skip
        assert same(run(m, prompt()), want)
        r = h.report()
        assert r["experts"]["decode"]["calls"] > 0
        if placement == "cpu":
            assert r["calls"]["decode"]["stream"] == r["calls"]["prompt"]["stream"] == 0
        h.close()
    assert sim.violations == []
    assert m.config._experts_implementation == "eager"


@pytest.mark.parametrize("arch,placement,storage,cache", [
    ("qwen3moe", "stream", "cpu", "all"),
    ("deepseek_v3", "auto", "nvme", "all"),
    ("mixtral", "stream", "cpu", "small"),
])  # fmt: skip
def test_the_device_expert_cache_is_bitwise_the_eager_experts_loop(arch: str, placement: str, storage: str, cache: str, nvme_dir: str) -> None:
    """With gpu_budget_gb, what the plan's device tier leaves holds experts on the device (issue
    34, point 4): a layer on the device runs its cached experts there, and a miss is copied (its
    unit's bytes only, into a slot whose readers ran: a small cache evicts) or, by the cost model,
    computed on the host for its rows; bitwise the resident eager model, no ordering violation."""
    m = model(arch)
    want = reference(arch)
    kw: dict[str, Any] = {"nvme_dir": nvme_dir} if storage == "nvme" else {}
    # (delays where slots are overwritten: a cache holding every expert writes each slot once)
    with testing.simulated_device(seed=2, max_delay_s=0.001 if cache == "small" else 0.0) as sim:
        budget = 0.5
        if cache == "small":
            tier = offload_adam.plan_weights(m, placement=placement, storage=storage, gpu_budget_gb=0.5, **kw).tier_bytes()["device"]
            budget = (tier + 3 * h_unit(m)) / 2**30
        h = offload_adam.offload_weights(
            m, placement=placement, storage=storage, gpu_budget_gb=budget, native_matmul=False, **kw,
            **({"cost_model": RowsModel()} if placement == "auto" else {}),
        )  # fmt: skip
        assert same(run(m, prompt()), want)
        r = h.report()
        h.close()
    assert sim.violations == []
    units = r["expert_units"]
    assert r["expert_gpu_units"] == (units if cache == "all" else 3)
    ph = r["experts"]
    copied = sum(p["copied"] for p in ph.values())
    assert sum(p["gpu_hits"] + p["copied"] + p["cpu_computed"] for p in ph.values()) == sum(p["experts"] for p in ph.values())
    if cache == "all":
        assert 0 < copied <= units and sum(p["gpu_hits"] for p in ph.values()) > 0
    else:
        assert copied > units  # (a small cache copies again what it evicted)
    unit = h.experts.layouts[0].unit_bytes  # (the bytes of one expert's parameters, their alignment inside)
    assert sum(p["h2d_bytes"] for p in ph.values()) == copied * unit
    if placement == "auto":
        assert sum(p["cpu_computed"] for p in ph.values()) > 0  # an expert of one row: on the host


# -- the plan ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("storage,cache,device", [("cpu", "none", False), ("nvme", "small", False), ("nvme", "none", True)])
def test_the_plan_lists_the_expert_store_as_the_offload_builds_it(storage: str, cache: str, device: bool, nvme_dir: str) -> None:
    """plan_weights' ``experts`` (an ExpertsPlan) says what offload_weights builds: units, bytes,
    where they live, the RAM and device caches' sizes, report()'s figures one for one; str(plan)
    and summary() say them."""
    m = model("qwen3moe")
    kw: dict[str, Any] = {"nvme_dir": nvme_dir, "host_budget_gb": host_budget(m, nvme_dir, cache)} if storage == "nvme" else {}
    with testing.simulated_device(seed=1, max_delay_s=0.0) if device else contextlib.nullcontext():
        if device:
            kw["gpu_budget_gb"] = (offload_adam.plan_weights(m, storage=storage, **kw).tier_bytes()["device"] + 5 * h_unit(m)) / 2**30
        else:
            kw["device"] = "cpu"
        plan = offload_adam.plan_weights(m, storage=storage, native_matmul=False, **kw)
        xp = plan.experts
        assert xp is not None
        h = offload_adam.offload_weights(m, storage=storage, native_matmul=False, **kw)
        r = h.report()
        summary = h.summary()
        h.close()
    want = {
        "modules": r["expert_modules"], "units": r["expert_units"], "nbytes": r["expert_bytes"], "ram_bytes": r["expert_ram_bytes"],
        "cache_units": r["expert_cache_units"], "nvme_bytes": r["expert_nvme_bytes"], "gpu_units": r["expert_gpu_units"],
        "gpu_bytes": r["expert_gpu_bytes"],
    }  # fmt: skip
    assert {k: getattr(xp, k) for k in want} == want
    assert h.plan.experts == xp and xp.home == ("nvme" if storage == "nvme" else "ram")
    assert xp.units == sum(e.num_experts for e in experts_modules(m)) and xp.modules == len(experts_modules(m))
    if cache == "small":
        assert xp.cache_units == 3
    if device:
        assert 0 < xp.gpu_units < xp.units and xp.gpu_bytes == xp.gpu_units * h_unit(m)  # (a budget of 5 more units: the plan resident what fits first)
    assert f"{xp.units} experts" in str(plan) and f"{xp.units} experts" in summary
