//! Bandwidth of kvlink between two processes on loopback, side by side with raw
//! `ucx_perftest -t tag_bw -O 1` on the same transport, printed as ratios.
//!
//! `kvlink-bench [--transports tcp,sm] [--sizes 1048576,16777216,67108864] [--iters 40]`
//!
//! Rows:
//! - `transport`: kvlink's UCX agent, one tagged send in flight at a time (what `tag_bw -O 1`
//!   does), timed on the sender from the first send to the receiver's "all landed" message;
//! - `engine`: whole requests through the protocol core (advertise, ready, send, agreed
//!   completion) with one buffer each, one request at a time;
//! - `ucx_perftest`: the raw baseline, run right before, same transport and sizes.
use kvlink::connection::{BufferSpec, Engine, EngineConfig};
use kvlink::proto::{BufferKind, RankId, RequestKey, Role};
use kvlink::transport::{Agent, AgentOptions, Event, PeerId, TransportKind};
use kvlink::Outcome;
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .cloned()
}

fn tls(t: TransportKind) -> &'static str {
    match t {
        TransportKind::Tcp => "tcp",
        TransportKind::SharedMemory => "posix,sysv,self",
    }
}

fn tname(t: TransportKind) -> &'static str {
    match t {
        TransportKind::Tcp => "tcp",
        TransportKind::SharedMemory => "sm",
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let size: usize = arg(&args, "--size").map_or(0, |s| s.parse().unwrap());
    let iters: usize = arg(&args, "--iters").map_or(40, |s| s.parse().unwrap());
    if let Some(role) = arg(&args, "--role") {
        let t = TransportKind::parse(&arg(&args, "--transport").unwrap()).unwrap();
        match role.as_str() {
            "transport-recv" => transport_recv(t, size, iters),
            "engine-gen" => engine_gen(t, size, iters),
            _ => panic!("unknown role"),
        }
        return;
    }
    let transports: Vec<TransportKind> = arg(&args, "--transports")
        .unwrap_or_else(|| "tcp,sm".into())
        .split(',')
        .map(|s| TransportKind::parse(s).unwrap())
        .collect();
    let sizes: Vec<usize> = arg(&args, "--sizes")
        .unwrap_or_else(|| "1048576,16777216,67108864".into())
        .split(',')
        .map(|s| s.parse().unwrap())
        .collect();
    println!("kvlink-bench: {iters} transfers per row, one in flight; GB/s = 1e9 bytes/s; ratio = kvlink / ucx_perftest");
    println!(
        "{:<4} {:>10} {:>14} {:>14} {:>14} {:>10} {:>10}",
        "tl", "size", "ucx_perftest", "transport", "engine", "t/ucx", "e/ucx"
    );
    for &t in &transports {
        for &size in &sizes {
            let base = perftest(t, size, iters);
            let tr = spawn_pair(t, size, iters, "transport-recv", transport_send);
            let en = spawn_pair(t, size, iters, "engine-gen", engine_ctx);
            let ratio = |x: Option<f64>| match (x, base) {
                (Some(x), Some(b)) if b > 0.0 => format!("{:.2}", x / b),
                _ => "-".into(),
            };
            let f = |x: Option<f64>| x.map_or("-".into(), |v| format!("{v:.2}"));
            println!(
                "{:<4} {:>10} {:>14} {:>14} {:>14} {:>10} {:>10}",
                tname(t),
                size,
                f(base),
                f(tr),
                f(en),
                ratio(tr),
                ratio(en)
            );
        }
    }
}

/// Raw UCX baseline: `ucx_perftest -t tag_bw -O 1` between two processes; GB/s or None.
fn perftest(t: TransportKind, size: usize, iters: usize) -> Option<f64> {
    let port = (20000 + (std::process::id() % 20000)).to_string();
    let common = [
        "-t",
        "tag_bw",
        "-s",
        &size.to_string(),
        "-n",
        &iters.to_string(),
        "-w",
        "3",
        "-O",
        "1",
        "-f",
        "-p",
        &port,
    ];
    let mut server = Command::new("ucx_perftest")
        .args(common)
        .env("UCX_TLS", tls(t))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .ok()?;
    std::thread::sleep(Duration::from_millis(300));
    let out = Command::new("timeout")
        .args(["60", "ucx_perftest", "127.0.0.1"])
        .args(common)
        .env("UCX_TLS", tls(t))
        .output()
        .ok()?;
    let _ = server.kill();
    let _ = server.wait();
    let text = String::from_utf8_lossy(&out.stdout);
    // The final line: iters, p50, avg, overall (us), bw avg, bw overall (MB/s), rates.
    let line = text.lines().rev().find(|l| {
        l.split_whitespace()
            .next()
            .is_some_and(|w| w.parse::<u64>().is_ok())
    })?;
    let mbs: f64 = line.split_whitespace().nth(5)?.parse().ok()?;
    // ucx_perftest counts MB as 2^20 bytes.
    Some(mbs * (1u64 << 20) as f64 / 1e9)
}

/// Starts this binary in `role` as the peer and runs `local` against it; GB/s or None.
fn spawn_pair(
    t: TransportKind,
    size: usize,
    iters: usize,
    role: &str,
    local: fn(TransportKind, &str, usize, usize) -> f64,
) -> Option<f64> {
    let mut child = Command::new(std::env::current_exe().ok()?)
        .args([
            "--role",
            role,
            "--transport",
            tname(t),
            "--size",
            &size.to_string(),
            "--iters",
            &iters.to_string(),
        ])
        .stdout(Stdio::piped())
        .spawn()
        .ok()?;
    let mut out = BufReader::new(child.stdout.take()?);
    let mut line = String::new();
    out.read_line(&mut line).ok()?;
    let addr = line.trim().strip_prefix("ADDR ")?.to_string();
    let gbps = local(t, &addr, size, iters);
    let _ = child.wait();
    Some(gbps)
}

