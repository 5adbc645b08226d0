//! Peers: where this rank is reached, `connect` and its dial (crossings with the other side's
//! dial and with this side's reconnect round), and the state and names of connected ranks.

use super::glue::{Core, Inner};
use super::waiters::{sleep, WaitKey};
use super::Engine;
use crate::error::{Error, ErrorKind, Result};
use crate::proto::peers::{PeerState, WORKER_ADDRESS_PREFIX};
use crate::proto::{RankId, Refusal};
use crate::transport::{Agent, PeerId};
use parking_lot::MutexGuard;
use std::time::{Duration, Instant};

/// How long `connect` lets its own `Refuse` go out before it returns the refusal.
const REFUSE_FLUSH: Duration = Duration::from_millis(100);

/// Dials `address` (`ip:port` or `ucx:<hex worker address>`): returns once the progress thread
/// has made the endpoint, or by `deadline` (within 10 s) if it has not.
pub(crate) fn dial(agent: &Agent, address: &str, deadline: Instant) -> Result<PeerId> {
    match address.strip_prefix(WORKER_ADDRESS_PREFIX) {
        Some(h) => agent.connect_worker_by(&unhex(h)?, deadline),
        None => agent.connect_by(crate::config::parse_listen_address(address)?, deadline),
    }
}

impl Engine {
    /// Where peers reach this rank: `ip:port` (tcp) or `ucx:<hex worker address>`. A listener
    /// at the wildcard `0.0.0.0` accepts on every interface; its `ip` here is one of this
    /// host's, since `0.0.0.0` is no address another host can dial: the first interface of the
    /// transport's devices (`tcp@eth1`, or `UCX_NET_DEVICES`) that is up with a carrier and has
    /// an IPv4 address, else the first such one that is not loopback, else 127.0.0.1
    /// (`reach.rs` has the rule). Listen
    /// at an interface's own address to publish exactly that one.
    pub fn address(&self) -> String {
        match self.published {
            Some(a) => a.to_string(),
            None => worker_address_text(&self.inner.agent.worker_address()),
        }
    }

    /// Connects to the rank at `address` (as printed by [`Engine::address`]) and waits, until
    /// `deadline`, for the handshake to bind it (`PeerLost` when it has not; at once, dialling
    /// nothing, when the deadline has already passed). Returns its rank. The engine remembers the
    /// address: if the connection fails later, it dials it again by itself (see [`PeerState`]).
    /// A handshake refused either way is `AuthFailed` (the two sides do not hold the same
    /// deployment secret), `RankInUse` (the peer, or this side, has that rank bound to another
    /// live process, or the peer is that rank itself) or `Protocol` (the two speak different wire versions: returned as soon as
    /// the refusal arrives, not at the deadline). `Transport` if this side's progress thread
    /// was too busy (or stuck) to make the endpoint by `deadline`, or within 10 s (one it makes
    /// later is closed unused: `Agent::connect_by`). Two ranks that dial each other at once (two
    /// tcp connections) end on one connection, and both `connect`s return the other's rank; a
    /// `connect` to a rank already connected (the same process, by either side's dial) returns
    /// its rank (`kvlink_proto::peers` `binding` has the rules). Only the side whose dial the
    /// pair kept redials it when that connection fails. A dial that won such a crossing and
    /// whose connection broke before it bound is dialled once more, within the deadline (the
    /// other side's dial was refused for it, so no connection would be left; the redial proves
    /// the broken dial's session, so a peer still holding that connection takes it as the same
    /// process coming back), and the other side's `connect` waits for that dial, up to 5 s
    /// after that connection broke (`kvlink_proto::peers::REDIAL_WAIT`). Either ends `PeerLost`
    /// when that does not connect the pair: the redial refused, or no redial in time (connect
    /// again). A `connect` and this side's reconnect round never dial one address side by side:
    /// a `connect` to the address the round is dialling waits for that dial and returns the
    /// rank when it binds (if it ends without binding, the `connect` dials in its place), and no
    /// round dials an address while a `connect`'s dial to it runs. A `connect` whose dial meets
    /// another dial of this side to the same rank through another of its addresses (the round
    /// dials a peer that moved to a new worker at its worker address, say): if its own dial
    /// gives way, it waits for the other and returns the rank when that binds (`PeerLost` if
    /// the round gives up).
    pub fn connect(&self, address: &str, deadline: Instant) -> Result<RankId> {
        if Instant::now() >= deadline {
            return Err(Error::new(
                ErrorKind::PeerLost,
                format!("{address}: the deadline had passed; nothing was dialled"),
            ));
        }
        let mut dialling = Connecting::begin(&self.inner, address);
        let mut core = self.inner.core.lock();
        let mut joined: Option<RankId> = None;
        loop {
            if let Some(rank) = joined.filter(|r| core.peers.state(*r) == PeerState::Connected) {
                // The round's dial this waited for bound it (or another dial did meanwhile).
                return Ok(rank);
            }
            // This side's reconnect round is dialling the rank: wait for its dial (if that
            // ends unbound, or there is none, dial).
            let Some(rank) = core.peers.round_dialling(address) else {
                break;
            };
            if joined.replace(rank).is_none() {
                tracing::info!(
                    peer = rank.0,
                    "{address}: the reconnect round is dialling {rank}; connect waits for its dial"
                );
            }
            if !sleep(&mut core, WaitKey::Peer(rank), deadline) && Instant::now() >= deadline {
                // Bound as the wait timed out (the wake not yet delivered): connected.
                if core.peers.state(rank) == PeerState::Connected {
                    return Ok(rank);
                }
                return Err(Error::new(
                    ErrorKind::PeerLost,
                    format!(
                        "{address}: this side's reconnect round was dialling {rank}, and its dial \
                         had not bound by the deadline"
                    ),
                ));
            }
        }
        drop(core);
        if joined.is_some() && Instant::now() >= deadline {
            // The round's dial this waited for ended unbound at the very end: no time is left
            // for a dial of its own (one started now would fail as if the progress thread
            // were stuck: `Transport`).
            return Err(Error::new(
                ErrorKind::PeerLost,
                format!("{address}: the reconnect round's dial ended unbound at the deadline"),
            ));
        }
        let r = self.dial_and_bind(address, deadline, &mut dialling);
        drop(dialling);
        r
    }

