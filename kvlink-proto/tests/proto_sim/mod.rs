//! A deterministic simulator for the protocol core (quinn-proto `tests/util.rs` style): a
//! simulated clock, any number of generation (receiving) and context (sending) ranks, a network
//! that drops, duplicates, reorders, delays and replays stale-generation messages inside a fault
//! window, tag-matched data whose landing is the receive's completion, cancels and reaps that
//! race data, ranks that die (detected or silent), and an invariant checker.
#![allow(dead_code)]
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvlink_proto::error::Outcome;
use kvlink_proto::{
    reduce, Action, BufferDesc, BufferId, BufferKind, BufferPool, Collective, Config, Endpoint,
    Event, Lease, Message, RankId, ReceiveFlow, ReceiveSpec, RequestKey, Role, Token,
    TokenAllocator,
};

/// The outcomes of every terminal event `ep` has queued for `key` in `role`, draining them.
pub fn terminals(ep: &mut Endpoint, key: RequestKey, role: Role) -> Vec<Outcome> {
    std::iter::from_fn(|| ep.poll_event())
        .filter_map(|e| match e {
            Event::Terminal {
                key: k,
                role: r,
                outcome,
                ..
            } if k == key && r == role => Some(outcome),
            _ => None,
        })
        .collect()
}

pub fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

pub fn config() -> Config {
    Config {
        timeout: ms(1000),
        agreement_bound: ms(500),
        retransmit: ms(50),
        linger: ms(500),
        ..Config::default()
    }
}

/// One 64-byte KV buffer at a fixed address, under `token`.
pub fn kv_desc(token: Token) -> BufferDesc {
    BufferDesc {
        kind: BufferKind::Kv,
        segment: 0,
        addr: 0x1000,
        len: 64,
        device_id: -1,
        token,
    }
}

/// A receive of one buffer on rank `me` from `sender`.
pub fn one_buffer(
    key: RequestKey,
    me: RankId,
    sender: RankId,
    lease: Lease,
    desc: BufferDesc,
    timeout: Option<Duration>,
) -> ReceiveSpec {
    ReceiveSpec {
        key,
        receivers: vec![me],
        flows: vec![ReceiveFlow {
            sender,
            buffers: vec![(lease, desc)],
        }],
        request_info: vec![],
        timeout,
    }
}

/// Starts request `key` at `t` on `ep` (rank `me`) with two receiving ranks, `receivers` (the
/// first coordinates), and one buffer (segment 0, not landed) from `sender`; returns that
/// buffer's descriptor.
pub fn start_two_receiver_request(
    ep: &mut Endpoint,
    me: RankId,
    receivers: [RankId; 2],
    sender: RankId,
    key: RequestKey,
    t: Instant,
) -> BufferDesc {
    start_two_receiver_request_for(ep, me, receivers, sender, key, t, None)
}

/// [`start_two_receiver_request`] with the request's own timeout (`None`: the default).
pub fn start_two_receiver_request_for(
    ep: &mut Endpoint,
    me: RankId,
    receivers: [RankId; 2],
    sender: RankId,
    key: RequestKey,
    t: Instant,
    timeout: Option<Duration>,
) -> BufferDesc {
    let lease = BufferPool::new(4).lease(key).unwrap();
    let desc = kv_desc(TokenAllocator::default().allocate().unwrap());
    let spec = ReceiveSpec {
        receivers: receivers.to_vec(),
        ..one_buffer(key, me, sender, lease, desc, timeout)
    };
    ep.start_receive(t, spec).unwrap();
    desc
}

/// xorshift64*: deterministic, seeded by the schedule.
#[derive(Clone, Debug)]
pub struct Rng(u64);
impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// True with probability `per_mille` / 1000.
    pub fn chance(&mut self, per_mille: u32) -> bool {
        (self.next() % 1000) < per_mille as u64
    }
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next() % n
        }
    }
}

#[derive(Clone, Debug, Default)]
pub struct Faults {
    pub drop: u32,
    pub dup: u32,
    /// Extra random delay (reordering) up to this many ms.
    pub jitter_ms: u64,
    /// Replays of a message with its generation lowered by one.
    pub stale: u32,
    /// Data that arrives far too late (a frozen sender's write).
    pub zombie: u32,
    /// A cancelled receive that is never reaped (the transport wedges).
    pub stuck_reap: u32,
    /// Faults apply to what is sent before this time; afterwards the network is reliable.
    pub window_ms: u64,
}

#[derive(Clone, Debug)]
pub struct ReqPlan {
    pub id: u64,
    pub start_ms: u64,
    pub segs_per_flow: u32,
    /// Start generation 1 on every generation rank if generation 0 failed there.
    pub retry: bool,
}

