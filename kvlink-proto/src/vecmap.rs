//! `VecMap`: a map kept as one vector sorted by key, for the few entries a request has (its
//! senders, its segments, its votes). Lookups are binary searches, iteration is in key order as
//! with `BTreeMap`, and a map of one entry (a request's one sender, one segment, one vote, the
//! usual case) is no allocation, of n entries one, where a `BTreeMap` allocates a node of eleven
//! slots even for one entry. Inserting is O(n): meant for maps filled once, at a request's start,
//! or a handful of times.

use smallvec::SmallVec;

/// One entry inline: a 1x1 request's maps (and its vote) allocate nothing.
type Entries<K, V> = SmallVec<[(K, V); 1]>;

/// A map sorted by key; see the module docs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct VecMap<K, V> {
    entries: Entries<K, V>,
}

impl<K: Ord, V> Default for VecMap<K, V> {
    fn default() -> Self {
        VecMap {
            entries: SmallVec::new(),
        }
    }
}

impl<K: Ord, V> VecMap<K, V> {
    pub(crate) fn new() -> Self {
        Self::default()
    }

    fn find(&self, key: &K) -> Result<usize, usize> {
        self.entries.binary_search_by(|(k, _)| k.cmp(key))
    }

    pub(crate) fn get(&self, key: &K) -> Option<&V> {
        self.find(key).ok().map(|i| &self.entries[i].1)
    }

    pub(crate) fn get_mut(&mut self, key: &K) -> Option<&mut V> {
        self.find(key).ok().map(|i| &mut self.entries[i].1)
    }

    pub(crate) fn contains_key(&self, key: &K) -> bool {
        self.find(key).is_ok()
    }

    /// Inserts or replaces; returns the value replaced, as `BTreeMap::insert` does.
    pub(crate) fn insert(&mut self, key: K, value: V) -> Option<V> {
        match self.find(&key) {
            Ok(i) => Some(std::mem::replace(&mut self.entries[i].1, value)),
            Err(i) => {
                self.entries.insert(i, (key, value));
                None
            }
        }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.entries.len()
    }

    #[cfg(test)]
    fn iter(&self) -> impl Iterator<Item = (&K, &V)> {
        self.entries.iter().map(|(k, v)| (k, v))
    }

    pub(crate) fn iter_mut(&mut self) -> impl Iterator<Item = (&K, &mut V)> {
        self.entries.iter_mut().map(|(k, v)| (&*k, v))
    }

    pub(crate) fn keys(&self) -> impl Iterator<Item = &K> {
        self.entries.iter().map(|(k, _)| k)
    }

    pub(crate) fn values(&self) -> impl Iterator<Item = &V> {
        self.entries.iter().map(|(_, v)| v)
    }

    pub(crate) fn values_mut(&mut self) -> impl Iterator<Item = &mut V> {
        self.entries.iter_mut().map(|(_, v)| v)
    }
}

impl<'a, K: Ord, V> IntoIterator for &'a VecMap<K, V> {
    type Item = (&'a K, &'a V);
    type IntoIter = std::iter::Map<std::slice::Iter<'a, (K, V)>, fn(&'a (K, V)) -> (&'a K, &'a V)>;
    fn into_iter(self) -> Self::IntoIter {
        self.entries.iter().map(|(k, v)| (k, v))
    }
}

impl<K: Ord, V> FromIterator<(K, V)> for VecMap<K, V> {
    /// As `BTreeMap` collects: sorted by key, the last of equal keys kept.
    fn from_iter<I: IntoIterator<Item = (K, V)>>(iter: I) -> Self {
        let mut entries: Entries<K, V> = iter.into_iter().collect();
        // Stable: among equal keys the input order stays, so the last is the one kept below.
        entries.sort_by(|a, b| a.0.cmp(&b.0));
        // In place: a repeat's value moves into the entry kept before the repeat goes.
        entries.dedup_by(|later, kept| {
            let same = later.0 == kept.0;
            if same {
                std::mem::swap(later, kept);
            }
            same
        });
        VecMap { entries }
    }
}

#[cfg(test)]
mod tests {
    use super::VecMap;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    #[derive(Clone, Debug)]
    enum Op {
        Insert(u8, u16),
        Modify(u8),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (any::<u8>(), any::<u16>()).prop_map(|(k, v)| Op::Insert(k % 16, v)),
            any::<u8>().prop_map(|k| Op::Modify(k % 16)),
        ]
    }

    proptest! {
        /// Whatever is collected and inserted, the map answers and iterates as a `BTreeMap`.
        #[test]
        fn behaves_as_a_btreemap(
            init in proptest::collection::vec((0u8..16, any::<u16>()), 0..12),
            ops in proptest::collection::vec(op(), 0..40),
        ) {
            let mut v: VecMap<u8, u16> = init.iter().copied().collect();
            let mut b: BTreeMap<u8, u16> = init.iter().copied().collect();
            for o in ops {
                match o {
                    Op::Insert(k, x) => prop_assert_eq!(v.insert(k, x), b.insert(k, x)),
                    Op::Modify(k) => {
                        if let Some(x) = v.get_mut(&k) { *x = x.wrapping_add(1) }
                        if let Some(x) = b.get_mut(&k) { *x = x.wrapping_add(1) }
                    }
                }
                prop_assert_eq!(v.len(), b.len());
                prop_assert!(v.iter().eq(b.iter()));
            }
            for k in 0..16u8 {
                prop_assert_eq!(v.get(&k), b.get(&k));
                prop_assert_eq!(v.contains_key(&k), b.contains_key(&k));
            }
            prop_assert!(v.values().eq(b.values()));
        }
    }
}
