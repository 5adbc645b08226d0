//! Peers on the progress thread: endpoints are created (connect, accept, bind back by worker
//! address), looked up, and failed (the error callback or a forced close: its posted requests
//! cancelled, its endpoint closed, the peer forgotten but for its id); a peer that gave up on a send
//! asks us to drain it. Messages are told apart by the endpoint they arrive on.
//!
//! # Voices
//! UCX names that endpoint (an active message's reply endpoint) from an id the sender writes
//! into the message, and the ids of a worker's endpoints are small sequential numbers: a
//! process that rewrites the id in its own UCX can have its messages handed to us as another
//! peer's. So the 8-byte header of every message we send on an endpoint is that endpoint's
//! *voice*, drawn at random when it is made and sent on no other endpoint, and a message or
//! drain is taken as a peer's only with the header the peer's first message on that endpoint
//! carried (`PeerEntry::heard`); others are dropped and counted (`Stats::control_spoofed`).
//! Only a process on the connection learns its voice (a kvlink of before voices sends its uid
//! on every endpoint, which is one header per endpoint too).
use super::callbacks::{ep_err_cb, internal_sent_cb, recv_cb, CbEvent};
use super::handles::Endpoint;
use super::op::{OpSlot, SlotKind, STOP_PEER, STOP_REMOTE_CANCEL};
use super::progress::Progress;
use super::{
    batch, sys, ucx_err, Event, PeerId, AM_BATCH_ID, AM_BIND_ID, AM_CONTROL_ID, AM_DRAIN_ID,
};
use crate::error::{Error, ErrorKind, Result};
use std::ffi::c_void;
use std::net::SocketAddr;
use std::os::raw::c_int;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The header of every message sent on one endpoint (see the module docs): shared with the
/// sends UCX holds, which read it until they end.
pub(super) type Voice = Arc<[u8; 8]>;

/// How long a drain receive waits for the abandoned message before it is cancelled.
const DRAIN_TTL: Duration = Duration::from_secs(60);

/// One live peer as the progress thread knows it (a failed one is forgotten).
pub(super) struct PeerEntry {
    /// None only while the agent tears down.
    pub(super) ep: Option<Endpoint>,
    /// Control messages to this peer that UCX holds queued.
    pub(super) held: u32,
    /// Control messages waiting for those to leave, to go as one (see `batch`).
    pub(super) batch: Vec<u8>,
    /// The header of what we send on this endpoint (see the module docs).
    pub(super) voice: Voice,
    /// The header of the peer's first message on this endpoint: the only one taken from it.
    pub(super) heard: Option<u64>,
}

impl PeerEntry {
    /// Drops what waits to be batched, as its endpoint goes (what UCX held goes with it too),
    /// and takes the waiting batch off the agent's queued sends.
    pub(super) fn drop_batch(&mut self, shared: &super::shared::Shared) {
        if !std::mem::take(&mut self.batch).is_empty() {
            shared.internal_sent();
        }
    }
}

/// What an endpoint is created from.
pub(super) enum Target<'a> {
    Sock(SocketAddr),
    Worker(&'a [u8]),
    Request(sys::ucp_conn_request_h),
}

