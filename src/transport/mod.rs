//! Moving bytes. [`ucx`] is the real transport (and the only `unsafe` UCX code).
pub mod cuda;
pub mod ucx;

pub use ucx::{
    memory_type_names, Agent, AgentOptions, DevicePath, Event, EventSink, MemHandle, Op, PeerId,
    RemoteKey, Stats, TransportKind,
};
