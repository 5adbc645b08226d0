//! One in-flight request: its completion slot (shared with the progress thread, which completes
//! it) and [`Op`], the owner's handle that waits, stops and maps the end to an outcome.
use super::callbacks;
use super::shared::{CancelPace, Cmd, Driving, Reply, Shared, CANCEL_POLL};
use super::{map_status, sys, PeerId};
use crate::error::{Error, ErrorKind, Outcome, Result};
use parking_lot::{Condvar, Mutex, MutexGuard};
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU32, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Why an op was asked to stop, recorded before the UCX cancel so its completion maps to the
/// right outcome.
pub(super) const STOP_NONE: u8 = 0;
pub(super) const STOP_TIMEOUT: u8 = 1;
pub(super) const STOP_CANCEL: u8 = 2;
pub(super) const STOP_PEER: u8 = 3;
pub(super) const STOP_SHUTDOWN: u8 = 4;
/// The sending peer gave up on this transfer and asked us to drain it.
pub(super) const STOP_REMOTE_CANCEL: u8 = 5;

/// What an op is: data (a tag send or receive) or a control message.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum SlotKind {
    Send,
    Recv,
    Control,
    /// A one-sided put or get, completed by the endpoint flush that follows it.
    Rma,
}

/// The completion slot of one in-flight operation, shared by the waiter and the progress thread.
pub(super) struct OpSlot {
    pub(super) id: u64,
    pub(super) peer: PeerId,
    pub(super) expected_len: usize,
    /// The UCX tag, and whether this is a send (a send's cancel asks the peer to drain it).
    pub(super) tag: u64,
    pub(super) send: bool,
    /// Push [`Event::OpDone`](super::Event::OpDone) when this op ends (for drivers that multiplex
    /// many ops).
    pub(super) notify: bool,
    /// A control message, not data: kept out of the data progress counters.
    pub(super) control: bool,
    pub(super) started: Instant,
    pub(super) state: Mutex<Option<(sys::ucs_status_t, usize)>>,
    pub(super) cv: Condvar,
    /// The UCX request handle while UCX owns it; only touched on the progress thread.
    pub(super) request: AtomicPtr<c_void>,
    pub(super) stop_reason: AtomicU8,
    /// Whether the op's bytes are in [`Shared::in_flight_bytes`](super::shared::Shared): set
    /// when it is tracked, cleared by whichever takes them off first (its end, or its stop
    /// giving up on UCX).
    pub(super) bytes_counted: AtomicBool,
    /// Posted through a [`Held`](super::Held) not yet released: its command is not queued, so
    /// a stop has nothing to cancel and ends it at once (as the `Held`'s drop would).
    pub(super) held: AtomicBool,
    /// Its index in [`Shared::in_flight`](super::shared::Shared) while tracked
    /// ([`NOT_TRACKED`] otherwise).
    pub(super) tracked_at: AtomicU32,
    /// Its owner asked its waiter to give up ([`OpAbort::abort`]).
    aborted: AtomicBool,
}

/// An op not in the in-flight table.
pub(super) const NOT_TRACKED: u32 = u32::MAX;

impl OpSlot {
    /// A fresh slot, not yet tracked ([`Shared::track_op`](super::shared::Shared)): not ended,
    /// no UCX request, no stop asked, no bytes counted.
    pub(super) fn new(
        id: u64,
        peer: PeerId,
        expected_len: usize,
        tag: u64,
        kind: SlotKind,
        notify: bool,
    ) -> Arc<OpSlot> {
        Arc::new(OpSlot {
            id,
            peer,
            expected_len,
            tag,
            send: kind == SlotKind::Send,
            notify,
            control: kind == SlotKind::Control,
            started: Instant::now(),
            state: Mutex::new(None),
            cv: Condvar::new(),
            request: AtomicPtr::new(std::ptr::null_mut()),
            stop_reason: AtomicU8::new(STOP_NONE),
            bytes_counted: AtomicBool::new(false),
            held: AtomicBool::new(false),
            tracked_at: AtomicU32::new(NOT_TRACKED),
            aborted: AtomicBool::new(false),
        })
    }

