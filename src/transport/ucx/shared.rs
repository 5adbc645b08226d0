//! What the owner's threads and the progress thread share: the command queue (with the eventfd
//! that wakes the progress thread), one-shot replies, the event queue, peer failure flags, the
//! ops in flight and the progress counters.
use super::agent::DIRECT_POST_MAX;
use super::callbacks::{self, finish_slot, CbEvent};
use super::op::{OpSlot, NOT_TRACKED, STOP_NONE, STOP_SHUTDOWN};
use super::peers::Voice;
use super::progress::Progress;
use super::{sys, AgentOptions, Event, PeerId, TransportKind};
use crate::error::{Error, ErrorKind, Result};
use foldhash::{HashMap, HashMapExt, HashSet, HashSetExt};
use parking_lot::{Condvar, Mutex};
use std::collections::VecDeque;
use std::ffi::c_void;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

#[derive(Default)]
pub(super) struct CmdQueue {
    pub(super) items: VecDeque<Cmd>,
    /// Commands ever taken from the front: the front command is number `taken`, and the last
    /// queued number `taken + items.len() - 1`, so a caller whose commands end before number
    /// `end` runs exactly its own while `taken < end` ([`Shared::run_here`]).
    pub(super) taken: u64,
    /// Set by the progress thread's teardown: nothing is queued after it.
    pub(super) closed: bool,
}

impl CmdQueue {
    /// Takes every queued command (counted as taken).
    pub(super) fn take_all(&mut self) -> Vec<Cmd> {
        self.taken += self.items.len() as u64;
        self.items.drain(..).collect()
    }

    /// Drops every queued command (counted as taken): for tests that play the progress thread.
    #[cfg(test)]
    pub(super) fn clear(&mut self) {
        self.taken += self.items.len() as u64;
        self.items.clear();
    }
}

/// What the owner's threads ask of the progress thread.
pub(super) enum Cmd {
    Connect(SocketAddr, Arc<Reply<PeerId>>),
    ConnectWorker(Vec<u8>, Arc<Reply<PeerId>>),
    Tag {
        send: bool,
        peer: PeerId,
        tag: u64,
        addr: usize,
        len: usize,
        slot: Arc<OpSlot>,
    },
    Control {
        peer: PeerId,
        bytes: Vec<u8>,
        slot: Arc<OpSlot>,
    },
    /// A control message nobody waits on ([`Agent::post_control`](super::Agent::post_control)).
    Post {
        peer: PeerId,
        bytes: Vec<u8>,
    },
    /// Cancel the op `id`, at index `at` of the in-flight table (checked: the index may
    /// have been taken by another op since).
    CancelOp {
        id: u64,
        at: u32,
    },
    Map {
        addr: usize,
        len: usize,
        reply: Arc<Reply<(u64, Vec<u8>)>>,
    },
    Unmap(u64),
    UnpackRkey {
        peer: PeerId,
        packed: Vec<u8>,
        reply: Arc<Reply<u64>>,
    },
    DestroyRkey(u64),
    Rma {
        rkey: u64,
        put: bool,
        addr: usize,
        len: usize,
        remote: u64,
        slot: Arc<OpSlot>,
    },
    ForceClose(PeerId, Option<Arc<Reply<()>>>),
    /// The transports and devices a peer's endpoint uses (None: this UCX cannot say).
    PeerTransports(PeerId, Arc<Reply<Option<Vec<String>>>>),
    /// A fault for tests: act as if the probe had found the receive queue stuck.
    FaultStuck,
    /// A fault for tests: the progress thread sleeps, after its next pass or in the next
    /// connect command; `armed` is answered when the sleep begins, or is armed.
    FaultStall {
        stall: Duration,
        at_next_connect: bool,
        armed: Arc<Reply<()>>,
    },
    Shutdown,
}

/// A one-shot reply from the progress thread. A waiter whose deadline passes gives the reply up:
/// what the progress thread makes for it afterwards comes back to that thread ([`Reply::offer`])
/// to be undone, so that a caller who returned on time leaves nothing behind.
pub(super) struct Reply<T> {
    state: Mutex<ReplyState<T>>,
    cv: Condvar,
}

struct ReplyState<T> {
    value: Option<Result<T>>,
    given_up: bool,
}

impl<T> Reply<T> {
    pub(super) fn new() -> Arc<Self> {
        Arc::new(Reply {
            state: Mutex::new(ReplyState {
                value: None,
                given_up: false,
            }),
            cv: Condvar::new(),
        })
    }

    /// Hands `v` to the waiter; for replies whose value needs no undoing.
    pub(super) fn set(&self, v: Result<T>) {
        drop(self.offer(v));
    }

    /// Hands `v` to the waiter, or gives it back when the waiter has given up.
    pub(super) fn offer(&self, v: Result<T>) -> Option<Result<T>> {
        let mut s = self.state.lock();
        if s.given_up {
            return Some(v);
        }
        s.value = Some(v);
        self.cv.notify_all();
        None
    }

    /// Whether the waiter has given up (the work it asked for need not be started).
    pub(super) fn given_up(&self) -> bool {
        self.state.lock().given_up
    }

    /// The value, or a `Transport` error if none came by `deadline` (the reply is then given up).
    pub(super) fn wait(&self, deadline: Instant) -> Result<T> {
        self.wait_or(deadline, || {
            Error::new(ErrorKind::Transport, "progress thread did not answer")
        })
    }

    /// The value, or `late()` if none came by `deadline` (the reply is then given up).
    pub(super) fn wait_or(&self, deadline: Instant, late: impl FnOnce() -> Error) -> Result<T> {
        let mut s = self.state.lock();
        loop {
            if let Some(v) = s.value.take() {
                return v;
            }
            if Instant::now() >= deadline {
                s.given_up = true;
                return Err(late());
            }
            self.cv.wait_until(&mut s, deadline);
        }
    }
}

/// A send UCX holds queued: its peer, its bytes and its header.
pub(super) type HeldSend = (u64, Vec<u8>, Voice);

#[derive(Default)]
pub(super) struct AtomicStats {
    pub(super) ops_started: AtomicU64,
    pub(super) ops_completed: AtomicU64,
    pub(super) ops_failed: AtomicU64,
    pub(super) bytes_completed: AtomicU64,
    pub(super) last_completion_ns: AtomicU64,
    pub(super) unreaped: AtomicU64,
    pub(super) wakeups: AtomicU64,
    pub(super) empty_wakeups: AtomicU64,
    /// See [`Stats::cancel_checks`](super::Stats::cancel_checks).
    pub(super) cancel_checks: AtomicU64,
    pub(super) backoffs: AtomicU64,
    pub(super) stale_control_dropped: AtomicU64,
    pub(super) control_batches: AtomicU64,
    pub(super) control_batched: AtomicU64,
    pub(super) control_malformed: AtomicU64,
    pub(super) control_spoofed: AtomicU64,
    pub(super) stray_discarded: AtomicU64,
    pub(super) worker_renewals: AtomicU64,
}

/// Where a progress pass hands its events when an owner runs its logic there (the engine does:
/// its protocol core runs where the events arrive, with no thread of its own between).
pub trait EventSink: Send + Sync {
    /// Called in a progress pass, under the driver lock (on the progress thread, or on a caller
    /// that drives progress while it waits), never inside a UCX callback, with the events since
    /// the last call (possibly none: a timer came due) and the time. Returns when it next wants
    /// to be called if nothing happens. It must not wait for progress (no `Agent::connect`, no
    /// `Op::wait`, no dropping an unfinished `Op`): commands it submits run after it returns.
    fn deliver(&self, events: &mut VecDeque<Event>, now: Instant) -> Option<Instant>;

