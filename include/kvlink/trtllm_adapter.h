// kvlink as a TensorRT-LLM KV-cache transfer backend: classes shaped like TensorRT-LLM's
// `AgentConnection` / `AgentConnectionManager` (and so also its generic `Connection` /
// `ConnectionManager`), implemented over `kvlink::Engine`.
//
// This is the only kvlink file that names TensorRT-LLM types. It includes TensorRT-LLM's
// headers by their upstream paths; in kvlink's own build those resolve to the stand-ins in
// cpp_tests/trtllm_shapes/. If upstream signatures drift, this file is what changes.
// See docs/TENSORRT_LLM.md for building TensorRT-LLM with it.
//
// Mapping
//   - Request identity: kvlink names a request by (64-bit request id, generation), taken from
//     `RequestInfo::getRequestId()` and the generation this manager tracks (0, or what
//     `nextAttempt` made it). The `DataContext` tag is only cross-checked: a data tag of
//     TensorRT-LLM's form `((id & 0xFFF) << 8) | 43` must match the connection's current request,
//     so a tag of a request 4096 ids away is refused instead of crossing.
//   - Generation rank: `sendRequestAndBufferInfo` = `Engine::advertise` of this rank's
//     pre-registered receive buffers; `recvReadySignalWithStatus` = `Engine::recv_ready`;
//     `recv(ctx, data, size)` = wait for the request's agreed outcome (`Engine::wait_receiver`),
//     then hand back the next segment (copied into `data` unless `data` is the buffer itself).
//   - Context rank: `recvConnectionAndRequestInfo` = `Engine::next_advertisement`;
//     `sendReadySignal` = `Engine::accept`; `send(ctx, data, size)` = `Engine::send` of the next
//     advertised segment; the last send also waits for the agreed verdict.
//   - Deadlines: `kv_transfer_timeout_ms` is `EngineConfig::timeout`, the per-request deadline
//     the ranks enforce and agree on by themselves. Each blocking call here is bounded by the
//     request's start + timeout + agreement bound (+1 s), so a lost completion ends as
//     `TimedOut` at the deadline on every rank, never as a hang and never as silent success.
//   - Cancel: every wait polls the `DataContext`'s transfer-terminate flag (the terminate flag
//     for `recvConnectionAndRequestInfo`); setting it ends the request `Cancelled` on every rank.
//     No opt-in switch is needed.
//   - Any outcome but `Completed` is thrown as `kvlink::trtllm::TransferError` (a
//     `std::runtime_error`, as TensorRT-LLM expects) whose `outcome()` says which; faults are
//     `kvlink::Error` with their stable kind.
//
// The TensorRT-LLM-specific methods are virtual here (upstream they are not) so that a manager
// made by the dlopen'ed wrapper library can be driven entirely through its vtable: a caller in
// another binary then never runs a second copy of this code or of the Rust library.
//
// One translation unit defines KVLINK_TRTLLM_IMPLEMENTATION before including this header: it
// gets the classes' key functions, hence their vtables and the code they reach. Other files only
// see declarations and inline code, so a binary that uses a manager made by the wrapper library
// (through its vtable) does not link a second copy of kvlink. The wrapper library's source
// defines KVLINK_TRTLLM_DEFINE_FACTORY, which implies it.
//
// Threading: both classes are thread safe (`isThreadSafe()` is true); a connection carries one
// request per direction at a time, as upstream's does. Destroy the manager only when no thread
// is inside it; connections it returned die with it.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <tensorrt_llm/batch_manager/dataTransceiver.h>
#include <tensorrt_llm/executor/cacheCommunicator.h>

#include "kvlink/kvlink.hpp"

