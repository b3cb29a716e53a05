//! fp8 block-quantized moments, as torchao's `AdamWFp8` defines them.
//!
//! A moment of `n` elements (`n` a multiple of [`QBLOCK`]) is `n` float8_e4m3fn codes and one
//! float32 scale per block: `scale = absmax.clip(1e-12) / 448` (448, e4m3fn's largest value),
//! code `i` = `(x[i] / scale)` rounded to float8_e4m3fn (a true division, then torch's cast:
//! round to nearest even; 480 and beyond, inf and NaN give NaN), element `i` = `float(code) *
//! scale`. Both moments (and the amsgrad maximum) use this one codec.
//!
//! The conversions are c10's (`c10/util/Float8_e4m3fn.h`), written branch-free on the float's
//! bits, so that every path (portable, AVX2, AVX-512, NEON) computes them lane by lane in
//! registers: no table, no gather.

use super::q8::{absmax, Codec};
use super::segment::QBLOCK;
use crate::isa::{Isa, LANES};

/// e4m3fn's largest finite value.
pub const FP8_MAX: f32 = 448.0;

/// The fp8 codec (one for both moments).
pub struct Fp8;

/// The one instance.
pub static FP8: Fp8 = Fp8;

/// `(f as float8_e4m3fn).to_bits()`: c10's `fp8e4m3fn_from_fp32_value`, both of its branches
/// computed and one kept, so that a lane loop vectorizes.
#[inline(always)]
pub fn encode(f: f32) -> u8 {
    encode32(f) as u8
}

/// [`encode`] in the low byte of a u32 (what a lane loop computes before narrowing).
#[inline(always)]
fn encode32(f: f32) -> u32 {
    const FP8_MAX_BITS: u32 = 1087 << 20; // 480.0: the first float that is not an e4m3fn
    const DENORM_MASK: u32 = 141 << 23; // 2^14: adding it rounds to a multiple of 2^-9
    const MIN_NORMAL: u32 = 121 << 23; // 2^-6
    let bits = f.to_bits();
    let sign = bits & 0x8000_0000;
    let a = bits ^ sign;
    // Below 2^-6: the float add rounds (to nearest even) at e4m3fn's subnormal spacing.
    let sub = (f32::from_bits(a) + f32::from_bits(DENORM_MASK))
        .to_bits()
        .wrapping_sub(DENORM_MASK);
    // Normal: rebias the exponent and round the mantissa to 3 bits, ties to even.
    let odd = (a >> 20) & 1;
    let normal = a
        .wrapping_add((7u32.wrapping_sub(127) << 23).wrapping_add(0x7_ffff))
        .wrapping_add(odd)
        >> 20;
    let r = if a >= FP8_MAX_BITS {
        0x7f
    } else if a < MIN_NORMAL {
        sub
    } else {
        normal
    };
    (r & 0xff) | (sign >> 24)
}

/// `float(code)`: c10's `fp8e4m3fn_to_fp32_value` (exact; 0x7f and 0xff are NaN, with c10's
/// bits), branch-free.
#[inline(always)]
pub fn decode(c: u8) -> f32 {
    decode32(c as u32)
}

/// [`decode`] of a code widened to u32.
#[inline(always)]
fn decode32(c: u32) -> f32 {
    let sign = (c & 0x80) << 24;
    let em = c & 0x7f;
    // Normal: the exponent rebiased by 120, the 3 mantissa bits on top of float32's.
    let normal = (em << 20) + (120 << 23);
    // A subnormal (exponent 0: em is its mantissa) is em * 2^-9, exactly (0 for em = 0).
    let sub = (em as i32 as f32 * (1.0 / 512.0)).to_bits();
    let r = if em == 0x7f {
        0x7ff0_0000 // NaN, with c10's bits
    } else if em < 8 {
        sub
    } else {
        normal
    };
    f32::from_bits(r | sign)
}

/// [`decode`]'s float bits of code `c`, in integer arithmetic (for the tables).
const fn decode_bits(c: u8) -> u32 {
    let sign = ((c & 0x80) as u32) << 24;
    let em = (c & 0x7f) as u32;
    let r = if em == 0x7f {
        0x7ff0_0000
    } else if em >= 8 {
        (em << 20) + (120 << 23)
    } else if em == 0 {
        0
    } else {
        // em * 2^-9, normalized: its top bit is 2^e
        let e = 31 - em.leading_zeros();
        ((127 - 9 + e) << 23) | ((em ^ (1 << e)) << (23 - e))
    };
    r | sign
}

