//! Property test of the region table (`kvlink_proto::regions`) against a plain model: random
//! sequences of registrations, transfers checked and tracked the way the engine does it,
//! fences, releases and deregistrations, over a small address space so that ranges touch,
//! straddle and overlap often. After every step the table must answer every lookup exactly as
//! the model does (which region, straddling edges, fenced overlap for receives and for sends,
//! closing regions) and its counters (transfers, fenced transfers and bytes, the fenced ranges,
//! the total) must match.
use kvlink_proto::error::ErrorKind;
use kvlink_proto::regions::{RegionId, Regions};
use proptest::prelude::*;
use std::collections::BTreeMap;

/// The address space the test plays in (regions and buffers fall inside it).
const SPACE: u64 = 256;

#[derive(Clone, Debug)]
enum Step {
    Register {
        addr: u64,
        len: u64,
    },
    Transfer {
        op: u64,
        addr: u64,
        len: u64,
        writes: bool,
        peer: u64,
    },
    Fence {
        op: u64,
    },
    Done {
        op: u64,
    },
    BeginRemove {
        pick: usize,
    },
    FinishRemove {
        pick: usize,
    },
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        (1..SPACE, 1u64..64).prop_map(|(addr, len)| Step::Register { addr, len }),
        (0u64..24, 1..SPACE, 1u64..32, any::<bool>(), 0u64..3).prop_map(
            |(op, addr, len, writes, peer)| Step::Transfer {
                op,
                addr,
                len,
                writes,
                peer
            }
        ),
        (0u64..24).prop_map(|op| Step::Fence { op }),
        (0u64..24).prop_map(|op| Step::Done { op }),
        (0usize..8).prop_map(|pick| Step::BeginRemove { pick }),
        (0usize..8).prop_map(|pick| Step::FinishRemove { pick }),
    ]
}

#[derive(Clone, Copy, Debug)]
struct MRegion {
    start: u64,
    len: u64,
    /// Deregistrations under way.
    closing: u32,
}

#[derive(Clone, Copy, Debug)]
struct MUse {
    region: RegionId,
    addr: u64,
    len: u64,
    writes: bool,
    peer: u64,
    fenced: bool,
}

#[derive(Default)]
struct Model {
    regions: BTreeMap<RegionId, MRegion>,
    uses: BTreeMap<u64, MUse>,
}

impl Model {
    fn overlaps(a: u64, al: u64, b: u64, bl: u64) -> bool {
        a < b + bl && b < a + al
    }

    /// What a lookup must answer: Ok(None), Ok(Some(region)) or the error kind.
    fn lookup(
        &self,
        addr: u64,
        len: u64,
        for_receive: bool,
    ) -> Result<Option<RegionId>, ErrorKind> {
        let hit = self
            .regions
            .iter()
            .find(|(_, r)| Self::overlaps(addr, len, r.start, r.len));
        let Some((&id, r)) = hit else { return Ok(None) };
        if addr < r.start || addr + len > r.start + r.len {
            return Err(ErrorKind::OutOfBounds);
        }
        if r.closing > 0 {
            return Err(ErrorKind::InvalidArgument);
        }
        let fenced = self.uses.values().any(|u| {
            u.region == id
                && u.fenced
                && (for_receive || u.writes)
                && Self::overlaps(addr, len, u.addr, u.len)
        });
        if fenced {
            return Err(ErrorKind::Fenced);
        }
        Ok(Some(id))
    }

    fn pick(&self, i: usize) -> Option<RegionId> {
        self.regions
            .keys()
            .nth(i % self.regions.len().max(1))
            .copied()
    }
}

fn kind<T>(r: kvlink_proto::error::Result<T>) -> Result<T, ErrorKind> {
    r.map_err(|e| e.kind)
}

