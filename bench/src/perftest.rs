//! The raw UCX baseline: `ucx_perftest` server and client on loopback, same transport.
use crate::cli::Transport;
use crate::pin::Split;
use std::io::Read;
use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Test {
    /// `-t tag_bw -O n`: n sends outstanding. With 1, what one transfer in flight can do (the
    /// baseline of every kvlink row); with n, the baseline of the rows that keep n in flight.
    TagBw(u64),
    /// `-t tag_lat`: ping-pong; ucx_perftest prints the one-way latency (half the round trip).
    TagLat,
}

/// ucx_perftest's final line.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Figures {
    pub iterations: u64,
    /// Time per message (tag_bw) or one-way latency (tag_lat), µs: median and overall mean.
    pub us_p50: f64,
    pub us_overall: f64,
    /// GB/s (1e9 bytes/s); ucx_perftest prints MB/s with MB = 2^20 bytes.
    pub gbps: f64,
}

/// A UCX tool of the UCX this bench is linked against: `<prefix>/bin/<name>` with
/// `LD_LIBRARY_PATH=<prefix>/lib` when built with `KVLINK_UCX_ROOT` (the PyPI wheel's tools have
/// no rpath to its lib/), else `<name>` from PATH (the system UCX).
pub fn tool(name: &str) -> Command {
    let libdir = env!("KVLINK_BENCH_UCX_LIBDIR");
    if !libdir.is_empty() {
        let lib = std::path::Path::new(libdir);
        if let Some(bin) = lib.parent().map(|p| p.join("bin").join(name)) {
            if bin.is_file() {
                let mut c = Command::new(bin);
                c.env("LD_LIBRARY_PATH", lib);
                return c;
            }
        }
    }
    Command::new(name)
}

pub fn version() -> Option<String> {
    let out = tool("ucx_info").arg("-v").output().ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    // "# Version 1.13.1" (older releases: "# UCT version=..." / "Library version: ...").
    let line = text
        .lines()
        .find(|l| l.contains("Version") || l.contains("version"))?;
    Some(line.trim_start_matches(['#', ' ']).trim().to_string())
}

/// Iterations for one size: `budget` bytes, within `[min_iters, max_iters]`.
pub fn iterations(size: u64, budget: u64, min_iters: u64, max_iters: u64) -> u64 {
    let lo = min_iters.max(1);
    (budget / size.max(1)).clamp(lo, max_iters.max(lo))
}

/// The tcp send buffer both sides of a row run with: kvlink's own setting
/// ([`kvlink::transport::ucx::TCP_SNDBUF`]) unless `UCX_TCP_SNDBUF` is set, which the kvlink
/// pairs then take too. The baseline gets the same, so that a ratio measures kvlink and not the
/// setting (on this host's loopback under BBR it doubles the rate of 16 and 64 MiB transfers).
pub fn tcp_sndbuf() -> String {
    std::env::var("UCX_TCP_SNDBUF").unwrap_or_else(|_| kvlink::transport::ucx::TCP_SNDBUF.into())
}

/// The untimed warm-up iterations ucx_perftest is given before `iters` timed ones.
pub fn warmup_of(iters: u64) -> u64 {
    (iters / 10).max(3)
}

/// Runs one ucx_perftest pair, each side on its CPUs when `pin` splits them; gives up (killing
/// both) at `limit`.
pub fn run(
    test: Test,
    t: Transport,
    size: u64,
    iters: u64,
    limit: Duration,
    pin: Option<&Split>,
) -> Result<Figures, String> {
    let deadline = Instant::now() + limit;
    let mut args: Vec<String> = vec![
        "-t".into(),
        match test {
            Test::TagBw(_) => "tag_bw",
            Test::TagLat => "tag_lat",
        }
        .into(),
        "-s".into(),
        size.to_string(),
        "-n".into(),
        iters.to_string(),
        "-w".into(),
        warmup_of(iters).to_string(),
        "-f".into(),
    ];
    if let Test::TagBw(n) = test {
        args.extend(["-O".into(), n.max(1).to_string()]);
    }
    let mut last_err = String::new();
    // The server may not listen yet when the client starts: try a few times.
    for _ in 0..4 {
        let port = free_port().map_err(|e| format!("no free port: {e}"))?;
        let mut both = args.clone();
        both.extend(["-p".into(), port.to_string()]);
        let mut server = tool("ucx_perftest");
        if let Some(p) = pin {
            // The server receives (the client sends and times).
            crate::pin::apply(&mut server, &p.receiver);
        }
        let server = server
            .args(&both)
            .env("UCX_TLS", t.ucx_tls())
            .env("UCX_TCP_SNDBUF", tcp_sndbuf())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("ucx_perftest: {e}"))?;
        let mut server = Reaped(server);
        if !listening(port, &mut server, Instant::now() + Duration::from_secs(5)) {
            last_err = "the ucx_perftest server did not start listening".into();
            continue;
        }
        let mut client = tool("ucx_perftest");
        if let Some(p) = pin {
            crate::pin::apply(&mut client, &p.sender);
        }
        let client = client
            .arg("127.0.0.1")
            .args(&both)
            .env("UCX_TLS", t.ucx_tls())
            .env("UCX_TCP_SNDBUF", tcp_sndbuf())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("ucx_perftest: {e}"))?;
        let (out, err, ok) = output_until(Reaped(client), deadline);
        drop(server);
        if let Some(f) = parse(&out) {
            return Ok(f);
        }
        last_err = if !ok {
            format!("no result within {} s", limit.as_secs())
        } else {
            let tail: Vec<&str> = err.lines().rev().take(2).collect();
            format!("no result: {}", tail.join(" / "))
        };
        if !ok || Instant::now() >= deadline {
            break;
        }
    }
    Err(last_err)
}

