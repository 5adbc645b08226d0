//! Waiting: `wait` for a request's agreed end, `cancel` and giving up, and the one blocking
//! loop every call waits in (`block`: drive progress for a window, then sleep on a waiter).

use super::glue::{Core, Inner};
use super::waiters::{sleep, WaitKey};
use super::{key_err, Engine};
use crate::error::{Error, ErrorKind, Outcome, Result};
use crate::proto::{RequestKey, Role};
use crate::timeline::{self, Stage};
use crate::transport::ucx::{CancelPace, CANCEL_POLL, CLOSE_RUN_LIMIT};
use parking_lot::MutexGuard;
use smallvec::SmallVec;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// After a caller gives up: what the wait allows past the agreement bound for the fence (a
/// force-closed endpoint's receives are released by UCX within a few milliseconds).
const SETTLE_SLACK: Duration = Duration::from_millis(30);

impl Engine {
    /// Waits for the agreed end of `key` on this rank as `role`, and takes it (a second wait
    /// for the same key and role is `UnknownRequest`, also when the first returned before the
    /// end came, which is then not kept for anyone; one made while another call waits for it
    /// is `InvalidArgument` at once). At `deadline` (or on `cancel()`) this
    /// rank gives up on the request (`TimedOut` / `Cancelled`, agreed with the other ranks
    /// within the agreement bound), so the call returns by the deadline plus that bound plus
    /// a few milliseconds, with buffers that nothing can write any more (outside the fenced
    /// ranges of a region: [`Engine::region_fenced_ranges`]).
    pub fn wait(
        &self,
        key: RequestKey,
        role: Role,
        deadline: Instant,
        cancel: Option<&dyn Fn() -> bool>,
    ) -> Result<Outcome> {
        let _span = timeline::span(Stage::WaitCalled, Stage::WaitReturned);
        // The end of a replaced process's request that ended while this call waited for it
        // (since before the bind, or after) comes in a slot of its own (`retired_ends`): in
        // `terminals` the new process's request of the key puts its own.
        let take = |core: &mut Core| {
            let retired = match role {
                Role::Sender { receiver } => core.retired_ends.remove(&(key, receiver)),
                Role::Receiver => None,
            };
            retired.or_else(|| core.terminals.remove(&(key, role)))
        };
        // The largest buffer a receive waits for: a bulk one is not polled for.
        let mut largest = 0;
        {
            let mut core = self.inner.core.lock();
            let busy = || {
                key_err(
                    ErrorKind::InvalidArgument,
                    key,
                    "another call is already waiting for it in that role (its end goes to that call)",
                )
            };
            // Looked at before the end is taken: an end that came while the waiting call was
            // awake (driving progress, or in its cancel check) is that call's.
            if core.waited.contains(&(key, role)) {
                return Err(busy());
            }
            if core.answered_early.contains_key(&(key, role)) {
                return Err(key_err(
                    ErrorKind::UnknownRequest,
                    key,
                    "already waited for (that wait returned before the request's end came)",
                ));
            }
            if let Role::Sender { receiver } = role {
                // A request of a replaced process, whose key another process's may now have
                // (an end kept under that key may be the new one's). One still running there
                // is waited for below: its end comes to this call.
                let old = (key, receiver);
                let running = core.retired_sends.contains(&old);
                if let Some(s) = core.superseded.get_mut(&old) {
                    if s.waited {
                        return Err(key_err(
                            ErrorKind::UnknownRequest,
                            key,
                            "already waited for (its receiver's process was replaced since)",
                        ));
                    }
                    if !running {
                        s.waited = true;
                        return Ok(s.end);
                    }
                }
            }
            if let Some(o) = take(&mut core) {
                return Ok(o);
            }
            let known = core.ep.running(key, role)
                || (role == Role::Receiver && core.deferred.contains_key(&key));
            if !known {
                return Err(key_err(
                    ErrorKind::UnknownRequest,
                    key,
                    "not running here in that role (never started, or already waited for)",
                ));
            }
            core.waited.insert((key, role));
            if role == Role::Receiver {
                largest = core.ep.largest_receive_segment(key).unwrap_or(0);
            }
        }
        let _owner = WaitOwner {
            inner: &self.inner,
            key: (key, role),
        };
        let terminal = WaitKey::Terminal(key, role);
        let why = match self.block_for(largest, terminal, deadline, cancel, take) {
            Ok(o) => return Ok(o),
            // The check said so once: a check that answers true only once (an edge, not a
            // flag) is not asked again here.
            Err(Ended::Cancelled) => Outcome::Cancelled,
            // At the deadline (or the engine's stop), a cancel raised meanwhile still counts.
            Err(_) if cancel.is_some_and(|c| c()) => Outcome::Cancelled,
            Err(_) => Outcome::TimedOut,
        };
        self.give_up(key, why);
        let settle = Instant::now() + self.inner.agreement_bound + SETTLE_SLACK;
        if let Some(o) = self.block(WaitKey::Terminal(key, role), settle, None, take) {
            return Ok(o);
        }
        if role == Role::Receiver && self.holds_plain_receive(key) {
            // UCX may still write the caller's memory until the progress thread has stopped
            // the receive (cancel, or its endpoint's close), and that thread may be inside one
            // long UCX call: hold on for it, as a stopped send does (`CLOSE_RUN_LIMIT`).
            let limit = Instant::now() + CLOSE_RUN_LIMIT;
            if let Some(o) = self.block(WaitKey::Terminal(key, role), limit, None, take) {
                return Ok(o);
            }
        }
        let mut core = self.inner.core.lock();
        // The end may have come while the lock was let go since the last look.
        if let Some(o) = take(&mut core) {
            return Ok(o);
        }
        core.answered_early.insert((key, role), (), Instant::now());
        if let Role::Sender { receiver } = role {
            // No verdict by the bound (the receiver stuck, or this thread's progress): an end
            // of this rank's own, as the rule allows; unsettled only while a send of the
            // request is still in flight (its bytes may still be read from caller memory).
            if !core
                .sends
                .keys()
                .any(|&(k, to, _)| k == key && to == receiver)
            {
                tracing::info!(%key, "wait returns {why:?}: no verdict by the bound, its sends done");
                return Ok(why);
            }
        }
        tracing::error!(%key, "wait returns before the request settled");
        core.counters.unsettled_returns += 1;
        if role == Role::Receiver {
            // The request's receives that UCX still holds may still be written. In a region
            // their ranges are fenced now (the `Fence` action that would do it has not run:
            // the progress thread is stuck), or a new request would be handed memory UCX may
            // still write, and the region counted in use by a running request.
            let held: SmallVec<[u64; 16]> = core
                .recv_ops
                .iter()
                .filter(|(_, r)| r.key == key)
                .map(|(&id, _)| id)
                .collect();
            for id in held {
                core.regions.fence(id);
            }
        }
        Ok(why)
    }

