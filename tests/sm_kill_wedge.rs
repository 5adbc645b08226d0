//! A shared-memory sender SIGKILLed mid-stream, and what it leaves the survivor (the known gap
//! in `docs/RELIABILITY.md`): UCX's posix/sysv transports give a worker one receive queue that
//! every sender writes into, slot by slot, and a sender killed between claiming a slot and
//! flagging it written leaves the queue stuck for good.
//!
//! Each round of the agent tests has a fresh survivor (an agent in this process) and
//! `kvlink-peer send` processes over `sm`:
//! - a flooder that sends 8000-byte tagged messages in a loop until it is SIGKILLed, so the
//!   kill often lands while it is writing into the survivor's receive queue;
//! - a healthy sender connected before the kill, whose data comes 300 ms after its go;
//! - a fresh sender started after the kill (unless the survivor already reports the queue
//!   stuck).
//!
//! In about one round in three here the queue sticks: the healthy sender's data and the fresh
//! sender's hello never arrive, together, which is what says it is the survivor's one queue.
//!
//! - `a_stuck_sm_receive_queue_is_found_and_reported` (CI): the agent's probe finds the stuck
//!   queue within about 2 s, fails its peers at once and refuses connects with a typed error;
//!   a round where everything got through must never be reported stuck.
//! - `an_engine_reports_its_stuck_receive_queue_in_health_and_metrics` (CI): the same seen
//!   through `Engine::health` and the metrics, checked against whether a new engine's
//!   handshake with it still completes.
//! - `survivor_of_a_killed_sm_sender_still_receives` (ignored, with its reason): the real fix,
//!   which is not built. Run it with
//!   `cargo test --release --test sm_kill_wedge -- --ignored --nocapture`.
//!
//! `WEDGE_ITERS=N` sets the rounds per test (default 6).
mod common;
use common::Proc;
use kvlink::transport::{Agent, AgentOptions, Event, Op, TransportKind};
use kvlink::Outcome;
use std::time::{Duration, Instant};

/// `kvlink-peer`'s tags: size number `i` in its `--sizes` goes with `TAG_BASE + i`.
const TAG_BASE: u64 = 0x5EED_0000_0000_0000;

/// How long after the kill a stuck queue must be reported. The probe needs about 2 s here
/// (a ping unseen for 1.5 s and 10 passes, pings every 0.5 s); the rest is room for a loaded
/// machine (the sanitizer run).
const FIND_WITHIN: Duration = Duration::from_secs(5);

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Serves one `kvlink-peer send` handshake: waits for its hello, posts a receive of `size`
/// bytes for `tag`, says go. None if no hello came within `within`.
fn serve(agent: &Agent, within: Duration, size: usize, tag: u64) -> Option<(Op, Vec<u8>)> {
    let deadline = Instant::now() + within;
    let peer = loop {
        match agent.next_event(deadline, None) {
            Some(Event::Control(p, _)) => break p,
            Some(_) => continue,
            None => return None,
        }
    };
    let mut buf = vec![0u8; size];
    // SAFETY: the buffer is returned with the op, and the caller waits the op before either
    // drops (or drops the op first, which stops and reaps it).
    let op = unsafe { agent.post_recv(peer, tag, buf.as_mut_ptr(), size) }.unwrap();
    let mut go = agent.send_control(peer, b"go".to_vec()).unwrap();
    let _ = go.wait(Instant::now() + Duration::from_secs(5), None);
    Some((op, buf))
}

fn sender(addr: &str, sizes: &str, mode: &str) -> Proc {
    Proc::peer(&[
        "send",
        "--transport",
        "sm",
        "--to",
        addr,
        "--sizes",
        sizes,
        "--mode",
        mode,
    ])
}

/// The tests of this file run one at a time: each spawns several processes, and the probe's
/// verdict must not be starved of CPU by another test's flood.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// Busy threads in this process while a flooder runs: a flooder that is often preempted is
/// often preempted mid-write, which is where the kill must land to wedge the queue (on an idle
/// machine that is rare). Dropping it stops them.
struct Hog(std::sync::Arc<std::sync::atomic::AtomicBool>);

