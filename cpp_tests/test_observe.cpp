// Logs and metrics through the C++ facade: a registered log sink receives the event of a request
// that timed out, with its request id; metrics_text() counts it.
#include "test_util.h"

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <sstream>
#include <string>
#include <vector>

using namespace kvtest;
using kvlink::Outcome;
using kvlink::RequestKey;

namespace {

constexpr std::uint32_t kCtx = 0;
constexpr std::uint32_t kGen = 1;

struct Captured {
  kvlink::LogLevel level;
  std::string target, message, fields;
};

struct Capture {
  std::mutex mutex;
  std::vector<Captured> events;

  std::vector<Captured> with(const std::string& needle) {
    std::lock_guard<std::mutex> lock(mutex);
    std::vector<Captured> out;
    for (const auto& e : events) {
      if (e.fields.find(needle) != std::string::npos) out.push_back(e);
    }
    return out;
  }
};

/// The value of one series (`name{labels}`) in the metrics text, -1 if absent.
double series(const std::string& text, const std::string& name) {
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(name + " ", 0) == 0) return std::stod(line.substr(name.size() + 1));
  }
  return -1;
}

class ObserveTest : public testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    ctx_.emplace(config(GetParam(), kCtx, 300ms));
    gen_.emplace(config(GetParam(), kGen, 300ms));
    ASSERT_EQ(gen_->connect(ctx_->address(), kvlink::after(5s)), kCtx);
    ctx_->wait_peer(kGen, kvlink::after(5s));
  }
  void TearDown() override {
    kvlink::clear_log_sink();
    expect_no_leak(*gen_, "gen");
    expect_no_leak(*ctx_, "ctx");
  }
  std::optional<kvlink::Engine> ctx_, gen_;
};

