//! What a run measured: the result rows, the line each peer process reports, and the ways
//! they are written out (table, JSON, CSV).
use crate::pacing::PACED;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;

/// What the measuring peer process (the generation side, or the transport sender) reports on
/// its `RESULT` line, and the context side on its `CTX` lines.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct PeerResult {
    /// Requests (or transfers) started, warm-up included.
    pub started: u64,
    /// Requests planned, warm-up included.
    pub planned: u64,
    pub completed: u64,
    /// How the requests that did not complete ended: outcome name or error kind -> count.
    pub failures: BTreeMap<String, u64>,
    /// Completed requests whose bytes were not the ones sent.
    pub corrupt: u64,
    /// Per round (warm-up included): requests in the round, how many completed, µs per request.
    pub rounds: Vec<Round>,
    /// µs per request over the measured rounds that fully completed: p50 and p99.
    pub us_p50: Option<f64>,
    pub us_p99: Option<f64>,
    /// Latency of one request, from advertise to the receiver's `Completed` (µs).
    pub lat_p50: Option<f64>,
    pub lat_p99: Option<f64>,
    /// GB/s (1e9 bytes/s) over the measured rounds that fully completed.
    pub gbps: Option<f64>,
    /// The process stopped at its time limit with requests still pending.
    pub stopped_at_limit: bool,
    /// The first few errors, as text.
    pub errors: Vec<String>,
    /// `Engine::health()` at the end (Debug text: its fields belong to the engine).
    pub health: Option<String>,
    /// The round in progress and when it started (moved into `rounds` if the time limit
    /// stops it).
    #[serde(skip)]
    pub current: Option<(Round, std::time::Instant)>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Round {
    pub requests: u64,
    pub completed: u64,
    pub us_per_request: f64,
}

impl PeerResult {
    pub fn failed(&self) -> u64 {
        self.failures.values().sum()
    }

    pub fn fail(&mut self, why: impl Into<String>) {
        *self.failures.entry(why.into()).or_default() += 1;
    }

    pub fn error(&mut self, e: impl std::fmt::Display) {
        if self.errors.len() < 8 {
            self.errors.push(e.to_string());
        }
    }
}

/// Which measurement a row holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// `ucx_perftest -t tag_bw -O N`: raw UCX, N sends outstanding (the row's in-flight
    /// count; 1 is the baseline of every kvlink row).
    UcxTagBw,
    /// `ucx_perftest -t tag_lat`: raw UCX ping-pong, one-way latency.
    UcxTagLat,
    /// kvlink's UCX agent alone: tagged send/recv, one at a time.
    KvlinkTransport,
    /// Whole kvlink requests through the engine (advertise, accept, send, agreed outcome).
    KvlinkRequest,
}

impl Kind {
    pub fn label(self) -> &'static str {
        match self {
            Kind::UcxTagBw => "ucx tag_bw -O 1",
            Kind::UcxTagLat => "ucx tag_lat",
            Kind::KvlinkTransport => "kvlink transport",
            Kind::KvlinkRequest => "kvlink request",
        }
    }
}

/// A row's "what": the kind's label, with a `tag_bw` baseline's outstanding count.
pub fn kind_label(kind: Kind, in_flight: u64) -> String {
    match kind {
        Kind::UcxTagBw => format!("ucx tag_bw -O {in_flight}"),
        _ => kind.label().to_string(),
    }
}

/// One line of the result table.
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    pub transport: String,
    pub kind: Kind,
    pub size: u64,
    pub in_flight: u64,
    /// Requests (transfers) in the measured part of the row.
    pub measured: u64,
    /// Over the whole row, warm-up included.
    pub completed: u64,
    pub failed: u64,
    /// µs per request: p50 and p99 (for `ucx_tag_lat` the one-way latency, for `ucx_tag_bw`
    /// the time per message).
    pub us_p50: Option<f64>,
    pub us_p99: Option<f64>,
    /// Request latency (advertise to `Completed`), µs.
    pub lat_p50: Option<f64>,
    pub lat_p99: Option<f64>,
    pub gbps: Option<f64>,
    /// GB/s over `ucx_perftest tag_bw -O 1` at the same size, same transport, same run.
    pub x_tag_bw: Option<f64>,
    /// µs per request (p50) over `ucx_perftest tag_lat` one-way (p50), same size.
    pub x_tag_lat: Option<f64>,
    /// For a row with N > 1 in flight: GB/s over `ucx_perftest tag_bw -O N`, same size, same
    /// transport, same run.
    pub x_tag_bw_n: Option<f64>,
    /// `ok`, `failed` (some requests did not complete), `error` (no figures) or `skipped`.
    pub status: String,
    pub note: String,
    pub failures: BTreeMap<String, u64>,
    pub rounds: Vec<Round>,
    /// The engines' `health()` at the end of the row (generation side, context side).
    pub health: Vec<String>,
    /// Wall time of the whole row, processes included.
    pub secs: f64,
    /// `HRTIMER` softirqs on the whole machine over the row: on a tcp row under BBR, the kicks
    /// of the kernel's pacing timer ([`crate::pacing`]). None where they cannot be counted.
    pub pacing_kicks: Option<u64>,
}

