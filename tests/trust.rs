//! Trust, between real OS processes (`kvlink-engine-peer`), on tcp and shared memory:
//! - a third process that connects to a generation rank at the UCX level and sends data under
//!   guessed tags and under the tokens the real sender was given cannot land a byte or complete
//!   anything; every attempt shows in `health().foreign_data`; the real request then completes
//!   with every byte checked;
//! - with a deployment secret, a peer without it (or with another) is refused at connect with
//!   `AuthFailed`, whichever side dials, and the refusal is counted on the other side;
//! - a second process with a rank already bound to a live one is refused with `RankInUse`, and
//!   accepted once the first is gone; a peer with the dialled engine's own rank is refused
//!   too, and both sides say so;
//! - a rank of another wire version is refused at once, whichever side dials: the dialler of
//!   another version gets the version refusal (the one frame every version reads), and a
//!   `connect` to one returns `Protocol` long before its deadline.
mod common;

use common::{field, Proc};
use std::process::Command;
use std::time::{Duration, Instant};

const PEER: &str = env!("CARGO_BIN_EXE_kvlink-engine-peer");

fn num(line: &str, name: &str) -> u64 {
    field(line, name).parse().unwrap()
}

fn spawn(args: &[&str], env_secret: Option<&str>) -> Proc {
    let mut c = Command::new(PEER);
    c.args(args);
    c.env_remove("KVLINK_SECRET");
    if let Some(s) = env_secret {
        c.env("KVLINK_SECRET", s);
    }
    Proc::spawn(c)
}

fn addr(p: &mut Proc) -> String {
    p.expect("ADDR ")
        .split_whitespace()
        .nth(1)
        .unwrap()
        .to_string()
}

/// The first `TRUST` line for which `ok` holds, within 20 s.
fn trust_until(p: &mut Proc, what: &str, ok: impl Fn(&str) -> bool) -> String {
    let until = Instant::now() + Duration::from_secs(20);
    loop {
        let line = p.expect("TRUST ");
        if ok(&line) {
            return line;
        }
        assert!(
            Instant::now() < until,
            "no TRUST line with {what}: last {line}"
        );
    }
}

fn ctx(transport: &str, extra: &[&str], env_secret: Option<&str>) -> (Proc, String) {
    let mut args = vec![
        "ctx",
        "--transport",
        transport,
        "--timeout-ms",
        "20000",
        "--trust-every-ms",
        "200",
    ];
    args.extend_from_slice(extra);
    let mut p = spawn(&args, env_secret);
    let a = addr(&mut p);
    (p, a)
}

fn gen(transport: &str, to: &str, extra: &[&str], env_secret: Option<&str>) -> Proc {
    let mut args = vec![
        "gen",
        "--transport",
        transport,
        "--to",
        to,
        "--timeout-ms",
        "20000",
    ];
    args.extend_from_slice(extra);
    spawn(&args, env_secret)
}

