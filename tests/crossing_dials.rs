//! Two ranks that dial each other at the same moment, as two OS processes
//! (`kvlink-engine-peer`). Over tcp UCX makes two connections, each with its own session, and
//! the pair must settle on one (`kvlink-proto/src/peers/binding.rs`; every order of the two
//! handshakes' messages is covered deterministically by `kvlink-proto/tests/proto_crossing.rs`).
//! Over shared memory UCX makes one connection of the two. In every round both `connect`s
//! return the other rank, a request then completes with every byte checked, and neither side
//! counts a refusal. Before the rules, most tcp rounds left both `connect`s failed with
//! `RankInUse` and the pair unbound on both sides.
mod common;

use common::{field, Proc};
use std::process::Command;
use std::time::Duration;

const PEER: &str = env!("CARGO_BIN_EXE_kvlink-engine-peer");

/// `kvlink-engine-peer ARGS`, in network namespace `ns` if given.
/// `log`: the child logs kvlink's info lines to this test's stderr (shown whether or not the
/// test passes), so that a rare failure says what each side did.
fn spawn(ns: Option<&str>, args: &[&str], log: bool) -> Proc {
    let mut c = match ns {
        Some(ns) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns, PEER]);
            c
        }
        None => Command::new(PEER),
    };
    c.args(args);
    c.env_remove("KVLINK_SECRET");
    if log {
        c.env("KVLINK_LOG", "kvlink=info");
    }
    Proc::spawn(c)
}

/// Where each side runs: its network namespace (None: this one) and, over tcp, its listen
/// address.
struct Place<'a> {
    ns: Option<&'a str>,
    listen: Option<String>,
}

/// Starts the context rank (rank 0, `--dial-line`) and the generation rank (rank 1, `--to -`)
/// and tells them to dial each other, `apart` between the two lines, the context rank first
/// when `ctx_first`. `deadline_ms` is both connects' deadline.
fn cross(
    transport: &str,
    places: [Place; 2],
    deadline_ms: u64,
    ctx_first: bool,
    apart: Duration,
) -> (Proc, Proc) {
    cross_with(transport, places, deadline_ms, ctx_first, apart, &[])
}

/// [`cross`], with `ctx_extra` added to the context rank's arguments.
fn cross_with(
    transport: &str,
    places: [Place; 2],
    deadline_ms: u64,
    ctx_first: bool,
    apart: Duration,
    ctx_extra: &[&str],
) -> (Proc, Proc) {
    let ms = deadline_ms.to_string();
    let args = |p: &Place, role: &[&str]| -> Vec<String> {
        let mut a: Vec<String> = role.iter().map(|s| s.to_string()).collect();
        a.extend(["--transport", transport, "--trust-every-ms", "100"].map(String::from));
        if let Some(l) = &p.listen {
            a.extend(["--listen".to_string(), l.clone()]);
        }
        a
    };
    let mut ctx_role = vec!["ctx", "--dial-line", "--dial-ms", &ms];
    ctx_role.extend_from_slice(ctx_extra);
    let ctx_args = args(&places[0], &ctx_role);
    let ctx_refs: Vec<&str> = ctx_args.iter().map(String::as_str).collect();
    // The won tie's redial runs in a window of about a millisecond: its rounds log.
    let log = ctx_extra.contains(&"--break-won-tie");
    let mut ctx = spawn(places[0].ns, &ctx_refs, log);
    let ctx_addr = ctx.expect_addr();
    let gen_role = [
        "gen",
        "--to",
        "-",
        "--sizes",
        "4K,1M",
        "--timeout-ms",
        "5000",
    ];
    let mut gen_args = args(&places[1], &gen_role);
    gen_args.extend(["--connect-ms".to_string(), ms]);
    let gen_refs: Vec<&str> = gen_args.iter().map(String::as_str).collect();
    let mut gen = spawn(places[1].ns, &gen_refs, log);
    let gen_addr = gen.expect_addr();
    let (to_ctx, to_gen) = (format!("DIAL {gen_addr}"), format!("DIAL {ctx_addr}"));
    if ctx_first {
        ctx.send(&to_ctx);
        std::thread::sleep(apart);
        gen.send(&to_gen);
    } else {
        gen.send(&to_gen);
        std::thread::sleep(apart);
        ctx.send(&to_ctx);
    }
    (ctx, gen)
}

