//! The functions UCX calls (`extern "C"`). They run inside `ucp_worker_progress`, on the thread
//! that holds the agent's driver lock (the progress thread, or a caller driving progress):
//! completions end their op's slot at once ([`finish_slot`]); everything else is only
//! pushed as a [`CbEvent`] for the progress loop to handle after the call, so no state is borrowed
//! re-entrantly.
use super::op::OpSlot;
use super::shared::Shared;
use super::{batch, sys, Event, MAX_CONTROL};
use crate::timeline::{self, Stage};
use std::cell::{Cell, RefCell};
use std::ffi::c_void;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// What UCX callbacks report; they run inside `ucp_worker_progress` under the driver lock and
/// only push here, so no state is borrowed re-entrantly.
pub(super) enum CbEvent {
    ConnRequest(sys::ucp_conn_request_h),
    EpError(u64, sys::ucs_status_t),
    Drain(sys::ucp_ep_h, u64, u64),
    Bind(u64, Vec<u8>),
    Control(sys::ucp_ep_h, u64, Vec<u8>),
    /// Several control messages in one (see `batch`), not yet split.
    Batch(sys::ucp_ep_h, u64, Vec<u8>),
    /// A send nobody waits on that UCX held for this peer has ended.
    HeldSent(u64),
}

impl CbEvent {
    /// How many control messages this report carries from the endpoint at address `ep` (UCX's
    /// reply endpoint of an active message): none when it names another endpoint or carries
    /// no message (a drain named by `ep` is one report of its own, counted as none).
    pub(super) fn names_endpoint(&self, ep: usize) -> Option<u64> {
        match self {
            CbEvent::Control(e, ..) if *e as usize == ep => Some(1),
            CbEvent::Batch(e, _, bytes) if *e as usize == ep => {
                Some(batch::split(bytes).map_or(1, |m| m.len() as u64))
            }
            CbEvent::Drain(e, ..) if *e as usize == ep => Some(0),
            _ => None,
        }
    }
}

// SAFETY: the UCX handles in a `CbEvent` are only used under the agent's driver lock (the
// queue is the agent's own, `Shared::cb_events`), one thread at a time, as the worker's
// SERIALIZED mode allows.
unsafe impl Send for CbEvent {}

/// Queues a report on the agent whose worker is being progressed (the calling thread's, see
/// [`set_shared`]): the queue is the agent's, not the thread's, so a report never waits on a
/// thread that stopped driving, and never reaches another agent the same thread drives later.
fn push_cb(ev: CbEvent) {
    let mut pushed = false;
    with_shared(|sh| {
        sh.cb_events.lock().push(ev);
        pushed = true;
    });
    if !pushed {
        tracing::error!("UCX callback on a thread that drives no agent: report dropped");
    }
}

/// Takes what the callbacks reported since the last call (under the driver lock), leaving
/// `spare` (empty) as the queue.
pub(super) fn take_events(shared: &Shared, mut spare: Vec<CbEvent>) -> Vec<CbEvent> {
    debug_assert!(spare.is_empty());
    std::mem::swap(&mut spare, &mut *shared.cb_events.lock());
    spare
}

/// Ends an op once: counts it, takes it out of the ops in flight, wakes its waiter and, when it
/// asked for it, reports [`Event::OpDone`]. An op already ended is left as it is: more than one
/// path can reach the same op (the end of a worker fails every op in flight, a held receive not
/// yet released and a queued command's op included, and that receive's `Held` dropped, or that
/// command run, ends it again), and each op is counted and reported once.
pub(super) fn finish_slot(shared: &Shared, slot: &OpSlot, status: sys::ucs_status_t, len: usize) {
    if slot.id == 0 {
        // An internal drain receive: not user work, not counted.
        return slot.complete(status, len);
    }
    if slot.control {
        shared.untrack_op(slot);
        return slot.complete(status, len);
    }
    // Under the state's lock until it is set: of two ends, only the first counts.
    let mut state = slot.state.lock();
    if state.is_some() {
        return;
    }
    if status == sys::UCS_OK {
        shared.stats.ops_completed.fetch_add(1, Ordering::Relaxed);
        shared
            .stats
            .bytes_completed
            .fetch_add(len as u64, Ordering::Relaxed);
        let ns = shared.epoch.elapsed().as_nanos() as u64;
        shared
            .stats
            .last_completion_ns
            .store(ns.max(1), Ordering::Relaxed);
    } else {
        shared.stats.ops_failed.fetch_add(1, Ordering::Relaxed);
    }
    shared.untrack_op(slot);
    *state = Some((status, len));
    drop(state);
    slot.cv.notify_all();
    if slot.notify {
        shared.push_event(Event::OpDone(slot.id));
    }
}