#[derive(Clone, Debug)]
pub struct Plan {
    pub n_gen: usize,
    pub n_ctx: usize,
    pub reqs: Vec<ReqPlan>,
    pub faults: Faults,
    pub reject: u32,
    pub stall: u32,
    /// (time, rank index over gen ranks then ctx ranks, request index)
    pub cancels: Vec<(u64, usize, usize)>,
    /// (time, rank index, detected by the transport)
    pub death: Option<(u64, usize, bool)>,
    /// (time, rank index, rank index, heal after ms): the connection between two ranks breaks
    /// (what is in flight between them is lost, each is told the other is lost within 10 ms)
    /// and is bound again that much later (at least 20 ms: after both were told).
    pub flap: Option<(u64, usize, usize, u64)>,
    pub pool_capacity: u32,
    pub external: bool,
    pub seed: u64,
    /// How much later (ms) each generation rank, by index, starts every request than planned
    /// (none: 0): ranks that start apart, a late coordinator among them.
    pub late: Vec<u64>,
}

impl Plan {
    pub fn simple(n_gen: usize, n_ctx: usize, reqs: Vec<ReqPlan>) -> Plan {
        Plan {
            n_gen,
            n_ctx,
            reqs,
            faults: Faults::default(),
            reject: 0,
            stall: 0,
            cancels: vec![],
            death: None,
            flap: None,
            pool_capacity: 64,
            external: false,
            seed: 1,
            late: vec![],
        }
    }
}

pub fn gen_rank(i: usize) -> RankId {
    RankId(100 + i as u32)
}
pub fn ctx_rank(i: usize) -> RankId {
    RankId(200 + i as u32)
}

#[derive(Clone, Debug)]
enum Item {
    Msg {
        from: RankId,
        to: RankId,
        msg: Message,
    },
    Data {
        from: RankId,
        to: RankId,
        key: RequestKey,
        token: Token,
        segment: u32,
    },
    SendDone {
        node: RankId,
        key: RequestKey,
        to: RankId,
        segment: u32,
        ok: bool,
    },
    Reap {
        node: RankId,
        token: Token,
    },
    PeerLost {
        node: RankId,
        lost: RankId,
    },
    Start {
        node: RankId,
        req: usize,
        generation: u32,
    },
    Accept {
        node: RankId,
        key: RequestKey,
        from: RankId,
        ready: bool,
    },
    Cancel {
        node: RankId,
        req: usize,
    },
    Die {
        node: RankId,
        detected: bool,
    },
    /// The connection between `node` and `other` breaks ([`Plan::flap`]).
    Cut {
        node: RankId,
        other: RankId,
        heal_after: u64,
    },
    /// It is bound again: each side's transport proves the other.
    Heal {
        node: RankId,
        other: RankId,
    },
}

#[derive(Debug)]
struct Posted {
    key: RequestKey,
    segment: u32,
    lease: Lease,
}

struct Node {
    ep: Endpoint,
    pool: BufferPool,
    tokens: TokenAllocator,
    posted: BTreeMap<Token, Posted>,
    /// Which request's data each buffer holds, as written by landings.
    content: BTreeMap<BufferId, RequestKey>,
    /// Segments of each request this rank started, with their leases.
    started: BTreeMap<RequestKey, Vec<(u32, Lease)>>,
    /// Data sends still in the network: (key, to, segment) -> net slot.
    inflight: BTreeMap<(RequestKey, RankId, u32), (Duration, u64)>,
}

/// What one rank reported for one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Terminal {
    pub outcome: Outcome,
    pub at: Duration,
    pub began: Duration,
}

/// The group of a request and the votes contributed so far.
type Contributions = (Vec<RankId>, BTreeMap<RankId, Outcome>);

/// An in-memory allgather standing in for MPI / a Torch process group.
#[derive(Clone, Default)]
pub struct MemCollective {
    state: Arc<Mutex<BTreeMap<RequestKey, Contributions>>>,
}

impl Collective for MemCollective {
    fn contribute(
        &mut self,
        _now: Instant,
        key: RequestKey,
        group: &[RankId],
        me: RankId,
        vote: Outcome,
    ) {
        let mut s = self.state.lock().unwrap();
        let e = s
            .entry(key)
            .or_insert_with(|| (group.to_vec(), BTreeMap::new()));
        e.1.insert(me, vote);
    }
    fn poll_verdict(&mut self, key: RequestKey) -> Option<Outcome> {
        let s = self.state.lock().unwrap();
        let (group, votes) = s.get(&key)?;
        if group.iter().all(|r| votes.contains_key(r)) {
            Some(reduce(votes.values().copied()))
        } else {
            None
        }
    }
}

pub struct Sim {
    pub base: Instant,
    pub now: Duration,
    pub cfg: Config,
    pub plan: Plan,
    rng: Rng,
    nodes: BTreeMap<RankId, Node>,
    net: BTreeMap<(Duration, u64), Item>,
    seq: u64,
    pub dead: BTreeSet<RankId>,
    /// Pairs of ranks whose connection is broken now (lower rank first).
    cut: BTreeSet<(RankId, RankId)>,
    pub violations: Vec<String>,
    pub terminals: BTreeMap<(RankId, RequestKey, Role), Terminal>,
    began: BTreeMap<(RankId, RequestKey, Role), Duration>,
    pub steps: u64,
    /// Keys whose messages saw a fault (for the agreement check).
    pub stale_injected: u64,
    pub not_started: u64,
    history: Vec<(RankId, RankId, Message)>,
}

