//! Two ranks that dial each other at once (two tcp connections between one pair): over every
//! order in which the two connections' messages, closes and failures can arrive, both sides end
//! up bound to the same connection, both `connect`s return the other rank, and nothing counts
//! as a refusal or a lost peer. The peer tables are the core's own (`Peers::on_handshake`, as
//! the engine drives it); the network is a set of queues, one per connection and direction, in
//! order within each (as a tcp connection is), interleaved at random between them.
//!
//! The second test adds what the first leaves out of the network: a close that drops a tail of
//! what its side sent before it, a close the other side hears of only seconds later (as by
//! keepalive), and one connection broken mid-crossing. Its property is safety: the pair ends
//! bound on both sides to one connection, or on neither, and every `connect` ends.
//!
//! The third breaks the pair's connection once the crossing has settled, and runs the reconnect
//! rounds (`Peers::due`, as the engine's background redials): the pair ends bound again, on a
//! new connection, with nothing refused, whichever side's close and however late it is heard.
//! The fourth has either side call `connect` during that round: on the side that only answers
//! its dial crosses the round's; on the redialling side it finds the rank still connected,
//! joins the round's dial, or dials in its place, never beside it. The pair ends on one
//! connection, that `connect` returning the rank, nothing refused. The fifth breaks the round's
//! dial while that side's `connect` waits for it: the `connect` dials in its place.
//!
//! A `connect` here is looked at after every step, but one asleep (waiting for a crossing, or
//! for its round's dial) may move on only in a step whose peer table named its rank
//! (`Peers::take_wakes`, what the engine wakes its waiters by) or when its timer is due (its
//! timer taken, as the engine's, only when it looks): every test that runs the network through
//! `Net::follow_dials` fails on a move without such a wake.
//!
//! What none models: worker moves, and shared memory's single connection
//! (`tests/crossing_dials.rs` runs that between two processes).
use kvlink_proto::peers::{HandshakeAction, PeerState, Peers};
use kvlink_proto::{Handshake, Identity, Message, RankId, Secret};
use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// What travels on one direction of a connection.
#[derive(Debug)]
enum Item {
    /// The connection reached the answerer (UCX's accept, before any message).
    Accept,
    Msg(Message),
    /// The sender's end closed: the receiver's endpoint fails.
    Fail,
}

/// What a `connect` on a side's dial has come to (the engine's loop in `Engine::connect`).
#[derive(Clone, Debug, PartialEq, Eq)]
enum Dial {
    NotYet,
    Running,
    WaitingFor(RankId),
    /// This side's reconnect round was dialling the rank when `connect` began: it waits for
    /// that dial, and dials itself if that one ends without binding the rank.
    Joined(RankId),
    Done(Result<RankId, String>),
}

/// The seeds a test runs: 0..n, or the one in `SEED` (to trace it: `TRACE=1`).
fn seeds(n: u64) -> std::ops::Range<u64> {
    std::env::var("SEED").map_or(0..n, |s| {
        let s: u64 = s.parse().unwrap();
        s..s + 1
    })
}

/// Orders counted by their outcome, each with the first seed that gave it (to rerun alone).
#[derive(Debug, Default)]
struct Tally(std::collections::BTreeMap<String, (u32, u64)>);

impl Tally {
    fn add(&mut self, outcome: String, seed: u64) {
        self.0.entry(outcome).or_insert((0, seed)).0 += 1;
    }

    /// The orders whose outcome `f` picks.
    fn count(&self, f: &dyn Fn(&str) -> bool) -> u32 {
        self.0
            .iter()
            .filter(|(k, _)| f(k))
            .map(|(_, (n, _))| n)
            .sum()
    }

    fn print(&self) {
        for (k, (n, seed)) in &self.0 {
            println!("{n:5} {k} (the first: seed {seed})");
        }
    }
}

/// One look of `connect`'s wait for `rank` after its dial gave way (`wait_for_crossing`).
fn waiting_for(peers: &Peers<u64>, rank: RankId, now: Instant) -> Dial {
    if peers.state(rank) == PeerState::Connected {
        Dial::Done(Ok(rank))
    } else if !peers.waiting_for_crossing(rank, now) {
        Dial::Done(Err("gave way to a dial that did not complete".into()))
    } else {
        Dial::WaitingFor(rank)
    }
}

/// The address each side's `connect` dials the other at.
const ADDR: &str = "the other side";

struct Side {
    me: Identity,
    peers: Peers<u64>,
    /// Whether this side's end of connection c is still open.
    open: Vec<bool>,
    /// The connection of this side's dial (its latest, after a redial).
    conn: usize,
    dial: Dial,
    /// This side's `connect` has dialled once more (it does so once at most).
    redialled: bool,
    /// How this side's last `connect` began: it joined its reconnect round's dial, or dialled.
    began: &'static str,
    /// The dials this side's last `connect` made itself.
    own_dials: u32,
    /// Until when a `connect` waiting for a crossing sleeps if nobody wakes it (the engine's
    /// `wait_for_crossing`: a redial's wait), if not to its deadline.
    wait_until: Option<Instant>,
    /// The most dials this side has had out at once (open here, neither bound nor refused).
    most_dials_out: usize,
    lost: u32,
    /// Of those, the losses a bind reported: a live binding replaced by the peer's redial.
    rebinds: u32,
}

/// Either side's endpoint id for connection `c` (in the order the dials made them).
fn ep(c: usize) -> u64 {
    10 + c as u64
}

struct Net {
    sides: [Side; 2],
    /// q[c][d]: connection c, from side d to side 1 - d.
    q: Vec<[VecDeque<Item>; 2]>,
    /// The side that dialled each connection.
    dialer: Vec<usize>,
    now: Instant,
    rng: u64,
    /// A close drops a random tail of what the closing side had sent and not yet delivered
    /// (UCX's force close may drop queued sends).
    drops: bool,
    /// A close reaches the other side only later, as keepalive finds it (None: with what was
    /// sent before it). Up to this long.
    late_fail: Option<Duration>,
    /// Fails heard of late: when, connection, from side.
    delayed: Vec<(Instant, usize, usize)>,
    /// At this step a random connection breaks (closed from a random side).
    fault_at: Option<usize>,
    /// The fault closed a connection that was open at that end: which one.
    faulted: bool,
    fault_conn: Option<usize>,
    /// Messages the closes dropped.
    dropped: usize,
    /// Reconnect rounds run: a rank `Reconnecting` is dialled again when due (the engine's
    /// background redial), on a connection of its own.
    reconnect: bool,
    /// Reconnect dials made, by side.
    redials: [u32; 2],
    /// At this step of [`Net::run_to_quiet`] this side's `connect` dials (by hand, as an
    /// application that saw the pair fail may).
    hand_dial_at: Option<(usize, usize)>,
    /// This side calls `connect` as soon as its reconnect round has a dial out (so it joins
    /// that dial), and that dial's connection is closed so many steps later, from a random side.
    join_then_break: Option<(usize, usize)>,
    /// When [`Net::join_then_break`]'s close is due, and on which connection.
    break_round_at: Option<(usize, usize)>,
}

