//! The progress thread: it owns the UCX context and worker, runs the commands other threads
//! queue, drives `ucp_worker_progress` and handles what the callbacks report, sleeps on the
//! worker's event fd and the wake eventfd, and tears everything down in order at the end.
mod mover;
mod setup;

use super::callbacks::{self, CbEvent};
use super::handles::{Context, Listener, Mapped, RemoteKey as UcxRkey, Worker};
use super::op::{OpSlot, STOP_SHUTDOWN};
use super::peers::{PeerEntry, Target};
use super::probe::{Probe, Verdict};
use super::shared::{Cmd, Reply, Shared};
use super::{sys, AgentOptions, Event, PeerId, AM_CONTROL_ID};
use crate::error::{Error, ErrorKind, Result};
use crate::timeline::{self, Stage};
use foldhash::HashMap;
use mover::fail_held;
use std::collections::VecDeque;
use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::os::raw::c_int;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Progress calls per pass before commands are looked at again.
const PROGRESS_BURST: usize = 64;

/// How long the sink may go without a call when it has no timer of its own.
const SINK_IDLE: Duration = Duration::from_millis(100);

/// After a pass that made progress, keep polling this long before arming the worker and
/// sleeping: the next completion or command of a busy transfer usually comes within it, and a
/// sleep/wake round costs 50-120 us here (the project's toolchain notes, outside this repository). Idle threads never poll: the window
/// only follows progress. `KVLINK_POLL_US` overrides it (0 turns polling off).
const POLL_AFTER_PROGRESS: Duration = Duration::from_micros(100);

/// How long passes may find the worker unarmable (`UCS_ERR_BUSY`) with nothing to do before the
/// thread backs off. A busy arm normally means data arrived between the pass and the arm, and
/// the next pass takes it; on shared memory it also means a sender has claimed the queue's next
/// slot and not yet written it, which lasts as long as that sender is descheduled (a time
/// slice here is 4 ms), and the message must be taken as soon as it is written. Only one that
/// persists is a writer stopped or killed mid-write (docs/RELIABILITY.md): UCX
/// refuses to arm the worker for as long as that lasts.
const BUSY_SPIN_FOR: Duration = Duration::from_millis(20);
/// The longest back-off sleep while the worker stays unarmable: the wedged state is polled
/// (and commands are taken at once, through the wake eventfd) without spinning a core. Each
/// sleep is an eighth of how long the state has lasted, so a late write costs at most that.
const BUSY_SLEEP_MAX: Duration = Duration::from_millis(16);

/// The poll window: `KVLINK_POLL_US` when set (a value that is not a whole number of
/// microseconds is an `InvalidArgument` naming it), else [`POLL_AFTER_PROGRESS`].
pub(super) fn poll_window() -> Result<Duration> {
    Ok(super::shared::env_micros("KVLINK_POLL_US")?.unwrap_or(POLL_AFTER_PROGRESS))
}

/// The progress thread's state. Field order is drop order: UCX handles made from others are
/// declared (and so dropped) before what they were made from.
pub(super) struct Progress {
    /// The shared-memory receive-queue probe (None where no shared-memory lane is used).
    pub(super) probe: Option<Probe>,
    /// See [`AgentOptions::fail_peers_when_stuck`].
    pub(super) fail_when_stuck: bool,
    pub(super) rkeys: HashMap<u64, (u64, UcxRkey)>,
    pub(super) peers: HashMap<u64, PeerEntry>,
    pub(super) listener: Option<Listener>,
    pub(super) maps: HashMap<u64, Mapped>,
    pub(super) epfd: Option<std::os::fd::OwnedFd>,
    pub(super) worker: Worker,
    pub(super) ctx: Context,
    pub(super) ep_to_peer: HashMap<usize, u64>,
    /// The last id given to a memory map or a remote key (a count of its own).
    pub(super) next_handle: u64,
    pub(super) drains: Vec<Arc<OpSlot>>,
    pub(super) scratch: Box<[u8; 8]>,
    /// What a new worker is set up with when the agent moves to one (see
    /// [`Progress::renew_worker`]): the listener's bound address, whether to probe its
    /// shared-memory receive queue, the agent's name (for logs), and the worker's event fd as
    /// registered in the epoll set.
    pub(super) listen_at: Option<SocketAddr>,
    /// A listen at `listen_at` to retry after a move: when next, and the tries so far.
    pub(super) relisten: Option<(Instant, u32)>,
    /// Ids of remote keys dropped by a move (their endpoints went with the old worker).
    pub(super) lost_rkeys: std::collections::HashSet<u64>,
    pub(super) probe_wanted: bool,
    pub(super) name: String,
    pub(super) worker_efd: c_int,
    /// See [`AgentOptions::discard_unexpected`].
    pub(super) discard_unexpected: bool,
    pub(super) shared: Arc<Shared>,
    /// A `Shutdown` command was taken: the progress thread tears down next.
    pub(super) shutdown: bool,
    /// The callbacks' reports being handled now ([`Progress::handle_callbacks`]), where
    /// [`Progress::forget_endpoint`] can take out those naming an endpoint just destroyed;
    /// empty between batches, and then swapped in as the queue's emptied buffer.
    pub(super) cb_batch: VecDeque<CbEvent>,
    /// The emptied buffer of the events queue, swapped in when a pass takes its contents: a
    /// queue keeps its capacity, so no report allocates once the pair is warm.
    pub(super) ev_spare: VecDeque<Event>,
    /// Faults for tests ([`Agent::fault_stall_progress`](super::Agent::fault_stall_progress)):
    /// the progress thread sleeps this long after its next pass, holding the worker (so that no
    /// caller drives it meanwhile either); the next connect command stalls this long before it
    /// makes its endpoint.
    pub(super) stall: Option<(Duration, Arc<Reply<()>>)>,
    pub(super) connect_stall: Option<Duration>,
}

// SAFETY: the UCX handles in `Progress` are raw pointers into a worker created with
// `UCS_THREAD_MODE_SERIALIZED`; `Progress` lives in `Shared::driver` and is only ever touched
// by the thread holding that lock, one at a time, which is what that mode allows.
unsafe impl Send for Progress {}

/// What one [`Progress::pass`] did.
pub(super) struct Pass {
    /// Commands ran, or UCX or its callbacks reported work.
    pub(super) progressed: bool,
    /// The owner's sink was called (what it did must run before any sleep).
    pub(super) sink_ran: bool,
    /// The pass's clock read (after its UCX calls), for its caller too.
    pub(super) now: Instant,
}

pub(super) fn progress_thread(
    opts: AgentOptions,
    shared: Arc<Shared>,
    init: Arc<Reply<Option<SocketAddr>>>,
) {
    callbacks::set_shared(&shared);
    match Progress::start(&opts, shared.clone()) {
        Ok((p, listen)) => {
            *shared.driver.lock() = Some(Box::new(p));
            init.set(Ok(listen));
        }
        Err(e) => {
            init.set(Err(e));
            return;
        }
    }
    run(&shared);
    // Out of the driver lock first: no caller can drive a worker that is going away.
    let p = shared.driver.lock().take();
    if let Some(p) = p {
        callbacks::set_shared(&shared);
        (*p).teardown();
    }
}

