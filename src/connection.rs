//! The engine's former path, kept so `kvlink::connection::*` keeps compiling: see
//! [`crate::engine`].
pub use crate::engine::{
    Advertisement, BufferSpec, Engine, EngineConfig, Faults, Health, HealthState, PeerState,
    LONGEST_WAIT, MAX_POOL_SLOTS,
};
