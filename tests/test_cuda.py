"""GPU offload on a real CUDA device (skipped without one): the same loop as test_streaming.py,
with streams, events and pinned host memory."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from offload_adam import AdamW
from offload_adam.weights.costs import CostModel

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


def run(dtype: torch.dtype, set_to_none: bool = True, **kw: Any) -> None:
    """Training against torch fused on the GPU, with the most common loop: zero_grad right after
    step (which races the gradient copies of an async step unless the step orders them), the
    next batch allocated after it (reusing freed gradient blocks), no synchronize per step."""
    torch.manual_seed(0)
    a = Net().cuda().to(dtype)
    b = copy.deepcopy(a).float()
    ours = AdamW(a.parameters(), lr=1e-3, weight_decay=0.1, bucket_mb=0.25, **kw)
    ref = torch.optim.AdamW(b.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    for _ in range(20):
        for m, o in ((a, ours), (b, ref)):
            x = torch.randint(0, 97, (8, 32), device="cuda")
            loss = torch.nn.functional.cross_entropy(m(x).float().flatten(0, 1), x.flatten())
            loss.backward()
            o.step()
            o.zero_grad(set_to_none=set_to_none)
        if dtype != torch.float32:
            # torch in fp32 from our (rounded) weights and gradients is another trajectory:
            # compare the masters with torch only for fp32 models
            ours.synchronize()
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


def test_cuda_is_torchs_accelerator_in_the_cuda_tests() -> None:
    """The CUDA tests run as a user's code does: CUDA is torch's accelerator, so autograd keeps
    each CUDA node's stream. (The test suite registered the simulated device's type at start-up,
    which made that torch's accelerator for the whole process.)"""
    accel = torch.accelerator.current_accelerator()
    assert accel is not None and accel.type == "cuda", accel


@pytest.mark.parametrize(
    "mode",
    [{}, {"async_step": True}, {"async_step": True, "set_to_none": False}, {"free_gradients": True}, {"free_gradients": True, "async_step": True}],
)
def test_cuda_training_matches_torch(mode: dict[str, Any]) -> None:
    run(torch.float32, **mode)


@pytest.mark.parametrize("mode", [{}, {"async_step": True}])
def test_cuda_bf16_model_fp32_masters(mode: dict[str, Any]) -> None:
    run(torch.bfloat16, **mode)


def test_cuda_memory_holds_no_optimizer_state() -> None:
    torch.manual_seed(0)
    m = Net(d=1024, layers=8).cuda()
    x = torch.randint(0, 97, (4, 64), device="cuda")
    m(x).float().sum().backward()  # warm-up: cuBLAS workspaces come from the caching allocator
    m.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    opt = AdamW(m.parameters(), free_gradients=True, bucket_mb=4)
    m(x).float().sum().backward()
    opt.step()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= before + (1 << 20)
    assert opt.memory_report()["gpu_bytes"] == 0
    rep = opt.memory_report()
    assert rep["host_bytes"] <= 1.05 * rep["host_tight_bytes"]


def test_cuda_async_step_never_lets_a_forward_read_a_stale_weight() -> None:
    from offload_adam import testing

    torch.manual_seed(0)
    with testing.engine_hooks(before_bucket=lambda k: __import__("time").sleep(0.005)):
        a = Net().cuda()
        ours = AdamW(a.parameters(), lr=1e-2, async_step=True, bucket_mb=0.05)
    for _ in range(5):
        x = torch.randint(0, 97, (8, 32), device="cuda")
        a(x).float().sum().backward()
        ours.step()
        ours.zero_grad(set_to_none=False)
        out = a(x)
        ours.synchronize()
        assert torch.equal(out, a(x))
    assert ours.last_step_stats["forward_wait_s"] > 0


