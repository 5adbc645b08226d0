//! Identity: who a message, a transfer or a buffer belongs to.
//!
//! A request is named by a full 64-bit [`RequestId`] plus a [`Generation`] (the attempt number).
//! Together they form a [`RequestKey`], which every control message and every landed transfer
//! carries. Nothing in kvlink truncates a request id: TensorRT-LLM's data tag keeps only 12 bits
//! (`(id & 0xFFF) << 8 | 43`), so two requests 4096 ids apart collide; kvlink does not build tags
//! from ids at all.
//!
//! # Tag layout
//! A tag-matched data transfer carries a [`Token`] as its whole 64-bit UCX tag. The receiver
//! allocates tokens from a [`TokenAllocator`] (one per receiver lifetime, strictly increasing,
//! never reused) and keeps the map `token -> (RequestKey, segment)` next to the posted receive.
//! Request id, generation, peer and segment therefore live in that table, untruncated, and a
//! late transfer of an old attempt can only match the old attempt's receive (or none, once it has
//! been reaped), never the retry's.
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

/// A receiver-assigned 64-bit UCX tag for one posted receive; unique per receiver lifetime.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Token(pub u64);

/// Hands out [`Token`]s for one receiver: strictly increasing, never reused, never zero.
#[derive(Debug, Default)]
pub struct TokenAllocator {
    last: u64,
}

impl TokenAllocator {
    pub fn new() -> Self {
        Self::default()
    }

    /// The next token, or `None` after 2^64 - 1 tokens (the receiver must then be recreated).
    pub fn allocate(&mut self) -> Option<Token> {
        self.last = self.last.checked_add(1)?;
        Some(Token(self.last))
    }
}
