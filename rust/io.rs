//! The I/O engine of the NVMe tier: reads and writes of aligned host buffers at file offsets,
//! several requests in flight, on one of two backends chosen at run time:
//!
//! - `uring`: one driver thread owns an io_uring, submits the requests' chunks and reaps their
//!   completions (short transfers are resubmitted for the rest);
//! - `threads`: a few threads doing plain `pread`/`pwrite`, for where io_uring is refused
//!   (containers often block it by seccomp).
//!
//! Files are opened with `O_DIRECT` where the filesystem accepts it (no page-cache copy of the
//! state); where it does not (tmpfs), buffered, with the page cache dropped behind each
//! transfer. A request's completion is a [`Ticket`]; an error names the file, the offset and
//! the errno. A test-only fault seam fails the n-th read, write or allocation with a chosen
//! errno. [`Engine::close`] gives everything back at once: it waits for the transfers queued,
//! stops the threads (and the io_uring), and closes every file; later use is an error.
//! Files are created with `O_NOFOLLOW`: a symlink planted under a file's name is refused, never
//! followed.
//!
//! The engine does not own the memory it transfers: a request carries an address and a length,
//! and the caller keeps that memory alive and untouched until the ticket completes (the binding
//! layer holds a reference to the tensor in the ticket).

use std::ffi::CString;
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender, TryRecvError};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use crate::error::{Error, Result};

/// Buffers, lengths and file offsets of `O_DIRECT` transfers are multiples of this.
pub const ALIGN: usize = 4096;
/// Requests are cut into chunks of at most this many bytes (several in flight per request).
pub const CHUNK: usize = 1 << 20;
/// Threads of the `threads` backend.
const THREADS: usize = 4;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    Uring,
    Threads,
}

impl Backend {
    pub fn name(self) -> &'static str {
        match self {
            Backend::Uring => "uring",
            Backend::Threads => "threads",
        }
    }
}

/// One transfer: `len` bytes between memory at `addr` and file `file` at `offset`.
#[derive(Clone, Copy, Debug)]
pub struct Request {
    pub write: bool,
    pub file: usize,
    pub addr: usize,
    pub len: usize,
    pub offset: u64,
}

#[derive(Default)]
struct TicketState {
    remaining: usize,
    error: Option<Error>, // the first of its transfers', an `Error::Io`
}

/// The completion of a batch of requests.
#[derive(Clone)]
pub struct Ticket(Arc<(Mutex<TicketState>, Condvar)>);

impl Ticket {
    fn new(n: usize) -> Ticket {
        Ticket(Arc::new((
            Mutex::new(TicketState {
                remaining: n,
                error: None,
            }),
            Condvar::new(),
        )))
    }

    fn finish(&self, error: Option<Error>) {
        let (m, cv) = &*self.0;
        let mut s = m.lock().unwrap_or_else(|e| e.into_inner());
        if s.error.is_none() {
            s.error = error;
        }
        s.remaining -= 1;
        if s.remaining == 0 {
            cv.notify_all();
        }
    }

    pub fn done(&self) -> bool {
        self.0 .0.lock().unwrap_or_else(|e| e.into_inner()).remaining == 0
    }

    /// Blocks until every transfer of the ticket has finished; the first error, if any.
    pub fn wait(&self) -> Result<()> {
        let (m, cv) = &*self.0;
        let mut s = m.lock().unwrap_or_else(|e| e.into_inner());
        while s.remaining > 0 {
            s = cv.wait(s).unwrap_or_else(|e| e.into_inner());
        }
        match &s.error {
            None => Ok(()),
            Some(e) => Err(e.clone()),
        }
    }
}

struct OpenFile {
    file: File,
    path: String,
    direct: bool,
}

/// A chunk of a request, with what the worker needs to do and report it.
struct Chunk {
    req: Request,
    fd: i32,
    direct: bool,
    path: Arc<str>,
    ticket: Ticket,
    fault: Option<i32>,
}

