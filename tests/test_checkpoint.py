"""Checkpoints validated as safetensors validates them (RELIABILITY.md, defect 1 and the
checkpoint rows of section 10): every file's header is checked by safetensors' own rules before
anything is read or changed, and a malformed file, index or ``checkpoint=`` argument is one
clear error naming the file and the tensor, the model left as it was. The reader is fuzzed
against safetensors itself (hypothesis): it accepts exactly the files safetensors accepts (but
for the stricter rules stated in :func:`stated_exception`) and reads the same bytes."""

from __future__ import annotations

import copy
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
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir

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


# -- fuzzing against safetensors ----------------------------------------------------------------

CODES = sorted(DTYPES.values())
ITEM = {code: torch.empty((), dtype=dt).element_size() for dt, code in DTYPES.items()}
OTHER_CODES = ["F4", "F6_E2M3", "F6_E3M2", "f32", "F32 ", "", "U128", "__metadata__"]
SUB_BYTE = {"F4", "F6_E2M3", "F6_E3M2"}
FIELDS = ["dtype", "shape", "data_offsets"]
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**66), 2**66) | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)
INTS = st.integers(-4, 48) | st.sampled_from([2**63, 2**64 - 1, 2**64, -(2**63)])


@st.composite
def mutate(draw: Any, header: Any, data: bytes) -> tuple[Any, bytes]:
    """One change to a header or its data: offsets, dtypes, shapes, fields of every JSON type,
    fields missing or added, entries that are not objects, the metadata, a header that is not
    an object, bytes added or cut."""
    kind = draw(st.sampled_from(["offsets", "dtype", "shape", "field", "delete", "extra", "entry", "new", "metadata", "header", "data"]))
    if kind == "data":
        return header, data + draw(st.binary(min_size=1, max_size=8)) if draw(st.booleans()) else data[: -draw(st.integers(1, 8))]
    if kind == "header":
        return draw(JSON.filter(lambda x: not isinstance(x, dict))), data
    if not isinstance(header, dict):
        return header, data
    if kind == "metadata":
        header["__metadata__"] = draw(JSON | st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=2))
        return header, data
    if kind == "new":
        header[draw(st.text(max_size=4))] = {"dtype": draw(st.sampled_from(CODES)), "shape": draw(st.lists(INTS, max_size=2)), "data_offsets": draw(st.lists(INTS, min_size=2, max_size=2))}
        return header, data
    names = [k for k in header if k != "__metadata__"]
    if not names:
        return header, data
    name = draw(st.sampled_from(names))
    if kind == "entry":
        e = header[name]
        array = [e.get(f) for f in FIELDS] if isinstance(e, dict) else [e]
        header[name] = draw(JSON | st.just(array))
        return header, data
    e = header[name]
    if not isinstance(e, dict):
        return header, data
    if kind == "offsets":
        others = [header[k]["data_offsets"] for k in names if isinstance(header[k], dict) and "data_offsets" in header[k]]
        how = draw(st.sampled_from(["random", "swap", "copy", "shift"]))
        if how == "random" or "data_offsets" not in e or not isinstance(e["data_offsets"], list):
            e["data_offsets"] = draw(st.lists(INTS, min_size=2, max_size=2))
        elif how == "swap":
            e["data_offsets"] = e["data_offsets"][::-1]
        elif how == "copy" and others:
            e["data_offsets"] = copy.deepcopy(draw(st.sampled_from(others)))
        else:
            e["data_offsets"] = [o + draw(st.integers(-8, 8)) if isinstance(o, int) else o for o in e["data_offsets"]]
    elif kind == "dtype":
        e["dtype"] = draw(st.sampled_from(CODES + OTHER_CODES) | JSON)
    elif kind == "shape":
        e["shape"] = draw(st.lists(INTS, max_size=3) | st.sampled_from([[2**63, 2, 0], [2**32, 2**32], [2**64]]) | JSON)
    elif kind == "field":
        e[draw(st.sampled_from(FIELDS))] = draw(JSON)
    elif kind == "delete":
        e.pop(draw(st.sampled_from(FIELDS)), None)
    else:
        e[draw(st.text(max_size=4))] = draw(JSON)
    return header, data


