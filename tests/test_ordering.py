"""The offload's ordering hazards (the CUDA review of the offload), each shown on the simulated
asynchronous device: copies run late, waits of the current stream are lazy, freed memory is
poisoned, released host buffers are recorded. Every test here fails when the one wait or event
that guards its hazard is removed from the engine (see ARCHITECTURE.md)."""

from __future__ import annotations

import copy
import gc
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from helpers import max_diff, to_device
from test_streaming import Net, assert_same_weights, batches, loss_of, twins

from offload_adam import AdamW, testing
from offload_adam.testing.simdevice import SimulatedDevice

SEEDS = [0, 1, 2]


@pytest.fixture(autouse=True)
def sim(request: pytest.FixtureRequest) -> Iterator[SimulatedDevice]:
    callspec = getattr(request.node, "callspec", None)
    seed = callspec.params.get("seed", 0) if callspec is not None else 0
    delay = callspec.params.get("delay", 0.003) if callspec is not None else 0.003
    with testing.simulated_device(seed=seed, max_delay_s=delay) as dev:
        yield dev
    assert dev.violations == []


def train(a: torch.nn.Module, b: torch.nn.Module, ours: AdamW, ref: torch.optim.Optimizer, n: int, *, set_to_none: bool) -> None:
    """The most common loop: zero_grad right after step (here: right after an async step)."""
    for x in batches(n):
        for m, o in ((a, ours), (b, ref)):
            loss_of(m, x).backward()
            o.step()
            o.zero_grad(set_to_none=set_to_none)
    ours.synchronize()


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("delay", [0.003, 0.03])
@pytest.mark.parametrize("set_to_none", [False, True])
def test_zero_grad_right_after_an_async_step_does_not_race_the_gradient_copies(set_to_none: bool, delay: float, seed: int) -> None:
    """Finding 1: the step returns with gradient copies in flight. `zero_grad(set_to_none=False)`
    must wait for them (else zeros reach the kernel); with `set_to_none=True` the freed gradient
    must stay allocated until its copy ran (else the block is reused: NaN here). The long delay
    keeps copies in flight when the step returns."""
    a, b, ours, ref = twins(async_step=True)
    train(a, b, ours, ref, 12 if delay < 0.01 else 4, set_to_none=set_to_none)
    assert_same_weights(a, b)


@pytest.mark.parametrize("seed", SEEDS)
def test_a_checkpoint_load_right_after_a_step_does_not_tear_the_weights(seed: int) -> None:
    """Finding 2: `load_state_dict` rewrites the masters, which the copy-backs of the step just
    taken may still be reading: it waits for them first, so the model keeps that step's weights
    (a rollback in the same process)."""
    a, b, ours, ref = twins()
    rollback = None
    for x in batches(4):
        for m, o in ((a, ours), (b, ref)):
            o.zero_grad()
            loss_of(m, x).backward()
            o.step()
        if rollback is None:
            rollback = copy.deepcopy(ours.state_dict())
    ours.load_state_dict(rollback)
    ours.synchronize()
    assert_same_weights(a, b)


class Parent(torch.nn.Module):
    """Reads its child's weight before calling the child."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(8, 8)
        self.child = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + x @ self.child.weight.t()  # the child's weight, read by the parent first
        h = self.first(h)
        return self.child(torch.tanh(h)).sum(-1)


@pytest.mark.parametrize("seed", SEEDS)
def test_a_parent_reading_a_childs_weight_waits_for_it(seed: int) -> None:
    """Finding 3: a module's forward waits for what its own code reads, learnt on a first
    forward: here a child's weight, read before the child is called."""
    torch.manual_seed(0)
    with testing.engine_hooks(before_bucket=lambda k: time.sleep(0.01)):
        m = to_device(Parent())
        opt = AdamW(m.parameters(), lr=1e-2, async_step=True, bucket_mb=1e-7)  # a bucket per parameter
    x = to_device(torch.randn(4, 8))
    for _ in range(6):
        opt.zero_grad()
        m(x).sum().backward()
        opt.step()
        out = m(x)  # runs while the worker is still updating later buckets
        opt.synchronize()
        assert torch.equal(out, m(x)), "the forward read a weight before its update"


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("by_backward", [False, True])
def test_bf16_landing_slots_are_not_overwritten_before_their_copy_back(
    seed: int, by_backward: bool, sim: SimulatedDevice
) -> None:
    """Finding 3, second part: a bf16 parameter's landing slot is both the target of its
    gradient's copy and the source of its weights' copy back. New gradients right after an async
    step, before any forward waited for the weights (set by hand, or by a backward through the
    raw parameters outside any module), are copied into the slots: those copies must wait for the
    copy-back, or the weights receive gradient bytes."""
    torch.manual_seed(0)
    sim.h2d.max_delay_s = 0.01  # copy-backs lag behind the gradient copies
    ps = [torch.nn.Parameter(to_device(torch.randn(64).bfloat16())) for _ in range(6)]
    qs = [torch.nn.Parameter(p.detach().float().cpu()) for p in ps]
    with testing.engine_hooks(before_bucket=lambda k: time.sleep(0.002)):  # a step still running
        ours = AdamW(ps, lr=1e-2, async_step=True, bucket_mb=0.0001)
    ref = torch.optim.AdamW(qs, lr=1e-2, foreach=False)
    for t in range(25):
        gs = [(torch.randn(64) * 1000).bfloat16() for _ in ps]  # far from the weights: a mix-up shows
        if by_backward:  # gradients that do not depend on the (possibly stale) weights
            torch.autograd.backward([p for p in ps], to_device(gs))
        else:
            for p, g in zip(ps, gs):
                p.grad = to_device(g)
        for q, g in zip(qs, gs):
            q.grad = g.float()
        ours.synchronize()
        for p in ps:  # the weights the last step sent, not gradient bytes
            if p in ours.state:
                assert torch.equal(p.detach().cpu(), ours.state[p]["master_param"].bfloat16())
        ours.step()
        ours.zero_grad()
        ref.step()
    ours.synchronize()
    for p, q in zip(ps, qs):
        assert max_diff(ours.state[p]["master_param"], q) <= 2e-5
        assert torch.equal(p.detach().cpu(), ours.state[p]["master_param"].bfloat16())


