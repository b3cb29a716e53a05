//! Where each parameter's state sits in its group's flat buffers, and the memory checks that make
//! handing the kernel mutable slices sound: no two buffers it writes share a byte, no two slots
//! of one buffer overlap, and no gradient it reads lies in memory it writes.
//!
//! Everything here is safe Rust: a buffer becomes per-parameter slices through `split_at_mut`.

use crate::error::{Error, Result};

/// Gradient landing buffers, one per gradient dtype: float32, bfloat16, float16.
pub const KINDS: usize = 3;

/// One parameter's place in the flat buffers of its group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Slot {
    /// First element of the slot in the state buffers (moments, amsgrad maximum, master).
    pub state: usize,
    /// Elements the kernel updates (twice the parameter's for complex parameters).
    pub len: usize,
    /// Gradients from landing buffers: (which buffer, first element in it).
    pub landing: Option<(usize, usize)>,
}

/// The slots of one param group.
#[derive(Clone, Debug)]
pub struct Layout {
    slots: Vec<Slot>,
}

impl Layout {
    /// Checks that every slot fits in state buffers of `state_len` elements (and its landing
    /// slot in a landing buffer of `landing_lens[kind]` elements), and that no two slots of one
    /// buffer overlap.
    pub fn new(slots: Vec<Slot>, state_len: usize, landing_lens: [Option<usize>; KINDS]) -> Result<Layout> {
        let fits = |off: usize, len: usize, total: usize| off.checked_add(len).is_some_and(|e| e <= total);
        for (i, s) in slots.iter().enumerate() {
            if !fits(s.state, s.len, state_len) {
                return Err(Error::Value(format!(
                    "slot {i}: state elements [{}, {}) past the end of the {state_len}-element buffers",
                    s.state,
                    s.state + s.len
                )));
            }
            if let Some((k, off)) = s.landing {
                match landing_lens.get(k).copied().flatten() {
                    Some(total) if fits(off, s.len, total) => {}
                    Some(_) => {
                        return Err(Error::Value(format!(
                            "slot {i}: landing slot past the end of its buffer"
                        )))
                    }
                    None => return Err(Error::Value(format!("slot {i}: no landing buffer of kind {k}"))),
                }
            }
        }
        let state: Vec<(usize, usize, String)> = slots
            .iter()
            .enumerate()
            .map(|(i, s)| (s.state, s.state + s.len, format!("slot {i}")))
            .collect();
        check_disjoint(state).map_err(|e| Error::Value(format!("overlapping state slots: {e}")))?;
        for k in 0..KINDS {
            let landing: Vec<(usize, usize, String)> = slots
                .iter()
                .enumerate()
                .filter_map(|(i, s)| match s.landing {
                    Some((kind, off)) if kind == k => Some((off, off + s.len, format!("slot {i}"))),
                    _ => None,
                })
                .collect();
            check_disjoint(landing).map_err(|e| Error::Value(format!("overlapping landing slots: {e}")))?;
        }
        Ok(Layout { slots })
    }

    pub fn slots(&self) -> &[Slot] {
        &self.slots
    }

    pub fn len(&self) -> usize {
        self.slots.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// Checks a selection of slots: in range, none twice.
    pub fn check_selection(&self, indices: &[usize]) -> Result<()> {
        let mut seen = vec![false; self.slots.len()];
        for &i in indices {
            if i >= self.slots.len() || std::mem::replace(&mut seen[i], true) {
                return Err(Error::Value(format!("selection: slot {i} is out of range or repeated")));
            }
        }
        Ok(())
    }
}

/// Sorts the byte ranges `[lo, hi)` and checks that no two share a byte (empty ranges are
/// dropped); the error names the two owners. Returns the sorted ranges.
pub fn check_disjoint(mut ranges: Vec<(usize, usize, String)>) -> Result<Vec<(usize, usize)>> {
    ranges.retain(|r| r.1 > r.0);
    ranges.sort_by_key(|r| r.0);
    for w in ranges.windows(2) {
        if w[1].0 < w[0].1 {
            return Err(Error::Value(format!(
                "{} and {} share memory; each parameter needs its own storage",
                w[0].2, w[1].2
            )));
        }
    }
    Ok(ranges.into_iter().map(|r| (r.0, r.1)).collect())
}

/// Whether `[lo, hi)` meets any of the sorted, disjoint `ranges`.
pub fn overlaps(ranges: &[(usize, usize)], lo: usize, hi: usize) -> bool {
    let i = ranges.partition_point(|r| r.0 < hi);
    lo < hi && i > 0 && ranges[i - 1].1 > lo
}

/// Merges lists of sorted, disjoint ranges, checking that no two lists share a byte.
pub fn merge_disjoint(lists: &[&[(usize, usize)]]) -> Result<Vec<(usize, usize)>> {
    let mut all: Vec<(usize, usize)> = lists.iter().flat_map(|l| l.iter().copied()).collect();
    if lists.len() > 1 {
        all.sort_unstable();
    }
    for w in all.windows(2) {
        if w[1].0 < w[0].1 {
            return Err(Error::Value(
                "two param groups share memory; each parameter needs its own storage".into(),
            ));
        }
    }
    Ok(all)
}

/// Cuts `buf` into the slices `[start, start + len)` of `ranges`, returned in the order of
/// `ranges`. Errors if one is out of bounds or two overlap.
pub fn carve<'a, T>(buf: &'a mut [T], ranges: &[(usize, usize)]) -> Result<Vec<&'a mut [T]>> {
    let mut order: Vec<usize> = (0..ranges.len()).collect();
    if !ranges.windows(2).all(|w| w[0].0 <= w[1].0) {
        order.sort_by_key(|&i| ranges[i].0);
    }
    let mut out: Vec<Option<&'a mut [T]>> = (0..ranges.len()).map(|_| None).collect();
    let mut rest = buf;
    let mut pos = 0usize;
    for i in order {
        let (start, len) = ranges[i];
        if start < pos || start.checked_add(len).is_none_or(|e| e > pos + rest.len()) {
            return Err(Error::Value(format!(
                "slice [{start}, {}) overlaps another or is out of bounds",
                start.saturating_add(len)
            )));
        }
        let (_, tail) = rest.split_at_mut(start - pos);
        let (piece, tail) = tail.split_at_mut(len);
        out[i] = Some(piece);
        rest = tail;
        pos = start + len;
    }
    Ok(out.into_iter().map(|s| s.expect("every range was placed")).collect())
}

