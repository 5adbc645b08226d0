//! Two real OS processes (the `kvlink-peer` binary) over UCX: tcp on loopback, shared memory,
//! `auto` (UCX chooses) and an explicit transport list. Every byte is checked; faults are real
//! signals.
mod common;

use common::{result, Proc};
use std::time::Instant;

/// Starts a receiver and a sender; returns both once the receiver has posted its receives.
fn start(transport: &str, sizes: &str, mode: &str, timeout_ms: u64) -> (Proc, Proc) {
    let t = timeout_ms.to_string();
    common::start_pair(
        |args, _| Proc::peer(args),
        transport,
        &["--sizes", sizes, "--timeout-ms", &t],
        &["--sizes", sizes, "--mode", mode],
    )
}

#[test]
fn transfers_4k_1m_64m_every_byte_checked_tcp_and_shm() {
    for transport in ["tcp", "sm"] {
        println!("{transport}:");
        let (mut recv, _send) = start(transport, "4096,1048576,67108864", "normal", 60_000);
        for want in [4096, 1 << 20, 64 << 20] {
            let (size, outcome, _, verified) = result(&recv.expect("RESULT"));
            assert_eq!(size, want);
            // The receiver checks the bytes right after its completion returned: a completion
            // reported before all data landed would fail this.
            assert_eq!(outcome, "Completed");
            assert!(verified, "{transport}: {size} bytes arrived corrupted");
        }
    }
}

#[test]
fn auto_and_an_explicit_transport_list_move_every_byte() {
    for transport in ["auto", "tcp,self", "posix,sysv,self"] {
        println!("{transport}:");
        let (mut recv, mut send) = start(transport, "4096,1048576,16777216", "normal", 60_000);
        // What UCX says the sender's endpoint uses (1.22 says; 1.13 cannot: "unknown").
        let lanes = send.expect("LANES");
        for want in [4096, 1 << 20, 16 << 20] {
            let (size, outcome, _, verified) = result(&recv.expect("RESULT"));
            assert_eq!(size, want);
            assert_eq!(outcome, "Completed", "{transport}");
            assert!(verified, "{transport}: {size} bytes arrived corrupted");
        }
        let lanes: Vec<&str> = lanes.split_whitespace().skip(1).collect();
        println!("{transport}: lanes {lanes:?}");
        if lanes != ["unknown"] {
            assert!(!lanes.is_empty());
            match transport {
                "tcp,self" => assert!(lanes.iter().all(|l| l.starts_with("tcp/")), "{lanes:?}"),
                "posix,sysv,self" => assert!(
                    lanes
                        .iter()
                        .all(|l| l.starts_with("posix/") || l.starts_with("sysv/")),
                    "{lanes:?}"
                ),
                _ => {}
            }
        }
        let stats = recv.expect("STATS");
        assert!(stats.contains("in_flight=0 unreaped=0"), "{stats}");
    }
}

/// A UCX setting from the environment that the linked UCX cannot run with is overridden, not
/// obeyed into an abort: with UCX 1.13 `UCX_PROTO_ENABLE=y` made UCX end both peers on their
/// first transfer (`ucs_fatal`); 1.22 runs with it on (its default).
#[test]
fn an_environment_that_would_make_ucx_abort_is_overridden_and_every_byte_moves() {
    let spawn = |args: &[&str], _| {
        let mut cmd = std::process::Command::new(common::PEER);
        cmd.args(args).env("UCX_PROTO_ENABLE", "y");
        Proc::spawn(cmd)
    };
    for transport in ["tcp", "sm"] {
        let (mut recv, _send) = common::start_pair(
            spawn,
            transport,
            &["--sizes", "4096,1048576", "--timeout-ms", "30000"],
            &["--sizes", "4096,1048576", "--mode", "normal"],
        );
        for want in [4096, 1 << 20] {
            let (size, outcome, _, verified) = result(&recv.expect("RESULT"));
            assert_eq!(size, want);
            assert_eq!(outcome, "Completed", "{transport}");
            assert!(verified, "{transport}: {size} bytes arrived corrupted");
        }
    }
}

#[test]
fn a_bad_transport_name_is_refused_with_invalid_argument() {
    let mut p = common::Proc::peer(&["recv", "--transport", "tcp,sysvv"]);
    let line = p.expect("AGENT_ERROR");
    assert!(line.starts_with("AGENT_ERROR InvalidArgument"), "{line}");
    assert!(line.contains("'sysvv'"), "{line}");
    let status = p.child.wait().unwrap();
    assert_eq!(
        status.code(),
        Some(3),
        "a clean exit, not a panic or an abort"
    );
}

