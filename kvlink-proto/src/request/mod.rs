//! The state machines of one request: `RecvRequest` on a generation (receiving) rank and
//! `SendFlow` on a context (sending) rank, one per (request, receiver) pair.
//!
//! Receiver: `Active` (advertised; segments landing) -> local vote -> verdict -> `Settling`
//! (unlanded receives cancelled, waiting for each to be reaped) -> terminal, buffers released ->
//! lingering (answers late votes, retransmits a failure verdict, backed off, to senders that
//! have not confirmed) -> forgotten at terminal + linger, leaving a tombstone. A `Completed`
//! request skips lingering: it is forgotten at its end (`linger_after`). Deadlines: the
//! request deadline (vote `TimedOut`, the coordinator decides), the agreement bound
//! (`deadline + agreement_bound`, pulled in when a caller gives up: terminal no matter what,
//! unsafe buffers fenced), the retransmit timer, and the forget time.
//!
//! Sender: `Offered` (Advertised event out, waiting for `accept`) -> `Sending` (a refusal is
//! `Ready(false)`; acceptance needs no message) -> verdict (pulled with a `Vote` once every send
//! is done) -> aborting whatever is still in flight -> `Quiesced` sent for a failure verdict,
//! terminal -> lingering -> forgotten (a `Completed` flow at once).
//!
//! `recv.rs` holds the receiver's machine, `send.rs` the sender's; this file the types both
//! share and the endpoint hands out.
use std::collections::VecDeque;
use std::time::{Duration, Instant};

use super::id::{RankId, RequestKey, Token};
use super::pool::Lease;
use super::wire::{BufferDesc, Message};
use crate::error::Outcome;

mod recv;
mod send;

pub(crate) use recv::RecvRequest;
pub(crate) use send::SendFlow;
pub use send::SendRefusal;

/// Timing of the core. All values come from configuration; none is read from a clock.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Config {
    /// The default per-request deadline, counted from `start_receive` (receiver); TensorRT-LLM's
    /// `kv_transfer_timeout_ms`. A request may carry its own ([`ReceiveSpec::timeout`]); the
    /// sender learns what is left of it from the `Advertise`.
    ///
    /// [`ReceiveSpec::timeout`]: super::endpoint::ReceiveSpec::timeout
    pub timeout: Duration,
    /// How long past its deadline (or past a caller giving up) a request may spend agreeing and
    /// quiescing before it ends anyway and fences what is still unsafe. With no verdict by then
    /// a rank ends with its own failure, or `TimedOut` (`PeerLost` when the transport reported
    /// the peer lost). Keep it well under the 100 ms a caller may wait past its deadline.
    pub agreement_bound: Duration,
    /// Interval between retransmissions of an unanswered control message (at least
    /// [`SHORTEST_RETRANSMIT`]: zero is taken as that). An advertisement,
    /// which a busy sender may leave unanswered for long, and a failure verdict pushed to a
    /// sender that has not confirmed it, back off: 1, 2, 4 ... up to 32 intervals apart
    /// (`backed_off`); a sender does not depend on that push alone (it pulls the verdict when
    /// its sends are done, and its vote is answered with it). Votes and a sender's pull of the
    /// verdict do not back off: they must get through within the agreement bound (with
    /// back-off, the fault proptest finds a sender that misses a lost verdict until its bound).
    pub retransmit: Duration,
    /// How long a request that ended without completing is remembered in full past its end
    /// (at most past its agreement bound), to retransmit its failure verdict, answer late
    /// duplicates and recognise stale messages. A `Completed` one is forgotten at its end:
    /// nothing confirms a `Completed` verdict, and its tombstone answers what may still come.
    /// A send flow with a send not reported done is kept until it is, linger or not (a minute
    /// past the linger at most).
    pub linger: Duration,
    /// The most tombstones kept (see `Endpoint::tombstones`). Each lives for its request's
    /// deadline plus the agreement bound, so with long deadlines their number grows with the
    /// request rate times the deadline; past this the one buried first goes early, counted in
    /// [`Stats::tombs_evicted`]. Its request is then unknown here: a late vote or verdict is
    /// dropped as unknown (not answered with the verdict), and a late duplicate `Advertise`
    /// would start a send flow again, so an owner that takes replays from the network keeps
    /// its own bounded record of ended keys (the engine's refuses them for 10 minutes or the
    /// last 2^20 keys).
    pub tomb_cap: usize,
}

/// [`Config::tomb_cap`] by default: about 180 heap bytes each with the maps' entries (`kvlink-bench
/// core`), some 180 MiB at most.
pub const TOMB_CAP: usize = 1 << 20;

/// The longest duration the core computes a deadline from (a year): a timeout or a bound
/// longer than this, `Duration::MAX` included, is taken as this, so that no `Instant`
/// overflows.
pub const LONGEST: Duration = Duration::from_secs(365 * 24 * 3600);

/// The shortest retransmit interval the core uses: a shorter one (zero) is taken as this. A
/// machine that retransmits is due again `retransmit` after it fired; at zero that is the very
/// instant it fired, and `handle_timeout` would pop it again for ever.
pub const SHORTEST_RETRANSMIT: Duration = Duration::from_millis(1);

impl Config {
    /// This configuration with every duration at most [`LONGEST`], and the retransmit interval
    /// at least [`SHORTEST_RETRANSMIT`].
    pub(crate) fn bounded(mut self) -> Self {
        for d in [
            &mut self.timeout,
            &mut self.agreement_bound,
            &mut self.retransmit,
            &mut self.linger,
        ] {
            *d = (*d).min(LONGEST);
        }
        self.retransmit = self.retransmit.max(SHORTEST_RETRANSMIT);
        self
    }
}

