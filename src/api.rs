//! The C++-facing API in plain Rust: argument checks and conversions between the bridge's
//! flat types and the engine's. `bridge.rs` declares these for cxx and forwards to them; every
//! entry point runs inside the panic boundary ([`guard`]).
//!
//! Conventions at this boundary: durations are relative milliseconds (each call computes its
//! own deadline at entry); outcomes that are not faults are returned as `Outcome` codes; faults
//! are errors with stable kinds; a cancel flag is the address of a C++ `std::atomic<bool>`
//! (0 for none) that the call polls every 5 ms while it waits.
#![deny(unsafe_op_in_unsafe_fn)]

use crate::boundary::guard;
use crate::bridge::ffi::{
    AdvertInfo, BufferInfo, EngineOptions, HealthInfo, NotificationInfo, RegionStatus,
};
use crate::engine::{BufferSpec, Engine, EngineConfig, RegionId};
use crate::error::{Error, Outcome, Result};
use crate::proto::{BufferKind, RankId, RequestKey, Role};
use crate::transport::TransportKind;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// One rank's engine, owned by C++ through `rust::Box`.
pub struct EngineHandle {
    /// Dropped by hand, inside the panic boundary (`Drop` below).
    engine: std::mem::ManuallyDrop<Engine>,
}

impl Drop for EngineHandle {
    /// cxx runs a `rust::Box`'s drop under a guard that aborts the process on a panic: the
    /// engine's drop (its last messages, the progress thread's stop) runs where a panic is
    /// caught and logged instead, however unlikely, since C++ destroys an engine after an
    /// `ErrorKind::Panic` too.
    fn drop(&mut self) {
        // SAFETY: taken once, here, and never used again: the handle is going.
        let engine = unsafe { std::mem::ManuallyDrop::take(&mut self.engine) };
        if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drop(engine))).is_err() {
            tracing::error!("a panic while an engine was dropped was caught at the C++ boundary");
        }
    }
}

/// The longest wait this boundary passes on: a year ([`crate::connection::LONGEST_WAIT`]). A
/// C++ `time_point::max()` lands here.
const MAX_MS: u64 = crate::connection::LONGEST_WAIT.as_millis() as u64;

pub(crate) fn deadline(timeout_ms: u64) -> Instant {
    // Saturate far in the future rather than overflow: "no bound" is never offered.
    Instant::now() + Duration::from_millis(timeout_ms.min(MAX_MS))
}

/// A cancel check over a C++ `std::atomic<bool>` at `addr` (none when 0).
///
/// # Safety
/// `addr` must be 0 or the address of a live, suitably aligned `std::atomic<bool>` (one byte,
/// layout-compatible with `AtomicBool` on the supported ABIs) for the duration of the call.
unsafe fn cancel_flag<'a>(addr: usize) -> Option<&'a AtomicBool> {
    // SAFETY: guaranteed by the caller, as above.
    (addr != 0).then(|| unsafe { AtomicBool::from_ptr(addr as *mut bool) })
}

/// The engine's form of a cancel check: none, or a read of the flag.
fn cancel_check(flag: Option<&AtomicBool>) -> Option<Box<dyn Fn() -> bool + '_>> {
    flag.map(|f| Box::new(move || f.load(Ordering::Acquire)) as Box<dyn Fn() -> bool>)
}