namespace kvlink::trtllm {

namespace kv = ::tensorrt_llm::executor::kv_cache;
namespace bm = ::tensorrt_llm::batch_manager;

/// TensorRT-LLM's fixed tag for ready signals.
inline constexpr int kReadySignalTag = 42;

/// TensorRT-LLM's data tag of a request (12 bits of its id). Only used as a cross-check.
constexpr int dataTag(std::uint64_t requestId) noexcept {
  return static_cast<int>(((requestId & 0xFFFu) << 8) | 43u);
}

/// A transfer that ended in anything but `Completed`.
class TransferError : public std::runtime_error {
 public:
  TransferError(Outcome outcome, RequestKey key, const std::string& where)
      : std::runtime_error("kvlink " + where + ": request " + std::to_string(key.request) + "#" +
                           std::to_string(key.generation) + " ended " + to_string(outcome)),
        outcome_(outcome),
        key_(key) {}
  Outcome outcome() const noexcept { return outcome_; }
  RequestKey key() const noexcept { return key_; }

 private:
  Outcome outcome_;
  RequestKey key_;
};

class AgentConnectionManager;

/// A connection to one remote rank. Made and owned by `AgentConnectionManager`.
class AgentConnection : public kv::Connection {
 public:
  AgentConnection(AgentConnectionManager& manager, std::uint32_t remoteRank)
      : manager_(manager), remote_(remoteRank) {}
  ~AgentConnection() override;  // the key function: see KVLINK_TRTLLM_IMPLEMENTATION

  // --- kv::Connection ---
  /// Context rank, blocks: sends the next advertised segment of the current request.
  void send(kv::DataContext const& ctx, void const* data, size_t size) const override;
  /// Generation rank, blocks: waits for the current request's agreed outcome; then gives the
  /// next segment (copied into `data` when it is not the registered buffer itself).
  void recv(kv::DataContext const& ctx, void* data, size_t size) const override;
  [[nodiscard]] bool isThreadSafe() const noexcept override { return true; }
  /// Generation rank: the registered buffer of `bufferKind` reserved for this connection
  /// (reserving a free one on first use); empty if none is free.
  [[nodiscard]] std::optional<size_t> getPreAssignedBufferId(uint8_t bufferKind) const override;
  /// Generation rank: the reserved buffer of `bufferKind` goes into the next request sent.
  void activateBuffer(uint8_t bufferKind) const override;

  // --- AgentConnection ---
  /// Generation rank: advertises the request and this rank's buffers (`cacheBufferIds[kind]`, or
  /// the activated buffer of that kind) to the remote context rank. Does not block.
  /// `validConnectionIdx` is this context rank's index among the request's senders; kvlink gives
  /// each sender whole buffers of its own, so it is only checked.
  virtual void sendRequestAndBufferInfo(bm::RequestInfo& requestInfo,
                                        std::vector<std::optional<size_t>> const& cacheBufferIds,
                                        int validConnectionIdx);
  /// Context rank: accept or refuse the current request before any data moves.
  virtual void sendReadySignal(kv::DataContext const& ctx, bool isReady) const;
  /// Generation rank, blocks: the context rank's answer; empty on deadline or terminate.
  virtual std::optional<bool> recvReadySignalWithStatus(kv::DataContext const& ctx) const;

  std::uint32_t remoteRank() const noexcept { return remote_; }

 private:
  friend class AgentConnectionManager;
  struct Segment {
    std::uint32_t segment;
    std::uint64_t address;
    std::uint64_t size;
  };
  struct Receiving {  // generation rank
    RequestKey key;
    Deadline deadline;
    std::vector<Segment> segments;
    std::vector<std::pair<std::uint8_t, size_t>> slots;
    size_t next = 0;
    std::optional<Outcome> outcome;
  };
  struct Sending {  // context rank
    RequestKey key;
    Deadline deadline;
    std::vector<Segment> segments;
    size_t next = 0;
  };

  void checkTag(kv::DataContext const& ctx, RequestKey key) const;
  void finishReceiving() const;  // with mu_ held