def test_cuda_checkpoint_rollback_right_after_a_step_keeps_that_steps_weights() -> None:
    torch.manual_seed(0)
    a = Net().cuda()
    ours = AdamW(a.parameters(), lr=1e-2, bucket_mb=0.05)
    x = torch.randint(0, 97, (8, 32), device="cuda")
    a(x).float().sum().backward()
    ours.step()
    sd = copy.deepcopy(ours.state_dict())
    ours.zero_grad()
    a(x).float().sum().backward()
    ours.step()
    masters = [ours.state[p]["master_param"].clone() for p in a.parameters()]
    ours.load_state_dict(sd)  # rewrites the masters the copy-backs just read
    torch.cuda.synchronize()
    for p, w in zip(a.parameters(), masters):
        assert torch.equal(p.detach().cpu(), w)


def _primary_context_active(index: int) -> bool:
    """Whether GPU ``index`` has a primary context (``cuDevicePrimaryCtxGetState``, through the
    driver: a context allocates nothing through torch's caching allocator, so
    ``memory_reserved`` cannot see it)."""
    import ctypes

    cuda = ctypes.CDLL("libcuda.so.1")
    dev = ctypes.c_int()
    assert cuda.cuDeviceGet(ctypes.byref(dev), index) == 0
    flags, active = ctypes.c_uint(), ctypes.c_int()
    assert cuda.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags), ctypes.byref(active)) == 0
    return bool(active.value)


_SECOND_GPU = """
import gc, sys, torch
sys.path.insert(0, {tests!r})
from test_cuda import Net, _primary_context_active
import offload_adam
from offload_adam import AdamW
assert not _primary_context_active(0)
torch.manual_seed(0)
m = Net().to("cuda:1")
opt = AdamW(m.parameters(), async_step=True)
m(torch.randint(0, 97, (2, 8), device="cuda:1")).float().sum().backward()
opt.step()
opt.synchronize()
w = Net()
h = offload_adam.offload_weights(w, device="cuda:1", prefetch=1)
with offload_adam.offload_activations(device="cuda:1", min_bytes=1024) as ao:
    loss = w(torch.randint(0, 97, (2, 64), device="cuda:1")).float().sum()
loss.backward()
h.close()
ao.close()
del opt, m, h, ao, w
gc.collect()
print("context on GPU 0:", _primary_context_active(0))
assert not _primary_context_active(0)
"""


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_cuda_a_model_on_a_second_gpu_creates_no_context_on_the_first() -> None:
    """CUDA review (December) findings 3 and 4: the optimizer, the weights and the activations on
    cuda:1, from a thread whose current device is 0, create no primary context on GPU 0 (checked
    through the driver, in a fresh process: this one has contexts on every GPU already)."""
    import os
    import subprocess
    import sys

    code = _SECOND_GPU.format(tests=os.path.dirname(__file__))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("mode", [{}, {"async_step": True}, {"free_gradients": True}])
def test_cuda_nvme_tier_bitwise_equal_to_ram_tier(mode: dict[str, Any], tmp_path: Any) -> None:
    outs = []
    for extra in ({"offload": "nvme", "nvme_dir": str(tmp_path)}, {}):
        torch.manual_seed(0)
        m = Net().cuda()
        opt = AdamW(m.parameters(), lr=1e-3, weight_decay=0.1, bucket_mb=0.25, **extra, **mode)
        g = torch.Generator(device="cuda").manual_seed(1)
        for _ in range(15):
            x = torch.randint(0, 97, (8, 32), device="cuda", generator=g)
            torch.nn.functional.cross_entropy(m(x).float().flatten(0, 1), x.flatten()).backward()
            opt.step()
            opt.zero_grad()
        opt.synchronize()
        outs.append([p.detach().cpu() for p in m.parameters()])
        opt.close()
    assert all(torch.equal(a, b) for a, b in zip(*outs))


# -- weights offloaded ------------------------------------------------------------------------------


