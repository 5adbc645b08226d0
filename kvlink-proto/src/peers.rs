//! The peer table: which transport endpoint serves which rank, its state, and the reconnect
//! policy that heals a pair after a fault.
//!
//! A rank is bound to an endpoint by the handshake ([`crate::handshake`]): only a peer that
//! proved it holds the deployment secret, and only while no other live endpoint holds its rank,
//! unless the newcomer proves it holds that endpoint's session (the same process coming back on a
//! new connection before this side saw the old one fail). A second process with the rank is
//! refused until the first is gone. An endpoint that has not finished its handshake within
//! [`HANDSHAKE_LIMIT`] is closed. When the transport reports the endpoint
//! failed, the rank becomes `Failed`; if this side dialled it (`connect`), it becomes
//! `Reconnecting` and the engine dials the same address again in the background, up to
//! [`MAX_TRIES`] times with a doubling back-off. The side that was dialled waits for the peer's
//! new `Hello`. A later use of a rank that gave up (`advertise`) starts a fresh round. Only the
//! requests that were on the failed endpoint are lost, never the pair. A peer that said it
//! leaves (its engine ended) is not redialled at a worker address, which ended with it
//! ([`Peers::on_left`]).
//!
//! One exception to "the dialled side waits": when this side moves to a new transport worker
//! (its shared-memory receive queue was stuck, docs/RELIABILITY.md), peers that dialled it by
//! its worker address cannot know: nothing fails on their side, and the address they hold is
//! dead. So a peer that dialled by worker address is remembered with the worker address it gave
//! (its dial-back address), and when the move fails its endpoint ([`Peers::moving`]), a
//! reconnect round dials it there. Its side binds the dial as the same session coming back,
//! and learns the new address from it.
//!
//! Sans-IO like the rest of the core: the table is generic over the transport's endpoint id
//! (`P`), takes the time as an argument and only says what to do (endpoints to close, ranks to
//! dial, ranks whose waiters to wake: [`Peers::take_wakes`]); the engine carries it out. The
//! tests at the bottom drive it deterministically, and `tests/proto_crossing.rs` checks, over
//! the orders it runs, that a sleeping `connect` never moves on without a wake the table named
//! (or its timer).
use foldhash::{HashMap, HashMapExt};
use std::collections::VecDeque;
use std::hash::Hash;
use std::time::{Duration, Instant};

use crate::{Handshake, Message, PeerInfo, RankId, Refusal, SessionKey, TagKey};

mod binding;
pub use binding::{HandshakeAction, REDIAL_WAIT};

/// Dial attempts per round before a rank is left `Failed` (until its next use).
pub const MAX_TRIES: u32 = 6;
/// The first back-off between attempts; it doubles after each.
const FIRST_BACKOFF: Duration = Duration::from_millis(50);
/// How long a refused endpoint stays open so that its `Refuse` reaches the peer.
const REFUSE_LINGER: Duration = Duration::from_millis(200);
/// How long a refusal is remembered after it: far past the endpoint's close (its linger), for
/// a `connect` that reads it late and so that a refused endpoint is never refused twice.
const REFUSED_KEEP: Duration = Duration::from_secs(60);
/// The most refusals remembered: past it the oldest go first (each needed a new endpoint, so
/// this many within `REFUSED_KEEP` is a flood, and the oldest are long closed).
const REFUSED_MAX: usize = 4096;
/// The most processes remembered as having lost their dial to this side (`lost_answers`): more
/// within HANDSHAKE_LIMIT are not remembered (their ties settle as before this rule).
const LOST_ANSWERS_MAX: usize = 1024;
/// How many `Failed` ranks that nobody here dials (ranks that dialled this side and then
/// failed) are kept for certain; past twice this, the ones that failed first are forgotten
/// down to it, as if never bound.
/// Without it the table kept every rank ever bound, and any process that can connect could
/// bind rank after rank (with a deployment secret, any member).
pub const FAILED_KEPT: usize = 4096;

/// The most process ids of forgotten ranks kept (`Peers::forgotten_instances`): a few bytes
/// each.
pub const FORGOTTEN_KEPT: usize = 4 * FAILED_KEPT;
/// An endpoint whose handshake is not done by then is closed.
pub const HANDSHAKE_LIMIT: Duration = Duration::from_secs(10);

/// A rank's connection, as the engine's `peer_state` reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum PeerState {
    /// Never heard of.
    Unknown = 0,
    /// Bound by its `Hello`; requests can use it.
    Connected = 1,
    /// Its endpoint failed and the engine is dialling it again.
    Reconnecting = 2,
    /// Its endpoint failed and nobody is dialling (this side was dialled, the tries ran out, or
    /// it left and was reached by worker address: [`Peers::on_left`]).
    Failed = 3,
}

impl<P> Rank<P> {
    /// The address a reconnect round dials it at.
    fn round_address(&self) -> Option<&String> {
        if self.by_dial_back {
            self.dial_back.as_ref()
        } else {
            self.dial.as_ref()
        }
    }
}

pub(crate) struct Rank<P> {
    pub peer: Option<P>,
    pub name: String,
    pub state: PeerState,
    /// The address this side dialled it at, if it did.
    pub dial: Option<String>,
    /// The worker address it gave when it last dialled this side, if it dialled by worker
    /// address (see [`Peers::moving`]).
    pub dial_back: Option<String>,
    /// Its endpoint is lost to this side's move (or was, and the reconnect round that follows
    /// dials `dial_back`, not `dial`).
    by_dial_back: bool,
    /// The process bound last (its `Hello`'s instance).
    instance: Option<u64>,
    /// The endpoint bound last was made by the peer (this side answered its dial), and when
    /// its handshake bound it (`binding`).
    answered: bool,
    bound_at: Option<Instant>,
    /// The session of the pair (kept after a failure: a redial proves it holds it) and the
    /// keys of the tags between us, derived from it.
    pub session: Option<SessionKey>,
    /// The session the bound process proved when it was last rebound by a redial (see
    /// [`Peers::held_sessions`]); None after a bind without one.
    proved: Option<SessionKey>,
    pub keys: Option<TagKeys>,
    tries: u32,
    next_try: Option<Instant>,
    /// The number of its last failure with nobody here to dial it (`Peers::failed_count`; see
    /// `Peers::forget_failed`). A number, not the time: a pass's events share one clock read,
    /// and a rank can fail twice in one pass.
    failed_at: Option<u64>,
}

/// The tag keys of one bound pair: for receives this side posts for the rank's data (`inbound`)
/// and for sends to it (`outbound`).
#[derive(Clone, Copy, Debug)]
pub struct TagKeys {
    pub inbound: TagKey,
    pub outbound: TagKey,
}

/// Drops the entries of `m` that are `keep` old at `now` (`at`: since when an entry is kept).
fn expire<K, V>(m: &mut HashMap<K, V>, now: Instant, keep: Duration, at: impl Fn(&V) -> Instant) {
    if !m.is_empty() {
        m.retain(|_, v| now.saturating_duration_since(at(v)) < keep);
    }
}

/// A dial of `connect`'s that won a tie (see `binding`): the rank, the session its `Proof`
/// made (if it got that far), and since when.
#[derive(Clone, Copy, Debug)]
pub struct WonTie {
    pub rank: RankId,
    pub session: Option<SessionKey>,
    pub at: Instant,
}

/// Handshake refusals, both ways.
#[derive(Clone, Copy, Debug, Default)]
pub struct Refusals {
    /// Peers this side refused: no proof of the secret, a rank held by another process, or
    /// frames of another wire version.
    pub auth: u64,
    pub rank_in_use: u64,
    pub version: u64,
    /// Times a peer refused this side.
    pub by_peer: u64,
}

