//! The receiving (generation) side: `advertise` posts a receive per buffer and starts the
//! request; `recv_ready` gives the context rank's answer.

use super::glue::{Core, OnReap, RecvOp};
use super::waiters::{sleep, WaitKey};
use super::{key_err, BufferSpec, Engine, LONGEST_WAIT};
use crate::error::{Error, ErrorKind, Outcome, Result};
use crate::proto::peers::{PeerState, MAX_TRIES};
use crate::proto::{BufferDesc, RankId, ReceiveFlow, ReceiveSpec, RequestKey, Role};
use crate::timeline::{self, Stage};
use crate::transport::cuda::Staging;
use crate::transport::ucx::Held;
use crate::transport::PeerId;
use parking_lot::MutexGuard;
use smallvec::SmallVec;
use std::time::{Duration, Instant};

impl Engine {
    /// [`Engine::advertise_with`] with the engine's default timeout.
    ///
    /// # Safety
    /// As for [`Engine::advertise_with`].
    pub unsafe fn advertise(
        &self,
        key: RequestKey,
        receivers: Vec<RankId>,
        flows: Vec<(RankId, Vec<BufferSpec>)>,
        request_info: Vec<u8>,
    ) -> Result<()> {
        // SAFETY: forwarded caller promise.
        unsafe { self.advertise_with(key, receivers, flows, request_info, None) }
    }

