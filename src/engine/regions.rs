//! Regions: host memory lent to kvlink once, whose transfers UCX cannot recall are fenced
//! instead of closing their endpoint.

use super::glue::Core;
use super::waiters::WaitKey;
use super::{BufferSpec, Engine, RegionId, RegionInfo};
use crate::error::Result;
use crate::proto::BufferKind;
use crate::transport::PeerId;
use std::time::Instant;

impl Engine {
    /// Lends `[addr, addr + len)` of host memory to kvlink as a region, once; requests then
    /// receive into ranges of it (named with [`Engine::region_buffer`], or any buffer whose
    /// address lies inside it) and send from it (any data inside it). What a region changes:
    /// when a request ends while UCX still holds one of its transfers there (a frozen or
    /// partitioned peer, data already matched), the call returns at once and the transfer is
    /// left to UCX with its range fenced: new transfers that overlap it get `ErrorKind::Fenced`
    /// until UCX releases it, and nothing else on the pair is touched. In plain memory the
    /// endpoint must be force-closed instead (unless the cancel of a receive nothing matched
    /// releases it within 5 ms), which costs every request on the pair. Regions
    /// may not overlap (`InvalidArgument`).
    ///
    /// # Safety
    /// The memory must be host memory, writable for receives, that stays valid until
    /// [`Engine::deregister_region`] returns `Ok` for it, or the engine is dropped: kvlink may
    /// write into (or read from) a fenced range of it after the request that used it ended.
    pub unsafe fn register_region(&self, addr: u64, len: u64) -> Result<RegionId> {
        self.inner.core.lock().regions.register(addr, len)
    }

    /// A buffer of `len` bytes at `offset` in `region`, for [`Engine::advertise`]:
    /// `OutOfBounds` past the region's end, `InvalidArgument` for an unknown region.
    pub fn region_buffer(
        &self,
        region: RegionId,
        kind: BufferKind,
        segment: u32,
        offset: u64,
        len: u64,
    ) -> Result<BufferSpec> {
        let addr = self
            .inner
            .core
            .lock()
            .regions
            .address(region, offset, len)?;
        Ok(BufferSpec {
            kind,
            segment,
            addr,
            len,
            device_id: -1,
        })
    }

    /// A region's transfers and fenced bytes now.
    pub fn region_info(&self, region: RegionId) -> Result<RegionInfo> {
        self.inner.core.lock().regions.info(region)
    }

    /// Takes a region back. Refused (`InvalidArgument`) while a running request moves data in
    /// or out of it. From the call on, no new request may use it. Fenced transfers are ended
    /// now: after a grace of 5 ms (a receive nothing matched is released by its cancel), their
    /// endpoints are force-closed (the caller wants the memory back; those pairs reconnect) and the call waits until UCX has released them, or returns `Fenced` at
    /// `deadline` with the region still registered (and usable again once no other
    /// deregistration of it is waiting). Of several concurrent calls for one region, any that
    /// ends after the region is gone returns `Ok`.
    pub fn deregister_region(&self, region: RegionId, deadline: Instant) -> Result<()> {
        let fenced = self.inner.core.lock().regions.begin_remove(region)?;
        let released = |core: &mut Core| match core.regions.info(region) {
            Ok(i) if i.transfers > 0 => None,
            _ => Some(()),
        };
        if !fenced.is_empty() {
            // A fenced receive that nothing matched is released by its cancel, which the
            // progress thread runs next: the grace plain memory gives it before its endpoint is
            // closed (found by review: a deregistration right after such a request's end
            // force-closed a sound pair, failing every other request on it).
            // Half of what is left at most: the close, if one is needed, has the rest.
            let now = Instant::now();
            let left = deadline.saturating_duration_since(now);
            let grace = now + super::glue::FENCE_CANCEL_GRACE.min(left / 2);
            self.block(WaitKey::Region(region), grace, None, released);
        }
        for peer in self.inner.core.lock().regions.fenced_peers(region) {
            tracing::warn!(
                region = region.0,
                "deregistration: closing the endpoint of a fenced transfer's peer"
            );
            let _ = self.inner.agent.close_peer(PeerId(peer));
        }
        self.block(WaitKey::Region(region), deadline, None, released);
        self.inner.core.lock().regions.finish_remove(region)
    }

    /// The fenced ranges of `region` now, as (offset, length): memory the caller must not
    /// touch yet (UCX may still write a fenced receive's range, or read a fenced send's).
    pub fn region_fenced_ranges(&self, region: RegionId) -> Result<Vec<(u64, u64)>> {
        self.inner.core.lock().regions.fenced_ranges(region)
    }
}