impl Net {
    fn new(seed: u64, instances: [u64; 2]) -> Net {
        let side = |rank: u32| Side {
            me: Identity {
                rank: RankId(rank),
                name: format!("r{rank}"),
                instance: instances[rank as usize],
                secret: Secret::none(),
            },
            peers: Peers::default(),
            open: Vec::new(),
            conn: 0,
            dial: Dial::NotYet,
            redialled: false,
            began: "",
            own_dials: 0,
            wait_until: None,
            most_dials_out: 0,
            lost: 0,
            rebinds: 0,
        };
        Net {
            sides: [side(0), side(1)],
            q: Vec::new(),
            dialer: Vec::new(),
            now: Instant::now(),
            rng: seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1,
            drops: false,
            late_fail: None,
            delayed: Vec::new(),
            fault_at: None,
            faulted: false,
            fault_conn: None,
            dropped: 0,
            reconnect: false,
            redials: [0; 2],
            hand_dial_at: None,
            join_then_break: None,
            break_round_at: None,
        }
    }

    fn rand(&mut self, n: usize) -> usize {
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        (self.rng % n as u64) as usize
    }

    /// Side `s` calls `connect`, as `Engine::connect` does: it joins a dial of its reconnect
    /// round already out to the rank, or dials (and no round dials while it runs).
    fn connect(&mut self, s: usize) {
        self.sides[s].peers.connect_begins(ADDR);
        self.sides[s].own_dials = 0;
        self.sides[s].dial = Dial::NotYet;
        self.connect_looks(s);
        self.sides[s].began = match self.sides[s].dial {
            Dial::Joined(_) => "joined the round's dial",
            _ => "dialled",
        };
    }

    /// `Engine::connect`'s loop before it dials: the rank that the round's dial it waited for
    /// bound is returned; a round's dial out to the address is waited for; else it dials.
    fn connect_looks(&mut self, s: usize) {
        let side = &mut self.sides[s];
        let bound = match side.dial {
            Dial::Joined(r) => Some(r).filter(|&r| side.peers.state(r) == PeerState::Connected),
            _ => None,
        };
        if let Some(rank) = bound {
            // The round's dial it waited for bound the rank.
            side.dial = Dial::Done(Ok(rank));
            side.peers.connect_ends(ADDR);
        } else if let Some(rank) = side.peers.round_dialling(ADDR) {
            side.dial = Dial::Joined(rank);
        } else {
            self.dial(s);
        }
    }

    /// Side `s`'s `connect` dials the other, on a new connection (the first two are 0 and 1).
    fn dial(&mut self, s: usize) {
        self.sides[s].own_dials += 1;
        let c = self.open_connection(s);
        let side = &mut self.sides[s];
        side.conn = c;
        side.dial = Dial::Running;
    }

    /// Side `s` opens a new connection to the other and says `Hello` on it; returns it.
    fn open_connection(&mut self, s: usize) -> usize {
        let c = self.q.len();
        self.q.push(Default::default());
        self.dialer.push(s);
        let challenge = 1000 + c as u64;
        let side = &mut self.sides[s];
        let (hs, hello) = Handshake::dial(&side.me, challenge);
        side.peers.handshakes.insert(ep(c), hs);
        side.peers.handshake_started(ep(c), self.now);
        side.open.push(true);
        self.sides[1 - s].open.push(true);
        self.q[c][s].push_back(Item::Accept);
        self.q[c][s].push_back(Item::Msg(hello));
        c
    }

    /// The reconnect rounds due now on each side (`Peers::due`): each dials on a connection of
    /// its own, as the engine's background redial does (`Peers::dialled`, then `Hello`).
    fn reconnect_rounds(&mut self) {
        for s in 0..2 {
            let now = self.now;
            for (rank, _address) in self.sides[s].peers.due(now) {
                let c = self.open_connection(s);
                self.sides[s].peers.dialled(rank, ep(c));
                self.redials[s] += 1;
                if std::env::var("TRACE").is_ok() {
                    println!("side {s}: reconnect round dials {rank} on conn {c}");
                }
            }
        }
    }

    /// Every (connection, direction) with something on the way.
    fn busy(&self) -> Vec<(usize, usize)> {
        (0..self.q.len())
            .flat_map(|c| (0..2).map(move |d| (c, d)))
            .filter(|&(c, d)| !self.q[c][d].is_empty())
            .collect()
    }

    /// Side `s` closes its end of connection `c`: its own endpoint fails at once (a forced
    /// close reports it), the other side's after what was sent before.
    fn close(&mut self, s: usize, c: usize) -> bool {
        if !self.sides[s].open[c] {
            return false;
        }
        self.sides[s].open[c] = false;
        self.fail(s, c);
        if self.drops {
            let keep = self.rand(self.q[c][s].len() + 1);
            self.dropped += self.q[c][s].len() - keep;
            self.q[c][s].truncate(keep);
        }
        if let Some(max) = self.late_fail {
            let ms = self.rand(max.as_millis() as usize + 1) as u64;
            self.delayed
                .push((self.now + Duration::from_millis(ms), c, s));
        } else {
            self.q[c][s].push_back(Item::Fail);
        }
        true
    }

    fn fail(&mut self, s: usize, c: usize) {
        let now = self.now;
        let side = &mut self.sides[s];
        side.open[c] = false;
        if side.peers.on_failed(ep(c), now).is_some() {
            side.lost += 1;
        }
    }

    /// Delivers the head of q[c][from] to the other side.
    fn deliver(&mut self, c: usize, from: usize) {
        let to = 1 - from;
        let item = self.q[c][from].pop_front().unwrap();
        if std::env::var("TRACE").is_ok() {
            println!(
                "conn {c} {from}->{to}: {item:?} (open {:?})",
                self.sides[to].open
            );
        }
        if !self.sides[to].open[c] {
            return;
        }
        let now = self.now;
        match item {
            Item::Accept => self.sides[to].peers.accepted(ep(c), None, now),
            Item::Fail => self.fail(to, c),
            Item::Msg(m) => {
                let challenge = 2000 + to as u64;
                let side = &mut self.sides[to];
                let actions = side.peers.on_handshake(&side.me, ep(c), m, now, challenge);
                if std::env::var("TRACE").is_ok() {
                    println!("   side {to}: {actions:?}");
                }
                for a in actions {
                    match a {
                        HandshakeAction::Send(m) if self.sides[to].open[c] => {
                            self.q[c][to].push_back(Item::Msg(m));
                        }
                        HandshakeAction::Close(p) => {
                            self.close(to, (p - 10) as usize);
                        }
                        HandshakeAction::Lost(_) => {
                            self.sides[to].lost += 1;
                            self.sides[to].rebinds += 1;
                        }
                        _ => {}
                    }
                }
            }
        }
    }