class _Big(torch.nn.Module):
    """Blocks with enough work that a missing wait shows: copies race the compute of the block
    the slot belonged to (the simulator cannot show this one: its compute is synchronous)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(1000, 1024)
        self.layers = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)) for _ in range(8)
        )
        self.head = torch.nn.Linear(1024, 1000, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for layer in self.layers:
            h = h + layer(h)
        return self.head(h)


@pytest.mark.parametrize("storage", ["cpu", "nvme"])
@pytest.mark.parametrize("prefetch", [0, 1, 3])
def test_cuda_weights_streamed_are_exact_and_bounded(storage: str, prefetch: int, tmp_path: Any) -> None:
    """Streamed through the GPU's ring (events, no host waits but the NVMe reads): the logits
    are bitwise those of the model resident on the GPU, the GPU holds the ring, not the model."""
    import offload_adam

    model = _Big().bfloat16().eval()
    ref = copy.deepcopy(model).cuda()
    x = torch.randint(0, 1000, (8, 256), device="cuda")
    with torch.no_grad():
        want = ref(x)
    del ref
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    kw = {"nvme_dir": str(tmp_path)} if storage == "nvme" else {}
    h = offload_adam.offload_weights(model, storage=storage, prefetch=prefetch, **kw)
    with torch.no_grad():
        for k in range(3):
            if k == 2:
                h.reset_stats()
            got = model(x)
            assert torch.equal(got, want)
    rep = h.report()
    assert rep["gpu_peak_bytes"] <= rep["ring_bytes"] + rep["gpu_resident_bytes"] + 64
    assert rep["ring_bytes"] < 0.6 * rep["weights_bytes"]
    # Each streamed block crosses once per forward but the embedding, looked up on the host (the
    # second CUDA review's hazard 1): only its rows cross, counted as hidden bytes, not h2d.
    looked_up = sum(h.blocks[i].nbytes for i in h.streamed if i in h.placer.host_only)
    assert looked_up >= model.emb.weight.numel() * model.emb.weight.element_size()
    assert rep["h2d_bytes"] == rep["streamed_bytes"] - looked_up and rep["h2d_s"] > 0
    h.close()
    assert next(model.parameters()).device.type == "cpu"


def test_cuda_weights_generate_matches_resident() -> None:
    transformers = pytest.importorskip("transformers")
    import offload_adam

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        num_hidden_layers=4, hidden_size=512, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=2,
        vocab_size=1000, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(cfg).bfloat16().eval()
    ref = copy.deepcopy(model).cuda()
    x = torch.randint(1, 1000, (2, 16), device="cuda")
    kw = {"max_new_tokens": 24, "min_new_tokens": 24, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        want = ref.generate(x, attention_mask=torch.ones_like(x), **kw)
    h = offload_adam.offload_weights(model, prefetch=2)
    with torch.no_grad():
        got = model.generate(x, attention_mask=torch.ones_like(x), **kw)
    assert torch.equal(got, want)
    h.close()


@pytest.mark.parametrize("storage", ["cpu", "nvme"])
def test_cuda_activations_offloaded_are_exact_and_save_memory(storage: str, tmp_path: Any) -> None:
    """On a GPU: the gradients are bitwise those without offloading, the peak memory falls,
    a tensor already on the host is kept as it is."""
    import offload_adam

    torch.manual_seed(0)
    m = Net(d=1024).cuda()
    ref = copy.deepcopy(m)
    x = torch.randint(0, 97, (16, 256), device="cuda")
    host = torch.randn(64, 64, requires_grad=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    ref(x).float().square().mean().backward()
    peak_ref = torch.cuda.max_memory_allocated() - base
    nv = {"storage": "nvme", "nvme_dir": str(tmp_path)} if storage == "nvme" else {}
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with offload_adam.offload_activations(min_bytes=1 << 16, **nv) as ao:
        loss = m(x).float().square().mean() + host.exp().sum()
    loss.backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    for p, q in zip(m.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)
    rep = ao.report()
    assert rep["h2d_bytes"] == rep["offloaded_bytes"] > 0 and rep["kept_tensors"] >= 1
    assert peak < peak_ref, (peak, peak_ref)
    ao.close()


# -- the CUDA review (December): what only a GPU shows ------------------------------------------------


def _llama(vocab: int = 32000, layers: int = 4) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        num_hidden_layers=layers, hidden_size=512, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=2,
        vocab_size=vocab, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg)  # untied head: one instance across forward and backward


def test_cuda_training_with_streamed_weights_then_eval_and_generate_match_resident() -> None:
    """Finding 1 on a GPU: train 2 steps with streamed weights and a large untied head (vocab
    32k, 2k tokens), then an eval pass and generate() (another block order) are bitwise the
    resident model's, a few rounds; under TORCH_CUDA_SANITIZER=1 an unordered H2D write against
    the head's GEMM is reported whatever the timing."""
    import offload_adam

    model = _llama().bfloat16()
    ref = copy.deepcopy(model).cuda()
    h = offload_adam.offload_weights(model, prefetch=2)
    opt = AdamW(model.parameters(), lr=1e-3, bucket_mb=16)
    ropt = AdamW(ref.parameters(), lr=1e-3, bucket_mb=16)
    g = torch.Generator(device="cuda").manual_seed(0)
    for _ in range(2):
        x = torch.randint(1, 32000, (2, 1024), device="cuda", generator=g)
        for m, o in ((model, opt), (ref, ropt)):
            out = m(x[:, :-1]).logits.float()
            torch.nn.functional.cross_entropy(out.flatten(0, 1), x[:, 1:].flatten()).backward()
            o.step()
            o.zero_grad()
    opt.synchronize()
    ropt.synchronize()
    x = torch.randint(1, 32000, (2, 1024), device="cuda", generator=g)
    for _ in range(3):
        with torch.no_grad():
            assert torch.equal(model.eval()(x).logits, ref.eval()(x).logits)
    kw = {"max_new_tokens": 16, "min_new_tokens": 16, "do_sample": False, "pad_token_id": 0}
    p = x[:, :32]
    assert torch.equal(
        model.generate(p, attention_mask=torch.ones_like(p), **kw), ref.generate(p, attention_mask=torch.ones_like(p), **kw)
    )
    opt.close()
    h.close()


