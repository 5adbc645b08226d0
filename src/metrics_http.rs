//! Serving one engine's metrics over plain HTTP, for hosts and tools that want a scrape port
//! (`kvlink-demo --metrics-listen`, `kvlink-bench run --metrics-listen`). The library opens no
//! port by itself: only a caller of [`serve`] does.
use crate::engine::Engine;
use crate::error::Result;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Weak;
use std::time::{Duration, Instant};

/// Answers each HTTP request at `listener` with the engine's metrics text, one short connection
/// at a time on a thread of its own, for as long as the engine lives: within 200 ms of the
/// engine's end the thread ends and the port is closed, connection or not.
///
/// While it makes a scrape's text (well under a millisecond), and for a moment each 200 ms,
/// the server holds the engine: a host that drops its last `Arc` just then finds the engine
/// dropped when that ends, on the server's thread, not at its own drop. Memory lent to the
/// engine (a region) is the host's again only once the engine is gone: deregister regions
/// before the drop, or wait for the `Weak` to fail, before freeing them.
pub fn serve(engine: Weak<Engine>, listener: TcpListener) {
    std::thread::spawn(move || {
        run(
            polled(listener),
            || engine.upgrade(),
            |e: &std::sync::Arc<Engine>| e.metrics_text(),
        )
    });
}

/// How long the accept loop waits for a connection before it looks whether the engine still
/// lives.
const IDLE_TICK: Duration = Duration::from_millis(200);

