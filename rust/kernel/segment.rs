//! What the kernel updates: a param group's hyper-parameters, the per-step scalars, and one
//! tensor's slices (`Segment`: weights, gradient, moments in their codec, the copy or the Kahan
//! weights), validated before anything runs.

use crate::elem::{Bf16, F16};
use crate::error::{Error, Result};

/// Elements per quantization block of a block-quantized moment (torchao's `block_size` for
/// 8 bits): one absmax (the fp8 codec: one scale) per block, chunks cut on whole blocks.
pub const QBLOCK: usize = 256;

/// Hyper-parameters of one update, as torch's param group holds them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Hyper {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    /// AdamW (decoupled weight decay) if true, Adam with L2 penalty if false.
    pub decoupled: bool,
    pub amsgrad: bool,
    pub maximize: bool,
    pub bias_correction: bool,
    /// Multiplies every gradient before use: AMP's 1/scale times the clipping coefficient.
    pub grad_scale: f64,
}

impl Hyper {
    /// Checks torch's constraints; the message names the offending hyper-parameter.
    pub fn validate(&self) -> Result<()> {
        let Hyper {
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
            grad_scale,
            ..
        } = *self;
        if !(lr >= 0.0) || lr.is_infinite() {
            return Err(Error::Value(format!("Invalid learning rate: {lr}")));
        }
        if !(eps >= 0.0) {
            return Err(Error::Value(format!("Invalid epsilon value: {eps}")));
        }
        if !(0.0..1.0).contains(&beta1) {
            return Err(Error::Value(format!("Invalid beta parameter at index 0: {beta1}")));
        }
        if !(0.0..1.0).contains(&beta2) {
            return Err(Error::Value(format!("Invalid beta parameter at index 1: {beta2}")));
        }
        if !(weight_decay >= 0.0) {
            return Err(Error::Value(format!("Invalid weight_decay value: {weight_decay}")));
        }
        if grad_scale.is_nan() {
            return Err(Error::Value(format!("Invalid grad_scale: {grad_scale}")));
        }
        Ok(())
    }
}

/// The per-update scalars, computed once in f64 (as torch computes them in Python doubles) and
/// rounded to f32 (as torch's tensor ops round a Python scalar).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Consts {
    pub gscale: f32,
    pub use_l2: bool,
    pub l2: f32,
    pub decay: f32,
    pub b1c: f32,
    pub b2: f32,
    pub b2c: f32,
    pub eps: f32,
    pub step_size: f32,
    pub neg_step_size: f32,
    pub bc2_sqrt: f32,
    pub inv_bc2_sqrt: f32,
}

impl Consts {
    /// Scalars for the update that makes the parameter's step count `step` (>= 1).
    pub fn new(h: &Hyper, step: u64) -> Consts {
        let t = step as f64;
        let (bc1, bc2) = if h.bias_correction {
            (1.0 - h.beta1.powf(t), 1.0 - h.beta2.powf(t))
        } else {
            (1.0, 1.0)
        };
        let step_size = h.lr / bc1;
        let bc2_sqrt = bc2.sqrt();
        let gscale = if h.maximize { -h.grad_scale } else { h.grad_scale };
        let use_l2 = !h.decoupled && h.weight_decay != 0.0;
        Consts {
            gscale: gscale as f32,
            use_l2,
            l2: if use_l2 { h.weight_decay as f32 } else { 0.0 },
            decay: if h.decoupled {
                (1.0 - h.lr * h.weight_decay) as f32
            } else {
                1.0
            },
            b1c: (1.0 - h.beta1) as f32,
            b2: h.beta2 as f32,
            b2c: (1.0 - h.beta2) as f32,
            eps: h.eps as f32,
            step_size: step_size as f32,
            neg_step_size: (-step_size) as f32,
            bc2_sqrt: bc2_sqrt as f32,
            inv_bc2_sqrt: (1.0 / bc2_sqrt) as f32,
        }
    }
}

