//! One rank of a two-process engine test (tests/engine_faults.rs), driven through stdin/stdout
//! so that a test can freeze, kill or cut it off between and during requests.
//!
//! `kvlink-engine-peer ctx --transport tcp|sm [--listen IP:PORT] [--timeout-ms N] [--suppress ID]
//!   [--region-mb N] [--rank R]` (rank id R, default 0: the context ranks of one request each
//!   need their own)
//!   prints `ADDR <address>`, then serves advertisements forever: accepts, prints
//!   `SENDING <request>`, sends every segment (deterministic bytes), waits for the agreed end,
//!   and prints
//!   `CTX <request> send=<outcome> end=<outcome> late_ms=<ms past the request's deadline> leased=<n>`.
//!   With `--dial-line` it first reads `DIAL <address>` from stdin, connects there (deadline
//!   `--dial-ms`, default 10000) and prints
//!   `DIALED <rank>` or `DIAL-ERROR <kind> late_ms=<ms>` (so that two ranks can dial each other
//!   at once); with `--break-won-tie` that dial's connection breaks if it wins the crossing,
//!   and `WON-TIE-BROKEN <0|1>` follows.
//!   With `--drop-after N` it drops its engine after serving N requests, prints `DROPPED` and
//!   lives on until stdin closes.
//!   With `--serve-threads N` it serves N advertisements at once, each on a thread of its own
//!   (their lines in any order).
//! `kvlink-engine-peer gen --transport tcp|sm --to ADDR --sizes 4K,64M,.. [--timeout-ms N]
//!   [--rank R]` (rank id R, default 1: several generation processes need their own)
//!   connects, prints `CONNECTED`, then for every stdin line `REQ <id>` advertises one request
//!   with one buffer per size, prints `ADV <id>`, waits for its end and prints
//!   `GEN <id> end=<outcome> late_ms=<ms> verified=<bool> leased=<n> ... region_fenced=<bytes>
//!   peers_failed=<n>`. `--to ADDR1,ADDR2,..` names several context ranks (connected in that
//!   order, each with its own `--rank` on the context side): segment i of a request comes
//!   from the (i % n)-th of them, each one's flow listing only its own segments; `REQ <id>
//!   from=I,J,..` draws on those positions of the list only (segment i from the (i % m)-th
//!   named). `HEALTH` prints a line (`peer=<state,..> failed=<n> left=<n> ...`, a state per
//!   context rank). With `--region` the buffers are ranges of one
//!   registered receive region (request N in its half N % 2), and `DEREG <ms>` deregisters it
//!   with that deadline, printing `DEREG ok|error:<kind> late_ms=<ms>`. With `--to -` it reads
//!   the address from a `DIAL <address>` line on stdin first (after its `ADDR` line).
//!   `DROP` drops the engine, prints `DROPPED ms=<how long the drop took>` and exits.
//!   With `--health-every-ms N` a second thread prints `STATE <Healthy|Degraded|Wedged>` every N
//!   ms (`--wedge-ms`, `--degraded-ms` set the windows). With `--listen` it also listens (and
//!   prints `ADDR <address>` first), so that a third process can reach it. A refused handshake
//!   prints `CONNECT-ERROR <kind> late_ms=<ms past its deadline>` and exits with status 3 (`--retry-ms N` keeps dialling that
//!   long first).
//! `kvlink-engine-peer intruder --to ADDR --tags T,.. --lens N,..` is a process that is not a
//!   rank of the deployment: it connects at the UCX level (no handshake) and sends data of each
//!   length under each tag, then prints `INTRUDER sent=<n> done=<n>`.
//! `kvlink-engine-peer other-version --wire-version V [--to ADDR | --listen IP:PORT]` is a rank
//!   of another kvlink release, at the UCX level: every frame it sends names wire version V.
//!   With `--to` it dials and says `Hello`, then prints the first control message it gets back,
//!   `REPLY <message> version=<the version its header names> ms=<since the Hello>` (or
//!   `REPLY none` after 10 s). Else it prints `ADDR <address>` and answers the first control
//!   message with the version refusal (under V), printing `ANSWERED version=<the message's>`;
//!   both then wait for stdin to close.
//!
//! Everywhere: an engine that cannot start prints `ENGINE-ERROR <kind> <message>` and exits with
//! status 3. `--secret S` sets the deployment secret (else `KVLINK_SECRET`); ctx `--hold`
//! prints `TOKENS <request> <token,..>` for each advertisement (what an observer could learn)
//! and waits for a `GO` line on stdin before it sends; `--trust-every-ms N` prints
//! `TRUST foreign=<n> late=<n> auth=<n> rank=<n> version=<n> by_peer=<n> completed=<n>` every N
//! ms.
use kvlink::engine::{BufferSpec, Engine, EngineConfig};
use kvlink::error::ErrorKind;
use kvlink::proto::{BufferKind, RankId, RequestKey, Role};
use kvlink::transport::{Agent, AgentOptions, TransportKind};
use std::io::{BufRead, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const CTX: u32 = 0;
const GEN: u32 = 1;

/// One rank of a two-process engine test, driven over stdin/stdout (see the module docs).
#[derive(clap::Parser, Debug)]
#[command(name = "kvlink-engine-peer", version)]
struct Args {
    #[command(subcommand)]
    role: Rank,
    /// UCX transport: tcp (loopback), sm (shared memory), auto (UCX chooses) or a UCX
    /// transport list (tcp,self); `@dev` adds network devices (tcp@lo).
    #[arg(long, global = true, default_value = "tcp")]
    transport: String,
    /// The engine's per-request deadline in milliseconds.
    #[arg(long = "timeout-ms", global = true, default_value_t = 2000)]
    timeout_ms: u64,
    /// The deployment secret (default: KVLINK_SECRET from the environment, if set).
    #[arg(long, global = true)]
    secret: Option<String>,
    /// Print a `TRUST ...` line of the engine's trust counters every this many milliseconds.
    #[arg(long = "trust-every-ms", global = true)]
    trust_every_ms: Option<u64>,
}

#[derive(clap::Subcommand, Debug)]
enum Rank {
    /// The context (sending) rank: serves every advertisement it gets.
    Ctx {
        /// tcp: where to listen (default 127.0.0.1:0).
        #[arg(long, value_name = "IP:PORT")]
        listen: Option<String>,
        /// The lost-completion fault: this request's data is "sent" without moving.
        #[arg(long, value_name = "REQUEST")]
        suppress: Option<u64>,
        /// This context rank's id (the context ranks that fill one request each need their
        /// own).
        #[arg(long, default_value_t = CTX)]
        rank: u32,
        /// Print each advertisement's tokens and wait for a `GO` line on stdin before sending.
        #[arg(long)]
        hold: bool,
        /// Send from a registered region of this many MiB (two halves, request N from half
        /// N % 2) instead of fresh memory per request.
        #[arg(long = "region-mb", value_name = "MIB")]
        region_mb: Option<usize>,
        /// Before serving, read `DIAL <address>` from stdin and connect there.
        #[arg(long = "dial-line")]
        dial_line: bool,
        /// The deadline of that connect, in milliseconds from its start.
        #[arg(long = "dial-ms", default_value_t = 10_000)]
        dial_ms: u64,
        /// The `break_won_tie` fault: that dial's connection breaks if it wins a crossing;
        /// `WON-TIE-BROKEN <n>` follows the dial's line.
        #[arg(long = "break-won-tie")]
        break_won_tie: bool,
        /// After serving this many requests, drop the engine and print `DROPPED`; the process
        /// lives on until stdin closes.
        #[arg(long = "drop-after", value_name = "N")]
        drop_after: Option<u64>,
        /// Serve this many advertisements at once, each on a thread of its own (as a context
        /// instance serves many generation instances); not with `--hold`, `--region-mb` or
        /// `--drop-after`.
        #[arg(long = "serve-threads", default_value_t = 1,
              conflicts_with_all = ["hold", "region_mb", "drop_after"])]
        serve_threads: usize,
    },
    /// The generation (receiving) rank: one request per `REQ <id>` line on stdin.
    Gen(GenOpts),
    /// Not a rank: connects without a handshake and sends data under the given tags.
    Intruder {
        /// The address of the rank to attack.
        #[arg(long)]
        to: String,
        /// UCX tags to send under, comma-separated (decimal or 0x hex).
        #[arg(long)]
        tags: String,
        /// Message lengths to send under each tag, comma-separated (K and M suffixes).
        #[arg(long, default_value = "4K")]
        lens: String,
    },
    /// A rank of another kvlink release: its frames carry another wire version (see the
    /// module docs).
    OtherVersion {
        /// Dial this rank and say `Hello` (else answer whoever dials, with `--listen` on tcp).
        #[arg(long)]
        to: Option<String>,
        /// tcp: where to listen when answering (default 127.0.0.1:0).
        #[arg(long, value_name = "IP:PORT")]
        listen: Option<String>,
        /// The wire version its headers name.
        #[arg(long = "wire-version")]
        wire_version: u16,
    },
}