/// Both on this host: over tcp both listen on loopback; over shared memory both are reached at
/// their worker addresses.
fn here(transport: &str) -> [Place<'static>; 2] {
    let listen = (transport == "tcp").then(|| "127.0.0.1:0".to_string());
    [
        Place {
            ns: None,
            listen: listen.clone(),
        },
        Place { ns: None, listen },
    ]
}

/// `rounds` crossings over `transport`, each between two new processes.
fn crossings(transport: &str, rounds: u32) {
    for round in 0..rounds {
        println!("{transport} round {round}");
        // Which one is told first, and how far apart, varies by round.
        let apart = Duration::from_micros(u64::from(round / 2) * 150);
        let (mut ctx, mut gen) = cross(transport, here(transport), 10_000, round % 2 == 0, apart);
        let dialled = ctx.expect_one_of(&["DIALED ", "DIAL-ERROR "]);
        assert_eq!(
            dialled, "DIALED 1",
            "round {round}: the context rank's connect"
        );
        let connected = gen.expect_one_of(&["CONNECTED", "CONNECT-ERROR "]);
        assert_eq!(
            connected, "CONNECTED",
            "round {round}: the generation rank's connect"
        );
        // One connection on both sides: data under the session's tags lands.
        let line = served_without_refusals(&mut ctx, &mut gen, &format!("round {round}"));
        assert_eq!(field(&line, "peers_failed"), "0", "round {round}: {line}");
    }
}

/// Request 1 completes with every byte checked, and (the crossing settled) neither side has
/// counted a refusal. Returns the generation rank's line.
fn served_without_refusals(ctx: &mut Proc, gen: &mut Proc, what: &str) -> String {
    gen.send("REQ 1");
    let line = gen.expect("GEN 1 ");
    assert_eq!(field(&line, "end"), "Completed", "{what}: {line}");
    assert_eq!(field(&line, "verified"), "true", "{what}: {line}");
    let c = ctx.expect("CTX 1 ");
    assert_eq!(field(&c, "end"), "Completed", "{what}: {c}");
    for p in [ctx, gen] {
        let trust = p.expect("TRUST ");
        for counter in ["rank", "by_peer", "auth"] {
            assert_eq!(field(&trust, counter), "0", "{what}: {trust}");
        }
    }
    line
}

#[test]
fn ranks_that_dial_each_other_at_once_over_tcp_share_one_connection() {
    crossings("tcp", 8);
}

/// Over shared memory UCX makes one connection of the two (endpoints by worker address), and
/// the handshake has the higher rank answer; this shows it still holds.
#[test]
fn ranks_that_dial_each_other_at_once_over_shared_memory_share_one_connection() {
    crossings("sm", 4);
}

const DEADLINE_MS: u64 = 800;
const SLACK_MS: f64 = 100.0;

/// A side's connect ended by its deadline + SLACK_MS: connected, or a typed error in time.
fn ended_in_time(p: &mut Proc, ok: &str, err: &str, what: &str) {
    let line = p.expect_one_of(&[ok, err]);
    println!("  {what}: {line}");
    if line.starts_with(err) {
        let late: f64 = field(&line, "late_ms").parse().unwrap();
        assert!(
            late <= SLACK_MS,
            "{what}: {late:.1} ms past the deadline: {line}"
        );
    }
}

