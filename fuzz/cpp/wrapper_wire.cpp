// libFuzzer target `wrapper_wire`: the decoder of the request info a peer's advertisement carries
// to the TensorRT-LLM wrapper (wrapper/kvlink_trtllm_wire.hpp), the one part of the wrapper that
// reads bytes a peer chose. Built and run by scripts/fuzz.sh with
// clang++ -fsanitize=fuzzer,address,undefined; seeded from fuzz/cpp/wrapper_wire_seeds/
// (valid envelopes and data headers as the wrapper encodes them, written by
// wrapper_wire_seeds.cpp, and any regression inputs).
//
// On every input:
// 1. decode never reads out of bounds (AddressSanitizer), never overflows (UBSan), and what it
//    accepts is canonical: it re-encodes to the very same bytes, within the limits decode
//    promises (kind 1 or 2, at most 16 messages).
// 2. Round trip: a header built from the input (any kind, tag, generation, closes and up to 20
//    messages) encodes to bytes that decode to the very same header when it has at most 16
//    messages, and that decode refuses when it has more.
#include "kvlink_trtllm_wire.hpp"

#include <fuzzer/FuzzedDataProvider.h>

#include <cstdio>
#include <cstdlib>

namespace wire = kvlink::trtllm::wire;

namespace {

[[noreturn]] void fail(char const* what) {
  std::fprintf(stderr, "wrapper_wire: %s\n", what);
  std::abort();
}

bool same(wire::Header const& a, wire::Header const& b) {
  if (a.kind != b.kind || a.tag != b.tag || a.envelopeGeneration != b.envelopeGeneration || a.closes != b.closes ||
      a.messages.size() != b.messages.size()) {
    return false;
  }
  for (size_t i = 0; i < a.messages.size(); ++i) {
    if (a.messages[i].tag != b.messages[i].tag || a.messages[i].bytes != b.messages[i].bytes) return false;
  }
  return true;
}

void checkDecode(std::vector<std::uint8_t> const& in) {
  std::optional<wire::Header> const h = wire::decode(in);
  if (!h) return;
  if (h->kind != wire::Kind::Envelope && h->kind != wire::Kind::Data) fail("decoded a kind that is neither 1 nor 2");
  if (h->messages.size() > 16) fail("decoded more than 16 messages");
  if (wire::encode(*h) != in) fail("what decodes does not re-encode to the same bytes");
}

void checkRoundTrip(std::uint8_t const* data, size_t size) {
  FuzzedDataProvider p(data, size);
  wire::Header h;
  h.kind = p.ConsumeBool() ? wire::Kind::Envelope : wire::Kind::Data;
  h.tag = p.ConsumeIntegral<int>();
  h.envelopeGeneration = p.ConsumeIntegral<std::uint32_t>();
  h.closes = p.ConsumeIntegral<std::uint64_t>();
  size_t const count = p.ConsumeIntegralInRange<size_t>(0, 20);
  for (size_t i = 0; i < count; ++i) {
    wire::Message m;
    m.tag = p.ConsumeIntegral<int>();
    m.bytes = p.ConsumeBytes<std::uint8_t>(p.ConsumeIntegralInRange<size_t>(0, 64));
    h.messages.push_back(std::move(m));
  }
  std::optional<wire::Header> const back = wire::decode(wire::encode(h));
  if (count > 16) {
    if (back) fail("decoded a header of more than 16 messages");
    return;
  }
  if (!back) fail("refused what encode wrote");
  if (!same(h, *back)) fail("decoded a header other than the one encoded");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(std::uint8_t const* data, size_t size) {
  std::vector<std::uint8_t> const in(data, data + size);
  checkDecode(in);
  checkRoundTrip(data, size);
  return 0;
}
