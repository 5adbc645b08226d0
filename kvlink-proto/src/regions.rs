//! Regions: host memory a caller registers once and lends to kvlink until it deregisters it.
//! Requests name a range inside a region (region + offset + length, or simply an address that
//! falls inside one), to receive into or to send from.
//!
//! Why: UCX cannot recall a rendezvous receive once the sender's data has been matched to it,
//! nor a send that its receiver does not drain. Such a transfer in plain caller memory can only
//! be stopped by force-closing the endpoint (which ends every request on that pair) while the
//! caller is held until UCX lets go. A transfer in a region needs neither: the memory stays
//! lent to kvlink, so the call returns at once and only the transfer's *range* is fenced. A
//! fenced range is refused to new receives ([`ErrorKind::Fenced`]: UCX may still write or read
//! it) until UCX has released the transfer (it finished, or the endpoint failed); sends, which
//! only read, are refused only where a fenced receive may still write. Nothing else on the pair
//! is touched, and a region cannot be deregistered while UCX holds any transfer in it.
//!
//! The table only counts; it never touches memory or UCX. Every transfer into or out of a
//! region is [`Regions::track`]ed when posted and [`Regions::done`] when UCX has released it;
//! in between it may be [`Regions::fence`]d (its request ended first). All operations are
//! O(log n) in the number of regions; the overlap check is O(1) while nothing in the region is
//! fenced, and otherwise linear in its transfers (bounded by the receive pool and the sends in
//! flight).
use crate::error::{Error, ErrorKind, Result};
use foldhash::{HashMap, HashMapExt};
use std::collections::BTreeMap;

/// A registered region (never reused within one table).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RegionId(pub u64);

/// One transfer UCX holds in a region.
#[derive(Clone, Copy, Debug)]
struct Use {
    addr: u64,
    len: u64,
    /// The transfer's peer, as the owner names it (what a deregistration must close).
    peer: u64,
    /// A receive: UCX may write the range (a send only reads it).
    writes: bool,
    fenced: bool,
}

/// What [`Regions::info`] reports of one region.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RegionInfo {
    pub addr: u64,
    pub len: u64,
    /// Transfers into or out of the region that UCX still holds, fenced ones included.
    pub transfers: usize,
    /// Of those, the ones whose request has ended: their ranges are refused to new receives
    /// (and, for a fenced receive, to new sends).
    pub fenced_transfers: usize,
    /// The sum of the fenced transfers' lengths (sends from the same bytes may overlap: each
    /// counts).
    pub fenced_bytes: u64,
}

#[derive(Debug)]
struct Region {
    id: RegionId,
    len: u64,
    /// Transfers UCX holds in this region, by op id.
    uses: HashMap<u64, Use>,
    fenced: usize,
    fenced_bytes: u64,
    /// Deregistrations under way (callers waiting in one): no new transfer may start here
    /// while any is.
    closing: u32,
}

#[derive(Debug, Default)]
pub struct Regions {
    /// By start address, so the region holding an address is one range query away.
    by_start: BTreeMap<u64, Region>,
    starts: HashMap<RegionId, u64>,
    /// Op id -> the start of its region.
    by_op: HashMap<u64, u64>,
    next: u64,
    fenced_bytes: u64,
    /// Transfers fenced so far (each cost its range for a while, not the pair).
    fences: u64,
}

impl Regions {
    pub fn new() -> Regions {
        Regions::default()
    }

    /// Registers `[addr, addr + len)`. It must not overlap a region already registered.
    pub fn register(&mut self, addr: u64, len: u64) -> Result<RegionId> {
        let end = match addr.checked_add(len) {
            Some(e) if addr != 0 && len != 0 => e,
            _ => {
                return Err(Error::invalid(format!(
                "region at {addr:#x}, {len} bytes: needs a non-null address, a length and no wrap"
            )))
            }
        };
        let before = self.by_start.range(..end).next_back();
        if let Some((&s, r)) = before.filter(|(&s, r)| s + r.len > addr) {
            return Err(Error::invalid(format!(
                "region at {addr:#x}, {len} bytes overlaps region {} at {s:#x}, {} bytes",
                r.id.0, r.len
            )));
        }
        self.next += 1;
        let id = RegionId(self.next);
        self.by_start.insert(
            addr,
            Region {
                id,
                len,
                uses: HashMap::new(),
                fenced: 0,
                fenced_bytes: 0,
                closing: 0,
            },
        );
        self.starts.insert(id, addr);
        Ok(id)
    }

