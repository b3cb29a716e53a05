//! Every path of this CPU (and the portable lanes, which the NEON path is) against a float64
//! reference, within [`error_bound`]; thread counts give the same bits.

use super::test_util::{same_bits, Rng};
use super::*;
use crate::elem::f32_to_f16;
use crate::isa::Simd;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    Bf16,
    Int8,
    Fp8,
}

struct Case {
    shape: Shape,
    x32: Vec<f32>,
    xb: Vec<Bf16>,
    wb: Vec<Bf16>,
    q8: Vec<i8>,
    f8: Vec<u8>,
    scale: Vec<f32>,
    bias: Vec<f32>,
}

fn case(rows: usize, k: usize, n: usize, seed: u64) -> Case {
    let mut g = Rng::seeded(seed);
    let x32: Vec<f32> = (0..rows * k).map(|_| g.f() * 4.0).collect();
    let xb = x32.iter().map(|&v| Bf16(f32_to_bf16(v))).collect();
    let wb = (0..n * k).map(|_| Bf16(f32_to_bf16(g.f() * 0.1))).collect();
    let q8 = (0..n * k).map(|_| g.int8()).collect::<Vec<i8>>();
    let f8 = (0..n * k).map(|_| g.fp8()).collect();
    let scale = (0..n).map(|_| (g.f().abs() + 0.01) * 0.02).collect();
    let bias = (0..n).map(|_| g.f()).collect();
    Case {
        shape: Shape { rows, k, n },
        x32,
        xb,
        wb,
        q8,
        f8,
        scale,
        bias,
    }
}

impl Case {
    fn weight(&self, kind: Kind) -> Weight<'_> {
        match kind {
            Kind::Bf16 => Weight::Bf16(&self.wb),
            Kind::Int8 => Weight::Int8 {
                q: &self.q8,
                scale: Scale::F32(&self.scale),
            },
            Kind::Fp8 => Weight::Fp8 {
                q: &self.f8,
                scale: Scale::F32(&self.scale),
            },
        }
    }
    /// `(y64, sum |x w| |s| + |b|)` of element (r, o), in float64.
    fn reference(&self, kind: Kind, bf16_x: bool, bias: bool, r: usize, o: usize) -> (f64, f64) {
        let Shape { k, .. } = self.shape;
        let w = self.weight(kind);
        let (mut s, mut a) = (0.0f64, 0.0f64);
        for i in 0..k {
            let x = if bf16_x {
                bf16_to_f32(self.xb[r * k + i].0)
            } else {
                self.x32[r * k + i]
            } as f64;
            let p = x * w.get(o, i, k) as f64;
            s += p;
            a += p.abs();
        }
        let sc = if kind == Kind::Bf16 { 1.0 } else { self.scale[o] as f64 };
        let b = if bias { self.bias[o] as f64 } else { 0.0 };
        (s * sc + b, a * sc.abs() + b.abs())
    }
    /// Runs `linear` and returns the output as float32.
    fn run(&self, simd: Simd, threads: usize, kind: Kind, bf16_x: bool, bias: bool) -> Vec<f32> {
        let pool = crate::pool::get(threads).unwrap();
        let Shape { rows, n, .. } = self.shape;
        let b = bias.then_some(Act::F32(&self.bias[..]));
        if bf16_x {
            let mut out = vec![Bf16(0); rows * n];
            linear(
                simd,
                pool.as_deref(),
                self.shape,
                Act::Bf16(&self.xb),
                self.weight(kind),
                b,
                ActMut::Bf16(&mut out),
            )
            .unwrap();
            out.iter().map(|v| bf16_to_f32(v.0)).collect()
        } else {
            let mut out = vec![0.0f32; rows * n];
            linear(
                simd,
                pool.as_deref(),
                self.shape,
                Act::F32(&self.x32),
                self.weight(kind),
                b,
                ActMut::F32(&mut out),
            )
            .unwrap();
            out
        }
    }
    fn check(&self, what: &str, y: &[f32], kind: Kind, bf16_x: bool, bias: bool) {
        let Shape { rows, k, n } = self.shape;
        for r in 0..rows {
            for o in 0..n {
                let (y64, abs) = self.reference(kind, bf16_x, bias, r, o);
                let got = y[r * n + o] as f64;
                let bound = error_bound(k, abs, y64, bf16_x);
                assert!(
                    (got - y64).abs() <= bound,
                    "{what} {kind:?} bf16_x={bf16_x} bias={bias} {:?} ({r}, {o}): {got} vs {y64} (bound {bound})",
                    self.shape
                );
            }
        }
    }
}

const KINDS: [Kind; 3] = [Kind::Bf16, Kind::Int8, Kind::Fp8];

/// Shapes: decode (1 row) and 2 to 9 rows (every tile and its remainders), `in` with and without
/// a tail, `out` with and without odd columns.
const SHAPES: [(usize, usize, usize); 8] = [
    (1, 64, 16),
    (1, 200, 37),
    (2, 96, 24),
    (3, 33, 11),
    (4, 128, 20),
    (5, 70, 9),
    (9, 64, 19),
    (1, 7, 3),
];

