//! The request lifecycle driven by the deterministic simulator (`tests/proto_sim`): scenarios
//! for each rule of the issue, then property tests over random fault schedules.
mod proto_sim;

use kvlink_proto::error::Outcome;
use kvlink_proto::{RequestKey, Role};
use proto_sim::*;

fn req(id: u64, start_ms: u64, segs: u32) -> ReqPlan {
    ReqPlan {
        id,
        start_ms,
        segs_per_flow: segs,
        retry: false,
    }
}

fn run(plan: Plan) -> Sim {
    let mut sim = Sim::new(plan);
    sim.run();
    let v = sim.check();
    assert!(v.is_empty(), "violations:\n{}", v.join("\n"));
    sim
}

fn all_outcomes(sim: &Sim, key: RequestKey) -> Vec<Outcome> {
    sim.outcomes(key).into_iter().map(|o| o.2).collect()
}

#[test]
fn clean_run_completes_on_every_rank() {
    let sim = run(Plan::simple(2, 3, vec![req(1, 0, 3), req(2, 5, 2)]));
    for id in [1, 2] {
        let outs = sim.outcomes(RequestKey::new(id, 0));
        // 2 receivers + 3 senders x 2 receivers.
        assert_eq!(outs.len(), 2 + 6, "{outs:?}");
        assert!(outs.iter().all(|o| o.2 == Outcome::Completed), "{outs:?}");
    }
}

#[test]
fn rejection_is_agreed() {
    let mut plan = Plan::simple(2, 2, vec![req(7, 0, 2)]);
    plan.reject = 1000;
    let sim = run(plan);
    let outs = all_outcomes(&sim, RequestKey::new(7, 0));
    assert!(
        !outs.is_empty() && outs.iter().all(|o| *o == Outcome::Rejected),
        "{outs:?}"
    );
}

#[test]
fn silent_senders_time_out_and_buffers_come_back() {
    let mut plan = Plan::simple(2, 2, vec![req(3, 0, 2)]);
    plan.stall = 1000; // the context side never answers
    let sim = run(plan);
    let outs = all_outcomes(&sim, RequestKey::new(3, 0));
    assert!(outs.iter().all(|o| *o == Outcome::TimedOut), "{outs:?}");
}

/// Cancel at every state: for each rank and each millisecond across the lifetime of a request
/// (before the advertisement arrives, after it, after accept, while segments land, after all
/// landed, while agreeing, after the verdict, after terminal), the run keeps every invariant and
/// all ranks agree.
#[test]
fn cancel_at_every_state() {
    let mut seen = std::collections::BTreeSet::new();
    for rank in 0..4 {
        for t in 0..70u64 {
            let mut plan = Plan::simple(2, 2, vec![req(9, 0, 2)]);
            plan.cancels = vec![(t, rank, 0)];
            plan.seed = t * 7 + rank as u64;
            let sim = run(plan);
            let outs = all_outcomes(&sim, RequestKey::new(9, 0));
            assert!(
                outs.windows(2).all(|w| w[0] == w[1]),
                "rank {rank} t {t}: {outs:?}"
            );
            seen.insert(outs[0] as u8);
        }
    }
    // Early cancels win, late ones come after completion.
    assert!(seen.contains(&(Outcome::Cancelled as u8)));
    assert!(seen.contains(&(Outcome::Completed as u8)));
}

#[test]
fn detected_dead_sender_ends_peer_lost_everywhere() {
    let mut plan = Plan::simple(2, 2, vec![req(4, 0, 2)]);
    plan.stall = 0;
    plan.death = Some((1, 2, true)); // ctx rank 0, before it can accept
    let sim = run(plan);
    let outs = all_outcomes(&sim, RequestKey::new(4, 0));
    assert!(outs.iter().all(|o| *o == Outcome::PeerLost), "{outs:?}");
}

#[test]
fn silent_dead_coordinator_is_bounded() {
    let mut plan = Plan::simple(3, 2, vec![req(5, 0, 1)]);
    plan.stall = 1000;
    plan.death = Some((1, 0, false)); // the coordinator freezes, nobody is told
    let sim = run(plan);
    let outs = sim.outcomes(RequestKey::new(5, 0));
    assert!(!outs.is_empty());
    // Receivers cannot reach the coordinator: at the bound each ends with its own failure
    // (here TimedOut: it never says Completed without the verdict), never a hang.
    assert!(
        outs.iter()
            .filter(|o| o.1 == Role::Receiver)
            .all(|o| o.2 == Outcome::TimedOut),
        "{outs:?}"
    );
}

