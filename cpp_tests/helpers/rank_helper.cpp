// One rank in its own process, for the multi-process tests (test_multiprocess.cpp spawns it).
// Protocol on stdout/stdin, one line each: the helper prints `ADDR <address>`; the test answers
// `PEERS <addr of rank 0> <addr of rank 1> ...`; the helper then plays its role and prints
// results (`VERDICT <outcome>`, ...). Every wait is bounded; a helper never outlives ~20 s.
//
//   rank_helper slow-sender <transport> <rank 0>         context rank: serves one request of
//       several segments, pausing 100 ms after each and printing `SENT <i>` (to be killed).
//   rank_helper group <transport> <rank> <timeout_ms> <suppress: request id or -1>
//       one of four ranks 0..3 (0,2 context; 1,3 generation, 1 pairs with 0, 3 with 2): request
//       77 is received by ranks 1 and 3 together, which agree on one verdict.
#include <kvlink/kvlink.hpp>

#include <chrono>
#include <cstdio>
#include <iostream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

using namespace std::chrono_literals;

namespace {

std::vector<std::string> read_peers() {
  std::string line;
  if (!std::getline(std::cin, line)) throw std::runtime_error("no PEERS line");
  std::istringstream is(line);
  std::string word;
  is >> word;
  std::vector<std::string> out;
  while (is >> word) out.push_back(word);
  return out;
}

void say(const std::string& s) {
  std::cout << s << std::endl;  // flushes: the test reads line by line
}

int slow_sender(const std::string& transport) {
  kvlink::EngineConfig c;
  c.name = "slow-sender";
  c.rank = 0;
  c.transport = transport;
  c.listen = transport == "tcp" ? "127.0.0.1:0" : "";
  c.timeout = 10s;
  kvlink::Engine e(c);
  say("ADDR " + e.address());
  read_peers();
  auto adv = e.next_advertisement(kvlink::after(10s));
  if (!adv) return 2;
  e.accept(adv->key, adv->from_rank, true);
  for (const auto& b : adv->buffers) {
    std::vector<std::uint8_t> data(b.size, static_cast<std::uint8_t>(b.segment + 1));
    auto o = e.send(adv->key, adv->from_rank, b.segment, data.data(), data.size(), kvlink::after(10s));
    say("SENT " + std::to_string(b.segment) + " " + kvlink::to_string(o));
    std::this_thread::sleep_for(100ms);
  }
  say("DONE");
  return 0;
}

int group(const std::string& transport, std::uint32_t rank, long timeout_ms, long long suppress) {
  constexpr std::uint64_t kRequest = 77;
  constexpr std::size_t kSize = 1 << 20;
  kvlink::EngineConfig c;
  c.name = "rank" + std::to_string(rank);
  c.rank = rank;
  c.transport = transport;
  c.listen = transport == "tcp" ? "127.0.0.1:0" : "";
  c.timeout = std::chrono::milliseconds(timeout_ms);
  c.agreement_bound = 1000ms;
  if (suppress >= 0) c.fault_suppress_request = static_cast<std::uint64_t>(suppress);
  kvlink::Engine e(c);
  say("ADDR " + e.address());
  const auto peers = read_peers();
  const kvlink::RequestKey key{kRequest, 0};
  const bool generation = rank % 2 == 1;
  if (generation) {
    const std::uint32_t sender = rank - 1;
    e.connect(peers.at(sender), kvlink::after(5s));
    if (rank == 3) e.connect(peers.at(1), kvlink::after(5s));
    else e.wait_peer(3, kvlink::after(5s));
    std::vector<std::uint8_t> buf(kSize, 0);
    const auto advertised = kvlink::Clock::now();
    e.advertise(key, {1, 3}, sender, {{kvlink::BufferKind::Kv, 0, buf.data(), buf.size()}}, {});
    // Acceptance is proved by the first landing: a rank whose data never comes has no answer.
    auto ready = e.recv_ready(key, kvlink::after(300ms));
    say(std::string("READY ") + (ready ? (*ready ? "yes" : "no") : "none"));
    // Wait for this rank's own data to land (or give up at the request deadline) and look at
    // the lease: it must be held until every rank has agreed.
    const auto until = advertised + std::chrono::milliseconds(timeout_ms - 200);
    while (e.health().bytes_completed < kSize && kvlink::Clock::now() < until) std::this_thread::sleep_for(5ms);
    const auto h = e.health();
    say("LANDED " + std::to_string(h.bytes_completed >= kSize) + " LEASED " + std::to_string(h.buffers_leased));
    const auto t0 = kvlink::Clock::now();
    const auto o = e.wait_receiver(key, kvlink::after(std::chrono::milliseconds(timeout_ms) + 3s));
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(kvlink::Clock::now() - t0).count();
    auto after = e.health();
    for (int i = 0; i < 200 && after.buffers_leased != 0; ++i) {
      std::this_thread::sleep_for(5ms);
      after = e.health();
    }
    say(std::string("VERDICT ") + kvlink::to_string(o) + " WAITED_MS " + std::to_string(ms) + " LEASED " +
        std::to_string(after.buffers_leased));
  } else {
    const std::uint32_t receiver = rank + 1;
    e.wait_peer(receiver, kvlink::after(5s));
    auto adv = e.next_advertisement(kvlink::after(5s));
    if (!adv) {
      say("VERDICT none");
      return 2;
    }
    e.accept(adv->key, adv->from_rank, true);
    std::vector<std::uint8_t> data(adv->buffers.at(0).size, static_cast<std::uint8_t>(rank + 10));
    const auto s = e.send(adv->key, adv->from_rank, 0, data.data(), data.size(), kvlink::after(5s));
    say(std::string("SENT ") + kvlink::to_string(s));
    const auto o = e.wait_sender(adv->key, adv->from_rank, kvlink::after(std::chrono::milliseconds(timeout_ms) + 3s));
    say(std::string("VERDICT ") + kvlink::to_string(o));
  }
  // Keep serving the agreement (retransmits, Quiesced) for a moment before the engine goes.
  std::this_thread::sleep_for(300ms);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const std::vector<std::string> a(argv, argv + argc);
    if (a.size() >= 3 && a[1] == "slow-sender") return slow_sender(a[2]);
    if (a.size() >= 6 && a[1] == "group") {
      return group(a[2], static_cast<std::uint32_t>(std::stoul(a[3])), std::stol(a[4]), std::stoll(a[5]));
    }
    std::cerr << "usage: see the top of rank_helper.cpp\n";
    return 64;
  } catch (const std::exception& e) {
    std::cout << "ERROR " << e.what() << std::endl;
    return 1;
  }
}