    /// Called in the same pass once the control messages at the front of the queue (those
    /// `deliver` sent) have been started, and before any other command runs (closing an
    /// endpoint may take long): what should follow the messages' start, and must not wait for
    /// anything slower (waking the callers `deliver` ended the wait of), goes here.
    fn delivered(&self) {}
}

/// State shared between the owner's threads and the progress thread.
pub(super) struct Shared {
    pub(super) cmds: Mutex<CmdQueue>,
    /// True whenever `cmds` holds a command (set under its lock by whoever queues, cleared
    /// under it by a drain that found it empty): a pass looks here, not at the lock, to learn
    /// that there is nothing to run. It may say true of an empty queue for a moment, never
    /// false of a full one once the queuing caller has let the lock go.
    pub(super) cmds_queued: AtomicBool,
    /// The eventfd that wakes the progress thread; closed when the last holder of `Shared` (an
    /// agent, an op, a handle) lets go, so a late wake never writes into a reused descriptor.
    pub(super) wake_fd: std::os::fd::OwnedFd,
    pub(super) stopping: AtomicBool,
    pub(super) events: Mutex<VecDeque<Event>>,
    pub(super) events_cv: Condvar,
    /// The peers whose endpoint is live: the same set as the progress thread's entries (both
    /// change together, in `Progress::connect` and `Progress::fail_peer`). A failed peer is
    /// forgotten with its endpoint: ids are handed out in order from 1 and never reused, so
    /// every other id below [`Shared::next_peer`] is a peer that failed ([`Shared::was_peer`]).
    /// What the agent keeps per peer is then bounded by the live ones, however many endpoints
    /// come and go over the process's life (a stranger dialling the listener again and again).
    pub(super) live_peers: Mutex<HashSet<PeerId>>,
    /// The id the next peer gets (only the progress thread moves it, once the peer is live).
    pub(super) next_peer: AtomicU64,
    pub(super) in_flight: Mutex<InFlight>,
    /// The bytes of the data transfers in `in_flight` (not control messages): kept by
    /// [`Shared::track_op`] and [`Shared::untrack_op`] alone.
    pub(super) in_flight_bytes: AtomicUsize,
    pub(super) next_op: AtomicU64,
    pub(super) stats: AtomicStats,
    pub(super) epoch: Instant,
    pub(super) reap_grace: Duration,
    pub(super) uid: u64,
    /// The owner's event sink, if it runs its logic on the progress thread.
    pub(super) sink: std::sync::OnceLock<Arc<dyn EventSink>>,
    /// When the progress thread will next call the sink unprompted (ns since `epoch`).
    pub(super) sink_due_ns: AtomicU64,
    /// The memory types the UCX context supports (a bit per `ucs_memory_type_t`), set at start.
    pub(super) memory_types: AtomicU64,
    /// The progress state behind the driver lock. Whoever holds the lock may call into UCX (the
    /// worker is `SERIALIZED`): the progress thread, for one pass at a time and never while it
    /// sleeps, or a waiting caller that took it with `try_lock` ([`Shared::try_drive`]) so the
    /// completion it waits for is handled on its own thread, without a wake-up in between.
    /// `None` before start and from teardown on.
    pub(super) driver: Mutex<Option<Box<Progress>>>,
    /// What the UCX callbacks reported, for the pass to handle after its progress call.
    pub(super) cb_events: Mutex<Vec<CbEvent>>,
    /// Passes run by callers (the progress thread's empty-wake count leaves those out).
    pub(super) caller_passes: AtomicU64,
    /// When a pass last made progress (ns since `epoch`).
    pub(super) last_progress_ns: AtomicU64,
    /// Until when the progress thread sleeps (ns since `epoch`; 0 while it is awake).
    pub(super) sleeping_until_ns: AtomicU64,
    /// How long a thread keeps polling after the last progress before it sleeps.
    pub(super) poll_window: Duration,
    /// How long a caller within its poll window spins for the driver lock when the progress
    /// thread holds it ([`Shared::try_drive`]); zero where this process may run on one CPU only
    /// (spinning would take the CPU from the very thread that holds the lock). See
    /// [`drive_spin`].
    pub(super) drive_spin: Duration,
    /// Callers spinning for the driver lock now: the progress thread stops polling and sleeps
    /// (letting go of the lock) while there are any, so that the caller drives and takes its
    /// own completion without a wake-up from another core.
    pub(super) spinning: AtomicUsize,
    /// The agent's transport is [`TransportKind::Tcp`] (sockets, which the kernel copies): a
    /// caller waits among bulk transfers in flight without polling (see
    /// [`Driving::for_transfer`]). An explicit list (`tcp,self`) or `auto` is left out.
    pub(super) kernel_copies: bool,
    /// The highest receive-queue probe ping the worker has read (see `probe.rs`), and the
    /// random nonce a ping must carry to count.
    pub(super) probe_seen: AtomicU64,
    pub(super) probe_nonce: u64,
    /// The probe found the shared-memory receive queue stuck; cleared if its ping is read
    /// after all (the writer holding the queue was only stopped).
    pub(super) receive_stuck: AtomicBool,
    /// The worker's address, as peers connect to it without a listener. It changes when a
    /// stuck receive queue makes the agent move to a new worker.
    pub(super) worker_address: Mutex<Vec<u8>>,
    /// Moves to a new worker begun (counted before the peers are failed; `worker_renewals`
    /// counts those that succeeded).
    pub(super) moves_begun: AtomicU64,
    /// Sends nobody waits on (`Progress::send_internal`) that UCX holds queued: while any is,
    /// the worker needs progress that no waiting caller gives.
    pub(super) internal_queued: AtomicUsize,
    /// The bytes of those sends and their header (the endpoint's voice), by their UCX
    /// request, until UCX is done with them (the send's callback, or the worker's end).
    pub(super) queued_msgs: Mutex<HashMap<usize, HeldSend>>,
    /// Passes owed to what callers started on their own threads: a send UCX queued, or an end
    /// that the sink must see ([`Shared::owe_pass`]). The progress thread does not sleep past a
    /// debt it has not seen (`owed_seen`, which only it writes, under the driver lock).
    pub(super) owed: AtomicU64,
    pub(super) owed_seen: AtomicU64,
}

