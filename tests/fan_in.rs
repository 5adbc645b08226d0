//! One context rank serving many generation processes at once, as a context instance of a
//! disaggregated deployment serves every generation instance that pulls from it. Real OS
//! processes (`kvlink-engine-peer`), tcp and shared memory: eight generation ranks each pull a
//! request at the same moment; then, with the next round's transfers under way, two of them are
//! killed (SIGKILL) and one is frozen (SIGSTOP). What must hold:
//! - the five others complete their requests, every byte checked, while the frozen one is still
//!   stopped: a rank that cannot take its data holds up no other rank's request;
//! - the context rank ends every request of that round, its victims' included, by the
//!   request's deadline + 100 ms, and a send to a killed rank ends `PeerLost` (or `Completed`
//!   if its data was in), not as a transport error;
//! - afterwards the frozen rank, resumed, and the two killed ranks, restarted under their old
//!   rank ids, are served again with the rest, without any manual `connect()` on the
//!   context side.
mod common;

use common::{field, late, Proc};
use std::collections::HashMap;
use std::process::Command;
use std::time::Duration;

const PEER: &str = env!("CARGO_BIN_EXE_kvlink-engine-peer");
const TIMEOUT_MS: u64 = 4000;
/// The promise: every wait returns by its deadline plus this.
const SLACK_MS: f64 = 100.0;
/// Two segments of 16 MiB per request: eight at once take tens of milliseconds on loopback,
/// so the faults land while transfers are under way.
const SIZES: &str = "16M,16M";
/// The frozen rank's: 128 MiB that cannot have landed 5 ms after the context side began.
const FROZEN_SIZES: &str = "64M,64M";
const RANKS: u32 = 8;
/// Ranks 0 and 1 of the eight are killed, rank 2 is frozen.
const KILLED: [u32; 2] = [0, 1];
const FROZEN: u32 = 2;

/// The context rank's lines, read as they come and kept until asked for: its serving threads
/// print them in any order.
struct Ctx {
    proc: Proc,
    kept: Vec<String>,
}

impl Ctx {
    fn start(tl: &str) -> (Ctx, String) {
        let mut cmd = Command::new(PEER);
        cmd.args(["ctx", "--transport", tl, "--serve-threads", "12"])
            .args(["--timeout-ms", &TIMEOUT_MS.to_string()]);
        let mut proc = Proc::spawn(cmd);
        let addr = proc.expect_addr();
        (
            Ctx {
                proc,
                kept: Vec::new(),
            },
            addr,
        )
    }

    /// The line that is `head` or starts with `head` and a space, kept or yet to come.
    fn line(&mut self, head: &str) -> String {
        let with_space = format!("{head} ");
        loop {
            if let Some(i) = self
                .kept
                .iter()
                .position(|l| l == head || l.starts_with(&with_space))
            {
                return self.kept.remove(i);
            }
            let l = self.proc.expect_one_of(&["CTX ", "SENDING "]);
            self.kept.push(l);
        }
    }
}

/// Generation rank `i` (engine rank id 100 + i) dialling `addr`; with `retry`, it keeps
/// dialling while the context side still holds its rank id for the process it replaces.
fn gen(tl: &str, addr: &str, i: u32, retry: bool) -> Proc {
    let mut cmd = Command::new(PEER);
    let sizes = if i == FROZEN { FROZEN_SIZES } else { SIZES };
    cmd.args(["gen", "--transport", tl, "--to", addr, "--sizes", sizes])
        .args(["--timeout-ms", &TIMEOUT_MS.to_string()])
        .args(["--rank", &(100 + i).to_string()]);
    if retry {
        cmd.args(["--retry-ms", "15000"]);
    }
    let mut g = Proc::spawn(cmd);
    g.expect("CONNECTED");
    g
}

