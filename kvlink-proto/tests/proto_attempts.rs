//! Coverage, not fixes: what a late message of an old attempt, of a rank outside the request,
//! or an old timer may do to a request, where the core already does the right thing. Each test
//! drives endpoints directly, deterministically.
mod proto_sim;

use kvlink_proto::error::{ErrorKind, Outcome};
use kvlink_proto::{
    Action, BufferPool, Endpoint, Message, RankId, RequestKey, Role, TokenAllocator,
};
use proto_sim::*;
use std::time::Instant;

/// The two receiving ranks of these tests' requests (the first coordinates), their sender, and
/// a rank that takes no part in them.
const G1: RankId = RankId(1);
const G2: RankId = RankId(2);
const C: RankId = RankId(3);
const X: RankId = RankId(9);

/// Delivers every control message `from` has queued for `to`'s rank at `at`; drops the rest.
fn pump(from: &mut Endpoint, to: &mut Endpoint, at: Instant) {
    let me = from.rank();
    while let Some(x) = from.poll_transmit() {
        if x.to == to.rank() {
            to.handle_message(at, me, x.message).unwrap();
        }
    }
}

/// The messages `ep` has queued, draining them.
fn transmits(ep: &mut Endpoint) -> Vec<(RankId, Message)> {
    std::iter::from_fn(|| ep.poll_transmit())
        .map(|x| (x.to, x.message))
        .collect()
}

/// Both receivers' data of `key` lands at `at`; their vote and verdict go between them. Both
/// must end `Completed`, and the sender must be told `Completed` by both.
fn complete(g1: &mut Endpoint, g2: &mut Endpoint, key: RequestKey, at: Instant) {
    g2.handle_segment_landed(at, key, 0).unwrap();
    pump(g2, g1, at);
    g1.handle_segment_landed(at, key, 0).unwrap();
    let to_sender = |m: &[(RankId, Message)]| {
        m.iter().any(|(to, m)| {
            *to == C
                && *m
                    == Message::Verdict {
                        key,
                        outcome: Outcome::Completed,
                    }
        })
    };
    let sent = transmits(g1);
    assert!(to_sender(&sent), "G1 told its sender {sent:?}");
    for (to, m) in sent {
        if to == G2 {
            g2.handle_message(at, G1, m).unwrap();
        }
    }
    let sent = transmits(g2);
    assert!(to_sender(&sent), "G2 told its sender {sent:?}");
    for ep in [g1, g2] {
        assert_eq!(
            terminals(ep, key, Role::Receiver),
            vec![Outcome::Completed],
            "on {}",
            ep.rank()
        );
    }
}

/// Generation 0 of a request is cancelled on both receivers and ends there; generation 1 runs.
/// Every message and landing the old attempt made comes again while the retry runs: the
/// cancel vote at the coordinator, the coordinator's `Cancelled` verdict at the other receiver,
/// a sender's refusal and confirmation, the late data of both receivers. None reaches the
/// retry, which completes on its own landings alone.
#[test]
fn an_old_attempts_cancel_refusal_and_data_never_reach_the_retry() {
    let t = Instant::now();
    let (old, new) = (RequestKey::new(50, 0), RequestKey::new(50, 1));
    let mut g1 = Endpoint::new(G1, config());
    let mut g2 = Endpoint::new(G2, config());
    start_two_receiver_request(&mut g1, G1, [G1, G2], C, old, t);
    start_two_receiver_request(&mut g2, G2, [G1, G2], C, old, t);
    g2.cancel(t + ms(1), old).unwrap();
    let old_vote = transmits(&mut g2)
        .into_iter()
        .find(|(to, m)| *to == G1 && matches!(m, Message::Vote { .. }))
        .expect("the cancel's vote")
        .1;
    g1.handle_message(t + ms(2), G2, old_vote.clone()).unwrap();
    let old_verdict = transmits(&mut g1)
        .into_iter()
        .find(|(to, _)| *to == G2)
        .expect("the coordinator's verdict")
        .1;
    assert_eq!(
        old_verdict,
        Message::Verdict {
            key: old,
            outcome: Outcome::Cancelled
        }
    );
    g2.handle_message(t + ms(2), G1, old_verdict.clone())
        .unwrap();
    for ep in [&mut g1, &mut g2] {
        ep.handle_receive_reaped(t + ms(3), old, 0).unwrap();
        assert_eq!(terminals(ep, old, Role::Receiver), vec![Outcome::Cancelled]);
        while ep.poll_transmit().is_some() {}
        while ep.poll_action().is_some() {}
    }
    // The retry, on both.
    let t1 = t + ms(100);
    start_two_receiver_request(&mut g1, G1, [G1, G2], C, new, t1);
    start_two_receiver_request(&mut g2, G2, [G1, G2], C, new, t1);
    let replays = |g1: &mut Endpoint, g2: &mut Endpoint, at: Instant| {
        g1.handle_message(at, G2, old_vote.clone()).unwrap();
        g2.handle_message(at, G1, old_verdict.clone()).unwrap();
        for ep in [g1, g2] {
            let refusal = Message::Ready {
                key: old,
                ready: false,
            };
            ep.handle_message(at, C, refusal).unwrap();
            ep.handle_message(at, C, Message::Quiesced { key: old })
                .unwrap();
            ep.handle_segment_landed(at, old, 0).unwrap();
            ep.handle_receive_reaped(at, old, 0).unwrap();
        }
    };
    // While the old attempt lingers, and again once it is forgotten (only its tombstone left).
    replays(&mut g1, &mut g2, t1 + ms(1));
    for ep in [&mut g1, &mut g2] {
        ep.handle_timeout(t1 + ms(600));
        assert_eq!(
            (ep.known(), ep.tombstones()),
            (1, 1),
            "the old one is forgotten"
        );
        assert!(ep.running(new, Role::Receiver), "on {}", ep.rank());
        assert_eq!(ep.verdict(new), None, "on {}", ep.rank());
        assert!(
            !std::iter::from_fn(|| ep.poll_action()).any(|a| matches!(
                a,
                Action::CancelReceive { key, .. } | Action::Release { key, .. } if key == new
            )),
            "the old attempt's messages touched the retry's buffers on {}",
            ep.rank()
        );
    }
    replays(&mut g1, &mut g2, t1 + ms(601));
    for ep in [&mut g1, &mut g2] {
        assert!(ep.running(new, Role::Receiver) && ep.verdict(new).is_none());
        assert!(terminals(ep, new, Role::Receiver).is_empty());
        while ep.poll_transmit().is_some() {}
    }
    complete(&mut g1, &mut g2, new, t1 + ms(602));
}

