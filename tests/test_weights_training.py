"""Training with streamed weights (offload_weights, then offload_adam.AdamW), on the simulated
device (the batches, and the resident twin, moved there as to "cuda"): forward and backward stream each block, the step writes the updated
weights straight into the host copies the next forward streams. Exact against the same
training with the weights resident and the optimizer offloading as before: every weight and
every state tensor bitwise equal after 12 steps, in every mode."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import offload_adam
from offload_adam import testing
from offload_adam.testing.simbackend import mem

from helpers import to_device, to_host

transformers = pytest.importorskip("transformers")
transformers.utils.logging.set_verbosity_error()

VOCAB = 256


def gpt2(dtype: torch.dtype, seed: int = 0, layers: int = 4) -> torch.nn.Module:
    """GPT-2 with tied embeddings, no dropout (both twins must compute the same)."""
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(
        n_layer=layers, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=64, bos_token_id=0, eos_token_id=0,
        pad_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(cfg).to(dtype).train()


def llama(dtype: torch.dtype, seed: int = 0, layers: int = 4) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        num_hidden_layers=layers, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, max_position_embeddings=128, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg).to(dtype).train()


MODELS = {"gpt2": gpt2, "llama": llama}


def batches(n: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (2, 9), generator=g) for _ in range(n)]


def loss_of(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    x = x.to(next(m.parameters()).device)  # the batch where the model is, as a user moves it
    out = m(x[:, :-1]).logits.float()
    return torch.nn.functional.cross_entropy(out.flatten(0, 1), x[:, 1:].flatten())


def train(
    model: torch.nn.Module,
    opt: Any,
    data: list[torch.Tensor],
    *,
    accumulate: int = 1,
    clip: str | None = None,
    scaler: Any = None,
    after: Callable[[int], None] | None = None,
) -> None:
    """The loop a user writes: micro-batches, clipping, GradScaler, zero_grad after the step."""
    for k in range(0, len(data), accumulate):
        for x in data[k : k + accumulate]:
            loss = loss_of(model, x) / accumulate
            (scaler.scale(loss) if scaler is not None else loss).backward()
        if scaler is not None and clip is not None:
            scaler.unscale_(opt)  # (torch refuses it for fp16 gradients: clip those without a scaler)
        if clip == "model":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        elif clip == "optimizer":
            opt.clip_grad_norm_(0.5)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad()
        if after is not None:
            after(k // accumulate)
    if hasattr(opt, "synchronize"):
        opt.synchronize()


def weights(model: torch.nn.Module) -> list[torch.Tensor]:
    """The weights as they are: a streamed parameter's in its host copy (its data outside a
    forward is a NaN placeholder)."""
    from offload_adam.runtime.hosted import home_of

    out = []
    for p in model.parameters():
        h = home_of(p)
        out.append(h.host if h is not None and h.host is not None else p.detach())
    return out


def assert_same(model: torch.nn.Module, ref: torch.nn.Module, opt: Any, ropt: Any) -> None:
    for (n, _), p, q in zip(model.named_parameters(), weights(model), ref.parameters()):
        assert torch.equal(to_host(p), to_host(q)), n
    sd, rsd = opt.state_dict(), ropt.state_dict()
    assert set(sd["state"]) == set(rsd["state"])
    for k, v in rsd["state"].items():
        assert set(sd["state"][k]) == set(v), k
        for key, t in v.items():
            assert torch.equal(sd["state"][k][key], t), (k, key)


@pytest.fixture
def nvme_dir(tmp_path: Any) -> Iterator[str]:
    d = tmp_path / "nvme"
    d.mkdir()
    yield str(d)


# name -> (AdamW kwargs, train kwargs)
MODES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "sync": ({}, {}),
    "async": ({"async_step": True}, {}),
    "free_gradients": ({"free_gradients": True}, {}),
    "async+free": ({"async_step": True, "free_gradients": True}, {}),
    "accumulate": ({}, {"accumulate": 2}),
    "accumulate+free": ({"free_gradients": True}, {"accumulate": 3}),
    "clip-model": ({}, {"clip": "model"}),
    "clip-optimizer": ({"async_step": True}, {"clip": "optimizer"}),
    "bf16-moments": ({"state_dtype": torch.bfloat16, "amsgrad": True}, {}),
}


def twins(arch: str, dtype: torch.dtype, seed: int, **offload: Any) -> tuple[torch.nn.Module, torch.nn.Module, Any]:
    model = MODELS[arch](dtype, seed)
    ref = to_device(copy.deepcopy(model))  # resident on the device
    h = offload_adam.offload_weights(model, **offload)
    return model, ref, h


# Every mode on fp32 GPT-2, and again on one of two bf16 cases (alternately, for the suite's
# time): each on two seeds, both dtypes, both architectures among them.
_CASES = [("gpt2", torch.float32, 0), ("llama", torch.bfloat16, 1), ("gpt2", torch.bfloat16, 2)]
_MATRIX = [(*_CASES[0], m) for m in MODES] + [(*_CASES[1 + k % 2], m) for k, m in enumerate(MODES)]


@pytest.mark.parametrize("arch, dtype, seed, mode", _MATRIX)
def test_training_is_bitwise_the_resident_trainings(arch: str, dtype: torch.dtype, seed: int, mode: str) -> None:
    kw, loop = MODES[mode]
    steps = 12
    data = batches(steps * loop.get("accumulate", 1), seed)
    with testing.simulated_device(seed=seed, max_delay_s=0.001) as sim:
        model, ref, h = twins(arch, dtype, seed, prefetch=1 + seed % 2)
        opt = offload_adam.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, bucket_mb=0.05, **kw)
        ropt = offload_adam.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1, bucket_mb=0.05, **kw)
        train(ref, ropt, data, **loop)
        train(model, opt, data, **loop)
        assert_same(model, ref, opt, ropt)
        rep = h.report()
        assert rep["gpu_peak_bytes"] <= rep["gpu_resident_bytes"] + rep["ring_bytes"] + 64
        assert rep["gpu_peak_bytes"] < 0.7 * rep["weights_bytes"]
        opt.close()
        h.close()
        assert sim.violations == []


def _crossings(h: Any) -> int:
    """Bytes a step streams: every block in the forward and again in the backward, except that a
    block whose backward reads no weight (an embedding) crosses once, and so does a block needed
    from the forward straight into the backward (the last one before the loss keeps its slot; a
    tied embedding and head is held in a slot of its own)."""
    order = h.streamer.cycle.order  # the cycle recorded: the forward's activations, then the backward's
    total = 0
    for i in h.streamed:
        runs = sum(1 for k, x in enumerate(order) if x == i and (k == 0 or order[k - 1] != i))
        total += h.blocks[i].nbytes * (1 if i in h.streamer.cycle.own or runs == 1 else 2)
    return total


@pytest.mark.parametrize("checkpointing", [None, "non-reentrant", "reentrant"])
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_bytes_per_step_and_activation_checkpointing(arch: str, checkpointing: str | None) -> None:
    """Each streamed weight crosses twice a step (forward and backward) in the model's dtype, each
    gradient once, nothing else (no copy-back); with torch.utils.checkpoint the recompute streams
    the block again, and its copy serves the block's backward too (still twice)."""
    with testing.simulated_device(seed=3, max_delay_s=0.001) as sim:
        model, ref, h = twins(arch, torch.bfloat16, 3, prefetch=2)
        if checkpointing:
            for m in (model, ref):
                m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpointing == "reentrant"})
        opt = offload_adam.AdamW(model.parameters(), lr=1e-3, bucket_mb=0.05)
        ropt = offload_adam.AdamW(ref.parameters(), lr=1e-3, bucket_mb=0.05)
        data = batches(8, 3)
        train(ref, ropt, data[:4])
        train(model, opt, data[:4])
        h.reset_stats()
        sim.copied_bytes.clear()
        grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        train(ref, ropt, data[4:])
        to_device = lambda: sim.copied_bytes.get("h2d", 0) + sim.copied_bytes.get("h2d_now", 0)  # noqa: E731
        ref_h2d = to_device()
        sim.copied_bytes.clear()
        train(model, opt, data[4:])
        rep = h.report()
        assert rep["h2d_bytes"] == 4 * _crossings(h) <= 4 * 2 * rep["streamed_bytes"]
        assert rep["on_demand_loads"] == 0
        assert sim.copied_bytes["d2h"] == 4 * grads  # each gradient once
        assert to_device() == rep["h2d_bytes"]  # the weights, no copy-back
        assert ref_h2d == 4 * grads  # (resident: the optimizer's copy-back)
        assert_same(model, ref, opt, ropt)
        opt.close()
        h.close()


