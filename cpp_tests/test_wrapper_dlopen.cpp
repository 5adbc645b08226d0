// libkvlink_trtllm_wrapper.so as TensorRT-LLM loads a backend: dlopen, dlsym the extern "C"
// factory, and drive the managers only through TensorRT-LLM's generic interface
// (ConnectionManager / Connection, the stand-ins of cpp_tests/trtllm_shapes). This binary does
// not link kvlink: every line of kvlink that runs comes out of the shared library.
// Ranks here share one process; test_trtllm_callsites.cpp runs them in separate processes.
#include "../wrapper/kvlink_trtllm_wire.hpp"
#include "helpers/wrapper_probe.h"
#include "trtllm_test_util.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <future>
#include <map>
#include <mutex>
#include <thread>

using namespace kvtest;
using namespace std::chrono_literals;

namespace {

std::string param_name(testing::TestParamInfo<std::string> const& i) { return i.param; }

/// A terminate flag that sets itself after `after` unless the watchdog is destroyed first: the
/// context side's calls of a test take it, so that a request lost by a bug fails the test
/// instead of hanging it. Declare it before the futures whose threads use it.
class Watchdog {
 public:
  explicit Watchdog(std::chrono::milliseconds after)
      : task_(std::async(std::launch::async, [this, after, done = done_.get_future()] {
          if (done.wait_for(after) == std::future_status::timeout) flag.store(true);
        })) {}
  ~Watchdog() {
    done_.set_value();
    task_.get();
  }
  Watchdog(Watchdog const&) = delete;
  Watchdog& operator=(Watchdog const&) = delete;
  std::atomic<bool> flag{false};

