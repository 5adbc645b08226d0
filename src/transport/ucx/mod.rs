//! The UCX agent: the only module with `unsafe` and the only one that calls UCX.
//!
//! # Threading
//! One progress thread owns the UCX worker (`UCS_THREAD_MODE_SINGLE`): every UCX call on the
//! worker, its endpoints and its requests happens on that thread. Other threads talk to it through
//! a command queue and an `eventfd`. When there is nothing to do the progress thread sleeps in
//! `epoll_wait` on the worker's event fd (`ucp_worker_arm`) and the eventfd, with a bounded
//! timeout so UCX keepalive still runs. Nothing spins: after many wake-ups in a row that make no
//! progress, the loop backs off (the tcp spin trap described in TOOLCHAIN.md).
//!
//! # Completion bound to the request
//! Data moves with tag-matched two-sided operations. A receive is posted into the caller's buffer
//! under a 64-bit tag; its own completion is the data's arrival, checked for length. There is no
//! separate "done" message. A send completes when UCX completes the send request.
//!
//! # Waits
//! Every wait ([`Op::wait`]) takes a deadline and an optional cancel check and returns an
//! [`Outcome`]. A wait that does not complete cancels its UCX request and waits (bounded) until
//! UCX has released it, so that the buffer can no longer be written when the wait returns; if the
//! request cannot be reaped in time the endpoint is force-closed, and if even that does not
//! release it the op reports itself as not quiesced ([`Op::is_quiesced`]) so the owner fences the
//! buffer instead of reusing it.
//!
//! # Peer failure
//! Endpoints are created with peer error handling. The UCX error callback moves the peer to the
//! failed state, which every later operation checks, and the progress thread cancels the posted
//! receives that belong to that peer (UCX does not complete unmatched receives on its own).
mod handles;
mod sys;

use handles::{Context, Endpoint, Listener, Mapped, RemoteKey as UcxRkey, Worker};

use crate::error::{Error, ErrorKind, Outcome, Result};
use parking_lot::{Condvar, Mutex, MutexGuard};
use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::ffi::{c_void, CString};
use std::net::SocketAddr;
use std::os::raw::c_int;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Which UCX transports an agent may use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TransportKind {
    /// TCP sockets (on loopback in tests).
    Tcp,
    /// Shared memory (posix/sysv) between processes on one host; connect by worker address.
    SharedMemory,
}

impl TransportKind {
    fn tls(self) -> &'static str {
        match self {
            TransportKind::Tcp => "tcp",
            // cma is left out: it is slower for large tag transfers here (TOOLCHAIN.md).
            TransportKind::SharedMemory => "posix,sysv,self",
        }
    }
    pub fn parse(s: &str) -> Result<TransportKind> {
        match s.to_ascii_lowercase().as_str() {
            "tcp" => Ok(TransportKind::Tcp),
            "sm" | "shm" | "shared-memory" => Ok(TransportKind::SharedMemory),
            _ => Err(Error::invalid(format!(
                "unknown transport '{s}' (expected tcp or sm)"
            ))),
        }
    }
}

/// Options for one agent.
#[derive(Clone, Debug)]
pub struct AgentOptions {
    pub name: String,
    pub transport: TransportKind,
    /// Listen on this `ip:port` (port 0 picks one) for incoming connections.
    pub listen: Option<SocketAddr>,
    /// UCX keepalive interval: how fast a dead peer is found when no operation is pending.
    pub keepalive: Duration,
    /// How long a wait that gave up may spend getting UCX to release its request.
    pub reap_grace: Duration,
}

impl AgentOptions {
    pub fn new(name: impl Into<String>, transport: TransportKind) -> Self {
        AgentOptions {
            name: name.into(),
            transport,
            listen: None,
            keepalive: Duration::from_secs(1),
            reap_grace: Duration::from_secs(2),
        }
    }
}

/// Local handle of a connected peer endpoint. Never reused within one agent.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PeerId(pub u64);

/// What the progress thread tells its owner.
#[derive(Debug)]
pub enum Event {
    /// A peer connected to our listener.
    Accepted(PeerId),
    /// A control message arrived from a peer.
    Control(PeerId, Vec<u8>),
    /// A peer's endpoint failed; every later operation on it fails with `PeerLost`.
    PeerFailed(PeerId),
    /// An op posted with `notify` has ended; [`Op::poll`] has its result.
    OpDone(u64),
}

/// Progress counters: these tell "alive" from "working".
#[derive(Clone, Debug, Default)]
pub struct Stats {
    pub ops_started: u64,
    pub ops_completed: u64,
    pub ops_failed: u64,
    pub in_flight: u64,
    pub bytes_completed: u64,
    /// Time since the last completed op, if any op has completed.
    pub since_last_completion: Option<Duration>,
    /// Age of the oldest op still in flight.
    pub oldest_in_flight: Option<Duration>,
    /// Ops whose UCX request could not be reaped: their buffers must be fenced, not reused.
    pub unreaped: u64,
    pub wakeups: u64,
    pub empty_wakeups: u64,
    pub backoffs: u64,
    pub stale_control_dropped: u64,
}

/// Why an op was asked to stop, recorded before the UCX cancel so its completion maps to the
/// right outcome.
const STOP_NONE: u8 = 0;
const STOP_TIMEOUT: u8 = 1;
const STOP_CANCEL: u8 = 2;
const STOP_PEER: u8 = 3;
const STOP_SHUTDOWN: u8 = 4;
/// The sending peer gave up on this transfer and asked us to drain it.
const STOP_REMOTE_CANCEL: u8 = 5;

/// What an op is: data (a tag send or receive) or a control message.
#[derive(Clone, Copy, PartialEq, Eq)]
enum SlotKind {
    Send,
    Recv,
    Control,
    /// A one-sided put or get, completed by the endpoint flush that follows it.
    Rma,
}

/// The completion slot of one in-flight operation, shared by the waiter and the progress thread.
struct OpSlot {
    id: u64,
    peer: PeerId,
    expected_len: usize,
    /// The UCX tag, and whether this is a send (a send's cancel asks the peer to drain it).
    tag: u64,
    send: bool,
    /// Push [`Event::OpDone`] when this op ends (for drivers that multiplex many ops).
    notify: bool,
    /// A control message, not data: kept out of the data progress counters.
    control: bool,
    started: Instant,
    state: Mutex<Option<(sys::ucs_status_t, usize)>>,
    cv: Condvar,
    /// The UCX request handle while UCX owns it; only touched on the progress thread.
    request: AtomicPtr<c_void>,
    stop_reason: AtomicU8,
}

impl OpSlot {
    fn complete(&self, status: sys::ucs_status_t, len: usize) {
        let mut st = self.state.lock();
        if st.is_none() {
            *st = Some((status, len));
        }
        drop(st);
        self.cv.notify_all();
    }
}

/// An in-flight send or receive. Dropping it before it ends cancels and reaps it (bounded).
pub struct Op {
    slot: Arc<OpSlot>,
    shared: Arc<Shared>,
    finished: bool,
    quiesced: bool,
}

impl Op {
    /// Waits until the op ends, `deadline` passes, or `cancel()` returns true (checked every
    /// `CANCEL_POLL`). Returns `Completed` only when the whole transfer has landed. On any other
    /// outcome the UCX request has been cancelled and released before this returns: UCX no
    /// longer touches the buffer (see [`Op::stop`] for the bound on that).
    pub fn wait(
        &mut self,
        deadline: Instant,
        cancel: Option<&dyn Fn() -> bool>,
    ) -> Result<Outcome> {
        const CANCEL_POLL: Duration = Duration::from_millis(5);
        let mut st = self.slot.state.lock();
        let stop = loop {
            if let Some((status, len)) = *st {
                drop(st);
                return self.finish(status, len);
            }
            if let Some(c) = cancel {
                // The check may take other locks (the engine's): never call it under ours.
                if MutexGuard::unlocked(&mut st, c) {
                    break STOP_CANCEL;
                }
                if st.is_some() {
                    continue;
                }
            }
            let now = Instant::now();
            if now >= deadline {
                break STOP_TIMEOUT;
            }
            let mut until = deadline;
            if cancel.is_some() {
                until = until.min(now + CANCEL_POLL);
            }
            // The lock is released while waiting (condvar); no lock is held across the wait.
            self.slot.cv.wait_until(&mut st, until);
        };
        drop(st);
        self.stop(stop);
        let (status, len) = self.slot.state.lock().unwrap_or((sys::UCS_ERR_CANCELED, 0));
        // A receive that completed in the race with the stop has all its data: it counts. A send
        // that completed after we asked the peer to drain it may have been discarded: it does not.
        if status == sys::UCS_OK && self.quiesced && !self.slot.send {
            return self.finish(status, len);
        }
        self.finished = true;
        Ok(match stop {
            STOP_CANCEL => Outcome::Cancelled,
            _ => Outcome::TimedOut,
        })
    }

    /// The op's id (as in [`Event::OpDone`]).
    pub fn id(&self) -> u64 {
        self.slot.id
    }

    /// The result if the op has ended, without waiting.
    pub fn poll(&mut self) -> Option<Result<Outcome>> {
        let done = *self.slot.state.lock();
        done.map(|(status, len)| {
            let stopped = self.slot.stop_reason.load(Ordering::Acquire);
            if self.slot.send && status == sys::UCS_OK && stopped != STOP_NONE {
                // Completed only because the receiver drained it: not delivered.
                self.finished = true;
                self.quiesced = true;
                return Ok(if stopped == STOP_TIMEOUT {
                    Outcome::TimedOut
                } else {
                    Outcome::Cancelled
                });
            }
            self.finish(status, len)
        })
    }

    /// Asks for the op to be cancelled without waiting; its end is reported as usual (by
    /// [`Event::OpDone`] when posted with `notify`). A receive is reaped within microseconds; a
    /// send is drained by its receiver.
    pub fn request_cancel(&self) {
        let _ = self.slot.stop_reason.compare_exchange(
            STOP_NONE,
            STOP_CANCEL,
            Ordering::AcqRel,
            Ordering::Acquire,
        );
        let _ = self.shared.submit(Cmd::CancelOp(self.slot.id));
    }

    /// True once UCX can no longer write into (or read from) the op's buffer.
    pub fn is_quiesced(&self) -> bool {
        self.quiesced || self.slot.state.lock().is_some()
    }

