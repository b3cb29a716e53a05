//! `experts` on every path of this CPU (and the portable lanes) against a float64 evaluation of
//! the same formula within the module's stated bound; bitwise the per-expert loop of `linear`
//! calls on the same path; thread counts and batches give the same bits; bad input refused first.

use super::experts::{experts, Activation, Expert, ExpertsShape};
use super::test_util::{same_bits, Rng};
use super::*;
use crate::elem::{f32_to_f16, F16};
use crate::isa::Simd;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    Bf16,
    Int8,
    Fp8,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum ScaleKind {
    F32,
    Bf16,
    F16,
    /// One float32 for the tensor.
    Tensor,
}

/// One expert's stored matrix and its scale in each dtype.
struct Mat {
    wb: Vec<Bf16>,
    q8: Vec<i8>,
    f8: Vec<u8>,
    s32: Vec<f32>,
    sb: Vec<Bf16>,
    sh: Vec<F16>,
}

fn mat(g: &mut Rng, n: usize, k: usize, amp: f32) -> Mat {
    let wb = (0..n * k).map(|_| Bf16(f32_to_bf16(g.f() * amp))).collect();
    let q8 = (0..n * k).map(|_| g.int8()).collect();
    let f8 = (0..n * k).map(|_| g.fp8()).collect();
    let s32: Vec<f32> = (0..n).map(|_| (g.f().abs() + 0.01) * amp / 64.0).collect();
    let sb = s32.iter().map(|&s| Bf16(f32_to_bf16(s))).collect();
    let sh = s32.iter().map(|&s| F16(f32_to_f16(s))).collect();
    Mat {
        wb,
        q8,
        f8,
        s32,
        sb,
        sh,
    }
}

impl Mat {
    fn weight(&self, kind: Kind, sk: ScaleKind) -> Weight<'_> {
        let scale = match sk {
            ScaleKind::F32 => Scale::F32(&self.s32),
            ScaleKind::Bf16 => Scale::Bf16(&self.sb),
            ScaleKind::F16 => Scale::F16(&self.sh),
            ScaleKind::Tensor => Scale::F32(&self.s32[..1]),
        };
        match kind {
            Kind::Bf16 => Weight::Bf16(&self.wb),
            Kind::Int8 => Weight::Int8 { q: &self.q8, scale },
            Kind::Fp8 => Weight::Fp8 { q: &self.f8, scale },
        }
    }
}

/// The dequantized weight `[o, i]` and its scale, as float64.
fn w64(w: &Weight<'_>, o: usize, i: usize, k: usize) -> f64 {
    w.get(o, i, k) as f64
}
fn s64(w: &Weight<'_>, o: usize) -> f64 {
    match w.scale() {
        None => 1.0,
        Some(s) => {
            let v = s.per_row(o + 1);
            v[o] as f64
        }
    }
}

struct Case {
    shape: ExpertsShape,
    x32: Vec<f32>,
    xb: Vec<Bf16>,
    gate_up: Vec<Mat>,
    down: Vec<Mat>,
    index: Vec<i64>,
    w32: Vec<f32>,
    wb: Vec<Bf16>,
}

/// A random case: `rows` rows, `u` experts, `k` slots with duplicates and skips.
fn case(rows: usize, hidden: usize, inter: usize, u: usize, k: usize, seed: u64) -> Case {
    let mut g = Rng::seeded(seed);
    let x32: Vec<f32> = (0..rows * hidden).map(|_| g.f() * 2.0).collect();
    let xb = x32.iter().map(|&v| Bf16(f32_to_bf16(v))).collect();
    let gate_up = (0..u).map(|_| mat(&mut g, 2 * inter, hidden, 0.3)).collect();
    let down = (0..u).map(|_| mat(&mut g, hidden, inter, 0.3)).collect();
    let index = (0..rows * k)
        .map(|_| match g.below(8) {
            0 => -1,
            _ => g.below(u) as i64,
        })
        .collect();
    let w32: Vec<f32> = (0..rows * k).map(|_| g.f()).collect();
    let wb = w32.iter().map(|&v| Bf16(f32_to_bf16(v))).collect();
    Case {
        shape: ExpertsShape { rows, hidden, inter, k },
        x32,
        xb,
        gate_up,
        down,
        index,
        w32,
        wb,
    }
}

#[derive(Clone, Copy, Debug)]
struct Opts {
    kind: Kind,
    scale: ScaleKind,
    bf16_x: bool,
    bf16_w: bool,
    act: Activation,
}