impl Shared {
    /// The state an agent shares between its progress thread and its callers (no thread
    /// started here), with its wake eventfd.
    pub(super) fn new(opts: &AgentOptions, uid: u64) -> Result<Arc<Shared>> {
        // SAFETY: eventfd with valid flags; `Shared` owns (and closes) it.
        let wake_fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if wake_fd < 0 {
            return Err(Error::new(ErrorKind::Transport, "eventfd failed"));
        }
        // SAFETY: a fresh descriptor that nothing else owns; `Shared` closes it when it goes.
        let wake_fd =
            unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(wake_fd) };
        Ok(Arc::new(Shared {
            cmds: Mutex::new(CmdQueue::default()),
            cmds_queued: AtomicBool::new(false),
            wake_fd,
            stopping: AtomicBool::new(false),
            events: Mutex::new(VecDeque::new()),
            events_cv: Condvar::new(),
            live_peers: Mutex::new(HashSet::new()),
            next_peer: AtomicU64::new(1),
            in_flight: Mutex::new(InFlight::default()),
            in_flight_bytes: AtomicUsize::new(0),
            next_op: AtomicU64::new(1),
            stats: AtomicStats::default(),
            epoch: Instant::now(),
            // Longer is a year ("forever"), as the engine's durations: a stop adds it to an
            // `Instant`, which would overflow.
            reap_grace: opts.reap_grace.min(crate::proto::request::LONGEST),
            uid,
            sink: std::sync::OnceLock::new(),
            sink_due_ns: AtomicU64::new(0),
            memory_types: AtomicU64::new(0),
            driver: Mutex::new(None),
            cb_events: Mutex::new(Vec::new()),
            caller_passes: AtomicU64::new(0),
            last_progress_ns: AtomicU64::new(0),
            sleeping_until_ns: AtomicU64::new(0),
            poll_window: super::progress::poll_window()?,
            drive_spin: drive_spin()?,
            spinning: AtomicUsize::new(0),
            kernel_copies: opts.transport == TransportKind::Tcp,
            probe_seen: AtomicU64::new(0),
            probe_nonce: crate::random::u64(),
            receive_stuck: AtomicBool::new(false),
            worker_address: Mutex::new(Vec::new()),
            moves_begun: AtomicU64::new(0),
            internal_queued: AtomicUsize::new(0),
            queued_msgs: Mutex::new(HashMap::new()),
            owed: AtomicU64::new(0),
            owed_seen: AtomicU64::new(0),
        }))
    }

    pub(super) fn submit(&self, cmd: Cmd) -> Result<()> {
        self.submit_all(std::iter::once(cmd))
    }

    /// Queues `cmds` together in their order and wakes the progress thread to run them.
    pub(super) fn submit_all(&self, cmds: impl IntoIterator<Item = Cmd>) -> Result<()> {
        self.enqueue_all(cmds)?;
        self.nudge();
        Ok(())
    }

    /// [`Shared::submit`] for an op its caller is about to wait on and drive: when the queue
    /// held nothing else and no other thread drives, the command runs here at once, so the op
    /// starts without a wake-up of the progress thread in between; the caller's wait then
    /// drives it (and wakes the progress thread when it stops driving). Otherwise, or when
    /// callers do not drive (`KVLINK_POLL_US=0`), the progress thread is woken as by `submit`.
    /// The caller may hold its own locks: no sink runs here, and no other thread's command.
    pub(super) fn submit_now(self: &Arc<Self>, cmd: Cmd) -> Result<()> {
        if !self.start_here(cmd)? {
            self.nudge();
        }
        Ok(())
    }

    /// Queues `cmd` and, when the queue held nothing else and no other thread drives, runs it
    /// here. True if it ran and left nothing for the progress thread to handle.
    fn start_here(self: &Arc<Self>, cmd: Cmd) -> Result<bool> {
        let mine = self.enqueue(cmd)?;
        self.run_here(mine)
    }

    /// Runs this caller's commands here when the queue held nothing else as it queued them
    /// (`mine`: up to which number they go, see [`Shared::enqueue_all`]) and no other thread
    /// drives. Only its own: what other threads queue meanwhile (a `ForceClose`, a `Connect`,
    /// a command whose end runs the sink) is the progress thread's, which their submitters woke;
    /// run here it would hold this caller, which may hold its own locks, for as long as it takes
    /// (and a sink run here could take a lock this caller holds). True if its commands ran and
    /// left nothing for the progress thread.
    fn run_here(self: &Arc<Self>, mine: Option<u64>) -> Result<bool> {
        let Some(end) = mine else {
            return Ok(false);
        };
        if self.poll_window.is_zero() {
            return Ok(false);
        }
        let Some(mut guard) = self.driver.try_lock() else {
            return Ok(false);
        };
        let Some(p) = guard.as_mut() else {
            return Ok(false);
        };
        callbacks::entered(self, || p.drain_to(end));
        // Whatever the commands left for a pass (callback reports) or ended (a shutdown) is
        // the progress thread's to handle.
        let more = p.shutdown || !self.cb_events.lock().is_empty();
        Ok(!more)
    }

    /// [`Shared::submit`] for an op nobody waits on (a control message, a receive whose end is
    /// an event): from inside this agent's sink, only queued, since the pass drains the queue
    /// as soon as the sink returns; from any other thread, started right here when
    /// [`Shared::submit_now`] may. The progress thread is woken only if the op still needs a
    /// pass: it could not start here, or it ended at once and its end is an event for the sink,
    /// or it is a send that UCX queued (it needs progress no caller gives). A posted receive
    /// needs none until its data arrives, which is an event on the worker that wakes the
    /// thread. Saves a caller an eventfd write and a wake-up per control message and receive.
    pub(super) fn submit_unwaited(self: &Arc<Self>, cmd: Cmd, slot: &OpSlot) -> Result<()> {
        self.submit_unwaited_all(std::iter::once(cmd), || {
            let ended = slot.state.lock().is_some();
            let receive = !slot.send && !slot.control;
            (ended && slot.notify) || (!ended && !receive)
        })
    }

    /// [`Shared::submit_unwaited`] for a [`Cmd::Post`]: there is no op to look at, so the
    /// progress thread is woken when the message could not start here or UCX holds a send
    /// queued (this one or an earlier one).
    pub(super) fn submit_post(self: &Arc<Self>, cmd: Cmd) -> Result<()> {
        self.submit_unwaited_all(std::iter::once(cmd), || self.internal_queued_any())
    }

    /// What [`Shared::submit_unwaited`] does, for commands queued together in their order (no
    /// pass runs between them): `needs_pass`, asked once they ran here, says whether what they
    /// started still needs a pass of the progress thread.
    pub(super) fn submit_unwaited_all(
        self: &Arc<Self>,
        cmds: impl IntoIterator<Item = Cmd>,
        needs_pass: impl FnOnce() -> bool,
    ) -> Result<()> {
        let mine = self.enqueue_all(cmds)?;
        if callbacks::in_sink_of(self) {
            return Ok(());
        }
        if !self.run_here(mine)? {
            self.nudge();
        } else if needs_pass() {
            self.owe_pass();
        }
        Ok(())
    }

    /// What a caller started here needs one more pass of the progress thread: not queued work,
    /// but a send UCX holds, or an end the sink must see. Woken only if it sleeps: an awake
    /// thread sees the debt before it sleeps ([`Shared::about_to_sleep`]) and runs that pass.
    /// Writing the eventfd to a thread that is awake anyway cost a system call per request
    /// (4 KiB requests over shared memory, 4096 in flight: 25-41k writes per 106k requests,
    /// where the thread was asleep for none of them).
    pub(super) fn owe_pass(&self) {
        self.owed.fetch_add(1, Ordering::SeqCst);
        self.nudge();
    }

    /// Whether UCX holds a send nobody waits on queued (see `internal_queued`).
    pub(super) fn internal_queued_any(&self) -> bool {
        self.internal_queued.load(Ordering::Acquire) != 0
    }

    /// UCX holds the send `request` to `peer` queued: its bytes stay here until it ends
    /// ([`Shared::held_send_ended`]).
    pub(super) fn hold_send(&self, request: usize, peer: u64, bytes: Vec<u8>, voice: Voice) {
        self.queued_msgs
            .lock()
            .insert(request, (peer, bytes, voice));
    }

    /// The held send `request` has ended (UCX's callback): its bytes go, and it is counted out.
    /// Returns its peer.
    pub(super) fn held_send_ended(&self, request: usize) -> Option<u64> {
        let held = self.queued_msgs.lock().remove(&request);
        self.internal_sent();
        held.map(|(peer, _bytes, _voice)| peer)
    }

    /// The worker that held sends queued is gone, and they with it: none is counted, and their
    /// bytes may go.
    pub(super) fn forget_held_sends(&self) {
        self.internal_queued.store(0, Ordering::Release);
        self.queued_msgs.lock().clear();
    }

    /// One send counted in `internal_queued` has ended. Never below zero: a stray decrement
    /// must not wrap the count into "always pending" (this runs in UCX callbacks, where nothing
    /// may panic, so it saturates rather than asserts).
    pub(super) fn internal_sent(&self) {
        let _ = self
            .internal_queued
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
    }

    /// Queues `cmd` ([`Shared::enqueue_all`]).
    fn enqueue(&self, cmd: Cmd) -> Result<Option<u64>> {
        self.enqueue_all(std::iter::once(cmd))
    }

    /// Queues `cmds` in their order under one lock (no pass takes the queue between them). When
    /// the queue held nothing else, the number just past the last of them (see
    /// [`CmdQueue::taken`]); None otherwise.
    pub(super) fn enqueue_all(&self, cmds: impl IntoIterator<Item = Cmd>) -> Result<Option<u64>> {
        let mut q = self.cmds.lock();
        let alone = q.items.is_empty();
        let stopping = self.stopping.load(Ordering::Acquire);
        let mut refused = Vec::new();
        for cmd in cmds {
            if q.closed || (stopping && !matches!(cmd, Cmd::Shutdown)) {
                refused.push(cmd);
            } else {
                q.items.push_back(cmd);
            }
        }
        if !q.items.is_empty() {
            self.cmds_queued.store(true, Ordering::Release);
        }
        let end = q.taken + q.items.len() as u64;
        drop(q);
        if refused.is_empty() {
            return Ok(alone.then_some(end));
        }
        // Whatever waits on these commands learns now: no slot or reply is left pending.
        for cmd in refused {
            self.fail_cmd(cmd);
        }
        Err(Error::new(ErrorKind::Shutdown, "agent is shut down"))
    }

    /// Ends a command that will never run, so nobody waits on it.
    pub(super) fn fail_cmd(&self, cmd: Cmd) {
        let shutdown = || Error::new(ErrorKind::Shutdown, "agent is shut down");
        match cmd {
            Cmd::Tag { slot, .. } | Cmd::Control { slot, .. } | Cmd::Rma { slot, .. } => {
                let _ = slot.stop_reason.compare_exchange(
                    STOP_NONE,
                    STOP_SHUTDOWN,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                );
                finish_slot(self, &slot, sys::UCS_ERR_CANCELED, 0);
            }
            Cmd::Connect(_, r) | Cmd::ConnectWorker(_, r) => r.set(Err(shutdown())),
            Cmd::Map { reply, .. } => reply.set(Err(shutdown())),
            Cmd::UnpackRkey { reply, .. } => reply.set(Err(shutdown())),
            Cmd::PeerTransports(_, r) => r.set(Err(shutdown())),
            Cmd::ForceClose(_, Some(r)) => r.set(Ok(())),
            Cmd::ForceClose(_, None)
            | Cmd::Post { .. }
            | Cmd::CancelOp { .. }
            | Cmd::Unmap(_)
            | Cmd::DestroyRkey(_)
            | Cmd::FaultStuck
            | Cmd::Shutdown => {}
            Cmd::FaultStall { armed, .. } => armed.set(Err(shutdown())),
        }
    }

    /// The progress thread is about to run a pass: every pass owed so far is paid by it.
    pub(super) fn pass_begins(&self) {
        self.owed_seen
            .store(self.owed.load(Ordering::SeqCst), Ordering::Relaxed);
    }

    /// Wakes the progress thread for work queued for it (commands, callback reports) only if it
    /// may be asleep. An awake thread looks at those queues again after it says it sleeps
    /// ([`Shared::about_to_sleep`]), so nothing is left behind; a busy thread (under load it
    /// runs pass after pass) is spared an eventfd write, and the spurious return of its next
    /// sleep and the read after it, per command.
    pub(super) fn nudge(&self) {
        // Against the thread's store and look in `about_to_sleep`: either it sees our queued
        // work, or we see that it sleeps (and the eventfd keeps the wake-up until it does).
        std::sync::atomic::fence(Ordering::SeqCst);
        if self.sleeping_until_ns.load(Ordering::Relaxed) != 0 {
            self.wake();
        }
    }

    /// The progress thread is about to sleep until `until_ns` (ns since `epoch`): says so, then
    /// looks once more at what [`Shared::nudge`] leaves to it. True to sleep; false (and
    /// awake again) if work came. Called under the driver lock, so a command that a caller runs
    /// itself (a shutdown included) either came before the thread's last pass or sees it asleep.
    pub(super) fn about_to_sleep(&self, until_ns: u64) -> bool {
        self.sleeping_until_ns
            .store(until_ns.max(1), Ordering::SeqCst);
        std::sync::atomic::fence(Ordering::SeqCst);
        let new_debt = self.owed.load(Ordering::SeqCst) != self.owed_seen.load(Ordering::Relaxed);
        if new_debt || self.cmds_pending() || !self.cb_events.lock().is_empty() {
            self.sleeping_until_ns.store(0, Ordering::Release);
            return false;
        }
        true
    }

    /// Consumes the wake-ups the eventfd holds (after a sleep on it ended because it fired).
    pub(super) fn take_wake(&self) {
        let mut buf = 0u64;
        // SAFETY: wake_fd is an eventfd that lives as long as `self`; reading 8 bytes into a
        // u64 is the eventfd protocol (non-blocking: nothing to take is EAGAIN, ignored).
        unsafe {
            libc::read(
                std::os::fd::AsRawFd::as_raw_fd(&self.wake_fd),
                &mut buf as *mut u64 as *mut c_void,
                8,
            )
        };
    }

    /// Wakes the progress thread (the eventfd it sleeps on).
    pub(super) fn wake(&self) {
        let one: u64 = 1;
        // SAFETY: wake_fd is an eventfd that lives as long as `self`; writing 8 bytes
        // from a valid u64 is the eventfd protocol.
        unsafe {
            libc::write(
                std::os::fd::AsRawFd::as_raw_fd(&self.wake_fd),
                &one as *const u64 as *const c_void,
                8,
            )
        };
    }

    pub(super) fn push_event(&self, ev: Event) {
        self.events.lock().push_back(ev);
        self.events_cv.notify_all();
    }

    /// Whether `peer` has failed; None if no peer ever had that id.
    pub(super) fn peer_failed(&self, peer: PeerId) -> Option<bool> {
        if self.live_peers.lock().contains(&peer) {
            return Some(false);
        }
        self.was_peer(peer).then_some(true)
    }

    /// Was `peer` ever handed out as a peer's id (live or failed)?
    pub(super) fn was_peer(&self, peer: PeerId) -> bool {
        peer.0 >= 1 && peer.0 < self.next_peer.load(Ordering::Acquire)
    }

    pub(super) fn now_ns(&self) -> u64 {
        self.epoch.elapsed().as_nanos() as u64
    }

    pub(super) fn note_progress(&self) {
        self.note_progress_at(Instant::now());
    }

    /// `at` in nanoseconds since `epoch`: 0 before it, and a time past 584 years from it (a
    /// timer set "forever") taken as `u64::MAX - 1`, never done, where a wrapped cast would
    /// land in the past and make the sink due on every pass. `u64::MAX` stays the sink's
    /// "delivering" mark.
    pub(super) fn ns_at(&self, at: Instant) -> u64 {
        let ns = at.saturating_duration_since(self.epoch).as_nanos();
        u64::try_from(ns).map_or(u64::MAX - 1, |n| n.min(u64::MAX - 1))
    }

    /// [`Shared::note_progress`] with the caller's clock read.
    pub(super) fn note_progress_at(&self, now: Instant) {
        let ns = self.ns_at(now);
        self.last_progress_ns.store(ns, Ordering::Release);
    }

    /// Over tcp (the kernel copies every byte), whether [`BULK_IN_FLIGHT_BYTES`] or more are
    /// in flight on this agent: then no waiting caller polls ([`Driving::for_transfer`]).
    pub(super) fn bulk_in_flight(&self) -> bool {
        self.kernel_copies && self.in_flight_bytes.load(Ordering::Relaxed) >= BULK_IN_FLIGHT_BYTES
    }

    /// Whether a caller that began waiting at `since` should drive progress rather than sleep:
    /// within the poll window of the later of `since` and the last progress. An idle wait
    /// polls for one window, then sleeps.
    pub(super) fn may_poll(&self, since: Instant, now: Instant) -> bool {
        if self.poll_window.is_zero() {
            return false;
        }
        let last = self.epoch + Duration::from_nanos(self.last_progress_ns.load(Ordering::Acquire));
        now.saturating_duration_since(since.max(last)) < self.poll_window
    }

    /// Runs one progress pass on the calling thread, if no other thread holds the driver lock
    /// (it never waits for it). Returns whether the pass ran. The caller must hold no lock that
    /// the owner's sink takes: the sink runs in the pass.
    pub(super) fn try_drive(self: &Arc<Self>) -> bool {
        // The progress thread holds the lock only for a pass: a few yields usually get it. A
        // caller that is driving already wakes us when our fact changes.
        let mut tries = 0;
        let got = loop {
            match self.driver.try_lock() {
                Some(g) => break Some(g),
                None if tries < 3 => {
                    tries += 1;
                    std::thread::yield_now();
                }
                None => break None,
            }
        };
        let Some(mut guard) = got.or_else(|| self.spin_for_driver()) else {
            return false;
        };
        let Some(p) = guard.as_mut() else {
            return false;
        };
        callbacks::entered(self, || p.pass());
        drop(guard);
        self.caller_passes.fetch_add(1, Ordering::AcqRel);
        // A timer the sink set in our pass, earlier than the progress thread's sleep, must not
        // be slept through: wake it to sleep again with the new time.
        let sleeping = self.sleeping_until_ns.load(Ordering::Acquire);
        if sleeping != 0 && self.sink_due_ns.load(Ordering::Acquire) < sleeping {
            self.wake();
        }
        true
    }

    /// Where another CPU may run the progress thread meanwhile: spins up to `drive_spin` for the
    /// driver lock, the progress thread told to let go of it (`spinning`). On a core of its own
    /// a caller that sleeps instead is woken from another core when its completion comes, and
    /// such a wake-up costs tens of µs on a virtual machine whose idle CPUs halt: on a 16-CPU
    /// host, each process on 8 of them, whole 4 KiB requests one at a time took 33-57 µs over
    /// shared memory, against 9-10 µs with each process on one CPU (README, "Callers drive
    /// progress").
    fn spin_for_driver(&self) -> Option<parking_lot::MutexGuard<'_, Option<Box<Progress>>>> {
        if self.drive_spin.is_zero() {
            return None;
        }
        self.spinning.fetch_add(1, Ordering::AcqRel);
        let until = Instant::now() + self.drive_spin;
        let got = loop {
            for _ in 0..64 {
                std::hint::spin_loop();
            }
            if let Some(g) = self.driver.try_lock() {
                break Some(g);
            }
            if Instant::now() >= until {
                break None;
            }
        };
        self.spinning.fetch_sub(1, Ordering::AcqRel);
        got
    }

    /// A caller stopped driving: if the progress thread sleeps, wake it, so it runs a pass and
    /// arms the worker over what our passes left (work UCX deferred to a later progress call
    /// raises no event of its own).
    pub(super) fn done_driving(&self) {
        if self.sleeping_until_ns.load(Ordering::Acquire) != 0 {
            self.wake();
        }
    }

    /// Puts a new op in `in_flight` and counts its bytes (a data transfer's). Counted first: a
    /// teardown may finish (and uncount) it as soon as it is in the map.
    pub(super) fn track_op(&self, slot: &Arc<OpSlot>) {
        if !slot.control {
            slot.bytes_counted.store(true, Ordering::Release);
            self.in_flight_bytes
                .fetch_add(slot.expected_len, Ordering::Relaxed);
        }
        self.in_flight.lock().insert(slot);
    }

    /// Takes an ending op out of `in_flight`, and its bytes off the count.
    pub(super) fn untrack_op(&self, slot: &OpSlot) {
        self.in_flight.lock().remove(slot);
        self.uncount_bytes(slot);
    }

    /// Takes an op's bytes off the count, once however often it is called (its end, and a stop
    /// that gave up on UCX, may both).
    pub(super) fn uncount_bytes(&self, slot: &OpSlot) {
        if slot.bytes_counted.swap(false, Ordering::AcqRel) {
            self.in_flight_bytes
                .fetch_sub(slot.expected_len, Ordering::Relaxed);
        }
    }

    pub(super) fn cmds_pending(&self) -> bool {
        !self.cmds.lock().items.is_empty()
    }

    /// [`Shared::cmds_pending`] without the lock, for a pass's hot path: may say true of a
    /// queue that was just emptied (see `cmds_queued`).
    pub(super) fn cmds_maybe_pending(&self) -> bool {
        self.cmds_queued.load(Ordering::Acquire)
    }
}

