//! The routed experts of one mixture-of-experts layer in one call: for each row `r` of
//! activations and each of its `k` routed slots `j` with an expert `u = index[r, j]` (`-1`: skip,
//! an expert computed elsewhere),
//!
//! ```text
//! out[r] = sum over valid j of weights[r, j] * down_u( act(gate) * up ),  [gate; up] = gate_up_u @ x[r]
//! ```
//!
//! with each expert's `gate_up` `[2I, H]` (gate rows first, then up rows: transformers'
//! concatenated layout, not transposed) and `down` `[H, I]` stored as [`Weight`]s (bfloat16, int8
//! or fp8 with per-row scales, read in place), `act` SiLU (Qwen3-MoE, Mixtral, DeepSeek-V3) or the
//! tanh approximation of GELU. It replaces transformers' eager per-expert loop
//! (`Qwen3MoeExperts.forward`): a linear, the activation, a product, a linear, a weighting and an
//! `index_add_` per expert, each rounded to the activations' dtype.
//!
//! The work, on the caller's pool as [`super::linear`] runs (one task per block, rayon's
//! `install`; one thread: the calling thread):
//! 1. the routing: each expert's distinct rows (a row routed twice to one expert is computed
//!    once and weighted twice), its activations gathered (none copied when every row is routed to
//!    it, as at decode);
//! 2. gate/up: tasks over (expert, block of the intermediate columns); a task computes the gate
//!    rows and the up rows of its columns with the linear kernel's path ([`LinearPath::block`]:
//!    the same tiles, formats and SIMD code) for all of the expert's rows, then
//!    `h = act(gate) * up` in float32;
//! 3. down and the weighted sum: tasks over blocks of the `H` output columns; a task computes
//!    every routed expert's down rows of its columns on `h`, then each row's weighted sum over its
//!    slots, in slot order, in float32, rounded once to the output dtype.
//!
//! Each routed expert's weights are read once per call, whatever the rows routed to it: a weight
//! row belongs to one task, and a task's weights (at most [`CACHE_BYTES`]) stay in cache while its
//! tiles take the rows four at a time. An output element is computed by the same code in the same
//! order whatever the blocks, the thread count or the other rows of the call: a row's result
//! does not depend on the batch it is in.
//!
//! # Exactness
//!
//! The intermediate stays in float32 (no rounding of `gate`, `up`, `h` or the expert outputs to
//! bfloat16, where eager rounds each): rounding it as eager does would make the result neither
//! eager's (whose dot products add in another order anyway) nor closer to the exact one; float32
//! keeps the bound small and simple, and the error of a bfloat16 layer is then one rounding of
//! the output. The bound, against the float64 evaluation of the same formula on the same inputs
//! (`g`, `v`, `a = act(g)`, `h = a v`, `y`, `o` exact; `u = 2^-24`, `gamma_m = m u / (1 - m u)`;
//! `eb(k, s)` is [`super::error_bound`]`(k, s, _, false)`, the few-row kernel's):
//! - gate and up: `e_g = eb(H, sum |x w_gate| |scale|)`, `e_v` likewise;
//! - activation: `e_a = L e_g + 8 u (|a| + |g| + (L + 1) e_g)`, `L = 1.13` bounding `|act'|`
//!   (SiLU 1.0998, GELU-tanh 1.129), `8 u (|act(t)| + |t|)` the float32 evaluation's error
//!   (SiLU `t / (1 + exp(-t))`: four roundings; GELU-tanh: its cancellation near `-t` is
//!   absolute, hence `|t|`);
//! - `h`: `e_h = e_a (|v| + e_v) + |a| e_v + u (|a| + e_a)(|v| + e_v)`;
//! - an expert's output: `e_y = eb(I, sum (|h| + e_h) |w_down| |scale|) + sum e_h |w_down| |scale|`;
//! - the weighted sum of the valid slots: `e_o = gamma_(k+1) sum |w_j| (|y_j| + e_y_j) + sum
//!   |w_j| e_y_j`; a bfloat16 output adds `2^-8 (|o| + e_o)`.
//!
//! `tests.rs`'s `experts` tests and the Python tests hold every path to it.