/// Stuck reaps (a transport that never completes a cancel) are fenced at the bound, and the
/// fenced slots come back through restore.
#[test]
fn stuck_cancel_is_fenced_not_reused() {
    let mut plan = Plan::simple(2, 2, vec![req(6, 0, 3)]);
    plan.stall = 1000;
    plan.faults = Faults {
        stuck_reap: 1000,
        window_ms: 10_000,
        ..Faults::default()
    };
    let sim = run(plan);
    assert!(sim.stats_sum().fenced_buffers >= 12);
    let outs = all_outcomes(&sim, RequestKey::new(6, 0));
    assert!(outs.iter().all(|o| *o == Outcome::TimedOut), "{outs:?}");
}

/// The field's wedge: every buffer is leased to requests whose peers never answer, no new
/// request arrives, and only the clock moves. Cleanup still runs, and the pool recovers fully,
/// including slots whose cancel never completed (fenced, then restored). A request started
/// afterwards completes.
#[test]
fn pool_exhaustion_wedge_recovers_without_new_requests() {
    for stuck in [0, 500, 1000] {
        let mut plan = Plan::simple(1, 2, (0..4).map(|i| req(10 + i, i, 2)).collect());
        plan.pool_capacity = 16; // 4 requests x 2 senders x 2 segments: exactly full
        plan.stall = 1000;
        plan.faults = Faults {
            stuck_reap: stuck,
            window_ms: 100_000,
            ..Faults::default()
        };
        // One more request while the pool is exhausted: it cannot start.
        plan.reqs.push(req(99, 10, 1));
        let sim = run(plan);
        assert_eq!(sim.not_started, 1, "the pool was not exhausted");
        for i in 0..4 {
            let outs = all_outcomes(&sim, RequestKey::new(10 + i, 0));
            assert_eq!(outs, vec![Outcome::TimedOut; 3], "stuck {stuck}");
        }
        let pool = sim.pool(gen_rank(0));
        assert_eq!((pool.available(), pool.leased(), pool.fenced()), (16, 0, 0));
    }
    // And after recovery, new work flows: same pool size, requests after the first wave.
    let mut plan = Plan::simple(1, 2, (0..4).map(|i| req(10 + i, i, 2)).collect());
    plan.pool_capacity = 16;
    plan.cancels = (0..4).map(|i| (5, 0, i)).collect();
    plan.reqs.push(req(50, 3_000, 2));
    plan.cancels.truncate(4);
    let sim = run(plan);
    assert_eq!(
        all_outcomes(&sim, RequestKey::new(50, 0)),
        vec![Outcome::Completed; 3]
    );
}

/// Two requests whose ids are equal modulo 4096 (and modulo 2^32) run at once; one is cancelled
/// or rejected, the other completes with its own data and nothing of the other's.
#[test]
fn ids_equal_mod_4096_never_interfere() {
    for (a, b) in [(5, 5 + 4096), (5, 5 + (1u64 << 32)), (0, 4096 * 1000)] {
        let mut plan = Plan::simple(2, 2, vec![req(a, 0, 2), req(b, 0, 2)]);
        plan.cancels = vec![(3, 0, 0)]; // cancel `a` on receiver 0 before data lands
        let sim = run(plan);
        let oa = all_outcomes(&sim, RequestKey::new(a, 0));
        let ob = all_outcomes(&sim, RequestKey::new(b, 0));
        assert!(oa.iter().all(|o| *o == Outcome::Cancelled), "{oa:?}");
        assert!(ob.iter().all(|o| *o == Outcome::Completed), "{ob:?}");
    }
}

/// A retry (generation 1) runs while stale messages and completions of generation 0 keep
/// arriving; they are counted and dropped, and the retry completes with its own data.
#[test]
fn retry_ignores_stale_generation() {
    let mut plan = Plan::simple(
        2,
        2,
        vec![ReqPlan {
            id: 42,
            start_ms: 0,
            segs_per_flow: 2,
            retry: true,
        }],
    );
    plan.cancels = vec![(2, 1, 0)];
    plan.faults = Faults {
        stale: 1000,
        window_ms: 100_000,
        ..Faults::default()
    };
    let sim = run(plan);
    let g0 = all_outcomes(&sim, RequestKey::new(42, 0));
    let g1 = all_outcomes(&sim, RequestKey::new(42, 1));
    assert!(g0.iter().all(|o| *o == Outcome::Cancelled), "{g0:?}");
    assert!(
        !g1.is_empty() && g1.iter().all(|o| *o == Outcome::Completed),
        "{g1:?}"
    );
    assert!(sim.stale_injected > 0);
    let s = sim.stats_sum();
    assert!(s.stale_dropped + s.duplicates > 0, "{s:?}");
}