#[test]
fn suppressed_completion_times_out_at_deadline_without_spinning() {
    for transport in ["tcp", "sm"] {
        println!("{transport}:");
        let deadline_ms = 10_000.0;
        let (mut recv, _send) = start(transport, "1048576", "suppress", deadline_ms as u64);
        let (_, outcome, elapsed, _) = result(&recv.expect("RESULT"));
        let cpu: Vec<f64> = recv
            .expect("CPU")
            .split_whitespace()
            .skip(1)
            .map(|x| x.parse().unwrap())
            .collect();
        let share = cpu[0] / cpu[1] * 100.0;
        println!("{transport}: TimedOut after {elapsed:.1} ms (deadline {deadline_ms} ms); CPU {:.2} ms in {:.0} ms = {share:.3}% of a core", cpu[0], cpu[1]);
        assert_eq!(outcome, "TimedOut");
        assert!(elapsed >= deadline_ms, "ended before its deadline");
        assert!(
            elapsed <= deadline_ms + 100.0,
            "ended {elapsed} ms after a {deadline_ms} ms deadline"
        );
        // Issue 8's bound, 2% of a core, is for the build users run (the cargo-test step).
        // The sanitizer's instrumented build runs the same idle loops several times slower,
        // and scripts/sanitize.sh passes a looser bound for it.
        let bound: f64 = std::env::var("KVLINK_IDLE_CPU_PCT")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(2.0);
        assert!(
            share < bound,
            "waiting used {share:.2}% of a core (bound {bound}%)"
        );
        let stats = recv.expect("STATS");
        assert!(
            stats.contains("in_flight=0 unreaped=0"),
            "the timed-out receive must be reaped: {stats}"
        );
    }
}

#[test]
fn killed_peer_gives_peer_lost_promptly() {
    // tcp detects a dead peer through the socket; shared memory through UCX keepalive (1 s).
    // auto: UCX's own choice (tcp, plus shared memory on UCX 1.22) under the same keepalive.
    for (transport, bound_ms) in [("tcp", 2000.0), ("sm", 5000.0), ("auto", 5000.0)] {
        println!("{transport}:");
        let (mut recv, mut send) = start(transport, &["4194304"; 8].join(","), "slow", 30_000);
        let (_, first, _, ok) = result(&recv.expect("RESULT"));
        assert_eq!(first, "Completed");
        assert!(ok);
        let killed = Instant::now();
        send.signal(libc::SIGKILL);
        // Reap it as its parent would: UCX's shared-memory keepalive looks for the peer's pid,
        // which a zombie still holds.
        let _ = send.child.wait();
        let mut outcomes = vec![];
        for _ in 1..8 {
            let (_, o, _, _) = result(&recv.expect("RESULT"));
            outcomes.push(o);
        }
        let after = killed.elapsed();
        println!(
            "{transport}: outcomes after SIGKILL {outcomes:?}; last one {after:?} after the kill"
        );
        assert!(outcomes.iter().any(|o| o == "PeerLost"), "{outcomes:?}");
        assert!(
            outcomes.iter().all(|o| o == "PeerLost" || o == "Completed"),
            "{outcomes:?}"
        );
        assert!(
            after.as_secs_f64() * 1e3 < bound_ms,
            "peer loss found after {after:?}"
        );
        let stats = recv.expect("STATS");
        assert!(stats.contains("in_flight=0 unreaped=0"), "{stats}");
    }
}

#[test]
fn frozen_peer_gives_timed_out_at_deadline() {
    let deadline_ms = 3000.0;
    let (mut recv, send) = start("tcp", &["4194304"; 8].join(","), "slow", deadline_ms as u64);
    let (_, first, _, _) = result(&recv.expect("RESULT"));
    assert_eq!(first, "Completed");
    send.signal(libc::SIGSTOP);
    let mut last = (String::new(), 0.0);
    for _ in 1..8 {
        let (_, o, e, _) = result(&recv.expect("RESULT"));
        last = (o, e);
    }
    send.signal(libc::SIGCONT);
    println!(
        "tcp: frozen peer -> {} at {:.1} ms (deadline {deadline_ms} ms)",
        last.0, last.1
    );
    assert_eq!(last.0, "TimedOut");
    assert!(last.1 >= deadline_ms && last.1 <= deadline_ms + 100.0);
}
