//! A rank's process comes back on a new connection (its reconnect round's redial, proving the
//! pair's session) while this side still holds the old connection bound: it never saw that one
//! fail. The peer failed the old session's requests when it saw the failure, and the new
//! session's tag keys differ, so their data can never match here. The rebind must report the
//! rank lost here too, once, before anything of the new session, so that those requests end
//! `PeerLost` at once, as on the peer's side (they ran to their deadline before).
use std::time::{Duration, Instant};

use kvlink_proto::error::Outcome;
use kvlink_proto::peers::{HandshakeAction, PeerState, Peers};
use kvlink_proto::{
    BufferDesc, BufferKind, Config, Endpoint, Event, Handshake, Identity, Message, RankId,
    RequestKey, Role, Secret, Token,
};

const ANSWERER: RankId = RankId(0);
const DIALLER: RankId = RankId(1);

fn identity(rank: RankId, instance: u64) -> Identity {
    Identity {
        rank,
        name: format!("r{}", rank.0),
        instance,
        secret: Secret::none(),
    }
}

/// The dialler opens endpoint `ep` (the same id on both sides) and the handshake runs to its
/// end; returns the answerer's actions.
fn handshake(
    (a, me_a): (&mut Peers<u64>, &Identity),
    (d, me_d): (&mut Peers<u64>, &Identity),
    ep: u64,
    now: Instant,
) -> Vec<HandshakeAction<u64>> {
    let (hs, hello) = Handshake::dial(me_d, 100 + ep);
    d.handshakes.insert(ep, hs);
    d.handshake_started(ep, now);
    a.accepted(ep, None, now);
    let mut answerer = Vec::new();
    let mut to_answerer = vec![hello];
    while let Some(m) = to_answerer.pop() {
        let out = a.on_handshake(me_a, ep, m, now, 200 + ep);
        let replies: Vec<Message> = out
            .iter()
            .filter_map(|x| match x {
                HandshakeAction::Send(m) => Some(m.clone()),
                _ => None,
            })
            .collect();
        answerer.extend(out);
        for r in replies {
            for x in d.on_handshake(me_d, ep, r, now, 300 + ep) {
                if let HandshakeAction::Send(m) = x {
                    to_answerer.push(m);
                }
            }
        }
    }
    answerer
}

fn losses(actions: &[HandshakeAction<u64>]) -> usize {
    let lost = |x: &&HandshakeAction<u64>| matches!(x, HandshakeAction::Lost(r) if *r == DIALLER);
    actions.iter().filter(lost).count()
}

