"""The model whole after any failed offload (issue 36, point 3): ``offload_weights`` either
completes or leaves every parameter exactly as it was, bitwise (the same objects under the same
names, their type, dtype, device, ``requires_grad`` and bytes; ties; buffers; the modules'
attributes), with the error; no failure loses a weight, and nothing is left in ``nvme_dir``.
The failures: a write error storing a block (RELIABILITY.md defect 2), a failure after every
block is stored, a ``quantize=`` that raises or makes a dtype that cannot be offloaded
(defect 3), and the bad ``quantize=`` and ``resident=`` values of its table, refused before
anything changes."""

from __future__ import annotations

import contextlib
import copy
import errno
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import offload_adam
from offload_adam import testing
from offload_adam.runtime import pages

from helpers import to_device, to_host

from test_weights import gpt2, llama, nvme_dir, prompt  # noqa: F401 (nvme_dir: a fixture)

NATIVE_OFF: dict[str, Any] = {"native_matmul": False}  # (bitwise against the model resident: see test_quantized)


def _tensors(p: torch.Tensor) -> list[torch.Tensor] | None:
    """``p``'s bytes (a quantized parameter's inner tensors), cloned; None on the meta device."""
    if p.device.type == "meta":
        return None
    if type(p) is torch.nn.Parameter:
        return [p.detach().clone()]
    names, _ = p.__tensor_flatten__()  # type: ignore[attr-defined]
    return [getattr(p, n).clone() for n in names]


def state(model: torch.nn.Module) -> dict[str, Any]:
    """What a failed offload must leave as it was."""
    return {
        "params": {
            n: (p, type(p), p.dtype, p.device, p.requires_grad, tuple(p.shape), _tensors(p))
            for n, p in model.named_parameters(remove_duplicate=False)
        },
        "buffers": {n: (b, b.clone()) for n, b in model.named_buffers(remove_duplicate=False)},
        "modules": {n: (m, sorted(vars(m))) for n, m in model.named_modules(remove_duplicate=False)},
        "repr": repr(model),
    }


def assert_as_before(model: torch.nn.Module, before: dict[str, Any]) -> None:
    now = state(model)
    assert now["params"].keys() == before["params"].keys()
    for n, (p, *meta, data) in before["params"].items():
        q, *meta_now, data_now = now["params"][n]
        assert q is p, f"{n}: another parameter object"  # (so ties hold: the same object under every name)
        assert meta_now == meta, (n, meta_now, meta)
        assert (data is None) == (data_now is None), n
        if data is not None:
            assert all(torch.equal(a, b) for a, b in zip(data_now, data, strict=True)), n
    assert now["buffers"].keys() == before["buffers"].keys()
    for n, (b, value) in before["buffers"].items():
        assert now["buffers"][n][0] is b and torch.equal(b, value), n
    assert {n: (m, a) for n, (m, a) in now["modules"].items()} == before["modules"]
    assert now["repr"] == before["repr"]
    assert not hasattr(model, "_offload_adam_weights")


@contextlib.contextmanager
def writes_failing(after: int = 2) -> Iterator[None]:
    """Every run directory made inside fails its write number ``after + 1`` with ENOSPC (a
    filesystem that over-commits, or a quota): RELIABILITY.md defect 2's repro."""
    orig = pages.RunDir.__init__

    def init(self: pages.RunDir, *args: Any, **kwargs: Any) -> None:
        orig(self, *args, **kwargs)
        self.io.inject_fault("write", errno.ENOSPC, after)

    pages.RunDir.__init__ = init  # type: ignore[method-assign]
    try:
        yield
    finally:
        pages.RunDir.__init__ = orig  # type: ignore[method-assign]


