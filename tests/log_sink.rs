//! A host's log sink that blocks (a logger writing to a full pipe) stalls no transfer: the sink
//! is called on kvlink's log thread, off the engines' threads, and the records that do not fit
//! in its queue meanwhile are dropped and counted. A sink that keeps up receives every record,
//! in order. One test in its own process: the subscriber and the sink are process-global.
use kvlink::connection::{BufferSpec, Engine, EngineConfig};
use kvlink::proto::{RankId, RequestKey, Role};
use kvlink::transport::TransportKind;
use kvlink::Outcome;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

const CTX: u32 = 0;
const GEN: u32 = 1;
const TO_GEN: Role = Role::Sender {
    receiver: RankId(GEN),
};
/// The engines' agreement bound.
const BOUND: Duration = Duration::from_millis(500);
/// The deadline rule's "few milliseconds", with room for a busy machine.
const SLACK: Duration = Duration::from_millis(100);
/// How long the stalling sink blocks on each call while `STALL` is set.
const STALL_FOR: Duration = Duration::from_secs(2);

static STALL: AtomicBool = AtomicBool::new(true);
static STALLED_CALLS: AtomicUsize = AtomicUsize::new(0);
static SEEN: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// A host logger stuck on a full pipe: every call blocks for `STALL_FOR` while `STALL` is set.
unsafe extern "C" fn stalling(
    _: u8,
    _: *const u8,
    _: usize,
    _: *const u8,
    _: usize,
    _: *const u8,
    _: usize,
) {
    STALLED_CALLS.fetch_add(1, Ordering::Relaxed);
    if STALL.load(Ordering::Relaxed) {
        std::thread::sleep(STALL_FOR);
    }
}

/// Set while the slow sink is inside a call; its calls so far.
static IN_SLOW: AtomicBool = AtomicBool::new(false);
static SLOW_CALLS: AtomicUsize = AtomicUsize::new(0);

/// A sink whose every call takes 100 ms.
unsafe extern "C" fn slow(
    _: u8,
    _: *const u8,
    _: usize,
    _: *const u8,
    _: usize,
    _: *const u8,
    _: usize,
) {
    IN_SLOW.store(true, Ordering::SeqCst);
    std::thread::sleep(Duration::from_millis(100));
    SLOW_CALLS.fetch_add(1, Ordering::SeqCst);
    IN_SLOW.store(false, Ordering::SeqCst);
}

/// A sink that keeps up: keeps each record's message.
unsafe extern "C" fn collect(
    _: u8,
    _: *const u8,
    _: usize,
    m: *const u8,
    ml: usize,
    _: *const u8,
    _: usize,
) {
    // SAFETY: the message is valid UTF-8 bytes for the call.
    let m = String::from_utf8_lossy(unsafe { std::slice::from_raw_parts(m, ml) }).into_owned();
    SEEN.lock().unwrap().push(m);
}

fn set_sink(level: u8, f: kvlink::log::SinkFn) {
    // SAFETY: both sinks never unwind, call no engine and live for the whole process.
    let ours = unsafe { kvlink::log::set_sink(level, f as usize) }.unwrap();
    assert!(ours, "kvlink's subscriber is the global one here");
}

fn engines() -> (Engine, Engine) {
    let mut c = EngineConfig::new("ctx", CTX, TransportKind::Tcp);
    c.listen = Some("127.0.0.1:0".parse().unwrap());
    c.timeout = Duration::from_secs(5);
    c.agreement_bound = BOUND;
    let ctx = Engine::new(c).unwrap();
    let mut g = EngineConfig::new("gen", GEN, TransportKind::Tcp);
    g.timeout = Duration::from_secs(5);
    g.agreement_bound = BOUND;
    let gen = Engine::new(g).unwrap();
    let dl = Instant::now() + Duration::from_secs(5);
    assert_eq!(gen.connect(&ctx.address(), dl).unwrap(), RankId(CTX));
    ctx.wait_peer(RankId(GEN), dl).unwrap();
    (ctx, gen)
}

/// Asserts that a call whose deadline was `deadline` returned by the deadline rule.
fn by_the_rule(what: &str, deadline: Instant) {
    let late = Instant::now().saturating_duration_since(deadline);
    assert!(late <= BOUND + SLACK, "{what}: {late:?} past its deadline");
}

