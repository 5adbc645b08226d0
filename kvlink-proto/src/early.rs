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
//!
//! The age is [`EARLY_KEEP`] (10 minutes), or the longest deadline of the requests this rank has
//! started (at least the endpoint's default) plus the agreement bound if that is longer. The
//! request's own deadline is unknown here (no vote or verdict carries it, and a receiving rank
//! never receives the `Advertise` that does), and even it would not do: another receiver that
//! cancelled may have ended long before this rank starts the request, and this rank must still
//! end as it did. The store's bounds are its counts ([`EARLY_CAP`], a share per rank, a cap per
//! request); the age only lets go of messages for requests that never start here, and a key is
//! a request's identity for at least that long (the engine refuses a replay of an ended key for
//! 10 minutes) within one process: what a process sent goes when another process takes its rank
//! ([`Early::forget_rank`]), since the new one's keys start again.
use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use smallvec::SmallVec;

use crate::error::Outcome;
use crate::id::{RankId, RequestKey};

/// How long early messages are kept at least, after the last one of their request came.
pub const EARLY_KEEP: Duration = Duration::from_secs(600);

/// The most requests whose early messages are kept; past it the request kept longest goes,
/// one that holds only `Completed` votes first (see [`Early::keep`]).
pub const EARLY_CAP: usize = 8192;
/// The most requests one rank's messages may be kept for (those it sent the first message of):
/// past it, that rank's own entry kept longest goes, one that holds only `Completed` votes
/// first. Half the store, so that one peer (a faulty one, or one that sends votes for requests
/// that never start here) cannot push out the entries of the others, while a coordinator may
/// still fall 4096 requests behind one other receiver (the common two-receiver layout) before
/// that receiver's votes go: they cost a resend then.
const PER_RANK: usize = EARLY_CAP / 2;
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
    /// The rank whose message made the entry: it counts in that rank's share.
    owner: RankId,
    msgs: SmallVec<[Msg; 2]>,
}

type Map<K, V> = HashMap<K, V, foldhash::fast::FixedState>;

/// Lines (since, key) of entries, oldest first.
#[derive(Debug, Default)]
struct Lines {
    /// In the order entries were made or took a new message; an entry taken or refreshed
    /// leaves its line behind, skipped when met and compacted when such lines pile up.
    order: VecDeque<(Instant, RequestKey)>,
    /// The same lines for the entries that hold only `Completed` votes (a line goes stale as
    /// `order`'s do, and when its entry takes a failure).
    settled: VecDeque<(Instant, RequestKey)>,
}

/// The entries one rank made, and their lines.
#[derive(Debug, Default)]
struct Share {
    held: usize,
    lines: Lines,
}

/// Whether the line (since, key) is that of `key`'s entry (made by `owner`, if given; holding
/// only `Completed` votes, if `settled`).
fn is_line(
    by_key: &Map<RequestKey, Entry>,
    (since, key): (Instant, RequestKey),
    owner: Option<RankId>,
    settled: bool,
) -> bool {
    by_key.get(&key).is_some_and(|e| {
        e.since == since
            && owner.is_none_or(|o| e.owner == o)
            && (!settled || e.msgs.iter().all(|m| m.2.is_completed()))
    })
}

/// The key of the entry (of `owner`'s, if given) kept longest, one that holds only `Completed`
/// votes first; its lines are popped, and the stale lines met.
fn pop_oldest(
    by_key: &Map<RequestKey, Entry>,
    lines: &mut Lines,
    owner: Option<RankId>,
) -> Option<RequestKey> {
    // (A vote of a rank lost since is a failure now, though its line stays.)
    while let Some(l) = lines.settled.pop_front() {
        if is_line(by_key, l, owner, true) {
            return Some(l.1);
        }
    }
    while let Some(l) = lines.order.pop_front() {
        if is_line(by_key, l, owner, false) {
            return Some(l.1);
        }
    }
    None
}

/// Drops `lines`' stale lines once they outnumber twice the `live` entries they may name
/// (amortized O(1) a line).
fn compact(by_key: &Map<RequestKey, Entry>, lines: &mut Lines, live: usize, owner: Option<RankId>) {
    if lines.order.len() > 2 * live + 16 {
        lines.order.retain(|&l| is_line(by_key, l, owner, false));
    }
    if lines.settled.len() > 2 * live + 16 {
        lines.settled.retain(|&l| is_line(by_key, l, owner, true));
    }
}

