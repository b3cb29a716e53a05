//! Run-time SIMD dispatch.
//!
//! The kernel in `kernel/` is written once, over blocks of [`LANES`] `f32` lanes, in plain Rust
//! that LLVM vectorizes. Here it is compiled several times, each time inside a function with
//! `#[target_feature]` (AVX-512, AVX2+FMA, NEON), and one of them is picked once at run time, so
//! one wheel runs on any x86-64 or aarch64 CPU. Where a CPU has conversion instructions LLVM will
//! not produce by itself (F16C, AVX512-BF16), the [`Isa`] impl of that path uses them.
//!
//! `OFFLOAD_ADAM_SIMD=scalar|avx2|avx512|avx512bf16|neon` forces a path; `scalar` is the reference
//! implementation of `kernel::reference`, the specification the others are tested against.

use std::sync::OnceLock;

use crate::error::{Error, Result};

use crate::elem::{bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16};

/// Lanes of one block: the kernel's unit of work, whatever the vector width.
pub const LANES: usize = 16;
/// One block of `f32` lanes.
pub type Block = [f32; LANES];

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
            Simd::Neon => "neon",
        }
    }

    pub fn parse(s: &str) -> Option<Simd> {
        Some(match s.trim().to_ascii_lowercase().as_str() {
            "scalar" => Simd::Scalar,
            "avx2" => Simd::Avx2,
            "avx512" => Simd::Avx512,
            "avx512bf16" => Simd::Avx512Bf16,
            "neon" => Simd::Neon,
            _ => return None,
        })
    }

    /// Whether this CPU can run the path.
    pub fn supported(self) -> bool {
        match self {
            Simd::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Simd::Avx2 => {
                is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            Simd::Avx512 => {
                Simd::Avx2.supported()
                    && is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl")
                    && is_x86_feature_detected!("avx512dq")
            }
            #[cfg(target_arch = "x86_64")]
            Simd::Avx512Bf16 => Simd::Avx512.supported() && is_x86_feature_detected!("avx512bf16"),
            #[cfg(target_arch = "aarch64")]
            Simd::Neon => std::arch::is_aarch64_feature_detected!("neon"),
            #[allow(unreachable_patterns)]
            _ => false,
        }
    }

    /// Every path this CPU can run, best last.
    pub fn available() -> Vec<Simd> {
        [Simd::Scalar, Simd::Neon, Simd::Avx2, Simd::Avx512, Simd::Avx512Bf16]
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
            "unknown SIMD path {name:?}: expected one of scalar, avx2, avx512, avx512bf16, neon, auto"
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
/// that supports that path (`kernel::dispatch` in `kernel/mod.rs` checks this once).
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
}

/// Portable code, vectorized for whatever the compilation target has (NEON on aarch64).
#[derive(Clone, Copy)]
pub struct Generic;
// SAFETY: only the portable default conversions.
unsafe impl Isa for Generic {}

#[cfg(target_arch = "x86_64")]
pub use x86::{Avx2, Avx512, Avx512Bf16};

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
}