def test_grad_scaler_with_fp16_weights() -> None:
    """GradScaler hands the step its scale and inf flag (the kernel unscales); steps with an
    inf are skipped on both twins alike (the small initial growth interval makes some)."""
    with testing.simulated_device(seed=4, max_delay_s=0.001) as sim:
        model, ref, h = twins("llama", torch.float16, 4)
        opt = offload_adam.AdamW(model.parameters(), lr=1e-3)
        ropt = offload_adam.AdamW(ref.parameters(), lr=1e-3)
        data = batches(12, 4)
        scales: list[list[float]] = []
        for m, o in ((ref, ropt), (model, opt)):
            scaler = torch.amp.GradScaler(sim.torch_device.type, init_scale=2.0**15, growth_interval=3)
            scales.append([])
            train(m, o, data, scaler=scaler, after=lambda k: scales[-1].append(scaler.get_scale()))
        assert scales[0] == scales[1] and any(b < a for a, b in zip(scales[0], scales[0][1:]))  # a step skipped
        assert_same(model, ref, opt, ropt)
        opt.close()
        h.close()


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_resident_blocks_and_the_nvme_state_tier(offload: str, nvme_dir: str) -> None:
    """Whole blocks resident within gpu_budget_gb keep the offloaded path with its copy-back, in
    the same param groups as the streamed ones; the state on NVMe pages as before."""
    nv = {"offload": "nvme", "nvme_dir": nvme_dir} if offload == "nvme" else {}
    with testing.simulated_device(seed=5, max_delay_s=0.001):
        model = llama(torch.bfloat16, 5)
        ref = to_device(copy.deepcopy(model))
        total = sum(p.numel() * p.element_size() for p in model.parameters())
        h = offload_adam.offload_weights(model, gpu_budget_gb=0.6 * total / 2**30, prefetch=1)
        assert 0 < len(h.resident) < len(h.blocks)
        groups = lambda m: [  # noqa: E731
            {"params": [p for n, p in m.named_parameters() if "norm" in n], "weight_decay": 0.0},
            {"params": [p for n, p in m.named_parameters() if "norm" not in n]},
        ]
        opt = offload_adam.AdamW(groups(model), lr=1e-3, weight_decay=0.1, bucket_mb=0.05, **nv)
        ropt = offload_adam.AdamW(groups(ref), lr=1e-3, weight_decay=0.1, bucket_mb=0.05, **nv)
        data = batches(12, 5)
        sched = [torch.optim.lr_scheduler.OneCycleLR(o, max_lr=1e-3, total_steps=12) for o in (opt, ropt)]
        train(ref, ropt, data, after=lambda k: sched[1].step())
        train(model, opt, data, after=lambda k: sched[0].step())
        assert_same(model, ref, opt, ropt)
        opt.close()
        ropt.close()
        h.close()