fn act64(act: Activation, t: f64) -> f64 {
    match act {
        Activation::Silu => t / (1.0 + (-t).exp()),
        Activation::GeluTanh => {
            0.5 * t * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (t + 0.044715 * t * t * t)).tanh())
        }
    }
}

impl Case {
    fn experts(&self, o: Opts) -> Vec<Expert<'_>> {
        self.gate_up
            .iter()
            .zip(&self.down)
            .map(|(g, d)| Expert {
                gate_up: g.weight(o.kind, o.scale),
                down: d.weight(o.kind, o.scale),
            })
            .collect()
    }
    fn x(&self, o: Opts) -> Act<'_> {
        if o.bf16_x {
            Act::Bf16(&self.xb)
        } else {
            Act::F32(&self.x32)
        }
    }
    fn weights(&self, o: Opts) -> Act<'_> {
        if o.bf16_w {
            Act::Bf16(&self.wb)
        } else {
            Act::F32(&self.w32)
        }
    }
    fn run(&self, simd: Simd, threads: usize, o: Opts) -> Vec<f32> {
        let pool = crate::pool::get(threads).unwrap();
        let ExpertsShape { rows, hidden, .. } = self.shape;
        let ex = self.experts(o);
        let call = |a: ActMut<'_>| {
            experts(
                simd,
                pool.as_deref(),
                self.shape,
                self.x(o),
                &ex,
                &self.index,
                self.weights(o),
                o.act,
                a,
            )
            .unwrap()
        };
        if o.bf16_x {
            let mut out = vec![Bf16(0x7fc0); rows * hidden];
            call(ActMut::Bf16(&mut out));
            out.iter().map(|v| bf16_to_f32(v.0)).collect()
        } else {
            let mut out = vec![f32::NAN; rows * hidden];
            call(ActMut::F32(&mut out));
            out
        }
    }
    /// The float64 result and the module's bound, per output element.
    fn reference(&self, o: Opts) -> (Vec<f64>, Vec<f64>) {
        let ExpertsShape { rows, hidden, inter, k } = self.shape;
        let u = f64::powi(2.0, -24);
        let gamma = |m: usize| m as f64 * u / (1.0 - m as f64 * u);
        let eb = |kk: usize, abs: f64| error_bound(kk, abs, 0.0, false);
        let l = 1.13;
        let ex = self.experts(o);
        let x = self.x(o);
        let wts = self.weights(o);
        let (mut y, mut bound) = (vec![0.0; rows * hidden], vec![0.0; rows * hidden]);
        for r in 0..rows {
            let mut o64 = vec![0.0f64; hidden];
            let mut abs_o = vec![0.0f64; hidden];
            let mut err_o = vec![0.0f64; hidden];
            let mut valid = 0;
            for j in 0..k {
                let e = self.index[r * k + j];
                if e < 0 {
                    continue;
                }
                valid += 1;
                let w = wts.get(r * k + j) as f64;
                let Expert { gate_up, down } = ex[e as usize];
                let (mut h, mut eh) = (vec![0.0; inter], vec![0.0; inter]);
                for c in 0..inter {
                    let dot = |row: usize| -> (f64, f64) {
                        let (mut s, mut a) = (0.0, 0.0);
                        for i in 0..hidden {
                            let p = x.get(r * hidden + i) as f64 * w64(&gate_up, row, i, hidden);
                            s += p;
                            a += p.abs();
                        }
                        let sc = s64(&gate_up, row);
                        (s * sc, a * sc.abs())
                    };
                    let (g, ag) = dot(c);
                    let (v, av) = dot(inter + c);
                    let (eg, ev) = (eb(hidden, ag), eb(hidden, av));
                    let a = act64(o.act, g);
                    let ea = l * eg + 8.0 * u * (a.abs() + g.abs() + (l + 1.0) * eg);
                    h[c] = a * v;
                    eh[c] = ea * (v.abs() + ev) + a.abs() * ev + u * (a.abs() + ea) * (v.abs() + ev);
                }
                for oc in 0..hidden {
                    let sc = s64(&down, oc);
                    let (mut s, mut a, mut prop) = (0.0, 0.0, 0.0);
                    for c in 0..inter {
                        let wd = w64(&down, oc, c, inter);
                        s += h[c] * wd;
                        a += (h[c].abs() + eh[c]) * wd.abs();
                        prop += eh[c] * wd.abs();
                    }
                    let yv = s * sc;
                    let ey = eb(inter, a * sc.abs()) + prop * sc.abs();
                    o64[oc] += w * yv;
                    abs_o[oc] += w.abs() * (yv.abs() + ey);
                    err_o[oc] += w.abs() * ey;
                }
            }
            for oc in 0..hidden {
                let mut e = gamma(valid + 1) * abs_o[oc] + err_o[oc];
                if o.bf16_x {
                    e += (o64[oc].abs() + e) * f64::powi(2.0, -8);
                }
                y[r * hidden + oc] = o64[oc];
                bound[r * hidden + oc] = e;
            }
        }
        (y, bound)
    }
    fn check(&self, what: &str, got: &[f32], o: Opts) {
        let (y, bound) = self.reference(o);
        for (i, ((&g, &y), &b)) in got.iter().zip(&y).zip(&bound).enumerate() {
            assert!(
                (g as f64 - y).abs() <= b,
                "{what} {o:?} {:?} element {i}: {g} vs {y} (bound {b})",
                self.shape
            );
        }
    }
}

