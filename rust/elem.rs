//! Element types the kernel reads and writes, and their conversions to and from `f32`.
//!
//! The conversions are written without branches (selects only) so that LLVM vectorizes them in
//! every SIMD path; `isa.rs` swaps in hardware instructions (F16C, AVX512-BF16) where they exist.

/// A bfloat16 value, as its bit pattern.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(transparent)]
pub struct Bf16(pub u16);

/// An IEEE half-precision value, as its bit pattern.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(transparent)]
pub struct F16(pub u16);

/// bf16 -> f32 is exact: the bf16 bits are the high half of the f32.
#[inline(always)]
pub fn bf16_to_f32(x: u16) -> f32 {
    f32::from_bits((x as u32) << 16)
}

/// f32 -> bf16, round to nearest even; NaN stays a (quiet) NaN, overflow rounds to infinity.
#[inline(always)]
pub fn f32_to_bf16(f: f32) -> u16 {
    let x = f.to_bits();
    let rounded = (x.wrapping_add(0x7fff + ((x >> 16) & 1)) >> 16) as u16;
    let nan = ((x >> 16) | 0x40) as u16;
    if f.is_nan() {
        nan
    } else {
        rounded
    }
}

/// f16 -> f32, exact (subnormals, infinities and NaN included).
#[inline(always)]
pub fn f16_to_f32(h: u16) -> f32 {
    let h = h as u32;
    let sign = (h & 0x8000) << 16;
    let em = (h & 0x7fff) << 13;
    let exp = em & (0x7c00 << 13);
    let normal = em + ((127 - 15) << 23);
    let inf_nan = normal + ((128 - 16) << 23);
    // A subnormal half: let the FPU renormalize it (magic-number subtraction, exact).
    let subnormal = (f32::from_bits(normal + (1 << 23)) - f32::from_bits(113 << 23)).to_bits();
    let bits = if exp == (0x7c00 << 13) {
        inf_nan
    } else if exp == 0 {
        subnormal
    } else {
        normal
    };
    f32::from_bits(bits | sign)
}

/// f32 -> f16, round to nearest even, like `torch.Tensor.half()`.
#[inline(always)]
pub fn f32_to_f16(f: f32) -> u16 {
    const F32_INF: u32 = 255 << 23;
    const F16_MAX: u32 = (127 + 16) << 23;
    const DENORM_MAGIC: u32 = ((127 - 15) + (23 - 10) + 1) << 23;
    let bits = f.to_bits();
    let sign = bits & 0x8000_0000;
    let x = bits ^ sign;
    let special = if x > F32_INF { 0x7e00 } else { 0x7c00 };
    // Result is subnormal or zero: add a magic number so the FPU rounds the 10 mantissa bits.
    let small = (f32::from_bits(x) + f32::from_bits(DENORM_MAGIC))
        .to_bits()
        .wrapping_sub(DENORM_MAGIC);
    let mant_odd = (x >> 13) & 1;
    let normal = x
        .wrapping_add((15u32.wrapping_sub(127) << 23).wrapping_add(0xfff))
        .wrapping_add(mant_odd)
        >> 13;
    let o = if x >= F16_MAX {
        special
    } else if x < (113 << 23) {
        small
    } else {
        normal
    };
    (o | (sign >> 16)) as u16
}

/// An element type of a gradient, moment or weight-copy buffer.
pub trait Elem: Copy + Default + PartialEq + Send + Sync + 'static {
    fn to_f32(self) -> f32;
    fn from_f32(x: f32) -> Self;
    /// True for an infinity or a NaN, read from the bits.
    fn is_nonfinite(self) -> bool;
}

impl Elem for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        x
    }
    #[inline(always)]
    fn is_nonfinite(self) -> bool {
        self.to_bits() & 0x7f80_0000 == 0x7f80_0000
    }
}

impl Elem for Bf16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16_to_f32(self.0)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        Bf16(f32_to_bf16(x))
    }
    #[inline(always)]
    fn is_nonfinite(self) -> bool {
        self.0 & 0x7f80 == 0x7f80
    }
}

impl Elem for F16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16_to_f32(self.0)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        F16(f32_to_f16(x))
    }
    #[inline(always)]
    fn is_nonfinite(self) -> bool {
        self.0 & 0x7c00 == 0x7c00
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_roundtrip_every_half() {
        for h in 0..=u16::MAX {
            let f = f16_to_f32(h);
            let back = f32_to_f16(f);
            if f.is_nan() {
                assert!(back & 0x7c00 == 0x7c00 && back & 0x3ff != 0, "{h:#x}");
            } else {
                assert_eq!(back, h, "{h:#x} -> {f}");
            }
        }
    }

    #[test]
    fn f16_known_values() {
        assert_eq!(f16_to_f32(0x3c00), 1.0);
        assert_eq!(f16_to_f32(0xc000), -2.0);
        assert_eq!(f16_to_f32(0x0001), 5.960_464_5e-8);
        assert_eq!(f16_to_f32(0x7c00), f32::INFINITY);
        assert_eq!(f32_to_f16(65520.0), 0x7c00); // rounds up to inf
        assert_eq!(f32_to_f16(65504.0), 0x7bff);
        assert_eq!(f32_to_f16(1.0 + 1.0 / 2048.0), 0x3c00); // tie -> even
        assert_eq!(f32_to_f16(1.0 + 3.0 / 2048.0), 0x3c02); // tie -> even (up)
        assert_eq!(f32_to_f16(-0.0), 0x8000);
        assert_eq!(f32_to_f16(1e-9), 0);
    }

    #[test]
    fn bf16_rounding() {
        assert_eq!(f32_to_bf16(1.0), 0x3f80);
        // 1 + 2^-8 is a tie between 1 and 1 + 2^-7: rounds to even (1.0).
        assert_eq!(f32_to_bf16(1.0 + 1.0 / 256.0), 0x3f80);
        assert_eq!(f32_to_bf16(1.0 + 3.0 / 256.0), 0x3f82);
        assert_eq!(f32_to_bf16(f32::MAX), 0x7f80);
        assert!(bf16_to_f32(f32_to_bf16(f32::NAN)).is_nan());
        assert_eq!(f32_to_bf16(f32::NEG_INFINITY), 0xff80);
        for h in 0..=u16::MAX {
            let f = bf16_to_f32(h);
            if !f.is_nan() {
                assert_eq!(f32_to_bf16(f), h);
            }
        }
    }
}
