//! One waiter per blocked caller, woken once, for its own key.
//!
//! Every blocked call (`wait`, `recv_ready`, `next_advertisement`, `wait_for_notification`,
//! `connect`, an advertise waiting for a reconnect) registers a condition variable under the one
//! fact it waits for. The engine's glue wakes a key when that fact changes, so an event for one
//! request wakes the callers of that request only, never every blocked thread.
use foldhash::HashMap;
use parking_lot::{Condvar, Mutex, MutexGuard};
use smallvec::SmallVec;
use std::collections::VecDeque;
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

/// One sleeping caller: its condition variable, and whether it has been woken already (it stays
/// registered until it runs again, and must not be counted as asleep for a second item).
struct Sleeper {
    cv: Arc<Condvar>,
    woken: bool,
}

#[derive(Default)]
pub(crate) struct Waiters {
    /// The sleepers of each key: usually one, kept inline.
    map: HashMap<WaitKey, SmallVec<[Sleeper; 1]>>,
    /// Whether wakes are held ([`Waiters::hold`] to [`Waiters::unhold_into`]).
    holding: bool,
    /// The wakes made while held, not yet notified. Kept between holds with its room: the sink
    /// holds wakes on every delivery.
    held: Vec<Arc<Condvar>>,
}

/// Notifies `cv` now, or keeps it for later while wakes are held.
fn notify(holding: bool, held: &mut Vec<Arc<Condvar>>, cv: &Arc<Condvar>) {
    if holding {
        held.push(cv.clone());
    } else {
        cv.notify_one();
    }
}

impl Waiters {
    /// Keys with a caller asleep on them now.
    pub(crate) fn keys(&self) -> usize {
        self.map.len()
    }

    /// Wakes every caller waiting for `key` (usually one).
    pub(crate) fn wake(&mut self, key: WaitKey) {
        let Waiters { map, holding, held } = self;
        if let Some(list) = map.get_mut(&key) {
            for s in list {
                s.woken = true;
                notify(*holding, held, &s.cv);
            }
        }
    }

    /// From now on wakes are marked but not notified: [`Waiters::unhold_into`] hands them over, to
    /// be notified once what the waker does next is under way (the engine's sink: after the
    /// control messages it queued have been started). Wakes still held from an earlier hold
    /// (a sink that panicked) are notified now.
    pub(crate) fn hold(&mut self) {
        for cv in self.held.drain(..) {
            cv.notify_one();
        }
        self.holding = true;
    }

    /// Ends [`Waiters::hold`]: moves the condition variables to notify to the end of `out`
    /// (locked only if there are any).
    pub(crate) fn unhold_into(&mut self, out: &Mutex<Vec<Arc<Condvar>>>) {
        self.holding = false;
        if !self.held.is_empty() {
            out.lock().append(&mut self.held);
        }
    }

    /// Wakes one caller waiting for `key` that has not been woken yet, the one asleep longest:
    /// for a fact that one caller takes (an item in a queue), the others would only wake to
    /// find nothing (a herd of runnable threads on a few cores delays the one that matters).
    pub(crate) fn wake_one(&mut self, key: WaitKey) {
        let Waiters { map, holding, held } = self;
        if let Some(s) = map
            .get_mut(&key)
            .and_then(|list| list.iter_mut().find(|s| !s.woken))
        {
            s.woken = true;
            notify(*holding, held, &s.cv);
        }
    }

    /// Sleepers of `key` woken but not yet run: each will look for an item of its own.
    pub(crate) fn woken(&self, key: WaitKey) -> usize {
        self.map
            .get(&key)
            .map_or(0, |l| l.iter().filter(|s| s.woken).count())
    }

    /// Takes the next item of `queue`, the queue whose items wake `key`'s sleepers one each, and
    /// passes the turn on: wakes one more sleeper if more items wait than sleepers already woken
    /// for them (a caller that was polling may have taken one meant for a sleeper).
    pub(crate) fn take<T>(&mut self, key: WaitKey, queue: &mut VecDeque<T>) -> Option<T> {
        let item = queue.pop_front()?;
        if queue.len() > self.woken(key) {
            self.wake_one(key);
        }
        Some(item)
    }

    /// Wakes everyone (shutdown), held wakes included, at once.
    pub(crate) fn wake_all(&mut self) {
        for s in self.map.values_mut().flatten() {
            s.woken = true;
            s.cv.notify_one();
        }
        for cv in self.held.drain(..) {
            cv.notify_one();
        }
    }

    fn register(&mut self, key: WaitKey) -> Arc<Condvar> {
        let cv = Arc::new(Condvar::new());
        self.map.entry(key).or_default().push(Sleeper {
            cv: cv.clone(),
            woken: false,
        });
        cv
    }

