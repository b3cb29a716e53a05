//! Module-level functions: the kernel without an optimizer around it (tests, benchmarks), the
//! gradient reductions, host-side gradient accumulation, and the SIMD path in use.

use pyo3::prelude::*;

use super::convert::{err, hyper, pool, simd_or_default, type_error, value_error};
use super::dlpack::{carve_sets, DType, Import, Writable};
use crate::isa::Simd;
use crate::kernel::{self, fp8, q8, Consts, GradRef, HostMut, OutMut, Segment, StateMut};
use crate::layout::overlaps;

/// Imports read-only host tensors (the reductions' inputs).
fn import_all(tensors: &Bound<'_, PyAny>) -> PyResult<Vec<Import>> {
    tensors
        .try_iter()?
        .enumerate()
        .map(|(i, t)| Import::new(&t?, &format!("tensors[{i}]")))
        .collect()
}

/// Runs `f` on read-only views of `tensors`.
fn with_grads<R>(tensors: &Bound<'_, PyAny>, f: impl FnOnce(&[GradRef<'_>]) -> R) -> PyResult<R> {
    let imports = import_all(tensors)?;
    let n = imports.len();
    let mut w = Writable::new(
        imports
            .into_iter()
            .enumerate()
            .map(|(i, b)| (Some(b), format!("tensors[{i}]")))
            .collect(),
    )
    .map_err(|e| value_error(format!("{e} (the tensors of one call must not overlap)")))?;
    let (mut carved, _) = carve_sets(vec![&mut w])?;
    let refs: Vec<GradRef<'_>> = carved
        .pop()
        .unwrap_or_default()
        .into_iter()
        .take(n)
        .enumerate()
        .map(|(i, h)| h.expect("imported").into_grad(&format!("tensors[{i}]")))
        .collect::<crate::error::Result<_>>()
        .map_err(err)?;
    Ok(f(&refs))
}

/// Sum of squares of every element of `tensors` (float32/bfloat16/float16, host memory),
/// accumulated in float64; deterministic for any number of threads.
#[pyfunction]
#[pyo3(signature = (tensors, *, num_threads=1, simd=None))]
pub fn grad_sq_norm(
    py: Python<'_>,
    tensors: &Bound<'_, PyAny>,
    num_threads: usize,
    simd: Option<&str>,
) -> PyResult<f64> {
    let simd = simd_or_default(simd)?;
    let pool = pool(num_threads)?;
    with_grads(tensors, |refs| {
        py.detach(|| kernel::grad_sq_norm(simd, pool.as_deref(), refs))
    })?
    .map_err(err)
}

/// Whether any element of `tensors` is an infinity or a NaN. Reads only.
#[pyfunction]
#[pyo3(signature = (tensors, *, num_threads=1, simd=None))]
pub fn grads_nonfinite(
    py: Python<'_>,
    tensors: &Bound<'_, PyAny>,
    num_threads: usize,
    simd: Option<&str>,
) -> PyResult<bool> {
    let simd = simd_or_default(simd)?;
    let pool = pool(num_threads)?;
    with_grads(tensors, |refs| {
        py.detach(|| kernel::grads_nonfinite(simd, pool.as_deref(), refs))
    })?
    .map_err(err)
}

/// `dst += src`, element by element, computed in fp32 and rounded to `dst`'s dtype (as torch adds
/// a gradient into an existing one). Both are host tensors of the same length.
#[pyfunction]
#[pyo3(signature = (dst, src, *, num_threads=1))]
pub fn grad_accumulate(
    py: Python<'_>,
    dst: &Bound<'_, PyAny>,
    src: &Bound<'_, PyAny>,
    num_threads: usize,
) -> PyResult<()> {
    let pool = pool(num_threads)?;
    let d = Import::new(dst, "dst")?;
    let s = Import::new(src, "src")?;
    if !d.contiguous || !s.contiguous {
        return Err(value_error("dst and src must be contiguous"));
    }
    let mut w = Writable::new(vec![(Some(d), "dst".into()), (Some(s), "src".into())])?;
    let (mut carved, _) = carve_sets(vec![&mut w])?;
    let mut bufs = carved.pop().expect("one set");
    let src = bufs[1].take().expect("imported").into_grad("src").map_err(err)?;
    let dst = bufs[0].take().expect("imported");
    py.detach(|| kernel::accumulate(pool.as_deref(), dst, src)).map_err(err)
}

/// One fused update of flat host tensors, in place: the kernel without the optimizer around it
/// (tests and benchmarks). `step` is the step count after this update (>= 1).
#[pyfunction]
#[pyo3(signature = (param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq=None, out=None, *, step, lr=1e-3,
    betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, decoupled=true, amsgrad=false, maximize=false,
    bias_correction=true, grad_scale=1.0, num_threads=1, simd=None))]
