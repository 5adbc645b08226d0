//! The timer table of the protocol core: every request's next deadline, each entry checked
//! against the instant its state machine holds, so that an input costs O(log n) at worst and no
//! call scans every request (quinn-proto's timer table). [`Endpoint`] arms a machine after every
//! input that touched it and fires what is due in `handle_timeout`.
//!
//! Most instants are armed in the order they fall due: a request's deadline is its start plus
//! the engine's timeout, a finished request's forget is its end plus the linger. Such an entry
//! goes to the back of a sorted queue, O(1), and only one that falls due before the queue's back
//! goes to a heap ([`DueQueue`]). Machines still running and finished ones (lingering) keep
//! separate queues, so that a deadline a minute away at the back does not send every forget
//! five seconds away to the heap. At thousands of requests a second the lingering ones number
//! tens of thousands: in one heap every input paid for their depth in cache misses.
//!
//! [`Endpoint`]: super::endpoint::Endpoint
use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::time::Instant;

use super::id::{RankId, RequestKey};

/// Which state machine a timer belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) enum TimerId {
    Recv(RequestKey),
    Send(RequestKey, RankId),
}

/// Superseded timer entries tolerated in a lane beyond its live ones before it is compacted.
const COMPACT_SLACK: usize = 64;

/// Instants in due order: a sorted queue for those armed in order (O(1)), a heap for the rest.
#[derive(Debug)]
pub(crate) struct DueQueue<T> {
    sorted: VecDeque<(Instant, T)>,
    heap: BinaryHeap<Reverse<(Instant, T)>>,
}

impl<T> Default for DueQueue<T> {
    fn default() -> Self {
        DueQueue {
            sorted: VecDeque::new(),
            heap: BinaryHeap::new(),
        }
    }
}

impl<T: Ord + Copy> DueQueue<T> {
    pub(crate) fn push(&mut self, at: Instant, item: T) {
        match self.sorted.back() {
            Some(&(last, _)) if at < last => self.heap.push(Reverse((at, item))),
            _ => self.sorted.push_back((at, item)),
        }
    }

    /// The earliest entry (the queue's front or the heap's top).
    pub(crate) fn peek(&self) -> Option<(Instant, T)> {
        let front = self.sorted.front().copied();
        let top = self.heap.peek().map(|Reverse(e)| *e);
        match (front, top) {
            (Some(f), Some(t)) => Some(f.min(t)),
            (f, t) => f.or(t),
        }
    }

    /// Takes the earliest entry if it is due at `now`.
    pub(crate) fn pop_due(&mut self, now: Instant) -> Option<(Instant, T)> {
        let e = self.peek()?;
        if e.0 > now {
            return None;
        }
        if self.sorted.front() == Some(&e) {
            self.sorted.pop_front();
        } else {
            self.heap.pop();
        }
        Some(e)
    }

    pub(crate) fn len(&self) -> usize {
        self.sorted.len() + self.heap.len()
    }

    /// Keeps the entries `keep` says yes to (the queue stays sorted).
    pub(crate) fn retain(&mut self, mut keep: impl FnMut(Instant, T) -> bool) {
        self.sorted.retain(|&(at, t)| keep(at, t));
        self.heap.retain(|&Reverse((at, t))| keep(at, t));
    }
}

/// The lane of a machine's live entry: still running, or finished and lingering.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Lane {
    Running = 0,
    Lingering = 1,
}

/// A state machine with the instant of its live entry in the timer table (the one entry not
/// superseded) and the lane it is in, kept beside it so that scheduling looks the machine up
/// once. Boxed in the maps: a machine is a few hundred bytes, and a map's growth then moves
/// pointers, not machines.
#[derive(Debug)]
pub(crate) struct Timed<T> {
    pub(crate) at: Option<Instant>,
    lane: Lane,
    machine: T,
}

impl<T> Timed<T> {
    pub(crate) fn boxed(machine: T) -> Box<Self> {
        Box::new(Timed {
            at: None,
            lane: Lane::Running,
            machine,
        })
    }

    /// Whether `(at, lane)` is this machine's live entry.
    pub(crate) fn is_live(&self, at: Instant, lane: Lane) -> bool {
        self.at == Some(at) && self.lane == lane
    }
}

impl<T> std::ops::Deref for Timed<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.machine
    }
}

impl<T> std::ops::DerefMut for Timed<T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.machine
    }
}

/// What the timer table needs of a state machine (implemented beside each machine:
/// `RecvRequest`, `SendFlow`).
pub(crate) trait Machine {
    /// Once terminal, the machine is remembered for its linger more (to answer late duplicates
    /// and recognise stale messages), counted from the terminal state, not from its start.
    fn settle(&mut self, now: Instant);
    /// When the machine next needs `on_timeout`: a deadline, a bound, a resend, or its forget.
    fn next_timeout(&self) -> Instant;
    /// Whether it has ended and only lingers (its timers are its forget and maybe a resend).
    fn lingers(&self) -> bool;
}

/// Every state machine's next deadline, earliest first, in two lanes (running and lingering
/// machines). An entry is live only while it equals its machine's `Timed::at` and lane; others
/// are skipped when popped, and compacted away once they outnumber the live ones.
#[derive(Debug, Default)]
pub(crate) struct TimerTable {
    lanes: [DueQueue<TimerId>; 2],
    /// Machines with a live entry in each lane.
    live: [usize; 2],
}

