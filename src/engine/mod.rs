//! The blocking engine: one rank's `send` / `recv` / `wait` surface over the protocol core and
//! the UCX agent.
//!
//! One [`Engine`] per rank: a UCX [`Agent`], the sans-IO [`Endpoint`] that owns every request
//! and its timers, and the glue (`glue.rs`) that feeds the endpoint what the agent reports and
//! carries out what it asks. The glue runs where the events arrive (an
//! [`crate::transport::EventSink`], called in the agent's progress pass), and the progress thread
//! sleeps no later than the endpoint's next timer: there is no engine thread of its own. Callers
//! block in `wait`, `recv_ready`, `next_advertisement`, `wait_for_notification`, `connect` and
//! `send`, each with a deadline and an optional cancel check. For a short window after the last
//! progress a blocked caller runs the progress pass itself
//! ([`Agent::driving`](crate::transport::Agent::driving)), so the event it
//! waits for is handled on its own thread; after that it sleeps on a waiter of its own that is
//! woken only for the fact it waits for (`waiters.rs`). No lock is held across a wait, one thread
//! at a time drives an agent, and no thread polls longer than one window past the last progress.
//!
//! # The data path of one request
//! 1. generation rank: [`Engine::advertise`] posts one tag-matched receive per buffer (tag = a
//!    fresh 64-bit token) and starts the request in the endpoint, which sends `Advertise` with
//!    what is left of the request's deadline;
//! 2. context rank: [`Engine::next_advertisement`] returns it (with the deadline the sender now
//!    shares); [`Engine::accept`] answers `Ready`; [`Engine::send_segments`] posts the sends of
//!    its segments together under their tokens and waits for them once;
//! 3. generation rank: each receive's own completion is its segment landing; when all have
//!    landed the ranks agree and [`Engine::wait`] returns `Completed` on both sides.
//!
//! # The deadline rule
//! Every blocking call returns by its deadline plus the agreement bound (50 ms by default) plus
//! a few milliseconds, whatever the peer does. A request's own deadline (the engine's timeout,
//! or [`Engine::advertise_with`]'s) ends it on every rank: at that deadline each rank votes
//! `TimedOut`, the ranks agree within the bound if they can talk, and each rank's receives are
//! cancelled before the end is reported, so the buffers handed back are never written again
//! (outside the fenced ranges of a region, below). If
//! UCX cannot recall a transfer (a receive whose data was already matched, a send its receiver
//! does not drain): in a region ([`Engine::register_region`]) the call returns at once and
//! the transfer is left to UCX, its range fenced until UCX releases it, and no endpoint is
//! closed; in plain caller memory its endpoint is force-closed (the pair reconnects) and the
//! call waits the few milliseconds UCX takes to release it. The one wait past the rule: that
//! close runs on the progress thread between UCX calls, and until it has run UCX may still
//! move the memory's bytes, so the call waits for it ([`crate::transport::ucx::CLOSE_RUN_LIMIT`],
//! 2 s, at most; one UCX call took 92 ms pushing a rendezvous after a SIGSTOP).
//! A caller's own earlier deadline (or its cancel flag) gives up on the request the same way.
//! Without a verdict by the bound a rank reports its own failure (`TimedOut`, `Cancelled`,
//! `Rejected`), or `PeerLost` when the transport reported the peer lost; it never reports
//! `Completed` without the verdict, so a sender's `Completed` implies its receiver's.
mod aged;
mod connect;
pub(crate) mod glue;
mod health;
mod notify;
mod reach;
mod receive;
mod regions;
mod send;
mod types;
mod wait;
mod waiters;

pub use crate::proto::peers::PeerState;
pub use crate::proto::regions::{RegionId, RegionInfo};
pub(crate) use connect::dial;
use connect::worker_address_text;
pub use types::{
    Advertisement, BufferSpec, EngineConfig, Faults, Health, HealthState, LONGEST_WAIT,
    MAX_POOL_SLOTS,
};

use crate::error::{Error, ErrorKind, Result};
use crate::proto::{Config, Endpoint, Identity, RankId, RequestKey, Secret};
use crate::transport::{Agent, AgentOptions, TransportKind};
use glue::{Core, Inner};
use parking_lot::Mutex;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long a stopped send waits for its receiver to drain it before the endpoint is
/// force-closed, at most (never longer than the agreement bound: [`reap_grace`]). A live
/// receiver drains in about 2 ms on loopback, but more than 20 ms on two busy cores: with 20
/// here, a cancel storm run twice at once (`tests/engine_storms.rs`) force-closed the pair's
/// endpoint in most runs, failing every request on it; with 50, in none of sixteen.
const REAP_GRACE: Duration = Duration::from_millis(50);