pub const MAX_STEPS: u64 = 200_000;

impl Sim {
    pub fn new(plan: Plan) -> Sim {
        Self::with_config(plan, config())
    }

    pub fn with_config(plan: Plan, cfg: Config) -> Sim {
        let collective = MemCollective::default();
        let mut nodes = BTreeMap::new();
        let ranks: Vec<RankId> = (0..plan.n_gen)
            .map(gen_rank)
            .chain((0..plan.n_ctx).map(ctx_rank))
            .collect();
        for r in ranks {
            let ep = if plan.external {
                Endpoint::with_collective(r, cfg, Box::new(collective.clone()))
            } else {
                Endpoint::new(r, cfg)
            };
            nodes.insert(
                r,
                Node {
                    ep,
                    pool: BufferPool::new(plan.pool_capacity),
                    tokens: TokenAllocator::default(),
                    posted: BTreeMap::new(),
                    content: BTreeMap::new(),
                    started: BTreeMap::new(),
                    inflight: BTreeMap::new(),
                },
            );
        }
        let mut sim = Sim {
            base: Instant::now(),
            now: Duration::ZERO,
            cfg,
            rng: Rng::new(plan.seed),
            plan,
            nodes,
            net: BTreeMap::new(),
            seq: 0,
            dead: BTreeSet::new(),
            cut: BTreeSet::new(),
            violations: vec![],
            terminals: BTreeMap::new(),
            began: BTreeMap::new(),
            steps: 0,
            stale_injected: 0,
            not_started: 0,
            history: vec![],
        };
        for (i, r) in sim.plan.reqs.clone().iter().enumerate() {
            for g in 0..sim.plan.n_gen {
                let jitter = sim.rng.below(5);
                let late = sim.plan.late.get(g).copied().unwrap_or(0);
                sim.schedule(
                    ms(r.start_ms + jitter + late),
                    Item::Start {
                        node: gen_rank(g),
                        req: i,
                        generation: 0,
                    },
                );
            }
        }
        for &(t, rank, req) in &sim.plan.cancels.clone() {
            let node = sim.rank_at(rank);
            sim.schedule(ms(t), Item::Cancel { node, req });
        }
        if let Some((t, rank, detected)) = sim.plan.death {
            let node = sim.rank_at(rank);
            sim.schedule(ms(t), Item::Die { node, detected });
        }
        if let Some((t, a, b, heal_after)) = sim.plan.flap {
            let (node, other) = (sim.rank_at(a), sim.rank_at(b));
            if node != other {
                let heal_after = heal_after.max(20);
                sim.schedule(
                    ms(t),
                    Item::Cut {
                        node,
                        other,
                        heal_after,
                    },
                );
            }
        }
        sim
    }

    fn rank_at(&self, i: usize) -> RankId {
        let n = self.plan.n_gen + self.plan.n_ctx;
        let i = i % n;
        if i < self.plan.n_gen {
            gen_rank(i)
        } else {
            ctx_rank(i - self.plan.n_gen)
        }
    }

    fn at(&self) -> Instant {
        self.base + self.now
    }

    fn schedule(&mut self, at: Duration, item: Item) -> (Duration, u64) {
        self.seq += 1;
        let slot = (at, self.seq);
        self.net.insert(slot, item);
        slot
    }

    fn violation(&mut self, s: String) {
        self.violations.push(format!("t={:?}: {s}", self.now));
    }

    fn in_window(&self) -> bool {
        self.now < ms(self.plan.faults.window_ms)
    }

    fn is_cut(&self, a: RankId, b: RankId) -> bool {
        self.cut.contains(&(a.min(b), a.max(b)))
    }

    fn transmit(&mut self, from: RankId, to: RankId, msg: Message) {
        // Every message goes through the codec, as it would on the wire.
        let bytes = msg.to_bytes().expect("core emitted an unencodable message");
        let msg = Message::decode(&bytes).expect("core emitted an undecodable frame");
        if self.is_cut(from, to) {
            return; // no connection to send it on
        }
        let f = self.plan.faults.clone();
        let base_delay = 1 + self.rng.below(5);
        if self.in_window() {
            if self.rng.chance(f.drop) {
                return;
            }
            let copies = if self.rng.chance(f.dup) { 2 } else { 1 };
            for _ in 0..copies {
                let d = base_delay + self.rng.below(f.jitter_ms + 1);
                self.schedule(
                    self.now + ms(d),
                    Item::Msg {
                        from,
                        to,
                        msg: msg.clone(),
                    },
                );
            }
            if let Some(k) = msg.key() {
                if k.generation.0 > 0 && self.rng.chance(f.stale) {
                    // Replay a message the previous attempt really sent between the same ranks.
                    let old: Vec<Message> = self
                        .history
                        .iter()
                        .filter(|(a, b, m)| {
                            (*a, *b) == (from, to)
                                && m.key().is_some_and(|o| o.is_older_attempt_of(&k))
                        })
                        .map(|h| h.2.clone())
                        .collect();
                    if !old.is_empty() {
                        self.stale_injected += 1;
                        let m = old[self.rng.below(old.len() as u64) as usize].clone();
                        let d = base_delay + self.rng.below(f.jitter_ms + 1);
                        self.schedule(self.now + ms(d), Item::Msg { from, to, msg: m });
                    }
                }
            }
            if msg.key().is_some_and(|k| k.generation.0 == 0) && self.history.len() < 4096 {
                self.history.push((from, to, msg.clone()));
            }
        } else {
            self.schedule(self.now + ms(base_delay), Item::Msg { from, to, msg });
        }
    }

