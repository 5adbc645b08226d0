//! The agent's public face: [`Agent`] and the handles it gives out ([`MemHandle`],
//! [`RemoteKey`]). Every call checks what it can here, then hands a command to the progress
//! thread; nothing here touches UCX.
use super::held::Held;
use super::op::{Op, OpSlot, SlotKind};
use super::progress::progress_thread;
use super::shared::{Cmd, Driving, EventSink, Reply, Shared};
use super::{AgentOptions, Event, PeerId, Stats, MAX_CONTROL};
use crate::error::{Error, ErrorKind, Result};
use parking_lot::Mutex;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The largest transfer its caller starts itself (see `Agent::post_tag`).
pub(super) const DIRECT_POST_MAX: usize = 64 << 10;

/// A UCX agent: one context, one worker, one progress thread. Not `Clone`; dropping it shuts the
/// progress thread down, cancels every op and closes every endpoint.
pub struct Agent {
    pub(super) shared: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
    listen_addr: Option<SocketAddr>,
    name: String,
}

/// Refuses an IPv6 address to listen at or dial: UCX's tcp transport (1.13 and 1.22 alike)
/// overflows a heap block when an endpoint is made through an IPv6 listener
/// (`uct_tcp_ep_set_dest_addr` writes an IPv6 address into an endpoint sized for IPv4; measured
/// with valgrind, the process then aborts in malloc), so an IPv6 address is an
/// `InvalidArgument` here rather than a corrupted process later.
pub(crate) fn ipv4_only(addr: SocketAddr) -> Result<()> {
    if addr.is_ipv6() {
        return Err(Error::invalid(format!(
            "'{addr}' is an IPv6 address: UCX's tcp transport corrupts memory on IPv6 \
             connections, use an IPv4 ip:port"
        )));
    }
    Ok(())
}

