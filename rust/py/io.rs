//! The NVMe tier's I/O engine and its helpers, for Python: `IoEngine` (files, transfers of
//! tensors' memory, fault injection, `close`), `IoTicket` (a batch's completion; waiting releases the
//! GIL), `crc32c` of a tensor's bytes, `io_backend()` and `MemoryWindow`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use pyo3::prelude::*;

use super::convert::{err, value_error};
use super::dlpack::Import;
use crate::io::{self, Backend, Op, Request};
use crate::window;

fn backend_named(name: Option<&str>) -> PyResult<Option<Backend>> {
    match name {
        None => Ok(None),
        Some("uring") => Ok(Some(Backend::Uring)),
        Some("threads") => Ok(Some(Backend::Threads)),
        Some(o) => Err(value_error(format!("backend must be 'uring' or 'threads', got {o:?}"))),
    }
}

/// Reads and writes of tensors' memory at file offsets, several in flight.
#[pyclass(module = "offload_adam._native", frozen)]
pub struct IoEngine {
    inner: Arc<io::Engine>,
}

#[pymethods]
impl IoEngine {
    #[new]
    #[pyo3(signature = (backend=None, depth=32))]
    fn new(backend: Option<&str>, depth: usize) -> PyResult<IoEngine> {
        let inner = io::Engine::new(backend_named(backend)?, depth).map_err(err)?;
        Ok(IoEngine { inner: Arc::new(inner) })
    }

    /// "uring" or "threads".
    #[getter]
    fn backend(&self) -> &'static str {
        self.inner.backend().name()
    }

    /// Creates (or opens) `path`, `size` bytes allocated; returns its file number.
    fn open(&self, py: Python<'_>, path: &str, size: u64) -> PyResult<usize> {
        let inner = self.inner.clone();
        py.detach(|| inner.open(path, size)).map_err(err)
    }

    /// Opens the existing `path` read-only (buffered: any offset); returns (file number, size).
    fn open_read(&self, py: Python<'_>, path: &str) -> PyResult<(usize, u64)> {
        let inner = self.inner.clone();
        py.detach(|| inner.open_read(path)).map_err(err)
    }

    /// Whether file `file` is read and written with O_DIRECT (else buffered, cache dropped).
    fn direct(&self, file: usize) -> PyResult<bool> {
        self.inner.direct(file).map_err(err)
    }

    fn close_file(&self, file: usize) {
        self.inner.close_file(file)
    }

    /// Waits for the transfers queued, stops the engine's threads and closes every file it
    /// opened (its io_uring too): the disk space of files already removed is given back now, not
    /// when the engine is garbage-collected. Idempotent; `open`, `open_read` and `submit` then
    /// raise RuntimeError.
    fn close(&self, py: Python<'_>) {
        let inner = self.inner.clone();
        py.detach(move || inner.close())
    }

    /// Whether `close` has run.
    #[getter]
    fn closed(&self) -> bool {
        self.inner.closed()
    }

    /// Queues transfers `(write, file, tensor, file_offset)`: the whole of each tensor's memory
    /// (contiguous). The tensors are kept alive by the ticket; nobody may touch their memory
    /// until it completes.
    fn submit(&self, requests: Vec<(bool, usize, Bound<'_, PyAny>, u64)>) -> PyResult<IoTicket> {
        let mut reqs = Vec::with_capacity(requests.len());
        let mut keep = Vec::with_capacity(requests.len());
        for (i, (write, file, t, offset)) in requests.into_iter().enumerate() {
            let imp = Import::contiguous(&t, &format!("requests[{i}]"))?;
            let (a, b) = imp.range();
            reqs.push(Request {
                write,
                file,
                addr: a,
                len: b - a,
                offset,
            });
            keep.push(imp);
        }
        // SAFETY: each request spans one imported tensor's memory, kept alive by `keep`, which the
        // ticket owns until it completes; that nobody else touches it meanwhile is this method's
        // documented contract with its one caller, the pager (runtime/pager.py).
        let ticket = unsafe { self.inner.submit(&reqs) }.map_err(err)?;
        Ok(IoTicket {
            ticket,
            keep: Mutex::new(Some(keep)),
        })
    }

    /// Test-only fault seam: the `op` ("read", "write", or "open": a file's allocation) after
    /// `after` more of them fails with `errno` (0 disarms).
    #[pyo3(signature = (op, errno, after=0))]
    fn inject_fault(&self, op: &str, errno: i32, after: u64) -> PyResult<()> {
        let op = match op {
            "read" => Op::Read,
            "write" => Op::Write,
            "open" => Op::Open,
            o => return Err(value_error(format!("op must be 'read', 'write' or 'open', got {o:?}"))),
        };
        self.inner.inject_fault(op, errno, after);
        Ok(())
    }

    /// (bytes read, bytes written) so far.
    fn bytes(&self) -> (u64, u64) {
        use std::sync::atomic::Ordering::Relaxed;
        (
            self.inner.bytes_read.load(Relaxed),
            self.inner.bytes_written.load(Relaxed),
        )
    }
}