impl Chunk {
    fn error(&self, errno: i32) -> Error {
        let what = if self.req.write { "write" } else { "read" };
        let text = std::io::Error::from_raw_os_error(errno);
        Error::Io(
            errno,
            format!(
                "{what} of {} bytes at offset {} of {} failed: {text} (errno {errno})",
                self.req.len, self.req.offset, self.path
            ),
        )
    }

    fn short(&self, done: usize) -> Error {
        Error::Io(
            libc::EIO,
            format!(
                "read of {} bytes at offset {} of {}: the file ends after {done} bytes (truncated)",
                self.req.len, self.req.offset, self.path
            ),
        )
    }

    /// Buffered files: drop the transferred range from the page cache (the state must not
    /// occupy RAM twice).
    fn drop_cache(&self) {
        if !self.direct {
            // SAFETY: plain syscall on a file descriptor we own; advisory, its result is ignored.
            unsafe {
                libc::posix_fadvise(
                    self.fd,
                    self.req.offset as i64,
                    self.req.len as i64,
                    libc::POSIX_FADV_DONTNEED,
                );
            }
        }
    }
}

/// What the fault seam fails: a read, a write, or an allocation (`Engine::open`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Read,
    Write,
    Open,
}

#[derive(Default)]
struct Faults {
    // (operation, errno, operations of that kind to let through first)
    armed: Option<(Op, i32, u64)>,
}

/// The I/O engine (see the module documentation).
pub struct Engine {
    backend: Backend,
    files: Mutex<Vec<Option<OpenFile>>>,
    // None once closed. Held while chunks are sent, so that `close` (which takes it) sees every
    // chunk queued before it, and the workers drain them all before they stop.
    tx: Mutex<Option<Sender<Chunk>>>,
    workers: Mutex<Vec<JoinHandle<()>>>,
    closed: AtomicBool,
    faults: Mutex<Faults>,
    pub bytes_read: AtomicU64,
    pub bytes_written: AtomicU64,
}

fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO)
}

impl Engine {
    /// `backend` None: io_uring where the kernel allows it, else threads (`OFFLOAD_ADAM_IO`
    /// overrides, `uring` or `threads`). `depth`: transfers in flight.
    pub fn new(backend: Option<Backend>, depth: usize) -> Result<Engine> {
        let depth = depth.clamp(1, 256);
        let want = match backend {
            Some(b) => Some(b),
            None => match std::env::var("OFFLOAD_ADAM_IO").ok().as_deref().map(str::trim) {
                None | Some("") => None,
                Some("uring") => Some(Backend::Uring),
                Some("threads") => Some(Backend::Threads),
                Some(other) => {
                    return Err(Error::Value(format!(
                        "OFFLOAD_ADAM_IO must be 'uring' or 'threads', got {other:?}"
                    )))
                }
            },
        };
        let (tx, rx) = channel::<Chunk>();
        let mut workers = Vec::new();
        let spawn = |name: &str, f: Box<dyn FnOnce() + Send>| {
            std::thread::Builder::new()
                .name(name.into())
                .spawn(f)
                .map_err(|e| Error::Runtime(format!("cannot start an I/O thread: {e}")))
        };
        let ring = match want {
            Some(Backend::Threads) => None,
            _ => match io_uring::IoUring::new(depth.next_power_of_two() as u32) {
                Ok(ring) => Some(ring),
                Err(e) if want == Some(Backend::Uring) => {
                    return Err(Error::Runtime(format!(
                        "OFFLOAD_ADAM_IO=uring: io_uring is not available here: {e}"
                    )))
                }
                Err(_) => None,
            },
        };
        let backend = match ring {
            Some(ring) => {
                workers.push(spawn(
                    "offload-adam-uring",
                    Box::new(move || uring_driver(ring, rx, depth)),
                )?);
                Backend::Uring
            }
            None => {
                let rx = Arc::new(Mutex::new(rx));
                for _ in 0..depth.min(THREADS) {
                    let rx = rx.clone();
                    workers.push(spawn("offload-adam-io", Box::new(move || thread_worker(&rx)))?);
                }
                Backend::Threads
            }
        };
        Ok(Engine {
            backend,
            files: Mutex::new(Vec::new()),
            tx: Mutex::new(Some(tx)),
            workers: Mutex::new(workers),
            closed: AtomicBool::new(false),
            faults: Mutex::new(Faults::default()),
            bytes_read: AtomicU64::new(0),
            bytes_written: AtomicU64::new(0),
        })
    }

    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// Whether [`Engine::close`] has run.
    pub fn closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    fn check_open(&self) -> Result<()> {
        if self.closed() {
            return Err(Error::Runtime("the I/O engine is closed".into()));
        }
        Ok(())
    }