    /// The engine's `connect` loop on each side's dial, looked at after every step.
    fn follow_dials(&mut self) {
        for s in 0..2 {
            let side = &self.sides[s];
            let out = (0..self.q.len())
                .filter(|&c| self.dialer[c] == s && side.open[c])
                .filter(|&c| side.peers.rank_of(ep(c)).is_none())
                .filter(|&c| side.peers.refusal(ep(c)).is_none())
                .count();
            self.sides[s].most_dials_out = self.sides[s].most_dials_out.max(out);
        }
        for s in 0..2 {
            // The engine wakes a sleeping `connect` only for the ranks the peer table names
            // (`Peers::take_wakes`, drained at the end of each pass), or at its timer: one that
            // would move on without either would sleep on in the engine.
            let wakes = self.sides[s].peers.take_wakes();
            let before = self.sides[s].dial.clone();
            let asleep_for = match before {
                Dial::Joined(r) | Dial::WaitingFor(r) => Some(r),
                _ => None,
            };
            let timer = matches!(before, Dial::WaitingFor(_))
                && self.sides[s].wait_until.is_some_and(|t| self.now >= t);
            let woken = asleep_for.is_some_and(|r| wakes.contains(&r)) || timer;
            if let Dial::Joined(_) = self.sides[s].dial {
                // Bound by the round's dial, or that dial ended and `connect` dials.
                self.connect_looks(s);
            }
            let side = &mut self.sides[s];
            let dial = ep(side.conn);
            if side.dial == Dial::Running && !side.open[side.conn] && !side.redialled {
                // A dial that won a tie and broke before it bound: `connect` dials once more.
                if let Some(won) = side.peers.take_won_tie(dial) {
                    side.redialled = true;
                    self.dial(s);
                    let c = self.sides[s].conn;
                    self.sides[s].peers.redial(ep(c), won);
                    continue;
                }
            }
            let side = &mut self.sides[s];
            let was_dialling = matches!(side.dial, Dial::Running | Dial::Joined(_));
            side.dial = match side.dial.clone() {
                Dial::Running => {
                    if let Some(r) = side.peers.rank_of(dial) {
                        // `connect` keeps the address for reconnect rounds.
                        side.peers.set_dial(r, ADDR);
                        Dial::Done(Ok(r))
                    } else if let Some(r) = side.peers.take_gave_way(dial) {
                        // `wait_for_crossing` looks before it sleeps.
                        waiting_for(&side.peers, r, self.now)
                    } else if let Some(reason) = side.peers.refusal(dial) {
                        Dial::Done(Err(format!("refused: {reason:?}")))
                    } else if !side.open[side.conn] {
                        Dial::Done(Err("connection failed".into()))
                    } else {
                        Dial::Running
                    }
                }
                Dial::WaitingFor(r) => waiting_for(&side.peers, r, self.now),
                d => d,
            };
            if was_dialling && matches!(side.dial, Dial::WaitingFor(_) | Dial::Done(_)) {
                // Its dial is over: a round may dial again (one it waits for, perhaps).
                side.peers.connect_ends(ADDR);
            }
            if asleep_for.is_some() && side.dial != before {
                assert!(
                    woken,
                    "side {s}'s connect ({before:?} -> {:?}) was not woken: the peer table \
                     named only {wakes:?}",
                    side.dial
                );
            }
            // The engine computes its timer when it looks: on its first look, and when woken.
            let looked = woken || !matches!(before, Dial::WaitingFor(_));
            if let Dial::WaitingFor(r) = side.dial {
                if looked {
                    side.wait_until = side.peers.redial_expected_until(r, self.now);
                }
            }
        }
    }

    /// Time passes: refused endpoints are closed after their linger, as the engine's timer does.
    fn tick(&mut self, by: Duration) {
        self.now += by;
        let now = self.now;
        let (due, later): (Vec<_>, Vec<_>) = self.delayed.iter().partition(|d| d.0 <= now);
        self.delayed = later;
        for (_, c, s) in due {
            if std::env::var("TRACE").is_ok() {
                println!("late: side {s}'s close of conn {c} is heard");
            }
            self.q[c][s].push_back(Item::Fail);
        }
        for s in 0..2 {
            let now = self.now;
            for p in self.sides[s].peers.due_closes(now) {
                self.close(s, (p - 10) as usize);
            }
        }
        if self.reconnect {
            self.reconnect_rounds();
        }
    }

    /// The planned fault, if due at this step: a random connection closed from a random side.
    fn fault_if_due(&mut self, steps: usize) {
        if Some(steps) == self.fault_at {
            self.fault_at = None;
            let (c, s) = (self.rand(self.q.len()), self.rand(2));
            if std::env::var("TRACE").is_ok() {
                println!("FAULT: side {s} closes conn {c}");
            }
            self.faulted = self.close(s, c);
            self.fault_conn = self.faulted.then_some(c);
        }
    }

    /// [`Net::join_then_break`]: the `connect` once the round's dial is out, then the close.
    fn join_then_break_if_due(&mut self, steps: usize) {
        if let Some((s, after)) = self.join_then_break {
            let out = (0..self.q.len())
                .find(|&c| self.dialer[c] == s && self.sides[s].peers.round_dial(ep(c)).is_some());
            if let Some(c) = out {
                self.join_then_break = None;
                self.sides[s].redialled = false;
                self.connect(s);
                self.break_round_at = Some((steps + after, c));
            }
        }
        if let Some((_, c)) = self.break_round_at.filter(|&(at, _)| at == steps) {
            self.break_round_at = None;
            let by = self.rand(2);
            if std::env::var("TRACE").is_ok() {
                println!("FAULT: side {by} closes the round's conn {c}");
            }
            self.faulted = self.close(by, c);
        }
    }

    /// Runs to quiet: side `first` dials, the other after `stagger` steps (or once all is
    /// quiet; never with None).
    fn run(&mut self, first: usize, stagger: Option<usize>) {
        self.connect(first);
        let mut steps = 0;
        let second = |n: &Net| stagger.is_some() && n.sides[1 - first].dial == Dial::NotYet;
        loop {
            if Some(steps) == stagger && second(self) {
                self.connect(1 - first);
            }
            self.fault_if_due(steps);
            let ready = self.busy();
            if ready.is_empty() {
                if second(self) {
                    self.connect(1 - first);
                    continue;
                }
                // Let the lingers run out, and what their closes cause arrive.
                self.tick(Duration::from_secs(1));
                self.follow_dials();
                if self.busy().is_empty() && self.delayed.is_empty() {
                    break;
                }
                continue;
            }
            let (c, d) = ready[self.rand(ready.len())];
            self.deliver(c, d);
            self.tick(Duration::from_millis(1));
            self.follow_dials();
            steps += 1;
            assert!(steps < 10_000, "no end");
        }
    }

