//! The two sides of a measurement, each run in a process of its own (`kvlink-bench peer ...`).
//!
//! Whole requests: the context side (`ctx`) listens and prints its address; the generation
//! side (`gen`) connects, then advertises requests (one buffer each), waits on them and checks
//! every byte: one at a time, or with N in flight at all times (a window: as the oldest ends,
//! its buffer is checked and advertised again). The context side accepts and sends each
//! advertised request from a few threads and waits on its sender outcome from another.
//!
//! Transport row: `tr-recv` listens and receives one tagged transfer at a time; `tr-send`
//! sends one at a time and times from the first measured send to the receiver's "done".
//!
//! Each side reports on standard output, one line each: `ADDR <address>` (listening sides),
//! `P <done> <planned>` (progress), and its [`PeerResult`] as JSON after `RESULT` (measuring
//! side) or `CTX`/`TR` (listening side). A watchdog ends the process at its time limit with
//! what it has counted so far: no engine wait can keep it past the row's limit.
use crate::cli::{PeerArgs, PeerRole, Source, Transport};
use crate::hugebuf::{Backing, HugeBuf};
use crate::report::{percentile, PeerResult, Round};
use kvlink::connection::{BufferSpec, Engine, EngineConfig};
use kvlink::proto::{RankId, RequestKey, Role};
use kvlink::transport::{Agent, AgentOptions, Event, PeerId};
use kvlink::Outcome;
use std::collections::{HashMap, VecDeque};
use std::fmt::Display;
use std::io::{Read, Write};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

pub const CTX_RANK: u32 = 0;
pub const GEN_RANK: u32 = 1;
/// How often a side reports progress.
const PROGRESS_EVERY: Duration = Duration::from_millis(100);
/// The listening side may have started this much before the measuring side.
const LISTENER_SLACK: Duration = Duration::from_secs(2);
/// Longest wait for the connection itself.
const CONNECT_LIMIT: Duration = Duration::from_secs(20);

pub fn run(a: &PeerArgs) -> i32 {
    match a.role {
        PeerRole::Gen => gen(a),
        PeerRole::Ctx => ctx(a),
        PeerRole::TrRecv => tr_recv(a),
        PeerRole::TrSend => tr_send(a),
    }
}

fn say(line: impl Display) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

/// A side's counters, shared with its watchdog.
#[derive(Clone)]
struct Shared {
    result: Arc<Mutex<PeerResult>>,
    /// The final report is out: the watchdog then only ends the process.
    done: Arc<AtomicBool>,
    /// The engine, for the watchdog's report of its health (weak: the watchdog must not keep
    /// it alive past the buffers it receives into).
    engine: Arc<Mutex<Weak<Engine>>>,
}

impl Shared {
    fn new(planned: u64) -> Shared {
        Shared {
            result: Arc::new(Mutex::new(PeerResult {
                planned,
                ..PeerResult::default()
            })),
            done: Arc::default(),
            engine: Arc::new(Mutex::new(Weak::new())),
        }
    }
    fn watch_engine(&self, e: &Arc<Engine>) {
        *self.engine.lock().unwrap_or_else(|p| p.into_inner()) = Arc::downgrade(e);
    }
    /// `health()` of the engine, unless it takes longer than `limit` (a wedged engine).
    fn health(&self, limit: Duration) -> Option<String> {
        let e = self
            .engine
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .upgrade()?;
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(format!("{:?}", e.health()));
        });
        Some(
            rx.recv_timeout(limit)
                .unwrap_or_else(|_| format!("health() did not return within {limit:?}")),
        )
    }
    fn lock(&self) -> MutexGuard<'_, PeerResult> {
        self.result.lock().unwrap_or_else(|p| p.into_inner())
    }
    fn report(&self, tag: &str) {
        let json = serde_json::to_string(&*self.lock()).unwrap_or_else(|e| format!("{{}} {e}"));
        say(format!("{tag} {json}"));
    }
    fn report_final(&self, tag: &str) {
        let r = self.lock();
        if self.done.swap(true, Ordering::AcqRel) {
            return;
        }
        let json = serde_json::to_string(&*r).unwrap_or_else(|e| format!("{{}} {e}"));
        drop(r);
        say(format!("{tag} {json}"));
    }
    /// Ends the process at `at`, first reporting the counts so far if it has not reported.
    fn watchdog(&self, at: Instant, tag: &'static str) {
        let me = self.clone();
        std::thread::spawn(move || {
            std::thread::sleep(at.saturating_duration_since(Instant::now()));
            if !me.done.load(Ordering::Acquire) {
                let health = me.health(Duration::from_millis(500));
                let mut r = me.lock();
                r.stopped_at_limit = true;
                if let Some((mut round, t0)) = r.current.take() {
                    round.us_per_request =
                        t0.elapsed().as_secs_f64() * 1e6 / round.requests.max(1) as f64;
                    r.rounds.push(round);
                }
                r.health = r.health.take().or(health);
                drop(r);
                me.report_final(tag);
            }
            std::process::exit(3);
        });
    }
}

