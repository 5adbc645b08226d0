//! Health and metrics (the progress snapshot and its Prometheus text), and the faults and
//! counters tests inject and read.

use super::{Engine, Health, HealthState};
use crate::error::{Error, ErrorKind, Result};
use crate::proto::peers::PeerState;
use crate::proto::RankId;
use std::time::{Duration, Instant};

impl Engine {
    /// A fault for tests: the engine's agent acts as if its shared-memory receive queue were
    /// found stuck (it moves to a new worker, unless report-only), with no writer killed.
    #[doc(hidden)]
    pub fn fault_stuck_receive_queue(&self) -> Result<()> {
        self.inner.agent.fault_stuck_receive_queue()
    }

    /// A fault for tests: the engine's progress thread stalls (see
    /// [`Agent::fault_stall_progress`](crate::transport::Agent::fault_stall_progress)).
    #[doc(hidden)]
    pub fn fault_stall_progress(&self, stall: Duration, at_next_connect: bool) -> Result<()> {
        self.inner
            .agent
            .fault_stall_progress(stall, at_next_connect)
    }

    /// For tests: how many handshakes this side has begun as the dialler (`connect`'s dials
    /// and its reconnect rounds').
    #[doc(hidden)]
    pub fn dials_begun(&self) -> u64 {
        self.inner.core.lock().counters.dials
    }

    /// A fault for tests: force-closes this side's endpoint to `rank` (as a connection that
    /// broke). `UnknownPeer` if no endpoint serves it.
    #[doc(hidden)]
    pub fn fault_close_peer(&self, rank: RankId) -> Result<()> {
        let peer = self.inner.core.lock().peers.endpoint(rank);
        let peer = peer.ok_or_else(|| Error::new(ErrorKind::UnknownPeer, format!("{rank}")))?;
        self.inner.agent.close_peer(peer)
    }

    /// For tests: the transport's counters (its agent's [`Stats`](crate::transport::Stats)).
    #[doc(hidden)]
    pub fn transport_stats(&self) -> crate::transport::Stats {
        self.inner.agent.stats()
    }

    /// For tests: the entries of every table the engine keeps (its own, the protocol core's
    /// and the peer table's), by name, to check that each stays bounded over many requests
    /// and connections.
    #[doc(hidden)]
    pub fn table_sizes(&self) -> Vec<(&'static str, usize)> {
        let core = self.inner.core.lock();
        let mut t = vec![
            ("refusal_ops", core.refusal_ops.len()),
            ("recv_ops", core.recv_ops.len()),
            ("by_token", core.by_token.len()),
            ("sends", core.sends.len()),
            ("adverts", core.adverts.len()),
            ("terminals", core.terminals.len()),
            ("answered_early", core.answered_early.len()),
            ("terminals.slots", core.terminals.slots()),
            ("waited", core.waited.len()),
            ("deferred", core.deferred.len()),
            ("fencing", core.fencing.len()),
            ("fence_closes", core.fence_closes.len()),
            ("finished", core.finished.len()),
            ("finished.slots", core.finished.slots()),
            ("superseded", core.superseded.len()),
            ("retired_sends", core.retired_sends.len()),
            ("retired_ends", core.retired_ends.len()),
            ("notes", core.notes.len()),
            ("control_ops", core.control_ops.len()),
            ("waiters", core.waiters.keys()),
            ("retired", core.retired.len()),
            ("retired.slots", core.retired.slots()),
            ("fault_cut", core.fault_cut.len()),
            ("left", core.left.len()),
            ("held_wakes", self.inner.held_wakes.lock().len()),
            ("agent.live_peers", self.inner.agent.live_peers()),
        ];
        t.extend(core.ep.table_sizes());
        t.extend(core.peers.table_sizes());
        t
    }

    /// The progress snapshot.
    pub fn health(&self) -> Health {
        let s = self.inner.agent.stats();
        let core = self.inner.core.lock();
        let ps = core.ep.stats();
        let c = core.counters;
        let now = Instant::now();
        let since_fault = c.last_fault.map(|t| now.saturating_duration_since(t));
        // Stalled for: since the last data completion, but no longer than the oldest pending op
        // has existed (new work after a quiet spell is not a stall).
        let stalled = match (s.oldest_in_flight, s.since_last_completion) {
            (None, _) => Duration::ZERO,
            (Some(age), Some(since)) => age.min(since),
            (Some(age), None) => age,
        };
        let (wedge, degraded) = self.inner.windows;
        let state = if stalled > wedge || s.receive_stuck {
            HealthState::Wedged
        } else if since_fault.is_some_and(|d| d <= degraded) {
            HealthState::Degraded
        } else {
            HealthState::Healthy
        };
        Health {
            state,
            since_last_fault_ms: since_fault.map_or(u64::MAX, |d| d.as_millis() as u64),
            peers: core.peers.connected() as u64,
            peers_failed: core.peers.failures,
            peers_reconnecting: core.peers.count(PeerState::Reconnecting) as u64,
            reconnects: core.peers.reconnects,
            requests_known: core.ep.known() as u64,
            completed: ps.completed,
            failed: ps.failed,
            stale_dropped: ps.stale_dropped + c.replays_dropped,
            // The transport's too: batches that did not split, and messages on a peer's
            // endpoint in another voice than its own (docs/SECURITY.md).
            bad_frames: ps.bad_frames + c.bad_frames + s.control_malformed + s.control_spoofed,
            adverts_refused: c.adverts_refused,
            notes_dropped: c.notes_dropped,
            buffers_leased: core.pool.leased() as u64,
            buffers_fenced: core.pool.fenced() as u64,
            ops_in_flight: s.in_flight,
            oldest_op_ms: s.oldest_in_flight.map_or(0, |d| d.as_millis() as u64),
            since_last_completion_ms: s
                .since_last_completion
                .map_or(u64::MAX, |d| d.as_millis() as u64),
            bytes_completed: s.bytes_completed,
            unreaped_ops: s.unreaped,
            unsettled_returns: c.unsettled_returns,
            foreign_data: c.foreign_data,
            late_data: c.late_data,
            refused_auth: core.peers.refusals.auth,
            refused_rank_in_use: core.peers.refusals.rank_in_use,
            refused_version: core.peers.refusals.version,
            refused_by_peer: core.peers.refusals.by_peer,
            receive_stuck: s.receive_stuck,
            worker_renewals: s.worker_renewals,
            region_fenced_bytes: core.regions.fenced_bytes(),
            region_fences: core.regions.fences(),
            resends: ps.retransmits,
            duplicates: ps.duplicates,
            unknown_dropped: ps.unknown_dropped,
            early_kept: ps.early_kept,
            ranks_forgotten: core.peers.forgotten,
            peers_left: c.peers_left,
        }
    }

    /// This engine's metrics in the Prometheus text format (version 0.0.4): requests by outcome
    /// and role, their durations, bytes moved, and the gauges and counters of [`Health`]
    /// (README, "Metrics"). Does not block beyond the engine's lock; opens no port.
    pub fn metrics_text(&self) -> Result<String> {
        self.inner.metrics.text(&self.health())
    }
}
