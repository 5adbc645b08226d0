//! The blocking engine: one rank's `send` / `recv` / `wait` surface over the protocol core and
//! the UCX agent.
//!
//! One [`Engine`] per rank: a UCX [`Agent`], the sans-IO [`Endpoint`] that owns every request
//! and its timers, and the glue (`glue.rs`) that feeds the endpoint what the agent reports and
//! carries out what it asks. The glue runs where the events arrive (an
//! [`crate::transport::EventSink`], called in the agent's progress pass), and the progress thread
//! sleeps no later than the endpoint's next timer: there is no engine thread of its own. Callers
//! block in `wait`, `recv_ready`, `next_advertisement`, `wait_for_notification`, `connect` and
//! `send`, each with a deadline and an optional cancel check. For a short window after the last
//! progress a blocked caller runs the progress pass itself
//! ([`Agent::driving`](crate::transport::Agent::driving)), so the event it
//! waits for is handled on its own thread; after that it sleeps on a waiter of its own that is
//! woken only for the fact it waits for (`waiters.rs`). No lock is held across a wait, one thread
//! at a time drives an agent, and no thread polls longer than one window past the last progress.
//!
//! # The data path of one request
//! 1. generation rank: [`Engine::advertise`] posts one tag-matched receive per buffer (tag = a
//!    fresh 64-bit token) and starts the request in the endpoint, which sends `Advertise` with
//!    what is left of the request's deadline;
//! 2. context rank: [`Engine::next_advertisement`] returns it (with the deadline the sender now
//!    shares); [`Engine::accept`] answers `Ready`; [`Engine::send_segments`] posts the sends of
//!    its segments together under their tokens and waits for them once;
//! 3. generation rank: each receive's own completion is its segment landing; when all have
//!    landed the ranks agree and [`Engine::wait`] returns `Completed` on both sides.
//!
//! # The deadline rule
//! Every blocking call returns by its deadline plus the agreement bound (50 ms by default) plus
//! a few milliseconds, whatever the peer does. A request's own deadline (the engine's timeout,
//! or [`Engine::advertise_with`]'s) ends it on every rank: at that deadline each rank votes
//! `TimedOut`, the ranks agree within the bound if they can talk, and each rank's receives are
//! cancelled before the end is reported, so the buffers handed back are never written again
//! (outside the fenced ranges of a region, below). If
//! UCX cannot recall a transfer (a receive whose data was already matched, a send its receiver
//! does not drain): in a region ([`Engine::register_region`]) the call returns at once and
//! the transfer is left to UCX, its range fenced until UCX releases it, and no endpoint is
//! closed; in plain caller memory its endpoint is force-closed (the pair reconnects) and the
//! call waits the few milliseconds UCX takes to release it.
//! A caller's own earlier deadline (or its cancel flag) gives up on the request the same way.
//! Without a verdict by the bound a rank reports its own failure (`TimedOut`, `Cancelled`,
//! `Rejected`), or `PeerLost` when the transport reported the peer lost; it never reports
//! `Completed` without the verdict, so a sender's `Completed` implies its receiver's.
mod aged;
pub(crate) mod glue;
mod waiters;

pub use crate::proto::peers::PeerState;
use crate::proto::peers::{MAX_TRIES, WORKER_ADDRESS_PREFIX};
pub use crate::proto::regions::{RegionId, RegionInfo};

use crate::error::{Error, ErrorKind, Outcome, Result};
use crate::proto::{
    BufferDesc, BufferKind, Config, Endpoint, Identity, RankId, ReceiveFlow, ReceiveSpec, Refusal,
    RequestKey, Role, Secret,
};
use crate::timeline::{self, Stage};
use crate::transport::cuda::Staging;
use crate::transport::ucx::{CancelPace, Held, CANCEL_POLL};
use crate::transport::{Agent, AgentOptions, PeerId, TransportKind};
use glue::{Core, Inner, OnReap, RecvOp};
use parking_lot::{Mutex, MutexGuard};
use smallvec::SmallVec;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use waiters::{sleep, WaitKey};

/// The longest timeout, bound or window the engine takes: a year, the core's own cap
/// ([`crate::proto::request::LONGEST`]). "Forever" (a C++ `milliseconds::max()`, `u64::MAX` ms,
/// `Duration::MAX`) lands here: past it a deadline is not representable everywhere it is used
/// (an `Instant`, a timer's nanoseconds), and a year is longer than any transfer.
pub const LONGEST_WAIT: Duration = crate::proto::request::LONGEST;

/// Configuration of one rank's engine.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Agent name (for logs and the peer's `Hello`).
    pub name: String,
    /// This rank's id, unique across both engines of a deployment.
    pub rank: u32,
    pub transport: TransportKind,
    /// Network devices in `UCX_NET_DEVICES` syntax (`mlx5_0:1`, `eth0`); None: UCX's choice.
    pub net_devices: Option<String>,
    /// tcp: listen here (`ip:port`, port 0 picks one). Shared memory connects by worker address.
    pub listen: Option<SocketAddr>,
    /// The default per-request deadline: TensorRT-LLM's `kv_transfer_timeout_ms`. Any of
    /// these four durations longer than [`LONGEST_WAIT`] (a year) is taken as a year. The
    /// sender learns what is left of a deadline in whole milliseconds, at most 2^32 - 1 (about
    /// 49.7 days): a longer deadline ends the sender's side of the request then.
    pub timeout: Duration,
    /// How long past a deadline the ranks may spend agreeing before each ends on its own.
    pub agreement_bound: Duration,
    /// `health().state`: work pending and no data landing or sent for this long is `Wedged`.
    pub wedge_window: Duration,
    /// `health().state`: a fault (failed peer, failed request) this recent is `Degraded`.
    pub degraded_window: Duration,
    /// The deployment secret: a peer is bound only if it proves it holds the same one (see
    /// [`crate::proto::handshake`]). `None` takes `KVLINK_SECRET` from the environment (unset or
    /// empty: no secret); `Some(empty)` is no secret whatever the environment says.
    pub secret: Option<Vec<u8>>,
    /// Receive buffers that may be posted at once, over all requests: past this `advertise`
    /// fails with `QueueFull` (and changes nothing) until earlier requests end. 1 to
    /// [`MAX_POOL_SLOTS`]; `Engine::new` refuses others with `InvalidArgument`.
    pub pool_slots: u32,
    /// When this process's shared-memory receive queue is found stuck
    /// ([`Health::receive_stuck`]): fail every peer at once and move to a new worker with a
    /// fresh queue (true, the default; [`Health::worker_renewals`]), or only report it.
    /// `KVLINK_STUCK=report` in the environment makes it false for every engine of the process.
    pub fail_peers_when_stuck: bool,
    /// Fault hooks for tests and the demo.
    pub faults: Faults,
}

