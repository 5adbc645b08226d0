//! One-sided transfers on the progress thread: memory mapping (with its packed remote key), a
//! peer's remote keys, and put and get, each completed by a flush of the endpoint.
use super::callbacks::send_cb;
use super::handles::{Mapped, RemoteKey as UcxRkey};
use super::op::{OpSlot, STOP_PEER};
use super::progress::Progress;
use super::{sys, PeerId};
use crate::error::Result;
use std::ffi::c_void;
use std::sync::atomic::Ordering;
use std::sync::Arc;

impl Progress {
    /// Ids of maps and remote keys come from one counter (peers have their own).
    pub(super) fn next_handle(&mut self) -> u64 {
        self.next_handle += 1;
        self.next_handle
    }

    /// Registers `[addr, addr+len)`; the id and packed remote key go back to the owner.
    pub(super) fn map(&mut self, addr: usize, len: usize) -> Result<(u64, Vec<u8>)> {
        // SAFETY: Agent::map's caller vouched for the range.
        unsafe { Mapped::new(self.ctx.0, addr as *mut u8, len) }.map(|m| {
            let id = self.next_handle();
            let packed = m.packed_rkey.clone();
            self.maps.insert(id, m);
            (id, packed)
        })
    }

    pub(super) fn unmap(&mut self, id: u64) {
        drop(self.maps.remove(&id));
    }

    /// Unpacks a peer's remote key on its endpoint.
    pub(super) fn unpack_rkey(&mut self, peer: PeerId, packed: &[u8]) -> Result<u64> {
        self.ep_of(peer).and_then(|ep| {
            // SAFETY: ep is a live endpoint of our worker.
            let k = unsafe { UcxRkey::unpack(ep, packed) }?;
            let id = self.next_handle();
            self.rkeys.insert(id, (peer.0, k));
            Ok(id)
        })
    }

    pub(super) fn destroy_rkey(&mut self, id: u64) {
        self.lost_rkeys.remove(&id);
        drop(self.rkeys.remove(&id));
    }

    /// A put or get, then a flush of the endpoint: the flush's completion is the op's, and it
    /// means the data is in place at the target (put) or here (get).
    pub(super) fn start_rma(
        &mut self,
        rkey: u64,
        put: bool,
        addr: usize,
        len: usize,
        remote: u64,
        slot: Arc<OpSlot>,
    ) {
        if self.ended_before_start(&slot) {
            return;
        }
        let Some((peer, key)) = self.rkeys.get(&rkey).map(|(p, k)| (*p, k.0)) else {
            if self.lost_rkeys.contains(&rkey) {
                // Its endpoint went with a worker the agent moved away from.
                slot.stop_reason.store(STOP_PEER, Ordering::Release);
                return self.finish_slot(&slot, sys::UCS_ERR_NOT_CONNECTED, 0);
            }
            return self.finish_slot(&slot, sys::UCS_ERR_INVALID_PARAM, 0);
        };
        let ep = match self.ep_of(PeerId(peer)) {
            Ok(ep) => ep,
            Err(_) => {
                slot.stop_reason.store(STOP_PEER, Ordering::Release);
                return self.finish_slot(&slot, sys::UCS_ERR_NOT_CONNECTED, 0);
            }
        };
        let plain = sys::ucp_request_param_t::default();
        // SAFETY: the caller of put/get vouched for the local buffer until the op ends; the
        // remote range was checked against the key's advertised region.
        let ptr = unsafe {
            if put {
                sys::ucp_put_nbx(ep, addr as *const c_void, len, remote, key, &plain)
            } else {
                sys::ucp_get_nbx(ep, addr as *mut c_void, len, remote, key, &plain)
            }
        };
        if sys::ptr_is_err(ptr) {
            return self.finish_slot(&slot, sys::ptr_status(ptr), 0);
        }
        if sys::ptr_is_ptr(ptr) {
            // No callback was asked for: UCX releases the request when it completes; the
            // flush below is what we track.
            // SAFETY: freeing the request handle once.
            unsafe { sys::ucp_request_free(ptr) };
        }
        let mut param = Self::request_param(&slot);
        param.cb.send = Some(send_cb);
        // SAFETY: as for the tag sends: the slot's count travels in user_data.
        let ptr = unsafe { sys::ucp_ep_flush_nbx(ep, &param) };
        self.track(&slot, ptr);
    }
}
