//! Setting the host's log sink while another thread removes it ends as one of the two calls
//! last: the sink set (an event at its level reaches it) or removed (its levels off), never the
//! level on with no sink. One test in its own process: the subscriber and the sink are
//! process-global.
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

static DELIVERED: AtomicUsize = AtomicUsize::new(0);
/// Set while the sink is inside a call; the sink's call returns once `RELEASE` is set.
static INSIDE: AtomicBool = AtomicBool::new(false);
static RELEASE: AtomicBool = AtomicBool::new(true);

/// Counts its records; while `RELEASE` is clear it blocks (up to 400 ms, within the removal's
/// 500 ms wait for the records queued for it).
unsafe extern "C" fn sink(
    _: u8,
    _: *const u8,
    _: usize,
    _: *const u8,
    _: usize,
    _: *const u8,
    _: usize,
) {
    INSIDE.store(true, Ordering::SeqCst);
    let until = Instant::now() + Duration::from_millis(400);
    while !RELEASE.load(Ordering::SeqCst) && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(1));
    }
    DELIVERED.fetch_add(1, Ordering::SeqCst);
    INSIDE.store(false, Ordering::SeqCst);
}

fn set(level: u8) {
    let f = if level == 0 {
        0
    } else {
        sink as kvlink::log::SinkFn as usize
    };
    // SAFETY: `sink` never unwinds, calls no engine and lives for the whole process.
    let ours = unsafe { kvlink::log::set_sink(level, f) }.unwrap();
    assert!(ours, "kvlink's subscriber is the global one here");
}

/// The removal stored the level off, then waited for the record under way to reach the sink,
/// then took the sink away. A registration in that wait (its sink stored, then its level) was
/// undone by halves: the level stayed on with no sink, so every event at it was formatted and
/// dropped, going neither to a sink nor to stderr, until the next call.
#[test]
fn a_sink_set_while_being_removed_ends_set_or_removed_never_half_of_each() {
    if std::env::var_os(kvlink::log::ENV).is_some() {
        eprintln!("SKIP: {} is set in this environment", kvlink::log::ENV);
        return;
    }
    set(3);
    // A record under way: the sink blocks in it until released.
    RELEASE.store(false, Ordering::SeqCst);
    tracing::error!("held");
    let t0 = Instant::now();
    while !INSIDE.load(Ordering::SeqCst) {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the sink was never called"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    // Another thread removes the sink: it waits for the record under way.
    let (removing, removal) = mpsc::channel();
    let remover = std::thread::spawn(move || {
        removing.send(()).unwrap();
        set(0);
    });
    removal.recv().unwrap();
    std::thread::sleep(Duration::from_millis(50));
    // Meanwhile the sink is set again; then the record under way returns.
    set(3);
    RELEASE.store(true, Ordering::SeqCst);
    remover.join().unwrap();
    let on = tracing::event_enabled!(tracing::Level::ERROR);
    let before = DELIVERED.load(Ordering::SeqCst);
    tracing::error!("probe");
    assert!(kvlink::log::flush(Instant::now() + Duration::from_secs(10)));
    let got = DELIVERED.load(Ordering::SeqCst) > before;
    assert_eq!(
        on, got,
        "events at the sink's level are on: {on}; the sink got one: {got}"
    );
    set(0);
}
