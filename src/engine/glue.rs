//! The glue between the protocol core and the UCX agent: what the engine's driver thread does.
//!
//! It feeds the core ([`Endpoint`]) every event the agent reports (control frames, receive
//! completions, peer failures) and fires the core's timers; it carries out the core's outputs
//! (control frames out, receive cancels, send aborts, buffer releases and fences) and wakes the
//! one caller each fact concerns. The only state kept here is what the transport needs next to
//! the core: the posted receive ops and their buffers, outcomes waiting for their caller, and the
//! bounded queues of advertisements and notifications.
use foldhash::{HashMap, HashMapExt, HashSet};
use smallvec::SmallVec;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::aged::Aged;
use super::waiters::{HasWaiters, WaitKey, Waiters};
use super::{Advertisement, Faults};
use crate::error::{Error, ErrorKind, Outcome, Result};
use crate::proto::peers::Peers;
use crate::proto::pool::{BufferId, BufferPool, Lease};
use crate::proto::regions::Regions;
use crate::proto::wire::{self, WireReason, VERSION};
use crate::proto::{
    Action, BufferDesc, Endpoint, Event as ProtoEvent, Handshake, Identity, Message, RankId,
    Refusal, RequestKey, Role, Token, TokenAllocator,
};
use crate::timeline::{self, Stage};
use crate::transport::cuda::Staging;
use crate::transport::ucx::{Held, OpAbort};
use crate::transport::{Agent, Event, EventSink, Op, PeerId};

/// How long a fenced plain-memory receive's cancel may take before its endpoint is
/// force-closed. An unmatched receive is released by the cancel's next progress pass (well
/// under a millisecond, a woken progress thread included); this is short enough that the wait
/// it holds still returns within its slack past the agreement bound (`SETTLE_SLACK`, 30 ms)
/// when the endpoint must be closed after all.
pub(crate) const FENCE_CANCEL_GRACE: Duration = Duration::from_millis(5);

/// How long an outcome nobody came for is kept, and a finished key is refused as a replay.
pub(crate) const RETENTION: Duration = Duration::from_secs(600);
/// The most entries each of the engine's memories of ended requests (`terminals`, `finished`,
/// `retired`) holds: past it the oldest goes before its time. Their times alone let them grow
/// with the request rate, about 130 bytes an entry; at this cap each stays under about 150 MB,
/// and the times still hold up to about 1700 requests a second (8700 for `retired`).
pub(crate) const AGED_CAP: usize = 1 << 20;
/// Advertisements waiting for `next_advertisement`. Past this a new one is refused (the
/// receiver sees `Rejected`) rather than queued without bound.
pub(crate) const MAX_ADVERTS: usize = 16384;
/// Notifications waiting per sending rank; past this they are dropped and counted.
pub(crate) const MAX_NOTES: usize = 4096;
/// The bytes that waiting advertisements may hold in all (their request info and buffer
/// lists), and waiting notifications over every rank. Counts alone let peers fill them with
/// 16384 advertisements of a 1 MiB request info each (16 GiB), or 4096 notifications of 64 KiB
/// per rank (256 MiB a rank, and ranks without end); past this a new one is refused (an
/// advertisement: the receiver sees `Rejected`) or dropped (a notification), and counted.
pub(crate) const MAX_QUEUED_BYTES: usize = 256 << 20;

/// What a waiting advertisement holds, in bytes (for [`MAX_QUEUED_BYTES`]).
pub(crate) fn advert_bytes(a: &Advertisement) -> usize {
    std::mem::size_of::<Advertisement>()
        + a.request_info.len()
        + std::mem::size_of_val(a.buffers.as_slice())
}

/// What a waiting notification holds, in bytes (for [`MAX_QUEUED_BYTES`]).
pub(crate) fn note_bytes(payload: &[u8]) -> usize {
    std::mem::size_of::<(RequestKey, Vec<u8>)>() + payload.len()
}

/// A posted receive: one segment of one request, into the caller's buffer (or a staging buffer).
pub(crate) struct RecvOp {
    pub key: RequestKey,
    pub segment: u32,
    pub peer: PeerId,
    pub op: Op,
    /// For a CUDA buffer: the pinned host buffer the receive lands in, and the device address
    /// it is copied to before the segment counts as landed.
    pub staged: Option<(Staging, u64)>,
    pub len: usize,
    pub token: Token,
    /// The UCX tag the receive is posted under (the token keyed for its sender).
    pub tag: u64,
    /// Set while the core does not track this receive (posted for a request that has not
    /// started, or fenced): what to do with its buffer once UCX has released it.
    pub on_reap: Option<OnReap>,
    /// The core asked for its cancel (any other cancelled receive was drained by its sender).
    pub core_cancelled: bool,
}

/// What to do with a receive's buffer once UCX has released the receive, for receives the
/// protocol core no longer tracks (fenced, or posted for a request that never started).
pub(crate) enum OnReap {
    Restore(BufferId),
    Release(Lease),
}

/// Everything behind the engine's one lock.
pub(crate) struct Core {
    pub ep: Endpoint,
    pub pool: BufferPool,
    /// Regions lent to kvlink, and which transfers UCX holds in them.
    pub regions: Regions,
    pub tokens: TokenAllocator,
    pub peers: Peers<PeerId>,
    /// The `Refuse` this side sent on an endpoint, so that `connect` can let it go out before it
    /// returns (a dialler that exits right after must still tell the peer why).
    pub refusal_ops: HashMap<PeerId, Op>,
    pub recv_ops: HashMap<u64, RecvOp>,
    pub by_token: HashMap<Token, u64>,
    /// The sends in flight (each one's abort), by (request, receiver, segment).
    pub sends: HashMap<(RequestKey, RankId, u32), OpAbort>,
    pub adverts: VecDeque<Advertisement>,
    /// What `adverts` holds, in bytes ([`advert_bytes`]; at most [`MAX_QUEUED_BYTES`]).
    pub advert_bytes: usize,
    /// Ends waiting for their caller (for RETENTION).
    pub terminals: Aged<(RequestKey, Role), Outcome>,
    /// Requests whose `wait` returned before their end came (no verdict by the bound: a peer
    /// stuck, or this rank's progress thread): that return was the caller's end, so the end
    /// that comes later is not kept for another `wait` (for RETENTION, or until it comes).
    pub answered_early: Aged<(RequestKey, Role), ()>,
    /// The (request, role) pairs a `wait` call is blocked on: one caller each, so that the end
    /// goes to that caller and a second concurrent wait is refused at once.
    pub waited: HashSet<(RequestKey, Role)>,
    /// Receiver ends held back until their fenced receives are released by UCX.
    pub deferred: HashMap<RequestKey, Outcome>,
    pub fencing: HashMap<RequestKey, HashSet<u64>>,
    /// Fenced plain-memory receives whose endpoint is force-closed at the time given unless
    /// the cancel released them first ([`FENCE_CANCEL_GRACE`]), oldest first: (when, receive
    /// op, its endpoint).
    pub fence_closes: VecDeque<(Instant, u64, PeerId)>,
    /// Keys that ended here, with their end: a replay of one is refused, a late advertisement
    /// of one dropped, and `recv_ready` answers from a receive's end once the core has forgotten
    /// it (for RETENTION).
    pub finished: Aged<(RequestKey, Option<RankId>), Outcome>,
    /// Sends to a rank whose process was replaced since, with their end: the application may
    /// have taken their advertisements and still answer, send or wait for them by key and
    /// rank, and those calls are the old request's (not the new process's request of that
    /// key) until it takes the new process's advertisement of the key (for RETENTION).
    pub superseded: Aged<(RequestKey, RankId), Superseded>,
    /// The `superseded` sends that had not ended yet (`Endpoint::forget_sends_to`): the next
    /// end of a send of that key to that rank is theirs (the core starts no other until they
    /// are gone).
    pub retired_sends: HashSet<(RequestKey, RankId)>,
    /// The end of a replaced process's request for the `wait` blocked on it (one that came
    /// after the bind, of a `retired_sends` request, or before it, not yet taken): at most one
    /// per key and rank, taken by that call before it returns.
    pub retired_ends: HashMap<(RequestKey, RankId), Outcome>,
    /// Notifications waiting, by sending rank (a rank's queue goes when it empties).
    pub notes: HashMap<RankId, VecDeque<(RequestKey, Vec<u8>)>>,
    /// What `notes` holds, in bytes ([`note_bytes`]; at most [`MAX_QUEUED_BYTES`]).
    pub note_bytes: usize,
    pub control_ops: VecDeque<Op>,
    pub waiters: Waiters,
    pub counters: Counters,
    /// Tags of receives that ended without their data: data arriving later under one is
    /// `late`, not `foreign` (for RETIRED_FOR).
    pub retired: Aged<u64, ()>,
    /// Endpoints the `break_won_tie` fault cut: what arrives on them is dropped, as if the
    /// connection had broken at once, until their failure is reported.
    pub fault_cut: Vec<PeerId>,
    /// Endpoints closed because their peer said it was leaving, until their failure is
    /// reported: that failure is the leave, no fault.
    pub left: HashSet<PeerId>,
    /// Set when this engine is going away (its drop: `say_leaving`): the endpoints told
    /// `Leaving` that have not yet answered it (their own `Leaving`) nor failed. The drop
    /// waits, within its drain, until none is left, so that its closing cannot overtake the
    /// message; meanwhile no reconnect round dials.
    pub leaving: Option<HashSet<PeerId>>,
    last_prune: Instant,
}