def test_a_gradient_set_to_none_before_the_step_skips_the_parameter() -> None:
    """Finding 7: `p.grad = None` between backward and step: torch skips p (its step count and
    state do not advance); so do we, although its gradient was already copied."""
    a, b, ours, ref = twins()
    for x in batches(6):
        for m, o in ((a, ours), (b, ref)):
            o.zero_grad()
            loss_of(m, x).backward()
            m.layers[1].weight.grad = None
            o.step()
    assert_same_weights(a, b)
    assert a.layers[1].weight not in ours.state and b.layers[1].weight not in ref.state


def test_host_buffers_outlive_the_copies_queued_on_them(sim: SimulatedDevice) -> None:
    """Finding 8: an optimizer collected right after an async step releases its host buffers
    only once the copies queued on them have run (a GPU: cudaHostUnregister under a DMA). The
    control without the wait slows the streams (up to 50 ms an operation), so that copies are
    still queued when the optimizer goes: at the fixture's 3 ms a loaded machine's host could
    reach the release after the last copy had run (seen once in a full run beside another)."""
    for release_waits in (True, False):
        sim.release_waits = release_waits
        sim.max_delay_s = 0.003 if release_waits else 0.05
        with testing.engine_hooks(before_bucket=lambda k: time.sleep(0.001)):
            a, _, ours, _ = twins(async_step=True)
        loss_of(a, batches(1)[0]).backward()
        ours.step()
        del ours
        gc.collect()
        sim.drain()
        if release_waits:
            assert sim.violations == []
        else:  # the simulator sees the hazard when the release does not wait
            assert any("released host buffer" in v for v in sim.violations)
            sim.violations.clear()
    sim.release_waits = True
    sim.max_delay_s = 0.003


class Branchy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        h = self.a(x)
        return (self.b(h) if use_b else h).sum()


def test_a_failed_step_gives_back_only_gradients_no_zero_grad_has_dropped() -> None:
    """Finding 12: the worker's error path must not race `zero_grad()`: a failed step's
    gradients are given back (in the main thread) only if no zero_grad came since."""
    fail = [True]

    def before_bucket(k: int) -> None:
        if fail[0]:
            raise RuntimeError("boom")

    torch.manual_seed(0)
    m = Branchy()
    m2 = copy.deepcopy(m)
    m = to_device(m)
    with testing.engine_hooks(before_bucket=before_bucket):
        ours = AdamW(m.parameters(), lr=1e-2, async_step=True, bucket_mb=0.0001)
    ref = torch.optim.AdamW(m2.parameters(), lr=1e-2, foreach=False)
    x = torch.randn(4, 8)
    m(to_device(x), True).backward()  # b gets a gradient in this step only
    ours.step()  # fails in the worker
    ours.zero_grad()
    m(to_device(x), False).backward()
    with pytest.raises(RuntimeError, match="boom"):
        ours.synchronize()
    fail[0] = False
    ours.step()
    ours.synchronize()
    m2(x, False).backward()
    ref.step()
    assert_same_weights(m, m2)
    assert m.b.weight not in ours.state


def test_a_worker_that_cannot_start_leaves_no_forward_hanging() -> None:
    """Finding 12: a failed `Thread.start()` raises at `step()`, leaves every bucket usable (a
    forward does not wait forever) and keeps the gradients for the next step."""

    def refuse(t: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    with testing.engine_hooks(start_worker=refuse):
        a, b, ours, ref = twins(async_step=True)
    x = batches(1)[0]
    loss_of(a, x).backward()
    with pytest.raises(RuntimeError, match="can't start new thread"):
        ours.step()
    done = threading.Event()
    xd = to_device(x)  # (here: the simulated device is this thread's context)
    threading.Thread(target=lambda: (a(xd), done.set()), daemon=True).start()
    assert done.wait(30), "a forward after a failed step start hangs"
    ours._engine.hooks = testing.EngineHooks()  # the next start succeeds
    ours.step()
    ours.synchronize()
    loss_of(b, x).backward()
    ref.step()
    assert_same_weights(a, b)


def run_with_scaler(**kw: Any) -> None:
    a, b, ours, ref = twins(**kw)
    sa = torch.amp.GradScaler(next(a.parameters()).device.type, init_scale=2.0**12, growth_interval=3)
    sb = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=3)
    for t, x in enumerate(batches(12)):
        for m, o, s in ((a, ours, sa), (b, ref, sb)):
            s.scale(loss_of(m, x)).backward()
            if t in (0, 5):  # overflows: the step is skipped and the scale drops
                m.layers[1].bias.grad[0] = float("inf")
            s.step(o)
            s.update()
            o.zero_grad()
    ours.synchronize()
    assert sa.get_scale() == sb.get_scale()
    assert_same_weights(a, b)
    assert float(ours.state[a.layers[0].weight]["step"]) == 10


@pytest.mark.parametrize("seed", SEEDS)
def test_grad_scaler_values_are_read_in_the_step_not_by_a_sync(seed: int) -> None:
    """Finding 10: GradScaler's found_inf and scale are device tensors: the async step reads
    them in its worker after a copy ordered behind the backward, and a skipped first step
    leaves no state behind."""
    run_with_scaler(async_step=True)
    run_with_scaler()
