//! The move to a new worker: when the probe finds the shared-memory receive queue stuck, every
//! peer is failed, the old worker's ops and endpoints are released, and a fresh worker takes
//! over (listening again on the same address).

use super::super::callbacks::{self, CbEvent};
use super::super::op::{OpSlot, STOP_PEER};
use super::super::shared::Shared;
use super::super::{sys, Event};
use super::setup::new_worker;
use super::Progress;
use crate::error::Result;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How often a listen that failed after a move to a new worker is tried again.
const RELISTEN_EVERY: Duration = Duration::from_secs(1);

/// Fails the ops a destroyed worker still held (see `Progress::release_worker`) as their
/// callbacks would have: counted, out of the in-flight table, and an `OpDone` for the owner
/// (whose receive buffers and region ranges wait for it). Ops the destruction itself ended are
/// left as they are.
pub(super) fn fail_held(shared: &Shared, held: Vec<Arc<OpSlot>>) {
    for s in held.iter().filter(|s| s.state.lock().is_none()) {
        callbacks::finish_slot(shared, s, sys::UCS_ERR_CANCELED, 0);
    }
}

impl Progress {
    /// The probe found the shared-memory receive queue stuck: nothing any peer sends over
    /// shared memory is read (again, if the writer holding it was killed; until it resumes, if
    /// it was stopped). Say so; unless only reporting, fail every peer now (their requests end
    /// `PeerLost` instead of waiting for deadlines that cannot be met) and move to a new worker
    /// with a fresh queue. If that fails, refuse new connections while the old queue is stuck.
    pub(super) fn receive_stuck(&mut self) {
        self.shared.receive_stuck.store(true, Ordering::Release);
        if !self.fail_when_stuck {
            tracing::error!(
                "{}: the shared-memory receive queue of this agent is stuck (a peer process \
                 died or was stopped while writing into it): reported only \
                 (fail_peers_when_stuck is off); after a death it stays deaf \
                 (docs/RELIABILITY.md)",
                self.name
            );
            return;
        }
        // Before any peer is failed: a caller that sees its dial fail from here on knows a move
        // is under way, and that its next dial is served by the new worker.
        self.shared.moves_begun.fetch_add(1, Ordering::AcqRel);
        self.shared.push_event(Event::WorkerMoving);
        let peers: Vec<u64> = self.peers.keys().copied().collect();
        for peer in peers {
            self.fail_peer(peer, sys::UCS_ERR_CONNECTION_RESET, true);
        }
        // The owner takes the failures before the old worker goes, not after: destroying it
        // takes milliseconds (more with thousands of unread messages in it), and meanwhile the
        // owner would report the ranks on it as connected and keep their requests waiting.
        // Its wakes and its control messages (to peers that are all gone: they end at once) go
        // now; its other commands (dials, cancels) wait for the new worker, and for the queue
        // to be reported healthy again (connects are refused while it is stuck).
        let sink_ran = self.run_sink(Instant::now());
        if sink_ran {
            self.send_after_sink();
        }
        match self.renew_worker() {
            Ok(()) => {
                self.shared.receive_stuck.store(false, Ordering::Release);
                let n = self
                    .shared
                    .stats
                    .worker_renewals
                    .fetch_add(1, Ordering::AcqRel)
                    + 1;
                tracing::error!(
                    "{}: the shared-memory receive queue of this agent was stuck (a peer process \
                     died or was stopped while writing into it): every peer was failed and the \
                     agent moved to a new worker (renewal {n}); processes that connect by \
                     worker address need the new one",
                    self.name
                );
            }
            Err(e) => tracing::error!(
                "{}: the shared-memory receive queue of this agent is stuck, and moving to a \
                 new worker failed ({e}): every peer was failed and new connections are refused \
                 while it reports the queue stuck; replace the process",
                self.name
            ),
        }
        if sink_ran {
            self.drain_commands();
        }
    }

