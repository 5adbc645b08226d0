//! The sending (context) side: the next advertisement, its answer, and the sends of its
//! segments (from host memory, or staged from a CUDA device).

use super::glue;
use super::waiters::WaitKey;
use super::{key_err, reap_grace, Advertisement, Engine};
use crate::error::{Error, ErrorKind, Outcome, Result};
use crate::proto::{RankId, RequestKey};
use crate::timeline::{self, Stage};
use crate::transport::cuda::Staging;
use smallvec::SmallVec;
use std::time::Instant;

impl Engine {
    /// Context side: the next advertisement, waiting until `deadline` or `cancel()`. Several
    /// threads may wait at once: each advertisement goes to exactly one of them, and wakes only
    /// one (as do notifications, for [`Engine::wait_for_notification`]). One whose request
    /// ended before it was taken is still handed out (its answer is no error, and the send and
    /// the sender's wait give the end); one whose rank's process was replaced since by a new
    /// process of that rank is not (nor are that process's notifications).
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
            // From here the caller's calls on this key and rank are this request's.
            core.superseded.remove(&(a.key, a.from));
            Some(a)
        })
        .inspect(|_| timeline::mark(Stage::AdvertisementTaken))
    }

    /// Context side: accept (`ready`) or reject an advertisement before any data moves.
    /// `UnknownRequest` when no advertisement of `key` came from `from`, `InvalidArgument` when
    /// it was answered already. An answer to a request that ended before it (the receivers gave
    /// it up or cancelled it: a race, not misuse) is no error and changes nothing: a send then
    /// returns the end, and [`Engine::wait`] the agreed verdict; so is an answer made after
    /// the protocol core has forgotten the request (the engine remembers its end for 10
    /// minutes, as for [`Engine::cancel`]). After `from`'s process was replaced by another,
    /// `accept`, [`Engine::send`] and [`Engine::wait`] on a key of the old process's requests
    /// are the old request's (ended, `PeerLost` if it ran) until the new process's
    /// advertisement of that key is taken, even if it came already.
    pub fn accept(&self, key: RequestKey, from: RankId, ready: bool) -> Result<()> {
        let _returned = timeline::on_return(Stage::AcceptReturned);
        let mut core = self.inner.core.lock();
        // `UnknownRequest` when no advertisement of `key` came from `from` (one look-up).
        let r = core.accept(Instant::now(), key, from, ready);
        self.inner.flush(&mut core);
        r
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
    /// Returns by the earlier of `deadline` and the request's deadline (plus the drain bound);
    /// called at or past it, posts nothing and gives the request up, `TimedOut` at once.
    ///
    /// Misuse is an error at once and changes nothing: an unknown request (`UnknownRequest`), a
    /// send before accept, no segment at all, a segment never advertised, a segment sent twice,
    /// or a size other than advertised (`InvalidArgument`). A send on a request this rank
    /// refused returns `Rejected`, whatever the segment (the refusal drops its buffer list).
    pub fn send_segments(
        &self,
        key: RequestKey,
        to: RankId,
        segments: &[(u32, &[u8])],
        deadline: Instant,
        cancel: Option<&dyn Fn() -> bool>,
    ) -> Result<Outcome> {
        self.send_segments_telling(key, to, segments, deadline, cancel, &mut true)
    }

    /// [`Engine::send_segments`], clearing `all_released` when UCX still holds a send as it
    /// returns (of plain memory: stopped, and its endpoint's close did not run within
    /// `CLOSE_RUN_LIMIT`; or of a region, left to UCX): its bytes may still be read.
    fn send_segments_telling(
        &self,
        key: RequestKey,
        to: RankId,
        segments: &[(u32, &[u8])],
        deadline: Instant,
        cancel: Option<&dyn Fn() -> bool>,
        all_released: &mut bool,
    ) -> Result<Outcome> {
        let _returned = timeline::on_return(Stage::SendReturned);
        let inner = &self.inner;
        let mut core = inner.core.lock();
        if segments.is_empty() {
            // Nothing to send is no send: without this, any key (known or not) came back
            // `Completed` with nothing sent.
            return Err(
                if core.ep.knows_send(key, to) || core.forgotten_send(key, to).is_some() {
                    key_err(ErrorKind::InvalidArgument, key, "no segment given")
                } else {
                    key_err(
                        ErrorKind::UnknownRequest,
                        key,
                        &format!("no advertisement from {to} is known here"),
                    )
                },
            );
        }
        // Per segment, inline for the usual one or two: no allocation on this path.
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
            match core.check_send(key, to, *segment, data.len() as u64)? {
                Ok(d) => descs.push(d),
                Err(ended) => return Ok(ended),
            }
        }
        let until = match send_until(inner, &mut core, key, to, deadline) {
            Ok(until) => until,
            Err(ended) => return Ok(ended),
        };
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
                    let abort = op.abort_handle();
                    core.sends.insert((key, to, *segment), abort.clone());
                    ops.push((*segment, op, abort));
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
            let (segment, op, abort) = &mut done[i];
            let segment = *segment;
            // Only a caller's cancel is polled: the core's abort (`Action::AbortSend`) wakes
            // the wait itself, and a send with no cancel sleeps until it ends.
            let stop = || {
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
            let stop: Option<&dyn Fn() -> bool> = cancel.map(|_| &stop as _);
            let r = op.wait_telling(until, stop, |why| {
                // At the deadline the vote goes out before the send is stopped, for the same
                // reason, and so that the agreement runs while the stop takes its grace. Not
                // after the core's abort: the verdict is already known.
                if !abort.is_aborted() && !told.replace(true) {
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
            *all_released &= quiesced;
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
                let _ = core.give_up(now, key, why);
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
        {
            let mut core = self.inner.core.lock();
            if let Err(ended) = core.check_send(key, to, segment, len as u64)? {
                return Ok(ended);
            }
            // Nor a pinned buffer and a copy for a send that posts nothing.
            if let Err(ended) = send_until(&self.inner, &mut core, key, to, deadline) {
                return Ok(ended);
            }
        }
        let mut staging = Staging::new(device, len)?;
        staging.from_device(device_addr, len)?;
        let mut released = true;
        let r = self.send_segments_telling(
            key,
            to,
            &[(segment, staging.host_slice(len)?)],
            deadline,
            cancel,
            &mut released,
        );
        if !released {
            // UCX still holds the send (its endpoint's close did not run in time): the pinned
            // buffer must not go back to the pool, where the next staged transfer would reuse
            // it while UCX reads it, nor be freed under UCX. Kept for good: one buffer per
            // such stop, rare (a progress thread held past `CLOSE_RUN_LIMIT`).
            tracing::warn!(%key, len, "a staged send UCX still holds: its pinned buffer is kept");
            std::mem::forget(staging);
        }
        r
    }
}

/// Until when a send of `key` to `to` called with `deadline` may run: the earlier of that and
/// the request's own deadline. A send called at or past it posts nothing (`Err(TimedOut)`): a
/// rendezvous started then is stopped at once, and a receiver that cannot drain it within the
/// grace costs the pair its endpoint, failing every other request on it, for a transfer that
/// should never have begun. The request is given up here `TimedOut`, as a wait past its deadline
/// gives it up (the deadline rule: a deadline in the past means "do not wait").
fn send_until(
    inner: &glue::Inner,
    core: &mut glue::Core,
    key: RequestKey,
    to: RankId,
    deadline: Instant,
) -> std::result::Result<Instant, Outcome> {
    let until = core
        .ep
        .send_deadline(key, to)
        .map_or(deadline, |d| d.min(deadline));
    let now = Instant::now();
    if now < until {
        return Ok(until);
    }
    let _ = core.give_up(now, key, Outcome::TimedOut);
    inner.flush(core);
    Err(Outcome::TimedOut)
}