/// Holds the process (and its engine or agent) until the bench closes our standard input:
/// the other side may still be finishing requests with us.
/// With `KVLINK_TIMELINE` set, writes this process's stage marks there
/// (`scripts/timeline.sh`); a build without the `timeline` feature says so on stderr.
fn dump_timeline() {
    let Some(path) = std::env::var_os("KVLINK_TIMELINE") else {
        return;
    };
    if !kvlink::timeline::ENABLED {
        eprintln!(
            "KVLINK_TIMELINE is set, but this kvlink-bench was built without --features timeline"
        );
        return;
    }
    if let Err(e) = kvlink::timeline::dump(std::path::Path::new(&path)) {
        eprintln!("timeline dump to {}: {e}", path.to_string_lossy());
    }
}

fn linger() {
    let mut sink = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut sink);
}

/// What the transfers of `len` bytes are cut from ([`cut`]): `len + 1` position-dependent
/// bytes, each different from the next (their lowest bits alternate). One buffer serves both
/// patterns, so the sending side keeps one source per size hot, as `ucx_perftest` does.
pub fn pattern_base(len: usize, backing: Backing) -> HugeBuf {
    // On the pages of a buffer of `len`, as `ucx_perftest`'s source of that size.
    let mut base = HugeBuf::zeroed_on(len + 1, len, backing);
    for (i, b) in base.iter_mut().enumerate() {
        *b = ((i as u32).wrapping_mul(2_654_435_761) >> 24) as u8 & 0xfe | (i & 1) as u8;
    }
    base
}

/// Pattern `ix` (0 or 1) of a base made by [`pattern_base`]: the two start one byte apart and
/// so differ in every byte, and a buffer that still holds the previous request's data is caught.
pub fn cut(base: &[u8], ix: usize) -> &[u8] {
    let len = base.len().saturating_sub(1);
    let ix = ix.min(1);
    &base[ix..ix + len]
}

/// Bytes between the words that a sampled check compares.
const SAMPLE_STRIDE: usize = 4096;

/// Whether `buf` holds `want`: every byte, or (`full` false) one 8-byte word per
/// [`SAMPLE_STRIDE`] and the last 8 bytes. The two patterns differ in every byte, so a sample still
/// catches a request that completed without its data landing, or with a page of it missing.
fn holds(buf: &[u8], want: &[u8], full: bool) -> bool {
    if buf.len() != want.len() {
        return false;
    }
    if full {
        return buf == want;
    }
    let word = |at: usize| {
        let end = (at + 8).min(buf.len());
        buf[at..end] == want[at..end]
    };
    (0..buf.len()).step_by(SAMPLE_STRIDE).all(word) && word(buf.len().saturating_sub(8))
}

/// The context side's pattern bases by length, made once and shared by its sender threads.
type PatternCache = Mutex<HashMap<u64, Arc<HugeBuf>>>;

fn kind_name(e: &kvlink::Error) -> String {
    format!("{:?}", e.kind)
}

/// How a wait that did not complete is counted.
fn not_completed(r: &kvlink::Result<Outcome>) -> String {
    match r {
        Ok(o) => format!("{o:?}"),
        Err(e) => format!("wait error {}", kind_name(e)),
    }
}

