//! The few operations the tiles of `tile.rs` need, per path: `W` float32 lanes, an FMA, a sum
//! across lanes, and the conversions of `2 W` stored weights to two vectors of float32.
//!
//! - int8: sign-extended and converted (exact);
//! - bfloat16: a 32-bit word holds two weights; shifted left by 16 it is the even one as a
//!   float32, masked with `0xffff0000` the odd one (exact, no shuffle): the activations are
//!   prepared in the matching order (even elements of each group of `2 W`, then odd ones);
//! - float8_e4m3fn: on x86, the code's bits moved into a half float's (`(c & 0x7f) << 7`, the
//!   sign to bit 15) are the value times 2^-8, subnormals included, converted by F16C; codes
//!   0x7f/0xff become a half NaN. The 2^8 is folded into the row's scale ([`Vector::FP8_FACTOR`]).
//!   The portable lanes use c10's branch-free decode (`kernel::fp8::decode`).

use crate::kernel::fp8;

/// `W` float32 lanes of one path.
///
/// # Safety
/// Implementations use their path's instructions: call them only on a CPU that runs the path
/// (`linear` dispatches after checking). Pointers must be readable for the elements a function
/// reads (`W` floats for `load`, `2 W` weights for the conversions).
pub(crate) unsafe trait Vector: Copy {
    /// Lanes.
    const W: usize;
    /// [`Vector::fp8x2`] returns the codes' values divided by this.
    const FP8_FACTOR: f32;
    /// # Safety
    /// As for the trait.
    unsafe fn zero() -> Self;
    /// # Safety
    /// As for the trait.
    unsafe fn load(p: *const f32) -> Self;
    /// `acc + a * b` (fused where the path has FMA).
    ///
    /// # Safety
    /// As for the trait.
    unsafe fn fma(acc: Self, a: Self, b: Self) -> Self;
    /// # Safety
    /// As for the trait.
    unsafe fn hsum(self) -> f32;
    /// # Safety
    /// As for the trait.
    unsafe fn i8x2(p: *const i8) -> [Self; 2];
    /// # Safety
    /// As for the trait.
    unsafe fn fp8x2(p: *const u8) -> [Self; 2];
    /// The even and the odd weights of `2 W` bfloat16.
    ///
    /// # Safety
    /// As for the trait.
    unsafe fn bf16x2(p: *const u16) -> [Self; 2];
}

/// Eight lanes in plain Rust, which LLVM vectorizes (NEON on aarch64, where FMA is baseline).
#[derive(Clone, Copy)]
pub(crate) struct Portable([f32; 8]);

