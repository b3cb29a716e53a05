//! The SIMD paths: tiles of `MR` activation rows by `NR` output rows over the whole `in`
//! dimension, generic over the lanes (`vector.rs`) and the stored format of the weights.
//!
//! A step covers `STEP` elements of `in`: each activation row's step is loaded once, each weight
//! row's step is loaded and converted once, then `MR * NR` multiply-adds into one accumulator per
//! (row, output). One activation row (decode) runs 8 output rows at a time: 8 weight streams, 8
//! independent accumulators (enough to hide the FMA latency). The last `in % STEP` elements are
//! added in float32 one by one, as the reference does.

use std::array::from_fn;

#[cfg(target_arch = "x86_64")]
use super::vector::{Avx2, Avx512};
use super::vector::{Portable, Vector};
use super::{finish, Act, Job, LinearPath, OutBlock, Shape, Weight};
use crate::elem::Bf16;
#[cfg(target_arch = "x86_64")]
use crate::isa::simd_features;

/// How one stored format is read by lanes `V`.
///
/// # Safety
/// As [`Vector`]: the CPU runs `V`'s path; the pointers are readable for one step.
pub(crate) unsafe trait Format<V: Vector> {
    /// A stored weight.
    type W: Copy;
    /// An element of the prepared activations.
    type X: Copy + Default;
    /// One step of activations, and of weights, in registers.
    type XV: Copy;
    type WV: Copy;
    /// Elements of `in` per step.
    const STEP: usize;
    /// The dot products come out divided by this (folded into the scale).
    const FACTOR: f32;
    /// Whether the activations of a step are prepared as its even elements, then its odd ones.
    const EVEN_ODD: bool;
    /// The activation as prepared.
    fn x_of(x: &Act<'_>, i: usize) -> Self::X;
    /// # Safety
    /// As for the trait.
    unsafe fn load_x(p: *const Self::X) -> Self::XV;
    /// # Safety
    /// As for the trait.
    unsafe fn load_w(p: *const Self::W) -> Self::WV;
    /// # Safety
    /// As for the trait.
    unsafe fn mac(acc: V, x: Self::XV, w: Self::WV) -> V;
}

/// int8 weights, float32 activations in order.
pub(crate) struct Int8;
/// float8_e4m3fn weights, float32 activations in order.
pub(crate) struct Fp8;
/// bfloat16 weights, float32 activations as even and odd elements of each step.
pub(crate) struct Bf16W;

macro_rules! float_format {
    ($f:ty, $w:ty, $conv:ident, $factor:expr, $even_odd:expr) => {
        // SAFETY: `V`'s own operations, under the same contract.
        unsafe impl<V: Vector> Format<V> for $f {
            type W = $w;
            type X = f32;
            type XV = [V; 2];
            type WV = [V; 2];
            const STEP: usize = 2 * V::W;
            const FACTOR: f32 = $factor;
            const EVEN_ODD: bool = $even_odd;
            #[inline(always)]
            fn x_of(x: &Act<'_>, i: usize) -> f32 {
                x.get(i)
            }
            #[inline(always)]
            unsafe fn load_x(p: *const f32) -> [V; 2] {
                unsafe { [V::load(p), V::load(p.add(V::W))] }
            }
            #[inline(always)]
            unsafe fn load_w(p: *const $w) -> [V; 2] {
                unsafe { V::$conv(p as _) }
            }
            #[inline(always)]
            unsafe fn mac(acc: V, x: [V; 2], w: [V; 2]) -> V {
                unsafe { V::fma(V::fma(acc, x[0], w[0]), x[1], w[1]) }
            }
        }
    };
}

float_format!(Int8, i8, i8x2, 1.0, false);
float_format!(Fp8, u8, fp8x2, V::FP8_FACTOR, false);
float_format!(Bf16W, Bf16, bf16x2, 1.0, true);

/// The activations of every row in `F`'s order: `steps * STEP` elements per row (the tail of
/// `in % STEP` is read from the activations as given).
pub(crate) fn prepare<V: Vector, F: Format<V>>(job: &Job<'_>) -> Vec<F::X> {
    let Shape { rows, k, .. } = job.shape;
    let (step, steps) = (F::STEP, k / F::STEP);
    let mut xp = vec![F::X::default(); rows * steps * step];
    for r in 0..rows {
        for s in 0..steps {
            let base = r * k + s * step;
            let dst = &mut xp[(r * steps + s) * step..][..step];
            if F::EVEN_ODD {
                let half = step / 2;
                for j in 0..half {
                    dst[j] = F::x_of(&job.x, base + 2 * j);
                    dst[half + j] = F::x_of(&job.x, base + 2 * j + 1);
                }
            } else {
                for (j, d) in dst.iter_mut().enumerate() {
                    *d = F::x_of(&job.x, base + j);
                }
            }
        }
    }
    xp
}

/// `MR x NR` dot products over `steps` steps: activations at `x` (rows `xs` apart), weights at `w`
/// (rows `k` apart).
///
/// # Safety
/// The CPU runs `V`'s path; `x` and `w` are readable for `MR` and `NR` rows of `steps` steps.
// The accumulators are indexed by (row, output) in the loops' nesting order: clearer than zips.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
unsafe fn tile<V: Vector, F: Format<V>, const MR: usize, const NR: usize>(
    x: *const F::X,
    xs: usize,
    w: *const F::W,
    k: usize,
    steps: usize,
) -> [[f32; NR]; MR] {
    unsafe {
        let mut acc = [[V::zero(); NR]; MR];
        for s in 0..steps {
            let off = s * F::STEP;
            let xv: [F::XV; MR] = from_fn(|r| F::load_x(x.add(r * xs + off)));
            for j in 0..NR {
                let wv = F::load_w(w.add(j * k + off));
                for r in 0..MR {
                    acc[r][j] = F::mac(acc[r][j], xv[r], wv);
                }
            }
        }
        from_fn(|r| from_fn(|j| acc[r][j].hsum()))
    }
}

/// Output columns `[c0, c0 + NR)` of the block, rows `[r0, r0 + MR)`: the tile, the tail, the
/// scale and bias, the store.
///
/// # Safety
/// As for [`tile`]; `xp` is `prepare`'s, the columns and rows are within the block and the job.
#[inline(always)]
unsafe fn tile_out<V: Vector, F: Format<V>, const MR: usize, const NR: usize>(
    job: &Job<'_>,
    xp: &[F::X],
    w: &[F::W],
    o0: usize,
    r0: usize,
    c0: usize,
    out: &mut OutBlock<'_>,
) {
    let Shape { k, .. } = job.shape;
    let steps = k / F::STEP;
    let xs = steps * F::STEP;
    let o = o0 + c0;
    // SAFETY: rows r0..r0+MR of `xp` (xs each) and weight rows o..o+NR (k each) are in bounds:
    // the caller keeps them within the job's shape, which `linear` validated.
    let dots = unsafe { tile::<V, F, MR, NR>(xp.as_ptr().add(r0 * xs), xs, w.as_ptr().add(o * k), k, steps) };
    let mut vals = [[0.0f32; NR]; MR];
    for r in 0..MR {
        for j in 0..NR {
            let mut tail = 0.0f32;
            for i in xs..k {
                tail += job.x.get((r0 + r) * k + i) * job.w.get(o + j, i, k);
            }
            vals[r][j] = finish(dots[r][j], tail, F::FACTOR, job.scale[o + j], job.bias[o + j]);
        }
    }
    out.store::<MR, NR>(r0, c0, NR, &vals);
}

/// Every row of the output columns `[o0, o0 + len)` in tiles: 8 columns at a time for one
/// activation row, 4 for two or three, 4 (AVX-512) or 2 (8 lanes) for four; single columns at
/// the end.
///
/// # Safety
/// As for [`tile_out`].
#[inline(always)]
unsafe fn block_body<V: Vector, F: Format<V>>(
    job: &Job<'_>,
    xp: &[F::X],
    w: &[F::W],
    o0: usize,
    out: &mut OutBlock<'_>,
) {
    let rows = job.shape.rows;
    let len = match out {
        OutBlock::F32(r) => r.first().map_or(0, |r| r.len()),
        OutBlock::Bf16(r) => r.first().map_or(0, |r| r.len()),
    };
    macro_rules! cols {
        ($mr:literal, $nr:literal, $r0:expr) => {{
            let mut c = 0;
            while c + $nr <= len {
                // SAFETY: columns c..c+NR of the block, rows r0..r0+MR (caller's contract).
                unsafe { tile_out::<V, F, $mr, $nr>(job, xp, w, o0, $r0, c, out) };
                c += $nr;
            }
            while c < len {
                // SAFETY: as above, one column.
                unsafe { tile_out::<V, F, $mr, 1>(job, xp, w, o0, $r0, c, out) };
                c += 1;
            }
        }};
    }
    // Rows in groups of four, then the rest; columns within each group's pass.
    let mut r0 = 0;
    while rows - r0 >= 4 {
        if V::W >= 16 {
            cols!(4, 4, r0);
        } else {
            cols!(4, 2, r0);
        }
        r0 += 4;
    }
    match rows - r0 {
        1 => cols!(1, 8, r0),
        2 => cols!(2, 4, r0),
        3 => cols!(3, 4, r0),
        _ => {}
    }
}

/// Prepared activations: float32 (float formats) or bfloat16 bits (the dot-product format).
pub(crate) struct Prepared {
    f32: Vec<f32>,
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    bf16: Vec<u16>,
}

#[inline(always)]
fn prepare_float<V: Vector>(job: &Job<'_>) -> Prepared {
    let f32 = match job.w {
        Weight::Int8 { .. } => prepare::<V, Int8>(job),
        Weight::Fp8 { .. } => prepare::<V, Fp8>(job),
        Weight::Bf16(_) => prepare::<V, Bf16W>(job),
    };
    Prepared { f32, bf16: Vec::new() }
}

/// # Safety
/// As for [`block_body`].
#[inline(always)]
unsafe fn block_float<V: Vector>(job: &Job<'_>, prep: &Prepared, o0: usize, out: &mut OutBlock<'_>) {
    // SAFETY: forwarded contract.
    unsafe {
        match job.w {
            Weight::Int8 { q, .. } => block_body::<V, Int8>(job, &prep.f32, q, o0, out),
            Weight::Fp8 { q, .. } => block_body::<V, Fp8>(job, &prep.f32, q, o0, out),
            Weight::Bf16(w) => block_body::<V, Bf16W>(job, &prep.f32, w, o0, out),
        }
    }
}

/// A path: [`block_float`] on lanes `$v`, compiled with `$features` (from `isa.rs`'s table,
/// `simd_features!`).
macro_rules! path {
    ($name:ident, $v:ty, $($features:tt)*) => {
        pub(crate) struct $name;
        impl LinearPath for $name {
            type Prepared = Prepared;
            fn prepare(job: &Job<'_>) -> Prepared {
                prepare_float::<$v>(job)
            }
            unsafe fn block(job: &Job<'_>, prep: &Prepared, o0: usize, out: &mut OutBlock<'_>) {
                $(#[target_feature(enable = $features)])*
                unsafe fn f(job: &Job<'_>, prep: &Prepared, o0: usize, out: &mut OutBlock<'_>) {
                    // SAFETY: forwarded contract (the CPU runs this path).
                    unsafe { block_float::<$v>(job, prep, o0, out) }
                }
                // SAFETY: as above.
                unsafe { f(job, prep, o0, out) }
            }
        }
    };
}

path!(PortablePath, Portable,);
#[cfg(target_arch = "x86_64")]
simd_features!(Avx2, path!(Avx2Path, Avx2,));
#[cfg(target_arch = "x86_64")]
simd_features!(Avx512, path!(Avx512Path, Avx512,));

#[cfg(target_arch = "x86_64")]
pub(crate) use bf16dot::Avx512Bf16Path;

#[cfg(target_arch = "x86_64")]
mod bf16dot {
    use std::arch::x86_64::*;

    use super::{block_body, block_float, prepare, prepare_float, Format, Prepared};
    use crate::elem::Bf16;
    use crate::isa::simd_features;
    use crate::linear::vector::Avx512;
    use crate::linear::{Act, Job, LinearPath, OutBlock, Weight};

    /// bfloat16 weights with bfloat16 activations on AVX-512 BF16: `vdpbf16ps` multiplies 32
    /// pairs exactly and adds each pair's two products into a float32 lane.
    pub(crate) struct Bf16Dot;

    // SAFETY: AVX-512 F and BF16, which the path that uses this format requires.
    unsafe impl Format<Avx512> for Bf16Dot {
        type W = Bf16;
        type X = u16;
        type XV = __m512bh;
        type WV = __m512bh;
        const STEP: usize = 32;
        const FACTOR: f32 = 1.0;
        const EVEN_ODD: bool = false;
        #[inline(always)]
        fn x_of(x: &Act<'_>, i: usize) -> u16 {
            match x {
                Act::Bf16(x) => x[i].0,
                Act::F32(_) => unreachable!("bfloat16 activations only"),
            }
        }
        #[inline(always)]
        unsafe fn load_x(p: *const u16) -> __m512bh {
            // SAFETY: 32 bfloat16 readable (contract); same-size plain data.
            unsafe { std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(p as *const __m512i)) }
        }
        #[inline(always)]
        unsafe fn load_w(p: *const Bf16) -> __m512bh {
            // SAFETY: as above.
            unsafe { std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(p as *const __m512i)) }
        }
        #[inline(always)]
        unsafe fn mac(acc: Avx512, x: __m512bh, w: __m512bh) -> Avx512 {
            // SAFETY: AVX-512 BF16 (contract).
            unsafe { Avx512(_mm512_dpbf16_ps(acc.0, x, w)) }
        }
    }

