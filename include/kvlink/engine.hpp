// kvlink::Engine: one rank's transfer engine, the C++ face of src/engine/ (through src/api.rs).
//
// Included by <kvlink/kvlink.hpp>; may also be included on its own. The general contract
// (ownership, threading, errors, panics) is the one at the top of kvlink.hpp; what is specific
// to the engine is written here.
//
// One request, end to end (the generation rank owns the receive buffers):
//   generation rank                              context rank
//   advertise(key, buffers, info)  ───────────▶  next_advertisement(deadline) -> Advertisement
//                                                accept(key, from, true)
//   recv_ready(key, deadline) -> true  ◀─ data ── send(key, to, segment, bytes, deadline) per buffer
//   wait_receiver(key, deadline)                 wait_sender(key, to, deadline)
//   both return the same agreed Outcome; the receive buffers are free again once they return.
//   (`send_segments` posts several segments at once and waits for them once.)
//
// Ownership
//   - `Engine` owns the Rust engine (UCX agent, protocol core, one progress thread) through a
//     `rust::Box`; it is move-only and its destructor tells every connected rank that it leaves
//     (their requests with it end `PeerLost` at once), waits for each to answer, then stops that
//     thread and releases every UCX resource (within about 200 ms for messages still going out
//     and answers not yet in: a frozen or unreachable rank costs it those 200 ms). Destroy it
//     only when no other thread is inside one of its member functions.
//   - Receive buffers passed to `advertise` are borrowed by kvlink from that call until
//     `wait_receiver` for the same key has returned (whatever the outcome): do not touch, free or
//     reuse them before. Send buffers are borrowed only for the duration of `send`. Memory in a
//     region (`register_region`) is lent for longer: a transfer there that UCX could not recall
//     is fenced past those calls, and its range (`region_fenced_ranges`) must not be touched
//     until it is released.
//   - Everything returned (`Advertisement`, `Notification`, `Health`, strings) is a copy.
//
// Threading
//   - Every member function may be called from any thread, concurrently (the engine serialises
//     internally and no lock is held while a call waits). Typical use is one thread per request.
//   - A blocked call first drives the engine's progress itself for a short window after the last
//     progress (100 us, `KVLINK_POLL_US`; 0 turns it off), so the completion it waits for is
//     handled on the calling thread with no wake-up between threads; then it sleeps until woken
//     for its own key. One thread drives at a time; an idle engine never polls. A wait for a
//     bulk transfer (a receive whose largest buffer is 4 MiB or more, a send of such a buffer)
//     does not drive: it sleeps and the progress thread wakes it. Over tcp neither does a wait
//     among 2 MiB or more of transfers in flight on the engine (its own included).
//
// Blocking and deadlines (the deadline rule)
//   - Functions that take a `Deadline` block until it (or the cancel flag, or the awaited event),
//     and return by it plus the agreement bound (50 ms by default) plus a few milliseconds,
//     whatever the peer does (frozen, partitioned, dead). A deadline in the past means "do not
//     wait" (a `wait_*` then gives the request up at once); `time_point::min()` and `max()` are
//     fine (`max()` waits at most a year, and in practice until the request's own deadline).
//     Deadlines are `std::chrono::steady_clock` points in any unit (a coarse one such as
//     `time_point<steady_clock, seconds>::max()` is read as it is, never wrapped through
//     nanoseconds); `kvlink::after(d)` makes one.
//   - Every request also has its own deadline: `EngineConfig::timeout` (TensorRT-LLM's
//     kv_transfer_timeout_ms), or the `timeout` given to `advertise`, counted from `advertise`.
//     The advertisement carries what is left of it, so the context rank shares the same
//     deadline (`Advertisement::deadline`). When it passes, every rank votes `TimedOut` and they
//     agree within the bound; a `wait_*` with a later deadline returns then.
//   - A caller's own earlier deadline, or its cancel flag, gives the request up the same way
//     (`TimedOut` / `Cancelled`, agreed within the bound). A `wait_*` returns only once nothing
//     can write the caller's receive buffers any more: unmatched receives are cancelled; one
//     that UCX cannot recall (half a large message in) has its endpoint force-closed, and the
//     engine reconnects the pair by itself. In a region (`register_region`) such a transfer (a
//     receive, or a send that its receiver does not drain) is left to UCX, fenced by range,
//     instead: the call returns at once, advertisements that overlap the range throw `Fenced`
//     until UCX releases it, and no endpoint is closed.
//   - One exception to the bound, for plain caller memory: until its endpoint's force-close has
//     run on the engine's own progress thread, UCX may still read or write that memory, so the
//     call waits for it. The thread runs it between UCX calls; one call can take tens of ms
//     (92 ms seen, pushing the rest of a 64 MiB rendezvous after a SIGSTOP of the process). The
//     wait is capped at 2 s past the bound (a thread that runs no more); past that the transfer
//     is left to UCX and counted in `Health::unreaped_ops`.
//   - Outcomes: the ranks report the same outcome when they can talk before the deadline. When
//     they cannot (partition, frozen or dead peer), each reports a failure by its own deadline:
//     `TimedOut` if its deadline came first (or it gave up), `PeerLost` if the transport said the
//     peer's endpoint failed before; a rank never reports `Completed` without the verdict, so a
//     sender's `Completed` implies its receiver's.
//   - A cancel flag (`CancelToken`, or any `std::atomic<bool>` via `CancelRef`) is polled every
//     5 ms by a blocked call. Setting it makes `send`/`wait_*` end the request as `Cancelled`, and
//     the cancel is agreed with every rank of the request.
//
// Errors
//   - Outcomes of a bounded wait are `kvlink::Outcome` values; "nothing arrived in time" is an
//     empty `std::optional`. Faults (unknown peer, bad buffer, a key already in use, ...) throw
//     `kvlink::Error` with a stable kind. Misuse throws at once and fails nothing else:
//     `UnknownRequest` for a key not running here (never advertised, or already waited for),
//     `InvalidArgument` for a send before accept, a segment never advertised or sent twice, a
//     size other than advertised, or a wait for a key another thread is already waiting for.
//
// Connections
//   - A rank this engine `connect`ed to is dialled again by the engine when its endpoint fails
//     (bounded tries with back-off), and `advertise` waits for a reconnect in progress (up to the
//     request's deadline); to a rank whose round gave up it starts one fresh round, and throws
//     `PeerLost` if that gives up too. A failure costs the requests on that endpoint, never the pair.
//     `peer_state(rank)` says where it stands. A rank that dialled this engine is left to dial
//     again, except after this engine moved to a new UCX worker (`Health::worker_renewals`):
//     ranks that had dialled its old worker address are dialled back from the new one.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "kvlink/kvlink.hpp"

