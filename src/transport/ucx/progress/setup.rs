//! Starting the progress thread's UCX: the settings an agent forces, the context and its
//! worker, the epoll set, the active-message handlers and the listener.

use super::super::callbacks::{am_bind_cb, am_control_cb, am_drain_cb, conn_cb, AmCb, BATCH_ARG};
use super::super::handles::{Context, Listener, Worker};
use super::super::peers::{close_on_exec_at, sockaddr_of, sockaddr_port};
use super::super::probe::{am_probe_cb, Probe};
use super::super::shared::Shared;
use super::super::{
    resources, sys, ucx_err, AgentOptions, AM_BATCH_ID, AM_BIND_ID, AM_CONTROL_ID, AM_DRAIN_ID,
    AM_PROBE_ID,
};
use super::Progress;
use crate::error::{Error, ErrorKind, Result};
use foldhash::{HashMap, HashMapExt};
use std::collections::VecDeque;
use std::ffi::CString;
use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::os::raw::c_int;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// The UCX settings an agent forces, each with whether a refusal is an error: keepalive (a dead
/// peer is found within about a second when no operation is pending), shared-memory lanes under
/// peer error handling, the tcp send buffer, the transports and the network devices. The
/// transport and devices are checked against what the linked UCX has first. `UCX_TLS`,
/// `UCX_NET_DEVICES`, `UCX_TCP_SNDBUF` and `UCX_KEEPALIVE_INTERVAL` in the environment win over
/// the agent's values (the first two are checked all the same); a setting pushed here is applied
/// after UCX read the environment, so one not skipped would override it.
fn ucx_settings(opts: &AgentOptions) -> Result<Vec<(&'static str, String, bool)>> {
    let mut settings = Vec::new();
    if !env_wins(opts, "UCX_KEEPALIVE_INTERVAL") {
        let keepalive = format!("{}ms", opts.keepalive.as_millis().max(1));
        settings.push(("KEEPALIVE_INTERVAL", keepalive, false));
    }
    // Without MM_ERROR_HANDLING UCX refuses shared-memory lanes (posix, sysv) under peer error
    // handling. UCX 1.13 with both tcp and shared-memory lanes fails every active message over
    // 100 bytes ("Invalid am_short_iov length", measured); 1.22 does not. Below 1.22 (what lies
    // between is untested) a setting that may also use the network leaves it off, and UCX uses
    // the network transports alone, as it always did under peer handling (`mm_lanes`).
    if mm_lanes(opts) {
        settings.push(("MM_ERROR_HANDLING", "y".into(), false));
    } else if opts.transport.may_use_mm() {
        tracing::info!(
            "{}: transport {}: no shared memory next to the network with UCX {} (1.22+ has it)",
            opts.name,
            opts.transport,
            resources::ucx_version()
        );
    }
    // A listener binds its port with SO_REUSEADDR, so that a process that replaces a dead one
    // at the same `ip:port` (or this agent moving to a new worker, `Progress::renew_worker`)
    // can listen while the connections the old listener accepted linger in TIME_WAIT, up to a
    // minute: without it the new engine failed to start for that minute ("UCX Device is busy").
    // Two live listeners on one port are still refused. UCX 1.13 does not take it through the
    // config (it warns, under either name); there the restart waits out TIME_WAIT.
    if opts.listen.is_some() && resources::ucx_minor() >= 22 {
        settings.push(("TCP_CM_REUSEADDR", "y".into(), false));
    }
    // A tcp socket's send buffer, fixed instead of left to the kernel's autotuning (which grows
    // it to megabytes). The rendezvous of a tagged transfer over tcp is a zero-copy put: with a
    // large buffer the kernel takes a whole 1 MiB transfer in one `sendmsg` and queues it at
    // once, which on this host's loopback under BBR pacing reorders and retransmits, and halves
    // the rate BBR then paces at (README, "Loopback tcp and the send buffer"); with 256 KiB
    // the put goes out as the socket drains, as `ucx_perftest`'s fragments do. Measured faster
    // at 1, 16 and 64 MiB. `UCX_TCP_SNDBUF` in the environment wins.
    if opts.transport.may_use_network() && !env_wins(opts, "UCX_TCP_SNDBUF") {
        // UCX 1.13 hands a cached key to a transport's config by the name within its table:
        // `TCP_SNDBUF` is refused there ("invalid configuration"), `SNDBUF` is taken (the tcp
        // interfaces' and the tcp connection manager's). 1.22 takes the full name and refuses
        // the short one (what lies between is untested). The test reads the sockets' buffers.
        let key = if resources::ucx_minor() >= 22 {
            "TCP_SNDBUF"
        } else {
            "SNDBUF"
        };
        settings.push((key, super::super::TCP_SNDBUF.into(), false));
    }
    // UCX's newer protocol selection: on by default from some release up to 1.22, off and
    // experimental in 1.13, where turning it on (`UCX_PROTO_ENABLE=y`) ends the process on the
    // first transfer, over tcp and shared memory alike (`ucs_fatal` in
    // `ucp_wireup_replay_pending_requests`, measured). Below 1.22 (what lies between is
    // untested) the agent keeps it off, whatever the environment says: the one UCX setting
    // from the environment that it overrides, because obeying it means an abort.
    if resources::ucx_minor() < 22 {
        if let Ok(v) = std::env::var("UCX_PROTO_ENABLE") {
            if !matches!(
                v.trim().to_ascii_lowercase().as_str(),
                "n" | "no" | "0" | "off"
            ) {
                tracing::warn!(
                    "{}: UCX_PROTO_ENABLE={v} is left off with UCX {} (its experimental protocols \
                     abort the process there; 1.22 uses them)",
                    opts.name,
                    resources::ucx_version()
                );
            }
        }
        settings.push(("PROTO_ENABLE", "n".into(), false));
    }
    let tls = opts.transport.tls();
    if tls.is_some() || opts.net_devices.is_some() {
        let have = resources::resources()?;
        if let Some(tls) = tls {
            let missing = resources::check_tls(tls, have)?;
            if !missing.is_empty() {
                tracing::warn!(
                    "{}: transports {} are not available in UCX {} here; UCX uses the rest of '{tls}'",
                    opts.name,
                    missing.join(","),
                    resources::ucx_version()
                );
            }
        }
        if let Some(d) = &opts.net_devices {
            resources::check_devices(d, have)?;
        }
    }
    if !env_wins(opts, "UCX_TLS") {
        if let Some(tls) = tls {
            settings.push(("TLS", tls.to_string(), true));
        }
    }
    if let Some(d) = &opts.net_devices {
        if !env_wins(opts, "UCX_NET_DEVICES") {
            settings.push(("NET_DEVICES", d.clone(), true));
        }
    }
    Ok(settings)
}