 private:
  std::promise<void> done_;
  std::future<void> task_;
};

class WrapperTest : public testing::TestWithParam<std::string> {
 protected:
  /// The build of the wrapper the test loads.
  virtual char const* library() const { return KVLINK_WRAPPER_PATH; }
  void SetUp() override {
    wrapper_ = std::make_unique<Wrapper>(library());
    ctx_ = make(*wrapper_, options(GetParam()));
    gen_ = make(*wrapper_, options(GetParam()));
    auto conns = gen_->getConnections(ctx_->getCommState());
    ASSERT_EQ(conns.size(), 1u);
    toCtx_ = conns.at(0);
    ASSERT_NE(toCtx_, nullptr);
  }
  void TearDown() override {
    gen_.reset();
    ctx_.reset();
    wrapper_.reset();
  }
  std::unique_ptr<Wrapper> wrapper_;
  std::unique_ptr<kv::ConnectionManager> ctx_, gen_;
  kv::Connection const* toCtx_ = nullptr;
  std::atomic<bool> never_{false};
};

TEST(WrapperFactory, ExportsOnlyTheFactoryAndRefusesBadOptions) {
  Wrapper w;
  // Only the factory is exported: the Rust library and the classes inside stay private.
  EXPECT_EQ(dlsym(w.handle, "cxxbridge1$string$new"), nullptr);
  EXPECT_EQ(dlsym(w.handle, "rust_eh_personality"), nullptr);
  char err[256] = {0};
  EXPECT_EQ(w.make(nullptr, err, sizeof err), nullptr);
  EXPECT_NE(std::string(err).find("KvlinkTrtllmOptions"), std::string::npos) << err;
  KvlinkTrtllmOptions o = options("tcp", 2, 2);  // rank outside the world
  EXPECT_EQ(w.make(&o, err, sizeof err), nullptr);
  EXPECT_NE(std::string(err).find("outside"), std::string::npos) << err;
  o = options("tcp", 0, 2);  // two ranks and no way to exchange addresses
  EXPECT_EQ(w.make(&o, err, sizeof err), nullptr);
  EXPECT_NE(std::string(err).find("allgather"), std::string::npos) << err;
  o = options("carrier-pigeon");
  o.transport = "carrier-pigeon";
  EXPECT_EQ(w.make(&o, err, sizeof err), nullptr);
  EXPECT_STRNE(err, "");
}

// The factory refuses each of `bad` as the value of the environment variable `var`, with a
// message naming it, and takes `good`.
void expectEnvRefused(KvlinkTrtllmOptions const& o, char const* var, std::initializer_list<char const*> bad,
                      char const* good) {
  Wrapper w;
  char err[256] = {0};
  for (char const* v : bad) {
    setenv(var, v, 1);
    err[0] = '\0';
    void* m = w.make(&o, err, sizeof err);
    if (m != nullptr) {
      delete static_cast<kv::ConnectionManager*>(m);
      ADD_FAILURE() << var << "=" << v << " was taken";
    } else {
      EXPECT_NE(std::string(err).find(var), std::string::npos) << v << ": " << err;
    }
  }
  setenv(var, good, 1);
  void* m = w.make(&o, err, sizeof err);
  unsetenv(var);
  EXPECT_NE(m, nullptr) << var << "=" << good << " was refused: " << err;
  delete static_cast<kv::ConnectionManager*>(m);
}

// TRTLLM_KVLINK_RANK_ID names this engine's 32-bit kvlink rank. A value that is not one (past
// 2^32 - 1, negative, trailing junk) is refused, not cut to 32 bits: 4294967297 became rank 1,
// the rank of another process configured with 1, and "-1" wrapped to 4294967295.
TEST(WrapperFactory, ARankIdThatIsNotA32BitNumberIsRefused) {
  expectEnvRefused(options("tcp"), "TRTLLM_KVLINK_RANK_ID",
                   {"4294967297", "4294967296", "-1", "12abc", "99999999999999999999"}, "4294967295");
}

// TRTLLM_KVLINK_TIMEOUT_MS (used when the options leave kv_transfer_timeout_ms out) that is not a
// positive number of milliseconds is refused with a message naming it. Before, "5s" was read as
// 5 ms, "abc" and a number past 64 bits failed with std::stoll's bare "stoll", and "-1" or "0"
// with a message about kv_transfer_timeout_ms, which the host had not set.
TEST(WrapperFactory, ATimeoutFromTheEnvironmentThatIsNotANumberIsRefused) {
  KvlinkTrtllmOptions o = options("tcp");
  o.kv_transfer_timeout_ms = 0;
  expectEnvRefused(o, "TRTLLM_KVLINK_TIMEOUT_MS", {"abc", "5s", "-1", "0", " 700", "99999999999999999999"}, "700");
}

/// The context side of request `id`: takes the next envelope (it must be `id`'s), answers ready
/// The context side's first half of request `id`: takes its envelope (throws if none, or
/// another request's) and answers ready; returns the connection the data goes on.
kv::Connection const* takeReady(kv::ConnectionManager& ctx, GenSide const& gen, uint64_t id,
                                std::atomic<bool> const& terminate) {
  Taken t = recvRequestInfo(ctx, terminate);
  if (t.conn == nullptr) throw std::runtime_error("no request taken (the envelope of " + std::to_string(id) + " was lost)");
  if (t.info.getRequestId() != id) {
    throw std::runtime_error("request " + std::to_string(t.info.getRequestId()) + " taken, not " + std::to_string(id));
  }
  bool const ready = true;
  t.conn->send(kv::DataContext{gen.tags.ready(id)}, &ready, sizeof ready);
  return t.conn;
}

/// and sends `src` into the request's one buffer.
void serveOne(kv::ConnectionManager& ctx, GenSide const& gen, uint64_t id, std::vector<uint8_t> const& src,
              std::atomic<bool> const& terminate) {
  kv::Connection const* conn = takeReady(ctx, gen, id, terminate);
  conn->send(kv::DataContext{gen.tags.data(id)}, src.data(), src.size());
}

/// The generation side of one request `id` that the context side serves with serveOne's
/// pattern: sends its info, expects ready (`what` names the request in the failure) and checks
/// every byte that lands.
void expectServed(GenSide const& gen, uint64_t id, std::atomic<bool> const& never, char const* what) {
  std::vector<uint8_t> dst(4096, 0);
  gen.sendRequestInfo(id);
  bool const ready = gen.recvReady(id, never);
  EXPECT_TRUE(ready) << what << " was refused";
  if (!ready) return;
  gen.conn->recv(kv::DataContext{gen.tags.data(id), never}, dst.data(), dst.size());
  EXPECT_EQ(check(id, 0, dst.data(), dst.size()), SIZE_MAX) << what;
}

/// tcp options whose log hook is `fn`, at every level (trace).
KvlinkTrtllmOptions traced(KvlinkLogFn fn, int rank = 0, int world = 1) {
  KvlinkTrtllmOptions o = options("tcp", rank, world);
  o.log = fn;
  o.log_level = 5;
  return o;
}

// A factory call that fails after registering the host's log hook (here: a
// transport UCX does not have) must not leave that hook installed: the host gets NULL and may
// free `log_user`, yet kvlink's later events (another manager's) would still be sent there.
std::atomic<int> g_failed_factory_log_calls{0};
TEST(WrapperFactory, AFailedFactoryLeavesNoLogHookBehind) {
  Wrapper w;
  KvlinkTrtllmOptions o = options("tcp");
  o.transport = "carrier-pigeon";
  o.log = [](void*, int, char const*, size_t) { g_failed_factory_log_calls.fetch_add(1); };
  o.log_level = 5;
  char err[256] = {0};
  ASSERT_EQ(w.make(&o, err, sizeof err), nullptr);
  g_failed_factory_log_calls.store(0);
  // Managers made without a hook, connected to each other: whatever they log must not reach the
  // hook of the factory call that failed.
  auto a = make(w, options("tcp"));
  auto b = make(w, options("tcp"));
  ASSERT_EQ(b->getConnections(a->getCommState()).size(), 1u);
  b.reset();
  a.reset();
  EXPECT_EQ(g_failed_factory_log_calls.load(), 0) << "the failed factory's log hook was still called";
}

// Two managers, each with its own hook: when the newer goes, the older's events reach the
// older's hook again, never the hook of the manager that is gone (its host may have freed
// `log_user`). Before, the sink stayed the newer's until the last manager went.
std::atomic<int> g_hook_a_calls{0};
std::atomic<int> g_hook_b_calls{0};
TEST(WrapperFactory, TheLogSinkFollowsTheLiveManagersHooks) {
  Wrapper w;
  KvlinkTrtllmOptions oa = traced([](void*, int, char const*, size_t) { g_hook_a_calls.fetch_add(1); });
  auto a = make(w, oa);
  KvlinkTrtllmOptions ob = traced([](void*, int, char const*, size_t) { g_hook_b_calls.fetch_add(1); });
  auto b = make(w, ob);
  b.reset();
  g_hook_a_calls.store(0);
  g_hook_b_calls.store(0);
  // A manager without a hook connects to `a`: what `a` and it log goes to `a`'s hook.
  auto c = make(w, options("tcp"));
  ASSERT_EQ(c->getConnections(a->getCommState()).size(), 1u);
  c.reset();
  // The hook is called on kvlink's log thread, after the event: give the records time to arrive.
  for (auto until = Clock::now() + 10s; g_hook_a_calls.load() == 0 && Clock::now() < until;) {
    std::this_thread::sleep_for(10ms);
  }
  EXPECT_EQ(g_hook_b_calls.load(), 0) << "a gone manager's hook was called";
  EXPECT_GT(g_hook_a_calls.load(), 0) << "the live manager's hook was not called";
  a.reset();
  g_hook_a_calls.store(0);
  auto d = make(w, options("tcp"));
  auto e = make(w, options("tcp"));
  ASSERT_EQ(e->getConnections(d->getCommState()).size(), 1u);
  EXPECT_EQ(g_hook_a_calls.load() + g_hook_b_calls.load(), 0) << "no manager holds a hook: no hook is called";
}

std::atomic<int> g_hook_made_late_calls{0};

// A context manager replaced by a new one at the same fixed address (a context server restarted
// on its port, with a new rank): the generation side's getConnections for the new CommState
// reaches the new manager, and its requests complete. Before, the connection was cached by
// address for good and kept naming the old rank: every request to the new one failed.
TEST(WrapperRestart, AContextRestartedAtTheSameAddressIsReachedAgain) {
  Wrapper w;
  std::atomic<bool> never{false};
  auto gen = make(w, options("tcp"));
  auto serve = [&](kv::ConnectionManager& ctx, uint64_t id) {
    auto conns = gen->getConnections(ctx.getCommState());
    ASSERT_EQ(conns.size(), 1u);
    GenSide side{conns.at(0), Tags{true}};
    std::vector<uint8_t> src(4096), dst(4096, 0);
    fill(id, 0, src.data(), src.size());
    Watchdog dog(10s);
    std::atomic<bool> const& giveUp = dog.flag;
    auto server = std::async(std::launch::async, [&] { serveOne(ctx, side, id, src, giveUp); });
    try {
      side.sendRequestInfo(id);
      ASSERT_TRUE(side.recvReady(id, never)) << "request " << id << " was refused";
      side.conn->recv(kv::DataContext{side.tags.data(id), never}, dst.data(), dst.size());
      EXPECT_EQ(check(id, 0, dst.data(), dst.size()), SIZE_MAX);
    } catch (std::exception const& e) {
      ADD_FAILURE() << "request " << id << ": " << e.what();
    }
    dog.flag = true;  // a server still waiting for the request gives up
    try {
      server.get();
    } catch (std::exception const& e) {
      ADD_FAILURE() << "request " << id << " at the context side: " << e.what();
    }
  };
  auto first = make(w, options("tcp"));
  std::string const address = first->getCommState().getAgentState().at(0).mConnectionInfo;
  serve(*first, 4371);
  first.reset();
  KvlinkTrtllmOptions o = options("tcp");
  o.listen = address.c_str();
  std::unique_ptr<kv::ConnectionManager> second;
  // The port may stay taken for a moment after the first manager's listener closed.
  for (auto const until = Clock::now() + 5s; !second && Clock::now() < until;) {
    try {
      second = make(w, o);
    } catch (std::exception const&) {
      std::this_thread::sleep_for(50ms);
    }
  }
  ASSERT_TRUE(second) << "no manager could listen at " << address << " again";
  ASSERT_EQ(second->getCommState().getAgentState().at(0).mConnectionInfo, address);
  serve(*second, 4372);
}

// A manager destroyed while another's factory call is under way (making the engine, waiting in
// the allgather): the new manager's hook, installed by its factory call before the manager
// existed, is still the sink once the manager is made. Before, the destruction removed it (no
// live manager held a hook yet), and the new manager's events reached no hook for its whole life.
TEST(WrapperFactory, AManagerMadeWhileAnotherIsDestroyedKeepsItsHook) {
  Wrapper w;
  KvlinkTrtllmOptions oa = traced([](void*, int, char const*, size_t) {});
  auto a = make(w, oa);
  struct Gate {
    std::promise<void> entered;
    std::shared_future<void> open;
  };
  std::promise<void> opener;
  Gate gate{{}, opener.get_future().share()};
  KvlinkTrtllmOptions ob = traced([](void*, int, char const*, size_t) { g_hook_made_late_calls.fetch_add(1); }, 0, 2);
  ob.allgather = [](void* user, void const* mine, size_t size, void* all) -> int {
    auto* g = static_cast<Gate*>(user);
    g->entered.set_value();
    g->open.wait();
    // Both ranks' records are this one's: enough for a manager that only listens here.
    std::memcpy(all, mine, size);
    std::memcpy(static_cast<char*>(all) + size, mine, size);
    return 0;
  };
  ob.allgather_user = &gate;
  auto made = std::async(std::launch::async, [&] { return make(w, ob); });
  bool const entered = gate.entered.get_future().wait_for(10s) == std::future_status::ready;
  if (entered) a.reset();
  opener.set_value();
  ASSERT_TRUE(entered) << "the factory call never reached its allgather";
  auto b = made.get();
  ASSERT_NE(b, nullptr);
  g_hook_made_late_calls.store(0);
  // A manager without a hook connects to `b`: what they log goes to `b`'s hook, the newest.
  auto c = make(w, options("tcp"));
  ASSERT_FALSE(c->getConnections(b->getCommState()).empty());
  c.reset();
  for (auto until = Clock::now() + 10s; g_hook_made_late_calls.load() == 0 && Clock::now() < until;) {
    std::this_thread::sleep_for(10ms);
  }
  EXPECT_GT(g_hook_made_late_calls.load(), 0) << "the live manager's hook was not called";
}

std::atomic<bool> g_in_slow_hook{false};
std::atomic<int> g_slow_hook_calls{0};

// kvlink calls the hooks on its log thread. When the manager whose hook is the sink's goes and
// an older manager's hook takes over, a call of the departing hook already under way must have
// returned by the time the manager's destruction returns: the host may free `log_user` then.
// The departing hook here takes 100 ms a call, and a call of it is under way at the destruction.
TEST(WrapperFactory, ADestroyedManagersHookIsNotRunningOnceTheDestructionReturns) {
  Wrapper w;
  KvlinkTrtllmOptions oa = traced([](void*, int, char const*, size_t) {});
  auto a = make(w, oa);
  KvlinkTrtllmOptions ob = traced([](void*, int, char const*, size_t) {
    g_in_slow_hook.store(true);
    std::this_thread::sleep_for(100ms);
    g_slow_hook_calls.fetch_add(1);
    g_in_slow_hook.store(false);
  });
  auto b = make(w, ob);
  // What this connection logs goes to `b`'s hook, the newest.
  auto c = make(w, options("tcp"));
  ASSERT_EQ(c->getConnections(b->getCommState()).size(), 1u);
  for (auto until = Clock::now() + 10s; !g_in_slow_hook.load() && Clock::now() < until;) {
    std::this_thread::sleep_for(1ms);
  }
  ASSERT_TRUE(g_in_slow_hook.load()) << "b's hook was never called";
  b.reset();
  EXPECT_FALSE(g_in_slow_hook.load()) << "b's hook still ran after its manager was destroyed";
  int const calls = g_slow_hook_calls.load();
  std::this_thread::sleep_for(300ms);
  EXPECT_EQ(g_slow_hook_calls.load(), calls) << "b's hook was called after its manager was destroyed";
}

std::atomic<bool> g_in_slower_hook{false};

// A factory call (another manager with a hook of its own) made while a manager's destruction
// waits for its departing hook's call under way (1.5 s, past the 500 ms the destruction waits
// for it): the factory call does not wait for that. Found by review: the wrapper held its log
// lock across the wait, so every other manager's factory call and destruction queued behind a
// slow hook.
TEST(WrapperFactory, AFactoryCallDoesNotWaitForADepartingHooksCall) {
  Wrapper w;
  auto a = make(w, traced([](void*, int, char const*, size_t) {}));
  auto b = make(w, traced([](void*, int, char const*, size_t) {
    g_in_slower_hook.store(true);
    std::this_thread::sleep_for(1500ms);
    g_in_slower_hook.store(false);
  }));
  auto c = make(w, options("tcp"));
  ASSERT_EQ(c->getConnections(b->getCommState()).size(), 1u);
  for (auto until = Clock::now() + 10s; !g_in_slower_hook.load() && Clock::now() < until;) {
    std::this_thread::sleep_for(1ms);
  }
  ASSERT_TRUE(g_in_slower_hook.load()) << "b's hook was never called";
  auto const t0 = Clock::now();
  auto destroyed = std::async(std::launch::async, [&] {
    b.reset();
    return Clock::now();
  });
  // By now the destruction waits for the hook's call (up to 500 ms), before it takes down b's
  // engine.
  std::this_thread::sleep_for(20ms);
  auto d = make(w, traced([](void*, int, char const*, size_t) {}));
  auto const made = Clock::now();
  auto const gone = destroyed.get();
  auto const ms = [&](Clock::time_point t) { return std::chrono::duration<double, std::milli>(t - t0).count(); };
  std::printf("destruction returned at %.0f ms, the factory call at %.0f ms\n", ms(gone), ms(made));
  EXPECT_LT(made, gone) << "the factory call waited for the departing hook's call";
  // The slow call ends before the wrapper goes (it runs the wrapper's code).
  for (auto until = Clock::now() + 5s; g_in_slower_hook.load() && Clock::now() < until;) {
    std::this_thread::sleep_for(1ms);
  }
  d.reset();
  c.reset();
  a.reset();
}

std::atomic<bool> g_in_older_hook{false};

// A manager whose hook a newer manager's replaced while a call of it was under way (a
// replacement does not wait): its destruction still waits for that call, though its hook is no
// longer the sink's. Found by review of the change that took the wait out of the log lock:
// an older manager's going returned at once, the host free to release `log_user` under the call.
TEST(WrapperFactory, AnOlderManagersHookIsNotRunningOnceItsDestructionReturns) {
  Wrapper w;
  auto a = make(w, traced([](void*, int, char const*, size_t) {
    g_in_older_hook.store(true);
    std::this_thread::sleep_for(300ms);
    g_in_older_hook.store(false);
  }));
  auto c = make(w, options("tcp"));
  ASSERT_EQ(c->getConnections(a->getCommState()).size(), 1u);
  for (auto until = Clock::now() + 10s; !g_in_older_hook.load() && Clock::now() < until;) {
    std::this_thread::sleep_for(1ms);
  }
  ASSERT_TRUE(g_in_older_hook.load()) << "a's hook was never called";
  auto b = make(w, traced([](void*, int, char const*, size_t) {}));
  a.reset();
  EXPECT_FALSE(g_in_older_hook.load()) << "a's hook still ran after its manager was destroyed";
  c.reset();
  b.reset();
}

// Kv_transfer_timeout_ms far beyond a year (INT64_MAX: "no timeout") is taken
// as a year by the engine (EngineConfig::timeout), but the wrapper's own deadlines
// (`after(timeout)`, `deadline + grace`) must not overflow into the past: getConnections must
// connect and a request must still run.
TEST(WrapperFactory, AHugeTransferTimeoutDoesNotWrapIntoThePast) {
  Wrapper w;
  KvlinkTrtllmOptions o = options("tcp");
  o.kv_transfer_timeout_ms = INT64_MAX;
  auto ctx = make(w, o);
  o.agreement_ms = UINT64_MAX / 4;
  auto gen = make(w, o);
  std::vector<kv::Connection const*> conns;
  ASSERT_NO_THROW(conns = gen->getConnections(ctx->getCommState()));
  ASSERT_EQ(conns.size(), 1u);
  std::atomic<bool> never{false};
  GenSide side{conns[0], Tags{true}};
  constexpr uint64_t kId = 77;
  std::vector<uint8_t> src(4096), dst(4096, 0);
  fill(kId, 0, src.data(), src.size());
  auto server = std::async(std::launch::async, [&] {
    Taken t = recvRequestInfo(*ctx, never);
    if (t.conn == nullptr) throw std::runtime_error("no request taken");
    bool const ready = true;
    t.conn->send(kv::DataContext{side.tags.ready(kId)}, &ready, sizeof ready);
    std::atomic<bool> cancel{false};
    t.conn->send(kv::DataContext{side.tags.data(kId), cancel}, src.data(), src.size());
  });
  side.sendRequestInfo(kId);
  EXPECT_TRUE(side.recvReady(kId, never));
  std::atomic<bool> cancel{false};
  EXPECT_NO_THROW(conns[0]->recv(kv::DataContext{side.tags.data(kId), cancel}, dst.data(), dst.size()));
  EXPECT_NO_THROW(server.get());
  EXPECT_EQ(check(kId, 0, dst.data(), dst.size()), SIZE_MAX);
}

// The host's allgather fills each rank's record; one that does not end in NUL (a host that
// packs records its own way, a corrupt peer) is a bad record, never read on into the next one:
// before, rank 0's 8 KiB of 'x' ran into rank 1's record and made an agent of both.
TEST(WrapperFactory, AnAllgatherRecordWithoutItsEndIsRefusedNotReadPast) {
  Wrapper w;
  KvlinkTrtllmOptions o = options("tcp", 0, 2);
  o.allgather = [](void*, void const*, size_t size, void* all) {
    auto* out = static_cast<char*>(all);
    std::memset(out, 'x', size);  // rank 0: all of it, no NUL
    std::memset(out + size, 0, size);
    std::string const other = "peer\n127.0.0.1:1";
    std::memcpy(out + size, other.data(), other.size());
    return 0;
  };
  char err[256] = {0};
  EXPECT_EQ(w.make(&o, err, sizeof err), nullptr);
  EXPECT_NE(std::string(err).find("bad agent record from rank 0"), std::string::npos) << err;
}

// The address a manager publishes in its CommState is one another node can dial: the default
// wildcard listener (0.0.0.0:0) is published at an interface's address, and a transport with
// devices (tcp@lo) listens too. Before, the wildcard was published as "0.0.0.0:port", which the
// other node dials as its own loopback, and tcp@lo did not listen at all (a worker address).
TEST(WrapperFactory, PublishesAnAddressAnotherNodeCanDial) {
  Wrapper w;
  auto published = [](kv::ConnectionManager& m) { return m.getCommState().getAgentState().at(0).mConnectionInfo; };
  for (char const* transport : {"tcp", "tcp@lo"}) {
    SCOPED_TRACE(transport);
    KvlinkTrtllmOptions o = options("tcp");
    o.transport = transport;
    o.listen = nullptr;  // the wrapper's default, TRTLLM_KVLINK_LISTEN unset
    ASSERT_EQ(std::getenv("TRTLLM_KVLINK_LISTEN"), nullptr);
    auto m = make(w, o);
    std::string const at = published(*m);
    auto const colon = at.rfind(':');
    ASSERT_NE(colon, std::string::npos) << at;
    EXPECT_NE(at.rfind("0.0.0.0:", 0), 0u) << at;
    EXPECT_NE(at.rfind("ucx:", 0), 0u) << at;
    EXPECT_GT(std::stoi(at.substr(colon + 1)), 0) << at;
    if (std::string(transport) == "tcp@lo") {
      EXPECT_EQ(at.substr(0, colon), "127.0.0.1");
    }
    // And it is reached there.
    KvlinkTrtllmOptions po = options("tcp");
    po.transport = transport;
    auto peer = make(w, po);
    auto conns = peer->getConnections(m->getCommState());
    ASSERT_EQ(conns.size(), 1u);
    EXPECT_NE(conns[0], nullptr);
  }
}

// A listen address given with a transport other than tcp is honoured, not dropped: before, an
// `auto` rank told TRTLLM_KVLINK_LISTEN (here the options' listen) published its worker address
// and listened nowhere. Without one it still publishes the worker address.
TEST(WrapperFactory, AnAutoRankListensWhereTold) {
  Wrapper w;
  auto published = [](kv::ConnectionManager& m) { return m.getCommState().getAgentState().at(0).mConnectionInfo; };
  KvlinkTrtllmOptions o = options("tcp");
  o.transport = "auto";
  o.listen = "127.0.0.1:0";
  auto m = make(w, o);
  std::string const at = published(*m);
  EXPECT_EQ(at.rfind("127.0.0.1:", 0), 0u) << at;
  KvlinkTrtllmOptions po = options("tcp");
  po.transport = "auto";
  po.listen = nullptr;
  ASSERT_EQ(std::getenv("TRTLLM_KVLINK_LISTEN"), nullptr);
  auto peer = make(w, po);
  EXPECT_EQ(published(*peer).rfind("ucx:", 0), 0u) << published(*peer);
  auto conns = peer->getConnections(m->getCommState());
  ASSERT_EQ(conns.size(), 1u);
  EXPECT_NE(conns[0], nullptr);
}

// getCommState() lists every rank of the instance (from the allgather) with selfIdx = rank:
// what CacheSender / CacheReceiver check at construction and index connections by.
TEST(WrapperFactory, CommStateCoversEveryRankWithSelfIdxTheRank) {
  Wrapper w;
  char dir[] = "/tmp/kvlink-commstate-XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  std::unique_ptr<kv::ConnectionManager> m[2];
  std::vector<std::thread> ts;
  FileAllgather g[2];
  for (int r = 0; r < 2; ++r) {
    g[r] = FileAllgather{dir, "ctx", r, 2};
    ts.emplace_back([&, r] {
      KvlinkTrtllmOptions o = options("tcp", r, 2);
      o.allgather = &FileAllgather::call;
      o.allgather_user = &g[r];
      m[r] = make(w, o);
    });
  }
  for (auto& t : ts) t.join();
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(m[r]);
    auto const& s = m[r]->getCommState();
    EXPECT_EQ(s.getSelfIdx(), r);
    ASSERT_TRUE(s.isAgentState());
    ASSERT_EQ(s.getAgentState().size(), 2u);
    EXPECT_TRUE(m[r]->isRunning());
  }
  EXPECT_EQ(m[0]->getCommState(), m[1]->getCommState());
  EXPECT_NE(m[0]->getCommState().getAgentState()[0].mConnectionInfo,
            m[0]->getCommState().getAgentState()[1].mConnectionInfo);
  // A peer connects to each rank by its index: connections[i] reaches rank i.
  auto peer = make(w, options("tcp"));
  auto conns = peer->getConnections(m[0]->getCommState());
  ASSERT_EQ(conns.size(), 2u);
  EXPECT_NE(conns[0], nullptr);
  EXPECT_NE(conns[1], nullptr);
  EXPECT_NE(conns[0], conns[1]);
}

