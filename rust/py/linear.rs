//! `linear`: the matmul of a few rows against bfloat16, int8 or fp8 weights (`crate::linear`),
//! on the tensors as they are (no copy), checked first: every error names the argument.

use pyo3::prelude::*;

use super::convert::{err, pool, simd_or_default, type_error, value_error};
use super::dlpack::{Elems, ElemsMut, HostView, HostViewMut};
use crate::linear::{self as core, Act, ActMut, Scale, Shape, Weight};

fn act<'a>(v: &HostView<'a, '_>, name: &str) -> PyResult<Act<'a>> {
    match v.elems() {
        Elems::F32(x) => Ok(Act::F32(x)),
        Elems::Bf16(x) => Ok(Act::Bf16(x)),
        _ => Err(type_error(format!("{name}: dtype must be float32 or bfloat16"))),
    }
}

/// `out` of a call that reads `reads`: `(rows, n)`, float32 or bfloat16, sharing no memory with
/// them (both bindings' check, before anything is written).
fn out_view<'a, 'py>(
    out: &'a Bound<'py, PyAny>,
    reads: &[&HostView<'_, '_>],
    rows: usize,
    n: usize,
) -> PyResult<HostViewMut<'a, 'py>> {
    let ov = HostViewMut::new(HostView::new(out, "out")?, reads, "out")?;
    if ov.shape() != [rows, n] {
        return Err(value_error(format!(
            "out: shape must be ({rows}, {n}), got {:?}",
            ov.shape()
        )));
    }
    Ok(ov)
}

/// The output's elements as the kernel writes them (`HostViewMut` holds float32 or bfloat16).
pub(super) fn act_mut<'v>(ov: &'v mut HostViewMut<'_, '_>) -> ActMut<'v> {
    match ov.elems_mut() {
        ElemsMut::F32(o) => ActMut::F32(o),
        ElemsMut::Bf16(o) => ActMut::Bf16(o),
    }
}

/// `out = x @ weight.T * scale + bias` for `x` of shape `(rows, in)` (float32 or bfloat16) and
/// `weight` of shape `(out, in)`: bfloat16 (no `scale`), or int8 / float8_e4m3fn with `scale`
/// (float32, bfloat16 or float16; one per output row, any shape of that many elements, or one
/// for the tensor). `bias` (float32 or bfloat16, `(out,)`) is optional; `out` is `(rows, out)`
/// in `x`'s dtype and shares no memory with the inputs. Every tensor is a contiguous CPU tensor.
/// Runs on `num_threads` threads (a pool of that size), GIL released.
/// `omp`: its blocks on the process's OpenMP team of `num_threads` (torch's intra-op threads,
/// `crate::omp`) where there is one, else on the pool; the same bits.
#[pyfunction]
#[pyo3(signature = (x, weight, scale=None, bias=None, *, out, num_threads=1, simd=None, omp=false))]
#[allow(clippy::too_many_arguments)]
pub fn linear(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    weight: &Bound<'_, PyAny>,
    scale: Option<&Bound<'_, PyAny>>,
    bias: Option<&Bound<'_, PyAny>>,
    out: &Bound<'_, PyAny>,
    num_threads: usize,
    simd: Option<&str>,
    omp: bool,
) -> PyResult<()> {
    let simd = simd_or_default(simd)?;
    let pool = pool(num_threads)?;
    let xv = HostView::new(x, "x")?;
    let wv = HostView::new(weight, "weight")?;
    let sv = scale.map(|s| HostView::new(s, "scale")).transpose()?;
    let bv = bias.map(|b| HostView::new(b, "bias")).transpose()?;
    let (&[rows, k], &[n, kw]) = (xv.shape.as_slice(), wv.shape.as_slice()) else {
        return Err(value_error(format!(
            "x and weight must be 2-D, got shapes {:?} and {:?}",
            xv.shape, wv.shape
        )));
    };
    if kw != k {
        return Err(value_error(format!(
            "weight: has {kw} inputs per row, x has {k} (shapes {:?} and {:?})",
            wv.shape, xv.shape
        )));
    }
    let scale_of = |name: &str| -> PyResult<Scale<'_>> {
        let s = sv
            .as_ref()
            .ok_or_else(|| value_error(format!("scale: required for {name} weights")))?;
        match s.elems() {
            Elems::F32(s) => Ok(Scale::F32(s)),
            Elems::Bf16(s) => Ok(Scale::Bf16(s)),
            Elems::F16(s) => Ok(Scale::F16(s)),
            _ => Err(type_error("scale: dtype must be float32, bfloat16 or float16")),
        }
    };
    let w = match wv.elems() {
        Elems::Bf16(w) => {
            if sv.is_some() {
                return Err(value_error("scale: bfloat16 weights take no scale"));
            }
            Weight::Bf16(w)
        }
        Elems::I8(q) => Weight::Int8 {
            q,
            scale: scale_of("int8")?,
        },
        Elems::F8E4M3(q) => Weight::Fp8 {
            q,
            scale: scale_of("float8_e4m3fn")?,
        },
        _ => return Err(type_error("weight: dtype must be bfloat16, int8 or float8_e4m3fn")),
    };
    let xa = act(&xv, "x")?;
    let ba = bv.as_ref().map(|b| act(b, "bias")).transpose()?;
    let mut reads = vec![&xv, &wv];
    reads.extend(sv.as_ref());
    reads.extend(bv.as_ref());
    let mut ov = out_view(out, &reads, rows, n)?;
    let o = act_mut(&mut ov);
    let shape = Shape { rows, k, n };
    let omp = omp.then_some(num_threads);
    py.detach(|| core::linear_on(simd, omp, pool.as_deref(), shape, xa, w, ba, o))
        .map_err(err)
}

