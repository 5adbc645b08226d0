//! The peer processes of one row: started from this binary, read line by line with a
//! deadline, and always reaped (killed if need be), so a stuck peer cannot stall the run.
use std::collections::VecDeque;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const STDERR_TAIL: usize = 20;

pub struct Proc {
    child: Child,
    lines: Receiver<String>,
    stderr: Arc<Mutex<VecDeque<String>>>,
    /// Held so that the peer's standard input stays open until [`Proc::close_stdin`].
    stdin: Option<ChildStdin>,
}

pub enum NoLine {
    /// The deadline passed.
    Timeout,
    /// The process closed its standard output (it exited).
    Closed,
}

impl Proc {
    /// Starts `exe` with `args`, on `cpus` only when given ([`crate::pin`]).
    pub fn spawn(exe: &Path, args: &[String], cpus: Option<&[usize]>) -> std::io::Result<Proc> {
        let mut cmd = Command::new(exe);
        if let Some(cpus) = cpus {
            crate::pin::apply(&mut cmd, cpus);
        }
        let mut child = cmd
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()?;
        let (tx, lines) = mpsc::channel();
        if let Some(out) = child.stdout.take() {
            std::thread::spawn(move || {
                for line in BufReader::new(out).lines() {
                    let Ok(line) = line else { break };
                    if tx.send(line).is_err() {
                        break;
                    }
                }
            });
        }
        let stderr = Arc::new(Mutex::new(VecDeque::new()));
        if let Some(err) = child.stderr.take() {
            let tail = stderr.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(err).lines() {
                    let Ok(line) = line else { break };
                    let mut t = tail.lock().unwrap_or_else(|p| p.into_inner());
                    if t.len() == STDERR_TAIL {
                        t.pop_front();
                    }
                    t.push_back(line);
                }
            });
        }
        let stdin = child.stdin.take();
        Ok(Proc {
            child,
            lines,
            stderr,
            stdin,
        })
    }

    /// The next line the process printed, waiting until `deadline`.
    pub fn line(&self, deadline: Instant) -> Result<String, NoLine> {
        let left = deadline.saturating_duration_since(Instant::now());
        match self.lines.recv_timeout(left) {
            Ok(l) => Ok(l),
            Err(RecvTimeoutError::Timeout) => Err(NoLine::Timeout),
            Err(RecvTimeoutError::Disconnected) => Err(NoLine::Closed),
        }
    }

    /// Closes its standard input: a peer that has reported holds on until then.
    pub fn close_stdin(&mut self) {
        self.stdin.take();
    }

    /// Waits up to `grace` for the process to exit; kills it after that. True if it exited
    /// by itself.
    pub fn finish(&mut self, grace: Duration) -> bool {
        let until = Instant::now() + grace;
        loop {
            match self.child.try_wait() {
                Ok(Some(_)) => return true,
                Ok(None) if Instant::now() < until => std::thread::sleep(Duration::from_millis(10)),
                _ => break,
            }
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        false
    }

    /// The last lines it wrote to standard error, joined (for a failure note).
    pub fn stderr_tail(&self, lines: usize) -> String {
        let t = self.stderr.lock().unwrap_or_else(|p| p.into_inner());
        let skip = t.len().saturating_sub(lines);
        t.iter()
            .skip(skip)
            .map(|l| l.trim())
            .collect::<Vec<_>>()
            .join(" / ")
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}
