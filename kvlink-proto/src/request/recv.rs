//! The receiver's state machine: one request on a generation (receiving) rank.
use crate::vecmap::VecMap;
use smallvec::SmallVec;
use std::time::{Duration, Instant};

use super::{unagreed, Action, Config, Out, Role};
use crate::agreement::reduce;
use crate::error::Outcome;
use crate::id::{RankId, RequestKey};
use crate::pool::Lease;
use crate::timers::Machine;
use crate::wire::{BufferDesc, Message};

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
    segs: VecMap<u32, Seg>,
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
    /// When `start_receive` started it.
    started: Instant,
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
    /// How many times the advertisement went out again unanswered, and a failure verdict
    /// unconfirmed (their back-offs).
    advert_resends: u32,
    verdict_resends: u32,
    request_info: Vec<u8>,
    flows: VecMap<RankId, InFlow>,
    local_vote: Option<Outcome>,
    /// External agreement: the vote waiting to be handed to the collective.
    pub(crate) pending_contribution: Option<Outcome>,
    /// Coordinator only (message agreement): every receiver's vote so far.
    votes: VecMap<RankId, Outcome>,
    verdict: Option<Outcome>,
    terminal: Option<Outcome>,
    deadline_fired: bool,
    /// This rank ended `PeerLost` for losing its coordinator, which has not heard it: told
    /// each time the coordinator's rank is bound again while this request is known here
    /// (`on_peer_bound`; a connection that breaks again may lose it), until the coordinator's
    /// process is replaced (`forget_coordinator`).
    owes_coordinator: bool,
    /// The senders' answer so far: `Some(true)` once one said ready or its data landed (the
    /// first landing proves acceptance), `Some(false)` once one refused (that wins).
    answer: Option<bool>,
}

/// The buffers of one sender, as `start_receive` takes them.
pub(crate) type FlowSpec = (RankId, Vec<(Lease, BufferDesc)>);

