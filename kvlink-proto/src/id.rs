//! Identity: who a message, a transfer or a buffer belongs to.
//!
//! A request is named by a full 64-bit [`RequestId`] plus a [`Generation`] (the attempt number).
//! Together they form a [`RequestKey`], which every control message and every landed transfer
//! carries. Nothing in kvlink truncates a request id: TensorRT-LLM's data tag keeps only 12 bits
//! (`(id & 0xFFF) << 8 | 43`), so two requests 4096 ids apart collide; kvlink does not build tags
//! from ids at all.
//!
//! # Tokens and tags
//! A tag-matched data transfer is named by a [`Token`]: 64 bits the receiver draws from a
//! [`TokenAllocator`] (a keyed pseudo-random permutation of a counter: unpredictable without the
//! receiver's key, and never repeated within one allocator). The receiver keeps the map
//! `token -> (RequestKey, segment)` next to the posted receive, so request id, generation, peer
//! and segment live in that table, untruncated, and a late transfer of an old attempt can only
//! match the old attempt's receive (or none, once it has been reaped), never the retry's. The
//! receive's UCX tag is not the token itself but the token keyed for the one sender the buffer
//! was offered to ([`super::auth::TagKey`]): nobody else can name it.
use std::fmt;

/// A request id as TensorRT-LLM assigns it: all 64 bits are significant.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RequestId(pub u64);

/// The attempt number of a request. A retry of the same [`RequestId`] uses the next generation;
/// anything carrying an older generation is stale.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Generation(pub u32);

impl Generation {
    /// The generation of the next attempt, or `None` when the counter is exhausted.
    pub fn next(self) -> Option<Generation> {
        self.0.checked_add(1).map(Generation)
    }
}

/// One attempt of one request: the unit every state machine, message and landed transfer names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RequestKey {
    pub request: RequestId,
    pub generation: Generation,
}

impl RequestKey {
    pub fn new(request: u64, generation: u32) -> Self {
        RequestKey {
            request: RequestId(request),
            generation: Generation(generation),
        }
    }

    /// True when `self` and `other` are attempts of the same request and `self` is the older.
    pub fn is_older_attempt_of(&self, other: &RequestKey) -> bool {
        self.request == other.request && self.generation < other.generation
    }
}

impl fmt::Display for RequestKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "req {}#{}", self.request.0, self.generation.0)
    }
}

/// A peer agent (one rank of one engine) as the transport knows it. Rank ids are unique across
/// both engines of a deployment: a context rank and a generation rank never share an id.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RankId(pub u32);

impl fmt::Display for RankId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rank {}", self.0)
    }
}

/// A receiver-assigned 64-bit name for one posted receive; unique per receiver lifetime.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Token(pub u64);

/// Hands out [`Token`]s for one receiver: unpredictable without the key, never zero, never
/// repeated. Token `n` is a 4-round Feistel permutation of the counter `n`, keyed by SipHash
/// with the allocator's 128-bit key: a bijection, so distinct counters give distinct tokens.
#[derive(Debug)]
pub struct TokenAllocator {
    key: [u8; 16],
    next: u64,
}

impl Default for TokenAllocator {
    /// A fixed, public key: for deterministic tests only. An engine seeds its own.
    fn default() -> Self {
        TokenAllocator::new([0; 16])
    }
}

impl TokenAllocator {
    /// An allocator keyed by `key` (draw it from the operating system's random source).
    pub fn new(key: [u8; 16]) -> Self {
        TokenAllocator { key, next: 0 }
    }

    fn round(&self, i: u8, half: u32) -> u32 {
        use std::hash::Hasher;
        let mut h = siphasher::sip::SipHasher13::new_with_key(&self.key);
        h.write_u8(i);
        h.write_u32(half);
        h.finish() as u32
    }

    fn permute(&self, n: u64) -> u64 {
        let (mut l, mut r) = ((n >> 32) as u32, n as u32);
        for i in 0..4 {
            let f = self.round(i, r);
            (l, r) = (r, l ^ f);
        }
        ((l as u64) << 32) | r as u64
    }

    /// The next token, or `None` after 2^64 tokens (the receiver must then be recreated).
    pub fn allocate(&mut self) -> Option<Token> {
        loop {
            let n = self.next;
            self.next = n.checked_add(1)?;
            let t = self.permute(n);
            if t != 0 {
                return Some(Token(t));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn tokens_are_distinct_nonzero_and_depend_on_the_key() {
        let mut a = TokenAllocator::new([7; 16]);
        let mut b = TokenAllocator::new([8; 16]);
        let mut seen = HashSet::new();
        let mut sequential = 0;
        let mut prev = 0u64;
        for _ in 0..100_000 {
            let t = a.allocate().unwrap();
            assert_ne!(t.0, 0);
            assert!(seen.insert(t.0), "token {t:?} repeated");
            if t.0 == prev.wrapping_add(1) {
                sequential += 1;
            }
            prev = t.0;
        }
        assert!(sequential < 3, "{sequential} sequential tokens: guessable");
        let first_b: Vec<u64> = (0..16).map(|_| b.allocate().unwrap().0).collect();
        let mut a2 = TokenAllocator::new([7; 16]);
        let first_a: Vec<u64> = (0..16).map(|_| a2.allocate().unwrap().0).collect();
        assert_ne!(first_a, first_b, "another key, another sequence");
    }
}
