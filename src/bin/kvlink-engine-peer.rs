//! One rank of a two-process engine test (tests/engine_faults.rs), driven through stdin/stdout
//! so that a test can freeze, kill or cut it off between and during requests.
//!
//! `kvlink-engine-peer ctx --transport tcp|sm [--listen IP:PORT] [--timeout-ms N] [--suppress ID]`
//!   prints `ADDR <address>`, then serves advertisements forever: accepts, prints
//!   `SENDING <request>`, sends every segment (deterministic bytes), waits for the agreed end,
//!   and prints
//!   `CTX <request> send=<outcome> end=<outcome> late_ms=<ms past the request's deadline> leased=<n>`.
//! `kvlink-engine-peer gen --transport tcp|sm --to ADDR --sizes 4K,64M,.. [--timeout-ms N]`
//!   connects, prints `CONNECTED`, then for every stdin line `REQ <id>` advertises one request
//!   with one buffer per size, prints `ADV <id>`, waits for its end and prints
//!   `GEN <id> end=<outcome> late_ms=<ms> verified=<bool> leased=<n>`; `HEALTH` prints a line.
//!   With `--health-every-ms N` a second thread prints `STATE <Healthy|Degraded|Wedged>` every N
//!   ms (`--wedge-ms`, `--degraded-ms` set the windows).
use kvlink::engine::{BufferSpec, Engine, EngineConfig};
use kvlink::proto::{BufferKind, RankId, RequestKey, Role};
use kvlink::transport::TransportKind;
use std::io::{BufRead, Write};
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
    },
    /// The generation (receiving) rank: one request per `REQ <id>` line on stdin.
    Gen(GenOpts),
}

#[derive(clap::Args, Debug)]
struct GenOpts {
    /// The context rank's address, as its ADDR line printed it.
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
}

fn size(s: &str) -> usize {
    let (n, mul) = match s.as_bytes().last() {
        Some(b'K') => (&s[..s.len() - 1], 1 << 10),
        Some(b'M') => (&s[..s.len() - 1], 1 << 20),
        _ => (s, 1),
    };
    n.parse::<usize>().expect("size") * mul
}

/// The bytes of (request, segment): deterministic, so the receiver checks every one; a word
/// at a time, so that a debug build fills 256 MiB quickly.
fn word(request: u64, segment: u32, i: usize) -> u64 {
    let mut x = request.wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ (u64::from(segment) << 40)
        ^ (i as u64).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^= x >> 31;
    x
}

fn fill(request: u64, segment: u32, buf: &mut [u8]) {
    for (i, c) in buf.chunks_mut(8).enumerate() {
        let w = word(request, segment, i).to_le_bytes();
        c.copy_from_slice(&w[..c.len()]);
    }
}

