"""The native matmul in the product: ``F.linear`` of the blocks run on the CPU goes to the kernel
(``hostmatmul.NativeMatmul``, entered by ``placement.HostCalls``) where it applies, to torch's
otherwise; ``offload_weights(native_matmul=False)`` is torch's path, bitwise the resident model.

Against torch's path the kernel sums in another order (both in float32, one rounding), so the
logits of a step may differ by the bound (1e-2 of the largest, the issue's), and a greedy token
may differ only where torch's top two logits are within twice that bound of each other: a near
tie, which the two orders may break differently (they did on an AVX-512 FP16 Xeon). Past such a
step the row's inputs differ and nothing is compared (``agree_where_decided``). The Llama's weights
are drawn wide (std 0.2) so that exact ties between the top two logits, as at the default 0.02,
are rare and most of the 24 steps are compared."""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import offload_adam
from offload_adam import testing
from offload_adam.weights import hostmatmul as hm

from test_hostmatmul import bound, reference
from test_weights import nvme_dir  # noqa: F401 (a fixture)

transformers = pytest.importorskip("transformers")

LINEARS = 7 * 2 + 1  # q k v o gate up down in each of 2 layers, and the head


def llama(dtype: torch.dtype = torch.bfloat16, seed: int = 6) -> torch.nn.Module:
    cfg = transformers.LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.2, bos_token_id=0, eos_token_id=0,
        pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg).to(dtype).eval()


def prompt(rows: int = 2, seq: int = 12, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, 512, (rows, seq), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def generate(model: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens of a 24-token greedy generate and the logits of each step (float32)."""
    out = model.generate(  # type: ignore[operator]
        x, attention_mask=torch.ones_like(x), max_new_tokens=24, min_new_tokens=24, do_sample=False, pad_token_id=0,
        output_logits=True, return_dict_in_generate=True,
    )  # fmt: skip
    return out.sequences, torch.stack(out.logits).float()


def agree_where_decided(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> int:
    """What the kernel's rounding allows a greedy generate, row by row and step by step while the
    row's tokens so far are the same: the step's logits within the bound of torch's (1e-2 of the
    largest), and the same token unless torch's top two logits are within twice the bound (a near
    tie: both logits may move by the bound). A row whose token differs at such a step is compared
    no further (its inputs differ from there). Returns how many (row, step) pairs were compared."""
    (seq, logits), (want_seq, want_logits) = got, want
    steps, rows = want_logits.shape[:2]
    start = want_seq.shape[1] - steps
    assert seq.shape == want_seq.shape and torch.equal(seq[:, :start], want_seq[:, :start])
    compared = 0
    for r in range(rows):
        for i in range(steps):
            g, w = logits[i, r], want_logits[i, r]
            eps = 1e-2 * float(w.abs().max())
            assert float((g - w).abs().max()) <= eps, f"row {r}, step {i}: logits beyond the bound"
            compared += 1
            top2 = w.topk(2).values
            tok, want_tok = int(seq[r, start + i]), int(want_seq[r, start + i])
            if float(top2[0] - top2[1]) > 2 * eps:
                assert tok == want_tok, f"row {r}, step {i}: a decided token differs"
            elif tok != want_tok:  # a near tie broken the other way: the row's later inputs differ
                assert float(w[want_tok] - w[tok]) <= 2 * eps
                break
    return compared


def no_mode_left() -> bool:
    return torch._C._len_torch_function_stack() == 0


# -- in the product --------------------------------------------------------------------------------


@pytest.mark.parametrize("storage", ["cpu", "nvme"])
def test_the_cpu_as_the_device_decodes_on_the_kernel_as_torch_does(storage: str, nvme_dir: str) -> None:
    """device="cpu": a prompt of 2 x 12 rows (above MAX_ROWS) runs on torch's kernels, bitwise
    torch's path; the decode steps (2 rows) on ours, the same 24 tokens and logits within 1e-2.
    With native_matmul=False every call is torch's, bitwise the resident model. storage="nvme":
    the blocks' parameters point to a new RAM page at each call, read where they are."""
    x = prompt()
    ref = llama()
    with torch.no_grad():
        want_prompt = ref(x).logits
    want = generate(ref, x)
    kw: dict[str, Any] = {"storage": storage, "prefetch": 1} | ({"nvme_dir": nvme_dir} if storage == "nvme" else {})
    results = {}
    for native in (False, True):
        model = llama()
        h = offload_adam.offload_weights(model, device="cpu", native_matmul=native, **kw)
        assert h.native_matmul is native
        with torch.no_grad():
            logits = model(x).logits
        r = h.report()
        assert r["native_calls"] == 0 and r["torch_calls"] == (LINEARS if native else 0)
        assert torch.equal(logits, want_prompt)  # rows > MAX_ROWS: torch's, whichever the setting
        h.reset_stats()
        results[native] = generate(model, x)
        r = h.report()
        if native:  # every call of the 23 decode steps ours; the prompt's (24 rows) torch's, but for rows kept for logits
            assert r["native_calls"] >= 23 * LINEARS and r["torch_calls"] <= LINEARS
        else:
            assert r["native_calls"] == r["torch_calls"] == 0
        assert no_mode_left()
        h.close()
    assert torch.equal(results[False][0], want[0]) and torch.equal(results[False][1], want[1])
    assert agree_where_decided(results[True], results[False]) >= 2


