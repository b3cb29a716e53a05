//! The 8-bit block-quantized moments, as torchao's `AdamW8bit` defines them.
//!
//! A moment of `n` elements (`n` a multiple of [`QBLOCK`]) is `n` codes and one float32 absmax
//! per block of [`QBLOCK`] elements; element `i` is `map[code[i]] * absmax[i / QBLOCK]`. The first
//! moment uses the signed map, the second moment and the amsgrad maximum the unsigned one
//! (`maps.rs`). Each step dequantizes, updates in float32, and quantizes the new moments: the
//! block's absmax (clipped at 1e-12, NaN propagating), `y = x / absmax`, then the nearest code by
//! torchao's rule (a branch-free binary search with `>=`, then one up if the residual is at least
//! half the gap: [`Map::code_ref`], the specification).
//!
//! The fast paths find that same code with one load instead of eight dependent ones (one gather
//! per 8 lanes on AVX2): [`Map::code`] looks up the float's bucket (its sign, exponent and top 7
//! mantissa bits), which holds at most one code boundary (checked when the table is built): the
//! entry is the code at the bucket's start and the low 16 bits of the float where the next code
//! begins, compared with the float's own low bits.
//!
//! The block loop ([`body`], [`update_ref`]) serves every block codec ([`Codec`]): this module's
//! dynamic maps and the fp8 codec of `fp8.rs`.

use std::sync::OnceLock;

use super::float::{kahan_add, out_block, BlockIo, PREFETCH_BLOCKS};
use super::maps;
use super::segment::{nan_max, Consts, Kahan, OutMut, Q8Mut, QBLOCK};
use crate::elem::Bf16;
use crate::elem::Elem;
use crate::isa::{Block, Buckets, BytePlanes, Generic, Isa, LANES};

/// torchao (after bitsandbytes) quantizes a tensor's moments only from this many elements, and
/// only if they divide into blocks; other tensors keep unquantized moments.
pub const MIN_NUMEL: usize = 4096;

/// How one quantization block of a moment is stored: codes and one float32 per block (the
/// dynamic maps' absmax, the fp8 codec's scale).
pub trait Codec: Sync + 'static {
    /// The codec of `exp_avg`.
    fn first() -> &'static Self;
    /// The codec of `exp_avg_sq` and `max_exp_avg_sq`.
    fn second() -> &'static Self;
    /// The specification: quantizes `x` into `codes`, returns the block's float.
    fn quantize_ref(&self, x: &[f32; QBLOCK], codes: &mut [u8; QBLOCK]) -> f32;
    /// The same codes and float as [`Codec::quantize_ref`], on path `I`.
    ///
    /// # Safety
    /// The CPU supports `I`.
    unsafe fn quantize<I: Isa>(&self, x: &[f32; QBLOCK], codes: &mut [u8; QBLOCK]) -> f32;
    /// The block's values from its codes and float `s`, on path `I`.
    ///
    /// # Safety
    /// The CPU supports `I`.
    unsafe fn dequantize<I: Isa>(&self, codes: &[u8; QBLOCK], s: f32, out: &mut [f32; QBLOCK]);
}

impl Codec for Map {
    #[inline(always)]
    fn first() -> &'static Self {
        signed()
    }
    #[inline(always)]
    fn second() -> &'static Self {
        unsigned()
    }
    #[inline(always)]
    fn quantize_ref(&self, x: &[f32; QBLOCK], codes: &mut [u8; QBLOCK]) -> f32 {
        quantize_block_ref(self, x, codes)
    }
    #[inline(always)]
    unsafe fn quantize<I: Isa>(&self, x: &[f32; QBLOCK], codes: &mut [u8; QBLOCK]) -> f32 {
        // SAFETY: the caller's contract.
        unsafe { quantize_block::<I>(self, x, codes) }
    }
    #[inline(always)]
    unsafe fn dequantize<I: Isa>(&self, codes: &[u8; QBLOCK], s: f32, out: &mut [f32; QBLOCK]) {
        // SAFETY: the caller's contract.
        unsafe { dequantize_block::<I>(self, codes, s, out) }
    }
}

/// One dynamic map, with the lookup tables of the fast quantizer.
pub struct Map {
    /// The value of each code, increasing.
    pub q: [f32; 256],
    /// Per bucket ([`bucket`]): the code of its first float (smallest magnitude) in the low 8
    /// bits, and above them the low 16 bits from which floats of the bucket have the next code
    /// (one further from zero; 0x10000: none).
    table: Box<[u32; BUCKETS]>,
    /// The paths with lookups in registers ([`Isa::search256`]): the smallest `y` of each code
    /// `1..=255` (`code_ref` is monotone in `y`, so the code is the number of them `<= y`), as
    /// the levels of a binary search.
    tree: [f32; 256],
    /// The paths with byte permutes ([`Isa::lookup256x64`]): `q` as its four byte planes.
    planes: BytePlanes,
    /// The paths with byte permutes ([`Isa::bucket_codes64`]): the quantizer's bucket table.
    buckets: Buckets,
}

/// Buckets of one sign: magnitudes up to 1.0 by their top 15 bits (below the sign), then one
/// for everything larger (NaN: `y` is never larger than 1 otherwise).
const HALF: u32 = (0x3f80_0000 >> 16) + 2;
const BUCKETS: usize = 2 * HALF as usize;
const NONE: u32 = 0x1_0000;

/// The bucket of a float's bits: its sign, then its magnitude's exponent and top 7 mantissa bits.
#[inline(always)]
fn bucket(b: u32) -> u32 {
    ((b & 0x7fff_ffff) >> 16).min(HALF - 1) + (b >> 31) * HALF
}

