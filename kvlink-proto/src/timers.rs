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
/// superseded), the lane it is in and its stamp slot, kept beside it so that scheduling looks
/// the machine up once. Boxed in the maps: a machine is a few hundred bytes, and a map's
/// growth then moves pointers, not machines.
#[derive(Debug)]
pub(crate) struct Timed<T> {
    pub(crate) at: Option<Instant>,
    lane: Lane,
    /// Its slot in [`TimerTable`]'s stamps ([`NO_SLOT`] before its first arm).
    slot: u32,
    machine: T,
}

/// How much later a machine's timer fires again when it is still due right after it fired
/// ([`TimerTable::rearm`]).
pub(crate) const REFIRE_FLOOR: std::time::Duration = std::time::Duration::from_millis(1);

/// A machine that was never armed has no stamp slot.
const NO_SLOT: u32 = u32::MAX;

impl<T> Timed<T> {
    pub(crate) fn boxed(machine: T) -> Box<Self> {
        Box::new(Timed {
            at: None,
            lane: Lane::Running,
            slot: NO_SLOT,
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

/// One entry of the timer table: the machine it is for, and the stamp its slot had when the
/// entry was pushed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct Entry {
    id: TimerId,
    slot: u32,
    stamp: u32,
}

/// Every state machine's next deadline, earliest first, in two lanes (running and lingering
/// machines). An entry is live only while its slot's stamp is the one it was pushed with: a
/// machine's new entry, its firing and its forgetting each move the stamp on. Telling a live
/// entry from a superseded one is one read of a dense array, not a look-up of the machine (a
/// hash probe and a pointer to follow, each a cache miss at thousands of requests in flight):
/// superseded entries are skipped when popped, and compacted away once they outnumber the live
/// ones, without touching a machine.
#[derive(Debug, Default)]
pub(crate) struct TimerTable {
    lanes: [DueQueue<Entry>; 2],
    /// Machines with a live entry in each lane.
    live: [usize; 2],
    /// Each slot's stamp; a machine holds its slot from its first arm until it is forgotten.
    stamps: Vec<u32>,
    /// Slots of forgotten machines, for the next ones.
    free: Vec<u32>,
}

impl TimerTable {
    /// Called with the machine in hand after every input that touched it: puts its next
    /// deadline in its lane, unless its live entry already says so.
    pub(crate) fn arm<M: Machine>(&mut self, id: TimerId, m: &mut Timed<M>, now: Instant) {
        m.machine.settle(now);
        let at = m.machine.next_timeout();
        self.arm_at(id, m, at);
    }

    /// [`TimerTable::arm`] for a machine whose timer has just fired at `now`: if it is still
    /// due (its `on_timeout` did not move its next deadline past `now`, a machine's fault), its
    /// new entry is put [`REFIRE_FLOOR`] later instead. Each `handle_timeout` then fires each
    /// machine once at most: a machine that never moves on costs a firing per millisecond, not
    /// a loop that never ends with the core's lock held (and every wait with it).
    pub(crate) fn rearm<M: Machine>(&mut self, id: TimerId, m: &mut Timed<M>, now: Instant) {
        m.machine.settle(now);
        let at = m.machine.next_timeout();
        let floor = now.checked_add(REFIRE_FLOOR).unwrap_or(now);
        self.arm_at(id, m, if at <= now { floor } else { at });
    }

    fn arm_at<M: Machine>(&mut self, id: TimerId, m: &mut Timed<M>, at: Instant) {
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
        if m.slot == NO_SLOT {
            m.slot = self.free.pop().unwrap_or_else(|| {
                self.stamps.push(0);
                (self.stamps.len() - 1) as u32
            });
        }
        // Supersedes the machine's previous entry, if any.
        let stamp = self.bump(m.slot);
        m.at = Some(at);
        m.lane = lane;
        self.live[lane as usize] += 1;
        let slot = m.slot;
        self.lanes[lane as usize].push(at, Entry { id, slot, stamp });
    }

    /// Moves `slot`'s stamp on (every entry pushed before is superseded) and returns it.
    fn bump(&mut self, slot: u32) -> u32 {
        let s = &mut self.stamps[slot as usize];
        *s = s.wrapping_add(1);
        *s
    }

    fn is_live_entry(&self, e: &Entry) -> bool {
        self.stamps[e.slot as usize] == e.stamp
    }

    /// The machine `m` is forgotten (its last entry has fired): its slot goes to the next one.
    pub(crate) fn release<M>(&mut self, m: &mut Timed<M>) {
        if m.slot != NO_SLOT {
            debug_assert!(m.at.is_none(), "a forgotten machine has no live entry");
            self.bump(m.slot);
            self.free.push(m.slot);
            m.slot = NO_SLOT;
        }
    }

    /// The machine `m` is forgotten before its timer fired: its entry, if any, is superseded
    /// (found stale when it comes up), and its slot goes to the next one.
    pub(crate) fn drop_early<M>(&mut self, m: &mut Timed<M>) {
        if m.at.take().is_some() {
            self.live[m.lane as usize] -= 1;
        }
        self.release(m);
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

    /// Takes the earliest live entry if it is due at `now` (superseded ones are dropped on the
    /// way); hand its machine to [`TimerTable::fired`].
    pub(crate) fn pop_due(&mut self, now: Instant) -> Option<(Instant, Lane, TimerId)> {
        loop {
            let (_, lane) = self.earliest()?;
            let (at, e) = self.lanes[lane as usize].pop_due(now)?;
            if self.is_live_entry(&e) {
                return Some((at, lane, e.id));
            }
        }
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

    /// Drops every superseded entry of a lane that [`TimerTable::wants_compact`]. O(entries),
    /// a stamp read each: it runs when at least half of a lane is superseded, so O(1)
    /// amortised per entry.
    pub(crate) fn compact(&mut self) {
        for lane in [Lane::Running, Lane::Lingering] {
            if self.lane_wants_compact(lane) {
                let stamps = &self.stamps;
                self.lanes[lane as usize].retain(|_, e| stamps[e.slot as usize] == e.stamp);
            }
        }
    }

    /// The table's entry for `m` at `at` in `lane` was popped: is it the live one? (Then `m`
    /// has none.) [`TimerTable::pop_due`] returns live entries only, so this is a check.
    pub(crate) fn fired<M>(&mut self, m: &mut Timed<M>, at: Instant, lane: Lane) -> bool {
        if !m.is_live(at, lane) {
            return false; // superseded by a later arm
        }
        m.at = None;
        self.live[lane as usize] -= 1;
        self.bump(m.slot);
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

    /// A machine whose next timeout and lane the test sets.
    struct Fake {
        next: Instant,
        lingers: bool,
    }

    impl Machine for Fake {
        fn settle(&mut self, _now: Instant) {}
        fn next_timeout(&self) -> Instant {
            self.next
        }
        fn lingers(&self) -> bool {
            self.lingers
        }
    }

    /// A machine still due right after it fired (its timeout did not move it on) is not fired
    /// again in the same `handle_timeout` loop: its next entry is a millisecond on.
    #[test]
    fn a_machine_still_due_after_it_fired_fires_again_a_millisecond_later_not_at_once() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let id = TimerId::Recv(crate::RequestKey::new(1, 0));
        let mut t = TimerTable::default();
        let mut stuck = Timed::boxed(Fake {
            next: t0,
            lingers: false,
        });
        t.arm(id, &mut stuck, t0);
        let now = t0 + ms(5);
        let (at, lane, _) = t.pop_due(now).expect("due");
        assert!(t.fired(&mut stuck, at, lane));
        // `arm` would put it back due at once, and the loop would pop it for ever.
        t.rearm(id, &mut stuck, now);
        assert_eq!(t.pop_due(now), None, "not again in this loop");
        assert_eq!(t.next_due(), Some(now + REFIRE_FLOOR));
        assert!(
            t.pop_due(now + REFIRE_FLOOR).is_some(),
            "but a millisecond later"
        );
        // A machine that did move on is armed where it says.
        let mut fine = Timed::boxed(Fake {
            next: now + ms(200),
            lingers: false,
        });
        t.rearm(id, &mut fine, now);
        assert_eq!(t.next_due(), Some(now + ms(200)));
    }

    /// Superseded entries are told by their stamp alone: they never come out of `pop_due`,
    /// compaction drops them without a look at any machine, and a forgotten machine's slot,
    /// taken by the next one, does not bring its old entries back to life.
    #[test]
    fn superseded_entries_are_told_by_their_stamp_and_never_fire() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let key = |i| TimerId::Recv(crate::RequestKey::new(i, 0));
        let mut t = TimerTable::default();
        let mut a = Timed::boxed(Fake {
            next: t0 + ms(200),
            lingers: false,
        });
        t.arm(key(1), &mut a, t0);
        // Finished: it moves to the lingering lane, its running entry is superseded.
        a.machine.next = t0 + ms(5000);
        a.machine.lingers = true;
        t.arm(key(1), &mut a, t0);
        assert_eq!(t.entries(), 2);
        assert_eq!(
            t.next_due(),
            Some(t0 + ms(200)),
            "the superseded one is still there"
        );
        assert_eq!(t.pop_due(t0 + ms(1000)), None, "but it never fires");
        assert_eq!(t.entries(), 1, "it was dropped on the way");
        // Many machines supersede their running entries: compaction keeps the live ones only.
        let mut ms_: Vec<Box<Timed<Fake>>> = (0..200)
            .map(|i| {
                Timed::boxed(Fake {
                    next: t0 + ms(100 + i),
                    lingers: false,
                })
            })
            .collect();
        for (i, m) in ms_.iter_mut().enumerate() {
            t.arm(key(10 + i as u64), m, t0);
        }
        for _ in 0..3 {
            for m in ms_.iter_mut().take(150) {
                m.machine.next += ms(10_000);
                t.arm(key(0), m, t0); // the id does not matter to liveness
            }
        }
        assert!(t.wants_compact());
        t.compact();
        assert_eq!(
            t.entries(),
            1 + 200,
            "a's lingering entry and one per machine"
        );
        // `a` fires for the last time and is forgotten; a new machine takes its slot.
        let (at, lane, id) = t.pop_due(t0 + ms(5000)).unwrap();
        assert_eq!(
            (at, lane, id),
            (t0 + ms(100 + 150), Lane::Running, key(160))
        );
        let mut b = Timed::boxed(Fake {
            next: t0 + ms(1),
            lingers: false,
        });
        let fired: Vec<TimerId> = std::iter::from_fn(|| t.pop_due(t0 + ms(5000)))
            .map(|(_, _, id)| id)
            .collect();
        assert_eq!(fired.len(), 49 + 1, "the 49 others still running, then a");
        assert!(t.fired(&mut a, t0 + ms(5000), Lane::Lingering));
        t.release(&mut a);
        t.arm(key(2), &mut b, t0);
        assert_eq!(b.slot, 0, "a's slot, reused");
        assert_eq!(
            t.pop_due(t0 + ms(1)),
            Some((t0 + ms(1), Lane::Running, key(2)))
        );
        assert_eq!(
            t.pop_due(t0 + ms(100_000)),
            Some((t0 + ms(30_100), Lane::Running, key(0)))
        );
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