def test_placement_cpu_on_a_device_decodes_on_the_kernel_as_torch_does() -> None:
    """placement="cpu" on the simulated device: every block runs on the CPU from its pinned copy,
    the hidden states crossing; decode on the kernel as above, native_matmul=False bitwise the
    resident model."""
    x = prompt(seed=2)
    want = generate(llama(), x)
    results = {}
    for native in (False, True):
        model = llama()
        with testing.simulated_device(seed=2, max_delay_s=0.001):
            h = offload_adam.offload_weights(model, placement="cpu", prefetch=1, native_matmul=native)
            results[native] = generate(model, x)
            r = h.report()
            assert r["calls"]["decode"]["cpu"] > 0 and r["calls"]["decode"]["stream"] == 0
            if native:
                assert r["native_calls"] >= 23 * LINEARS and r["torch_calls"] <= LINEARS  # the prompt's
            else:
                assert r["native_calls"] == r["torch_calls"] == 0
            h.close()
        assert no_mode_left()
    assert torch.equal(results[False][0], want[0]) and torch.equal(results[False][1], want[1])
    assert agree_where_decided(results[True], results[False]) >= 2


def test_a_quantized_block_run_on_the_cpu_of_a_device_reaches_the_kernel() -> None:
    """CUDA review, second pass, hazard 4: a quantized weight rebuilt on the device reports the
    device for good, while a block run on the CPU points its inner tensors at host bytes; judged
    by the wrapper's device the kernel never ran (torchao's torch path instead, 13-20x slower).
    On the simulated device (its own device type) the wrapper reports ``simgpu``, as on a GPU."""
    torchao_q = pytest.importorskip("torchao.quantization")
    model = llama(seed=8)
    torchao_q.quantize_(model, torchao_q.Int8WeightOnlyConfig())
    x = prompt(1, 1, seed=8)
    with testing.simulated_device(seed=8, max_delay_s=0.0) as sim:
        h = offload_adam.offload_weights(model, placement="cpu", prefetch=1)
        w = model.model.layers[0].mlp.down_proj.weight
        assert w.device == sim.torch_device  # the wrapper reports the device
        with torch.no_grad():
            model(x.to(sim.torch_device))
        assert h.report()["native_calls"] == LINEARS  # every linear of the CPU-run blocks: the head too
        h.close()
    assert sim.violations == []