#[test]
fn external_collective_agrees_too() {
    let mut plan = Plan::simple(3, 2, vec![req(8, 0, 2), req(18, 0, 1)]);
    plan.external = true;
    plan.cancels = vec![(4, 1, 1)];
    let sim = run(plan);
    let o8 = all_outcomes(&sim, RequestKey::new(8, 0));
    assert!(o8.iter().all(|o| *o == Outcome::Completed), "{o8:?}");
    let o18 = all_outcomes(&sim, RequestKey::new(18, 0));
    assert!(o18.windows(2).all(|w| w[0] == w[1]), "{o18:?}");
}

/// Directly on one endpoint: a landing and a message of generation 0 while generation 1 runs
/// are counted as stale and change nothing; the retry completes only on its own landings.
#[test]
fn stale_landing_is_counted_and_dropped() {
    use kvlink_proto::*;
    let base = std::time::Instant::now();
    let me = RankId(1);
    let mut ep = Endpoint::new(me, config());
    let mut pool = BufferPool::new(4);
    let mut tokens = TokenAllocator::default();
    let mut spec = |ep: &mut Endpoint, key: RequestKey| {
        let lease = pool.lease(key).unwrap();
        let desc = kv_desc(tokens.allocate().unwrap());
        ep.start_receive(base, one_buffer(key, me, RankId(2), lease, desc, None))
    };
    let old = RequestKey::new(5, 0);
    let new = RequestKey::new(5, 1);
    spec(&mut ep, new).unwrap();
    // Starting an older generation while a newer one runs is refused.
    assert_eq!(
        spec(&mut ep, old).unwrap_err().kind,
        kvlink_proto::error::ErrorKind::StaleGeneration
    );
    ep.handle_segment_landed(base, old, 0).unwrap();
    ep.handle_message(
        base,
        RankId(2),
        Message::Ready {
            key: old,
            ready: false,
        },
    )
    .unwrap();
    assert_eq!(ep.stats().stale_dropped, 2);
    while let Some(e) = ep.poll_event() {
        assert!(!matches!(e, Event::Terminal { .. }), "{e:?}");
    }
    ep.handle_segment_landed(base + ms(1), new, 0).unwrap();
    let mut terminal = None;
    while let Some(e) = ep.poll_event() {
        if let Event::Terminal { key, outcome, .. } = e {
            terminal = Some((key, outcome));
        }
    }
    assert_eq!(terminal, Some((new, Outcome::Completed)));
    // The deadline is what the driver sleeps to; nothing ever asks for time in the past. The
    // completed retry is due to be forgotten now; after that the next time is later.
    assert_eq!(ep.poll_timeout(), Some(base + ms(1)));
    ep.handle_timeout(base + ms(1));
    assert!(ep.poll_timeout().unwrap() > base + ms(1));
}

/// The same on a context rank, for the messages a sender takes: while generation 1 of a
/// request from a peer is known here, that peer's late `Advertise` and `Verdict` of
/// generation 0 are counted as stale and start nothing; once generation 1 is forgotten, a
/// message of generation 0 is merely unknown (nothing newer is known any more).
#[test]
fn stale_advertisement_and_verdict_reach_no_sender() {
    use kvlink_proto::*;
    let t0 = std::time::Instant::now();
    let (g, c) = (RankId(1), RankId(2));
    let mut ctx = Endpoint::new(c, config());
    let mut tokens = TokenAllocator::default();
    let advertise = |key: RequestKey, token: Token| Message::Advertise {
        key,
        src_rank: g,
        timeout_ms: 1000,
        request_info: vec![],
        buffers: vec![kv_desc(token)],
    };
    let (old, new) = (RequestKey::new(5, 0), RequestKey::new(5, 1));
    ctx.handle_message(t0, g, advertise(new, tokens.allocate().unwrap()))
        .unwrap();
    let advertised = |ctx: &mut Endpoint| {
        let mut n = 0;
        while let Some(e) = ctx.poll_event() {
            n += usize::from(matches!(e, Event::Advertised { .. }));
        }
        n
    };
    assert_eq!(advertised(&mut ctx), 1);
    ctx.handle_message(t0, g, advertise(old, tokens.allocate().unwrap()))
        .unwrap();
    ctx.handle_message(
        t0,
        g,
        Message::Verdict {
            key: old,
            outcome: Outcome::Completed,
        },
    )
    .unwrap();
    assert_eq!(
        advertised(&mut ctx),
        0,
        "a stale advertisement started a flow"
    );
    assert_eq!(ctx.known(), 1);
    assert_eq!(ctx.stats().stale_dropped, 2);
    assert_eq!(ctx.stats().unknown_dropped, 0);
    // Generation 1 ends (never accepted: its deadline passes) and is forgotten.
    let mut now = t0;
    while ctx.known() > 0 {
        now += ms(100);
        assert!(now < t0 + ms(60_000), "generation 1 was never forgotten");
        ctx.handle_timeout(now);
        while ctx.poll_transmit().is_some() {}
        while ctx.poll_event().is_some() {}
    }
    ctx.handle_message(
        now,
        g,
        Message::Verdict {
            key: old,
            outcome: Outcome::Completed,
        },
    )
    .unwrap();
    assert_eq!(ctx.stats().stale_dropped, 2);
    assert_eq!(ctx.stats().unknown_dropped, 1);
}