@st.composite
def files(draw: Any) -> bytes:
    """A valid safetensors file of up to four small tensors (in any order of offsets), mutated
    up to three times; sometimes its header's length or one of its bytes changed as well."""
    tensors = [(f"t{i}", draw(st.sampled_from(CODES)), draw(st.lists(st.integers(0, 3), max_size=3))) for i in range(draw(st.integers(0, 4)))]
    offsets, at = {}, 0
    for i in draw(st.permutations(range(len(tensors)))):
        name, code, shape = tensors[i]
        n = ITEM[code]
        for d in shape:
            n *= d
        offsets[name], at = [at, at + n], at + n
    header: Any = {name: {"dtype": code, "shape": shape, "data_offsets": offsets[name]} for name, code, shape in tensors}
    if draw(st.booleans()):
        header["__metadata__"] = {"format": "pt"}
    data = random.Random(draw(st.integers(0, 2**32))).randbytes(at)
    for _ in range(draw(st.integers(0, 3))):
        header, data = draw(mutate(header, data))
    text = json.dumps(header, indent=draw(st.sampled_from([None, 1]))).encode()
    text += b" " * draw(st.integers(0, 7))
    n = len(text)
    if draw(st.integers(0, 9)) == 0:
        n = max(0, n + draw(st.integers(-3, 3)))
    if text and draw(st.integers(0, 9)) == 0:
        i = draw(st.integers(0, len(text) - 1))
        text = text[:i] + bytes([draw(st.integers(0, 255))]) + text[i + 1 :]
    return struct.pack("<Q", n) + text + data


def stated_exception(header: bytes) -> bool:
    """The rules where we are stricter than safetensors on purpose (``runtime.safetensors._parse``):
    a key given twice, an entry that is not an object, a dtype that is not a string, a sub-byte
    dtype, a dimension past torch's int64 sizes."""
    twice = False

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        nonlocal twice
        twice |= len({k for k, _ in items}) != len(items)
        return dict(items)

    try:
        h = json.loads(header.decode("utf-8"), object_pairs_hook=pairs)
    except (ValueError, RecursionError):
        return False
    if twice:
        return True
    if not isinstance(h, dict):
        return False
    for k, e in h.items():
        if k == "__metadata__":
            continue
        if not isinstance(e, dict):
            return True
        if "dtype" in e and (not isinstance(e["dtype"], str) or e["dtype"] in SUB_BYTE):
            return True
        shape = e.get("shape")
        if isinstance(shape, list) and any(isinstance(d, int) and not isinstance(d, bool) and 2**63 <= d < 2**64 for d in shape):
            return True
    return False


def check_against_safetensors(path: str, blob: bytes) -> None:
    """Our reader refuses with a ValueError naming the file, or accepts; it accepts exactly the
    files safetensors accepts, but for the stated exceptions; accepted tensors read the same."""
    with open(path, "wb") as f:
        f.write(blob)
    try:
        with safe_open(path, "pt"):
            theirs = True
    except SafetensorError:
        theirs = False
    try:
        r = Reader(path)
    except (ValueError, TypeError) as err:
        assert path in str(err), err
        (n,) = struct.unpack("<Q", blob[:8]) if len(blob) >= 8 else (0,)
        assert not theirs or stated_exception(blob[8 : 8 + n]), f"safetensors accepts what we refused: {err}"
        return
    try:
        assert theirs, "we accepted what safetensors refuses"
        with safe_open(path, "pt") as f:
            assert set(f.keys()) == set(r.entries)
            for name in r.entries:
                ours, want = r.read(name), f.get_tensor(name)
                assert ours.dtype == want.dtype and ours.shape == want.shape, name
                assert torch.equal(ours.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), name
    finally:
        r.close()


def fuzz(tmp_path: Any, examples: int, derandomize: bool) -> None:
    """``examples`` files of :func:`files` checked by :func:`check_against_safetensors`. Nothing
    is written outside ``tmp_path``: no example database, and hypothesis's cache of the constants
    it finds in the source (its ``.hypothesis`` folder, in the working directory by default) is
    put there too."""
    count = iter(range(10**9))
    where = tmp_path / "files"
    where.mkdir()

    @settings(
        max_examples=examples, deadline=None, database=None, derandomize=derandomize,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    )  # fmt: skip
    @given(files())
    def prop(blob: bytes) -> None:
        path = str(where / f"f{next(count)}.safetensors")  # a new file each time: safetensors maps them
        try:
            check_against_safetensors(path, blob)
        finally:
            os.remove(path)

    set_hypothesis_home_dir(tmp_path / "hypothesis")
    try:
        prop()
    finally:
        set_hypothesis_home_dir(None)
    assert os.listdir(where) == []


def test_the_reader_accepts_what_safetensors_accepts_fuzzed_briefly(tmp_path: Any) -> None:
    """The fuzz below, 50 examples, the same ones every run (CI's)."""
    fuzz(tmp_path, 50, derandomize=True)


@pytest.mark.slow
def test_the_reader_accepts_what_safetensors_accepts_fuzzed(tmp_path: Any) -> None:
    """Minutes of random headers (``--run-slow``): see :func:`check_against_safetensors`."""
    fuzz(tmp_path, 30_000, derandomize=False)
