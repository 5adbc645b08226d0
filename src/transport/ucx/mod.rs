//! The UCX agent: the only module with `unsafe` and the only one that calls UCX.
//!
//! # Threading
//! The UCX worker (`UCS_THREAD_MODE_SERIALIZED`) and everything made from it live in one
//! `Progress`, behind the driver lock (`Shared::driver`): every UCX call happens under it, one
//! thread at a time. Other threads hand work over through a command queue and an `eventfd`.
//! - The progress thread runs one pass at a time under the lock (commands, a burst of
//!   `ucp_worker_progress`, what the callbacks reported, the owner's sink). When there is nothing
//!   to do it arms the worker (`ucp_worker_arm`), lets go of the lock and sleeps in `epoll_wait`
//!   on the worker's event fd and the eventfd, with a bounded timeout so UCX keepalive still runs.
//!   A caller that queues work writes the eventfd only while the thread says it sleeps; the
//!   thread says so first and then looks at the queues once more (`Shared::nudge`,
//!   `Shared::about_to_sleep`), so a busy thread is not signalled for every command. Work a
//!   caller started itself that still needs one of the thread's passes (a send UCX queued) is
//!   recorded as a debt the same way (`Shared::owe_pass`): an awake thread pays it with one
//!   more pass before it sleeps, and each of its passes pays the debts made before it began.
//! - A caller that waits (an [`Op::wait`], the engine's blocking calls) may take the lock with
//!   `try_lock` and run passes itself ([`Agent::driving`]) for a short window after the last
//!   progress (`KVLINK_POLL_US`, 100 µs): the completion it waits for is then handled on its own
//!   thread, with no wake-up between threads (one costs about 25 µs on this machine). When it
//!   stops, it wakes a sleeping progress thread, which arms the worker over what the caller left.
//!
//! Nothing spins without bound: polling only follows progress, for one window; after many
//! wake-ups in a row that make no progress, the loop backs off (the tcp spin trap described in
//! the project's toolchain notes, outside this repository). The progress thread yields the core between its polling passes (and between
//! retries of a worker that cannot be armed): on a small machine the thread it has just woken is
//! often queued on that very core. Callers that drive do not yield (measured: it doubles the
//! back-to-back 4 KiB request).
//!
//! # Completion bound to the request
//! Data moves with tag-matched two-sided operations. A receive is posted into the caller's buffer
//! under a 64-bit tag; its own completion is the data's arrival, checked for length. There is no
//! separate "done" message. A send completes when UCX completes the send request.
//!
//! # Waits
//! Every wait ([`Op::wait`]) takes a deadline and an optional cancel check and returns an
//! [`Outcome`](crate::Outcome). A wait that does not complete cancels its UCX request and waits
//! (bounded) until UCX has released it, so that the buffer can no longer be written when the wait
//! returns; if the request cannot be reaped in time the endpoint is force-closed, and if even that
//! does not release it the op reports itself as not quiesced ([`Op::is_quiesced`]) so the owner
//! fences the buffer instead of reusing it.
//!
//! # Peer failure
//! Endpoints are created with peer error handling. The UCX error callback moves the peer to the
//! failed state, which every later operation checks, and the progress thread cancels the posted
//! receives that belong to that peer (UCX does not complete unmatched receives on its own).
//!
//! # Layout
//! One room per concern; the direction of use is from the owner's threads down to UCX:
//! - `agent`: the public face ([`Agent`], [`MemHandle`], [`RemoteKey`]): checks, then a command.
//! - `op`: one in-flight request ([`Op`]) and its completion slot; waits, stops and outcomes.
//! - `shared`: what the owner's threads and the progress thread share: the driver lock, the command
//!   queue, one-shot replies, events, counters, and a caller's turn at driving ([`Driving`]).
//! - `progress`: the pass, the progress thread's loop, the commands, start and teardown.
//! - `peers`: endpoints, under the driver lock: connect, bind, fail, drain.
//! - `tag`: two-sided transfers, under the driver lock (tag sends and receives, control
//!   messages) and how any op's request is handed to UCX and cancelled.
//! - `batch`: control messages to a peer whose queue is full, sent together once it has room.
//! - `rma`: one-sided transfers, under the driver lock (put, get) and memory mapping.
//! - `callbacks`: the `extern "C"` functions UCX calls, and how they report back.
//! - `handles`, `sys`: owning UCX handles, raw bindings.
mod address;
mod agent;
mod batch;
mod callbacks;
mod handles;
mod held;
mod op;
mod peers;
mod probe;
mod progress;
pub mod resources;
mod rma;
mod shared;
mod sys;
mod tag;