fn run(steps: &[Step]) -> Result<(), TestCaseError> {
    let mut t = Regions::new();
    let mut m = Model::default();
    for s in steps {
        match *s {
            Step::Register { addr, len } => {
                let clash = m
                    .regions
                    .values()
                    .any(|r| Model::overlaps(addr, len, r.start, r.len));
                let got = kind(t.register(addr, len));
                if clash {
                    prop_assert_eq!(got, Err(ErrorKind::InvalidArgument));
                } else {
                    let id = got.expect("a free range registers");
                    prop_assert!(!m.regions.contains_key(&id), "an id was reused");
                    m.regions.insert(
                        id,
                        MRegion {
                            start: addr,
                            len,
                            closing: 0,
                        },
                    );
                }
            }
            Step::Transfer {
                op,
                addr,
                len,
                writes,
                peer,
            } => {
                if m.uses.contains_key(&op) {
                    continue; // op ids are unique while UCX holds the op
                }
                // As the engine does: a receive is checked, a send found; tracked if in a region.
                let got = if writes {
                    t.check(addr, len)
                } else {
                    t.find(addr, len)
                };
                let got = kind(got);
                prop_assert_eq!(
                    got,
                    m.lookup(addr, len, writes),
                    "lookup of {}+{}",
                    addr,
                    len
                );
                if let Ok(Some(region)) = got {
                    t.track(op, peer, writes, region, addr, len).unwrap();
                    m.uses.insert(
                        op,
                        MUse {
                            region,
                            addr,
                            len,
                            writes,
                            peer,
                            fenced: false,
                        },
                    );
                }
            }
            Step::Fence { op } => {
                let known = m.uses.contains_key(&op);
                prop_assert_eq!(t.fence(op), known);
                if let Some(u) = m.uses.get_mut(&op) {
                    u.fenced = true;
                }
            }
            Step::Done { op } => {
                let u = m.uses.remove(&op);
                prop_assert_eq!(t.done(op), u.map(|u| u.region));
            }
            Step::BeginRemove { pick } => {
                let Some(id) = m.pick(pick) else { continue };
                let live = m.uses.values().any(|u| u.region == id && !u.fenced);
                let got = kind(t.begin_remove(id));
                if live {
                    prop_assert_eq!(got, Err(ErrorKind::InvalidArgument));
                } else {
                    let mut peers: Vec<u64> = m
                        .uses
                        .values()
                        .filter(|u| u.region == id)
                        .map(|u| u.peer)
                        .collect();
                    peers.sort_unstable();
                    peers.dedup();
                    prop_assert_eq!(got, Ok(peers));
                    m.regions.get_mut(&id).unwrap().closing += 1;
                }
            }
            Step::FinishRemove { pick } => {
                let Some(id) = m.pick(pick) else { continue };
                let held = m.uses.values().any(|u| u.region == id);
                let got = kind(t.finish_remove(id));
                if held {
                    prop_assert_eq!(got, Err(ErrorKind::Fenced));
                    let r = m.regions.get_mut(&id).unwrap();
                    r.closing = r.closing.saturating_sub(1);
                } else {
                    prop_assert_eq!(got, Ok(()));
                    m.regions.remove(&id);
                }
            }
        }
        check(&t, &m)?;
    }
    Ok(())
}

/// Every counter and every lookup agrees with the model.
fn check(t: &Regions, m: &Model) -> Result<(), TestCaseError> {
    prop_assert_eq!(t.len(), m.regions.len());
    let total: u64 = m.uses.values().filter(|u| u.fenced).map(|u| u.len).sum();
    prop_assert_eq!(t.fenced_bytes(), total);
    for (&id, r) in &m.regions {
        let i = t.info(id).unwrap();
        let uses: Vec<&MUse> = m.uses.values().filter(|u| u.region == id).collect();
        prop_assert_eq!((i.addr, i.len), (r.start, r.len));
        prop_assert_eq!(i.transfers, uses.len());
        prop_assert_eq!(i.fenced_transfers, uses.iter().filter(|u| u.fenced).count());
        prop_assert_eq!(
            i.fenced_bytes,
            uses.iter().filter(|u| u.fenced).map(|u| u.len).sum::<u64>()
        );
        let mut ranges: Vec<(u64, u64)> = uses
            .iter()
            .filter(|u| u.fenced)
            .map(|u| (u.addr - r.start, u.len))
            .collect();
        ranges.sort_unstable();
        prop_assert_eq!(t.fenced_ranges(id).unwrap(), ranges);
    }
    // A sweep of lookups across the space, both kinds.
    for addr in (1..SPACE).step_by(7) {
        for len in [1, 5, 16] {
            prop_assert_eq!(kind(t.check(addr, len)), m.lookup(addr, len, true));
            prop_assert_eq!(kind(t.find(addr, len)), m.lookup(addr, len, false));
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn the_region_table_agrees_with_its_model(steps in prop::collection::vec(step(), 1..80)) {
        run(&steps)?;
    }
}

fn tx(op: u64, addr: u64, len: u64, writes: bool, peer: u64) -> Step {
    Step::Transfer {
        op,
        addr,
        len,
        writes,
        peer,
    }
}

/// A fixed sequence: what the engine does when a frozen sender's receive is fenced, a
/// deregistration times out, and the late data finally lands.
#[test]
fn a_timed_out_deregistration_leaves_the_region_usable() {
    let steps = [
        Step::Register { addr: 16, len: 64 },
        tx(1, 16, 32, true, 2),
        Step::Fence { op: 1 },
        tx(2, 20, 4, true, 2),
        tx(3, 20, 4, false, 2),
        Step::BeginRemove { pick: 0 },
        Step::FinishRemove { pick: 0 },
        tx(4, 60, 4, false, 1),
        Step::Done { op: 1 },
        tx(5, 20, 4, true, 2),
        Step::Done { op: 4 },
        Step::Done { op: 5 },
        Step::BeginRemove { pick: 0 },
        Step::FinishRemove { pick: 0 },
    ];
    run(&steps).unwrap();
}
