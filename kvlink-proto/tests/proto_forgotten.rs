//! A completed request is forgotten at its end (no linger): what its lingering machine used to
//! answer, its tombstone answers the same way. Misuse stays misuse, repeats stay repeats, and an
//! older generation stays stale for as long as the tombstone of a newer one is kept.
mod proto_sim;

use kvlink_proto::error::ErrorKind;
use kvlink_proto::error::Outcome;
use kvlink_proto::{
    BufferPool, Endpoint, Event, Message, RankId, ReceiveFlow, ReceiveSpec, RequestKey, Role,
    Token, TokenAllocator,
};
use proto_sim::*;
use std::time::Instant;

fn drain(ep: &mut Endpoint) {
    while ep.poll_transmit().is_some() {}
    while ep.poll_event().is_some() {}
    while ep.poll_action().is_some() {}
}

/// A 1x1 request of `key` run to `Completed` on both sides by `t + 4 ms`, not yet forgotten;
/// returns (generation side, context side, generation rank).
fn completed_one_to_one(t: Instant, key: RequestKey) -> (Endpoint, Endpoint, RankId) {
    let (g, c) = (RankId(1), RankId(2));
    let mut gen = Endpoint::new(g, config());
    let mut ctx = Endpoint::new(c, config());
    complete_one_to_one(&mut gen, &mut ctx, t, key);
    (gen, ctx, g)
}

/// Runs a 1x1 request of `key` from `ctx` to `gen` to `Completed` on both by `t + 4 ms`.
fn complete_one_to_one(gen: &mut Endpoint, ctx: &mut Endpoint, t: Instant, key: RequestKey) {
    let (g, c) = (gen.rank(), ctx.rank());
    let lease = BufferPool::new(4).lease(key).unwrap();
    let desc = kv_desc(TokenAllocator::default().allocate().unwrap());
    gen.start_receive(t, one_buffer(key, g, c, lease, desc, Some(ms(700))))
        .unwrap();
    let pump = |from: &mut Endpoint, to: &mut Endpoint, at| {
        while let Some(tx) = from.poll_transmit() {
            to.handle_message(at, from.rank(), tx.message).unwrap();
        }
    };
    pump(gen, ctx, t + ms(1));
    ctx.accept(t + ms(2), key, g, true).unwrap();
    assert_eq!(ctx.check_send(key, g, 0, 64).unwrap(), Ok(desc));
    ctx.begin_send(key, g, 0);
    ctx.handle_send_done(t + ms(3), key, g, 0, true).unwrap();
    gen.handle_segment_landed(t + ms(3), key, 0).unwrap();
    pump(gen, ctx, t + ms(4));
    pump(ctx, gen, t + ms(4));
    assert!(!gen.running(key, Role::Receiver));
    assert!(!ctx.running(key, Role::Sender { receiver: g }));
    drain(gen);
    drain(ctx);
}

/// A segment sent again, or one never advertised, is misuse (`InvalidArgument`, what
/// `Engine::send_segments` documents), before and after the completed flow is forgotten: a
/// completed flow sent every segment it was offered. Its tombstone once answered with the end
/// (`Ok(Completed)`: nothing sent, success reported).
#[test]
fn a_second_send_after_a_completed_end_is_still_misuse() {
    let t = Instant::now();
    let key = RequestKey::new(9, 0);
    let (_gen, mut ctx, g) = completed_one_to_one(t, key);
    let e = ctx.check_send(key, g, 0, 64).unwrap_err();
    assert_eq!(e.kind, ErrorKind::InvalidArgument, "{e}");
    ctx.handle_timeout(t + ms(5));
    assert_eq!((ctx.known(), ctx.tombstones()), (0, 1));
    for segment in [0, 9] {
        let r = ctx.check_send(key, g, segment, 64);
        assert!(
            matches!(&r, Err(e) if e.kind == ErrorKind::InvalidArgument),
            "segment {segment} after the completed flow was forgotten: {r:?}"
        );
    }
}

