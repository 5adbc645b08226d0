//! The blocking connection surface over the protocol core and the UCX agent.
//!
//! One [`Engine`] per rank: a UCX [`Agent`], the sans-IO [`Endpoint`], and a driver thread that
//! feeds the endpoint everything the agent reports (control messages, op completions, peer
//! failures) and fires its deadlines whether or not any new work arrives. Callers block in
//! `send`, `wait`, `recv_ready`, `next_advertisement` and `wait_for_notification`, each with a
//! deadline and an optional cancel check, on a condition variable: no lock is held across a
//! wait and no thread spins.
//!
//! The data path of one request:
//! 1. generation rank: [`Engine::advertise`] posts one tag-matched receive per buffer (tag = a
//!    fresh 64-bit token) and starts the request in the endpoint, which sends `Advertise`;
//! 2. context rank: [`Engine::next_advertisement`] returns it; [`Engine::accept`] answers
//!    `Ready`; [`Engine::send`] sends each segment under its token;
//! 3. generation rank: each receive's own completion is the segment landing; when all have
//!    landed the ranks agree and [`Engine::wait`] returns `Completed`. A timeout, cancel or peer
//!    loss on any rank becomes the agreed verdict instead, and buffers are released only when
//!    their receives are reaped (or fenced when a peer is lost).
#![deny(unsafe_op_in_unsafe_fn)]

use crate::error::{Error, ErrorKind, Outcome, Result};
use crate::proto::pool::{BufferPool, Lease};
use crate::proto::{
    Action, BufferDesc, BufferKind, Config, Endpoint, Event as ProtoEvent, Message, RankId,
    ReceiveFlow, ReceiveSpec, RequestKey, Role, Token, TokenAllocator,
};
use crate::transport::cuda::Staging;
use crate::transport::{Agent, AgentOptions, Event, Op, PeerId, TransportKind};
use parking_lot::{Condvar, Mutex, MutexGuard};
use std::collections::{HashMap, HashSet, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Configuration of one rank's engine.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Agent name (for logs and the peer's `Hello`).
    pub name: String,
    /// This rank's id, unique across both engines of a deployment.
    pub rank: u32,
    pub transport: TransportKind,
    /// tcp: listen here (`ip:port`, port 0 picks one). Shared memory connects by worker address.
    pub listen: Option<SocketAddr>,
    /// Per-request deadline: TensorRT-LLM's `kv_transfer_timeout_ms`.
    pub timeout: Duration,
    /// Extra time past a deadline for the ranks to agree before the verdict is `PeerLost`.
    pub agreement_bound: Duration,
    /// Fault hooks for tests and the demo.
    pub faults: Faults,
}

impl EngineConfig {
    pub fn new(name: impl Into<String>, rank: u32, transport: TransportKind) -> Self {
        EngineConfig {
            name: name.into(),
            rank,
            transport,
            listen: None,
            timeout: Duration::from_secs(60),
            agreement_bound: Duration::from_secs(2),
            faults: Faults::default(),
        }
    }
}

/// Faults a test can inject.
#[derive(Clone, Debug, Default)]
pub struct Faults {
    /// A sender "sends" this request's segments without moving any data: the lost-completion
    /// fault. The receiver must end in `TimedOut` at its deadline.
    pub suppress_data_of_request: Option<u64>,
}

/// One buffer a generation rank offers for a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BufferSpec {
    pub kind: BufferKind,
    pub segment: u32,
    pub addr: u64,
    pub len: u64,
    /// CUDA device, or -1 for host memory.
    pub device_id: i32,
}

/// An advertisement received by a context rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Advertisement {
    pub key: RequestKey,
    pub from: RankId,
    pub request_info: Vec<u8>,
    pub buffers: Vec<BufferDesc>,
}

/// The progress snapshot: "alive" told from "working".
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Health {
    pub peers: u64,
    pub peers_failed: u64,
    /// Requests known to the protocol core (running or lingering).
    pub requests_known: u64,
    pub completed: u64,
    pub failed: u64,
    pub stale_dropped: u64,
    pub bad_frames: u64,
    /// Receive buffers still leased to a request (0 when idle: anything else is a leak).
    pub buffers_leased: u64,
    pub buffers_fenced: u64,
    /// Transport ops in flight and the age of the oldest, in milliseconds.
    pub ops_in_flight: u64,
    pub oldest_op_ms: u64,
    /// Milliseconds since the last completed transfer (u64::MAX if none yet).
    pub since_last_completion_ms: u64,
    pub bytes_completed: u64,
    pub unreaped_ops: u64,
}

