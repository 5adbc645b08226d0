//! A transport-level peer process for the two-process tests and benchmarks.
//!
//! `kvlink-peer recv --transport tcp|sm --sizes 4096,1048576 --timeout-ms 5000`
//!   Listens (tcp: `--listen ip:port`, default 127.0.0.1:0; sm: prints its worker address), prints `ADDR <kind> <addr>`,
//!   waits for the sender's hello, posts one tagged receive per size, tells the sender to go,
//!   waits for each receive with the deadline, verifies every byte, and prints one
//!   `RESULT <size> <outcome> <elapsed_ms> <verified>` line per transfer and a final
//!   `CPU <user+sys ms of this process while waiting> <wall ms waiting>` line.
//! `kvlink-peer send --transport tcp|sm --to <addr> --sizes ... [--mode normal|suppress|loop]`
//!   Connects, says hello, waits for go, sends each size with the agreed tags. `suppress` is the
//!   fault hook: it never sends the data (the receiver must time out); `loop` keeps sending the
//!   last size until killed;
//   `slow` pauses 300 ms before each send (a sender that stays mid-stream long enough to be
//   killed or frozen by a test); `flood` skips the hello and go and sends the last size in a
//   loop until killed, into any agent or engine (whose receive queue a test wants written to
//   when the kill lands).
use kvlink::transport::{Agent, AgentOptions, Event, TransportKind};
use kvlink::Outcome;
use std::time::{Duration, Instant};

/// A transport-level peer process (UCX agent, no protocol) for the two-process tests: one
/// side posts tagged receives and checks every byte, the other sends, or fails to on purpose.
#[derive(clap::Parser, Debug)]
#[command(name = "kvlink-peer", version)]
struct Args {
    #[command(subcommand)]
    role: PeerRole,
    /// UCX transport: tcp (loopback), sm (shared memory), auto (UCX chooses) or a UCX
    /// transport list (tcp,self); `@dev` adds network devices (tcp@lo).
    #[arg(long, global = true, default_value = "tcp")]
    transport: String,
    /// Transfer sizes in bytes, comma-separated, in order.
    #[arg(long, global = true, default_value = "4096", value_delimiter = ',')]
    sizes: Vec<usize>,
}

#[derive(clap::Subcommand, Debug)]
enum PeerRole {
    /// Listen, post one receive per size, and print a RESULT line per transfer and a CPU line.
    Recv {
        /// tcp: where to listen (port 0 picks one).
        #[arg(long, default_value = "127.0.0.1:0")]
        listen: String,
        /// Deadline of each receive in milliseconds.
        #[arg(long = "timeout-ms", default_value_t = 10_000)]
        timeout_ms: u64,
    },
    /// Connect to a receiver and send each size.
    Send {
        /// The receiver's address, as its ADDR line printed it.
        #[arg(long)]
        to: String,
        /// normal; suppress (never send: the receiver must time out); loop (keep sending the
        /// last size until killed); slow (300 ms before each send); flood (no hello, no go:
        /// send the last size in a loop until killed).
        #[arg(long, default_value = "normal", value_parser = ["normal", "suppress", "loop", "slow", "flood"])]
        mode: String,
        /// Added to every tag: a receiver that meets several senders in turn keeps each one's
        /// messages apart (a message nobody received stays in its unexpected queue).
        #[arg(long = "tag-offset", default_value_t = 0)]
        tag_offset: u64,
    },
}

fn pattern(size: usize, i: usize) -> Vec<u8> {
    (0..size)
        .map(|j| ((j as u64).wrapping_mul(2654435761) >> 7) as u8 ^ (i as u8))
        .collect()
}

fn cpu_ms() -> f64 {
    // SAFETY: getrusage writes into the zeroed struct we pass.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let t = |tv: libc::timeval| tv.tv_sec as f64 * 1e3 + tv.tv_usec as f64 / 1e3;
    t(ru.ru_utime) + t(ru.ru_stime)
}

const TAG_BASE: u64 = 0x5EED_0000_0000_0000;

fn main() {
    let args = <Args as clap::Parser>::parse();
    let setting = TransportKind::parse_setting(&args.transport).unwrap_or_else(|e| {
        eprintln!("{e}");
        std::process::exit(2)
    });
    match &args.role {
        PeerRole::Recv { listen, timeout_ms } => recv(
            setting,
            &args.sizes,
            Duration::from_millis(*timeout_ms),
            listen,
        ),
        PeerRole::Send {
            to,
            mode,
            tag_offset,
        } => send(setting, to, &args.sizes, mode, TAG_BASE + tag_offset),
    }
}

/// The transport and network devices (`--transport tcp@lo`).
type Setting = (TransportKind, Option<String>);

/// The agent, or exit 3 with the error's kind and text on one line (`AGENT_ERROR InvalidArgument
/// ...`): a bad transport name or device must be refused that way, not with a panic.
fn agent_or_exit(opts: AgentOptions) -> Agent {
    Agent::new(opts).unwrap_or_else(|e| {
        println!("AGENT_ERROR {:?} {}", e.kind, e.message);
        std::process::exit(3)
    })
}

/// `LANES tcp/lo ...`: what UCX says the endpoint to `peer` uses ("unknown" where UCX cannot
/// say, as 1.13 cannot), and `DEVICE_PATH Staged|Direct`.
fn print_lanes(agent: &Agent, peer: kvlink::transport::PeerId) {
    match agent.peer_transports(peer) {
        Ok(Some(l)) => println!("LANES {}", l.join(" ")),
        Ok(None) => println!("LANES unknown"),
        Err(e) => println!("LANES error {e}"),
    }
    println!("DEVICE_PATH {:?}", agent.device_path());
}

