//! Edges of the cross-rank agreement (`agreement.rs`, the votes and verdicts of
//! `request/recv.rs`) that a review found faulty, each pinned by a deterministic test.
mod proto_sim;

use kvlink_proto::error::Outcome;
use kvlink_proto::{BufferDesc, Endpoint, Message, RankId, RequestKey, Role};
use proto_sim::*;
use std::time::Instant;

/// The two receiving ranks of these tests' requests (the first coordinates) and their one
/// sender.
const G1: RankId = RankId(1);
const G2: RankId = RankId(2);
const C: RankId = RankId(3);

/// Rank `me`'s endpoint with request `key` started at `t`: receivers `G1` and `G2`, one buffer
/// (segment 0, not landed) from `C`; returns the endpoint and that buffer's descriptor.
fn receiving(me: RankId, key: RequestKey, t: Instant) -> (Endpoint, BufferDesc) {
    let mut ep = Endpoint::new(me, config());
    let desc = start_two_receiver_request(&mut ep, me, [G1, G2], C, key, t);
    (ep, desc)
}

/// A rank's own vote never comes over the wire: the coordinator records it itself. A `Vote`
/// that names the coordinator's own rank as its sender (a transport or a caller that routes a
/// message to the wrong rank) was taken as that rank's vote, replacing the real one: a
/// `Completed` from "itself" made the coordinator decide `Completed` with none of its own
/// segments landed, and end `Completed` once the cancelled receive was reaped, breaking
/// "`Completed` iff every byte of every segment landed". `on_verdict` already refuses a verdict
/// from its own rank; a vote from it is now dropped the same way.
#[test]
fn a_vote_naming_the_coordinators_own_rank_is_not_its_vote() {
    let t = Instant::now();
    let key = RequestKey::new(11, 0);
    // Two receivers: G1 is the coordinator, its one segment from `C` has not landed.
    let (mut gen, _) = receiving(G1, key, t);
    let dropped = gen.stats().unknown_dropped;
    // The other receiver's data landed: its vote is `Completed`.
    gen.handle_message(
        t + ms(1),
        G2,
        Message::Vote {
            key,
            outcome: Outcome::Completed,
        },
    )
    .unwrap();
    // A `Completed` vote that names the coordinator itself.
    gen.handle_message(
        t + ms(2),
        G1,
        Message::Vote {
            key,
            outcome: Outcome::Completed,
        },
    )
    .unwrap();
    assert_eq!(
        gen.verdict(key),
        None,
        "a vote from the coordinator's own rank decided the request"
    );
    assert_eq!(gen.stats().unknown_dropped, dropped + 1);
    assert!(gen.running(key, Role::Receiver));
    assert!(terminals(&mut gen, key, Role::Receiver).is_empty());
    // Its own landing still completes it (both receivers have now voted `Completed`).
    gen.handle_segment_landed(t + ms(4), key, 0).unwrap();
    assert_eq!(
        terminals(&mut gen, key, Role::Receiver),
        vec![Outcome::Completed]
    );
}

/// A non-coordinating receiver takes a `Completed` verdict only once its own segments have all
/// landed: before that a correct coordinator cannot have decided it (it needs this rank's
/// `Completed` vote, sent only after the landings), so it is a faulty or forged verdict, and
/// taking it ended this rank `Completed` with bytes missing. Dropped and counted as a bad
/// message; after the landing the coordinator's real verdict is taken.
#[test]
fn a_completed_verdict_before_this_ranks_own_landings_is_refused() {
    let t = Instant::now();
    let key = RequestKey::new(12, 0);
    // This side is G2; G1 coordinates.
    let (mut gen, _) = receiving(G2, key, t);
    let bad = gen.stats().bad_frames;
    let completed = Message::Verdict {
        key,
        outcome: Outcome::Completed,
    };
    gen.handle_message(t + ms(1), G1, completed.clone())
        .unwrap();
    assert_eq!(gen.verdict(key), None, "taken with nothing landed");
    assert_eq!(gen.stats().bad_frames, bad + 1);
    assert!(terminals(&mut gen, key, Role::Receiver).is_empty());
    // Its segment lands; the coordinator's verdict now completes it.
    gen.handle_segment_landed(t + ms(2), key, 0).unwrap();
    gen.handle_message(t + ms(3), G1, completed).unwrap();
    assert_eq!(
        terminals(&mut gen, key, Role::Receiver),
        vec![Outcome::Completed]
    );
}