/// `torch.maximum`: NaN if either side is NaN.
#[inline(always)]
pub(super) fn nan_max(a: f32, b: f32) -> f32 {
    if a.is_nan() || a > b {
        a
    } else {
        b
    }
}

/// Gradient slice, in any of the supported dtypes.
pub enum GradRef<'a> {
    F32(&'a [f32]),
    Bf16(&'a [Bf16]),
    F16(&'a [F16]),
    /// The gradient is in the low-precision copy's buffer (`Segment::out`), which the copy then
    /// overwrites: one host buffer per parameter serves as gradient landing slot and as source
    /// of the weights sent back to the GPU. Nothing is read back from it as a previous copy.
    InOut,
}

/// Moment slice (exp_avg, exp_avg_sq, max_exp_avg_sq).
pub enum StateMut<'a> {
    F32(&'a mut [f32]),
    Bf16(&'a mut [Bf16]),
    /// Block-quantized ([`super::q8`]): one code per element, one absmax per [`QBLOCK`] elements.
    Q8 {
        codes: &'a mut [u8],
        absmax: &'a mut [f32],
    },
    /// Block-quantized to float8_e4m3fn ([`super::fp8`]): one code per element, one scale per
    /// [`QBLOCK`] elements.
    Fp8 {
        codes: &'a mut [u8],
        scale: &'a mut [f32],
    },
}

/// A quantized moment's codes and absmax (the fp8 codec: its scale), split out of
/// [`StateMut::Q8`] or [`StateMut::Fp8`].
pub struct Q8Mut<'a> {
    pub codes: &'a mut [u8],
    pub absmax: &'a mut [f32],
}

/// bfloat16 weights without a float32 master (`master_dtype=torch.bfloat16`): each step's update
/// is computed in float32 and added with Kahan compensation, `comp` holding what the weight's
/// rounding lost (torch-optimi's `kahan_sum`).
pub struct Kahan<'a> {
    pub w: &'a mut [Bf16],
    pub comp: &'a mut [Bf16],
}

/// Low-precision copy of the updated weights, written in the same pass.
pub enum OutMut<'a> {
    None,
    Bf16(&'a mut [Bf16]),
    F16(&'a mut [F16]),
}

impl GradRef<'_> {
    pub fn len(&self) -> usize {
        match self {
            GradRef::F32(s) => s.len(),
            GradRef::Bf16(s) => s.len(),
            GradRef::F16(s) => s.len(),
            GradRef::InOut => 0,
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub(super) fn split_at(self, mid: usize) -> (Self, Self) {
        match self {
            GradRef::F32(s) => (GradRef::F32(&s[..mid]), GradRef::F32(&s[mid..])),
            GradRef::Bf16(s) => (GradRef::Bf16(&s[..mid]), GradRef::Bf16(&s[mid..])),
            GradRef::F16(s) => (GradRef::F16(&s[..mid]), GradRef::F16(&s[mid..])),
            GradRef::InOut => (GradRef::InOut, GradRef::InOut),
        }
    }
}

impl<'a> StateMut<'a> {
    pub fn len(&self) -> usize {
        match self {
            StateMut::F32(s) => s.len(),
            StateMut::Bf16(s) => s.len(),
            StateMut::Q8 { codes, .. } | StateMut::Fp8 { codes, .. } => codes.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Which storage: 0 float32, 1 bfloat16, 2 quantized (dynamic map), 3 fp8.
    pub(super) fn codec(&self) -> u8 {
        match self {
            StateMut::F32(_) => 0,
            StateMut::Bf16(_) => 1,
            StateMut::Q8 { .. } => 2,
            StateMut::Fp8 { .. } => 3,
        }
    }
    /// A quantized moment's length and absmax agree (whole blocks).
    pub(super) fn check_q8(&self, what: &str) -> Result<()> {
        if let StateMut::Q8 { codes, absmax } | StateMut::Fp8 { codes, scale: absmax } = self {
            if !codes.len().is_multiple_of(QBLOCK) || absmax.len() != codes.len() / QBLOCK {
                return Err(Error::Value(format!(
                    "{what}: {} codes need {} absmax/scale values, got {} (whole blocks of {})",
                    codes.len(),
                    codes.len() / QBLOCK,
                    absmax.len(),
                    QBLOCK
                )));
            }
        }
        Ok(())
    }
    /// `mid` is a multiple of [`QBLOCK`] for a quantized moment (chunks are).
    pub(super) fn split_at(self, mid: usize) -> (Self, Self) {
        match self {
            StateMut::F32(s) => {
                let (a, b) = s.split_at_mut(mid);
                (StateMut::F32(a), StateMut::F32(b))
            }
            StateMut::Bf16(s) => {
                let (a, b) = s.split_at_mut(mid);
                (StateMut::Bf16(a), StateMut::Bf16(b))
            }
            StateMut::Q8 { codes, absmax } => {
                debug_assert_eq!(mid % QBLOCK, 0);
                let (c0, c1) = codes.split_at_mut(mid);
                let (a0, a1) = absmax.split_at_mut(mid / QBLOCK);
                (
                    StateMut::Q8 { codes: c0, absmax: a0 },
                    StateMut::Q8 { codes: c1, absmax: a1 },
                )
            }
            StateMut::Fp8 { codes, scale } => {
                debug_assert_eq!(mid % QBLOCK, 0);
                let (c0, c1) = codes.split_at_mut(mid);
                let (a0, a1) = scale.split_at_mut(mid / QBLOCK);
                (
                    StateMut::Fp8 { codes: c0, scale: a0 },
                    StateMut::Fp8 { codes: c1, scale: a1 },
                )
            }
        }
    }
}

impl OutMut<'_> {
    /// Length of the copy, if there is one.
    pub fn len_if_any(&self) -> Option<usize> {
        match self {
            OutMut::None => None,
            OutMut::Bf16(s) => Some(s.len()),
            OutMut::F16(s) => Some(s.len()),
        }
    }
    pub(super) fn split_at(self, mid: usize) -> (Self, Self) {
        match self {
            OutMut::None => (OutMut::None, OutMut::None),
            OutMut::Bf16(s) => {
                let (a, b) = s.split_at_mut(mid);
                (OutMut::Bf16(a), OutMut::Bf16(b))
            }
            OutMut::F16(s) => {
                let (a, b) = s.split_at_mut(mid);
                (OutMut::F16(a), OutMut::F16(b))
            }
        }
    }
}

/// One tensor's (or one chunk of it) update: the fp32 master weights, its gradient, its moments,
/// and where to write the low-precision copy, if any.
///
/// With a low-precision copy, the copy is also an input: where it no longer equals the master
/// weight rounded to its dtype, someone wrote the model's weights (a checkpoint load, a manual
/// edit) and the kernel takes that value as the new master before updating. On the first step
/// this initializes the master from the model's weights.
pub struct Segment<'a> {
    pub consts: Consts,
    pub amsgrad: bool,
    pub param: &'a mut [f32],
    pub grad: GradRef<'a>,
    pub exp_avg: StateMut<'a>,
    pub exp_avg_sq: StateMut<'a>,
    pub max_exp_avg_sq: Option<StateMut<'a>>,
    pub out: OutMut<'a>,
    /// The weights in bfloat16 with Kahan compensation, instead of `param` (then empty).
    pub kahan: Option<Kahan<'a>>,
}

impl<'a> Segment<'a> {
    pub fn len(&self) -> usize {
        self.kahan.as_ref().map_or(self.param.len(), |k| k.w.len())
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Lengths agree, moments share one dtype, amsgrad has its buffer.
    pub fn validate(&self) -> Result<()> {
        let n = self.len();
        if let Some(k) = &self.kahan {
            if !self.param.is_empty() || !matches!(self.out, OutMut::None) || matches!(self.grad, GradRef::InOut) {
                return Err(Error::Value(
                    "Kahan weights take the place of the master, the copy and a gradient in it".into(),
                ));
            }
            if k.comp.len() != n {
                return Err(Error::Value(format!(
                    "the Kahan compensation has {} elements, the weights {n}",
                    k.comp.len()
                )));
            }
        }
        let check = |what: &str, len: usize| {
            if len != n {
                Err(Error::Value(format!("{what} has {len} elements, the parameter {n}")))
            } else {
                Ok(())
            }
        };
        match (&self.grad, &self.out) {
            (GradRef::InOut, OutMut::None) => {
                return Err(Error::Value("a gradient in the copy's buffer needs that buffer".into()))
            }
            (GradRef::InOut, _) => {}
            _ => check("grad", self.grad.len())?,
        }
        check("exp_avg", self.exp_avg.len())?;
        check("exp_avg_sq", self.exp_avg_sq.len())?;
        if self.exp_avg.codec() != self.exp_avg_sq.codec() {
            return Err(Error::Value("exp_avg and exp_avg_sq must have the same dtype".into()));
        }
        self.exp_avg.check_q8("exp_avg")?;
        self.exp_avg_sq.check_q8("exp_avg_sq")?;
        match (&self.max_exp_avg_sq, self.amsgrad) {
            (Some(v), _) => {
                check("max_exp_avg_sq", v.len())?;
                if v.codec() != self.exp_avg.codec() {
                    return Err(Error::Value("max_exp_avg_sq must have the dtype of exp_avg".into()));
                }
                v.check_q8("max_exp_avg_sq")?;
            }
            (None, true) => return Err(Error::Value("amsgrad needs max_exp_avg_sq".into())),
            (None, false) => {}
        }
        if let Some(len) = self.out.len_if_any() {
            check("the low-precision weight copy", len)?;
        }
        Ok(())
    }

    pub(super) fn split_at(self, mid: usize) -> (Segment<'a>, Segment<'a>) {
        let (p0, p1) = self.param.split_at_mut(if self.kahan.is_some() { 0 } else { mid });
        let (g0, g1) = self.grad.split_at(mid);
        let (m0, m1) = self.exp_avg.split_at(mid);
        let (v0, v1) = self.exp_avg_sq.split_at(mid);
        let (x0, x1) = match self.max_exp_avg_sq {
            Some(x) => {
                let (a, b) = x.split_at(mid);
                (Some(a), Some(b))
            }
            None => (None, None),
        };
        let (o0, o1) = self.out.split_at(mid);
        let (k0, k1) = match self.kahan {
            Some(Kahan { w, comp }) => {
                let (w0, w1) = w.split_at_mut(mid);
                let (c0, c1) = comp.split_at_mut(mid);
                (Some(Kahan { w: w0, comp: c0 }), Some(Kahan { w: w1, comp: c1 }))
            }
            None => (None, None),
        };
        let mk = |param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, out, kahan| Segment {
            consts: self.consts,
            amsgrad: self.amsgrad,
            param,
            grad,
            exp_avg,
            exp_avg_sq,
            max_exp_avg_sq,
            out,
            kahan,
        };
        (mk(p0, g0, m0, v0, x0, o0, k0), mk(p1, g1, m1, v1, x1, o1, k1))
    }

    /// Cuts the segment into pieces of at most `max` elements (`max` a multiple of LANES).
    pub(super) fn chunks(self, max: usize, into: &mut Vec<Segment<'a>>) {
        let mut rest = self;
        while rest.len() > max {
            let (a, b) = rest.split_at(max);
            into.push(a);
            rest = b;
        }
        if !rest.is_empty() {
            into.push(rest);
        }
    }
}
