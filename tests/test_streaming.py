"""The GPU-offload machinery (hooks, buckets, worker, copy-back, pre-hook waits, accumulation,
clipping, GradScaler), run on a simulated asynchronous device (the model moved there as to
"cuda"; torch's AdamW on the CPU as reference): side
streams are worker threads that run copies late (random seeded delays), waits of the current
stream are honoured lazily, and memory freed under a queued copy is poisoned with NaN."""

from __future__ import annotations

import copy
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from helpers import max_diff, to_device

from offload_adam import AdamW, testing
from offload_adam.runtime.device import device_for
from offload_adam.testing.simdevice import SimulatedDevice

TOL = 2e-5
SEEDS = [0, 1, 2]


@pytest.fixture(autouse=True)
def sim(request: pytest.FixtureRequest) -> Iterator[SimulatedDevice]:
    """Every test runs on a simulated device; tests parametrized by ``seed`` under several."""
    callspec = getattr(request.node, "callspec", None)
    seed = callspec.params.get("seed", 0) if callspec is not None else 0
    with testing.simulated_device(seed=seed, max_delay_s=0.002) as dev:
        yield dev
    assert dev.violations == []


class Net(torch.nn.Module):
    def __init__(self, d: int = 16, layers: int = 3, vocab: int = 11) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.unused = torch.nn.Linear(d, d)  # never gets a gradient

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.head(self.norm(h))


def twins(dtype: torch.dtype = torch.float32, **kw: Any) -> tuple[Net, Net, AdamW, torch.optim.AdamW]:
    torch.manual_seed(0)
    a = to_device(Net().to(dtype))
    b = Net()
    b.load_state_dict({k: v.float().cpu() for k, v in a.state_dict().items()})
    opt_kw = {k: kw.pop(k) for k in ("free_gradients", "async_step", "bucket_mb") if k in kw}
    ours = AdamW(a.parameters(), lr=1e-2, bucket_mb=opt_kw.pop("bucket_mb", 0.001), **opt_kw, **kw)
    ref = torch.optim.AdamW(b.parameters(), lr=1e-2, foreach=False, **kw)
    return a, b, ours, ref


def loss_of(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    x = x.to(next(m.parameters()).device)  # the batch where the model is, as a user moves it
    return torch.nn.functional.cross_entropy(m(x).float().flatten(0, 1), x.flatten())


def batches(n: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 11, (4, 6), generator=g) for _ in range(n)]


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module, tol: float = TOL) -> None:
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert max_diff(p.float().cpu(), q.cpu()) <= tol, n


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", [{}, {"async_step": True}, {"free_gradients": True}, {"free_gradients": True, "async_step": True}])
def test_training_matches_torch(mode: dict[str, Any], seed: int) -> None:
    a, b, ours, ref = twins(**mode, weight_decay=0.1, amsgrad=True)
    assert ours._engine.streamed is not None and len(ours._engine.streamed.buckets) > 3
    for x in batches(40):
        for m, o in ((a, ours), (b, ref)):
            o.zero_grad()
            loss_of(m, x).backward()
            o.step()
        if mode.get("free_gradients"):
            assert all(p.grad is None for p in a.parameters())
    ours.synchronize()
    assert_same_weights(a, b)
    assert a.unused.weight not in ours.state  # no gradient, no state, no step
    assert float(ours.state[a.layers[0].weight]["step"]) == 40


