//! The run: for each transport and size, ucx_perftest first, then the kvlink rows, each row
//! in fresh peer processes with a time limit.
use crate::cli::{PeerRole, RunArgs, Transport};
use crate::perftest::{self, Test};
use crate::pin::Split;
use crate::procs::{NoLine, Proc};
use crate::report::{self, sig3, size_label, Kind, PeerResult, Row};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// How long a listening peer may take to print its address.
const ADDR_LIMIT: Duration = Duration::from_secs(20);
/// How long past its time limit (which its own watchdog enforces) a measuring peer is given
/// before it is killed.
const KILL_AFTER: Duration = Duration::from_secs(5);
/// The listening side's own watchdog fires 3 s past the row limit (counted from its start).
const LISTENER_LIMIT_SLACK: Duration = Duration::from_secs(5);
/// How long a peer may take to exit once the row is over.
const EXIT_GRACE: Duration = Duration::from_secs(3);

/// In-flight rows of this size and up (bandwidth rows, not the small-request rate rows) get
/// a second baseline, `tag_bw -O N` with as many sends outstanding.
const OUTSTANDING_BASELINE_FROM: u64 = 64 << 10;

/// One row to measure.
#[derive(Clone, Copy, Debug)]
enum Step {
    Perftest(Test, u64),
    Transport(u64),
    Requests { size: u64, in_flight: u64 },
}

pub struct Runner {
    args: RunArgs,
    /// Each side's CPUs (`--pin`); None: not pinned.
    pin: Option<Split>,
    exe: PathBuf,
    pb: ProgressBar,
    to_stderr: bool,
    pub rows: Vec<Row>,
}

