//! `kvlink-bench core`: what the protocol core itself costs per request, without a transport.
//!
//! One generation and one context endpoint (`kvlink::proto::Endpoint`) in this one thread, with
//! the engine's default settings (a finished request is remembered 5 s): each request is
//! started, its `Advertise` encoded and decoded, accepted, each segment's send and landing
//! reported, the `Verdict` encoded and decoded, events and actions drained and the leases given
//! back, as the engine does between the transport's callbacks. The simulated clock moves
//! `--spacing-us` per request, so the endpoints hold as many lingering requests as a real engine
//! at that rate. Prints nanoseconds per request (CPU work on one core, no waiting), the best and
//! the median of the rounds: the figure to compare before and after a change to the core, far
//! steadier on a noisy machine than a two-process latency.
use crate::cli::CoreArgs;
use kvlink::error::Outcome;
use kvlink::proto::{
    BufferDesc, BufferKind, BufferPool, Config, Endpoint, Event, RankId, ReceiveFlow, ReceiveSpec,
    RequestKey, TokenAllocator,
};
use std::time::{Duration, Instant};

pub fn run(a: &CoreArgs) -> i32 {
    let mut per_req = Vec::new();
    let mut held = 0;
    for _ in 0..a.rounds {
        match round(a) {
            Ok((ns, h)) => {
                per_req.push(ns);
                held = h;
            }
            Err(e) => {
                eprintln!("kvlink-bench core: {e}");
                return 1;
            }
        }
    }
    per_req.sort_by(f64::total_cmp);
    let median = per_req[per_req.len() / 2];
    println!(
        "core: {} requests x {} segments, {} us apart (simulated), {} rounds: \
         best {:.0} ns/request, median {:.0}; requests known at the end {held}",
        a.requests, a.segments, a.spacing_us, a.rounds, per_req[0], median
    );
    println!(
        "CORE {}",
        serde_json::json!({"requests": a.requests, "segments": a.segments,
            "spacing_us": a.spacing_us, "best_ns": per_req[0], "median_ns": median,
            "known_at_end": held})
    );
    0
}

/// One round: `a.requests` requests, each completed before the next starts. Returns ns per
/// request and the requests both endpoints still know at the end (lingering).
fn round(a: &CoreArgs) -> Result<(f64, usize), String> {
    let (g, c) = (RankId(1), RankId(2));
    let cfg = Config::default();
    let mut gen = Endpoint::new(g, cfg);
    let mut ctx = Endpoint::new(c, cfg);
    let mut pool = BufferPool::new(a.segments);
    let mut tokens = TokenAllocator::new([7; 16]);
    let mut frame = Vec::new();
    let t0 = Instant::now();
    let started = Instant::now();
    for i in 0..a.requests {
        let now = t0 + Duration::from_micros(a.spacing_us * i);
        for ep in [&mut gen, &mut ctx] {
            if ep.poll_timeout().is_some_and(|t| t <= now) {
                ep.handle_timeout(now);
            }
        }
        let key = RequestKey::new(i + 1, 0);
        let mut buffers = Vec::with_capacity(a.segments as usize);
        for s in 0..a.segments {
            let lease = pool
                .lease(key)
                .ok_or("pool empty: a lease was not given back")?;
            let token = tokens.allocate().ok_or("tokens exhausted")?;
            let desc = BufferDesc {
                kind: BufferKind::Kv,
                segment: s,
                addr: 0x1000 + u64::from(s) * 4096,
                len: 4096,
                device_id: -1,
                token,
            };
            buffers.push((lease, desc));
        }
        let spec = ReceiveSpec {
            key,
            receivers: vec![g],
            flows: vec![ReceiveFlow { sender: c, buffers }],
            request_info: Vec::new(),
            timeout: None,
        };
        gen.start_receive(now, spec).map_err(|e| e.to_string())?;
        pump(&mut gen, &mut ctx, now, &mut frame)?;
        while let Some(e) = ctx.poll_event() {
            if let Event::Advertised { key, from, .. } = e {
                ctx.accept(now, key, from, true)
                    .map_err(|e| e.to_string())?;
            }
        }
        pump(&mut ctx, &mut gen, now, &mut frame)?;
        for s in 0..a.segments {
            ctx.check_send(key, g, s, 4096)
                .map_err(|e| e.to_string())?
                .map_err(|e| format!("{e:?}"))?;
            ctx.begin_send(key, g, s);
            ctx.handle_send_done(now, key, g, s, true)
                .map_err(|e| e.to_string())?;
        }
        for s in 0..a.segments {
            gen.handle_segment_landed(now, key, s)
                .map_err(|e| e.to_string())?;
        }
        pump(&mut gen, &mut ctx, now, &mut frame)?;
        pump(&mut ctx, &mut gen, now, &mut frame)?;
        let mut ends = 0;
        for ep in [&mut gen, &mut ctx] {
            while let Some(e) = ep.poll_event() {
                if let Event::Terminal { outcome, role, .. } = e {
                    if outcome != Outcome::Completed {
                        return Err(format!("request {i} ended {outcome:?} as {role:?}"));
                    }
                    ends += 1;
                }
            }
            while let Some(act) = ep.poll_action() {
                if let kvlink::proto::Action::Release { lease, .. } = act {
                    pool.release(lease).map_err(|e| e.to_string())?;
                }
            }
        }
        if ends != 2 {
            return Err(format!("request {i}: {ends} terminal events, expected 2"));
        }
    }
    let ns = started.elapsed().as_nanos() as f64 / a.requests as f64;
    Ok((ns, gen.known() + ctx.known()))
}

/// Every queued message of `from`, encoded and decoded as the wire carries it, handed to `to`.
fn pump(
    from: &mut Endpoint,
    to: &mut Endpoint,
    now: Instant,
    frame: &mut Vec<u8>,
) -> Result<(), String> {
    while let Some(tx) = from.poll_transmit() {
        frame.clear();
        tx.message.encode(frame).map_err(|e| format!("{e:?}"))?;
        to.handle_frame(now, from.rank(), frame)
            .map_err(|e| e.to_string())?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every request of a round completes on both endpoints (`round` fails otherwise), and a
    /// finished request is remembered for the core's linger: at 1000 requests/s simulated, all
    /// of a 2000-request round (2 s) are still known, one receive and one send each; 10 ms
    /// apart (20 s) only the last 5 s of them are.
    #[test]
    fn a_round_completes_every_request_and_keeps_the_lingering_ones() {
        for segments in [1, 8] {
            let a = |spacing_us| CoreArgs {
                requests: 2000,
                segments,
                spacing_us,
                rounds: 1,
            };
            let (ns, known) = round(&a(1000)).unwrap();
            assert!(ns > 0.0);
            assert_eq!(known, 4000, "{segments} segments");
            let (_, known) = round(&a(10_000)).unwrap();
            assert!(
                (900..=1100).contains(&known),
                "{segments} segments, 10 ms apart: {known} known"
            );
        }
    }
}