/// Whether `var` is set in the environment, which then wins over the agent's own value for it
/// (said at info level): the settings above are applied after UCX read the environment, so one
/// pushed anyway would override it.
fn env_wins(opts: &AgentOptions, var: &str) -> bool {
    match std::env::var(var) {
        Ok(env) => {
            tracing::info!("{}: {var}={env} from the environment", opts.name);
            true
        }
        Err(_) => false,
    }
}

/// Whether peers' endpoints may use shared-memory lanes (see `ucx_settings`): by the
/// transport setting, or by `UCX_TLS` in the environment, which wins over it.
fn mm_lanes(opts: &AgentOptions) -> bool {
    let env = std::env::var("UCX_TLS")
        .ok()
        .map(|l| super::super::TransportKind::List(l.trim().to_string()));
    let t = env.as_ref().unwrap_or(&opts.transport);
    t.may_use_mm() && (!t.may_use_network() || resources::ucx_minor() >= 22)
}

/// A worker of `ctx` for one thread at a time (the driver lock's holder).
pub(super) fn new_worker(ctx: &Context) -> Result<Worker> {
    let wparams = sys::ucp_worker_params_t {
        field_mask: sys::UCP_WORKER_PARAM_FIELD_THREAD_MODE as u64,
        thread_mode: sys::UCS_THREAD_MODE_SERIALIZED,
        ..Default::default()
    };
    let mut worker: sys::ucp_worker_h = std::ptr::null_mut();
    // SAFETY: a live context; the params name exactly the field set; the out-pointer is valid.
    let st = unsafe { sys::ucp_worker_create(ctx.0, &wparams, &mut worker) };
    if st != sys::UCS_OK {
        return Err(ucx_err(st, "ucp_worker_create"));
    }
    Ok(Worker(worker))
}