const POOL_SLOTS: u32 = 1 << 16;
const IDLE_TICK: Duration = Duration::from_millis(100);
/// How long an agreed outcome or ready answer waits for someone to take it.
const RETENTION: Duration = Duration::from_secs(600);

struct RecvOp {
    key: RequestKey,
    segment: u32,
    peer: PeerId,
    op: Op,
    /// For a CUDA buffer: the pinned host buffer the receive lands in, and the device address
    /// it is copied to before the segment counts as landed.
    staged: Option<(Staging, u64)>,
    len: usize,
    token: Token,
}

/// What to do with a receive's buffer once UCX has released the receive, for receives the
/// protocol core no longer tracks (fenced, or posted for a request that never started).
enum OnReap {
    Restore(crate::proto::pool::BufferId),
    Release(Lease),
}

#[derive(Default)]
struct Peers {
    rank_of: HashMap<PeerId, RankId>,
    peer_of: HashMap<RankId, PeerId>,
    names: HashMap<RankId, String>,
    failed: HashSet<RankId>,
    hello_sent: HashSet<PeerId>,
}

struct Core {
    ep: Endpoint,
    pool: BufferPool,
    tokens: TokenAllocator,
    peers: Peers,
    recv_ops: HashMap<u64, RecvOp>,
    by_token: HashMap<Token, u64>,
    permits: HashMap<(RequestKey, RankId, u32), BufferDesc>,
    aborts: HashSet<(RequestKey, RankId, u32)>,
    adverts: VecDeque<Advertisement>,
    readies: HashMap<RequestKey, (bool, Instant)>,
    /// Agreed ends, kept until a waiter takes them (or for `RETENTION`).
    terminals: HashMap<(RequestKey, Role), (Outcome, Instant)>,
    /// Receiver terminals held back until their fenced receives are released by UCX.
    deferred: HashMap<RequestKey, Outcome>,
    fencing: HashMap<RequestKey, HashSet<u64>>,
    /// Receives whose cancel the core asked for (any other cancelled receive was drained by its
    /// sender).
    core_cancelled: HashSet<u64>,
    /// Keys that reached a terminal state here, kept for `RETENTION` after the core forgets
    /// them: a replay of one is refused, and a late advertisement of one is dropped.
    finished: HashMap<(RequestKey, Option<RankId>), Instant>,
    replays_dropped: u64,
    on_reap: HashMap<u64, OnReap>,
    last_prune: Instant,
    notes: HashMap<RankId, VecDeque<(RequestKey, Vec<u8>)>>,
    control_ops: Vec<Op>,
    bad_frames: u64,
}

struct Inner {
    agent: Agent,
    me: RankId,
    name: String,
    faults: Faults,
    agreement_bound: Duration,
    timeout: Duration,
    core: Mutex<Core>,
    cv: Condvar,
    stopping: AtomicBool,
}

/// One rank: agent, protocol core, driver thread. Dropping it stops the driver, then the agent
/// (which cancels and reaps every op).
pub struct Engine {
    inner: Arc<Inner>,
    driver: Option<JoinHandle<()>>,
}

fn key_err(kind: ErrorKind, key: RequestKey, what: &str) -> Error {
    Error::new(kind, format!("{key}: {what}"))
}

impl Engine {
    pub fn new(cfg: EngineConfig) -> Result<Engine> {
        if cfg.timeout.is_zero() {
            return Err(Error::invalid("timeout must be positive"));
        }
        let mut opts = AgentOptions::new(cfg.name.clone(), cfg.transport);
        opts.listen = cfg.listen;
        let agent = Agent::new(opts)?;
        let me = RankId(cfg.rank);
        let config = Config {
            timeout: cfg.timeout,
            agreement_bound: cfg.agreement_bound,
            ..Config::default()
        };
        let core = Core {
            ep: Endpoint::new(me, config),
            pool: BufferPool::new(POOL_SLOTS),
            tokens: TokenAllocator::new(),
            peers: Peers::default(),
            recv_ops: HashMap::new(),
            by_token: HashMap::new(),
            permits: HashMap::new(),
            aborts: HashSet::new(),
            adverts: VecDeque::new(),
            readies: HashMap::new(),
            terminals: HashMap::new(),
            deferred: HashMap::new(),
            fencing: HashMap::new(),
            core_cancelled: HashSet::new(),
            finished: HashMap::new(),
            replays_dropped: 0,
            on_reap: HashMap::new(),
            last_prune: Instant::now(),
            notes: HashMap::new(),
            control_ops: Vec::new(),
            bad_frames: 0,
        };
        let inner = Arc::new(Inner {
            agent,
            me,
            name: cfg.name,
            faults: cfg.faults,
            agreement_bound: cfg.agreement_bound,
            timeout: cfg.timeout,
            core: Mutex::new(core),
            cv: Condvar::new(),
            stopping: AtomicBool::new(false),
        });
        let i2 = inner.clone();
        let driver = std::thread::Builder::new()
            .name(format!("kvlink-driver-{}", cfg.rank))
            .spawn(move || i2.drive())
            .map_err(|e| Error::new(ErrorKind::Internal, format!("spawn: {e}")))?;
        Ok(Engine {
            inner,
            driver: Some(driver),
        })
    }