    fn unregister(&mut self, key: WaitKey, cv: &Arc<Condvar>) {
        if let Some(list) = self.map.get_mut(&key) {
            list.retain(|s| !Arc::ptr_eq(&s.cv, cv));
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

#[cfg(test)]
mod tests {
    use super::*;

    fn unhold(w: &mut Waiters) -> Vec<Arc<Condvar>> {
        let out = Mutex::new(Vec::new());
        w.unhold_into(&out);
        out.into_inner()
    }

    fn woken(w: &Waiters, key: WaitKey) -> usize {
        w.map
            .get(&key)
            .map_or(0, |l| l.iter().filter(|s| s.woken).count())
    }

    #[test]
    fn wake_one_wakes_each_sleeper_once_and_wake_wakes_all() {
        let mut w = Waiters::default();
        let a: Vec<_> = (0..3).map(|_| w.register(WaitKey::Advert)).collect();
        let other = w.register(WaitKey::Peer(RankId(1)));
        w.wake_one(WaitKey::Advert);
        assert_eq!(woken(&w, WaitKey::Advert), 1);
        assert!(
            w.map[&WaitKey::Advert][0].woken,
            "the one asleep longest first"
        );
        w.wake_one(WaitKey::Advert);
        w.wake_one(WaitKey::Advert);
        assert_eq!(
            woken(&w, WaitKey::Advert),
            3,
            "a woken sleeper is not counted twice"
        );
        w.wake_one(WaitKey::Advert);
        assert_eq!(
            woken(&w, WaitKey::Peer(RankId(1))),
            0,
            "other keys untouched"
        );
        // A sleeper that ran again and went back to sleep registers anew, unwoken.
        w.unregister(WaitKey::Advert, &a[0]);
        let again = w.register(WaitKey::Advert);
        w.wake_one(WaitKey::Advert);
        assert_eq!(woken(&w, WaitKey::Advert), 3);
        w.wake(WaitKey::Peer(RankId(1)));
        assert_eq!(woken(&w, WaitKey::Peer(RankId(1))), 1);
        for cv in a.iter().skip(1).chain([&again]) {
            w.unregister(WaitKey::Advert, cv);
        }
        w.unregister(WaitKey::Peer(RankId(1)), &other);
        assert!(w.map.is_empty());
    }

    /// The engine's sink holds its wakes until the control messages it queued have left: a
    /// held wake marks its sleeper at once (a second `wake_one` picks another) but hands the
    /// condition variable over instead of notifying it; what a panicked sink left held is
    /// notified by the next hold, and a shutdown notifies everything.
    #[test]
    fn held_wakes_are_marked_at_once_and_handed_over_instead_of_notified() {
        let mut w = Waiters::default();
        let key = WaitKey::Terminal(RequestKey::new(7, 0), Role::Receiver);
        let adverts: Vec<_> = (0..2).map(|_| w.register(WaitKey::Advert)).collect();
        let end = w.register(key);
        assert!(unhold(&mut w).is_empty(), "nothing is held outside a hold");
        w.hold();
        w.wake(key);
        w.wake_one(WaitKey::Advert);
        assert_eq!(woken(&w, key), 1);
        assert_eq!(
            woken(&w, WaitKey::Advert),
            1,
            "marked although not notified"
        );
        let held = unhold(&mut w);
        assert_eq!(held.len(), 2);
        assert!(Arc::ptr_eq(&held[0], &end) && Arc::ptr_eq(&held[1], &adverts[0]));
        assert!(unhold(&mut w).is_empty(), "handed over once");
        // Outside a hold a wake is notified at once: nothing to hand over.
        w.wake_one(WaitKey::Advert);
        assert_eq!(woken(&w, WaitKey::Advert), 2);
        assert!(unhold(&mut w).is_empty());
        // A hold never ended (a sink that panicked) is notified by the next one.
        w.hold();
        w.wake(key);
        w.hold();
        assert!(unhold(&mut w).is_empty());
        w.hold();
        w.wake(key);
        w.wake_all();
        assert!(w.held.is_empty(), "a shutdown notifies held wakes");
        assert!(w.holding, "and the hold stays until it ends");
    }

    #[test]
    fn the_turn_is_passed_on_only_for_items_no_woken_sleeper_will_take() {
        let mut w = Waiters::default();
        let cvs: Vec<_> = (0..4).map(|_| w.register(WaitKey::Advert)).collect();
        // Two items arrived together: two sleepers woken.
        w.wake_one(WaitKey::Advert);
        w.wake_one(WaitKey::Advert);
        let mut q: VecDeque<u32> = [1, 2].into();
        // The first runs, takes one; one item is left and one woken sleeper will take it.
        w.unregister(WaitKey::Advert, &cvs[0]);
        assert_eq!(w.take(WaitKey::Advert, &mut q), Some(1));
        assert_eq!(woken(&w, WaitKey::Advert), 1, "no third sleeper woken");
        // Two more arrive unannounced (as if a poller had taken the other's): after a take, two
        // are left for one woken sleeper, so one more is woken.
        q.extend([3, 4]);
        assert_eq!(w.take(WaitKey::Advert, &mut q), Some(2));
        assert_eq!(woken(&w, WaitKey::Advert), 2);
        assert_eq!(w.take(WaitKey::Advert, &mut VecDeque::<u32>::new()), None);
    }
}