const KINDS: [Kind; 3] = [Kind::Bf16, Kind::Int8, Kind::Fp8];
const SCALES: [ScaleKind; 4] = [ScaleKind::F32, ScaleKind::Bf16, ScaleKind::F16, ScaleKind::Tensor];

fn opts(kind: Kind, i: usize) -> Opts {
    Opts {
        kind,
        scale: SCALES[i % 4],
        bf16_x: i.is_multiple_of(2),
        bf16_w: i.is_multiple_of(3),
        act: if i % 5 == 4 {
            Activation::GeluTanh
        } else {
            Activation::Silu
        },
    }
}

/// Random shapes: rows 1..16, k 1..8, U 1..16, hidden and intermediate with and without the
/// tiles' tails; duplicates and skips in the index; every format, scale dtype, activation dtype.
#[test]
fn every_path_is_within_the_bound_of_the_float64_reference() {
    let mut g = Rng(12345);
    for i in 0..12 {
        let rows = 1 + g.below(16);
        let k = 1 + g.below(8);
        let u = 1 + g.below(16);
        let hidden = 1 + g.below(96);
        let inter = 1 + g.below(48);
        let c = case(rows, hidden, inter, u, k, i as u64 + 1);
        for kind in KINDS {
            let o = opts(kind, i + kind as usize);
            for simd in Simd::available() {
                let y = c.run(simd, 1 + i % 2, o);
                c.check(simd.name(), &y, o);
            }
        }
    }
}

/// Every activation dtype, weights dtype and activation on one case, each path.
#[test]
fn every_dtype_and_activation_on_every_path() {
    let c = case(5, 70, 33, 6, 4, 77);
    for simd in Simd::available() {
        for kind in KINDS {
            for bf16_x in [false, true] {
                for act in [Activation::Silu, Activation::GeluTanh] {
                    let o = Opts {
                        kind,
                        scale: ScaleKind::F32,
                        bf16_x,
                        bf16_w: bf16_x,
                        act,
                    };
                    c.check(simd.name(), &c.run(simd, 1, o), o);
                }
            }
        }
    }
}

/// The portable lanes (the NEON path's code) on this CPU.
#[test]
fn the_portable_lanes_are_within_the_bound() {
    let c = case(4, 80, 24, 5, 3, 9);
    for kind in KINDS {
        for bf16_x in [false, true] {
            let o = Opts {
                kind,
                scale: ScaleKind::F32,
                bf16_x,
                bf16_w: false,
                act: Activation::Silu,
            };
            let ExpertsShape { rows, hidden, .. } = c.shape;
            let ex = c.experts(o);
            let w: Vec<f32> = c.w32.clone();
            let mut o32 = vec![0.0f32; rows * hidden];
            let mut ob = vec![Bf16(0); rows * hidden];
            let out = if bf16_x {
                ActMut::Bf16(&mut ob)
            } else {
                ActMut::F32(&mut o32)
            };
            experts::run::<tile::PortablePath>(None, None, c.shape, c.x(o), &ex, &c.index, &w, o.act, out);
            let y: Vec<f32> = if bf16_x {
                ob.iter().map(|v| bf16_to_f32(v.0)).collect()
            } else {
                o32
            };
            c.check("portable", &y, o);
        }
    }
}