// A send from a null pointer with a size is a typed error, on every kind of tag, and the
// connection then serves a request (before, the request-info tag copied from the null pointer);
// so is an empty data send, at once.
TEST_P(WrapperTest, ASendFromNullIsATypedErrorAndTheConnectionServesOn) {
  for (int tag : {int(bm::TransceiverTag::kID_TAG), int(bm::TransceiverTag::kINFO_TAG), Tags{}.ready(7), Tags{}.data(7)}) {
    try {
      toCtx_->send(kv::DataContext{tag}, nullptr, 16);
      ADD_FAILURE() << "tag " << tag << ": a send of 16 bytes from null was taken";
    } catch (std::exception const& e) {
      EXPECT_NE(std::string(e.what()).find("InvalidArgument"), std::string::npos) << tag << ": " << e.what();
    }
  }
  GenSide gen{toCtx_, Tags{true}};
  constexpr uint64_t kId = 4343;
  std::vector<uint8_t> src(4096), dst(4096, 0);
  fill(kId, 0, src.data(), src.size());
  auto server = std::async(std::launch::async, [&] {
    Taken t = recvRequestInfo(*ctx_, never_);
    if (t.conn == nullptr) throw std::runtime_error("no request taken");
    bool const ready = true;
    t.conn->send(kv::DataContext{gen.tags.ready(kId)}, &ready, sizeof ready);
    std::atomic<bool> cancel{false};
    // An empty data send is refused at once and takes nothing, as an empty recv is (before,
    // it waited to the request's deadline for a buffer no recv advertises).
    auto const t0 = std::chrono::steady_clock::now();
    try {
      t.conn->send(kv::DataContext{gen.tags.data(kId), cancel}, src.data(), 0);
      ADD_FAILURE() << "an empty data send was taken";
    } catch (std::exception const& e) {
      EXPECT_NE(std::string(e.what()).find("InvalidArgument"), std::string::npos) << e.what();
    }
    EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(1)) << "the empty send waited";
    t.conn->send(kv::DataContext{gen.tags.data(kId), cancel}, src.data(), src.size());
  });
  gen.sendRequestInfo(kId);
  EXPECT_TRUE(gen.recvReady(kId, never_));
  std::atomic<bool> cancel{false};
  toCtx_->recv(kv::DataContext{gen.tags.data(kId), cancel}, dst.data(), dst.size());
  server.get();
  EXPECT_EQ(check(kId, 0, dst.data(), dst.size()), SIZE_MAX);
}

// A recv into a null pointer with a size is a typed error on every kind of tag (recvConnect's
// id, the rest of the envelope, the ready signal, data), and takes nothing: the same request
// then runs with real buffers (before, the envelope and ready tags copied into the null pointer).
TEST_P(WrapperTest, ARecvIntoNullIsATypedErrorAndTheRequestRunsOn) {
  auto const expect_invalid = [](auto&& f, char const* what) {
    try {
      f();
      ADD_FAILURE() << what << ": a recv of bytes into null was taken";
    } catch (std::exception const& e) {
      EXPECT_NE(std::string(e.what()).find("InvalidArgument"), std::string::npos) << what << ": " << e.what();
    }
  };
  GenSide gen{toCtx_, Tags{true}};
  constexpr uint64_t kId = 4344;
  std::vector<uint8_t> src(4096), dst(4096, 0);
  fill(kId, 0, src.data(), src.size());
  auto server = std::async(std::launch::async, [&] {
    bm::TransceiverTag::Id id{};
    expect_invalid([&] { ctx_->recvConnect(kv::DataContext{bm::TransceiverTag::kID_TAG, never_}, nullptr, sizeof id); },
                   "recvConnect");
    kv::Connection const* conn = ctx_->recvConnect(kv::DataContext{bm::TransceiverTag::kID_TAG, never_}, &id, sizeof id);
    if (conn == nullptr) throw std::runtime_error("no request taken");
    uint64_t size = 0;
    expect_invalid([&] { conn->recv(kv::DataContext{bm::TransceiverTag::kINFO_SIZE_TAG, never_}, nullptr, sizeof size); },
                   "recv of the info size");
    conn->recv(kv::DataContext{bm::TransceiverTag::kINFO_SIZE_TAG, never_}, &size, sizeof size);
    std::string info(size, '\0');
    conn->recv(kv::DataContext{bm::TransceiverTag::kINFO_TAG, never_}, info.data(), size);
    bool const ready = true;
    conn->send(kv::DataContext{gen.tags.ready(kId)}, &ready, sizeof ready);
    std::atomic<bool> cancel{false};
    conn->send(kv::DataContext{gen.tags.data(kId), cancel}, src.data(), src.size());
  });
  gen.sendRequestInfo(kId);
  expect_invalid([&] { toCtx_->recv(kv::DataContext{gen.tags.ready(kId), never_}, nullptr, 1); }, "recv of the ready signal");
  EXPECT_TRUE(gen.recvReady(kId, never_));
  std::atomic<bool> cancel{false};
  expect_invalid([&] { toCtx_->recv(kv::DataContext{gen.tags.data(kId), cancel}, nullptr, dst.size()); }, "recv of data");
  toCtx_->recv(kv::DataContext{gen.tags.data(kId), cancel}, dst.data(), dst.size());
  server.get();
  EXPECT_EQ(check(kId, 0, dst.data(), dst.size()), SIZE_MAX);
}

// A recv of the rest of a taken envelope with the wrong size is a typed error and takes nothing,
// as one into null is: the same recv with the right size then reads the message and the request
// runs. Before, the message was taken out before its size was checked, so the right recv found
// "no envelope taken" and the request was lost (its generation rank waited out its deadline).
TEST_P(WrapperTest, ARecvOfTheEnvelopeWithTheWrongSizeTakesNothing) {
  GenSide gen{toCtx_, Tags{true}};
  constexpr uint64_t kId = 4345;
  std::vector<uint8_t> src(4096), dst(4096, 0);
  fill(kId, 0, src.data(), src.size());
  auto server = std::async(std::launch::async, [&] {
    bm::TransceiverTag::Id id{};
    kv::Connection const* conn = ctx_->recvConnect(kv::DataContext{bm::TransceiverTag::kID_TAG, never_}, &id, sizeof id);
    if (conn == nullptr) throw std::runtime_error("no request taken");
    uint64_t size = 0;
    uint32_t small = 0;
    try {
      conn->recv(kv::DataContext{bm::TransceiverTag::kINFO_SIZE_TAG, never_}, &small, sizeof small);
      ADD_FAILURE() << "a recv of 4 bytes took the 8-byte info size";
    } catch (std::exception const& e) {
      EXPECT_NE(std::string(e.what()).find("InvalidArgument"), std::string::npos) << e.what();
    }
    conn->recv(kv::DataContext{bm::TransceiverTag::kINFO_SIZE_TAG, never_}, &size, sizeof size);
    std::string info(size, '\0');
    conn->recv(kv::DataContext{bm::TransceiverTag::kINFO_TAG, never_}, info.data(), size);
    bool const ready = true;
    conn->send(kv::DataContext{gen.tags.ready(kId)}, &ready, sizeof ready);
    conn->send(kv::DataContext{gen.tags.data(kId)}, src.data(), src.size());
  });
  gen.sendRequestInfo(kId);
  EXPECT_TRUE(gen.recvReady(kId, never_));
  toCtx_->recv(kv::DataContext{gen.tags.data(kId)}, dst.data(), dst.size());
  server.get();
  EXPECT_EQ(check(kId, 0, dst.data(), dst.size()), SIZE_MAX);
}

// The generic path, with the older releases' tags (12-bit data tag, fixed ready tag 42):
// request info round trip, ready, and three KV-shaped segments checked byte for byte.
TEST_P(WrapperTest, GenericPathMovesARequestByteForByte) {
  GenSide gen{toCtx_, Tags{false}};
  constexpr uint64_t kId = 4242;
  std::vector<std::vector<uint8_t>> src(3, std::vector<uint8_t>(256 * 1024)), dst(3, std::vector<uint8_t>(256 * 1024));
  for (size_t i = 0; i < src.size(); ++i) fill(kId, i, src[i].data(), src[i].size());
  auto server = std::async(std::launch::async, [&] {
    Taken t = recvRequestInfo(*ctx_, never_);
    EXPECT_NE(t.conn, nullptr);
    EXPECT_EQ(t.info.getRequestId(), kId);
    EXPECT_EQ(t.info.getTransState().getCacheState()->opaque(), "layout");
    bool const ready = true;
    t.conn->send(kv::DataContext{gen.tags.ready(kId)}, &ready, sizeof ready);
    std::atomic<bool> cancel{false};
    kv::DataContext const data{gen.tags.data(kId), cancel};
    for (auto& s : src) t.conn->send(data, s.data(), s.size());
  });
  gen.sendRequestInfo(kId);
  EXPECT_TRUE(gen.recvReady(kId, never_));
  std::atomic<bool> cancel{false};
  kv::DataContext const data{gen.tags.data(kId), cancel};
  for (auto& d : dst) toCtx_->recv(data, d.data(), d.size());
  server.get();
  for (size_t i = 0; i < dst.size(); ++i) EXPECT_EQ(check(kId, i, dst[i].data(), dst[i].size()), SIZE_MAX) << i;
}

// A context rank that refuses (sendReadySignal false) is a `false`, not an error; the
// connection then serves the next request.
TEST_P(WrapperTest, RefusedReadySignalReadsFalseAndTheNextRequestRuns) {
  GenSide gen{toCtx_, Tags{true}};
  auto server = std::async(std::launch::async, [&] {
    for (bool ready : {false, true}) {
      Taken t = recvRequestInfo(*ctx_, never_);
      t.conn->send(kv::DataContext{gen.tags.ready(t.info.getRequestId())}, &ready, sizeof ready);
      if (!ready) continue;
      std::vector<uint8_t> s(4096);
      fill(t.info.getRequestId(), 0, s.data(), s.size());
      t.conn->send(kv::DataContext{gen.tags.data(t.info.getRequestId())}, s.data(), s.size());
    }
  });
  gen.sendRequestInfo(10);
  EXPECT_FALSE(gen.recvReady(10, never_));
  gen.sendRequestInfo(11);
  EXPECT_TRUE(gen.recvReady(11, never_));
  std::vector<uint8_t> d(4096);
  toCtx_->recv(kv::DataContext{gen.tags.data(11)}, d.data(), d.size());
  server.get();
  EXPECT_EQ(check(11, 0, d.data(), d.size()), SIZE_MAX);
}

// A ready signal for a request its generation rank has given up (its ready wait cancelled)
// does not throw on the context rank: upstream sends it on the thread that takes every
// generation rank's requests (CacheSender's response loop), which ends for good on an
// exception. That request's data send fails alone, and the same thread serves the next request.
// (Before, the ready send threw TransferError Cancelled.)
TEST_P(WrapperTest, AReadySignalForARequestItsGenerationRankGaveUpDoesNotThrow) {
  GenSide gen{toCtx_, Tags{true}};
  constexpr uint64_t kGone = 0x60E, kNext = 0x60F;
  std::promise<void> taken, givenUp;
  auto server = std::async(std::launch::async, [&] {
    Taken t = recvRequestInfo(*ctx_, never_);
    EXPECT_EQ(t.info.getRequestId(), kGone);
    taken.set_value();
    givenUp.get_future().wait();
    bool const ready = true;
    EXPECT_NO_THROW(t.conn->send(kv::DataContext{gen.tags.ready(kGone)}, &ready, sizeof ready));
    std::vector<uint8_t> s(4096);
    fill(kGone, 0, s.data(), s.size());
    EXPECT_THROW(t.conn->send(kv::DataContext{gen.tags.data(kGone)}, s.data(), s.size()), std::exception)
        << "the data send of a request its generation rank gave up";
    std::vector<uint8_t> next(4096);
    fill(kNext, 0, next.data(), next.size());
    serveOne(*ctx_, gen, kNext, next, never_);
  });
  gen.sendRequestInfo(kGone);
  taken.get_future().wait();
  std::atomic<bool> const giveUp{true};
  EXPECT_THROW(gen.recvReady(kGone, giveUp), kvlink::trtllm::TransferError);
  std::this_thread::sleep_for(50ms);  // the cancel reaches the context rank
  givenUp.set_value();
  expectServed(gen, kNext, never_, "the request after the one given up");
  server.get();
}

/// Requests `first` and `second` of one generation rank (`gen`), sent in that order from two
/// threads, both awaiting their ready signals on one connection; the context rank takes both
/// and answers them in the order `answered` gives (ids), then sends each its block. Each must
/// read ready and land its own bytes.
void expectTwoAwaitingReadyComplete(kv::ConnectionManager& ctx, GenSide const& gen, uint64_t first, uint64_t second,
                                    std::array<uint64_t, 2> answered, std::atomic<bool> const& never) {
  auto server = std::async(std::launch::async, [&] {
    std::map<uint64_t, Taken> taken;
    for (uint64_t want : {first, second}) {
      Taken t = recvRequestInfo(ctx, never);
      EXPECT_EQ(t.info.getRequestId(), want);
      taken[t.info.getRequestId()] = t;
    }
    bool const ready = true;
    for (uint64_t id : answered) {
      taken.at(id).conn->send(kv::DataContext{gen.tags.ready(id)}, &ready, sizeof ready);
    }
    for (uint64_t id : answered) {
      std::vector<uint8_t> s(4096);
      fill(id, 0, s.data(), s.size());
      taken.at(id).conn->send(kv::DataContext{gen.tags.data(id)}, s.data(), s.size());
    }
  });
  std::promise<void> firstSent;
  auto receive = [&](uint64_t id) {
    std::vector<uint8_t> d(4096);
    EXPECT_TRUE(gen.recvReady(id, never)) << id;
    gen.conn->recv(kv::DataContext{gen.tags.data(id), never}, d.data(), d.size());
    return check(id, 0, d.data(), d.size()) == SIZE_MAX;
  };
  auto one = std::async(std::launch::async, [&] {
    gen.sendRequestInfo(first);
    firstSent.set_value();
    return receive(first);
  });
  firstSent.get_future().wait();
  auto two = std::async(std::launch::async, [&] {
    gen.sendRequestInfo(second);
    return receive(second);
  });
  EXPECT_TRUE(one.get()) << "request " << first << " did not get its own bytes";
  EXPECT_TRUE(two.get()) << "request " << second << " did not get its own bytes";
  server.get();
}