pub(crate) use agent::ipv4_only;
pub use agent::{Agent, MemHandle, RemoteKey};
pub use held::Held;
pub use op::{Op, OpAbort, CLOSE_RUN_LIMIT};
pub use resources::{memory_type_names, DevicePath};
pub(crate) use shared::{CancelPace, CANCEL_POLL};
pub use shared::{Driving, EventSink};

/// The send buffer an agent gives the tcp sockets UCX opens for it (`UCX_TCP_SNDBUF`), unless
/// `UCX_TCP_SNDBUF` is set in the environment: a fixed 256 KiB instead of the kernel's
/// autotuning. On loopback under BBR congestion control the autotuned buffer halves the rate of
/// 16 and 64 MiB transfers, for `ucx_perftest` as for kvlink (README, "Loopback tcp and the
/// send buffer"); under CUBIC the two are the same.
pub const TCP_SNDBUF: &str = "256K";

use crate::error::{Error, ErrorKind, Result};
use std::net::SocketAddr;
use std::time::Duration;

/// Which UCX transports an agent may use (the `transport` setting).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TransportKind {
    /// TCP sockets (on loopback in tests). Connect by `ip:port` (the agent listens).
    Tcp,
    /// Shared memory (posix/sysv) between processes on one host; connect by worker address.
    SharedMemory,
    /// Whatever UCX chooses among everything it has (`UCX_TLS` unset: `all`). Connect by
    /// `ip:port` when listening, else by worker address.
    Auto,
    /// An explicit UCX transport list, in `UCX_TLS` syntax: `rc,cuda_copy,cuda_ipc`, `tcp,self`,
    /// `^cma`. Checked against what the linked UCX has when the agent starts. Connects like
    /// [`TransportKind::Auto`].
    List(String),
}

impl TransportKind {
    /// The `UCX_TLS` value the agent sets, or None to leave UCX's choice.
    fn tls(&self) -> Option<&str> {
        match self {
            TransportKind::Tcp => Some("tcp"),
            // cma is left out: it is slower for large tag transfers here (toolchain notes).
            TransportKind::SharedMemory => Some("posix,sysv,self"),
            TransportKind::Auto => None,
            TransportKind::List(l) => Some(l),
        }
    }

    /// Whether peers connect by worker address rather than to a listener by default: shared
    /// memory, and a list with no network transport in it (a listener needs one).
    pub fn by_worker_address(&self) -> bool {
        match self {
            TransportKind::SharedMemory => true,
            TransportKind::List(l) => !l.starts_with('^') && !words(l).any(is_network),
            _ => false,
        }
    }

    /// Whether UCX may pick a shared-memory transport (posix, sysv) with this setting.
    pub fn may_use_mm(&self) -> bool {
        match self {
            TransportKind::Tcp => false,
            TransportKind::SharedMemory | TransportKind::Auto => true,
            TransportKind::List(l) => {
                l.starts_with('^')
                    || words(l).any(|w| ["posix", "sysv", "mm", "sm", "shm", "all"].contains(&w))
            }
        }
    }

    /// Whether UCX may pick a network transport with this setting.
    fn may_use_network(&self) -> bool {
        match self {
            TransportKind::SharedMemory => false,
            TransportKind::Tcp | TransportKind::Auto => true,
            TransportKind::List(l) => l.starts_with('^') || words(l).any(is_network),
        }
    }

    /// Parses `tcp`, `sm`, `auto` or a UCX transport list. Only the form is checked here; the
    /// names are checked against the linked UCX when an agent starts.
    pub fn parse(s: &str) -> Result<TransportKind> {
        let t = s.trim().to_ascii_lowercase();
        match t.as_str() {
            "tcp" => return Ok(TransportKind::Tcp),
            "sm" | "shm" | "shared-memory" => return Ok(TransportKind::SharedMemory),
            "auto" => return Ok(TransportKind::Auto),
            _ => {}
        }
        let body = t.strip_prefix('^').unwrap_or(&t);
        let word_ok = |w: &str| {
            let name = w.strip_suffix(":aux").unwrap_or(w);
            !name.is_empty()
                && name
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
        };
        if body.is_empty() || !body.split(',').all(word_ok) {
            return Err(Error::invalid(format!(
                "transport '{s}' is not tcp, sm, auto or a UCX transport list like \
                 rc,cuda_copy,cuda_ipc"
            )));
        }
        Ok(TransportKind::List(t))
    }

