//! The block code of float moments: a path's block loads and stores, one lane block's update,
//! the resync and store of a low-precision copy, the block loops over a chunk (a copy, a
//! gradient in the copy's buffer, Kahan weights), and the gradient passes' blocks.

use super::segment::{nan_max, Consts, GradRef, OutMut, Segment, StateMut};
use crate::elem::{Bf16, Elem, F16};
use crate::isa::{Block, Isa, LANES};

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
pub(super) unsafe fn resync<I: Isa, O: BlockIo>(p: &mut Block, o: &[O; LANES]) {
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
pub(super) unsafe fn update_block<I: Isa, G: BlockIo, S: BlockIo, const AMS: bool, const DELTA: bool>(
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
pub(super) unsafe fn out_block<I: Isa, const STORE: bool>(p: &mut Block, out: &mut OutMut<'_>, b: usize) {
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
pub(super) fn pad<T: Copy + Default>(src: &[T]) -> [T; LANES] {
    let mut b = [T::default(); LANES];
    b[..src.len()].copy_from_slice(src);
    b
}

/// Software prefetch distance, in blocks (one 64-byte line of each fp32 stream per block). The
/// hardware prefetchers stop at 4 KiB page edges and track few streams. Asking 3 KiB ahead on
/// each stream took `python -m offload_adam bench` on one 100M tensor from 0.99x to 1.11-1.21x
/// torch fused on this project's 2-core VM.
pub(super) const PREFETCH_BLOCKS: usize = 48;

/// A chunk's float moments cut into lane blocks: what every block loop does with them, whatever
/// its weights are (prefetch, the update of one block, the zero-padded tail).
struct Moments<'a, S, const AMS: bool> {
    mb: &'a mut [[S; LANES]],
    vb: &'a mut [[S; LANES]],
    xb: &'a mut [[S; LANES]],
    mt: &'a mut [S],
    vt: &'a mut [S],
    xt: &'a mut [S],
}

impl<'a, S: BlockIo, const AMS: bool> Moments<'a, S, AMS> {
    /// `vmax` is empty unless `AMS`.
    #[inline(always)]
    fn new(m: &'a mut [S], v: &'a mut [S], vmax: &'a mut [S]) -> Self {
        let (mb, mt) = m.as_chunks_mut::<LANES>();
        let (vb, vt) = v.as_chunks_mut::<LANES>();
        let (xb, xt) = vmax.as_chunks_mut::<LANES>();
        Moments { mb, vb, xb, mt, vt, xt }
    }

    /// Prefetches block `ahead` of each moment (an address only: never dereferenced).
    #[inline(always)]
    fn prefetch<I: Isa>(&self, ahead: usize) {
        I::prefetch(self.mb.as_ptr().wrapping_add(ahead) as *const u8);
        I::prefetch(self.vb.as_ptr().wrapping_add(ahead) as *const u8);
        if AMS {
            I::prefetch(self.xb.as_ptr().wrapping_add(ahead) as *const u8);
        }
    }

    /// [`update_block`] on block `b` of the moments, with the weights `p` and gradient `g`.
    ///
    /// # Safety
    /// The CPU supports `I`; `b` is a full block of the moments (not checked).
    #[inline(always)]
    unsafe fn update<I: Isa, G: BlockIo, const DELTA: bool>(
        &mut self,
        c: &Consts,
        b: usize,
        p: &mut Block,
        g: &[G; LANES],
    ) {
        unsafe {
            let x = if AMS { Some(self.xb.get_unchecked_mut(b)) } else { None };
            update_block::<I, G, S, AMS, DELTA>(c, p, g, self.mb.get_unchecked_mut(b), self.vb.get_unchecked_mut(b), x);
        }
    }

    /// How many elements the moments' partial last block has (0: none).
    #[inline(always)]
    fn tail_len(&self) -> usize {
        self.mt.len()
    }

    /// [`update_block`] on the moments' partial last block, padded with zeros (which stay finite);
    /// `p` and `g` are padded by the caller.
    ///
    /// # Safety
    /// The CPU supports `I`.
    #[inline(always)]
    unsafe fn update_tail<I: Isa, G: BlockIo, const DELTA: bool>(&mut self, c: &Consts, p: &mut Block, g: &[G; LANES]) {
        let r = self.mt.len();
        let (mut m1, mut v1) = (pad(self.mt), pad(self.vt));
        let mut x1 = if AMS { pad(self.xt) } else { [S::default(); LANES] };
        // SAFETY: the caller's contract, on padded blocks.
        unsafe { update_block::<I, G, S, AMS, DELTA>(c, p, g, &mut m1, &mut v1, AMS.then_some(&mut x1)) };
        self.mt.copy_from_slice(&m1[..r]);
        self.vt.copy_from_slice(&v1[..r]);
        if AMS {
            self.xt.copy_from_slice(&x1[..r]);
        }
    }
}

/// The block loop over one chunk.
///
/// # Safety
/// The CPU supports `I`; all slices have `p.len()` elements (`vmax` too when `AMS`).
#[inline(always)]
pub(super) unsafe fn body<I: Isa, G: BlockIo, S: BlockIo, const AMS: bool>(
    c: &Consts,
    p: &mut [f32],
    g: &[G],
    m: &mut [S],
    v: &mut [S],
    vmax: &mut [S],
    out: &mut OutMut<'_>,
    next: &Lookahead,
) {
    let full = p.len() / LANES;
    let (pb, pt) = p.as_chunks_mut::<LANES>();
    let (gb, gt) = g.as_chunks::<LANES>();
    let mut mo = Moments::<S, AMS>::new(m, v, vmax);
    // SAFETY: every `*b` slice has `full` blocks (same lengths, checked by the caller), so the
    // unchecked indexing stays in bounds; the CPU supports `I` (caller's contract).
    unsafe {
        for b in 0..full {
            let ahead = b + PREFETCH_BLOCKS;
            if ahead < full {
                I::prefetch(pb.as_ptr().wrapping_add(ahead) as *const u8);
                I::prefetch(gb.as_ptr().wrapping_add(ahead) as *const u8);
                mo.prefetch::<I>(ahead);
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
            mo.update::<I, G, false>(c, b, pk, gb.get_unchecked(b));
            out_block::<I, true>(pk, out, b);
        }
    }
    let r = mo.tail_len();
    if r == 0 {
        return;
    }
    // The tail goes through the same block code, padded.
    let mut p1 = pad(pt);
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
        mo.update_tail::<I, G, false>(c, &mut p1, &pad(gt));
        out_block::<I, true>(&mut p1, &mut o, 0);
    }
    pt.copy_from_slice(&p1[..r]);
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
pub(super) unsafe fn body_inout<I: Isa, O: BlockIo, S: BlockIo, const AMS: bool>(
    c: &Consts,
    p: &mut [f32],
    o: &mut [O],
    m: &mut [S],
    v: &mut [S],
    vmax: &mut [S],
) {
    let full = p.len() / LANES;
    let (pb, pt) = p.as_chunks_mut::<LANES>();
    let (ob, ot) = o.as_chunks_mut::<LANES>();
    let mut mo = Moments::<S, AMS>::new(m, v, vmax);
    // SAFETY: as in `body`: equal lengths, so `full` blocks in each; CPU support is the caller's.
    unsafe {
        for b in 0..full {
            let ahead = (b + PREFETCH_BLOCKS).min(full - 1);
            I::prefetch(pb.as_ptr().wrapping_add(ahead) as *const u8);
            I::prefetch(ob.as_ptr().wrapping_add(ahead) as *const u8);
            mo.prefetch::<I>(ahead);
            let pk = pb.get_unchecked_mut(b);
            let ok = ob.get_unchecked_mut(b);
            let g = *ok;
            mo.update::<I, O, false>(c, b, pk, &g);
            *ok = O::store::<I>(pk);
        }
    }
    let r = mo.tail_len();
    if r == 0 {
        return;
    }
    let mut p1 = pad(pt);
    // SAFETY: as above.
    let o1 = unsafe {
        mo.update_tail::<I, O, false>(c, &mut p1, &pad(ot));
        O::store::<I>(&p1)
    };
    pt.copy_from_slice(&p1[..r]);
    ot.copy_from_slice(&o1[..r]);
}

/// Adds the update `u` to bfloat16 weights `w` (float32 `p0`) with Kahan compensation `comp`,
/// in torch-optimi's order, each step rounded to bfloat16: `c = c + u`, `w = p0 + c`,
/// `c = c + (p0 - w)`.
///
/// # Safety
/// The CPU supports `I`.
#[inline(always)]
pub(super) unsafe fn kahan_add<I: Isa>(w: &mut [Bf16; LANES], comp: &mut [Bf16; LANES], p0: &Block, u: &Block) {
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
pub(super) unsafe fn body_kahan<I: Isa, G: BlockIo, S: BlockIo, const AMS: bool>(
    c: &Consts,
    w: &mut [Bf16],
    comp: &mut [Bf16],
    g: &[G],
    m: &mut [S],
    v: &mut [S],
    vmax: &mut [S],
) {
    let full = w.len() / LANES;
    let (wb, wt) = w.as_chunks_mut::<LANES>();
    let (cb, ct) = comp.as_chunks_mut::<LANES>();
    let (gb, gt) = g.as_chunks::<LANES>();
    let mut mo = Moments::<S, AMS>::new(m, v, vmax);
    // SAFETY: equal lengths (the caller's), so `full` blocks in each; CPU support is the caller's.
    unsafe {
        for b in 0..full {
            let ahead = (b + PREFETCH_BLOCKS).min(full - 1);
            I::prefetch(wb.as_ptr().wrapping_add(ahead) as *const u8);
            I::prefetch(cb.as_ptr().wrapping_add(ahead) as *const u8);
            I::prefetch(gb.as_ptr().wrapping_add(ahead) as *const u8);
            mo.prefetch::<I>(ahead);
            let wk = wb.get_unchecked_mut(b);
            let p0 = Bf16::load::<I>(wk);
            let mut u = p0;
            mo.update::<I, G, true>(c, b, &mut u, gb.get_unchecked(b));
            kahan_add::<I>(wk, cb.get_unchecked_mut(b), &p0, &u);
        }
    }
    let r = mo.tail_len();
    if r == 0 {
        return;
    }
    let (mut w1, mut c1) = (pad(wt), pad(ct));
    // SAFETY: as above, on padded blocks.
    unsafe {
        let p0 = Bf16::load::<I>(&w1);
        let mut u = p0;
        mo.update_tail::<I, G, true>(c, &mut u, &pad(gt));
        kahan_add::<I>(&mut w1, &mut c1, &p0, &u);
    }
    wt.copy_from_slice(&w1[..r]);
    ct.copy_from_slice(&c1[..r]);
}

/// Sum of squares in f64, lane-wise then in a fixed order.
///
/// # Safety
/// The CPU supports `I`.
#[inline(always)]
pub(super) unsafe fn sq_norm_body<I: Isa, G: BlockIo>(g: &[G]) -> f64 {
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
pub(super) fn nonfinite_body<G: Elem>(g: &[G]) -> bool {
    let (gb, gt) = g.as_chunks::<64>();
    for b in gb {
        if b.iter().fold(false, |a, x| a | x.is_nonfinite()) {
            return true;
        }
    }
    gt.iter().any(|x| x.is_nonfinite())
}

/// Addresses of the next segment's streams, only ever prefetched (never dereferenced).
#[derive(Default)]
pub(super) struct Lookahead {
    /// (start address, bytes per block) of each stream.
    streams: [(usize, usize); 6],
    count: usize,
}

impl Lookahead {
    pub(super) fn of(s: Option<&Segment<'_>>) -> Lookahead {
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
            StateMut::Q8 { codes, .. } | StateMut::Fp8 { codes, .. } => add(codes.as_ptr() as usize, 1),
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
    pub(super) fn prefetch<I: Isa>(&self, b: usize) {
        for &(addr, bytes) in &self.streams[..self.count] {
            I::prefetch(addr.wrapping_add(b * bytes) as *const u8);
        }
    }
}
