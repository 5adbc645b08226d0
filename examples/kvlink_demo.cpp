// The main job, through kvlink's C++ API: a context process and a generation process on loopback
// hand over a KV-cache-shaped request (advertisement, ready signal, multi-buffer transfer,
// verification of every byte); then a request whose data the context side's fault hook drops
// ends TimedOut at its deadline on both sides while both processes stay healthy; then a third
// request is served. Exit status 0 only if every step went as stated.
//
//   kvlink_demo [--transport tcp|sm|auto|<UCX list>[@devices]] [--timeout-ms N] [--metrics-file PATH]
//
// --metrics-file writes the generation side's metrics (Prometheus text format) to PATH at the end.
// KVLINK_LOG=debug (or any tracing EnvFilter) makes both processes log to stderr.
//
// This process is the generation side; it starts the context side as a second process (this
// program with --role context) and reads its address and results from a pipe.
#include <kvlink/kvlink.hpp>

#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <fstream>
#include <string>
#include <vector>

namespace {

using namespace std::chrono;
constexpr std::uint32_t kCtx = 0;
constexpr std::uint32_t kGen = 1;
constexpr std::uint64_t kFaulty = 2;  // the request whose data the context side drops

struct Segment {
  kvlink::BufferKind kind;
  std::size_t size;
};

// 4 layers x (K, V) x 1 MiB, plus a small indexer buffer.
std::vector<Segment> layout() {
  std::vector<Segment> v(8, Segment{kvlink::BufferKind::Kv, 1u << 20});
  v.push_back({kvlink::BufferKind::KvIndexer, 4096});
  return v;
}

// What the context side "computed" for (request, segment): deterministic, so the generation
// side can check every byte.
std::vector<std::uint8_t> content(std::uint64_t request, std::uint32_t segment, std::size_t n) {
  std::uint64_t x = (request * 0x9E3779B97F4A7C15ull) ^ (segment * 0xBF58476D1CE4E5B9ull) | 1;
  std::vector<std::uint8_t> out(n);
  for (auto& b : out) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    b = static_cast<std::uint8_t>(x);
  }
  return out;
}

std::string arg(int argc, char** argv, const char* name, const char* dflt) {
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::strcmp(argv[i], name) == 0) return argv[i + 1];
  }
  return dflt;
}

int run_context(const std::string& transport, milliseconds timeout) {
  kvlink::EngineConfig cfg;
  cfg.name = "context";
  cfg.rank = kCtx;
  cfg.transport = transport;
  // tcp listens; sm, auto and lists are reached by worker address.
  if (transport == "tcp" || transport.rfind("tcp@", 0) == 0) cfg.listen = "127.0.0.1:0";
  cfg.timeout = timeout;
  cfg.fault_suppress_request = kFaulty;
  kvlink::Engine engine(cfg);
  std::printf("ADDR %s\n", engine.address().c_str());
  std::fflush(stdout);
  for (int served = 0; served < 3; ++served) {
    auto adv = engine.next_advertisement(kvlink::after(seconds(30)));
    if (!adv) {
      std::fprintf(stderr, "[context] no advertisement within 30 s\n");
      return 1;
    }
    engine.accept(adv->key, adv->from_rank, true);
    const auto deadline = kvlink::after(timeout);
    for (const auto& b : adv->buffers) {
      const auto data = content(adv->key.request, b.segment, b.size);
      engine.send(adv->key, adv->from_rank, b.segment, data.data(), data.size(), deadline);
    }
    const auto o = engine.wait_sender(adv->key, adv->from_rank, kvlink::after(2 * timeout));
    std::printf("CTX %llu %s\n", static_cast<unsigned long long>(adv->key.request), kvlink::to_string(o));
    std::fflush(stdout);
  }
  return 0;
}

