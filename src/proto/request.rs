//! The state machines of one request: `RecvRequest` on a generation (receiving) rank and
//! `SendFlow` on a context (sending) rank, one per (request, receiver) pair.
//!
//! Receiver: `Active` (advertised; segments landing) -> local vote -> verdict -> `Settling`
//! (unlanded receives cancelled, waiting for each to be reaped) -> terminal, buffers released ->
//! lingering (answers late votes, retransmits the verdict to senders that have not confirmed) ->
//! forgotten. Deadlines: the request deadline (vote `TimedOut`, the coordinator decides), the
//! agreement bound (`deadline + agreement_bound`: terminal no matter what, unsafe buffers fenced),
//! the retransmit timer, and the forget time (`bound + linger`).
//!
//! Sender: `Offered` (Advertised event out, waiting for `accept`) -> `Sending` -> verdict ->
//! aborting whatever is still in flight -> `Quiesced` sent, terminal -> lingering -> forgotten.
use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};

use super::agreement::reduce;
use super::id::{RankId, RequestKey, Token};
use super::pool::Lease;
use super::wire::{BufferDesc, Message};
use crate::error::Outcome;

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
    /// Interval between retransmissions of an unanswered control message.
    pub retransmit: Duration,
    /// How long a finished request is remembered past its agreement bound, to answer late
    /// duplicates and to recognise stale messages.
    pub linger: Duration,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            timeout: Duration::from_secs(60),
            agreement_bound: Duration::from_millis(50),
            retransmit: Duration::from_millis(200),
            linger: Duration::from_secs(5),
        }
    }
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
    fn terminal(&mut self, key: RequestKey, role: Role, outcome: Outcome) {
        if outcome.is_completed() {
            self.stats.completed += 1;
        } else {
            self.stats.failed += 1;
        }
        self.events
            .push_back(Event::Terminal { key, role, outcome });
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SegState {
    Posted,
    CancelRequested,
    Landed,
    Reaped,
}

#[derive(Debug)]
struct Seg {
    lease: Lease,
    desc: BufferDesc,
    state: SegState,
}

#[derive(Debug)]
struct InFlow {
    segs: BTreeMap<u32, Seg>,
    /// The sender has said something (Ready, Vote) or data from it landed: stop advertising.
    answered: bool,
    quiesced: bool,
    lost: bool,
}

/// One request on a receiving rank.
#[derive(Debug)]
pub(crate) struct RecvRequest {
    key: RequestKey,
    me: RankId,
    pub(crate) receivers: Vec<RankId>,
    coordinator: RankId,
    external: bool,
    deadline: Instant,
    bound: Instant,
    agreement: Duration,
    forget_at: Instant,
    /// Until when a tombstone of this request outlives it: as long as a peer's late copy of a
    /// message for it can still arrive.
    pub(crate) tomb_until: Instant,
    linger: Duration,
    retransmit: Duration,
    next_retx: Instant,
    request_info: Vec<u8>,
    flows: BTreeMap<RankId, InFlow>,
    local_vote: Option<Outcome>,
    /// External agreement: the vote waiting to be handed to the collective.
    pub(crate) pending_contribution: Option<Outcome>,
    /// Coordinator only (message agreement): every receiver's vote so far.
    votes: BTreeMap<RankId, Outcome>,
    verdict: Option<Outcome>,
    terminal: Option<Outcome>,
    deadline_fired: bool,
}

/// The buffers of one sender, as `start_receive` takes them.
pub(crate) type FlowSpec = (RankId, Vec<(Lease, BufferDesc)>);

impl RecvRequest {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        now: Instant,
        cfg: &Config,
        me: RankId,
        key: RequestKey,
        timeout: Duration,
        receivers: Vec<RankId>,
        flows: Vec<FlowSpec>,
        request_info: Vec<u8>,
        external: bool,
        out: &mut Out,
    ) -> Self {
        let deadline = now + timeout;
        let bound = deadline + cfg.agreement_bound;
        let coordinator = receivers[0];
        let flows = flows
            .into_iter()
            .map(|(sender, bufs)| {
                let segs = bufs
                    .into_iter()
                    .map(|(lease, desc)| {
                        (
                            desc.segment,
                            Seg {
                                lease,
                                desc,
                                state: SegState::Posted,
                            },
                        )
                    })
                    .collect();
                (
                    sender,
                    InFlow {
                        segs,
                        answered: false,
                        quiesced: false,
                        lost: false,
                    },
                )
            })
            .collect();
        let mut r = RecvRequest {
            key,
            me,
            receivers,
            coordinator,
            external,
            deadline,
            bound,
            agreement: cfg.agreement_bound,
            forget_at: bound + cfg.linger,
            tomb_until: bound + cfg.linger,
            linger: cfg.linger,
            retransmit: cfg.retransmit,
            next_retx: now + cfg.retransmit,
            request_info,
            flows,
            local_vote: None,
            pending_contribution: None,
            votes: BTreeMap::new(),
            verdict: None,
            terminal: None,
            deadline_fired: false,
        };
        r.advertise(now, out, false);
        r
    }

    /// Once terminal, the request is remembered for `linger` more (to answer late duplicates
    /// and recognise stale messages), counted from the terminal state, not from its start.
    pub(crate) fn settle(&mut self, now: Instant) {
        if self.terminal.is_some() && self.forget_at > now + self.linger {
            self.forget_at = now + self.linger;
        }
    }

    fn is_coordinator(&self) -> bool {
        !self.external && self.me == self.coordinator
    }

    pub(crate) fn is_finished(&self, now: Instant) -> bool {
        self.terminal.is_some() && now >= self.forget_at
    }

    pub(crate) fn verdict(&self) -> Option<Outcome> {
        self.verdict
    }

    pub(crate) fn is_terminal(&self) -> bool {
        self.terminal.is_some()
    }

    pub(crate) fn terminal(&self) -> Option<Outcome> {
        self.terminal
    }

    pub(crate) fn is_external_waiting(&self) -> bool {
        self.external && self.verdict.is_none() && self.local_vote.is_some()
    }

    fn advertise(&mut self, now: Instant, out: &mut Out, only_unanswered: bool) {
        // What is left of the request's deadline travels with it: the sender learns it.
        let left = self.deadline.saturating_duration_since(now).as_millis();
        let timeout_ms = left.clamp(1, u32::MAX as u128) as u32;
        for (sender, flow) in &self.flows {
            if flow.lost || (only_unanswered && flow.answered) {
                continue;
            }
            out.send(
                *sender,
                Message::Advertise {
                    key: self.key,
                    src_rank: self.me,
                    timeout_ms,
                    request_info: self.request_info.clone(),
                    buffers: flow.segs.values().map(|s| s.desc).collect(),
                },
            );
        }
    }

    fn set_local_vote(&mut self, now: Instant, vote: Outcome, out: &mut Out) {
        if self.verdict.is_some() {
            return;
        }
        match self.local_vote {
            None => {}
            // A failure after a local `Completed` (every segment landed, then a sender gave up
            // or a caller cancelled) still counts until the verdict: it replaces the vote.
            // An external collective has already taken the first one.
            Some(v) if v.is_completed() && !vote.is_completed() && !self.external => {}
            Some(_) => return,
        }
        self.local_vote = Some(vote);
        if self.external {
            self.pending_contribution = Some(vote);
        } else if self.is_coordinator() {
            self.votes.insert(self.me, vote);
            self.try_decide(now, out);
        } else {
            out.send(
                self.coordinator,
                Message::Vote {
                    key: self.key,
                    outcome: vote,
                },
            );
            self.next_retx = now + self.retransmit;
        }
    }

    fn try_decide(&mut self, now: Instant, out: &mut Out) {
        if self.verdict.is_some() {
            return;
        }
        let any_failure = self.votes.values().any(|v| !v.is_completed());
        let all_in = self.receivers.iter().all(|r| self.votes.contains_key(r));
        if any_failure || all_in {
            let v = reduce(self.votes.values().copied());
            self.set_verdict(now, v, out);
        }
    }

    pub(crate) fn set_verdict(&mut self, now: Instant, verdict: Outcome, out: &mut Out) {
        if self.verdict.is_some() || self.terminal.is_some() {
            return;
        }
        self.verdict = Some(verdict);
        self.next_retx = now + self.retransmit;
        if self.is_coordinator() {
            // Push rather than wait for each receiver's next vote; votes still pull it again.
            for r in self.receivers.iter().filter(|r| **r != self.me) {
                out.send(
                    *r,
                    Message::Verdict {
                        key: self.key,
                        outcome: verdict,
                    },
                );
            }
        }
        for (sender, flow) in self.flows.iter_mut() {
            if !flow.lost {
                out.send(
                    *sender,
                    Message::Verdict {
                        key: self.key,
                        outcome: verdict,
                    },
                );
            }
            for seg in flow.segs.values_mut() {
                if seg.state == SegState::Posted {
                    seg.state = SegState::CancelRequested;
                    out.actions.push_back(Action::CancelReceive {
                        key: self.key,
                        segment: seg.desc.segment,
                        token: seg.desc.token,
                    });
                }
            }
        }
        self.try_finish(out);
    }

    /// Terminal once the verdict is known and no posted receive is left.
    fn try_finish(&mut self, out: &mut Out) {
        let Some(verdict) = self.verdict else { return };
        if self.terminal.is_some() {
            return;
        }
        let safe = self.flows.values().all(|f| {
            f.segs
                .values()
                .all(|s| matches!(s.state, SegState::Landed | SegState::Reaped))
        });
        if safe {
            self.finish(verdict, out);
        }
    }

    /// Releases what is safe, fences the rest, and reports the terminal state.
    fn finish(&mut self, outcome: Outcome, out: &mut Out) {
        for flow in self.flows.values_mut() {
            for seg in flow.segs.values_mut() {
                let action = match seg.state {
                    SegState::Landed | SegState::Reaped => Action::Release {
                        key: self.key,
                        lease: seg.lease,
                    },
                    SegState::Posted | SegState::CancelRequested => {
                        out.stats.fenced_buffers += 1;
                        // After fencing nothing can land: the registration is gone.
                        seg.state = SegState::Reaped;
                        Action::Fence {
                            key: self.key,
                            lease: seg.lease,
                            token: seg.desc.token,
                        }
                    }
                };
                out.actions.push_back(action);
            }
        }
        self.terminal = Some(outcome);
        out.terminal(self.key, Role::Receiver, outcome);
    }

    pub(crate) fn on_ready(&mut self, now: Instant, from: RankId, ready: bool, out: &mut Out) {
        let Some(flow) = self.flows.get_mut(&from) else {
            out.stats.unknown_dropped += 1;
            return;
        };
        flow.answered = true;
        if !ready {
            self.set_local_vote(now, Outcome::Rejected, out);
        }
    }

    /// A vote from one of this request's senders (its own failure) or, at the coordinator, from
    /// another receiver.
    pub(crate) fn on_vote(&mut self, now: Instant, from: RankId, vote: Outcome, out: &mut Out) {
        if let Some(flow) = self.flows.get_mut(&from) {
            flow.answered = true;
            if self.verdict.is_some() {
                // It has not heard the verdict yet: answer now rather than at the next tick.
                out.send(
                    from,
                    Message::Verdict {
                        key: self.key,
                        outcome: self.verdict.unwrap_or(vote),
                    },
                );
            } else if !vote.is_completed() {
                self.set_local_vote(now, vote, out);
            }
        } else if self.is_coordinator() && self.receivers.contains(&from) {
            if let Some(v) = self.verdict {
                out.send(
                    from,
                    Message::Verdict {
                        key: self.key,
                        outcome: v,
                    },
                );
                return;
            }
            if self.votes.insert(from, vote).is_some() {
                out.stats.duplicates += 1;
            }
            self.try_decide(now, out);
        } else {
            out.stats.unknown_dropped += 1;
        }
    }

    pub(crate) fn on_verdict(&mut self, now: Instant, from: RankId, v: Outcome, out: &mut Out) {
        if self.external || from != self.coordinator || from == self.me {
            out.stats.unknown_dropped += 1;
            return;
        }
        if self.verdict.is_some() {
            out.stats.duplicates += 1;
            return;
        }
        self.set_verdict(now, v, out);
    }

    pub(crate) fn on_quiesced(&mut self, from: RankId, out: &mut Out) {
        match self.flows.get_mut(&from) {
            Some(flow) if self.verdict.is_some() => {
                if flow.quiesced {
                    out.stats.duplicates += 1;
                }
                flow.quiesced = true;
                flow.answered = true;
            }
            // A confirmation can only answer a verdict we sent.
            _ => out.stats.unknown_dropped += 1,
        }
    }

    fn seg_mut(&mut self, segment: u32) -> Option<&mut Seg> {
        self.flows
            .values_mut()
            .find_map(|f| f.segs.get_mut(&segment))
    }

    /// Returns false when `segment` is not part of this request.
    pub(crate) fn on_landed(&mut self, now: Instant, segment: u32, out: &mut Out) -> bool {
        let Some(flow) = self
            .flows
            .values_mut()
            .find(|f| f.segs.contains_key(&segment))
        else {
            return false;
        };
        flow.answered = true;
        let seg = flow.segs.get_mut(&segment).expect("checked above");
        match seg.state {
            SegState::Posted | SegState::CancelRequested => seg.state = SegState::Landed,
            SegState::Landed | SegState::Reaped => {
                out.stats.duplicates += 1;
                return true;
            }
        }
        let all_landed = self
            .flows
            .values()
            .all(|f| f.segs.values().all(|s| matches!(s.state, SegState::Landed)));
        if all_landed {
            self.set_local_vote(now, Outcome::Completed, out);
        }
        self.try_finish(out);
        true
    }

    /// Returns false when `segment` is not part of this request.
    pub(crate) fn on_reaped(&mut self, now: Instant, segment: u32, out: &mut Out) -> bool {
        let Some(seg) = self.seg_mut(segment) else {
            return false;
        };
        match seg.state {
            SegState::Posted => {
                // The receive died on its own (transport error): the data will never come.
                seg.state = SegState::Reaped;
                self.set_local_vote(now, Outcome::PeerLost, out);
            }
            SegState::CancelRequested => seg.state = SegState::Reaped,
            SegState::Landed | SegState::Reaped => out.stats.duplicates += 1,
        }
        self.try_finish(out);
        true
    }

    /// This rank stops waiting: it votes `why` (Cancelled, or TimedOut for a caller's own
    /// deadline that came before the request's).
    pub(crate) fn give_up(&mut self, now: Instant, why: Outcome, out: &mut Out) {
        // The caller stops waiting now: agreement gets the bound from now, not from the
        // request's own deadline, so the caller's wait ends inside its own deadline's slack.
        // (Message agreement decides at the first failure; an external collective may need
        // every rank's vote, so there the request's own bound stands.)
        if !self.external {
            self.bound = self.bound.min(now + self.agreement);
        }
        self.set_local_vote(now, why, out);
    }

    pub(crate) fn on_peer_lost(&mut self, now: Instant, rank: RankId, out: &mut Out) {
        if self.terminal.is_some() {
            if let Some(f) = self.flows.get_mut(&rank) {
                f.lost = true;
            }
            return;
        }
        if let Some(flow) = self.flows.get_mut(&rank) {
            flow.lost = true;
            self.set_local_vote(now, Outcome::PeerLost, out);
        }
        if self.external || !self.receivers.contains(&rank) {
            return;
        }
        if rank == self.coordinator {
            // Nobody is left to agree with: stop every write now, end PeerLost.
            self.set_verdict(now, Outcome::PeerLost, out);
        } else if self.is_coordinator() && !self.votes.contains_key(&rank) {
            self.votes.insert(rank, Outcome::PeerLost);
            self.try_decide(now, out);
        }
    }

    pub(crate) fn on_timeout(&mut self, now: Instant, out: &mut Out) {
        if self.terminal.is_none() {
            if now >= self.bound {
                let outcome = match self.verdict {
                    Some(v) => v,
                    None => {
                        // No verdict within the bound: this rank's own failure if it had one,
                        // else TimedOut (it never says Completed without the verdict). Tell the
                        // senders too, so they stop and confirm.
                        let v = unagreed(self.local_vote);
                        self.set_verdict(now, v, out);
                        v
                    }
                };
                if self.terminal.is_none() {
                    self.finish(outcome, out);
                }
            } else if now >= self.deadline && !self.deadline_fired {
                self.deadline_fired = true;
                self.set_local_vote(now, Outcome::TimedOut, out);
                if self.is_coordinator() && self.verdict.is_none() {
                    let v = reduce(
                        self.votes
                            .values()
                            .copied()
                            .chain(std::iter::once(Outcome::TimedOut)),
                    );
                    self.set_verdict(now, v, out);
                }
            }
        }
        if now >= self.next_retx {
            self.retransmit(now, out);
        }
    }

    fn retransmit(&mut self, now: Instant, out: &mut Out) {
        let before = out.transmits.len();
        match (self.verdict, self.local_vote) {
            (None, None) => self.advertise(now, out, true),
            (None, Some(v)) if !self.external && !self.is_coordinator() => out.send(
                self.coordinator,
                Message::Vote {
                    key: self.key,
                    outcome: v,
                },
            ),
            (Some(v), _) if !v.is_completed() => {
                for (sender, flow) in &self.flows {
                    if !flow.quiesced && !flow.lost {
                        out.send(
                            *sender,
                            Message::Verdict {
                                key: self.key,
                                outcome: v,
                            },
                        );
                    }
                }
            }
            _ => {}
        }
        out.stats.retransmits += (out.transmits.len() - before) as u64;
        self.next_retx = now + self.retransmit;
    }

    fn wants_retransmit(&self) -> bool {
        match (self.verdict, self.local_vote) {
            (None, None) => self.flows.values().any(|f| !f.answered && !f.lost),
            // External agreement: poll the collective at the retransmit interval.
            (None, Some(_)) => self.external || !self.is_coordinator(),
            // A Completed verdict needs no confirmation: every segment landed, so nothing more
            // will be sent; a sender that missed it pulls it (a `Vote` answered with it).
            (Some(v), _) => {
                !v.is_completed() && self.flows.values().any(|f| !f.quiesced && !f.lost)
            }
        }
    }

    pub(crate) fn next_timeout(&self) -> Instant {
        let mut t = self.forget_at;
        if self.terminal.is_none() {
            t = t.min(self.bound);
            if !self.deadline_fired {
                t = t.min(self.deadline);
            }
        }
        if self.wants_retransmit() && (self.terminal.is_none() || self.next_retx < self.forget_at) {
            t = t.min(self.next_retx);
        }
        t
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SendState {
    /// Accepted; the application has not started this segment's send yet.
    Pending,
    /// Started ([`SendFlow::begin_send`]); its completion is reported with `on_send_done`.
    InFlight,
    /// Started, then asked to stop ([`Action::AbortSend`]).
    Aborting,
    Done,
    /// Never started: the request ended first.
    Skipped,
}

/// Why a segment's send cannot start: misuse (the caller's mistake, nothing else fails) or the
/// request has already ended or been told to stop.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SendRefusal {
    NotAccepted,
    NotAdvertised,
    AlreadySent,
    WrongSize { advertised: u64 },
    Ended(Outcome),
}

/// The no-verdict outcome at the agreement bound: this rank's own failure if it had one, else
/// `TimedOut`. Never `Completed`: without the verdict a rank cannot know that every other rank
/// completed.
fn unagreed(local_vote: Option<Outcome>) -> Outcome {
    match local_vote {
        Some(v) if !v.is_completed() => v,
        _ => Outcome::TimedOut,
    }
}

/// One (request, receiver) pair on a sending rank.
#[derive(Debug)]
pub(crate) struct SendFlow {
    key: RequestKey,
    receiver: RankId,
    deadline: Instant,
    bound: Instant,
    agreement: Duration,
    forget_at: Instant,
    /// See [`RecvRequest::tomb_until`].
    pub(crate) tomb_until: Instant,
    linger: Duration,
    retransmit: Duration,
    next_retx: Instant,
    buffers: Vec<BufferDesc>,
    accepted: Option<bool>,
    sends: BTreeMap<u32, SendState>,
    local_vote: Option<Outcome>,
    verdict: Option<Outcome>,
    receiver_lost: bool,
    terminal: Option<Outcome>,
    deadline_fired: bool,
}

impl SendFlow {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        now: Instant,
        cfg: &Config,
        key: RequestKey,
        receiver: RankId,
        timeout: Duration,
        request_info: Vec<u8>,
        buffers: Vec<BufferDesc>,
        out: &mut Out,
    ) -> Self {
        let deadline = now + timeout;
        let bound = deadline + cfg.agreement_bound;
        out.events.push_back(Event::Advertised {
            key,
            from: receiver,
            deadline,
            request_info,
            buffers: buffers.clone(),
        });
        SendFlow {
            key,
            receiver,
            deadline,
            bound,
            agreement: cfg.agreement_bound,
            forget_at: bound + cfg.linger,
            tomb_until: bound + cfg.linger,
            linger: cfg.linger,
            retransmit: cfg.retransmit,
            next_retx: now + cfg.retransmit,
            buffers,
            accepted: None,
            sends: BTreeMap::new(),
            local_vote: None,
            verdict: None,
            receiver_lost: false,
            terminal: None,
            deadline_fired: false,
        }
    }

    pub(crate) fn is_finished(&self, now: Instant) -> bool {
        self.terminal.is_some() && now >= self.forget_at
    }

    /// See [`RecvRequest::settle`].
    pub(crate) fn settle(&mut self, now: Instant) {
        if self.terminal.is_some() && self.forget_at > now + self.linger {
            self.forget_at = now + self.linger;
        }
    }

    pub(crate) fn is_terminal(&self) -> bool {
        self.terminal.is_some()
    }

    pub(crate) fn terminal(&self) -> Option<Outcome> {
        self.terminal
    }

    /// The request's deadline on this rank (learned from the advertisement).
    pub(crate) fn deadline(&self) -> Instant {
        self.deadline
    }

    /// The ended outcome, if any (terminal, or a verdict / local failure already known).
    pub(crate) fn ended(&self) -> Option<Outcome> {
        self.terminal
            .or(self.verdict)
            .or(self.local_vote.filter(|v| !v.is_completed()))
    }

    /// May the application start the send of `segment` with `len` bytes now? Once per
    /// advertised segment, with its advertised size, after accept, while the request runs.
    pub(crate) fn check_send(&self, segment: u32, len: u64) -> Result<BufferDesc, SendRefusal> {
        let Some(desc) = self.buffers.iter().find(|d| d.segment == segment).copied() else {
            return Err(SendRefusal::NotAdvertised);
        };
        // A second send of a segment is misuse whether or not the request has ended since.
        if matches!(
            self.sends.get(&segment),
            Some(SendState::InFlight | SendState::Aborting | SendState::Done)
        ) {
            return Err(SendRefusal::AlreadySent);
        }
        if let Some(o) = self.ended() {
            return Err(SendRefusal::Ended(o));
        }
        match self.accepted {
            Some(true) => {}
            Some(false) => return Err(SendRefusal::Ended(Outcome::Rejected)),
            None => return Err(SendRefusal::NotAccepted),
        }
        if desc.len != len {
            return Err(SendRefusal::WrongSize {
                advertised: desc.len,
            });
        }
        match self.sends.get(&segment) {
            Some(SendState::Pending) => Ok(desc),
            _ => Err(SendRefusal::AlreadySent),
        }
    }

    /// Marks `segment`'s send started (after [`SendFlow::check_send`] allowed it).
    pub(crate) fn begin_send(&mut self, segment: u32) {
        if let Some(st @ SendState::Pending) = self.sends.get_mut(&segment) {
            *st = SendState::InFlight;
        }
    }

    fn quiesced(&self) -> bool {
        self.sends
            .values()
            .all(|s| matches!(s, SendState::Done | SendState::Skipped))
    }

    fn send_quiesced(&self, out: &mut Out) {
        // A Completed verdict is not confirmed (the receiver does not retransmit it).
        if !self.receiver_lost && self.verdict != Some(Outcome::Completed) {
            out.send(self.receiver, Message::Quiesced { key: self.key });
        }
    }

    /// The same advertisement again: answer what was answered.
    pub(crate) fn on_advertise_again(&mut self, out: &mut Out) {
        out.stats.duplicates += 1;
        if self.terminal.is_some() {
            self.send_quiesced(out);
        } else if let Some(ready) = self.accepted {
            out.send(
                self.receiver,
                Message::Ready {
                    key: self.key,
                    ready,
                },
            );
        }
    }

    /// The application's answer to the advertisement. Returns false when it comes too late (a
    /// verdict or a local failure got there first, or it was answered already).
    pub(crate) fn accept(&mut self, now: Instant, ready: bool, out: &mut Out) -> bool {
        if self.accepted.is_some() || self.local_vote.is_some() || self.verdict.is_some() {
            return false;
        }
        self.accepted = Some(ready);
        // Only a refusal is sent: acceptance is proved by the first landing (a receiver that
        // re-advertises before any data arrives is answered `Ready(true)`).
        if !ready {
            out.send(
                self.receiver,
                Message::Ready {
                    key: self.key,
                    ready,
                },
            );
        }
        if ready {
            for desc in &self.buffers {
                self.sends.insert(desc.segment, SendState::Pending);
                out.actions.push_back(Action::Send {
                    key: self.key,
                    to: self.receiver,
                    desc: *desc,
                });
            }
        } else {
            // Ready(false) is this rank's vote.
            self.local_vote = Some(Outcome::Rejected);
            self.next_retx = now + self.retransmit;
        }
        true
    }

    fn abort_pending(&mut self, out: &mut Out) {
        for (segment, state) in self.sends.iter_mut() {
            match *state {
                // Never started: nothing to stop.
                SendState::Pending => *state = SendState::Skipped,
                SendState::InFlight => {
                    *state = SendState::Aborting;
                    out.actions.push_back(Action::AbortSend {
                        key: self.key,
                        to: self.receiver,
                        segment: *segment,
                    });
                }
                SendState::Aborting | SendState::Done | SendState::Skipped => {}
            }
        }
    }

    fn fail(&mut self, now: Instant, vote: Outcome, out: &mut Out) {
        if self.local_vote.is_some() || self.verdict.is_some() {
            return;
        }
        self.local_vote = Some(vote);
        self.abort_pending(out);
        if !self.receiver_lost {
            out.send(
                self.receiver,
                Message::Vote {
                    key: self.key,
                    outcome: vote,
                },
            );
        }
        self.next_retx = now + self.retransmit;
    }

    fn try_finish(&mut self, out: &mut Out) {
        if self.terminal.is_some() {
            return;
        }
        if let Some(v) = self.verdict {
            if self.quiesced() {
                self.send_quiesced(out);
                self.terminal = Some(v);
                out.terminal(
                    self.key,
                    Role::Sender {
                        receiver: self.receiver,
                    },
                    v,
                );
            }
        }
    }

    /// Returns false when `segment` is not a send of this flow.
    pub(crate) fn on_send_done(
        &mut self,
        now: Instant,
        segment: u32,
        ok: bool,
        out: &mut Out,
    ) -> bool {
        let Some(state) = self.sends.get_mut(&segment) else {
            return false;
        };
        let was = *state;
        *state = SendState::Done;
        match was {
            SendState::Done | SendState::Skipped => out.stats.duplicates += 1,
            SendState::InFlight | SendState::Pending if !ok => {
                self.fail(now, Outcome::PeerLost, out)
            }
            _ => {}
        }
        if self.verdict.is_none() && self.pulls() {
            self.next_retx = now + self.retransmit;
        }
        self.try_finish(out);
        true
    }

    pub(crate) fn on_verdict(&mut self, v: Outcome, out: &mut Out) {
        if self.terminal.is_some() {
            // Our confirmation was lost: confirm again.
            out.stats.duplicates += 1;
            self.send_quiesced(out);
            return;
        }
        if self.verdict.is_none() {
            self.verdict = Some(v);
            if !v.is_completed() {
                self.abort_pending(out);
            }
        }
        self.try_finish(out);
    }

    pub(crate) fn give_up(&mut self, now: Instant, why: Outcome, out: &mut Out) {
        // As for a receiver: the caller stops waiting now, agreement gets the bound from now,
        // while something of this flow can still be stopped. A give-up after every send has
        // finished stops nothing: the flow waits for the verdict as before.
        if self.accepted.is_none() || !self.quiesced() {
            self.bound = self.bound.min(now + self.agreement);
        }
        self.fail(now, why, out);
    }

    pub(crate) fn on_peer_lost(&mut self, now: Instant, out: &mut Out) {
        if self.verdict.is_none() {
            // A loss found after the deadline (or after this rank gave up, e.g. the endpoint
            // it force-closed to stop a send) does not change why the request failed here.
            if now >= self.deadline {
                self.fail(now, Outcome::TimedOut, out);
            }
            self.receiver_lost = true;
            self.fail(now, Outcome::PeerLost, out);
            // The only rank that could tell us the verdict is gone: this rank's own reason.
            self.verdict = Some(unagreed(self.local_vote));
            self.abort_pending(out);
        }
        self.receiver_lost = true;
        self.try_finish(out);
    }

    pub(crate) fn on_timeout(&mut self, now: Instant, out: &mut Out) {
        if self.terminal.is_some() {
            return;
        }
        if now >= self.bound {
            let fallback = if self.receiver_lost {
                Outcome::PeerLost
            } else {
                unagreed(self.local_vote)
            };
            let v = *self.verdict.get_or_insert(fallback);
            self.abort_pending(out);
            // Bounded: terminal now even if an abort has not been confirmed; the driver still
            // owns those sends and reaps them.
            self.terminal = Some(v);
            out.terminal(
                self.key,
                Role::Sender {
                    receiver: self.receiver,
                },
                v,
            );
            return;
        }
        if now >= self.deadline && !self.deadline_fired {
            self.deadline_fired = true;
            // A sender whose sends all finished has nothing left to time out: it waits for the
            // verdict until the bound.
            if self.verdict.is_none() && (self.accepted.is_none() || !self.quiesced()) {
                self.fail(now, Outcome::TimedOut, out);
            }
        }
        if now >= self.next_retx && self.verdict.is_none() && self.pulls() && !self.receiver_lost {
            out.send(
                self.receiver,
                Message::Vote {
                    key: self.key,
                    outcome: Outcome::Completed,
                },
            );
            out.stats.retransmits += 1;
            self.next_retx = now + self.retransmit;
        }
        if now >= self.next_retx {
            if let (Some(v), None, false) = (self.local_vote, self.verdict, self.receiver_lost) {
                if v == Outcome::Rejected {
                    out.send(
                        self.receiver,
                        Message::Ready {
                            key: self.key,
                            ready: false,
                        },
                    );
                } else {
                    out.send(
                        self.receiver,
                        Message::Vote {
                            key: self.key,
                            outcome: v,
                        },
                    );
                }
                out.stats.retransmits += 1;
            }
            self.next_retx = now + self.retransmit;
        }
    }

    pub(crate) fn next_timeout(&self) -> Instant {
        if self.terminal.is_some() {
            return self.forget_at;
        }
        let mut t = self.bound;
        if !self.deadline_fired {
            t = t.min(self.deadline);
        }
        if self.verdict.is_none()
            && !self.receiver_lost
            && (self.local_vote.is_some() || self.pulls())
        {
            t = t.min(self.next_retx);
        }
        t
    }

    /// Every send done and accepted, no verdict yet: this rank asks for the verdict (a `Vote`
    /// of `Completed`, which the receiver answers with its verdict) at the retransmit interval.
    fn pulls(&self) -> bool {
        self.accepted == Some(true) && self.local_vote.is_none() && self.quiesced()
    }
}