#[test]
fn a_third_process_cannot_land_data_by_guessed_or_observed_tokens() {
    for transport in ["tcp", "sm"] {
        println!("== {transport}: a third process sends under guessed and observed tokens");
        let (mut c, caddr) = ctx(transport, &["--hold"], None);
        let mut extra = vec!["--sizes", "4K,1M", "--trust-every-ms", "200"];
        if transport == "tcp" {
            extra.extend_from_slice(&["--listen", "127.0.0.1:0"]);
        }
        let mut g = gen(transport, &caddr, &extra, None);
        let gaddr = addr(&mut g);
        g.expect("CONNECTED");
        g.send("REQ 7");
        // What an observer learns: the tokens of both segments, as the sender got them.
        let line = c.expect("TOKENS 7 ");
        let observed: Vec<u64> = line
            .split_whitespace()
            .nth(2)
            .unwrap()
            .split(',')
            .map(|t| t.parse().unwrap())
            .collect();
        assert_eq!(observed.len(), 2, "{line}");
        // Guesses: sequential tokens (what kvlink used to hand out), and neighbours of the
        // observed ones; then the observed tokens themselves.
        let mut tags: Vec<u64> = (0..32).collect();
        for t in &observed {
            tags.extend([*t, t.wrapping_add(1), t.wrapping_sub(1), t ^ 1]);
        }
        let tag_list: Vec<String> = tags.iter().map(u64::to_string).collect();
        let tag_arg = tag_list.join(",");
        let mut intruder = spawn(
            &[
                "intruder",
                "--transport",
                transport,
                "--to",
                &gaddr,
                "--tags",
                &tag_arg,
                "--lens",
                "4K,1M",
            ],
            None,
        );
        let line = intruder.expect("INTRUDER ");
        let sent = num(&line, "sent");
        assert_eq!(sent, 2 * tags.len() as u64, "{line}");
        // Every attempt is discarded and counted, and nothing completed the request.
        let line = trust_until(&mut g, "every attempt counted", |l| {
            num(l, "foreign") >= sent
        });
        assert_eq!(num(&line, "foreign"), sent, "{line}");
        assert_eq!(
            num(&line, "completed"),
            0,
            "the intruder completed a request: {line}"
        );
        // Now the real sender: the request completes with its own bytes, none of the 0xEE ones.
        c.send("GO");
        let line = g.expect("GEN 7 ");
        assert_eq!(field(&line, "end"), "Completed", "{line}");
        assert_eq!(field(&line, "verified"), "true", "{line}");
        assert_eq!(field(&line, "leased"), "0", "{line}");
        let line = c.expect("CTX 7 ");
        assert_eq!(field(&line, "end"), "Completed", "{line}");
    }
}

/// A secret case: (ctx --secret, ctx KVLINK_SECRET, gen --secret, gen KVLINK_SECRET, connects?).
type Case = (
    Option<&'static str>,
    Option<&'static str>,
    Option<&'static str>,
    Option<&'static str>,
    bool,
);

#[test]
fn with_a_secret_a_peer_without_it_is_refused_on_both_sides() {
    for transport in ["tcp", "sm"] {
        println!("== {transport}: peers with and without the deployment secret");
        // (ctx --secret, ctx env, gen --secret, gen env, connects?)
        let cases: [Case; 5] = [
            // The answering side holds a secret, the dialler none.
            (Some("s1"), None, None, None, false),
            // The dialler holds a secret, the answering side none.
            (None, None, Some("s1"), None, false),
            // Two different secrets.
            (Some("s1"), None, Some("s2"), None, false),
            // The same secret, once as a flag and once from KVLINK_SECRET.
            (Some("s1"), None, None, Some("s1"), true),
            // Only the environment, on both.
            (None, Some("s3"), None, Some("s3"), true),
        ];
        for (i, (cs, ce, gs, ge, ok)) in cases.into_iter().enumerate() {
            println!("-- case {i}");
            let cflag: Vec<&str> = cs.map_or(vec![], |s| vec!["--secret", s]);
            let (mut c, caddr) = ctx(transport, &cflag, ce);
            let mut gflag: Vec<&str> = gs.map_or(vec![], |s| vec!["--secret", s]);
            gflag.extend_from_slice(&["--trust-every-ms", "200"]);
            let mut g = gen(transport, &caddr, &gflag, ge);
            if ok {
                g.expect("CONNECTED");
                g.send("REQ 1");
                let line = g.expect("GEN 1 ");
                assert_eq!(field(&line, "end"), "Completed", "{line}");
                assert_eq!(field(&line, "verified"), "true", "{line}");
                continue;
            }
            // The dialler's connect fails with the typed error...
            let line = g.expect_one_of(&["CONNECT-ERROR ", "CONNECTED"]);
            assert!(
                line.starts_with("CONNECT-ERROR AuthFailed"),
                "case {i}: {line}"
            );
            // ...and the answering side counts a refusal: its own (it checked the dialler's
            // proof) or the dialler's (the dialler checked its proof first).
            let line = trust_until(&mut c, "a refusal", |l| {
                num(l, "auth") + num(l, "by_peer") >= 1
            });
            println!("   ctx: {line}");
            assert_eq!(num(&line, "completed"), 0);
        }
    }
}

