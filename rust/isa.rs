//! Run-time SIMD dispatch.
//!
//! The kernel in `kernel/` is written once, over blocks of [`LANES`] `f32` lanes, in plain Rust
//! that LLVM vectorizes. Here it is compiled several times, each time inside a function with
//! `#[target_feature]` (AVX-512, AVX2+FMA, NEON), and one of them is picked once at run time, so
//! one wheel runs on any x86-64 or aarch64 CPU. Where a CPU has conversion instructions LLVM will
//! not produce by itself (F16C, AVX512-BF16), the [`Isa`] impl of that path uses them.
//!
//! `OFFLOAD_ADAM_SIMD=scalar|avx2|avx512|avx512vbmi|avx512bf16|avx512bf16vbmi|neon` forces a path; `scalar` is the reference
//! implementation of `kernel::reference`, the specification the others are tested against.

use std::sync::OnceLock;

use crate::error::{Error, Result};

use crate::elem::{bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16};

/// Lanes of one block: the kernel's unit of work, whatever the vector width.
pub const LANES: usize = 16;
/// One block of `f32` lanes.
pub type Block = [f32; LANES];

/// The CPU features of each x86 path, written once: the run-time check ([`Simd::supported`])
/// and the `#[target_feature]` of the code paths (the kernel's, `kernel/path.rs`; the linear
/// kernel's, `linear/tile.rs`) are all made from this table. `simd_features!(Avx512, m!(args))` expands to `m!(args "avx2" "fma" ...)`: a
/// path's features are its base path's and its own.
macro_rules! simd_features {
    (Avx2, $m:ident!($($a:tt)*)) => { $m! { $($a)* "avx2" "fma" "f16c" } };
    (Avx512, $m:ident!($($a:tt)*)) => {
        $crate::isa::simd_features! { Avx2, $m!($($a)* "avx512f" "avx512bw" "avx512vl" "avx512dq") }
    };
    (Avx512Bf16, $m:ident!($($a:tt)*)) => { $crate::isa::simd_features! { Avx512, $m!($($a)* "avx512bf16") } };
    (Avx512Vbmi, $m:ident!($($a:tt)*)) => { $crate::isa::simd_features! { Avx512, $m!($($a)* "avx512vbmi") } };
    (Avx512Bf16Vbmi, $m:ident!($($a:tt)*)) => { $crate::isa::simd_features! { Avx512Bf16, $m!($($a)* "avx512vbmi") } };
}
pub(crate) use simd_features;

/// A code path of the kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Simd {
    /// The scalar reference implementation (the specification).
    Scalar,
    /// AVX2 + FMA + F16C.
    Avx2,
    /// AVX-512 F/BW/VL/DQ + FMA + F16C.
    Avx512,
    /// AVX-512 as above plus the BF16 conversion instructions.
    Avx512Bf16,
    /// [`Simd::Avx512`] on a CPU with AVX-512 VBMI (Ice Lake, Zen 4 and later, whose
    /// two-register permutes are fast): the 8-bit moments' 256-entry lookups in registers.
    Avx512Vbmi,
    /// [`Simd::Avx512Bf16`] with the lookups of [`Simd::Avx512Vbmi`].
    Avx512Bf16Vbmi,
    /// aarch64 Advanced SIMD.
    Neon,
}

impl Simd {
    pub fn name(self) -> &'static str {
        match self {
            Simd::Scalar => "scalar",
            Simd::Avx2 => "avx2",
            Simd::Avx512 => "avx512",
            Simd::Avx512Bf16 => "avx512bf16",
            Simd::Avx512Vbmi => "avx512vbmi",
            Simd::Avx512Bf16Vbmi => "avx512bf16vbmi",
            Simd::Neon => "neon",
        }
    }

    pub fn parse(s: &str) -> Option<Simd> {
        Some(match s.trim().to_ascii_lowercase().as_str() {
            "scalar" => Simd::Scalar,
            "avx2" => Simd::Avx2,
            "avx512" => Simd::Avx512,
            "avx512bf16" => Simd::Avx512Bf16,
            "avx512vbmi" => Simd::Avx512Vbmi,
            "avx512bf16vbmi" => Simd::Avx512Bf16Vbmi,
            "neon" => Simd::Neon,
            _ => return None,
        })
    }

    /// Whether this CPU can run the path: it has every feature [`simd_features`] lists for it.
    pub fn supported(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        macro_rules! detected {
            ($($f:tt)*) => { true $(&& is_x86_feature_detected!($f))* };
        }
        match self {
            Simd::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Simd::Avx2 => simd_features!(Avx2, detected!()),
            #[cfg(target_arch = "x86_64")]
            Simd::Avx512 => simd_features!(Avx512, detected!()),
            #[cfg(target_arch = "x86_64")]
            Simd::Avx512Bf16 => simd_features!(Avx512Bf16, detected!()),
            #[cfg(target_arch = "x86_64")]
            Simd::Avx512Vbmi => simd_features!(Avx512Vbmi, detected!()),
            #[cfg(target_arch = "x86_64")]
            Simd::Avx512Bf16Vbmi => simd_features!(Avx512Bf16Vbmi, detected!()),
            #[cfg(target_arch = "aarch64")]
            Simd::Neon => std::arch::is_aarch64_feature_detected!("neon"),
            #[allow(unreachable_patterns)]
            _ => false,
        }
    }

    /// Every path this CPU can run, best last.
    pub fn available() -> Vec<Simd> {
        [
            Simd::Scalar,
            Simd::Neon,
            Simd::Avx2,
            Simd::Avx512,
            Simd::Avx512Vbmi,
            Simd::Avx512Bf16,
            Simd::Avx512Bf16Vbmi,
        ]
        .into_iter()
        .filter(|s| s.supported())
        .collect()
    }

    /// The best path of this CPU.
    pub fn best() -> Simd {
        *Simd::available().last().unwrap_or(&Simd::Scalar)
    }
}

