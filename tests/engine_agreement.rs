//! A seeded randomized test of the agreement among the several ranks of one request through the
//! real engine over real UCX (tcp on loopback and shared memory): four engines in one process,
//! G1 and G2 receiving (G1, the lower rank, coordinates) and C1 and C2 sending, run many
//! requests, several at once, whose receivers are both G ranks and whose flows come from C1,
//! C2 or both. At random: a rank's caller cancels (any of the four: at once after its start,
//! after a while (mid-send), or after its data was sent or landed), a short request deadline
//! expires mid-way, a sender refuses or never answers, a receiver starts late (after the other
//! receiver's cancel or vote may have come: the early store), and, rarely, an endpoint between
//! two ranks of a request is force-closed mid-request (that request then runs alone).
//!
//! Per request: every wait returns by its deadline plus the agreement bound plus a margin; when
//! no endpoint was closed, every receiver ends with one outcome and every sender with the same
//! (a lone refusal: `Rejected`; nothing injected: `Completed`); always, a sender's `Completed`
//! implies every receiver's, and a receiver's `Completed` has every byte of its segments. At
//! the end nothing is leased or fenced and a fresh request on the four engines completes.
//!
//! The seed is printed; `KVLINK_AGREE_SEED=<n>` reruns one (the threads' timing is not seeded,
//! only the plans). To shrink a failure, `KVLINK_AGREE_PLANS=1` prints every plan and
//! `KVLINK_AGREE_ONLY=30,31` runs only those requests.
#[path = "common/rng.rs"]
mod rng;

use kvlink::connection::{Advertisement, BufferSpec, Engine, EngineConfig, PeerState};
use kvlink::proto::{RankId, RequestKey, Role};
use kvlink::transport::TransportKind;
use kvlink::Outcome;
use rng::Rng;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard, RwLock};
use std::time::{Duration, Instant};

const G1: u32 = 1;
const G2: u32 = 2;
const C1: u32 = 5;
const C2: u32 = 6;
const RECEIVERS: [u32; 2] = [G1, G2];
const SENDERS: [u32; 2] = [C1, C2];
/// The engines' agreement bound, and what the deadline rule allows past it.
const BOUND: Duration = Duration::from_millis(50);
const MARGIN: Duration = Duration::from_millis(100);
/// The engines' default request timeout (and the longest a request here runs with).
const TIMEOUT: Duration = Duration::from_secs(2);
/// Requests per transport, and how many run at once.
const REQUESTS: u64 = 150;
const AT_ONCE: u64 = 4;

/// The tests of this file take turns: each loads both cores.
fn one_at_a_time() -> MutexGuard<'static, ()> {
    static TURN: Mutex<()> = Mutex::new(());
    TURN.lock().unwrap_or_else(|p| p.into_inner())
}

fn soon() -> Instant {
    Instant::now() + Duration::from_secs(5)
}

/// What segment `segment` of request `id` carries to receiver `rank`.
fn pattern(id: u64, rank: u32, segment: u32, len: usize) -> Vec<u8> {
    let salt = (id as u8).wrapping_mul(7) ^ (segment as u8).wrapping_mul(101) ^ (rank as u8);
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(salt) ^ (i >> 8) as u8)
        .collect()
}

/// When a rank's caller cancels.
#[derive(Clone, Copy, Debug, PartialEq)]
enum CancelAt {
    /// Right after its start (a receiver's advertise, a sender's first advertisement taken).
    Start,
    /// This many ms after its start (a sender: from a thread beside its sends), by `cancel`.
    After(u64),
    /// This many ms after the request began here, by the wait's cancel check (receivers).
    Check(u64),
    /// Once its data was sent (a sender) or sent to it (a receiver).
    AfterData,
}

/// What a sender does with one receiver's advertisement.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Answer {
    Send,
    Refuse,
    Silent,
}

/// A force-closed endpoint: `on` closes its endpoint to `to`, `after` ms into the request.
#[derive(Clone, Copy, Debug)]
struct Fault {
    on: u32,
    to: u32,
    after: u64,
}

#[derive(Clone, Debug)]
struct Plan {
    id: u64,
    senders: Vec<u32>,
    /// Per receiver, per sender: the lengths of the segments that sender fills there.
    lens: HashMap<(u32, u32), Vec<usize>>,
    timeout: Duration,
    /// A receiver that starts this many ms after the other.
    late: Option<(u32, u64)>,
    cancels: HashMap<u32, CancelAt>,
    answers: HashMap<(u32, u32), Answer>,
    fault: Option<Fault>,
}

