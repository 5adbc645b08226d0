// The TensorRT-LLM-shaped adapter (kvlink/trtllm_adapter.h) driven the way TensorRT-LLM's cache
// transceiver drives AgentConnection / AgentConnectionManager, over tcp and shared memory.
// Names follow TensorRT-LLM's agentCommTest / transferAgentTest where a case mirrors one.
// This file is the test binary's one implementation unit of the adapter.
#define KVLINK_TRTLLM_IMPLEMENTATION
#include <kvlink/trtllm_adapter.h>

#include "test_util.h"

#include <atomic>
#include <cstring>
#include <future>
#include <memory>

using namespace kvtest;
using kvlink::Outcome;
using kvlink::trtllm::AgentConnection;
using kvlink::trtllm::AgentConnectionManager;
using kvlink::trtllm::TransferError;
namespace kv = tensorrt_llm::executor::kv_cache;
namespace bm = tensorrt_llm::batch_manager;

namespace {

constexpr std::uint8_t kKv = 0;
constexpr std::uint8_t kIndexer = 1;

class AdapterTest : public testing::TestWithParam<std::string> {
 protected:
  void SetUp() override { build(); }

  void build(std::optional<std::uint64_t> suppress = std::nullopt, std::chrono::milliseconds timeout = 5000ms) {
    auto c = config(GetParam(), 0, timeout);
    c.name = "ctx";
    c.fault_suppress_request = suppress;
    ctx_ = std::make_unique<AgentConnectionManager>(c);
    auto g = config(GetParam(), 1, timeout);
    g.name = "gen";
    gen_ = std::make_unique<AgentConnectionManager>(g);
    auto conns = gen_->getConnections(ctx_->getCommState());
    ASSERT_EQ(conns.size(), 1u);
    toCtx_ = dynamic_cast<AgentConnection const*>(conns[0]);
    ASSERT_NE(toCtx_, nullptr);
  }

  void TearDown() override {
    for (auto* m : {gen_.get(), ctx_.get()}) {
      if (m == nullptr) continue;
      expect_no_leak(m->engine(), m->config().name.c_str());
      EXPECT_EQ(m->buffersReserved(), 0u) << m->config().name << ": receive buffer still reserved";
    }
  }

  /// Context side: takes the next request and answers ready.
  AgentConnection const* serve(bm::RequestInfo& info, bool ready = true) {
    std::atomic<bool> never{false};
    std::atomic<bool> stop{false};
    auto guard = std::async(std::launch::async, [&] {
      // Bound the accept loop: it otherwise waits until its terminate flag.
      for (int i = 0; i < 500 && !stop; ++i) std::this_thread::sleep_for(10ms);
      never = true;
    });
    auto const* conn = ctx_->recvConnectionAndRequestInfo(info, never);
    stop = true;
    guard.get();
    if (conn != nullptr) conn->sendReadySignal(kv::DataContext(kvlink::trtllm::kReadySignalTag), ready);
    return conn;
  }

