//! Shared by the multi-process tests: a child `kvlink-peer` whose stdout is read line by line.
#![allow(dead_code)]
pub mod net;

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::Duration;

/// How long a test waits for any one line from a child before it fails (never hangs CI).
pub const LINE_TIMEOUT: Duration = Duration::from_secs(90);

pub const PEER: &str = env!("CARGO_BIN_EXE_kvlink-peer");

pub struct Proc {
    pub child: Child,
    /// Lines of the child's stdout, read by a thread of their own so a wait can time out.
    out: Receiver<String>,
    input: Option<ChildStdin>,
    /// Every `STATE ...` line read so far (a health reporter's), in order.
    pub states: Vec<String>,
}

impl Proc {
    /// Starts `cmd` with stdin and stdout piped (stderr inherited).
    pub fn spawn(mut cmd: Command) -> Proc {
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        let (tx, out) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in stdout.lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let input = child.stdin.take();
        Proc {
            child,
            out,
            input,
            states: Vec::new(),
        }
    }

    /// Writes one line to the child's stdin.
    pub fn send(&mut self, line: &str) {
        let w = self.input.as_mut().expect("stdin");
        writeln!(w, "{line}").unwrap();
        w.flush().unwrap();
    }

    /// `kvlink-peer ARGS`.
    pub fn peer(args: &[&str]) -> Proc {
        let mut cmd = Command::new(PEER);
        cmd.args(args);
        Proc::spawn(cmd)
    }

    /// Next stdout line starting with `prefix` (other lines are echoed).
    pub fn expect(&mut self, prefix: &str) -> String {
        loop {
            let line = self.line(prefix);
            if !line.starts_with("STATE ") {
                println!("  | {line}");
            }
            if line.starts_with(prefix) {
                return line;
            }
        }
    }

    /// The address a `kvlink-engine-peer` prints first (`ADDR <address>`).
    pub fn expect_addr(&mut self) -> String {
        let line = self.expect("ADDR");
        line.split_whitespace()
            .nth(1)
            .unwrap_or_else(|| panic!("no address in {line:?}"))
            .to_string()
    }

    /// Next stdout line that starts with one of `prefixes` (other lines are skipped); returns
    /// the matched line trimmed to that prefix when the prefix is a whole word sequence.
    pub fn expect_one_of(&mut self, prefixes: &[&str]) -> String {
        let until = std::time::Instant::now() + LINE_TIMEOUT;
        loop {
            assert!(
                std::time::Instant::now() < until,
                "none of {prefixes:?} within {LINE_TIMEOUT:?}"
            );
            let line = self.line(&format!("{prefixes:?}"));
            if !line.starts_with("STATE ") {
                println!("  | {line}");
            }
            if let Some(p) = prefixes.iter().find(|p| line.starts_with(**p)) {
                return if p.ends_with(' ') {
                    line
                } else {
                    p.to_string()
                };
            }
        }
    }

    /// The next line, or a test failure naming what was awaited if none comes in time.
    fn line(&mut self, awaited: &str) -> String {
        match self.out.recv_timeout(LINE_TIMEOUT) {
            Ok(line) => {
                let line = line.trim_end().to_string();
                if line.starts_with("STATE ") {
                    self.states.push(line.clone());
                }
                line
            }
            Err(RecvTimeoutError::Timeout) => {
                panic!("no line from the peer for {LINE_TIMEOUT:?} while waiting for {awaited}")
            }
            Err(RecvTimeoutError::Disconnected) => {
                panic!("peer exited before printing {awaited}")
            }
        }
    }

    pub fn signal(&self, sig: i32) {
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(self.child.id() as i32, sig) };
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts a `kvlink-peer recv` with `recv_args` through `spawn`, then a `kvlink-peer send`
/// (`--to` its printed address, `send_args`) the same way; returns both once the receiver has
/// posted its receives and the sender has been told to go.
pub fn start_pair(
    spawn: impl Fn(&[&str], bool) -> Proc,
    transport: &str,
    recv_args: &[&str],
    send_args: &[&str],
) -> (Proc, Proc) {
    let mut args = vec!["recv", "--transport", transport];
    args.extend_from_slice(recv_args);
    let mut recv = spawn(&args, true);
    let addr = recv
        .expect("ADDR")
        .split_whitespace()
        .nth(2)
        .unwrap()
        .to_string();
    let mut args = vec!["send", "--transport", transport, "--to", &addr];
    args.extend_from_slice(send_args);
    let mut send = spawn(&args, false);
    recv.expect("POSTED");
    send.expect("GO");
    (recv, send)
}

/// The value of `name=` in a peer's line (a test failure if it has none).
pub fn field<'a>(line: &'a str, name: &str) -> &'a str {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(name).and_then(|r| r.strip_prefix('=')))
        .unwrap_or_else(|| panic!("no {name}= in {line:?}"))
}

/// A line's `late_ms=`: how long past its request's deadline the call it reports returned.
pub fn late(line: &str) -> f64 {
    field(line, "late_ms").parse().unwrap()
}

/// A `RESULT <size> <outcome> <elapsed_ms> <verified>` line.
pub fn result(line: &str) -> (usize, String, f64, bool) {
    let f: Vec<&str> = line.split_whitespace().collect();
    (
        f[1].parse().unwrap(),
        f[2].to_string(),
        f[3].parse().unwrap(),
        f[4] == "true",
    )
}
