"""Checkpoints validated as safetensors validates them (RELIABILITY.md, defect 1 and the
checkpoint rows of section 10): every file's header is checked by safetensors' own rules before
anything is read or changed, and a malformed file, index or ``checkpoint=`` argument is one
clear error naming the file and the tensor, the model left as it was."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import struct
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import offload_adam
from offload_adam.runtime.safetensors import DTYPES, Reader

transformers = pytest.importorskip("transformers")
transformers.utils.logging.set_verbosity_error()
safetensors = pytest.importorskip("safetensors")
from safetensors import SafetensorError, safe_open  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

DOWN1 = "model.layers.1.mlp.down_proj.weight"
DOWN0 = "model.layers.0.mlp.down_proj.weight"
MAX_HEADER = 100_000_000  # bytes: safetensors' limit on a header


def llama(seed: int) -> torch.nn.Module:
    """RELIABILITY.md's model: a small LlamaForCausalLM (hidden 64, 4 layers, bf16)."""
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128, max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()


def read_st(path: Any) -> tuple[Any, bytes]:
    """A safetensors file's header (parsed) and data section."""
    blob = open(path, "rb").read()
    (n,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8 : 8 + n]), blob[8 + n :]


def write_st(path: Any, header: Any, data: bytes = b"", *, raw: bytes | None = None, n: int | None = None) -> str:
    text = json.dumps(header).encode() if raw is None else raw
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text) if n is None else n) + text + data)
    return str(path)


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The checkpoint of ``llama(0)``, as safetensors writes it."""
    path = tmp_path_factory.mktemp("good") / "model.safetensors"
    save_file(llama(0).state_dict(), str(path))
    return str(path)


Snapshot = dict[str, tuple[torch.nn.Parameter, torch.device, int, torch.Tensor]]


def snapshot(model: torch.nn.Module) -> Snapshot:
    return {n: (p, p.device, p.data_ptr(), p.detach().clone()) for n, p in model.named_parameters()}


def assert_unchanged(model: torch.nn.Module, before: Snapshot) -> None:
    """Every parameter the same object, where it was, bitwise as before; no offload attached."""
    now = dict(model.named_parameters())
    assert now.keys() == before.keys()
    for n, (p, device, ptr, value) in before.items():
        q = now[n]
        assert q is p and q.device == device and q.data_ptr() == ptr, n
        if device.type != "meta":
            assert torch.equal(q.detach().reshape(-1).view(torch.uint8), value.reshape(-1).view(torch.uint8)), n
    assert not hasattr(model, "_offload_adam_weights")


def refused(model: torch.nn.Module, checkpoint: Any, exc: type[Exception], match: str) -> None:
    """``offload_weights(model, checkpoint=...)`` raises ``exc`` matching ``match`` and changes nothing."""
    before = snapshot(model)
    with pytest.raises(exc, match=match):
        offload_adam.offload_weights(model, device="cpu", checkpoint=checkpoint)
    assert_unchanged(model, before)


# -- RELIABILITY.md defect 1: offsets that loaded silently wrong weights ---------------------------


def _alias(h: dict[str, Any]) -> None:
    h[DOWN1]["data_offsets"] = list(h[DOWN0]["data_offsets"])


def _negative(h: dict[str, Any]) -> None:
    begin, end = h[DOWN1]["data_offsets"]
    h[DOWN1]["data_offsets"] = [-64, -64 + end - begin]


def _reversed(h: dict[str, Any]) -> None:
    h[DOWN1]["data_offsets"] = h[DOWN1]["data_offsets"][::-1]


@pytest.mark.parametrize(
    "damage, why",
    [
        (_alias, rf"overlap \[\d+, \d+\] of tensor '{DOWN0}'$"),
        (_negative, r"are not two non-negative integers"),
        (_reversed, r"are reversed \(end before begin\)"),
    ],
    ids=["aliasing", "negative-begin", "reversed"],
)
def test_offsets_that_loaded_wrong_weights_are_refused_before_anything_changes(damage: Any, why: str, good: str, tmp_path: Any) -> None:
    """Layer 1's down_proj given layer 0's bytes, bytes before the data section (header bytes),
    or its range reversed: each loaded without error before. safetensors refuses the same file;
    so do we, naming the file and the tensor, and the model (real weights on the CPU, or empty on
    the meta device) is as it was."""
    header, data = read_st(good)
    damage(header)
    bad = write_st(tmp_path / "model.safetensors", header, data)
    with pytest.raises(SafetensorError, match="invalid offset|invalid JSON"):
        load_file(bad)
    match = re.escape(f"{bad}: tensor '{DOWN1}': data_offsets ") + ".*" + why
    refused(llama(1), bad, ValueError, match)
    accelerate = pytest.importorskip("accelerate")
    with accelerate.init_empty_weights():
        empty = llama(1)
    refused(empty, tmp_path, ValueError, match)  # the folder, whose model.safetensors it is
    assert all(p.device.type == "meta" for p in empty.parameters())


# -- headers: one clear error naming the file and the tensor ------------------------------------

F32 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
HEADERS: list[tuple[str, Any, bytes, str, bool]] = [
    # (id, header, data, what our error says after the file's name, whether safetensors accepts it)
    ("list", [F32], bytes(8), r": not a safetensors file \(its header is an array, not a JSON object\)", False),
    ("number", 7, b"", r": not a safetensors file \(its header is a number", False),
    ("no-dtype", {"w": {"shape": [2], "data_offsets": [0, 8]}}, bytes(8), r": tensor 'w': its entry has no 'dtype'", False),
    ("no-shape", {"w": {"dtype": "F32", "data_offsets": [0, 8]}}, bytes(8), r": tensor 'w': its entry has no 'shape'", False),
    ("unknown-dtype", {"w": {**F32, "dtype": "F31"}}, bytes(8), r": tensor 'w': dtype 'F31' is not one of safetensors'", False),
    ("dtype-null", {"w": {**F32, "dtype": None}}, bytes(8), r": tensor 'w': dtype None is null, not a string", False),
    ("shape-negative", {"w": {**F32, "shape": [-2]}}, bytes(8), r": tensor 'w': shape \[-2\] is not an array of non-negative", False),
    ("shape-float", {"w": {**F32, "shape": [2.0]}}, bytes(8), r": tensor 'w': shape \[2.0\] is not an array", False),
    ("shape-bool", {"w": {**F32, "shape": [True, 2]}}, bytes(8), r": tensor 'w': shape \[True, 2\] is not an array", False),
    ("offsets-three", {"w": {**F32, "data_offsets": [0, 4, 8]}}, bytes(8), r": tensor 'w': data_offsets \[0, 4, 8\] are not two", False),
    ("offsets-str", {"w": {**F32, "data_offsets": "0-8"}}, bytes(8), r": tensor 'w': data_offsets '0-8' are not two", False),
    ("size", {"w": {**F32, "shape": [3]}}, bytes(8), r": tensor 'w': data_offsets \[0, 8\] hold 8 bytes, its shape \[3\] of F32 12", False),
    ("gap", {"w": {**F32, "data_offsets": [4, 12]}}, bytes(12), r": tensor 'w': data_offsets \[4, 12\] leave bytes \[0, 4\) of the data unused", False),
    ("trailing", {"w": F32}, bytes(9), r": 1 bytes after the last tensor's data \(the data section has 9 bytes, the tensors 8\)", False),
    ("truncated", {"w": F32}, bytes(7), r": tensor 'w': ends after the end of the file \(truncated\)", False),
    ("overlap", {"v": F32, "w": {**F32, "shape": [1], "data_offsets": [4, 8]}}, bytes(8), r": tensor 'w': data_offsets \[4, 8\] overlap \[0, 8\] of tensor 'v'", False),
    ("metadata-list", {"__metadata__": ["pt"], "w": F32}, bytes(8), r": '__metadata__' is an array, not an object of strings", False),
    ("metadata-int", {"__metadata__": {"step": 3}, "w": F32}, bytes(8), r": '__metadata__' entry 'step' is a number, not a string", False),
    ("overflow", {"w": {**F32, "shape": [2**62, 8, 0], "data_offsets": [0, 0]}}, b"", r": tensor 'w': shape .* has more elements than 64 bits count", False),
    # Stricter than safetensors on purpose (see runtime.safetensors._parse):
    ("entry-array", {"w": ["F32", [2], [0, 8]]}, bytes(8), r": tensor 'w': its entry is an array, not an object", True),
    ("dtype-object", {"w": {**F32, "dtype": {"F32": None}}}, bytes(8), r": tensor 'w': dtype \{'F32': None\} is an object, not a string", True),
    ("sub-byte", {"w": {"dtype": "F4", "shape": [16], "data_offsets": [0, 8]}}, bytes(8), r": tensor 'w': dtype F4 \(under a byte an element\)", True),
    ("past-int64", {"w": {**F32, "shape": [0, 2**63], "data_offsets": [0, 0]}}, b"", r": tensor 'w': shape .* has a dimension of 2\*\*63 or more", True),
]


@pytest.mark.parametrize("header, data, match, theirs", [h[1:] for h in HEADERS], ids=[h[0] for h in HEADERS])
def test_a_malformed_header_is_one_error_naming_the_file_and_the_tensor(header: Any, data: bytes, match: str, theirs: bool, tmp_path: Any) -> None:
    path = write_st(tmp_path / "w.safetensors", header, data)
    with pytest.raises(ValueError, match=re.escape(path) + match):
        Reader(path)
    try:
        with safe_open(path, "pt"):
            accepted = True
    except SafetensorError:
        accepted = False
    assert accepted == theirs


def test_header_problems_through_offload_weights_change_nothing(tmp_path: Any) -> None:
    """RELIABILITY.md's rows: a header that is a JSON list (was a TypeError from ``pop``), an
    entry without a dtype (a KeyError): now ValueErrors naming the file, the model as it was."""
    model = llama(1)
    bad = write_st(tmp_path / "list.safetensors", [F32], bytes(8))
    refused(model, bad, ValueError, re.escape(bad) + r": not a safetensors file \(its header is an array")
    bad = write_st(tmp_path / "nodtype.safetensors", {"w": {"shape": [2], "data_offsets": [0, 8]}}, bytes(8))
    refused(model, bad, ValueError, re.escape(bad) + r": tensor 'w': its entry has no 'dtype'")


def test_a_bad_checkpoint_is_refused_before_the_weights_are_tied(tmp_path: Any) -> None:
    """offload_weights ties an empty model's weights (``tie_weights()``) before it loads: a bad
    file is refused before that too. GPT-2 built with init_empty_weights comes untied."""
    accelerate = pytest.importorskip("accelerate")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64)
    with accelerate.init_empty_weights():
        empty = transformers.GPT2LMHeadModel(cfg)
    assert empty.lm_head.weight is not empty.transformer.wte.weight
    bad = write_st(tmp_path / "model.safetensors", [F32], bytes(8))
    refused(empty, bad, ValueError, re.escape(bad) + r": not a safetensors file")
    assert empty.lm_head.weight is not empty.transformer.wte.weight


def test_an_absurd_header_length_is_refused(tmp_path: Any) -> None:
    """Larger than the file, or over safetensors' 100 MB limit (a sparse file over 100 MB)."""
    path = write_st(tmp_path / "long.safetensors", {"w": F32}, bytes(8), n=1000)
    with pytest.raises(ValueError, match=re.escape(path) + r": not a safetensors file \(header of 1000 bytes in a file of"):
        Reader(path)
    huge = str(tmp_path / "huge.safetensors")
    with open(huge, "wb") as f:
        f.write(struct.pack("<Q", MAX_HEADER + 1))
        f.truncate(8 + MAX_HEADER + 16)  # sparse: no disk space
    with pytest.raises(ValueError, match=re.escape(huge) + rf": not a safetensors file \(a header of {MAX_HEADER + 1} bytes, over"):
        Reader(huge)
    with pytest.raises(SafetensorError):
        safe_open(huge, "pt")