pub fn engine_new(o: &EngineOptions) -> Result<Box<EngineHandle>> {
    guard(|| {
        let (transport, net_devices) = TransportKind::parse_setting(&o.transport)?;
        let mut cfg = EngineConfig::new(o.name.clone(), o.rank, transport);
        cfg.net_devices = net_devices;
        if !o.listen.is_empty() {
            cfg.listen = Some(crate::config::parse_listen_address(&o.listen)?);
        }
        if o.timeout_ms == 0 {
            return Err(Error::invalid("timeout_ms must be positive"));
        }
        cfg.timeout = Duration::from_millis(o.timeout_ms);
        if o.agreement_ms > 0 {
            cfg.agreement_bound = Duration::from_millis(o.agreement_ms);
        }
        if o.has_linger {
            cfg.linger = Duration::from_millis(o.linger_ms);
        }
        if o.wedge_ms > 0 {
            cfg.wedge_window = Duration::from_millis(o.wedge_ms);
        }
        if o.degraded_ms > 0 {
            cfg.degraded_window = Duration::from_millis(o.degraded_ms);
        }
        if o.has_secret {
            cfg.secret = Some(o.secret.clone());
        }
        cfg.faults.suppress_data_of_request =
            (o.fault_suppress_request >= 0).then_some(o.fault_suppress_request as u64);
        Ok(Box::new(EngineHandle {
            engine: std::mem::ManuallyDrop::new(Engine::new(cfg)?),
        }))
    })
}

fn outcome_code(o: Outcome) -> u8 {
    o as u8
}

impl EngineHandle {
    pub fn address(&self) -> Result<String> {
        guard(|| Ok(self.engine.address()))
    }

    pub fn rank(&self) -> u32 {
        self.engine.rank().0
    }

    pub fn connect(&self, address: &str, timeout_ms: u64) -> Result<u32> {
        guard(|| Ok(self.engine.connect(address, deadline(timeout_ms))?.0))
    }

    pub fn wait_peer(&self, rank: u32, timeout_ms: u64) -> Result<()> {
        guard(|| self.engine.wait_peer(RankId(rank), deadline(timeout_ms)))
    }

    /// # Safety
    /// Every buffer must be writable host memory, untouched by others until `wait` for the
    /// request (as receiver) has returned.
    pub unsafe fn advertise(
        &self,
        request: u64,
        generation: u32,
        receivers: &[u32],
        sender: u32,
        buffers: &[BufferInfo],
        request_info: &[u8],
    ) -> Result<()> {
        let senders = vec![sender; buffers.len()];
        // SAFETY: the caller's promise is the same.
        unsafe {
            self.advertise_flows(
                request,
                generation,
                receivers,
                &senders,
                buffers,
                request_info,
                0,
            )
        }
    }

    /// One request filled by several context ranks: `senders[i]` sends `buffers[i]`.
    ///
    /// # Safety
    /// As for [`EngineHandle::advertise`].
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn advertise_flows(
        &self,
        request: u64,
        generation: u32,
        receivers: &[u32],
        senders: &[u32],
        buffers: &[BufferInfo],
        request_info: &[u8],
        timeout_ms: u64,
    ) -> Result<()> {
        guard(|| {
            if senders.len() != buffers.len() {
                return Err(Error::invalid(format!(
                    "{} senders for {} buffers: give one sender per buffer",
                    senders.len(),
                    buffers.len()
                )));
            }
            let mut flows: Vec<(RankId, Vec<BufferSpec>)> = Vec::new();
            for (b, &sender) in buffers.iter().zip(senders) {
                let spec = BufferSpec {
                    kind: BufferKind::from_u8(b.kind)
                        .ok_or_else(|| Error::invalid(format!("unknown buffer kind {}", b.kind)))?,
                    segment: b.segment,
                    addr: b.addr,
                    len: b.len,
                    device_id: b.device_id,
                };
                match flows.iter_mut().find(|(r, _)| r.0 == sender) {
                    Some((_, specs)) => specs.push(spec),
                    None => flows.push((RankId(sender), vec![spec])),
                }
            }
            let mut receivers: Vec<RankId> = receivers.iter().map(|&r| RankId(r)).collect();
            if receivers.is_empty() {
                receivers.push(self.engine.rank());
            }
            let key = RequestKey::new(request, generation);
            let timeout = (timeout_ms > 0).then(|| Duration::from_millis(timeout_ms.min(MAX_MS)));
            // SAFETY: the caller's promise above is the engine's.
            unsafe {
                self.engine
                    .advertise_with(key, receivers, flows, request_info.to_vec(), timeout)
            }
        })
    }