#[test]
fn a_duplicated_rank_is_refused_while_the_first_lives_and_accepted_after() {
    for transport in ["tcp", "sm"] {
        println!("== {transport}: a second process claims a live rank");
        let (mut c, caddr) = ctx(transport, &[], None);
        let mut first = gen(transport, &caddr, &[], None);
        let instance = first
            .expect("INSTANCE ")
            .split_whitespace()
            .nth(1)
            .unwrap()
            .to_string();
        first.expect("CONNECTED");
        first.send("REQ 1");
        assert_eq!(field(&first.expect("GEN 1 "), "end"), "Completed");
        // A second process with the same rank, while the first is alive: refused. Also when it
        // claims the first one's instance nonce (public: the first gave it in its handshake).
        let mut second = gen(transport, &caddr, &[], None);
        let line = second.expect_one_of(&["CONNECT-ERROR ", "CONNECTED"]);
        assert!(line.starts_with("CONNECT-ERROR RankInUse"), "{line}");
        let mut twin = gen(transport, &caddr, &["--instance", &instance], None);
        let line = twin.expect_one_of(&["CONNECT-ERROR ", "CONNECTED"]);
        assert!(
            line.starts_with("CONNECT-ERROR RankInUse"),
            "impersonation: {line}"
        );
        trust_until(&mut c, "two rank refusals", |l| num(l, "rank") >= 2);
        // The first still works: it was not displaced.
        first.send("REQ 2");
        let line = first.expect("GEN 2 ");
        assert_eq!(field(&line, "end"), "Completed", "{line}");
        assert_eq!(field(&line, "verified"), "true", "{line}");
        // Once the first is gone, a newcomer with the rank is accepted (it keeps dialling while
        // the context rank has not yet seen the first one's endpoint fail).
        // Reaped, as a process manager would: shared memory's liveness check reads the pid,
        // and a zombie still has one.
        first.child.kill().unwrap();
        first.child.wait().unwrap();
        let mut third = gen(transport, &caddr, &["--retry-ms", "20000"], None);
        third.expect("CONNECTED");
        third.send("REQ 3");
        let line = third.expect("GEN 3 ");
        assert_eq!(field(&line, "end"), "Completed", "{line}");
        assert_eq!(field(&line, "verified"), "true", "{line}");
    }
}

