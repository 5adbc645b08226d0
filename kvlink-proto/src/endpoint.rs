//! [`Endpoint`]: every request of one rank, the inputs that drive them and the outputs they
//! produce.
//!
//! Call order (quinn style): feed inputs with `handle_*` / `start_receive` / `accept` / `cancel`,
//! each with the current time; then drain `poll_transmit`, `poll_action` and `poll_event` until
//! each returns `None`; then sleep until `poll_timeout` (or the next input) and call
//! `handle_timeout`. Deadlines fire from `handle_timeout` alone, so cleanup never depends on new
//! requests arriving.
use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use smallvec::SmallVec;

use super::agreement::Collective;
use super::early::{self, Early, Kept};
use super::id::{RankId, RequestKey};
use super::pool::Lease;
use super::request::{
    Action, Config, Event, Out, RecvRequest, Role, SendFlow, SendRefusal, Stats, Transmit,
};
use super::timers::{DueQueue, Machine, Timed, TimerId, TimerTable};
use super::wire::{self, BufferDesc, Message};
use crate::error::{Error, ErrorKind, Outcome, Result};

/// The buffers one sender will fill, as the generation side leased and posted them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReceiveFlow {
    pub sender: RankId,
    /// Each lease with the descriptor of its posted receive (the token is the receive's tag).
    pub buffers: Vec<(Lease, BufferDesc)>,
}

/// Everything `start_receive` needs to run one request on a generation rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReceiveSpec {
    pub key: RequestKey,
    /// Every generation rank taking part, this one included. The lowest is the coordinator.
    pub receivers: Vec<RankId>,
    pub flows: Vec<ReceiveFlow>,
    /// Opaque TensorRT-LLM request info, carried in `Advertise`.
    pub request_info: Vec<u8>,
    /// This request's deadline, counted from `start_receive`; `None` takes [`Config::timeout`].
    pub timeout: Option<Duration>,
}

/// Whether two buffers of a request, over all its flows, share the value `of` gives.
fn buffers_repeat<T: Ord>(flows: &[ReceiveFlow], of: impl Fn(&(Lease, BufferDesc)) -> T) -> bool {
    match flows {
        [one] => wire::any_repeated(one.buffers.len(), |i| of(&one.buffers[i])),
        _ => {
            let all: Vec<&(Lease, BufferDesc)> = flows.iter().flat_map(|f| &f.buffers).collect();
            wire::any_repeated(all.len(), |i| of(all[i]))
        }
    }
}

/// The core's maps: hashed with a fixed seed, so that a run (a simulated one in the tests)
/// visits them in the same order every time. Lookups are by exact key; the one ordered question,
/// whether a newer generation is known, has an index of its own (`Endpoint::retries`).
type Map<K, V> = HashMap<K, V, foldhash::fast::FixedState>;

/// The retries known here of one request id: (generation, `None` for the receive or
/// `Some(receiver)` for a send).
type Retries = SmallVec<[(u32, Option<RankId>); 2]>;

/// A request's send flows on this rank, one per receiver (one or a few).
type Flows = SmallVec<[(RankId, Box<Timed<SendFlow>>); 1]>;

fn flow(sends: &Map<RequestKey, Flows>, key: RequestKey, to: RankId) -> Option<&Timed<SendFlow>> {
    let flows = sends.get(&key)?;
    flows.iter().find(|(r, _)| *r == to).map(|(_, f)| &**f)
}

fn flow_mut(
    sends: &mut Map<RequestKey, Flows>,
    key: RequestKey,
    to: RankId,
) -> Option<&mut Timed<SendFlow>> {
    let flows = sends.get_mut(&key)?;
    flows
        .iter_mut()
        .find(|(r, _)| *r == to)
        .map(|(_, f)| &mut **f)
}

/// What is kept of a request forgotten here, for as long as a peer may still ask about it: 32
/// bytes for a request answered to one rank (a 1x1 request's), as many tombstones are kept.
#[derive(Debug)]
struct Tomb {
    /// Its expiry (the request's own deadline plus the agreement bound).
    until: Instant,
    outcome: Outcome,
    /// The rank it answers: a send flow's receiver (its key names it too); a receive's first
    /// sender.
    asker: RankId,
    /// A receive's other askers, if any: its other senders and, at the coordinator, the other
    /// receivers (whose votes it answered while it ran). Behind one thin pointer, so that the
    /// common tombstone keeps its 32 bytes; allocated only for such requests.
    #[allow(clippy::box_collection)]
    more: Option<Box<Vec<RankId>>>,
}

impl Tomb {
    /// A receive's tombstone, answering `askers` (the first is always there: a receive has a
    /// sender).
    fn receive(until: Instant, outcome: Outcome, askers: &[RankId]) -> Tomb {
        Tomb {
            until,
            outcome,
            asker: askers.first().copied().unwrap_or(RankId(u32::MAX)),
            more: (askers.len() > 1).then(|| Box::new(askers[1..].to_vec())),
        }
    }

    /// Whether it answers `rank`'s vote or ready answer.
    fn answers(&self, rank: RankId) -> bool {
        self.asker == rank || self.more.as_ref().is_some_and(|m| m.contains(&rank))
    }
}

/// The protocol core of one rank. See the module docs for the call order.
pub struct Endpoint {
    me: RankId,
    config: Config,
    recvs: Map<RequestKey, Box<Timed<RecvRequest>>>,
    /// Every send flow, by request (then by receiver).
    sends: Map<RequestKey, Flows>,
    /// Every state machine's next deadline (see [`TimerTable`]).
    timers: TimerTable,
    /// Requests forgotten at terminal + linger leave a tombstone (key, expiry and outcome, no
    /// other state) for as long as a peer may still ask about them (its own deadline plus the
    /// agreement bound): a late vote is answered with the verdict, a late verdict confirmed,
    /// and a late duplicate advertisement never starts the request again. Expiries in due order.
    tombs: Map<TimerId, Tomb>,
    tomb_expiry: DueQueue<TimerId>,
    /// The tombstones in the order they were buried, for the cap ([`Config::tomb_cap`]): the
    /// one buried first goes (an entry whose tombstone has expired or been replaced is
    /// skipped, and the list is compacted when such entries pile up).
    tomb_order: VecDeque<(TimerId, Instant)>,
    /// The receives (`None`) and sends (`Some(receiver)`) known here, or forgotten with their
    /// tombstone still kept, whose generation is above 0 (a retry's), by request id: only those
    /// can be newer than a key's generation, so this answers [`Endpoint::newer_known`], and is
    /// empty unless retries run. An older generation stays stale as long as the newer one's
    /// tombstone, not only while its machine is kept (a completed one is forgotten at its end).
    retries: Map<u64, Retries>,
    collective: Option<Box<dyn Collective>>,
    /// Votes and failure verdicts for requests not started here yet (see `early`), kept for
    /// [`early::EARLY_KEEP`], or the longest deadline of a request started here plus the
    /// agreement bound if longer, after the last was kept (their expiry is one of
    /// `poll_timeout`'s timers).
    early: Early,
    /// Votes owed to a coordinator by receives forgotten here (past their linger) while they
    /// still owed it (see [`Endpoint::handle_peer_bound`]): (coordinator, key, outcome, until
    /// the receive's tombstone would go), oldest first, at most [`OWED_CAP`].
    owed: VecDeque<(RankId, RequestKey, Outcome, Instant)>,
    out: Out,
}