impl Plan {
    fn new(id: u64, rng: &mut Rng) -> Plan {
        let senders = match rng.below(3) {
            0 => vec![C1],
            1 => vec![C2],
            _ => vec![C1, C2],
        };
        let big = rng.percent(20);
        let mut lens = HashMap::new();
        let mut answers = HashMap::new();
        for g in RECEIVERS {
            for &c in &senders {
                let n = 1 + rng.below(2) as usize;
                let l = (0..n)
                    .map(|_| match (big, rng.below(8)) {
                        (true, _) => 1 << 20,
                        (false, 0) => 1 + rng.below(16) as usize,
                        _ => 1 + rng.below(64 << 10) as usize,
                    })
                    .collect();
                lens.insert((g, c), l);
                let a = match rng.below(100) {
                    0..=5 => Answer::Refuse,
                    6..=8 => Answer::Silent,
                    _ => Answer::Send,
                };
                answers.insert((g, c), a);
            }
        }
        let timeout = match rng.percent(25) {
            true => Duration::from_millis(rng.ms(20, 250)),
            false => TIMEOUT,
        };
        // At most half the timeout: the early receiver is still waiting when the late starts.
        let late = rng.percent(25).then(|| {
            let hi = (timeout.as_millis() as u64 / 2).clamp(10, 300);
            (RECEIVERS[rng.below(2) as usize], rng.ms(5, hi))
        });
        let mut cancels = HashMap::new();
        for r in RECEIVERS.into_iter().chain(senders.iter().copied()) {
            if rng.percent(10) {
                let at = match rng.below(4) {
                    0 => CancelAt::Start,
                    1 => CancelAt::After(rng.ms(0, 60)),
                    2 if RECEIVERS.contains(&r) => CancelAt::Check(rng.ms(0, 60)),
                    _ => CancelAt::AfterData,
                };
                cancels.insert(r, at);
            }
        }
        let fault = rng.percent(3).then(|| {
            let pairs: Vec<(u32, u32)> = [(G1, G2)]
                .into_iter()
                .chain(
                    RECEIVERS
                        .iter()
                        .flat_map(|&g| senders.iter().map(move |&c| (g, c))),
                )
                .collect();
            let (a, b) = pairs[rng.below(pairs.len() as u64) as usize];
            let (on, to) = if rng.percent(50) { (a, b) } else { (b, a) };
            Fault {
                on,
                to,
                after: rng.ms(0, 40),
            }
        });
        Plan {
            id,
            senders,
            lens,
            timeout,
            late,
            cancels,
            answers,
            fault,
        }
    }

    /// Nothing that fails the request was planned.
    fn clean(&self) -> bool {
        self.cancels.is_empty()
            && self.timeout == TIMEOUT
            && self.fault.is_none()
            && self.answers.values().all(|&a| a == Answer::Send)
    }

    /// Only refusals were planned (at least one).
    fn only_refused(&self) -> bool {
        self.cancels.is_empty()
            && self.timeout == TIMEOUT
            && self.fault.is_none()
            && self.answers.values().all(|&a| a != Answer::Silent)
            && self.answers.values().any(|&a| a == Answer::Refuse)
    }
}

/// The four engines, by rank.
struct Ranks {
    engines: HashMap<u32, Engine>,
}

impl Ranks {
    fn new(kind: &TransportKind) -> Ranks {
        let mut engines = HashMap::new();
        for (name, rank) in [("g1", G1), ("g2", G2), ("c1", C1), ("c2", C2)] {
            let mut c = EngineConfig::new(name, rank, kind.clone());
            if !kind.by_worker_address() {
                c.listen = Some("127.0.0.1:0".parse().unwrap());
            }
            c.timeout = TIMEOUT;
            c.agreement_bound = BOUND;
            engines.insert(rank, Engine::new(c).unwrap());
        }
        let r = Ranks { engines };
        r.connect_all();
        r
    }

    fn get(&self, rank: u32) -> &Engine {
        &self.engines[&rank]
    }

    /// The links of the test: G2 dials G1, each G dials each C.
    fn links() -> Vec<(u32, u32)> {
        let mut l = vec![(G2, G1)];
        for g in RECEIVERS {
            for c in SENDERS {
                l.push((g, c));
            }
        }
        l
    }