impl Progress {
    pub(super) fn start(
        opts: &AgentOptions,
        shared: Arc<Shared>,
    ) -> Result<(Progress, Option<SocketAddr>)> {
        // SAFETY: all calls below follow the UCX API contracts: parameter structs are zeroed
        // (Default) with field masks naming exactly the fields set; out-pointers are valid;
        // every created handle is owned by `Progress` and destroyed in `teardown`.
        // Every string UCX is given, checked before its configuration is read: an error here
        // has nothing to release (a name or a setting with a NUL in it).
        let cname = CString::new(opts.name.clone())
            .map_err(|_| Error::invalid("agent name contains NUL"))?;
        let settings = ucx_settings(opts)?
            .into_iter()
            .map(
                |(k, v, required)| match (CString::new(k), CString::new(v.as_str())) {
                    (Ok(ck), Ok(cv)) => Ok((k, v, ck, cv, required)),
                    _ => Err(Error::invalid(format!(
                        "UCX setting {k}={v:?} contains NUL"
                    ))),
                },
            )
            .collect::<Result<Vec<_>>>()?;
        unsafe {
            let mut config: *mut sys::ucp_config_t = std::ptr::null_mut();
            let st = sys::ucp_config_read(std::ptr::null(), std::ptr::null(), &mut config);
            if st != sys::UCS_OK {
                return Err(ucx_err(st, "ucp_config_read"));
            }
            for (k, v, ck, cv, required) in &settings {
                let st = sys::ucp_config_modify(config, ck.as_ptr(), cv.as_ptr());
                if st != sys::UCS_OK {
                    if *required {
                        sys::ucp_config_release(config);
                        return Err(Error::invalid(format!(
                            "UCX refused {k}={v}: {}",
                            sys::status_str(st)
                        )));
                    }
                    tracing::debug!("ucp_config_modify({k}={v}): {}", sys::status_str(st));
                }
            }
            let mut params = sys::ucp_params_t {
                field_mask: (sys::UCP_PARAM_FIELD_FEATURES | sys::UCP_PARAM_FIELD_NAME) as u64,
                features: (sys::UCP_FEATURE_TAG
                    | sys::UCP_FEATURE_AM
                    | sys::UCP_FEATURE_RMA
                    | sys::UCP_FEATURE_WAKEUP) as u64,
                ..Default::default()
            };
            params.name = cname.as_ptr();
            let mut ctx: sys::ucp_context_h = std::ptr::null_mut();
            let st = sys::ucp_init_version(
                sys::UCP_API_MAJOR,
                sys::UCP_API_MINOR,
                &params,
                config,
                &mut ctx,
            );
            sys::ucp_config_release(config);
            if st != sys::UCS_OK {
                let e = ucx_err(st, "ucp_init");
                if st == sys::UCS_ERR_NO_DEVICE || st == sys::UCS_ERR_NO_ELEM {
                    // Nothing left after the transport and device selection.
                    return Err(Error::invalid(format!(
                        "{} (transport {}, devices {})",
                        e.message,
                        opts.transport,
                        opts.net_devices.as_deref().unwrap_or("UCX's choice")
                    )));
                }
                return Err(e);
            }
            let ctx = Context(ctx);
            let mut cattr = sys::ucp_context_attr_t {
                field_mask: sys::UCP_ATTR_FIELD_MEMORY_TYPES as u64,
                ..Default::default()
            };
            let st = sys::ucp_context_query(ctx.0, &mut cattr);
            if st != sys::UCS_OK {
                return Err(ucx_err(st, "ucp_context_query"));
            }
            let memory_types = cattr.memory_types;
            shared.memory_types.store(memory_types, Ordering::Release);
            tracing::info!(
                "{}: UCX {} (built against {} at {}), transport {}{}, memory types: {}",
                opts.name,
                resources::ucx_version(),
                env!("KVLINK_UCX_BUILD_VERSION"),
                env!("KVLINK_UCX_BUILD_LIBDIR"),
                opts.transport,
                opts.net_devices
                    .as_deref()
                    .map_or(String::new(), |d| format!("@{d}")),
                resources::memory_type_names(memory_types)
            );
            let worker = new_worker(&ctx)?;
            let mut p = Progress {
                probe: None,
                fail_when_stuck: opts.fail_peers_when_stuck,
                rkeys: HashMap::new(),
                peers: HashMap::new(),
                listener: None,
                maps: HashMap::new(),
                epfd: None,
                worker,
                ctx,
                ep_to_peer: HashMap::new(),
                next_handle: 0,
                drains: Vec::new(),
                scratch: Box::new([0; 8]),
                listen_at: None,
                relisten: None,
                lost_rkeys: Default::default(),
                probe_wanted: mm_lanes(opts),
                name: opts.name.clone(),
                worker_efd: -1,
                discard_unexpected: opts.discard_unexpected,
                shared,
                shutdown: false,
                cb_batch: VecDeque::new(),
                ev_spare: VecDeque::new(),
                stall: None,
                connect_stall: None,
            };
            // From here on, `p.teardown()` releases what exists.
            match p.setup(opts) {
                Ok(listen) => Ok((p, listen)),
                Err(e) => {
                    p.teardown();
                    Err(e)
                }
            }
        }
    }