def test_bad_combinations_are_refused_before_anything_changes(nvme_dir: str) -> None:
    with testing.simulated_device(max_delay_s=0.0):
        model = gpt2(torch.float32, layers=2)
        h = offload_adam.offload_weights(model, storage="nvme", nvme_dir=nvme_dir)
        with pytest.raises(ValueError, match=r"streamed from NVMe .* train with offload_weights\(storage='cpu'\)"):
            offload_adam.AdamW(model.parameters())
        h.close()
        model = gpt2(torch.float32, layers=2)
        early = offload_adam.AdamW(model.parameters())
        with pytest.raises(ValueError, match="held by an offload_adam optimizer.* call offload_weights before building the optimizer"):
            offload_adam.offload_weights(model)
        early.close()
        h = offload_adam.offload_weights(model)  # once the optimizer let go
        opt = offload_adam.AdamW(model.parameters())
        h.close()  # hands the weights back (the optimizer may no longer step them)
        assert not any(p.isnan().any() for p in model.parameters())
        model(torch.randint(1, VOCAB, (1, 4))).logits.sum().backward()
        with pytest.raises(RuntimeError, match="handed back by their offload's close"):
            opt.step()
        opt.close()


def test_train_weights_bench_reports_bytes_and_breakdown() -> None:
    """The bench's CPU part (simulated device): both cases measured, the streamed one moving no
    copy-back and its weights up about twice a step, the resident one copying back."""
    from offload_adam.tools import train_weights_bench

    with testing.simulated_device(max_delay_s=0.0, lazy=False) as sim:
        res = train_weights_bench._measure(layers=2, d=64, vocab=256, batch=2, seq=8, rounds=2, prefetch=1, cuda=False, device=sim.torch_device)
    s, r = res["streamed (offload_weights)"], res["resident, optimizer offloaded"]
    assert s["h2d_bytes_copy_back"] == 0 and r["h2d_bytes_copy_back"] > 0
    assert s["d2h_bytes"] == r["d2h_bytes"] > 0
    assert s["streamed_bytes"] < s["weights_h2d_bytes"] <= 2 * s["streamed_bytes"]
    assert s["gpu_peak_bytes"] <= s["ring_bytes"] + s["gpu_resident_bytes"] + 64