impl EngineConfig {
    pub fn new(name: impl Into<String>, rank: u32, transport: TransportKind) -> Self {
        EngineConfig {
            name: name.into(),
            rank,
            transport,
            net_devices: None,
            listen: None,
            timeout: Duration::from_secs(60),
            agreement_bound: Config::default().agreement_bound,
            wedge_window: Duration::from_secs(10),
            degraded_window: Duration::from_secs(60),
            secret: None,
            pool_slots: POOL_SLOTS,
            fail_peers_when_stuck: true,
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
    /// Impersonation: introduce this engine with another process's instance nonce (which any
    /// peer it answered has seen). It must buy nothing: the instance is not a credential.
    pub instance: Option<u64>,
    /// A dial of `connect` that wins a crossing of dials has its connection force-closed as it
    /// wins, before its handshake ends: the window in which `connect` dials once more and the
    /// other side waits for that (see [`Engine::connect`]). Once, counted here.
    pub break_won_tie: Option<Arc<AtomicU64>>,
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

impl BufferSpec {
    /// Segment `segment` of a request in host memory: all of `buf`, as KV cache.
    pub fn host(segment: u32, buf: &mut [u8]) -> BufferSpec {
        BufferSpec {
            kind: BufferKind::Kv,
            segment,
            addr: buf.as_mut_ptr() as u64,
            len: buf.len() as u64,
            device_id: -1,
        }
    }
}

/// An advertisement received by a context rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Advertisement {
    pub key: RequestKey,
    pub from: RankId,
    /// The request's deadline here, learned from the advertisement: sends and waits for it
    /// end by then.
    pub deadline: Instant,
    pub request_info: Vec<u8>,
    pub buffers: Vec<BufferDesc>,
}

/// The verdict of [`Health`]: is this engine making progress?
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(u8)]
pub enum HealthState {
    /// No work stuck, no fault within the degraded window.
    #[default]
    Healthy = 0,
    /// Requests still complete (or nothing is pending), but a peer failed or a request failed
    /// (timed out, peer lost) within the degraded window.
    Degraded = 1,
    /// Work is pending (a transfer in flight or posted) and no data has landed or been sent for
    /// longer than the wedge window: alive, not working. Also while this process's
    /// shared-memory receive queue is stuck ([`Health::receive_stuck`]).
    Wedged = 2,
}

/// The progress snapshot: "alive" told from "working".
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Health {
    /// The verdict, from the counters below (see [`HealthState`]).
    pub state: HealthState,
    /// Milliseconds since the last fault (failed peer or request), u64::MAX if none.
    pub since_last_fault_ms: u64,
    /// Ranks connected now.
    pub peers: u64,
    /// Connection failures seen (each one cost the requests on that endpoint, not the pair).
    pub peers_failed: u64,
    /// Ranks being dialled again after a failure, and dial attempts made so far.
    pub peers_reconnecting: u64,
    pub reconnects: u64,
    /// Requests known to the protocol core (running, or failed and lingering; a completed one
    /// is forgotten at its end and only its tombstone is kept).
    pub requests_known: u64,
    pub completed: u64,
    pub failed: u64,
    pub stale_dropped: u64,
    pub bad_frames: u64,
    /// Advertisements refused because the queue for `next_advertisement` was full, and
    /// notifications dropped because their queue was full (in number, or in bytes: 256 MiB
    /// each, notifications over all peers).
    pub adverts_refused: u64,
    pub notes_dropped: u64,
    /// Receive buffers still leased to a request (0 when idle: anything else is a leak).
    pub buffers_leased: u64,
    pub buffers_fenced: u64,
    /// Transport ops in flight and the age of the oldest, in milliseconds.
    pub ops_in_flight: u64,
    pub oldest_op_ms: u64,
    /// Milliseconds since the last completed transfer (u64::MAX if none yet).
    pub since_last_completion_ms: u64,
    pub bytes_completed: u64,
    /// Transfers UCX still held when their wait returned: once the force-close of its endpoint
    /// has run, a stopped transfer waits at most 30 ms past the end of its grace (at least 2 ms
    /// after the close) for UCX to let it go (see the deadline rule). Nonzero only when UCX
    /// keeps a transfer past the close of its endpoint; each one is also logged.
    pub unreaped_ops: u64,
    /// Waits that had to return before UCX released a fenced receive (should stay 0).
    pub unsettled_returns: u64,
    /// Tagged data discarded because no receive of ours was offered under its tag: attempts by
    /// a process that is not the buffer's peer (or garbage). Never landed, never completed
    /// anything.
    pub foreign_data: u64,
    /// Data discarded because its receive had already ended (a sender too late).
    pub late_data: u64,
    /// Handshakes this rank refused: no proof of the deployment secret, a rank bound to
    /// another live process, or frames of another wire version; and handshakes a peer refused.
    pub refused_auth: u64,
    pub refused_rank_in_use: u64,
    pub refused_version: u64,
    pub refused_by_peer: u64,
    /// This process's shared-memory receive queue is stuck: a peer process died (or was
    /// stopped) while writing into it, and nothing any peer sends over shared memory is read.
    /// By default every peer is failed when it is found and the engine moves to a new worker
    /// at once ([`Health::worker_renewals`]); it stays set only in report-only mode
    /// (`fail_peers_when_stuck = false`), or if that move failed (connects are then refused).
    /// The state is `Wedged` meanwhile (`docs/RELIABILITY.md`).
    pub receive_stuck: bool,
    /// Moves to a new worker, each after a stuck receive queue. Each failed every peer (ranks
    /// this engine dialled are redialled from the new one, and ranks connected by having
    /// dialled its worker address are dialled back) and changed the worker address: a process
    /// that dials this engine later needs the new [`Engine::address`] (a listening engine keeps
    /// its `ip:port`).
    pub worker_renewals: u64,
    /// Bytes of regions fenced now (transfers of ended requests that UCX still holds; refused
    /// to new receives until released; the sum of their lengths, so two fenced sends from the
    /// same bytes count them twice), and transfers fenced that way so far.
    pub region_fenced_bytes: u64,
    pub region_fences: u64,
    /// Control messages sent again because their answer had not come: unanswered
    /// advertisements and failure verdicts not yet confirmed (both backed off, 200 ms doubling
    /// to 6.4 s), votes and verdict pulls (at the retransmit interval). A few per fault are normal;
    /// a rate that keeps climbing means a peer that is alive but not answering.
    pub resends: u64,
    /// Messages and landings that repeated one already handled (a resend that crossed its
    /// answer): dropped, changing nothing.
    pub duplicates: u64,
    /// Messages for a request this rank does not know (forgotten, and its tombstone gone after
    /// its deadline, the agreement bound and the linger; or never started here, except a vote
    /// or failure verdict, kept for the request's start and counted here only if it goes
    /// unused): dropped. Older generations of a request still known (or remembered by its
    /// tombstone) count in `stale_dropped` instead.
    pub unknown_dropped: u64,
    /// Votes and failure verdicts that came for a request before it had started here (its
    /// ranks start it apart), kept for its start: another rank's early cancel or landing counts
    /// as soon as the request starts here, not at the voter's resend.
    pub early_kept: u64,
    /// Ranks that dialled this side and failed, forgotten to bound the peer table (more than
    /// 8192 such failures since; docs/SECURITY.md): each reads `Unknown` again.
    pub ranks_forgotten: u64,
}

const POOL_SLOTS: u32 = 1 << 16;
/// The most receive buffers an engine may have posted at once ([`EngineConfig::pool_slots`]):
/// its slot table is allocated whole at start, and `u32::MAX` slots (tens of GB) would end the
/// process in the allocator instead of returning an error.
pub const MAX_POOL_SLOTS: u32 = 1 << 20;
/// After a caller gives up: what the wait allows past the agreement bound for the fence (a
/// force-closed endpoint's receives are released by UCX within a few milliseconds).
const SETTLE_SLACK: Duration = Duration::from_millis(30);
/// How long a stopped send waits for its receiver to drain it before the endpoint is
/// force-closed, at most (never longer than the agreement bound: [`reap_grace`]). A live
/// receiver drains in about 2 ms on loopback, but more than 20 ms on two busy cores: with 20
/// here, a cancel storm run twice at once (`tests/engine_storms.rs`) force-closed the pair's
/// endpoint in most runs, failing every request on it; with 50, in none of sixteen.
const REAP_GRACE: Duration = Duration::from_millis(50);

/// [`REAP_GRACE`], within the agreement bound: a send stopped at its deadline then returns by
/// the deadline plus the bound plus the force-close, as the deadline rule says.
fn reap_grace(agreement_bound: Duration) -> Duration {
    REAP_GRACE.min(agreement_bound)
}

/// How long `connect` lets its own `Refuse` go out before it returns the refusal.
const REFUSE_FLUSH: Duration = Duration::from_millis(100);

/// One rank: agent, protocol core, driver thread. Dropping it stops the driver, then the agent
/// (which cancels and reaps every op).
pub struct Engine {
    inner: Arc<Inner>,
    timeout: Duration,
}

fn key_err(kind: ErrorKind, key: RequestKey, what: &str) -> Error {
    Error::new(kind, format!("{key}: {what}"))
}

/// Whether `KVLINK_STUCK` asks for report-only mode: `report` (spaces around it aside) is yes;
/// unset, empty or only spaces is no; anything else is an `InvalidArgument` naming the variable.
fn stuck_report_only() -> Result<bool> {
    match std::env::var_os("KVLINK_STUCK") {
        None => Ok(false),
        Some(v) => match v.to_str().map(str::trim) {
            Some("report") => Ok(true),
            Some("") => Ok(false),
            _ => Err(Error::invalid(format!(
                "KVLINK_STUCK={v:?}: the one value is report (only report a stuck receive \
                 queue); unset it for the default"
            ))),
        },
    }
}

/// Dials `address` (`ip:port` or `ucx:<hex worker address>`): returns once the progress thread
/// has made the endpoint, or by `deadline` (within 10 s) if it has not.
pub(crate) fn dial(agent: &Agent, address: &str, deadline: Instant) -> Result<PeerId> {
    match address.strip_prefix(WORKER_ADDRESS_PREFIX) {
        Some(h) => agent.connect_worker_by(&unhex(h)?, deadline),
        None => agent.connect_by(crate::config::parse_listen_address(address)?, deadline),
    }
}

impl Engine {
    pub fn new(mut cfg: EngineConfig) -> Result<Engine> {
        for d in [
            &mut cfg.timeout,
            &mut cfg.agreement_bound,
            &mut cfg.wedge_window,
            &mut cfg.degraded_window,
        ] {
            *d = (*d).min(LONGEST_WAIT);
        }
        if cfg.timeout.is_zero() {
            return Err(Error::invalid("timeout must be positive"));
        }
        if cfg.pool_slots == 0 || cfg.pool_slots > MAX_POOL_SLOTS {
            return Err(Error::invalid(format!(
                "pool_slots must be 1 to {MAX_POOL_SLOTS}, not {}",
                cfg.pool_slots
            )));
        }
        let shared_memory = cfg.transport.may_use_mm();
        let mut opts = AgentOptions::new(cfg.name.clone(), cfg.transport);
        opts.listen = cfg.listen;
        opts.net_devices = cfg.net_devices;
        opts.reap_grace = reap_grace(cfg.agreement_bound);
        // Every receive is posted before data under its tag can be taken in (it goes out right
        // after its advertisement, before any progress pass: `Agent::hold`): anything unmatched
        // is from someone the buffer was not offered to (or too late), and is discarded.
        opts.discard_unexpected = true;
        // `KVLINK_STUCK=report` turns the action off where the config cannot be reached (the
        // TensorRT-LLM wrapper builds its own).
        // Any other value is refused rather than run as if unset (the action a `KVLINK_STUCK=
        // Report` or `=1` meant to turn off would still fail every peer).
        let report_only = stuck_report_only()?;
        opts.fail_peers_when_stuck = cfg.fail_peers_when_stuck && !report_only;
        let secret = match cfg.secret {
            Some(s) => Secret::new(s),
            // The variable's bytes as they are: a secret need not be UTF-8, and one that is not
            // must not read as "no secret" (`std::env::var` fails on it).
            None => Secret::new(
                std::env::var_os("KVLINK_SECRET")
                    .map(std::os::unix::ffi::OsStringExt::into_vec)
                    .unwrap_or_default(),
            ),
        };
        crate::log::init();
        let agent = Agent::new(opts)?;
        let me = RankId(cfg.rank);
        let config = Config {
            timeout: cfg.timeout,
            agreement_bound: cfg.agreement_bound,
            ..Config::default()
        };
        let identity = Identity {
            rank: me,
            name: cfg.name.clone(),
            instance: cfg.faults.instance.unwrap_or_else(crate::random::u64),
            secret,
        };
        let inner = Arc::new(Inner {
            agent,
            me,
            name: cfg.name,
            identity,
            faults: cfg.faults,
            agreement_bound: cfg.agreement_bound,
            windows: (cfg.wedge_window, cfg.degraded_window),
            core: Mutex::new(Core::new(Endpoint::new(me, config), cfg.pool_slots)),
            stopping: AtomicBool::new(false),
            metrics: crate::metrics::Metrics::new(),
            shared_memory,
            held_wakes: Default::default(),
        });
        inner
            .agent
            .set_sink(Arc::new(glue::Sink(Arc::downgrade(&inner))));
        Ok(Engine {
            inner,
            timeout: cfg.timeout,
        })
    }