    fn start(&self, id: RegionId) -> Result<u64> {
        self.starts.get(&id).copied().ok_or_else(|| unknown(id))
    }

    fn region(&self, id: RegionId) -> Result<(u64, &Region)> {
        let start = self.start(id)?;
        Ok((start, &self.by_start[&start]))
    }

    fn region_mut(&mut self, id: RegionId) -> Result<&mut Region> {
        let start = self.start(id)?;
        Ok(self.by_start.get_mut(&start).expect("indexed"))
    }

    /// The address of `len` bytes at `offset` in region `id`: `OutOfBounds` past its end.
    pub fn address(&self, id: RegionId, offset: u64, len: u64) -> Result<u64> {
        let (start, r) = self.region(id)?;
        match offset.checked_add(len) {
            Some(end) if len != 0 && end <= r.len => Ok(start + offset),
            _ => Err(Error::new(
                ErrorKind::OutOfBounds,
                format!(
                    "{len} bytes at offset {offset} of region {}: the region has {} bytes",
                    id.0, r.len
                ),
            )),
        }
    }

    /// Which region `[addr, addr + len)` lies in (None: none, it is plain caller memory), and
    /// whether it may be received into now. A range that straddles a region's edge is
    /// `OutOfBounds`; one that overlaps a fenced range is `Fenced`.
    pub fn check(&self, addr: u64, len: u64) -> Result<Option<RegionId>> {
        self.lookup(addr, len, true)
    }

    /// [`Regions::check`] for a send: UCX only reads the range, so only a fenced *receive*
    /// (which UCX may still write) is in the way.
    pub fn find(&self, addr: u64, len: u64) -> Result<Option<RegionId>> {
        self.lookup(addr, len, false)
    }

    fn lookup(&self, addr: u64, len: u64, for_receive: bool) -> Result<Option<RegionId>> {
        let Some(end) = addr.checked_add(len) else {
            return Err(Error::new(
                ErrorKind::OutOfBounds,
                "buffer wraps the address space",
            ));
        };
        // The last region that starts before `end` is the only one that can overlap.
        let Some((&start, r)) = self.by_start.range(..end).next_back() else {
            return Ok(None);
        };
        let r_end = start + r.len;
        if r_end <= addr {
            return Ok(None);
        }
        if addr < start || end > r_end {
            return Err(Error::new(
                ErrorKind::OutOfBounds,
                format!(
                    "buffer at {addr:#x}, {len} bytes straddles an edge of region {} ({start:#x}, {} bytes)",
                    r.id.0, r.len
                ),
            ));
        }
        if r.closing > 0 {
            return Err(Error::invalid(format!(
                "region {} is being deregistered",
                r.id.0
            )));
        }
        if r.fenced == 0 {
            return Ok(Some(r.id));
        }
        let hit = r
            .uses
            .values()
            .filter(|u| u.fenced && (for_receive || u.writes))
            .find(|u| u.addr < end && addr < u.addr + u.len);
        if let Some(Use {
            addr: a, len: l, ..
        }) = hit
        {
            return Err(Error::new(
                ErrorKind::Fenced,
                format!(
                    "buffer at {addr:#x}, {len} bytes overlaps a fenced range of region {} ({a:#x}, {l} bytes): \
                     a transfer of an ended request that UCX still holds; it is freed when UCX releases it",
                    r.id.0
                ),
            ));
        }
        Ok(Some(r.id))
    }

