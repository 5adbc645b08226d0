// kvlink::Engine through the C++ facade, two ranks in one process, over tcp and shared memory.
#include "test_util.h"

#include <dlfcn.h>

#include <atomic>
#include <cmath>
#include <cstdio>
#include <thread>
#include <tuple>

using namespace kvtest;
using kvlink::Outcome;
using kvlink::RequestKey;

namespace {

constexpr std::uint32_t kCtx = 0;
constexpr std::uint32_t kGen = 1;

class EngineTest : public testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    ctx_.emplace(config(GetParam(), kCtx));
    gen_.emplace(config(GetParam(), kGen));
    ASSERT_EQ(gen_->connect(ctx_->address(), kvlink::after(5s)), kCtx);
    ctx_->wait_peer(kGen, kvlink::after(5s));
  }
  void TearDown() override {
    expect_no_leak(*gen_, "gen");
    expect_no_leak(*ctx_, "ctx");
  }

  /// Advertises one buffer of `buf` for `key` from the generation rank.
  void advertise(RequestKey key, std::vector<std::uint8_t>& buf) {
    gen_->advertise(key, {}, kCtx, {{kvlink::BufferKind::Kv, 0, buf.data(), buf.size()}}, {1, 2, 3});
  }

  /// The context rank accepts `key` and sends `buf.size()` bytes of pattern `seed` into it;
  /// both ranks must end `Completed` and every byte must have landed.
  void serve_and_check(RequestKey key, const std::vector<std::uint8_t>& buf, std::uint8_t seed) {
    ctx_->accept(key, kGen, true);
    const auto src = pattern(buf.size(), seed);
    EXPECT_EQ(ctx_->send(key, kGen, 0, src.data(), src.size(), kvlink::after(5s)), Outcome::Completed);
    EXPECT_EQ(gen_->wait_receiver(key, kvlink::after(5s)), Outcome::Completed);
    EXPECT_EQ(ctx_->wait_sender(key, kGen, kvlink::after(5s)), Outcome::Completed);
    EXPECT_EQ(buf, src);
  }

  /// Memory a test lends to an engine as a region: declared before the engines, so that it
  /// outlives them even when an assertion ends the test early.
  std::vector<std::uint8_t> region_mem_, send_region_mem_;
  std::optional<kvlink::Engine> ctx_, gen_;
};

TEST_P(EngineTest, ConfigIsCheckedWithTypedErrors) {
  auto bad = config(GetParam(), 9);
  bad.timeout = 0ms;
  try {
    kvlink::Engine e(bad);
    FAIL() << "a zero timeout was accepted";
  } catch (const kvlink::Error& e) {
    EXPECT_EQ(e.kind(), kvlink::ErrorKind::InvalidArgument);
  }
  bad = config(GetParam(), 9);
  bad.transport = "carrier-pigeon";
  try {
    kvlink::Engine e(bad);
    FAIL() << "an unknown transport was accepted";
  } catch (const kvlink::Error& e) {
    EXPECT_EQ(e.kind(), kvlink::ErrorKind::InvalidArgument);
  }
  // A negative duration is refused, each of them (before, only linger's was: the others became
  // their defaults), and so is a suppressed request id past what the bridge carries.
  const std::pair<const char*, void (*)(kvlink::EngineConfig&)> refused[] = {
      {"a negative linger", [](kvlink::EngineConfig& c) { c.linger = -1ms; }},
      {"a negative agreement bound", [](kvlink::EngineConfig& c) { c.agreement_bound = -1ms; }},
      {"a negative wedge window", [](kvlink::EngineConfig& c) { c.wedge_window = -1ms; }},
      {"a negative degraded window", [](kvlink::EngineConfig& c) { c.degraded_window = -1ms; }},
      {"a suppressed request id past 2^63 - 1",
       [](kvlink::EngineConfig& c) { c.fault_suppress_request = std::uint64_t{1} << 63; }},
  };
  for (const auto& [what, spoil] : refused) {
    bad = config(GetParam(), 9);
    spoil(bad);
    try {
      kvlink::Engine e(bad);
      ADD_FAILURE() << what << " was accepted";
    } catch (const kvlink::Error& e) {
      EXPECT_EQ(e.kind(), kvlink::ErrorKind::InvalidArgument) << what;
      EXPECT_NE(std::string(e.what()).find("must not"), std::string::npos) << what << ": " << e.what();
    }
  }
}

// `EngineConfig::linger` reaches the protocol core across the bridge: a request refused to a
// rank with a linger of 1 s is held whole there (`requests_known`) right after its end, and
// forgotten within the linger and a margin (with the default, 5 s, it still was).
TEST_P(EngineTest, ALingerSetThroughTheFacadeIsHowLongAFailedRequestIsHeld) {
  constexpr std::uint32_t kLingering = 3;
  const RequestKey key{93, 0};
  auto c = config(GetParam(), kLingering, 10s);
  c.linger = 1000ms;
  kvlink::Engine gen(c);
  ASSERT_EQ(gen.connect(ctx_->address(), kvlink::after(5s)), kCtx);
  ctx_->wait_peer(kLingering, kvlink::after(5s));
  std::vector<std::uint8_t> buf(4096, 0);
  gen.advertise(key, {}, kCtx, {{kvlink::BufferKind::Kv, 0, buf.data(), buf.size()}}, {});
  auto adv = ctx_->next_advertisement(kvlink::after(5s));
  ASSERT_TRUE(adv);
  ctx_->accept(key, kLingering, false);
  EXPECT_EQ(gen.wait_receiver(key, kvlink::after(5s)), Outcome::Rejected);
  EXPECT_EQ(gen.health().requests_known, 1u) << "held whole inside the linger";
  EXPECT_TRUE(eventually([&] { return gen.health().requests_known == 0; }, 2000ms))
      << "still held past the linger";
  EXPECT_EQ(ctx_->wait_sender(key, kLingering, kvlink::after(5s)), Outcome::Rejected);
  expect_no_leak(gen, "lingering");
}