    /// Drains every output of `node` and acts on it.
    fn drain(&mut self, node: RankId) {
        loop {
            if self.dead.contains(&node) {
                return;
            }
            let n = self.nodes.get_mut(&node).unwrap();
            if let Some(t) = n.ep.poll_transmit() {
                self.transmit(node, t.to, t.message);
                continue;
            }
            if let Some(a) = n.ep.poll_action() {
                self.action(node, a);
                continue;
            }
            if let Some(e) = n.ep.poll_event() {
                self.event(node, e);
                continue;
            }
            return;
        }
    }

    /// The send of `segment` of `key` from `node` to `to` is reported failed 1 ms from now.
    fn fail_send_soon(&mut self, node: RankId, key: RequestKey, to: RankId, segment: u32) {
        let now = self.now;
        self.schedule(
            now + ms(1),
            Item::SendDone {
                node,
                key,
                to,
                segment,
                ok: false,
            },
        );
    }

    fn action(&mut self, node: RankId, a: Action) {
        let now = self.now;
        match a {
            Action::Send { key, to, desc } => {
                // The application starts the send at once (the core checks it first).
                let n = self.nodes.get_mut(&node).unwrap();
                match n.ep.check_send(key, to, desc.segment, desc.len) {
                    Ok(Ok(_)) => n.ep.begin_send(key, to, desc.segment),
                    other => {
                        let s = format!(
                            "{node}: send of {key} seg {} refused: {other:?}",
                            desc.segment
                        );
                        self.violation(s);
                        return;
                    }
                }
                if self.is_cut(node, to) {
                    // Posting to a lost peer fails at once.
                    self.fail_send_soon(node, key, to, desc.segment);
                    return;
                }
                let zombie = self.in_window() && self.rng.chance(self.plan.faults.zombie);
                let delay = if zombie {
                    self.cfg.timeout + self.cfg.agreement_bound + ms(self.rng.below(400))
                } else {
                    ms(2 + self.rng.below(30))
                };
                let slot = self.schedule(
                    now + delay,
                    Item::Data {
                        from: node,
                        to,
                        key,
                        token: desc.token,
                        segment: desc.segment,
                    },
                );
                let n = self.nodes.get_mut(&node).unwrap();
                n.inflight.insert((key, to, desc.segment), slot);
            }
            Action::AbortSend { key, to, segment } => {
                let n = self.nodes.get_mut(&node).unwrap();
                if let Some(slot) = n.inflight.get(&(key, to, segment)).copied() {
                    if self.rng.chance(600) {
                        // Aborted before it left: nothing will arrive.
                        self.net.remove(&slot);
                        self.nodes
                            .get_mut(&node)
                            .unwrap()
                            .inflight
                            .remove(&(key, to, segment));
                        self.fail_send_soon(node, key, to, segment);
                    }
                    // Otherwise the abort lost the race: the data still lands, done follows.
                }
            }
            Action::CancelReceive { token, .. } => {
                if !(self.in_window() && self.rng.chance(self.plan.faults.stuck_reap)) {
                    let d = ms(1 + self.rng.below(20));
                    self.schedule(now + d, Item::Reap { node, token });
                }
            }
            Action::Release { key, lease } => {
                let n = self.nodes.get_mut(&node).unwrap();
                if let Some((t, p)) = n.posted.iter().find(|(_, p)| p.lease == lease) {
                    let s = format!(
                        "{node} released {lease:?} of {key} while receive {t:?} ({}) is posted",
                        p.key
                    );
                    self.violation(s);
                }
                let n = self.nodes.get_mut(&node).unwrap();
                if n.pool.owner(lease.buffer) != Some(key) {
                    let s = format!("{node} released {lease:?} not owned by {key}");
                    self.violation(s);
                }
                let n = self.nodes.get_mut(&node).unwrap();
                if let Err(e) = n.pool.release(lease) {
                    self.violation(format!("{node}: {e}"));
                }
            }
            Action::Fence { lease, token, .. } => {
                let n = self.nodes.get_mut(&node).unwrap();
                // The registration is invalidated: the posted receive dies with it.
                n.posted.remove(&token);
                let r = n
                    .pool
                    .fence(lease)
                    .and_then(|_| n.pool.restore(lease.buffer));
                n.content.remove(&lease.buffer);
                if let Err(e) = r {
                    self.violation(format!("{node}: {e}"));
                }
            }
        }
    }

