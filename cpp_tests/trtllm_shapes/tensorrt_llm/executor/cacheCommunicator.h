// STAND-IN: mirrors the shapes of TensorRT-LLM's executor/cacheCommunicator.h (DataContext,
// Connection, ConnectionManager) and of its agent CommState, for compiling kvlink's adapter
// without TensorRT-LLM. Written for kvlink; see ../../README.md. Not TensorRT-LLM code.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace tensorrt_llm::executor::kv_cache {

/// The per-call context: an int tag and the transfer-terminate (cancel) flag.
class DataContext {
 public:
  explicit DataContext(int tag) : tag_(tag), terminate_(&unset()) {}
  DataContext(int tag, std::atomic<bool> const& transferTerminate) : tag_(tag), terminate_(&transferTerminate) {}

  [[nodiscard]] int getTag() const noexcept { return tag_; }
  [[nodiscard]] std::atomic<bool> const& getTransferTerminate() const noexcept { return *terminate_; }

 private:
  static std::atomic<bool> const& unset() {
    static std::atomic<bool> const never{false};
    return never;
  }
  int tag_;
  std::atomic<bool> const* terminate_;
};

/// One agent of a deployment: its name and how to reach it.
struct AgentState {
  std::string mAgentName;
  std::string mConnectionInfo;
};

/// How to reach a set of ranks (the agent variant only) and which of them is this one.
class CommState {
 public:
  CommState() = default;
  CommState(std::vector<AgentState> agentState, int selfIdx) : agents_(std::move(agentState)), self_(selfIdx) {}
  [[nodiscard]] bool isAgentState() const noexcept { return !agents_.empty(); }
  [[nodiscard]] std::vector<AgentState> const& getAgentState() const noexcept { return agents_; }
  [[nodiscard]] int getSelfIdx() const noexcept { return self_; }

 private:
  std::vector<AgentState> agents_;
  int self_ = -1;
};

/// A connection to one remote rank.
class Connection {
 public:
  virtual ~Connection() = default;
  virtual void send(DataContext const& ctx, void const* data, size_t size) const = 0;
  virtual void recv(DataContext const& ctx, void* data, size_t size) const = 0;
  [[nodiscard]] virtual bool isThreadSafe() const noexcept { return false; }
  /// Newer releases: a buffer of `bufferKind` pre-assigned to this connection, and activating it.
  [[nodiscard]] virtual std::optional<size_t> getPreAssignedBufferId(uint8_t bufferKind) const {
    (void)bufferKind;
    return std::nullopt;
  }
  virtual void activateBuffer(uint8_t bufferKind) const { (void)bufferKind; }
};

/// Builds and hands out connections.
class ConnectionManager {
 public:
  virtual ~ConnectionManager() = default;
  virtual Connection const* recvConnect(DataContext const& ctx, void* data, size_t size) = 0;
  [[nodiscard]] virtual std::vector<Connection const*> getConnections(CommState const& state) = 0;
  [[nodiscard]] virtual CommState const& getCommState() const = 0;
  [[nodiscard]] virtual bool isRunning() const { return true; }
};

}  // namespace tensorrt_llm::executor::kv_cache