/// A receiver that is not the coordinator takes the coordinator's verdict again (its vote's
/// resend crossed the verdict). While it lingers that is a duplicate, and once it is forgotten
/// with its tombstone kept, still a duplicate: not a message for an unknown request.
#[test]
fn a_repeated_verdict_at_a_forgotten_receiver_is_a_duplicate() {
    let t = Instant::now();
    let (g1, g2, c) = (RankId(1), RankId(2), RankId(3));
    let mut gen = Endpoint::new(g2, config());
    let key = RequestKey::new(11, 0);
    let lease = BufferPool::new(4).lease(key).unwrap();
    let desc = kv_desc(TokenAllocator::default().allocate().unwrap());
    gen.start_receive(
        t,
        ReceiveSpec {
            key,
            receivers: vec![g1, g2],
            flows: vec![ReceiveFlow {
                sender: c,
                buffers: vec![(lease, desc)],
            }],
            request_info: vec![],
            timeout: Some(ms(700)),
        },
    )
    .unwrap();
    gen.handle_segment_landed(t + ms(1), key, 0).unwrap();
    let verdict = Message::Verdict {
        key,
        outcome: Outcome::Completed,
    };
    gen.handle_message(t + ms(2), g1, verdict.clone()).unwrap();
    assert!(!gen.running(key, Role::Receiver));
    drain(&mut gen);
    let before = *gen.stats();
    gen.handle_message(t + ms(2), g1, verdict.clone()).unwrap();
    assert_eq!(gen.stats().duplicates, before.duplicates + 1, "lingering");
    gen.handle_timeout(t + ms(3));
    assert_eq!((gen.known(), gen.tombstones()), (0, 1));
    let before = *gen.stats();
    gen.handle_message(t + ms(60), g1, verdict).unwrap();
    gen.handle_message(t + ms(60), c, Message::Quiesced { key })
        .unwrap();
    assert_eq!(
        (gen.stats().duplicates, gen.stats().unknown_dropped),
        (before.duplicates + 2, before.unknown_dropped),
        "a repeated verdict and a Quiesced for a receive whose tombstone is kept"
    );
    assert!(gen.poll_transmit().is_none());
}

/// A late advertisement of generation 0 reaches a sender that only saw generation 1, which has
/// just completed and been forgotten: it is stale and starts nothing, for as long as generation
/// 1's tombstone is kept. After that it is merely unknown to this rank.
#[test]
fn a_stale_advertisement_right_after_a_completed_retry_starts_nothing() {
    let t = Instant::now();
    let new = RequestKey::new(5, 1);
    let (_gen, mut ctx, g) = completed_one_to_one(t, new);
    ctx.handle_timeout(t + ms(5));
    assert_eq!((ctx.known(), ctx.tombstones()), (0, 1));
    let old = RequestKey::new(5, 0);
    let advertise = |token| Message::Advertise {
        key: old,
        src_rank: g,
        timeout_ms: 1000,
        request_info: vec![],
        buffers: vec![kv_desc(Token(token))],
    };
    ctx.handle_message(t + ms(6), g, advertise(77)).unwrap();
    assert!(
        ctx.poll_event().is_none(),
        "a stale advertisement started a flow"
    );
    assert_eq!(ctx.stats().stale_dropped, 1);
    // The tombstone goes at the deadline, the agreement bound and the linger; with it the
    // knowledge of generation 1.
    ctx.handle_timeout(t + ms(1 + 700 + 500 + 500));
    assert_eq!(ctx.tombstones(), 0);
    ctx.handle_message(t + ms(1800), g, advertise(78)).unwrap();
    assert!(matches!(
        ctx.poll_event(),
        Some(Event::Advertised { key, .. }) if key == old
    ));
}

/// Tombstones are bounded ([`kvlink_proto::Config::tomb_cap`]): past the cap the one buried
/// first goes early and is counted. With long deadlines they would otherwise grow with the
/// request rate times the deadline. The two oldest here have long deadlines and the two newest
/// short ones, so the newest expire first: by expiry the cap would drop what just ended and
/// keep the old. The kept ones still answer as tombstones (a repeated verdict is a duplicate);
/// an evicted one's late message is dropped as unknown.
#[test]
fn tombstones_past_the_cap_go_oldest_first() {
    let t = Instant::now();
    let (g1, g2, c) = (RankId(1), RankId(2), RankId(3));
    let mut gen = Endpoint::new(
        g2,
        kvlink_proto::Config {
            tomb_cap: 2,
            ..config()
        },
    );
    let mut pool = BufferPool::new(8);
    let mut tokens = TokenAllocator::default();
    let verdict = |key| Message::Verdict {
        key,
        outcome: Outcome::Completed,
    };
    let keys: Vec<RequestKey> = (0..4).map(|i| RequestKey::new(20 + i, 0)).collect();
    for (i, &key) in keys.iter().enumerate() {
        let at = t + ms(10 * i as u64);
        gen.start_receive(
            at,
            ReceiveSpec {
                key,
                receivers: vec![g1, g2],
                flows: vec![ReceiveFlow {
                    sender: c,
                    buffers: vec![(
                        pool.lease(key).unwrap(),
                        kv_desc(tokens.allocate().unwrap()),
                    )],
                }],
                request_info: vec![],
                timeout: Some(if i < 2 { ms(5000) } else { ms(700) }),
            },
        )
        .unwrap();
        gen.handle_segment_landed(at + ms(1), key, 0).unwrap();
        gen.handle_message(at + ms(2), g1, verdict(key)).unwrap();
        gen.handle_timeout(at + ms(3));
        drain(&mut gen);
    }
    assert_eq!((gen.known(), gen.tombstones()), (0, 2));
    assert_eq!(gen.stats().tombs_evicted, 2);
    let before = *gen.stats();
    for k in &keys[2..] {
        gen.handle_message(t + ms(60), g1, verdict(*k)).unwrap();
    }
    assert_eq!(
        gen.stats().duplicates,
        before.duplicates + 2,
        "the newest are kept"
    );
    for k in &keys[..2] {
        gen.handle_message(t + ms(60), g1, verdict(*k)).unwrap();
    }
    assert_eq!(
        gen.stats().unknown_dropped,
        before.unknown_dropped + 2,
        "the oldest went first"
    );
}