TEST_P(EngineTest, FullRoundTripThroughTheFacade) {
  const RequestKey key{0x1234'5678'9ABC'DEF0ull, 3};  // all 64 bits and a generation survive
  std::vector<std::uint8_t> buf(64 << 10, 0);
  advertise(key, buf);
  auto adv = ctx_->next_advertisement(kvlink::after(5s));
  ASSERT_TRUE(adv);
  EXPECT_EQ(adv->key, key);
  EXPECT_EQ(adv->from_rank, kGen);
  EXPECT_EQ(adv->request_info, (std::vector<std::uint8_t>{1, 2, 3}));
  ASSERT_EQ(adv->buffers.size(), 1u);
  EXPECT_EQ(adv->buffers[0].size, buf.size());
  ctx_->accept(key, kGen, true);
  EXPECT_EQ(gen_->recv_ready(key, kvlink::after(5s)), std::optional<bool>(true));
  const auto src = pattern(buf.size(), 1);
  EXPECT_EQ(ctx_->send(key, kGen, 0, src.data(), src.size(), kvlink::after(5s)), Outcome::Completed);
  EXPECT_EQ(gen_->wait_receiver(key, kvlink::after(5s)), Outcome::Completed);
  EXPECT_EQ(ctx_->wait_sender(key, kGen, kvlink::after(5s)), Outcome::Completed);
  EXPECT_EQ(buf, src);
  EXPECT_GE(gen_->health().completed, 1u);
  // A cancel after the end, on either side, is no error and changes nothing.
  EXPECT_NO_THROW(ctx_->cancel(key));
  EXPECT_NO_THROW(gen_->cancel(key));
  EXPECT_EQ(ctx_->health().failed + gen_->health().failed, 0u);
  // The shared-memory probe runs on sm (and the field crosses the bridge): a healthy pair is
  // never reported stuck.
  EXPECT_FALSE(gen_->health().receive_stuck);
  EXPECT_FALSE(ctx_->health().receive_stuck);
}

// Two generation ranks receive one request and start it apart: the second (rank 2, not the
// coordinator) starts first and its caller cancels before the coordinator (the fixture's rank 1)
// has started. The cancel's vote reaches the coordinator first and is kept for its start, so the
// coordinator ends `Cancelled` as soon as it starts (it used to wait out its deadline and end
// `TimedOut`), and `health().early_kept` counts that vote across the bridge.
TEST_P(EngineTest, AVoteThatComesBeforeTheCoordinatorStartsCountsAtItsStart) {
  constexpr std::uint32_t kOther = 2;
  const RequestKey key{91, 0};
  kvlink::Engine other(config(GetParam(), kOther, 10s));
  ASSERT_EQ(other.connect(ctx_->address(), kvlink::after(5s)), kCtx);
  ASSERT_EQ(other.connect(gen_->address(), kvlink::after(5s)), kGen);
  ctx_->wait_peer(kOther, kvlink::after(5s));
  gen_->wait_peer(kOther, kvlink::after(5s));
  std::vector<std::uint8_t> buf_other(4096, 0), buf_coord(4096, 0);
  other.advertise(key, {kGen, kOther}, kCtx, {{kvlink::BufferKind::Kv, 0, buf_other.data(), buf_other.size()}}, {});
  auto adv = ctx_->next_advertisement(kvlink::after(5s));
  ASSERT_TRUE(adv);
  EXPECT_EQ(adv->from_rank, kOther);
  ctx_->accept(key, kOther, true);
  other.cancel(key);
  EXPECT_EQ(other.wait_receiver(key, kvlink::after(5s)), Outcome::Cancelled);
  EXPECT_EQ(gen_->health().early_kept, 1u);
  const auto t0 = std::chrono::steady_clock::now();
  gen_->advertise(key, {kGen, kOther}, kCtx, {{kvlink::BufferKind::Kv, 0, buf_coord.data(), buf_coord.size()}}, {});
  EXPECT_EQ(gen_->wait_receiver(key, kvlink::after(3s)), Outcome::Cancelled);
  const auto took = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0);
  EXPECT_LT(took.count(), 1000) << "the late coordinator waited for its deadline";
  EXPECT_EQ(ctx_->wait_sender(key, kOther, kvlink::after(5s)), Outcome::Cancelled);
  EXPECT_EQ(ctx_->health().ranks_forgotten + gen_->health().ranks_forgotten, 0u);
  expect_no_leak(other, "other");
}

// A context rank that is alive but slow to take an advertisement: the generation rank resends
// it (backed off) and the context rank drops the repeats; both counts reach health() across the
// bridge, each in its own field, and the metrics text. The request completes once taken.
TEST_P(EngineTest, UnansweredAdvertisementIsResentAndCounted) {
  const RequestKey key{77, 0};
  std::vector<std::uint8_t> buf(16 << 10, 0);
  const auto t0 = std::chrono::steady_clock::now();
  advertise(key, buf);
  std::this_thread::sleep_for(800ms);  // resends are due at 200, 600, 1400, 3000 ms...
  const kvlink::Health g = gen_->health();
  const kvlink::Health c = ctx_->health();
  const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(
                          std::chrono::steady_clock::now() - t0).count();
  std::uint64_t due = 0;  // without the back-off one would be due every 200 ms
  while (due < 16 && 200 * ((1ll << (due + 1)) - 1) <= waited + 50) ++due;
  EXPECT_GE(g.resends, 2u);
  EXPECT_LE(g.resends, due) << "resends back off; waited " << waited << " ms";
  EXPECT_EQ(g.duplicates, 0u);
  EXPECT_GE(c.duplicates, 2u);
  EXPECT_EQ(c.resends, 0u);
  EXPECT_EQ(g.unknown_dropped, 0u);
  EXPECT_EQ(c.unknown_dropped, 0u);
  // Nothing came before its request started, and no rank was forgotten (fields of their own).
  EXPECT_EQ(g.early_kept + c.early_kept, 0u);
  EXPECT_EQ(g.ranks_forgotten + c.ranks_forgotten, 0u);
  EXPECT_NE(gen_->metrics_text().find("kvlink_control_resends_total"), std::string::npos);
  auto adv = ctx_->next_advertisement(kvlink::after(5s));
  ASSERT_TRUE(adv);
  EXPECT_EQ(adv->key, key);
  EXPECT_FALSE(ctx_->next_advertisement(kvlink::after(200ms))) << "a repeat was offered again";
  serve_and_check(key, buf, 5);
}