/// The code of a float's bits from its bucket's entry `e`: one further from zero (up for
/// positive floats, down for negative ones) past the entry's threshold.
#[inline(always)]
fn decode(b: u32, e: u32) -> u8 {
    let past = ((b & 0xffff) >= (e >> 8)) as u32;
    let neg = b >> 31;
    (e & 0xff).wrapping_add(past).wrapping_sub(2 * past * neg) as u8
}

impl Map {
    fn build(bits: &[u32; 256]) -> Map {
        let q = bits.map(f32::from_bits);
        let mut m = Map {
            q,
            table: vec![0u32; BUCKETS]
                .into_boxed_slice()
                .try_into()
                .expect("BUCKETS entries"),
            tree: [0.0; 256],
            planes: BytePlanes::new(&q),
            buckets: Buckets {
                code: [0; 128],
                thr: [[[0; 128]; 4]; 3],
                scale: [0.0; 32],
                offset: [0.0; 32],
                floor: 0.0,
            },
        };
        // The thresholds: for each code, the first float of [-1, 1] (in the floats' order) with
        // that code or a larger one, by bisection over the order.
        let key = |f: f32| {
            let b = f.to_bits();
            if b >> 31 == 1 {
                !b
            } else {
                b | 0x8000_0000
            }
        };
        let unkey = |k: u32| f32::from_bits(if k >> 31 == 1 { k & 0x7fff_ffff } else { !k });
        let mut first = [0.0f32; 256];
        for (j, f) in first.iter_mut().enumerate().skip(1) {
            let (mut lo, mut hi) = (key(-1.0), key(1.0)); // code(lo) < j <= code(hi)
            assert!(m.code_ref(-1.0) < j as u8 && m.code_ref(1.0) >= j as u8);
            while hi - lo > 1 {
                let mid = lo + (hi - lo) / 2;
                if m.code_ref(unkey(mid)) >= j as u8 {
                    hi = mid;
                } else {
                    lo = mid;
                }
            }
            *f = unkey(hi);
        }
        for l in 0..8 {
            for i in 0..(1usize << l) {
                m.tree[(1 << l) + i] = first[(2 * i + 1) * (128 >> l)];
            }
        }
        m.buckets = buckets(&first, m.q[0] < 0.0);
        // The code is monotone in y: within a bucket it changes at most once (asserted), where
        // bisection over the low 16 bits finds it.
        for idx in 0..BUCKETS as u32 {
            let (sign, mag) = ((idx / HALF) << 31, idx % HALF);
            if mag == HALF - 1 {
                m.table[idx as usize] = NONE << 8; // NaN: code 0, as the search gives
                continue;
            }
            let at = |low: u32| m.code_ref(f32::from_bits(sign | (mag << 16) | low).clamp(-1.0, 1.0));
            let (c0, c1) = (at(0), at(0xffff));
            let thr = if c0 == c1 {
                NONE
            } else {
                assert!(c0.abs_diff(c1) == 1, "bucket {idx:#x} spans codes {c0} and {c1}");
                let (mut a, mut b) = (0u32, 0xffffu32); // at(a) == c0, at(b) != c0
                while b - a > 1 {
                    let mid = (a + b) / 2;
                    if at(mid) == c0 {
                        a = mid;
                    } else {
                        b = mid;
                    }
                }
                b
            };
            m.table[idx as usize] = c0 as u32 | (thr << 8);
        }
        m
    }

    /// torchao's `quantize_8bit_with_qmap` for one element: the specification.
    pub fn code_ref(&self, y: f32) -> u8 {
        let q = &self.q;
        let mut c = 0usize;
        for k in [128, 64, 32, 16, 8, 4, 2, 1] {
            if y >= q[c + k] {
                c += k;
            }
        }
        let up = (c + 1).min(255);
        if y - q[c] >= (q[up] - q[c]) * 0.5 {
            c = up;
        }
        c as u8
    }

    /// The same code as [`Map::code_ref`] for every `y` in [-1, 1] and NaN (what `x / absmax`
    /// can be), by two table loads.
    #[inline(always)]
    pub fn code(&self, y: f32) -> u8 {
        let b = y.to_bits();
        // In range by construction: `bucket` clamps below BUCKETS.
        decode(b, self.table[bucket(b) as usize])
    }

    /// [`Map::code`] for a lane block: by the path's gather of the bucket table, or where the
    /// path searches in registers, by [`Isa::search256`] over the thresholds.
    ///
    /// # Safety
    /// The CPU supports `I`.
    #[inline(always)]
    unsafe fn codes<I: Isa>(&self, y: &Block) -> [u8; LANES] {
        if I::SEARCH_IN_REGISTERS {
            // SAFETY: the caller's contract.
            return unsafe { I::search256(&self.tree, y) };
        }
        let bits = y.map(f32::to_bits);
        // SAFETY: `bucket` < BUCKETS, the table's length; CPU support is the caller's contract.
        let e = unsafe { I::gather_u32(&self.table[..], &bits.map(bucket)) };
        std::array::from_fn(|i| decode(bits[i], e[i]))
    }
}