@pytest.mark.parametrize("fresh", [False, True], ids=["one-handle", "handle-per-step"])
def test_cuda_activation_regions_reused_over_steps_stay_exact(fresh: bool) -> None:
    """Pinned regions reused over 5 steps (a d2h copy into a released region after the h2d
    copies that read it): the gradients are bitwise those without offloading, and a handle made
    each step pins nothing new (finding 6)."""
    import offload_adam

    torch.manual_seed(0)
    m = Net(d=1024).cuda()
    ref = copy.deepcopy(m)
    ao = None if fresh else offload_adam.offload_activations(min_bytes=1 << 16)
    pinned = []
    for step in range(5):
        x = torch.randint(0, 97, (16, 256), device="cuda")
        ref(x).float().square().mean().backward()
        handle = offload_adam.offload_activations(min_bytes=1 << 16) if fresh else ao
        assert handle is not None
        with handle:
            loss = m(x).float().square().mean()
        loss.backward()
        torch.cuda.synchronize()
        for p, q in zip(m.parameters(), ref.parameters()):
            assert torch.equal(p.grad, q.grad), step
        pinned.append(handle.report()["host_pinned_bytes"])
    assert pinned[1:] == pinned[:1] * 4, pinned


def test_cuda_autocast_keeps_no_copy_of_streamed_weights() -> None:
    """Finding 2 on a GPU: an fp32 model streamed under autocast holds the ring, not a bf16 copy
    of each weight: the peak is within the ring, the resident bytes and the activations."""
    import offload_adam

    model = _Big().eval()
    x = torch.randint(0, 1000, (8, 256), device="cuda")
    h = offload_adam.offload_weights(model, prefetch=1)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with torch.autocast("cuda", torch.bfloat16), torch.no_grad():
        model(x)
    peak = torch.cuda.max_memory_allocated() - base
    rep = h.report()
    # Cached, the bf16 copies alone would be half the fp32 weights; a block's casts and
    # activations are far less than a quarter of them.
    assert peak < rep["weights_bytes"] // 4, (peak, rep["weights_bytes"])
    h.close()