    /// [`Engine::connect`]'s own dial, from the dial to its end: `dialling` is ended when it
    /// gives way (what it waits for then may be the round's dial).
    fn dial_and_bind(
        &self,
        address: &str,
        deadline: Instant,
        dialling: &mut Connecting<'_>,
    ) -> Result<RankId> {
        let mut moves = self.inner.agent.worker_moves_begun();
        let mut peer = dial(&self.inner.agent, address, deadline)?;
        let mut core = self.inner.core.lock();
        self.inner.say_hello(&mut core, peer)?;
        // After the hello: one that failed left no handshake to bind, nor anything to remove
        // the entry (the lock is held, so the bind cannot come in between).
        core.peers.connect_dialled(peer, address);
        let mut redialled = false;
        loop {
            if let Some(r) = core.peers.rank_of(peer) {
                core.peers.set_dial(r, address);
                return Ok(r);
            }
            if let Some(rank) = core.peers.take_gave_way(peer) {
                // The rank dialled this side while this dial ran, and the pair keeps its
                // connection (`Peers::on_handshake`): connected once that one is bound.
                // Its address is not kept for redials: the side whose dial was kept redials.
                dialling.end(&mut core);
                return wait_for_crossing(&mut core, rank, address, deadline);
            }
            if let Some(reason) = core.peers.refusal(peer) {
                // Let our own `Refuse` (if we sent one) go out, then close the endpoint: a
                // retry starts on an endpoint of its own.
                let sent = core.refusal_ops.remove(&peer);
                let by_peer = sent.is_none();
                drop(core);
                if let Some(mut op) = sent {
                    let _ = op.wait((Instant::now() + REFUSE_FLUSH).min(deadline), None);
                }
                let _ = self.inner.agent.close_peer(peer);
                if redialled && by_peer && reason == Refusal::RankInUse {
                    // The rank this side is held there is most likely our own broken first
                    // connection, which the peer has not found dead yet (keepalive).
                    return Err(Error::new(
                        ErrorKind::PeerLost,
                        format!(
                            "{address}: the connection of a dial that won a crossing broke before \
                             it bound, and the peer refused the dial made again: it still holds \
                             the broken one (it finds it dead by keepalive; connect again then)"
                        ),
                    ));
                }
                return Err(Error::new(
                    reason.kind(),
                    format!(
                        "{address}: handshake refused ({reason:?}): {}",
                        reason.describe()
                    ),
                ));
            }
            if self.inner.agent.peer_state(peer).is_err() {
                let now_moves = self.inner.agent.worker_moves_begun();
                let won_tie = core.peers.take_won_tie(peer).filter(|_| !redialled);
                if let Some(w) =
                    won_tie.filter(|w| core.peers.state(w.rank) == PeerState::Connected)
                {
                    // Bound meanwhile through another connection: the pair is connected.
                    return Ok(w.rank);
                }
                if Instant::now() >= deadline || now_moves == moves && won_tie.is_none() {
                    return Err(Error::new(
                        ErrorKind::PeerLost,
                        format!("{address}: connection failed"),
                    ));
                }
                if let Some(w) = won_tie {
                    // This dial won a tie against the rank's dial the other way, which was
                    // refused for it, and then its connection broke before it bound: neither
                    // connection is left. Dial once more (`Peers::take_won_tie`).
                    tracing::info!(
                        "{address}: the connection of a dial that won a crossing with {} broke \
                         before it bound; dialling again",
                        w.rank
                    );
                    redialled = true;
                }
                // Or this agent is moving to a new worker (its shared-memory receive queue was
                // stuck, which is why no hello came): dial again, from the new one (the dial is
                // a command, run after the pass that moves).
                moves = now_moves;
                drop(core);
                peer = dial(&self.inner.agent, address, deadline)?;
                core = self.inner.core.lock();
                self.inner.say_hello(&mut core, peer)?;
                core.peers.connect_dialled(peer, address);
                if let Some(w) = won_tie {
                    // Its `Proof` proves the broken dial's session (`Peers::redial`).
                    core.peers.redial(peer, w);
                }
                continue;
            }
            if !sleep(&mut core, WaitKey::Dial(peer), deadline) && Instant::now() >= deadline {
                // Bound as the wait timed out (the sink's wake not yet delivered): the dial
                // succeeded, and is recorded as the rank's, so a later failure redials it.
                if let Some(r) = core.peers.rank_of(peer) {
                    core.peers.set_dial(r, address);
                    return Ok(r);
                }
                // A peer process that died while writing into our shared-memory receive queue
                // can leave this process deaf on shared memory (UCX; docs/RELIABILITY.md).
                let hint = if self.inner.shared_memory && core.peers.failures > 0 {
                    "; a peer was lost earlier, and on shared memory a peer killed mid-write \
                     can leave this process unable to receive until the probe finds it, or for \
                     good in report-only mode (docs/RELIABILITY.md)"
                } else {
                    ""
                };
                return Err(Error::new(
                    ErrorKind::PeerLost,
                    format!("{address}: no hello before the deadline{hint}"),
                ));
            }
        }
    }

