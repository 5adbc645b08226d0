//! Logs: kvlink's `tracing` events go to stderr when `KVLINK_LOG` asks for them (the
//! `tracing-subscriber` `EnvFilter` syntax: `KVLINK_LOG=debug`, `KVLINK_LOG=kvlink=info`), or to
//! the host's log sink once one is registered ([`set_sink`], the C++ `kvlink::set_log_sink`),
//! instead of stderr. With neither, every callsite is disabled: the subscriber's max level hint
//! is `OFF`, so a `tracing` macro on the request path costs one relaxed load and a compare.
//!
//! The sink is called on one thread of kvlink's ("kvlink-log"), never on the thread that logged:
//! each event is formatted there into one owned record and queued (at most
//! [`QUEUE_CAP`] records wait; past that a new record is dropped and counted in
//! [`records_dropped`]), so a sink that blocks delays only its own records, never a transfer.
//! [`flush`] waits, up to a deadline, until the records queued so far have been delivered;
//! records still queued when the process exits are lost.
//!
//! kvlink installs its global subscriber once, lazily, on the first engine creation or sink
//! registration. If the host has already installed a global `tracing` subscriber, kvlink leaves
//! it alone: its events go there, and [`set_sink`] says so by returning `false`.
use std::cell::Cell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::OnceLock;