/// The bucket table of a map from its thresholds (`first[j]`: the smallest `y` of code `j` or
/// more, increasing): per magnitude binade, the fewest equal buckets (in `y`) that hold at most
/// three thresholds each, 64 buckets per sign for a signed map, 128 for an unsigned one; then
/// each bucket's first code (the thresholds in the buckets below it) and its own thresholds. The
/// code of `y` is then `code_ref(y)` because the bucket index is monotone in `y` (asserted on
/// the thresholds here; tested on every float near every threshold and bucket edge).
fn buckets(first: &[f32; 256], signed: bool) -> Buckets {
    let mut b = Buckets {
        code: [0; 128],
        thr: [[[0; 128]; 4]; 3],
        scale: [0.0; 32],
        offset: [0.0; 32],
        floor: if signed { -1.0 } else { 0.0 },
    };
    let t = &first[1..];
    let (half, budget) = if signed { (64u32, 64u32) } else { (0, 128) };
    let binade = |x: f32| (x.to_bits() & 0x7fff_ffff) >> 23;
    assert!(t.iter().all(|&x| binade(x) > 96), "a threshold below 2^-30");
    let mut base = 0u32;
    for e in 96..128u32 {
        let i = (e & 31) as usize;
        let inb: Vec<f32> = t.iter().copied().filter(|&x| binade(x) == e).collect();
        if inb.is_empty() {
            // one bucket: the next binade's first
            (b.scale[i], b.offset[i]) = (0.0, (half + base) as f32);
            continue;
        }
        let mut k = 1u32;
        loop {
            b.scale[i] = k as f32 * 2f32.powi(127 - e as i32);
            b.offset[i] = (half + base) as f32 - k as f32;
            let mut count = [0u8; 128];
            for &x in &inb {
                count[b.index(x)] += 1;
            }
            if count.iter().all(|&c| c <= 3) {
                break;
            }
            k += 1;
        }
        base += k;
    }
    assert!(base < budget, "{base} buckets of one sign, more than {budget}");
    let idx: Vec<usize> = t.iter().map(|&x| b.index(x)).collect();
    assert!(idx.windows(2).all(|w| w[0] <= w[1]), "the bucket index is not monotone");
    for bk in 0..128 {
        let below = idx.iter().filter(|&&i| i < bk).count();
        let inside: Vec<f32> = t.iter().zip(&idx).filter(|&(_, &i)| i == bk).map(|(&x, _)| x).collect();
        assert!(inside.len() <= 3, "bucket {bk} holds {} thresholds", inside.len());
        b.code[bk] = below as u8;
        for k in 0..3 {
            let bytes = inside.get(k).copied().unwrap_or(f32::INFINITY).to_le_bytes();
            for (plane, &byte) in b.thr[k].iter_mut().zip(&bytes) {
                plane[bk] = byte;
            }
        }
    }
    b
}

/// The map of `exp_avg`.
pub fn signed() -> &'static Map {
    static M: OnceLock<Map> = OnceLock::new();
    M.get_or_init(|| Map::build(&maps::SIGNED))
}

/// The map of `exp_avg_sq` and `max_exp_avg_sq`.
pub fn unsigned() -> &'static Map {
    static M: OnceLock<Map> = OnceLock::new();
    M.get_or_init(|| Map::build(&maps::UNSIGNED))
}

/// `torch.amax(|x|).clip(1e-12)`: NaN if any element is NaN. Lane-wise, so that it vectorizes.
#[inline(always)]
pub fn absmax(x: &[f32; QBLOCK]) -> f32 {
    let mut a = [0.0f32; LANES];
    let mut nan = [false; LANES];
    for b in x.as_chunks::<LANES>().0 {
        for i in 0..LANES {
            let v = b[i].abs();
            nan[i] |= v.is_nan();
            a[i] = if v > a[i] { v } else { a[i] };
        }
    }
    if nan.iter().any(|&n| n) {
        return f32::NAN;
    }
    a.iter().fold(0.0f32, |m, &v| if v > m { v } else { m }).max(1e-12)
}

/// Quantizes one block with `map` by the specification's search; returns its absmax.
#[inline(always)]
pub fn quantize_block_ref(map: &Map, x: &[f32; QBLOCK], codes: &mut [u8; QBLOCK]) -> f32 {
    let s = absmax(x);
    for i in 0..QBLOCK {
        codes[i] = map.code_ref(x[i] / s);
    }
    s
}

/// Quantizes one block with `map` by the fast quantizer on path `I`; returns its absmax.
///
/// # Safety
/// The CPU supports `I`.
#[inline(always)]
pub unsafe fn quantize_block<I: Isa>(map: &Map, x: &[f32; QBLOCK], codes: &mut [u8; QBLOCK]) -> f32 {
    let s = absmax(x);
    if I::BYTE_PERMUTES {
        let (xb, cb) = (x.as_chunks::<64>().0, codes.as_chunks_mut::<64>().0);
        for (x, c) in xb.iter().zip(cb) {
            let y = x.map(|v| v / s);
            // SAFETY: the caller's contract.
            *c = unsafe { I::bucket_codes64(&map.buckets, &y) };
        }
        return s;
    }
    let (xb, cb) = (x.as_chunks::<LANES>().0, codes.as_chunks_mut::<LANES>().0);
    for (x, c) in xb.iter().zip(cb) {
        let y = x.map(|v| v / s);
        // SAFETY: the caller's contract.
        *c = unsafe { map.codes::<I>(&y) };
    }
    s
}