# -- the CUDA review, second pass: what only a GPU shows ---------------------------------------------
#
# The lag tests hold the compute stream back with torch.cuda._sleep (a spin kernel) so that the
# host runs ahead of the GPU, as it does in any real run with large layers: memory the host frees
# then still has kernels queued against it, and the caching allocator hands it to the next
# allocation of that stream at once. A copy from a side stream into such memory, not ordered after
# the allocation, lands before those kernels run (hazards 2 and 3). The tests of hazard 3 arrange
# the reuse rather than wait for it: right before the code under test allocates, they free blocks
# whose last kernel (a fill) is queued behind the spin, of the sizes it asks for, so that the
# allocator's best fit hands them out.

LAG = 1 << 28  # cycles of torch.cuda._sleep: about 0.15 s on an H200, far longer than the copies


@contextlib.contextmanager
def _freed_under_lag(*nbytes: int) -> Iterator[None]:
    """Blocks of these sizes on the compute stream, written by a fill queued behind a spin kernel,
    then freed; a 1-byte spacer after each stays allocated until the end of the ``with``, so that
    freed neighbours do not merge (each block stays its size, the best fit of an allocation of
    that size)."""
    junk, spacers = [], []
    for n in nbytes:
        junk.append(torch.empty(n, dtype=torch.uint8, device="cuda"))
        spacers.append(torch.empty(1, dtype=torch.uint8, device="cuda"))
    torch.cuda._sleep(LAG)
    while junk:
        junk.pop().fill_(7)  # (freed here: its fill still queued)
    yield
    del spacers


def test_cuda_a_streamed_embedding_takes_ids_on_the_gpu() -> None:
    """Hazard 1 (crash): offload_weights(model) with the defaults streams the embedding, whose
    inference call is looked up on the host; the ids are on the GPU. Its rows come back to the
    GPU, bitwise the resident model's output."""
    import offload_adam

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Embedding(100, 64), torch.nn.Linear(64, 64))
    ref = copy.deepcopy(m).cuda()
    ids = torch.randint(0, 100, (2, 8), device="cuda")
    h = offload_adam.offload_weights(m)
    with torch.no_grad():
        got, want = m(ids), ref(ids)
    assert got.device == ids.device and torch.equal(got, want)
    h.close()


def test_cuda_activations_reloaded_while_the_gpu_lags_are_exact() -> None:
    """Hazard 2: a reload buffer allocated on the compute stream and written by a copy stream
    must wait for the kernels still queued on the memory it reuses. A spin kernel queued at the
    start of the backward keeps the GPU behind the host for the rest of it; every layer's
    activation has the same size, so each reload gets the block the previous node just freed.
    The gradients are bitwise those without offloading, over 3 steps."""
    import offload_adam

    torch.manual_seed(0)
    m = Net(d=1024, layers=8).cuda()
    ref = copy.deepcopy(m)
    for step in range(3):
        x = torch.randint(0, 97, (16, 256), device="cuda")
        ref(x).float().square().mean().backward()
        with offload_adam.offload_activations(min_bytes=1 << 16, prefetch=2) as ao:
            out = m(x)
        out.register_hook(lambda g: (torch.cuda._sleep(LAG), g)[1])
        out.float().square().mean().backward()
        torch.cuda.synchronize()
        assert ao.report()["offloaded_bytes"] > 0
        for (n, p), q in zip(m.named_parameters(), ref.parameters()):
            assert torch.equal(p.grad, q.grad), (step, n)
        ao.close()


