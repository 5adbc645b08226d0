// The functions kvlink_trtllm_wrapper_probe.so adds to the wrapper (helpers/wrapper_probe.cpp):
// what a test needs of the engine and the wrapper behind a ConnectionManager, which TensorRT-LLM's
// interface does not expose. Looked up with dlsym, like the factory; test builds only.
#pragma once

#include <cstddef>
#include <cstdint>

/// Fields of kvlink::Health (include/kvlink/engine.hpp) a leak or a stuck op shows in.
struct KvlinkProbeHealth {
  std::uint64_t buffers_leased;
  std::uint64_t buffers_fenced;
  std::uint64_t ops_in_flight;
  std::uint64_t unreaped_ops;
  std::uint64_t completed;
  std::uint64_t failed;
  std::uint64_t peers_failed;
  /// 1 while the engine's shared-memory receive queue is stuck (kvlink::Health::receive_stuck).
  std::uint64_t receive_stuck;
  /// Moves to a new worker after a stuck receive queue (kvlink::Health::worker_renewals).
  std::uint64_t worker_renewals;
};

/// Fills `out` from the engine of `manager` (the factory's result, a ConnectionManager*).
/// Returns 0, or -1 when `manager` is not a manager made by this library.
using KvlinkProbeHealthFn = int (*)(void* manager, KvlinkProbeHealth* out);
#define KVLINK_PROBE_HEALTH_SYMBOL "kvlinkProbeHealth"

/// What the wrapper holds outside the engine, where a lost envelope or a leak of per-thread
/// state shows.
struct KvlinkProbeWrapperState {
  /// Envelopes (request advertisements) taken from the engine that no recvConnect has taken yet.
  std::uint64_t envelopes_queued;
  /// Per-thread entries over the manager's connections: envelopes being built or read, and
  /// generation requests, each keyed by the thread running it.
  std::uint64_t thread_states;
  /// Buffer advertisements of the generation rank queued on the context rank's connections for
  /// a send to fill.
  std::uint64_t buffers_queued;
  /// Requests the context rank's connections hold, each taken by a recvConnect (open, answered
  /// or ended), until they are closed or forgotten past their deadline.
  std::uint64_t context_requests;
};

/// Fills `out` from the wrapper state of `manager`. Returns 0, or -1 as KvlinkProbeHealthFn.
using KvlinkProbeWrapperStateFn = int (*)(void* manager, KvlinkProbeWrapperState* out);
#define KVLINK_PROBE_WRAPPER_STATE_SYMBOL "kvlinkProbeWrapperState"

/// The connections the calling thread holds (or held) per-thread state on, each of which its exit
/// visits: the list a long-lived thread keeps over every manager it ever used.
using KvlinkProbeThreadConnectionsFn = std::uint64_t (*)();
#define KVLINK_PROBE_THREAD_CONNECTIONS_SYMBOL "kvlinkProbeThreadConnections"

/// Advertises one 1-byte buffer from the engine of `manager` to the engine at `address` (a
/// rank's published connection info), under request `request`, with `info` as the request info
/// exactly as given (not built by the wrapper: how a peer that does not run the wrapper, or a
/// hostile one, would advertise), and waits for the request's end, at most `wait_ms` past it
/// plus a second. Returns the outcome (kvlink::Outcome as an int), -1 as KvlinkProbeHealthFn,
/// -2 when a call threw.
using KvlinkProbeAdvertiseRawFn = int (*)(void* manager, char const* address, std::uint64_t request,
                                          std::uint8_t const* info, std::size_t n, std::uint32_t wait_ms);
#define KVLINK_PROBE_ADVERTISE_RAW_SYMBOL "kvlinkProbeAdvertiseRaw"
