//! The sans-IO protocol core. No I/O, no threads, no clock reads: time is an argument, inputs
//! are `handle_*` calls, outputs are drained with `poll_*`.
//!
//! # The data path of one request
//! 1. The generation rank leases receive buffers from its [`BufferPool`], gives each a fresh
//!    [`Token`] (its UCX tag, from a [`TokenAllocator`]), posts the tag-matched receives, and
//!    calls [`Endpoint::start_receive`]. The endpoint queues an [`Message::Advertise`] per
//!    context rank (request info + that rank's [`BufferDesc`]s).
//! 2. The context rank's endpoint turns the advertisement into [`Event::Advertised`]; the
//!    application answers with [`Endpoint::accept`] (`Ready { ready }` goes back). On accept the
//!    endpoint asks for one tag-matched send per descriptor ([`Action::Send`]); the driver
//!    reports each with [`Endpoint::handle_send_done`].
//! 3. Data arrives as the completion of the generation rank's posted receive: the driver calls
//!    [`Endpoint::handle_segment_landed`]. There is no separate "done" message to lose. When
//!    every segment has landed the rank votes `Completed`.
//! 4. The receivers agree on a verdict ([`agreement`]); each receiver forwards it to its senders,
//!    who abort what is still in flight (if the verdict is a failure) and confirm with
//!    `Quiesced`.
//! 5. A receiver releases a buffer only when its posted receive is finished: it landed, or it
//!    was cancelled ([`Action::CancelReceive`]) and reaped
//!    ([`Endpoint::handle_receive_reaped`]). Whatever is still posted at the agreement bound is
//!    fenced ([`Action::Fence`]): its registration is invalidated rather than the memory reused.
//!    Then [`Event::Terminal`] reports exactly one [`Outcome`](crate::error::Outcome).
//!
//! A sender's `Quiesced` alone does not free a buffer: an eager send completes locally before
//! its data arrives, and a confirmation can overtake data on a reordering network. The posted
//! receive is the only local proof that nothing more can land.
//!
//! Every non-terminal state has a deadline; [`Endpoint::poll_timeout`] says when to call
//! [`Endpoint::handle_timeout`], which is all cleanup needs: it never waits for new requests.
//!
//! The per-peer facts live here too: [`peers`] binds ranks to transport endpoints after the
//! [`handshake`], refuses a second process with a live rank, closes endpoints that never finish
//! their handshake, and runs the reconnect policy (which ranks to dial again, when, and when to
//! give up). The engine only carries out what it says.
#![forbid(unsafe_code)]

pub mod agreement;
pub mod auth;
pub mod batch;
mod early;
pub mod endpoint;
pub mod error;
pub mod handshake;
pub mod id;
mod lowest;
pub mod peers;
pub mod pool;
pub mod regions;
pub mod request;
mod timers;
mod vecmap;
pub mod wire;
pub mod worker_address;

pub use agreement::{reduce, Collective};
pub use auth::{Secret, SessionKey, TagKey};
pub use early::EARLY_KEEP;
pub use endpoint::{Endpoint, ReceiveFlow, ReceiveSpec};
pub use handshake::{Handshake, Identity, PeerInfo, Step};
pub use id::{Generation, RankId, RequestId, RequestKey, Token, TokenAllocator};
pub use pool::{BufferId, BufferPool, Lease};
pub use regions::{RegionId, RegionInfo, Regions};
pub use request::{Action, Config, Event, Role, Stats, Transmit};
pub use wire::{BufferDesc, BufferKind, Message, Refusal, WireError, WireReason};