    /// The command that cancels this op.
    pub(super) fn cancel_cmd(&self) -> super::shared::Cmd {
        super::shared::Cmd::CancelOp {
            id: self.id,
            at: self.tracked_at.load(Ordering::Relaxed),
        }
    }

    pub(super) fn complete(&self, status: sys::ucs_status_t, len: usize) {
        let mut st = self.state.lock();
        if st.is_none() {
            *st = Some((status, len));
        }
        drop(st);
        self.cv.notify_all();
    }
}

/// How long a stop waits for UCX to release a request once the force-close of its endpoint has
/// run, counted from the end of the cancel's grace (shared by the ops of one request given up
/// together), and at least [`FORCE_CLOSE_FLOOR`] after the close. A force-closed endpoint's
/// requests end within the close itself (their callbacks run in it: under a millisecond
/// measured here). Not longer: UCX 1.13 has been seen (shared memory, receiver killed, both
/// cores busy) to keep the second send of a request past the close of its endpoint with no end
/// in sight, and the caller's wait must still end by its deadline plus the agreement bound plus
/// this; such an op is counted as unreaped instead.
const FORCE_CLOSE_WAIT: Duration = Duration::from_millis(30);
/// The least a stop waits for UCX after the force-close has run, when the shared wait is over.
const FORCE_CLOSE_FLOOR: Duration = Duration::from_millis(2);
/// A handle that makes an op's waiter give up ([`Op::abort_handle`]): from another thread,
/// without a cancel check that the waiter would have to poll. The waiter is woken at once.
#[derive(Clone)]
pub struct OpAbort(Arc<OpSlot>);

impl OpAbort {
    /// Asks the op's waiter to give up: its wait stops the op as for a cancel check that said
    /// so (`Cancelled`). An op that has ended, or is no longer waited for, is not changed.
    pub fn abort(&self) {
        self.0.aborted.store(true, Ordering::Release);
        // Under the slot's lock, which the waiter holds from its look at the flag until its
        // sleep begins: the wake cannot fall between the two.
        let _st = self.0.state.lock();
        self.0.cv.notify_all();
    }

    /// Whether [`OpAbort::abort`] was called.
    pub fn is_aborted(&self) -> bool {
        self.0.aborted.load(Ordering::Acquire)
    }
}

/// How long past the shared bound a stop waits for the force-close to run at all. The progress
/// thread runs commands between UCX calls, and one call can be long: a sender resumed after a
/// SIGSTOP, its receiver gone, spent 92 ms in one `ucp_worker_progress` (UCX 1.22, shared
/// memory) pushing the rest of a 64 MiB rendezvous, 7676 fragments, read from the caller's
/// buffer. Returning before the close has run hands that buffer back while UCX still reads
/// it; the engine-level test's process freed it and died of a segfault in UCX's copy. Past
/// this limit (a progress thread that no longer runs at all) the op is left to UCX, unreaped.
pub const CLOSE_RUN_LIMIT: Duration = Duration::from_secs(2);

/// When a stop that begins at `now` stops waiting for its cancel: after the agent's reap grace,
/// or at the grace shared with the ops given up together ([`Op::limit_grace`]) if that is
/// earlier.
fn cancel_ends(now: Instant, reap_grace: Duration, shared: Option<Instant>) -> Instant {
    let own = now + reap_grace;
    shared.map_or(own, |limit| own.min(limit))
}

/// When a stop whose cancel wait ended at `cancel_until` stops waiting for UCX, the force-close
/// having run at `closed` ([`FORCE_CLOSE_WAIT`], [`FORCE_CLOSE_FLOOR`]).
fn close_ends(closed: Instant, cancel_until: Instant, reap_grace: Duration) -> Instant {
    (cancel_until + reap_grace.min(FORCE_CLOSE_WAIT)).max(closed + FORCE_CLOSE_FLOOR)
}

