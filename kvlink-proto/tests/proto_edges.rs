//! Edges of the handshake and of the core's configuration that reviews found faulty, each pinned
//! by a deterministic test.
use std::sync::mpsc;
use std::time::{Duration, Instant};

use kvlink_proto::auth::Secret;
use kvlink_proto::error::Outcome;
use kvlink_proto::peers::{HandshakeAction, PeerState, Peers, HANDSHAKE_LIMIT};
use kvlink_proto::{
    BufferDesc, BufferKind, BufferPool, Collective, Config, Endpoint, Handshake, Identity, Message,
    RankId, ReceiveFlow, ReceiveSpec, RequestKey, Step, Token,
};

const ME: RankId = RankId(1);
const R: RankId = RankId(7);

/// A 64-byte host buffer for segment `segment` under `token`, at an address of its own.
fn desc(segment: u32, token: u64) -> BufferDesc {
    BufferDesc {
        kind: BufferKind::Kv,
        segment,
        addr: 0x1000 * (u64::from(segment) + 1),
        len: 64,
        device_id: -1,
        token: Token(token),
    }
}

fn identity(rank: RankId, instance: u64) -> Identity {
    Identity {
        rank,
        name: format!("rank{}", rank.0),
        instance,
        secret: Secret::none(),
    }
}

/// Rank `R` dials this side on `endpoint` at `t`: its `Hello` answered here; returns its
/// `Proof` (not yet handled). `n` makes the challenges differ between dials.
fn dial_to_proof(p: &mut Peers<u64>, endpoint: u64, t: Instant, n: u64) -> Message {
    let me = identity(ME, 1);
    let them = identity(R, 42);
    let (mut hs, hello) = Handshake::dial(&them, n);
    p.accepted(endpoint, None, t);
    let answer = sent(p.on_handshake(&me, endpoint, hello, t, n + 1));
    assert!(matches!(hs.handle(&them, answer), Step::Verified { .. }));
    hs.accept(&them, None).unwrap()
}

/// Handles `R`'s `Proof` on `endpoint`: the rank is bound there.
fn bind_by_proof(p: &mut Peers<u64>, endpoint: u64, proof: Message, t: Instant) {
    let out = p.on_handshake(&identity(ME, 1), endpoint, proof, t, 99);
    assert!(
        out.contains(&HandshakeAction::Bound(R, "rank7".into())),
        "{out:?}"
    );
    assert_eq!(p.endpoint(R), Some(endpoint));
}

/// A table where rank `R` dialled this side on endpoint 10 and its handshake bound it.
fn bound_by_its_dial(t: Instant) -> Peers<u64> {
    let mut p: Peers<u64> = Peers::default();
    let proof = dial_to_proof(&mut p, 10, t, 5);
    bind_by_proof(&mut p, 10, proof, t);
    p
}

/// An answered dial whose `Proof` comes only after its handshake ran past HANDSHAKE_LIMIT and
/// its endpoint was handed out to be closed: the `Proof` binds nothing (before, it bound the
/// rank to the endpoint being closed, and its failure then cost a spurious loss). Once the
/// failure is reported, the rank's next dial binds as usual.
#[test]
fn a_proof_after_the_handshake_limit_does_not_bind_the_endpoint_being_closed() {
    let t = Instant::now();
    let mut p: Peers<u64> = Peers::default();
    let proof = dial_to_proof(&mut p, 10, t, 5);
    let late = t + HANDSHAKE_LIMIT;
    assert_eq!(
        p.due_closes(late),
        vec![10],
        "the stale handshake's endpoint is closed"
    );
    let out = p.on_handshake(&identity(ME, 1), 10, proof, late, 7);
    assert!(
        !out.iter().any(|a| matches!(a, HandshakeAction::Bound(..))),
        "{out:?}"
    );
    assert_eq!(p.endpoint(R), None);
    p.on_failed(10, late);
    // The dialler tries again on a new endpoint: bound.
    let proof = dial_to_proof(&mut p, 11, late, 8);
    bind_by_proof(&mut p, 11, proof, late);
}