/// A crossing during which the context rank is frozen or killed, at several moments of the
/// handshakes: the generation rank's connect (a dial that may have given way to the other's and
/// waits for it) still returns by its deadline + 100 ms.
#[test]
fn a_crossing_with_the_peer_frozen_or_killed_ends_by_the_deadline() {
    for transport in ["tcp", "sm"] {
        for (signal, name) in [(libc::SIGSTOP, "frozen"), (libc::SIGKILL, "killed")] {
            for after_us in [0u64, 200, 500, 1000, 3000] {
                let what = format!("{transport}, context rank {name} {after_us} us in");
                let (ctx, mut gen) = cross(
                    transport,
                    here(transport),
                    DEADLINE_MS,
                    after_us % 2 == 0,
                    Duration::ZERO,
                );
                std::thread::sleep(Duration::from_micros(after_us));
                ctx.signal(signal);
                ended_in_time(&mut gen, "CONNECTED", "CONNECT-ERROR ", &what);
                ctx.signal(libc::SIGCONT);
            }
        }
    }
}

/// A crossing cut by a partition (iptables DROP both ways in the context rank's namespace) at
/// several moments: both connects return by their deadline + 100 ms.
#[test]
fn a_crossing_cut_by_a_partition_ends_by_the_deadline_on_both_sides() {
    let Some(net) = common::net::setup("cross") else {
        return;
    };
    for after_us in [0u64, 300, 1000, 3000] {
        let places = [
            Place {
                ns: Some(&net.b),
                listen: Some(format!("{}:0", net.ip_b)),
            },
            Place {
                ns: Some(&net.a),
                listen: Some(format!("{}:0", net.ip_a)),
            },
        ];
        let what = format!("tcp, partition {after_us} us in");
        let (mut ctx, mut gen) = cross("tcp", places, DEADLINE_MS, true, Duration::ZERO);
        std::thread::sleep(Duration::from_micros(after_us));
        assert!(net.partition(true));
        ended_in_time(&mut gen, "CONNECTED", "CONNECT-ERROR ", &what);
        ended_in_time(&mut ctx, "DIALED ", "DIAL-ERROR ", &what);
        assert!(net.partition(false));
    }
}

/// A crossing whose tie-winning dial (the context rank's: the lower rank wins) has its
/// connection broken as it wins, before its handshake ends (the `break_won_tie` fault). The
/// generation rank's dial was refused for that tie, so no connection is left: the context
/// rank's `connect` dials once more, proving the broken dial's session (the generation rank may
/// still hold that connection bound), and the generation rank's `connect` waits for that dial.
/// Both return the other rank, a request completes, and neither counts a refusal. Crossings
/// that end without a tie leave the fault unfired; rounds go on until it has fired three times.
#[test]
fn a_won_tie_whose_connection_breaks_is_healed_by_a_redial() {
    let (mut fired, mut rounds) = (0u32, 0u32);
    while fired < 3 && rounds < 60 {
        let apart = Duration::from_micros(u64::from(rounds % 4) * 100);
        let ctx_first = rounds % 2 == 0;
        let (mut ctx, mut gen) = cross_with(
            "tcp",
            here("tcp"),
            10_000,
            ctx_first,
            apart,
            &["--break-won-tie"],
        );
        let dialled = ctx.expect_one_of(&["DIALED ", "DIAL-ERROR "]);
        let broken = ctx.expect("WON-TIE-BROKEN ");
        let connected = gen.expect_one_of(&["CONNECTED", "CONNECT-ERROR "]);
        println!(
            "round {rounds} (ctx first: {ctx_first}, {apart:?} apart): {dialled}; {broken}; \
             {connected}"
        );
        assert_eq!(
            dialled, "DIALED 1",
            "round {rounds}: the context rank's connect"
        );
        assert_eq!(
            connected, "CONNECTED",
            "round {rounds}: the generation rank's"
        );
        served_without_refusals(&mut ctx, &mut gen, &format!("round {rounds}"));
        fired += u32::from(broken == "WON-TIE-BROKEN 1");
        rounds += 1;
    }
    println!("the fault fired in {fired} of {rounds} crossings");
    assert!(fired >= 1, "no crossing in {rounds} was a tie");
}