/// The success path of a 1x1 request costs two control messages: `Advertise` and the
/// `Verdict`. Acceptance is proved by the landing (no `Ready(true)`), a `Completed` verdict is
/// not confirmed (no `Quiesced`). Both ends are `Completed`, and the sender knows the request's
/// deadline from the advertisement. Each side forgets the request at its end (no linger for a
/// completed one): its tombstone keeps the answer and the end, answers a late pull of the
/// verdict, and takes a repeated verdict or advertisement without a word.
#[test]
fn a_successful_one_to_one_request_costs_two_control_messages() {
    use kvlink_proto::*;
    let t = std::time::Instant::now();
    let (g, c) = (RankId(1), RankId(2));
    let mut gen = Endpoint::new(g, config());
    let mut ctx = Endpoint::new(c, config());
    let mut pool = BufferPool::new(4);
    let mut tokens = TokenAllocator::default();
    let key = RequestKey::new(9, 0);
    let desc = kv_desc(tokens.allocate().unwrap());
    let lease = pool.lease(key).unwrap();
    gen.start_receive(t, one_buffer(key, g, c, lease, desc, Some(ms(700))))
        .unwrap();
    let mut sent = Vec::new();
    let mut pump = |from: &mut Endpoint, to: &mut Endpoint, at| {
        while let Some(tx) = from.poll_transmit() {
            sent.push(
                format!("{:?}", tx.message)
                    .split_whitespace()
                    .next()
                    .unwrap()
                    .to_string(),
            );
            to.handle_message(at, from.rank(), tx.message).unwrap();
        }
    };
    pump(&mut gen, &mut ctx, t + ms(1));
    let mut deadline = None;
    while let Some(e) = ctx.poll_event() {
        if let Event::Advertised { deadline: d, .. } = e {
            deadline = Some(d);
        }
    }
    assert_eq!(
        deadline,
        Some(t + ms(1) + ms(700)),
        "the sender shares the deadline"
    );
    assert_eq!(
        ctx.accept(t + ms(2), key, RankId(7), true)
            .unwrap_err()
            .kind,
        kvlink_proto::error::ErrorKind::UnknownRequest,
        "no advertisement from that rank"
    );
    ctx.accept(t + ms(2), key, g, true).unwrap();
    assert_eq!(
        ctx.accept(t + ms(2), key, g, true).unwrap_err().kind,
        kvlink_proto::error::ErrorKind::InvalidArgument,
        "already decided"
    );
    pump(&mut ctx, &mut gen, t + ms(2));
    assert_eq!(
        gen.receive_answer(key),
        None,
        "an acceptance is not a message of its own"
    );
    assert_eq!(ctx.check_send(key, g, 0, 64).unwrap(), Ok(desc));
    ctx.begin_send(key, g, 0);
    ctx.handle_send_done(t + ms(3), key, g, 0, true).unwrap();
    gen.handle_segment_landed(t + ms(3), key, 0).unwrap();
    assert_eq!(
        gen.receive_answer(key),
        Some(true),
        "the first landing proves acceptance"
    );
    pump(&mut gen, &mut ctx, t + ms(4));
    pump(&mut ctx, &mut gen, t + ms(4));
    let end = |ep: &mut Endpoint| {
        let mut o = None;
        while let Some(e) = ep.poll_event() {
            if let Event::Terminal {
                outcome, started, ..
            } = e
            {
                o = Some((outcome, started));
            }
        }
        o
    };
    // Each end says when the request started on its rank (its duration, for metrics).
    assert_eq!(end(&mut gen), Some((Outcome::Completed, t)));
    assert_eq!(end(&mut ctx), Some((Outcome::Completed, t + ms(1))));
    assert_eq!(sent, ["Advertise", "Verdict"]);
    assert_eq!(
        gen.receive_answer(key),
        Some(true),
        "a finished receive keeps its answer"
    );
    assert_eq!(gen.receive_answer(RequestKey::new(10, 0)), None, "unknown");
    // Due at once, and forgotten by the next timeout pass, on both sides.
    for ep in [&mut gen, &mut ctx] {
        assert!(ep.poll_timeout().unwrap() <= t + ms(4), "due at its end");
        ep.handle_timeout(t + ms(4));
        assert_eq!((ep.known(), ep.tombstones()), (0, 1));
        assert!(ep.poll_timeout().unwrap() > t + ms(4));
    }
    assert_eq!(gen.receive_answer(key), Some(true), "from the tombstone");
    assert!(gen.knows_receive(key) && ctx.knows_send(key, g));
    assert_eq!(
        ctx.check_send(key, g, 0, 64).unwrap_err().kind,
        kvlink_proto::error::ErrorKind::InvalidArgument,
        "a completed flow sent every segment"
    );
    // Misuse after the end is told as while it lingered: accepting again is a decision already
    // made, a cancel of the ended receive changes nothing.
    assert_eq!(
        ctx.accept(t + ms(5), key, g, true).unwrap_err().kind,
        kvlink_proto::error::ErrorKind::InvalidArgument
    );
    gen.cancel(t + ms(5), key).unwrap();
    assert!(gen.poll_event().is_none() && gen.poll_transmit().is_none());
    // A pull of the verdict that crossed it: answered from the tombstone.
    let vote = Message::Vote {
        key,
        outcome: Outcome::Completed,
    };
    gen.handle_message(t + ms(5), c, vote).unwrap();
    let answer = gen.poll_transmit().expect("the verdict again");
    assert_eq!(
        (answer.to, answer.message),
        (
            c,
            Message::Verdict {
                key,
                outcome: Outcome::Completed
            }
        )
    );
    // That verdict again, and the advertisement again: counted, nothing sent back.
    let dups = ctx.stats().duplicates;
    ctx.handle_message(
        t + ms(5),
        g,
        Message::Verdict {
            key,
            outcome: Outcome::Completed,
        },
    )
    .unwrap();
    ctx.handle_message(
        t + ms(5),
        g,
        Message::Advertise {
            key,
            src_rank: g,
            timeout_ms: 700,
            request_info: vec![],
            buffers: vec![desc],
        },
    )
    .unwrap();
    assert_eq!(ctx.stats().duplicates, dups + 2);
    assert!(ctx.poll_transmit().is_none() && ctx.poll_event().is_none());
    assert!(gen.poll_transmit().is_none());
}