// Regions: registered once, received into by range and sent from, checked with typed errors,
// and taken back only when no transfer uses them.
TEST_P(EngineTest, RequestsMoveBetweenRegisteredRegions) {
  std::vector<std::uint8_t>& region = region_mem_;
  region.assign(256 << 10, 0);
  const kvlink::RegionId r = gen_->register_region(region.data(), region.size());
  const auto expect_kind = [](kvlink::ErrorKind kind, auto&& f, const char* what) {
    try {
      f();
      ADD_FAILURE() << what << ": no error";
    } catch (const kvlink::Error& e) {
      EXPECT_EQ(e.kind(), kind) << what << ": " << e.what();
    }
  };
  expect_kind(kvlink::ErrorKind::InvalidArgument,
              [&] { gen_->register_region(region.data() + 100, 10); }, "an overlapping region");
  expect_kind(kvlink::ErrorKind::OutOfBounds,
              [&] { gen_->region_buffer(r, kvlink::BufferKind::Kv, 0, region.size() - 10, 11); },
              "a buffer past the region's end");
  expect_kind(kvlink::ErrorKind::InvalidArgument,
              [&] { gen_->region_buffer(r + 1000, kvlink::BufferKind::Kv, 0, 0, 1); }, "an unknown region");
  // A buffer that straddles the region's edge is refused before anything is posted.
  expect_kind(kvlink::ErrorKind::OutOfBounds,
              [&] {
                gen_->advertise({7, 0}, {}, kCtx,
                                {{kvlink::BufferKind::Kv, 0, region.data() + region.size() - 8, 16}}, {});
              },
              "a buffer straddling the region's end");
  EXPECT_EQ(gen_->health().buffers_leased, 0u);

  const RequestKey key{8, 0};
  const std::size_t off = 4096, len = 64 << 10;
  const kvlink::Buffer b = gen_->region_buffer(r, kvlink::BufferKind::Kv, 0, off, len);
  EXPECT_EQ(b.data, region.data() + off);
  gen_->advertise(key, {}, kCtx, {b}, {});
  EXPECT_EQ(gen_->region_info(r).transfers, 1u);
  expect_kind(kvlink::ErrorKind::InvalidArgument,
              [&] { gen_->deregister_region(r, kvlink::after(1s)); }, "deregistration while in use");
  // The same refusal, at once, with deadlines at the clock's extremes.
  for (const auto deadline : {kvlink::Clock::time_point::min(), kvlink::Clock::time_point::max()}) {
    const auto t0 = kvlink::Clock::now();
    expect_kind(kvlink::ErrorKind::InvalidArgument, [&] { gen_->deregister_region(r, deadline); },
                "deregistration while in use, extreme deadline");
    EXPECT_LT(kvlink::Clock::now() - t0, 100ms);
  }
  auto adv = ctx_->next_advertisement(kvlink::after(5s));
  ASSERT_TRUE(adv);
  ctx_->accept(key, kGen, true);
  // The context rank sends from a region of its own.
  auto src = pattern(len, 3);
  std::vector<std::uint8_t>& send_region = send_region_mem_;
  send_region.assign(2 * len, 0);
  std::copy(src.begin(), src.end(), send_region.begin() + len);
  const kvlink::RegionId sr = ctx_->register_region(send_region.data(), send_region.size());
  // Data straddling the region's start is refused before anything moves; the request goes on.
  expect_kind(kvlink::ErrorKind::OutOfBounds,
              [&] { ctx_->send(key, kGen, 0, send_region.data() - 8, len, kvlink::after(5s)); },
              "a send straddling a region's edge");
  EXPECT_EQ(ctx_->send(key, kGen, 0, send_region.data() + len, len, kvlink::after(5s)), Outcome::Completed);
  EXPECT_EQ(gen_->wait_receiver(key, kvlink::after(5s)), Outcome::Completed);
  EXPECT_EQ(ctx_->wait_sender(key, kGen, kvlink::after(5s)), Outcome::Completed);
  EXPECT_TRUE(std::equal(src.begin(), src.end(), region.begin() + off));
  const kvlink::RegionInfo info = gen_->region_info(r);
  EXPECT_EQ(info.address, reinterpret_cast<std::uint64_t>(region.data()));
  EXPECT_EQ(info.size, region.size());
  EXPECT_EQ(info.transfers, 0u);
  EXPECT_EQ(info.fenced_bytes, 0u);
  EXPECT_EQ(gen_->health().region_fenced_bytes, 0u);
  EXPECT_TRUE(gen_->region_fenced_ranges(r).empty());
  gen_->deregister_region(r, kvlink::after(1s));
  expect_kind(kvlink::ErrorKind::InvalidArgument, [&] { gen_->region_info(r); }, "a deregistered region");
  EXPECT_EQ(ctx_->region_info(sr).transfers, 0u);
  // Nothing held: a deadline already past still deregisters, at once.
  const auto t0 = kvlink::Clock::now();
  ctx_->deregister_region(sr, kvlink::Clock::time_point::min());
  EXPECT_LT(kvlink::Clock::now() - t0, 100ms);
  expect_kind(kvlink::ErrorKind::InvalidArgument, [&] { ctx_->region_info(sr); }, "a deregistered send region");
}

TEST_P(EngineTest, NothingArrivedIsAnEmptyOptionalAtTheDeadline) {
  const auto t0 = kvlink::Clock::now();
  EXPECT_FALSE(ctx_->next_advertisement(kvlink::after(100ms)));
  EXPECT_FALSE(gen_->wait_for_notification(kCtx, kvlink::after(100ms)));
  const auto took = kvlink::Clock::now() - t0;
  EXPECT_GE(took, 200ms);
  EXPECT_LT(took, 1500ms);
  kvlink::CancelToken cancel;
  cancel.cancel();
  const auto t1 = kvlink::Clock::now();
  EXPECT_FALSE(ctx_->next_advertisement(kvlink::after(5s), cancel));
  EXPECT_LT(kvlink::Clock::now() - t1, 500ms) << "a set cancel flag ends the wait";
}

