// Shared pieces of the engine and adapter tests.
#pragma once

#include <kvlink/kvlink.hpp>

#include <gtest/gtest.h>

#include <cctype>
#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <thread>
#include <vector>

namespace kvtest {

using namespace std::chrono_literals;

/// The transports every suite runs over.
inline std::vector<std::string> transports() { return {"tcp", "sm"}; }

/// Whether ranks on `transport` are reached by worker address (no listener): shared memory,
/// and a transport list without tcp in it.
inline bool by_worker_address(const std::string& transport) {
  return transport == "sm" || (transport != "auto" && transport.find("tcp") == std::string::npos);
}

inline kvlink::EngineConfig config(const std::string& transport, std::uint32_t rank, std::chrono::milliseconds timeout = 5000ms) {
  kvlink::EngineConfig c;
  c.name = "rank" + std::to_string(rank);
  c.rank = rank;
  c.transport = transport;
  c.listen = by_worker_address(transport) ? "" : "127.0.0.1:0";
  c.timeout = timeout;
  c.agreement_bound = 500ms;
  return c;
}

/// A byte pattern that differs per seed and per position.
inline std::vector<std::uint8_t> pattern(std::size_t n, std::uint32_t seed) {
  std::vector<std::uint8_t> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<std::uint8_t>((i * 131u + seed * 7919u + (i >> 8)) & 0xFF);
  return v;
}

/// Polls `pred` until true or `limit`; returns the last value.
inline bool eventually(const std::function<bool()>& pred, std::chrono::milliseconds limit = 2000ms) {
  const auto end = std::chrono::steady_clock::now() + limit;
  while (!pred()) {
    if (std::chrono::steady_clock::now() >= end) return pred();
    std::this_thread::sleep_for(5ms);
  }
  return true;
}

/// No receive buffer leased and no transport op left once things settle.
inline void expect_no_leak(const kvlink::Engine& e, const char* who) {
  EXPECT_TRUE(eventually([&] { return e.health().buffers_leased == 0; })) << who << ": buffers still leased";
  EXPECT_TRUE(eventually([&] { return e.health().ops_in_flight == 0; })) << who << ": ops still in flight";
}

/// The parameter as a test name: `tcp,self` -> `tcp_self`, `tcp@lo` -> `tcp_lo`.
inline std::string param_name(const testing::TestParamInfo<std::string>& i) {
  std::string n = i.param;
  for (char& ch : n) {
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  }
  return n;
}

}  // namespace kvtest