  AgentConnectionManager& manager_;
  std::uint32_t remote_;
  mutable std::mutex mu_;
  mutable std::optional<Receiving> receiving_;
  mutable std::optional<Sending> sending_;
  mutable std::map<std::uint8_t, size_t> reserved_;
  mutable std::map<std::uint8_t, size_t> activated_;
};

/// One rank's connection manager over one `kvlink::Engine`.
class AgentConnectionManager : public kv::ConnectionManager {
 public:
  /// Creates the engine (listening per `config`). `config.timeout` is kv_transfer_timeout_ms.
  explicit AgentConnectionManager(EngineConfig const& config)
      : config_(config),
        engine_(config),
        commState_({kv::AgentState{config.name, engine_.address()}}, 0) {}
  ~AgentConnectionManager() override;  // the key function: see KVLINK_TRTLLM_IMPLEMENTATION
  AgentConnectionManager(AgentConnectionManager const&) = delete;
  AgentConnectionManager& operator=(AgentConnectionManager const&) = delete;

  // --- kv::ConnectionManager ---
  /// Context rank, blocks until an advertisement (or the ctx's terminate flag: nullptr); copies
  /// its raw request info into `data` (at most `size` bytes, InvalidArgument if it is longer).
  kv::Connection const* recvConnect(kv::DataContext const& ctx, void* data, size_t size) override {
    auto adv = nextAdvertisement(ctx.getTransferTerminate());
    if (!adv) return nullptr;
    if (adv->request_info.size() > size) {
      throw Error(ErrorKind::InvalidArgument, "kvlink InvalidArgument: request info does not fit");
    }
    if (!adv->request_info.empty()) std::memcpy(data, adv->request_info.data(), adv->request_info.size());
    return adopt(*adv);
  }
  /// Blocks (connect): a connection to every agent of `state` but this one.
  [[nodiscard]] std::vector<kv::Connection const*> getConnections(kv::CommState const& state) override {
    std::vector<kv::Connection const*> out;
    auto const& agents = state.getAgentState();
    for (size_t i = 0; i < agents.size(); ++i) {
      if (static_cast<int>(i) == state.getSelfIdx() && agents[i].mConnectionInfo == engine_.address()) continue;
      out.push_back(connectTo(agents[i].mConnectionInfo));
    }
    return out;
  }
  [[nodiscard]] kv::CommState const& getCommState() const override { return commState_; }
  [[nodiscard]] bool isRunning() const override { return running_.load(std::memory_order_acquire); }

  // --- AgentConnectionManager ---
  /// Context rank, blocks until the next request arrives (nullptr once `terminateFlag` is set
  /// or the manager stops): fills `requestInfo` and returns the connection it came on.
  virtual AgentConnection const* recvConnectionAndRequestInfo(bm::RequestInfo& requestInfo,
                                                              std::atomic<bool> const& terminateFlag) {
    auto adv = nextAdvertisement(terminateFlag);
    if (!adv) return nullptr;
    std::istringstream is(std::string(adv->request_info.begin(), adv->request_info.end()));
    requestInfo = bm::RequestInfo::deserialize(is);
    if (!is || requestInfo.getRequestId() != adv->key.request) {
      throw Error(ErrorKind::Protocol, "kvlink Protocol: request info does not match its request id");
    }
    return adopt(*adv);
  }
  /// Generation rank: registers host memory as receive buffer `bufferId` of `bufferKind` (the
  /// stand-in for TensorRT-LLM's cache transfer buffer manager). It must stay valid for the
  /// manager's life.
  virtual void registerReceiveBuffer(uint8_t bufferKind, size_t bufferId, void* data, size_t size) {
    if (data == nullptr || size == 0) {
      throw Error(ErrorKind::InvalidArgument, "kvlink InvalidArgument: empty receive buffer");
    }
    std::lock_guard<std::mutex> g(mu_);
    slots_[{bufferKind, bufferId}] = Slot{data, size, nullptr};
  }
  /// The next `sendRequestAndBufferInfo` of `requestId` is a new attempt (next generation).
  /// Without it, advertising a request id again is a replay and is refused.
  virtual void nextAttempt(std::uint64_t requestId) {
    std::lock_guard<std::mutex> g(mu_);
    ++generation_[requestId];
  }
  /// The engine's progress snapshot plus this manager's reserved buffers.
  virtual Health health() const { return engine_.health(); }
  /// Registered buffers currently reserved by a connection (0 when idle).
  virtual size_t buffersReserved() const {
    std::lock_guard<std::mutex> g(mu_);
    return static_cast<size_t>(std::count_if(slots_.begin(), slots_.end(), [](auto const& s) { return s.second.owner != nullptr; }));
  }
  /// Stops accepting (`isRunning()` false; `recvConnectionAndRequestInfo` returns nullptr).
  virtual void stop() { running_.store(false, std::memory_order_release); }