/// The one call is the per-expert loop of `linear` calls on the same path, bit for bit: gate/up
/// into float32, `act(gate) * up`, down into float32, the slots' weighted sum in slot order,
/// rounded once.
#[test]
fn the_call_is_the_loop_of_linear_calls_on_the_same_path() {
    let c = case(6, 75, 37, 7, 5, 21);
    let ExpertsShape { rows, hidden, inter, k } = c.shape;
    for simd in Simd::available() {
        for kind in KINDS {
            let o = Opts {
                kind,
                scale: ScaleKind::Bf16,
                bf16_x: true,
                bf16_w: false,
                act: Activation::Silu,
            };
            let got = c.run(simd, 2, o);
            let ex = c.experts(o);
            for r in 0..rows {
                let mut acc = vec![0.0f32; hidden];
                for j in 0..k {
                    let e = c.index[r * k + j];
                    if e < 0 {
                        continue;
                    }
                    let Expert { gate_up, down } = ex[e as usize];
                    // The kernel's job as `linear` runs it, with a float32 output (`linear` itself
                    // rounds to the activations' dtype).
                    let x = Act::Bf16(&c.xb[r * hidden..(r + 1) * hidden]);
                    let mut gu = vec![0.0f32; 2 * inter];
                    let job = Job {
                        shape: Shape {
                            rows: 1,
                            k: hidden,
                            n: 2 * inter,
                        },
                        x,
                        w: gate_up,
                        scale: gate_up.scale().map_or(vec![1.0; 2 * inter], |s| s.per_row(2 * inter)),
                        bias: vec![0.0; 2 * inter],
                    };
                    dispatch!(simd, run(None, None, &job, ActMut::F32(&mut gu)));
                    let h: Vec<f32> = (0..inter).map(|i| o.act.apply(gu[i]) * gu[inter + i]).collect();
                    let mut y = vec![0.0f32; hidden];
                    linear(
                        simd,
                        None,
                        Shape {
                            rows: 1,
                            k: inter,
                            n: hidden,
                        },
                        Act::F32(&h),
                        down,
                        None,
                        ActMut::F32(&mut y),
                    )
                    .unwrap();
                    for (a, y) in acc.iter_mut().zip(&y) {
                        *a += c.w32[r * k + j] * *y;
                    }
                }
                for (i, a) in acc.iter().enumerate() {
                    let want = bf16_to_f32(f32_to_bf16(*a));
                    let g = got[r * hidden + i];
                    assert_eq!(
                        g.to_bits(),
                        want.to_bits(),
                        "{} {kind:?} ({r}, {i}): {g} vs {want}",
                        simd.name()
                    );
                }
            }
        }
    }
}

/// Thread counts, and the other rows of a call, change no bit of a row's result.
#[test]
fn results_depend_neither_on_threads_nor_on_the_batch() {
    let c = case(9, 130, 70, 6, 4, 5);
    let ExpertsShape { hidden, k, .. } = c.shape;
    for simd in Simd::available() {
        for kind in KINDS {
            let o = opts(kind, 1);
            let one = c.run(simd, 1, o);
            for threads in [2, 3, 5] {
                let y = c.run(simd, threads, o);
                assert!(same_bits(&one, &y), "{} {kind:?} {threads} threads", simd.name());
            }
            // Row 4 alone.
            let r = 4;
            let alone = Case {
                shape: ExpertsShape { rows: 1, ..c.shape },
                x32: c.x32[r * hidden..(r + 1) * hidden].to_vec(),
                xb: c.xb[r * hidden..(r + 1) * hidden].to_vec(),
                gate_up: Vec::new(),
                down: Vec::new(),
                index: c.index[r * k..(r + 1) * k].to_vec(),
                w32: c.w32[r * k..(r + 1) * k].to_vec(),
                wb: c.wb[r * k..(r + 1) * k].to_vec(),
            };
            let ex = c.experts(o);
            assert!(!o.bf16_x);
            let mut out = vec![0.0f32; hidden];
            let a = ActMut::F32(&mut out);
            experts(
                simd,
                None,
                alone.shape,
                alone.x(o),
                &ex,
                &alone.index,
                alone.weights(o),
                o.act,
                a,
            )
            .unwrap();
            assert!(
                same_bits(&out, &one[r * hidden..]),
                "{} {kind:?}: row {r} alone",
                simd.name()
            );
        }
    }
}