/// How long a reconnect round's dial waits for the progress thread to make its endpoint (no
/// caller waits for it).
const DIAL_WAIT: Duration = Duration::from_secs(10);

/// How long an ended receive's tag is remembered as "late, not foreign".
const RETIRED_FOR: Duration = Duration::from_secs(120);

/// Counters of the glue (the core and the agent keep their own).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Counters {
    pub replays_dropped: u64,
    pub bad_frames: u64,
    pub adverts_refused: u64,
    pub notes_dropped: u64,
    /// Waits that returned at their deadline's slack before the request's end was certain
    /// (UCX did not release a fenced receive in time): should stay 0.
    pub unsettled_returns: u64,
    /// Tagged data that matched no posted receive and was discarded: `foreign` under a tag no
    /// receive of ours ever had (a process that is not the peer the buffer was offered to, or
    /// garbage); `late` for a receive that had already ended (its sender was too slow).
    pub foreign_data: u64,
    pub late_data: u64,
    /// When a foreign landing was last logged.
    pub foreign_logged: Option<Instant>,
    /// When a peer last failed or a request last ended TimedOut / PeerLost.
    pub last_fault: Option<Instant>,
    /// Entries of the memories of ended requests that went early (full), as last logged.
    pub aged_evicted_logged: u64,
    /// Handshakes this side began as the dialler: `connect`'s dials and reconnect rounds'.
    pub dials: u64,
    /// Peers that said they were leaving (`Message::Leaving`: their engine was dropped).
    pub peers_left: u64,
}

impl HasWaiters for Core {
    fn waiters(&mut self) -> &mut Waiters {
        &mut self.waiters
    }
}

impl Core {
    pub fn new(ep: Endpoint, pool_slots: u32) -> Core {
        Core {
            ep,
            pool: BufferPool::new(pool_slots),
            regions: Regions::new(),
            tokens: TokenAllocator::new(crate::random::key16()),
            peers: Peers::default(),
            refusal_ops: HashMap::new(),
            recv_ops: HashMap::new(),
            by_token: HashMap::new(),
            sends: HashMap::new(),
            adverts: VecDeque::new(),
            advert_bytes: 0,
            terminals: Aged::new(RETENTION, AGED_CAP),
            answered_early: Aged::new(RETENTION, AGED_CAP),
            deferred: HashMap::new(),
            fencing: HashMap::new(),
            fence_closes: VecDeque::new(),
            finished: Aged::new(RETENTION, AGED_CAP),
            superseded: Aged::new(RETENTION, AGED_CAP),
            retired_sends: HashSet::default(),
            retired_ends: HashMap::new(),
            notes: HashMap::new(),
            note_bytes: 0,
            control_ops: VecDeque::new(),
            waiters: Waiters::default(),
            counters: Counters::default(),
            retired: Aged::new(RETIRED_FOR, AGED_CAP),
            fault_cut: Vec::new(),
            left: HashSet::default(),
            leaving: None,
            waited: HashSet::default(),
            last_prune: Instant::now(),
        }
    }

    /// Another process holds `rank` now: the old one's requests must not make the new one's
    /// look like replays (its attempt numbers start again), and the old one's ends nobody
    /// waited for must not be taken by a `wait` for the new one's request of that key.
    /// Its advertisements and notifications not yet taken go too: taken later, the old one's
    /// advertisement of a key would be answered with the new one's request of that key.
    /// What the application took of the old one's requests stays theirs (`superseded`).
    fn forget_instance(&mut self, rank: RankId) {
        let now = Instant::now();
        let sent_to_it = Role::Sender { receiver: rank };
        // Whether a `wait` has the end of the old request of `key` already, or will take it
        // (blocked on it, its end kept in `terminals` below): a `wait` after is refused.
        let answered = |core: &Core, key: RequestKey, ended: bool| {
            let k = (key, sent_to_it);
            core.answered_early.contains_key(&k)
                || (ended && (core.waited.contains(&k) || !core.terminals.contains_key(&k)))
        };
        for (key, end) in self.ep.forget_sends_to(rank) {
            if end.is_none() {
                self.retired_sends.insert((key, rank));
            }
            let waited = answered(self, key, end.is_some());
            self.supersede(key, rank, end.unwrap_or(Outcome::PeerLost), waited, now);
        }
        for ((key, _), end) in self.finished.take_if(|(_, to)| *to == Some(rank)) {
            let waited = answered(self, key, true);
            self.supersede(key, rank, end, waited, now);
        }
        // An end a blocked `wait` was woken for and has not taken yet stays for it, in that
        // wait's own slot (`retired_ends`): that wait is the old process's request's, and would
        // otherwise sleep to its own deadline and return TimedOut for a request that ended
        // PeerLost; in `terminals` the new process's request of the key, ending before that
        // wait runs, would take its place.
        for ((key, _), end) in self.terminals.take_if(|k| k.1 == sent_to_it) {
            if self.waited.contains(&(key, sent_to_it)) {
                self.retired_ends.insert((key, rank), end);
            }
        }
        self.answered_early.retain(|(_, role)| *role != sent_to_it);
        self.drop_adverts(|a| a.from == rank);
        if let Some(q) = self.notes.remove(&rank) {
            self.note_bytes -= q.iter().map(|(_, p)| note_bytes(p)).sum::<usize>();
        }
    }

    /// Takes the advertisements `doomed` names out of the queue (a pass over it: called when a
    /// rank's process is replaced).
    fn drop_adverts(&mut self, doomed: impl Fn(&Advertisement) -> bool) {
        let (adverts, bytes) = (&mut self.adverts, &mut self.advert_bytes);
        adverts.retain(|a| {
            let drop = doomed(a);
            if drop {
                *bytes -= advert_bytes(a);
            }
            !drop
        });
    }

    /// `peer` answered this engine's `Leaving` (its own `Leaving`) or failed. False if this
    /// engine is not leaving.
    fn leave_answered(&mut self, peer: PeerId) -> bool {
        match self.leaving.as_mut() {
            Some(told) => {
                told.remove(&peer);
                true
            }
            None => false,
        }
    }

    /// Whether a peer told `Leaving` has neither answered nor failed yet.
    pub fn leave_unanswered(&self) -> bool {
        self.leaving.as_ref().is_some_and(|told| !told.is_empty())
    }

    /// Has `key` ended here, as a receive or as a send to any rank, recently enough that its
    /// replay would be refused? (One look-up per rank ever known: a handful.)
    pub fn ended_here(&self, key: RequestKey) -> bool {
        self.finished.contains_key(&(key, None))
            || self
                .peers
                .ranks()
                .any(|r| self.finished.contains_key(&(key, Some(r))))
    }

    /// The end of the send of `key` to `to`, once the protocol core has forgotten it (its
    /// tombstone too): remembered here for RETENTION. The core's answers for a forgotten send
    /// (`accept`, `check_send`: `UnknownRequest`) are then taken as its tombstone gave them.
    /// So is a send to a replaced process of the rank (`superseded`), even where the core now
    /// holds the new process's request of that key.
    pub fn forgotten_send(&self, key: RequestKey, to: RankId) -> Option<Outcome> {
        if let Some(s) = self.superseded.get(&(key, to)) {
            return Some(s.end);
        }
        if self.ep.knows_send(key, to) {
            return None;
        }
        self.finished.get(&(key, Some(to))).copied()
    }

    /// Keeps the send of `key` to `rank`, whose process was replaced, as `superseded` with
    /// `end`, unless one is kept already: then the application has not taken a newer
    /// advertisement of that key since, the request of the process between (if any) was never
    /// its own, and the kept one is the request it may still name. Either way a `wait` that
    /// answered it (`waited`: the early answers go at this bind) is remembered.
    fn supersede(
        &mut self,
        key: RequestKey,
        rank: RankId,
        end: Outcome,
        waited: bool,
        now: Instant,
    ) {
        match self.superseded.get_mut(&(key, rank)) {
            Some(kept) => kept.waited |= waited,
            None => {
                let s = Superseded { end, waited };
                self.superseded.insert((key, rank), s, now);
            }
        }
    }

