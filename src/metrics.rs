//! Metrics: one engine's counters, gauges and histogram in the Prometheus text format
//! (version 0.0.4), from one call ([`crate::engine::Engine::metrics_text`]). kvlink opens no
//! port: the host serves the text however it serves its own.
//!
//! Encoded by `prometheus-client`, the Prometheus project's own Rust client. What happens to a
//! request (its outcome and duration) is counted as it ends, on the progress thread; the rest is
//! read from [`Health`] when the text is asked for. Counters taken from `Health` only ever move
//! forward.
use std::time::Duration;

use parking_lot::Mutex;
use prometheus_client::encoding::prometheus_text;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::{Registry, Unit};

use crate::engine::Health;
use crate::error::{Error, ErrorKind, Outcome, Result};
use crate::proto::Role;

type Labels2 = [(&'static str, &'static str); 2];
type Labels1 = [(&'static str, &'static str); 1];

const OUTCOMES: [Outcome; 5] = [
    Outcome::Completed,
    Outcome::TimedOut,
    Outcome::Cancelled,
    Outcome::PeerLost,
    Outcome::Rejected,
];
const ROLES: [&str; 2] = ["receiver", "sender"];

/// The `outcome` label value of an outcome.
pub fn outcome_label(o: Outcome) -> &'static str {
    match o {
        Outcome::Completed => "completed",
        Outcome::TimedOut => "timed_out",
        Outcome::Cancelled => "cancelled",
        Outcome::PeerLost => "peer_lost",
        Outcome::Rejected => "rejected",
    }
}

pub(crate) fn role_label(r: Role) -> &'static str {
    match r {
        Role::Receiver => "receiver",
        Role::Sender { .. } => "sender",
    }
}

fn duration_histogram() -> Histogram {
    // 1 ms .. 65 s, doubling: a transfer on loopback up to a request's whole deadline.
    Histogram::new(exponential_buckets(0.001, 2.0, 17))
}

