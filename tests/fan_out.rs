//! One request filled by several context processes at once, as a generation rank of
//! tensor-parallel size 1 pulls the KV cache of a context instance of tensor-parallel size 6:
//! every context rank sends its part. Real OS processes (`kvlink-engine-peer`), tcp and shared
//! memory: one generation process, six context processes, two segments per context rank. A
//! request completes, every byte checked; then, with a request's transfers under way, one
//! context process is killed (SIGKILL), and in the next request another is frozen (SIGSTOP,
//! resumed once the others have ended). What must hold:
//! - the generation rank's wait and every surviving context rank's wait end by the request's
//!   deadline + 100 ms, the generation rank's not `Completed`, with nothing leased;
//! - every surviving context rank ends the request as the generation rank does (they can still
//!   talk: the generation rank, the request's only receiver, decides and tells them);
//! - a next request over the context ranks that are left, the resumed one included, completes
//!   with every byte checked, without any manual `connect()`.
mod common;

use common::{field, late, Proc};
use std::process::Command;

const PEER: &str = env!("CARGO_BIN_EXE_kvlink-engine-peer");
const TIMEOUT_MS: u64 = 3000;
/// The promise: every wait returns by its deadline plus this.
const SLACK_MS: f64 = 100.0;
const RANKS: usize = 6;
/// Each request's segments: two per context rank.
const SEGMENTS: usize = 2 * RANKS;
/// Context rank 5 is killed while a request over all six runs; then rank 2 is frozen while a
/// request over the other five runs.
const KILLED: usize = 5;
const FROZEN: usize = 2;
/// The generation rank's id (the context ranks are 0..6).
const GEN_RANK: &str = "100";

/// The context ranks that fill segment `i` when a request draws on `from` (the peer's
/// `segment i from from[i % n]`).
fn sender(from: &[usize], i: usize) -> usize {
    from[i % from.len()]
}

/// Every segment 8 MiB, but those of the victims 32 MiB: the killed rank's in a request over
/// all six, the frozen rank's in a request over the five left. 64 MiB and more of one rank's
/// cannot have landed a moment after it began, so the faults land while its data moves.
fn sizes(all: &[usize], five: &[usize]) -> String {
    (0..SEGMENTS)
        .map(
            |i| match sender(all, i) == KILLED || sender(five, i) == FROZEN {
                true => "32M",
                false => "8M",
            },
        )
        .collect::<Vec<_>>()
        .join(",")
}

fn ctx(tl: &str, rank: usize) -> (Proc, String) {
    let mut cmd = Command::new(PEER);
    cmd.args(["ctx", "--transport", tl, "--rank", &rank.to_string()])
        .args(["--timeout-ms", &TIMEOUT_MS.to_string()]);
    let mut p = Proc::spawn(cmd);
    let addr = p.expect_addr();
    (p, addr)
}

/// `REQ <id> from=..` naming the context ranks (positions of the `--to` list) in `from`.
fn req(id: u64, from: &[usize]) -> String {
    let from: Vec<String> = from.iter().map(|r| r.to_string()).collect();
    format!("REQ {id} from={}", from.join(","))
}

/// Request `id` over the context ranks `from`: it must complete on every side, every byte
/// checked.
fn completes(gen: &mut Proc, ctxs: &mut [Option<Proc>], from: &[usize], id: u64) {
    gen.send(&req(id, from));
    let g = gen.expect(&format!("GEN {id} "));
    assert_eq!(field(&g, "end"), "Completed", "{g}");
    assert_eq!(field(&g, "verified"), "true", "{g}");
    assert_eq!(field(&g, "leased"), "0", "{g}");
    for &r in from {
        let c = ctxs[r].as_mut().unwrap().expect(&format!("CTX {id} "));
        assert_eq!(field(&c, "send"), "Completed", "context rank {r}: {c}");
        assert_eq!(field(&c, "end"), "Completed", "context rank {r}: {c}");
    }
}

