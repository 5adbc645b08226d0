//! Property tests: thousands of random fault schedules through the deterministic simulator.
//! Each asserts every invariant the simulator checks (`Sim::check`): one terminal state per rank
//! and request by deadline + agreement bound, agreement across ranks (exact when no rank dies
//! and no connection breaks; with those faults the failures may differ, and a rank cut off from
//! the verdict ends with a failure of its own beside others' `Completed`), a sender's
//! `Completed` only where its receiver completed, no lease leaked or returned twice, no buffer released
//! while its receive is posted, no data of one request or generation landing in another's
//! buffer, every request forgotten, bounded steps (no livelock).
mod proto_sim;

use proptest::prelude::*;
use proto_sim::*;
use std::time::Duration;

fn plan() -> impl Strategy<Value = Plan> {
    (
        (1usize..=3, 1usize..=3, 1usize..=3, 1u32..=2, any::<u64>()),
        (
            0u32..300,
            0u32..300,
            0u64..40,
            0u32..500,
            0u32..200,
            0u32..300,
            0u64..900,
        ),
        (0u32..200, 0u32..200, any::<bool>(), any::<bool>()),
        prop::option::of((0u64..1500, 0usize..8, 0usize..4)),
        prop::option::of((0u64..1500, 0usize..8, any::<bool>())),
        prop::option::of((0u64..1500, 0usize..8, 0usize..8, 20u64..600)),
    )
        .prop_map(
            |(
                (n_gen, n_ctx, n_req, segs, seed),
                (drop, dup, jitter_ms, stale, zombie, stuck_reap, window_ms),
                (reject, stall, external, retry),
                cancel,
                death,
                flap,
            )| {
                let reqs = (0..n_req)
                    .map(|i| ReqPlan {
                        // Ids equal modulo 4096 on purpose.
                        id: 7 + 4096 * i as u64,
                        start_ms: (seed >> (i * 4)) % 16,
                        segs_per_flow: segs,
                        retry,
                    })
                    .collect();
                Plan {
                    n_gen,
                    n_ctx,
                    reqs,
                    faults: Faults {
                        drop,
                        dup,
                        jitter_ms,
                        stale,
                        zombie,
                        stuck_reap,
                        window_ms,
                    },
                    reject,
                    stall,
                    cancels: cancel.into_iter().collect(),
                    death,
                    flap,
                    pool_capacity: 64,
                    external,
                    seed,
                    late: vec![],
                }
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 3000, ..ProptestConfig::default() })]

    #[test]
    fn random_fault_schedules_keep_every_invariant(plan in plan()) {
        let mut sim = Sim::new(plan);
        sim.run();
        let v = sim.check();
        prop_assert!(v.is_empty(), "violations:\n{}", v.join("\n"));
    }
}

/// Receivers that start a request far apart, with the default timing's ratio (an agreement
/// bound shorter than the retransmit interval, 50 ms against 200): a vote or failure verdict
/// that reaches a rank before its start must still count there. A reliable network and no
/// deaths, so agreement must be exact; a non-coordinator's early cancel used to leave the late
/// coordinator running to its deadline (`TimedOut` against `Cancelled`).
fn late_plan() -> impl Strategy<Value = Plan> {
    (
        2usize..=3,
        1usize..=2,
        any::<u64>(),
        prop::collection::vec(0u64..400, 3),
        prop::option::of((0u64..300, 0usize..3)),
    )
        .prop_map(|(n_gen, n_ctx, seed, late, cancel)| {
            let reqs = vec![ReqPlan {
                id: 7,
                start_ms: 0,
                segs_per_flow: 1,
                retry: false,
            }];
            let mut plan = Plan::simple(n_gen, n_ctx, reqs);
            plan.seed = seed;
            plan.late = late;
            // The cancel is by a generation rank (indices below n_gen).
            plan.cancels = cancel
                .map(|(t, rank)| (t, rank % n_gen, 0))
                .into_iter()
                .collect();
            plan
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, ..ProptestConfig::default() })]

    #[test]
    fn receivers_that_start_apart_agree_with_the_default_timing(plan in late_plan()) {
        let cfg = kvlink_proto::Config {
            timeout: ms(1000),
            agreement_bound: ms(50),
            retransmit: ms(200),
            linger: ms(500),
            ..kvlink_proto::Config::default()
        };
        let mut sim = Sim::with_config(plan, cfg);
        sim.run();
        let v = sim.check();
        prop_assert!(v.is_empty(), "violations:\n{}", v.join("\n"));
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, ..ProptestConfig::default() })]

    /// Linger zero (`EngineConfig::linger`): a request that failed is forgotten at its end, as
    /// a completed one is, and nothing pushes its failure verdict again. Lost, duplicated and
    /// reordered messages, cancels and deaths must still end every rank by its bound with the
    /// ranks agreeing: a sender that missed the verdict pulls it from the tombstone.
    #[test]
    fn random_fault_schedules_keep_every_invariant_without_linger(plan in plan()) {
        let cfg = kvlink_proto::Config {
            linger: Duration::ZERO,
            ..config()
        };
        let mut sim = Sim::with_config(plan, cfg);
        sim.run();
        let v = sim.check();
        prop_assert!(v.is_empty(), "violations:\n{}", v.join("\n"));
    }
}

/// Receivers that start a request apart, the coordinator last (within the others' deadline: a
/// receiver that times out first votes `TimedOut`, a failure of another kind), and the
/// connection between the coordinator and another receiver breaks after that receiver has
/// started and is bound again before the coordinator starts (in some schedules past the
/// receiver's linger, 500 ms here, when only the vote it owes is left of its receive). The receiver ends `PeerLost` at once (it lost its coordinator),
/// and once they are connected again it tells the coordinator, which decides `PeerLost` at its
/// start: every rank agrees, senders included. Before, the coordinator waited for that
/// receiver's vote and ended `TimedOut` at its deadline, as did its senders.
fn flap_before_the_coordinator_plan() -> impl Strategy<Value = Plan> {
    (
        2usize..=3,
        1usize..=2,
        any::<u64>(),
        300u64..900,
        (20u64..120, 1usize..3, 30u64..900),
    )
        .prop_map(
            |(n_gen, n_ctx, seed, coordinator_late, (at, other, heal_after))| {
                // Healed before the coordinator starts; past the receiver's linger (500 ms) in
                // some schedules, when its receive is forgotten and only the owed vote is left.
                let heal_after = heal_after.min(coordinator_late - at - 20);
                let reqs = vec![ReqPlan {
                    id: 7,
                    start_ms: 0,
                    segs_per_flow: 1,
                    retry: false,
                }];
                let mut plan = Plan::simple(n_gen, n_ctx, reqs);
                plan.seed = seed;
                plan.late = vec![coordinator_late];
                // Generation rank 0 coordinates; the other is a generation rank too.
                plan.flap = Some((at, 0, 1 + (other - 1) % (n_gen - 1), heal_after));
                plan
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 500, ..ProptestConfig::default() })]

    #[test]
    fn a_flap_healed_before_the_coordinator_starts_leaves_every_rank_agreeing(
        plan in flap_before_the_coordinator_plan()
    ) {
        let mut sim = Sim::new(plan);
        sim.run();
        let v = sim.check();
        prop_assert!(v.is_empty(), "violations:\n{}", v.join("\n"));
        let outs = sim.outcomes(kvlink_proto::RequestKey::new(7, 0));
        prop_assert!(!outs.is_empty());
        prop_assert!(
            outs.iter().all(|o| o.2 == kvlink_proto::error::Outcome::PeerLost),
            "ranks disagree: {:?}",
            outs
        );
    }
}
