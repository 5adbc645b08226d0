//! Network faults between two processes in their own network namespaces, joined by a veth pair
//! (addresses of our own test hosts, inside namespaces this test creates and removes). Needs
//! root (CI runs as root); elsewhere it prints why it skips.
mod common;

use common::{Proc, PEER};
use std::process::{Command, Stdio};
use std::time::Instant;

fn sh(args: &[&str]) -> bool {
    Command::new(args[0])
        .args(&args[1..])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Two namespaces `a` and `b` joined by veth, with 10.77.<n>.1 and 10.77.<n>.2.
struct Net {
    a: String,
    b: String,
    ip_b: String,
}

impl Net {
    fn new(tag: &str) -> Option<Net> {
        let n = std::process::id() % 200 + if tag == "part" { 0 } else { 1 };
        let (a, b) = (format!("kvl{tag}a{n}"), format!("kvl{tag}b{n}"));
        let (va, vb) = (format!("kv{tag}{n}a"), format!("kv{tag}{n}b"));
        let (ip_a, ip_b) = (format!("10.77.{n}.1"), format!("10.77.{n}.2"));
        let _ = sh(&["ip", "netns", "del", &a]);
        let _ = sh(&["ip", "netns", "del", &b]);
        let ok = sh(&["ip", "netns", "add", &a])
            && sh(&["ip", "netns", "add", &b])
            && sh(&[
                "ip", "link", "add", &va, "type", "veth", "peer", "name", &vb,
            ])
            && sh(&["ip", "link", "set", &va, "netns", &a])
            && sh(&["ip", "link", "set", &vb, "netns", &b])
            && sh(&[
                "ip",
                "-n",
                &a,
                "addr",
                "add",
                &format!("{ip_a}/24"),
                "dev",
                &va,
            ])
            && sh(&[
                "ip",
                "-n",
                &b,
                "addr",
                "add",
                &format!("{ip_b}/24"),
                "dev",
                &vb,
            ])
            && sh(&["ip", "-n", &a, "link", "set", &va, "up"])
            && sh(&["ip", "-n", &b, "link", "set", &vb, "up"])
            && sh(&["ip", "-n", &a, "link", "set", "lo", "up"])
            && sh(&["ip", "-n", &b, "link", "set", "lo", "up"]);
        let net = Net { a, b, ip_b };
        ok.then_some(net)
    }
    fn iptables_b(&self, rule: &[&str]) -> bool {
        let mut args = vec!["ip", "netns", "exec", &self.b, "iptables"];
        args.extend_from_slice(rule);
        sh(&args)
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        let _ = sh(&["ip", "netns", "del", &self.a]);
        let _ = sh(&["ip", "netns", "del", &self.b]);
    }
}

fn spawn_in(ns: &str, args: &[&str]) -> Proc {
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", ns, PEER]).args(args);
    Proc::spawn(cmd)
}

fn skip(why: &str) {
    println!("SKIP: {why}");
}

fn setup(tag: &str) -> Option<Net> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        skip("network namespaces need root");
        return None;
    }
    let net = Net::new(tag);
    if net.is_none() {
        skip("could not create network namespaces and a veth pair (ip netns / veth unavailable)");
    }
    net
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
    assert!(
        net.iptables_b(&["-I", "INPUT", "-j", "DROP"])
            && net.iptables_b(&["-I", "OUTPUT", "-j", "DROP"])
    );
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