/// The progress thread's loop: a pass under the driver lock, a short poll after progress, then
/// the worker armed and a bounded sleep on its event fd and the wake eventfd. The lock is never
/// held while asleep, so a waiting caller can drive progress itself meanwhile
/// ([`Shared::try_drive`]).
fn run(shared: &Shared) {
    let mut empty_streak = 0u32;
    let window = shared.poll_window;
    let mut last_progress = Instant::now();
    let mut seen_caller_passes = 0;
    let mut busy_since: Option<Instant> = None;
    loop {
        let mut guard = shared.driver.lock();
        let Some(p) = guard.as_mut() else { return };
        callbacks::set_shared(&p.shared);
        shared.pass_begins();
        let pass = p.pass();
        if p.shutdown {
            return;
        }
        if let Some((stall, armed)) = p.stall.take() {
            armed.set(Ok(()));
            std::thread::sleep(stall);
            continue;
        }
        if pass.progressed {
            empty_streak = 0;
            busy_since = None;
            last_progress = pass.now;
        }
        if pass.sink_ran || !shared.cb_events.lock().is_empty() {
            // What the sink did (control messages, cancels) runs before any sleep.
            continue;
        }
        let callers = shared.caller_passes.load(Ordering::Acquire);
        let caller_drives = std::mem::replace(&mut seen_caller_passes, callers) != callers;
        // A caller spinning for the lock (`Shared::spin_for_driver`) is let in: we sleep and it
        // drives, taking its completion on its own core.
        if !window.is_zero()
            && pass.now.saturating_duration_since(last_progress) < window
            && !caller_drives
            && shared.spinning.load(Ordering::Acquire) == 0
        {
            // Bounded: only within `window` of our last progress (a caller that drives polls
            // on its own; we do not compete with it).
            drop(guard);
            // Give the core to any thread that is ready to run (on a small machine the thread
            // we just woke, a peer's or our caller, is often queued on this very core): polling
            // is worth it only while the core would otherwise idle.
            std::thread::yield_now();
            continue;
        }
        // SAFETY: the worker is used only under the driver lock, which we hold.
        let st = unsafe { sys::ucp_worker_arm(p.worker.0) };
        if st == sys::UCS_ERR_BUSY {
            let busy_for = busy_since.get_or_insert_with(Instant::now).elapsed();
            if busy_for < BUSY_SPIN_FOR {
                // Data arrived since the pass, or (shared memory) a sender here claimed the
                // queue's next slot and has not written it yet: look again, but yield first,
                // so that the writer, or our caller driving the same worker, gets the core.
                drop(guard);
                std::thread::yield_now();
                continue;
            }
            // Unarmable and nothing found for a while (see BUSY_SPIN_FOR): sleep on the wake
            // eventfd alone, an eighth of that while, 2.5 up to 16 ms, never past the sink's
            // next timer.
            let nap = (busy_for / 8)
                .min(BUSY_SLEEP_MAX)
                .min(Duration::from_millis(p.sleep_ms().max(1) as u64));
            let asleep = shared.about_to_sleep(shared.now_ns() + nap.as_nanos() as u64);
            drop(guard);
            if asleep {
                back_off(shared, nap);
            }
            continue;
        }
        busy_since = None;
        // A bounded sleep: UCX keepalive needs progress now and then even when idle, and the
        // sink's next timer must not be slept through.
        let sleep_ms = p.sleep_ms();
        let epfd = p.epoll_fd();
        let caller_passes = shared.caller_passes.load(Ordering::Acquire);
        // What we sleep against: a caller's pass that moves the sink's timer before it wakes us.
        let cap = shared.now_ns().saturating_add(sleep_ms as u64 * 1_000_000);
        let due = shared.sink_due_ns.load(Ordering::Acquire);
        if !shared.about_to_sleep(due.min(cap)) {
            continue;
        }
        drop(guard);
        let mut evs: [libc::epoll_event; 4] = unsafe { std::mem::zeroed() };
        // SAFETY: epfd is the driver's (it lives as long as `Shared::driver` holds it, and only
        // this thread takes it out); evs has room for 4 events.
        let n = unsafe { libc::epoll_wait(epfd, evs.as_mut_ptr(), 4, sleep_ms) };
        shared.sleeping_until_ns.store(0, Ordering::Release);
        shared.stats.wakeups.fetch_add(1, Ordering::Relaxed);
        if n <= 0 {
            continue;
        }
        let mut ucx_woke = false;
        for ev in &evs[..n as usize] {
            if ev.u64 == 2 {
                shared.take_wake();
            } else {
                ucx_woke = true;
            }
        }
        if !ucx_woke || shared.cmds_pending() {
            continue;
        }
        // Woken by UCX: if the next progress pass finds nothing, and no caller drove the worker
        // while we slept (it may have taken what woke us), count an empty wake.
        let mut guard = shared.driver.lock();
        let Some(p) = guard.as_mut() else { return };
        // SAFETY: as above.
        let n = unsafe { sys::ucp_worker_progress(p.worker.0) };
        let handled = p.handle_callbacks();
        drop(guard);
        if n != 0 || handled != 0 {
            shared.note_progress();
            empty_streak = 0;
        } else if shared.caller_passes.load(Ordering::Acquire) == caller_passes {
            empty_streak += 1;
            shared.stats.empty_wakeups.fetch_add(1, Ordering::Relaxed);
            if empty_streak >= 64 && shared.about_to_sleep(shared.now_ns() + 1_000_000) {
                // A readable fd that yields nothing: back off 1 ms, but on the wake eventfd,
                // so that a command queued meanwhile still starts at once.
                back_off(shared, Duration::from_millis(1));
            }
        }
    }
}

/// A counted back-off, after [`Shared::about_to_sleep`] allowed it: sleeps until the wake
/// eventfd fires (a command was queued) or `nap` passes, then says the thread is awake again.
fn back_off(shared: &Shared, nap: Duration) {
    shared.stats.backoffs.fetch_add(1, Ordering::Relaxed);
    let fd = shared.wake_fd.as_raw_fd();
    let mut pfd = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one pollfd, ours; the eventfd lives as long as `shared`.
    let n = unsafe { libc::poll(&mut pfd, 1, nap.as_millis().max(1) as c_int) };
    if n > 0 && pfd.revents & libc::POLLIN != 0 {
        shared.take_wake();
    }
    shared.sleeping_until_ns.store(0, Ordering::Release);
}

impl Progress {
    pub(super) fn epoll_fd(&self) -> c_int {
        use std::os::fd::AsRawFd;
        self.epfd.as_ref().map_or(-1, |f| f.as_raw_fd())
    }

    /// One pass of the loop, by whichever thread holds the driver lock: queued commands, a
    /// burst of progress with the callbacks' reports, stray data, expired drains, the sink.
    /// Stops early once shutdown was asked (the progress thread tears down).
    pub(super) fn pass(&mut self) -> Pass {
        let mut progressed = self.drain_commands();
        if self.shutdown {
            self.settle_callbacks();
            return Pass {
                progressed,
                sink_ran: false,
                now: Instant::now(),
            };
        }
        let mut read = false;
        for _ in 0..PROGRESS_BURST {
            // SAFETY: the worker is used only under the driver lock, which our caller holds.
            let n = unsafe { sys::ucp_worker_progress(self.worker.0) };
            read |= n != 0;
            let handled = self.handle_callbacks();
            if n == 0 && handled == 0 {
                break;
            }
            progressed = true;
            // Commands (cancels, new posts) must not wait behind a busy transfer, nor the
            // sink's events behind one more call that finds nothing: a control message or a
            // landing goes to the core at once.
            if self.shared.cmds_maybe_pending() || self.sink_has_events() {
                break;
            }
        }
        // One clock read for the rest of the pass (the progress mark, the probe and the sink)
        // and for its caller.
        let now = Instant::now();
        if progressed {
            self.shared.note_progress_at(now);
        }
        if self.discard_unexpected {
            self.discard_strays();
        }
        if !self.drains.is_empty() {
            self.expire_drains();
        }
        if self.relisten.is_some() {
            self.retry_listen();
        }
        if self.settle_callbacks() {
            progressed = true;
        }
        let verdict = self.probe.as_mut().map(|p| p.tick(&self.shared, read, now));
        match verdict {
            Some(Verdict::Stuck) => self.receive_stuck(),
            Some(Verdict::Moving) => {
                self.shared.receive_stuck.store(false, Ordering::Release);
                tracing::warn!("the shared-memory receive queue of this agent moves again");
            }
            _ => {}
        }
        let sink_ran = self.run_sink(now);
        if sink_ran {
            // What the sink queued (control messages, cancels) leaves now: a caller whose wait
            // the sink just ended returns without another pass, and nobody else may be awake.
            self.drain_after_sink();
            timeline::mark(Stage::ControlSent);
        }
        Pass {
            progressed,
            sink_ran,
            now,
        }
    }