/// The early messages, by request, oldest first in `lines`, and each rank's share.
#[derive(Debug)]
pub(crate) struct Early {
    keep: Duration,
    by_key: Map<RequestKey, Entry>,
    /// Every entry's lines: `order` for the expiries, both for the cap.
    lines: Lines,
    /// By the rank that made them (a rank with none has no share).
    shares: Map<RankId, Share>,
}

impl Early {
    /// Keeps messages for `keep` after the last one of their request was kept.
    pub(crate) fn new(keep: Duration) -> Self {
        Early {
            keep,
            by_key: Map::default(),
            lines: Lines::default(),
            shares: Map::default(),
        }
    }

    /// Keeps messages at least `keep` from now on (never shorter than before). Every entry
    /// keeps the same time after its last message, so the entries stay in expiry order.
    pub(crate) fn keep_at_least(&mut self, keep: Duration) {
        self.keep = self.keep.max(keep);
    }

    /// Requests with messages kept.
    pub(crate) fn len(&self) -> usize {
        self.by_key.len()
    }

    /// Keeps `msg` for `key`. Returns what it did, and how many kept messages went to make room
    /// or because they were past their keep (they are lost: the caller counts them).
    pub(crate) fn keep(&mut self, now: Instant, key: RequestKey, msg: Msg) -> (Kept, usize) {
        let mut lost = self.expire(now);
        let (done, owner) = match self.by_key.get_mut(&key) {
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
                }
                (done, e.owner)
            }
            None => {
                // Full: a request that holds only `Completed` votes goes first. Their voters
                // send them again at every retransmit interval until the verdict, while a
                // failure may go once (a caller that gives up waits only the agreement bound):
                // pushed out by the votes of later requests, it was lost for good. A rank past
                // its share makes room among its own entries, so one that sends votes for
                // requests that never start here pushes out no other's.
                let owner = msg.0;
                let share = self.shares.entry(owner).or_default();
                if share.held >= PER_RANK {
                    if let Some(old) = pop_oldest(&self.by_key, &mut share.lines, Some(owner)) {
                        lost += self.remove(old).map_or(0, |e| e.msgs.len());
                    }
                }
                while self.by_key.len() >= EARLY_CAP {
                    let Some(old) = pop_oldest(&self.by_key, &mut self.lines, None) else {
                        break;
                    };
                    lost += self.remove(old).map_or(0, |e| e.msgs.len());
                }
                let mut msgs = SmallVec::new();
                msgs.push(msg);
                let entry = Entry {
                    since: now,
                    owner,
                    msgs,
                };
                self.by_key.insert(key, entry);
                self.shares.entry(owner).or_default().held += 1;
                (Kept::New, owner)
            }
        };
        if done == Kept::New {
            let line = (now, key);
            let settled = self.by_key[&key].msgs.iter().all(|m| m.2.is_completed());
            let share = self.shares.entry(owner).or_default();
            for lines in [&mut self.lines, &mut share.lines] {
                lines.order.push_back(line);
                if settled {
                    lines.settled.push_back(line);
                }
            }
            compact(&self.by_key, &mut self.lines, self.by_key.len(), None);
            compact(&self.by_key, &mut share.lines, share.held, Some(owner));
        }
        (done, lost)
    }

    /// Removes `key`'s entry (its lines go stale), and counts it out of its owner's share.
    fn remove(&mut self, key: RequestKey) -> Option<Entry> {
        let e = self.by_key.remove(&key)?;
        if let Some(share) = self.shares.get_mut(&e.owner) {
            share.held -= 1;
            if share.held == 0 {
                // Every line left in it is stale.
                self.shares.remove(&e.owner);
            }
        }
        Some(e)
    }

    /// Takes what was kept for `key`, in arrival order per rank, unless it is past its keep.
    /// Also returns how many messages went past their keep (for `key` or any other).
    pub(crate) fn take(&mut self, now: Instant, key: RequestKey) -> (SmallVec<[Msg; 2]>, usize) {
        let lost = self.expire(now);
        let msgs = self.remove(key).map(|e| e.msgs).unwrap_or_default();
        // The lines of entries gone from the front, so that `next_expiry` names a live one (a
        // stale line behind a live one wakes the driver once, for nothing).
        while let Some(&l) = self.lines.order.front() {
            if is_line(&self.by_key, l, None, false) {
                break;
            }
            self.lines.order.pop_front();
        }
        (msgs, lost)
    }

    /// When the entry kept longest goes past its keep, if any is kept: the endpoint's timers
    /// wake for it, so that an idle endpoint drops what no request took (O(1): the front line).
    pub(crate) fn next_expiry(&self) -> Option<Instant> {
        let &(since, _) = self.lines.order.front()?;
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

    /// Another process now holds `rank`: the messages the old one sent go (its requests are
    /// not the new one's, whose keys start again). Returns how many went. O(requests kept).
    pub(crate) fn forget_rank(&mut self, rank: RankId) -> usize {
        let mut gone = 0;
        let keys: SmallVec<[RequestKey; 8]> = self
            .by_key
            .iter()
            .filter(|(_, e)| e.msgs.iter().any(|m| m.0 == rank))
            .map(|(k, _)| *k)
            .collect();
        for key in keys {
            let Some(e) = self.by_key.get_mut(&key) else {
                continue;
            };
            let before = e.msgs.len();
            e.msgs.retain(|m| m.0 != rank);
            gone += before - e.msgs.len();
            if e.msgs.is_empty() {
                self.remove(key);
            }
        }
        gone
    }

    /// Drops the entries past their keep at `now`; returns how many messages they held.
    pub(crate) fn expire(&mut self, now: Instant) -> usize {
        let mut lost = 0;
        while let Some(&l) = self.lines.order.front() {
            if now.saturating_duration_since(l.0) < self.keep {
                break;
            }
            self.lines.order.pop_front();
            if is_line(&self.by_key, l, None, false) {
                lost += self.remove(l.1).map_or(0, |e| e.msgs.len());
            }
        }
        lost
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
        // first (its voter sends it again), the failures after them. (From eight ranks, each
        // within its share.)
        let rank = |i: u64| RankId(2 + (i % 8) as u32);
        let mut lost = 0;
        for i in 0..EARLY_CAP as u64 {
            let vote = (rank(i), Kind::Vote, Outcome::Completed);
            lost += e.keep(t + ms(1), RequestKey::new(100 + i, 0), vote).1;
        }
        assert_eq!((e.len(), lost), (EARLY_CAP, 1));
        assert!(e.take(t + ms(2), RequestKey::new(100, 0)).0.is_empty());
        let mut lost = 0;
        for i in 0..EARLY_CAP as u64 {
            let cancel = (rank(i), Kind::Vote, Outcome::Cancelled);
            lost += e.keep(t + ms(3), RequestKey::new(10_000 + i, 0), cancel).1;
        }
        // The 4095 `Completed` ones left, then the oldest failure: `key`'s.
        assert_eq!((e.len(), lost), (EARLY_CAP, EARLY_CAP - 1 + PER_REQUEST));
        assert!(
            e.take(t + ms(4), key).0.is_empty(),
            "the oldest failure stayed"
        );
        assert_eq!(e.take(t + ms(4), RequestKey::new(10_000, 0)).0.len(), 1);
        assert!(e.lines.order.len() <= 2 * e.len() + 16);
        assert!(e.lines.settled.len() <= 2 * e.len() + 16);
    }

    #[test]
    fn a_rank_past_its_share_makes_room_among_its_own_entries() {
        let t = Instant::now();
        let mut e = Early::new(ms(100));
        let cancel = |r| (RankId(r), Kind::Vote, Outcome::Cancelled);
        let (theirs, mine) = (RequestKey::new(1, 0), RequestKey::new(2, 0));
        assert_eq!(e.keep(t, theirs, cancel(3)), (Kept::New, 0));
        assert_eq!(e.keep(t, mine, cancel(2)), (Kept::New, 0));
        // Rank 2's `Completed` votes past its share: its own go, those first.
        let mut lost = 0;
        for i in 0..2 * PER_RANK as u64 {
            lost += e.keep(t, RequestKey::new(100 + i, 0), VOTE).1;
        }
        assert_eq!((e.len(), lost), (1 + PER_RANK, PER_RANK + 1));
        assert_eq!(e.shares[&RankId(2)].held, PER_RANK);
        // Its failures for twice the whole store: its own oldest go, never rank 3's.
        let mut lost = 0;
        for i in 0..2 * EARLY_CAP as u64 {
            lost += e.keep(t, RequestKey::new(10_000 + i, 0), cancel(2)).1;
        }
        assert_eq!((e.len(), lost), (1 + PER_RANK, 2 * EARLY_CAP));
        assert!(e.take(t, mine).0.is_empty(), "its oldest went");
        assert_eq!(e.take(t, theirs).0.as_slice(), &[cancel(3)]);
        for lines in [&e.lines, &e.shares[&RankId(2)].lines] {
            assert!(lines.order.len() <= 2 * e.len() + 16);
            assert!(lines.settled.len() <= 2 * e.len() + 16);
        }
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
        assert!(e.lines.order.len() <= 16, "{}", e.lines.order.len());
        assert!(e.shares.is_empty(), "a rank with no entry has no share");
    }
}