    /// Gives back what the engine holds: waits for every transfer queued, stops its threads
    /// (the io_uring's descriptor goes with its driver) and closes every file. Idempotent;
    /// afterwards `open`, `open_read` and `submit` are errors.
    pub fn close(&self) {
        self.closed.store(true, Ordering::Release);
        // The workers see the channel closed once they have drained the chunks queued.
        drop(self.tx.lock().unwrap_or_else(|e| e.into_inner()).take());
        let workers: Vec<_> = self
            .workers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain(..)
            .collect();
        for w in workers {
            let _ = w.join();
        }
        // No chunk holds a descriptor any more: close them all.
        self.files.lock().unwrap_or_else(|e| e.into_inner()).clear();
    }

    /// Opens (creating it) `path` and makes it `size` bytes long, its blocks allocated. Returns
    /// the file's index for [`Request::file`].
    pub fn open(&self, path: &str, size: u64) -> Result<usize> {
        self.check_open()?;
        let c = CString::new(path).map_err(|_| Error::Value(format!("{path:?}: contains a NUL byte")))?;
        let flags = libc::O_RDWR | libc::O_CREAT | libc::O_CLOEXEC | libc::O_NOFOLLOW;
        // SAFETY: plain syscalls with a NUL-terminated path; the descriptor is owned by a File.
        let (fd, direct) = unsafe {
            let fd = libc::open(c.as_ptr(), flags | libc::O_DIRECT, 0o600);
            if fd >= 0 {
                (fd, true)
            } else {
                let fd = libc::open(c.as_ptr(), flags, 0o600);
                if fd < 0 {
                    let e = errno();
                    return Err(Error::Io(
                        e,
                        format!("cannot open {path}: {}", std::io::Error::from_raw_os_error(e)),
                    ));
                }
                (fd, false)
            }
        };
        // SAFETY: `fd` is a fresh descriptor nobody else owns.
        let file = unsafe { File::from_raw_fd(fd) };
        if size > 0 {
            let r = match self.fault_for(Op::Open) {
                Some(e) => e,
                // SAFETY: plain syscall on our descriptor.
                None => unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, size as i64) },
            };
            if r != 0 {
                return Err(Error::Io(
                    r,
                    format!(
                        "cannot allocate {size} bytes for {path}: {}",
                        std::io::Error::from_raw_os_error(r)
                    ),
                ));
            }
        }
        let mut files = self.files.lock().unwrap_or_else(|e| e.into_inner());
        files.push(Some(OpenFile {
            file,
            path: path.to_string(),
            direct,
        }));
        Ok(files.len() - 1)
    }

    /// Opens the existing file `path` read-only, buffered (its transfers need no alignment: a
    /// checkpoint's tensors sit at any offset), the page cache dropped behind each read.
    /// Returns the file's index and its size in bytes.
    pub fn open_read(&self, path: &str) -> Result<(usize, u64)> {
        self.check_open()?;
        let file = File::open(path).map_err(|e| {
            Error::Io(
                e.raw_os_error().unwrap_or(libc::EIO),
                format!("cannot open {path}: {e}"),
            )
        })?;
        let size = file
            .metadata()
            .map_err(|e| Error::Io(e.raw_os_error().unwrap_or(libc::EIO), format!("{path}: {e}")))?
            .len();
        let mut files = self.files.lock().unwrap_or_else(|e| e.into_inner());
        files.push(Some(OpenFile {
            file,
            path: path.to_string(),
            direct: false,
        }));
        Ok((files.len() - 1, size))
    }

    /// Whether file `id` was opened with `O_DIRECT`.
    pub fn direct(&self, id: usize) -> Result<bool> {
        let files = self.files.lock().unwrap_or_else(|e| e.into_inner());
        match files.get(id) {
            Some(Some(f)) => Ok(f.direct),
            _ => {
                self.check_open()?;
                Err(Error::Value(format!("no open file {id}")))
            }
        }
    }

    /// Closes file `id` (the caller has waited for its transfers).
    pub fn close_file(&self, id: usize) {
        let mut files = self.files.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(slot) = files.get_mut(id) {
            *slot = None;
        }
    }

    /// Test-only: the operation `op` after `after` more of them fails with `errno` (once; an
    /// `Open` fails its allocation, as `posix_fallocate` on a full disk); `errno` 0 disarms.
    pub fn inject_fault(&self, op: Op, errno: i32, after: u64) {
        let mut f = self.faults.lock().unwrap_or_else(|e| e.into_inner());
        f.armed = if errno == 0 { None } else { Some((op, errno, after)) };
    }

    fn fault_for(&self, op: Op) -> Option<i32> {
        let mut f = self.faults.lock().unwrap_or_else(|e| e.into_inner());
        match f.armed {
            Some((o, e, 0)) if o == op => {
                f.armed = None;
                Some(e)
            }
            Some((o, e, n)) if o == op => {
                f.armed = Some((o, e, n - 1));
                None
            }
            _ => None,
        }
    }

    /// Queues `reqs`; the ticket completes when all have. Direct files need `ALIGN`-aligned
    /// addresses, lengths and offsets (checked here, before anything is queued).
    ///
    /// # Safety
    /// Each request's memory stays valid, and is neither read (for a read) nor written (for
    /// either) by anyone else, until the ticket completes: the kernel or the I/O threads write
    /// into it (reads) or read it (writes) after this returns.
    pub unsafe fn submit(&self, reqs: &[Request]) -> Result<Ticket> {
        self.check_open()?;
        let files = self.files.lock().unwrap_or_else(|e| e.into_inner());
        let mut chunks = Vec::new();
        for r in reqs {
            let f = match files.get(r.file) {
                Some(Some(f)) => f,
                _ => return Err(Error::Value(format!("no open file {}", r.file))),
            };
            if f.direct && (r.addr % ALIGN != 0 || r.len % ALIGN != 0 || r.offset % ALIGN as u64 != 0) {
                return Err(Error::Value(format!(
                    "{}: O_DIRECT transfer not aligned to {ALIGN} bytes (address {:#x}, {} bytes at offset {})",
                    f.path, r.addr, r.len, r.offset
                )));
            }
            let path: Arc<str> = Arc::from(f.path.as_str());
            let mut done = 0;
            while done < r.len || (r.len == 0 && done == 0) {
                let n = (r.len - done).min(CHUNK);
                chunks.push((
                    Request {
                        write: r.write,
                        file: r.file,
                        addr: r.addr + done,
                        len: n,
                        offset: r.offset + done as u64,
                    },
                    f.file.as_raw_fd(),
                    f.direct,
                    path.clone(),
                ));
                if n == 0 {
                    break;
                }
                done += n;
            }
        }
        drop(files);
        let ticket = Ticket::new(chunks.len().max(1));
        if chunks.is_empty() {
            ticket.finish(None);
            return Ok(ticket);
        }
        let tx = self.tx.lock().unwrap_or_else(|e| e.into_inner());
        let tx = tx
            .as_ref()
            .ok_or_else(|| Error::Runtime("the I/O engine is closed".into()))?;
        for (req, fd, direct, path) in chunks {
            let fault = self.fault_for(if req.write { Op::Write } else { Op::Read });
            let counter = if req.write {
                &self.bytes_written
            } else {
                &self.bytes_read
            };
            counter.fetch_add(req.len as u64, Ordering::Relaxed);
            let c = Chunk {
                req,
                fd,
                direct,
                path,
                ticket: ticket.clone(),
                fault,
            };
            if tx.send(c).is_err() {
                return Err(Error::Runtime("the I/O engine's threads have stopped".into()));
            }
        }
        Ok(ticket)
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.close();
    }
}

