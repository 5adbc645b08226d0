//! The peer table: which transport endpoint serves which rank, its state, and the reconnect
//! policy that heals a pair after a fault.
//!
//! A rank is bound to an endpoint by its `Hello`. When the transport reports the endpoint
//! failed, the rank becomes `Failed`; if this side dialled it (`connect`), it becomes
//! `Reconnecting` and the engine dials the same address again in the background, up to
//! [`MAX_TRIES`] times with a doubling back-off. The side that was dialled waits for the peer's
//! new `Hello`. A later use of a rank that gave up (`advertise`) starts a fresh round. Only the
//! requests that were on the failed endpoint are lost, never the pair.
use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use crate::proto::RankId;
use crate::transport::PeerId;

/// Dial attempts per round before a rank is left `Failed` (until its next use).
pub const MAX_TRIES: u32 = 6;
/// The first back-off between attempts; it doubles after each.
const FIRST_BACKOFF: Duration = Duration::from_millis(50);

/// A rank's connection, as [`crate::engine::Engine::peer_state`] reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum PeerState {
    /// Never heard of.
    Unknown = 0,
    /// Bound by its `Hello`; requests can use it.
    Connected = 1,
    /// Its endpoint failed and the engine is dialling it again.
    Reconnecting = 2,
    /// Its endpoint failed and nobody is dialling (this side was dialled, or the tries ran out).
    Failed = 3,
}

pub(crate) struct Rank {
    pub peer: Option<PeerId>,
    pub name: String,
    pub state: PeerState,
    /// The address this side dialled it at, if it did.
    pub dial: Option<String>,
    tries: u32,
    next_try: Option<Instant>,
}

#[derive(Default)]
pub(crate) struct Peers {
    ranks: HashMap<RankId, Rank>,
    rank_of: HashMap<PeerId, RankId>,
    /// Endpoints dialled for a rank, waiting for its `Hello`.
    dialling: HashMap<PeerId, RankId>,
    hello_sent: HashSet<PeerId>,
    pub reconnects: u64,
    pub failures: u64,
}

impl Peers {
    pub fn state(&self, rank: RankId) -> PeerState {
        self.ranks
            .get(&rank)
            .map_or(PeerState::Unknown, |r| r.state)
    }

    /// The live endpoint of `rank`, if it is connected.
    pub fn endpoint(&self, rank: RankId) -> Option<PeerId> {
        self.ranks
            .get(&rank)
            .filter(|r| r.state == PeerState::Connected)
            .and_then(|r| r.peer)
    }

    pub fn rank_of(&self, peer: PeerId) -> Option<RankId> {
        self.rank_of.get(&peer).copied()
    }

    pub fn name(&self, rank: RankId) -> Option<String> {
        self.ranks.get(&rank).map(|r| r.name.clone())
    }

    pub fn connected(&self) -> usize {
        self.ranks
            .values()
            .filter(|r| r.state == PeerState::Connected)
            .count()
    }

    pub fn count(&self, state: PeerState) -> usize {
        self.ranks.values().filter(|r| r.state == state).count()
    }

    /// True the first time for `peer`: say `Hello` on it.
    pub fn first_hello(&mut self, peer: PeerId) -> bool {
        self.hello_sent.insert(peer)
    }

    /// A `Hello` from `peer` for `rank`: bind them (replacing an older endpoint). Returns the
    /// endpoint it replaced, if any, and whether `peer` was dialled here.
    pub fn bind(&mut self, rank: RankId, peer: PeerId, name: String) -> Option<PeerId> {
        self.dialling.remove(&peer);
        let r = self.ranks.entry(rank).or_insert(Rank {
            peer: None,
            name: String::new(),
            state: PeerState::Unknown,
            dial: None,
            tries: 0,
            next_try: None,
        });
        let old = r.peer.filter(|p| *p != peer);
        r.peer = Some(peer);
        r.name = name;
        r.state = PeerState::Connected;
        r.tries = 0;
        r.next_try = None;
        if let Some(old) = old {
            self.rank_of.remove(&old);
            self.hello_sent.remove(&old);
        }
        self.rank_of.insert(peer, rank);
        old
    }

    /// Remembers that this side dialled `rank` at `address` through `peer`.
    pub fn dialled(&mut self, rank: Option<RankId>, peer: PeerId, address: &str) {
        if let Some(rank) = rank {
            self.dialling.insert(peer, rank);
            if let Some(r) = self.ranks.get_mut(&rank) {
                r.dial = Some(address.to_string());
            }
        }
    }

    /// After `connect` learned the rank behind an address.
    pub fn set_dial(&mut self, rank: RankId, address: &str) {
        if let Some(r) = self.ranks.get_mut(&rank) {
            r.dial = Some(address.to_string());
        }
    }

    /// The transport reported `peer` failed. Returns the rank that lost its live endpoint.
    pub fn on_failed(&mut self, peer: PeerId, now: Instant) -> Option<RankId> {
        self.hello_sent.remove(&peer);
        if self.dialling.remove(&peer).is_some() {
            // A reconnect attempt failed; the next try is already scheduled.
            return None;
        }
        let rank = self.rank_of.remove(&peer)?;
        let r = self.ranks.get_mut(&rank)?;
        if r.peer != Some(peer) {
            return None;
        }
        r.peer = None;
        self.failures += 1;
        if r.dial.is_some() {
            // Not at once: a peer that is shutting down (the common case of a failure seen on
            // a healthy machine) has a moment to close its listener first.
            r.state = PeerState::Reconnecting;
            r.tries = 0;
            r.next_try = Some(now + FIRST_BACKOFF);
        } else {
            r.state = PeerState::Failed;
        }
        Some(rank)
    }

    /// Starts a fresh reconnect round for a `Failed` rank this side can dial. True if it did.
    pub fn revive(&mut self, rank: RankId, now: Instant) -> bool {
        match self.ranks.get_mut(&rank) {
            Some(r) if r.state == PeerState::Failed && r.dial.is_some() => {
                r.state = PeerState::Reconnecting;
                r.tries = 0;
                r.next_try = Some(now);
                true
            }
            _ => false,
        }
    }

    /// The ranks due for a dial attempt at `now`, with their addresses; each attempt is counted
    /// and the next one scheduled (or the rank given up as `Failed`).
    pub fn due(&mut self, now: Instant) -> Vec<(RankId, String)> {
        let mut out = Vec::new();
        for (rank, r) in self.ranks.iter_mut() {
            if r.state != PeerState::Reconnecting || r.next_try.is_none_or(|t| t > now) {
                continue;
            }
            if r.tries >= MAX_TRIES {
                r.state = PeerState::Failed;
                r.next_try = None;
                continue;
            }
            r.tries += 1;
            r.next_try = Some(now + FIRST_BACKOFF * (1 << (r.tries - 1).min(8)));
            if let Some(a) = &r.dial {
                out.push((*rank, a.clone()));
            }
        }
        self.reconnects += out.len() as u64;
        out
    }

    /// When the next dial attempt is due, if any.
    pub fn next_due(&self) -> Option<Instant> {
        self.ranks
            .values()
            .filter(|r| r.state == PeerState::Reconnecting)
            .filter_map(|r| r.next_try)
            .min()
    }
}