impl Progress {
    pub(super) fn connect(&mut self, target: Target<'_>) -> Result<PeerId> {
        if self.fail_when_stuck && self.shared.receive_stuck.load(Ordering::Acquire) {
            return Err(Error::new(
                ErrorKind::Transport,
                "this agent's shared-memory receive queue is stuck (a peer process died while \
                 writing into it; docs/RELIABILITY.md): no peer could reach it",
            ));
        }
        let id = self.shared.next_peer.load(Ordering::Acquire);
        let mut ep: sys::ucp_ep_h = std::ptr::null_mut();
        let mut params = sys::ucp_ep_params_t {
            field_mask: (sys::UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE
                | sys::UCP_EP_PARAM_FIELD_ERR_HANDLER) as u64,
            err_mode: sys::UCP_ERR_HANDLING_MODE_PEER,
            err_handler: sys::ucp_err_handler_t {
                cb: Some(ep_err_cb),
                arg: id as usize as *mut c_void,
            },
            ..Default::default()
        };
        let storage;
        match target {
            Target::Sock(addr) => {
                let (s, len) = sockaddr_of(addr);
                storage = s;
                params.field_mask |=
                    (sys::UCP_EP_PARAM_FIELD_SOCK_ADDR | sys::UCP_EP_PARAM_FIELD_FLAGS) as u64;
                params.flags = sys::UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
                params.sockaddr = sys::ucs_sock_addr_t {
                    addr: &storage as *const libc::sockaddr_storage as *const sys::sockaddr,
                    addrlen: len,
                };
            }
            Target::Worker(sealed) => {
                // Only an address this kvlink sealed reaches UCX, which does not check what it
                // unpacks (`address.rs`): a dialled one, or a peer's `Bind`.
                let addr = super::address::open(sealed)?;
                params.field_mask |= sys::UCP_EP_PARAM_FIELD_REMOTE_ADDRESS as u64;
                params.address = addr.as_ptr() as *const sys::ucp_address_t;
            }
            Target::Request(req) => {
                params.field_mask |= sys::UCP_EP_PARAM_FIELD_CONN_REQUEST as u64;
                params.conn_request = req;
            }
        }
        // SAFETY: params is fully initialised for the fields in its mask; pointers in it
        // (sockaddr storage, worker address) outlive this call.
        let st = unsafe { sys::ucp_ep_create(self.worker.0, &params, &mut ep) };
        if st != sys::UCS_OK {
            return Err(ucx_err(st, "ucp_ep_create"));
        }
        self.peers.insert(
            id,
            PeerEntry {
                ep: Some(Endpoint::new(ep, self.worker.0)),
                held: 0,
                batch: Vec::new(),
                voice: Arc::new(crate::random::u64().to_le_bytes()),
                heard: None,
            },
        );
        self.ep_to_peer.insert(ep as usize, id);
        self.shared.live_peers.lock().insert(PeerId(id));
        // Published once the peer is live: no caller holds the id before this.
        self.shared.next_peer.store(id + 1, Ordering::Release);
        Ok(PeerId(id))
    }

    /// Connects to a peer by its worker address (the shared-memory way, no listener).
    pub(super) fn connect_worker(&mut self, addr: &[u8]) -> Result<PeerId> {
        let r = self.connect(Target::Worker(addr));
        if let Ok(peer) = &r {
            // The peer has no endpoint back to us yet: send it our address so it
            // connects back and can tell our messages (by endpoint) from others'.
            let me = self.shared.worker_address.lock().clone();
            self.send_internal(*peer, AM_BIND_ID, me);
        }
        r
    }

    /// A connection request arrived at our listener.
    pub(super) fn accept(&mut self, req: sys::ucp_conn_request_h) {
        if self.fail_when_stuck && self.shared.receive_stuck.load(Ordering::Acquire) {
            // Refused before UCX saw it (`connect` would refuse too): answer it, so the
            // dialler learns at once.
            if let Some(l) = &self.listener {
                // SAFETY: an unanswered connection request of our listener.
                unsafe { sys::ucp_listener_reject(l.0, req) };
            }
            return;
        }
        match self.connect(Target::Request(req)) {
            Ok(peer) => self.shared.push_event(Event::Accepted(peer, None)),
            Err(e) => tracing::warn!("accepting a connection failed: {e}"),
        }
    }

