"""Weights offloaded for inference (offload_adam.offload_weights), on the CPU through the
simulated device: copies run after random seeded delays, the compute stream's waits are lazy,
a weight read outside its block's forward reads NaN (its placeholder), uninitialized device
memory is NaN. Small HF models built from configs with random weights (GPT-2 with tied
embeddings, Llama with grouped-query attention), exact against the same model resident."""

from __future__ import annotations

import copy
import errno
import gc
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import offload_adam
from offload_adam import testing
from offload_adam.testing.simbackend import mem
from offload_adam.testing.simdevice import SimulatedDevice

from helpers import to_device, to_host

transformers = pytest.importorskip("transformers")
transformers.utils.logging.set_verbosity_error()

VOCAB = 256


def gpt2(dtype: torch.dtype, seed: int = 0, layers: int = 6) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(
        n_layer=layers, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=64, bos_token_id=0, eos_token_id=0, pad_token_id=0
    )
    return transformers.GPT2LMHeadModel(cfg).to(dtype).eval()


def llama(dtype: torch.dtype, seed: int = 0, layers: int = 6) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        num_hidden_layers=layers, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, max_position_embeddings=128, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg).to(dtype).eval()


MODELS = {"gpt2": gpt2, "llama": llama}


def prompt(seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (2, 7), generator=g)