// SAFETY: plain Rust; the reads are within what the callers' contract makes readable.
unsafe impl Vector for Portable {
    const W: usize = 8;
    const FP8_FACTOR: f32 = 1.0;
    #[inline(always)]
    unsafe fn zero() -> Self {
        Portable([0.0; 8])
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self {
        // SAFETY: 8 floats readable (contract).
        Portable(unsafe { std::ptr::read_unaligned(p as *const [f32; 8]) })
    }
    #[inline(always)]
    unsafe fn fma(acc: Self, a: Self, b: Self) -> Self {
        Portable(std::array::from_fn(|l| {
            if cfg!(target_arch = "aarch64") {
                a.0[l].mul_add(b.0[l], acc.0[l])
            } else {
                acc.0[l] + a.0[l] * b.0[l]
            }
        }))
    }
    #[inline(always)]
    unsafe fn hsum(self) -> f32 {
        let v = self.0;
        ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]))
    }
    #[inline(always)]
    unsafe fn i8x2(p: *const i8) -> [Self; 2] {
        // SAFETY: 16 bytes readable (contract).
        let q = unsafe { std::ptr::read_unaligned(p as *const [i8; 16]) };
        [
            Portable(std::array::from_fn(|l| q[l] as f32)),
            Portable(std::array::from_fn(|l| q[8 + l] as f32)),
        ]
    }
    #[inline(always)]
    unsafe fn fp8x2(p: *const u8) -> [Self; 2] {
        // SAFETY: 16 bytes readable (contract).
        let q = unsafe { std::ptr::read_unaligned(p as *const [u8; 16]) };
        [
            Portable(std::array::from_fn(|l| fp8::decode(q[l]))),
            Portable(std::array::from_fn(|l| fp8::decode(q[8 + l]))),
        ]
    }
    #[inline(always)]
    unsafe fn bf16x2(p: *const u16) -> [Self; 2] {
        // SAFETY: 16 bfloat16 readable (contract).
        let q = unsafe { std::ptr::read_unaligned(p as *const [u16; 16]) };
        [
            Portable(std::array::from_fn(|l| f32::from_bits((q[2 * l] as u32) << 16))),
            Portable(std::array::from_fn(|l| f32::from_bits((q[2 * l + 1] as u32) << 16))),
        ]
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) use x86::{Avx2, Avx512};

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::Vector;
    use std::arch::x86_64::*;

    /// AVX2 + FMA + F16C, 8 lanes.
    #[derive(Clone, Copy)]
    pub(crate) struct Avx2(__m256);

    /// AVX-512 F/BW, 16 lanes.
    #[derive(Clone, Copy)]
    pub(crate) struct Avx512(pub(crate) __m512);

    // SAFETY (both impls): the intrinsics need the path's features, which the trait's contract
    // says were detected; every load is unaligned and reads the elements the contract makes
    // readable (`W` floats, or the `2 W` weights of a conversion).
    unsafe impl Vector for Avx2 {
        const W: usize = 8;
        const FP8_FACTOR: f32 = 256.0;
        #[inline(always)]
        unsafe fn zero() -> Self {
            unsafe { Avx2(_mm256_setzero_ps()) }
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> Self {
            unsafe { Avx2(_mm256_loadu_ps(p)) }
        }
        #[inline(always)]
        unsafe fn fma(acc: Self, a: Self, b: Self) -> Self {
            unsafe { Avx2(_mm256_fmadd_ps(a.0, b.0, acc.0)) }
        }
        #[inline(always)]
        unsafe fn hsum(self) -> f32 {
            unsafe {
                let s = _mm_add_ps(_mm256_castps256_ps128(self.0), _mm256_extractf128_ps::<1>(self.0));
                let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
                _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
            }
        }
        #[inline(always)]
        unsafe fn i8x2(p: *const i8) -> [Self; 2] {
            unsafe {
                let lo = _mm_loadl_epi64(p as *const __m128i);
                let hi = _mm_loadl_epi64(p.add(8) as *const __m128i);
                [
                    Avx2(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo))),
                    Avx2(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi))),
                ]
            }
        }
        #[inline(always)]
        unsafe fn fp8x2(p: *const u8) -> [Self; 2] {
            unsafe {
                let u = _mm256_cvtepu8_epi16(_mm_loadu_si128(p as *const __m128i));
                let mag = _mm256_and_si256(_mm256_slli_epi16::<7>(u), _mm256_set1_epi16(0x3f80));
                let sign = _mm256_and_si256(_mm256_slli_epi16::<8>(u), _mm256_set1_epi16(0x8000u16 as i16));
                let nan = _mm256_and_si256(
                    _mm256_cmpeq_epi16(mag, _mm256_set1_epi16(0x3f80)),
                    _mm256_set1_epi16(0x7c00),
                );
                let h = _mm256_or_si256(_mm256_or_si256(mag, sign), nan);
                [
                    Avx2(_mm256_cvtph_ps(_mm256_castsi256_si128(h))),
                    Avx2(_mm256_cvtph_ps(_mm256_extracti128_si256::<1>(h))),
                ]
            }
        }
        #[inline(always)]
        unsafe fn bf16x2(p: *const u16) -> [Self; 2] {
            unsafe {
                let v = _mm256_loadu_si256(p as *const __m256i);
                [
                    Avx2(_mm256_castsi256_ps(_mm256_slli_epi32::<16>(v))),
                    Avx2(_mm256_castsi256_ps(_mm256_and_si256(
                        v,
                        _mm256_set1_epi32(0xffff_0000u32 as i32),
                    ))),
                ]
            }
        }
    }

    unsafe impl Vector for Avx512 {
        const W: usize = 16;
        const FP8_FACTOR: f32 = 256.0;
        #[inline(always)]
        unsafe fn zero() -> Self {
            unsafe { Avx512(_mm512_setzero_ps()) }
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> Self {
            unsafe { Avx512(_mm512_loadu_ps(p)) }
        }
        #[inline(always)]
        unsafe fn fma(acc: Self, a: Self, b: Self) -> Self {
            unsafe { Avx512(_mm512_fmadd_ps(a.0, b.0, acc.0)) }
        }
        #[inline(always)]
        unsafe fn hsum(self) -> f32 {
            unsafe {
                let lo = _mm512_castps512_ps256(self.0);
                let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(self.0)));
                Avx2(_mm256_add_ps(lo, hi)).hsum()
            }
        }
        #[inline(always)]
        unsafe fn i8x2(p: *const i8) -> [Self; 2] {
            unsafe {
                let lo = _mm_loadu_si128(p as *const __m128i);
                let hi = _mm_loadu_si128(p.add(16) as *const __m128i);
                [
                    Avx512(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo))),
                    Avx512(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi))),
                ]
            }
        }
        #[inline(always)]
        unsafe fn fp8x2(p: *const u8) -> [Self; 2] {
            unsafe {
                let u = _mm512_cvtepu8_epi16(_mm256_loadu_si256(p as *const __m256i));
                let mag = _mm512_and_si512(_mm512_slli_epi16::<7>(u), _mm512_set1_epi16(0x3f80));
                let sign = _mm512_and_si512(_mm512_slli_epi16::<8>(u), _mm512_set1_epi16(0x8000u16 as i16));
                let h = _mm512_or_si512(mag, sign);
                let nan = _mm512_cmpeq_epi16_mask(mag, _mm512_set1_epi16(0x3f80));
                let h = _mm512_mask_mov_epi16(h, nan, _mm512_or_si512(h, _mm512_set1_epi16(0x7c00)));
                [
                    Avx512(_mm512_cvtph_ps(_mm512_castsi512_si256(h))),
                    Avx512(_mm512_cvtph_ps(_mm512_extracti64x4_epi64::<1>(h))),
                ]
            }
        }
        #[inline(always)]
        unsafe fn bf16x2(p: *const u16) -> [Self; 2] {
            unsafe {
                let v = _mm512_loadu_si512(p as *const __m512i);
                [
                    Avx512(_mm512_castsi512_ps(_mm512_slli_epi32::<16>(v))),
                    Avx512(_mm512_castsi512_ps(_mm512_and_si512(
                        v,
                        _mm512_set1_epi32(0xffff_0000u32 as i32),
                    ))),
                ]
            }
        }
    }
}
