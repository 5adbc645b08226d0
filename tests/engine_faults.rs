//! Real faults at the engine level, between two OS processes (`kvlink-engine-peer`): a sender
//! frozen mid-transfer (SIGSTOP), a receiver killed mid-transfer (SIGKILL), and a network
//! partition between two namespaces mid-transfer. For each, on tcp and shared memory (the
//! partition on tcp, the only transport that crosses namespaces): every wait on both sides ends
//! by the request's deadline + 100 ms (printed), the outcomes agree where the ranks can talk,
//! no receive buffer stays leased, and the next request on the same engines completes with
//! every byte checked, without any manual `connect()`.
mod common;

use common::net::{setup, Net};
use common::{field, late, Proc};
use std::process::Command;
use std::time::{Duration, Instant};

const PEER: &str = env!("CARGO_BIN_EXE_kvlink-engine-peer");
/// Every request's timeout, ms: 4000, or `KVLINK_FAULTS_TIMEOUT_MS` (the sanitizer run sets a
/// longer one: under AddressSanitizer, in a slow hour, the first 128 MiB request of a fresh
/// pair, filled and checked by unoptimised code on both sides, once took longer than 4 s).
fn timeout_ms() -> u64 {
    std::env::var("KVLINK_FAULTS_TIMEOUT_MS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(4000)
}
/// The promise: every wait returns by its deadline plus this.
const SLACK_MS: f64 = 100.0;
/// Two 64 MiB segments: long enough on loopback (tcp about 50 ms, shared memory about 15 ms)
/// that a fault 2 ms after the sender starts lands mid-transfer.
const SIZES: &str = "64M,64M";

fn peer_cmd(ns: Option<&str>) -> Command {
    match ns {
        Some(ns) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns, PEER]);
            c
        }
        None => Command::new(PEER),
    }
}

fn start_ctx(tl: &str, ns: Option<&str>, listen: Option<&str>) -> (Proc, String) {
    start_ctx_with(tl, ns, listen, &[])
}

fn start_ctx_with(
    tl: &str,
    ns: Option<&str>,
    listen: Option<&str>,
    extra: &[&str],
) -> (Proc, String) {
    let mut cmd = peer_cmd(ns);
    cmd.args([
        "ctx",
        "--transport",
        tl,
        "--timeout-ms",
        &timeout_ms().to_string(),
    ])
    .args(extra);
    if let Some(l) = listen {
        cmd.args(["--listen", l]);
    }
    let mut ctx = Proc::spawn(cmd);
    let addr = ctx.expect_addr();
    (ctx, addr)
}

fn start_gen(tl: &str, ns: Option<&str>, addr: &str) -> Proc {
    start_gen_with(tl, ns, addr, &[])
}

fn start_gen_with(tl: &str, ns: Option<&str>, addr: &str, extra: &[&str]) -> Proc {
    let mut cmd = peer_cmd(ns);
    cmd.args(["gen", "--transport", tl, "--to", addr, "--sizes", SIZES])
        .args(["--timeout-ms", &timeout_ms().to_string()])
        .args(extra);
    let mut gen = Proc::spawn(cmd);
    gen.expect("CONNECTED");
    gen
}

/// One request that must complete on both sides, every byte checked.
fn completes(ctx: &mut Proc, gen: &mut Proc, id: u64) {
    gen.send(&format!("REQ {id}"));
    let g = gen.expect(&format!("GEN {id} "));
    let c = ctx.expect(&format!("CTX {id} "));
    assert_eq!(field(&g, "end"), "Completed", "{g}");
    assert_eq!(field(&g, "verified"), "true", "{g}");
    assert_eq!(field(&g, "leased"), "0", "{g}");
    assert_eq!(field(&c, "end"), "Completed", "{c}");
}

/// Starts request `id` and returns once the sender has begun sending it.
fn start_request(tl: &str, ctx: &mut Proc, gen: &mut Proc, id: u64) {
    gen.send(&format!("REQ {id}"));
    gen.expect(&format!("ADV {id}"));
    ctx.expect(&format!("SENDING {id}"));
    // The sender says SENDING just before it posts: give it time to post and its first message
    // time to be matched (the tests that freeze it then count on a transfer under way), but
    // less than the 64 MiB take (12 ms and more on tcp here; shared memory moves them in as
    // little as 6 ms). 2 ms was once too short on tcp on a CI machine running the suite's tests
    // side by side, and even 5 ms can be on a loaded one (the sender, not yet scheduled, was
    // frozen before its data was matched): a test that needs the data matched checks that it
    // was and starts the round again.
    let settle = if tl == "tcp" { 5 } else { 2 };
    std::thread::sleep(Duration::from_millis(settle));
}

