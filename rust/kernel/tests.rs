//! The kernel's tests: every path against the specification, threads, tails, every mode.

use super::{
    accumulate, adam_step, fp8, grad_sq_norm, grads_nonfinite, q8, Consts, GradRef, HostMut, Hyper, Kahan, OutMut,
    Segment, StateMut, CHUNK, QBLOCK,
};
use crate::elem::{Bf16, Elem, F16};
use crate::isa::Simd;

/// xorshift64*: deterministic test data without a dependency.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> f32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let x = self.0.wrapping_mul(0x2545_f491_4f6c_dd1d);
        ((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.next() * scale).collect()
    }
}

fn hyper(decoupled: bool, amsgrad: bool, maximize: bool, wd: f64) -> Hyper {
    Hyper {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: wd,
        decoupled,
        amsgrad,
        maximize,
        bias_correction: true,
        grad_scale: 1.0,
    }
}

#[derive(Clone, Debug, PartialEq)]
struct Bufs {
    p: Vec<f32>,
    g: Vec<f32>,
    m: Vec<f32>,
    v: Vec<f32>,
    x: Vec<f32>,
}

impl Bufs {
    fn new(n: usize, seed: u64) -> Bufs {
        let mut r = Rng(seed | 1);
        let m = r.vec(n, 0.01);
        let v: Vec<f32> = r.vec(n, 1e-4).iter().map(|x| x.abs()).collect();
        let x = v.iter().zip(r.vec(n, 1e-4)).map(|(v, d)| v + d.abs() * 0.5).collect();
        Bufs {
            p: r.vec(n, 1.0),
            g: r.vec(n, 0.1),
            m,
            v,
            x,
        }
    }
}

/// Runs `steps` updates on fp32 buffers with `simd` and `threads` threads.
fn run(b: &mut Bufs, h: &Hyper, simd: Simd, threads: usize, steps: u64) {
    let pool = crate::pool::get(threads).unwrap();
    for t in 1..=steps {
        let seg = Segment {
            consts: Consts::new(h, t),
            amsgrad: h.amsgrad,
            param: &mut b.p,
            grad: GradRef::F32(&b.g),
            exp_avg: StateMut::F32(&mut b.m),
            exp_avg_sq: StateMut::F32(&mut b.v),
            max_exp_avg_sq: Some(StateMut::F32(&mut b.x)),
            out: OutMut::None,
            kahan: None,
        };
        adam_step(simd, pool.as_deref(), vec![seg]).unwrap();
    }
}

fn close(a: &[f32], b: &[f32], rtol: f32, atol: f32, what: &str) {
    assert_eq!(a.len(), b.len());
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        let ok = (x.is_nan() && y.is_nan()) || x == y || (x - y).abs() <= atol + rtol * y.abs();
        assert!(ok, "{what}[{i}]: {x} vs {y}");
    }
}

#[test]
fn every_path_matches_the_reference_in_every_mode() {
    for simd in Simd::available() {
        for &(decoupled, amsgrad, maximize, wd) in &[
            (true, false, false, 0.01),
            (false, false, false, 0.0),
            (false, true, false, 0.1),
            (true, true, true, 0.1),
            (false, false, true, 0.05),
        ] {
            let h = hyper(decoupled, amsgrad, maximize, wd);
            for n in [0usize, 1, 7, 15, 16, 17, 33, 100, 1000] {
                let mut a = Bufs::new(n, 42 + n as u64);
                let mut b = a.clone();
                run(&mut a, &h, Simd::Scalar, 1, 5);
                run(&mut b, &h, simd, 1, 5);
                let what = format!("{simd:?} {h:?} n={n}");
                close(&b.p, &a.p, 1e-6, 1e-7, &format!("p {what}"));
                close(&b.m, &a.m, 1e-5, 1e-9, &format!("m {what}"));
                close(&b.v, &a.v, 1e-5, 1e-12, &format!("v {what}"));
                close(&b.x, &a.x, 1e-5, 1e-12, &format!("vmax {what}"));
            }
        }
    }
}