  /// The engine, for callers linked with kvlink itself.
  Engine& engine() noexcept { return engine_; }
  EngineConfig const& config() const noexcept { return config_; }

  /// Bound of every wait for a request started now: timeout + agreement bound + 1 s slack.
  Deadline requestDeadline() const {
    auto const agree = config_.agreement_bound.count() > 0 ? config_.agreement_bound : std::chrono::milliseconds(2000);
    return after(config_.timeout + agree + std::chrono::seconds(1));
  }

 private:
  friend class AgentConnection;
  struct Slot {
    void* data;
    size_t size;
    AgentConnection const* owner;
  };

  std::optional<Advertisement> nextAdvertisement(std::atomic<bool> const& terminate) {
    while (isRunning() && !terminate.load(std::memory_order_acquire)) {
      auto adv = engine_.next_advertisement(after(std::chrono::milliseconds(200)), terminate);
      if (adv) return adv;
    }
    return std::nullopt;
  }

  AgentConnection const* adopt(Advertisement const& adv) {
    AgentConnection* c = connectionFor(adv.from_rank);
    std::lock_guard<std::mutex> g(c->mu_);
    AgentConnection::Sending s{adv.key, requestDeadline(), {}, 0};
    for (auto const& b : adv.buffers) s.segments.push_back({b.segment, b.address, b.size});
    c->sending_ = std::move(s);
    return c;
  }

  AgentConnection* connectionFor(std::uint32_t rank) {
    std::lock_guard<std::mutex> g(mu_);
    auto& slot = connections_[rank];
    if (!slot) slot = std::make_unique<AgentConnection>(*this, rank);
    return slot.get();
  }

  AgentConnection const* connectTo(std::string const& address) {
    {
      std::lock_guard<std::mutex> g(mu_);
      auto it = byAddress_.find(address);
      if (it != byAddress_.end()) return it->second;
    }
    std::uint32_t const rank = engine_.connect(address, after(config_.timeout));
    AgentConnection* c = connectionFor(rank);
    std::lock_guard<std::mutex> g(mu_);
    byAddress_[address] = c;
    return c;
  }

  std::uint32_t generationOf(std::uint64_t requestId) const {
    std::lock_guard<std::mutex> g(mu_);
    auto it = generation_.find(requestId);
    return it == generation_.end() ? 0 : it->second;
  }

  std::optional<size_t> reserve(AgentConnection const* who, std::uint8_t kind, std::optional<size_t> id) {
    std::lock_guard<std::mutex> g(mu_);
    for (auto& [k, s] : slots_) {
      if (k.first != kind || (id && k.second != *id)) continue;
      if (s.owner == who) return k.second;
      if (s.owner == nullptr) {
        s.owner = who;
        return k.second;
      }
      if (id) throw Error(ErrorKind::InvalidArgument, "kvlink InvalidArgument: receive buffer " + std::to_string(*id) + " is in use");
    }
    if (id) throw Error(ErrorKind::InvalidArgument, "kvlink InvalidArgument: receive buffer " + std::to_string(*id) + " is not registered");
    return std::nullopt;
  }
  Slot slot(std::uint8_t kind, size_t id) const {
    std::lock_guard<std::mutex> g(mu_);
    return slots_.at({kind, id});
  }
  void release(AgentConnection const* who, std::uint8_t kind, size_t id) {
    std::lock_guard<std::mutex> g(mu_);
    auto it = slots_.find({kind, id});
    if (it != slots_.end() && it->second.owner == who) it->second.owner = nullptr;
  }