// Older releases send every ready signal on the fixed tag 42, which names any request. Two
// requests of one generation rank awaiting theirs on one connection (two threads, as with
// several counterparts): each ready signal answers the request taken first, as upstream takes
// and answers them, and both complete with their own bytes. (Before, the first ready send threw
// AmbiguousTagError, which ends upstream's response loop.)
TEST_P(WrapperTest, TwoRequestsAwaitingTheFixedReadyTagAreAnsweredInTheOrderTaken) {
  GenSide gen{toCtx_, Tags{false}};
  expectTwoAwaitingReadyComplete(*ctx_, gen, 21, 22, {21, 22}, never_);
}

// With the newer 23-bit tags, request 2^23's ready tag is 42 (its id bits are all zero), which
// by the older releases' rule names every request. Requests 1 and 2^23 awaiting their ready
// signals on one connection, answered in the other order than taken (upstream answers a request
// when its context phase is done): each signal reaches its own request, and both complete with
// their own bytes. (The first take on the older tag's rule answered request 1 with 2^23's
// signal, and 2^23 waited out its deadline.)
TEST_P(WrapperTest, AReadySignalOnItsOwnTagAnswersItsOwnRequestBesideAnotherAwaitingOne) {
  GenSide gen{toCtx_, Tags{true}};
  constexpr uint64_t kZero = 1ull << 23;
  ASSERT_EQ(gen.tags.ready(kZero), 42);
  expectTwoAwaitingReadyComplete(*ctx_, gen, 1, kZero, {kZero, 1}, never_);
}

// kv_transfer_timeout_ms absent from the config (<= 0): the wrapper still bounds every wait,
// with TRTLLM_KVLINK_TIMEOUT_MS (else 60 s). A context rank that never answers ends the
// generation side's ready wait TimedOut at that deadline, not never; and the event reaches the
// host's logger through the options' log hook, with its request id.
TEST_P(WrapperTest, AbsentTimeoutStillBoundsTheWaitAndLogsThroughTheHook) {
  struct Lines {
    std::mutex mu;
    std::vector<std::string> v;
  } lines;
  setenv("TRTLLM_KVLINK_TIMEOUT_MS", "700", 1);
  KvlinkTrtllmOptions o = options(GetParam());
  o.kv_transfer_timeout_ms = 0;
  o.log = [](void* user, int level, char const* m, size_t n) {
    auto* l = static_cast<Lines*>(user);
    std::lock_guard<std::mutex> g(l->mu);
    l->v.push_back(std::to_string(level) + " " + std::string(m, n));
  };
  o.log_user = &lines;
  o.log_level = 2;
  auto gen = make(*wrapper_, o);
  unsetenv("TRTLLM_KVLINK_TIMEOUT_MS");
  auto conns = gen->getConnections(ctx_->getCommState());
  GenSide side{conns.at(0), Tags{true}};
  constexpr uint64_t kId = 0x5EED0077;
  auto const t0 = Clock::now();
  side.sendRequestInfo(kId);  // the context rank never calls recvConnect
  try {
    side.recvReady(kId, never_);
    FAIL() << "a ready signal arrived from nobody";
  } catch (kvlink::trtllm::TransferError const& e) {
    EXPECT_EQ(e.outcome(), 1) << e.what();  // TimedOut
    EXPECT_EQ(e.request(), kId);
  }
  auto const took = Clock::now() - t0;
  std::printf("ready wait with no answer ended after %.1f ms (timeout 700 ms)\n",
              std::chrono::duration<double, std::milli>(took).count());
  EXPECT_GE(took, 650ms);
  EXPECT_LT(took, 700ms + 1500ms);
  // The hook is called on kvlink's log thread, after the event: give the record time to arrive.
  bool seen = false;
  for (auto until = Clock::now() + 10s; !seen && Clock::now() < until; std::this_thread::sleep_for(10ms)) {
    std::lock_guard<std::mutex> g(lines.mu);
    for (auto const& l : lines.v) seen = seen || l.find("request=" + std::to_string(kId)) != std::string::npos;
  }
  EXPECT_TRUE(seen) << "no log line with the request id reached the hook";
}

// A data recv made once its request's deadline has passed (a generation rank whose ready signal
// came late, as when the context rank took its request late) ends as the transfer it is: a
// TransferError TimedOut naming the request, not a plain UnknownRequest error as if the thread
// had sent no request at all; on the request's thread and on a helper thread alike.
TEST_P(WrapperTest, ARecvMadeAfterItsRequestsDeadlineIsATransferErrorTimedOut) {
  KvlinkTrtllmOptions o = options(GetParam());
  o.kv_transfer_timeout_ms = 300;
  auto gen = make(*wrapper_, o);
  GenSide side{gen->getConnections(ctx_->getCommState()).at(0), Tags{true}};
  constexpr uint64_t kId = 0x1A7E;
  auto server = std::async(std::launch::async, [&] {
    Taken t = recvRequestInfo(*ctx_, never_);
    bool const ready = true;
    t.conn->send(kv::DataContext{side.tags.ready(kId)}, &ready, sizeof ready);  // and no data
  });
  side.sendRequestInfo(kId);
  auto const deadline = Clock::now() + 300ms;  // no earlier than the wrapper's
  EXPECT_TRUE(side.recvReady(kId, never_));
  server.get();
  std::this_thread::sleep_until(deadline + 50ms);
  std::vector<uint8_t> d(4096);
  try {
    side.conn->recv(kv::DataContext{side.tags.data(kId)}, d.data(), d.size());
    FAIL() << "a recv past its request's deadline returned";
  } catch (kvlink::trtllm::TransferError const& e) {
    EXPECT_EQ(e.outcome(), 1) << e.what();  // TimedOut
    EXPECT_EQ(e.request(), kId);
  } catch (std::exception const& e) {
    ADD_FAILURE() << "not a TransferError: " << e.what();
  }
  // The same recv on a helper thread (a formatter that receives on threads of its own): found by
  // review, it was UnknownRequest, the request past its deadline not being looked at there.
  std::async(std::launch::async, [&] {
    try {
      side.conn->recv(kv::DataContext{side.tags.data(kId)}, d.data(), d.size());
      ADD_FAILURE() << "a helper's recv past its request's deadline returned";
    } catch (kvlink::trtllm::TransferError const& e) {
      EXPECT_EQ(e.outcome(), 1) << e.what();  // TimedOut
      EXPECT_EQ(e.request(), kId);
    } catch (std::exception const& e) {
      ADD_FAILURE() << "not a TransferError on a helper thread: " << e.what();
    }
  }).get();
}

// The DataContext's terminate flag ends a blocked recv on both ranks: Cancelled within 50 ms.
TEST_P(WrapperTest, TerminateFlagEndsBothSidesWithin50ms) {
  GenSide gen{toCtx_, Tags{true}};
  constexpr uint64_t kId = 77;
  std::atomic<bool> cancel{false};
  std::atomic<int64_t> ctxEnd{0};
  auto server = std::async(std::launch::async, [&] {
    Taken t = recvRequestInfo(*ctx_, never_);
    bool const ready = true;
    t.conn->send(kv::DataContext{gen.tags.ready(kId)}, &ready, sizeof ready);
    std::vector<uint8_t> s(1 << 20);
    std::atomic<bool> ctxCancel{false};
    try {
      for (int i = 0; i < 1000; ++i) t.conn->send(kv::DataContext{gen.tags.data(kId), ctxCancel}, s.data(), s.size());
      ADD_FAILURE() << "the context side sent everything";
    } catch (kvlink::trtllm::TransferError const& e) {
      ctxEnd = nowNs();
      EXPECT_EQ(e.outcome(), 2) << e.what();  // Cancelled
    }
  });
  gen.sendRequestInfo(kId);
  ASSERT_TRUE(gen.recvReady(kId, never_));
  std::vector<uint8_t> d(1 << 20);
  kv::DataContext const data{gen.tags.data(kId), cancel};
  for (int i = 0; i < 3; ++i) toCtx_->recv(data, d.data(), d.size());
  std::atomic<int64_t> setAt{0};
  std::thread setter([&] {
    std::this_thread::sleep_for(20ms);
    setAt = nowNs();
    cancel = true;
  });
  int64_t genEnd = 0;
  try {
    for (int i = 0; i < 1000; ++i) toCtx_->recv(data, d.data(), d.size());
  } catch (kvlink::trtllm::TransferError const& e) {
    genEnd = nowNs();
    EXPECT_EQ(e.outcome(), 2) << e.what();
  }
  setter.join();
  server.get();
  ASSERT_NE(genEnd, 0);
  ASSERT_NE(ctxEnd.load(), 0);
  double const genMs = (genEnd - setAt.load()) / 1e6, ctxMs = (ctxEnd.load() - setAt.load()) / 1e6;
  std::printf("terminate flag set mid-transfer: generation side out after %.2f ms, context side after %.2f ms\n",
              genMs, ctxMs);
  EXPECT_LE(genMs, 50.0);
  EXPECT_LE(ctxMs, 50.0);
}

// Two requests whose ids are 4096 apart (equal in a 12-bit tag) on one connection: one after the
// other on a thread, both complete with their own bytes; in flight together from two threads,
// the second is refused with AmbiguousTagError and the first still completes with its own bytes.
TEST_P(WrapperTest, IdsEqualMod4096NeverCrossAndAreRefusedWhenInFlightTogether) {
  GenSide gen{toCtx_, Tags{false}};
  constexpr uint64_t kA = 5, kB = 5 + 4096;
  std::atomic<bool> stop{false};
  auto server = std::async(std::launch::async, [&] {
    std::vector<std::future<void>> sends;
    for (;;) {
      Taken t = recvRequestInfo(*ctx_, stop);
      if (t.conn == nullptr) break;
      uint64_t const id = t.info.getRequestId();
      bool const ready = true;
      t.conn->send(kv::DataContext{gen.tags.ready(id)}, &ready, sizeof ready);
      sends.push_back(std::async(std::launch::async, [&gen, t, id] {
        std::vector<uint8_t> s(64 * 1024);
        fill(id, 0, s.data(), s.size());
        t.conn->send(kv::DataContext{gen.tags.data(id)}, s.data(), s.size());
      }));
    }
    for (auto& f : sends) f.get();
  });
  auto receive = [&](uint64_t id) {
    gen.sendRequestInfo(id);
    EXPECT_TRUE(gen.recvReady(id, never_));
    std::vector<uint8_t> d(64 * 1024);
    toCtx_->recv(kv::DataContext{gen.tags.data(id)}, d.data(), d.size());
    return check(id, 0, d.data(), d.size()) == SIZE_MAX;
  };
  // One after the other on one thread.
  EXPECT_TRUE(receive(kA));
  EXPECT_TRUE(receive(kB));
  // In flight together: thread 1 holds request 9 (= 9 + 4096k for none other), thread 2 asks for
  // 9 + 4096 while 9 is still open.
  constexpr uint64_t kC = 9, kD = 9 + 4096;
  std::promise<void> cSent;
  std::promise<void> dTried;
  auto first = std::async(std::launch::async, [&] {
    gen.sendRequestInfo(kC);
    cSent.set_value();
    dTried.get_future().wait();
    EXPECT_TRUE(gen.recvReady(kC, never_));
    std::vector<uint8_t> d(64 * 1024);
    toCtx_->recv(kv::DataContext{gen.tags.data(kC)}, d.data(), d.size());
    return check(kC, 0, d.data(), d.size()) == SIZE_MAX;
  });
  cSent.get_future().wait();
  std::thread second([&] {
    try {
      gen.sendRequestInfo(kD);
      ADD_FAILURE() << "request " << kD << " was let in while " << kC << " is in flight on the connection";
    } catch (kvlink::trtllm::AmbiguousTagError const& e) {
      EXPECT_EQ(e.request(), kD);
      EXPECT_EQ(e.other(), kC);
    }
    dTried.set_value();
  });
  second.join();
  EXPECT_TRUE(first.get()) << "request " << kC << " did not get its own bytes";
  stop = true;
  server.get();
}

// Request `zero`, whose data tag has no id bits (43), and request `zero + 1` in flight together
// on one connection, both answered: each completes with its own bytes.
void expectZeroTagPairCompletes(kv::ConnectionManager& ctx, kv::Connection const* toCtx, Tags tags, uint64_t zero) {
  std::atomic<bool> never{false};
  Watchdog dog(20s);
  GenSide gen{toCtx, tags};
  uint64_t const one = zero + 1;  // low 12 bits 1: a tag of its own
  ASSERT_EQ(gen.tags.data(zero) >> 8, 0) << "the test's id must have no id bits in its data tag";
  auto server = std::async(std::launch::async, [&] {
    std::vector<Taken> taken;
    // Answered one at a time: with the older tags both ready signals go on the fixed tag 42.
    for (int i = 0; i < 2; ++i) {
      Taken t = recvRequestInfo(ctx, dog.flag);
      if (t.conn == nullptr) throw std::runtime_error("no request taken");
      bool const ready = true;
      t.conn->send(kv::DataContext{gen.tags.ready(t.info.getRequestId())}, &ready, sizeof ready);
      taken.push_back(t);
    }
    // Both open and answered: the send for the request without id bits first.
    std::sort(taken.begin(), taken.end(),
              [&](Taken const& a, Taken const& b) { return a.info.getRequestId() == zero && b.info.getRequestId() != zero; });
    for (Taken const& t : taken) {
      uint64_t const id = t.info.getRequestId();
      std::vector<uint8_t> src(64 * 1024);
      fill(id, 0, src.data(), src.size());
      t.conn->send(kv::DataContext{gen.tags.data(id)}, src.data(), src.size());
    }
  });
  std::promise<void> oneSent;
  auto receive = [&](uint64_t id, std::promise<void>* sent, std::shared_future<void> after) {
    if (after.valid()) after.wait();
    try {
      gen.sendRequestInfo(id);
    } catch (...) {
      if (sent != nullptr) sent->set_value();
      throw;
    }
    if (sent != nullptr) sent->set_value();
    if (!gen.recvReady(id, never)) return false;
    std::vector<uint8_t> d(64 * 1024);
    toCtx->recv(kv::DataContext{gen.tags.data(id)}, d.data(), d.size());
    return check(id, 0, d.data(), d.size()) == SIZE_MAX;
  };
  // Request `one` goes out first, so both are in flight together when `zero` is sent.
  std::shared_future<void> first = oneSent.get_future().share();
  auto a = std::async(std::launch::async, receive, one, &oneSent, std::shared_future<void>());
  auto b = std::async(std::launch::async, receive, zero, nullptr, first);
  EXPECT_TRUE(a.get()) << "request " << one << " did not get its own bytes";
  EXPECT_TRUE(b.get()) << "request " << zero << " did not get its own bytes";
  EXPECT_NO_THROW(server.get());
}

