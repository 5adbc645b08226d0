//! The timer table of the protocol core: every request's next deadline in one heap, each entry
//! checked against the instant its state machine holds, so that an input costs O(log n) and no
//! call scans every request (quinn-proto's timer table, kept as a heap). [`Endpoint`] arms a
//! machine after every input that touched it and fires what is due in `handle_timeout`.
//!
//! [`Endpoint`]: super::endpoint::Endpoint
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::Instant;

use super::id::{RankId, RequestKey};

/// Which state machine a timer belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) enum TimerId {
    Recv(RequestKey),
    Send(RequestKey, RankId),
}

/// Superseded timer entries tolerated beyond the live ones before the heap is rebuilt.
const COMPACT_SLACK: usize = 64;

/// A state machine with the instant of its live entry in the timer heap (the one entry not
/// superseded), kept beside it so that scheduling looks the machine up once. Boxed in the maps:
/// a B-tree node then holds pointers, not machines of a few hundred bytes, so inserts and the
/// splits they cause move little memory.
#[derive(Debug)]
pub(crate) struct Timed<T> {
    pub(crate) at: Option<Instant>,
    machine: T,
}

impl<T> Timed<T> {
    pub(crate) fn boxed(machine: T) -> Box<Self> {
        Box::new(Timed { at: None, machine })
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
}

/// Every state machine's next deadline, earliest first (quinn-proto's timer table, as a heap).
/// An entry is live only while it equals its machine's `Timed::at`; others are skipped when
/// popped, so an event costs O(log n) and no call scans every request.
#[derive(Debug, Default)]
pub(crate) struct TimerTable {
    heap: BinaryHeap<Reverse<(Instant, TimerId)>>,
    /// Machines with a live entry in `heap`.
    live: usize,
}

impl TimerTable {
    /// Called with the machine in hand after every input that touched it: puts its next
    /// deadline in the heap, unless its live entry already says so.
    pub(crate) fn arm<M: Machine>(&mut self, id: TimerId, m: &mut Timed<M>, now: Instant) {
        m.machine.settle(now);
        let at = m.machine.next_timeout();
        if m.at != Some(at) {
            if m.at.replace(at).is_none() {
                self.live += 1;
            }
            self.heap.push(Reverse((at, id)));
        }
    }

    /// The earliest entry's instant (it may be a superseded one: then whoever waits for it
    /// wakes early, once, for nothing).
    pub(crate) fn next_due(&self) -> Option<Instant> {
        self.heap.peek().map(|Reverse((at, _))| *at)
    }

    /// Takes the earliest entry if it is due at `now`; check it with [`TimerTable::fired`].
    pub(crate) fn pop_due(&mut self, now: Instant) -> Option<(Instant, TimerId)> {
        let Reverse((at, id)) = *self.heap.peek()?;
        if at > now {
            return None;
        }
        self.heap.pop();
        Some((at, id))
    }

    /// Entries in the heap, live and superseded.
    pub(crate) fn entries(&self) -> usize {
        self.heap.len()
    }

    /// Whether superseded entries outnumber the live ones (beyond [`COMPACT_SLACK`]): then
    /// [`TimerTable::rebuild`] from the live ones, so the heap's size follows the machines alive.
    pub(crate) fn wants_rebuild(&self) -> bool {
        self.heap.len() > 2 * self.live + COMPACT_SLACK
    }

    /// Remakes the heap from the machines' live entries (each machine's `Timed::at`).
    pub(crate) fn rebuild(&mut self, live: impl Iterator<Item = (Instant, TimerId)>) {
        self.heap = live.map(Reverse).collect();
        debug_assert_eq!(self.heap.len(), self.live);
    }

    /// The heap's entry for `m` at `at` was popped: is it the live one? (Then `m` has none.)
    pub(crate) fn fired<M>(&mut self, m: &mut Timed<M>, at: Instant) -> bool {
        if m.at != Some(at) {
            return false; // superseded by a later arm
        }
        m.at = None;
        self.live -= 1;
        true
    }
}
