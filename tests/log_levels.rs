//! Logs off by default cost a level check: with no `KVLINK_LOG` and no sink, kvlink's
//! subscriber hints `OFF`, so every `tracing` callsite is disabled before it formats anything.
//! Registering a sink turns exactly its levels on (the interest cache is rebuilt), and removing
//! it turns them off again. One test in its own process: the subscriber is process-global.
use std::sync::atomic::{AtomicUsize, Ordering};
use tracing::level_filters::LevelFilter;

static WARNS: AtomicUsize = AtomicUsize::new(0);
static OTHERS: AtomicUsize = AtomicUsize::new(0);

unsafe extern "C" fn count(
    level: u8,
    _: *const u8,
    _: usize,
    _: *const u8,
    _: usize,
    _: *const u8,
    _: usize,
) {
    let n = if level == 2 { &WARNS } else { &OTHERS };
    n.fetch_add(1, Ordering::Relaxed);
}

fn log_everything() {
    for _ in 0..10 {
        tracing::error!(request = 1u64, "error");
        tracing::warn!(request = 1u64, "warn");
        tracing::info!(request = 1u64, "info");
        tracing::debug!(request = 1u64, "debug");
    }
}

#[test]
fn off_by_default_and_exactly_the_sinks_levels_when_one_is_set() {
    if std::env::var_os(kvlink::log::ENV).is_some() {
        eprintln!("SKIP: {} is set in this environment", kvlink::log::ENV);
        return;
    }
    assert!(
        kvlink::log::init(),
        "kvlink's subscriber is the global one here"
    );
    assert_eq!(LevelFilter::current(), LevelFilter::OFF);
    assert!(!tracing::enabled!(tracing::Level::ERROR));
    log_everything();

    // SAFETY: `count` never unwinds and lives for the whole process.
    let ours = unsafe { kvlink::log::set_sink(2, count as kvlink::log::SinkFn as usize) }.unwrap();
    assert!(ours);
    assert_eq!(LevelFilter::current(), LevelFilter::WARN);
    log_everything();
    // The sink is called on kvlink's log thread: wait for the records to reach it.
    assert!(kvlink::log::flush(
        std::time::Instant::now() + std::time::Duration::from_secs(10)
    ));
    assert_eq!(WARNS.load(Ordering::Relaxed), 10);
    assert_eq!(
        OTHERS.load(Ordering::Relaxed),
        10,
        "the errors, and nothing below WARN"
    );

    // SAFETY: removing the sink.
    unsafe { kvlink::log::set_sink(0, 0) }.unwrap();
    assert_eq!(LevelFilter::current(), LevelFilter::OFF);
    log_everything();
    assert_eq!(WARNS.load(Ordering::Relaxed), 10);
    assert_eq!(OTHERS.load(Ordering::Relaxed), 10);
}