/// A frame of another wire version on an endpoint handed out to be closed for a handshake past
/// HANDSHAKE_LIMIT is dropped as every frame there is: no version refusal (before, it was
/// refused: a refusal counted for a stranger already being closed, and its endpoint handed out
/// for closing a second time). A fresh endpoint is still refused for its version.
#[test]
fn a_frame_of_another_version_after_the_handshake_limit_is_not_refused_again() {
    let t = Instant::now();
    let mut p: Peers<u64> = Peers::default();
    let _proof = dial_to_proof(&mut p, 10, t, 5);
    let late = t + HANDSHAKE_LIMIT;
    assert_eq!(p.due_closes(late), vec![10]);
    assert_eq!(p.refuse_version(10, 3, late), None);
    assert_eq!(p.refusal(10), None);
    assert!(
        p.due_closes(late + Duration::from_secs(1)).is_empty(),
        "not closed twice"
    );
    p.accepted(11, None, late);
    assert!(matches!(
        p.refuse_version(11, 3, late),
        Some(Message::Refuse { .. })
    ));
    // A second frame on the refused endpoint: nothing to refuse.
    assert_eq!(p.refuse_version(11, 4, late), None);
}

fn sent(out: Vec<HandshakeAction<u64>>) -> Message {
    out.into_iter()
        .find_map(|x| match x {
            HandshakeAction::Send(m) => Some(m),
            _ => None,
        })
        .unwrap()
}

/// A `Hello` that names this side's own rank, arriving on an endpoint whose handshake is done
/// (the rank is bound to it), is a handshake message out of order, as any other late `Hello`:
/// it must not refuse the endpoint and silently unbind the live rank (the table's
/// `handshakes` field says "a late handshake message on a bound endpoint is answered as out of
/// order"). Before the fix it unbound the rank without a `Lost`, so the requests on it were
/// never told their peer was gone.
#[test]
fn a_late_hello_naming_our_rank_on_a_bound_endpoint_is_out_of_order() {
    let t = Instant::now();
    let mut p = bound_by_its_dial(t);
    // The same late `Hello` with any other rank is out of order and changes nothing.
    let (_, other) = Handshake::dial(&identity(RankId(9), 42), 5);
    let out = p.on_handshake(&identity(ME, 1), 10, other, t, 7);
    assert_eq!(out, vec![HandshakeAction::BadFrame]);
    assert_eq!(p.endpoint(R), Some(10));
    // Naming our rank: the same.
    let (_, mine) = Handshake::dial(&identity(ME, 42), 5);
    let out = p.on_handshake(&identity(ME, 1), 10, mine, t, 7);
    assert_eq!(out, vec![HandshakeAction::BadFrame], "{out:?}");
    assert_eq!(p.state(R), PeerState::Connected);
    assert_eq!(p.endpoint(R), Some(10));
    assert_eq!(p.refusals.rank_in_use, 0);
    assert!(p.due_closes(t + Duration::from_secs(1)).is_empty());
}

/// A refused endpoint is not refused again (nor closed twice): a peer that keeps sending a
/// `Hello` with this side's rank on an endpoint already refused is out of order.
#[test]
fn a_refused_endpoint_is_not_refused_again() {
    let t = Instant::now();
    let mut p: Peers<u64> = Peers::default();
    p.accepted(20, None, t);
    let (_, mine) = Handshake::dial(&identity(ME, 42), 5);
    let out = p.on_handshake(&identity(ME, 1), 20, mine.clone(), t, 7);
    assert!(out.contains(&HandshakeAction::Refused(
        kvlink_proto::Refusal::RankInUse,
        None
    )));
    assert_eq!(p.refusals.rank_in_use, 1);
    for _ in 0..3 {
        let out = p.on_handshake(&identity(ME, 1), 20, mine.clone(), t, 7);
        assert_eq!(out, vec![HandshakeAction::BadFrame], "{out:?}");
    }
    assert_eq!(p.refusals.rank_in_use, 1);
    assert_eq!(p.due_closes(t + Duration::from_secs(1)), vec![20]);
}

/// An external collective that answers every request with the same verdict, whatever was
/// voted: `Answers(None)` never answers.
struct Answers(Option<Outcome>);

impl Collective for Answers {
    fn contribute(
        &mut self,
        _now: Instant,
        _key: RequestKey,
        _receivers: &[RankId],
        _me: RankId,
        _vote: Outcome,
    ) {
    }
    fn poll_verdict(&mut self, _key: RequestKey) -> Option<Outcome> {
        self.0
    }
}

