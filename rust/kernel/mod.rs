//! The fused Adam/AdamW update over flat slices, and the read-only gradient passes.
//!
//! [`reference`] is the specification: one element at a time, torch's order of operations
//! (`torch.optim.adam._single_tensor_adam`). The fast paths process blocks of [`LANES`] lanes with
//! FMA and multiply by `1/sqrt(bc2)` instead of dividing; the tests bound their distance to the
//! reference. A partial block at the end of a slice is copied into a padded block and goes through
//! the very same code, so every element's result depends only on its own inputs: results are
//! bitwise identical however the work is split between threads.

use rayon::prelude::*;

mod maps;
pub mod q8;

use crate::elem::{Bf16, Elem, F16};
use crate::error::{Error, Result};
#[cfg(target_arch = "x86_64")]
use crate::isa::{Avx2, Avx512, Avx512Bf16};
use crate::isa::{Block, Generic, Isa, Simd, LANES};

/// Elements per unit of parallel work: a multiple of [`LANES`], fixed, so that chunk boundaries
/// (and the order in which reductions add partial sums) never depend on the number of threads.
pub const CHUNK: usize = 1 << 15;

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
fn nan_max(a: f32, b: f32) -> f32 {
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
    /// Block-quantized ([`q8`]): one code per element, one absmax per [`q8::QBLOCK`] elements.
    Q8 {
        codes: &'a mut [u8],
        absmax: &'a mut [f32],
    },
}