    pub fn rank(&self) -> RankId {
        self.inner.me
    }

    /// The instance nonce this engine drew at start (given to every peer in the handshake).
    pub fn instance(&self) -> u64 {
        self.inner.identity.instance
    }

    /// The engine's name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// How CUDA memory can move with the linked UCX, asked of it at start: `Direct` when it
    /// supports CUDA memory, else `Staged` (see [`crate::transport::DevicePath`]).
    pub fn device_path(&self) -> crate::transport::DevicePath {
        self.inner.agent.device_path()
    }

    /// Where peers reach this rank: `ip:port` (tcp) or `ucx:<hex worker address>`.
    pub fn address(&self) -> String {
        match self.inner.agent.listen_address() {
            Some(a) => a.to_string(),
            None => worker_address_text(&self.inner.agent.worker_address()),
        }
    }

    /// Connects to the rank at `address` (as printed by [`Engine::address`]) and waits, until
    /// `deadline`, for the handshake to bind it (`PeerLost` when it has not; at once, dialling
    /// nothing, when the deadline has already passed). Returns its rank. The engine remembers the
    /// address: if the connection fails later, it dials it again by itself (see [`PeerState`]).
    /// A handshake refused either way is `AuthFailed` (the two sides do not hold the same
    /// deployment secret), `RankInUse` (the peer, or this side, has that rank bound to another
    /// live process) or `Protocol` (the two speak different wire versions: returned as soon as
    /// the refusal arrives, not at the deadline). `Transport` if this side's progress thread
    /// was too busy (or stuck) to make the endpoint by `deadline`, or within 10 s (one it makes
    /// later is closed unused: `Agent::connect_by`). Two ranks that dial each other at once (two
    /// tcp connections) end on one connection, and both `connect`s return the other's rank; a
    /// `connect` to a rank already connected (the same process, by either side's dial) returns
    /// its rank (`kvlink_proto::peers` `binding` has the rules). Only the side whose dial the
    /// pair kept redials it when that connection fails. A dial that won such a crossing and
    /// whose connection broke before it bound is dialled once more, within the deadline (the
    /// other side's dial was refused for it, so no connection would be left; the redial proves
    /// the broken dial's session, so a peer still holding that connection takes it as the same
    /// process coming back), and the other side's `connect` waits for that dial, up to 5 s
    /// after that connection broke (`kvlink_proto::peers::REDIAL_WAIT`). Either ends `PeerLost`
    /// when that does not connect the pair: the redial refused, or no redial in time (connect
    /// again). A `connect` and this side's reconnect round never dial one address side by side:
    /// a `connect` to the address the round is dialling waits for that dial and returns the
    /// rank when it binds (if it ends without binding, the `connect` dials in its place), and no
    /// round dials an address while a `connect`'s dial to it runs. A `connect` whose dial meets
    /// another dial of this side to the same rank through another of its addresses (the round
    /// dials a peer that moved to a new worker at its worker address, say): if its own dial
    /// gives way, it waits for the other and returns the rank when that binds (`PeerLost` if
    /// the round gives up).
    pub fn connect(&self, address: &str, deadline: Instant) -> Result<RankId> {
        if Instant::now() >= deadline {
            return Err(Error::new(
                ErrorKind::PeerLost,
                format!("{address}: the deadline had passed; nothing was dialled"),
            ));
        }
        let mut dialling = Connecting::begin(&self.inner, address);
        let mut core = self.inner.core.lock();
        let mut joined: Option<RankId> = None;
        loop {
            if let Some(rank) = joined.filter(|r| core.peers.state(*r) == PeerState::Connected) {
                // The round's dial this waited for bound it (or another dial did meanwhile).
                return Ok(rank);
            }
            // This side's reconnect round is dialling the rank: wait for its dial (if that
            // ends unbound, or there is none, dial).
            let Some(rank) = core.peers.round_dialling(address) else {
                break;
            };
            if joined.replace(rank).is_none() {
                tracing::info!(
                    peer = rank.0,
                    "{address}: the reconnect round is dialling {rank}; connect waits for its dial"
                );
            }
            if !sleep(&mut core, WaitKey::Peer(rank), deadline) && Instant::now() >= deadline {
                return Err(Error::new(
                    ErrorKind::PeerLost,
                    format!(
                        "{address}: this side's reconnect round was dialling {rank}, and its dial \
                         had not bound by the deadline"
                    ),
                ));
            }
        }
        drop(core);
        let r = self.dial_and_bind(address, deadline, &mut dialling);
        drop(dialling);
        r
    }

    /// [`Engine::connect`]'s own dial, from the dial to its end: `dialling` is ended when it
    /// gives way (what it waits for then may be the round's dial).
    fn dial_and_bind(
        &self,
        address: &str,
        deadline: Instant,
        dialling: &mut Connecting<'_>,
    ) -> Result<RankId> {
        let mut moves = self.inner.agent.worker_moves_begun();
        let mut peer = dial(&self.inner.agent, address, deadline)?;
        let mut core = self.inner.core.lock();
        self.inner.say_hello(&mut core, peer)?;
        let mut redialled = false;
        loop {
            if let Some(r) = core.peers.rank_of(peer) {
                core.peers.set_dial(r, address);
                return Ok(r);
            }
            if let Some(rank) = core.peers.take_gave_way(peer) {
                // The rank dialled this side while this dial ran, and the pair keeps its
                // connection (`Peers::on_handshake`): connected once that one is bound.
                // Its address is not kept for redials: the side whose dial was kept redials.
                dialling.end(&mut core);
                return wait_for_crossing(&mut core, rank, address, deadline);
            }
            if let Some(reason) = core.peers.refusal(peer) {
                // Let our own `Refuse` (if we sent one) go out, then close the endpoint: a
                // retry starts on an endpoint of its own.
                let sent = core.refusal_ops.remove(&peer);
                let by_peer = sent.is_none();
                drop(core);
                if let Some(mut op) = sent {
                    let _ = op.wait((Instant::now() + REFUSE_FLUSH).min(deadline), None);
                }
                let _ = self.inner.agent.close_peer(peer);
                if redialled && by_peer && reason == Refusal::RankInUse {
                    // The rank this side is held there is most likely our own broken first
                    // connection, which the peer has not found dead yet (keepalive).
                    return Err(Error::new(
                        ErrorKind::PeerLost,
                        format!(
                            "{address}: the connection of a dial that won a crossing broke before \
                             it bound, and the peer refused the dial made again: it still holds \
                             the broken one (it finds it dead by keepalive; connect again then)"
                        ),
                    ));
                }
                return Err(Error::new(
                    reason.kind(),
                    format!(
                        "{address}: handshake refused ({reason:?}): {}",
                        reason.describe()
                    ),
                ));
            }
            if self.inner.agent.peer_state(peer).is_err() {
                let now_moves = self.inner.agent.worker_moves_begun();
                let won_tie = core.peers.take_won_tie(peer).filter(|_| !redialled);
                if let Some(w) =
                    won_tie.filter(|w| core.peers.state(w.rank) == PeerState::Connected)
                {
                    // Bound meanwhile through another connection: the pair is connected.
                    return Ok(w.rank);
                }
                if Instant::now() >= deadline || now_moves == moves && won_tie.is_none() {
                    return Err(Error::new(
                        ErrorKind::PeerLost,
                        format!("{address}: connection failed"),
                    ));
                }
                if let Some(w) = won_tie {
                    // This dial won a tie against the rank's dial the other way, which was
                    // refused for it, and then its connection broke before it bound: neither
                    // connection is left. Dial once more (`Peers::take_won_tie`).
                    tracing::info!(
                        "{address}: the connection of a dial that won a crossing with {} broke \
                         before it bound; dialling again",
                        w.rank
                    );
                    redialled = true;
                }
                // Or this agent is moving to a new worker (its shared-memory receive queue was
                // stuck, which is why no hello came): dial again, from the new one (the dial is
                // a command, run after the pass that moves).
                moves = now_moves;
                drop(core);
                peer = dial(&self.inner.agent, address, deadline)?;
                core = self.inner.core.lock();
                self.inner.say_hello(&mut core, peer)?;
                if let Some(w) = won_tie {
                    // Its `Proof` proves the broken dial's session (`Peers::redial`).
                    core.peers.redial(peer, w);
                }
                continue;
            }
            if !sleep(&mut core, WaitKey::Dial(peer), deadline) && Instant::now() >= deadline {
                // A peer process that died while writing into our shared-memory receive queue
                // can leave this process deaf on shared memory (UCX; docs/RELIABILITY.md).
                let hint = if self.inner.shared_memory && core.peers.failures > 0 {
                    "; a peer was lost earlier, and on shared memory a peer killed mid-write \
                     can leave this process unable to receive until the probe finds it, or for \
                     good in report-only mode (docs/RELIABILITY.md)"
                } else {
                    ""
                };
                return Err(Error::new(
                    ErrorKind::PeerLost,
                    format!("{address}: no hello before the deadline{hint}"),
                ));
            }
        }
    }