    /// Handles the reports still queued at the end of a pass: commands and the handling of
    /// earlier reports call into UCX outside the burst (closing a failed peer's endpoint
    /// progresses the worker), and what that reports must not wait for a later pass that may
    /// not come soon. Returns whether there were any.
    fn settle_callbacks(&mut self) -> bool {
        let mut any = false;
        for _ in 0..16 {
            if self.handle_callbacks() == 0 {
                break;
            }
            any = true;
        }
        any
    }

    /// Whether an owner's sink has events waiting (an op ended, a control message came).
    fn sink_has_events(&self) -> bool {
        self.shared.sink.get().is_some() && !self.shared.events.lock().is_empty()
    }

    /// Hands the queued events to the owner's sink, if there is one and there are events or its
    /// timer is due (at `now`); returns true if the sink ran.
    fn run_sink(&mut self, now: Instant) -> bool {
        let Some(sink) = self.shared.sink.get().cloned() else {
            return false;
        };
        let now_ns = self.shared.ns_at(now);
        let mut evs = std::mem::take(&mut self.ev_spare);
        std::mem::swap(&mut evs, &mut *self.shared.events.lock());
        if evs.is_empty() && now_ns < self.shared.sink_due_ns.load(Ordering::Acquire) {
            self.ev_spare = evs;
            return false;
        }
        // While the sink runs, any `wake_by` (from another thread) lands below MAX and wakes
        // us; afterwards the earlier of the two stands.
        self.shared.sink_due_ns.store(u64::MAX, Ordering::Release);
        // A panic in the owner's logic must not unwind into whichever thread runs the pass (a
        // caller's wait, or the progress thread) and leave the timer at "delivering".
        let shared = &*self.shared;
        let delivered = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            callbacks::in_sink(shared, || sink.deliver(&mut evs, now))
        }));
        let next = match delivered {
            Ok(t) => t.map_or(now + SINK_IDLE, |t| t.min(now + SINK_IDLE)),
            Err(_) => {
                tracing::error!("the agent's event sink panicked; its events were dropped");
                now + SINK_IDLE
            }
        };
        let next_ns = self.shared.ns_at(next);
        self.shared.sink_due_ns.fetch_min(next_ns, Ordering::AcqRel);
        // The sink drains what it is given; what a panic left is dropped, as said above.
        evs.clear();
        self.ev_spare = evs;
        true
    }

    /// How long the next sleep may last: 100 ms at most, less if the sink's timer comes first.
    pub(super) fn sleep_ms(&self) -> c_int {
        if self.shared.sink.get().is_none() {
            return 100;
        }
        let due = self.shared.sink_due_ns.load(Ordering::Acquire);
        let now = Instant::now()
            .saturating_duration_since(self.shared.epoch)
            .as_nanos() as u64;
        let left_ms = due.saturating_sub(now).div_ceil(1_000_000);
        left_ms.min(100) as c_int
    }

    /// Runs queued commands; returns whether there were any. A `Shutdown` stops it and sets
    /// `self.shutdown`: what is still queued is failed by the teardown.
    pub(super) fn drain_commands(&mut self) -> bool {
        self.drain_while(|_, _| true)
    }

    /// Runs queued commands from the front up to number `end` (see
    /// [`super::shared::CmdQueue::taken`]): a caller's own, started on its thread.
    pub(super) fn drain_to(&mut self, end: u64) -> bool {
        self.drain_while(|taken, _| taken < end)
    }

    /// Runs queued commands from the front for as long as `take` accepts the next one (given
    /// its number and itself; and no `Shutdown` was taken); returns whether any ran.
    fn drain_while(&mut self, take: impl Fn(u64, &Cmd) -> bool) -> bool {
        let mut did = false;
        while !self.shutdown && self.shared.cmds_maybe_pending() {
            let cmd = {
                let mut q = self.shared.cmds.lock();
                let taken = q.taken;
                match q.items.front() {
                    Some(c) if take(taken, c) => {
                        q.taken += 1;
                        q.items.pop_front()
                    }
                    Some(_) => None,
                    None => {
                        self.shared.cmds_queued.store(false, Ordering::Release);
                        None
                    }
                }
            };
            let Some(cmd) = cmd else { break };
            did = true;
            self.run_command(cmd);
        }
        did
    }

    /// After the sink ran: the control messages at the front of the queue (what the sink sent,
    /// a receiver's verdict say) are started first, then the sink is told (`delivered`: the
    /// engine wakes the callers whose waits it ended), then the rest runs. Nothing slower than
    /// a message send (closing an endpoint, a connect) comes between an ended wait and its
    /// caller: that would hold the caller past its deadline.
    fn drain_after_sink(&mut self) {
        self.send_after_sink();
        self.drain_commands();
    }

    /// The first half of [`Self::drain_after_sink`]: the control messages at the front of the
    /// queue, then the sink told.
    fn send_after_sink(&mut self) {
        self.drain_while(|_, c| matches!(c, Cmd::Post { .. } | Cmd::Control { .. }));
        if let Some(sink) = self.shared.sink.get() {
            // The owner's code, like `deliver` (`run_sink`): a panic in it must not unwind out
            // of the pass, which would end the progress thread (or a caller's wait) with the
            // worker never torn down.
            let told = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| sink.delivered()));
            if told.is_err() {
                tracing::error!("the agent's event sink panicked in delivered");
            }
        }
    }

    /// Makes an endpoint for a caller that waits for it, unless it has given up waiting; one
    /// made after it gave up is closed again (no peer of the owner's knows it), in flush mode
    /// ([`Progress::close_unwanted`]): its failure is reported here at once, and UCX ends its
    /// connection once the connection is made or has failed.
    fn connect_for(
        &mut self,
        reply: &Reply<PeerId>,
        make: impl FnOnce(&mut Self) -> Result<PeerId>,
    ) {
        if reply.given_up() {
            // The progress thread was too busy (or stuck) to start it by the caller's deadline:
            // worth an operator's notice.
            tracing::warn!("a connect whose caller had given up was not started");
            return;
        }
        if let Some(stall) = self.connect_stall.take() {
            std::thread::sleep(stall);
        }
        if let Some(Ok(peer)) = reply.offer(make(self)) {
            tracing::warn!(
                peer = peer.0,
                "closing the endpoint of a connect whose caller gave up"
            );
            self.close_unwanted(peer);
        }
    }

    /// Runs one queued command.
    fn run_command(&mut self, cmd: Cmd) {
        match cmd {
            Cmd::Shutdown => self.shutdown = true,
            Cmd::FaultStuck => self.receive_stuck(),
            Cmd::FaultStall {
                stall,
                at_next_connect: false,
                armed,
            } => self.stall = Some((stall, armed)),
            Cmd::FaultStall {
                stall,
                at_next_connect: true,
                armed,
            } => {
                self.connect_stall = Some(stall);
                armed.set(Ok(()));
            }
            Cmd::PeerTransports(peer, reply) => reply.set(self.peer_transports(peer)),
            Cmd::Connect(addr, reply) => {
                self.connect_for(&reply, |p| p.connect(Target::Sock(addr)))
            }
            Cmd::ConnectWorker(addr, reply) => {
                self.connect_for(&reply, |p| p.connect_worker(&addr))
            }
            Cmd::Tag {
                send,
                peer,
                tag,
                addr,
                len,
                slot,
            } => self.start_tag(peer, tag, addr, len, slot, send),
            Cmd::Control { peer, bytes, slot } => self.start_control(peer, bytes, slot),
            Cmd::Post { peer, bytes } => self.send_internal(peer, AM_CONTROL_ID, bytes),
            Cmd::CancelOp { id, at } => self.cancel_op(id, at),
            Cmd::Map { addr, len, reply } => {
                // Not made for a caller that gave up waiting (10 s); undone if it gave up
                // meanwhile.
                if reply.given_up() {
                    return;
                }
                if let Some(Ok((id, _))) = reply.offer(self.map(addr, len)) {
                    self.unmap(id);
                }
            }
            Cmd::Unmap(id) => self.unmap(id),
            Cmd::UnpackRkey {
                peer,
                packed,
                reply,
            } => {
                if reply.given_up() {
                    return;
                }
                if let Some(Ok(id)) = reply.offer(self.unpack_rkey(peer, &packed)) {
                    self.destroy_rkey(id);
                }
            }
            Cmd::DestroyRkey(id) => self.destroy_rkey(id),
            Cmd::Rma {
                rkey,
                put,
                addr,
                len,
                remote,
                slot,
            } => self.start_rma(rkey, put, addr, len, remote, slot),
            Cmd::ForceClose(peer, reply) => {
                self.fail_peer(peer.0, sys::UCS_ERR_CANCELED, true);
                if let Some(r) = reply {
                    r.set(Ok(()))
                }
            }
        }
    }

    /// Handles what the UCX callbacks reported during the last progress call.
    /// The batch is kept in `cb_batch` while it is handled, so that destroying an endpoint
    /// takes out the reports still to come that name it (see [`Progress::forget_endpoint`]).
    pub(super) fn handle_callbacks(&mut self) -> usize {
        let spare = Vec::from(std::mem::take(&mut self.cb_batch));
        self.cb_batch = callbacks::take_events(&self.shared, spare).into();
        let n = self.cb_batch.len();
        while let Some(ev) = self.cb_batch.pop_front() {
            match ev {
                CbEvent::ConnRequest(req) => self.accept(req),
                CbEvent::EpError(peer, status) => self.fail_peer(peer, status, false),
                CbEvent::Bind(_uid, address) => self.bind(&address),
                CbEvent::Drain(ep, header, tag) => self.drain_from(ep, header, tag),
                CbEvent::Control(ep, uid, bytes) => self.control_from(ep, uid, bytes),
                CbEvent::Batch(ep, uid, bytes) => self.batch_from(ep, uid, bytes),
                CbEvent::HeldSent(peer) => self.held_sent(peer),
            }
        }
        n
    }

    pub(super) fn teardown(mut self) {
        // Close the queue (later submits fail at once) and end what never ran; then stop every
        // op, then close every endpoint; then the worker and context go, and only then are the
        // ops UCX still held failed for their waiters.
        let leftovers: Vec<Cmd> = {
            let mut q = self.shared.cmds.lock();
            q.closed = true;
            q.take_all()
        };
        for cmd in leftovers {
            self.shared.fail_cmd(cmd);
        }
        // A stall taken in the pass that took the shutdown never begins: its caller waits
        // for that answer.
        if let Some((_, armed)) = self.stall.take() {
            armed.set(Err(Error::new(ErrorKind::Shutdown, "agent is shut down")));
        }
        let held = self.release_worker(STOP_SHUTDOWN);
        self.maps.clear();
        let shared = self.shared.clone();
        drop(self);
        shared.forget_held_sends();
        fail_held(&shared, held);
    }
}

