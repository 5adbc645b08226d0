//! What a handshake step means for the peer table: bind the rank, refuse the endpoint, or let a
//! dial give way. The engine feeds every handshake message to [`Peers::on_handshake`] and
//! carries out the [`HandshakeAction`]s it returns.
//!
//! # Two ranks that dial each other at once
//! Over tcp that makes two connections, each with its own session (and so its own tag keys),
//! and the pair must end up on the same one on both sides. The answerer of a connection binds
//! first (on the dialler's `Proof`), the dialler on the `Welcome` after it. Left alone, each
//! side binds the connection the other dialled and then refuses its own dial's `Welcome`, which
//! unbinds the other side: both lose the pair. Three rules settle it, the same on both sides,
//! whatever the order in which the messages of the two connections arrive:
//! - **The lower rank's dial wins a tie.** An answerer whose own dial to the same process (the
//!   same rank and instance) has its proof out refuses the peer's dial if it has the lower
//!   rank. The higher rank answers the lower one's dial as any other. An answerer whose own
//!   dial bound the rank after the peer's dial began refuses that dial too, as the settling of
//!   a crossing (unless it proves the session of the bound one: the same process coming back,
//!   as after a move to a new worker). A dial that began after the bind is refused and counted
//!   as any second claim to a live rank.
//! - **A dial that finds the pair connected gives way.** A dialler that learns, from the
//!   answer, that the rank is already bound to the same process (by either side's dial) does
//!   not go on: the pair is connected, its `connect` returns that rank, and the dial is closed.
//!   A second `connect` to a connected rank returns it too. If the pair's connection is the
//!   peer's dial and breaks before that `connect` has looked, it waits [`REDIAL_WAIT`] for the
//!   peer's redial (its reconnect round).
//! - **A dial refused for a crossing gives way.** A dial refused with `RankInUse` while the
//!   same process's dial the other way is bound here, or still shaking hands, waits for that
//!   one instead: its `connect` returns the rank once it is bound. So does a dial refused
//!   while another dial of this side to that process is bound or has its proof out, and a dial
//!   that gave way also waits while this side's reconnect round redials the rank. (A `connect`
//!   to the address its round dials joins the round's dial, and the round holds off while a
//!   `connect`'s dial runs: [`Peers::connect_begins`]. Two dials of this side to one process
//!   remain possible through two addresses of it, a listener and a worker address.)
//!
//! # A redial's `Welcome` lost
//! A rank rebound by a redial's resume proof also takes, from a handshake begun here after
//! that rebind and within [`HANDSHAKE_LIMIT`](super::HANDSHAKE_LIMIT), a proof of the session
//! that redial proved: a dialler whose redial's connection broke after its `Proof` arrived
//! still holds that session, not the redial's. A dial of that process begun here no later than
//! the rebind that proves it lost to the redial, and is refused without a count
//! (`Peers::lost_to_rebind`).
//!
//! The lower rank's dial that won a tie and then fails before it binds (its connection broke)
//! leaves the pair with no connection: the dial it won over was refused. Its `connect` dials
//! once more, within its deadline ([`Peers::take_won_tie`]), and the other side answers that
//! dial as any other. The redial's `Proof` proves the broken dial's session ([`Peers::redial`]):
//! a side that bound the broken connection and has not heard it broke rebinds the rank to the
//! redial, as for any process coming back, instead of refusing it. The higher rank's dial, refused for that tie, gives way too when the
//! refusal comes after the lower rank's dial broke here (so no crossing is left to see), and
//! so does a dial that gave way to a dial which then broke: each waits [`REDIAL_WAIT`] (to its
//! deadline at most) for the redial.
//!
//! A crossing needs the same instance on both connections, so a second process with the rank
//! (another instance) is still refused as before, and nothing here rebinds a live rank: the
//! rank is never taken over (docs/SECURITY.md). The refusal that settles a crossing is not
//! counted as a refusal, on either side: the dials it settles overlapped in time (a side that
//! refuses while it still holds a broken connection of the peer's counts that refusal as any
//! other; the refused side counts it only if the peer's dial here did not break lately). A dial that
//! gave way does not make this side redial the rank when the kept connection fails: the side
//! whose dial was kept does, as after any `connect`.
//!
//! The instance is what the peer says it is: a `connect` that gives way trusts the answer's
//! claim that it is the process already bound, as a first `connect` trusts its claim of a rank
//! (with a deployment secret, only a member can make either claim).
use super::{Peers, WonTie};
use crate::{Handshake, Identity, Message, PeerInfo, RankId, Refusal, SessionKey, Step};
use std::hash::Hash;
use std::time::{Duration, Instant};