// A data tag whose id bits are all zero (43: ids 0 mod 4096 with the older tags, 0 mod 2^23 with
// the newer) names its own request, not every request: request 4096 (and 2^23) in flight beside
// request 4097 (2^23 + 1) on one connection, both answered, both complete with their own bytes.
// Before, tag 43 was taken for the fixed ready tag's wildcard, and the context rank's send for
// 4096 was refused with AmbiguousTagError (one request in 4096 failed wherever two run on a
// connection). One test per tag width: a request's tag bits stay in use on its connection until
// its deadline, and 4096 and 2^23 share theirs.
TEST_P(WrapperTest, ADataTagWithoutIdBitsNamesOnlyItsOwnRequest) {
  expectZeroTagPairCompletes(*ctx_, toCtx_, Tags{false}, 4096);
}
TEST_P(WrapperTest, ADataTagWithoutIdBitsNamesOnlyItsOwnRequestWithTheNewerTags) {
  expectZeroTagPairCompletes(*ctx_, toCtx_, Tags{true}, 0x800000);
}

// A recvConnect whose tag or size does not fit the queued envelope (the host's mistake) is
// InvalidArgument and takes nothing: a recvConnect that fits then gets the same request, which
// runs. Before, the envelope was taken and refused: the generation rank read ready == false for
// a request nobody had turned down.
TEST_P(WrapperTest, ARecvConnectThatDoesNotFitTheEnvelopeTakesNothing) {
  GenSide gen{toCtx_, Tags{true}};
  constexpr uint64_t kId = 4347;
  std::vector<uint8_t> src(4096);
  fill(kId, 0, src.data(), src.size());
  Watchdog dog(10s);
  std::atomic<bool> const& giveUp = dog.flag;
  auto server = std::async(std::launch::async, [&] {
    auto const expectInvalid = [&](int tag, void* p, size_t n) {
      try {
        kv::Connection const* c = ctx_->recvConnect(kv::DataContext{tag, giveUp}, p, n);
        ADD_FAILURE() << "recvConnect of " << n << " bytes on tag " << tag
                      << (c == nullptr ? " found no envelope in 10 s" : " took the envelope");
      } catch (std::exception const& e) {
        EXPECT_NE(std::string(e.what()).find("InvalidArgument"), std::string::npos) << e.what();
      }
    };
    uint32_t small = 0;
    expectInvalid(bm::TransceiverTag::kID_TAG, &small, sizeof small);
    bm::TransceiverTag::Id id{};
    expectInvalid(bm::TransceiverTag::kINFO_SIZE_TAG, &id, sizeof id);
    serveOne(*ctx_, gen, kId, src, giveUp);
  });
  expectServed(gen, kId, never_, "the request");
  EXPECT_NO_THROW(server.get());
}

// An envelope that is not upstream's three parts (the 8-byte id, tag 19; the info's size as 8
// bytes, 22; the info of that size, 32) is the generation rank's mistake: refused as it arrives
// (that rank reads ready == false at once), told to the host's log hook as a warning, and never
// handed to the host: recvConnect gets the next, whole one. Before, the call threw Protocol for
// an envelope without its id, and handed out one with a good id and a bad rest, whose reads
// then threw in the host; upstream's context side ends its response loop for good on an
// exception, so one peer's bad envelope stopped the rank serving every request after it.
TEST_P(WrapperTest, AMalformedEnvelopeIsRefusedAndTheCallGoesOnToTheNext) {
  struct Seen {
    std::mutex mu;
    std::vector<std::string> warnings;
  } seen;  // declared before the manager whose hook it is, destroyed after it
  KvlinkTrtllmOptions o = options(GetParam());
  o.log = [](void* user, int level, char const* line, size_t n) {
    auto* s = static_cast<Seen*>(user);
    std::lock_guard<std::mutex> g(s->mu);
    if (level == 2) s->warnings.emplace_back(line, n);
  };
  o.log_user = &seen;
  o.log_level = 2;
  auto ctx = make(*wrapper_, o);
  auto conns = gen_->getConnections(ctx->getCommState());
  ASSERT_EQ(conns.size(), 1u);
  kv::Connection const* toCtx = conns.at(0);
  GenSide gen{toCtx, Tags{true}};
  constexpr uint64_t kId = 4353;
  auto const rid = bm::TransceiverTag::Id::REQUEST_SEND;
  uint32_t const shortSize = 16;
  uint64_t const sixteen = 16, seventeen = 17;
  // Each from a thread of its own (a generation thread's next request would wait for its last),
  // each with an info that starts with a request id of its own.
  struct Part {
    int tag;
    void const* data;
    size_t size;
  };
  std::vector<std::vector<Part>> const bad = {
      {{bm::TransceiverTag::kINFO_SIZE_TAG, &sixteen, 8}},                     // no id
      {{bm::TransceiverTag::kID_TAG, &rid, sizeof rid}},                          // no info size
      {{bm::TransceiverTag::kID_TAG, &rid, sizeof rid}, {bm::TransceiverTag::kINFO_SIZE_TAG, &shortSize, 4}},
      {{bm::TransceiverTag::kID_TAG, &rid, sizeof rid}, {bm::TransceiverTag::kINFO_SIZE_TAG, &seventeen, 8}},
  };
  auto const started = Clock::now();
  for (size_t i = 0; i < bad.size(); ++i) {
    std::thread([&, i] {
      uint64_t const info[2] = {kId + 1 + i, 0};
      try {
        for (Part const& p : bad[i]) toCtx->send(kv::DataContext{p.tag}, p.data, p.size);
        toCtx->send(kv::DataContext{bm::TransceiverTag::kINFO_TAG}, info, sizeof info);
        EXPECT_FALSE(gen.recvReady(kId + 1 + i, never_)) << "malformed envelope " << i << " was served";
      } catch (std::exception const& e) {
        ADD_FAILURE() << "malformed envelope " << i << ": " << e.what();
      }
    }).join();
  }
  EXPECT_LT(Clock::now() - started, 5s) << "a malformed envelope was refused only at its deadline";
  std::vector<uint8_t> src(4096);
  fill(kId, 0, src.data(), src.size());
  Watchdog dog(10s);
  std::atomic<bool> const& giveUp = dog.flag;
  auto server = std::async(std::launch::async, [&] { serveOne(*ctx, gen, kId, src, giveUp); });
  expectServed(gen, kId, never_, "the request behind the malformed ones");
  EXPECT_NO_THROW(server.get());
  std::lock_guard<std::mutex> g(seen.mu);
  auto const told = std::count_if(seen.warnings.begin(), seen.warnings.end(), [](std::string const& w) {
    return w.find("is malformed") != std::string::npos;
  });
  // At most one a second (the four most likely within one).
  auto const seconds = std::chrono::duration_cast<std::chrono::seconds>(Clock::now() - started).count();
  EXPECT_GE(told, 1) << seen.warnings.size() << " warnings";
  EXPECT_LE(told, 1 + seconds) << seen.warnings.size() << " warnings";
}

// A data send of another size than the buffer the generation rank advertised (a layout
// mismatch, which upstream never retries) is InvalidArgument on the context rank, and the
// generation rank's recv ends at once, refused, not at its deadline.
TEST_P(WrapperTest, ADataSendOfTheWrongSizeEndsTheRequestOnBothRanksAtOnce) {
  GenSide gen{toCtx_, Tags{true}};
  constexpr uint64_t kId = 4361;
  std::vector<uint8_t> src(4096), dst(4096, 0);
  Watchdog dog(10s);
  std::atomic<bool> const& giveUp = dog.flag;
  auto server = std::async(std::launch::async, [&] {
    kv::Connection const* conn = takeReady(*ctx_, gen, kId, giveUp);
    try {
      conn->send(kv::DataContext{gen.tags.data(kId), giveUp}, src.data(), src.size() - 1);
      ADD_FAILURE() << "a send of the wrong size went through";
    } catch (std::exception const& e) {
      EXPECT_NE(std::string(e.what()).find("InvalidArgument"), std::string::npos) << e.what();
    }
  });
  gen.sendRequestInfo(kId);
  ASSERT_TRUE(gen.recvReady(kId, never_));
  auto const started = Clock::now();
  EXPECT_THROW(toCtx_->recv(kv::DataContext{gen.tags.data(kId), never_}, dst.data(), dst.size()), std::exception);
  EXPECT_LT(Clock::now() - started, 3s) << "the generation rank's recv waited for its deadline (5 s)";
  EXPECT_NO_THROW(server.get());
}


// A send of the envelope's id that went through, then a send of its info size that failed (from
// null): the thread's next request goes out as an envelope of its own, not behind the id left
// over. Before, that envelope went [19, 19, 22, 32]: the context rank's recv of 22 found 19, and
// the request was never answered (its generation rank waited out its deadline).
TEST_P(WrapperTest, AnEnvelopeLeftHalfBuiltByAFailedSendIsNotSentWithTheNext) {
  GenSide gen{toCtx_, Tags{true}};
  constexpr uint64_t kId = 4349;
  auto const rid = bm::TransceiverTag::Id::REQUEST_SEND;
  toCtx_->send(kv::DataContext{bm::TransceiverTag::kID_TAG}, &rid, sizeof rid);
  EXPECT_THROW(toCtx_->send(kv::DataContext{bm::TransceiverTag::kINFO_SIZE_TAG}, nullptr, 8), std::exception);
  std::vector<uint8_t> src(4096), dst(4096, 0);
  fill(kId, 0, src.data(), src.size());
  auto server = std::async(std::launch::async, [&] {
    serveOne(*ctx_, gen, kId, src, never_);
  });
  gen.sendRequestInfo(kId);
  EXPECT_TRUE(gen.recvReady(kId, never_));
  toCtx_->recv(kv::DataContext{gen.tags.data(kId), never_}, dst.data(), dst.size());
  EXPECT_NO_THROW(server.get());
  EXPECT_EQ(check(kId, 0, dst.data(), dst.size()), SIZE_MAX);
}

// Two threads that send requests 4096 apart AT THE SAME TIME: one of the two must be refused.
// Before, the check against the other threads' requests and the recording of this thread's own
// were two critical sections with the previous request's settle and the advertisement between
// them, so both threads passed the check and both requests went out with the same data tags.
TEST_P(WrapperTest, IdsEqualMod4096SentTogetherFromTwoThreadsAreNeverBothLetIn) {
  GenSide gen{toCtx_, Tags{false}};
  constexpr int kRounds = 20;
  std::atomic<int> bothIn{0};
  for (int round = 0; round < kRounds; ++round) {
    // Each thread first holds a request of its own (nothing answers it), so that the next send
    // settles one, as a request thread of TensorRT-LLM does from its second request on.
    uint64_t const a = 1000 + 4 * static_cast<uint64_t>(round), b = a + 4096;
    std::promise<void> go;
    std::shared_future<void> start = go.get_future().share();
    auto sendOne = [&](uint64_t warm, uint64_t id) {
      gen.sendRequestInfo(warm);
      start.wait();
      try {
        gen.sendRequestInfo(id);
        return true;
      } catch (kvlink::trtllm::AmbiguousTagError const&) {
        return false;
      }
    };
    auto fa = std::async(std::launch::async, sendOne, a + 1, a);
    auto fb = std::async(std::launch::async, sendOne, a + 2, b);
    std::this_thread::sleep_for(5ms);
    go.set_value();
    bool const inA = fa.get(), inB = fb.get();
    EXPECT_FALSE(inA && inB) << "round " << round << ": requests " << a << " and " << b
                             << " were both let in, in flight together on one connection";
    if (inA && inB) ++bothIn;
    if (bothIn.load() > 0) break;
  }
}

// The context manager destroyed while one of its connections' sends waits for the buffer the
// generation rank has not advertised yet (TensorRT-LLM tearing a CacheTransceiver down with a
// transfer open). Before, the destructor returned at once and freed the connection, its mutex
// and the engine under the waiting send, which went on using them until its deadline. Now the
// send ends Cancelled and the destructor returns only once it has left.
TEST_P(WrapperTest, TheManagerGoesOnlyAfterASendBlockedInItHasLeft) {
  GenSide gen{toCtx_, Tags{true}};
  constexpr uint64_t kId = 31;
  std::promise<void> sending;
  auto server = std::async(std::launch::async, [&] {
    Taken t = recvRequestInfo(*ctx_, never_);
    if (t.conn == nullptr) throw std::runtime_error("no request taken");
    bool const ready = true;
    t.conn->send(kv::DataContext{gen.tags.ready(kId)}, &ready, sizeof ready);
    std::vector<uint8_t> s(4096);
    sending.set_value();
    try {
      t.conn->send(kv::DataContext{gen.tags.data(kId), never_}, s.data(), s.size());
      return std::string("sent into a buffer never advertised");
    } catch (kvlink::trtllm::TransferError const& e) {
      return std::string(e.outcome() == 2 ? "" : "ended ") + (e.outcome() == 2 ? "" : e.what());
    } catch (std::exception const& e) {
      return std::string("threw ") + e.what();
    }
  });
  gen.sendRequestInfo(kId);
  ASSERT_TRUE(gen.recvReady(kId, never_));
  sending.get_future().wait();
  std::this_thread::sleep_for(100ms);  // inside the send's wait for an advertisement
  auto const t0 = std::chrono::steady_clock::now();
  ctx_.reset();
  auto const ms = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0).count();
  // The send has left the connection when the destructor returns; its thread still unwinds to
  // the catch above and returns (microseconds, but a loaded machine can run this line first:
  // seen once in CI). A send still blocked would stay so until its 5 s deadline.
  ASSERT_EQ(server.wait_for(500ms), std::future_status::ready)
      << "the manager was destroyed while a send was still blocked inside one of its connections";
  EXPECT_EQ(server.get(), "");
  EXPECT_LT(ms, 1000) << "the destructor waited for the send's deadline instead of ending it";
}

