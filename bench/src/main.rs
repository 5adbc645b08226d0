//! `kvlink-bench`: kvlink between two processes on loopback, side by side with `ucx_perftest`
//! (`tag_bw -O 1` and `tag_lat`) on the same transport in the same run, as ratios.
//!
//! Rows per transport and size: the two ucx_perftest baselines, the kvlink transport row (the
//! UCX agent's tagged send/recv, one transfer at a time), whole requests one at a time, and the
//! in-flight rows (N requests advertised at once, then all waited). Each kvlink row runs in two
//! fresh processes of this binary (`kvlink-bench peer ...`, see `roles.rs`), under a time limit,
//! so a row whose requests fail or hang is reported with its failure count and the run goes on.
//! `kvlink-bench --help` explains every flag.
mod alloc_count;
mod cli;
mod copy_rate;
mod core_cost;
mod hugebuf;
mod pacing;
mod perftest;
mod pin;
mod plot;
mod procs;
mod report;
mod roles;
mod run;

use clap::Parser;
use cli::{Cli, PeerCmd};
use std::process::ExitCode;

#[global_allocator]
static HEAP: alloc_count::Counting = alloc_count::Counting;

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Some(PeerCmd::Peer(p)) = &cli.peer {
        return ExitCode::from(roles::run(p).clamp(0, 255) as u8);
    }
    if let Some(PeerCmd::Core(c)) = &cli.peer {
        return ExitCode::from(core_cost::run(c).clamp(0, 255) as u8);
    }
    if let Some(PeerCmd::Copy(c)) = &cli.peer {
        return ExitCode::from(copy_rate::run(c).clamp(0, 255) as u8);
    }
    let args = cli.run;
    let pin = match pin::split(args.pin) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("kvlink-bench: {e}");
            return ExitCode::from(2);
        }
    };
    let settings = serde_json::json!({
        "transports": args.transports.iter().map(|t| t.name()).collect::<Vec<_>>(),
        "sizes": args.sizes,
        "inflight": args.inflight.iter().map(|&(s, n)| serde_json::json!({"size": s, "requests": n})).collect::<Vec<_>>(),
        "iters": args.fixed_iters().map_or_else(
            || serde_json::json!("as ucx_perftest at each size"),
            |i| serde_json::json!(i),
        ),
        "warmup": args.warmup.map_or_else(
            || serde_json::json!("requests: as ucx_perftest (a tenth of its iterations at each size); transport rows: 3"),
            |w| serde_json::json!(w),
        ),
        "rounds": args.fixed_rounds().map_or_else(
            || serde_json::json!("as ucx_perftest at each size, at least 5"),
            |r| serde_json::json!(r),
        ),
        "warmup_rounds": 1,
        "senders": args.senders,
        "gap_us": args.gap_us,
        "tr_source": args.tr_source.name(),
        "tr_buffers": args.tr_buffers,
        "row_timeout_s": args.row_timeout().as_secs(),
        "quick": args.quick,
        "pin": pin::label(pin.as_ref()),
        "tcp_sndbuf": perftest::tcp_sndbuf(),
        "tcp_congestion_control": pacing::congestion_control(),
    });
    let mut runner = match run::Runner::new(args.clone(), pin) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("kvlink-bench: cannot find its own executable: {e}");
            return ExitCode::from(2);
        }
    };
    runner.run();
    let rows = std::mem::take(&mut runner.rows);
    let mut code = ExitCode::SUCCESS;
    if let Some(path) = &args.csv {
        if let Err(e) = report::write_csv(path, &rows) {
            eprintln!("kvlink-bench: CSV {}: {e}", path.display());
            code = ExitCode::from(2);
        }
    }
    if let Some(path) = &args.plot {
        if let Err(e) = plot::draw(path, &rows) {
            eprintln!("kvlink-bench: plot {}: {e}", path.display());
            code = ExitCode::from(2);
        }
    }
    if let Some(path) = &args.json {
        let report = report::Report {
            tool: "kvlink-bench",
            version: env!("CARGO_PKG_VERSION"),
            units: "GB = 1e9 bytes; us/req = round wall time / requests in the round \
                    (transport rows: one transfer, post to completion on the sender; \
                    ucx_tag_bw rows: ucx_perftest's median time per message); \
                    tag_lat is one-way (half the round trip)",
            settings,
            host: report::Host {
                cores: std::thread::available_parallelism().map_or(0, |n| n.get()),
                ucx: perftest::version(),
                kvlink_ucx: kvlink::transport::ucx::resources::ucx_version(),
            },
            rows,
        };
        if let Err(e) = report::write_json(path, &report) {
            eprintln!("kvlink-bench: JSON {}: {e}", path.display());
            code = ExitCode::from(2);
        }
    }
    code
}
