// STAND-IN, written for kvlink (not TensorRT-LLM code): the parts of the batch manager's
// transceiver header that the generic cache-transfer path puts on a Connection.
//
// Pinned upstream (NVIDIA/TensorRT-LLM):
//   cpp/tensorrt_llm/batch_manager/dataTransceiver.h @3277953654b9b2863dae4f1cb81856b172837db4
//     (TransceiverTag, RequestInfo), with RequestInfo's serialization as
//   cpp/tensorrt_llm/batch_manager/dataTransceiver.cpp defines it: the 64-bit request id first
//     (native byte order), then indexFromEnd, lastBlockKey and the DataTransceiverState.
// kvlink relies on one fact of it: a serialized RequestInfo begins with its u64 request id. The
// rest of this stand-in's encoding is ours (upstream's serialize_utils is not reproduced).
#pragma once

#include "tensorrt_llm/common/config.h"
#include "tensorrt_llm/executor/dataTransceiverState.h"

#include <cstdint>
#include <cstring>
#include <istream>
#include <ostream>
#include <string>
#include <utility>

TRTLLM_NAMESPACE_BEGIN
namespace batch_manager {

/// The fixed tags of the request-info envelope and of the ready signal (upstream values).
struct TransceiverTag {
  enum class Id : uint64_t { REQUEST_SEND = 1, TERMINATION = 2 };

  static constexpr int32_t kID_TAG{19};
  static constexpr int32_t kINFO_SIZE_TAG{22};
  static constexpr int32_t kINFO_TAG{32};
  static constexpr int32_t kREADY_SIGNAL_TAG{42};
};

/// What the generation side sends the context side to ask for a request's cache.
class RequestInfo {
 public:
  using RequestIdType = std::uint64_t;

  RequestInfo() = default;
  RequestInfo(RequestIdType requestId, executor::DataTransceiverState transState)
      : mRequestId{requestId}, mTransState{std::move(transState)} {}
  RequestInfo(RequestIdType requestId, executor::DataTransceiverState transState, int32_t indexFromEnd,
              std::string lastBlockKey)
      : mRequestId{requestId}, mIndexFromEnd{indexFromEnd}, mLastBlockKey{std::move(lastBlockKey)},
        mTransState{std::move(transState)} {}

  bool operator==(RequestInfo const& rhs) const {
    return mRequestId == rhs.mRequestId && mIndexFromEnd == rhs.mIndexFromEnd &&
           mLastBlockKey == rhs.mLastBlockKey && mTransState == rhs.mTransState;
  }
  [[nodiscard]] RequestIdType getRequestId() const noexcept { return mRequestId; }
  [[nodiscard]] executor::DataTransceiverState const& getTransState() const noexcept { return mTransState; }
  [[nodiscard]] int32_t getIndexFromEnd() const noexcept { return mIndexFromEnd; }
  /// Upstream: a kv_cache_manager::BlockKey; opaque here.
  [[nodiscard]] std::string const& getLastBlockKey() const noexcept { return mLastBlockKey; }

  static void serialize(RequestInfo const& info, std::ostream& os) {
    put(os, info.mRequestId);  // first, as upstream: the one field kvlink reads
    put(os, info.mIndexFromEnd);
    putString(os, info.mLastBlockKey);
    auto const& cache = info.mTransState.getCacheState();
    putString(os, cache ? cache->opaque() : std::string());
    auto const& comm = info.mTransState.getCommState();
    put(os, static_cast<int32_t>(comm ? comm->getSelfIdx() : -1));
    auto const n = static_cast<uint64_t>(comm && comm->isAgentState() ? comm->getAgentState().size() : 0);
    put(os, n);
    for (uint64_t i = 0; i < n; ++i) {
      putString(os, comm->getAgentState()[i].mAgentName);
      putString(os, comm->getAgentState()[i].mConnectionInfo);
    }
  }
  static RequestInfo deserialize(std::istream& is) {
    RequestInfo r;
    r.mRequestId = get<RequestIdType>(is);
    r.mIndexFromEnd = get<int32_t>(is);
    r.mLastBlockKey = getString(is);
    std::string cache = getString(is);
    auto const self = get<int32_t>(is);
    auto const n = get<uint64_t>(is);
    std::vector<executor::kv_cache::AgentState> agents;
    for (uint64_t i = 0; i < n && is; ++i) {
      std::string name = getString(is);
      agents.emplace_back(std::move(name), getString(is));
    }
    r.mTransState = executor::DataTransceiverState(executor::kv_cache::CacheState(std::move(cache)),
                                                   executor::kv_cache::CommState(std::move(agents), self));
    return r;
  }
  static std::size_t serializedSize(RequestInfo const& info) {
    std::ostringstream os;
    serialize(info, os);
    return os.str().size();
  }

 private:
  template <typename T>
  static void put(std::ostream& os, T v) {
    os.write(reinterpret_cast<char const*>(&v), sizeof v);
  }
  template <typename T>
  static T get(std::istream& is) {
    T v{};
    is.read(reinterpret_cast<char*>(&v), sizeof v);
    return v;
  }
  static void putString(std::ostream& os, std::string const& s) {
    put(os, static_cast<uint64_t>(s.size()));
    os.write(s.data(), static_cast<std::streamsize>(s.size()));
  }
  static std::string getString(std::istream& is) {
    auto const n = get<uint64_t>(is);
    if (!is || n > (1u << 20)) return {};
    std::string s(static_cast<size_t>(n), '\0');
    is.read(s.data(), static_cast<std::streamsize>(n));
    return s;
  }

  RequestIdType mRequestId{0};
  int32_t mIndexFromEnd{0};
  std::string mLastBlockKey;
  executor::DataTransceiverState mTransState;
};

}  // namespace batch_manager
TRTLLM_NAMESPACE_END