    /// Waits until `rank` is connected (its `Hello` arrived), up to `deadline`.
    pub fn wait_peer(&self, rank: RankId, deadline: Instant) -> Result<()> {
        self.block(WaitKey::Peer(rank), deadline, None, |core| {
            (core.peers.state(rank) == PeerState::Connected).then_some(())
        })
        .ok_or_else(|| Error::new(ErrorKind::UnknownPeer, format!("{rank} did not connect")))
    }

    /// The state of this rank's connection to `rank`.
    pub fn peer_state(&self, rank: RankId) -> PeerState {
        self.inner.core.lock().peers.state(rank)
    }

    /// The name a connected rank gave in its `Hello`.
    pub fn peer_name(&self, rank: RankId) -> Option<String> {
        self.inner.core.lock().peers.name(rank)
    }
}

/// A `connect` dialling an address ([`kvlink_proto::peers::Peers::connect_begins`]): no
/// reconnect round dials that address until it ends, when its dial gives way or it returns.
struct Connecting<'a> {
    inner: &'a Inner,
    address: Option<&'a str>,
}

impl<'a> Connecting<'a> {
    fn begin(inner: &'a Inner, address: &'a str) -> Self {
        inner.core.lock().peers.connect_begins(address);
        Connecting {
            inner,
            address: Some(address),
        }
    }

    fn end(&mut self, core: &mut Core) {
        if let Some(a) = self.address.take() {
            core.peers.connect_ends(a);
        }
    }
}