use tracing::field::{Field, Visit};
use tracing::level_filters::LevelFilter;
use tracing::{Event, Level, Metadata, Subscriber};
use tracing_core::subscriber::Interest;
use tracing_subscriber::layer::{Context, Filter, Layer, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::{EnvFilter, Registry};

use crate::error::{Error, ErrorKind, Result};

mod delivery;

pub use delivery::{flush, records_dropped, DRAIN_WAIT, QUEUE_CAP, STOP_WAIT};

/// The environment variable read (once, at installation) for the stderr filter.
pub const ENV: &str = "KVLINK_LOG";

/// A host's sink, as C++ passes it: the address of an `extern "C"` function taking the level
/// (1 error .. 5 trace), then the target, the message and the fields (`k=v` separated by
/// spaces), each as UTF-8 bytes and a length. Called on kvlink's log thread ("kvlink-log"), one
/// record at a time, in the order the events were logged, with no kvlink lock held.
pub type SinkFn = unsafe extern "C" fn(u8, *const u8, usize, *const u8, usize, *const u8, usize);

/// The sink's level code (0: no sink); its function's address is kept with the queue.
static SINK_LEVEL: AtomicU8 = AtomicU8::new(0);
/// Whether kvlink's subscriber is the global one (decided once).
static INSTALLED: OnceLock<bool> = OnceLock::new();

thread_local! {
    /// Set while this thread formats an event for the sink, and for good on the thread that
    /// calls the sink: an event the sink (or the formatting) itself causes is dropped rather
    /// than recursing.
    static IN_SINK: Cell<bool> = const { Cell::new(false) };
}

/// Level code (1 error .. 5 trace) as a filter; 0 is `OFF`.
fn filter_of(code: u8) -> LevelFilter {
    match code {
        1 => LevelFilter::ERROR,
        2 => LevelFilter::WARN,
        3 => LevelFilter::INFO,
        4 => LevelFilter::DEBUG,
        5 => LevelFilter::TRACE,
        _ => LevelFilter::OFF,
    }
}

/// A level as its code (1 error .. 5 trace).
pub fn level_code(level: &Level) -> u8 {
    match *level {
        Level::ERROR => 1,
        Level::WARN => 2,
        Level::INFO => 3,
        Level::DEBUG => 4,
        Level::TRACE => 5,
    }
}

fn sink_filter() -> LevelFilter {
    filter_of(SINK_LEVEL.load(Ordering::Acquire))
}

fn sink_active() -> bool {
    SINK_LEVEL.load(Ordering::Acquire) != 0
}

/// Installs kvlink's global subscriber if no global subscriber exists yet; returns whether
/// kvlink's is the one installed. Called on every engine creation: after the first, a load.
pub fn init() -> bool {
    *INSTALLED.get_or_init(|| {
        let spec = std::env::var(ENV).ok().filter(|s| !s.trim().is_empty());
        let env = match spec {
            Some(s) => EnvFilter::builder().parse_lossy(s),
            None => EnvFilter::new("off"),
        };
        let stderr = tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .with_filter(StderrFilter(env));
        let sink = SinkLayer.with_filter(SinkLevel);
        let subscriber = Registry::default().with(stderr).with(sink);
        tracing::subscriber::set_global_default(subscriber).is_ok()
    })
}

/// Routes every event at or above `level` (1 error .. 5 trace) to `callback` instead of stderr;
/// `level` 0 or a null `callback` removes the sink (stderr, if `KVLINK_LOG` is set, again).
/// Returns whether the events reach it (false: the host installed a global `tracing` subscriber
/// of its own first, and the events go there).
///
/// The callback is called on kvlink's log thread, started here when a sink is first set, one
/// record at a time and in order; a replacement receives the records still queued. Removing the
/// sink lets the records still queued reach it for [`DRAIN_WAIT`] and joins the log thread,
/// within [`STOP_WAIT`] in all; records left after the first are discarded (never delivered to
/// a sink set later). After it the callback is not called again, unless its call under way
/// outlasts that bound (one call of up to `STOP_WAIT - DRAIN_WAIT` always fits; from inside
/// the callback it does not wait).
///
/// # Safety
/// `callback` is 0 or the address of a function of type [`SinkFn`] that stays callable for as
/// long as it is registered (until replaced or removed and its call under way, if any, has
/// returned, or until the process ends), does not unwind, and must not call into a kvlink
/// engine.
pub unsafe fn set_sink(level: u8, callback: usize) -> Result<bool> {
    if level > 5 {
        return Err(Error::invalid(format!(
            "log level {level}: use 0 (off), 1 (error) .. 5 (trace)"
        )));
    }
    let level = if callback == 0 { 0 } else { level };
    // The level is stored with the sink, under the queue's lock: a removal and a registration
    // at once end as one of them last, never the level on with no sink.
    if level != 0 {
        delivery::start(callback, level)
            .map_err(|e| Error::new(ErrorKind::Internal, format!("no log thread: {e}")))?;
    } else {
        delivery::stop();
    }
    let ours = init();
    // Callsites cached their interest under the old level: ask every one again (this also
    // recomputes the global max level from the subscriber's hint).
    tracing_core::callsite::rebuild_interest_cache();
    Ok(ours)
}

/// The stderr layer's filter: `KVLINK_LOG`'s `EnvFilter`, and nothing while a sink is set.
struct StderrFilter(EnvFilter);

impl<S: Subscriber + for<'a> LookupSpan<'a>> Filter<S> for StderrFilter {
    fn enabled(&self, meta: &Metadata<'_>, cx: &Context<'_, S>) -> bool {
        !sink_active() && Filter::<S>::enabled(&self.0, meta, cx)
    }

    fn callsite_enabled(&self, meta: &'static Metadata<'static>) -> Interest {
        if sink_active() {
            Interest::never()
        } else {
            Filter::<S>::callsite_enabled(&self.0, meta)
        }
    }

    fn max_level_hint(&self) -> Option<LevelFilter> {
        if sink_active() {
            Some(LevelFilter::OFF)
        } else {
            Filter::<S>::max_level_hint(&self.0)
        }
    }

    fn on_new_span(
        &self,
        attrs: &tracing::span::Attributes<'_>,
        id: &tracing::span::Id,
        cx: Context<'_, S>,
    ) {
        Filter::<S>::on_new_span(&self.0, attrs, id, cx)
    }

    fn on_record(
        &self,
        id: &tracing::span::Id,
        values: &tracing::span::Record<'_>,
        cx: Context<'_, S>,
    ) {
        Filter::<S>::on_record(&self.0, id, values, cx)
    }

    fn on_enter(&self, id: &tracing::span::Id, cx: Context<'_, S>) {
        Filter::<S>::on_enter(&self.0, id, cx)
    }

    fn on_exit(&self, id: &tracing::span::Id, cx: Context<'_, S>) {
        Filter::<S>::on_exit(&self.0, id, cx)
    }

    fn on_close(&self, id: tracing::span::Id, cx: Context<'_, S>) {
        Filter::<S>::on_close(&self.0, id, cx)
    }
}

/// The sink layer's filter: events at or above the sink's level; everything off with no sink.
struct SinkLevel;

impl SinkLevel {
    fn wants(meta: &Metadata<'_>) -> bool {
        meta.is_event() && *meta.level() <= sink_filter()
    }
}

impl<S> Filter<S> for SinkLevel {
    fn enabled(&self, meta: &Metadata<'_>, _: &Context<'_, S>) -> bool {
        Self::wants(meta)
    }

    fn callsite_enabled(&self, meta: &'static Metadata<'static>) -> Interest {
        if Self::wants(meta) {
            Interest::always()
        } else {
            Interest::never()
        }
    }

    fn max_level_hint(&self) -> Option<LevelFilter> {
        Some(sink_filter())
    }
}

/// An event's message and its other fields as `k=v` text, in one string: the message first.
struct Text {
    text: String,
    message_len: usize,
}

impl Visit for Text {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.message(format_args!("{value}"));
        } else {
            self.push(field, format_args!("{value}"));
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            self.message(format_args!("{value:?}"));
        } else {
            self.push(field, format_args!("{value:?}"));
        }
    }
}