/// An `Advertise` for a key this rank receives (or one claiming to come from this very rank)
/// is a protocol error: before, it started a send flow, and the coordinator's verdicts, routed to
/// a send flow `(key, from)` first, went there instead of to the receive, which then ended
/// unagreed at its bound.
#[test]
fn an_advertisement_for_a_key_this_rank_receives_is_a_protocol_error() {
    let t = Instant::now();
    let key = RequestKey::new(13, 0);
    let (mut gen, desc) = receiving(G2, key, t);
    for from in [G1, G2] {
        let e = gen
            .handle_message(
                t + ms(1),
                from,
                Message::Advertise {
                    key,
                    src_rank: from,
                    timeout_ms: 1000,
                    request_info: vec![],
                    buffers: vec![desc],
                },
            )
            .unwrap_err();
        assert_eq!(
            e.kind,
            kvlink_proto::error::ErrorKind::Protocol,
            "{from}: {e}"
        );
    }
    assert!(!gen.running(key, Role::Sender { receiver: G1 }));
    // The coordinator's verdict still reaches the receive.
    gen.handle_segment_landed(t + ms(2), key, 0).unwrap();
    gen.handle_message(
        t + ms(3),
        G1,
        Message::Verdict {
            key,
            outcome: Outcome::Completed,
        },
    )
    .unwrap();
    assert_eq!(
        terminals(&mut gen, key, Role::Receiver),
        vec![Outcome::Completed]
    );
}

/// `ep`'s receive of `key` (one segment, 0) has the verdict `Cancelled` (`why` if not) and ends
/// `Cancelled` once its cancelled receive is reaped at `at`.
fn ends_cancelled_once_reaped(ep: &mut Endpoint, key: RequestKey, at: Instant, why: &str) {
    assert_eq!(ep.verdict(key), Some(Outcome::Cancelled), "{why}");
    ep.handle_receive_reaped(at, key, 0).unwrap();
    assert_eq!(terminals(ep, key, Role::Receiver), vec![Outcome::Cancelled]);
}

/// Every `Verdict` `ep` has queued for `to`, draining its transmits.
fn verdicts_to(ep: &mut Endpoint, to: RankId) -> Vec<Outcome> {
    std::iter::from_fn(|| ep.poll_transmit())
        .filter_map(|t| match t.message {
            Message::Verdict { outcome, .. } if t.to == to => Some(outcome),
            _ => None,
        })
        .collect()
}

/// The vote of a receiver whose data came first can reach the coordinator before the
/// coordinator has started the request (the ranks of a request start it apart: separate
/// processes). It was dropped as unknown, and the coordinator, its own data landed, waited for
/// the voter's resend (a retransmit interval, 200 ms at defaults) before it could decide. Now it
/// is kept for the request's start and counts at once.
#[test]
fn a_vote_that_reaches_the_coordinator_before_it_starts_counts_when_it_starts() {
    let t = Instant::now();
    let key = RequestKey::new(14, 0);
    let mut gen = Endpoint::new(G1, config());
    let vote = Message::Vote {
        key,
        outcome: Outcome::Completed,
    };
    gen.handle_message(t, G2, vote.clone()).unwrap();
    // Its resend, before the start too: the same vote, kept once.
    gen.handle_message(t + ms(1), G2, vote).unwrap();
    assert_eq!(gen.stats().unknown_dropped, 0);
    assert_eq!((gen.early_requests(), gen.stats().early_kept), (1, 1));
    start_two_receiver_request(&mut gen, G1, [G1, G2], C, key, t + ms(10));
    assert_eq!(gen.early_requests(), 0, "taken at the start");
    assert_eq!(gen.verdict(key), None, "decided before its own data");
    gen.handle_segment_landed(t + ms(11), key, 0).unwrap();
    assert_eq!(gen.verdict(key), Some(Outcome::Completed));
    assert_eq!(
        terminals(&mut gen, key, Role::Receiver),
        vec![Outcome::Completed]
    );
    assert!(verdicts_to(&mut gen, G2).contains(&Outcome::Completed));
}