    /// Ends everything made from the worker, short of the worker itself: the listener, the
    /// probe, every op (stopped for `reason`), every remote key and endpoint. Memory maps belong
    /// to the context and stay. Returns the ops UCX still holds after a bounded progress, each
    /// forgotten by UCX's side (nothing may cancel it on that worker later): the caller fails
    /// them for their waiters with `fail_held`, once no transfer of theirs can move any more.
    pub(super) fn release_worker(&mut self, reason: u8) -> Vec<Arc<OpSlot>> {
        // Stop listening first: a peer that redials meanwhile must meet a closed port, not a
        // listener that is destroyed under a connection request UCX is still serving on its
        // async thread (UCX 1.13 crashes in ucp_cm_server_conn_request_cb then). Pending
        // requests are rejected before it goes.
        self.handle_callbacks_discard();
        self.listener = None;
        self.probe = None;
        // Tagged messages nobody received stay in UCX's unexpected queue until the worker is
        // destroyed, which logs a warning for each: hundreds of thousands after a peer that
        // flooded an agent without `discard_unexpected` died. Taken now (their receives are
        // stopped with the other ops below), again for what arrives while the endpoints close,
        // and told once.
        let mut strays = self.discard_strays();
        let slots: Vec<Arc<OpSlot>> = self.shared.in_flight.lock().upgraded().collect();
        // The drain receives (posted for senders that gave up) are not in `in_flight`: cancel
        // them too, or UCX never completes them and the reference it holds is never released.
        for s in slots.iter().chain(self.drains.iter()) {
            self.stop_slot(s, reason);
        }
        // A key's id stays known as lost, so that a transfer still asked with it ends as its
        // peer's loss, not as a bad argument.
        self.lost_rkeys.extend(self.rkeys.keys().copied());
        self.rkeys.clear();
        for entry in self.peers.values_mut() {
            drop(entry.ep.take());
            entry.drop_batch(&self.shared);
            entry.held = 0;
        }
        self.ep_to_peer.clear();
        for _ in 0..100 {
            // SAFETY: progress on this thread's own worker.
            if unsafe { sys::ucp_worker_progress(self.worker.0) } == 0 {
                break;
            }
        }
        let late = self.drains.len();
        strays += self.discard_strays();
        for s in &self.drains[late..] {
            self.stop_slot(s, reason);
        }
        if strays > 0 {
            // An owner that discards strays hears of each (`Event::StrayData`) as in any pass;
            // for one that keeps them this is where they are lost, which it should see.
            if self.discard_unexpected {
                tracing::debug!("{}: {strays} strays discarded with the worker", self.name);
            } else {
                tracing::warn!(
                    "{}: {strays} tagged messages that no receive matched were discarded with \
                     the worker",
                    self.name
                );
            }
        }
        self.handle_callbacks_discard();
        let held: Vec<Arc<OpSlot>> = slots
            .into_iter()
            .chain(self.drains.drain(..))
            .filter(|s| s.state.lock().is_none())
            .collect();
        for s in &held {
            s.request.store(std::ptr::null_mut(), Ordering::Release);
        }
        held
    }

    /// Moves the agent to a new worker, with a fresh shared-memory receive queue, after the
    /// probe found the old one stuck (a writer killed mid-write). Every peer has been failed
    /// already. The old worker's ops end (`PeerLost` for their waiters), its endpoints close,
    /// and it is destroyed once the new one is set up: the same handlers, the listener on the
    /// same address, the probe aimed at the new queue, and a new worker address.
    fn renew_worker(&mut self) -> Result<()> {
        let fresh = new_worker(&self.ctx)?;
        let held = self.release_worker(STOP_PEER);
        // SAFETY: the old worker's event fd leaves our epoll set before the worker goes.
        unsafe {
            libc::epoll_ctl(
                self.epoll_fd(),
                libc::EPOLL_CTL_DEL,
                self.worker_efd,
                std::ptr::null_mut(),
            );
        }
        self.worker_efd = -1;
        // Dropping the old worker destroys it: nothing made from it is left. Only then are the
        // ops it still held failed for their waiters, who may reuse their buffers at once.
        drop(std::mem::replace(&mut self.worker, fresh));
        self.shared.forget_held_sends();
        fail_held(&self.shared, held);
        // SAFETY: a fresh worker of ours, under the driver lock.
        unsafe { self.attach_worker() }?;
        if self.listen_at.is_some() {
            // The same address as before, so that peers dial it as they always did.
            self.relisten = Some((Instant::now(), 0));
            self.retry_listen();
        }
        Ok(())
    }

    /// Listens again on the address the old worker listened on, after a move; retried once a
    /// second while it fails (a socket may still hold the port for a while). Without it the
    /// new worker still serves the ranks it dials, and those that have its worker address.
    pub(super) fn retry_listen(&mut self) {
        let (Some((due, tries)), Some(addr)) = (self.relisten, self.listen_at) else {
            return;
        };
        if Instant::now() < due {
            return;
        }
        // SAFETY: our worker, under the driver lock.
        match unsafe { self.listen(addr) } {
            Ok(_) => {
                self.relisten = None;
                if tries > 0 {
                    tracing::warn!("{}: listening on {addr} again", self.name);
                }
            }
            Err(e) => {
                if tries == 0 {
                    tracing::error!(
                        "{}: the new worker could not listen on {addr} again ({e}); retrying \
                         every second",
                        self.name
                    );
                }
                self.relisten = Some((Instant::now() + RELISTEN_EVERY, tries + 1));
            }
        }
    }

    fn handle_callbacks_discard(&mut self) {
        let mut evs: Vec<CbEvent> = self.cb_batch.drain(..).collect();
        evs.extend(callbacks::take_events(&self.shared, Vec::new()));
        for ev in evs {
            if let CbEvent::ConnRequest(req) = ev {
                // SAFETY: an unanswered connection request of our listener.
                if let Some(l) = &self.listener {
                    unsafe { sys::ucp_listener_reject(l.0, req) };
                }
            }
        }
    }
}
