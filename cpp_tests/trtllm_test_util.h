// Helpers of the TensorRT-LLM wrapper tests: load libkvlink_trtllm_wrapper.so as TensorRT-LLM
// does (dlopen + dlsym, nothing of kvlink linked), a file-based allgather for ranks in separate
// processes, upstream's tag schemes, and KV-cache-shaped data patterns.
#pragma once

#include <kvlink/trtllm_adapter.h>

#include <tensorrt_llm/batch_manager/dataTransceiver.h>
#include <tensorrt_llm/executor/cacheCommunicator.h>
#include <tensorrt_llm/executor/dataTransceiverState.h>

#include <dlfcn.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace kvtest {

namespace kv = tensorrt_llm::executor::kv_cache;
namespace bm = tensorrt_llm::batch_manager;
using Clock = std::chrono::steady_clock;

/// The wrapper, loaded the way cacheTransceiver.cpp loads its UCX wrapper (`path`: another build
/// of it, e.g. the test build with a health probe, helpers/wrapper_probe.cpp).
struct Wrapper {
  void* handle = nullptr;
  KvlinkMakeConnectionManagerFn make = nullptr;
  explicit Wrapper(char const* path = KVLINK_WRAPPER_PATH) {
    handle = dlopen(path, RTLD_LAZY | RTLD_LOCAL);
    if (handle == nullptr) throw std::runtime_error(std::string("dlopen: ") + dlerror());
    make = reinterpret_cast<KvlinkMakeConnectionManagerFn>(dlsym(handle, KVLINK_TRTLLM_FACTORY_SYMBOL));
    if (make == nullptr) throw std::runtime_error(std::string("dlsym: ") + dlerror());
  }
  ~Wrapper() {
    if (handle != nullptr) dlclose(handle);
  }
  Wrapper(Wrapper const&) = delete;
  Wrapper& operator=(Wrapper const&) = delete;
};

/// A line to the parent test process (a rank child's stdout is a pipe the parent reads).
inline void say(std::string const& line) {
  std::printf("%s\n", line.c_str());
  std::fflush(stdout);
}

/// A rank child's fatal failure: the reason on stderr, exit status 3.
[[noreturn]] inline void die(std::string const& why) {
  std::fprintf(stderr, "FAILED: %s\n", why.c_str());
  std::fflush(stderr);
  std::_Exit(3);
}

inline KvlinkTrtllmOptions options(std::string const& transport, int rank = 0, int world = 1) {
  KvlinkTrtllmOptions o{};
  o.struct_size = sizeof o;
  o.rank = rank;
  o.world_size = world;
  o.transport = transport.c_str() == nullptr ? "tcp" : (transport == "tcp" ? "tcp" : "sm");
  o.listen = "127.0.0.1:0";
  o.kv_transfer_timeout_ms = 5000;
  o.agreement_ms = 200;
  o.fault_suppress_request = -1;
  return o;
}

inline std::unique_ptr<kv::ConnectionManager> make(Wrapper& w, KvlinkTrtllmOptions const& o) {
  char err[512] = {0};
  void* m = w.make(&o, err, sizeof err);
  if (m == nullptr) throw std::runtime_error(std::string("factory: ") + err);
  return std::unique_ptr<kv::ConnectionManager>(static_cast<kv::ConnectionManager*>(m));
}

