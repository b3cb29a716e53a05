//! int4 weight-only weights, two per byte, with a float scale and zero point per group of `in`:
//! torchao's CPU int4 format (`Int4OpaqueTensor`, made by `PrototypeInt4WeightOnlyConfig`), read
//! as its packed bytes. Its arithmetic is torch's `_weight_int4pack_mm_for_cpu` (tinygemm):
//!
//! `w[o, i] = (q[o, i] - 8) * s[g, o] + z[g, o]`, `g = i / group`, `q` in `0..16`,
//!
//! and `y = x @ w.T + bias`, activations never quantized. `scale_and_zero` is `[in / group, out,
//! 2]` (scale, then zero point) in float32, bfloat16 or float16.
//!
//! The bytes are laid out as torch's `_convert_weight_to_int4pack_for_cpu` packs them, which
//! depends on the CPU capability torch runs with ([`Int4Layout`]): the outputs in blocks of
//! `block_n`, each block `[in, block_n / 2]` bytes (`in`-major); within a full block of the
//! `avx512` layout byte `d < 16` holds output `d` (low nibble) and `d + 32` (high), byte `16 + d`
//! outputs `16 + d` and `48 + d`; of the `avx2` layout byte `d` outputs `d` and `d + 16`;
//! elsewhere (the `default` layout, and every last block shorter than `block_n`) byte `j / 2`
//! holds output `j` (low nibble for even `j`). `out` is a multiple of 16, as torch packs it.
//!
//! Paths. [`reference`] (the `scalar` path): each weight as above in float32 (`(q - 8) * s`, then
//! `+ z`), the products added in order, then `+ bias`, rounded once. The others sum each group
//! first: `A = sum(x * (q - 8))` and `X = sum(x)` over the group, then `y += s * A; y += z * X`
//! (the scale and zero point once per group, not per weight). The portable path does so in plain
//! Rust, compiled with each x86 path's features; on AVX-512 BF16 with VBMI, bfloat16 activations
//! against full blocks of the `avx512` layout take `vdpbf16ps`: a `vpermb` puts the bytes of two
//! consecutive `in` side by side, a `vpermw` of a 32-entry table gives `q - 8` as bfloat16
//! (exact), and each 32-bit lane adds its two exact products (`x[i] (q[i] - 8) + x[i+1] (q[i+1]
//! - 8)`); 128 weights take one load, one `vpermb`, three shifts, four `vpermw` and four
//! `vdpbf16ps`.
//!
//! The bound ([`int4_error_bound`]): every path is within `gamma_(in + group + 4) * (sum_i |x_i|
//! (|q_i - 8| |s| + |z|) + |bias|)` of the exact result (plus half a bfloat16 ulp for bfloat16
//! outputs): a weight of the reference rounds twice, a product once, `in - 1` additions and the
//! bias once more; a grouped sum rounds at most `group` times in a group, `2 in / group` times
//! across groups and once for the bias. (`vdpbf16ps` flushes subnormal inputs to zero, as the
//! bfloat16 weights' path of the kernel does.)

use super::{check_supported, error_bound, out_tasks, run_tasks, task_threads, Act, ActMut, OutBlock, Scale, Shape};
use crate::elem::{bf16_to_f32, f16_to_f32};
use crate::error::{Error, Result};
use crate::isa::Simd;

/// How torch packed the bytes: the CPU capability it ran with (`torch.backends.cpu.
/// get_cpu_capability()`: `AVX512`, `AVX2`, or `DEFAULT`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Int4Layout {
    Avx512,
    Avx2,
    Default,
}