impl Runner {
    pub fn new(args: RunArgs, pin: Option<Split>) -> std::io::Result<Runner> {
        let exe = std::env::current_exe()?;
        let to_stderr = args.json.as_deref() == Some(std::path::Path::new("-"));
        let pb = if args.no_progress {
            ProgressBar::hidden()
        } else {
            ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr())
        };
        pb.set_style(
            ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {pos}/{len} rows  {msg}")
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> "),
        );
        Ok(Runner {
            args,
            pin,
            exe,
            pb,
            to_stderr,
            rows: Vec::new(),
        })
    }

    /// The steps of one transport, grouped by size: the baseline first, then kvlink.
    fn plan(&self) -> Vec<Step> {
        let a = &self.args;
        let mut sizes: Vec<u64> = a.sizes.clone();
        sizes.extend(a.inflight.iter().map(|&(s, _)| s));
        sizes.sort_unstable();
        sizes.dedup();
        let mut steps = Vec::new();
        for &size in &sizes {
            if !a.no_perftest {
                steps.push(Step::Perftest(Test::TagBw(1), size));
                steps.push(Step::Perftest(Test::TagLat, size));
                // The bandwidth rows with several in flight: raw UCX with as many outstanding.
                for &(s, n) in &a.inflight {
                    if s == size && n > 1 && size >= OUTSTANDING_BASELINE_FROM {
                        steps.push(Step::Perftest(Test::TagBw(n), size));
                    }
                }
            }
            if a.sizes.contains(&size) {
                if !a.no_transport {
                    steps.push(Step::Transport(size));
                }
                steps.push(Step::Requests { size, in_flight: 1 });
            }
            for &(s, n) in &a.inflight {
                if s == size && !(n == 1 && a.sizes.contains(&size)) {
                    steps.push(Step::Requests { size, in_flight: n });
                }
            }
        }
        steps
    }

    fn print(&self, line: &str) {
        self.pb.suspend(|| {
            if self.to_stderr {
                eprintln!("{line}");
            } else {
                println!("{line}");
            }
        });
    }

    pub fn run(&mut self) {
        let a = self.args.clone();
        let plan = self.plan();
        self.pb
            .set_length((plan.len() * a.transports.len().max(1)) as u64);
        let per_row = match (a.fixed_iters(), a.fixed_rounds()) {
            (Some(i), Some(r)) => {
                format!("{i} requests per one-in-flight row, {r} rounds per in-flight row")
            }
            (Some(i), None) => format!(
                "{i} requests per one-in-flight row, in-flight rows as many as ucx_perftest"
            ),
            (None, Some(r)) => format!(
                "one-in-flight rows as many requests as ucx_perftest, {r} rounds per in-flight row"
            ),
            (None, None) => "every row as many requests as ucx_perftest at its size".into(),
        };
        self.print(&format!(
            "kvlink-bench: two processes on loopback per row ({}); {per_row}, row limit {} s. \
             GB/s = 1e9 bytes/s; x tag_bw = GB/s / tag_bw; x tag_lat = us/req p50 / tag_lat \
             one-way p50; x -O N = GB/s / tag_bw -O N, N the row's in-flight count.",
            match &self.pin {
                Some(p) => format!(
                    "each on CPUs of its own, receiving side | sending side: {}",
                    p.label()
                ),
                None => "not pinned".into(),
            },
            a.row_timeout().as_secs()
        ));
        self.print(&format!(
            "transport rows send from {} memory (--tr-source); whole requests send checked patterns",
            a.tr_source.name()
        ));
        self.print(&format!(
            "tcp: UCX_TCP_SNDBUF={} for kvlink and ucx_perftest alike; congestion control {} \
             (a row with {} or more of the kernel's pacing-timer kicks is marked paced)",
            crate::perftest::tcp_sndbuf(),
            crate::pacing::congestion_control().unwrap_or_else(|| "unknown".into()),
            crate::pacing::PACED
        ));
        if a.tr_buffers > 1 {
            self.print(&format!(
                "transport rows receive into {} buffers in turn (--tr-buffers)",
                a.tr_buffers
            ));
        }
        if a.gap_us > 0 {
            self.print(&format!(
                "whole-request rows pause {} us between rounds (not timed): requests arrive apart",
                a.gap_us
            ));
        }
        self.print(&report::header());
        for &t in &a.transports {
            let first = self.rows.len();
            for &step in &plan {
                let t0 = Instant::now();
                let kicks = crate::pacing::hrtimer_softirqs();
                let mut row = self.step(t, step);
                row.secs = t0.elapsed().as_secs_f64();
                row.pacing_kicks = kicks
                    .zip(crate::pacing::hrtimer_softirqs())
                    .map(|(a, b)| b.saturating_sub(a));
                self.rows.push(row);
                fill_ratios(&mut self.rows[first..]);
                let line = report::table_line(&self.rows[self.rows.len() - 1]);
                self.print(&line);
                self.pb.inc(1);
            }
        }
        self.pb.finish_and_clear();
        let bad: Vec<String> = self
            .rows
            .iter()
            .filter(|r| r.status == "failed" || r.status == "error")
            .map(|r| {
                format!(
                    "{} {} {} x{}",
                    r.transport,
                    r.kind.label(),
                    size_label(r.size),
                    r.in_flight
                )
            })
            .collect();
        if bad.is_empty() {
            self.print("kvlink-bench: every row completed");
        } else {
            self.print(&format!(
                "kvlink-bench: {} row(s) with failures or errors: {}",
                bad.len(),
                bad.join(", ")
            ));
        }
    }

    fn step(&self, t: Transport, step: Step) -> Row {
        let a = &self.args;
        match step {
            Step::Perftest(test, size) => {
                let (kind, outstanding) = match test {
                    Test::TagBw(n) => (Kind::UcxTagBw, n),
                    Test::TagLat => (Kind::UcxTagLat, 1),
                };
                self.pb.set_message(format!(
                    "{} {} {}",
                    t.name(),
                    report::kind_label(kind, outstanding),
                    size_label(size)
                ));
                let iters = a.perftest_iters(size);
                let mut row = Row::new(t.name(), kind, size, outstanding);
                match perftest::run(test, t, size, iters, a.row_timeout(), self.pin.as_ref()) {
                    Ok(f) => {
                        row.measured = f.iterations;
                        row.completed = f.iterations;
                        row.us_p50 = Some(f.us_p50);
                        row.gbps = Some(f.gbps);
                        row.note = format!("overall mean {} us", sig3(f.us_overall));
                        if test == Test::TagLat {
                            row.note.push_str(" (one-way)");
                        }
                    }
                    Err(e) if e.contains("No such file") => {
                        row.status = "skipped".into();
                        row.note = format!("ucx_perftest not found ({e})");
                    }
                    Err(e) => row = row.error(e),
                }
                row
            }
            Step::Transport(size) => {
                self.pb.set_message(format!(
                    "{} kvlink transport {}",
                    t.name(),
                    size_label(size)
                ));
                let out = self.pair(
                    t,
                    (PeerRole::TrRecv, "TR"),
                    PeerRole::TrSend,
                    size,
                    1,
                    a.iters_for(size),
                    a.transport_warmup(),
                );
                to_row(
                    Row::new(t.name(), Kind::KvlinkTransport, size, 1),
                    out,
                    a.iters_for(size),
                )
            }
            Step::Requests { size, in_flight } => {
                let (rounds, warmup) = if in_flight == 1 {
                    (a.iters_for(size), a.warmup_for(size))
                } else {
                    (a.rounds_for(size, in_flight), 1)
                };
                self.pb.set_message(format!(
                    "{} kvlink requests {} x{in_flight}",
                    t.name(),
                    size_label(size)
                ));
                let out = self.pair(
                    t,
                    (PeerRole::Ctx, "CTX"),
                    PeerRole::Gen,
                    size,
                    in_flight,
                    rounds,
                    warmup,
                );
                to_row(
                    Row::new(t.name(), Kind::KvlinkRequest, size, in_flight),
                    out,
                    rounds * in_flight,
                )
            }
        }
    }

    /// Starts the listening peer, then the measuring one against its address; collects both
    /// reports. Never takes longer than the row's limit plus a few seconds.
    #[allow(clippy::too_many_arguments)]
    fn pair(
        &self,
        t: Transport,
        (listener_role, listener_tag): (PeerRole, &str),
        active_role: PeerRole,
        size: u64,
        in_flight: u64,
        rounds: u64,
        warmup: u64,
    ) -> PairOut {
        let limit = self.args.row_timeout();
        let role = |r: PeerRole| {
            clap::ValueEnum::to_possible_value(&r)
                .map(|v| v.get_name().to_string())
                .unwrap_or_default()
        };
        let common = |r: PeerRole| -> Vec<String> {
            vec![
                "peer".into(),
                "--role".into(),
                role(r),
                "--transport".into(),
                t.name().into(),
                "--size".into(),
                size.to_string(),
                "--inflight".into(),
                in_flight.to_string(),
                "--rounds".into(),
                rounds.to_string(),
                "--warmup".into(),
                warmup.to_string(),
                "--senders".into(),
                self.args.senders.to_string(),
                "--limit-ms".into(),
                limit.as_millis().to_string(),
                "--gap-us".into(),
                self.args.gap_us.to_string(),
                "--tr-source".into(),
                self.args.tr_source.name().into(),
                "--tr-buffers".into(),
                self.args.tr_buffers.to_string(),
            ]
        };
        let mut out = PairOut {
            listener_label: match listener_role {
                PeerRole::Ctx => "context side",
                _ => "receiving agent",
            },
            ..PairOut::default()
        };
        // The receiving side of the pair on the first half of the CPUs, the sending side on the
        // second (`pin`): the context side listens but sends.
        let (listener_cpus, active_cpus) = match self.pin.as_ref() {
            Some(p) if listener_role == PeerRole::Ctx => {
                (Some(&p.sender[..]), Some(&p.receiver[..]))
            }
            Some(p) => (Some(&p.receiver[..]), Some(&p.sender[..])),
            None => (None, None),
        };
        let listener_started = Instant::now();
        let mut listener = match Proc::spawn(&self.exe, &common(listener_role), listener_cpus) {
            Ok(p) => p,
            Err(e) => {
                out.notes.push(format!("cannot start a peer: {e}"));
                return out;
            }
        };
        let addr_by = Instant::now() + ADDR_LIMIT;
        let addr = loop {
            match listener.line(addr_by) {
                Ok(l) => {
                    if let Some(a) = l.strip_prefix("ADDR ") {
                        break a.to_string();
                    }
                }
                Err(_) => {
                    out.notes.push(format!(
                        "the listening peer gave no address: {}",
                        listener.stderr_tail(3)
                    ));
                    listener.finish(Duration::ZERO);
                    return out;
                }
            }
        };
        let mut args = common(active_role);
        args.extend(["--peer".into(), addr]);
        if let (PeerRole::Gen, Some(m)) = (active_role, &self.args.metrics_listen) {
            args.extend(["--metrics-listen".into(), m.clone()]);
        }
        let mut active = match Proc::spawn(&self.exe, &args, active_cpus) {
            Ok(p) => p,
            Err(e) => {
                out.notes.push(format!("cannot start a peer: {e}"));
                return out;
            }
        };
        let kill_at = Instant::now() + limit + KILL_AFTER;
        let base_msg = self.pb.message();
        loop {
            match active.line(kill_at) {
                Ok(l) => {
                    if let Some(p) = l.strip_prefix("P ") {
                        out.progress = p.to_string();
                        self.pb
                            .set_message(format!("{base_msg}: {} requests", p.replace(' ', "/")));
                    } else if let Some(j) = l.strip_prefix("RESULT ") {
                        match serde_json::from_str::<PeerResult>(j) {
                            Ok(r) => out.result = Some(r),
                            Err(e) => out.notes.push(format!("unreadable result: {e}")),
                        }
                        break;
                    }
                }
                Err(NoLine::Timeout) => {
                    active.finish(Duration::ZERO);
                    out.notes.push(format!(
                        "{} process killed {} s past the row limit",
                        role(active_role),
                        KILL_AFTER.as_secs()
                    ));
                    break;
                }
                Err(NoLine::Closed) => {
                    out.notes.push(format!(
                        "the measuring peer exited without a result: {}",
                        active.stderr_tail(3)
                    ));
                    break;
                }
            }
        }
        // The listening side ends by itself once it has served every request (or at its own
        // limit); the measuring side holds on until then, so that no request of the other side
        // sees it go.
        self.pb.set_message(format!(
            "{base_msg}: waiting for the {}",
            role(listener_role)
        ));
        let by = if out.result.is_some() {
            listener_started + limit + LISTENER_LIMIT_SLACK
        } else {
            Instant::now() + Duration::from_millis(200)
        };
        let tag = format!("{listener_tag} ");
        loop {
            match listener.line(by) {
                Ok(l) => {
                    if let Some(j) = l.strip_prefix(&tag) {
                        out.listener = serde_json::from_str(j).ok();
                    }
                }
                Err(NoLine::Closed) => break,
                Err(NoLine::Timeout) => {
                    out.notes.push(format!(
                        "{} process still running past its limit: killed",
                        role(listener_role)
                    ));
                    break;
                }
            }
        }
        listener.finish(EXIT_GRACE);
        active.close_stdin();
        if !active.finish(EXIT_GRACE) && out.result.is_some() {
            out.notes.push(format!(
                "{} process still running {} s after the row: killed",
                role(active_role),
                EXIT_GRACE.as_secs()
            ));
        }
        out
    }
}