impl Row {
    pub fn new(transport: &str, kind: Kind, size: u64, in_flight: u64) -> Row {
        Row {
            transport: transport.to_string(),
            kind,
            size,
            in_flight,
            measured: 0,
            completed: 0,
            failed: 0,
            us_p50: None,
            us_p99: None,
            lat_p50: None,
            lat_p99: None,
            gbps: None,
            x_tag_bw: None,
            x_tag_lat: None,
            x_tag_bw_n: None,
            status: "ok".into(),
            note: String::new(),
            failures: BTreeMap::new(),
            rounds: Vec::new(),
            health: Vec::new(),
            secs: 0.0,
            pacing_kicks: None,
        }
    }

    pub fn error(mut self, note: impl Into<String>) -> Row {
        self.status = "error".into();
        self.note = note.into();
        self
    }
}

/// The whole run, as written by `--json`.
#[derive(Debug, Serialize)]
pub struct Report {
    pub tool: &'static str,
    pub version: &'static str,
    /// GB = 1e9 bytes; µs per request is wall time of a round divided by its requests (the
    /// transport row: one transfer, post to completion on the sender).
    pub units: &'static str,
    pub settings: serde_json::Value,
    pub host: Host,
    pub rows: Vec<Row>,
}

#[derive(Debug, Serialize)]
pub struct Host {
    pub cores: usize,
    /// What the `ucx_info` of the baseline's UCX says.
    pub ucx: Option<String>,
    /// The UCX kvlink itself runs on (`ucp_get_version`): the same one, or the ratios compare
    /// two generations.
    pub kvlink_ucx: String,
}

/// `x` to three significant digits, without an exponent (12345 -> "12300", 0.012345 -> "0.0123").
pub fn sig3(x: f64) -> String {
    if !x.is_finite() {
        return "-".into();
    }
    if x == 0.0 {
        return "0".into();
    }
    let mag = x.abs().log10().floor() as i32;
    let scale = 10f64.powi(mag - 2);
    let rounded = (x / scale).round() * scale;
    // Rounding may carry into the next decade (999.7 -> 1000): recount the digits.
    let mag = rounded.abs().log10().floor() as i32;
    let decimals = (2 - mag).max(0) as usize;
    format!("{rounded:.decimals$}")
}

pub fn opt(x: Option<f64>) -> String {
    x.map_or_else(|| "-".into(), sig3)
}

pub fn ratio(x: Option<f64>) -> String {
    x.map_or_else(|| "-".into(), |v| format!("{}x", sig3(v)))
}