/// One engine's metrics.
pub(crate) struct Metrics {
    registry: Registry,
    /// The members of the request families, fetched once: an end adds to one without looking
    /// its labels up (hashing them, taking the family's lock) on the path of every request.
    /// `[outcome][role]` in the order of `OUTCOMES` and `ROLES`.
    requests_by: [[Counter; 2]; 5],
    duration_by: [Histogram; 2],
    bytes: Counter,
    stale: Counter,
    bad: Counter,
    resends: Counter,
    duplicates: Counter,
    unknown: Counter,
    early: Counter,
    forgotten: Counter,
    left: Counter,
    log_dropped: Counter,
    peer_failures: Counter,
    reconnects: Counter,
    foreign: Counter,
    late: Counter,
    renewals: Counter,
    refused: Family<Labels1, Counter>,
    refused_by_peer: Counter,
    ops: Gauge,
    leased: Gauge,
    fenced: Gauge,
    state: Gauge,
    stuck: Gauge,
    region_fenced: Gauge,
    /// Serialises the catch-up from `Health` and the encoding (two scrapes at once would
    /// otherwise both add the same increment).
    scrape: Mutex<()>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Metrics")
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("kvlink");
        let requests = Family::<Labels2, Counter>::default();
        let duration: Family<Labels1, Histogram, fn() -> Histogram> =
            Family::new_with_constructor(duration_histogram);
        // Every outcome and role exists from the start, at 0 (a dashboard's rate() sees the
        // first one): made here, where the ends' counters are fetched.
        let requests_by = OUTCOMES.map(|o| {
            ROLES.map(|r| {
                requests
                    .get_or_create(&[("outcome", outcome_label(o)), ("role", r)])
                    .clone()
            })
        });
        let duration_by = ROLES.map(|r| duration.get_or_create(&[("role", r)]).clone());
        let m = Metrics {
            requests_by,
            duration_by,
            bytes: Counter::default(),
            stale: Counter::default(),
            bad: Counter::default(),
            resends: Counter::default(),
            duplicates: Counter::default(),
            unknown: Counter::default(),
            early: Counter::default(),
            forgotten: Counter::default(),
            left: Counter::default(),
            log_dropped: Counter::default(),
            peer_failures: Counter::default(),
            reconnects: Counter::default(),
            foreign: Counter::default(),
            late: Counter::default(),
            renewals: Counter::default(),
            refused: Family::default(),
            refused_by_peer: Counter::default(),
            ops: Gauge::default(),
            leased: Gauge::default(),
            fenced: Gauge::default(),
            state: Gauge::default(),
            stuck: Gauge::default(),
            region_fenced: Gauge::default(),
            scrape: Mutex::new(()),
            registry: Registry::default(),
        };
        registry.register(
            "requests",
            "Requests ended on this rank, by outcome and by this rank's role in them",
            requests,
        );
        registry.register_with_unit(
            "request_duration",
            "From a request's start (advertise on the receiver, the advertisement's arrival on the sender) to its end",
            Unit::Seconds,
            duration,
        );
        registry.register_with_unit(
            "transfer",
            "Bytes moved by completed transfers (both directions)",
            Unit::Bytes,
            m.bytes.clone(),
        );
        registry.register(
            "ops_in_flight",
            "Transport operations in flight",
            m.ops.clone(),
        );
        registry.register(
            "buffers_leased",
            "Receive buffers leased to a running request (0 when idle)",
            m.leased.clone(),
        );
        registry.register(
            "buffers_fenced",
            "Receive buffers fenced until the transport releases them",
            m.fenced.clone(),
        );
        registry.register(
            "health_state",
            "health().state: 0 healthy, 1 degraded, 2 wedged",
            m.state.clone(),
        );
        registry.register(
            "receive_queue_stuck",
            "1 while this process's shared-memory receive queue is stuck (a peer died or was stopped mid-write; see docs/RELIABILITY.md)",
            m.stuck.clone(),
        );
        registry.register_with_unit(
            "region_fenced",
            "Region bytes fenced until the transport releases their transfers (refused to new receives meanwhile)",
            Unit::Bytes,
            m.region_fenced.clone(),
        );
        registry.register(
            "stale_frames",
            "Messages from an older generation of a request still known, and replayed messages, dropped",
            m.stale.clone(),
        );
        registry.register(
            "unknown_frames",
            "Messages for a request this rank does not know (forgotten with its tombstone expired, or never started here), dropped",
            m.unknown.clone(),
        );
        registry.register(
            "early_frames",
            "Votes and failure verdicts that came for a request before it had started here, kept for its start",
            m.early.clone(),
        );
        registry.register(
            "ranks_forgotten",
            "Ranks that dialled this side and failed, forgotten to bound the peer table",
            m.forgotten.clone(),
        );
        registry.register(
            "log_records_dropped",
            "Log records dropped because the host's log sink fell behind or formatting one panicked (the whole process's, not this engine's alone)",
            m.log_dropped.clone(),
        );
        registry.register(
            "peers_left",
            "Connections whose peer said it was leaving (its engine was dropped), ended at once",
            m.left.clone(),
        );
        registry.register(
            "duplicate_frames",
            "Messages and landings that repeated one already handled (a resend that crossed its answer), dropped",
            m.duplicates.clone(),
        );
        registry.register(
            "control_resends",
            "Control messages sent again because their answer had not come (advertisements and failure verdicts, backed off; votes, verdict pulls)",
            m.resends.clone(),
        );
        registry.register(
            "bad_frames",
            "Control messages that failed to decode, came from an unknown peer, or could not be true (a Completed verdict before this rank's own landings)",
            m.bad.clone(),
        );
        registry.register(
            "peer_failures",
            "Connection failures seen",
            m.peer_failures.clone(),
        );
        registry.register(
            "reconnects",
            "Dial attempts to reconnect a failed peer",
            m.reconnects.clone(),
        );
        registry.register(
            "foreign_data",
            "Tagged data under a tag no receive here was offered for (a process that is not the buffer's peer), discarded unlanded",
            m.foreign.clone(),
        );
        registry.register(
            "late_data",
            "Tagged data for a receive that had already ended, discarded",
            m.late.clone(),
        );
        registry.register(
            "worker_renewals",
            "Moves to a new UCX worker (a fresh shared-memory receive queue) after the old queue was found stuck; each fails every peer and changes the worker address",
            m.renewals.clone(),
        );
        for r in ["auth_failed", "rank_in_use", "wire_version"] {
            let _ = m.refused.get_or_create(&[("reason", r)]);
        }
        registry.register(
            "peers_refused",
            "Handshakes this rank refused, by reason",
            m.refused.clone(),
        );
        registry.register(
            "refused_by_peer",
            "Handshakes a peer refused",
            m.refused_by_peer.clone(),
        );
        Metrics { registry, ..m }
    }

    /// A request ended on this rank as `role`; `took` is from its start, when known.
    pub fn ended(&self, role: Role, outcome: Outcome, took: Option<Duration>) {
        let r = match role {
            Role::Receiver => 0,
            Role::Sender { .. } => 1,
        };
        // The order of OUTCOMES (a new outcome fails to compile here until it has its place).
        let o = match outcome {
            Outcome::Completed => 0,
            Outcome::TimedOut => 1,
            Outcome::Cancelled => 2,
            Outcome::PeerLost => 3,
            Outcome::Rejected => 4,
        };
        self.requests_by[o][r].inc();
        if let Some(d) = took {
            self.duration_by[r].observe(d.as_secs_f64());
        }
    }

    /// The text, after bringing the values read from `h` up to date.
    pub fn text(&self, h: &Health) -> Result<String> {
        let _one = self.scrape.lock();
        let gauge = |g: &Gauge, v: u64| {
            g.set(i64::try_from(v).unwrap_or(i64::MAX));
        };
        gauge(&self.ops, h.ops_in_flight);
        gauge(&self.leased, h.buffers_leased);
        gauge(&self.fenced, h.buffers_fenced);
        gauge(&self.state, h.state as u64);
        gauge(&self.stuck, u64::from(h.receive_stuck));
        gauge(&self.region_fenced, h.region_fenced_bytes);
        // Monotonic: only the increase since the last scrape is added.
        let catch_up = |c: &Counter, v: u64| {
            c.inc_by(v.saturating_sub(c.get()));
        };
        catch_up(&self.bytes, h.bytes_completed);
        catch_up(&self.stale, h.stale_dropped);
        catch_up(&self.bad, h.bad_frames);
        catch_up(&self.resends, h.resends);
        catch_up(&self.duplicates, h.duplicates);
        catch_up(&self.unknown, h.unknown_dropped);
        catch_up(&self.early, h.early_kept);
        catch_up(&self.forgotten, h.ranks_forgotten);
        catch_up(&self.left, h.peers_left);
        catch_up(&self.log_dropped, crate::log::records_dropped());
        catch_up(&self.peer_failures, h.peers_failed);
        catch_up(&self.reconnects, h.reconnects);
        catch_up(&self.foreign, h.foreign_data);
        catch_up(&self.late, h.late_data);
        catch_up(&self.renewals, h.worker_renewals);
        catch_up(
            &self.refused.get_or_create(&[("reason", "auth_failed")]),
            h.refused_auth,
        );
        catch_up(
            &self.refused.get_or_create(&[("reason", "rank_in_use")]),
            h.refused_rank_in_use,
        );
        catch_up(
            &self.refused.get_or_create(&[("reason", "wire_version")]),
            h.refused_version,
        );
        catch_up(&self.refused_by_peer, h.refused_by_peer);
        let mut out = String::new();
        prometheus_text::encode(&mut out, &self.registry)
            .map_err(|e| Error::new(ErrorKind::Internal, format!("metrics encoding: {e}")))?;
        Ok(out)
    }
}