    fn connect_all(&self) {
        for (dialler, to) in Ranks::links() {
            let (d, t) = (self.get(dialler), self.get(to));
            if d.peer_state(RankId(to)) != PeerState::Connected {
                assert_eq!(d.connect(&t.address(), soon()).unwrap(), RankId(to));
            }
            t.wait_peer(RankId(dialler), soon()).unwrap();
            d.wait_peer(RankId(to), soon()).unwrap();
        }
    }
}

/// Takes every sender's advertisements and hands each to the thread of its request and flow.
#[derive(Default)]
struct Mailbox {
    got: Mutex<HashMap<(u32, RequestKey, u32), Advertisement>>,
    came: Condvar,
}

impl Mailbox {
    fn take(&self, c: u32, key: RequestKey, g: u32, until: Instant) -> Option<Advertisement> {
        let mut got = self.got.lock().unwrap();
        loop {
            if let Some(a) = got.remove(&(c, key, g)) {
                return Some(a);
            }
            let now = Instant::now();
            if now >= until {
                return None;
            }
            got = self.came.wait_timeout(got, until - now).unwrap().0;
        }
    }
}

/// A rank's end of one request: its outcome, and by when it had to come.
#[derive(Debug, Default)]
struct Ends {
    recv: HashMap<u32, Outcome>,
    sent: HashMap<(u32, u32), Outcome>,
    /// When each wait returned, in ms from the request's start.
    at: Vec<(String, u128)>,
}

struct Test<'a> {
    ranks: &'a Ranks,
    mail: &'a Mailbox,
    seed: u64,
    /// Requests run under its read side; one with a fault alone, under its write side.
    alone: RwLock<()>,
    worst: Mutex<Duration>,
    ends: Mutex<HashMap<(Option<Outcome>, bool), u64>>,
}

