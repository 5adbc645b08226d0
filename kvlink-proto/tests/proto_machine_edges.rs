//! Edges of the request state machines that a review found faulty, each pinned by a
//! deterministic test.
mod proto_sim;

use kvlink_proto::error::Outcome;
use kvlink_proto::{
    BufferPool, Config, Endpoint, Event, Message, RankId, RequestKey, Role, TokenAllocator,
};
use proto_sim::*;
use std::time::Instant;

/// Every transmit `ep` has queued, drained.
fn transmits(ep: &mut Endpoint) -> Vec<(RankId, Message)> {
    std::iter::from_fn(|| ep.poll_transmit())
        .map(|t| (t.to, t.message))
        .collect()
}

/// The terminal outcome `ep` reported for `key` in `role`, draining its events.
fn terminal(ep: &mut Endpoint, key: RequestKey, role: Role) -> Option<Outcome> {
    std::iter::from_fn(|| ep.poll_event()).find_map(|e| match e {
        Event::Terminal {
            key: k,
            role: r,
            outcome,
            ..
        } if k == key && r == role => Some(outcome),
        _ => None,
    })
}

/// A sender that refused (`Ready(false)`) pulls the verdict by sending its refusal again at the
/// retransmit interval, as a sender that voted a failure pulls it with its `Vote`. The
/// receiver's tombstone answers such a repeat with the verdict, but the receiver's live machine
/// ignored it once it had a verdict: the sender then depended on the receiver's backed-off push
/// alone (1, 2, 4 ... 32 intervals apart), and when those pushes were lost it ended at its bound
/// with its own `Rejected` while the receiver had ended `Cancelled`, no rank lost.
#[test]
fn a_refusal_sent_again_after_the_verdict_is_answered_with_the_verdict() {
    let t = Instant::now();
    let cfg = Config {
        linger: ms(5000),
        ..config()
    };
    let (g, c) = (RankId(1), RankId(2));
    let mut gen = Endpoint::new(g, cfg);
    let mut ctx = Endpoint::new(c, cfg);
    let key = RequestKey::new(3, 0);
    let lease = BufferPool::new(4).lease(key).unwrap();
    let desc = kv_desc(TokenAllocator::default().allocate().unwrap());
    gen.start_receive(t, one_buffer(key, g, c, lease, desc, None))
        .unwrap();
    for (_, m) in transmits(&mut gen) {
        ctx.handle_message(t + ms(1), g, m).unwrap();
    }
    // The receiver gives up; its verdict to the sender is lost (the endpoint broke and healed).
    gen.cancel(t + ms(2), key).unwrap();
    let lost = transmits(&mut gen);
    assert!(lost
        .iter()
        .any(|(_, m)| matches!(m, Message::Verdict { .. })));
    gen.handle_receive_reaped(t + ms(3), key, 0).unwrap();
    assert_eq!(
        terminal(&mut gen, key, Role::Receiver),
        Some(Outcome::Cancelled)
    );
    // The sender refuses meanwhile.
    ctx.accept(t + ms(3), key, g, false).unwrap();
    let mut now = t + ms(3);
    let mut answered = false;
    while let Some(at) = ctx.poll_timeout() {
        if at > t + ms(4000) {
            break;
        }
        now = now.max(at);
        // The receiver's own timer: its pushes of the verdict are lost too.
        gen.handle_timeout(now);
        transmits(&mut gen);
        ctx.handle_timeout(now);
        for (to, m) in transmits(&mut ctx) {
            assert_eq!(to, g);
            gen.handle_message(now, c, m).unwrap();
            // What the receiver answers to the sender's own message gets through.
            for (to, m) in transmits(&mut gen) {
                assert_eq!(to, c);
                answered |= matches!(m, Message::Verdict { .. });
                ctx.handle_message(now, g, m).unwrap();
            }
        }
        if !ctx.running(key, Role::Sender { receiver: g }) {
            break;
        }
    }
    assert!(
        answered,
        "the sender's repeated Ready(false) was never answered with the verdict"
    );
    assert_eq!(
        terminal(&mut ctx, key, Role::Sender { receiver: g }),
        Some(Outcome::Cancelled),
        "the sender must end with the receiver's verdict"
    );
}