impl Int4Layout {
    /// From torch's name of the capability (case-insensitive).
    pub fn parse(s: &str) -> Option<Int4Layout> {
        match s.to_ascii_lowercase().as_str() {
            "avx512" => Some(Int4Layout::Avx512),
            "avx2" => Some(Int4Layout::Avx2),
            "default" => Some(Int4Layout::Default),
            _ => None,
        }
    }
    /// Outputs per block.
    pub fn block_n(self) -> usize {
        match self {
            Int4Layout::Avx512 => 64,
            _ => 32,
        }
    }
    /// `(byte in a block's row, high nibble)` of output `j` of a block of `nb` outputs.
    #[inline(always)]
    pub fn locate(self, nb: usize, j: usize) -> (usize, bool) {
        match (self, nb) {
            (Int4Layout::Avx512, 64) => (j % 32, j >= 32),
            (Int4Layout::Avx2, 32) => (j % 16, j >= 16),
            _ => (j / 2, j % 2 == 1),
        }
    }
}

/// int4 weights as torch packs them (see the module's documentation).
#[derive(Clone, Copy, Debug)]
pub struct Int4<'a> {
    /// `out * in / 2` bytes.
    pub q: &'a [u8],
    /// `[in / group, out, 2]`: scale, zero point.
    pub scale_zero: Scale<'a>,
    pub group: usize,
    pub layout: Int4Layout,
}

#[inline(always)]
fn scale_get(s: &Scale<'_>, i: usize) -> f32 {
    match s {
        Scale::F32(s) => s[i],
        Scale::Bf16(s) => bf16_to_f32(s[i].0),
        Scale::F16(s) => f16_to_f32(s[i].0),
    }
}

impl Int4<'_> {
    /// The code `q[o, i]` (0..16) of a `[n, k]` weight.
    pub fn code(&self, o: usize, i: usize, k: usize, n: usize) -> u8 {
        let bn = self.layout.block_n();
        let b0 = o / bn * bn;
        let nb = bn.min(n - b0);
        let (byte, hi) = self.layout.locate(nb, o - b0);
        let v = self.q[b0 * k / 2 + i * nb / 2 + byte];
        if hi {
            v >> 4
        } else {
            v & 15
        }
    }
    /// `(scale, zero point)` of weight `[o, i]`.
    pub fn scale_zero(&self, o: usize, i: usize, n: usize) -> (f32, f32) {
        let j = (i / self.group * n + o) * 2;
        (scale_get(&self.scale_zero, j), scale_get(&self.scale_zero, j + 1))
    }
    /// The weight `[o, i]` as the reference computes it: `(q - 8) * s + z` in float32.
    pub fn get(&self, o: usize, i: usize, k: usize, n: usize) -> f32 {
        let (s, z) = self.scale_zero(o, i, n);
        (self.code(o, i, k, n) as f32 - 8.0) * s + z
    }
}

/// The bound every path is held to: `|y - y64| <= int4_error_bound(..)`, `y64` the exact result
/// (float64) and `abs_sum` `sum_i |x_i| (|q_i - 8| |s| + |z|) + |bias|` (module documentation).
pub fn int4_error_bound(k: usize, group: usize, abs_sum: f64, y64: f64, bf16_out: bool) -> f64 {
    error_bound(k + group, abs_sum, y64, bf16_out)
}