    /// A peer that connected to us by worker address sent its own: connect back. Each `Bind`
    /// is one new connection from that agent (a first one, or a redial). UCX pairs our endpoint
    /// with the dialler's (the n-th endpoint each way between two workers is one connection), so
    /// the dialler's messages arrive on the endpoint made here and are told apart by it.
    pub(super) fn bind(&mut self, address: &[u8]) {
        match self.connect(Target::Worker(address)) {
            Ok(peer) => self
                .shared
                .push_event(Event::Accepted(peer, Some(address.to_vec()))),
            Err(e) => tracing::warn!("connecting back to a peer failed: {e}"),
        }
    }

    pub(super) fn ep_of(&self, peer: PeerId) -> Result<sys::ucp_ep_h> {
        match self.peers.get(&peer.0) {
            // A failed peer's entry goes with its endpoint; its id stays failed.
            None if self.shared.was_peer(peer) => {
                Err(Error::new(ErrorKind::PeerLost, "peer has failed"))
            }
            None => Err(Error::new(
                ErrorKind::UnknownPeer,
                format!("no peer {}", peer.0),
            )),
            Some(PeerEntry { ep: None, .. }) => {
                Err(Error::new(ErrorKind::PeerLost, "peer has failed"))
            }
            Some(PeerEntry { ep: Some(e), .. }) => Ok(e.ep),
        }
    }

    /// Fails a peer: cancels the receives posted for it, closes its endpoint so its sends end
    /// too, and forgets it (its id stays failed: see `Shared::live_peers`). A peer already
    /// failed is not known any more, and nothing is done again: its ops were stopped then, and
    /// none can start on it since.
    pub(super) fn fail_peer(&mut self, peer: u64, status: sys::ucs_status_t, forced: bool) {
        let Some(mut entry) = self.peers.remove(&peer) else {
            return;
        };
        entry.drop_batch(&self.shared);
        let ep = entry.ep.take();
        self.shared.live_peers.lock().remove(&PeerId(peer));
        // Not a warning here: a close this side asked for (`forced`) has its reason logged by
        // whoever asked, and the engine warns for a failure that cost a bound rank, not for an
        // endpoint that gave way to another or was never bound.
        if forced {
            tracing::debug!(peer, "endpoint closed here: {}", sys::status_str(status));
        } else {
            tracing::info!(peer, "peer failed: {}", sys::status_str(status));
        }
        self.shared.push_event(Event::PeerFailed(PeerId(peer)));
        let slots: Vec<Arc<OpSlot>> = self
            .shared
            .in_flight
            .lock()
            .upgraded()
            .filter(|s| s.peer.0 == peer)
            .collect();
        for s in &slots {
            self.stop_slot(s, STOP_PEER);
        }
        // Its remote keys were unpacked on the endpoint: destroyed before it, as a worker's
        // move does with all of them (`handles.rs`), their ids kept as lost so that a transfer
        // still asked with one ends as the peer's loss.
        let keys: Vec<u64> = self
            .rkeys
            .iter()
            .filter(|(_, (p, _))| *p == peer)
            .map(|(id, _)| *id)
            .collect();
        for id in keys {
            drop(self.rkeys.remove(&id));
            self.lost_rkeys.insert(id);
        }
        if let Some(ep) = ep {
            // Dropping the endpoint force-closes it: every send still on it ends.
            self.forget_endpoint(ep.ep);
            drop(ep);
        }
    }

    /// Forgets the endpoint `ep`, about to be destroyed: its peer, and the callbacks' reports
    /// not yet handled that name it (a control message, a batch, a drain; counted as stale
    /// control messages). UCX may give a new endpoint the same address at once (a connection
    /// accepted in the same batch of reports): a report of the old peer's handled after that
    /// would be taken as the new peer's, and set the new peer's voice to the old one's, so that
    /// the new peer's own messages were then dropped as spoofed. Every report naming `ep` that
    /// exists now was made before the destroy; one made after it names the new endpoint.
    pub(super) fn forget_endpoint(&mut self, ep: sys::ucp_ep_h) {
        let ep = ep as usize;
        self.ep_to_peer.remove(&ep);
        let mut stale = 0u64;
        let mut keep = |ev: &CbEvent| match ev.names_endpoint(ep) {
            Some(n) => {
                stale += n;
                false
            }
            None => true,
        };
        self.cb_batch.retain(&mut keep);
        self.shared.cb_events.lock().retain(&mut keep);
        if stale > 0 {
            self.shared
                .stats
                .stale_control_dropped
                .fetch_add(stale, Ordering::Relaxed);
        }
    }