/// How long a dial that gave way waits for the rank's redial after the rank's dial here broke.
pub const REDIAL_WAIT: Duration = Duration::from_secs(5);

/// What the engine does after a handshake message, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HandshakeAction<P> {
    /// Send this on the endpoint the message came from.
    Send(Message),
    /// Close this endpoint now (one a new binding replaced, or a dial that gave way).
    Close(P),
    /// The rank is bound to the endpoint: it is connected.
    Bound(RankId, String),
    /// The rank is being bound by another engine instance than the one it was bound by last:
    /// another process, whose attempt numbers start again, so what this side keeps of the old
    /// one's requests must go ([`crate::Endpoint::forget_sends_to`]). Comes just before its
    /// `Bound`.
    NewInstance(RankId),
    /// The rank lost its endpoint (the peer refused the one it was bound to, or its process
    /// came back on a new connection while the old one looked alive here): its requests are
    /// lost.
    Lost(RankId),
    /// This side refused the endpoint (for a rank, if it had proved one).
    Refused(Refusal, Option<RankId>),
    /// The peer refused this side.
    RefusedByPeer(Refusal),
    /// Both ranks dialled; this side's dial wins, and the peer's was refused.
    Crossed(RankId),
    /// This side's dial gave way to the rank's dial the other way, or found the rank connected.
    GaveWay(RankId),
    /// A handshake with a peer that dialled this side, claiming this rank, ended without
    /// binding it: a dial of ours that gave way to it waits no longer.
    Unbound(RankId),
    /// A handshake message out of order.
    BadFrame,
}

