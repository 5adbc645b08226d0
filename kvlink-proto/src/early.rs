//! Agreement messages that reach a rank for a request it has not started yet.
//!
//! The receiving ranks of one request start it apart (separate processes, each when its own
//! scheduler gets to it), so another receiver's vote can reach the coordinator, and the
//! coordinator's failure verdict another receiver, before the request exists there. Dropped as
//! unknown, a `Completed` vote cost the coordinator a retransmit interval once its own data had
//! landed, and a failure was lost for good once its sender stopped resending (a receiver that
//! gave up ends at its agreement bound): the late rank ran to its deadline and ended `TimedOut`
//! against the other's `Cancelled`. [`Early`] keeps them, bounded in number and age, for the
//! request's start, which applies those from the ranks that may send them.
use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use smallvec::SmallVec;

use crate::error::Outcome;
use crate::id::{RankId, RequestKey};

/// The most requests whose early messages are kept; past it the request kept longest goes,
/// one that holds only `Completed` votes first (see [`Early::keep`]).
pub const EARLY_CAP: usize = 4096;
/// The most messages kept for one request (one per rank and kind: a request has as many
/// receivers as its generation side has ranks, 16 at most in common tensor-parallel layouts).
const PER_REQUEST: usize = 64;

/// What kind of agreement message came early.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    /// Another receiver's vote, for the coordinator.
    Vote,
    /// The coordinator's failure verdict, for another receiver.
    Verdict,
}

/// One early message: who sent it, what kind, and its outcome.
pub(crate) type Msg = (RankId, Kind, Outcome);

/// What [`Early::keep`] did with a message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kept {
    /// Kept (or it replaced the same rank's message of the same kind).
    New,
    /// The same message again (a resend).
    Duplicate,
    /// Not kept: the request already holds [`PER_REQUEST`] messages (failures, or this one is
    /// a `Completed`).
    Full,
}

#[derive(Debug)]
struct Entry {
    /// When the last message kept for the request came: the entry goes `keep` after it.
    since: Instant,
    msgs: SmallVec<[Msg; 2]>,
}

/// The early messages, by request, oldest first in `order`.
#[derive(Debug)]
pub(crate) struct Early {
    keep: Duration,
    by_key: HashMap<RequestKey, Entry, foldhash::fast::FixedState>,
    /// (since, key) in the order entries were made; an entry taken or replaced leaves its line
    /// behind, skipped when met and compacted when such lines pile up.
    order: VecDeque<(Instant, RequestKey)>,
    /// The same lines for the entries that hold only `Completed` votes (a line goes stale as
    /// `order`'s do, and when its entry takes a failure).
    settled: VecDeque<(Instant, RequestKey)>,
}

impl Early {
    /// Keeps messages for `keep` after the last one of their request was kept.
    pub(crate) fn new(keep: Duration) -> Self {
        Early {
            keep,
            by_key: HashMap::default(),
            order: VecDeque::new(),
            settled: VecDeque::new(),
        }
    }

    /// Requests with messages kept.
    pub(crate) fn len(&self) -> usize {
        self.by_key.len()
    }