#[cfg(test)]
mod tests {
    use super::super::{
        batch, Agent, AgentOptions, Event, EventSink, PeerId, TransportKind, AM_BATCH_ID,
    };
    use super::*;
    use parking_lot::Mutex;

    /// Answers every control message with one of its own, then queues a command that is not a
    /// message (a cancel of no op), and notes, each time it is told that what it submitted has
    /// started, what was still queued then.
    struct Echo {
        shared: std::sync::Weak<Shared>,
        answered: std::sync::atomic::AtomicBool,
        queued_at_delivered: Mutex<Vec<usize>>,
    }

    impl EventSink for Echo {
        fn deliver(&self, events: &mut VecDeque<Event>, _now: Instant) -> Option<Instant> {
            let sh = self.shared.upgrade()?;
            for ev in events.drain(..) {
                if let Event::Control(peer, bytes) = ev {
                    let answer = [b"re: ".as_slice(), &bytes].concat();
                    sh.submit_post(Cmd::Post {
                        peer,
                        bytes: answer,
                    })
                    .unwrap();
                    sh.submit(Cmd::CancelOp {
                        id: u64::MAX,
                        at: crate::transport::ucx::op::NOT_TRACKED,
                    })
                    .unwrap();
                    self.answered.store(true, Ordering::Release);
                }
            }
            None
        }

        fn delivered(&self) {
            if self.answered.swap(false, Ordering::AcqRel) {
                let sh = self.shared.upgrade().unwrap();
                let queued = sh.cmds.lock().items.len();
                self.queued_at_delivered.lock().push(queued);
            }
        }
    }

    /// The engine wakes the callers its sink ended the waits of in `delivered`, counting on the
    /// messages the sink sent (a receiver's verdict) to have left by then, and on nothing
    /// slower (closing an endpoint) to have run before: over real UCX on loopback, every answer
    /// a sink queues has been started when `delivered` runs, and the other command not yet.
    #[test]
    fn the_sink_is_told_after_its_messages_left_and_before_its_other_commands_run() {
        let mut ob = AgentOptions::new("echo", TransportKind::Tcp);
        ob.listen = Some("127.0.0.1:0".parse().unwrap());
        let b = Agent::new(ob).unwrap();
        let sink = Arc::new(Echo {
            shared: Arc::downgrade(&b.shared),
            answered: Default::default(),
            queued_at_delivered: Mutex::new(Vec::new()),
        });
        assert!(b.set_sink(sink.clone()));
        let a = Agent::new(AgentOptions::new("asker", TransportKind::Tcp)).unwrap();
        let ab = a.connect(b.listen_address().unwrap()).unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        for i in 0..20u8 {
            a.post_control(ab, vec![i]).unwrap();
            let answer = loop {
                match a
                    .next_event(deadline, None)
                    .expect("the answer must arrive")
                {
                    Event::Control(_, bytes) => break bytes,
                    _ => continue,
                }
            };
            assert_eq!(answer, [b"re: ".as_slice(), &[i]].concat());
        }
        // The last answer can reach us before the other agent's thread has gone on to tell
        // its sink (`delivered` runs after the answer is started): give it a moment.
        let told_by = Instant::now() + Duration::from_secs(2);
        while sink.queued_at_delivered.lock().len() < 20 && Instant::now() < told_by {
            std::thread::sleep(Duration::from_millis(1));
        }
        let seen = sink.queued_at_delivered.lock().clone();
        assert_eq!(seen.len(), 20, "told once per answering delivery");
        assert!(
            seen.iter().all(|&queued| queued == 1),
            "when the sink was told, only its cancel should have been queued: {seen:?}"
        );
    }

