//! Property tests: thousands of random fault schedules through the deterministic simulator.
//! Each asserts every invariant the simulator checks (`Sim::check`): one terminal state per rank
//! and request by deadline + agreement bound, agreement across ranks (exact when no rank dies;
//! otherwise only `PeerLost` may differ), no lease leaked or returned twice, no buffer released
//! while its receive is posted, no data of one request or generation landing in another's
//! buffer, every request forgotten, bounded steps (no livelock).
mod proto_sim;

use proptest::prelude::*;
use proto_sim::*;

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
    )
        .prop_map(
            |(
                (n_gen, n_ctx, n_req, segs, seed),
                (drop, dup, jitter_ms, stale, zombie, stuck_reap, window_ms),
                (reject, stall, external, retry),
                cancel,
                death,
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
                    pool_capacity: 64,
                    external,
                    seed,
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