impl Text {
    fn new() -> Self {
        Text {
            // Most events fit: one allocation per record.
            text: String::with_capacity(160),
            message_len: 0,
        }
    }

    /// Sets the message. A control character in it (a newline, an escape) is written escaped
    /// (`\n`, `\u{1b}`): the sink's host writes a record as one line, and some of what is
    /// logged comes from peers (a peer's name, up to 256 bytes of its choosing), which must not
    /// forge a line of their own or a terminal's colours.
    fn message(&mut self, value: std::fmt::Arguments<'_>) {
        use std::fmt::Write;
        if self.text.len() == self.message_len {
            let _ = write!(self.text, "{value}");
            escape_controls(&mut self.text, 0);
            self.message_len = self.text.len();
        } else {
            // A message recorded after fields (the macros record it first).
            let mut m = value.to_string();
            escape_controls(&mut m, 0);
            self.text.insert_str(self.message_len, &m);
            self.message_len += m.len();
        }
    }

    /// Appends ` name=value`; a value that is empty or holds a space, a double quote, a
    /// backslash or a `=` is written in double quotes, its quotes and backslashes escaped with
    /// a backslash (`key="req 2#0"`), and its control characters as in [`Text::message`], so
    /// that the fields split on spaces and `=` whatever a value displays as.
    fn push(&mut self, field: &Field, value: std::fmt::Arguments<'_>) {
        use std::fmt::Write;
        if self.text.len() > self.message_len {
            self.text.push(' ');
        }
        let _ = write!(self.text, "{}=", field.name());
        let at = self.text.len();
        let _ = write!(self.text, "{value}");
        let plain = self.text.len() > at
            && !self.text[at..]
                .chars()
                .any(|c| c.is_whitespace() || c.is_control() || matches!(c, '"' | '\\' | '='));
        if !plain {
            let raw = self.text.split_off(at);
            self.text.push('"');
            for c in raw.chars() {
                if matches!(c, '"' | '\\') {
                    self.text.push('\\');
                }
                if c.is_control() {
                    self.text.extend(c.escape_default());
                } else {
                    self.text.push(c);
                }
            }
            self.text.push('"');
        }
    }
}

/// Writes each control character of `text[from..]` escaped (`\n`, `\u{1b}`), in place; costs a
/// scan when there is none.
fn escape_controls(text: &mut String, from: usize) {
    if !text[from..].chars().any(char::is_control) {
        return;
    }
    let raw = text.split_off(from);
    for c in raw.chars() {
        if c.is_control() {
            text.extend(c.escape_default());
        } else {
            text.push(c);
        }
    }
}

/// Queues each event for the host's sink.
struct SinkLayer;

