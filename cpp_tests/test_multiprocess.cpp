// Ranks in separate processes (fork + exec of kvlink_rank_helper, lines over pipes): a peer
// process killed mid-transfer, and a cancel agreed across four rank processes.
#include <kvlink/trtllm_adapter.h>

#include "test_util.h"

#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <map>
#include <memory>

using namespace kvtest;
using kvlink::Outcome;
namespace kv = tensorrt_llm::executor::kv_cache;
namespace bm = tensorrt_llm::batch_manager;

namespace {

/// A helper process with its stdin and stdout on pipes. Killed (and reaped) on destruction.
class Child {
 public:
  explicit Child(std::vector<std::string> args) {
    int in[2], out[2];
    if (pipe(in) != 0 || pipe(out) != 0) throw std::runtime_error("pipe");
    pid_ = fork();
    if (pid_ < 0) throw std::runtime_error("fork");
    if (pid_ == 0) {
      dup2(in[0], 0);
      dup2(out[1], 1);
      close(in[0]), close(in[1]), close(out[0]), close(out[1]);
      std::vector<char*> argv;
      std::string const exe = KVLINK_RANK_HELPER;
      argv.push_back(const_cast<char*>(exe.c_str()));
      for (auto& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      execv(exe.c_str(), argv.data());
      _exit(127);
    }
    close(in[0]);
    close(out[1]);
    to_ = in[1];
    from_ = out[0];
  }
  ~Child() {
    kill(SIGKILL);
    close(to_);
    close(from_);
  }
  Child(Child const&) = delete;
  Child& operator=(Child const&) = delete;

  void write_line(std::string const& s) {
    std::string l = s + "\n";
    ASSERT_EQ(write(to_, l.data(), l.size()), static_cast<ssize_t>(l.size()));
  }
  /// The next line, or "" if none came within `limit` (or the child closed its stdout).
  std::string read_line(std::chrono::milliseconds limit = 10000ms) {
    auto const end = kvlink::Clock::now() + limit;
    for (;;) {
      auto nl = buf_.find('\n');
      if (nl != std::string::npos) {
        std::string line = buf_.substr(0, nl);
        buf_.erase(0, nl + 1);
        return line;
      }
      int const left = static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(end - kvlink::Clock::now()).count());
      if (left <= 0) return "";
      pollfd p{from_, POLLIN, 0};
      if (poll(&p, 1, left) <= 0) continue;
      char tmp[4096];
      ssize_t n = read(from_, tmp, sizeof tmp);
      if (n <= 0) return "";
      buf_.append(tmp, static_cast<size_t>(n));
    }
  }
  /// The next line starting with `prefix` (skipping others); "" on timeout.
  std::string expect(std::string const& prefix, std::chrono::milliseconds limit = 10000ms) {
    auto const end = kvlink::Clock::now() + limit;
    for (;;) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(end - kvlink::Clock::now());
      if (left <= 0ms) return "";
      std::string l = read_line(left);
      if (l.empty()) return "";
      if (l.rfind(prefix, 0) == 0) return l;
      if (l.rfind("ERROR", 0) == 0) return l;
    }
  }
  void kill(int sig) {
    if (pid_ > 0) {
      ::kill(pid_, sig);
      if (sig == SIGKILL) {
        int st = 0;
        waitpid(pid_, &st, 0);
        pid_ = -1;
      }
    }
  }

 private:
  pid_t pid_ = -1;
  int to_ = -1, from_ = -1;
  std::string buf_;
};

class MultiProcessTest : public testing::TestWithParam<std::string> {};

