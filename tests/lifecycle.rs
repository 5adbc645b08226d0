//! What a long-running host sees over many engine lives in one process (TensorRT-LLM makes its
//! executor, and with it its engines, again and again): engine pairs over real UCX (tcp on
//! loopback and shared memory, in turn) are made, connected, used for requests that end every
//! way (completed, timed out, cancelled, and a connection force-closed under them) and dropped,
//! round after round. Threads, file descriptors (each UCX context and worker holds several:
//! sockets, eventfds, shared-memory segments) and memory must come back to what the first
//! rounds left, not grow with the rounds.
//!
//! The only test in this binary: it counts the process's threads and descriptors, which another
//! test running beside it would change.
use kvlink::connection::{Engine, EngineConfig, PeerState};
use kvlink::proto::{BufferKind, RankId, RequestKey, Role};
use kvlink::transport::TransportKind;
use kvlink::Outcome;
use std::time::{Duration, Instant};

const CTX: u32 = 0;
const GEN: u32 = 1;
const TO_GEN: Role = Role::Sender {
    receiver: RankId(GEN),
};
const SEG: usize = 4096;

fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").unwrap().count()
}

fn fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

/// Resident memory in bytes.
fn rss() -> usize {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: usize = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    // SAFETY: sysconf has no preconditions.
    pages * unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as usize
}

fn pair(kind: TransportKind) -> (Engine, Engine) {
    let mut c = EngineConfig::new("ctx", CTX, kind.clone());
    if !kind.by_worker_address() {
        c.listen = Some("127.0.0.1:0".parse().unwrap());
    }
    c.timeout = Duration::from_secs(5);
    c.agreement_bound = Duration::from_millis(200);
    let ctx = Engine::new(c).unwrap();
    let mut g = EngineConfig::new("gen", GEN, kind);
    g.timeout = Duration::from_secs(5);
    g.agreement_bound = Duration::from_millis(200);
    let gen = Engine::new(g).unwrap();
    let dl = Instant::now() + Duration::from_secs(5);
    assert_eq!(gen.connect(&ctx.address(), dl).unwrap(), RankId(CTX));
    ctx.wait_peer(RankId(GEN), dl).unwrap();
    (ctx, gen)
}

/// Advertises `buf` as `key`'s one segment (with its own `timeout`, if given) and hands the
/// advertisement to the context side.
fn advertise(
    ctx: &Engine,
    gen: &Engine,
    key: RequestKey,
    buf: &mut [u8],
    timeout: Option<Duration>,
) -> kvlink::connection::Advertisement {
    let spec = kvlink::connection::BufferSpec {
        kind: BufferKind::Kv,
        segment: 0,
        addr: buf.as_mut_ptr() as u64,
        len: buf.len() as u64,
        device_id: -1,
    };
    // SAFETY: every caller waits for the request's end before it lets go of `buf`.
    unsafe {
        gen.advertise_with(
            key,
            vec![RankId(GEN)],
            vec![(RankId(CTX), vec![spec])],
            vec![],
            timeout,
        )
    }
    .unwrap();
    let adv = ctx
        .next_advertisement(Instant::now() + Duration::from_secs(5), None)
        .expect("advertisement");
    assert_eq!(adv.key, key);
    adv
}

fn wait_both(ctx: &Engine, gen: &Engine, key: RequestKey) -> (Outcome, Outcome) {
    let dl = Instant::now() + Duration::from_secs(5);
    let g = gen.wait(key, Role::Receiver, dl, None).unwrap();
    let c = ctx.wait(key, TO_GEN, dl, None).unwrap();
    (g, c)
}