    unsafe fn setup(&mut self, opts: &AgentOptions) -> Result<Option<SocketAddr>> {
        let epfd = libc::epoll_create1(libc::EPOLL_CLOEXEC);
        if epfd < 0 {
            return Err(Error::new(ErrorKind::Transport, "epoll_create1 failed"));
        }
        // SAFETY: a fresh fd that nothing else owns.
        self.epfd = Some(std::os::fd::FromRawFd::from_raw_fd(epfd));
        let mut ev = libc::epoll_event {
            events: libc::EPOLLIN as u32,
            u64: 2,
        };
        if libc::epoll_ctl(
            epfd,
            libc::EPOLL_CTL_ADD,
            self.shared.wake_fd.as_raw_fd(),
            &mut ev,
        ) != 0
        {
            return Err(Error::new(ErrorKind::Transport, "epoll_ctl failed"));
        }
        self.attach_worker()?;
        match opts.listen {
            Some(addr) => self.listen(addr).map(Some),
            None => Ok(None),
        }
    }

    /// Sets up `self.worker`: its event fd in the epoll set, the active-message handlers, its
    /// address and the receive-queue probe.
    pub(super) unsafe fn attach_worker(&mut self) -> Result<()> {
        let mut efd: c_int = -1;
        let st = sys::ucp_worker_get_efd(self.worker.0, &mut efd);
        if st != sys::UCS_OK {
            return Err(ucx_err(st, "ucp_worker_get_efd"));
        }
        let mut ev = libc::epoll_event {
            events: libc::EPOLLIN as u32,
            u64: 1,
        };
        if libc::epoll_ctl(self.epoll_fd(), libc::EPOLL_CTL_ADD, efd, &mut ev) != 0 {
            return Err(Error::new(ErrorKind::Transport, "epoll_ctl failed"));
        }
        self.worker_efd = efd;
        let am = sys::ucp_am_handler_param_t {
            field_mask: (sys::UCP_AM_HANDLER_PARAM_FIELD_ID
                | sys::UCP_AM_HANDLER_PARAM_FIELD_CB
                | sys::UCP_AM_HANDLER_PARAM_FIELD_ARG) as u64,
            id: AM_CONTROL_ID,
            cb: Some(am_control_cb),
            arg: std::ptr::null_mut(),
            ..Default::default()
        };
        let st = sys::ucp_worker_set_am_recv_handler(self.worker.0, &am);
        if st != sys::UCS_OK {
            return Err(ucx_err(st, "ucp_worker_set_am_recv_handler"));
        }
        for (id, cb, arg) in [
            (AM_DRAIN_ID, am_drain_cb as AmCb, std::ptr::null_mut()),
            (AM_BIND_ID, am_bind_cb as AmCb, std::ptr::null_mut()),
            (AM_PROBE_ID, am_probe_cb as AmCb, std::ptr::null_mut()),
            (AM_BATCH_ID, am_control_cb as AmCb, BATCH_ARG),
        ] {
            let h = sys::ucp_am_handler_param_t {
                id,
                cb: Some(cb),
                arg,
                ..am
            };
            let st = sys::ucp_worker_set_am_recv_handler(self.worker.0, &h);
            if st != sys::UCS_OK {
                return Err(ucx_err(st, "ucp_worker_set_am_recv_handler"));
            }
        }
        let mut attr = sys::ucp_worker_attr_t {
            field_mask: sys::UCP_WORKER_ATTR_FIELD_ADDRESS as u64,
            ..Default::default()
        };
        let st = sys::ucp_worker_query(self.worker.0, &mut attr);
        if st != sys::UCS_OK {
            return Err(ucx_err(st, "ucp_worker_query"));
        }
        let address =
            std::slice::from_raw_parts(attr.address as *const u8, attr.address_length).to_vec();
        sys::ucp_worker_release_address(self.worker.0, attr.address);
        // Handed out sealed (`address.rs`); the probe below dials the raw one itself.
        *self.shared.worker_address.lock() = super::super::address::seal(&address);
        if self.probe_wanted {
            // A new probe counts its pings from 1 again: what an earlier worker read must not
            // count as read here.
            self.shared.probe_seen.store(0, Ordering::Release);
            // Without it the agent works as before; it only cannot tell a stuck queue.
            match Probe::start(self.ctx.0, &address, self.shared.probe_nonce) {
                Ok(p) => self.probe = Some(p),
                Err(e) => tracing::warn!("{}: no shared-memory receive probe: {e}", self.name),
            }
        }
        Ok(())
    }