/// The peer table over endpoint ids `P` (the transport's `PeerId` in the engine).
pub struct Peers<P> {
    ranks: HashMap<RankId, Rank<P>>,
    rank_of: HashMap<P, RankId>,
    /// Endpoints a reconnect round dialled for a rank, waiting for its `Hello`, with the
    /// address dialled (what [`Peers::due`] gave).
    dialling: HashMap<P, (RankId, Option<String>)>,
    /// Endpoints peers made to this side (dialled here by worker address, with the worker
    /// address the peer gave, or through a listener: None), until their handshake binds or
    /// fails.
    came_from: HashMap<P, Option<String>>,
    /// Ranks whose connection facts changed since [`Peers::take_wakes`]: their waiters look
    /// again.
    wakes: Vec<RankId>,
    /// The handshake of every endpoint not yet failed (done ones included: a late handshake
    /// message on a bound endpoint is answered as out of order).
    pub handshakes: HashMap<P, Handshake>,
    /// Endpoints refused (either way), why and when: `connect` reports it, and a refused
    /// endpoint is not refused again. Kept for REFUSED_KEEP, in `refused_order`.
    refused: HashMap<P, (Refusal, Instant)>,
    refused_order: VecDeque<(Instant, P)>,
    /// Refused endpoints to close once their `Refuse` had time to go out.
    closing: Vec<(P, Instant)>,
    /// Endpoints whose handshake is not done, since when: closed after HANDSHAKE_LIMIT.
    pending: HashMap<P, Instant>,
    /// Dials that gave way to the same process's dial the other way (see `binding`): the rank
    /// they reached, and since when. `connect` takes its entry; others go after REFUSED_KEEP.
    gave_way: HashMap<P, (RankId, Instant)>,
    /// Endpoints handed to the engine to close because their handshake ran past
    /// HANDSHAKE_LIMIT, until their failure is reported (or REFUSED_KEEP): what still arrives on
    /// them is dropped, so a late `Proof` cannot bind a rank to an endpoint being closed.
    timed_out: HashMap<P, Instant>,
    /// `connect`'s dials whose proof was out to a process when this side refused that
    /// process's dial the other way for a tie (see `binding`). Such a dial that fails before
    /// it binds owes the pair another dial, unless the rank got bound otherwise (`connect`
    /// takes the entry); a dial that binds drops its entry, and others go after REFUSED_KEEP.
    won_tie: HashMap<P, WonTie>,
    /// A redial of a won tie (`connect`'s new dial -> the broken dial's rank and session): its
    /// `Proof` carries a resume proof of that session, so that an answerer that bound the
    /// broken connection and has not heard it broke takes the redial as the same process
    /// coming back. Dropped when the dial ends.
    redial_of: HashMap<P, (RankId, SessionKey)>,
    /// Processes whose dial to this side ended in a failure (its connection broke, before or
    /// after the bind): rank -> (instance, when). Kept for HANDSHAKE_LIMIT, at most
    /// LOST_ANSWERS_MAX of them (see `binding`).
    lost_answers: HashMap<RankId, (u64, Instant)>,
    /// Ranks a dial of ours gave way to after the rank refused it, or because the pair's
    /// connection is the rank's dial (see `binding`), since when: cleared by a bind of the
    /// rank, kept for HANDSHAKE_LIMIT.
    gave_way_to: HashMap<RankId, Instant>,
    /// Ranks whose dial here, which a dial of ours gave way to or which refused ours for a
    /// tie, broke: they dial again (the tie's winner in its `connect`, a bound dialler in its
    /// reconnect round), and a dial of ours that gave way waits for that. Since when; cleared
    /// by a bind of the rank, kept for HANDSHAKE_LIMIT.
    expect_redial: HashMap<RankId, Instant>,
    /// Addresses a `connect` is running for, and how many ([`Peers::connect_begins`]): a
    /// reconnect round holds off dialling a rank at one of them.
    connects: HashMap<String, u32>,
    /// Endpoints a `connect` dialled, and the address it dialled ([`Peers::connect_dialled`]):
    /// a handshake on one may bind after that `connect` returned (at its deadline, the peer
    /// slow to answer), and the rank is then still one this side dialled, dialled again there
    /// when its connection breaks. Dropped when the endpoint binds, gives way or fails.
    connect_dials: HashMap<P, String>,
    /// Ranks a reconnect round has handed out to be dialled ([`Peers::due`]) whose dial is not
    /// yet made ([`Peers::dialled`]) or given up ([`Peers::round_dial_void`]), with when and
    /// the address it is to dial.
    round_starting: HashMap<RankId, (Instant, String)>,
    /// Ranks that became `Failed` with nobody here to dial them, and the number of that
    /// failure (`failed_count`), oldest first (an entry whose rank was bound again or failed
    /// again since is skipped): the order in which `Peers::forget_failed` forgets them.
    failed_order: VecDeque<(RankId, u64)>,
    /// Failures pushed to `failed_order` so far: each entry's number.
    failed_count: u64,
    /// The process ids of ranks forgotten by `forget_failed`, with the number of that
    /// forgetting, and those numbers in order: at most [`FORGOTTEN_KEPT`] entries in the
    /// order (those of ranks bound again since count until they reach its front). A rank that comes
    /// back from another process is then still seen as a new process (`NewInstance`), and
    /// what was kept of the old one's requests goes.
    forgotten_instances: HashMap<RankId, (u64, u64)>,
    forgotten_order: VecDeque<(RankId, u64)>,
    /// Set when this side is going away ([`Peers::stop_dialling`]): no rank is dialled again,
    /// and no try is due.
    dialling_stopped: bool,
    /// Ranks forgotten that way.
    pub forgotten: u64,
    pub refusals: Refusals,
    pub reconnects: u64,
    pub failures: u64,
}

impl<P> Default for Peers<P> {
    fn default() -> Self {
        Peers {
            ranks: HashMap::new(),
            rank_of: HashMap::new(),
            dialling: HashMap::new(),
            came_from: HashMap::new(),
            wakes: Vec::new(),
            handshakes: HashMap::new(),
            refused: HashMap::new(),
            refused_order: VecDeque::new(),
            closing: Vec::new(),
            pending: HashMap::new(),
            gave_way: HashMap::new(),
            timed_out: HashMap::new(),
            won_tie: HashMap::new(),
            redial_of: HashMap::new(),
            lost_answers: HashMap::new(),
            gave_way_to: HashMap::new(),
            expect_redial: HashMap::new(),
            connects: HashMap::new(),
            connect_dials: HashMap::new(),
            round_starting: HashMap::new(),
            failed_order: VecDeque::new(),
            failed_count: 0,
            forgotten_instances: HashMap::new(),
            forgotten_order: VecDeque::new(),
            dialling_stopped: false,
            forgotten: 0,
            refusals: Refusals::default(),
            reconnects: 0,
            failures: 0,
        }
    }
}

impl<P: Copy + Eq + Hash> Peers<P> {
    pub fn state(&self, rank: RankId) -> PeerState {
        self.ranks
            .get(&rank)
            .map_or(PeerState::Unknown, |r| r.state)
    }

    /// The live endpoint of `rank`, if it is connected.
    pub fn endpoint(&self, rank: RankId) -> Option<P> {
        self.ranks
            .get(&rank)
            .filter(|r| r.state == PeerState::Connected)
            .and_then(|r| r.peer)
    }

    pub fn rank_of(&self, peer: P) -> Option<RankId> {
        self.rank_of.get(&peer).copied()
    }

    pub fn name(&self, rank: RankId) -> Option<String> {
        self.ranks.get(&rank).map(|r| r.name.clone())
    }

    /// The entries of every table kept here, by name: for tests that check each stays bounded
    /// over many connections (a peer dialling and dropping again and again).
    #[doc(hidden)]
    pub fn table_sizes(&self) -> Vec<(&'static str, usize)> {
        vec![
            ("peers.ranks", self.ranks.len()),
            ("peers.rank_of", self.rank_of.len()),
            ("peers.dialling", self.dialling.len()),
            ("peers.came_from", self.came_from.len()),
            ("peers.wakes", self.wakes.len()),
            ("peers.handshakes", self.handshakes.len()),
            ("peers.refused", self.refused.len()),
            ("peers.refused_order", self.refused_order.len()),
            ("peers.closing", self.closing.len()),
            ("peers.pending", self.pending.len()),
            ("peers.gave_way", self.gave_way.len()),
            ("peers.timed_out", self.timed_out.len()),
            ("peers.won_tie", self.won_tie.len()),
            ("peers.redial_of", self.redial_of.len()),
            ("peers.lost_answers", self.lost_answers.len()),
            ("peers.gave_way_to", self.gave_way_to.len()),
            ("peers.expect_redial", self.expect_redial.len()),
            ("peers.connects", self.connects.len()),
            ("peers.round_starting", self.round_starting.len()),
            ("peers.failed_order", self.failed_order.len()),
            ("peers.forgotten_instances", self.forgotten_instances.len()),
            ("peers.forgotten_order", self.forgotten_order.len()),
        ]
    }