// A context rank whose send is terminated while it waits for the generation rank's buffer ends
// the request on both ranks: the generation rank's recv of that buffer ends at once with the
// request's failure, not at its deadline. Before, the send threw Cancelled and left the request
// open; the buffer advertised next was queued on the context rank with nobody to take or refuse
// it, and the generation rank waited out the whole deadline to end TimedOut.
TEST_P(WrapperTest, ASendTerminatedBeforeItsBufferCameEndsTheRecvOfIt) {
  GenSide gen{toCtx_, Tags{true}};
  constexpr uint64_t kId = 0x7E58;
  std::promise<void> terminated;
  auto server = std::async(std::launch::async, [&] {
    Taken t = recvRequestInfo(*ctx_, never_);
    if (t.conn == nullptr) throw std::runtime_error("no request taken");
    bool const ready = true;
    t.conn->send(kv::DataContext{gen.tags.ready(kId)}, &ready, sizeof ready);
    std::atomic<bool> const stop{true};  // TensorRT-LLM gave the request up
    std::vector<uint8_t> s(4096);
    int outcome = -1;
    try {
      t.conn->send(kv::DataContext{gen.tags.data(kId), stop}, s.data(), s.size());
    } catch (kvlink::trtllm::TransferError const& e) {
      outcome = e.outcome();
    }
    terminated.set_value();
    return outcome;
  });
  gen.sendRequestInfo(kId);
  ASSERT_TRUE(gen.recvReady(kId, never_));
  terminated.get_future().wait();
  EXPECT_EQ(server.get(), 2) << "the terminated send did not end Cancelled";
  std::vector<uint8_t> d(4096);
  auto const t0 = Clock::now();
  int outcome = -1;
  try {
    toCtx_->recv(kv::DataContext{gen.tags.data(kId), never_}, d.data(), d.size());
  } catch (kvlink::trtllm::TransferError const& e) {
    outcome = e.outcome();
  }
  auto const ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count();
  std::printf("the recv of the given-up request ended %d after %lld ms (deadline 5000 ms)\n", outcome,
              static_cast<long long>(ms));
  EXPECT_NE(outcome, -1) << "the recv completed from a request the context rank gave up";
  EXPECT_NE(outcome, 1) << "the recv waited out its deadline (" << ms << " ms)";
}

/// The same, with the test build of the wrapper (helpers/wrapper_probe.cpp): what the wrapper and
/// the engine hold behind a manager, which TensorRT-LLM's interface does not show.
class WrapperStateTest : public WrapperTest {
 protected:
  char const* library() const override { return KVLINK_WRAPPER_PROBE_PATH; }
  KvlinkProbeWrapperState state(kv::ConnectionManager& m) {
    auto const fn = reinterpret_cast<KvlinkProbeWrapperStateFn>(dlsym(wrapper_->handle, KVLINK_PROBE_WRAPPER_STATE_SYMBOL));
    KvlinkProbeWrapperState out{};
    if (fn == nullptr || fn(&m, &out) != 0) ADD_FAILURE() << "no wrapper state probe for this manager";
    return out;
  }
  /// A context and a generation manager whose requests last 500 ms (short deadlines keep the
  /// tests that wait them out short), and the generation's connection to the context.
  struct ShortPair {
    std::unique_ptr<kv::ConnectionManager> ctx, gen;
    kv::Connection const* conn;
  };
  ShortPair shortPair() {
    KvlinkTrtllmOptions o = options(GetParam());
    o.kv_transfer_timeout_ms = 500;
    ShortPair p{make(*wrapper_, o), make(*wrapper_, o), nullptr};
    p.conn = p.gen->getConnections(p.ctx->getCommState()).at(0);
    return p;
  }
  KvlinkProbeHealth health(kv::ConnectionManager& m) {
    auto const fn = reinterpret_cast<KvlinkProbeHealthFn>(dlsym(wrapper_->handle, KVLINK_PROBE_HEALTH_SYMBOL));
    KvlinkProbeHealth out{};
    if (fn == nullptr || fn(&m, &out) != 0) ADD_FAILURE() << "no health probe for this manager";
    return out;
  }
};

// Advertisements a peer that does not run the wrapper (or a hostile one) can make, from a raw
// engine beside the generation manager: an envelope whose info names another request than its
// advertisement (upstream makes the ready tag from the info's id, so the context rank's ready
// signal would name no request), one whose info is too short to hold an id, and a buffer
// advertisement that carries messages (queued, each could keep a megabyte of info until a
// deadline the peer chose). Each is refused at once (Rejected, not at its 3 s deadline), told to
// the hook, never handed to the host, and the context rank then serves a request as usual.
TEST_P(WrapperStateTest, AnEnvelopeNamingAnotherRequestOrABufferWithMessagesIsRefusedAtOnce) {
  namespace wire = kvlink::trtllm::wire;
  struct Seen {
    std::mutex mu;
    std::vector<std::string> warnings;
  } seen;  // declared before the manager whose hook it is, destroyed after it
  KvlinkTrtllmOptions o = options(GetParam());
  o.log = [](void* user, int level, char const* line, size_t n) {
    auto* s = static_cast<Seen*>(user);
    std::lock_guard<std::mutex> g(s->mu);
    if (level == 2) s->warnings.emplace_back(line, n);
  };
  o.log_user = &seen;
  o.log_level = 2;
  auto ctx = make(*wrapper_, o);
  auto conns = gen_->getConnections(ctx->getCommState());
  ASSERT_EQ(conns.size(), 1u);
  GenSide gen{conns.at(0), Tags{true}};
  auto const raw = reinterpret_cast<KvlinkProbeAdvertiseRawFn>(dlsym(wrapper_->handle, KVLINK_PROBE_ADVERTISE_RAW_SYMBOL));
  ASSERT_NE(raw, nullptr);
  std::string const address = ctx->getCommState().getAgentState().at(0).mConnectionInfo;
  auto bytesOf = [](uint64_t v, size_t n) {
    std::vector<uint8_t> b(n, 0);
    std::memcpy(b.data(), &v, std::min(n, sizeof v));
    return b;
  };
  auto envelope = [&](uint64_t infoId, size_t infoBytes) {
    wire::Header h;
    h.kind = wire::Kind::Envelope;
    auto const rid = static_cast<uint64_t>(bm::TransceiverTag::Id::REQUEST_SEND);
    h.messages = {wire::Message{bm::TransceiverTag::kID_TAG, bytesOf(rid, 8)},
                  wire::Message{bm::TransceiverTag::kINFO_SIZE_TAG, bytesOf(infoBytes, 8)},
                  wire::Message{bm::TransceiverTag::kINFO_TAG, bytesOf(infoId, infoBytes)}};
    return wire::encode(h);
  };
  wire::Header data;
  data.kind = wire::Kind::Data;
  data.tag = Tags{true}.data(0x5A3);
  data.messages = {wire::Message{bm::TransceiverTag::kINFO_TAG, std::vector<uint8_t>(64 * 1024, 7)}};
  struct Case {
    char const* what;
    uint64_t request;
    std::vector<uint8_t> info;
  };
  std::vector<Case> const cases = {
      {"an envelope whose info names another request", 0x5A1, envelope(0x5A2, 16)},
      {"an envelope whose info is shorter than an id", 0x5A2, envelope(0x5A2, 4)},
      {"a buffer advertisement with a message", 0x5A3, wire::encode(data)},
  };
  for (Case const& c : cases) {
    auto const t0 = Clock::now();
    int const outcome = raw(gen_.get(), address.c_str(), c.request, c.info.data(), c.info.size(), 3000);
    auto const ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count();
    std::printf("%s: outcome %d after %lld ms\n", c.what, outcome, static_cast<long long>(ms));
    EXPECT_EQ(outcome, 4) << c.what << ": not Rejected";  // kvlink::Outcome::Rejected
    EXPECT_LT(ms, 1500) << c.what << ": refused only at its deadline";
  }
  KvlinkProbeWrapperState const held = state(*ctx);
  EXPECT_EQ(held.envelopes_queued, 0u);
  EXPECT_EQ(held.buffers_queued, 0u);
  // And the host's next recvConnect takes the next request, not one of those.
  constexpr uint64_t kId = 0x5A4;
  std::vector<uint8_t> src(4096);
  fill(kId, 0, src.data(), src.size());
  Watchdog dog(10s);
  std::atomic<bool> const& giveUp = dog.flag;
  auto server = std::async(std::launch::async, [&] { serveOne(*ctx, gen, kId, src, giveUp); });
  expectServed(gen, kId, never_, "the request after the refused ones");
  EXPECT_NO_THROW(server.get());
  std::lock_guard<std::mutex> g(seen.mu);
  EXPECT_GE(seen.warnings.size(), 1u) << "no refusal was told to the hook";
}

// Two blocks of one request under one data tag, of two sizes, received on two threads (a
// formatter's helpers; the large one advertised first) and sent small first: each send fills
// the buffer of its own size, in even rounds once both buffers are advertised, in odd ones with
// the small buffer advertised 20 ms after the small send began (within kOtherSizeGrace).
// Before, a send took the first buffer of its tag, the other block's here, and both ranks
// failed the request on the size.
TEST_P(WrapperStateTest, TwoBlocksOfOneTagAndTwoSizesEachFillTheirOwnBuffer) {
  GenSide gen{toCtx_, Tags{true}};
  for (uint64_t round = 0; round < 4; ++round) {
    uint64_t const id = 4371 + round;
    std::vector<uint8_t> small(4096), large(8192), smallDst(4096, 0), largeDst(8192, 0);
    fill(id, 0, small.data(), small.size());
    fill(id, 1, large.data(), large.size());
    Watchdog dog(10s);
    std::atomic<bool> const& giveUp = dog.flag;
    auto server = std::async(std::launch::async, [&] {
      kv::Connection const* conn = takeReady(*ctx_, gen, id, giveUp);
      std::size_t const queued = round % 2 == 0 ? 2 : 1;
      while (state(*ctx_).buffers_queued < queued && !giveUp) std::this_thread::sleep_for(1ms);
      conn->send(kv::DataContext{gen.tags.data(id), giveUp}, small.data(), small.size());
      conn->send(kv::DataContext{gen.tags.data(id), giveUp}, large.data(), large.size());
    });
    gen.sendRequestInfo(id);
    ASSERT_TRUE(gen.recvReady(id, never_));
    // The large buffer advertised first: the send of the small block, made first, finds it
    // at the front of its tag.
    auto helper = std::async(std::launch::async, [&] {
      toCtx_->recv(kv::DataContext{gen.tags.data(id), never_}, largeDst.data(), largeDst.size());
    });
    while (state(*ctx_).buffers_queued < 1 && !giveUp) std::this_thread::sleep_for(1ms);
    if (round % 2 == 1) std::this_thread::sleep_for(20ms);  // the small send is already looking
    try {
      toCtx_->recv(kv::DataContext{gen.tags.data(id), never_}, smallDst.data(), smallDst.size());
    } catch (std::exception const& e) {
      ADD_FAILURE() << "round " << round << ", the small block: " << e.what();
    }
    try {
      helper.get();
    } catch (std::exception const& e) {
      ADD_FAILURE() << "round " << round << ", the large block: " << e.what();
    }
    try {
      server.get();
    } catch (std::exception const& e) {
      ADD_FAILURE() << "round " << round << ", the context side: " << e.what();
    }
    EXPECT_EQ(check(id, 0, smallDst.data(), smallDst.size()), SIZE_MAX) << "round " << round;
    EXPECT_EQ(check(id, 1, largeDst.data(), largeDst.size()), SIZE_MAX) << "round " << round;
  }
}

// A host that runs each request on a thread of its own (upstream's CacheReceiver once ran each
// request in a std::async; a thread pool made anew does the same): what the connection keeps per
// thread goes with the thread, on both ranks: a finished request, a refused one whose envelope
// was not read to its end, an envelope begun and never finished, and a request abandoned before
// its ready signal, whose posted ready byte is given back too. Before, all of it was kept for
// good, keyed by the ids of threads long gone, which the C library hands to new threads: a new
// thread with a dead one's id took over its request.
TEST_P(WrapperStateTest, PerThreadStateGoesWithItsThread) {
  GenSide gen{toCtx_, Tags{true}};
  constexpr uint64_t kFirst = 0x1000;
  constexpr int kRequests = 8;
  uint64_t const refused = kFirst + kRequests;  // the last: its state is not overwritten by another's
  auto server = std::async(std::launch::async, [&] {
    for (uint64_t id = kFirst; id <= refused; ++id) {
      std::thread([&, id] {
        bm::TransceiverTag::Id tag{};
        kv::Connection const* conn = ctx_->recvConnect(kv::DataContext{bm::TransceiverTag::kID_TAG, never_}, &tag, sizeof tag);
        if (conn == nullptr) return ADD_FAILURE() << "request " << id << " not taken";
        if (id == refused) {  // refused at once: the rest of its envelope is never read
          bool const no = false;
          return conn->send(kv::DataContext{gen.tags.ready(id)}, &no, sizeof no);
        }
        uint64_t size = 0;
        conn->recv(kv::DataContext{bm::TransceiverTag::kINFO_SIZE_TAG, never_}, &size, sizeof size);
        std::string info(size, '\0');
        conn->recv(kv::DataContext{bm::TransceiverTag::kINFO_TAG, never_}, info.data(), size);
        bool const yes = true;
        conn->send(kv::DataContext{gen.tags.ready(id)}, &yes, sizeof yes);
        std::vector<uint8_t> s(4096);
        fill(id, 0, s.data(), s.size());
        conn->send(kv::DataContext{gen.tags.data(id)}, s.data(), s.size());
      }).join();
    }
  });
  for (uint64_t id = kFirst; id <= refused; ++id) {
    std::thread([&, id] {
      gen.sendRequestInfo(id);
      bool const ready = gen.recvReady(id, never_);
      EXPECT_EQ(ready, id != refused) << id;
      if (!ready) return;
      std::vector<uint8_t> d(4096);
      toCtx_->recv(kv::DataContext{gen.tags.data(id)}, d.data(), d.size());
      EXPECT_EQ(check(id, 0, d.data(), d.size()), SIZE_MAX) << id;
    }).join();
  }
  server.get();
  std::thread([&] {  // an envelope begun, and the thread gone before its last part
    auto const rid = bm::TransceiverTag::Id::REQUEST_SEND;
    toCtx_->send(kv::DataContext{bm::TransceiverTag::kID_TAG}, &rid, sizeof rid);
  }).join();
  std::thread([&] { gen.sendRequestInfo(refused + 1); }).join();  // abandoned before its ready signal
  EXPECT_EQ(state(*ctx_).thread_states, 0u) << "the context rank kept state of threads that are gone";
  // The abandoned request is settled by the generation rank's dispatcher: within a round of it
  // (200 ms) and the cancel's agreement, well inside the request's own deadline.
  auto const until = Clock::now() + 5s;
  while ((state(*gen_).thread_states != 0 || health(*gen_).buffers_leased != 0) && Clock::now() < until) {
    std::this_thread::sleep_for(5ms);
  }
  EXPECT_EQ(state(*gen_).thread_states, 0u) << "the generation rank kept state of threads that are gone";
  EXPECT_EQ(health(*gen_).buffers_leased, 0u) << "an abandoned request's ready byte is still posted";
}