    /// Listens on `addr` with the worker; returns the bound address (the real port when 0 was
    /// asked for).
    pub(super) unsafe fn listen(&mut self, addr: SocketAddr) -> Result<SocketAddr> {
        let (storage, len) = sockaddr_of(addr);
        let lp = sys::ucp_listener_params_t {
            field_mask: (sys::UCP_LISTENER_PARAM_FIELD_SOCK_ADDR
                | sys::UCP_LISTENER_PARAM_FIELD_CONN_HANDLER) as u64,
            sockaddr: sys::ucs_sock_addr_t {
                addr: &storage as *const libc::sockaddr_storage as *const sys::sockaddr,
                addrlen: len,
            },
            conn_handler: sys::ucp_listener_conn_handler_t {
                cb: Some(conn_cb),
                arg: std::ptr::null_mut(),
            },
            ..Default::default()
        };
        let mut listener: sys::ucp_listener_h = std::ptr::null_mut();
        let st = sys::ucp_listener_create(self.worker.0, &lp, &mut listener);
        if st != sys::UCS_OK {
            return Err(ucx_err(st, &format!("listen on {addr}")));
        }
        self.listener = Some(Listener(listener));
        let mut la = sys::ucp_listener_attr_t {
            field_mask: sys::UCP_LISTENER_ATTR_FIELD_SOCKADDR as u64,
            ..Default::default()
        };
        let st = sys::ucp_listener_query(listener, &mut la);
        if st != sys::UCS_OK {
            return Err(ucx_err(st, "ucp_listener_query"));
        }
        let port = sockaddr_port(
            &la.sockaddr as *const sys::sockaddr_storage as *const libc::sockaddr_storage,
        );
        let bound = SocketAddr::new(addr.ip(), port);
        close_on_exec_at(bound);
        self.listen_at = Some(bound);
        Ok(bound)
    }
}
