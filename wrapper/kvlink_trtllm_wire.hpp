// The wire header the TensorRT-LLM wrapper (kvlink_trtllm_wrapper.cpp) puts in the request info
// of each advertisement it makes, and reads back from the request info a peer sends. Pure byte
// encoding and decoding, nothing of kvlink or TensorRT-LLM: it compiles alone, so that the
// decoder of peer-supplied bytes can be fuzzed by itself (fuzz/cpp/wrapper_wire.cpp, run by
// scripts/fuzz.sh).
//
// u32 magic 'KVLT', u8 version 1, u8 kind (1 envelope, 2 data), u16 0, i32 tag, u32 envelope
// generation (data: the generation of its request's envelope), u64 closes (envelope: the request
// id + 1 that this envelope's thread finished on this connection, 0 none), u32 message count,
// then per message: i32 tag, u64 length, bytes. Decoded with every length bounds-checked; what
// decodes is exactly what encode writes (the reserved u16 must be 0).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <utility>
#include <vector>

namespace kvlink::trtllm::wire {

constexpr std::uint32_t kMagic = 0x544C564Bu;
constexpr std::uint8_t kVersion = 1;
enum class Kind : std::uint8_t { Envelope = 1, Data = 2 };

struct Message {
  int tag = 0;
  std::vector<std::uint8_t> bytes;
};

struct Header {
  Kind kind = Kind::Envelope;
  int tag = 0;
  std::uint32_t envelopeGeneration = 0;
  std::uint64_t closes = 0;
  std::vector<Message> messages;
};

template <typename T>
void put(std::vector<std::uint8_t>& out, T v) {
  auto const* p = reinterpret_cast<std::uint8_t const*>(&v);
  out.insert(out.end(), p, p + sizeof v);
}

inline std::vector<std::uint8_t> encode(Header const& h) {
  std::vector<std::uint8_t> out;
  put(out, kMagic);
  put(out, kVersion);
  put(out, static_cast<std::uint8_t>(h.kind));
  put(out, std::uint16_t{0});
  put(out, static_cast<std::int32_t>(h.tag));
  put(out, h.envelopeGeneration);
  put(out, h.closes);
  put(out, static_cast<std::uint32_t>(h.messages.size()));
  for (auto const& m : h.messages) {
    put(out, static_cast<std::int32_t>(m.tag));
    put(out, static_cast<std::uint64_t>(m.bytes.size()));
    out.insert(out.end(), m.bytes.begin(), m.bytes.end());
  }
  return out;
}

class Reader {
 public:
  explicit Reader(std::vector<std::uint8_t> const& b) : b_(b) {}
  template <typename T>
  bool get(T& v) {
    if (b_.size() - at_ < sizeof v) return false;
    std::memcpy(&v, b_.data() + at_, sizeof v);
    at_ += sizeof v;
    return true;
  }
  bool bytes(std::uint64_t n, std::vector<std::uint8_t>& out) {
    if (b_.size() - at_ < n) return false;
    out.assign(b_.begin() + static_cast<std::ptrdiff_t>(at_), b_.begin() + static_cast<std::ptrdiff_t>(at_ + n));
    at_ += static_cast<size_t>(n);
    return true;
  }
  bool done() const { return at_ == b_.size(); }

 private:
  std::vector<std::uint8_t> const& b_;
  size_t at_ = 0;
};

inline std::optional<Header> decode(std::vector<std::uint8_t> const& info) {
  Reader r(info);
  std::uint32_t magic = 0, count = 0;
  std::uint8_t version = 0, kind = 0;
  std::uint16_t zero = 0;
  std::int32_t tag = 0;
  Header h;
  if (!r.get(magic) || magic != kMagic || !r.get(version) || version != kVersion || !r.get(kind) ||
      (kind != 1 && kind != 2) || !r.get(zero) || zero != 0 || !r.get(tag) || !r.get(h.envelopeGeneration) || !r.get(h.closes) ||
      !r.get(count) || count > 16) {
    return std::nullopt;
  }
  h.kind = static_cast<Kind>(kind);
  h.tag = tag;
  for (std::uint32_t i = 0; i < count; ++i) {
    Message m;
    std::int32_t t = 0;
    std::uint64_t n = 0;
    if (!r.get(t) || !r.get(n) || !r.bytes(n, m.bytes)) return std::nullopt;
    m.tag = t;
    h.messages.push_back(std::move(m));
  }
  if (!r.done()) return std::nullopt;
  return h;
}

}  // namespace kvlink::trtllm::wire