/// The path used when a caller names none: `OFFLOAD_ADAM_SIMD` if set, else the best one.
/// Read once; an unknown or unsupported name is an error the caller reports.
pub fn default_simd() -> Result<Simd> {
    static CHOICE: OnceLock<Result<Simd>> = OnceLock::new();
    CHOICE
        .get_or_init(|| match std::env::var("OFFLOAD_ADAM_SIMD") {
            Ok(v) if !v.trim().is_empty() && v.trim() != "auto" => resolve(&v),
            _ => Ok(Simd::best()),
        })
        .clone()
}

/// Parse a path name and check that this CPU runs it.
pub fn resolve(name: &str) -> Result<Simd> {
    let s = Simd::parse(name).ok_or_else(|| {
        Error::Value(format!(
            "unknown SIMD path {name:?}: expected one of scalar, avx2, avx512, avx512vbmi, avx512bf16, avx512bf16vbmi, neon, auto"
        ))
    })?;
    if !s.supported() {
        let have: Vec<_> = Simd::available().iter().map(|s| s.name()).collect();
        return Err(Error::Value(format!(
            "SIMD path {name:?} is not supported by this CPU (available: {})",
            have.join(", ")
        )));
    }
    Ok(s)
}

/// Block conversions a path may do with its own instructions. The defaults are the portable,
/// branch-free conversions of `elem.rs`, which LLVM vectorizes.
///
/// # Safety
/// Implementations may use instructions of their path: call them only from code running on a CPU
/// that supports that path (`kernel::path::dispatch` checks this once).
pub unsafe trait Isa: Copy + Send + Sync + 'static {
    /// Hints that the cache line at `p` will be read soon. Never faults (any address is fine).
    #[inline(always)]
    fn prefetch(_p: *const u8) {}
    /// # Safety
    /// The CPU supports the path (trait contract).
    #[inline(always)]
    unsafe fn bf16_load(src: &[u16; LANES]) -> Block {
        src.map(bf16_to_f32)
    }
    /// # Safety
    /// The CPU supports the path (trait contract).
    #[inline(always)]
    unsafe fn bf16_store(x: &Block) -> [u16; LANES] {
        x.map(f32_to_bf16)
    }
    /// # Safety
    /// The CPU supports the path (trait contract).
    #[inline(always)]
    unsafe fn f16_load(src: &[u16; LANES]) -> Block {
        src.map(f16_to_f32)
    }
    /// # Safety
    /// The CPU supports the path (trait contract).
    #[inline(always)]
    unsafe fn f16_store(x: &Block) -> [u16; LANES] {
        x.map(f32_to_f16)
    }
    /// `table[idx[i]]` in each lane (the 8-bit moments' lookups).
    ///
    /// # Safety
    /// The CPU supports the path; every index is in bounds (not checked: a gather instruction).
    #[inline(always)]
    unsafe fn gather_f32(table: &[f32], idx: &[u32; LANES]) -> Block {
        idx.map(|i| unsafe { *table.get_unchecked(i as usize) })
    }
    /// `table[idx[i]]` in each lane.
    ///
    /// # Safety
    /// The CPU supports the path; every index is in bounds (not checked: a gather instruction).
    #[inline(always)]
    unsafe fn gather_u32(table: &[u32], idx: &[u32; LANES]) -> [u32; LANES] {
        idx.map(|i| unsafe { *table.get_unchecked(i as usize) })
    }
    /// Whether [`Isa::search256`] runs in registers: then the 8-bit moments quantize with it
    /// instead of their bucket table's gathers.
    const SEARCH_IN_REGISTERS: bool = false;
    /// `table[idx[i]]` in each lane, for a 256-entry table (the 8-bit maps' values): the
    /// path's gather, or permutes of the table held in registers.
    ///
    /// # Safety
    /// The CPU supports the path.
    #[inline(always)]
    unsafe fn lookup256(table: &[f32; 256], idx: &[u8; LANES]) -> Block {
        // SAFETY: a u8 indexes 256 entries; CPU support is the caller's contract.
        unsafe { Self::gather_f32(&table[..], &idx.map(|i| i as u32)) }
    }
    /// In each lane, the number of thresholds `t` with `y >= t` among 255 sorted ones, found by a
    /// binary search over `tree` (level `l`'s `2^l` thresholds at `tree[2^l..2^(l+1)]`, the
    /// threshold of step `128 >> l` after `c` at `tree[2^l + (c >> (8 - l))]`; `tree[0]`
    /// unused). NaN counts none. Here one lane at a time: the specification of the paths that
    /// run it in registers.
    ///
    /// # Safety
    /// The CPU supports the path.
    #[inline(always)]
    unsafe fn search256(tree: &[f32; 256], y: &Block) -> [u8; LANES] {
        y.map(|y| search256_lane(tree, y))
    }
    /// Whether the path permutes bytes across two registers (`vpermi2b`, AVX-512 VBMI): then the
    /// block codecs decode 64 codes at a time through byte tables ([`Isa::lookup256x64`],
    /// [`Isa::lookup_bf16x64`]).
    const BYTE_PERMUTES: bool = false;
    /// `f32::from_le_bytes([planes[0][c], planes[1][c], planes[2][c], planes[3][c]])` for each of
    /// 64 codes `c`: a 256-entry float table held as its four byte planes (the 8-bit maps'
    /// values). Here one lane at a time: the specification of the paths with byte permutes.
    ///
    /// # Safety
    /// The CPU supports the path.
    #[inline(always)]
    unsafe fn lookup256x64(planes: &BytePlanes, idx: &[u8; 64]) -> [f32; 64] {
        let p = &planes.0;
        idx.map(|c| {
            let c = c as usize;
            f32::from_le_bytes([p[0][c], p[1][c], p[2][c], p[3][c]])
        })
    }
    /// The codes of 64 values by a bucket table, [`Buckets::code_lane`] in each lane. Here one
    /// lane at a time: the specification of the paths with byte permutes.
    ///
    /// # Safety
    /// The CPU supports the path.
    #[inline(always)]
    unsafe fn bucket_codes64(b: &Buckets, y: &[f32; 64]) -> [u8; 64] {
        y.map(|y| b.code_lane(y))
    }
    /// For each of 64 codes `c`, the float32 whose top two bytes are `hi[c & 0x7f] | (c & 0x80)`
    /// and `lo[c & 0x7f]` and whose low two bytes are zero (a bf16 value, its sign the code's
    /// top bit: the fp8 codes). Here one lane at a time: the specification of the paths with byte
    /// permutes.
    ///
    /// # Safety
    /// The CPU supports the path.
    #[inline(always)]
    unsafe fn lookup_bf16x64(hi: &[u8; 128], lo: &[u8; 128], idx: &[u8; 64]) -> [f32; 64] {
        idx.map(|c| {
            let k = (c & 0x7f) as usize;
            f32::from_bits((((hi[k] | (c & 0x80)) as u32) << 24) | ((lo[k] as u32) << 16))
        })
    }
}