    /// Parses a whole transport setting, `<transport>[@<devices>]`: the transport as in
    /// [`TransportKind::parse`], and the network devices in `UCX_NET_DEVICES` syntax
    /// (`tcp@lo`, `rc,cuda_copy@mlx5_0:1`, `auto@eth0,eth1`).
    pub fn parse_setting(s: &str) -> Result<(TransportKind, Option<String>)> {
        let (t, devices) = match s.split_once('@') {
            Some((t, d)) => (t, Some(d.trim())),
            None => (s, None),
        };
        let kind = TransportKind::parse(t)?;
        if let Some(d) = devices {
            let body = d.strip_prefix('^').unwrap_or(d);
            let dev_ok = |w: &str| {
                !w.is_empty()
                    && w.bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b"_.:-".contains(&b))
            };
            if !body.split(',').all(dev_ok) {
                return Err(Error::invalid(format!(
                    "network devices '{d}' in '{s}' are not a UCX_NET_DEVICES list like \
                     mlx5_0:1 or eth0,lo"
                )));
            }
        }
        Ok((kind, devices.map(str::to_string)))
    }
}

/// The transport names of a `UCX_TLS` list, without `^` and `:aux`.
fn words(list: &str) -> impl Iterator<Item = &str> {
    list.trim_start_matches('^')
        .split(',')
        .map(|w| w.strip_suffix(":aux").unwrap_or(w))
}

/// Whether a `UCX_TLS` word names (or may stand for) a transport between hosts.
fn is_network(word: &str) -> bool {
    word == "all"
        || word == "tcp"
        || word == "ib"
        || word == "srd"
        || ["rc", "ud", "dc", "ugni"]
            .iter()
            .any(|p| word.starts_with(p))
}

impl std::fmt::Display for TransportKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TransportKind::Tcp => f.write_str("tcp"),
            TransportKind::SharedMemory => f.write_str("sm"),
            TransportKind::Auto => f.write_str("auto"),
            TransportKind::List(l) => f.write_str(l),
        }
    }
}

/// Options for one agent.
#[derive(Clone, Debug)]
pub struct AgentOptions {
    pub name: String,
    pub transport: TransportKind,
    /// Network devices in `UCX_NET_DEVICES` syntax (`mlx5_0:1`, `eth0`); None: UCX's choice.
    pub net_devices: Option<String>,
    /// Listen on this `ip:port` (port 0 picks one) for incoming connections.
    pub listen: Option<SocketAddr>,
    /// UCX keepalive interval: how fast a dead peer is found when no operation is pending.
    pub keepalive: Duration,
    /// How long a stopped op waits for its cancel (a send: for its receiver to drain it) before
    /// its endpoint is force-closed, and at most how long it then waits for the progress thread
    /// to run that close. After the close has run it waits at most 30 ms more, counted from the
    /// end of the grace, for UCX to let the op go (counted in `Stats::unreaped` if it does not).
    /// Longer than a year is taken as a year.
    pub reap_grace: Duration,
    /// Discard tagged data that matches no posted receive (reported as
    /// [`Event::StrayData`]) instead of keeping it for a receive posted later; the discard runs
    /// in a progress pass. For owners whose receive is always posted before a pass can see data
    /// under its tag (the engine: posted right after the advertisement naming it, in one batch
    /// with it, [`Agent::hold`]): then such data is from someone the buffer was not offered to,
    /// or too late, and it must neither land nor pile up in UCX's unexpected queue.
    pub discard_unexpected: bool,
    /// When the probe finds this agent's shared-memory receive queue stuck
    /// ([`Stats::receive_stuck`]): fail every peer at once and move to a new worker with a
    /// fresh queue (true, the default; connects are refused only if the move fails), or only
    /// report it (false: requests then end at their deadlines and the queue stays deaf).
    pub fail_peers_when_stuck: bool,
}

impl AgentOptions {
    pub fn new(name: impl Into<String>, transport: TransportKind) -> Self {
        AgentOptions {
            name: name.into(),
            transport,
            net_devices: None,
            listen: None,
            keepalive: Duration::from_secs(1),
            reap_grace: Duration::from_secs(2),
            discard_unexpected: false,
            fail_peers_when_stuck: true,
        }
    }
}

/// Local handle of a connected peer endpoint. Never reused within one agent.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PeerId(pub u64);