@torch.no_grad()
def run(model: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits of one forward, and the tokens of a 24-token greedy generate."""
    x = to_device(x)
    logits = model(x).logits
    tokens = model.generate(
        x, attention_mask=torch.ones_like(x), max_new_tokens=24, min_new_tokens=24, do_sample=False, pad_token_id=0
    )
    return to_host(logits), to_host(tokens)


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def budget(model: torch.nn.Module, what: str) -> float | None:
    total = weight_bytes(model) + sum(b.numel() * b.element_size() for b in model.buffers())
    return {"none": None, "half": 0.5 * total / 2**30, "most": 0.9 * total / 2**30}[what]


@pytest.fixture
def nvme_dir(tmp_path: Any) -> Iterator[str]:
    d = tmp_path / "nvme"
    d.mkdir()
    yield str(d)
    assert os.listdir(d) == []  # every run directory removed


# storage, budget, prefetch, seed: every value of each, over several seeds.
CASES = [
    ("cpu", "none", 0, 0),
    ("cpu", "half", 1, 1),
    ("cpu", "most", 3, 2),
    ("nvme", "none", 3, 1),
    ("nvme", "half", 0, 2),
    ("nvme", "most", 1, 0),
]


@pytest.mark.parametrize("storage, budget_of, prefetch, seed", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", list(MODELS))
def test_logits_and_generate_are_bitwise_the_resident_models(
    arch: str, dtype: torch.dtype, storage: str, budget_of: str, prefetch: int, seed: int, nvme_dir: str
) -> None:
    model = MODELS[arch](dtype, seed)
    ref = copy.deepcopy(model)
    x = prompt(seed)
    want = run(ref, x)
    nvme = {"nvme_dir": nvme_dir} if storage == "nvme" else {}
    with testing.simulated_device(seed=seed, max_delay_s=0.001) as sim:
        h = offload_adam.offload_weights(model, storage=storage, gpu_budget_gb=budget(model, budget_of), prefetch=prefetch, **nvme)
        rep = h.report()
        assert rep["streamed_blocks"] > (0 if budget_of == "most" else 2)
        got = run(model, x)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        # Bytes: each streamed weight crosses once per forward, each resident one never, an
        # embedding's only as the rows it looks up on the host (GPT-2's position embedding).
        h.reset_stats()
        with torch.no_grad():
            model(to_device(x))
        rep = h.report()
        looked_up = sum(h.blocks[i].nbytes for i in h.streamed if i in h.placer.host_only)
        assert rep["h2d_bytes"] == rep["streamed_bytes"] - looked_up and rep["on_demand_loads"] == 0
        assert rep["gpu_peak_bytes"] <= rep["gpu_resident_bytes"] + rep["ring_bytes"] + 64  # (+ the NaN placeholders)
        assert rep["gpu_peak_bytes"] == sim.allocated.peak  # measured by the device too
        if storage == "cpu":
            assert abs(rep["host_pinned_bytes"] - rep["streamed_bytes"]) <= 0.01 * rep["streamed_bytes"]
        else:  # the staging ring: prefetch + 2 slots of the largest streamed block's page
            page = max(-(-h.blocks[i].nbytes // 4096) * 4096 for i in h.streamed)
            assert (prefetch + 2) * page <= rep["host_pinned_bytes"] <= (prefetch + 2) * (page + 4096)  # (+ alignment)
            assert rep["nvme_bytes"] == sum(-(-h.blocks[i].nbytes // 4096) * 4096 for i in h.streamed)
        h.close()
        assert sim.violations == []
    with torch.no_grad():
        assert torch.equal(model(x).logits, want[0])  # back on the host, as it was


@pytest.mark.parametrize("arch", list(MODELS))
def test_every_weight_streamed_is_stored_once_and_pinned_exactly(arch: str) -> None:
    """GPT-2's head is its embedding (tied): stored once, streamed once per forward. The pinned
    copy is the weights' own bytes (within 1%), not a power-of-two rounding of each."""
    model = MODELS[arch](torch.bfloat16)
    with testing.simulated_device(seed=0, max_delay_s=0.0):
        h = offload_adam.offload_weights(model)
        rep = h.report()
        assert abs(rep["host_pinned_bytes"] - weight_bytes(model)) <= 0.01 * weight_bytes(model)
        if arch == "gpt2":
            assert model.lm_head.weight is model.transformer.wte.weight
            (tied,) = [b for b in h.blocks if b.shared]
            assert set(map(id, tied.modules)) == {id(model.lm_head), id(model.transformer.wte)}
        h.close()


# -- checkpoints --------------------------------------------------------------------------------


def _empty_like(model: torch.nn.Module) -> torch.nn.Module:
    """The same architecture built with accelerate's init_empty_weights: parameters on the meta
    device, buffers real."""
    accelerate = pytest.importorskip("accelerate")
    with accelerate.init_empty_weights():
        m = type(model)(model.config).to(next(model.parameters()).dtype)
    m.tie_weights()  # as from_pretrained does: init_empty_weights re-creates each registered parameter
    assert all(p.device.type == "meta" for p in m.parameters())
    return m.eval()


@pytest.mark.parametrize("storage", ["cpu", "nvme"])
@pytest.mark.parametrize("sharded", [False, True], ids=["file", "sharded-folder"])
@pytest.mark.parametrize("arch, dtype", [("gpt2", torch.float32), ("llama", torch.bfloat16)])
def test_a_checkpoint_loads_into_an_empty_model(arch: str, dtype: torch.dtype, sharded: bool, storage: str, tmp_path: Any, nvme_dir: str) -> None:
    """An HF folder with a sharded index (or one .safetensors file) loaded into a model built
    with init_empty_weights: the same tokens as the model resident; half of it resident."""
    model = MODELS[arch](dtype, 3)
    x = prompt(3)
    want = run(model, x)
    if sharded:
        model.save_pretrained(tmp_path / "ckpt", max_shard_size="100KB")
        ckpt: Any = tmp_path / "ckpt"
        assert (ckpt / "model.safetensors.index.json").exists()
    else:
        from safetensors.torch import save_model

        ckpt = tmp_path / "model.safetensors"
        save_model(model, str(ckpt))
    empty = _empty_like(model)
    nvme = {"nvme_dir": nvme_dir} if storage == "nvme" else {}
    with testing.simulated_device(seed=3, max_delay_s=0.001):
        h = offload_adam.offload_weights(empty, checkpoint=ckpt, storage=storage, gpu_budget_gb=budget(model, "half"), prefetch=1, **nvme)
        assert not any(p.device.type == "meta" for p in empty.parameters())
        got = run(empty, x)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        h.close()


def test_a_checkpoint_that_does_not_match_is_refused_before_anything_changes(tmp_path: Any) -> None:
    from safetensors.torch import save_file

    model = gpt2(torch.float32, layers=2)
    sd = {k: v.clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    for name, change, match in [
        ("transformer.h.1.mlp.c_fc.weight", None, "missing tensor\\(s\\) for parameter\\(s\\): 'transformer.h.1.mlp.c_fc.weight'"),
        ("transformer.h.0.ln_1.bias", lambda t: t[:-1], r"'transformer.h.0.ln_1.bias': the checkpoint has torch.float32 of shape \(63,\)"),
        ("transformer.wpe.weight", lambda t: t.half(), r"'transformer.wpe.weight': the checkpoint has torch.float16 of shape"),
    ]:
        bad = dict(sd)
        if change is None:
            del bad[name]
        else:
            bad[name] = change(bad[name]).contiguous()
        save_file(bad, str(tmp_path / "bad.safetensors"))
        empty = _empty_like(model)
        with testing.simulated_device(max_delay_s=0.0), pytest.raises(ValueError, match=match):
            offload_adam.offload_weights(empty, checkpoint=tmp_path / "bad.safetensors")
        assert all(p.device.type == "meta" for p in empty.parameters())  # nothing changed
        assert not hasattr(empty, "_offload_adam_weights")


# -- bad input ----------------------------------------------------------------------------------


def test_bad_input_is_a_clear_error_before_anything_changes(tmp_path: Any) -> None:
    model = gpt2(torch.float32, layers=2)
    before = {n: (p.data_ptr(), p.detach().clone()) for n, p in model.named_parameters()}
    ref_budget = 1e-6  # GiB: far below the ring
    cases: list[tuple[dict[str, Any], type, str]] = [
        ({"storage": "disk"}, ValueError, "storage must be one of"),
        ({"storage": "nvme"}, ValueError, "needs nvme_dir"),
        ({"storage": "nvme", "nvme_dir": str(tmp_path / "missing")}, ValueError, "nvme_dir: .* is not a directory"),
        ({"nvme_dir": str(tmp_path)}, ValueError, 'nvme_dir is only used with storage="nvme"'),
        ({"prefetch": -1}, ValueError, "prefetch must be an int >= 0"),
        ({"gpu_budget_gb": ref_budget}, ValueError, "gpu_budget_gb: .* smaller than the streaming ring"),
        ({"blocks": [model.transformer.h[0], model.transformer.h[0]]}, ValueError, r"blocks\[1\]: module 'transformer.h.0' is listed twice"),
        ({"blocks": [model.transformer.h[0]]}, ValueError, "these parameters are in no block: transformer.wte.weight"),
        ({"blocks": [model.transformer, model.transformer.h[0]]}, ValueError, "'transformer' and 'transformer.h.0' share parameters"),
        ({"blocks": [torch.nn.Linear(2, 2)]}, ValueError, "not a submodule of the model"),
        ({"checkpoint": tmp_path / "none.safetensors"}, ValueError, "is neither a file nor a directory"),
    ]
    with testing.simulated_device(max_delay_s=0.0):
        for kw, exc, match in cases:
            with pytest.raises(exc, match=match):
                offload_adam.offload_weights(model, **kw)
        assert not hasattr(model, "_offload_adam_weights") and os.listdir(tmp_path) == []
        for n, p in model.named_parameters():
            assert p.data_ptr() == before[n][0] and torch.equal(p, before[n][1]), n
        h = offload_adam.offload_weights(model)
        with pytest.raises(ValueError, match="offloaded already"):
            offload_adam.offload_weights(model)
        h.close()
    with pytest.raises(ValueError, match="is on the meta device: pass checkpoint="):
        offload_adam.offload_weights(_empty_like(model), device="cuda")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device here"):
            offload_adam.offload_weights(model, device="cuda")
        h = offload_adam.offload_weights(model)  # no GPU: the CPU runs it (see test_placement.py)
        assert h.report()["device"] == "cpu"
        h.close()


@pytest.mark.cuda
def test_a_model_already_on_the_gpu_is_refused() -> None:
    model = gpt2(torch.float32, layers=2).cuda()
    with pytest.raises(ValueError, match="transformer.wte.weight is on cuda:0; offload_weights takes a model on the CPU"):
        offload_adam.offload_weights(model)


# -- streaming ------------------------------------------------------------------------------------


class Stack(torch.nn.Module):
    """Layers run in an order the caller picks; the head reads the embedding's weight without
    calling the embedding (a read outside that block's module)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(50, 32)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(5))
        self.norm = torch.nn.LayerNorm(32)

    def forward(self, x: torch.Tensor, order: list[int] | None = None) -> torch.Tensor:
        h = self.emb(x)
        for i in order if order is not None else range(len(self.layers)):
            h = torch.tanh(self.layers[i](h))
        return self.norm(h) @ self.emb.weight.t()


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_forward_in_another_order_is_exact_and_recorded_again(seed: int, prefetch: int) -> None:
    torch.manual_seed(seed)
    model = Stack().eval()
    ref = copy.deepcopy(model)
    x = torch.randint(0, 50, (3, 4))
    orders = [None, None, [4, 3, 2, 1, 0], [4, 3, 2, 1, 0], [0, 2, 4], None, [1, 1, 3]]
    with testing.simulated_device(seed=seed, max_delay_s=0.001), torch.no_grad():
        h = offload_adam.offload_weights(model, prefetch=prefetch)
        for k, order in enumerate(orders):
            assert torch.equal(to_host(model(to_device(x), order)), ref(x, order)), k
            if k and order == orders[k - 1]:
                assert h.report()["on_demand_loads"] == 0, k  # the order recorded on the pass before
            h.reset_stats()
        h.close()


def test_a_weight_read_outside_its_blocks_forward_is_nan() -> None:
    """Outside its block's forward a streamed parameter is a placeholder without memory: NaN,
    never stale weights (the simulator's poisoning is the placeholder itself)."""
    model = gpt2(torch.float32, layers=2)
    with testing.simulated_device(max_delay_s=0.0) as sim:
        h = offload_adam.offload_weights(model)
        with torch.no_grad():
            model(to_device(prompt()))
        w = model.transformer.h[0].attn.c_attn.weight
        assert w.isnan().all() and w.untyped_storage().nbytes() <= 4 and w.device == sim.torch_device
        h.close()
        assert not model.transformer.h[0].attn.c_attn.weight.isnan().any()


def test_resident_blocks_are_the_small_ones_first_then_layers() -> None:
    model = llama(torch.float32)
    blocks = offload_adam.weights.blocks.find_blocks(model)
    layers = [b for b in blocks if b.layer]
    others = [b for b in blocks if not b.layer]
    with testing.simulated_device(max_delay_s=0.0):
        total = weight_bytes(model) + sum(b.numel() * b.element_size() for b in model.buffers())
        h = offload_adam.offload_weights(model, gpu_budget_gb=0.6 * total / 2**30)
        res = {h.blocks[i].name for i in h.resident}
        assert {b.name for b in others} <= res  # norm, embedding, head
        assert res - {b.name for b in others} == {b.name for b in layers[: len(res) - len(others)]}  # then layers in order
        assert h.report()["gpu_resident_bytes"] + h.report()["ring_bytes"] <= 0.6 * total
        h.close()


def test_user_blocks() -> None:
    """The user's own blocks: each holds every parameter under its module. A module that does
    not run itself (a ModuleList) or a parameter used elsewhere (the tied head, not listed) is
    loaded when the modules that read it run: exact all the same."""
    for make in (
        lambda t: [t.wte, t.wpe, t.h[0], t.h[1], t.pair, t.ln_f],
        lambda t: [t],
    ):
        model = gpt2(torch.float32, layers=4)
        ref = copy.deepcopy(model)
        t = model.transformer
        t.pair = torch.nn.ModuleList([t.h[2], t.h[3]])  # a module of the model
        blocks = make(t)
        x = prompt()
        want = run(ref, x)
        with testing.simulated_device(seed=4, max_delay_s=0.001):
            h = offload_adam.offload_weights(model, blocks=blocks)
            names = {id(m): n for n, m in model.named_modules()}
            assert [b.name for b in h.blocks] == [names[id(m)] for m in blocks]
            got = run(model, x)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
            h.close()


# -- NVMe faults ----------------------------------------------------------------------------------


def fault_and_recover(h: Any, model: torch.nn.Module, x: torch.Tensor, want: torch.Tensor, fault: str) -> None:
    """An EIO on a read, or a corrupted page of block 3: a clear OSError naming the file and the
    block; once the fault is cleared, the next forwards are exact (the NVMe tests of weights
    streamed and of weights run on the CPU)."""
    assert torch.equal(to_host(model(to_device(x)).logits), want)
    src = h.sources.nvme
    path = os.path.join(src.run.path, "weights.bin")
    victim = h.blocks[3]
    off = src.offset[victim.index]
    if fault == "eio":
        src.io.inject_fault("read", errno.EIO, 2)
        # (a layer's page, or with the CPU as the device the embedding's rows: rows.py)
        match = r"reading (the page|rows) of block \d+ \(model\.(layers\.\d|embed_tokens)\) from .*weights\.bin: .*Input/output error"
    else:
        with open(path, "r+b") as f:
            f.seek(off + 100)
            good = f.read(8)
            f.seek(off + 100)
            f.write(b"\x7f" * 8)
        match = rf"weights\.bin: the page of block {victim.index} \({victim.name}\) is corrupted \(checksum mismatch\)"
    with pytest.raises(OSError, match=match):
        for _ in range(3):
            model(to_device(x))
    if fault == "corrupt":
        with open(path, "r+b") as f:
            f.seek(off + 100)
            f.write(good)
    for _ in range(2):
        assert torch.equal(to_host(model(to_device(x)).logits), want)


@pytest.mark.parametrize("fault", ["eio", "corrupt"])
def test_an_nvme_fault_is_a_clear_error_and_the_next_forward_is_exact(fault: str, nvme_dir: str) -> None:
    model = llama(torch.float32)
    ref = copy.deepcopy(model)
    x = prompt()
    with torch.no_grad():
        want = ref(x).logits
    with testing.simulated_device(seed=5, max_delay_s=0.001), torch.no_grad():
        h = offload_adam.offload_weights(model, storage="nvme", nvme_dir=nvme_dir, prefetch=1)
        fault_and_recover(h, model, x, want, fault)
        h.close()


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("prefetch", [0, 1])
def test_nvme_staging_is_reused_only_after_its_copy(prefetch: int, seed: int, nvme_dir: str) -> None:
    """Copies slower than the compute (long delays): the staging slot a block is read into is
    taken back only once the copy that read it has run."""
    model = gpt2(torch.bfloat16, seed)
    ref = copy.deepcopy(model)
    x = prompt(seed)
    with torch.no_grad():
        want = ref(x).logits
    with testing.simulated_device(seed=seed, max_delay_s=0.02), torch.no_grad():
        h = offload_adam.offload_weights(model, storage="nvme", nvme_dir=nvme_dir, prefetch=prefetch)
        for _ in range(3):
            assert torch.equal(to_host(model(to_device(x)).logits), want)
        h.close()


def test_nvme_files_go_with_close_and_with_the_garbage(nvme_dir: str) -> None:
    model = gpt2(torch.float32, layers=2)
    with testing.simulated_device(max_delay_s=0.0):
        h = offload_adam.offload_weights(model, storage="nvme", nvme_dir=nvme_dir)
        assert len(os.listdir(nvme_dir)) == 1
        h.close()
        assert os.listdir(nvme_dir) == []
        model2 = gpt2(torch.float32, layers=2)
        offload_adam.offload_weights(model2, storage="nvme", nvme_dir=nvme_dir)
        assert len(os.listdir(nvme_dir)) == 1
        del model2
        gc.collect()
        assert os.listdir(nvme_dir) == []


def test_close_waits_for_a_forward_on_a_user_stream_before_freeing_the_ring() -> None:
    """CUDA review (December) finding 10: a forward run under the user's own stream may still
    read the ring when close() frees it; the caching allocator hands the slots to the next
    allocations of the stream that made them, so close() synchronizes the device first. The
    simulator flags a reuse the freed memory's last reader was not ordered before."""
    model = gpt2(torch.float32, 0, layers=3)
    x = prompt(0)
    with testing.simulated_device(seed=0, max_delay_s=0.001) as sim:
        h = offload_adam.offload_weights(model, prefetch=0)  # (no copy queued after the pass waits its reads)
        sizes = [s.buf.numel() for s in h.streamer.ring.slots]
        user = sim.stream()
        with sim.use_stream(user), torch.no_grad():
            model(to_device(x))
        h.close()
        taken = [sim.empty(n, torch.uint8) for n in sizes]  # the next allocations get the ring's memory
        assert sim.counters()["reuses"] >= len(sizes)
        del taken
    assert sim.violations == []


class _Casts(torch.utils._python_dispatch.TorchDispatchMode):
    """Weak references to every cast (``_to_copy``) of a tensor lying in ``storages``."""

    def __init__(self, storages: set[int]) -> None:
        super().__init__()
        self.storages = storages
        self.casts: list[Any] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        import weakref

        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and mem(args[0]).untyped_storage().data_ptr() in self.storages:
            self.casts.append(weakref.ref(out))
        return out

    def alive(self) -> int:
        gc.collect()
        return sum(c() is not None for c in self.casts)


@pytest.mark.parametrize("arch", list(MODELS))
def test_autocast_keeps_no_copy_of_a_streamed_weight(arch: str) -> None:
    """CUDA review (December) finding 2: autocast's cast cache keeps a bf16 copy of every fp32
    weight it casts (the parameter stays the same object while its data is a slot view) until
    the outermost autocast exits, which undoes the ring's bound (and, the parameter's memory
    swapped under it, hands a later block the cast of an earlier one). Under the simulated
    device's autocast, which keeps CUDA's cache: no cast of a streamed weight outlives its block's
    forward, and the logits are bitwise the model's resident on the device under autocast."""
    import torch.utils._python_dispatch  # noqa: F401

    model = MODELS[arch](torch.float32, 7)
    ref = copy.deepcopy(model)
    x = prompt(7)
    with testing.simulated_device(seed=7, max_delay_s=0.0) as sim:
        ref.to(sim.torch_device)
        with torch.autocast(sim.torch_device.type, torch.bfloat16), torch.no_grad():
            want = to_host(ref(to_device(x)).logits)
    with testing.simulated_device(seed=7, max_delay_s=0.001) as sim:
        h = offload_adam.offload_weights(model, prefetch=1)
        watch = _Casts({s.buf.untyped_storage().data_ptr() for s in h.streamer.ring.slots})
        with torch.autocast(sim.torch_device.type, torch.bfloat16), torch.no_grad():
            with watch:
                got = to_host(model(to_device(x)).logits)
            assert watch.casts and watch.alive() == 0  # (inside the autocast region: its cache would hold them)
        assert torch.equal(got, want)
        h.close()


# -- faults a new user meets (CUDA review, December, point 3) ------------------------------------------


def test_close_after_a_corrupted_page_frees_everything_and_names_what_is_lost(nvme_dir: str) -> None:
    """close() always frees the ring, the pinned staging, the files and the run directory; the
    block whose page cannot be read back leaves its parameters on the meta device and one error
    names them, after the cleanup; a second close() does nothing. The other weights come back
    bitwise."""
    model = llama(torch.float32)
    ref = copy.deepcopy(model)
    x = prompt()
    with testing.simulated_device(seed=5, max_delay_s=0.001) as sim, torch.no_grad():
        h = offload_adam.offload_weights(model, storage="nvme", nvme_dir=nvme_dir, prefetch=1)
        model(to_device(x))
        victim = h.blocks[3]
        path = os.path.join(h.sources.nvme.run.path, "weights.bin")
        with open(path, "r+b") as f:
            f.seek(h.sources.nvme.offset[victim.index] + 100)
            f.write(b"\x7f" * 8)
        lost = [e.names[0] for e in victim.entries]
        with pytest.raises(OSError, match=r"could not be read back .*corrupted.* left on the meta device: " + lost[0]):
            h.close()
        assert os.listdir(nvme_dir) == []  # the run directory went
        gc.collect()
        assert h.meter.current == 0  # the ring, the placeholders, the resident blocks
        h.close()  # a no-op
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            if n in lost:
                assert p.device.type == "meta", n
            else:
                assert p.device.type == "cpu" and torch.equal(p, q), n
        assert not hasattr(model, "_offload_adam_weights")
    assert sim.violations == []


def test_a_checkpoint_saved_from_a_tied_model_loads_into_an_untied_empty_one(tmp_path: Any) -> None:
    """With transformers 5, init_empty_weights() leaves GPT-2's head untied and save_pretrained
    omits it; offload_weights ties the weights first (as accelerate's load_checkpoint_and_dispatch)."""
    accelerate = pytest.importorskip("accelerate")
    model = gpt2(torch.float32, 4)
    x = prompt(4)
    want = run(model, x)
    model.save_pretrained(tmp_path / "ckpt")
    with accelerate.init_empty_weights():
        empty = type(model)(model.config).eval()  # no tie_weights() here
    with testing.simulated_device(seed=4, max_delay_s=0.001):
        h = offload_adam.offload_weights(empty, checkpoint=tmp_path / "ckpt", prefetch=1)
        assert empty.lm_head.weight is empty.transformer.wte.weight
        got = run(empty, x)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        h.close()


def test_every_problem_of_a_checkpoint_in_one_error(tmp_path: Any) -> None:
    """As torch's strict load_state_dict: missing and unexpected tensors, shape and dtype
    mismatches, all in one error; a dtype mismatch says how to fix it."""
    from safetensors.torch import save_file

    model = gpt2(torch.float32, layers=2)
    sd = {k: v.clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    del sd["transformer.h.1.mlp.c_fc.weight"]
    sd["transformer.h.0.ln_1.bias"] = sd["transformer.h.0.ln_1.bias"][:-1].contiguous()
    sd["transformer.wpe.weight"] = sd["transformer.wpe.weight"].half()
    sd["extra.weight"] = torch.zeros(3)
    save_file(sd, str(tmp_path / "bad.safetensors"))
    empty = _empty_like(model)
    with testing.simulated_device(max_delay_s=0.0), pytest.raises(ValueError) as err:
        offload_adam.offload_weights(empty, checkpoint=tmp_path / "bad.safetensors")
    msg = str(err.value)
    for part in [
        "missing tensor(s) for parameter(s): 'transformer.h.1.mlp.c_fc.weight'",
        "unexpected tensor(s), in no parameter or buffer of the model: 'extra.weight'",
        "size mismatch for 'transformer.h.0.ln_1.bias': the checkpoint has torch.float32 of shape (63,)",
        "dtype mismatch for 'transformer.wpe.weight': the checkpoint has torch.float16",
        "build the empty model in that dtype",
    ]:
        assert part in msg, msg
    assert all(p.device.type == "meta" for p in empty.parameters())  # nothing changed


_RSS = """
import gc, torch
import offload_adam
from offload_adam import testing

def status(key):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(key + ":"))

torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(16)])  # 16 blocks of 16 MiB
weights = sum(p.numel() * p.element_size() for p in model.parameters())
gc.collect()
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets the peak (VmHWM) to the current RSS: the model's construction is not counted
base = status("VmRSS")
with testing.simulated_device(max_delay_s=0.0, lazy=False):
    h = offload_adam.offload_weights(model)
    peak = status("VmHWM")
    print(weights, peak - base, h.report()["host_pinned_bytes"])
    h.close()
"""


def test_offloading_a_model_built_on_the_host_never_holds_it_twice() -> None:
    """Finding 13: the pinned copy used to be zeroed and pinned whole before the fill freed the
    model's tensors, so the host peaked at twice the streamed bytes, half of it unswappable. It
    is now touched only as each block is filled (the block's tensors then freed) and pinned
    after: the peak grows by at most two blocks and 64 MiB (measured in a fresh process)."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", _RSS], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    weights, grew, pinned = map(int, r.stdout.split())
    block = weights // 16
    assert pinned >= weights and grew <= 2 * block + (64 << 20), (grew / 2**20, weights / 2**20)


def test_the_recorded_cycle_is_a_pure_order() -> None:
    """weights/cycle.py, without a device: a training cycle's instances (a tied embedding/head
    with a slot of its own is one instance across the cycle; a layer's consecutive activations
    are one), a cycle that diverges is recorded when it ends, a fault keeps the old order."""
    from offload_adam.weights.cycle import Cycle, plan

    fwd_bwd = [0, 1, 2, 3, 3, 2, 1, 0]  # 0: tied embedding and head (own slot); 3: the last layer, twice in a row
    inst, of_pos = plan(fwd_bwd, {0})
    assert inst == [(0, 0, 7), (1, 1, 1), (2, 2, 2), (3, 3, 4), (2, 5, 5), (1, 6, 6)]
    assert of_pos == [0, 1, 2, 3, 3, 4, 5, 0]
    cy = Cycle(fwd_bwd, {0})
    for b in fwd_bwd:
        pos, planned, diverged = cy.advance(b)
        assert planned and not diverged
    assert cy.instance(3) == (3, 4) and cy.end() == (False, False)
    assert cy.at(6 + 1) == (1, 1, 9, 9)  # instance 1 of the second cycle: block 1 at absolute position 9
    # an eval pass: only the forward, another order
    for k, b in enumerate([0, 1, 2, 3]):
        _, planned, diverged = cy.advance(b)
        assert planned and not diverged
    assert cy.end() == (True, True) and cy.order == [0, 1, 2, 3]
    cy.advance(0)
    _, planned, diverged = cy.advance(2)  # diverges here
    assert not planned and diverged
    cy.faulted = True
    assert cy.end() == (True, False) and cy.order == [0, 1, 2, 3]  # a fault: the old order stays


def test_training_on_the_simulated_device_saves_slot_weights_as_tokens() -> None:
    """Three training passes of a streamed model on the simulated device: each weight a backward
    reads from a ring slot (the transposed view linear saves, not the parameter) is saved as a
    token and loaded again for it, so no copy into a slot precedes its last read unordered, and
    the gradients are those of the model resident there. (The simulated device's tensors are its
    plain memory: taken for wrapped tensors, their views were saved as they were and read after
    their slot was refilled.)"""

    def grads(offload: bool) -> dict[str, torch.Tensor]:
        model = llama(torch.float32, 11, layers=2)
        x = prompt(11)
        with testing.simulated_device(seed=11, max_delay_s=0.0) as sim:
            h = offload_adam.offload_weights(model) if offload else model.to(sim.torch_device)
            for _ in range(3):
                for p in model.parameters():
                    p.grad = None
                model(to_device(x), labels=to_device(x)).loss.backward()
            out = {n: to_host(p.grad) for n, p in model.named_parameters()}
            if offload:
                h.close()
        assert sim.violations == []
        return out

    got, want = grads(True), grads(False)
    for n in want:
        assert torch.equal(got[n], want[n]), n