/// Two engines given the same rank id (a deployment that numbers its instances' ranks alike):
/// the dial is refused with `RankInUse`, and both sides say that the rank is the dialled
/// engine's own, not only that another process holds it.
#[test]
fn a_peer_with_the_dialled_engines_own_rank_is_refused_and_told_why() {
    for transport in ["tcp", "sm"] {
        println!("== {transport}: a generation rank dials a context rank with its own rank id");
        let log = std::env::temp_dir().join(format!(
            "kvlink-own-rank-{}-{transport}.log",
            std::process::id()
        ));
        // The context rank's warnings go to a file (Proc passes stderr through).
        let mut c = Command::new("sh");
        c.args(["-c", "exec \"$0\" \"$@\" 2>\"$KVLINK_TEST_LOG\"", PEER])
            .args(["ctx", "--transport", transport, "--rank", "1"])
            .env("KVLINK_LOG", "kvlink=warn")
            .env("KVLINK_TEST_LOG", &log)
            .env_remove("KVLINK_SECRET");
        let mut c = Proc::spawn(c);
        let caddr = addr(&mut c);
        let mut g = gen(transport, &caddr, &["--rank", "1"], None);
        let line = g.expect_one_of(&["CONNECT-ERROR ", "CONNECTED"]);
        assert!(line.starts_with("CONNECT-ERROR RankInUse"), "{line}");
        assert!(line.contains("dialled engine's own"), "{line}");
        let until = Instant::now() + Duration::from_secs(10);
        let warned = loop {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            if text.contains("this engine's own rank") || Instant::now() > until {
                break text;
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        let _ = std::fs::remove_file(&log);
        assert!(
            warned.contains("this engine's own rank"),
            "the context rank's log: {warned}"
        );
    }
}

/// A generation process killed and started again under the same rank id (a deployment that
/// pins its rank ids) numbers its attempts from the start again: its request with an id its
/// predecessor had used must be served, not taken for a replay of the old attempt (which the
/// context rank remembers for minutes). The same process coming back keeps that protection
/// (`proto_rebind`, `proto_identity`).
#[test]
fn a_process_restarted_under_its_rank_id_is_served_a_request_id_its_predecessor_used() {
    for transport in ["tcp", "sm"] {
        println!("== {transport}: a generation process restarted under its rank id");
        let (mut c, caddr) = ctx(transport, &[], None);
        let mut first = gen(transport, &caddr, &["--rank", "7"], None);
        first.expect("CONNECTED");
        first.send("REQ 5");
        let line = first.expect("GEN 5 ");
        assert_eq!(field(&line, "end"), "Completed", "{line}");
        c.expect("CTX 5 ");
        // Killed and reaped, as a process manager would (shared memory's liveness check reads
        // the pid).
        first.child.kill().unwrap();
        first.child.wait().unwrap();
        let mut second = gen(
            transport,
            &caddr,
            &["--rank", "7", "--retry-ms", "20000"],
            None,
        );
        second.expect("CONNECTED");
        second.send("REQ 5");
        let line = second.expect("GEN 5 ");
        assert_eq!(
            field(&line, "end"),
            "Completed",
            "the retry of request 5: {line}"
        );
        assert_eq!(field(&line, "verified"), "true", "{line}");
        let line = c.expect("CTX 5 ");
        assert_eq!(field(&line, "end"), "Completed", "{line}");
    }
}

#[test]
fn a_rank_of_another_wire_version_is_refused_at_once_either_way() {
    let other = (kvlink::proto::wire::VERSION + 1).to_string();
    for transport in ["tcp", "sm"] {
        println!("== {transport}: a rank of another wire version dials, then answers");
        // It dials a context rank: the version refusal comes back at once, in the one frame
        // every version reads, and the refusal is counted.
        let (mut c, caddr) = ctx(transport, &[], None);
        let mut o = spawn(
            &[
                "other-version",
                "--transport",
                transport,
                "--to",
                &caddr,
                "--wire-version",
                &other,
            ],
            None,
        );
        let line = o.expect("REPLY ");
        println!("   other-version: {line}");
        assert!(
            line.starts_with("REPLY Refuse { reason: WireVersion }"),
            "{line}"
        );
        assert_eq!(
            num(&line, "version"),
            u64::from(kvlink::proto::wire::VERSION)
        );
        assert!(num(&line, "ms") < 2000, "{line}");
        let line = trust_until(&mut c, "a version refusal", |l| num(l, "version") >= 1);
        println!("   ctx: {line}");
        assert_eq!(num(&line, "version"), 1, "{line}");
        // The context rank serves a rank of its own version as before.
        let mut g = gen(transport, &caddr, &[], None);
        g.expect("CONNECTED");
        g.send("REQ 1");
        let line = g.expect("GEN 1 ");
        assert_eq!(field(&line, "end"), "Completed", "{line}");
        assert_eq!(field(&line, "verified"), "true", "{line}");

        // A generation rank dials one of another version: its connect (deadline 20 s) returns
        // the typed error as soon as the refusal arrives.
        let mut o = spawn(
            &[
                "other-version",
                "--transport",
                transport,
                "--wire-version",
                &other,
            ],
            None,
        );
        let oaddr = addr(&mut o);
        let mut g = gen(transport, &oaddr, &["--connect-ms", "20000"], None);
        let line = g.expect_one_of(&["CONNECT-ERROR ", "CONNECTED"]);
        println!("   gen: {line}");
        assert!(line.starts_with("CONNECT-ERROR Protocol"), "{line}");
        assert!(line.contains("wire versions"), "{line}");
        let late: f64 = field(&line, "late_ms").parse().unwrap();
        assert!(
            late < -18_000.0,
            "connect returned {late} ms from its deadline: {line}"
        );
        let line = o.expect("ANSWERED ");
        assert_eq!(
            num(&line, "version"),
            u64::from(kvlink::proto::wire::VERSION),
            "{line}"
        );
    }
}