/// Once a receive has ended its answer follows the end: a segment that landed before the
/// request timed out does not leave it "ready" (the engine's `recv_ready` reads this before and
/// after `wait` took the end, and must say the same both times).
#[test]
fn an_ended_receives_answer_follows_its_end_not_an_earlier_landing() {
    use kvlink_proto::*;
    let t = std::time::Instant::now();
    let (g, c) = (RankId(1), RankId(2));
    let mut gen = Endpoint::new(g, config());
    let mut pool = BufferPool::new(4);
    let mut tokens = TokenAllocator::default();
    let key = RequestKey::new(6, 0);
    let mut second = kv_desc(tokens.allocate().unwrap());
    second.segment = 1;
    let buffers = vec![
        (
            pool.lease(key).unwrap(),
            kv_desc(tokens.allocate().unwrap()),
        ),
        (pool.lease(key).unwrap(), second),
    ];
    gen.start_receive(
        t,
        ReceiveSpec {
            key,
            receivers: vec![g],
            flows: vec![ReceiveFlow { sender: c, buffers }],
            request_info: vec![],
            timeout: Some(ms(100)),
        },
    )
    .unwrap();
    gen.handle_segment_landed(t + ms(1), key, 0).unwrap();
    assert_eq!(gen.receive_answer(key), Some(true), "running: a landing");
    // Segment 1 never comes: the deadline, then the agreement bound, end it.
    for at in [100, 200, 400, 1000] {
        gen.handle_timeout(t + ms(at));
    }
    let mut end = None;
    while let Some(e) = gen.poll_event() {
        if let Event::Terminal { outcome, .. } = e {
            end = Some(outcome);
        }
    }
    assert_eq!(end, Some(Outcome::TimedOut));
    assert!(gen.knows_receive(key), "it lingers");
    assert_eq!(gen.receive_answer(key), None, "ended TimedOut: no answer");
}