/// The old attempt's cancel reaches the coordinator before the coordinator has started either
/// attempt: it is kept for the start of generation 0 (`early`), never of generation 1. The
/// retry starts unaffected; once it is known, the same old cancel is stale and not kept, and
/// the old attempt can no longer start here to pick up what was kept.
#[test]
fn an_old_attempts_cancel_kept_before_the_start_is_never_applied_to_the_retry() {
    let t = Instant::now();
    let (old, new) = (RequestKey::new(51, 0), RequestKey::new(51, 1));
    let cancel = Message::Vote {
        key: old,
        outcome: Outcome::Cancelled,
    };
    let mut g1 = Endpoint::new(G1, config());
    g1.handle_message(t, G2, cancel.clone()).unwrap();
    assert_eq!(g1.early_requests(), 1);
    let mut g2 = Endpoint::new(G2, config());
    start_two_receiver_request(&mut g1, G1, [G1, G2], C, new, t + ms(10));
    start_two_receiver_request(&mut g2, G2, [G1, G2], C, new, t + ms(10));
    assert_eq!(g1.verdict(new), None, "the old cancel decided the retry");
    let stale = g1.stats().stale_dropped;
    let kept = g1.stats().early_kept;
    g1.handle_message(t + ms(11), G2, cancel).unwrap();
    assert_eq!(
        (g1.stats().stale_dropped, g1.stats().early_kept),
        (stale + 1, kept)
    );
    let lease = BufferPool::new(4).lease(old).unwrap();
    let desc = kv_desc(TokenAllocator::default().allocate().unwrap());
    let e = g1
        .start_receive(t + ms(12), one_buffer(old, G1, C, lease, desc, None))
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::StaleGeneration);
    while g1.poll_transmit().is_some() {}
    while g2.poll_transmit().is_some() {}
    complete(&mut g1, &mut g2, new, t + ms(20));
}