pub fn adam_update(
    py: Python<'_>,
    param: &Bound<'_, PyAny>,
    grad: &Bound<'_, PyAny>,
    exp_avg: &Bound<'_, PyAny>,
    exp_avg_sq: &Bound<'_, PyAny>,
    max_exp_avg_sq: Option<&Bound<'_, PyAny>>,
    out: Option<&Bound<'_, PyAny>>,
    step: u64,
    lr: f64,
    betas: (f64, f64),
    eps: f64,
    weight_decay: f64,
    decoupled: bool,
    amsgrad: bool,
    maximize: bool,
    bias_correction: bool,
    grad_scale: f64,
    num_threads: usize,
    simd: Option<&str>,
) -> PyResult<()> {
    let simd = simd_or_default(simd)?;
    let pool = pool(num_threads)?;
    if step == 0 {
        return Err(value_error("step: must be >= 1 (the count after this update)"));
    }
    let hyper_tuple = (lr, betas.0, betas.1, eps, weight_decay, decoupled, amsgrad, maximize);
    let h = hyper(hyper_tuple, "adam_update", grad_scale, bias_correction)?;
    let p = Import::new(param, "param")?;
    p.require(DType::F32, "param")?;
    let n = p.len;
    let g = Import::new(grad, "grad")?;
    let named: Vec<(Import, &str)> = [
        Some((p, "param")),
        Some((Import::new(exp_avg, "exp_avg")?, "exp_avg")),
        Some((Import::new(exp_avg_sq, "exp_avg_sq")?, "exp_avg_sq")),
        max_exp_avg_sq
            .map(|x| Import::new(x, "max_exp_avg_sq").map(|i| (i, "max_exp_avg_sq")))
            .transpose()?,
        out.map(|o| Import::new(o, "out").map(|i| (i, "out"))).transpose()?,
    ]
    .into_iter()
    .flatten()
    .collect();
    if amsgrad && max_exp_avg_sq.is_none() {
        return Err(value_error("max_exp_avg_sq: required with amsgrad=True"));
    }
    for (b, what) in named.iter().map(|(b, w)| (b, *w)).chain([(&g, "grad")]) {
        if b.len != n {
            return Err(value_error(format!("{what}: has {} elements, param {n}", b.len)));
        }
        if !b.contiguous {
            return Err(value_error(format!("{what}: must be contiguous")));
        }
        match what {
            "out" if b.dtype == DType::F32 => return Err(type_error("out: dtype must be bfloat16 or float16")),
            "exp_avg" | "exp_avg_sq" | "max_exp_avg_sq" if b.dtype == DType::F16 => {
                return Err(type_error(format!("{what}: state dtype must be float32 or bfloat16")))
            }
            _ => {}
        }
    }
    let has_x = max_exp_avg_sq.is_some();
    let has_out = out.is_some();
    let mut entries: Vec<(Option<Import>, String)> = named.into_iter().map(|(b, w)| (Some(b), w.to_string())).collect();
    if !has_x {
        entries.insert(3, (None, "max_exp_avg_sq".into()));
    }
    if !has_out {
        entries.push((None, "out".into()));
    }
    let mut w = Writable::new(entries)?;
    let mut r = Writable::new(vec![(Some(g), "grad".into())])?;
    if let Some(&(lo, hi)) = r.ranges().first() {
        if overlaps(w.ranges(), lo, hi) {
            return Err(value_error("grad: shares memory with a buffer the kernel writes"));
        }
    }
    let (mut carved, _) = carve_sets(vec![&mut w])?;
    let mut bufs = carved.pop().expect("one set");
    let (mut rc, _) = carve_sets(vec![&mut r])?;
    let grad = rc
        .pop()
        .expect("one set")
        .pop()
        .flatten()
        .expect("imported")
        .into_grad("grad")
        .map_err(err)?;
    fn state(b: Option<HostMut<'_>>) -> Option<StateMut<'_>> {
        match b {
            Some(HostMut::Bf16(s)) => Some(StateMut::Bf16(s)),
            Some(HostMut::F32(s)) => Some(StateMut::F32(s)),
            _ => None,
        }
    }
    let seg = Segment {
        consts: Consts::new(&h, step),
        amsgrad,
        param: match bufs[0].take() {
            Some(HostMut::F32(s)) => s,
            _ => unreachable!("param checked float32"),
        },
        grad,
        exp_avg: state(bufs[1].take()).expect("imported"),
        exp_avg_sq: state(bufs[2].take()).expect("imported"),
        max_exp_avg_sq: state(bufs[3].take()),
        out: match bufs[4].take() {
            Some(HostMut::Bf16(s)) => OutMut::Bf16(s),
            Some(HostMut::F16(s)) => OutMut::F16(s),
            _ => OutMut::None,
        },
        kahan: None,
    };
    py.detach(|| kernel::adam_step(simd, pool.as_deref(), vec![seg]))
        .map_err(err)
}

/// The SIMD path used when none is named (`OFFLOAD_ADAM_SIMD`, else the best this CPU has).
#[pyfunction]
pub fn simd_path() -> PyResult<&'static str> {
    Ok(simd_or_default(None)?.name())
}