/// One chunk with `pread`/`pwrite`, looping over short transfers.
fn run_blocking(c: &Chunk) -> Option<Error> {
    if let Some(e) = c.fault {
        return Some(c.error(e));
    }
    let mut done = 0usize;
    while done < c.req.len {
        let (addr, n, off) = (c.req.addr + done, c.req.len - done, c.req.offset as i64 + done as i64);
        // SAFETY: the submitter guarantees [addr, addr + len) is valid and exclusively ours
        // until the ticket completes (Engine::submit).
        let r = unsafe {
            if c.req.write {
                libc::pwrite(c.fd, addr as *const libc::c_void, n, off)
            } else {
                libc::pread(c.fd, addr as *mut libc::c_void, n, off)
            }
        };
        if r < 0 {
            let e = errno();
            if e == libc::EINTR {
                continue;
            }
            return Some(c.error(e));
        }
        if r == 0 {
            return Some(c.short(done));
        }
        done += r as usize;
    }
    c.drop_cache();
    None
}

/// The threads backend: take a chunk, transfer it, report it.
fn thread_worker(rx: &Mutex<Receiver<Chunk>>) {
    loop {
        let c = match rx.lock().unwrap_or_else(|e| e.into_inner()).recv() {
            Ok(c) => c,
            Err(_) => return, // the engine is gone
        };
        let e = run_blocking(&c);
        c.ticket.finish(e);
    }
}