/// [`REAP_GRACE`], within the agreement bound: a send stopped at its deadline then returns by
/// the deadline plus the bound plus the force-close, as the deadline rule says.
fn reap_grace(agreement_bound: Duration) -> Duration {
    REAP_GRACE.min(agreement_bound)
}

/// One rank: agent, protocol core, driver thread. Dropping it tells every bound rank that it
/// leaves (`Message::Leaving`: their requests with it end `PeerLost` at once), lets its last
/// control messages go and waits for each told rank's answer (up to 200 ms in all), then stops
/// the driver and the agent (which cancels and reaps every op).
pub struct Engine {
    inner: Arc<Inner>,
    timeout: Duration,
    /// Where peers reach this rank's listener (`reach.rs`): its bound address, or for a
    /// wildcard `0.0.0.0` one an address of this host's interfaces in its place.
    published: Option<SocketAddr>,
}

fn key_err(kind: ErrorKind, key: RequestKey, what: &str) -> Error {
    Error::new(kind, format!("{key}: {what}"))
}

/// Whether `KVLINK_STUCK` asks for report-only mode: `report` (spaces around it aside) is yes;
/// unset, empty or only spaces is no; anything else is an `InvalidArgument` naming the variable.
fn stuck_report_only() -> Result<bool> {
    match std::env::var_os("KVLINK_STUCK") {
        None => Ok(false),
        Some(v) => match v.to_str().map(str::trim) {
            Some("report") => Ok(true),
            Some("") => Ok(false),
            _ => Err(Error::invalid(format!(
                "KVLINK_STUCK={v:?}: the one value is report (only report a stuck receive \
                 queue); unset it for the default"
            ))),
        },
    }
}

impl Engine {
    pub fn new(mut cfg: EngineConfig) -> Result<Engine> {
        for d in [
            &mut cfg.timeout,
            &mut cfg.agreement_bound,
            &mut cfg.linger,
            &mut cfg.wedge_window,
            &mut cfg.degraded_window,
        ] {
            *d = (*d).min(LONGEST_WAIT);
        }
        if cfg.timeout.is_zero() {
            return Err(Error::invalid("timeout must be positive"));
        }
        // The handshake carries the name, and a peer refuses a `Hello` without one or with a
        // longer one: before, such an engine started, and every connect to or from it failed
        // (at once as a bad frame, or at its deadline on the other side).
        if cfg.name.is_empty() || cfg.name.len() > crate::proto::wire::MAX_NAME {
            return Err(Error::invalid(format!(
                "the engine's name must be 1 to {} bytes, not {}",
                crate::proto::wire::MAX_NAME,
                cfg.name.len()
            )));
        }
        if cfg.pool_slots == 0 || cfg.pool_slots > MAX_POOL_SLOTS {
            return Err(Error::invalid(format!(
                "pool_slots must be 1 to {MAX_POOL_SLOTS}, not {}",
                cfg.pool_slots
            )));
        }
        let shared_memory = cfg.transport.may_use_mm();
        // The devices UCX runs with: its own variable wins over the setting (`setup.rs`).
        let devices = std::env::var("UCX_NET_DEVICES")
            .ok()
            .filter(|d| !d.trim().is_empty())
            .or_else(|| cfg.net_devices.clone());
        // This host's interfaces, read once: what a listener is checked against and published at.
        let ifaces = match cfg.listen {
            Some(_) => reach::interfaces(),
            None => Vec::new(),
        };
        if let (TransportKind::Tcp, Some(listen)) = (&cfg.transport, cfg.listen) {
            if let Some(on) = reach::listen_outside_devices(listen, devices.as_deref(), &ifaces) {
                return Err(Error::invalid(format!(
                    "listen address {listen} is on {on}, which the transport's devices '{}' \
                     leave out: peers would reach the listener but have no tcp lane to this \
                     side (listen at 0.0.0.0, or at an address of a device the list takes)",
                    devices.as_deref().unwrap_or_default()
                )));
            }
        }
        let mut opts = AgentOptions::new(cfg.name.clone(), cfg.transport);
        opts.listen = cfg.listen;
        opts.net_devices = cfg.net_devices;
        opts.reap_grace = reap_grace(cfg.agreement_bound);
        // Every receive is posted before data under its tag can be taken in (it goes out right
        // after its advertisement, before any progress pass: `Agent::hold`): anything unmatched
        // is from someone the buffer was not offered to (or too late), and is discarded.
        opts.discard_unexpected = true;
        // `KVLINK_STUCK=report` turns the action off where the config cannot be reached (the
        // TensorRT-LLM wrapper builds its own).
        // Any other value is refused rather than run as if unset (the action a `KVLINK_STUCK=
        // Report` or `=1` meant to turn off would still fail every peer).
        let report_only = stuck_report_only()?;
        opts.fail_peers_when_stuck = cfg.fail_peers_when_stuck && !report_only;
        let secret = match cfg.secret {
            Some(s) => Secret::new(s),
            // The variable's bytes as they are: a secret need not be UTF-8, and one that is not
            // must not read as "no secret" (`std::env::var` fails on it).
            None => Secret::new(
                std::env::var_os("KVLINK_SECRET")
                    .map(std::os::unix::ffi::OsStringExt::into_vec)
                    .unwrap_or_default(),
            ),
        };
        crate::log::init();
        let agent = Agent::new(opts)?;
        let published = agent.listen_address().map(|bound| {
            let (at, from) = reach::published(bound, devices.as_deref(), &ifaces);
            if at != bound {
                tracing::info!(
                    "{}: listening at {bound}; peers are told {at} (interface {}): listen at \
                     an address, or name the transport's devices, to choose another",
                    cfg.name,
                    from.as_deref().unwrap_or("none up: this host only")
                );
            }
            at
        });
        let me = RankId(cfg.rank);
        let config = Config {
            timeout: cfg.timeout,
            agreement_bound: cfg.agreement_bound,
            linger: cfg.linger,
            ..Config::default()
        };
        let identity = Identity {
            rank: me,
            name: cfg.name.clone(),
            instance: cfg.faults.instance.unwrap_or_else(crate::random::u64),
            secret,
        };
        let inner = Arc::new(Inner {
            agent,
            me,
            name: cfg.name,
            identity,
            faults: cfg.faults,
            agreement_bound: cfg.agreement_bound,
            windows: (cfg.wedge_window, cfg.degraded_window),
            core: Mutex::new(Core::new(Endpoint::new(me, config), cfg.pool_slots)),
            stopping: AtomicBool::new(false),
            metrics: crate::metrics::Metrics::new(),
            shared_memory,
            held_wakes: Default::default(),
        });
        inner
            .agent
            .set_sink(Arc::new(glue::Sink(Arc::downgrade(&inner))));
        Ok(Engine {
            inner,
            timeout: cfg.timeout,
            published,
        })
    }