/// `4096` -> `4 KiB`, `1048576` -> `1 MiB`; other sizes in bytes.
pub fn size_label(n: u64) -> String {
    const UNITS: [(&str, u64); 3] = [("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)];
    for (name, unit) in UNITS {
        if n >= unit && n.is_multiple_of(unit) {
            return format!("{} {name}", n / unit);
        }
    }
    format!("{n} B")
}

/// Nearest-rank percentile of unsorted samples.
pub fn percentile(samples: &[f64], p: f64) -> Option<f64> {
    if samples.is_empty() {
        return None;
    }
    let mut s = samples.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    let rank = ((p / 100.0) * s.len() as f64).ceil() as usize;
    Some(s[rank.clamp(1, s.len()) - 1])
}

pub const HEADER: [&str; 13] = [
    "tl",
    "what",
    "size",
    "in flight",
    "requests",
    "failed",
    "us/req p50",
    "us/req p99",
    "GB/s",
    "x tag_bw",
    "x tag_lat",
    "x -O N",
    "status",
];
const WIDTHS: [usize; 13] = [3, 16, 7, 9, 8, 6, 10, 10, 6, 8, 9, 6, 0];

fn line(cells: &[String]) -> String {
    let mut s = String::new();
    for (i, (c, w)) in cells.iter().zip(WIDTHS).enumerate() {
        if i > 0 {
            s.push_str("  ");
        }
        if i < 2 {
            s.push_str(&format!("{c:<w$}"));
        } else {
            s.push_str(&format!("{c:>w$}"));
        }
    }
    s.trim_end().to_string()
}

pub fn header() -> String {
    line(&HEADER.map(String::from))
}

pub fn table_line(r: &Row) -> String {
    let ucx = matches!(r.kind, Kind::UcxTagBw | Kind::UcxTagLat);
    let mut status = r.status.clone();
    if !r.note.is_empty() {
        status.push_str(": ");
        status.push_str(&r.note);
    }
    if let Some(k) = r
        .pacing_kicks
        .filter(|&k| r.transport == "tcp" && k >= PACED)
    {
        status.push_str(&format!(" [paced: {k} pacing-timer kicks]"));
    }
    line(&[
        r.transport.clone(),
        kind_label(r.kind, r.in_flight),
        size_label(r.size),
        r.in_flight.to_string(),
        r.measured.to_string(),
        if ucx || r.status == "error" {
            "-".into()
        } else {
            r.failed.to_string()
        },
        opt(r.us_p50),
        opt(r.us_p99),
        opt(r.gbps),
        ratio(r.x_tag_bw),
        ratio(r.x_tag_lat),
        ratio(r.x_tag_bw_n),
        status,
    ])
}

pub fn write_json(path: &Path, report: &Report) -> std::io::Result<()> {
    let text = serde_json::to_string_pretty(report)?;
    if path == Path::new("-") {
        let mut out = std::io::stdout().lock();
        writeln!(out, "{text}")?;
        return out.flush();
    }
    std::fs::write(path, text + "\n")
}

/// One CSV record per row: the table's columns, unrounded, plus latency and the failures.
#[derive(Serialize)]
struct CsvRecord<'a> {
    transport: &'a str,
    kind: Kind,
    size_bytes: u64,
    in_flight: u64,
    measured: u64,
    completed: u64,
    failed: u64,
    us_per_request_p50: Option<f64>,
    us_per_request_p99: Option<f64>,
    latency_us_p50: Option<f64>,
    latency_us_p99: Option<f64>,
    gbps: Option<f64>,
    x_tag_bw: Option<f64>,
    x_tag_lat: Option<f64>,
    x_tag_bw_n: Option<f64>,
    status: &'a str,
    failures: String,
    secs: f64,
    note: &'a str,
}

pub fn write_csv(path: &Path, rows: &[Row]) -> Result<(), Box<dyn std::error::Error>> {
    let mut w = csv::Writer::from_path(path)?;
    for r in rows {
        w.serialize(CsvRecord {
            transport: &r.transport,
            kind: r.kind,
            size_bytes: r.size,
            in_flight: r.in_flight,
            measured: r.measured,
            completed: r.completed,
            failed: r.failed,
            us_per_request_p50: r.us_p50,
            us_per_request_p99: r.us_p99,
            latency_us_p50: r.lat_p50,
            latency_us_p99: r.lat_p99,
            gbps: r.gbps,
            x_tag_bw: r.x_tag_bw,
            x_tag_lat: r.x_tag_lat,
            x_tag_bw_n: r.x_tag_bw_n,
            status: &r.status,
            failures: r
                .failures
                .iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect::<Vec<_>>()
                .join(";"),
            secs: r.secs,
            note: &r.note,
        })?;
    }
    w.flush()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn three_significant_digits() {
        assert_eq!(sig3(12345.0), "12300");
        assert_eq!(sig3(205.4), "205");
        assert_eq!(sig3(4.704), "4.70");
        assert_eq!(sig3(0.012345), "0.0123");
        assert_eq!(sig3(999.7), "1000");
        assert_eq!(sig3(9.996), "10.0");
        assert_eq!(sig3(0.0), "0");
        assert_eq!(sig3(f64::NAN), "-");
    }

    #[test]
    fn sizes_and_percentiles() {
        assert_eq!(size_label(4096), "4 KiB");
        assert_eq!(size_label(64 << 20), "64 MiB");
        assert_eq!(size_label(1000), "1000 B");
        let s: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&s, 50.0), Some(50.0));
        assert_eq!(percentile(&s, 99.0), Some(99.0));
        assert_eq!(percentile(&[3.0], 99.0), Some(3.0));
        assert_eq!(percentile(&[], 50.0), None);
    }
}