/// A receiver that gives up before the coordinator has started: its cancel reached the
/// coordinator first and was dropped, and the voter, at its bound, stops resending. The
/// coordinator then ran to its deadline and ended `TimedOut` against the voter's `Cancelled`.
/// Now the kept vote decides the request as soon as it starts: `Cancelled` on both.
#[test]
fn a_cancel_voted_before_the_coordinator_starts_ends_it_cancelled_when_it_starts() {
    let t = Instant::now();
    let key = RequestKey::new(15, 0);
    let (mut g2, _) = receiving(G2, key, t);
    g2.cancel(t + ms(1), key).unwrap();
    let vote = std::iter::from_fn(|| g2.poll_transmit())
        .find(|x| x.to == G1 && matches!(x.message, Message::Vote { .. }))
        .expect("the cancel's vote to the coordinator");
    let mut g1 = Endpoint::new(G1, config());
    g1.handle_message(t + ms(2), G2, vote.message).unwrap();
    start_two_receiver_request(&mut g1, G1, [G1, G2], C, key, t + ms(20));
    assert!(verdicts_to(&mut g1, C).contains(&Outcome::Cancelled));
    assert!(
        std::iter::from_fn(|| g1.poll_action())
            .any(|a| matches!(a, kvlink_proto::Action::CancelReceive { key: k, .. } if k == key)),
        "its receive is not cancelled"
    );
    ends_cancelled_once_reaped(&mut g1, key, t + ms(21), "the early cancel was lost");
}

/// The coordinator's failure verdict can reach another receiver before that one starts (the
/// coordinator's own caller cancelled first). Kept the same way, it ends that receiver's request
/// as soon as it starts. A `Completed` verdict before the start is never right (it needs this
/// rank's landings) and is not kept; nor is what comes from a rank that is not the request's
/// coordinator, nor what is older than the keep (`EARLY_KEEP`, 10 minutes, on a rank that has
/// started no request with a longer deadline).
#[test]
fn what_reaches_a_receiver_before_it_starts_counts_only_from_the_right_rank_and_in_time() {
    let t = Instant::now();
    let verdict = |key, outcome| Message::Verdict { key, outcome };
    // The coordinator's cancel, before G2 starts.
    let key = RequestKey::new(16, 0);
    let mut g2 = Endpoint::new(G2, config());
    g2.handle_message(t, G1, verdict(key, Outcome::Cancelled))
        .unwrap();
    start_two_receiver_request(&mut g2, G2, [G1, G2], C, key, t + ms(5));
    assert_eq!(g2.verdict(key), Some(Outcome::Cancelled));
    // A `Completed` verdict, a failure verdict from the sender, a vote at a non-coordinator.
    let key = RequestKey::new(17, 0);
    g2.handle_message(t, G1, verdict(key, Outcome::Completed))
        .unwrap();
    g2.handle_message(t, C, verdict(key, Outcome::Cancelled))
        .unwrap();
    g2.handle_message(
        t,
        G1,
        Message::Vote {
            key,
            outcome: Outcome::Cancelled,
        },
    )
    .unwrap();
    start_two_receiver_request(&mut g2, G2, [G1, G2], C, key, t + ms(5));
    assert_eq!(g2.verdict(key), None);
    assert!(g2.running(key, Role::Receiver));
    // A vote older than the keep.
    let key = RequestKey::new(18, 0);
    let mut g1 = Endpoint::new(G1, config());
    g1.handle_message(
        t,
        G2,
        Message::Vote {
            key,
            outcome: Outcome::Cancelled,
        },
    )
    .unwrap();
    let keep = kvlink_proto::EARLY_KEEP;
    start_two_receiver_request(&mut g1, G1, [G1, G2], C, key, t + keep + ms(1));
    assert_eq!(g1.verdict(key), None, "a vote past the keep counted");
}