/// One request the context rank fills: every call returns by its deadline, and it completes.
fn completes(ctx: &Engine, gen: &Engine, key: RequestKey) {
    let mut buf = vec![0u8; 64 << 10];
    let data: Vec<u8> = (0..buf.len()).map(|i| i as u8 ^ 0x5a).collect();
    // SAFETY: `buf` outlives the request: it is waited for below.
    unsafe {
        gen.advertise_with(
            key,
            vec![RankId(GEN)],
            vec![(RankId(CTX), vec![BufferSpec::host(0, &mut buf)])],
            vec![],
            None,
        )
    }
    .unwrap();
    let dl = Instant::now() + Duration::from_secs(2);
    let adv = ctx.next_advertisement(dl, None).expect("advertisement");
    by_the_rule("next_advertisement", dl);
    ctx.accept(key, adv.from, true).unwrap();
    let o = ctx.send(key, adv.from, 0, &data, dl, None).unwrap();
    by_the_rule("send", dl);
    assert_eq!(o, Outcome::Completed, "{key}: send");
    let o = gen.wait(key, Role::Receiver, dl, None).unwrap();
    by_the_rule("receiver's wait", dl);
    assert_eq!(o, Outcome::Completed, "{key}: receiver");
    let o = ctx.wait(key, TO_GEN, dl, None).unwrap();
    by_the_rule("sender's wait", dl);
    assert_eq!(o, Outcome::Completed, "{key}: sender");
    assert!(buf == data, "{key}: data");
}

/// One request the context rank takes and never fills: it times out at its short deadline, and
/// every wait returns by the deadline rule.
fn times_out(ctx: &Engine, gen: &Engine, key: RequestKey) {
    let mut buf = vec![0u8; 4096];
    let short = Duration::from_millis(300);
    // SAFETY: `buf` outlives the request: it is waited for below.
    unsafe {
        gen.advertise_with(
            key,
            vec![RankId(GEN)],
            vec![(RankId(CTX), vec![BufferSpec::host(0, &mut buf)])],
            vec![],
            Some(short),
        )
    }
    .unwrap();
    let dl = Instant::now() + short;
    assert!(ctx.next_advertisement(dl, None).is_some(), "{key}");
    let o = gen.wait(key, Role::Receiver, dl, None).unwrap();
    by_the_rule("receiver's wait", dl);
    assert_eq!(o, Outcome::TimedOut, "{key}: receiver");
    let dl = Instant::now() + short;
    let o = ctx.wait(key, TO_GEN, dl, None).unwrap();
    by_the_rule("sender's wait", dl);
    assert_ne!(o, Outcome::Completed, "{key}: sender");
}

/// The messages `SEEN` holds that start with `prefix`.
fn seen(prefix: &str) -> Vec<String> {
    let seen = SEEN.lock().unwrap();
    seen.iter()
        .filter(|m| m.starts_with(prefix))
        .cloned()
        .collect()
}