/// The most votes kept for coordinators past their receives' linger ([`Endpoint::handle_peer_bound`]);
/// past it the oldest goes.
pub const OWED_CAP: usize = 4096;

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoint")
            .field("me", &self.me)
            .field("receives", &self.recvs.len())
            .field("sends", &self.flow_count())
            .field("stats", &self.out.stats)
            .finish()
    }
}

fn invalid(msg: String) -> Error {
    Error::new(ErrorKind::InvalidArgument, msg)
}

impl Endpoint {
    /// An endpoint whose receivers agree over kvlink's own control messages.
    pub fn new(me: RankId, config: Config) -> Self {
        let config = config.bounded();
        Endpoint {
            me,
            config,
            recvs: Map::default(),
            sends: Map::default(),
            timers: TimerTable::default(),
            tombs: Map::default(),
            tomb_expiry: DueQueue::default(),
            tomb_order: VecDeque::new(),
            retries: Map::default(),
            collective: None,
            early: Early::new(
                early::EARLY_KEEP.max(config.timeout.saturating_add(config.agreement_bound)),
            ),
            owed: VecDeque::new(),
            out: Out::default(),
        }
    }

    /// An endpoint whose receivers agree through an external collective.
    pub fn with_collective(me: RankId, config: Config, collective: Box<dyn Collective>) -> Self {
        let mut e = Self::new(me, config);
        e.collective = Some(collective);
        e
    }

    pub fn rank(&self) -> RankId {
        self.me
    }

    /// The rank this one agrees with over the wire on a request it receives with `receivers`
    /// (in any order): their coordinator, the lowest (as [`Endpoint::start_receive`] takes
    /// them, sorted), unless that is this rank or the receivers agree through an external
    /// collective. A request whose coordinator cannot be heard never learns its verdict; the
    /// engine reconnects that rank before it starts one.
    pub fn coordinator_of(&self, receivers: &[RankId]) -> Option<RankId> {
        receivers
            .iter()
            .min()
            .copied()
            .filter(|&c| c != self.me && self.collective.is_none())
    }
    /// The other receiving ranks whose word a receive of `receivers` waits for here: its
    /// coordinator's verdict at any other receiver, every other receiver's vote at the
    /// coordinator (none under a [`Collective`], which agrees elsewhere).
    pub fn agreement_peers(&self, receivers: &[RankId]) -> Vec<RankId> {
        if self.collective.is_some() {
            return Vec::new();
        }
        match self.coordinator_of(receivers) {
            Some(c) => vec![c],
            None => {
                let mut others: Vec<RankId> = receivers
                    .iter()
                    .copied()
                    .filter(|&r| r != self.me)
                    .collect();
                others.sort_unstable();
                others.dedup();
                others
            }
        }
    }
    pub fn config(&self) -> &Config {
        &self.config
    }
    pub fn stats(&self) -> &Stats {
        &self.out.stats
    }

    /// Requests (receives and per-receiver sends) not yet forgotten, terminal ones included.
    pub fn known(&self) -> usize {
        self.recvs.len() + self.flow_count()
    }

    /// The entries of every table kept here, by name: for tests that check each stays bounded
    /// over many requests.
    #[doc(hidden)]
    pub fn table_sizes(&self) -> Vec<(&'static str, usize)> {
        vec![
            ("ep.recvs", self.recvs.len()),
            ("ep.sends", self.sends.len()),
            ("ep.timers", self.timers.entries()),
            ("ep.tombs", self.tombs.len()),
            ("ep.tomb_expiry", self.tomb_expiry.len()),
            ("ep.tomb_order", self.tomb_order.len()),
            ("ep.retries", self.retries.len()),
            ("ep.early", self.early.len()),
            ("ep.owed", self.owed.len()),
        ]
    }

    /// Requests forgotten here whose tombstones are still kept (see [`Endpoint::known`]).
    pub fn tombstones(&self) -> usize {
        self.tombs.len()
    }

    /// Send flows known here (counted: only health reports and debug output ask).
    fn flow_count(&self) -> usize {
        self.sends.values().map(|flows| flows.len()).sum()
    }

    /// Is a newer generation of `key.request` known here (as a receive, or a send to `peer`)?
    fn newer_known(&self, key: RequestKey, peer: Option<RankId>) -> bool {
        self.retries.get(&key.request.0).is_some_and(|known| {
            known.iter().any(|&(generation, to)| {
                generation > key.generation.0
                    && match (to, peer) {
                        (Some(to), Some(peer)) => to == peer,
                        _ => true,
                    }
            })
        })
    }

    /// Is a newer generation of `key.request` known here as a receive? A send flow's generation
    /// says nothing of this rank's own receives: the rank that advertised it chose it, and may
    /// be any bound rank (one that advertised `(7, 5)` here made `(7, 0)` a stale receive, and
    /// dropped the early votes kept for it).
    fn newer_receive_known(&self, key: RequestKey) -> bool {
        self.retries.get(&key.request.0).is_some_and(|known| {
            known
                .iter()
                .any(|&(generation, to)| generation > key.generation.0 && to.is_none())
        })
    }

    /// Notes a receive (`to` None) or send of `key` that is now known here ([`Endpoint::retries`]).
    fn note_known(&mut self, key: RequestKey, to: Option<RankId>) {
        if key.generation.0 > 0 {
            let known = self.retries.entry(key.request.0).or_default();
            known.push((key.generation.0, to));
        }
    }

    /// Notes a receive or send of `key` whose tombstone is gone (expired, or replaced).
    fn note_forgotten(&mut self, key: RequestKey, to: Option<RankId>) {
        if key.generation.0 == 0 {
            return;
        }
        if let Some(known) = self.retries.get_mut(&key.request.0) {
            if let Some(i) = known.iter().position(|&e| e == (key.generation.0, to)) {
                known.swap_remove(i);
            }
            if known.is_empty() {
                self.retries.remove(&key.request.0);
            }
        }
    }

    fn drop_unknown(&mut self, key: RequestKey, peer: Option<RankId>) {
        if self.newer_known(key, peer) {
            self.out.stats.stale_dropped += 1;
        } else {
            self.out.stats.unknown_dropped += 1;
        }
    }

