//! The only file that knows cxx: declarations and one-line forwarders. Every exported function
//! that does more than read a field goes through the single panic boundary (`boundary::guard`),
//! in `api.rs` or here; the others (`rank`, `device_path`, `version`, `error_kind_name`,
//! `take_last_error_kind`, `ucx_version`, which reads a version UCX reported once) return a value
//! read or formatted without any call that can panic.
use crate::api::{engine_new, EngineHandle};
use crate::boundary::{guard, take_last_error_kind};
use crate::error::Error;

#[cxx::bridge(namespace = "kvlink::ffi")]
pub mod ffi {
    /// How to build one rank's engine.
    #[derive(Default)]
    struct EngineOptions {
        /// Agent name, sent to peers in the hello.
        name: String,
        /// This rank's id, unique across both engines of a deployment.
        rank: u32,
        /// "tcp", "sm" (shared memory), "auto" or a UCX transport list ("rc,cuda_copy"), with
        /// "@devices" for network devices ("tcp@eth0").
        transport: String,
        /// tcp: `ip:port` to listen on (port 0 picks one); empty for none.
        listen: String,
        /// Per-request deadline (TensorRT-LLM's kv_transfer_timeout_ms). Must be positive.
        timeout_ms: u64,
        /// Extra time past a deadline for ranks to agree (0: the default, 50 ms).
        agreement_ms: u64,
        /// How long a request that ended without completing is kept whole past its end, when
        /// `has_linger` (else the default, 5 000 ms); 0: forgotten at its end.
        has_linger: bool,
        linger_ms: u64,
        /// health().state windows (0: the defaults, 10 000 and 60 000 ms).
        wedge_ms: u64,
        degraded_ms: u64,
        /// Fault hook: the request id whose data a sender silently drops; -1 for none.
        fault_suppress_request: i64,
        /// The deployment secret, when `has_secret` (else `KVLINK_SECRET` from the environment).
        has_secret: bool,
        secret: Vec<u8>,
    }

    /// A region now (see `Engine::region_info`).
    #[derive(Default, Clone, Debug)]
    struct RegionStatus {
        addr: u64,
        len: u64,
        transfers: u64,
        fenced_transfers: u64,
        fenced_bytes: u64,
    }

    /// One advertised buffer.
    #[derive(Default, Clone, Debug)]
    struct BufferInfo {
        /// 0 KV, 1 KV indexer, 2 RNN.
        kind: u8,
        segment: u32,
        addr: u64,
        len: u64,
        /// CUDA device, -1 for host memory.
        device_id: i32,
        /// Set by kvlink (the receive's token, from which its UCX tag is keyed); ignored on input.
        token: u64,
    }

    /// An advertisement taken by a context rank; `found` is false when none came in time.
    #[derive(Default)]
    struct AdvertInfo {
        found: bool,
        request: u64,
        generation: u32,
        from_rank: u32,
        /// Milliseconds left, when it was taken, until the request's deadline.
        deadline_ms: u64,
        request_info: Vec<u8>,
        buffers: Vec<BufferInfo>,
    }

    /// A notification; `found` is false when none came in time.
    #[derive(Default)]
    struct NotificationInfo {
        found: bool,
        request: u64,
        generation: u32,
        payload: Vec<u8>,
    }