    /// The ranks whose sends of `key` known to the core are another process's request than
    /// the application's (`superseded`, and not the replaced process's own, retired): a
    /// give-up of `key` spares them. Empty at once when nothing is superseded.
    pub fn spared(&self, key: RequestKey) -> SmallVec<[RankId; 2]> {
        if self.superseded.len() == 0 {
            return SmallVec::new();
        }
        self.ep
            .unretired_send_ranks(key)
            .filter(|&r| self.superseded.contains_key(&(key, r)))
            .collect()
    }

    /// Whether a send of `key` to some rank is `superseded` (the old request ended). One
    /// look-up per rank ever known, as [`Core::ended_here`].
    pub fn superseded_here(&self, key: RequestKey) -> bool {
        self.superseded.len() > 0
            && self
                .peers
                .ranks()
                .any(|r| self.superseded.contains_key(&(key, r)))
    }

    /// [`Endpoint::give_up`] of `key` on this rank, sparing the sends [`Core::spared`] names.
    pub fn give_up(&mut self, now: Instant, key: RequestKey, why: Outcome) -> Result<()> {
        let spare = self.spared(key);
        self.ep.give_up_sparing(now, key, why, &spare)
    }

    /// `UnknownRequest` for a `superseded` send of `key` to `to`: the core's send of that key,
    /// if any, is another process's.
    fn not_superseded(&self, key: RequestKey, to: RankId) -> Result<()> {
        match self.superseded.contains_key(&(key, to)) {
            true => Err(Error::new(
                ErrorKind::UnknownRequest,
                format!("{key} to {to}: its process was replaced"),
            )),
            false => Ok(()),
        }
    }

    /// [`Endpoint::accept`], answered for a send the core has forgotten as its tombstone
    /// answered: no error after any end but `Completed` (the answer lost a race with the end),
    /// `InvalidArgument` after `Completed` (it was answered long ago).
    pub fn accept(
        &mut self,
        now: Instant,
        key: RequestKey,
        from: RankId,
        ready: bool,
    ) -> Result<()> {
        match self
            .not_superseded(key, from)
            .and_then(|()| self.ep.accept(now, key, from, ready))
        {
            Err(e) if e.kind == ErrorKind::UnknownRequest => match self.forgotten_send(key, from) {
                Some(Outcome::Completed) => Err(Error::invalid(format!(
                    "{key} from {from}: already decided"
                ))),
                Some(_) => Ok(()),
                None => Err(e),
            },
            r => r,
        }
    }

    /// [`Endpoint::check_send`], answered for a send the core has forgotten as its tombstone
    /// answered: its end, or `InvalidArgument` after `Completed` (every segment was sent).
    pub fn check_send(
        &self,
        key: RequestKey,
        to: RankId,
        segment: u32,
        len: u64,
    ) -> Result<std::result::Result<BufferDesc, Outcome>> {
        match self
            .not_superseded(key, to)
            .and_then(|()| self.ep.check_send(key, to, segment, len))
        {
            Err(e) if e.kind == ErrorKind::UnknownRequest => match self.forgotten_send(key, to) {
                Some(Outcome::Completed) => Err(Error::invalid(format!(
                    "{key} to {to}: segment {segment} was already sent or never advertised"
                ))),
                Some(o) => Ok(Err(o)),
                None => Err(e),
            },
            r => r,
        }
    }

    /// Drops the early answers given RETENTION ago, except those whose request the core still
    /// knows: a request can outlive RETENTION (its deadline may be a year off), and its early
    /// answer stays the caller's end until that end comes. Dropped at RETENTION, the end that
    /// came later was kept for a second `wait` to take, and a claimed answer was not final.
    pub fn expire_answered_early(&mut self, now: Instant) {
        let ep = &self.ep;
        self.answered_early
            .expire_unless(now, |&(key, role)| match role {
                Role::Receiver => ep.knows_receive(key),
                Role::Sender { receiver } => ep.knows_send(key, receiver),
            });
    }

    fn end(&mut self, key: RequestKey, role: Role, outcome: Outcome, now: Instant) {
        // A `wait` answered the caller already: its answer stays the end for that caller.
        if self.answered_early.remove(&(key, role)).is_none() {
            self.terminals.insert((key, role), outcome, now);
        }
        self.waiters.wake(WaitKey::Terminal(key, role));
        if role == Role::Receiver {
            // From here `recv_ready` answers from the end itself.
            self.waiters.wake(WaitKey::Ready(key));
        }
    }
}

/// A send to a replaced process ([`Core::superseded`]): its end, and whether a `wait` returned
/// it already (a second one is `UnknownRequest`, as for any request).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Superseded {
    pub end: Outcome,
    pub waited: bool,
}

/// What the engine's threads share: the agent, the core under its lock, and the stop flag.
pub(crate) struct Inner {
    pub agent: Agent,
    pub me: RankId,
    pub name: String,
    /// How this rank introduces itself in the handshake (rank, name, instance, secret).
    pub identity: Identity,
    pub faults: Faults,
    pub agreement_bound: Duration,
    /// The wedge and degraded windows of `health().state`.
    pub windows: (Duration, Duration),
    pub core: Mutex<Core>,
    pub stopping: AtomicBool,
    pub metrics: crate::metrics::Metrics,
    /// UCX may use shared memory (posix, sysv) here: see `Engine::connect`'s hint.
    pub shared_memory: bool,
    /// The callers the sink's last run woke, notified once the control messages it queued have
    /// been started (`Sink::delivered`).
    pub held_wakes: Mutex<Vec<Arc<parking_lot::Condvar>>>,
}

impl Inner {
    /// Starts the handshake on an endpoint this side dialled (once per endpoint).
    pub fn say_hello(&self, core: &mut Core, peer: PeerId) -> Result<()> {
        if core.peers.handshakes.contains_key(&peer) {
            return Ok(());
        }
        // A dial refused at once can fail before this (the caller takes the lock after the
        // progress thread made the endpoint): its failure, if already handled, found no
        // handshake to end, so none is begun now (it would be kept for good), and the caller
        // reads the loss, not `UnknownPeer`. Asked under the lock, before the sink can run.
        if let Err(e) = self.agent.peer_state(peer) {
            return Err(Error::new(
                ErrorKind::PeerLost,
                format!("the connection failed before its handshake began ({e})"),
            ));
        }
        let (hs, hello) = Handshake::dial(&self.identity, crate::random::u64());
        core.counters.dials += 1;
        core.peers.handshakes.insert(peer, hs);
        core.peers.handshake_started(peer, Instant::now());
        // Failed since the look above: its failure, reported once this lock is let go, ends
        // the handshake.
        self.send_msg(core, peer, &hello).map_err(|e| match e.kind {
            ErrorKind::UnknownPeer => Error::new(ErrorKind::PeerLost, e.message),
            _ => e,
        })
    }

    fn send_msg(&self, core: &mut Core, peer: PeerId, msg: &Message) -> Result<()> {
        let op = self.agent.send_control(peer, msg.to_bytes()?)?;
        if matches!(msg, Message::Refuse { .. }) {
            // A replaced one goes to the polled list: dropping an unfinished op waits for UCX,
            // which cannot progress while this pass runs.
            if let Some(old) = core.refusal_ops.insert(peer, op) {
                core.control_ops.push_back(old);
            }
        } else {
            core.control_ops.push_back(op);
        }
        Ok(())
    }

    /// Tells every bound peer that this engine is going away (its drop), so that each ends the
    /// connection and the requests on it at once. Over shared memory nothing else would tell
    /// them while this process lives on: UCX's keepalive there checks the process. Each told
    /// endpoint is awaited until it answers or fails ([`Core::leaving`]).
    pub fn say_leaving(&self, core: &mut Core) {
        let bound: Vec<PeerId> = core
            .peers
            .ranks()
            .filter_map(|rank| core.peers.endpoint(rank))
            .collect();
        let mut told = HashSet::default();
        for peer in bound {
            if self.send_msg(core, peer, &Message::Leaving).is_ok() {
                told.insert(peer);
            }
        }
        core.leaving = Some(told);
        core.peers.stop_dialling();
    }

    /// A peer's `Leaving`: its engine is going away. Its endpoint is closed here as a failed one
    /// is (the transport reports the failure): the requests on it end `PeerLost`, and a rank
    /// this side dialled at a listener's address gets its reconnect round, which finds a
    /// process that builds a new engine there; one dialled by worker address reads `Failed`
    /// (`Peers::on_left`). Only the endpoint the message came on is closed, so a
    /// peer can end nothing but its own connection.
    ///
    /// It is answered with this side's own `Leaving` before the close, which tells the leaving
    /// side that its message arrived: the leaving side waits for that answer (or the
    /// connection's end) before it closes its endpoints, as a close can overtake a message
    /// still on its way (over tcp a reset discarded it, under load, with UCX 1.22). An
    /// engine leaving itself takes a `Leaving` as that answer, and sends none back.
    fn on_leaving(&self, core: &mut Core, peer: PeerId) {
        if core.leave_answered(peer) {
            core.left.insert(peer);
            return;
        }
        match core.peers.rank_of(peer) {
            Some(rank) => {
                tracing::info!(peer = rank.0, "{rank} is leaving: its engine ends");
                // Its failure, reported after this message whether this close makes it or the
                // transport saw the connection close first, is the leave.
                core.left.insert(peer);
                core.counters.peers_left += 1;
                let _ = self.send_msg(core, peer, &Message::Leaving);
            }
            // Not a rank's connection (a handshake, or one given way): only closed.
            None => tracing::info!("endpoint {}: the peer is leaving", peer.0),
        }
        let _ = self.agent.close_peer(peer);
    }