    /// Waits until `rank` is connected (its `Hello` arrived), up to `deadline`.
    pub fn wait_peer(&self, rank: RankId, deadline: Instant) -> Result<()> {
        self.block(WaitKey::Peer(rank), deadline, None, |core| {
            (core.peers.state(rank) == PeerState::Connected).then_some(())
        })
        .ok_or_else(|| Error::new(ErrorKind::UnknownPeer, format!("{rank} did not connect")))
    }

    /// The state of this rank's connection to `rank`.
    pub fn peer_state(&self, rank: RankId) -> PeerState {
        self.inner.core.lock().peers.state(rank)
    }

    /// The name a connected rank gave in its `Hello`.
    pub fn peer_name(&self, rank: RankId) -> Option<String> {
        self.inner.core.lock().peers.name(rank)
    }

    /// [`Engine::advertise_with`] with the engine's default timeout.
    ///
    /// # Safety
    /// As for [`Engine::advertise_with`].
    pub unsafe fn advertise(
        &self,
        key: RequestKey,
        receivers: Vec<RankId>,
        flows: Vec<(RankId, Vec<BufferSpec>)>,
        request_info: Vec<u8>,
    ) -> Result<()> {
        // SAFETY: forwarded caller promise.
        unsafe { self.advertise_with(key, receivers, flows, request_info, None) }
    }

    /// Generation side: posts a receive for every buffer and advertises the request to each
    /// sender, with its own deadline (`timeout` from now; `None` takes the engine's). Every
    /// rank of the request ends it by that deadline. `receivers` lists every generation rank
    /// of the request (this one included); `flows` gives, per context rank, the buffers it will
    /// fill. A sender whose connection is being re-established is waited for (up to the
    /// request's deadline); one whose round gave up gets one fresh round, and the call fails
    /// `PeerLost` if that gives up too. A host buffer inside a region ([`Engine::register_region`])
    /// must lie wholly inside it (`OutOfBounds`) and off its fenced ranges (`Fenced`). On error
    /// nothing stays posted or leased.
    ///
    /// # Safety
    /// Every buffer must be writable host memory that nobody else touches until [`Engine::wait`]
    /// for `key` has returned (the request's buffers are released by then, or fenced).
    pub unsafe fn advertise_with(
        &self,
        key: RequestKey,
        receivers: Vec<RankId>,
        flows: Vec<(RankId, Vec<BufferSpec>)>,
        request_info: Vec<u8>,
        timeout: Option<Duration>,
    ) -> Result<()> {
        let _span = timeline::span(Stage::AdvertiseCalled, Stage::AdvertiseReturned);
        let timeout = timeout.unwrap_or(self.timeout).min(LONGEST_WAIT);
        if timeout.is_zero() {
            return Err(key_err(ErrorKind::InvalidArgument, key, "zero timeout"));
        }
        let started = Instant::now();
        let deadline = started + timeout;
        if flows.is_empty() || flows.iter().any(|(_, b)| b.is_empty()) {
            return Err(key_err(
                ErrorKind::InvalidArgument,
                key,
                "a request needs at least one buffer per sender",
            ));
        }
        let total: usize = flows.iter().map(|(_, b)| b.len()).sum();
        for b in flows.iter().flat_map(|(_, b)| b) {
            if b.addr == 0 || b.len == 0 || b.addr.checked_add(b.len).is_none() {
                return Err(key_err(
                    ErrorKind::OutOfBounds,
                    key,
                    &format!("bad buffer {b:?}"),
                ));
            }
            usize::try_from(b.len).map_err(|_| Error::invalid("buffer too large"))?;
            // Checked here as the core checks it, before a receive is posted for the buffer
            // (below -1 would be taken for host memory there, then refused after the post).
            if b.device_id < -1 {
                return Err(key_err(
                    ErrorKind::InvalidArgument,
                    key,
                    &format!("bad device id {} (-1 for host memory)", b.device_id),
                ));
            }
        }
        let mut core = self.inner.core.lock();
        let ran_here = |core: &Core| {
            (core.finished.contains_key(&(key, None)) || core.ep.knows_receive(key)).then(|| {
                key_err(
                    ErrorKind::InvalidArgument,
                    key,
                    "has already run here: a retry needs the next generation",
                )
            })
        };
        if let Some(e) = ran_here(&core) {
            return Err(e);
        }
        let peers = self.senders_connected(&mut core, &flows, deadline)?;
        // Waiting for a sender to reconnect lets go of the lock: another advertise of the same
        // key may have run meanwhile.
        if let Some(e) = ran_here(&core) {
            return Err(e);
        }
        // One clock read for the rest (the wait for senders above may have taken a while).
        let now = Instant::now();
        if core.pool.available() < total {
            return Err(key_err(
                ErrorKind::QueueFull,
                key,
                &format!(
                    "{total} buffers asked, {} free in the receive pool",
                    core.pool.available()
                ),
            ));
        }
        // The ids of the receives posted, inline for a request of up to 16 buffers.
        let mut posted: SmallVec<[u64; 16]> = SmallVec::with_capacity(total);
        // The receives are held back and the advertisement goes out before them (Held): it
        // does not wait for their posts, and nothing can overtake them.
        let mut held = self.inner.agent.hold();
        // SAFETY: forwarded caller promise (the buffers stay valid until the request ends).
        let result =
            unsafe { self.post_flows(&mut core, key, &flows, &peers, &mut held, &mut posted) }
                .and_then(|spec_flows| {
                    core.ep.start_receive(
                        now,
                        ReceiveSpec {
                            key,
                            receivers,
                            flows: spec_flows,
                            request_info,
                            timeout: Some(deadline.saturating_duration_since(now)),
                        },
                    )
                });
        if let Err(e) = result {
            // Nothing was started, and nothing was advertised: the receives posted for it never
            // reach UCX. Dropping `held` unreleased ends each of them `Cancelled` at once (they
            // were only held), so their leases, tokens and region transfers go back here, before
            // the error is returned, not a progress pass or two later (started and then
            // cancelled, they were still leased, posted and in use in their region when the
            // call returned: a `deregister_region` right after was refused as in use by a
            // running request). Their `OpDone`s, which follow, find nothing.
            drop(held);
            self.inner.take_back_unstarted(&mut core, now, &posted);
            self.inner.flush_via(&mut core, None, now);
            return Err(e);
        }
        self.inner.flush_via(&mut core, Some(&mut held), now);
        timeline::mark(Stage::AdvertiseSent);
        // Started before anything below can cancel one of them (a cancel queued first would
        // find nothing to cancel).
        let released = held.release();
        for id in posted {
            // Started: from here the core owns the lease.
            if let Some(r) = core.recv_ops.get_mut(&id) {
                r.on_reap = None;
            }
        }
        // Anything the bookkeeping above queued (nothing, usually).
        self.inner.flush_via(&mut core, None, now);
        released
    }

    /// The endpoint of every sender of a request, waiting (until `deadline`) for those being
    /// reconnected. Releases the lock while it waits.
    fn senders_connected(
        &self,
        core: &mut MutexGuard<'_, Core>,
        flows: &[(RankId, Vec<BufferSpec>)],
        deadline: Instant,
    ) -> Result<Vec<PeerId>> {
        // The ranks this call revived: each gets one fresh round (`Peers::revive`); one that
        // gives up is lost to this call, not revived again round after round to the deadline.
        let mut revived: SmallVec<[RankId; 2]> = SmallVec::new();
        'again: loop {
            let mut peers = Vec::with_capacity(flows.len());
            for (rank, _) in flows {
                match core.peers.state(*rank) {
                    PeerState::Connected => {
                        peers.push(core.peers.endpoint(*rank).expect("connected"))
                    }
                    PeerState::Unknown => {
                        return Err(Error::new(
                            ErrorKind::UnknownPeer,
                            format!("{rank} is not connected"),
                        ))
                    }
                    state => {
                        if state == PeerState::Failed {
                            if revived.contains(rank) {
                                return Err(Error::new(
                                    ErrorKind::PeerLost,
                                    format!(
                                        "{rank}: connection failed, and the reconnect round this \
                                         request started gave up ({MAX_TRIES} dials)"
                                    ),
                                ));
                            }
                            let now = Instant::now();
                            if !core.peers.revive(*rank, now) {
                                return Err(Error::new(
                                    ErrorKind::PeerLost,
                                    format!(
                                        "{rank}: connection failed and cannot be redialled here"
                                    ),
                                ));
                            }
                            revived.push(*rank);
                            // The round's first dial is due now, and only the sink makes it: a
                            // progress thread asleep would reach it at its next timer, up to
                            // 100 ms on.
                            self.inner.agent.wake_by(now);
                        }
                        if !sleep(core, WaitKey::Peer(*rank), deadline)
                            && Instant::now() >= deadline
                        {
                            return Err(Error::new(
                                ErrorKind::PeerLost,
                                format!("{rank}: not reconnected before the request's deadline"),
                            ));
                        }
                        continue 'again;
                    }
                }
            }
            return Ok(peers);
        }
    }