/// "Forever" in the core's configuration or a request's own timeout (`Duration::MAX`) is taken
/// as a year ([`kvlink_proto::request::LONGEST`]): no deadline overflows an `Instant`, on
/// either side, and the request still runs and completes.
#[test]
fn forever_as_a_timeout_is_a_year_and_the_request_completes() {
    use std::time::Duration;
    let t = Instant::now();
    let forever = kvlink_proto::Config {
        timeout: Duration::MAX,
        agreement_bound: Duration::MAX,
        linger: Duration::MAX,
        ..config()
    };
    let (g, c) = (RankId(1), RankId(2));
    let key = RequestKey::new(30, 0);
    let mut gen = Endpoint::new(g, forever);
    let mut ctx = Endpoint::new(c, forever);
    let lease = BufferPool::new(4).lease(key).unwrap();
    let desc = kv_desc(TokenAllocator::default().allocate().unwrap());
    gen.start_receive(t, one_buffer(key, g, c, lease, desc, Some(Duration::MAX)))
        .unwrap();
    let next = gen.poll_timeout().expect("a timer");
    assert!(next > t && next - t <= kvlink_proto::request::LONGEST);
    while let Some(tx) = gen.poll_transmit() {
        ctx.handle_message(t + ms(1), g, tx.message).unwrap();
    }
    ctx.accept(t + ms(2), key, g, true).unwrap();
    assert_eq!(ctx.check_send(key, g, 0, 64).unwrap(), Ok(desc));
    ctx.begin_send(key, g, 0);
    ctx.handle_send_done(t + ms(3), key, g, 0, true).unwrap();
    gen.handle_segment_landed(t + ms(3), key, 0).unwrap();
    let ended = std::iter::from_fn(|| gen.poll_event()).any(|e| {
        matches!(
            e,
            Event::Terminal {
                role: Role::Receiver,
                outcome: Outcome::Completed,
                ..
            }
        )
    });
    assert!(ended, "the receiver completed");
    gen.handle_timeout(t + ms(4));
}

/// A key that ended here and is still remembered by its tombstone cannot be started again:
/// `start_receive` took it, and the new request ran beside the tombstone that still answered
/// the old one's votes and verdicts (the engine refuses such keys itself; the core did not).
/// Now `InvalidArgument`, nothing taken; a retry takes the next generation.
#[test]
fn a_key_remembered_by_its_tombstone_cannot_be_started_again() {
    let t = Instant::now();
    let key = RequestKey::new(12, 0);
    let (mut gen, _ctx, g) = completed_one_to_one(t, key);
    gen.handle_timeout(t + ms(5));
    assert_eq!(gen.known(), 0);
    assert!(
        gen.tombstones() > 0,
        "the completed request left no tombstone"
    );
    let lease = BufferPool::new(4).lease(key).unwrap();
    let desc = kv_desc(TokenAllocator::default().allocate().unwrap());
    let e = gen
        .start_receive(t + ms(5), one_buffer(key, g, RankId(2), lease, desc, None))
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::InvalidArgument, "{e}");
    assert!(!gen.running(key, Role::Receiver));
    assert!(gen.poll_transmit().is_none(), "something was advertised");
    let retry = RequestKey::new(12, 1);
    let lease = BufferPool::new(4).lease(retry).unwrap();
    gen.start_receive(
        t + ms(6),
        one_buffer(retry, g, RankId(2), lease, desc, None),
    )
    .unwrap();
    assert!(gen.running(retry, Role::Receiver));
}

/// A driver sleeps until `poll_timeout` and calls `handle_timeout` only when it passes (the
/// engine does exactly that). Tombstones expire in `handle_timeout`, but `poll_timeout` did not
/// say when: once the last request was forgotten and its superseded timer entries popped,
/// `poll_timeout` was `None` and an idle endpoint kept every tombstone (and the retry index
/// entries behind them) for ever, not for their request's deadline plus the agreement bound.
#[test]
fn tombstones_expire_on_the_timers_poll_timeout_asks_for() {
    let t = Instant::now();
    for generation in [0, 1] {
        let key = RequestKey::new(40, generation);
        let (mut gen, mut ctx, _g) = completed_one_to_one(t, key);
        for ep in [&mut gen, &mut ctx] {
            let mut passes = 0;
            while let Some(at) = ep.poll_timeout() {
                ep.handle_timeout(at.max(t + ms(5)));
                passes += 1;
                assert!(passes < 1000, "poll_timeout never settles");
            }
            assert_eq!(ep.known(), 0);
            assert_eq!(
                ep.tombstones(),
                0,
                "{key} on {}: no timer left, yet a tombstone outlived its expiry",
                ep.rank()
            );
            assert_eq!(ep.tomb_entries(), 0);
        }
    }
}