impl Default for Config {
    fn default() -> Self {
        Config {
            timeout: Duration::from_secs(60),
            agreement_bound: Duration::from_millis(50),
            retransmit: Duration::from_millis(200),
            linger: Duration::from_secs(5),
            tomb_cap: TOMB_CAP,
        }
    }
}

/// How long a request that ended with `outcome` stays in full past its end: `linger`, or
/// nothing for `Completed`. A completed request has nothing left to send or to wait for (every
/// byte landed; a `Completed` verdict is not confirmed), and what a peer may still send about it
/// (a vote pulling the verdict, the verdict again, the advertisement again) is answered by its
/// tombstone, which lasts as long as before. At high request rates a whole machine per request
/// for `linger` was most of the core's memory, and forgetting it later touched it cold.
pub(super) fn linger_after(outcome: Outcome, linger: Duration) -> Duration {
    if outcome.is_completed() {
        Duration::ZERO
    } else {
        linger
    }
}

/// The wait before the next resend of a message already sent `resends` times again: `every`
/// doubled per resend, at most 32 times `every`. Control messages are reliable on a live
/// endpoint, so a resend only covers one lost with its endpoint; a peer with thousands of
/// requests queued (a busy prefill) must not be sent each of them again every interval.
pub(crate) fn backed_off(every: Duration, resends: u32) -> Duration {
    every.saturating_mul(1 << resends.min(5))
}

/// A control message for the driver to send.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Transmit {
    pub to: RankId,
    pub message: Message,
}

/// Something the driver must do to the transport or the buffer pool.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Post a tag-matched send of this rank's data for `desc` to `to`, tag `desc.token`; report
    /// its completion with `handle_send_done`.
    Send {
        key: RequestKey,
        to: RankId,
        desc: BufferDesc,
    },
    /// Abort that send if it is still in flight; report the result with `handle_send_done`.
    AbortSend {
        key: RequestKey,
        to: RankId,
        segment: u32,
    },
    /// Cancel the posted receive with tag `token`; report its reaping with
    /// `handle_receive_reaped` (or its landing, if the data won the race).
    CancelReceive {
        key: RequestKey,
        segment: u32,
        token: Token,
    },
    /// No peer can write this buffer any more: return the lease to the pool.
    Release { key: RequestKey, lease: Lease },
    /// A peer might still write this buffer: invalidate its registration (the posted receive
    /// with `token` dies with it), then `BufferPool::fence` the lease and restore the slot with a
    /// fresh registration.
    Fence {
        key: RequestKey,
        lease: Lease,
        token: Token,
    },
}

/// Which side of a request a terminal event belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Role {
    Receiver,
    Sender { receiver: RankId },
}

/// Things the application must learn.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// A receiver advertised a request to this (sending) rank; answer with `accept`.
    Advertised {
        key: RequestKey,
        from: RankId,
        /// The request's deadline on this rank, learned from the advertisement.
        deadline: Instant,
        request_info: Vec<u8>,
        buffers: Vec<BufferDesc>,
    },
    /// A `Notify` arrived.
    Notified {
        key: RequestKey,
        from: RankId,
        payload: Vec<u8>,
    },
    /// The request ended, exactly once per (key, role). For a receiver every buffer has been
    /// released or fenced by the time this event is queued.
    Terminal {
        key: RequestKey,
        role: Role,
        outcome: Outcome,
        /// When the request started on this rank: `start_receive`, or the advertisement's
        /// arrival (the request's duration, for metrics).
        started: Instant,
    },
}

/// Counters a health check or a test can read.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Messages or landings of an older generation than one still known: counted and dropped.
    pub stale_dropped: u64,
    /// Messages or landings for requests not known here (finished and forgotten, or never seen).
    pub unknown_dropped: u64,
    /// Duplicated messages or landings that changed nothing.
    pub duplicates: u64,
    /// Frames that failed to decode.
    pub bad_frames: u64,
    pub retransmits: u64,
    pub completed: u64,
    pub failed: u64,
    pub fenced_buffers: u64,
    /// Tombstones dropped before their expiry to keep their number at [`Config::tomb_cap`].
    pub tombs_evicted: u64,
    /// Votes and failure verdicts that came for a request before it started here, kept for its
    /// start (see `early`); those that went unused (past their keep, or over its caps) count
    /// in `unknown_dropped` instead.
    pub early_kept: u64,
}

/// Output queues shared by all state machines of one endpoint.
#[derive(Debug, Default)]
pub(crate) struct Out {
    pub transmits: VecDeque<Transmit>,
    pub actions: VecDeque<Action>,
    pub events: VecDeque<Event>,
    pub stats: Stats,
}

impl Out {
    fn send(&mut self, to: RankId, message: Message) {
        self.transmits.push_back(Transmit { to, message });
    }
    fn terminal(&mut self, key: RequestKey, role: Role, outcome: Outcome, started: Instant) {
        if outcome.is_completed() {
            self.stats.completed += 1;
        } else {
            self.stats.failed += 1;
        }
        self.events.push_back(Event::Terminal {
            key,
            role,
            outcome,
            started,
        });
    }
}

/// The no-verdict outcome at the agreement bound: this rank's own failure if it had one, else
/// `TimedOut`. Never `Completed`: without the verdict a rank cannot know that every other rank
/// completed.
pub(crate) fn unagreed(local_vote: Option<Outcome>) -> Outcome {
    match local_vote {
        Some(v) if !v.is_completed() => v,
        _ => Outcome::TimedOut,
    }
}