    /// Forgets the endpoint of a dial whose caller had already given up waiting for it, as a
    /// failed peer is forgotten, but closes it in flush mode. By worker address, its `Bind`
    /// still goes out: the peer pairs endpoints between two workers by their count, and a
    /// `Bind` lost here would leave the dialler's next endpoint paired with this closed one
    /// there. At a listener's address, the close waits for the connection manager's handshake
    /// (UCX ends the connection once it is made, and the peer hears), as UCX 1.13 aborted the
    /// process (`tcp_sockcm_ep.c:416`, its async thread sending the handshake's data on an
    /// endpoint force-closed meanwhile) when this close forced it at once.
    pub(super) fn close_unwanted(&mut self, peer: PeerId) {
        let ep = self.peers.get_mut(&peer.0).and_then(|e| e.ep.take());
        self.fail_peer(peer.0, sys::UCS_ERR_CANCELED, true);
        if let Some(ep) = ep {
            self.forget_endpoint(ep.ep);
            ep.close_flushed();
        }
    }

    /// A control message arrived on `ep` (UCX's reply endpoint, as the message names it) with
    /// the header `uid`. Hand it on as from that peer unless the peer has failed (then it is
    /// stale and dropped) or the header is not the peer's voice (see the module docs).
    pub(super) fn control_from(&mut self, ep: sys::ucp_ep_h, uid: u64, bytes: Vec<u8>) {
        if let Some(peer) = self.live_sender(ep, uid, 1) {
            self.shared.push_event(Event::Control(peer, bytes))
        }
    }

    /// A batch of control messages arrived on `ep` (see `batch`): each is handed on as from
    /// that peer, in order, as if it had come alone; a batch that does not split into whole
    /// messages is dropped whole.
    pub(super) fn batch_from(&mut self, ep: sys::ucp_ep_h, uid: u64, bytes: Vec<u8>) {
        let Some(msgs) = batch::split(&bytes) else {
            tracing::warn!(uid, len = bytes.len(), "malformed control batch: dropped");
            self.shared
                .stats
                .control_malformed
                .fetch_add(1, Ordering::Relaxed);
            return;
        };
        if let Some(peer) = self.live_sender(ep, uid, msgs.len() as u64) {
            for m in msgs {
                self.shared.push_event(Event::Control(peer, m.to_vec()));
            }
        }
    }

    /// The peer whose endpoint `ep` is, unless it has failed or there is none: then its `n`
    /// control messages are stale, counted and dropped. Also dropped (and counted as spoofed):
    /// a header other than the peer's voice.
    fn live_sender(&mut self, ep: sys::ucp_ep_h, uid: u64, n: u64) -> Option<PeerId> {
        match self.ep_to_peer.get(&(ep as usize)).copied() {
            Some(peer) if self.peers.contains_key(&peer) => return self.in_voice(peer, uid, n),
            Some(_) => {}
            None => tracing::warn!(
                uid,
                "control message from an agent with no endpoint: dropped"
            ),
        }
        self.shared
            .stats
            .stale_control_dropped
            .fetch_add(n, Ordering::Relaxed);
        None
    }

    /// `peer`, if `header` is its voice on its endpoint: the header its first message there
    /// carried (this one's, when it is the first). Otherwise the `n` messages are another
    /// process's that named this endpoint: dropped and counted.
    fn in_voice(&mut self, peer: u64, header: u64, n: u64) -> Option<PeerId> {
        let entry = self.peers.get_mut(&peer)?;
        let heard = *entry.heard.get_or_insert(header);
        if heard == header {
            return Some(PeerId(peer));
        }
        tracing::warn!(
            peer,
            "a message named this peer's endpoint without its header: dropped (another \
             process speaking as it)"
        );
        self.shared
            .stats
            .control_spoofed
            .fetch_add(n, Ordering::Relaxed);
        None
    }