    pub fn rank(&self) -> RankId {
        self.inner.me
    }

    /// Where peers reach this rank: `ip:port` (tcp) or `ucx:<hex worker address>`.
    pub fn address(&self) -> String {
        match self.inner.agent.listen_address() {
            Some(a) => a.to_string(),
            None => format!("ucx:{}", hex(self.inner.agent.worker_address())),
        }
    }

    /// Connects to the rank at `address` (as printed by [`Engine::address`]) and waits, until
    /// `deadline`, for its `Hello`. Returns its rank.
    pub fn connect(&self, address: &str, deadline: Instant) -> Result<RankId> {
        let peer = match address.strip_prefix("ucx:") {
            Some(h) => self.inner.agent.connect_worker(&unhex(h)?)?,
            None => self
                .inner
                .agent
                .connect(crate::config::parse_listen_address(address)?)?,
        };
        {
            let mut core = self.inner.core.lock();
            self.inner.say_hello(&mut core, peer)?;
        }
        let mut core = self.inner.core.lock();
        loop {
            if let Some(&r) = core.peers.rank_of.get(&peer) {
                return Ok(r);
            }
            if self.inner.agent.peer_state(peer).is_err() {
                return Err(Error::new(
                    ErrorKind::PeerLost,
                    format!("{address}: connection failed"),
                ));
            }
            if self.inner.cv.wait_until(&mut core, deadline).timed_out() {
                return Err(Error::new(
                    ErrorKind::PeerLost,
                    format!("{address}: no hello before the deadline"),
                ));
            }
        }
    }

    /// Waits until a rank has connected to us (its `Hello` arrived); returns it.
    pub fn wait_peer(&self, rank: RankId, deadline: Instant) -> Result<()> {
        let mut core = self.inner.core.lock();
        while !core.peers.peer_of.contains_key(&rank) {
            if self.inner.cv.wait_until(&mut core, deadline).timed_out() {
                return Err(Error::new(
                    ErrorKind::UnknownPeer,
                    format!("{rank} did not connect"),
                ));
            }
        }
        Ok(())
    }

    /// The name a connected rank gave in its `Hello`.
    pub fn peer_name(&self, rank: RankId) -> Option<String> {
        self.inner.core.lock().peers.names.get(&rank).cloned()
    }