/// A rank that is neither a receiver nor a sender of a request votes a cancel, sends a
/// `Cancelled` verdict, refuses and confirms; the request's own sender sends a verdict, which
/// only the coordinator may; a receiver that does not coordinate gets another receiver's vote.
/// So does a stranger's vote kept before the start. None of it counts: the request completes.
/// On the sending side, a verdict from a receiver the flow does not serve leaves it running.
#[test]
fn a_rank_outside_the_request_neither_votes_nor_cancels_it() {
    let t = Instant::now();
    let key = RequestKey::new(52, 0);
    let cancelled = |key| Message::Verdict {
        key,
        outcome: Outcome::Cancelled,
    };
    let vote = Message::Vote {
        key,
        outcome: Outcome::Cancelled,
    };
    let mut g1 = Endpoint::new(G1, config());
    let mut g2 = Endpoint::new(G2, config());
    // Before the coordinator starts: kept, and dropped at the start.
    g1.handle_message(t, X, vote.clone()).unwrap();
    g2.handle_message(t, X, cancelled(key)).unwrap();
    start_two_receiver_request(&mut g1, G1, [G1, G2], C, key, t + ms(1));
    start_two_receiver_request(&mut g2, G2, [G1, G2], C, key, t + ms(1));
    let at = t + ms(2);
    let dropped = (g1.stats().unknown_dropped, g2.stats().unknown_dropped);
    assert!(dropped.0 >= 1 && dropped.1 >= 1, "{dropped:?}");
    for ep in [&mut g1, &mut g2] {
        ep.handle_message(at, X, vote.clone()).unwrap();
        ep.handle_message(at, X, cancelled(key)).unwrap();
        ep.handle_message(at, X, Message::Ready { key, ready: false })
            .unwrap();
        ep.handle_message(at, X, Message::Quiesced { key }).unwrap();
        // The sender's verdict: not the coordinator's.
        ep.handle_message(at, C, cancelled(key)).unwrap();
    }
    // Another receiver's vote at a receiver that does not coordinate.
    g2.handle_message(at, G1, vote).unwrap();
    for ep in [&mut g1, &mut g2] {
        assert!(ep.running(key, Role::Receiver) && ep.verdict(key).is_none());
        assert!(ep.stats().unknown_dropped >= 5, "{:?}", ep.stats());
        while ep.poll_transmit().is_some() {}
        while ep.poll_action().is_some() {}
    }
    complete(&mut g1, &mut g2, key, t + ms(3));

    // The sending side: a flow for G1, a `Cancelled` verdict from G2 (which it does not serve).
    let key = RequestKey::new(53, 0);
    let mut c = Endpoint::new(C, config());
    let desc = kv_desc(TokenAllocator::default().allocate().unwrap());
    let advertise = Message::Advertise {
        key,
        src_rank: G1,
        timeout_ms: 1000,
        request_info: vec![],
        buffers: vec![desc],
    };
    c.handle_message(t, G1, advertise).unwrap();
    c.accept(t, key, G1, true).unwrap();
    c.handle_message(t + ms(1), G2, cancelled(key)).unwrap();
    c.handle_message(t + ms(1), X, cancelled(key)).unwrap();
    assert!(c.running(key, Role::Sender { receiver: G1 }));
    assert_eq!(
        c.check_send(key, G1, 0, desc.len).unwrap(),
        Ok(desc),
        "a verdict from another rank stopped the flow"
    );
}

/// A request completes and is forgotten at once, and its tombstone goes early (the cap, here
/// one tombstone); the same key then starts again (only the engine's own record of ended keys
/// refuses that, for 10 minutes) while the old request's deadline entry is still in the timer
/// table. It does not fire on the new request: that one runs to its own deadline, 5 s on.
#[test]
fn timers_of_an_ended_request_never_fire_on_a_new_one_with_its_key() {
    let t = Instant::now();
    let (key, other) = (RequestKey::new(54, 0), RequestKey::new(55, 0));
    let mut g = Endpoint::new(
        G1,
        kvlink_proto::Config {
            tomb_cap: 1,
            ..config()
        },
    );
    let mut pool = BufferPool::new(4);
    let mut tokens = TokenAllocator::default();
    let mut start = |g: &mut Endpoint, key: RequestKey, at: Instant, timeout_ms: u64| {
        let lease = pool.lease(key).unwrap();
        let desc = kv_desc(tokens.allocate().unwrap());
        g.start_receive(
            at,
            one_buffer(key, G1, C, lease, desc, Some(ms(timeout_ms))),
        )
        .unwrap();
    };
    // Each is answered (its next timer is its deadline, 1 s on), completes and is forgotten:
    // `key` first, then `other`, whose tombstone pushes out `key`'s.
    for (i, k) in [key, other].into_iter().enumerate() {
        let at = t + ms(3 * i as u64);
        start(&mut g, k, at, 1000);
        g.handle_message(
            at,
            C,
            Message::Ready {
                key: k,
                ready: true,
            },
        )
        .unwrap();
        g.handle_segment_landed(at + ms(1), k, 0).unwrap();
        assert_eq!(
            terminals(&mut g, k, Role::Receiver),
            vec![Outcome::Completed]
        );
        g.handle_timeout(at + ms(2));
    }
    assert_eq!((g.known(), g.tombstones()), (0, 1));
    assert!(!g.knows_receive(key), "its tombstone is still kept");
    // Their superseded entries (first resend, deadline) are still there.
    assert!(g.timer_entries() >= 4, "{} entries", g.timer_entries());
    assert!(g.poll_timeout().is_some_and(|at| at <= t + ms(1000)));
    // Started again, with a deadline 5 s away: every instant the driver is asked to wake for
    // until then (the old request's deadline among them) leaves it running.
    let t2 = t + ms(10);
    start(&mut g, key, t2, 5000);
    let mut wakes = 0;
    while let Some(at) = g.poll_timeout().filter(|at| *at < t2 + ms(5000)) {
        g.handle_timeout(at.max(t2));
        wakes += 1;
        assert!(wakes < 1000);
        assert!(g.running(key, Role::Receiver), "ended at {:?}", at - t2);
        assert!(terminals(&mut g, key, Role::Receiver).is_empty());
        while g.poll_transmit().is_some() {}
    }
    g.handle_segment_landed(t2 + ms(4999), key, 0).unwrap();
    assert_eq!(
        terminals(&mut g, key, Role::Receiver),
        vec![Outcome::Completed]
    );
}
