//! `kvlink-bench core`: what the protocol core itself costs per request, without a transport.
//!
//! One generation and one context endpoint (`kvlink::proto::Endpoint`) in this one thread, with
//! the engine's default settings (a completed request is forgotten at its end, leaving a
//! tombstone for its deadline, the agreement bound and the linger): each request is
//! started, its `Advertise` encoded and decoded, accepted, each segment's send and landing
//! reported, the `Verdict` encoded and decoded, events and actions drained and the leases given
//! back, as the engine does between the transport's callbacks. The simulated clock moves
//! `--spacing-us` per request, so the endpoints hold as many tombstones as a real engine at that
//! rate, and forget requests while the round runs. With `--inflight N` a request's data lands and its verdict passes N requests
//! after it started, so the core holds N running requests as well (the in-flight rows of the
//! two-process bench, without the transport and the other process). Prints nanoseconds per request (CPU work on one core, no waiting), the best and
//! the median of the rounds: the figure to compare before and after a change to the core, far
//! steadier on a noisy machine than a two-process latency.
use crate::alloc_count;
use crate::cli::CoreArgs;
use kvlink::error::Outcome;
use kvlink::proto::{
    BufferDesc, BufferKind, BufferPool, Config, Endpoint, Event, RankId, ReceiveFlow, ReceiveSpec,
    RequestKey, TokenAllocator,
};
use std::time::{Duration, Instant};

pub fn run(a: &CoreArgs) -> i32 {
    let mut per_req = Vec::new();
    let mut last = Round::default();
    for _ in 0..a.rounds {
        match round(a) {
            Ok(r) => {
                per_req.push(r.ns);
                last = r;
            }
            Err(e) => {
                eprintln!("kvlink-bench core: {e}");
                return 1;
            }
        }
    }
    per_req.sort_by(f64::total_cmp);
    let median = per_req[per_req.len() / 2];
    let (known, tombs) = (last.known, last.tombs);
    let allocs = last.allocs as f64 / a.requests as f64;
    let bytes = last.bytes_held as f64 / (known + tombs).max(1) as f64;
    println!(
        "core: {} requests x {} segments, {} in flight, {} us apart (simulated), {} rounds: \
         best {:.0} ns/request, median {:.0}; {allocs:.1} heap allocations per request; \
         remembered at the end {known} requests and {tombs} tombstones, {bytes:.0} heap bytes \
         each",
        a.requests, a.segments, a.inflight, a.spacing_us, a.rounds, per_req[0], median
    );
    println!(
        "CORE {}",
        serde_json::json!({"requests": a.requests, "segments": a.segments,
            "inflight": a.inflight, "spacing_us": a.spacing_us, "best_ns": per_req[0],
            "median_ns": median, "known_at_end": known, "tombstones_at_end": tombs,
            "allocs_per_request": allocs, "heap_bytes_per_remembered": bytes})
    );
    0
}

/// What one round measured.
#[derive(Default)]
struct Round {
    /// Wall time per request.
    ns: f64,
    /// Requests both endpoints still know at the end (running or lingering).
    known: usize,
    /// Requests both endpoints have forgotten but keep a tombstone of.
    tombs: usize,
    /// Heap allocations made during the round (by the core and by this loop, which makes a
    /// request's descriptor list and encodes its frames into one reused buffer).
    allocs: u64,
    /// Heap bytes held at the end that were not held at the start: what the known requests and
    /// the tombstones (and the tables that index them) cost.
    bytes_held: usize,
}

/// One round: `a.requests` requests, each started `a.inflight` requests before it completes.
fn round(a: &CoreArgs) -> Result<Round, String> {
    let cfg = Config::default();
    let window = a.inflight.max(1);
    let slots = u32::try_from(window * u64::from(a.segments)).map_err(|_| "pool too large")?;
    let mut p = Pair {
        segments: a.segments,
        gen: Endpoint::new(RankId(1), cfg),
        ctx: Endpoint::new(RankId(2), cfg),
        pool: BufferPool::new(slots),
        tokens: TokenAllocator::new([7; 16]),
        frame: Vec::new(),
    };
    let heap0 = alloc_count::now();
    let t0 = Instant::now();
    let started = Instant::now();
    let mut ended = 0;
    for i in 0..a.requests + window - 1 {
        let now = t0 + Duration::from_micros(a.spacing_us * i);
        for ep in [&mut p.gen, &mut p.ctx] {
            if ep.poll_timeout().is_some_and(|t| t <= now) {
                ep.handle_timeout(now);
            }
        }
        if i < a.requests {
            p.start(RequestKey::new(i + 1, 0), now)?;
        }
        if let Some(j) = (i + 1).checked_sub(window) {
            ended += p.finish(RequestKey::new(j + 1, 0), now)?;
        }
    }
    if ended != 2 * a.requests {
        return Err(format!(
            "{ended} terminal events, expected {}",
            2 * a.requests
        ));
    }
    let ns = started.elapsed().as_nanos() as f64 / a.requests as f64;
    let heap1 = alloc_count::now();
    Ok(Round {
        ns,
        known: p.gen.known() + p.ctx.known(),
        tombs: p.gen.tombstones() + p.ctx.tombstones(),
        allocs: heap1.calls - heap0.calls,
        bytes_held: heap1.live.wrapping_sub(heap0.live),
    })
}