/// An allgather through files in `dir` (what TensorRT-LLM does over MPI): rank r writes
/// `<dir>/<group>.<r>`, then reads every rank's file, waiting up to 30 s.
struct FileAllgather {
  std::string dir, group;
  int rank = 0, world = 1;
  static int call(void* user, void const* mine, size_t size, void* all) {
    auto* self = static_cast<FileAllgather*>(user);
    std::string const path = self->dir + "/" + self->group + "." + std::to_string(self->rank);
    {
      std::ofstream f(path + ".tmp", std::ios::binary);
      f.write(static_cast<char const*>(mine), static_cast<std::streamsize>(size));
    }
    if (std::rename((path + ".tmp").c_str(), path.c_str()) != 0) return 1;
    auto const until = Clock::now() + std::chrono::seconds(30);
    for (int r = 0; r < self->world; ++r) {
      std::string const p = self->dir + "/" + self->group + "." + std::to_string(r);
      for (;;) {
        std::ifstream f(p, std::ios::binary);
        if (f && f.read(static_cast<char*>(all) + static_cast<size_t>(r) * size, static_cast<std::streamsize>(size))) break;
        if (Clock::now() > until) return 2;
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
    }
    return 0;
  }
};

// Upstream's request-scoped tags. Older releases (dataTransceiver.cpp @859f0426): data tag
// ((id & 0xFFF) << 8) | 43, ready signal the fixed tag 42. Newer (the stored version with
// makeRequestScopedTag): 23 id bits, and the ready tag carries them too.
struct Tags {
  bool scoped23 = true;
  int data(uint64_t id) const {
    uint64_t const mask = scoped23 ? 0x7FFFFFu : 0xFFFu;
    return static_cast<int>(((id & mask) << 8) | 43u);
  }
  int ready(uint64_t id) const { return scoped23 ? ((data(id) & ~0xFF) | 42) : 42; }
};

/// The 64-bit word `i` of segment `seg` of request `id`: every byte depends on all three.
inline uint64_t word(uint64_t id, uint64_t seg, uint64_t i) {
  uint64_t x = id * 0x9E3779B97F4A7C15ull ^ (seg << 40) ^ i;
  x ^= x >> 29;
  return x * 0xBF58476D1CE4E5B9ull;
}
inline void fill(uint64_t id, uint64_t seg, void* p, size_t bytes) {
  auto* w = static_cast<uint64_t*>(p);
  for (size_t i = 0; i < bytes / 8; ++i) w[i] = word(id, seg, i);
}
/// Index of the first wrong word, or SIZE_MAX when all are right.
inline size_t check(uint64_t id, uint64_t seg, void const* p, size_t bytes) {
  auto const* w = static_cast<uint64_t const*>(p);
  for (size_t i = 0; i < bytes / 8; ++i) {
    if (w[i] != word(id, seg, i)) return i;
  }
  return SIZE_MAX;
}

/// A KV-cache-shaped request: `layers` x {K, V} blocks of `block` bytes each.
struct Layout {
  int layers = 4;
  size_t block = 64 * 1024;
  std::string str() const { return "layers=" + std::to_string(layers) + " block=" + std::to_string(block); }
  static Layout parse(std::string const& s) {
    Layout l;
    std::sscanf(s.c_str(), "layers=%d block=%zu", &l.layers, &l.block);
    return l;
  }
  size_t segments() const { return static_cast<size_t>(layers) * 2; }
  size_t bytes() const { return segments() * block; }
};

/// The generation side of one request, as CacheReceiver::Impl makes the calls.
struct GenSide {
  GenSide(kv::Connection const* c, Tags t) : conn(c), tags(t) {}
  kv::Connection const* conn;
  Tags tags;
  std::string layout = "layout";
  kv::CommState self;
  void sendRequestInfo(uint64_t id) const {
    bm::RequestInfo info(id, tensorrt_llm::executor::DataTransceiverState(kv::CacheState(layout), self));
    std::ostringstream os;
    bm::RequestInfo::serialize(info, os);
    std::string const s = os.str();
    uint64_t const size = s.size();
    auto const rid = bm::TransceiverTag::Id::REQUEST_SEND;
    conn->send(kv::DataContext{bm::TransceiverTag::kID_TAG}, &rid, sizeof rid);
    conn->send(kv::DataContext{bm::TransceiverTag::kINFO_SIZE_TAG}, &size, sizeof size);
    conn->send(kv::DataContext{bm::TransceiverTag::kINFO_TAG}, s.data(), s.size());
  }
  bool recvReady(uint64_t id, std::atomic<bool> const& cancel) const {
    bool ready = false;
    conn->recv(kv::DataContext{tags.ready(id), cancel}, &ready, sizeof ready);
    return ready;
  }
};

/// The context side: recvRequestInfo as CacheSender::Impl makes the calls.
struct Taken {
  kv::Connection const* conn = nullptr;
  bm::RequestInfo info;
};
inline Taken recvRequestInfo(kv::ConnectionManager& m, std::atomic<bool> const& terminate) {
  Taken t;
  bm::TransceiverTag::Id id{};
  t.conn = m.recvConnect(kv::DataContext{bm::TransceiverTag::kID_TAG, terminate}, &id, sizeof id);
  if (t.conn == nullptr) return t;
  if (id != bm::TransceiverTag::Id::REQUEST_SEND) throw std::runtime_error("envelope without REQUEST_SEND");
  uint64_t size = 0;
  t.conn->recv(kv::DataContext{bm::TransceiverTag::kINFO_SIZE_TAG, terminate}, &size, sizeof size);
  std::string s(size, '\0');
  t.conn->recv(kv::DataContext{bm::TransceiverTag::kINFO_TAG, terminate}, s.data(), size);
  std::istringstream is(s);
  t.info = bm::RequestInfo::deserialize(is);
  return t;
}

inline int64_t nowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
}

}  // namespace kvtest