/// The ops in flight, for the sweeps that must reach each of them (a failed peer's, a drain's,
/// the shutdown's, the stats'): a slab, so that tracking and untracking an op, twice per
/// transfer, costs an index and no hashing. An op knows its index (`OpSlot::tracked_at`).
#[derive(Default)]
pub(super) struct InFlight {
    slots: Vec<Option<Weak<OpSlot>>>,
    free: Vec<u32>,
}

impl InFlight {
    pub(super) fn insert(&mut self, slot: &Arc<OpSlot>) {
        let w = Some(Arc::downgrade(slot));
        let i = match self.free.pop() {
            Some(i) => {
                self.slots[i as usize] = w;
                i
            }
            None => {
                self.slots.push(w);
                (self.slots.len() - 1) as u32
            }
        };
        slot.tracked_at.store(i, Ordering::Relaxed);
    }

    /// Takes `slot` out, if it is in (removing twice, or an op never tracked, does nothing).
    pub(super) fn remove(&mut self, slot: &OpSlot) {
        let i = slot.tracked_at.swap(NOT_TRACKED, Ordering::Relaxed);
        let Some(e) = self.slots.get_mut(i as usize) else {
            return;
        };
        if e.as_ref().is_some_and(|w| std::ptr::eq(w.as_ptr(), slot)) {
            *e = None;
            self.free.push(i);
        }
    }