/// What the progress thread tells its owner. More kinds may come: match with a wildcard arm.
#[derive(Debug)]
#[non_exhaustive]
pub enum Event {
    /// A peer connected: to our listener (None), or by our worker address, sending its own,
    /// which we connected back to (Some: where it can be reached again, see
    /// [`Event::WorkerMoving`]).
    Accepted(PeerId, Option<Vec<u8>>),
    /// This agent's shared-memory receive queue is stuck (docs/RELIABILITY.md) and it moves to
    /// a new worker: every peer fails next (their `PeerFailed` follow this event), then the
    /// worker address changes ([`Agent::worker_address`]; if the move fails, the agent keeps
    /// reporting the queue stuck instead). Peers that connected by the old worker address
    /// know nothing of it: their owner can dial them back at the worker address their
    /// `Accepted` gave.
    WorkerMoving,
    /// A control message arrived from a peer.
    Control(PeerId, Vec<u8>),
    /// A peer's endpoint failed; every later operation on it fails with `PeerLost`.
    PeerFailed(PeerId),
    /// An op posted with `notify` has ended; [`Op::poll`] has its result.
    OpDone(u64),
    /// Tagged data matched no posted receive and was discarded (with
    /// [`AgentOptions::discard_unexpected`]): its tag and length.
    StrayData { tag: u64, len: usize },
}

/// Progress counters: these tell "alive" from "working".
#[derive(Clone, Debug, Default)]
pub struct Stats {
    pub ops_started: u64,
    pub ops_completed: u64,
    pub ops_failed: u64,
    pub in_flight: u64,
    /// The bytes of the transfers in flight (posted receives included, whether or not their
    /// data is moving yet). From 4 MiB up, on an agent whose transport is
    /// [`TransportKind::Tcp`], a caller that waits leaves progress to the progress thread
    /// instead of polling beside it.
    pub bytes_in_flight: u64,
    pub bytes_completed: u64,
    /// Time since the last completed op, if any op has completed.
    pub since_last_completion: Option<Duration>,
    /// Age of the oldest op still in flight.
    pub oldest_in_flight: Option<Duration>,
    /// Ops whose UCX request could not be reaped: their buffers must be fenced, not reused.
    pub unreaped: u64,
    pub wakeups: u64,
    pub empty_wakeups: u64,
    /// Progress passes run by waiting callers rather than the progress thread (see
    /// "Threading" above).
    pub caller_passes: u64,
    pub backoffs: u64,
    pub stale_control_dropped: u64,
    /// Active messages that carried several control messages to one peer: sent while UCX held
    /// an earlier one queued (the peer's receive queue was full), instead of one each.
    pub control_batches: u64,
    /// Control messages that went in those batches.
    pub control_batched: u64,
    /// Batches received that did not split into whole control messages: dropped whole.
    pub control_malformed: u64,
    /// Control messages and drains dropped because their header was not the one the peer's
    /// first message on that endpoint carried: a process that made UCX name another peer's
    /// endpoint as its own (see `peers.rs`).
    pub control_spoofed: u64,
    /// Tagged messages discarded because no receive was posted for them: each progress pass
    /// with [`AgentOptions::discard_unexpected`]; otherwise those left unreceived when the agent
    /// leaves a worker (a move or the drop), logged once with their count.
    pub stray_discarded: u64,
    /// This agent's shared-memory receive queue is stuck: nothing sent to it over shared
    /// memory is read (a peer process died, or was stopped, while writing into it; see
    /// `docs/RELIABILITY.md`). With [`AgentOptions::fail_peers_when_stuck`] (the default) it
    /// lasts only while the agent moves to a new worker ([`Stats::worker_renewals`]), or, if
    /// that failed, until a stopped writer resumes (connects are refused meanwhile). In
    /// report-only mode it lasts until the writer resumes: after a death, for good.
    pub receive_stuck: bool,
    /// How many times the agent moved to a new UCX worker (a fresh receive queue) because the
    /// old one's queue was stuck. Each move fails every peer and changes
    /// [`Agent::worker_address`].
    pub worker_renewals: u64,
    /// Peers the agent keeps an entry for: the live ones. A failed peer's entry goes with its
    /// endpoint (later calls naming it get `PeerLost`), so this does not grow with the
    /// endpoints made over the agent's life.
    pub peer_entries: u64,
    /// Calls of the cancel checks that waiters of transfers were given ([`Op::wait`]): the
    /// first at once, then one every 5 ms while the transfer runs (a caller's
    /// cancel flag cannot wake anybody, so it is looked at). A waiter with no cancel check
    /// calls none: whatever else ends its wait ([`OpAbort`], the op's end) wakes it.
    pub cancel_checks: u64,
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

fn ucx_err(status: sys::ucs_status_t, what: &str) -> Error {
    map_status(status, what)
}

/// The largest control message: control messages are small and always sent eagerly. Every frame
/// the codec emits must fit (an `Advertise` with `MAX_INFO` bytes of request info and
/// `MAX_BUFFERS` buffers is over 1 MiB): one that does not is refused here and dropped by the
/// receiver, and the core would resend it until its request timed out.
pub const MAX_CONTROL: usize = crate::proto::wire::HEADER_LEN + crate::proto::wire::MAX_BODY;
const AM_CONTROL_ID: u32 = 7;
/// Internal: "I gave up on my send with this tag; drain it" (8-byte tag).
const AM_DRAIN_ID: u32 = 8;
/// Internal: "this is my worker address; connect back" (sent after connecting by address).
const AM_BIND_ID: u32 = 9;
/// Internal: the receive-queue probe's ping (8-byte sequence number in the header).
const AM_PROBE_ID: u32 = 10;
/// Internal: several control messages to one peer in one (see `batch`).
const AM_BATCH_ID: u32 = 11;

#[cfg(test)]
mod tests {
    use super::*;