/// `handle_timeout` must return whatever the configuration: with a zero retransmit interval a
/// request that wants a retransmission (here: polling its external collective) is due again at
/// the very instant it fired, and the loop in `handle_timeout` popped it forever. (Without a
/// collective the same spin queued an advertisement per turn, without bound.)
#[test]
fn a_zero_retransmit_interval_does_not_spin_handle_timeout() {
    let (done, finished) = mpsc::channel();
    std::thread::spawn(move || {
        let cfg = Config {
            retransmit: Duration::ZERO,
            ..Config::default()
        };
        let t = Instant::now();
        let mut ep = Endpoint::with_collective(ME, cfg, Box::new(Answers(None)));
        let key = RequestKey::new(5, 0);
        let mut pool = BufferPool::new(4);
        let lease = pool.lease(key).unwrap();
        let desc = desc(0, 11);
        ep.start_receive(
            t,
            ReceiveSpec {
                key,
                receivers: vec![ME],
                flows: vec![ReceiveFlow {
                    sender: R,
                    buffers: vec![(lease, desc)],
                }],
                request_info: vec![],
                timeout: None,
            },
        )
        .unwrap();
        ep.cancel(t, key).unwrap();
        while ep.poll_transmit().is_some() {}
        ep.handle_timeout(t + Duration::from_millis(1));
        let _ = done.send(ep.poll_timeout());
    });
    let next = finished
        .recv_timeout(Duration::from_secs(10))
        .expect("handle_timeout spun");
    assert!(next.is_some());
}

/// A message handed to the endpoint without a frame (`handle_message`, the core's own API)
/// keeps the limits a frame is decoded under: an advertisement with no buffers, two buffers
/// under one token, or a zero timeout, and a notification past `MAX_PAYLOAD`, are protocol
/// errors, counted as bad frames, that start and queue nothing. Before, only `handle_frame`
/// (through the decoder) refused them, and such an advertisement started a send flow.
#[test]
fn a_message_without_a_frame_keeps_the_wire_limits() {
    let t = Instant::now();
    let key = RequestKey::new(1, 0);
    let mut ctx = Endpoint::new(ME, Config::default());
    let advertise = |timeout_ms, buffers| Message::Advertise {
        key,
        src_rank: R,
        timeout_ms,
        request_info: vec![],
        buffers,
    };
    let bad = [
        advertise(1000, vec![]),
        advertise(1000, vec![desc(0, 5), desc(1, 5)]),
        advertise(0, vec![desc(0, 5)]),
        Message::Notify {
            key,
            payload: vec![0; kvlink_proto::wire::MAX_PAYLOAD + 1],
        },
    ];
    for (i, m) in bad.into_iter().enumerate() {
        let e = ctx.handle_message(t, R, m).unwrap_err();
        assert_eq!(e.kind, kvlink_proto::error::ErrorKind::Protocol, "{i}: {e}");
        assert_eq!(ctx.stats().bad_frames, i as u64 + 1);
    }
    assert_eq!(ctx.known(), 0, "a send flow was started");
    assert!(ctx.poll_event().is_none() && ctx.poll_transmit().is_none());
    // Within the limits, the same advertisement starts its flow.
    ctx.handle_message(t, R, advertise(1000, vec![desc(0, 5), desc(1, 6)]))
        .unwrap();
    assert_eq!(ctx.known(), 1);
}

/// A rank receives a request or sends it, never both. An advertisement for a key this rank
/// receives was refused; the reverse, `start_receive` of a key this rank is sending, started a
/// receive whose verdicts went to the send flow (routed first). Now `InvalidArgument`, nothing
/// taken or sent.
#[test]
fn a_key_sent_from_here_is_not_received_here_too() {
    let t = Instant::now();
    let key = RequestKey::new(3, 0);
    let mut ep = Endpoint::new(ME, Config::default());
    let desc = desc(0, 9);
    ep.handle_message(
        t,
        R,
        Message::Advertise {
            key,
            src_rank: R,
            timeout_ms: 1000,
            request_info: vec![],
            buffers: vec![desc],
        },
    )
    .unwrap();
    while ep.poll_event().is_some() {}
    while ep.poll_transmit().is_some() {}
    let mut pool = BufferPool::new(4);
    let lease = pool.lease(key).unwrap();
    let e = ep
        .start_receive(
            t,
            ReceiveSpec {
                key,
                receivers: vec![ME],
                flows: vec![ReceiveFlow {
                    sender: RankId(8),
                    buffers: vec![(
                        lease,
                        BufferDesc {
                            token: Token(10),
                            ..desc
                        },
                    )],
                }],
                request_info: vec![],
                timeout: None,
            },
        )
        .unwrap_err();
    assert_eq!(
        e.kind,
        kvlink_proto::error::ErrorKind::InvalidArgument,
        "{e}"
    );
    assert_eq!(ep.known(), 1, "only the send flow");
    assert!(ep.poll_transmit().is_none(), "an advertisement went out");
}

