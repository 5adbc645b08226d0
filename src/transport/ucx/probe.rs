//! The receive-queue probe: a second, private UCX worker in the same context pings the agent's
//! worker over shared memory now and then, and a ping that is written but never read says the
//! worker's shared-memory receive queue is stuck.
//!
//! Why: UCX's posix and sysv transports give a worker one receive queue that every sending
//! process writes into (claim a slot, write it, then flag it written), and the worker reads
//! the slots strictly in order. A sender killed between the claim and the flag leaves a slot
//! that is never flagged, and the worker reads nothing on shared memory again, from anyone
//! (`docs/RELIABILITY.md`). Nothing in UCX reports it. The probe writes into the
//! same queue as every peer does, so it sees what they see: its pings stop arriving.
//!
//! The verdict is conservative. A ping's clock starts when UCX has written it into the queue
//! (its send completed), not when it was queued behind a full queue; it counts as lost only
//! when it has gone unread for [`PROBE_TIMEOUT`] *and* [`PROBE_PASSES`] progress passes have
//! polled the worker since (a process that was stopped, or starved of CPU, has not had the
//! chance to read it). A ping that cannot even be written is judged by the worker alone: stuck
//! only if the worker read nothing at all for [`PROBE_TIMEOUT`] and [`PROBE_PASSES`] passes
//! (a full queue that is being read is busy, not stuck). A writer that was only stopped
//! (SIGSTOP) mid-write holds the queue the same way until it resumes; then the ping arrives
//! and the queue counts as moving again. Pings carry a random per-agent nonce: another process
//! cannot fake one and blind the probe.
use super::handles::{Endpoint, Worker};
use super::shared::Shared;
use super::{sys, ucx_err, AM_PROBE_ID};
use crate::error::Result;
use std::ffi::c_void;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// How often a ping is sent while the last one was read.
const PROBE_EVERY: Duration = Duration::from_millis(500);
/// How long a ping may go unread before the queue counts as stuck (with [`PROBE_PASSES`]).
const PROBE_TIMEOUT: Duration = Duration::from_millis(1500);
/// How many passes must have polled the worker meanwhile.
const PROBE_PASSES: u64 = 10;
/// A gap this long between two passes means the agent itself was held up (its process stopped
/// or starved, its progress thread held): an idle thread runs a pass at least every 100 ms.
/// The ping in flight then starts its wait over, counted from the pass that runs again: the
/// time it waited meanwhile, and the few passes that follow at once (each reading a little
/// of a queue that filled meanwhile, ahead of the ping), say nothing about the queue.
const HELD_UP: Duration = Duration::from_millis(500);
/// A ping: the agent's nonce, then the sequence number (little-endian).
const PING_LEN: usize = 16;

/// What a [`Probe::tick`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Verdict {
    /// Nothing new.
    Same,
    /// The queue is found stuck.
    Stuck,
    /// A stuck queue is read again (the writer that held it was stopped, not killed).
    Moving,
}

/// The ping in flight.
struct Ping {
    seq: u64,
    /// UCX's request while the ping is queued, not yet written (null once written).
    request: *mut c_void,
    /// When it was written (its send completed), or queued while `request` is set; the pass
    /// count and the worker's progress count then.
    since: Instant,
    passes: u64,
    progress: u64,
}

/// Field order is drop order: the endpoint closes before its worker goes. `Drop` frees a
/// queued ping's request first.
pub(super) struct Probe {
    ep: Option<Endpoint>,
    worker: Worker,
    /// The ping's bytes, at a stable address while a send may be pending.
    ping: Box<[u8; PING_LEN]>,
    seq: u64,
    pending: Option<Ping>,
    next_at: Instant,
    passes: u64,
    /// Passes in which the agent's worker read something.
    progress: u64,
    /// When the last pass ran (see [`HELD_UP`]).
    last_tick: Instant,
    stuck: bool,
}