/// The io_uring backend: keeps up to `depth` chunks in flight; a short transfer is resubmitted
/// for its rest, an error completes the chunk with its errno.
fn uring_driver(mut ring: io_uring::IoUring, rx: Receiver<Chunk>, depth: usize) {
    use io_uring::{opcode, types};
    // In flight, by slot: the chunk and how many of its bytes are done.
    let mut slots: Vec<Option<(Chunk, usize)>> = (0..depth).map(|_| None).collect();
    let mut free: Vec<usize> = (0..depth).rev().collect();
    let mut open = true;
    loop {
        // Fill the free slots: block for the first chunk only when nothing is in flight.
        while let Some(&slot) = free.last() {
            let c = if free.len() == depth {
                if !open {
                    return;
                }
                match rx.recv() {
                    Ok(c) => c,
                    Err(_) => return,
                }
            } else {
                match rx.try_recv() {
                    Ok(c) => c,
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => {
                        open = false;
                        break;
                    }
                }
            };
            if let Some(e) = c.fault {
                let err = c.error(e);
                c.ticket.finish(Some(err));
                continue;
            }
            if c.req.len == 0 {
                c.ticket.finish(None);
                continue;
            }
            free.pop();
            slots[slot] = Some((c, 0));
            push_sqe(&mut ring, &slots, slot);
        }
        if free.len() == depth {
            continue;
        }
        if let Err(e) = ring.submit_and_wait(1) {
            if e.raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            // The ring is broken: finish everything in flight with the error.
            let errno = e.raw_os_error().unwrap_or(libc::EIO);
            for s in slots.iter_mut() {
                if let Some((c, _)) = s.take() {
                    let err = c.error(errno);
                    c.ticket.finish(Some(err));
                }
            }
            free = (0..depth).rev().collect();
            continue;
        }
        let done: Vec<(u64, i32)> = ring.completion().map(|cqe| (cqe.user_data(), cqe.result())).collect();
        for (slot, res) in done {
            let slot = slot as usize;
            let Some((c, mut got)) = slots[slot].take() else {
                continue;
            };
            if res == -libc::EINTR || res == -libc::EAGAIN {
                slots[slot] = Some((c, got));
                push_sqe(&mut ring, &slots, slot);
                continue;
            }
            let outcome = if res < 0 {
                Some(Some(c.error(-res)))
            } else if res == 0 && got < c.req.len {
                Some(Some(c.short(got)))
            } else {
                got += res as usize;
                if got < c.req.len {
                    None
                } else {
                    Some(None)
                }
            };
            match outcome {
                None => {
                    slots[slot] = Some((c, got));
                    push_sqe(&mut ring, &slots, slot);
                }
                Some(err) => {
                    if err.is_none() {
                        c.drop_cache();
                    }
                    c.ticket.finish(err);
                    free.push(slot);
                }
            }
        }
    }

    fn push_sqe(ring: &mut io_uring::IoUring, slots: &[Option<(Chunk, usize)>], slot: usize) {
        let (c, got) = slots[slot].as_ref().expect("a chunk in this slot");
        let (addr, n, off) = (c.req.addr + got, (c.req.len - got) as u32, c.req.offset + *got as u64);
        let e = if c.req.write {
            opcode::Write::new(types::Fd(c.fd), addr as *const u8, n)
                .offset(off)
                .build()
        } else {
            opcode::Read::new(types::Fd(c.fd), addr as *mut u8, n)
                .offset(off)
                .build()
        }
        .user_data(slot as u64);
        // SAFETY: the buffer stays valid and exclusively the transfer's until its completion
        // (Engine::submit's contract); the queue has room: at most `depth` entries are in
        // flight and the ring has at least `depth` entries.
        unsafe {
            ring.submission().push(&e).expect("a free submission entry");
        }
    }
}