  std::unique_ptr<AgentConnectionManager> ctx_, gen_;
  AgentConnection const* toCtx_ = nullptr;
};

TEST_P(AdapterTest, AgentConnectionManagerBasic) {
  EXPECT_TRUE(gen_->isRunning());
  auto const& st = gen_->getCommState();
  ASSERT_TRUE(st.isAgentState());
  ASSERT_EQ(st.getAgentState().size(), 1u);
  EXPECT_EQ(st.getAgentState()[0].mAgentName, "gen");
  EXPECT_EQ(st.getAgentState()[0].mConnectionInfo, gen_->engine().address());
  EXPECT_EQ(st.getSelfIdx(), 0);
  EXPECT_TRUE(toCtx_->isThreadSafe());
  EXPECT_EQ(toCtx_->remoteRank(), 0u);
  EXPECT_FALSE(toCtx_->getPreAssignedBufferId(kKv)) << "nothing registered yet";
  // The same agent gives the same connection.
  EXPECT_EQ(gen_->getConnections(ctx_->getCommState()).at(0), toCtx_);
  // A stopped manager stops accepting at once.
  ctx_->stop();
  EXPECT_FALSE(ctx_->isRunning());
  bm::RequestInfo info;
  std::atomic<bool> never{false};
  auto const t0 = kvlink::Clock::now();
  EXPECT_EQ(ctx_->recvConnectionAndRequestInfo(info, never), nullptr);
  EXPECT_LT(kvlink::Clock::now() - t0, 500ms);
}

TEST_P(AdapterTest, AgentConnectionManagerConnect) {
  std::vector<std::uint8_t> recvBuf(1024, 0);
  gen_->registerReceiveBuffer(kKv, 0, recvBuf.data(), recvBuf.size());
  bm::RequestInfo sent(0xFEED'0000'0000'0042ull, "transfer state");
  const_cast<AgentConnection*>(toCtx_)->sendRequestAndBufferInfo(sent, {std::optional<size_t>(0)}, 0);
  bm::RequestInfo got;
  auto const* conn = serve(got);
  ASSERT_NE(conn, nullptr);
  EXPECT_EQ(got, sent) << "request info round trip";
  EXPECT_EQ(conn->remoteRank(), 1u);
  EXPECT_EQ(toCtx_->recvReadySignalWithStatus(kv::DataContext(kvlink::trtllm::kReadySignalTag)), std::optional<bool>(true));
  auto const src = pattern(1024, 42);
  int const tag = kvlink::trtllm::dataTag(sent.getRequestId());
  conn->send(kv::DataContext(tag), src.data(), src.size());
  toCtx_->recv(kv::DataContext(tag), recvBuf.data(), recvBuf.size());
  EXPECT_EQ(recvBuf, src) << "1024 bytes, byte for byte";
}

// TensorRT-LLM's CacheSenderRejectsStandaloneFinalizedReplay: a cancelled request is refused and
// so is its replay (same request id and generation). A new attempt (nextAttempt) is served.
TEST_P(AdapterTest, CancelledRequestAndItsReplayAreBothRejected) {
  std::vector<std::uint8_t> recvBuf(4096, 0);
  gen_->registerReceiveBuffer(kKv, 0, recvBuf.data(), recvBuf.size());
  bm::RequestInfo req(7, "r7");
  auto* conn = const_cast<AgentConnection*>(toCtx_);
  conn->sendRequestAndBufferInfo(req, {std::optional<size_t>(0)}, 0);
  bm::RequestInfo got;
  auto const* sender = serve(got);
  ASSERT_NE(sender, nullptr);
  std::atomic<bool> terminate{true};  // TensorRT-LLM cancels the request
  try {
    toCtx_->recv(kv::DataContext(kvlink::trtllm::dataTag(7), terminate), recvBuf.data(), recvBuf.size());
    FAIL() << "a cancelled request was served";
  } catch (TransferError const& e) {
    EXPECT_EQ(e.outcome(), Outcome::Cancelled) << e.what();
  }
  auto const src = pattern(4096, 7);
  try {
    sender->send(kv::DataContext(kvlink::trtllm::dataTag(7)), src.data(), src.size());
    FAIL() << "the context side sent into a cancelled request";
  } catch (TransferError const& e) {
    EXPECT_EQ(e.outcome(), Outcome::Cancelled) << e.what();
  }
  EXPECT_TRUE(std::all_of(recvBuf.begin(), recvBuf.end(), [](std::uint8_t b) { return b == 0; }));
  // The replay: same id, same generation.
  try {
    conn->sendRequestAndBufferInfo(req, {std::optional<size_t>(0)}, 0);
    FAIL() << "a replay of a cancelled request was advertised";
  } catch (kvlink::Error const& e) {
    EXPECT_EQ(e.kind(), kvlink::ErrorKind::InvalidArgument) << e.what();
  }
  EXPECT_FALSE(ctx_->engine().next_advertisement(kvlink::after(200ms))) << "the replay reached the context rank";
  // A real retry is a new generation and is served.
  gen_->nextAttempt(7);
  conn->sendRequestAndBufferInfo(req, {std::optional<size_t>(0)}, 0);
  sender = serve(got);
  ASSERT_NE(sender, nullptr);
  EXPECT_EQ(toCtx_->recvReadySignalWithStatus(kv::DataContext(kvlink::trtllm::kReadySignalTag)), std::optional<bool>(true));
  sender->send(kv::DataContext(kvlink::trtllm::dataTag(7)), src.data(), src.size());
  toCtx_->recv(kv::DataContext(kvlink::trtllm::dataTag(7)), nullptr, 0);
  EXPECT_EQ(recvBuf, src);
}

// transferAgentTest Basic: the context rank writes two buffers (KV and KV indexer) into the
// generation rank's pre-assigned buffers.
TEST_P(AdapterTest, WriteIntoPreAssignedBuffers) {
  std::vector<std::uint8_t> kvBuf(256 << 10, 0), idxBuf(4096, 0);
  gen_->registerReceiveBuffer(kKv, 3, kvBuf.data(), kvBuf.size());
  gen_->registerReceiveBuffer(kIndexer, 0, idxBuf.data(), idxBuf.size());
  ASSERT_EQ(toCtx_->getPreAssignedBufferId(kKv), std::optional<size_t>(3));
  ASSERT_EQ(toCtx_->getPreAssignedBufferId(kIndexer), std::optional<size_t>(0));
  toCtx_->activateBuffer(kKv);
  toCtx_->activateBuffer(kIndexer);
  bm::RequestInfo req(100, "");
  const_cast<AgentConnection*>(toCtx_)->sendRequestAndBufferInfo(req, {std::nullopt, std::nullopt}, 0);
  EXPECT_EQ(gen_->buffersReserved(), 2u);
  bm::RequestInfo got;
  auto const* sender = serve(got);
  ASSERT_NE(sender, nullptr);
  EXPECT_EQ(toCtx_->recvReadySignalWithStatus(kv::DataContext(42)), std::optional<bool>(true));
  auto const a = pattern(kvBuf.size(), 1), b = pattern(idxBuf.size(), 2);
  kv::DataContext const ctx(kvlink::trtllm::dataTag(100));
  sender->send(ctx, a.data(), a.size());
  sender->send(ctx, b.data(), b.size());
  toCtx_->recv(ctx, kvBuf.data(), kvBuf.size());
  toCtx_->recv(ctx, idxBuf.data(), idxBuf.size());
  EXPECT_EQ(kvBuf, a);
  EXPECT_EQ(idxBuf, b);
}

// transferAgentTest Basic2 (read): kvlink has no one-sided read; the generation rank "pulls" by
// advertising and then reading the landed bytes into its own memory through recv(ctx, dst, n).
TEST_P(AdapterTest, ReadIntoCallerMemory) {
  std::vector<std::uint8_t> staging(8192, 0), dst(8192, 0);
  gen_->registerReceiveBuffer(kKv, 0, staging.data(), staging.size());
  bm::RequestInfo req(101, "read");
  const_cast<AgentConnection*>(toCtx_)->sendRequestAndBufferInfo(req, {std::optional<size_t>(0)}, 0);
  bm::RequestInfo got;
  auto const* sender = serve(got);
  ASSERT_NE(sender, nullptr);
  auto const src = pattern(dst.size(), 101);
  kv::DataContext const ctx(kvlink::trtllm::dataTag(101));
  std::thread t([&] { sender->send(ctx, src.data(), src.size()); });
  toCtx_->recv(ctx, dst.data(), dst.size());
  t.join();
  EXPECT_EQ(dst, src);
}

// A refused request (sendReadySignal false) ends Rejected and gives its buffers back.
TEST_P(AdapterTest, NotReadyIsReportedAndReleasesTheBuffer) {
  std::vector<std::uint8_t> buf(4096, 0);
  gen_->registerReceiveBuffer(kKv, 0, buf.data(), buf.size());
  bm::RequestInfo req(102, "");
  const_cast<AgentConnection*>(toCtx_)->sendRequestAndBufferInfo(req, {std::optional<size_t>(0)}, 0);
  bm::RequestInfo got;
  ASSERT_NE(serve(got, false), nullptr);
  EXPECT_EQ(toCtx_->recvReadySignalWithStatus(kv::DataContext(42)), std::optional<bool>(false));
  EXPECT_EQ(gen_->buffersReserved(), 0u);
}

// Not in TensorRT-LLM: a completion that never comes (the sender's data is dropped by the fault
// hook) fails the waiting recv with TimedOut at the deadline: not a hang, not silent success.
// The same ranks then serve the next request.
TEST_P(AdapterTest, SuppressedCompletionFailsRecvWithTimedOutAtTheDeadline) {
  constexpr auto kTimeout = 1000ms;
  build(/*suppress=*/200, kTimeout);
  std::vector<std::uint8_t> buf(65536, 0);
  gen_->registerReceiveBuffer(kKv, 0, buf.data(), buf.size());
  auto* conn = const_cast<AgentConnection*>(toCtx_);
  bm::RequestInfo req(200, "");
  auto const t0 = kvlink::Clock::now();
  conn->sendRequestAndBufferInfo(req, {std::optional<size_t>(0)}, 0);
  bm::RequestInfo got;
  auto const* sender = serve(got);
  ASSERT_NE(sender, nullptr);
  auto const src = pattern(buf.size(), 200);
  kv::DataContext const ctx(kvlink::trtllm::dataTag(200));
  auto senderResult = std::async(std::launch::async, [&]() -> Outcome {
    try {
      sender->send(ctx, src.data(), src.size());
      return Outcome::Completed;
    } catch (TransferError const& e) {
      return e.outcome();
    }
  });
  try {
    toCtx_->recv(ctx, buf.data(), buf.size());
    FAIL() << "recv succeeded without data";
  } catch (TransferError const& e) {
    EXPECT_EQ(e.outcome(), Outcome::TimedOut) << e.what();
  }
  auto const took = kvlink::Clock::now() - t0;
  EXPECT_GE(took, kTimeout);
  EXPECT_LT(took, kTimeout + 1500ms) << "ended well after its deadline";
  EXPECT_EQ(senderResult.get(), Outcome::TimedOut) << "both sides reach the same verdict";
  EXPECT_NE(buf, src);
  // Still healthy: the next request goes through.
  bm::RequestInfo next(201, "");
  conn->sendRequestAndBufferInfo(next, {std::optional<size_t>(0)}, 0);
  sender = serve(got);
  ASSERT_NE(sender, nullptr);
  kv::DataContext const ctx2(kvlink::trtllm::dataTag(201));
  sender->send(ctx2, src.data(), src.size());
  toCtx_->recv(ctx2, buf.data(), buf.size());
  EXPECT_EQ(buf, src);
}

// Not in TensorRT-LLM: the context side's terminate flag, set between two segments of a
// request, ends it on both sides as Cancelled; nothing lands after it.
TEST_P(AdapterTest, TerminateFlagBetweenSegmentsCancelsBothSides) {
  std::vector<std::uint8_t> kvBuf(1 << 20, 0), idxBuf(1 << 20, 0);
  gen_->registerReceiveBuffer(kKv, 0, kvBuf.data(), kvBuf.size());
  gen_->registerReceiveBuffer(kIndexer, 0, idxBuf.data(), idxBuf.size());
  bm::RequestInfo req(300, "");
  const_cast<AgentConnection*>(toCtx_)->sendRequestAndBufferInfo(req, {std::optional<size_t>(0), std::optional<size_t>(0)}, 0);
  bm::RequestInfo got;
  auto const* sender = serve(got);
  ASSERT_NE(sender, nullptr);
  std::vector<std::uint8_t> const src(1 << 20, 0x5A);
  std::atomic<bool> terminate{false};
  kv::DataContext const ctx(kvlink::trtllm::dataTag(300), terminate);
  sender->send(ctx, src.data(), src.size());  // first segment goes
  terminate = true;
  auto const t0 = kvlink::Clock::now();
  try {
    sender->send(ctx, src.data(), src.size());
    FAIL() << "sent after the terminate flag";
  } catch (TransferError const& e) {
    EXPECT_EQ(e.outcome(), Outcome::Cancelled) << e.what();
  }
  try {
    toCtx_->recv(kv::DataContext(kvlink::trtllm::dataTag(300)), nullptr, 0);
    FAIL() << "recv succeeded for a cancelled request";
  } catch (TransferError const& e) {
    EXPECT_EQ(e.outcome(), Outcome::Cancelled) << e.what();
  }
  EXPECT_LT(kvlink::Clock::now() - t0, 50ms);
  EXPECT_TRUE(std::all_of(idxBuf.begin(), idxBuf.end(), [](std::uint8_t b) { return b == 0; }));
}

// transferAgentTest Connect: two writers (two context ranks) fill one target's memory, each its
// own half, as two requests.
TEST_P(AdapterTest, TwoWritersOneTarget) {
  auto c2 = config(GetParam(), 2);
  c2.name = "ctx2";
  AgentConnectionManager ctx2(c2);
  std::vector<std::uint8_t> target(2 * 16384, 0);
  gen_->registerReceiveBuffer(kKv, 0, target.data(), 16384);
  gen_->registerReceiveBuffer(kKv, 1, target.data() + 16384, 16384);
  auto both = gen_->getConnections(kv::CommState({ctx_->getCommState().getAgentState()[0], ctx2.getCommState().getAgentState()[0]}, -1));
  ASSERT_EQ(both.size(), 2u);
  auto* to0 = const_cast<AgentConnection*>(dynamic_cast<AgentConnection const*>(both[0]));
  auto* to2 = const_cast<AgentConnection*>(dynamic_cast<AgentConnection const*>(both[1]));
  ASSERT_EQ(to2->remoteRank(), 2u);
  bm::RequestInfo r0(400, "a"), r2(401, "b");
  to0->sendRequestAndBufferInfo(r0, {std::optional<size_t>(0)}, 0);
  to2->sendRequestAndBufferInfo(r2, {std::optional<size_t>(1)}, 1);
  auto const a = pattern(16384, 400), b = pattern(16384, 401);
  auto writer = [](AgentConnectionManager& m, std::vector<std::uint8_t> const& data, std::uint64_t id) {
    bm::RequestInfo got;
    std::atomic<bool> never{false};
    auto const* c = m.recvConnectionAndRequestInfo(got, never);
    ASSERT_EQ(got.getRequestId(), id);
    c->sendReadySignal(kv::DataContext(42), true);
    c->send(kv::DataContext(kvlink::trtllm::dataTag(id)), data.data(), data.size());
  };
  std::thread w0([&] { writer(*ctx_, a, 400); });
  std::thread w2([&] { writer(ctx2, b, 401); });
  to0->recv(kv::DataContext(kvlink::trtllm::dataTag(400)), nullptr, 0);
  to2->recv(kv::DataContext(kvlink::trtllm::dataTag(401)), nullptr, 0);
  w0.join();
  w2.join();
  EXPECT_TRUE(std::equal(a.begin(), a.end(), target.begin()));
  EXPECT_TRUE(std::equal(b.begin(), b.end(), target.begin() + 16384));
  expect_no_leak(ctx2.engine(), "ctx2");
}

// transferAgentTest SyncMessage: notifications arrive exactly once per source, in order, in both
// directions, and from two sources to one target without mixing.
TEST_P(AdapterTest, NotificationsExactlyOncePerSourceInOrderBothWays) {
  auto c2 = config(GetParam(), 2);
  AgentConnectionManager ctx2(c2);
  (void)gen_->getConnections(ctx2.getCommState());
  auto& g = gen_->engine();
  auto& c0 = ctx_->engine();
  auto& c1 = ctx2.engine();
  for (std::uint8_t i = 0; i < 20; ++i) {
    c0.notify(1, {500, 0}, {i});
    c1.notify(1, {600, 0}, {static_cast<std::uint8_t>(100 + i)});
    g.notify(0, {700, 0}, {i, i});
  }
  for (std::uint8_t i = 0; i < 20; ++i) {
    auto n0 = g.wait_for_notification(0, kvlink::after(5s));
    ASSERT_TRUE(n0);
    EXPECT_EQ(n0->key, (kvlink::RequestKey{500, 0}));
    EXPECT_EQ(n0->payload, std::vector<std::uint8_t>{i});
    auto n2 = g.wait_for_notification(2, kvlink::after(5s));
    ASSERT_TRUE(n2);
    EXPECT_EQ(n2->payload, std::vector<std::uint8_t>{static_cast<std::uint8_t>(100 + i)});
    auto back = c0.wait_for_notification(1, kvlink::after(5s));
    ASSERT_TRUE(back);
    EXPECT_EQ(back->payload, (std::vector<std::uint8_t>{i, i}));
  }
  EXPECT_FALSE(g.wait_for_notification(0, kvlink::after(100ms))) << "a duplicate from rank 0";
  EXPECT_FALSE(g.wait_for_notification(2, kvlink::after(100ms))) << "a duplicate from rank 2";
  EXPECT_FALSE(c0.wait_for_notification(1, kvlink::after(100ms))) << "a duplicate from rank 1";
}

// The tag cross-check: a data tag of another request is refused before anything moves.
TEST_P(AdapterTest, DataTagOfAnotherRequestIsRefused) {
  std::vector<std::uint8_t> buf(4096, 0);
  gen_->registerReceiveBuffer(kKv, 0, buf.data(), buf.size());
  bm::RequestInfo req(800, "");
  const_cast<AgentConnection*>(toCtx_)->sendRequestAndBufferInfo(req, {std::optional<size_t>(0)}, 0);
  bm::RequestInfo got;
  auto const* sender = serve(got);
  ASSERT_NE(sender, nullptr);
  auto const src = pattern(4096, 8);
  try {
    sender->send(kv::DataContext(kvlink::trtllm::dataTag(801)), src.data(), src.size());
    FAIL() << "a tag of request 801 was used for request 800";
  } catch (kvlink::Error const& e) {
    EXPECT_EQ(e.kind(), kvlink::ErrorKind::InvalidArgument);
  }
  // 800 + 4096 has the same 12-bit tag as 800 in TensorRT-LLM: the tag cannot tell them apart,
  // which is why kvlink names requests by their full id (see IdsFourThousandNinetySixApartNeverCross).
  EXPECT_EQ(kvlink::trtllm::dataTag(800), kvlink::trtllm::dataTag(800 + 4096));
  sender->send(kv::DataContext(kvlink::trtllm::dataTag(800)), src.data(), src.size());
  toCtx_->recv(kv::DataContext(kvlink::trtllm::dataTag(800)), nullptr, 0);
  EXPECT_EQ(buf, src);
}

INSTANTIATE_TEST_SUITE_P(Transports, AdapterTest, testing::ValuesIn(transports()), param_name);

}  // namespace
