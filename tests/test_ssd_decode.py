"""Decode from the SSD with the CPU as the device (issue 35, point 4): an embedding on the SSD is
looked up by its rows (only the 4 KiB units they span are read, ``weights/rows.py``); the RAM
ring is ``prefetch + 1`` pages of a layer, a block larger than a layer gets a page of its own,
and the rest of ``host_budget_gb`` keeps blocks resident (``plan.host_ring_plan``). Every
answer is the resident model's, bitwise."""

from __future__ import annotations

import copy

import pytest
import torch

import offload_adam
from offload_adam.runtime.pages import ALIGN
from offload_adam.runtime.pinned import align_up
from offload_adam.weights.plan import BlockPlan, HostRingPlan, host_ring_plan, make_plan

from test_weights import llama, nvme_dir, prompt, run  # noqa: F401 (nvme_dir: a fixture)

MiB = 1 << 20


@torch.no_grad()
def test_a_decode_token_reads_the_pages_of_its_embedding_row_only(nvme_dir: str) -> None:
    """Every block on the SSD (no host budget): a decode step reads each other block's page once
    and, of the embedding, only the 4 KiB unit its token's row lies in (the table was read
    whole at every token before: 64 KiB here, 125 MiB for a 32000 x 2048 bf16 one)."""
    model = llama(torch.float32, 3, layers=4)
    ref = copy.deepcopy(model)
    x = prompt(3)
    want = run(ref, x)
    h = offload_adam.offload_weights(model, device="cpu", storage="nvme", nvme_dir=nvme_dir, prefetch=1, native_matmul=False)
    assert run(model, x)[0].equal(want[0]) and run(model, x)[1].equal(want[1])
    p = h.plan
    embed = next(b for b in p.blocks if b.name == "model.embed_tokens")
    assert embed.by_rows and embed.home == "nvme" and p.host_ring.rows == {embed.index}
    general = sum(align_up(p.blocks[i].nbytes, ALIGN) for i in p.on_nvme if i != embed.index)
    # decode steps of one sequence: the reads of a step's read-ahead cross into the next
    ids = x[:1]
    out = model(ids, use_cache=True)
    past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
    for _ in range(2):
        out = model(tok, use_cache=True, past_key_values=past)
        past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
    steps = 3
    h.reset_stats()
    for _ in range(steps):
        out = model(tok, use_cache=True, past_key_values=past)
        past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
    r = h.report()
    assert r["read_bytes"] == steps * (general + ALIGN), (r["read_bytes"], general)
    h.close()


class _Table(torch.nn.Module):
    """An embedding whose rows of 3000 bytes straddle the 4 KiB units, with a padding row, then
    layers and a head."""

    def __init__(self, vocab: int = 200, d: int = 750, layers: int = 3) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, d, padding_idx=3)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(layers))
        self.head = torch.nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx)
        for layer in self.layers:
            x = x + torch.tanh(layer(x))
        return self.head(x)