/// A request may have more receivers than the early store keeps messages for one request (64):
/// the votes of 64 ranks whose data landed first filled it, and the cancel of one more was
/// dropped as `Full`, however it was the one message that decides the request. The late
/// coordinator then waited for a vote that never came again (the voter ends at its bound) and
/// ended `TimedOut` against the voter's `Cancelled`. A failure now takes the place of a kept
/// `Completed` vote, which a failure makes moot (the coordinator decides at the first failure).
#[test]
fn an_early_cancel_is_kept_when_completed_votes_of_many_receivers_came_first() {
    let t = Instant::now();
    let key = RequestKey::new(19, 0);
    let receivers: Vec<RankId> = (1..=66).map(RankId).collect();
    let sender = RankId(500);
    let mut g1 = Endpoint::new(receivers[0], config());
    for (i, &r) in receivers[1..65].iter().enumerate() {
        let vote = Message::Vote {
            key,
            outcome: Outcome::Completed,
        };
        g1.handle_message(t + ms(i as u64), r, vote).unwrap();
    }
    let cancel = Message::Vote {
        key,
        outcome: Outcome::Cancelled,
    };
    g1.handle_message(t + ms(70), receivers[65], cancel)
        .unwrap();
    let lease = kvlink_proto::BufferPool::new(4).lease(key).unwrap();
    let desc = kv_desc(kvlink_proto::TokenAllocator::default().allocate().unwrap());
    let spec = kvlink_proto::ReceiveSpec {
        receivers: receivers.clone(),
        ..one_buffer(key, receivers[0], sender, lease, desc, None)
    };
    g1.start_receive(t + ms(80), spec).unwrap();
    ends_cancelled_once_reaped(
        &mut g1,
        key,
        t + ms(81),
        "the early cancel of the last receiver was lost",
    );
}

/// The early store keeps a request's messages for the default deadline plus the agreement
/// bound after the first came (here, where no request runs longer). A failure that replaced an earlier `Completed` vote (the voter's
/// data landed, then its caller, tired of waiting for a late coordinator, cancelled) went with
/// the `Completed` vote's keep: up to a deadline sooner than the same cancel kept alone. A
/// coordinator that started in between ran to its deadline and ended `TimedOut` against the
/// voter's `Cancelled`. A replacing message now gets its own keep.
#[test]
fn an_early_cancel_that_replaces_a_completed_vote_is_kept_as_long_as_one_that_came_alone() {
    let t = Instant::now();
    let key = RequestKey::new(20, 0);
    let keep = config().timeout + config().agreement_bound;
    // G2: its data lands (a `Completed` vote), then its caller cancels (a `Cancelled` one).
    let (mut g2, _) = receiving(G2, key, t);
    let mut g1 = Endpoint::new(G1, config());
    let votes_to_g1 = |g2: &mut Endpoint, g1: &mut Endpoint, at| {
        while let Some(x) = g2.poll_transmit() {
            if x.to == G1 && matches!(x.message, Message::Vote { .. }) {
                g1.handle_message(at, G2, x.message).unwrap();
            }
        }
    };
    g2.handle_segment_landed(t + ms(10), key, 0).unwrap();
    votes_to_g1(&mut g2, &mut g1, t + ms(10));
    g2.cancel(t + ms(900), key).unwrap();
    votes_to_g1(&mut g2, &mut g1, t + ms(900));
    // G2 ends `Cancelled` at its bound (no verdict came).
    g2.handle_timeout(t + ms(900) + config().agreement_bound);
    assert_eq!(
        terminals(&mut g2, key, Role::Receiver),
        vec![Outcome::Cancelled]
    );
    // G1 starts past the first vote's keep, within the cancel's.
    start_two_receiver_request(&mut g1, G1, [G1, G2], C, key, t + ms(10) + keep + ms(10));
    assert_eq!(
        g1.verdict(key),
        Some(Outcome::Cancelled),
        "the cancel went with the keep of the Completed vote it replaced"
    );
}