    /// Posts one receive per buffer of every flow (held: started when `held` is released) and
    /// leases its pool slot; returns the flows as the core takes them. Every posted receive is
    /// in `posted` with its lease in its `RecvOp::on_reap` (to go back when UCX releases it) until the
    /// caller knows the request started.
    ///
    /// # Safety
    /// As for [`Engine::advertise_with`].
    unsafe fn post_flows(
        &self,
        core: &mut Core,
        key: RequestKey,
        flows: &[(RankId, Vec<BufferSpec>)],
        peers: &[PeerId],
        held: &mut Held<'_>,
        posted: &mut SmallVec<[u64; 16]>,
    ) -> Result<Vec<ReceiveFlow>> {
        let mut spec_flows = Vec::with_capacity(flows.len());
        for ((sender, buffers), &peer) in flows.iter().zip(peers) {
            let mut flow = ReceiveFlow {
                sender: *sender,
                buffers: Vec::with_capacity(buffers.len()),
            };
            let keys = core.peers.keys(*sender).ok_or_else(|| {
                Error::new(ErrorKind::PeerLost, format!("{sender} is not connected"))
            })?;
            for b in buffers {
                let len = b.len as usize;
                // A host buffer inside a region is checked against the region's edges
                // and fenced ranges before anything is posted for it.
                let region = match b.device_id {
                    d if d >= 0 => None,
                    _ => core.regions.check(b.addr, b.len).map_err(|e| {
                        key_err(
                            e.kind,
                            key,
                            &format!("segment {}: {}", b.segment, e.message),
                        )
                    })?,
                };
                // The system UCX cannot move device memory: a CUDA buffer's receive lands in a
                // pinned host buffer that is copied to the device on arrival.
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
                // Only `sender` can name this tag: the token keyed for the pair.
                let tag = keys.inbound.tag(token);
                // Leased before the post (the pool has room: checked under this same lock), so
                // that no held op is ever dropped unstarted; a post that fails gives it back.
                let lease = core
                    .pool
                    .lease(key)
                    .ok_or_else(|| Error::new(ErrorKind::Internal, "pool emptied under lock"))?;
                // SAFETY: the caller's promise covers the buffer until the request ends (a
                // staging buffer lives in the RecvOp); its lease goes back only after this
                // receive is reaped.
                let op = match unsafe { held.post_recv_with(peer, tag, target, len, true) } {
                    Ok(op) => op,
                    Err(e) => {
                        drop(core.pool.release(lease));
                        return Err(e);
                    }
                };
                let id = op.id();
                posted.push(id);
                if let Some(r) = region {
                    // Cannot fail: `r` was found under this same lock.
                    let _ = core.regions.track(id, peer.0, true, r, b.addr, b.len);
                }
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
                        tag,
                        on_reap: Some(OnReap::Release(lease)),
                        core_cancelled: false,
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
        Ok(spec_flows)
    }

    /// Lends `[addr, addr + len)` of host memory to kvlink as a region, once; requests then
    /// receive into ranges of it (named with [`Engine::region_buffer`], or any buffer whose
    /// address lies inside it) and send from it (any data inside it). What a region changes:
    /// when a request ends while UCX still holds one of its transfers there (a frozen or
    /// partitioned peer, data already matched), the call returns at once and the transfer is
    /// left to UCX with its range fenced: new receives that overlap it get `ErrorKind::Fenced`
    /// until UCX releases it, and nothing else on the pair is touched. In plain memory the
    /// endpoint must be force-closed instead, which costs every request on the pair. Regions
    /// may not overlap (`InvalidArgument`).
    ///
    /// # Safety
    /// The memory must be host memory, writable for receives, that stays valid until
    /// [`Engine::deregister_region`] returns `Ok` for it, or the engine is dropped: kvlink may
    /// write into (or read from) a fenced range of it after the request that used it ended.
    pub unsafe fn register_region(&self, addr: u64, len: u64) -> Result<RegionId> {
        self.inner.core.lock().regions.register(addr, len)
    }

    /// A buffer of `len` bytes at `offset` in `region`, for [`Engine::advertise`]:
    /// `OutOfBounds` past the region's end, `InvalidArgument` for an unknown region.
    pub fn region_buffer(
        &self,
        region: RegionId,
        kind: BufferKind,
        segment: u32,
        offset: u64,
        len: u64,
    ) -> Result<BufferSpec> {
        let addr = self
            .inner
            .core
            .lock()
            .regions
            .address(region, offset, len)?;
        Ok(BufferSpec {
            kind,
            segment,
            addr,
            len,
            device_id: -1,
        })
    }

    /// A region's transfers and fenced bytes now.
    pub fn region_info(&self, region: RegionId) -> Result<RegionInfo> {
        self.inner.core.lock().regions.info(region)
    }

    /// Takes a region back. Refused (`InvalidArgument`) while a running request moves data in
    /// or out of it. From the call on, no new request may use it. Fenced transfers are ended
    /// now: their endpoints are force-closed (the caller wants the memory back; those pairs
    /// reconnect) and the call waits until UCX has released them, or returns `Fenced` at
    /// `deadline` with the region still registered (and usable again once no other
    /// deregistration of it is waiting). Of several concurrent calls for one region, any that
    /// ends after the region is gone returns `Ok`.
    pub fn deregister_region(&self, region: RegionId, deadline: Instant) -> Result<()> {
        let peers = self.inner.core.lock().regions.begin_remove(region)?;
        for peer in peers {
            tracing::warn!(
                region = region.0,
                "deregistration: closing the endpoint of a fenced transfer's peer"
            );
            let _ = self.inner.agent.close_peer(PeerId(peer));
        }
        let released = |core: &mut Core| match core.regions.info(region) {
            Ok(i) if i.transfers > 0 => None,
            _ => Some(()),
        };
        self.block(WaitKey::Region(region), deadline, None, released);
        self.inner.core.lock().regions.finish_remove(region)
    }

    /// The fenced ranges of `region` now, as (offset, length): memory the caller must not
    /// touch yet (UCX may still write a fenced receive's range, or read a fenced send's).
    pub fn region_fenced_ranges(&self, region: RegionId) -> Result<Vec<(u64, u64)>> {
        self.inner.core.lock().regions.fenced_ranges(region)
    }

    /// Context side: the next advertisement, waiting until `deadline` or `cancel()`. Several
    /// threads may wait at once: each advertisement goes to exactly one of them, and wakes only
    /// one (as do notifications, for [`Engine::wait_for_notification`]).
    pub fn next_advertisement(
        &self,
        deadline: Instant,
        cancel: Option<&dyn Fn() -> bool>,
    ) -> Option<Advertisement> {
        // A caller returns None only from a pass that found the queue empty, or after its
        // cancel check, during which it was not asleep (an arrival then woke another caller).
        self.block(WaitKey::Advert, deadline, cancel, |core| {
            let a = core.waiters.take(WaitKey::Advert, &mut core.adverts)?;
            core.advert_bytes -= glue::advert_bytes(&a);
            Some(a)
        })
        .inspect(|_| timeline::mark(Stage::AdvertisementTaken))
    }

    /// Context side: accept (`ready`) or reject an advertisement before any data moves.
    /// `UnknownRequest` when no advertisement of `key` came from `from`, `InvalidArgument` when
    /// it was answered already. An answer to a request that ended before it (the receivers gave
    /// it up or cancelled it: a race, not misuse) is no error and changes nothing: a send then
    /// returns the end, and [`Engine::wait`] the agreed verdict.
    pub fn accept(&self, key: RequestKey, from: RankId, ready: bool) -> Result<()> {
        let _returned = timeline::on_return(Stage::AcceptReturned);
        let mut core = self.inner.core.lock();
        // `UnknownRequest` when no advertisement of `key` came from `from` (one look-up).
        let r = core.ep.accept(Instant::now(), key, from, ready);
        self.inner.flush(&mut core);
        r
    }

    /// Generation side: the context rank's answer: `Some(true)` ready, `Some(false)` rejected,
    /// `None` if none came by `deadline` (or `cancel()`), or at once if the request is unknown
    /// or has already ended otherwise. The answer is the protocol core's, not consumed by
    /// asking: a second call gives it again, and once the request has ended it follows the end
    /// (`Completed` true, `Rejected` false, else `None`), before and after `wait` took it.
    pub fn recv_ready(
        &self,
        key: RequestKey,
        deadline: Instant,
        cancel: Option<&dyn Fn() -> bool>,
    ) -> Option<bool> {
        self.block(WaitKey::Ready(key), deadline, cancel, |core| {
            match core.terminals.get(&(key, Role::Receiver)) {
                Some(Outcome::Completed) => Some(Some(true)),
                Some(Outcome::Rejected) => Some(Some(false)),
                Some(_) => Some(None),
                None => match core.ep.receive_answer(key) {
                    Some(a) => Some(Some(a)),
                    None if !core.ep.running(key, Role::Receiver)
                        && !core.deferred.contains_key(&key) =>
                    {
                        Some(None)
                    }
                    None => None,
                },
            }
        })
        .flatten()
    }

    /// Context side: sends segment `segment` of `key` to `to` from `data`. See
    /// [`Engine::send_segments`].
    pub fn send(
        &self,
        key: RequestKey,
        to: RankId,
        segment: u32,
        data: &[u8],
        deadline: Instant,
        cancel: Option<&dyn Fn() -> bool>,
    ) -> Result<Outcome> {
        self.send_segments(key, to, &[(segment, data)], deadline, cancel)
    }

    /// Context side: sends several segments of `key` to `to` at once (posted together, waited
    /// once), after [`Engine::accept`]. Returns `Completed` when every one of this rank's
    /// tracked sends completed (the request's agreed end comes from [`Engine::wait`]); any
    /// other outcome is also given to the protocol core, which makes it the agreed verdict.
    /// Returns by the earlier of `deadline` and the request's deadline (plus the drain bound).
    ///
    /// Misuse is an error at once and changes nothing: an unknown request (`UnknownRequest`), a
    /// send before accept, no segment at all, a segment never advertised, a segment sent twice,
    /// or a size other than advertised (`InvalidArgument`).
    pub fn send_segments(
        &self,
        key: RequestKey,
        to: RankId,
        segments: &[(u32, &[u8])],
        deadline: Instant,
        cancel: Option<&dyn Fn() -> bool>,
    ) -> Result<Outcome> {
        let _returned = timeline::on_return(Stage::SendReturned);
        let inner = &self.inner;
        let mut core = inner.core.lock();
        if segments.is_empty() {
            // Nothing to send is no send: without this, any key (known or not) came back
            // `Completed` with nothing sent.
            return Err(if core.ep.knows_send(key, to) {
                key_err(ErrorKind::InvalidArgument, key, "no segment given")
            } else {
                key_err(
                    ErrorKind::UnknownRequest,
                    key,
                    &format!("no advertisement from {to} is known here"),
                )
            });
        }
        // Per segment, inline for the usual one or two: no allocation on this path but the
        // abort flag's.
        let mut descs: SmallVec<[_; 2]> = SmallVec::with_capacity(segments.len());
        let mut regions: SmallVec<[_; 2]> = SmallVec::with_capacity(segments.len());
        for (i, (segment, data)) in segments.iter().enumerate() {
            // Data inside a region must lie wholly inside it (nothing is posted otherwise).
            let region = core
                .regions
                .find(data.as_ptr() as u64, data.len() as u64)
                .map_err(|e| key_err(e.kind, key, &format!("segment {segment}: {}", e.message)))?;
            regions.push(region);
            if segments[..i].iter().any(|(s, _)| s == segment) {
                return Err(key_err(
                    ErrorKind::InvalidArgument,
                    key,
                    &format!("segment {segment} given twice"),
                ));
            }
            match core.ep.check_send(key, to, *segment, data.len() as u64)? {
                Ok(d) => descs.push(d),
                Err(ended) => return Ok(ended),
            }
        }
        let until = core
            .ep
            .send_deadline(key, to)
            .map_or(deadline, |d| d.min(deadline));
        for (segment, _) in segments {
            core.ep.begin_send(key, to, *segment);
        }
        if inner.faults.suppress_data_of_request == Some(key.request.0) {
            tracing::warn!(%key, "fault hook: data suppressed");
            let now = Instant::now();
            for (segment, _) in segments {
                let _ = core.ep.handle_send_done(now, key, to, *segment, true);
            }
            inner.flush(&mut core);
            return Ok(Outcome::Completed);
        }
        let peer = core.peers.endpoint(to).zip(core.peers.keys(to));
        let mut ops: SmallVec<[_; 2]> = SmallVec::with_capacity(segments.len());
        let mut first_err = None;
        for (((segment, data), desc), region) in segments.iter().zip(&descs).zip(&regions) {
            let posted = match peer {
                None => Err(Error::new(
                    ErrorKind::PeerLost,
                    format!("{to} is not connected"),
                )),
                // SAFETY: `data` is borrowed for this call, and every op is waited for below
                // before it returns (a wait that gives up stops and reaps its op), except an op
                // from a region, whose memory the caller has lent for longer (see below).
                Some((p, keys)) => unsafe {
                    inner.agent.post_send_with(
                        p,
                        keys.outbound.tag(desc.token),
                        data.as_ptr(),
                        data.len(),
                        region.is_some(),
                    )
                },
            };
            match posted {
                Ok(mut op) => {
                    if let (Some(r), Some((p, _))) = (region, peer) {
                        // A send that its receiver does not drain is left to UCX, not its
                        // endpoint closed: the region outlives it, and UCX only reads it.
                        op.detach_on_stop();
                        let (addr, len) = (data.as_ptr() as u64, data.len() as u64);
                        let _ = core.regions.track(op.id(), p.0, false, *r, addr, len);
                    }
                    let flag = Arc::new(AtomicBool::new(false));
                    core.sends.insert((key, to, *segment), flag.clone());
                    ops.push((*segment, op, flag));
                }
                Err(e) => {
                    let _ = core
                        .ep
                        .handle_send_done(Instant::now(), key, to, *segment, false);
                    if e.kind != ErrorKind::PeerLost && first_err.is_none() {
                        first_err = Some(e);
                    }
                }
            }
        }
        inner.flush(&mut core);
        drop(core);
        let mut results: SmallVec<[_; 2]> = SmallVec::with_capacity(ops.len());
        let told = std::cell::Cell::new(false);
        // The check said so (once is enough: it is not asked again for the verdict below).
        let asked_off = std::cell::Cell::new(false);
        // Once one send is given up, the rest of the request's sends are asked to stop at once
        // and share its grace (their receiver drains them meanwhile), instead of waiting a grace
        // each in turn: a request may have many.
        let mut shared_grace = false;
        for i in 0..ops.len() {
            let (done, rest) = ops.split_at_mut(i + 1);
            let (segment, op, flag) = &mut done[i];
            let segment = *segment;
            let stop = || {
                if flag.load(Ordering::Acquire) {
                    return true; // the core aborted it: the verdict is already known
                }
                if !cancel.is_some_and(|c| c()) {
                    return false;
                }
                asked_off.set(true);
                // Tell the receiver before the send is stopped: stopping a send the receiver
                // cannot drain closes the endpoint, and the vote must get there first.
                if !told.replace(true) {
                    self.give_up(key, Outcome::Cancelled);
                }
                true
            };
            let r = op.wait_telling(until, Some(&stop), |why| {
                // At the deadline the vote goes out before the send is stopped, for the same
                // reason, and so that the agreement runs while the stop takes its grace.
                if !flag.load(Ordering::Acquire) && !told.replace(true) {
                    self.give_up(key, why);
                }
                if !shared_grace {
                    shared_grace = true;
                    let grace = Instant::now() + reap_grace(inner.agreement_bound);
                    for (_, other, _) in rest.iter_mut() {
                        other.request_cancel();
                        other.limit_grace(grace);
                    }
                }
            });
            results.push((segment, r, op.id(), op.is_quiesced()));
        }
        // Each op has ended here (waited for, or stopped and reaped): let them go before the
        // core's lock is taken again.
        drop(ops);
        // Asked here, before the core's lock is taken: the check may take other locks (the
        // engine's among them). Only a send that did not complete needs its answer.
        let cancelled = results
            .iter()
            .any(|(_, r, _, _)| !matches!(r, Ok(Outcome::Completed)))
            && (asked_off.get() || cancel.is_some_and(|c| c()));
        let mut core = inner.core.lock();
        let now = Instant::now();
        let mut outcome = if segments.len() > results.len() {
            Ok(Outcome::PeerLost)
        } else {
            Ok(Outcome::Completed)
        };
        for (segment, r, id, quiesced) in results {
            core.sends.remove(&(key, to, segment));
            if quiesced {
                core.regions.done(id);
            } else {
                // Left to UCX (`detach_on_stop`): it ends on its own, reported by `OpDone`.
                core.regions.fence(id);
            }
            // This rank's reason goes first: the core takes a failed send with no reason given
            // as a lost peer.
            let why = match r {
                _ if cancelled => Some(Outcome::Cancelled),
                Ok(o @ (Outcome::TimedOut | Outcome::Cancelled)) => Some(o),
                // A loss learned only after the deadline (a frozen rank resuming) does not
                // change why the request failed here.
                Ok(Outcome::PeerLost) if now >= until => Some(Outcome::TimedOut),
                _ => None,
            };
            if let Some(why) = why.filter(|_| !matches!(r, Ok(Outcome::Completed))) {
                let _ = core.ep.give_up(now, key, why);
            }
            let ok = matches!(r, Ok(Outcome::Completed));
            let _ = core.ep.handle_send_done(now, key, to, segment, ok);
            if matches!(outcome, Ok(Outcome::Completed)) && !ok {
                outcome = r;
            }
        }
        inner.flush(&mut core);
        match first_err {
            Some(e) => Err(e),
            None => outcome,
        }
    }

    /// [`Engine::send`] for data in CUDA device memory: staged through a pinned host buffer
    /// (device -> host copy, then the tagged send), since the system UCX cannot read device
    /// memory. `ErrorKind::Cuda` where no driver or no such device exists. Misuse is told as for
    /// [`Engine::send`], before anything is staged or copied.
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
        // The request's checks first (unknown, not accepted, segment, size): a misuse is not a
        // CUDA error, and costs no pinned buffer and no copy. `send` checks again.
        if let Err(ended) = self
            .inner
            .core
            .lock()
            .ep
            .check_send(key, to, segment, len as u64)?
        {
            return Ok(ended);
        }
        let mut staging = Staging::new(device, len)?;
        staging.from_device(device_addr, len)?;
        self.send(key, to, segment, staging.host_slice(len)?, deadline, cancel)
    }

    /// Waits for the agreed end of `key` on this rank as `role`, and takes it (a second wait
    /// for the same key and role is `UnknownRequest`; one made while another call waits for it
    /// is `InvalidArgument` at once). At `deadline` (or on `cancel()`) this
    /// rank gives up on the request (`TimedOut` / `Cancelled`, agreed with the other ranks
    /// within the agreement bound), so the call returns by the deadline plus that bound plus
    /// a few milliseconds, with buffers that nothing can write any more (outside the fenced
    /// ranges of a region: [`Engine::region_fenced_ranges`]).
    pub fn wait(
        &self,
        key: RequestKey,
        role: Role,
        deadline: Instant,
        cancel: Option<&dyn Fn() -> bool>,
    ) -> Result<Outcome> {
        let _span = timeline::span(Stage::WaitCalled, Stage::WaitReturned);
        let take = |core: &mut Core| core.terminals.remove(&(key, role));
        // The largest buffer a receive waits for: a bulk one is not polled for.
        let mut largest = 0;
        {
            let mut core = self.inner.core.lock();
            let busy = || {
                key_err(
                    ErrorKind::InvalidArgument,
                    key,
                    "another call is already waiting for it in that role (its end goes to that call)",
                )
            };
            // Looked at before the end is taken: an end that came while the waiting call was
            // awake (driving progress, or in its cancel check) is that call's.
            if core.waited.contains(&(key, role)) {
                return Err(busy());
            }
            if let Some(o) = take(&mut core) {
                return Ok(o);
            }
            let known = core.ep.running(key, role)
                || (role == Role::Receiver && core.deferred.contains_key(&key));
            if !known {
                return Err(key_err(
                    ErrorKind::UnknownRequest,
                    key,
                    "not running here in that role (never started, or already waited for)",
                ));
            }
            core.waited.insert((key, role));
            if role == Role::Receiver {
                largest = core.ep.largest_receive_segment(key).unwrap_or(0);
            }
        }
        let _owner = WaitOwner {
            inner: &self.inner,
            key: (key, role),
        };
        let terminal = WaitKey::Terminal(key, role);
        let why = match self.block_for(largest, terminal, deadline, cancel, take) {
            Ok(o) => return Ok(o),
            // The check said so once: a check that answers true only once (an edge, not a
            // flag) is not asked again here.
            Err(Ended::Cancelled) => Outcome::Cancelled,
            // At the deadline (or the engine's stop), a cancel raised meanwhile still counts.
            Err(_) if cancel.is_some_and(|c| c()) => Outcome::Cancelled,
            Err(_) => Outcome::TimedOut,
        };
        self.give_up(key, why);
        let settle = Instant::now() + self.inner.agreement_bound + SETTLE_SLACK;
        if let Some(o) = self.block(WaitKey::Terminal(key, role), settle, None, take) {
            return Ok(o);
        }
        tracing::error!(%key, "wait returns before the request settled");
        let mut core = self.inner.core.lock();
        core.counters.unsettled_returns += 1;
        if role == Role::Receiver {
            // The request's receives that UCX still holds may still be written. In a region
            // their ranges are fenced now (the `Fence` action that would do it has not run:
            // the progress thread is stuck), or a new request would be handed memory UCX may
            // still write, and the region counted in use by a running request.
            let held: SmallVec<[u64; 16]> = core
                .recv_ops
                .iter()
                .filter(|(_, r)| r.key == key)
                .map(|(&id, _)| id)
                .collect();
            for id in held {
                core.regions.fence(id);
            }
        }
        Ok(why)
    }

    /// Cancels `key` on this rank; the cancel is agreed with every rank of the request. A
    /// request that has already ended here, in either role, is left as it ended and the call
    /// succeeds: a cancel that races the end is no error, on the sending side as on the
    /// receiving one (ended keys are remembered as long as replays are refused, 10 minutes).
    /// A key not known here (never run, or ended longer ago than that, or pushed out of that
    /// memory by its cap of 2^20 keys) is `UnknownRequest`.
    pub fn cancel(&self, key: RequestKey) -> Result<()> {
        let mut core = self.inner.core.lock();
        let r = core.ep.cancel(Instant::now(), key);
        self.inner.flush(&mut core);
        match r {
            Ok(()) => Ok(()),
            Err(_) if core.ended_here(key) => Ok(()),
            Err(e) => Err(Error::new(ErrorKind::UnknownRequest, e.message)),
        }
    }

    fn give_up(&self, key: RequestKey, why: Outcome) {
        let mut core = self.inner.core.lock();
        let _ = core.ep.give_up(Instant::now(), key, why);
        self.inner.flush(&mut core);
    }

    /// Sends an ordered notification to `to`: `UnknownPeer` for a rank never connected here,
    /// `PeerLost` for one whose connection failed (reconnecting, or failed for good), as for
    /// an advertise.
    pub fn notify(&self, to: RankId, key: RequestKey, payload: Vec<u8>) -> Result<()> {
        let mut core = self.inner.core.lock();
        if core.peers.endpoint(to).is_none() {
            return Err(match core.peers.state(to) {
                PeerState::Unknown => {
                    Error::new(ErrorKind::UnknownPeer, format!("{to} is not connected"))
                }
                state => Error::new(
                    ErrorKind::PeerLost,
                    format!("{to}: its connection failed ({state:?})"),
                ),
            });
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
        // As in `next_advertisement`: one sleeper woken per notification, the turn passed on.
        self.block(WaitKey::Note(from), deadline, cancel, |core| {
            let q = core.notes.get_mut(&from)?;
            let note = core.waiters.take(WaitKey::Note(from), q)?;
            if q.is_empty() {
                // Ranks come and go: their empty queues must not pile up.
                core.notes.remove(&from);
            }
            core.note_bytes -= glue::note_bytes(&note.1);
            Some(note)
        })
    }

    /// A fault for tests: the engine's agent acts as if its shared-memory receive queue were
    /// found stuck (it moves to a new worker, unless report-only), with no writer killed.
    #[doc(hidden)]
    pub fn fault_stuck_receive_queue(&self) -> Result<()> {
        self.inner.agent.fault_stuck_receive_queue()
    }

    /// A fault for tests: the engine's progress thread stalls (see
    /// [`Agent::fault_stall_progress`](crate::transport::Agent::fault_stall_progress)).
    #[doc(hidden)]
    pub fn fault_stall_progress(&self, stall: Duration, at_next_connect: bool) -> Result<()> {
        self.inner
            .agent
            .fault_stall_progress(stall, at_next_connect)
    }

    /// For tests: how many handshakes this side has begun as the dialler (`connect`'s dials
    /// and its reconnect rounds').
    #[doc(hidden)]
    pub fn dials_begun(&self) -> u64 {
        self.inner.core.lock().counters.dials
    }

    /// A fault for tests: force-closes this side's endpoint to `rank` (as a connection that
    /// broke). `UnknownPeer` if no endpoint serves it.
    #[doc(hidden)]
    pub fn fault_close_peer(&self, rank: RankId) -> Result<()> {
        let peer = self.inner.core.lock().peers.endpoint(rank);
        let peer = peer.ok_or_else(|| Error::new(ErrorKind::UnknownPeer, format!("{rank}")))?;
        self.inner.agent.close_peer(peer)
    }

    /// The progress snapshot.
    pub fn health(&self) -> Health {
        let s = self.inner.agent.stats();
        let core = self.inner.core.lock();
        let ps = core.ep.stats();
        let c = core.counters;
        let now = Instant::now();
        let since_fault = c.last_fault.map(|t| now.saturating_duration_since(t));
        // Stalled for: since the last data completion, but no longer than the oldest pending op
        // has existed (new work after a quiet spell is not a stall).
        let stalled = match (s.oldest_in_flight, s.since_last_completion) {
            (None, _) => Duration::ZERO,
            (Some(age), Some(since)) => age.min(since),
            (Some(age), None) => age,
        };
        let (wedge, degraded) = self.inner.windows;
        let state = if stalled > wedge || s.receive_stuck {
            HealthState::Wedged
        } else if since_fault.is_some_and(|d| d <= degraded) {
            HealthState::Degraded
        } else {
            HealthState::Healthy
        };
        Health {
            state,
            since_last_fault_ms: since_fault.map_or(u64::MAX, |d| d.as_millis() as u64),
            peers: core.peers.connected() as u64,
            peers_failed: core.peers.failures,
            peers_reconnecting: core.peers.count(PeerState::Reconnecting) as u64,
            reconnects: core.peers.reconnects,
            requests_known: core.ep.known() as u64,
            completed: ps.completed,
            failed: ps.failed,
            stale_dropped: ps.stale_dropped + c.replays_dropped,
            // The transport's too: batches that did not split, and messages on a peer's
            // endpoint in another voice than its own (docs/SECURITY.md).
            bad_frames: ps.bad_frames + c.bad_frames + s.control_malformed + s.control_spoofed,
            adverts_refused: c.adverts_refused,
            notes_dropped: c.notes_dropped,
            buffers_leased: core.pool.leased() as u64,
            buffers_fenced: core.pool.fenced() as u64,
            ops_in_flight: s.in_flight,
            oldest_op_ms: s.oldest_in_flight.map_or(0, |d| d.as_millis() as u64),
            since_last_completion_ms: s
                .since_last_completion
                .map_or(u64::MAX, |d| d.as_millis() as u64),
            bytes_completed: s.bytes_completed,
            unreaped_ops: s.unreaped,
            unsettled_returns: c.unsettled_returns,
            foreign_data: c.foreign_data,
            late_data: c.late_data,
            refused_auth: core.peers.refusals.auth,
            refused_rank_in_use: core.peers.refusals.rank_in_use,
            refused_version: core.peers.refusals.version,
            refused_by_peer: core.peers.refusals.by_peer,
            receive_stuck: s.receive_stuck,
            worker_renewals: s.worker_renewals,
            region_fenced_bytes: core.regions.fenced_bytes(),
            region_fences: core.regions.fences(),
            resends: ps.retransmits,
            duplicates: ps.duplicates,
            unknown_dropped: ps.unknown_dropped,
            early_kept: ps.early_kept,
            ranks_forgotten: core.peers.forgotten,
        }
    }

    /// This engine's metrics in the Prometheus text format (version 0.0.4): requests by outcome
    /// and role, their durations, bytes moved, and the gauges and counters of [`Health`]
    /// (README, "Metrics"). Does not block beyond the engine's lock; opens no port.
    pub fn metrics_text(&self) -> Result<String> {
        self.inner.metrics.text(&self.health())
    }

    /// Blocks until `f` yields, `deadline` passes, `cancel()` says so (checked every 5 ms when
    /// given) or the engine stops; woken only for `key`.
    fn block<T>(
        &self,
        key: WaitKey,
        deadline: Instant,
        cancel: Option<&dyn Fn() -> bool>,
        f: impl FnMut(&mut Core) -> Option<T>,
    ) -> Option<T> {
        self.block_for(0, key, deadline, cancel, f).ok()
    }

    /// [`Engine::block`] for a wait whose largest single transfer is `transfer` bytes (a bulk
    /// one is left to the progress thread: [`Agent::driving`](crate::transport::Agent::driving)),
    /// saying why it ended without `f`'s answer.
    fn block_for<T>(
        &self,
        transfer: u64,
        key: WaitKey,
        deadline: Instant,
        cancel: Option<&dyn Fn() -> bool>,
        mut f: impl FnMut(&mut Core) -> Option<T>,
    ) -> std::result::Result<T, Ended> {
        let transfer = usize::try_from(transfer).unwrap_or(usize::MAX);
        let mut driving = self.inner.agent.driving(transfer);
        let mut polling = true;
        let mut pace = CancelPace::default();
        let mut core = self.inner.core.lock();
        loop {
            if let Some(v) = f(&mut core) {
                return Ok(v);
            }
            if self.inner.stopping.load(Ordering::Acquire) {
                return Err(Ended::Stopping);
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Ended::Deadline);
            }
            if let Some(c) = cancel.filter(|_| pace.due(now, polling)) {
                // The check may take other locks: never call it under ours.
                if MutexGuard::unlocked(&mut core, c) {
                    return Err(Ended::Cancelled);
                }
                // The lock was released for the check: a wake in between must not be lost.
                if let Some(v) = f(&mut core) {
                    return Ok(v);
                }
            }
            // Within the poll window, run the progress pass here instead of sleeping: the event
            // we wait for is then handled on this thread, with no wake-up in between. Our lock
            // is released first (the sink takes it in the pass).
            if polling {
                // The lock was released for the step: look again either way before a sleep.
                polling = MutexGuard::unlocked(&mut core, || driving.step(now));
                continue;
            }
            let until = match cancel {
                Some(_) => deadline.min(now + CANCEL_POLL),
                None => deadline,
            };
            sleep(&mut core, key, until);
        }
    }
}

/// Why [`Engine::block_for`] ended without its answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Ended {
    Deadline,
    Cancelled,
    /// The engine is stopping.
    Stopping,
}