def test_json_that_safetensors_refuses_is_refused(tmp_path: Any) -> None:
    """Python's json reads what serde_json (safetensors' parser) does not: NaN, numbers out of
    range, lone surrogates, nesting past its limit; and a header not UTF-8 or a key given twice."""
    body = '"dtype":"F32","shape":[2],"data_offsets":[0,8]'
    for raw, match in [
        ('{"w":{' + body + ',"x":NaN}}', r"its header: NaN is not JSON"),
        ('{"w":{' + body + ',"x":1e400}}', r"its header: number 1e400 out of range"),
        ('{"w":{' + body + ',"x":"\\ud800"}}', r"its header has a lone surrogate escape"),
        ('{"w":{' + body + ',"x":' + "[" * 126 + "]" * 126 + "}}", r"its header: arrays and objects nested deeper than 127 levels"),
        ('{"w":{' + body + ',"dtype":"F32"}}', r"its header: the key 'dtype' is given twice"),
        ('{"w":{' + body + "}}\x00", r"its header is not JSON"),
        ('{"w\xff":{' + body + "}}", r"its header is not UTF-8"),
    ]:
        path = write_st(tmp_path / "j.safetensors", None, bytes(8), raw=raw.encode("latin-1"))
        with pytest.raises(ValueError, match=re.escape(path) + r": not a safetensors file \(" + match):
            Reader(path)
        with pytest.raises(SafetensorError):
            safe_open(path, "pt")
    # Deepest nesting serde_json reads, and a valid surrogate pair: read by both.
    for raw in ['{"w":{' + body + ',"x":' + "[" * 125 + "]" * 125 + "}}", '{"w":{' + body + ',"x":"\\ud83d\\ude00"}}']:
        path = write_st(tmp_path / "j.safetensors", None, bytes(8), raw=raw.encode())
        Reader(path).close()
        with safe_open(path, "pt"):
            pass