/// Until when a stop whose close was due by `close_by` waits for that close to run at all:
/// [`CLOSE_RUN_LIMIT`] past it, or past the close wait of the grace shared with the ops given
/// up together (`shared`, [`Op::limit_grace`]) if that is earlier.
fn close_run_ends(close_by: Instant, reap_grace: Duration, shared: Option<Instant>) -> Instant {
    let own = close_by + CLOSE_RUN_LIMIT;
    shared.map_or(own, |limit| {
        own.min(close_ends(limit, limit, reap_grace) + CLOSE_RUN_LIMIT)
    })
}

/// An in-flight send or receive. Dropping it before it ends cancels and reaps it (bounded).
pub struct Op {
    slot: Arc<OpSlot>,
    shared: Arc<Shared>,
    finished: bool,
    quiesced: bool,
    /// See [`Op::detach_on_stop`].
    detach: bool,
    /// See [`Op::limit_grace`].
    grace_until: Option<Instant>,
    /// What must outlive the op (a put's or get's remote key), dropped after its stop.
    keep: Option<Arc<dyn std::any::Any + Send + Sync>>,
}

impl Op {
    pub(super) fn new(slot: Arc<OpSlot>, shared: Arc<Shared>) -> Op {
        Op {
            slot,
            shared,
            finished: false,
            quiesced: false,
            detach: false,
            grace_until: None,
            keep: None,
        }
    }

    /// Keeps `what` alive until this op has been dropped (after its stop, if it had not ended).
    pub(super) fn keep_alive(&mut self, what: Arc<dyn std::any::Any + Send + Sync>) {
        self.keep = Some(what);
    }

    /// A stop waits for the cancel no later than `until` (several ops given up together share
    /// one grace instead of one each); then the op is left to UCX ([`Op::detach_on_stop`]) or
    /// its endpoint is force-closed. The wait for that close to run ([`CLOSE_RUN_LIMIT`]) is
    /// shared the same way: it ends by `until` plus that limit (and the close's own wait), so
    /// that ops stopped one after another behind a progress thread that no longer runs add
    /// one limit, not one each.
    pub fn limit_grace(&mut self, until: Instant) {
        self.grace_until = Some(until);
    }

    /// A stop that the cancel alone does not end leaves the op to UCX instead of force-closing
    /// its endpoint: the wait returns at once with `is_quiesced()` false, and the op ends later
    /// on its own (reported as [`Event::OpDone`](super::Event::OpDone) when posted with
    /// `notify`). For memory the owner has lent for longer than the op (a registered region):
    /// UCX may still touch it after the wait, and nothing else on the endpoint is ended.
    pub fn detach_on_stop(&mut self) {
        self.detach = true;
    }

    /// A handle that makes this op's wait give up at once, from another thread.
    pub fn abort_handle(&self) -> OpAbort {
        OpAbort(self.slot.clone())
    }

    /// Whether [`Op::detach_on_stop`] was asked for.
    pub fn detaches_on_stop(&self) -> bool {
        self.detach
    }

    /// Waits until the op ends, `deadline` passes, `cancel()` returns true (checked every
    /// `CANCEL_POLL`), or its [`OpAbort`] is used (at once, as for a cancel). Returns
    /// `Completed` only when the whole transfer has landed. On any other outcome the UCX
    /// request has been cancelled and released before this returns: UCX no longer touches the
    /// buffer (see `Op::stop` for the bound on that), unless the op was
    /// [`Op::detach_on_stop`]ped and the cancel alone did not end it (`is_quiesced()` false).
    pub fn wait(
        &mut self,
        deadline: Instant,
        cancel: Option<&dyn Fn() -> bool>,
    ) -> Result<Outcome> {
        self.wait_telling(deadline, cancel, |_| {})
    }