    /// Records transfer `op` (a receive if `writes`) with `peer` over `[addr, addr + len)` of
    /// region `id` (as [`Regions::check`] or [`Regions::find`] found it). Refused, changing
    /// nothing: an `op` already tracked (`InvalidArgument`: it is released by [`Regions::done`]
    /// first), a range not wholly inside the region (`OutOfBounds`), a region being
    /// deregistered (`InvalidArgument`).
    pub fn track(
        &mut self,
        op: u64,
        peer: u64,
        writes: bool,
        id: RegionId,
        addr: u64,
        len: u64,
    ) -> Result<()> {
        if self.by_op.contains_key(&op) {
            return Err(Error::invalid(format!(
                "transfer {op} is already tracked in a region"
            )));
        }
        let start = self.start(id)?;
        let r = self.by_start.get_mut(&start).expect("indexed");
        let inside = addr >= start
            && addr
                .checked_add(len)
                .is_some_and(|end| len != 0 && end <= start + r.len);
        if !inside {
            return Err(Error::new(
                ErrorKind::OutOfBounds,
                format!(
                    "transfer at {addr:#x}, {len} bytes is not inside region {} ({start:#x}, {} bytes)",
                    id.0, r.len
                ),
            ));
        }
        if r.closing > 0 {
            return Err(Error::invalid(format!(
                "region {} is being deregistered",
                id.0
            )));
        }
        r.uses.insert(
            op,
            Use {
                addr,
                len,
                peer,
                writes,
                fenced: false,
            },
        );
        self.by_op.insert(op, start);
        Ok(())
    }

    /// Whether transfer `op` is in a region (tracked and not yet done); false: plain memory.
    pub fn holds(&self, op: u64) -> bool {
        self.by_op.contains_key(&op)
    }

    /// The request of transfer `op` ended while UCX still holds it: if it is in a region, its
    /// range is fenced and true is returned (the caller need not be held). False: plain memory.
    pub fn fence(&mut self, op: u64) -> bool {
        let Some(start) = self.by_op.get(&op) else {
            return false;
        };
        let r = self.by_start.get_mut(start).expect("indexed");
        let Some(u) = r.uses.get_mut(&op) else {
            return false;
        };
        if !u.fenced {
            u.fenced = true;
            self.fences += 1;
            r.fenced += 1;
            r.fenced_bytes += u.len;
            self.fenced_bytes += u.len;
        }
        true
    }

    /// UCX has released transfer `op`: its range is free (fenced or not). Unknown ids are
    /// ignored (plain memory). Returns the region, if it was in one.
    pub fn done(&mut self, op: u64) -> Option<RegionId> {
        let start = self.by_op.remove(&op)?;
        let r = self.by_start.get_mut(&start).expect("indexed");
        if let Some(u) = r.uses.remove(&op) {
            if u.fenced {
                r.fenced -= 1;
                r.fenced_bytes -= u.len;
                self.fenced_bytes -= u.len;
            }
        }
        Some(r.id)
    }

    pub fn info(&self, id: RegionId) -> Result<RegionInfo> {
        let (start, r) = self.region(id)?;
        Ok(RegionInfo {
            addr: start,
            len: r.len,
            transfers: r.uses.len(),
            fenced_transfers: r.fenced,
            fenced_bytes: r.fenced_bytes,
        })
    }

    /// The fenced ranges of region `id` as (offset, length), lowest first: the memory its owner
    /// must not touch until they are gone.
    pub fn fenced_ranges(&self, id: RegionId) -> Result<Vec<(u64, u64)>> {
        let (start, r) = self.region(id)?;
        let mut v: Vec<(u64, u64)> = r
            .uses
            .values()
            .filter(|u| u.fenced)
            .map(|u| (u.addr - start, u.len))
            .collect();
        v.sort_unstable();
        Ok(v)
    }

    /// Starts deregistering region `id`: refused (`InvalidArgument`) while a running request
    /// uses it. From here no new transfer may start in it. Returns the peers of its fenced
    /// transfers, each once: what must be closed so that UCX releases them.
    pub fn begin_remove(&mut self, id: RegionId) -> Result<Vec<u64>> {
        let r = self.region_mut(id)?;
        let live = r.uses.len() - r.fenced;
        if live > 0 {
            return Err(Error::invalid(format!(
                "region {} is in use by {live} transfer(s) of running requests",
                id.0
            )));
        }
        r.closing += 1;
        Ok(Self::peers_of(r))
    }

