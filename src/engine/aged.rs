//! A map whose entries go a fixed time after they were put in, at O(1) per entry.
//!
//! The engine remembers every request that ended for minutes (a replayed key is refused), and
//! every ended receive's tag and every unclaimed outcome for a while. Swept with `retain` once
//! a second, such a map costs a pass over all of it under the engine's lock: at 10k requests a
//! second, 6M entries and tens of milliseconds each second in which no caller and no event can
//! run. Here the entries expire in the order they were put in (a queue beside the map), so
//! each expiry costs one pop, however large the map.
//!
//! The time alone does not bound such a map: it grows with the request rate (at 10k requests a
//! second, 6M keys in 10 minutes, about 800 MB). So a map also has a cap on its entries: past
//! it, the oldest entry goes early, also one pop (skipping the slots of removed entries).
use foldhash::{HashMap, HashMapExt};
use std::collections::VecDeque;
use std::hash::Hash;
use std::time::{Duration, Instant};

/// Entries removed before they expire leave their queue slot behind; past this many more slots
/// than entries (and twice the entries) the queue is compacted.
const SLACK: usize = 1024;

pub(crate) struct Aged<K, V> {
    /// Each entry with the number of its slot in `order`.
    map: HashMap<K, (V, u64)>,
    /// When each entry was put in, oldest first, with the slot's number. A slot whose number no
    /// longer matches its entry's (removed, or put in again since) is skipped when it comes up.
    order: VecDeque<(Instant, u64, K)>,
    /// The number the next slot gets.
    next: u64,
    keep: Duration,
    cap: usize,
    /// Entries that went before their time because the map was full.
    evicted: u64,
}

impl<K: Hash + Eq + Clone, V> Aged<K, V> {
    /// Entries are kept `keep` after they were put in, and at most `cap` (at least 1) at once:
    /// putting in one more takes out the one put in first.
    pub fn new(keep: Duration, cap: usize) -> Self {
        Aged {
            map: HashMap::new(),
            order: VecDeque::new(),
            next: 0,
            keep,
            cap: cap.max(1),
            evicted: 0,
        }
    }

    /// How many entries went early, the map being full.
    pub fn evicted(&self) -> u64 {
        self.evicted
    }

    /// Puts `v` in under `k` at `now` (replacing what was there, and its age and place).
    pub fn insert(&mut self, k: K, v: V, now: Instant) {
        let n = self.next;
        self.next += 1;
        self.map.insert(k.clone(), (v, n));
        self.order.push_back((now, n, k));
        if self.map.len() > self.cap {
            self.evict_oldest();
        }
        self.compact();
    }

    /// Is this slot its entry's?
    fn live(&self, n: u64, k: &K) -> bool {
        self.map.get(k).is_some_and(|(_, m)| *m == n)
    }

    /// Takes out the entry put in first. It is never the one just put in: the map holds two or
    /// more when this runs, and each entry has exactly one live slot.
    fn evict_oldest(&mut self) {
        while let Some((_, n, k)) = self.order.pop_front() {
            if self.live(n, &k) {
                self.map.remove(&k);
                self.evicted += 1;
                return;
            }
        }
    }

    pub fn get(&self, k: &K) -> Option<&V> {
        self.map.get(k).map(|(v, _)| v)
    }

    pub fn get_mut(&mut self, k: &K) -> Option<&mut V> {
        self.map.get_mut(k).map(|(v, _)| v)
    }

    pub fn contains_key(&self, k: &K) -> bool {
        self.map.contains_key(k)
    }

    pub fn remove(&mut self, k: &K) -> Option<V> {
        self.map.remove(k).map(|(v, _)| v)
    }

    /// Keeps only the entries whose key passes `keep` (a pass over all of them: for rare
    /// events only).
    pub fn retain(&mut self, keep: impl Fn(&K) -> bool) {
        self.map.retain(|k, _| keep(k));
        self.compact();
    }