/// What a control send hands to its callback: the slot, and the payload and header that must
/// outlive the send.
pub(super) struct ControlSend {
    pub(super) slot: Arc<OpSlot>,
    pub(super) bytes: Vec<u8>,
    pub(super) voice: super::peers::Voice,
}

thread_local! {
    /// The shared state of the agent this thread drives, for callbacks that complete slots.
    static SHARED: RefCell<Option<Arc<Shared>>> = const { RefCell::new(None) };
    /// The agent whose sink this thread is running, if any (compared by address only).
    static IN_SINK: Cell<*const Shared> = const { Cell::new(std::ptr::null()) };
}

/// Runs `f` (the owner's sink) marked as inside `shared`'s sink on this thread. The mark is
/// taken off however `f` ends: a sink that panics is caught above this (`run_sink`), and a
/// thread left marked would from then on only queue what it submits, never start it or wake
/// the progress thread for it.
pub(super) fn in_sink<R>(shared: &Shared, f: impl FnOnce() -> R) -> R {
    struct Restore(*const Shared);
    impl Drop for Restore {
        fn drop(&mut self) {
            IN_SINK.with(|c| c.set(self.0));
        }
    }
    let _restore = Restore(IN_SINK.with(|c| c.replace(shared as *const Shared)));
    f()
}

/// Whether this thread is running `shared`'s sink now: the pass that called it drains the
/// command queue as soon as it returns.
pub(super) fn in_sink_of(shared: &Shared) -> bool {
    IN_SINK.with(|c| std::ptr::eq(c.get(), shared))
}

/// Makes `shared` the calling thread's, for the callbacks that run in its next progress call:
/// whichever thread holds an agent's driver lock sets it before it calls into that worker.
pub(super) fn set_shared(shared: &Arc<Shared>) {
    SHARED.with(|s| {
        let mut s = s.borrow_mut();
        if !s.as_ref().is_some_and(|cur| Arc::ptr_eq(cur, shared)) {
            *s = Some(shared.clone());
        }
    })
}

/// Runs `f` with `shared` as this thread's agent, then puts back the one it had: for a stretch
/// of work on an agent's worker by a caller (driving it, or starting its commands), possibly
/// from inside the sink of another agent this thread drives.
pub(super) fn entered<R>(shared: &Arc<Shared>, f: impl FnOnce() -> R) -> R {
    // Put back however `f` ends (as `in_sink`).
    struct Restore(Option<Arc<Shared>>);
    impl Drop for Restore {
        fn drop(&mut self) {
            let prev = self.0.take();
            SHARED.with(|s| *s.borrow_mut() = prev);
        }
    }
    let _restore = Restore(SHARED.with(|s| s.borrow_mut().replace(shared.clone())));
    f()
}

pub(super) fn with_shared(f: impl FnOnce(&Shared)) {
    SHARED.with(|s| {
        if let Some(sh) = s.borrow().as_ref() {
            f(sh)
        }
    })
}

pub(super) unsafe extern "C" fn send_cb(
    request: *mut c_void,
    status: sys::ucs_status_t,
    user_data: *mut c_void,
) {
    timeline::mark(Stage::SendDone);
    let slot = Arc::from_raw(user_data as *const OpSlot);
    slot.request.store(std::ptr::null_mut(), Ordering::Release);
    sys::ucp_request_free(request);
    let len = slot.expected_len;
    with_shared(|sh| finish_slot(sh, &slot, status, len));
}

pub(super) unsafe extern "C" fn recv_cb(
    request: *mut c_void,
    status: sys::ucs_status_t,
    info: *const sys::ucp_tag_recv_info_t,
    user_data: *mut c_void,
) {
    timeline::mark(Stage::DataLanded);
    let slot = Arc::from_raw(user_data as *const OpSlot);
    slot.request.store(std::ptr::null_mut(), Ordering::Release);
    let len = if info.is_null() { 0 } else { (*info).length };
    sys::ucp_request_free(request);
    with_shared(|sh| finish_slot(sh, &slot, status, len));
}

pub(super) unsafe extern "C" fn control_send_cb(
    request: *mut c_void,
    status: sys::ucs_status_t,
    user_data: *mut c_void,
) {
    let ctx = Box::from_raw(user_data as *mut ControlSend);
    ctx.slot
        .request
        .store(std::ptr::null_mut(), Ordering::Release);
    sys::ucp_request_free(request);
    let len = ctx.bytes.len();
    with_shared(|sh| finish_slot(sh, &ctx.slot, status, len));
}

