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
use super::request::{RecvRequest, SendFlow};

/// Which state machine a timer belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum TimerId {
    Recv(RequestKey),
    Send(RequestKey, RankId),
}

/// Superseded timer entries tolerated beyond the live ones before the heap is rebuilt.
pub(crate) const COMPACT_SLACK: usize = 64;

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

/// What the timer table needs of a state machine.
pub(crate) trait Machine {
    /// Starts the linger of a machine that has just ended.
    fn settle(&mut self, now: Instant);
    fn next_timeout(&self) -> Instant;
}

impl Machine for RecvRequest {
    fn settle(&mut self, now: Instant) {
        RecvRequest::settle(self, now)
    }
    fn next_timeout(&self) -> Instant {
        RecvRequest::next_timeout(self)
    }
}

impl Machine for SendFlow {
    fn settle(&mut self, now: Instant) {
        SendFlow::settle(self, now)
    }
    fn next_timeout(&self) -> Instant {
        SendFlow::next_timeout(self)
    }
}

/// Every state machine's next deadline, earliest first (quinn-proto's timer table, as a heap).
/// An entry is live only while it equals its machine's `Timed::at`; others are skipped when
/// popped, so an event costs O(log n) and no call scans every request.
#[derive(Debug, Default)]
pub(crate) struct TimerTable {
    pub(crate) heap: BinaryHeap<Reverse<(Instant, TimerId)>>,
    /// Machines with a live entry in `heap`.
    pub(crate) live: usize,
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