impl Hog {
    fn start() -> Hog {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        for _ in 0..2 {
            let stop = stop.clone();
            std::thread::spawn(move || {
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    std::hint::spin_loop();
                }
            });
        }
        Hog(stop)
    }
}

impl Drop for Hog {
    fn drop(&mut self) {
        self.0.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// How long a round watches for a false alarm once the evidence says the queue moves: the
/// probe's whole cycle (a ping every 0.5 s, judged after 1.5 s) and then some.
const WATCH_CLEAN: Duration = Duration::from_millis(2500);

/// What one round saw.
struct Round {
    /// The already-connected sender's data, sent about 600 ms after the kill.
    healthy: kvlink::Result<Outcome>,
    /// When the healthy sender's wait ended, counted from the kill.
    healthy_after: Duration,
    /// When the agent reported its receive queue stuck, counted from the kill (watched for
    /// [`FIND_WITHIN`]).
    stuck_after: Option<Duration>,
    /// A fresh sender's hello and data (None: no hello in 5 s). Not tried when the agent fails
    /// its peers and refuses connects once stuck.
    fresh: Option<Option<kvlink::Result<Outcome>>>,
    /// The agent's answer to a new connection once stuck (when it fails its peers).
    connect_refused: Option<kvlink::ErrorKind>,
    /// This process's CPU over one second once stuck, in cores: UCX cannot arm a worker whose
    /// queue is stuck, and the progress thread must back off rather than spin on it.
    cpu_while_stuck: Option<f64>,
}

/// CPU time (user + system) of this process so far.
fn cpu() -> Duration {
    // SAFETY: getrusage writes into the zeroed struct we pass.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let t = |tv: libc::timeval| Duration::new(tv.tv_sec as u64, tv.tv_usec as u32 * 1000);
    t(ru.ru_utime) + t(ru.ru_stime)
}

fn completed(r: &kvlink::Result<Outcome>) -> bool {
    matches!(r, Ok(Outcome::Completed))
}

/// One round on a fresh survivor: a flooder killed mid-stream after `sends` messages, a
/// healthy sender connected before the kill whose data comes after it, then a fresh sender.
/// `fail` is the survivor's `fail_peers_when_stuck`.
fn round(sends: usize, fail: bool) -> Round {
    let mut opts = AgentOptions::new("survivor", TransportKind::SharedMemory);
    opts.fail_peers_when_stuck = fail;
    let agent = Agent::new(opts).unwrap();
    let addr = hex(agent.worker_address());
    // Tags: the flooder sends TAG_BASE; the healthy sender 1 byte on TAG_BASE, then 4096 on
    // TAG_BASE + 1; the fresh one 1, 1, then 4096 on TAG_BASE + 2. No receive can match
    // another sender's message.
    let mut flood = sender(&addr, "8000", "loop");
    let (mut flood_op, _flood_buf) =
        serve(&agent, Duration::from_secs(10), 8000, TAG_BASE).expect("the flooder's hello");
    flood.expect("GO");
    // `slow`: 300 ms before each message, so its 4096 bytes leave about 600 ms after its go,
    // well after the kill below (the flooder prints its lines within milliseconds).
    let mut healthy = sender(&addr, "1,4096", "slow");
    let (mut healthy_op, _healthy_buf) =
        serve(&agent, Duration::from_secs(10), 4096, TAG_BASE + 1).expect("a hello");
    healthy.expect("GO");
    let hog = Hog::start();
    for _ in 0..sends {
        flood.expect("SENT");
    }
    flood.signal(libc::SIGKILL);
    let killed = Instant::now();
    drop(hog);
    let _ = flood.child.wait();
    let _ = flood_op.wait(killed + Duration::from_secs(3), None);
    let healthy_got = healthy_op.wait(killed + Duration::from_secs(3), None);
    let healthy_after = killed.elapsed();
    // The healthy sender's data left after the kill: if it landed, the queue moved after the
    // kill, and a queue a dead writer stuck never moves again, so a short watch for a false
    // alarm will do; if it did not, give the probe all of FIND_WITHIN.
    let watch = if completed(&healthy_got) {
        WATCH_CLEAN
    } else {
        FIND_WITHIN
    };
    let mut stuck_after = None;
    while killed.elapsed() < watch {
        if agent.stats().receive_stuck {
            stuck_after = Some(killed.elapsed());
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let cpu_while_stuck = stuck_after.map(|_| {
        let (c0, t0) = (cpu(), Instant::now());
        std::thread::sleep(Duration::from_secs(1));
        (cpu() - c0).as_secs_f64() / t0.elapsed().as_secs_f64()
    });
    let mut r = Round {
        healthy: healthy_got,
        healthy_after,
        stuck_after,
        fresh: None,
        connect_refused: None,
        cpu_while_stuck,
    };
    if fail && stuck_after.is_some() {
        let t = Instant::now();
        r.connect_refused = agent
            .connect_worker(agent.worker_address())
            .err()
            .map(|e| e.kind);
        assert!(
            t.elapsed() < Duration::from_secs(2),
            "a refused connect must be quick"
        );
        return r;
    }
    let mut fresh = sender(&addr, "1,1,4096", "normal");
    r.fresh = Some(
        serve(&agent, Duration::from_secs(5), 4096, TAG_BASE + 2)
            .map(|(mut op, _buf)| op.wait(Instant::now() + Duration::from_secs(5), None)),
    );
    if r.fresh
        .as_ref()
        .is_some_and(|f| f.as_ref().is_some_and(completed))
    {
        fresh.expect("SENT");
    }
    r
}

fn rounds() -> usize {
    std::env::var("WEDGE_ITERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(8)
}

/// The probe's verdict against the evidence, and what a survivor does with it.
///
/// Even rounds only report (`fail_peers_when_stuck = false`), so nothing the verdict triggers
/// can make the evidence agree with it: the verdict must be "stuck" exactly when the healthy
/// sender's data (sent after the kill) and a fresh sender's hello both fail to arrive.
///
/// Odd rounds act on it (the default): once stuck, the healthy sender's wait ends `PeerLost`
/// soon after the verdict instead of at its 3 s deadline, and a new connection is refused at
/// once with `ErrorKind::Transport`; a round that was not found stuck must have got
/// everything through.
#[test]
fn a_stuck_sm_receive_queue_is_found_and_reported() {
    let _one = serial();
    let n = rounds();
    let (mut checked, mut acted, mut clean) = (0, 0, 0);
    for i in 0..n {
        let fail = i % 2 == 1;
        let r = round((i % 7 + 1) * 20, fail);
        println!(
            "round {i} (fail peers: {fail}): healthy sender's data {:?} after {:?}; stuck \
             reported after {:?}; fresh sender {:?}; connect once stuck {:?}; CPU once stuck \
             {:?} of a core",
            r.healthy,
            r.healthy_after,
            r.stuck_after,
            r.fresh,
            r.connect_refused,
            r.cpu_while_stuck
        );
        if let Some(c) = r.cpu_while_stuck {
            // A progress thread spinning on the unarmable worker costs a whole core.
            assert!(
                c < 0.2,
                "{c:.2} of a core while the queue is stuck: something spins"
            );
        }
        let fresh_ok = r.fresh.as_ref().map(|f| f.as_ref().is_some_and(completed));
        match (r.stuck_after, fail) {
            (None, _) => {
                // Not reported stuck: then everything must have got through.
                assert!(completed(&r.healthy), "undetected: {:?}", r.healthy);
                assert_eq!(fresh_ok, Some(true), "undetected: {:?}", r.fresh);
                clean += 1;
            }
            (Some(_), false) => {
                // Reported only: the evidence must say stuck too.
                assert!(
                    !completed(&r.healthy),
                    "reported stuck, yet the data landed"
                );
                assert_eq!(
                    fresh_ok,
                    Some(false),
                    "reported stuck, yet a fresh sender got in"
                );
                checked += 1;
            }
            (Some(after), true) => {
                assert_eq!(r.connect_refused, Some(kvlink::ErrorKind::Transport));
                if !completed(&r.healthy) {
                    assert!(
                        matches!(r.healthy, Ok(Outcome::PeerLost)),
                        "the peer is failed when the queue is found stuck: {:?}",
                        r.healthy
                    );
                    assert!(r.healthy_after <= after + Duration::from_millis(500));
                }
                acted += 1;
            }
        }
    }
    println!("STUCK {checked} reported + {acted} acted on, CLEAN {clean}, of {n} rounds");
    if checked == 0 || acted == 0 {
        println!(
            "not every kind of round wedged this time: checked {checked}, acted {acted} (each \
             round wedges about one time in three here)"
        );
    }
}

#[test]
#[ignore = "known gap (docs/RELIABILITY.md): a shared-memory sender killed mid-write wedges \
            the survivor's receive queue for good; run with --ignored to reproduce"]
fn survivor_of_a_killed_sm_sender_still_receives() {
    let _one = serial();
    let n = rounds();
    let mut wedged = 0;
    for i in 0..n {
        let r = round((i % 7 + 1) * 20, false);
        let ok = completed(&r.healthy)
            && r.fresh
                .as_ref()
                .is_some_and(|f| f.as_ref().is_some_and(completed));
        println!("round {i}: healthy {:?}; fresh {:?}", r.healthy, r.fresh);
        if !ok {
            wedged += 1;
        }
    }
    println!("WEDGED {wedged} of {n} rounds");
    assert_eq!(
        wedged, 0,
        "the survivor stopped receiving in {wedged} of {n} rounds"
    );
}

/// The same through the engine, in report-only mode: a process that floods an engine's worker
/// over shared memory (no handshake: it writes into the engine's receive queue all the same)
/// is killed. The engine's health (`receive_stuck`, state `Wedged`) and its metric must agree
/// with what a second engine finds: a handshake with it no longer completes exactly when it
/// is reported stuck.
#[test]
fn an_engine_reports_its_stuck_receive_queue_in_health_and_metrics() {
    use kvlink::connection::{Engine, EngineConfig, HealthState};
    let _one = serial();
    let n = rounds();
    let (mut stuck, mut clean) = (0, 0);
    for i in 0..n {
        let mut cfg = EngineConfig::new("survivor", 1, TransportKind::SharedMemory);
        cfg.fail_peers_when_stuck = false;
        let engine = Engine::new(cfg).unwrap();
        let addr = engine.address();
        let mut flood = sender(&addr, "8000", "flood");
        flood.expect("GO");
        let hog = Hog::start();
        for _ in 0..(i % 7 + 1) * 20 {
            flood.expect("SENT");
        }
        flood.signal(libc::SIGKILL);
        let killed = Instant::now();
        drop(hog);
        let _ = flood.child.wait();
        // The evidence first: a new engine's handshake, whose hello goes into the same queue.
        let other =
            Engine::new(EngineConfig::new("other", 2, TransportKind::SharedMemory)).unwrap();
        let dialled = other.connect(&addr, Instant::now() + Duration::from_secs(3));
        let watch = if dialled.is_ok() {
            WATCH_CLEAN
        } else {
            FIND_WITHIN
        };
        let mut health = engine.health();
        while !health.receive_stuck && killed.elapsed() < watch {
            std::thread::sleep(Duration::from_millis(20));
            health = engine.health();
        }
        let metrics = engine.metrics_text().unwrap();
        let gauge = metrics
            .lines()
            .find(|l| l.starts_with("kvlink_receive_queue_stuck "))
            .unwrap_or_else(|| panic!("no receive_queue_stuck gauge in\n{metrics}"))
            .to_string();
        println!(
            "round {i}: a new peer's handshake after the kill: {:?}; receive_stuck {} (state \
             {:?}) {:?} after the kill",
            dialled.as_ref().map(|r| r.0),
            health.receive_stuck,
            health.state,
            killed.elapsed(),
        );
        if health.receive_stuck {
            stuck += 1;
            assert_eq!(health.state, HealthState::Wedged);
            assert_eq!(gauge, "kvlink_receive_queue_stuck 1");
            assert!(
                dialled.is_err(),
                "reported stuck, yet a handshake completed"
            );
        } else {
            clean += 1;
            assert_eq!(gauge, "kvlink_receive_queue_stuck 0");
            assert!(
                dialled.is_ok(),
                "not reported stuck, yet no handshake: {dialled:?}"
            );
        }
    }
    println!("STUCK {stuck} CLEAN {clean} of {n} rounds");
    if stuck == 0 {
        println!("no round wedged this time: only the no-false-alarm side was checked");
    }
}
