//! Two-sided transfers on the progress thread: tagged sends and receives and control messages
//! (eager active messages); and how any op's request is handed to UCX (`request_param`,
//! `track`) and cancelled (`cancel_op`), which one-sided transfers and drains use too.
use super::callbacks::{self, control_send_cb, recv_cb, send_cb, ControlSend};
use super::op::{OpSlot, STOP_NONE, STOP_PEER};
use super::progress::Progress;
use super::{sys, PeerId, AM_CONTROL_ID};
use crate::error::ErrorKind;
use crate::timeline::{self, Stage};
use std::ffi::c_void;
use std::sync::atomic::Ordering;
use std::sync::Arc;

impl Progress {
    /// Records why `slot` stops (unless a reason is already set) and cancels its UCX request,
    /// if UCX still holds it. The completion callback reports the end as usual.
    pub(super) fn stop_slot(&self, slot: &OpSlot, reason: u8) {
        let _ = slot.stop_reason.compare_exchange(
            STOP_NONE,
            reason,
            Ordering::AcqRel,
            Ordering::Acquire,
        );
        let req = slot.request.load(Ordering::Acquire);
        if !req.is_null() {
            // SAFETY: req is a live request of our worker: the completion callback clears
            // `slot.request` (on this thread) before freeing it.
            unsafe { sys::ucp_request_cancel(self.worker.0, req) };
        }
    }

    pub(super) fn cancel_op(&mut self, id: u64, at: u32) {
        let slot = self.shared.in_flight.lock().get(at, id);
        if let Some(slot) = slot {
            let req = slot.request.load(Ordering::Acquire);
            if !req.is_null() {
                // SAFETY: req is a live request of our worker: the completion callback clears
                // `slot.request` (on this thread) before freeing it.
                unsafe { sys::ucp_request_cancel(self.worker.0, req) };
                if slot.send {
                    // UCX cannot cancel a rendezvous send on its own: ask the receiver to drain
                    // the tag, which completes our send without the data being kept.
                    self.send_drain(slot.peer, slot.tag);
                }
            }
        }
    }

    /// Hands a slot to UCX: on success UCX holds one strong count, returned by the callback.
    pub(super) fn track(&self, slot: &Arc<OpSlot>, status_ptr: sys::ucs_status_ptr_t) {
        if sys::ptr_is_ptr(status_ptr) {
            // With NO_IMM_CMPL the callback may already have run (and freed the request)
            // inside the *_nbx call: only a pending request is stored for later cancels.
            if slot.state.lock().is_none() {
                slot.request.store(status_ptr, Ordering::Release);
            }
        } else {
            // Not a request: the callback will not run. Release its count and fail the slot.
            // SAFETY: the count was leaked with Arc::into_raw for this call.
            unsafe { Arc::decrement_strong_count(Arc::as_ptr(slot)) };
            let st = if sys::ptr_is_err(status_ptr) {
                sys::ptr_status(status_ptr)
            } else {
                sys::UCS_OK
            };
            self.finish_slot(slot, st, slot.expected_len);
        }
    }

    /// Between its queueing and its start (held by `Agent::hold`, or behind other commands) an
    /// op may have been ended (failed with its worker) or asked to stop: the first is not
    /// posted again, the second ends stopped, not posted (its cancel found nothing to cancel;
    /// its caller may have been told it ended, and have reused the memory). True if either:
    /// the op must not be posted. For tag and one-sided ops alike.
    pub(super) fn ended_before_start(&self, slot: &OpSlot) -> bool {
        if slot.state.lock().is_some() {
            return true;
        }
        if slot.stop_reason.load(Ordering::Acquire) != STOP_NONE {
            self.finish_slot(slot, sys::UCS_ERR_CANCELED, 0);
            return true;
        }
        false
    }

    pub(super) fn finish_slot(&self, slot: &OpSlot, status: sys::ucs_status_t, len: usize) {
        callbacks::finish_slot(&self.shared, slot, status, len);
    }