    /// Every frame the codec encodes (and so every frame an endpoint may emit) must fit one
    /// control message, or the transport refuses to send it and the receiver drops it: the
    /// request would be resent until it times out instead of failing or going through.
    #[test]
    fn the_largest_frame_the_codec_emits_fits_a_control_message() {
        use crate::proto::wire::{BufferDesc, BufferKind, Message, MAX_BUFFERS, MAX_INFO};
        use crate::proto::{RequestKey, Token};
        let buffers = (0..MAX_BUFFERS as u32)
            .map(|i| BufferDesc {
                kind: BufferKind::Kv,
                segment: i,
                addr: 4096,
                len: 4096,
                device_id: -1,
                token: Token(i as u64),
            })
            .collect();
        let largest = Message::Advertise {
            key: RequestKey::new(1, 1),
            src_rank: crate::proto::RankId(0),
            timeout_ms: 1,
            request_info: vec![0; MAX_INFO],
            buffers,
        };
        let bytes = largest.to_bytes().unwrap();
        assert!(
            bytes.len() <= MAX_CONTROL,
            "{} > {MAX_CONTROL}",
            bytes.len()
        );
    }

    #[test]
    fn transport_settings_parse_and_say_how_peers_connect() {
        assert_eq!(TransportKind::parse(" TCP ").unwrap(), TransportKind::Tcp);
        assert_eq!(
            TransportKind::parse("shm").unwrap(),
            TransportKind::SharedMemory
        );
        assert_eq!(TransportKind::parse("auto").unwrap(), TransportKind::Auto);
        let l = TransportKind::parse("RC,cuda_copy,cuda_ipc").unwrap();
        assert_eq!(l, TransportKind::List("rc,cuda_copy,cuda_ipc".into()));
        assert_eq!(l.to_string(), "rc,cuda_copy,cuda_ipc");
        assert!(TransportKind::parse("^cma").is_ok());
        assert!(TransportKind::parse("ud:aux,rc").is_ok());
        for bad in ["", "^", "tcp,", "tcp self", "tcp;x", "tcp@lo", "t=1"] {
            let e = TransportKind::parse(bad).unwrap_err();
            assert_eq!(e.kind, ErrorKind::InvalidArgument, "{bad:?}");
        }
        assert_eq!(
            TransportKind::parse_setting("rc,cuda_copy@mlx5_0:1").unwrap(),
            (
                TransportKind::List("rc,cuda_copy".into()),
                Some("mlx5_0:1".into())
            )
        );
        assert_eq!(
            TransportKind::parse_setting("tcp").unwrap(),
            (TransportKind::Tcp, None)
        );
        for bad in ["tcp@", "tcp@eth0,", "tcp@eth 0", "@lo"] {
            assert!(TransportKind::parse_setting(bad).is_err(), "{bad:?}");
        }
        let worker = |s: &str| TransportKind::parse(s).unwrap().by_worker_address();
        assert!(worker("sm") && worker("posix,sysv,self") && worker("cuda_copy,cuda_ipc"));
        assert!(!worker("tcp") && !worker("auto") && !worker("tcp,self") && !worker("rc_x"));
        assert!(!worker("^tcp"), "a negated list may still use the network");
        let mm = |s: &str| TransportKind::parse(s).unwrap().may_use_mm();
        let net = |s: &str| TransportKind::parse(s).unwrap().may_use_network();
        assert!(mm("auto") && mm("sm") && mm("tcp,sysv") && mm("^cma") && !mm("tcp,self"));
        assert!(net("auto") && net("tcp,sysv") && !net("sm") && !net("posix,sysv,self"));
    }
}