def test_every_safetensors_dtype_torch_has_reads_as_safetensors_reads_it(tmp_path: Any) -> None:
    for dtype, code in DTYPES.items():
        item = torch.empty((), dtype=dtype).element_size()
        header = {"m": {"dtype": code, "shape": [2, 3], "data_offsets": [0, 6 * item]}, "s": {"dtype": code, "shape": [], "data_offsets": [6 * item, 7 * item]}}
        path = write_st(tmp_path / f"{code}.safetensors", header, bytes(random.Random(code).randbytes(7 * item)))
        r = Reader(path)
        with safe_open(path, "pt") as f:
            for name in ("m", "s"):
                ours, theirs = r.read(name), f.get_tensor(name)
                assert ours.dtype == theirs.dtype == dtype and ours.shape == theirs.shape, code
                assert torch.equal(ours.reshape(-1).view(torch.uint8), theirs.reshape(-1).view(torch.uint8)), code
        r.close()


# -- checkpoint=, and a sharded checkpoint's index ----------------------------------------------


def test_a_checkpoint_that_is_not_a_path_is_a_type_error_naming_it(good: str) -> None:
    model = llama(1)
    for bad in (5, b"model.safetensors", [good]):
        refused(model, bad, TypeError, r"^checkpoint must be a path \(str or os.PathLike\) to a .safetensors file or a folder, got")