@pytest.mark.parametrize("prefetch", [1, 2])
def test_an_eval_pass_after_training_never_refills_a_slot_compute_may_still_read(prefetch: int) -> None:
    """CUDA review (December) finding 1: in a training cycle the untied head is one instance
    across its forward and backward, kept after its forward release with no free event; an eval
    pass after training changes the order, its slot is dropped (``_cancel``), and the next load
    into it must wait for the head's last read on the compute stream. The simulator's
    happens-before check sees the copy that does not; the logits stay bitwise the resident
    model's."""
    data = batches(3, 5)
    with testing.simulated_device(seed=5, max_delay_s=0.001) as sim:
        model, ref, h = twins("llama", torch.float32, 5, prefetch=prefetch)
        assert model.lm_head.weight is not model.model.embed_tokens.weight
        opt = offload_adam.AdamW(model.parameters(), lr=1e-3)
        ropt = offload_adam.AdamW(ref.parameters(), lr=1e-3)
        train(ref, ropt, data[:2])
        train(model, opt, data[:2])
        x = to_device(data[2])
        for _ in range(3):
            with torch.no_grad():
                got, want = model.eval()(x).logits, ref.eval()(x).logits
            assert torch.equal(to_host(got), to_host(want))
        toks = model.generate(x[:, :4], attention_mask=torch.ones_like(x[:, :4]), max_new_tokens=6, do_sample=False, pad_token_id=0)
        rtoks = ref.generate(x[:, :4], attention_mask=torch.ones_like(x[:, :4]), max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert torch.equal(to_host(toks), to_host(rtoks))
        opt.close()
        h.close()
        assert sim.violations == []


def test_autocast_training_recasts_streamed_weights_in_the_backward() -> None:
    """Finding 2 in training: F.linear under autocast saves the bf16 cast of an fp32 weight, a
    new tensor off the ring; it is saved as a token and cast again from the slot in the
    backward, so no cast of a streamed weight is held between the forward and the backward. The
    training is bitwise the resident model's under autocast (whose cache keeps its casts)."""
    import gc
    import weakref

    from torch.utils._python_dispatch import TorchDispatchMode

    data = batches(4, 8)
    with testing.simulated_device(seed=8, max_delay_s=0.001) as sim:
        model, ref, h = twins("llama", torch.float32, 8, prefetch=1)
        opt = offload_adam.AdamW(model.parameters(), lr=1e-3, bucket_mb=0.05)
        ropt = offload_adam.AdamW(ref.parameters(), lr=1e-3, bucket_mb=0.05)
        slots = {s.buf.untyped_storage().data_ptr() for s in h.streamer.ring.slots}
        casts: list[Any] = []

        class Watch(TorchDispatchMode):
            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                out = func(*args, **(kwargs or {}))
                if func is torch.ops.aten._to_copy.default and mem(args[0]).untyped_storage().data_ptr() in slots:
                    casts.append(weakref.ref(out))
                return out

        for m, o in ((ref, ropt), (model, opt)):
            for x in data:
                with torch.autocast(sim.torch_device.type, torch.bfloat16):
                    with Watch() if m is model else contextlib.nullcontext():
                        loss = loss_of(m, x)
                if m is model:
                    gc.collect()
                    assert casts and not any(c() is not None for c in casts)  # none held for the backward
                    casts.clear()
                loss.backward()
                o.step()
                o.zero_grad()
        opt.synchronize()
        assert_same(model, ref, opt, ropt)
        opt.close()
        h.close()
        assert sim.violations == []


def test_the_context_manager_around_training_hands_the_trained_model_back() -> None:
    """``with offload_weights(model) as h:`` around a training loop: its exit hands the model
    back (the trained weights as ordinary host tensors, bitwise the resident training's) instead
    of raising; the optimizer then refuses to step the released weights, and its state_dict()
    still works."""
    data = batches(4, 9)
    with testing.simulated_device(seed=9, max_delay_s=0.001) as sim:
        model = MODELS["gpt2"](torch.float32, 9)
        ref = to_device(copy.deepcopy(model))
        ropt = offload_adam.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1, bucket_mb=0.05)
        train(ref, ropt, data)
        with offload_adam.offload_weights(model, prefetch=1):
            opt = offload_adam.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, bucket_mb=0.05, async_step=True)
            train(model, opt, data)
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            assert type(p.data) is torch.Tensor and p.device.type == "cpu" and torch.equal(p, to_host(q)), n
        sd, rsd = opt.state_dict(), ropt.state_dict()
        for k, v in rsd["state"].items():
            for key, t in v.items():
                assert torch.equal(sd["state"][k][key], t), (k, key)
        loss_of(model, data[0]).backward()
        with pytest.raises(RuntimeError, match="handed back by their offload's close"):
            opt.step()
        opt.close()
        assert sim.violations == []