namespace kvlink {

using Clock = std::chrono::steady_clock;
/// A point in time by which a blocking call returns.
using Deadline = Clock::time_point;

/// The deadline `d` from now, for a duration in any unit. Saturates instead of overflowing: a
/// duration past what the clock can hold (`milliseconds::max()`, centuries) is `Deadline::max()`,
/// a hugely negative one `Deadline::min()` (the unit conversion and the addition are checked), a
/// floating-point NaN now (do not wait).
template <typename Rep, typename Period>
inline Deadline after(std::chrono::duration<Rep, Period> d) {
  const Deadline now = Clock::now();
  // In long double ticks nothing overflows; a 1 ms margin covers its rounding near the limits.
  const long double ticks = std::chrono::duration<long double, Clock::period>(d).count();
  const long double at = static_cast<long double>(now.time_since_epoch().count()) + ticks;
  constexpr long double kMargin = 1e6L * Clock::period::den / (1000000000LL * Clock::period::num);
  if (at != at) return now;  // a NaN duration: no time at all, never a conversion of NaN
  if (at >= static_cast<long double>(Clock::duration::max().count()) - kMargin) return Deadline::max();
  if (at <= static_cast<long double>(Clock::duration::min().count()) + kMargin) return Deadline::min();
  if (ticks <= static_cast<long double>(Clock::duration::min().count()) + kMargin ||
      ticks >= static_cast<long double>(Clock::duration::max().count()) - kMargin) {
    // The point fits but the duration alone does not (hugely negative, the clock well past its
    // epoch): built from the point, never a conversion of a value outside the integer's range
    // (undefined; on x86 it came out as the range's minimum, 145 ms off for -9223372037 s).
    return Deadline(Clock::duration(static_cast<Clock::rep>(at)));
  }
  // The ticks checked above, not duration_cast: in a unit whose ratio to the clock's has a
  // denominator (1/44100 s), duration_cast multiplies before it divides and overflows for
  // counts whose result fits (10^12 samples, 262 days, came out 222 days in the past).
  return now + Clock::duration(static_cast<Clock::rep>(ticks));
}

/// How to build one rank's engine.
struct EngineConfig {
  /// Agent name, sent to peers when connecting (for their logs): 1 to 256 bytes, else the
  /// constructor throws InvalidArgument (the handshake cannot carry it).
  std::string name;
  /// This rank's id; unique across the context and generation engines of one deployment.
  std::uint32_t rank = 0;
  /// "tcp" (UCX over TCP sockets), "sm" (UCX shared memory, same host), "auto" (UCX chooses
  /// among what it has), or a UCX transport list in UCX_TLS syntax ("rc,cuda_copy,cuda_ipc",
  /// "tcp,self"); "@devices" appends network devices in UCX_NET_DEVICES syntax ("tcp@eth0",
  /// "rc,cuda_copy@mlx5_0:1"). Names are checked against the linked UCX when the engine starts:
  /// a bad one throws `InvalidArgument` naming it.
  std::string transport = "tcp";
  /// `ip:port` to listen on ("127.0.0.1:0" picks a port). Empty: do not listen (this rank then
  /// only connects out, or is reached by its worker address: "sm" and lists without a network
  /// transport). "0.0.0.0:port" accepts on every interface and `address()` reports one of this
  /// host's addresses for it. With transport "tcp@<devices>", an address on an interface the
  /// devices leave out throws `InvalidArgument` (peers could reach it but never connect).
  std::string listen;
  /// The default per-request deadline: TensorRT-LLM's `kv_transfer_timeout_ms`. Must be positive.
  /// This and the four durations below are taken as a year where they are longer
  /// (`milliseconds::max()` included). The sender learns what is left of a deadline in whole
  /// milliseconds, at most 2^32 - 1 (about 49.7 days): a longer one ends the sender's side then.
  std::chrono::milliseconds timeout{60000};
  /// Extra time past a deadline for the ranks of a request to agree on the verdict; a rank with
  /// no verdict by then ends with its own failure and fences what is still unsafe. Zero means
  /// the default (50 ms); negative: `InvalidArgument` (as for the two windows below).
  std::chrono::milliseconds agreement_bound{0};
  /// How long a request that ended without completing is kept whole past its end, to push its
  /// failure verdict again to a sender that has not confirmed it and answer late duplicates
  /// (`Health::requests_known` counts it meanwhile): memory for tolerance. A `Completed` request
  /// does not linger. Empty: the default (5 s). Zero: a failed request is forgotten at its end
  /// as a completed one is, its tombstone (to its deadline plus the agreement bound) still
  /// answering late votes and verdicts. Negative: `InvalidArgument`. A context rank's request
  /// whose `send` has not returned yet is kept until it has, linger or not (a minute past the
  /// linger at most).
  std::optional<std::chrono::milliseconds> linger;
  /// `Health::state`: work pending and no data moved for this long is `Wedged` (zero: 10 s).
  /// Make it longer than the slowest prefill a receiver waits through.
  std::chrono::milliseconds wedge_window{0};
  /// `Health::state`: a fault (failed peer, timed-out or lost request) this recent makes the
  /// engine `Degraded` (zero: 60 s).
  std::chrono::milliseconds degraded_window{0};
  /// Fault hook for tests and the demo: a context rank "sends" this request id's data without
  /// moving it (a lost completion). Leave empty in production. Past 2^63 - 1: `InvalidArgument`.
  std::optional<std::uint64_t> fault_suppress_request;
  /// The deployment secret: a peer is bound only if it proves it holds the same bytes
  /// (challenge-response in the handshake; `connect` fails with `AuthFailed` otherwise, on both
  /// sides). Empty optional: `KVLINK_SECRET` from the environment (unset or empty: none). An
  /// empty string: no secret, whatever the environment says.
  std::optional<std::string> secret;
};

/// One attempt of one request: the 64-bit request id plus the attempt number. A retry of the
/// same request uses the next generation; a key is never reused.
struct RequestKey {
  std::uint64_t request = 0;
  std::uint32_t generation = 0;
  friend bool operator==(const RequestKey& a, const RequestKey& b) {
    return a.request == b.request && a.generation == b.generation;
  }
  friend bool operator!=(const RequestKey& a, const RequestKey& b) { return !(a == b); }
};

/// Buffer kinds, as TensorRT-LLM numbers them.
enum class BufferKind : std::uint8_t { Kv = 0, KvIndexer = 1, Rnn = 2 };

/// A receive buffer the generation rank offers: host memory, or CUDA device memory when
/// `device_id` is a device (the receive then lands in pinned host memory and is copied to the
/// device on arrival; `ErrorKind::Cuda` where no driver exists).
struct Buffer {
  BufferKind kind = BufferKind::Kv;
  /// Segment number, unique within the request; the sender names it in `send`.
  std::uint32_t segment = 0;
  void* data = nullptr;
  std::size_t size = 0;
  /// CUDA device of `data`, -1 for host memory.
  std::int32_t device_id = -1;
};

/// A region: host memory lent to the engine once (`Engine::register_region`).
using RegionId = std::uint64_t;

/// A region now (`Engine::region_info`).
struct RegionInfo {
  std::uint64_t address = 0;
  std::uint64_t size = 0;
  /// Transfers into or out of the region that UCX still holds, fenced ones included.
  std::uint64_t transfers = 0;
  /// Of those, transfers of requests that have ended: their ranges are refused to new receives
  /// (`ErrorKind::Fenced`) until UCX releases them.
  std::uint64_t fenced_transfers = 0;
  std::uint64_t fenced_bytes = 0;
};

/// A buffer as the context rank sees it in an advertisement.
struct RemoteBuffer {
  BufferKind kind = BufferKind::Kv;
  std::uint32_t segment = 0;
  std::uint64_t address = 0;
  std::uint64_t size = 0;
  /// CUDA device, -1 for host memory.
  std::int32_t device_id = -1;
};

/// A request advertised to a context rank.
struct Advertisement {
  RequestKey key;
  std::uint32_t from_rank = 0;
  /// The request's deadline here (learned from the advertisement): pass it to `send` and
  /// `wait_sender`; the generation rank ends the request by then too.
  Deadline deadline{};
  std::vector<std::uint8_t> request_info;
  std::vector<RemoteBuffer> buffers;
};

/// An ordered notification from one rank.
struct Notification {
  RequestKey key;
  std::vector<std::uint8_t> payload;
};

/// How CUDA memory moves with the engine's UCX (asked of UCX when the engine starts).
enum class DevicePath : std::uint8_t {
  /// Through pinned host buffers: this UCX reports no CUDA memory support (built without CUDA,
  /// or its CUDA module could not load, e.g. no driver).
  Staged = 0,
  /// UCX reports CUDA memory support.
  Direct = 1,
};

/// The verdict of `Health`: is this engine making progress?
enum class HealthState : std::uint8_t {
  /// No work stuck, no fault within the degraded window.
  Healthy = 0,
  /// Requests still complete (or nothing is pending), but a peer or a request failed within the
  /// degraded window.
  Degraded = 1,
  /// Work is pending and no data has moved for longer than the wedge window: alive, not working.
  /// Also while this process's shared-memory receive queue is stuck (a peer process died or was
  /// stopped while writing into it; docs/RELIABILITY.md). By default the engine then fails every
  /// peer and moves to a new UCX worker at once (`Health::worker_renewals`), so this lasts only
  /// in report-only mode (`KVLINK_STUCK=report`), where after a death only a new process
  /// recovers, or if that move failed (connects are then refused).
  Wedged = 2,
};

/// The progress snapshot: tells "alive" from "working" and shows leaks.
struct Health {
  /// The verdict (see `HealthState`); the counters below are what it is computed from.
  HealthState state = HealthState::Healthy;
  /// Milliseconds since the last failed peer or timed-out / lost request (UINT64_MAX if none).
  std::uint64_t since_last_fault_ms = 0;
  std::uint64_t peers = 0;
  std::uint64_t peers_failed = 0;
  /// Requests the protocol core still knows (running, or failed and lingering to answer late
  /// messages; a completed one is forgotten at its end).
  std::uint64_t requests_known = 0;
  std::uint64_t completed = 0;
  std::uint64_t failed = 0;
  std::uint64_t stale_dropped = 0;
  std::uint64_t bad_frames = 0;
  /// Receive buffers still lent to a request. 0 when idle; anything else is a leak.
  std::uint64_t buffers_leased = 0;
  /// Buffers fenced because a lost peer might still have written them.
  std::uint64_t buffers_fenced = 0;
  std::uint64_t ops_in_flight = 0;
  std::uint64_t oldest_op_ms = 0;
  /// Milliseconds since the last completed transfer (UINT64_MAX if none yet).
  std::uint64_t since_last_completion_ms = 0;
  std::uint64_t bytes_completed = 0;
  /// Transfers UCX still held when their wait returned: once the force-close of its endpoint
  /// has run, a stopped transfer waits at most 30 ms past the end of its grace (at least 2 ms
  /// after the close) for UCX to let it go, and for the close to run at most 2 s more (see the
  /// deadline rule). Nonzero only when UCX keeps a transfer past the close of its endpoint, or
  /// the progress thread ran nothing for that long; each one is also logged.
  std::uint64_t unreaped_ops = 0;
  /// Ranks being dialled again after their endpoint failed, and dial attempts so far.
  std::uint64_t peers_reconnecting = 0;
  std::uint64_t reconnects = 0;
  /// Advertisements refused (queue full: the receiver sees Rejected) and notifications dropped.
  std::uint64_t adverts_refused = 0;
  std::uint64_t notes_dropped = 0;
  /// Waits that returned before UCX released a fenced receive (should stay 0).
  std::uint64_t unsettled_returns = 0;
  /// Tagged data discarded because no receive here was offered under its tag: a process that is
  /// not the buffer's peer (it never lands, never completes anything). And data that came after
  /// its receive had ended.
  std::uint64_t foreign_data = 0;
  std::uint64_t late_data = 0;
  /// Handshakes refused by this rank (no proof of the deployment secret; a rank bound to another
  /// live process; frames of another wire version), and by a peer.
  std::uint64_t refused_auth = 0;
  std::uint64_t refused_rank_in_use = 0;
  std::uint64_t refused_version = 0;
  std::uint64_t refused_by_peer = 0;
  /// This process's shared-memory receive queue is stuck: a peer process died (or was stopped)
  /// while writing into it, and nothing any peer sends over shared memory is read (state
  /// `Wedged`). By default every peer is failed when it is found and the engine moves to a new
  /// UCX worker with a fresh queue at once (`worker_renewals`), so this stays true only in
  /// report-only mode (`KVLINK_STUCK=report`), where after a death only a new process recovers,
  /// or if that move failed (connects are then refused) (docs/RELIABILITY.md).
  bool receive_stuck = false;
  /// Moves to a new worker, each after a stuck receive queue. Each failed every peer (ranks this
  /// engine dialled are redialled from the new worker, and ranks that had dialled its worker
  /// address are dialled back) and changed the worker address: a process that dials this engine
  /// later needs the new `address()` (a listening engine keeps its `ip:port`).
  std::uint64_t worker_renewals = 0;
  /// Bytes of regions fenced now: transfers of ended requests that UCX still holds (refused to
  /// new receives, `ErrorKind::Fenced`, until released), the sum of their lengths (two fenced
  /// sends from the same bytes count them twice); and transfers fenced that way so far. Each
  /// cost its range for a while, never the pair.
  std::uint64_t region_fenced_bytes = 0;
  std::uint64_t region_fences = 0;
  /// Control messages sent again because their answer had not come (unanswered advertisements
  /// and unconfirmed failure verdicts, backed off from 200 ms to 6.4 s; votes, verdict pulls). A
  /// rate that keeps climbing means a peer that is alive but not answering.
  std::uint64_t resends = 0;
  /// Messages that repeated one already handled (a resend that crossed its answer), dropped.
  std::uint64_t duplicates = 0;
  /// Messages for a request this rank does not know (forgotten, and its tombstone gone after
  /// its deadline, the agreement bound and the linger; or never started here), dropped; older
  /// generations of a known request count in `stale_dropped`.
  std::uint64_t unknown_dropped = 0;
  /// Votes and failure verdicts that came for a request before it had started here (its ranks
  /// start it apart), kept for its start (10 minutes, or the longest deadline of a request
  /// started here plus the agreement bound if longer; 8192 requests' worth at most): another rank's early cancel or
  /// landing counts as soon as the request starts here, not at the voter's resend. One that goes
  /// unused counts in `unknown_dropped` when it goes.
  std::uint64_t early_kept = 0;
  /// Ranks that dialled this side and failed, forgotten to bound the peer table (more than
  /// 8192 such failures since; docs/SECURITY.md): each reads `Unknown` again.
  std::uint64_t ranks_forgotten = 0;
  /// Connections whose peer said it was leaving (its engine was dropped): each ended at once,
  /// as a failed one does, and counts in `peers_failed` too, but is no fault for `state` (the
  /// requests it cost are).
  std::uint64_t peers_left = 0;
};

/// A rank's connection as this engine sees it.
enum class PeerState : std::uint8_t {
  Unknown = 0,
  Connected = 1,
  /// Its endpoint failed; the engine is dialling it again.
  Reconnecting = 2,
  /// Its endpoint failed and nobody is dialling it (it dialled us, the tries ran out, or it left
  /// and was reached by worker address, which ended with its engine).
  Failed = 3,
};

/// A cancel flag owned by the caller. Not copyable or movable: kvlink holds its address while a
/// call that was given it is blocked.
class CancelToken {
 public:
  CancelToken() = default;
  CancelToken(const CancelToken&) = delete;
  CancelToken& operator=(const CancelToken&) = delete;

