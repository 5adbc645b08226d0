//! kvlink moves a KV cache between the context and generation engines of disaggregated LLM
//! serving, with every wait bounded and every request ending in exactly one typed outcome.
//!
//! The picture, from the wire up:
//! - [`proto`] (the crate `kvlink-proto`, with [`error`]): the sans-IO protocol core. Request
//!   identity (64-bit id + generation), the versioned wire codec, the request state machine,
//!   cross-rank cancel agreement, buffer pool accounting. Time is an argument; no I/O, no
//!   threads, no `unsafe`.
//! - [`transport`]: moving bytes. `transport::ucx` is the only module with `unsafe` and the only
//!   one that calls UCX: an agent (worker + progress thread sleeping on the worker's event fd),
//!   endpoints with explicit failed state, tag-matched transfers whose completion is the data's
//!   arrival.
//! - [`memory`]: host and CUDA regions (address, length, kind), never dereferenced.
//! - [`engine`]: the blocking `send` / `recv` / `wait` surface: thin glue that feeds the core
//!   what the transport reports, carries out what the core asks and wakes the one caller each
//!   fact concerns; peers that fail are dialled again. ([`connection`] is its former path.)
//! - `bridge`: the only file that knows cxx; declarations and one-line forwarders behind one
//!   panic boundary.
pub mod config;
pub mod connection;
pub mod engine;
pub mod log;
pub mod memory;
pub mod metrics;
pub mod metrics_http;
pub mod timeline;
pub mod transport;

pub use kvlink_proto as proto;
pub use kvlink_proto::error;

mod api;
mod boundary;
mod bridge;
mod random;

pub use error::{Error, ErrorKind, Outcome, Result};