/// Kills and reaps its child when dropped.
struct Reaped(Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = self.0.kill();
        }
        let _ = self.0.wait();
    }
}

/// The child's stdout and stderr once it exits, or what it wrote by `deadline` (then it is
/// killed; `false`).
fn output_until(mut c: Reaped, deadline: Instant) -> (String, String, bool) {
    let grab = |r: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut s = String::new();
            if let Some(mut r) = r {
                let _ = r.read_to_string(&mut s);
            }
            s
        })
    };
    let out = grab(
        c.0.stdout
            .take()
            .map(|r| Box::new(r) as Box<dyn Read + Send>),
    );
    let err = grab(
        c.0.stderr
            .take()
            .map(|r| Box::new(r) as Box<dyn Read + Send>),
    );
    let mut finished = false;
    while Instant::now() < deadline {
        if let Ok(Some(_)) = c.0.try_wait() {
            finished = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(c); // kills it if still running, which closes the pipes
    (
        out.join().unwrap_or_default(),
        err.join().unwrap_or_default(),
        finished,
    )
}

/// Waits until something listens on TCP `port` (read from /proc/net/tcp{,6}, which does not
/// connect to it: a probe connection would be taken for the client); false if `server` exits
/// first or `until` passes. Where /proc cannot be read, waits 300 ms instead.
fn listening(port: u16, server: &mut Reaped, until: Instant) -> bool {
    let want = format!(":{port:04X} ");
    loop {
        let tables: Vec<String> = ["/proc/net/tcp", "/proc/net/tcp6"]
            .iter()
            .filter_map(|p| std::fs::read_to_string(p).ok())
            .collect();
        if tables.is_empty() {
            std::thread::sleep(Duration::from_millis(300));
            return true;
        }
        // Columns: sl, local_address (ADDR:PORT in hex), rem_address, st (0A = LISTEN), ...
        let found = tables.iter().flat_map(|t| t.lines().skip(1)).any(|l| {
            let mut cols = l.split_whitespace().skip(1);
            let local = cols.next().unwrap_or("");
            let state = cols.nth(1).unwrap_or("");
            format!("{local} ").ends_with(&want) && state == "0A"
        });
        if found {
            return true;
        }
        if Instant::now() >= until || !matches!(server.0.try_wait(), Ok(None)) {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn free_port() -> std::io::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// The final line of `-f` output: iterations, then latency or overhead in µs (50th
/// percentile, average, overall), bandwidth in MB/s (average, overall), message rate.
pub fn parse(out: &str) -> Option<Figures> {
    let line = out.lines().rev().find(|l| {
        l.split_whitespace()
            .next()
            .is_some_and(|w| w.parse::<u64>().is_ok())
    })?;
    let v: Vec<f64> = line
        .split_whitespace()
        .map(|w| w.parse::<f64>())
        .collect::<Result<_, _>>()
        .ok()?;
    if v.len() < 6 {
        return None;
    }
    Some(Figures {
        iterations: v[0] as u64,
        us_p50: v[1],
        us_overall: v[3],
        gbps: v[5] * (1u64 << 20) as f64 / 1e9,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_final_line() {
        let out = "+----+\n|  Test | # iterations |\n+---+\n                        1000      9.297    97.593    97.593       40.03      40.03       10247       10247\n";
        let f = parse(out).expect("figures");
        assert_eq!(f.iterations, 1000);
        assert_eq!(f.us_p50, 9.297);
        assert_eq!(f.us_overall, 97.593);
        assert!((f.gbps - 40.03 * 1048576.0 / 1e9).abs() < 1e-9);
        assert_eq!(parse("no numbers here\n"), None);
    }

    #[test]
    fn iteration_counts() {
        assert_eq!(iterations(4096, 256 << 20, 100, 10_000), 10_000);
        assert_eq!(iterations(1 << 20, 256 << 20, 100, 10_000), 256);
        assert_eq!(iterations(64 << 20, 256 << 20, 100, 10_000), 100);
        assert_eq!(iterations(64 << 20, 32 << 20, 10, 1000), 10);
        assert_eq!(iterations(4096, 32 << 20, 10, 1000), 1000);
    }
}