/// The one `wait` call blocked on a (request, role): it lets the pair go when it returns.
struct WaitOwner<'a> {
    inner: &'a Inner,
    key: (RequestKey, Role),
}

impl Drop for WaitOwner<'_> {
    fn drop(&mut self) {
        self.inner.core.lock().waited.remove(&self.key);
    }
}

/// How long dropping an engine waits for its last control messages (a verdict just decided) to
/// leave, so a peer is not left to find a closed endpoint instead of the verdict.
const DRAIN_ON_DROP: Duration = Duration::from_millis(200);

impl Drop for Engine {
    fn drop(&mut self) {
        let until = Instant::now() + DRAIN_ON_DROP;
        loop {
            let pending = {
                let mut core = self.inner.core.lock();
                core.control_ops.retain_mut(|op| op.poll().is_none());
                !core.control_ops.is_empty()
            } || self.inner.agent.push_pending();
            if !pending || Instant::now() >= until {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        self.inner.stopping.store(true, Ordering::Release);
        self.inner.core.lock().waiters.wake_all();
        // Stop the progress thread (where the core's sink runs) while this engine still owns
        // the agent, so the sink is never the one to drop it.
        self.inner.agent.shutdown();
    }
}

/// A `connect` dialling an address ([`kvlink_proto::peers::Peers::connect_begins`]): no
/// reconnect round dials that address until it ends, when its dial gives way or it returns.
struct Connecting<'a> {
    inner: &'a Inner,
    address: Option<&'a str>,
}

impl<'a> Connecting<'a> {
    fn begin(inner: &'a Inner, address: &'a str) -> Self {
        inner.core.lock().peers.connect_begins(address);
        Connecting {
            inner,
            address: Some(address),
        }
    }