#[derive(clap::Args, Debug)]
struct GenOpts {
    /// The context rank's address, as its ADDR line printed it; `-`: from a `DIAL <address>`
    /// line on stdin. Several, comma-separated: a request's segments are split among them.
    #[arg(long)]
    to: String,
    /// Buffer sizes of each request, comma-separated (K and M suffixes).
    #[arg(long, default_value = "4K")]
    sizes: String,
    /// health().state: the wedge window in milliseconds.
    #[arg(long = "wedge-ms")]
    wedge_ms: Option<u64>,
    /// health().state: the degraded window in milliseconds.
    #[arg(long = "degraded-ms")]
    degraded_ms: Option<u64>,
    /// Print `STATE <state>` from a second thread every this many milliseconds.
    #[arg(long = "health-every-ms")]
    health_every_ms: Option<u64>,
    /// tcp: also listen here (prints `ADDR <address>` before connecting).
    #[arg(long, value_name = "IP:PORT")]
    listen: Option<String>,
    /// Keep dialling this long while the handshake is refused (for a rank that frees up).
    #[arg(long = "retry-ms", default_value_t = 0)]
    retry_ms: u64,
    /// Impersonation test: introduce this engine with this instance nonce (another process's,
    /// as printed in its `INSTANCE` line).
    #[arg(long)]
    instance: Option<u64>,
    /// The deadline of each connect, in milliseconds from its start (default 20 s, 3 s while
    /// retrying; 0 is a deadline already passed).
    #[arg(long = "connect-ms")]
    connect_ms: Option<u64>,
    /// This generation rank's id (several generation processes of one context rank each
    /// need their own).
    #[arg(long, default_value_t = GEN)]
    rank: u32,
    /// Receive into a registered receive region (two request-sized halves, request N in half
    /// N % 2) instead of fresh memory per request.
    #[arg(long)]
    region: bool,
    /// Only report a stuck shared-memory receive queue (`fail_peers_when_stuck = false`): a
    /// sender frozen mid-write holds the queue until it resumes, and the test wants the pair.
    #[arg(long = "stuck-report")]
    stuck_report: bool,
}

