// STAND-IN, written for kvlink (not TensorRT-LLM code): our declaration of the generic cache
// transfer interface, to compile kvlink's adapter and its tests without TensorRT-LLM.
//
// Pinned upstream (NVIDIA/TensorRT-LLM):
//   cpp/include/tensorrt_llm/executor/cacheCommunicator.h @3585984b32cded5cc002d3087d3da4b0fd9fb8a5
//     (the newest stored version: DataContext, Connection, ConnectionManager, in the inline
//     `_v1` namespace), extended by the members that
//   cpp/tensorrt_llm/executor/cache_transmission/agent_utils/connection.h
//     @0649223e9dce0aea4ba9ad6ac030582f6e62d37d overrides or calls, and that
//   cpp/tensorrt_llm/batch_manager/dataTransceiver.cpp (the stored version with 23-bit request
//     tags) calls: DataContext's transfer-terminate flag (`DataContext{tag, flag}`,
//     `getTransferTerminate()`), Connection::activateBuffer / getPreAssignedBufferId, and
//     ConnectionManager::isRunning. Where 3585984b does not show a member, its exact spelling
//     (default body, const-ness) is taken from those call and override sites.
// Every member below is one an upstream caller uses; the comment on each names where.
#pragma once

#include "tensorrt_llm/common/config.h"

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

TRTLLM_NAMESPACE_BEGIN
namespace executor::kv_cache {

class CommState;  // dataTransceiverState.h

/// cacheCommunicator.h: the per-call context. The tag says which message this is; the
/// terminate flag (newer releases; dataTransceiver.cpp builds `DataContext{tag, *cancelFlag}`)
/// asks a blocked call to give up.
struct DataContext {
 public:
  explicit DataContext(int tag) : mTag{tag}, mTransferTerminate{&neverTerminate()} {}
  DataContext(int tag, std::atomic<bool> const& transferTerminate)
      : mTag{tag}, mTransferTerminate{&transferTerminate} {}

  [[nodiscard]] int getTag() const noexcept { return mTag; }
  [[nodiscard]] std::atomic<bool> const& getTransferTerminate() const noexcept { return *mTransferTerminate; }

 private:
  static std::atomic<bool> const& neverTerminate() noexcept {
    static std::atomic<bool> const flag{false};
    return flag;
  }
  int const mTag;
  std::atomic<bool> const* mTransferTerminate;
};

/// cacheCommunicator.h: one connection to one remote rank. TransferSession::send / recv
/// (dataTransceiver.cpp) call `send` / `recv`; connection.h overrides the buffer members.
class Connection {
 public:
  virtual ~Connection() = default;

  virtual void send(DataContext const& ctx, void const* data, size_t size) const = 0;

  virtual void recv(DataContext const& ctx, void* data, size_t size) const = 0;

  [[nodiscard]] virtual bool isThreadSafe() const noexcept { return false; }

  /// connection.h @0649223e overrides these (agent path: pre-assigned receive buffers).
  virtual void activateBuffer(uint8_t kind) const { (void)kind; }

  [[nodiscard]] virtual std::optional<size_t> getPreAssignedBufferId(uint8_t kind) const {
    (void)kind;
    return std::nullopt;
  }
};

/// cacheCommunicator.h: makes and hands out connections. CacheSender::Impl calls
/// `recvConnect` and `getCommState`; CacheReceiver::Impl calls `getConnections(contextCommState)`
/// and indexes the result by rank; `isRunning` is overridden by connection.h @0649223e.
class ConnectionManager {
 public:
  virtual ~ConnectionManager() = default;

  virtual Connection const* recvConnect(DataContext const& ctx, void* data, size_t size) = 0;

  [[nodiscard]] virtual std::vector<Connection const*> getConnections(CommState const& state) = 0;

  [[nodiscard]] virtual CommState const& getCommState() const = 0;

  [[nodiscard]] virtual bool isRunning() const { return true; }
};

}  // namespace executor::kv_cache
TRTLLM_NAMESPACE_END