def _big_head_llama() -> torch.nn.Module:
    """A Llama whose untied head (vocab 32k x 2048, 131 MB in bf16) is larger than a layer (46 MB):
    the head gets a ring slot of its own, made at its first copy, in the middle of the first
    forward."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=2048, intermediate_size=2048, num_attention_heads=16, num_key_value_heads=4,
        vocab_size=32000, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg).bfloat16().eval()


def test_cuda_ring_slots_made_while_the_gpu_lags_are_exact() -> None:
    """Hazard 3, the ring: a slot is written by the copy stream right after its allocation on
    the compute stream; the first copy must wait for the kernels still queued on the memory it
    reuses. Memory freed under a spin kernel before the offload (its slots) and before the first
    no_grad forward (the head's own slot, made mid-forward): the logits are bitwise the resident
    model's."""
    import offload_adam

    model = _big_head_llama()
    x = torch.randint(1, 32000, (1, 1024), device="cuda")
    ref = copy.deepcopy(model).cuda()
    with torch.no_grad():
        want = ref(x).logits
    del ref
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    head = model.lm_head.weight.numel() * model.lm_head.weight.element_size()
    with _freed_under_lag(4 * head):  # the slots made at offload time (two layers' of it)
        h = offload_adam.offload_weights(model, prefetch=1)
    own = [i for i, b in enumerate(h.blocks) if any(m is model.lm_head for m in b.modules)]
    assert own and own[0] in h.streamed
    # The head's slot, made mid-forward: a block smaller than what the offload left of the first
    # one (so the best fit), larger than the head and the activations before it.
    with _freed_under_lag(2 * head), torch.no_grad():
        got = model(x).logits
    assert any(s.own == own[0] for s in h.streamer.ring.slots)  # its own slot, made in that forward
    assert torch.equal(got, want)
    h.close()


class _RowsModel(CostModel):
    """Forces placement="auto"'s choice by a call's rows: decode steps (batch 1) on the CPU,
    prompts streamed."""

    def choose(self, nbytes: int, params: int, rows: int, dtype: torch.dtype) -> str:
        return "cpu" if rows <= 2 else "stream"


def test_cuda_a_kv_cache_moved_back_while_the_gpu_lags_is_exact() -> None:
    """Hazard 3, the KV cache: placement="auto" decodes on the CPU (each layer's cache moved to
    the host), then a second prompt on the same cache streams and moves it back to the GPU into
    memory allocated on the compute stream. With blocks of the cache's sizes freed under a spin
    kernel right before that prompt, its logits and the next decode step are bitwise those of the
    same turns run with the GPU idle at each turn."""
    import offload_adam

    model = _llama(vocab=1000).bfloat16().eval()
    g = torch.Generator().manual_seed(3)
    p1, p2 = (torch.randint(1, 1000, (1, 8), generator=g).cuda() for _ in range(2))
    h = offload_adam.offload_weights(model, placement="auto", prefetch=1, cost_model=_RowsModel())

    @torch.no_grad()
    def turns(lag: bool) -> list[torch.Tensor]:
        out = model(input_ids=p1, use_cache=True)
        past, logits = out.past_key_values, [out.logits]
        for _ in range(3):
            out = model(input_ids=out.logits[:, -1:].argmax(-1), past_key_values=past, use_cache=True)
            past = out.past_key_values
            logits.append(out.logits)
        assert all(t.device.type == "cpu" for layer in past.layers for t in (layer.keys, layer.values))  # decoded on the host
        h.reset_stats()
        sizes = [t.numel() * t.element_size() for layer in past.layers for t in (layer.keys, layer.values)]
        torch.cuda.synchronize()
        with _freed_under_lag(*sizes) if lag else contextlib.nullcontext():
            out = model(input_ids=p2, past_key_values=past, use_cache=True)
        assert h.report()["kv_bytes"] > 0  # the cache moved back to the GPU for the streamed prompt
        logits.append(out.logits)
        out = model(input_ids=out.logits[:, -1:].argmax(-1), past_key_values=out.past_key_values, use_cache=True)
        logits.append(out.logits)
        torch.cuda.synchronize()
        return [t.cpu() for t in logits]

    want = turns(lag=False)
    got = turns(lag=True)
    for k, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), k
    h.close()


def test_cuda_a_quantized_model_decoded_on_the_cpu_runs_the_native_kernel() -> None:
    """Hazard 4: an int8 weight rebuilt on the GPU reports cuda while a CPU-run block points its
    inner tensors at host bytes; judged by the wrapper's device, the native kernel never ran
    (torchao's torch path instead, 13-20x slower). placement="cpu", 4 greedy tokens."""
    torchao_q = pytest.importorskip("torchao.quantization")
    import offload_adam

    model = _llama(vocab=1000).bfloat16().eval()
    torchao_q.quantize_(model, torchao_q.Int8WeightOnlyConfig())
    x = torch.randint(1, 1000, (1, 16), device="cuda")
    h = offload_adam.offload_weights(model, placement="cpu", prefetch=1)
    with torch.no_grad():
        got = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
    r = h.report()
    assert got.device == x.device and got.shape == (1, 20)
    assert r["calls"]["decode"]["cpu"] > 0 and r["calls"]["decode"]["stream"] == 0
    assert r["native_calls"] > 0, r
    h.close()