  EngineConfig config_;
  Engine engine_;
  kv::CommState commState_;
  std::atomic<bool> running_{true};
  mutable std::mutex mu_;
  std::map<std::pair<std::uint8_t, size_t>, Slot> slots_;
  std::map<std::uint64_t, std::uint32_t> generation_;
  std::map<std::string, AgentConnection const*> byAddress_;
  // Last member: connections go before the engine they use.
  std::map<std::uint32_t, std::unique_ptr<AgentConnection>> connections_;
};

// --- AgentConnection, out of line (it needs the manager) ------------------------------------

inline void AgentConnection::checkTag(kv::DataContext const& ctx, RequestKey key) const {
  int const tag = ctx.getTag();
  if ((tag & 0xFF) == 43 && tag != dataTag(key.request)) {
    throw Error(ErrorKind::InvalidArgument, "kvlink InvalidArgument: data tag " + std::to_string(tag) +
                                                " is not that of request " + std::to_string(key.request));
  }
}

inline void AgentConnection::finishReceiving() const {
  for (auto const& [kind, id] : receiving_->slots) {
    manager_.release(this, kind, id);
    reserved_.erase(kind);
  }
  receiving_.reset();
}

inline std::optional<size_t> AgentConnection::getPreAssignedBufferId(uint8_t bufferKind) const {
  std::lock_guard<std::mutex> g(mu_);
  auto it = reserved_.find(bufferKind);
  if (it != reserved_.end()) return it->second;
  auto id = manager_.reserve(this, bufferKind, std::nullopt);
  if (id) reserved_[bufferKind] = *id;
  return id;
}

inline void AgentConnection::activateBuffer(uint8_t bufferKind) const {
  std::lock_guard<std::mutex> g(mu_);
  auto it = reserved_.find(bufferKind);
  if (it == reserved_.end()) {
    throw Error(ErrorKind::InvalidArgument, "kvlink InvalidArgument: no buffer pre-assigned for kind " +
                                                std::to_string(bufferKind));
  }
  activated_[bufferKind] = it->second;
}

inline void AgentConnection::sendRequestAndBufferInfo(bm::RequestInfo& requestInfo,
                                                      std::vector<std::optional<size_t>> const& cacheBufferIds,
                                                      int validConnectionIdx) {
  if (validConnectionIdx < 0) {
    throw Error(ErrorKind::InvalidArgument, "kvlink InvalidArgument: negative connection index");
  }
  std::lock_guard<std::mutex> g(mu_);
  if (receiving_) {
    if (!receiving_->outcome) {
      throw Error(ErrorKind::InvalidArgument, "kvlink InvalidArgument: a request is still receiving on this connection");
    }
    finishReceiving();
  }
  RequestKey const key{requestInfo.getRequestId(), manager_.generationOf(requestInfo.getRequestId())};
  Receiving r{key, Deadline{}, {}, {}, 0, std::nullopt};
  std::vector<Buffer> buffers;
  auto const undo = [&] {
    for (auto const& [kind, id] : r.slots) manager_.release(this, kind, id);
  };
  try {
    for (size_t k = 0; k < cacheBufferIds.size(); ++k) {
      auto const kind = static_cast<std::uint8_t>(k);
      std::optional<size_t> id = cacheBufferIds[k];
      if (!id) {
        auto a = activated_.find(kind);
        if (a == activated_.end()) continue;
        id = a->second;
      }
      id = manager_.reserve(this, kind, id);
      r.slots.emplace_back(kind, *id);
      auto const s = manager_.slot(kind, *id);
      auto const seg = static_cast<std::uint32_t>(buffers.size());
      buffers.push_back(Buffer{static_cast<BufferKind>(kind), seg, s.data, s.size});
      r.segments.push_back({seg, reinterpret_cast<std::uint64_t>(s.data), s.size});
    }
    if (buffers.empty()) throw Error(ErrorKind::InvalidArgument, "kvlink InvalidArgument: no receive buffer for the request");
    std::ostringstream os;
    bm::RequestInfo::serialize(requestInfo, os);
    std::string const info = os.str();
    r.deadline = manager_.requestDeadline();
    manager_.engine_.advertise(key, {}, remote_, buffers, std::vector<std::uint8_t>(info.begin(), info.end()));
  } catch (...) {
    undo();
    throw;
  }
  activated_.clear();
  receiving_ = std::move(r);
}

inline std::optional<bool> AgentConnection::recvReadySignalWithStatus(kv::DataContext const& ctx) const {
  std::unique_lock<std::mutex> g(mu_);
  if (!receiving_) throw Error(ErrorKind::InvalidArgument, "kvlink InvalidArgument: no request sent on this connection");
  RequestKey const key = receiving_->key;
  Deadline const deadline = receiving_->deadline;
  g.unlock();
  auto ready = manager_.engine_.recv_ready(key, deadline, ctx.getTransferTerminate());
  if (ready && *ready) return ready;
  // Refused, terminated or no answer: the request is over; settle it so its buffers come back.
  if (!ready) {
    try {
      manager_.engine_.cancel(key);
    } catch (Error const&) {
      // Already ended: nothing to cancel.
    }
  }
  Outcome const o = manager_.engine_.wait_receiver(key, deadline);
  g.lock();
  if (receiving_ && receiving_->key == key) {
    receiving_->outcome = o;
    finishReceiving();
  }
  return ready;
}

inline void AgentConnection::recv(kv::DataContext const& ctx, void* data, size_t size) const {
  std::unique_lock<std::mutex> g(mu_);
  if (!receiving_) throw Error(ErrorKind::InvalidArgument, "kvlink InvalidArgument: no request receiving on this connection");
  RequestKey const key = receiving_->key;
  checkTag(ctx, key);
  if (!receiving_->outcome) {
    Deadline const deadline = receiving_->deadline;
    g.unlock();
    Outcome const o = manager_.engine_.wait_receiver(key, deadline, ctx.getTransferTerminate());
    g.lock();
    if (!receiving_ || receiving_->key != key) throw TransferError(o, key, "recv");
    receiving_->outcome = o;
  }
  Outcome const o = *receiving_->outcome;
  if (o != Outcome::Completed) {
    finishReceiving();
    throw TransferError(o, key, "recv");
  }
  Segment const seg = receiving_->segments.at(receiving_->next++);
  if (data != nullptr && reinterpret_cast<std::uint64_t>(data) != seg.address) {
    if (size > seg.size) {
      throw Error(ErrorKind::OutOfBounds, "kvlink OutOfBounds: recv of " + std::to_string(size) +
                                              " bytes from a " + std::to_string(seg.size) + "-byte segment");
    }
    std::memcpy(data, reinterpret_cast<void const*>(seg.address), size);
  }
  if (receiving_->next == receiving_->segments.size()) finishReceiving();
}

inline void AgentConnection::sendReadySignal(kv::DataContext const& ctx, bool isReady) const {
  (void)ctx;
  std::lock_guard<std::mutex> g(mu_);
  if (!sending_) throw Error(ErrorKind::InvalidArgument, "kvlink InvalidArgument: no request to answer on this connection");
  manager_.engine_.accept(sending_->key, remote_, isReady);
  if (!isReady) sending_.reset();
}

inline void AgentConnection::send(kv::DataContext const& ctx, void const* data, size_t size) const {
  std::unique_lock<std::mutex> g(mu_);
  if (!sending_) throw Error(ErrorKind::InvalidArgument, "kvlink InvalidArgument: no accepted request on this connection");
  RequestKey const key = sending_->key;
  checkTag(ctx, key);
  if (sending_->next >= sending_->segments.size()) {
    throw Error(ErrorKind::InvalidArgument, "kvlink InvalidArgument: more sends than advertised segments");
  }
  Segment const seg = sending_->segments[sending_->next++];
  bool const last = sending_->next == sending_->segments.size();
  Deadline const deadline = sending_->deadline;
  if (last) sending_.reset();
  g.unlock();
  Engine& e = manager_.engine_;
  std::atomic<bool> const& terminate = ctx.getTransferTerminate();
  Outcome o = Outcome::Cancelled;
  if (!terminate.load(std::memory_order_acquire)) {
    o = e.send(key, remote_, seg.segment, data, size, deadline, terminate);
  } else {
    try {
      e.cancel(key);  // terminated between segments: nothing more goes on the wire
    } catch (Error const&) {
      // Already ended: the verdict below says how.
    }
  }
  if (o == Outcome::Completed && !last) return;
  // The last segment, or a send that did not complete: what counts is the verdict every rank
  // agrees on (a send cancelled after its bytes had all landed may still be agreed Completed).
  Outcome const verdict = e.wait_sender(key, remote_, deadline, o == Outcome::Completed ? terminate : CancelRef{});
  if (!last || verdict != Outcome::Completed) {
    g.lock();
    if (sending_ && sending_->key == key) sending_.reset();
  }
  if (verdict != Outcome::Completed) throw TransferError(verdict, key, "send");
}

}  // namespace kvlink::trtllm