impl TimerTable {
    /// Called with the machine in hand after every input that touched it: puts its next
    /// deadline in its lane, unless its live entry already says so.
    pub(crate) fn arm<M: Machine>(&mut self, id: TimerId, m: &mut Timed<M>, now: Instant) {
        m.machine.settle(now);
        let at = m.machine.next_timeout();
        let lane = if m.machine.lingers() {
            Lane::Lingering
        } else {
            Lane::Running
        };
        if m.is_live(at, lane) {
            return;
        }
        if m.at.is_some() {
            self.live[m.lane as usize] -= 1;
        }
        m.at = Some(at);
        m.lane = lane;
        self.live[lane as usize] += 1;
        self.lanes[lane as usize].push(at, id);
    }

    /// The lane whose front is the earliest, and that front's instant.
    fn earliest(&self) -> Option<(Instant, Lane)> {
        let running = self.lanes[Lane::Running as usize].peek();
        let lingering = self.lanes[Lane::Lingering as usize].peek();
        match (running, lingering) {
            (Some(r), Some(l)) if l.0 < r.0 => Some((l.0, Lane::Lingering)),
            (Some(r), _) => Some((r.0, Lane::Running)),
            (None, l) => l.map(|l| (l.0, Lane::Lingering)),
        }
    }

    /// The earliest entry's instant (it may be a superseded one: then whoever waits for it
    /// wakes early, once, for nothing).
    pub(crate) fn next_due(&self) -> Option<Instant> {
        self.earliest().map(|(at, _)| at)
    }

    /// Takes the earliest entry if it is due at `now`; check it with [`TimerTable::fired`].
    pub(crate) fn pop_due(&mut self, now: Instant) -> Option<(Instant, Lane, TimerId)> {
        let (_, lane) = self.earliest()?;
        let (at, id) = self.lanes[lane as usize].pop_due(now)?;
        Some((at, lane, id))
    }

    /// Entries in the table, live and superseded.
    pub(crate) fn entries(&self) -> usize {
        self.lanes.iter().map(DueQueue::len).sum()
    }

    /// Whether superseded entries outnumber the live ones in a lane (beyond [`COMPACT_SLACK`]):
    /// then [`TimerTable::compact`], so the table's size follows the machines alive.
    pub(crate) fn wants_compact(&self) -> bool {
        [Lane::Running, Lane::Lingering]
            .into_iter()
            .any(|lane| self.lane_wants_compact(lane))
    }

    fn lane_wants_compact(&self, lane: Lane) -> bool {
        let i = lane as usize;
        self.lanes[i].len() > 2 * self.live[i] + COMPACT_SLACK
    }

    /// Drops every entry `live` says is not its machine's live one. O(entries), each looked up
    /// once: it runs when at least half of a lane is superseded, so O(1) amortised per entry.
    pub(crate) fn compact(&mut self, mut live: impl FnMut(Instant, Lane, TimerId) -> bool) {
        for lane in [Lane::Running, Lane::Lingering] {
            if self.lane_wants_compact(lane) {
                self.lanes[lane as usize].retain(|at, id| live(at, lane, id));
            }
        }
    }

    /// The table's entry for `m` at `at` in `lane` was popped: is it the live one? (Then `m`
    /// has none.)
    pub(crate) fn fired<M>(&mut self, m: &mut Timed<M>, at: Instant, lane: Lane) -> bool {
        if !m.is_live(at, lane) {
            return false; // superseded by a later arm
        }
        m.at = None;
        self.live[lane as usize] -= 1;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::time::Duration;

    proptest! {
        /// Whatever the order of the pushes, entries come out in due order, each once.
        #[test]
        fn a_due_queue_pops_in_due_order(offsets in proptest::collection::vec(0u64..1000, 0..200)) {
            let t0 = Instant::now();
            let mut q = DueQueue::default();
            for (i, &o) in offsets.iter().enumerate() {
                q.push(t0 + Duration::from_millis(o), i);
            }
            let mut want: Vec<(Instant, usize)> = offsets
                .iter()
                .enumerate()
                .map(|(i, &o)| (t0 + Duration::from_millis(o), i))
                .collect();
            want.sort();
            // Nothing is due before its instant.
            prop_assert_eq!(q.pop_due(t0 - Duration::from_millis(1)), None);
            let mut got = Vec::new();
            while let Some(e) = q.pop_due(t0 + Duration::from_secs(2)) {
                got.push(e);
            }
            prop_assert_eq!(got, want);
            prop_assert_eq!(q.len(), 0);
        }
    }

    #[test]
    fn entries_armed_in_order_stay_out_of_the_heap() {
        let t0 = Instant::now();
        let mut q = DueQueue::default();
        for i in 0..100u64 {
            q.push(t0 + Duration::from_millis(i), i);
        }
        q.push(t0, 1000); // earlier than the back: the heap
        assert_eq!((q.sorted.len(), q.heap.len()), (100, 1));
        assert_eq!(q.pop_due(t0), Some((t0, 0)));
        assert_eq!(q.pop_due(t0), Some((t0, 1000)));
        q.retain(|_, i| i % 2 == 0);
        assert_eq!(q.len(), 49);
        assert_eq!(q.peek(), Some((t0 + Duration::from_millis(2), 2)));
    }
}