    /// Delivers in random order, 1 ms a step, and lets time pass when nothing is on the way,
    /// until nothing is left to happen: no message, no close to be heard, no reconnect round
    /// waiting for its next try.
    fn run_to_quiet(&mut self) {
        let mut steps = 0;
        loop {
            self.fault_if_due(steps);
            self.join_then_break_if_due(steps);
            if let Some((_, s)) = self.hand_dial_at.filter(|&(at, _)| at == steps) {
                self.hand_dial_at = None;
                self.sides[s].redialled = false;
                self.connect(s);
            }
            let ready = self.busy();
            if ready.is_empty() {
                let rounds = (0..2).any(|s| {
                    let other = RankId(1 - s as u32);
                    self.sides[s].peers.state(other) == PeerState::Reconnecting
                });
                if self.delayed.is_empty() && !rounds {
                    return;
                }
                self.tick(Duration::from_millis(50));
                self.follow_dials();
            } else {
                let (c, d) = ready[self.rand(ready.len())];
                self.deliver(c, d);
                self.tick(Duration::from_millis(1));
                self.follow_dials();
            }
            steps += 1;
            assert!(steps < 100_000, "no end");
        }
    }

    /// After [`Net::run`]: quiet for longer than the handshake limit, so that handshakes left
    /// without an answer are closed and what that causes arrives.
    fn settle(&mut self) {
        for _ in 0..12 {
            self.tick(Duration::from_secs(1));
            self.follow_dials();
            while let Some(&(c, d)) = self.busy().first() {
                self.deliver(c, d);
                self.follow_dials();
            }
        }
    }
}

#[test]
fn crossing_dials_settle_on_one_connection_in_every_order() {
    let mut endings = [0u32; 2];
    for seed in seeds(4000) {
        let mut net = Net::new(seed, [77, 88]);
        let first = (seed % 2) as usize;
        let stagger = net.rand(12);
        net.run(first, Some(stagger));
        let [a, b] = &net.sides;
        let ctx = format!("seed {seed}, side {first} first, the other after {stagger} steps");
        assert_eq!(a.dial, Dial::Done(Ok(RankId(1))), "{ctx}");
        assert_eq!(b.dial, Dial::Done(Ok(RankId(0))), "{ctx}");
        // Both ends of one connection, both open, one session.
        assert_eq!(binding_outcome(&net, &ctx), "bound on both sides");
        let c = (a.peers.endpoint(RankId(1)).unwrap() - 10) as usize;
        // The other connection is closed on both sides, and the crossing cost nothing.
        assert!(
            !a.open[1 - c] && !b.open[1 - c],
            "{ctx}: the other stayed open"
        );
        for s in [a, b] {
            assert_eq!(s.lost, 0, "{ctx}: a side lost the pair on the way");
            assert_eq!(s.peers.failures, 0, "{ctx}");
            assert_eq!(s.peers.refusals.rank_in_use, 0, "{ctx}");
            assert_eq!(s.peers.refusals.by_peer, 0, "{ctx}");
        }
        endings[net.dialer[c]] += 1;
        // A second `connect` from either side finds the pair connected and gives way.
        for s in 0..2 {
            connect_again(&mut net, s, &ctx);
        }
    }
    // Both connections are kept in some orders (the one that binds first, or the lower rank's
    // on a tie), so both paths ran.
    println!(
        "kept rank 0's dial {} times, rank 1's {}",
        endings[0], endings[1]
    );
    assert!(endings[0] > 100 && endings[1] > 100, "{endings:?}");
}

/// Side `s` dials the other side's process once more, on a new connection: it gives way (its
/// `connect` returns the rank), and neither side loses or refuses anything.
fn connect_again(net: &mut Net, s: usize, ctx: &str) {
    let (me, other) = (RankId(s as u32), RankId(1 - s as u32));
    let now = net.now + Duration::from_millis(1);
    let (dial_ep, answer_ep) = (60, 70);
    let (hs, hello) = Handshake::dial(&net.sides[s].me, 31);
    let side = &mut net.sides[s];
    side.peers.handshakes.insert(dial_ep, hs);
    side.peers.handshake_started(dial_ep, now);
    let o = &mut net.sides[1 - s];
    o.peers.accepted(answer_ep, None, now);
    let answer = sent(o.peers.on_handshake(&o.me, answer_ep, hello, now, 32));
    let side = &mut net.sides[s];
    let out = side.peers.on_handshake(&side.me, dial_ep, answer, now, 33);
    assert_eq!(
        out,
        vec![
            HandshakeAction::GaveWay(other),
            HandshakeAction::Close(dial_ep)
        ],
        "{ctx}: side {s} connects again"
    );
    assert_eq!(side.peers.take_gave_way(dial_ep), Some(other), "{ctx}");
    // The close fails both ends of the new connection; nothing else moves.
    assert_eq!(side.peers.on_failed(dial_ep, now), None, "{ctx}");
    let o = &mut net.sides[1 - s];
    assert_eq!(o.peers.on_failed(answer_ep, now), None, "{ctx}");
    for (side, rank) in [(&net.sides[s], other), (&net.sides[1 - s], me)] {
        assert_eq!(side.peers.state(rank), PeerState::Connected, "{ctx}");
        assert_eq!(side.peers.failures, 0, "{ctx}");
        assert_eq!(side.peers.refusals.rank_in_use, 0, "{ctx}");
    }
}

/// The message the actions send.
fn sent(out: Vec<HandshakeAction<u64>>) -> Message {
    out.into_iter()
        .find_map(|x| match x {
            HandshakeAction::Send(m) => Some(m),
            _ => None,
        })
        .unwrap()
}

fn refused_rank_1(out: Vec<HandshakeAction<u64>>) {
    let refused = HandshakeAction::Refused(kvlink_proto::Refusal::RankInUse, Some(RankId(1)));
    assert!(out.contains(&refused), "{out:?}");
}