fn size(s: &str) -> usize {
    let (n, mul) = match s.as_bytes().last() {
        Some(b'K') => (&s[..s.len() - 1], 1 << 10),
        Some(b'M') => (&s[..s.len() - 1], 1 << 20),
        _ => (s, 1),
    };
    n.parse::<usize>().expect("size") * mul
}

// The bytes of (request, segment), shared with the tests that check what this helper sent.
#[path = "common/pattern.rs"]
mod pattern;
use pattern::{fill, intact};

/// Memory lent to an engine as a region for the rest of the process (the engine may still
/// touch it after the request that used it): never freed, and kept reachable from here so
/// that LeakSanitizer does not count it as a leak.
static REGIONS: std::sync::Mutex<Vec<usize>> = std::sync::Mutex::new(Vec::new());

fn region_memory(len: usize) -> &'static mut [u8] {
    let m = Box::leak(vec![0u8; len].into_boxed_slice());
    REGIONS
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push(m.as_ptr() as usize);
    m
}

/// Signed milliseconds from `deadline` to now.
fn late_ms(deadline: Instant) -> f64 {
    let now = Instant::now();
    if now >= deadline {
        (now - deadline).as_secs_f64() * 1e3
    } else {
        -(deadline - now).as_secs_f64() * 1e3
    }
}

/// CPU time (user + system) this process has used, in milliseconds.
fn cpu_ms() -> f64 {
    // SAFETY: getrusage writes into the zeroed struct we pass.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let t = |tv: libc::timeval| tv.tv_sec as f64 * 1e3 + tv.tv_usec as f64 / 1e3;
    t(ru.ru_utime) + t(ru.ru_stime)
}

/// The address of a `DIAL <address>` line, the next on stdin.
fn dial_address(lines: &mut impl Iterator<Item = std::io::Result<String>>) -> String {
    let line = lines.next().and_then(|l| l.ok()).unwrap_or_default();
    match line.split_whitespace().collect::<Vec<_>>().as_slice() {
        ["DIAL", address] => address.to_string(),
        _ => {
            eprintln!("expected `DIAL <address>` on stdin, got {line:?}");
            std::process::exit(2)
        }
    }
}

fn say(line: String) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

/// The rank's engine, or `ENGINE-ERROR <kind> <message>` and exit status 3 when it cannot start
/// (a listen address refused or taken, say): a line a test can read, not a panic.
fn start(cfg: EngineConfig) -> Engine {
    Engine::new(cfg).unwrap_or_else(|e| {
        say(format!("ENGINE-ERROR {:?} {e}", e.kind));
        std::process::exit(3)
    })
}

fn main() {
    let args = <Args as clap::Parser>::parse();
    let transport = TransportKind::parse_setting(&args.transport).unwrap_or_else(|e| {
        eprintln!("{e}");
        std::process::exit(2)
    });
    match &args.role {
        Rank::Ctx {
            listen,
            suppress,
            rank,
            hold,
            region_mb,
            dial_line,
            dial_ms,
            break_won_tie,
            drop_after,
            serve_threads,
        } => ctx(
            &args,
            transport,
            listen.as_deref(),
            *rank,
            *suppress,
            Serve {
                hold: *hold,
                drop_after: *drop_after,
                threads: *serve_threads,
                region_mb: *region_mb,
            },
            dial_line.then_some((*dial_ms, *break_won_tie)),
        ),
        Rank::Gen(opts) => {
            // The engine is dropped inside `gen`, before the exit: its UCX resources are freed
            // (LeakSanitizer runs these processes too).
            let code = gen(&args, transport, opts);
            if code != 0 {
                std::process::exit(code);
            }
        }
        Rank::Intruder { to, tags, lens } => intruder(transport.0, to, tags, lens),
        Rank::OtherVersion {
            to,
            listen,
            wire_version,
        } => other_version(transport.0, to.as_deref(), listen.as_deref(), *wire_version),
    }
}