impl RecvRequest {
    /// The length of the request's largest buffer, over all its senders.
    pub(crate) fn largest_segment(&self) -> u64 {
        self.flows
            .values()
            .flat_map(|f| f.segs.values())
            .map(|s| s.desc.len)
            .max()
            .unwrap_or(0)
    }

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
            started: now,
            deadline,
            bound,
            agreement: cfg.agreement_bound,
            forget_at: bound + cfg.linger,
            tomb_until: bound + cfg.linger,
            linger: cfg.linger,
            retransmit: cfg.retransmit,
            next_retx: now + cfg.retransmit,
            advert_resends: 0,
            verdict_resends: 0,
            request_info,
            flows,
            local_vote: None,
            pending_contribution: None,
            votes: VecMap::new(),
            verdict: None,
            terminal: None,
            deadline_fired: false,
            owes_coordinator: false,
            answer: None,
        };
        r.advertise(now, out, false);
        r
    }

    fn is_coordinator(&self) -> bool {
        !self.external && self.me == self.coordinator
    }

    /// The ranks whose vote or ready answer this request answers (`on_vote`): its senders and,
    /// at the coordinator, the other receivers. Its tombstone answers them alone.
    pub(crate) fn askers(&self) -> SmallVec<[RankId; 2]> {
        let mut ranks: SmallVec<[RankId; 2]> = self.flows.keys().copied().collect();
        if self.is_coordinator() {
            ranks.extend(self.receivers.iter().copied().filter(|r| *r != self.me));
        }
        ranks
    }

    pub(crate) fn is_finished(&self, now: Instant) -> bool {
        self.terminal.is_some() && now >= self.forget_at
    }

    pub(crate) fn verdict(&self) -> Option<Outcome> {
        self.verdict
    }

    /// The senders' answer (see `answer`) while the request runs; once it has ended, its end's:
    /// `Some(true)` for `Completed`, `Some(false)` for `Rejected`, else `None` (a landing before
    /// a timeout does not make the request ready after it).
    pub(crate) fn answer(&self) -> Option<bool> {
        match self.terminal {
            None => self.answer,
            Some(Outcome::Completed) => Some(true),
            Some(Outcome::Rejected) => Some(false),
            Some(_) => None,
        }
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
            // From now on the collective is polled at the retransmit interval: not at the
            // advertisement's backed-off resend, up to 32 intervals away.
            self.next_retx = now + self.retransmit;
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
                out.send(*r, verdict_to_send(self.key, verdict));
            }
        }
        for (sender, flow) in self.flows.iter_mut() {
            if !flow.lost {
                out.send(*sender, verdict_to_send(self.key, verdict));
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
                        // Fenced: the driver keeps the buffer out of use until UCX releases
                        // the receive; a landing after this changes nothing here.
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
        out.terminal(self.key, Role::Receiver, outcome, self.started);
    }

    pub(crate) fn on_ready(&mut self, now: Instant, from: RankId, ready: bool, out: &mut Out) {
        let Some(flow) = self.flows.get_mut(&from) else {
            out.stats.unknown_dropped += 1;
            return;
        };
        let again = std::mem::replace(&mut flow.answered, true);
        if let Some(v) = self.verdict {
            // A refusal sent again is the refusing sender's pull of the verdict (as a `Vote`
            // is a failing sender's): answer it now, as the tombstone does once the request
            // is forgotten, rather than leave the sender to the backed-off push alone. A first
            // answer that comes after the verdict gets it too.
            if again {
                out.stats.duplicates += 1;
            }
            out.send(from, verdict_to_send(self.key, v));
            return;
        }
        if ready {
            self.answer.get_or_insert(true);
        } else {
            self.answer = Some(false);
            self.set_local_vote(now, Outcome::Rejected, out);
        }
    }

    /// A vote from one of this request's senders (its own failure) or, at the coordinator, from
    /// another receiver. This rank's own vote never comes as a message (`set_local_vote` records
    /// it): one that names this rank is dropped, as `on_verdict` drops a verdict from it.
    pub(crate) fn on_vote(&mut self, now: Instant, from: RankId, vote: Outcome, out: &mut Out) {
        if let Some(flow) = self.flows.get_mut(&from) {
            flow.answered = true;
            if self.verdict.is_some() {
                // It has not heard the verdict yet: answer now rather than at the next tick.
                out.send(
                    from,
                    verdict_to_send(self.key, self.verdict.unwrap_or(vote)),
                );
            } else if !vote.is_completed() {
                self.set_local_vote(now, vote, out);
            }
        } else if self.is_coordinator() && from != self.me && self.receivers.contains(&from) {
            if let Some(v) = self.verdict {
                out.send(from, verdict_to_send(self.key, v));
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
        // A coordinator decides `Completed` only once every receiver voted it, and this rank
        // votes it only once all its segments landed: a `Completed` before that is a faulty
        // coordinator's (or a forged one), and taking it would end this rank `Completed` with
        // bytes missing. Dropped as a bad message; the rank goes on to its own end.
        if v.is_completed() && !self.all_landed() {
            out.stats.bad_frames += 1;
            return;
        }
        self.set_verdict(now, v, out);
    }

    /// The external collective's verdict for this receive (it is waiting for one). A
    /// `Completed` before this rank's own landings is refused as a coordinator's would be
    /// (`on_verdict`): a faulty collective, or one answering for an earlier request under the
    /// same key, would end this rank `Completed` with bytes missing. The rank then goes on to
    /// its own end.
    pub(crate) fn on_external_verdict(&mut self, now: Instant, v: Outcome, out: &mut Out) {
        if v.is_completed() && !self.all_landed() {
            out.stats.bad_frames += 1;
            return;
        }
        self.set_verdict(now, v, out);
    }

    /// Whether every segment of this rank's flows has landed.
    fn all_landed(&self) -> bool {
        self.flows
            .values()
            .all(|f| f.segs.values().all(|s| matches!(s.state, SegState::Landed)))
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
        self.answer.get_or_insert(true);
        let seg = flow.segs.get_mut(&segment).expect("checked above");
        match seg.state {
            SegState::Posted | SegState::CancelRequested => seg.state = SegState::Landed,
            SegState::Landed | SegState::Reaped => {
                out.stats.duplicates += 1;
                return true;
            }
        }
        if self.all_landed() {
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
            // Only where the loss decided it: a second report of the loss must not clear it.
            if self.verdict.is_none() {
                self.owes_coordinator = true;
            }
            self.set_verdict(now, Outcome::PeerLost, out);
        } else if self.is_coordinator() && self.verdict.is_none() {
            // Whatever it voted: a receiver lost before the verdict cannot learn it (it ends
            // `PeerLost` at once if it is alive and lost this rank too), so its earlier
            // `Completed` must not let this rank decide `Completed` for the senders.
            self.votes.insert(rank, Outcome::PeerLost);
            self.try_decide(now, out);
        }
    }

    /// `rank` is bound again: if it is the coordinator this rank lost before it could hear
    /// the verdict, it learns why this rank ended (a coordinator that starts the request only
    /// now would otherwise wait for this rank's vote until its deadline). At every such bind:
    /// the connection may break again before the vote gets there, and a repeat is harmless (the
    /// coordinator counts it a duplicate, or answers it with its verdict).
    pub(crate) fn on_peer_bound(&mut self, rank: RankId, out: &mut Out) {
        if !self.owes_coordinator || rank != self.coordinator {
            return;
        }
        out.send(
            rank,
            Message::Vote {
                key: self.key,
                outcome: self.verdict.unwrap_or(Outcome::PeerLost),
            },
        );
    }

    /// The vote this rank still owes its coordinator (see `owes_coordinator`), if any: to
    /// whom, and what.
    pub(crate) fn owed_vote(&self) -> Option<(RankId, Outcome)> {
        self.owes_coordinator
            .then(|| (self.coordinator, self.verdict.unwrap_or(Outcome::PeerLost)))
    }

    /// Another process now holds `rank`: if it is this request's coordinator, the process that
    /// needed this rank's vote is gone, and the new one's requests are not this one (its keys
    /// start again): nothing is owed to it.
    pub(crate) fn forget_coordinator(&mut self, rank: RankId) {
        if rank == self.coordinator {
            self.owes_coordinator = false;
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
        let mut every = self.retransmit;
        match (self.verdict, self.local_vote) {
            (None, None) => {
                // Backed off: a sender with a long queue of advertisements (4096 requests in
                // flight to a busy prefill) would otherwise get each again every interval.
                self.advertise(now, out, true);
                self.advert_resends = self.advert_resends.saturating_add(1);
                every = super::backed_off(every, self.advert_resends);
            }
            (None, Some(v)) if !self.external && !self.is_coordinator() => out.send(
                self.coordinator,
                Message::Vote {
                    key: self.key,
                    outcome: v,
                },
            ),
            (Some(v), _) if !v.is_completed() => {
                // Backed off too: after a mass failure (thousands of requests cancelled at once
                // towards a sender that is alive but slow) each unconfirmed verdict would
                // otherwise go out again every interval until linger. A sender that missed it
                // does not depend on this push alone: it pulls the verdict once its sends are
                // done, and its own vote at its deadline is answered with it.
                self.verdict_resends = self.verdict_resends.saturating_add(1);
                every = super::backed_off(every, self.verdict_resends);
                for (sender, flow) in &self.flows {
                    if !flow.quiesced && !flow.lost {
                        out.send(*sender, verdict_to_send(self.key, v));
                    }
                }
            }
            _ => {}
        }
        out.stats.retransmits += (out.transmits.len() - before) as u64;
        self.next_retx = now + every;
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
}

impl Machine for RecvRequest {
    fn settle(&mut self, now: Instant) {
        let Some(outcome) = self.terminal else {
            return;
        };
        let linger = super::linger_after(outcome, self.linger);
        if self.forget_at > now + linger {
            self.forget_at = now + linger;
        }
    }

    fn next_timeout(&self) -> Instant {
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

    fn lingers(&self) -> bool {
        self.terminal.is_some()
    }
}

/// The `Verdict` of `key`: `outcome`, as this rank sends it to a sender or another receiver.
fn verdict_to_send(key: RequestKey, outcome: Outcome) -> Message {
    Message::Verdict { key, outcome }
}