/// Each burial puts a tombstone's entry in the cap's order queue, and that queue was trimmed
/// only at the next burial: once the tombstones of a burst of requests had expired, an idle
/// endpoint kept one entry per request in it (about 3000 with no tombstone left, found by
/// `tests/lifecycle_tables.rs`). Expiry trims it now, as burial does.
#[test]
fn expired_tombstones_leave_no_entries_in_the_caps_queue() {
    let t = Instant::now();
    let mut gen = Endpoint::new(RankId(1), config());
    let mut ctx = Endpoint::new(RankId(2), config());
    for i in 0..500 {
        complete_one_to_one(&mut gen, &mut ctx, t, RequestKey::new(1000 + i, 0));
    }
    let order = |ep: &Endpoint| {
        ep.table_sizes()
            .into_iter()
            .find(|(name, _)| *name == "ep.tomb_order")
            .map(|(_, n)| n)
            .unwrap()
    };
    // Forgotten at their end, in the next pass: buried.
    gen.handle_timeout(t + ms(5));
    ctx.handle_timeout(t + ms(5));
    for ep in [&gen, &ctx] {
        assert_eq!(ep.tombstones(), 500);
        assert!(order(ep) >= 500, "buried: {:?}", ep.table_sizes());
    }
    for ep in [&mut gen, &mut ctx] {
        let mut passes = 0;
        while let Some(at) = ep.poll_timeout() {
            ep.handle_timeout(at.max(t + ms(5)));
            passes += 1;
            assert!(passes < 10_000, "poll_timeout never settles");
        }
        assert_eq!(ep.tombstones(), 0);
        assert_eq!(order(ep), 0, "entries of expired tombstones left queued");
    }
}

/// A vote kept for a request that has not started here (`early`) expired only when another
/// message was kept or a request started: `poll_timeout` did not name its expiry, so an idle
/// endpoint, whose driver calls `handle_timeout` only when `poll_timeout` passes, kept it (up to
/// 4096 requests' worth) for ever rather than for its keep. Its expiry is a timer now, as a
/// tombstone's is.
#[test]
fn early_messages_expire_on_the_timers_poll_timeout_asks_for() {
    let t = Instant::now();
    let (g1, g2) = (RankId(1), RankId(2));
    let mut gen = Endpoint::new(g1, config());
    for (id, outcome) in [(50, Outcome::Completed), (51, Outcome::Cancelled)] {
        let vote = Message::Vote {
            key: RequestKey::new(id, 0),
            outcome,
        };
        gen.handle_message(t, g2, vote).unwrap();
    }
    // One of them taken by its request's start, the other never started here.
    let key = RequestKey::new(50, 0);
    start_two_receiver_request(&mut gen, g1, [g1, g2], RankId(3), key, t + ms(1));
    gen.cancel(t + ms(2), key).unwrap();
    assert_eq!(gen.early_requests(), 1);
    let mut passes = 0;
    while let Some(at) = gen.poll_timeout() {
        gen.handle_timeout(at.max(t + ms(3)));
        drain(&mut gen);
        passes += 1;
        assert!(passes < 1000, "poll_timeout never settles");
    }
    assert_eq!(gen.known(), 0);
    assert_eq!(
        gen.early_requests(),
        0,
        "no timer left, yet an early vote outlived its keep"
    );
}

