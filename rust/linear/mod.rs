//! `y = x @ W.T * scale + bias` for a few rows of activations: the matmul of CPU-executed blocks
//! at decode (one row) up to the few tens of rows at which a prompt is better streamed.
//!
//! The weights are read in the layout they are stored and streamed in, never copied per call:
//! - bfloat16 `[out, in]`;
//! - int8 `[out, in]` with one float scale per output row (or one for the tensor): torchao's
//!   `Int8WeightOnlyConfig` (`Int8Tensor`'s `qdata` and `scale`), `w = q * scale[o]`;
//! - float8_e4m3fn `[out, in]` with its scale likewise: torchao's `Float8WeightOnlyConfig`
//!   (`Float8Tensor`'s `qdata` and `scale`), `w = float(q) * scale[o]`.
//!
//! Activations are float32 or bfloat16 rows, the output has their dtype, the bias (optional) is
//! float32 or bfloat16. Every path computes, for each output element, `dot * scale + bias` with
//! the dot product of float32 products summed in float32 (weight-only semantics: activations are
//! never quantized), then rounds once to the output dtype. Only the order of the additions differs
//! between paths: [`reference`] (the specification, and the `scalar` path) adds them one after the
//! other; the SIMD paths in lanes, then across lanes. `tests.rs` holds every path to a float64
//! reference within the bound of [`error_bound`].
//!
//! Decode reads every weight once per token, so it runs at the memory bandwidth if the conversion
//! of a weight costs less than its bytes' time. Per step of `2 W` weights (`W` float32 lanes) a
//! tile of `MR` activation rows by `NR` output rows converts each weight once and does `MR` FMAs
//! with it (`tile.rs`); the output rows are cut into blocks run in parallel on a rayon pool (the
//! caller's, sized by its argument), each block writing its own columns. The split never changes
//! a result: an output element is always computed by the same code in the same order.
//!
//! Paths (`OFFLOAD_ADAM_SIMD`, or the best one of the CPU): `scalar` ([`reference`]), `avx2`
//! (AVX2 + FMA + F16C), `avx512*` (AVX-512; on `avx512bf16*`, bfloat16 weights with bfloat16
//! activations use `vdpbf16ps`), `neon` (the portable lanes, FMA in NEON). VNNI is not used: it
//! multiplies int8 by int8, so it would need the activations quantized, which changes the result
//! (llama.cpp does that, Q8_0 activations); the weight-only dot of one row reads 1 byte per
//! 3 instructions per 16 weights on AVX-512, well under the memory's rate.
//!
//! Why this module has lanes (`vector.rs`) and a dispatch ([`linear`]'s match) of its own beside
//! the kernel's (`isa::Isa`, `kernel/path.rs`'s `dispatch`), and takes from `isa.rs` only what
//! they share: the choices ([`Simd`], its run-time check) and each path's CPU features
//! (`simd_features!`, which `tile.rs`'s paths are compiled with):
//! - the lanes do another job. The kernel's update is element-wise: every lane's result depends
//!   only on its own inputs, so it is written once over a logical block of 16 lanes in plain Rust
//!   that LLVM vectorizes (one or two registers per block), and `Isa` adds only the conversions
//!   LLVM will not make. A matmul is a reduction kept in registers: a tile holds `MR x NR`
//!   accumulators, so its lanes are the register's width (8 on AVX2, 16 on AVX-512; the tile
//!   shapes follow it: 16-lane blocks on AVX2 would need 16 registers for the 8 accumulators of
//!   a decode row alone), it needs a sum across lanes, and its conversions may reorder a row
//!   (bfloat16 as even and odd halves, fp8 as halves scaled by 2^-8) because a dot product's
//!   terms commute, which an element-wise update's cannot. Measured (one and four rows of a
//!   Llama-8B layer, 2 threads, `OFFLOAD_ADAM_SIMD=avx2`): the same tiles on the portable lanes,
//!   plain Rust compiled with the AVX2 path's features (the kernel's way), took 0.8 to 1.05 times
//!   the AVX2 lanes' time in bfloat16, 1.1 to 1.6 times in int8 and 4.7 to 19 times in fp8;
//! - the dispatch reaches another trait. A path here is `prepare` and `block` (`LinearPath`),
//!   one caller; the kernel's is six entry points generic over element types and codecs, reached
//!   through a visitor by the step and the passes; and the sets differ: here the VBMI choices run
//!   the AVX-512 paths (a matmul has no 256-entry lookups), the kernel compiles its quantized
//!   update again for them. One dispatch for both would have to be generic over the client's path
//!   trait, which Rust cannot express: it would take a visitor with one method per path in
//!   `isa.rs`, implemented by each client for each path, more code than the match it replaces.