use super::{
    block_len, check_supported, column_blocks, out_tasks, run_tasks, task_threads, Act, ActMut, Job, LinearPath,
    OutBlock, Shape, Weight,
};
use crate::elem::{bf16_to_f32, f32_to_bf16, Bf16};
use crate::error::{Error, Result};
use crate::isa::Simd;

use super::{reference, tile};

/// Bytes of weights per task, so that a task's weights stay in a core's L2 cache while its tiles
/// take the rows four at a time (Zen 4 has 1 MiB, older Intel cores 256 KiB).
pub const CACHE_BYTES: usize = 256 << 10;

/// The activation of the gate half.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// `t / (1 + exp(-t))`: torch's `silu`.
    Silu,
    /// `0.5 t (1 + tanh(sqrt(2 / pi) (t + 0.044715 t^3)))`: torch's `gelu(approximate="tanh")`.
    GeluTanh,
}

impl Activation {
    /// The activation named `name` (`"silu"`, `"gelu_tanh"`).
    pub fn parse(name: &str) -> Result<Activation> {
        match name {
            "silu" => Ok(Activation::Silu),
            "gelu_tanh" => Ok(Activation::GeluTanh),
            _ => Err(Error::Value(format!(
                "act: must be \"silu\" or \"gelu_tanh\", got {name:?}"
            ))),
        }
    }

    /// The activation in float32.
    #[inline]
    pub fn apply(self, t: f32) -> f32 {
        match self {
            Activation::Silu => t / (1.0 + (-t).exp()),
            Activation::GeluTanh => {
                const C: f32 = 0.797_884_6; // sqrt(2 / pi)
                0.5 * t * (1.0 + (C * (t + 0.044_715 * t * t * t)).tanh())
            }
        }
    }
}

/// One expert's weights: `gate_up` `[2I, H]`, `down` `[H, I]`.
#[derive(Clone, Copy, Debug)]
pub struct Expert<'a> {
    pub gate_up: Weight<'a>,
    pub down: Weight<'a>,
}

/// The shape of a call: `rows` activation rows of `hidden` (`H`), experts of `inter` (`I`)
/// intermediate columns, `k` routed slots per row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpertsShape {
    pub rows: usize,
    pub hidden: usize,
    pub inter: usize,
    pub k: usize,
}