/// The SIMD paths this CPU can run, best last.
#[pyfunction]
pub fn simd_paths() -> Vec<&'static str> {
    Simd::available().into_iter().map(|s| s.name()).collect()
}

/// The imports of a quantize/dequantize call: contiguous, of the given dtypes, not overlapping.
fn codec_buffers(tensors: [(&Bound<'_, PyAny>, &str, DType); 3]) -> PyResult<Writable> {
    let mut entries = Vec::with_capacity(3);
    for (t, name, dtype) in tensors {
        let imp = Import::contiguous(t, name)?;
        imp.require(dtype, name)?;
        entries.push((Some(imp), name.to_string()));
    }
    Writable::new(entries)
}

fn check_blocks(n: usize, codes: usize, absmax: usize) -> PyResult<()> {
    if !n.is_multiple_of(kernel::QBLOCK) || codes != n || absmax != n / kernel::QBLOCK {
        return Err(value_error(format!(
            "codes and absmax: {n} elements need {n} codes and {} absmax values (whole blocks of {}), got {codes} and {absmax}",
            n / kernel::QBLOCK,
            kernel::QBLOCK
        )));
    }
    Ok(())
}

fn map_of(signed: bool) -> &'static q8::Map {
    if signed {
        q8::signed()
    } else {
        q8::unsigned()
    }
}

/// Block-quantizes float32 `src` (whole blocks of `QBLOCK` elements) into `codes` (uint8) and
/// `absmax` (float32, one per block), as a step stores a moment: the signed map (`exp_avg`) or
/// the unsigned one (`exp_avg_sq`, `max_exp_avg_sq`); with `fp8`, float8_e4m3fn codes (their
/// bytes) and one scale per block, for every moment.
#[pyfunction]
#[pyo3(signature = (src, codes, absmax, *, signed, fp8=false))]
pub fn quantize(
    py: Python<'_>,
    src: &Bound<'_, PyAny>,
    codes: &Bound<'_, PyAny>,
    absmax: &Bound<'_, PyAny>,
    signed: bool,
    fp8: bool,
) -> PyResult<()> {
    let mut w = codec_buffers([
        (src, "src", DType::F32),
        (codes, "codes", DType::U8),
        (absmax, "absmax", DType::F32),
    ])?;
    let (mut carved, _) = carve_sets(vec![&mut w])?;
    let mut b = carved.pop().expect("one set");
    match (b[0].take(), b[1].take(), b[2].take()) {
        (Some(HostMut::F32(x)), Some(HostMut::U8(c)), Some(HostMut::F32(s))) => {
            check_blocks(x.len(), c.len(), s.len())?;
            if fp8 {
                py.detach(|| q8::quantize(&fp8::FP8, x, c, s));
            } else {
                py.detach(|| q8::quantize(map_of(signed), x, c, s));
            }
            Ok(())
        }
        _ => unreachable!("dtypes checked"),
    }
}

/// The float32 values of block-quantized `codes` and `absmax` (with `fp8`: fp8 codes' bytes and
/// scales) into `out`.
#[pyfunction]
#[pyo3(signature = (codes, absmax, out, *, signed, fp8=false))]
pub fn dequantize(
    py: Python<'_>,
    codes: &Bound<'_, PyAny>,
    absmax: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    signed: bool,
    fp8: bool,
) -> PyResult<()> {
    let mut w = codec_buffers([
        (codes, "codes", DType::U8),
        (absmax, "absmax", DType::F32),
        (out, "out", DType::F32),
    ])?;
    let (mut carved, _) = carve_sets(vec![&mut w])?;
    let mut b = carved.pop().expect("one set");
    match (b[0].take(), b[1].take(), b[2].take()) {
        (Some(HostMut::U8(c)), Some(HostMut::F32(s)), Some(HostMut::F32(x))) => {
            check_blocks(x.len(), c.len(), s.len())?;
            if fp8 {
                py.detach(|| q8::dequantize(&fp8::FP8, c, s, x));
            } else {
                py.detach(|| q8::dequantize(map_of(signed), c, s, x));
            }
            Ok(())
        }
        _ => unreachable!("dtypes checked"),
    }
}

/// The 256 values of the signed or unsigned 8-bit map, increasing.
#[pyfunction]
#[pyo3(signature = (*, signed))]
pub fn qmap(signed: bool) -> Vec<f32> {
    map_of(signed).q.to_vec()
}