    pub(super) fn request_param(slot: &Arc<OpSlot>) -> sys::ucp_request_param_t {
        sys::ucp_request_param_t {
            op_attr_mask: sys::UCP_OP_ATTR_FIELD_CALLBACK
                | sys::UCP_OP_ATTR_FIELD_USER_DATA
                | sys::UCP_OP_ATTR_FLAG_NO_IMM_CMPL,
            user_data: Arc::into_raw(slot.clone()) as *mut c_void,
            ..Default::default()
        }
    }

    pub(super) fn start_tag(
        &mut self,
        peer: PeerId,
        tag: u64,
        addr: usize,
        len: usize,
        slot: Arc<OpSlot>,
        send: bool,
    ) {
        if self.ended_before_start(&slot) {
            return;
        }
        let ep = match self.ep_of(peer) {
            Ok(ep) => ep,
            Err(e) => {
                slot.stop_reason.store(
                    if e.kind == ErrorKind::PeerLost {
                        STOP_PEER
                    } else {
                        STOP_NONE
                    },
                    Ordering::Release,
                );
                return self.finish_slot(&slot, sys::UCS_ERR_NOT_CONNECTED, 0);
            }
        };
        let mut param = Self::request_param(&slot);
        // SAFETY: the caller of post_send/post_recv promised the buffer's validity until the op
        // ends; the slot's strong count in user_data is returned by the callback or by `track`.
        let ptr = unsafe {
            if send {
                timeline::mark(Stage::SendPosted);
                param.cb.send = Some(send_cb);
                sys::ucp_tag_send_nbx(ep, addr as *const c_void, len, tag, &param)
            } else {
                timeline::mark(Stage::RecvPosted);
                param.cb.recv = Some(recv_cb);
                sys::ucp_tag_recv_nbx(
                    self.worker.0,
                    addr as *mut c_void,
                    len,
                    tag,
                    u64::MAX,
                    &param,
                )
            }
        };
        self.track(&slot, ptr);
    }

    pub(super) fn start_control(&mut self, peer: PeerId, bytes: Vec<u8>, slot: Arc<OpSlot>) {
        // What waits in the peer's batch was sent before this: it goes first.
        self.send_batch(peer);
        let (ep, voice) = match (self.ep_of(peer), self.peers.get(&peer.0)) {
            (Ok(ep), Some(e)) => (ep, e.voice.clone()),
            _ => {
                slot.stop_reason.store(STOP_PEER, Ordering::Release);
                return self.finish_slot(&slot, sys::UCS_ERR_NOT_CONNECTED, 0);
            }
        };
        // The payload and the header must outlive the send: they are kept in a box owned by
        // the callback.
        let ctx = Box::new(ControlSend {
            slot: slot.clone(),
            bytes,
            voice,
        });
        let mut param = sys::ucp_request_param_t {
            op_attr_mask: sys::UCP_OP_ATTR_FIELD_CALLBACK
                | sys::UCP_OP_ATTR_FIELD_USER_DATA
                | sys::UCP_OP_ATTR_FIELD_FLAGS
                | sys::UCP_OP_ATTR_FLAG_NO_IMM_CMPL,
            flags: sys::UCP_AM_SEND_FLAG_EAGER | sys::UCP_AM_SEND_FLAG_REPLY,
            ..Default::default()
        };
        param.cb.send = Some(control_send_cb);
        let (data, len) = (ctx.bytes.as_ptr(), ctx.bytes.len());
        let header = ctx.voice.as_ptr() as *const c_void;
        param.user_data = Box::into_raw(ctx) as *mut c_void;
        // SAFETY: `data` and the 8-byte header (the endpoint's voice, see `peers.rs`) live in
        // the box until control_send_cb frees it (or below on error).
        let ptr = unsafe {
            sys::ucp_am_send_nbx(
                ep,
                AM_CONTROL_ID,
                header,
                8,
                data as *const c_void,
                len,
                &param,
            )
        };
        if sys::ptr_is_ptr(ptr) {
            if slot.state.lock().is_none() {
                slot.request.store(ptr, Ordering::Release);
            }
        } else {
            // SAFETY: the callback will not run: reclaim the box made above.
            drop(unsafe { Box::from_raw(param.user_data as *mut ControlSend) });
            let st = if sys::ptr_is_err(ptr) {
                sys::ptr_status(ptr)
            } else {
                sys::UCS_OK
            };
            self.finish_slot(&slot, st, len);
        }
    }
}