/// Generation side: advertise N, wait on all, check the bytes; round after round.
fn gen(a: &PeerArgs) -> i32 {
    let limit = Duration::from_millis(a.limit_ms);
    let deadline = Instant::now() + limit;
    let st = Shared::new(a.planned());
    st.watchdog(deadline + Duration::from_secs(1), "RESULT");
    let finish = |code: i32| {
        st.report_final("RESULT");
        code
    };
    let (Ok(size), Ok(n)) = (usize::try_from(a.size), usize::try_from(a.inflight)) else {
        st.lock().error("size or in-flight count too large");
        return finish(2);
    };
    let Some(addr) = a.peer.as_deref() else {
        st.lock().error("--peer is required");
        return finish(2);
    };
    // Declared before the engine, so dropped after it: by then nothing is posted into them.
    let mem = a.transport.backing();
    let mut bufs: Vec<HugeBuf> = (0..n)
        .map(|_| HugeBuf::zeroed_on(size, size, mem))
        .collect();
    let base = pattern_base(size, mem);
    let patterns = [cut(&base, 0), cut(&base, 1)];
    let mut cfg = EngineConfig::new("bench-gen", GEN_RANK, a.transport.kind());
    cfg.timeout = limit;
    let engine = match Engine::new(cfg) {
        Ok(e) => Arc::new(e),
        Err(e) => {
            st.lock().error(format!("engine: {e}"));
            return finish(1);
        }
    };
    st.watch_engine(&engine);
    if let Some(m) = &a.metrics_listen {
        match std::net::TcpListener::bind(m.as_str()) {
            Ok(l) => kvlink::metrics_http::serve(Arc::downgrade(&engine), l),
            Err(e) => {
                st.lock().error(format!("--metrics-listen {m}: {e}"));
                return finish(2);
            }
        }
    }
    let ctx = match engine.connect(addr, (Instant::now() + CONNECT_LIMIT).min(deadline)) {
        Ok(r) => r,
        Err(e) => {
            st.lock().error(format!("connect: {e}"));
            return finish(1);
        }
    };

    let mut t = Tally {
        planned: a.planned(),
        ..Tally::default()
    };
    let row = Row {
        engine: &engine,
        st: &st,
        ctx,
        deadline,
    };
    if n == 1 {
        row.rounds(a, &mut bufs, &patterns, &mut t);
    } else {
        row.window(a, &mut bufs, &patterns, &mut t);
    }
    let Tally {
        planned,
        done,
        per_request_us,
        latency_us,
        bytes,
        secs,
        ..
    } = t;
    say(format!("P {done} {planned}"));
    {
        let mut s = st.lock();
        s.us_p50 = percentile(&per_request_us, 50.0);
        s.us_p99 = percentile(&per_request_us, 99.0);
        s.lat_p50 = percentile(&latency_us, 50.0);
        s.lat_p99 = percentile(&latency_us, 99.0);
        s.gbps = (secs > 0.0).then(|| bytes as f64 / secs / 1e9);
        s.health = Some(format!("{:?}", engine.health()));
    }
    dump_timeline();
    st.report_final("RESULT");
    linger();
    drop(engine);
    0
}

/// What the generation side measured.
#[derive(Default)]
struct Tally {
    planned: u64,
    done: u64,
    last_progress: Option<Instant>,
    /// Wall time per request of each measured round that completed whole and correct.
    per_request_us: Vec<f64>,
    /// Advertise to the end of the wait, each measured request that completed.
    latency_us: Vec<f64>,
    bytes: u64,
    secs: f64,
}

impl Tally {
    /// One more request waited for: reports progress now and then.
    fn ended(&mut self) {
        self.done += 1;
        let now = Instant::now();
        if self.last_progress.is_none_or(|t| now - t >= PROGRESS_EVERY) {
            self.last_progress = Some(now);
            say(format!("P {} {}", self.done, self.planned));
        }
    }
}

/// A buffer's request in flight: the buffer, the request's key and advertise time (None if
/// the advertise failed), and the index of its pattern.
type InFlight = (usize, Option<(RequestKey, Instant)>, usize);

/// The generation side of one row: its engine, the context rank, and the row's deadline.
struct Row<'a> {
    engine: &'a Engine,
    st: &'a Shared,
    ctx: RankId,
    deadline: Instant,
}

