// STAND-IN, written for kvlink (not TensorRT-LLM code): our declaration of the communication
// state that a ConnectionManager publishes and that the other instance connects to.
//
// Pinned upstream (NVIDIA/TensorRT-LLM):
//   cpp/include/tensorrt_llm/executor/dataTransceiverState.h @12af636eef5463ace5c26c9636bea37ebd212d44
// Declared here: MpiState, SocketState, AgentState, CommState (the variant of the three plus
// selfIdx) and DataTransceiverState. Left out: CacheState (the model layout, which kvlink never
// reads); DataTransceiverState keeps an opaque stand-in for it so the call-site test can carry
// one. Namespace: 12af636e writes `namespace tensorrt_llm::executor`; cacheCommunicator.h
// @3585984b opens the same namespace through TRTLLM_NAMESPACE_BEGIN (inline `_v1`). Both must
// name ONE namespace: a plain `namespace tensorrt_llm::executor` extends the `_v1` one only if
// the `_v1` one was declared first, so these stand-ins all use the macro (as the release with
// `_v1` does throughout) and any include order works.
#pragma once

#include "tensorrt_llm/common/config.h"

#include <cstdint>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <variant>
#include <vector>

TRTLLM_NAMESPACE_BEGIN
namespace executor {
namespace kv_cache {

/// Upstream: the layout of a rank's KV cache (model config, parallel config, data type). Not
/// read by kvlink; this stand-in holds the bytes a test wants to compare.
class CacheState final {
 public:
  CacheState() = default;
  explicit CacheState(std::string opaque) : mOpaque(std::move(opaque)) {}
  [[nodiscard]] bool operator==(CacheState const& other) const noexcept { return mOpaque == other.mOpaque; }
  [[nodiscard]] std::string const& opaque() const noexcept { return mOpaque; }

 private:
  std::string mOpaque;
};

struct MpiState {
  [[nodiscard]] bool operator==(MpiState const& other) const noexcept { return mRanks == other.mRanks; }
  std::vector<int> mRanks;
};

struct SocketState {
  [[nodiscard]] bool operator==(SocketState const& other) const noexcept {
    return mPort == other.mPort && mIp == other.mIp;
  }
  [[nodiscard]] std::string toString() const { return mIp + ":" + std::to_string(mPort); }
  std::uint16_t mPort;
  std::string mIp;
};

/// One agent: its name and how to reach it (kvlink: its engine address).
struct AgentState {
  AgentState(std::string agentName, std::string connectionInfo)
      : mAgentName(std::move(agentName)), mConnectionInfo(std::move(connectionInfo)) {}
  AgentState() = default;
  [[nodiscard]] bool operator==(AgentState const& other) const noexcept {
    return mAgentName == other.mAgentName && mConnectionInfo == other.mConnectionInfo;
  }
  [[nodiscard]] std::string toString() const { return mAgentName; }
  std::string mAgentName;
  std::string mConnectionInfo;
};

/// How to reach every rank of one instance, and which one is this (`selfIdx`, the rank).
class CommState final {
 public:
  CommState() = default;
  explicit CommState(std::vector<int> ranks, int selfIdx = -1)
      : mState{MpiState{std::move(ranks)}}, mSelfIdx{selfIdx} {}
  explicit CommState(std::vector<SocketState> socketState, int selfIdx = -1)
      : mState{std::move(socketState)}, mSelfIdx{selfIdx} {}
  CommState(std::uint16_t port, std::string ip)
      : mState{std::vector<SocketState>{SocketState{port, std::move(ip)}}}, mSelfIdx{0} {}
  explicit CommState(std::vector<AgentState> agentState, int selfIdx = -1)
      : mState{std::move(agentState)}, mSelfIdx{selfIdx} {}

  [[nodiscard]] bool isMpiState() const noexcept { return std::holds_alternative<MpiState>(mState); }
  [[nodiscard]] bool isSocketState() const noexcept {
    return std::holds_alternative<std::vector<SocketState>>(mState);
  }
  [[nodiscard]] bool isAgentState() const noexcept {
    return std::holds_alternative<std::vector<AgentState>>(mState);
  }
  [[nodiscard]] MpiState const& getMpiState() const { return get<MpiState>(); }
  [[nodiscard]] std::vector<SocketState> const& getSocketState() const { return get<std::vector<SocketState>>(); }
  [[nodiscard]] std::vector<AgentState> const& getAgentState() const { return get<std::vector<AgentState>>(); }
  [[nodiscard]] int getSelfIdx() const noexcept { return mSelfIdx; }
  [[nodiscard]] bool operator==(CommState const& other) const noexcept { return mState == other.mState; }

 private:
  // Upstream checks with TLLM_CHECK (throws); the stand-in throws a standard exception.
  template <typename T>
  T const& get() const {
    if (!std::holds_alternative<T>(mState)) throw std::logic_error("CommState: other variant");
    return std::get<T>(mState);
  }
  std::variant<std::monostate, MpiState, std::vector<SocketState>, std::vector<AgentState>> mState;
  int mSelfIdx{-1};
};

}  // namespace kv_cache

/// What each side of a transfer knows about the other: its cache layout and how to reach it.
class DataTransceiverState final {
 public:
  DataTransceiverState() = default;
  DataTransceiverState(kv_cache::CacheState cacheState, kv_cache::CommState commState)
      : mCacheState{std::move(cacheState)}, mCommState{std::move(commState)} {}
  void setCacheState(kv_cache::CacheState state) { mCacheState = std::move(state); }
  [[nodiscard]] std::optional<kv_cache::CacheState> const& getCacheState() const noexcept { return mCacheState; }
  void setCommState(kv_cache::CommState state) { mCommState = std::move(state); }
  [[nodiscard]] std::optional<kv_cache::CommState> const& getCommState() const noexcept { return mCommState; }
  [[nodiscard]] bool operator==(DataTransceiverState const& other) const noexcept {
    return mCacheState == other.mCacheState && mCommState == other.mCommState;
  }

 private:
  std::optional<kv_cache::CacheState> mCacheState;
  std::optional<kv_cache::CommState> mCommState;
};

}  // namespace executor
TRTLLM_NAMESPACE_END