@pytest.mark.parametrize("async_step", [False, True])
def test_param_groups_and_a_scheduler_cycling_betas(async_step: bool) -> None:
    """With async_step the scheduler changes lr/betas while the step is still running: the step
    must use the values it was started with."""
    torch.manual_seed(0)
    a, b = Net(), Net()
    b.load_state_dict(a.state_dict())
    a = to_device(a)

    def groups(m: Net) -> list[dict[str, Any]]:
        return [
            {"params": list(m.layers.parameters()), "weight_decay": 0.2},
            {"params": list(m.emb.parameters()) + list(m.norm.parameters()), "lr": 3e-3, "amsgrad": True},
        ]

    with testing.engine_hooks(before_bucket=lambda k: time.sleep(0.002 if async_step else 0.0)):
        ours = AdamW(groups(a), lr=1e-2, bucket_mb=0.001, async_step=async_step)
    ref = torch.optim.AdamW(groups(b), lr=1e-2, foreach=False)
    s1 = torch.optim.lr_scheduler.OneCycleLR(ours, max_lr=[1e-2, 3e-3], total_steps=30)
    s2 = torch.optim.lr_scheduler.OneCycleLR(ref, max_lr=[1e-2, 3e-3], total_steps=30)
    for x in batches(30):
        for m, o, sch in ((a, ours, s1), (b, ref, s2)):
            o.zero_grad()
            loss_of(m, x).backward()
            o.step()
            sch.step()
    ours.synchronize()
    assert_same_weights(a, b)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("free", [False, True])
def test_gradient_accumulation_is_exact(free: bool, seed: int) -> None:
    a, b, ours, ref = twins(free_gradients=free)
    data = batches(24)
    for k in range(0, 24, 4):
        for m, o in ((a, ours), (b, ref)):
            o.zero_grad()
            for x in data[k : k + 4]:
                (loss_of(m, x) / 4).backward()
            o.step()
    assert_same_weights(a, b)


def test_low_precision_model_keeps_fp32_masters_on_the_host() -> None:
    a, b, ours, ref = twins(dtype=torch.bfloat16)
    data = batches(20)
    for x in data:
        ours.zero_grad()
        loss_of(a, x).backward()
        # torch, in fp32, fed the same (bf16) gradients
        ref.zero_grad()
        for p, q in zip(a.parameters(), b.parameters()):
            q.grad = None if p.grad is None else p.grad.float().cpu()
        ours.step()
        ref.step()
        for p, q in zip(a.parameters(), b.parameters()):
            q.data.copy_(q.data)  # torch keeps its own fp32 trajectory
    for p, q in zip(a.parameters(), b.parameters()):
        st = ours.state.get(p)
        if not st:
            continue
        assert st["master_param"].dtype == torch.float32
        assert max_diff(st["master_param"], q) <= TOL
        assert torch.equal(p.detach().cpu(), st["master_param"].to(torch.bfloat16))


def test_clip_grad_norm_on_the_model_is_seen_and_the_fast_path_matches() -> None:
    # torch's own clip on the model's gradients, between backward and step (HF Trainer)
    a, b, ours, ref = twins()
    for x in batches(20):
        for m, o in ((a, ours), (b, ref)):
            o.zero_grad()
            (loss_of(m, x) * 50).backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            o.step()
    assert_same_weights(a, b)
    # the fast path: same norm as torch's, same trajectory; with free_gradients too
    for free in (False, True):
        a, b, ours, ref = twins(free_gradients=free)
        for x in batches(20):
            for m, o in ((a, ours), (b, ref)):
                o.zero_grad()
                (loss_of(m, x) * 50).backward()
            norm = ours.clip_grad_norm_(1.0)
            want = torch.nn.utils.clip_grad_norm_(b.parameters(), 1.0)
            assert abs(float(norm) - float(want)) <= 1e-5 * float(want)
            ours.step()
            ref.step()
        assert_same_weights(a, b)