use rayon::prelude::*;

use crate::elem::{bf16_to_f32, f16_to_f32, f32_to_bf16, Bf16, F16};
use crate::error::{Error, Result};
use crate::isa::Simd;

pub mod int4;
/// `$run::<P>(args)` with `P` the path of `$simd`: the one place a [`Simd`] becomes a path of
/// this module (`linear` and `experts` both go through it).
macro_rules! dispatch {
    ($simd:expr, $run:ident($($arg:expr),* $(,)?)) => {
        match $simd {
            Simd::Scalar => $run::<reference::Scalar>($($arg),*),
            #[cfg(target_arch = "x86_64")]
            Simd::Avx2 => $run::<tile::Avx2Path>($($arg),*),
            #[cfg(target_arch = "x86_64")]
            Simd::Avx512 | Simd::Avx512Vbmi => $run::<tile::Avx512Path>($($arg),*),
            #[cfg(target_arch = "x86_64")]
            Simd::Avx512Bf16 | Simd::Avx512Bf16Vbmi => $run::<tile::Avx512Bf16Path>($($arg),*),
            _ => $run::<tile::PortablePath>($($arg),*),
        }
    };
}

pub mod experts;
pub mod reference;
mod tile;
mod vector;

#[cfg(test)]
mod experts_tests;
#[cfg(test)]
mod test_util;
#[cfg(test)]
mod tests;

/// Rows of activations (row-major `[rows, in]`), or a bias (`[out]`).
#[derive(Clone, Copy, Debug)]
pub enum Act<'a> {
    F32(&'a [f32]),
    Bf16(&'a [Bf16]),
}

/// The output rows (row-major `[rows, out]`), in the activations' dtype.
#[derive(Debug)]
pub enum ActMut<'a> {
    F32(&'a mut [f32]),
    Bf16(&'a mut [Bf16]),
}

/// The scale of quantized weights: one per output row, or one for the whole tensor.
#[derive(Clone, Copy, Debug)]
pub enum Scale<'a> {
    F32(&'a [f32]),
    Bf16(&'a [Bf16]),
    F16(&'a [F16]),
}

/// The weights, row-major `[out, in]`, in their stored layout.
#[derive(Clone, Copy, Debug)]
pub enum Weight<'a> {
    Bf16(&'a [Bf16]),
    /// int8 weight-only: `w[o, i] = q[o, i] * scale[o]`.
    Int8 {
        q: &'a [i8],
        scale: Scale<'a>,
    },
    /// fp8 weight-only: `w[o, i] = float(q[o, i]) * scale[o]`, `q` float8_e4m3fn bit patterns.
    Fp8 {
        q: &'a [u8],
        scale: Scale<'a>,
    },
}

impl Act<'_> {
    fn len(&self) -> usize {
        match self {
            Act::F32(x) => x.len(),
            Act::Bf16(x) => x.len(),
        }
    }
    fn get(&self, i: usize) -> f32 {
        match self {
            Act::F32(x) => x[i],
            Act::Bf16(x) => bf16_to_f32(x[i].0),
        }
    }
    fn to_f32(self) -> Vec<f32> {
        match self {
            Act::F32(x) => x.to_vec(),
            Act::Bf16(x) => x.iter().map(|v| bf16_to_f32(v.0)).collect(),
        }
    }
    fn dtype(&self) -> &'static str {
        match self {
            Act::F32(_) => "float32",
            Act::Bf16(_) => "bfloat16",
        }
    }
}

impl ActMut<'_> {
    fn len(&self) -> usize {
        match self {
            ActMut::F32(x) => x.len(),
            ActMut::Bf16(x) => x.len(),
        }
    }
    fn dtype(&self) -> &'static str {
        match self {
            ActMut::F32(_) => "float32",
            ActMut::Bf16(_) => "bfloat16",
        }
    }
}

