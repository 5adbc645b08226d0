//! A pool of receive buffers with lease accounting.
//!
//! The pool only counts: it never touches memory. Every [`Lease`] must come back exactly once,
//! either through [`BufferPool::release`] (the core proved no peer can still write into it) or
//! through [`BufferPool::fence`] (a peer might still write: the driver calls
//! [`BufferPool::restore`] once UCX has released the receive). A second
//! return, a return of a lease the pool did not hand out, and a lease still out when the owner
//! says none should be ([`BufferPool::check_all_returned`]) are [`ErrorKind::Accounting`] errors.
use super::id::RequestKey;
use super::lowest::LowestFree;
use crate::error::{Error, ErrorKind, Result};

/// Index of a buffer slot in its pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BufferId(pub u32);

/// One lease of one slot. `serial` is unique per pool lifetime, so a stale copy of an old lease
/// can never release the slot's next lease.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Lease {
    pub buffer: BufferId,
    pub serial: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Slot {
    Free,
    Leased { serial: u64, owner: RequestKey },
    Fenced,
}

#[derive(Debug)]
pub struct BufferPool {
    slots: Vec<Slot>,
    /// Free slots, lowest first: the lowest free slot is handed out first, which makes reuse as
    /// eager as possible (and tests of "reused while a peer could write" as sharp as possible).
    /// A bitmap with summary levels keeps a lease or a return to a word per level.
    free: LowestFree,
    next_serial: u64,
    leased: usize,
    fenced: usize,
}

impl BufferPool {
    pub fn new(capacity: u32) -> Self {
        BufferPool {
            slots: vec![Slot::Free; capacity as usize],
            free: LowestFree::full(capacity),
            next_serial: 1,
            leased: 0,
            fenced: 0,
        }
    }

    pub fn capacity(&self) -> usize {
        self.slots.len()
    }
    pub fn available(&self) -> usize {
        self.slots.len() - self.leased - self.fenced
    }
    pub fn leased(&self) -> usize {
        self.leased
    }
    pub fn fenced(&self) -> usize {
        self.fenced
    }

    /// Leases a free slot to `owner`, or `None` when the pool is exhausted.
    pub fn lease(&mut self, owner: RequestKey) -> Option<Lease> {
        let idx = self.free.take_lowest()? as usize;
        let serial = self.next_serial;
        self.next_serial += 1;
        self.slots[idx] = Slot::Leased { serial, owner };
        self.leased += 1;
        Some(Lease {
            buffer: BufferId(idx as u32),
            serial,
        })
    }

    /// The request a slot is currently leased to.
    pub fn owner(&self, buffer: BufferId) -> Option<RequestKey> {
        match self.slots.get(buffer.0 as usize) {
            Some(Slot::Leased { owner, .. }) => Some(*owner),
            _ => None,
        }
    }

    /// True when `lease` is the live lease of its slot.
    pub fn is_live(&self, lease: Lease) -> bool {
        matches!(self.slots.get(lease.buffer.0 as usize),
            Some(Slot::Leased { serial, .. }) if *serial == lease.serial)
    }

    fn take_back(&mut self, lease: Lease, what: &str) -> Result<usize> {
        if !self.is_live(lease) {
            return Err(Error::new(
                ErrorKind::Accounting,
                format!(
                    "{what} of buffer {} lease {}: not live (double return or foreign lease)",
                    lease.buffer.0, lease.serial
                ),
            ));
        }
        self.leased -= 1;
        Ok(lease.buffer.0 as usize)
    }

    /// Returns a lease whose buffer no peer can write any more.
    pub fn release(&mut self, lease: Lease) -> Result<()> {
        let idx = self.take_back(lease, "release")?;
        self.slots[idx] = Slot::Free;
        self.free.put(idx as u32);
        Ok(())
    }

    /// Returns a lease whose buffer a peer might still write: the slot stays out of service
    /// until [`BufferPool::restore`].
    pub fn fence(&mut self, lease: Lease) -> Result<()> {
        let idx = self.take_back(lease, "fence")?;
        self.slots[idx] = Slot::Fenced;
        self.fenced += 1;
        Ok(())
    }

    /// Puts a fenced slot back in service once the driver has replaced its registration.
    pub fn restore(&mut self, buffer: BufferId) -> Result<()> {
        match self.slots.get_mut(buffer.0 as usize) {
            Some(slot @ Slot::Fenced) => {
                *slot = Slot::Free;
                self.fenced -= 1;
                self.free.put(buffer.0);
                Ok(())
            }
            _ => Err(Error::new(
                ErrorKind::Accounting,
                format!("restore of buffer {}: not fenced", buffer.0),
            )),
        }
    }

    /// `Err(Accounting)` naming the outstanding leases when any lease is still out.
    pub fn check_all_returned(&self) -> Result<()> {
        let out: Vec<String> = self
            .slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| match s {
                Slot::Leased { owner, .. } => Some(format!("buffer {i} ({owner})")),
                _ => None,
            })
            .collect();
        if out.is_empty() {
            Ok(())
        } else {
            Err(Error::new(
                ErrorKind::Accounting,
                format!("leaked leases: {}", out.join(", ")),
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lease_release_exactly_once() {
        let mut p = BufferPool::new(2);
        let k = RequestKey::new(1, 0);
        let a = p.lease(k).unwrap();
        let b = p.lease(k).unwrap();
        assert!(p.lease(k).is_none());
        assert!(p.check_all_returned().is_err());
        p.release(a).unwrap();
        assert_eq!(p.release(a).unwrap_err().kind, ErrorKind::Accounting);
        // A stale copy of `a` cannot release the slot's next lease.
        let c = p.lease(k).unwrap();
        assert_eq!(c.buffer, a.buffer);
        assert!(p.release(a).is_err());
        p.fence(b).unwrap();
        assert!(p.release(b).is_err());
        assert_eq!(p.available(), 0);
        p.restore(b.buffer).unwrap();
        assert!(p.restore(b.buffer).is_err());
        p.release(c).unwrap();
        p.check_all_returned().unwrap();
        assert_eq!(p.available(), 2);
    }
}