/// `map[code] * absmax` for one block, by the path's gathers, or 64 codes at a time by its byte
/// permutes.
///
/// # Safety
/// The CPU supports `I`.
#[inline(always)]
pub unsafe fn dequantize_block<I: Isa>(map: &Map, codes: &[u8; QBLOCK], s: f32, out: &mut [f32; QBLOCK]) {
    if I::BYTE_PERMUTES {
        let (cb, ob) = (codes.as_chunks::<64>().0, out.as_chunks_mut::<64>().0);
        for (c, o) in cb.iter().zip(ob) {
            // SAFETY: CPU support is the caller's contract.
            let q = unsafe { I::lookup256x64(&map.planes, c) };
            *o = q.map(|v| v * s);
        }
        return;
    }
    let (cb, ob) = (codes.as_chunks::<LANES>().0, out.as_chunks_mut::<LANES>().0);
    for (c, o) in cb.iter().zip(ob) {
        // SAFETY: CPU support is the caller's contract.
        let q = unsafe { I::lookup256(&map.q, c) };
        *o = q.map(|v| v * s);
    }
}

/// Quantizes `x` (a multiple of [`QBLOCK`] elements) into `codes` and `absmax` (conversions
/// of loaded state: the portable path, the same codes as every path).
pub fn quantize<C: Codec>(map: &C, x: &[f32], codes: &mut [u8], scales: &mut [f32]) {
    let (xb, codes) = (x.as_chunks::<QBLOCK>().0, codes.as_chunks_mut::<QBLOCK>().0);
    for ((x, c), s) in xb.iter().zip(codes).zip(scales) {
        // SAFETY: the portable path runs on every CPU.
        *s = unsafe { map.quantize::<Generic>(x, c) };
    }
}

/// Dequantizes `codes` and `absmax` (or scales) into `out`.
pub fn dequantize<C: Codec>(map: &C, codes: &[u8], scales: &[f32], out: &mut [f32]) {
    let (cb, ob) = (codes.as_chunks::<QBLOCK>().0, out.as_chunks_mut::<QBLOCK>().0);
    for ((c, o), &s) in cb.iter().zip(ob).zip(scales) {
        // SAFETY: the portable path runs on every CPU.
        unsafe { map.dequantize::<Generic>(c, s, o) };
    }
}

/// ATen's `lerp` with a scalar weight, as its vectorized body computes it (one rounding): both
/// of its forms computed and one kept (`small`: `|w| < 0.5`), so that the loop vectorizes.
#[inline(always)]
fn lerp(a: f32, b: f32, w: f32, small: bool) -> f32 {
    let d = b - a;
    let lo = w.mul_add(d, a);
    let hi = (w - 1.0).mul_add(d, b);
    if small {
        lo
    } else {
        hi
    }
}

/// One element's update with quantized moments. The moments follow torchao's
/// `single_param_adam` exactly (what the codes are made from): the gradient, with the L2 term
/// `g + wd * p` unfused, then `lerp` for both moments. The weight follows torch's AdamW as the
/// float32 kernel computes it (`p * (1 - lr * wd)`, then `p - step_size * m / (sqrt(v) / sqrt(bc2)
/// + eps)` with one FMA and a multiply by `1 / sqrt(bc2)`), with the unquantized moments.
///
/// Branch-free (selects on uniform flags), so that LLVM vectorizes the lane loop.
///
/// With `DELTA`, the first result is the update (decay included) instead of the new weight:
/// what Kahan weights add.
#[inline(always)]
fn element<const AMS: bool, const DELTA: bool>(
    c: &Consts,
    p: f32,
    g: f32,
    m: f32,
    v: f32,
    x: f32,
) -> (f32, f32, f32, f32) {
    let g = g * c.gscale;
    let g_l2 = g + c.l2 * p;
    let g = if c.use_l2 { g_l2 } else { g };
    let m = lerp(m, g, c.b1c, c.b1c.abs() < 0.5);
    let v = lerp(v, g * g, c.b2c, c.b2c.abs() < 0.5);
    let x = if AMS { nan_max(x, v) } else { v };
    let denom = x.sqrt().mul_add(c.inv_bc2_sqrt, c.eps);
    let p = if DELTA {
        (p * c.decay - p) + c.neg_step_size * (m / denom)
    } else {
        c.neg_step_size.mul_add(m / denom, p * c.decay)
    };
    (p, m, v, x)
}

/// Lane blocks per quantization block.
const SUB: usize = QBLOCK / LANES;

/// A block's values on a cache line boundary: the lane loops' vector loads and stores then never
/// split a line (a plain `[f32; QBLOCK]` on the stack is only 4-byte aligned).
#[repr(C, align(64))]
struct Values([f32; QBLOCK]);

impl std::ops::Deref for Values {
    type Target = [f32; QBLOCK];
    #[inline(always)]
    fn deref(&self) -> &[f32; QBLOCK] {
        &self.0
    }
}

impl std::ops::DerefMut for Values {
    #[inline(always)]
    fn deref_mut(&mut self) -> &mut [f32; QBLOCK] {
        &mut self.0
    }
}

/// One quantization block's codes, float (absmax or scale) and dequantized values.
struct Moment<'s, 'a, C: Codec> {
    m: &'s mut Q8Mut<'a>,
    map: &'static C,
    x: Values,
}

impl<'s, 'a, C: Codec> Moment<'s, 'a, C> {
    /// # Safety
    /// The CPU supports `I`.
    #[inline(always)]
    unsafe fn open<I: Isa>(m: &'s mut Q8Mut<'a>, map: &'static C, qb: usize) -> Moment<'s, 'a, C> {
        let mut x = Values([0.0; QBLOCK]);
        // SAFETY: the caller's contract.
        unsafe { map.dequantize::<I>(&m.codes.as_chunks::<QBLOCK>().0[qb], m.absmax[qb], &mut x) };
        Moment { m, map, x }
    }
    /// With `EXACT`, the specification's search; otherwise the fast quantizer on `I`.
    ///
    /// # Safety
    /// The CPU supports `I`.
    #[inline(always)]
    unsafe fn close<I: Isa, const EXACT: bool>(self, qb: usize) {
        let codes = &mut self.m.codes.as_chunks_mut::<QBLOCK>().0[qb];
        self.m.absmax[qb] = if EXACT {
            self.map.quantize_ref(&self.x, codes)
        } else {
            // SAFETY: the caller's contract.
            unsafe { self.map.quantize::<I>(&self.x, codes) }
        };
    }
}