    /// A frame of another wire version from an endpoint with no rank bound (a rank of another
    /// kvlink release dialling, or answering our dial): refuse it in the one frame every version
    /// reads, so that it learns why at once, and close the endpoint after the refusal's linger.
    /// Returns false (the frame is counted as bad) for a bound peer, one refused already, or one
    /// being closed for a handshake past its limit.
    fn refuse_version(&self, core: &mut Core, now: Instant, peer: PeerId, version: u16) -> bool {
        // The handshake ends refused, as any other refusal: nothing more from this endpoint
        // starts one (a frame in this version's `Hello` included); it is closed after the
        // refusal's linger. The refusal goes as a waited control message, never in a batch
        // (which a release before batches could not read). None: bound, refused already, or
        // being closed for a handshake past its limit.
        let Some(refusal) = core.peers.refuse_version(peer, crate::random::u64(), now) else {
            return false;
        };
        let _ = self.send_msg(core, peer, &refusal);
        tracing::warn!(
            "refused endpoint {}: it speaks wire version {version}, this side {VERSION}",
            peer.0
        );
        core.waiters.wake(WaitKey::Dial(peer));
        true
    }

    /// The `break_won_tie` fault: once, force-closes the dials to `rank` that just won a tie.
    fn fault_break_won_tie(&self, core: &mut Core, rank: RankId) {
        let Some(count) = &self.faults.break_won_tie else {
            return;
        };
        let dials = core.peers.won_tie_dials(rank);
        if dials.is_empty() || count.load(Ordering::Acquire) > 0 {
            return;
        }
        tracing::warn!("fault: breaking the connection of a dial that won a crossing with {rank}");
        for p in dials {
            let _ = self.agent.close_peer(p);
            core.fault_cut.push(p);
        }
        count.fetch_add(1, Ordering::AcqRel);
    }

    /// One handshake message from `peer` (see [`crate::proto::handshake`]): the peer table
    /// decides (`Peers::on_handshake`: bind, refuse, or give way to a crossing dial), this
    /// carries it out.
    fn on_handshake(&self, core: &mut Core, now: Instant, peer: PeerId, msg: Message) {
        use crate::proto::peers::HandshakeAction as A;
        // The waiters it concerns are woken at the end of the pass (`Peers::take_wakes`).
        let actions = core
            .peers
            .on_handshake(&self.identity, peer, msg, now, crate::random::u64());
        for action in actions {
            match action {
                A::Send(m) => {
                    let _ = self.send_msg(core, peer, &m);
                }
                A::Close(p) => {
                    let _ = self.agent.close_peer(p);
                }
                A::Bound(rank, name) => {
                    tracing::info!(peer = rank.0, "{rank} ({name}) connected");
                    // A receive that ended for losing this rank as its coordinator tells it now.
                    core.ep.handle_peer_bound(now, rank);
                }
                A::Lost(rank) => {
                    // Refused on its bound endpoint, or rebound by its process on a new
                    // connection: a fault, as a failed connection is.
                    tracing::warn!(peer = rank.0, "{rank}: connection lost");
                    core.counters.last_fault = Some(now);
                    core.ep.handle_peer_lost(now, rank);
                }
                // Refused by the handshake itself, before any binding: the only such clash
                // is a peer that says it is this engine's rank.
                A::Refused(Refusal::RankInUse, None) => tracing::warn!(
                    "refused a peer that says it is {}, this engine's own rank: rank ids must be \
                     unique in a deployment",
                    self.me
                ),
                A::Refused(Refusal::RankInUse, Some(rank)) => tracing::warn!(
                    peer = rank.0,
                    "refused {rank}: it is bound to another live endpoint"
                ),
                A::Refused(reason, _) => tracing::warn!("refused a peer: {reason:?}"),
                A::RefusedByPeer(reason) => {
                    tracing::warn!("a peer refused this rank: {reason:?}");
                }
                A::Crossed(rank) => {
                    tracing::info!(
                        peer = rank.0,
                        "{rank} dialled this side while this side's dial to it ran: this side's \
                         dial is the pair's connection, its dial is refused"
                    );
                    self.fault_break_won_tie(core, rank);
                }
                A::NewInstance(rank) => self.new_instance(core, now, rank),
                A::Unbound(_) => {}
                A::GaveWay(rank) => {
                    tracing::info!(
                        peer = rank.0,
                        "{rank} is connected to this side already (it dialled too): the pair \
                         keeps that connection, this dial closes"
                    );
                }
                A::BadFrame => core.counters.bad_frames += 1,
            }
        }
        core.waiters.wake(WaitKey::Dial(peer));
    }

    /// Another process holds `rank` now ([`Core::forget_instance`]). What the core decided
    /// before is recorded first: an end of the old process's requests still queued there (one
    /// delivery may carry the old endpoint's failure and the new process's bind) would
    /// otherwise be recorded after the forgetting, and refuse the new process's request of that
    /// key as a replay for RETENTION, or be taken by a `wait` for it.
    fn new_instance(&self, core: &mut Core, now: Instant, rank: RankId) {
        self.flush_via(core, None, now);
        core.forget_instance(rank);
    }

    /// Redials `rank` at `address` on a short-lived thread of its own: a dial waits for the
    /// progress thread, where the sink runs, so it cannot run there. Reconnects are rare.
    /// False if no thread could be made.
    fn redial(self: &Arc<Self>, rank: RankId, address: String) -> bool {
        let weak = Arc::downgrade(self);
        let spawned = std::thread::Builder::new()
            .name(format!("kvlink-redial-{}", rank.0))
            .spawn(move || {
                let Some(inner) = weak.upgrade() else { return };
                if inner.stopping.load(Ordering::Acquire) {
                    return;
                }
                {
                    // The engine began its drop after this round was due: it dials no more.
                    let mut core = inner.core.lock();
                    if core.leaving.is_some() {
                        core.peers.round_dial_void(rank);
                        return;
                    }
                }
                let dialled = super::dial(&inner.agent, &address, Instant::now() + DIAL_WAIT);
                let mut core = inner.core.lock();
                match dialled {
                    // The drop began while it dialled: no hello goes out on it.
                    Ok(peer) if core.leaving.is_some() => {
                        let _ = inner.agent.close_peer(peer);
                        core.peers.round_dial_void(rank);
                        return;
                    }
                    // Failed before we got here: its failure, already handled, found no dial
                    // to end, and the round's next try is due anyway.
                    Ok(peer) if inner.agent.peer_state(peer).is_err() => {
                        core.peers.round_dial_void(rank);
                        tracing::debug!("reconnect to {rank} at {address}: failed at once");
                    }
                    Ok(peer) => {
                        core.peers.dialled(rank, peer);
                        if let Err(e) = inner.say_hello(&mut core, peer) {
                            tracing::debug!("reconnect to {rank} at {address}: {e}");
                        }
                        tracing::info!("reconnecting to {rank} at {address}");
                    }
                    Err(e) => {
                        core.peers.round_dial_void(rank);
                        tracing::debug!("reconnect to {rank} at {address}: {e}");
                    }
                }
                // `advertise` may wait for the round, a `connect` for this dial.
                for rank in core.peers.take_wakes() {
                    core.waiters.wake(WaitKey::Peer(rank));
                }
            });
        if let Err(e) = &spawned {
            tracing::warn!("reconnect to {rank}: no thread: {e}");
        }
        spawned.is_ok()
    }

    /// Results nobody came for are dropped after RETENTION: memory stays bounded over
    /// millions of requests.
    fn prune(&self, core: &mut Core, now: Instant) {
        // What has aged out, oldest first: a pop each, never a pass over what stays.
        core.terminals.expire(now);
        core.expire_answered_early(now);
        core.finished.expire(now);
        core.superseded.expire(now);
        core.retired.expire(now);
        if now.duration_since(core.last_prune) < Duration::from_secs(1) {
            return;
        }
        core.last_prune = now;
        // Once when the first entry goes early, then each time their count doubles.
        let evicted = core.terminals.evicted() + core.finished.evicted() + core.retired.evicted();
        if evicted > 2 * core.counters.aged_evicted_logged {
            core.counters.aged_evicted_logged = evicted;
            tracing::warn!(
                "{evicted} memories of ended requests dropped before their time, each map being \
                 full ({AGED_CAP} entries): a replay of such a key is no longer refused here, an \
                 end nobody came for is gone, late data counts as foreign"
            );
        }
        core.control_ops.retain_mut(|op| op.poll().is_none());
    }