    fn end(&mut self, core: &mut Core) {
        if let Some(a) = self.address.take() {
            core.peers.connect_ends(a);
        }
    }
}

impl Drop for Connecting<'_> {
    /// Takes the core's lock: drop it where the lock is not held.
    fn drop(&mut self) {
        if let Some(a) = self.address.take() {
            self.inner.core.lock().peers.connect_ends(a);
        }
    }
}

/// `connect`'s wait after its dial gave way to `rank`'s dial the other way (or to another dial
/// of this side, or to this side's reconnect round): until that one is bound, or ends, or (when
/// its connection broke) `REDIAL_WAIT` passes without the redial, and by `deadline`.
fn wait_for_crossing(
    core: &mut MutexGuard<'_, Core>,
    rank: RankId,
    address: &str,
    deadline: Instant,
) -> Result<RankId> {
    loop {
        if core.peers.state(rank) == PeerState::Connected {
            return Ok(rank);
        }
        // A redial expected from the rank is waited for a while, not to the deadline.
        let now = Instant::now();
        let until = core
            .peers
            .redial_expected_until(rank, now)
            .map_or(deadline, |t| t.min(deadline));
        if core.peers.waiting_for_crossing(rank, now)
            && (sleep(core, WaitKey::Peer(rank), until) || Instant::now() < deadline)
        {
            continue;
        }
        return Err(if core.peers.redial_was_expected(rank) {
            Error::new(
                ErrorKind::PeerLost,
                format!(
                    "{address}: {rank} dialled this side at the same time, this dial gave way to \
                     its, and that connection broke; its redial did not come in time (connect \
                     again)"
                ),
            )
        } else if core.peers.state(rank) == PeerState::Failed {
            // The connection it gave way to (the rank's dial, another of ours, or this side's
            // reconnect round) ended without binding the rank.
            Error::new(
                ErrorKind::PeerLost,
                format!(
                    "{address}: this dial gave way to another connection to {rank}, which \
                     failed (connect again)"
                ),
            )
        } else {
            Error::new(
                ErrorKind::RankInUse,
                format!(
                    "{address}: this dial gave way to another connection to {rank} (its dial \
                     the other way, or another of this side's), which did not complete"
                ),
            )
        });
    }
}