  /// Asks every call watching this token to stop. Any thread; does not block.
  void cancel() noexcept { flag_.store(true, std::memory_order_release); }
  bool cancelled() const noexcept { return flag_.load(std::memory_order_acquire); }
  /// Clears the flag for reuse; only when no call is watching it.
  void reset() noexcept { flag_.store(false, std::memory_order_release); }
  const std::atomic<bool>& flag() const noexcept { return flag_; }

 private:
  std::atomic<bool> flag_{false};
};

/// A borrowed cancel flag for one call: a `CancelToken`, any `std::atomic<bool>` (such as
/// TensorRT-LLM's transfer-terminate flag), or none. Must outlive the call it is passed to.
class CancelRef {
 public:
  CancelRef() = default;
  CancelRef(std::nullptr_t) {}  // NOLINT: implicit on purpose
  CancelRef(const CancelToken& t) : flag_(&t.flag()) {}  // NOLINT
  CancelRef(const std::atomic<bool>& f) : flag_(&f) {}    // NOLINT
  /// What Rust receives: the flag's address, 0 for none.
  std::size_t address() const noexcept { return reinterpret_cast<std::size_t>(flag_); }

 private:
  // Rust reads the flag as an AtomicBool: the same one-byte lock-free layout.
  static_assert(sizeof(std::atomic<bool>) == 1 && std::atomic<bool>::is_always_lock_free,
                "std::atomic<bool> must be one lock-free byte to be shared with Rust");
  const std::atomic<bool>* flag_ = nullptr;
};

namespace detail {

/// Whole milliseconds of `d`, rounded up: 0 for none (zero, negative, NaN), UINT64_MAX where
/// more (Rust caps it at a year). In long double, so that `seconds::max()` does not wrap
/// through milliseconds into a negative count.
template <typename Rep, typename Period>
inline std::uint64_t ms_of(std::chrono::duration<Rep, Period> d) {
  const long double ms = std::chrono::duration<long double, std::milli>(d).count();
  if (!(ms > 0)) return 0;
  if (ms >= 18446744073709551615.0L) return UINT64_MAX;
  const auto whole = static_cast<std::uint64_t>(ms);
  return whole + (static_cast<long double>(whole) < ms ? 1 : 0);
}

/// Milliseconds left until `d`, rounded up, 0 if past.
/// Compares before subtracting, so `Deadline::min()` (and anything before now) cannot overflow;
/// `Deadline::max()` minus now is representable, and Rust caps it at a year.
inline std::uint64_t ms_until(Deadline d) {
  const auto now = Clock::now();
  if (d <= now) return 0;
  const auto left = d - now;
  return static_cast<std::uint64_t>(std::chrono::ceil<std::chrono::milliseconds>(left).count());
}

/// The same for a `steady_clock` time point in another unit (seconds, hours, floating point).
/// Never converted to `Deadline` first: `time_point<Clock, seconds>::max()` in nanoseconds
/// overflows (and wraps into the past). In long double milliseconds nothing overflows; what is
/// past (or NaN) is 0, what is too far is UINT64_MAX (Rust caps it at a year).
template <typename Duration>
inline std::uint64_t ms_until(std::chrono::time_point<Clock, Duration> d) {
  if constexpr (std::is_same_v<Duration, Clock::duration>) {
    return ms_until(Deadline(d));
  } else {
    using Ms = std::chrono::duration<long double, std::milli>;
    return ms_of(Ms(d.time_since_epoch()) - Ms(Clock::now().time_since_epoch()));
  }
}

/// An owned `rust::String` copy of `s`; non-UTF-8 becomes our InvalidArgument.
inline ::rust::String string(std::string_view s) {
  try {
    return ::rust::String(s.data(), s.size());
  } catch (const std::invalid_argument& e) {
    throw Error(ErrorKind::InvalidArgument, std::string("kvlink InvalidArgument: ") + e.what());
  }
}

inline Outcome outcome_from_code(std::uint8_t code) {
  if (code > static_cast<std::uint8_t>(Outcome::Rejected)) {
    throw Error(ErrorKind::Internal, "kvlink Internal: unknown outcome code " + std::to_string(code));
  }
  return static_cast<Outcome>(code);
}

template <typename T>
::rust::Slice<const T> slice(const std::vector<T>& v) {
  return ::rust::Slice<const T>(v.data(), v.size());
}

}  // namespace detail

/// Waits until the log records queued so far have reached the sink (see `set_log_sink`), or
/// until `deadline`; returns whether they all have. For a host that wants them before it exits:
/// records still queued when the process ends are lost. Called from inside the sink, it does not
/// wait (it cannot wait for itself).
template <typename Duration>
inline bool flush_log(std::chrono::time_point<Clock, Duration> deadline) {
  return detail::call(ffi::flush_log, detail::ms_until(deadline));
}

/// One rank's engine. See the top of this file for the contract.
class Engine {
 public:
  /// Creates the UCX agent (listening if configured) and starts its progress thread. Does not
  /// block on any peer. Throws `Error` (InvalidArgument for a bad config, Transport for UCX).
  explicit Engine(const EngineConfig& config) : handle_(make(config)) {}