/// The vote `G2` sends its coordinator `G1` when it starts request `key` at `t` (with its own
/// `timeout`, if given) and cancels it 1 ms later.
fn cancel_vote_of_g2(key: RequestKey, t: Instant, timeout: Option<std::time::Duration>) -> Message {
    let mut g2 = Endpoint::new(G2, config());
    start_two_receiver_request_for(&mut g2, G2, [G1, G2], C, key, t, timeout);
    g2.cancel(t + ms(1), key).unwrap();
    std::iter::from_fn(|| g2.poll_transmit())
        .find(|x| x.to == G1 && matches!(x.message, Message::Vote { .. }))
        .expect("the cancel's vote to the coordinator")
        .message
}

/// The early store kept a message for the default deadline plus the agreement bound, whatever
/// the deadlines of the requests this rank runs: neither a vote nor a verdict carries one. So a
/// coordinator whose requests run with a longer deadline of their own, starting one later than
/// the default deadline after another receiver's cancel reached it, found the cancel gone, ran
/// to its deadline and ended `TimedOut` against the voter's `Cancelled`. The store now keeps
/// messages as long as the longest deadline of a request started here (plus the bound): the
/// deadlines a rank's application gives its requests are the ones its peers' votes concern.
#[test]
fn an_early_cancel_outlives_the_default_deadline_where_requests_run_longer() {
    let t = Instant::now();
    let long = Some(config().timeout * 10);
    let default_keep = config().timeout + config().agreement_bound;
    // The coordinator's application runs its requests with the long deadline: one has started.
    let mut g1 = Endpoint::new(G1, config());
    start_two_receiver_request_for(&mut g1, G1, [G1, G2], C, RequestKey::new(30, 0), t, long);
    // Another request: G2 starts it and cancels; its vote reaches G1 before G1 starts it.
    let key = RequestKey::new(31, 0);
    g1.handle_message(t + ms(2), G2, cancel_vote_of_g2(key, t, long))
        .unwrap();
    // G1 gets to it past the default keep, well within the request's own deadline.
    let late = t + ms(2) + default_keep + ms(100);
    g1.handle_timeout(late);
    start_two_receiver_request_for(&mut g1, G1, [G1, G2], C, key, late, long);
    assert_eq!(
        g1.verdict(key),
        Some(Outcome::Cancelled),
        "the early cancel went at the default deadline"
    );
    ends_cancelled_once_reaped(&mut g1, key, late + ms(1), "the early cancel was lost");
}