#[test]
fn bitwise_identical_for_any_thread_count() {
    let h = hyper(true, true, false, 0.01);
    let n = 3 * CHUNK + 77;
    let mut base = Bufs::new(n, 7);
    run(&mut base, &h, Simd::best(), 1, 3);
    for threads in [2, 3, 5] {
        let mut b = Bufs::new(n, 7);
        run(&mut b, &h, Simd::best(), threads, 3);
        assert!(b == base, "{threads} threads differ");
    }
}

#[test]
fn nan_and_inf_propagate_like_torch() {
    for simd in Simd::available() {
        let h = hyper(true, true, false, 0.01);
        let mut b = Bufs::new(40, 3);
        b.g[3] = f32::NAN;
        b.g[20] = f32::INFINITY;
        b.g[39] = f32::NEG_INFINITY;
        let mut r = b.clone();
        run(&mut b, &h, simd, 1, 1);
        run(&mut r, &h, Simd::Scalar, 1, 1);
        for i in [3, 20, 39] {
            assert!(b.p[i].is_nan(), "{simd:?} p[{i}] = {}", b.p[i]);
            assert_eq!(b.p[i].is_nan(), r.p[i].is_nan());
            assert_eq!(b.m[i].is_nan(), r.m[i].is_nan(), "{simd:?} m[{i}]");
            close(&b.v[i..=i], &r.v[i..=i], 0.0, 0.0, &format!("{simd:?} v[{i}]"));
            close(&b.m[i..=i], &r.m[i..=i], 0.0, 0.0, &format!("{simd:?} m[{i}]"));
        }
        // A NaN already in the amsgrad maximum stays (torch.maximum propagates NaN).
        let mut c = Bufs::new(20, 5);
        c.x[2] = f32::NAN;
        run(&mut c, &h, simd, 1, 2);
        assert!(c.x[2].is_nan() && c.p[2].is_nan());
        close(
            &c.p[3..],
            &Bufs::new(20, 5).p[3..],
            0.0,
            1e-2,
            "untouched neighbours stay finite",
        );
    }
}

/// Low-precision gradients, bf16 moments and the low-precision weight copy, on every path.
#[test]
fn low_precision_buffers_match_the_reference() {
    let n = 203;
    let h = hyper(true, true, false, 0.01);
    for simd in Simd::available() {
        let src = Bufs::new(n, 11);
        let gb: Vec<Bf16> = src.g.iter().map(|&x| Bf16::from_f32(x)).collect();
        let gh: Vec<F16> = src.g.iter().map(|&x| F16::from_f32(x)).collect();
        let grads = [GradRef::Bf16(&gb), GradRef::F16(&gh), GradRef::F32(&src.g)];
        for (gi, grad) in grads.iter().enumerate() {
            for bf16_state in [false, true] {
                for out_kind in 0..3 {
                    let mut results = Vec::new();
                    for s in [Simd::Scalar, simd] {
                        let mut p = src.p.clone();
                        let mut m32 = src.m.clone();
                        let mut v32 = src.v.clone();
                        let mut x32 = src.x.clone();
                        let mut m16: Vec<Bf16> = src.m.iter().map(|&x| Bf16::from_f32(x)).collect();
                        let mut v16: Vec<Bf16> = src.v.iter().map(|&x| Bf16::from_f32(x)).collect();
                        let mut x16: Vec<Bf16> = src.x.iter().map(|&x| Bf16::from_f32(x)).collect();
                        // The copy starts as the model's own weights, which differ from the
                        // master: the kernel must take them over.
                        let mut ob: Vec<Bf16> = src.p.iter().map(|&x| Bf16::from_f32(x * 0.5)).collect();
                        let mut oh: Vec<F16> = src.p.iter().map(|&x| F16::from_f32(x * 0.5)).collect();
                        for t in 1..=3 {
                            let g = match grad {
                                GradRef::F32(x) => GradRef::F32(x),
                                GradRef::Bf16(x) => GradRef::Bf16(x),
                                GradRef::F16(x) => GradRef::F16(x),
                                GradRef::InOut => GradRef::InOut,
                            };
                            let (m, v, x) = if bf16_state {
                                (
                                    StateMut::Bf16(&mut m16),
                                    StateMut::Bf16(&mut v16),
                                    StateMut::Bf16(&mut x16),
                                )
                            } else {
                                (
                                    StateMut::F32(&mut m32),
                                    StateMut::F32(&mut v32),
                                    StateMut::F32(&mut x32),
                                )
                            };
                            let out = match out_kind {
                                0 => OutMut::None,
                                1 => OutMut::Bf16(&mut ob),
                                _ => OutMut::F16(&mut oh),
                            };
                            let seg = Segment {
                                consts: Consts::new(&h, t),
                                amsgrad: true,
                                param: &mut p,
                                grad: g,
                                exp_avg: m,
                                exp_avg_sq: v,
                                max_exp_avg_sq: Some(x),
                                out,
                                kahan: None,
                            };
                            adam_step(s, None, vec![seg]).unwrap();
                        }
                        let m: Vec<f32> = if bf16_state {
                            m16.iter().map(|x| x.to_f32()).collect()
                        } else {
                            m32
                        };
                        let o: Vec<f32> = match out_kind {
                            0 => p.clone(),
                            1 => ob.iter().map(|x| x.to_f32()).collect(),
                            _ => oh.iter().map(|x| x.to_f32()).collect(),
                        };
                        results.push((p, m, o));
                    }
                    let what = format!("{simd:?} grad#{gi} bf16_state={bf16_state} out#{out_kind}");
                    let (r, f) = (&results[0], &results[1]);
                    close(&f.0, &r.0, 1e-5, 1e-6, &format!("master {what}"));
                    // Rounded values may differ by one unit of the low-precision format.
                    close(&f.1, &r.1, 1e-2, 1e-6, &format!("exp_avg {what}"));
                    close(&f.2, &r.2, 1e-2, 1e-6, &format!("copy {what}"));
                    if out_kind > 0 {
                        // The master was taken over from the copy (x * 0.5), then updated.
                        for i in 0..n {
                            assert!((f.0[i] - src.p[i] * 0.5).abs() < 0.01, "{what} master[{i}]");
                        }
                    }
                }
            }
        }
    }
}