  /// Moving hands the engine over; the moved-from `Engine` may be destroyed or assigned to,
  /// and any other call on it throws `Error` Shutdown.
  Engine(Engine&&) noexcept = default;
  Engine& operator=(Engine&&) noexcept = default;

  /// Where peers reach this rank: `ip:port` (tcp) or `ucx:<hex>` (sm: UCX's worker address
  /// sealed with its length and a checksum; `connect` refuses one that is cut or altered). A
  /// listener at `0.0.0.0` is reported at one of this host's interface addresses (the
  /// transport's devices first; README, "The transport setting"), never at `0.0.0.0`.
  std::string address() const {
    return detail::call([&] { return std::string(handle()->address()); });
  }
  std::uint32_t rank() const { return handle()->rank(); }

  /// Blocks: connects to the rank at `address` and runs the handshake (each side proves it holds
  /// the deployment secret, see `EngineConfig::secret`); returns the peer's rank. Throws `Error`
  /// with kind `PeerLost` if the handshake did not finish by `deadline` (at once, dialling
  /// nothing, if it has passed), `AuthFailed` if the two
  /// sides do not hold the same secret, `RankInUse` if the peer (or this rank) has that rank bound
  /// to another live process (or the peer is that rank itself), `Protocol` (at once) if the two speak different wire versions,
  /// `Transport` if this rank's progress thread was too busy (or stuck) to make the endpoint by
  /// `deadline`, or within 10 s (one it makes later is closed unused). Two ranks may dial each other at once, or dial a rank already connected to them: the pair
  /// keeps one connection and both calls return the other's rank. A dial that won such a
  /// crossing and whose connection broke before the handshake ended is made once more, within
  /// `deadline` (proving the broken dial's session, so a peer still holding that connection
  /// takes it as the same process coming back), and the other rank's call waits for it (up to
  /// 5 s after that connection broke; then `PeerLost`, as when the dial made again does not
  /// connect: connect again). A call to an address that this rank's reconnect round is dialling
  /// (after a connection failed) waits for that dial and returns the rank when it binds (if it
  /// fails, the call dials in its place); the round does not dial while a call's dial runs.
  template <typename Duration = Clock::duration>
  std::uint32_t connect(std::string_view address, std::chrono::time_point<Clock, Duration> deadline) {
    return detail::call([&] { return handle()->connect(detail::str(address), detail::ms_until(deadline)); });
  }