    fn event(&mut self, node: RankId, e: Event) {
        if std::env::var_os("SIM_TRACE").is_some() {
            eprintln!("{:?} {node} event {e:?}", self.now);
        }
        match e {
            Event::Advertised { key, from, .. } => {
                self.began
                    .insert((node, key, Role::Sender { receiver: from }), self.now);
                if self.rng.chance(self.plan.stall) {
                    return;
                }
                let ready = !self.rng.chance(self.plan.reject);
                let d = ms(self.rng.below(20));
                self.schedule(
                    self.now + d,
                    Item::Accept {
                        node,
                        key,
                        from,
                        ready,
                    },
                );
            }
            Event::Notified { .. } => {}
            Event::Terminal {
                key, role, outcome, ..
            } => {
                let began = self.began.get(&(node, key, role)).copied();
                let Some(began) = began else {
                    self.violation(format!("{node} {key} {role:?}: terminal for unknown"));
                    return;
                };
                let t = Terminal {
                    outcome,
                    at: self.now,
                    began,
                };
                if let Some(prev) = self.terminals.insert((node, key, role), t) {
                    self.violation(format!("{node} {key} {role:?}: second terminal {prev:?}"));
                }
                if role == Role::Receiver && outcome == Outcome::Completed {
                    let n = &self.nodes[&node];
                    let bad: Vec<u32> = n.started[&key]
                        .iter()
                        .filter(|(_, l)| n.content.get(&l.buffer) != Some(&key))
                        .map(|(s, _)| *s)
                        .collect();
                    if !bad.is_empty() {
                        self.violation(format!(
                            "{node} {key} completed; segments {bad:?} hold other data"
                        ));
                    }
                }
                // The scheduler retries in lockstep, as TensorRT-LLM's ranks do: once every live
                // generation rank has finished generation 0, those that failed start generation 1.
                let req = self.plan.reqs.iter().position(|r| r.id == key.request.0);
                if let Some(i) = req.filter(|&i| self.plan.reqs[i].retry && role == Role::Receiver)
                {
                    if key.generation.0 == 0 {
                        self.maybe_retry(i, key);
                    }
                }
            }
        }
    }

    fn maybe_retry(&mut self, req: usize, key: RequestKey) {
        let ranks: Vec<RankId> = (0..self.plan.n_gen)
            .map(gen_rank)
            .filter(|r| !self.dead.contains(r))
            .filter(|r| self.began.contains_key(&(*r, key, Role::Receiver)))
            .collect();
        let outcomes: Vec<Option<Outcome>> = ranks
            .iter()
            .map(|r| {
                self.terminals
                    .get(&(*r, key, Role::Receiver))
                    .map(|t| t.outcome)
            })
            .collect();
        if outcomes.iter().all(|o| o.is_some()) {
            for (r, o) in ranks.into_iter().zip(outcomes) {
                if o != Some(Outcome::Completed) {
                    self.schedule(
                        self.now + ms(20),
                        Item::Start {
                            node: r,
                            req,
                            generation: 1,
                        },
                    );
                }
            }
        }
    }

    fn start(&mut self, node: RankId, req: usize, generation: u32) {
        let plan = self.plan.reqs[req].clone();
        let key = RequestKey::new(plan.id, generation);
        let n_ctx = self.plan.n_ctx;
        let n = self.nodes.get_mut(&node).unwrap();
        let mut flows = vec![];
        let mut leases = vec![];
        for c in 0..n_ctx {
            let mut buffers = vec![];
            for j in 0..plan.segs_per_flow {
                let Some(lease) = n.pool.lease(key) else {
                    // Exhausted: give back what we took, do not start.
                    for l in leases {
                        n.pool.release(l).unwrap();
                    }
                    self.not_started += 1;
                    return;
                };
                leases.push(lease);
                let segment = c as u32 * plan.segs_per_flow + j;
                let token = n.tokens.allocate().unwrap();
                let desc = BufferDesc {
                    kind: if j % 3 == 2 {
                        BufferKind::Rnn
                    } else {
                        BufferKind::Kv
                    },
                    segment,
                    addr: 0x1000_0000 * (lease.buffer.0 as u64 + 1),
                    len: 4096,
                    device_id: 0,
                    token,
                };
                buffers.push((lease, desc));
            }
            flows.push(ReceiveFlow {
                sender: ctx_rank(c),
                buffers,
            });
        }
        let receivers = (0..self.plan.n_gen).map(gen_rank).collect();
        let segs: Vec<(u32, Lease)> = flows
            .iter()
            .flat_map(|f| f.buffers.iter().map(|(l, d)| (d.segment, *l)))
            .collect();
        for f in &flows {
            for (lease, d) in &f.buffers {
                n.posted.insert(
                    d.token,
                    Posted {
                        key,
                        segment: d.segment,
                        lease: *lease,
                    },
                );
            }
        }
        n.started.insert(key, segs);
        let spec = ReceiveSpec {
            key,
            receivers,
            flows,
            request_info: format!("req {key}").into_bytes(),
            timeout: None,
        };
        let at = self.base + self.now;
        if let Err(e) = n.ep.start_receive(at, spec) {
            self.violation(format!("{node} start {key}: {e}"));
            return;
        }
        self.began.insert((node, key, Role::Receiver), self.now);
    }