    /// Two agents over `kind`, the first connected to the second, once the second has
    /// accepted it (it drops messages from an endpoint it has not accepted yet: no peer to name
    /// them by).
    fn accepted_pair(kind: &TransportKind, deadline: Instant) -> (Agent, Agent, PeerId) {
        let mut ob = AgentOptions::new("flooded", kind.clone());
        if *kind == TransportKind::Tcp {
            ob.listen = Some("127.0.0.1:0".parse().unwrap());
        }
        let b = Agent::new(ob).unwrap();
        let a = Agent::new(AgentOptions::new("flooder", kind.clone())).unwrap();
        let ab = match b.listen_address() {
            Some(addr) => a.connect(addr),
            None => a.connect_worker(&b.worker_address()),
        }
        .unwrap();
        loop {
            match b.next_event(deadline, None) {
                Some(Event::Accepted(..)) => break,
                Some(_) => continue,
                None => panic!("{kind:?}: the flooder was not accepted"),
            }
        }
        (a, b, ab)
    }

    /// Makes `b` find its receive queue stuck, and returns once its move to a new worker is
    /// counted.
    fn force_move(b: &Agent, deadline: Instant) {
        b.fault_stuck_receive_queue().unwrap();
        while b.stats().worker_renewals == 0 {
            assert!(Instant::now() < deadline, "the agent never moved");
            std::thread::sleep(Duration::from_micros(100));
        }
    }

    /// Notes, for each peer failure it is handed, how many moves to a new worker had been
    /// counted then, whether its agent still reported the queue stuck, and when.
    struct MoveWatch {
        shared: std::sync::Weak<Shared>,
        failed_at: Mutex<Vec<(u64, bool, Instant)>>,
    }

    impl EventSink for MoveWatch {
        fn deliver(&self, events: &mut VecDeque<Event>, _now: Instant) -> Option<Instant> {
            let sh = self.shared.upgrade()?;
            for ev in events.drain(..) {
                if let Event::PeerFailed(_) = ev {
                    self.failed_at.lock().push((
                        sh.stats.worker_renewals.load(Ordering::Acquire),
                        sh.receive_stuck.load(Ordering::Acquire),
                        Instant::now(),
                    ));
                }
            }
            None
        }
    }

    /// A move to a new worker hands its owner the peers' failures within the move, before the
    /// old worker is destroyed (milliseconds, more with many unread messages in it), not in a
    /// pass after it: meanwhile the owner would report those peers connected. It used to be
    /// after: this saw `[(1, false)]`.
    #[test]
    fn a_move_hands_over_the_peers_failures_before_the_old_worker_goes() {
        let kind = TransportKind::SharedMemory;
        let deadline = Instant::now() + Duration::from_secs(30);
        let (_a, b, _ab) = accepted_pair(&kind, deadline);
        let sink = Arc::new(MoveWatch {
            shared: Arc::downgrade(&b.shared),
            failed_at: Mutex::new(Vec::new()),
        });
        assert!(b.set_sink(sink.clone()));
        let t0 = Instant::now();
        force_move(&b, deadline);
        let moved = t0.elapsed();
        let failed_at = sink.failed_at.lock().clone();
        if let Some(&(_, _, t)) = failed_at.first() {
            println!(
                "failure handed over {:?} after the fault, the move counted {moved:?} after it",
                t.duration_since(t0)
            );
        }
        let seen: Vec<(u64, bool)> = failed_at.iter().map(|&(n, stuck, _)| (n, stuck)).collect();
        assert_eq!(
            seen,
            [(0, true)],
            "the one peer's failure, handed over during the move (not yet counted, the queue \
             still reported stuck)"
        );
    }

    /// Tagged messages that no receive matched (an agent without `discard_unexpected`) are
    /// taken out of UCX's unexpected queue and counted when the agent leaves its worker, not
    /// left for UCX to warn about one line each as it destroys the worker (the flood of
    /// `sm_kill_wedge`'s flooded survivor). Without that the count stays 0.
    #[test]
    fn a_move_takes_the_unmatched_messages_out_of_the_old_worker() {
        const N: u64 = 200;
        let kind = TransportKind::SharedMemory;
        let deadline = Instant::now() + Duration::from_secs(30);
        let (a, b, ab) = accepted_pair(&kind, deadline);
        let bytes = vec![7u8; 8000];
        for i in 0..N {
            // SAFETY: `bytes` outlives the op, which is waited right here.
            let mut op = unsafe { a.post_send(ab, 0x57A7 + i, bytes.as_ptr(), bytes.len()) };
            let done = op.as_mut().unwrap().wait(deadline, None).unwrap();
            assert_eq!(done, crate::Outcome::Completed, "send {i}");
        }
        // The same queue, in order: once this is handed over, every message before it was read.
        a.send_control(ab, b"last".to_vec())
            .unwrap()
            .wait(deadline, None)
            .unwrap();
        assert_eq!(controls(&b, 1, deadline), [b"last".to_vec()]);
        assert_eq!(
            b.stats().stray_discarded,
            0,
            "nothing discarded before the move"
        );
        force_move(&b, deadline);
        assert_eq!(
            b.stats().stray_discarded,
            N,
            "every unmatched message taken and counted"
        );
    }

    /// The next `n` control messages `b` is handed, in order.
    fn controls(b: &Agent, n: usize, deadline: Instant) -> Vec<Vec<u8>> {
        let mut got = Vec::with_capacity(n);
        while got.len() < n {
            match b.next_event(deadline, None) {
                Some(Event::Control(_, bytes)) => got.push(bytes),
                Some(_) => continue,
                None => panic!("{} of {n} messages by the deadline", got.len()),
            }
        }
        got
    }