    pub fn on_event(&self, core: &mut Core, now: Instant, ev: Event) {
        match ev {
            // An engine being dropped takes no new connection: bound now, it would be closed
            // at the drain's end unannounced (a fault to the dialler, not a leave).
            Event::Accepted(peer, _) if core.leaving.is_some() => {
                let _ = self.agent.close_peer(peer);
            }
            // An endpoint that does not finish its handshake in time is closed.
            Event::Accepted(peer, from) => {
                let from = from.map(|a| super::worker_address_text(&a));
                core.peers.accepted(peer, from, now)
            }
            Event::WorkerMoving => {
                // Those that dialled our old worker address are dialled back from the new one
                // once their endpoints' failures (which follow) come in.
                let n = core.peers.moving();
                tracing::warn!(
                    "moving to a new worker: {n} ranks that dialled this one by worker address \
                     will be dialled back"
                );
            }
            Event::Control(peer, _) if core.fault_cut.contains(&peer) => {}
            Event::Control(peer, bytes) => self.on_control(core, now, peer, &bytes),
            Event::PeerFailed(peer) => {
                core.fault_cut.retain(|&p| p != peer);
                // Its refusal (if one was going out) is failed with it: polled, never dropped
                // unfinished here (that would wait for progress this pass holds up).
                if let Some(op) = core.refusal_ops.remove(&peer) {
                    core.control_ops.push_back(op);
                }
                // The waiters it concerns (a dial that gave way to this one, a `connect`
                // waiting for this reconnect dial, the rank's) are woken at the end of the pass.
                core.leave_answered(peer);
                let left = core.left.remove(&peer);
                let lost = if left {
                    core.peers.on_left(peer, now)
                } else {
                    core.peers.on_failed(peer, now)
                };
                if let Some(rank) = lost {
                    if left {
                        // An orderly leave is no fault (the requests it cost are, each).
                        tracing::info!(peer = rank.0, "{rank}: connection closed, the peer left");
                    } else {
                        tracing::warn!(peer = rank.0, "{rank}: connection failed");
                        core.counters.last_fault = Some(now);
                    }
                    core.ep.handle_peer_lost(now, rank);
                }
                core.waiters.wake(WaitKey::Dial(peer));
            }
            Event::OpDone(id) => {
                // A transfer into or out of a region: its range is free again.
                if let Some(region) = core.regions.done(id) {
                    core.waiters.wake(WaitKey::Region(region));
                }
                self.on_receive_done(core, now, id)
            }
            Event::StrayData { tag, len } => {
                // Nothing of it was kept: the transport discarded it.
                if core.retired.contains_key(&tag) {
                    core.counters.late_data += 1;
                    tracing::debug!("late data under tag {tag:#x} ({len} bytes) discarded");
                } else {
                    core.counters.foreign_data += 1;
                    // At most one line a second: the sender of such data chooses how many.
                    if core
                        .counters
                        .foreign_logged
                        .is_none_or(|t| now.saturating_duration_since(t) >= Duration::from_secs(1))
                    {
                        core.counters.foreign_logged = Some(now);
                        tracing::warn!(
                            "data under a tag no receive here was offered ({len} bytes) \
                             discarded: a process that is not the buffer's peer, or a corrupt \
                             sender ({} so far)",
                            core.counters.foreign_data
                        );
                    }
                }
            }
        }
    }

    fn on_control(&self, core: &mut Core, now: Instant, peer: PeerId, bytes: &[u8]) {
        let msg = match Message::decode(bytes) {
            Ok(m) => m,
            Err(e) => {
                if let WireReason::UnsupportedVersion(v) = e.reason {
                    if self.refuse_version(core, now, peer, v) {
                        return;
                    }
                }
                tracing::warn!("undecodable control message: {e}");
                core.counters.bad_frames += 1;
                return;
            }
        };
        if msg
            == (Message::Refuse {
                reason: Refusal::WireVersion,
            })
        {
            tracing::warn!(
                "endpoint {}: the peer speaks wire version {}, this side {VERSION}",
                peer.0,
                wire::frame_version(bytes).unwrap_or(VERSION)
            );
        }
        if msg == Message::Leaving {
            return self.on_leaving(core, peer);
        }
        if msg.key().is_none() {
            if core.leaving.is_some() && core.peers.rank_of(peer).is_none() {
                // A dial that reached this engine before its drop began: not bound now either.
                let _ = self.agent.close_peer(peer);
                return;
            }
            return self.on_handshake(core, now, peer, msg);
        }
        let Some(rank) = core.peers.rank_of(peer) else {
            core.counters.bad_frames += 1;
            return;
        };
        match &msg {
            Message::Advertise { key, .. } if core.finished.contains_key(&(*key, Some(rank))) => {
                core.counters.replays_dropped += 1;
                return;
            }
            _ => {}
        }
        // The core keeps the senders' answer (`Endpoint::receive_answer`).
        let ready = match &msg {
            Message::Ready { key, .. } => Some(*key),
            _ => None,
        };
        if let Err(e) = core.ep.handle_message(now, rank, msg) {
            // A message that cannot be true (an advertisement naming another rank, or for a
            // key this rank receives): the peer's mistake, counted with the undecodable ones.
            tracing::warn!("control message from {rank}: {e}");
            core.counters.bad_frames += 1;
        }
        if let Some(key) = ready {
            core.waiters.wake(WaitKey::Ready(key));
        }
        timeline::mark(Stage::ControlHandled);
    }

    /// Takes back the receives `ids` of a request that did not start: posted through a
    /// [`Held`] that was dropped unreleased, so UCX never saw them and each has already ended
    /// `Cancelled`. Their records, tokens, region transfers and leases go now.
    pub fn take_back_unstarted(&self, core: &mut Core, now: Instant, ids: &[u64]) {
        for &id in ids {
            debug_assert!(core.recv_ops.get(&id).is_none_or(|r| r.op.is_quiesced()));
            core.regions.done(id);
            self.on_receive_done(core, now, id);
        }
    }

