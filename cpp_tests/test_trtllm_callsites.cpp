// The call-site test: two context ranks and two generation ranks (selfIdx 0 and 1), each in its
// own process, each with its own kvlink engine loaded from libkvlink_trtllm_wrapper.so by dlopen
// (this binary links nothing of kvlink). Every call on a ConnectionManager / Connection is one
// that upstream's generic path makes, in its order, with its tags (the newer 23-bit
// request-scoped tags), written from reading batch_manager/dataTransceiver.cpp and the cache
// formatters:
//   construction      CacheSender/CacheReceiver: getCommState().getSelfIdx() == rank
//   generation rank   CacheReceiver::Impl::requestSync on its request thread:
//                       getConnections(contextCommState).at(counterpart)
//                       sendRequestInfo: send(19, Id), send(22, size), send(32, info)
//                       receiveReadySignal: recv(readyTag, &isReady, 1)
//                       unformat: recv(dataTag, block, size) per layer, K then V
//   context rank      CacheSender::Impl: response thread recvConnect(19, terminate), recv(22),
//                       recv(32); sendReadySignal: send(readyTag, &isReady, 1); then format on an
//                       async send thread: send(dataTag, block, size) per layer, K then V
// Scenarios, on tcp and on shared memory: a KV-shaped request with every byte checked; a 1 GiB
// request (8 layers x K,V over the two generation ranks; KVLINK_CALLSITE_BIG_MIB changes it);
// a terminate flag set mid-transfer (both sides out within 50 ms); and ids 4096 apart (in flight
// together: refused with AmbiguousTagError; one after the other: both complete).
#include "trtllm_test_util.h"

#include <gtest/gtest.h>

#include <execinfo.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include <atomic>
#include <cstdlib>
#include <future>
#include <map>
#include <mutex>

using namespace kvtest;
using namespace std::chrono_literals;