TEST_P(EngineTest, FaultsThrowWithKinds) {
  std::vector<std::uint8_t> buf(4096);
  try {
    gen_->advertise({1, 0}, {}, 42, {{kvlink::BufferKind::Kv, 0, buf.data(), buf.size()}}, {});
    FAIL() << "advertise to an unconnected rank";
  } catch (const kvlink::Error& e) {
    EXPECT_EQ(e.kind(), kvlink::ErrorKind::UnknownPeer);
  }
  try {
    gen_->advertise({1, 0}, {}, kCtx, {{kvlink::BufferKind::Kv, 0, nullptr, 16}}, {});
    FAIL() << "a null buffer";
  } catch (const kvlink::Error& e) {
    EXPECT_EQ(e.kind(), kvlink::ErrorKind::OutOfBounds);
  }
  try {
    gen_->cancel({999, 0});
    FAIL() << "cancel of an unknown request";
  } catch (const kvlink::Error& e) {
    EXPECT_EQ(e.kind(), kvlink::ErrorKind::UnknownRequest);
  }
  // Waits on keys this rank does not run throw at once, whatever the deadline.
  const auto t0 = kvlink::Clock::now();
  try {
    gen_->wait_receiver({999, 0}, kvlink::Deadline::max());
    FAIL() << "wait on an unknown request";
  } catch (const kvlink::Error& e) {
    EXPECT_EQ(e.kind(), kvlink::ErrorKind::UnknownRequest);
  }
  try {
    const std::uint8_t one = 1;
    ctx_->send({999, 0}, kGen, 0, &one, 1, kvlink::after(5s));
    FAIL() << "send on an unknown request";
  } catch (const kvlink::Error& e) {
    EXPECT_EQ(e.kind(), kvlink::ErrorKind::UnknownRequest);
  }
  try {
    (void)gen_->recv_ready({999, 0}, kvlink::Deadline::max());
    FAIL() << "recv_ready on an unknown request";
  } catch (const kvlink::Error& e) {
    EXPECT_EQ(e.kind(), kvlink::ErrorKind::UnknownRequest);
  }
  EXPECT_LT(kvlink::Clock::now() - t0, 100ms);
}

// The deployment secret through the facade: a rank with another secret (or none) is refused at
// connect with AuthFailed, and the refusing side counts it; the same secret connects.
TEST_P(EngineTest, ASecretKeepsOutThoseWithoutIt) {
  auto guarded = config(GetParam(), 7);
  guarded.secret = std::string("deployment-secret");
  kvlink::Engine door(guarded);
  for (const std::optional<std::string>& s :
       {std::optional<std::string>(""), std::optional<std::string>("wrong")}) {
    auto c = config(GetParam(), 8);
    c.secret = s;
    kvlink::Engine stranger(c);
    try {
      stranger.connect(door.address(), kvlink::after(5s));
      FAIL() << "connected without the secret";
    } catch (const kvlink::Error& e) {
      EXPECT_EQ(e.kind(), kvlink::ErrorKind::AuthFailed) << e.what();
    }
    const auto h = stranger.health();
    const auto d = door.health();
    EXPECT_EQ(h.refused_auth + h.refused_by_peer + d.refused_auth + d.refused_by_peer >= 1, true);
    EXPECT_EQ(h.peers, 0u);
  }
  auto c = config(GetParam(), 9);
  c.secret = std::string("deployment-secret");
  kvlink::Engine member(c);
  EXPECT_EQ(member.connect(door.address(), kvlink::after(5s)), 7u);
  door.wait_peer(9, kvlink::after(5s));
  EXPECT_EQ(door.peer_state(9), kvlink::PeerState::Connected);
}

// The deadline rule at the clock's extremes: min() does not overflow and means "do not wait";
// max() waits until the request's own deadline at most. The sender learns that deadline.
TEST_P(EngineTest, DeadlinesAtTheClockExtremes) {
  EXPECT_EQ(gen_->peer_state(kCtx), kvlink::PeerState::Connected);
  EXPECT_EQ(gen_->peer_state(77), kvlink::PeerState::Unknown);
  auto t0 = kvlink::Clock::now();
  EXPECT_FALSE(ctx_->next_advertisement(kvlink::Deadline::min()));
  EXPECT_FALSE(gen_->wait_for_notification(kCtx, kvlink::Deadline::min()));
  EXPECT_LT(kvlink::Clock::now() - t0, 50ms);
  // A request with its own 300 ms deadline whose sender never sends: wait(max()) ends with it.
  const RequestKey key{4242, 0};
  std::vector<std::uint8_t> buf(4096);
  gen_->advertise(key, {}, kCtx, {{kvlink::BufferKind::Kv, 0, buf.data(), buf.size()}}, {}, 300ms);
  auto adv = ctx_->next_advertisement(kvlink::after(5s));
  ASSERT_TRUE(adv);
  EXPECT_LE(adv->deadline, kvlink::after(300ms));
  EXPECT_GT(adv->deadline, kvlink::after(150ms));
  t0 = kvlink::Clock::now();
  EXPECT_EQ(gen_->wait_receiver(key, kvlink::Deadline::max()), Outcome::TimedOut);
  const auto took = kvlink::Clock::now() - t0;
  EXPECT_LT(took, 300ms + 150ms);
  EXPECT_EQ(ctx_->wait_sender(key, kGen, kvlink::Deadline::max()), Outcome::TimedOut);
  // A past deadline gives a request up at once.
  const RequestKey key2{4243, 0};
  gen_->advertise(key2, {}, kCtx, {{kvlink::BufferKind::Kv, 0, buf.data(), buf.size()}}, {});
  t0 = kvlink::Clock::now();
  EXPECT_EQ(gen_->wait_receiver(key2, kvlink::Deadline::min()), Outcome::TimedOut);
  EXPECT_LT(kvlink::Clock::now() - t0, 150ms);
  ASSERT_TRUE(ctx_->next_advertisement(kvlink::after(5s)));
  EXPECT_EQ(ctx_->wait_sender(key2, kGen, kvlink::after(5s)), Outcome::TimedOut);
}