@pytest.fixture()
def sharded(good: str, tmp_path: Any) -> Iterator[tuple[str, dict[str, str]]]:
    """``good`` split in two shards in a folder, and its weight map."""
    sd = load_file(good)
    names = sorted(sd)
    folder = tmp_path / "ckpt"
    folder.mkdir()
    weight_map = {}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
        file = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({k: sd[k] for k in part}, str(folder / file))
        weight_map.update({k: file for k in part})
    yield str(folder), weight_map


def _index(folder: str, doc: Any, raw: str | None = None) -> str:
    path = os.path.join(folder, "model.safetensors.index.json")
    with open(path, "w") as f:
        f.write(json.dumps(doc) if raw is None else raw)
    return path


def test_a_sharded_checkpoint_loads_its_shards_wherever_the_links_lead(sharded: tuple[str, dict[str, str]], good: str, tmp_path: Any) -> None:
    """A shard in a subfolder, and one that is a symbolic link out of the folder (a Hugging Face
    cache's snapshot links to its blobs): inside the folder by name, so read."""
    folder, weight_map = sharded
    os.mkdir(os.path.join(folder, "sub"))
    os.rename(os.path.join(folder, "model-00001-of-00002.safetensors"), os.path.join(folder, "sub", "a.safetensors"))
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    os.rename(os.path.join(folder, "model-00002-of-00002.safetensors"), blobs / "b")
    os.symlink(blobs / "b", os.path.join(folder, "b.safetensors"))
    moved = {"model-00001-of-00002.safetensors": "sub/a.safetensors", "model-00002-of-00002.safetensors": "./b.safetensors"}
    _index(folder, {"metadata": {}, "weight_map": {k: moved[v] for k, v in weight_map.items()}})
    model = llama(1)
    h = offload_adam.offload_weights(model, device="cpu", checkpoint=folder)
    h.close()
    want = load_file(good)
    for n, p in model.named_parameters():
        assert torch.equal(p.detach().view(torch.int16), want[n].view(torch.int16)), n