/// CRC-32C of a byte buffer (hardware-accelerated where the CPU has it).
pub fn crc32c(bytes: &[u8]) -> u32 {
    crc32c::crc32c(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Aligned(Vec<u8>, usize);
    impl Aligned {
        fn new(n: usize) -> Aligned {
            let v = vec![0u8; n + ALIGN];
            let off = (ALIGN - v.as_ptr() as usize % ALIGN) % ALIGN;
            Aligned(v, off)
        }
        fn buf(&mut self, n: usize) -> &mut [u8] {
            &mut self.0[self.1..self.1 + n]
        }
    }

    fn roundtrip(backend: Backend) {
        let dir = std::env::temp_dir().join(format!(
            "offload-adam-io-test-{}-{}",
            std::process::id(),
            backend.name()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("f.bin");
        let eng = match Engine::new(Some(backend), 8) {
            Ok(e) => e,
            Err(_) if backend == Backend::Uring => return, // not allowed here
            Err(e) => panic!("{e}"),
        };
        let n = 3 * CHUNK + 2 * ALIGN;
        let f = eng.open(path.to_str().unwrap(), n as u64).unwrap();
        let mut a = Aligned::new(n);
        for (i, b) in a.buf(n).iter_mut().enumerate() {
            *b = (i * 7 % 251) as u8;
        }
        let crc = crc32c(a.buf(n));
        let transfer = |write: bool, addr: usize, len: usize, offset: u64| {
            let req = Request {
                write,
                file: f,
                addr,
                len,
                offset,
            };
            // SAFETY: the buffers outlive the wait, and nothing else touches them.
            unsafe { eng.submit(&[req]) }.unwrap().wait()
        };
        transfer(true, a.buf(n).as_ptr() as usize, n, 0).unwrap();
        let mut b = Aligned::new(n);
        let addr = b.buf(n).as_ptr() as usize;
        transfer(false, addr, n, 0).unwrap();
        assert_eq!(crc32c(b.buf(n)), crc);
        // A fault: the next read fails with the errno, naming the file.
        eng.inject_fault(Op::Read, libc::EIO, 0);
        let e = transfer(false, addr, ALIGN, 0).unwrap_err();
        assert!(matches!(e, Error::Io(libc::EIO, _)), "{e:?}");
        assert!(e.message().contains("f.bin"), "{e}");
        // Reading past the end is a truncation error, not silent zeros.
        let e = transfer(false, addr, ALIGN, n as u64).unwrap_err();
        assert!(e.message().contains("truncated"), "{e}");
        // An existing file opened to read: any offset, any length, any address.
        let (r, size) = eng.open_read(path.to_str().unwrap()).unwrap();
        assert_eq!(size, n as u64);
        let mut c = vec![0u8; 1001];
        let req = Request {
            write: false,
            file: r,
            addr: c.as_mut_ptr() as usize + 1,
            len: 1000,
            offset: 13,
        };
        // SAFETY: as above.
        unsafe { eng.submit(&[req]) }.unwrap().wait().unwrap();
        assert_eq!(&c[1..], &a.buf(n)[13..1013]);
        assert!(eng.open_read(dir.join("missing").to_str().unwrap()).is_err());
        drop(eng);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    fn scratch(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("offload-adam-io-test-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// Descriptors of this process open on `path`.
    fn fds_on(path: &std::path::Path) -> usize {
        std::fs::read_dir("/proc/self/fd")
            .unwrap()
            .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
            .filter(|l| l == path)
            .count()
    }

    #[test]
    fn close_waits_the_queue_closes_every_file_and_refuses_later_use() {
        let dir = scratch("close");
        let path = dir.join("f.bin");
        let eng = Engine::new(Some(Backend::Threads), 4).unwrap();
        let n = 2 * CHUNK;
        let f = eng.open(path.to_str().unwrap(), n as u64).unwrap();
        let (r, _) = eng.open_read(path.to_str().unwrap()).unwrap();
        assert_eq!(fds_on(&path), 2);
        let mut a = Aligned::new(n);
        a.buf(n).fill(7);
        let req = Request {
            write: true,
            file: f,
            addr: a.buf(n).as_ptr() as usize,
            len: n,
            offset: 0,
        };
        // SAFETY: the buffer outlives the wait below, and nothing else touches it.
        let ticket = unsafe { eng.submit(&[req]) }.unwrap();
        eng.close(); // with the write still queued: it completes first
        ticket.wait().unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), vec![7u8; n]);
        assert_eq!(fds_on(&path), 0);
        assert!(eng.closed());
        for e in [
            eng.open(dir.join("g.bin").to_str().unwrap(), 0).unwrap_err(),
            eng.open_read(path.to_str().unwrap()).unwrap_err(),
            // SAFETY: refused before anything is queued.
            unsafe { eng.submit(&[req]) }.err().expect("refused"),
            eng.direct(r).unwrap_err(),
        ] {
            assert!(e.message().contains("the I/O engine is closed"), "{e}");
        }
        assert!(!dir.join("g.bin").exists());
        eng.close(); // a second close: nothing to do
        drop(eng);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_symlink_is_not_followed_and_an_allocation_fault_is_an_enospc() {
        let dir = scratch("nofollow");
        let target = dir.join("elsewhere");
        let link = dir.join("f.bin");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        let eng = Engine::new(Some(Backend::Threads), 4).unwrap();
        let e = eng.open(link.to_str().unwrap(), ALIGN as u64).unwrap_err();
        assert!(matches!(e, Error::Io(libc::ELOOP, _)), "{e:?}");
        assert!(!target.exists());
        eng.inject_fault(Op::Open, libc::ENOSPC, 1);
        eng.open(dir.join("a.bin").to_str().unwrap(), ALIGN as u64).unwrap();
        let e = eng.open(dir.join("b.bin").to_str().unwrap(), ALIGN as u64).unwrap_err();
        assert!(matches!(e, Error::Io(libc::ENOSPC, _)), "{e:?}");
        assert!(
            e.message().contains("cannot allocate 4096 bytes for") && e.message().contains("b.bin"),
            "{e}"
        );
        eng.open(dir.join("c.bin").to_str().unwrap(), ALIGN as u64).unwrap(); // once
        drop(eng);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn threads_roundtrip() {
        roundtrip(Backend::Threads);
    }

    #[test]
    fn uring_roundtrip() {
        roundtrip(Backend::Uring);
    }
}