    /// Sets the stop reason, asks the progress thread to cancel, and waits (bounded) for UCX to
    /// release the request; force-closes the endpoint if the cancel alone does not.
    fn stop(&mut self, reason: u8) {
        let _ = self.slot.stop_reason.compare_exchange(
            STOP_NONE,
            reason,
            Ordering::AcqRel,
            Ordering::Acquire,
        );
        let grace = self.shared.reap_grace;
        // Stage 1: cancel (a send is drained by its receiver). Stage 2: force-close the
        // endpoint, which ends every request on it. Stage 3: shutdown of the agent, if under
        // way, completes everything. The buffer is never handed back while UCX holds it.
        for cmd in [
            Cmd::CancelOp(self.slot.id),
            Cmd::ForceClose(self.slot.peer, None),
        ] {
            if self.slot.state.lock().is_some() {
                break;
            }
            if self.shared.submit(cmd).is_err() {
                break;
            }
            self.wait_done(Instant::now() + grace);
        }
        if self.slot.state.lock().is_none() {
            // UCX broke its contract (a force-closed endpoint completes its requests). The wait
            // is a promise to the caller, so it is not held; the op stays counted as unreaped
            // (health shows it) and `is_quiesced` stays false so an owner that can fence the
            // memory does. No abort: a library must not end its host process.
            self.shared.stats.unreaped.fetch_add(1, Ordering::Relaxed);
            tracing::error!(
                op = self.slot.id,
                "UCX has not released a request after cancel and force-close"
            );
            return;
        }
        self.quiesced = true;
    }

    fn wait_done(&self, until: Instant) {
        let mut st = self.slot.state.lock();
        while st.is_none() && Instant::now() < until {
            self.slot.cv.wait_until(&mut st, until);
        }
    }

    fn finish(&mut self, status: sys::ucs_status_t, len: usize) -> Result<Outcome> {
        self.finished = true;
        self.quiesced = true;
        if status == sys::UCS_OK {
            if len != self.slot.expected_len {
                return Err(Error::new(
                    ErrorKind::Protocol,
                    format!(
                        "transfer size mismatch: expected {} bytes, {} arrived",
                        self.slot.expected_len, len
                    ),
                ));
            }
            return Ok(Outcome::Completed);
        }
        match self.slot.stop_reason.load(Ordering::Acquire) {
            STOP_CANCEL | STOP_REMOTE_CANCEL => return Ok(Outcome::Cancelled),
            STOP_TIMEOUT => return Ok(Outcome::TimedOut),
            STOP_PEER => return Ok(Outcome::PeerLost),
            STOP_SHUTDOWN => return Err(Error::new(ErrorKind::Shutdown, "agent shut down")),
            _ => {}
        }
        Err(map_status(status, "transfer")).or_else(|e: Error| {
            if e.kind == ErrorKind::PeerLost {
                Ok(Outcome::PeerLost)
            } else {
                Err(e)
            }
        })
    }
}

impl Drop for Op {
    fn drop(&mut self) {
        if !self.finished && self.slot.state.lock().is_none() {
            self.stop(STOP_CANCEL);
        }
    }
}

/// Maps a UCX status to kvlink's error kinds (one exhaustive place).
fn map_status(status: sys::ucs_status_t, what: &str) -> Error {
    let kind = match status {
        sys::UCS_ERR_MESSAGE_TRUNCATED => ErrorKind::Protocol,
        sys::UCS_ERR_INVALID_PARAM | sys::UCS_ERR_INVALID_ADDR => ErrorKind::InvalidArgument,
        sys::UCS_ERR_UNREACHABLE
        | sys::UCS_ERR_CONNECTION_RESET
        | sys::UCS_ERR_NOT_CONNECTED
        | sys::UCS_ERR_REJECTED => ErrorKind::PeerLost,
        s if (sys::UCS_ERR_LAST_ENDPOINT_FAILURE..=sys::UCS_ERR_FIRST_LINK_FAILURE)
            .contains(&s) =>
        {
            ErrorKind::PeerLost
        }
        _ => ErrorKind::Transport,
    };
    Error::new(kind, format!("{what}: UCX {}", sys::status_str(status)))
}

#[derive(Default)]
struct CmdQueue {
    items: VecDeque<Cmd>,
    /// Set by the progress thread's teardown: nothing is queued after it.
    closed: bool,
}

enum Cmd {
    Connect(SocketAddr, Arc<Reply<PeerId>>),
    ConnectWorker(Vec<u8>, Arc<Reply<PeerId>>),
    Tag {
        send: bool,
        peer: PeerId,
        tag: u64,
        addr: usize,
        len: usize,
        slot: Arc<OpSlot>,
    },
    Control {
        peer: PeerId,
        bytes: Vec<u8>,
        slot: Arc<OpSlot>,
    },
    CancelOp(u64),
    Map {
        addr: usize,
        len: usize,
        reply: Arc<Reply<(u64, Vec<u8>)>>,
    },
    Unmap(u64),
    UnpackRkey {
        peer: PeerId,
        packed: Vec<u8>,
        reply: Arc<Reply<u64>>,
    },
    DestroyRkey(u64),
    Rma {
        rkey: u64,
        put: bool,
        addr: usize,
        len: usize,
        remote: u64,
        slot: Arc<OpSlot>,
    },
    ForceClose(PeerId, Option<Arc<Reply<()>>>),
    Shutdown,
}

/// A one-shot reply from the progress thread.
struct Reply<T> {
    value: Mutex<Option<Result<T>>>,
    cv: Condvar,
}

impl<T> Reply<T> {
    fn new() -> Arc<Self> {
        Arc::new(Reply {
            value: Mutex::new(None),
            cv: Condvar::new(),
        })
    }
    fn set(&self, v: Result<T>) {
        *self.value.lock() = Some(v);
        self.cv.notify_all();
    }
    fn wait(&self, deadline: Instant) -> Result<T> {
        let mut v = self.value.lock();
        while v.is_none() {
            if self.cv.wait_until(&mut v, deadline).timed_out() && v.is_none() {
                return Err(Error::new(
                    ErrorKind::Transport,
                    "progress thread did not answer",
                ));
            }
        }
        v.take().unwrap()
    }
}

#[derive(Default)]
struct AtomicStats {
    ops_started: AtomicU64,
    ops_completed: AtomicU64,
    ops_failed: AtomicU64,
    bytes_completed: AtomicU64,
    last_completion_ns: AtomicU64,
    unreaped: AtomicU64,
    wakeups: AtomicU64,
    empty_wakeups: AtomicU64,
    backoffs: AtomicU64,
    stale_control_dropped: AtomicU64,
}

/// State shared between the owner's threads and the progress thread.
struct Shared {
    cmds: Mutex<CmdQueue>,
    wake_fd: c_int,
    stopping: AtomicBool,
    events: Mutex<VecDeque<Event>>,
    events_cv: Condvar,
    failed: Mutex<HashMap<PeerId, bool>>,
    in_flight: Mutex<HashMap<u64, Weak<OpSlot>>>,
    next_op: AtomicU64,
    stats: AtomicStats,
    epoch: Instant,
    reap_grace: Duration,
    uid: u64,
    /// `uid` as little-endian bytes: the header of every control message we send.
    uid_le: [u8; 8],
}

impl Shared {
    fn submit(&self, cmd: Cmd) -> Result<()> {
        let mut q = self.cmds.lock();
        let refused =
            q.closed || (self.stopping.load(Ordering::Acquire) && !matches!(cmd, Cmd::Shutdown));
        if refused {
            drop(q);
            // Whatever waits on this command learns now: no slot or reply is left pending.
            self.fail_cmd(cmd);
            return Err(Error::new(ErrorKind::Shutdown, "agent is shut down"));
        }
        q.items.push_back(cmd);
        drop(q);
        let one: u64 = 1;
        // SAFETY: wake_fd is an eventfd owned by the agent for its whole life; writing 8 bytes
        // from a valid u64 is the eventfd protocol.
        unsafe { libc::write(self.wake_fd, &one as *const u64 as *const c_void, 8) };
        Ok(())
    }

    /// Ends a command that will never run, so nobody waits on it.
    fn fail_cmd(&self, cmd: Cmd) {
        let shutdown = || Error::new(ErrorKind::Shutdown, "agent is shut down");
        match cmd {
            Cmd::Tag { slot, .. } | Cmd::Control { slot, .. } | Cmd::Rma { slot, .. } => {
                let _ = slot.stop_reason.compare_exchange(
                    STOP_NONE,
                    STOP_SHUTDOWN,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                );
                finish_slot(self, &slot, sys::UCS_ERR_CANCELED, 0);
            }
            Cmd::Connect(_, r) | Cmd::ConnectWorker(_, r) => r.set(Err(shutdown())),
            Cmd::Map { reply, .. } => reply.set(Err(shutdown())),
            Cmd::UnpackRkey { reply, .. } => reply.set(Err(shutdown())),
            Cmd::ForceClose(_, Some(r)) => r.set(Ok(())),
            Cmd::ForceClose(_, None)
            | Cmd::CancelOp(_)
            | Cmd::Unmap(_)
            | Cmd::DestroyRkey(_)
            | Cmd::Shutdown => {}
        }
    }

    fn push_event(&self, ev: Event) {
        self.events.lock().push_back(ev);
        self.events_cv.notify_all();
    }

    fn peer_failed(&self, peer: PeerId) -> Option<bool> {
        self.failed.lock().get(&peer).copied()
    }
}

/// A UCX agent: one context, one worker, one progress thread. Not `Clone`; dropping it shuts the
/// progress thread down, cancels every op and closes every endpoint.
pub struct Agent {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
    listen_addr: Option<SocketAddr>,
    worker_address: Vec<u8>,
    name: String,
}