    /// Generation side: posts a receive for every buffer and advertises the request to each
    /// sender, with its own deadline (`timeout` from now; `None` takes the engine's). Every
    /// rank of the request ends it by that deadline. `receivers` lists every generation rank
    /// of the request (this one included); `flows` gives, per context rank, the buffers it will
    /// fill. A sender whose connection is being re-established is waited for (up to the
    /// request's deadline); one whose round gave up gets one fresh round, and the call fails
    /// `PeerLost` if that gives up too (at once for one this rank cannot redial). The other
    /// receiving ranks whose word this one waits for (the coordinator, the lowest receiving
    /// rank; at the coordinator, every other receiver), when once connected here, are treated
    /// alike. A host buffer inside a region ([`Engine::register_region`])
    /// must lie wholly inside it (`OutOfBounds`) and off its fenced ranges (`Fenced`). A key
    /// known here is `InvalidArgument` (a replay); an older generation of a request id whose
    /// newer one runs or ended here lately is `StaleGeneration`. On error nothing stays posted
    /// or leased.
    ///
    /// # Safety
    /// Every buffer must be writable host memory that nobody else touches until [`Engine::wait`]
    /// for `key` has returned (the request's buffers are released by then, or fenced).
    pub unsafe fn advertise_with(
        &self,
        key: RequestKey,
        receivers: Vec<RankId>,
        flows: Vec<(RankId, Vec<BufferSpec>)>,
        request_info: Vec<u8>,
        timeout: Option<Duration>,
    ) -> Result<()> {
        let _span = timeline::span(Stage::AdvertiseCalled, Stage::AdvertiseReturned);
        let timeout = timeout.unwrap_or(self.timeout).min(LONGEST_WAIT);
        if timeout.is_zero() {
            return Err(key_err(ErrorKind::InvalidArgument, key, "zero timeout"));
        }
        let started = Instant::now();
        let deadline = started + timeout;
        if flows.is_empty() || flows.iter().any(|(_, b)| b.is_empty()) {
            return Err(key_err(
                ErrorKind::InvalidArgument,
                key,
                "a request needs at least one buffer per sender",
            ));
        }
        let total: usize = flows.iter().map(|(_, b)| b.len()).sum();
        for b in flows.iter().flat_map(|(_, b)| b) {
            if b.addr == 0 || b.len == 0 || b.addr.checked_add(b.len).is_none() {
                return Err(key_err(
                    ErrorKind::OutOfBounds,
                    key,
                    &format!("bad buffer {b:?}"),
                ));
            }
            usize::try_from(b.len).map_err(|_| Error::invalid("buffer too large"))?;
            // Checked here as the core checks it, before a receive is posted for the buffer
            // (below -1 would be taken for host memory there, then refused after the post).
            if b.device_id < -1 {
                return Err(key_err(
                    ErrorKind::InvalidArgument,
                    key,
                    &format!("bad device id {} (-1 for host memory)", b.device_id),
                ));
            }
        }
        // Two buffers of the request that share memory: one segment's data would land over the
        // other's, and the request would complete with one of them wrong.
        let mut spans: Vec<(i32, u64, u64)> = flows
            .iter()
            .flat_map(|(_, b)| b)
            .map(|b| (b.device_id, b.addr, b.addr + b.len))
            .collect();
        spans.sort_unstable();
        if let Some(w) = spans
            .windows(2)
            .find(|w| w[0].0 == w[1].0 && w[1].1 < w[0].2)
        {
            return Err(key_err(
                ErrorKind::InvalidArgument,
                key,
                &format!(
                    "two of its buffers overlap ({:#x}..{:#x} and {:#x}..{:#x})",
                    w[0].1, w[0].2, w[1].1, w[1].2
                ),
            ));
        }
        let mut core = self.inner.core.lock();
        let ran_here = |core: &Core| {
            (core.finished.contains_key(&(key, None)) || core.ep.knows_receive(key)).then(|| {
                key_err(
                    ErrorKind::InvalidArgument,
                    key,
                    "has already run here: a retry needs the next generation",
                )
            })
        };
        if let Some(e) = ran_here(&core) {
            return Err(e);
        }
        if total > core.pool.capacity() {
            return Err(key_err(
                ErrorKind::InvalidArgument,
                key,
                &format!(
                    "{total} buffers asked, more than the receive pool holds ({}): it never fits",
                    core.pool.capacity()
                ),
            ));
        }
        // The request's shape is checked before anything waits or is posted: misuse (this rank
        // not a receiver, a sender repeated, a segment repeated, a key that ran here) is told
        // at once, not after a wait for a sender's reconnect that it also set off.
        let shape: SmallVec<[(RankId, usize); 2]> =
            flows.iter().map(|(rank, b)| (*rank, b.len())).collect();
        let segments: SmallVec<[u32; 16]> = flows
            .iter()
            .flat_map(|(_, b)| b.iter().map(|b| b.segment))
            .collect();
        core.ep
            .check_receive(key, &receivers, &shape, &segments, request_info.len())?;
        let voters = core.ep.agreement_peers(&receivers);
        let peers = self.senders_connected(&mut core, &flows, &voters, deadline)?;
        // Waiting for a rank to reconnect lets go of the lock: another advertise of the same
        // key may have run meanwhile.
        if let Some(e) = ran_here(&core) {
            return Err(e);
        }
        // One clock read for the rest (the wait for senders above may have taken a while).
        let now = Instant::now();
        if core.pool.available() < total {
            return Err(key_err(
                ErrorKind::QueueFull,
                key,
                &format!(
                    "{total} buffers asked, {} free in the receive pool",
                    core.pool.available()
                ),
            ));
        }
        // The ids of the receives posted, inline for a request of up to 16 buffers.
        let mut posted: SmallVec<[u64; 16]> = SmallVec::with_capacity(total);
        // The receives are held back and the advertisement goes out before them (Held): it
        // does not wait for their posts, and nothing can overtake them.
        let mut held = self.inner.agent.hold();
        // SAFETY: forwarded caller promise (the buffers stay valid until the request ends).
        let result =
            unsafe { self.post_flows(&mut core, key, &flows, &peers, &mut held, &mut posted) }
                .and_then(|spec_flows| {
                    core.ep.start_receive(
                        now,
                        ReceiveSpec {
                            key,
                            receivers,
                            flows: spec_flows,
                            request_info,
                            // At least a moment: a wait for a sender's connection that
                            // ended at the deadline leaves none, and a zero timeout is refused
                            // as misuse (it read `InvalidArgument`). The request then ends
                            // `TimedOut` at once, told by `wait` as any other.
                            timeout: Some(
                                deadline
                                    .saturating_duration_since(now)
                                    .max(Duration::from_micros(1)),
                            ),
                        },
                    )
                });
        if let Err(e) = result {
            // Nothing was started, and nothing was advertised: the receives posted for it never
            // reach UCX. Dropping `held` unreleased ends each of them `Cancelled` at once (they
            // were only held), so their leases, tokens and region transfers go back here, before
            // the error is returned, not a progress pass or two later (started and then
            // cancelled, they were still leased, posted and in use in their region when the
            // call returned: a `deregister_region` right after was refused as in use by a
            // running request). Their `OpDone`s, which follow, find nothing.
            drop(held);
            self.inner.take_back_unstarted(&mut core, now, &posted);
            self.inner.flush_via(&mut core, None, now);
            return Err(e);
        }
        self.inner.flush_via(&mut core, Some(&mut held), now);
        timeline::mark(Stage::AdvertiseSent);
        // Started before anything below can cancel one of them (a cancel queued first would
        // find nothing to cancel).
        let released = held.release();
        for id in posted {
            // Started: from here the core owns the lease.
            if let Some(r) = core.recv_ops.get_mut(&id) {
                r.on_reap = None;
            }
        }
        // Anything the bookkeeping above queued (nothing, usually).
        self.inner.flush_via(&mut core, None, now);
        released
    }

