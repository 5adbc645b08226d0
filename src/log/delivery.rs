//! The sink's records are delivered off kvlink's threads. The thread that logs formats the
//! record into one owned value and pushes it onto a bounded queue; one thread of kvlink's
//! ("kvlink-log") pops the records in order and calls the sink with no lock held. A sink that
//! blocks (a host logger writing to a full pipe) then only holds up its own records: the queue
//! fills, the records past [`QUEUE_CAP`] are dropped and counted ([`records_dropped`]), and no
//! transfer waits on it.
//!
//! The thread is started when a sink is set and ends once the sink is removed and it has nothing
//! left to do; it sleeps on a condvar while the queue is empty. Removing the sink first lets the
//! records queued for it reach it (for [`DRAIN_WAIT`]), then waits for the thread to end and
//! joins it, all within [`STOP_WAIT`]: after that no call of the sink runs, and no kvlink code runs on that thread (a
//! host may then unload a library that links kvlink, as the TensorRT-LLM wrapper is).
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex, MutexGuard};

use super::{SinkFn, IN_SINK, SINK_LEVEL};

/// The most records waiting for the sink; past it a new record is dropped and counted.
pub const QUEUE_CAP: usize = 4096;

/// How long removing the sink waits in all: for the records queued for it to reach it (for the
/// first [`DRAIN_WAIT`] of it; what is left then is discarded), then for its call under way to
/// return (a sink that blocks past it is left to finish its call on its own).
pub const STOP_WAIT: Duration = Duration::from_millis(500);

/// The part of [`STOP_WAIT`] in which the records queued for a removed sink still reach it: the
/// rest is kept for the call under way then. Were the whole bound spent on the queue, a sink
/// that is slow but returns (100 ms a record, eight queued) would still be in a call when the
/// removal gave up waiting for it.
pub const DRAIN_WAIT: Duration = Duration::from_millis(250);

/// One event, formatted: the message and the fields in one string.
pub(super) struct Record {
    pub(super) level: u8,
    pub(super) target: &'static str,
    /// The message, then the fields (`k=v` separated by spaces).
    pub(super) text: String,
    /// Where the message ends in `text`.
    pub(super) message_len: usize,
}

struct State {
    queue: VecDeque<Record>,
    /// The sink's function's address (0: none): records are taken while it is set. Read under
    /// the lock with each record, so a record taken off the queue before the sink's removal or
    /// replacement goes to the sink it was queued for.
    sink: usize,
    /// Sinks set since the start: a removal that waits sees by it that a sink was set
    /// meanwhile (the same function again, too) and leaves that one in place.
    sets: u64,
    /// The delivery thread runs (it may still be in a call of a sink removed since).
    running: bool,
    /// That thread, to be joined once it has ended (`running` false).
    thread: Option<JoinHandle<()>>,
    /// Records taken, and records delivered or discarded, since the start: [`flush`] waits for
    /// the second to reach what the first was when it was called.
    taken: u64,
    done: u64,
}

static STATE: Mutex<State> = Mutex::new(State {
    queue: VecDeque::new(),
    sink: 0,
    sets: 0,
    running: false,
    thread: None,
    taken: 0,
    done: 0,
});
/// Signalled when a record is queued or the sink removed (the delivery thread waits on it).
static QUEUED: Condvar = Condvar::new();
/// Signalled when records are delivered or discarded ([`flush`] waits on it).
static DONE: Condvar = Condvar::new();
static DROPPED: AtomicU64 = AtomicU64::new(0);

/// Records dropped because the queue was full (the sink fell [`QUEUE_CAP`] records behind), or
/// because formatting one panicked (a field's `Display`), since the process started.
pub fn records_dropped() -> u64 {
    DROPPED.load(Ordering::Relaxed)
}

/// Counts a record that never reached the queue (its formatting panicked).
pub(super) fn count_dropped() {
    DROPPED.fetch_add(1, Ordering::Relaxed);
}

/// Queues `record` for the sink; drops it (counted) when the queue is full, and drops it
/// silently when the sink was removed meanwhile.
pub(super) fn push(record: Record) {
    let mut s = STATE.lock();
    if s.sink == 0 {
        return;
    }
    if s.queue.len() >= QUEUE_CAP {
        drop(s);
        DROPPED.fetch_add(1, Ordering::Relaxed);
        return;
    }
    s.queue.push_back(record);
    s.taken += 1;
    drop(s);
    QUEUED.notify_one();
}