impl Agent {
    /// Creates the agent and starts its progress thread.
    pub fn new(opts: AgentOptions) -> Result<Agent> {
        // SAFETY: eventfd with valid flags; the fd is closed in Drop for Agent.
        let wake_fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if wake_fd < 0 {
            return Err(Error::new(ErrorKind::Transport, "eventfd failed"));
        }
        let uid = fresh_uid();
        let shared = Arc::new(Shared {
            cmds: Mutex::new(CmdQueue::default()),
            wake_fd,
            stopping: AtomicBool::new(false),
            events: Mutex::new(VecDeque::new()),
            events_cv: Condvar::new(),
            failed: Mutex::new(HashMap::new()),
            in_flight: Mutex::new(HashMap::new()),
            next_op: AtomicU64::new(1),
            stats: AtomicStats::default(),
            epoch: Instant::now(),
            reap_grace: opts.reap_grace,
            uid,
            uid_le: uid.to_le_bytes(),
        });
        let init: Arc<Reply<(Option<SocketAddr>, Vec<u8>)>> = Reply::new();
        let (sh, ini, o) = (shared.clone(), init.clone(), opts.clone());
        let thread = std::thread::Builder::new()
            .name(format!("kvlink-ucx-{}", opts.name))
            .spawn(move || progress_thread(o, sh, ini))
            .map_err(|e| Error::new(ErrorKind::Internal, format!("spawn: {e}")))?;
        let started = init.wait(Instant::now() + Duration::from_secs(30));
        match started {
            Ok((listen_addr, worker_address)) => Ok(Agent {
                shared,
                thread: Some(thread),
                listen_addr,
                worker_address,
                name: opts.name,
            }),
            Err(e) => {
                shared.stopping.store(true, Ordering::Release);
                let _ = shared.submit(Cmd::Shutdown);
                let _ = thread.join();
                // SAFETY: the progress thread has exited; nobody else uses the fd.
                unsafe { libc::close(wake_fd) };
                Err(e)
            }
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The bound listen address (with the real port when 0 was asked for).
    pub fn listen_address(&self) -> Option<SocketAddr> {
        self.listen_addr
    }

    /// The worker's address, for connecting without a listener (shared memory).
    pub fn worker_address(&self) -> &[u8] {
        &self.worker_address
    }

    /// Connects to a peer's listener. The endpoint is usable at once; its failure is reported
    /// by later operations and as [`Event::PeerFailed`].
    pub fn connect(&self, addr: SocketAddr) -> Result<PeerId> {
        let r = Reply::new();
        self.shared.submit(Cmd::Connect(addr, r.clone()))?;
        r.wait(Instant::now() + Duration::from_secs(10))
    }

    /// Connects to a peer by its exported worker address.
    pub fn connect_worker(&self, address: &[u8]) -> Result<PeerId> {
        if address.is_empty() || address.len() > 64 * 1024 {
            return Err(Error::invalid("worker address must be 1..=65536 bytes"));
        }
        let r = Reply::new();
        self.shared
            .submit(Cmd::ConnectWorker(address.to_vec(), r.clone()))?;
        r.wait(Instant::now() + Duration::from_secs(10))
    }

    /// This agent's unique id, carried in the header of every control message it sends.
    pub fn uid(&self) -> u64 {
        self.shared.uid
    }

    fn check_peer(&self, peer: PeerId) -> Result<()> {
        match self.shared.peer_failed(peer) {
            None => Err(Error::new(
                ErrorKind::UnknownPeer,
                format!("no peer {}", peer.0),
            )),
            Some(true) => Err(Error::new(
                ErrorKind::PeerLost,
                format!("peer {} has failed", peer.0),
            )),
            Some(false) => Ok(()),
        }
    }

    fn new_slot(
        &self,
        peer: PeerId,
        expected_len: usize,
        tag: u64,
        kind: SlotKind,
        notify: bool,
    ) -> Arc<OpSlot> {
        let send = kind == SlotKind::Send;
        let control = kind == SlotKind::Control;
        let id = self.shared.next_op.fetch_add(1, Ordering::Relaxed);
        let slot = Arc::new(OpSlot {
            id,
            peer,
            expected_len,
            tag,
            send,
            notify,
            control,
            started: Instant::now(),
            state: Mutex::new(None),
            cv: Condvar::new(),
            request: AtomicPtr::new(std::ptr::null_mut()),
            stop_reason: AtomicU8::new(STOP_NONE),
        });
        self.shared
            .in_flight
            .lock()
            .insert(id, Arc::downgrade(&slot));
        self.shared
            .stats
            .ops_started
            .fetch_add(1, Ordering::Relaxed);
        slot
    }

    fn op(&self, slot: Arc<OpSlot>) -> Op {
        Op {
            slot,
            shared: self.shared.clone(),
            finished: false,
            quiesced: false,
        }
    }

    /// Posts a tagged send of `len` bytes at `addr` to `peer`.
    ///
    /// # Safety
    /// `addr..addr+len` must be readable host memory that stays valid and unmodified until the
    /// returned [`Op`] has ended (completed, or [`Op::is_quiesced`] after a stop).
    pub unsafe fn post_send(
        &self,
        peer: PeerId,
        tag: u64,
        addr: *const u8,
        len: usize,
    ) -> Result<Op> {
        self.post_send_with(peer, tag, addr, len, false)
    }

    /// [`Agent::post_send`], optionally reporting the op's end as [`Event::OpDone`].
    ///
    /// # Safety
    /// As for [`Agent::post_send`].
    pub unsafe fn post_send_with(
        &self,
        peer: PeerId,
        tag: u64,
        addr: *const u8,
        len: usize,
        notify: bool,
    ) -> Result<Op> {
        self.post_tag(SlotKind::Send, peer, tag, addr as usize, len, notify)
    }

    /// Posts a tagged receive of exactly `len` bytes into `addr`, from `peer` (the peer whose
    /// failure cancels it). The receive's completion is the data's arrival.
    ///
    /// # Safety
    /// `addr..addr+len` must be writable host memory, not read or written by anyone else, that
    /// stays valid until the returned [`Op`] has ended.
    pub unsafe fn post_recv(
        &self,
        peer: PeerId,
        tag: u64,
        addr: *mut u8,
        len: usize,
    ) -> Result<Op> {
        self.post_recv_with(peer, tag, addr, len, false)
    }

    /// [`Agent::post_recv`], optionally reporting the op's end as [`Event::OpDone`].
    ///
    /// # Safety
    /// As for [`Agent::post_recv`].
    pub unsafe fn post_recv_with(
        &self,
        peer: PeerId,
        tag: u64,
        addr: *mut u8,
        len: usize,
        notify: bool,
    ) -> Result<Op> {
        self.post_tag(SlotKind::Recv, peer, tag, addr as usize, len, notify)
    }

    fn post_tag(
        &self,
        kind: SlotKind,
        peer: PeerId,
        tag: u64,
        addr: usize,
        len: usize,
        notify: bool,
    ) -> Result<Op> {
        check_buffer(addr, len)?;
        self.check_peer(peer)?;
        let slot = self.new_slot(peer, len, tag, kind, notify);
        let op = self.op(slot.clone());
        let send = kind == SlotKind::Send;
        self.shared.submit(Cmd::Tag {
            send,
            peer,
            tag,
            addr,
            len,
            slot,
        })?;
        Ok(op)
    }

    /// Registers `[addr, addr+len)` with UCX for one-sided access by peers. The handle's packed
    /// remote key is what a peer needs ([`Agent::unpack_rkey`]); dropping the handle unmaps.
    ///
    /// # Safety
    /// The range must be valid host memory for as long as the handle lives, and no peer may
    /// still access it when the handle is dropped.
    pub unsafe fn map(&self, addr: *mut u8, len: usize) -> Result<MemHandle> {
        check_buffer(addr as usize, len)?;
        let r = Reply::new();
        self.shared.submit(Cmd::Map {
            addr: addr as usize,
            len,
            reply: r.clone(),
        })?;
        let (id, packed_rkey) = r.wait(Instant::now() + Duration::from_secs(10))?;
        Ok(MemHandle {
            id,
            addr: addr as u64,
            len,
            packed_rkey,
            shared: self.shared.clone(),
        })
    }

    /// Unpacks a peer's remote key for its region `[base, base+len)` (as the peer advertised
    /// it). Every put or get through the key is checked against that region.
    pub fn unpack_rkey(
        &self,
        peer: PeerId,
        packed: &[u8],
        base: u64,
        len: u64,
    ) -> Result<RemoteKey> {
        if packed.is_empty() || packed.len() > 64 * 1024 {
            return Err(Error::invalid(
                "a packed remote key must be 1..=65536 bytes",
            ));
        }
        if base == 0 || len == 0 || base.checked_add(len).is_none() {
            return Err(Error::new(ErrorKind::OutOfBounds, "bad remote region"));
        }
        self.check_peer(peer)?;
        let r = Reply::new();
        self.shared.submit(Cmd::UnpackRkey {
            peer,
            packed: packed.to_vec(),
            reply: r.clone(),
        })?;
        let id = r.wait(Instant::now() + Duration::from_secs(10))?;
        Ok(RemoteKey {
            id,
            peer,
            base,
            len,
            shared: self.shared.clone(),
        })
    }

    /// One-sided write of `len` bytes at `local` into the peer's memory at `remote`. Completes
    /// when the data is in place at the target (the endpoint is flushed).
    ///
    /// # Safety
    /// `local..local+len` must be readable until the op has ended.
    pub unsafe fn put(
        &self,
        local: *const u8,
        len: usize,
        key: &RemoteKey,
        remote: u64,
    ) -> Result<Op> {
        self.rma(local as usize, len, key, remote, true)
    }

    /// One-sided read of `len` bytes from the peer's memory at `remote` into `local`.
    ///
    /// # Safety
    /// `local..local+len` must be writable and untouched by others until the op has ended.
    pub unsafe fn get(
        &self,
        local: *mut u8,
        len: usize,
        key: &RemoteKey,
        remote: u64,
    ) -> Result<Op> {
        self.rma(local as usize, len, key, remote, false)
    }

    fn rma(&self, addr: usize, len: usize, key: &RemoteKey, remote: u64, put: bool) -> Result<Op> {
        check_buffer(addr, len)?;
        let end = remote.checked_add(len as u64);
        if remote < key.base || end.is_none_or(|e| e > key.base + key.len) {
            return Err(Error::new(
                ErrorKind::OutOfBounds,
                format!(
                    "[{remote:#x}, +{len}) is outside the remote region [{:#x}, +{})",
                    key.base, key.len
                ),
            ));
        }
        self.check_peer(key.peer)?;
        let slot = self.new_slot(key.peer, len, 0, SlotKind::Rma, false);
        let op = self.op(slot.clone());
        self.shared.submit(Cmd::Rma {
            rkey: key.id,
            put,
            addr,
            len,
            remote,
            slot,
        })?;
        Ok(op)
    }

    /// Sends a small control message (eager active message); returns the op to wait on.
    pub fn send_control(&self, peer: PeerId, bytes: Vec<u8>) -> Result<Op> {
        if bytes.is_empty() || bytes.len() > MAX_CONTROL {
            return Err(Error::invalid(format!(
                "control message must be 1..={MAX_CONTROL} bytes"
            )));
        }
        self.check_peer(peer)?;
        let slot = self.new_slot(peer, bytes.len(), 0, SlotKind::Control, false);
        let op = self.op(slot.clone());
        self.shared.submit(Cmd::Control { peer, bytes, slot })?;
        Ok(op)
    }

    /// Takes the next event, waiting until `deadline` (or until `cancel()` turns true, checked
    /// every 5 ms when given). `None` when the wait ended without an event.
    pub fn next_event(
        &self,
        deadline: Instant,
        cancel: Option<&dyn Fn() -> bool>,
    ) -> Option<Event> {
        let mut q = self.shared.events.lock();
        loop {
            if let Some(ev) = q.pop_front() {
                return Some(ev);
            }
            let now = Instant::now();
            if now >= deadline || cancel.is_some_and(|c| c()) {
                return None;
            }
            let until = if cancel.is_some() {
                deadline.min(now + Duration::from_millis(5))
            } else {
                deadline
            };
            self.shared.events_cv.wait_until(&mut q, until);
        }
    }

    /// Whether `peer` is connected, failed, or unknown.
    pub fn peer_state(&self, peer: PeerId) -> Result<()> {
        self.check_peer(peer)
    }

    /// A snapshot of the progress counters.
    pub fn stats(&self) -> Stats {
        let s = &self.shared.stats;
        let now = Instant::now();
        let mut in_flight = 0;
        let mut oldest: Option<Instant> = None;
        let slots: Vec<Arc<OpSlot>> = self
            .shared
            .in_flight
            .lock()
            .values()
            .filter_map(Weak::upgrade)
            .collect();
        for slot in slots {
            {
                if !slot.control && slot.state.lock().is_none() {
                    in_flight += 1;
                    oldest = Some(oldest.map_or(slot.started, |o| o.min(slot.started)));
                }
            }
        }
        let last = s.last_completion_ns.load(Ordering::Relaxed);
        Stats {
            ops_started: s.ops_started.load(Ordering::Relaxed),
            ops_completed: s.ops_completed.load(Ordering::Relaxed),
            ops_failed: s.ops_failed.load(Ordering::Relaxed),
            in_flight,
            bytes_completed: s.bytes_completed.load(Ordering::Relaxed),
            since_last_completion: (last > 0).then(|| {
                now.saturating_duration_since(self.shared.epoch + Duration::from_nanos(last))
            }),
            oldest_in_flight: oldest.map(|o| now.saturating_duration_since(o)),
            unreaped: s.unreaped.load(Ordering::Relaxed),
            wakeups: s.wakeups.load(Ordering::Relaxed),
            empty_wakeups: s.empty_wakeups.load(Ordering::Relaxed),
            backoffs: s.backoffs.load(Ordering::Relaxed),
            stale_control_dropped: s.stale_control_dropped.load(Ordering::Relaxed),
        }
    }

    /// Force-closes the endpoint to `peer`: every op on it ends with an error and the peer is
    /// marked failed. The fence of last resort.
    pub fn close_peer(&self, peer: PeerId) -> Result<()> {
        self.check_peer(peer)?;
        self.shared.submit(Cmd::ForceClose(peer, None))
    }

    /// Like [`Agent::close_peer`], but returns only once the endpoint is closed and the receives
    /// posted for the peer are cancelled (bounded by `deadline`). False if the deadline passed.
    pub fn close_peer_sync(&self, peer: PeerId, deadline: Instant) -> bool {
        let r = Reply::new();
        if self
            .shared
            .submit(Cmd::ForceClose(peer, Some(r.clone())))
            .is_err()
        {
            return false;
        }
        r.wait(deadline).is_ok()
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.shared.stopping.store(true, Ordering::Release);
        let _ = self.shared.submit(Cmd::Shutdown);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        // SAFETY: the progress thread has exited; the fd is ours and closed once.
        unsafe { libc::close(self.shared.wake_fd) };
    }
}

/// Host memory registered with UCX ([`Agent::map`]). Not `Clone`; dropping it unmaps.
pub struct MemHandle {
    id: u64,
    addr: u64,
    len: usize,
    packed_rkey: Vec<u8>,
    shared: Arc<Shared>,
}

impl MemHandle {
    pub fn addr(&self) -> u64 {
        self.addr
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The key a peer unpacks to read or write this memory.
    pub fn packed_rkey(&self) -> &[u8] {
        &self.packed_rkey
    }
}

impl Drop for MemHandle {
    fn drop(&mut self) {
        let _ = self.shared.submit(Cmd::Unmap(self.id));
    }
}

/// A peer's memory key, bound to one endpoint and the region it was advertised for. Not
/// `Clone`; dropping it destroys the key.
pub struct RemoteKey {
    id: u64,
    peer: PeerId,
    base: u64,
    len: u64,
    shared: Arc<Shared>,
}

impl Drop for RemoteKey {
    fn drop(&mut self) {
        let _ = self.shared.submit(Cmd::DestroyRkey(self.id));
    }
}

/// Progress calls per pass before commands are looked at again.
const PROGRESS_BURST: usize = 64;

/// The largest control message: control messages are small and always sent eagerly.
pub const MAX_CONTROL: usize = 1 << 20;
const AM_CONTROL_ID: u32 = 7;
/// Internal: "I gave up on my send with this tag; drain it" (8-byte tag).
const AM_DRAIN_ID: u32 = 8;
/// Internal: "this is my worker address; connect back" (sent after connecting by address).
const AM_BIND_ID: u32 = 9;
/// How long a drain receive waits for the abandoned message before it is cancelled.
const DRAIN_TTL: Duration = Duration::from_secs(60);

fn check_buffer(addr: usize, len: usize) -> Result<()> {
    if addr == 0 {
        return Err(Error::invalid("null buffer"));
    }
    if len == 0 {
        return Err(Error::invalid("zero-length transfer"));
    }
    if addr.checked_add(len).is_none() {
        return Err(Error::new(
            ErrorKind::OutOfBounds,
            "buffer wraps the address space",
        ));
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// The progress thread.

/// What UCX callbacks report; they run inside `ucp_worker_progress` on the progress thread and
/// only push here, so no state is borrowed re-entrantly.
enum CbEvent {
    ConnRequest(sys::ucp_conn_request_h),
    EpError(u64, sys::ucs_status_t),
    Drain(sys::ucp_ep_h, u64, u64),
    Bind(u64, Vec<u8>),
    Control(sys::ucp_ep_h, u64, Vec<u8>),
}

thread_local! {
    static CB_EVENTS: RefCell<Vec<CbEvent>> = const { RefCell::new(Vec::new()) };
}

fn push_cb(ev: CbEvent) {
    CB_EVENTS.with(|q| q.borrow_mut().push(ev));
}

struct PeerEntry {
    /// None once the endpoint has been closed (after a failure).
    ep: Option<Endpoint>,
    failed: bool,
}

/// The progress thread's state. Field order is drop order: UCX handles made from others are
/// declared (and so dropped) before what they were made from.
struct Progress {
    rkeys: HashMap<u64, (u64, UcxRkey)>,
    peers: HashMap<u64, PeerEntry>,
    listener: Option<Listener>,
    maps: HashMap<u64, Mapped>,
    epfd: Option<std::os::fd::OwnedFd>,
    worker: Worker,
    ctx: Context,
    ep_to_peer: HashMap<usize, u64>,
    uid_to_peer: HashMap<u64, u64>,
    next_peer: u64,
    drains: Vec<Arc<OpSlot>>,
    scratch: Box<[u8; 8]>,
    own_address: Vec<u8>,
    shared: Arc<Shared>,
}

fn ucx_err(status: sys::ucs_status_t, what: &str) -> Error {
    map_status(status, what)
}

fn progress_thread(
    opts: AgentOptions,
    shared: Arc<Shared>,
    init: Arc<Reply<(Option<SocketAddr>, Vec<u8>)>>,
) {
    SHARED.with(|s| *s.borrow_mut() = Some(shared.clone()));
    let mut p = match Progress::start(&opts, shared) {
        Ok((p, listen, addr)) => {
            init.set(Ok((listen, addr)));
            p
        }
        Err(e) => {
            init.set(Err(e));
            return;
        }
    };
    p.run();
    p.teardown();
}

impl Progress {
    fn start(
        opts: &AgentOptions,
        shared: Arc<Shared>,
    ) -> Result<(Progress, Option<SocketAddr>, Vec<u8>)> {
        // SAFETY: all calls below follow the UCX API contracts: parameter structs are zeroed
        // (Default) with field masks naming exactly the fields set; out-pointers are valid;
        // every created handle is owned by `Progress` and destroyed in `teardown`.
        unsafe {
            let mut config: *mut sys::ucp_config_t = std::ptr::null_mut();
            let st = sys::ucp_config_read(std::ptr::null(), std::ptr::null(), &mut config);
            if st != sys::UCS_OK {
                return Err(ucx_err(st, "ucp_config_read"));
            }
            let keepalive = format!("{}ms", opts.keepalive.as_millis().max(1));
            let mut settings: Vec<(&str, String)> = vec![("KEEPALIVE_INTERVAL", keepalive)];
            if opts.transport == TransportKind::SharedMemory {
                // Without it UCX 1.13 refuses shared-memory lanes under peer error handling.
                settings.push(("MM_ERROR_HANDLING", "y".into()));
            }
            if std::env::var_os("UCX_TLS").is_none() {
                settings.push(("TLS", opts.transport.tls().into()));
            }
            for (k, v) in &settings {
                let (ck, cv) = (CString::new(*k).unwrap(), CString::new(v.as_str()).unwrap());
                let st = sys::ucp_config_modify(config, ck.as_ptr(), cv.as_ptr());
                if st != sys::UCS_OK {
                    tracing::debug!("ucp_config_modify({k}={v}): {}", sys::status_str(st));
                }
            }
            let mut params = sys::ucp_params_t {
                field_mask: (sys::UCP_PARAM_FIELD_FEATURES | sys::UCP_PARAM_FIELD_NAME) as u64,
                features: (sys::UCP_FEATURE_TAG
                    | sys::UCP_FEATURE_AM
                    | sys::UCP_FEATURE_RMA
                    | sys::UCP_FEATURE_WAKEUP) as u64,
                ..Default::default()
            };
            let cname = CString::new(opts.name.clone())
                .map_err(|_| Error::invalid("agent name contains NUL"))?;
            params.name = cname.as_ptr();
            let mut ctx: sys::ucp_context_h = std::ptr::null_mut();
            let st = sys::ucp_init_version(
                sys::UCP_API_MAJOR,
                sys::UCP_API_MINOR,
                &params,
                config,
                &mut ctx,
            );
            sys::ucp_config_release(config);
            if st != sys::UCS_OK {
                return Err(ucx_err(st, "ucp_init"));
            }
            let ctx = Context(ctx);
            let wparams = sys::ucp_worker_params_t {
                field_mask: sys::UCP_WORKER_PARAM_FIELD_THREAD_MODE as u64,
                thread_mode: sys::UCS_THREAD_MODE_SINGLE,
                ..Default::default()
            };
            let mut worker: sys::ucp_worker_h = std::ptr::null_mut();
            let st = sys::ucp_worker_create(ctx.0, &wparams, &mut worker);
            if st != sys::UCS_OK {
                return Err(ucx_err(st, "ucp_worker_create"));
            }
            let mut p = Progress {
                rkeys: HashMap::new(),
                peers: HashMap::new(),
                listener: None,
                maps: HashMap::new(),
                epfd: None,
                worker: Worker(worker),
                ctx,
                ep_to_peer: HashMap::new(),
                uid_to_peer: HashMap::new(),
                next_peer: 1,
                drains: Vec::new(),
                scratch: Box::new([0; 8]),
                own_address: Vec::new(),
                shared,
            };
            // From here on, `p.teardown()` releases what exists.
            match p.setup(opts) {
                Ok((listen, addr)) => Ok((p, listen, addr)),
                Err(e) => {
                    p.teardown();
                    Err(e)
                }
            }
        }
    }

    unsafe fn setup(&mut self, opts: &AgentOptions) -> Result<(Option<SocketAddr>, Vec<u8>)> {
        let mut efd: c_int = -1;
        let st = sys::ucp_worker_get_efd(self.worker.0, &mut efd);
        if st != sys::UCS_OK {
            return Err(ucx_err(st, "ucp_worker_get_efd"));
        }
        let epfd = libc::epoll_create1(libc::EPOLL_CLOEXEC);
        if epfd < 0 {
            return Err(Error::new(ErrorKind::Transport, "epoll_create1 failed"));
        }
        // SAFETY: a fresh fd that nothing else owns.
        self.epfd = Some(std::os::fd::FromRawFd::from_raw_fd(epfd));
        for (fd, token) in [(efd, 1u64), (self.shared.wake_fd, 2u64)] {
            let mut ev = libc::epoll_event {
                events: libc::EPOLLIN as u32,
                u64: token,
            };
            if libc::epoll_ctl(epfd, libc::EPOLL_CTL_ADD, fd, &mut ev) != 0 {
                return Err(Error::new(ErrorKind::Transport, "epoll_ctl failed"));
            }
        }
        let am = sys::ucp_am_handler_param_t {
            field_mask: (sys::UCP_AM_HANDLER_PARAM_FIELD_ID
                | sys::UCP_AM_HANDLER_PARAM_FIELD_CB
                | sys::UCP_AM_HANDLER_PARAM_FIELD_ARG) as u64,
            id: AM_CONTROL_ID,
            cb: Some(am_control_cb),
            arg: std::ptr::null_mut(),
            ..Default::default()
        };
        let st = sys::ucp_worker_set_am_recv_handler(self.worker.0, &am);
        if st != sys::UCS_OK {
            return Err(ucx_err(st, "ucp_worker_set_am_recv_handler"));
        }
        for (id, cb) in [
            (AM_DRAIN_ID, am_drain_cb as AmCb),
            (AM_BIND_ID, am_bind_cb as AmCb),
        ] {
            let h = sys::ucp_am_handler_param_t {
                id,
                cb: Some(cb),
                ..am
            };
            let st = sys::ucp_worker_set_am_recv_handler(self.worker.0, &h);
            if st != sys::UCS_OK {
                return Err(ucx_err(st, "ucp_worker_set_am_recv_handler"));
            }
        }
        let mut attr = sys::ucp_worker_attr_t {
            field_mask: sys::UCP_WORKER_ATTR_FIELD_ADDRESS as u64,
            ..Default::default()
        };
        let st = sys::ucp_worker_query(self.worker.0, &mut attr);
        if st != sys::UCS_OK {
            return Err(ucx_err(st, "ucp_worker_query"));
        }
        let address =
            std::slice::from_raw_parts(attr.address as *const u8, attr.address_length).to_vec();
        sys::ucp_worker_release_address(self.worker.0, attr.address);
        self.own_address = address.clone();

        let mut bound = None;
        if let Some(addr) = opts.listen {
            let (storage, len) = sockaddr_of(addr);
            let lp = sys::ucp_listener_params_t {
                field_mask: (sys::UCP_LISTENER_PARAM_FIELD_SOCK_ADDR
                    | sys::UCP_LISTENER_PARAM_FIELD_CONN_HANDLER)
                    as u64,
                sockaddr: sys::ucs_sock_addr_t {
                    addr: &storage as *const libc::sockaddr_storage as *const sys::sockaddr,
                    addrlen: len,
                },
                conn_handler: sys::ucp_listener_conn_handler_t {
                    cb: Some(conn_cb),
                    arg: std::ptr::null_mut(),
                },
                ..Default::default()
            };
            let mut listener: sys::ucp_listener_h = std::ptr::null_mut();
            let st = sys::ucp_listener_create(self.worker.0, &lp, &mut listener);
            if st != sys::UCS_OK {
                return Err(ucx_err(st, &format!("listen on {addr}")));
            }
            self.listener = Some(Listener(listener));
            let mut la = sys::ucp_listener_attr_t {
                field_mask: sys::UCP_LISTENER_ATTR_FIELD_SOCKADDR as u64,
                ..Default::default()
            };
            let st = sys::ucp_listener_query(listener, &mut la);
            if st != sys::UCS_OK {
                return Err(ucx_err(st, "ucp_listener_query"));
            }
            let port = sockaddr_port(
                &la.sockaddr as *const sys::sockaddr_storage as *const libc::sockaddr_storage,
            );
            bound = Some(SocketAddr::new(addr.ip(), port));
        }
        Ok((bound, address))
    }

    fn epoll_fd(&self) -> c_int {
        use std::os::fd::AsRawFd;
        self.epfd.as_ref().map_or(-1, |f| f.as_raw_fd())
    }

    fn run(&mut self) {
        let mut empty_streak = 0u32;

        loop {
            let mut did = self.drain_commands();
            if did.1 {
                return;
            }
            for _ in 0..PROGRESS_BURST {
                // SAFETY: the worker is owned by this thread.
                let n = unsafe { sys::ucp_worker_progress(self.worker.0) };
                let handled = self.handle_callbacks();
                if n == 0 && handled == 0 {
                    break;
                }
                did.0 = true;
                // Commands (cancels, new posts) must not wait behind a busy transfer.
                if self.shared.cmds_pending() {
                    break;
                }
            }
            if did.0 {
                empty_streak = 0;
            }
            if !self.drains.is_empty() {
                self.expire_drains();
            }

            // SAFETY: as above.
            let st = unsafe { sys::ucp_worker_arm(self.worker.0) };
            if st == sys::UCS_ERR_BUSY {
                continue;
            }
            let mut evs: [libc::epoll_event; 4] = unsafe { std::mem::zeroed() };
            // A bounded sleep: UCX keepalive needs progress now and then even when idle.
            // SAFETY: epfd is ours; evs has room for 4 events.
            let n = unsafe { libc::epoll_wait(self.epoll_fd(), evs.as_mut_ptr(), 4, 100) };
            self.shared.stats.wakeups.fetch_add(1, Ordering::Relaxed);
            if n > 0 {
                let mut ucx_woke = false;
                for ev in &evs[..n as usize] {
                    if ev.u64 == 2 {
                        let mut buf = 0u64;
                        // SAFETY: reading 8 bytes from our eventfd into a u64.
                        unsafe {
                            libc::read(self.shared.wake_fd, &mut buf as *mut u64 as *mut c_void, 8)
                        };
                    } else {
                        ucx_woke = true;
                    }
                }
                if ucx_woke && !self.shared.cmds_pending() {
                    // Woken by UCX: if the next progress pass finds nothing, count an empty wake.
                    let n = unsafe { sys::ucp_worker_progress(self.worker.0) };
                    let handled = self.handle_callbacks();
                    if n == 0 && handled == 0 {
                        empty_streak += 1;
                        self.shared
                            .stats
                            .empty_wakeups
                            .fetch_add(1, Ordering::Relaxed);
                        if empty_streak >= 64 {
                            self.shared.stats.backoffs.fetch_add(1, Ordering::Relaxed);
                            std::thread::sleep(Duration::from_millis(1));
                        }
                    } else {
                        empty_streak = 0;
                    }
                }
            }
        }
    }

    /// Runs queued commands; returns (did something, saw shutdown).
    fn drain_commands(&mut self) -> (bool, bool) {
        let mut did = false;
        loop {
            let cmd = self.shared.cmds.lock().items.pop_front();
            let Some(cmd) = cmd else { return (did, false) };
            did = true;
            match cmd {
                Cmd::Shutdown => return (true, true),
                Cmd::Connect(addr, reply) => reply.set(self.connect(Target::Sock(addr))),
                Cmd::ConnectWorker(addr, reply) => {
                    let r = self.connect(Target::Worker(&addr));
                    if let Ok(peer) = &r {
                        // The peer has no endpoint back to us yet: send it our address so it
                        // connects back and can tell our messages (by uid) from others'.
                        let me = self.own_address.clone();
                        self.send_internal(*peer, AM_BIND_ID, me);
                    }
                    reply.set(r)
                }
                Cmd::Tag {
                    send,
                    peer,
                    tag,
                    addr,
                    len,
                    slot,
                } => self.start_tag(peer, tag, addr, len, slot, send),
                Cmd::Control { peer, bytes, slot } => self.start_control(peer, bytes, slot),
                Cmd::CancelOp(id) => self.cancel_op(id),
                Cmd::Map { addr, len, reply } => {
                    // SAFETY: Agent::map's caller vouched for the range.
                    let r = unsafe { Mapped::new(self.ctx.0, addr as *mut u8, len) }.map(|m| {
                        let id = self.next_handle();
                        let packed = m.packed_rkey.clone();
                        self.maps.insert(id, m);
                        (id, packed)
                    });
                    reply.set(r)
                }
                Cmd::Unmap(id) => drop(self.maps.remove(&id)),
                Cmd::UnpackRkey {
                    peer,
                    packed,
                    reply,
                } => {
                    let r = self.ep_of(peer).and_then(|ep| {
                        // SAFETY: ep is a live endpoint of our worker.
                        let k = unsafe { UcxRkey::unpack(ep, &packed) }?;
                        let id = self.next_handle();
                        self.rkeys.insert(id, (peer.0, k));
                        Ok(id)
                    });
                    reply.set(r)
                }
                Cmd::DestroyRkey(id) => drop(self.rkeys.remove(&id)),
                Cmd::Rma {
                    rkey,
                    put,
                    addr,
                    len,
                    remote,
                    slot,
                } => self.start_rma(rkey, put, addr, len, remote, slot),
                Cmd::ForceClose(peer, reply) => {
                    self.fail_peer(peer.0, sys::UCS_ERR_CANCELED, true);
                    if let Some(r) = reply {
                        r.set(Ok(()))
                    }
                }
            }
        }
    }

    fn next_handle(&mut self) -> u64 {
        self.next_peer += 1;
        self.next_peer
    }

    /// A put or get, then a flush of the endpoint: the flush's completion is the op's, and it
    /// means the data is in place at the target (put) or here (get).
    fn start_rma(
        &mut self,
        rkey: u64,
        put: bool,
        addr: usize,
        len: usize,
        remote: u64,
        slot: Arc<OpSlot>,
    ) {
        let Some((peer, key)) = self.rkeys.get(&rkey).map(|(p, k)| (*p, k.0)) else {
            return self.finish_slot(&slot, sys::UCS_ERR_INVALID_PARAM, 0);
        };
        let ep = match self.ep_of(PeerId(peer)) {
            Ok(ep) => ep,
            Err(_) => {
                slot.stop_reason.store(STOP_PEER, Ordering::Release);
                return self.finish_slot(&slot, sys::UCS_ERR_NOT_CONNECTED, 0);
            }
        };
        let plain = sys::ucp_request_param_t::default();
        // SAFETY: the caller of put/get vouched for the local buffer until the op ends; the
        // remote range was checked against the key's advertised region.
        let ptr = unsafe {
            if put {
                sys::ucp_put_nbx(ep, addr as *const c_void, len, remote, key, &plain)
            } else {
                sys::ucp_get_nbx(ep, addr as *mut c_void, len, remote, key, &plain)
            }
        };
        if sys::ptr_is_err(ptr) {
            return self.finish_slot(&slot, sys::ptr_status(ptr), 0);
        }
        if sys::ptr_is_ptr(ptr) {
            // No callback was asked for: UCX releases the request when it completes; the
            // flush below is what we track.
            // SAFETY: freeing the request handle once.
            unsafe { sys::ucp_request_free(ptr) };
        }
        let mut param = Self::request_param(&slot);
        param.cb.send = Some(send_cb);
        // SAFETY: as for the tag sends: the slot's count travels in user_data.
        let ptr = unsafe { sys::ucp_ep_flush_nbx(ep, &param) };
        self.track(&slot, ptr);
    }

    fn cancel_op(&mut self, id: u64) {
        let slot = self
            .shared
            .in_flight
            .lock()
            .get(&id)
            .and_then(Weak::upgrade);
        if let Some(slot) = slot {
            let req = slot.request.load(Ordering::Acquire);
            if !req.is_null() {
                // SAFETY: req is a live request of our worker: the completion callback clears
                // `slot.request` (on this thread) before freeing it.
                unsafe { sys::ucp_request_cancel(self.worker.0, req) };
                if slot.send {
                    // UCX cannot cancel a rendezvous send on its own: ask the receiver to drain
                    // the tag, which completes our send without the data being kept.
                    self.send_drain(slot.peer, slot.tag);
                }
            }
        }
    }

    fn send_drain(&mut self, peer: PeerId, tag: u64) {
        self.send_internal(peer, AM_DRAIN_ID, tag.to_le_bytes().to_vec());
    }

    /// Sends an internal active message (drain, bind); fire and forget.
    fn send_internal(&mut self, peer: PeerId, id: u32, bytes: Vec<u8>) {
        let Ok(ep) = self.ep_of(peer) else { return };
        let msg = Box::new(bytes);
        let header = self.shared.uid_le.as_ptr() as *const c_void;
        let mut param = sys::ucp_request_param_t {
            op_attr_mask: sys::UCP_OP_ATTR_FIELD_FLAGS
                | sys::UCP_OP_ATTR_FIELD_CALLBACK
                | sys::UCP_OP_ATTR_FIELD_USER_DATA,
            flags: sys::UCP_AM_SEND_FLAG_EAGER | sys::UCP_AM_SEND_FLAG_REPLY,
            ..Default::default()
        };
        param.cb.send = Some(drain_sent_cb);
        let (data, len) = (msg.as_ptr() as *const c_void, msg.len());
        param.user_data = Box::into_raw(msg) as *mut c_void;
        // SAFETY: the message lives in the box until drain_sent_cb (or the code below) frees
        // it; the header lives in `shared`.
        let ptr = unsafe { sys::ucp_am_send_nbx(ep, id, header, 8, data, len, &param) };
        if !sys::ptr_is_ptr(ptr) {
            // SAFETY: the callback will not run; reclaim the box.
            drop(unsafe { Box::from_raw(param.user_data as *mut Vec<u8>) });
        }
    }

    /// The sender of `tag` gave up: cancel our receive for it, then post a 1-byte receive that
    /// swallows the abandoned message (UCX completes a too-large message as truncated, and the
    /// sender's request completes) so it neither waits forever nor sits in the unexpected queue.
    fn drain(&mut self, peer: u64, tag: u64) {
        let slots: Vec<Arc<OpSlot>> = self
            .shared
            .in_flight
            .lock()
            .values()
            .filter_map(Weak::upgrade)
            .filter(|s| s.peer.0 == peer && !s.send && s.tag == tag)
            .collect();
        for s in &slots {
            let _ = s.stop_reason.compare_exchange(
                STOP_NONE,
                STOP_REMOTE_CANCEL,
                Ordering::AcqRel,
                Ordering::Acquire,
            );
            let req = s.request.load(Ordering::Acquire);
            if !req.is_null() {
                // SAFETY: live request of this worker.
                unsafe { sys::ucp_request_cancel(self.worker.0, req) };
            }
        }
        let slot = Arc::new(OpSlot {
            id: 0,
            peer: PeerId(peer),
            expected_len: 1,
            tag,
            send: false,
            notify: false,
            control: true,
            started: Instant::now(),
            state: Mutex::new(None),
            cv: Condvar::new(),
            request: AtomicPtr::new(std::ptr::null_mut()),
            stop_reason: AtomicU8::new(STOP_NONE),
        });
        let mut param = Self::request_param(&slot);
        param.cb.recv = Some(recv_cb);
        let scratch = self.scratch.as_mut_ptr() as *mut c_void;
        // SAFETY: the scratch bytes live as long as the worker; only truncated (discarded)
        // messages ever target them.
        let ptr =
            unsafe { sys::ucp_tag_recv_nbx(self.worker.0, scratch, 1, tag, u64::MAX, &param) };
        self.track(&slot, ptr);
        self.drains.push(slot);
    }

    /// Cancels drain receives whose abandoned message never came.
    fn expire_drains(&mut self) {
        let now = Instant::now();
        let worker = self.worker.0;
        self.drains.retain(|s| {
            if s.state.lock().is_some() {
                return false;
            }
            if now.duration_since(s.started) > DRAIN_TTL {
                let req = s.request.load(Ordering::Acquire);
                if !req.is_null() {
                    // SAFETY: live request of this worker.
                    unsafe { sys::ucp_request_cancel(worker, req) };
                }
            }
            true
        });
    }

    fn connect(&mut self, target: Target<'_>) -> Result<PeerId> {
        let id = self.next_peer;
        let mut ep: sys::ucp_ep_h = std::ptr::null_mut();
        let mut params = sys::ucp_ep_params_t {
            field_mask: (sys::UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE
                | sys::UCP_EP_PARAM_FIELD_ERR_HANDLER) as u64,
            err_mode: sys::UCP_ERR_HANDLING_MODE_PEER,
            err_handler: sys::ucp_err_handler_t {
                cb: Some(ep_err_cb),
                arg: id as usize as *mut c_void,
            },
            ..Default::default()
        };
        let storage;
        match target {
            Target::Sock(addr) => {
                let (s, len) = sockaddr_of(addr);
                storage = s;
                params.field_mask |=
                    (sys::UCP_EP_PARAM_FIELD_SOCK_ADDR | sys::UCP_EP_PARAM_FIELD_FLAGS) as u64;
                params.flags = sys::UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
                params.sockaddr = sys::ucs_sock_addr_t {
                    addr: &storage as *const libc::sockaddr_storage as *const sys::sockaddr,
                    addrlen: len,
                };
            }
            Target::Worker(addr) => {
                params.field_mask |= sys::UCP_EP_PARAM_FIELD_REMOTE_ADDRESS as u64;
                params.address = addr.as_ptr() as *const sys::ucp_address_t;
            }
            Target::Request(req) => {
                params.field_mask |= sys::UCP_EP_PARAM_FIELD_CONN_REQUEST as u64;
                params.conn_request = req;
            }
        }
        // SAFETY: params is fully initialised for the fields in its mask; pointers in it
        // (sockaddr storage, worker address) outlive this call.
        let st = unsafe { sys::ucp_ep_create(self.worker.0, &params, &mut ep) };
        if st != sys::UCS_OK {
            return Err(ucx_err(st, "ucp_ep_create"));
        }
        self.next_peer += 1;
        self.peers.insert(
            id,
            PeerEntry {
                ep: Some(Endpoint::new(ep, self.worker.0)),
                failed: false,
            },
        );
        self.ep_to_peer.insert(ep as usize, id);
        self.shared.failed.lock().insert(PeerId(id), false);
        Ok(PeerId(id))
    }

    fn ep_of(&self, peer: PeerId) -> Result<sys::ucp_ep_h> {
        match self.peers.get(&peer.0) {
            None => Err(Error::new(
                ErrorKind::UnknownPeer,
                format!("no peer {}", peer.0),
            )),
            Some(PeerEntry { failed: true, .. }) | Some(PeerEntry { ep: None, .. }) => {
                Err(Error::new(ErrorKind::PeerLost, "peer has failed"))
            }
            Some(PeerEntry { ep: Some(e), .. }) => Ok(e.ep),
        }
    }

    /// Hands a slot to UCX: on success UCX holds one strong count, returned by the callback.
    fn track(&self, slot: &Arc<OpSlot>, status_ptr: sys::ucs_status_ptr_t) {
        if sys::ptr_is_ptr(status_ptr) {
            // With NO_IMM_CMPL the callback may already have run (and freed the request)
            // inside the *_nbx call: only a pending request is stored for later cancels.
            if slot.state.lock().is_none() {
                slot.request.store(status_ptr, Ordering::Release);
            }
        } else {
            // Not a request: the callback will not run. Release its count and fail the slot.
            // SAFETY: the count was leaked with Arc::into_raw for this call.
            unsafe { Arc::decrement_strong_count(Arc::as_ptr(slot)) };
            let st = if sys::ptr_is_err(status_ptr) {
                sys::ptr_status(status_ptr)
            } else {
                sys::UCS_OK
            };
            self.finish_slot(slot, st, slot.expected_len);
        }
    }

    fn finish_slot(&self, slot: &OpSlot, status: sys::ucs_status_t, len: usize) {
        finish_slot(&self.shared, slot, status, len);
    }

    fn request_param(slot: &Arc<OpSlot>) -> sys::ucp_request_param_t {
        sys::ucp_request_param_t {
            op_attr_mask: sys::UCP_OP_ATTR_FIELD_CALLBACK
                | sys::UCP_OP_ATTR_FIELD_USER_DATA
                | sys::UCP_OP_ATTR_FLAG_NO_IMM_CMPL,
            user_data: Arc::into_raw(slot.clone()) as *mut c_void,
            ..Default::default()
        }
    }

    fn start_tag(
        &mut self,
        peer: PeerId,
        tag: u64,
        addr: usize,
        len: usize,
        slot: Arc<OpSlot>,
        send: bool,
    ) {
        let ep = match self.ep_of(peer) {
            Ok(ep) => ep,
            Err(e) => {
                slot.stop_reason.store(
                    if e.kind == ErrorKind::PeerLost {
                        STOP_PEER
                    } else {
                        STOP_NONE
                    },
                    Ordering::Release,
                );
                return self.finish_slot(&slot, sys::UCS_ERR_NOT_CONNECTED, 0);
            }
        };
        let mut param = Self::request_param(&slot);
        // SAFETY: the caller of post_send/post_recv promised the buffer's validity until the op
        // ends; the slot's strong count in user_data is returned by the callback or by `track`.
        let ptr = unsafe {
            if send {
                param.cb.send = Some(send_cb);
                sys::ucp_tag_send_nbx(ep, addr as *const c_void, len, tag, &param)
            } else {
                param.cb.recv = Some(recv_cb);
                sys::ucp_tag_recv_nbx(
                    self.worker.0,
                    addr as *mut c_void,
                    len,
                    tag,
                    u64::MAX,
                    &param,
                )
            }
        };
        self.track(&slot, ptr);
    }

    fn start_control(&mut self, peer: PeerId, bytes: Vec<u8>, slot: Arc<OpSlot>) {
        let ep = match self.ep_of(peer) {
            Ok(ep) => ep,
            Err(_) => {
                slot.stop_reason.store(STOP_PEER, Ordering::Release);
                return self.finish_slot(&slot, sys::UCS_ERR_NOT_CONNECTED, 0);
            }
        };
        // The payload must outlive the send: it is kept in a box owned by the callback.
        let ctx = Box::new(ControlSend {
            slot: slot.clone(),
            bytes,
        });
        let mut param = sys::ucp_request_param_t {
            op_attr_mask: sys::UCP_OP_ATTR_FIELD_CALLBACK
                | sys::UCP_OP_ATTR_FIELD_USER_DATA
                | sys::UCP_OP_ATTR_FIELD_FLAGS
                | sys::UCP_OP_ATTR_FLAG_NO_IMM_CMPL,
            flags: sys::UCP_AM_SEND_FLAG_EAGER | sys::UCP_AM_SEND_FLAG_REPLY,
            ..Default::default()
        };
        param.cb.send = Some(control_send_cb);
        let (data, len) = (ctx.bytes.as_ptr(), ctx.bytes.len());
        param.user_data = Box::into_raw(ctx) as *mut c_void;
        let header = self.shared.uid_le.as_ptr() as *const c_void;
        // SAFETY: `data` lives in the box until control_send_cb frees it (or below on error);
        // the 8-byte header (our uid) lives in `shared` for the agent's life.
        let ptr = unsafe {
            sys::ucp_am_send_nbx(
                ep,
                AM_CONTROL_ID,
                header,
                8,
                data as *const c_void,
                len,
                &param,
            )
        };
        if sys::ptr_is_ptr(ptr) {
            if slot.state.lock().is_none() {
                slot.request.store(ptr, Ordering::Release);
            }
        } else {
            // SAFETY: the callback will not run: reclaim the box made above.
            drop(unsafe { Box::from_raw(param.user_data as *mut ControlSend) });
            let st = if sys::ptr_is_err(ptr) {
                sys::ptr_status(ptr)
            } else {
                sys::UCS_OK
            };
            self.finish_slot(&slot, st, len);
        }
    }

    fn handle_callbacks(&mut self) -> usize {
        let evs = CB_EVENTS.with(|q| std::mem::take(&mut *q.borrow_mut()));
        let n = evs.len();
        for ev in evs {
            match ev {
                CbEvent::ConnRequest(req) => match self.connect(Target::Request(req)) {
                    Ok(peer) => self.shared.push_event(Event::Accepted(peer)),
                    Err(e) => tracing::warn!("accepting a connection failed: {e}"),
                },
                CbEvent::EpError(peer, status) => self.fail_peer(peer, status, false),
                CbEvent::Bind(uid, address) => {
                    if !self.uid_to_peer.contains_key(&uid) {
                        match self.connect(Target::Worker(&address)) {
                            Ok(peer) => {
                                self.uid_to_peer.insert(uid, peer.0);
                                self.shared.push_event(Event::Accepted(peer));
                            }
                            Err(e) => tracing::warn!("connecting back to a peer failed: {e}"),
                        }
                    }
                }
                CbEvent::Drain(ep, uid, tag) => {
                    let peer = self
                        .uid_to_peer
                        .get(&uid)
                        .copied()
                        .or_else(|| self.ep_to_peer.get(&(ep as usize)).copied());
                    if let Some(peer) = peer {
                        self.drain(peer, tag);
                    }
                }
                CbEvent::Control(ep, uid, bytes) => {
                    let peer = self.uid_to_peer.get(&uid).copied().or_else(|| {
                        let p = self.ep_to_peer.get(&(ep as usize)).copied()?;
                        self.uid_to_peer.insert(uid, p);
                        Some(p)
                    });
                    match peer {
                        Some(peer) if !self.peers[&peer].failed => {
                            self.shared.push_event(Event::Control(PeerId(peer), bytes))
                        }
                        Some(_) => {
                            self.shared
                                .stats
                                .stale_control_dropped
                                .fetch_add(1, Ordering::Relaxed);
                        }
                        None => {
                            tracing::warn!(
                                uid,
                                "control message from an agent with no endpoint: dropped"
                            );
                            self.shared
                                .stats
                                .stale_control_dropped
                                .fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            }
        }
        n
    }

    /// Moves a peer to FAILED, cancels the receives posted for it, and (when forced, or when UCX
    /// reported the error) closes its endpoint so its sends end too.
    fn fail_peer(&mut self, peer: u64, status: sys::ucs_status_t, forced: bool) {
        let Some(entry) = self.peers.get_mut(&peer) else {
            return;
        };
        let first = !entry.failed;
        entry.failed = true;
        // Forget which agent this was: if it connects again it gets a fresh peer.
        self.uid_to_peer.retain(|_, p| *p != peer);
        let ep = if first { entry.ep.take() } else { None };
        self.shared.failed.lock().insert(PeerId(peer), true);
        if first {
            tracing::warn!(peer, forced, "peer failed: {}", sys::status_str(status));
            self.shared.push_event(Event::PeerFailed(PeerId(peer)));
        }
        let slots: Vec<Arc<OpSlot>> = self
            .shared
            .in_flight
            .lock()
            .values()
            .filter_map(Weak::upgrade)
            .filter(|s| s.peer.0 == peer)
            .collect();
        for s in &slots {
            let _ = s.stop_reason.compare_exchange(
                STOP_NONE,
                STOP_PEER,
                Ordering::AcqRel,
                Ordering::Acquire,
            );
            let req = s.request.load(Ordering::Acquire);
            if !req.is_null() {
                // SAFETY: live request of this worker (see cancel_op).
                unsafe { sys::ucp_request_cancel(self.worker.0, req) };
            }
        }
        if let Some(ep) = ep {
            // Dropping the endpoint force-closes it: every send still on it ends.
            self.ep_to_peer.remove(&(ep.ep as usize));
            drop(ep);
        }
    }

    fn teardown(&mut self) {
        // Close the queue (later submits fail at once) and end what never ran; then stop every
        // op, then close every endpoint; the worker and context go when `self` drops.
        let leftovers: Vec<Cmd> = {
            let mut q = self.shared.cmds.lock();
            q.closed = true;
            q.items.drain(..).collect()
        };
        for cmd in leftovers {
            self.shared.fail_cmd(cmd);
        }
        let slots: Vec<Arc<OpSlot>> = self
            .shared
            .in_flight
            .lock()
            .values()
            .filter_map(Weak::upgrade)
            .collect();
        for s in &slots {
            let _ = s.stop_reason.compare_exchange(
                STOP_NONE,
                STOP_SHUTDOWN,
                Ordering::AcqRel,
                Ordering::Acquire,
            );
            let req = s.request.load(Ordering::Acquire);
            if !req.is_null() {
                // SAFETY: live request of this worker.
                unsafe { sys::ucp_request_cancel(self.worker.0, req) };
            }
        }
        self.rkeys.clear();
        for entry in self.peers.values_mut() {
            drop(entry.ep.take());
        }
        self.ep_to_peer.clear();
        for _ in 0..100 {
            // SAFETY: progress on this thread's own worker.
            if unsafe { sys::ucp_worker_progress(self.worker.0) } == 0 {
                break;
            }
        }
        self.handle_callbacks_discard();
        for s in slots.iter().chain(self.drains.iter()) {
            // Any op UCX still holds is failed for its waiter; UCX is about to be destroyed.
            s.complete(sys::UCS_ERR_CANCELED, 0);
        }
        self.listener = None;
        self.maps.clear();
    }

    fn handle_callbacks_discard(&mut self) {
        let evs = CB_EVENTS.with(|q| std::mem::take(&mut *q.borrow_mut()));
        for ev in evs {
            if let CbEvent::ConnRequest(req) = ev {
                // SAFETY: an unanswered connection request of our listener.
                if let Some(l) = &self.listener {
                    unsafe { sys::ucp_listener_reject(l.0, req) };
                }
            }
        }
    }
}

impl Shared {
    fn cmds_pending(&self) -> bool {
        !self.cmds.lock().items.is_empty()
    }
}

fn finish_slot(shared: &Shared, slot: &OpSlot, status: sys::ucs_status_t, len: usize) {
    if slot.id == 0 {
        // An internal drain receive: not user work, not counted.
        return slot.complete(status, len);
    }
    if slot.control {
        shared.in_flight.lock().remove(&slot.id);
        return slot.complete(status, len);
    }
    if status == sys::UCS_OK {
        shared.stats.ops_completed.fetch_add(1, Ordering::Relaxed);
        shared
            .stats
            .bytes_completed
            .fetch_add(len as u64, Ordering::Relaxed);
        let ns = shared.epoch.elapsed().as_nanos() as u64;
        shared
            .stats
            .last_completion_ns
            .store(ns.max(1), Ordering::Relaxed);
    } else {
        shared.stats.ops_failed.fetch_add(1, Ordering::Relaxed);
    }
    shared.in_flight.lock().remove(&slot.id);
    slot.complete(status, len);
    if slot.notify {
        shared.push_event(Event::OpDone(slot.id));
    }
}

enum Target<'a> {
    Sock(SocketAddr),
    Worker(&'a [u8]),
    Request(sys::ucp_conn_request_h),
}

struct ControlSend {
    slot: Arc<OpSlot>,
    bytes: Vec<u8>,
}

thread_local! {
    /// The progress thread's shared state, for callbacks that complete slots.
    static SHARED: RefCell<Option<Arc<Shared>>> = const { RefCell::new(None) };
}

fn with_shared(f: impl FnOnce(&Shared)) {
    SHARED.with(|s| {
        if let Some(sh) = s.borrow().as_ref() {
            f(sh)
        }
    })
}

unsafe extern "C" fn send_cb(
    request: *mut c_void,
    status: sys::ucs_status_t,
    user_data: *mut c_void,
) {
    let slot = Arc::from_raw(user_data as *const OpSlot);
    slot.request.store(std::ptr::null_mut(), Ordering::Release);
    sys::ucp_request_free(request);
    let len = slot.expected_len;
    with_shared(|sh| finish_slot(sh, &slot, status, len));
}

unsafe extern "C" fn recv_cb(
    request: *mut c_void,
    status: sys::ucs_status_t,
    info: *const sys::ucp_tag_recv_info_t,
    user_data: *mut c_void,
) {
    let slot = Arc::from_raw(user_data as *const OpSlot);
    slot.request.store(std::ptr::null_mut(), Ordering::Release);
    let len = if info.is_null() { 0 } else { (*info).length };
    sys::ucp_request_free(request);
    with_shared(|sh| finish_slot(sh, &slot, status, len));
}

unsafe extern "C" fn control_send_cb(
    request: *mut c_void,
    status: sys::ucs_status_t,
    user_data: *mut c_void,
) {
    let ctx = Box::from_raw(user_data as *mut ControlSend);
    ctx.slot
        .request
        .store(std::ptr::null_mut(), Ordering::Release);
    sys::ucp_request_free(request);
    let len = ctx.bytes.len();
    with_shared(|sh| finish_slot(sh, &ctx.slot, status, len));
}

unsafe extern "C" fn drain_sent_cb(
    request: *mut c_void,
    _status: sys::ucs_status_t,
    user_data: *mut c_void,
) {
    drop(Box::from_raw(user_data as *mut Vec<u8>));
    sys::ucp_request_free(request);
}

unsafe extern "C" fn am_drain_cb(
    _arg: *mut c_void,
    header: *const c_void,
    header_length: usize,
    data: *mut c_void,
    length: usize,
    param: *const sys::ucp_am_recv_param_t,
) -> sys::ucs_status_t {
    if header_length != 8 || length != 8 || data.is_null() {
        return sys::UCS_OK;
    }
    let uid = u64::from_le_bytes(
        std::slice::from_raw_parts(header as *const u8, 8)
            .try_into()
            .unwrap(),
    );
    let tag = u64::from_le_bytes(
        std::slice::from_raw_parts(data as *const u8, 8)
            .try_into()
            .unwrap(),
    );
    push_cb(CbEvent::Drain((*param).reply_ep, uid, tag));
    sys::UCS_OK
}

type AmCb = unsafe extern "C" fn(
    *mut c_void,
    *const c_void,
    usize,
    *mut c_void,
    usize,
    *const sys::ucp_am_recv_param_t,
) -> sys::ucs_status_t;

unsafe extern "C" fn am_bind_cb(
    _arg: *mut c_void,
    header: *const c_void,
    header_length: usize,
    data: *mut c_void,
    length: usize,
    param: *const sys::ucp_am_recv_param_t,
) -> sys::ucs_status_t {
    let rndv = (*param).recv_attr & (sys::UCP_AM_RECV_ATTR_FLAG_RNDV as u64) != 0;
    if header_length != 8 || length == 0 || length > 64 * 1024 || data.is_null() || rndv {
        return sys::UCS_OK;
    }
    let uid = u64::from_le_bytes(
        std::slice::from_raw_parts(header as *const u8, 8)
            .try_into()
            .unwrap(),
    );
    let addr = std::slice::from_raw_parts(data as *const u8, length).to_vec();
    push_cb(CbEvent::Bind(uid, addr));
    sys::UCS_OK
}

unsafe extern "C" fn ep_err_cb(arg: *mut c_void, _ep: sys::ucp_ep_h, status: sys::ucs_status_t) {
    push_cb(CbEvent::EpError(arg as usize as u64, status));
}

unsafe extern "C" fn conn_cb(req: sys::ucp_conn_request_h, _arg: *mut c_void) {
    push_cb(CbEvent::ConnRequest(req));
}

unsafe extern "C" fn am_control_cb(
    _arg: *mut c_void,
    header: *const c_void,
    header_length: usize,
    data: *mut c_void,
    length: usize,
    param: *const sys::ucp_am_recv_param_t,
) -> sys::ucs_status_t {
    let p = &*param;
    // Control messages are sent eagerly, so the data is here now; anything else is dropped.
    if p.recv_attr & (sys::UCP_AM_RECV_ATTR_FLAG_RNDV as u64) != 0
        || data.is_null()
        || length > MAX_CONTROL
        || header_length != 8
    {
        return sys::UCS_OK;
    }
    let uid = u64::from_le_bytes(
        std::slice::from_raw_parts(header as *const u8, 8)
            .try_into()
            .unwrap(),
    );
    let bytes = std::slice::from_raw_parts(data as *const u8, length).to_vec();
    push_cb(CbEvent::Control(p.reply_ep, uid, bytes));
    sys::UCS_OK
}

/// A 64-bit id unique to this agent instance: time, pid and a process-wide counter mixed.
fn fresh_uid() -> u64 {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let mut x = t
        ^ ((std::process::id() as u64) << 32)
        ^ COUNTER
            .fetch_add(1, Ordering::Relaxed)
            .wrapping_mul(0x9E37_79B9_7F4A_7C15);
    // splitmix64 finaliser
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

fn sockaddr_of(addr: SocketAddr) -> (libc::sockaddr_storage, u32) {
    // SAFETY: sockaddr_storage is plain old data; zeroed is a valid value.
    let mut storage: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let len = match addr {
        SocketAddr::V4(a) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: a.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from_ne_bytes(a.ip().octets()),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_storage is large enough and suitably aligned for sockaddr_in.
            unsafe { std::ptr::write(&mut storage as *mut _ as *mut libc::sockaddr_in, sin) };
            std::mem::size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(a) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: a.port().to_be(),
                sin6_flowinfo: a.flowinfo(),
                sin6_addr: libc::in6_addr {
                    s6_addr: a.ip().octets(),
                },
                sin6_scope_id: a.scope_id(),
            };
            // SAFETY: as above, for sockaddr_in6.
            unsafe { std::ptr::write(&mut storage as *mut _ as *mut libc::sockaddr_in6, sin6) };
            std::mem::size_of::<libc::sockaddr_in6>()
        }
    };
    (storage, len as u32)
}

/// # Safety
/// `s` must point to an initialised sockaddr_storage.
unsafe fn sockaddr_port(s: *const libc::sockaddr_storage) -> u16 {
    match (*s).ss_family as c_int {
        libc::AF_INET => u16::from_be((*(s as *const libc::sockaddr_in)).sin_port),
        libc::AF_INET6 => u16::from_be((*(s as *const libc::sockaddr_in6)).sin6_port),
        _ => 0,
    }
}