/// The gradient read from the copy's buffer, which the copy then overwrites, gives the same
/// result as separate buffers, on every path.
#[test]
fn gradient_in_the_copy_buffer() {
    let h = hyper(true, true, false, 0.01);
    for simd in Simd::available() {
        for n in [5usize, 16, 100, 2 * CHUNK + 9] {
            let src = Bufs::new(n, 21);
            let g: Vec<Bf16> = src.g.iter().map(|&x| Bf16::from_f32(x)).collect();
            let run = |inout: bool| {
                let (mut p, mut m, mut v, mut x) = (src.p.clone(), src.m.clone(), src.v.clone(), src.x.clone());
                let mut o: Vec<Bf16> = if inout {
                    g.clone()
                } else {
                    p.iter().map(|&x| Bf16::from_f32(x)).collect()
                };
                let seg = Segment {
                    consts: Consts::new(&h, 2),
                    amsgrad: true,
                    param: &mut p,
                    grad: if inout { GradRef::InOut } else { GradRef::Bf16(&g) },
                    exp_avg: StateMut::F32(&mut m),
                    exp_avg_sq: StateMut::F32(&mut v),
                    max_exp_avg_sq: Some(StateMut::F32(&mut x)),
                    out: OutMut::Bf16(&mut o),
                    kahan: None,
                };
                adam_step(simd, crate::pool::get(2).unwrap().as_deref(), vec![seg]).unwrap();
                (p, m, o)
            };
            let (a, b) = (run(false), run(true));
            assert!(a.0 == b.0 && a.1 == b.1 && a.2 == b.2, "{simd:?} n={n}");
        }
    }
}

#[test]
fn bias_correction_off_and_grad_scale() {
    for simd in Simd::available() {
        let mut h = hyper(true, false, false, 0.0);
        h.bias_correction = false;
        h.grad_scale = 0.25;
        let mut a = Bufs::new(50, 9);
        let mut b = a.clone();
        run(&mut a, &h, Simd::Scalar, 1, 4);
        run(&mut b, &h, simd, 1, 4);
        close(&b.p, &a.p, 1e-6, 1e-7, "p");
        // grad_scale multiplies the gradient: same as feeding g * scale.
        let mut c = Bufs::new(50, 9);
        c.g.iter_mut().for_each(|g| *g *= 0.25);
        h.grad_scale = 1.0;
        run(&mut c, &h, Simd::Scalar, 1, 4);
        close(&c.p, &a.p, 1e-6, 1e-7, "scaled");
    }
}