    fn on_receive_done(&self, core: &mut Core, now: Instant, id: u64) {
        let Some(mut r) = core.recv_ops.remove(&id) else {
            return;
        };
        let result = r.op.poll();
        core.by_token.remove(&r.token);
        if !matches!(result, Some(Ok(Outcome::Completed))) {
            core.retired.insert(r.tag, (), now);
        }
        if let Some(act) = r.on_reap.take() {
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
                    core.end(r.key, Role::Receiver, o, now);
                }
            }
            return;
        }
        let res = match result {
            Some(Ok(Outcome::Completed)) => {
                match r.staged.as_mut().map(|(st, dev)| st.to_device(*dev, r.len)) {
                    Some(Err(e)) => {
                        // The bytes did not reach the caller's memory: this rank gives up (the
                        // cancel is agreed), and the receive is over without data, told at once
                        // so that the core does not wait its bound for it.
                        tracing::error!(key = %r.key, "segment {}: copy to device failed: {e}", r.segment);
                        let _ = core.ep.cancel(now, r.key);
                        core.ep.handle_receive_reaped(now, r.key, r.segment)
                    }
                    _ => {
                        // The first landing proves the sender accepted (the core notes it).
                        let landed = core.ep.handle_segment_landed(now, r.key, r.segment);
                        core.waiters.wake(WaitKey::Ready(r.key));
                        landed
                    }
                }
            }
            Some(Err(e)) if e.kind == ErrorKind::Protocol => {
                // The peer sent the wrong size: its mistake, voted as a rejection (first, so the
                // reaped receive is not read as a lost peer).
                tracing::warn!(key = %r.key, "segment {}: {e}", r.segment);
                let _ = core.ep.give_up(now, r.key, Outcome::Rejected);
                core.ep.handle_receive_reaped(now, r.key, r.segment)
            }
            Some(Ok(Outcome::Cancelled)) if !r.core_cancelled => {
                // The sender gave up on this segment and had the receiver drain it: that is the
                // sender's cancel, not a lost peer.
                let _ = core.ep.give_up(now, r.key, Outcome::Cancelled);
                core.ep.handle_receive_reaped(now, r.key, r.segment)
            }
            _ => core.ep.handle_receive_reaped(now, r.key, r.segment),
        };
        if let Err(e) = res {
            tracing::debug!("op {id}: {e}");
        }
        timeline::mark(Stage::LandingHandled);
    }

    /// Drains the core's outputs: control messages out, actions applied, events recorded and
    /// their callers woken.
    pub fn flush(&self, core: &mut Core) {
        self.flush_via(core, None, Instant::now());
    }

    /// [`Inner::flush`], with the control messages posted through `held` (started when the
    /// caller releases it) when given, and the caller's clock read (`now`, the time its events
    /// are recorded at).
    pub fn flush_via(&self, core: &mut Core, mut held: Option<&mut Held<'_>>, now: Instant) {
        loop {
            let mut progressed = false;
            while let Some(t) = core.ep.poll_transmit() {
                progressed = true;
                let Some(peer) = core.peers.endpoint(t.to) else {
                    continue;
                };
                // Nobody waits on it: the core resends what matters until it is answered.
                if let Err(e) = t
                    .message
                    .to_bytes()
                    .map_err(crate::Error::from)
                    .and_then(|b| match held.as_deref_mut() {
                        Some(h) => h.post_control(peer, b),
                        None => self.agent.post_control(peer, b),
                    })
                {
                    tracing::debug!("control to {}: {e}", t.to);
                }
            }
            while let Some(a) = core.ep.poll_action() {
                progressed = true;
                self.apply(core, a);
            }
            while let Some(ev) = core.ep.poll_event() {
                progressed = true;
                self.record(core, now, ev);
            }
            if !progressed {
                break;
            }
        }
        // Control messages on one endpoint complete in order: reclaim the finished ones from the
        // front, O(1) a flush however many are in flight (the once-a-second prune sweeps the rest).
        while core
            .control_ops
            .front_mut()
            .is_some_and(|op| op.poll().is_some())
        {
            core.control_ops.pop_front();
        }
        // A caller may have moved the core's next timer earlier (a give-up pulls the agreement
        // bound in): the progress thread must not sleep past it.
        if let Some(t) = core.ep.poll_timeout() {
            self.agent.wake_by(t);
        }
        if let Some(&(t, _, _)) = core.fence_closes.front() {
            self.agent.wake_by(t);
        }
    }

    /// Force-closes the endpoints of fenced receives whose cancel grace is over and that UCX
    /// still holds (see [`Core::fence_closes`]).
    fn close_unreleased_fences(&self, core: &mut Core, now: Instant) {
        while let Some(&(at, id, peer)) = core.fence_closes.front() {
            if at > now {
                break;
            }
            core.fence_closes.pop_front();
            if core.recv_ops.contains_key(&id) {
                let _ = self.agent.close_peer(peer);
            }
        }
    }

    fn apply(&self, core: &mut Core, a: Action) {
        match a {
            // The application starts each send itself (`Engine::send`), checked by the core.
            Action::Send { .. } => {}
            Action::AbortSend { key, to, segment } => {
                // Its `send` wakes at once, and stops it (no cancel check polls for this).
                if let Some(abort) = core.sends.get(&(key, to, segment)) {
                    abort.abort();
                }
            }
            Action::CancelReceive { token, .. } => {
                if let Some(&id) = core.by_token.get(&token) {
                    if let Some(r) = core.recv_ops.get_mut(&id) {
                        r.op.request_cancel();
                        r.core_cancelled = true;
                    }
                }
            }
            Action::Release { lease, .. } => {
                if let Err(e) = core.pool.release(lease) {
                    tracing::error!("release: {e}");
                }
            }
            Action::Fence { key, lease, token } => {
                // A receive that could not be reaped in time: in a region its range is fenced;
                // in plain memory its endpoint is force-closed unless the cancel releases it
                // within FENCE_CANCEL_GRACE (a close ends every request on it; the pair
                // reconnects). The slot stays fenced,
                // and the request's end is held back, until UCX has released the receive: only
                // then can nothing write the buffer.
                let _ = core.pool.fence(lease);
                let live = match core.by_token.get(&token) {
                    Some(&id) => core.recv_ops.get_mut(&id).map(|r| (id, r)),
                    None => None,
                };
                match live {
                    Some((id, r)) => {
                        let peer = r.peer;
                        r.op.request_cancel();
                        r.on_reap = Some(OnReap::Restore(lease.buffer));
                        // Region memory stays lent to kvlink: the request ends now, and only this
                        // range is refused to new requests until UCX releases the receive. The
                        // pair and its other requests are not touched.
                        if !core.regions.fence(id) {
                            // Plain memory: the cancel gets a short grace first. A receive no
                            // data has matched is released by it at once (the core often asks
                            // for the cancel and the fence in one go: a receiver whose verdict
                            // never came by its bound), and closing its endpoint then would fail
                            // every other request of a sound pair. One that data is landing in
                            // cannot be recalled: its endpoint is closed at the grace's end.
                            let at = Instant::now() + FENCE_CANCEL_GRACE;
                            core.fence_closes.push_back((at, id, peer));
                            core.fencing.entry(key).or_default().insert(id);
                        }
                    }
                    None => drop(core.pool.restore(lease.buffer)),
                }
            }
        }
    }

    fn record(&self, core: &mut Core, now: Instant, ev: ProtoEvent) {
        match ev {
            ProtoEvent::Advertised {
                key,
                from,
                deadline,
                request_info,
                buffers,
            } => {
                let a = Advertisement {
                    key,
                    from,
                    deadline,
                    request_info,
                    buffers,
                };
                let bytes = advert_bytes(&a);
                if core.adverts.len() >= MAX_ADVERTS || core.advert_bytes + bytes > MAX_QUEUED_BYTES
                {
                    // Bounded: refuse rather than queue without end. The receiver sees
                    // `Rejected` at once instead of a timeout.
                    core.counters.adverts_refused += 1;
                    let _ = core.ep.accept(now, key, from, false);
                    return;
                }
                core.advert_bytes += bytes;
                core.adverts.push_back(a);
                core.waiters.wake_one(WaitKey::Advert);
            }
            ProtoEvent::Notified { key, from, payload } => {
                let bytes = note_bytes(&payload);
                let q = core.notes.entry(from).or_default();
                if q.len() >= MAX_NOTES || core.note_bytes + bytes > MAX_QUEUED_BYTES {
                    core.counters.notes_dropped += 1;
                    if q.is_empty() {
                        core.notes.remove(&from);
                    }
                    return;
                }
                core.note_bytes += bytes;
                q.push_back((key, payload));
                core.waiters.wake_one(WaitKey::Note(from));
            }
            ProtoEvent::Terminal {
                key,
                role,
                outcome,
                started,
            } => {
                let peer = match role {
                    Role::Receiver => None,
                    Role::Sender { receiver } => Some(receiver),
                };
                let retired = peer.is_some_and(|r| core.retired_sends.remove(&(key, r)));
                match peer {
                    // A send to a replaced process: not an end of this key on this rank (the
                    // new process's request of it is no replay), nor one for a later `wait`,
                    // which takes it from `superseded`.
                    Some(r) if retired => {
                        // A `wait` blocked on it takes it (below); one that returned before it
                        // came (its early answer, taken out here: `end` is not called for it)
                        // had its answer. Either way, once.
                        let k = (key, role);
                        let answered = core.answered_early.remove(&k).is_some()
                            || core.superseded.get(&(key, r)).is_some_and(|s| s.waited);
                        let end = Superseded {
                            end: outcome,
                            waited: answered || core.waited.contains(&k),
                        };
                        core.superseded.insert((key, r), end, now);
                    }
                    _ => core.finished.insert((key, peer), outcome, now),
                }
                if matches!(outcome, Outcome::TimedOut | Outcome::PeerLost) {
                    core.counters.last_fault = Some(now);
                }
                let took = now.saturating_duration_since(started);
                self.metrics.ended(role, outcome, Some(took));
                macro_rules! ended {
                    ($level:ident) => {
                        tracing::$level!(
                            request = key.request.0,
                            generation = key.generation.0,
                            role = crate::metrics::role_label(role),
                            peer = peer.map(|r| r.0),
                            outcome = crate::metrics::outcome_label(outcome),
                            "request {key} ended {outcome:?}"
                        )
                    };
                }
                if outcome == Outcome::Completed {
                    ended!(debug);
                } else {
                    ended!(warn);
                }
                if role == Role::Receiver && core.fencing.contains_key(&key) {
                    core.deferred.insert(key, outcome);
                } else if let (true, Some(r)) = (retired, peer) {
                    // Kept in `superseded`, and for a `wait` blocked on it in a slot of its
                    // own (`retired_ends`): in `terminals` the new process's request of the
                    // key, which may start and end before that wait runs, would take its place.
                    if core.waited.contains(&(key, role)) {
                        core.retired_ends.insert((key, r), outcome);
                    }
                    core.waiters.wake(WaitKey::Terminal(key, role));
                } else {
                    core.end(key, role, outcome, now);
                }
            }
        }
    }
}

/// The engine's logic on the agent's progress thread: the core runs where the events arrive,
/// with no thread of its own in between (one hand-off less per event, both ways).
pub(crate) struct Sink(pub std::sync::Weak<Inner>);