/// UCX requires an error handler with peer error handling; the probe needs none: a ping whose
/// send fails is simply not counted.
unsafe extern "C" fn probe_ep_err_cb(
    _arg: *mut c_void,
    _ep: sys::ucp_ep_h,
    status: sys::ucs_status_t,
) {
    tracing::debug!("probe endpoint: {}", sys::status_str(status));
}

impl Probe {
    /// A worker of `ctx` with an endpoint to the agent's worker at `address`; its pings carry
    /// `nonce` (the agent's, in `Shared::probe_nonce`).
    pub(super) fn start(ctx: sys::ucp_context_h, address: &[u8], nonce: u64) -> Result<Probe> {
        let wparams = sys::ucp_worker_params_t {
            field_mask: sys::UCP_WORKER_PARAM_FIELD_THREAD_MODE as u64,
            thread_mode: sys::UCS_THREAD_MODE_SERIALIZED,
            ..Default::default()
        };
        let mut w: sys::ucp_worker_h = std::ptr::null_mut();
        // SAFETY: a live context; the out-pointer is valid; the worker is owned below.
        let st = unsafe { sys::ucp_worker_create(ctx, &wparams, &mut w) };
        if st != sys::UCS_OK {
            return Err(ucx_err(st, "ucp_worker_create (probe)"));
        }
        let worker = Worker(w);
        // Peer error handling like the agent's own endpoints: the same lanes are chosen, and
        // the forced close at the end is allowed.
        let params = sys::ucp_ep_params_t {
            field_mask: (sys::UCP_EP_PARAM_FIELD_REMOTE_ADDRESS
                | sys::UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE
                | sys::UCP_EP_PARAM_FIELD_ERR_HANDLER) as u64,
            address: address.as_ptr() as *const sys::ucp_address_t,
            err_mode: sys::UCP_ERR_HANDLING_MODE_PEER,
            err_handler: sys::ucp_err_handler_t {
                cb: Some(probe_ep_err_cb),
                arg: std::ptr::null_mut(),
            },
            ..Default::default()
        };
        let mut ep: sys::ucp_ep_h = std::ptr::null_mut();
        // SAFETY: the address bytes outlive the call; the endpoint is owned below and closed
        // before the worker (field order).
        let st = unsafe { sys::ucp_ep_create(worker.0, &params, &mut ep) };
        if st != sys::UCS_OK {
            return Err(ucx_err(st, "ucp_ep_create (probe)"));
        }
        let mut ping = Box::new([0u8; PING_LEN]);
        ping[..8].copy_from_slice(&nonce.to_le_bytes());
        Ok(Probe {
            ep: Some(Endpoint::new(ep, worker.0)),
            worker,
            ping,
            seq: 0,
            pending: None,
            next_at: Instant::now(),
            passes: 0,
            progress: 0,
            last_tick: Instant::now(),
            stuck: false,
        })
    }