int run_generation(const char* self, const std::string& transport, milliseconds timeout,
                   const std::string& metrics_file) {
  int fds[2];
  if (pipe(fds) != 0) return 1;
  const std::string ms = std::to_string(timeout.count());
  const pid_t child = fork();
  if (child == 0) {
    dup2(fds[1], STDOUT_FILENO);
    close(fds[0]);
    close(fds[1]);
    execl(self, self, "--role", "context", "--transport", transport.c_str(), "--timeout-ms", ms.c_str(),
          static_cast<char*>(nullptr));
    _exit(127);
  }
  close(fds[1]);
  // Ends the context process however this side ends, a thrown error included: left alone it
  // would wait 30 s for an advertisement, holding the stderr it inherited (a test's pipe).
  struct Reaper {
    pid_t pid;
    bool reaped = false;
    ~Reaper() {
      if (pid > 0 && !reaped) {
        kill(pid, SIGKILL);
        waitpid(pid, nullptr, 0);
      }
    }
  } reaper{child};
  FILE* from_ctx = fdopen(fds[0], "r");
  char line[4096];
  if (child < 0 || from_ctx == nullptr || std::fgets(line, sizeof line, from_ctx) == nullptr ||
      std::strncmp(line, "ADDR ", 5) != 0) {
    std::fprintf(stderr, "the context process did not start\n");
    return 1;
  }
  std::string addr(line + 5);
  addr.erase(addr.find_last_not_of("\r\n") + 1);
  std::printf("kvlink demo (C++ API): context process pid %d and generation process pid %d over UCX %s on loopback\n",
              static_cast<int>(child), static_cast<int>(getpid()), transport.c_str());

  const auto shape = layout();
  std::size_t total = 0;
  for (const auto& s : shape) total += s.size;
  // The generation side's KV-cache pool, lent to kvlink once as a region: requests receive into
  // ranges of it. Should a sender stall mid-transfer, only that range would be fenced (no
  // endpoint closed). Declared before the engine, so that it outlives the engine whatever
  // happens (a fenced range may be written until the engine is gone).
  std::vector<std::uint8_t> pool(total, 0);
  kvlink::EngineConfig cfg;
  cfg.name = "generation";
  cfg.rank = kGen;
  cfg.transport = transport;
  cfg.timeout = timeout;
  kvlink::Engine engine(cfg);
  const auto peer = engine.connect(addr, kvlink::after(seconds(10)));
  std::printf("  connected to rank %u\n", peer);

  const kvlink::RegionId region = engine.register_region(pool.data(), pool.size());
  std::printf("  receive pool of %.1f MiB registered once as region %llu\n", total / 1048576.0,
              static_cast<unsigned long long>(region));
  bool all_ok = true;
  std::vector<std::string> ctx_lines;
  const std::pair<std::uint64_t, kvlink::Outcome> plan[] = {
      {1, kvlink::Outcome::Completed}, {kFaulty, kvlink::Outcome::TimedOut}, {3, kvlink::Outcome::Completed}};
  for (const auto& [request, expect] : plan) {
    const kvlink::RequestKey key{request, 0};
    std::fill(pool.begin(), pool.end(), 0);
    std::vector<kvlink::Buffer> specs;
    std::size_t offset = 0;
    for (std::size_t i = 0; i < shape.size(); ++i) {
      specs.push_back(engine.region_buffer(region, shape[i].kind, static_cast<std::uint32_t>(i), offset, shape[i].size));
      offset += shape[i].size;
    }
    const auto t0 = steady_clock::now();
    const std::string info = "prompt-" + std::to_string(request);
    engine.advertise(key, {}, peer, specs, std::vector<std::uint8_t>(info.begin(), info.end()));
    const auto ready = engine.recv_ready(key, kvlink::after(timeout));
    const auto outcome = engine.wait_receiver(key, kvlink::after(2 * timeout));
    const double took = duration<double, std::milli>(steady_clock::now() - t0).count();
    bool intact = true;
    for (std::size_t i = 0; i < specs.size(); ++i) {
      const auto want = content(request, static_cast<std::uint32_t>(i), specs[i].size);
      intact = intact && std::memcmp(specs[i].data, want.data(), want.size()) == 0;
    }
    std::printf("  request %llu: %zu buffers, %.1f MiB, ready=%s -> %s in %.1f ms, every byte verified: %s   [%s]\n",
                static_cast<unsigned long long>(request), shape.size(), total / 1048576.0,
                ready ? (*ready ? "yes" : "no") : "none", kvlink::to_string(outcome), took, intact ? "true" : "false",
                request == kFaulty ? "fault hook: the context side drops this request's data (the lost-completion case)"
                                   : "KV-cache-shaped: 4 layers x K,V x 1 MiB + indexer");
    all_ok = all_ok && outcome == expect && (expect != kvlink::Outcome::Completed || intact);
    if (expect == kvlink::Outcome::TimedOut) {
      const bool on_time = took >= timeout.count() && took <= 2.0 * timeout.count();
      std::printf("    expected TimedOut at the %lld ms deadline: %s\n", static_cast<long long>(timeout.count()),
                  outcome == expect && on_time ? "yes" : "NO");
      all_ok = all_ok && on_time;
    }
    if (std::fgets(line, sizeof line, from_ctx) != nullptr) {
      std::string l(line);
      l.erase(l.find_last_not_of("\r\n") + 1);
      ctx_lines.push_back(l);
    }
    const auto h = engine.health();
    std::printf("    health: completed=%llu failed=%llu buffers_leased=%llu ops_in_flight=%llu region_fenced_bytes=%llu\n",
                static_cast<unsigned long long>(h.completed), static_cast<unsigned long long>(h.failed),
                static_cast<unsigned long long>(h.buffers_leased), static_cast<unsigned long long>(h.ops_in_flight),
                static_cast<unsigned long long>(h.region_fenced_bytes));
    all_ok = all_ok && h.buffers_leased == 0 && h.ops_in_flight == 0 && h.region_fenced_bytes == 0;
    if (h.region_fenced_bytes != 0) break;  // fenced memory must not be refilled or read
  }
  engine.deregister_region(region, kvlink::after(seconds(1)));
  std::string joined;
  for (const auto& l : ctx_lines) joined += (joined.empty() ? "" : ", ") + l;
  std::printf("  context side reported: %s\n", joined.c_str());
  all_ok = all_ok && joined == "CTX 1 Completed, CTX 2 TimedOut, CTX 3 Completed";
  int status = 0;
  reaper.reaped = waitpid(child, &status, 0) == child;
  all_ok = all_ok && reaper.reaped && WIFEXITED(status) && WEXITSTATUS(status) == 0;
  if (!metrics_file.empty()) {
    std::ofstream out(metrics_file, std::ios::binary | std::ios::trunc);
    out << engine.metrics_text();
    out.close();
    const bool written = static_cast<bool>(out);
    std::printf("  metrics (generation side, Prometheus text) written to %s: %s\n", metrics_file.c_str(),
                written ? "yes" : "NO");
    all_ok = all_ok && written;
  }
  std::printf("kvlink demo: %s\n", all_ok ? "OK (transfer verified, fault handled, process kept serving)" : "FAILED");
  return all_ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--help") == 0 || std::strcmp(argv[i], "-h") == 0) {
      std::printf(
          "kvlink_demo: the main job through kvlink's C++ API. A context (prefill) process and a\n"
          "generation (decode) process on loopback hand over three KV-cache-shaped requests over\n"
          "UCX; the second one's data is dropped by a fault hook (a lost completion), which both\n"
          "sides must end TimedOut at its deadline, leaking nothing, before serving the third.\n"
          "Exits 0 only if every step went as stated.\n\n"
          "Options:\n"
          "  --transport T           UCX transport between the two processes (default tcp): tcp, sm,\n"
          "                          auto, or a UCX list such as tcp,self; @dev adds network devices\n"
          "  --timeout-ms N          per-request deadline in milliseconds (default 2000)\n"
          "  --metrics-file PATH     write the generation side's Prometheus metrics there at the end\n"
          "  -h, --help              this text\n"
          "Environment: KVLINK_LOG=debug (or info, warn, ...) logs both processes to stderr.\n");
      return 0;
    }
  }
  const std::string transport = arg(argc, argv, "--transport", "tcp");
  const std::string timeout_arg = arg(argc, argv, "--timeout-ms", "2000");
  long long timeout_ms = 0;
  try {
    std::size_t used = 0;
    timeout_ms = std::stoll(timeout_arg, &used);
    if (used != timeout_arg.size()) timeout_ms = 0;
  } catch (const std::exception&) {
    // Not a number, or out of range: told below (std::stoll's throw ended the process here).
  }
  if (timeout_ms <= 0) {
    std::fprintf(stderr, "kvlink_demo: --timeout-ms takes a positive number of milliseconds, not '%s'\n",
                 timeout_arg.c_str());
    return 2;
  }
  const milliseconds timeout(timeout_ms);
  try {
    if (arg(argc, argv, "--role", "generation") == "context") return run_context(transport, timeout);
    return run_generation(argv[0], transport, timeout, arg(argc, argv, "--metrics-file", ""));
  } catch (const kvlink::Error& e) {
    std::fprintf(stderr, "kvlink error (%s): %s\n", kvlink::to_string(e.kind()), e.what());
    return 1;
  }
}