impl<P: Copy + Eq + Hash> Peers<P> {
    /// One handshake message from `peer`. `challenge` is a fresh random value, used if this is
    /// the first message of a peer that dialled this side.
    pub fn on_handshake(
        &mut self,
        me: &Identity,
        peer: P,
        msg: Message,
        now: Instant,
        challenge: u64,
    ) -> Vec<HandshakeAction<P>> {
        use HandshakeAction as A;
        let mut out = Vec::new();
        if self.timed_out.contains_key(&peer) {
            // Handed out to be closed for a handshake past its limit: nothing on it binds now.
            return out;
        }
        if matches!(msg, Message::Refuse { .. })
            && self
                .handshakes
                .get(&peer)
                .is_none_or(|h| h.refused().is_some())
        {
            // A refusal of a handshake this side already dropped (a bind closed the endpoint,
            // and its close is still on the way), or already refused either way: nothing is
            // left to refuse, and the refusal recorded (the one `connect` reports) stays.
            return out;
        }
        // When a handshake began is taken once, at its first message (or its endpoint's
        // accept): a later frame must not make an old one look new.
        if !self.handshakes.contains_key(&peer) {
            self.handshake_started(peer, now);
        }
        let mut hs = self
            .handshakes
            .remove(&peer)
            .unwrap_or_else(|| Handshake::answer(challenge));
        let dialled = hs.dialled_peer().cloned();
        let answered = hs.answered_peer().map(|p| p.rank);
        let dialled_rank = dialled.as_ref().map(|d| d.rank);
        let mut refuse = None;
        match hs.handle(me, msg) {
            Step::Reply(m) => out.push(A::Send(m)),
            Step::Verified { peer: info, .. } => {
                if self.may_bind(&info, peer) {
                    let redial = self.redial_of.get(&peer).filter(|(r, _)| *r == info.rank);
                    let held = redial.map(|&(_, s)| s).or(self.session(info.rank));
                    if let Some(proof) = hs.accept(me, held.as_ref()) {
                        out.push(A::Send(proof));
                    }
                } else if let Some((answered, _)) = self.binding_of(&info) {
                    self.give_way(peer, info.rank, now);
                    if answered {
                        // The pair's connection is the peer's dial: if it breaks, the peer's
                        // round redials, and this dial's `connect` waits a while for that.
                        self.gave_way_to.insert(info.rank, now);
                    }
                    out.push(A::GaveWay(info.rank));
                    out.push(A::Close(peer));
                } else {
                    refuse = Some((Refusal::RankInUse, info.rank));
                }
            }
            Step::Proven {
                peer: info,
                session,
                resume,
            } => {
                // A rank still bound to a live endpoint is rebound only to the same session
                // coming back (the dialler proves it holds it).
                let started = self.pending.get(&peer).copied();
                let held = self.held_sessions(info.rank, started, now);
                let proved =
                    resume.and_then(|r| held.into_iter().flatten().find(|o| hs.resumes(o, &r)));
                let resumed = proved.is_some();
                // A dial of the bound process begun before its redial rebound the rank, proving
                // what that redial proved: it lost to that dial (`Peers::lost_to_rebind`).
                let replaced = !resumed
                    && resume.is_some_and(|r| {
                        let lost = self.lost_to_rebind(info.rank, started);
                        lost.is_some_and(|o| hs.resumes(&o, &r))
                    });
                let tie = me.rank < info.rank
                    && self.shaking_hands(Handshake::dialled_peer, info.rank, Some(info.instance));
                // A dial of ours that bound the rank after this one started crossed it.
                let crossed = self.pending.get(&peer).is_some_and(|&started| {
                    self.binding_of(&info)
                        .is_some_and(|(answered, at)| !answered && at.is_some_and(|b| b >= started))
                });
                if !tie && (resumed || self.may_bind(&info, peer)) {
                    let rank = info.rank;
                    out.extend(self.bind_step(me, &mut hs, info, peer, session, now));
                    if let Some(p) = proved {
                        self.rebound_proving(rank, p);
                    }
                } else if tie || crossed || replaced {
                    // Our dial to the same process wins the tie, or already won it; or the
                    // process's other dial did.
                    if tie {
                        self.mark_won_tie(&info, now);
                    }
                    let m = hs.refuse(Refusal::RankInUse);
                    out.push(A::Send(m));
                    if !replaced {
                        out.push(A::Crossed(info.rank));
                    }
                    self.end_refused(peer, Refusal::RankInUse, false, now);
                } else {
                    refuse = Some((Refusal::RankInUse, info.rank));
                }
            }
            Step::Welcomed {
                peer: info,
                session,
            } => {
                if self.may_bind(&info, peer) {
                    out.extend(self.bind_step(me, &mut hs, info, peer, session, now));
                } else {
                    refuse = Some((Refusal::RankInUse, info.rank));
                }
            }
            Step::Refuse(reason) => {
                out.push(A::Send(Message::Refuse { reason }));
                out.push(A::Refused(reason, None));
                self.refuse(peer, reason, false, now);
            }
            Step::RefusedByPeer(reason) => match dialled
                .filter(|_| reason == Refusal::RankInUse)
                .and_then(|info| self.refused_for_crossing(me, &info, now))
            {
                Some((rank, broke)) => {
                    if broke {
                        // The lower rank refused us for a tie while its dial here was alive;
                        // that dial has since broken, so its `connect` dials once more.
                        self.expect_redial.insert(rank, now);
                    }
                    self.end_refused(peer, reason, true, now);
                    self.give_way(peer, rank, now);
                    self.gave_way_to.insert(rank, now);
                    out.push(A::GaveWay(rank));
                }
                None => {
                    out.push(A::RefusedByPeer(reason));
                    if let Some(rank) = self.refuse(peer, reason, true, now) {
                        // The peer ended a bound connection: its requests are lost, and it
                        // counts as `on_failed` counts a failed one (whose later report of
                        // this endpoint finds it unbound and counts nothing).
                        self.failures += 1;
                        out.push(A::Lost(rank));
                    }
                }
            },
            Step::Ignore => {}
            Step::Unexpected => out.push(A::BadFrame),
        }
        if let Some((reason, rank)) = refuse {
            let m = hs.refuse(reason);
            out.push(A::Send(m));
            out.push(A::Refused(reason, Some(rank)));
            self.refuse(peer, reason, false, now);
        }
        if let Some(rank) = answered.filter(|_| hs.refused().is_some()) {
            out.push(A::Unbound(rank));
        }
        self.handshakes.insert(peer, hs);
        self.wake_for(&out, dialled_rank);
        out
    }

    /// The waiters a handshake step concerns ([`Peers::take_wakes`]) beyond those its bind,
    /// refusal or give-way woke (a reconnect dial ended among them): the rank of an answered
    /// handshake refused; our dial's rank when the peer refused it (a dial that gave way to it
    /// waits).
    fn wake_for(&mut self, out: &[HandshakeAction<P>], dialled: Option<RankId>) {
        use HandshakeAction as A;
        for action in out {
            match action {
                // (A bind, a loss and a give-way wake their rank where they are made.)
                A::Unbound(r) => self.wake(*r),
                A::RefusedByPeer(_) => {
                    if let Some(r) = dialled {
                        self.wake(r);
                    }
                }
                _ => {}
            }
        }
    }