/// The senders' answer is the core's: a refusal is `Some(false)`, and wins over an earlier
/// acceptance of another sender; a `Ready` from a rank that is not a sender of the request
/// answers nothing.
#[test]
fn a_refusal_is_the_receives_answer_and_a_stranger_gives_none() {
    use kvlink_proto::*;
    let t = std::time::Instant::now();
    let (g, c1, c2, stranger) = (RankId(1), RankId(2), RankId(3), RankId(4));
    let mut gen = Endpoint::new(g, config());
    let mut pool = BufferPool::new(4);
    let mut tokens = TokenAllocator::default();
    let key = RequestKey::new(5, 0);
    let flow = |sender, pool: &mut BufferPool, tokens: &mut TokenAllocator, segment| {
        let mut desc = kv_desc(tokens.allocate().unwrap());
        desc.segment = segment;
        ReceiveFlow {
            sender,
            buffers: vec![(pool.lease(key).unwrap(), desc)],
        }
    };
    let flows = vec![
        flow(c1, &mut pool, &mut tokens, 0),
        flow(c2, &mut pool, &mut tokens, 1),
    ];
    gen.start_receive(
        t,
        ReceiveSpec {
            key,
            receivers: vec![g],
            flows,
            request_info: vec![],
            timeout: Some(ms(700)),
        },
    )
    .unwrap();
    let ready = |ready| Message::Ready { key, ready };
    gen.handle_message(t + ms(1), stranger, ready(false))
        .unwrap();
    assert_eq!(gen.receive_answer(key), None, "not one of its senders");
    gen.handle_message(t + ms(1), c1, ready(true)).unwrap();
    assert_eq!(gen.receive_answer(key), Some(true));
    gen.handle_message(t + ms(2), c2, ready(false)).unwrap();
    assert_eq!(gen.receive_answer(key), Some(false), "a refusal wins");
    gen.handle_message(t + ms(3), c1, ready(true)).unwrap();
    assert_eq!(gen.receive_answer(key), Some(false), "and stays");
}

/// Requests that end long before their deadline do not leave their deadline behind in the
/// timer heap: after 5000 requests of a minute's deadline, each completed at once, the heap
/// holds no more than about twice the timers still alive (those lingering), not one per
/// request ever started.
#[test]
fn timers_of_finished_requests_do_not_pile_up() {
    use kvlink_proto::*;
    let t0 = std::time::Instant::now();
    let (g, c) = (RankId(1), RankId(2));
    let mut gen = Endpoint::new(g, config());
    let mut ctx = Endpoint::new(c, config());
    let mut pool = BufferPool::new(8);
    let mut tokens = TokenAllocator::default();
    let pump = |from: &mut Endpoint, to: &mut Endpoint, at| {
        while let Some(tx) = from.poll_transmit() {
            to.handle_message(at, from.rank(), tx.message).unwrap();
        }
    };
    let mut most = 0;
    for i in 0..5000u64 {
        // 0.5 ms apart: about 1000 lingering (linger 500 ms) at any time.
        let now = t0 + std::time::Duration::from_micros(500 * i);
        gen.handle_timeout(now);
        ctx.handle_timeout(now);
        let key = RequestKey::new(i + 1, 0);
        let (lease, desc) = (
            pool.lease(key).unwrap(),
            kv_desc(tokens.allocate().unwrap()),
        );
        gen.start_receive(now, one_buffer(key, g, c, lease, desc, Some(ms(60_000))))
            .unwrap();
        pump(&mut gen, &mut ctx, now);
        ctx.accept(now, key, g, true).unwrap();
        ctx.begin_send(key, g, 0);
        ctx.handle_send_done(now, key, g, 0, true).unwrap();
        gen.handle_segment_landed(now, key, 0).unwrap();
        pump(&mut gen, &mut ctx, now);
        pump(&mut ctx, &mut gen, now);
        let mut done = false;
        while let Some(e) = gen.poll_event() {
            if let Event::Terminal { outcome, .. } = e {
                assert_eq!(outcome, Outcome::Completed);
                done = true;
            }
        }
        while ctx.poll_event().is_some() {}
        while let Some(a) = gen.poll_action() {
            if let Action::Release { lease, .. } = a {
                pool.release(lease).unwrap();
            }
        }
        while ctx.poll_action().is_some() {}
        assert!(done, "request {i} completed");
        most = most.max(gen.timer_entries()).max(ctx.timer_entries());
    }
    println!("most timer entries on one rank over 5000 requests: {most}");
    assert!(
        most < 3000,
        "timer heap grew with every request ever started: {most}"
    );
}

/// A generation rank (1) and a context rank (2) at `t0`, the generation rank having started
/// request 1 (one 64-byte buffer from rank 2, deadline 60 s): its `Advertise` is the first
/// transmit. Returns both endpoints and the generation rank's id.
fn one_request_advertised(
    t0: std::time::Instant,
) -> (
    kvlink_proto::Endpoint,
    kvlink_proto::Endpoint,
    kvlink_proto::RankId,
) {
    use kvlink_proto::*;
    let (g, c) = (RankId(1), RankId(2));
    let mut gen = Endpoint::new(g, config());
    let ctx = Endpoint::new(c, config());
    let mut pool = BufferPool::new(4);
    let mut tokens = TokenAllocator::default();
    let key = RequestKey::new(1, 0);
    let (lease, desc) = (
        pool.lease(key).unwrap(),
        kv_desc(tokens.allocate().unwrap()),
    );
    gen.start_receive(t0, one_buffer(key, g, c, lease, desc, Some(ms(60_000))))
        .unwrap();
    (gen, ctx, g)
}