/// A rank that advertised to this one a request of some id, in a late generation, says nothing
/// of this rank's own receives of that id: it chose the key, and may be any bound rank. Such
/// an advertisement (`(7, 5)` from R) made this rank's receive of `(7, 0)` a `StaleGeneration`,
/// and the early votes of `(7, 0)` stale, for as long as R's flow and its tombstone lasted.
#[test]
fn a_peers_advertisement_of_a_late_generation_does_not_make_this_ranks_receive_stale() {
    let t = Instant::now();
    let mut ep = Endpoint::new(ME, Config::default());
    ep.handle_message(
        t,
        R,
        Message::Advertise {
            key: RequestKey::new(7, 5),
            src_rank: R,
            timeout_ms: 1000,
            request_info: vec![],
            buffers: vec![desc(0, 9)],
        },
    )
    .unwrap();
    while ep.poll_event().is_some() {}
    while ep.poll_transmit().is_some() {}
    // Another receiver's early cancel of this rank's next request is kept, not dropped as stale.
    let key = RequestKey::new(7, 0);
    let before = ep.stats().stale_dropped;
    ep.handle_message(
        t,
        RankId(0),
        Message::Vote {
            key,
            outcome: Outcome::Cancelled,
        },
    )
    .unwrap();
    assert_eq!(
        ep.stats().stale_dropped,
        before,
        "the early vote was dropped as stale"
    );
    let mut pool = BufferPool::new(4);
    let lease = pool.lease(key).unwrap();
    ep.start_receive(
        t,
        ReceiveSpec {
            key,
            receivers: vec![RankId(0), ME],
            flows: vec![ReceiveFlow {
                sender: RankId(8),
                buffers: vec![(lease, desc(0, 10))],
            }],
            request_info: vec![],
            timeout: None,
        },
    )
    .expect("a receive of the rank's own request");
}

/// A refused advertisement's flow keeps waiting for its verdict (its receiver may answer it
/// late, and the ranks must agree), but without its buffer list: nothing will be sent. A send
/// asked of it after the refusal, of an advertised segment or another, is told the request
/// ended `Rejected`; an answer from its receiver still ends it.
#[test]
fn a_refused_flow_tells_every_send_it_ended_and_still_takes_its_verdict() {
    let t = Instant::now();
    let mut ep = Endpoint::new(ME, Config::default());
    let key = RequestKey::new(4, 0);
    ep.handle_message(
        t,
        R,
        Message::Advertise {
            key,
            src_rank: R,
            timeout_ms: u32::MAX,
            request_info: vec![],
            buffers: vec![desc(0, 1), desc(1, 2)],
        },
    )
    .unwrap();
    ep.accept(t, key, R, false).unwrap();
    for segment in [0, 1, 7] {
        assert_eq!(
            ep.check_send(key, R, segment, 64).unwrap(),
            Err(Outcome::Rejected),
            "segment {segment}"
        );
    }
    while ep.poll_event().is_some() {}
    while ep.poll_transmit().is_some() {}
    ep.handle_message(
        t,
        R,
        Message::Verdict {
            key,
            outcome: Outcome::Rejected,
        },
    )
    .unwrap();
    let ended = std::iter::from_fn(|| ep.poll_event()).any(|ev| {
        matches!(
            ev,
            kvlink_proto::Event::Terminal {
                outcome: Outcome::Rejected,
                ..
            }
        )
    });
    assert!(ended, "the verdict did not end the refused flow");
}