/// A receive's tombstone answered a vote or ready answer from any bound rank with the verdict,
/// while the running request had dropped one from a rank outside it (`unknown_dropped`): a
/// rank that guessed a key learned how another pair's request ended, and made this side send
/// a message for it. Now the tombstone answers the ranks the request answered (its sender
/// here) and drops the rest, counted, with nothing sent.
#[test]
fn a_receives_tombstone_answers_only_the_ranks_of_its_request() {
    let t = Instant::now();
    let key = RequestKey::new(50, 0);
    let (mut gen, _ctx, _g) = completed_one_to_one(t, key);
    gen.handle_timeout(t + ms(5));
    assert!(gen.tombstones() >= 1, "forgotten at its end, buried");
    let stranger = RankId(9);
    let dropped = gen.stats().unknown_dropped;
    for msg in [
        Message::Vote {
            key,
            outcome: Outcome::TimedOut,
        },
        Message::Ready { key, ready: true },
    ] {
        gen.handle_message(t + ms(6), stranger, msg).unwrap();
    }
    let sent: Vec<_> = std::iter::from_fn(|| gen.poll_transmit()).collect();
    assert!(
        sent.is_empty(),
        "answered a rank outside the request: {sent:?}"
    );
    assert_eq!(gen.stats().unknown_dropped, dropped + 2);
    // The request's own sender still hears the verdict.
    let vote = Message::Vote {
        key,
        outcome: Outcome::TimedOut,
    };
    gen.handle_message(t + ms(7), RankId(2), vote).unwrap();
    let sent: Vec<_> = std::iter::from_fn(|| gen.poll_transmit()).collect();
    assert_eq!(sent.len(), 1, "{sent:?}");
    assert_eq!(sent[0].to, RankId(2));
    assert!(matches!(
        sent[0].message,
        Message::Verdict {
            outcome: Outcome::Completed,
            ..
        }
    ));
}

/// The same at the coordinator of two receiving ranks: once the request has completed and been
/// forgotten, its tombstone answers its sender and the other receiver (both answered while it
/// ran), and nobody else.
#[test]
fn a_coordinators_tombstone_answers_its_sender_and_the_other_receiver_only() {
    let t = Instant::now();
    let (g1, g2, c, stranger) = (RankId(1), RankId(2), RankId(5), RankId(9));
    let key = RequestKey::new(51, 0);
    let mut ep = Endpoint::new(g1, config());
    start_two_receiver_request(&mut ep, g1, [g1, g2], c, key, t);
    ep.handle_segment_landed(t + ms(1), key, 0).unwrap();
    let vote = Message::Vote {
        key,
        outcome: Outcome::Completed,
    };
    ep.handle_message(t + ms(2), g2, vote).unwrap();
    assert_eq!(
        terminals(&mut ep, key, Role::Receiver),
        [Outcome::Completed]
    );
    let now = t + ms(5);
    ep.handle_timeout(now);
    assert_eq!(ep.tombstones(), 1, "forgotten at its end, buried");
    drain(&mut ep);
    let ask = |ep: &mut Endpoint, from: RankId| {
        let vote = Message::Vote {
            key,
            outcome: Outcome::TimedOut,
        };
        ep.handle_message(now, from, vote).unwrap();
        std::iter::from_fn(|| ep.poll_transmit()).collect::<Vec<_>>()
    };
    let dropped = ep.stats().unknown_dropped;
    assert!(ask(&mut ep, stranger).is_empty(), "answered a stranger");
    assert_eq!(ep.stats().unknown_dropped, dropped + 1);
    for rank in [c, g2] {
        let sent = ask(&mut ep, rank);
        assert_eq!(sent.len(), 1, "{rank}: {sent:?}");
        assert_eq!(sent[0].to, rank);
        assert!(
            matches!(
                sent[0].message,
                Message::Verdict {
                    outcome: Outcome::Completed,
                    ..
                }
            ),
            "{rank}: {sent:?}"
        );
    }
    assert_eq!(
        ep.tombstones(),
        1,
        "still kept: the answers came before its expiry"
    );
}

/// Another process under the receiver's rank (its old one gone) advertises a key the old one
/// used: its attempt numbers start again. While the context side keeps the old request's
/// tombstone the advertisement is taken for a duplicate of the old one and starts nothing; once
/// it forgets what it served to that rank (`forget_sends_to`, which the engine calls when
/// another instance binds the rank), the same advertisement starts the request. An advertisement
/// from another rank is not affected.
#[test]
fn a_new_process_under_the_rank_is_served_a_key_its_predecessor_used() {
    let t = Instant::now();
    let key = RequestKey::new(14, 0);
    let (_gen, mut ctx, g) = completed_one_to_one(t, key);
    ctx.handle_timeout(t + ms(5));
    assert_eq!((ctx.known(), ctx.tombstones()), (0, 1));
    let advertise = |gen: &mut Endpoint| {
        let lease = BufferPool::new(4).lease(key).unwrap();
        let desc = kv_desc(TokenAllocator::default().allocate().unwrap());
        gen.start_receive(t + ms(6), one_buffer(key, g, RankId(2), lease, desc, None))
            .unwrap();
        gen.poll_transmit().expect("an advertisement").message
    };
    // The new process: a fresh endpoint under the same rank.
    let mut reborn = Endpoint::new(g, config());
    let adv = advertise(&mut reborn);
    ctx.handle_message(t + ms(7), g, adv.clone()).unwrap();
    assert!(
        !ctx.running(key, Role::Sender { receiver: g }),
        "taken for the old request's duplicate while its tombstone is kept"
    );
    drain(&mut ctx);
    ctx.forget_sends_to(g);
    assert_eq!(ctx.tombstones(), 0);
    ctx.handle_message(t + ms(8), g, adv).unwrap();
    assert!(ctx.running(key, Role::Sender { receiver: g }));
    assert!(
        std::iter::from_fn(|| ctx.poll_event()).any(|e| matches!(e, Event::Advertised { .. })),
        "no advertisement for the application"
    );
}