    /// [`Op::wait`], telling `before_stop` why it gives up (`TimedOut` or `Cancelled`) before it
    /// stops the op, which may take the stop's grace: an owner that must announce its giving
    /// up (a vote to its peer) does so at the deadline, not a grace later.
    pub fn wait_telling(
        &mut self,
        deadline: Instant,
        cancel: Option<&dyn Fn() -> bool>,
        before_stop: impl FnOnce(Outcome),
    ) -> Result<Outcome> {
        let shared = self.shared.clone();
        let mut driving = Driving::for_transfer(&shared, self.slot.expected_len);
        let mut polling = true;
        let mut pace = CancelPace::default();
        let mut st = self.slot.state.lock();
        let stop = loop {
            if let Some((status, len)) = *st {
                drop(st);
                return self.finish(status, len);
            }
            // Looked at under the lock, which is held from here to the sleep below unless a
            // step lets it go (and then comes back here): an abort's wake cannot be missed.
            if self.slot.aborted.load(Ordering::Acquire) {
                break STOP_CANCEL;
            }
            let now = Instant::now();
            if let Some(c) = cancel.filter(|_| pace.due(now, polling)) {
                shared.stats.cancel_checks.fetch_add(1, Ordering::Relaxed);
                // The check may take other locks (the engine's): never under ours.
                if MutexGuard::unlocked(&mut st, c) {
                    break STOP_CANCEL;
                }
                // The lock was let go: an end or an abort that came meanwhile is seen before a
                // sleep.
                if st.is_some() || self.slot.aborted.load(Ordering::Acquire) {
                    continue;
                }
            }
            if now >= deadline {
                break STOP_TIMEOUT;
            }
            if polling {
                // Run a pass here while the window lasts; the lock was released for it, so look
                // again either way before a sleep.
                polling = MutexGuard::unlocked(&mut st, || driving.step(now));
                continue;
            }
            let mut until = deadline;
            if cancel.is_some() {
                until = until.min(now + CANCEL_POLL);
            }
            // The lock is released while waiting (condvar); no lock is held across the wait.
            self.slot.cv.wait_until(&mut st, until);
        };
        drop(st);
        drop(driving);
        before_stop(match stop {
            STOP_CANCEL => Outcome::Cancelled,
            _ => Outcome::TimedOut,
        });
        self.stop(stop);
        let (status, len) = self.slot.state.lock().unwrap_or((sys::UCS_ERR_CANCELED, 0));
        // A receive that completed in the race with the stop has all its data: it counts. A send
        // that completed after we asked the peer to drain it may have been discarded: it does not.
        if status == sys::UCS_OK && self.quiesced && !self.slot.send {
            return self.finish(status, len);
        }
        self.finished = true;
        Ok(match stop {
            STOP_CANCEL => Outcome::Cancelled,
            _ => Outcome::TimedOut,
        })
    }

    /// The op's id (as in [`Event::OpDone`](super::Event::OpDone)).
    pub fn id(&self) -> u64 {
        self.slot.id
    }

    /// The result if the op has ended, without waiting.
    pub fn poll(&mut self) -> Option<Result<Outcome>> {
        let done = *self.slot.state.lock();
        done.map(|(status, len)| self.finish(status, len))
    }

    /// Asks for the op to be cancelled without waiting; its end is reported as usual (by
    /// [`Event::OpDone`](super::Event::OpDone) when posted with `notify`). A receive is reaped
    /// within microseconds; a send is drained by its receiver.
    pub fn request_cancel(&self) {
        let _ = self.slot.stop_reason.compare_exchange(
            STOP_NONE,
            STOP_CANCEL,
            Ordering::AcqRel,
            Ordering::Acquire,
        );
        let _ = self.shared.submit(self.slot.cancel_cmd());
    }

    /// True once UCX can no longer write into (or read from) the op's buffer.
    pub fn is_quiesced(&self) -> bool {
        self.quiesced || self.slot.state.lock().is_some()
    }

