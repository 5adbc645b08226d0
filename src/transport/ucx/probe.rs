//! The receive-queue probe: a second, private UCX worker in the same context pings the agent's
//! worker over shared memory now and then, and a ping that never arrives says the worker's
//! shared-memory receive queue is stuck.
//!
//! Why: UCX's posix and sysv transports give a worker one receive queue that every sending
//! process writes into (claim a slot, write it, then flag it written), and the worker reads
//! the slots strictly in order. A sender killed between the claim and the flag leaves a slot
//! that is never flagged, and the worker reads nothing on shared memory again, from anyone
//! (`docs/RELIABILITY.md`, known gaps). Nothing in UCX reports it. The probe writes into the
//! same queue as every peer does, so it sees what they see: its pings stop arriving.
//!
//! The verdict is conservative: a ping counts as lost only when it has gone unseen for
//! [`PROBE_TIMEOUT`] *and* [`PROBE_PASSES`] progress passes have polled the worker since it was
//! sent (a process that was stopped, or starved of CPU, has not had the chance to read it). A
//! writer that was only stopped (SIGSTOP) mid-write holds the queue the same way until it
//! resumes; then the ping arrives and the queue counts as moving again.
use super::handles::{Endpoint, Worker};
use super::shared::Shared;
use super::{sys, ucx_err, AM_PROBE_ID};
use crate::error::Result;
use std::ffi::c_void;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// How often a ping is sent while the last one was seen.
const PROBE_EVERY: Duration = Duration::from_millis(500);
/// How long a ping may go unseen before the queue counts as stuck (with [`PROBE_PASSES`]).
const PROBE_TIMEOUT: Duration = Duration::from_millis(1500);
/// How many passes must have polled the worker since the ping was sent.
const PROBE_PASSES: u64 = 10;

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

/// Field order is drop order: the endpoint closes before its worker goes.
pub(super) struct Probe {
    ep: Option<Endpoint>,
    worker: Worker,
    /// The ping's header (its sequence number), at a stable address while a send is pending.
    header: Box<[u8; 8]>,
    seq: u64,
    /// The ping in flight: its number, when it was sent and the pass count then.
    pending: Option<(u64, Instant, u64)>,
    next_at: Instant,
    passes: u64,
    stuck: bool,
}

impl Probe {
    /// A worker of `ctx` with an endpoint to the agent's worker at `address`.
    pub(super) fn start(ctx: sys::ucp_context_h, address: &[u8]) -> Result<Probe> {
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
        let params = sys::ucp_ep_params_t {
            field_mask: sys::UCP_EP_PARAM_FIELD_REMOTE_ADDRESS as u64,
            address: address.as_ptr() as *const sys::ucp_address_t,
            ..Default::default()
        };
        let mut ep: sys::ucp_ep_h = std::ptr::null_mut();
        // SAFETY: the address bytes outlive the call; the endpoint is owned below and closed
        // before the worker (field order).
        let st = unsafe { sys::ucp_ep_create(worker.0, &params, &mut ep) };
        if st != sys::UCS_OK {
            return Err(ucx_err(st, "ucp_ep_create (probe)"));
        }
        Ok(Probe {
            ep: Some(Endpoint::new(ep, worker.0)),
            worker,
            header: Box::new([0; 8]),
            seq: 0,
            pending: None,
            next_at: Instant::now(),
            passes: 0,
            stuck: false,
        })
    }

    /// One pass's share, after the pass polled the agent's worker: progress the probe's own
    /// worker, judge the ping in flight against what the agent's worker has seen, and send the
    /// next one when due. Says when the queue is found stuck, and when it moves again.
    pub(super) fn tick(&mut self, shared: &Shared, now: Instant) -> Verdict {
        self.passes += 1;
        // SAFETY: the probe's worker is used only by the holder of the driver lock.
        unsafe { sys::ucp_worker_progress(self.worker.0) };
        if let Some((seq, sent, passes)) = self.pending {
            if shared.probe_seen.load(Ordering::Acquire) >= seq {
                self.pending = None;
                if std::mem::take(&mut self.stuck) {
                    // Read at last: the writer that held the queue was only stopped, not
                    // dead, and has finished its write.
                    return Verdict::Moving;
                }
            } else if !self.stuck
                && now.saturating_duration_since(sent) >= PROBE_TIMEOUT
                && self.passes - passes >= PROBE_PASSES
            {
                // The same ping stays pending: the queue is read in order, so it arrives
                // when (if ever) the queue moves again.
                self.stuck = true;
                return Verdict::Stuck;
            } else {
                return Verdict::Same;
            }
        }
        if now >= self.next_at {
            self.send(now);
        }
        Verdict::Same
    }

    fn send(&mut self, now: Instant) {
        let Some(ep) = self.ep.as_ref().map(|e| e.ep) else {
            return;
        };
        self.seq += 1;
        *self.header = self.seq.to_le_bytes();
        let param = sys::ucp_request_param_t {
            op_attr_mask: sys::UCP_OP_ATTR_FIELD_FLAGS,
            flags: sys::UCP_AM_SEND_FLAG_EAGER,
            ..Default::default()
        };
        // SAFETY: the header lives in `self.header`, which is not written again until this ping
        // was seen (the send completed) or the probe is dropped (closing the endpoint first
        // ends the send); no payload.
        let ptr = unsafe {
            sys::ucp_am_send_nbx(
                ep,
                AM_PROBE_ID,
                self.header.as_ptr() as *const c_void,
                8,
                std::ptr::null(),
                0,
                &param,
            )
        };
        if sys::ptr_is_err(ptr) {
            tracing::debug!("probe ping: {}", sys::status_str(sys::ptr_status(ptr)));
            self.next_at = now + PROBE_EVERY;
            return;
        }
        if sys::ptr_is_ptr(ptr) {
            // SAFETY: a request we do not wait for: UCX releases it when it completes.
            unsafe { sys::ucp_request_free(ptr) };
        }
        self.pending = Some((self.seq, now, self.passes));
        self.next_at = now + PROBE_EVERY;
    }
}

/// The agent's worker received a ping: record its number.
pub(super) unsafe extern "C" fn am_probe_cb(
    _arg: *mut c_void,
    header: *const c_void,
    header_length: usize,
    _data: *mut c_void,
    _length: usize,
    _param: *const sys::ucp_am_recv_param_t,
) -> sys::ucs_status_t {
    if header_length == 8 && !header.is_null() {
        // SAFETY: UCX hands us `header_length` readable bytes.
        let seq = u64::from_le_bytes(unsafe { *(header as *const [u8; 8]) });
        super::callbacks::with_shared(|sh| {
            sh.probe_seen.fetch_max(seq, Ordering::AcqRel);
        });
    }
    sys::UCS_OK
}