  /// Blocks until rank `rank` has connected to this one. Throws `Error` UnknownPeer at the deadline.
  template <typename Duration = Clock::duration>
  void wait_peer(std::uint32_t rank, std::chrono::time_point<Clock, Duration> deadline) {
    detail::call([&] { handle()->wait_peer(rank, detail::ms_until(deadline)); });
  }

  /// Generation rank: posts a receive for each buffer and advertises the request to `sender`.
  /// `receivers` lists every generation rank of the request (empty: this rank alone); they agree
  /// on one verdict. Does not block while `sender` is connected. While it is being reconnected
  /// (its endpoint failed: `peer_state` says `Reconnecting`) the call waits for that, up to the
  /// request's deadline (`timeout`); to a sender whose reconnect round gave up it starts one fresh
  /// round; it throws `PeerLost` if the sender is not back by then or that round gives up first
  /// (it dials the old address: a context process that died and came back at another one is
  /// reached only by a `connect` to its new address). The request's coordinator (the lowest of
  /// `receivers`, when it is another rank that has been connected here) is waited for alike; a
  /// failed one that this rank cannot redial (it was the one that dialled) throws `PeerLost` at once.
  /// The buffers are borrowed until `wait_receiver(key)` returns.
  /// Throws `Error`: InvalidArgument if the key is already known here (a replay) or two of its
  /// buffers overlap,
  /// StaleGeneration if a newer generation of its request id runs or ended here lately (a late
  /// retry of an old attempt), UnknownPeer if `sender` is not connected, OutOfBounds for a null or empty buffer (or one straddling a
  /// region's edge), Fenced for one overlapping a fenced range of a region, QueueFull when the
  /// receive pool (65536 buffers over all requests) has fewer free than `buffers` asks for
  /// (InvalidArgument if it asks for more than the whole pool: it never fits).
  /// `timeout`: this request's own deadline from now, in any unit (zero or negative:
  /// `EngineConfig::timeout`; longer than a year, `seconds::max()` included: a year).
  template <typename Rep = std::chrono::milliseconds::rep, typename Period = std::milli>
  void advertise(RequestKey key, const std::vector<std::uint32_t>& receivers, std::uint32_t sender,
                 const std::vector<Buffer>& buffers, const std::vector<std::uint8_t>& request_info,
                 std::chrono::duration<Rep, Period> timeout = std::chrono::duration<Rep, Period>::zero()) {
    advertise_flows(key, receivers, std::vector<std::uint32_t>(buffers.size(), sender), buffers,
                    request_info, timeout);
  }

