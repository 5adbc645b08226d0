//! Network faults between two processes in their own network namespaces, joined by a veth pair
//! (addresses of our own test hosts, inside namespaces this test creates and removes). Needs
//! root (CI runs as root); elsewhere it prints why it skips.
mod common;

use common::net::{setup, skip, Net};
use common::{Proc, PEER};
use std::process::Command;
use std::time::Instant;

fn spawn_in(ns: &str, args: &[&str]) -> Proc {
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", ns, PEER]).args(args);
    Proc::spawn(cmd)
}

fn start(net: &Net, sizes: &str, mode: &str, timeout_ms: u64) -> (Proc, Proc) {
    let listen = format!("{}:0", net.ip_b);
    let t = timeout_ms.to_string();
    // The receiver runs in namespace b, the sender in a.
    common::start_pair(
        |args, is_recv| spawn_in(if is_recv { &net.b } else { &net.a }, args),
        "tcp",
        &["--listen", &listen, "--sizes", sizes, "--timeout-ms", &t],
        &["--sizes", sizes, "--mode", mode],
    )
}

fn result(line: &str) -> (String, f64, bool) {
    let (_, o, ms, ok) = common::result(line);
    (o, ms, ok)
}

#[test]
fn partition_mid_transfer_ends_every_wait_by_its_deadline() {
    let Some(net) = setup("part") else { return };
    let deadline_ms = 3000.0;
    let (mut recv, _send) = start(&net, &["4194304"; 6].join(","), "slow", deadline_ms as u64);
    let (first, _, ok) = result(&recv.expect("RESULT"));
    assert_eq!(first, "Completed");
    assert!(ok);
    // Partition: everything into and out of the receiver's namespace is dropped (no RST, no FIN).
    assert!(net.partition(true));
    let t0 = Instant::now();
    let mut outcomes = vec![];
    let mut last_ms = 0.0;
    for _ in 1..6 {
        let (o, ms, _) = result(&recv.expect("RESULT"));
        outcomes.push(o);
        last_ms = ms;
    }
    println!("partition: outcomes {outcomes:?}, last at {last_ms:.1} ms (deadline {deadline_ms} ms), {:?} after the partition", t0.elapsed());
    assert!(
        outcomes
            .iter()
            .all(|o| o == "TimedOut" || o == "PeerLost" || o == "Completed"),
        "{outcomes:?}"
    );
    assert!(
        outcomes.iter().any(|o| o != "Completed"),
        "a partition cannot let every transfer complete"
    );
    // Bounded: a receive still matched to a half-received message is reaped by force-closing
    // its endpoint (reap grace 2 s); an unmatched one ends at the deadline.
    assert!(
        last_ms <= deadline_ms + 2200.0,
        "ended {last_ms} ms after start, deadline {deadline_ms} ms"
    );
    let stats = recv.expect("STATS");
    assert!(stats.contains("in_flight=0 unreaped=0"), "{stats}");
}

#[test]
fn ten_percent_packet_loss_still_delivers_every_byte() {
    let Some(net) = setup("loss") else { return };
    if !net.iptables_b(&[
        "-A",
        "INPUT",
        "-m",
        "statistic",
        "--mode",
        "random",
        "--probability",
        "0.1",
        "-j",
        "DROP",
    ]) {
        skip("iptables statistic match unavailable");
        return;
    }
    let (mut recv, _send) = start(&net, "4096,1048576,16777216", "normal", 60_000);
    for want in [4096, 1 << 20, 16 << 20] {
        let line = recv.expect("RESULT");
        let (o, ms, ok) = result(&line);
        println!("10% loss: {want} bytes -> {o} in {ms:.0} ms, verified {ok}");
        assert_eq!(o, "Completed");
        assert!(ok, "{line}");
    }
}