    /// Generation side: posts a receive for every buffer and advertises the request to each
    /// sender. `receivers` lists every generation rank of the request (this one included);
    /// `flows` gives, per context rank, the buffers it will fill. On error nothing stays posted.
    ///
    /// # Safety
    /// Every buffer must be writable host memory that nobody else touches until [`Engine::wait`]
    /// for `key` has returned (the request's buffers are released by then, or fenced).
    pub unsafe fn advertise(
        &self,
        key: RequestKey,
        receivers: Vec<RankId>,
        flows: Vec<(RankId, Vec<BufferSpec>)>,
        request_info: Vec<u8>,
    ) -> Result<()> {
        if flows.is_empty() || flows.iter().any(|(_, b)| b.is_empty()) {
            return Err(Error::invalid(format!(
                "{key}: a request needs at least one buffer per sender"
            )));
        }
        let mut core = self.inner.core.lock();
        if core.finished.contains_key(&(key, None)) {
            return Err(Error::invalid(format!(
                "{key} has already run here: a retry needs the next generation"
            )));
        }
        let mut posted: Vec<(u64, Lease)> = Vec::new();
        let result = (|| {
            let mut spec_flows = Vec::new();
            for (sender, buffers) in &flows {
                let peer = *core.peers.peer_of.get(sender).ok_or_else(|| {
                    Error::new(ErrorKind::UnknownPeer, format!("{sender} is not connected"))
                })?;
                let mut flow = ReceiveFlow {
                    sender: *sender,
                    buffers: Vec::new(),
                };
                for b in buffers {
                    if b.addr == 0 || b.len == 0 || b.addr.checked_add(b.len).is_none() {
                        return Err(Error::new(
                            ErrorKind::OutOfBounds,
                            format!("{key}: bad buffer {b:?}"),
                        ));
                    }
                    // The system UCX cannot move device memory: a CUDA buffer's receive lands
                    // in a pinned host buffer that is copied to the device on arrival.
                    let len =
                        usize::try_from(b.len).map_err(|_| Error::invalid("buffer too large"))?;
                    let mut staged = match b.device_id {
                        d if d >= 0 => Some((Staging::new(d, len)?, b.addr)),
                        _ => None,
                    };
                    let target = match &mut staged {
                        Some((st, _)) => st.host_ptr()?,
                        None => b.addr as *mut u8,
                    };
                    let token = core
                        .tokens
                        .allocate()
                        .ok_or_else(|| Error::new(ErrorKind::Internal, "tokens exhausted"))?;
                    let lease = core.pool.lease(key).ok_or_else(|| {
                        Error::new(ErrorKind::Accounting, "buffer pool exhausted")
                    })?;
                    // SAFETY: the caller's promise above covers the buffer until the request ends
                    // (a staging buffer lives in the RecvOp); the endpoint releases it only after
                    // this receive is reaped.
                    let op = unsafe {
                        self.inner
                            .agent
                            .post_recv_with(peer, token.0, target, len, true)
                    }?;
                    let id = op.id();
                    posted.push((id, lease));
                    core.by_token.insert(token, id);
                    core.recv_ops.insert(
                        id,
                        RecvOp {
                            key,
                            segment: b.segment,
                            peer,
                            op,
                            staged,
                            len,
                            token,
                        },
                    );
                    flow.buffers.push((
                        lease,
                        BufferDesc {
                            kind: b.kind,
                            segment: b.segment,
                            addr: b.addr,
                            len: b.len,
                            device_id: b.device_id,
                            token,
                        },
                    ));
                }
                spec_flows.push(flow);
            }
            core.ep.start_receive(
                Instant::now(),
                ReceiveSpec {
                    key,
                    receivers,
                    flows: spec_flows,
                    request_info,
                },
            )
        })();
        if result.is_err() {
            // Nothing was started: take back every posted receive and lease.
            // The lease goes back only once UCX has released the receive.
            for (id, lease) in posted {
                if let Some(r) = core.recv_ops.get(&id) {
                    r.op.request_cancel();
                    core.on_reap.insert(id, OnReap::Release(lease));
                }
            }
        }
        self.inner.flush(&mut core);
        result
    }

    /// Context side: the next advertisement, waiting until `deadline` or `cancel()`.
    pub fn next_advertisement(
        &self,
        deadline: Instant,
        cancel: Option<&dyn Fn() -> bool>,
    ) -> Option<Advertisement> {
        self.inner
            .wait_for(deadline, cancel, |core| core.adverts.pop_front())
    }

    /// Context side: accept (`ready`) or reject an advertisement before any data moves.
    pub fn accept(&self, key: RequestKey, from: RankId, ready: bool) -> Result<()> {
        let mut core = self.inner.core.lock();
        let r = core.ep.accept(Instant::now(), key, from, ready);
        self.inner.flush(&mut core);
        r
    }

    /// Generation side: the context rank's answer: `Some(true)` ready, `Some(false)` rejected,
    /// `None` if none came by `deadline` (or `cancel()`).
    pub fn recv_ready(
        &self,
        key: RequestKey,
        deadline: Instant,
        cancel: Option<&dyn Fn() -> bool>,
    ) -> Option<bool> {
        self.inner.wait_for(deadline, cancel, |core| {
            core.readies.remove(&key).map(|(r, _)| r).or_else(|| {
                match core.terminals.get(&(key, Role::Receiver)) {
                    Some((Outcome::Rejected, _)) => Some(false),
                    _ => None,
                }
            })
        })
    }