impl Scale<'_> {
    fn len(&self) -> usize {
        match self {
            Scale::F32(s) => s.len(),
            Scale::Bf16(s) => s.len(),
            Scale::F16(s) => s.len(),
        }
    }
    /// One float32 scale per output row (a tensor-wide scale repeated).
    fn per_row(&self, n: usize) -> Vec<f32> {
        let get = |i: usize| match self {
            Scale::F32(s) => s[i],
            Scale::Bf16(s) => bf16_to_f32(s[i].0),
            Scale::F16(s) => f16_to_f32(s[i].0),
        };
        if self.len() == 1 {
            vec![get(0); n]
        } else {
            (0..n).map(get).collect()
        }
    }
}

impl Weight<'_> {
    fn len(&self) -> usize {
        match self {
            Weight::Bf16(w) => w.len(),
            Weight::Int8 { q, .. } => q.len(),
            Weight::Fp8 { q, .. } => q.len(),
        }
    }
    fn scale(&self) -> Option<&Scale<'_>> {
        match self {
            Weight::Bf16(_) => None,
            Weight::Int8 { scale, .. } | Weight::Fp8 { scale, .. } => Some(scale),
        }
    }
    /// The weight `[o, i]` of a row of `k`, as a float32 (exact), without its scale.
    fn get(&self, o: usize, i: usize, k: usize) -> f32 {
        match self {
            Weight::Bf16(w) => bf16_to_f32(w[o * k + i].0),
            Weight::Int8 { q, .. } => q[o * k + i] as f32,
            Weight::Fp8 { q, .. } => crate::kernel::fp8::decode(q[o * k + i]),
        }
    }
}

/// The shape of one call: `rows` activation rows of `k` (the weights' `in`), `n` outputs per row
/// (the weights' `out`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    pub rows: usize,
    pub k: usize,
    pub n: usize,
}

/// The bound the tests hold every path to: `|y - y64| <= error_bound(..)`, where `y64` is
/// `sum(x * w) * scale + bias` in float64 and `abs_sum` is `sum(|x * w|) * |scale| + |bias|`.
/// Summing `k` float32 products in any order errs by at most `gamma_(k+1) * sum(|x * w|)`
/// (`gamma_m = m u / (1 - m u)`, `u = 2^-24`: one rounding per product, at most `k - 1` per
/// addition chain, one more across lanes counted in); the scale and the bias add two roundings.
/// A bfloat16 output then rounds once more: half an ulp, at most `2^-8 |y|`.
pub fn error_bound(k: usize, abs_sum: f64, y64: f64, bf16_out: bool) -> f64 {
    let u = f64::powi(2.0, -24);
    let m = (k + 4) as f64 * u;
    let f32_part = m / (1.0 - m) * abs_sum;
    if bf16_out {
        f32_part + (y64.abs() + f32_part) * f64::powi(2.0, -8)
    } else {
        f32_part
    }
}

/// Checks the buffers of a call against `shape`; nothing is read before this passes.
pub fn validate(shape: Shape, x: &Act<'_>, w: &Weight<'_>, bias: Option<&Act<'_>>, out: &ActMut<'_>) -> Result<()> {
    let Shape { rows, k, n } = shape;
    let want = |what: &str, got: usize, expect: Option<usize>, desc: &str| -> Result<()> {
        match expect {
            Some(e) if e == got => Ok(()),
            _ => Err(Error::Value(format!("{what}: has {got} elements, expected {desc}"))),
        }
    };
    want("x", x.len(), rows.checked_mul(k), &format!("rows * in = {rows} * {k}"))?;
    want("weight", w.len(), n.checked_mul(k), &format!("out * in = {n} * {k}"))?;
    want(
        "out",
        out.len(),
        rows.checked_mul(n),
        &format!("rows * out = {rows} * {n}"),
    )?;
    if let Some(s) = w.scale() {
        if s.len() != n && s.len() != 1 {
            return Err(Error::Value(format!(
                "scale: has {} elements, expected one per output row ({n}) or one for the tensor",
                s.len()
            )));
        }
    }
    if let Some(b) = bias {
        want("bias", b.len(), Some(n), &format!("out = {n}"))?;
    }
    if out.dtype() != x.dtype() {
        return Err(Error::Type(format!(
            "out: dtype must be the activations' ({}), got {}",
            x.dtype(),
            out.dtype()
        )));
    }
    Ok(())
}

/// The output element `(r, o)` before rounding: `(dot * factor + tail) * scale + bias`, in the
/// one order every path uses.
#[inline(always)]
fn finish(dot: f32, tail: f32, factor: f32, scale: f32, bias: f32) -> f32 {
    (dot * factor + tail) * scale + bias
}