// TensorRT-LLM's data tag keeps 12 bits of the request id: 5 and 5 + 4096 share a tag there.
// kvlink keys on all 64 bits: two such requests in flight at once each get their own bytes.
TEST_P(EngineTest, IdsFourThousandNinetySixApartNeverCross) {
  const RequestKey a{5, 0}, b{5 + 4096, 0};
  std::vector<std::uint8_t> ba(8192, 0), bb(8192, 0);
  advertise(a, ba);
  advertise(b, bb);
  std::vector<kvlink::Advertisement> advs;
  for (int i = 0; i < 2; ++i) {
    auto adv = ctx_->next_advertisement(kvlink::after(5s));
    ASSERT_TRUE(adv);
    ctx_->accept(adv->key, kGen, true);
    advs.push_back(*adv);
  }
  const auto sa = pattern(8192, 0xA), sb = pattern(8192, 0xB);
  // Send b's data first, then a's: order must not matter.
  EXPECT_EQ(ctx_->send(b, kGen, 0, sb.data(), sb.size(), kvlink::after(5s)), Outcome::Completed);
  EXPECT_EQ(ctx_->send(a, kGen, 0, sa.data(), sa.size(), kvlink::after(5s)), Outcome::Completed);
  EXPECT_EQ(gen_->wait_receiver(a, kvlink::after(5s)), Outcome::Completed);
  EXPECT_EQ(gen_->wait_receiver(b, kvlink::after(5s)), Outcome::Completed);
  EXPECT_EQ(ba, sa);
  EXPECT_EQ(bb, sb);
  EXPECT_EQ(ctx_->wait_sender(a, kGen, kvlink::after(5s)), Outcome::Completed);
  EXPECT_EQ(ctx_->wait_sender(b, kGen, kvlink::after(5s)), Outcome::Completed);
}

// The replay half of TensorRT-LLM's CacheSenderRejectsStandaloneFinalizedReplay, on the engine:
// a key that ended (here: cancelled) cannot be advertised again while the engine remembers it.
TEST_P(EngineTest, CancelledKeyCannotBeAdvertisedAgain) {
  const RequestKey key{31, 0};
  std::vector<std::uint8_t> buf(4096, 0);
  advertise(key, buf);
  auto adv = ctx_->next_advertisement(kvlink::after(5s));
  ASSERT_TRUE(adv);
  ctx_->accept(key, kGen, true);
  gen_->cancel(key);
  EXPECT_EQ(gen_->wait_receiver(key, kvlink::after(5s)), Outcome::Cancelled);
  EXPECT_EQ(ctx_->wait_sender(key, kGen, kvlink::after(5s)), Outcome::Cancelled);
  try {
    advertise(key, buf);
    FAIL() << "a replay of a cancelled key was accepted";
  } catch (const kvlink::Error& e) {
    EXPECT_EQ(e.kind(), kvlink::ErrorKind::InvalidArgument) << e.what();
  }
  EXPECT_FALSE(ctx_->next_advertisement(kvlink::after(200ms))) << "the replay reached the context rank";
  // The next attempt (generation + 1) is a different key and is served.
  const RequestKey retry{31, 1};
  advertise(retry, buf);
  adv = ctx_->next_advertisement(kvlink::after(5s));
  ASSERT_TRUE(adv);
  EXPECT_EQ(adv->key, retry);
  ctx_->accept(retry, kGen, true);
  const auto src = pattern(buf.size(), 31);
  EXPECT_EQ(ctx_->send(retry, kGen, 0, src.data(), src.size(), kvlink::after(5s)), Outcome::Completed);
  EXPECT_EQ(gen_->wait_receiver(retry, kvlink::after(5s)), Outcome::Completed);
  EXPECT_EQ(buf, src);
}

/// Runs a request of `segments` x `segment_size` bytes; sets `cancel` (watched by the sender's
/// sends) once `cancel_after` bytes have landed; returns how long after that each side ended.
struct CancelRun {
  Outcome sender, receiver;
  long sender_ms, receiver_ms;
  bool cancelled_mid;
};

CancelRun cancel_mid_transfer(kvlink::Engine& ctx, kvlink::Engine& gen, RequestKey key, std::size_t segments,
                              std::size_t segment_size, std::uint64_t cancel_after) {
  std::vector<std::vector<std::uint8_t>> bufs(segments, std::vector<std::uint8_t>(segment_size, 0));
  std::vector<kvlink::Buffer> specs;
  for (std::size_t i = 0; i < segments; ++i) {
    specs.push_back({kvlink::BufferKind::Kv, static_cast<std::uint32_t>(i), bufs[i].data(), segment_size});
  }
  gen.advertise(key, {}, kCtx, specs, {});
  auto adv = ctx.next_advertisement(kvlink::after(5s));
  EXPECT_TRUE(adv);
  ctx.accept(key, kGen, true);
  const std::vector<std::uint8_t> src(segment_size, 0x5A);
  kvlink::CancelToken token;
  std::atomic<kvlink::Clock::time_point::rep> sender_end{0}, receiver_end{0};
  Outcome so = Outcome::Completed, ro = Outcome::Completed;
  std::thread s([&] {
    for (std::size_t i = 0; i < segments && so == Outcome::Completed; ++i) {
      so = ctx.send(key, kGen, static_cast<std::uint32_t>(i), src.data(), src.size(), kvlink::after(10s), token);
    }
    so = ctx.wait_sender(key, kGen, kvlink::after(10s));
    sender_end = kvlink::Clock::now().time_since_epoch().count();
  });
  std::thread r([&] {
    ro = gen.wait_receiver(key, kvlink::after(10s));
    receiver_end = kvlink::Clock::now().time_since_epoch().count();
  });
  const std::uint64_t base = gen.health().bytes_completed;
  eventually([&] { return gen.health().bytes_completed - base >= cancel_after; }, 10s);
  const bool mid = receiver_end.load() == 0;
  const auto t0 = kvlink::Clock::now();
  token.cancel();
  s.join();
  r.join();
  auto ms = [&](kvlink::Clock::time_point::rep end) {
    return static_cast<long>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                 kvlink::Clock::time_point(kvlink::Clock::duration(end)) - t0)
                                 .count());
  };
  return {so, ro, ms(sender_end), ms(receiver_end), mid};
}

