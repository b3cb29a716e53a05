//! Every path of this CPU (and the grouped path in plain Rust) against a float64 reference,
//! within [`int4_error_bound`], for every layout; thread counts give the same bits.

use super::*;
use crate::elem::{bf16_to_f32, f32_to_bf16, f32_to_f16, Bf16, F16};
use crate::linear::test_util::{same_bits, Rng};

/// torch's `_convert_weight_to_int4pack_for_cpu` of codes `q [n, k]` (0..16), written from its
/// description: blocks of `block_n` outputs, each `[k, nb / 2]` bytes; see the module's docs.
#[allow(clippy::needless_range_loop)] // (bytes indexed as torch's packing writes them)
fn pack(q: &[u8], n: usize, k: usize, layout: Int4Layout) -> Vec<u8> {
    let bn = layout.block_n();
    let mut out = vec![0u8; n * k / 2];
    let mut b0 = 0;
    while b0 < n {
        let nb = bn.min(n - b0);
        let dst = &mut out[b0 * k / 2..][..nb * k / 2];
        let src = |j: usize, i: usize| q[(b0 + j) * k + i];
        for i in 0..k {
            let row = &mut dst[i * nb / 2..][..nb / 2];
            match (layout, nb) {
                (Int4Layout::Avx512, 64) => {
                    for d in 0..16 {
                        row[d] = (src(d + 32, i) << 4) | src(d, i);
                        row[16 + d] = (src(d + 48, i) << 4) | src(d + 16, i);
                    }
                }
                (Int4Layout::Avx2, 32) => {
                    for d in 0..16 {
                        row[d] = (src(d + 16, i) << 4) | src(d, i);
                    }
                }
                _ => {
                    for j in (0..nb).step_by(2) {
                        row[j / 2] = (src(j + 1, i) << 4) | src(j, i);
                    }
                }
            }
        }
        b0 += nb;
    }
    out
}

struct Case {
    shape: Shape,
    group: usize,
    codes: Vec<u8>,
    x32: Vec<f32>,
    xb: Vec<Bf16>,
    sz: Vec<f32>,
    bias: Vec<f32>,
}