    pub(super) fn send_drain(&mut self, peer: PeerId, tag: u64) {
        self.send_internal(peer, AM_DRAIN_ID, tag.to_le_bytes().to_vec());
    }

    /// Sends an active message nobody waits on (a drain, a bind, a posted control message);
    /// fire and forget. A control message to a peer that UCX holds an earlier one for waits in
    /// the peer's batch instead (see `batch`); anything else sends the peer's batch first.
    pub(super) fn send_internal(&mut self, peer: PeerId, id: u32, bytes: Vec<u8>) {
        let Some(e) = self.peers.get(&peer.0) else {
            return self.send_am(peer, id, bytes); // gone: dropped there, with a line
        };
        let waiting = !e.batch.is_empty();
        let batched = id == AM_CONTROL_ID
            && bytes.len() <= batch::MSG_MAX
            && e.ep.is_some()
            && (e.held > 0 || waiting);
        if waiting && (!batched || !batch::fits(&e.batch, &bytes)) {
            // Whatever waits goes first; when full, this message begins a new batch (queued by
            // UCX behind what it holds).
            self.send_batch(peer);
        }
        if !batched {
            return self.send_am(peer, id, bytes);
        }
        let Some(entry) = self.peers.get_mut(&peer.0) else {
            return;
        };
        if entry.batch.is_empty() {
            // A waiting batch counts as one queued send (`Agent::push_pending`), from its first
            // message until it is handed to UCX: an engine that is dropped waits for it as for
            // a held message.
            self.shared.internal_queued.fetch_add(1, Ordering::AcqRel);
        }
        batch::push(&mut entry.batch, &bytes);
        self.shared
            .stats
            .control_batched
            .fetch_add(1, Ordering::Relaxed);
    }

    /// Sends what waits in `peer`'s batch, if anything does.
    pub(super) fn send_batch(&mut self, peer: PeerId) {
        let Some(entry) = self.peers.get_mut(&peer.0) else {
            return;
        };
        if entry.batch.is_empty() {
            return;
        }
        let b = std::mem::take(&mut entry.batch);
        self.shared
            .stats
            .control_batches
            .fetch_add(1, Ordering::Relaxed);
        // Counted as the send it becomes (held or not) before it stops counting as waiting.
        self.send_am(peer, AM_BATCH_ID, b);
        self.shared.internal_sent();
    }

    /// One control message to `peer` that UCX held has left (or ended with its endpoint): once
    /// none is held, the batch goes.
    pub(super) fn held_sent(&mut self, peer: u64) {
        let Some(entry) = self.peers.get_mut(&peer) else {
            return;
        };
        entry.held = entry.held.saturating_sub(1);
        if entry.held == 0 {
            self.send_batch(PeerId(peer));
        }
    }