/// The nearest codes of a monotone 256-level map by buckets ([`Isa::bucket_codes64`]): `y` is
/// first clamped from below at `floor` (`max(y, floor)` as `vmaxps` computes it: NaN gives
/// `floor`), then its bucket is `g = trunc(|y| * scale[e] + offset[e])` with `e` its magnitude's
/// binade (exponent bits, at least 96, mod 32), flipped for a negative `y` (`g ^ 0x7f`, the
/// offsets of a signed map holding 64 buckets per sign), and its code is the bucket's first code
/// plus the number of the bucket's (at most three) thresholds that `y` reaches. Built once per
/// map (`kernel/q8.rs`).
#[repr(C, align(64))]
pub struct Buckets {
    /// Per bucket: the code of its smallest float.
    pub code: [u8; 128],
    /// Per bucket, its thresholds `k = 0, 1, 2` (the smallest float of each next code, +inf where
    /// it has fewer), as byte planes: `thr[k][plane][bucket]`.
    pub thr: [[[u8; 128]; 4]; 3],
    /// Per binade `e & 31`: the bucket index's scale and offset.
    pub scale: [f32; 32],
    pub offset: [f32; 32],
    /// The clamp from below: -1 for a signed map, 0 for an unsigned one.
    pub floor: f32,
}

impl Buckets {
    /// The bucket of `y` (after the clamp): the specification of the vector code.
    #[inline(always)]
    pub fn index(&self, y: f32) -> usize {
        let bits = y.to_bits();
        let a = bits & 0x7fff_ffff;
        let e = ((a >> 23).max(96) & 31) as usize;
        let g = f32::from_bits(a).mul_add(self.scale[e], self.offset[e]) as i32;
        ((g ^ ((bits as i32) >> 31)) & 0x7f) as usize
    }
    /// `max(y, floor)` as `vmaxps` computes it (`floor` if `y` is NaN or not larger).
    #[inline(always)]
    pub fn clamp(&self, y: f32) -> f32 {
        if y > self.floor {
            y
        } else {
            self.floor
        }
    }
    /// Threshold `k` of bucket `b`.
    #[inline(always)]
    pub fn threshold(&self, k: usize, b: usize) -> f32 {
        let p = &self.thr[k];
        f32::from_le_bytes([p[0][b], p[1][b], p[2][b], p[3][b]])
    }
    /// The code of one `y`: the specification of [`Isa::bucket_codes64`].
    #[inline(always)]
    pub fn code_lane(&self, y: f32) -> u8 {
        let y = self.clamp(y);
        let b = self.index(y);
        let past = (0..3).filter(|&k| y >= self.threshold(k, b)).count() as u8;
        self.code[b].wrapping_add(past)
    }
}

