//! A window of RAM that moves: the physical memory of a paged buffer's resident part, kept
//! between uses. The NVMe tier's buffers are as large as the whole state but only a few pages of
//! them hold anything at a time. Giving a page written back to the OS (`madvise`) and faulting
//! fresh, zeroed pages in for the next read cost more than the read itself when the disk is
//! fast: a RAM-backed directory stepped at 2.6x the raw time of its bytes that way.
//!
//! A `Window` moves the memory instead (`mremap`, which moves page-table entries, not bytes):
//! a range paged out has its pages moved to a parking place of the window's, and the range keeps
//! a fresh, empty mapping (`MREMAP_DONTUNMAP`: the buffer stays mapped throughout, and no other
//! mapping can take its place); a range paged in gets parked pages moved under it. RAM stays
//! bounded by what is resident at once (parked memory beyond a limit goes back to the OS), and
//! no page is faulted in or zeroed twice. Adopted ranges (their own memory, contents kept) and
//! ranges the kernel refuses to move are given back the same way. Everything is
//! private anonymous memory, as torch's CPU allocator hands out: a fork copies it on write, as
//! any other.
//!
//! `mremap` moves a range only within one mapping (VMA). Every piece the window moves is one:
//! each is a whole mapping of its own when it is created (`mmap`) and moves as one piece, and the
//! kernel only ever merges such mappings (never splits them) until the window moves them again.
//! A range's own memory may span several mappings: where its move fails, its memory goes to the
//! OS (`MADV_DONTNEED`) instead.

use crate::error::{Error, Result};

/// Window memory under a set of ranges: the pieces `(addr, len)` moved there, in order.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Lease {
    pieces: Vec<(usize, usize)>,
}

impl Lease {
    pub fn bytes(&self) -> usize {
        self.pieces.iter().map(|p| p.1).sum()
    }
}

/// The window: the parked pieces, and what is leased.
pub struct Window {
    /// Parked pieces `(addr, len)`: memory of the window's, mapped nowhere else.
    parked: Vec<(usize, usize)>,
    leased: usize,
    /// The most parked memory kept ([`Window::set_limit`]).
    limit: usize,
    page: usize,
    /// Whether this kernel moves memory (`MREMAP_DONTUNMAP`, Linux 5.7); if not, a range paged
    /// out gives its memory to the OS (`MADV_DONTNEED`) and nothing is parked.
    moves: bool,
}

fn os_error(what: &str) -> Error {
    let e = std::io::Error::last_os_error();
    Error::Io(e.raw_os_error().unwrap_or(libc::EIO), format!("{what}: {e}"))
}

impl Window {
    pub fn new() -> Window {
        Window {
            parked: Vec::new(),
            leased: 0,
            limit: usize::MAX,
            // SAFETY: sysconf has no preconditions.
            page: unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as usize,
            moves: true,
        }
    }

    /// Bytes of RAM the window holds (once touched): leased and parked (without moves: leased).
    pub fn bytes(&self) -> usize {
        self.leased + self.parked_bytes()
    }

    fn parked_bytes(&self) -> usize {
        self.parked.iter().map(|p| p.1).sum()
    }

    /// The whole OS pages inside `[addr, addr + len)`: what a lease moves (the partial pages at
    /// either end stay as they are).
    pub fn inner(&self, addr: usize, len: usize) -> (usize, usize) {
        let start = addr.div_ceil(self.page) * self.page;
        let end = (addr + len) / self.page * self.page;
        (start, end.saturating_sub(start))
    }

    /// A parked piece for `need` bytes: the smallest that holds them, else the largest; else
    /// new, untouched memory (the window grows); None if there is none to be had.
    fn take(&mut self, need: usize) -> Option<(usize, usize)> {
        let fit = (0..self.parked.len())
            .filter(|&i| self.parked[i].1 >= need)
            .min_by_key(|&i| self.parked[i].1)
            .or_else(|| (0..self.parked.len()).max_by_key(|&i| self.parked[i].1));
        if let Some(i) = fit {
            return Some(self.parked.swap_remove(i));
        }
        // SAFETY: a fresh private anonymous mapping wherever the kernel finds room; checked.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                need,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        (p != libc::MAP_FAILED).then_some((p as usize, need))
    }

    /// A lease of the ranges' own memory, as it is (what the caller wrote there stays): given
    /// back by [`Window::unmap`] like any other, which parks that memory for the next lease.
    pub fn adopt(&mut self, ranges: &[(usize, usize)]) -> Lease {
        let mut lease = Lease::default();
        for &(a, l) in ranges {
            let (a, l) = self.inner(a, l);
            if l > 0 {
                lease.pieces.push((a, l));
                self.leased += l;
            }
        }
        lease
    }

