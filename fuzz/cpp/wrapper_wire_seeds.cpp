// Writes the seeds of the `wrapper_wire` fuzz target (wrapper_wire.cpp) into the directory named
// by its one argument: request-info headers as the TensorRT-LLM wrapper encodes them (the
// envelope of sendEnvelope, the data header of recvData), with the wrapper's own encoder. The
// committed seeds in fuzz/cpp/wrapper_wire_seeds/ were written by it; run it again when the wire
// header changes:
//   c++ -std=c++17 -I wrapper fuzz/cpp/wrapper_wire_seeds.cpp -o /tmp/seeds && /tmp/seeds fuzz/cpp/wrapper_wire_seeds
#include "kvlink_trtllm_wire.hpp"

#include <cstdio>
#include <string>

namespace wire = kvlink::trtllm::wire;

namespace {

template <typename T>
std::vector<std::uint8_t> bytesOf(T v) {
  std::vector<std::uint8_t> out;
  wire::put(out, v);
  return out;
}

/// The three parts of upstream's request-info envelope: tag 19 (TransceiverTag::Id
/// REQUEST_SEND), tag 22 (the info's size), tag 32 (the info, the request id first).
wire::Header envelope(std::uint64_t id, std::uint64_t closes) {
  std::vector<std::uint8_t> info = bytesOf(id);
  for (char c : std::string("\x06\0\0\0\0\0\0\0layout", 14)) info.push_back(static_cast<std::uint8_t>(c));
  wire::Header h;
  h.kind = wire::Kind::Envelope;
  h.tag = 32;
  h.closes = closes;
  h.messages.push_back(wire::Message{19, bytesOf(std::uint64_t{1})});
  h.messages.push_back(wire::Message{22, bytesOf(static_cast<std::uint64_t>(info.size()))});
  h.messages.push_back(wire::Message{32, info});
  return h;
}

/// A data buffer's header: the data tag of request `id` (12 or 23 id bits above type 43) and its
/// envelope's generation.
wire::Header data(int tag, std::uint32_t envelopeGeneration) {
  wire::Header h;
  h.kind = wire::Kind::Data;
  h.tag = tag;
  h.envelopeGeneration = envelopeGeneration;
  return h;
}

bool write(std::string const& dir, char const* name, wire::Header const& h) {
  std::vector<std::uint8_t> const b = wire::encode(h);
  std::string const path = dir + "/" + name;
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) return false;
  bool const ok = std::fwrite(b.data(), 1, b.size(), f) == b.size();
  return std::fclose(f) == 0 && ok;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s <seed directory>\n", argv[0]);
    return 2;
  }
  std::string const dir = argv[1];
  bool ok = write(dir, "envelope__first.bin", envelope(4242, 0));
  ok = write(dir, "envelope__closes_previous.bin", envelope(4243, 4242 + 1)) && ok;
  ok = write(dir, "data__tag12.bin", data((4242 & 0xFFF) << 8 | 43, 7)) && ok;
  ok = write(dir, "data__tag23.bin", data((0x5EED77 & 0x7FFFFF) << 8 | 43, 0xFFFFFFFFu)) && ok;
  if (!ok) std::perror("wrapper_wire_seeds");
  return ok ? 0 : 1;
}