    fn deliver(&mut self, item: Item) {
        let at = self.at();
        let now = self.now;
        let target = match &item {
            Item::Msg { to, .. } | Item::Data { to, .. } => *to,
            Item::SendDone { node, .. }
            | Item::Reap { node, .. }
            | Item::PeerLost { node, .. }
            | Item::Start { node, .. }
            | Item::Accept { node, .. }
            | Item::Cancel { node, .. }
            | Item::Die { node, .. }
            | Item::Cut { node, .. }
            | Item::Heal { node, .. } => *node,
        };
        if self.dead.contains(&target) {
            if let Item::Data {
                from,
                to,
                key,
                segment,
                ..
            } = item
            {
                // A send to a dead rank fails, and its sender hears of it (as an engine's send
                // returns, its endpoint failed): a flow is kept until each send it began is
                // reported done.
                let sender_alive = !self.dead.contains(&from);
                if let Some(n) = self.nodes.get_mut(&from).filter(|_| sender_alive) {
                    n.inflight.remove(&(key, to, segment));
                    self.fail_send_soon(from, key, to, segment);
                }
            }
            return;
        }
        if std::env::var_os("SIM_TRACE").is_some() {
            eprintln!("{:?} {item:?}", self.now);
        }
        match item {
            Item::Msg { from, to, msg } => {
                let bytes = msg.to_bytes().unwrap();
                let n = self.nodes.get_mut(&to).unwrap();
                if let Err(e) = n.ep.handle_frame(at, from, &bytes) {
                    self.violation(format!("{to} refused a frame from {from}: {e}"));
                }
            }
            Item::Data {
                from,
                to,
                key,
                token,
                segment,
            } => {
                if let Some(n) = self.nodes.get_mut(&from) {
                    n.inflight.remove(&(key, to, segment));
                }
                if !self.dead.contains(&from) {
                    self.schedule(
                        now + ms(1),
                        Item::SendDone {
                            node: from,
                            key,
                            to,
                            segment,
                            ok: true,
                        },
                    );
                }
                let n = self.nodes.get_mut(&to).unwrap();
                // Tag matching: data lands only in a posted receive with its token.
                let Some(p) = n.posted.remove(&token) else {
                    return;
                };
                let mut bad = vec![];
                if p.key != key || p.segment != segment {
                    bad.push(format!(
                        "{to}: data of {key}/{segment} matched receive of {}/{}",
                        p.key, p.segment
                    ));
                }
                if n.pool.owner(p.lease.buffer) != Some(p.key) || !n.pool.is_live(p.lease) {
                    bad.push(format!(
                        "{to}: data landed in {:?}, no longer {}'s",
                        p.lease, p.key
                    ));
                }
                n.content.insert(p.lease.buffer, key);
                let r = n.ep.handle_segment_landed(at, p.key, p.segment);
                for b in bad {
                    self.violation(b);
                }
                if let Err(e) = r {
                    self.violation(format!("{to}: landed: {e}"));
                }
                // A stale completion of the previous attempt, delivered alongside.
                if key.generation.0 > 0 && self.rng.chance(self.plan.faults.stale) {
                    self.stale_injected += 1;
                    let old = RequestKey::new(key.request.0, key.generation.0 - 1);
                    let n = self.nodes.get_mut(&to).unwrap();
                    if !n.posted.values().any(|p| p.key == old) {
                        let _ = n.ep.handle_segment_landed(at, old, segment);
                    }
                }
            }
            Item::SendDone {
                node,
                key,
                to,
                segment,
                ok,
            } => {
                let n = self.nodes.get_mut(&node).unwrap();
                if let Err(e) = n.ep.handle_send_done(at, key, to, segment, ok) {
                    self.violation(format!("{node}: send done: {e}"));
                }
            }
            Item::Reap { node, token } => {
                let n = self.nodes.get_mut(&node).unwrap();
                if let Some(p) = n.posted.remove(&token) {
                    if let Err(e) = n.ep.handle_receive_reaped(at, p.key, p.segment) {
                        self.violation(format!("{node}: reaped: {e}"));
                    }
                }
            }
            Item::PeerLost { node, lost } => {
                self.nodes
                    .get_mut(&node)
                    .unwrap()
                    .ep
                    .handle_peer_lost(at, lost);
            }
            Item::Start {
                node,
                req,
                generation,
            } => self.start(node, req, generation),
            Item::Accept {
                node,
                key,
                from,
                ready,
            } => {
                // Too late is fine (a verdict got there first); anything else is not.
                let _ = self
                    .nodes
                    .get_mut(&node)
                    .unwrap()
                    .ep
                    .accept(at, key, from, ready);
            }
            Item::Cancel { node, req } => {
                let id = self.plan.reqs[req % self.plan.reqs.len()].id;
                let n = self.nodes.get_mut(&node).unwrap();
                for g in 0..2 {
                    let _ = n.ep.cancel(at, RequestKey::new(id, g));
                }
            }
            Item::Cut {
                node,
                other,
                heal_after,
            } => self.cut(node, other, heal_after),
            Item::Heal { node, other } => {
                self.cut.remove(&(node.min(other), node.max(other)));
                for (a, b) in [(node, other), (other, node)] {
                    if !self.dead.contains(&a) {
                        let at = self.base + self.now;
                        self.nodes.get_mut(&a).unwrap().ep.handle_peer_bound(at, b);
                        self.drain(a);
                    }
                }
            }
            Item::Die { node, detected } => {
                self.dead.insert(node);
                if detected {
                    let others: Vec<RankId> = self.nodes.keys().copied().collect();
                    for o in others {
                        if o != node {
                            self.schedule(
                                now + ms(10),
                                Item::PeerLost {
                                    node: o,
                                    lost: node,
                                },
                            );
                        }
                    }
                }
            }
        }
        self.drain(target);
    }

