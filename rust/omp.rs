//! The process's OpenMP team: torch's intra-op threads (libgomp's), reached through
//! `GOMP_parallel`, resolved from the process at run time (`dlsym(RTLD_DEFAULT)`: nothing is
//! linked). Inside a model the few-row kernel's rayon threads compete for the cores with torch's
//! OpenMP workers, which spin for a while after each torch operation; run on torch's own team,
//! a decode has one pool and the spinning workers are the ones that take the kernel's blocks.
//!
//! [`run`] calls `f(i)` for every `i < n` on a team of `threads` (the calling thread one of
//! them), each thread taking the next index from a shared counter. Without libgomp in the
//! process, or from inside a parallel region (a nested team would be one thread), it returns
//! false and runs nothing: the caller then uses its own pool.

use std::ffi::{c_uint, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::OnceLock;

type Parallel = unsafe extern "C" fn(extern "C" fn(*mut c_void), *mut c_void, c_uint, c_uint);
type IntFn = unsafe extern "C" fn() -> i32;

struct Omp {
    parallel: Parallel,
    in_parallel: IntFn,
}

fn omp() -> Option<&'static Omp> {
    static OMP: OnceLock<Option<Omp>> = OnceLock::new();
    OMP.get_or_init(|| {
        // SAFETY: dlsym with RTLD_DEFAULT and NUL-terminated names only looks symbols up; a
        // non-null result is the function of that name in a loaded libgomp, whose C signatures
        // are `void GOMP_parallel(void (*)(void *), void *, unsigned, unsigned)` and `int
        // omp_in_parallel(void)`.
        unsafe {
            let p = libc::dlsym(libc::RTLD_DEFAULT, c"GOMP_parallel".as_ptr());
            let q = libc::dlsym(libc::RTLD_DEFAULT, c"omp_in_parallel".as_ptr());
            if p.is_null() || q.is_null() {
                return None;
            }
            Some(Omp {
                parallel: std::mem::transmute::<*mut c_void, Parallel>(p),
                in_parallel: std::mem::transmute::<*mut c_void, IntFn>(q),
            })
        }
    })
    .as_ref()
}

/// Whether the process has an OpenMP runtime (libgomp) to run on.
pub fn available() -> bool {
    omp().is_some()
}

/// Whether [`run`] would run on a team from this thread: an OpenMP runtime, and the thread not
/// inside a parallel region.
pub fn usable() -> bool {
    // SAFETY: omp_in_parallel takes no argument and only reads the calling thread's state.
    omp().is_some_and(|o| unsafe { (o.in_parallel)() } == 0)
}

struct Ctx<'a> {
    f: &'a (dyn Fn(usize) + Sync),
    n: usize,
    next: AtomicUsize,
    panicked: AtomicBool,
}

extern "C" fn body(p: *mut c_void) {
    // SAFETY: `run` passes a pointer to its `Ctx`, alive until `GOMP_parallel` returns (every
    // thread of the team has finished this function by then).
    let ctx = unsafe { &*(p as *const Ctx<'_>) };
    loop {
        let i = ctx.next.fetch_add(1, Ordering::Relaxed);
        if i >= ctx.n {
            break;
        }
        // A panic must not unwind through C: it is caught, the other indices still run, and
        // `run` panics after the region.
        if catch_unwind(AssertUnwindSafe(|| (ctx.f)(i))).is_err() {
            ctx.panicked.store(true, Ordering::Relaxed);
        }
    }
}

/// Runs `f(0..n)` on the OpenMP team of `threads` (see the module's documentation); false (nothing
/// run) without one.
pub fn run(threads: usize, n: usize, f: &(dyn Fn(usize) + Sync)) -> bool {
    let Some(omp) = omp() else { return false };
    // SAFETY: omp_in_parallel takes no argument and only reads the calling thread's state.
    if unsafe { (omp.in_parallel)() } != 0 {
        return false;
    }
    let ctx = Ctx {
        f,
        n,
        next: AtomicUsize::new(0),
        panicked: AtomicBool::new(false),
    };
    // SAFETY: `body` matches GOMP_parallel's callback type and reads `ctx` only while the region
    // runs; GOMP_parallel returns after every thread of the team has returned from `body`, so
    // the borrow outlives every use. flags 0: no proc_bind.
    unsafe { (omp.parallel)(body, &ctx as *const Ctx<'_> as *mut c_void, threads.max(1) as c_uint, 0) };
    if ctx.panicked.load(Ordering::Relaxed) {
        panic!("a task run on the OpenMP team panicked");
    }
    true
}