@torch.no_grad()
def logits(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The logits, on the host; the ids on the simulated device inside one (as a user moves them)."""
    return to_host(model(to_device(x)).logits)


# -- storing --------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["device-cpu", "simulated"])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_a_write_error_storing_a_block_leaves_every_weight_as_it_was(arch: str, where: str, nvme_dir: str) -> None:
    """Defect 2: the third block's page fails to write (ENOSPC). The blocks stored before it used
    to point at placeholders while the file was deleted: the embedding and layer 0 read NaN.
    Now: the error, every parameter as it was (GPT-2's tied head still tied), nothing left in
    nvme_dir, and the next offload works and is exact."""
    model = {"llama": llama, "gpt2": gpt2}[arch](torch.bfloat16, 3, layers=4)
    ref = copy.deepcopy(model)
    before = state(model)
    x = prompt(3)
    want = logits(ref, x)
    device: Any = testing.simulated_device(seed=3, max_delay_s=0.001) if where == "simulated" else contextlib.nullcontext()
    kw: dict[str, Any] = {"device": "cpu", **NATIVE_OFF} if where == "device-cpu" else {}
    with device:
        with writes_failing(), pytest.raises(OSError, match=r"No space left on device") as err:
            offload_adam.offload_weights(model, storage="nvme", nvme_dir=nvme_dir, prefetch=1, **kw)
        assert err.value.errno == errno.ENOSPC and "writing the page of block 2" in str(err.value)
        assert_as_before(model, before)
        if arch == "gpt2":
            assert model.lm_head.weight is model.transformer.wte.weight
        assert os.listdir(nvme_dir) == []
        h = offload_adam.offload_weights(model, storage="nvme", nvme_dir=nvme_dir, prefetch=1, **kw)
        assert torch.equal(logits(model, x), want)
        h.close()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), n


def test_a_write_error_filling_an_empty_model_from_a_checkpoint_leaves_it_empty(tmp_path: Any, nvme_dir: str) -> None:
    """A model built with init_empty_weights, filled from a checkpoint: the write error leaves its
    parameters the meta ones they were (the same objects, untied as it came: the offload's
    tie_weights() is undone too); the next offload loads it exactly."""
    accelerate = pytest.importorskip("accelerate")
    from safetensors.torch import save_model

    model = gpt2(torch.float32, 4, layers=3)
    ckpt = tmp_path / "model.safetensors"
    save_model(model, str(ckpt))
    with accelerate.init_empty_weights():
        empty = type(model)(model.config).eval()  # (untied: init_empty_weights re-creates each parameter)
    assert empty.lm_head.weight is not empty.transformer.wte.weight
    before = state(empty)
    x = prompt(4)
    want = logits(model, x)
    with writes_failing(), pytest.raises(OSError, match=r"writing the page of block 2 .*No space left on device"):
        offload_adam.offload_weights(empty, device="cpu", storage="nvme", nvme_dir=nvme_dir, checkpoint=ckpt, **NATIVE_OFF)
    assert_as_before(empty, before)
    assert all(p.device.type == "meta" for p in empty.parameters())
    assert empty.lm_head.weight is not empty.transformer.wte.weight
    assert os.listdir(nvme_dir) == []
    h = offload_adam.offload_weights(empty, device="cpu", storage="nvme", nvme_dir=nvme_dir, checkpoint=ckpt, **NATIVE_OFF)
    assert torch.equal(logits(empty, x), want)
    h.close()


@pytest.mark.parametrize("storage, kind", [("cpu", "fp32"), ("nvme", "fp32"), ("cpu", "int8")])
def test_a_failure_after_every_block_is_stored_puts_back_every_weight(storage: str, kind: str, nvme_dir: str, monkeypatch: Any) -> None:
    """The device out of memory for the streaming ring, after every block is stored: blocks
    resident on the device, blocks in the pinned host copy (whose own tensors were freed as
    they were copied: they come back from it), blocks on NVMe, the buffers moved to the device,
    all as they were, quantized ones (torchao's int8: their inner tensors) too; the next
    offload is exact."""
    from offload_adam.weights import streamer

    model = llama(torch.float32 if kind == "fp32" else torch.bfloat16, 5, layers=4)
    if kind == "int8":
        torchao_q = pytest.importorskip("torchao.quantization")
        torchao_q.quantize_(model, torchao_q.Int8WeightOnlyConfig())
    ref = copy.deepcopy(model)
    before = state(model)
    x = prompt(5)
    want = logits(ref, x)
    total = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    kw: dict[str, Any] = {"storage": storage, "gpu_budget_gb": 0.5 * total / 2**30, "prefetch": 1}
    if storage == "nvme":
        kw["nvme_dir"] = nvme_dir

    class OutOfMemory(streamer.Ring):  # type: ignore[misc,name-defined]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate the streaming ring")

    with testing.simulated_device(seed=5, max_delay_s=0.001):
        with monkeypatch.context() as mp:
            mp.setattr(streamer, "Ring", OutOfMemory)
            with pytest.raises(torch.OutOfMemoryError, match="the streaming ring"):
                offload_adam.offload_weights(model, **kw, **NATIVE_OFF)
        assert_as_before(model, before)
        assert os.listdir(nvme_dir) == []
        h = offload_adam.offload_weights(model, **kw, **NATIVE_OFF)
        assert 0 < len(h.resident) < len(h.blocks)  # (both kinds of blocks were there)
        assert torch.equal(logits(model, x), want)
        h.close()


# -- quantize= ------------------------------------------------------------------------------------


def _quantize_all_but(stop: torch.nn.Module) -> Any:
    torchao_q = pytest.importorskip("torchao.quantization")

    def quantize(m: torch.nn.Module) -> None:
        if m is stop:
            raise RuntimeError("no kernel for this layer")
        torchao_q.quantize_(m, torchao_q.Int8WeightOnlyConfig())

    return quantize


def _empty(model: torch.nn.Module, tmp_path: Any) -> tuple[torch.nn.Module, Any]:
    """``model`` saved to a checkpoint, and the same architecture built empty (tied)."""
    accelerate = pytest.importorskip("accelerate")
    from safetensors.torch import save_model

    ckpt = tmp_path / "model.safetensors"
    save_model(model, str(ckpt))
    with accelerate.init_empty_weights():
        empty = type(model)(model.config).to(torch.bfloat16).eval()
    empty.tie_weights()
    return empty, ckpt


@pytest.mark.parametrize("source", ["model", "checkpoint"])
def test_a_quantize_that_raises_at_block_4_leaves_every_weight_as_it_was(source: str, tmp_path: Any, nvme_dir: str) -> None:
    """Defect 3: the function raises at the fourth block (layer 2); the first three used to stay
    int8 (14 tensors). Now the error names the block, and every parameter is the one it was, in
    full precision (or on the meta device, loading from a checkpoint): bitwise, of its type,
    the modules' attributes too (torchao's extra_repr)."""
    model = llama(torch.bfloat16, 6, layers=4)
    target, ckpt = (model, None) if source == "model" else _empty(model, tmp_path)
    before = state(target)
    quantize = _quantize_all_but(target.model.layers[2])
    with pytest.raises(RuntimeError, match="no kernel for this layer") as err:
        offload_adam.offload_weights(
            target, device="cpu", storage="nvme", nvme_dir=nvme_dir, checkpoint=ckpt, quantize=quantize, **NATIVE_OFF
        )  # fmt: skip
    assert any("quantize=" in n and "model.layers.2" in n for n in getattr(err.value, "__notes__", []))
    assert_as_before(target, before)
    assert os.listdir(nvme_dir) == []
    if source == "model":  # the next offload is exact
        ref = copy.deepcopy(model)
        x = prompt(6)
        h = offload_adam.offload_weights(model, device="cpu", **NATIVE_OFF)
        assert torch.equal(logits(model, x), logits(ref, x))
        h.close()


@pytest.mark.parametrize("source", ["model", "checkpoint"])
def test_a_quantize_that_makes_float64_is_an_error_naming_it_and_changes_nothing(source: str, tmp_path: Any) -> None:
    """Defect 3: a function that turns parameters into float64 used to leave the model converted
    (the error came from the blocks found after it). Now the error names quantize= and the
    parameter, and the model is as it was."""
    model = llama(torch.bfloat16, 7, layers=2)
    target, ckpt = (model, None) if source == "model" else _empty(model, tmp_path)
    before = state(target)
    with pytest.raises(TypeError, match=r"quantize: model\.embed_tokens\.weight is torch\.float64 after it"):
        offload_adam.offload_weights(target, device="cpu", checkpoint=ckpt, quantize=lambda m: m.to(torch.float64))
    assert_as_before(target, before)


# -- the table's rows: refused before anything changes -------------------------------------------


def _int8_class() -> Any:
    return pytest.importorskip("torchao.quantization").Int8WeightOnlyConfig


ROWS: dict[str, tuple[Any, str]] = {
    "quantize-str": (lambda: {"quantize": "int8"}, r"quantize: 'int8' \(of type str\) is neither a torchao config .* nor a function of a module"),
    "quantize-object": (lambda: {"quantize": object()}, r"quantize: <object object at .*> \(of type object\) is neither a torchao config"),
    "quantize-class": (lambda: {"quantize": _int8_class()}, r"quantize: Int8WeightOnlyConfig is a class: pass an instance, Int8WeightOnlyConfig\(\)"),
    "resident-str": (lambda: {"resident": lambda n, p: "no"}, r"resident must return a bool, got 'no' \(of type str\) for model\.embed_tokens\.weight"),
    "resident-tensor": (lambda: {"resident": lambda n, p: torch.tensor([True, False])}, r"resident must return a bool, got a Tensor for model\.embed_tokens\.weight"),
}  # fmt: skip


@pytest.mark.parametrize("row", list(ROWS))
def test_bad_quantize_and_resident_are_clear_errors_before_anything_changes(row: str) -> None:
    """RELIABILITY.md's table: ``quantize="int8"`` and ``quantize=object()`` were torchao's
    AssertionError about generic callables, the config's class was called with each module
    (another AssertionError), ``resident=`` answering ``"no"`` kept every parameter (a truthy
    string) and one answering a tensor was torch's "Boolean value of Tensor" error."""
    pytest.importorskip("torchao.quantization")
    kw, match = ROWS[row]
    model = llama(torch.bfloat16, 8, layers=2)
    before = state(model)
    with pytest.raises(TypeError, match=match):
        offload_adam.offload_weights(model, device="cpu", **kw())
    assert_as_before(model, before)


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["bf16", "int8"])
def test_cuda_a_failure_after_every_block_is_stored_puts_back_every_weight(kind: str, monkeypatch: Any) -> None:
    """On a GPU: quantized (wrapped) parameters change their device as they are attached (their
    contents swapped), streamed ones from the pinned copy and resident ones alike; the ring's
    allocation failing after every block is stored puts every one back on the host as it was,
    and the next offload hands back the same bytes at close()."""
    from offload_adam.weights import streamer

    model = llama(torch.bfloat16, 9, layers=4)
    if kind == "int8":
        torchao_q = pytest.importorskip("torchao.quantization")
        torchao_q.quantize_(model, torchao_q.Int8WeightOnlyConfig())
    before = state(model)
    total = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    kw: dict[str, Any] = {"device": "cuda", "gpu_budget_gb": 0.5 * total / 2**30, "prefetch": 1}

    class OutOfMemory(streamer.Ring):  # type: ignore[misc,name-defined]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate the streaming ring")

    with monkeypatch.context() as mp:
        mp.setattr(streamer, "Ring", OutOfMemory)
        with pytest.raises(torch.OutOfMemoryError, match="the streaming ring"):
            offload_adam.offload_weights(model, **kw)
    assert_as_before(model, before)
    h = offload_adam.offload_weights(model, **kw)
    assert 0 < len(h.resident) < len(h.blocks)
    with torch.no_grad():
        model(prompt(9).cuda())
    h.close()
    for n, (_, _, dtype, _, _, _, data) in before["params"].items():
        p = dict(model.named_parameters(remove_duplicate=False))[n]
        assert p.device.type == "cpu" and p.dtype == dtype
        assert all(torch.equal(a, b) for a, b in zip(_tensors(p) or [], data, strict=True)), n


def test_close_right_after_an_async_step_keeps_that_steps_resident_weights() -> None:
    """CUDA review, second pass, hazard 8: the parameters resident= keeps on the device have no
    Home, so close() did not wait for an asynchronous step still on its worker: its copy-back went
    to the device tensor close() had just replaced (freed, possibly reallocated) and the weights
    handed back missed that step. The worker is held 0.3 s before its buckets; close() waits for
    it, and the weights handed back are those of the same steps with the model resident."""
    import time

    def train(model: torch.nn.Module, offload: bool) -> torch.nn.Module:
        for n, p in model.named_parameters():
            p.requires_grad_(".q_proj." in n)
        x = prompt(11)
        with testing.simulated_device(seed=11, max_delay_s=0.0) as sim:
            h = offload_adam.offload_weights(model, resident=lambda n, p: p.requires_grad) if offload else None
            if h is None:
                model.to(sim.torch_device)
            held = testing.engine_hooks(before_bucket=lambda i: time.sleep(0.3) if i == 0 else None)
            with held:
                opt = offload_adam.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, async_step=True)
            for _ in range(2):
                model(to_device(x), labels=to_device(x)).loss.backward()
                opt.step()
                opt.zero_grad()
            if h is not None:
                h.close()  # right after the step: its worker still holds the first bucket
                assert all(p.device.type == "cpu" for p in model.parameters())
            opt.synchronize()
            model.cpu()
        assert sim.violations == []
        return model

    want = train(llama(torch.float32, 11, layers=2), offload=False)
    got = train(llama(torch.float32, 11, layers=2), offload=True)
    for (n, p), q in zip(got.named_parameters(), want.parameters()):
        assert torch.equal(p, q), n