/// A worker address as a rank's address text: `ucx:<hex>` ([`dial`] reads it back).
fn worker_address_text(address: &[u8]) -> String {
    let hex: String = address.iter().map(|x| format!("{x:02x}")).collect();
    format!("{WORKER_ADDRESS_PREFIX}{hex}")
}

/// Hex digits to bytes; any other character (non-ASCII included) is an `InvalidArgument`.
fn unhex(s: &str) -> Result<Vec<u8>> {
    let bad = || Error::invalid("a worker address is an even number of hex digits after 'ucx:'");
    let digits = s.as_bytes();
    if digits.is_empty() || digits.len() % 2 != 0 {
        return Err(bad());
    }
    let nibble = |c: u8| (c as char).to_digit(16).map(|d| d as u8).ok_or_else(bad);
    digits
        .chunks(2)
        .map(|p| Ok(nibble(p[0])? << 4 | nibble(p[1])?))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unhex_refuses_odd_non_hex_and_non_ascii_without_panicking() {
        assert_eq!(unhex("00ff7a").unwrap(), vec![0, 255, 0x7a]);
        let text = worker_address_text(&[1, 2, 254]);
        assert!(crate::proto::peers::is_worker_address(&text), "{text}");
        let h = text.strip_prefix(WORKER_ADDRESS_PREFIX).unwrap();
        assert_eq!(unhex(h).unwrap(), vec![1, 2, 254]);
        for bad in ["", "0", "0g", "é1", "1é", "ééé"] {
            assert_eq!(
                unhex(bad).unwrap_err().kind,
                ErrorKind::InvalidArgument,
                "{bad}"
            );
        }
    }
}