/// `out = x @ W.T + bias` for int4 weights as torchao's CPU format holds them
/// (`crate::linear::int4`): `qdata` uint8 `(out, in / 2)` packed by torch's
/// `_convert_weight_to_int4pack_for_cpu` under the CPU capability `layout` (`"AVX512"`, `"AVX2"`
/// or `"DEFAULT"`), `scale_and_zero` `(in / group_size, out, 2)` (float32, bfloat16 or float16),
/// `w = (q - 8) * scale + zero`. `x` is `(rows, in)` (float32 or bfloat16), `bias` optional
/// `(out,)`, `out` `(rows, out)` in `x`'s dtype, sharing no memory with the inputs. Every tensor
/// is a contiguous CPU tensor. Runs on `num_threads` threads, GIL released (`omp`: as `linear`'s).
#[pyfunction]
#[pyo3(signature = (x, qdata, scale_and_zero, bias=None, *, group_size, layout, out, num_threads=1, simd=None, omp=false))]
#[allow(clippy::too_many_arguments)]
pub fn linear_int4(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    qdata: &Bound<'_, PyAny>,
    scale_and_zero: &Bound<'_, PyAny>,
    bias: Option<&Bound<'_, PyAny>>,
    group_size: usize,
    layout: &str,
    out: &Bound<'_, PyAny>,
    num_threads: usize,
    simd: Option<&str>,
    omp: bool,
) -> PyResult<()> {
    use crate::linear::int4::{self, Int4, Int4Layout};
    let simd = simd_or_default(simd)?;
    let pool = pool(num_threads)?;
    let layout = Int4Layout::parse(layout).ok_or_else(|| {
        value_error(format!(
            "layout: {layout:?} is not a CPU capability torch packs int4 for (AVX512, AVX2 or DEFAULT)"
        ))
    })?;
    let xv = HostView::new(x, "x")?;
    let qv = HostView::new(qdata, "qdata")?;
    let sv = HostView::new(scale_and_zero, "scale_and_zero")?;
    let bv = bias.map(|b| HostView::new(b, "bias")).transpose()?;
    let (&[rows, k], &[n, kh]) = (xv.shape.as_slice(), qv.shape.as_slice()) else {
        return Err(value_error(format!(
            "x and qdata must be 2-D, got shapes {:?} and {:?}",
            xv.shape, qv.shape
        )));
    };
    if kh * 2 != k {
        return Err(value_error(format!(
            "qdata: has {kh} bytes per row, x has {k} inputs (two per byte: expected {})",
            k / 2
        )));
    }
    if group_size == 0 || sv.shape != [k / group_size, n, 2] {
        return Err(value_error(format!(
            "scale_and_zero: shape must be (in / group_size, out, 2) = ({}, {n}, 2), got {:?}",
            k.checked_div(group_size).unwrap_or(0),
            sv.shape
        )));
    }
    let Elems::U8(q) = qv.elems() else {
        return Err(type_error("qdata: dtype must be uint8 (two int4 codes per byte)"));
    };
    let scale_zero = match sv.elems() {
        Elems::F32(s) => Scale::F32(s),
        Elems::Bf16(s) => Scale::Bf16(s),
        Elems::F16(s) => Scale::F16(s),
        _ => return Err(type_error("scale_and_zero: dtype must be float32, bfloat16 or float16")),
    };
    let w = Int4 {
        q,
        scale_zero,
        group: group_size,
        layout,
    };
    let xa = act(&xv, "x")?;
    let ba = bv.as_ref().map(|b| act(b, "bias")).transpose()?;
    let mut reads = vec![&xv, &qv, &sv];
    reads.extend(bv.as_ref());
    let mut ov = out_view(out, &reads, rows, n)?;
    let o = act_mut(&mut ov);
    let shape = Shape { rows, k, n };
    let omp = omp.then_some(num_threads);
    py.detach(|| int4::linear_int4_on(simd, omp, pool.as_deref(), shape, xa, w, ba, o))
        .map_err(err)
}

/// Whether the process has an OpenMP runtime (torch's libgomp) that `linear(..., omp=True)` runs on.
#[pyfunction]
pub fn omp_available() -> bool {
    crate::omp::available()
}