/// The context side `ctx` (rank 2) of request `key` from rank 1's old process, accepted, its
/// one segment's send in flight, then that process lost: the send asked to stop and not yet
/// reported done. Returns `ctx` and a maker of advertisements of `key` from a new process of
/// rank 1 (at the time given).
fn sending_to_a_lost_process(
    t: Instant,
    key: RequestKey,
    cfg: kvlink_proto::Config,
) -> (Endpoint, impl Fn(Instant) -> kvlink_proto::Message) {
    let (g, c) = (RankId(1), RankId(2));
    let advertise = move |at| {
        let mut gen = Endpoint::new(g, config());
        let lease = BufferPool::new(4).lease(key).unwrap();
        let desc = kv_desc(TokenAllocator::default().allocate().unwrap());
        gen.start_receive(at, one_buffer(key, g, c, lease, desc, None))
            .unwrap();
        gen.poll_transmit().expect("an advertisement").message
    };
    let mut ctx = Endpoint::new(c, cfg);
    ctx.handle_message(t + ms(1), g, advertise(t)).unwrap();
    ctx.accept(t + ms(2), key, g, true).unwrap();
    ctx.check_send(key, g, 0, 64).unwrap().unwrap();
    ctx.begin_send(key, g, 0);
    drain(&mut ctx);
    ctx.handle_peer_lost(t + ms(3), g);
    assert!(
        std::iter::from_fn(|| ctx.poll_action())
            .any(|a| matches!(a, kvlink_proto::Action::AbortSend { .. })),
        "the send is asked to stop"
    );
    drain(&mut ctx);
    (ctx, advertise)
}

/// After [`sending_to_a_lost_process`] and the new process's bind (`forget_sends_to`), its
/// advertisement `adv` of the same key, handled at `at`, starts nothing while the old send is
/// not reported done: no answer (`Ready` would be the old flow's), nothing handed out.
fn not_answered_while_the_old_send_runs(
    ctx: &mut Endpoint,
    at: Instant,
    adv: kvlink_proto::Message,
) {
    ctx.handle_message(at, RankId(1), adv).unwrap();
    let answers: Vec<_> = std::iter::from_fn(|| ctx.poll_transmit()).collect();
    assert!(
        answers.is_empty(),
        "the old flow answered the new process: {answers:?}"
    );
    assert!(
        !std::iter::from_fn(|| ctx.poll_event()).any(|e| matches!(e, Event::Advertised { .. })),
        "handed out while the old flow runs"
    );
}

/// Once the old send is reported done (at `at`) the old flow is gone without a tombstone, and
/// the new process's advertisement, kept meanwhile, starts its request at once (not at its
/// receiver's next resend), whose send is allowed; `adv` again is its duplicate. Returns the
/// ends the old flow reported at the send's report.
fn the_new_request_starts_once_the_old_send_is_done(
    ctx: &mut Endpoint,
    at: Instant,
    key: RequestKey,
    adv: kvlink_proto::Message,
) -> Vec<Outcome> {
    let g = RankId(1);
    ctx.handle_send_done(at, key, g, 0, false).unwrap();
    let ends: Vec<_> = std::iter::from_fn(|| ctx.poll_event())
        .filter_map(|e| match e {
            Event::Terminal { outcome, .. } => Some(outcome),
            _ => None,
        })
        .collect();
    ctx.handle_timeout(at);
    assert_eq!((ctx.known(), ctx.tombstones()), (1, 0));
    assert!(ctx.running(key, Role::Sender { receiver: g }));
    assert!(
        std::iter::from_fn(|| ctx.poll_event()).any(|e| matches!(e, Event::Advertised { .. })),
        "no advertisement for the application"
    );
    drain(ctx);
    ctx.handle_message(at + ms(1), g, adv).unwrap();
    assert!(
        !std::iter::from_fn(|| ctx.poll_event()).any(|e| matches!(e, Event::Advertised { .. })),
        "the resend taken for another request"
    );
    ctx.accept(at + ms(2), key, g, true).unwrap();
    assert!(
        ctx.check_send(key, g, 0, 64).unwrap().is_ok(),
        "the new request's send"
    );
    ends
}