/// The first request that runs longer than any before it on its coordinator (and longer than
/// the default deadline): another receiver cancels it, and the coordinator starts it later than
/// the default deadline after the cancel reached it. The store kept the cancel only for the
/// longest deadline started so far (plus the bound): it was gone, and the coordinator ran to its
/// own deadline and ended `TimedOut` against the voter's `Cancelled`. The store now keeps early
/// messages for at least `EARLY_KEEP` (10 minutes, as long as the engine refuses a replay of an
/// ended key), bounded in number as before.
#[test]
fn an_early_cancel_counts_for_the_first_request_that_runs_longer_than_any_before() {
    let t = Instant::now();
    let long = Some(config().timeout * 100);
    let default_keep = config().timeout + config().agreement_bound;
    // The coordinator has started nothing with the long deadline.
    let mut g1 = Endpoint::new(G1, config());
    let key = RequestKey::new(32, 0);
    g1.handle_message(t + ms(2), G2, cancel_vote_of_g2(key, t, long))
        .unwrap();
    let late = t + ms(2) + default_keep * 20;
    g1.handle_timeout(late);
    start_two_receiver_request_for(&mut g1, G1, [G1, G2], C, key, late, long);
    assert_eq!(
        g1.verdict(key),
        Some(Outcome::Cancelled),
        "the early cancel went at the longest deadline started so far"
    );
    ends_cancelled_once_reaped(&mut g1, key, late + ms(1), "the early cancel was lost");
    // Past the keep, an unused early message goes (counted), its timer asked for.
    g1.handle_message(
        late + ms(2),
        G2,
        Message::Vote {
            key: RequestKey::new(33, 0),
            outcome: Outcome::Cancelled,
        },
    )
    .unwrap();
    let dropped = g1.stats().unknown_dropped;
    g1.handle_timeout(late + ms(2) + kvlink_proto::EARLY_KEEP + ms(1));
    assert_eq!(g1.early_requests(), 0);
    assert_eq!(g1.stats().unknown_dropped, dropped + 1);
}

/// A receiver that voted `Completed` and is then reported lost to the coordinator (the link
/// between the two generation ranks failed; each side's transport reports the other lost) ends
/// `PeerLost` at once: it has lost its coordinator and no verdict had come. The coordinator
/// kept that receiver's earlier `Completed` vote, and once its own data landed decided
/// `Completed` and told its senders so: a sender ended `Completed` while a live receiver of
/// the same request ended `PeerLost`, although the coordinator knew, before it decided, that
/// this receiver could no longer learn the verdict. A receiver lost before the verdict now
/// counts as `PeerLost` whatever it voted.
#[test]
fn a_receiver_lost_before_the_verdict_is_not_counted_completed() {
    let t = Instant::now();
    let key = RequestKey::new(21, 0);
    let (mut g1, _) = receiving(G1, key, t);
    let (mut g2, _) = receiving(G2, key, t);
    // G2's data lands: its `Completed` vote reaches the coordinator.
    g2.handle_segment_landed(t + ms(5), key, 0).unwrap();
    let vote = std::iter::from_fn(|| g2.poll_transmit())
        .find(|x| x.to == G1 && matches!(x.message, Message::Vote { .. }))
        .expect("G2's vote");
    g1.handle_message(t + ms(6), G2, vote.message).unwrap();
    // The link between the two receivers fails; each is told the other is lost.
    g2.handle_peer_lost(t + ms(10), G1);
    assert_eq!(
        terminals(&mut g2, key, Role::Receiver),
        vec![Outcome::PeerLost],
        "a receiver whose coordinator is lost ends PeerLost at once"
    );
    g1.handle_peer_lost(t + ms(10), G2);
    // The coordinator's own data lands afterwards.
    g1.handle_segment_landed(t + ms(20), key, 0).unwrap();
    let ends = terminals(&mut g1, key, Role::Receiver);
    assert!(
        !ends.contains(&Outcome::Completed) && g1.verdict(key) != Some(Outcome::Completed),
        "the coordinator decided Completed though G2, lost before the verdict, ended PeerLost"
    );
    assert!(
        !verdicts_to(&mut g1, C).contains(&Outcome::Completed),
        "the sender is told Completed while a live receiver ended PeerLost"
    );
    assert_eq!(ends, vec![Outcome::PeerLost]);
}

