//! Two ranks that dial each other at the same moment, as two OS processes
//! (`kvlink-engine-peer`). Over tcp UCX makes two connections, each with its own session, and
//! the pair must settle on one (`kvlink-proto/src/peers/binding.rs`; every order of the two
//! handshakes' messages is covered deterministically by `kvlink-proto/tests/proto_crossing.rs`).
//! Over shared memory UCX makes one connection of the two. In every round both `connect`s
//! return the other rank, a request then completes with every byte checked, and neither side
//! counts a refusal. Before the rules, most tcp rounds left both `connect`s failed with
//! `RankInUse` and the pair unbound on both sides.
mod common;

use common::Proc;
use std::process::Command;
use std::time::Duration;

const PEER: &str = env!("CARGO_BIN_EXE_kvlink-engine-peer");

fn spawn(args: &[&str]) -> Proc {
    let mut c = Command::new(PEER);
    c.args(args);
    c.env_remove("KVLINK_SECRET");
    Proc::spawn(c)
}

fn field<'a>(line: &'a str, name: &str) -> &'a str {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(name).and_then(|r| r.strip_prefix('=')))
        .unwrap_or_else(|| panic!("no {name}= in {line:?}"))
}

/// `rounds` crossings over `transport`, each between two new processes.
fn crossings(transport: &str, rounds: u32) {
    // tcp: both listen. Shared memory: both are reached at their worker addresses.
    let listen: &[&str] = if transport == "tcp" {
        &["--listen", "127.0.0.1:0"]
    } else {
        &[]
    };
    let common = [
        &["--transport", transport][..],
        listen,
        &["--trust-every-ms", "100"],
    ]
    .concat();
    for round in 0..rounds {
        println!("{transport} round {round}");
        let mut ctx = spawn(&[&["ctx"], &common[..], &["--dial-line"]].concat());
        let ctx_addr = ctx.expect_addr();
        let gen_args = ["--to", "-", "--sizes", "4K,1M", "--timeout-ms", "5000"];
        let mut gen = spawn(&[&["gen"], &common[..], &gen_args].concat());
        let gen_addr = gen.expect_addr();
        // Both dial at once; which one is told first, and how far apart, varies by round.
        let (to_ctx, to_gen) = (format!("DIAL {gen_addr}"), format!("DIAL {ctx_addr}"));
        let apart = Duration::from_micros(u64::from(round / 2) * 150);
        if round % 2 == 0 {
            ctx.send(&to_ctx);
            std::thread::sleep(apart);
            gen.send(&to_gen);
        } else {
            gen.send(&to_gen);
            std::thread::sleep(apart);
            ctx.send(&to_ctx);
        }
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
        gen.send("REQ 1");
        let line = gen.expect("GEN 1 ");
        assert_eq!(field(&line, "end"), "Completed", "round {round}: {line}");
        assert_eq!(field(&line, "verified"), "true", "round {round}: {line}");
        assert_eq!(field(&line, "peers_failed"), "0", "round {round}: {line}");
        let line = ctx.expect("CTX 1 ");
        assert_eq!(field(&line, "end"), "Completed", "round {round}: {line}");
        // Settling the crossing is not a refusal, on either side.
        for p in [&mut ctx, &mut gen] {
            let line = p.expect("TRUST ");
            for counter in ["rank", "by_peer", "auth"] {
                assert_eq!(field(&line, counter), "0", "round {round}: {line}");
            }
        }
    }
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