/// The listener's connections, each wait for one bounded by [`IDLE_TICK`]: a tick with none
/// comes out as `WouldBlock`. A blocking `accept` would keep the thread, and the port, until
/// the next connection after the engine's end.
fn polled(listener: TcpListener) -> impl Iterator<Item = std::io::Result<TcpStream>> {
    use std::os::fd::AsRawFd;
    let set = listener.set_nonblocking(true);
    std::iter::from_fn(move || {
        if let Err(e) = &set {
            return Some(Err(std::io::Error::new(e.kind(), e.to_string())));
        }
        let mut p = libc::pollfd {
            fd: listener.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd for the listener, which outlives the call.
        let n = unsafe { libc::poll(&mut p, 1, IDLE_TICK.as_millis() as libc::c_int) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            return Some(match e.kind() {
                std::io::ErrorKind::Interrupted => Err(std::io::ErrorKind::WouldBlock.into()),
                _ => Err(e),
            });
        }
        // A connection already gone again reads as WouldBlock too.
        Some(listener.accept().and_then(|(s, _)| {
            s.set_nonblocking(false)?;
            Ok(s)
        }))
    })
}

/// The accept loop of [`serve`]: `engine` is `None` once the engine is gone (then it ends),
/// `text` the metrics text of a live one.
fn run<E>(
    incoming: impl IntoIterator<Item = std::io::Result<TcpStream>>,
    engine: impl Fn() -> Option<E>,
    text: impl Fn(&E) -> Result<String>,
) {
    for stream in incoming {
        if engine().is_none() {
            return;
        }
        match stream {
            // The engine is held for its text only, not across the client's reads and writes:
            // else a client that takes its time keeps an engine its host has dropped alive.
            Ok(s) => {
                let _ = answer(s, || engine().is_some(), || engine().map(|e| text(&e)));
            }
            // No connection within a tick: look at the engine again.
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            // Out of file descriptors (or buffers), accept fails at once for as long as that
            // lasts, the connection still queued: without a pause the loop would spin a core.
            Err(_) => std::thread::sleep(ACCEPT_PAUSE),
        }
    }
}

/// The pause after a failed accept.
const ACCEPT_PAUSE: Duration = Duration::from_millis(100);

/// How long one exchange may take, reading the request and writing the answer each.
const LIMIT: Duration = Duration::from_secs(2);

/// One HTTP/1.1 exchange, bounded: a request head of at most 8 KiB, 2 s in all to read it and
/// 2 s in all to write the answer (a socket timeout bounds one call only: a client that sends
/// or reads a byte at a time would otherwise hold the server for as long as it likes). `text`
/// is `None` once the engine is gone: then the connection is closed unanswered. No socket call
/// waits longer than [`IDLE_TICK`]: between them `alive` says whether the engine still lives,
/// and once it does not the exchange ends there, so that a client that says nothing (or
/// reads nothing) keeps neither the thread nor the port past the engine's end by more than a
/// tick.
fn answer(
    mut s: TcpStream,
    alive: impl Fn() -> bool,
    text: impl FnOnce() -> Option<Result<String>>,
) -> std::io::Result<()> {
    let by = Instant::now() + LIMIT;
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 8192 {
        s.set_read_timeout(Some(left(by)?.min(IDLE_TICK)))?;
        let n = match s.read(&mut buf) {
            Ok(n) => n,
            Err(e) if waited(&e) || e.kind() == std::io::ErrorKind::Interrupted => {
                if !alive() {
                    return Ok(());
                }
                continue;
            }
            Err(e) => return Err(e),
        };
        if n == 0 {
            break;
        }
        head.extend_from_slice(&buf[..n]);
    }
    let (status, kind, body) = if !head.starts_with(b"GET ") {
        (
            "405 Method Not Allowed",
            "text/plain",
            "GET only\n".to_string(),
        )
    } else {
        match text() {
            None => return Ok(()),
            Some(Ok(text)) => ("200 OK", crate::metrics::CONTENT_TYPE, text),
            Some(Err(e)) => ("500 Internal Server Error", "text/plain", format!("{e}\n")),
        }
    };
    let reply = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let by = Instant::now() + LIMIT;
    let mut rest = reply.as_bytes();
    while !rest.is_empty() {
        s.set_write_timeout(Some(left(by)?.min(IDLE_TICK)))?;
        match s.write(rest) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => rest = &rest[n..],
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) if waited(&e) => {
                if !alive() {
                    return Ok(());
                }
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Whether a socket call ended for its timeout (Linux says `WouldBlock`, others `TimedOut`).
fn waited(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
    )
}

/// The time left until `by` (a socket timeout cannot be zero), or `TimedOut`.
fn left(by: Instant) -> std::io::Result<Duration> {
    let d = by.saturating_duration_since(Instant::now());
    if d.is_zero() {
        return Err(std::io::ErrorKind::TimedOut.into());
    }
    Ok(d)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::SocketAddr;

    /// A server on a loopback port that answers `body` to every GET.
    fn server(body: String) -> SocketAddr {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let at = l.local_addr().unwrap();
        std::thread::spawn(move || run(l.incoming(), || Some(()), move |_| Ok(body.clone())));
        at
    }

    /// A polled server (as [`serve`] runs) that answers while the returned stand-in for the
    /// engine lives; the receiver hears when its thread has ended.
    fn served_while_alive() -> (
        std::sync::Arc<()>,
        SocketAddr,
        std::sync::mpsc::Receiver<()>,
    ) {
        let engine = std::sync::Arc::new(());
        let weak = std::sync::Arc::downgrade(&engine);
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let at = l.local_addr().unwrap();
        let (done, ended) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            run(polled(l), || weak.upgrade(), |_| Ok("up 1\n".to_string()));
            let _ = done.send(());
        });
        (engine, at, ended)
    }

    /// A whole exchange, and how long it took.
    fn get(at: SocketAddr) -> (Duration, Vec<u8>) {
        let t = Instant::now();
        let mut s = TcpStream::connect(at).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        s.write_all(b"GET /metrics HTTP/1.1\r\n\r\n").unwrap();
        let mut out = Vec::new();
        s.read_to_end(&mut out).unwrap();
        (t.elapsed(), out)
    }

    /// Once the engine is gone the thread ends and the port is closed within a tick or two,
    /// though no client ever connects again (a blocking accept waited for the next one).
    #[test]
    fn the_port_is_closed_soon_after_the_engine_ends_without_a_connection() {
        let (engine, at, ended) = served_while_alive();
        let (_, reply) = get(at);
        assert!(reply.ends_with(b"\r\n\r\nup 1\n"), "served while it lives");
        drop(engine);
        ended
            .recv_timeout(Duration::from_secs(3))
            .expect("the accept loop ended without a new connection");
        assert!(TcpStream::connect(at).is_err(), "the port is closed");
    }

    /// A client that connects and says nothing as the engine ends does not keep the thread,
    /// and the port, for the rest of its 2 s: they still end within a tick or two of the engine.
    #[test]
    fn the_port_is_closed_soon_after_the_engine_ends_with_a_silent_client_connected() {
        let (engine, at, ended) = served_while_alive();
        let _silent = TcpStream::connect(at).unwrap();
        // Accepted by now, its request being waited for.
        std::thread::sleep(Duration::from_millis(300));
        let t = Instant::now();
        drop(engine);
        ended
            .recv_timeout(Duration::from_secs(5))
            .expect("the accept loop ended");
        let took = t.elapsed();
        assert!(
            took < Duration::from_millis(700),
            "ended {took:?} after the engine"
        );
        assert!(TcpStream::connect(at).is_err(), "the port is closed");
    }

    /// A client that connects and says nothing does not keep the engine alive: an engine the
    /// host drops meanwhile is dropped then, on the host's thread, not when the client is done.
    #[test]
    fn a_silent_client_does_not_keep_the_engine_alive() {
        let engine = std::sync::Arc::new(());
        let weak = std::sync::Arc::downgrade(&engine);
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let at = l.local_addr().unwrap();
        let w = weak.clone();
        std::thread::spawn(move || run(l.incoming(), || w.upgrade(), |_| Ok(String::new())));
        let _silent = TcpStream::connect(at).unwrap();
        std::thread::sleep(Duration::from_millis(300));
        drop(engine);
        assert_eq!(weak.strong_count(), 0, "held by the metrics thread");
    }

    /// An accept that keeps failing (the process out of file descriptors: the connection
    /// stays queued and every accept fails at once) does not spin the thread.
    #[test]
    fn failing_accepts_are_backed_off() {
        use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
        use std::sync::Arc;
        let tries = Arc::new(AtomicUsize::new(0));
        let alive = Arc::new(AtomicBool::new(true));
        let (t, a) = (tries.clone(), alive.clone());
        let server = std::thread::spawn(move || {
            let failing = std::iter::repeat_with(move || {
                t.fetch_add(1, Ordering::Relaxed);
                Err(std::io::Error::from_raw_os_error(24)) // EMFILE
            });
            run(
                failing,
                || a.load(Ordering::Relaxed).then_some(()),
                |_| Ok(String::new()),
            )
        });
        std::thread::sleep(Duration::from_millis(500));
        alive.store(false, Ordering::Relaxed);
        server.join().unwrap();
        let n = tries.load(Ordering::Relaxed);
        assert!(n <= 10, "{n} accepts in 0.5 s");
    }

    /// A client that sends its request head one byte at a time, each well within the read
    /// timeout, holds the one-at-a-time server for 2 s in all, not for as long as it trickles.
    #[test]
    fn a_client_trickling_its_request_holds_the_server_2s_at_most() {
        let at = server("up 1\n".into());
        let slow = std::thread::spawn(move || {
            let mut s = TcpStream::connect(at).unwrap();
            let t = Instant::now();
            for b in b"GET /metrics HTTP/1.1\r\nX: "
                .iter()
                .chain([b'x'; 64].iter())
            {
                if s.write_all(&[*b]).is_err() || t.elapsed() > Duration::from_secs(12) {
                    return;
                }
                std::thread::sleep(Duration::from_millis(400));
            }
        });
        std::thread::sleep(Duration::from_millis(300));
        let (took, reply) = get(at);
        assert!(reply.starts_with(b"HTTP/1.1 200 OK\r\n"));
        assert!(reply.ends_with(b"\r\n\r\nup 1\n"));
        assert!(took < Duration::from_secs(5), "answered after {took:?}");
        slow.join().unwrap();
    }

    /// A client that reads its answer slowly (a little more than a window, every 100 ms: each
    /// write makes progress within its timeout) holds the server for 2 s in all.
    #[test]
    fn a_client_reading_slowly_holds_the_server_2s_at_most() {
        let body = "x".repeat(64 << 20);
        let at = server(body.clone());
        let slow = std::thread::spawn(move || {
            let mut s = TcpStream::connect(at).unwrap();
            s.write_all(b"GET /metrics HTTP/1.1\r\n\r\n").unwrap();
            let t = Instant::now();
            let mut buf = vec![0u8; 256 << 10];
            while t.elapsed() < Duration::from_secs(12) {
                match s.read(&mut buf) {
                    Ok(0) | Err(_) => return,
                    Ok(_) => std::thread::sleep(Duration::from_millis(100)),
                }
            }
        });
        std::thread::sleep(Duration::from_millis(300));
        let (took, reply) = get(at);
        assert!(reply.starts_with(b"HTTP/1.1 200 OK\r\n"));
        assert!(reply.ends_with(body.as_bytes()));
        assert!(took < Duration::from_secs(6), "answered after {took:?}");
        slow.join().unwrap();
    }
}
