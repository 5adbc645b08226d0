//! A map whose entries go a fixed time after they were put in, at O(1) per entry.
//!
//! The engine remembers every request that ended for minutes (a replayed key is refused), and
//! every ended receive's tag and every unclaimed outcome for a while. Swept with `retain` once
//! a second, such a map costs a pass over all of it under the engine's lock: at 10k requests a
//! second, 6M entries and tens of milliseconds each second in which no caller and no event can
//! run. Here the entries expire in the order they were put in (a queue beside the map), so
//! each expiry costs one pop, however large the map.
use foldhash::{HashMap, HashMapExt};
use std::collections::VecDeque;
use std::hash::Hash;
use std::time::{Duration, Instant};

/// Entries removed before they expire leave their queue slot behind; past this many more slots
/// than entries (and twice the entries) the queue is compacted.
const SLACK: usize = 1024;

pub(crate) struct Aged<K, V> {
    map: HashMap<K, (V, Instant)>,
    /// When each entry was put in, oldest first. A slot whose time no longer matches its
    /// entry's (removed, or put in again since) is skipped when it comes up.
    order: VecDeque<(Instant, K)>,
    keep: Duration,
}

impl<K: Hash + Eq + Clone, V> Aged<K, V> {
    /// Entries are kept `keep` after they were put in.
    pub fn new(keep: Duration) -> Self {
        Aged {
            map: HashMap::new(),
            order: VecDeque::new(),
            keep,
        }
    }

    /// Puts `v` in under `k` at `now` (replacing what was there, and its age).
    pub fn insert(&mut self, k: K, v: V, now: Instant) {
        // Put in again at the same instant: its slot is there already (a second one would
        // match too, and no compaction could take it).
        if self
            .map
            .insert(k.clone(), (v, now))
            .is_some_and(|(_, t)| t == now)
        {
            return;
        }
        self.order.push_back((now, k));
        self.compact();
    }

    pub fn get(&self, k: &K) -> Option<&V> {
        self.map.get(k).map(|(v, _)| v)
    }

    pub fn contains_key(&self, k: &K) -> bool {
        self.map.contains_key(k)
    }

    pub fn remove(&mut self, k: &K) -> Option<V> {
        self.map.remove(k).map(|(v, _)| v)
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.map.len()
    }

    /// Drops every entry put in `keep` or more before `now`. A clock read that ran behind an
    /// earlier one (another thread's) only makes an entry go a little late.
    pub fn expire(&mut self, now: Instant) {
        while let Some((at, _)) = self.order.front() {
            if now.saturating_duration_since(*at) < self.keep {
                break;
            }
            let (at, k) = self.order.pop_front().expect("looked at");
            if self.map.get(&k).is_some_and(|(_, t)| *t == at) {
                self.map.remove(&k);
            }
        }
    }

    /// Keeps the queue within twice the entries plus [`SLACK`]: a map whose entries are mostly
    /// removed early (outcomes claimed at once) must not keep a slot for each for `keep`. Each
    /// compaction passes over a queue at most that long, after at least as many removals.
    fn compact(&mut self) {
        if self.order.len() <= 2 * self.map.len() + SLACK {
            return;
        }
        let map = &self.map;
        self.order
            .retain(|(at, k)| map.get(k).is_some_and(|(_, t)| t == at));
    }

    #[cfg(test)]
    fn slots(&self) -> usize {
        self.order.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap as StdMap;

    #[test]
    fn entries_go_keep_after_they_were_put_in_and_not_before() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut a = Aged::new(ms(100));
        a.insert(1u64, "a", t0);
        a.insert(2, "b", t0 + ms(50));
        a.expire(t0 + ms(99));
        assert_eq!(a.len(), 2);
        a.expire(t0 + ms(100));
        assert!(!a.contains_key(&1) && a.get(&2) == Some(&"b"));
        // Put in again: its age starts over, and its first slot does not take it away.
        a.insert(2, "c", t0 + ms(120));
        a.expire(t0 + ms(160));
        assert_eq!(a.get(&2), Some(&"c"));
        a.expire(t0 + ms(220));
        assert_eq!(a.len(), 0);
        // Removed early: gone at once, and its slot goes at its time.
        a.insert(3, "d", t0 + ms(300));
        assert_eq!(a.remove(&3), Some("d"));
        assert!(a.get(&3).is_none());
        a.expire(t0 + ms(400));
        assert_eq!(a.slots(), 0);
    }

    #[test]
    fn entries_removed_early_do_not_keep_their_slots() {
        let t0 = Instant::now();
        let mut a = Aged::new(Duration::from_secs(600));
        for i in 0..100_000u64 {
            a.insert(i, (), t0);
            assert_eq!(a.remove(&i), Some(()));
            // The bound is checked as an entry is put in, that entry counted.
            assert!(a.slots() <= SLACK + 3, "{} slots", a.slots());
        }
    }

    #[test]
    fn entries_left_after_a_compaction_still_go_at_their_time() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut a = Aged::new(ms(10_000));
        // 5000 kept, each after 3 claimed at once: compactions run among live entries.
        for i in 0..20_000u64 {
            a.insert(i, i, t0 + ms(i / 4));
            if i % 4 != 0 {
                a.remove(&i);
            }
            // Put in again at the same instant: no second slot.
            a.insert(i - i % 4, i - i % 4, t0 + ms((i - i % 4) / 4));
        }
        assert_eq!(a.len(), 5000);
        assert!(a.slots() <= 2 * a.len() + SLACK + 1, "{} slots", a.slots());
        a.expire(t0 + ms(10_000 + 2499));
        assert_eq!(a.len(), 2500, "those put in before 2.5 s are gone");
        assert!(a.get(&9996).is_none() && a.get(&10_000) == Some(&10_000));
        a.expire(t0 + ms(20_000));
        assert_eq!((a.len(), a.slots()), (0, 0));
    }

    proptest! {
        /// Against a plain map with times: after any inserts, removes and expiries (the clock
        /// running forward), the same keys are present with the same values.
        #[test]
        fn it_holds_what_a_plain_map_swept_by_age_holds(
            ops in prop::collection::vec((0u8..3, 0u16..50, 0u64..40), 1..400)
        ) {
            let t0 = Instant::now();
            let keep = Duration::from_millis(100);
            let mut a = Aged::new(keep);
            let mut model: StdMap<u16, (u64, Instant)> = StdMap::new();
            let mut now = t0;
            for (op, k, x) in ops {
                now += Duration::from_millis(x % 20);
                match op {
                    0 => {
                        a.insert(k, x, now);
                        model.insert(k, (x, now));
                    }
                    1 => {
                        prop_assert_eq!(a.remove(&k), model.remove(&k).map(|(v, _)| v));
                    }
                    _ => {
                        a.expire(now);
                        model.retain(|_, (_, at)| now.duration_since(*at) < keep);
                    }
                }
                prop_assert_eq!(a.len(), model.len());
                for (k, (v, _)) in &model {
                    prop_assert_eq!(a.get(k), Some(v));
                }
            }
        }
    }
}