    /// One pass's share, after the pass polled the agent's worker (`read`: it read something):
    /// progress the probe's own worker, judge the ping in flight against what the agent's
    /// worker has seen, and send the next one when due. Says when the queue is found stuck,
    /// and when it moves again.
    pub(super) fn tick(&mut self, shared: &Shared, read: bool, now: Instant) -> Verdict {
        let held_up = now.saturating_duration_since(self.last_tick) >= HELD_UP;
        self.last_tick = now;
        self.passes += 1;
        self.progress += u64::from(read);
        // SAFETY: the probe's worker is used only by the holder of the driver lock.
        unsafe { sys::ucp_worker_progress(self.worker.0) };
        let Some(ping) = self.pending.as_mut() else {
            if now >= self.next_at {
                self.send(now);
            }
            return Verdict::Same;
        };
        if !ping.request.is_null() {
            // SAFETY: our own request, not freed yet.
            let st = unsafe { sys::ucp_request_check_status(ping.request) };
            if st != sys::UCS_INPROGRESS {
                // SAFETY: completed; freed once, here.
                unsafe { sys::ucp_request_free(ping.request) };
                ping.request = std::ptr::null_mut();
                if st != sys::UCS_OK {
                    // Not written (the probe's endpoint failed): it proves nothing.
                    self.pending = None;
                    self.next_at = now + PROBE_EVERY;
                    return Verdict::Same;
                }
                // Written now: its clock starts.
                ping.since = now;
                ping.passes = self.passes;
                ping.progress = self.progress;
            }
        }
        if held_up {
            // The agent was held up: its wait starts over with this pass.
            ping.since = now;
            ping.passes = self.passes;
            ping.progress = self.progress;
        }
        let seen = shared.probe_seen.load(Ordering::Acquire) >= ping.seq;
        if seen && ping.request.is_null() {
            self.pending = None;
            self.next_at = now + PROBE_EVERY;
            if std::mem::take(&mut self.stuck) {
                // Read at last: the writer that held the queue was only stopped, not dead,
                // and has finished its write.
                return Verdict::Moving;
            }
            return Verdict::Same;
        }
        let waited = now.saturating_duration_since(ping.since) >= PROBE_TIMEOUT
            && self.passes - ping.passes >= PROBE_PASSES;
        // Written and unread; or not even writable while the worker read nothing at all.
        let lost = waited && (ping.request.is_null() || self.progress == ping.progress);
        if lost && !self.stuck {
            // The same ping stays pending: the queue is read in order, so it arrives when (if
            // ever) the queue moves again.
            self.stuck = true;
            return Verdict::Stuck;
        }
        Verdict::Same
    }

    fn send(&mut self, now: Instant) {
        let Some(ep) = self.ep.as_ref().map(|e| e.ep) else {
            return;
        };
        self.seq += 1;
        self.ping[8..].copy_from_slice(&self.seq.to_le_bytes());
        let param = sys::ucp_request_param_t {
            op_attr_mask: sys::UCP_OP_ATTR_FIELD_FLAGS,
            flags: sys::UCP_AM_SEND_FLAG_EAGER,
            ..Default::default()
        };
        // SAFETY: the ping bytes live in `self.ping`, which is not written again until this
        // send completed (its request is checked in `tick`) and was read, or the probe is
        // dropped (which frees the request and closes the endpoint first); no payload.
        let ptr = unsafe {
            sys::ucp_am_send_nbx(
                ep,
                AM_PROBE_ID,
                self.ping.as_ptr() as *const c_void,
                PING_LEN,
                std::ptr::null(),
                0,
                &param,
            )
        };
        self.next_at = now + PROBE_EVERY;
        if sys::ptr_is_err(ptr) {
            tracing::debug!("probe ping: {}", sys::status_str(sys::ptr_status(ptr)));
            return;
        }
        self.pending = Some(Ping {
            seq: self.seq,
            request: if sys::ptr_is_ptr(ptr) {
                ptr
            } else {
                std::ptr::null_mut()
            },
            since: now,
            passes: self.passes,
            progress: self.progress,
        });
    }
}

impl Drop for Probe {
    fn drop(&mut self) {
        if let Some(ping) = self.pending.take() {
            if !ping.request.is_null() {
                // SAFETY: our own request, freed once; closing the endpoint next ends it.
                unsafe { sys::ucp_request_free(ping.request) };
            }
        }
    }
}

/// The agent's worker received a ping: record its number if it carries the agent's nonce.
pub(super) unsafe extern "C" fn am_probe_cb(
    _arg: *mut c_void,
    header: *const c_void,
    header_length: usize,
    _data: *mut c_void,
    _length: usize,
    _param: *const sys::ucp_am_recv_param_t,
) -> sys::ucs_status_t {
    if header_length == PING_LEN && !header.is_null() {
        // SAFETY: UCX hands us `header_length` readable bytes.
        let b = unsafe { &*(header as *const [u8; PING_LEN]) };
        let nonce = u64::from_le_bytes(b[..8].try_into().unwrap());
        let seq = u64::from_le_bytes(b[8..].try_into().unwrap());
        super::callbacks::with_shared(|sh| {
            if nonce == sh.probe_nonce {
                sh.probe_seen.fetch_max(seq, Ordering::AcqRel);
            }
        });
    }
    sys::UCS_OK
}