def test_a_frozen_base_trained_on_the_cpu_leaves_no_mode_behind(nvme_dir: str) -> None:
    """CUDA review, second pass, 9: on device="cpu" a streamed block with frozen quantized weights
    enters FrozenLinearMode (global hooks) and then its CPU-run call NativeMatmul (module hooks),
    above it; FrozenLinearMode's __exit__ popped the top mode (NativeMatmul), whose leave() then
    pushed FrozenLinearMode back: one mode leaked per block call, F.linear slowing with each."""
    pytest.importorskip("torchao.quantization")
    from test_quantized import adapters, qlora

    model = qlora(4)
    h = offload_adam.offload_weights(
        model, device="cpu", storage="nvme", nvme_dir=nvme_dir, prefetch=1, native_matmul=True, resident=lambda n, p: p.requires_grad
    )  # fmt: skip
    x = torch.randint(1, 256, (2, 7), generator=torch.Generator().manual_seed(4))  # (test_weights' vocabulary)
    for _ in range(2):
        out = model(x[:, :-1]).logits.float()
        torch.nn.functional.cross_entropy(out.flatten(0, 1), x[:, 1:].flatten()).backward()
        assert no_mode_left()
    assert all(p.grad is not None for p in adapters(model))
    h.close()


def test_training_on_the_cpu_runs_torchs_kernels() -> None:
    """A forward that builds a graph (device="cpu", whose calls all run on the CPU), of one row
    (decode-sized): torch's kernels, the logits and gradients bitwise the resident model's; the same
    forward without a graph goes to the kernel."""
    model, ref = llama(seed=3), llama(seed=3)
    x = prompt(1, 1, seed=3)
    h = offload_adam.offload_weights(model, device="cpu", native_matmul=True)
    model.train()
    ref.train()
    loss, want = model(x, labels=x).logits.float().sum(), ref(x, labels=x).logits.float().sum()
    assert torch.equal(loss, want)
    loss.backward()
    want.backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert p.grad is not None and q.grad is not None and torch.equal(p.grad, q.grad)
    r = h.report()
    assert r["native_calls"] == 0 and r["torch_calls"] == LINEARS
    with torch.no_grad():
        model(x)
    assert h.report()["native_calls"] == LINEARS
    h.close()
    assert no_mode_left()


@pytest.mark.parametrize(
    "native, quantized, entered", [(None, False, False), (True, False, True), (None, True, True), (False, True, False)]
)
def test_the_mode_is_entered_only_around_blocks_whose_weights_the_kernel_may_read(
    native: bool | None, quantized: bool, entered: bool, monkeypatch: pytest.MonkeyPatch
) -> None:  # fmt: skip
    """Where torch's bfloat16 kernel is the faster (``bf16_faster`` False) a bf16 model's blocks run
    without NativeMatmul: under a mode every torch operation passes through Python (about 3 us
    each), for no F.linear the kernel would take. With native_matmul=True, or weights quantized
    (torchao's int8: the kernel's), the mode is active inside the blocks; native_matmul=False never
    enters it. The logits are torch's path's wherever no mode is entered."""
    monkeypatch.setitem(hm._BF16_FASTER, torch.get_num_threads(), False)
    x = prompt(1, 1, seed=5)
    model = llama(seed=5)
    if quantized:
        torchao_q = pytest.importorskip("torchao.quantization")
        torchao_q.quantize_(model, torchao_q.Int8WeightOnlyConfig())
    with torch.no_grad():
        want = model(x).logits
    h = offload_adam.offload_weights(model, device="cpu", native_matmul=native)
    seen: list[bool] = []

    def active(*_: Any) -> None:
        seen.append(any(isinstance(m, hm.NativeMatmul) for m in torch.overrides._get_current_function_mode_stack()))

    handles = [model.model.layers[i].mlp.down_proj.register_forward_pre_hook(active) for i in range(2)]
    handles.append(model.lm_head.register_forward_pre_hook(active))
    with torch.no_grad():
        got = model(x).logits
    assert seen == [entered] * 3
    r = h.report()
    assert r["native_calls"] == (LINEARS if entered else 0)
    if not entered:
        assert r["torch_calls"] == 0 and torch.equal(got, want)
    for hd in handles:
        hd.remove()
    assert no_mode_left()
    h.close()


def test_native_matmul_must_be_none_or_a_bool() -> None:
    model = llama()
    for bad in ("yes", 1):
        with pytest.raises(TypeError, match="native_matmul must be None, True or False, got"):
            offload_adam.offload_weights(model, device="cpu", native_matmul=bad)  # type: ignore[arg-type]
    assert not hasattr(model, "_offload_adam_weights")