  /// Generation rank, one request filled by several context ranks: `senders[i]` sends
  /// `buffers[i]`. Otherwise as `advertise`; InvalidArgument if the two lists differ in length.
  template <typename Rep = std::chrono::milliseconds::rep, typename Period = std::milli>
  void advertise_flows(RequestKey key, const std::vector<std::uint32_t>& receivers,
                       const std::vector<std::uint32_t>& senders, const std::vector<Buffer>& buffers,
                       const std::vector<std::uint8_t>& request_info,
                       std::chrono::duration<Rep, Period> timeout = std::chrono::duration<Rep, Period>::zero()) {
    const std::uint64_t timeout_ms = detail::ms_of(timeout);
    std::vector<ffi::BufferInfo> infos;
    infos.reserve(buffers.size());
    for (const Buffer& b : buffers) {
      ffi::BufferInfo i;
      i.kind = static_cast<std::uint8_t>(b.kind);
      i.segment = b.segment;
      i.addr = reinterpret_cast<std::uint64_t>(b.data);
      i.len = b.size;
      i.device_id = b.device_id;
      i.token = 0;
      infos.push_back(i);
    }
    detail::call([&] {
      handle()->advertise_flows(key.request, key.generation, detail::slice(receivers),
                               detail::slice(senders), detail::slice(infos),
                               detail::slice(request_info),
                               timeout_ms);
    });
  }

  /// Lends `[data, data + size)` of host memory to the engine as a region, once. Requests then
  /// receive into ranges of it (`region_buffer`, or any `Buffer` whose memory lies inside it) and
  /// `send` from it. When a request ends while UCX still holds one of its transfers there (a
  /// frozen or cut-off peer, data already matched), `wait_receiver` / `send` return at once and
  /// the transfer is left to UCX, fenced by range: advertisements that overlap it throw `Fenced`
  /// until UCX releases it, and nothing else on the pair is touched. In memory outside any region
  /// the endpoint is force-closed instead, which costs every request on the pair. Does not block.
  /// Throws
  /// InvalidArgument for a null or empty range, or one overlapping another region. The memory
  /// must stay valid until `deregister_region` returns for it without throwing (after `Fenced`
  /// the region stays registered), or the engine is destroyed: the engine may write a fenced
  /// range after its request has ended.
  RegionId register_region(void* data, std::size_t size) {
    return detail::call(
        [&] { return handle()->register_region(reinterpret_cast<std::uint64_t>(data), size); });
  }

  /// A buffer of `size` bytes at `offset` in `region`. Throws OutOfBounds past the region's end,
  /// InvalidArgument for an unknown region. Does not block.
  Buffer region_buffer(RegionId region, BufferKind kind, std::uint32_t segment, std::size_t offset,
                       std::size_t size) const {
    Buffer b;
    b.kind = kind;
    b.segment = segment;
    b.data = reinterpret_cast<void*>(
        detail::call([&] { return handle()->region_address(region, offset, size); }));
    b.size = size;
    return b;
  }

  /// The region's transfers and fenced bytes now. Does not block.
  RegionInfo region_info(RegionId region) const {
    const ffi::RegionStatus s = detail::call([&] { return handle()->region_info(region); });
    return {s.addr, s.len, s.transfers, s.fenced_transfers, s.fenced_bytes};
  }

  /// The region's fenced ranges now, as (offset, size), lowest first: memory the caller must not
  /// touch yet (UCX may still write a fenced receive's range, or read a fenced send's). Does not
  /// block.
  std::vector<std::pair<std::uint64_t, std::uint64_t>> region_fenced_ranges(RegionId region) const {
    const rust::Vec<std::uint64_t> flat =
        detail::call([&] { return handle()->region_fenced_ranges(region); });
    std::vector<std::pair<std::uint64_t, std::uint64_t>> out;
    for (std::size_t i = 0; i + 1 < flat.size(); i += 2) out.emplace_back(flat[i], flat[i + 1]);
    return out;
  }

  /// Blocks: takes the region back. Throws InvalidArgument while a running request moves data in
  /// or out of it; from the call on no new request may use it. Fenced transfers are ended now:
  /// their endpoints are force-closed (those pairs reconnect) and the call waits until UCX has
  /// released them, or throws `Fenced` at the deadline with the region still registered (and
  /// usable again once no other deregistration of it is waiting). Of several concurrent calls
  /// for one region, any that ends after the region is gone returns normally.
  template <typename Duration = Clock::duration>
  void deregister_region(RegionId region, std::chrono::time_point<Clock, Duration> deadline) {
    detail::call([&] { handle()->deregister_region(region, detail::ms_until(deadline)); });
  }