/// The two endpoints of a round and what they share: the generation side's pool and tokens,
/// and the frame messages are encoded into.
struct Pair {
    segments: u32,
    gen: Endpoint,
    ctx: Endpoint,
    pool: BufferPool,
    tokens: TokenAllocator,
    frame: Vec<u8>,
}

impl Pair {
    /// Starts `key` on the generation endpoint and has the context endpoint accept it.
    fn start(&mut self, key: RequestKey, now: Instant) -> Result<(), String> {
        let (g, c) = (self.gen.rank(), self.ctx.rank());
        let mut buffers = Vec::with_capacity(self.segments as usize);
        for s in 0..self.segments {
            let lease = self
                .pool
                .lease(key)
                .ok_or("pool empty: a lease was not given back")?;
            let token = self.tokens.allocate().ok_or("tokens exhausted")?;
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
        self.gen
            .start_receive(now, spec)
            .map_err(|e| e.to_string())?;
        pump(&mut self.gen, &mut self.ctx, now, &mut self.frame)?;
        while let Some(e) = self.ctx.poll_event() {
            if let Event::Advertised { key, from, .. } = e {
                self.ctx
                    .accept(now, key, from, true)
                    .map_err(|e| e.to_string())?;
            }
        }
        pump(&mut self.ctx, &mut self.gen, now, &mut self.frame)
    }

    /// Sends and lands every segment of `key`, passes the verdict, and drains both endpoints'
    /// events and actions. Returns the terminal events seen (each must be `Completed`).
    fn finish(&mut self, key: RequestKey, now: Instant) -> Result<u64, String> {
        let g = self.gen.rank();
        for s in 0..self.segments {
            self.ctx
                .check_send(key, g, s, 4096)
                .map_err(|e| e.to_string())?
                .map_err(|e| format!("{e:?}"))?;
            self.ctx.begin_send(key, g, s);
            self.ctx
                .handle_send_done(now, key, g, s, true)
                .map_err(|e| e.to_string())?;
        }
        for s in 0..self.segments {
            self.gen
                .handle_segment_landed(now, key, s)
                .map_err(|e| e.to_string())?;
        }
        pump(&mut self.gen, &mut self.ctx, now, &mut self.frame)?;
        pump(&mut self.ctx, &mut self.gen, now, &mut self.frame)?;
        let mut ends = 0;
        for ep in [&mut self.gen, &mut self.ctx] {
            while let Some(e) = ep.poll_event() {
                if let Event::Terminal { outcome, role, .. } = e {
                    if outcome != Outcome::Completed {
                        return Err(format!("{key} ended {outcome:?} as {role:?}"));
                    }
                    ends += 1;
                }
            }
            while let Some(act) = ep.poll_action() {
                if let kvlink::proto::Action::Release { lease, .. } = act {
                    self.pool.release(lease).map_err(|e| e.to_string())?;
                }
            }
        }
        Ok(ends)
    }
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

    /// Every request of a round completes on both endpoints (`round` fails otherwise), and is
    /// forgotten at its end: what is left of it is its tombstone, on both sides, for its
    /// deadline (60 s), the agreement bound and the linger, so at 1000 requests/s (2 s) and
    /// 100 (20 s) simulated all of a 2000-request round's are still there.
    #[test]
    fn a_round_completes_every_request_and_keeps_only_its_tombstones() {
        for segments in [1, 8] {
            let a = |spacing_us| CoreArgs {
                requests: 2000,
                segments,
                inflight: 1,
                spacing_us,
                rounds: 1,
            };
            for spacing_us in [1000, 10_000] {
                let r = round(&a(spacing_us)).unwrap();
                assert!(r.ns > 0.0);
                // The last request ended after the round's last timeout pass: still known.
                assert_eq!((r.known, r.tombs), (2, 3998), "{segments} segments");
                assert!(r.allocs >= 2000, "a request allocates: {}", r.allocs);
                assert!(r.bytes_held >= 4000 * 32, "tombstones hold memory");
            }
        }
    }

    /// With requests in flight every request still completes on both endpoints, each within
    /// its window (the pool holds exactly the window's buffers: a request that did not give its
    /// leases back fails the round).
    #[test]
    fn requests_in_flight_all_complete_and_give_their_buffers_back() {
        for (inflight, segments) in [(64, 1), (4096, 1), (7, 3)] {
            let a = CoreArgs {
                requests: 5000,
                segments,
                inflight,
                spacing_us: 10,
                rounds: 1,
            };
            let r = round(&a).unwrap();
            assert_eq!((r.known, r.tombs), (2, 9998), "{inflight} in flight");
        }
    }
}
