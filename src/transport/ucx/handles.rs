//! Owning, non-`Clone` wrappers for UCX handles. Each releases its handle exactly once in `Drop`.
//! They live on the progress thread (they hold raw UCX pointers and are neither `Send` nor
//! `Sync`); what other threads hold are ids that the progress thread maps to these.
//!
//! Drop order matters and is encoded in `Progress`'s field order: remote keys, then endpoints
//! and the listener, then mapped memory, then the worker, then the context.
use super::sys;
use super::{map_status, Result};
use std::os::raw::c_void;

/// `ucp_context_h`: destroyed with `ucp_cleanup`.
pub(super) struct Context(pub sys::ucp_context_h);

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: created by ucp_init, destroyed once, after everything made from it.
        unsafe { sys::ucp_cleanup(self.0) }
    }
}

/// `ucp_worker_h`: destroyed with `ucp_worker_destroy`.
pub(super) struct Worker(pub sys::ucp_worker_h);

impl Drop for Worker {
    fn drop(&mut self) {
        // SAFETY: created by ucp_worker_create, destroyed once, after its endpoints/listener.
        unsafe { sys::ucp_worker_destroy(self.0) }
    }
}

/// `ucp_listener_h`: destroyed with `ucp_listener_destroy`.
pub(super) struct Listener(pub sys::ucp_listener_h);

impl Drop for Listener {
    fn drop(&mut self) {
        // SAFETY: created by ucp_listener_create, destroyed once, before the worker.
        unsafe { sys::ucp_listener_destroy(self.0) }
    }
}

/// `ucp_ep_h`: force-closed on drop (every request still on it completes with an error), with
/// a bounded number of progress calls to let the close finish.
pub(super) struct Endpoint {
    pub ep: sys::ucp_ep_h,
    worker: sys::ucp_worker_h,
}

impl Endpoint {
    pub fn new(ep: sys::ucp_ep_h, worker: sys::ucp_worker_h) -> Self {
        Endpoint { ep, worker }
    }

    /// Closes the endpoint in flush mode, without waiting: what is queued on it still goes out
    /// first, in the worker's later progress.
    pub fn close_flushed(self) {
        let this = std::mem::ManuallyDrop::new(self);
        let param = sys::ucp_request_param_t::default();
        // SAFETY: closed exactly once, here (not dropped: no force close follows).
        let req = unsafe { sys::ucp_ep_close_nbx(this.ep, &param) };
        if sys::ptr_is_ptr(req) {
            // SAFETY: freed once; UCX finishes the close and releases it in later progress.
            unsafe { sys::ucp_request_free(req) };
        }
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        let param = sys::ucp_request_param_t {
            op_attr_mask: sys::UCP_OP_ATTR_FIELD_FLAGS,
            flags: sys::UCP_EP_CLOSE_FLAG_FORCE,
            ..Default::default()
        };
        // SAFETY: the endpoint belongs to `worker`, which outlives it (field order in Progress),
        // and is closed exactly once, here.
        let req = unsafe { sys::ucp_ep_close_nbx(self.ep, &param) };
        if sys::ptr_is_ptr(req) {
            for _ in 0..10_000 {
                // SAFETY: `req` is the close request just returned and not yet freed.
                if unsafe { sys::ucp_request_check_status(req) } != sys::UCS_INPROGRESS {
                    break;
                }
                // SAFETY: progress on our own worker, on its owning thread.
                unsafe { sys::ucp_worker_progress(self.worker) };
            }
            // SAFETY: freed once; UCX releases it when (if) it completes later.
            unsafe { sys::ucp_request_free(req) };
        }
    }
}

/// Memory registered with `ucp_mem_map`, with its packed remote key.
pub(super) struct Mapped {
    ctx: sys::ucp_context_h,
    memh: sys::ucp_mem_h,
    pub packed_rkey: Vec<u8>,
}

impl Mapped {
    /// # Safety
    /// `addr..addr+len` must be valid host memory that outlives the mapping.
    pub unsafe fn new(ctx: sys::ucp_context_h, addr: *mut u8, len: usize) -> Result<Mapped> {
        let params = sys::ucp_mem_map_params_t {
            field_mask: (sys::UCP_MEM_MAP_PARAM_FIELD_ADDRESS | sys::UCP_MEM_MAP_PARAM_FIELD_LENGTH)
                as u64,
            address: addr as *mut c_void,
            length: len,
            ..Default::default()
        };
        let mut memh: sys::ucp_mem_h = std::ptr::null_mut();
        // SAFETY: params names exactly the fields set; the caller vouches for the range.
        let st = unsafe { sys::ucp_mem_map(ctx, &params, &mut memh) };
        if st != sys::UCS_OK {
            return Err(map_status(st, "ucp_mem_map"));
        }
        let mut mapped = Mapped {
            ctx,
            memh,
            packed_rkey: Vec::new(),
        };
        let mut buf: *mut c_void = std::ptr::null_mut();
        let mut size = 0usize;
        // SAFETY: memh was just created from ctx; the buffer is copied then released.
        let st = unsafe { sys::ucp_rkey_pack(ctx, memh, &mut buf, &mut size) };
        if st != sys::UCS_OK {
            return Err(map_status(st, "ucp_rkey_pack"));
        }
        // SAFETY: UCX returned `size` readable bytes at `buf`. Sealed (length and checksum):
        // `ucp_ep_rkey_unpack` reads a key without a length, so only one whole and unchanged
        // may reach it (`Agent::unpack_rkey`).
        mapped.packed_rkey = super::address::seal_rkey(unsafe {
            std::slice::from_raw_parts(buf as *const u8, size)
        });
        // SAFETY: releasing the buffer ucp_rkey_pack allocated, once.
        unsafe { sys::ucp_rkey_buffer_release(buf) };
        Ok(mapped)
    }
}

impl Drop for Mapped {
    fn drop(&mut self) {
        // SAFETY: unmapped once, before the context is cleaned up (field order in Progress).
        unsafe { sys::ucp_mem_unmap(self.ctx, self.memh) };
    }
}

/// A peer's memory key unpacked on one of our endpoints: destroyed with `ucp_rkey_destroy`.
pub(super) struct RemoteKey(pub sys::ucp_rkey_h);

impl RemoteKey {
    /// # Safety
    /// `ep` must be a live endpoint of this thread's worker.
    pub unsafe fn unpack(ep: sys::ucp_ep_h, packed: &[u8]) -> Result<RemoteKey> {
        let mut rkey: sys::ucp_rkey_h = std::ptr::null_mut();
        // SAFETY: the caller vouches for ep; `packed` is readable for the call.
        let st =
            unsafe { sys::ucp_ep_rkey_unpack(ep, packed.as_ptr() as *const c_void, &mut rkey) };
        if st != sys::UCS_OK {
            return Err(map_status(st, "ucp_ep_rkey_unpack"));
        }
        Ok(RemoteKey(rkey))
    }
}

impl Drop for RemoteKey {
    fn drop(&mut self) {
        // SAFETY: destroyed once, before its endpoint (field order in Progress).
        unsafe { sys::ucp_rkey_destroy(self.0) }
    }
}