#[test]
fn reductions_match_and_are_deterministic() {
    let mut r = Rng(99);
    let big = r.vec(2 * CHUNK + 5, 3.0);
    let small = r.vec(17, 1.0);
    let hb: Vec<Bf16> = small.iter().map(|&x| Bf16::from_f32(x)).collect();
    let exact: f64 = big.iter().chain(&small).map(|&x| (x as f64) * (x as f64)).sum::<f64>()
        + hb.iter().map(|x| (x.to_f32() as f64).powi(2)).sum::<f64>();
    let grads = [
        GradRef::F32(&big),
        GradRef::F32(&small),
        GradRef::Bf16(&hb),
        GradRef::F32(&[]),
    ];
    for simd in Simd::available() {
        let one = grad_sq_norm(simd, None, &grads).unwrap();
        assert!((one - exact).abs() <= 1e-12 * exact, "{simd:?}");
        for threads in [2, 3] {
            let pool = crate::pool::get(threads).unwrap();
            assert_eq!(grad_sq_norm(simd, pool.as_deref(), &grads).unwrap(), one);
            assert!(!grads_nonfinite(simd, pool.as_deref(), &grads).unwrap());
        }
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let mut b = big.clone();
            b[CHUNK + 3] = bad;
            assert!(grads_nonfinite(simd, None, &[GradRef::F32(&b)]).unwrap(), "{simd:?}");
            let hf = [F16::from_f32(1.0), F16::from_f32(bad)];
            assert!(grads_nonfinite(simd, None, &[GradRef::F16(&hf)]).unwrap());
        }
    }
}

#[test]
fn invalid_segments_are_refused_before_anything_runs() {
    let mut p = vec![1.0f32; 8];
    let before = p.clone();
    let (g, mut m, mut v) = (vec![1.0f32; 8], vec![0.0f32; 8], vec![0.0f32; 7]);
    let mut p2 = vec![1.0f32; 4];
    let (g2, mut m2, mut v2) = (vec![1.0f32; 4], vec![0.0f32; 4], vec![0.0f32; 4]);
    let h = hyper(true, false, false, 0.0);
    let good = Segment {
        consts: Consts::new(&h, 1),
        amsgrad: false,
        param: &mut p2,
        grad: GradRef::F32(&g2),
        exp_avg: StateMut::F32(&mut m2),
        exp_avg_sq: StateMut::F32(&mut v2),
        max_exp_avg_sq: None,
        out: OutMut::None,
        kahan: None,
    };
    let bad = Segment {
        consts: Consts::new(&h, 1),
        amsgrad: false,
        param: &mut p,
        grad: GradRef::F32(&g),
        exp_avg: StateMut::F32(&mut m),
        exp_avg_sq: StateMut::F32(&mut v),
        max_exp_avg_sq: None,
        out: OutMut::None,
        kahan: None,
    };
    let err = adam_step(Simd::best(), None, vec![good, bad]).unwrap_err();
    assert!(err.message().contains("exp_avg_sq has 7 elements"), "{err}");
    assert_eq!(p, before);
    assert_eq!(p2, vec![1.0f32; 4]);
    let mut h2 = h;
    h2.beta2 = 1.0;
    assert!(h2
        .validate()
        .unwrap_err()
        .message()
        .contains("beta parameter at index 1"));
    h2 = h;
    h2.lr = f64::NAN;
    assert!(h2.validate().unwrap_err().message().contains("learning rate"));
}