    /// Context side: sends segment `segment` of `key` to `to` from `data`, once the request has
    /// been accepted. Returns `Completed` when this rank's tracked send completed; any other
    /// outcome is reported to the protocol core, which turns it into the agreed verdict.
    pub fn send(
        &self,
        key: RequestKey,
        to: RankId,
        segment: u32,
        data: &[u8],
        deadline: Instant,
        cancel: Option<&dyn Fn() -> bool>,
    ) -> Result<Outcome> {
        let inner = &self.inner;
        let desc = inner.wait_for(deadline, cancel, |core| {
            if let Some(d) = core.permits.remove(&(key, to, segment)) {
                return Some(Ok(d));
            }
            core.terminals
                .get(&(key, Role::Sender { receiver: to }))
                .map(|&(o, _)| Err(o))
        });
        let desc = match desc {
            None => {
                let o = if cancel.is_some_and(|c| c()) {
                    Outcome::Cancelled
                } else {
                    Outcome::TimedOut
                };
                self.fail_request(key, o);
                return Ok(o);
            }
            Some(Err(o)) => return Ok(o),
            Some(Ok(d)) => d,
        };
        if data.len() as u64 != desc.len {
            let mut core = inner.core.lock();
            let _ = core
                .ep
                .handle_send_done(Instant::now(), key, to, segment, false);
            inner.flush(&mut core);
            return Err(key_err(
                ErrorKind::InvalidArgument,
                key,
                &format!(
                    "segment {segment} is {} bytes at the receiver, {} given",
                    desc.len,
                    data.len()
                ),
            ));
        }
        let outcome = if inner.faults.suppress_data_of_request == Some(key.request.0) {
            tracing::warn!(%key, segment, "fault hook: data suppressed");
            Ok(Outcome::Completed)
        } else {
            let peer = inner.core.lock().peers.peer_of.get(&to).copied();
            match peer {
                None => Ok(Outcome::PeerLost),
                Some(peer) => {
                    // SAFETY: `data` is borrowed for this call, and the wait below returns only once
                    // the op has ended or been stopped (and reaped: see Op::wait).
                    match unsafe {
                        inner
                            .agent
                            .post_send(peer, desc.token.0, data.as_ptr(), data.len())
                    } {
                        Ok(mut op) => {
                            let aborted = || {
                                cancel.is_some_and(|c| c())
                                    || inner.core.lock().aborts.contains(&(key, to, segment))
                            };
                            op.wait(deadline, Some(&aborted))
                        }
                        // Reported to the core like any other failed send (below).
                        Err(e) if e.kind == ErrorKind::PeerLost => Ok(Outcome::PeerLost),
                        Err(e) => Err(e),
                    }
                }
            }
        };
        let ok = matches!(outcome, Ok(Outcome::Completed));
        let mut core = inner.core.lock();
        core.aborts.remove(&(key, to, segment));
        let now = Instant::now();
        // This rank's reason goes first: the core takes a failed send with no reason given as a
        // lost peer, and the first vote is the one that counts.
        if let Ok(o @ (Outcome::TimedOut | Outcome::Cancelled)) = outcome {
            let _ = core.ep.give_up(now, key, o);
        }
        let _ = core.ep.handle_send_done(now, key, to, segment, ok);
        inner.flush(&mut core);
        outcome
    }

    /// [`Engine::send`] for data in CUDA device memory: staged through a pinned host buffer
    /// (device -> host copy, then the tagged send), since the system UCX cannot read device
    /// memory. `ErrorKind::Cuda` where no driver or no such device exists.
    #[allow(clippy::too_many_arguments)]
    pub fn send_device(
        &self,
        key: RequestKey,
        to: RankId,
        segment: u32,
        device: i32,
        device_addr: u64,
        len: usize,
        deadline: Instant,
        cancel: Option<&dyn Fn() -> bool>,
    ) -> Result<Outcome> {
        let mut staging = Staging::new(device, len)?;
        staging.from_device(device_addr, len)?;
        self.send(key, to, segment, staging.host_slice(len)?, deadline, cancel)
    }

    /// Waits for the agreed end of `key` on this rank as `role`. Past `deadline` (or on
    /// `cancel()`) the request is cancelled, and the agreed verdict is awaited for at most the
    /// agreement bound; `TimedOut`/`Cancelled` is returned if even that does not come.
    pub fn wait(
        &self,
        key: RequestKey,
        role: Role,
        deadline: Instant,
        cancel: Option<&dyn Fn() -> bool>,
    ) -> Outcome {
        let done = |core: &mut Core| core.terminals.remove(&(key, role)).map(|(o, _)| o);
        if let Some(o) = self.inner.wait_for(deadline, cancel, done) {
            return o;
        }
        let cancelled = cancel.is_some_and(|c| c());
        self.fail_request(
            key,
            if cancelled {
                Outcome::Cancelled
            } else {
                Outcome::TimedOut
            },
        );
        // The verdict is certain by the request's own bound (its deadline plus the agreement bound,
        // at most one timeout from now), and it comes only once no peer can write its buffers:
        // returning earlier would hand back memory UCX may still fill.
        let bound = Instant::now()
            + self.inner.timeout
            + self.inner.agreement_bound
            + Duration::from_secs(1);
        self.inner
            .wait_for(bound, None, done)
            .unwrap_or(if cancelled {
                Outcome::Cancelled
            } else {
                Outcome::TimedOut
            })
    }