@pytest.mark.parametrize("prefetch", [0, 2])
@torch.no_grad()
def test_rows_that_straddle_units_repeat_or_pad_are_the_resident_lookup(prefetch: int, nvme_dir: str) -> None:
    torch.manual_seed(prefetch)
    model = _Table().eval()
    ref = copy.deepcopy(model)
    table = ref.tok.weight.detach().clone()
    h = offload_adam.offload_weights(model, device="cpu", storage="nvme", nvme_dir=nvme_dir, prefetch=prefetch, native_matmul=False)
    assert h.plan.host_ring.rows == {0}
    g = torch.Generator().manual_seed(prefetch)
    for ids in (torch.tensor([[3, 3, 199, 0, 5, 5]]), torch.randint(0, 200, (2, 9), generator=g), torch.tensor([[7]])):
        assert torch.equal(model(ids), ref(ids))
    assert model.tok.padding_idx == 3  # set aside for the call only
    rows_of = h.rows.tables[0]
    before = h.report()["read_bytes"]
    rows = torch.tensor([0, 1, 2, 57, 58, 199])
    assert torch.equal(rows_of.read(rows), table[rows])
    spans = {u for r in rows.tolist() for u in range(r * 3000 // ALIGN, ((r + 1) * 3000 - 1) // ALIGN + 1)}
    assert h.report()["read_bytes"] - before == len(spans) * ALIGN  # the units the rows span, no more
    h.close()
    assert torch.equal(model.tok.weight, table)


def _blocks(embed: int) -> list[BlockPlan]:
    """An embedding of ``embed`` MiB looked up by rows, 4 layers of 10 MiB and a head of 20 MiB."""
    out = [BlockPlan(0, "embed", embed * MiB, lookup=True, by_rows=True)]
    out += [BlockPlan(1 + i, f"layers.{i}", 10 * MiB, layer=True) for i in range(4)]
    out.append(BlockPlan(5, "head", 20 * MiB))
    return out


def test_the_ram_ring_is_prefetch_plus_one_layers_and_the_budget_keeps_blocks() -> None:
    """The CPU as the device, every block on the SSD: prefetch + 1 pages of a layer, a page of its
    own for the head (larger than a layer), none for the embedding. Under a budget the head
    costs nothing more kept in RAM than in its page, so it stays; the layers come next, and the
    embedding (read by rows: 4 KiB a token) last. Before, every page was the largest block's
    and the embedding came first: 2 pages of 20 MiB, and a budget of 45 MiB kept nothing."""
    blocks = _blocks(16)
    ring = host_ring_plan(blocks, [b.index for b in blocks], 1, on_device=False)
    assert ring == HostRingPlan(2, 10 * MiB, ((5, 20 * MiB),), frozenset({0}))
    assert ring.nbytes == 40 * MiB
    p = make_plan(_blocks(16), device="cpu", storage="nvme", placement="stream", prefetch=1, host_budget=45 * MiB, on_device=False)
    assert [b.home for b in p.blocks] == ["nvme", "nvme", "nvme", "nvme", "nvme", "ram"]
    assert p.host_ring == HostRingPlan(2, 10 * MiB, (), frozenset({0}))
    assert p.tier_bytes()["ram"] == 40 * MiB <= 45 * MiB
    assert "RAM ring: 2 pages of 10.00 MiB; 1 looked up by rows (no page)" in str(p)
    # more budget: layers, then the embedding
    p = make_plan(_blocks(16), device="cpu", storage="nvme", placement="stream", prefetch=1, host_budget=50 * MiB, on_device=False)
    assert [b.home for b in p.blocks] == ["nvme", "ram", "nvme", "nvme", "nvme", "ram"]
    p = make_plan(_blocks(16), device="cpu", storage="nvme", placement="stream", prefetch=1, host_budget=76 * MiB, on_device=False)
    assert [b.home for b in p.blocks] == ["ram"] * 6 and p.host_ring == HostRingPlan()
    # an edited plan: the head on the SSD keeps a page of its own
    p = make_plan(_blocks(4), device="cpu", storage="nvme", placement="stream", prefetch=2, host_budget=80 * MiB, on_device=False)
    for b in p.blocks:
        b.home = "nvme"
    assert p.host_ring == HostRingPlan(3, 10 * MiB, ((5, 20 * MiB),), frozenset({0}))
    assert "RAM ring: 3 pages of 10.00 MiB and 1 of their own (20.00 MiB)" in str(p)
    p.check()


@torch.no_grad()
def test_a_head_larger_than_a_layer_runs_from_its_own_page_read_once(nvme_dir: str) -> None:
    """A plan whose head stays on the SSD: its page of its own is read at its first run and kept
    (nothing else uses it), the layers pass through prefetch + 1 pages; the answers are the
    resident model's."""
    torch.manual_seed(5)
    model = _Table(vocab=900, d=256).eval()  # head 900 KiB, layers 257 KiB
    ref = copy.deepcopy(model)
    plan = offload_adam.plan_weights(model, device="cpu", storage="nvme", nvme_dir=nvme_dir, prefetch=1, native_matmul=False)
    for b in plan.blocks:
        b.home = "nvme"
    h = offload_adam.offload_weights(model, plan=plan)
    hr = h.plan.host_ring
    head = len(h.blocks) - 1
    assert hr.slots == 2 and dict(hr.own) == {head: align_up(h.blocks[head].nbytes, ALIGN)}
    ids = torch.randint(0, 900, (1, 5))
    assert torch.equal(model(ids), ref(ids))
    h.reset_stats()
    for _ in range(3):
        assert torch.equal(model(ids), ref(ids))
    layers = sum(align_up(h.blocks[i].nbytes, ALIGN) for i in range(1, head))
    units = {r * 1024 // ALIGN for r in ids.flatten().tolist()}  # rows of 1 KiB
    r = h.report()
    assert r["read_bytes"] == 3 * (layers + len(units) * ALIGN), (r["read_bytes"], layers)  # the head: not again
    assert r["host_ring_bytes"] == hr.nbytes
    h.close()


@pytest.mark.parametrize("prefetch", [1, 2, 3])
@torch.no_grad()
def test_every_page_is_read_ahead_none_on_demand(prefetch: int, nvme_dir: str) -> None:
    """The read-ahead keeps ``prefetch`` pages in flight: after the first forward no page is read
    when its block is asked for. The cursor once moved past the blocks run on the CPU without
    reading them (the read-ahead started after them): at prefetch 2 every third block was read
    on demand, its read not overlapped with the blocks before it."""
    model = llama(torch.float32, prefetch, layers=6)
    ref = copy.deepcopy(model)
    x = prompt(prefetch)
    h = offload_adam.offload_weights(model, device="cpu", storage="nvme", nvme_dir=nvme_dir, prefetch=prefetch, native_matmul=False)
    ring = h.sources.nvme.ring
    assert torch.equal(model(x).logits, ref(x).logits)
    ring.misses = 0
    for _ in range(3):
        assert torch.equal(model(x).logits, ref(x).logits)
    assert ring.misses == 0
    h.close()