    /// The progress snapshot (see `kvlink::Health` in engine.hpp).
    #[derive(Default, Debug)]
    struct HealthInfo {
        /// 0 Healthy, 1 Degraded, 2 Wedged.
        state: u8,
        since_last_fault_ms: u64,
        peers: u64,
        peers_failed: u64,
        requests_known: u64,
        completed: u64,
        failed: u64,
        stale_dropped: u64,
        bad_frames: u64,
        buffers_leased: u64,
        buffers_fenced: u64,
        ops_in_flight: u64,
        oldest_op_ms: u64,
        since_last_completion_ms: u64,
        bytes_completed: u64,
        unreaped_ops: u64,
        peers_reconnecting: u64,
        reconnects: u64,
        adverts_refused: u64,
        notes_dropped: u64,
        unsettled_returns: u64,
        foreign_data: u64,
        late_data: u64,
        refused_auth: u64,
        refused_rank_in_use: u64,
        refused_version: u64,
        refused_by_peer: u64,
        /// This process's shared-memory receive queue is stuck (see `kvlink::Health`).
        receive_stuck: bool,
        /// Moves to a new worker after a stuck receive queue (see `kvlink::Health`).
        worker_renewals: u64,
        /// Region bytes fenced now, and transfers fenced that way so far.
        region_fenced_bytes: u64,
        region_fences: u64,
        /// Control messages resent, repeats dropped, messages for unknown requests dropped.
        resends: u64,
        duplicates: u64,
        unknown_dropped: u64,
        /// Votes and failure verdicts kept for a request not yet started here; ranks forgotten
        /// to bound the peer table (see `kvlink::Health`).
        early_kept: u64,
        ranks_forgotten: u64,
        /// Connections whose peer said it was leaving (see `kvlink::Health`).
        peers_left: u64,
    }