/// The specification of the quantized update: element by element in [`element`], the search
/// quantizer. `out`: the low-precision weight copy (see `Segment`); with `inout` the gradients
/// are read from it (and `g` is empty).
pub fn update_ref<G: Elem, O: Elem, C: Codec, const AMS: bool>(
    c: &Consts,
    p: &mut [f32],
    g: &[G],
    mut m: Q8Mut<'_>,
    mut v: Q8Mut<'_>,
    mut x: Option<Q8Mut<'_>>,
    mut out: Option<&mut [O]>,
    inout: bool,
    mut kahan: Option<Kahan<'_>>,
) {
    let n = kahan.as_ref().map_or(p.len(), |k| k.w.len());
    for qb in 0..n / QBLOCK {
        // SAFETY: the portable path runs on every CPU.
        let mut mm = unsafe { Moment::open::<Generic>(&mut m, C::first(), qb) };
        let mut vv = unsafe { Moment::open::<Generic>(&mut v, C::second(), qb) };
        let mut xx = x
            .as_mut()
            .map(|x| unsafe { Moment::open::<Generic>(x, C::second(), qb) });
        for j in 0..QBLOCK {
            let i = qb * QBLOCK + j;
            let gi = match out.as_deref_mut() {
                _ if kahan.is_some() => 0.0, // read below
                Some(o) if inout => {
                    let gi = o[i].to_f32();
                    o[i] = O::from_f32(p[i]); // the slot now holds the master: no resync
                    gi
                }
                _ => g[i].to_f32(),
            };
            if let Some(o) = out.as_deref() {
                if O::from_f32(p[i]) != o[i] {
                    p[i] = o[i].to_f32();
                }
            }
            let x0 = xx.as_ref().map_or(0.0, |x| x.x[j]);
            if let Some(k) = kahan.as_mut() {
                let p0 = k.w[i].to_f32();
                let (u, mn, vn, xn) = element::<AMS, true>(c, p0, g[i].to_f32(), mm.x[j], vv.x[j], x0);
                let c1 = Bf16::from_f32(k.comp[i].to_f32() + u).to_f32();
                let p1 = Bf16::from_f32(p0 + c1);
                let lost = Bf16::from_f32(p0 - p1.to_f32()).to_f32();
                (k.w[i], k.comp[i]) = (p1, Bf16::from_f32(c1 + lost));
                (mm.x[j], vv.x[j]) = (mn, vn);
                if let Some(x) = xx.as_mut() {
                    x.x[j] = xn;
                }
                continue;
            }
            let (pn, mn, vn, xn) = element::<AMS, false>(c, p[i], gi, mm.x[j], vv.x[j], x0);
            p[i] = pn;
            (mm.x[j], vv.x[j]) = (mn, vn);
            if let Some(x) = xx.as_mut() {
                x.x[j] = xn;
            }
            if let Some(o) = out.as_deref_mut() {
                o[i] = O::from_f32(pn);
            }
        }
        // SAFETY: the portable path runs on every CPU.
        unsafe {
            mm.close::<Generic, true>(qb);
            vv.close::<Generic, true>(qb);
            if let Some(x) = xx {
                x.close::<Generic, true>(qb);
            }
        }
    }
}

/// A lane block of the copy's buffer read as float32 (the gradient, in the in-place mode).
///
/// # Safety
/// The CPU supports `I`; `b` is a full block of `out`.
#[inline(always)]
unsafe fn out_grad<I: Isa>(out: &OutMut<'_>, b: usize) -> Block {
    unsafe {
        match out {
            OutMut::Bf16(o) => <crate::elem::Bf16 as BlockIo>::load::<I>(o.as_chunks::<LANES>().0.get_unchecked(b)),
            OutMut::F16(o) => <crate::elem::F16 as BlockIo>::load::<I>(o.as_chunks::<LANES>().0.get_unchecked(b)),
            OutMut::None => [0.0; LANES],
        }
    }
}