class _LoRA(torch.nn.Module):
    """A low-rank adapter in bfloat16 beside a frozen (quantized) linear (as test_quantized's)."""

    def __init__(self, base: torch.nn.Linear, rank: int = 4) -> None:
        super().__init__()
        self.base = base
        out, inp = base.weight.shape
        self.A = torch.nn.Parameter(torch.randn(rank, inp, dtype=torch.bfloat16) * 0.1)
        self.B = torch.nn.Parameter(torch.randn(out, rank, dtype=torch.bfloat16) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + torch.nn.functional.linear(torch.nn.functional.linear(x, self.A), self.B)


def test_cuda_qlora_under_autocast_is_bitwise_the_resident_quantized_base() -> None:
    """Hazard 5: the frozen base's backward recomputes its F.linear; outside the forward's
    autocast that is an fp32 GEMM over an fp32 dequantized copy (other bits, 15x slower on an
    H200). An fp32 Llama quantized int8 with bf16 adapters, 3 steps under
    torch.autocast("cuda", torch.bfloat16), the base streamed and the adapters resident: the
    adapters' gradients at every step and their weights after are bitwise those of the same
    training with the quantized base resident on the GPU."""
    torchao_q = pytest.importorskip("torchao.quantization")
    import offload_adam

    model = _llama(vocab=1000, layers=3).train()
    torchao_q.quantize_(model, torchao_q.Int8WeightOnlyConfig())
    for p in model.parameters():
        p.requires_grad_(False)
    for layer in model.model.layers:
        for parent, name in ((layer.self_attn, "q_proj"), (layer.self_attn, "v_proj"), (layer.mlp, "up_proj"), (layer.mlp, "down_proj")):
            setattr(parent, name, _LoRA(getattr(parent, name)))
    ref = copy.deepcopy(model).cuda()
    g = torch.Generator().manual_seed(9)
    data = [torch.randint(1, 1000, (2, 65), generator=g).cuda() for _ in range(3)]

    def train(m: torch.nn.Module) -> list[list[torch.Tensor]]:
        params = [p for p in m.parameters() if p.requires_grad]
        opt = AdamW(params, lr=1e-2)
        grads = []
        for x in data:
            with torch.autocast("cuda", torch.bfloat16):
                out = m(x[:, :-1]).logits.float()
            torch.nn.functional.cross_entropy(out.flatten(0, 1), x[:, 1:].flatten()).backward()
            grads.append([p.grad.clone() for p in params])
            opt.step()
            opt.zero_grad()
        torch.cuda.synchronize()
        return grads

    want = train(ref)
    h = offload_adam.offload_weights(model, prefetch=1, resident=lambda n, p: p.requires_grad)
    got = train(model)
    for step, (a, b) in enumerate(zip(got, want)):
        for k, (ga, gb) in enumerate(zip(a, b)):
            assert ga.device.type == "cuda" and torch.equal(ga, gb), (step, k)
    h.close()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        if p.requires_grad:
            assert torch.equal(p.detach().cpu(), q.detach().cpu()), n


def test_cuda_measuring_pcie_leaves_no_pinned_memory_behind() -> None:
    """Hazard 9: the first placement="auto" measured the PCIe rate from a 256 MB buffer of
    torch's pinned allocator, which caches it for the life of the process. The measurement
    registers its own buffer and unregisters it when done."""
    import gc

    from offload_adam.weights.costs import pcie_h2d_rates

    def pinned() -> int:
        return int(torch.cuda.host_memory_stats().get("allocated_bytes.current", 0))

    before = pinned()
    rates = pcie_h2d_rates(torch.device("cuda"), 64 << 20, rounds=2)
    gc.collect()
    assert len(rates) == 2 and all(r > 0 for r in rates)
    assert pinned() <= before  # nothing left in torch's pinned cache