    /// An active message nobody waits on. One that UCX queues is counted in
    /// `Shared::internal_queued` (and, for its peer, in `PeerEntry::held`) until it ends: it
    /// needs progress.
    pub(super) fn send_am(&mut self, peer: PeerId, id: u32, bytes: Vec<u8>) {
        let (Ok(ep), Some(voice)) = (self.ep_of(peer), self.peers.get(&peer.0)) else {
            tracing::debug!("message for peer {}, which is gone: dropped", peer.0);
            return;
        };
        let voice = voice.voice.clone();
        let header = voice.as_ptr() as *const c_void;
        let mut param = sys::ucp_request_param_t {
            op_attr_mask: sys::UCP_OP_ATTR_FIELD_FLAGS | sys::UCP_OP_ATTR_FIELD_CALLBACK,
            flags: sys::UCP_AM_SEND_FLAG_EAGER | sys::UCP_AM_SEND_FLAG_REPLY,
            ..Default::default()
        };
        param.cb.send = Some(internal_sent_cb);
        // Counted before UCX can call back.
        self.shared.internal_queued.fetch_add(1, Ordering::AcqRel);
        // SAFETY: the message's bytes and its header stay where they are until UCX is done
        // with them: dropped below when the send completed in the call, else kept (moving a
        // vector or an Arc leaves its bytes in place) in `queued_msgs` under the request until
        // internal_sent_cb, which UCX calls from a later progress call on this worker, never
        // from this one.
        let ptr = unsafe {
            sys::ucp_am_send_nbx(
                ep,
                id,
                header,
                8,
                bytes.as_ptr() as *const c_void,
                bytes.len(),
                &param,
            )
        };
        if sys::ptr_is_ptr(ptr) {
            // Held by UCX (its queue to the peer is full): kept until the callback. A message
            // that completes in the call, as almost all do, costs no allocation of its own.
            if let Some(entry) = self.peers.get_mut(&peer.0) {
                entry.held += 1;
            }
            self.shared.hold_send(ptr as usize, peer.0, bytes, voice);
            return;
        }
        self.shared.internal_sent();
        if sys::ptr_is_err(ptr) {
            tracing::debug!(
                "message to peer {}: {}",
                peer.0,
                super::map_status(sys::ptr_status(ptr), "send")
            );
        }
    }

    /// The peer behind `ep` (the endpoint the request arrived on, in its voice `header`)
    /// asked us to drain `tag`.
    pub(super) fn drain_from(&mut self, ep: sys::ucp_ep_h, header: u64, tag: u64) {
        if let Some(peer) = self.ep_to_peer.get(&(ep as usize)).copied() {
            if let Some(PeerId(peer)) = self.in_voice(peer, header, 1) {
                self.drain(peer, tag);
            }
        }
    }

    /// The sender of `tag` gave up: cancel our receive for it, so that the abandoned message
    /// is swallowed (UCX completes a too-large message as truncated, and the sender's request
    /// completes) instead of waiting forever or sitting in the unexpected queue. With
    /// `discard_unexpected` the unmatched message is swallowed as soon as it is seen; otherwise
    /// a 1-byte receive under the tag waits for it (up to DRAIN_TTL).
    pub(super) fn drain(&mut self, peer: u64, tag: u64) {
        let slots: Vec<Arc<OpSlot>> = self
            .shared
            .in_flight
            .lock()
            .upgraded()
            .filter(|s| s.peer.0 == peer && !s.send && s.tag == tag)
            .collect();
        for s in &slots {
            self.stop_slot(s, STOP_REMOTE_CANCEL);
        }
        if !self.discard_unexpected {
            self.swallow(peer, tag, None);
        }
    }

    /// Posts a 1-byte receive into the scratch bytes that swallows one message: the next one
    /// under `tag` (from `peer`), or the unexpected message `msg` already probed. UCX completes
    /// it as truncated, the sender's request completes, and nothing is kept.
    fn swallow(&mut self, peer: u64, tag: u64, msg: Option<sys::ucp_tag_message_h>) {
        let slot = OpSlot::new(0, PeerId(peer), 1, tag, SlotKind::Control, false);
        let mut param = Self::request_param(&slot);
        param.cb.recv = Some(recv_cb);
        let scratch = self.scratch.as_mut_ptr() as *mut c_void;
        // SAFETY: the scratch bytes live as long as the worker; only truncated (discarded)
        // messages ever target them. `msg` came from ucp_tag_probe_nb with remove = 1, so it is
        // received exactly once, here.
        let ptr = unsafe {
            match msg {
                None => sys::ucp_tag_recv_nbx(self.worker.0, scratch, 1, tag, u64::MAX, &param),
                Some(m) => sys::ucp_tag_msg_recv_nbx(self.worker.0, scratch, 1, m, &param),
            }
        };
        self.track(&slot, ptr);
        self.drains.push(slot);
    }