/// The completion of one `IoEngine.submit`.
#[pyclass(module = "offload_adam._native", frozen)]
pub struct IoTicket {
    ticket: io::Ticket,
    keep: Mutex<Option<Vec<Import>>>,
}

#[pymethods]
impl IoTicket {
    /// Waits (without the GIL) for every transfer; raises OSError naming the file, offset and
    /// errno of the first that failed.
    fn wait(&self, py: Python<'_>) -> PyResult<()> {
        let t = self.ticket.clone();
        let r = py.detach(move || t.wait());
        drop(self.keep.lock().unwrap_or_else(|e| e.into_inner()).take());
        r.map_err(err)
    }

    fn done(&self) -> bool {
        self.ticket.done()
    }
}

impl Drop for IoTicket {
    fn drop(&mut self) {
        // The transfers write or read the tensors' memory: it must outlive them.
        let _ = self.ticket.wait();
    }
}

/// CRC-32C of a contiguous tensor's bytes.
#[pyfunction]
pub fn crc32c(py: Python<'_>, tensor: &Bound<'_, PyAny>) -> PyResult<u32> {
    let imp = Import::contiguous(tensor, "tensor")?;
    let bytes = imp.bytes();
    Ok(py.detach(|| io::crc32c(bytes)))
}

/// The I/O backend an `IoEngine()` gets here: "uring" where the kernel allows it, else
/// "threads" (`OFFLOAD_ADAM_IO` overrides).
#[pyfunction]
pub fn io_backend() -> PyResult<&'static str> {
    Ok(io::Engine::new(None, 1).map_err(err)?.backend().name())
}

/// The NVMe tier's RAM window (`crate::window`): memory moved under tensors' pages while they
/// are resident, and taken back (parked) when they are not.
#[pyclass(module = "offload_adam._native")]
pub struct MemoryWindow {
    inner: window::Window,
    /// Lease number -> the lease and the tensors it lies under (kept alive, so that their memory
    /// stays allocated while it holds window memory).
    leases: HashMap<u64, (window::Lease, Vec<Import>)>,
    next: u64,
}

#[pymethods]
impl MemoryWindow {
    #[new]
    fn new() -> MemoryWindow {
        MemoryWindow {
            inner: window::Window::new(),
            leases: HashMap::new(),
            next: 0,
        }
    }

    /// Moves window memory under the whole OS pages of each tensor (contiguous, in host memory
    /// from torch's CPU allocator, not pinned; kept alive until `unmap`), reusing what earlier
    /// leases gave back; returns the lease's number. The tensors' contents are undefined until
    /// written.
    fn map(&mut self, tensors: Vec<Bound<'_, PyAny>>) -> PyResult<u64> {
        let keep = imports(&tensors)?;
        // SAFETY: each range is the memory of a tensor kept alive in `keep` until `unmap` gives
        // the lease back; the caller (the pager) leases a page's ranges only while no one uses
        // them, and no Rust reference points into a tensor's memory outside a call. (The GIL
        // stays held: the moves are page-table edits, and no other thread enters the window.)
        let lease = unsafe { self.inner.map(&ranges(&keep)) };
        Ok(self.insert(lease, keep))
    }

    /// A lease of the tensors' own memory, as it is (their contents stay); given back by
    /// `unmap`, which parks it for the next lease.
    fn adopt(&mut self, tensors: Vec<Bound<'_, PyAny>>) -> PyResult<u64> {
        let keep = imports(&tensors)?;
        let lease = self.inner.adopt(&ranges(&keep));
        Ok(self.insert(lease, keep))
    }

    /// Parked memory beyond `bytes` goes back to the OS instead.
    fn set_limit(&mut self, bytes: usize) {
        self.inner.set_limit(bytes)
    }

    /// Gives lease `lease` back: its memory is parked for the next lease, and its tensors' pages
    /// read zeros (no RAM until written).
    fn unmap(&mut self, lease: u64) -> PyResult<()> {
        let Some((l, keep)) = self.leases.remove(&lease) else {
            return Err(value_error(format!("lease: no lease {lease}")));
        };
        // SAFETY: the lease's ranges are still allocated (`keep`); the caller gives a page back
        // only once nothing reads it.
        let r = unsafe { self.inner.unmap(l) };
        drop(keep);
        r.map_err(err)
    }

    /// Bytes of RAM the window holds: leased and parked.
    #[getter]
    fn nbytes(&self) -> usize {
        self.inner.bytes()
    }
}

impl MemoryWindow {
    fn insert(&mut self, lease: window::Lease, keep: Vec<Import>) -> u64 {
        self.next += 1;
        self.leases.insert(self.next, (lease, keep));
        self.next
    }
}

/// The tensors of a lease, imported (contiguous, host memory).
fn imports(tensors: &[Bound<'_, PyAny>]) -> PyResult<Vec<Import>> {
    tensors
        .iter()
        .enumerate()
        .map(|(i, t)| Import::contiguous(t, &format!("tensors[{i}]")))
        .collect()
}

/// Their `(addr, len)` byte ranges.
fn ranges(keep: &[Import]) -> Vec<(usize, usize)> {
    keep.iter().map(|i| i.range()).map(|(a, b)| (a, b - a)).collect()
}