/// What a block of output rows needs, shared by the tasks of one call.
pub(crate) struct Job<'a> {
    pub shape: Shape,
    /// The activations as given (the tails of the SIMD paths and the reference read them).
    pub x: Act<'a>,
    pub w: Weight<'a>,
    /// One float32 scale per output row (1 for bfloat16 weights).
    pub scale: Vec<f32>,
    /// One float32 bias per output row (0 without a bias).
    pub bias: Vec<f32>,
}

/// The output columns `[o0, o0 + len)` of every row: the part of the output one task writes.
pub(crate) enum OutBlock<'a> {
    F32(Vec<&'a mut [f32]>),
    Bf16(Vec<&'a mut [Bf16]>),
}

impl OutBlock<'_> {
    /// Its columns.
    pub fn len(&self) -> usize {
        match self {
            OutBlock::F32(rows) => rows.first().map_or(0, |r| r.len()),
            OutBlock::Bf16(rows) => rows.first().map_or(0, |r| r.len()),
        }
    }
    /// Writes the float32 results of one tile (`vals[r][j]`, rows `r0..`, columns `c0..` of the
    /// block), rounded to the output dtype.
    #[inline(always)]
    pub fn store<const MR: usize, const NR: usize>(&mut self, r0: usize, c0: usize, nr: usize, vals: &[[f32; NR]; MR]) {
        match self {
            OutBlock::F32(rows) => {
                for (r, v) in vals.iter().enumerate() {
                    rows[r0 + r][c0..c0 + nr].copy_from_slice(&v[..nr]);
                }
            }
            OutBlock::Bf16(rows) => {
                for (r, v) in vals.iter().enumerate() {
                    for (o, y) in rows[r0 + r][c0..c0 + nr].iter_mut().zip(v) {
                        *o = Bf16(f32_to_bf16(*y));
                    }
                }
            }
        }
    }
}

/// Cuts `[rows, n]` into per-task column blocks of `block` (the last one shorter): block `b` gets
/// `out[r][b * block..]` of every row `r`. Safe Rust: `chunks_mut` of each row.
fn column_blocks<T>(out: &mut [T], rows: usize, n: usize, block: usize) -> Vec<Vec<&mut [T]>> {
    let nblocks = n.div_ceil(block);
    let mut blocks: Vec<Vec<&mut [T]>> = (0..nblocks).map(|_| Vec::with_capacity(rows)).collect();
    if n == 0 {
        return blocks;
    }
    for row in out.chunks_mut(n).take(rows) {
        for (b, part) in row.chunks_mut(block).enumerate() {
            blocks[b].push(part);
        }
    }
    blocks
}