    /// The op `id` at index `at`, if it is still there and alive.
    pub(super) fn get(&self, at: u32, id: u64) -> Option<Arc<OpSlot>> {
        self.slots
            .get(at as usize)?
            .as_ref()?
            .upgrade()
            .filter(|s| s.id == id)
    }

    /// Every op in flight that is still alive.
    pub(super) fn upgraded(&self) -> impl Iterator<Item = Arc<OpSlot>> + '_ {
        self.slots.iter().flatten().filter_map(Weak::upgrade)
    }

    /// Ops tracked.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.slots.len() - self.free.len()
    }

    #[cfg(test)]
    pub(super) fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// When a waiter next calls its cancel check: while it polls, every [`CANCEL_POLL`]; once it
/// sleeps (at most [`CANCEL_POLL`] at a time), at every wake. The first check is due at once,
/// and costs no clock read of its own.
#[derive(Default)]
pub(crate) struct CancelPace(Option<Instant>);

/// How often a waiter that polls calls its cancel check, and the longest it sleeps between
/// checks.
pub(crate) const CANCEL_POLL: Duration = Duration::from_millis(5);

impl CancelPace {
    /// Whether the check is due at `now` (this step's clock read); if so, the next one is
    /// counted from it.
    pub(crate) fn due(&mut self, now: Instant, polling: bool) -> bool {
        let due = !polling || self.0.is_none_or(|t| now >= t);
        if due {
            self.0 = Some(now + CANCEL_POLL);
        }
        due
    }
}