    /// Waits until `a` holds no send queued; then none of their bytes may be left.
    fn nothing_held(a: &Agent, deadline: Instant) {
        while a.push_pending() {
            assert!(Instant::now() < deadline, "sends still held");
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(a.shared.queued_msgs.lock().is_empty());
    }

    /// A control message nobody waits on has no allocation of its own while UCX sends it in
    /// the call; one that UCX holds queued (a burst outruns the peer) keeps its bytes, under
    /// its request, until UCX's callback. A flood of messages, each with bytes of its own,
    /// must arrive whole and in order, and nothing may stay held afterwards. (Under the
    /// sanitizer build a message freed early is also a use after free.)
    #[test]
    fn messages_ucx_holds_queued_keep_their_bytes_until_sent() {
        const N: u32 = 4000;
        let payload = |i: u32| -> Vec<u8> {
            let mut v = i.to_le_bytes().repeat(150);
            v.push((i % 251) as u8);
            v
        };
        for kind in [TransportKind::SharedMemory, TransportKind::Tcp] {
            let deadline = Instant::now() + Duration::from_secs(30);
            let (a, b, ab) = accepted_pair(&kind, deadline);
            let mut peak = 0;
            for i in 0..N {
                a.post_control(ab, payload(i)).unwrap();
                peak = peak.max(a.shared.queued_msgs.lock().len());
            }
            for (i, bytes) in controls(&b, N as usize, deadline).into_iter().enumerate() {
                assert_eq!(bytes, payload(i as u32), "{kind:?}: message {i}");
            }
            // Every held send has ended: its bytes are gone with it.
            nothing_held(&a, deadline);
            let s = a.stats();
            println!(
                "{kind:?}: {N} messages, at most {peak} held by UCX at once, {} of them in {} \
                 batches",
                s.control_batched, s.control_batches
            );
        }
    }

    /// A peer that does not read (its driver lock held here, so its receive queue fills) gets
    /// the messages sent meanwhile in batches once it reads again: fewer active messages than
    /// control messages, every one of them whole and in order, the ones too long to batch and
    /// a waited one sent last (each sends the batch before it) included.
    #[test]
    fn messages_to_a_peer_that_does_not_read_go_in_batches_whole_and_in_order() {
        const N: u32 = 3000;
        let payload = |i: u32| -> Vec<u8> {
            // Every 97th longer than a batch's bound: sent alone, after the batch before it.
            let len = if i % 97 == 0 {
                5000
            } else {
                40 + (i as usize * 7) % 300
            };
            (0..len).map(|k| (i as usize * 31 + k) as u8).collect()
        };
        let kind = TransportKind::SharedMemory;
        let deadline = Instant::now() + Duration::from_secs(30);
        let (a, b, ab) = accepted_pair(&kind, deadline);
        {
            let _frozen = b.shared.driver.lock();
            for i in 0..N {
                a.post_control(ab, payload(i)).unwrap();
            }
            // Until the queue to the peer is full and messages wait in a batch.
            while a.stats().control_batched == 0 {
                assert!(Instant::now() < deadline, "no message was ever batched");
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        // A message with an op of its own (a handshake's) goes after the batch too.
        let mut waited = a.send_control(ab, b"waited".to_vec()).unwrap();
        let got = controls(&b, N as usize + 1, deadline);
        for (i, bytes) in got[..N as usize].iter().enumerate() {
            assert_eq!(*bytes, payload(i as u32), "message {i}");
        }
        assert_eq!(got[N as usize], b"waited", "the waited message came last");
        assert_eq!(
            waited.wait(deadline, None).unwrap(),
            crate::Outcome::Completed
        );
        nothing_held(&a, deadline);
        let s = a.stats();
        let sent = u64::from(N) - s.control_batched + s.control_batches;
        assert!(
            s.control_batches > 0 && sent < u64::from(N) / 2,
            "{N} messages in {sent} active messages ({} batched in {} batches)",
            s.control_batched,
            s.control_batches
        );
        assert_eq!(b.stats().control_malformed, 0);
        println!("{N} messages in {sent} active messages");
    }

    /// Messages waiting in a batch for a peer that is closed go with it: nothing stays counted
    /// as pending (an engine's drop would wait for it), nothing stays held.
    #[test]
    fn a_closed_peer_takes_its_waiting_batch_with_it() {
        let kind = TransportKind::SharedMemory;
        let deadline = Instant::now() + Duration::from_secs(30);
        let (a, b, ab) = accepted_pair(&kind, deadline);
        let frozen = b.shared.driver.lock();
        let mut i = 0u32;
        while a.stats().control_batched == 0 {
            assert!(Instant::now() < deadline, "no message was ever batched");
            a.post_control(ab, i.to_le_bytes().repeat(50)).unwrap();
            i += 1;
        }
        a.post_control(ab, b"last".to_vec()).unwrap();
        assert!(a.push_pending());
        assert!(a.close_peer_sync(ab, deadline));
        nothing_held(&a, deadline);
        drop(frozen);
        println!("{i} messages posted before one was batched");
    }

    /// A batch is checked whole before any of it is handed on: one that does not split into
    /// whole messages is dropped and counted, and the peer's next messages still arrive; a good
    /// one is handed on message by message.
    #[test]
    fn a_malformed_batch_is_dropped_whole_and_a_good_one_handed_on() {
        for kind in [TransportKind::Tcp, TransportKind::SharedMemory] {
            let deadline = Instant::now() + Duration::from_secs(30);
            let (a, b, ab) = accepted_pair(&kind, deadline);
            let mut good = Vec::new();
            batch::push(&mut good, b"first");
            batch::push(&mut good, b"second");
            // A good first message, then a length that runs past the end; a zero length.
            let mut bad = Vec::new();
            batch::push(&mut bad, b"never");
            bad.extend_from_slice(&100u32.to_le_bytes());
            bad.extend_from_slice(b"short");
            {
                let mut g = a.shared.driver.lock();
                let p = g.as_mut().unwrap();
                p.send_am(ab, AM_BATCH_ID, bad);
                p.send_am(ab, AM_BATCH_ID, vec![0; 4]);
                p.send_am(ab, AM_BATCH_ID, good);
            }
            a.post_control(ab, b"after".to_vec()).unwrap();
            let got = controls(&b, 3, deadline);
            assert_eq!(got, [&b"first"[..], b"second", b"after"], "{kind:?}");
            assert_eq!(b.stats().control_malformed, 2, "{kind:?}");
        }
    }

    /// UCX names the endpoint an active message came on (the reply endpoint) from an id that
    /// the sender writes into the message, and these ids are small sequential numbers: a
    /// process that rewrites that id in its own UCX (seen with UCX 1.13.1: a client that set
    /// its endpoint's remote id to another peer's had its `Refuse` taken as that peer's) is
    /// handed to us as the other peer. What the callbacks then report is that peer's endpoint
    /// with the forger's header: such a message, or a drain, must not count as the peer's,
    /// even when the header is the peer's uid (public: the peer sends it to anyone it talks to).
    #[test]
    fn a_message_that_names_a_peers_endpoint_without_its_header_is_not_that_peers() {
        for kind in [TransportKind::Tcp, TransportKind::SharedMemory] {
            let deadline = Instant::now() + Duration::from_secs(30);
            let (a, b, ab) = accepted_pair(&kind, deadline);
            a.post_control(ab, b"first".to_vec()).unwrap();
            assert_eq!(controls(&b, 1, deadline), [b"first"]);
            let (ep, ba) = {
                let g = b.shared.driver.lock();
                let p = g.as_ref().unwrap();
                assert_eq!(p.ep_to_peer.len(), 1, "{kind:?}");
                let (&ep, &peer) = p.ep_to_peer.iter().next().unwrap();
                (ep as sys::ucp_ep_h, PeerId(peer))
            };
            const TAG: u64 = 0x5eed;
            let mut buf = [0u8; 4];
            // SAFETY: `buf` outlives the op: it is waited for below.
            let mut recv = unsafe { b.post_recv(ba, TAG, buf.as_mut_ptr(), buf.len()) }.unwrap();
            {
                let mut g = b.shared.driver.lock();
                let p = g.as_mut().unwrap();
                let mut forged = Vec::new();
                batch::push(&mut forged, b"forged in a batch");
                b.shared.cb_events.lock().extend([
                    CbEvent::Control(ep, a.uid(), b"forged".to_vec()),
                    CbEvent::Batch(ep, a.uid(), forged),
                    CbEvent::Drain(ep, a.uid(), TAG),
                ]);
                p.handle_callbacks();
            }
            a.post_control(ab, b"after".to_vec()).unwrap();
            assert_eq!(controls(&b, 1, deadline), [b"after"], "{kind:?}");
            let data = *b"data";
            // SAFETY: `data` outlives the op: it is waited for below.
            let mut send = unsafe { a.post_send(ab, TAG, data.as_ptr(), data.len()) }.unwrap();
            assert_eq!(
                recv.wait(deadline, None).unwrap(),
                crate::Outcome::Completed,
                "{kind:?}: a forged drain stopped the peer's receive"
            );
            assert_eq!(buf, data);
            assert_eq!(
                send.wait(deadline, None).unwrap(),
                crate::Outcome::Completed
            );
            assert_eq!(b.stats().control_spoofed, 3, "{kind:?}");
        }
    }

    /// A report the callbacks queued for a peer's endpoint, still unhandled when that endpoint
    /// is destroyed, is the old peer's even if a new endpoint gets the same address (UCX's
    /// allocator hands a freed endpoint's memory to the next one; here the new peer's mapping
    /// is put at the old address by hand, as that reuse would): it is dropped, not taken as the
    /// new peer's. Before, the old peer's message was handed on as the new peer's, and the new
    /// peer's own messages were dropped as spoofed from then on.
    #[test]
    fn a_report_for_an_endpoint_destroyed_before_it_was_handled_is_not_a_new_peers() {
        for kind in [TransportKind::Tcp, TransportKind::SharedMemory] {
            let deadline = Instant::now() + Duration::from_secs(30);
            let (a, b, ab) = accepted_pair(&kind, deadline);
            a.post_control(ab, b"first".to_vec()).unwrap();
            assert_eq!(controls(&b, 1, deadline), [b"first"]);
            let c = Agent::new(AgentOptions::new("newcomer", kind.clone())).unwrap();
            let cb = match b.listen_address() {
                Some(addr) => c.connect(addr),
                None => c.connect_worker(&b.worker_address()),
            }
            .unwrap();
            let bc = loop {
                match b.next_event(deadline, None) {
                    Some(Event::Accepted(peer, _)) => break peer,
                    Some(_) => continue,
                    None => panic!("{kind:?}: the newcomer was not accepted"),
                }
            };
            let stale_before = b.stats().stale_control_dropped;
            {
                let mut g = b.shared.driver.lock();
                let p = g.as_mut().unwrap();
                let (&old_ep, &ba) = p
                    .ep_to_peer
                    .iter()
                    .find(|(_, &peer)| peer != bc.0)
                    .expect("the first peer's endpoint");
                let mut batched = Vec::new();
                batch::push(&mut batched, b"stale in a batch");
                // Queued before the endpoint goes, handled after a new one took its address.
                b.shared.cb_events.lock().extend([
                    CbEvent::Control(old_ep as sys::ucp_ep_h, a.uid(), b"stale".to_vec()),
                    CbEvent::Batch(old_ep as sys::ucp_ep_h, a.uid(), batched),
                ]);
                p.fail_peer(ba, sys::UCS_ERR_CANCELED, true);
                p.ep_to_peer.insert(old_ep, bc.0);
                p.handle_callbacks();
                p.ep_to_peer.remove(&old_ep);
            }
            c.post_control(cb, b"mine".to_vec()).unwrap();
            let got = loop {
                match b.next_event(deadline, None) {
                    Some(Event::Control(peer, bytes)) => break (peer, bytes),
                    Some(_) => continue,
                    None => panic!("{kind:?}: the newcomer's message never came"),
                }
            };
            assert_eq!(got, (bc, b"mine".to_vec()), "{kind:?}");
            let s = b.stats();
            assert_eq!(s.control_spoofed, 0, "{kind:?}");
            assert_eq!(s.stale_control_dropped - stale_before, 2, "{kind:?}");
        }
    }

    /// Notes which thread ran the sink, and when.
    struct ThreadWatch {
        seen: Mutex<Vec<(std::thread::ThreadId, Instant)>>,
    }

    impl EventSink for ThreadWatch {
        fn deliver(&self, events: &mut VecDeque<Event>, now: Instant) -> Option<Instant> {
            events.clear();
            self.seen.lock().push((std::thread::current().id(), now));
            None
        }
    }

    /// A caller that starts its command on its own thread (`submit_now`) runs that command
    /// only. Here its command is a connect held 300 ms (a test stall); another thread queues a
    /// command whose run calls the sink (`FaultStuck`, report-only here) 100 ms in. That one is
    /// the progress thread's: run on the caller, under whatever locks the caller holds (the
    /// engine's core lock, which its sink takes), it would deadlock or hold the caller.
    #[test]
    fn a_caller_starting_its_command_here_runs_no_other_threads_command() {
        let deadline = Instant::now() + Duration::from_secs(30);
        let (a, b, _ab) = accepted_pair(&TransportKind::Tcp, deadline);
        let sink = Arc::new(ThreadWatch {
            seen: Mutex::new(Vec::new()),
        });
        assert!(a.set_sink(sink.clone()));
        std::thread::sleep(Duration::from_millis(50));
        a.fault_stall_progress(Duration::from_millis(300), true)
            .unwrap();
        let sh = a.shared.clone();
        let other = {
            let sh = sh.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(100));
                sh.submit(Cmd::FaultStuck).unwrap();
            })
        };
        let me = std::thread::current().id();
        let r = Reply::new();
        let t0 = Instant::now();
        sh.submit_now(Cmd::Connect(b.listen_address().unwrap(), r.clone()))
            .unwrap();
        let t1 = Instant::now();
        other.join().unwrap();
        r.wait(deadline).unwrap();
        // The other thread's command ran, on the progress thread, once the caller let go.
        let until = Instant::now() + Duration::from_secs(5);
        while sink
            .seen
            .lock()
            .iter()
            .all(|(_, at)| *at < t0 + Duration::from_millis(100))
            && Instant::now() < until
        {
            std::thread::sleep(Duration::from_millis(5));
        }
        let seen = sink.seen.lock().clone();
        let on_caller: Vec<_> = seen
            .iter()
            .filter(|(t, at)| *t == me && *at >= t0 && *at <= t1)
            .collect();
        println!(
            "submit_now held the caller {:?}; sink runs after it began: {:?}",
            t1 - t0,
            seen.iter()
                .filter(|(_, at)| *at >= t0)
                .map(|(t, at)| (*t == me, at.duration_since(t0)))
                .collect::<Vec<_>>()
        );
        assert!(
            on_caller.is_empty(),
            "the sink ran on the caller inside submit_now"
        );
        assert!(
            seen.iter()
                .any(|(t, at)| *t != me && *at >= t0 + Duration::from_millis(100)),
            "the other thread's command ran elsewhere"
        );
    }