#[test]
fn every_path_is_within_the_bound_of_the_float64_reference() {
    for simd in Simd::available() {
        for (i, &(rows, k, n)) in SHAPES.iter().enumerate() {
            let c = case(rows, k, n, i as u64 + 1);
            for kind in KINDS {
                for bf16_x in [false, true] {
                    for bias in [false, true] {
                        let y = c.run(simd, 1, kind, bf16_x, bias);
                        c.check(simd.name(), &y, kind, bf16_x, bias);
                    }
                }
            }
        }
    }
}

/// The portable lanes (the NEON path's code) on this CPU, through the same tiles.
#[test]
fn the_portable_lanes_are_within_the_bound() {
    for (i, &(rows, k, n)) in SHAPES.iter().enumerate() {
        let c = case(rows, k, n, 100 + i as u64);
        for kind in KINDS {
            for bf16_x in [false, true] {
                let pool = crate::pool::get(2).unwrap();
                let x = if bf16_x { Act::Bf16(&c.xb) } else { Act::F32(&c.x32) };
                let (rows, n) = (c.shape.rows, c.shape.n);
                let mut o32 = vec![0.0f32; rows * n];
                let mut ob = vec![Bf16(0); rows * n];
                let out = if bf16_x {
                    ActMut::Bf16(&mut ob)
                } else {
                    ActMut::F32(&mut o32)
                };
                let job = Job {
                    shape: c.shape,
                    x,
                    w: c.weight(kind),
                    scale: c.weight(kind).scale().map_or(vec![1.0; n], |s| s.per_row(n)),
                    bias: c.bias.clone(),
                };
                run::<tile::PortablePath>(None, pool.as_deref(), &job, out);
                let y: Vec<f32> = if bf16_x {
                    ob.iter().map(|v| bf16_to_f32(v.0)).collect()
                } else {
                    o32
                };
                c.check("portable", &y, kind, bf16_x, true);
            }
        }
    }
}

#[test]
fn results_do_not_depend_on_the_thread_count() {
    let c = case(3, 160, 301, 7);
    for simd in Simd::available() {
        for kind in KINDS {
            let one = c.run(simd, 1, kind, false, true);
            for threads in [2, 3, 5] {
                let y = c.run(simd, threads, kind, false, true);
                assert!(same_bits(&one, &y), "{} {kind:?} {threads} threads", simd.name());
            }
        }
    }
}

#[test]
fn scalar_is_the_reference_order() {
    let c = case(2, 50, 5, 3);
    let y = c.run(Simd::Scalar, 1, Kind::Int8, false, true);
    for r in 0..2 {
        for o in 0..5 {
            let mut s = 0.0f32;
            for i in 0..50 {
                s += c.x32[r * 50 + i] * c.q8[o * 50 + i] as f32;
            }
            assert_eq!(y[r * 5 + o], s * c.scale[o] + c.bias[o]);
        }
    }
}

/// fp8 NaN codes make their outputs NaN, infinities in bfloat16 weights give infinities, on every
/// path, as the reference's arithmetic does.
#[test]
fn nan_codes_and_infinities_propagate() {
    for simd in Simd::available() {
        let mut c = case(1, 64, 16, 11);
        c.f8[3 * 64 + 40] = 0x7f;
        c.f8[5 * 64 + 2] = 0xff;
        c.wb[7 * 64 + 33] = Bf16(0x7f80);
        let y = c.run(simd, 1, Kind::Fp8, false, false);
        for (o, v) in y.iter().enumerate() {
            assert_eq!(v.is_nan(), o == 3 || o == 5, "{} fp8 output {o}: {v}", simd.name());
        }
        let y = c.run(simd, 1, Kind::Bf16, false, false);
        for (o, v) in y.iter().enumerate() {
            assert_eq!(v.is_infinite(), o == 7, "{} bf16 output {o}: {v}", simd.name());
        }
    }
}

