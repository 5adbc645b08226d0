//! Opt-in timestamps at the stages of a request's data path, to see where a small request's
//! microseconds go (cargo feature `timeline`; without it every mark compiles to nothing).
//!
//! A mark is one read of `CLOCK_MONOTONIC` (one clock for every process of a host, so the marks
//! of a generation and a context process line up) and one store into a process-wide buffer of
//! [`CAPACITY`] marks; later marks are dropped. [`dump`] writes them as `nanoseconds stage`
//! lines. `scripts/timeline.sh` runs a pair of `kvlink-bench peer` processes built with the
//! feature and prints, stage by stage, the median time a request spends between them. A mark
//! costs about 30-50 ns here, so a request of a dozen marks reads about half a microsecond
//! slower than without them.

/// A point in a request's path (where it is marked).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Stage {
    /// `Engine::advertise_with` entered.
    AdvertiseCalled = 1,
    /// Its `Advertise` handed to UCX (its receives not yet posted).
    AdvertiseSent,
    /// A tagged receive handed to UCX (`ucp_tag_recv_nbx`).
    RecvPosted,
    /// `Engine::advertise_with` returns.
    AdvertiseReturned,
    /// `Engine::wait` entered.
    WaitCalled,
    /// `Engine::wait` returns.
    WaitReturned,
    /// A control message's active message arrived (UCX callback).
    ControlArrived,
    /// The protocol core has handled a control message (engine sink).
    ControlHandled,
    /// `Engine::next_advertisement` returns one.
    AdvertisementTaken,
    /// `Engine::accept` returns.
    AcceptReturned,
    /// A tagged send handed to UCX (`ucp_tag_send_nbx`).
    SendPosted,
    /// A tagged send completed (UCX callback).
    SendDone,
    /// `Engine::send_segments` returns.
    SendReturned,
    /// A tagged receive completed: its data landed (UCX callback).
    DataLanded,
    /// The protocol core has handled a landing (engine sink).
    LandingHandled,
    /// The engine sink has flushed the core's output (control messages queued for UCX, actions
    /// applied, events recorded) and lets go of the core.
    SinkFlushed,
    /// The engine sink is called with a progress pass's events.
    SinkEntered,
    /// The engine sink has handled its events and the core's due timers.
    TimersHandled,
    /// A pass that ran the sink has handed the control messages it queued to UCX (on tcp, their
    /// `sendmsg`).
    ControlSent,
}

impl Stage {
    /// Every stage, in the order of their numbers (1, 2, ...).
    pub const ALL: [Stage; 19] = [
        Stage::AdvertiseCalled,
        Stage::AdvertiseSent,
        Stage::RecvPosted,
        Stage::AdvertiseReturned,
        Stage::WaitCalled,
        Stage::WaitReturned,
        Stage::ControlArrived,
        Stage::ControlHandled,
        Stage::AdvertisementTaken,
        Stage::AcceptReturned,
        Stage::SendPosted,
        Stage::SendDone,
        Stage::SendReturned,
        Stage::DataLanded,
        Stage::LandingHandled,
        Stage::SinkFlushed,
        Stage::SinkEntered,
        Stage::TimersHandled,
        Stage::ControlSent,
    ];
}