#[test]
fn accumulation_rounds_like_torch() {
    // bf16 += bf16 is computed in f32 and rounded once, as torch's `grad += new` on bf16.
    let a = [1.0f32, 1.0, 3.0e38, -2.5];
    let b = [1.0f32 / 256.0, 3.0 / 256.0, 3.0e38, 0.5];
    let mut d: Vec<Bf16> = a.iter().map(|&x| Bf16::from_f32(x)).collect();
    let s: Vec<Bf16> = b.iter().map(|&x| Bf16::from_f32(x)).collect();
    accumulate(None, HostMut::Bf16(&mut d), GradRef::Bf16(&s)).unwrap();
    let want: Vec<Bf16> = a
        .iter()
        .zip(&b)
        .map(|(x, y)| Bf16::from_f32(Bf16::from_f32(*x).to_f32() + Bf16::from_f32(*y).to_f32()))
        .collect();
    assert_eq!(d, want);
    assert!(d[2].to_f32().is_infinite());
    let n = 3 * CHUNK + 5;
    let mut d32 = vec![1.0f32; n];
    let s16: Vec<F16> = (0..n).map(|i| F16::from_f32((i % 7) as f32)).collect();
    accumulate(
        crate::pool::get(2).unwrap().as_deref(),
        HostMut::F32(&mut d32),
        GradRef::F16(&s16),
    )
    .unwrap();
    assert!(d32.iter().enumerate().all(|(i, x)| *x == 1.0 + (i % 7) as f32));
    assert!(accumulate(None, HostMut::F32(&mut d32[..3]), GradRef::F16(&s16[..4])).is_err());
}

/// Quantized moments: `n` elements' codes and absmax, a copy buffer's bits, per run.
#[derive(Clone, Debug, PartialEq)]
struct Q8Bufs {
    p: Vec<f32>,
    g: Vec<Bf16>,
    mc: Vec<u8>,
    ms: Vec<f32>,
    vc: Vec<u8>,
    vs: Vec<f32>,
    xc: Vec<u8>,
    xs: Vec<f32>,
    o: Vec<Bf16>,
    /// The fp8 codec instead of the dynamic maps.
    fp8: bool,
}

/// A quantized moment of either codec.
fn qstate<'a>(fp8: bool, codes: &'a mut [u8], absmax: &'a mut [f32]) -> StateMut<'a> {
    if fp8 {
        StateMut::Fp8 { codes, scale: absmax }
    } else {
        StateMut::Q8 { codes, absmax }
    }
}

impl Q8Bufs {
    fn new(n: usize, seed: u64) -> Q8Bufs {
        let mut r = Rng(seed | 1);
        let p = r.vec(n, 1.0);
        let b = n / QBLOCK;
        Q8Bufs {
            o: p.iter().map(|x| Bf16::from_f32(*x)).collect(),
            p,
            g: r.vec(n, 0.1).iter().map(|x| Bf16::from_f32(*x)).collect(),
            mc: vec![0; n],
            ms: vec![0.0; b],
            vc: vec![0; n],
            vs: vec![0.0; b],
            xc: vec![0; n],
            xs: vec![0.0; b],
            fp8: false,
        }
    }

    fn fp8(n: usize, seed: u64) -> Q8Bufs {
        Q8Bufs {
            fp8: true,
            ..Q8Bufs::new(n, seed)
        }
    }

    /// `steps` updates; `mode` 0: no copy, 1: a bf16 copy, 2: the gradient in the copy's
    /// buffer. Fresh gradients each step (from `seed`).
    fn run(&mut self, h: &Hyper, simd: Simd, threads: usize, steps: u64, mode: u8) {
        let pool = crate::pool::get(threads).unwrap();
        let mut r = Rng(77);
        for t in 1..=steps {
            let fresh: Vec<Bf16> = r.vec(self.p.len(), 0.1).iter().map(|x| Bf16::from_f32(*x)).collect();
            if mode == 2 {
                self.o.copy_from_slice(&fresh);
            } else {
                self.g.copy_from_slice(&fresh);
            }
            let seg = Segment {
                consts: Consts::new(h, t),
                amsgrad: h.amsgrad,
                param: &mut self.p,
                grad: if mode == 2 {
                    GradRef::InOut
                } else {
                    GradRef::Bf16(&self.g)
                },
                exp_avg: qstate(self.fp8, &mut self.mc, &mut self.ms),
                exp_avg_sq: qstate(self.fp8, &mut self.vc, &mut self.vs),
                max_exp_avg_sq: Some(qstate(self.fp8, &mut self.xc, &mut self.xs)),
                out: if mode == 0 {
                    OutMut::None
                } else {
                    OutMut::Bf16(&mut self.o)
                },
                kahan: None,
            };
            adam_step(simd, pool.as_deref(), vec![seg]).unwrap();
        }
    }
}

