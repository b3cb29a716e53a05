"""The state schema: every buffer of a group's state, declared once.

A group's state is its moments (:data:`MOMENTS`: name, which 8-bit map, whether amsgrad needs
it), each in one flat buffer of the group, paged by the NVMe tier, plus the float32 masters and
step counts. How one parameter's slot stores a moment is its :class:`Codec`, chosen by the
optimizer's ``state_dtype`` and the parameter (:func:`codec_for`):

* ``float32`` / ``bfloat16``: one element per parameter element, ``state[p][name]`` a view
  shaped like the parameter;
* ``uint8``: torchao's ``AdamW8bit`` storage (the kernel's ``q8``): one code per element and one
  float32 absmax per block of :data:`QBLOCK` elements, shown as ``state[p][name + "_codes"]``
  (uint8, shaped like the parameter) and ``state[p][name + "_absmax"]`` (float32,
  ``numel / QBLOCK``). A tensor torchao would not quantize (under :data:`MIN_NUMEL` elements, not
  whole blocks, complex) keeps float32 moments in the same byte buffers;
* ``fp8`` (``state_dtype=torch.float8_e4m3fn``): torchao's ``AdamWFp8`` storage (the kernel's
  ``fp8``): one float8_e4m3fn code per element and one float32 scale (``absmax / 448``) per block,
  shown as ``state[p][name + "_codes"]`` (float8_e4m3fn, shaped like the parameter) and
  ``state[p][name + "_scale"]``, in the same byte buffers as uint8 and with the same fallback
  (tensors torchao would not quantize keep float32 moments: torchao keeps the parameter's dtype,
  which is float32 for a float32 parameter; a bfloat16 parameter's stay float32 here);
* ``float32`` in bytes: that fallback, ``4 * numel`` bytes of the uint8 buffers.

Every user reads this: :class:`~offload_adam.optim.state.GroupState` allocates and views by it,
the tier pages its buffers, the planner and ``memory_report`` count its bytes, and checkpoints,
take-over and ``load_state_dict`` check and convert entries with :func:`check_moment` and
:func:`write_moment` (an fp32 entry into a quantized slot is quantized, a quantized one into a
float slot dequantized, one codec's entry into the other's slot dequantized and quantized).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .. import _native

QBLOCK: int = _native.QBLOCK
MIN_NUMEL: int = _native.Q8_MIN_NUMEL
STATE_DTYPES = (torch.float32, torch.bfloat16, torch.uint8, torch.float8_e4m3fn)
BYTE_STATES = (torch.uint8, torch.float8_e4m3fn)  # moments in byte buffers of their own layout
FP8 = torch.float8_e4m3fn
MASTER_KEY = "master_param"
COMP_KEY = "kahan_comp"  # bfloat16 weights without a master: their Kahan compensation


@dataclass(frozen=True)
class Moment:
    """One moment buffer of a group."""

    key: str  # its name in state[p] (and its prefix, quantized)
    signed: bool  # which 8-bit map quantizes it
    amsgrad: bool  # only groups with amsgrad have it


MOMENTS = (Moment("exp_avg", True, False), Moment("exp_avg_sq", False, False), Moment("max_exp_avg_sq", False, True))
MOMENT = {m.key: m for m in MOMENTS}


def moments(amsgrad: bool) -> tuple[Moment, ...]:
    """The moments a group with (or without) amsgrad has."""
    return tuple(m for m in MOMENTS if amsgrad or not m.amsgrad)


@dataclass(frozen=True)
class Codec:
    """How one slot stores a moment, in buffers of ``buffer_dtype``."""

    name: str  # "float32", "bfloat16", "q8" or "fp8"
    buffer_dtype: torch.dtype

    @property
    def quantized(self) -> bool:
        return self.name in ("q8", "fp8")

    @property
    def native(self) -> int:
        """The native set's code of a slot in byte buffers: 0 float32, 1 q8, 2 fp8."""
        return ("float32", "q8", "fp8").index(self.name)

    @property
    def scale_key(self) -> str:
        """The suffix of a quantized moment's per-block floats."""
        return "_scale" if self.name == "fp8" else "_absmax"
    def nbytes(self, n: int) -> int:
        """Bytes of a slot of ``n`` elements (the native layer's ``moment_bytes``)."""
        if self.quantized:
            return n + 4 * (n // QBLOCK)
        return n * (2 if self.name == "bfloat16" else 4)

    def units(self, n: int) -> int:
        """Elements of the buffer a slot of ``n`` elements spans."""
        return self.nbytes(n) // _size(self.buffer_dtype)

    def keys(self, m: Moment) -> tuple[str, ...]:
        """The ``state[p]`` keys of moment ``m`` in this codec."""
        return (m.key + "_codes", m.key + self.scale_key) if self.quantized else (m.key,)

    def views(self, buf: Tensor, off: int, m: Moment, like: Tensor, rows: bool = False) -> dict[str, Tensor]:
        """Moment ``m`` of the slot at ``off`` (in buffer elements), ``like`` the parameter whose
        shape and strides it takes; ``rows``: the absmax shaped ``(rows, row // QBLOCK)`` (a
        DTensor's shard, whose blocks run along its rows)."""
        n = like.numel() * (2 if like.is_complex() else 1)
        if self.quantized:
            absmax = buf[off + n : off + n + 4 * (n // QBLOCK)].view(torch.float32)
            if rows:
                absmax = absmax.view(like.shape[0], -1)
            codes = view(buf, off, like)
            return {m.key + "_codes": codes.view(FP8) if self.name == "fp8" else codes, m.key + self.scale_key: absmax}
        if buf.dtype == torch.uint8:  # float32 moments among quantized ones
            return {m.key: view(buf[off : off + 4 * n].view(torch.float32), 0, like)}
        return {m.key: view(buf, off, like)}


def _size(dt: torch.dtype) -> int:
    return torch.empty((), dtype=dt).element_size()


def codec_for(state_dtype: torch.dtype, n: int, dtype: torch.dtype) -> Codec:
    """The codec of a slot of ``n`` elements of a ``dtype`` parameter under ``state_dtype``:
    uint8 and float8_e4m3fn quantize what torchao quantizes (``n >= MIN_NUMEL``, whole blocks,
    real), in uint8 buffers."""
    if state_dtype not in BYTE_STATES:
        return Codec("bfloat16" if state_dtype == torch.bfloat16 else "float32", state_dtype)
    if not dtype.is_complex and n >= MIN_NUMEL and n % QBLOCK == 0:
        return Codec("fp8" if state_dtype == FP8 else "q8", torch.uint8)
    return Codec("float32", torch.uint8)


def buffer_dtype(state_dtype: torch.dtype) -> torch.dtype:
    """The dtype of a group's moment buffers under ``state_dtype``."""
    return torch.uint8 if state_dtype in BYTE_STATES else state_dtype


def is_dense(t: Tensor) -> bool:
    """Its elements fill exactly ``numel`` consecutive slots in some order of the dimensions
    (contiguous, channels_last, any permutation): what the kernel can step in place."""
    dims = sorted((st, n) for st, n in zip(t.stride(), t.shape) if n != 1)
    expected = 1
    for st, n in dims:
        if st != expected:
            return False
        expected *= n
    return True


def view(flat: Tensor, offset: int, p: Tensor) -> Tensor:
    """The slot of ``p`` in ``flat`` at ``offset``, shaped (and strided) like ``p``."""
    offset += int(flat.storage_offset())  # as_strided counts from the storage's start
    if p.is_complex():
        real = torch.as_strided(flat, (*p.shape, 2), (*(2 * s for s in p.stride()), 1), offset)
        return torch.view_as_complex(real)
    return torch.as_strided(flat, p.shape, p.stride(), offset)


# -- entries: what a checkpoint, load_state_dict or other code hands in ---------------------------

Local = Callable[[Any, str], Any]  # a DTensor entry's local shard, checked against the parameter


def check_moment(entry: Mapping[str, Any], m: Moment, p: Tensor, name: str, local: Local) -> str | None:
    """Checks how ``entry`` holds moment ``m`` of parameter ``p`` (its local shard): ``"float"``
    (a tensor shaped like ``p``), ``"q8"`` (uint8 codes shaped like ``p`` and one float32 absmax
    per block), ``"fp8"`` (float8_e4m3fn codes and one float32 scale per block) or None (absent).
    Raises, naming the key, on anything else."""
    codes, absmax, scale = entry.get(m.key + "_codes"), entry.get(m.key + "_absmax"), entry.get(m.key + "_scale")
    t = entry.get(m.key)
    what = f"loaded state of {name}"
    if t is not None and codes is not None:
        raise ValueError(f"{what}: both {m.key!r} and {m.key + '_codes'!r}; one form per moment")
    if absmax is not None and scale is not None:
        raise ValueError(f"{what}: both {m.key + '_absmax'!r} and {m.key + '_scale'!r}; one form per moment")
    if codes is not None or absmax is not None or scale is not None:
        fp8 = scale is not None or (absmax is None and getattr(codes, "dtype", None) == FP8)
        kind, suffix = ("fp8", "_scale") if fp8 else ("q8", "_absmax")
        floats = scale if fp8 else absmax
        if codes is None or floats is None:
            raise ValueError(f"{what}: {m.key}_codes and {m.key}{suffix} go together")
        for key, x in ((m.key + "_codes", codes), (m.key + suffix, floats)):
            if not isinstance(x, Tensor):
                raise TypeError(f"{what}: {key} must be a tensor, got {type(x).__name__}")
        codes, floats = local(codes, m.key + "_codes"), local(floats, m.key + suffix)
        n = p.numel()
        want = FP8 if kind == "fp8" else torch.uint8
        if p.is_complex() or codes.shape != p.shape or codes.dtype != want or n % QBLOCK:
            raise ValueError(
                f"{what}: {m.key}_codes must be {str(want).removeprefix('torch.')} of shape {tuple(p.shape)} "
                f"in whole blocks of {QBLOCK} (with {m.key}{suffix}), got {codes.dtype} of shape {tuple(codes.shape)}"
            )
        if floats.dtype != torch.float32 or floats.numel() != n // QBLOCK:
            raise ValueError(f"{what}: {m.key}{suffix} must be {n // QBLOCK} float32 values, got {floats.numel()} {floats.dtype}")
        return kind
    if t is None:
        return None
    if not isinstance(t, Tensor):
        raise TypeError(f"{what}: {m.key} must be a tensor, got {type(t).__name__}")
    t = local(t, m.key)
    if t.shape != p.shape:
        raise ValueError(f"{what}: {m.key} has shape {tuple(t.shape)}, expected {tuple(p.shape)}")
    if not (t.is_floating_point() or t.is_complex()) or t.is_complex() != p.is_complex():
        raise TypeError(f"{what}: {m.key} has dtype {t.dtype}, expected one like {p.dtype}")
    return "float"


def _flat(t: Tensor) -> Tensor:
    """The memory of a dense tensor (any order of its dimensions) as one run of elements: the
    order the kernel and its blocks see."""
    return torch.as_strided(t, (t.numel(),), (1,), t.storage_offset())


def _bytes(codes: Tensor) -> Tensor:
    """Codes as the native calls take them: their bytes (fp8 codes viewed as uint8)."""
    return codes.view(torch.uint8) if codes.dtype == FP8 else codes


def _dequantize(codes: Tensor, absmax: Tensor, m: Moment) -> Tensor:
    """The float32 values of dense ``codes`` (uint8 codes of the dynamic maps, or fp8 codes;
    blocks in their memory order) and their absmax or scale, shaped and strided like the codes."""
    out = torch.empty_like(codes, dtype=torch.float32)
    fp8 = codes.dtype == FP8
    _native.dequantize(_flat(_bytes(codes)), absmax.contiguous().reshape(-1), _flat(out), signed=m.signed, fp8=fp8)
    return out


def write_moment(views: Mapping[str, Tensor], codec: Codec, m: Moment, src: Mapping[str, Any], local: Local) -> None:
    """Writes moment ``m`` of a checked entry ``src`` into a slot's ``views`` (its codec's),
    quantizing or dequantizing as the two forms require. Codes are tied to the parameter's
    elements as its view shows them; blocks run in the slot's memory order."""
    if m.key + "_codes" in src:
        codes = local(src[m.key + "_codes"], m.key)
        suffix = "_scale" if codes.dtype == FP8 else "_absmax"
        absmax = local(src[m.key + suffix], m.key).reshape(-1)
        if codec.quantized and codec.scale_key == suffix:
            views[m.key + "_codes"].copy_(codes)
            views[m.key + suffix].view(-1).copy_(absmax)
            return
        like = views[m.key + "_codes"] if codec.quantized else views[m.key]
        mem = torch.empty_like(like, dtype=codes.dtype)  # the codes in the slot's memory order
        mem.copy_(codes)
        t = _dequantize(mem, absmax, m)
        if not codec.quantized:
            views[m.key].copy_(t)
            return
    else:
        t = local(src[m.key], m.key)
    if codec.quantized:
        codes = views[m.key + "_codes"]
        x = torch.empty_like(codes, dtype=torch.float32)
        x.copy_(t)
        _native.quantize(_flat(x), _flat(_bytes(codes)), views[m.key + codec.scale_key], signed=m.signed, fp8=codec.name == "fp8")
    else:
        views[m.key].copy_(t)


def copy_moment(views: Mapping[str, Tensor], codec: Codec, dst: Moment, src: Moment) -> None:
    """Moment ``src``'s values into moment ``dst`` of the same slot (the amsgrad maximum started
    from ``exp_avg_sq``: both use the unsigned map)."""
    for a, b in zip(codec.keys(dst), codec.keys(src)):
        views[a].copy_(views[b])


def dequantized(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A copy of a state dict with every quantized moment (``<name>_codes`` and
    ``<name>_absmax``, or fp8 ``<name>_codes`` and ``<name>_scale``) replaced by its float32
    values under ``<name>``: what
    ``torch.optim.AdamW.load_state_dict`` can take. Other entries are shared, not copied.

    Args:
        state_dict: an optimizer state dict of ``AdamW(state_dtype=torch.uint8)`` (or
            ``torch.float8_e4m3fn``).
    """
    out = dict(state_dict)
    state = {}
    for k, entry in state_dict["state"].items():
        if not isinstance(entry, dict):
            state[k] = entry
            continue
        e = dict(entry)
        for m in MOMENTS:
            codes = e.pop(m.key + "_codes", None)
            absmax = e.pop(m.key + "_absmax", None)
            scale = e.pop(m.key + "_scale", None)
            absmax = absmax if absmax is not None else scale
            if codes is None or absmax is None:
                continue
            e[m.key] = _dequantize(codes if is_dense(codes) else codes.contiguous(), absmax, m)
        state[k] = e
    out["state"] = state
    return out