/// A send to the receiver's old process still in flight when a new process binds the rank (the
/// old one's loss asked it to stop; the application's send has not returned yet), and the new
/// process advertises the key the old one used. Before, the advertisement was taken for the
/// old flow's duplicate and answered `Ready(true)`: the new request started nothing here and
/// ran to its deadline with no data. Now it is dropped while the old flow waits for its send,
/// the old flow then ends and goes without a tombstone, and the advertisement, sent again,
/// starts the new request.
#[test]
fn a_send_still_in_flight_when_a_new_process_binds_the_rank_does_not_answer_it() {
    let t = Instant::now();
    let key = RequestKey::new(15, 0);
    let (mut ctx, advertise) = sending_to_a_lost_process(t, key, config());
    let known = ctx.forget_sends_to(RankId(1));
    assert_eq!(known, vec![(key, None)], "the flow still runs");
    let adv = advertise(t + ms(4));
    not_answered_while_the_old_send_runs(&mut ctx, t + ms(5), adv.clone());
    // The application's send returns: the old flow ends (seen once) and goes.
    let ends = the_new_request_starts_once_the_old_send_is_done(&mut ctx, t + ms(6), key, adv);
    assert_eq!(ends, vec![Outcome::PeerLost], "the old flow's end");
}

/// As above, but the old flow had already ended at its agreement bound (its send still
/// stopping, which the bound does not wait for) when the new process bound the rank, and its
/// linger (500 ms here, or none) is over too. Found by review: such a flow was forgotten at the
/// bind, or at its linger's end before it, the new process's request started, and the old
/// send's late report (`handle_send_done` failed, with the application's `give_up`) then failed
/// the new request. A flow is now kept while a send of it is not reported done.
#[test]
fn a_send_still_stopping_past_its_bound_when_a_new_process_binds_the_rank_does_not_reach_it() {
    for linger in [ms(500), ms(0)] {
        let t = Instant::now();
        let key = RequestKey::new(16, 0);
        let cfg = kvlink_proto::Config { linger, ..config() };
        let (mut ctx, advertise) = sending_to_a_lost_process(t, key, cfg);
        // Past the bound (1000 ms deadline, 500 ms bound) and the linger: ended, its send
        // still not reported.
        ctx.handle_timeout(t + ms(1600));
        ctx.handle_timeout(t + ms(2200));
        assert!(!ctx.running(
            key,
            Role::Sender {
                receiver: RankId(1)
            }
        ));
        assert_eq!(
            ctx.known(),
            1,
            "linger {linger:?}: forgotten with its send unreported"
        );
        drain(&mut ctx);
        let known = ctx.forget_sends_to(RankId(1));
        assert_eq!(known.len(), 1);
        assert!(known[0].1.is_some(), "ended: {known:?}");
        let adv = advertise(t + ms(2201));
        not_answered_while_the_old_send_runs(&mut ctx, t + ms(2202), adv.clone());
        ctx.handle_timeout(t + ms(2300));
        // The application's give-up as its send returns, then the send's report: the old
        // request's, not the new one's (which starts after).
        ctx.give_up(t + ms(2301), key, Outcome::Cancelled).unwrap();
        let ends =
            the_new_request_starts_once_the_old_send_is_done(&mut ctx, t + ms(2302), key, adv);
        assert!(ends.is_empty(), "ended before: {ends:?}");
    }
}

/// A flow whose send is never reported done (an application thread lost) is still forgotten,
/// `UNREPORTED_KEEP` (60 s) past its linger (its tombstone's time is over by then), without a
/// timer that fires before then.
#[test]
fn a_flow_whose_send_is_never_reported_is_forgotten_a_minute_past_its_linger() {
    let t = Instant::now();
    let key = RequestKey::new(17, 0);
    let (mut ctx, _) = sending_to_a_lost_process(t, key, config());
    ctx.handle_timeout(t + ms(1600));
    let next = ctx.poll_timeout().expect("a timer");
    // Its bound came 1.501 s after the start, its linger is 0.5 s.
    assert!(next >= t + ms(62_001), "{:?} after the start", next - t);
    ctx.handle_timeout(next);
    assert_eq!(ctx.known(), 0);
}

/// The rank's process replaced twice before the old send is reported: the flow, retired at the
/// first bind, kept the second process's advertisement, which goes with that process at the
/// second bind. Found by review: it was started once the old send was done, for the third
/// process, with the second one's buffers, and the third's own advertisement of the key was
/// then answered as its duplicate.
#[test]
fn a_flow_retired_twice_drops_the_advertisement_of_the_process_between() {
    let t = Instant::now();
    let key = RequestKey::new(18, 0);
    let g = RankId(1);
    let (mut ctx, advertise) = sending_to_a_lost_process(t, key, config());
    ctx.forget_sends_to(g);
    not_answered_while_the_old_send_runs(&mut ctx, t + ms(5), advertise(t + ms(4)));
    ctx.handle_peer_lost(t + ms(6), g);
    ctx.forget_sends_to(g);
    drain(&mut ctx);
    ctx.handle_send_done(t + ms(7), key, g, 0, false).unwrap();
    ctx.handle_timeout(t + ms(7));
    assert_eq!((ctx.known(), ctx.tombstones()), (0, 0));
    assert!(
        !std::iter::from_fn(|| ctx.poll_event()).any(|e| matches!(e, Event::Advertised { .. })),
        "the second process's advertisement was handed out"
    );
    ctx.handle_message(t + ms(8), g, advertise(t + ms(8)))
        .unwrap();
    assert!(
        std::iter::from_fn(|| ctx.poll_event()).any(|e| matches!(e, Event::Advertised { .. })),
        "the third process's advertisement was not handed out"
    );
}