def test_an_eval_call_on_the_cpu_right_after_an_async_step_reads_the_stepped_weights() -> None:
    """Placement "cpu": an inference call runs a block from its host copy, which an async step
    may still be writing; the call waits the block's fences first. The eval right after each
    async step is bitwise the resident model's (trained the same way, synchronously)."""
    data = batches(4, 7)
    with testing.simulated_device(seed=7, max_delay_s=0.001) as sim:
        model, ref, h = twins("llama", torch.float32, 7, prefetch=1, placement="cpu")
        opt = offload_adam.AdamW(model.parameters(), lr=1e-2, async_step=True)
        ropt = offload_adam.AdamW(ref.parameters(), lr=1e-2)
        for x in data[:3]:
            train(ref, ropt, [x])
            train(model, opt, [x])
            with torch.no_grad():
                x = to_device(data[3])
                got, want = model(x).logits, ref(x).logits
            assert torch.equal(to_host(got), to_host(want))
        assert h.report()["calls"]["prompt"]["cpu"] > 0
        opt.close()
        h.close()
        assert sim.violations == []


@pytest.mark.parametrize(
    "arch, dtype, seed, state_dtype",
    [("gpt2", torch.float32, 0, torch.uint8), ("llama", torch.bfloat16, 1, torch.uint8), ("llama", torch.bfloat16, 2, torch.float8_e4m3fn)],
)
def test_compact_state_trains_streamed_weights_bitwise_as_on_the_cpu(arch: str, dtype: torch.dtype, seed: int, state_dtype: torch.dtype) -> None:
    """8-bit or fp8 moments, and bf16 weights updated in their host copy with Kahan compensation
    (no fp32 master): the streamed training on the simulated device is bitwise the same model's
    training on the CPU (an offloaded resident twin would keep an fp32 master:
    master_dtype=torch.bfloat16 needs the weights on the host). The simulated device computes as
    the CPU, backward too (its silu_backward is the CPU's kernel, not the composite)."""
    kw = {"state_dtype": state_dtype, "master_dtype": torch.bfloat16}
    data = batches(12, seed)
    ref = MODELS[arch](dtype, seed)
    ropt = offload_adam.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1, bucket_mb=0.05, **kw)
    train(ref, ropt, data)
    with testing.simulated_device(seed=seed, max_delay_s=0.001) as sim:
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