    /// Cancels `key` on this rank; the cancel is agreed with every rank of the request.
    pub fn cancel(&self, key: RequestKey) -> Result<()> {
        let mut core = self.inner.core.lock();
        let r = core.ep.cancel(Instant::now(), key);
        self.inner.flush(&mut core);
        r
    }

    fn fail_request(&self, key: RequestKey, why: Outcome) {
        let mut core = self.inner.core.lock();
        let _ = core.ep.give_up(Instant::now(), key, why);
        self.inner.flush(&mut core);
    }

    /// Sends an ordered notification to `to`.
    pub fn notify(&self, to: RankId, key: RequestKey, payload: Vec<u8>) -> Result<()> {
        let mut core = self.inner.core.lock();
        if !core.peers.peer_of.contains_key(&to) {
            return Err(Error::new(
                ErrorKind::UnknownPeer,
                format!("{to} is not connected"),
            ));
        }
        core.ep.send_notify(key, to, payload)?;
        self.inner.flush(&mut core);
        Ok(())
    }

    /// The next notification from `from`, in the order sent; `None` at the deadline or cancel.
    pub fn wait_for_notification(
        &self,
        from: RankId,
        deadline: Instant,
        cancel: Option<&dyn Fn() -> bool>,
    ) -> Option<(RequestKey, Vec<u8>)> {
        self.inner.wait_for(deadline, cancel, |core| {
            core.notes.get_mut(&from).and_then(|q| q.pop_front())
        })
    }

    /// The progress snapshot.
    pub fn health(&self) -> Health {
        let s = self.inner.agent.stats();
        let core = self.inner.core.lock();
        let ps = core.ep.stats();
        Health {
            peers: core.peers.peer_of.len() as u64,
            peers_failed: core.peers.failed.len() as u64,
            requests_known: core.ep.known() as u64,
            completed: ps.completed,
            failed: ps.failed,
            stale_dropped: ps.stale_dropped + core.replays_dropped,
            bad_frames: ps.bad_frames + core.bad_frames,
            buffers_leased: core.pool.leased() as u64,
            buffers_fenced: core.pool.fenced() as u64,
            ops_in_flight: s.in_flight,
            oldest_op_ms: s.oldest_in_flight.map_or(0, |d| d.as_millis() as u64),
            since_last_completion_ms: s
                .since_last_completion
                .map_or(u64::MAX, |d| d.as_millis() as u64),
            bytes_completed: s.bytes_completed,
            unreaped_ops: s.unreaped,
        }
    }

    /// The engine's name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.inner.stopping.store(true, Ordering::Release);
        self.inner.cv.notify_all();
        if let Some(d) = self.driver.take() {
            let _ = d.join();
        }
    }
}

impl Inner {
    /// Waits on the condition variable until `f` yields, `deadline` passes or `cancel()` says
    /// so (checked every 5 ms when given).
    fn wait_for<T>(
        &self,
        deadline: Instant,
        cancel: Option<&dyn Fn() -> bool>,
        mut f: impl FnMut(&mut Core) -> Option<T>,
    ) -> Option<T> {
        let mut core = self.core.lock();
        loop {
            if let Some(v) = f(&mut core) {
                return Some(v);
            }
            if self.stopping.load(Ordering::Acquire) {
                return None;
            }
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            if let Some(c) = cancel {
                // The cancel check may take the core lock itself: release it while asking.
                let stop = MutexGuard::unlocked(&mut core, c);
                if stop {
                    return None;
                }
            }
            let until = if cancel.is_some() {
                deadline.min(now + Duration::from_millis(5))
            } else {
                deadline
            };
            self.cv.wait_until(&mut core, until);
        }
    }

    fn say_hello(&self, core: &mut Core, peer: PeerId) -> Result<()> {
        if !core.peers.hello_sent.insert(peer) {
            return Ok(());
        }
        let bytes = Message::Hello {
            agent_name: self.name.clone(),
            rank: self.me,
        }
        .to_bytes()?;
        let op = self.agent.send_control(peer, bytes)?;
        core.control_ops.push(op);
        Ok(())
    }