def test_grad_scaler_unscales_in_the_kernel_and_skips_infs() -> None:
    a, b, ours, ref = twins()
    sa = torch.amp.GradScaler(next(a.parameters()).device.type, init_scale=2.0**12, growth_interval=3)
    sb = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=3)
    for t, x in enumerate(batches(20)):
        for m, o, s in ((a, ours, sa), (b, ref, sb)):
            o.zero_grad()
            s.scale(loss_of(m, x)).backward()
            if t == 7:  # an overflow: the step is skipped and the scale drops
                m.layers[1].bias.grad[0] = float("inf")
            s.step(o)
            s.update()
        assert sa.get_scale() == sb.get_scale()
        if t not in (7, 8):  # (the inf written at 7 is a gradient edited after the backward)
            # GradScaler hands the kernel the scale: each gradient crossed once, no in-place
            # unscale made them cross again
            assert ours.last_step_stats["d2h_bytes"] == sum(p.numel() * p.element_size() for p in a.parameters() if p.grad is not None)
    assert float(ours.state[a.layers[0].weight]["step"]) == 19
    assert_same_weights(a, b)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_an_unscale_before_the_step_is_not_lost(seed: int) -> None:
    """``scaler.unscale_(opt)`` before ``scaler.step(opt)`` (to read or clip the gradients, and
    what Lightning's 16-mixed does): the unscale writes the device gradients in place without
    bumping their version, after the hooks copied them; the step then got no scale and
    stepped the host copies still scaled. It copies them again now."""
    a, b, ours, ref = twins()
    sa = torch.amp.GradScaler(next(a.parameters()).device.type, init_scale=2.0**12, growth_interval=3)
    sb = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=3)
    for x in batches(8):
        for m, o, s in ((a, ours, sa), (b, ref, sb)):
            o.zero_grad()
            s.scale(loss_of(m, x)).backward()
            s.unscale_(o)
            s.step(o)
            s.update()
    assert_same_weights(a, b)


def test_grad_scaler_with_free_gradients_is_refused_clearly() -> None:
    a, _, ours, _ = twins(free_gradients=True)
    s = torch.amp.GradScaler(next(a.parameters()).device.type)
    s.scale(loss_of(a, batches(1)[0])).backward()
    with pytest.raises((NotImplementedError, AssertionError)):
        s.step(ours)
        s.update()


@pytest.mark.parametrize("seed", SEEDS)
def test_async_step_never_lets_a_forward_read_a_stale_weight(seed: int) -> None:
    with testing.engine_hooks(before_bucket=lambda k: time.sleep(0.02)):  # the next forward overtakes the step
        a, b, ours, ref = twins(async_step=True)
    for x in batches(6):
        ours.zero_grad()
        loss_of(a, x).backward()
        ours.step()
        out = a(to_device(x))  # runs while the worker is still updating later buckets
        ours.synchronize()
        assert torch.equal(out, a(to_device(x))), "the forward read a weight before its update"
        ref.zero_grad()
        loss_of(b, x).backward()
        ref.step()
    assert ours.last_step_stats["forward_wait_s"] > 0
    assert_same_weights(a, b)


def test_worker_errors_reach_the_caller_and_leave_state_consistent() -> None:
    fail = [True]

    def before_bucket(k: int) -> None:
        if fail[0]:
            raise RuntimeError("disk on fire")

    with testing.engine_hooks(before_bucket=before_bucket):
        a, _, ours, _ = twins(async_step=True)
    x = batches(1)[0]
    loss_of(a, x).backward()
    before = [p.detach().clone() for p in a.parameters()]
    ours.param_groups[0]["lr"] = float("nan")
    with pytest.raises(ValueError, match="Invalid learning rate"):  # refused before anything runs
        ours.step()
    ours.param_groups[0]["lr"] = 1e-2
    ours.step()
    with pytest.raises(RuntimeError, match="disk on fire"):
        ours.synchronize()
    for p, w in zip(a.parameters(), before):
        assert torch.equal(p.detach(), w)
    assert len(ours.state) == 0  # no state handed out for a step that did not run
    fail[0] = False
    ours.step()  # the gradients are still there: this step applies them
    ours.synchronize()
    assert any(not torch.equal(p.detach(), w) for p, w in zip(a.parameters(), before))


def _interrupt_at(n: int) -> Any:
    def hook(k: int) -> None:
        if k == n:
            raise KeyboardInterrupt

    return hook