    /// The checks [`Endpoint::start_receive`] makes of a request's shape that need no buffer:
    /// `key` not running, sent, ended or superseded here; this rank among `receivers` (any
    /// order); request info within the wire's bound; one to [`wire::MAX_BUFFERS`] buffers per
    /// sender (`flows`: each sender and its count of buffers), no sender that is this rank, a
    /// receiver or repeated; no segment repeated. An engine asks first, before it waits for a
    /// sender's connection or posts a buffer, so that misuse is told at once and costs nothing.
    pub fn check_receive(
        &self,
        key: RequestKey,
        receivers: &[RankId],
        flows: &[(RankId, usize)],
        segments: &[u32],
        info_len: usize,
    ) -> Result<()> {
        if self.recvs.contains_key(&key) {
            return Err(invalid(format!("{key} is already running here")));
        }
        if self.sends.contains_key(&key) {
            // A rank receives a request or sends it, never both (as an advertisement for a key
            // received here is refused): verdicts are routed to a send flow first, so this
            // receive would never hear its own.
            return Err(invalid(format!("{key} is sent from here")));
        }
        if self.tombs.contains_key(&TimerId::Recv(key)) {
            // Its tombstone still answers for the ended request: a second one under the same
            // key would run beside it (a retry takes the next generation).
            return Err(invalid(format!("{key} has already ended here")));
        }
        if self.newer_receive_known(key) {
            return Err(Error::new(
                ErrorKind::StaleGeneration,
                format!("{key}: a newer generation is running here"),
            ));
        }
        if !receivers.contains(&self.me) {
            return Err(invalid(format!(
                "{key}: receivers must include {}",
                self.me
            )));
        }
        if info_len > wire::MAX_INFO {
            return Err(invalid(format!("{key}: request info too large")));
        }
        if flows.is_empty() {
            return Err(invalid(format!("{key}: no senders")));
        }
        for (i, &(sender, buffers)) in flows.iter().enumerate() {
            if buffers == 0 || buffers > wire::MAX_BUFFERS {
                return Err(invalid(format!("{key}: {buffers} buffers for {sender}")));
            }
            // A request has one sender per context rank: a few.
            if sender == self.me
                || receivers.contains(&sender)
                || flows[..i].iter().any(|g| g.0 == sender)
            {
                return Err(invalid(format!("{key}: bad or repeated sender {sender}")));
            }
        }
        if wire::any_repeated(segments.len(), |i| segments[i]) {
            return Err(invalid(format!("{key}: segment or token repeated")));
        }
        Ok(())
    }

    /// Starts one request on this (generation) rank: advertises `spec`'s buffers to each sender.
    /// The leases stay the caller's until the endpoint hands each back through
    /// [`Action::Release`] or [`Action::Fence`]; on error nothing was taken.
    pub fn start_receive(&mut self, now: Instant, spec: ReceiveSpec) -> Result<()> {
        let ReceiveSpec {
            key,
            mut receivers,
            flows,
            request_info,
            timeout,
        } = spec;
        let timeout = timeout
            .unwrap_or(self.config.timeout)
            .min(crate::request::LONGEST);
        if timeout.is_zero() {
            return Err(invalid(format!(
                "{key}: the request's timeout must be positive"
            )));
        }
        receivers.sort_unstable();
        receivers.dedup();
        let shape: SmallVec<[(RankId, usize); 2]> =
            flows.iter().map(|f| (f.sender, f.buffers.len())).collect();
        let segments: SmallVec<[u32; 16]> = flows
            .iter()
            .flat_map(|f| f.buffers.iter().map(|(_, d)| d.segment))
            .collect();
        self.check_receive(key, &receivers, &shape, &segments, request_info.len())?;
        for f in &flows {
            for (_, d) in &f.buffers {
                d.validate()
                    .map_err(|r| invalid(format!("{key}: segment {}: {r:?}", d.segment)))?;
            }
        }
        if buffers_repeat(&flows, |(_, d)| d.token) {
            return Err(invalid(format!("{key}: segment or token repeated")));
        }
        if buffers_repeat(&flows, |(l, _)| *l) {
            return Err(invalid(format!("{key}: lease repeated")));
        }
        let external = self.collective.is_some();
        let flows = flows.into_iter().map(|f| (f.sender, f.buffers)).collect();
        let r = RecvRequest::new(
            now,
            &self.config,
            self.me,
            key,
            timeout,
            receivers,
            flows,
            request_info,
            external,
            &mut self.out,
        );
        let mut r = Timed::boxed(r);
        // Messages that come before their request starts here are kept as long as this one
        // could still start after them (`early.rs`).
        self.early
            .keep_at_least(timeout.saturating_add(self.config.agreement_bound));
        // What other receivers said of it before it started here, in the order it came; only
        // another receiver's vote (at the coordinator) and the coordinator's verdict count.
        let (kept, lost) = self.early.take(now, key);
        self.out.stats.unknown_dropped += lost as u64;
        for (from, kind, outcome) in kept {
            if from == self.me || !r.receivers.contains(&from) {
                self.out.stats.unknown_dropped += 1;
                continue;
            }
            match kind {
                early::Kind::Vote => r.on_vote(now, from, outcome, &mut self.out),
                early::Kind::Verdict => r.on_verdict(now, from, outcome, &mut self.out),
            }
        }
        self.timers.arm(TimerId::Recv(key), &mut r, now);
        self.note_known(key, None);
        self.recvs.insert(key, r);
        self.compact_timers();
        Ok(())
    }

    /// The application's answer to an [`Event::Advertised`]: accept (then [`Action::Send`]s
    /// follow) or reject. Fails with `UnknownRequest` when no advertisement of `key` came from
    /// `from`, and `InvalidArgument` when it was already answered. An answer to a request that
    /// ended first (the receivers gave it up or cancelled it) is no error and changes nothing:
    /// the sends report the end, as the wait does.
    pub fn accept(
        &mut self,
        now: Instant,
        key: RequestKey,
        from: RankId,
        ready: bool,
    ) -> Result<()> {
        let Some(f) = flow_mut(&mut self.sends, key, from) else {
            if let Some(&Tomb { outcome, .. }) = self.tombs.get(&TimerId::Send(key, from)) {
                if outcome.is_completed() {
                    // Completed: every segment was sent, so it was accepted long ago.
                    return Err(invalid(format!("{key} from {from}: already decided")));
                }
                return Ok(()); // ended and forgotten: its end is still known
            }
            return Err(Error::new(
                ErrorKind::UnknownRequest,
                format!("{key}: no advertisement from {from}"),
            ));
        };
        let ok = f.accept(now, ready, &mut self.out);
        self.timers.arm(TimerId::Send(key, from), f, now);
        self.drive(now);
        if ok {
            Ok(())
        } else {
            Err(invalid(format!("{key} from {from}: already answered")))
        }
    }

    /// Cancels `key` on this rank (its receive and every send of it). The cancel is agreed: the
    /// terminal event follows once every rank knows and no peer can write. A receive that has
    /// already ended (lingering, or forgotten with its tombstone kept) is left as it ended, and
    /// the call succeeds; an unknown key is `UnknownRequest`, as for `accept`.
    pub fn cancel(&mut self, now: Instant, key: RequestKey) -> Result<()> {
        self.give_up(now, key, Outcome::Cancelled)
    }

    /// Like [`Endpoint::cancel`], with the reason this rank gives: `Cancelled`, `TimedOut` when
    /// the application's own deadline came before the request's, or `Rejected` for a peer's
    /// mistake (a segment of the wrong size).
    pub fn give_up(&mut self, now: Instant, key: RequestKey, why: Outcome) -> Result<()> {
        self.give_up_sparing(now, key, why, &[])
    }