/// Request `id` over `from`, with `fault` dealt to context rank `victim` as soon as it has begun
/// sending; `after`, if any, is dealt to it once the others have ended, else the victim is
/// reaped at once (a killed process left a zombie still counts as alive to shared memory's
/// keepalive). Checks the deadline rule and the agreement on every side that can still talk.
fn faulted(
    gen: &mut Proc,
    ctxs: &mut [Option<Proc>],
    from: &[usize],
    id: u64,
    (victim, fault, after): (usize, i32, Option<i32>),
) {
    gen.send(&req(id, from));
    gen.expect(&format!("ADV {id}"));
    ctxs[victim]
        .as_mut()
        .unwrap()
        .expect(&format!("SENDING {id}"));
    ctxs[victim].as_ref().unwrap().signal(fault);
    if after.is_none() {
        drop(ctxs[victim].take());
    }
    let g = gen.expect(&format!("GEN {id} "));
    let gl = late(&g);
    println!("  generation rank: {g}  -> {gl:.1} ms past the deadline");
    assert!(gl <= SLACK_MS, "the generation rank's wait: {g}");
    let end = field(&g, "end");
    // Else the fault missed the transfer and tested nothing.
    assert_ne!(end, "Completed", "{g}");
    assert_eq!(field(&g, "leased"), "0", "{g}");
    for &r in from.iter().filter(|&&r| r != victim) {
        let c = ctxs[r].as_mut().unwrap().expect(&format!("CTX {id} "));
        let l = late(&c);
        println!("  context rank {r}: {c}  -> {l:.1} ms past the deadline");
        assert!(l <= SLACK_MS, "context rank {r}'s wait: {c}");
        assert_eq!(field(&c, "end"), end, "context rank {r} against {g}");
        assert_eq!(field(&c, "leased"), "0", "context rank {r}: {c}");
    }
    if let Some(sig) = after {
        let v = ctxs[victim].as_mut().unwrap();
        v.signal(sig);
        let c = v.expect(&format!("CTX {id} "));
        println!("  context rank {victim}, resumed: {c}");
        assert_ne!(field(&c, "end"), "Completed", "the frozen rank: {c}");
        assert_eq!(field(&c, "leased"), "0", "the frozen rank: {c}");
    }
}

fn fan_out(tl: &str) {
    println!("== {tl}: one generation rank pulling from {RANKS} context ranks");
    let (mut ctxs, addrs): (Vec<Option<Proc>>, Vec<String>) = (0..RANKS)
        .map(|r| {
            let (p, a) = ctx(tl, r);
            (Some(p), a)
        })
        .unzip();
    let all: Vec<usize> = (0..RANKS).collect();
    let five: Vec<usize> = all.iter().copied().filter(|&r| r != KILLED).collect();
    let mut cmd = Command::new(PEER);
    cmd.args(["gen", "--transport", tl, "--to", &addrs.join(",")])
        .args(["--sizes", &sizes(&all, &five), "--rank", GEN_RANK])
        .args(["--timeout-ms", &TIMEOUT_MS.to_string()]);
    let mut gen = Proc::spawn(cmd);
    gen.expect("CONNECTED");

    // (a) All six fill one request.
    completes(&mut gen, &mut ctxs, &all, 1);
    // (b) One of them is killed mid-transfer.
    faulted(&mut gen, &mut ctxs, &all, 2, (KILLED, libc::SIGKILL, None));
    // (c) Over the five left, one is frozen mid-transfer, and resumed after the others ended.
    let frozen = (FROZEN, libc::SIGSTOP, Some(libc::SIGCONT));
    faulted(&mut gen, &mut ctxs, &five, 3, frozen);
    // (d) The five, the resumed one among them, fill the next request.
    completes(&mut gen, &mut ctxs, &five, 4);
    // Nothing the faults touched is still held, and the five read connected.
    gen.send("HEALTH");
    let h = gen.expect("HEALTH ");
    for held in ["leased", "fenced", "unsettled", "region_fenced"] {
        assert_eq!(field(&h, held), "0", "{held}: {h}");
    }
    let states: Vec<&str> = field(&h, "peer").split(',').collect();
    for &r in &five {
        assert_eq!(states[r], "Connected", "context rank {r}: {h}");
    }
}

#[test]
fn six_context_ranks_fill_one_request_and_a_killed_or_frozen_one_ends_it_on_every_side_in_time() {
    for tl in ["tcp", "sm"] {
        fan_out(tl);
    }
}