def test_keyboard_interrupt_leaves_each_bucket_updated_or_untouched() -> None:
    with testing.engine_hooks(before_bucket=_interrupt_at(2)):
        a, _, ours, _ = twins()
    x = batches(1)[0]
    loss_of(a, x).backward()
    before = {id(p): p.detach().clone() for p in a.parameters()}
    with pytest.raises(KeyboardInterrupt):
        ours.step()
    st = ours._engine.streamed
    updated = untouched = 0
    for bk in st.buckets:
        ps = [r.param for r in bk.recs if r.param.grad is not None]
        if not ps:
            continue
        changed = [not torch.equal(p.detach(), before[id(p)]) for p in ps]
        assert all(changed) or not any(changed)
        updated += all(changed) and bool(changed)
        untouched += not any(changed)
    assert updated == 2 and untouched >= 1


def test_edge_cases_of_the_loop() -> None:
    a, b, ours, ref = twins()
    w = [p.detach().clone() for p in a.parameters()]
    ours.step()  # no backward: a no-op
    assert all(torch.equal(p.detach(), q) for p, q in zip(a.parameters(), w)) and len(ours.state) == 0
    x, y = batches(2)
    loss_of(a, x).backward()
    ours.zero_grad()  # discards the streamed gradients too
    ours.step()
    assert all(torch.equal(p.detach(), q) for p, q in zip(a.parameters(), w))
    for m, o in ((a, ours), (b, ref)):  # backward twice without a step accumulates
        o.zero_grad()
        loss_of(m, x).backward()
        loss_of(m, y).backward()
        o.step()
    assert_same_weights(a, b)


def test_state_dict_round_trips_with_torch_and_resumes_exactly() -> None:
    a, b, ours, ref = twins(amsgrad=True)
    data = batches(30)
    for x in data[:10]:
        for m, o in ((a, ours), (b, ref)):
            o.zero_grad()
            loss_of(m, x).backward()
            o.step()
    sd = copy.deepcopy(ours.state_dict())
    assert "master_param" in sd["state"][0] and sd["state"][0]["exp_avg"].device.type == "cpu"
    # resume in a fresh optimizer (and model), and in torch from our checkpoint
    a2 = copy.deepcopy(a)
    ours2 = AdamW(a2.parameters(), lr=1e-2, amsgrad=True, bucket_mb=0.001)
    ours2.load_state_dict(sd)
    b2 = Net()  # (a copy of a on the host: the simulated device's .cpu() would untie the tied weights)
    b2.load_state_dict({k: v.float().cpu() for k, v in a.state_dict().items()})
    ref2 = torch.optim.AdamW(b2.parameters(), lr=1e-2, amsgrad=True, foreach=False)
    ref2.load_state_dict(copy.deepcopy(sd))
    for x in data[10:]:
        for m, o in ((a, ours), (a2, ours2), (b2, ref2), (b, ref)):
            o.zero_grad()
            loss_of(m, x).backward()
            o.step()
    assert_same_weights(a2, a, tol=0.0)
    assert_same_weights(a2, b)
    assert_same_weights(b2, b)


def test_model_checkpoint_loaded_mid_training_is_taken_over() -> None:
    a, _, ours, _ = twins(dtype=torch.bfloat16)
    snapshot = copy.deepcopy(a.state_dict())
    for x in batches(5):
        ours.zero_grad()
        loss_of(a, x).backward()
        ours.step()
    a.load_state_dict(snapshot)  # back to the start, behind the optimizer's back
    ours.zero_grad()
    loss_of(a, batches(1, seed=3)[0]).backward()
    ours.step()
    for k, p in a.named_parameters():
        if p in ours.state:
            assert max_diff(p.cpu(), snapshot[k].cpu()) < 0.1, k  # one step away from the loaded weights