/// The transport and network devices (`--transport tcp@lo`).
type Setting = (TransportKind, Option<String>);

/// The engine configuration every rank shares: transport, deadline and secret.
fn config(args: &Args, name: &str, rank: u32, (transport, devices): Setting) -> EngineConfig {
    let mut cfg = EngineConfig::new(name, rank, transport);
    cfg.net_devices = devices;
    cfg.timeout = Duration::from_millis(args.timeout_ms);
    cfg.secret = args.secret.as_ref().map(|s| s.as_bytes().to_vec());
    cfg
}

/// With `--trust-every-ms`, a thread that prints the trust counters.
fn trust_lines(args: &Args, engine: &Arc<Engine>) {
    let Some(every) = args.trust_every_ms.map(Duration::from_millis) else {
        return;
    };
    // Weak: the engine must go when its owner returns, not live on in this thread.
    let e = Arc::downgrade(engine);
    std::thread::spawn(move || loop {
        let Some(h) = e.upgrade().map(|e| e.health()) else {
            return;
        };
        say(format!(
            "TRUST foreign={} late={} auth={} rank={} version={} by_peer={} completed={}",
            h.foreign_data,
            h.late_data,
            h.refused_auth,
            h.refused_rank_in_use,
            h.refused_version,
            h.refused_by_peer,
            h.completed
        ));
        std::thread::sleep(every);
    });
}

/// How the context rank serves: `--hold`, `--drop-after`, `--serve-threads` and
/// `--region-mb`.
struct Serve {
    hold: bool,
    drop_after: Option<u64>,
    threads: usize,
    region_mb: Option<usize>,
}

fn ctx(
    args: &Args,
    setting: Setting,
    listen: Option<&str>,
    rank: u32,
    suppress: Option<u64>,
    Serve {
        hold,
        drop_after,
        threads,
        region_mb,
    }: Serve,
    dial_line: Option<(u64, bool)>,
) {
    let by_address = setting.0.by_worker_address();
    let mut cfg = config(args, "ctx", rank, setting);
    // The lost-completion fault: this request's data is "sent" without moving.
    cfg.faults.suppress_data_of_request = suppress;
    let won_tie_broken = Arc::new(AtomicU64::new(0));
    if dial_line.is_some_and(|(_, b)| b) {
        cfg.faults.break_won_tie = Some(won_tie_broken.clone());
    }
    if let Some(l) = listen {
        cfg.listen = Some(l.parse().expect("--listen ip:port"));
    } else if !by_address {
        cfg.listen = Some("127.0.0.1:0".parse().unwrap());
    }
    let engine = Arc::new(start(cfg));
    say(format!("ADDR {}", engine.address()));
    trust_lines(args, &engine);
    let region: Option<&'static mut [u8]> = region_mb.map(|mb| region_memory(mb << 20));
    if let Some(r) = &region {
        // SAFETY: never freed, and written below only for requests whose sends have ended.
        unsafe { engine.register_region(r.as_ptr() as u64, r.len() as u64) }
            .expect("register_region");
    }
    let region_base = region.map(|r| (r.as_mut_ptr(), r.len()));
    let mut stdin = std::io::stdin().lock().lines();
    if let Some((ms, break_won_tie)) = dial_line {
        let to = dial_address(&mut stdin);
        let deadline = Instant::now() + Duration::from_millis(ms);
        match engine.connect(&to, deadline) {
            Ok(rank) => say(format!("DIALED {}", rank.0)),
            Err(e) => say(format!(
                "DIAL-ERROR {:?} late_ms={:.1} {e}",
                e.kind,
                late_ms(deadline)
            )),
        }
        if break_won_tie {
            say(format!(
                "WON-TIE-BROKEN {}",
                won_tie_broken.load(Ordering::Acquire)
            ));
        }
    }
    // `--serve-threads`: the others serve plain memory, neither held nor counted.
    for _ in 1..threads {
        let engine = Arc::downgrade(&engine);
        std::thread::spawn(move || {
            while let Some(engine) = engine.upgrade() {
                if let Some(adv) = next_advertisement(&engine) {
                    serve_one(&engine, adv, None, None);
                }
            }
        });
    }
    let mut served = 0;
    while drop_after != Some(served) {
        let Some(adv) = next_advertisement(&engine) else {
            continue;
        };
        if serve_one(&engine, adv, region_base, hold.then_some(&mut stdin)) {
            served += 1;
        }
    }
    // `--drop-after`: a host that tears its engine down and lives on.
    drop(engine);
    say("DROPPED".into());
    for _ in stdin {}
}