    /// Sets the stop reason, asks the progress thread to cancel, and waits (bounded) for UCX to
    /// release the request; force-closes the endpoint if the cancel alone does not.
    fn stop(&mut self, reason: u8) {
        let _ = self.slot.stop_reason.compare_exchange(
            STOP_NONE,
            reason,
            Ordering::AcqRel,
            Ordering::Acquire,
        );
        if self.slot.held.load(Ordering::Acquire) {
            // Not started, and never will be (its command, when released, finds it ended):
            // nothing of UCX to wait for. Before, the cancel found no request, waited the whole
            // reap grace, force-closed the peer's endpoint and counted the op unreaped.
            callbacks::finish_slot(&self.shared, &self.slot, sys::UCS_ERR_CANCELED, 0);
            if self.slot.notify {
                self.shared.owe_pass();
            }
            self.quiesced = true;
            return;
        }
        let grace = self.shared.reap_grace;
        let cancel_until = cancel_ends(Instant::now(), grace, self.grace_until);
        // Stage 1: cancel (a send is drained by its receiver). Stage 2: force-close the
        // endpoint, which ends every request on it, and wait for the close to run and then for
        // UCX to let the op go within `close_ends` (from the end of the shared grace). Until
        // the close has run, UCX may still move the op's bytes, so its run is waited for past
        // that bound, up to [`CLOSE_RUN_LIMIT`]: the progress thread may be inside one long
        // UCX call. The buffer is never handed back while UCX holds it, except past those
        // bounds (a progress thread stuck past the limit, a UCX that keeps the op past the
        // close, an agent shutting down meanwhile), and then the op is counted as unreaped.
        if self.slot.state.lock().is_none() && self.shared.submit(self.slot.cancel_cmd()).is_ok() {
            self.wait_done(cancel_until);
            if self.slot.state.lock().is_none() {
                if self.detach {
                    // Left to UCX (see `detach_on_stop`): not quiesced, not counted as unreaped.
                    return;
                }
                let closed = Reply::new();
                let cmd = Cmd::ForceClose(self.slot.peer, Some(closed.clone()));
                // The close is waited for until it has run (bounded by CLOSE_RUN_LIMIT, past
                // the shared bound), not a grace of its own per op: once it has run, the other
                // ops of the request on that endpoint have ended with it.
                let mut close_by = close_ends(Instant::now(), cancel_until, grace);
                // Not from inside a pass (the owner's sink dropping an op): the close runs only
                // after that pass, so waiting longer for it gains nothing. Nor for a control
                // message, whose bytes the progress thread owns: no caller memory to guard.
                if !callbacks::in_sink_of(&self.shared) && !self.slot.control {
                    close_by = close_by.max(close_run_ends(close_by, grace, self.grace_until));
                }
                if self.shared.submit(cmd).is_ok() && closed.wait(close_by).is_ok() {
                    self.wait_done(close_ends(Instant::now(), cancel_until, grace));
                }
            }
        }
        if self.slot.state.lock().is_none() {
            // UCX broke its contract (a force-closed endpoint completes its requests). The wait
            // is a promise to the caller, so it is not held; the op stays counted as unreaped
            // (health shows it) and `is_quiesced` stays false so an owner that can fence the
            // memory does. No abort: a library must not end its host process.
            self.shared.stats.unreaped.fetch_add(1, Ordering::Relaxed);
            // Its bytes are no transfer in progress any more: left counted, over tcp a few MiB
            // of them would keep every later wait from polling for the agent's life.
            self.shared.uncount_bytes(&self.slot);
            tracing::error!(
                op = self.slot.id,
                "UCX has not released a request after cancel and force-close"
            );
            return;
        }
        self.quiesced = true;
    }

    fn wait_done(&self, until: Instant) {
        let mut st = self.slot.state.lock();
        while st.is_none() && Instant::now() < until {
            self.slot.cv.wait_until(&mut st, until);
        }
    }