TEST_P(ObserveTest, LogSinkReceivesTheTimedOutRequestWithItsId) {
  auto capture = std::make_shared<Capture>();
  const bool ours = kvlink::set_log_sink(kvlink::LogLevel::Warn, [capture](const kvlink::LogRecord& r) {
    std::lock_guard<std::mutex> lock(capture->mutex);
    capture->events.push_back({r.level, std::string(r.target), std::string(r.message), std::string(r.fields)});
  });
  ASSERT_TRUE(ours) << "kvlink's subscriber must be the global one in this process";

  // The context rank takes the advertisement and never sends: the request times out at 300 ms.
  const RequestKey key{0x5EED'0000'0000'0042ull, 7};
  std::vector<std::uint8_t> buf(4096);
  gen_->advertise(key, {}, kCtx, {{kvlink::BufferKind::Kv, 0, buf.data(), buf.size()}}, {});
  ASSERT_TRUE(ctx_->next_advertisement(kvlink::after(5s)));
  EXPECT_EQ(gen_->wait_receiver(key, kvlink::after(5s)), Outcome::TimedOut);
  EXPECT_EQ(ctx_->wait_sender(key, kGen, kvlink::after(5s)), Outcome::TimedOut);

  // The sink is called on kvlink's log thread: wait for the records to reach it.
  ASSERT_TRUE(kvlink::flush_log(kvlink::after(10s)));
  const std::string id = "request=" + std::to_string(key.request);
  const auto got = capture->with(id);
  ASSERT_FALSE(got.empty()) << "no log event with " << id;
  bool receiver_seen = false;
  for (const auto& e : got) {
    EXPECT_EQ(e.level, kvlink::LogLevel::Warn);
    EXPECT_NE(e.fields.find("generation=7"), std::string::npos) << e.fields;
    EXPECT_NE(e.target.find("kvlink"), std::string::npos) << e.target;
    receiver_seen = receiver_seen || (e.fields.find("role=receiver") != std::string::npos &&
                                      e.fields.find("outcome=timed_out") != std::string::npos);
  }
  EXPECT_TRUE(receiver_seen);

  // Removed: nothing more arrives.
  kvlink::clear_log_sink();
  const RequestKey second{0x5EED'0000'0000'0043ull, 0};
  gen_->advertise(second, {}, kCtx, {{kvlink::BufferKind::Kv, 0, buf.data(), buf.size()}}, {});
  EXPECT_EQ(gen_->wait_receiver(second, kvlink::after(5s)), Outcome::TimedOut);
  EXPECT_TRUE(capture->with("request=" + std::to_string(second.request)).empty());
  ASSERT_TRUE(ctx_->next_advertisement(kvlink::after(5s)));
  ctx_->wait_sender(second, kGen, kvlink::after(5s));
}

TEST_P(ObserveTest, ASinkThatThrowsDoesNotHurt) {
  kvlink::set_log_sink(kvlink::LogLevel::Trace, [](const kvlink::LogRecord&) { throw std::runtime_error("sink"); });
  const RequestKey key{44, 0};
  std::vector<std::uint8_t> buf(4096);
  gen_->advertise(key, {}, kCtx, {{kvlink::BufferKind::Kv, 0, buf.data(), buf.size()}}, {});
  ASSERT_TRUE(ctx_->next_advertisement(kvlink::after(5s)));
  EXPECT_EQ(gen_->wait_receiver(key, kvlink::after(5s)), Outcome::TimedOut);
  ctx_->wait_sender(key, kGen, kvlink::after(5s));
  try {
    kvlink::set_log_sink(static_cast<kvlink::LogLevel>(9), [](const kvlink::LogRecord&) {});
    FAIL() << "level 9 was accepted";
  } catch (const kvlink::Error& e) {
    EXPECT_EQ(e.kind(), kvlink::ErrorKind::InvalidArgument);
  }
}

// A set_log_sink call that throws (a level outside the enum) changes nothing:
// the sink registered before keeps the events, and the refused one never sees any.
TEST_P(ObserveTest, ARefusedSinkDoesNotReplaceTheRegisteredOne) {
  auto kept = std::make_shared<std::atomic<int>>(0);
  auto refused = std::make_shared<std::atomic<int>>(0);
  kvlink::set_log_sink(kvlink::LogLevel::Warn, [kept](const kvlink::LogRecord&) { kept->fetch_add(1); });
  EXPECT_THROW(kvlink::set_log_sink(static_cast<kvlink::LogLevel>(9),
                                    [refused](const kvlink::LogRecord&) { refused->fetch_add(1); }),
               kvlink::Error);
  const RequestKey key{45, 0};
  std::vector<std::uint8_t> buf(4096);
  gen_->advertise(key, {}, kCtx, {{kvlink::BufferKind::Kv, 0, buf.data(), buf.size()}}, {});
  ASSERT_TRUE(ctx_->next_advertisement(kvlink::after(5s)));
  EXPECT_EQ(gen_->wait_receiver(key, kvlink::after(5s)), Outcome::TimedOut);
  ctx_->wait_sender(key, kGen, kvlink::after(5s));
  ASSERT_TRUE(kvlink::flush_log(kvlink::after(10s)));
  EXPECT_EQ(refused->load(), 0) << "the refused sink received events";
  EXPECT_GT(kept->load(), 0) << "the registered sink lost its events";
}

// A host logger that blocks (a full pipe to a stalled log collector) holds up no transfer: the
// sink is called on kvlink's log thread, so a request that times out while the sink is blocked
// still ends by its deadline + the agreement bound + a few ms, and once the sink is released the
// queued records reach it. Before, the sink was called on the thread that logged (the progress
// thread, with the engine's lock held): the waits stayed blocked with the sink.
TEST_P(ObserveTest, ASinkThatBlocksHoldsUpNoWait) {
  struct Gate {
    std::mutex mutex;
    std::condition_variable cv;
    bool open = false;
    int calls = 0;
    std::vector<std::string> fields;
  };
  auto gate = std::make_shared<Gate>();
  const std::uint64_t dropped = kvlink::log_records_dropped();
  kvlink::set_log_sink(kvlink::LogLevel::Warn, [gate](const kvlink::LogRecord& r) {
    std::unique_lock<std::mutex> lock(gate->mutex);
    ++gate->calls;
    gate->cv.notify_all();
    gate->cv.wait(lock, [&] { return gate->open; });
    gate->fields.emplace_back(r.fields);
  });
  // Should the waits be stuck behind the sink, this opens it after 5 s so that the test ends.
  std::thread watchdog([gate] {
    std::unique_lock<std::mutex> lock(gate->mutex);
    gate->cv.wait_for(lock, 5s, [&] { return gate->open; });
    gate->open = true;
    gate->cv.notify_all();
  });

  // The context rank takes the advertisement and never sends: the request times out at 300 ms.
  const RequestKey key{0x5EED'0000'0000'0044ull, 1};
  std::vector<std::uint8_t> buf(4096);
  const auto deadline = kvlink::after(300ms);
  const auto bound = 500ms + 100ms;  // the agreement bound (config()) and a busy machine's margin
  gen_->advertise(key, {}, kCtx, {{kvlink::BufferKind::Kv, 0, buf.data(), buf.size()}}, {});
  ASSERT_TRUE(ctx_->next_advertisement(kvlink::after(5s)));
  EXPECT_EQ(gen_->wait_receiver(key, kvlink::after(5s)), Outcome::TimedOut);
  const auto late = std::chrono::duration_cast<std::chrono::milliseconds>(kvlink::Clock::now() - deadline);
  EXPECT_LE(late, bound) << "the receiver's wait returned " << late.count() << " ms past its deadline";
  const auto sender_deadline = kvlink::after(300ms);
  EXPECT_NE(ctx_->wait_sender(key, kGen, sender_deadline), Outcome::Completed);
  const auto sender_late =
      std::chrono::duration_cast<std::chrono::milliseconds>(kvlink::Clock::now() - sender_deadline);
  EXPECT_LE(sender_late, bound) << "the sender's wait returned " << sender_late.count() << " ms past its deadline";
  {
    std::unique_lock<std::mutex> lock(gate->mutex);
    EXPECT_FALSE(gate->open) << "the waits returned only once the watchdog opened the sink";
    EXPECT_TRUE(gate->cv.wait_for(lock, 5s, [&] { return gate->calls > 0; })) << "the sink was never called";
    gate->open = true;
    gate->cv.notify_all();
  }
  watchdog.join();
  ASSERT_TRUE(kvlink::flush_log(kvlink::after(10s)));
  const std::string id = "request=" + std::to_string(key.request);
  bool receiver_seen = false;
  {
    std::lock_guard<std::mutex> lock(gate->mutex);
    for (const auto& f : gate->fields) {
      receiver_seen = receiver_seen || (f.find(id) != std::string::npos && f.find("role=receiver") != std::string::npos);
    }
  }
  EXPECT_TRUE(receiver_seen) << "the queued record of the timed-out request did not arrive";
  EXPECT_EQ(kvlink::log_records_dropped(), dropped) << "a request's few records fit in the queue";
}

TEST_P(ObserveTest, MetricsTextCountsOutcomesByRole) {
  const RequestKey done{1, 0}, late{2, 0};
  std::vector<std::uint8_t> buf(64 << 10);
  gen_->advertise(done, {}, kCtx, {{kvlink::BufferKind::Kv, 0, buf.data(), buf.size()}}, {});
  auto adv = ctx_->next_advertisement(kvlink::after(5s));
  ASSERT_TRUE(adv);
  ctx_->accept(done, kGen, true);
  const auto src = pattern(buf.size(), 3);
  EXPECT_EQ(ctx_->send(done, kGen, 0, src.data(), src.size(), kvlink::after(5s)), Outcome::Completed);
  EXPECT_EQ(gen_->wait_receiver(done, kvlink::after(5s)), Outcome::Completed);
  EXPECT_EQ(ctx_->wait_sender(done, kGen, kvlink::after(5s)), Outcome::Completed);
  gen_->advertise(late, {}, kCtx, {{kvlink::BufferKind::Kv, 0, buf.data(), buf.size()}}, {});
  ASSERT_TRUE(ctx_->next_advertisement(kvlink::after(5s)));
  EXPECT_EQ(gen_->wait_receiver(late, kvlink::after(5s)), Outcome::TimedOut);
  EXPECT_EQ(ctx_->wait_sender(late, kGen, kvlink::after(5s)), Outcome::TimedOut);

  const std::string g = gen_->metrics_text();
  EXPECT_EQ(series(g, R"(kvlink_requests_total{outcome="completed",role="receiver"})"), 1) << g;
  EXPECT_EQ(series(g, R"(kvlink_requests_total{outcome="timed_out",role="receiver"})"), 1) << g;
  EXPECT_EQ(series(g, R"(kvlink_requests_total{outcome="completed",role="sender"})"), 0) << g;
  EXPECT_EQ(series(g, R"(kvlink_request_duration_seconds_count{role="receiver"})"), 2) << g;
  EXPECT_GE(series(g, "kvlink_transfer_bytes_total"), static_cast<double>(buf.size())) << g;
  EXPECT_EQ(series(g, "kvlink_buffers_leased"), 0) << g;
  EXPECT_EQ(series(g, "kvlink_health_state"), 1) << g << "(a timed-out request makes it Degraded)";
  const std::string c = ctx_->metrics_text();
  EXPECT_EQ(series(c, R"(kvlink_requests_total{outcome="completed",role="sender"})"), 1) << c;
  EXPECT_EQ(series(c, R"(kvlink_requests_total{outcome="timed_out",role="sender"})"), 1) << c;
  EXPECT_EQ(series(c, R"(kvlink_request_duration_seconds_count{role="sender"})"), 2) << c;
}

INSTANTIATE_TEST_SUITE_P(Transports, ObserveTest, testing::ValuesIn(transports()), param_name);

}  // namespace

namespace {

// set_log_sink may be called from several threads at once (a free function of kvlink.hpp): the
// result must be that of some order of the calls. A refused call (a level outside the enum) that
// raced a good one put back, on its way out, the sink it had found, silently undoing the good
// registration that had come in between (and the two halves of the state, the C++ slot and the
// level Rust holds, could likewise end from different calls).
TEST(LogSink, ARefusedCallRacingAGoodOneNeverUndoesIt) {
  constexpr int kRounds = 300;
  int undone = 0;
  for (int round = 0; round < kRounds && undone == 0; ++round) {
    kvlink::clear_log_sink();
    auto good_called = std::make_shared<std::atomic<int>>(0);
    std::atomic<int> ready{0};
    const auto go = [&] {
      ready.fetch_add(1);
      while (ready.load() < 2) {
      }
    };
    std::thread refused([&] {
      go();
      try {
        kvlink::set_log_sink(static_cast<kvlink::LogLevel>(9), [](const kvlink::LogRecord&) {});
        ADD_FAILURE() << "level 9 was accepted";
      } catch (const kvlink::Error&) {
      }
    });
    std::thread good([&] {
      go();
      kvlink::set_log_sink(kvlink::LogLevel::Warn, [good_called](const kvlink::LogRecord&) { good_called->fetch_add(1); });
    });
    refused.join();
    good.join();
    // The only call that succeeded registered the good sink: it must be the one in place.
    std::shared_ptr<const kvlink::LogSink> now;
    {
      auto& slot = kvlink::detail::log_slot();
      std::lock_guard<std::mutex> lock(slot.mutex);
      now = slot.sink;
    }
    if (now && *now) (*now)(kvlink::LogRecord{kvlink::LogLevel::Warn, "t", "m", ""});
    if (good_called->load() != 1) {
      undone = round + 1;
    }
  }
  kvlink::clear_log_sink();
  EXPECT_EQ(undone, 0) << "round " << undone << ": the good sink was not in place after the race";
}

}  // namespace