/// A quantized moment's codes and absmax, split out of [`StateMut::Q8`].
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
    fn split_at(self, mid: usize) -> (Self, Self) {
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
            StateMut::Q8 { codes, .. } => codes.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Which storage: 0 float32, 1 bfloat16, 2 quantized.
    fn codec(&self) -> u8 {
        match self {
            StateMut::F32(_) => 0,
            StateMut::Bf16(_) => 1,
            StateMut::Q8 { .. } => 2,
        }
    }
    /// A quantized moment's length and absmax agree (whole blocks).
    fn check_q8(&self, what: &str) -> Result<()> {
        if let StateMut::Q8 { codes, absmax } = self {
            if !codes.len().is_multiple_of(q8::QBLOCK) || absmax.len() != codes.len() / q8::QBLOCK {
                return Err(Error::Value(format!(
                    "{what}: {} codes need {} absmax values, got {} (whole blocks of {})",
                    codes.len(),
                    codes.len() / q8::QBLOCK,
                    absmax.len(),
                    q8::QBLOCK
                )));
            }
        }
        Ok(())
    }
    /// `mid` is a multiple of [`q8::QBLOCK`] for a quantized moment (chunks are).
    fn split_at(self, mid: usize) -> (Self, Self) {
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
                debug_assert_eq!(mid % q8::QBLOCK, 0);
                let (c0, c1) = codes.split_at_mut(mid);
                let (a0, a1) = absmax.split_at_mut(mid / q8::QBLOCK);
                (
                    StateMut::Q8 { codes: c0, absmax: a0 },
                    StateMut::Q8 { codes: c1, absmax: a1 },
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
    fn split_at(self, mid: usize) -> (Self, Self) {
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

    fn split_at(self, mid: usize) -> (Segment<'a>, Segment<'a>) {
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
    fn chunks(self, max: usize, into: &mut Vec<Segment<'a>>) {
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

/// The specification: one element at a time, in torch's order of operations, no FMA.
pub mod reference {
    use super::*;

    #[allow(clippy::too_many_arguments)]
    pub fn update<G: Elem, S: Elem, O: Elem>(
        c: &Consts,
        p: &mut [f32],
        g: &[G],
        m: &mut [S],
        v: &mut [S],
        mut vmax: Option<&mut [S]>,
        mut out: Option<&mut [O]>,
    ) {
        for i in 0..p.len() {
            if let Some(o) = out.as_deref() {
                if O::from_f32(p[i]) != o[i] {
                    p[i] = o[i].to_f32();
                }
            }
            let mut grad = g[i].to_f32() * c.gscale;
            if c.use_l2 {
                grad += c.l2 * p[i];
            }
            let param = p[i] * c.decay;
            let mut ea = m[i].to_f32();
            ea = ea + c.b1c * (grad - ea);
            let mut eas = v[i].to_f32();
            eas = eas * c.b2 + c.b2c * grad * grad;
            m[i] = S::from_f32(ea);
            v[i] = S::from_f32(eas);
            let mut vhat = eas;
            if let Some(vm) = vmax.as_deref_mut() {
                vhat = nan_max(vm[i].to_f32(), eas);
                vm[i] = S::from_f32(vhat);
            }
            let denom = vhat.sqrt() / c.bc2_sqrt + c.eps;
            p[i] = param + (-c.step_size) * (ea / denom);
            if let Some(o) = out.as_deref_mut() {
                o[i] = O::from_f32(p[i]);
            }
        }
    }
}

/// Block loads and stores through a path's conversion instructions.
pub trait BlockIo: Elem {
    /// # Safety
    /// The CPU supports `I`.
    unsafe fn load<I: Isa>(src: &[Self; LANES]) -> Block;
    /// # Safety
    /// The CPU supports `I`.
    unsafe fn store<I: Isa>(x: &Block) -> [Self; LANES];
}

impl BlockIo for f32 {
    #[inline(always)]
    unsafe fn load<I: Isa>(src: &[f32; LANES]) -> Block {
        *src
    }
    #[inline(always)]
    unsafe fn store<I: Isa>(x: &Block) -> [f32; LANES] {
        *x
    }
}

impl BlockIo for Bf16 {
    #[inline(always)]
    unsafe fn load<I: Isa>(src: &[Bf16; LANES]) -> Block {
        unsafe { I::bf16_load(&src.map(|b| b.0)) }
    }
    #[inline(always)]
    unsafe fn store<I: Isa>(x: &Block) -> [Bf16; LANES] {
        unsafe { I::bf16_store(x) }.map(Bf16)
    }
}

impl BlockIo for F16 {
    #[inline(always)]
    unsafe fn load<I: Isa>(src: &[F16; LANES]) -> Block {
        unsafe { I::f16_load(&src.map(|b| b.0)) }
    }
    #[inline(always)]
    unsafe fn store<I: Isa>(x: &Block) -> [F16; LANES] {
        unsafe { I::f16_store(x) }.map(F16)
    }
}

/// Takes the model's value as master weight where the low-precision copy was written by someone
/// else (see [`Segment`]).
///
/// # Safety
/// The CPU supports `I`.
#[inline(always)]
unsafe fn resync<I: Isa, O: BlockIo>(p: &mut Block, o: &[O; LANES]) {
    let (rounded, old) = unsafe { (O::store::<I>(p), O::load::<I>(o)) };
    for i in 0..LANES {
        if rounded[i] != o[i] {
            p[i] = old[i];
        }
    }
}

/// One lane block of the float update, in the fast paths' form (see the module documentation);
/// with `DELTA`, `p` gets the update instead of the new weight.
///
/// # Safety
/// The CPU supports `I`.
#[inline(always)]
unsafe fn update_block<I: Isa, G: BlockIo, S: BlockIo, const AMS: bool, const DELTA: bool>(
    c: &Consts,
    p: &mut Block,
    g: &[G; LANES],
    m: &mut [S; LANES],
    v: &mut [S; LANES],
    vmax: Option<&mut [S; LANES]>,
) {
    let (gr, mut ea, mut eas) = unsafe { (G::load::<I>(g), S::load::<I>(m), S::load::<I>(v)) };
    let mut vm = [0.0f32; LANES];
    if AMS {
        if let Some(x) = vmax.as_deref() {
            vm = unsafe { S::load::<I>(x) };
        }
    }
    for i in 0..LANES {
        let g0 = gr[i] * c.gscale;
        let g_l2 = c.l2.mul_add(p[i], g0);
        let grad = if c.use_l2 { g_l2 } else { g0 };
        let param = p[i] * c.decay;
        let mi = c.b1c.mul_add(grad - ea[i], ea[i]);
        let vi = (c.b2c * grad).mul_add(grad, eas[i] * c.b2);
        let vhat = if AMS {
            vm[i] = nan_max(vm[i], vi);
            vm[i]
        } else {
            vi
        };
        let denom = vhat.sqrt().mul_add(c.inv_bc2_sqrt, c.eps);
        // DELTA: the update itself (decay included), for Kahan weights to add.
        p[i] = if DELTA {
            (param - p[i]) + c.neg_step_size * (mi / denom)
        } else {
            c.neg_step_size.mul_add(mi / denom, param)
        };
        ea[i] = mi;
        eas[i] = vi;
    }
    unsafe {
        *m = S::store::<I>(&ea);
        *v = S::store::<I>(&eas);
        if AMS {
            if let Some(x) = vmax {
                *x = S::store::<I>(&vm);
            }
        }
    }
}

/// Resyncs the master from (`STORE` false) or stores it into (`STORE` true) block `b` of the
/// low-precision copy, if there is one.
///
/// # Safety
/// The CPU supports `I`; `b` is a full block of `out` (not checked).
#[inline(always)]
unsafe fn out_block<I: Isa, const STORE: bool>(p: &mut Block, out: &mut OutMut<'_>, b: usize) {
    // `b` indexes a full block of `out`, whose length the caller checked.
    unsafe {
        match out {
            OutMut::None => {}
            OutMut::Bf16(o) => {
                let ob = o.as_chunks_mut::<LANES>().0.get_unchecked_mut(b);
                if STORE {
                    *ob = Bf16::store::<I>(p)
                } else {
                    resync::<I, Bf16>(p, ob)
                }
            }
            OutMut::F16(o) => {
                let ob = o.as_chunks_mut::<LANES>().0.get_unchecked_mut(b);
                if STORE {
                    *ob = F16::store::<I>(p)
                } else {
                    resync::<I, F16>(p, ob)
                }
            }
        }
    }
}

/// Copies `src` into a zero-padded block.
#[inline(always)]
fn pad<T: Copy + Default>(src: &[T]) -> [T; LANES] {
    let mut b = [T::default(); LANES];
    b[..src.len()].copy_from_slice(src);
    b
}

/// Software prefetch distance, in blocks (one 64-byte line of each fp32 stream per block). The
/// hardware prefetchers stop at 4 KiB page edges and track few streams. Asking 3 KiB ahead on
/// each stream took `python -m offload_adam bench` on one 100M tensor from 0.99x to 1.11-1.21x
/// torch fused on this project's 2-core VM.
const PREFETCH_BLOCKS: usize = 48;

/// The block loop over one chunk.
///
/// # Safety
/// The CPU supports `I`; all slices have `p.len()` elements (`vmax` too when `AMS`).
#[inline(always)]
unsafe fn body<I: Isa, G: BlockIo, S: BlockIo, const AMS: bool>(
    c: &Consts,
    p: &mut [f32],
    g: &[G],
    m: &mut [S],
    v: &mut [S],
    vmax: &mut [S],
    out: &mut OutMut<'_>,
    next: &Lookahead,
) {
    let n = p.len();
    let full = n / LANES;
    let (pb, pt) = p.as_chunks_mut::<LANES>();
    let (gb, gt) = g.as_chunks::<LANES>();
    let (mb, mt) = m.as_chunks_mut::<LANES>();
    let (vb, vt) = v.as_chunks_mut::<LANES>();
    let (xb, xt) = vmax.as_chunks_mut::<LANES>();
    // SAFETY: every `*b` slice has `full` blocks (same lengths, checked by the caller), so the
    // unchecked indexing stays in bounds; the CPU supports `I` (caller's contract).
    unsafe {
        for b in 0..full {
            let ahead = b + PREFETCH_BLOCKS;
            if ahead < full {
                I::prefetch(pb.as_ptr().wrapping_add(ahead) as *const u8);
                I::prefetch(gb.as_ptr().wrapping_add(ahead) as *const u8);
                I::prefetch(mb.as_ptr().wrapping_add(ahead) as *const u8);
                I::prefetch(vb.as_ptr().wrapping_add(ahead) as *const u8);
                if AMS {
                    I::prefetch(xb.as_ptr().wrapping_add(ahead) as *const u8);
                }
                match out {
                    OutMut::Bf16(o) => I::prefetch(o.as_ptr().wrapping_add(ahead * LANES) as *const u8),
                    OutMut::F16(o) => I::prefetch(o.as_ptr().wrapping_add(ahead * LANES) as *const u8),
                    OutMut::None => {}
                }
            } else {
                // Near the end: start on the next segment of this task.
                next.prefetch::<I>(ahead - full);
            }
            let pk = pb.get_unchecked_mut(b);
            out_block::<I, false>(pk, out, b);
            let x = if AMS { Some(xb.get_unchecked_mut(b)) } else { None };
            update_block::<I, G, S, AMS, false>(
                c,
                pk,
                gb.get_unchecked(b),
                mb.get_unchecked_mut(b),
                vb.get_unchecked_mut(b),
                x,
            );
            out_block::<I, true>(pk, out, b);
        }
    }
    let r = n - full * LANES;
    if r == 0 {
        return;
    }
    // The tail goes through the same block code, padded with zeros (which stay finite).
    let mut p1 = pad(pt);
    let (mut m1, mut v1) = (pad(mt), pad(vt));
    let mut x1 = if AMS { pad(xt) } else { [S::default(); LANES] };
    let mut o = OutMut::None;
    let (mut ob, mut of) = ([Bf16::default(); LANES], [F16::default(); LANES]);
    match out {
        OutMut::None => {}
        OutMut::Bf16(s) => {
            ob = pad(&s[full * LANES..]);
            o = OutMut::Bf16(&mut ob);
        }
        OutMut::F16(s) => {
            of = pad(&s[full * LANES..]);
            o = OutMut::F16(&mut of);
        }
    }
    // SAFETY: as above; `o` holds exactly one block.
    unsafe {
        out_block::<I, false>(&mut p1, &mut o, 0);
        update_block::<I, G, S, AMS, false>(c, &mut p1, &pad(gt), &mut m1, &mut v1, AMS.then_some(&mut x1));
        out_block::<I, true>(&mut p1, &mut o, 0);
    }
    pt.copy_from_slice(&p1[..r]);
    mt.copy_from_slice(&m1[..r]);
    vt.copy_from_slice(&v1[..r]);
    if AMS {
        xt.copy_from_slice(&x1[..r]);
    }
    match out {
        OutMut::None => {}
        OutMut::Bf16(s) => s[full * LANES..].copy_from_slice(&ob[..r]),
        OutMut::F16(s) => s[full * LANES..].copy_from_slice(&of[..r]),
    }
}

/// The block loop when the gradient sits in the copy's buffer `o`, which the copy overwrites.
///
/// # Safety
/// The CPU supports `I`; all slices have `p.len()` elements (`vmax` too when `AMS`).
#[inline(always)]
unsafe fn body_inout<I: Isa, O: BlockIo, S: BlockIo, const AMS: bool>(
    c: &Consts,
    p: &mut [f32],
    o: &mut [O],
    m: &mut [S],
    v: &mut [S],
    vmax: &mut [S],
) {
    let n = p.len();
    let full = n / LANES;
    let (pb, pt) = p.as_chunks_mut::<LANES>();
    let (ob, ot) = o.as_chunks_mut::<LANES>();
    let (mb, mt) = m.as_chunks_mut::<LANES>();
    let (vb, vt) = v.as_chunks_mut::<LANES>();
    let (xb, xt) = vmax.as_chunks_mut::<LANES>();
    // SAFETY: as in `body`: equal lengths, so `full` blocks in each; CPU support is the caller's.
    unsafe {
        for b in 0..full {
            let ahead = (b + PREFETCH_BLOCKS).min(full - 1);
            I::prefetch(pb.as_ptr().wrapping_add(ahead) as *const u8);
            I::prefetch(ob.as_ptr().wrapping_add(ahead) as *const u8);
            I::prefetch(mb.as_ptr().wrapping_add(ahead) as *const u8);
            I::prefetch(vb.as_ptr().wrapping_add(ahead) as *const u8);
            let pk = pb.get_unchecked_mut(b);
            let ok = ob.get_unchecked_mut(b);
            let g = *ok;
            let x = if AMS { Some(xb.get_unchecked_mut(b)) } else { None };
            update_block::<I, O, S, AMS, false>(c, pk, &g, mb.get_unchecked_mut(b), vb.get_unchecked_mut(b), x);
            *ok = O::store::<I>(pk);
        }
    }
    let r = n - full * LANES;
    if r == 0 {
        return;
    }
    let mut p1 = pad(pt);
    let g1 = pad(ot);
    let (mut m1, mut v1) = (pad(mt), pad(vt));
    let mut x1 = if AMS { pad(xt) } else { [S::default(); LANES] };
    // SAFETY: as above.
    let o1 = unsafe {
        update_block::<I, O, S, AMS, false>(c, &mut p1, &g1, &mut m1, &mut v1, AMS.then_some(&mut x1));
        O::store::<I>(&p1)
    };
    pt.copy_from_slice(&p1[..r]);
    ot.copy_from_slice(&o1[..r]);
    mt.copy_from_slice(&m1[..r]);
    vt.copy_from_slice(&v1[..r]);
    if AMS {
        xt.copy_from_slice(&x1[..r]);
    }
}

/// Adds the update `u` to bfloat16 weights `w` (float32 `p0`) with Kahan compensation `comp`,
/// in torch-optimi's order, each step rounded to bfloat16: `c = c + u`, `w = p0 + c`,
/// `c = c + (p0 - w)`.
///
/// # Safety
/// The CPU supports `I`.
#[inline(always)]
unsafe fn kahan_add<I: Isa>(w: &mut [Bf16; LANES], comp: &mut [Bf16; LANES], p0: &Block, u: &Block) {
    let round = |x: Block| unsafe { Bf16::load::<I>(&Bf16::store::<I>(&x)) };
    let c0 = unsafe { Bf16::load::<I>(comp) };
    let c1 = round(std::array::from_fn(|i| c0[i] + u[i]));
    let p1 = round(std::array::from_fn(|i| p0[i] + c1[i]));
    let lost = round(std::array::from_fn(|i| p0[i] - p1[i]));
    let c2: Block = std::array::from_fn(|i| c1[i] + lost[i]);
    unsafe {
        *w = Bf16::store::<I>(&p1);
        *comp = Bf16::store::<I>(&c2);
    }
}

/// The block loop of bfloat16 weights with Kahan compensation and float moments: the update of
/// each lane block (`update_block` with `DELTA`) added by [`kahan_add`].
///
/// # Safety
/// The CPU supports `I`; all slices have `w.len()` elements (`vmax` too when `AMS`).
#[inline(always)]
unsafe fn body_kahan<I: Isa, G: BlockIo, S: BlockIo, const AMS: bool>(
    c: &Consts,
    w: &mut [Bf16],
    comp: &mut [Bf16],
    g: &[G],
    m: &mut [S],
    v: &mut [S],
    vmax: &mut [S],
) {
    let n = w.len();
    let full = n / LANES;
    let (wb, wt) = w.as_chunks_mut::<LANES>();
    let (cb, ct) = comp.as_chunks_mut::<LANES>();
    let (gb, gt) = g.as_chunks::<LANES>();
    let (mb, mt) = m.as_chunks_mut::<LANES>();
    let (vb, vt) = v.as_chunks_mut::<LANES>();
    let (xb, xt) = vmax.as_chunks_mut::<LANES>();
    // SAFETY: equal lengths (the caller's), so `full` blocks in each; CPU support is the caller's.
    unsafe {
        for b in 0..full {
            let ahead = (b + PREFETCH_BLOCKS).min(full - 1);
            I::prefetch(wb.as_ptr().wrapping_add(ahead) as *const u8);
            I::prefetch(cb.as_ptr().wrapping_add(ahead) as *const u8);
            I::prefetch(gb.as_ptr().wrapping_add(ahead) as *const u8);
            I::prefetch(mb.as_ptr().wrapping_add(ahead) as *const u8);
            I::prefetch(vb.as_ptr().wrapping_add(ahead) as *const u8);
            let wk = wb.get_unchecked_mut(b);
            let p0 = Bf16::load::<I>(wk);
            let mut u = p0;
            let x = if AMS { Some(xb.get_unchecked_mut(b)) } else { None };
            update_block::<I, G, S, AMS, true>(
                c,
                &mut u,
                gb.get_unchecked(b),
                mb.get_unchecked_mut(b),
                vb.get_unchecked_mut(b),
                x,
            );
            kahan_add::<I>(wk, cb.get_unchecked_mut(b), &p0, &u);
        }
    }
    let r = n - full * LANES;
    if r == 0 {
        return;
    }
    let (mut w1, mut c1) = (pad(wt), pad(ct));
    let (mut m1, mut v1) = (pad(mt), pad(vt));
    let mut x1 = if AMS { pad(xt) } else { [S::default(); LANES] };
    // SAFETY: as above, on padded blocks.
    unsafe {
        let p0 = Bf16::load::<I>(&w1);
        let mut u = p0;
        update_block::<I, G, S, AMS, true>(c, &mut u, &pad(gt), &mut m1, &mut v1, AMS.then_some(&mut x1));
        kahan_add::<I>(&mut w1, &mut c1, &p0, &u);
    }
    wt.copy_from_slice(&w1[..r]);
    ct.copy_from_slice(&c1[..r]);
    mt.copy_from_slice(&m1[..r]);
    vt.copy_from_slice(&v1[..r]);
    if AMS {
        xt.copy_from_slice(&x1[..r]);
    }
}

/// Sum of squares in f64, lane-wise then in a fixed order.
///
/// # Safety
/// The CPU supports `I`.
#[inline(always)]
unsafe fn sq_norm_body<I: Isa, G: BlockIo>(g: &[G]) -> f64 {
    let (gb, gt) = g.as_chunks::<LANES>();
    let mut acc = [0.0f64; LANES];
    let mut add = |x: &Block| {
        for i in 0..LANES {
            let d = x[i] as f64;
            acc[i] += d * d;
        }
    };
    for b in gb {
        add(&unsafe { G::load::<I>(b) });
    }
    if !gt.is_empty() {
        add(&unsafe { G::load::<I>(&pad(gt)) });
    }
    let mut width = LANES / 2;
    while width > 0 {
        for i in 0..width {
            acc[i] += acc[i + width];
        }
        width /= 2;
    }
    acc[0]
}

#[inline(always)]
fn nonfinite_body<G: Elem>(g: &[G]) -> bool {
    let (gb, gt) = g.as_chunks::<64>();
    for b in gb {
        if b.iter().fold(false, |a, x| a | x.is_nonfinite()) {
            return true;
        }
    }
    gt.iter().any(|x| x.is_nonfinite())
}

/// The typed entry points of one code path. Every entry point of the kernel reaches a path
/// through [`dispatch`], which checks once that the CPU runs it.
trait Path {
    /// # Safety
    /// As for [`body`].
    #[allow(clippy::too_many_arguments)]
    unsafe fn update<G: BlockIo, S: BlockIo, const AMS: bool>(
        c: &Consts,
        p: &mut [f32],
        g: &[G],
        m: &mut [S],
        v: &mut [S],
        vmax: &mut [S],
        out: &mut OutMut<'_>,
        next: &Lookahead,
    );
    /// # Safety
    /// As for [`body_inout`].
    unsafe fn update_inout<O: BlockIo, S: BlockIo, const AMS: bool>(
        c: &Consts,
        p: &mut [f32],
        o: &mut [O],
        m: &mut [S],
        v: &mut [S],
        vmax: &mut [S],
    );
    /// # Safety
    /// As for [`q8::body`].
    unsafe fn update_q8<G: BlockIo, const AMS: bool>(
        c: &Consts,
        p: &mut [f32],
        g: Option<&[G]>,
        m: Q8Mut<'_>,
        v: Q8Mut<'_>,
        x: Option<Q8Mut<'_>>,
        out: &mut OutMut<'_>,
        kahan: Option<Kahan<'_>>,
    );
    /// # Safety
    /// As for [`body_kahan`].
    unsafe fn update_kahan<G: BlockIo, S: BlockIo, const AMS: bool>(
        c: &Consts,
        k: Kahan<'_>,
        g: &[G],
        m: &mut [S],
        v: &mut [S],
        vmax: &mut [S],
    );
    /// # Safety
    /// The CPU supports the path.
    unsafe fn sq_norm<G: BlockIo>(g: &[G]) -> f64;
    /// # Safety
    /// The CPU supports the path.
    unsafe fn nonfinite<G: BlockIo>(g: &[G]) -> bool;
}

macro_rules! path {
    ($name:ident, $isa:ty $(, $features:literal)?) => {
        struct $name;
        impl Path for $name {
            #[inline]
            unsafe fn update<G: BlockIo, S: BlockIo, const AMS: bool>(
                c: &Consts, p: &mut [f32], g: &[G], m: &mut [S], v: &mut [S], vmax: &mut [S],
                out: &mut OutMut<'_>, next: &Lookahead,
            ) {
                $(#[target_feature(enable = $features)])?
                unsafe fn f<G: BlockIo, S: BlockIo, const AMS: bool>(
                    c: &Consts, p: &mut [f32], g: &[G], m: &mut [S], v: &mut [S], vmax: &mut [S],
                    out: &mut OutMut<'_>, next: &Lookahead,
                ) {
                    unsafe { body::<$isa, G, S, AMS>(c, p, g, m, v, vmax, out, next) }
                }
                unsafe { f::<G, S, AMS>(c, p, g, m, v, vmax, out, next) }
            }
            #[inline]
            unsafe fn update_inout<O: BlockIo, S: BlockIo, const AMS: bool>(
                c: &Consts, p: &mut [f32], o: &mut [O], m: &mut [S], v: &mut [S], vmax: &mut [S],
            ) {
                $(#[target_feature(enable = $features)])?
                unsafe fn f<O: BlockIo, S: BlockIo, const AMS: bool>(
                    c: &Consts, p: &mut [f32], o: &mut [O], m: &mut [S], v: &mut [S], vmax: &mut [S],
                ) {
                    unsafe { body_inout::<$isa, O, S, AMS>(c, p, o, m, v, vmax) }
                }
                unsafe { f::<O, S, AMS>(c, p, o, m, v, vmax) }
            }
            #[inline]
            unsafe fn update_q8<G: BlockIo, const AMS: bool>(
                c: &Consts, p: &mut [f32], g: Option<&[G]>, m: Q8Mut<'_>, v: Q8Mut<'_>, x: Option<Q8Mut<'_>>,
                out: &mut OutMut<'_>, kahan: Option<Kahan<'_>>,
            ) {
                $(#[target_feature(enable = $features)])?
                unsafe fn f<G: BlockIo, const AMS: bool>(
                    c: &Consts, p: &mut [f32], g: Option<&[G]>, m: Q8Mut<'_>, v: Q8Mut<'_>, x: Option<Q8Mut<'_>>,
                    out: &mut OutMut<'_>, kahan: Option<Kahan<'_>>,
                ) {
                    unsafe { q8::body::<$isa, G, AMS>(c, p, g, m, v, x, out, kahan) }
                }
                unsafe { f::<G, AMS>(c, p, g, m, v, x, out, kahan) }
            }
            #[inline]
            unsafe fn update_kahan<G: BlockIo, S: BlockIo, const AMS: bool>(
                c: &Consts, k: Kahan<'_>, g: &[G], m: &mut [S], v: &mut [S], vmax: &mut [S],
            ) {
                $(#[target_feature(enable = $features)])?
                unsafe fn f<G: BlockIo, S: BlockIo, const AMS: bool>(
                    c: &Consts, k: Kahan<'_>, g: &[G], m: &mut [S], v: &mut [S], vmax: &mut [S],
                ) {
                    unsafe { body_kahan::<$isa, G, S, AMS>(c, k.w, k.comp, g, m, v, vmax) }
                }
                unsafe { f::<G, S, AMS>(c, k, g, m, v, vmax) }
            }
            #[inline]
            unsafe fn sq_norm<G: BlockIo>(g: &[G]) -> f64 {
                $(#[target_feature(enable = $features)])?
                unsafe fn f<G: BlockIo>(g: &[G]) -> f64 {
                    unsafe { sq_norm_body::<$isa, G>(g) }
                }
                unsafe { f::<G>(g) }
            }
            #[inline]
            unsafe fn nonfinite<G: BlockIo>(g: &[G]) -> bool {
                $(#[target_feature(enable = $features)])?
                unsafe fn f<G: BlockIo>(g: &[G]) -> bool {
                    nonfinite_body(g)
                }
                unsafe { f::<G>(g) }
            }
        }
    };
}

path!(GenericPath, Generic);
#[cfg(target_arch = "x86_64")]
path!(Avx2Path, Avx2, "avx2,fma,f16c");
#[cfg(target_arch = "x86_64")]
path!(Avx512Path, Avx512, "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c");
#[cfg(target_arch = "x86_64")]
path!(
    Avx512Bf16Path,
    Avx512Bf16,
    "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c"
);

/// The specification as a path: [`reference::update`], one element at a time.
struct ScalarPath;

/// In-place mode: the slot's gradient, read exactly as f32; the slot then holds the rounded
/// master, so that the reference's resync sees no edit and overwrites it with the new copy.
fn take_slot<O: Elem>(o: &mut [O], p: &[f32]) -> Vec<f32> {
    let g = o.iter().map(|x| x.to_f32()).collect();
    for (x, w) in o.iter_mut().zip(p) {
        *x = O::from_f32(*w);
    }
    g
}

impl Path for ScalarPath {
    unsafe fn update<G: BlockIo, S: BlockIo, const AMS: bool>(
        c: &Consts,
        p: &mut [f32],
        g: &[G],
        m: &mut [S],
        v: &mut [S],
        vmax: &mut [S],
        out: &mut OutMut<'_>,
        _next: &Lookahead,
    ) {
        let x = if AMS { Some(vmax) } else { None };
        match out {
            OutMut::None => reference::update::<G, S, Bf16>(c, p, g, m, v, x, None),
            OutMut::Bf16(o) => reference::update(c, p, g, m, v, x, Some(&mut **o)),
            OutMut::F16(o) => reference::update(c, p, g, m, v, x, Some(&mut **o)),
        }
    }
    unsafe fn update_inout<O: BlockIo, S: BlockIo, const AMS: bool>(
        c: &Consts,
        p: &mut [f32],
        o: &mut [O],
        m: &mut [S],
        v: &mut [S],
        vmax: &mut [S],
    ) {
        // The specification of the in-place mode: read the gradients, then run the plain update
        // with the copy written to the same buffer.
        let g = take_slot(o, p);
        reference::update(c, p, &g, m, v, if AMS { Some(vmax) } else { None }, Some(o));
    }
    unsafe fn update_q8<G: BlockIo, const AMS: bool>(
        c: &Consts,
        p: &mut [f32],
        g: Option<&[G]>,
        m: Q8Mut<'_>,
        v: Q8Mut<'_>,
        x: Option<Q8Mut<'_>>,
        out: &mut OutMut<'_>,
        kahan: Option<Kahan<'_>>,
    ) {
        let (g, inout) = (g.unwrap_or(&[]), g.is_none());
        match out {
            OutMut::None => q8::update_ref::<G, Bf16, AMS>(c, p, g, m, v, x, None, false, kahan),
            OutMut::Bf16(o) => q8::update_ref::<G, Bf16, AMS>(c, p, g, m, v, x, Some(&mut **o), inout, None),
            OutMut::F16(o) => q8::update_ref::<G, F16, AMS>(c, p, g, m, v, x, Some(&mut **o), inout, None),
        }
    }
    /// The Kahan mode has no element-by-element specification of its own: it is the portable
    /// path's block code (the tests check its plumbing; torch-optimi checks its arithmetic).
    unsafe fn update_kahan<G: BlockIo, S: BlockIo, const AMS: bool>(
        c: &Consts,
        k: Kahan<'_>,
        g: &[G],
        m: &mut [S],
        v: &mut [S],
        vmax: &mut [S],
    ) {
        // SAFETY: the portable path runs on every CPU.
        unsafe { GenericPath::update_kahan::<G, S, AMS>(c, k, g, m, v, vmax) }
    }
    unsafe fn sq_norm<G: BlockIo>(g: &[G]) -> f64 {
        g.iter().map(|x| (x.to_f32() as f64) * (x.to_f32() as f64)).sum()
    }
    unsafe fn nonfinite<G: BlockIo>(g: &[G]) -> bool {
        g.iter().any(|x| !x.to_f32().is_finite())
    }
}

/// Something to run on whichever path [`dispatch`] picks.
trait Visit {
    type Out;
    /// # Safety
    /// The CPU supports `P` (only [`dispatch`] calls this, after checking).
    unsafe fn visit<P: Path>(self) -> Self::Out;
}

/// The one place a [`Simd`] choice becomes a code path: checks that this CPU runs it, then
/// calls `v` with that path.
fn dispatch<V: Visit>(simd: Simd, v: V) -> Result<V::Out> {
    if !simd.supported() {
        return Err(Error::Value(format!(
            "SIMD path {} is not supported by this CPU",
            simd.name()
        )));
    }
    // SAFETY: checked just above that this CPU runs `simd`.
    Ok(unsafe {
        match simd {
            Simd::Scalar => v.visit::<ScalarPath>(),
            #[cfg(target_arch = "x86_64")]
            Simd::Avx2 => v.visit::<Avx2Path>(),
            #[cfg(target_arch = "x86_64")]
            Simd::Avx512 => v.visit::<Avx512Path>(),
            #[cfg(target_arch = "x86_64")]
            Simd::Avx512Bf16 => v.visit::<Avx512Bf16Path>(),
            _ => v.visit::<GenericPath>(),
        }
    })
}

/// Runs one (validated) segment on path `P`; `next` is what this thread updates after it.
///
/// # Safety
/// The CPU supports `P`.
unsafe fn run_segment<P: Path>(s: Segment<'_>, next: &Lookahead) {
    let Segment {
        consts,
        amsgrad,
        param,
        grad,
        exp_avg,
        exp_avg_sq,
        max_exp_avg_sq,
        mut out,
        kahan,
    } = s;
    let (kahan, float_kahan) = match kahan {
        Some(k) if !matches!(exp_avg, StateMut::Q8 { .. }) => (None, Some(k)),
        k => (k, None),
    };
    if let Some(k) = float_kahan {
        macro_rules! kh {
            ($ams:literal, $g:expr, $m:expr, $v:expr, $x:expr) => {
                // SAFETY: lengths validated; path support is the caller's contract.
                unsafe { P::update_kahan::<_, _, $ams>(&consts, k, $g, $m, $v, $x) }
            };
        }
        macro_rules! by_state_k {
            ($g:expr) => {
                match (exp_avg, exp_avg_sq, max_exp_avg_sq) {
                    (StateMut::F32(m), StateMut::F32(v), Some(StateMut::F32(x))) if amsgrad => kh!(true, $g, m, v, x),
                    (StateMut::F32(m), StateMut::F32(v), _) => kh!(false, $g, m, v, &mut []),
                    (StateMut::Bf16(m), StateMut::Bf16(v), Some(StateMut::Bf16(x))) if amsgrad => {
                        kh!(true, $g, m, v, x)
                    }
                    (StateMut::Bf16(m), StateMut::Bf16(v), _) => kh!(false, $g, m, v, &mut []),
                    _ => unreachable!("validated: moments share one dtype"),
                }
            };
        }
        match grad {
            GradRef::F32(g) => by_state_k!(g),
            GradRef::Bf16(g) => by_state_k!(g),
            GradRef::F16(g) => by_state_k!(g),
            GradRef::InOut => unreachable!("validated: Kahan weights read their gradient"),
        }
        return;
    }
    if let StateMut::Q8 { .. } = exp_avg {
        fn q(s: StateMut<'_>) -> Q8Mut<'_> {
            match s {
                StateMut::Q8 { codes, absmax } => Q8Mut { codes, absmax },
                _ => unreachable!("validated: moments share one codec"),
            }
        }
        let (m, v) = (q(exp_avg), q(exp_avg_sq));
        let x = if amsgrad { max_exp_avg_sq.map(q) } else { None };
        macro_rules! q8 {
            ($g:expr) => {
                // SAFETY: lengths validated (whole blocks); path support is the caller's contract.
                unsafe {
                    if amsgrad {
                        P::update_q8::<_, true>(&consts, param, $g, m, v, x, &mut out, kahan)
                    } else {
                        P::update_q8::<_, false>(&consts, param, $g, m, v, x, &mut out, kahan)
                    }
                }
            };
        }
        match grad {
            GradRef::F32(g) => q8!(Some(g)),
            GradRef::Bf16(g) => q8!(Some(g)),
            GradRef::F16(g) => q8!(Some(g)),
            GradRef::InOut => q8!(None::<&[f32]>),
        }
        return;
    }
    macro_rules! go {
        ($ams:literal, $g:expr, $m:expr, $v:expr, $x:expr) => {
            // SAFETY: lengths validated; path support is the caller's contract.
            unsafe { P::update::<_, _, $ams>(&consts, param, $g, $m, $v, $x, &mut out, next) }
        };
    }
    macro_rules! by_state {
        ($g:expr) => {
            match (exp_avg, exp_avg_sq, max_exp_avg_sq) {
                (StateMut::F32(m), StateMut::F32(v), Some(StateMut::F32(x))) if amsgrad => go!(true, $g, m, v, x),
                (StateMut::F32(m), StateMut::F32(v), _) => go!(false, $g, m, v, &mut []),
                (StateMut::Bf16(m), StateMut::Bf16(v), Some(StateMut::Bf16(x))) if amsgrad => go!(true, $g, m, v, x),
                (StateMut::Bf16(m), StateMut::Bf16(v), _) => go!(false, $g, m, v, &mut []),
                _ => unreachable!("validated: moments share one dtype"),
            }
        };
    }
    macro_rules! inout {
        ($o:expr) => {{
            macro_rules! go2 {
                ($ams:literal, $m:expr, $v:expr, $x:expr) => {
                    // SAFETY: as above.
                    unsafe { P::update_inout::<_, _, $ams>(&consts, param, $o, $m, $v, $x) }
                };
            }
            match (exp_avg, exp_avg_sq, max_exp_avg_sq) {
                (StateMut::F32(m), StateMut::F32(v), Some(StateMut::F32(x))) if amsgrad => go2!(true, m, v, x),
                (StateMut::F32(m), StateMut::F32(v), _) => go2!(false, m, v, &mut []),
                (StateMut::Bf16(m), StateMut::Bf16(v), Some(StateMut::Bf16(x))) if amsgrad => go2!(true, m, v, x),
                (StateMut::Bf16(m), StateMut::Bf16(v), _) => go2!(false, m, v, &mut []),
                _ => unreachable!("validated: moments share one dtype"),
            }
        }};
    }
    match grad {
        GradRef::F32(g) => by_state!(g),
        GradRef::Bf16(g) => by_state!(g),
        GradRef::F16(g) => by_state!(g),
        GradRef::InOut => match std::mem::replace(&mut out, OutMut::None) {
            OutMut::Bf16(o) => inout!(o),
            OutMut::F16(o) => inout!(o),
            OutMut::None => unreachable!("validated: InOut has a copy buffer"),
        },
    }
}

/// Addresses of the next segment's streams, only ever prefetched (never dereferenced).
#[derive(Default)]
pub struct Lookahead {
    /// (start address, bytes per block) of each stream.
    streams: [(usize, usize); 6],
    count: usize,
}

impl Lookahead {
    fn of(s: Option<&Segment<'_>>) -> Lookahead {
        let mut l = Lookahead::default();
        let Some(s) = s else { return l };
        let mut add = |addr: usize, elem: usize| {
            l.streams[l.count] = (addr, elem * LANES);
            l.count += 1;
        };
        add(s.param.as_ptr() as usize, 4);
        match &s.grad {
            GradRef::F32(x) => add(x.as_ptr() as usize, 4),
            GradRef::Bf16(x) => add(x.as_ptr() as usize, 2),
            GradRef::F16(x) => add(x.as_ptr() as usize, 2),
            GradRef::InOut => match &s.out {
                OutMut::Bf16(x) => add(x.as_ptr() as usize, 2),
                OutMut::F16(x) => add(x.as_ptr() as usize, 2),
                OutMut::None => {}
            },
        }
        let mut state = |x: &StateMut<'_>| match x {
            StateMut::F32(x) => add(x.as_ptr() as usize, 4),
            StateMut::Bf16(x) => add(x.as_ptr() as usize, 2),
            StateMut::Q8 { codes, .. } => add(codes.as_ptr() as usize, 1),
        };
        state(&s.exp_avg);
        state(&s.exp_avg_sq);
        if let Some(x) = &s.max_exp_avg_sq {
            state(x);
        }
        l
    }

    /// Prefetches block `b` of every stream (past the segment's end is harmless: a hint).
    #[inline(always)]
    fn prefetch<I: Isa>(&self, b: usize) {
        for &(addr, bytes) in &self.streams[..self.count] {
            I::prefetch(addr.wrapping_add(b * bytes) as *const u8);
        }
    }
}

/// Consecutive chunks run by one thread, in order, so that the end of one prefetches the start
/// of the next: tensors smaller than the prefetch distance would otherwise always start cold.
fn tasks<'a>(chunks: Vec<Segment<'a>>) -> Vec<Vec<Segment<'a>>> {
    let mut tasks = Vec::new();
    let mut cur = Vec::new();
    let mut len = 0;
    for c in chunks {
        len += c.len();
        cur.push(c);
        if len >= CHUNK {
            tasks.push(std::mem::take(&mut cur));
            len = 0;
        }
    }
    if !cur.is_empty() {
        tasks.push(cur);
    }
    tasks
}

/// Where the work runs: a thread pool, or (None) the calling thread.
pub type Pool<'p> = Option<&'p rayon::ThreadPool>;

fn for_each<T: Send>(pool: Pool<'_>, items: Vec<T>, f: impl Fn(T) + Sync + Send) {
    match pool {
        Some(p) if p.current_num_threads() > 1 => p.install(|| items.into_par_iter().for_each(f)),
        _ => items.into_iter().for_each(f),
    }
}

fn map<T: Sync, R: Send>(pool: Pool<'_>, items: &[T], f: impl Fn(&T) -> R + Sync + Send) -> Vec<R> {
    match pool {
        Some(p) if p.current_num_threads() > 1 => p.install(|| items.par_iter().map(f).collect()),
        _ => items.iter().map(f).collect(),
    }
}

/// Updates every segment: validates them all first (an error leaves every buffer untouched),
/// then runs them on `pool` in chunks of at most [`CHUNK`] elements.
pub fn adam_step(simd: Simd, pool: Pool<'_>, segments: Vec<Segment<'_>>) -> Result<()> {
    struct Step<'p, 'a> {
        pool: Pool<'p>,
        tasks: Vec<Vec<Segment<'a>>>,
    }
    impl Visit for Step<'_, '_> {
        type Out = ();
        unsafe fn visit<P: Path>(self) {
            for_each(self.pool, self.tasks, |task| {
                let mut it = task.into_iter().peekable();
                while let Some(s) = it.next() {
                    let next = Lookahead::of(it.peek());
                    // SAFETY: the CPU supports `P` (this visit's contract).
                    unsafe { run_segment::<P>(s, &next) };
                }
            })
        }
    }
    for (i, s) in segments.iter().enumerate() {
        s.validate().map_err(|e| e.context(&format!("segment {i}")))?;
    }
    let mut chunks = Vec::with_capacity(segments.len());
    for s in segments {
        s.chunks(CHUNK, &mut chunks);
    }
    dispatch(
        simd,
        Step {
            pool,
            tasks: tasks(chunks),
        },
    )
}

/// Gradients cut into chunks of at most [`CHUNK`] elements (`InOut` has none to read).
fn grad_chunks<'a>(grads: &[GradRef<'a>]) -> Vec<GradRef<'a>> {
    let mut out = Vec::new();
    for g in grads {
        let mut rest = match g {
            GradRef::F32(s) => GradRef::F32(s),
            GradRef::Bf16(s) => GradRef::Bf16(s),
            GradRef::F16(s) => GradRef::F16(s),
            GradRef::InOut => continue,
        };
        while rest.len() > CHUNK {
            let (a, b) = rest.split_at(CHUNK);
            out.push(a);
            rest = b;
        }
        if !rest.is_empty() {
            out.push(rest);
        }
    }
    out
}

/// A read-only pass over gradient chunks, one result per chunk.
trait ChunkPass: Send + Sync {
    type Out: Send;
    /// # Safety
    /// The CPU supports `P`.
    unsafe fn on<P: Path, G: BlockIo>(g: &[G]) -> Self::Out;
}

/// Runs pass `F` over the chunks of `grads` on whichever path [`dispatch`] picks.
fn chunk_pass<F: ChunkPass>(simd: Simd, pool: Pool<'_>, grads: &[GradRef<'_>]) -> Result<Vec<F::Out>> {
    struct Run<'p, 'a, F>(Pool<'p>, Vec<GradRef<'a>>, std::marker::PhantomData<F>);
    impl<F: ChunkPass> Visit for Run<'_, '_, F> {
        type Out = Vec<F::Out>;
        unsafe fn visit<P: Path>(self) -> Vec<F::Out> {
            map(self.0, &self.1, |g| {
                // SAFETY: the CPU supports `P` (this visit's contract); `grad_chunks` left out
                // `InOut`, which has nothing to read.
                unsafe {
                    match g {
                        GradRef::F32(s) => F::on::<P, _>(s),
                        GradRef::Bf16(s) => F::on::<P, _>(s),
                        GradRef::F16(s) => F::on::<P, _>(s),
                        GradRef::InOut => unreachable!("not chunked"),
                    }
                }
            })
        }
    }
    dispatch(simd, Run::<F>(pool, grad_chunks(grads), std::marker::PhantomData))
}

/// Sum of the squares of every gradient element, accumulated in f64. Deterministic: partial sums
/// of fixed chunks, added in order, whatever the number of threads.
pub fn grad_sq_norm(simd: Simd, pool: Pool<'_>, grads: &[GradRef<'_>]) -> Result<f64> {
    struct SqNorm;
    impl ChunkPass for SqNorm {
        type Out = f64;
        unsafe fn on<P: Path, G: BlockIo>(g: &[G]) -> f64 {
            // SAFETY: the caller's contract.
            unsafe { P::sq_norm(g) }
        }
    }
    Ok(chunk_pass::<SqNorm>(simd, pool, grads)?.iter().sum())
}

/// Whether any gradient element is an infinity or a NaN. Reads only.
pub fn grads_nonfinite(simd: Simd, pool: Pool<'_>, grads: &[GradRef<'_>]) -> Result<bool> {
    struct NonFinite;
    impl ChunkPass for NonFinite {
        type Out = bool;
        unsafe fn on<P: Path, G: BlockIo>(g: &[G]) -> bool {
            // SAFETY: the caller's contract.
            unsafe { P::nonfinite(g) }
        }
    }
    Ok(chunk_pass::<NonFinite>(simd, pool, grads)?.into_iter().any(|b| b))
}

/// A host buffer of any of the kernel's element types, to write (bytes: quantized moments).
pub enum HostMut<'a> {
    F32(&'a mut [f32]),
    Bf16(&'a mut [Bf16]),
    F16(&'a mut [F16]),
    U8(&'a mut [u8]),
}

impl<'a> HostMut<'a> {
    pub fn len(&self) -> usize {
        match self {
            HostMut::F32(s) => s.len(),
            HostMut::Bf16(s) => s.len(),
            HostMut::F16(s) => s.len(),
            HostMut::U8(s) => s.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The buffer as a gradient to read; `what` names it in the error (a uint8 buffer).
    pub fn into_grad(self, what: &str) -> Result<GradRef<'a>> {
        Ok(match self {
            HostMut::F32(s) => GradRef::F32(s),
            HostMut::Bf16(s) => GradRef::Bf16(s),
            HostMut::F16(s) => GradRef::F16(s),
            HostMut::U8(_) => {
                return Err(Error::Type(format!(
                    "{what}: dtype must be float32, bfloat16 or float16, got uint8"
                )))
            }
        })
    }
}

fn add_into<D: Elem, S: Elem>(dst: &mut [D], src: &[S]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = D::from_f32(d.to_f32() + s.to_f32());
    }
}

/// `dst += src` element by element, computed in f32 and rounded to `dst`'s dtype: the rounding
/// torch does when it adds a gradient into an existing one.
pub fn accumulate(pool: Pool<'_>, dst: HostMut<'_>, src: GradRef<'_>) -> Result<()> {
    if matches!(dst, HostMut::U8(_)) {
        return Err(Error::Type(
            "dst: a gradient is float32, bfloat16 or float16, not uint8".into(),
        ));
    }
    if dst.len() != src.len() || matches!(src, GradRef::InOut) {
        return Err(Error::Value(format!(
            "src: has {} elements, dst {}",
            src.len(),
            dst.len()
        )));
    }
    macro_rules! go {
        ($d:expr, $s:expr) => {{
            let pairs: Vec<_> = $d.chunks_mut(CHUNK).zip($s.chunks(CHUNK)).collect();
            for_each(pool, pairs, |(d, s)| add_into(d, s));
        }};
    }
    match (dst, src) {
        (HostMut::F32(d), GradRef::F32(s)) => go!(d, s),
        (HostMut::F32(d), GradRef::Bf16(s)) => go!(d, s),
        (HostMut::F32(d), GradRef::F16(s)) => go!(d, s),
        (HostMut::Bf16(d), GradRef::F32(s)) => go!(d, s),
        (HostMut::Bf16(d), GradRef::Bf16(s)) => go!(d, s),
        (HostMut::Bf16(d), GradRef::F16(s)) => go!(d, s),
        (HostMut::F16(d), GradRef::F32(s)) => go!(d, s),
        (HostMut::F16(d), GradRef::Bf16(s)) => go!(d, s),
        (HostMut::F16(d), GradRef::F16(s)) => go!(d, s),
        (HostMut::U8(_), _) | (_, GradRef::InOut) => unreachable!("refused above"),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

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
    }

    impl Q8Bufs {
        fn new(n: usize, seed: u64) -> Q8Bufs {
            let mut r = Rng(seed | 1);
            let p = r.vec(n, 1.0);
            let b = n / q8::QBLOCK;
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
                    exp_avg: StateMut::Q8 {
                        codes: &mut self.mc,
                        absmax: &mut self.ms,
                    },
                    exp_avg_sq: StateMut::Q8 {
                        codes: &mut self.vc,
                        absmax: &mut self.vs,
                    },
                    max_exp_avg_sq: Some(StateMut::Q8 {
                        codes: &mut self.xc,
                        absmax: &mut self.xs,
                    }),
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
        // Several chunks (CHUNK = 128 blocks), threads, modes.
        let n = 2 * CHUNK + 4096;
        for &(decoupled, amsgrad, wd) in &[(true, false, 0.01), (false, true, 0.01), (true, true, 0.0)] {
            for mode in 0..3u8 {
                let h = hyper(decoupled, amsgrad, false, wd);
                let mut want = Q8Bufs::new(n, 5);
                want.run(&h, Simd::Scalar, 1, 6, mode);
                for simd in Simd::available() {
                    for threads in [1, 3] {
                        let mut got = Q8Bufs::new(n, 5);
                        got.run(&h, simd, threads, 6, mode);
                        assert!(
                            got == want,
                            "{} threads {threads} mode {mode} {decoupled} {amsgrad}",
                            simd.name()
                        );
                    }
                }
                assert!(want.mc.iter().any(|&c| c != want.mc[0]), "codes move");
            }
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
        q8: bool,
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
        let b = n / q8::QBLOCK;
        let (mut mc, mut vc, mut xc) = (vec![0u8; n], vec![0u8; n], vec![0u8; n]);
        let (mut ms, mut vs, mut xs) = (vec![0.0f32; b], vec![0.0f32; b], vec![0.0f32; b]);
        let pool = crate::pool::get(threads).unwrap();
        for t in 1..=steps {
            let g: Vec<f32> = r.vec(n, 0.1);
            let (em, ev, ex) = if q8 {
                (
                    StateMut::Q8 {
                        codes: &mut mc,
                        absmax: &mut ms,
                    },
                    StateMut::Q8 {
                        codes: &mut vc,
                        absmax: &mut vs,
                    },
                    StateMut::Q8 {
                        codes: &mut xc,
                        absmax: &mut xs,
                    },
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
        for q8 in [false, true] {
            for amsgrad in [false, true] {
                let n = if q8 { CHUNK + 4096 } else { CHUNK + 4096 + 7 }; // a tail of 7 without blocks
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
        let (w, comp) = run_kahan(n, false, false, Simd::best(), 1, steps, lr);
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
}
