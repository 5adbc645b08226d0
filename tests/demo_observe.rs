//! The Rust demo's logs and metrics: `KVLINK_LOG=debug` prints kvlink's events to stderr (the
//! timed-out request 2 among them, with its id), and `--metrics-listen` serves the generation
//! side's metrics on HTTP, which after the three requests count 2 completed and 1 timed out.
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::Duration;

fn get(addr: &str) -> String {
    let mut s = TcpStream::connect(addr).expect("connect to the metrics port");
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    write!(s, "GET /metrics HTTP/1.1\r\nHost: {addr}\r\n\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

fn value(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

#[test]
fn kvlink_log_prints_to_stderr_and_metrics_listen_serves_the_counts() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvlink-demo"))
        .args(["--transport", "tcp", "--timeout-ms", "1000"])
        .args([
            "--metrics-listen",
            "127.0.0.1:0",
            "--metrics-linger-ms",
            "20000",
        ])
        .env("KVLINK_LOG", "debug")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = child.stderr.take().unwrap();
    let errors = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let mut addr = None;
    let mut text = String::new();
    let mut ok = false;
    for line in BufReader::new(child.stdout.take().unwrap()).lines() {
        let line = line.unwrap();
        text.push_str(&line);
        text.push('\n');
        if let Some(rest) = line
            .trim()
            .strip_prefix("metrics (generation side): http://")
        {
            addr = rest.strip_suffix("/metrics").map(str::to_string);
        }
        if line == "kvlink demo: FAILED" || line.starts_with("kvlink demo: OK") {
            ok = line.starts_with("kvlink demo: OK");
            break;
        }
    }
    assert!(ok, "the demo failed:\n{text}");
    let addr = addr.unwrap_or_else(|| panic!("no metrics address in\n{text}"));
    let reply = get(&addr);
    // The demo lingers for the scrape; it has done its work, so end it now.
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(reply.starts_with("HTTP/1.1 200 OK\r\n"), "{reply}");
    assert!(
        reply.contains("Content-Type: text/plain; version=0.0.4"),
        "{reply}"
    );
    let series = |s: &str| value(&reply, s).unwrap_or_else(|| panic!("{s} missing:\n{reply}"));
    let done = r#"kvlink_requests_total{outcome="completed",role="receiver"}"#;
    let late = r#"kvlink_requests_total{outcome="timed_out",role="receiver"}"#;
    assert_eq!(series(done), 2.0);
    assert_eq!(series(late), 1.0);
    assert_eq!(
        series(r#"kvlink_request_duration_seconds_count{role="receiver"}"#),
        3.0
    );
    assert_eq!(series("kvlink_buffers_leased"), 0.0);

    let stderr = errors.join().unwrap();
    assert!(
        stderr
            .lines()
            .any(|l| l.contains("WARN kvlink") && l.contains("request=2 ")),
        "KVLINK_LOG=debug: no WARN for request 2 on stderr:\n{stderr}"
    );
    assert!(
        stderr.lines().any(|l| l.contains("DEBUG kvlink")),
        "KVLINK_LOG=debug: no DEBUG event on stderr:\n{stderr}"
    );
}

#[test]
fn without_kvlink_log_the_demo_is_quiet_on_stderr() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvlink-demo"))
        .args(["--transport", "tcp", "--timeout-ms", "1000"])
        .env_remove("KVLINK_LOG")
        .output()
        .unwrap();
    assert!(out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !stderr.contains(" kvlink::"),
        "events on stderr without KVLINK_LOG:\n{stderr}"
    );
}