/// The end of a send nobody waits on (`Progress::send_internal`): its payload goes, and UCX
/// holds one queued send fewer.
pub(super) unsafe extern "C" fn internal_sent_cb(
    request: *mut c_void,
    _status: sys::ucs_status_t,
    _user_data: *mut c_void,
) {
    // The message's bytes go before the request is freed (UCX may reuse its address).
    let mut peer = None;
    with_shared(|sh| peer = sh.held_send_ended(request as usize));
    sys::ucp_request_free(request);
    if let Some(peer) = peer {
        push_cb(CbEvent::HeldSent(peer));
    }
}

pub(super) unsafe extern "C" fn am_drain_cb(
    _arg: *mut c_void,
    header: *const c_void,
    header_length: usize,
    data: *mut c_void,
    length: usize,
    param: *const sys::ucp_am_recv_param_t,
) -> sys::ucs_status_t {
    // As the control and bind callbacks: data a peer forced through rendezvous is a descriptor,
    // not the tag, and is not read.
    let rndv = (*param).recv_attr & (sys::UCP_AM_RECV_ATTR_FLAG_RNDV as u64) != 0;
    if header_length != 8 || length != 8 || data.is_null() || rndv {
        return sys::UCS_OK;
    }
    let uid = u64::from_le_bytes(
        std::slice::from_raw_parts(header as *const u8, 8)
            .try_into()
            .unwrap(),
    );
    let tag = u64::from_le_bytes(
        std::slice::from_raw_parts(data as *const u8, 8)
            .try_into()
            .unwrap(),
    );
    push_cb(CbEvent::Drain((*param).reply_ep, uid, tag));
    sys::UCS_OK
}

pub(super) type AmCb = unsafe extern "C" fn(
    *mut c_void,
    *const c_void,
    usize,
    *mut c_void,
    usize,
    *const sys::ucp_am_recv_param_t,
) -> sys::ucs_status_t;

pub(super) unsafe extern "C" fn am_bind_cb(
    _arg: *mut c_void,
    header: *const c_void,
    header_length: usize,
    data: *mut c_void,
    length: usize,
    param: *const sys::ucp_am_recv_param_t,
) -> sys::ucs_status_t {
    let rndv = (*param).recv_attr & (sys::UCP_AM_RECV_ATTR_FLAG_RNDV as u64) != 0;
    if header_length != 8 || length == 0 || length > 64 * 1024 || data.is_null() || rndv {
        return sys::UCS_OK;
    }
    let uid = u64::from_le_bytes(
        std::slice::from_raw_parts(header as *const u8, 8)
            .try_into()
            .unwrap(),
    );
    let addr = std::slice::from_raw_parts(data as *const u8, length).to_vec();
    push_cb(CbEvent::Bind(uid, addr));
    sys::UCS_OK
}

pub(super) unsafe extern "C" fn ep_err_cb(
    arg: *mut c_void,
    _ep: sys::ucp_ep_h,
    status: sys::ucs_status_t,
) {
    push_cb(CbEvent::EpError(arg as usize as u64, status));
}

pub(super) unsafe extern "C" fn conn_cb(req: sys::ucp_conn_request_h, _arg: *mut c_void) {
    push_cb(CbEvent::ConnRequest(req));
}

/// The handler argument under which [`am_control_cb`] also serves the batch id (see `batch`).
pub(super) const BATCH_ARG: *mut c_void = 1 as *mut c_void;

/// A control message, or (`arg` is [`BATCH_ARG`]) several in one, split later under the driver
/// lock. Control messages are sent eagerly, so the data is here now, with an 8-byte header (the
/// sender's voice on this endpoint, see `peers.rs`); anything else is dropped.
pub(super) unsafe extern "C" fn am_control_cb(
    arg: *mut c_void,
    header: *const c_void,
    header_length: usize,
    data: *mut c_void,
    length: usize,
    param: *const sys::ucp_am_recv_param_t,
) -> sys::ucs_status_t {
    timeline::mark(Stage::ControlArrived);
    let p = &*param;
    let batched = arg == BATCH_ARG;
    let max = if batched {
        batch::BATCH_MAX
    } else {
        MAX_CONTROL
    };
    if p.recv_attr & (sys::UCP_AM_RECV_ATTR_FLAG_RNDV as u64) != 0
        || data.is_null()
        || length > max
        || header_length != 8
    {
        return sys::UCS_OK;
    }
    let uid = u64::from_le_bytes(
        std::slice::from_raw_parts(header as *const u8, 8)
            .try_into()
            .unwrap(),
    );
    let bytes = std::slice::from_raw_parts(data as *const u8, length).to_vec();
    push_cb(if batched {
        CbEvent::Batch(p.reply_ep, uid, bytes)
    } else {
        CbEvent::Control(p.reply_ep, uid, bytes)
    });
    sys::UCS_OK
}