/// The block loop of the quantized update: per quantization block, dequantize the moments,
/// update its lane blocks (the same [`element`] as the specification), quantize the new moments
/// with the fast quantizer. `g` None: the gradients are in `out` (the in-place mode).
///
/// # Safety
/// The CPU supports `I`; every slice has `p.len()` elements, a multiple of [`QBLOCK`] (the
/// moments' codes too, their absmax one per block), `out` too if it is a copy.
#[inline(always)]
pub(super) unsafe fn body<I: Isa, G: BlockIo, C: Codec, const AMS: bool>(
    c: &Consts,
    p: &mut [f32],
    g: Option<&[G]>,
    mut m: Q8Mut<'_>,
    mut v: Q8Mut<'_>,
    mut x: Option<Q8Mut<'_>>,
    out: &mut OutMut<'_>,
    kahan: Option<Kahan<'_>>,
) {
    let full = kahan.as_ref().map_or(p.len(), |k| k.w.len()) / LANES;
    let pb = p.as_chunks_mut::<LANES>().0;
    let gb = g.map(|g| g.as_chunks::<LANES>().0);
    let (wb, cb) = match kahan {
        Some(k) => (k.w.as_chunks_mut::<LANES>().0, k.comp.as_chunks_mut::<LANES>().0),
        None => (&mut [][..], &mut [][..]),
    };
    for qb in 0..full / SUB {
        // SAFETY: the CPU supports `I` (the caller's contract).
        let mut mm = unsafe { Moment::open::<I>(&mut m, C::first(), qb) };
        let mut vv = unsafe { Moment::open::<I>(&mut v, C::second(), qb) };
        let mut xx = if AMS {
            x.as_mut().map(|x| unsafe { Moment::open::<I>(x, C::second(), qb) })
        } else {
            None
        };
        for k in 0..SUB {
            let b = qb * SUB + k;
            // SAFETY: `b` < `full`, the blocks of every slice (the caller's lengths); the CPU
            // supports `I` (the caller's contract).
            unsafe {
                let ahead = b + PREFETCH_BLOCKS;
                if ahead < full {
                    I::prefetch(pb.as_ptr().wrapping_add(ahead) as *const u8);
                    I::prefetch(wb.as_ptr().wrapping_add(ahead) as *const u8);
                    if let Some(gb) = gb {
                        I::prefetch(gb.as_ptr().wrapping_add(ahead) as *const u8);
                    }
                }
                let kahan = !wb.is_empty();
                let mut pk: Block = if kahan {
                    Bf16::load::<I>(wb.get_unchecked(b))
                } else {
                    *pb.get_unchecked(b)
                };
                let p0 = pk;
                let gk = match gb {
                    Some(gb) => {
                        out_block::<I, false>(&mut pk, out, b);
                        G::load::<I>(gb.get_unchecked(b))
                    }
                    None => out_grad::<I>(out, b),
                };
                let x0 = match &xx {
                    Some(x) => &x.x[k * LANES..(k + 1) * LANES],
                    None => &[0.0; LANES][..],
                };
                let mut xn = [0.0f32; LANES];
                for i in 0..LANES {
                    let j = k * LANES + i;
                    let (pn, mn, vn, xi) = if kahan {
                        element::<AMS, true>(c, pk[i], gk[i], mm.x[j], vv.x[j], x0[i])
                    } else {
                        element::<AMS, false>(c, pk[i], gk[i], mm.x[j], vv.x[j], x0[i])
                    };
                    pk[i] = pn;
                    mm.x[j] = mn;
                    vv.x[j] = vn;
                    xn[i] = xi;
                }
                if let Some(x) = xx.as_mut() {
                    x.x[k * LANES..(k + 1) * LANES].copy_from_slice(&xn);
                }
                if kahan {
                    kahan_add::<I>(wb.get_unchecked_mut(b), cb.get_unchecked_mut(b), &p0, &pk);
                } else {
                    *pb.get_unchecked_mut(b) = pk;
                    out_block::<I, true>(pb.get_unchecked_mut(b), out, b);
                }
            }
        }
        // SAFETY: as above.
        unsafe {
            mm.close::<I, false>(qb);
            vv.close::<I, false>(qb);
            if let Some(x) = xx {
                x.close::<I, false>(qb);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_maps_are_sorted_and_span_the_unit_interval() {
        for (m, lo) in [(signed(), -1.0f32), (unsigned(), 0.0)] {
            assert!(m.q.windows(2).all(|w| w[0] < w[1]));
            assert!(m.q[0] >= lo && m.q[0] < lo + 0.01 && m.q[255] == 1.0);
            assert!(m.q.contains(&0.0));
        }
    }

    /// The fast quantizer equals the search on every float near every code boundary and every
    /// bucket edge, on a million spread over [-1, 1], and on NaN.
    #[test]
    fn the_fast_code_is_the_search_on_every_float_that_matters() {
        for m in [signed(), unsigned()] {
            let check = |y: f32| {
                assert_eq!(m.code(y), m.code_ref(y), "y = {y:e} ({:#x})", y.to_bits());
                // The thresholds' search (the in-register paths' specification) too.
                assert_eq!(crate::isa::search256_lane(&m.tree, y), m.code_ref(y), "tree, y = {y:e}");
            };
            for idx in 0..BUCKETS as u32 {
                let thr = m.table[idx as usize] >> 8;
                let (sign, mag) = ((idx / HALF) << 31, idx % HALF);
                if thr < NONE {
                    for low in thr.saturating_sub(3)..=(thr + 3).min(0xffff) {
                        check(f32::from_bits(sign | (mag << 16) | low).clamp(-1.0, 1.0));
                    }
                }
            }
            for idx in 0..(1u32 << 16) {
                for y in [f32::from_bits(idx << 16), f32::from_bits((idx << 16) | 0xffff)] {
                    if y.is_finite() && y.abs() <= 1.0 {
                        check(y);
                    }
                }
            }
            let mut s = 0x9e37_79b9_7f4a_7c15u64;
            for _ in 0..1_000_000 {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                let y = ((s >> 40) as f32 / (1u64 << 23) as f32 - 1.0) * 10f32.powi(-((s & 7) as i32));
                check(y);
            }
            // Each threshold of the tree and its neighbours.
            for &t in &m.tree[1..] {
                let b = t.to_bits();
                for y in [t, f32::from_bits(b.wrapping_sub(1)), f32::from_bits(b + 1)] {
                    if y.is_finite() && y.abs() <= 1.0 {
                        check(y);
                    }
                }
            }
            assert_eq!(m.code(f32::NAN), 0);
            assert_eq!(m.code_ref(f32::NAN), 0);
            assert_eq!(crate::isa::search256_lane(&m.tree, f32::NAN), 0);
            check(0.0);
            check(-0.0);
            check(1.0);
            check(-1.0);
        }
    }

    /// The in-register lookups of the AVX-512 VBMI paths against the specification (where the
    /// CPU has them; elsewhere the test says it did not run).
    #[test]
    fn the_in_register_lookups_are_the_tables() {
        #[cfg(target_arch = "x86_64")]
        {
            use crate::isa::{Avx512Vbmi, Simd};
            if !Simd::Avx512Vbmi.supported() {
                eprintln!("skipped: this CPU has no AVX-512 VBMI");
                return;
            }
            #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,avx2,fma,f16c")]
            unsafe fn run(m: &Map, y: &Block, c: &[u8; LANES]) -> ([u8; LANES], Block) {
                unsafe { (Avx512Vbmi::search256(&m.tree, y), Avx512Vbmi::lookup256(&m.q, c)) }
            }
            let mut s = 0x2545_f491_4f6c_dd1du64;
            for m in [signed(), unsigned()] {
                for round in 0..200_000u32 {
                    let mut y = [0.0f32; LANES];
                    let mut c = [0u8; LANES];
                    for i in 0..LANES {
                        s ^= s << 13;
                        s ^= s >> 7;
                        s ^= s << 17;
                        let t = m.tree[1 + (s as usize % 255)];
                        // thresholds, their neighbours, and spread values
                        y[i] = match s >> 62 {
                            0 => t,
                            1 => f32::from_bits(t.to_bits().wrapping_add(((s >> 32) % 5) as u32).wrapping_sub(2)),
                            _ => ((s >> 40) as f32 / (1u64 << 23) as f32 - 1.0) * 10f32.powi(-(((s >> 8) & 7) as i32)),
                        };
                        if round == 0 && i == 0 {
                            y[i] = f32::NAN;
                        }
                        c[i] = (s >> 16) as u8;
                    }
                    let (codes, vals) = unsafe { run(m, &y, &c) };
                    for i in 0..LANES {
                        if y[i].is_nan() || y[i].abs() <= 1.0 {
                            assert_eq!(codes[i], m.code_ref(y[i]), "y = {:e}", y[i]);
                        }
                        assert_eq!(vals[i].to_bits(), m.q[c[i] as usize].to_bits());
                    }
                }
            }
        }
    }

    /// Every float near every threshold, bucket edge and binade edge of the bucket table (4 ulps
    /// either side), a dense sample of [-1, 1] (every float whose low 12 bits are one of five
    /// patterns), a million spread ones, NaN, the zeros and the ends.
    fn bucket_probes(m: &Map) -> Vec<f32> {
        let mut ys = Vec::new();
        let near = |y: f32, ys: &mut Vec<f32>| {
            for d in -4i32..=4 {
                let f = f32::from_bits(y.to_bits().wrapping_add_signed(d));
                if f.is_finite() && f.abs() <= 1.0 {
                    ys.push(f);
                }
                let f = f32::from_bits((-y).to_bits().wrapping_add_signed(d));
                if f.is_finite() && f.abs() <= 1.0 {
                    ys.push(f);
                }
            }
        };
        for &t in &m.tree[1..] {
            near(t, &mut ys);
        }
        // bucket edges: the first float (upwards from 0, both signs) of each new bucket
        for sign in [0u32, 0x8000_0000] {
            let mut last = usize::MAX;
            let mut bits = 0u32;
            while bits <= 0x3f80_0000 {
                // bisection for the next change of bucket within the magnitudes
                let y = f32::from_bits(sign | bits);
                let i = m.buckets.index(m.buckets.clamp(y));
                if i != last {
                    near(y, &mut ys);
                    last = i;
                }
                let (mut lo, mut hi) = (bits, 0x3f80_0001u32);
                while hi - lo > 1 {
                    let mid = lo + (hi - lo) / 2;
                    if m.buckets.index(m.buckets.clamp(f32::from_bits(sign | mid))) == i {
                        lo = mid;
                    } else {
                        hi = mid;
                    }
                }
                bits = hi;
            }
        }
        for e in 90..=127u32 {
            near(f32::from_bits(e << 23), &mut ys);
        }
        for hi in 0..=(0x3f80_0000u32 >> 12) {
            for low in [0u32, 1, 0x7ff, 0x800, 0xfff] {
                for sign in [0u32, 0x8000_0000] {
                    let y = f32::from_bits(sign | (hi << 12) | low);
                    if y.abs() <= 1.0 {
                        ys.push(y);
                    }
                }
            }
        }
        let mut s = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..1_000_000 {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ys.push(((s >> 40) as f32 / (1u64 << 23) as f32 - 1.0) * 10f32.powi(-((s & 7) as i32)));
        }
        ys.extend([f32::NAN, -f32::NAN, 0.0, -0.0, 1.0, -1.0]);
        while ys.len() % 64 != 0 {
            ys.push(0.5);
        }
        ys
    }

    /// The bucket quantizer (the VBMI paths' encode) is the search: its lane specification, and
    /// the vector code where the CPU has it, on every float of [`bucket_probes`].
    #[test]
    fn the_bucket_code_is_the_search() {
        for m in [signed(), unsigned()] {
            let ys = bucket_probes(m);
            for &y in &ys {
                assert_eq!(m.buckets.code_lane(y), m.code_ref(y), "y = {y:e} ({:#x})", y.to_bits());
            }
            for y in ys.as_chunks::<64>().0 {
                let got = unsafe { Generic::bucket_codes64(&m.buckets, y) };
                assert!((0..64).all(|i| got[i] == m.code_ref(y[i])));
            }
            #[cfg(target_arch = "x86_64")]
            {
                use crate::isa::{Avx512Vbmi, Simd};
                if !Simd::Avx512Vbmi.supported() {
                    eprintln!("skipped: this CPU has no AVX-512 VBMI");
                    continue;
                }
                #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,avx2,fma,f16c")]
                unsafe fn run(m: &Map, y: &[f32; 64]) -> [u8; 64] {
                    unsafe { Avx512Vbmi::bucket_codes64(&m.buckets, y) }
                }
                for y in ys.as_chunks::<64>().0 {
                    let got = unsafe { run(m, y) };
                    for i in 0..64 {
                        assert_eq!(got[i], m.code_ref(y[i]), "y = {:e} ({:#x})", y[i], y[i].to_bits());
                    }
                }
            }
        }
    }

    /// Every float32 of [-1, 1] through the VBMI paths' bucket quantizer against the search
    /// (about 2^31 per map: a minute or so; `cargo test --release -- --ignored every_float`).
    #[test]
    #[ignore]
    fn every_float_of_the_unit_interval_by_buckets_is_the_search() {
        #[cfg(target_arch = "x86_64")]
        {
            use crate::isa::{Avx512Vbmi, Simd};
            if !Simd::Avx512Vbmi.supported() {
                eprintln!("skipped: this CPU has no AVX-512 VBMI");
                return;
            }
            #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,avx2,fma,f16c")]
            unsafe fn run(m: &Map, y: &[f32; 64]) -> [u8; 64] {
                unsafe { Avx512Vbmi::bucket_codes64(&m.buckets, y) }
            }
            for m in [signed(), unsigned()] {
                for sign in [0u32, 0x8000_0000] {
                    let mut bits = 0u32;
                    while bits <= 0x3f80_0000 {
                        let y: [f32; 64] =
                            std::array::from_fn(|i| f32::from_bits(sign | (bits + i as u32).min(0x3f80_0000)));
                        let got = unsafe { run(m, &y) };
                        for i in 0..64 {
                            assert_eq!(got[i], m.code_ref(y[i]), "y = {:e}", y[i]);
                        }
                        bits += 64;
                    }
                }
            }
        }
    }

    /// The byte-permute lookups (the VBMI paths' decode of 64 codes) against the tables: every
    /// code in every one of the 64 positions, for both maps and the fp8 codes.
    #[test]
    fn the_byte_lookups_are_the_tables() {
        use crate::kernel::fp8;
        // The portable specification first: the planes are the map.
        let idx: [[u8; 64]; 4] = std::array::from_fn(|k| std::array::from_fn(|i| (64 * k + i) as u8));
        for m in [signed(), unsigned()] {
            for c in &idx {
                let got = unsafe { Generic::lookup256x64(&m.planes, c) };
                for i in 0..64 {
                    assert_eq!(got[i].to_bits(), m.q[c[i] as usize].to_bits());
                }
            }
        }
        #[cfg(target_arch = "x86_64")]
        {
            use crate::isa::{Avx512Vbmi, Simd};
            if !Simd::Avx512Vbmi.supported() {
                eprintln!("skipped: this CPU has no AVX-512 VBMI");
                return;
            }
            #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,avx2,fma,f16c")]
            unsafe fn run(m: &Map, c: &[u8; 64]) -> ([f32; 64], [f32; 64]) {
                let mut q = [0.0f32; QBLOCK];
                let mut codes = [0u8; QBLOCK];
                codes[..64].copy_from_slice(c);
                unsafe { fp8::FP8.dequantize::<Avx512Vbmi>(&codes, 1.0, &mut q) };
                let f: [f32; 64] = q[..64].try_into().unwrap();
                (unsafe { Avx512Vbmi::lookup256x64(&m.planes, c) }, f)
            }
            for m in [signed(), unsigned()] {
                for rot in 0..256usize {
                    let c: [u8; 64] = std::array::from_fn(|i| ((i * 4 + rot) % 256) as u8);
                    let c2: [u8; 64] = std::array::from_fn(|i| ((i * 4 + rot + 1 + i / 16) % 256) as u8);
                    for c in [c, c2] {
                        let (q, f) = unsafe { run(m, &c) };
                        for i in 0..64 {
                            assert_eq!(q[i].to_bits(), m.q[c[i] as usize].to_bits(), "code {} at {i}", c[i]);
                            assert_eq!(f[i].to_bits(), fp8::decode(c[i]).to_bits(), "fp8 {} at {i}", c[i]);
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn a_block_round_trips_to_its_nearest_codes() {
        let x: [f32; QBLOCK] = std::array::from_fn(|i| ((i as f32) - 128.0) * 1e-3);
        let mut c = [0u8; QBLOCK];
        let s = unsafe { quantize_block::<Generic>(signed(), &x, &mut c) };
        assert_eq!(s, 0.128);
        let mut back = [0.0; QBLOCK];
        unsafe { dequantize_block::<Generic>(signed(), &c, s, &mut back) };
        for i in 0..QBLOCK {
            // Nearest code: no other code is closer.
            let y = x[i] / s;
            let best = signed().q.iter().map(|q| (q - y).abs()).fold(f32::INFINITY, f32::min);
            assert!(((signed().q[c[i] as usize] - y).abs() - best).abs() <= 1e-6, "{i}");
        }
        assert_eq!(back[0], signed().q[0] * s); // the signed map ends at -0.99297, not -1
        let z = [0.0f32; QBLOCK];
        assert_eq!(unsafe { quantize_block::<Generic>(unsigned(), &z, &mut c) }, 1e-12);
        assert!(c.iter().all(|&k| unsigned().q[k as usize] == 0.0));
    }
}