#[test]
fn a_dial_to_another_process_with_the_rank_is_still_refused() {
    // Rank 1 is bound here through a connection its process made; a dial from this side that
    // reaches another process claiming rank 1 (another instance) gives no way: RankInUse.
    let mut net = Net::new(1, [77, 88]);
    net.run(1, Some(0));
    assert_eq!(net.sides[0].dial, Dial::Done(Ok(RankId(1))));
    let kept = net.sides[0].peers.endpoint(RankId(1));
    let mut other = Net::new(2, [77, 99]);
    // Side 0 of `net` dials a process of rank 1 with instance 99: feed it that process's
    // answer by hand.
    let a = &mut net.sides[0];
    let (hs, hello) = Handshake::dial(&a.me, 5);
    a.peers.handshakes.insert(30, hs);
    let b = &mut other.sides[1];
    let answer = sent(b.peers.on_handshake(&b.me, 40, hello, other.now, 6));
    let now = net.now;
    refused_rank_1(a.peers.on_handshake(&a.me, 30, answer, now, 7));
    assert_eq!(a.peers.take_gave_way(30), None);
    assert_eq!(a.peers.endpoint(RankId(1)), kept, "the first keeps it");
}

#[test]
fn a_later_dial_claiming_the_same_process_is_refused_and_counted() {
    // Rank 0 dialled rank 1 and bound it, alone. Then a dial claiming rank 1 and its instance
    // (public) comes in: it began after the bind, so it crossed nothing. It is refused and
    // counted as any second claim to a live rank, and the pair keeps its connection.
    let mut net = Net::new(3, [77, 88]);
    net.run(0, None);
    let a = &mut net.sides[0];
    assert_eq!(a.dial, Dial::Done(Ok(RankId(1))));
    let kept = a.peers.endpoint(RankId(1));
    let twin = Identity {
        rank: RankId(1),
        name: "twin".into(),
        instance: 88,
        secret: Secret::none(),
    };
    let now = net.now + Duration::from_millis(5);
    let (mut hs, hello) = Handshake::dial(&twin, 9);
    a.peers.accepted(50, None, now);
    let answer = sent(a.peers.on_handshake(&a.me, 50, hello, now, 10));
    assert!(matches!(
        hs.handle(&twin, answer),
        kvlink_proto::Step::Verified { .. }
    ));
    let proof = hs.accept(&twin, None).unwrap();
    let out = a.peers.on_handshake(&a.me, 50, proof, now, 11);
    // A dial of this side's that gave way to that handshake would be told it ended.
    assert!(
        out.contains(&HandshakeAction::Unbound(RankId(1))),
        "{out:?}"
    );
    refused_rank_1(out);
    assert_eq!(a.peers.refusals.rank_in_use, 1);
    assert_eq!(a.peers.endpoint(RankId(1)), kept);
}

#[test]
fn a_refusal_on_an_endpoint_without_a_handshake_is_ignored() {
    // A bind closed another dial for the rank (its handshake dropped) while the peer's refusal
    // of it was on the way: the refusal finds nothing to refuse, and nothing is counted.
    let mut net = Net::new(4, [77, 88]);
    net.run(0, None);
    let a = &mut net.sides[0];
    let reason = kvlink_proto::Refusal::RankInUse;
    let out = a
        .peers
        .on_handshake(&a.me, 99, Message::Refuse { reason }, net.now, 1);
    assert!(out.is_empty(), "{out:?}");
    assert_eq!(a.peers.refusals.by_peer, 0);
    assert_eq!(a.peers.refusal(99), None);
    assert_eq!(a.peers.state(RankId(1)), PeerState::Connected);
}

/// How a pair came out of a crossing with faults: bound to one connection on both sides, or on
/// neither. Anything else (one side bound alone, the two on different connections, a bound
/// connection closed at one end, different sessions) fails the test.
fn binding_outcome(net: &Net, ctx: &str) -> &'static str {
    let [a, b] = &net.sides;
    match (a.peers.endpoint(RankId(1)), b.peers.endpoint(RankId(0))) {
        (Some(x), Some(y)) => {
            assert_eq!(x, y, "{ctx}: bound to different connections");
            let c = (x - 10) as usize;
            assert!(
                a.open[c] && b.open[c],
                "{ctx}: bound to a connection closed at one end"
            );
            assert!(
                a.peers.session(RankId(1)) == b.peers.session(RankId(0)),
                "{ctx}: different sessions"
            );
            let (ka, kb) = (
                a.peers.keys(RankId(1)).unwrap(),
                b.peers.keys(RankId(0)).unwrap(),
            );
            assert!(
                ka.outbound == kb.inbound && ka.inbound == kb.outbound,
                "{ctx}"
            );
            "bound on both sides"
        }
        (None, None) => "bound on neither side",
        (x, y) => panic!("{ctx}: bound on one side only ({x:?}, {y:?}): a half-open pair"),
    }
}