/// Every code's float has at most 4 significant bits, so it is a bf16: the top byte of each
/// non-negative code's float (sign and top 7 exponent bits) and the next byte, for the paths
/// that decode by byte permutes ([`Isa::lookup_bf16x64`]).
const BF16_HI: [u8; 128] = bf16_bytes(24);
const BF16_LO: [u8; 128] = bf16_bytes(16);

const fn bf16_bytes(shift: u32) -> [u8; 128] {
    let mut t = [0u8; 128];
    let mut c = 0;
    while c < 128 {
        t[c] = (decode_bits(c as u8) >> shift) as u8;
        c += 1;
    }
    t
}

impl Fp8 {
    /// The block's scale: `absmax.clip(1e-12) / 448` (NaN if an element is NaN).
    #[inline(always)]
    fn scale(x: &[f32; QBLOCK]) -> f32 {
        absmax(x) / FP8_MAX
    }
}

impl Codec for Fp8 {
    #[inline(always)]
    fn first() -> &'static Self {
        &FP8
    }
    #[inline(always)]
    fn second() -> &'static Self {
        &FP8
    }
    #[inline(always)]
    fn quantize_ref(&self, x: &[f32; QBLOCK], codes: &mut [u8; QBLOCK]) -> f32 {
        let s = Fp8::scale(x);
        for i in 0..QBLOCK {
            codes[i] = encode(x[i] / s);
        }
        s
    }
    #[inline(always)]
    unsafe fn quantize<I: Isa>(&self, x: &[f32; QBLOCK], codes: &mut [u8; QBLOCK]) -> f32 {
        let s = Fp8::scale(x);
        let (xb, cb) = (x.as_chunks::<LANES>().0, codes.as_chunks_mut::<LANES>().0);
        for (x, c) in xb.iter().zip(cb) {
            // Lane loops on u32 (which vectorize), then one narrowing.
            let mut r = [0u32; LANES];
            for i in 0..LANES {
                r[i] = encode32(x[i] / s);
            }
            for i in 0..LANES {
                c[i] = r[i] as u8;
            }
        }
        s
    }
    #[inline(always)]
    unsafe fn dequantize<I: Isa>(&self, codes: &[u8; QBLOCK], s: f32, out: &mut [f32; QBLOCK]) {
        if I::BYTE_PERMUTES {
            let (cb, ob) = (codes.as_chunks::<64>().0, out.as_chunks_mut::<64>().0);
            for (c, o) in cb.iter().zip(ob) {
                // SAFETY: CPU support is the caller's contract.
                let f = unsafe { I::lookup_bf16x64(&BF16_HI, &BF16_LO, c) };
                *o = f.map(|v| v * s);
            }
            return;
        }
        let (cb, ob) = (codes.as_chunks::<LANES>().0, out.as_chunks_mut::<LANES>().0);
        for (c, o) in cb.iter().zip(ob) {
            let mut w = [0u32; LANES];
            for i in 0..LANES {
                w[i] = c[i] as u32;
            }
            for i in 0..LANES {
                o[i] = decode32(w[i]) * s;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// c10's scalar conversion, transcribed with its branches: the reference of [`encode`].
    fn c10_from_f32(f: f32) -> u8 {
        let fp8_max: u32 = 1087 << 20;
        let denorm_mask: u32 = 141 << 23;
        let mut f_bits = f.to_bits();
        let sign = f_bits & 0x8000_0000;
        f_bits ^= sign;
        let result: u8 = if f_bits >= fp8_max {
            0x7f
        } else if f_bits < (121 << 23) {
            f_bits = (f32::from_bits(f_bits) + f32::from_bits(denorm_mask)).to_bits();
            f_bits.wrapping_sub(denorm_mask) as u8
        } else {
            let mant_odd = (f_bits >> 20) & 1;
            f_bits = f_bits.wrapping_add((7u32.wrapping_sub(127) << 23).wrapping_add(0x7ffff));
            f_bits = f_bits.wrapping_add(mant_odd);
            (f_bits >> 20) as u8
        };
        result | (sign >> 24) as u8
    }

    #[test]
    fn decode_is_the_e4m3fn_value_of_every_code() {
        for c in 0..=255u8 {
            let (s, e, m) = ((c >> 7) as i32, ((c >> 3) & 15) as i32, (c & 7) as f64);
            let want = if c & 0x7f == 0x7f {
                f64::NAN
            } else if e == 0 {
                m / 8.0 * 2f64.powi(-6)
            } else {
                (1.0 + m / 8.0) * 2f64.powi(e - 7)
            } * if s == 1 { -1.0 } else { 1.0 };
            let got = decode(c) as f64;
            assert!(got == want || (got.is_nan() && want.is_nan()), "{c:#x}: {got} {want}");
            if !got.is_nan() {
                assert_eq!(encode(decode(c)), c, "round trip of {c:#x}");
            }
        }
        assert_eq!(decode(0x7e), FP8_MAX);
        // The byte tables: the integer decode, and the low 16 bits of every float zero.
        for c in 0..=255u8 {
            let b = decode(c).to_bits();
            assert_eq!(decode_bits(c), b, "{c:#x}");
            assert_eq!(b & 0xffff, 0, "{c:#x}");
            let k = (c & 0x7f) as usize;
            assert_eq!(((BF16_HI[k] | (c & 0x80)) as u32) << 24 | (BF16_LO[k] as u32) << 16, b);
        }
        assert_eq!(decode(0x7f).to_bits(), 0x7ff0_0000);
        assert_eq!(decode(0xff).to_bits(), 0xfff0_0000);
    }

    #[test]
    fn encode_is_c10s_conversion_on_every_float_that_matters() {
        // Every float with its low 12 bits in a few patterns (every e4m3fn rounding boundary and
        // tie sits at bit 19 or below 2^-6 at multiples of 2^-10), then specials.
        for hi in 0..(1u32 << 20) {
            for low in [0u32, 1, 0x7ff, 0x800, 0xfff] {
                let f = f32::from_bits((hi << 12) | low);
                assert_eq!(encode(f), c10_from_f32(f), "{:#x}", f.to_bits());
            }
        }
        for f in [
            0.0f32,
            -0.0,
            448.0,
            464.0,
            464.00003,
            479.9,
            480.0,
            f32::INFINITY,
            f32::NAN,
            -f32::NAN,
        ] {
            assert_eq!(encode(f), c10_from_f32(f), "{f}");
        }
        assert_eq!(encode(464.0), 0x7e); // the tie rounds to the even 448
        assert_eq!(encode(464.00003), 0x7f); // past it: NaN, as c10 gives
        assert_eq!(encode(f32::INFINITY), 0x7f);
        assert_eq!(encode(-f32::INFINITY), 0xff);
        assert_eq!(encode(2f32.powi(-10)), 0); // half the smallest subnormal: ties to even (0)
        assert_eq!(encode(3.0 * 2f32.powi(-10)), 2); // 1.5 ulps: to even (2)
    }

    #[test]
    fn a_block_quantizes_as_torchao_defines_it() {
        let x: [f32; QBLOCK] = std::array::from_fn(|i| ((i as f32) - 100.0) * 1e-3);
        let mut c = [0u8; QBLOCK];
        let s = FP8.quantize_ref(&x, &mut c);
        assert_eq!(s, (155f32 * 1e-3) / 448.0);
        let mut c2 = [0u8; QBLOCK];
        assert_eq!(unsafe { FP8.quantize::<crate::isa::Generic>(&x, &mut c2) }, s);
        assert_eq!(c, c2);
        assert_eq!(c[255], 0x7e); // the absmax is 448 after scaling
        for i in 0..QBLOCK {
            assert_eq!(c[i], encode(x[i] / s));
        }
        let mut back = [0.0; QBLOCK];
        unsafe { FP8.dequantize::<crate::isa::Generic>(&c, s, &mut back) };
        for i in 0..QBLOCK {
            assert!((back[i] - x[i]).abs() <= x[i].abs() / 16.0 + s * 2f32.powi(-9), "{i}");
        }
        // A NaN makes the scale NaN and every code NaN; an inf: scale inf, its code NaN, the
        // others 0 (torch's x / inf).
        let mut y = x;
        y[3] = f32::NAN;
        assert!(FP8.quantize_ref(&y, &mut c).is_nan());
        assert!(c.iter().all(|&k| k & 0x7f == 0x7f));
        y[3] = f32::INFINITY;
        assert_eq!(FP8.quantize_ref(&y, &mut c), f32::INFINITY);
        assert_eq!(c[3] & 0x7f, 0x7f);
        assert!(c.iter().enumerate().all(|(i, &k)| i == 3 || k & 0x7f == 0));
    }
}
