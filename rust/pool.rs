//! Private rayon pools, one per thread count, rebuilt after a fork.
//!
//! A forked child (a DataLoader worker) inherits the pool's bookkeeping but none of its threads;
//! using it there would hang. Each pool remembers the process that built it, and a lookup from
//! another process builds a fresh one. The stale pool is leaked, not dropped: its threads do not
//! exist in the child, so nothing must try to talk to them.

use std::sync::{Arc, Mutex};

use rayon::{ThreadPool, ThreadPoolBuilder};

use crate::error::{Error, Result};

struct Entry {
    threads: usize,
    pid: u32,
    pool: Arc<ThreadPool>,
}

static POOLS: Mutex<Vec<Entry>> = Mutex::new(Vec::new());

/// The pool of `threads` threads for this process (None for one thread: run on the caller).
pub fn get(threads: usize) -> Result<Option<Arc<ThreadPool>>> {
    if threads == 0 {
        return Err(Error::Value("num_threads must be at least 1".into()));
    }
    if threads == 1 {
        return Ok(None);
    }
    let pid = std::process::id();
    let mut pools = POOLS.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(i) = pools.iter().position(|e| e.threads == threads) {
        if pools[i].pid == pid {
            return Ok(Some(pools[i].pool.clone()));
        }
        let stale = pools.swap_remove(i);
        std::mem::forget(stale);
    }
    let pool = ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("offload-adam-{i}"))
        .build()
        .map_err(|e| Error::Runtime(format!("cannot start {threads} threads: {e}")))?;
    let pool = Arc::new(pool);
    pools.push(Entry {
        threads,
        pid,
        pool: pool.clone(),
    });
    Ok(Some(pool))
}

#[cfg(test)]
mod tests {
    #[test]
    fn one_thread_runs_inline_and_pools_are_shared() {
        assert!(super::get(1).unwrap().is_none());
        let a = super::get(3).unwrap().unwrap();
        let b = super::get(3).unwrap().unwrap();
        assert!(std::sync::Arc::ptr_eq(&a, &b));
        assert_eq!(a.current_num_threads(), 3);
        assert!(super::get(0).is_err());
    }
}