/// Rows whose slots are all skipped get zeros; no rows, no experts, no intermediate columns.
#[test]
fn skipped_rows_are_zero_and_empty_shapes_work() {
    let mut c = case(3, 40, 12, 4, 2, 3);
    c.index = vec![-1, -1, 0, 3, -1, -1];
    let o = opts(Kind::Int8, 1);
    for simd in Simd::available() {
        let y = c.run(simd, 2, o);
        assert!(y[..40].iter().chain(&y[80..]).all(|&v| v == 0.0));
        assert!(y[40..80].iter().any(|&v| v != 0.0));
        c.check(simd.name(), &y, o);
        // No experts at all: every slot skipped.
        let shape = ExpertsShape {
            rows: 1,
            hidden: 4,
            inter: 0,
            k: 2,
        };
        let mut out = vec![5.0f32; 4];
        experts(
            simd,
            None,
            shape,
            Act::F32(&[1.0; 4]),
            &[],
            &[-1, -1],
            Act::F32(&[1.0, 1.0]),
            Activation::Silu,
            ActMut::F32(&mut out),
        )
        .unwrap();
        assert_eq!(out, [0.0; 4]);
        // No intermediate columns: every expert gives zero.
        let z = [Bf16(0); 0];
        let e = Expert {
            gate_up: Weight::Bf16(&z),
            down: Weight::Bf16(&z),
        };
        let mut out = vec![5.0f32; 4];
        experts(
            simd,
            None,
            shape,
            Act::F32(&[1.0; 4]),
            &[e],
            &[0, 0],
            Act::F32(&[1.0, 1.0]),
            Activation::Silu,
            ActMut::F32(&mut out),
        )
        .unwrap();
        assert_eq!(out, [0.0; 4]);
        // No rows.
        let shape = ExpertsShape {
            rows: 0,
            hidden: 4,
            inter: 0,
            k: 2,
        };
        experts(
            simd,
            None,
            shape,
            Act::F32(&[]),
            &[e],
            &[],
            Act::F32(&[]),
            Activation::Silu,
            ActMut::F32(&mut []),
        )
        .unwrap();
    }
}

#[test]
fn bad_buffers_are_refused_before_anything_is_written() {
    let c = case(2, 16, 8, 3, 2, 1);
    let o = opts(Kind::Int8, 1);
    let ex = c.experts(o);
    let s = c.shape;
    let mut out = vec![7.0f32; 32];
    let mut bad = |shape: ExpertsShape, ex: &[Expert<'_>], index: &[i64], w: Act<'_>| -> String {
        let e = experts(
            Simd::Scalar,
            None,
            shape,
            Act::F32(&c.x32),
            ex,
            index,
            w,
            Activation::Silu,
            ActMut::F32(&mut out),
        );
        e.unwrap_err().to_string()
    };
    let w = Act::F32(&c.w32);
    let e = bad(ExpertsShape { hidden: 15, ..s }, &ex, &c.index, w);
    assert!(e.starts_with("x: has 32 elements"), "{e}");
    let e = bad(s, &ex, &c.index[..3], w);
    assert!(e.starts_with("index: has 3 elements"), "{e}");
    let e = bad(s, &ex, &c.index, Act::F32(&c.w32[..3]));
    assert!(e.starts_with("weights: has 3 elements"), "{e}");
    for v in [3, -2, i64::MAX, i64::MIN] {
        let e = bad(s, &ex, &[0, 1, v, 2], w);
        assert!(e.starts_with(&format!("index: {v} at (1, 0) is outside [0, 3)")), "{e}");
    }
    let e = bad(ExpertsShape { inter: 7, ..s }, &ex, &c.index, w);
    assert!(e.starts_with("gate_up[0]: has 256 elements"), "{e}");
    let mut mixed = ex.clone();
    mixed[2].down = Weight::Bf16(&c.down[2].wb);
    let e = bad(s, &mixed, &c.index, w);
    assert!(e.starts_with("down[2]: is bfloat16, down[0] is int8"), "{e}");
    let mut short = ex.clone();
    short[1].gate_up = Weight::Int8 {
        q: &c.gate_up[1].q8,
        scale: Scale::F32(&c.gate_up[1].s32[..5]),
    };
    let e = bad(s, &short, &c.index, w);
    assert!(e.starts_with("gate_up_scale[1]: has 5 elements"), "{e}");
    let mut ob = vec![Bf16(0); 32];
    let e = experts(
        Simd::Scalar,
        None,
        s,
        Act::F32(&c.x32),
        &ex,
        &c.index,
        w,
        Activation::Silu,
        ActMut::Bf16(&mut ob),
    )
    .unwrap_err()
    .to_string();
    assert!(e.starts_with("out: dtype must be x's"), "{e}");
    assert!(out.iter().all(|&v| v == 7.0) && ob.iter().all(|v| v.0 == 0));
    assert!(Activation::parse("relu")
        .unwrap_err()
        .to_string()
        .starts_with("act: must be"));
}