/// An advertisement that its sender has queued but not yet answered (a busy prefill) goes out
/// again backed off, 1, 2, 4 ... up to 32 retransmit intervals apart, not once an interval: a
/// sender holding 4096 of them would otherwise be sent each again five times a second (at the
/// engine's 200 ms) while it works. It is still sent again, so a lost one is recovered.
#[test]
fn an_unanswered_advertisement_is_sent_again_backed_off() {
    let t0 = std::time::Instant::now();
    let cfg = config();
    let (mut gen, mut ctx, g) = one_request_advertised(t0);
    let mut sent_at = Vec::new();
    for step in 0..=1000u64 {
        let now = t0 + ms(10 * step);
        gen.handle_timeout(now);
        while let Some(tx) = gen.poll_transmit() {
            if matches!(tx.message, kvlink_proto::wire::Message::Advertise { .. }) {
                sent_at.push(now - t0);
            }
            // The sender takes it (queued for `next_advertisement`) and never answers.
            ctx.handle_message(now, g, tx.message).unwrap();
        }
        while ctx.poll_event().is_some() {}
    }
    let gaps: Vec<u128> = sent_at
        .windows(2)
        .map(|w| (w[1] - w[0]).as_millis())
        .collect();
    println!("advertisement sent at {sent_at:?}");
    assert!(
        (4..=15).contains(&sent_at.len()),
        "{} advertisements in 10 s at a {:?} interval (without back-off: 200)",
        sent_at.len(),
        cfg.retransmit
    );
    assert!(gaps.windows(2).all(|w| w[0] <= w[1]), "gaps grow: {gaps:?}");
    let most = 32 * cfg.retransmit.as_millis();
    assert!(gaps.iter().all(|&g| g <= most + 10), "capped: {gaps:?}");
    assert!(
        gaps.last().is_some_and(|&g| g + 10 >= most),
        "reaches the cap: {gaps:?}"
    );
}

/// A failure verdict the sender does not confirm (alive but slow, or its `Quiesced` lost) is
/// pushed again backed off like an advertisement: after a mass failure, thousands of requests
/// towards one busy sender would otherwise each go out five times a second until their linger.
/// It is still pushed again, so a lost verdict is recovered; the fault proptest checks that the
/// outcomes still agree (a sender also pulls the verdict, and its vote is answered with it).
#[test]
fn an_unconfirmed_failure_verdict_is_pushed_again_backed_off() {
    use kvlink_proto::wire::Message;
    let t0 = std::time::Instant::now();
    let cfg = config();
    let (mut gen, mut ctx, g) = one_request_advertised(t0);
    let key = RequestKey::new(1, 0);
    let mut verdicts_at = Vec::new();
    let mut confirmations = 0;
    for step in 0..=1000u64 {
        let now = t0 + ms(10 * step);
        if step == 5 {
            // The generation side gives up on the request: the verdict is decided and pushed.
            gen.cancel(now, key).unwrap();
        }
        gen.handle_timeout(now);
        while let Some(tx) = gen.poll_transmit() {
            if let Message::Verdict { outcome, .. } = tx.message {
                assert_eq!(outcome, Outcome::Cancelled);
                verdicts_at.push((now - t0).as_millis());
            }
            ctx.handle_message(now, g, tx.message).unwrap();
        }
        // The sender answers every verdict with `Quiesced`; none of them arrives.
        while let Some(tx) = ctx.poll_transmit() {
            confirmations += usize::from(matches!(tx.message, Message::Quiesced { .. }));
        }
        while gen.poll_action().is_some() {}
        while ctx.poll_event().is_some() {}
        while gen.poll_event().is_some() {}
    }
    let gaps: Vec<u128> = verdicts_at.windows(2).map(|w| w[1] - w[0]).collect();
    println!("verdict pushed at {verdicts_at:?} ms, {confirmations} confirmations lost");
    assert!(
        confirmations >= verdicts_at.len() - 1,
        "the sender answered each"
    );
    assert!(
        verdicts_at.len() >= 3,
        "pushed again while unconfirmed: {verdicts_at:?}"
    );
    assert!(
        verdicts_at.len() <= 12,
        "{} pushes before the request was forgotten, at a {:?} interval (without back-off: one per interval)",
        verdicts_at.len(),
        cfg.retransmit
    );
    assert!(gaps.windows(2).all(|w| w[0] <= w[1]), "gaps grow: {gaps:?}");
    let most = 32 * cfg.retransmit.as_millis();
    assert!(gaps.iter().all(|&g| g <= most + 10), "capped: {gaps:?}");
}