/// The old process's retry (generation 1 of a request id) still has a send in flight at the
/// bind: the new process's generation 0 of that id (its ids start again) is not taken for a
/// stale attempt of it. Found by review: the retired flow kept its retry entry, and the new
/// process's advertisement of generation 0 was dropped as stale until the flow went.
#[test]
fn a_retired_retry_does_not_make_the_new_processs_first_attempt_stale() {
    let t = Instant::now();
    let (retry, first) = (RequestKey::new(19, 1), RequestKey::new(19, 0));
    let g = RankId(1);
    let (mut ctx, _) = sending_to_a_lost_process(t, retry, config());
    ctx.forget_sends_to(g);
    let mut reborn = Endpoint::new(g, config());
    let lease = BufferPool::new(4).lease(first).unwrap();
    let desc = kv_desc(TokenAllocator::default().allocate().unwrap());
    reborn
        .start_receive(
            t + ms(4),
            one_buffer(first, g, RankId(2), lease, desc, None),
        )
        .unwrap();
    let adv = reborn.poll_transmit().expect("an advertisement").message;
    ctx.handle_message(t + ms(5), g, adv).unwrap();
    assert!(
        std::iter::from_fn(|| ctx.poll_event()).any(|e| matches!(e, Event::Advertised { .. })),
        "the new process's first attempt was dropped as stale"
    );
    assert!(ctx.running(first, Role::Sender { receiver: g }));
}

/// The new process's request of the key ends there (its verdict comes) while a retired flow
/// keeps its advertisement: once the old flow goes, the request starts here already ended,
/// confirmed to its receiver, as it would have had no old flow been in the way. Found by
/// review: the retired flow swallowed the verdict, and the request started here as if running
/// (the application could accept it and send into a receive that was gone).
#[test]
fn a_verdict_for_a_held_advertisement_ends_its_request_when_it_starts() {
    let t = Instant::now();
    let key = RequestKey::new(20, 0);
    let g = RankId(1);
    let (mut ctx, advertise) = sending_to_a_lost_process(t, key, config());
    ctx.forget_sends_to(g);
    not_answered_while_the_old_send_runs(&mut ctx, t + ms(5), advertise(t + ms(4)));
    let verdict = kvlink_proto::Message::Verdict {
        key,
        outcome: Outcome::Cancelled,
    };
    ctx.handle_message(t + ms(6), g, verdict).unwrap();
    drain(&mut ctx);
    ctx.handle_send_done(t + ms(7), key, g, 0, false).unwrap();
    drain(&mut ctx);
    ctx.handle_timeout(t + ms(7));
    let events: Vec<_> = std::iter::from_fn(|| ctx.poll_event()).collect();
    assert!(
        events.iter().any(|e| matches!(e, Event::Advertised { .. })),
        "{events:?}"
    );
    assert!(
        std::iter::from_fn(|| ctx.poll_transmit())
            .any(|tx| matches!(tx.message, kvlink_proto::Message::Quiesced { .. })),
        "the receiver's verdict not confirmed"
    );
    ctx.accept(t + ms(8), key, g, true).unwrap();
    assert_eq!(
        ctx.check_send(key, g, 0, 64).unwrap(),
        Err(Outcome::Cancelled),
        "started as running"
    );
}

/// The new process is lost too while a retired flow keeps its advertisement: nothing of it
/// starts once the old flow goes. Found by review: it started as a running request to a rank
/// already lost.
#[test]
fn a_held_advertisement_goes_with_its_lost_process() {
    let t = Instant::now();
    let key = RequestKey::new(21, 0);
    let g = RankId(1);
    let (mut ctx, advertise) = sending_to_a_lost_process(t, key, config());
    ctx.forget_sends_to(g);
    not_answered_while_the_old_send_runs(&mut ctx, t + ms(5), advertise(t + ms(4)));
    ctx.handle_peer_lost(t + ms(6), g);
    drain(&mut ctx);
    ctx.handle_send_done(t + ms(7), key, g, 0, false).unwrap();
    ctx.handle_timeout(t + ms(7));
    assert_eq!(ctx.known(), 0);
    assert!(
        !std::iter::from_fn(|| ctx.poll_event()).any(|e| matches!(e, Event::Advertised { .. })),
        "the lost process's advertisement was handed out"
    );
}