/// Tombstones are capped (`Config::tomb_cap`) so that the core's memory does not grow with the
/// request rate times the deadline; past the cap the oldest goes early. Its entry in the queue
/// of tombstone expiries stayed until its expiry, though (the request's deadline plus bound plus
/// linger: here an hour), so that queue grew by one entry per request, cap or not. The queue
/// now drops entries whose tombstone is gone once they outnumber the live ones.
#[test]
fn evicted_tombstones_do_not_pile_up_in_the_expiry_queue() {
    let t = Instant::now();
    let cfg = Config {
        timeout: ms(3_600_000),
        tomb_cap: 4,
        ..config()
    };
    let (g, c) = (RankId(1), RankId(2));
    let mut gen = Endpoint::new(g, cfg);
    let mut ctx = Endpoint::new(c, cfg);
    let mut pool = BufferPool::new(4);
    let mut tokens = TokenAllocator::default();
    for i in 0..2000u64 {
        let now = t + ms(i);
        let key = RequestKey::new(i, 0);
        let lease = pool.lease(key).unwrap();
        let desc = kv_desc(tokens.allocate().unwrap());
        gen.start_receive(now, one_buffer(key, g, c, lease, desc, None))
            .unwrap();
        for (_, m) in transmits(&mut gen) {
            ctx.handle_message(now, g, m).unwrap();
        }
        ctx.accept(now, key, g, true).unwrap();
        assert_eq!(ctx.check_send(key, g, 0, 64).unwrap(), Ok(desc));
        ctx.begin_send(key, g, 0);
        ctx.handle_send_done(now, key, g, 0, true).unwrap();
        gen.handle_segment_landed(now, key, 0).unwrap();
        for (_, m) in transmits(&mut gen) {
            ctx.handle_message(now, g, m).unwrap();
        }
        transmits(&mut ctx);
        while let Some(a) = gen.poll_action() {
            if let kvlink_proto::Action::Release { lease, .. } = a {
                pool.release(lease).unwrap();
            }
        }
        while ctx.poll_action().is_some() {}
        while gen.poll_event().is_some() {}
        while ctx.poll_event().is_some() {}
        gen.handle_timeout(now);
        ctx.handle_timeout(now);
    }
    for ep in [&gen, &ctx] {
        assert_eq!((ep.known(), ep.tombstones()), (0, 4));
        assert!(
            ep.tomb_entries() <= 2 * 4 + 64,
            "{} entries kept for {} tombstones",
            ep.tomb_entries(),
            ep.tombstones()
        );
    }
}

/// With an external collective a receiver that has voted polls the collective for the verdict at
/// the retransmit interval ("a verdict is otherwise noticed within one retransmit interval").
/// Its vote did not set the retransmit timer, though: the poll came when the advertisement's
/// backed-off resend would have (up to 32 intervals later), so a verdict the other ranks had
/// reached waited that long, or until the bound, for a request whose every byte had landed.
#[test]
fn an_external_vote_polls_the_collective_within_one_retransmit_interval() {
    use kvlink_proto::Collective;
    let t = Instant::now();
    let cfg = config();
    let (g1, g2, c) = (RankId(1), RankId(2), RankId(3));
    let collective = MemCollective::default();
    let mut gen = Endpoint::with_collective(g1, cfg, Box::new(collective.clone()));
    let key = RequestKey::new(5, 0);
    // One buffer from `c`, received by two ranks: the vote goes through the collective.
    start_two_receiver_request(&mut gen, g1, [g1, g2], c, key, t);
    // A busy sender: the advertisement goes out again, backed off, three times.
    let mut now = t;
    for _ in 0..3 {
        now = gen.poll_timeout().unwrap();
        gen.handle_timeout(now);
    }
    transmits(&mut gen);
    // Then its data lands: this rank votes `Completed`.
    let voted = now + ms(10);
    gen.handle_segment_landed(voted, key, 0).unwrap();
    assert!(gen.running(key, Role::Receiver));
    // The other receiver votes `Completed` a moment later; nothing else reaches this rank.
    let mut other = collective.clone();
    other.contribute(voted + ms(1), key, &[g1, g2], g2, Outcome::Completed);
    let next = gen.poll_timeout().unwrap();
    assert!(
        next <= voted + cfg.retransmit,
        "the collective is polled {:?} after the vote, the retransmit interval is {:?}",
        next - voted,
        cfg.retransmit
    );
    gen.handle_timeout(next);
    assert_eq!(
        terminal(&mut gen, key, Role::Receiver),
        Some(Outcome::Completed)
    );
}