// recvConnect whose terminate flag is already set returns nullptr (TensorRT-LLM's contract,
// docs/TENSORRT_LLM.md) and takes nothing: an envelope already queued stays for the next
// recvConnect, and its request runs. Before, a queued envelope was taken first and handed to a
// caller that had given up; the request was then never answered.
TEST_P(WrapperStateTest, RecvConnectWithItsTerminateFlagSetLeavesAQueuedEnvelope) {
  GenSide gen{toCtx_, Tags{true}};
  constexpr uint64_t kId = 0x7E57;
  gen.sendRequestInfo(kId);
  auto const until = Clock::now() + 5s;  // the request's deadline
  while (state(*ctx_).envelopes_queued == 0 && Clock::now() < until) std::this_thread::sleep_for(1ms);
  ASSERT_EQ(state(*ctx_).envelopes_queued, 1u) << "the envelope never reached the context rank's queue";
  std::atomic<bool> const terminated{true};
  bm::TransceiverTag::Id tag{};
  ASSERT_EQ(ctx_->recvConnect(kv::DataContext{bm::TransceiverTag::kID_TAG, terminated}, &tag, sizeof tag), nullptr)
      << "a recvConnect with its terminate flag set took the queued envelope";
  EXPECT_EQ(state(*ctx_).envelopes_queued, 1u);
  std::vector<uint8_t> src(4096), dst(4096, 0);
  fill(kId, 0, src.data(), src.size());
  auto server = std::async(std::launch::async, [&] {
    serveOne(*ctx_, gen, kId, src, never_);
  });
  EXPECT_TRUE(gen.recvReady(kId, never_));
  toCtx_->recv(kv::DataContext{gen.tags.data(kId)}, dst.data(), dst.size());
  server.get();
  EXPECT_EQ(check(kId, 0, dst.data(), dst.size()), SIZE_MAX);
}

// The context manager destroyed with one request taken by recvConnect and never answered, and
// another queued that no recvConnect took: each generation rank's wait for its ready signal ends
// then, with the request refused, not at its deadline. Before, over shared memory (whose
// endpoints do not fail when the peer's engine goes), both waited out the whole deadline; over
// tcp the closed endpoint ended them PeerLost.
TEST_P(WrapperStateTest, AManagerDestroyedWithRequestsUnansweredRefusesThem) {
  GenSide gen{toCtx_, Tags{true}};
  constexpr uint64_t kTaken = 0x7E5A, kQueued = 0x7E5B;
  std::promise<void> destroyed;
  std::shared_future<void> gone = destroyed.get_future().share();
  std::promise<void> takenSent;
  auto const ask = [&](uint64_t id, std::promise<void>* sent) {
    gen.sendRequestInfo(id);
    if (sent != nullptr) sent->set_value();
    gone.wait();
    auto const t0 = Clock::now();
    int outcome = -1;
    try {
      outcome = gen.recvReady(id, never_) ? 0 : 4;
    } catch (kvlink::trtllm::TransferError const& e) {
      outcome = e.outcome();
    }
    std::printf("request %llx: ready wait ended %d after %lld ms (deadline 5000 ms)\n",
                static_cast<unsigned long long>(id), outcome,
                static_cast<long long>(std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count()));
    return outcome;
  };
  auto taken = std::async(std::launch::async, ask, kTaken, &takenSent);
  takenSent.get_future().wait();
  Taken t = recvRequestInfo(*ctx_, never_);
  ASSERT_NE(t.conn, nullptr);
  EXPECT_EQ(t.info.getRequestId(), kTaken);
  auto queued = std::async(std::launch::async, ask, kQueued, nullptr);
  auto const until = Clock::now() + 5s;  // the request's deadline
  while (state(*ctx_).envelopes_queued == 0 && Clock::now() < until) std::this_thread::sleep_for(1ms);
  EXPECT_EQ(state(*ctx_).envelopes_queued, 1u) << "the second envelope never reached the context rank's queue";
  ctx_.reset();
  destroyed.set_value();
  int const takenEnd = taken.get(), queuedEnd = queued.get();
  EXPECT_NE(takenEnd, 1) << "the taken request's ready wait ran to its deadline";
  EXPECT_NE(queuedEnd, 1) << "the queued request's ready wait ran to its deadline";
  EXPECT_NE(takenEnd, 0);
  EXPECT_NE(queuedEnd, 0);
}

// The context manager destroyed with a buffer advertisement queued that no send has taken yet
// (the context host answered ready and had not sent): the generation rank's recv of that buffer
// ends then, refused, not at its deadline. Before, the connection's destructor refused only the
// requests never answered; over shared memory (whose endpoints do not fail when the peer's
// engine goes) the recv waited out the whole deadline.
TEST_P(WrapperStateTest, AManagerDestroyedWithABufferQueuedRefusesIt) {
  GenSide gen{toCtx_, Tags{true}};
  constexpr uint64_t kId = 0x7E5F;
  auto server = std::async(std::launch::async, [&] {
    Taken t = recvRequestInfo(*ctx_, never_);
    if (t.conn == nullptr) throw std::runtime_error("no request taken");
    bool const ready = true;
    t.conn->send(kv::DataContext{gen.tags.ready(kId)}, &ready, sizeof ready);  // no send yet
  });
  gen.sendRequestInfo(kId);
  ASSERT_TRUE(gen.recvReady(kId, never_));
  server.get();
  auto recv = std::async(std::launch::async, [&] {
    std::vector<uint8_t> d(4096);
    auto const t0 = Clock::now();
    int outcome = -1;
    try {
      toCtx_->recv(kv::DataContext{gen.tags.data(kId), never_}, d.data(), d.size());
    } catch (kvlink::trtllm::TransferError const& e) {
      outcome = e.outcome();
    }
    std::printf("the recv of the queued buffer ended %d after %lld ms (deadline 5000 ms)\n", outcome,
                static_cast<long long>(std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count()));
    return outcome;
  });
  auto const until = Clock::now() + 5s;  // the request's deadline
  while (state(*ctx_).buffers_queued == 0 && Clock::now() < until) std::this_thread::sleep_for(1ms);
  ASSERT_EQ(state(*ctx_).buffers_queued, 1u) << "the buffer advertisement never reached the context rank's queue";
  ctx_.reset();
  int const outcome = recv.get();
  EXPECT_NE(outcome, -1) << "a recv completed that no send filled";
  EXPECT_NE(outcome, 1) << "the recv of the queued buffer ran to its deadline";
}

// A buffer the generation rank advertised that no send of the context rank ever takes (the
// context host answered ready, then never sent, and its generation thread sends no next request
// to close it) is forgotten on the context rank once its request's deadline has passed, not
// kept for good. Short deadlines (500 ms) keep the test short.
TEST_P(WrapperStateTest, ABufferNoSendTookIsForgottenAfterItsDeadline) {
  ShortPair pair = shortPair();  // named members, not a structured binding: lambdas capture them
  auto& ctx = pair.ctx;
  kv::Connection const* conn = pair.conn;
  GenSide gen{conn, Tags{true}};
  constexpr uint64_t kId = 0x7E5C;
  auto server = std::async(std::launch::async, [&] {
    Taken t = recvRequestInfo(*ctx, never_);
    if (t.conn == nullptr) throw std::runtime_error("no request taken");
    bool const ready = true;
    t.conn->send(kv::DataContext{gen.tags.ready(kId)}, &ready, sizeof ready);  // and no send
  });
  gen.sendRequestInfo(kId);
  ASSERT_TRUE(gen.recvReady(kId, never_));
  server.get();
  std::vector<uint8_t> d(4096);
  try {
    conn->recv(kv::DataContext{gen.tags.data(kId), never_}, d.data(), d.size());
    ADD_FAILURE() << "a recv completed that no send filled";
  } catch (kvlink::trtllm::TransferError const& e) {
    EXPECT_EQ(e.outcome(), 1) << e.what();  // TimedOut
  }
  // Its deadline has passed; the grace after it (agreement bound 200 ms + 1 s) and a dispatcher
  // round (200 ms), with a margin, bound when it goes.
  auto const until = Clock::now() + 3s;
  while (state(*ctx).buffers_queued != 0 && Clock::now() < until) std::this_thread::sleep_for(10ms);
  EXPECT_EQ(state(*ctx).buffers_queued, 0u) << "a buffer advertisement past its deadline was kept";
}

// An envelope no recvConnect took by its request's deadline (the context host fell behind) is
// refused and dropped: the next recvConnect gets the live request behind it, not the dead one.
// Before, envelopes stayed queued for good (past the engine's own bound on queued
// advertisements) and were handed out oldest first. Short deadlines (500 ms) keep it short.
TEST_P(WrapperStateTest, AnEnvelopeNoRecvConnectTookIsDroppedAfterItsDeadline) {
  // The old request from a generation manager whose requests last 500 ms, the live one from
  // the fixture's (5 s), both to one context manager: only the old one can expire here.
  ShortPair pair = shortPair();  // named members, not a structured binding: lambdas capture them
  auto& ctx = pair.ctx;
  kv::Connection const* conn = pair.conn;
  kv::Connection const* live = gen_->getConnections(ctx->getCommState()).at(0);
  GenSide gen{conn, Tags{true}}, liveGen{live, Tags{true}};
  constexpr uint64_t kOld = 0x7E61, kNew = 0x7E62;
  gen.sendRequestInfo(kOld);
  auto const queued = Clock::now() + 2s;
  while (state(*ctx).envelopes_queued == 0 && Clock::now() < queued) std::this_thread::sleep_for(1ms);
  ASSERT_EQ(state(*ctx).envelopes_queued, 1u) << "the envelope never reached the context rank's queue";
  try {
    EXPECT_FALSE(gen.recvReady(kOld, never_)) << "a request nobody took was answered ready";
  } catch (kvlink::trtllm::TransferError const&) {
    // Its deadline: TimedOut (or refused first).
  }
  // Its deadline has passed; a dispatcher round (200 ms) with a margin bounds when it goes.
  auto const until = Clock::now() + 2s;
  while (state(*ctx).envelopes_queued != 0 && Clock::now() < until) std::this_thread::sleep_for(10ms);
  EXPECT_EQ(state(*ctx).envelopes_queued, 0u) << "an envelope past its deadline was kept";
  std::vector<uint8_t> src(4096), dst(4096, 0);
  fill(kNew, 0, src.data(), src.size());
  Watchdog dog(10s);
  auto server = std::async(std::launch::async, [&] {
    serveOne(*ctx, liveGen, kNew, src, dog.flag);  // the live request, not the one past its deadline
  });
  liveGen.sendRequestInfo(kNew);
  EXPECT_TRUE(liveGen.recvReady(kNew, never_));
  live->recv(kv::DataContext{liveGen.tags.data(kNew), never_}, dst.data(), dst.size());
  EXPECT_NO_THROW(server.get());
  EXPECT_EQ(check(kNew, 0, dst.data(), dst.size()), SIZE_MAX);
}

// Requests the context rank took (one completed, one refused) are forgotten once their deadline
// and its grace have passed, whether or not new work comes: no next envelope arrives here.
// Before, only the next envelope's arrival swept them out, so a context rank that got no more
// requests kept them for good. Short deadlines (500 ms) keep the test short.
TEST_P(WrapperStateTest, ContextRequestsAreForgottenAfterTheirDeadlineWithoutNewWork) {
  ShortPair pair = shortPair();  // named members, not a structured binding: lambdas capture them
  auto& ctx = pair.ctx;
  kv::Connection const* conn = pair.conn;
  GenSide gen{conn, Tags{true}};
  constexpr uint64_t kDone = 0x7E5D, kRefused = 0x7E5E;
  auto server = std::async(std::launch::async, [&] {
    for (int i = 0; i < 2; ++i) {
      Taken t = recvRequestInfo(*ctx, never_);
      if (t.conn == nullptr) throw std::runtime_error("no request taken");
      uint64_t const id = t.info.getRequestId();
      bool const ready = id == kDone;
      t.conn->send(kv::DataContext{gen.tags.ready(id)}, &ready, sizeof ready);
      if (!ready) continue;
      std::vector<uint8_t> s(4096);
      fill(id, 0, s.data(), s.size());
      t.conn->send(kv::DataContext{gen.tags.data(id)}, s.data(), s.size());
    }
  });
  // Each on a thread of its own: neither request's envelope closes the other.
  std::thread([&] {
    gen.sendRequestInfo(kDone);
    EXPECT_TRUE(gen.recvReady(kDone, never_));
    std::vector<uint8_t> d(4096);
    conn->recv(kv::DataContext{gen.tags.data(kDone)}, d.data(), d.size());
    EXPECT_EQ(check(kDone, 0, d.data(), d.size()), SIZE_MAX);
  }).join();
  std::thread([&] {
    gen.sendRequestInfo(kRefused);
    EXPECT_FALSE(gen.recvReady(kRefused, never_));
  }).join();
  server.get();
  EXPECT_EQ(state(*ctx).context_requests, 2u) << "the context rank did not hold the requests it took";
  // Their deadline (500 ms), the grace after it (agreement bound 200 ms + 1 s) and a dispatcher
  // round (200 ms), with a margin, bound when they go.
  auto const until = Clock::now() + 3s;
  while (state(*ctx).context_requests != 0 && Clock::now() < until) std::this_thread::sleep_for(10ms);
  EXPECT_EQ(state(*ctx).context_requests, 0u) << "requests past their deadline were kept with no new work";
}

size_t threadCount() {
  size_t n = 0;
  for (auto const& e : std::filesystem::directory_iterator("/proc/self/task")) n += e.is_directory() ? 1 : 0;
  return n;
}

