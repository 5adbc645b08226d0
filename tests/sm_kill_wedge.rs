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

/// What one round saw.
struct Round {
    /// The already-connected sender's data, after the kill.
    healthy: kvlink::Result<Outcome>,
    /// When the agent reported its receive queue stuck, counted from the kill (polled for
    /// [`FIND_WITHIN`]).
    stuck_after: Option<Duration>,
    /// A fresh sender's hello and data (None: no hello in 5 s). Not tried once stuck.
    fresh: Option<Option<kvlink::Result<Outcome>>>,
    /// The agent's answer to a new connection once stuck.
    connect_refused: Option<kvlink::ErrorKind>,
}

fn completed(r: &kvlink::Result<Outcome>) -> bool {
    matches!(r, Ok(Outcome::Completed))
}

/// One round on a fresh survivor: a flooder killed mid-stream after `sends` messages, a
/// healthy sender connected before the kill, then (unless the survivor reports its queue
/// stuck) a fresh sender.
fn round(sends: usize) -> Round {
    let agent = Agent::new(AgentOptions::new("survivor", TransportKind::SharedMemory)).unwrap();
    let addr = hex(agent.worker_address());
    // Tags: the flooder sends TAG_BASE; the healthy sender 1 byte on TAG_BASE, then 4096 on
    // TAG_BASE + 1; the fresh one 1, 1, then 4096 on TAG_BASE + 2. No receive can match
    // another sender's message.
    let mut flood = sender(&addr, "8000", "loop");
    let (mut flood_op, _flood_buf) =
        serve(&agent, Duration::from_secs(10), 8000, TAG_BASE).expect("the flooder's hello");
    flood.expect("GO");
    let mut healthy = sender(&addr, "1,4096", "slow");
    let (mut healthy_op, _healthy_buf) =
        serve(&agent, Duration::from_secs(10), 4096, TAG_BASE + 1).expect("a hello");
    healthy.expect("GO");
    for _ in 0..sends {
        flood.expect("SENT");
    }
    flood.signal(libc::SIGKILL);
    let killed = Instant::now();
    let _ = flood.child.wait();
    let _ = flood_op.wait(killed + Duration::from_secs(3), None);
    let healthy_got = healthy_op.wait(killed + Duration::from_secs(3), None);
    let mut stuck_after = None;
    while killed.elapsed() < FIND_WITHIN {
        if agent.stats().receive_stuck {
            stuck_after = Some(killed.elapsed());
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let mut r = Round {
        healthy: healthy_got,
        stuck_after,
        fresh: None,
        connect_refused: None,
    };
    if stuck_after.is_some() {
        let t = Instant::now();
        r.connect_refused = agent
            .connect_worker(agent.worker_address())
            .err()
            .map(|e| e.kind);
        assert!(
            t.elapsed() < Duration::from_millis(500),
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
        .unwrap_or(6)
}

/// What a survivor can do today: find the stuck queue and say so, fail its peers at once
/// rather than at their deadlines, refuse new connections with a typed error, and never cry
/// wolf in a round where everything still gets through.
#[test]
fn a_stuck_sm_receive_queue_is_found_and_reported() {
    let n = rounds();
    let (mut stuck, mut clean) = (0, 0);
    for i in 0..n {
        let r = round((i % 7 + 1) * 20);
        println!(
            "round {i}: healthy sender's data {:?}; stuck reported after {:?}; fresh sender {:?}; \
             connect once stuck {:?}",
            r.healthy, r.stuck_after, r.fresh, r.connect_refused
        );
        match r.stuck_after {
            Some(_) => {
                stuck += 1;
                assert_eq!(r.connect_refused, Some(kvlink::ErrorKind::Transport));
                // Data sent before the wedge may have landed; if it did not, the wait ended
                // (PeerLost when the probe failed the peer first, else TimedOut) by its deadline.
                assert!(r.healthy.is_ok(), "{:?}", r.healthy);
            }
            None => {
                // Not reported stuck: then everything must have got through.
                assert!(completed(&r.healthy), "undetected: {:?}", r.healthy);
                let fresh = r.fresh.expect("a fresh sender is tried when not stuck");
                assert!(
                    fresh.as_ref().is_some_and(completed),
                    "a fresh sender failed but nothing was reported: {fresh:?}"
                );
                clean += 1;
            }
        }
    }
    println!("STUCK {stuck} CLEAN {clean} of {n} rounds");
    if stuck == 0 {
        println!("no round wedged this time: only the no-false-alarm side was checked");
    }
}

#[test]
#[ignore = "known gap (docs/RELIABILITY.md): a shared-memory sender killed mid-write wedges \
            the survivor's receive queue for good; run with --ignored to reproduce"]
fn survivor_of_a_killed_sm_sender_still_receives() {
    let n = rounds();
    let mut wedged = 0;
    for i in 0..n {
        let r = round((i % 7 + 1) * 20);
        let ok = completed(&r.healthy)
            && r.stuck_after.is_none()
            && r.fresh
                .as_ref()
                .is_some_and(|f| f.as_ref().is_some_and(completed));
        println!(
            "round {i}: healthy {:?}; stuck after {:?}; fresh {:?}",
            r.healthy, r.stuck_after, r.fresh
        );
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

/// The same through the engine: a process that floods an engine's worker over shared memory
/// (no handshake: it writes into the engine's receive queue all the same) is killed. Then the
/// engine's health must agree with what a second engine finds: `receive_stuck` (and state
/// `Wedged`, and the metric) exactly when a handshake with it can no longer complete.
#[test]
fn an_engine_reports_its_stuck_receive_queue_in_health_and_metrics() {
    use kvlink::connection::{Engine, EngineConfig, HealthState};
    let n = rounds();
    let (mut stuck, mut clean) = (0, 0);
    for i in 0..n {
        let engine = Engine::new(EngineConfig::new(
            "survivor",
            1,
            TransportKind::SharedMemory,
        ))
        .unwrap();
        let addr = engine.address();
        let mut flood = sender(&addr, "8000", "flood");
        flood.expect("GO");
        for _ in 0..(i % 7 + 1) * 20 {
            flood.expect("SENT");
        }
        flood.signal(libc::SIGKILL);
        let killed = Instant::now();
        let _ = flood.child.wait();
        let mut health = engine.health();
        while !health.receive_stuck && killed.elapsed() < FIND_WITHIN {
            std::thread::sleep(Duration::from_millis(20));
            health = engine.health();
        }
        let other =
            Engine::new(EngineConfig::new("other", 2, TransportKind::SharedMemory)).unwrap();
        let dialled = other.connect(&addr, Instant::now() + Duration::from_secs(3));
        println!(
            "round {i}: receive_stuck {} (state {:?}) {:?} after the kill; a new peer's handshake: {:?}",
            health.receive_stuck,
            health.state,
            killed.elapsed(),
            dialled.as_ref().map(|r| r.0)
        );
        let metrics = engine.metrics_text().unwrap();
        let gauge = metrics
            .lines()
            .find(|l| l.starts_with("kvlink_receive_queue_stuck "))
            .unwrap_or_else(|| panic!("no receive_queue_stuck gauge in\n{metrics}"))
            .to_string();
        if health.receive_stuck {
            stuck += 1;
            assert_eq!(health.state, HealthState::Wedged);
            assert_eq!(gauge, "kvlink_receive_queue_stuck 1");
            assert!(dialled.is_err(), "stuck, yet a handshake completed");
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