/// `start_receive` refuses a spec whose buffers repeat a segment, a token or a lease (within a
/// flow or across two), or whose senders repeat or include a receiver, with a typed error that
/// starts nothing and sends nothing; the same request, repaired, then starts.
#[test]
fn start_receive_refuses_repeats_and_starts_nothing() {
    use kvlink_proto::error::ErrorKind;
    use kvlink_proto::*;
    let t = std::time::Instant::now();
    let (g, c1, c2) = (RankId(1), RankId(2), RankId(3));
    let mut ep = Endpoint::new(g, config());
    let mut pool = BufferPool::new(8);
    let mut tokens = TokenAllocator::default();
    let key = RequestKey::new(7, 0);
    let mut buf = |segment: u32| {
        let mut d = kv_desc(tokens.allocate().unwrap());
        d.segment = segment;
        (pool.lease(key).unwrap(), d)
    };
    let (a, b, x, y) = (buf(0), buf(1), buf(2), buf(3));
    let spec = |flows: Vec<(RankId, Vec<(Lease, BufferDesc)>)>| ReceiveSpec {
        key,
        receivers: vec![g],
        flows: flows
            .into_iter()
            .map(|(sender, buffers)| ReceiveFlow { sender, buffers })
            .collect(),
        request_info: vec![],
        timeout: None,
    };
    let with = |(l, d): (Lease, BufferDesc), f: &dyn Fn(&mut Lease, &mut BufferDesc)| {
        let (mut l, mut d) = (l, d);
        f(&mut l, &mut d);
        (l, d)
    };
    let bad = [
        (
            "segment in a flow",
            spec(vec![(c1, vec![a, with(b, &|_, d| d.segment = 0)])]),
        ),
        (
            "token across flows",
            spec(vec![
                (c1, vec![a]),
                (c2, vec![with(b, &|_, d| d.token = a.1.token)]),
            ]),
        ),
        (
            "lease across flows",
            spec(vec![(c1, vec![a]), (c2, vec![with(b, &|l, _| *l = a.0)])]),
        ),
        ("sender twice", spec(vec![(c1, vec![a]), (c1, vec![b])])),
        ("sender is a receiver", spec(vec![(g, vec![a])])),
    ];
    for (what, s) in bad {
        let e = ep.start_receive(t, s).expect_err(what);
        assert_eq!(e.kind, ErrorKind::InvalidArgument, "{what}: {e}");
        assert_eq!(ep.known(), 0, "{what}: nothing started");
        assert!(ep.poll_transmit().is_none(), "{what}: nothing sent");
    }
    ep.start_receive(t, spec(vec![(c1, vec![a, b]), (c2, vec![x, y])]))
        .unwrap();
    assert_eq!(ep.known(), 1);
    let sent: Vec<RankId> = std::iter::from_fn(|| ep.poll_transmit())
        .map(|t| t.to)
        .collect();
    assert_eq!(sent, [c1, c2], "one advertisement per sender");
}

#[test]
fn a_receive_reports_its_largest_buffer_over_every_sender() {
    use kvlink_proto::*;
    let t = std::time::Instant::now();
    let (g, c1, c2) = (RankId(1), RankId(2), RankId(3));
    let mut ep = Endpoint::new(g, config());
    let mut pool = BufferPool::new(8);
    let mut tokens = TokenAllocator::default();
    let key = RequestKey::new(9, 0);
    assert_eq!(
        ep.largest_receive_segment(key),
        None,
        "unknown before it starts"
    );
    let mut buf = |segment: u32, len: u64| {
        let mut d = kv_desc(tokens.allocate().unwrap());
        d.segment = segment;
        d.len = len;
        d.addr = 0x1000 + u64::from(segment) * (64 << 20);
        (pool.lease(key).unwrap(), d)
    };
    let flows = vec![
        ReceiveFlow {
            sender: c1,
            buffers: vec![buf(0, 4096), buf(1, 1 << 20)],
        },
        ReceiveFlow {
            sender: c2,
            buffers: vec![buf(2, 32 << 20), buf(3, 64)],
        },
    ];
    let spec = ReceiveSpec {
        key,
        receivers: vec![g],
        flows,
        request_info: vec![],
        timeout: None,
    };
    ep.start_receive(t, spec).unwrap();
    assert_eq!(ep.largest_receive_segment(key), Some(32 << 20));
    assert_eq!(ep.largest_receive_segment(RequestKey::new(9, 1)), None);
}