impl<S: Subscriber> Layer<S> for SinkLayer {
    fn on_event(&self, event: &Event<'_>, _: Context<'_, S>) {
        let meta = event.metadata();
        if !SinkLevel::wants(meta) || IN_SINK.with(|b| b.replace(true)) {
            return;
        }
        // A panic while formatting (a field's Display) must not reach the code that logged;
        // the record is lost, and counted as dropped.
        let formatted = catch_unwind(AssertUnwindSafe(|| {
            let mut text = Text::new();
            event.record(&mut text);
            delivery::push(delivery::Record {
                level: level_code(meta.level()),
                target: meta.target(),
                text: text.text,
                message_len: text.message_len,
            });
        }));
        if formatted.is_err() {
            delivery::count_dropped();
        }
        IN_SINK.with(|b| b.set(false));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use parking_lot::Mutex;

    static SEEN: Mutex<Vec<(u8, String, String, String)>> = Mutex::new(Vec::new());

    unsafe extern "C" fn collect(
        level: u8,
        t: *const u8,
        tl: usize,
        m: *const u8,
        ml: usize,
        f: *const u8,
        fl: usize,
    ) {
        let s = |p: *const u8, n: usize| {
            // SAFETY: the layer passes valid UTF-8 ranges for the call.
            String::from_utf8_lossy(unsafe { std::slice::from_raw_parts(p, n) }).into_owned()
        };
        let message = s(m, ml);
        if message == "flush from inside" {
            // Nothing is pending but the record being delivered: flush says so.
            let flushed = flush(std::time::Instant::now());
            SEEN.lock()
                .push((level, s(t, tl), format!("flushed {flushed}"), s(f, fl)));
            return;
        }
        SEEN.lock().push((level, s(t, tl), message, s(f, fl)));
    }

    #[test]
    fn a_sink_gets_events_at_or_above_its_level_with_their_fields() {
        // SAFETY: `collect` is a SinkFn that never unwinds and lives for the whole process.
        let ours = unsafe { set_sink(2, collect as SinkFn as usize) }.unwrap();
        if !ours {
            return; // another test binary installed a subscriber of its own first
        }
        tracing::info!(request = 7u64, "below the sink's level");
        tracing::warn!(
            request = 7u64,
            generation = 3u32,
            key = %"req 7#3",
            why = "a \"quote\" and a \\",
            name = "two\nlines",
            colour = "x\u{1b}[31m",
            empty = "",
            "request ended {}",
            "TimedOut"
        );
        assert!(flush(
            std::time::Instant::now() + std::time::Duration::from_secs(10)
        ));
        tracing::warn!(request = 9u64, "flush from inside");
        assert!(flush(
            std::time::Instant::now() + std::time::Duration::from_secs(10)
        ));
        // A field whose formatting panics: the record is lost, counted as dropped, and the
        // code that logged goes on (were the stderr layer on, it would format it too).
        if std::env::var_os(ENV).is_none() {
            struct Panics;
            impl std::fmt::Display for Panics {
                fn fmt(&self, _: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                    panic!("a field that cannot be formatted");
                }
            }
            let before = records_dropped();
            tracing::warn!(request = 10u64, bad = %Panics, "formatting panics");
            assert!(records_dropped() > before, "the lost record is counted");
        }
        // SAFETY: removing the sink.
        unsafe { set_sink(0, 0) }.unwrap();
        tracing::warn!(request = 8u64, "after removal");
        let seen = SEEN.lock().clone();
        let ours: Vec<_> = seen
            .iter()
            .filter(|e| {
                e.3.contains("request=7")
                    || e.3.contains("request=8")
                    || e.3.starts_with("request=10 ")
            })
            .collect();
        // A flush from inside the sink with nothing queued behind the record it delivers says
        // nothing is pending (it said false for ever: the record under way counted as
        // pending). Another test's record queued meanwhile would make it false rightly: then
        // one must have come after it.
        let at = seen
            .iter()
            .position(|e| e.3 == "request=9")
            .unwrap_or_else(|| panic!("{seen:?}"));
        let others_after = seen[at + 1..].iter().any(|e| !e.3.starts_with("request="));
        assert!(
            seen[at].2 == "flushed true" || others_after,
            "a flush from inside the sink: {seen:?}"
        );
        assert_eq!(ours.len(), 1, "{seen:?}");
        let (level, target, message, fields) = ours[0];
        assert_eq!(*level, 2);
        assert_eq!(target, "kvlink::log::tests");
        assert_eq!(message, "request ended TimedOut");
        assert_eq!(
            fields,
            r#"request=7 generation=3 key="req 7#3" why="a \"quote\" and a \\" name="two\nlines" colour="x\u{1b}[31m" empty="""#
        );
        assert!(set_sink_invalid_level_is_refused());
    }

    /// A message's control characters (a peer's name with a newline or a terminal escape in
    /// it) are written escaped: the host writes a record as one line.
    #[test]
    fn control_characters_in_a_message_are_escaped() {
        let mut t = Text::new();
        t.message(format_args!(
            "rank 3 ({}) connected",
            "x\nERROR fake\u{1b}[31m"
        ));
        assert_eq!(t.text, r"rank 3 (x\nERROR fake\u{1b}[31m) connected");
        assert_eq!(t.message_len, t.text.len());
    }

    fn set_sink_invalid_level_is_refused() -> bool {
        // SAFETY: refused before anything is stored.
        unsafe { set_sink(9, collect as SinkFn as usize) }.is_err()
    }
}