    /// Takes every tagged message that arrived with no receive posted for it into the scratch
    /// bytes (truncated: nothing is kept, and each sender's request completes) and counts it in
    /// `Stats::stray_discarded`. Reported as `Event::StrayData` where the owner discards strays
    /// (`AgentOptions::discard_unexpected`: each pass); for an owner that keeps them this runs
    /// only as the worker is released, where they would be lost anyway. Returns how many.
    pub(super) fn discard_strays(&mut self) -> u64 {
        let mut n = 0;
        loop {
            let mut info = sys::ucp_tag_recv_info_t::default();
            // SAFETY: the worker is owned by this thread; info is written on a match.
            let msg = unsafe { sys::ucp_tag_probe_nb(self.worker.0, 0, 0, 1, &mut info) };
            if msg.is_null() {
                return n;
            }
            n += 1;
            self.swallow(0, info.sender_tag, Some(msg));
            self.shared
                .stats
                .stray_discarded
                .fetch_add(1, Ordering::Relaxed);
            if self.discard_unexpected {
                self.shared.push_event(Event::StrayData {
                    tag: info.sender_tag,
                    len: info.length,
                });
            }
        }
    }

    /// Cancels drain receives whose abandoned message never came.
    pub(super) fn expire_drains(&mut self) {
        let now = Instant::now();
        let worker = self.worker.0;
        self.drains.retain(|s| {
            if s.state.lock().is_some() {
                return false;
            }
            if now.duration_since(s.started) > DRAIN_TTL {
                let req = s.request.load(Ordering::Acquire);
                if !req.is_null() {
                    // SAFETY: live request of this worker.
                    unsafe { sys::ucp_request_cancel(worker, req) };
                }
            }
            true
        });
    }
}

pub(super) fn sockaddr_of(addr: SocketAddr) -> (libc::sockaddr_storage, u32) {
    // SAFETY: sockaddr_storage is plain old data; zeroed is a valid value.
    let mut storage: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let len = match addr {
        SocketAddr::V4(a) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: a.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from_ne_bytes(a.ip().octets()),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_storage is large enough and suitably aligned for sockaddr_in.
            unsafe { std::ptr::write(&mut storage as *mut _ as *mut libc::sockaddr_in, sin) };
            std::mem::size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(a) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: a.port().to_be(),
                sin6_flowinfo: a.flowinfo(),
                sin6_addr: libc::in6_addr {
                    s6_addr: a.ip().octets(),
                },
                sin6_scope_id: a.scope_id(),
            };
            // SAFETY: as above, for sockaddr_in6.
            unsafe { std::ptr::write(&mut storage as *mut _ as *mut libc::sockaddr_in6, sin6) };
            std::mem::size_of::<libc::sockaddr_in6>()
        }
    };
    (storage, len as u32)
}

/// # Safety
/// `s` must point to an initialised sockaddr_storage.
pub(super) unsafe fn sockaddr_port(s: *const libc::sockaddr_storage) -> u16 {
    match (*s).ss_family as c_int {
        libc::AF_INET => u16::from_be((*(s as *const libc::sockaddr_in)).sin_port),
        libc::AF_INET6 => u16::from_be((*(s as *const libc::sockaddr_in6)).sin6_port),
        _ => 0,
    }
}