/// The next advertisement, waiting up to an hour for it.
fn next_advertisement(engine: &Engine) -> Option<kvlink::engine::Advertisement> {
    engine.next_advertisement(Instant::now() + Duration::from_secs(3600), None)
}

/// Serves one advertisement: accepts it, sends every segment (from the region's half when
/// `region_base` is set; after a `GO` line on `hold` when given), waits for the agreed end and
/// prints its `CTX` line. False when the accept failed.
fn serve_one(
    engine: &Engine,
    adv: kvlink::engine::Advertisement,
    region_base: Option<(*mut u8, usize)>,
    hold: Option<&mut std::io::Lines<std::io::StdinLock<'static>>>,
) -> bool {
    let key = adv.key;
    if let Err(e) = engine.accept(key, adv.from, true) {
        say(format!("CTX {} accept-error {e}", key.request.0));
        return false;
    }
    let data: Vec<(u32, Vec<u8>)> = match region_base {
        Some(_) => Vec::new(),
        None => adv
            .buffers
            .iter()
            .map(|d| {
                let mut v = vec![0u8; d.len as usize];
                fill(key.request.0, d.segment, &mut v);
                (d.segment, v)
            })
            .collect(),
    };
    let segs: Vec<(u32, &[u8])> = match region_base {
        Some((base, len)) => {
            let half = len / 2;
            let mut off = (key.request.0 as usize % 2) * half;
            let end = off + half;
            adv.buffers
                .iter()
                .map(|d| {
                    let n = d.len as usize;
                    assert!(off + n <= end, "--region-mb too small for the request");
                    // SAFETY: inside the leaked region; this half is not in a running
                    // send (a stale one only reads it, and its data is discarded).
                    let s = unsafe { std::slice::from_raw_parts_mut(base.add(off), n) };
                    fill(key.request.0, d.segment, s);
                    off += n;
                    (d.segment, &*s)
                })
                .collect()
        }
        None => data.iter().map(|(s, d)| (*s, d.as_slice())).collect(),
    };
    if let Some(stdin) = hold {
        let tokens: Vec<String> = adv.buffers.iter().map(|d| d.token.0.to_string()).collect();
        say(format!("TOKENS {} {}", key.request.0, tokens.join(",")));
        while !matches!(stdin.next(), Some(Ok(l)) if l.trim() == "GO") {}
    }
    say(format!("SENDING {}", key.request.0));
    let sent = engine
        .send_segments(key, adv.from, &segs, adv.deadline, None)
        .map_or_else(|e| format!("error:{:?}", e.kind), |o| format!("{o:?}"));
    let end = engine
        .wait(key, Role::Sender { receiver: adv.from }, adv.deadline, None)
        .map_or_else(|e| format!("error:{:?}", e.kind), |o| format!("{o:?}"));
    let late = late_ms(adv.deadline);
    let h = engine.health();
    say(format!(
        "CTX {} send={sent} end={end} late_ms={late:.1} leased={} region_fenced={} peers_failed={}",
        key.request.0, h.buffers_leased, h.region_fenced_bytes, h.peers_failed
    ));
    true
}