    /// [`Endpoint::give_up`], except for the sends of `key` to the ranks in `spare` (another
    /// request under the same key: a replaced process's successor's, which the application
    /// has not been handed yet). `UnknownRequest` if nothing else of `key` is known here.
    pub fn give_up_sparing(
        &mut self,
        now: Instant,
        key: RequestKey,
        why: Outcome,
        spare: &[RankId],
    ) -> Result<()> {
        if !matches!(
            why,
            Outcome::Cancelled | Outcome::TimedOut | Outcome::Rejected
        ) {
            return Err(invalid(format!(
                "{key}: can only give up as Cancelled, TimedOut or Rejected"
            )));
        }
        let mut found = false;
        if let Some(r) = self.recvs.get_mut(&key) {
            r.give_up(now, why, &mut self.out);
            self.timers.arm(TimerId::Recv(key), r, now);
            found = true;
        }
        let flows = self.sends.get_mut(&key).into_iter().flatten();
        for (to, f) in flows.filter(|(to, _)| !spare.contains(to)) {
            f.give_up(now, why, &mut self.out);
            self.timers.arm(TimerId::Send(key, *to), f, now);
            found = true;
        }
        self.drive(now);
        // A receive that ended and was forgotten (a completed one at its end): nothing left to
        // give up, as for one that lingers.
        if found || self.tombs.contains_key(&TimerId::Recv(key)) {
            Ok(())
        } else {
            Err(Error::new(
                ErrorKind::UnknownRequest,
                format!("{key}: not known here"),
            ))
        }
    }

    /// Queues a `Notify` for `to`.
    pub fn send_notify(&mut self, key: RequestKey, to: RankId, payload: Vec<u8>) -> Result<()> {
        if payload.len() > wire::MAX_PAYLOAD {
            return Err(invalid(format!("{key}: notification too large")));
        }
        self.out.transmits.push_back(Transmit {
            to,
            message: Message::Notify { key, payload },
        });
        Ok(())
    }

    /// Decodes and handles one frame received from `from`.
    pub fn handle_frame(&mut self, now: Instant, from: RankId, bytes: &[u8]) -> Result<()> {
        match Message::decode(bytes) {
            // `decode` keeps the limits that `handle_message` checks.
            Ok(m) => self.handle_checked(now, from, m),
            Err(e) => {
                self.out.stats.bad_frames += 1;
                Err(e.into())
            }
        }
    }

    /// Handles one decoded message from `from` (the rank the transport says sent it). Late,
    /// duplicated and stale messages are counted and dropped, not errors.
    pub fn handle_message(&mut self, now: Instant, from: RankId, msg: Message) -> Result<()> {
        // A message handed over without a frame keeps the limits a frame is decoded under.
        if let Err(reason) = msg.check() {
            self.out.stats.bad_frames += 1;
            return Err(wire::WireError { reason, offset: 0 }.into());
        }
        self.handle_checked(now, from, msg)
    }

    /// [`Endpoint::handle_message`] for a message within the wire's limits (decoded from a
    /// frame, or checked).
    fn handle_checked(&mut self, now: Instant, from: RankId, msg: Message) -> Result<()> {
        match msg {
            // The handshake is the engine's (see `handshake`): nothing for a request here.
            Message::Hello { .. }
            | Message::Proof { .. }
            | Message::Welcome
            | Message::Refuse { .. }
            | Message::Leaving => {}
            Message::Advertise {
                key,
                src_rank,
                timeout_ms,
                request_info,
                buffers,
            } => {
                if src_rank != from {
                    return Err(Error::new(
                        ErrorKind::Protocol,
                        format!("{key}: advertise names {src_rank} but came from {from}"),
                    ));
                }
                // A rank receives a request or sends it, never both, and never to itself: such
                // an advertisement would start a send flow that takes the verdicts meant for
                // this rank's receive (they are routed to a send flow first).
                if from == self.me || self.recvs.contains_key(&key) {
                    return Err(Error::new(
                        ErrorKind::Protocol,
                        format!("{key}: an advertisement from {from} for a request this rank receives, or from itself"),
                    ));
                }
                if let Some(f) = flow_mut(&mut self.sends, key, from) {
                    if f.is_retired() {
                        // The new process's request: started once the old one's flow is gone.
                        let advert = Message::Advertise {
                            key,
                            src_rank,
                            timeout_ms,
                            request_info,
                            buffers,
                        };
                        f.hold_advert(now, advert);
                    } else {
                        f.on_advertise_again(&mut self.out);
                    }
                } else if let Some(&Tomb { outcome: ended, .. }) =
                    self.tombs.get(&TimerId::Send(key, from))
                {
                    self.confirm_from_tomb(key, from, ended);
                } else if self.newer_known(key, Some(from)) {
                    self.out.stats.stale_dropped += 1;
                } else {
                    let out = &mut self.out;
                    let timeout = Duration::from_millis(u64::from(timeout_ms));
                    let f = SendFlow::new(
                        now,
                        &self.config,
                        key,
                        from,
                        timeout,
                        request_info,
                        buffers,
                        out,
                    );
                    let mut f = Timed::boxed(f);
                    self.timers.arm(TimerId::Send(key, from), &mut f, now);
                    self.note_known(key, Some(from));
                    self.sends.entry(key).or_default().push((from, f));
                }
            }
            Message::Ready { key, ready } => match self.recvs.get_mut(&key) {
                Some(r) => {
                    r.on_ready(now, from, ready, &mut self.out);
                    self.timers.arm(TimerId::Recv(key), r, now);
                }
                None => self.answer_from_tomb(key, from),
            },
            Message::Vote { key, outcome } => match self.recvs.get_mut(&key) {
                Some(r) => {
                    r.on_vote(now, from, outcome, &mut self.out);
                    self.timers.arm(TimerId::Recv(key), r, now);
                }
                None if self.tombs.contains_key(&TimerId::Recv(key)) => {
                    self.answer_from_tomb(key, from)
                }
                // Another receiver's vote, for a request this rank has not started yet.
                None => self.keep_early(now, key, (from, early::Kind::Vote, outcome)),
            },
            Message::Verdict { key, outcome } => {
                if let Some(f) = flow_mut(&mut self.sends, key, from) {
                    f.on_verdict(outcome, &mut self.out);
                    self.timers.arm(TimerId::Send(key, from), f, now);
                } else if let Some(r) = self.recvs.get_mut(&key) {
                    r.on_verdict(now, from, outcome, &mut self.out);
                    self.timers.arm(TimerId::Recv(key), r, now);
                } else if let Some(&Tomb { outcome: ended, .. }) =
                    self.tombs.get(&TimerId::Send(key, from))
                {
                    // Our confirmation was lost before we forgot the flow: confirm again.
                    self.confirm_from_tomb(key, from, ended);
                } else if self.tombs.contains_key(&TimerId::Recv(key)) {
                    // The coordinator's verdict again, for a receive forgotten here.
                    self.out.stats.duplicates += 1;
                } else if !outcome.is_completed() {
                    // The coordinator's failure, for a request this rank has not started yet.
                    // (A `Completed` one cannot be right before this rank's own landings.)
                    self.keep_early(now, key, (from, early::Kind::Verdict, outcome));
                } else {
                    self.drop_unknown(key, Some(from));
                }
            }
            Message::Quiesced { key } => match self.recvs.get_mut(&key) {
                Some(r) => {
                    r.on_quiesced(from, &mut self.out);
                    self.timers.arm(TimerId::Recv(key), r, now);
                }
                // A sender's confirmation that crossed the end here: a repeat, not unknown.
                None if self.tombs.contains_key(&TimerId::Recv(key)) => {
                    self.out.stats.duplicates += 1
                }
                None => self.drop_unknown(key, Some(from)),
            },
            Message::Notify { key, payload } => {
                // Stale for a newer attempt of its key with its sender (a send flow to it) or
                // a newer receive here; another rank's newer advertisement of the same id says
                // nothing of this sender's stream.
                if self.newer_known(key, Some(from)) {
                    self.out.stats.stale_dropped += 1;
                } else {
                    self.out.events.push_back(super::request::Event::Notified {
                        key,
                        from,
                        payload,
                    });
                }
            }
        }
        self.drive(now);
        Ok(())
    }