    /// Every rank this side has known (bound once, whatever its state now).
    pub fn ranks(&self) -> impl Iterator<Item = RankId> + '_ {
        self.ranks.keys().copied()
    }

    pub fn connected(&self) -> usize {
        self.ranks
            .values()
            .filter(|r| r.state == PeerState::Connected)
            .count()
    }

    pub fn count(&self, state: PeerState) -> usize {
        self.ranks.values().filter(|r| r.state == state).count()
    }

    /// The tag keys of a connected rank.
    pub fn keys(&self, rank: RankId) -> Option<TagKeys> {
        self.ranks
            .get(&rank)
            .filter(|r| r.state == PeerState::Connected)
            .and_then(|r| r.keys)
    }

    /// May `info`'s rank be bound to `peer` without more proof? Yes unless another live
    /// endpoint holds it.
    pub fn may_bind(&self, info: &PeerInfo, peer: P) -> bool {
        match self.ranks.get(&info.rank) {
            Some(r) if r.state == PeerState::Connected => r.peer == Some(peer),
            _ => true,
        }
    }

    /// The session this side holds (or held) with `rank`: a redial proves it holds it.
    pub fn session(&self, rank: RankId) -> Option<SessionKey> {
        self.ranks.get(&rank).and_then(|r| r.session)
    }

    /// The sessions a redial from `rank`'s process, whose handshake here began at `started`,
    /// may prove to be taken as that process coming back: the pair's session, and the one
    /// proved by the redial that last rebound the rank ([`Peers::rebound_proving`]). A dialler
    /// whose redial's `Welcome` was lost (the redial's connection broke after its `Proof`
    /// arrived here) still holds the session it proved, not the one the redial made, and
    /// proves it again on its next try. That one is taken only from a handshake begun here
    /// after the rebind (strictly: a pass's events share one clock read) and within
    /// [`HANDSHAKE_LIMIT`] of it. One begun before: [`Peers::lost_to_rebind`].
    pub(crate) fn held_sessions(
        &self,
        rank: RankId,
        started: Option<Instant>,
        now: Instant,
    ) -> [Option<SessionKey>; 2] {
        let Some(r) = self.ranks.get(&rank) else {
            return [None, None];
        };
        let fresh = r.bound_at.is_some_and(|b| {
            started.is_some_and(|s| s > b) && now.saturating_duration_since(b) < HANDSHAKE_LIMIT
        });
        [r.session, r.proved.filter(|_| fresh)]
    }

    /// The session proved by the redial that last rebound `rank`, if a handshake begun here at
    /// `started` began no later than that rebind: a dial of that process which proves it lost
    /// to the dial that rebound (the process's `connect` and its reconnect round dialled at
    /// once), and is refused without a count.
    pub(crate) fn lost_to_rebind(
        &self,
        rank: RankId,
        started: Option<Instant>,
    ) -> Option<SessionKey> {
        let r = self.ranks.get(&rank)?;
        let before = started.zip(r.bound_at).is_some_and(|(s, b)| s <= b);
        r.proved.filter(|_| before)
    }

    /// `rank` was just rebound by a redial that proved `proved` (see
    /// [`Peers::held_sessions`]).
    pub(crate) fn rebound_proving(&mut self, rank: RankId, proved: SessionKey) {
        if let Some(r) = self.ranks.get_mut(&rank) {
            r.proved = Some(proved);
        }
    }

    /// A handshake starts on `peer` at `now` (dialled here, or the first message of a dialler).
    pub fn handshake_started(&mut self, peer: P, now: Instant) {
        self.pending.entry(peer).or_insert(now);
    }

    /// A peer connected to this side on `peer`: through a listener (`from` None), or by this
    /// side's worker address, giving its own (`from`, see [`Peers::moving`]).
    pub fn accepted(&mut self, peer: P, from: Option<String>, now: Instant) {
        self.handshake_started(peer, now);
        self.came_from.insert(peer, from);
    }

    /// A finished handshake on `peer`: bind its rank with the session's tag keys. Returns the
    /// endpoints to close: the one it replaced, and other dials still running for the rank.
    pub fn bind(&mut self, info: PeerInfo, peer: P, me: RankId, session: SessionKey) -> Vec<P> {
        // A round's dial that found another rank at the address: the rank it was for is woken
        // (a `connect` may wait for that dial) and its round goes on; the rank found is one
        // this side dialled there, redialled there when its connection breaks, as if a
        // `connect` had found it (found by review: it kept no address, and neither side ever
        // dialled it again).
        let found_at = match self.dialling.remove(&peer) {
            Some((dialled, at)) if dialled != info.rank => {
                self.wake(dialled);
                at
            }
            _ => None,
        };
        self.pending.remove(&peer);
        let from = self.came_from.remove(&peer);
        let dialled_at = self.connect_dials.remove(&peer).or(found_at);
        let rank = info.rank;
        // Bound: no redial of the rank is owed to us. (A dial of ours that won a tie and breaks
        // now finds the rank connected: `connect` returns it.)
        self.won_tie.remove(&peer);
        self.redial_of.remove(&peer);
        // Bound on our own dial, nothing is owed. Bound on the peer's dial, a dial of ours that
        // gave way to it still waits, and is owed a redial should this connection break
        // (`note_lost_answer`): the peer's `Proof` can come after its refusal of our dial, and
        // the break after the bind (crossing_dials under the sanitizer).
        if from.is_none() {
            self.gave_way_to.remove(&rank);
        }
        self.expect_redial.remove(&rank);
        self.forgotten_instances.remove(&rank);
        let r = self.ranks.entry(rank).or_insert(Rank {
            peer: None,
            name: String::new(),
            state: PeerState::Unknown,
            dial: None,
            dial_back: None,
            by_dial_back: false,
            instance: None,
            answered: false,
            bound_at: None,
            session: None,
            proved: None,
            keys: None,
            tries: 0,
            next_try: None,
            failed_at: None,
        });
        r.answered = from.is_some();
        r.bound_at = None;
        if let Some(address) = dialled_at.filter(|_| from.is_none()) {
            // A `connect`'s dial, bound now (perhaps after that call gave up): redialled there.
            r.dial = Some(address);
        } else if r.instance.is_some_and(|i| i != info.instance)
            && r.dial.as_deref().is_some_and(is_worker_address)
        {
            // Another process holds the rank now, and it came by a dial of its own: the
            // worker address this side dialled ended with the old one. Dialled there, the new
            // one is never reached, and (kept as an address of ours) it is not dialled back
            // after a move of this side either (found by review).
            r.dial = None;
        }
        if let Some(from) = from {
            // The same process, which this side dials at a worker address, came back from
            // another one (it moved): that is where it lives now.
            let same = r.instance == Some(info.instance);
            if let Some(a) = from.as_ref().filter(|_| same) {
                if r.dial.as_deref().is_some_and(is_worker_address) {
                    r.dial = Some(a.clone());
                }
            }
            r.dial_back = from;
        }
        r.instance = Some(info.instance);
        r.by_dial_back = false;
        let old = r.peer.filter(|p| *p != peer);
        r.peer = Some(peer);
        r.name = info.name;
        r.session = Some(session);
        r.proved = None;
        r.keys = Some(TagKeys {
            inbound: session.tag_key(rank, me),
            outbound: session.tag_key(me, rank),
        });
        r.state = PeerState::Connected;
        r.tries = 0;
        r.next_try = None;
        let mut close: Vec<P> = self
            .dialling
            .iter()
            .filter(|(_, (r, _))| *r == rank)
            .map(|(p, _)| *p)
            .collect();
        for p in &close {
            self.dialling.remove(p);
            self.handshakes.remove(p);
        }
        if let Some(old) = old {
            self.rank_of.remove(&old);
            self.handshakes.remove(&old);
            close.push(old);
        }
        self.rank_of.insert(peer, rank);
        self.wake(rank);
        close
    }

    /// The handshake on `peer` was refused (`by_peer`: the peer refused us). Unbinds whatever
    /// the endpoint held and schedules its close. Returns the rank that lost its endpoint.
    pub fn refuse(
        &mut self,
        peer: P,
        reason: Refusal,
        by_peer: bool,
        now: Instant,
    ) -> Option<RankId> {
        match (by_peer, reason) {
            (true, _) => self.refusals.by_peer += 1,
            (false, Refusal::AuthFailed) => self.refusals.auth += 1,
            (false, Refusal::RankInUse) => self.refusals.rank_in_use += 1,
            (false, Refusal::WireVersion) => self.refusals.version += 1,
        }
        self.end_refused(peer, reason, by_peer, now)
    }

    /// [`Peers::refuse`] without counting it: the refusal that settles two crossing dials
    /// (`binding`) is the protocol working, not a peer turned away.
    fn end_refused(
        &mut self,
        peer: P,
        reason: Refusal,
        by_peer: bool,
        now: Instant,
    ) -> Option<RankId> {
        self.refused.insert(peer, (reason, now));
        self.refused_order.push_back((now, peer));
        self.won_tie.remove(&peer);
        self.redial_of.remove(&peer);
        // A peer that refused us has nothing more to say: close at once. Our own `Refuse` gets
        // a moment to reach the peer first.
        let at = if by_peer { now } else { now + REFUSE_LINGER };
        self.closing.push((peer, at));
        self.end_round_dial(peer);
        self.pending.remove(&peer);
        self.came_from.remove(&peer);
        self.connect_dials.remove(&peer);
        let rank = self.rank_of.remove(&peer)?;
        let r = self.ranks.get_mut(&rank)?;
        if r.peer == Some(peer) {
            r.peer = None;
            r.state = PeerState::Failed;
            self.failed(rank);
        }
        self.wake(rank);
        Some(rank)
    }

    /// `rank` has just become `Failed`: if nobody here dials it, it joins the ranks that
    /// `Peers::forget_failed` may forget.
    fn failed(&mut self, rank: RankId) {
        let Some(r) = self.ranks.get_mut(&rank) else {
            return;
        };
        if r.dial.is_some() || r.by_dial_back {
            return;
        }
        self.failed_count += 1;
        r.failed_at = Some(self.failed_count);
        self.failed_order.push_back((rank, self.failed_count));
        self.forget_failed();
    }

    /// Bounds the `Failed` ranks that nobody here dials: once twice [`FAILED_KEPT`] have failed
    /// since the last look, those still `Failed` beyond the newest [`FAILED_KEPT`] are forgotten
    /// whole (name, addresses, session), the ones that failed first, as if never bound. Such a
    /// rank's state reads `Unknown` from then on, and a process that dials in with it later
    /// binds it afresh. Amortised O(1) a failure.
    fn forget_failed(&mut self) {
        if self.failed_order.len() <= 2 * FAILED_KEPT {
            return;
        }
        let ranks = &self.ranks;
        let dialling = &self.dialling;
        let forgettable = |rank: &RankId, at: &u64| {
            ranks.get(rank).is_some_and(|r| {
                r.state == PeerState::Failed
                    && r.peer.is_none()
                    && r.dial.is_none()
                    && !r.by_dial_back
                    && r.failed_at == Some(*at)
            }) && !dialling.values().any(|(d, _)| d == rank)
        };
        self.failed_order.retain(|(rank, at)| forgettable(rank, at));
        while self.failed_order.len() > FAILED_KEPT {
            let Some((rank, _)) = self.failed_order.pop_front() else {
                break;
            };
            if let Some(instance) = self.ranks.remove(&rank).and_then(|r| r.instance) {
                self.forgotten_instances
                    .insert(rank, (instance, self.forgotten));
                self.forgotten_order.push_back((rank, self.forgotten));
                if self.forgotten_order.len() > FORGOTTEN_KEPT {
                    if let Some((old, n)) = self.forgotten_order.pop_front() {
                        // Unless that rank was forgotten again since (a newer entry).
                        if self
                            .forgotten_instances
                            .get(&old)
                            .is_some_and(|&(_, m)| m == n)
                        {
                            self.forgotten_instances.remove(&old);
                        }
                    }
                }
            }
            self.forgotten += 1;
        }
    }

    /// Why the handshake on `peer` was refused (either way), if it was, within REFUSED_KEEP.
    pub fn refusal(&self, peer: P) -> Option<Refusal> {
        self.refused.get(&peer).map(|&(r, _)| r)
    }

    /// Forgets refusals older than REFUSED_KEEP, and the oldest past REFUSED_MAX: a pop per
    /// refusal, in the order they came.
    fn expire_refusals(&mut self, now: Instant) {
        while let Some(&(at, peer)) = self.refused_order.front() {
            if now.saturating_duration_since(at) < REFUSED_KEEP
                && self.refused_order.len() <= REFUSED_MAX
            {
                break;
            }
            self.refused_order.pop_front();
            // Only the entry this slot put in (a later refusal of the same id keeps its own).
            if self.refused.get(&peer).is_some_and(|&(_, t)| t == at) {
                self.refused.remove(&peer);
            }
        }
    }

    /// Endpoints due to be closed at `now`: refused ones after their linger, and those whose
    /// handshake is not done within HANDSHAKE_LIMIT. Also forgets old refusals.
    pub fn due_closes(&mut self, now: Instant) -> Vec<P> {
        self.expire_refusals(now);
        expire(&mut self.gave_way, now, REFUSED_KEEP, |&(_, t)| t);
        expire(&mut self.timed_out, now, REFUSED_KEEP, |&t| t);
        expire(&mut self.won_tie, now, REFUSED_KEEP, |w| w.at);
        expire(&mut self.lost_answers, now, HANDSHAKE_LIMIT, |&(_, t)| t);
        expire(&mut self.gave_way_to, now, HANDSHAKE_LIMIT, |&t| t);
        expire(&mut self.expect_redial, now, HANDSHAKE_LIMIT, |&t| t);
        // A dial handed out is made or given up within its wait (the engine's is 10 s, from
        // when its thread starts); this only keeps a lost report from holding the rank's rounds
        // off for good, so it waits twice that (and a `connect` waiting for it is told).
        if !self.round_starting.is_empty() {
            let lost: Vec<RankId> = self
                .round_starting
                .iter()
                .filter(|&(_, (t, _))| now.saturating_duration_since(*t) >= 2 * HANDSHAKE_LIMIT)
                .map(|(r, _)| *r)
                .collect();
            for rank in lost {
                self.round_starting.remove(&rank);
                self.wake(rank);
            }
        }
        let (due, keep): (Vec<_>, Vec<_>) = self.closing.iter().partition(|(_, t)| *t <= now);
        self.closing = keep;
        let mut out: Vec<P> = due.into_iter().map(|(p, _)| p).collect();
        let stale: Vec<P> = self
            .pending
            .iter()
            .filter(|(_, t)| now.saturating_duration_since(**t) >= HANDSHAKE_LIMIT)
            .map(|(p, _)| *p)
            .collect();
        for p in stale {
            self.pending.remove(&p);
            self.end_round_dial(p);
            self.came_from.remove(&p);
            self.connect_dials.remove(&p);
            // Its handshake stays as it is until the failure is reported (`on_failed` reads it
            // for whom to wake), but takes no more frames.
            self.timed_out.insert(p, now);
            out.push(p);
        }
        out
    }

    /// Refuses the handshake on `peer` for a frame of another wire version: returns the refusal
    /// to send, in the one frame every version reads. The endpoint is closed after the
    /// refusal's linger, as for any refusal of ours. None (nothing changes, the frame is a bad
    /// one) where there is no handshake to refuse: the endpoint is bound, refused already, or
    /// handed out to be closed for running past [`HANDSHAKE_LIMIT`] (as `on_handshake` drops
    /// every frame there).
    pub fn refuse_version(&mut self, peer: P, challenge: u64, now: Instant) -> Option<Message> {
        // Refused already: its record (kept for a while, at most REFUSED_MAX) or, once a flood
        // of refusals has pushed that out while the endpoint still lingers, its handshake.
        let refused = self.refusal(peer).is_some()
            || self
                .handshakes
                .get(&peer)
                .is_some_and(|h| h.refused().is_some());
        if self.rank_of(peer).is_some() || refused || self.timed_out.contains_key(&peer) {
            return None;
        }
        let mut hs = self
            .handshakes
            .remove(&peer)
            .unwrap_or_else(|| Handshake::answer(challenge));
        // A dial of ours that gave way to this handshake waits for it.
        let rank = hs.answered_peer().or(hs.dialled_peer()).map(|p| p.rank);
        let refusal = hs.refuse(Refusal::WireVersion);
        self.handshakes.insert(peer, hs);
        self.refuse(peer, Refusal::WireVersion, false, now);
        if let Some(rank) = rank {
            self.wake(rank);
        }
        Some(refusal)
    }

    /// The ranks whose connection facts changed since the last call, for the engine to wake
    /// their waiters (`WaitKey::Peer`): a rank bound, unbound, lost, given way to, or given up
    /// by its reconnect round; a dial of ours refused; a reconnect dial made, not made, ended
    /// or closed unanswered, or its hand-out lost. The engine wakes its waiters on a rank
    /// (`connect`, `wait_peer`, `advertise`) from this alone.
    pub fn take_wakes(&mut self) -> Vec<RankId> {
        std::mem::take(&mut self.wakes)
    }

    fn wake(&mut self, rank: RankId) {
        if self.wakes.last() != Some(&rank) {
            self.wakes.push(rank);
        }
    }

    /// Remembers that a reconnect round dialled `rank` through `peer` (at the address
    /// [`Peers::due`] gave; the rank's own addresses are not changed here: a bind may have
    /// updated them meanwhile).
    pub fn dialled(&mut self, rank: RankId, peer: P) {
        let at = self.round_starting.remove(&rank).map(|(_, a)| a);
        self.dialling.insert(peer, (rank, at));
        self.wake(rank);
    }

    /// The dial a reconnect round handed out for `rank` ([`Peers::due`]) was not made (the
    /// transport refused it, or its endpoint failed before it was recorded).
    pub fn round_dial_void(&mut self, rank: RankId) {
        self.round_starting.remove(&rank);
        self.wake(rank);
    }

    /// Ends the reconnect round's dial on `peer`, if it is one: its rank, named to wake (a
    /// `connect` may wait for that dial, [`Peers::round_dialling`]).
    fn end_round_dial(&mut self, peer: P) -> Option<RankId> {
        let (rank, _) = self.dialling.remove(&peer)?;
        self.wake(rank);
        Some(rank)
    }

    /// The rank a reconnect round's dial on `peer` is for, while that dial runs.
    pub fn round_dial(&self, peer: P) -> Option<RankId> {
        self.dialling.get(&peer).map(|(r, _)| *r)
    }

    /// A `connect` to `address` begins: until [`Peers::connect_ends`], no reconnect round
    /// dials a rank at that address, so that this side never has two dials out to one rank (the
    /// other side would bind one and then, taking the other as the same process proving the
    /// session again, rebind to it, while this side bound the first: one more round). Call
    /// [`Peers::round_dialling`] next: a round's dial already out is joined, not doubled.
    pub fn connect_begins(&mut self, address: &str) {
        *self.connects.entry(address.to_string()).or_insert(0) += 1;
    }

    /// The `connect` to `address` that [`Peers::connect_begins`] counted has returned.
    pub fn connect_ends(&mut self, address: &str) {
        if let Some(n) = self.connects.get_mut(address) {
            *n -= 1;
            if *n == 0 {
                self.connects.remove(address);
            }
        }
    }

    /// The rank a reconnect round is dialling at `address` now (its dial handed out or
    /// running): a `connect` to that address waits for that dial instead of making its own.
    pub fn round_dialling(&self, address: &str) -> Option<RankId> {
        let dialling = |rank: &RankId| {
            self.round_starting.contains_key(rank) || self.dialling.values().any(|(r, _)| r == rank)
        };
        self.ranks
            .iter()
            .filter(|(_, r)| r.state == PeerState::Reconnecting)
            .filter(|(_, r)| r.round_address().is_some_and(|a| a == address))
            .map(|(rank, _)| *rank)
            .find(dialling)
    }

    /// A `connect` dialled `address` on `peer`: should a handshake there bind after that call
    /// returned, the rank is still redialled at `address` when its connection breaks.
    pub fn connect_dialled(&mut self, peer: P, address: &str) {
        self.connect_dials.insert(peer, address.to_string());
    }

    /// After `connect` learned the rank behind an address.
    pub fn set_dial(&mut self, rank: RankId, address: &str) {
        if let Some(r) = self.ranks.get_mut(&rank) {
            r.dial = Some(address.to_string());
        }
    }

    /// A dial of `rank` (process `instance`) to this side broke, before or after its bind.
    fn note_lost_answer(&mut self, rank: RankId, instance: u64, now: Instant) {
        if self.lost_answers.len() < LOST_ANSWERS_MAX || self.lost_answers.contains_key(&rank) {
            self.lost_answers.insert(rank, (instance, now));
        }
        if self.gave_way_to.contains_key(&rank) {
            // A dial of ours waits for this one: the rank dials again.
            self.expect_redial.insert(rank, now);
        }
    }

    /// The transport reported `peer` failed. Returns the rank that lost its live endpoint.
    pub fn on_failed(&mut self, peer: P, now: Instant) -> Option<RankId> {
        self.redial_of.remove(&peer);
        self.timed_out.remove(&peer);
        let hs = self.handshakes.remove(&peer);
        // A handshake's rank (a dial that gave way to it waits), a reconnect dial's (a
        // `connect` may wait for it), and below the rank that lost its endpoint.
        let shaking = hs
            .as_ref()
            .and_then(|h| h.answered_peer().or(h.dialled_peer()));
        if let Some(rank) = shaking.map(|p| p.rank) {
            self.wake(rank);
        }
        let answered = hs.and_then(|h| h.answered_peer().cloned());
        if let Some(p) = answered {
            // Unproven (a `Hello` alone; docs/SECURITY.md says what a stranger can do with it).
            self.note_lost_answer(p.rank, p.instance, now);
        }
        self.pending.remove(&peer);
        self.came_from.remove(&peer);
        self.connect_dials.remove(&peer);
        if self.end_round_dial(peer).is_some() {
            // A reconnect attempt failed; the next try is already scheduled.
            return None;
        }
        let rank = self.rank_of.remove(&peer)?;
        let r = self.ranks.get_mut(&rank)?;
        if r.peer != Some(peer) {
            return None;
        }
        r.peer = None;
        self.failures += 1;
        // The peer's own dial was the bound connection: noted below.
        let lost_answer = r.instance.filter(|_| r.answered);
        if r.dial.is_some() || r.by_dial_back {
            // Not at once: a peer that is shutting down (the common case of a failure seen on
            // a healthy machine) has a moment to close its listener first.
            r.state = PeerState::Reconnecting;
            r.tries = 0;
            r.next_try = Some(now + FIRST_BACKOFF);
        } else {
            r.state = PeerState::Failed;
            self.failed(rank);
        }
        if let Some(instance) = lost_answer {
            self.note_lost_answer(rank, instance, now);
        }
        self.wake(rank);
        Some(rank)
    }

    /// [`Peers::on_failed`] for the connection of a peer that said it leaves (its engine ends).
    /// A reconnect round is kept only where a new engine may answer: a listener's `ip:port`,
    /// where a process builds its next engine. A worker address ends with the engine that had
    /// it (its successor has a new one), so a rank reached by one reads `Failed` at once and
    /// forgets that address: nothing redials it, and a request to it fails at once instead of
    /// waiting for a round that cannot succeed (6 dials, about 3 s). A `connect` to the new
    /// engine's address binds the rank again.
    pub fn on_left(&mut self, peer: P, now: Instant) -> Option<RankId> {
        let rank = self.on_failed(peer, now)?;
        let r = self.ranks.get_mut(&rank)?;
        if r.state == PeerState::Reconnecting
            && r.round_address().is_some_and(|a| is_worker_address(a))
        {
            r.state = PeerState::Failed;
            r.next_try = None;
            r.by_dial_back = false;
            if r.dial.as_deref().is_some_and(is_worker_address) {
                r.dial = None;
            }
            if r.dial_back.as_deref().is_some_and(is_worker_address) {
                r.dial_back = None;
            }
            self.failed(rank);
        }
        Some(rank)
    }

    /// This side moves to a new transport worker: every endpoint fails next (reported after
    /// this), and the worker address changes. Connected ranks that dialled this side by worker
    /// address, and that this side does not dial itself, know nothing of it: when their
    /// endpoint's failure comes, a reconnect round dials each at its dial-back address (not
    /// ranks that had failed before: they were not cut off by the move). Returns how many.
    pub fn moving(&mut self) -> usize {
        let mut n = 0;
        for r in self.ranks.values_mut() {
            if r.state == PeerState::Connected && r.dial.is_none() && r.dial_back.is_some() {
                r.by_dial_back = true;
                n += 1;
            }
        }
        n
    }

    /// Starts a fresh reconnect round for a `Failed` rank this side can dial. True if it did.
    pub fn revive(&mut self, rank: RankId, now: Instant) -> bool {
        match self.ranks.get_mut(&rank) {
            Some(r) if r.state == PeerState::Failed && r.dial.is_some() => {
                r.state = PeerState::Reconnecting;
                r.tries = 0;
                r.next_try = Some(now);
                true
            }
            _ => false,
        }
    }

    /// This side is going away: from now on no rank is due for a dial, and [`Peers::next_due`]
    /// names no try (a try kept in the past would make every pass of its caller due). The
    /// ranks keep their states; closes are still due.
    pub fn stop_dialling(&mut self) {
        self.dialling_stopped = true;
    }

    /// The ranks due for a dial attempt at `now`, with their addresses; each attempt is counted
    /// and the next one scheduled (or the rank given up as `Failed`). None once dialling stopped.
    pub fn due(&mut self, now: Instant) -> Vec<(RankId, String)> {
        let (mut out, mut given_up) = (Vec::new(), Vec::new());
        if self.dialling_stopped {
            return out;
        }
        // One dial at a time per rank: attempts that pile up behind a partition would all
        // connect when it heals, and each would replace the one before.
        let busy: std::collections::HashSet<RankId> =
            self.dialling.values().map(|(r, _)| *r).collect();
        // And one at a time per address: two ranks may share one (a round's dial found another
        // rank at the address it was for, and both rounds run), and two dials at once to one
        // process make it bind one and rebind to the other (found by review).
        let mut at: std::collections::HashSet<String> = self
            .dialling
            .values()
            .filter_map(|(_, a)| a.clone())
            .chain(self.round_starting.values().map(|(_, a)| a.clone()))
            .collect();
        for (rank, r) in self.ranks.iter_mut() {
            if r.state != PeerState::Reconnecting || r.next_try.is_none_or(|t| t > now) {
                continue;
            }
            // A `connect` to its address dials it instead (`Peers::connect_begins`); neither
            // is the try counted.
            let connecting = || {
                r.round_address()
                    .is_some_and(|a| self.connects.contains_key(a.as_str()))
            };
            let shared = || r.round_address().is_some_and(|a| at.contains(a));
            if busy.contains(rank)
                || self.round_starting.contains_key(rank)
                || connecting()
                || shared()
            {
                r.next_try = Some(now + FIRST_BACKOFF);
                continue;
            }
            if r.tries >= MAX_TRIES {
                r.state = PeerState::Failed;
                r.next_try = None;
                r.by_dial_back = false;
                given_up.push(*rank);
                continue;
            }
            r.tries += 1;
            r.next_try = Some(now + FIRST_BACKOFF * (1 << (r.tries - 1).min(8)));
            if let Some(a) = r.round_address() {
                out.push((*rank, a.clone()));
                self.round_starting.insert(*rank, (now, a.clone()));
                at.insert(a.clone());
            }
        }
        self.reconnects += out.len() as u64;
        for rank in given_up {
            // `advertise` waits for a round: it ended.
            self.failed(rank);
            self.wake(rank);
        }
        out
    }

    /// When the next dial attempt or close is due, if any.
    pub fn next_due(&self) -> Option<Instant> {
        self.ranks
            .values()
            .filter(|r| r.state == PeerState::Reconnecting && !self.dialling_stopped)
            .filter_map(|r| r.next_try)
            .chain(self.closing.iter().map(|(_, t)| *t))
            .chain(self.pending.values().map(|t| *t + HANDSHAKE_LIMIT))
            .min()
    }
}