/// Marks close-on-exec every socket of this process bound to `addr`'s port. UCX opens its
/// listening socket without it, so a child process started later (a helper, a worker pool)
/// would keep the port bound after the listener is destroyed, and the agent could not listen
/// there again (found when a listener is re-created after a move to a new worker). UCX does
/// not expose the descriptor, so this looks for it among the process's descriptors.
pub(super) fn close_on_exec_at(addr: SocketAddr) {
    let Ok(dir) = std::fs::read_dir("/proc/self/fd") else {
        return;
    };
    for entry in dir.flatten() {
        let Some(fd) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<c_int>().ok())
        else {
            continue;
        };
        // SAFETY: a zeroed sockaddr_storage and its size; getsockname fails harmlessly on a
        // descriptor that is not a socket (or is already closed), and fcntl only sets a flag.
        unsafe {
            let mut ss: libc::sockaddr_storage = std::mem::zeroed();
            let mut len = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
            if libc::getsockname(fd, &mut ss as *mut _ as *mut libc::sockaddr, &mut len) != 0 {
                continue;
            }
            if sockaddr_port(&ss) != addr.port() || !same_ip(&ss, addr) {
                continue;
            }
            let flags = libc::fcntl(fd, libc::F_GETFD);
            if flags >= 0 && flags & libc::FD_CLOEXEC == 0 {
                libc::fcntl(fd, libc::F_SETFD, flags | libc::FD_CLOEXEC);
            }
        }
    }
}

/// Whether `s` is bound to `addr`'s IP, or `addr` is a wildcard (any of the host's).
///
/// # Safety
/// `s` must point to an initialised sockaddr_storage.
unsafe fn same_ip(s: *const libc::sockaddr_storage, addr: SocketAddr) -> bool {
    if addr.ip().is_unspecified() {
        return true;
    }
    match ((*s).ss_family as c_int, addr) {
        (libc::AF_INET, SocketAddr::V4(a)) => {
            u32::from_be((*(s as *const libc::sockaddr_in)).sin_addr.s_addr) == u32::from(*a.ip())
        }
        (libc::AF_INET6, SocketAddr::V6(a)) => {
            (*(s as *const libc::sockaddr_in6)).sin6_addr.s6_addr == a.ip().octets()
        }
        _ => false,
    }
}

impl Progress {
    /// `transport/device` for each lane of `peer`'s endpoint, as `ucp_ep_query` reports them
    /// (where the headers have `UCP_EP_ATTR_FIELD_TRANSPORTS`: 1.22 yes, 1.13 no; else None).
    pub(super) fn peer_transports(&mut self, peer: PeerId) -> Result<Option<Vec<String>>> {
        ep_transports(self.ep_of(peer)?)
    }
}

#[cfg(kvlink_ucx_ep_transports)]
fn ep_transports(ep: sys::ucp_ep_h) -> Result<Option<Vec<String>>> {
    let mut entries = vec![sys::ucp_transport_entry_t::default(); 32];
    let mut attr = sys::ucp_ep_attr_t {
        field_mask: sys::UCP_EP_ATTR_FIELD_TRANSPORTS as u64,
        ..Default::default()
    };
    attr.transports.entries = entries.as_mut_ptr();
    attr.transports.num_entries = entries.len() as _;
    attr.transports.entry_size = std::mem::size_of::<sys::ucp_transport_entry_t>();
    // SAFETY: a live endpoint of our worker, on its thread; `entries` has room for
    // num_entries entries of entry_size bytes; UCX writes back how many it filled.
    let st = unsafe { sys::ucp_ep_query(ep, &mut attr) };
    if st != sys::UCS_OK {
        return Err(ucx_err(st, "ucp_ep_query"));
    }
    let n = (attr.transports.num_entries as usize).min(entries.len());
    Ok(Some(
        entries[..n]
            .iter()
            .map(|e| {
                // SAFETY: UCX points both names at strings it owns for the endpoint's life.
                let (t, d) = unsafe {
                    (
                        super::resources::c_str(e.transport_name),
                        super::resources::c_str(e.device_name),
                    )
                };
                format!("{t}/{d}")
            })
            .collect(),
    ))
}

#[cfg(not(kvlink_ucx_ep_transports))]
fn ep_transports(_ep: sys::ucp_ep_h) -> Result<Option<Vec<String>>> {
    Ok(None)
}