fn format_name(w: &Weight<'_>) -> &'static str {
    match w {
        Weight::Bf16(_) => "bfloat16",
        Weight::Int8 { .. } => "int8",
        Weight::Fp8 { .. } => "float8_e4m3fn",
    }
}

fn bytes_per_weight(w: &Weight<'_>) -> usize {
    match w {
        Weight::Bf16(_) => 2,
        _ => 1,
    }
}

/// Checks a call's buffers against `shape`; nothing is read or written before this passes.
/// Errors name the argument (`gate_up[3]`, `index`, ...).
pub fn validate(
    shape: ExpertsShape,
    x: &Act<'_>,
    experts: &[Expert<'_>],
    index: &[i64],
    weights: &Act<'_>,
    out: &ActMut<'_>,
) -> Result<()> {
    let ExpertsShape { rows, hidden, inter, k } = shape;
    let want = |what: &str, got: usize, a: usize, b: usize, desc: &str| -> Result<()> {
        match a.checked_mul(b) {
            Some(e) if e == got => Ok(()),
            _ => Err(Error::Value(format!(
                "{what}: has {got} elements, expected {desc} = {a} * {b}"
            ))),
        }
    };
    want("x", x.len(), rows, hidden, "rows * hidden")?;
    want("index", index.len(), rows, k, "rows * k")?;
    want("weights", weights.len(), rows, k, "rows * k")?;
    want("out", out.len(), rows, hidden, "rows * hidden")?;
    if out.dtype() != x.dtype() {
        return Err(Error::Type(format!(
            "out: dtype must be x's ({}), got {}",
            x.dtype(),
            out.dtype()
        )));
    }
    let two_i = inter
        .checked_mul(2)
        .ok_or_else(|| Error::Value("gate_up: too many rows".into()))?;
    for (u, e) in experts.iter().enumerate() {
        let parts = [
            (
                "gate_up",
                &e.gate_up,
                &experts[0].gate_up,
                two_i,
                hidden,
                "2 * intermediate * hidden",
            ),
            (
                "down",
                &e.down,
                &experts[0].down,
                hidden,
                inter,
                "hidden * intermediate",
            ),
        ];
        for (name, w, first, n, k_in, desc) in parts {
            if format_name(w) != format_name(first) {
                return Err(Error::Type(format!(
                    "{name}[{u}]: is {}, {name}[0] is {}: the experts of a call share one format",
                    format_name(w),
                    format_name(first)
                )));
            }
            want(&format!("{name}[{u}]"), w.len(), n, k_in, desc)?;
            if let Some(s) = w.scale() {
                if s.len() != n && s.len() != 1 {
                    return Err(Error::Value(format!(
                        "{name}_scale[{u}]: has {} elements, expected one per output row ({n}) or one for the tensor",
                        s.len()
                    )));
                }
            }
        }
    }
    let n = experts.len() as i64;
    if let Some(p) = index.iter().position(|&v| v < -1 || v >= n) {
        return Err(Error::Value(format!(
            "index: {} at ({}, {}) is outside [0, {n}) (the experts given) and not -1 (skip)",
            index[p],
            p / k.max(1),
            p % k.max(1)
        )));
    }
    Ok(())
}

/// Activation rows gathered for one expert (or borrowed: every row routed to it).
enum Rows<'a> {
    All(Act<'a>),
    F32(Vec<f32>),
    Bf16(Vec<Bf16>),
}

impl Rows<'_> {
    fn act(&self) -> Act<'_> {
        match self {
            Rows::All(x) => *x,
            Rows::F32(v) => Act::F32(v),
            Rows::Bf16(v) => Act::Bf16(v),
        }
    }
}

/// Who is routed where: the experts with rows (ascending), each one's distinct rows (ascending),
/// and for each slot `(r, j)` the routed expert's number among them and the row's position in its
/// rows.
struct Routing {
    active: Vec<usize>,
    rows: Vec<Vec<usize>>,
    slot: Vec<Option<(usize, usize)>>,
}

fn routing(shape: ExpertsShape, n_experts: usize, index: &[i64]) -> Routing {
    let k = shape.k;
    let mut rows: Vec<Vec<usize>> = vec![Vec::new(); n_experts];
    let mut pos = vec![None; index.len()];
    for (i, &v) in index.iter().enumerate() {
        if v < 0 {
            continue;
        }
        let (r, u) = (i / k, v as usize);
        if rows[u].last() != Some(&r) {
            rows[u].push(r);
        }
        pos[i] = Some((u, rows[u].len() - 1));
    }
    let mut number = vec![usize::MAX; n_experts];
    let mut active = Vec::new();
    for (u, r) in rows.iter().enumerate() {
        if !r.is_empty() {
            number[u] = active.len();
            active.push(u);
        }
    }
    let slot = pos.into_iter().map(|p| p.map(|(u, q)| (number[u], q))).collect();
    let rows = active.iter().map(|&u| std::mem::take(&mut rows[u])).collect();
    Routing { active, rows, slot }
}

/// Columns per task: a multiple of 16 (every tile's), about four tasks per thread for one
/// expert, and at most [`CACHE_BYTES`] of weights for `bytes_per_col` bytes a column.
fn cols_per_task(n: usize, threads: usize, bytes_per_col: usize) -> usize {
    let fit = (CACHE_BYTES / bytes_per_col.max(1)) / 16 * 16;
    block_len(n, threads).min(fit.max(16))
}