impl Test<'_> {
    fn by(&self, what: &str, plan: &Plan, by: Instant) {
        let late = Instant::now().saturating_duration_since(by);
        {
            let mut w = self.worst.lock().unwrap();
            *w = (*w).max(late);
        }
        assert!(
            late <= BOUND + MARGIN,
            "seed {}: request {} ({plan:?}): {what} returned {late:?} past its deadline",
            self.seed,
            plan.id
        );
    }

    /// Runs `plan`, checks it, and gives G1's outcome.
    fn run(&self, plan: &Plan) -> Option<Outcome> {
        let _turn = match plan.fault {
            Some(_) => (None, Some(self.alone.write().unwrap())),
            None => (Some(self.alone.read().unwrap()), None),
        };
        let key = RequestKey::new(plan.id, 0);
        let seed = self.seed;
        let ends = Mutex::new(Ends::default());
        // Sends that returned, per receiver.
        let sent_to: HashMap<u32, AtomicU32> = RECEIVERS.map(|g| (g, AtomicU32::new(0))).into();
        let flows_to = plan.senders.len() as u32;
        // Per sender: its caller's cancel has been made.
        let cancelled: HashMap<u32, AtomicBool> =
            SENDERS.map(|c| (c, AtomicBool::new(false))).into();
        // Failures each rank of the fault has seen so far.
        let failed = |f: &Fault| [f.on, f.to].map(|r| self.ranks.get(r).health().peers_failed);
        let failed_before = plan.fault.as_ref().map(failed);
        let began = Instant::now();
        // The latest a sender's advertisement can come.
        let adverts_by = began + plan.timeout + Duration::from_millis(300) + BOUND + MARGIN;
        std::thread::scope(|s| {
            for g in RECEIVERS {
                let (ends, sent_to) = (&ends, &sent_to);
                s.spawn(move || {
                    let e = self.ranks.get(g);
                    if let Some((late, ms)) = plan.late {
                        if late == g {
                            std::thread::sleep(Duration::from_millis(ms));
                        }
                    }
                    let mut bufs: Vec<(u32, u32, Vec<u8>)> = Vec::new();
                    for &c in &plan.senders {
                        for &l in &plan.lens[&(g, c)] {
                            bufs.push((c, bufs.len() as u32, vec![0u8; l]));
                        }
                    }
                    let flows: Vec<(RankId, Vec<BufferSpec>)> = plan
                        .senders
                        .iter()
                        .map(|&c| {
                            let specs = bufs
                                .iter_mut()
                                .filter(|b| b.0 == c)
                                .map(|b| BufferSpec::host(b.1, &mut b.2))
                                .collect();
                            (RankId(c), specs)
                        })
                        .collect();
                    let start = Instant::now();
                    // SAFETY: `bufs` outlives the request: its end is waited for below.
                    let r = unsafe {
                        e.advertise_with(
                            key,
                            RECEIVERS.map(RankId).to_vec(),
                            flows,
                            vec![],
                            Some(plan.timeout),
                        )
                    };
                    if let Err(err) = r {
                        assert!(
                            plan.fault.is_some(),
                            "seed {seed}: request {} ({plan:?}): g{g} advertise: {err}",
                            plan.id
                        );
                        return;
                    }
                    let deadline = Instant::now() + plan.timeout;
                    let at = plan.cancels.get(&g).copied();
                    let check_at = match at {
                        Some(CancelAt::Check(ms)) => Some(start + Duration::from_millis(ms)),
                        _ => None,
                    };
                    match at {
                        Some(CancelAt::Start) => e.cancel(key).unwrap(),
                        Some(CancelAt::After(ms)) => {
                            std::thread::sleep(Duration::from_millis(ms));
                            e.cancel(key).unwrap();
                        }
                        Some(CancelAt::AfterData) => {
                            while sent_to[&g].load(Ordering::Acquire) < flows_to
                                && Instant::now() < deadline
                            {
                                std::thread::sleep(Duration::from_millis(1));
                            }
                            e.cancel(key).unwrap();
                        }
                        _ => {}
                    }
                    let check = move || check_at.is_some_and(|t| Instant::now() >= t);
                    let cancel: Option<&dyn Fn() -> bool> = check_at.map(|_| &check as _);
                    let o = e
                        .wait(
                            key,
                            Role::Receiver,
                            deadline + Duration::from_secs(5),
                            cancel,
                        )
                        .unwrap_or_else(|err| panic!("seed {seed}: g{g} wait {key}: {err}"));
                    self.by(&format!("g{g}'s receiver wait ({o:?})"), plan, deadline);
                    if o == Outcome::Completed {
                        for (c, segment, b) in &bufs {
                            assert!(
                                *b == pattern(plan.id, g, *segment, b.len()),
                                "seed {seed}: request {} ({plan:?}) completed on g{g}, its \
                                 segment {segment} from c{c} ({} bytes) is not what was sent",
                                plan.id,
                                b.len()
                            );
                        }
                    }
                    let mut ends = ends.lock().unwrap();
                    ends.recv.insert(g, o);
                    ends.at.push((format!("g{g}"), began.elapsed().as_millis()));
                });
            }
            for &c in &plan.senders {
                let cancelled = &cancelled[&c];
                for g in RECEIVERS {
                    let (ends, sent_to) = (&ends, &sent_to);
                    let mail = self.mail;
                    s.spawn(move || {
                        let e = self.ranks.get(c);
                        let Some(a) = mail.take(c, key, g, adverts_by) else {
                            assert!(
                                plan.fault.is_some(),
                                "seed {seed}: request {} ({plan:?}): c{c} got no advertisement \
                                 from g{g}",
                                plan.id
                            );
                            return;
                        };
                        let at = plan.cancels.get(&c).copied();
                        let cancel_once = || {
                            if !cancelled.swap(true, Ordering::AcqRel) {
                                e.cancel(key).unwrap();
                            }
                        };
                        if at == Some(CancelAt::Start) {
                            cancel_once();
                        }
                        let answer = plan.answers[&(g, c)];
                        let timer = match at {
                            Some(CancelAt::After(ms)) => Some(Duration::from_millis(ms)),
                            _ => None,
                        };
                        std::thread::scope(|s2| {
                            if let Some(t) = timer {
                                s2.spawn(move || {
                                    std::thread::sleep(t);
                                    cancel_once();
                                });
                            }
                            match answer {
                                Answer::Silent => {}
                                Answer::Refuse => {
                                    let _ = e.accept(key, a.from, false);
                                }
                                Answer::Send => {
                                    if e.accept(key, a.from, true).is_ok() {
                                        for b in &a.buffers {
                                            let data =
                                                pattern(plan.id, g, b.segment, b.len as usize);
                                            let r = e.send(
                                                key, a.from, b.segment, &data, a.deadline, None,
                                            );
                                            self.by(&format!("c{c}'s send to g{g}"), plan, {
                                                a.deadline
                                            });
                                            if r.is_err() {
                                                break;
                                            }
                                        }
                                    }
                                    sent_to[&g].fetch_add(1, Ordering::AcqRel);
                                    if at == Some(CancelAt::AfterData) {
                                        cancel_once();
                                    }
                                }
                            }
                            let to = Role::Sender { receiver: a.from };
                            let o = e
                                .wait(key, to, a.deadline + Duration::from_secs(5), None)
                                .unwrap_or_else(|err| {
                                    panic!("seed {seed}: c{c} wait {key} to g{g}: {err}")
                                });
                            self.by(&format!("c{c}'s sender wait to g{g} ({o:?})"), plan, {
                                a.deadline
                            });
                            let mut ends = ends.lock().unwrap();
                            ends.sent.insert((c, g), o);
                            ends.at
                                .push((format!("c{c}->g{g}"), began.elapsed().as_millis()));
                        });
                    });
                }
            }
            if let Some(f) = plan.fault {
                s.spawn(move || {
                    std::thread::sleep(Duration::from_millis(f.after));
                    let _ = self.ranks.get(f.on).fault_close_peer(RankId(f.to));
                });
            }
        });
        let ends = ends.into_inner().unwrap();
        let label = format!("seed {seed}: request {} ({plan:?}): {ends:?}", plan.id);
        // A sender's `Completed` implies every receiver's.
        if ends.sent.values().any(|&o| o == Outcome::Completed) {
            assert!(
                RECEIVERS
                    .iter()
                    .all(|g| ends.recv.get(g) == Some(&Outcome::Completed)),
                "{label}: a sender completed, a receiver did not"
            );
        }
        if plan.fault.is_none() {
            let first = ends.recv[&G1];
            assert!(
                ends.recv
                    .values()
                    .chain(ends.sent.values())
                    .all(|&o| o == first),
                "{label}: the ranks disagree"
            );
            assert_eq!(
                ends.sent.len(),
                2 * plan.senders.len(),
                "{label}: a sender end is missing"
            );
            if plan.clean() {
                assert_eq!(first, Outcome::Completed, "{label}");
            }
            if plan.only_refused() {
                assert_eq!(first, Outcome::Rejected, "{label}");
            }
        } else if let (Some(f), Some(before)) = (plan.fault, failed_before) {
            // Both ends of the closed link have seen it fail (its close is carried out by the
            // progress thread, and the far end learns it later still), so that no request
            // after this one runs into it; then every link serves the next request.
            let by = Instant::now() + Duration::from_secs(3);
            while failed(&f).iter().zip(before).any(|(&n, b)| n == b) && Instant::now() < by {
                std::thread::sleep(Duration::from_millis(1));
            }
            println!(
                "  request {}: {f:?} seen by both ends after {:?} ({:?} failures before, {:?} \
                 now)",
                plan.id,
                began.elapsed(),
                before,
                failed(&f)
            );
            self.ranks.connect_all();
        }
        let recv = ends.recv.get(&G1).copied();
        *self
            .ends
            .lock()
            .unwrap()
            .entry((recv, plan.fault.is_some()))
            .or_default() += 1;
        recv
    }
}