    /// Whether UCX still holds a receive of `key` into plain caller memory (not a region's).
    fn holds_plain_receive(&self, key: RequestKey) -> bool {
        let core = self.inner.core.lock();
        core.recv_ops
            .iter()
            .any(|(&id, r)| r.key == key && !r.op.is_quiesced() && !core.regions.holds(id))
    }

    /// Cancels `key` on this rank; the cancel is agreed with every rank of the request. A
    /// request that has already ended here, in either role, is left as it ended and the call
    /// succeeds: a cancel that races the end is no error, on the sending side as on the
    /// receiving one (ended keys are remembered as long as replays are refused, 10 minutes).
    /// A key not known here (never run, or ended longer ago than that, or pushed out of that
    /// memory by its cap of 2^20 keys) is `UnknownRequest`.
    ///
    /// On a context rank, the sends of `key` to a rank whose process was replaced since are
    /// the old process's request's until its successor's advertisement of that key is taken
    /// (as for [`Engine::accept`]): that old request has ended, and the successor's request of
    /// the key, if any, is not cancelled.
    pub fn cancel(&self, key: RequestKey) -> Result<()> {
        let mut core = self.inner.core.lock();
        let r = core.give_up(Instant::now(), key, Outcome::Cancelled);
        self.inner.flush(&mut core);
        match r {
            Ok(()) => Ok(()),
            Err(_) if core.ended_here(key) || core.superseded_here(key) => Ok(()),
            Err(e) => Err(Error::new(ErrorKind::UnknownRequest, e.message)),
        }
    }