#if defined(KVLINK_TRTLLM_IMPLEMENTATION) || defined(KVLINK_TRTLLM_DEFINE_FACTORY)
kvlink::trtllm::AgentConnection::~AgentConnection() = default;
kvlink::trtllm::AgentConnectionManager::~AgentConnectionManager() = default;
#endif

// --- The wrapper library's factory (what TensorRT-LLM dlopens) ------------------------------

extern "C" {

/// Options of `makeKvlinkConnectionManager`. Plain C so the library can be loaded with dlopen
/// by code built separately. `struct_size` must be `sizeof(KvlinkManagerOptions)`.
struct KvlinkManagerOptions {
  size_t struct_size;
  char const* name;
  uint32_t rank;
  char const* transport;  ///< "tcp", "sm", "auto" or a UCX transport list, "@devices" optional (EngineConfig)
  char const* listen;     ///< tcp listen address ("127.0.0.1:0"), or NULL / "" for none
  uint64_t kv_transfer_timeout_ms;
  uint64_t agreement_ms;  ///< 0: the default
  int64_t fault_suppress_request;  ///< -1: none (a test hook)
};

/// The factory's type, for `dlsym`. Returns a new manager (delete it through the base class), or
/// NULL with a message in `error` (at most `error_size` bytes, NUL-terminated).
typedef ::tensorrt_llm::executor::kv_cache::ConnectionManager* (*KvlinkMakeConnectionManagerFn)(
    KvlinkManagerOptions const* options, char* error, size_t error_size);

}  // extern "C"