impl Agent {
    /// Creates the agent and starts its progress thread.
    pub fn new(opts: AgentOptions) -> Result<Agent> {
        // The name goes into a thread's name and UCX's: neither can hold a NUL.
        if opts.name.contains('\0') {
            return Err(Error::invalid("agent name contains NUL"));
        }
        if let Some(at) = opts.listen {
            ipv4_only(at)?;
        }
        let shared = Shared::new(&opts, fresh_uid())?;
        let init: Arc<Reply<Option<SocketAddr>>> = Reply::new();
        let (sh, ini, o) = (shared.clone(), init.clone(), opts.clone());
        let thread = std::thread::Builder::new()
            .name(format!("kvlink-ucx-{}", opts.name))
            .spawn(move || progress_thread(o, sh, ini))
            .map_err(|e| Error::new(ErrorKind::Internal, format!("spawn: {e}")))?;
        let started = init.wait(Instant::now() + Duration::from_secs(30));
        match started {
            Ok(listen_addr) => Ok(Agent {
                shared,
                thread: Mutex::new(Some(thread)),
                listen_addr,
                name: opts.name,
            }),
            Err(e) => {
                shared.stopping.store(true, Ordering::Release);
                let _ = shared.submit(Cmd::Shutdown);
                let _ = thread.join();
                Err(e)
            }
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Runs `sink` in every progress pass with the events from now on, instead of queueing
    /// them for [`Agent::next_event`]. Once per agent; false if one was set already.
    pub fn set_sink(&self, sink: Arc<dyn EventSink>) -> bool {
        let ok = self.shared.sink.set(sink).is_ok();
        if ok {
            // Due at once (its timer starts at 0). The progress thread may be asleep for up to
            // 100 ms, on a sleep reckoned without a sink: woken, it calls it now. `wake_by`
            // would wake nobody: nothing is earlier than a timer already due.
            self.shared.wake();
        }
        ok
    }

    /// Makes sure the sink is called by `at`: wakes the progress thread if it would otherwise
    /// sleep past it (an owner's timer moved earlier).
    pub fn wake_by(&self, at: Instant) {
        let at_ns = self.shared.ns_at(at);
        let was = self.shared.sink_due_ns.fetch_min(at_ns, Ordering::AcqRel);
        // `u64::MAX`: a pass is delivering to the sink right now; it keeps the earlier time when
        // it ends and sleeps (or wakes the progress thread) by it, so no wake-up is needed.
        if at_ns < was && was != u64::MAX {
            self.shared.wake();
        }
    }

    /// Stops the progress thread (cancelling every op, closing every endpoint) and waits for
    /// it. Idempotent; `Drop` does it too. Never call it from the sink.
    pub fn shutdown(&self) {
        self.shared.stopping.store(true, Ordering::Release);
        let _ = self.shared.submit(Cmd::Shutdown);
        if let Some(t) = self.thread.lock().take() {
            let _ = t.join();
        }
    }

    /// For a waiting caller: its turn at driving progress on its own thread instead of sleeping
    /// and being woken. [`Driving::step`] runs one pass (commands, UCX progress, callbacks, the
    /// sink) while the wait is within the poll window (`KVLINK_POLL_US`, 100 µs by default; 0
    /// turns it off) of the later of its start and the agent's last progress, and no other
    /// thread drives; so an idle wait polls for one window, then sleeps. `transfer` is the
    /// largest single transfer the wait is for (0 if none): from 4 MiB up it never drives and
    /// leaves progress to the progress thread, nor, on a tcp agent, while 4 MiB or more are in
    /// flight in all (see `Driving::for_transfer`). Never step holding a lock the sink takes
    /// (the sink runs in the pass).
    pub fn driving(&self, transfer: usize) -> Driving<'_> {
        Driving::for_transfer(&self.shared, transfer)
    }

    /// How many moves to a new worker this agent has begun ([`Stats::worker_renewals`] counts
    /// those that succeeded). It changes before the peers are failed for a move: a connect
    /// whose endpoint failed while it changed can dial again, and is served by the new worker
    /// (commands wait for the pass that moves).
    pub fn worker_moves_begun(&self) -> u64 {
        self.shared.moves_begun.load(Ordering::Acquire)
    }

    /// Whether something asked of this agent has not left yet: a command still queued, or a
    /// message nobody waits on ([`Agent::post_control`]) that UCX holds queued. If so, the
    /// progress thread is woken to move it (it may be asleep for up to 100 ms). An owner about
    /// to shut the agent down asks this in a bounded loop so that its last messages go out.
    pub fn push_pending(&self) -> bool {
        let pending = self.shared.cmds_pending() || self.shared.internal_queued_any();
        if pending {
            self.shared.wake();
        }
        pending
    }

    /// A fault for tests: the progress thread acts as if its probe had found the
    /// shared-memory receive queue stuck (a move to a new worker, unless report-only), without
    /// a killed writer, so that what follows a move can be tested deterministically.
    #[doc(hidden)]
    pub fn fault_stuck_receive_queue(&self) -> Result<()> {
        self.shared.submit(Cmd::FaultStuck)
    }

    /// A fault for tests: the progress thread stalls for `stall`, as if stuck in UCX: after
    /// its next pass, holding the worker (no caller drives it meanwhile either), or, with
    /// `at_next_connect`, in the next connect command just before it makes its endpoint.
    #[doc(hidden)]
    pub fn fault_stall_progress(&self, stall: Duration, at_next_connect: bool) -> Result<()> {
        let armed = Reply::new();
        self.shared.submit(Cmd::FaultStall {
            stall,
            at_next_connect,
            armed: armed.clone(),
        })?;
        // Returns once the stall has begun (or is armed): what is queued after it waits.
        armed.wait(Instant::now() + ANSWER_WAIT)
    }

    /// The bound listen address (with the real port when 0 was asked for).
    pub fn listen_address(&self) -> Option<SocketAddr> {
        self.listen_addr
    }

    /// The worker's address, for connecting without a listener (shared memory). It changes
    /// when the agent moves to a new worker because its shared-memory receive queue got stuck
    /// ([`Stats::worker_renewals`]): a process that connects later needs the new one.
    pub fn worker_address(&self) -> Vec<u8> {
        self.shared.worker_address.lock().clone()
    }

    /// Connects to a peer's listener. The endpoint is usable at once; its failure is reported
    /// by later operations and as [`Event::PeerFailed`]. Waits up to 10 s for the progress
    /// thread to make it ([`Agent::connect_by`] takes a deadline).
    pub fn connect(&self, addr: SocketAddr) -> Result<PeerId> {
        self.connect_by(addr, Instant::now() + ANSWER_WAIT)
    }

    /// [`Agent::connect`], returning by `deadline` (and within 10 s): a `Transport` error if
    /// the progress thread has not made the endpoint by then (it is busy, or stuck). An
    /// endpoint it makes after that is closed again, unused (its failure is reported as
    /// [`Event::PeerFailed`] of an id this call never returned).
    pub fn connect_by(&self, addr: SocketAddr, deadline: Instant) -> Result<PeerId> {
        ipv4_only(addr)?;
        let r = Reply::new();
        self.shared.submit(Cmd::Connect(addr, r.clone()))?;
        wait_for_endpoint(&r, deadline)
    }

    /// Connects to a peer by its exported worker address (waits as [`Agent::connect`]).
    pub fn connect_worker(&self, address: &[u8]) -> Result<PeerId> {
        self.connect_worker_by(address, Instant::now() + ANSWER_WAIT)
    }

    /// [`Agent::connect_worker`], returning by `deadline` as [`Agent::connect_by`] does.
    pub fn connect_worker_by(&self, address: &[u8], deadline: Instant) -> Result<PeerId> {
        if address.is_empty() || address.len() > 64 * 1024 {
            return Err(Error::invalid("worker address must be 1..=65536 bytes"));
        }
        // Refused here, at once, rather than by the progress thread (which checks it again).
        super::address::open(address)?;
        let r = Reply::new();
        self.shared
            .submit(Cmd::ConnectWorker(address.to_vec(), r.clone()))?;
        wait_for_endpoint(&r, deadline)
    }

    /// The memory types the linked UCX supports (a bit per `ucs_memory_type_t`), asked of UCX
    /// at start (`ucp_context_query`).
    pub fn memory_types(&self) -> u64 {
        self.shared.memory_types.load(Ordering::Acquire)
    }

    /// How CUDA memory moves with this UCX: [`DevicePath::Direct`](super::DevicePath::Direct)
    /// when it supports CUDA memory, else [`DevicePath::Staged`](super::DevicePath::Staged).
    pub fn device_path(&self) -> super::DevicePath {
        super::DevicePath::from_memory_types(self.memory_types())
    }

    /// The transports and devices (`tcp/lo`, `posix/memory`) `peer`'s endpoint uses, as UCX
    /// reports them; `Ok(None)` where the linked UCX cannot say (no
    /// `UCP_EP_ATTR_FIELD_TRANSPORTS` in its headers, as in 1.13's; 1.22's have it).
    pub fn peer_transports(&self, peer: PeerId) -> Result<Option<Vec<String>>> {
        self.check_peer(peer)?;
        let r = Reply::new();
        self.shared.submit(Cmd::PeerTransports(peer, r.clone()))?;
        r.wait(Instant::now() + ANSWER_WAIT)
    }

    /// This agent's unique id (in logs). The header of the messages it sends is not this but
    /// a voice of each endpoint's own (see `peers.rs`).
    pub fn uid(&self) -> u64 {
        self.shared.uid
    }

    fn check_peer(&self, peer: PeerId) -> Result<()> {
        // Shut down (or shutting down): its endpoints are gone or going, whatever the table of
        // peers, which the teardown does not clear, still says.
        if self.shared.stopping.load(Ordering::Acquire) {
            return Err(Error::new(ErrorKind::Shutdown, "agent is shut down"));
        }
        match self.shared.peer_failed(peer) {
            None => Err(Error::new(
                ErrorKind::UnknownPeer,
                format!("no peer {}", peer.0),
            )),
            Some(true) => Err(Error::new(
                ErrorKind::PeerLost,
                format!("peer {} has failed", peer.0),
            )),
            Some(false) => Ok(()),
        }
    }

    fn new_slot(
        &self,
        peer: PeerId,
        expected_len: usize,
        tag: u64,
        kind: SlotKind,
        notify: bool,
    ) -> Arc<OpSlot> {
        let id = self.shared.next_op.fetch_add(1, Ordering::Relaxed);
        let slot = OpSlot::new(id, peer, expected_len, tag, kind, notify);
        self.shared.track_op(&slot);
        // A control message's op is kept out of the data counters, at its end too
        // (`finish_slot`): counted here, it was started and never ended.
        if !slot.control {
            self.shared
                .stats
                .ops_started
                .fetch_add(1, Ordering::Relaxed);
        }
        slot
    }

    fn op(&self, slot: Arc<OpSlot>) -> Op {
        Op::new(slot, self.shared.clone())
    }

    /// Posts a tagged send of `len` bytes at `addr` to `peer`.
    ///
    /// # Safety
    /// `addr..addr+len` must be readable host memory that stays valid and unmodified until the
    /// returned [`Op`] has ended (completed, or [`Op::is_quiesced`] after a stop).
    pub unsafe fn post_send(
        &self,
        peer: PeerId,
        tag: u64,
        addr: *const u8,
        len: usize,
    ) -> Result<Op> {
        self.post_send_with(peer, tag, addr, len, false)
    }

    /// [`Agent::post_send`], optionally reporting the op's end as [`Event::OpDone`].
    ///
    /// # Safety
    /// As for [`Agent::post_send`].
    pub unsafe fn post_send_with(
        &self,
        peer: PeerId,
        tag: u64,
        addr: *const u8,
        len: usize,
        notify: bool,
    ) -> Result<Op> {
        self.post_tag(SlotKind::Send, peer, tag, addr as usize, len, notify)
    }

    /// Posts a tagged receive of exactly `len` bytes into `addr`, from `peer` (the peer whose
    /// failure cancels it). The receive's completion is the data's arrival.
    ///
    /// # Safety
    /// `addr..addr+len` must be writable host memory, not read or written by anyone else, that
    /// stays valid until the returned [`Op`] has ended.
    pub unsafe fn post_recv(
        &self,
        peer: PeerId,
        tag: u64,
        addr: *mut u8,
        len: usize,
    ) -> Result<Op> {
        self.post_recv_with(peer, tag, addr, len, false)
    }

    /// [`Agent::post_recv`], optionally reporting the op's end as [`Event::OpDone`].
    ///
    /// # Safety
    /// As for [`Agent::post_recv`].
    pub unsafe fn post_recv_with(
        &self,
        peer: PeerId,
        tag: u64,
        addr: *mut u8,
        len: usize,
        notify: bool,
    ) -> Result<Op> {
        self.post_tag(SlotKind::Recv, peer, tag, addr as usize, len, notify)
    }

    fn post_tag(
        &self,
        kind: SlotKind,
        peer: PeerId,
        tag: u64,
        addr: usize,
        len: usize,
        notify: bool,
    ) -> Result<Op> {
        let (op, cmd, slot) = self.prepare_tag(kind, peer, tag, addr, len, notify)?;
        let send = kind == SlotKind::Send;
        // A small transfer reported only through its `Op` is waited on by its caller right away,
        // and that wait drives it: start it here, without waking the progress thread
        // (measured: a 4 KiB transport-row transfer 8.8 -> 2.5 us p50 on tcp). A small receive
        // reported as an event (the engine's) is posted here too: it needs no progress until
        // its data arrives, which wakes the progress thread by itself (a 4 KiB request on
        // shared memory, 13.2 vs 16.3 us p50). A large one is left to the progress thread, as
        // is a send reported as an event (it may sit unwaited): a large transfer driven by its
        // caller has the woken progress thread compete with it for the worker and the cores
        // (1 MiB: 196 -> 262 us).
        if len > DIRECT_POST_MAX {
            self.shared.submit(cmd)?;
        } else if !send && notify {
            self.shared.submit_unwaited(cmd, &slot)?;
        } else if !notify {
            self.shared.submit_now(cmd)?;
        } else {
            self.shared.submit(cmd)?;
        }
        Ok(op)
    }

    /// A tagged transfer's op and the command that starts it (checked, not yet queued).
    pub(super) fn prepare_tag(
        &self,
        kind: SlotKind,
        peer: PeerId,
        tag: u64,
        addr: usize,
        len: usize,
        notify: bool,
    ) -> Result<(Op, Cmd, Arc<OpSlot>)> {
        check_buffer(addr, len)?;
        self.check_peer(peer)?;
        let slot = self.new_slot(peer, len, tag, kind, notify);
        let op = self.op(slot.clone());
        let cmd = Cmd::Tag {
            send: kind == SlotKind::Send,
            peer,
            tag,
            addr,
            len,
            slot: slot.clone(),
        };
        Ok((op, cmd, slot))
    }

    /// Registers `[addr, addr+len)` with UCX for one-sided access by peers. The handle's packed
    /// remote key is what a peer needs ([`Agent::unpack_rkey`]); dropping the handle unmaps.
    ///
    /// # Safety
    /// The range must be valid host memory for as long as the handle lives, and no peer may
    /// still access it when the handle is dropped.
    pub unsafe fn map(&self, addr: *mut u8, len: usize) -> Result<MemHandle> {
        check_buffer(addr as usize, len)?;
        let r = Reply::new();
        self.shared.submit(Cmd::Map {
            addr: addr as usize,
            len,
            reply: r.clone(),
        })?;
        let (id, packed_rkey) = r.wait(Instant::now() + ANSWER_WAIT)?;
        Ok(MemHandle {
            id,
            addr: addr as u64,
            len,
            packed_rkey,
            shared: self.shared.clone(),
        })
    }

    /// Unpacks a peer's remote key for its region `[base, base+len)` (as the peer advertised
    /// it: [`MemHandle::packed_rkey`]'s bytes, whole). Every put or get through the key is
    /// checked against that region. Bytes that are not such a key (cut short, changed, made up)
    /// are `InvalidArgument`: UCX's unpack reads a key without a length.
    ///
    /// # Safety
    /// `packed` must be the bytes of a [`MemHandle::packed_rkey`] that a kvlink agent made,
    /// from a peer trusted not to forge one: the seal's checksum keeps accidents away from
    /// UCX's unpack, not a process that seals bad bytes on purpose, which UCX then reads past.
    pub unsafe fn unpack_rkey(
        &self,
        peer: PeerId,
        packed: &[u8],
        base: u64,
        len: u64,
    ) -> Result<RemoteKey> {
        if packed.is_empty() || packed.len() > 64 * 1024 {
            return Err(Error::invalid(
                "a packed remote key must be 1..=65536 bytes",
            ));
        }
        let packed = super::address::open_rkey(packed)?;
        if base == 0 || len == 0 || base.checked_add(len).is_none() {
            return Err(Error::new(ErrorKind::OutOfBounds, "bad remote region"));
        }
        self.check_peer(peer)?;
        let r = Reply::new();
        self.shared.submit(Cmd::UnpackRkey {
            peer,
            packed: packed.to_vec(),
            reply: r.clone(),
        })?;
        let id = r.wait(Instant::now() + ANSWER_WAIT)?;
        Ok(RemoteKey {
            inner: Arc::new(RkeyInner {
                id,
                peer,
                base,
                len,
                shared: self.shared.clone(),
            }),
        })
    }

    /// One-sided write of `len` bytes at `local` into the peer's memory at `remote`. Completes
    /// when the data is in place at the target (the endpoint is flushed).
    ///
    /// # Safety
    /// `local..local+len` must be readable until the op has ended.
    pub unsafe fn put(
        &self,
        local: *const u8,
        len: usize,
        key: &RemoteKey,
        remote: u64,
    ) -> Result<Op> {
        self.rma(local as usize, len, key, remote, true)
    }

    /// One-sided read of `len` bytes from the peer's memory at `remote` into `local`.
    ///
    /// # Safety
    /// `local..local+len` must be writable and untouched by others until the op has ended.
    pub unsafe fn get(
        &self,
        local: *mut u8,
        len: usize,
        key: &RemoteKey,
        remote: u64,
    ) -> Result<Op> {
        self.rma(local as usize, len, key, remote, false)
    }

    fn rma(&self, addr: usize, len: usize, key: &RemoteKey, remote: u64, put: bool) -> Result<Op> {
        let (inner, key) = (&key.inner, &*key.inner);
        check_buffer(addr, len)?;
        let end = remote.checked_add(len as u64);
        if remote < key.base || end.is_none_or(|e| e > key.base + key.len) {
            return Err(Error::new(
                ErrorKind::OutOfBounds,
                format!(
                    "[{remote:#x}, +{len}) is outside the remote region [{:#x}, +{})",
                    key.base, key.len
                ),
            ));
        }
        if !Arc::ptr_eq(&key.shared, &self.shared) {
            // Its id names another agent's key: here it would be nobody's, or another peer's.
            return Err(Error::invalid(
                "the remote key was unpacked by another agent",
            ));
        }
        self.check_peer(key.peer)?;
        let slot = self.new_slot(key.peer, len, 0, SlotKind::Rma, false);
        let mut op = self.op(slot.clone());
        // The key lives while the op does: dropped before the op ended, it would be destroyed
        // while UCX still reads it for the transfer's fragments.
        op.keep_alive(inner.clone());
        self.shared.submit(Cmd::Rma {
            rkey: key.id,
            put,
            addr,
            len,
            remote,
            slot,
        })?;
        Ok(op)
    }

    /// Sends a small control message (eager active message); returns the op to wait on.
    pub fn send_control(&self, peer: PeerId, bytes: Vec<u8>) -> Result<Op> {
        if bytes.is_empty() || bytes.len() > MAX_CONTROL {
            return Err(Error::invalid(format!(
                "control message must be 1..={MAX_CONTROL} bytes"
            )));
        }
        self.check_peer(peer)?;
        let slot = self.new_slot(peer, bytes.len(), 0, SlotKind::Control, false);
        let op = self.op(slot.clone());
        let cmd = Cmd::Control {
            peer,
            bytes,
            slot: slot.clone(),
        };
        self.shared.submit_unwaited(cmd, &slot)?;
        Ok(op)
    }

    /// Sends a small control message that nobody waits on: no op, nothing to reap. Errors only
    /// on bad input, an unknown peer or a shut-down agent; a send that fails later (the peer
    /// went) is dropped, as the loss of any message on a failed endpoint. For a caller that
    /// must know the message left, [`Agent::send_control`].
    pub fn post_control(&self, peer: PeerId, bytes: Vec<u8>) -> Result<()> {
        let cmd = self.prepare_post(peer, bytes)?;
        self.shared.submit_post(cmd)
    }

    /// The command of [`Agent::post_control`] (checked, not yet queued).
    pub(super) fn prepare_post(&self, peer: PeerId, bytes: Vec<u8>) -> Result<Cmd> {
        if bytes.is_empty() || bytes.len() > MAX_CONTROL {
            return Err(Error::invalid(format!(
                "control message must be 1..={MAX_CONTROL} bytes"
            )));
        }
        self.check_peer(peer)?;
        Ok(Cmd::Post { peer, bytes })
    }

    /// Holds back what is posted through the returned [`Held`] and starts it all together when
    /// it is released: its control messages first, then its transfers (see [`Held`]).
    pub fn hold(&self) -> Held<'_> {
        Held::new(self)
    }