    /// # Safety
    /// `cancel` as for [`cancel_flag`].
    pub unsafe fn next_advertisement(&self, timeout_ms: u64, cancel: usize) -> Result<AdvertInfo> {
        // SAFETY: forwarded caller promise.
        let flag = unsafe { cancel_flag(cancel) };
        guard(|| {
            let check = cancel_check(flag);
            Ok(
                match self
                    .engine
                    .next_advertisement(deadline(timeout_ms), check.as_deref())
                {
                    None => AdvertInfo {
                        found: false,
                        ..AdvertInfo::default()
                    },
                    Some(a) => AdvertInfo {
                        found: true,
                        request: a.key.request.0,
                        generation: a.key.generation.0,
                        from_rank: a.from.0,
                        deadline_ms: a
                            .deadline
                            .saturating_duration_since(Instant::now())
                            .as_millis() as u64,
                        request_info: a.request_info,
                        buffers: a
                            .buffers
                            .iter()
                            .map(|d| BufferInfo {
                                kind: d.kind as u8,
                                segment: d.segment,
                                addr: d.addr,
                                len: d.len,
                                device_id: d.device_id,
                                token: d.token.0,
                            })
                            .collect(),
                    },
                },
            )
        })
    }

    pub fn accept(&self, request: u64, generation: u32, from_rank: u32, ready: bool) -> Result<()> {
        guard(|| {
            self.engine.accept(
                RequestKey::new(request, generation),
                RankId(from_rank),
                ready,
            )
        })
    }

    /// -1: no answer by the deadline (or cancelled); 0: rejected; 1: ready.
    ///
    /// # Safety
    /// `cancel` as for [`cancel_flag`].
    pub unsafe fn recv_ready(
        &self,
        request: u64,
        generation: u32,
        timeout_ms: u64,
        cancel: usize,
    ) -> Result<i8> {
        // SAFETY: forwarded caller promise.
        let flag = unsafe { cancel_flag(cancel) };
        guard(|| {
            let check = cancel_check(flag);
            Ok(
                match self.engine.recv_ready(
                    RequestKey::new(request, generation),
                    deadline(timeout_ms),
                    check.as_deref(),
                )? {
                    None => -1,
                    Some(false) => 0,
                    Some(true) => 1,
                },
            )
        })
    }

    /// # Safety
    /// `data..data+len` must be readable for the duration of the call; `cancel` as for
    /// [`cancel_flag`].
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn send(
        &self,
        request: u64,
        generation: u32,
        to_rank: u32,
        segment: u32,
        data: *const u8,
        len: usize,
        timeout_ms: u64,
        cancel: usize,
    ) -> Result<u8> {
        // SAFETY: forwarded caller promise.
        let flag = unsafe { cancel_flag(cancel) };
        if data.is_null() || len == 0 {
            return guard(|| {
                Err(Error::invalid(
                    "send needs a non-null buffer and a non-zero size",
                ))
            });
        }
        // `from_raw_parts` requires `len <= isize::MAX` (its debug check aborts the process, past
        // any `catch_unwind`) and a range that does not wrap the address space.
        if len > isize::MAX as usize || (data as usize).checked_add(len).is_none() {
            return guard(|| {
                Err(Error::invalid(format!(
                    "send of {len} bytes at {data:p}: no buffer has that size"
                )))
            });
        }
        // SAFETY: the caller promises `len` readable bytes at `data` for this call.
        let bytes = unsafe { std::slice::from_raw_parts(data, len) };
        guard(|| {
            let check = cancel_check(flag);
            let key = RequestKey::new(request, generation);
            self.engine
                .send(
                    key,
                    RankId(to_rank),
                    segment,
                    bytes,
                    deadline(timeout_ms),
                    check.as_deref(),
                )
                .map(outcome_code)
        })
    }