    /// Binds a proven peer's rank to `peer`: the endpoints it replaces are closed, and an
    /// answerer says `Welcome`.
    fn bind_step(
        &mut self,
        me: &Identity,
        hs: &mut Handshake,
        info: PeerInfo,
        peer: P,
        session: SessionKey,
        now: Instant,
    ) -> Vec<HandshakeAction<P>> {
        let (rank, name) = (info.rank, info.name.clone());
        // A rank bound to another live endpoint: its process came back on a new connection
        // (a redial's resume proof) before this side saw the old one fail. Its side failed the
        // requests of the old session when it saw that; the new session's tag keys differ, so
        // their data can never match here either. They are lost here too, at once, before
        // anything of the new session arrives (not left to run to their deadline).
        let replaced = self.endpoint(rank).is_some_and(|p| p != peer);
        // Only a rank known here by another instance (bound now, or forgotten as a `Failed`
        // rank nobody dials): its first bind has no history to forget, and the forgetting is a
        // pass over what this side keeps.
        let new_instance = self
            .ranks
            .get(&rank)
            .and_then(|r| r.instance)
            .or_else(|| self.forgotten_instances.get(&rank).map(|&(i, _)| i))
            .is_some_and(|old| old != info.instance);
        // The same session came back on a new endpoint, or another dial for the rank is still
        // running: those endpoints are done.
        let mut out: Vec<_> = self
            .bind(info, peer, me.rank, session)
            .into_iter()
            .map(HandshakeAction::Close)
            .collect();
        if replaced {
            // A connection of a bound rank was lost, as `on_failed` counts one it hears of.
            self.failures += 1;
            out.push(HandshakeAction::Lost(rank));
        }
        if let Some(r) = self.ranks.get_mut(&rank) {
            r.bound_at = Some(now);
        }
        if let Some(welcome) = hs.accept(me, None) {
            out.push(HandshakeAction::Send(welcome));
        }
        if new_instance {
            out.push(HandshakeAction::NewInstance(rank));
        }
        out.push(HandshakeAction::Bound(rank, name));
        out
    }

    /// `info`'s process, if its rank is bound here, live: whether the peer made the bound
    /// connection (this side answered it), and when it was bound.
    fn binding_of(&self, info: &PeerInfo) -> Option<(bool, Option<Instant>)> {
        self.ranks
            .get(&info.rank)
            .filter(|r| {
                r.state == crate::peers::PeerState::Connected && r.instance == Some(info.instance)
            })
            .map(|r| (r.answered, r.bound_at))
    }

    /// Does a handshake in the role `side` picks (this side's dial: [`Handshake::dialled_peer`];
    /// the peer's: [`Handshake::answered_peer`]) run with `rank` (and `instance`, if given)?
    fn shaking_hands(
        &self,
        side: fn(&Handshake) -> Option<&PeerInfo>,
        rank: RankId,
        instance: Option<u64>,
    ) -> bool {
        self.handshakes
            .values()
            .filter_map(side)
            .any(|p| p.rank == rank && instance.is_none_or(|i| p.instance == i))
    }

    /// Is `info`'s process connected to this side by its own dial, or shaking hands on one?
    fn crossing_from(&self, info: &PeerInfo) -> bool {
        self.binding_of(info).is_some_and(|(answered, _)| answered)
            || self.shaking_hands(Handshake::answered_peer, info.rank, Some(info.instance))
    }

    /// This side's dial on `peer` gave way to `rank`'s dial the other way.
    fn give_way(&mut self, peer: P, rank: RankId, now: Instant) {
        self.end_round_dial(peer);
        self.pending.remove(&peer);
        self.connect_dials.remove(&peer);
        self.gave_way.insert(peer, (rank, now));
        self.wake(rank);
    }

    /// `connect`'s dials to `info`'s process won a tie: the peer's dial was refused for them.
    /// (A reconnect round's dial is left out: the round tries again by itself.)
    fn mark_won_tie(&mut self, info: &PeerInfo, now: Instant) {
        let ours = self.handshakes.iter().filter(|(p, h)| {
            !self.dialling.contains_key(p)
                && h.dialled_peer()
                    .is_some_and(|d| d.rank == info.rank && d.instance == info.instance)
        });
        let won: Vec<(P, WonTie)> = ours
            .map(|(p, h)| {
                let w = WonTie {
                    rank: info.rank,
                    session: h.dial_session(),
                    at: now,
                };
                (*p, w)
            })
            .collect();
        self.won_tie.extend(won);
    }