    /// Keeps `msg` for `key`. Returns what it did, and how many kept messages went to make room
    /// or because they were past their keep (they are lost: the caller counts them).
    pub(crate) fn keep(&mut self, now: Instant, key: RequestKey, msg: Msg) -> (Kept, usize) {
        let mut lost = self.expire(now);
        let done = match self.by_key.get_mut(&key) {
            Some(e) => {
                let full = e.msgs.len() >= PER_REQUEST;
                let done = match e.msgs.iter_mut().find(|m| (m.0, m.1) == (msg.0, msg.1)) {
                    // The same again, or a `Completed` after the rank's failure (a resend of an
                    // earlier vote overtaken): the failure stands, as a rank never takes a
                    // failure back.
                    Some(m) if *m == msg || (msg.2.is_completed() && !m.2.is_completed()) => {
                        Kept::Duplicate
                    }
                    Some(m) => {
                        // A failure after the rank's `Completed` vote replaces it.
                        *m = msg;
                        Kept::New
                    }
                    // Full: a failure takes the place of a kept `Completed` vote, which it
                    // makes moot (the coordinator decides at the first failure). Dropped, it
                    // was lost for good with more receivers than the cap: the one message that
                    // decides the request, kept out by the votes that do not.
                    None if full => match e.msgs.iter_mut().find(|m| m.2.is_completed()) {
                        Some(m) if !msg.2.is_completed() => {
                            *m = msg;
                            lost += 1;
                            Kept::New
                        }
                        _ => Kept::Full,
                    },
                    None => {
                        e.msgs.push(msg);
                        Kept::New
                    }
                };
                if done == Kept::New {
                    // Kept for `keep` from now, as it would be alone: a failure that replaced a
                    // `Completed` vote went with that vote's keep, up to a deadline sooner.
                    e.since = now;
                    self.order.push_back((now, key));
                }
                done
            }
            None => {
                // Full: a request that holds only `Completed` votes goes first. Their voters
                // send them again at every retransmit interval until the verdict, while a
                // failure may go once (a caller that gives up waits only the agreement bound):
                // pushed out by the votes of later requests, it was lost for good.
                while self.by_key.len() >= EARLY_CAP {
                    let Some((since, old)) = self.pop_settled().or_else(|| self.order.pop_front())
                    else {
                        break;
                    };
                    lost += self.remove_if(old, since);
                }
                let mut msgs = SmallVec::new();
                msgs.push(msg);
                self.by_key.insert(key, Entry { since: now, msgs });
                self.order.push_back((now, key));
                Kept::New
            }
        };
        if done == Kept::New && self.by_key[&key].msgs.iter().all(|m| m.2.is_completed()) {
            self.settled.push_back((now, key));
        }
        let live = |by_key: &HashMap<RequestKey, Entry, _>,
                    (since, key): &(Instant, RequestKey)| {
            by_key.get(key).is_some_and(|e| e.since == *since)
        };
        if self.order.len() > 2 * self.by_key.len() + 16 {
            let by_key = &self.by_key;
            self.order.retain(|l| live(by_key, l));
        }
        if self.settled.len() > 2 * self.by_key.len() + 16 {
            let by_key = &self.by_key;
            self.settled.retain(|l| live(by_key, l));
        }
        (done, lost)
    }

    /// The line of the entry kept longest that holds only `Completed` votes, if any.
    fn pop_settled(&mut self) -> Option<(Instant, RequestKey)> {
        while let Some((since, key)) = self.settled.pop_front() {
            // (A vote of a rank lost since is a failure now, though its line stays live.)
            let settled = |e: &Entry| e.since == since && e.msgs.iter().all(|m| m.2.is_completed());
            if self.by_key.get(&key).is_some_and(settled) {
                return Some((since, key));
            }
        }
        None
    }

    /// Takes what was kept for `key`, in arrival order per rank, unless it is past its keep.
    /// Also returns how many messages went past their keep (for `key` or any other).
    pub(crate) fn take(&mut self, now: Instant, key: RequestKey) -> (SmallVec<[Msg; 2]>, usize) {
        let lost = self.expire(now);
        let msgs = self.by_key.remove(&key).map(|e| e.msgs).unwrap_or_default();
        // The lines of entries gone from the front, so that `next_expiry` names a live one (a
        // stale line behind a live one wakes the driver once, for nothing).
        while let Some(&(since, key)) = self.order.front() {
            if self.by_key.get(&key).is_some_and(|e| e.since == since) {
                break;
            }
            self.order.pop_front();
        }
        (msgs, lost)
    }

    /// When the entry kept longest goes past its keep, if any is kept: the endpoint's timers
    /// wake for it, so that an idle endpoint drops what no request took (O(1): the front line).
    pub(crate) fn next_expiry(&self) -> Option<Instant> {
        let &(since, _) = self.order.front()?;
        since.checked_add(self.keep)
    }

    /// `rank` was reported lost: each vote kept from it becomes `PeerLost`, whatever it said,
    /// as a running coordinator counts a receiver lost before the verdict (it cannot learn the
    /// verdict: alive, it has lost this rank too and ended `PeerLost`). Its keep is unchanged.
    pub(crate) fn peer_lost(&mut self, rank: RankId) {
        for e in self.by_key.values_mut() {
            for m in e.msgs.iter_mut() {
                if (m.0, m.1) == (rank, Kind::Vote) {
                    m.2 = Outcome::PeerLost;
                }
            }
        }
    }