/// `sink` (the address of a [`SinkFn`]) is set at `level` (1 error .. 5 trace): records are
/// taken for it, and the delivery thread runs (started if it does not). Records still queued go
/// to it. The level is stored with the sink, under the lock, so that a removal running at the
/// same time cannot leave one without the other.
pub(super) fn start(sink: usize, level: u8) -> std::io::Result<()> {
    let mut s = STATE.lock();
    if !s.running {
        // One that ended and was not joined (its stop gave up waiting) is left detached.
        s.thread = Some(
            std::thread::Builder::new()
                .name("kvlink-log".into())
                .spawn(run)?,
        );
        s.running = true;
    }
    // The function and the thread first, then the level that makes the layer queue records.
    s.sink = sink;
    s.sets += 1;
    SINK_LEVEL.store(level, Ordering::Release);
    Ok(())
}

/// The sink is removed: the records queued for it are delivered first, up to [`DRAIN_WAIT`]; any
/// left then are discarded (never delivered to a sink set later), and the delivery thread ends
/// once its call under way, if any, returns. Waits for that too, up to [`STOP_WAIT`] from the
/// start, and joins the thread. From inside the sink it waits for nothing (the thread ends when the sink
/// returns). A sink set meanwhile takes over, with what is still queued.
pub(super) fn stop() {
    let in_sink = IN_SINK.with(|b| b.get());
    let start = Instant::now();
    let (drained_by, deadline) = (start + DRAIN_WAIT, start + STOP_WAIT);
    let mut s = STATE.lock();
    // No new records while those queued go; a sink set meanwhile stores its own level.
    SINK_LEVEL.store(0, Ordering::Release);
    let sets = s.sets;
    if !in_sink {
        let target = s.taken;
        while s.done < target && s.sets == sets {
            if DONE.wait_until(&mut s, drained_by).timed_out() {
                break;
            }
        }
        if s.sets != sets {
            return;
        }
    }
    s.sink = 0;
    let gone = std::mem::take(&mut s.queue);
    s.done += gone.len() as u64;
    QUEUED.notify_all();
    DONE.notify_all();
    if in_sink {
        return;
    }
    while s.running {
        // A sink set again meanwhile keeps the thread: nothing to wait for.
        if s.sink != 0 || DONE.wait_until(&mut s, deadline).timed_out() {
            return;
        }
    }
    let ended = s.thread.take();
    drop(s);
    drop(gone);
    if let Some(t) = ended {
        // It has left its loop and released the lock: only its return is left.
        let _ = t.join();
    }
}

/// Waits until every record queued before the call has been delivered (or discarded by the
/// sink's removal), or until `deadline`; returns whether they all have. On the delivery thread
/// (from inside the sink) it cannot wait for itself: it says whether nothing is pending.
pub fn flush(deadline: Instant) -> bool {
    let mut s = STATE.lock();
    let target = s.taken;
    if IN_SINK.with(|b| b.get()) {
        // The record being delivered is taken, and done only once the sink returns.
        return s.done + 1 >= target;
    }
    while s.done < target {
        if DONE.wait_until(&mut s, deadline).timed_out() {
            return s.done >= target;
        }
    }
    true
}

/// The delivery thread: pops records in order and calls the sink, with no lock held; ends once
/// the sink is removed and the queue is empty.
fn run() {
    // Whatever this thread logs is caused by the sink: dropped, never queued.
    IN_SINK.with(|b| b.set(true));
    let mut s = STATE.lock();
    loop {
        let Some(record) = s.queue.pop_front() else {
            if s.sink == 0 {
                s.running = false;
                DONE.notify_all();
                return;
            }
            QUEUED.wait(&mut s);
            continue;
        };
        let sink = s.sink;
        MutexGuard::unlocked(&mut s, || deliver(sink, record));
        s.done += 1;
        DONE.notify_all();
    }
}

/// Calls `f`, the address of a [`SinkFn`], with `record`.
fn deliver(f: usize, record: Record) {
    let (message, fields) = record.text.split_at(record.message_len);
    // SAFETY: `f` is a `SinkFn` that stays callable while registered (`set_sink`'s contract);
    // the three byte ranges live for the call. It does not unwind.
    unsafe {
        let sink: SinkFn = std::mem::transmute::<usize, SinkFn>(f);
        sink(
            record.level,
            record.target.as_ptr(),
            record.target.len(),
            message.as_ptr(),
            message.len(),
            fields.as_ptr(),
            fields.len(),
        );
    }
}
