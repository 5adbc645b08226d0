//! One waiter per blocked caller, woken once, for its own key.
//!
//! Every blocked call (`wait`, `recv_ready`, `next_advertisement`, `wait_for_notification`,
//! `connect`, an advertise waiting for a reconnect) registers a condition variable under the one
//! fact it waits for. The engine's glue wakes a key when that fact changes, so an event for one
//! request wakes the callers of that request only, never every blocked thread.
use parking_lot::{Condvar, MutexGuard};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use crate::proto::{RankId, RegionId, RequestKey, Role};
use crate::transport::PeerId;

/// The fact a caller waits for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum WaitKey {
    /// A new advertisement (context side).
    Advert,
    /// A notification from this rank.
    Note(RankId),
    /// The ready answer, or the end, of a receive.
    Ready(RequestKey),
    /// The end of a request in one role.
    Terminal(RequestKey, Role),
    /// A rank's connection changed state (bound, failed, reconnecting).
    Peer(RankId),
    /// A freshly dialled endpoint got its `Hello` (or failed).
    Dial(PeerId),
    /// UCX released a transfer in this region.
    Region(RegionId),
}

#[derive(Default)]
pub(crate) struct Waiters {
    map: HashMap<WaitKey, Vec<Arc<Condvar>>>,
}

impl Waiters {
    /// Wakes the callers waiting for `key` (usually one).
    pub(crate) fn wake(&self, key: WaitKey) {
        if let Some(list) = self.map.get(&key) {
            for cv in list {
                cv.notify_one();
            }
        }
    }

    /// Wakes everyone (shutdown).
    pub(crate) fn wake_all(&self) {
        for cv in self.map.values().flatten() {
            cv.notify_one();
        }
    }

    fn register(&mut self, key: WaitKey) -> Arc<Condvar> {
        let cv = Arc::new(Condvar::new());
        self.map.entry(key).or_default().push(cv.clone());
        cv
    }

    fn unregister(&mut self, key: WaitKey, cv: &Arc<Condvar>) {
        if let Some(list) = self.map.get_mut(&key) {
            list.retain(|c| !Arc::ptr_eq(c, cv));
            if list.is_empty() {
                self.map.remove(&key);
            }
        }
    }
}

/// Something that owns a [`Waiters`] (the engine's shared state).
pub(crate) trait HasWaiters {
    fn waiters(&mut self) -> &mut Waiters;
}

/// Blocks on `guard` until `until`, woken only for `key`. The lock is released while asleep.
/// Returns false if `until` passed. Spurious wakes are the caller's to re-check.
pub(crate) fn sleep<S: HasWaiters>(
    guard: &mut MutexGuard<'_, S>,
    key: WaitKey,
    until: Instant,
) -> bool {
    let cv = guard.waiters().register(key);
    let timed_out = cv.wait_until(guard, until).timed_out();
    guard.waiters().unregister(key, &cv);
    !timed_out
}