@pytest.mark.parametrize(
    "doc, raw, match",
    [
        (None, "{'weight_map': {}}", r" is not JSON \(Expecting property name"),
        ([], None, r" is an array, not a JSON object with a weight_map"),
        ({"metadata": {}}, None, r" has no weight_map, not an object of tensor names to file names"),
        ({"weight_map": ["model-00001-of-00002.safetensors"]}, None, r" has a weight_map that is an array, not an object"),
        ({"weight_map": {DOWN1: 1}}, None, rf": weight_map\['{DOWN1}'\] is a number, not a file name"),
    ],
    ids=["not-json", "list", "no-weight-map", "weight-map-list", "file-not-str"],
)
def test_a_malformed_index_is_one_error_naming_it(doc: Any, raw: str | None, match: str, sharded: tuple[str, dict[str, str]]) -> None:
    folder, _ = sharded
    index = _index(folder, doc, raw)
    refused(llama(1), folder, ValueError, "^" + re.escape(f"checkpoint: {index}") + match)


@pytest.mark.parametrize("where", ["parent", "absolute", "climbing"])
def test_an_index_naming_a_file_outside_its_folder_is_refused(where: str, good: str, tmp_path: Any) -> None:
    """transformers reads ``../outside.safetensors``; this package opens only files inside the
    folder it is given (the checkpoint is complete: before, it loaded)."""
    folder = tmp_path / "ckpt"
    folder.mkdir()
    outside = tmp_path / "outside.safetensors"
    shutil.copy(good, outside)
    file = {"parent": "../outside.safetensors", "absolute": str(outside), "climbing": "sub/../../outside.safetensors"}[where]
    index = _index(str(folder), {"weight_map": {k: file for k in load_file(good)}})
    match = "^" + re.escape(f"checkpoint: {index}: weight_map[") + r".*" + re.escape(f"] names {file!r}, outside the checkpoint's folder")
    refused(llama(1), folder, ValueError, match)


def test_a_tensor_in_two_shards_is_refused(sharded: tuple[str, dict[str, str]], good: str) -> None:
    """Which one a reader takes is the reader's: neither is taken."""
    folder, weight_map = sharded
    third = os.path.join(folder, "model-extra.safetensors")
    save_file({DOWN1: load_file(good)[DOWN0]}, third)
    _index(folder, {"weight_map": {**weight_map, "extra": "model-extra.safetensors"}})
    first = os.path.join(folder, weight_map[DOWN1])  # read first: the files are read in sorted order
    refused(llama(1), folder, ValueError, re.escape(f"checkpoint: tensor '{DOWN1}' is in two files of {folder!r}: {first} and {third}"))