    /// The peers of region `id`'s fenced transfers now, each once (none for a region gone).
    pub fn fenced_peers(&self, id: RegionId) -> Vec<u64> {
        self.region(id)
            .map(|(_, r)| Self::peers_of(r))
            .unwrap_or_default()
    }

    fn peers_of(r: &Region) -> Vec<u64> {
        let mut peers: Vec<u64> = r.uses.values().map(|u| u.peer).collect();
        peers.sort_unstable();
        peers.dedup();
        peers
    }

    /// Ends a deregistration begun by [`Regions::begin_remove`]: forgets region `id` if UCX
    /// holds nothing in it any more, else (`Fenced`) leaves it registered, and usable again
    /// once no other deregistration of it is under way. A region that a concurrent
    /// deregistration has already forgotten is gone, as asked: `Ok` (ids are never reused; an
    /// id never issued is an error). Each `begin_remove` that succeeded takes one call.
    pub fn finish_remove(&mut self, id: RegionId) -> Result<()> {
        if id.0 == 0 || id.0 > self.next {
            return Err(unknown(id)); // never issued
        }
        let Ok(r) = self.region_mut(id) else {
            return Ok(());
        };
        r.closing = r.closing.saturating_sub(1);
        if !r.uses.is_empty() {
            return Err(Error::new(
                ErrorKind::Fenced,
                format!(
                    "region {} still has {} fenced transfer(s) that UCX has not released; it stays registered",
                    id.0,
                    r.uses.len()
                ),
            ));
        }
        let start = self.starts.remove(&id).expect("indexed");
        self.by_start.remove(&start);
        Ok(())
    }

    pub fn len(&self) -> usize {
        self.by_start.len()
    }
    pub fn is_empty(&self) -> bool {
        self.by_start.is_empty()
    }
    /// Bytes fenced over all regions.
    pub fn fenced_bytes(&self) -> u64 {
        self.fenced_bytes
    }
    /// Transfers fenced so far, over all regions (deregistered ones included).
    pub fn fences(&self) -> u64 {
        self.fences
    }
}