#[test]
fn drops_late_failures_and_a_broken_connection_never_leave_a_half_open_pair() {
    // What the first test leaves out of the network: a close drops a random tail of what its
    // side had sent on that connection (UCX's force close may drop queued sends), and the
    // other side may hear of a close only up to 12 s later (keepalive). Without a fault (none
    // planned, or it came after the run or found its connection closed) the late failures
    // change nothing: every order ends as in the first test. With one connection broken at a
    // random step (closed from a random side), the pair may end unbound (that is the fault),
    // but never bound on one side only or on two connections, and every `connect` ends.
    let mut outcomes = Tally::default();
    let (mut healed, mut refused) = (0, 0);
    let (mut quiet_drops, mut quiet_late, mut fault_drops) = (0, 0, 0);
    let mut answered: std::collections::BTreeMap<String, u32> = Default::default();
    for seed in seeds(4000) {
        let mut net = Net::new(seed, [77, 88]);
        net.drops = true;
        if (seed / 4) % 2 == 1 {
            net.late_fail = Some(Duration::from_secs(12));
        }
        if seed % 4 != 0 {
            net.fault_at = Some(net.rand(16));
        }
        let first = (seed % 2) as usize;
        let stagger = net.rand(12);
        let ctx = format!(
            "seed {seed}, side {first} first, the other after {stagger} steps, fault at step {:?}",
            net.fault_at
        );
        net.run(first, Some(stagger));
        net.settle();
        let outcome = binding_outcome(&net, &ctx);
        // A fault that came after the run, or found its connection already closed, is none.
        let fault = net.faulted;
        if fault {
            fault_drops += net.dropped;
        } else {
            quiet_drops += net.dropped;
            quiet_late += usize::from(net.late_fail.is_some());
        }
        let [a, b] = &net.sides;
        for (s, other) in [(a, 1), (b, 0)] {
            assert!(
                matches!(s.dial, Dial::Done(_)),
                "{ctx}: a connect never ended: {:?}",
                s.dial
            );
            if s.dial == Dial::Done(Ok(RankId(other)))
                && s.peers.state(RankId(other)) != PeerState::Connected
            {
                assert!(s.lost > 0, "{ctx}: connect returned the rank, which was never lost, and it is not connected");
            }
        }
        if !fault {
            assert_eq!(outcome, "bound on both sides", "{ctx}");
            assert_eq!(a.dial, Dial::Done(Ok(RankId(1))), "{ctx}");
            assert_eq!(b.dial, Dial::Done(Ok(RankId(0))), "{ctx}");
            for s in [a, b] {
                assert_eq!((s.lost, s.peers.failures), (0, 0), "{ctx}");
                assert_eq!(
                    s.peers.refusals.rank_in_use + s.peers.refusals.by_peer,
                    0,
                    "{ctx}"
                );
            }
        }
        // A dial that won a tie and broke before it bound dials once more. The pair then ends
        // bound on both sides and that `connect` returns the rank; an other side that had bound
        // the broken connection and not yet heard it broke takes the redial's resume proof of
        // that session as the same process coming back. (A redial refused all the same would
        // count in `refused`; the order's one fault is spent on the first dial.)
        for (s, other) in [(a, 1), (b, 0)] {
            if s.redialled {
                if s.dial == Dial::Done(Ok(RankId(other))) {
                    assert_eq!(outcome, "bound on both sides", "{ctx}: after a redial");
                    healed += 1;
                    let o = &net.sides[other as usize];
                    *answered.entry(format!("{:?}", o.dial)).or_insert(0) += 1;
                } else {
                    assert_eq!(
                        s.dial,
                        Dial::Done(Err("refused: RankInUse".into())),
                        "{ctx}: after a redial"
                    );
                    refused += 1;
                }
            }
        }
        let ok = |d: &Dial| matches!(d, Dial::Done(Ok(_)));
        let fault = if fault { "fault:" } else { "no fault:" };
        let (a, b) = (ok(&a.dial), ok(&b.dial));
        outcomes.add(format!("{fault} {outcome}, connects ok: {a} {b}"), seed);
    }
    outcomes.print();
    println!("redialled: {healed} orders connected by it, {refused} refused");
    println!("  the other side's connect in those it connected: {answered:?}");
    println!(
        "orders without a fault: {quiet_late} heard closes late, {quiet_drops} messages dropped; \
         with a fault: {fault_drops} dropped"
    );
    // Deterministic: docs/RELIABILITY.md quotes these (update it with them).
    assert_eq!(
        (healed, refused),
        (52, 0),
        "orders the redial connected, refused"
    );
    let waited = answered.get("Done(Ok(RankId(0)))").copied();
    // The rest heard of the break later than REDIAL_WAIT (closes here are heard up to 12 s
    // late; UCX's keepalive finds a dead connection within about two of its 1 s intervals).
    assert_eq!(
        waited,
        Some(30),
        "the other rank's connect returned the rank: {answered:?}"
    );
    // A losing connection is closed only after its last message arrived, so only a fault drops
    // anything; late failures run in orders without one too.
    assert_eq!(quiet_drops, 0);
    assert!(
        quiet_late > 500 && fault_drops > 100,
        "{quiet_late} {fault_drops}"
    );
}

/// Rank 0 dials on connection 1 and rank 1 on connection 0; rank 0 refuses rank 1's dial for
/// the tie its own dial wins, whose `Proof` is out and whose `Welcome` has not come.
fn tie_won() -> Net {
    let mut net = Net::new(5, [77, 88]);
    net.dial(1);
    net.dial(0);
    for (c, from) in [(0, 1), (1, 0), (1, 0), (0, 1), (0, 0), (1, 1)] {
        net.deliver(c, from);
    }
    // Rank 1's `Proof` on its dial reaches rank 0.
    net.deliver(0, 1);
    assert!(
        net.sides[0].peers.refusal(ep(0)).is_some(),
        "rank 1's dial refused"
    );
    net
}

#[test]
fn a_won_tie_is_remembered_for_its_dial_until_taken_bound_or_old() {
    // Taken once, for the dial that won.
    let mut net = tie_won();
    let p = &mut net.sides[0].peers;
    assert!(
        p.take_won_tie(ep(0)).is_none(),
        "not for the refused endpoint"
    );
    assert_eq!(p.take_won_tie(ep(1)).map(|w| w.rank), Some(RankId(1)));
    assert!(p.take_won_tie(ep(1)).is_none(), "taken once");
    // Gone once the rank is bound: the dial completes.
    let mut net = tie_won();
    net.deliver(1, 0);
    net.deliver(1, 1);
    assert_eq!(net.sides[0].peers.state(RankId(1)), PeerState::Connected);
    assert!(net.sides[0].peers.take_won_tie(ep(1)).is_none(), "bound");
    // Gone after a minute untaken.
    let mut net = tie_won();
    net.tick(Duration::from_secs(61));
    assert!(net.sides[0].peers.take_won_tie(ep(1)).is_none(), "expired");
}

#[test]
fn a_dial_that_gave_way_waits_a_while_for_the_redial_of_a_dial_that_broke() {
    // Rank 1's dial is refused for rank 0's tie and gives way to rank 0's dial, which then
    // breaks at rank 1: rank 0 will dial again (its `connect` redials a won tie), and rank 1's
    // `connect` waits REDIAL_WAIT for it, not to its deadline and not past the window.
    let mut net = tie_won();
    net.deliver(0, 0);
    assert_eq!(net.sides[1].peers.take_gave_way(ep(0)), Some(RankId(0)));
    assert!(net.sides[1].peers.waiting_for_crossing(RankId(0), net.now));
    net.close(1, 1);
    let (t, p) = (net.now, &net.sides[1].peers);
    let wait = kvlink_proto::peers::REDIAL_WAIT;
    assert_eq!(p.redial_expected_until(RankId(0), t), Some(t + wait));
    assert!(p.waiting_for_crossing(RankId(0), t + wait - Duration::from_millis(1)));
    // After the window: no more waiting (a wait ends then, as PeerLost: it was expected).
    let after = t + wait + Duration::from_millis(1);
    assert_eq!(p.redial_expected_until(RankId(0), after), None);
    assert!(!p.waiting_for_crossing(RankId(0), after));
    assert!(p.redial_was_expected(RankId(0)));
    // A bind of the rank, or time, forgets it.
    net.tick(Duration::from_secs(11));
    assert!(!net.sides[1].peers.redial_was_expected(RankId(0)));
}