#[derive(Default)]
struct PairOut {
    /// The measuring side's report.
    result: Option<PeerResult>,
    /// The listening side's last report.
    listener: Option<PeerResult>,
    /// Who the listening side is, for the notes.
    listener_label: &'static str,
    /// Its last progress line (`done planned`), for a side that was killed.
    progress: String,
    notes: Vec<String>,
}

fn to_row(mut row: Row, out: PairOut, measured: u64) -> Row {
    row.measured = measured;
    let mut notes = Vec::new();
    let Some(r) = out.result else {
        let mut note = out.notes.join("; ");
        if !out.progress.is_empty() {
            note.push_str(&format!(
                " (last progress: {} requests)",
                out.progress.replace(' ', "/")
            ));
        }
        return row.error(note);
    };
    row.completed = r.completed;
    row.failed = r.planned.saturating_sub(r.completed);
    row.failures = r.failures.clone();
    let ended = r.failed();
    let unfinished = r.started.saturating_sub(r.completed + ended);
    if unfinished > 0 {
        row.failures.insert("unfinished".into(), unfinished);
    }
    let not_started = r.planned.saturating_sub(r.started);
    if not_started > 0 {
        row.failures.insert("not started".into(), not_started);
    }
    if r.corrupt > 0 {
        row.failures.insert("corrupt".into(), r.corrupt);
    }
    row.us_p50 = r.us_p50;
    row.us_p99 = r.us_p99;
    row.lat_p50 = r.lat_p50;
    row.lat_p99 = r.lat_p99;
    row.gbps = r.gbps;
    row.rounds = r.rounds.clone();
    row.health.extend(r.health.clone());
    if let Some(l) = &out.listener {
        row.health.extend(l.health.clone());
        let lf = l.failed();
        if lf > 0 {
            notes.push(format!(
                "{}: {}",
                out.listener_label,
                failures_text(&l.failures)
            ));
        }
    }
    if row.failed > 0 || r.corrupt > 0 {
        row.status = "failed".into();
        notes.insert(
            0,
            format!(
                "{} of {} did not complete ({})",
                row.failed,
                r.planned,
                failures_text(&row.failures)
            ),
        );
        if let Some(k) = r.rounds.iter().position(|x| x.completed < x.requests) {
            let planned_rounds = r.planned / row.in_flight.max(1);
            notes.push(format!(
                "first incomplete round: {} of {planned_rounds}",
                k + 1
            ));
        }
    }
    if r.stopped_at_limit {
        notes.push("stopped at the row limit".into());
    }
    if row.failed == 0 && row.gbps.is_none() {
        row.status = "error".into();
    }
    notes.extend(r.errors.iter().take(2).cloned());
    notes.extend(out.notes);
    row.note = notes.join("; ");
    row
}