/// One engine life: a completed request, a timed-out one, a cancelled one, and the pair's
/// connection force-closed (then, every other round, dropped before it is made again).
fn life(round: usize, kind: TransportKind) {
    let (ctx, gen) = pair(kind.clone());
    let mut buf = vec![0u8; SEG];
    let data = vec![round as u8; SEG];
    let dl = Instant::now() + Duration::from_secs(5);

    let key = RequestKey::new(1, 0);
    let adv = advertise(&ctx, &gen, key, &mut buf, None);
    ctx.accept(key, adv.from, true).unwrap();
    assert_eq!(
        ctx.send(key, adv.from, 0, &data, dl, None).unwrap(),
        Outcome::Completed
    );
    assert_eq!(
        wait_both(&ctx, &gen, key),
        (Outcome::Completed, Outcome::Completed)
    );
    assert_eq!(buf, data, "round {round} {kind:?}");

    // Never accepted: both sides reach the request's own deadline.
    let key = RequestKey::new(2, 0);
    advertise(&ctx, &gen, key, &mut buf, Some(Duration::from_millis(30)));
    assert_eq!(
        wait_both(&ctx, &gen, key),
        (Outcome::TimedOut, Outcome::TimedOut)
    );

    let key = RequestKey::new(3, 0);
    let adv = advertise(&ctx, &gen, key, &mut buf, None);
    ctx.accept(key, adv.from, true).unwrap();
    gen.cancel(key).unwrap();
    assert_eq!(
        wait_both(&ctx, &gen, key),
        (Outcome::Cancelled, Outcome::Cancelled)
    );

    // A request running when the connection breaks.
    let key = RequestKey::new(4, 0);
    let adv = advertise(&ctx, &gen, key, &mut buf, None);
    ctx.accept(key, adv.from, true).unwrap();
    gen.fault_close_peer(RankId(CTX)).unwrap();
    let (g, c) = wait_both(&ctx, &gen, key);
    assert_ne!(g, Outcome::Completed, "round {round} {kind:?}");
    assert_ne!(c, Outcome::Completed, "round {round} {kind:?}");
    if round % 2 == 0 {
        // The reconnect round binds the pair again before it goes.
        gen.wait_peer(RankId(CTX), Instant::now() + Duration::from_secs(5))
            .unwrap();
        assert_eq!(gen.peer_state(RankId(CTX)), PeerState::Connected);
    }
    let h = gen.health();
    assert_eq!(
        (h.buffers_leased, h.ops_in_flight),
        (0, 0),
        "round {round} {kind:?}"
    );
}

/// Waits (up to 15 s: a reconnect dial left running by a dropped engine ends within its own
/// bound) for `now()` to come down to `bound`; returns what it last saw.
fn settles_to(bound: usize, now: impl Fn() -> usize) -> usize {
    let until = Instant::now() + Duration::from_secs(15);
    loop {
        let n = now();
        if n <= bound || Instant::now() >= until {
            return n;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// 100 lives, tcp and shared memory in turn. The first six make the baseline (UCX's own
/// one-time state, the log sink, allocator arenas); after the rest, threads and descriptors are
/// back to it (a leaked agent keeps its progress thread and its worker's descriptors: one
/// thread and several descriptors a life, 94 of each over the rounds), and resident memory has
/// grown by less than 48 MiB (a leaked UCX context and worker holds a few MiB each).
#[test]
fn engine_lives_leave_no_threads_descriptors_or_memory_behind() {
    const ROUNDS: usize = 100;
    const WARMUP: usize = 6;
    let kinds = [TransportKind::Tcp, TransportKind::SharedMemory];
    let mut base = None;
    for round in 0..ROUNDS {
        life(round, kinds[round % 2].clone());
        if round + 1 == WARMUP {
            // What the warm-up left, once a reconnect dial it left running is over.
            std::thread::sleep(Duration::from_millis(300));
            let t = threads();
            base = Some((t, fds(), rss()));
            println!(
                "baseline after {WARMUP} lives: {t} threads, {} fds, {} KiB",
                fds(),
                rss() >> 10
            );
        }
    }
    let (t0, f0, r0) = base.unwrap();
    let t = settles_to(t0, threads);
    let f = settles_to(f0, fds);
    let r = rss();
    println!(
        "after {ROUNDS} lives: {t} threads, {f} fds, {} KiB (+{} KiB)",
        r >> 10,
        r.saturating_sub(r0) >> 10
    );
    assert!(
        t <= t0,
        "threads: {t} after {ROUNDS} lives, {t0} after {WARMUP}"
    );
    assert!(
        f <= f0,
        "descriptors: {f} after {ROUNDS} lives, {f0} after {WARMUP}"
    );
    assert!(
        r < r0 + (48 << 20),
        "resident memory: {r} after {ROUNDS} lives, {r0} after {WARMUP}"
    );
}