/// Returns the process's exit status: 0, or 3 when the handshake was refused.
fn gen(args: &Args, setting: Setting, opts: &GenOpts) -> i32 {
    let GenOpts {
        to,
        sizes,
        wedge_ms,
        degraded_ms,
        health_every_ms,
        listen,
        retry_ms,
        instance,
        connect_ms,
        region,
        stuck_report,
        rank,
    } = opts;
    let timeout = Duration::from_millis(args.timeout_ms);
    let by_address = setting.0.by_worker_address();
    let mut cfg = config(args, "gen", *rank, setting);
    if let Some(l) = listen {
        cfg.listen = Some(l.parse().expect("--listen ip:port"));
    }
    cfg.faults.instance = *instance;
    cfg.fail_peers_when_stuck = !*stuck_report;
    let ms = |v: &Option<u64>| v.map(Duration::from_millis);
    if let Some(w) = ms(wedge_ms) {
        cfg.wedge_window = w;
    }
    if let Some(d) = ms(degraded_ms) {
        cfg.degraded_window = d;
    }
    let engine = Arc::new(start(cfg));
    if listen.is_some() || by_address {
        say(format!("ADDR {}", engine.address()));
    }
    trust_lines(args, &engine);
    if let Some(every) = ms(health_every_ms) {
        // What a router's health check would see, while requests run on the main thread.
        let e = Arc::downgrade(&engine);
        std::thread::spawn(move || loop {
            let Some(state) = e.upgrade().map(|e| e.health().state) else {
                return;
            };
            say(format!("STATE {state:?}"));
            std::thread::sleep(every);
        });
    }
    let to = match to.as_str() {
        "-" => dial_address(&mut std::io::stdin().lock().lines()),
        to => to.to_string(),
    };
    let sizes: Vec<usize> = sizes.split(',').map(size).collect();
    let half: usize = sizes.iter().sum();
    let region_mem: &'static mut [u8] = match region {
        true => region_memory(2 * half),
        false => &mut [],
    };
    let region_base = region_mem.as_mut_ptr();
    let region_id = match region {
        // SAFETY: the region memory is never freed and nothing else writes it.
        true => Some(
            unsafe { engine.register_region(region_base as u64, region_mem.len() as u64) }
                .expect("register_region"),
        ),
        false => None,
    };
    let retry_until = Instant::now() + Duration::from_millis(*retry_ms);
    // While retrying, each attempt gets a few seconds: an attempt can be lost when the peer
    // closes the refused endpoint of the one before.
    let attempt = connect_ms.unwrap_or(if *retry_ms > 0 { 3000 } else { 20_000 });
    let mut peers = Vec::new();
    for to in to.split(',') {
        let peer = loop {
            let deadline = Instant::now() + Duration::from_millis(attempt);
            match engine.connect(to, deadline) {
                Ok(p) => break p,
                Err(e)
                    if matches!(
                        e.kind,
                        ErrorKind::AuthFailed | ErrorKind::RankInUse | ErrorKind::PeerLost
                    ) && Instant::now() < retry_until =>
                {
                    std::thread::sleep(Duration::from_millis(250));
                }
                Err(e) => {
                    let late = late_ms(deadline);
                    say(format!("CONNECT-ERROR {:?} late_ms={late:.1} {e}", e.kind));
                    return 3;
                }
            }
        };
        peers.push(peer);
    }
    say(format!("INSTANCE {}", engine.instance()));
    say("CONNECTED".into());
    for line in std::io::stdin().lock().lines() {
        let line = line.unwrap_or_default();
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["REQ", id, from @ ..] => {
                let id: u64 = id.parse().expect("request id");
                let Some(from) = senders(&peers, from) else {
                    say(format!("GEN {id} bad-from {from:?}"));
                    continue;
                };
                let key = RequestKey::new(id, 0);
                let mut bufs: Vec<Vec<u8>> = match region_id {
                    Some(_) => Vec::new(),
                    None => sizes.iter().map(|&n| vec![0u8; n]).collect(),
                };
                let specs: Vec<BufferSpec> = match region_id {
                    Some(r) => {
                        let mut off = (id as usize % 2) * half;
                        let mut specs = Vec::new();
                        for (i, &n) in sizes.iter().enumerate() {
                            let s = engine.region_buffer(
                                r,
                                BufferKind::Kv,
                                i as u32,
                                off as u64,
                                n as u64,
                            );
                            specs.push(s.expect("region_buffer"));
                            off += n;
                        }
                        specs
                    }
                    None => bufs
                        .iter_mut()
                        .enumerate()
                        .map(|(i, b)| BufferSpec {
                            kind: BufferKind::Kv,
                            segment: i as u32,
                            addr: b.as_mut_ptr() as u64,
                            len: b.len() as u64,
                            device_id: -1,
                        })
                        .collect(),
                };
                let deadline = Instant::now() + timeout;
                let cpu0 = cpu_ms();
                // SAFETY: `bufs` outlives the request: we wait for its end below.
                let adv = unsafe {
                    engine.advertise(key, vec![RankId(*rank)], flows(&from, specs), vec![])
                };
                if let Err(e) = adv {
                    say(format!(
                        "GEN {id} advertise-error {:?} late_ms={:.1} {e}",
                        e.kind,
                        late_ms(deadline)
                    ));
                    continue;
                }
                say(format!("ADV {id}"));
                let end = engine
                    .wait(key, Role::Receiver, deadline, None)
                    .map_or_else(|e| format!("error:{:?}", e.kind), |o| format!("{o:?}"));
                let late = late_ms(deadline);
                let cpu = cpu_ms() - cpu0;
                let h = engine.health();
                let verified = match region_id {
                    Some(_) => {
                        let mut off = (id as usize % 2) * half;
                        sizes.iter().enumerate().all(|(i, &n)| {
                            // SAFETY: inside the region; the request has ended, so nothing
                            // writes this half unless it is fenced (then it is not Completed).
                            let b = unsafe { std::slice::from_raw_parts(region_base.add(off), n) };
                            off += n;
                            intact(id, i as u32, b)
                        })
                    }
                    None => bufs
                        .iter()
                        .enumerate()
                        .all(|(i, b)| intact(id, i as u32, b)),
                };
                say(format!(
                    "GEN {id} end={end} late_ms={late:.1} verified={verified} leased={} cpu_ms={cpu:.1} region_fenced={} peers_failed={}",
                    h.buffers_leased, h.region_fenced_bytes, h.peers_failed
                ));
            }
            ["DEREG", ms] => {
                let deadline = Instant::now() + Duration::from_millis(ms.parse().expect("ms"));
                let r = region_id.map(|r| engine.deregister_region(r, deadline));
                let res = match r {
                    Some(Ok(())) => "ok".to_string(),
                    Some(Err(e)) => format!("error:{:?}", e.kind),
                    None => "error:no-region".to_string(),
                };
                say(format!("DEREG {res} late_ms={:.1}", late_ms(deadline)));
            }
            ["DROP"] => {
                // The last strong reference unless a health line is being made right now.
                let Some(engine) = Arc::into_inner(engine) else {
                    say("DROPPED shared".into());
                    return 4;
                };
                let t0 = Instant::now();
                drop(engine);
                say(format!(
                    "DROPPED ms={:.1}",
                    t0.elapsed().as_secs_f64() * 1e3
                ));
                return 0;
            }
            ["HEALTH"] => {
                let h = engine.health();
                say(format!(
                    "HEALTH peer={} failed={} left={} reconnects={} leased={} fenced={} unsettled={} region_fenced={} region_fences={} new_workers={}",
                    peers
                        .iter()
                        .map(|&p| format!("{:?}", engine.peer_state(p)))
                        .collect::<Vec<_>>()
                        .join(","),
                    h.peers_failed,
                    h.peers_left,
                    h.reconnects,
                    h.buffers_leased,
                    h.buffers_fenced,
                    h.unsettled_returns,
                    h.region_fenced_bytes,
                    h.region_fences,
                    h.worker_renewals
                ));
            }
            _ => {}
        }
    }
    0
}