    fn finish(&mut self, status: sys::ucs_status_t, len: usize) -> Result<Outcome> {
        self.finished = true;
        self.quiesced = true;
        let stopped = self.slot.stop_reason.load(Ordering::Acquire);
        if self.slot.send && status == sys::UCS_OK && stopped != STOP_NONE {
            // Asked to stop (`request_cancel`, or a stop), then completed: the receiver may have
            // drained it, so it is not known delivered.
            return Ok(if stopped == STOP_TIMEOUT {
                Outcome::TimedOut
            } else {
                Outcome::Cancelled
            });
        }
        if status == sys::UCS_OK {
            if len != self.slot.expected_len {
                return Err(Error::new(
                    ErrorKind::Protocol,
                    format!(
                        "transfer size mismatch: expected {} bytes, {} arrived",
                        self.slot.expected_len, len
                    ),
                ));
            }
            return Ok(Outcome::Completed);
        }
        match self.slot.stop_reason.load(Ordering::Acquire) {
            STOP_CANCEL | STOP_REMOTE_CANCEL => return Ok(Outcome::Cancelled),
            STOP_TIMEOUT => return Ok(Outcome::TimedOut),
            STOP_PEER => return Ok(Outcome::PeerLost),
            STOP_SHUTDOWN => return Err(Error::new(ErrorKind::Shutdown, "agent shut down")),
            _ => {}
        }
        // A cancel this side did not ask for (no stop recorded): UCX purging the requests of an
        // endpoint that failed, which it completes before it reports the failure (the report
        // waits for its progress). Seen for sends to a peer killed mid-transfer while others
        // were served (tests/fan_in.rs): they read `Transport`. (Kept in this method: with the
        // mapping moved into a function of its own, the shared-memory 4 KiB transport row
        // measured 5% slower, six alternated pairs.)
        if status == sys::UCS_ERR_CANCELED {
            return Ok(Outcome::PeerLost);
        }
        Err(map_status(status, "transfer")).or_else(|e: Error| {
            if e.kind == ErrorKind::PeerLost {
                Ok(Outcome::PeerLost)
            } else {
                Err(e)
            }
        })
    }
}