#[test]
fn quantized_moments_every_path_is_the_specification_bitwise() {
    // Several chunks (CHUNK = 128 blocks), threads, modes, both codecs.
    let n = 2 * CHUNK + 4096;
    for fp8 in [false, true] {
        let make = |seed| {
            if fp8 {
                Q8Bufs::fp8(n, seed)
            } else {
                Q8Bufs::new(n, seed)
            }
        };
        for &(decoupled, amsgrad, wd) in &[(true, false, 0.01), (false, true, 0.01), (true, true, 0.0)] {
            for mode in 0..3u8 {
                let h = hyper(decoupled, amsgrad, false, wd);
                let mut want = make(5);
                want.run(&h, Simd::Scalar, 1, 6, mode);
                for simd in Simd::available() {
                    for threads in [1, 3] {
                        let mut got = make(5);
                        got.run(&h, simd, threads, 6, mode);
                        assert!(
                            got == want,
                            "{} threads {threads} mode {mode} {decoupled} {amsgrad} fp8 {fp8}",
                            simd.name()
                        );
                    }
                }
                assert!(want.mc.iter().any(|&c| c != want.mc[0]), "codes move");
            }
        }
    }
}

#[test]
fn fp8_moments_track_the_float32_update_and_a_nan_block_stays_in_its_block() {
    let n = 8192;
    let h = hyper(true, false, false, 0.01);
    let mut q = Q8Bufs::fp8(n, 9);
    q.run(&h, Simd::best(), 1, 20, 0);
    let mut d = Q8Bufs::new(n, 9);
    d.run(&h, Simd::best(), 1, 20, 0);
    let mut f = Bufs::new(n, 9);
    f.p = Q8Bufs::new(n, 9).p;
    f.m.fill(0.0);
    f.v.fill(0.0);
    let mut r = Rng(77);
    for t in 1..=20 {
        let g: Vec<f32> = r.vec(n, 0.1).iter().map(|x| Bf16::from_f32(*x).to_f32()).collect();
        let seg = Segment {
            consts: Consts::new(&h, t),
            amsgrad: false,
            param: &mut f.p,
            grad: GradRef::F32(&g),
            exp_avg: StateMut::F32(&mut f.m),
            exp_avg_sq: StateMut::F32(&mut f.v),
            max_exp_avg_sq: None,
            out: OutMut::None,
            kahan: None,
        };
        adam_step(Simd::best(), None, vec![seg]).unwrap();
    }
    let start = Q8Bufs::new(n, 9).p;
    let moved: f32 = f.p.iter().zip(&start).map(|(a, b)| (a - b).abs()).sum::<f32>() / n as f32;
    let err: f32 = f.p.iter().zip(&q.p).map(|(a, b)| (a - b).abs()).sum::<f32>() / n as f32;
    assert!(moved > 1e-3, "{moved}");
    assert!(err < 0.05 * moved, "{err} vs {moved}");
    let mut m = vec![0.0; n];
    q8::dequantize(&fp8::FP8, &q.mc, &q.ms, &mut m);
    let rel: f32 =
        m.iter().zip(&f.m).map(|(a, b)| (a - b).abs()).sum::<f32>() / f.m.iter().map(|x| x.abs()).sum::<f32>();
    assert!(rel < 0.1, "{rel}");
    // A NaN gradient: its block's moments become NaN (scale and codes), the others do not.
    for simd in Simd::available() {
        let mut q = Q8Bufs::fp8(n, 9);
        q.run(&h, simd, 1, 2, 0);
        let pool = crate::pool::get(1).unwrap();
        let mut g: Vec<Bf16> = vec![Bf16::from_f32(0.01); n];
        g[300] = Bf16::from_f32(f32::NAN);
        let seg = Segment {
            consts: Consts::new(&h, 3),
            amsgrad: false,
            param: &mut q.p,
            grad: GradRef::Bf16(&g),
            exp_avg: qstate(true, &mut q.mc, &mut q.ms),
            exp_avg_sq: qstate(true, &mut q.vc, &mut q.vs),
            max_exp_avg_sq: None,
            out: OutMut::None,
            kahan: None,
        };
        adam_step(simd, pool.as_deref(), vec![seg]).unwrap();
        assert!(q.ms[1].is_nan() && q.vs[1].is_nan());
        assert!(q.mc[256..512].iter().all(|&c| c & 0x7f == 0x7f));
        assert!(q.ms.iter().enumerate().all(|(i, s)| i == 1 || s.is_finite()));
        // The update uses the unquantized moments: only the NaN's own weight, this step.
        assert!(q.p[300].is_nan() && q.p.iter().enumerate().all(|(i, x)| i == 300 || x.is_finite()));
    }
}