    /// The driver: feeds agent events to the endpoint and fires its deadlines.
    fn drive(self: Arc<Self>) {
        while !self.stopping.load(Ordering::Acquire) {
            let next = self.core.lock().ep.poll_timeout();
            let now = Instant::now();
            let wake = next.map_or(now + IDLE_TICK, |t| t.min(now + IDLE_TICK));
            let ev = self.agent.next_event(wake, None);
            let mut core = self.core.lock();
            let now = Instant::now();
            if let Some(ev) = ev {
                self.on_event(&mut core, now, ev);
            }
            if core.ep.poll_timeout().is_some_and(|t| t <= now) {
                core.ep.handle_timeout(now);
            }
            if now.duration_since(core.last_prune) > Duration::from_secs(1) {
                // Results nobody came for are dropped after RETENTION: memory stays bounded
                // over millions of requests.
                core.last_prune = now;
                core.terminals
                    .retain(|_, (_, at)| now.duration_since(*at) < RETENTION);
                core.readies
                    .retain(|_, (_, at)| now.duration_since(*at) < RETENTION);
                core.finished
                    .retain(|_, at| now.duration_since(*at) < RETENTION);
            }
            self.flush(&mut core);
        }
    }

    fn on_event(&self, core: &mut Core, now: Instant, ev: Event) {
        match ev {
            Event::Accepted(_) => {}
            Event::Control(peer, bytes) => match Message::decode(&bytes) {
                Ok(Message::Hello { agent_name, rank }) => {
                    if let Some(old) = core.peers.peer_of.insert(rank, peer) {
                        core.peers.rank_of.remove(&old);
                    }
                    core.peers.rank_of.insert(peer, rank);
                    core.peers.names.insert(rank, agent_name);
                    core.peers.failed.remove(&rank);
                    let _ = self.say_hello(core, peer);
                }
                Ok(msg) => match core.peers.rank_of.get(&peer).copied() {
                    Some(rank) => {
                        if let Message::Advertise { key, .. } = &msg {
                            if core.finished.contains_key(&(*key, Some(rank))) {
                                core.replays_dropped += 1;
                                return;
                            }
                        }
                        if let Message::Ready { key, ready } = &msg {
                            core.readies.insert(*key, (*ready, now));
                        }
                        if let Err(e) = core.ep.handle_message(now, rank, msg) {
                            tracing::warn!("control message from {rank}: {e}");
                        }
                    }
                    None => core.bad_frames += 1,
                },
                Err(e) => {
                    tracing::warn!("undecodable control message: {e}");
                    core.bad_frames += 1;
                }
            },
            Event::PeerFailed(peer) => {
                if let Some(&rank) = core.peers.rank_of.get(&peer) {
                    core.peers.failed.insert(rank);
                    core.ep.handle_peer_lost(now, rank);
                }
            }
            Event::OpDone(id) => {
                if let Some(mut r) = core.recv_ops.remove(&id) {
                    let result = r.op.poll();
                    core.by_token.remove(&r.token);
                    if let Some(act) = core.on_reap.remove(&id) {
                        // The core is done with this receive; only its buffer was waiting.
                        match act {
                            OnReap::Restore(b) => drop(core.pool.restore(b)),
                            OnReap::Release(l) => drop(core.pool.release(l)),
                        }
                        let cleared = core.fencing.get_mut(&r.key).is_some_and(|set| {
                            set.remove(&id);
                            set.is_empty()
                        });
                        if cleared {
                            core.fencing.remove(&r.key);
                            if let Some(o) = core.deferred.remove(&r.key) {
                                core.terminals.insert((r.key, Role::Receiver), (o, now));
                            }
                        }
                        return;
                    }
                    let res = match result {
                        Some(Ok(Outcome::Completed)) => {
                            match r.staged.as_mut().map(|(st, dev)| st.to_device(*dev, r.len)) {
                                Some(Err(e)) => {
                                    tracing::error!(key = %r.key, "segment {}: copy to device failed: {e}", r.segment);
                                    core.ep.cancel(now, r.key)
                                }
                                _ => core.ep.handle_segment_landed(now, r.key, r.segment),
                            }
                        }
                        Some(Err(e)) if e.kind == ErrorKind::Protocol => {
                            tracing::warn!(key = %r.key, "segment {}: {e}", r.segment);
                            let _ = core.ep.handle_receive_reaped(now, r.key, r.segment);
                            core.ep.cancel(now, r.key)
                        }
                        Some(Ok(Outcome::Cancelled)) if !core.core_cancelled.contains(&id) => {
                            // The sender gave up on this segment and had the receiver drain it:
                            // that is the sender's cancel, not a lost peer.
                            let _ = core.ep.give_up(now, r.key, Outcome::Cancelled);
                            core.ep.handle_receive_reaped(now, r.key, r.segment)
                        }
                        _ => core.ep.handle_receive_reaped(now, r.key, r.segment),
                    };
                    core.core_cancelled.remove(&id);
                    if let Err(e) = res {
                        tracing::debug!("op {id}: {e}");
                    }
                }
            }
        }
    }