impl Drop for Connecting<'_> {
    /// Takes the core's lock: drop it where the lock is not held.
    fn drop(&mut self) {
        if let Some(a) = self.address.take() {
            self.inner.core.lock().peers.connect_ends(a);
        }
    }
}

/// `connect`'s wait after its dial gave way to `rank`'s dial the other way (or to another dial
/// of this side, or to this side's reconnect round): until that one is bound, or ends, or (when
/// its connection broke) `REDIAL_WAIT` passes without the redial, and by `deadline`.
fn wait_for_crossing(
    core: &mut MutexGuard<'_, Core>,
    rank: RankId,
    address: &str,
    deadline: Instant,
) -> Result<RankId> {
    loop {
        if core.peers.state(rank) == PeerState::Connected {
            return Ok(rank);
        }
        // A redial expected from the rank is waited for a while, not to the deadline.
        let now = Instant::now();
        let until = core
            .peers
            .redial_expected_until(rank, now)
            .map_or(deadline, |t| t.min(deadline));
        if core.peers.waiting_for_crossing(rank, now)
            && (sleep(core, WaitKey::Peer(rank), until) || Instant::now() < deadline)
        {
            continue;
        }
        // Bound as the wait timed out (the wake not yet delivered): connected.
        if core.peers.state(rank) == PeerState::Connected {
            return Ok(rank);
        }
        return Err(if core.peers.redial_was_expected(rank) {
            Error::new(
                ErrorKind::PeerLost,
                format!(
                    "{address}: {rank} dialled this side at the same time, this dial gave way to \
                     its, and that connection broke; its redial did not come in time (connect \
                     again)"
                ),
            )
        } else if core.peers.state(rank) == PeerState::Failed {
            // The connection it gave way to (the rank's dial, another of ours, or this side's
            // reconnect round) ended without binding the rank.
            Error::new(
                ErrorKind::PeerLost,
                format!(
                    "{address}: this dial gave way to another connection to {rank}, which \
                     failed (connect again)"
                ),
            )
        } else {
            Error::new(
                ErrorKind::RankInUse,
                format!(
                    "{address}: this dial gave way to another connection to {rank} (its dial \
                     the other way, or another of this side's), which did not complete"
                ),
            )
        });
    }
}

/// A worker address as a rank's address text: `ucx:<hex>` ([`dial`] reads it back).
pub(super) fn worker_address_text(address: &[u8]) -> String {
    // One allocation, not one per byte: a peer's `Bind` (up to 64 KiB) is written out here on
    // the progress thread.
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut text = String::with_capacity(WORKER_ADDRESS_PREFIX.len() + 2 * address.len());
    text.push_str(WORKER_ADDRESS_PREFIX);
    for b in address {
        text.push(HEX[usize::from(b >> 4)] as char);
        text.push(HEX[usize::from(b & 15)] as char);
    }
    text
}

/// Hex digits to bytes; any other character (non-ASCII included) is an `InvalidArgument`.
fn unhex(s: &str) -> Result<Vec<u8>> {
    let bad = || Error::invalid("a worker address is an even number of hex digits after 'ucx:'");
    let digits = s.as_bytes();
    if digits.is_empty() || digits.len() % 2 != 0 {
        return Err(bad());
    }
    let nibble = |c: u8| (c as char).to_digit(16).map(|d| d as u8).ok_or_else(bad);
    digits
        .chunks(2)
        .map(|p| Ok(nibble(p[0])? << 4 | nibble(p[1])?))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unhex_refuses_odd_non_hex_and_non_ascii_without_panicking() {
        assert_eq!(unhex("00ff7a").unwrap(), vec![0, 255, 0x7a]);
        let text = worker_address_text(&[1, 2, 254]);
        assert!(crate::proto::peers::is_worker_address(&text), "{text}");
        let h = text.strip_prefix(WORKER_ADDRESS_PREFIX).unwrap();
        assert_eq!(unhex(h).unwrap(), vec![1, 2, 254]);
        let every: Vec<u8> = (0..=255).collect();
        let text = worker_address_text(&every);
        let h = text.strip_prefix(WORKER_ADDRESS_PREFIX).unwrap();
        assert_eq!(unhex(h).unwrap(), every);
        for bad in ["", "0", "0g", "é1", "1é", "ééé"] {
            assert_eq!(
                unhex(bad).unwrap_err().kind,
                ErrorKind::InvalidArgument,
                "{bad}"
            );
        }
    }
}