#[test]
fn quantized_moments_track_the_float32_update() {
    // After 20 steps, the weights are within the quantization's reach of fp32 moments.
    let n = 8192;
    let h = hyper(true, false, false, 0.01);
    let mut q = Q8Bufs::new(n, 9);
    q.run(&h, Simd::best(), 1, 20, 0);
    let mut f = Bufs::new(n, 9);
    f.p = Q8Bufs::new(n, 9).p;
    f.m.fill(0.0);
    f.v.fill(0.0);
    let mut r = Rng(77);
    let pool = crate::pool::get(1).unwrap();
    for t in 1..=20 {
        let g: Vec<f32> = r.vec(n, 0.1).iter().map(|x| Bf16::from_f32(*x).to_f32()).collect();
        let seg = Segment {
            consts: Consts::new(&h, t),
            amsgrad: false,
            param: &mut f.p,
            grad: GradRef::F32(&g),
            exp_avg: StateMut::F32(&mut f.m),
            exp_avg_sq: StateMut::F32(&mut f.v),
            max_exp_avg_sq: None,
            out: OutMut::None,
            kahan: None,
        };
        adam_step(Simd::best(), pool.as_deref(), vec![seg]).unwrap();
    }
    let start = Q8Bufs::new(n, 9).p;
    let moved: f32 = f.p.iter().zip(&start).map(|(a, b)| (a - b).abs()).sum::<f32>() / n as f32;
    let err: f32 = f.p.iter().zip(&q.p).map(|(a, b)| (a - b).abs()).sum::<f32>() / n as f32;
    assert!(moved > 1e-3, "{moved}");
    assert!(err < 0.05 * moved, "{err} vs {moved}");
    let mut m = vec![0.0; n];
    q8::dequantize(q8::signed(), &q.mc, &q.ms, &mut m);
    let rel: f32 =
        m.iter().zip(&f.m).map(|(a, b)| (a - b).abs()).sum::<f32>() / f.m.iter().map(|x| x.abs()).sum::<f32>();
    assert!(rel < 0.05, "{rel}");
}

#[test]
fn quantized_segments_need_whole_blocks() {
    let h = hyper(true, false, false, 0.0);
    let n = 4096 + 16;
    let (mut p, g, mut c, mut c2) = (vec![0.0; n], vec![0.0f32; n], vec![0u8; n], vec![0u8; n]);
    let (mut s, mut s2) = (vec![0.0; n / 256], vec![0.0; n / 256]);
    let seg = Segment {
        consts: Consts::new(&h, 1),
        amsgrad: false,
        param: &mut p,
        grad: GradRef::F32(&g),
        exp_avg: StateMut::Q8 {
            codes: &mut c,
            absmax: &mut s,
        },
        exp_avg_sq: StateMut::Q8 {
            codes: &mut c2,
            absmax: &mut s2,
        },
        max_exp_avg_sq: None,
        out: OutMut::None,
        kahan: None,
    };
    let e = adam_step(Simd::Scalar, None, vec![seg]).unwrap_err();
    assert!(e.message().contains("whole blocks"), "{e}");
}