#[test]
fn scales_of_every_dtype_and_per_tensor() {
    let c = case(2, 48, 6, 5);
    let sb: Vec<Bf16> = c.scale.iter().map(|&s| Bf16(f32_to_bf16(s))).collect();
    let sh: Vec<F16> = c.scale.iter().map(|&s| F16(f32_to_f16(s))).collect();
    for simd in Simd::available() {
        let run = |scale: Scale<'_>| {
            let mut out = vec![0.0f32; 12];
            let w = Weight::Int8 { q: &c.q8, scale };
            linear(simd, None, c.shape, Act::F32(&c.x32), w, None, ActMut::F32(&mut out)).unwrap();
            out
        };
        let exact = |scales: &[f32], y: &[f32]| {
            for r in 0..2 {
                for o in 0..6 {
                    let s: f64 = (0..48)
                        .map(|i| c.x32[r * 48 + i] as f64 * c.q8[o * 48 + i] as f64)
                        .sum();
                    let a: f64 = (0..48)
                        .map(|i| (c.x32[r * 48 + i] as f64 * c.q8[o * 48 + i] as f64).abs())
                        .sum();
                    let sc = scales[o.min(scales.len() - 1)] as f64;
                    let y64 = s * sc;
                    assert!((y[r * 6 + o] as f64 - y64).abs() <= error_bound(48, a * sc.abs(), y64, false));
                }
            }
        };
        let bs: Vec<f32> = sb.iter().map(|v| bf16_to_f32(v.0)).collect();
        let hs: Vec<f32> = sh.iter().map(|v| f16_to_f32(v.0)).collect();
        exact(&bs, &run(Scale::Bf16(&sb)));
        exact(&hs, &run(Scale::F16(&sh)));
        exact(&c.scale[..1], &run(Scale::F32(&c.scale[..1])));
    }
}

#[test]
fn bad_buffers_are_refused_before_anything_is_written() {
    let c = case(2, 16, 4, 1);
    let mut out = vec![7.0f32; 8];
    let w = c.weight(Kind::Int8);
    let bad = |shape: Shape, x: Act<'_>, w: Weight<'_>, b: Option<Act<'_>>, out: ActMut<'_>| {
        linear(Simd::Scalar, None, shape, x, w, b, out).unwrap_err().to_string()
    };
    let s = c.shape;
    let e = bad(Shape { k: 15, ..s }, Act::F32(&c.x32), w, None, ActMut::F32(&mut out));
    assert!(e.starts_with("x: has 32 elements"), "{e}");
    let e = bad(
        s,
        Act::F32(&c.x32),
        Weight::Bf16(&c.wb[..10]),
        None,
        ActMut::F32(&mut out),
    );
    assert!(e.starts_with("weight: has 10 elements"), "{e}");
    let w2 = Weight::Int8 {
        q: &c.q8,
        scale: Scale::F32(&c.scale[..3]),
    };
    let e = bad(s, Act::F32(&c.x32), w2, None, ActMut::F32(&mut out));
    assert!(e.starts_with("scale: has 3 elements"), "{e}");
    let e = bad(
        s,
        Act::F32(&c.x32),
        w,
        Some(Act::F32(&c.bias[..2])),
        ActMut::F32(&mut out),
    );
    assert!(e.starts_with("bias: has 2 elements"), "{e}");
    let e = bad(s, Act::F32(&c.x32), w, None, ActMut::F32(&mut out[..7]));
    assert!(e.starts_with("out: has 7 elements"), "{e}");
    let mut ob = vec![Bf16(0); 8];
    let e = bad(s, Act::F32(&c.x32), w, None, ActMut::Bf16(&mut ob));
    assert!(e.starts_with("out: dtype must be the activations'"), "{e}");
    assert!(out.iter().all(|&v| v == 7.0) && ob.iter().all(|v| v.0 == 0));
}

#[test]
fn empty_shapes_write_nothing_and_in_zero_gives_the_bias() {
    for simd in Simd::available() {
        let mut out = vec![9.0f32; 3];
        let bias = [1.0f32, 2.0, 3.0];
        let shape = Shape { rows: 1, k: 0, n: 3 };
        let w = Weight::Int8 {
            q: &[],
            scale: Scale::F32(&[0.5]),
        };
        linear(
            simd,
            None,
            shape,
            Act::F32(&[]),
            w,
            Some(Act::F32(&bias)),
            ActMut::F32(&mut out),
        )
        .unwrap();
        assert_eq!(out, bias);
        let shape = Shape { rows: 0, k: 4, n: 3 };
        linear(
            simd,
            None,
            shape,
            Act::F32(&[]),
            Weight::Bf16(&[Bf16(0); 12]),
            None,
            ActMut::F32(&mut []),
        )
        .unwrap();
    }
}

/// `linear_on` with a team gives `linear`'s bits (here, without an OpenMP runtime in the test binary, on the
/// pool; Python's tests run it on torch's team).
#[test]
fn linear_omp_is_linear_bit_for_bit() {
    let c = case(3, 160, 301, 9);
    let pool = crate::pool::get(2).unwrap();
    for kind in KINDS {
        let mut a = vec![0.0f32; 3 * 301];
        let mut b = vec![1.0f32; 3 * 301];
        let x = Act::F32(&c.x32);
        linear(
            Simd::best(),
            pool.as_deref(),
            c.shape,
            x,
            c.weight(kind),
            None,
            ActMut::F32(&mut a),
        )
        .unwrap();
        linear_on(
            Simd::best(),
            Some(2),
            pool.as_deref(),
            c.shape,
            x,
            c.weight(kind),
            None,
            ActMut::F32(&mut b),
        )
        .unwrap();
        assert!(same_bits(&a, &b), "{kind:?}");
    }
}