impl Row<'_> {
    /// Advertises `b` as request `key` (one segment from the context rank, which fills it with
    /// pattern `ix`); counts it. Returns when it was advertised, None if it failed.
    ///
    /// # Safety
    /// Nothing may touch `b` until `wait` for `key` has returned, and `b` must outlive the
    /// engine.
    unsafe fn advertise(&self, key: RequestKey, b: &mut [u8], ix: usize) -> Option<Instant> {
        let spec = BufferSpec::host(0, b);
        let at = Instant::now();
        // SAFETY: as this function's contract.
        let r = unsafe {
            self.engine.advertise(
                key,
                vec![RankId(GEN_RANK)],
                vec![(self.ctx, vec![spec])],
                vec![ix as u8],
            )
        };
        let mut s = self.st.lock();
        s.started += 1;
        match r {
            Ok(()) => Some(at),
            Err(e) => {
                s.fail(format!("advertise {}", kind_name(&e)));
                s.error(format!("advertise {key}: {e}"));
                None
            }
        }
    }

    /// Waits for `key` (advertised at `at`; None if its advertise failed); true if it
    /// completed. Counts it, and its latency when `measured`.
    fn wait(&self, sent: Option<(RequestKey, Instant)>, measured: bool, t: &mut Tally) -> bool {
        let Some((key, at)) = sent else {
            t.ended();
            return false;
        };
        let o = self.engine.wait(key, Role::Receiver, self.deadline, None);
        let now = Instant::now();
        let mut s = self.st.lock();
        if let Err(e) = &o {
            s.error(format!("wait {key}: {e}"));
        }
        let ok = matches!(o, Ok(Outcome::Completed));
        if ok {
            s.completed += 1;
            if let Some((r, _)) = s.current.as_mut() {
                r.completed += 1;
            }
            if measured {
                t.latency_us
                    .push(now.duration_since(at).as_secs_f64() * 1e6);
            }
        } else {
            s.fail(not_completed(&o));
        }
        drop(s);
        t.ended();
        ok
    }

    /// Starts a round's record (for the watchdog's report of a row cut short).
    fn begin_round(&self, n: usize, t0: Instant) {
        self.st.lock().current = Some((
            Round {
                requests: n as u64,
                ..Round::default()
            },
            t0,
        ));
    }

    /// Ends a round of `n` requests, `completed` of them whole and correct, taking `dt`.
    fn end_round(
        &self,
        n: usize,
        size: usize,
        completed: u64,
        dt: f64,
        measured: bool,
        t: &mut Tally,
    ) {
        let mut s = self.st.lock();
        s.current = None;
        s.rounds.push(Round {
            requests: n as u64,
            completed,
            us_per_request: dt * 1e6 / n as f64,
        });
        if measured && completed == n as u64 {
            t.per_request_us.push(dt * 1e6 / n as f64);
            t.bytes += (n * size) as u64;
            t.secs += dt;
        }
    }

    /// One request at a time: advertise, wait, then check the bytes (not timed): a sample of
    /// them in measured rounds, every byte in warm-up ones. Not timed is not free: a check of
    /// every byte of a 16 MiB request takes about 1.6 ms, in which both sides go idle and the
    /// buffers go cold, and a transfer started after 3 ms of idle takes 1.2-1.6 ms longer at
    /// 16 MiB on tcp even in the transport row (with sleeps between its sends), where
    /// `ucx_perftest` runs back to back.
    fn rounds(&self, a: &PeerArgs, bufs: &mut [HugeBuf], patterns: &[&[u8]; 2], t: &mut Tally) {
        let mut next_id = 1u64;
        for round in 0..a.warmup + a.rounds {
            if Instant::now() >= self.deadline {
                break;
            }
            let measured = round >= a.warmup;
            let seed_ix = (round % 2) as usize;
            let t0 = Instant::now();
            self.begin_round(bufs.len(), t0);
            let mut keys = Vec::with_capacity(bufs.len());
            for b in bufs.iter_mut() {
                let key = RequestKey::new(next_id, 0);
                next_id += 1;
                // SAFETY: every advertised key is waited for below before the round's bytes
                // are read, and the buffers outlive the engine.
                keys.push(unsafe { self.advertise(key, b, seed_ix) }.map(|at| (key, at)));
            }
            let landed: Vec<bool> = keys.iter().map(|&k| self.wait(k, measured, t)).collect();
            let dt = t0.elapsed().as_secs_f64();
            let corrupt = bufs
                .iter()
                .zip(&landed)
                .filter(|(b, &ok)| ok && !holds(b, patterns[seed_ix], !measured))
                .count() as u64;
            self.st.lock().corrupt += corrupt;
            let completed = landed.iter().filter(|&&ok| ok).count() as u64 - corrupt;
            self.end_round(bufs.len(), patterns[0].len(), completed, dt, measured, t);
            if a.gap_us > 0 {
                std::thread::sleep(Duration::from_micros(a.gap_us));
            }
        }
    }

    /// N requests in flight at all times, as `ucx_perftest -O N` keeps N operations
    /// outstanding: when the oldest ends, its bytes are checked and its buffer goes out again
    /// as a new request with the other pattern. Every N ends make a round, timed from the
    /// previous round's last end to its own, so a round's time includes the checks (done while
    /// the other requests move) and no start from idle. Warm-up rounds come first, and a
    /// trailing round keeps the window full to the end of the measured ones.
    ///
    /// The requests that end in a measured round get a sampled check ([`holds`]): a check of
    /// every byte reads twice the request's size on the cores that the transfers use (about
    /// 100 us per MiB here), which `ucx_perftest` does not pay and which cost this row 20-40%
    /// per request. Every byte of every other request (warm-up and trailing rounds) is checked.
    fn window(&self, a: &PeerArgs, bufs: &mut [HugeBuf], patterns: &[&[u8]; 2], t: &mut Tally) {
        let n = bufs.len();
        let total = a.planned();
        let mut next_id = 1u64;
        let mut queue: VecDeque<InFlight> = VecDeque::with_capacity(n);
        let mut uses = vec![0usize; n];
        let mut issue = |i: usize, b: &mut HugeBuf, queue: &mut VecDeque<_>| {
            let key = RequestKey::new(next_id, 0);
            next_id += 1;
            let seed_ix = uses[i] % 2;
            uses[i] += 1;
            // SAFETY: the buffer is read (checked) or advertised again only after its wait has
            // returned (the queue holds one request per buffer), and the buffers outlive the
            // engine.
            let sent = unsafe { self.advertise(key, b, seed_ix) }.map(|at| (key, at));
            queue.push_back((i, sent, seed_ix));
        };
        for (i, b) in bufs.iter_mut().enumerate() {
            issue(i, b, &mut queue);
        }
        let mut issued = n as u64;
        let mut ended = 0u64;
        let mut mark = Instant::now();
        let mut completed = 0u64;
        self.begin_round(n, mark);
        while let Some((i, sent, seed_ix)) = queue.pop_front() {
            let round = ended / n as u64;
            let measured = round >= a.warmup && round < a.warmup + a.rounds;
            let mut ok = self.wait(sent, measured, t);
            if ok && !holds(&bufs[i], patterns[seed_ix], !measured) {
                self.st.lock().corrupt += 1;
                ok = false;
            }
            completed += u64::from(ok);
            ended += 1;
            if ended.is_multiple_of(n as u64) {
                let now = Instant::now();
                let dt = now.duration_since(mark).as_secs_f64();
                self.end_round(n, patterns[0].len(), completed, dt, measured, t);
                (mark, completed) = (now, 0);
                if ended < total {
                    self.begin_round(n, mark);
                }
            }
            if issued < total && Instant::now() < self.deadline {
                issued += 1;
                issue(i, &mut bufs[i], &mut queue);
            }
        }
    }
}