#[test]
fn a_rebind_by_the_peers_redial_reports_the_old_session_lost_once_and_first() {
    let t = Instant::now();
    let (me_a, me_d) = (identity(ANSWERER, 11), identity(DIALLER, 22));
    let (mut a, mut d): (Peers<u64>, Peers<u64>) = (Peers::default(), Peers::default());
    let first = handshake((&mut a, &me_a), (&mut d, &me_d), 10, t);
    assert_eq!(losses(&first), 0, "a first bind loses nothing: {first:?}");
    assert_eq!(a.endpoint(DIALLER), Some(10));
    assert_eq!(d.endpoint(ANSWERER), Some(10));
    d.set_dial(ANSWERER, "addr");
    let old_keys = a.keys(DIALLER).unwrap();

    // The answerer has a send in flight to the dialler: its advertisement came on the old
    // connection, and its application has not answered it yet.
    let mut ep = Endpoint::new(ANSWERER, Config::default());
    let key = RequestKey::new(5, 0);
    let buffer = BufferDesc {
        kind: BufferKind::Kv,
        segment: 0,
        addr: 0x1000,
        len: 64,
        device_id: -1,
        token: Token(1),
    };
    let advertise = Message::Advertise {
        key,
        src_rank: DIALLER,
        timeout_ms: 60_000,
        request_info: vec![],
        buffers: vec![buffer],
    };
    ep.handle_message(t, DIALLER, advertise).unwrap();
    while ep.poll_event().is_some() {}

    // The dialler sees the connection fail (the answerer does not) and its round redials.
    assert_eq!(d.on_failed(10, t), Some(ANSWERER));
    assert_eq!(d.state(ANSWERER), PeerState::Reconnecting);
    let t1 = t + Duration::from_millis(50);
    assert_eq!(d.due(t1), vec![(ANSWERER, "addr".to_string())]);
    d.dialled(ANSWERER, 12);
    let failures = a.failures;
    let rebind = handshake((&mut a, &me_a), (&mut d, &me_d), 12, t1);
    assert_eq!(a.failures, failures + 1, "counted as the failure it is");
    assert_eq!(a.endpoint(DIALLER), Some(12), "rebound: {rebind:?}");
    assert_eq!(d.endpoint(ANSWERER), Some(12));
    assert_ne!(
        a.keys(DIALLER).unwrap().inbound,
        old_keys.inbound,
        "a new session"
    );
    assert_eq!(
        losses(&rebind),
        1,
        "the old session is lost here too: {rebind:?}"
    );
    let at = |f: &dyn Fn(&HandshakeAction<u64>) -> bool| rebind.iter().position(f).unwrap();
    let lost = at(&|x| matches!(x, HandshakeAction::Lost(_)));
    assert!(
        lost < at(&|x| matches!(x, HandshakeAction::Bound(..))),
        "{rebind:?}"
    );
    assert!(rebind.contains(&HandshakeAction::Close(10)), "{rebind:?}");
    // The old endpoint's failure, heard later, is not a second loss.
    assert_eq!(a.on_failed(10, t1), None);
    assert_eq!(a.state(DIALLER), PeerState::Connected);
    assert_eq!(a.failures, failures + 1, "and counted once");

    // As the engine carries it out: the request of the old session ends now, PeerLost.
    ep.handle_peer_lost(t1, DIALLER);
    let ended = std::iter::from_fn(|| ep.poll_event()).find_map(|e| match e {
        Event::Terminal {
            key: k,
            role,
            outcome,
            ..
        } if k == key => Some((role, outcome)),
        _ => None,
    });
    let role = Role::Sender { receiver: DIALLER };
    assert_eq!(ended, Some((role, Outcome::PeerLost)));

    // A side that heard of the failure first reports its loss then; the redial's bind after
    // it reports none.
    assert_eq!(d.on_failed(12, t1), Some(ANSWERER));
    assert_eq!(a.on_failed(12, t1), Some(DIALLER));
    let t2 = t1 + Duration::from_millis(50);
    assert_eq!(d.due(t2), vec![(ANSWERER, "addr".to_string())]);
    d.dialled(ANSWERER, 14);
    let failures = a.failures;
    let after = handshake((&mut a, &me_a), (&mut d, &me_d), 14, t2);
    assert_eq!(a.failures, failures, "no second count: {after:?}");
    assert_eq!(a.endpoint(DIALLER), Some(14), "{after:?}");
    assert_eq!(losses(&after), 0, "lost once, when it failed: {after:?}");
}

#[test]
fn a_refusal_on_the_bound_connection_is_a_loss_counted_once() {
    let t = Instant::now();
    let (me_a, me_d) = (identity(ANSWERER, 11), identity(DIALLER, 22));
    let (mut a, mut d): (Peers<u64>, Peers<u64>) = (Peers::default(), Peers::default());
    handshake((&mut a, &me_a), (&mut d, &me_d), 10, t);
    assert_eq!(a.state(DIALLER), PeerState::Connected);
    let failures = a.failures;

    // The dialler's side ends the bound connection with a refusal: the requests on it are
    // lost, as on a failed connection, and the health counts it as one.
    let refused = a.on_handshake(
        &me_a,
        10,
        Message::Refuse {
            reason: kvlink_proto::wire::Refusal::RankInUse,
        },
        t,
        1,
    );
    assert_eq!(losses(&refused), 1, "{refused:?}");
    assert_eq!(
        a.failures,
        failures + 1,
        "counted as a failed connection is"
    );
    assert_eq!(a.endpoint(DIALLER), None);
    // The endpoint's close, heard after, is not a second failure.
    assert_eq!(a.on_failed(10, t), None);
    assert_eq!(a.failures, failures + 1, "and counted once");
}

/// A reconnect round's dial finds another rank at the address (a process restarted there under
/// another rank id): that rank is bound, and the rank the round was for is woken, so that a
/// `connect` waiting for the round's dial (joined, asleep on that rank) dials for itself at
/// once instead of sleeping to its deadline. Its round goes on with its next try. Before, the
/// bind dropped the round's dial without a wake.
#[test]
fn a_round_dial_that_binds_another_rank_wakes_the_rank_it_was_for() {
    let (mut d, t1) = a_round_dial_finds(OTHER);
    assert_eq!(d.round_dial(12), None);
    let woken = d.take_wakes();
    assert!(
        woken.contains(&ANSWERER),
        "the round's rank is not woken: {woken:?}"
    );
    assert_eq!(d.state(ANSWERER), PeerState::Reconnecting);
    let later = t1 + Duration::from_secs(1);
    assert_eq!(d.due(later), vec![(ANSWERER, "addr".to_string())]);
}