/// How long a caller spins for the driver lock ([`Shared::try_drive`]): 50 µs where this
/// process may run on [`SPIN_CPUS`] CPUs or more, none on fewer (`KVLINK_DRIVE_SPIN_US`
/// overrides it; 0 turns spinning off; a value that is not a whole number of microseconds is an
/// `InvalidArgument` naming it). Read once, when the agent starts. Not on one CPU, where
/// the spin would take the CPU from the thread that holds the lock, and not on two or three,
/// where a process pair on one host (this project's test machines, two CPUs) would take each
/// other's: there the threads of a process mostly share a core, and a wake-up is cheap.
fn drive_spin() -> Result<Duration> {
    Ok(spin_for(
        env_micros("KVLINK_DRIVE_SPIN_US")?,
        std::thread::available_parallelism().map_or(1, |n| n.get()),
    ))
}

/// [`drive_spin`] for the environment's value `env` and `cpus` CPUs.
fn spin_for(env: Option<Duration>, cpus: usize) -> Duration {
    match env {
        Some(d) => d,
        None if cpus >= SPIN_CPUS => DRIVE_SPIN,
        None => Duration::ZERO,
    }
}

/// A duration in whole microseconds from the environment variable `var`: None when it is unset.
/// Anything else than a whole number (spaces around it aside) is an `InvalidArgument` naming the
/// variable, not the default in silence: an operator's `KVLINK_POLL_US=100us` must not run as if
/// it had not been set.
pub(super) fn env_micros(var: &str) -> Result<Option<Duration>> {
    parse_micros(var, std::env::var_os(var).as_deref())
}

/// [`env_micros`] for the value `value` of `var`.
fn parse_micros(var: &str, value: Option<&std::ffi::OsStr>) -> Result<Option<Duration>> {
    let Some(v) = value else { return Ok(None) };
    v.to_str()
        .and_then(|s| s.trim().parse::<u64>().ok())
        .map(|us| Some(Duration::from_micros(us)))
        .ok_or_else(|| {
            Error::invalid(format!(
                "{var}={v:?} is not a whole number of microseconds (0 turns it off)"
            ))
        })
}

/// See [`drive_spin`].
const DRIVE_SPIN: Duration = Duration::from_micros(50);
/// See [`drive_spin`].
const SPIN_CPUS: usize = 4;

/// A waiting caller's turn at driving progress (`Shared::try_drive`). When it stops (paused
/// before a sleep, or dropped), the progress thread takes over (`Shared::done_driving`).
pub struct Driving<'a> {
    shared: &'a Arc<Shared>,
    began: Instant,
    /// A sleeping progress thread must be woken when this wait stops driving: it drove, or it
    /// is a bulk wait for an op its caller may have started itself (see
    /// [`Driving::for_transfer`]).
    owes_wake: bool,
    /// The wait is for a bulk transfer, or (tcp) among bulk transfers: it never drives (see
    /// [`Driving::for_transfer`]).
    bulk: bool,
}

/// A wait for a transfer of at least this many bytes, or (tcp) among at least this many bytes
/// of transfers in flight, leaves progress to the progress thread instead of polling beside it
/// ([`Driving::for_transfer`]).
pub(super) const BULK_WAIT_BYTES: usize = 4 << 20;
/// Over tcp, how many bytes of transfers in flight on an agent make every wait leave progress
/// to the progress thread ([`Shared::bulk_in_flight`]): two transfers of 1 MiB. With 4 MiB
/// (as for one transfer), a context side's sender threads, each waiting on one 1 MiB send
/// among three or fewer, polled and took turns with the progress thread at the socket. Whole
/// 1 MiB requests eight in flight (`kvlink-bench peer` pairs, 64 rounds), 4 MiB against 2 MiB,
/// twelve alternated pairs in a slow hour, GB/s: 1.61 / 1.55 / 1.55 / 1.64 / 1.88 / 1.57 /
/// 1.64 / 1.75 / 1.84 / 1.89 / 1.67 / 2.07 against 1.79 / 1.73 / 1.64 / 2.05 / 1.83 / 2.05 /
/// 1.95 / 1.90 / 1.83 / 1.69 / 1.70 / 2.35 (nine better). One 1 MiB transfer alone is still
/// polled for.
pub(super) const BULK_IN_FLIGHT_BYTES: usize = 2 << 20;

impl<'a> Driving<'a> {
    pub(super) fn new(shared: &'a Arc<Shared>) -> Self {
        Driving {
            shared,
            began: Instant::now(),
            owes_wake: false,
            bulk: false,
        }
    }

    /// For a wait on one transfer of `len` bytes. The caller does not drive when that transfer
    /// comes to [`BULK_WAIT_BYTES`] or more, nor, over tcp, when everything in flight on this agent
    /// (the transfer included; posted receives count even before their data moves) comes to
    /// [`BULK_IN_FLIGHT_BYTES`]: such transfers keep the progress thread busy for milliseconds, the
    /// end of ours is reported a wake-up later (tens of µs), and a caller polling beside that
    /// thread competes with it, and with the kernel's copies, for the cores. Measured on two cores:
    /// tcp, one 64 MiB transfer at a time, 1.71 GB/s polling, 1.92 not (eight alternated pairs,
    /// seven better); tcp, whole 1 MiB requests eight in flight, 1.79 -> 2.06 GB/s (ten pairs,
    /// seven better). Over shared memory the copies of transfers in flight run in the passes of
    /// whoever drives, and a waiting caller that drives ends its wait without a wake-up: the same
    /// eight in flight there were slower without polling (6.56 -> 5.33 GB/s, twelve pairs, nine
    /// slower). One 1 MiB transfer alone is polled for on every transport: its wake-up is a large
    /// part of it.
    ///
    /// A bulk wait for a small transfer wakes a sleeping progress thread before its first
    /// sleep, as a caller that stops driving does: its caller may have started the op itself
    /// ([`Shared::submit_now`]), expecting to drive it. A larger one was handed to the
    /// progress thread when it was posted.
    pub(super) fn for_transfer(shared: &'a Arc<Shared>, len: usize) -> Self {
        let bulk = len >= BULK_WAIT_BYTES || shared.bulk_in_flight();
        Driving {
            bulk,
            owes_wake: bulk && (1..=DIRECT_POST_MAX).contains(&len),
            ..Driving::new(shared)
        }
    }

    /// Runs one pass here if the wait is within the poll window and no other thread drives;
    /// true if it ran (look at what you wait for again). False means: sleep, and be woken.
    /// `now` is the waiter's own clock read of this step: a polling caller reads the clock
    /// once a step (a read costs about 28 ns on this project's machines, as much as an idle
    /// `ucp_worker_progress`).
    pub fn step(&mut self, now: Instant) -> bool {
        if self.wants_to_drive(now) && self.shared.try_drive() {
            self.owes_wake = true;
            return true;
        }
        self.pause();
        false
    }