    /// The posted receive for `segment` of `key` completed: its data is in the buffer. The
    /// driver calls this from the transport's receive completion. A landing of an older
    /// generation (or of a forgotten request) is counted and dropped.
    pub fn handle_segment_landed(
        &mut self,
        now: Instant,
        key: RequestKey,
        segment: u32,
    ) -> Result<()> {
        self.on_receive(now, key, segment, RecvRequest::on_landed)
    }

    /// The posted receive for `segment` of `key` is gone without data (cancelled and reaped, or
    /// failed): nothing can land in its buffer any more.
    pub fn handle_receive_reaped(
        &mut self,
        now: Instant,
        key: RequestKey,
        segment: u32,
    ) -> Result<()> {
        self.on_receive(now, key, segment, RecvRequest::on_reaped)
    }

    /// A posted receive of `key` ended (`event` says how); unknown keys are counted and dropped.
    fn on_receive(
        &mut self,
        now: Instant,
        key: RequestKey,
        segment: u32,
        event: fn(&mut RecvRequest, Instant, u32, &mut Out) -> bool,
    ) -> Result<()> {
        match self.recvs.get_mut(&key) {
            Some(r) => {
                let known = event(r, now, segment, &mut self.out);
                self.timers.arm(TimerId::Recv(key), r, now);
                if !known {
                    return Err(invalid(format!("{key}: no segment {segment}")));
                }
            }
            None => self.drop_unknown(key, None),
        }
        self.drive(now);
        Ok(())
    }

    /// The tracked send of `segment` of `key` to `to` finished (`ok`) or failed / was aborted.
    pub fn handle_send_done(
        &mut self,
        now: Instant,
        key: RequestKey,
        to: RankId,
        segment: u32,
        ok: bool,
    ) -> Result<()> {
        match flow_mut(&mut self.sends, key, to) {
            Some(f) => {
                let known = f.on_send_done(now, segment, ok, &mut self.out);
                self.timers.arm(TimerId::Send(key, to), f, now);
                if !known {
                    return Err(invalid(format!(
                        "{key} to {to}: no send of segment {segment}"
                    )));
                }
            }
            None => self.drop_unknown(key, Some(to)),
        }
        self.drive(now);
        Ok(())
    }

    /// Another process now holds `rank` (another engine instance bound it; its old one is
    /// gone): what this side keeps of the requests it served to the old one goes, so that the
    /// new one's, whose attempt numbers start again, are not taken for replays or stale
    /// retries of the old one's. Its ended send flows go, with their tombstones and retry
    /// entries. One with a send still in flight (asked to stop by the old process's loss, the
    /// application's send has not returned), ended or not, stays until that send is done,
    /// retired: it no longer answers an advertisement of its key (the new process's, kept and
    /// started once the flow is gone), and its send's late report cannot reach the new
    /// process's request of that key; it leaves no tombstone. (A flow that ended is kept while a send of it is not reported done, linger
    /// or not, up to `UNREPORTED_KEEP` past its linger: so it is still here to retire.) Receives are this side's own requests and stay, but
    /// owe the old process nothing more (`handle_peer_bound`), and what it sent for requests
    /// not started here yet goes (kept, it would end the new process's request of the same
    /// key).
    /// Returns every send to `rank` it knew, with its end (`None`: still running, retired;
    /// its end comes as an event later):
    /// the application may still answer, send or wait for them by key and rank.
    /// O(requests known).
    pub fn forget_sends_to(&mut self, rank: RankId) -> Vec<(RequestKey, Option<Outcome>)> {
        for r in self.recvs.values_mut() {
            r.forget_coordinator(rank);
        }
        self.owed.retain(|&(coordinator, ..)| coordinator != rank);
        let gone = self.early.forget_rank(rank);
        self.out.stats.unknown_dropped += gone as u64;
        let known: Vec<(RequestKey, Option<Outcome>)> = self
            .sends
            .iter()
            .flat_map(|(key, flows)| {
                flows
                    .iter()
                    .filter(|(to, _)| *to == rank)
                    .map(|(_, f)| (*key, f.terminal()))
            })
            .collect();
        for &(key, end) in &known {
            // Nothing of the old process's can come any more: its keys no longer make the new
            // one's older generations stale (a retired flow's neither).
            self.note_forgotten(key, Some(rank));
            let Some(f) = flow_mut(&mut self.sends, key, rank) else {
                continue;
            };
            if end.is_none() || !f.quiesced() {
                f.retire();
                continue;
            }
            self.timers.drop_early(f);
            self.forget_flow(key, rank);
        }
        let tombs: Vec<TimerId> = self
            .tombs
            .keys()
            .filter(|id| matches!(id, TimerId::Send(_, to) if *to == rank))
            .copied()
            .collect();
        for id in tombs {
            self.tombs.remove(&id);
            self.note_tomb_gone(id);
        }
        self.trim_tomb_order();
        known
    }

    /// The transport declared `rank` lost (its endpoint failed).
    pub fn handle_peer_lost(&mut self, now: Instant, rank: RankId) {
        // What it voted before the requests started here came over the connection now lost.
        self.early.peer_lost(rank);
        for (key, r) in self.recvs.iter_mut() {
            r.on_peer_lost(now, rank, &mut self.out);
            self.timers.arm(TimerId::Recv(*key), r, now);
        }
        for (key, flows) in self.sends.iter_mut() {
            for (to, f) in flows.iter_mut().filter(|(to, _)| *to == rank) {
                f.on_peer_lost(now, &mut self.out);
                self.timers.arm(TimerId::Send(*key, *to), f, now);
            }
        }
        self.drive(now);
    }