/// Rank 2, found at "addr" by the dialler's reconnect round for the answerer (dialled on
/// endpoint 12): the dialler's table, woken ranks taken before that handshake, and its time.
fn a_round_dial_finds(other: RankId) -> (Peers<u64>, Instant) {
    let t = Instant::now();
    let (me_a, me_d, me_o) = (
        identity(ANSWERER, 11),
        identity(DIALLER, 22),
        identity(other, 33),
    );
    let (mut a, mut d, mut o): (Peers<u64>, Peers<u64>, Peers<u64>) =
        (Peers::default(), Peers::default(), Peers::default());
    handshake((&mut a, &me_a), (&mut d, &me_d), 10, t);
    d.set_dial(ANSWERER, "addr");
    assert_eq!(d.on_failed(10, t), Some(ANSWERER));
    let t1 = t + Duration::from_millis(50);
    assert_eq!(d.due(t1), vec![(ANSWERER, "addr".to_string())]);
    d.dialled(ANSWERER, 12);
    assert_eq!(d.round_dial(12), Some(ANSWERER));
    d.take_wakes();
    // Another process answers at "addr", as `other`.
    handshake((&mut o, &me_o), (&mut d, &me_d), 12, t1);
    assert_eq!(d.endpoint(other), Some(12));
    (d, t1)
}

const OTHER: RankId = RankId(2);

/// The rank a round's dial found at the address (another process took it) is one this side
/// dialled: when its connection breaks it is dialled again there, one dial at a time with the
/// old rank's round, which dials there too. Found by review: the bind
/// kept no address for it, so its failure left it `Failed` on both sides (the other side,
/// dialled, waits for this one), and nobody dialled it again.
#[test]
fn a_rank_a_rounds_dial_found_is_redialled_at_that_address() {
    let (mut d, t1) = a_round_dial_finds(OTHER);
    assert_eq!(d.on_failed(12, t1), Some(OTHER));
    assert_eq!(d.state(OTHER), PeerState::Reconnecting);
    // Both ranks' rounds now dial "addr": one dial at a time goes there (two at once to one
    // process make it bind one and rebind to the other), and the found rank's comes.
    let mut now = t1;
    let mut dialled_other = false;
    for _ in 0..20 {
        now += Duration::from_secs(1);
        let due = d.due(now);
        assert!(due.len() <= 1, "two dials at once to one address: {due:?}");
        for (rank, address) in due {
            assert_eq!(address, "addr");
            dialled_other |= rank == OTHER;
            d.round_dial_void(rank);
        }
    }
    assert!(dialled_other, "not dialled again");
}

/// A rank that dialled this side and failed, forgotten since (more than twice
/// `FAILED_KEPT` other such ranks failed after it), that comes back from another process is
/// still seen as a new process: what this side kept of the old one's requests goes. The same
/// process coming back is not. Found by review: the forgetting dropped the process id with
/// the rank, and the new process's keys could be refused as the old one's replays.
#[test]
fn a_forgotten_rank_that_comes_back_from_another_process_is_a_new_instance() {
    use kvlink_proto::peers::FAILED_KEPT;
    const BACK: RankId = RankId(5);
    let t = Instant::now();
    let me = identity(ANSWERER, 11);
    let mut a: Peers<u64> = Peers::default();
    let come_back = |a: &mut Peers<u64>, instance: u64, ep: u64| {
        let mut d: Peers<u64> = Peers::default();
        let out = handshake((a, &me), (&mut d, &identity(BACK, instance)), ep, t);
        out.iter()
            .any(|x| matches!(x, HandshakeAction::NewInstance(r) if *r == BACK))
    };
    for (instance, new) in [(42, false), (42, false), (43, true)] {
        assert_eq!(come_back(&mut a, instance, 10), new, "instance {instance}");
        assert_eq!(a.state(BACK), PeerState::Connected);
        if new {
            break;
        }
        assert_eq!(a.on_failed(10, t), Some(BACK));
        assert_eq!(a.state(BACK), PeerState::Failed);
        for i in 0..2 * FAILED_KEPT as u64 + 1 {
            let mut d: Peers<u64> = Peers::default();
            let (rank, ep) = (RankId(1000 + i as u32), 1000 + i);
            handshake((&mut a, &me), (&mut d, &identity(rank, 7)), ep, t);
            a.on_failed(ep, t);
        }
        assert_eq!(a.state(BACK), PeerState::Unknown, "forgotten");
    }
}