fn intact(request: u64, segment: u32, buf: &[u8]) -> bool {
    buf.chunks(8)
        .enumerate()
        .all(|(i, c)| c == &word(request, segment, i).to_le_bytes()[..c.len()])
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

fn say(line: String) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

fn main() {
    let args = <Args as clap::Parser>::parse();
    let transport = TransportKind::parse_setting(&args.transport).unwrap_or_else(|e| {
        eprintln!("{e}");
        std::process::exit(2)
    });
    let timeout = Duration::from_millis(args.timeout_ms);
    match &args.role {
        Rank::Ctx { listen, suppress } => ctx(transport, timeout, listen.as_deref(), *suppress),
        Rank::Gen(opts) => gen(transport, timeout, opts),
    }
}

/// The transport and network devices (`--transport tcp@lo`).
type Setting = (TransportKind, Option<String>);

fn ctx(
    (transport, devices): Setting,
    timeout: Duration,
    listen: Option<&str>,
    suppress: Option<u64>,
) {
    let mut cfg = EngineConfig::new("ctx", CTX, transport.clone());
    cfg.net_devices = devices;
    cfg.timeout = timeout;
    // The lost-completion fault: this request's data is "sent" without moving.
    cfg.faults.suppress_data_of_request = suppress;
    if let Some(l) = listen {
        cfg.listen = Some(l.parse().expect("--listen ip:port"));
    } else if !transport.by_worker_address() {
        cfg.listen = Some("127.0.0.1:0".parse().unwrap());
    }
    let engine = Engine::new(cfg).expect("engine");
    say(format!("ADDR {}", engine.address()));
    loop {
        let Some(adv) = engine.next_advertisement(Instant::now() + Duration::from_secs(3600), None)
        else {
            continue;
        };
        let key = adv.key;
        if let Err(e) = engine.accept(key, adv.from, true) {
            say(format!("CTX {} accept-error {e}", key.request.0));
            continue;
        }
        let data: Vec<(u32, Vec<u8>)> = adv
            .buffers
            .iter()
            .map(|d| {
                let mut v = vec![0u8; d.len as usize];
                fill(key.request.0, d.segment, &mut v);
                (d.segment, v)
            })
            .collect();
        let segs: Vec<(u32, &[u8])> = data.iter().map(|(s, d)| (*s, d.as_slice())).collect();
        say(format!("SENDING {}", key.request.0));
        let sent = engine
            .send_segments(key, adv.from, &segs, adv.deadline, None)
            .map_or_else(|e| format!("error:{:?}", e.kind), |o| format!("{o:?}"));
        let end = engine
            .wait(key, Role::Sender { receiver: adv.from }, adv.deadline, None)
            .map_or_else(|e| format!("error:{:?}", e.kind), |o| format!("{o:?}"));
        let late = late_ms(adv.deadline);
        say(format!(
            "CTX {} send={sent} end={end} late_ms={late:.1} leased={}",
            key.request.0,
            engine.health().buffers_leased
        ));
    }
}

fn gen((transport, devices): Setting, timeout: Duration, opts: &GenOpts) {
    let GenOpts {
        to,
        sizes,
        wedge_ms,
        degraded_ms,
        health_every_ms,
    } = opts;
    let mut cfg = EngineConfig::new("gen", GEN, transport);
    cfg.net_devices = devices;
    cfg.timeout = timeout;
    let ms = |v: &Option<u64>| v.map(Duration::from_millis);
    if let Some(w) = ms(wedge_ms) {
        cfg.wedge_window = w;
    }
    if let Some(d) = ms(degraded_ms) {
        cfg.degraded_window = d;
    }
    let engine = std::sync::Arc::new(Engine::new(cfg).expect("engine"));
    if let Some(every) = ms(health_every_ms) {
        // What a router's health check would see, while requests run on the main thread.
        let e = engine.clone();
        std::thread::spawn(move || loop {
            say(format!("STATE {:?}", e.health().state));
            std::thread::sleep(every);
        });
    }
    let sizes: Vec<usize> = sizes.split(',').map(size).collect();
    let peer = engine
        .connect(to, Instant::now() + Duration::from_secs(20))
        .expect("connect");
    say("CONNECTED".into());
    for line in std::io::stdin().lock().lines() {
        let line = line.unwrap_or_default();
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["REQ", id] => {
                let id: u64 = id.parse().expect("request id");
                let key = RequestKey::new(id, 0);
                let mut bufs: Vec<Vec<u8>> = sizes.iter().map(|&n| vec![0u8; n]).collect();
                let specs: Vec<BufferSpec> = bufs
                    .iter_mut()
                    .enumerate()
                    .map(|(i, b)| BufferSpec {
                        kind: BufferKind::Kv,
                        segment: i as u32,
                        addr: b.as_mut_ptr() as u64,
                        len: b.len() as u64,
                        device_id: -1,
                    })
                    .collect();
                let deadline = Instant::now() + timeout;
                let cpu0 = cpu_ms();
                // SAFETY: `bufs` outlives the request: we wait for its end below.
                let adv = unsafe {
                    engine.advertise(key, vec![RankId(GEN)], vec![(peer, specs)], vec![])
                };
                if let Err(e) = adv {
                    say(format!("GEN {id} advertise-error {:?} {e}", e.kind));
                    continue;
                }
                say(format!("ADV {id}"));
                let end = engine
                    .wait(key, Role::Receiver, deadline, None)
                    .map_or_else(|e| format!("error:{:?}", e.kind), |o| format!("{o:?}"));
                let late = late_ms(deadline);
                let cpu = cpu_ms() - cpu0;
                let leased = engine.health().buffers_leased;
                let verified = bufs
                    .iter()
                    .enumerate()
                    .all(|(i, b)| intact(id, i as u32, b));
                say(format!(
                    "GEN {id} end={end} late_ms={late:.1} verified={verified} leased={leased} cpu_ms={cpu:.1}"
                ));
            }
            ["HEALTH"] => {
                let h = engine.health();
                say(format!(
                    "HEALTH peer={:?} failed={} reconnects={} leased={} fenced={} unsettled={}",
                    engine.peer_state(peer),
                    h.peers_failed,
                    h.reconnects,
                    h.buffers_leased,
                    h.buffers_fenced,
                    h.unsettled_returns
                ));
            }
            _ => {}
        }
    }
}