// Not in TensorRT-LLM: the context process dies (SIGKILL) between two segments of a transfer.
// The generation side's recv fails PeerLost promptly, and no buffer stays leased.
TEST_P(MultiProcessTest, PeerProcessKilledMidTransferGivesPeerLost) {
  Child ctx({"slow-sender", GetParam()});
  std::string const addr = ctx.expect("ADDR ");
  ASSERT_FALSE(addr.empty());
  kvlink::trtllm::AgentConnectionManager gen(config(GetParam(), 1, 8000ms));
  std::vector<std::vector<std::uint8_t>> bufs(8, std::vector<std::uint8_t>(1 << 20, 0));
  for (size_t i = 0; i < bufs.size(); ++i) gen.registerReceiveBuffer(static_cast<std::uint8_t>(i % 3), i, bufs[i].data(), bufs[i].size());
  auto conns = gen.getConnections(kv::CommState({{"ctx", addr.substr(5)}}, -1));
  ASSERT_EQ(conns.size(), 1u);
  auto const* c = dynamic_cast<kvlink::trtllm::AgentConnection const*>(conns[0]);
  ctx.write_line("PEERS");
  bm::RequestInfo req(900, "");
  // Three kinds, one buffer each (ids 0, 1, 2): three segments.
  const_cast<kvlink::trtllm::AgentConnection*>(c)->sendRequestAndBufferInfo(
      req, {std::optional<size_t>(0), std::optional<size_t>(1), std::optional<size_t>(2)}, 0);
  ASSERT_EQ(c->recvReadySignalWithStatus(kv::DataContext(42)), std::optional<bool>(true));
  ASSERT_EQ(ctx.expect("SENT 0"), "SENT 0 Completed");
  ctx.kill(SIGKILL);
  auto const t0 = kvlink::Clock::now();
  try {
    c->recv(kv::DataContext(kvlink::trtllm::dataTag(900)), nullptr, 0);
    FAIL() << "recv succeeded with its sender dead";
  } catch (kvlink::trtllm::TransferError const& e) {
    EXPECT_EQ(e.outcome(), Outcome::PeerLost) << e.what();
  }
  EXPECT_LT(kvlink::Clock::now() - t0, 5000ms) << "peer loss noticed late";
  EXPECT_TRUE(eventually([&] { return gen.health().buffers_leased == 0; }));
  EXPECT_EQ(gen.buffersReserved(), 0u);
  EXPECT_GE(gen.health().peers_failed, 1u);
}

// Not in TensorRT-LLM: four rank processes (context 0 -> generation 1, context 2 ->
// generation 3), one request received by ranks 1 and 3 together. Rank 2's data is dropped by
// the fault hook, so rank 3 times out; every rank must report the same verdict, and rank 1,
// whose own data did land, must keep its buffer leased until the verdict.
TEST_P(MultiProcessTest, CancelAgreedAcrossFourRankProcesses) {
  constexpr int kTimeoutMs = 1500;
  std::vector<std::unique_ptr<Child>> ranks;
  for (int r = 0; r < 4; ++r) {
    ranks.push_back(std::make_unique<Child>(std::vector<std::string>{
        "group", GetParam(), std::to_string(r), std::to_string(kTimeoutMs), r == 2 ? "77" : "-1"}));
  }
  std::string peers = "PEERS";
  for (auto& c : ranks) {
    std::string const a = c->expect("ADDR ");
    ASSERT_FALSE(a.empty());
    peers += " " + a.substr(5);
  }
  for (auto& c : ranks) c->write_line(peers);
  std::map<int, std::string> landed, verdict;
  for (int r : {1, 3}) landed[r] = ranks[r]->expect("LANDED");
  for (int r = 0; r < 4; ++r) verdict[r] = ranks[r]->expect("VERDICT", 15000ms);
  for (int r = 0; r < 4; ++r) std::cout << "rank " << r << ": " << landed[r] << " | " << verdict[r] << "\n";
  EXPECT_EQ(landed[1], "LANDED 1 LEASED 1") << "rank 1's data landed but its buffer must stay leased";
  EXPECT_EQ(landed[3], "LANDED 0 LEASED 1");
  for (int r : {0, 2}) EXPECT_EQ(verdict[r], "VERDICT TimedOut") << "rank " << r;
  for (int r : {1, 3}) {
    EXPECT_EQ(verdict[r].rfind("VERDICT TimedOut", 0), 0u) << "rank " << r << ": " << verdict[r];
    EXPECT_NE(verdict[r].find(" LEASED 0"), std::string::npos) << "rank " << r << " leaked: " << verdict[r];
  }
}

INSTANTIATE_TEST_SUITE_P(Transports, MultiProcessTest, testing::ValuesIn(transports()), param_name);

}  // namespace