fn failures_text(f: &std::collections::BTreeMap<String, u64>) -> String {
    f.iter()
        .map(|(k, v)| format!("{k} {v}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// kvlink rows against the baseline rows of the same transport and size.
fn fill_ratios(rows: &mut [Row]) {
    let base = |rows: &[Row], kind: Kind, size: u64, in_flight: u64| {
        rows.iter()
            .find(|r| {
                r.kind == kind && r.size == size && r.in_flight == in_flight && r.status == "ok"
            })
            .map(|r| (r.gbps, r.us_p50))
    };
    for i in 0..rows.len() {
        if !matches!(rows[i].kind, Kind::KvlinkRequest | Kind::KvlinkTransport) {
            continue;
        }
        let size = rows[i].size;
        let bw = base(rows, Kind::UcxTagBw, size, 1).and_then(|b| b.0);
        let lat = base(rows, Kind::UcxTagLat, size, 1).and_then(|b| b.1);
        let n = rows[i].in_flight;
        let bw_n = (n > 1)
            .then(|| base(rows, Kind::UcxTagBw, size, n).and_then(|b| b.0))
            .flatten();
        let over = |x: Option<f64>, b: Option<f64>| match (x, b) {
            (Some(x), Some(b)) if b > 0.0 => Some(x / b),
            _ => None,
        };
        let r = &mut rows[i];
        r.x_tag_bw = over(r.gbps, bw);
        r.x_tag_bw_n = over(r.gbps, bw_n);
        r.x_tag_lat = match (r.us_p50, lat) {
            (Some(x), Some(b)) if b > 0.0 => Some(x / b),
            _ => None,
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(kind: Kind, size: u64, in_flight: u64, gbps: f64) -> Row {
        let mut r = Row::new("sm", kind, size, in_flight);
        r.gbps = Some(gbps);
        r.us_p50 = Some(100.0);
        r
    }

    #[test]
    fn each_kvlink_row_is_set_against_the_baselines_of_its_size_and_in_flight_count() {
        const M: u64 = 1 << 20;
        let mut lat = row(Kind::UcxTagLat, M, 1, 1.0);
        lat.us_p50 = Some(2.0);
        let mut failed = row(Kind::UcxTagBw, 16 * M, 4, 1.0);
        failed.status = "error".into();
        let mut rows = vec![
            row(Kind::UcxTagBw, M, 1, 8.0),
            lat,
            row(Kind::UcxTagBw, M, 8, 2.0),
            row(Kind::UcxTagBw, 16 * M, 1, 1.0),
            failed,
            row(Kind::KvlinkTransport, M, 1, 6.0),
            row(Kind::KvlinkRequest, M, 8, 3.0),
            row(Kind::KvlinkRequest, 16 * M, 4, 0.5),
        ];
        fill_ratios(&mut rows);
        let tr = &rows[5];
        assert_eq!(tr.x_tag_bw, Some(0.75), "against tag_bw -O 1, not -O 8");
        assert_eq!(tr.x_tag_lat, Some(50.0), "100 us over 2 us one-way");
        assert_eq!(tr.x_tag_bw_n, None, "one in flight has the -O 1 ratio only");
        let eight = &rows[6];
        assert_eq!(
            eight.x_tag_bw,
            Some(3.0 / 8.0),
            "the issue's ratio: against -O 1"
        );
        assert_eq!(eight.x_tag_bw_n, Some(1.5), "and against -O 8");
        assert_eq!(rows[7].x_tag_bw, Some(0.5));
        assert_eq!(rows[7].x_tag_bw_n, None, "a failed baseline gives no ratio");
        assert_eq!(rows[2].x_tag_bw_n, None, "baselines get no ratio");
        assert_eq!(report::kind_label(Kind::UcxTagBw, 8), "ucx tag_bw -O 8");
    }
}