/// The context ranks a `REQ` line draws on: every connected one, or with `from=I,J,..` those
/// positions of the `--to` list (None for a position that is not there, or another word).
fn senders(peers: &[RankId], words: &[&str]) -> Option<Vec<RankId>> {
    match words {
        [] => Some(peers.to_vec()),
        [w] => w
            .strip_prefix("from=")?
            .split(',')
            .map(|i| i.parse::<usize>().ok().and_then(|i| peers.get(i).copied()))
            .collect(),
        _ => None,
    }
}

/// A request's flows: segment i (in `specs` order) from `from[i % from.len()]`, each context
/// rank's flow listing only its own segments.
fn flows(from: &[RankId], specs: Vec<BufferSpec>) -> Vec<(RankId, Vec<BufferSpec>)> {
    let mut flows: Vec<(RankId, Vec<BufferSpec>)> = from.iter().map(|&r| (r, Vec::new())).collect();
    for (i, s) in specs.into_iter().enumerate() {
        flows[i % from.len()].1.push(s);
    }
    flows.retain(|(_, specs)| !specs.is_empty());
    flows
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len() / 2)
        .map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).expect("hex address"))
        .collect()
}

fn intruder(transport: TransportKind, to: &str, tags: &str, lens: &str) {
    let agent = Agent::new(AgentOptions::new("intruder", transport)).expect("agent");
    let peer = match to.strip_prefix(kvlink::proto::peers::WORKER_ADDRESS_PREFIX) {
        Some(h) => agent.connect_worker(&unhex(h)),
        None => agent.connect(to.parse().expect("--to ip:port")),
    }
    .expect("connect");
    let tags: Vec<u64> = tags
        .split(',')
        .map(|t| match t.strip_prefix("0x") {
            Some(h) => u64::from_str_radix(h, 16).expect("tag"),
            None => t.parse().expect("tag"),
        })
        .collect();
    let lens: Vec<usize> = lens.split(',').map(size).collect();
    let data = vec![0xEEu8; lens.iter().copied().max().unwrap_or(0)];
    let (mut sent, mut done) = (0, 0);
    for &tag in &tags {
        for &len in &lens {
            // SAFETY: `data` outlives the op: it is waited for (or given up and reaped) below.
            let op = unsafe { agent.post_send(peer, tag, data.as_ptr(), len) };
            let Ok(mut op) = op else { continue };
            sent += 1;
            if let Ok(kvlink::error::Outcome::Completed) =
                op.wait(Instant::now() + Duration::from_secs(5), None)
            {
                done += 1;
            }
        }
    }
    say(format!("INTRUDER sent={sent} done={done}"));
}