// Not in TensorRT-LLM: a cancel flag set while a KV cache (64 segments of 4 MiB) is on the wire
// ends both sides within 50 ms with the same verdict: Cancelled. (A segment the sender stops is
// drained at the receiver; the engine reads that as the sender's cancel, not as a lost peer.)
TEST_P(EngineTest, CancelFlagMidTransferEndsBothSidesWithin50ms) {
  const auto run = cancel_mid_transfer(*ctx_, *gen_, {600, 0}, 64, 4u << 20, 32u << 20);
  ASSERT_TRUE(run.cancelled_mid) << "the transfer finished before the flag was set";
  EXPECT_EQ(run.sender, run.receiver) << "split verdict: sender " << kvlink::to_string(run.sender)
                                      << ", receiver " << kvlink::to_string(run.receiver);
  EXPECT_EQ(run.receiver, Outcome::Cancelled) << kvlink::to_string(run.receiver);
  EXPECT_LE(run.sender_ms, 50) << "sender ended " << run.sender_ms << " ms after the flag";
  EXPECT_LE(run.receiver_ms, 50) << "receiver ended " << run.receiver_ms << " ms after the flag";
}

// One 512 MiB segment: bytes already on the wire cannot be recalled (UCX cannot cancel a
// rendezvous transfer once it is matched), and the sender's vote queues behind them on the same
// stream. The sender does not wait for them: after the drain grace (50 ms) it cuts the
// endpoint (the pair reconnects), so the flag ends its wait within about that. The receiver sees its peer's endpoint close: it ends PeerLost, or
// Cancelled when the vote got through first. Neither may end Completed, both are bounded.
TEST_P(EngineTest, CancelFlagMidOneHugeSegmentEndsBothSidesBounded) {
  const auto run = cancel_mid_transfer(*ctx_, *gen_, {601, 0}, 1, 512u << 20, 0);
  std::printf("[ one 512 MiB segment: sender %s after %ld ms, receiver %s after %ld ms ]\n",
              kvlink::to_string(run.sender), run.sender_ms, kvlink::to_string(run.receiver),
              run.receiver_ms);
  if (!run.cancelled_mid) GTEST_SKIP() << "the transfer finished before the flag was set";
  EXPECT_EQ(run.sender, Outcome::Cancelled);
  EXPECT_TRUE(run.receiver == Outcome::Cancelled || run.receiver == Outcome::PeerLost)
      << kvlink::to_string(run.receiver);
  EXPECT_LE(run.sender_ms, 100);
  // Shared memory finds the closed endpoint by keepalive (1 s).
  EXPECT_LE(run.receiver_ms, 1500);
}

// Two context ranks fill one request of one generation rank (advertise_flows): each sees only
// its own buffers, both bytes ranges land, and all three ranks agree on Completed.
TEST_P(EngineTest, TwoContextRanksFillOneRequest) {
  kvlink::Engine ctx2(config(GetParam(), 2));
  ASSERT_EQ(gen_->connect(ctx2.address(), kvlink::after(5s)), 2u);
  ctx2.wait_peer(kGen, kvlink::after(5s));
  const RequestKey key{77, 0};
  std::vector<std::uint8_t> a(256 << 10, 0), b(256 << 10, 0);
  gen_->advertise_flows(key, {}, {kCtx, 2},
                        {{kvlink::BufferKind::Kv, 0, a.data(), a.size()},
                         {kvlink::BufferKind::Kv, 1, b.data(), b.size()}},
                        {});
  const auto pa = pattern(a.size(), 3), pb = pattern(b.size(), 4);
  for (auto [engine, segment, src] : {std::tuple{&*ctx_, 0u, &pa}, std::tuple{&ctx2, 1u, &pb}}) {
    auto adv = engine->next_advertisement(kvlink::after(5s));
    ASSERT_TRUE(adv);
    ASSERT_EQ(adv->buffers.size(), 1u) << "a context rank sees only its own buffers";
    EXPECT_EQ(adv->buffers[0].segment, segment);
    engine->accept(key, kGen, true);
    EXPECT_EQ(engine->send(key, kGen, segment, src->data(), src->size(), kvlink::after(5s)),
              Outcome::Completed);
  }
  EXPECT_EQ(gen_->wait_receiver(key, kvlink::after(5s)), Outcome::Completed);
  EXPECT_EQ(ctx_->wait_sender(key, kGen, kvlink::after(5s)), Outcome::Completed);
  EXPECT_EQ(ctx2.wait_sender(key, kGen, kvlink::after(5s)), Outcome::Completed);
  EXPECT_EQ(a, pa);
  EXPECT_EQ(b, pb);
  try {
    gen_->advertise_flows(key, {}, {kCtx}, {}, {});
    FAIL() << "mismatched senders and buffers were accepted";
  } catch (const kvlink::Error& e) {
    EXPECT_EQ(e.kind(), kvlink::ErrorKind::InvalidArgument);
  }
  expect_no_leak(ctx2, "ctx2");
}

INSTANTIATE_TEST_SUITE_P(Transports, EngineTest, testing::ValuesIn(transports()), param_name);

// Any UCX transport: UCX's own choice, explicit lists (network, shared memory only) and a list
// with a network device. One round trip each, every byte checked.
class AnyTransportTest : public EngineTest {};

TEST_P(AnyTransportTest, RoundTripMovesEveryByte) {
  const RequestKey key{77, 0};
  std::vector<std::uint8_t> buf(1 << 20, 0);
  advertise(key, buf);
  auto adv = ctx_->next_advertisement(kvlink::after(5s));
  ASSERT_TRUE(adv);
  serve_and_check(key, buf, 5);
}

INSTANTIATE_TEST_SUITE_P(Ucx, AnyTransportTest, testing::Values("auto", "tcp,self", "posix,sysv,self", "tcp@lo"),
                         param_name);