fn unknown(id: RegionId) -> Error {
    Error::invalid(format!("region {} is not registered here", id.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: u64 = 0x10_000;

    #[test]
    fn registration_rejects_bad_and_overlapping_ranges() {
        let mut t = Regions::new();
        assert_eq!(
            t.register(0, 10).unwrap_err().kind,
            ErrorKind::InvalidArgument
        );
        assert_eq!(
            t.register(A, 0).unwrap_err().kind,
            ErrorKind::InvalidArgument
        );
        assert_eq!(
            t.register(u64::MAX - 4, 10).unwrap_err().kind,
            ErrorKind::InvalidArgument
        );
        let r = t.register(A, 100).unwrap();
        for (addr, len) in [(A, 1), (A + 99, 10), (A - 10, 11), (A - 10, 200)] {
            let e = t.register(addr, len).unwrap_err();
            assert_eq!(e.kind, ErrorKind::InvalidArgument, "{addr:#x}+{len}: {e}");
        }
        // Touching edges are fine.
        let below = t.register(A - 10, 10).unwrap();
        let above = t.register(A + 100, 5).unwrap();
        assert_ne!(below, r);
        assert_ne!(above, r);
        assert_eq!(t.len(), 3);
    }

    #[test]
    fn addresses_are_found_and_bounded() {
        let mut t = Regions::new();
        let r = t.register(A, 100).unwrap();
        assert_eq!(t.address(r, 10, 90).unwrap(), A + 10);
        assert_eq!(
            t.address(r, 10, 91).unwrap_err().kind,
            ErrorKind::OutOfBounds
        );
        assert_eq!(
            t.address(r, u64::MAX, 2).unwrap_err().kind,
            ErrorKind::OutOfBounds
        );
        assert_eq!(t.address(r, 0, 0).unwrap_err().kind, ErrorKind::OutOfBounds);
        assert_eq!(
            t.address(RegionId(99), 0, 1).unwrap_err().kind,
            ErrorKind::InvalidArgument
        );
        assert_eq!(t.check(A, 100).unwrap(), Some(r));
        assert_eq!(t.check(A + 50, 1).unwrap(), Some(r));
        assert_eq!(t.check(A + 100, 10).unwrap(), None);
        assert_eq!(t.check(A - 10, 10).unwrap(), None);
        assert_eq!(t.check(A - 1, 2).unwrap_err().kind, ErrorKind::OutOfBounds);
        assert_eq!(t.check(A + 99, 2).unwrap_err().kind, ErrorKind::OutOfBounds);
        assert_eq!(
            t.check(u64::MAX, 2).unwrap_err().kind,
            ErrorKind::OutOfBounds
        );
    }

    #[test]
    fn a_fenced_range_is_refused_until_released_and_nothing_else_is() {
        let mut t = Regions::new();
        let r = t.register(A, 100).unwrap();
        t.track(1, 50, true, r, A, 40).unwrap();
        t.track(2, 50, true, r, A + 40, 40).unwrap();
        t.track(3, 60, false, r, A + 80, 10).unwrap();
        // Live receives do not block other ranges (and the table does not police overlap of
        // running requests: that is the caller's memory contract).
        assert_eq!(t.check(A + 90, 10).unwrap(), Some(r));
        assert!(t.fence(1));
        assert!(!t.fence(77), "plain memory is not fenced here");
        assert!(t.fence(1), "fencing twice counts once");
        let i = t.info(r).unwrap();
        assert_eq!(
            (i.transfers, i.fenced_transfers, i.fenced_bytes),
            (3, 1, 40)
        );
        assert_eq!(t.fenced_bytes(), 40);
        for (addr, len) in [(A, 1), (A + 39, 1), (A + 10, 80)] {
            assert_eq!(t.check(addr, len).unwrap_err().kind, ErrorKind::Fenced);
        }
        assert_eq!(t.check(A + 40, 60).unwrap(), Some(r));
        // A fenced receive may still be written: no send from it either.
        assert_eq!(t.find(A, 40).unwrap_err().kind, ErrorKind::Fenced);
        assert_eq!(t.find(A - 1, 2).unwrap_err().kind, ErrorKind::OutOfBounds);
        assert_eq!(t.fenced_ranges(r).unwrap(), vec![(0, 40)]);
        // A fenced send is only read: sends from it go on, receives into it do not.
        t.fence(3);
        assert_eq!(t.find(A + 80, 10).unwrap(), Some(r));
        assert_eq!(t.check(A + 85, 1).unwrap_err().kind, ErrorKind::Fenced);
        assert_eq!(t.fenced_ranges(r).unwrap(), vec![(0, 40), (80, 10)]);
        t.done(3);
        assert_eq!(t.done(1), Some(r));
        assert_eq!(t.done(1), None);
        assert_eq!(t.fenced_bytes(), 0);
        assert_eq!(t.check(A, 40).unwrap(), Some(r));
        assert_eq!(t.done(2), Some(r));
        assert_eq!(
            t.info(r).unwrap(),
            RegionInfo {
                addr: A,
                len: 100,
                ..RegionInfo::default()
            }
        );
    }

    #[test]
    fn a_region_in_use_is_not_forgotten() {
        let mut t = Regions::new();
        let r = t.register(A, 100).unwrap();
        t.track(1, 7, true, r, A, 10).unwrap();
        t.track(2, 8, false, r, A + 10, 10).unwrap();
        assert_eq!(
            t.begin_remove(r).unwrap_err().kind,
            ErrorKind::InvalidArgument
        );
        t.fence(1);
        t.fence(2);
        // Closing: the peers to close come back, and nothing new may start meanwhile.
        assert_eq!(t.begin_remove(r).unwrap(), vec![7, 8]);
        assert_eq!(
            t.check(A + 50, 1).unwrap_err().kind,
            ErrorKind::InvalidArgument
        );
        assert_eq!(t.finish_remove(r).unwrap_err().kind, ErrorKind::Fenced);
        // Not released in time: registered and usable again.
        assert_eq!(t.check(A + 50, 1).unwrap(), Some(r));
        t.begin_remove(r).unwrap();
        t.done(1);
        t.done(2);
        t.finish_remove(r).unwrap();
        assert!(t.is_empty());
        assert_eq!(
            t.begin_remove(r).unwrap_err().kind,
            ErrorKind::InvalidArgument
        );
        assert_eq!(t.check(A, 10).unwrap(), None, "the memory is plain again");
        assert_eq!(
            t.track(3, 7, true, r, A, 10).unwrap_err().kind,
            ErrorKind::InvalidArgument
        );
        // A new registration of the same memory gets a new id.
        let again = t.register(A, 100).unwrap();
        assert_ne!(again, r);
    }

    /// `track` is the table's only way in for a transfer: what it takes must keep the table
    /// whole. A second `track` of an op still held (it replaced the first, fenced, one and left
    /// the region's fenced count behind: `begin_remove` then underflowed), a range outside the
    /// region (`fenced_ranges` underflowed on it), an empty one, or one in a region being
    /// deregistered are refused, typed, and change nothing.
    #[test]
    fn track_refuses_what_would_corrupt_the_table() {
        let mut t = Regions::new();
        let r = t.register(A, 100).unwrap();
        let other = t.register(A + 1000, 100).unwrap();
        t.track(1, 7, true, r, A, 10).unwrap();
        t.fence(1);
        for (id, addr) in [(r, A + 20), (other, A + 1000)] {
            assert_eq!(
                t.track(1, 7, true, id, addr, 10).unwrap_err().kind,
                ErrorKind::InvalidArgument,
                "op 1 is still held"
            );
        }
        for (addr, len) in [
            (A - 1, 10),
            (A + 95, 10),
            (A + 100, 1),
            (A, 0),
            (u64::MAX, 2),
            (A + 1000, 10),
        ] {
            assert_eq!(
                t.track(2, 7, true, r, addr, len).unwrap_err().kind,
                ErrorKind::OutOfBounds,
                "{addr:#x}+{len}"
            );
        }
        assert_eq!(t.fenced_ranges(r).unwrap(), vec![(0, 10)]);
        let i = t.info(r).unwrap();
        assert_eq!(
            (i.transfers, i.fenced_transfers, i.fenced_bytes),
            (1, 1, 10)
        );
        assert_eq!(t.info(other).unwrap().transfers, 0);
        assert_eq!(t.done(1), Some(r));
        assert_eq!(t.done(1), None);
        assert_eq!(
            t.info(r).unwrap(),
            RegionInfo {
                addr: A,
                len: 100,
                ..RegionInfo::default()
            }
        );
        assert_eq!(t.begin_remove(r).unwrap(), Vec::<u64>::new());
        assert_eq!(
            t.track(3, 7, false, r, A, 10).unwrap_err().kind,
            ErrorKind::InvalidArgument,
            "being deregistered"
        );
        t.finish_remove(r).unwrap();
        // The other region was never touched: it goes at once.
        t.begin_remove(other).unwrap();
        t.finish_remove(other).unwrap();
        assert!(t.is_empty());
    }

    #[test]
    fn concurrent_deregistrations_of_one_region() {
        let mut t = Regions::new();
        let r = t.register(A, 100).unwrap();
        t.track(1, 7, true, r, A, 10).unwrap();
        t.fence(1);
        // Two callers deregister at once; the first gives up while UCX still holds the
        // transfer: the region stays closed for the second, which is still waiting.
        assert_eq!(t.begin_remove(r).unwrap(), vec![7]);
        assert_eq!(t.begin_remove(r).unwrap(), vec![7]);
        assert_eq!(t.finish_remove(r).unwrap_err().kind, ErrorKind::Fenced);
        assert_eq!(
            t.check(A + 50, 1).unwrap_err().kind,
            ErrorKind::InvalidArgument,
            "still being deregistered by the second caller"
        );
        // UCX releases it: the second succeeds, and a third that raced it finds it gone: Ok.
        t.begin_remove(r).unwrap();
        t.done(1);
        t.finish_remove(r).unwrap();
        t.finish_remove(r).unwrap();
        assert!(t.is_empty());
        assert_eq!(
            t.finish_remove(RegionId(r.0 + 1)).unwrap_err().kind,
            ErrorKind::InvalidArgument,
            "an id never issued is not 'already gone'"
        );
    }
}