/// Context side: accept and send every advertised request (several threads), wait on each
/// request's sender outcome (this thread).
fn ctx(a: &PeerArgs) -> i32 {
    let limit = Duration::from_millis(a.limit_ms);
    let deadline = Instant::now() + limit + LISTENER_SLACK;
    let st = Shared::new(a.planned());
    st.watchdog(deadline + Duration::from_secs(1), "CTX");
    let mut cfg = EngineConfig::new("bench-ctx", CTX_RANK, a.transport.kind());
    if a.transport == Transport::Tcp {
        cfg.listen = "127.0.0.1:0".parse().ok();
    }
    cfg.timeout = limit;
    let engine = match Engine::new(cfg) {
        Ok(e) => Arc::new(e),
        Err(e) => {
            st.lock().error(format!("engine: {e}"));
            st.report_final("CTX");
            return 1;
        }
    };
    st.watch_engine(&engine);
    say(format!("ADDR {}", engine.address()));

    let planned = a.planned();
    let taken = Arc::new(AtomicU64::new(0));
    let patterns: Arc<PatternCache> = Arc::default();
    let mem = a.transport.backing();
    let (tx, rx) = mpsc::channel::<(RequestKey, RankId)>();
    let senders: Vec<_> = (0..a.senders.max(1))
        .map(|_| {
            let (engine, taken, patterns, st, tx) = (
                engine.clone(),
                taken.clone(),
                patterns.clone(),
                st.clone(),
                tx.clone(),
            );
            std::thread::spawn(move || {
                while taken.load(Ordering::Acquire) < planned && Instant::now() < deadline {
                    let poll = (Instant::now() + Duration::from_millis(200)).min(deadline);
                    let Some(adv) = engine.next_advertisement(poll, None) else {
                        continue;
                    };
                    taken.fetch_add(1, Ordering::AcqRel);
                    if let Err(e) = engine.accept(adv.key, adv.from, true) {
                        let mut s = st.lock();
                        s.fail(format!("accept {}", kind_name(&e)));
                        s.error(format!("accept {}: {e}", adv.key));
                        continue;
                    }
                    let ix = usize::from(adv.request_info.first().copied().unwrap_or(0));
                    let send_by = (Instant::now() + limit).min(deadline);
                    for d in &adv.buffers {
                        let base = {
                            let mut p = patterns.lock().unwrap_or_else(|p| p.into_inner());
                            p.entry(d.len)
                                .or_insert_with(|| Arc::new(pattern_base(d.len as usize, mem)))
                                .clone()
                        };
                        let data = cut(&base, ix);
                        match engine.send(adv.key, adv.from, d.segment, data, send_by, None) {
                            Ok(Outcome::Completed) => {}
                            Ok(o) => {
                                st.lock().fail(format!("send {o:?}"));
                                break;
                            }
                            Err(e) => {
                                let mut s = st.lock();
                                s.fail(format!("send {}", kind_name(&e)));
                                s.error(format!("send {}: {e}", adv.key));
                                break;
                            }
                        }
                    }
                    let _ = tx.send((adv.key, adv.from));
                }
            })
        })
        .collect();
    drop(tx);
    let mut last_progress = Instant::now();
    for (key, from) in rx {
        let o = engine.wait(key, Role::Sender { receiver: from }, deadline, None);
        {
            let mut s = st.lock();
            s.started += 1;
            if let Err(e) = &o {
                s.error(format!("wait {key}: {e}"));
            }
            if matches!(o, Ok(Outcome::Completed)) {
                s.completed += 1;
            } else {
                s.fail(format!("wait {}", not_completed(&o)));
            }
        }
        if last_progress.elapsed() >= PROGRESS_EVERY {
            last_progress = Instant::now();
            st.report("CTX");
        }
    }
    for s in senders {
        let _ = s.join();
    }
    st.lock().health = Some(format!("{:?}", engine.health()));
    dump_timeline();
    st.report_final("CTX");
    0
}