    /// The dials of `connect` to `rank` that won a tie and are not yet bound, refused or
    /// taken ([`Peers::take_won_tie`]).
    pub fn won_tie_dials(&self, rank: RankId) -> Vec<P> {
        let won = self.won_tie.iter().filter(|(_, w)| w.rank == rank);
        won.map(|(p, _)| *p).collect()
    }

    /// If the dial on `peer` won a tie and then failed before the rank was bound: the rank it
    /// was for. The peer's dial was refused for this one, so neither connection is left; the
    /// pair is connected only if this side dials again (`connect` does, within its deadline).
    /// Taken once; a dial that was refused, or whose rank got bound, has no entry.
    pub fn take_won_tie(&mut self, peer: P) -> Option<WonTie> {
        self.won_tie.remove(&peer)
    }

    /// `connect` dials `peer` again for a won tie whose dial broke: its `Proof` proves the
    /// broken dial's session, so that an answerer still holding that connection bound (it has
    /// not heard it broke) rebinds the rank to this one, as for any process coming back.
    pub fn redial(&mut self, peer: P, won: WonTie) {
        if let Some(session) = won.session {
            self.redial_of.insert(peer, (won.rank, session));
        }
    }

    /// If the dial on `peer` gave way to its rank's dial the other way: that rank, which is
    /// connected or about to be (see [`Peers::waiting_for_crossing`]). Taken once.
    pub fn take_gave_way(&mut self, peer: P) -> Option<RankId> {
        self.gave_way.remove(&peer).map(|(rank, _)| rank)
    }

    /// Does `rank` still shake hands with this side on a connection it dialled, or does another
    /// dial of ours to it, or does this side's reconnect round redial it, or is its redial
    /// expected at `now`? (A dial that gave way to it waits while it does; see
    /// [`Peers::redial_expected_until`].)
    pub fn waiting_for_crossing(&self, rank: RankId, now: Instant) -> bool {
        self.shaking_hands(Handshake::answered_peer, rank, None)
            || self.dialling_to(rank, None)
            || self.state(rank) == crate::peers::PeerState::Reconnecting
            || self.redial_expected_until(rank, now).is_some()
    }

    /// Does another dial of ours to `rank` (and `instance`, if given) still shake hands, not
    /// refused?
    fn dialling_to(&self, rank: RankId, instance: Option<u64>) -> bool {
        self.handshakes
            .values()
            .filter(|h| h.refused().is_none())
            .filter_map(Handshake::dialled_peer)
            .any(|p| p.rank == rank && instance.is_none_or(|i| p.instance == i))
    }

    /// Until when `rank`'s redial is waited for, if that is after `now`: [`REDIAL_WAIT`] after
    /// its dial here broke (or it refused ours after that). The redial follows the break at
    /// once when the rank hears of it; one heard later, by keepalive, may come after this.
    pub fn redial_expected_until(&self, rank: RankId, now: Instant) -> Option<Instant> {
        self.expect_redial
            .get(&rank)
            .map(|&t| t + REDIAL_WAIT)
            .filter(|&t| t > now)
    }

    /// Whether a redial of `rank` was expected lately (its dial here broke while one of ours
    /// waited for it): a wait for it that ends did not end for a conflict.
    pub fn redial_was_expected(&self, rank: RankId) -> bool {
        self.expect_redial.contains_key(&rank)
    }

    /// Whether a `RankInUse` refusal from `info`'s process is its side of a crossing: its dial
    /// is bound or shaking hands here, or another dial of ours to it is bound or has its proof
    /// out, or (the lower rank, which wins ties) its dial here broke lately. The rank, and
    /// whether its dial broke (its redial is then to be waited for).
    fn refused_for_crossing(
        &self,
        me: &Identity,
        info: &PeerInfo,
        now: Instant,
    ) -> Option<(RankId, bool)> {
        let ours = self.binding_of(info).is_some_and(|(answered, _)| !answered)
            || self.dialling_to(info.rank, Some(info.instance));
        if self.crossing_from(info) || ours {
            // Or the rank is bound, or being bound, to that process through another dial of
            // ours (to another of its addresses): it refused this one for that.
            Some((info.rank, false))
        } else if info.rank < me.rank && self.lost_answer_from(info, now) {
            Some((info.rank, true))
        } else {
            None
        }
    }

    /// Did `info`'s process dial this side lately, and that connection break?
    fn lost_answer_from(&self, info: &PeerInfo, now: Instant) -> bool {
        self.lost_answers
            .get(&info.rank)
            .is_some_and(|&(instance, t)| {
                instance == info.instance
                    && now.saturating_duration_since(t) < super::HANDSHAKE_LIMIT
            })
    }
}