#ifdef KVLINK_TRTLLM_DEFINE_FACTORY
extern "C" __attribute__((visibility("default"))) ::tensorrt_llm::executor::kv_cache::ConnectionManager*
makeKvlinkConnectionManager(KvlinkManagerOptions const* o, char* error, size_t error_size) {
  auto const fail = [&](char const* what) -> ::tensorrt_llm::executor::kv_cache::ConnectionManager* {
    if (error != nullptr && error_size > 0) {
      std::strncpy(error, what, error_size - 1);
      error[error_size - 1] = '\0';
    }
    return nullptr;
  };
  if (o == nullptr || o->struct_size != sizeof(KvlinkManagerOptions)) return fail("bad KvlinkManagerOptions");
  try {
    kvlink::EngineConfig c;
    c.name = o->name ? o->name : "";
    c.rank = o->rank;
    c.transport = o->transport ? o->transport : "tcp";
    c.listen = o->listen ? o->listen : "";
    c.timeout = std::chrono::milliseconds(o->kv_transfer_timeout_ms);
    c.agreement_bound = std::chrono::milliseconds(o->agreement_ms);
    if (o->fault_suppress_request >= 0) c.fault_suppress_request = static_cast<uint64_t>(o->fault_suppress_request);
    return new kvlink::trtllm::AgentConnectionManager(c);
  } catch (std::exception const& e) {
    return fail(e.what());
  }
}
#endif
