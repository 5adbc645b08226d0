//! The engine's public configuration and value types: [`EngineConfig`] and its [`Faults`],
//! the [`BufferSpec`] a generation rank offers, the [`Advertisement`] a context rank receives,
//! and the [`Health`] snapshot with its [`HealthState`].

#[cfg(doc)]
use super::Engine;
use crate::proto::{BufferDesc, BufferKind, Config, RankId, RequestKey};
use crate::transport::TransportKind;
use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The longest timeout, bound or window the engine takes: a year, the core's own cap
/// ([`crate::proto::request::LONGEST`]). "Forever" (a C++ `milliseconds::max()`, `u64::MAX` ms,
/// `Duration::MAX`) lands here: past it a deadline is not representable everywhere it is used
/// (an `Instant`, a timer's nanoseconds), and a year is longer than any transfer.
pub const LONGEST_WAIT: Duration = crate::proto::request::LONGEST;

/// Configuration of one rank's engine.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Agent name (for logs and the peer's `Hello`): 1 to `wire::MAX_NAME` (256) bytes, else
    /// [`Engine::new`](super::Engine::new) is `InvalidArgument`.
    pub name: String,
    /// This rank's id, unique across both engines of a deployment.
    pub rank: u32,
    pub transport: TransportKind,
    /// Network devices in `UCX_NET_DEVICES` syntax (`mlx5_0:1`, `eth0`); None: UCX's choice.
    pub net_devices: Option<String>,
    /// tcp: listen here (`ip:port`, port 0 picks one). Shared memory connects by worker address.
    /// `0.0.0.0` accepts on every interface, and [`Engine::address`] reports one of this host's
    /// addresses for it. With [`TransportKind::Tcp`] and devices, an address on an interface the
    /// devices leave out is refused by `Engine::new` (`InvalidArgument`).
    pub listen: Option<SocketAddr>,
    /// The default per-request deadline: TensorRT-LLM's `kv_transfer_timeout_ms`. Any of
    /// these five durations longer than [`LONGEST_WAIT`] (a year) is taken as a year. The
    /// sender learns what is left of a deadline in whole milliseconds, at most 2^32 - 1 (about
    /// 49.7 days): a longer deadline ends the sender's side of the request then.
    pub timeout: Duration,
    /// How long past a deadline the ranks may spend agreeing before each ends on its own.
    pub agreement_bound: Duration,
    /// How long the protocol core keeps a request that ended without completing in full past
    /// its end (the core's [`Config::linger`], 5 s by default): meanwhile it pushes the failure
    /// verdict again to a sender that has not confirmed it, answers late duplicates from the
    /// whole request and counts it in [`Health::requests_known`]. Memory for tolerance: at a
    /// high failure rate the core holds every request that failed within the last linger, and
    /// a shorter one holds fewer. A `Completed` request does not linger (it is forgotten at its
    /// end). Zero: a failed request is forgotten at its end as a completed one is; its tombstone
    /// (kept to its deadline plus the agreement bound) still answers a late vote or verdict, and
    /// a sender that missed the failure verdict pulls it rather than having it pushed again.
    /// Past the tombstone the engine still remembers each end for 10 minutes. A context rank's
    /// request whose [`Engine::send`](crate::connection::Engine::send) has not returned yet is
    /// kept until it has, linger or not (a minute past the linger at most).
    pub linger: Duration,
    /// `health().state`: work pending and no data landing or sent for this long is `Wedged`
    /// (10 s by default). Taken as given: zero makes any pending work `Wedged` at once (the C++
    /// `EngineConfig` and the bridge take zero as the default instead).
    pub wedge_window: Duration,
    /// `health().state`: a fault (failed peer, failed request) this recent is `Degraded` (60 s
    /// by default). Zero: never `Degraded` (the C++ `EngineConfig`: zero is the default).
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
            linger: Config::default().linger,
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
    /// after the close) for UCX to let it go, and for the close to run at most 2 s more (see the
    /// deadline rule). Nonzero only when UCX keeps a transfer past the close of its endpoint, or
    /// the progress thread ran nothing for that long; each one is also logged.
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
    /// unused, 10 minutes after it came, or sooner when the store of such messages is full):
    /// dropped. Older generations of a request still known (or remembered by its
    /// tombstone) count in `stale_dropped` instead.
    pub unknown_dropped: u64,
    /// Votes and failure verdicts that came for a request before it had started here (its
    /// ranks start it apart), kept for its start (for 10 minutes, or the longest deadline of a
    /// request started here plus the agreement bound if longer; 8192 requests' worth at most): another rank's early
    /// cancel or landing counts as soon as the request starts here, not at the voter's resend.
    pub early_kept: u64,
    /// Ranks that dialled this side and failed, forgotten to bound the peer table (more than
    /// 8192 such failures since; docs/SECURITY.md): each reads `Unknown` again.
    pub ranks_forgotten: u64,
    /// Connections whose peer said it was leaving (its engine was dropped): each ended at once,
    /// as a failed one does, and counts in `peers_failed` too, but is no fault for `state` (the
    /// requests it cost are).
    pub peers_left: u64,
}

const POOL_SLOTS: u32 = 1 << 16;
/// The most receive buffers an engine may have posted at once ([`EngineConfig::pool_slots`]):
/// its slot table is allocated whole at start, and `u32::MAX` slots (tens of GB) would end the
/// process in the allocator instead of returning an error.
pub const MAX_POOL_SLOTS: u32 = 1 << 20;