size_t fdCount() {
  return static_cast<size_t>(std::distance(std::filesystem::directory_iterator("/proc/self/fd"),
                                           std::filesystem::directory_iterator{}));
}

/// Resident memory in bytes.
size_t rssBytes() {
  std::ifstream f("/proc/self/statm");
  size_t total = 0, resident = 0;
  f >> total >> resident;
  return resident * static_cast<size_t>(sysconf(_SC_PAGESIZE));
}

/// One life of TensorRT-LLM's cache transceiver on both ranks, with the wrapper `w`: a context and
/// a generation manager made and connected, four requests (completed, refused, given up by the
/// context rank before its buffer came, and taken by a context manager destroyed before it
/// answered), the managers destroyed. The generation side runs on the calling thread; the
/// context side on a thread of the life's own.
void managerLife(Wrapper& w, int round, std::string const& transport) {
  auto ctx = make(w, options(transport));
  auto gen = make(w, options(transport));
  kv::Connection const* conn = gen->getConnections(ctx->getCommState()).at(0);
  GenSide side{conn, Tags{true}};
  std::atomic<bool> never{false}, stop{false};
  uint64_t const first = 0x11FE0000 + 8 * static_cast<uint64_t>(round);
  uint64_t const done = first, refused = first + 1, given = first + 2, orphan = first + 3;
  auto server = std::async(std::launch::async, [&] {
    auto const take = [&] {
      Taken t = recvRequestInfo(*ctx, stop);
      if (t.conn == nullptr) throw std::runtime_error("no request taken");
      return t;
    };
    std::vector<uint8_t> s(4096);
    Taken t = take();
    bool const yes = true, no = false;
    t.conn->send(kv::DataContext{side.tags.ready(done)}, &yes, sizeof yes);
    fill(done, 0, s.data(), s.size());
    t.conn->send(kv::DataContext{side.tags.data(done)}, s.data(), s.size());
    t = take();
    t.conn->send(kv::DataContext{side.tags.ready(refused)}, &no, sizeof no);
    t = take();
    t.conn->send(kv::DataContext{side.tags.ready(given)}, &yes, sizeof yes);
    std::atomic<bool> const stop{true};  // TensorRT-LLM gave the request up
    try {
      t.conn->send(kv::DataContext{side.tags.data(given), stop}, s.data(), s.size());
      ADD_FAILURE() << "round " << round << ": a terminated send went out";
    } catch (kvlink::trtllm::TransferError const& e) {
      EXPECT_EQ(e.outcome(), 2) << e.what();  // Cancelled
    }
    t = take();  // and never answered
  });
  struct StopOnExit {  // a failure below must not leave the server in recvConnect for good
    std::atomic<bool>& stop;
    ~StopOnExit() { stop = true; }
  } const stopOnExit{stop};
  std::vector<uint8_t> d(4096);
  side.sendRequestInfo(done);
  EXPECT_TRUE(side.recvReady(done, never));
  conn->recv(kv::DataContext{side.tags.data(done)}, d.data(), d.size());
  EXPECT_EQ(check(done, 0, d.data(), d.size()), SIZE_MAX) << round;
  side.sendRequestInfo(refused);
  EXPECT_FALSE(side.recvReady(refused, never));
  side.sendRequestInfo(given);
  EXPECT_TRUE(side.recvReady(given, never));
  EXPECT_THROW(conn->recv(kv::DataContext{side.tags.data(given), never}, d.data(), d.size()),
               kvlink::trtllm::TransferError);
  side.sendRequestInfo(orphan);
  server.get();
  ctx.reset();  // the peer goes with the request it took unanswered
  bool ready = true;
  try {
    ready = side.recvReady(orphan, never);
  } catch (kvlink::trtllm::TransferError const& e) {
    EXPECT_NE(e.outcome(), 1) << "round " << round << ": the orphan's ready wait ran to its deadline";
    ready = false;
  }
  EXPECT_FALSE(ready) << round;
  gen.reset();
}

/// What a leaked manager shows in: its dispatcher and its engine's progress thread, its UCX
/// worker's descriptors (sockets, eventfds, shared-memory segments), its memory.
struct Footprint {
  size_t threads = 0, fds = 0, rss = 0;
};

Footprint footprint() { return Footprint{threadCount(), fdCount(), rssBytes()}; }

#if defined(__SANITIZE_ADDRESS__)
constexpr bool kAsan = true;  // AddressSanitizer's build (scripts/sanitize.sh)
#else
constexpr bool kAsan = false;
#endif

/// Runs `lives` lives (managerLife, tcp and shared memory in turn) with `run(round, transport)`,
/// and expects threads and descriptors back to what the first six left, and resident memory
/// grown by less than 48 MiB (a leaked UCX context and worker holds a few MiB each; not under
/// AddressSanitizer, whose quarantine keeps up to 256 MiB of freed memory resident).
template <typename Run>
void expectLivesLeaveNothing(int lives, Run&& run) {
  constexpr int kWarmup = 6;  // UCX's one-time state, the log sink, allocator arenas
  std::string const transports[] = {"tcp", "sm"};
  Footprint base;
  auto const t0 = Clock::now();
  for (int round = 0; round < lives; ++round) {
    run(round, transports[round % 2]);
    if (testing::Test::HasFailure()) return;
    if (round + 1 == kWarmup) base = footprint();
  }
  // Threads that a manager's destructor ended may still be leaving: a bounded wait for them.
  auto const until = Clock::now() + 5s;
  Footprint now = footprint();
  while ((now.threads > base.threads || now.fds > base.fds) && Clock::now() < until) {
    std::this_thread::sleep_for(20ms);
    now = footprint();
  }
  std::printf("%d lives in %lld ms: %zu threads, %zu fds, %zu KiB after them; %zu, %zu, %zu KiB after %d\n", lives,
              static_cast<long long>(std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count()),
              now.threads, now.fds, now.rss >> 10, base.threads, base.fds, base.rss >> 10, kWarmup);
  EXPECT_LE(now.threads, base.threads) << "threads left behind by " << lives << " manager lives";
  EXPECT_LE(now.fds, base.fds) << "descriptors left behind by " << lives << " manager lives";
  if (!kAsan) {
    EXPECT_LT(now.rss, base.rss + (size_t{48} << 20)) << "resident memory grew over " << lives << " manager lives";
  }
}

// TensorRT-LLM makes its executor, and with it the cache transceiver, its connection managers
// and the wrapper's dlopen, again and again in a long-running server, and closes the wrapper
// when the transceiver goes. Each life here loads the wrapper, runs on a thread of its own, and
// closes the wrapper once that thread is gone: with no live thread holding a thread_local of it
// (glibc keeps a library whose thread_local destructors are pending), the wrapper, and UCX with
// it, is really unloaded, and loaded again by the next life. Nothing of the lives is left: no
// thread, no descriptor, no memory beyond the bound.
//
// Under AddressSanitizer the wrapper is kept loaded: what a copy of the library keeps in its
// statics (Rust's and UCX's, made once per load and never freed) is unreachable once that copy
// is unmapped, and LeakSanitizer reports it at exit (about 36 KiB a reload here).
TEST(WrapperLives, ManagerLivesWithTheWrapperUnloadedBetweenThemLeaveNothingBehind) {
  // A test before this one in the process may have used the wrapper on a thread still alive
  // (this one's): then it stays loaded, and only the lives are checked.
  void* const before = dlopen(KVLINK_WRAPPER_PATH, RTLD_LAZY | RTLD_NOLOAD);
  if (before != nullptr) dlclose(before);
  bool const loadedBefore = before != nullptr || kAsan;
  if (kAsan) (void)dlopen(KVLINK_WRAPPER_PATH, RTLD_LAZY | RTLD_LOCAL);  // a reference never closed
  expectLivesLeaveNothing(60, [](int round, std::string const& transport) {
    Wrapper w;
    std::thread([&] { managerLife(w, round, transport); }).join();
  });
  void* const still = dlopen(KVLINK_WRAPPER_PATH, RTLD_LAZY | RTLD_NOLOAD);
  if (still != nullptr) dlclose(still);
  if (loadedBefore) {
    std::printf("the wrapper stayed loaded (an earlier test or AddressSanitizer's build): not unloaded between lives\n");
  } else {
    EXPECT_EQ(still, nullptr) << "the wrapper stayed loaded: the lives did not unload and load it again";
  }
}

// The same lives, the generation side on one long-lived thread (the test's, which keeps the
// wrapper loaded: it holds a thread_local of it), as a host thread that outlives its executors
// makes its calls. That thread keeps a list of the connections it holds state on, for its exit
// to drop that state; the list stays bounded by what is alive. Before, it kept a pointer to
// every connection it ever used, of managers long destroyed (one more each life: 83 after 100
// lives here), and searched the whole list on each of its requests.
TEST(WrapperLives, ALongLivedThreadKeepsNothingOfManagersGone) {
  constexpr int kLives = 100;
  expectLivesLeaveNothing(kLives, [](int round, std::string const& transport) {
    Wrapper w(KVLINK_WRAPPER_PROBE_PATH);
    managerLife(w, round, transport);
  });
  Wrapper w(KVLINK_WRAPPER_PROBE_PATH);
  auto const touched =
      reinterpret_cast<KvlinkProbeThreadConnectionsFn>(dlsym(w.handle, KVLINK_PROBE_THREAD_CONNECTIONS_SYMBOL));
  ASSERT_NE(touched, nullptr);
  uint64_t const n = touched();
  std::printf("connections this thread lists after %d lives: %llu\n", kLives, static_cast<unsigned long long>(n));
  EXPECT_LT(n, 32u) << "the long-lived thread lists a connection of every manager it ever used";
}

/// The CUDA driver, loaded at run time (this binary links nothing of CUDA): device memory for
/// the GPU test, or the reason there is none.
struct Cuda {
  using Ptr = unsigned long long;
  void* lib = nullptr;
  int (*memAlloc)(Ptr*, size_t) = nullptr;
  int (*memFree)(Ptr) = nullptr;
  int (*htod)(Ptr, void const*, size_t) = nullptr;
  int (*dtoh)(void*, Ptr, size_t) = nullptr;
  std::string why;
  Cuda() {
    lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (lib == nullptr) {
      why = "no CUDA driver (libcuda.so.1 not found)";
      return;
    }
    auto init = reinterpret_cast<int (*)(unsigned)>(dlsym(lib, "cuInit"));
    auto deviceGet = reinterpret_cast<int (*)(int*, int)>(dlsym(lib, "cuDeviceGet"));
    auto retain = reinterpret_cast<int (*)(void**, int)>(dlsym(lib, "cuDevicePrimaryCtxRetain"));
    auto setCurrent = reinterpret_cast<int (*)(void*)>(dlsym(lib, "cuCtxSetCurrent"));
    memAlloc = reinterpret_cast<int (*)(Ptr*, size_t)>(dlsym(lib, "cuMemAlloc_v2"));
    memFree = reinterpret_cast<int (*)(Ptr)>(dlsym(lib, "cuMemFree_v2"));
    htod = reinterpret_cast<int (*)(Ptr, void const*, size_t)>(dlsym(lib, "cuMemcpyHtoD_v2"));
    dtoh = reinterpret_cast<int (*)(void*, Ptr, size_t)>(dlsym(lib, "cuMemcpyDtoH_v2"));
    int dev = 0;
    void* ctx = nullptr;
    if (init == nullptr || deviceGet == nullptr || retain == nullptr || setCurrent == nullptr || memAlloc == nullptr ||
        memFree == nullptr || htod == nullptr || dtoh == nullptr) {
      why = "the CUDA driver lacks a needed entry point";
    } else if (int r = init(0); r != 0) {
      why = "cuInit failed (" + std::to_string(r) + "): no usable GPU";
    } else if (deviceGet(&dev, 0) != 0 || retain(&ctx, dev) != 0 || setCurrent(ctx) != 0) {
      why = "no CUDA device 0";
    }
  }
  bool ok() const { return why.empty(); }
};

// TensorRT-LLM's buffers are device memory: the generation side receives into a device pointer
// and the context side sends from one. kvlink must take its device path (staged through pinned
// host memory by kvlink), never read or write the device pointer on the host. Skips, saying
// why, where no GPU exists; runs on a GPU machine (scripts/gpu-check.sh).
TEST_P(WrapperTest, DeviceMemoryMovesThroughKvlinksDevicePath) {
  Cuda cuda;
  if (!cuda.ok()) GTEST_SKIP() << "GPU test skipped: " << cuda.why;
  // Managers made after libcuda is loaded see device pointers as such.
  auto ctx = make(*wrapper_, options(GetParam()));
  auto gen = make(*wrapper_, options(GetParam()));
  auto const* conn = gen->getConnections(ctx->getCommState()).at(0);
  GenSide side{conn, Tags{true}};
  constexpr uint64_t kId = 0xD0;
  constexpr size_t kBytes = 8 << 20;
  std::vector<uint8_t> host(kBytes), back(kBytes, 0);
  fill(kId, 0, host.data(), host.size());
  Cuda::Ptr src = 0, dst = 0;
  ASSERT_EQ(cuda.memAlloc(&src, kBytes), 0);
  ASSERT_EQ(cuda.memAlloc(&dst, kBytes), 0);
  ASSERT_EQ(cuda.htod(src, host.data(), kBytes), 0);
  auto server = std::async(std::launch::async, [&] {
    Taken t = recvRequestInfo(*ctx, never_);
    bool const ready = true;
    t.conn->send(kv::DataContext{side.tags.ready(kId)}, &ready, sizeof ready);
    t.conn->send(kv::DataContext{side.tags.data(kId)}, reinterpret_cast<void const*>(src), kBytes);
  });
  side.sendRequestInfo(kId);
  ASSERT_TRUE(side.recvReady(kId, never_));
  conn->recv(kv::DataContext{side.tags.data(kId)}, reinterpret_cast<void*>(dst), kBytes);
  server.get();
  ASSERT_EQ(cuda.dtoh(back.data(), dst, kBytes), 0);
  EXPECT_EQ(check(kId, 0, back.data(), back.size()), SIZE_MAX);
  cuda.memFree(src);
  cuda.memFree(dst);
}

INSTANTIATE_TEST_SUITE_P(Transports, WrapperTest, testing::Values("tcp", "sm"), param_name);
INSTANTIATE_TEST_SUITE_P(Transports, WrapperStateTest, testing::Values("tcp", "sm"), param_name);

}  // namespace