def test_thousands_of_small_parameters_and_memory_report() -> None:
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(to_device(torch.randn(64))) for _ in range(2000)]
    qs = [torch.nn.Parameter(p.detach().cpu()) for p in ps]
    ours = AdamW(ps, lr=1e-3)
    ref = torch.optim.AdamW(qs, lr=1e-3, foreach=False)
    for _ in range(2):  # (2 steps: each is 2000 parameters' operations on the simulated device)
        for p, q in zip(ps, qs):
            g = torch.randn(64)
            p.grad, q.grad = to_device(g), g.clone()
        ours.step()
        ref.step()
    assert max(max_diff(p.cpu(), q) for p, q in zip(ps, qs)) <= TOL
    for dtype, grad_bytes in ((torch.float32, 4), (torch.bfloat16, 2)):
        big = [torch.nn.Parameter(to_device(torch.randn(1 << 20).to(dtype))) for _ in range(4)]
        rep = AdamW(big).memory_report()
        assert rep["gpu_bytes"] == 0
        # 4 B master + 8 B moments + the landing buffer (which also carries the bf16 copy back)
        assert rep["host_tight_bytes"] == 4 * (1 << 20) * (4 + 8 + grad_bytes)
        assert rep["host_bytes"] <= 1.05 * rep["host_tight_bytes"]


def test_moved_or_retyped_parameters_are_refused_before_anything_changes() -> None:
    a, _, ours, _ = twins()
    loss_of(a, batches(1)[0]).backward()
    ours.step()
    for p in a.parameters():  # what a.double() does to a CUDA model: the same objects, retyped
        p.data = p.data.double()
    loss_of(a, batches(1)[0]).backward()
    w = [p.detach().clone() for p in a.parameters()]
    with pytest.raises(RuntimeError, match="moved or changed"):
        ours.step()
    assert all(torch.equal(p.detach(), q) for p, q in zip(a.parameters(), w))


def test_profiler_sees_named_ranges() -> None:
    a, _, ours, _ = twins()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        loss_of(a, batches(1)[0]).backward()
        ours.step()
    names = {e.name for e in prof.events()}
    assert {"offload_adam.d2h", "offload_adam.cpu_step", "offload_adam.h2d"} <= names


def test_streaming_is_reported_by_the_package(sim: SimulatedDevice) -> None:
    """Inside `testing.simulated_device()` the runtime streams the simulated device's tensors
    through it, and CPU tensors are host memory; outside, and in the product's own imports,
    there is no simulator."""
    assert device_for(sim.torch_device) is sim
    assert device_for(torch.device("cpu")) is None
    assert testing.active_device() is sim
    code = "import sys, offload_adam; print(sorted(m for m in sys.modules if m.startswith('offload_adam.testing')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]"


@pytest.mark.cuda
def test_cuda_parameters_on_two_devices_or_mixed_with_cpu() -> None:
    p = torch.nn.Parameter(torch.randn(4, device="cuda"))
    q = torch.nn.Parameter(torch.randn(4))
    with pytest.raises(ValueError, match="mixes devices"):
        AdamW([p, q])
    if torch.cuda.device_count() > 1:
        r = torch.nn.Parameter(torch.randn(4, device="cuda:1"))
        with pytest.raises(ValueError, match="one optimizer per GPU"):
            AdamW([{"params": [p]}, {"params": [r]}])


def test_amsgrad_switched_on_later() -> None:
    a, b, ours, ref = twins()
    for i, x in enumerate(batches(10)):
        if i == 5:
            ours.param_groups[0]["amsgrad"] = True
        ours.zero_grad()
        loss_of(a, x).backward()
        ours.step()
    st = ours.state[a.layers[0].weight]
    assert torch.all(st["max_exp_avg_sq"] >= st["exp_avg_sq"])


@pytest.mark.parametrize("free", [False, True])
def test_gradients_reach_the_host_during_backward(free: bool) -> None:
    """Every bucket is copied by the backward hooks, before step(): a parameter that never gets
    a gradient (the unused layer) does not hold its bucket back after the first step."""
    a, _, ours, _ = twins(free_gradients=free)
    st = ours._engine.streamed
    for i, x in enumerate(batches(3)):
        ours.zero_grad()
        loss_of(a, x).backward()
        used = [r for r in st.recs if r.param is not a.unused.weight and r.param is not a.unused.bias]
        if i > 0:
            assert all(r.has_grad and r.pending is None for r in used)
        ours.step()
