// kvlink_trtllm_wrapper_probe.so, a test build of libkvlink_trtllm_wrapper.so: the wrapper's own
// translation unit, included unchanged, plus exported functions that read the health of the
// kvlink engine behind a manager and the wrapper's own queues. The wrapper's interface is
// TensorRT-LLM's ConnectionManager / Connection, which has no health or lease query, and the
// production library exports only its factory (ctest kvlink.wrapper.exports_only_the_factory); a
// test that must show no buffer stays leased, no envelope lost or no state left behind loads this
// build instead. Everything else it runs is the production wrapper's code.
#include "../../wrapper/kvlink_trtllm_wrapper.cpp"

#include "wrapper_probe.h"

extern "C" __attribute__((visibility("default"))) int kvlinkProbeHealth(void* manager, KvlinkProbeHealth* out) {
  if (manager == nullptr || out == nullptr) return -1;
  auto* base = static_cast<::tensorrt_llm::executor::kv_cache::ConnectionManager*>(manager);
  auto* m = dynamic_cast<kvlink::trtllm::Manager*>(base);
  if (m == nullptr) return -1;
  kvlink::Health const h = m->engine().health();
  *out = KvlinkProbeHealth{h.buffers_leased, h.buffers_fenced, h.ops_in_flight, h.unreaped_ops,
                           h.completed,      h.failed,         h.peers_failed,  h.receive_stuck ? 1u : 0u,
                           h.worker_renewals};
  return 0;
}

extern "C" __attribute__((visibility("default"))) int kvlinkProbeWrapperState(void* manager,
                                                                             KvlinkProbeWrapperState* out) {
  if (manager == nullptr || out == nullptr) return -1;
  auto* base = static_cast<::tensorrt_llm::executor::kv_cache::ConnectionManager*>(manager);
  auto* m = dynamic_cast<kvlink::trtllm::Manager*>(base);
  if (m == nullptr) return -1;
  *out = KvlinkProbeWrapperState{m->envelopesQueued(), m->threadStates(), m->buffersQueued(),
                                 m->contextRequests()};
  return 0;
}

extern "C" __attribute__((visibility("default"))) std::uint64_t kvlinkProbeThreadConnections() {
  return kvlink::trtllm::threadStateOwner().touched.size();
}

extern "C" __attribute__((visibility("default"))) int kvlinkProbeAdvertiseRaw(void* manager, char const* address,
                                                                             std::uint64_t request,
                                                                             std::uint8_t const* info, std::size_t n,
                                                                             std::uint32_t wait_ms) {
  if (manager == nullptr || address == nullptr) return -1;
  auto* base = static_cast<::tensorrt_llm::executor::kv_cache::ConnectionManager*>(manager);
  auto* m = dynamic_cast<kvlink::trtllm::Manager*>(base);
  if (m == nullptr) return -1;
  try {
    using namespace std::chrono;
    std::uint32_t const rank = m->engine().connect(address, steady_clock::now() + seconds(5));
    kvlink::RequestKey const key{request, m->nextGeneration()};
    auto byte = std::make_unique<std::uint8_t>(0);
    std::vector<kvlink::Buffer> const one{kvlink::Buffer{kvlink::BufferKind::Kv, 0, byte.get(), 1, -1}};
    m->engine().advertise(key, {}, rank, one, std::vector<std::uint8_t>(info, info + n), milliseconds(wait_ms));
    // Waited past the request's own deadline: the engine ends it by then, whatever the peer does.
    return static_cast<int>(m->engine().wait_receiver(key, steady_clock::now() + milliseconds(wait_ms) + seconds(1)));
  } catch (...) {
    return -2;
  }
}