#[test]
fn a_sink_that_blocks_stalls_no_transfer_and_a_sink_that_keeps_up_gets_every_record_in_order() {
    let (ctx, gen) = engines();

    // DEBUG: every request's end is logged, on the progress threads, and each call of the sink
    // blocks for 2 s.
    set_sink(4, stalling);
    for i in 0..3 {
        completes(&ctx, &gen, RequestKey::new(100 + i, 0));
        times_out(&ctx, &gen, RequestKey::new(200 + i, 0));
    }
    assert!(
        STALLED_CALLS.load(Ordering::Relaxed) >= 1,
        "the sink was called"
    );
    assert!(
        !kvlink::log::flush(Instant::now() + Duration::from_millis(100)),
        "the requests' records wait behind the blocked sink"
    );

    // The queue fills behind the blocked sink: what does not fit is dropped and counted.
    let dropped = kvlink::log::records_dropped();
    let extra = 1000;
    for i in 0..kvlink::log::QUEUE_CAP + extra {
        tracing::warn!("overflow {i}");
    }
    let now = kvlink::log::records_dropped() - dropped;
    println!("records dropped behind the blocked sink: {now}");
    // At most one record left the queue meanwhile (each call blocks for 2 s).
    assert!(now >= extra as u64 - 1, "{now} dropped");

    // A sink that keeps up takes over and receives the records still queued (once the call
    // under way returns), then every new one, in the order they were logged, per thread.
    STALL.store(false, Ordering::Relaxed);
    set_sink(2, collect);
    assert!(kvlink::log::flush(Instant::now() + Duration::from_secs(10)));
    std::thread::scope(|s| {
        for t in 0..2 {
            s.spawn(move || {
                for i in 0..500 {
                    tracing::warn!(thread = t, "ordered {t} {i}");
                }
            });
        }
    });
    for i in 0..500 {
        tracing::warn!("ordered main {i}");
    }
    assert!(kvlink::log::flush(Instant::now() + Duration::from_secs(10)));
    for t in ["0", "1", "main"] {
        let got = seen(&format!("ordered {t} "));
        let want: Vec<String> = (0..500).map(|i| format!("ordered {t} {i}")).collect();
        assert_eq!(got, want, "thread {t}");
    }
    let overflow = seen("overflow ");
    assert!(
        !overflow.is_empty(),
        "the replacement got the queued records"
    );
    let mut last = None;
    for m in &overflow {
        let i: usize = m["overflow ".len()..].parse().unwrap();
        assert!(last < Some(i), "out of order: {m} after {last:?}");
        last = Some(i);
    }
    assert_eq!(
        kvlink::log::records_dropped() - dropped,
        now,
        "nothing dropped for a sink that keeps up"
    );

    // Removed while records wait behind a blocked sink: the removal waits for them no longer
    // than its bound, then those records are discarded, never delivered to a sink set later;
    // new events go nowhere.
    STALL.store(true, Ordering::Relaxed);
    set_sink(2, stalling);
    tracing::warn!("first, blocks the sink");
    for i in 0..10 {
        tracing::warn!("discarded {i}");
    }
    let t0 = Instant::now();
    // SAFETY: removing the sink.
    unsafe { kvlink::log::set_sink(0, 0) }.unwrap();
    assert!(
        t0.elapsed() < kvlink::log::STOP_WAIT + SLACK,
        "the removal waited {:?}",
        t0.elapsed()
    );
    tracing::warn!("after removal");
    STALL.store(false, Ordering::Relaxed);
    set_sink(2, collect);
    tracing::warn!("back");
    assert!(kvlink::log::flush(Instant::now() + Duration::from_secs(10)));
    assert_eq!(seen("back"), vec!["back".to_string()]);
    assert!(seen("discarded ").is_empty(), "{:?}", seen("discarded "));
    assert!(seen("after removal").is_empty());
    // Removed while a call of a sink takes 100 ms and two more records wait for it: the removal
    // lets them reach it (300 ms in all, within its bound), and once it returns the sink is not
    // running and the log thread has ended and been joined (a host may unload a library that
    // links kvlink then).
    set_sink(2, slow);
    for i in 0..3 {
        tracing::warn!("slow {i}");
    }
    let by = Instant::now() + Duration::from_secs(10);
    while !IN_SLOW.load(Ordering::SeqCst) {
        assert!(Instant::now() < by, "the slow sink was never called");
        std::thread::yield_now();
    }
    assert!(log_thread_alive());
    // SAFETY: removing the sink.
    unsafe { kvlink::log::set_sink(0, 0) }.unwrap();
    assert_eq!(
        SLOW_CALLS.load(Ordering::SeqCst),
        3,
        "the records queued for the removed sink did not all reach it"
    );
    assert!(
        !IN_SLOW.load(Ordering::SeqCst),
        "the sink's call outlived its removal"
    );
    assert!(
        !log_thread_alive(),
        "the log thread outlived the sink's removal"
    );
    // The same with more queued than the bound lets through (eight records of 100 ms): the
    // queue gets the first part of the bound, the call under way then the rest. Found by
    // review: the queue took all of it, and the removal returned while the sink was in a call
    // and the log thread ran.
    let before = SLOW_CALLS.load(Ordering::SeqCst);
    set_sink(2, slow);
    for i in 0..8 {
        tracing::warn!("slower {i}");
    }
    let by = Instant::now() + Duration::from_secs(10);
    while !IN_SLOW.load(Ordering::SeqCst) {
        assert!(Instant::now() < by, "the slow sink was never called");
        std::thread::yield_now();
    }
    let t0 = Instant::now();
    // SAFETY: removing the sink.
    unsafe { kvlink::log::set_sink(0, 0) }.unwrap();
    let took = t0.elapsed();
    let calls = SLOW_CALLS.load(Ordering::SeqCst) - before;
    assert!(
        took < kvlink::log::STOP_WAIT + SLACK,
        "the removal waited {took:?}"
    );
    assert!(
        !IN_SLOW.load(Ordering::SeqCst),
        "the sink's call outlived its removal ({calls} calls, {took:?})"
    );
    assert!(
        !log_thread_alive(),
        "the log thread outlived the sink's removal ({calls} calls, {took:?})"
    );
    assert!((1..8).contains(&calls), "{calls} of 8 records delivered");
}

/// Whether this process has a thread named `kvlink-log`.
fn log_thread_alive() -> bool {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .any(|name| name.trim() == "kvlink-log")
}
