//! The NVMe tier's I/O engine and its helpers, for Python: `IoEngine` (files, transfers of
//! tensors' memory, fault injection), `IoTicket` (a batch's completion; waiting releases the
//! GIL), `crc32c` of a tensor's bytes, `io_backend()` and `discard_memory`.

use std::sync::{Arc, Mutex};

use pyo3::prelude::*;

use super::convert::{err, value_error};
use super::dlpack::Import;
use crate::io::{self, Backend, Request};

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

    /// Queues transfers `(write, file, tensor, file_offset)`: the whole of each tensor's memory
    /// (contiguous). The tensors are kept alive by the ticket; nobody may touch their memory
    /// until it completes.
    fn submit(&self, requests: Vec<(bool, usize, Bound<'_, PyAny>, u64)>) -> PyResult<IoTicket> {
        let mut reqs = Vec::with_capacity(requests.len());
        let mut keep = Vec::with_capacity(requests.len());
        for (i, (write, file, t, offset)) in requests.into_iter().enumerate() {
            let imp = Import::new(&t, &format!("requests[{i}]"))?;
            if !imp.contiguous {
                return Err(value_error(format!("requests[{i}]: the tensor must be contiguous")));
            }
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

    /// Test-only fault seam: the `op` ("read" or "write") after `after` more of them fails with
    /// `errno` (0 disarms).
    #[pyo3(signature = (op, errno, after=0))]
    fn inject_fault(&self, op: &str, errno: i32, after: u64) -> PyResult<()> {
        let write = match op {
            "read" => false,
            "write" => true,
            o => return Err(value_error(format!("op must be 'read' or 'write', got {o:?}"))),
        };
        self.inner.inject_fault(write, errno, after);
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
    let imp = Import::new(tensor, "tensor")?;
    if !imp.contiguous {
        return Err(value_error("tensor: must be contiguous"));
    }
    let bytes = imp.bytes();
    Ok(py.detach(|| io::crc32c(bytes)))
}

/// The I/O backend an `IoEngine()` gets here: "uring" where the kernel allows it, else
/// "threads" (`OFFLOAD_ADAM_IO` overrides).
#[pyfunction]
pub fn io_backend() -> PyResult<&'static str> {
    Ok(io::Engine::new(None, 1).map_err(err)?.backend().name())
}

/// Gives the whole pages inside a contiguous tensor's memory back to the OS: its contents
/// become zeros, and it stops counting in the process's resident memory until written again.
#[pyfunction]
pub fn discard_memory(tensor: &Bound<'_, PyAny>) -> PyResult<()> {
    let imp = Import::new(tensor, "tensor")?;
    if !imp.contiguous {
        return Err(value_error("tensor: must be contiguous"));
    }
    imp.discard().map_err(err)
}