/// A collective's `Completed` is refused before this rank's own data landed, as a
/// coordinator's message is: a rank that cancelled with nothing landed, told `Completed` by a
/// faulty collective, used to end `Completed` with its bytes missing. It ends as it voted, and
/// the refusal is counted as a bad frame.
#[test]
fn a_collectives_completed_before_this_ranks_landings_is_refused() {
    let t = Instant::now();
    let mut ep = Endpoint::with_collective(
        ME,
        Config::default(),
        Box::new(Answers(Some(Outcome::Completed))),
    );
    let key = RequestKey::new(6, 0);
    let mut pool = BufferPool::new(4);
    let lease = pool.lease(key).unwrap();
    ep.start_receive(
        t,
        ReceiveSpec {
            key,
            receivers: vec![ME, RankId(9)],
            flows: vec![ReceiveFlow {
                sender: R,
                buffers: vec![(lease, desc(0, 12))],
            }],
            request_info: vec![],
            timeout: None,
        },
    )
    .unwrap();
    ep.cancel(t, key).unwrap();
    ep.handle_receive_reaped(t, key, 0).unwrap();
    let mut ends = Vec::new();
    for later in [0, 1, 10, 100, 1_000, 10_000, 100_000] {
        ep.handle_timeout(t + Duration::from_millis(later));
        while ep.poll_transmit().is_some() {}
        while let Some(e) = ep.poll_event() {
            if let kvlink_proto::Event::Terminal { outcome, .. } = e {
                ends.push(outcome);
            }
        }
    }
    assert_eq!(ends, vec![Outcome::Cancelled], "the receive's end");
    assert!(ep.stats().bad_frames >= 1, "{:?}", ep.stats());
}

/// Cancelling (or giving up) a key the endpoint does not know is `UnknownRequest`, as an answer
/// to one is (`accept`): it was `InvalidArgument`, the kind for a call made wrong.
#[test]
fn a_cancel_of_a_key_not_known_here_is_unknown_request() {
    let t = Instant::now();
    let mut ep = Endpoint::new(ME, Config::default());
    let key = RequestKey::new(77, 0);
    let e = ep.cancel(t, key).unwrap_err();
    assert_eq!(
        e.kind,
        kvlink_proto::error::ErrorKind::UnknownRequest,
        "{e}"
    );
    let e = ep.give_up(t, key, Outcome::TimedOut).unwrap_err();
    assert_eq!(
        e.kind,
        kvlink_proto::error::ErrorKind::UnknownRequest,
        "{e}"
    );
    let e = ep.accept(t, key, R, true).unwrap_err();
    assert_eq!(
        e.kind,
        kvlink_proto::error::ErrorKind::UnknownRequest,
        "{e}"
    );
}

/// A notification is dropped as stale only for a newer attempt of its key with the rank that
/// sent it. Another rank's newer advertisement of the same request id says nothing of the
/// sender's stream: before, rank 2's `(7, 1)` made rank 3's notification `(7, 0)` stale, and it
/// was dropped (`stale_dropped`) with no `Notified`. The sender's own newer attempt still makes
/// an older notification of it stale.
#[test]
fn a_notification_is_stale_only_for_its_senders_newer_attempt() {
    let t = Instant::now();
    let (b, a) = (RankId(2), RankId(3));
    let mut ep = Endpoint::new(ME, Config::default());
    ep.handle_message(
        t,
        b,
        Message::Advertise {
            key: RequestKey::new(7, 1),
            src_rank: b,
            timeout_ms: 1000,
            request_info: vec![],
            buffers: vec![desc(0, 5)],
        },
    )
    .unwrap();
    while ep.poll_event().is_some() {}
    let notify = |generation| Message::Notify {
        key: RequestKey::new(7, generation),
        payload: vec![1, 2, 3],
    };
    ep.handle_message(t, a, notify(0)).unwrap();
    let got = std::iter::from_fn(|| ep.poll_event()).collect::<Vec<_>>();
    assert!(
        got.iter()
            .any(|e| matches!(e, kvlink_proto::Event::Notified { from, .. } if *from == a)),
        "rank 3's notification was not delivered: {got:?}"
    );
    assert_eq!(ep.stats().stale_dropped, 0);
    // From the rank whose newer attempt this is: stale.
    ep.handle_message(t, b, notify(0)).unwrap();
    assert!(std::iter::from_fn(|| ep.poll_event())
        .all(|e| !matches!(e, kvlink_proto::Event::Notified { .. })));
    assert_eq!(ep.stats().stale_dropped, 1);
}