    /// The transport bound `rank` (again): a connection to it was proven. A receive that ended
    /// `PeerLost` because it lost its coordinator, `rank`, never told the coordinator why (its
    /// vote goes only while the coordinator can hear it); the coordinator, starting the request
    /// after the two were connected again, would wait for that vote until its deadline and end
    /// `TimedOut` against this rank's `PeerLost`. Each such receive sends it now, at every such
    /// bind (a connection that breaks again may lose one; a repeat is harmless there), while
    /// it is known here (`Config::linger` past its end) and after that as long as its
    /// tombstone would last (its deadline, the agreement bound and the linger past its start;
    /// at most [`OWED_CAP`] such votes kept). O(requests known): binds are rare.
    pub fn handle_peer_bound(&mut self, now: Instant, rank: RankId) {
        for r in self.recvs.values_mut() {
            r.on_peer_bound(rank, &mut self.out);
        }
        // And those forgotten since, while their tombstone would last.
        self.owed.retain(|&(_, _, _, until)| until > now);
        for &(coordinator, key, outcome, _) in &self.owed {
            if coordinator == rank {
                self.out.transmits.push_back(Transmit {
                    to: rank,
                    message: Message::Vote { key, outcome },
                });
            }
        }
    }

    /// Fires every deadline and retransmission due at `now`, and forgets requests past their
    /// linger time. Call it whenever `poll_timeout` passes, whether or not anything else
    /// happened. Only the state machines whose timer is due are looked at.
    pub fn handle_timeout(&mut self, now: Instant) {
        // A verdict that is already there beats the bound.
        self.drive(now);
        while let Some((at, lane, id)) = self.timers.pop_due(now) {
            match id {
                TimerId::Recv(key) => {
                    let Some(r) = self.recvs.get_mut(&key) else {
                        continue; // forgotten
                    };
                    if !self.timers.fired(r, at, lane) {
                        continue;
                    }
                    r.on_timeout(now, &mut self.out);
                    r.settle(now);
                    if r.is_finished(now) {
                        let tomb = Tomb::receive(
                            r.tomb_until,
                            r.terminal().unwrap_or(Outcome::PeerLost),
                            &r.askers(),
                        );
                        if let Some((coordinator, outcome)) = r.owed_vote() {
                            // Its coordinator may be bound again later than its linger.
                            if self.owed.len() >= OWED_CAP {
                                self.owed.pop_front();
                            }
                            self.owed
                                .push_back((coordinator, key, outcome, r.tomb_until));
                        }
                        self.timers.release(r);
                        self.recvs.remove(&key);
                        self.bury(id, tomb);
                        if let Some(c) = self.collective.as_mut() {
                            c.forget(key);
                        }
                    } else {
                        self.timers.rearm(id, r, now);
                    }
                }
                TimerId::Send(key, to) => {
                    let Some(f) = flow_mut(&mut self.sends, key, to) else {
                        continue;
                    };
                    if !self.timers.fired(f, at, lane) {
                        continue;
                    }
                    f.on_timeout(now, &mut self.out);
                    f.settle(now);
                    if f.is_finished(now) {
                        let held = f.take_held(now);
                        let tomb = (!f.is_retired()).then(|| Tomb {
                            until: f.tomb_until,
                            outcome: f.terminal().unwrap_or(Outcome::PeerLost),
                            asker: to,
                            more: None,
                        });
                        self.timers.release(f);
                        self.forget_flow(key, to);
                        match tomb {
                            Some(tomb) if tomb.until > now => self.bury(id, tomb),
                            // Its tombstone's time is over already (the flow was kept past it
                            // for a send's late report): buried, it could push a live one out
                            // of a full store.
                            Some(_) => self.note_tomb_gone(id),
                            // Its rank's process was replaced: nothing of it is kept, and the
                            // new process's advertisement of its key, if one came, starts.
                            // (Its retry entry went when it was retired.)
                            None => {
                                if let Some((advert, verdict)) = held {
                                    // Checked when it came.
                                    let _ = self.handle_checked(now, to, advert);
                                    if let Some(outcome) = verdict {
                                        let v = Message::Verdict { key, outcome };
                                        let _ = self.handle_checked(now, to, v);
                                    }
                                }
                            }
                        }
                    } else {
                        self.timers.rearm(id, f, now);
                    }
                }
            }
        }
        // Owed votes whose time is up, from the front (the rest go at the next bind, or as the
        // cap pushes them out).
        while self.owed.front().is_some_and(|o| o.3 <= now) {
            self.owed.pop_front();
        }
        let mut expired = false;
        while let Some((at, id)) = self.tomb_expiry.pop_due(now) {
            if self.tomb_is(id, at) {
                self.tombs.remove(&id);
                // A newer generation stays known (stale detection) as long as its tombstone.
                self.note_tomb_gone(id);
                expired = true;
            }
        }
        if expired {
            self.trim_tomb_order();
        }
        // Early messages past their keep, which no request took.
        self.out.stats.unknown_dropped += self.early.expire(now) as u64;
        self.drive(now);
    }

    /// Forgets the send flow of `key` to `to` (its timer has fired for the last time).
    fn forget_flow(&mut self, key: RequestKey, to: RankId) {
        if let Some(flows) = self.sends.get_mut(&key) {
            if let Some(i) = flows.iter().position(|(r, _)| *r == to) {
                flows.swap_remove(i);
            }
            if flows.is_empty() {
                self.sends.remove(&key);
            }
        }
    }

    fn bury(&mut self, id: TimerId, tomb: Tomb) {
        let until = tomb.until;
        if self.tombs.insert(id, tomb).is_some() {
            // The replaced tombstone's expiry will find it gone: account for it now.
            self.note_tomb_gone(id);
        }
        self.tomb_expiry.push(until, id);
        self.tomb_order.push_back((id, until));
        // Bounded: past the cap the tombstone buried first goes now, whatever its expiry (by
        // expiry, a fresh one with a short deadline would go before old day-long ones). Its
        // expiry entry finds it gone later, as for a replaced one.
        while self.tombs.len() > self.config.tomb_cap {
            let Some((old, at)) = self.tomb_order.pop_front() else {
                break;
            };
            if self.tomb_is(old, at) {
                self.tombs.remove(&old);
                self.note_tomb_gone(old);
                self.out.stats.tombs_evicted += 1;
            }
        }
        self.trim_tomb_order();
        // As for the order queue (`trim_tomb_order`), the expiry queue: an evicted (or replaced) tombstone's expiry stays
        // there until its instant, a deadline away, so without this the queue grew with the
        // request rate times the deadline whatever the cap.
        if self.tomb_expiry.len() > 2 * self.tombs.len() + 64 {
            let tombs = &self.tombs;
            self.tomb_expiry
                .retain(|at, id| tombs.get(&id).is_some_and(|t| t.until == at));
        }
    }

    /// Drops the order queue's entries whose tombstone expired, was evicted or was replaced:
    /// from the front as they come, and all at once when they outnumber the live ones
    /// (amortized O(1) a burial or an expiry). Run at both, so that the queue follows the
    /// tombstones down as well as up (an idle endpoint whose tombstones all expired keeps none).
    fn trim_tomb_order(&mut self) {
        while let Some(&(old, at)) = self.tomb_order.front() {
            if self.tomb_is(old, at) {
                break;
            }
            self.tomb_order.pop_front();
        }
        if self.tomb_order.len() > 2 * self.tombs.len() + 64 {
            let mut order = std::mem::take(&mut self.tomb_order);
            order.retain(|&(old, at)| self.tomb_is(old, at));
            self.tomb_order = order;
        }
    }