impl Drop for Op {
    fn drop(&mut self) {
        if !self.finished && self.slot.state.lock().is_none() {
            self.stop(STOP_CANCEL);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::ucx::{AgentOptions, TransportKind};

    const MS: Duration = Duration::from_millis(1);

    /// An op ended with `status`, no stop asked, as its waiter reads it.
    fn ended_unasked(send: bool, status: sys::ucs_status_t) -> Result<Outcome> {
        let kind = if send { SlotKind::Send } else { SlotKind::Recv };
        let slot = OpSlot::new(1, PeerId(1), 8, 0, kind, false);
        slot.complete(status, 0);
        let shared = Shared::new(&AgentOptions::new("op-test", TransportKind::Tcp), 1).unwrap();
        Op::new(slot, shared).wait(Instant::now() + MS, None)
    }

    #[test]
    fn a_cancel_nobody_here_asked_for_is_the_peers_loss() {
        // UCX purging a failed endpoint's requests, before it reports the failure.
        assert_eq!(
            ended_unasked(true, sys::UCS_ERR_CANCELED),
            Ok(Outcome::PeerLost)
        );
        assert_eq!(
            ended_unasked(false, sys::UCS_ERR_CANCELED),
            Ok(Outcome::PeerLost)
        );
        assert_eq!(
            ended_unasked(true, sys::UCS_ERR_CONNECTION_RESET),
            Ok(Outcome::PeerLost)
        );
        // Other failures stay errors of the transport.
        assert_eq!(
            ended_unasked(true, sys::UCS_ERR_NO_MEMORY).map_err(|e| e.kind),
            Err(ErrorKind::Transport)
        );
    }

    #[test]
    fn a_lone_stop_waits_its_grace_then_at_most_the_force_close_wait() {
        let t = Instant::now();
        let cancel = cancel_ends(t, 50 * MS, None);
        assert_eq!(cancel, t + 50 * MS);
        // The cancel did not end it: the close runs at the end of the grace.
        assert_eq!(close_ends(cancel, cancel, 50 * MS), t + 80 * MS);
        // A close that the progress thread ran late still gets the floor.
        assert_eq!(close_ends(t + 79 * MS, cancel, 50 * MS), t + 81 * MS);
        // An agent with a long reap grace still waits only FORCE_CLOSE_WAIT after the close.
        let cancel = cancel_ends(t, 2000 * MS, None);
        assert_eq!(close_ends(cancel, cancel, 2000 * MS), t + 2030 * MS);
        // A grace shorter than the close wait bounds it too.
        let cancel = cancel_ends(t, 10 * MS, None);
        assert_eq!(close_ends(cancel, cancel, 10 * MS), t + 20 * MS);
    }

    #[test]
    fn ops_given_up_together_share_one_grace_and_one_close_wait() {
        // The first op was stopped at t with a 50 ms grace, and limited the others to t + 50.
        let t = Instant::now();
        let limit = Some(t + 50 * MS);
        // The second op's stop begins once the first's has ended (t + 51): its cancel wait is
        // already over, and its wait after the close ends with the first's, at t + 80 (before
        // this, each op waited a whole grace after its own close: t + 101 for the second).
        let second = t + 51 * MS;
        let cancel = cancel_ends(second, 50 * MS, limit);
        assert_eq!(cancel, t + 50 * MS);
        assert_eq!(close_ends(second, cancel, 50 * MS), t + 80 * MS);
        // A third op stopped after that still gets FORCE_CLOSE_FLOOR to see its close run.
        let third = t + 81 * MS;
        let cancel = cancel_ends(third, 50 * MS, limit);
        assert_eq!(
            close_ends(third, cancel, 50 * MS),
            third + FORCE_CLOSE_FLOOR
        );
        // A limit later than the op's own grace does not lengthen it.
        assert_eq!(cancel_ends(t, 50 * MS, Some(t + 500 * MS)), t + 50 * MS);
    }

    #[test]
    fn ops_given_up_together_share_one_wait_for_the_close_to_run() {
        // As above: the first op stopped at t, the others limited to t + 50. The first waits
        // for its close to run until CLOSE_RUN_LIMIT past its close wait.
        let t = Instant::now();
        let limit = Some(t + 50 * MS);
        let first = close_ends(t + 50 * MS, t + 50 * MS, 50 * MS);
        let first_runs = close_run_ends(first, 50 * MS, None);
        assert_eq!(first_runs, t + 80 * MS + CLOSE_RUN_LIMIT);
        // The progress thread never ran it: the second op's stop begins when the first's wait
        // has ended, and waits only its floor, not a limit of its own (before: 2 s more per op).
        let second = first_runs + MS;
        let cancel = cancel_ends(second, 50 * MS, limit);
        let close_by = close_ends(second, cancel, 50 * MS);
        assert_eq!(close_by, second + FORCE_CLOSE_FLOOR);
        assert_eq!(
            close_by.max(close_run_ends(close_by, 50 * MS, limit)),
            second + FORCE_CLOSE_FLOOR
        );
        // Stopped at once (the close ran at the shared grace's end), an op given up together
        // with others waits for the run as long as the first does.
        let close_by = close_ends(t + 50 * MS, t + 50 * MS, 50 * MS);
        assert_eq!(close_run_ends(close_by, 50 * MS, limit), first_runs);
        // A shared limit later than the op's own does not lengthen it.
        assert_eq!(
            close_run_ends(t, 50 * MS, Some(t + 500 * MS)),
            t + CLOSE_RUN_LIMIT
        );
    }
}