fn case(rows: usize, k: usize, n: usize, group: usize, seed: u64) -> Case {
    let mut g = Rng::seeded(seed);
    let x32: Vec<f32> = (0..rows * k).map(|_| g.f() * 4.0).collect();
    let xb = x32.iter().map(|&v| Bf16(f32_to_bf16(v))).collect();
    let codes = (0..n * k).map(|_| (g.next() % 16) as u8).collect();
    // Scales and zero points as tinygemm's quantization makes them (a zero point near
    // `min + 8 s`), rounded to bfloat16 so that every scale dtype holds them exactly.
    let sz = (0..k / group * n)
        .flat_map(|_| {
            let s = (g.f().abs() + 0.01) * 0.02;
            let z = g.f() * 0.05;
            [bf16_to_f32(f32_to_bf16(s)), bf16_to_f32(f32_to_bf16(z))]
        })
        .collect();
    let bias = (0..n).map(|_| g.f()).collect();
    Case {
        shape: Shape { rows, k, n },
        group,
        codes,
        x32,
        xb,
        sz,
        bias,
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum SzType {
    F32,
    Bf16,
    F16,
}

impl Case {
    /// `(y64, abs_sum)` of element (r, o), in float64 from the codes.
    fn reference(&self, bf16_x: bool, bias: bool, r: usize, o: usize) -> (f64, f64) {
        let Shape { k, n, .. } = self.shape;
        let (mut y, mut a) = (0.0f64, 0.0f64);
        for i in 0..k {
            let x = if bf16_x {
                bf16_to_f32(self.xb[r * k + i].0)
            } else {
                self.x32[r * k + i]
            } as f64;
            let j = (i / self.group * n + o) * 2;
            let (s, z) = (self.sz[j] as f64, self.sz[j + 1] as f64);
            let q = self.codes[o * k + i] as f64 - 8.0;
            y += x * (q * s + z);
            a += x.abs() * (q.abs() * s.abs() + z.abs());
        }
        let b = if bias { self.bias[o] as f64 } else { 0.0 };
        (y + b, a + b.abs())
    }

    #[allow(clippy::too_many_arguments)]
    fn run(&self, simd: Simd, threads: usize, layout: Int4Layout, szt: SzType, bf16_x: bool, bias: bool) -> Vec<f32> {
        let Shape { rows, k, n } = self.shape;
        let q = pack(&self.codes, n, k, layout);
        let sb: Vec<Bf16> = self.sz.iter().map(|&v| Bf16(f32_to_bf16(v))).collect();
        let sh: Vec<F16> = self.sz.iter().map(|&v| F16(f32_to_f16(v))).collect();
        let scale_zero = match szt {
            SzType::F32 => Scale::F32(&self.sz),
            SzType::Bf16 => Scale::Bf16(&sb),
            SzType::F16 => Scale::F16(&sh),
        };
        let w = Int4 {
            q: &q,
            scale_zero,
            group: self.group,
            layout,
        };
        let pool = crate::pool::get(threads).unwrap();
        let b = bias.then_some(Act::F32(&self.bias[..]));
        let call = |x: Act<'_>, out: ActMut<'_>| linear_int4(simd, pool.as_deref(), self.shape, x, w, b, out).unwrap();
        if bf16_x {
            let mut out = vec![Bf16(0); rows * n];
            call(Act::Bf16(&self.xb), ActMut::Bf16(&mut out));
            out.iter().map(|v| bf16_to_f32(v.0)).collect()
        } else {
            let mut out = vec![0.0f32; rows * n];
            call(Act::F32(&self.x32), ActMut::F32(&mut out));
            out
        }
    }

    fn check(&self, what: &str, y: &[f32], bf16_x: bool, bias: bool) {
        let Shape { rows, k, n } = self.shape;
        for r in 0..rows {
            for o in 0..n {
                let (y64, abs) = self.reference(bf16_x, bias, r, o);
                let got = y[r * n + o] as f64;
                let bound = int4_error_bound(k, self.group, abs, y64, bf16_x);
                assert!(
                    (got - y64).abs() <= bound,
                    "{what} bf16_x={bf16_x} bias={bias} {:?} group {} ({r}, {o}): {got} vs {y64} (bound {bound})",
                    self.shape,
                    self.group
                );
            }
        }
    }
}

const LAYOUTS: [Int4Layout; 3] = [Int4Layout::Avx512, Int4Layout::Avx2, Int4Layout::Default];

/// `(rows, in, out, group)`: decode and 2 to 9 rows (every row tile and its remainder), full
/// blocks and every shorter last block (16, 32, 48 outputs), groups from 2 to the whole row.
const SHAPES: [(usize, usize, usize, usize); 8] = [
    (1, 64, 64, 32),
    (1, 128, 80, 32),
    (2, 96, 112, 32),
    (3, 64, 16, 64),
    (4, 256, 128, 128),
    (5, 64, 64, 2),
    (9, 32, 96, 16),
    (1, 256, 192, 256),
];

#[test]
fn every_path_and_layout_is_within_the_bound_of_the_float64_reference() {
    for simd in Simd::available() {
        for (c, &(rows, k, n, group)) in SHAPES.iter().enumerate() {
            let case = case(rows, k, n, group, c as u64 + 1);
            for layout in LAYOUTS {
                for szt in [SzType::F32, SzType::Bf16, SzType::F16] {
                    for bf16_x in [false, true] {
                        for bias in [false, true] {
                            let y = case.run(simd, 1, layout, szt, bf16_x, bias);
                            case.check(&format!("{} {layout:?} {szt:?}", simd.name()), &y, bf16_x, bias);
                        }
                    }
                }
            }
        }
    }
}

/// The grouped path in plain Rust (what a CPU without an x86 path runs) on this CPU.
#[test]
fn the_portable_grouped_path_is_within_the_bound() {
    for (c, &(rows, k, n, group)) in SHAPES.iter().enumerate() {
        let case = case(rows, k, n, group, 50 + c as u64);
        for layout in LAYOUTS {
            for bf16_x in [false, true] {
                let q = pack(&case.codes, n, k, layout);
                let w = Int4 {
                    q: &q,
                    scale_zero: Scale::F32(&case.sz),
                    group,
                    layout,
                };
                let x = if bf16_x {
                    Act::Bf16(&case.xb)
                } else {
                    Act::F32(&case.x32)
                };
                // A path other than scalar: the job has its float32 activations and group sums.
                let job = Job::new(case.shape, x, w, Some(Act::F32(&case.bias)), Simd::Avx2);
                let mut o32 = vec![0.0f32; rows * n];
                let mut ob = OutBlock::F32(o32.chunks_mut(n).collect());
                grouped(&job, 0, &mut ob);
                let mut y = o32;
                if bf16_x {
                    y.iter_mut().for_each(|v| *v = bf16_to_f32(f32_to_bf16(*v)));
                }
                case.check(&format!("portable {layout:?}"), &y, bf16_x, true);
            }
        }
    }
}

#[test]
fn the_packing_is_read_back_code_by_code() {
    let (k, n) = (8, 112);
    let codes: Vec<u8> = (0..n * k).map(|v| (v * 7 % 16) as u8).collect();
    for layout in LAYOUTS {
        let q = pack(&codes, n, k, layout);
        let w = Int4 {
            q: &q,
            scale_zero: Scale::F32(&[]),
            group: 2,
            layout,
        };
        for o in 0..n {
            for i in 0..k {
                assert_eq!(w.code(o, i, k, n), codes[o * k + i], "{layout:?} ({o}, {i})");
            }
        }
    }
}

#[test]
fn results_do_not_depend_on_the_thread_count() {
    let c = case(3, 128, 400, 32, 7);
    for simd in Simd::available() {
        for bf16_x in [false, true] {
            let one = c.run(simd, 1, Int4Layout::Avx512, SzType::Bf16, bf16_x, true);
            for threads in [2, 3, 5] {
                let y = c.run(simd, threads, Int4Layout::Avx512, SzType::Bf16, bf16_x, true);
                assert!(same_bits(&one, &y), "{} {threads} threads", simd.name());
            }
        }
    }
}

#[test]
fn scalar_is_the_reference_order() {
    let c = case(2, 64, 32, 16, 3);
    let y = c.run(Simd::Scalar, 1, Int4Layout::Default, SzType::F32, false, true);
    for r in 0..2 {
        for o in 0..32 {
            let mut s = 0.0f32;
            for i in 0..64 {
                let j = (i / 16 * 32 + o) * 2;
                let w = (c.codes[o * 64 + i] as f32 - 8.0) * c.sz[j] + c.sz[j + 1];
                s += c.x32[r * 64 + i] * w;
            }
            assert_eq!(y[r * 32 + o], s + c.bias[o]);
        }
    }
}

#[test]
fn bad_buffers_are_refused_before_anything_is_written() {
    let c = case(2, 64, 32, 16, 1);
    let q = pack(&c.codes, 32, 64, Int4Layout::Avx512);
    let w = |q: &'static [u8], sz: &'static [f32], group: usize| Int4 {
        q,
        scale_zero: Scale::F32(sz),
        group,
        layout: Int4Layout::Avx512,
    };
    let q: &'static [u8] = Box::leak(q.into_boxed_slice());
    let sz: &'static [f32] = Box::leak(c.sz.clone().into_boxed_slice());
    let mut out = vec![7.0f32; 64];
    let s = c.shape;
    let bad = |shape: Shape, w: Int4<'_>, out: &mut [f32]| {
        linear_int4(Simd::Scalar, None, shape, Act::F32(&c.x32), w, None, ActMut::F32(out))
            .unwrap_err()
            .to_string()
    };
    let e = bad(s, w(q, sz, 3), &mut out);
    assert!(e.starts_with("group_size: must be even"), "{e}");
    let e = bad(s, w(q, sz, 128), &mut out);
    assert!(e.starts_with("group_size: 128 does not divide"), "{e}");
    let e = bad(Shape { n: 24, ..s }, w(q, sz, 16), &mut out[..48]);
    assert!(e.starts_with("weight: out (24) must be a multiple of 16"), "{e}");
    let e = bad(s, w(&q[..100], sz, 16), &mut out);
    assert!(e.starts_with("weight: has 100 bytes"), "{e}");
    let e = bad(s, w(q, &sz[..10], 16), &mut out);
    assert!(e.starts_with("scale_and_zero: has 10 elements"), "{e}");
    let e = bad(s, w(q, sz, 16), &mut out[..63]);
    assert!(e.starts_with("out: has 63 elements"), "{e}");
    assert!(out.iter().all(|&v| v == 7.0));
}