TEST_P(AnyTransportTest, DevicePathIsStagedWithoutACudaDriver) {
  // What UCX reports decides it; without libcuda no UCX can support CUDA memory.
  if (void* cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL)) {
    dlclose(cuda);
    GTEST_SKIP() << "a CUDA driver is present: the path is whatever this UCX reports";
  }
  EXPECT_EQ(ctx_->device_path(), kvlink::DevicePath::Staged);
  EXPECT_EQ(gen_->device_path(), kvlink::DevicePath::Staged);
}

TEST(TransportSetting, ABadNameOrDeviceIsInvalidArgumentNamingIt) {
  for (const auto& [setting, named] : std::vector<std::pair<std::string, std::string>>{
           {"tcp,tpc", "'tpc'"}, {"tcp@nosuchdev0", "'nosuchdev0'"}, {"auto@lo,eth9z", "'eth9z'"}}) {
    auto c = config("tcp", 9);
    c.transport = setting;
    try {
      kvlink::Engine e(c);
      ADD_FAILURE() << setting << " was accepted";
    } catch (const kvlink::Error& e) {
      EXPECT_EQ(e.kind(), kvlink::ErrorKind::InvalidArgument) << setting;
      EXPECT_NE(std::string(e.what()).find(named), std::string::npos) << setting << ": " << e.what();
    }
  }
}

}  // namespace

