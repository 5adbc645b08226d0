/* kvlink as TensorRT-LLM's KV-cache transfer backend: the factory of libkvlink_trtllm_wrapper.so.
 *
 * The wrapper library implements TensorRT-LLM's generic `ConnectionManager` / `Connection`
 * (cpp/include/tensorrt_llm/executor/cacheCommunicator.h), the interface its UCX backend
 * implements, so TensorRT-LLM's CacheSender / CacheReceiver and cache formatters drive it
 * unchanged. TensorRT-LLM loads it the way it loads the UCX wrapper: `dlopen` +
 * `dlsym("makeKvlinkConnectionManager")`. It exports that one symbol and links nothing of
 * TensorRT-LLM (`-Wl,--no-undefined`): the request info is carried as opaque bytes, of which
 * kvlink reads only the leading 64-bit request id.
 *
 * This header is plain C (and C++): it names no TensorRT-LLM type, so it can be included on
 * either side with no include path beyond kvlink's. The factory returns the manager as `void*`;
 * it is a `tensorrt_llm::executor::kv_cache::ConnectionManager*` (built against the headers
 * named in docs/TENSORRT_LLM.md): delete it through that type.
 *
 * See docs/TENSORRT_LLM.md and docs/trtllm/ for the upstream patch and configuration.
 */
#ifndef KVLINK_TRTLLM_ADAPTER_H
#define KVLINK_TRTLLM_ADAPTER_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/** The symbol to `dlsym`. */
#define KVLINK_TRTLLM_FACTORY_SYMBOL "makeKvlinkConnectionManager"

/** Exchanges one fixed-size record per rank among the `world_size` ranks of this instance (a
 * TensorRT-LLM allgather over its session communicator): writes rank r's `size` bytes at
 * `all + r * size`. Returns 0 on success. */
typedef int (*KvlinkAllgatherFn)(void* user, const void* mine, size_t size, void* all);

/** Receives every kvlink log event at or above `log_level`: `level` is 1 error, 2 warning,
 * 3 info, 4 debug, 5 trace; `message` (not NUL-terminated, `length` bytes) holds the target,
 * the message and the structured fields (request=..., generation=..., peer=...). Called on
 * kvlink's threads, possibly concurrently: it must be quick and thread-safe. */
typedef void (*KvlinkLogFn)(void* user, int level, const char* message, size_t length);

/** Options of the factory. Zero-initialise, set `struct_size`, then what you need; every
 * unset string falls back to its environment variable (docs/trtllm/README.md), then to the
 * default named here. */
typedef struct KvlinkTrtllmOptions {
  size_t struct_size;         /**< sizeof(KvlinkTrtllmOptions) */
  int32_t rank;               /**< this rank in its instance: getCommState().getSelfIdx() */
  int32_t world_size;         /**< ranks in this instance (TP x PP); 1 needs no allgather */
  KvlinkAllgatherFn allgather; /**< required when world_size > 1 */
  void* allgather_user;
  const char* agent_name;     /**< NULL: TRTLLM_KVLINK_AGENT_NAME, else host_pid_random */
  const char* transport;      /**< NULL: TRTLLM_KVLINK_TRANSPORT, else "tcp"; "tcp", "sm", "auto" or a UCX transport list, "@devices" optional */
  const char* listen;         /**< NULL: TRTLLM_KVLINK_LISTEN, else "0.0.0.0:0" (tcp) */
  /** cache_transceiver_config.kv_transfer_timeout_ms; <= 0 when absent: then
   * TRTLLM_KVLINK_TIMEOUT_MS, else 60000. Every request and every wait is bounded by it. */
  int64_t kv_transfer_timeout_ms;
  uint64_t agreement_ms;      /**< extra time for the ranks of a request to agree; 0: default */
  KvlinkLogFn log;            /**< NULL: kvlink logs to stderr as KVLINK_LOG asks */
  void* log_user;
  int32_t log_level;          /**< 0: TRTLLM_LOG_LEVEL mapped (error .. trace), else warning */
  int64_t fault_suppress_request; /**< test hook: -1 (none) in production */
} KvlinkTrtllmOptions;

/** The factory's type. Returns a new `ConnectionManager*` (as `void*`), or NULL with a
 * NUL-terminated message of at most `error_size` bytes in `error`. Never throws. */
typedef void* (*KvlinkMakeConnectionManagerFn)(const KvlinkTrtllmOptions* options, char* error,
                                               size_t error_size);

#ifdef __cplusplus
}

#include <stdexcept>
#include <string>

namespace kvlink {
namespace trtllm {

/** Thrown by a connection's `send` / `recv` when its transfer ended in anything but success;
 * `outcome()` is the `kvlink::Outcome` code: 1 TimedOut, 2 Cancelled, 3 PeerLost, 4 Rejected.
 * TensorRT-LLM catches it as a `std::exception` (TransferSession turns it into its request
 * error); never treated as success. */
class TransferError : public std::runtime_error {
 public:
  TransferError(int outcome, uint64_t request, const std::string& what)
      : std::runtime_error(what), outcome_(outcome), request_(request) {}
  int outcome() const noexcept { return outcome_; }
  uint64_t request() const noexcept { return request_; }

 private:
  int outcome_;
  uint64_t request_;
};

/** Thrown when a data tag (which carries only some bits of a request id) could name two
 * requests in flight on one connection, instead of delivering one's data into the other. */
class AmbiguousTagError : public std::runtime_error {
 public:
  AmbiguousTagError(int tag, uint64_t request, uint64_t other, const std::string& what)
      : std::runtime_error(what), tag_(tag), request_(request), other_(other) {}
  int tag() const noexcept { return tag_; }
  uint64_t request() const noexcept { return request_; }
  uint64_t other() const noexcept { return other_; }

 private:
  int tag_;
  uint64_t request_;
  uint64_t other_;
};

}  // namespace trtllm
}  // namespace kvlink
#endif

#endif /* KVLINK_TRTLLM_ADAPTER_H */