    /// The `avx512bf16` paths: [`Bf16Dot`] where both operands are bfloat16, the AVX-512 float
    /// formats otherwise.
    pub(crate) struct Avx512Bf16Path;

    fn dot(job: &Job<'_>) -> bool {
        matches!((job.w, job.x), (Weight::Bf16(_), Act::Bf16(_)))
    }

    impl LinearPath for Avx512Bf16Path {
        type Prepared = Prepared;
        fn prepare(job: &Job<'_>) -> Prepared {
            if dot(job) {
                Prepared {
                    f32: Vec::new(),
                    bf16: prepare::<Avx512, Bf16Dot>(job),
                }
            } else {
                prepare_float::<Avx512>(job)
            }
        }
        unsafe fn block(job: &Job<'_>, prep: &Prepared, o0: usize, out: &mut OutBlock<'_>) {
            // SAFETY: forwarded contract (the CPU runs this path).
            unsafe { block_bf16(job, prep, o0, out) }
        }
    }

    /// [`Avx512Bf16Path`]'s block, compiled with the features of `isa.rs`'s table.
    macro_rules! block_bf16 {
        ($($features:tt)*) => {
            /// # Safety
            /// As for [`LinearPath::block`].
            $(#[target_feature(enable = $features)])*
            unsafe fn block_bf16(job: &Job<'_>, prep: &Prepared, o0: usize, out: &mut OutBlock<'_>) {
                // SAFETY: forwarded contract (the CPU runs this path).
                unsafe {
                    match job.w {
                        Weight::Bf16(w) if dot(job) => block_body::<Avx512, Bf16Dot>(job, &prep.bf16, w, o0, out),
                        _ => block_float::<Avx512>(job, prep, o0, out),
                    }
                }
            }
        };
    }
    simd_features!(Avx512Bf16, block_bf16!());
}