/// Marks `stage` when dropped: for a function's return, whichever way it returns.
#[must_use]
pub struct OnReturn(#[cfg_attr(not(feature = "timeline"), allow(dead_code))] Stage);

#[cfg(feature = "timeline")]
impl Drop for OnReturn {
    fn drop(&mut self) {
        mark(self.0);
    }
}

/// Marks `stage` when the returned guard is dropped.
#[inline(always)]
pub fn on_return(stage: Stage) -> OnReturn {
    OnReturn(stage)
}

/// Marks `called` now and `returned` when the guard is dropped: a function's whole call.
#[inline(always)]
pub fn span(called: Stage, returned: Stage) -> OnReturn {
    mark(called);
    on_return(returned)
}

/// Whether this build records marks.
pub const ENABLED: bool = cfg!(feature = "timeline");

/// Marks kept per process.
pub const CAPACITY: usize = 1 << 20;

#[cfg(feature = "timeline")]
mod imp {
    use super::{Stage, CAPACITY};
    use std::io::Write;
    use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

    static NEXT: AtomicUsize = AtomicUsize::new(0);
    static MARKS: [AtomicU64; CAPACITY] = [const { AtomicU64::new(0) }; CAPACITY];

    pub fn mark(stage: Stage) {
        let mut t = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: a valid timespec to fill; CLOCK_MONOTONIC always exists on Linux.
        unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut t) };
        let ns = t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64;
        let i = NEXT.fetch_add(1, Ordering::Relaxed);
        if let Some(slot) = MARKS.get(i) {
            // 2^56 ns is over two years of uptime: the stage fits in the low byte.
            slot.store((ns << 8) | stage as u64, Ordering::Relaxed);
        }
    }

    pub fn dump(path: &std::path::Path) -> std::io::Result<usize> {
        let n = NEXT.load(Ordering::Relaxed).min(CAPACITY);
        let mut f = std::io::BufWriter::new(std::fs::File::create(path)?);
        for m in &MARKS[..n] {
            let v = m.load(Ordering::Relaxed);
            // The variant's name (`Debug`), as scripts/timeline.py reads it.
            match Stage::ALL.get(((v & 0xff) as usize).wrapping_sub(1)) {
                Some(stage) => writeln!(f, "{} {stage:?}", v >> 8)?,
                None => writeln!(f, "{} ?", v >> 8)?,
            }
        }
        f.flush()?;
        Ok(n)
    }
}

#[cfg(not(feature = "timeline"))]
mod imp {
    use super::Stage;

    #[inline(always)]
    pub fn mark(_: Stage) {}

    pub fn dump(_: &std::path::Path) -> std::io::Result<usize> {
        Ok(0)
    }
}

/// Records that a request reached `stage` now (nothing without the `timeline` feature).
#[inline(always)]
pub fn mark(stage: Stage) {
    imp::mark(stage)
}

/// Writes this process's marks to `path` (`nanoseconds stage` lines, in the order taken);
/// returns how many. Without the feature: writes nothing, returns 0.
pub fn dump(path: &std::path::Path) -> std::io::Result<usize> {
    imp::dump(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stages_are_numbered_in_the_order_of_all() {
        for (i, s) in Stage::ALL.iter().enumerate() {
            assert_eq!(*s as usize, i + 1, "{s:?}");
        }
    }

    #[cfg(not(feature = "timeline"))]
    #[test]
    fn without_the_feature_nothing_is_kept_or_written() {
        const { assert!(!ENABLED) };
        drop(span(Stage::WaitCalled, Stage::WaitReturned));
        let path = std::env::temp_dir().join(format!("kvlink-timeline-off-{}", std::process::id()));
        assert_eq!(dump(&path).unwrap(), 0);
        assert!(!path.exists(), "no file is made");
    }

    #[cfg(feature = "timeline")]
    #[test]
    fn marks_are_dumped_in_order_with_their_names() {
        drop(span(Stage::WaitCalled, Stage::WaitReturned));
        let path = std::env::temp_dir().join(format!("kvlink-timeline-{}", std::process::id()));
        assert!(dump(&path).unwrap() >= 2);
        let text = std::fs::read_to_string(&path).unwrap();
        let _ = std::fs::remove_file(&path);
        let lines: Vec<(u64, &str)> = text
            .lines()
            .map(|l| {
                let (t, s) = l.split_once(' ').unwrap();
                (t.parse().unwrap(), s)
            })
            .collect();
        // Other tests of this process may mark in between.
        let i = lines.iter().position(|l| l.1 == "WaitCalled").unwrap();
        let j = i + lines[i..]
            .iter()
            .position(|l| l.1 == "WaitReturned")
            .unwrap();
        assert!(lines[j].0 >= lines[i].0);
    }
}