  /// Context rank, blocks: the next advertisement, or empty at the deadline or on cancel.
  /// Several threads may wait at once: each advertisement goes to exactly one of them, and
  /// wakes only one. One whose request ended before it was taken is still handed out (see
  /// `accept`); one whose rank's process was replaced since by a new process of that rank is
  /// not (nor are that process's notifications not yet taken).
  template <typename Duration = Clock::duration>
  std::optional<Advertisement> next_advertisement(std::chrono::time_point<Clock, Duration> deadline,
                                                  CancelRef cancel = {}) {
    ffi::AdvertInfo a = detail::call(
        [&] { return handle()->next_advertisement(detail::ms_until(deadline), cancel.address()); });
    if (!a.found) return std::nullopt;
    Advertisement out;
    out.key = {a.request, a.generation};
    out.from_rank = a.from_rank;
    out.deadline = Clock::now() + std::chrono::milliseconds(a.deadline_ms);
    out.request_info.assign(a.request_info.begin(), a.request_info.end());
    for (const ffi::BufferInfo& b : a.buffers) {
      out.buffers.push_back({static_cast<BufferKind>(b.kind), b.segment, b.addr, b.len, b.device_id});
    }
    return out;
  }

  /// Context rank: accepts (`ready`) or rejects an advertised request before any data moves.
  /// Does not block. Throws UnknownRequest if no advertisement of `key` came from `from_rank`,
  /// InvalidArgument if it was already answered. An answer to a request that ended before it
  /// (the generation rank gave it up or cancelled it after the advertisement was taken: a race,
  /// not misuse) is no error and changes nothing: `send` then returns that end (not
  /// `Completed`), and `wait_sender` the agreed verdict. After `from_rank`'s process was
  /// replaced by another, `accept`, `send` and `wait_sender` on a key of the old process's
  /// requests are the old request's (ended, `PeerLost` if it ran) until the new process's
  /// advertisement of that key is taken, even if it came already.
  void accept(RequestKey key, std::uint32_t from_rank, bool ready) {
    detail::call([&] { handle()->accept(key.request, key.generation, from_rank, ready); });
  }

  /// Generation rank, blocks: the context rank's answer: true once its first segment landed (an
  /// acceptance is not a message of its own) or the request completed, false if it refused, empty
  /// at the deadline, on cancel, or at once when the request ended otherwise. Asking is not
  /// consumed: once the request has ended the answer follows its end, before and after `wait`
  /// (for 10 minutes after its end, or less once 2^20 keys have ended since). Throws
  /// UnknownRequest at once for a key no receive here has (never advertised, its end
  /// forgotten, or an `advertise` of it on another thread still waiting for its sender).
  template <typename Duration = Clock::duration>
  std::optional<bool> recv_ready(RequestKey key, std::chrono::time_point<Clock, Duration> deadline,
                                 CancelRef cancel = {}) {
    const std::int8_t r = detail::call([&] {
      return handle()->recv_ready(key.request, key.generation, detail::ms_until(deadline), cancel.address());
    });
    if (r < 0) return std::nullopt;
    return r == 1;
  }

  /// Context rank, blocks: sends segment `segment` of `key` (its whole buffer: `size` must equal
  /// the advertised length) once the request is accepted. Data inside a region
  /// (`register_region`) must lie wholly inside it (OutOfBounds); a send of it that the receiver
  /// cannot drain is left to UCX when this returns, instead of its endpoint being closed. `Completed` when this rank's send is
  /// done; anything else ends the request (the verdict is agreed; read it with `wait_sender`).
  /// Called at or past its deadline (or its request's), it posts nothing and gives the request
  /// up: `TimedOut` at once.
  template <typename Duration = Clock::duration>
  Outcome send(RequestKey key, std::uint32_t to_rank, std::uint32_t segment, const void* data,
               std::size_t size, std::chrono::time_point<Clock, Duration> deadline, CancelRef cancel = {}) {
    return detail::outcome_from_code(detail::call([&] {
      return handle()->send(key.request, key.generation, to_rank, segment,
                           static_cast<const std::uint8_t*>(data), size, detail::ms_until(deadline),
                           cancel.address());
    }));
  }

  /// Context rank, blocks: `send` of `size` bytes of CUDA device memory at `device_data` on
  /// `device` (staged through pinned host memory, never read on the host directly). Throws
  /// `Error` Cuda where no CUDA driver or no such device exists.
  template <typename Duration = Clock::duration>
  Outcome send_device(RequestKey key, std::uint32_t to_rank, std::uint32_t segment, std::int32_t device,
                      std::uint64_t device_data, std::size_t size, std::chrono::time_point<Clock, Duration> deadline,
                      CancelRef cancel = {}) {
    return detail::outcome_from_code(detail::call([&] {
      return handle()->send_device(key.request, key.generation, to_rank, segment, device, device_data, size,
                                  detail::ms_until(deadline), cancel.address());
    }));
  }

  /// Generation rank, blocks: the agreed end of `key`, taken (a second wait for it throws
  /// UnknownRequest, as does a wait for a key never advertised here; one made while another
  /// thread waits for it throws InvalidArgument at once). Once it returns (any
  /// outcome) the receive buffers are the caller's again, except fenced ranges of a region
  /// (`region_fenced_ranges`). If `deadline` or `cancel` comes first
  /// the request is given up and the verdict awaited for at most the agreement bound. What it
  /// returns is this rank's end: an end that comes later (no verdict came by the bound: a peer
  /// frozen or cut off) is not handed to another wait, which throws UnknownRequest.
  template <typename Duration = Clock::duration>
  Outcome wait_receiver(RequestKey key, std::chrono::time_point<Clock, Duration> deadline, CancelRef cancel = {}) {
    return wait(key, true, 0, detail::ms_until(deadline), cancel);
  }

  /// Context rank, blocks: the agreed end of `key` as the sender to `receiver_rank` (taken, given
  /// up and final as for `wait_receiver`).
  template <typename Duration = Clock::duration>
  Outcome wait_sender(RequestKey key, std::uint32_t receiver_rank, std::chrono::time_point<Clock, Duration> deadline,
                      CancelRef cancel = {}) {
    return wait(key, false, receiver_rank, detail::ms_until(deadline), cancel);
  }

  /// Cancels `key` on this rank; every rank of the request ends `Cancelled`. Does not block.
  /// A request that already ended here, in either role (kept for 10 minutes, as long as a
  /// replay of its key is refused), is left as it ended and the call succeeds: a cancel that
  /// races the end is no error. Throws UnknownRequest if the key is not known here: it never ran,
  /// or it ended longer ago than replays are refused.
  void cancel(RequestKey key) { detail::call([&] { handle()->cancel(key.request, key.generation); }); }

