// STAND-IN: mirrors the shape of TensorRT-LLM's batch_manager RequestInfo (a request id plus
// serialized transfer state, with static serialize / deserialize / serializedSize), for
// compiling kvlink's adapter without TensorRT-LLM. Written for kvlink; not TensorRT-LLM code.
#pragma once

#include <cstddef>
#include <cstdint>
#include <istream>
#include <ostream>
#include <string>
#include <utility>

namespace tensorrt_llm::batch_manager {

class RequestInfo {
 public:
  using RequestIdType = std::uint64_t;

  RequestInfo() = default;
  RequestInfo(RequestIdType requestId, std::string transState) : id_(requestId), state_(std::move(transState)) {}

  [[nodiscard]] RequestIdType getRequestId() const noexcept { return id_; }
  [[nodiscard]] std::string const& getTransState() const noexcept { return state_; }
  bool operator==(RequestInfo const& o) const { return id_ == o.id_ && state_ == o.state_; }

  static void serialize(RequestInfo const& info, std::ostream& os) {
    write(os, info.id_);
    write(os, static_cast<std::uint64_t>(info.state_.size()));
    os.write(info.state_.data(), static_cast<std::streamsize>(info.state_.size()));
  }
  static RequestInfo deserialize(std::istream& is) {
    RequestInfo r;
    r.id_ = read(is);
    const std::uint64_t n = read(is);
    r.state_.resize(static_cast<size_t>(n));
    is.read(r.state_.data(), static_cast<std::streamsize>(n));
    return r;
  }
  static size_t serializedSize(RequestInfo const& info) { return 16 + info.state_.size(); }

 private:
  static void write(std::ostream& os, std::uint64_t v) { os.write(reinterpret_cast<char const*>(&v), sizeof v); }
  static std::uint64_t read(std::istream& is) {
    std::uint64_t v = 0;
    is.read(reinterpret_cast<char*>(&v), sizeof v);
    return v;
  }
  RequestIdType id_ = 0;
  std::string state_;
};

}  // namespace tensorrt_llm::batch_manager