    /// Takes the next event, waiting until `deadline` (or until `cancel()` turns true, checked
    /// every 5 ms when given). `None` when the wait ended without an event.
    pub fn next_event(
        &self,
        deadline: Instant,
        cancel: Option<&dyn Fn() -> bool>,
    ) -> Option<Event> {
        let mut q = self.shared.events.lock();
        loop {
            if let Some(ev) = q.pop_front() {
                return Some(ev);
            }
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            if let Some(c) = cancel {
                // The check may take other locks (or call into this agent): never under ours.
                if parking_lot::MutexGuard::unlocked(&mut q, c) {
                    return None;
                }
                // An event may have come while the lock was let go.
                if let Some(ev) = q.pop_front() {
                    return Some(ev);
                }
            }
            let until = if cancel.is_some() {
                deadline.min(now + Duration::from_millis(5))
            } else {
                deadline
            };
            self.shared.events_cv.wait_until(&mut q, until);
        }
    }

    /// Whether `peer` is connected, failed, or unknown.
    pub fn peer_state(&self, peer: PeerId) -> Result<()> {
        self.check_peer(peer)
    }

    /// A snapshot of the progress counters.
    /// Peers whose endpoint is live now (for tests of what the agent keeps per peer).
    #[doc(hidden)]
    pub fn live_peers(&self) -> usize {
        self.shared.live_peers.lock().len()
    }