    /// The connection between `node` and `other` breaks: what is in flight between them is lost
    /// (a data send fails at its sender), each is told within 10 ms that the other is lost, and
    /// the two are bound again `heal_after` ms later.
    fn cut(&mut self, node: RankId, other: RankId, heal_after: u64) {
        let now = self.now;
        self.cut.insert((node.min(other), node.max(other)));
        let pair = |a: RankId, b: RankId| (a == node && b == other) || (a == other && b == node);
        let lost: Vec<(Duration, u64)> = self
            .net
            .iter()
            .filter(|(_, item)| match item {
                Item::Msg { from, to, .. } | Item::Data { from, to, .. } => pair(*from, *to),
                _ => false,
            })
            .map(|(slot, _)| *slot)
            .collect();
        for slot in lost {
            if let Some(Item::Data {
                from,
                to,
                key,
                segment,
                ..
            }) = self.net.remove(&slot)
            {
                if let Some(n) = self.nodes.get_mut(&from) {
                    n.inflight.remove(&(key, to, segment));
                }
                self.fail_send_soon(from, key, to, segment);
            }
        }
        for (a, b) in [(node, other), (other, node)] {
            let d = ms(1 + self.rng.below(10));
            self.schedule(now + d, Item::PeerLost { node: a, lost: b });
        }
        self.schedule(now + ms(heal_after), Item::Heal { node, other });
    }

    /// Runs until nothing is left to do. Bounded: panics on livelock.
    pub fn run(&mut self) {
        let end = ms(self.plan.reqs.iter().map(|r| r.start_ms).max().unwrap_or(0))
            + (self.cfg.timeout + self.cfg.agreement_bound + self.cfg.linger) * 3
            + ms(5_000);
        let mut same_instant = 0u64;
        loop {
            self.steps += 1;
            assert!(self.steps < MAX_STEPS, "livelock: {} steps", self.steps);
            let alive: Vec<RankId> = self
                .nodes
                .keys()
                .copied()
                .filter(|r| !self.dead.contains(r))
                .collect();
            let timer = alive
                .iter()
                .filter_map(|r| self.nodes[r].ep.poll_timeout())
                .min()
                .map(|t| t.saturating_duration_since(self.base));
            let net = self.net.keys().next().map(|k| k.0);
            let next = match (timer, net) {
                (Some(a), Some(b)) => a.min(b),
                (a, b) => match a.or(b) {
                    Some(t) => t,
                    None => break,
                },
            };
            // Past the end only early messages for requests that never started may be left,
            // waiting out their keep (`EARLY_KEEP`): no request and no tombstone on a live rank.
            assert!(
                next <= end
                    || (next <= end + kvlink_proto::EARLY_KEEP
                        && self
                            .nodes
                            .iter()
                            .filter(|(r, _)| !self.dead.contains(r))
                            .all(|(_, n)| n.ep.known() == 0 && n.ep.tombstones() == 0)),
                "still busy at {next:?}: no request may outlive its bound"
            );
            if next <= self.now {
                same_instant += 1;
                assert!(same_instant < 10_000, "livelock at {:?}", self.now);
            } else {
                same_instant = 0;
            }
            self.now = self.now.max(next);
            if net == Some(next) {
                let (k, item) = self.net.pop_first().unwrap();
                debug_assert_eq!(k.0, next);
                self.deliver(item);
            } else {
                let at = self.at();
                for r in alive {
                    let due = self.nodes[&r].ep.poll_timeout().is_some_and(|t| t <= at);
                    if due {
                        self.nodes.get_mut(&r).unwrap().ep.handle_timeout(at);
                        self.drain(r);
                    }
                }
            }
        }
    }

