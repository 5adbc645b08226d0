//! The sender's state machine: one (request, receiver) pair on a context (sending) rank.
use crate::vecmap::VecMap;
use std::time::{Duration, Instant};

use super::{unagreed, Action, Config, Event, Out, Role};
use crate::error::Outcome;
use crate::id::{RankId, RequestKey};
use crate::timers::Machine;
use crate::wire::{BufferDesc, Message};

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

/// How long past its linger a flow that ended is kept while a send of it is still not reported
/// done ([`SendFlow::is_finished`]). The engine reports every send it started when the
/// application's call returns, by the request's deadline and the stop's limits (seconds); this
/// bounds the flow's memory should a report never come.
pub(crate) const UNREPORTED_KEEP: Duration = Duration::from_secs(60);

/// One (request, receiver) pair on a sending rank.
#[derive(Debug)]
pub(crate) struct SendFlow {
    key: RequestKey,
    receiver: RankId,
    /// When its advertisement arrived.
    started: Instant,
    deadline: Instant,
    bound: Instant,
    agreement: Duration,
    forget_at: Instant,
    /// See `RecvRequest::tomb_until`.
    pub(crate) tomb_until: Instant,
    linger: Duration,
    retransmit: Duration,
    next_retx: Instant,
    buffers: Vec<BufferDesc>,
    accepted: Option<bool>,
    sends: VecMap<u32, SendState>,
    local_vote: Option<Outcome>,
    verdict: Option<Outcome>,
    receiver_lost: bool,
    terminal: Option<Outcome>,
    deadline_fired: bool,
    /// Its receiver's process was replaced while a send of this flow still ran
    /// ([`SendFlow::retire`]).
    retired: bool,
    /// Retired: what the new process sent of its request of this key, to start it once this
    /// flow is gone (its receiver's resends back off, up to 32 intervals apart).
    held: Option<Held>,
}

/// What a retired flow keeps of the new process's request of its key ([`SendFlow::hold_advert`]).
#[derive(Debug)]
struct Held {
    /// When its last advertisement came.
    at: Instant,
    advert: Message,
    /// Its verdict, if it came too (the request ended there before it started here).
    verdict: Option<Outcome>,
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
            started: now,
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
            sends: VecMap::new(),
            local_vote: None,
            verdict: None,
            receiver_lost: false,
            terminal: None,
            deadline_fired: false,
            retired: false,
            held: None,
        }
    }

    /// Forgotten now: ended, its sends all reported done, and its linger over (retired: at
    /// once). A send still not reported keeps it past its linger (a flow forgotten then could
    /// take that late report for another request of its key: with its tombstone gone, or none
    /// made, a new process's request of the key), up to [`UNREPORTED_KEEP`] more.
    pub(crate) fn is_finished(&self, now: Instant) -> bool {
        self.terminal.is_some()
            && if self.quiesced() {
                self.retired || now >= self.forget_at
            } else {
                now >= self.unreported_until()
            }
    }

    /// When a flow whose sends are not all reported done is forgotten anyway.
    fn unreported_until(&self) -> Instant {
        self.forget_at
            .checked_add(UNREPORTED_KEEP)
            .unwrap_or(self.forget_at)
    }

    /// Another process holds its receiver's rank now, and this flow still has a send in
    /// flight (the old process's loss asked it to stop; the application's send has not
    /// returned yet), whether or not it has ended (its bound does not wait for that send):
    /// the new process's advertisement of its key is not this flow's, so it is no longer
    /// answered here, and this flow leaves no tombstone, which would answer it. It is
    /// forgotten as soon as it has ended and its sends are done. What comes from its
    /// rank from then on is the new process's ([`SendFlow::hold_advert`],
    /// [`SendFlow::on_verdict`], [`SendFlow::on_peer_lost`]). Retired again (another process
    /// took the rank once more), it drops what it kept: that process is gone too.
    pub(crate) fn retire(&mut self) {
        self.retired = true;
        self.held = None;
    }

    pub(crate) fn is_retired(&self) -> bool {
        self.retired
    }

    /// Retired: keeps `advert` (the new process's of this key, come at `now`; the last one
    /// replaces those before) for [`SendFlow::take_held`].
    pub(crate) fn hold_advert(&mut self, now: Instant, advert: Message) {
        let verdict = self.held.take().and_then(|h| h.verdict);
        self.held = Some(Held {
            at: now,
            advert,
            verdict,
        });
    }

    /// What [`SendFlow::hold_advert`] kept: the advertisement, with what is left at `now` of
    /// the deadline it carried, and the new process's verdict of it if one came (to be handled
    /// right after, as it would have been had the advertisement started a flow at once); none
    /// if nothing is left of the deadline.
    pub(crate) fn take_held(&mut self, now: Instant) -> Option<(Message, Option<Outcome>)> {
        let Held {
            at,
            mut advert,
            verdict,
        } = self.held.take()?;
        if let Message::Advertise { timeout_ms, .. } = &mut advert {
            let spent = now.saturating_duration_since(at).as_millis();
            let left = u128::from(*timeout_ms)
                .checked_sub(spent)
                .filter(|&l| l > 0)?;
            *timeout_ms = left as u32;
        }
        Some((advert, verdict))
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
        if self.accepted == Some(false) {
            // Refused here (its buffer list is gone): whatever the segment, the request ended.
            return Err(SendRefusal::Ended(
                self.ended().unwrap_or(Outcome::Rejected),
            ));
        }
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

    /// Every send started has been reported done (none was, or none is left in flight).
    pub(crate) fn quiesced(&self) -> bool {
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

    /// The application's answer to the advertisement. Returns false when it was answered
    /// already (misuse). One that comes after the request ended unanswered (a verdict or a local
    /// failure got there first: a race with the receivers, not misuse) changes nothing, and the
    /// sends then report the end (`check_send`).
    pub(crate) fn accept(&mut self, now: Instant, ready: bool, out: &mut Out) -> bool {
        if self.accepted.is_some() {
            return false;
        }
        if self.ended().is_some() {
            return true;
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
            // Ready(false) is this rank's vote. Nothing will be sent: the buffer list goes (up
            // to 1024 descriptors, 40 KiB), and the flow that waits for the verdict is small. A
            // refusal is how an engine sheds advertisements it cannot queue, and a receiver
            // that never answers keeps the flow to the deadline it chose.
            self.local_vote = Some(Outcome::Rejected);
            self.next_retx = now + self.retransmit;
            self.buffers = Vec::new();
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
                    self.started,
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
        if self.retired {
            // The new process's verdict of its request of this key (this flow's receiver is
            // gone): kept with its advertisement. Without one there is nothing to end here.
            if let Some(h) = self.held.as_mut() {
                h.verdict.get_or_insert(v);
            }
            return;
        }
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
        if self.retired {
            // The new process is lost too: what it advertised goes with it.
            self.held = None;
        }
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
                self.started,
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

    /// Every send done and accepted, no verdict yet: this rank asks for the verdict (a `Vote`
    /// of `Completed`, which the receiver answers with its verdict) at the retransmit interval.
    fn pulls(&self) -> bool {
        self.accepted == Some(true) && self.local_vote.is_none() && self.quiesced()
    }
}

impl Machine for SendFlow {
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
        if self.terminal.is_some() {
            return match (self.quiesced(), self.retired) {
                // Due at once.
                (true, true) => self.started,
                (true, false) => self.forget_at,
                // Moved earlier by the last report (`on_send_done` arms the timer again).
                (false, _) => self.unreported_until(),
            };
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

    fn lingers(&self) -> bool {
        self.terminal.is_some()
    }
}