impl EventSink for Sink {
    fn deliver(&self, events: &mut VecDeque<Event>, now: Instant) -> Option<Instant> {
        timeline::mark(Stage::SinkEntered);
        let inner = self.0.upgrade()?;
        if inner.stopping.load(Ordering::Acquire) {
            return None;
        }
        let mut core = inner.core.lock();
        core.waiters.hold();
        // Whatever happens in between, the wakes held from here are let go below: a panic in the
        // core's handling (caught by the transport, which drops the events) must not leave
        // `hold` on, with every wake made meanwhile waiting for the next delivery.
        let next = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            Self::deliver_held(&inner, &mut core, events, now)
        }));
        // Handed to `delivered` (which runs after this sink returns), in a vector that keeps its
        // room: no allocation per delivery.
        core.waiters.unhold_into(&inner.held_wakes);
        drop(core);
        // Never the last owner here: `Engine::drop` stops this thread before it lets go.
        drop(inner);
        next.unwrap_or_else(|p| std::panic::resume_unwind(p))
    }

    /// The callers that `deliver` woke run only now, after the control messages it queued (a
    /// receiver's verdict, say) have left: woken first, a caller on a small machine takes the
    /// core from the thread that would send them. Measured on two cores, whole 16 MiB requests
    /// over tcp (median per run, three runs each): the verdict left 27-61 µs after the
    /// landing, often behind the woken receiver's return and next advertisement, and 8-10 µs
    /// once the wake came after it.
    fn delivered(&self) {
        let Some(inner) = self.0.upgrade() else {
            return;
        };
        // Taken out under the lock, notified after it; inline for the usual few.
        let woken: SmallVec<[_; 4]> = inner.held_wakes.lock().drain(..).collect();
        for cv in woken {
            cv.notify_one();
        }
    }
}

