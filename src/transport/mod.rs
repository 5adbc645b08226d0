//! Moving bytes. [`ucx`] is the real transport (and the only `unsafe` UCX code).
pub mod cuda;
pub mod ucx;

pub use ucx::{Agent, AgentOptions, Event, Op, PeerId, Stats, TransportKind};