  /// Queues an ordered notification for `to_rank`. Does not block. Throws UnknownPeer for a rank
  /// never connected here, PeerLost for one whose connection failed (reconnecting or failed).
  void notify(std::uint32_t to_rank, RequestKey key, const std::vector<std::uint8_t>& payload) {
    detail::call([&] { handle()->notify(to_rank, key.request, key.generation, detail::slice(payload)); });
  }

  /// Blocks: the next notification from `from_rank` in the order sent (each exactly once, to
  /// one waiting thread, waking only that one), or empty at the deadline or on cancel.
  template <typename Duration = Clock::duration>
  std::optional<Notification> wait_for_notification(std::uint32_t from_rank,
                                                    std::chrono::time_point<Clock, Duration> deadline,
                                                    CancelRef cancel = {}) {
    ffi::NotificationInfo n = detail::call([&] {
      return handle()->wait_for_notification(from_rank, detail::ms_until(deadline), cancel.address());
    });
    if (!n.found) return std::nullopt;
    return Notification{{n.request, n.generation}, std::vector<std::uint8_t>(n.payload.begin(), n.payload.end())};
  }

  /// How CUDA memory moves with this engine's UCX. Does not block.
  DevicePath device_path() const { return static_cast<DevicePath>(handle()->device_path()); }

  /// The progress snapshot. Does not block (takes the engine's lock briefly). Throws only
  /// `kvlink::Error` of kind `Panic`, should kvlink fail inside.
  Health health() const {
    const ffi::HealthInfo h = detail::call([&] { return handle()->health(); });
    return {static_cast<HealthState>(h.state), h.since_last_fault_ms,
            h.peers,           h.peers_failed,   h.requests_known,  h.completed,
            h.failed,          h.stale_dropped,  h.bad_frames,      h.buffers_leased,
            h.buffers_fenced,  h.ops_in_flight,  h.oldest_op_ms,    h.since_last_completion_ms,
            h.bytes_completed, h.unreaped_ops,    h.peers_reconnecting, h.reconnects,
            h.adverts_refused, h.notes_dropped,   h.unsettled_returns,  h.foreign_data,
            h.late_data,       h.refused_auth,    h.refused_rank_in_use, h.refused_version,
            h.refused_by_peer,
            h.receive_stuck,   h.worker_renewals, h.region_fenced_bytes, h.region_fences,
            h.resends,         h.duplicates,      h.unknown_dropped,
            h.early_kept,      h.ranks_forgotten, h.peers_left};
  }

  /// This engine's metrics in the Prometheus text format (version 0.0.4): `kvlink_requests_total`
  /// by outcome and role, `kvlink_request_duration_seconds`, `kvlink_transfer_bytes_total`, the
  /// in-flight, leased and fenced gauges, `kvlink_health_state`, and the frame, peer-failure and
  /// reconnect counters (README, "Metrics"). Serve it however the host serves its own metrics:
  /// kvlink opens no port. Does not block (takes the engine's lock briefly).
  std::string metrics_text() const {
    return detail::call([&] { return std::string(handle()->metrics_text()); });
  }

  /// The state of this rank's connection to `rank`. Does not block. Throws only
  /// `kvlink::Error` of kind `Panic`, should kvlink fail inside.
  PeerState peer_state(std::uint32_t rank) const {
    return static_cast<PeerState>(detail::call([&] { return handle()->peer_state(rank); }));
  }

 private:
  static ::rust::Box<ffi::EngineHandle> make(const EngineConfig& c) {
    if (c.timeout.count() <= 0) {
      throw Error(ErrorKind::InvalidArgument, "kvlink InvalidArgument: timeout must be positive");
    }
    const std::pair<const char*, std::chrono::milliseconds> windows[] = {
        {"linger", c.linger.value_or(std::chrono::milliseconds(0))},
        {"agreement_bound", c.agreement_bound},
        {"wedge_window", c.wedge_window},
        {"degraded_window", c.degraded_window},
    };
    for (const auto& [name, value] : windows) {
      if (value.count() < 0) {
        throw Error(ErrorKind::InvalidArgument, std::string("kvlink InvalidArgument: ") + name + " must not be negative");
      }
    }
    if (c.fault_suppress_request && *c.fault_suppress_request > std::uint64_t(INT64_MAX)) {
      throw Error(ErrorKind::InvalidArgument, "kvlink InvalidArgument: fault_suppress_request must not pass 2^63 - 1");
    }
    ffi::EngineOptions o;
    o.name = detail::string(c.name);
    o.rank = c.rank;
    o.transport = detail::string(c.transport);
    o.listen = detail::string(c.listen);
    o.timeout_ms = static_cast<std::uint64_t>(c.timeout.count());
    o.agreement_ms = c.agreement_bound.count() > 0 ? static_cast<std::uint64_t>(c.agreement_bound.count()) : 0;
    o.has_linger = c.linger.has_value();
    o.linger_ms = c.linger ? static_cast<std::uint64_t>(c.linger->count()) : 0;
    o.wedge_ms = c.wedge_window.count() > 0 ? static_cast<std::uint64_t>(c.wedge_window.count()) : 0;
    o.degraded_ms = c.degraded_window.count() > 0 ? static_cast<std::uint64_t>(c.degraded_window.count()) : 0;
    o.fault_suppress_request =
        c.fault_suppress_request ? static_cast<std::int64_t>(*c.fault_suppress_request) : -1;
    o.has_secret = c.secret.has_value();
    if (c.secret) {
      for (const char ch : *c.secret) o.secret.push_back(static_cast<std::uint8_t>(ch));
    }
    return detail::call([&] { return ffi::engine_new(o); });
  }

  Outcome wait(RequestKey key, bool as_receiver, std::uint32_t peer, std::uint64_t timeout_ms, CancelRef cancel) {
    return detail::outcome_from_code(detail::call([&] {
      return handle()->wait(key.request, key.generation, as_receiver, peer, timeout_ms,
                           cancel.address());
    }));
  }

  /// The Rust engine; `Shutdown` on a moved-from `Engine`, whose box is null (a null
  /// `&EngineHandle` must never reach Rust).
  const ffi::EngineHandle* handle() const {
    const ffi::EngineHandle* h = handle_.operator->();
    if (h == nullptr) {
      throw Error(ErrorKind::Shutdown, "kvlink Shutdown: this Engine was moved from; it holds no engine");
    }
    return h;
  }

  ::rust::Box<ffi::EngineHandle> handle_;
};

}  // namespace kvlink