/// How a rank's address names a transport worker: this prefix, then the worker address in hex.
pub const WORKER_ADDRESS_PREFIX: &str = "ucx:";

/// Whether `address` names a transport worker (`ucx:<hex>`, which changes when that process
/// moves to a new worker) rather than a listener (`ip:port`, which stays).
pub fn is_worker_address(address: &str) -> bool {
    address.starts_with(WORKER_ADDRESS_PREFIX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::{Party, Secret};

    const ME: RankId = RankId(1);
    const R: RankId = RankId(7);

    fn info(rank: RankId) -> PeerInfo {
        PeerInfo {
            rank,
            name: format!("rank{}", rank.0),
            instance: 42,
        }
    }

    fn session(challenge: u64) -> SessionKey {
        let party = |rank, challenge| Party {
            rank,
            instance: 1,
            challenge,
        };
        SessionKey::derive(&Secret::none(), party(ME, challenge), party(R, 2))
    }

    /// A table where this side dialled `R` at "addr" on endpoint 10 and bound it.
    fn dialled_and_bound(now: Instant) -> Peers<u64> {
        let mut p = Peers::default();
        p.handshake_started(10, now);
        let closed = p.bind(info(R), 10, ME, session(1));
        assert!(closed.is_empty());
        p.set_dial(R, "addr");
        p
    }

    /// A `connect`'s dial that binds after the call returned (at its deadline) is still the
    /// rank's dial: a failure then starts a reconnect round to the address it dialled. One
    /// that fails before it binds, or a dial that gave way, leaves nothing behind.
    #[test]
    fn a_connect_dial_that_binds_after_the_call_returned_is_redialled() {
        let t0 = Instant::now();
        let mut p: Peers<u64> = Peers::default();
        p.handshake_started(10, t0);
        p.connect_dialled(10, "addr");
        // The call returned here (no set_dial); the handshake binds later.
        assert!(p.bind(info(R), 10, ME, session(1)).is_empty());
        assert_eq!(p.on_failed(10, t0), Some(R));
        assert_eq!(p.state(R), PeerState::Reconnecting);
        // A connect dial that fails unbound is forgotten with its endpoint.
        let mut q: Peers<u64> = Peers::default();
        q.handshake_started(11, t0);
        q.connect_dialled(11, "addr");
        assert_eq!(q.on_failed(11, t0), None);
        assert!(q.connect_dials.is_empty());
        // Bound on the peer's dial (an accepted endpoint): not this side's to redial.
        let mut a: Peers<u64> = Peers::default();
        a.accepted(12, None, t0);
        a.connect_dialled(12, "addr");
        a.bind(info(R), 12, ME, session(2));
        assert_eq!(a.on_failed(12, t0), Some(R));
        assert_eq!(a.state(R), PeerState::Failed);
    }

    /// Ranks that dial this side, bind and fail, one after another, without end (any process
    /// that can connect, or any member with a secret, can do it): the table keeps at most twice
    /// `FAILED_KEPT` of them, forgets the ones that failed first, and leaves ranks this side
    /// dials and live ones alone. A forgotten rank reads `Unknown` and binds afresh.
    #[test]
    fn failed_ranks_nobody_dials_are_forgotten_past_a_bound_oldest_first() {
        let t0 = Instant::now();
        let mut p = dialled_and_bound(t0);
        // A failed rank this side dials (being redialled), and a live answered rank.
        assert_eq!(p.on_failed(10, t0), Some(R));
        p.accepted(11, None, t0);
        p.bind(info(RankId(8)), 11, ME, session(2));
        let n = 3 * FAILED_KEPT as u64;
        for i in 0..n {
            let (peer, rank) = (100 + i, RankId(1000 + i as u32));
            let t = t0 + Duration::from_micros(i);
            p.accepted(peer, None, t);
            p.bind(info(rank), peer, ME, session(3));
            assert_eq!(p.on_failed(peer, t), Some(rank));
            assert!(
                p.ranks.len() <= 2 * FAILED_KEPT + 3,
                "{i}: {}",
                p.ranks.len()
            );
        }
        assert!(p.forgotten >= n - 2 * FAILED_KEPT as u64, "{}", p.forgotten);
        assert_eq!(p.state(RankId(1000)), PeerState::Unknown);
        assert_eq!(p.name(RankId(1000)), None);
        assert_eq!(p.state(RankId(1000 + n as u32 - 1)), PeerState::Failed);
        assert_eq!(p.state(R), PeerState::Reconnecting);
        assert_eq!(p.state(RankId(8)), PeerState::Connected);
        // A forgotten rank that dials in again is bound afresh.
        p.accepted(5, None, t0 + Duration::from_secs(1));
        p.bind(info(RankId(1000)), 5, ME, session(4));
        assert_eq!(p.state(RankId(1000)), PeerState::Connected);
        // A rank failed and then bound again is not forgotten for its old failure.
        let again = RankId(1000 + n as u32 - 1);
        p.accepted(6, None, t0 + Duration::from_secs(1));
        p.bind(info(again), 6, ME, session(5));
        for i in 0..2 * FAILED_KEPT as u64 + 1 {
            let (peer, rank) = (1_000_000 + i, RankId(1_000_000 + i as u32));
            let t = t0 + Duration::from_secs(2);
            p.accepted(peer, None, t);
            p.bind(info(rank), peer, ME, session(3));
            p.on_failed(peer, t);
        }
        assert_eq!(p.state(again), PeerState::Connected);
        assert_eq!(p.state(RankId(1000)), PeerState::Connected);
    }

    /// A progress pass reads the clock once, so one rank can bind, fail, bind again on a new
    /// connection and fail again at the same instant: that is still one rank to forget. It
    /// is forgotten, and counted in `forgotten`, once.
    #[test]
    fn a_rank_failed_twice_at_one_instant_is_forgotten_and_counted_once() {
        let t0 = Instant::now();
        let mut p: Peers<u64> = Peers::default();
        let twice = RankId(500);
        for peer in [1, 2] {
            p.accepted(peer, None, t0);
            p.bind(info(twice), peer, ME, session(3));
            assert_eq!(p.on_failed(peer, t0), Some(twice));
        }
        let n = 2 * FAILED_KEPT as u64;
        for i in 0..n {
            let (peer, rank) = (100 + i, RankId(1000 + i as u32));
            let t = t0 + Duration::from_micros(i + 1);
            p.accepted(peer, None, t);
            p.bind(info(rank), peer, ME, session(3));
            assert_eq!(p.on_failed(peer, t), Some(rank));
        }
        let gone = (0..n)
            .map(|i| RankId(1000 + i as u32))
            .chain([twice])
            .filter(|r| p.state(*r) == PeerState::Unknown)
            .count() as u64;
        assert_eq!(p.state(twice), PeerState::Unknown);
        assert_eq!(p.forgotten, gone, "every rank forgotten counted once");
        // The look came with the failure before the last: the newest FAILED_KEPT then, and
        // the one failed since.
        assert_eq!(p.ranks.len(), FAILED_KEPT + 1);
    }

    #[test]
    fn a_bound_rank_is_connected_with_its_endpoint_and_keys() {
        let t0 = Instant::now();
        let p = dialled_and_bound(t0);
        assert_eq!(p.state(R), PeerState::Connected);
        assert_eq!(p.endpoint(R), Some(10));
        assert_eq!(p.rank_of(10), Some(R));
        assert_eq!(p.name(R).as_deref(), Some("rank7"));
        let keys = p.keys(R).expect("keys");
        let s = session(1);
        assert!(keys.inbound == s.tag_key(R, ME) && keys.outbound == s.tag_key(ME, R));
        assert_eq!(p.connected(), 1);
        assert_eq!(p.state(RankId(99)), PeerState::Unknown);
        // The handshake is done: nothing to close at the limit.
        assert!(p.next_due().is_none());
    }

    /// A side going away dials nobody, and names no try as due: a try left in the past kept
    /// the engine's progress thread waking on every pass through its drain.
    #[test]
    fn a_side_that_stopped_dialling_has_no_try_due_and_still_closes() {
        let t0 = Instant::now();
        let mut p = dialled_and_bound(t0);
        assert_eq!(p.on_failed(10, t0), Some(R));
        assert_eq!(p.next_due(), Some(t0 + FIRST_BACKOFF));
        p.stop_dialling();
        assert_eq!(p.next_due(), None, "no try is due once dialling stopped");
        let later = t0 + FIRST_BACKOFF * 4;
        assert!(p.due(later).is_empty(), "nobody is dialled");
        assert_eq!(
            p.state(R),
            PeerState::Reconnecting,
            "the rank keeps its state"
        );
        assert_eq!(p.reconnects, 0);
    }

    #[test]
    fn a_dialled_rank_that_fails_is_redialled_with_a_doubling_backoff_then_given_up() {
        let t0 = Instant::now();
        let mut p = dialled_and_bound(t0);
        assert_eq!(p.on_failed(10, t0), Some(R));
        assert_eq!(p.failures, 1);
        assert_eq!(p.state(R), PeerState::Reconnecting);
        assert_eq!(p.endpoint(R), None);
        // Not at once: the first try comes after the first back-off.
        assert!(p.due(t0).is_empty());
        assert_eq!(p.next_due(), Some(t0 + FIRST_BACKOFF));
        let mut now = t0 + FIRST_BACKOFF;
        let mut gaps = Vec::new();
        for try_no in 1..=MAX_TRIES {
            assert_eq!(p.due(now), vec![(R, "addr".to_string())], "try {try_no}");
            // Each attempt's endpoint fails before its handshake ends: that is not a new
            // failure of the rank, and the next try is already scheduled.
            let ep = 100 + try_no as u64;
            p.dialled(R, ep);
            assert_eq!(p.on_failed(ep, now), None);
            let next = p.next_due().expect("next try");
            gaps.push(next - now);
            now = next;
        }
        assert_eq!(p.reconnects, MAX_TRIES as u64);
        assert_eq!(p.failures, 1);
        let doubling: Vec<Duration> = (0..MAX_TRIES).map(|i| FIRST_BACKOFF * (1 << i)).collect();
        assert_eq!(gaps, doubling);
        // Out of tries: given up, nothing more due.
        assert!(p.due(now).is_empty());
        assert_eq!(p.state(R), PeerState::Failed);
        assert!(p.next_due().is_none());
        // A later use starts a fresh round at once.
        assert!(p.revive(R, now));
        assert_eq!(p.state(R), PeerState::Reconnecting);
        assert_eq!(p.due(now), vec![(R, "addr".to_string())]);
    }

    /// A peer that left (`Leaving`): a rank dialled at a listener's address keeps its round (a
    /// new engine may come up there), one dialled by worker address is `Failed` at once, with
    /// nothing due and nothing to revive, until a `connect` names a new address.
    #[test]
    fn a_rank_that_left_is_redialled_only_at_a_listeners_address() {
        let t0 = Instant::now();
        let mut p = dialled_and_bound(t0);
        p.set_dial(R, "10.0.0.1:5000");
        assert_eq!(p.on_left(10, t0), Some(R));
        assert_eq!(p.state(R), PeerState::Reconnecting);
        assert_eq!(p.failures, 1);
        let worker = format!("{WORKER_ADDRESS_PREFIX}0a0b");
        let mut p = dialled_and_bound(t0);
        p.set_dial(R, &worker);
        assert_eq!(p.on_left(10, t0), Some(R));
        assert_eq!(p.state(R), PeerState::Failed);
        assert_eq!(p.failures, 1);
        assert!(p.next_due().is_none());
        assert!(p.due(t0 + Duration::from_secs(10)).is_empty());
        assert!(!p.revive(R, t0), "nothing to dial");
        // A plain failure of a rank reached by worker address still gets its round.
        let mut p = dialled_and_bound(t0);
        p.set_dial(R, &worker);
        assert_eq!(p.on_failed(10, t0), Some(R));
        assert_eq!(p.state(R), PeerState::Reconnecting);
        // A rank that answered this side's dial (not dialled from here) is `Failed` either way.
        let mut p: Peers<u64> = Peers::default();
        p.accepted(11, None, t0);
        p.bind(info(RankId(8)), 11, ME, session(2));
        assert_eq!(p.on_left(11, t0), Some(RankId(8)));
        assert_eq!(p.state(RankId(8)), PeerState::Failed);
        // And an endpoint with no rank is none of this.
        assert_eq!(p.on_left(99, t0), None);
    }

    #[test]
    fn one_dial_at_a_time_per_rank_and_a_success_ends_the_round() {
        let t0 = Instant::now();
        let mut p = dialled_and_bound(t0);
        p.on_failed(10, t0);
        let t1 = t0 + FIRST_BACKOFF;
        assert_eq!(p.due(t1).len(), 1);
        p.dialled(R, 11);
        // The next try comes due while endpoint 11 still dials: it is put off, not doubled up.
        let t2 = p.next_due().unwrap();
        assert!(p.due(t2).is_empty());
        assert_eq!(p.reconnects, 1);
        // Endpoint 11's handshake ends: bound again, tries reset.
        assert!(p.bind(info(R), 11, ME, session(3)).is_empty());
        assert_eq!(p.state(R), PeerState::Connected);
        assert_eq!(p.endpoint(R), Some(11));
        assert!(p.due(t2 + Duration::from_secs(60)).is_empty());
        // A later failure starts from the first back-off again.
        p.on_failed(11, t2);
        assert_eq!(p.next_due(), Some(t2 + FIRST_BACKOFF));
    }

    #[test]
    fn a_connect_holds_the_round_off_and_joins_a_dial_the_round_has_out() {
        let t0 = Instant::now();
        let mut p = dialled_and_bound(t0);
        p.on_failed(10, t0);
        let t1 = t0 + FIRST_BACKOFF;
        // A `connect` to the rank's address runs: the round neither dials nor counts a try.
        p.connect_begins("addr");
        assert_eq!(p.round_dialling("addr"), None);
        assert!(p.due(t1).is_empty());
        assert_eq!(p.reconnects, 0);
        p.connect_ends("addr");
        let t2 = p.next_due().unwrap();
        assert_eq!(t2, t1 + FIRST_BACKOFF);
        // The round hands its dial out: from then a `connect` to that address joins it.
        assert_eq!(p.due(t2), vec![(R, "addr".to_string())]);
        assert_eq!(p.round_dialling("addr"), Some(R));
        assert_eq!(p.round_dialling("elsewhere"), None);
        p.dialled(R, 11);
        assert_eq!(
            (p.round_dialling("addr"), p.round_dial(11)),
            (Some(R), Some(R))
        );
        // It fails: nothing is dialling until the next try.
        assert_eq!(p.on_failed(11, t2), None);
        assert_eq!(p.round_dialling("addr"), None);
        // A dial handed out but never made (the transport refused it) ends the same way.
        let t3 = p.next_due().unwrap();
        assert_eq!(p.due(t3).len(), 1);
        assert_eq!(p.round_dialling("addr"), Some(R));
        assert!(
            p.due(p.next_due().unwrap()).is_empty(),
            "one dial at a time"
        );
        p.round_dial_void(R);
        assert_eq!(p.round_dialling("addr"), None);
        // Two `connect`s: the round waits for both to end.
        p.connect_begins("addr");
        p.connect_begins("addr");
        p.connect_ends("addr");
        assert!(p.due(p.next_due().unwrap()).is_empty());
        p.connect_ends("addr");
        // A round's dial left unanswered is closed at the handshake limit, and said so (a
        // `connect` waiting for it dials in its place).
        let t4 = p.next_due().unwrap();
        assert_eq!(p.due(t4).len(), 1);
        p.dialled(R, 13);
        p.handshake_started(13, t4);
        p.take_wakes();
        assert_eq!(p.due_closes(t4 + HANDSHAKE_LIMIT), vec![13]);
        assert_eq!(p.take_wakes(), vec![R]);
        assert!(p.take_wakes().is_empty());
        assert_eq!(p.round_dialling("addr"), None);
        // A bind by the round's dial ends the round.
        p.dialled(R, 12);
        p.handshake_started(12, t3);
        p.bind(info(R), 12, ME, session(3));
        assert_eq!(p.round_dialling("addr"), None);
        assert_eq!(p.state(R), PeerState::Connected);
    }

    #[test]
    fn every_end_of_a_round_dial_names_its_rank_to_wake() {
        let t0 = Instant::now();
        let mut p = dialled_and_bound(t0);
        assert_eq!(p.take_wakes(), vec![R], "bound");
        p.on_failed(10, t0);
        assert_eq!(p.take_wakes(), vec![R], "lost");
        let mut now = t0 + FIRST_BACKOFF;
        // Handed out, and its report lost: it expires (after twice the handshake limit).
        assert_eq!(p.due(now).len(), 1);
        assert!(p.take_wakes().is_empty());
        p.due_closes(now + HANDSHAKE_LIMIT);
        assert!(p.take_wakes().is_empty(), "not yet");
        now += 2 * HANDSHAKE_LIMIT;
        p.due_closes(now);
        assert_eq!(p.take_wakes(), vec![R], "expired");
        assert_eq!(p.round_dialling("addr"), None);
        // Made, then refused by the peer.
        now = p.next_due().unwrap();
        assert_eq!(p.due(now).len(), 1);
        p.dialled(R, 11);
        assert_eq!(p.take_wakes(), vec![R], "made");
        p.refuse(11, Refusal::AuthFailed, true, now);
        assert_eq!(p.take_wakes(), vec![R], "refused");
        assert_eq!(p.due_closes(now), vec![11]);
        // Made, then refused by this side for a frame of another wire version.
        now = p.next_due().unwrap();
        assert_eq!(p.due(now).len(), 1);
        p.dialled(R, 12);
        p.take_wakes();
        let m = p.refuse_version(12, 5, now);
        assert!(matches!(m, Some(Message::Refuse { .. })), "{m:?}");
        assert_eq!(p.take_wakes(), vec![R], "refused for its version");
        assert_eq!(p.refusal(12), Some(Refusal::WireVersion));
    }

    #[test]
    fn a_rank_this_side_was_dialled_by_is_failed_not_redialled() {
        let t0 = Instant::now();
        let mut p: Peers<u64> = Peers::default();
        p.handshake_started(5, t0);
        p.bind(info(R), 5, ME, session(1));
        assert_eq!(p.on_failed(5, t0), Some(R));
        assert_eq!(p.state(R), PeerState::Failed);
        assert!(!p.revive(R, t0), "nothing to dial");
        assert!(p.due(t0 + Duration::from_secs(60)).is_empty());
        // The same process comes back on a new endpoint: bound there.
        p.handshake_started(6, t0);
        p.bind(info(R), 6, ME, session(1));
        assert_eq!(p.endpoint(R), Some(6));
    }

    #[test]
    fn a_live_rank_is_not_bound_to_a_second_endpoint_without_proof() {
        let t0 = Instant::now();
        let p = dialled_and_bound(t0);
        assert!(p.may_bind(&info(R), 10), "its own endpoint");
        assert!(
            !p.may_bind(&info(R), 11),
            "another endpoint while 10 is live"
        );
        assert!(p.may_bind(&info(RankId(8)), 11), "a rank nobody holds");
        assert!(
            p.session(R).is_some(),
            "the proof a returning process must give"
        );
    }

    #[test]
    fn rebinding_a_rank_closes_the_endpoint_it_replaces_and_other_dials() {
        let t0 = Instant::now();
        let mut p = dialled_and_bound(t0);
        // Two dials for R are running (say a connect and a background redial).
        p.dialled(R, 20);
        p.dialled(R, 21);
        let mut closed = p.bind(info(R), 20, ME, session(4));
        closed.sort_unstable();
        assert_eq!(closed, vec![10, 21]);
        assert_eq!(p.endpoint(R), Some(20));
        assert_eq!(p.rank_of(10), None);
        // The replaced endpoint's failure, reported later, costs the rank nothing.
        assert_eq!(p.on_failed(10, t0), None);
        assert_eq!(p.state(R), PeerState::Connected);
    }

    /// A refusal is remembered for REFUSED_KEEP whatever else fails meanwhile (the table was
    /// once cleared whole past 1024 entries, so an endpoint still in its linger could be refused
    /// twice), then forgotten; past REFUSED_MAX the oldest go first.
    #[test]
    fn refusals_are_remembered_for_a_while_and_the_oldest_go_first() {
        let t0 = Instant::now();
        let mut p = dialled_and_bound(t0);
        for e in 100..2100 {
            p.refuse(e, Refusal::AuthFailed, false, t0);
        }
        // Other endpoints fail, and passes run, meanwhile.
        for e in 100..200 {
            p.on_failed(e, t0);
        }
        let _ = p.due_closes(t0 + Duration::from_secs(1));
        assert_eq!(p.refusal(100), Some(Refusal::AuthFailed));
        assert_eq!(p.refusal(2099), Some(Refusal::AuthFailed));
        // Endpoint 2099 is refused again later (an id the transport reused): the first slot's
        // expiry does not take the second refusal.
        let t1 = t0 + Duration::from_secs(30);
        p.refuse(2099, Refusal::RankInUse, true, t1);
        let _ = p.due_closes(t0 + REFUSED_KEEP);
        assert_eq!(p.refusal(100), None, "forgotten after REFUSED_KEEP");
        assert_eq!(p.refusal(2099), Some(Refusal::RankInUse));
        let _ = p.due_closes(t1 + REFUSED_KEEP);
        assert_eq!(p.refusal(2099), None);
        // A flood: past REFUSED_MAX the oldest are forgotten first, at once.
        let t2 = t1 + REFUSED_KEEP;
        let n = REFUSED_MAX as u64 + 100;
        for e in 0..n {
            p.refuse(10_000 + e, Refusal::AuthFailed, false, t2);
        }
        let _ = p.due_closes(t2);
        assert_eq!(p.refusal(10_000), None);
        assert_eq!(p.refusal(10_099), None);
        assert_eq!(p.refusal(10_100), Some(Refusal::AuthFailed));
        assert_eq!(p.refusal(10_000 + n - 1), Some(Refusal::AuthFailed));
        assert_eq!(p.refused.len(), REFUSED_MAX);
    }

    #[test]
    fn refusals_are_counted_both_ways_and_closed_after_their_linger() {
        let t0 = Instant::now();
        let mut p = dialled_and_bound(t0);
        // We refuse a stranger on endpoint 30: its Refuse gets REFUSE_LINGER to go out.
        p.handshake_started(30, t0);
        assert_eq!(p.refuse(30, Refusal::AuthFailed, false, t0), None);
        // A peer refuses us on endpoint 10 (bound to R): R loses it, closed at once.
        assert_eq!(p.refuse(10, Refusal::RankInUse, true, t0), Some(R));
        assert_eq!(p.state(R), PeerState::Failed);
        assert_eq!(p.refusal(30), Some(Refusal::AuthFailed));
        // A stranger of another wire version on endpoint 31 (no handshake began: its frames
        // were not read).
        assert_eq!(p.refuse(31, Refusal::WireVersion, false, t0), None);
        assert_eq!(
            (
                p.refusals.auth,
                p.refusals.rank_in_use,
                p.refusals.version,
                p.refusals.by_peer
            ),
            (1, 0, 1, 1)
        );
        assert_eq!(p.due_closes(t0), vec![10]);
        assert!(p.due_closes(t0 + REFUSE_LINGER / 2).is_empty());
        assert_eq!(p.due_closes(t0 + REFUSE_LINGER), vec![30, 31]);
        assert!(p.due_closes(t0 + REFUSE_LINGER * 2).is_empty());
    }

    #[test]
    fn an_endpoint_that_never_finishes_its_handshake_is_closed_at_the_limit() {
        let t0 = Instant::now();
        let mut p: Peers<u64> = Peers::default();
        p.handshake_started(40, t0);
        // A second start does not push the limit back.
        p.handshake_started(40, t0 + Duration::from_secs(5));
        assert_eq!(p.next_due(), Some(t0 + HANDSHAKE_LIMIT));
        assert!(p
            .due_closes(t0 + HANDSHAKE_LIMIT - Duration::from_millis(1))
            .is_empty());
        assert_eq!(p.due_closes(t0 + HANDSHAKE_LIMIT), vec![40]);
        assert!(p.next_due().is_none());
        // One that finishes in time is never closed.
        p.handshake_started(41, t0);
        p.bind(info(R), 41, ME, session(1));
        assert!(p.due_closes(t0 + HANDSHAKE_LIMIT * 2).is_empty());
    }

    #[test]
    fn a_peer_that_dialled_by_worker_address_is_dialled_back_after_a_move_only() {
        let t0 = Instant::now();
        let mut p: Peers<u64> = Peers::default();
        p.accepted(5, Some("ucx:aa".into()), t0);
        p.bind(info(R), 5, ME, session(1));
        assert_eq!(p.ranks[&R].dial_back.as_deref(), Some("ucx:aa"));
        // A plain failure: this side was dialled, so it waits (as before).
        assert_eq!(p.on_failed(5, t0), Some(R));
        assert_eq!(p.state(R), PeerState::Failed);
        assert!(p.due(t0 + Duration::from_secs(60)).is_empty());
        // A rank that failed before a move was not cut off by it: not dialled.
        assert_eq!(p.moving(), 0);
        assert_eq!(p.state(R), PeerState::Failed);
        // It comes back; then this side moves, and its endpoint fails with the move.
        p.accepted(6, Some("ucx:bb".into()), t0);
        p.bind(info(R), 6, ME, session(2));
        assert_eq!(p.moving(), 1);
        assert_eq!(p.on_failed(6, t0), Some(R));
        assert_eq!(p.state(R), PeerState::Reconnecting);
        let t1 = t0 + FIRST_BACKOFF;
        assert_eq!(p.due(t1), vec![(R, "ucx:bb".to_string())]);
        // The dial back does not make this side the rank's dialler.
        p.dialled(R, 7);
        assert!(p.bind(info(R), 7, ME, session(2)).is_empty());
        assert_eq!(p.endpoint(R), Some(7));
        assert_eq!(p.ranks[&R].dial, None);
        assert_eq!(p.ranks[&R].dial_back.as_deref(), Some("ucx:bb"));
        assert_eq!(p.on_failed(7, t1), Some(R));
        assert_eq!(
            p.state(R),
            PeerState::Failed,
            "waits again, as the dialled side"
        );
        assert!(
            !p.revive(R, t1),
            "a later use does not dial it: this side never did"
        );
    }

    #[test]
    fn a_dial_back_round_that_runs_out_of_tries_gives_the_rank_up_and_says_so() {
        let t0 = Instant::now();
        let mut p: Peers<u64> = Peers::default();
        p.accepted(5, Some("ucx:aa".into()), t0);
        p.bind(info(R), 5, ME, session(1));
        assert_eq!(p.moving(), 1);
        p.on_failed(5, t0);
        let mut now = t0 + FIRST_BACKOFF;
        for try_no in 0..MAX_TRIES {
            assert_eq!(p.due(now), vec![(R, "ucx:aa".to_string())]);
            // Each attempt's endpoint fails before its handshake ends.
            p.dialled(R, 10 + try_no as u64);
            assert_eq!(p.on_failed(10 + try_no as u64, now), None);
            now = p.next_due().unwrap();
        }
        p.take_wakes();
        assert!(p.due(now).is_empty());
        assert_eq!(p.state(R), PeerState::Failed);
        assert_eq!(p.take_wakes(), vec![R], "given up: its waiters are told");
        assert!(p.take_wakes().is_empty());
        // The next move does not dial it: it had failed already.
        assert_eq!(p.moving(), 0);
    }

    #[test]
    fn peers_from_a_listener_and_ranks_this_side_dials_are_not_dialled_back() {
        let t0 = Instant::now();
        let mut p = dialled_and_bound(t0);
        p.accepted(5, None, t0);
        p.bind(info(RankId(8)), 5, ME, session(1));
        // Rank 8 came through a listener, which keeps its port: it dials again by itself. R is
        // this side's to dial, reconnecting at its own address.
        assert_eq!(p.moving(), 0);
        p.on_failed(5, t0);
        p.on_failed(10, t0);
        assert_eq!(p.state(RankId(8)), PeerState::Failed);
        assert_eq!(p.due(t0 + FIRST_BACKOFF), vec![(R, "addr".to_string())]);
        // A rank that dialled by worker address once and through a listener since has no
        // dial-back address any more.
        let mut q: Peers<u64> = Peers::default();
        q.accepted(5, Some("ucx:aa".into()), t0);
        q.bind(info(R), 5, ME, session(1));
        q.on_failed(5, t0);
        q.accepted(6, None, t0);
        q.bind(info(R), 6, ME, session(1));
        assert_eq!(q.ranks[&R].dial_back, None);
        assert_eq!(q.moving(), 0);
    }

    #[test]
    fn a_rank_dialled_at_a_worker_address_that_comes_back_from_another_is_dialled_there() {
        let t0 = Instant::now();
        let mut p: Peers<u64> = Peers::default();
        p.handshake_started(10, t0);
        p.bind(info(R), 10, ME, session(1));
        p.set_dial(R, "ucx:old");
        // A redial of ours is under way when R (the same process) dials us back from its new
        // worker: the same session, a new endpoint.
        p.dialled(R, 12);
        p.accepted(11, Some("ucx:new".into()), t0);
        let mut closed = p.bind(info(R), 11, ME, session(1));
        closed.sort_unstable();
        assert_eq!(closed, vec![10, 12]);
        assert_eq!(p.on_failed(11, t0), Some(R));
        assert_eq!(p.due(t0 + FIRST_BACKOFF), vec![(R, "ucx:new".to_string())]);
        // A listener address is kept: it does not move.
        let mut q: Peers<u64> = Peers::default();
        q.handshake_started(10, t0);
        q.bind(info(R), 10, ME, session(1));
        q.set_dial(R, "10.0.0.1:5000");
        q.accepted(11, Some("ucx:new".into()), t0);
        q.bind(info(R), 11, ME, session(1));
        q.on_failed(11, t0);
        assert_eq!(
            q.due(t0 + FIRST_BACKOFF),
            vec![(R, "10.0.0.1:5000".to_string())]
        );
        // Another process with the rank (a new instance) that dials this side does not
        // redirect this side's dials, and the old process's worker address, which ended with
        // it, is not dialled any more: the new process is a rank that dialled this side, dialled
        // back at its own address after a move of this side (found by review: the old address
        // was dialled six times in vain, and the new process never reached).
        let mut o: Peers<u64> = Peers::default();
        o.handshake_started(10, t0);
        o.bind(info(R), 10, ME, session(1));
        o.set_dial(R, "ucx:old");
        o.on_failed(10, t0);
        o.accepted(11, Some("ucx:other".into()), t0);
        let other = PeerInfo {
            instance: 43,
            ..info(R)
        };
        o.bind(other.clone(), 11, ME, session(5));
        assert_eq!(o.ranks[&R].dial, None);
        assert_eq!(o.moving(), 1);
        o.on_failed(11, t0);
        assert_eq!(
            o.due(t0 + FIRST_BACKOFF),
            vec![(R, "ucx:other".to_string())]
        );
        // A listener address stays: a new process may listen there too.
        let mut l: Peers<u64> = Peers::default();
        l.handshake_started(10, t0);
        l.bind(info(R), 10, ME, session(1));
        l.set_dial(R, "10.0.0.1:5000");
        l.on_failed(10, t0);
        l.accepted(11, None, t0);
        l.bind(other, 11, ME, session(5));
        assert_eq!(l.ranks[&R].dial.as_deref(), Some("10.0.0.1:5000"));
        // An endpoint that fails before its handshake leaves nothing behind.
        q.accepted(12, Some("ucx:x".into()), t0);
        q.on_failed(12, t0);
        assert!(q.came_from.is_empty());
    }

    #[test]
    fn the_session_a_redial_proved_is_taken_only_after_its_rebind_and_for_a_while() {
        let t = Instant::now();
        let ms = |n| t + Duration::from_millis(n);
        let mut p = dialled_and_bound(t);
        // A redial rebound R at t, proving session 9.
        p.ranks.get_mut(&R).unwrap().bound_at = Some(t);
        p.rebound_proving(R, session(9));
        let older = |p: &Peers<u64>, started, now| p.held_sessions(R, Some(started), now)[1];
        // A handshake seen in the same pass as the rebind (one clock read) is not after it: it
        // lost to the redial.
        assert!(older(&p, t, t).is_none());
        assert!(p.lost_to_rebind(R, Some(t)).is_some());
        // One begun after it may prove it, within HANDSHAKE_LIMIT of the rebind.
        assert!(older(&p, ms(1), ms(1)).is_some());
        assert!(p.lost_to_rebind(R, Some(ms(1))).is_none());
        assert!(older(&p, ms(1), t + HANDSHAKE_LIMIT).is_none());
        // The pair's own session is always taken.
        assert!(p.held_sessions(R, Some(ms(1)), ms(1))[0].is_some());
        // A bind without a redial's proof forgets it.
        p.bind(info(R), 11, ME, session(3));
        p.ranks.get_mut(&R).unwrap().bound_at = Some(ms(2));
        assert!(older(&p, ms(3), ms(3)).is_none());
        assert!(p.lost_to_rebind(R, Some(ms(1))).is_none());
    }

    #[test]
    fn a_handshake_frame_on_a_bound_endpoint_does_not_get_it_closed_later() {
        // The handshake's start is taken at its first message: a later frame (here a `Hello`
        // on the bound endpoint, which only the peer can send) must not make the handshake
        // look new, or the handshake limit would close the live endpoint.
        let t = Instant::now();
        let mut p: Peers<u64> = Peers::default();
        p.accepted(10, None, t);
        p.handshakes.insert(10, crate::Handshake::answer(1));
        p.bind(info(R), 10, ME, session(1));
        let id = |rank, instance| crate::Identity {
            rank,
            name: "r".into(),
            instance,
            secret: Secret::none(),
        };
        let (_, hello) = crate::Handshake::dial(&id(R, 42), 5);
        let later = t + Duration::from_secs(1);
        let _ = p.on_handshake(&id(ME, 1), 10, hello, later, 7);
        assert!(p.due_closes(t + HANDSHAKE_LIMIT * 2).is_empty());
        assert_eq!(p.endpoint(R), Some(10));
    }
}