#[cfg(test)]
mod tests {
    use super::super::{Agent, AgentOptions, Event, EventSink, TransportKind};
    use super::*;
    use std::collections::VecDeque;
    use std::sync::Arc;

    /// Takes every event, as an engine's sink does: a pass whose burst reads a control message
    /// then stops early, to hand it on.
    struct Drain;

    impl EventSink for Drain {
        fn deliver(&self, events: &mut VecDeque<Event>, _now: Instant) -> Option<Instant> {
            events.clear();
            None
        }
    }

    /// An agent that was itself held up (stopped, starved, or its progress thread held) for
    /// longer than the probe's timeout, with its queue full of messages written before the
    /// ping, is not judged stuck: once it runs again it reads the queue, in order, and the ping
    /// with it. Every pass from then on reads; none of them is evidence of a stuck queue.
    #[test]
    fn an_agent_held_up_with_a_full_queue_is_not_judged_stuck() {
        let deadline = Instant::now() + Duration::from_secs(30);
        let b = Agent::new(AgentOptions::new("held-up", TransportKind::SharedMemory)).unwrap();
        assert!(b.set_sink(Arc::new(Drain)));
        let a = Agent::new(AgentOptions::new("writer", TransportKind::SharedMemory)).unwrap();
        let ab = a.connect_worker(&b.worker_address()).unwrap();
        // Connected both ways, and the probe's first pings read.
        a.send_control(ab, b"hello".to_vec())
            .unwrap()
            .wait(deadline, None)
            .unwrap();
        while b.shared.probe_seen.load(Ordering::Acquire) < 2 {
            assert!(Instant::now() < deadline, "no ping was read");
            std::thread::sleep(Duration::from_millis(10));
        }
        {
            // `b` held up: nothing reads its queue.
            let mut g = b.shared.driver.lock();
            let p = g.as_mut().unwrap();
            for i in 0..56u32 {
                a.post_control(ab, i.to_le_bytes().repeat(4)).unwrap();
            }
            // Until the writer has written them all into the queue.
            while a.push_pending() {
                assert!(Instant::now() < deadline, "the messages never left");
                std::thread::sleep(Duration::from_millis(1));
            }
            std::thread::sleep(Duration::from_millis(50));
            // A ping written behind them, as the last pass before the hold-up would have.
            let probe = p.probe.as_mut().expect("a probe on shared memory");
            probe.pending = None;
            probe.send(Instant::now());
            assert!(
                probe.pending.as_ref().is_some_and(|p| p.request.is_null()),
                "the ping was written into the queue"
            );
            std::thread::sleep(PROBE_TIMEOUT + Duration::from_millis(200));
        }
        let seq = b.shared.probe_seen.load(Ordering::Acquire);
        let until = Instant::now() + Duration::from_secs(1);
        while Instant::now() < until {
            std::thread::sleep(Duration::from_millis(10));
        }
        let s = b.stats();
        println!(
            "after the hold-up: renewals {}, moves begun {}, pings read {seq} -> {}",
            s.worker_renewals,
            b.worker_moves_begun(),
            b.shared.probe_seen.load(Ordering::Acquire)
        );
        assert_eq!(
            (s.worker_renewals, b.worker_moves_begun()),
            (0, 0),
            "a queue that was being read was judged stuck: every peer failed and a move"
        );
        assert!(
            b.shared.probe_seen.load(Ordering::Acquire) > seq,
            "the ping was read once the agent ran again"
        );
    }
}