/// bf16 weights with Kahan compensation, float or quantized moments: `steps` updates.
fn run_kahan(
    n: usize,
    q8: u8, // 0: float moments, 1: the dynamic maps, 2: fp8
    amsgrad: bool,
    simd: Simd,
    threads: usize,
    steps: u64,
    lr: f64,
) -> (Vec<Bf16>, Vec<Bf16>) {
    let h = Hyper {
        lr,
        ..hyper(true, amsgrad, false, 0.01)
    };
    let mut r = Rng(31);
    let mut w: Vec<Bf16> = r.vec(n, 1.0).iter().map(|x| Bf16::from_f32(*x)).collect();
    let mut comp = vec![Bf16::default(); n];
    let (mut m, mut v, mut x) = (vec![0.0f32; n], vec![0.0f32; n], vec![0.0f32; n]);
    let b = n / QBLOCK;
    let (mut mc, mut vc, mut xc) = (vec![0u8; n], vec![0u8; n], vec![0u8; n]);
    let (mut ms, mut vs, mut xs) = (vec![0.0f32; b], vec![0.0f32; b], vec![0.0f32; b]);
    let pool = crate::pool::get(threads).unwrap();
    for t in 1..=steps {
        let g: Vec<f32> = r.vec(n, 0.1);
        let (em, ev, ex) = if q8 > 0 {
            let fp8 = q8 == 2;
            (
                qstate(fp8, &mut mc, &mut ms),
                qstate(fp8, &mut vc, &mut vs),
                qstate(fp8, &mut xc, &mut xs),
            )
        } else {
            (StateMut::F32(&mut m), StateMut::F32(&mut v), StateMut::F32(&mut x))
        };
        let seg = Segment {
            consts: Consts::new(&h, t),
            amsgrad,
            param: &mut [],
            grad: GradRef::F32(&g),
            exp_avg: em,
            exp_avg_sq: ev,
            max_exp_avg_sq: Some(ex),
            out: OutMut::None,
            kahan: Some(Kahan {
                w: &mut w,
                comp: &mut comp,
            }),
        };
        adam_step(simd, pool.as_deref(), vec![seg]).unwrap();
    }
    (w, comp)
}

#[test]
fn kahan_weights_are_the_same_on_every_path_and_thread_count() {
    for q8 in [0, 1, 2] {
        for amsgrad in [false, true] {
            let n = if q8 > 0 { CHUNK + 4096 } else { CHUNK + 4096 + 7 }; // a tail of 7 without blocks
            let want = run_kahan(n, q8, amsgrad, Simd::Scalar, 1, 5, 1e-3);
            for simd in Simd::available() {
                for threads in [1, 3] {
                    let got = run_kahan(n, q8, amsgrad, simd, threads, 5, 1e-3);
                    assert!(
                        got == want,
                        "{} threads {threads} q8 {q8} amsgrad {amsgrad}",
                        simd.name()
                    );
                }
            }
            assert!(
                want.1.iter().any(|c| c.to_f32() != 0.0),
                "the compensation holds something"
            );
        }
    }
}

#[test]
fn kahan_weights_keep_updates_that_bf16_rounding_loses() {
    // Updates far below half a bf16 ulp: plain rounding keeps none; Kahan accumulates them,
    // the weight plus its compensation following the fp32 master.
    let n = 4096;
    let (lr, steps) = (1e-5, 200);
    let (w, comp) = run_kahan(n, 0, false, Simd::best(), 1, steps, lr);
    let mut f = Bufs::new(n, 0);
    let mut r = Rng(31);
    f.p = r.vec(n, 1.0).iter().map(|x| Bf16::from_f32(*x).to_f32()).collect();
    f.m.fill(0.0);
    f.v.fill(0.0);
    let h = Hyper {
        lr,
        ..hyper(true, false, false, 0.01)
    };
    for t in 1..=steps {
        let g = r.vec(n, 0.1);
        let seg = Segment {
            consts: Consts::new(&h, t),
            amsgrad: false,
            param: &mut f.p,
            grad: GradRef::F32(&g),
            exp_avg: StateMut::F32(&mut f.m),
            exp_avg_sq: StateMut::F32(&mut f.v),
            max_exp_avg_sq: None,
            out: OutMut::None,
            kahan: None,
        };
        adam_step(Simd::best(), None, vec![seg]).unwrap();
    }
    let mut r0 = Rng(31);
    let start: Vec<f32> = r0.vec(n, 1.0).iter().map(|x| Bf16::from_f32(*x).to_f32()).collect();
    let (mut kahan_err, mut moved, mut w_moved) = (0.0f64, 0.0f64, 0usize);
    for i in 0..n {
        let sum = w[i].to_f32() as f64 + comp[i].to_f32() as f64;
        kahan_err += (sum - f.p[i] as f64).abs();
        moved += (f.p[i] - start[i]).abs() as f64;
        w_moved += (w[i].to_f32() != start[i]) as usize;
    }
    assert!(kahan_err < 0.05 * moved, "{kahan_err} vs {moved}");
    // Plain bf16 rounding of each update would move none of them.
    assert!(w_moved > n / 100, "the bf16 weights moved: {w_moved} of {n}");
}
