//! The linear tests' shared aids (`tests.rs`, `experts_tests.rs`, `int4/tests.rs`).

/// A small deterministic generator (xorshift).
pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    /// A generator from any seed (never the all-zero state xorshift stays in).
    pub(crate) fn seeded(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }
    pub(crate) fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    /// Uniform in [-1, 1).
    pub(crate) fn f(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    /// An int8 code, uniform in -127..=127 (the symmetric range the quantizers write).
    pub(crate) fn int8(&mut self) -> i8 {
        ((self.next() % 255) as i32 - 127) as i8
    }
    /// An fp8 (e4m3fn) code: every one but the NaNs (0x7f, 0xff), subnormals and zeros included.
    pub(crate) fn fp8(&mut self) -> u8 {
        let c = (self.next() % 256) as u8;
        if c & 0x7f == 0x7f {
            c - 1
        } else {
            c
        }
    }
    /// Uniform in `0..n`.
    pub(crate) fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// Whether every pair of `a` and `b` (zipped) is the same float32, bit for bit.
pub(crate) fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.iter().zip(b).all(|(p, q)| p.to_bits() == q.to_bits())
}