/// The seed: `KVLINK_AGREE_SEED` if set, else `default`.
fn seed(default: u64) -> u64 {
    match std::env::var("KVLINK_AGREE_SEED") {
        Ok(s) => s.trim().parse().expect("KVLINK_AGREE_SEED: a u64"),
        Err(_) => default,
    }
}

fn agreement(kind: TransportKind, default_seed: u64) {
    let seed = seed(default_seed);
    println!("== {kind:?}: agreement seed {seed} (KVLINK_AGREE_SEED={seed} reruns it)");
    let ranks = Ranks::new(&kind);
    let mail = Mailbox::default();
    let stop = AtomicBool::new(false);
    let mut rng = Rng(seed);
    let plans: Vec<Plan> = (1..=REQUESTS).map(|id| Plan::new(id, &mut rng)).collect();
    // For shrinking a failure: only the requests listed (`KVLINK_AGREE_ONLY=30,31`).
    let plans: Vec<Plan> = match std::env::var("KVLINK_AGREE_ONLY") {
        Ok(ids) => {
            let ids: Vec<u64> = ids.split(',').map(|i| i.trim().parse().unwrap()).collect();
            plans.into_iter().filter(|p| ids.contains(&p.id)).collect()
        }
        Err(_) => plans,
    };
    if std::env::var("KVLINK_AGREE_PLANS").is_ok() {
        for p in &plans {
            println!("  {p:?}");
        }
    }
    let test = Test {
        ranks: &ranks,
        mail: &mail,
        seed,
        alone: RwLock::new(()),
        worst: Mutex::new(Duration::ZERO),
        ends: Mutex::new(HashMap::new()),
    };
    let next = std::sync::atomic::AtomicUsize::new(0);
    let t0 = Instant::now();
    std::thread::scope(|s| {
        let (ranks, mail, stop) = (&ranks, &mail, &stop);
        for c in SENDERS {
            s.spawn(move || postman(ranks, mail, c, stop));
        }
        let workers: Vec<_> = (0..AT_ONCE)
            .map(|_| {
                s.spawn(|| loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(plan) = plans.get(i) else { break };
                    let _bail = Bail(&next);
                    test.run(plan);
                })
            })
            .collect();
        for w in workers {
            if let Err(p) = w.join() {
                stop.store(true, Ordering::Release);
                std::panic::resume_unwind(p);
            }
        }
        stop.store(true, Ordering::Release);
    });
    let ran = t0.elapsed();
    // Nothing leased, fenced or in flight once the last ends have settled.
    let settle = Instant::now() + Duration::from_secs(5);
    let idle = || {
        RECEIVERS.iter().all(|&g| {
            let h = ranks.get(g).health();
            h.buffers_leased == 0 && h.buffers_fenced == 0
        }) && ranks
            .engines
            .values()
            .all(|e| e.health().ops_in_flight == 0)
    };
    while !idle() && Instant::now() < settle {
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut ends: Vec<_> = test.ends.lock().unwrap().clone().into_iter().collect();
    ends.sort_by_key(|e| std::cmp::Reverse(e.1));
    println!(
        "  AGREE requests={REQUESTS} ran_ms={} worst_late_ms={:.1}",
        ran.as_millis(),
        test.worst.lock().unwrap().as_secs_f64() * 1e3
    );
    println!("  ends (outcome, faulted): {ends:?}");
    for (rank, e) in &ranks.engines {
        let h = e.health();
        println!("  {rank}: {h:?}");
        assert_eq!(
            (h.buffers_leased, h.buffers_fenced, h.ops_in_flight),
            (0, 0, 0),
            "seed {seed}: rank {rank}"
        );
        assert_eq!(h.unsettled_returns, 0, "seed {seed}: rank {rank}");
    }
    // A fresh request from both senders to both receivers completes, bytes checked.
    ranks.connect_all();
    let plan = Plan {
        id: REQUESTS + 1,
        senders: SENDERS.to_vec(),
        lens: RECEIVERS
            .iter()
            .flat_map(|&g| SENDERS.map(|c| ((g, c), vec![100_000, 7])))
            .collect(),
        timeout: TIMEOUT,
        late: None,
        cancels: HashMap::new(),
        answers: RECEIVERS
            .iter()
            .flat_map(|&g| SENDERS.map(|c| ((g, c), Answer::Send)))
            .collect(),
        fault: None,
    };
    let stop = AtomicBool::new(false);
    let fresh = std::thread::scope(|s| {
        let (ranks, mail, stop) = (&ranks, &mail, &stop);
        for c in SENDERS {
            s.spawn(move || postman(ranks, mail, c, stop));
        }
        let o = test.run(&plan);
        stop.store(true, Ordering::Release);
        o
    });
    assert_eq!(
        fresh,
        Some(Outcome::Completed),
        "seed {seed}: the fresh request"
    );
}

/// Takes no more plans once a request's check failed.
struct Bail<'a>(&'a std::sync::atomic::AtomicUsize);

impl Drop for Bail<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.store(usize::MAX / 2, Ordering::Relaxed);
        }
    }
}

/// Takes sender `c`'s advertisements into `mail` until `stop`.
fn postman(ranks: &Ranks, mail: &Mailbox, c: u32, stop: &AtomicBool) {
    while !stop.load(Ordering::Acquire) {
        let until = Instant::now() + Duration::from_millis(20);
        if let Some(a) = ranks.get(c).next_advertisement(until, None) {
            mail.got.lock().unwrap().insert((c, a.key, a.from.0), a);
            mail.came.notify_all();
        }
    }
}
#[test]
fn ranks_of_one_request_agree_under_random_cancels_refusals_and_faults_over_tcp() {
    let _turn = one_at_a_time();
    agreement(TransportKind::Tcp, 0xa6e0_0001);
}

#[test]
fn ranks_of_one_request_agree_under_random_cancels_refusals_and_faults_over_shared_memory() {
    let _turn = one_at_a_time();
    agreement(TransportKind::SharedMemory, 0xa6e0_0002);
}