/// A rank of another kvlink release (see the module docs): this version's frames, with another
/// version in their headers.
fn other_version(transport: TransportKind, to: Option<&str>, listen: Option<&str>, version: u16) {
    use kvlink::proto::wire::{frame_version, Refusal};
    use kvlink::proto::Message;
    use kvlink::transport::Event;
    let under = |m: &Message| {
        let mut b = m.to_bytes().expect("frame");
        b[4..6].copy_from_slice(&version.to_le_bytes());
        b
    };
    let mut opts = AgentOptions::new("other-version", transport.clone());
    if to.is_none() && !transport.by_worker_address() {
        opts.listen = Some(
            listen
                .unwrap_or("127.0.0.1:0")
                .parse()
                .expect("--listen ip:port"),
        );
    }
    let agent = Agent::new(opts).expect("agent");
    let first_control = |limit: Duration| {
        let until = Instant::now() + limit;
        while let Some(ev) = agent.next_event(until, None) {
            if let Event::Control(peer, bytes) = ev {
                return Some((peer, bytes));
            }
        }
        None
    };
    let mut ops = Vec::new();
    if let Some(to) = to {
        let peer = match to.strip_prefix(kvlink::proto::peers::WORKER_ADDRESS_PREFIX) {
            Some(h) => agent.connect_worker(&unhex(h)),
            None => agent.connect(to.parse().expect("--to ip:port")),
        }
        .expect("connect");
        let hello = Message::Hello {
            agent_name: "other-version".into(),
            rank: kvlink::proto::RankId(7),
            instance: 1,
            challenge: 2,
            proof: None,
        };
        let t0 = Instant::now();
        ops.push(agent.send_control(peer, under(&hello)).expect("send"));
        match first_control(Duration::from_secs(10)) {
            Some((_, bytes)) => say(format!(
                "REPLY {} version={} ms={}",
                Message::decode(&bytes)
                    .map_or_else(|e| format!("undecodable:{e}"), |m| format!("{m:?}")),
                frame_version(&bytes).map_or_else(|| "none".into(), |v| v.to_string()),
                t0.elapsed().as_millis()
            )),
            None => say("REPLY none".into()),
        }
    } else {
        let addr = match agent.listen_address() {
            Some(a) => a.to_string(),
            None => format!(
                "{}{}",
                kvlink::proto::peers::WORKER_ADDRESS_PREFIX,
                agent
                    .worker_address()
                    .iter()
                    .map(|b| format!("{b:02x}"))
                    .collect::<String>()
            ),
        };
        say(format!("ADDR {addr}"));
        if let Some((peer, bytes)) = first_control(Duration::from_secs(60)) {
            let refusal = Message::Refuse {
                reason: Refusal::WireVersion,
            };
            ops.push(agent.send_control(peer, under(&refusal)).expect("send"));
            say(format!(
                "ANSWERED version={}",
                frame_version(&bytes).map_or_else(|| "none".into(), |v| v.to_string())
            ));
        }
    }
    for op in &mut ops {
        let _ = op.wait(Instant::now() + Duration::from_secs(5), None);
    }
    // Until the test is done with it (stdin closes).
    for _ in std::io::stdin().lock().lines() {}
}

#[cfg(test)]
mod tests {
    use super::pattern::{fill, intact, BLOCK_WORDS};
    use super::{flows, senders, BufferSpec, RankId};

    /// `--to A,B,C` and `REQ <id> [from=..]`: segment i from the (i % n)-th context rank named,
    /// each flow listing only its own segments, in order; a position not in the list, or another
    /// word, names no request.
    #[test]
    fn segments_are_split_among_the_context_ranks_named() {
        let peers = [RankId(0), RankId(3), RankId(5)];
        let mut b = [0u8; 7];
        let mut specs = |n: u32| -> Vec<BufferSpec> {
            (0..n).map(|i| BufferSpec::host(i, &mut b[..])).collect()
        };
        let segs = |f: &[(RankId, Vec<BufferSpec>)]| -> Vec<(u32, Vec<u32>)> {
            f.iter()
                .map(|(r, s)| (r.0, s.iter().map(|s| s.segment).collect()))
                .collect()
        };
        let all = senders(&peers, &[]).unwrap();
        assert_eq!(
            segs(&flows(&all, specs(7))),
            [(0, vec![0, 3, 6]), (3, vec![1, 4]), (5, vec![2, 5])]
        );
        let two = senders(&peers, &["from=2,0"]).unwrap();
        assert_eq!(two, [RankId(5), RankId(0)]);
        assert_eq!(
            segs(&flows(&two, specs(3))),
            [(5, vec![0, 2]), (0, vec![1])]
        );
        // More context ranks than segments: those left without one get no flow.
        assert_eq!(segs(&flows(&all, specs(1))), [(0, vec![0])]);
        for bad in [&["from=3"][..], &["from="], &["to=0"], &["from=0", "x"]] {
            assert_eq!(senders(&peers, bad), None, "{bad:?}");
        }
    }

    /// The repeating block still tells misplaced bytes: another request's or segment's data,
    /// data shifted by a word, a page, a MiB or a whole block, one byte changed in the last
    /// block.
    #[test]
    fn the_pattern_catches_misplaced_and_changed_bytes() {
        let len = (3 << 20) + 5;
        let mut a = vec![0u8; len];
        fill(7, 1, &mut a);
        assert!(intact(7, 1, &a));
        assert!(!intact(8, 1, &a));
        assert!(!intact(7, 0, &a));
        for shift in [8, 4096, 1 << 20, 8 * BLOCK_WORDS, 16 * BLOCK_WORDS] {
            let mut b = vec![0u8; len + shift];
            fill(7, 1, &mut b);
            assert!(!intact(7, 1, &b[shift..]), "shifted by {shift}");
        }
        a[len - 1] ^= 1;
        assert!(!intact(7, 1, &a));
    }
}