    pub fn stats(&self) -> Stats {
        let s = &self.shared.stats;
        let now = Instant::now();
        let mut in_flight = 0;
        let mut oldest: Option<Instant> = None;
        let slots: Vec<Arc<OpSlot>> = self.shared.in_flight.lock().upgraded().collect();
        for slot in slots {
            {
                if !slot.control && slot.state.lock().is_none() {
                    in_flight += 1;
                    oldest = Some(oldest.map_or(slot.started, |o| o.min(slot.started)));
                }
            }
        }
        let last = s.last_completion_ns.load(Ordering::Relaxed);
        Stats {
            ops_started: s.ops_started.load(Ordering::Relaxed),
            ops_completed: s.ops_completed.load(Ordering::Relaxed),
            ops_failed: s.ops_failed.load(Ordering::Relaxed),
            in_flight,
            bytes_in_flight: self.shared.in_flight_bytes.load(Ordering::Relaxed) as u64,
            bytes_completed: s.bytes_completed.load(Ordering::Relaxed),
            since_last_completion: (last > 0).then(|| {
                now.saturating_duration_since(self.shared.epoch + Duration::from_nanos(last))
            }),
            oldest_in_flight: oldest.map(|o| now.saturating_duration_since(o)),
            unreaped: s.unreaped.load(Ordering::Relaxed),
            wakeups: s.wakeups.load(Ordering::Relaxed),
            empty_wakeups: s.empty_wakeups.load(Ordering::Relaxed),
            caller_passes: self.shared.caller_passes.load(Ordering::Relaxed),
            backoffs: s.backoffs.load(Ordering::Relaxed),
            stale_control_dropped: s.stale_control_dropped.load(Ordering::Relaxed),
            control_batches: s.control_batches.load(Ordering::Relaxed),
            control_batched: s.control_batched.load(Ordering::Relaxed),
            control_malformed: s.control_malformed.load(Ordering::Relaxed),
            control_spoofed: s.control_spoofed.load(Ordering::Relaxed),
            stray_discarded: s.stray_discarded.load(Ordering::Relaxed),
            receive_stuck: self.shared.receive_stuck.load(Ordering::Acquire),
            worker_renewals: s.worker_renewals.load(Ordering::Relaxed),
            peer_entries: self.shared.live_peers.lock().len() as u64,
            cancel_checks: s.cancel_checks.load(Ordering::Relaxed),
        }
    }