/// Checks a call's buffers; nothing is read before this passes.
pub fn validate(shape: Shape, x: &Act<'_>, w: &Int4<'_>, bias: Option<&Act<'_>>, out: &ActMut<'_>) -> Result<()> {
    let Shape { rows, k, n } = shape;
    let bad = |m: String| Err(Error::Value(m));
    if w.group < 2 || !w.group.is_multiple_of(2) {
        return bad(format!("group_size: must be even and at least 2, got {}", w.group));
    }
    if k % w.group != 0 {
        return bad(format!("group_size: {} does not divide in ({k})", w.group));
    }
    if n % 16 != 0 {
        return bad(format!(
            "weight: out ({n}) must be a multiple of 16 (torch packs int4 in blocks of 16 to 64 outputs)"
        ));
    }
    if Some(x.len()) != rows.checked_mul(k) {
        return bad(format!(
            "x: has {} elements, expected rows * in = {rows} * {k}",
            x.len()
        ));
    }
    if Some(w.q.len()) != n.checked_mul(k).map(|v| v / 2) {
        return bad(format!(
            "weight: has {} bytes, expected out * in / 2 = {n} * {k} / 2",
            w.q.len()
        ));
    }
    let want = (k / w.group).checked_mul(n).and_then(|v| v.checked_mul(2));
    if Some(w.scale_zero.len()) != want {
        return bad(format!(
            "scale_and_zero: has {} elements, expected in / group_size * out * 2 = {} * {n} * 2",
            w.scale_zero.len(),
            k / w.group
        ));
    }
    if let Some(b) = bias {
        if b.len() != n {
            return bad(format!("bias: has {} elements, expected out = {n}", b.len()));
        }
    }
    if Some(out.len()) != rows.checked_mul(n) {
        return bad(format!(
            "out: has {} elements, expected rows * out = {rows} * {n}",
            out.len()
        ));
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

/// What every task of a call reads.
pub(crate) struct Job<'a> {
    shape: Shape,
    x: Act<'a>,
    w: Int4<'a>,
    bias: Vec<f32>,
    /// The activations in float32 (the grouped paths), `[rows, in]`.
    x32: Vec<f32>,
    /// `sum(x)` over each group, `[rows, in / group]`, added in order.
    xsum: Vec<f32>,
}

impl<'a> Job<'a> {
    fn new(shape: Shape, x: Act<'a>, w: Int4<'a>, bias: Option<Act<'a>>, simd: Simd) -> Job<'a> {
        let Shape { rows, k, n } = shape;
        let bias = bias.map_or_else(|| vec![0.0; n], Act::to_f32);
        if simd == Simd::Scalar {
            return Job {
                shape,
                x,
                w,
                bias,
                x32: Vec::new(),
                xsum: Vec::new(),
            };
        }
        let x32 = x.to_f32();
        let groups = k / w.group;
        let mut xsum = vec![0.0f32; rows * groups];
        for r in 0..rows {
            for g in 0..groups {
                let mut s = 0.0f32;
                for v in &x32[r * k + g * w.group..][..w.group] {
                    s += v;
                }
                xsum[r * groups + g] = s;
            }
        }
        Job {
            shape,
            x,
            w,
            bias,
            x32,
            xsum,
        }
    }
}

/// The `scalar` path: the reference's order (module documentation).
pub(crate) fn reference(job: &Job<'_>, o0: usize, out: &mut OutBlock<'_>) {
    let Shape { rows, k, n } = job.shape;
    for r in 0..rows {
        for c in 0..out.len() {
            let o = o0 + c;
            let mut s = 0.0f32;
            for i in 0..k {
                s += job.x.get(r * k + i) * job.w.get(o, i, k, n);
            }
            out.store::<1, 1>(r, c, 1, &[[s + job.bias[o]]]);
        }
    }
}

/// `acc[j] += x * (q_j - 8)` over one row of `in` of a block of `nb` outputs, `row` its bytes.
#[inline(always)]
fn add_row(layout: Int4Layout, nb: usize, row: &[u8], x: f32, acc: &mut [f32; 64]) {
    let lo = |v: u8| ((v & 15) as i32 - 8) as f32;
    let hi = |v: u8| ((v >> 4) as i32 - 8) as f32;
    match (layout, nb) {
        (Int4Layout::Avx512, 64) => {
            let row: &[u8; 32] = row[..32].try_into().unwrap();
            for d in 0..32 {
                acc[d] += x * lo(row[d]);
                acc[32 + d] += x * hi(row[d]);
            }
        }
        (Int4Layout::Avx2, 32) => {
            let row: &[u8; 16] = row[..16].try_into().unwrap();
            for d in 0..16 {
                acc[d] += x * lo(row[d]);
                acc[16 + d] += x * hi(row[d]);
            }
        }
        _ => {
            for (d, &v) in row[..nb / 2].iter().enumerate() {
                acc[2 * d] += x * lo(v);
                acc[2 * d + 1] += x * hi(v);
            }
        }
    }
}

/// The grouped sums of the layout block at output `b0` (`nb` outputs), rows `r`, in plain Rust.
// Outputs are indexed by their place in the block across several arrays: clearer than zips.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
fn grouped_block(job: &Job<'_>, b0: usize, nb: usize, o0: usize, out: &mut OutBlock<'_>) {
    let Shape { rows, k, n } = job.shape;
    let w = &job.w;
    let groups = k / w.group;
    let base = &w.q[b0 * k / 2..][..nb * k / 2];
    for r in 0..rows {
        let mut y = [0.0f32; 64];
        for g in 0..groups {
            let mut acc = [0.0f32; 64];
            for i in g * w.group..(g + 1) * w.group {
                add_row(
                    w.layout,
                    nb,
                    &base[i * nb / 2..][..nb / 2],
                    job.x32[r * k + i],
                    &mut acc,
                );
            }
            let xs = job.xsum[r * groups + g];
            for j in 0..nb {
                let sz = (g * n + b0 + j) * 2;
                let (s, z) = (scale_get(&w.scale_zero, sz), scale_get(&w.scale_zero, sz + 1));
                y[j] += s * acc[j];
                y[j] += z * xs;
            }
        }
        for j in 0..nb {
            y[j] += job.bias[b0 + j];
        }
        out.store::<1, 64>(r, b0 - o0, nb, &[y]);
    }
}

/// The grouped path over the output columns `[o0, o0 + len)` (`o0` a multiple of 64).
#[inline(always)]
fn grouped(job: &Job<'_>, o0: usize, out: &mut OutBlock<'_>) {
    let bn = job.w.layout.block_n();
    let end = o0 + out.len();
    let mut b0 = o0;
    while b0 < end {
        let nb = bn.min(job.shape.n - b0);
        grouped_block(job, b0, nb, o0, out);
        b0 += nb;
    }
}

/// [`grouped`] compiled with a path's features (`isa.rs`'s table).
#[cfg(target_arch = "x86_64")]
macro_rules! grouped_path {
    ($name:ident, $($features:tt)*) => {
        /// # Safety
        /// The CPU has the path's features.
        $(#[target_feature(enable = $features)])*
        unsafe fn $name(job: &Job<'_>, o0: usize, out: &mut OutBlock<'_>) {
            grouped(job, o0, out)
        }
    };
}
#[cfg(target_arch = "x86_64")]
use crate::isa::simd_features;
#[cfg(target_arch = "x86_64")]
simd_features!(Avx2, grouped_path!(grouped_avx2,));
#[cfg(target_arch = "x86_64")]
simd_features!(Avx512, grouped_path!(grouped_avx512,));

#[cfg(target_arch = "x86_64")]
mod dot {
    //! The `vdpbf16ps` path (module documentation).
    use std::arch::x86_64::*;

    use super::{grouped_block, Int4Layout, Job};
    use crate::elem::Bf16;
    use crate::isa::simd_features;
    use crate::linear::{Act, OutBlock, Scale, Shape};

    /// Whether a call takes it: bfloat16 activations and scales, the `avx512` layout.
    pub(super) fn applies(job: &Job<'_>) -> bool {
        matches!(job.x, Act::Bf16(_))
            && matches!(job.w.scale_zero, Scale::Bf16(_))
            && job.w.layout == Int4Layout::Avx512
    }

    /// Bytes `d`, `16 + d` of `in` row `i` and of row `i + 1` side by side: byte `4 d + m`.
    fn pair_index() -> [u8; 64] {
        std::array::from_fn(|b| {
            let (d, m) = (b / 4, b % 4);
            (d + 16 * m) as u8
        })
    }

    /// `q - 8` as bfloat16, for the low 5 bits of a word (the table twice).
    fn table() -> [u16; 32] {
        std::array::from_fn(|i| crate::elem::f32_to_bf16((i % 16) as f32 - 8.0))
    }

    /// One full block of 64 outputs at `b0`, activation rows `r0..r0 + MR`.
    ///
    /// # Safety
    /// AVX-512 F/BW, BF16 and VBMI; `applies(job)`; the block and rows within the job.
    // The accumulators are indexed by (row, 16 outputs) in the loops' nesting order.
    #[allow(clippy::needless_range_loop)]
    #[inline(always)]
    unsafe fn block64<const MR: usize>(
        job: &Job<'_>,
        xb: &[Bf16],
        sz: &[Bf16],
        b0: usize,
        r0: usize,
        o0: usize,
        out: &mut OutBlock<'_>,
    ) {
        let Shape { k, n, .. } = job.shape;
        let group = job.w.group;
        let groups = k / group;
        // SAFETY (the whole body): the loads read 64 bytes of the block (two rows of 32 within
        // its `k * 32` bytes), 64 bytes of the scales of the block's 64 outputs in a group (of
        // `n * 2` per group, `b0 + 64 <= n`), 4 bytes of an activation row at an even `i < k`.
        unsafe {
            let idx = pair_index();
            let idx = _mm512_loadu_si512(idx.as_ptr() as *const __m512i);
            let lut = table();
            let lut = _mm512_loadu_si512(lut.as_ptr() as *const __m512i);
            let hi16 = _mm512_set1_epi32(0xffff_0000u32 as i32);
            let base = job.w.q.as_ptr().add(b0 * k / 2);
            let mut y = [[_mm512_setzero_ps(); 4]; MR];
            for g in 0..groups {
                let mut acc = [[_mm512_setzero_ps(); 4]; MR];
                let mut i = g * group;
                while i < (g + 1) * group {
                    let v = _mm512_loadu_si512(base.add(i * 32) as *const __m512i);
                    let a = _mm512_permutexvar_epi8(idx, v);
                    // Outputs 0..16, 32..48, 16..32, 48..64 (module documentation).
                    let w = [
                        _mm512_permutexvar_epi16(a, lut),
                        _mm512_permutexvar_epi16(_mm512_srli_epi16::<8>(a), lut),
                        _mm512_permutexvar_epi16(_mm512_srli_epi16::<4>(a), lut),
                        _mm512_permutexvar_epi16(_mm512_srli_epi16::<12>(a), lut),
                    ];
                    for r in 0..MR {
                        let xp = (xb.as_ptr().add((r0 + r) * k + i) as *const i32).read_unaligned();
                        let xp: __m512bh = std::mem::transmute(_mm512_set1_epi32(xp));
                        for c in 0..4 {
                            acc[r][c] = _mm512_dpbf16_ps(acc[r][c], std::mem::transmute::<__m512i, __m512bh>(w[c]), xp);
                        }
                    }
                    i += 2;
                }
                let zs = sz.as_ptr().add((g * n + b0) * 2);
                for c in 0..4 {
                    let v = _mm512_loadu_si512(zs.add(32 * c) as *const __m512i);
                    let s = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(v));
                    let z = _mm512_castsi512_ps(_mm512_and_si512(v, hi16));
                    for r in 0..MR {
                        let xs = _mm512_set1_ps(job.xsum[(r0 + r) * groups + g]);
                        y[r][c] = _mm512_add_ps(y[r][c], _mm512_mul_ps(s, acc[r][c]));
                        y[r][c] = _mm512_add_ps(y[r][c], _mm512_mul_ps(z, xs));
                    }
                }
            }
            let mut vals = [[0.0f32; 64]; MR];
            for r in 0..MR {
                for c in 0..4 {
                    _mm512_storeu_ps(vals[r].as_mut_ptr().add(16 * c), y[r][c]);
                }
                for (j, v) in vals[r].iter_mut().enumerate() {
                    *v += job.bias[b0 + j];
                }
            }
            out.store::<MR, 64>(r0, b0 - o0, 64, &vals);
        }
    }

    macro_rules! dot_path {
        ($($features:tt)*) => {
            /// The columns `[o0, o0 + len)`: full blocks here, a last shorter one grouped.
            ///
            /// # Safety
            /// The CPU has the path's features; `applies(job)`; `o0` a multiple of 64.
            $(#[target_feature(enable = $features)])*
            pub(super) unsafe fn block(job: &Job<'_>, o0: usize, out: &mut OutBlock<'_>) {
                let (Act::Bf16(xb), Scale::Bf16(sz)) = (job.x, job.w.scale_zero) else {
                    unreachable!("applies(job) checked the dtypes")
                };
                let Shape { rows, n, .. } = job.shape;
                let end = o0 + out.len();
                let mut b0 = o0;
                while b0 < end {
                    let nb = 64.min(n - b0);
                    if nb < 64 {
                        grouped_block(job, b0, nb, o0, out);
                    } else {
                        let mut r0 = 0;
                        while r0 < rows {
                            // SAFETY: forwarded contract; rows r0.. within the job.
                            unsafe {
                                match rows - r0 {
                                    1 => block64::<1>(job, xb, sz, b0, r0, o0, out),
                                    2 => block64::<2>(job, xb, sz, b0, r0, o0, out),
                                    3 => block64::<3>(job, xb, sz, b0, r0, o0, out),
                                    _ => block64::<4>(job, xb, sz, b0, r0, o0, out),
                                }
                            }
                            r0 += 4;
                        }
                    }
                    b0 += nb;
                }
            }
        };
    }
    simd_features!(Avx512Bf16Vbmi, dot_path!());
}

/// `out = x @ W.T + bias` for int4 weights `w` (module documentation) on `simd`'s path, on `pool`
/// (None: the calling thread). The buffers are checked first: an error writes nothing.
pub fn linear_int4(
    simd: Simd,
    pool: Option<&rayon::ThreadPool>,
    shape: Shape,
    x: Act<'_>,
    w: Int4<'_>,
    bias: Option<Act<'_>>,
    out: ActMut<'_>,
) -> Result<()> {
    linear_int4_on(simd, None, pool, shape, x, w, bias, out)
}

/// As [`linear_int4`], on the process's OpenMP team of `omp` threads (`crate::omp`) where it has
/// one and the call is not inside a parallel region, else on `pool`; the same bits.
#[allow(clippy::too_many_arguments)]
pub fn linear_int4_on(
    simd: Simd,
    omp: Option<usize>,
    pool: Option<&rayon::ThreadPool>,
    shape: Shape,
    x: Act<'_>,
    w: Int4<'_>,
    bias: Option<Act<'_>>,
    out: ActMut<'_>,
) -> Result<()> {
    let omp = omp.filter(|_| crate::omp::usable());
    validate(shape, &x, &w, bias.as_ref(), &out)?;
    check_supported(simd)?;
    let Shape { rows, n, .. } = shape;
    if rows == 0 || n == 0 {
        return Ok(());
    }
    let job = Job::new(shape, x, w, bias, simd);
    let threads = task_threads(omp, pool);
    // Tasks of whole blocks (64 outputs: a multiple of every layout's block), about four per
    // thread.
    let block = n.div_ceil(threads.max(1) * 4).div_ceil(64).max(1) * 64;
    let tasks = out_tasks(out, rows, n, block);
    #[cfg(target_arch = "x86_64")]
    let dot = matches!(simd, Simd::Avx512Bf16Vbmi) && dot::applies(&job);
    let f = |(o0, mut ob): (usize, OutBlock<'_>)| {
        let ob = &mut ob;
        match simd {
            Simd::Scalar => reference(&job, o0, ob),
            // SAFETY (each arm): `check_supported(simd)` checked the path's features above; `dot`
            // checked `applies`; tasks start at multiples of 64.
            #[cfg(target_arch = "x86_64")]
            _ if dot => unsafe { dot::block(&job, o0, ob) },
            #[cfg(target_arch = "x86_64")]
            Simd::Avx2 => unsafe { grouped_avx2(&job, o0, ob) },
            #[cfg(target_arch = "x86_64")]
            Simd::Avx512 | Simd::Avx512Vbmi | Simd::Avx512Bf16 | Simd::Avx512Bf16Vbmi => unsafe {
                grouped_avx512(&job, o0, ob)
            },
            #[allow(unreachable_patterns)]
            _ => grouped(&job, o0, ob),
        }
    };
    run_tasks(omp, pool, tasks, f);
    Ok(())
}

#[cfg(test)]
mod tests;