    /// Gives `key` up on this rank (sparing what another process's request of the key is:
    /// `Core::spared`).
    pub(super) fn give_up(&self, key: RequestKey, why: Outcome) {
        let mut core = self.inner.core.lock();
        let _ = core.give_up(Instant::now(), key, why);
        self.inner.flush(&mut core);
    }

    /// Blocks until `f` yields, `deadline` passes, `cancel()` says so (checked every 5 ms when
    /// given) or the engine stops; woken only for `key`.
    pub(super) fn block<T>(
        &self,
        key: WaitKey,
        deadline: Instant,
        cancel: Option<&dyn Fn() -> bool>,
        f: impl FnMut(&mut Core) -> Option<T>,
    ) -> Option<T> {
        self.block_for(0, key, deadline, cancel, f).ok()
    }

    /// [`Engine::block`] for a wait whose largest single transfer is `transfer` bytes (a bulk
    /// one is left to the progress thread: [`Agent::driving`](crate::transport::Agent::driving)),
    /// saying why it ended without `f`'s answer.
    fn block_for<T>(
        &self,
        transfer: u64,
        key: WaitKey,
        deadline: Instant,
        cancel: Option<&dyn Fn() -> bool>,
        mut f: impl FnMut(&mut Core) -> Option<T>,
    ) -> std::result::Result<T, Ended> {
        let transfer = usize::try_from(transfer).unwrap_or(usize::MAX);
        let mut driving = self.inner.agent.driving(transfer);
        let mut polling = true;
        let mut pace = CancelPace::default();
        let mut core = self.inner.core.lock();
        loop {
            if let Some(v) = f(&mut core) {
                return Ok(v);
            }
            if self.inner.stopping.load(Ordering::Acquire) {
                return Err(Ended::Stopping);
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Ended::Deadline);
            }
            if let Some(c) = cancel.filter(|_| pace.due(now, polling)) {
                // The check may take other locks: never call it under ours.
                if MutexGuard::unlocked(&mut core, c) {
                    return Err(Ended::Cancelled);
                }
                // The lock was released for the check: a wake in between must not be lost.
                if let Some(v) = f(&mut core) {
                    return Ok(v);
                }
            }
            // Within the poll window, run the progress pass here instead of sleeping: the event
            // we wait for is then handled on this thread, with no wake-up in between. Our lock
            // is released first (the sink takes it in the pass).
            if polling {
                // The lock was released for the step: look again either way before a sleep.
                polling = MutexGuard::unlocked(&mut core, || driving.step(now));
                continue;
            }
            let until = match cancel {
                Some(_) => deadline.min(now + CANCEL_POLL),
                None => deadline,
            };
            sleep(&mut core, key, until);
        }
    }
}

/// Why [`Engine::block_for`] ended without its answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Ended {
    Deadline,
    Cancelled,
    /// The engine is stopping.
    Stopping,
}

/// The one `wait` call blocked on a (request, role): it lets the pair go when it returns.
struct WaitOwner<'a> {
    inner: &'a Inner,
    key: (RequestKey, Role),
}

impl Drop for WaitOwner<'_> {
    fn drop(&mut self) {
        let mut core = self.inner.core.lock();
        core.waited.remove(&self.key);
        // Taken by the call before it returns; nothing of it may outlive the call.
        if let (key, Role::Sender { receiver }) = self.key {
            core.retired_ends.remove(&(key, receiver));
        }
    }
}
