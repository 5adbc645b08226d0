//! Control messages to one peer sent together while UCX holds an earlier one queued.
//!
//! When a peer's receive queue is full (a burst of advertisements outruns the peer; a shared
//! memory queue has 64 slots), UCX keeps each further message in its own request on its pending
//! queue, and each costs a request, an entry in `Shared::queued_msgs`, a dispatch and a
//! callback on this side and a queue slot and a callback on the peer's. While an earlier
//! message to a peer is held, the next ones wait in a batch of the peer's own instead
//! (`PeerEntry::batch`), which goes as one active message once the peer has no held message
//! left, or when the next message would take it past [`BATCH_MAX`]. Messages keep their order:
//! a message to the same peer that is not batched (a drain, a bind, a waited control message)
//! sends the batch first.
//! A peer whose queue has room meets no batch: each message goes in the call, as before.
//!
//! The batch's format is the protocol core's (`proto::batch`, where the fuzz targets reach its
//! decoder). The receiver hands the messages on one by one ([`split`]); a batch that does not
//! split exactly is dropped whole and counted (`Stats::control_malformed`). A kvlink before
//! batches has no handler for their active message and would lose them without a word, under
//! load only: wire version 4 (`proto::wire::VERSION`) marks the peers that take them, and a
//! version 3 peer's `Hello` is answered with the version refusal
//! (`proto::wire::Refusal::WireVersion`, logged with its version), so such a pair never
//! connects.
pub(super) use crate::proto::batch::{fits, push, split, BATCH_MAX, MSG_MAX};