fn transport_recv(t: TransportKind, size: usize, iters: usize) {
    let mut o = AgentOptions::new("bench-recv", t);
    if t == TransportKind::Tcp {
        o.listen = Some("127.0.0.1:0".parse().unwrap());
    }
    let agent = Agent::new(o).unwrap();
    match agent.listen_address() {
        Some(a) => println!("ADDR {a}"),
        None => println!(
            "ADDR {}",
            agent
                .worker_address()
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect::<String>()
        ),
    }
    std::io::stdout().flush().unwrap();
    let peer = wait_control(&agent);
    let mut buf = vec![0u8; size];
    let dl = || Instant::now() + Duration::from_secs(30);
    for i in 0..iters + 3 {
        // SAFETY: `buf` outlives the op, which is waited right here.
        let mut op =
            unsafe { agent.post_recv(peer, i as u64 + 1, buf.as_mut_ptr(), size) }.unwrap();
        assert_eq!(op.wait(dl(), None).unwrap(), Outcome::Completed);
    }
    let mut done = agent.send_control(peer, b"done".to_vec()).unwrap();
    done.wait(dl(), None).unwrap();
    let _ = agent.next_event(Instant::now() + Duration::from_millis(200), None);
}

fn wait_control(agent: &Agent) -> PeerId {
    loop {
        match agent
            .next_event(Instant::now() + Duration::from_secs(30), None)
            .expect("peer")
        {
            Event::Control(p, _) => return p,
            _ => continue,
        }
    }
}

fn transport_send(t: TransportKind, addr: &str, size: usize, iters: usize) -> f64 {
    let agent = Agent::new(AgentOptions::new("bench-send", t)).unwrap();
    let peer = match t {
        TransportKind::Tcp => agent.connect(addr.parse().unwrap()).unwrap(),
        TransportKind::SharedMemory => {
            let bytes: Vec<u8> = (0..addr.len() / 2)
                .map(|i| u8::from_str_radix(&addr[2 * i..2 * i + 2], 16).unwrap())
                .collect();
            agent.connect_worker(&bytes).unwrap()
        }
    };
    let dl = || Instant::now() + Duration::from_secs(30);
    agent
        .send_control(peer, b"hi".to_vec())
        .unwrap()
        .wait(dl(), None)
        .unwrap();
    let data = vec![7u8; size];
    let mut t0 = Instant::now();
    for i in 0..iters + 3 {
        if i == 3 {
            t0 = Instant::now(); // after warm-up
        }
        // SAFETY: `data` outlives the op, which is waited right here.
        let mut op = unsafe { agent.post_send(peer, i as u64 + 1, data.as_ptr(), size) }.unwrap();
        assert_eq!(op.wait(dl(), None).unwrap(), Outcome::Completed);
    }
    loop {
        match agent.next_event(dl(), None).expect("done") {
            Event::Control(_, b) if b == b"done" => break,
            _ => continue,
        }
    }
    (iters * size) as f64 / t0.elapsed().as_secs_f64() / 1e9
}

fn engine_gen(t: TransportKind, size: usize, iters: usize) {
    let mut cfg = EngineConfig::new("bench-gen", 1, t);
    if t == TransportKind::Tcp {
        cfg.listen = Some("127.0.0.1:0".parse().unwrap());
    }
    cfg.timeout = Duration::from_secs(30);
    let e = Engine::new(cfg).unwrap();
    println!("ADDR {}", e.address());
    std::io::stdout().flush().unwrap();
    e.wait_peer(RankId(0), Instant::now() + Duration::from_secs(30))
        .unwrap();
    let mut buf = vec![0u8; size];
    for i in 0..iters + 3 {
        let key = RequestKey::new(i as u64 + 1, 0);
        let spec = BufferSpec {
            kind: BufferKind::Kv,
            segment: 0,
            addr: buf.as_mut_ptr() as u64,
            len: size as u64,
            device_id: -1,
        };
        // SAFETY: `buf` outlives the request: we wait for its end before the next one.
        unsafe { e.advertise(key, vec![RankId(1)], vec![(RankId(0), vec![spec])], vec![]) }
            .unwrap();
        let o = e.wait(
            key,
            Role::Receiver,
            Instant::now() + Duration::from_secs(30),
            None,
        );
        assert_eq!(o.unwrap(), Outcome::Completed);
    }
}

fn engine_ctx(t: TransportKind, addr: &str, size: usize, iters: usize) -> f64 {
    let e = Engine::new(EngineConfig::new("bench-ctx", 0, t)).unwrap();
    let gen = e
        .connect(addr, Instant::now() + Duration::from_secs(30))
        .unwrap();
    let data = vec![7u8; size];
    let mut t0 = Instant::now();
    for i in 0..iters + 3 {
        if i == 3 {
            t0 = Instant::now();
        }
        let dl = Instant::now() + Duration::from_secs(30);
        let adv = e.next_advertisement(dl, None).expect("advertisement");
        e.accept(adv.key, adv.from, true).unwrap();
        assert_eq!(
            e.send(adv.key, adv.from, 0, &data, dl, None).unwrap(),
            Outcome::Completed
        );
        assert_eq!(
            e.wait(adv.key, Role::Sender { receiver: gen }, dl, None)
                .unwrap(),
            Outcome::Completed
        );
    }
    (iters * size) as f64 / t0.elapsed().as_secs_f64() / 1e9
}