/// The same, in the order the sanitizer's CI run met on 2026-12-07 (`crossing_dials`
/// `a_won_tie_whose_connection_breaks_is_healed_by_a_redial`, round 5): rank 1 gives way, then
/// binds rank 0's dial (its `Proof` arrives), and only then does that connection break. The
/// bind must not forget that a dial of rank 1's gave way to it: rank 0 redials, and rank 1's
/// `connect` waits for that. Before, the bind dropped the give-way, the break expected no
/// redial, and rank 1's `connect` failed at once ("gave way ... which failed"), its process
/// exiting under rank 0's redial.
#[test]
fn a_dial_that_gave_way_before_the_winners_bind_still_waits_for_its_redial() {
    let mut net = tie_won();
    net.deliver(0, 0); // the refusal reaches rank 1: it gives way
    assert_eq!(net.sides[1].peers.take_gave_way(ep(0)), Some(RankId(0)));
    net.deliver(1, 0); // rank 0's `Proof`: rank 1 binds connection 1
    assert_eq!(net.sides[1].peers.state(RankId(0)), PeerState::Connected);
    net.fail(1, 1); // the won tie's connection breaks at rank 1
    let p = &net.sides[1].peers;
    assert!(
        p.redial_was_expected(RankId(0)),
        "rank 1 expects no redial of rank 0"
    );
    assert!(p.waiting_for_crossing(RankId(0), net.now));
    assert!(
        net.sides[0].peers.take_won_tie(ep(1)).is_some(),
        "rank 0 redials"
    );
}

/// For the reconnect tests: a crossing settled with reconnect rounds on (no fault), and how its
/// connection will break: (the net, the order's text, the kept connection, the side that dialled
/// it, the side that will close it). Closes are heard at once or (in two orders of three) up to
/// 12 s late.
fn settled_then_to_break(seed: u64) -> (Net, String, usize, usize, usize) {
    let mut net = Net::new(seed, [77, 88]);
    net.drops = true;
    net.reconnect = true;
    let first = (seed % 2) as usize;
    let stagger = net.rand(12);
    net.run(first, Some(stagger));
    net.settle();
    let ctx = format!("seed {seed}, side {first} first, the other after {stagger} steps");
    assert_eq!(binding_outcome(&net, &ctx), "bound on both sides");
    let kept = (net.sides[0].peers.endpoint(RankId(1)).unwrap() - 10) as usize;
    let dialler = net.dialer[kept];
    if seed % 3 != 0 {
        net.late_fail = Some(Duration::from_secs(12));
    }
    let closer = net.rand(2);
    (net, ctx, kept, dialler, closer)
}

#[test]
fn a_broken_pair_is_bound_again_by_the_reconnect_round_of_the_side_whose_dial_it_kept() {
    // The crossing settles (no fault); then the pair's connection breaks, closed from a random
    // side, with what that side had queued dropped, and heard at the other end at once or up
    // to 12 s later (keepalive). The side whose dial the pair kept runs its reconnect rounds
    // (the other side only answers); the pair ends bound again on both sides, to one new
    // connection, one failure counted on each side and nothing refused. Where the dialler's
    // redial reaches a side that still holds the broken connection bound, its resume proof
    // rebinds the rank (the same process coming back).
    let (mut resumed, mut second_breaks, mut early_closes) = (0, 0, 0);
    let mut rounds_taken: std::collections::BTreeMap<u32, u32> = Default::default();
    for seed in seeds(2000) {
        let (mut net, ctx, kept, dialler, closer) = settled_then_to_break(seed);
        // In half the orders a second break, of a random connection at a random step of the
        // reconnect (the redial's own, often): the round tries again.
        if seed % 2 == 1 {
            net.fault_at = Some(net.rand(8));
        }
        let ctx = format!(
            "{ctx}: conn {kept} (side {dialler}'s dial) closed by side {closer}, then a fault at \
             step {:?}",
            net.fault_at
        );
        assert!(net.close(closer, kept), "{ctx}");
        net.run_to_quiet();
        net.settle();
        assert_eq!(binding_outcome(&net, &ctx), "bound on both sides", "{ctx}");
        let now_kept = (net.sides[0].peers.endpoint(RankId(1)).unwrap() - 10) as usize;
        assert_ne!(now_kept, kept, "{ctx}: bound to the broken connection");
        assert_eq!(
            net.dialer[now_kept], dialler,
            "{ctx}: not the dialler's redial"
        );
        assert_eq!(
            net.redials[1 - dialler],
            0,
            "{ctx}: the answering side dialled"
        );
        for (s, other) in [(&net.sides[0], 1), (&net.sides[1], 0)] {
            assert_eq!(s.peers.state(RankId(other)), PeerState::Connected, "{ctx}");
            assert_eq!(
                s.peers.refusals.rank_in_use + s.peers.refusals.by_peer,
                0,
                "{ctx}: a refusal"
            );
        }
        // The closing side's endpoint failed at once: one failure. The other side counts one
        // too: when it hears of the break, or when the redial's resume proof rebinds the rank
        // before that (then the break heard later is not counted again).
        let failures = |s: usize| net.sides[s].peers.failures;
        // (Only the dialler's close leaves the other side holding the broken connection.)
        if !net.faulted {
            assert_eq!(failures(closer), 1, "{ctx}");
            assert_eq!(failures(1 - closer), 1, "{ctx}");
            let rebound = net.sides[1 - closer].rebinds > 0;
            assert!(net.sides[1 - closer].rebinds <= 1, "{ctx}");
            assert!(!rebound || closer == dialler, "{ctx}: rebound, but how?");
            resumed += u32::from(rebound);
        }
        // The second fault closed a connection open at that end: the reconnect's (a second
        // break), or the broken one's other end (its break heard at once).
        match net.fault_conn {
            Some(c) if c == kept => early_closes += 1,
            Some(_) => second_breaks += 1,
            None => {}
        }
        *rounds_taken.entry(net.redials[dialler]).or_insert(0) += 1;
    }
    println!(
        "reconnect dials per order: {rounds_taken:?}; {second_breaks} with a second break of \
         the reconnect's connection, {early_closes} with the broken one's other end closed \
         too; in {resumed} of the others the redial's resume proof rebound a side that still \
         held the broken connection"
    );
    // Deterministic: docs/RELIABILITY.md quotes these (update it with them).
    assert_eq!((resumed, second_breaks, early_closes), (497, 180, 135));
    let two = rounds_taken.get(&2).copied();
    assert_eq!(
        (rounds_taken.len(), two),
        (2, Some(180)),
        "{rounds_taken:?}"
    );
}