/// The code of one path: computes the output columns `[o0, o0 + len)` of every row.
pub(crate) trait LinearPath {
    /// Prepared activations (each path's own order and element type), made once per call.
    type Prepared: Sync;
    fn prepare(job: &Job<'_>) -> Self::Prepared;
    /// # Safety
    /// The CPU runs the path; `job`'s buffers were validated against its shape.
    unsafe fn block(job: &Job<'_>, prep: &Self::Prepared, o0: usize, out: &mut OutBlock<'_>);
}

/// Outputs per task: a multiple of every tile's rows, about four tasks per thread so that a slow
/// (shared) core does not hold up the call.
fn block_len(n: usize, threads: usize) -> usize {
    let per = n.div_ceil(threads.max(1) * 4);
    per.div_ceil(16).max(1) * 16
}

/// Checks that this CPU runs `simd`'s path (the error of every entry point of this module).
pub(crate) fn check_supported(simd: Simd) -> Result<()> {
    if simd.supported() {
        Ok(())
    } else {
        Err(Error::Value(format!(
            "SIMD path {} is not supported by this CPU",
            simd.name()
        )))
    }
}

/// `out` (`[rows, n]`) cut into tasks of `block` columns ([`column_blocks`]): each the first
/// column of its block and the block of every row, in the output's dtype.
pub(crate) fn out_tasks(out: ActMut<'_>, rows: usize, n: usize, block: usize) -> Vec<(usize, OutBlock<'_>)> {
    match out {
        ActMut::F32(o) => column_blocks(o, rows, n, block)
            .into_iter()
            .enumerate()
            .map(|(b, v)| (b * block, OutBlock::F32(v)))
            .collect(),
        ActMut::Bf16(o) => column_blocks(o, rows, n, block)
            .into_iter()
            .enumerate()
            .map(|(b, v)| (b * block, OutBlock::Bf16(v)))
            .collect(),
    }
}

/// Runs `f` once on every task: on the process's OpenMP team of `omp` threads (`crate::omp`)
/// where `omp` is given, else on `pool`; on the calling thread where there is one task, one
/// thread, or the team is not there (or busy: the call is inside a parallel region). The tasks
/// and so the bits are the same wherever they run.
pub(crate) fn run_tasks<T: Send>(
    omp: Option<usize>,
    pool: Option<&rayon::ThreadPool>,
    tasks: Vec<T>,
    f: impl Fn(T) + Sync + Send,
) {
    let n = tasks.len();
    if let Some(threads) = omp {
        // `crate::omp::run` calls by index: each task is taken once from its slot.
        let slots: Vec<std::sync::Mutex<Option<T>>> =
            tasks.into_iter().map(|t| std::sync::Mutex::new(Some(t))).collect();
        let g = |i: usize| {
            if let Some(t) = slots[i].lock().unwrap_or_else(|e| e.into_inner()).take() {
                f(t)
            }
        };
        if !(threads > 1 && n > 1 && crate::omp::run(threads, n, &g)) {
            (0..n).for_each(g);
        }
        return;
    }
    let threads = pool.map_or(1, |p| p.current_num_threads());
    match pool {
        Some(p) if threads > 1 && n > 1 => p.install(|| tasks.into_par_iter().for_each(f)),
        _ => tasks.into_iter().for_each(f),
    }
}

/// The threads a call's tasks are cut for: the OpenMP team's where it runs there, else the pool's.
pub(crate) fn task_threads(omp: Option<usize>, pool: Option<&rayon::ThreadPool>) -> usize {
    omp.unwrap_or_else(|| pool.map_or(1, |p| p.current_num_threads()))
}

fn run<P: LinearPath>(omp: Option<usize>, pool: Option<&rayon::ThreadPool>, job: &Job<'_>, out: ActMut<'_>) {
    let Shape { rows, n, .. } = job.shape;
    let block = block_len(n, task_threads(omp, pool));
    let prep = P::prepare(job);
    let tasks = out_tasks(out, rows, n, block);
    // SAFETY: `linear_on` dispatched to `P` after checking that this CPU runs it, and validated
    // the buffers against the shape.
    run_tasks(omp, pool, tasks, |(o0, mut ob): (usize, OutBlock<'_>)| unsafe {
        P::block(job, &prep, o0, &mut ob)
    });
}

/// `out = x @ W.T * scale + bias` (see the module's documentation) on `simd`'s path, on `pool`
/// (None: the calling thread). The buffers are checked first: an error writes nothing.
pub fn linear(
    simd: Simd,
    pool: Option<&rayon::ThreadPool>,
    shape: Shape,
    x: Act<'_>,
    w: Weight<'_>,
    bias: Option<Act<'_>>,
    out: ActMut<'_>,
) -> Result<()> {
    linear_on(simd, None, pool, shape, x, w, bias, out)
}

/// As [`linear`], with `omp` the threads of the process's OpenMP team (torch's intra-op threads,
/// `crate::omp`) to run the blocks on, where it has one and the call is not inside a parallel
/// region, else on `pool` as [`linear`] does (`omp` None: [`linear`]). The result is
/// [`linear`]'s, bit for bit.
#[allow(clippy::too_many_arguments)]
pub fn linear_on(
    simd: Simd,
    omp: Option<usize>,
    pool: Option<&rayon::ThreadPool>,
    shape: Shape,
    x: Act<'_>,
    w: Weight<'_>,
    bias: Option<Act<'_>>,
    out: ActMut<'_>,
) -> Result<()> {
    let omp = omp.filter(|_| crate::omp::usable());
    validate(shape, &x, &w, bias.as_ref(), &out)?;
    check_supported(simd)?;
    let job = Job {
        shape,
        x,
        w,
        scale: w.scale().map_or_else(|| vec![1.0; shape.n], |s| s.per_row(shape.n)),
        bias: bias.map_or_else(|| vec![0.0; shape.n], Act::to_f32),
    };
    if shape.rows == 0 || shape.n == 0 {
        return Ok(());
    }
    dispatch!(simd, run(omp, pool, &job, out));
    Ok(())
}