/// A receiver that loses its coordinator ends `PeerLost` at once, and its vote stops (it goes
/// only while the coordinator can hear it). When the two are connected again before the
/// coordinator has started the request, the coordinator started it, found that receiver
/// connected, waited for its vote until the deadline and ended `TimedOut`, as did its senders,
/// against that receiver's `PeerLost`. The receiver now tells its coordinator once the
/// coordinator's rank is bound again, and the coordinator decides `PeerLost` at its start.
#[test]
fn a_receiver_that_lost_its_coordinator_tells_it_once_they_are_connected_again() {
    let t = Instant::now();
    let key = RequestKey::new(23, 0);
    let (mut g2, _) = receiving(G2, key, t);
    while g2.poll_transmit().is_some() {}
    g2.handle_peer_lost(t + ms(10), G1);
    // Reported twice (the loss, then a rebind that replaced the endpoint) before the receive is
    // reaped: still owed.
    g2.handle_peer_lost(t + ms(10), G1);
    g2.handle_receive_reaped(t + ms(11), key, 0).unwrap();
    assert_eq!(
        terminals(&mut g2, key, Role::Receiver),
        vec![Outcome::PeerLost]
    );
    while g2.poll_transmit().is_some() {}
    // A bind of another rank tells nobody anything.
    g2.handle_peer_bound(t + ms(30), C);
    assert!(
        g2.poll_transmit().is_none(),
        "told a rank that is not its coordinator"
    );
    // The coordinator's rank is bound again: the vote goes, once.
    g2.handle_peer_bound(t + ms(30), G1);
    let told: Vec<_> = std::iter::from_fn(|| g2.poll_transmit()).collect();
    assert_eq!(
        told.iter()
            .map(|x| (x.to, x.message.clone()))
            .collect::<Vec<_>>(),
        vec![(
            G1,
            Message::Vote {
                key,
                outcome: Outcome::PeerLost
            }
        )],
        "the coordinator was not told why this rank ended"
    );
    // Bound again (the new connection may have broken before the vote got there): told again,
    // and the repeat is harmless at the coordinator.
    g2.handle_peer_bound(t + ms(30), G1);
    let again: Vec<_> = std::iter::from_fn(|| g2.poll_transmit()).collect();
    assert_eq!(again, told, "not told again at the next bind");
    // The coordinator has it before it starts the request, and decides at the start.
    let mut g1 = Endpoint::new(G1, config());
    g1.handle_message(t + ms(20), G2, told[0].message.clone())
        .unwrap();
    g1.handle_message(t + ms(21), G2, again[0].message.clone())
        .unwrap();
    start_two_receiver_request(&mut g1, G1, [G1, G2], C, key, t + ms(30));
    assert_eq!(
        g1.verdict(key),
        Some(Outcome::PeerLost),
        "the coordinator waits for a vote that will not come"
    );
    assert_eq!(verdicts_to(&mut g1, C), vec![Outcome::PeerLost]);
    // Another process now holds the coordinator's rank: nothing is owed to it.
    g2.forget_sends_to(G1);
    g2.handle_peer_bound(t + ms(30), G1);
    assert!(
        g2.poll_transmit().is_none(),
        "the old request's vote went to the coordinator's new process"
    );
}