    /// Whether this wait would drive now: not for a bulk transfer, nor (tcp) while bulk
    /// transfers are in flight, else within the window. The second is looked at on every
    /// step: a wait that began with nothing in flight (a sender thread in
    /// `next_advertisement`) would otherwise poll through a whole bulk transfer that starts
    /// meanwhile, since that transfer's progress keeps the window open. Context side, whole
    /// requests one at a time over tcp, sender threads not polling at all against the code
    /// before (four alternated pairs each): 16 MiB 5.6 against 4.8 GB/s, 64 MiB 5.2 against
    /// 4.6.
    fn wants_to_drive(&self, now: Instant) -> bool {
        !self.bulk && !self.shared.bulk_in_flight() && self.shared.may_poll(self.began, now)
    }

    /// Hands progress back to the progress thread (before this caller sleeps).
    fn pause(&mut self) {
        if std::mem::take(&mut self.owes_wake) {
            self.shared.done_driving();
        }
    }
}

impl Drop for Driving<'_> {
    fn drop(&mut self) {
        self.pause();
    }
}

#[cfg(test)]
mod tests {
    use super::super::op::SlotKind;
    use super::*;
    use std::os::fd::AsRawFd;

    /// Callers spin for the driver lock only where the process has four CPUs or more, unless
    /// the environment says otherwise (a value that is not a number is ignored).
    #[test]
    fn callers_spin_for_the_driver_only_on_four_cpus_or_more() {
        let env = |v: &str| parse_micros("KVLINK_DRIVE_SPIN_US", Some(v.as_ref()));
        assert_eq!(spin_for(None, 1), Duration::ZERO);
        assert_eq!(spin_for(None, 2), Duration::ZERO, "a two-CPU test machine");
        assert_eq!(spin_for(None, 3), Duration::ZERO);
        assert_eq!(spin_for(None, 4), DRIVE_SPIN);
        assert_eq!(spin_for(None, 8), DRIVE_SPIN);
        assert_eq!(spin_for(env("0").unwrap(), 8), Duration::ZERO, "turned off");
        assert_eq!(spin_for(env(" 20 ").unwrap(), 1), Duration::from_micros(20));
        for bad in ["lots", "50us", "-1", ""] {
            let e = env(bad).unwrap_err();
            assert_eq!(e.kind, ErrorKind::InvalidArgument, "{bad:?}");
            assert!(e.message.contains("KVLINK_DRIVE_SPIN_US"), "{}", e.message);
        }
    }

    /// The shared state alone: no progress thread, so the tests play it.
    fn shared() -> Arc<Shared> {
        Shared::new(&AgentOptions::new("wake-test", TransportKind::Tcp), 1).unwrap()
    }

    #[test]
    fn a_wait_for_one_bulk_transfer_leaves_progress_to_the_progress_thread() {
        let sh = shared();
        sh.note_progress();
        assert!(
            Driving::new(&sh).wants_to_drive(Instant::now()),
            "within the window, a wait polls"
        );
        // A transfer's own bytes count as in flight (`track_op`): over tcp one of 1 MiB alone
        // is polled for, one of 2 MiB is not; over shared memory only the bulk size counts.
        let alone = |len: usize| {
            sh.in_flight_bytes.store(len, Ordering::Relaxed);
            Driving::for_transfer(&sh, len).wants_to_drive(Instant::now())
        };
        assert!(alone(1 << 20), "one 1 MiB transfer alone is polled for");
        assert!(
            !alone(BULK_IN_FLIGHT_BYTES),
            "over tcp, one of 2 MiB is not"
        );
        let sm = Shared::new(&AgentOptions::new("sm", TransportKind::SharedMemory), 1).unwrap();
        sm.note_progress();
        sm.in_flight_bytes
            .store(BULK_WAIT_BYTES - 1, Ordering::Relaxed);
        assert!(
            Driving::for_transfer(&sm, BULK_WAIT_BYTES - 1).wants_to_drive(Instant::now()),
            "over shared memory, a transfer under the bulk size is polled for"
        );
        sh.in_flight_bytes.store(0, Ordering::Relaxed);
        let mut bulk = Driving::for_transfer(&sh, BULK_WAIT_BYTES);
        assert!(
            !bulk.wants_to_drive(Instant::now()),
            "a bulk transfer is not"
        );
        assert!(!bulk.step(Instant::now()), "its step says: sleep");
        assert!(!Driving::for_transfer(&sh, usize::MAX).wants_to_drive(Instant::now()));
    }

    #[test]
    fn an_ops_bytes_leave_the_count_once_whether_it_ends_or_is_given_up_first() {
        let sh = shared();
        let slot = |id, kind| OpSlot::new(id, PeerId(1), 1 << 20, id, kind, false);
        let (a, b, c) = (
            slot(1, SlotKind::Send),
            slot(2, SlotKind::Recv),
            slot(3, SlotKind::Control),
        );
        for s in [&a, &b, &c] {
            sh.track_op(s);
        }
        assert_eq!(
            sh.in_flight_bytes.load(Ordering::Relaxed),
            2 << 20,
            "data ops only"
        );
        assert!(sh.bulk_in_flight());
        // `a` ends; `b` is given up on (unreaped) and UCX lets it go later.
        sh.untrack_op(&a);
        sh.untrack_op(&a);
        sh.uncount_bytes(&b);
        assert_eq!(sh.in_flight_bytes.load(Ordering::Relaxed), 0);
        assert!(
            !sh.bulk_in_flight(),
            "an unreaped op does not keep waits from polling"
        );
        assert_eq!(
            sh.in_flight.lock().len(),
            2,
            "b is still UCX's, and the control op"
        );
        sh.untrack_op(&b);
        sh.untrack_op(&c);
        assert_eq!(
            sh.in_flight_bytes.load(Ordering::Relaxed),
            0,
            "nothing taken off twice"
        );
        assert!(sh.in_flight.lock().is_empty());
    }

    /// The in-flight slab reuses the index of an op that ended; a cancel or a second untrack
    /// aimed at the ended op does not reach the op that took its index.
    #[test]
    fn an_index_taken_by_a_new_op_is_not_reached_through_the_old_one() {
        let sh = shared();
        let slot = |id| OpSlot::new(id, PeerId(1), 64, id, SlotKind::Recv, false);
        let (a, b) = (slot(1), slot(2));
        sh.track_op(&a);
        let cancel_a = a.cancel_cmd();
        let Cmd::CancelOp { id, at } = cancel_a else {
            panic!("not a cancel")
        };
        assert_eq!(sh.in_flight.lock().get(at, id).map(|s| s.id), Some(1));
        sh.untrack_op(&a);
        sh.track_op(&b);
        assert_eq!(b.tracked_at.load(Ordering::Relaxed), at, "b took a's index");
        assert!(
            sh.in_flight.lock().get(at, id).is_none(),
            "a's cancel finds nothing"
        );
        sh.untrack_op(&a);
        assert_eq!(sh.in_flight.lock().len(), 1, "b is still tracked");
        assert_eq!(
            sh.in_flight
                .lock()
                .upgraded()
                .map(|s| s.id)
                .collect::<Vec<_>>(),
            vec![2]
        );
        drop(b);
        assert_eq!(
            sh.in_flight.lock().upgraded().count(),
            0,
            "a dropped op is skipped"
        );
    }