    pub fn rank(&self) -> RankId {
        self.inner.me
    }

    /// The instance nonce this engine drew at start (given to every peer in the handshake).
    pub fn instance(&self) -> u64 {
        self.inner.identity.instance
    }

    /// The engine's name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// How CUDA memory can move with the linked UCX, asked of it at start: `Direct` when it
    /// supports CUDA memory, else `Staged` (see [`crate::transport::DevicePath`]).
    pub fn device_path(&self) -> crate::transport::DevicePath {
        self.inner.agent.device_path()
    }
}

/// How long dropping an engine waits for its last control messages (a verdict just decided, and
/// the `Leaving` that tells each bound peer it goes) to leave and for each told peer to answer
/// (or fail), so a peer is not left to find a closed endpoint instead of the verdict or the
/// leave. A frozen or unreachable peer costs the drop this much; an answering one a round trip.
/// Meanwhile the engine takes no new connection (`Core::leaving`): one bound now would be
/// closed at the drain's end without a `Leaving`.
const DRAIN_ON_DROP: Duration = Duration::from_millis(200);

impl Drop for Engine {
    fn drop(&mut self) {
        let until = Instant::now() + DRAIN_ON_DROP;
        {
            // Its `Leaving` goes with the last control messages, drained below.
            let mut core = self.inner.core.lock();
            self.inner.say_leaving(&mut core);
        }
        loop {
            let pending = {
                let mut core = self.inner.core.lock();
                core.control_ops.retain_mut(|op| op.poll().is_none());
                !core.control_ops.is_empty() || core.leave_unanswered()
            } || self.inner.agent.push_pending();
            if !pending || Instant::now() >= until {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        self.inner.stopping.store(true, Ordering::Release);
        self.inner.core.lock().waiters.wake_all();
        // Stop the progress thread (where the core's sink runs) while this engine still owns
        // the agent, so the sink is never the one to drop it.
        self.inner.agent.shutdown();
    }
}