fn agent(name: &str, t: Transport, listen: bool) -> kvlink::Result<Agent> {
    let mut o = AgentOptions::new(name, t.kind());
    if listen && t == Transport::Tcp {
        o.listen = "127.0.0.1:0".parse().ok();
    }
    Agent::new(o)
}

/// Transport row, receiving agent.
fn tr_recv(a: &PeerArgs) -> i32 {
    let limit = Duration::from_millis(a.limit_ms);
    let deadline = Instant::now() + limit + LISTENER_SLACK;
    let st = Shared::new(a.planned());
    st.watchdog(deadline + Duration::from_secs(1), "TR");
    let finish = |code: i32| {
        st.report_final("TR");
        code
    };
    let Ok(size) = usize::try_from(a.size) else {
        st.lock().error("size too large");
        return finish(2);
    };
    // Written once here, so that no page is first touched inside a timed transfer (the
    // warm-up is only a few transfers, fewer than the buffers may be).
    let mut bufs: Vec<HugeBuf> = (0..a.tr_buffers.max(1))
        .map(|_| {
            let mut b = HugeBuf::zeroed_on(size, size, a.transport.backing());
            b.fill(0);
            b
        })
        .collect();
    let agent = match agent("bench-tr-recv", a.transport, true) {
        Ok(x) => x,
        Err(e) => {
            st.lock().error(format!("agent: {e}"));
            return finish(1);
        }
    };
    match agent.listen_address() {
        Some(addr) => say(format!("ADDR {addr}")),
        None => say(format!(
            "ADDR {}{}",
            kvlink::proto::peers::WORKER_ADDRESS_PREFIX,
            hex::encode(agent.worker_address())
        )),
    }
    // The sender's first control message tells which peer it is.
    let peer: PeerId = loop {
        match agent.next_event(deadline, None) {
            Some(Event::Control(p, _)) => break p,
            Some(_) => continue,
            None => {
                st.lock().error("no sender connected");
                return finish(1);
            }
        }
    };
    let n = bufs.len() as u64;
    for i in 0..a.planned() {
        let buf = &mut bufs[(i % n) as usize];
        // SAFETY: `buf` outlives the op, which is waited (or stopped and reaped) right here.
        let r = unsafe { agent.post_recv(peer, i + 1, buf.as_mut_ptr(), size) }
            .and_then(|mut op| op.wait(deadline, None));
        let mut s = st.lock();
        s.started += 1;
        match r {
            Ok(Outcome::Completed) => s.completed += 1,
            Ok(o) => {
                s.fail(format!("recv {o:?}"));
                break;
            }
            Err(e) => {
                s.fail(format!("recv {}", kind_name(&e)));
                s.error(format!("recv: {e}"));
                break;
            }
        }
    }
    let sent = agent
        .send_control(peer, b"done".to_vec())
        .and_then(|mut op| op.wait(deadline, None));
    if let Err(e) = sent {
        st.lock().error(format!("done message: {e}"));
    }
    // The sender's "bye": it has the "done", so our agent may go.
    let bye_by = (Instant::now() + Duration::from_secs(5)).min(deadline);
    loop {
        match agent.next_event(bye_by, None) {
            Some(Event::Control(_, b)) if b == b"bye" => break,
            Some(_) => continue,
            None => {
                st.lock().error("the sender's bye did not come");
                break;
            }
        }
    }
    finish(0)
}