/// A reconnect can take longer than the linger of the receive that owes its coordinator a vote
/// (the engine's redial round backs off over several tries). Forgotten, the receive told
/// nothing at the bind. The vote is now kept as long as the receive's tombstone would last, and
/// sent at a bind then; not after that, and not to a new process of the coordinator's rank.
#[test]
fn a_vote_owed_to_the_coordinator_outlives_the_receives_linger() {
    let t = Instant::now();
    let key = RequestKey::new(27, 0);
    let (mut g2, _) = receiving(G2, key, t);
    g2.handle_peer_lost(t + ms(10), G1);
    g2.handle_receive_reaped(t + ms(11), key, 0).unwrap();
    assert_eq!(
        terminals(&mut g2, key, Role::Receiver),
        vec![Outcome::PeerLost]
    );
    // Past its linger (500 ms here) the receive is forgotten.
    let forgotten = t + ms(11) + config().linger + ms(10);
    g2.handle_timeout(forgotten);
    assert!(!g2.running(key, Role::Receiver));
    assert_eq!(
        g2.known(),
        0,
        "the receive is still known: the test proves nothing"
    );
    while g2.poll_transmit().is_some() {}
    let vote = Message::Vote {
        key,
        outcome: Outcome::PeerLost,
    };
    g2.handle_peer_bound(forgotten + ms(1), G1);
    let told: Vec<_> = std::iter::from_fn(|| g2.poll_transmit())
        .map(|x| (x.to, x.message))
        .collect();
    assert_eq!(
        told,
        vec![(G1, vote.clone())],
        "the forgotten receive told nothing"
    );
    // Its tombstone's time: the request's deadline, the bound and the linger past its start.
    let gone = t + config().timeout + config().agreement_bound + config().linger + ms(1);
    g2.handle_peer_bound(gone, G1);
    assert!(
        g2.poll_transmit().is_none(),
        "told past its tombstone's time"
    );
    // Owed, then the coordinator's rank taken by another process: nothing more.
    let key = RequestKey::new(28, 0);
    let (mut g2, _) = receiving(G2, key, t);
    g2.handle_peer_lost(t + ms(10), G1);
    g2.handle_receive_reaped(t + ms(11), key, 0).unwrap();
    g2.handle_timeout(forgotten);
    while g2.poll_transmit().is_some() {}
    g2.forget_sends_to(G1);
    g2.handle_peer_bound(forgotten + ms(1), G1);
    assert!(
        g2.poll_transmit().is_none(),
        "told the coordinator's new process"
    );
}

/// What a replaced process sent for requests not started here goes with it: its keys start
/// again in the new process, whose request of the same key the old vote would otherwise end
/// (early messages are kept for 10 minutes).
#[test]
fn early_messages_of_a_replaced_process_go_with_it() {
    let t = Instant::now();
    let mut g1 = Endpoint::new(G1, config());
    let key = RequestKey::new(25, 0);
    for (from, id) in [(G2, 25), (C, 26)] {
        let m = Message::Vote {
            key: RequestKey::new(id, 0),
            outcome: Outcome::Cancelled,
        };
        g1.handle_message(t, from, m).unwrap();
    }
    assert_eq!(g1.early_requests(), 2);
    let dropped = g1.stats().unknown_dropped;
    g1.forget_sends_to(G2);
    assert_eq!(g1.early_requests(), 1, "only the replaced rank's go");
    assert_eq!(g1.stats().unknown_dropped, dropped + 1);
    // The new process's request of that key runs on its own.
    start_two_receiver_request(&mut g1, G1, [G1, G2], C, key, t + ms(5));
    assert_eq!(g1.verdict(key), None);
    assert!(g1.running(key, Role::Receiver));
}

/// Only a receive that ended for its coordinator's loss owes it a vote: one whose verdict had
/// come from the coordinator before the loss, and the coordinator itself, tell nobody.
#[test]
fn a_rebind_tells_nothing_for_a_receive_whose_coordinator_had_decided() {
    let t = Instant::now();
    let key = RequestKey::new(24, 0);
    let (mut g2, _) = receiving(G2, key, t);
    let (mut g1, _) = receiving(G1, key, t);
    g1.cancel(t + ms(1), key).unwrap();
    let verdict = std::iter::from_fn(|| g1.poll_transmit())
        .find(|x| x.to == G2 && matches!(x.message, Message::Verdict { .. }))
        .expect("the coordinator's verdict to G2");
    g2.handle_message(t + ms(2), G1, verdict.message).unwrap();
    g2.handle_receive_reaped(t + ms(3), key, 0).unwrap();
    assert_eq!(
        terminals(&mut g2, key, Role::Receiver),
        vec![Outcome::Cancelled]
    );
    g2.handle_peer_lost(t + ms(10), G1);
    g1.handle_peer_lost(t + ms(10), G2);
    while g2.poll_transmit().is_some() {}
    while g1.poll_transmit().is_some() {}
    g2.handle_peer_bound(t + ms(30), G1);
    g1.handle_peer_bound(t + ms(30), G2);
    assert!(g2.poll_transmit().is_none());
    assert!(g1.poll_transmit().is_none());
}