/// A 256-entry float32 table as its four byte planes (plane 0: the least significant bytes), on
/// a cache line boundary: what [`Isa::lookup256x64`] permutes.
#[repr(C, align(64))]
pub struct BytePlanes(pub [[u8; 256]; 4]);

impl BytePlanes {
    pub fn new(table: &[f32; 256]) -> BytePlanes {
        BytePlanes(std::array::from_fn(|k| table.map(|v| v.to_le_bytes()[k])))
    }
}

/// [`Isa::search256`] for one lane.
#[inline(always)]
pub fn search256_lane(tree: &[f32; 256], y: f32) -> u8 {
    let mut c = 0usize;
    for l in 0..8 {
        if y >= tree[(1 << l) + (c >> (8 - l))] {
            c += 128 >> l;
        }
    }
    c as u8
}

/// Portable code, vectorized for whatever the compilation target has (NEON on aarch64).
#[derive(Clone, Copy)]
pub struct Generic;
// SAFETY: only the portable default conversions.
unsafe impl Isa for Generic {}

#[cfg(target_arch = "x86_64")]
pub use x86::{Avx2, Avx512, Avx512Bf16, Avx512Bf16Vbmi, Avx512Vbmi};

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{Block, Isa, LANES};
    use std::arch::x86_64::*;

    #[derive(Clone, Copy)]
    pub struct Avx2;
    #[derive(Clone, Copy)]
    pub struct Avx512;
    #[derive(Clone, Copy)]
    pub struct Avx512Bf16;
    /// [`Avx512`] with the 256-entry lookups in registers (CPUs with AVX-512 VBMI).
    #[derive(Clone, Copy)]
    pub struct Avx512Vbmi;
    /// [`Avx512Bf16`] with the 256-entry lookups in registers.
    #[derive(Clone, Copy)]
    pub struct Avx512Bf16Vbmi;

    /// `table[idx[i]]` for a 256-entry table held in 16 registers: eight two-register permutes
    /// (`vpermi2ps`: the index's low 5 bits pick one of 32 entries), then a blend tree on its bits
    /// 5, 6 and 7.
    ///
    /// # Safety
    /// AVX-512 F.
    #[inline(always)]
    unsafe fn lookup256_zmm(table: &[f32; 256], idx: &[u8; LANES]) -> Block {
        unsafe {
            let i = _mm512_cvtepu8_epi32(std::mem::transmute::<[u8; LANES], __m128i>(*idx));
            let t = table.as_ptr();
            let pair = |k: usize| {
                _mm512_permutex2var_ps(_mm512_loadu_ps(t.add(32 * k)), i, _mm512_loadu_ps(t.add(32 * k + 16)))
            };
            let bit = |b: i32| _mm512_test_epi32_mask(i, _mm512_set1_epi32(b));
            let (m5, m6, m7) = (bit(32), bit(64), bit(128));
            let q0 = _mm512_mask_blend_ps(m5, pair(0), pair(1));
            let q1 = _mm512_mask_blend_ps(m5, pair(2), pair(3));
            let q2 = _mm512_mask_blend_ps(m5, pair(4), pair(5));
            let q3 = _mm512_mask_blend_ps(m5, pair(6), pair(7));
            let r0 = _mm512_mask_blend_ps(m6, q0, q1);
            let r1 = _mm512_mask_blend_ps(m6, q2, q3);
            std::mem::transmute::<__m512, Block>(_mm512_mask_blend_ps(m7, r0, r1))
        }
    }

    /// [`Isa::search256`] in registers: levels 0 to 3 from one register of `tree[0..16]`
    /// (`vpermps`), level 4 from `tree[16..32]`, level 5 from `tree[32..64]` (one `vpermi2ps`),
    /// levels 6 and 7 from two and four `vpermi2ps` and a blend tree; each level one compare
    /// and one masked add.
    ///
    /// # Safety
    /// AVX-512 F.
    #[inline(always)]
    unsafe fn search256_zmm(tree: &[f32; 256], y: &Block) -> [u8; LANES] {
        unsafe {
            let y = std::mem::transmute::<Block, __m512>(*y);
            let t = tree.as_ptr();
            let reg = |k: usize| _mm512_loadu_ps(t.add(16 * k));
            let mut c = _mm512_setzero_si512();
            let step = |c: __m512i, thr: __m512, k: i32| {
                let ge = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(y, thr); // NaN: false
                _mm512_mask_add_epi32(c, ge, c, _mm512_set1_epi32(k))
            };
            let t0 = reg(0);
            // level 0: tree[1]; levels 1-3: tree[2^l + (c >> (8 - l))], all within tree[0..16]
            c = step(c, _mm512_permutexvar_ps(_mm512_set1_epi32(1), t0), 128);
            let at = |c: __m512i, shift: u32, base: i32| {
                _mm512_add_epi32(
                    _mm512_srlv_epi32(c, _mm512_set1_epi32(shift as i32)),
                    _mm512_set1_epi32(base),
                )
            };
            c = step(c, _mm512_permutexvar_ps(at(c, 7, 2), t0), 64);
            c = step(c, _mm512_permutexvar_ps(at(c, 6, 4), t0), 32);
            c = step(c, _mm512_permutexvar_ps(at(c, 5, 8), t0), 16);
            // level 4: tree[16 + (c >> 4)]
            c = step(c, _mm512_permutexvar_ps(at(c, 4, 0), reg(1)), 8);
            // level 5: tree[32 + (c >> 3)], 32 entries
            c = step(c, _mm512_permutex2var_ps(reg(2), at(c, 3, 0), reg(3)), 4);
            // level 6: tree[64 + (c >> 2)], 64 entries: bit 5 of the index picks the half
            let i6 = at(c, 2, 0);
            let h6 = _mm512_test_epi32_mask(i6, _mm512_set1_epi32(32));
            let t6 = _mm512_mask_blend_ps(
                h6,
                _mm512_permutex2var_ps(reg(4), i6, reg(5)),
                _mm512_permutex2var_ps(reg(6), i6, reg(7)),
            );
            c = step(c, t6, 2);
            // level 7: tree[128 + (c >> 1)], 128 entries: bits 5 and 6 of the index
            let i7 = at(c, 1, 0);
            let (h5, h6) = (
                _mm512_test_epi32_mask(i7, _mm512_set1_epi32(32)),
                _mm512_test_epi32_mask(i7, _mm512_set1_epi32(64)),
            );
            let lo = _mm512_mask_blend_ps(
                h5,
                _mm512_permutex2var_ps(reg(8), i7, reg(9)),
                _mm512_permutex2var_ps(reg(10), i7, reg(11)),
            );
            let hi = _mm512_mask_blend_ps(
                h5,
                _mm512_permutex2var_ps(reg(12), i7, reg(13)),
                _mm512_permutex2var_ps(reg(14), i7, reg(15)),
            );
            c = step(c, _mm512_mask_blend_ps(h6, lo, hi), 1);
            std::mem::transmute::<__m128i, [u8; LANES]>(_mm512_cvtepi32_epi8(c))
        }
    }

    /// Where the byte lookups take each of 64 codes so that their two-level unpack (bytes to
    /// words, words to dwords, `vpunpck*`, within each 128-bit lane) leaves the dwords in the
    /// codes' order: dword vector `k`'s 128-bit lane `L` then holds codes `16k + 4L .. 16k + 4L + 4`,
    /// which are at positions `16L + 4k ..` of the permuted codes (a transposition of 4-byte
    /// groups).
    const UNPACK_ORDER: [u8; 64] = {
        let mut o = [0u8; 64];
        let mut p = 0;
        while p < 64 {
            let (l, k, j) = (p / 16, (p / 4) % 4, p % 4);
            o[p] = (16 * k + 4 * l + j) as u8;
            p += 1;
        }
        o
    };

    /// 64 codes loaded and put in [`UNPACK_ORDER`].
    ///
    /// # Safety
    /// AVX-512 F/BW/VBMI.
    #[inline(always)]
    unsafe fn codes64(idx: &[u8; 64]) -> __m512i {
        unsafe {
            let order = _mm512_loadu_si512(UNPACK_ORDER.as_ptr() as *const _);
            _mm512_permutexvar_epi8(order, _mm512_loadu_si512(idx.as_ptr() as *const _))
        }
    }

    /// [`Isa::lookup256x64`] by byte permutes: per plane two `vpermi2b` (128 entries each, from
    /// two registers; the code's low 7 bits) and a blend on its top bit, then the planes
    /// interleaved into dwords.
    ///
    /// # Safety
    /// AVX-512 F/BW/VBMI.
    #[inline(always)]
    unsafe fn lookup256x64_zmm(planes: &super::BytePlanes, idx: &[u8; 64]) -> [f32; 64] {
        unsafe {
            let c = codes64(idx);
            let top = _mm512_movepi8_mask(c);
            let plane = |k: usize| {
                let t = planes.0[k].as_ptr() as *const __m512i;
                let lo = _mm512_permutex2var_epi8(_mm512_loadu_si512(t), c, _mm512_loadu_si512(t.add(1)));
                let hi = _mm512_permutex2var_epi8(_mm512_loadu_si512(t.add(2)), c, _mm512_loadu_si512(t.add(3)));
                _mm512_mask_blend_epi8(top, lo, hi)
            };
            let (b0, b1, b2, b3) = (plane(0), plane(1), plane(2), plane(3));
            let (w01l, w01h) = (_mm512_unpacklo_epi8(b0, b1), _mm512_unpackhi_epi8(b0, b1));
            let (w23l, w23h) = (_mm512_unpacklo_epi8(b2, b3), _mm512_unpackhi_epi8(b2, b3));
            std::mem::transmute::<[__m512i; 4], [f32; 64]>([
                _mm512_unpacklo_epi16(w01l, w23l),
                _mm512_unpackhi_epi16(w01l, w23l),
                _mm512_unpacklo_epi16(w01h, w23h),
                _mm512_unpackhi_epi16(w01h, w23h),
            ])
        }
    }

    /// [`Isa::lookup_bf16x64`] by byte permutes: one `vpermi2b` per byte (128 entries, the
    /// code's low 7 bits; `vpermi2b` ignores bit 7), the sign merged by one ternary logic op,
    /// then the bytes interleaved into words and the words above zero words.
    ///
    /// # Safety
    /// AVX-512 F/BW/VBMI.
    #[inline(always)]
    unsafe fn lookup_bf16x64_zmm(hi: &[u8; 128], lo: &[u8; 128], idx: &[u8; 64]) -> [f32; 64] {
        unsafe {
            let c = codes64(idx);
            let (th, tl) = (hi.as_ptr() as *const __m512i, lo.as_ptr() as *const __m512i);
            let h = _mm512_permutex2var_epi8(_mm512_loadu_si512(th), c, _mm512_loadu_si512(th.add(1)));
            // h | (c & 0x80)
            let h = _mm512_ternarylogic_epi32::<0xf8>(h, c, _mm512_set1_epi8(0x80u8 as i8));
            let l = _mm512_permutex2var_epi8(_mm512_loadu_si512(tl), c, _mm512_loadu_si512(tl.add(1)));
            let (wl, wh) = (_mm512_unpacklo_epi8(l, h), _mm512_unpackhi_epi8(l, h));
            let z = _mm512_setzero_si512();
            std::mem::transmute::<[__m512i; 4], [f32; 64]>([
                _mm512_unpacklo_epi16(z, wl),
                _mm512_unpackhi_epi16(z, wl),
                _mm512_unpacklo_epi16(z, wh),
                _mm512_unpackhi_epi16(z, wh),
            ])
        }
    }

    /// [`Isa::bucket_codes64`] in registers: per 16 lanes the clamp, the binade's scale and
    /// offset by two `vpermi2ps` (32 entries), one FMA and a truncation give the bucket; the 64
    /// buckets packed to bytes (three `vpermi2b`) pick the first codes (one `vpermi2b`, 128
    /// entries) and, put in the unpack order, each threshold's four byte planes (one `vpermi2b`
    /// each) interleaved into floats; three compares per 16 lanes count the thresholds reached.
    ///
    /// # Safety
    /// AVX-512 F/BW/VBMI.
    #[inline(always)]
    unsafe fn bucket_codes64_zmm(b: &super::Buckets, y: &[f32; 64]) -> [u8; 64] {
        unsafe {
            let floor = _mm512_set1_ps(b.floor);
            let (sc0, sc1) = (
                _mm512_loadu_ps(b.scale.as_ptr()),
                _mm512_loadu_ps(b.scale.as_ptr().add(16)),
            );
            let (of0, of1) = (
                _mm512_loadu_ps(b.offset.as_ptr()),
                _mm512_loadu_ps(b.offset.as_ptr().add(16)),
            );
            let mut yb = [_mm512_setzero_ps(); 4];
            let mut g = [_mm512_setzero_si512(); 4];
            for k in 0..4 {
                // vmaxps returns its second operand where the first is NaN: NaN becomes floor
                let v = _mm512_max_ps(_mm512_loadu_ps(y.as_ptr().add(16 * k)), floor);
                let bits = _mm512_castps_si512(v);
                let a = _mm512_and_si512(bits, _mm512_set1_epi32(0x7fff_ffff));
                let e = _mm512_max_epu32(_mm512_srli_epi32::<23>(a), _mm512_set1_epi32(96));
                let z = _mm512_fmadd_ps(
                    _mm512_castsi512_ps(a),
                    _mm512_permutex2var_ps(sc0, e, sc1),
                    _mm512_permutex2var_ps(of0, e, of1),
                );
                g[k] = _mm512_xor_si512(_mm512_cvttps_epi32(z), _mm512_srai_epi32::<31>(bits));
                yb[k] = v;
            }
            // byte 4i of each pair of dword vectors: 32 bytes from each pair
            let sel = _mm512_loadu_si512(PACK_DWORDS.as_ptr() as *const _);
            let lo = _mm512_permutex2var_epi8(g[0], sel, g[1]);
            let hi = _mm512_permutex2var_epi8(g[2], sel, g[3]);
            let c = _mm512_inserti64x4::<1>(lo, _mm512_castsi512_si256(hi));
            let t = b.code.as_ptr() as *const __m512i;
            let mut code = _mm512_permutex2var_epi8(_mm512_loadu_si512(t), c, _mm512_loadu_si512(t.add(1)));
            let r = _mm512_permutexvar_epi8(_mm512_loadu_si512(UNPACK_ORDER.as_ptr() as *const _), c);
            for k in 0..3 {
                let plane = |p: usize| {
                    let t = b.thr[k][p].as_ptr() as *const __m512i;
                    _mm512_permutex2var_epi8(_mm512_loadu_si512(t), r, _mm512_loadu_si512(t.add(1)))
                };
                let (b0, b1, b2, b3) = (plane(0), plane(1), plane(2), plane(3));
                let (w01l, w01h) = (_mm512_unpacklo_epi8(b0, b1), _mm512_unpackhi_epi8(b0, b1));
                let (w23l, w23h) = (_mm512_unpacklo_epi8(b2, b3), _mm512_unpackhi_epi8(b2, b3));
                let th = [
                    _mm512_unpacklo_epi16(w01l, w23l),
                    _mm512_unpackhi_epi16(w01l, w23l),
                    _mm512_unpacklo_epi16(w01h, w23h),
                    _mm512_unpackhi_epi16(w01h, w23h),
                ];
                let mut m = 0u64;
                for j in 0..4 {
                    let ge = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(yb[j], _mm512_castsi512_ps(th[j]));
                    m |= (ge as u64) << (16 * j);
                }
                code = _mm512_mask_add_epi8(code, m, code, _mm512_set1_epi8(1));
            }
            std::mem::transmute::<__m512i, [u8; 64]>(code)
        }
    }

    /// Byte `i` is `4 * i` (mod 128): the low bytes of 32 dwords from two registers.
    const PACK_DWORDS: [u8; 64] = {
        let mut o = [0u8; 64];
        let mut i = 0;
        while i < 64 {
            o[i] = ((4 * i) % 128) as u8;
            i += 1;
        }
        o
    };

    /// Two AVX2 gathers of 8 lanes each.
    ///
    /// # Safety
    /// AVX2; every `base + idx[i] * SCALE` is readable for 4 bytes.
    #[inline(always)]
    unsafe fn gather2<const SCALE: i32>(base: *const u8, idx: &[u32; LANES]) -> [__m256i; 2] {
        unsafe {
            let ix: [__m256i; 2] = std::mem::transmute(*idx);
            [
                _mm256_i32gather_epi32::<SCALE>(base as *const i32, ix[0]),
                _mm256_i32gather_epi32::<SCALE>(base as *const i32, ix[1]),
            ]
        }
    }

    // SAFETY (all three impls): the intrinsics need F16C and AVX2 (and AVX-512 F / BF16 for the
    // 512-bit ones); the trait contract says these run only where the path's features were
    // detected. The gathers read where the callers' contracts (indices in bounds) allow.
    // The transmutes are between same-sized plain-old-data types ([u16; 16] = 32 bytes = __m256i,
    // [f32; 16] = 64 bytes = two __m256 or one __m512), valid for every bit pattern.
    unsafe impl Isa for Avx2 {
        #[inline(always)]
        fn prefetch(p: *const u8) {
            // SAFETY: a prefetch is a hint: it never faults, whatever the address.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(p as *const i8) }
        }
        #[inline(always)]
        unsafe fn gather_f32(table: &[f32], idx: &[u32; LANES]) -> Block {
            unsafe { std::mem::transmute(gather2::<4>(table.as_ptr() as *const u8, idx)) }
        }
        #[inline(always)]
        unsafe fn gather_u32(table: &[u32], idx: &[u32; LANES]) -> [u32; LANES] {
            unsafe { std::mem::transmute(gather2::<4>(table.as_ptr() as *const u8, idx)) }
        }
        #[inline(always)]
        unsafe fn f16_load(src: &[u16; LANES]) -> Block {
            unsafe {
                let h: [__m128i; 2] = std::mem::transmute(*src);
                std::mem::transmute([_mm256_cvtph_ps(h[0]), _mm256_cvtph_ps(h[1])])
            }
        }
        #[inline(always)]
        unsafe fn f16_store(x: &Block) -> [u16; LANES] {
            unsafe {
                let v: [__m256; 2] = std::mem::transmute(*x);
                std::mem::transmute([
                    _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v[0]),
                    _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v[1]),
                ])
            }
        }
    }

    unsafe impl Isa for Avx512 {
        #[inline(always)]
        fn prefetch(p: *const u8) {
            Avx2::prefetch(p)
        }
        #[inline(always)]
        unsafe fn gather_f32(table: &[f32], idx: &[u32; LANES]) -> Block {
            unsafe { Avx2::gather_f32(table, idx) }
        }
        #[inline(always)]
        unsafe fn gather_u32(table: &[u32], idx: &[u32; LANES]) -> [u32; LANES] {
            unsafe { Avx2::gather_u32(table, idx) }
        }
        #[inline(always)]
        unsafe fn f16_load(src: &[u16; LANES]) -> Block {
            unsafe { std::mem::transmute(_mm512_cvtph_ps(std::mem::transmute::<[u16; LANES], __m256i>(*src))) }
        }
        #[inline(always)]
        unsafe fn f16_store(x: &Block) -> [u16; LANES] {
            unsafe {
                std::mem::transmute(_mm512_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(std::mem::transmute::<
                    Block,
                    __m512,
                >(*x)))
            }
        }
    }

    unsafe impl Isa for Avx512Bf16 {
        #[inline(always)]
        fn prefetch(p: *const u8) {
            Avx2::prefetch(p)
        }
        #[inline(always)]
        unsafe fn gather_f32(table: &[f32], idx: &[u32; LANES]) -> Block {
            unsafe { Avx2::gather_f32(table, idx) }
        }
        #[inline(always)]
        unsafe fn gather_u32(table: &[u32], idx: &[u32; LANES]) -> [u32; LANES] {
            unsafe { Avx2::gather_u32(table, idx) }
        }
        #[inline(always)]
        unsafe fn f16_load(src: &[u16; LANES]) -> Block {
            unsafe { Avx512::f16_load(src) }
        }
        #[inline(always)]
        unsafe fn f16_store(x: &Block) -> [u16; LANES] {
            unsafe { Avx512::f16_store(x) }
        }
        /// VCVTNEPS2BF16: round to nearest even, NaN to quiet NaN; unlike the portable code it
        /// flushes subnormal inputs to zero (the tests allow for that).
        #[inline(always)]
        unsafe fn bf16_store(x: &Block) -> [u16; LANES] {
            unsafe { std::mem::transmute(_mm512_cvtneps_pbh(std::mem::transmute::<Block, __m512>(*x))) }
        }
    }

    // SAFETY: as for `Avx512` and `Avx512Bf16`, which these delegate to; the lookups use
    // AVX-512 F, BW and VBMI, and run only where the path (AVX-512 with VBMI) was detected. The
    // byte tables are read by whole 64-byte loads within their arrays (256 or 128 bytes).
    unsafe impl Isa for Avx512Vbmi {
        const SEARCH_IN_REGISTERS: bool = true;
        #[inline(always)]
        fn prefetch(p: *const u8) {
            Avx2::prefetch(p)
        }
        #[inline(always)]
        unsafe fn gather_f32(table: &[f32], idx: &[u32; LANES]) -> Block {
            unsafe { Avx2::gather_f32(table, idx) }
        }
        #[inline(always)]
        unsafe fn gather_u32(table: &[u32], idx: &[u32; LANES]) -> [u32; LANES] {
            unsafe { Avx2::gather_u32(table, idx) }
        }
        #[inline(always)]
        unsafe fn f16_load(src: &[u16; LANES]) -> Block {
            unsafe { Avx512::f16_load(src) }
        }
        #[inline(always)]
        unsafe fn f16_store(x: &Block) -> [u16; LANES] {
            unsafe { Avx512::f16_store(x) }
        }
        #[inline(always)]
        unsafe fn lookup256(table: &[f32; 256], idx: &[u8; LANES]) -> Block {
            unsafe { lookup256_zmm(table, idx) }
        }
        #[inline(always)]
        unsafe fn search256(tree: &[f32; 256], y: &Block) -> [u8; LANES] {
            unsafe { search256_zmm(tree, y) }
        }
        const BYTE_PERMUTES: bool = true;
        #[inline(always)]
        unsafe fn lookup256x64(planes: &super::BytePlanes, idx: &[u8; 64]) -> [f32; 64] {
            unsafe { lookup256x64_zmm(planes, idx) }
        }
        #[inline(always)]
        unsafe fn lookup_bf16x64(hi: &[u8; 128], lo: &[u8; 128], idx: &[u8; 64]) -> [f32; 64] {
            unsafe { lookup_bf16x64_zmm(hi, lo, idx) }
        }
        #[inline(always)]
        unsafe fn bucket_codes64(b: &super::Buckets, y: &[f32; 64]) -> [u8; 64] {
            unsafe { bucket_codes64_zmm(b, y) }
        }
    }

    // SAFETY: as above, with `Avx512Bf16`'s conversions.
    unsafe impl Isa for Avx512Bf16Vbmi {
        const SEARCH_IN_REGISTERS: bool = true;
        #[inline(always)]
        fn prefetch(p: *const u8) {
            Avx2::prefetch(p)
        }
        #[inline(always)]
        unsafe fn gather_f32(table: &[f32], idx: &[u32; LANES]) -> Block {
            unsafe { Avx2::gather_f32(table, idx) }
        }
        #[inline(always)]
        unsafe fn gather_u32(table: &[u32], idx: &[u32; LANES]) -> [u32; LANES] {
            unsafe { Avx2::gather_u32(table, idx) }
        }
        #[inline(always)]
        unsafe fn f16_load(src: &[u16; LANES]) -> Block {
            unsafe { Avx512::f16_load(src) }
        }
        #[inline(always)]
        unsafe fn f16_store(x: &Block) -> [u16; LANES] {
            unsafe { Avx512::f16_store(x) }
        }
        #[inline(always)]
        unsafe fn bf16_store(x: &Block) -> [u16; LANES] {
            unsafe { Avx512Bf16::bf16_store(x) }
        }
        #[inline(always)]
        unsafe fn lookup256(table: &[f32; 256], idx: &[u8; LANES]) -> Block {
            unsafe { lookup256_zmm(table, idx) }
        }
        #[inline(always)]
        unsafe fn search256(tree: &[f32; 256], y: &Block) -> [u8; LANES] {
            unsafe { search256_zmm(tree, y) }
        }
        const BYTE_PERMUTES: bool = true;
        #[inline(always)]
        unsafe fn lookup256x64(planes: &super::BytePlanes, idx: &[u8; 64]) -> [f32; 64] {
            unsafe { lookup256x64_zmm(planes, idx) }
        }
        #[inline(always)]
        unsafe fn lookup_bf16x64(hi: &[u8; 128], lo: &[u8; 128], idx: &[u8; 64]) -> [f32; 64] {
            unsafe { lookup_bf16x64_zmm(hi, lo, idx) }
        }
        #[inline(always)]
        unsafe fn bucket_codes64(b: &super::Buckets, y: &[f32; 64]) -> [u8; 64] {
            unsafe { bucket_codes64_zmm(b, y) }
        }
    }
}