namespace {

constexpr uint64_t kMiB = 1024 * 1024;

std::unique_ptr<kv::ConnectionManager> makeRank(Wrapper& w, std::string const& transport, std::string const& dir,
                                                std::string const& group, int rank, FileAllgather& g) {
  g = FileAllgather{dir, group, rank, 2};
  KvlinkTrtllmOptions o = options(transport, rank, 2);
  o.kv_transfer_timeout_ms = 30000;
  o.allgather = &FileAllgather::call;
  o.allgather_user = &g;
  auto m = make(w, o);
  // What CacheSender::Impl and CacheReceiver::Impl check at construction.
  if (m->getCommState().getSelfIdx() != rank) die("selfIdx is not the rank");
  if (m->getCommState().getAgentState().size() != 2) die("CommState does not list both ranks");
  return m;
}

// --- Context rank ---------------------------------------------------------------------------------

int contextRank(std::string const& transport, std::string const& dir, int rank) {
  Wrapper w;
  FileAllgather g;
  auto m = makeRank(w, transport, dir, "ctx", rank, g);
  if (rank == 0) {  // what travels to the generation instance in ContextPhaseParams
    std::ofstream f(dir + "/ctx.commstate.tmp");
    for (auto const& a : m->getCommState().getAgentState()) f << a.mAgentName << '\t' << a.mConnectionInfo << '\n';
    f.close();
    std::rename((dir + "/ctx.commstate.tmp").c_str(), (dir + "/ctx.commstate").c_str());
  }
  std::atomic<bool> terminate{false};
  std::thread stopper([&] {  // the executor shutting down
    struct stat st {};
    while (stat((dir + "/stop").c_str(), &st) != 0) std::this_thread::sleep_for(20ms);
    terminate = true;
  });
  Tags const tags{true};
  std::vector<std::future<void>> sends;
  std::mutex outMu;
  for (;;) {
    Taken t = recvRequestInfo(*m, terminate);
    if (t.conn == nullptr) break;
    uint64_t const id = t.info.getRequestId();
    if (t.info.getTransState().getCommState()->getSelfIdx() != rank) die("request from a rank that is not my counterpart");
    Layout const layout = Layout::parse(t.info.getTransState().getCacheState()->opaque());
    bool const ready = true;
    t.conn->send(kv::DataContext{tags.ready(id)}, &ready, sizeof ready);
    // format() on an async send thread, as the non-agent path does.
    sends.push_back(std::async(std::launch::async, [&, conn = t.conn, id, layout] {
      std::vector<uint64_t> cache(layout.bytes() / 8);
      auto* base = reinterpret_cast<uint8_t*>(cache.data());
      for (size_t s = 0; s < layout.segments(); ++s) fill(id, s, base + s * layout.block, layout.block);
      std::atomic<bool> requestCancel{false};
      kv::DataContext const ctx{tags.data(id), requestCancel};
      try {
        for (size_t s = 0; s < layout.segments(); ++s) conn->send(ctx, base + s * layout.block, layout.block);
        std::lock_guard<std::mutex> g(outMu);
        say("CTX_SENT " + std::to_string(id));
      } catch (kvlink::trtllm::TransferError const& e) {
        auto const end = nowNs();
        std::lock_guard<std::mutex> g(outMu);
        say("CTX_SEND_END " + std::to_string(id) + " " + std::to_string(end) + " " + std::to_string(e.outcome()));
      } catch (std::exception const& e) {
        std::lock_guard<std::mutex> g(outMu);
        say("CTX_SEND_ERROR " + std::to_string(id) + " " + e.what());
      }
    }));
  }
  for (auto& f : sends) f.get();
  stopper.join();
  say("CTX_DONE");
  return 0;
}

// --- Generation rank ------------------------------------------------------------------------------

kv::CommState readContextState(std::string const& dir) {
  auto const until = Clock::now() + 30s;
  for (;;) {
    std::ifstream f(dir + "/ctx.commstate");
    std::vector<kv::AgentState> agents;
    std::string line;
    while (std::getline(f, line)) {
      auto const tab = line.find('\t');
      if (tab != std::string::npos) agents.emplace_back(line.substr(0, tab), line.substr(tab + 1));
    }
    if (agents.size() == 2) return kv::CommState(std::move(agents), 0);
    if (Clock::now() > until) die("no context CommState");
    std::this_thread::sleep_for(20ms);
  }
}

/// One request as CacheReceiver::Impl::requestSync runs it; returns whether every byte came.
bool requestSync(GenSide const& side, uint64_t id, Layout const& layout, std::atomic<bool> const& cancel) {
  GenSide s = side;
  s.layout = layout.str();
  s.sendRequestInfo(id);
  if (!s.recvReady(id, cancel)) die("context rank refused " + std::to_string(id));
  std::vector<uint64_t> cache(layout.bytes() / 8, 0);
  auto* base = reinterpret_cast<uint8_t*>(cache.data());
  kv::DataContext const ctx{s.tags.data(id), cancel};
  for (size_t seg = 0; seg < layout.segments(); ++seg) s.conn->recv(ctx, base + seg * layout.block, layout.block);
  for (size_t seg = 0; seg < layout.segments(); ++seg) {
    if (check(id, seg, base + seg * layout.block, layout.block) != SIZE_MAX) return false;
  }
  return true;
}

int generationRank(std::string const& transport, std::string const& dir, int rank, uint64_t bigMiB) {
  Wrapper w;
  FileAllgather g;
  auto m = makeRank(w, transport, dir, "gen", rank, g);
  kv::CommState const contextState = readContextState(dir);
  auto const connections = m->getConnections(contextState);
  if (connections.size() != 2) die("getConnections did not index every context rank");
  GenSide side{connections.at(static_cast<size_t>(rank)), Tags{true}};
  side.self = m->getCommState();
  std::atomic<bool> never{false};

  // A KV-cache-shaped request, every byte checked.
  if (!requestSync(side, 1000 + rank, Layout{4, 256 * 1024}, never)) die("request A bytes differ");
  say("GEN_A ok");

  // The big one: each generation rank receives half of it from its counterpart.
  if (bigMiB > 0) {
    Layout const big{8, bigMiB * kMiB / 2 / 16};
    auto const t0 = Clock::now();
    if (!requestSync(side, 2000 + rank, big, never)) die("big request bytes differ");
    double const ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
    say("GEN_BIG " + std::to_string(big.bytes()) + " " + std::to_string(ms));
  }

  // Terminate mid-transfer: 64 layers x K,V of 1 MiB; the flag is set after a few segments.
  {
    uint64_t const id = 3000 + rank;
    Layout const l{64, kMiB};
    GenSide s = side;
    s.layout = l.str();
    std::atomic<bool> cancel{false};
    s.sendRequestInfo(id);
    if (!s.recvReady(id, cancel)) die("refused");
    std::vector<uint8_t> block(l.block);
    kv::DataContext const ctx{s.tags.data(id), cancel};
    for (int i = 0; i < 4; ++i) s.conn->recv(ctx, block.data(), block.size());
    std::atomic<int64_t> setAt{0};
    std::thread setter([&] {
      std::this_thread::sleep_for(5ms);
      setAt = nowNs();
      cancel = true;
    });
    int64_t end = 0;
    int outcome = -1;
    try {
      for (size_t i = 4; i < l.segments(); ++i) s.conn->recv(ctx, block.data(), block.size());
    } catch (kvlink::trtllm::TransferError const& e) {
      end = nowNs();
      outcome = e.outcome();
    }
    setter.join();
    if (end == 0) die("the transfer ran to its end with the terminate flag set");
    say("GEN_CANCEL " + std::to_string(id) + " " + std::to_string(setAt.load()) + " " + std::to_string(end) + " " +
        std::to_string(outcome));
  }

  // Ids 4096 apart, one after the other on this thread: both complete with their own bytes.
  uint64_t const e = 7000 + rank;
  if (!requestSync(side, e, Layout{2, 64 * 1024}, never)) die("sequential request bytes differ");
  if (!requestSync(side, e + 4096, Layout{2, 64 * 1024}, never)) die("sequential +4096 bytes differ");
  say("GEN_SEQ ok");

  // Ids 4096 apart in flight together (two request threads): the second is refused, typed.
  {
    uint64_t const c = 5000 + rank * 10, d = c + 4096;
    std::promise<void> cSent, dTried;
    auto first = std::async(std::launch::async, [&] {
      GenSide s = side;
      s.layout = Layout{2, 64 * 1024}.str();
      s.sendRequestInfo(c);
      cSent.set_value();
      dTried.get_future().wait();
      if (!s.recvReady(c, never)) return false;
      std::vector<uint8_t> b(64 * 1024);
      bool ok = true;
      for (size_t seg = 0; seg < 4; ++seg) {
        s.conn->recv(kv::DataContext{s.tags.data(c)}, b.data(), b.size());
        ok = ok && check(c, seg, b.data(), b.size()) == SIZE_MAX;
      }
      return ok;
    });
    cSent.get_future().wait();
    bool refused = false;
    std::thread second([&] {
      try {
        GenSide s = side;
        s.layout = Layout{2, 64 * 1024}.str();
        s.sendRequestInfo(d);
      } catch (kvlink::trtllm::AmbiguousTagError const& err) {
        refused = err.request() == d && err.other() == c;
      }
      dTried.set_value();
    });
    second.join();
    if (!refused) die("request 4096 apart was not refused while the other was in flight");
    if (!first.get()) die("the request in flight did not get its own bytes");
    say("GEN_AMBIG ok");
  }
  say("GEN_DONE");
  return 0;
}

// --- The test: four processes ---------------------------------------------------------------------

struct Proc {
  pid_t pid = -1;
  std::string out;
};

Proc spawn(std::vector<std::string> args, std::string const& out) {
  Proc p;
  p.out = out;
  p.pid = fork();
  if (p.pid == 0) {
    int fd = open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(fd, 1);
    dup2(fd, 2);
    close(fd);
    std::vector<char*> argv;
    std::string exe = "/proc/self/exe";
    argv.push_back(exe.data());
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    execv("/proc/self/exe", argv.data());
    std::_Exit(127);
  }
  return p;
}

/// Exit status, or -1 if it had to be killed at `until`.
int reap(Proc& p, Clock::time_point until) {
  for (;;) {
    int st = 0;
    pid_t const r = waitpid(p.pid, &st, WNOHANG);
    if (r == p.pid) return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    if (Clock::now() > until) {
      kill(p.pid, SIGKILL);
      waitpid(p.pid, &st, 0);
      return -1;
    }
    std::this_thread::sleep_for(20ms);
  }
}

std::string slurp(std::string const& path) {
  std::ifstream f(path);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

std::vector<std::string> linesWith(std::string const& text, std::string const& prefix) {
  std::vector<std::string> out;
  std::istringstream is(text);
  std::string line;
  while (std::getline(is, line)) {
    if (line.rfind(prefix, 0) == 0) out.push_back(line);
  }
  return out;
}

class CallSites : public testing::TestWithParam<std::string> {};

TEST_P(CallSites, TwoContextAndTwoGenerationRanksInSeparateProcesses) {
  char tmpl[] = "/tmp/kvlink-callsites-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  std::string const dir = tmpl;
  char const* env = std::getenv("KVLINK_CALLSITE_BIG_MIB");
  std::string const big = env != nullptr ? env : "1024";
  std::vector<Proc> ctx, gen;
  for (int r = 0; r < 2; ++r) {
    ctx.push_back(spawn({"--kvlink-rank", "ctx", std::to_string(r), dir, GetParam(), big}, dir + "/ctx" + std::to_string(r) + ".out"));
    gen.push_back(spawn({"--kvlink-rank", "gen", std::to_string(r), dir, GetParam(), big}, dir + "/gen" + std::to_string(r) + ".out"));
  }
  auto const until = Clock::now() + 240s;
  int genStatus[2];
  for (int r = 0; r < 2; ++r) genStatus[r] = reap(gen[r], until);
  { std::ofstream(dir + "/stop") << "stop\n"; }
  int ctxStatus[2];
  for (int r = 0; r < 2; ++r) ctxStatus[r] = reap(ctx[r], Clock::now() + 30s);
  std::map<std::string, std::string> out;
  for (int r = 0; r < 2; ++r) {
    out["gen" + std::to_string(r)] = slurp(gen[r].out);
    out["ctx" + std::to_string(r)] = slurp(ctx[r].out);
  }
  for (auto const& [who, text] : out) std::printf("--- %s (%s)\n%s", who.c_str(), GetParam().c_str(), text.c_str());
  for (int r = 0; r < 2; ++r) {
    auto const where = [&](std::string const& who) -> std::string {
      std::string const& o = out[who];
      if (o.find("RANK_TORN_DOWN") == std::string::npos) return " (before its manager and wrapper were torn down, or during)";
      // RANK_EXIT (sayExit): what exit() was called with, and by whom when that failed.
      if (o.find("RANK_EXIT 0") != std::string::npos) {
        return " (after exit(0) had begun: from a later exit handler, such as LeakSanitizer's in an ASan build, whose "
               "report is in ASAN_OPTIONS' log_path)";
      }
      return " (after its teardown: in the process's exit; see its RANK_EXIT line)";
    };
    EXPECT_EQ(genStatus[r], 0) << "generation rank " << r << where("gen" + std::to_string(r));
    EXPECT_EQ(ctxStatus[r], 0) << "context rank " << r << where("ctx" + std::to_string(r));
    std::string const& g = out["gen" + std::to_string(r)];
    for (char const* step : {"GEN_A ok", "GEN_SEQ ok", "GEN_AMBIG ok", "GEN_DONE"}) {
      EXPECT_NE(g.find(step), std::string::npos) << "generation rank " << r << " missing " << step;
    }
    if (big != "0") {
      auto const b = linesWith(g, "GEN_BIG ");
      ASSERT_EQ(b.size(), 1u) << "generation rank " << r;
      size_t bytes = 0;
      double ms = 0;
      std::sscanf(b[0].c_str(), "GEN_BIG %zu %lf", &bytes, &ms);
      std::printf("rank %d: %zu bytes (half of the big request) in %.0f ms: %.2f GB/s\n", r, bytes, ms, bytes / ms / 1e6);
      EXPECT_EQ(bytes, std::stoull(big) * kMiB / 2);
    }
    // Terminate mid-transfer: both sides out within 50 ms of the flag.
    auto const c = linesWith(g, "GEN_CANCEL ");
    ASSERT_EQ(c.size(), 1u) << "generation rank " << r;
    unsigned long long id = 0;
    long long setAt = 0, genEnd = 0;
    int outcome = -1;
    std::sscanf(c[0].c_str(), "GEN_CANCEL %llu %lld %lld %d", &id, &setAt, &genEnd, &outcome);
    EXPECT_EQ(outcome, 2) << "generation side did not end Cancelled";
    long long ctxEnd = 0;
    int ctxOutcome = -1;
    for (auto const& l : linesWith(out["ctx" + std::to_string(r)], "CTX_SEND_END " + std::to_string(id) + " ")) {
      std::sscanf(l.c_str(), "CTX_SEND_END %*s %lld %d", &ctxEnd, &ctxOutcome);
    }
    ASSERT_NE(ctxEnd, 0) << "context rank " << r << " did not end request " << id;
    EXPECT_EQ(ctxOutcome, 2) << "context side did not end Cancelled";
    double const genMs = (genEnd - setAt) / 1e6, ctxMs = (ctxEnd - setAt) / 1e6;
    std::printf("rank %d terminate flag: generation out after %.2f ms, context out after %.2f ms\n", r, genMs, ctxMs);
    EXPECT_LE(genMs, 50.0);
    EXPECT_LE(ctxMs, 50.0);
    // Nothing of the refused request ever reached the context rank.
    EXPECT_EQ(out["ctx" + std::to_string(r)].find("CTX_SENT " + std::to_string(5000 + r * 10 + 4096)), std::string::npos);
  }
  if (!HasFailure()) std::system(("rm -rf " + dir).c_str());
}

INSTANTIATE_TEST_SUITE_P(Transports, CallSites, testing::Values("tcp", "sm"),
                         [](testing::TestParamInfo<std::string> const& i) { return i.param; });

/// Run by exit() in a rank process (a return from main included), after the thread-locals'
/// destructors and before the libraries' own (UCX's among them): the status exit() was called
/// with, and with a failing one the stack that called it. A failing status with no RANK_EXIT
/// line, or after RANK_EXIT 0, came from elsewhere: an _exit, a thread's exit_group, or a handler
/// that runs after this one, such as LeakSanitizer's check in an ASan build (status 1, its report
/// in ASAN_OPTIONS' log_path, not on the rank's output; scripts/sanitize.sh prints those).
void sayExit(int status, void*) {
  std::fflush(stdout);
  char line[32];
  int const n = std::snprintf(line, sizeof line, "RANK_EXIT %d\n", status);
  if (write(2, line, static_cast<size_t>(n)) != n) return;
  if (status == 0) return;
  void* frames[64];
  backtrace_symbols_fd(frames, backtrace(frames, 64), 2);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc >= 7 && std::string(argv[1]) == "--kvlink-rank") {
    void* warm[1];
    (void)backtrace(warm, 1);  // loads libgcc's unwinder now, not inside exit()
    on_exit(sayExit, nullptr);
    try {
      std::string const role = argv[2];
      int const rank = std::atoi(argv[3]);
      uint64_t const bigMiB = std::strtoull(argv[6], nullptr, 10);
      int const rc = role == "ctx" ? contextRank(argv[5], argv[4], rank) : generationRank(argv[5], argv[4], rank, bigMiB);
      // Its manager and the wrapper are gone by now: a failing exit status after this line came
      // from the process's exit (static and thread-local destructors, atexit), not from them.
      say("RANK_TORN_DOWN " + std::to_string(rc));
      return rc;
    } catch (std::exception const& e) {
      die(std::string("rank process: ") + e.what());
    }
  }
  testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