    /// Force-closes the endpoint to `peer`: every op on it ends with an error and the peer is
    /// marked failed. The fence of last resort.
    pub fn close_peer(&self, peer: PeerId) -> Result<()> {
        self.check_peer(peer)?;
        self.shared.submit(Cmd::ForceClose(peer, None))
    }

    /// Like [`Agent::close_peer`], but returns only once the endpoint is closed and the receives
    /// posted for the peer are cancelled (bounded by `deadline`). False if the deadline passed.
    pub fn close_peer_sync(&self, peer: PeerId, deadline: Instant) -> bool {
        let r = Reply::new();
        if self
            .shared
            .submit(Cmd::ForceClose(peer, Some(r.clone())))
            .is_err()
        {
            return false;
        }
        r.wait(deadline).is_ok()
    }
}

/// How long a call waits for the progress thread to answer when its caller gave no deadline.
const ANSWER_WAIT: Duration = Duration::from_secs(10);

/// Waits for a connect command's endpoint until `deadline`, and at most [`ANSWER_WAIT`].
fn wait_for_endpoint(r: &Reply<PeerId>, deadline: Instant) -> Result<PeerId> {
    r.wait_or(deadline.min(Instant::now() + ANSWER_WAIT), || {
        Error::new(
            ErrorKind::Transport,
            "the progress thread made no endpoint by the deadline (busy or stuck)",
        )
    })
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Host memory registered with UCX ([`Agent::map`]). Not `Clone`; dropping it unmaps.
pub struct MemHandle {
    id: u64,
    addr: u64,
    len: usize,
    packed_rkey: Vec<u8>,
    shared: Arc<Shared>,
}

impl MemHandle {
    pub fn addr(&self) -> u64 {
        self.addr
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The key a peer unpacks to read or write this memory.
    pub fn packed_rkey(&self) -> &[u8] {
        &self.packed_rkey
    }
}

impl Drop for MemHandle {
    fn drop(&mut self) {
        let _ = self.shared.submit(Cmd::Unmap(self.id));
    }
}

/// A peer's memory key, bound to one endpoint and the region it was advertised for. Not
/// `Clone`; dropping it destroys the key once the puts and gets made with it have ended (each
/// op holds it until then).
pub struct RemoteKey {
    inner: Arc<RkeyInner>,
}

/// What a [`RemoteKey`] and its ops share: the key is destroyed when the last goes.
struct RkeyInner {
    id: u64,
    peer: PeerId,
    base: u64,
    len: u64,
    shared: Arc<Shared>,
}

impl Drop for RkeyInner {
    fn drop(&mut self) {
        let _ = self.shared.submit(Cmd::DestroyRkey(self.id));
    }
}

fn check_buffer(addr: usize, len: usize) -> Result<()> {
    if addr == 0 {
        return Err(Error::invalid("null buffer"));
    }
    if len == 0 {
        return Err(Error::invalid("zero-length transfer"));
    }
    if addr.checked_add(len).is_none() {
        return Err(Error::new(
            ErrorKind::OutOfBounds,
            "buffer wraps the address space",
        ));
    }
    Ok(())
}

/// A 64-bit id unique to this agent instance: time, pid and a process-wide counter mixed.
fn fresh_uid() -> u64 {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let mut x = t
        ^ ((std::process::id() as u64) << 32)
        ^ COUNTER
            .fetch_add(1, Ordering::Relaxed)
            .wrapping_mul(0x9E37_79B9_7F4A_7C15);
    // splitmix64 finaliser
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}