    /// Whether `id`'s tombstone is the one that expires `at` (not expired, nor replaced since).
    fn tomb_is(&self, id: TimerId, at: Instant) -> bool {
        self.tombs.get(&id).is_some_and(|t| t.until == at)
    }

    /// [`Endpoint::note_forgotten`] for the request whose tombstone `id` is gone.
    fn note_tomb_gone(&mut self, id: TimerId) {
        match id {
            TimerId::Recv(key) => self.note_forgotten(key, None),
            TimerId::Send(key, to) => self.note_forgotten(key, Some(to)),
        }
    }

    /// The advertisement or the verdict again for a send flow forgotten here that ended with
    /// `ended`: counted, and answered as the flow answered while it lingered, with `Quiesced`
    /// after a failure. Nothing confirms a `Completed` verdict (its repeat comes when the flow's
    /// pull crossed the verdict pushed to it).
    fn confirm_from_tomb(&mut self, key: RequestKey, from: RankId, ended: Outcome) {
        self.out.stats.duplicates += 1;
        if !ended.is_completed() {
            self.out.transmits.push_back(Transmit {
                to: from,
                message: Message::Quiesced { key },
            });
        }
    }

    /// Keeps `msg`, a vote or failure verdict for `key`, which has not started here, for its
    /// start (see `early`): not with an external collective (no votes travel then), nor when a
    /// newer generation of the request is known here (it is stale).
    fn keep_early(&mut self, now: Instant, key: RequestKey, msg: early::Msg) {
        if self.collective.is_some() {
            return self.drop_unknown(key, Some(msg.0));
        }
        if self.newer_receive_known(key) {
            self.out.stats.stale_dropped += 1;
            return;
        }
        let (kept, lost) = self.early.keep(now, key, msg);
        self.out.stats.unknown_dropped += lost as u64;
        match kept {
            Kept::New => self.out.stats.early_kept += 1,
            Kept::Duplicate => self.out.stats.duplicates += 1,
            Kept::Full => self.out.stats.unknown_dropped += 1,
        }
    }

    /// Requests with votes or verdicts kept for their start here (see `early`).
    pub fn early_requests(&self) -> usize {
        self.early.len()
    }

    /// A vote or ready answer for a receive forgotten here: answer one of the ranks the request
    /// answered while it ran with its verdict (a late voter has not heard it); count and drop
    /// anything else, as the running request did (a rank outside the request learns nothing).
    fn answer_from_tomb(&mut self, key: RequestKey, from: RankId) {
        match self.tombs.get(&TimerId::Recv(key)) {
            Some(tomb) if tomb.answers(from) => {
                let outcome = tomb.outcome;
                self.out.stats.duplicates += 1;
                self.out.transmits.push_back(Transmit {
                    to: from,
                    message: Message::Verdict { key, outcome },
                });
            }
            _ => self.drop_unknown(key, Some(from)),
        }
    }

    /// A request that ends early leaves its deadline's entry behind until that deadline (a
    /// minute at defaults): at thousands of requests a second the table would hold far more dead
    /// entries than live ones. Compacted once a lane holds twice as many as it has live, so its
    /// size follows the requests alive, at O(1) amortised.
    fn compact_timers(&mut self) {
        if self.timers.wants_compact() {
            self.timers.compact();
        }
    }

    /// Entries in the timer table, live and superseded (kept within twice the live timers).
    pub fn timer_entries(&self) -> usize {
        self.timers.entries()
    }

    /// Entries in the queue of tombstone expiries, live and stale (those of tombstones evicted
    /// by the cap or replaced; kept within twice the tombstones).
    pub fn tomb_entries(&self) -> usize {
        self.tomb_expiry.len()
    }

    /// The external collective has news: pick up its verdicts now rather than at the next
    /// tick (a verdict is otherwise noticed within one retransmit interval).
    pub fn handle_collective(&mut self, now: Instant) {
        self.drive(now);
    }

    /// Hands votes to the external collective and picks up its verdicts.
    fn drive(&mut self, now: Instant) {
        if let Some(c) = self.collective.as_mut() {
            for (key, r) in self.recvs.iter_mut() {
                if let Some(v) = r.pending_contribution.take() {
                    c.contribute(now, *key, &r.receivers, self.me, v);
                }
                if r.is_external_waiting() {
                    if let Some(v) = c.poll_verdict(*key) {
                        r.on_external_verdict(now, v, &mut self.out);
                        self.timers.arm(TimerId::Recv(*key), r, now);
                    }
                }
            }
        }
        self.compact_timers();
    }

    /// When `handle_timeout` must next be called, if anything is pending.
    pub fn poll_timeout(&self) -> Option<Instant> {
        // The earliest entry may be a superseded one: then the caller wakes early, once, for
        // nothing; `handle_timeout` pops it. Tombstone expiries count too: a driver calls
        // `handle_timeout` only when this passes, and an idle endpoint kept every tombstone
        // for ever otherwise (an evicted or replaced one's entry wakes it once, for nothing).
        // So do early messages' expiries, for the same reason.
        let tomb = self.tomb_expiry.peek().map(|(at, _)| at);
        [self.timers.next_due(), tomb, self.early.next_expiry()]
            .into_iter()
            .flatten()
            .min()
    }

    /// May the application start the tracked send of `segment` of `key` to `to`, with `len`
    /// bytes, now (after [`Endpoint::accept`])? Returns its descriptor (the token), or why not.
    /// Misuse (unknown request, not accepted, a segment never advertised, a second send of one,
    /// the wrong size) is an error that changes nothing; a request that has already ended
    /// answers `Ok(Err(outcome))`. Nothing changes until [`Endpoint::begin_send`].
    pub fn check_send(
        &self,
        key: RequestKey,
        to: RankId,
        segment: u32,
        len: u64,
    ) -> Result<std::result::Result<BufferDesc, Outcome>> {
        let Some(f) = flow(&self.sends, key, to) else {
            if let Some(&Tomb { outcome, .. }) = self.tombs.get(&TimerId::Send(key, to)) {
                if outcome.is_completed() {
                    // Completed: every advertised segment was sent, so any send is misuse.
                    return Err(invalid(format!(
                        "{key} to {to}: segment {segment} was already sent or never advertised"
                    )));
                }
                return Ok(Err(outcome)); // ended and forgotten: its end is still known
            }
            return Err(Error::new(
                ErrorKind::UnknownRequest,
                format!("{key}: no advertisement from {to} is known here"),
            ));
        };
        match f.check_send(segment, len) {
            Ok(d) => Ok(Ok(d)),
            Err(SendRefusal::Ended(o)) => Ok(Err(o)),
            Err(SendRefusal::NotAccepted) => {
                Err(invalid(format!("{key} from {to}: send before accept")))
            }
            Err(SendRefusal::NotAdvertised) => Err(invalid(format!(
                "{key} from {to}: segment {segment} was not advertised"
            ))),
            Err(SendRefusal::AlreadySent) => Err(invalid(format!(
                "{key} to {to}: segment {segment} was already sent"
            ))),
            Err(SendRefusal::WrongSize { advertised }) => Err(invalid(format!(
                "{key} to {to}: segment {segment} is {advertised} bytes at the receiver, {len} given"
            ))),
        }
    }