    /// Every invariant of the issue, over what the run recorded. Returns the violations.
    pub fn check(&self) -> Vec<String> {
        let mut v = self.violations.clone();
        let bound = self.cfg.timeout + self.cfg.agreement_bound;
        // Exactly one terminal per rank and request it took part in, by deadline + bound.
        for (k, began) in &self.began {
            if self.dead.contains(&k.0) {
                continue;
            }
            match self.terminals.get(k) {
                None => v.push(format!("{k:?}: no terminal state")),
                Some(t) if t.at > *began + bound => v.push(format!(
                    "{k:?}: terminal at {:?}, past {:?}",
                    t.at,
                    *began + bound
                )),
                _ => {}
            }
        }
        // Agreement.
        let mut by_key: BTreeMap<RequestKey, Vec<(RankId, Role, Outcome)>> = BTreeMap::new();
        // An external collective among the receivers may have taken a receiver's `Completed`
        // before a sender's late cancel reaches it; that sender, which gave up while a send was
        // in flight, ends with its own reason at its (pulled-in) bound.
        let cancelled: BTreeSet<RankId> = if self.plan.external {
            self.plan
                .cancels
                .iter()
                .map(|c| self.rank_at(c.1))
                .collect()
        } else {
            BTreeSet::new()
        };
        for ((r, k, role), t) in &self.terminals {
            if matches!(role, Role::Sender { .. }) && cancelled.contains(r) {
                continue;
            }
            if !self.dead.contains(r) {
                by_key.entry(*k).or_default().push((*r, *role, t.outcome));
            }
        }
        let faulty = self.plan.death.is_some() || self.plan.flap.is_some();
        for (k, outs) in &by_key {
            let mut set: BTreeSet<u8> = outs.iter().map(|o| o.2 as u8).collect();
            if faulty {
                // A rank that cannot reach the rank holding the verdict ends at the bound with
                // its own failure (or TimedOut): failures may differ, but a rank that never
                // heard the verdict never reports Completed, so at most one non-failure kind.
                set.retain(|o| *o == Outcome::Completed as u8);
            }
            if set.len() > 1 {
                v.push(format!("{k}: ranks disagree: {outs:?}"));
            }
            if !faulty && outs.iter().any(|o| o.2 == Outcome::PeerLost) {
                v.push(format!("{k}: PeerLost with no rank lost: {outs:?}"));
            }
        }
        // Whatever the faults: a sender's `Completed` implies its receiver's (every byte of the
        // request landed there), unless that receiver died.
        for ((r, k, role), t) in &self.terminals {
            let Role::Sender { receiver } = *role else {
                continue;
            };
            if t.outcome != Outcome::Completed
                || self.dead.contains(&receiver)
                || self.dead.contains(r)
            {
                continue;
            }
            let theirs = self
                .terminals
                .get(&(receiver, *k, Role::Receiver))
                .map(|t| t.outcome);
            if theirs != Some(Outcome::Completed) {
                v.push(format!(
                    "{k}: {r} completed its send to {receiver}, which ended {theirs:?}"
                ));
            }
        }
        // Every lease back, every fenced slot restored, every request forgotten.
        for (r, n) in &self.nodes {
            if self.dead.contains(r) {
                continue;
            }
            if let Err(e) = n.pool.check_all_returned() {
                v.push(format!("{r}: {e}"));
            }
            if n.pool.available() != n.pool.capacity() {
                v.push(format!(
                    "{r}: pool {} of {}",
                    n.pool.available(),
                    n.pool.capacity()
                ));
            }
            if n.ep.known() != 0 {
                v.push(format!("{r}: {} requests never forgotten", n.ep.known()));
            }
            if !n.posted.is_empty() {
                v.push(format!("{r}: receives left posted: {:?}", n.posted));
            }
        }
        v
    }

    pub fn outcomes(&self, key: RequestKey) -> Vec<(RankId, Role, Outcome)> {
        self.terminals
            .iter()
            .filter(|((_, k, _), _)| *k == key)
            .map(|((r, _, role), t)| (*r, *role, t.outcome))
            .collect()
    }

    pub fn stats_sum(&self) -> kvlink_proto::Stats {
        let mut s = kvlink_proto::Stats::default();
        for n in self.nodes.values() {
            let t = n.ep.stats();
            s.stale_dropped += t.stale_dropped;
            s.unknown_dropped += t.unknown_dropped;
            s.duplicates += t.duplicates;
            s.fenced_buffers += t.fenced_buffers;
            s.retransmits += t.retransmits;
        }
        s
    }

    pub fn pool(&self, r: RankId) -> &BufferPool {
        &self.nodes[&r].pool
    }
}