/// A pair on `tl` that has completed request 1 and is in the middle of sending request 2;
/// also the context side's address.
fn pair_mid_request(tl: &str, gen_extra: &[&str], ctx_extra: &[&str]) -> (Proc, Proc, String) {
    let (mut ctx, addr) = start_ctx_with(tl, None, None, ctx_extra);
    let mut gen = start_gen_with(tl, None, &addr, gen_extra);
    completes(&mut ctx, &mut gen, 1);
    start_request(tl, &mut ctx, &mut gen, 2);
    (ctx, gen, addr)
}

/// The receiver's HEALTH line once its regions have no fenced bytes left (or `within` has
/// passed), and how long that took.
fn unfenced(gen: &mut Proc, within: Duration) -> (String, Duration) {
    let t0 = Instant::now();
    loop {
        gen.send("HEALTH");
        let h = gen.expect("HEALTH");
        if field(&h, "region_fenced") == "0" || t0.elapsed() > within {
            return (h, t0.elapsed());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn check_bounded(side: &str, line: &str) {
    let l = late(line);
    println!("  {side}: {line}  -> ended {l:.1} ms past the deadline");
    assert!(
        l <= SLACK_MS,
        "{side} ended {l:.1} ms past its deadline: {line}"
    );
    assert_ne!(field(line, "end"), "Completed", "{line}");
    assert_eq!(field(line, "leased"), "0", "{line}");
}

#[test]
fn frozen_sender_mid_transfer_ends_both_sides_by_the_deadline_and_the_pair_heals() {
    for tl in ["tcp", "sm"] {
        println!("== {tl}: sender frozen (SIGSTOP) mid-transfer");
        let (mut ctx, mut gen, _) = pair_mid_request(tl, &[], &[]);
        ctx.signal(libc::SIGSTOP);
        let g = gen.expect("GEN 2 ");
        check_bounded("receiver", &g);
        ctx.signal(libc::SIGCONT);
        let t0 = Instant::now();
        let c = ctx.expect("CTX 2 ");
        println!(
            "  sender (frozen past its deadline): {c}, {:?} after SIGCONT",
            t0.elapsed()
        );
        assert!(t0.elapsed() < Duration::from_secs(1), "{c}");
        // The frozen rank could not talk before its deadline: it reports a failure too, the
        // verdict's (TimedOut) if it reads that first, else PeerLost for the endpoint the
        // receiver closed to stop the half-done transfer (README: "How a request moves").
        assert!(["TimedOut", "PeerLost"].contains(&field(&c, "end")), "{c}");
        completes(&mut ctx, &mut gen, 3);
        gen.send("HEALTH");
        println!("  after: {}", gen.expect("HEALTH"));
    }
}

/// The receiver frozen mid-transfer: the sender cannot recall a send its receiver does not
/// drain, so at its deadline it force-closes the endpoint (plain caller memory). Once the
/// receiver runs again its wait ends at once with a failure, and the next request, made
/// right away, completes: the close must reach the receiver before that request does.
#[test]
fn frozen_receiver_mid_transfer_ends_the_sender_by_the_deadline_and_the_next_request_completes() {
    for tl in ["tcp", "sm"] {
        println!("== {tl}: receiver frozen (SIGSTOP) mid-transfer");
        // `start_request` leaves the sender a few ms, less than the 128 MiB take; on a loaded
        // machine the freeze can still come after all of it landed (the request then completes
        // on both sides, seen once in 32 runs of the three frozen tests two at a time here, sm).
        // Such a round tests nothing: it is started afresh, three times at most.
        let mut tries = 0;
        let (mut ctx, mut gen, c) = loop {
            tries += 1;
            let (mut ctx, mut gen, _) = pair_mid_request(tl, &[], &[]);
            gen.signal(libc::SIGSTOP);
            let c = ctx.expect("CTX 2 ");
            if field(&c, "end") == "Completed" && tries < 3 {
                println!("  frozen after the request completed: {c}; again");
                gen.signal(libc::SIGCONT);
                let g = gen.expect("GEN 2 ");
                assert_eq!(field(&g, "end"), "Completed", "{g}");
                continue;
            }
            break (ctx, gen, c);
        };
        check_bounded("sender", &c);
        gen.signal(libc::SIGCONT);
        let t0 = Instant::now();
        let g = gen.expect("GEN 2 ");
        println!(
            "  receiver (frozen past its deadline): {g}, {:?} after SIGCONT",
            t0.elapsed()
        );
        assert!(t0.elapsed() < Duration::from_secs(1), "{g}");
        assert_ne!(field(&g, "end"), "Completed", "{g}");
        assert_eq!(field(&g, "leased"), "0", "{g}");
        completes(&mut ctx, &mut gen, 3);
        gen.send("HEALTH");
        println!("  after: {}", gen.expect("HEALTH"));
    }
}

#[test]
fn killed_receiver_mid_transfer_ends_the_sender_by_the_deadline_and_it_serves_the_next() {
    for tl in ["tcp", "sm"] {
        println!("== {tl}: receiver killed (SIGKILL) mid-transfer");
        let (mut ctx, gen, addr) = pair_mid_request(tl, &[], &[]);
        gen.signal(libc::SIGKILL);
        let c = ctx.expect("CTX 2 ");
        check_bounded("sender", &c);
        drop(gen);
        // A new receiver process; the same sender engine serves it.
        let mut gen = start_gen(tl, None, &addr);
        completes(&mut ctx, &mut gen, 3);
    }
}

#[test]
fn partition_mid_transfer_ends_both_sides_by_the_deadline_and_the_pair_heals() {
    let Some(net): Option<Net> = setup("epart") else {
        return;
    };
    // Plain caller memory, then regions on both sides (where no side closes anything: the
    // transfers UCX still holds are fenced by range until the pair can talk again).
    let plain: (&[&str], &[&str]) = (&[], &[]);
    let regions: (&[&str], &[&str]) = (&["--region"], &["--region-mb", "256"]);
    for (gen_extra, ctx_extra) in [plain, regions] {
        println!(
            "== tcp: partition (iptables DROP both ways) mid-transfer {gen_extra:?} {ctx_extra:?}"
        );
        let listen = format!("{}:0", net.ip_b);
        let (mut ctx, addr) = start_ctx_with("tcp", Some(&net.b), Some(&listen), ctx_extra);
        let mut gen = start_gen_with("tcp", Some(&net.a), &addr, gen_extra);
        completes(&mut ctx, &mut gen, 1);
        start_request("tcp", &mut ctx, &mut gen, 2);
        assert!(net.partition(true));
        let g = gen.expect("GEN 2 ");
        let c = ctx.expect("CTX 2 ");
        check_bounded("receiver", &g);
        check_bounded("sender", &c);
        assert!(net.partition(false));
        // Request 3 uses the other half of a region; request 4 the half request 2 used, once
        // its fence (if any) has lifted.
        completes(&mut ctx, &mut gen, 3);
        let (h, took) = unfenced(&mut gen, Duration::from_secs(10));
        println!("  fence clear after {took:?}: {h}");
        assert_eq!(field(&h, "region_fenced"), "0", "{h}");
        completes(&mut ctx, &mut gen, 4);
        gen.send("HEALTH");
        let h = gen.expect("HEALTH");
        println!("  after: {h}");
        if !gen_extra.is_empty() {
            assert_eq!(field(&h, "failed"), "0", "an endpoint was closed: {h}");
        }
    }
}

/// `health().state` tells alive from working: a receiver whose sender is frozen mid-transfer is
/// `Wedged` while it waits (work pending, no data moving for longer than the 1 s window), and
/// recovery brings it back: `Degraded` while the fault is recent (3 s window), then `Healthy`.
#[test]
fn health_state_is_wedged_while_a_peer_is_frozen_and_recovers() {
    let (mut ctx, addr) = start_ctx("tcp", None, None);
    let extra = [
        "--wedge-ms",
        "1000",
        "--degraded-ms",
        "3000",
        "--health-every-ms",
        "100",
    ];
    let mut gen = start_gen_with("tcp", None, &addr, &extra);
    completes(&mut ctx, &mut gen, 1);
    assert_eq!(gen.expect("STATE "), "STATE Healthy");
    start_request("tcp", &mut ctx, &mut gen, 2);
    ctx.signal(libc::SIGSTOP);
    // Before the request's deadline (4 s) the receiver must be seen Wedged.
    let seen = gen.expect_one_of(&["STATE Wedged", "GEN 2 "]);
    assert_eq!(seen, "STATE Wedged", "not Wedged before the request ended");
    let fault_seen = gen.states.len();
    let g = gen.expect("GEN 2 ");
    check_bounded("receiver", &g);
    ctx.signal(libc::SIGCONT);
    ctx.expect("CTX 2 ");
    completes(&mut ctx, &mut gen, 3);
    let t0 = Instant::now();
    assert_eq!(gen.expect_one_of(&["STATE Healthy"]), "STATE Healthy");
    // On the way back from Wedged it was Degraded (the fault within its 3 s window), not
    // straight Healthy.
    let after: Vec<&String> = gen.states[fault_seen..].iter().collect();
    let degraded = after.iter().position(|s| *s == "STATE Degraded");
    let healthy = after.iter().position(|s| *s == "STATE Healthy");
    assert!(
        degraded.is_some() && degraded < healthy,
        "states after the fault: {after:?}"
    );
    println!(
        "  Healthy again {:?} after the pair recovered",
        t0.elapsed()
    );
}

/// A receiver whose data never comes (the sender's completion is lost: `--suppress`) waits 10 s
/// for it at under 2% of a core, and ends TimedOut by the deadline + 100 ms.
#[test]
fn waiting_ten_seconds_for_data_that_never_comes_costs_under_two_percent_of_a_core() {
    std::thread::scope(|s| {
        for tl in ["tcp", "sm"] {
            s.spawn(move || {
                let mut cmd = peer_cmd(None);
                cmd.args([
                    "ctx",
                    "--transport",
                    tl,
                    "--timeout-ms",
                    "10000",
                    "--suppress",
                    "5",
                ]);
                let mut ctx = Proc::spawn(cmd);
                let addr = ctx.expect_addr();
                let mut cmd = peer_cmd(None);
                cmd.args(["gen", "--transport", tl, "--to", &addr, "--sizes", "1M"])
                    .args(["--timeout-ms", "10000"]);
                let mut gen = Proc::spawn(cmd);
                gen.expect("CONNECTED");
                gen.send("REQ 5");
                let g = gen.expect("GEN 5 ");
                let cpu: f64 = field(&g, "cpu_ms").parse().unwrap();
                let share = cpu / 10_000.0 * 100.0;
                println!("{tl}: {g} -> {share:.3}% of a core while waiting");
                assert_eq!(field(&g, "end"), "TimedOut", "{g}");
                assert!(late(&g) <= SLACK_MS, "{g}");
                assert!(share < 2.0, "waiting used {share:.2}% of a core: {g}");
            });
        }
    });
}

/// Dials `addr` with a connect deadline `connect_ms` from now; the handshake must not finish.
/// Asserts the typed error came by the deadline + SLACK_MS.
fn connect_fails_in_time(tl: &str, ns: Option<&str>, addr: &str, connect_ms: &str, what: &str) {
    let mut cmd = peer_cmd(ns);
    cmd.args(["gen", "--transport", tl, "--to", addr])
        .args(["--connect-ms", connect_ms]);
    let mut gen = Proc::spawn(cmd);
    let line = gen.expect_one_of(&["CONNECT-ERROR ", "CONNECTED"]);
    let l = late(&line);
    println!("  connect, {what} ({connect_ms} ms deadline): {l:+.1} ms past it: {line}");
    assert!(line.starts_with("CONNECT-ERROR "), "{what}: {line}");
    assert!(
        l <= SLACK_MS,
        "{what}: connect ended {l:.1} ms past its deadline"
    );
}

/// `connect` is a blocking call like any other: with a frozen peer, a dead one, a partitioned
/// one, and a deadline already passed, it returns its typed error by its deadline + 100 ms.
#[test]
fn connect_returns_by_its_deadline_whatever_the_peer_does() {
    for tl in ["tcp", "sm"] {
        println!("== {tl}: connect to a frozen, a live (past deadline) and a dead peer");
        let (mut ctx, addr) = start_ctx(tl, None, None);
        ctx.signal(libc::SIGSTOP);
        connect_fails_in_time(tl, None, &addr, "800", "frozen peer");
        ctx.signal(libc::SIGCONT);
        connect_fails_in_time(tl, None, &addr, "0", "deadline already passed");
        ctx.child.kill().unwrap();
        ctx.child.wait().unwrap();
        connect_fails_in_time(tl, None, &addr, "800", "dead peer");
    }
    let Some(net): Option<Net> = setup("cpart") else {
        return;
    };
    println!("== tcp: connect across a partition (iptables DROP both ways)");
    let listen = format!("{}:0", net.ip_b);
    let (_ctx, addr) = start_ctx("tcp", Some(&net.b), Some(&listen));
    assert!(net.partition(true));
    connect_fails_in_time("tcp", Some(&net.a), &addr, "800", "partitioned peer");
}

/// Regions (`Engine::register_region`) on both sides: a frozen sender mid-transfer ends the
/// receiver by its deadline, and no endpoint is closed anywhere, then or after. The receives
/// UCX still holds are fenced by range, and only that range is refused (`Fenced`, at once)
/// while the sender stays frozen. When the sender resumes past its deadline, its send (which
/// its receiver cannot drain: the data is already matched) is left to UCX instead of its
/// endpoint being closed; the transfer finishes into the fenced range, both fences lift by
/// themselves, and the same endpoints serve both halves of the regions again with every byte
/// checked. Finally a deregistration ends a fence that nothing lifts (the sender frozen again)
/// by closing that endpoint, and returns by its deadline.
#[test]
fn frozen_sender_into_a_region_fences_only_its_range_and_the_pair_goes_on() {
    for tl in ["tcp", "sm"] {
        println!("== {tl}: sender frozen (SIGSTOP) mid-transfer, both sides in regions");
        // Request 1 (half 1) completes; request 2 (half 0) is mid-transfer. On sm a sender
        // frozen mid-write holds the receiver's shared-memory queue until it resumes; by default
        // the receiver's probe then fails every peer (docs/RELIABILITY.md), which is not what
        // this test is about: the receiver only reports it here.
        let gen_extra = ["--region", "--stuck-report"];
        // On tcp the freeze must come after the receiver matched the data (the transfer is
        // then one UCX cannot recall, and must be fenced): `start_request` leaves the sender
        // a few ms to get there, which a loaded machine may not give it. Such a round fences
        // nothing; it is started afresh, three times at most.
        let mut tries = 0;
        let (mut ctx, mut gen, g, fenced) = loop {
            tries += 1;
            let (ctx, mut gen, _) = pair_mid_request(tl, &gen_extra, &["--region-mb", "256"]);
            ctx.signal(libc::SIGSTOP);
            let g = gen.expect("GEN 2 ");
            check_bounded("receiver", &g);
            let fenced: u64 = field(&g, "region_fenced").parse().unwrap();
            assert_eq!(
                field(&g, "peers_failed"),
                "0",
                "an endpoint was closed: {g}"
            );
            if tl == "tcp" && fenced == 0 && tries < 3 {
                println!("  frozen before the data was matched (nothing to fence): again");
                ctx.signal(libc::SIGCONT);
                continue;
            }
            break (ctx, gen, g, fenced);
        };
        if tl == "tcp" {
            // A matched 64 MiB rendezvous on tcp cannot be recalled.
            assert!(fenced > 0, "{g}");
        }
        if fenced > 0 {
            // Half 0 is fenced: refused at once, while the sender is still frozen.
            let t0 = Instant::now();
            gen.send("REQ 4");
            let r = gen.expect("GEN 4 ");
            println!("  overlapping the fence: {r} ({:?})", t0.elapsed());
            assert!(r.contains("advertise-error Fenced"), "{r}");
            assert!(t0.elapsed() < Duration::from_millis(500), "{r}");
        } else {
            println!("  UCX released every receive in time: nothing was fenced this round");
        }
        ctx.signal(libc::SIGCONT);
        let t0 = Instant::now();
        let c = ctx.expect("CTX 2 ");
        println!("  sender: {c} ({:?} after SIGCONT)", t0.elapsed());
        assert!(t0.elapsed() < Duration::from_secs(1), "{c}");
        assert_eq!(field(&c, "end"), "TimedOut", "{c}");
        assert_eq!(
            field(&c, "peers_failed"),
            "0",
            "an endpoint was closed: {c}"
        );
        // The fences lift by themselves once UCX releases the transfers.
        let (h, took) = unfenced(&mut gen, Duration::from_secs(5));
        println!("  receiver's fence lifted {took:?} after the sender's end: {h}");
        assert_eq!(field(&h, "region_fenced"), "0", "{h}");
        assert_eq!(field(&h, "leased"), "0", "{h}");
        assert_eq!(field(&h, "fenced"), "0", "{h}");
        assert_eq!(
            field(&h, "region_fences").parse::<u64>().unwrap() > 0,
            fenced > 0,
            "{h}"
        );
        // Both halves serve again on the same endpoints, the once-fenced one included.
        completes(&mut ctx, &mut gen, 3);
        completes(&mut ctx, &mut gen, 6);
        gen.send("HEALTH");
        let h = gen.expect("HEALTH");
        println!("  after: {h}");
        assert_eq!(field(&h, "failed"), "0", "an endpoint was closed: {h}");
        assert_eq!(field(&h, "reconnects"), "0", "{h}");
        // A fence that nothing lifts: the sender frozen again mid-transfer (request 7, half 1;
        // on tcp, as above, again with 9 and 11 if the freeze came before the data was matched).
        let mut id = 7;
        let g = loop {
            start_request(tl, &mut ctx, &mut gen, id);
            ctx.signal(libc::SIGSTOP);
            let g = gen.expect(&format!("GEN {id} "));
            check_bounded("receiver", &g);
            if tl != "tcp" || field(&g, "region_fenced") != "0" || id >= 11 {
                break g;
            }
            println!("  frozen before the data was matched (nothing to fence): again");
            ctx.signal(libc::SIGCONT);
            ctx.expect(&format!("CTX {id} "));
            id += 2;
        };
        if tl == "tcp" {
            assert_ne!(field(&g, "region_fenced"), "0", "{g}");
        }
        let t0 = Instant::now();
        gen.send("DEREG 1000");
        let d = gen.expect("DEREG ");
        println!(
            "  deregistered with {} bytes fenced: {d} in {:?}",
            field(&g, "region_fenced"),
            t0.elapsed()
        );
        assert!(d.starts_with("DEREG ok"), "{d}");
        assert!(late(&d) <= SLACK_MS, "{d}");
        ctx.signal(libc::SIGCONT);
    }
}

/// A context process drops its engine after one request and lives on (a host that tears its
/// transceiver down and builds another). Its `Leaving` tells the generation process at once:
/// the peer reads `Reconnecting` or `Failed` within a moment, counted as a leave. Before, over
/// shared memory the generation side never learned it while the process lived (UCX's
/// keepalive there checks the process): the peer stayed `Connected` and every request to it
/// ran to its deadline. A request made then ends by its deadline + 100 ms, not `Completed`.
#[test]
fn an_engine_dropped_in_a_live_process_is_seen_gone_at_once() {
    for tl in ["sm", "tcp"] {
        let (mut ctx, addr) = start_ctx_with(tl, None, None, &["--drop-after", "1"]);
        let mut gen = start_gen(tl, None, &addr);
        completes(&mut ctx, &mut gen, 1);
        ctx.expect("DROPPED");
        let t0 = Instant::now();
        let line = loop {
            gen.send("HEALTH");
            let h = gen.expect("HEALTH");
            if field(&h, "peer") != "Connected" || t0.elapsed() > Duration::from_secs(2) {
                break h;
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        println!("{tl}: {line} ({:?} after DROPPED)", t0.elapsed());
        assert_ne!(field(&line, "peer"), "Connected", "{tl}: {line}");
        assert_eq!(field(&line, "left"), "1", "{tl}: {line}");
        assert!(
            ctx.child.try_wait().unwrap().is_none(),
            "{tl}: the process without its engine exited"
        );
        gen.send("REQ 2");
        let g = gen.expect("GEN 2 ");
        println!("{tl}: {g}");
        if g.contains("advertise-error") {
            // Refused while the reconnect round found no engine at the address.
            assert!(late(&g) <= SLACK_MS, "{tl}: {g}");
        } else {
            check_bounded("gen", &g);
        }
    }
}

/// An engine being dropped takes no new connection while it drains. A context process drops its
/// engine with one generation process frozen (SIGSTOP), so the drain runs its whole 200 ms
/// waiting for that one's answer; the other, live, answers the `Leaving` and its reconnect round
/// (kept: it dialled a listener) dials the address again 50 ms later, inside that drain. It must
/// find no engine there: the leave is the only failure the live side counts (`left=1`,
/// `failed=1`: a leave counts in both) and the rank is not bound again. Before, the draining
/// engine accepted and bound the dial, then closed it at the drain's end without a word: the
/// live side counted that close as a second failure, a fault (`failed=2`), and spent its round
/// on a dead port.
#[test]
fn an_engine_being_dropped_takes_no_new_connection_while_it_drains() {
    let (mut ctx, addr) = start_ctx_with("tcp", None, None, &["--drop-after", "1"]);
    let mut live = start_gen("tcp", None, &addr);
    let frozen = start_gen_with("tcp", None, &addr, &["--rank", "2"]);
    frozen.signal(libc::SIGSTOP);
    completes(&mut ctx, &mut live, 1);
    ctx.expect("DROPPED");
    // Past the drain and the round's first dials (50 and 100 ms apart).
    std::thread::sleep(Duration::from_millis(600));
    live.send("HEALTH");
    let h = live.expect("HEALTH");
    println!("the live generation process after the drop: {h}");
    assert_eq!(field(&h, "left"), "1", "{h}");
    assert_eq!(field(&h, "failed"), "1", "a failure beside the leave: {h}");
    assert_ne!(field(&h, "peer"), "Connected", "{h}");
    frozen.signal(libc::SIGCONT);
}

/// Dropping an engine (the C++ destructor) is a blocking call too: it waits for each bound peer
/// to answer its `Leaving`, within its 200 ms drain (`DRAIN_ON_DROP`), and then closes. Whatever
/// the peer does, frozen (SIGSTOP), dead (SIGKILL) or cut off (a partition between two
/// namespaces, tcp), the drop returns by that drain + 100 ms (printed): nothing in it waits on
/// the peer past the drain, neither the close of its endpoints nor the stop of the progress
/// thread. A live peer answers, so the drop then takes a round trip.
#[test]
fn a_dropped_engine_returns_by_its_drain_whatever_the_peer_does() {
    const DRAIN_MS: f64 = 200.0;
    let dropped = |gen: &mut Proc, case: &str| -> f64 {
        gen.send("DROP");
        let line = gen.expect("DROPPED");
        let ms: f64 = field(&line, "ms").parse().unwrap_or(f64::MAX);
        println!("  {case}: {line}");
        assert!(
            ms <= DRAIN_MS + SLACK_MS,
            "{case}: the drop took {ms:.1} ms: {line}"
        );
        ms
    };
    for tl in ["tcp", "sm"] {
        println!("== {tl}: engine dropped, its peer live, frozen (SIGSTOP), killed (SIGKILL)");
        let (mut ctx, addr) = start_ctx(tl, None, None);
        let mut gen = start_gen(tl, None, &addr);
        completes(&mut ctx, &mut gen, 1);
        let ms = dropped(&mut gen, "live peer");
        assert!(ms < DRAIN_MS, "{tl}: a live peer answers within the drain");

        let mut gen = start_gen(tl, None, &addr);
        completes(&mut ctx, &mut gen, 2);
        ctx.signal(libc::SIGSTOP);
        dropped(&mut gen, "frozen peer (SIGSTOP)");
        ctx.signal(libc::SIGCONT);

        let mut gen = start_gen(tl, None, &addr);
        completes(&mut ctx, &mut gen, 3);
        ctx.signal(libc::SIGKILL);
        dropped(&mut gen, "dead peer (SIGKILL)");
    }
    let Some(net): Option<Net> = setup("edrop") else {
        return;
    };
    println!("== tcp: engine dropped, its peer cut off (iptables DROP both ways)");
    let listen = format!("{}:0", net.ip_b);
    let (mut ctx, addr) = start_ctx("tcp", Some(&net.b), Some(&listen));
    let mut gen = start_gen("tcp", Some(&net.a), &addr);
    completes(&mut ctx, &mut gen, 1);
    assert!(net.partition(true));
    dropped(&mut gen, "partitioned peer");
    assert!(net.partition(false));
}