    /// Takes out the entries whose key `pick` names, and gives them back (a pass over all of
    /// them: for rare events only).
    pub fn take_if(&mut self, pick: impl Fn(&K) -> bool) -> Vec<(K, V)> {
        let keys: Vec<K> = self.map.keys().filter(|k| pick(k)).cloned().collect();
        let taken = keys
            .into_iter()
            .filter_map(|k| self.map.remove(&k).map(|(v, _)| (k, v)))
            .collect();
        self.compact();
        taken
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Slots in the expiry queue, live and stale (kept within twice the entries plus
    /// [`SLACK`]).
    pub fn slots(&self) -> usize {
        self.order.len()
    }

    /// Drops every entry put in `keep` or more before `now`. A clock read that ran behind an
    /// earlier one (another thread's) only makes an entry go a little late.
    pub fn expire(&mut self, now: Instant) {
        while let Some((at, _, _)) = self.order.front() {
            if now.saturating_duration_since(*at) < self.keep {
                break;
            }
            let (_, n, k) = self.order.pop_front().expect("looked at");
            if self.live(n, &k) {
                self.map.remove(&k);
            }
        }
    }

    /// As [`Aged::expire`], but an entry whose key `stays` says must stay is put in again at
    /// `now` (kept another `keep`, as if it had just been put in) instead of dropped.
    pub fn expire_unless(&mut self, now: Instant, stays: impl Fn(&K) -> bool) {
        let mut again = Vec::new();
        while let Some((at, _, _)) = self.order.front() {
            if now.saturating_duration_since(*at) < self.keep {
                break;
            }
            let (_, n, k) = self.order.pop_front().expect("looked at");
            if self.live(n, &k) {
                let (v, _) = self.map.remove(&k).expect("live");
                if stays(&k) {
                    again.push((k, v));
                }
            }
        }
        for (k, v) in again {
            self.insert(k, v, now);
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
            .retain(|(_, n, k)| map.get(k).is_some_and(|(_, m)| m == n));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap as StdMap;

    #[test]
    fn take_if_gives_back_what_it_takes_and_the_rest_still_expires() {
        let t0 = Instant::now();
        let mut m = Aged::new(Duration::from_secs(10), 100);
        for k in 0..6u32 {
            m.insert(k, k * 10, t0);
        }
        let mut taken = m.take_if(|k| k % 2 == 0);
        taken.sort();
        assert_eq!(taken, vec![(0, 0), (2, 20), (4, 40)]);
        assert_eq!(m.len(), 3);
        assert_eq!(m.get(&2), None);
        assert_eq!(m.get(&3), Some(&30));
        m.expire(t0 + Duration::from_secs(10));
        assert_eq!(m.len(), 0);
    }

    #[test]
    fn entries_go_keep_after_they_were_put_in_and_not_before() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut a = Aged::new(ms(100), usize::MAX);
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
        let mut a = Aged::new(Duration::from_secs(600), usize::MAX);
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
        let mut a = Aged::new(ms(10_000), usize::MAX);
        // 5000 kept, each after 3 claimed at once: compactions run among live entries.
        for i in 0..20_000u64 {
            a.insert(i, i, t0 + ms(i / 4));
            if i % 4 != 0 {
                a.remove(&i);
            }
            // Put in again at the same instant: a new slot, the old one stale.
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

    #[test]
    fn past_its_cap_the_oldest_entry_goes_first_whatever_its_age() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut a = Aged::new(Duration::from_secs(600), 100);
        // Times run backwards: what goes is the first put in, not the earliest stamped.
        let at = |i: u64| t0 + ms(10_000 - i);
        for i in 0..100u64 {
            a.insert(i, i, at(i));
        }
        // Twelve removed early (0, 3, .. 33): their slots are stale and never count.
        for i in (0..34).step_by(3) {
            a.remove(&i);
        }
        for i in 100..132u64 {
            a.insert(i, i, at(i));
        }
        // 100 + 32 - 12 put in and left in, 100 kept: the 20 first put in went, 1, 2, 4 .. 29.
        assert_eq!((a.len(), a.evicted()), (100, 20));
        let gone: Vec<u64> = (0..132).filter(|k| !a.contains_key(k)).collect();
        let expected: Vec<u64> = (0..30).chain((30..34).step_by(3)).collect();
        assert_eq!(gone, expected);
        // Put in again, 31 is the newest: the next to go is 32.
        a.insert(31, 0, t0);
        a.insert(1000, 0, t0);
        assert!(a.contains_key(&31) && !a.contains_key(&32) && a.contains_key(&34));
        assert_eq!((a.len(), a.evicted()), (100, 21));
        assert!(a.slots() <= 2 * a.len() + SLACK);
    }

    proptest! {
        /// Against a plain map with times and the order entries were put in: after any inserts,
        /// removes and expiries (the clock running forward), with or without a cap, the same
        /// keys are present with the same values, and as many went early.
        #[test]
        fn it_holds_what_a_plain_map_swept_by_age_and_capped_holds(
            cap in prop::option::of(1usize..30),
            ops in prop::collection::vec((0u8..3, 0u16..50, 0u64..40), 1..400)
        ) {
            let t0 = Instant::now();
            let keep = Duration::from_millis(100);
            let mut a = Aged::new(keep, cap.unwrap_or(usize::MAX));
            // key -> (value, put in at, order put in)
            let mut model: StdMap<u16, (u64, Instant, u64)> = StdMap::new();
            let mut evicted = 0u64;
            let mut now = t0;
            for (i, (op, k, x)) in ops.into_iter().enumerate() {
                now += Duration::from_millis(x % 20);
                match op {
                    0 => {
                        a.insert(k, x, now);
                        model.insert(k, (x, now, i as u64));
                        if cap.is_some_and(|c| model.len() > c) {
                            let first = *model.iter().min_by_key(|(_, e)| e.2).expect("full").0;
                            model.remove(&first);
                            evicted += 1;
                        }
                    }
                    1 => {
                        prop_assert_eq!(a.remove(&k), model.remove(&k).map(|(v, _, _)| v));
                    }
                    _ => {
                        a.expire(now);
                        model.retain(|_, (_, at, _)| now.duration_since(*at) < keep);
                    }
                }
                prop_assert_eq!(a.len(), model.len());
                prop_assert_eq!(a.evicted(), evicted);
                for (k, (v, _, _)) in &model {
                    prop_assert_eq!(a.get(k), Some(v));
                }
            }
        }
    }
}