impl Sink {
    /// [`Sink::deliver`]'s work, with the core's wakes held: the events, due timers, redials
    /// and closes, fences, pruning and the flush. Returns when the sink next wants a call.
    fn deliver_held(
        inner: &Arc<Inner>,
        core: &mut Core,
        events: &mut VecDeque<Event>,
        now: Instant,
    ) -> Option<Instant> {
        for ev in events.drain(..) {
            inner.on_event(core, now, ev);
        }
        // The pass's clock read serves the whole delivery: its events take microseconds, and a
        // timer that falls due meanwhile is handled by the next pass.
        if core.ep.poll_timeout().is_some_and(|t| t <= now) {
            core.ep.handle_timeout(now);
        }
        timeline::mark(Stage::TimersHandled);
        // An engine going away dials nobody (`say_leaving` stopped the peer table's dials).
        for (rank, address) in core.peers.due(now) {
            if !inner.redial(rank, address) {
                core.peers.round_dial_void(rank);
            }
        }
        for peer in core.peers.due_closes(now) {
            let _ = inner.agent.close_peer(peer);
        }
        inner.close_unreleased_fences(core, now);
        // Whatever this pass changed in the peer table wakes the waiters it concerns: a rank
        // bound or lost, a round given up, a dial refused or ended (`Peers::take_wakes`).
        for rank in core.peers.take_wakes() {
            core.waiters.wake(WaitKey::Peer(rank));
        }
        inner.prune(core, now);
        inner.flush_via(core, None, now);
        timeline::mark(Stage::SinkFlushed);
        [
            core.ep.poll_timeout(),
            core.peers.next_due(),
            core.fence_closes.front().map(|&(t, _, _)| t),
        ]
        .into_iter()
        .flatten()
        .min()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An engine of rank 1 on tcp, connected to nothing.
    fn tcp_engine() -> crate::engine::Engine {
        use crate::transport::TransportKind;
        let mut cfg = crate::engine::EngineConfig::new("ctx", 1, TransportKind::Tcp);
        cfg.listen = Some("127.0.0.1:0".parse().unwrap());
        crate::engine::Engine::new(cfg).unwrap()
    }

    /// Runs `test` on a fresh [`tcp_engine`] under its core's lock, with the clock read once,
    /// and the key (4, 0) and rank 2 the tests name.
    fn on_engine(test: impl FnOnce(&Inner, &mut Core, Instant, RequestKey, RankId)) {
        let engine = tcp_engine();
        let inner = &engine.inner;
        test(
            inner,
            &mut inner.core.lock(),
            Instant::now(),
            RequestKey::new(4, 0),
            RankId(2),
        );
    }

    /// `rank`'s process lost and a new one bound to it, as one delivery records it.
    fn replace_process(inner: &Inner, core: &mut Core, now: Instant, rank: RankId) {
        core.ep.handle_peer_lost(now, rank);
        inner.new_instance(core, now, rank);
        inner.flush_via(core, None, now);
    }

    /// A send of `key` to `rank` accepted and in flight when `rank`'s process is lost and a
    /// new one binds the rank: retired in the core.
    fn sending_to_a_replaced_process(
        inner: &Inner,
        core: &mut Core,
        now: Instant,
        key: RequestKey,
        rank: RankId,
    ) {
        core.ep
            .handle_message(now, rank, advertisement(key, rank))
            .unwrap();
        core.accept(now, key, rank, true).unwrap();
        core.check_send(key, rank, 0, 64).unwrap().unwrap();
        core.ep.begin_send(key, rank, 0);
        inner.flush_via(core, None, now);
        replace_process(inner, core, now, rank);
        assert!(core.retired_sends.contains(&(key, rank)));
    }

    /// `rank`'s advertisement of `key`: one segment of 64 bytes, a minute to run.
    fn advertisement(key: RequestKey, rank: RankId) -> Message {
        Message::Advertise {
            key,
            src_rank: rank,
            timeout_ms: 60_000,
            request_info: vec![],
            buffers: vec![segment_of_64_bytes()],
        }
    }

    /// The old request's give-up (its `wait` cancelled, or its send's end) after its flow went
    /// and the new process's request of the key started from the advertisement the retired
    /// flow kept, not yet taken by the application: the new request is not given up. Found by
    /// review: `wait` gave up every send of the key.
    #[test]
    fn the_old_requests_give_up_spares_the_new_processs_request() {
        on_engine(|inner, core, now, key, rank| {
            sending_to_a_replaced_process(inner, core, now, key, rank);
            core.ep
                .handle_message(now, rank, advertisement(key, rank))
                .unwrap();
            core.ep.handle_send_done(now, key, rank, 0, false).unwrap();
            inner.flush_via(core, None, now);
            core.ep.handle_timeout(now);
            inner.flush_via(core, None, now);
            assert!(
                core.ep.running(key, Role::Sender { receiver: rank }),
                "the new request"
            );
            core.give_up(now, key, Outcome::Cancelled).unwrap_err();
            inner.flush_via(core, None, now);
            // The application takes the new advertisement (`next_advertisement`) and runs it.
            core.superseded.remove(&(key, rank));
            core.accept(now, key, rank, true).unwrap();
            assert!(
                matches!(core.check_send(key, rank, 0, 64), Ok(Ok(_))),
                "the new request was given up"
            );
        });
    }

    /// The old request's own give-up (its `wait` at its deadline) while its send is still
    /// stopping: it ends by the agreement bound from then (`PeerLost`, its verdict), as any
    /// request given up. Found by review: the give-up spared the retired flow as if it were
    /// the new process's, and it ran to its request's deadline (here a minute) plus the bound,
    /// the wait returning `TimedOut` unsettled.
    #[test]
    fn the_old_requests_give_up_reaches_its_own_retired_send() {
        on_engine(|inner, core, now, key, rank| {
            sending_to_a_replaced_process(inner, core, now, key, rank);
            core.give_up(now, key, Outcome::TimedOut).unwrap();
            inner.flush_via(core, None, now);
            let later = now + inner.agreement_bound + Duration::from_millis(1);
            core.ep.handle_timeout(later);
            inner.flush_via(core, None, later);
            assert!(!core.retired_sends.contains(&(key, rank)), "still running");
            assert_eq!(
                core.superseded.get(&(key, rank)).map(|s| s.end),
                Some(Outcome::PeerLost)
            );
        });
    }

    /// The new process's request of the key starts from the advertisement the retired flow
    /// kept and ends at once (its verdict came meanwhile) in the pass that forgets the old
    /// flow, before the old request's blocked `wait` has run: that wait still gets the old
    /// request's end, and the new one's stays for the `wait` the application makes once it
    /// takes the new advertisement. Found by review: both ends went to one slot, the new one
    /// over the old one (and without the verdict, the old end waited there for the new
    /// request's `wait`).
    #[test]
    fn a_new_request_that_ends_at_once_leaves_the_old_end_to_its_wait() {
        for new_end in [Some(Outcome::TimedOut), None] {
            for blocked_before_the_bind in [false, true] {
                new_request_beside_an_old_wait(new_end, blocked_before_the_bind);
            }
        }
    }

    /// See [`a_new_request_that_ends_at_once_leaves_the_old_end_to_its_wait`]; the old
    /// request's `wait` blocked since before the bind, or after it. Either way its end stays
    /// for it once the application takes the new advertisement. (Found by a later review:
    /// a wait blocked since before the bind, and one whose end the application's take of the
    /// new advertisement removed, slept to their deadlines.)
    fn new_request_beside_an_old_wait(new_end: Option<Outcome>, blocked_before_the_bind: bool) {
        on_engine(|inner, core, now, key, rank| {
            let role = Role::Sender { receiver: rank };
            if blocked_before_the_bind {
                core.waited.insert((key, role));
            }
            sending_to_a_replaced_process(inner, core, now, key, rank);
            core.ep
                .handle_message(now, rank, advertisement(key, rank))
                .unwrap();
            if let Some(outcome) = new_end {
                let verdict = Message::Verdict { key, outcome };
                core.ep.handle_message(now, rank, verdict).unwrap();
            }
            // The old request's wait, blocked.
            core.waited.insert((key, role));
            core.ep.handle_send_done(now, key, rank, 0, false).unwrap();
            inner.flush_via(core, None, now);
            core.ep.handle_timeout(now);
            inner.flush_via(core, None, now);
            // The application takes the new advertisement (`next_advertisement`) before the old
            // wait has run.
            core.superseded.remove(&(key, rank));
            assert_eq!(
                core.retired_ends.get(&(key, rank)),
                Some(&Outcome::PeerLost),
                "the old end, for its wait"
            );
            assert_eq!(
                core.terminals.get(&(key, role)).copied(),
                new_end,
                "the new request's end, and only that"
            );
        });
    }

    /// A host segment 0 of 64 bytes under token 1.
    fn segment_of_64_bytes() -> BufferDesc {
        BufferDesc {
            kind: crate::proto::BufferKind::Kv,
            segment: 0,
            addr: 0x1000,
            len: 64,
            device_id: -1,
            token: crate::proto::Token(1),
        }
    }

    /// A new process under a rank forgets the ends of the old one's requests, except one a
    /// blocked `wait` was woken for and has not taken yet (its request's, not the new one's).
    #[test]
    fn a_replaced_process_keeps_the_end_a_woken_wait_has_not_taken() {
        let mut core = Core::new(Endpoint::new(RankId(1), crate::proto::Config::default()), 4);
        let now = Instant::now();
        let role = Role::Sender {
            receiver: RankId(2),
        };
        let (waited, unwaited) = ((RequestKey::new(7, 0), role), (RequestKey::new(8, 0), role));
        let elsewhere = (
            RequestKey::new(9, 0),
            Role::Sender {
                receiver: RankId(3),
            },
        );
        for k in [waited, unwaited, elsewhere] {
            core.terminals.insert(k, Outcome::PeerLost, now);
        }
        core.waited.insert(waited);
        core.forget_instance(RankId(2));
        // Kept for the woken wait in its own slot, where the new process's request of the key
        // cannot take its place (found by review: it stayed in `terminals`).
        assert_eq!(core.terminals.get(&waited), None);
        assert_eq!(
            core.retired_ends.get(&(waited.0, RankId(2))),
            Some(&Outcome::PeerLost)
        );
        assert_eq!(core.terminals.get(&unwaited), None);
        assert_eq!(core.terminals.get(&elsewhere), Some(&Outcome::PeerLost));
    }

    /// The old endpoint's failure ended a send flow to rank 2 (its end queued in the core), and
    /// in the same delivery a new process bound the rank: the end is recorded before the
    /// forgetting, so it is kept as the old request's (`superseded`) and is neither an ended
    /// key (which would refuse the new process's request of it as a replay for RETENTION) nor
    /// an end a `wait` for the new request would take. Before, it was recorded after.
    #[test]
    fn an_end_queued_when_a_new_process_binds_the_rank_is_recorded_before_the_forgetting() {
        on_engine(|inner, core, now, key, rank| {
            core.ep
                .handle_message(now, rank, advertisement(key, rank))
                .unwrap();
            inner.flush_via(core, None, now);
            replace_process(inner, core, now, rank);
            let role = Role::Sender { receiver: rank };
            assert!(
                !core.finished.contains_key(&(key, Some(rank))),
                "kept as an ended key"
            );
            assert_eq!(core.terminals.get(&(key, role)), None, "kept for a wait");
            assert_eq!(
                core.superseded.get(&(key, rank)).map(|s| s.end),
                Some(Outcome::PeerLost)
            );
        });
    }

    /// A `wait` for a request of a replaced process that returned before the request's end
    /// came (its early answer) had its answer: the end, when it comes, is not kept for another
    /// `wait`, and the early answer goes with it. Before, the early answer stayed (only the
    /// end's recording took it out, which a replaced process's request skips) and refused the
    /// `wait` for the new process's request of that key, and then swallowed its end.
    /// The same with the rank's process replaced once more after that `wait` (which clears the
    /// early answers): found by a later review, the second bind kept the entry without it.
    #[test]
    fn an_early_answer_for_a_replaced_processs_request_goes_with_its_end() {
        for second_bind in [false, true] {
            early_answer_for_a_replaced_processs_request(second_bind);
        }
    }

    fn early_answer_for_a_replaced_processs_request(second_bind: bool) {
        on_engine(|inner, core, now, key, rank| {
            let role = Role::Sender { receiver: rank };
            sending_to_a_replaced_process(inner, core, now, key, rank);
            // A wait that gave up before the end came, as `Engine::wait` records it.
            core.answered_early.insert((key, role), (), now);
            if second_bind {
                replace_process(inner, core, now, rank);
            }
            core.ep.handle_send_done(now, key, rank, 0, false).unwrap();
            inner.flush_via(core, None, now);
            assert!(
                !core.answered_early.contains_key(&(key, role)),
                "the early answer stayed"
            );
            assert_eq!(
                core.terminals.get(&(key, role)),
                None,
                "kept for another wait"
            );
            let s = core.superseded.get(&(key, rank)).copied();
            assert_eq!(
                s,
                Some(Superseded {
                    end: Outcome::PeerLost,
                    waited: true
                })
            );
        });
    }

    /// The rank's process replaced twice while the application has not taken the second
    /// process's advertisement of a key: what the application may still name by that key is
    /// the first process's request (`Completed`), not the second's (its end at the second
    /// bind, `PeerLost`). Found by review: the second bind replaced the first's entry.
    #[test]
    fn a_second_replacement_keeps_the_request_the_application_took() {
        on_engine(|inner, core, now, key, rank| {
            let advertise = || advertisement(key, rank);
            core.ep.handle_message(now, rank, advertise()).unwrap();
            core.accept(now, key, rank, true).unwrap();
            core.check_send(key, rank, 0, 64).unwrap().unwrap();
            core.ep.begin_send(key, rank, 0);
            core.ep.handle_send_done(now, key, rank, 0, true).unwrap();
            let verdict = Message::Verdict {
                key,
                outcome: Outcome::Completed,
            };
            core.ep.handle_message(now, rank, verdict).unwrap();
            inner.flush_via(core, None, now);
            let first = Superseded {
                end: Outcome::Completed,
                waited: false,
            };
            for _ in 0..2 {
                replace_process(inner, core, now, rank);
                assert_eq!(core.superseded.get(&(key, rank)), Some(&first));
                // The next process advertises the key; the application does not take it.
                core.ep.handle_message(now, rank, advertise()).unwrap();
                inner.flush_via(core, None, now);
            }
        });
    }

    /// An early answer (a `wait` that gave up before the end came) stays the caller's end for
    /// as long as its request runs, past RETENTION: the end that comes later is not kept for a
    /// second `wait`. One whose request the core no longer knows goes at RETENTION.
    #[test]
    fn an_early_answer_outlives_retention_while_its_request_runs() {
        use crate::proto::{ReceiveFlow, ReceiveSpec};
        let mut core = Core::new(Endpoint::new(RankId(1), crate::proto::Config::default()), 4);
        let t0 = Instant::now();
        let key = RequestKey::new(5, 0);
        let lease = core.pool.lease(key).unwrap();
        let desc = segment_of_64_bytes();
        core.ep
            .start_receive(
                t0,
                ReceiveSpec {
                    key,
                    receivers: vec![RankId(1)],
                    flows: vec![ReceiveFlow {
                        sender: RankId(2),
                        buffers: vec![(lease, desc)],
                    }],
                    request_info: vec![],
                    timeout: Some(Duration::from_secs(3600)),
                },
            )
            .unwrap();
        let running = (key, Role::Receiver);
        let gone = (RequestKey::new(6, 0), Role::Receiver);
        core.answered_early.insert(running, (), t0);
        core.answered_early.insert(gone, (), t0);
        core.expire_answered_early(t0 + RETENTION);
        assert!(core.answered_early.contains_key(&running));
        assert!(!core.answered_early.contains_key(&gone));
        core.end(key, Role::Receiver, Outcome::Completed, t0 + RETENTION);
        assert_eq!(
            core.terminals.get(&running),
            None,
            "the end after an early answer was kept for a second wait"
        );
    }
}
