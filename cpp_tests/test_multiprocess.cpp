// Ranks in separate processes (fork + exec of kvlink_rank_helper, lines over pipes): a cancel
// agreed across four rank processes. (The TensorRT-LLM wrapper's multi-process tests are in
// test_trtllm_callsites.cpp.)
#include "test_util.h"

#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <map>
#include <memory>

using namespace kvtest;

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