/// The linear kernel's job of `rows` rows of `k` against `w` (`[n, k]`), no bias.
fn job<'a>(rows: usize, x: Act<'a>, w: Weight<'a>, k: usize, n: usize) -> Job<'a> {
    Job {
        shape: Shape { rows, k, n },
        x,
        w,
        scale: w.scale().map_or_else(|| vec![1.0; n], |s| s.per_row(n)),
        bias: vec![0.0; n],
    }
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn run<P: LinearPath>(
    omp: Option<usize>,
    pool: Option<&rayon::ThreadPool>,
    shape: ExpertsShape,
    x: Act<'_>,
    experts: &[Expert<'_>],
    index: &[i64],
    weights: &[f32],
    act: Activation,
    out: ActMut<'_>,
) {
    let ExpertsShape { rows, hidden, inter, k } = shape;
    let threads = task_threads(omp, pool);
    let route = routing(shape, experts.len(), index);
    let gathered: Vec<Rows<'_>> = route
        .rows
        .iter()
        .map(|rs| {
            if rs.len() == rows {
                return Rows::All(x);
            }
            let pick = |r: &usize| r * hidden..(r + 1) * hidden;
            match x {
                Act::F32(v) => Rows::F32(rs.iter().flat_map(|r| v[pick(r)].iter().copied()).collect()),
                Act::Bf16(v) => Rows::Bf16(rs.iter().flat_map(|r| v[pick(r)].iter().copied()).collect()),
            }
        })
        .collect();
    // Gate/up and the activation: h[a] is [rows of a, I] in float32.
    let gjobs: Vec<Job<'_>> = (0..route.active.len())
        .map(|a| {
            job(
                route.rows[a].len(),
                gathered[a].act(),
                experts[route.active[a]].gate_up,
                hidden,
                2 * inter,
            )
        })
        .collect();
    let gpreps: Vec<P::Prepared> = gjobs.iter().map(P::prepare).collect();
    let mut h: Vec<Vec<f32>> = route.rows.iter().map(|rs| vec![0.0f32; rs.len() * inter]).collect();
    let gate_bytes = experts.first().map_or(1, |e| bytes_per_weight(&e.gate_up));
    let block = cols_per_task(inter, threads, 2 * hidden * gate_bytes);
    let mut tasks = Vec::new();
    for (a, ha) in h.iter_mut().enumerate() {
        let n_rows = route.rows[a].len();
        for (b, cols) in column_blocks(ha, n_rows, inter, block).into_iter().enumerate() {
            tasks.push((a, b * block, cols));
        }
    }
    run_tasks(omp, pool, tasks, |(a, c0, cols): (usize, usize, Vec<&mut [f32]>)| {
        let len = cols.first().map_or(0, |c| c.len());
        let mut gate = OutBlock::F32(cols);
        let mut up_buf = vec![0.0f32; gjobs[a].shape.rows * len];
        let mut up = OutBlock::F32(up_buf.chunks_mut(len.max(1)).collect());
        // SAFETY: `experts` dispatched to `P` after checking that this CPU runs it; `validate`
        // checked the weights against the shape, the job's rows are the gathered ones, and the
        // blocks (columns `c0..c0 + len` and `I + c0..`) lie within `2I`.
        unsafe {
            P::block(&gjobs[a], &gpreps[a], c0, &mut gate);
            P::block(&gjobs[a], &gpreps[a], inter + c0, &mut up);
        }
        let (OutBlock::F32(gate), OutBlock::F32(up)) = (gate, up) else {
            unreachable!("float32 blocks")
        };
        for (g, v) in gate.into_iter().zip(up) {
            for (g, v) in g.iter_mut().zip(v.iter()) {
                *g = act.apply(*g) * *v;
            }
        }
    });
    // Down and the weighted sum, per block of output columns.
    let djobs: Vec<Job<'_>> = (0..route.active.len())
        .map(|a| {
            job(
                route.rows[a].len(),
                Act::F32(&h[a]),
                experts[route.active[a]].down,
                inter,
                hidden,
            )
        })
        .collect();
    let dpreps: Vec<P::Prepared> = djobs.iter().map(P::prepare).collect();
    let down_bytes = experts.first().map_or(1, |e| bytes_per_weight(&e.down));
    let block = cols_per_task(hidden, threads, inter * down_bytes);
    let tasks = out_tasks(out, rows, hidden, block);
    run_tasks(omp, pool, tasks, |(c0, mut cols): (usize, OutBlock<'_>)| {
        let len = match &cols {
            OutBlock::F32(c) => c.first().map_or(0, |c| c.len()),
            OutBlock::Bf16(c) => c.first().map_or(0, |c| c.len()),
        };
        let ys: Vec<Vec<f32>> = djobs
            .iter()
            .zip(&dpreps)
            .map(|(j, p)| {
                let mut y = vec![0.0f32; j.shape.rows * len];
                let mut ob = OutBlock::F32(y.chunks_mut(len.max(1)).collect());
                // SAFETY: as for gate/up; columns `c0..c0 + len` lie within `H`.
                unsafe { P::block(j, p, c0, &mut ob) };
                y
            })
            .collect();
        let mut acc = vec![0.0f32; len];
        for r in 0..rows {
            acc.iter_mut().for_each(|v| *v = 0.0);
            for j in 0..k {
                if let Some((a, p)) = route.slot[r * k + j] {
                    let w = weights[r * k + j];
                    for (s, y) in acc.iter_mut().zip(&ys[a][p * len..(p + 1) * len]) {
                        *s += w * *y;
                    }
                }
            }
            match &mut cols {
                OutBlock::F32(c) => c[r].copy_from_slice(&acc),
                OutBlock::Bf16(c) => {
                    for (o, s) in c[r].iter_mut().zip(&acc) {
                        *o = Bf16(f32_to_bf16(*s));
                    }
                }
            }
        }
    });
}

/// `out = ` the routed experts' weighted sum (see the module's documentation) on `simd`'s path,
/// on `pool` (None: the calling thread). Everything is checked first: an error writes nothing.
#[allow(clippy::too_many_arguments)]
pub fn experts(
    simd: Simd,
    pool: Option<&rayon::ThreadPool>,
    shape: ExpertsShape,
    x: Act<'_>,
    experts: &[Expert<'_>],
    index: &[i64],
    weights: Act<'_>,
    act: Activation,
    out: ActMut<'_>,
) -> Result<()> {
    experts_on(simd, None, pool, shape, x, experts, index, weights, act, out)
}

/// As [`experts`], its tasks run on the process's OpenMP team of `omp` threads (torch's intra-op
/// threads, `crate::omp`) where it has one and the call is not inside a parallel region, else on
/// `pool`: inside a model, torch's spinning OpenMP workers and the pool's threads then do not
/// compete for the cores between the layer's operations. The result is [`experts`]', bit for bit
/// (the same tasks, wherever they run).
#[allow(clippy::too_many_arguments)]
pub fn experts_on(
    simd: Simd,
    omp: Option<usize>,
    pool: Option<&rayon::ThreadPool>,
    shape: ExpertsShape,
    x: Act<'_>,
    experts: &[Expert<'_>],
    index: &[i64],
    weights: Act<'_>,
    act: Activation,
    out: ActMut<'_>,
) -> Result<()> {
    let omp = omp.filter(|_| crate::omp::usable());
    validate(shape, &x, experts, index, &weights, &out)?;
    check_supported(simd)?;
    if shape.rows == 0 || shape.hidden == 0 {
        return Ok(());
    }
    let w: Vec<f32> = match weights {
        Act::F32(w) => w.to_vec(),
        Act::Bf16(w) => w.iter().map(|v| bf16_to_f32(v.0)).collect(),
    };
    dispatch!(simd, run(omp, pool, shape, x, experts, index, &w, act, out));
    Ok(())
}
