//! A worker address as kvlink hands it out: UCX's packed address, sealed with its length and a
//! checksum (`proto::worker_address`, where the fuzz targets reach its decoder), so that one
//! that was cut short, mistyped or made up is refused as `InvalidArgument` before it reaches
//! `ucp_ep_create`, which asserts on what it cannot read. A packed remote key alike, before
//! `ucp_ep_rkey_unpack`.
pub(super) use crate::proto::worker_address::{open, open_rkey, seal, seal_rkey};