#[test]
fn a_connect_by_hand_during_a_reconnect_round_ends_on_one_connection() {
    // As the third test (no second break), and one side calls `connect` at a random step of
    // the reconnect (an application that saw the pair fail): the side that only answers, or
    // the side whose round redials. On the side that only answers, its dial crosses the
    // round's. On the redialling side, it joins the round's dial if one is out, or dials in its
    // place (the round holds off while it does): that side never has two dials out to the
    // rank. The pair ends bound on both sides to one connection in every order, that `connect`
    // returning the rank, with nothing refused.
    let mut outcomes = Tally::default();
    for seed in seeds(2000) {
        let (mut net, ctx, kept, dialler, closer) = settled_then_to_break(seed);
        net.sides[dialler].most_dials_out = 0;
        // Within the round's first steps (it takes seven when the break is heard at once).
        let at = net.rand(7);
        let hand = if seed % 4 < 2 { 1 - dialler } else { dialler };
        net.hand_dial_at = Some((at, hand));
        let ctx = format!(
            "{ctx}: conn {kept} (side {dialler}'s dial) closed by side {closer}; side {hand} \
             connects at step {at}"
        );
        assert!(net.close(closer, kept), "{ctx}");
        net.run_to_quiet();
        assert_eq!(net.hand_dial_at, None, "{ctx}: the connect never ran");
        net.settle();
        let outcome = binding_outcome(&net, &ctx);
        assert_eq!(outcome, "bound on both sides", "{ctx}");
        let dial = &net.sides[hand].dial;
        assert!(matches!(dial, Dial::Done(_)), "{ctx}: {dial:?}");
        let most = net.sides[dialler].most_dials_out;
        assert!(
            most <= 1,
            "{ctx}: the redialling side had {most} dials out at once"
        );
        let refused: u64 = net
            .sides
            .iter()
            .map(|s| s.peers.refusals.rank_in_use + s.peers.refusals.by_peer)
            .sum();
        let who = if hand != dialler {
            "the other side".to_string()
        } else {
            let (began, rounds) = (net.sides[hand].began, net.redials[dialler]);
            let own = net.sides[hand].own_dials;
            format!("the redialling side ({began}, {own} own dials; {rounds} round dials)")
        };
        outcomes.add(
            format!("{who}: {outcome}, {dial:?}, refused {refused}"),
            seed,
        );
    }
    outcomes.print();
    // Deterministic: docs/RELIABILITY.md quotes these (update it with them). Before the
    // redialling side kept to one dial, five orders ended `RankInUse` there: its two dials
    // both reached the other side, which bound the round's and then, taking the `connect`'s
    // as the same process proving the session again, that one; this side bound the round's
    // first, refused the other's `Welcome`, and the pair went through one more round.
    let count = |f: &dyn Fn(&str) -> bool| outcomes.count(f);
    assert_eq!(count(&|k| k.contains("Err")), 0, "{outcomes:?}");
    assert_eq!(count(&|k| !k.ends_with("refused 0")), 0, "{outcomes:?}");
    // How the redialling side's `connect` went: it waited for the round's dial, which bound the
    // rank (no dial of its own); or it dialled while the round held off (the round never
    // dialled); or it dialled and its dial gave way to a bound connection (the broken one, its
    // break not yet heard there, or one a round dial had bound already), the round binding the
    // pair again.
    let began = |how: &str, own: u32, rounds: u32| {
        count(&|k| k.contains(&format!("({how}, {own} own dials; {rounds} round dials)")))
    };
    let ways = [
        began("joined the round's dial", 0, 1),
        began("dialled", 1, 0),
        began("dialled", 1, 1),
    ];
    assert_eq!(ways, [458, 133, 409], "{outcomes:?}");
}

#[test]
fn a_connect_that_waits_for_the_rounds_dial_dials_in_its_place_when_that_dial_breaks() {
    // As the fourth test, and the redialling side calls `connect` as soon as its round has a
    // dial out: it waits for that dial. That dial's connection is then closed, from either side,
    // 0-5 steps later (before its handshake ends, or after). The `connect` dials in its place
    // when the round's dial ends unbound, or returns the rank when it bound first; the pair ends
    // bound on one connection, that `connect` returning the rank, nothing refused, never two
    // dials out on that side.
    let mut outcomes = Tally::default();
    for seed in seeds(1000) {
        let (mut net, ctx, kept, dialler, closer) = settled_then_to_break(seed);
        net.sides[dialler].most_dials_out = 0;
        let after = net.rand(6);
        net.join_then_break = Some((dialler, after));
        let ctx = format!(
            "{ctx}: conn {kept} (side {dialler}'s dial) closed by side {closer}; side {dialler} \
             connects once its round dials, whose connection breaks {after} steps later"
        );
        assert!(net.close(closer, kept), "{ctx}");
        net.run_to_quiet();
        assert_eq!(net.join_then_break, None, "{ctx}: the round never dialled");
        net.settle();
        assert_eq!(binding_outcome(&net, &ctx), "bound on both sides", "{ctx}");
        let side = &net.sides[dialler];
        assert_eq!(side.began, "joined the round's dial", "{ctx}");
        assert!(
            matches!(side.dial, Dial::Done(Ok(_))),
            "{ctx}: {:?}",
            side.dial
        );
        assert!(
            side.most_dials_out <= 1,
            "{ctx}: {} dials out",
            side.most_dials_out
        );
        for s in &net.sides {
            let refused = s.peers.refusals.rank_in_use + s.peers.refusals.by_peer;
            assert_eq!(refused, 0, "{ctx}: a refusal");
        }
        // The `connect` dialled in the round's place (once) when that dial ended unbound, and not
        // at all when it had bound first (a later round dial bound the pair again after its
        // break).
        let (own, rounds) = (net.sides[dialler].own_dials, net.redials[dialler]);
        outcomes.add(
            format!("connect's own dials {own}, round dials {rounds}"),
            seed,
        );
    }
    outcomes.print();
    // Deterministic: docs/RELIABILITY.md quotes these (update it with them).
    let n = |key: &str| outcomes.count(&|k| k == key);
    let in_place = n("connect's own dials 1, round dials 1");
    let bound_first = n("connect's own dials 0, round dials 2");
    assert_eq!(
        (in_place, bound_first, outcomes.0.len()),
        (805, 195, 2),
        "{outcomes:?}"
    );
}

/// A `connect` whose dial gave way sleeps (to its deadline: no redial is expected yet). The
/// dial it gave way to then breaks, and its redial is expected for `REDIAL_WAIT`: the engine's
/// sleeper learns that only if it is woken (the failure wakes the handshake's rank). None comes,
/// and the `connect` ends at the end of that wait, not at its deadline.
#[test]
fn a_connect_asleep_is_woken_when_the_dial_it_gave_way_to_breaks() {
    let mut net = tie_won();
    net.follow_dials();
    net.deliver(0, 0); // the tie's refusal reaches rank 1: its dial gives way
    net.follow_dials();
    assert_eq!(net.sides[1].dial, Dial::WaitingFor(RankId(0)));
    assert_eq!(net.sides[1].wait_until, None, "sleeps to its deadline");
    net.close(1, 1); // rank 0's dial breaks at rank 1: its redial is expected
    net.follow_dials();
    net.tick(Duration::from_secs(6)); // no redial comes
    net.follow_dials();
    assert!(
        matches!(net.sides[1].dial, Dial::Done(Err(_))),
        "{:?}",
        net.sides[1].dial
    );
}