def test_by_default_bf16_weights_go_to_the_kernel_where_it_beat_torch_here_and_quantized_ones_always() -> None:
    """native_matmul=None: bfloat16 weights on the kernel as this machine's measurement says
    (hm.bf16_faster, once per thread count), int8 weight-only ones always."""
    torchao_q = pytest.importorskip("torchao.quantization")
    x = prompt(1, 1, seed=4)
    for quantized in (False, True):
        model = llama(seed=4)
        if quantized:
            torchao_q.quantize_(model, torchao_q.Int8WeightOnlyConfig())
        h = offload_adam.offload_weights(model, device="cpu")
        assert h.native_matmul is None
        with torch.no_grad():
            model(x)
        r = h.report()
        assert r["native_bf16"] is hm.bf16_faster(torch.get_num_threads())
        if quantized:  # every Linear but the head (quantized too: torchao's quantize_ takes every Linear)
            assert r["native_calls"] == LINEARS
        else:
            assert r["native_calls"] == (LINEARS if r["native_bf16"] else 0)
        h.close()



@pytest.mark.parametrize("ours_ms,faster", [(0.95, False), (1.05, False), (0.85, True)])
def test_bf16_goes_to_the_kernel_only_where_it_beat_torch_by_the_margin(monkeypatch: pytest.MonkeyPatch, ours_ms: float, faster: bool) -> None:
    """bf16_faster decides by the kernel's time under BF16_MARGIN (0.9) of torch's, over weights
    read from DRAM (96 MiB cycled): a near tie (0.95 of torch's time) keeps torch's kernel, which
    the plain minimum chose by noise between processes. A fake clock: each call of the kernel
    advances it ``ours_ms``, each of torch's 1 ms; no timing is measured."""
    clock = [0.0]

    def tick(ms: float) -> Any:
        def call(*args: Any, **kwargs: Any) -> None:
            clock[0] += ms / 1e3

        return call

    calls = {"ours": 0}
    ours = tick(ours_ms)

    def kernel(*args: Any, **kwargs: Any) -> None:
        calls["ours"] += 1
        ours()

    monkeypatch.setattr(hm, "_BF16_FASTER", {})
    monkeypatch.setattr(hm._native, "linear", kernel)
    monkeypatch.setattr(hm, "_LINEAR", tick(1.0))
    monkeypatch.setattr(hm, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    assert hm.bf16_faster(2, d=1024, rounds=2) is faster
    assert calls["ours"] == 2 * (96 << 20) // (1024 * 1024 * 2)  # (every copy of the 96 MiB, each round)
    assert hm.bf16_faster(2) is faster and calls["ours"] == 2 * 48  # (measured once per thread count)

# -- the mode ---------------------------------------------------------------------------------------


def test_the_mode_takes_what_the_kernel_reads_and_gives_torch_the_rest() -> None:
    g = torch.Generator().manual_seed(7)
    w = (torch.randn(24, 64, generator=g) * 0.1).to(torch.bfloat16)
    b = torch.randn(24, generator=g).to(torch.bfloat16)
    x = torch.randn(3, 64, generator=g).to(torch.bfloat16)
    mode = hm.NativeMatmul()
    with torch.no_grad():
        for args, kwargs in [((x, w), {}), ((x, w, b), {}), ((x, w), {"bias": b}), ((x.view(3, 1, 64), w, b), {})]:
            with mode:
                got = F.linear(*args, **kwargs)
            y64, a = reference(args[0], w.double(), kwargs.get("bias", args[2] if len(args) > 2 else None))
            assert got.dtype == torch.bfloat16 and got.shape == (*args[0].shape[:-1], 24)
            assert bool(((got.double().reshape(-1, 24) - y64).abs() <= bound(64, a, y64, True)).all())
        assert (mode.native_calls, mode.torch_calls) == (4, 0)
        wt = w.T.contiguous().T  # the same values, not contiguous
        torch_cases = [
            (x, wt, None),  # a weight not in place
            (x.float(), w.float(), None),  # float32 weights: torch's
            (torch.randn(17, 64, dtype=torch.bfloat16), w, None),  # rows > MAX_ROWS
            (x, w, b[:1].expand(24)),  # a bias not in place
            (x.half(), w.half(), None),
        ]
        for xx, ww, bb in torch_cases:
            with mode:
                got = F.linear(xx, ww, bb)
            assert torch.equal(got, F.linear(xx, ww, bb))
        assert (mode.native_calls, mode.torch_calls) == (4, len(torch_cases))
        for xx, ww, bb in [(x.float(), w, None), (x, w, b.float())]:  # dtypes torch refuses: its error, as without the mode
            with mode, pytest.raises(RuntimeError, match="dtype"):
                F.linear(xx, ww, bb)
        with mode:
            mode.on = False
            F.linear(x, w)
            mode.on = True
            y = torch.add(x, 1)  # other functions: torch's, uncounted
        assert torch.equal(y, x + 1) and (mode.native_calls, mode.torch_calls) == (4, len(torch_cases) + 3)
    with mode:
        y = F.linear(x, w)  # grad mode, nothing requiring a gradient: ours
        out = F.linear(x, torch.nn.Parameter(w.clone()))  # a weight that wants one: torch's
    assert not y.requires_grad and out.requires_grad and (mode.native_calls, mode.torch_calls) == (5, len(torch_cases) + 4)
    assert no_mode_left()


def test_leave_takes_the_mode_off_the_stack_wherever_it_is() -> None:
    """HostCalls enters the mode at a block's start and leaves it at its end: a mode entered in
    between and still active keeps its place."""
    mode, other = hm.NativeMatmul(), torch.overrides.BaseTorchFunctionMode()
    mode.__enter__()
    other.__enter__()
    mode.leave()
    assert torch._C._len_torch_function_stack() == 1 and torch._C._get_function_stack_at(0) is other
    other.__exit__(None, None, None)
    assert no_mode_left()


# -- torchao's weights, on the host (no offload) ------------------------------------------------------


def _int8_llama() -> torch.nn.Module:
    quantization = pytest.importorskip("torchao.quantization")  # a test dependency (requirements-dev.txt)
    model = llama()
    quantization.quantize_(model, quantization.Int8WeightOnlyConfig())
    return model


def test_torchao_int8_weights_run_on_the_kernel_within_the_bound_of_torchaos_path() -> None:
    """Every Linear of an int8 weight-only Llama, on a decode step's inputs: under the mode on the
    kernel, within the bound of test_hostmatmul of torchao's own F.linear (its weights rounded to
    bfloat16 first). The whole model under the mode (a prompt of 8 rows: every call ours) is no
    farther from the model in float64 over the same dequantized weights than torchao's path;
    the two paths' logits differ by 1-4% of the largest (bfloat16 activations amplify the last
    bits), so their greedy tokens part at a near tie, and only the calls of a generate are
    checked: every decode step's on the kernel."""
    model = _int8_llama()
    x = prompt(seed=4)
    inputs: list[tuple[torch.nn.Linear, torch.Tensor]] = []
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    hooks = [m.register_forward_pre_hook(lambda m, a: inputs.append((m, a[0]))) for m in linears]
    with torch.no_grad():
        model(x[:, :1])  # one row per sequence: decode-sized
    for hk in hooks:
        hk.remove()
    assert len(inputs) == LINEARS
    mode = hm.NativeMatmul()
    with torch.no_grad():
        for lin, xin in inputs:
            theirs = F.linear(xin, lin.weight, lin.bias).double()
            with mode:
                ours = F.linear(xin, lin.weight, lin.bias).double()
            w: Any = lin.weight
            w64 = w.qdata.double() * w.scale.double().reshape(-1, 1)
            y64, a = reference(xin, w64, lin.bias)
            lim = bound(xin.shape[-1], a, y64, True)
            theirs_lim = lim + 2.0**-9 * a * (1 + 2.0**-8)
            assert bool(((ours.reshape(-1, w.shape[0]) - theirs.reshape(-1, w.shape[0])).abs() <= lim + theirs_lim).all())
    assert (mode.native_calls, mode.torch_calls) == (LINEARS, 0)
    exact = llama().double()
    for m, q in zip(exact.modules(), model.modules()):
        if isinstance(m, torch.nn.Linear):
            qw: Any = q.weight
            m.weight = torch.nn.Parameter(qw.qdata.double() * qw.scale.double(), requires_grad=False)
    short = prompt(1, 8, seed=4)
    mode = hm.NativeMatmul()
    with torch.no_grad():
        y64 = exact(short).logits
        theirs = model(short).logits.double()
        with mode:
            ours = model(short).logits.double()
    assert (mode.native_calls, mode.torch_calls) == (LINEARS, 0)
    err_ours, err_theirs = float((ours - y64).abs().max()), float((theirs - y64).abs().max())
    assert err_ours <= err_theirs <= 0.1 * float(y64.abs().max()), (err_ours, err_theirs)
    mode = hm.NativeMatmul()
    with mode:
        generate(model, x)
    assert mode.native_calls >= 23 * LINEARS and mode.torch_calls <= LINEARS  # the prompt: 24 rows


def test_a_torchao_weight_is_read_where_it_is_at_each_call() -> None:
    """What the mode keeps of a subclass weight is its kind; its parts are read at each call (a
    streamed weight's move between calls): new inner tensors are used, and parts not in place
    send the call to torch."""
    model: Any = _int8_llama()
    w = model.model.layers[0].mlp.down_proj.weight
    x = torch.randn(2, w.shape[1], dtype=torch.bfloat16, generator=torch.Generator().manual_seed(8))
    mode = hm.NativeMatmul()
    with torch.no_grad():
        with mode:
            first = F.linear(x, w)
        w.qdata = torch.flip(w.qdata, [0]).contiguous()
        w.scale = torch.flip(w.scale, [0]).contiguous()
        with mode:
            flipped = F.linear(x, w)
        assert torch.equal(flipped, torch.flip(first, [-1]))
        w.qdata = w.qdata.T.contiguous().T
        with mode:
            F.linear(x, w)
    assert (mode.native_calls, mode.torch_calls) == (2, 1)


def test_a_model_with_torchaos_weights_decodes_through_the_mode_in_one_pass() -> None:
    """A whole forward under the mode: rows above MAX_ROWS and grad-mode calls go to torchao,
    bitwise its eager path."""
    model = _int8_llama()
    x = prompt(seed=5)  # 24 rows
    with torch.no_grad():
        want = model(x).logits
    mode = hm.NativeMatmul()
    with torch.no_grad(), mode:
        got = model(x).logits
    assert torch.equal(got, want) and (mode.native_calls, mode.torch_calls) == (0, LINEARS)
    one = x[:1, :1]
    want = model(one).logits
    with mode:
        got = model(one).logits  # grad mode: the embedding's output wants a gradient
    assert got.requires_grad and torch.equal(got, want) and (mode.native_calls, mode.torch_calls) == (0, 2 * LINEARS)


@pytest.mark.parametrize("storage", ["cpu", "nvme"])
def test_torchao_int4_cpu_weights_decode_on_the_kernel_from_ram_and_the_ssd(storage: str, nvme_dir: str) -> None:
    """Issue 35, point 3: a Llama quantized by torchao's CPU int4 config (two codes per byte,
    groups of 32), offloaded with device="cpu" and stored as its packed bytes in RAM or on the
    SSD: every decode call on the kernel, and a 24-token greedy generate as torchao's own path on
    the model kept resident does, within the bound where decided (``agree_where_decided``)."""
    pytest.importorskip("torchao.quantization")
    from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig
    from torchao.quantization import quantize_

    if hm.int4_layout() is None:
        pytest.skip("torch's CPU capability packs int4 in a layout the kernel does not read")
    ref = llama()
    quantize_(ref, PrototypeInt4WeightOnlyConfig(group_size=32))
    x = prompt()
    want = generate(ref, x)
    model = llama()
    quantize_(model, PrototypeInt4WeightOnlyConfig(group_size=32))
    kw: dict[str, Any] = {"storage": storage, "prefetch": 1} | ({"nvme_dir": nvme_dir} if storage == "nvme" else {})
    h = offload_adam.offload_weights(model, device="cpu", **kw)
    got = generate(model, x)
    r = h.report()
    assert r["native_calls"] >= 23 * LINEARS and r["torch_calls"] <= LINEARS
    assert agree_where_decided(got, want) >= 24
    h.close()
    assert no_mode_left()