fn recv((transport, devices): Setting, sizes: &[usize], timeout: Duration, listen: &str) {
    let mut opts = AgentOptions::new("peer-recv", transport.clone());
    opts.net_devices = devices;
    if !transport.by_worker_address() {
        opts.listen = Some(listen.parse().expect("--listen ip:port"));
    }
    let agent = agent_or_exit(opts);
    match agent.listen_address() {
        Some(a) => println!("ADDR tcp {a}"),
        None => println!("ADDR sm {}", hex(&agent.worker_address())),
    }
    // Wait for the hello (a control message carrying the sender's worker address).
    let deadline = Instant::now() + Duration::from_secs(20);
    let peer = loop {
        match agent.next_event(deadline, None) {
            Some(Event::Control(p, _)) => break p,
            Some(_) => continue,
            None => panic!("no hello from the sender"),
        }
    };
    // What each transfer must hold, made before the timed loop: unoptimised (sanitizer) builds
    // took hundreds of ms per 4 MiB to make it, which delayed the next wait past its deadline.
    let expected: Vec<Vec<u8>> = sizes
        .iter()
        .enumerate()
        .map(|(i, &s)| pattern(s, i))
        .collect();
    let mut bufs: Vec<Vec<u8>> = sizes.iter().map(|&s| vec![0u8; s]).collect();
    let mut ops = Vec::new();
    for (i, b) in bufs.iter_mut().enumerate() {
        // SAFETY: each buffer lives until its op has ended (waited below, before `bufs` drops).
        ops.push(
            unsafe { agent.post_recv(peer, TAG_BASE + i as u64, b.as_mut_ptr(), b.len()) }
                .expect("post_recv"),
        );
    }
    let mut go = agent.send_control(peer, b"go".to_vec()).expect("go");
    assert_eq!(
        go.wait(Instant::now() + Duration::from_secs(10), None)
            .unwrap(),
        Outcome::Completed
    );
    println!("POSTED {}", sizes.len());
    let cpu0 = cpu_ms();
    let t0 = Instant::now();
    let deadline = t0 + timeout;
    for (i, op) in ops.iter_mut().enumerate() {
        let outcome = op.wait(deadline, None);
        let elapsed = t0.elapsed().as_secs_f64() * 1e3;
        let verified = matches!(outcome, Ok(Outcome::Completed)) && bufs[i] == expected[i];
        let o = match outcome {
            Ok(o) => format!("{o:?}"),
            Err(e) => format!("Error:{:?}", e.kind),
        };
        println!("RESULT {} {} {:.1} {}", sizes[i], o, elapsed, verified);
    }
    let wall = t0.elapsed().as_secs_f64() * 1e3;
    println!("CPU {:.2} {:.1}", cpu_ms() - cpu0, wall);
    let s = agent.stats();
    println!(
        "STATS in_flight={} unreaped={} wakeups={} empty={} backoffs={}",
        s.in_flight, s.unreaped, s.wakeups, s.empty_wakeups, s.backoffs
    );
}

fn send((transport, devices): Setting, to: &str, sizes: &[usize], mode: &str, tag_base: u64) {
    let mut opts = AgentOptions::new("peer-send", transport);
    opts.net_devices = devices;
    let agent = agent_or_exit(opts);
    // Made before the receiver is told to start its clock (the hello): see `recv`.
    let bufs: Vec<Vec<u8>> = sizes
        .iter()
        .enumerate()
        .map(|(i, &s)| pattern(s, i))
        .collect();
    // The receiver's ADDR line: an ip:port when it listens, else its worker address in hex.
    let peer = match to.parse() {
        Ok(addr) => agent.connect(addr).expect("connect"),
        Err(_) => agent
            .connect_worker(&unhex(
                to.trim_start_matches(kvlink::proto::peers::WORKER_ADDRESS_PREFIX),
            ))
            .expect("connect"),
    };
    if mode == "flood" {
        println!("GO");
        let b = pattern(*sizes.last().unwrap_or(&4096), 0);
        loop {
            // SAFETY: `b` outlives the op, which is waited right here.
            let mut op =
                unsafe { agent.post_send(peer, tag_base, b.as_ptr(), b.len()) }.expect("post_send");
            let o = op.wait(Instant::now() + Duration::from_secs(30), None);
            println!("SENT {} {:?}", b.len(), o);
        }
    }
    let mut hello = agent
        .send_control(peer, agent.worker_address().to_vec())
        .expect("hello");
    assert_eq!(
        hello
            .wait(Instant::now() + Duration::from_secs(10), None)
            .unwrap(),
        Outcome::Completed
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match agent.next_event(deadline, None) {
            Some(Event::Control(_, b)) if b == b"go" => break,
            Some(_) => continue,
            None => panic!("no go from the receiver"),
        }
    }
    println!("GO");
    print_lanes(&agent, peer);
    if mode == "suppress" {
        // The fault hook: the data (and with it the completion) never comes.
        std::thread::sleep(Duration::from_secs(3600));
    }
    loop {
        for (i, b) in bufs.iter().enumerate() {
            if mode == "slow" {
                // A sender that is mid-stream for a while: the window the fault tests hit.
                std::thread::sleep(Duration::from_millis(300));
            }
            // SAFETY: `b` outlives the op, which is waited right here.
            let mut op = unsafe { agent.post_send(peer, tag_base + i as u64, b.as_ptr(), b.len()) }
                .expect("post_send");
            let o = op.wait(Instant::now() + Duration::from_secs(30), None);
            println!("SENT {} {:?}", b.len(), o);
        }
        if mode != "loop" {
            break;
        }
    }
    // Let the receiver finish before tearing the endpoint down.
    let _ = agent.next_event(Instant::now() + Duration::from_secs(2), None);
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len() / 2)
        .map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).expect("hex"))
        .collect()
}