/// The `Content-Type` a host serving `Metrics::text` over HTTP should send.
pub const CONTENT_TYPE: &str = prometheus_text::CONTENT_TYPE;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::HealthState;
    use crate::proto::RankId;

    fn value(text: &str, series: &str) -> Option<f64> {
        text.lines()
            .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
    }

    #[test]
    fn names_labels_and_values_as_documented() {
        let m = Metrics::new();
        let sender = Role::Sender {
            receiver: RankId(1),
        };
        m.ended(
            Role::Receiver,
            Outcome::Completed,
            Some(Duration::from_millis(3)),
        );
        m.ended(
            Role::Receiver,
            Outcome::Completed,
            Some(Duration::from_millis(5)),
        );
        m.ended(
            Role::Receiver,
            Outcome::TimedOut,
            Some(Duration::from_secs(2)),
        );
        m.ended(sender, Outcome::Rejected, None);
        let mut h = Health {
            state: HealthState::Degraded,
            ops_in_flight: 4,
            buffers_leased: 9,
            buffers_fenced: 1,
            bytes_completed: 1000,
            stale_dropped: 2,
            bad_frames: 3,
            peers_failed: 1,
            reconnects: 5,
            foreign_data: 6,
            refused_rank_in_use: 7,
            refused_version: 8,
            resends: 11,
            duplicates: 12,
            unknown_dropped: 13,
            early_kept: 14,
            ranks_forgotten: 15,
            peers_left: 16,
            ..Health::default()
        };
        let t = m.text(&h).unwrap();
        let v = |s: &str| value(&t, s).unwrap_or_else(|| panic!("{s} missing in\n{t}"));
        assert_eq!(
            v(r#"kvlink_requests_total{outcome="completed",role="receiver"}"#),
            2.0
        );
        assert_eq!(
            v(r#"kvlink_requests_total{outcome="timed_out",role="receiver"}"#),
            1.0
        );
        assert_eq!(
            v(r#"kvlink_requests_total{outcome="rejected",role="sender"}"#),
            1.0
        );
        assert_eq!(
            v(r#"kvlink_requests_total{outcome="peer_lost",role="sender"}"#),
            0.0
        );
        assert_eq!(
            v(r#"kvlink_request_duration_seconds_count{role="receiver"}"#),
            3.0
        );
        assert_eq!(
            v(r#"kvlink_request_duration_seconds_count{role="sender"}"#),
            0.0
        );
        assert_eq!(v("kvlink_transfer_bytes_total"), 1000.0);
        assert_eq!(v("kvlink_ops_in_flight"), 4.0);
        assert_eq!(v("kvlink_buffers_leased"), 9.0);
        assert_eq!(v("kvlink_buffers_fenced"), 1.0);
        assert_eq!(v("kvlink_health_state"), 1.0);
        assert_eq!(v("kvlink_receive_queue_stuck"), 0.0);
        assert_eq!(v("kvlink_region_fenced_bytes"), 0.0);
        assert_eq!(v("kvlink_stale_frames_total"), 2.0);
        assert_eq!(v("kvlink_bad_frames_total"), 3.0);
        assert_eq!(v("kvlink_control_resends_total"), 11.0);
        assert_eq!(v("kvlink_duplicate_frames_total"), 12.0);
        assert_eq!(v("kvlink_unknown_frames_total"), 13.0);
        assert_eq!(v("kvlink_early_frames_total"), 14.0);
        assert_eq!(v("kvlink_ranks_forgotten_total"), 15.0);
        assert_eq!(v("kvlink_peers_left_total"), 16.0);
        assert_eq!(
            v("kvlink_log_records_dropped_total"),
            crate::log::records_dropped() as f64
        );
        assert_eq!(v("kvlink_peer_failures_total"), 1.0);
        assert_eq!(v("kvlink_reconnects_total"), 5.0);
        assert_eq!(v("kvlink_foreign_data_total"), 6.0);
        assert_eq!(v("kvlink_late_data_total"), 0.0);
        assert_eq!(
            v(r#"kvlink_peers_refused_total{reason="rank_in_use"}"#),
            7.0
        );
        assert_eq!(
            v(r#"kvlink_peers_refused_total{reason="auth_failed"}"#),
            0.0
        );
        assert_eq!(
            v(r#"kvlink_peers_refused_total{reason="wire_version"}"#),
            8.0
        );
        assert!(
            t.contains("# TYPE kvlink_request_duration_seconds histogram"),
            "{t}"
        );
        // Counters never go back, whatever the snapshot says; gauges follow it.
        h.bytes_completed = 10;
        h.buffers_leased = 0;
        h.receive_stuck = true;
        let t = m.text(&h).unwrap();
        assert_eq!(value(&t, "kvlink_transfer_bytes_total"), Some(1000.0));
        assert_eq!(value(&t, "kvlink_buffers_leased"), Some(0.0));
        assert_eq!(value(&t, "kvlink_receive_queue_stuck"), Some(1.0));
        h.bytes_completed = 1500;
        let t = m.text(&h).unwrap();
        assert_eq!(value(&t, "kvlink_transfer_bytes_total"), Some(1500.0));
    }
}