    /// Drops the entries past their keep at `now`; returns how many messages they held.
    pub(crate) fn expire(&mut self, now: Instant) -> usize {
        let mut lost = 0;
        while let Some(&(since, key)) = self.order.front() {
            if now.saturating_duration_since(since) < self.keep {
                break;
            }
            self.order.pop_front();
            lost += self.remove_if(key, since);
        }
        lost
    }

    /// Removes `key`'s entry if it is the one made at `since`; returns its message count.
    fn remove_if(&mut self, key: RequestKey, since: Instant) -> usize {
        match self.by_key.get(&key) {
            Some(e) if e.since == since => self.by_key.remove(&key).map_or(0, |e| e.msgs.len()),
            _ => 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    const VOTE: Msg = (RankId(2), Kind::Vote, Outcome::Completed);

    #[test]
    fn a_message_is_kept_once_replaced_by_a_later_one_and_taken_once() {
        let t = Instant::now();
        let key = RequestKey::new(1, 0);
        let mut e = Early::new(ms(100));
        assert_eq!(e.keep(t, key, VOTE), (Kept::New, 0));
        assert_eq!(e.keep(t + ms(1), key, VOTE), (Kept::Duplicate, 0));
        let cancel = (RankId(2), Kind::Vote, Outcome::Cancelled);
        assert_eq!(e.keep(t + ms(2), key, cancel), (Kept::New, 0));
        // The earlier `Completed`, overtaken, does not take the failure back.
        assert_eq!(e.keep(t + ms(3), key, VOTE), (Kept::Duplicate, 0));
        let (msgs, lost) = e.take(t + ms(3), key);
        assert_eq!((msgs.as_slice(), lost), (&[cancel][..], 0));
        assert!(e.take(t + ms(4), key).0.is_empty());
        assert_eq!(e.len(), 0);
    }

    #[test]
    fn messages_go_at_their_keep_and_past_the_caps() {
        let t = Instant::now();
        let mut e = Early::new(ms(100));
        e.keep(t, RequestKey::new(1, 0), VOTE);
        // Past the keep: gone, and counted, when anything next happens.
        let (msgs, lost) = e.take(t + ms(100), RequestKey::new(1, 0));
        assert_eq!((msgs.len(), lost), (0, 1));
        // Per request: PER_REQUEST ranks, then full.
        let key = RequestKey::new(2, 0);
        for r in 0..PER_REQUEST as u32 {
            assert_eq!(
                e.keep(t, key, (RankId(r), Kind::Vote, Outcome::Cancelled))
                    .0,
                Kept::New
            );
        }
        assert_eq!(
            e.keep(t, key, (RankId(99), Kind::Vote, Outcome::Cancelled))
                .0,
            Kept::Full
        );
        // Over all requests: EARLY_CAP, the oldest that holds only `Completed` votes going
        // first (its voter sends it again), the failures after them.
        let mut lost = 0;
        for i in 0..EARLY_CAP as u64 {
            lost += e.keep(t + ms(1), RequestKey::new(100 + i, 0), VOTE).1;
        }
        assert_eq!((e.len(), lost), (EARLY_CAP, 1));
        assert!(e.take(t + ms(2), RequestKey::new(100, 0)).0.is_empty());
        let cancel = (RankId(2), Kind::Vote, Outcome::Cancelled);
        let mut lost = 0;
        for i in 0..EARLY_CAP as u64 {
            lost += e.keep(t + ms(3), RequestKey::new(10_000 + i, 0), cancel).1;
        }
        // The 4095 `Completed` ones left, then the oldest failure: `key`'s.
        assert_eq!((e.len(), lost), (EARLY_CAP, EARLY_CAP - 1 + PER_REQUEST));
        assert!(
            e.take(t + ms(4), key).0.is_empty(),
            "the oldest failure stayed"
        );
        assert_eq!(e.take(t + ms(4), RequestKey::new(10_000, 0)).0.len(), 1);
        assert!(e.order.len() <= 2 * e.len() + 16);
        assert!(e.settled.len() <= 2 * e.len() + 16);
    }

    #[test]
    fn the_order_stays_within_twice_the_entries_when_entries_are_taken() {
        let t = Instant::now();
        let mut e = Early::new(ms(100));
        for i in 0..10_000 {
            let key = RequestKey::new(i, 0);
            e.keep(t, key, VOTE);
            assert_eq!(e.take(t, key).0.len(), 1);
        }
        assert!(e.order.len() <= 16, "{}", e.order.len());
    }
}
