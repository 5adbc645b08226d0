//! Cross-rank agreement on one request's verdict.
//!
//! Every rank that takes part in a request ends with the same [`Outcome`]. The default agreement
//! runs over kvlink's own control messages:
//!
//! ```text
//!   sender ranks --Ready(false) / Vote--> their receiver ranks --Vote--> coordinator
//!   coordinator --Verdict--> receiver ranks --Verdict--> their sender ranks --Quiesced--> receivers
//! ```
//! The coordinator is the lowest-numbered receiver rank of the request. It decides as soon as one
//! vote is a failure (the verdict can no longer be `Completed`), when every receiver has voted
//! `Completed`, or at its own deadline (`TimedOut`). Receivers retransmit their vote until the
//! verdict arrives; the coordinator answers every vote, so no verdict needs an acknowledgement
//! from a receiver. Receivers retransmit the verdict to their senders until each confirms with
//! `Quiesced` (all its sends for the request finished or aborted).
//!
//! The agreement is bounded: a rank with no verdict at `deadline + agreement_bound` ends
//! `PeerLost`, and every buffer that a peer might still write is fenced rather than reused. A
//! rank whose coordinator is reported lost ends `PeerLost` at once. Only then can two live ranks
//! disagree (one may have seen the coordinator's verdict before it died), and both sides of that
//! disagreement have already stopped every write.
//!
//! Deployments that already run a collective over the receiver ranks (TensorRT-LLM's allgather
//! over MPI or a Torch process group) plug it in through [`Collective`]; the verdict is then
//! [`reduce`] of every receiver's vote, and the receiver -> sender leg still runs over messages.
use super::id::{RankId, RequestKey};
use crate::error::Outcome;
use std::time::Instant;

/// How bad an outcome is; the verdict of a set of votes is the worst of them.
pub fn severity(outcome: Outcome) -> u8 {
    match outcome {
        Outcome::Completed => 0,
        Outcome::Rejected => 1,
        Outcome::Cancelled => 2,
        Outcome::TimedOut => 3,
        Outcome::PeerLost => 4,
    }
}

/// The verdict of a set of votes: `Completed` only when every vote is `Completed` (and there is
/// at least one), else the most severe failure.
pub fn reduce<I: IntoIterator<Item = Outcome>>(votes: I) -> Outcome {
    let mut verdict = None;
    for v in votes {
        verdict = Some(match verdict {
            None => v,
            Some(w) if severity(v) > severity(w) => v,
            Some(w) => w,
        });
    }
    verdict.unwrap_or(Outcome::PeerLost)
}

/// An external collective over the receiver ranks of a request, used instead of the default
/// message agreement. Sans-IO like the rest of the core: `contribute` must not block; the
/// verdict is picked up later through `poll_verdict`, which the endpoint calls on every input and
/// every tick. An implementation must give every rank of `group` the same verdict, normally
/// [`reduce`] of all contributions. If it never answers, the endpoint's agreement bound still
/// ends the request (`PeerLost`, fenced buffers).
pub trait Collective: Send {
    /// This rank's vote for `key`. Called at most once per key and rank. `group` is every
    /// receiver rank of the request, sorted, `me` among them.
    fn contribute(
        &mut self,
        now: Instant,
        key: RequestKey,
        group: &[RankId],
        me: RankId,
        vote: Outcome,
    );
    /// The agreed verdict for `key`, once there is one.
    fn poll_verdict(&mut self, key: RequestKey) -> Option<Outcome>;
    /// The endpoint no longer needs `key` (it may drop any state for it).
    fn forget(&mut self, key: RequestKey) {
        let _ = key;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reduce_is_worst_vote() {
        use Outcome::*;
        assert_eq!(reduce([Completed, Completed]), Completed);
        assert_eq!(reduce([Completed, Rejected, Cancelled]), Cancelled);
        assert_eq!(reduce([TimedOut, Completed, Cancelled]), TimedOut);
        assert_eq!(reduce([PeerLost, TimedOut]), PeerLost);
        assert_eq!(reduce([]), PeerLost);
    }
}
