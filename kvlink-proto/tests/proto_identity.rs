//! Request identity across attempts and connections: what a late message of an old attempt,
//! of an ended request or of a lost connection may still do to a request. Each test drives
//! endpoints directly, deterministically.
mod proto_sim;

use kvlink_proto::error::Outcome;
use kvlink_proto::{Endpoint, Message, RankId, RequestKey, Role};
use proto_sim::*;
use std::time::Instant;

/// The two receiving ranks of these tests' requests (the first coordinates) and their sender.
const G1: RankId = RankId(1);
const G2: RankId = RankId(2);
const C: RankId = RankId(3);

/// The verdicts `ep` has queued for `to`, draining every transmit.
fn verdicts_to(ep: &mut Endpoint, to: RankId) -> Vec<Outcome> {
    std::iter::from_fn(|| ep.poll_transmit())
        .filter_map(|x| match x.message {
            Message::Verdict { outcome, .. } if x.to == to => Some(outcome),
            _ => None,
        })
        .collect()
}

/// The vote `ep` has queued for `to`, draining every transmit.
fn vote_to(ep: &mut Endpoint, to: RankId) -> Message {
    std::iter::from_fn(|| ep.poll_transmit())
        .find(|x| x.to == to && matches!(x.message, Message::Vote { .. }))
        .expect("a vote")
        .message
}

/// A receiver's `Completed` vote that reached the coordinator before the coordinator started
/// the request is kept for its start (`early`). When the connection between the two receivers
/// then fails, the voter, told its coordinator is lost, ends `PeerLost` at once. The
/// coordinator, told the voter is lost, changed nothing of what it kept: at its start it took
/// the vote of the old connection as it came, decided `Completed` once its own data landed and
/// told its sender so, while a live receiver of the same request had ended `PeerLost`. A
/// running coordinator counts a receiver lost before the verdict as `PeerLost` whatever it
/// voted; a kept vote of a rank lost since now counts the same.
#[test]
fn a_vote_kept_before_the_start_from_a_receiver_lost_since_is_not_counted_completed() {
    let t = Instant::now();
    let key = RequestKey::new(31, 0);
    let mut g2 = Endpoint::new(G2, config());
    start_two_receiver_request(&mut g2, G2, [G1, G2], C, key, t);
    g2.handle_segment_landed(t + ms(5), key, 0).unwrap();
    // G1 has not started the request: the vote is kept for its start.
    let mut g1 = Endpoint::new(G1, config());
    g1.handle_message(t + ms(6), G2, vote_to(&mut g2, G1))
        .unwrap();
    assert_eq!(g1.early_requests(), 1);
    // The link between the two receivers fails; each is told the other is lost.
    g2.handle_peer_lost(t + ms(10), G1);
    assert_eq!(
        terminals(&mut g2, key, Role::Receiver),
        vec![Outcome::PeerLost]
    );
    g1.handle_peer_lost(t + ms(10), G2);
    // G1 starts the request afterwards, and its own data lands.
    start_two_receiver_request(&mut g1, G1, [G1, G2], C, key, t + ms(20));
    g1.handle_segment_landed(t + ms(21), key, 0).unwrap();
    assert_ne!(
        g1.verdict(key),
        Some(Outcome::Completed),
        "the coordinator counted the Completed vote of a receiver lost before its start"
    );
    assert!(
        !verdicts_to(&mut g1, C).contains(&Outcome::Completed),
        "the sender is told Completed while a live receiver ended PeerLost"
    );
    assert_eq!(
        terminals(&mut g1, key, Role::Receiver),
        vec![Outcome::PeerLost]
    );
}

/// G1, coordinator of `key` (receivers G1, G2; sender C), not started yet, holding G2's vote
/// `Cancelled` for it: G2 started the request at `t` and cancelled it a millisecond later.
fn coordinator_holding_g2s_early_cancel(key: RequestKey, t: Instant) -> Endpoint {
    let mut g2 = Endpoint::new(G2, config());
    start_two_receiver_request(&mut g2, G2, [G1, G2], C, key, t);
    g2.cancel(t + ms(1), key).unwrap();
    let mut g1 = Endpoint::new(G1, config());
    g1.handle_message(t + ms(2), G2, vote_to(&mut g2, G1))
        .unwrap();
    g1
}

/// `from`'s vote `outcome` for each of `n` requests (ids from 1000) that never start at `ep`.
fn votes_for_requests_never_started(
    ep: &mut Endpoint,
    from: RankId,
    outcome: Outcome,
    n: u64,
    at: Instant,
) {
    for id in 1000..1000 + n {
        let vote = Message::Vote {
            key: RequestKey::new(id, 0),
            outcome,
        };
        ep.handle_message(at, from, vote).unwrap();
    }
}

/// The early store kept the messages of at most 4096 requests (`early::EARLY_CAP`); past it
/// the request kept longest went, whatever it held. A coordinator that lags behind the other
/// receivers of a busy rank holds a `Completed` vote for each request they finished first, and
/// those filled the store: a cancel voted before them was pushed out by votes that their
/// voters send again at every retransmit interval until the verdict, while the cancel went
/// once (a caller that gives up waits only the agreement bound). The coordinator then ran to
/// its deadline and ended `TimedOut` against the voter's `Cancelled`. Requests that hold only
/// `Completed` votes now go first.
#[test]
fn an_early_cancel_is_not_pushed_out_by_completed_votes_of_later_requests() {
    let t = Instant::now();
    let key = RequestKey::new(32, 0);
    let mut g1 = coordinator_holding_g2s_early_cancel(key, t);
    // Twice one rank's share of the store (half its 8192 requests) of later requests, each
    // with G2's data landed first.
    votes_for_requests_never_started(&mut g1, G2, Outcome::Completed, 2 * 4096, t + ms(3));
    start_two_receiver_request(&mut g1, G1, [G1, G2], C, key, t + ms(4));
    assert_eq!(
        g1.verdict(key),
        Some(Outcome::Cancelled),
        "the early cancel was pushed out by Completed votes"
    );
}

/// Any authenticated peer could fill the early store: past its cap (then 4096, now 8192
/// requests) the request kept longest went (those holding only `Completed` votes first),
/// whoever sent what it held. A rank that sent failure votes for requests that never start here (made-up keys, or a bug)
/// pushed out another receiver's cancel, and the coordinator ran to its deadline and ended
/// `TimedOut` against that receiver's `Cancelled`. Each rank now has a share of the store: past
/// it, its own entries make room for its next.
#[test]
fn a_peer_flooding_the_early_store_does_not_push_out_another_receivers_cancel() {
    let t = Instant::now();
    let key = RequestKey::new(33, 0);
    let mut g1 = coordinator_holding_g2s_early_cancel(key, t);
    // Another rank's failure votes for twice the store's cap of requests never started here.
    const CAP: u64 = 8192;
    votes_for_requests_never_started(&mut g1, RankId(9), Outcome::Cancelled, 2 * CAP, t + ms(3));
    assert!(
        g1.early_requests() < CAP as usize,
        "one rank filled the store"
    );
    start_two_receiver_request(&mut g1, G1, [G1, G2], C, key, t + ms(4));
    assert_eq!(
        g1.verdict(key),
        Some(Outcome::Cancelled),
        "the early cancel was pushed out by another rank's votes"
    );
}