    /// Parked memory beyond `bytes` is given back to the OS instead of parked: a lease as large
    /// as the whole state (a checkpoint makes every page resident) does not stay in RAM after.
    pub fn set_limit(&mut self, bytes: usize) {
        self.limit = bytes;
        while self.parked_bytes() > self.limit {
            let Some((a, n)) = self.parked.pop() else { break };
            // SAFETY: a parked piece is a mapping of the window's own that nothing else uses.
            unsafe { libc::munmap(a as *mut libc::c_void, n) };
        }
    }

    /// Moves window memory under the whole OS pages of each of `ranges` (`(addr, len)`). Their
    /// contents become whatever that memory held last (the caller reads or zeroes them next).
    /// Where the kernel refuses a move (no memory for a mapping), the range keeps its own memory
    /// and the lease gives that back.
    ///
    /// # Safety
    /// Each range is private anonymous memory of this process that stays allocated until the
    /// lease is given back ([`Window::unmap`]), that no other thread uses during this call and
    /// that no live Rust reference points into.
    pub unsafe fn map(&mut self, ranges: &[(usize, usize)]) -> Lease {
        let mut lease = Lease::default();
        for &(a, l) in ranges {
            let (mut a, mut l) = self.inner(a, l);
            while l > 0 {
                let moved = self.moves.then(|| self.take(l)).flatten().and_then(|(src, have)| {
                    let n = have.min(l);
                    // SAFETY: [src, src + n) is a parked piece (one mapping of ours, nothing else
                    // maps it); [a, a + n) whole pages of the caller's range (the contract), which
                    // MREMAP_FIXED replaces in one step.
                    let r = unsafe {
                        libc::mremap(
                            src as *mut libc::c_void,
                            n,
                            n,
                            libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED,
                            a as *mut libc::c_void,
                        )
                    };
                    let rest = if r == libc::MAP_FAILED {
                        (src, have)
                    } else {
                        (src + n, have - n)
                    };
                    if rest.1 > 0 {
                        self.parked.push(rest);
                    }
                    (r != libc::MAP_FAILED).then_some(n)
                });
                // Not moved: the range's own memory (one piece: it stays in its mapping).
                let n = moved.unwrap_or(l);
                lease.pieces.push((a, n));
                self.leased += n;
                (a, l) = (a + n, l - n);
            }
        }
        lease
    }

    /// Takes a lease's memory back: its pages are parked (beyond the limit: given to the OS),
    /// and its ranges keep an empty mapping (zeros, no RAM until written).
    ///
    /// # Safety
    /// The lease's ranges are still allocated, and nothing uses them during this call or needs
    /// their contents after it.
    pub unsafe fn unmap(&mut self, lease: Lease) -> Result<()> {
        let mut first = Ok(());
        let mut parked = self.parked_bytes();
        for (a, n) in lease.pieces {
            self.leased -= n;
            if self.moves && parked + n <= self.limit {
                // SAFETY: [a, a + n) is one mapping's worth of a lease (see the module
                // documentation); DONTUNMAP leaves it mapped, empty, and moves its pages to a new
                // place of the kernel's choosing, which nothing else maps.
                let r = unsafe {
                    libc::mremap(
                        a as *mut libc::c_void,
                        n,
                        n,
                        libc::MREMAP_MAYMOVE | libc::MREMAP_DONTUNMAP,
                        std::ptr::null_mut::<libc::c_void>(),
                    )
                };
                if r != libc::MAP_FAILED {
                    self.parked.push((r as usize, n));
                    parked += n;
                    continue;
                }
                if std::io::Error::last_os_error().raw_os_error() == Some(libc::EINVAL) {
                    self.moves = false; // a kernel without MREMAP_DONTUNMAP: give memory back instead
                }
            }
            // SAFETY: the caller's contract; the range stays mapped and reads zeros.
            if unsafe { libc::madvise(a as *mut libc::c_void, n, libc::MADV_DONTNEED) } != 0 && first.is_ok() {
                first = Err(os_error("madvise"));
            }
        }
        if !self.moves {
            self.release_parked();
        }
        first
    }

    fn release_parked(&mut self) {
        for (a, n) in self.parked.drain(..) {
            // SAFETY: a parked piece is a mapping of the window's own that nothing else uses.
            unsafe { libc::munmap(a as *mut libc::c_void, n) };
        }
    }
}

impl Default for Window {
    fn default() -> Window {
        Window::new()
    }
}