/// Request `round * 100 + i` of every rank in `ranks`, all at once; every one must complete on
/// both sides, every byte checked.
fn all_complete(ctx: &mut Ctx, gens: &mut HashMap<u32, Proc>, ranks: &[u32], round: u64) {
    for &i in ranks {
        gens.get_mut(&i)
            .unwrap()
            .send(&format!("REQ {}", round * 100 + u64::from(i)));
    }
    for &i in ranks {
        let id = round * 100 + u64::from(i);
        let g = gens.get_mut(&i).unwrap().expect(&format!("GEN {id} "));
        assert_eq!(field(&g, "end"), "Completed", "rank {i}: {g}");
        assert_eq!(field(&g, "verified"), "true", "rank {i}: {g}");
        assert_eq!(field(&g, "leased"), "0", "rank {i}: {g}");
        let c = ctx.line(&format!("CTX {id}"));
        assert_eq!(field(&c, "end"), "Completed", "rank {i}: {c}");
    }
}

fn fan_in(tl: &str) {
    println!("== {tl}: {RANKS} generation ranks pulling from one context rank");
    let (mut ctx, addr) = Ctx::start(tl);
    let all: Vec<u32> = (0..RANKS).collect();
    let mut gens: HashMap<u32, Proc> = all.iter().map(|&i| (i, gen(tl, &addr, i, false))).collect();
    all_complete(&mut ctx, &mut gens, &all, 1);

    // Round 2: every rank pulls. The frozen rank is stopped as soon as the context side has
    // begun sending to it (its 128 MiB take 10 ms and more); two others are killed 2 ms into
    // their transfers.
    for &i in &all {
        gens.get_mut(&i).unwrap().send(&format!("REQ {}", 200 + i));
    }
    ctx.line(&format!("SENDING {}", 200 + FROZEN));
    gens[&FROZEN].signal(libc::SIGSTOP);
    for i in KILLED {
        ctx.line(&format!("SENDING {}", 200 + i));
    }
    std::thread::sleep(Duration::from_millis(2));
    for i in KILLED {
        gens.remove(&i).unwrap().signal(libc::SIGKILL);
    }
    let survivors: Vec<u32> = all
        .iter()
        .copied()
        .filter(|i| !KILLED.contains(i) && *i != FROZEN)
        .collect();
    // Read while the frozen rank is still stopped: each survivor must have been served.
    for &i in &survivors {
        let g = gens
            .get_mut(&i)
            .unwrap()
            .expect(&format!("GEN {} ", 200 + i));
        assert_eq!(
            field(&g, "end"),
            "Completed",
            "rank {i}, with rank {FROZEN} frozen and ranks {KILLED:?} killed: {g}"
        );
        assert_eq!(field(&g, "verified"), "true", "rank {i}: {g}");
        assert_eq!(field(&g, "leased"), "0", "rank {i}: {g}");
    }
    for i in 0..RANKS {
        let c = ctx.line(&format!("CTX {}", 200 + i));
        let l = late(&c);
        println!("  context side, rank {i}: {c}  -> {l:.1} ms past the deadline");
        assert!(
            l <= SLACK_MS,
            "rank {i}'s request ended {l:.1} ms past its deadline: {c}"
        );
        if survivors.contains(&i) {
            assert_eq!(field(&c, "end"), "Completed", "rank {i}: {c}");
        }
        if KILLED.contains(&i) {
            // Killed mid-transfer, or done just before: the send says which, never as an
            // error (it once read `Transport`, UCX's purge of the endpoint taken for a fault).
            assert!(
                ["PeerLost", "Completed"].contains(&field(&c, "send")),
                "rank {i}: {c}"
            );
        }
        if i == FROZEN {
            // Else the fault missed the transfer and tested nothing.
            assert_ne!(field(&c, "end"), "Completed", "the frozen rank: {c}");
        }
    }
    gens[&FROZEN].signal(libc::SIGCONT);
    let g = gens
        .get_mut(&FROZEN)
        .unwrap()
        .expect(&format!("GEN {} ", 200 + FROZEN));
    println!("  the frozen rank, resumed: {g}");
    assert_eq!(field(&g, "leased"), "0", "{g}");
    assert_ne!(field(&g, "end"), "Completed", "{g}");

    // Round 3: the killed ranks come back under their rank ids; all eight are served.
    for i in KILLED {
        gens.insert(i, gen(tl, &addr, i, true));
    }
    all_complete(&mut ctx, &mut gens, &all, 3);
}

#[test]
fn one_context_rank_serves_many_generation_ranks_and_a_killed_or_frozen_one_costs_only_its_own_request(
) {
    for tl in ["tcp", "sm"] {
        fan_in(tl);
    }
}
