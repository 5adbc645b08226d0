//! Trust edges of the handshake and the peer table that a review found faulty: what a peer's
//! own frames must not be able to do to this side's record of a connection. Each is pinned by a
//! deterministic test.
use std::time::{Duration, Instant};

use kvlink_proto::auth::Secret;
use kvlink_proto::peers::{HandshakeAction, Peers};
use kvlink_proto::{Handshake, Identity, Message, RankId, Refusal, Step};

const ME: RankId = RankId(1);
const R: RankId = RankId(7);

fn identity(rank: RankId, instance: u64, secret: &[u8]) -> Identity {
    Identity {
        rank,
        name: format!("rank{}", rank.0),
        instance,
        secret: Secret::new(secret.to_vec()),
    }
}

/// This side dials endpoint `ep` (as the engine's `say_hello` does) and gets the answer of a
/// process holding `their_secret`: returns what the table made of that answer.
fn dial_and_get_answer(
    p: &mut Peers<u64>,
    me: &Identity,
    ep: u64,
    their_secret: &[u8],
    t: Instant,
) -> Vec<HandshakeAction<u64>> {
    let (hs, hello) = Handshake::dial(me, 11);
    p.handshakes.insert(ep, hs);
    p.handshake_started(ep, t);
    let them = identity(R, 42, their_secret);
    let Step::Reply(answer) = Handshake::answer(22).handle(&them, hello) else {
        panic!("the answerer answers a dial")
    };
    p.on_handshake(me, ep, answer, t, 5)
}

/// An endpoint this side refused (here: the answerer's proof failed) takes no `Refuse` from the
/// peer afterwards. Before the fix the peer's `Refuse` went through as a refusal by the peer: it
/// replaced the reason recorded for the endpoint (the one `connect` reports, so a dial refused
/// for `AuthFailed` could end with `RankInUse`), counted a `refused_by_peer` that never
/// happened, and scheduled the endpoint's close a second time. A peer that refused this side
/// first and then repeats its `Refuse` counted twice in the same way.
#[test]
fn a_refuse_on_an_endpoint_already_refused_changes_nothing() {
    let t = Instant::now();
    let me = identity(ME, 1, b"ours");
    let mut p: Peers<u64> = Peers::default();
    let out = dial_and_get_answer(&mut p, &me, 10, b"theirs", t);
    assert!(
        out.contains(&HandshakeAction::Refused(Refusal::AuthFailed, None)),
        "{out:?}"
    );
    assert_eq!(p.refusal(10), Some(Refusal::AuthFailed));
    // The stranger answers our refusal with one of its own, twice.
    for _ in 0..2 {
        let out = p.on_handshake(
            &me,
            10,
            Message::Refuse {
                reason: Refusal::RankInUse,
            },
            t,
            6,
        );
        assert!(
            !out.iter()
                .any(|a| matches!(a, HandshakeAction::RefusedByPeer(_))),
            "{out:?}"
        );
    }
    assert_eq!(
        p.refusal(10),
        Some(Refusal::AuthFailed),
        "the reason connect reports"
    );
    assert_eq!((p.refusals.auth, p.refusals.by_peer), (1, 0));
    assert!(p.due_closes(t).is_empty());
    assert_eq!(
        p.due_closes(t + Duration::from_secs(1)),
        vec![10],
        "closed once, after our refusal's linger"
    );

    // Refused by the peer first, then the same refusal again: counted once, closed once.
    let mut q: Peers<u64> = Peers::default();
    let (hs, _) = Handshake::dial(&me, 11);
    q.handshakes.insert(20, hs);
    q.handshake_started(20, t);
    for _ in 0..3 {
        q.on_handshake(
            &me,
            20,
            Message::Refuse {
                reason: Refusal::AuthFailed,
            },
            t,
            6,
        );
    }
    assert_eq!(q.refusals.by_peer, 1);
    assert_eq!(q.refusal(20), Some(Refusal::AuthFailed));
    assert_eq!(q.due_closes(t), vec![20]);
}

/// A refused endpoint is refused once, even when a flood of refusals has pushed its record out
/// of the bounded memory of refusals (past 4096 of them) while it still lingers: a frame of
/// another wire version on it then is a bad frame, not a second version refusal. Before the
/// fix `refuse_version` looked only at that record: the endpoint was refused again, its
/// `Refuse` sent again, the refusal counted twice and its close scheduled twice.
#[test]
fn a_refused_endpoint_is_not_refused_again_after_a_flood_pushed_its_record_out() {
    let t = Instant::now();
    let mut p: Peers<u64> = Peers::default();
    p.handshake_started(10, t);
    assert!(p.refuse_version(10, 1, t).is_some());
    assert_eq!(p.refusals.version, 1);
    // Strangers, each refused on an endpoint of its own, within the refusal's linger.
    for e in 1000..1000 + 4200 {
        p.refuse(e, Refusal::AuthFailed, false, t);
    }
    let _ = p.due_closes(t);
    assert_eq!(p.refusal(10), None, "pushed out by the flood");
    // Endpoint 10 is still open (its close is due after the linger) and speaks again.
    assert!(p.refuse_version(10, 2, t).is_none(), "refused twice");
    assert_eq!(p.refusals.version, 1);
    let closes = p.due_closes(t + Duration::from_secs(1));
    assert_eq!(
        closes.iter().filter(|&&e| e == 10).count(),
        1,
        "closed once"
    );
}