    /// Notes when it was first called.
    struct FirstCall(Mutex<Option<Instant>>);

    impl EventSink for FirstCall {
        fn deliver(&self, events: &mut VecDeque<Event>, now: Instant) -> Option<Instant> {
            events.clear();
            self.0.lock().get_or_insert(now);
            None
        }
    }

    /// A sink is due at once when it is set: the progress thread, asleep (up to 100 ms) on a
    /// sleep reckoned without one, is woken to call it. It used to sleep on: `set_sink`'s
    /// `wake_by(now)` found the timer at 0, nothing later to move earlier, and woke nobody, so
    /// the first call (and every `wake_by` before it) waited for the end of that sleep.
    #[test]
    fn a_sink_just_set_is_called_without_waiting_out_the_progress_threads_sleep() {
        let mut delays = Vec::new();
        for _ in 0..3 {
            let a = Agent::new(AgentOptions::new("sinkless", TransportKind::Tcp)).unwrap();
            std::thread::sleep(Duration::from_millis(30));
            // Just after a wake-up the thread begins a new sleep of 100 ms.
            let woke = a.shared.stats.wakeups.load(Ordering::Relaxed);
            let until = Instant::now() + Duration::from_secs(2);
            while a.shared.stats.wakeups.load(Ordering::Relaxed) == woke {
                assert!(Instant::now() < until, "the idle thread never woke");
                std::thread::sleep(Duration::from_micros(200));
            }
            let sink = Arc::new(FirstCall(Mutex::new(None)));
            let t0 = Instant::now();
            assert!(a.set_sink(sink.clone()));
            let until = t0 + Duration::from_secs(2);
            let first = loop {
                if let Some(t) = *sink.0.lock() {
                    break t;
                }
                assert!(Instant::now() < until, "the sink was never called");
                std::thread::sleep(Duration::from_micros(200));
            };
            delays.push(first.saturating_duration_since(t0));
        }
        println!("first sink calls after set_sink: {delays:?}");
        let best = delays.iter().min().unwrap();
        assert!(
            *best < Duration::from_millis(40),
            "the sink waited out the sleep: {delays:?}"
        );
    }