/// Transport row, sending agent: one transfer in flight, timed to the receiver's "done".
fn tr_send(a: &PeerArgs) -> i32 {
    let limit = Duration::from_millis(a.limit_ms);
    let deadline = Instant::now() + limit;
    let st = Shared::new(a.planned());
    st.watchdog(deadline + Duration::from_secs(1), "RESULT");
    let finish = |code: i32| {
        st.report_final("RESULT");
        code
    };
    let Ok(size) = usize::try_from(a.size) else {
        st.lock().error("size too large");
        return finish(2);
    };
    let Some(addr) = a.peer.as_deref() else {
        st.lock().error("--peer is required");
        return finish(2);
    };
    // Never written when untouched: the kernel's copies read the huge zero page, as they do
    // for ucx_perftest's sender (`--tr-source`).
    let base = match a.tr_source {
        Source::Untouched => HugeBuf::zeroed_on(size + 1, size, a.transport.backing()),
        Source::Pattern => pattern_base(size, a.transport.backing()),
    };
    let data = cut(&base, 0);
    let agent = match agent("bench-tr-send", a.transport, false) {
        Ok(x) => x,
        Err(e) => {
            st.lock().error(format!("agent: {e}"));
            return finish(1);
        }
    };
    let peer = match addr.strip_prefix(kvlink::proto::peers::WORKER_ADDRESS_PREFIX) {
        Some(h) => match hex::decode(h) {
            Ok(bytes) => agent.connect_worker(&bytes),
            Err(e) => {
                st.lock().error(format!("worker address: {e}"));
                return finish(2);
            }
        },
        None => match addr.parse() {
            Ok(sa) => agent.connect(sa),
            Err(e) => {
                st.lock().error(format!("address {addr}: {e}"));
                return finish(2);
            }
        },
    }
    .and_then(|p| {
        agent
            .send_control(p, b"hi".to_vec())
            .and_then(|mut op| op.wait(deadline, None))
            .map(|_| p)
    });
    let peer = match peer {
        Ok(p) => p,
        Err(e) => {
            st.lock().error(format!("connect: {e}"));
            return finish(1);
        }
    };
    let total = a.planned();
    let warm = a.warmup * a.inflight;
    let mut op_us = Vec::new();
    let mut t0 = Instant::now();
    let mut last_progress = Instant::now();
    for i in 0..total {
        if i == warm {
            t0 = Instant::now();
        }
        let ts = Instant::now();
        // SAFETY: `data` outlives the op, which is waited (or stopped and reaped) right here.
        let r = unsafe { agent.post_send(peer, i + 1, data.as_ptr(), size) }
            .and_then(|mut op| op.wait(deadline, None));
        let mut s = st.lock();
        s.started += 1;
        match r {
            Ok(Outcome::Completed) => {
                s.completed += 1;
                if i >= warm {
                    op_us.push(ts.elapsed().as_secs_f64() * 1e6);
                }
            }
            Ok(o) => {
                s.fail(format!("send {o:?}"));
                break;
            }
            Err(e) => {
                s.fail(format!("send {}", kind_name(&e)));
                s.error(format!("send: {e}"));
                break;
            }
        }
        drop(s);
        if last_progress.elapsed() >= PROGRESS_EVERY {
            last_progress = Instant::now();
            say(format!("P {} {total}", i + 1));
        }
    }
    let all = st.lock().completed == total;
    // The receiver's "done": every byte has landed there.
    let landed = loop {
        match agent.next_event(deadline, None) {
            Some(Event::Control(_, b)) if b == b"done" => break Some(Instant::now()),
            Some(_) => continue,
            None => break None,
        }
    };
    if landed.is_some() {
        let bye = agent
            .send_control(peer, b"bye".to_vec())
            .and_then(|mut op| op.wait(deadline, None));
        if let Err(e) = bye {
            st.lock().error(format!("bye message: {e}"));
        }
    }
    let mut s = st.lock();
    match landed {
        Some(t1) if all && total > warm => {
            let secs = t1.duration_since(t0).as_secs_f64();
            s.gbps = Some(((total - warm) * a.size) as f64 / secs / 1e9);
            s.us_p50 = percentile(&op_us, 50.0);
            s.us_p99 = percentile(&op_us, 99.0);
            s.rounds.push(Round {
                requests: total - warm,
                completed: total - warm,
                us_per_request: secs * 1e6 / (total - warm) as f64,
            });
        }
        Some(_) => {}
        None => s.error("the receiver's done message did not come"),
    }
    drop(s);
    st.report_final("RESULT");
    linger();
    0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sampled_check_catches_stale_data_a_missing_page_and_a_short_tail() {
        let base = pattern_base(1 << 20, Backing::Thp);
        let want = cut(&base, 0).to_vec();
        assert!(holds(&want.clone(), &want, false));
        // The previous request's data (the other pattern), left where nothing landed.
        assert!(!holds(cut(&base, 1), &want, false));
        let mut page_missing = want.clone();
        page_missing[5 * SAMPLE_STRIDE..6 * SAMPLE_STRIDE].fill(0xaa);
        assert!(!holds(&page_missing, &want, false));
        let mut tail = want.clone();
        let n = tail.len();
        tail[n - 3] ^= 1;
        assert!(!holds(&tail, &want, false));
        // Between the samples only the full check sees a difference.
        let mut between = want.clone();
        between[SAMPLE_STRIDE + 100] ^= 1;
        assert!(holds(&between, &want, false));
        assert!(!holds(&between, &want, true));
        // Shorter than a word, and of another length.
        assert!(holds(&want[..5], &want[..5], false));
        assert!(!holds(&want[..5], &want[..6], false));
    }

    #[test]
    fn the_two_patterns_differ_everywhere_and_are_cut_from_one_base() {
        for len in [1, 2, 7, 4096, 1 << 20] {
            let base = pattern_base(len, Backing::Thp);
            let (a, b) = (cut(&base, 0), cut(&base, 1));
            assert_eq!((a.len(), b.len()), (len, len));
            assert!(a.iter().zip(b).all(|(x, y)| x != y), "len {len}");
            assert_eq!(a.as_ptr_range().end, b.as_ptr_range().end.wrapping_sub(1));
        }
        let base = pattern_base(4096, Backing::Thp);
        assert_ne!(base[..256], base[256..512], "position-dependent");
    }

    #[test]
    fn a_source_lies_on_the_pages_of_its_transfer_size_not_one_byte_more() {
        // UCX leaves ucx_perftest's 1 MiB buffers on small pages (a huge page would double
        // them); the pattern base is one byte longer and must not tip over onto a huge page.
        assert!(!pattern_base(1 << 20, Backing::Thp).huge());
        assert!(!HugeBuf::zeroed_as((1 << 20) + 1, 1 << 20).huge());
        assert!(pattern_base(16 << 20, Backing::Thp).huge());
        assert!(!pattern_base(4096, Backing::Thp).huge());
    }
}