    /// [`EngineHandle::send`] of `len` bytes of CUDA device memory at `device_addr` on
    /// `device` ([`Engine::send_device`]: staged through pinned host memory). `Cuda` where no
    /// driver or no such device exists.
    ///
    /// # Safety
    /// `cancel` as for [`cancel_flag`]; `device_addr` must be `len` bytes of device memory on
    /// `device` for the duration of the call.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn send_device(
        &self,
        request: u64,
        generation: u32,
        to_rank: u32,
        segment: u32,
        device: i32,
        device_addr: u64,
        len: usize,
        timeout_ms: u64,
        cancel: usize,
    ) -> Result<u8> {
        // SAFETY: forwarded caller promise.
        let flag = unsafe { cancel_flag(cancel) };
        guard(|| {
            if device < 0 || device_addr == 0 || len == 0 {
                return Err(Error::invalid(
                    "send_device needs a device, a non-null address and a non-zero size",
                ));
            }
            // As for host memory (`send`): a range that wraps is the caller's mistake, not a
            // CUDA error for the driver to find.
            if device_addr.checked_add(len as u64).is_none() {
                return Err(Error::invalid(format!(
                    "send_device of {len} bytes at {device_addr:#x} wraps the address space"
                )));
            }
            let check = cancel_check(flag);
            let key = RequestKey::new(request, generation);
            self.engine
                .send_device(
                    key,
                    RankId(to_rank),
                    segment,
                    device,
                    device_addr,
                    len,
                    deadline(timeout_ms),
                    check.as_deref(),
                )
                .map(outcome_code)
        })
    }

    /// Waits for the agreed end of the request: as its receiver (`peer_rank` ignored) or as the
    /// sender to `peer_rank`.
    ///
    /// # Safety
    /// `cancel` as for [`cancel_flag`].
    pub unsafe fn wait(
        &self,
        request: u64,
        generation: u32,
        as_receiver: bool,
        peer_rank: u32,
        timeout_ms: u64,
        cancel: usize,
    ) -> Result<u8> {
        // SAFETY: forwarded caller promise.
        let flag = unsafe { cancel_flag(cancel) };
        guard(|| {
            let check = cancel_check(flag);
            let role = if as_receiver {
                Role::Receiver
            } else {
                Role::Sender {
                    receiver: RankId(peer_rank),
                }
            };
            self.engine
                .wait(
                    RequestKey::new(request, generation),
                    role,
                    deadline(timeout_ms),
                    check.as_deref(),
                )
                .map(outcome_code)
        })
    }

    pub fn cancel(&self, request: u64, generation: u32) -> Result<()> {
        guard(|| self.engine.cancel(RequestKey::new(request, generation)))
    }

    pub fn notify(
        &self,
        to_rank: u32,
        request: u64,
        generation: u32,
        payload: &[u8],
    ) -> Result<()> {
        guard(|| {
            self.engine.notify(
                RankId(to_rank),
                RequestKey::new(request, generation),
                payload.to_vec(),
            )
        })
    }

    /// # Safety
    /// `cancel` as for [`cancel_flag`].
    pub unsafe fn wait_for_notification(
        &self,
        from_rank: u32,
        timeout_ms: u64,
        cancel: usize,
    ) -> Result<NotificationInfo> {
        // SAFETY: forwarded caller promise.
        let flag = unsafe { cancel_flag(cancel) };
        guard(|| {
            let check = cancel_check(flag);
            Ok(
                match self.engine.wait_for_notification(
                    RankId(from_rank),
                    deadline(timeout_ms),
                    check.as_deref(),
                ) {
                    None => NotificationInfo {
                        found: false,
                        ..NotificationInfo::default()
                    },
                    Some((k, payload)) => NotificationInfo {
                        found: true,
                        request: k.request.0,
                        generation: k.generation.0,
                        payload,
                    },
                },
            )
        })
    }

    pub fn device_path(&self) -> u8 {
        match self.engine.device_path() {
            crate::transport::DevicePath::Staged => 0,
            crate::transport::DevicePath::Direct => 1,
        }
    }

    pub fn health(&self) -> Result<HealthInfo> {
        guard(|| Ok(self.health_info()))
    }

    fn health_info(&self) -> HealthInfo {
        let h = self.engine.health();
        HealthInfo {
            state: h.state as u8,
            since_last_fault_ms: h.since_last_fault_ms,
            peers: h.peers,
            peers_failed: h.peers_failed,
            requests_known: h.requests_known,
            completed: h.completed,
            failed: h.failed,
            stale_dropped: h.stale_dropped,
            bad_frames: h.bad_frames,
            buffers_leased: h.buffers_leased,
            buffers_fenced: h.buffers_fenced,
            ops_in_flight: h.ops_in_flight,
            oldest_op_ms: h.oldest_op_ms,
            since_last_completion_ms: h.since_last_completion_ms,
            bytes_completed: h.bytes_completed,
            unreaped_ops: h.unreaped_ops,
            peers_reconnecting: h.peers_reconnecting,
            reconnects: h.reconnects,
            adverts_refused: h.adverts_refused,
            notes_dropped: h.notes_dropped,
            unsettled_returns: h.unsettled_returns,
            foreign_data: h.foreign_data,
            late_data: h.late_data,
            refused_auth: h.refused_auth,
            refused_rank_in_use: h.refused_rank_in_use,
            refused_version: h.refused_version,
            refused_by_peer: h.refused_by_peer,
            receive_stuck: h.receive_stuck,
            worker_renewals: h.worker_renewals,
            region_fenced_bytes: h.region_fenced_bytes,
            region_fences: h.region_fences,
            resends: h.resends,
            duplicates: h.duplicates,
            unknown_dropped: h.unknown_dropped,
            early_kept: h.early_kept,
            ranks_forgotten: h.ranks_forgotten,
            peers_left: h.peers_left,
        }
    }

    pub fn metrics_text(&self) -> Result<String> {
        guard(|| self.engine.metrics_text())
    }

    pub fn peer_state(&self, rank: u32) -> Result<u8> {
        guard(|| Ok(self.engine.peer_state(RankId(rank)) as u8))
    }

    /// # Safety
    /// As for [`Engine::register_region`]: the memory stays valid until `deregister_region`
    /// returns for it, or the engine is dropped.
    pub unsafe fn register_region(&self, addr: u64, len: u64) -> Result<u64> {
        // SAFETY: forwarded caller promise.
        guard(|| unsafe { self.engine.register_region(addr, len) }.map(|r| r.0))
    }

    pub fn region_address(&self, region: u64, offset: u64, len: u64) -> Result<u64> {
        guard(|| {
            self.engine
                .region_buffer(RegionId(region), BufferKind::Kv, 0, offset, len)
                .map(|b| b.addr)
        })
    }

    pub fn region_info(&self, region: u64) -> Result<RegionStatus> {
        guard(|| {
            let i = self.engine.region_info(RegionId(region))?;
            Ok(RegionStatus {
                addr: i.addr,
                len: i.len,
                transfers: i.transfers as u64,
                fenced_transfers: i.fenced_transfers as u64,
                fenced_bytes: i.fenced_bytes,
            })
        })
    }

    pub fn region_fenced_ranges(&self, region: u64) -> Result<Vec<u64>> {
        guard(|| {
            let ranges = self.engine.region_fenced_ranges(RegionId(region))?;
            Ok(ranges.into_iter().flat_map(|(o, l)| [o, l]).collect())
        })
    }

    pub fn deregister_region(&self, region: u64, timeout_ms: u64) -> Result<()> {
        guard(|| {
            self.engine
                .deregister_region(RegionId(region), deadline(timeout_ms))
        })
    }
}