    /// Notes when it is called, and when it is handed an `OpDone`.
    struct DoneWatch {
        calls: std::sync::atomic::AtomicU64,
        done: Mutex<Option<Instant>>,
    }

    impl EventSink for DoneWatch {
        fn deliver(&self, events: &mut VecDeque<Event>, now: Instant) -> Option<Instant> {
            for ev in events.drain(..) {
                if let Event::OpDone(_) = ev {
                    self.done.lock().get_or_insert(now);
                }
            }
            self.calls.fetch_add(1, Ordering::AcqRel);
            None
        }
    }

    /// A `Held` dropped unreleased ends its receives on the caller's thread; one reported as an
    /// event is the sink's to hear at once, not at the sink's next idle call (up to 100 ms
    /// later, which is when it used to hear of it: nothing woke the sleeping progress thread).
    #[test]
    fn a_held_receive_dropped_unreleased_is_reported_to_the_sink_at_once() {
        let deadline = Instant::now() + Duration::from_secs(30);
        let (a, _b, ab) = accepted_pair(&TransportKind::Tcp, deadline);
        let sink = Arc::new(DoneWatch {
            calls: Default::default(),
            done: Mutex::new(None),
        });
        assert!(a.set_sink(sink.clone()));
        let mut buf = vec![0u8; 4096];
        let mut delays = Vec::new();
        for _ in 0..3 {
            *sink.done.lock() = None;
            let mut held = a.hold();
            // SAFETY: `buf` outlives the op, which never starts.
            let _op = unsafe { held.post_recv_with(ab, 0x4E1D, buf.as_mut_ptr(), buf.len(), true) }
                .unwrap();
            // Just after an idle call the sink's next one is 100 ms away.
            std::thread::sleep(Duration::from_millis(20));
            let calls = sink.calls.load(Ordering::Acquire);
            while sink.calls.load(Ordering::Acquire) == calls {
                assert!(Instant::now() < deadline, "the sink is never called");
                std::thread::sleep(Duration::from_micros(200));
            }
            let t0 = Instant::now();
            drop(held);
            let done = loop {
                if let Some(t) = *sink.done.lock() {
                    break t;
                }
                assert!(Instant::now() < deadline, "the OpDone never came");
                std::thread::sleep(Duration::from_micros(200));
            };
            delays.push(done.saturating_duration_since(t0));
        }
        println!("OpDone handed to the sink after the drop: {delays:?}");
        let best = delays.iter().min().unwrap();
        assert!(
            *best < Duration::from_millis(40),
            "the sink heard of the ended receive only at its next idle call: {delays:?}"
        );
    }

    struct PanicOnce(std::sync::atomic::AtomicBool);

    impl EventSink for PanicOnce {
        fn deliver(&self, events: &mut VecDeque<Event>, _now: Instant) -> Option<Instant> {
            events.clear();
            if !self.0.swap(true, Ordering::AcqRel) {
                panic!("a sink bug, on purpose");
            }
            None
        }
    }

    /// A stall armed in the same pass as the shutdown never begins: its caller
    /// (`Agent::fault_stall_progress`) is told so at the teardown, not left waiting for an
    /// answer until its 10 s are up, which is what it used to do (the reply was dropped with
    /// the progress state).
    #[test]
    fn a_stall_taken_with_the_shutdown_is_answered_at_the_teardown() {
        let a = Agent::new(AgentOptions::new("p", TransportKind::Tcp)).unwrap();
        let armed = Reply::new();
        a.shared
            .submit_all([
                Cmd::FaultStall {
                    stall: Duration::from_secs(1),
                    at_next_connect: false,
                    armed: armed.clone(),
                },
                Cmd::Shutdown,
            ])
            .unwrap();
        let t0 = Instant::now();
        let r = armed.wait(t0 + Duration::from_secs(3));
        let waited = t0.elapsed();
        a.shutdown();
        let e = r.expect_err("the stall never began");
        assert_eq!(
            e.kind,
            ErrorKind::Shutdown,
            "told of the shutdown after {waited:?}, not left to its deadline: {e}"
        );
    }

    /// Counts its calls; panics the first time it is told its messages have left.
    struct PanicInDelivered {
        calls: std::sync::atomic::AtomicU64,
        panicked: std::sync::atomic::AtomicBool,
    }

    impl EventSink for PanicInDelivered {
        fn deliver(&self, events: &mut VecDeque<Event>, _now: Instant) -> Option<Instant> {
            events.clear();
            self.calls.fetch_add(1, Ordering::AcqRel);
            None
        }

        fn delivered(&self) {
            if !self.panicked.swap(true, Ordering::AcqRel) {
                panic!("a bug in the sink's delivered, on purpose");
            }
        }
    }

    /// A panic in the sink's `delivered` (called in the same pass as `deliver`) is caught as
    /// one in `deliver` is: the progress thread goes on calling the sink (every 100 ms when
    /// idle). It used to unwind out of the pass and end the progress thread: no more passes,
    /// and the shutdown found no thread to tear the worker down.
    #[test]
    fn a_panic_in_the_sinks_delivered_leaves_the_progress_thread_running() {
        let a = Agent::new(AgentOptions::new("p", TransportKind::Tcp)).unwrap();
        let sink = Arc::new(PanicInDelivered {
            calls: Default::default(),
            panicked: Default::default(),
        });
        assert!(a.set_sink(sink.clone()));
        let until = Instant::now() + Duration::from_secs(5);
        while !sink.panicked.load(Ordering::Acquire) {
            assert!(Instant::now() < until, "delivered was never called");
            std::thread::sleep(Duration::from_millis(1));
        }
        let calls = sink.calls.load(Ordering::Acquire);
        std::thread::sleep(Duration::from_millis(600));
        let after = sink.calls.load(Ordering::Acquire);
        assert!(
            after >= calls + 3,
            "the sink was called {} times in 600 ms after the panic: the progress thread \
             stopped",
            after - calls
        );
    }

    /// A sink that panics in a caller's pass is caught there, and the caller's thread is no
    /// longer marked as inside the sink (or driving the agent) afterwards: marked, everything it
    /// submitted would only be queued, never started or woken for.
    #[test]
    fn a_caught_sink_panic_leaves_the_thread_unmarked() {
        let a = Agent::new(AgentOptions::new("p", TransportKind::Tcp)).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        let sink = Arc::new(PanicOnce(Default::default()));
        {
            let mut g = a.shared.driver.lock();
            assert!(a.shared.sink.set(sink.clone()).is_ok());
            a.shared.sink_due_ns.store(0, Ordering::Release);
            let p = g.as_mut().unwrap();
            callbacks::entered(&a.shared, || p.pass());
        }
        assert!(
            sink.0.load(Ordering::Acquire),
            "the sink ran here, and panicked"
        );
        assert!(
            !callbacks::in_sink_of(&a.shared),
            "still marked as inside the sink"
        );
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            callbacks::entered(&a.shared, || panic!("a bug inside a caller's stretch"))
        }));
        assert!(r.is_err());
        let mut after = None;
        callbacks::with_shared(|sh| after = Some(sh as *const Shared));
        assert_eq!(
            after, None,
            "the thread's agent was put back after the panic"
        );
    }
}