    #[test]
    fn a_wait_among_bulk_transfers_in_flight_leaves_progress_to_the_progress_thread() {
        let sh = shared();
        sh.note_progress();
        let in_flight = |n| sh.in_flight_bytes.store(n, Ordering::Relaxed);
        in_flight(BULK_IN_FLIGHT_BYTES - 4096);
        assert!(
            Driving::for_transfer(&sh, 4096).wants_to_drive(Instant::now()),
            "under the bulk size in all, a wait polls"
        );
        in_flight(BULK_IN_FLIGHT_BYTES);
        let mut among = Driving::for_transfer(&sh, 4096);
        assert!(
            !among.wants_to_drive(Instant::now()),
            "among bulk transfers, it does not"
        );
        // It wakes a sleeping progress thread before its first sleep (it may have started its
        // op itself, expecting to drive it), and only then.
        assert!(sh.about_to_sleep(sh.now_ns() + 1_000_000));
        assert!(!among.step(Instant::now()), "its step says: sleep");
        assert!(woken(&sh, 0), "the sleeping progress thread is woken");
        assert!(!among.step(Instant::now()));
        assert!(!woken(&sh, 0), "once");
        // A larger transfer was handed to the progress thread when it was posted: no wake.
        let mut large = Driving::for_transfer(&sh, DIRECT_POST_MAX + 1);
        assert!(!large.step(Instant::now()));
        assert!(!woken(&sh, 0), "a large transfer's bulk wait wakes nobody");
        // A wait that began with little in flight stops polling once bulk transfers start,
        // and may poll again when they end.
        in_flight(0);
        let mut early = Driving::new(&sh);
        assert!(early.wants_to_drive(Instant::now()));
        in_flight(BULK_IN_FLIGHT_BYTES);
        assert!(
            !early.wants_to_drive(Instant::now()),
            "a bulk transfer started meanwhile"
        );
        assert!(!early.step(Instant::now()), "its step says: sleep");
        in_flight(0);
        sh.note_progress();
        assert!(
            early.wants_to_drive(Instant::now()),
            "the bulk transfer has ended"
        );
        // Over shared memory only a bulk transfer itself is left to the progress thread.
        let sm = Shared::new(&AgentOptions::new("sm", TransportKind::SharedMemory), 1).unwrap();
        sm.note_progress();
        sm.in_flight_bytes.store(BULK_WAIT_BYTES, Ordering::Relaxed);
        assert!(Driving::for_transfer(&sm, 4096).wants_to_drive(Instant::now()));
        assert!(!Driving::for_transfer(&sm, BULK_WAIT_BYTES).wants_to_drive(Instant::now()));
    }

    /// Waits up to `ms` for a wake-up on the eventfd, and takes it.
    fn woken(sh: &Shared, ms: i32) -> bool {
        let mut pfd = libc::pollfd {
            fd: sh.wake_fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one pollfd, ours; the eventfd lives as long as `sh`.
        let n = unsafe { libc::poll(&mut pfd, 1, ms) };
        if n > 0 {
            sh.take_wake();
        }
        n > 0
    }

    #[test]
    fn a_nudge_wakes_only_a_thread_that_said_it_sleeps() {
        let sh = shared();
        let later = || sh.now_ns() + 1_000_000;
        sh.nudge();
        assert!(!woken(&sh, 0), "an awake thread is not written to");
        assert!(sh.about_to_sleep(later()));
        sh.nudge();
        assert!(woken(&sh, 0), "a sleeping thread is woken");
        sh.sleeping_until_ns.store(0, Ordering::Release);
        // Work queued before the thread says it sleeps keeps it awake: commands, and the
        // reports of callbacks that ran on a caller's thread.
        sh.enqueue(Cmd::CancelOp {
            id: 7,
            at: NOT_TRACKED,
        })
        .unwrap();
        assert!(!sh.about_to_sleep(later()));
        assert_eq!(sh.sleeping_until_ns.load(Ordering::Acquire), 0);
        sh.cmds.lock().clear();
        sh.cb_events
            .lock()
            .push(CbEvent::EpError(1, sys::UCS_ERR_CANCELED));
        assert!(!sh.about_to_sleep(later()));
        sh.cb_events.lock().clear();
        assert!(sh.about_to_sleep(later()));
    }

    #[test]
    fn a_cancel_check_is_due_at_once_then_every_cancel_poll_while_polling_and_at_every_wake() {
        let mut pace = CancelPace::default();
        let t = Instant::now();
        assert!(pace.due(t, true), "the first check is due at once");
        assert!(
            !pace.due(t + CANCEL_POLL / 2, true),
            "not again within CANCEL_POLL"
        );
        assert!(pace.due(t + CANCEL_POLL, true), "due again after it");
        assert!(pace.due(t + CANCEL_POLL, false), "asleep: at every wake");
    }

    #[test]
    fn a_pass_owed_wakes_a_sleeping_thread_and_keeps_an_awake_one_up_for_one_pass() {
        let sh = shared();
        let later = || sh.now_ns() + 1_000_000;
        // Awake: no eventfd write, but its look before a sleep sees the debt.
        sh.owe_pass();
        assert!(!woken(&sh, 0), "an awake thread is not written to");
        assert!(!sh.about_to_sleep(later()), "the debt keeps it up");
        assert_eq!(sh.sleeping_until_ns.load(Ordering::Acquire), 0);
        assert!(!sh.about_to_sleep(later()), "until a pass pays it");
        sh.pass_begins();
        assert!(sh.about_to_sleep(later()), "after that pass it may sleep");
        // Asleep: woken; the pass it then runs pays the debt.
        sh.owe_pass();
        assert!(woken(&sh, 0), "a sleeping thread is woken");
        sh.sleeping_until_ns.store(0, Ordering::Release);
        sh.pass_begins();
        assert!(sh.about_to_sleep(later()));
        sh.sleeping_until_ns.store(0, Ordering::Release);
        // A debt that comes while a pass runs is not paid by it.
        sh.pass_begins();
        sh.owe_pass();
        assert!(!sh.about_to_sleep(later()));
    }

    /// The lost wake-up a nudge could cause, raced many times: a stand-in progress thread that
    /// takes the queue, works a little, and, whenever `about_to_sleep` lets it, sleeps on the
    /// eventfd alone; and a caller that queues a command and nudges as soon as the last one was
    /// taken, round after round. A wake-up lost leaves a command queued under a sleeper that
    /// nobody wakes: its sleep runs to the limit. Without the second look in `about_to_sleep`
    /// this fails within a few rounds.
    #[test]
    fn no_queued_command_is_left_to_a_sleeping_thread() {
        const ROUNDS: u64 = 20_000;
        const LIMIT_MS: i32 = 2_000;
        let sh = shared();
        let taken = Arc::new(AtomicU64::new(0));
        let sleeper = {
            let (sh, taken) = (sh.clone(), taken.clone());
            std::thread::spawn(move || {
                while taken.load(Ordering::Acquire) < ROUNDS {
                    let n = sh.cmds.lock().take_all().len();
                    if n > 0 {
                        taken.fetch_add(n as u64, Ordering::AcqRel);
                        continue;
                    }
                    // The real thread arms the worker here: a window in which a caller
                    // queues and nudges, seeing it awake (`taken` just moved, so it does).
                    let t = Instant::now();
                    while t.elapsed() < Duration::from_micros(3) {
                        std::hint::spin_loop();
                    }
                    if sh.about_to_sleep(u64::MAX) {
                        let ok = woken(&sh, LIMIT_MS);
                        sh.sleeping_until_ns.store(0, Ordering::Release);
                        if !ok {
                            return Err(taken.load(Ordering::Acquire));
                        }
                    }
                }
                Ok(())
            })
        };
        for i in 0..ROUNDS {
            sh.enqueue(Cmd::CancelOp {
                id: i,
                at: NOT_TRACKED,
            })
            .unwrap();
            sh.nudge();
            let until = Instant::now() + Duration::from_millis(2 * LIMIT_MS as u64);
            while taken.load(Ordering::Acquire) <= i && Instant::now() < until {
                std::thread::yield_now();
            }
            if taken.load(Ordering::Acquire) <= i {
                break;
            }
        }
        let r = sleeper.join().unwrap();
        assert_eq!(r, Ok(()), "a command sat queued under a sleeping thread");
    }
}
