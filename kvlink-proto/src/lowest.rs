//! `LowestFree`: a set of slot indices that hands out the lowest one first, as a bitmap with a
//! summary level above it per 64 words. Taking the lowest and putting one back each touch one
//! word per level: three at 65536 slots (8 KiB of leaf words, 16 summary words, one top word),
//! where a binary heap of the same slots walks 16 levels of a 256 KiB array on every take.

/// The free slots of a pool, lowest first. See the module docs.
#[derive(Clone, Debug)]
pub(crate) struct LowestFree {
    /// `levels[0]` has a bit per slot (set: free); `levels[i + 1]` a bit per word of
    /// `levels[i]` (set: that word has a free slot). The last level is one word.
    levels: Vec<Vec<u64>>,
}

impl LowestFree {
    /// Every slot in `0..capacity` free.
    pub(crate) fn full(capacity: u32) -> Self {
        let mut levels = Vec::new();
        let mut bits = capacity as usize;
        loop {
            let words = bits.div_ceil(64).max(1);
            let mut level = vec![u64::MAX; words];
            if bits % 64 != 0 {
                level[words - 1] = (1u64 << (bits % 64)) - 1;
            }
            if bits == 0 {
                level[0] = 0;
            }
            levels.push(level);
            if words == 1 {
                break;
            }
            bits = words;
        }
        LowestFree { levels }
    }

    /// Takes the lowest free slot out of the set.
    pub(crate) fn take_lowest(&mut self) -> Option<u32> {
        // Down from the top: each level's lowest set bit names the word to look at below.
        let mut word = 0usize;
        for level in self.levels.iter().rev() {
            let w = level[word];
            if w == 0 {
                return None; // only the top word can be empty: a set bit above means a free slot
            }
            word = word * 64 + w.trailing_zeros() as usize;
        }
        let slot = word;
        // Up from the leaves: clear the bit, and a word's summary bit once the word is empty.
        let mut i = slot;
        for level in self.levels.iter_mut() {
            let w = &mut level[i / 64];
            *w &= !(1u64 << (i % 64));
            if *w != 0 {
                break;
            }
            i /= 64;
        }
        Some(slot as u32)
    }

    /// Puts `slot` back (it must be one of `0..capacity`, and not in the set).
    pub(crate) fn put(&mut self, slot: u32) {
        let mut i = slot as usize;
        for level in self.levels.iter_mut() {
            let w = &mut level[i / 64];
            let was_empty = *w == 0;
            *w |= 1u64 << (i % 64);
            if !was_empty {
                break; // the levels above already say this word has a free slot
            }
            i /= 64;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    /// Against a plain ordered set: random takes and puts at capacities around the word and
    /// level edges, the lowest always first, `None` exactly when nothing is free.
    #[test]
    fn hands_out_the_lowest_free_slot_as_an_ordered_set_would() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for cap in [0u32, 1, 2, 63, 64, 65, 127, 4096, 4097, 64 * 64 + 1, 70_000] {
            let mut set = LowestFree::full(cap);
            let mut model: BTreeSet<u32> = (0..cap).collect();
            let mut out: Vec<u32> = Vec::new();
            for _ in 0..20_000 {
                if next() % 5 < 3 || out.is_empty() {
                    let got = set.take_lowest();
                    assert_eq!(got, model.pop_first(), "capacity {cap}");
                    out.extend(got);
                } else {
                    let i = (next() % out.len() as u64) as usize;
                    let slot = out.swap_remove(i);
                    set.put(slot);
                    model.insert(slot);
                }
            }
            // Everything back, then all of it out again in order.
            for slot in out.drain(..) {
                set.put(slot);
                model.insert(slot);
            }
            let all: Vec<u32> = std::iter::from_fn(|| set.take_lowest()).collect();
            assert_eq!(all, model.into_iter().collect::<Vec<_>>(), "capacity {cap}");
        }
    }
}