/// Rounds `n` up to a multiple of `align`.
pub fn align_up(n: usize, align: usize) -> usize {
    n.div_ceil(align) * align
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slot(state: usize, len: usize, landing: Option<(usize, usize)>) -> Slot {
        Slot { state, len, landing }
    }

    #[test]
    fn layouts_are_checked() {
        let ok = vec![slot(0, 10, Some((0, 0))), slot(16, 5, Some((1, 0))), slot(32, 0, None)];
        assert!(Layout::new(ok, 32, [Some(16), Some(5), None]).is_ok());
        let past = vec![slot(0, 40, None)];
        assert!(Layout::new(past, 32, [None; 3])
            .unwrap_err()
            .message()
            .contains("past the end"));
        let overlap = vec![slot(0, 10, None), slot(8, 4, None)];
        assert!(Layout::new(overlap, 32, [None; 3])
            .unwrap_err()
            .message()
            .contains("overlapping state slots"));
        let landing = vec![slot(0, 4, Some((2, 0))), slot(16, 4, Some((2, 2)))];
        assert!(Layout::new(landing.clone(), 32, [None, None, Some(8)])
            .unwrap_err()
            .message()
            .contains("overlapping landing"));
        assert!(Layout::new(landing, 32, [None, None, None])
            .unwrap_err()
            .message()
            .contains("no landing buffer"));
        let l = Layout::new(vec![slot(0, 1, None), slot(16, 1, None)], 32, [None; 3]).unwrap();
        assert!(l.check_selection(&[1, 0]).is_ok());
        assert!(l.check_selection(&[1, 1]).is_err());
        assert!(l.check_selection(&[2]).is_err());
    }

    #[test]
    fn disjointness() {
        let r = check_disjoint(vec![(10, 20, "a".into()), (0, 10, "b".into()), (5, 5, "empty".into())]).unwrap();
        assert_eq!(r, vec![(0, 10), (10, 20)]);
        let e = check_disjoint(vec![(0, 11, "a".into()), (10, 20, "b".into())]).unwrap_err();
        assert_eq!(
            e,
            Error::Value("a and b share memory; each parameter needs its own storage".into())
        );
        assert!(overlaps(&r, 19, 25) && overlaps(&r, 0, 1) && !overlaps(&r, 20, 30) && !overlaps(&r, 3, 3));
        assert!(merge_disjoint(&[&[(0, 4)], &[(4, 8)]]).is_ok());
        assert!(merge_disjoint(&[&[(0, 5)], &[(4, 8)]]).is_err());
    }

    #[test]
    fn carving_returns_disjoint_slices_in_request_order() {
        let mut buf: Vec<u32> = (0..20).collect();
        let parts = carve(&mut buf, &[(10, 3), (0, 2), (15, 5), (13, 0)]).unwrap();
        assert_eq!(parts[0], &[10, 11, 12]);
        assert_eq!(parts[1], &[0, 1]);
        assert_eq!(parts[2], &[15, 16, 17, 18, 19]);
        assert!(parts[3].is_empty());
        for p in parts {
            p.iter_mut().for_each(|x| *x += 100);
        }
        assert_eq!(buf[0], 100);
        assert_eq!(buf[5], 5);
        assert!(carve(&mut buf, &[(0, 5), (4, 2)]).is_err());
        assert!(carve(&mut buf, &[(18, 3)]).is_err());
        assert!(carve(&mut buf, &[(usize::MAX, 2)]).is_err());
    }
}