    /// Drains the endpoint's outputs: control messages out, actions applied, events recorded.
    fn flush(&self, core: &mut Core) {
        let now = Instant::now();
        loop {
            let mut progressed = false;
            while let Some(t) = core.ep.poll_transmit() {
                progressed = true;
                let Some(&peer) = core.peers.peer_of.get(&t.to) else {
                    continue;
                };
                match t
                    .message
                    .to_bytes()
                    .map_err(Error::from)
                    .and_then(|b| self.agent.send_control(peer, b))
                {
                    Ok(op) => core.control_ops.push(op),
                    Err(e) => tracing::debug!("control to {}: {e}", t.to),
                }
            }
            while let Some(a) = core.ep.poll_action() {
                progressed = true;
                match a {
                    Action::Send { key, to, desc } => {
                        core.permits.insert((key, to, desc.segment), desc);
                    }
                    Action::AbortSend { key, to, segment } => {
                        if core.permits.remove(&(key, to, segment)).is_some() {
                            // Never started: it is finished as far as the core is concerned.
                            let _ = core.ep.handle_send_done(now, key, to, segment, false);
                        } else {
                            core.aborts.insert((key, to, segment));
                        }
                    }
                    Action::CancelReceive { token, .. } => {
                        if let Some(&id) = core.by_token.get(&token) {
                            if let Some(r) = core.recv_ops.get(&id) {
                                r.op.request_cancel();
                                core.core_cancelled.insert(id);
                            }
                        }
                    }
                    Action::Release { lease, .. } => {
                        if let Err(e) = core.pool.release(lease) {
                            tracing::error!("release: {e}");
                        }
                    }
                    Action::Fence { key, lease, token } => {
                        // A receive that could not be reaped: its peer is cut off (the endpoint
                        // is force-closed, which ends every request on it). The slot stays
                        // fenced, and the request's terminal is held back, until UCX has
                        // released the receive: only then can nothing write the buffer.
                        let _ = core.pool.fence(lease);
                        let live = core
                            .by_token
                            .get(&token)
                            .copied()
                            .filter(|id| core.recv_ops.contains_key(id));
                        match live {
                            Some(id) => {
                                let peer = core.recv_ops[&id].peer;
                                core.recv_ops[&id].op.request_cancel();
                                let _ = self.agent.close_peer(peer);
                                core.on_reap.insert(id, OnReap::Restore(lease.buffer));
                                core.fencing.entry(key).or_default().insert(id);
                            }
                            None => drop(core.pool.restore(lease.buffer)),
                        }
                    }
                }
            }
            while let Some(ev) = core.ep.poll_event() {
                progressed = true;
                match ev {
                    ProtoEvent::Advertised {
                        key,
                        from,
                        request_info,
                        buffers,
                    } => core.adverts.push_back(Advertisement {
                        key,
                        from,
                        request_info,
                        buffers,
                    }),
                    ProtoEvent::Notified { key, from, payload } => core
                        .notes
                        .entry(from)
                        .or_default()
                        .push_back((key, payload)),
                    ProtoEvent::Terminal { key, role, outcome } => {
                        let peer = match role {
                            Role::Receiver => None,
                            Role::Sender { receiver } => Some(receiver),
                        };
                        core.finished.insert((key, peer), now);
                        if role == Role::Receiver && core.fencing.contains_key(&key) {
                            core.deferred.insert(key, outcome);
                        } else {
                            core.terminals.insert((key, role), (outcome, now));
                        }
                    }
                }
            }
            if !progressed {
                break;
            }
        }
        core.control_ops.retain_mut(|op| op.poll().is_none());
        self.cv.notify_all();
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Result<Vec<u8>> {
    if s.len() % 2 != 0 || s.is_empty() {
        return Err(Error::invalid(
            "worker address must be an even number of hex digits",
        ));
    }
    (0..s.len() / 2)
        .map(|i| {
            u8::from_str_radix(&s[2 * i..2 * i + 2], 16)
                .map_err(|_| Error::invalid("bad hex in worker address"))
        })
        .collect()
}
