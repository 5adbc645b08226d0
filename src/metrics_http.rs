//! Serving one engine's metrics over plain HTTP, for hosts and tools that want a scrape port
//! (`kvlink-demo --metrics-listen`, `kvlink-bench run --metrics-listen`). The library opens no
//! port by itself: only a caller of [`serve`] does.
use crate::engine::Engine;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Weak;
use std::time::Duration;

/// Answers each HTTP request at `listener` with the engine's metrics text, one short connection
/// at a time on a thread of its own, for as long as the engine lives.
pub fn serve(engine: Weak<Engine>, listener: TcpListener) {
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Some(engine) = engine.upgrade() else {
                return;
            };
            if let Ok(s) = stream {
                let _ = answer(&engine, s);
            }
        }
    });
}

/// One HTTP/1.1 exchange, bounded: a request head of at most 8 KiB, 2 s to read and to write.
fn answer(engine: &Engine, mut s: TcpStream) -> std::io::Result<()> {
    s.set_read_timeout(Some(Duration::from_secs(2)))?;
    s.set_write_timeout(Some(Duration::from_secs(2)))?;
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 8192 {
        let n = s.read(&mut buf)?;
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
        match engine.metrics_text() {
            Ok(text) => ("200 OK", crate::metrics::CONTENT_TYPE, text),
            Err(e) => ("500 Internal Server Error", "text/plain", format!("{e}\n")),
        }
    };
    write!(
        s,
        "HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    s.flush()
}