impl Drop for Window {
    fn drop(&mut self) {
        // Leased pieces belong to their ranges' buffers from now on (plain memory of theirs).
        self.release_parked();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Private anonymous memory of `pages` pages, unmapped at drop.
    struct Region(usize, usize);
    impl Region {
        fn new(pages: usize, page: usize) -> Region {
            let n = pages * page;
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    n,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            assert_ne!(p, libc::MAP_FAILED);
            Region(p as usize, n)
        }
        fn bytes(&mut self) -> &mut [u8] {
            unsafe { std::slice::from_raw_parts_mut(self.0 as *mut u8, self.1) }
        }
    }
    impl Drop for Region {
        fn drop(&mut self) {
            unsafe { libc::munmap(self.0 as *mut libc::c_void, self.1) };
        }
    }

    /// A leased range shows what the window's memory held last; given back, it reads zeros and
    /// the next lease reuses that memory (split or joined as the ranges need); partial pages at
    /// the ends are left alone; the window holds only what was leased at once.
    fn leases_reuse_the_same_memory(moves: bool) {
        let mut w = Window::new();
        w.moves = moves;
        let page = w.page;
        let (mut a, mut b) = (Region::new(6, page), Region::new(6, page));
        let ra = (a.0 + 1, 5 * page); // 4 whole pages inside, a partial one either side
        a.bytes()[0] = 7;
        let l1 = unsafe { w.map(&[ra]) };
        a.bytes()[page..5 * page].fill(42);
        assert_eq!(w.bytes(), 4 * page);
        unsafe { w.unmap(l1).unwrap() };
        assert!(a.bytes()[page..5 * page].iter().all(|&x| x == 0));
        assert_eq!(a.bytes()[0], 7);
        // The same memory, now under two ranges of b: split.
        let l2 = unsafe { w.map(&[(b.0, page), (b.0 + 2 * page, 4 * page)]) };
        if moves {
            assert!(b.bytes()[..page].iter().all(|&x| x == 42));
            assert!(b.bytes()[2 * page..5 * page].iter().all(|&x| x == 42));
            assert!(b.bytes()[5 * page..].iter().all(|&x| x == 0)); // grown: fresh memory
            assert_eq!(w.bytes(), 5 * page);
        } else {
            assert!(b.bytes().iter().all(|&x| x == 0));
        }
        b.bytes().fill(9);
        unsafe { w.unmap(l2).unwrap() };
        assert!(b.bytes()[..page].iter().all(|&x| x == 0));
        assert_eq!(b.bytes()[page], 9); // never leased: kept
                                        // Joined: the parked pieces under one range.
        let l3 = unsafe { w.map(&[(a.0, 6 * page)]) };
        assert_eq!(l3.bytes(), 6 * page);
        if moves {
            assert_eq!(a.bytes().iter().filter(|&&x| x == 9).count(), 5 * page);
        }
        unsafe { w.unmap(l3).unwrap() };
        assert!(a.bytes().iter().all(|&x| x == 0));
        assert_eq!(w.bytes(), if moves { 6 * page } else { 0 });
    }

    /// An adopted range keeps its contents, and given back, its memory is parked for the next
    /// lease; parked memory beyond the limit goes back to the OS.
    #[test]
    fn adopted_memory_is_parked_up_to_the_limit() {
        let mut w = Window::new();
        let page = w.page;
        let (mut a, mut b) = (Region::new(4, page), Region::new(4, page));
        a.bytes().fill(5);
        let l = w.adopt(&[(a.0, 4 * page)]);
        assert!(a.bytes().iter().all(|&x| x == 5));
        assert_eq!(w.bytes(), 4 * page);
        unsafe { w.unmap(l).unwrap() };
        assert!(a.bytes().iter().all(|&x| x == 0));
        let l = unsafe { w.map(&[(b.0, 4 * page)]) };
        assert!(b.bytes().iter().all(|&x| x == 5));
        w.set_limit(2 * page);
        unsafe { w.unmap(l).unwrap() };
        assert_eq!(w.bytes(), 0); // over the limit: given back, not parked
        assert!(b.bytes().iter().all(|&x| x == 0));
        let l = unsafe { w.map(&[(a.0, page)]) };
        unsafe { w.unmap(l).unwrap() };
        assert_eq!(w.bytes(), page); // within it: parked
        w.set_limit(0);
        assert_eq!(w.bytes(), 0);
    }

    #[test]
    fn leases_move_memory() {
        leases_reuse_the_same_memory(true);
    }

    #[test]
    fn without_moves_leases_give_memory_back() {
        leases_reuse_the_same_memory(false);
    }
}