    /// The endpoint of every sender of a request, waiting (until `deadline`) for those being
    /// reconnected. The other receiving ranks whose word this one waits for (`voters`: its
    /// coordinator's verdict, or at the coordinator every other receiver's vote) are
    /// reconnected and waited for alike when their connection failed: started without one, the
    /// request could only run to its deadline. One never connected here is not waited for (it
    /// may be the one that dials). Releases the lock while it waits.
    fn senders_connected(
        &self,
        core: &mut MutexGuard<'_, Core>,
        flows: &[(RankId, Vec<BufferSpec>)],
        voters: &[RankId],
        deadline: Instant,
    ) -> Result<Vec<PeerId>> {
        // The ranks this call revived: each gets one fresh round (`Peers::revive`); one that
        // gives up is lost to this call, not revived again round after round to the deadline.
        let mut revived: SmallVec<[RankId; 2]> = SmallVec::new();
        let senders = flows.iter().map(|(rank, _)| rank);
        'again: loop {
            let mut peers = Vec::with_capacity(flows.len());
            for (i, rank) in senders.clone().chain(voters.iter()).enumerate() {
                let sender = i < flows.len();
                match core.peers.state(*rank) {
                    PeerState::Connected if sender => {
                        peers.push(core.peers.endpoint(*rank).expect("connected"))
                    }
                    PeerState::Connected => {}
                    PeerState::Unknown if !sender => {}
                    PeerState::Unknown => {
                        return Err(Error::new(
                            ErrorKind::UnknownPeer,
                            format!("{rank} is not connected"),
                        ))
                    }
                    state => {
                        if state == PeerState::Failed {
                            if revived.contains(rank) {
                                return Err(Error::new(
                                    ErrorKind::PeerLost,
                                    format!(
                                        "{rank}: connection failed, and the reconnect round this \
                                         request started gave up ({MAX_TRIES} dials)"
                                    ),
                                ));
                            }
                            let now = Instant::now();
                            if !core.peers.revive(*rank, now) {
                                return Err(Error::new(
                                    ErrorKind::PeerLost,
                                    format!(
                                        "{rank}: connection failed and cannot be redialled here"
                                    ),
                                ));
                            }
                            revived.push(*rank);
                            // The round's first dial is due now, and only the sink makes it: a
                            // progress thread asleep would reach it at its next timer, up to
                            // 100 ms on.
                            self.inner.agent.wake_by(now);
                        }
                        // Timed out: the rank may have been bound as the wait ended (its wake
                        // not yet delivered), so its state decides, not the timeout.
                        if !sleep(core, WaitKey::Peer(*rank), deadline)
                            && Instant::now() >= deadline
                            && core.peers.state(*rank) != PeerState::Connected
                        {
                            return Err(Error::new(
                                ErrorKind::PeerLost,
                                format!("{rank}: not reconnected before the request's deadline"),
                            ));
                        }
                        continue 'again;
                    }
                }
            }
            return Ok(peers);
        }
    }

    /// Posts one receive per buffer of every flow (held: started when `held` is released) and
    /// leases its pool slot; returns the flows as the core takes them. Every posted receive is
    /// in `posted` with its lease in its `RecvOp::on_reap` (to go back when UCX releases it) until the
    /// caller knows the request started.
    ///
    /// # Safety
    /// As for [`Engine::advertise_with`].
    unsafe fn post_flows(
        &self,
        core: &mut Core,
        key: RequestKey,
        flows: &[(RankId, Vec<BufferSpec>)],
        peers: &[PeerId],
        held: &mut Held<'_>,
        posted: &mut SmallVec<[u64; 16]>,
    ) -> Result<Vec<ReceiveFlow>> {
        let mut spec_flows = Vec::with_capacity(flows.len());
        for ((sender, buffers), &peer) in flows.iter().zip(peers) {
            let mut flow = ReceiveFlow {
                sender: *sender,
                buffers: Vec::with_capacity(buffers.len()),
            };
            let keys = core.peers.keys(*sender).ok_or_else(|| {
                Error::new(ErrorKind::PeerLost, format!("{sender} is not connected"))
            })?;
            for b in buffers {
                let len = b.len as usize;
                // A host buffer inside a region is checked against the region's edges
                // and fenced ranges before anything is posted for it.
                let region = match b.device_id {
                    d if d >= 0 => None,
                    _ => core.regions.check(b.addr, b.len).map_err(|e| {
                        key_err(
                            e.kind,
                            key,
                            &format!("segment {}: {}", b.segment, e.message),
                        )
                    })?,
                };
                // The system UCX cannot move device memory: a CUDA buffer's receive lands in a
                // pinned host buffer that is copied to the device on arrival.
                let mut staged = match b.device_id {
                    d if d >= 0 => Some((Staging::new(d, len)?, b.addr)),
                    _ => None,
                };
                let target = match &mut staged {
                    Some((st, _)) => st.host_ptr()?,
                    None => b.addr as *mut u8,
                };
                let token = core
                    .tokens
                    .allocate()
                    .ok_or_else(|| Error::new(ErrorKind::Internal, "tokens exhausted"))?;
                // Only `sender` can name this tag: the token keyed for the pair.
                let tag = keys.inbound.tag(token);
                // Leased before the post (the pool has room: checked under this same lock), so
                // that no held op is ever dropped unstarted; a post that fails gives it back.
                let lease = core
                    .pool
                    .lease(key)
                    .ok_or_else(|| Error::new(ErrorKind::Internal, "pool emptied under lock"))?;
                // SAFETY: the caller's promise covers the buffer until the request ends (a
                // staging buffer lives in the RecvOp); its lease goes back only after this
                // receive is reaped.
                let op = match unsafe { held.post_recv_with(peer, tag, target, len, true) } {
                    Ok(op) => op,
                    Err(e) => {
                        drop(core.pool.release(lease));
                        return Err(e);
                    }
                };
                let id = op.id();
                posted.push(id);
                if let Some(r) = region {
                    // Cannot fail: `r` was found under this same lock.
                    let _ = core.regions.track(id, peer.0, true, r, b.addr, b.len);
                }
                core.by_token.insert(token, id);
                core.recv_ops.insert(
                    id,
                    RecvOp {
                        key,
                        segment: b.segment,
                        peer,
                        op,
                        staged,
                        len,
                        token,
                        tag,
                        on_reap: Some(OnReap::Release(lease)),
                        core_cancelled: false,
                    },
                );
                flow.buffers.push((
                    lease,
                    BufferDesc {
                        kind: b.kind,
                        segment: b.segment,
                        addr: b.addr,
                        len: b.len,
                        device_id: b.device_id,
                        token,
                    },
                ));
            }
            spec_flows.push(flow);
        }
        Ok(spec_flows)
    }

    /// Generation side: the context rank's answer: `Some(true)` ready, `Some(false)` rejected,
    /// `None` if none came by `deadline` (or `cancel()`), or at once if the request has already
    /// ended otherwise. The answer is the protocol core's, not consumed by asking: a second
    /// call gives it again, and once the request has ended it follows the end (`Completed`
    /// true, `Rejected` false, else `None`), before and after `wait` took it, and after the
    /// protocol core has forgotten it (as long as its replay is refused: 10 minutes, less once
    /// 2^20 keys have ended since). `UnknownRequest` at once for a key no receive here has
    /// (never advertised, its end forgotten, or an `advertise` of it on another thread still
    /// waiting for its sender), as for every other call on such a key.
    pub fn recv_ready(
        &self,
        key: RequestKey,
        deadline: Instant,
        cancel: Option<&dyn Fn() -> bool>,
    ) -> Result<Option<bool>> {
        let answer = |a: Option<bool>| Some(Ok(a));
        self.block(WaitKey::Ready(key), deadline, cancel, |core| {
            match core.terminals.get(&(key, Role::Receiver)) {
                Some(Outcome::Completed) => answer(Some(true)),
                Some(Outcome::Rejected) => answer(Some(false)),
                Some(_) => answer(None),
                None => match core.ep.receive_answer(key) {
                    Some(a) => answer(Some(a)),
                    None if !core.ep.running(key, Role::Receiver)
                        && !core.deferred.contains_key(&key) =>
                    {
                        // Forgotten by the core (its tombstone too, after its deadline, the
                        // agreement bound and the linger): the end it had is still the answer.
                        match core.finished.get(&(key, None)) {
                            Some(Outcome::Completed) => answer(Some(true)),
                            Some(Outcome::Rejected) => answer(Some(false)),
                            Some(_) => answer(None),
                            None if core.ep.knows_receive(key) => answer(None),
                            None => Some(Err(key_err(
                                ErrorKind::UnknownRequest,
                                key,
                                "no receive of this key here (never advertised, or forgotten)",
                            ))),
                        }
                    }
                    None => None,
                },
            }
        })
        .unwrap_or(Ok(None))
    }
}