// `kvlink::after(d)` is the documented way to make a Deadline, and the header
// promises that `max()`-like deadlines are fine. A duration too long for the clock's nanoseconds
// (milliseconds::max(), 300 years) must give a far-future deadline, not a wrapped one in the
// past that makes every wait return at once; a hugely negative one must give a past deadline.
TEST_P(EngineTest, AfterOfAHugeDurationSaturates) {
  const auto now = kvlink::Clock::now();
  EXPECT_GT(kvlink::after(std::chrono::milliseconds::max()), now);
  EXPECT_GT(kvlink::after(std::chrono::hours(24 * 365 * 300)), now);
  EXPECT_GT(kvlink::after(kvlink::Clock::duration::max()), now);
  EXPECT_LT(kvlink::after(-std::chrono::milliseconds::max()), now);
  EXPECT_LT(kvlink::after(kvlink::Clock::duration::min()), now);
  // A duration whose ticks alone are below the integer's range while now + it is not (the
  // clock is past its epoch): the point itself, 145 ms below min() + now, not a conversion of
  // an out-of-range value (undefined; on x86 it gave min() + now).
  const auto far_back = kvlink::after(std::chrono::seconds(-9'223'372'037));
  EXPECT_LT(far_back, kvlink::Deadline::min() + kvlink::Clock::now().time_since_epoch() - 100ms);
  // A unit whose ratio to nanoseconds has a denominator: 10^12 samples at 44.1 kHz are 262 days
  // (duration_cast's count * 10^7 overflowed before its / 441, a deadline 222 days back).
  using Samples = std::chrono::duration<std::int64_t, std::ratio<1, 44100>>;
  const auto samples_at = kvlink::after(Samples(1'000'000'000'000));
  EXPECT_GT(samples_at, now + std::chrono::hours(24 * 262));
  EXPECT_LT(samples_at, kvlink::Clock::now() + std::chrono::hours(24 * 263));
  // Floating-point durations: infinity saturates; NaN means no time (it was converted to an
  // integer, which is undefined: on x86 a deadline centuries in the past).
  EXPECT_EQ(kvlink::after(std::chrono::duration<double>(HUGE_VAL)), kvlink::Deadline::max());
  EXPECT_EQ(kvlink::after(std::chrono::duration<double>(-HUGE_VAL)), kvlink::Deadline::min());
  const auto nan_at = kvlink::after(std::chrono::duration<double>(std::nan("")));
  EXPECT_GE(nan_at, now);
  EXPECT_LE(nan_at, kvlink::Clock::now());
  // A notification sent 200 ms from now arrives within a wait whose deadline is after(max()).
  std::thread later([&] {
    std::this_thread::sleep_for(200ms);
    ctx_->notify(kGen, {77, 0}, {1, 2, 3});
  });
  const auto n = gen_->wait_for_notification(kCtx, kvlink::after(std::chrono::milliseconds::max()));
  later.join();
  ASSERT_TRUE(n) << "after(milliseconds::max()) was a deadline in the past";
  EXPECT_EQ(n->key.request, 77u);
}

// A send whose size cannot be a buffer (SIZE_MAX) is a typed error, not an
// abort in Rust's slice::from_raw_parts precondition (debug) or undefined behaviour (release).
TEST_P(EngineTest, SendOfAnImpossibleSizeIsATypedError) {
  const std::uint8_t byte = 1;
  for (const std::size_t size : {SIZE_MAX, SIZE_MAX / 2 + 1}) {
    try {
      ctx_->send({999, 0}, kGen, 0, &byte, size, kvlink::after(1s));
      FAIL() << "send of " << size << " bytes";
    } catch (const kvlink::Error& e) {
      EXPECT_EQ(e.kind(), kvlink::ErrorKind::InvalidArgument) << e.what();
    }
  }
  // A range that wraps the address space.
  try {
    ctx_->send({999, 0}, kGen, 0, reinterpret_cast<const void*>(UINTPTR_MAX - 15), 64, kvlink::after(1s));
    FAIL() << "send of a range that wraps the address space";
  } catch (const kvlink::Error& e) {
    EXPECT_TRUE(e.kind() == kvlink::ErrorKind::InvalidArgument || e.kind() == kvlink::ErrorKind::OutOfBounds)
        << e.what();
  }
  // The same from device memory: the caller's mistake, said before any request or CUDA check
  // (it was a Cuda error from the driver, or the request's own error first).
  try {
    ctx_->send_device({999, 0}, kGen, 0, 0, UINT64_MAX - 15, 64, kvlink::after(1s));
    FAIL() << "send_device of a range that wraps the address space";
  } catch (const kvlink::Error& e) {
    EXPECT_EQ(e.kind(), kvlink::ErrorKind::InvalidArgument) << e.what();
  }
}

// A deadline in a coarser unit (a `steady_clock` time point in seconds or hours, which converts
// to `Deadline` implicitly) is a deadline too, `max()` included: its conversion to nanoseconds
// overflows (seconds::max() * 10^9 wraps to one second before the clock's epoch), which made
// every wait "already past" and return at once.
TEST_P(EngineTest, ACoarseDeadlineMaxWaitsInsteadOfWrappingIntoThePast) {
  using Secs = std::chrono::time_point<kvlink::Clock, std::chrono::seconds>;
  using Hours = std::chrono::time_point<kvlink::Clock, std::chrono::hours>;
  std::uint64_t request = 500;
  const auto waits_for_a_late_notification = [&](auto deadline, const char* what) {
    const RequestKey key{request++, 0};
    std::thread later([&] {
      std::this_thread::sleep_for(200ms);
      ctx_->notify(kGen, key, {1});
    });
    const auto n = gen_->wait_for_notification(kCtx, deadline);
    later.join();
    ASSERT_TRUE(n) << what << " was taken for a deadline in the past";
    EXPECT_EQ(n->key, key) << what;
  };
  waits_for_a_late_notification(Secs::max(), "time_point<steady_clock, seconds>::max()");
  waits_for_a_late_notification(Hours::max(), "time_point<steady_clock, hours>::max()");
  // Still "do not wait" at the other end, and an ordinary coarse deadline is what it says.
  const auto t0 = kvlink::Clock::now();
  EXPECT_FALSE(gen_->wait_for_notification(kCtx, Secs::min()));
  EXPECT_FALSE(gen_->wait_for_notification(kCtx, Hours::min()));
  EXPECT_LT(kvlink::Clock::now() - t0, 100ms);
  using FloatSecs = std::chrono::time_point<kvlink::Clock, std::chrono::duration<double>>;
  const auto t1 = kvlink::Clock::now();
  EXPECT_FALSE(gen_->wait_for_notification(kCtx, FloatSecs(t1.time_since_epoch()) + std::chrono::duration<double>(0.15)));
  EXPECT_GE(kvlink::Clock::now() - t1, 150ms);
  EXPECT_LT(kvlink::Clock::now() - t1, 1s);
}

// A moved-from Engine holds no Rust engine (its rust::Box is null): a call on it must be a
// typed error, not a null `&EngineHandle` handed to Rust (a crash, or undefined behaviour).
TEST(EngineMove, AMovedFromEngineThrowsShutdownInsteadOfCrashing) {
  kvlink::Engine a(config("tcp", 31));
  const std::string address = a.address();
  kvlink::Engine b(std::move(a));
  EXPECT_EQ(b.address(), address) << "the move keeps the engine";
  const auto expect_shutdown = [](const std::function<void()>& f, const char* what) {
    try {
      f();
      ADD_FAILURE() << what << " on a moved-from engine did not throw";
    } catch (const kvlink::Error& e) {
      EXPECT_EQ(e.kind(), kvlink::ErrorKind::Shutdown) << what << ": " << e.what();
    }
  };
  expect_shutdown([&] { (void)a.address(); }, "address");
  expect_shutdown([&] { (void)a.rank(); }, "rank");
  expect_shutdown([&] { (void)a.health(); }, "health");
  expect_shutdown([&] { (void)a.wait_receiver({1, 0}, kvlink::after(10ms)); }, "wait_receiver");
  expect_shutdown([&] { (void)a.device_path(); }, "device_path");
  // Assigned a live engine again, it works; a moved-from one assigned away is harmless.
  a = std::move(b);
  EXPECT_EQ(a.address(), address);
  expect_shutdown([&] { (void)b.metrics_text(); }, "metrics_text");
}

// `advertise`'s own timeout in a coarser unit: seconds::max() is "as long as allowed" (a year),
// not wrapped through milliseconds into a negative count and taken for "none given" (the
// engine's 5 s here).
TEST_P(EngineTest, AnAdvertiseTimeoutOfSecondsMaxIsLongNotTheDefault) {
  const RequestKey key{6100, 0};
  std::vector<std::uint8_t> buf(64);
  gen_->advertise(key, {}, kCtx, {{kvlink::BufferKind::Kv, 0, buf.data(), buf.size()}}, {},
                  std::chrono::seconds::max());
  auto adv = ctx_->next_advertisement(kvlink::after(5s));
  ASSERT_TRUE(adv);
  EXPECT_GT(adv->deadline, kvlink::after(std::chrono::hours(24)))
      << "the request got the engine's default timeout, not a long one";
  gen_->cancel(key);
  EXPECT_EQ(gen_->wait_receiver(key, kvlink::after(5s)), Outcome::Cancelled);
  EXPECT_EQ(ctx_->wait_sender(key, kGen, kvlink::after(5s)), Outcome::Cancelled);
}

// A notification to a rank whose connection failed is `PeerLost` (its endpoint failed: "every
// later operation on it fails the same way"), as an advertise to it is; `UnknownPeer` is for a
// rank never connected. It was `UnknownPeer` for both, so a caller switching on the kind took a
// lost peer for a wrong rank number.
TEST(EngineNotify, ANotifyToALostPeerIsPeerLostAndToAStrangerUnknownPeer) {
  kvlink::Engine gen(config("tcp", 41));
  std::optional<kvlink::Engine> ctx(std::in_place, config("tcp", 40));
  ASSERT_EQ(gen.connect(ctx->address(), kvlink::after(5s)), 40u);
  ctx->wait_peer(41, kvlink::after(5s));
  gen.notify(40, {1, 0}, {1});
  ctx.reset();
  ASSERT_TRUE(eventually([&] { return gen.peer_state(40) != kvlink::PeerState::Connected; }, 5000ms));
  const auto kind_of = [&](std::uint32_t rank) {
    try {
      gen.notify(rank, {2, 0}, {2});
    } catch (const kvlink::Error& e) {
      return e.kind();
    }
    ADD_FAILURE() << "notify to rank " << rank << " did not throw";
    return kvlink::ErrorKind::Internal;
  };
  EXPECT_EQ(kind_of(40), kvlink::ErrorKind::PeerLost) << "state " << static_cast<int>(gen.peer_state(40));
  EXPECT_EQ(kind_of(77), kvlink::ErrorKind::UnknownPeer);
}
