//! Faults a review of the request state machines found, each pinned by a deterministic test.
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