    extern "Rust" {
        /// The library version (Cargo package version).
        fn version() -> String;
        /// The UCX library kvlink runs on, as it reports itself (`ucp_get_version`): "1.22.0".
        fn ucx_version() -> String;
        /// Kind code (see `kvlink::ErrorKind`) of the last error thrown on this thread; 0 if none.
        /// Reading clears it.
        fn take_last_error_kind() -> u8;
        /// Stable name of an error kind code ("InvalidArgument", ...), "Unknown" for others.
        fn error_kind_name(code: u8) -> &'static str;
        /// Parses and checks an `ip:port` listen address; returns its canonical form.
        /// Throws InvalidArgument on anything else.
        fn check_listen_address(addr: &str) -> Result<String>;
        /// Routes kvlink's log events at or above `level` (1 error .. 5 trace) to `callback`,
        /// the address of an `extern "C"` function (level, target, message and fields as
        /// pointer + length each) instead of stderr; level 0 or callback 0 removes it. Returns
        /// false when a global `tracing` subscriber of the host's came first (events go there).
        /// cxx cannot pass a function pointer from C++ to Rust, so it travels as an address.
        unsafe fn set_log_sink(level: u8, callback: usize) -> Result<bool>;
        /// Log records dropped because the sink fell `kvlink::log::QUEUE_CAP` records behind, or
        /// because formatting one panicked, since the process started.
        fn log_records_dropped() -> u64;
        /// Waits up to `timeout_ms` until the log records queued so far have reached the sink;
        /// returns whether they all have.
        fn flush_log(timeout_ms: u64) -> Result<bool>;

        /// One rank's engine: UCX agent, protocol core, driver thread.
        type EngineHandle;
        fn engine_new(options: &EngineOptions) -> Result<Box<EngineHandle>>;
        fn address(self: &EngineHandle) -> Result<String>;
        fn rank(self: &EngineHandle) -> u32;
        fn connect(self: &EngineHandle, address: &str, timeout_ms: u64) -> Result<u32>;
        fn wait_peer(self: &EngineHandle, rank: u32, timeout_ms: u64) -> Result<()>;
        unsafe fn advertise(
            self: &EngineHandle,
            request: u64,
            generation: u32,
            receivers: &[u32],
            sender: u32,
            buffers: &[BufferInfo],
            request_info: &[u8],
        ) -> Result<()>;
        /// One request filled by several context ranks: `senders[i]` sends `buffers[i]`.
        /// `timeout_ms`: the request's own deadline from now (0: the engine's timeout).
        #[allow(clippy::too_many_arguments)]
        unsafe fn advertise_flows(
            self: &EngineHandle,
            request: u64,
            generation: u32,
            receivers: &[u32],
            senders: &[u32],
            buffers: &[BufferInfo],
            request_info: &[u8],
            timeout_ms: u64,
        ) -> Result<()>;
        unsafe fn next_advertisement(
            self: &EngineHandle,
            timeout_ms: u64,
            cancel: usize,
        ) -> Result<AdvertInfo>;
        fn accept(
            self: &EngineHandle,
            request: u64,
            generation: u32,
            from_rank: u32,
            ready: bool,
        ) -> Result<()>;
        unsafe fn recv_ready(
            self: &EngineHandle,
            request: u64,
            generation: u32,
            timeout_ms: u64,
            cancel: usize,
        ) -> Result<i8>;
        #[allow(clippy::too_many_arguments)]
        unsafe fn send(
            self: &EngineHandle,
            request: u64,
            generation: u32,
            to_rank: u32,
            segment: u32,
            data: *const u8,
            len: usize,
            timeout_ms: u64,
            cancel: usize,
        ) -> Result<u8>;
        /// `send` of CUDA device memory (staged through pinned host memory).
        #[allow(clippy::too_many_arguments)]
        unsafe fn send_device(
            self: &EngineHandle,
            request: u64,
            generation: u32,
            to_rank: u32,
            segment: u32,
            device: i32,
            device_addr: u64,
            len: usize,
            timeout_ms: u64,
            cancel: usize,
        ) -> Result<u8>;
        unsafe fn wait(
            self: &EngineHandle,
            request: u64,
            generation: u32,
            as_receiver: bool,
            peer_rank: u32,
            timeout_ms: u64,
            cancel: usize,
        ) -> Result<u8>;
        fn cancel(self: &EngineHandle, request: u64, generation: u32) -> Result<()>;
        fn notify(
            self: &EngineHandle,
            to_rank: u32,
            request: u64,
            generation: u32,
            payload: &[u8],
        ) -> Result<()>;
        unsafe fn wait_for_notification(
            self: &EngineHandle,
            from_rank: u32,
            timeout_ms: u64,
            cancel: usize,
        ) -> Result<NotificationInfo>;
        fn health(self: &EngineHandle) -> Result<HealthInfo>;
        /// The engine's metrics in the Prometheus text format (version 0.0.4).
        fn metrics_text(self: &EngineHandle) -> Result<String>;
        /// The connection to `rank`: 0 unknown, 1 connected, 2 reconnecting, 3 failed.
        fn peer_state(self: &EngineHandle, rank: u32) -> Result<u8>;
        /// How CUDA memory moves with this engine's UCX, asked of it at start: 0 staged through
        /// pinned host buffers, 1 direct (UCX reports CUDA memory support).
        fn device_path(self: &EngineHandle) -> u8;
        /// Lends `[addr, addr + len)` to the engine as a region; returns its id.
        unsafe fn register_region(self: &EngineHandle, addr: u64, len: u64) -> Result<u64>;
        /// The address of `len` bytes at `offset` in a region (OutOfBounds past its end).
        fn region_address(self: &EngineHandle, region: u64, offset: u64, len: u64) -> Result<u64>;
        fn region_info(self: &EngineHandle, region: u64) -> Result<RegionStatus>;
        /// The region's fenced ranges, flattened: offset, length, offset, length, ...
        fn region_fenced_ranges(self: &EngineHandle, region: u64) -> Result<Vec<u64>>;
        fn deregister_region(self: &EngineHandle, region: u64, timeout_ms: u64) -> Result<()>;
    }
}

fn version() -> String {
    env!("CARGO_PKG_VERSION").to_string()
}

fn ucx_version() -> String {
    crate::transport::ucx::resources::ucx_version()
}

fn error_kind_name(code: u8) -> &'static str {
    crate::error::ErrorKind::from_code(code).map_or("Unknown", |k| k.name())
}

/// # Safety
/// As for [`crate::log::set_sink`].
unsafe fn set_log_sink(level: u8, callback: usize) -> Result<bool, Error> {
    // SAFETY: forwarded caller promise.
    guard(|| unsafe { crate::log::set_sink(level, callback) })
}

fn log_records_dropped() -> u64 {
    crate::log::records_dropped()
}

fn flush_log(timeout_ms: u64) -> Result<bool, Error> {
    guard(|| Ok(crate::log::flush(crate::api::deadline(timeout_ms))))
}

fn check_listen_address(addr: &str) -> Result<String, Error> {
    guard(|| crate::config::parse_listen_address(addr).map(|a| a.to_string()))
}