    /// The application starts the send of `segment` (after [`Endpoint::check_send`] allowed
    /// it); report its end with [`Endpoint::handle_send_done`].
    pub fn begin_send(&mut self, key: RequestKey, to: RankId, segment: u32) {
        if let Some(f) = flow_mut(&mut self.sends, key, to) {
            f.begin_send(segment);
        }
    }

    /// Is the request still running here in `role` (known and not yet ended)?
    pub fn running(&self, key: RequestKey, role: Role) -> bool {
        match role {
            Role::Receiver => self.recvs.get(&key).is_some_and(|r| !r.is_terminal()),
            Role::Sender { receiver } => {
                flow(&self.sends, key, receiver).is_some_and(|f| !f.is_terminal())
            }
        }
    }

    /// The senders' answer to the receive `key`: while it runs, `Some(true)` once a sender said
    /// ready or its data landed, `Some(false)` once one refused, `None` before any answer; once
    /// it has ended (while it lingers), `Some(true)` if it completed, `Some(false)` if it was
    /// rejected, else `None`. `None` too when the receive is not known here.
    pub fn receive_answer(&self, key: RequestKey) -> Option<bool> {
        match self.recvs.get(&key) {
            Some(r) => r.answer(),
            // Forgotten (a completed one at its end): its tombstone keeps the outcome.
            None => match self.tombs.get(&TimerId::Recv(key))?.outcome {
                Outcome::Completed => Some(true),
                Outcome::Rejected => Some(false),
                _ => None,
            },
        }
    }

    /// The length of the largest buffer of the receive `key` (None if it is not known here).
    pub fn largest_receive_segment(&self, key: RequestKey) -> Option<u64> {
        self.recvs.get(&key).map(|r| r.largest_segment())
    }

    /// Is a receive for `key` known here (running, lingering after its end, or forgotten with
    /// its tombstone still kept)?
    pub fn knows_receive(&self, key: RequestKey) -> bool {
        self.recvs.contains_key(&key) || self.tombs.contains_key(&TimerId::Recv(key))
    }

    /// Is a send of `key` to `to` known here (running, lingering after its end, or forgotten
    /// with its tombstone still kept)?
    pub fn knows_send(&self, key: RequestKey, to: RankId) -> bool {
        flow(&self.sends, key, to).is_some() || self.tombs.contains_key(&TimerId::Send(key, to))
    }

    /// The ranks this rank sends `key` to (a flow of it is known here, running or ended),
    /// except those whose flow is retired (its rank's process was replaced since).
    pub fn unretired_send_ranks(&self, key: RequestKey) -> impl Iterator<Item = RankId> + '_ {
        let flows = self.sends.get(&key).into_iter().flatten();
        flows.filter(|(_, f)| !f.is_retired()).map(|(to, _)| *to)
    }

    /// The request's deadline for the send flow of `key` to `to`, as learned from its advert.
    pub fn send_deadline(&self, key: RequestKey, to: RankId) -> Option<Instant> {
        flow(&self.sends, key, to).map(|f| f.deadline())
    }

    pub fn poll_transmit(&mut self) -> Option<Transmit> {
        self.out.transmits.pop_front()
    }
    pub fn poll_action(&mut self) -> Option<Action> {
        self.out.actions.pop_front()
    }
    pub fn poll_event(&mut self) -> Option<Event> {
        self.out.events.pop_front()
    }

    /// The agreed verdict of a receive, once known here.
    pub fn verdict(&self, key: RequestKey) -> Option<crate::error::Outcome> {
        self.recvs.get(&key).and_then(|r| r.verdict())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Many tombstones are kept (up to `Config::tomb_cap`): the one of a request answered to one
    /// rank stays within 32 bytes, its askers inline.
    #[test]
    fn a_tombstone_of_a_request_with_one_asker_takes_32_bytes() {
        assert!(
            std::mem::size_of::<Tomb>() <= 32,
            "{}",
            std::mem::size_of::<Tomb>()
        );
        let t = Tomb::receive(Instant::now(), Outcome::Completed, &[RankId(3)]);
        assert!(t.more.is_none());
        assert!(t.answers(RankId(3)) && !t.answers(RankId(4)));
        let t = Tomb::receive(Instant::now(), Outcome::Completed, &[RankId(3), RankId(5)]);
        assert!(t.answers(RankId(3)) && t.answers(RankId(5)) && !t.answers(RankId(4)));
    }

    /// The coordinator the engine reconnects before a request starts is the one the request
    /// votes to: the lowest receiver, whatever order the caller lists them in. It was the
    /// first listed: rank 105 given `[105, 102]` took itself for the coordinator and did not
    /// wait for 102, to which its request then voted.
    #[test]
    fn the_coordinator_is_the_lowest_receiver_in_any_order() {
        let ep = Endpoint::new(RankId(105), Config::default());
        assert_eq!(
            ep.coordinator_of(&[RankId(105), RankId(102)]),
            Some(RankId(102))
        );
        assert_eq!(
            ep.coordinator_of(&[RankId(107), RankId(105)]),
            None,
            "this rank coordinates"
        );
        assert_eq!(ep.coordinator_of(&[RankId(105)]), None);
        struct Silent;
        impl Collective for Silent {
            fn contribute(
                &mut self,
                _: Instant,
                _: RequestKey,
                _: &[RankId],
                _: RankId,
                _: Outcome,
            ) {
            }
            fn poll_verdict(&mut self, _: RequestKey) -> Option<Outcome> {
                None
            }
        }
        let collective =
            Endpoint::with_collective(RankId(105), Config::default(), Box::new(Silent));
        assert_eq!(
            collective.coordinator_of(&[RankId(105), RankId(102)]),
            None,
            "an external collective agrees for them"
        );
        assert!(collective
            .agreement_peers(&[RankId(105), RankId(102)])
            .is_empty());
    }

    /// The ranks a receive waits for the word of: its coordinator, or, at the coordinator,
    /// every other receiver (whose votes it reduces), each once and never itself.
    #[test]
    fn agreement_peers_are_the_coordinator_or_every_other_receiver() {
        let ep = Endpoint::new(RankId(105), Config::default());
        let r = |v: &[u32]| v.iter().map(|&x| RankId(x)).collect::<Vec<_>>();
        assert_eq!(ep.agreement_peers(&r(&[107, 102, 105])), r(&[102]));
        assert_eq!(ep.agreement_peers(&r(&[109, 105, 107])), r(&[107, 109]));
        assert_eq!(ep.agreement_peers(&r(&[105])), r(&[]));
    }
}
