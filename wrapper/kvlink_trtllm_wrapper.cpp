// libkvlink_trtllm_wrapper.so: kvlink as a TensorRT-LLM `ConnectionManager` / `Connection`.
//
// TensorRT-LLM's generic cache-transfer path (batch_manager/dataTransceiver.cpp, the path its
// UCX backend serves) speaks tagged messages on connections:
//   generation rank (CacheReceiver)                 context rank (CacheSender)
//   getConnections(contextCommState)[rank]
//   send(19, id) send(22, size) send(32, info)  ->  recvConnect(19) -> conn; recv(22); recv(32)
//   recv(readyTag, &isReady, 1)                 <-  send(readyTag, &isReady, 1)
//   recv(dataTag, ptr, n) ... (formatter)       <-  send(dataTag, ptr, n) ... (formatter)
// Each arrow becomes a kvlink request, so completion is the receive's own completion, every wait
// has the request's deadline (kv_transfer_timeout_ms) and the DataContext's terminate flag
// cancels it on both sides:
//   - The three envelope sends are held, then go out as ONE advertisement (any-source, so
//     `recvConnect` can take it from whoever sent it) whose request info carries them, and whose
//     one posted 1-byte buffer receives the ready signal. The key is (request id read from the
//     info's first 8 bytes, a fresh generation).
//   - `send(readyTag, &b, 1)` on the context rank = accept (b true: the byte is sent into that
//     buffer, and the request's first data send takes its verdict; false: Rejected).
//     `recv(readyTag)` on the generation rank = the envelope request's agreed outcome:
//     Completed -> true, Rejected -> false, anything else throws TransferError.
//   - Each data `recv(tag, ptr, n)` posts `ptr` (host, or device via kvlink's device path) and
//     advertises it; the matching `send(tag, ptr, n)` waits for that advertisement and sends
//     into it (device memory through kvlink's send_device), then both wait for the verdict.
// Request identity: advertisements carry the full 64-bit request id. Upstream's data tag carries
// only some bits of it ((id & 0xFFF) << 8 | 43 in older releases, 23 bits in newer ones). On the
// generation rank a recv is bound to the request its calling thread sent last on that connection
// (upstream runs a request's sendRequestInfo, ready and unformat on one thread) and the tag is
// only cross-checked; on the context rank a send picks the one open request whose id matches the
// tag. Two requests in flight on one connection whose ids a data tag cannot tell apart are
// refused with AmbiguousTagError, never mixed. A ready signal, sent on upstream's thread that
// takes every request (an exception ends it for good), answers the request whose own tag it is,
// else the one taken first (the older releases' fixed ready tag 42 names any request).
//
// Written for kvlink against the declarations in docs/TENSORRT_LLM.md (pinned upstream commits);
// no TensorRT-LLM code. Exports only `makeKvlinkConnectionManager`.
#include <kvlink/kvlink.hpp>
#include <kvlink/trtllm_adapter.h>

#include "kvlink_trtllm_wire.hpp"

#include <tensorrt_llm/executor/cacheCommunicator.h>
#include <tensorrt_llm/executor/dataTransceiverState.h>

#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

namespace kvlink::trtllm {
namespace {

namespace kv = ::tensorrt_llm::executor::kv_cache;
using namespace std::chrono_literals;

// Upstream's TransceiverTag values (dataTransceiver.h @32779536): the request-info envelope.
constexpr int kIdTag = 19;
// The most request envelopes queued for recvConnect, and the most bytes of request info they
// hold; past either a new one is refused (the engine's own bounds on its queue of
// advertisements, kvlink::engine::glue's MAX_ADVERTS and MAX_QUEUED_BYTES, which the
// dispatcher's taking them would otherwise get around).
constexpr std::size_t kMaxEnvelopes = 16384;
constexpr std::size_t kMaxEnvelopeBytes = std::size_t{256} << 20;
/// Buffer advertisements a connection holds for its sends, at most (the engine's own bound on
/// queued advertisements): past it one is refused, as a peer could otherwise grow the queue
/// without end with advertisements of long deadlines that no send takes.
constexpr std::size_t kMaxBuffersQueued = 16384;
/// How long a data send waits for a buffer of its own size while only buffers of another size
/// are queued under its tag (another helper thread's recv may not have advertised yet), before
/// it takes one of them as a size mismatch.
constexpr auto kOtherSizeGrace = std::chrono::milliseconds(200);
// The envelope's first part: upstream's TransceiverTag::Id, a 64-bit enum.
constexpr std::size_t kIdSize = 8;
constexpr int kInfoSizeTag = 22;
constexpr int kInfoTag = 32;
// The low 8 bits of a request-scoped tag are its type: 42 ready signal, 43 data.
constexpr int kReadyType = 42;

// The wire header of an advertisement's request info (encode, decode): kvlink_trtllm_wire.hpp.
using wire::decode;
using wire::encode;
using wire::Header;
using wire::Kind;
using wire::Message;

// --- Tags and request ids ------------------------------------------------------------------------

bool isEnvelopeTag(int tag) { return tag == kIdTag || tag == kInfoSizeTag || tag == kInfoTag; }

/// What is wrong with an envelope, or nothing: upstream's sendRequestInfo sends the 8-byte id
/// (tag 19), the info's size as 8 bytes (22) and the info of that size (32), and its context
/// side reads them in that order, each with its own size. Anything else is the generation
/// rank's mistake (or a hostile peer's): the context side's reads of it would fail one by one,
/// each an exception in its response loop.
std::optional<std::string> envelopeFault(std::vector<Message> const& m, std::uint64_t key) {
  if (m.size() != 3 || m[0].tag != kIdTag || m[1].tag != kInfoSizeTag || m[2].tag != kInfoTag) {
    std::string tags;
    for (auto const& part : m) tags += (tags.empty() ? "" : ", ") + std::to_string(part.tag);
    return "its parts have tags [" + tags + "], not [19, 22, 32]";
  }
  if (m[0].bytes.size() != kIdSize || m[1].bytes.size() != sizeof(std::uint64_t)) {
    return "its id has " + std::to_string(m[0].bytes.size()) + " bytes and its info size " +
           std::to_string(m[1].bytes.size()) + ", not 8 each";
  }
  std::uint64_t named = 0;
  std::memcpy(&named, m[1].bytes.data(), sizeof named);
  if (named != m[2].bytes.size()) {
    return "it names an info of " + std::to_string(named) + " bytes and carries " + std::to_string(m[2].bytes.size());
  }
  // The info starts with the request id (RequestInfo::serialize), from which upstream makes the
  // request's ready and data tags; the context side knows the request by the advertisement's
  // key. Two different ids would leave the ready signal naming no request here.
  if (m[2].bytes.size() < sizeof(std::uint64_t)) {
    return "its info has " + std::to_string(m[2].bytes.size()) + " bytes, fewer than a request id's 8";
  }
  std::uint64_t infoId = 0;
  std::memcpy(&infoId, m[2].bytes.data(), sizeof infoId);
  if (infoId != key) {
    return "its info names request " + std::to_string(infoId) + ", its advertisement request " + std::to_string(key);
  }
  return std::nullopt;
}

int levelFromEnv();  // the host's TRTLLM_LOG_LEVEL as a kvlink log level (below)
bool isReadyTag(int tag) { return (tag & 0xFF) == kReadyType; }

/// Whether request `id` can be the one a request-scoped `tag` names. Upstream puts the low 12
/// (older) or 23 (newer) bits of the id above an 8-bit type; a ready tag without id bits (the
/// fixed ready tag 42 of older releases) names any request. A data tag without id bits (43) is
/// an id's like any other: that of the ids whose low 12 bits are 0 (before, it named every
/// request, so the send of request 4096 was refused as ambiguous beside request 1).
bool tagNames(int tag, std::uint64_t id) {
  auto const bits = static_cast<std::uint64_t>(static_cast<std::uint32_t>(tag) >> 8);
  if (bits == 0 && isReadyTag(tag)) return true;
  if ((id & 0xFFFu) != (bits & 0xFFFu)) return false;
  return bits < 0x1000u || (id & 0x7FFFFFu) == bits;
}

std::string envOr(char const* given, char const* name, char const* fallback) {
  if (given != nullptr && *given != '\0') return given;
  char const* e = std::getenv(name);
  return (e != nullptr && *e != '\0') ? std::string(e) : std::string(fallback);
}

/// Runs `f`, an advertisement that starts request `id`'s transfer. A transfer that cannot start
/// because its peer is gone (or not back by the request's deadline: the engine's `PeerLost`)
/// ended as one that started would: `TransferError` PeerLost, as the adapter promises for any
/// send or recv whose transfer ends in anything but success. Other errors (bad input, a full
/// queue, shutdown) pass as they are.
template <class F>
void startTransfer(std::uint64_t id, std::string const& what, F&& f) {
  try {
    f();
  } catch (Error const& e) {
    if (e.kind() != ErrorKind::PeerLost) throw;
    throw TransferError(static_cast<int>(Outcome::PeerLost), id, what + ": " + e.what());
  }
}

// --- CUDA pointers, without a link dependency ------------------------------------------------------
// TensorRT-LLM's buffers are device memory. Ask the CUDA driver the process has already loaded
// (RTLD_NOLOAD: a process without libcuda has no device pointers) which device a pointer is on.
class CudaPointers {
 public:
  CudaPointers() {
    handle_ = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
    if (handle_ == nullptr) return;
    init_ = reinterpret_cast<int (*)(unsigned)>(dlsym(handle_, "cuInit"));
    attr_ = reinterpret_cast<int (*)(void*, int, unsigned long long)>(dlsym(handle_, "cuPointerGetAttribute"));
    if (init_ == nullptr || attr_ == nullptr || init_(0) != 0) attr_ = nullptr;
  }
  /// The reference taken above keeps the driver loaded while the manager may call it, and no
  /// longer: kept, each manager of a long-lived host added one that was never given back.
  ~CudaPointers() {
    if (handle_ != nullptr) dlclose(handle_);
  }
  CudaPointers(CudaPointers const&) = delete;
  CudaPointers& operator=(CudaPointers const&) = delete;
  /// The CUDA device of `p`, or -1 for host memory (pinned host memory included).
  int deviceOf(void const* p) const {
    if (attr_ == nullptr || p == nullptr) return -1;
    unsigned int memoryType = 0;  // CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2, CU_MEMORYTYPE_DEVICE = 2
    if (attr_(&memoryType, 2, reinterpret_cast<unsigned long long>(p)) != 0 || memoryType != 2) return -1;
    int ordinal = -1;  // CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9
    if (attr_(&ordinal, 9, reinterpret_cast<unsigned long long>(p)) != 0) return -1;
    return ordinal;
  }

 private:
  void* handle_ = nullptr;
  int (*init_)(unsigned) = nullptr;
  int (*attr_)(void*, int, unsigned long long) = nullptr;
};

std::string describe(std::uint64_t id, int tag) {
  return "request " + std::to_string(id) + " (tag " + std::to_string(tag) + ")";
}

class Manager;
class KvlinkConnection;

// --- Per-thread state ends with its thread -------------------------------------------------------
// A connection keys the state of the request a host thread is running by that thread's id
// (upstream has no request handle: a request's sends and recvs are tied only by their thread).
// That state belongs to the thread: when the thread exits (a std::async per request, a thread
// pool made anew), it goes. Kept past the thread, it piled up for good, and a new thread that got
// the dead one's id (the C library reuses them) took over the dead thread's request. The request
// itself is retired, not forgotten: it is in flight for the context rank until its deadline (no
// next envelope of that thread will close it), so it still keeps a request with the same data
// tags out until then, and the manager's dispatcher settles it if it still holds its posted
// ready byte (the engine cannot be called from a thread's exit: its thread-locals are gone).

/// The connections alive in this process, for a thread's exit to tell a live one from one
/// destroyed since. Never destroyed: a thread may exit during static destruction.
struct LiveConnections {
  std::mutex mu;
  std::set<KvlinkConnection const*> live;
};
LiveConnections& liveConnections() {
  static auto* l = new LiveConnections;
  return *l;
}

/// The connections this thread holds state on; its destructor, run at the thread's exit, drops
/// that state on each that is still alive.
struct ThreadStateOwner {
  /// A list this long is pruned of the connections destroyed since (then twice what is left).
  static constexpr size_t kPruneAt = 16;
  std::vector<KvlinkConnection const*> touched;
  size_t pruneAt = kPruneAt;
  ~ThreadStateOwner();
};
/// The calling thread's owner, made on its first use.
ThreadStateOwner& threadStateOwner() {
  thread_local ThreadStateOwner owner;
  return owner;
}
/// This thread holds state on `c`: it goes when the thread exits. Takes the live connections'
/// lock: never called with a connection's lock held (a thread's exit takes them the other way).
void ownThreadState(KvlinkConnection const* c) {
  auto& o = threadStateOwner();
  if (std::find(o.touched.begin(), o.touched.end(), c) != o.touched.end()) return;
  if (o.touched.size() >= o.pruneAt) {
    // A thread that outlives managers (a host thread over many executor lives) used their
    // connections too: those destroyed since hold nothing of it. Kept, the list grew by each
    // connection it ever used, and was searched whole on each request.
    auto& l = liveConnections();
    std::lock_guard<std::mutex> g(l.mu);
    auto const gone = [&](KvlinkConnection const* t) { return l.live.count(t) == 0; };
    o.touched.erase(std::remove_if(o.touched.begin(), o.touched.end(), gone), o.touched.end());
    o.pruneAt = std::max(ThreadStateOwner::kPruneAt, 2 * o.touched.size());
  }
  o.touched.push_back(c);
}

/// One remote rank. Thread safe; holds per-thread state for the requests its callers run.
class KvlinkConnection final : public kv::Connection {
 public:
  KvlinkConnection(Manager& m, std::uint32_t remote) : m_(m), remote_(remote) {
    auto& l = liveConnections();
    std::lock_guard<std::mutex> g(l.mu);
    l.live.insert(this);
  }
  ~KvlinkConnection() override;

  void send(kv::DataContext const& ctx, void const* data, size_t size) const override;
  void recv(kv::DataContext const& ctx, void* data, size_t size) const override;
  [[nodiscard]] bool isThreadSafe() const noexcept override { return true; }

  // Called by the manager.
  void adoptEnvelope(Advertisement const& adv, Header&& h) const;
  void queueData(Advertisement&& adv, Header&& h) const;
  void wake() const { cv_.notify_all(); }
  /// The calling thread is exiting: its state here goes, its request retired. Does not block,
  /// calls nothing of the engine.
  void threadEnded() const;
  /// The dispatcher's round here, the only thread that settles a retired request: settles the
  /// retired requests that still hold their posted ready byte and forgets those past their
  /// deadline, forgets buffer advertisements past theirs that no send took, and forgets the
  /// context-side requests past theirs.
  void tidy() const;
  /// Per-thread entries held here (test build: helpers/wrapper_probe.cpp).
  size_t threadStates() const {
    std::lock_guard<std::mutex> g(mu_);
    return outgoing_.size() + incoming_.size() + gen_.size();
  }
  /// The rank at the other end.
  std::uint32_t remote() const { return remote_; }
  /// Buffer advertisements queued for a send (test build: helpers/wrapper_probe.cpp).
  size_t buffersQueued() const {
    std::lock_guard<std::mutex> g(mu_);
    return data_.size();
  }
  /// Context-side requests held here (test build: helpers/wrapper_probe.cpp).
  size_t contextRequests() const {
    std::lock_guard<std::mutex> g(mu_);
    return ctx_.size();
  }

 private:
  struct GenRequest {  // generation side: one per calling thread
    std::uint64_t id = 0;
    RequestKey envelope;
    Deadline deadline;
    std::unique_ptr<std::uint8_t> readyByte = std::make_unique<std::uint8_t>(0);
    bool settled = false;  // the envelope request's outcome was taken
    std::optional<bool> ready;
  };
  struct CtxRequest {  // context side: one per adopted envelope
    std::uint64_t id = 0;
    RequestKey envelope;
    Deadline deadline;
    bool answered = false;
    bool open = true;
    /// The ready byte went out and its verdict is not taken yet: the request's first data send
    /// takes it (sendReady does not wait for it).
    bool readyUnconfirmed = false;
    /// Adoption order on this connection (the first adopted answers a ready tag naming two).
    std::uint64_t adopted = 0;
  };
  struct DataAdvert {
    Advertisement adv;
    int tag = 0;
  };

  void sendEnvelope(std::vector<Message>&& msgs) const;
  void sendReady(kv::DataContext const& ctx, void const* data, size_t size) const;
  void sendData(kv::DataContext const& ctx, void const* data, size_t size) const;
  void recvReady(kv::DataContext const& ctx, void* data, size_t size) const;
  void recvData(kv::DataContext const& ctx, void* data, size_t size) const;
  void settle(GenRequest& r) const;  // with mu_ not held
  std::vector<CtxRequest*> openCtxNaming(int tag, bool answered) const;  // with mu_ held
  void endCtx(std::uint64_t id) const;                                    // with mu_ held

  Manager& m_;
  std::uint32_t remote_;
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  mutable std::map<std::thread::id, std::vector<Message>> outgoing_;   // envelope being built
  mutable std::map<std::thread::id, std::vector<Message>> incoming_;   // envelope being read
  mutable std::map<std::thread::id, std::shared_ptr<GenRequest>> gen_;  // generation side
  mutable std::vector<std::shared_ptr<GenRequest>> retired_;  // of exited threads
  mutable std::map<std::uint64_t, CtxRequest> ctx_;                   // context side, by id
  mutable std::uint64_t adoptions_ = 0;                               // CtxRequest::adopted
  mutable std::deque<DataAdvert> data_;                               // context side
};

/// One rank's manager: one kvlink engine, one dispatcher thread for advertisements.
class Manager final : public kv::ConnectionManager {
 public:
  Manager(EngineConfig const& config, std::vector<kv::AgentState> agents, int selfIdx)
      : config_(config), engine_(config), commState_(std::move(agents), selfIdx) {}

  /// Publishes this rank (the allgather) and starts the dispatcher.
  static std::unique_ptr<Manager> make(KvlinkTrtllmOptions const& o, EngineConfig const& c) {
    auto m = std::unique_ptr<Manager>(new Manager(c, {}, o.rank));
    std::string const mine = c.name + '\n' + m->engine_.address();
    constexpr size_t kRecord = 8192;
    if (mine.size() >= kRecord) throw Error(ErrorKind::InvalidArgument, "kvlink: agent name too long");
    std::vector<kv::AgentState> agents;
    if (o.world_size <= 1) {
      agents.emplace_back(c.name, m->engine_.address());
    } else {
      if (o.allgather == nullptr) {
        throw Error(ErrorKind::InvalidArgument, "kvlink: world_size > 1 needs an allgather");
      }
      std::vector<char> record(kRecord, '\0'), all(kRecord * static_cast<size_t>(o.world_size), '\0');
      std::memcpy(record.data(), mine.data(), mine.size());
      if (o.allgather(o.allgather_user, record.data(), kRecord, all.data()) != 0) {
        throw Error(ErrorKind::Transport, "kvlink: the allgather of agent addresses failed");
      }
      for (int r = 0; r < o.world_size; ++r) {
        // A record need not end in NUL (the host's allgather fills it): never read past it.
        char const* rec = all.data() + static_cast<size_t>(r) * kRecord;
        std::string s(rec, strnlen(rec, kRecord));
        auto const nl = s.find('\n');
        if (nl == std::string::npos) throw Error(ErrorKind::Protocol, "kvlink: bad agent record from rank " + std::to_string(r));
        agents.emplace_back(s.substr(0, nl), s.substr(nl + 1));
      }
    }
    m->commState_ = kv::CommState(std::move(agents), o.rank);
    m->hook_ = hookOf(o);  // before the dispatcher, which reads it (warn)
    m->dispatcher_ = std::thread([p = m.get()] { p->dispatch(); });
    return m;
  }

  ~Manager() override {
    releaseLogSink();
    running_.store(false, std::memory_order_release);
    stop_.store(true, std::memory_order_release);
    envelopeCv_.notify_all();
    if (dispatcher_.joinable()) dispatcher_.join();
    {
      // Calls still inside (a recvConnect, a send waiting for its buffer, a recv) see
      // isRunning() false and leave, or end at their request's deadline: the connections, their
      // locks and the engine stay until the last has left (the engine may not be destroyed with
      // a thread inside it).
      std::unique_lock<std::mutex> g(mu_);
      for (auto& [rank, c] : connections_) {
        (void)rank;
        c->wake();
      }
      envelopeCv_.notify_all();
      callsCv_.wait(g, [this] { return calls_ == 0; });
    }
    // Requests no recvConnect took: refused, so that their generation ranks learn now, not at
    // their deadline (a transport without endpoint failures, shared memory, tells them nothing).
    std::deque<std::pair<Advertisement, Header>> untaken;
    std::map<std::uint32_t, std::unique_ptr<KvlinkConnection>> gone;
    {
      std::lock_guard<std::mutex> g(mu_);
      untaken.swap(envelopes_);
      envelopeBytes_ = 0;
      gone.swap(connections_);
    }
    for (auto const& e : untaken) {
      try {
        refuse(e.first);
      } catch (...) {
        // Out of memory: its deadline still ends it (nothing may leave a destructor).
      }
    }
    gone.clear();  // before the engine they use; unlocked: their destructors wait (settle)
  }

  /// Counts a call of the host's into this manager or one of its connections: the destructor
  /// waits until none is left inside.
  class Call {
   public:
    explicit Call(Manager& m) : m_(m) {
      std::lock_guard<std::mutex> g(m_.mu_);
      ++m_.calls_;
    }
    ~Call() {
      std::lock_guard<std::mutex> g(m_.mu_);
      if (--m_.calls_ == 0) m_.callsCv_.notify_all();
    }
    Call(Call const&) = delete;
    Call& operator=(Call const&) = delete;

   private:
    Manager& m_;
  };

  kv::Connection const* recvConnect(kv::DataContext const& ctx, void* data, size_t size) override {
    if (data == nullptr && size != 0) {  // checked before an envelope is taken: none is lost
      throw Error(ErrorKind::InvalidArgument,
                  "kvlink InvalidArgument: recvConnect of " + std::to_string(size) + " bytes into null");
    }
    std::atomic<bool> const& terminate = ctx.getTransferTerminate();
    Call const call(*this);
    std::unique_lock<std::mutex> g(mu_);
    std::optional<std::pair<Advertisement, Header>> taken;
    for (;;) {
      // The flags first: a terminated call takes nothing, and an envelope already queued stays
      // for a later recvConnect (before, it was taken and handed to a caller that had given up).
      if (!isRunning() || terminate.load(std::memory_order_acquire)) return nullptr;
      if (envelopes_.empty()) {
        // The flag cannot notify us: look at it every 10 ms (no spinning, bounded latency).
        envelopeCv_.wait_for(g, 10ms);
        continue;
      }
      auto const& [queuedAdv, queuedHeader] = envelopes_.front();
      // Queued only whole (dispatchOne: envelopeFault), so it starts with the 8-byte id (19).
      Message const* first = &queuedHeader.messages.front();
      bool const expired = Clock::now() > queuedAdv.deadline;
      if (!expired && (first->tag != ctx.getTag() || first->bytes.size() != size)) {
        // The host's mistake: a typed error, and the envelope stays for a recvConnect that fits
        // (before, it was taken and refused, and that request was lost).
        throw Error(ErrorKind::InvalidArgument,
                    "kvlink InvalidArgument: recvConnect of " + std::to_string(size) + " bytes on tag " +
                        std::to_string(ctx.getTag()) + "; the request envelope starts with tag " +
                        std::to_string(first->tag) + " of " + std::to_string(first->bytes.size()) + " bytes");
      }
      taken.emplace(popEnvelope());
      if (!expired) break;
      // Past its deadline (the dispatcher drops those too, every 100 ms): its generation rank has
      // given up, and the host gets the next one, not a dead request.
      g.unlock();
      refuse(taken->first);
      g.lock();
    }
    auto& [adv, header] = *taken;
    KvlinkConnection* c = connectionFor(adv.from_rank, g);
    g.unlock();
    std::memcpy(data, header.messages.front().bytes.data(), size);
    header.messages.erase(header.messages.begin());
    c->adoptEnvelope(adv, std::move(header));
    return c;
  }

  [[nodiscard]] std::vector<kv::Connection const*> getConnections(kv::CommState const& state) override {
    if (!state.isAgentState()) {
      throw Error(ErrorKind::InvalidArgument, "kvlink InvalidArgument: the CommState is not kvlink's (agent state)");
    }
    Call const call(*this);
    std::vector<kv::Connection const*> out;
    for (auto const& a : state.getAgentState()) {
      out.push_back(a.mConnectionInfo == engine_.address() ? nullptr : connectTo(a.mConnectionInfo));
    }
    return out;
  }

  [[nodiscard]] kv::CommState const& getCommState() const override { return commState_; }
  [[nodiscard]] bool isRunning() const override { return running_.load(std::memory_order_acquire); }

  /// The host's log hook of one factory call.
  struct LogHook {
    KvlinkLogFn fn;
    void* user;
    int level;
  };

  /// The log hook the options ask for, if any.
  static std::optional<LogHook> hookOf(KvlinkTrtllmOptions const& o) {
    if (o.log == nullptr) return std::nullopt;
    return LogHook{o.log, o.log_user, o.log_level > 0 ? std::min(o.log_level, 5) : levelFromEnv()};
  }

  /// Routes kvlink's (process-wide) log sink to `h`. Called with `logMutex()` held.
  static void installLogHook(LogHook const& h) {
    set_log_sink(static_cast<LogLevel>(h.level), [fn = h.fn, user = h.user](LogRecord const& r) {
      std::string line = "[kvlink] ";
      line.append(r.target.data(), r.target.size()).append(": ").append(r.message.data(), r.message.size());
      if (!r.fields.empty()) line.append(" ").append(r.fields.data(), r.fields.size());
      fn(user, static_cast<int>(r.level), line.data(), line.size());
    });
  }

  /// The sink goes to the hook of the newest live manager that has one, or nowhere. Called with
  /// `logMutex()` held, whenever the hook that is the sink's must go (its manager's, or one
  /// installed for a factory call that failed): no event reaches a hook whose owner may be gone.
  /// With no hook left the sink is removed, which waits (up to 500 ms) for a call of the old hook
  /// under way (kvlink calls hooks on its log thread). Else it is replaced, which does not wait:
  /// returns true, and the caller, once it has let go of `logMutex()`, waits for that call with
  /// `settleReplacedHook()` before the old hook's owner may go. (Found by review: the lock was
  /// held across that wait, and every other manager's factory call and destruction queued
  /// behind a slow hook.)
  static bool reinstallLogHookLocked() {
    auto const& v = logHooks();
    if (v.empty()) {
      clear_log_sink();
      return false;
    }
    try {
      installLogHook(v.back().second);
    } catch (...) {
      // A replacement refused keeps the old hook: it must go all the same.
      clear_log_sink();
      throw;
    }
    return true;
  }
  /// After a replacement of the sink (`reinstallLogHookLocked` returned true), without
  /// `logMutex()`: waits (up to 500 ms) until the records taken so far have been delivered, the
  /// old hook's call under way among them.
  static void settleReplacedHook() noexcept {
    try {
      flush_log(Clock::now() + std::chrono::milliseconds(500));
    } catch (...) {
      // Nothing to do: the wait is what was asked, and it is bounded either way.
    }
  }

  /// This manager routes kvlink's logs to the host's hook `h`, now the newest live manager's.
  /// Installed again here, not only by the factory before the manager was made: a manager
  /// destroyed in between (its hook going, and with it the sink, as no manager held one yet)
  /// left this one's hook uninstalled for its whole life. Replacing a sink does not block.
  void holdLogSink(LogHook const& h) {
    std::lock_guard<std::mutex> g(logMutex());
    logHooks().emplace_back(this, h);
    try {
      installLogHook(h);
    } catch (...) {
      logHooks().pop_back();
      throw;
    }
  }
  /// This manager's hook, if it holds one, goes; the sink follows the hooks left. Called from
  /// the destructor, so it throws nothing: should kvlink refuse the next manager's hook (its log
  /// thread could not start), kvlink's logs go to stderr (KVLINK_LOG) instead of the process
  /// ending in std::terminate.
  void releaseLogSink() noexcept {
    bool settle = false;
    {
      std::lock_guard<std::mutex> g(logMutex());
      auto& v = logHooks();
      // Only the newest holder's hook is the sink's: an older one's going changes the sink
      // nothing, but its hook may still be in a call from before a newer one replaced it (a
      // replacement does not wait): waited for below all the same (found by review).
      bool const sinks = !v.empty() && v.back().first == this;
      auto const mine = std::remove_if(v.begin(), v.end(), [this](auto const& e) { return e.first == this; });
      if (mine == v.end()) return;
      v.erase(mine, v.end());
      settle = true;
      if (sinks) {
        try {
          settle = reinstallLogHookLocked();
        } catch (std::exception const& e) {
          settle = false;  // removed instead, which waited
          std::fprintf(stderr, "[kvlink] the log hook of the next live manager could not be installed: %s\n", e.what());
        }
      }
    }
    if (settle) settleReplacedHook();
  }
  // Both never destroyed (as liveConnections): a manager the host destroys during static
  // destruction (one held in a global) still finds them.
  static std::mutex& logMutex() {
    static auto* m = new std::mutex;
    return *m;
  }
  /// A warning of the wrapper's own (not kvlink's, which reach the hook through the log sink),
  /// to this manager's hook if it holds one at `Warn` or a more verbose level. Takes no lock:
  /// the log mutex is held across the sink's removal when the last hook goes, which waits up to
  /// 500 ms for a slow hook.
  /// At most one a second: a peer that sends malformed envelopes without end would otherwise
  /// hold the dispatcher in the host's hook once for each; the ones held back are counted in
  /// the next one told.
  void warn(std::string const& what) const {
    if (!hook_ || hook_->level < static_cast<int>(LogLevel::Warn)) return;
    std::int64_t const now = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now().time_since_epoch()).count();
    std::int64_t last = lastWarnMs_.load(std::memory_order_relaxed);
    if ((last != 0 && now - last < 1000) || !lastWarnMs_.compare_exchange_strong(last, now)) {
      warnsHeld_.fetch_add(1, std::memory_order_relaxed);
      return;
    }
    std::string line = "[kvlink] kvlink_trtllm_wrapper: " + what;
    if (std::uint64_t const held = warnsHeld_.exchange(0, std::memory_order_relaxed)) {
      line += " (" + std::to_string(held) + " more warnings held back in the second before)";
    }
    hook_->fn(hook_->user, static_cast<int>(LogLevel::Warn), line.data(), line.size());
  }
  /// The live managers with a hook, oldest first.
  static std::vector<std::pair<Manager const*, LogHook>>& logHooks() {
    static auto* v = new std::vector<std::pair<Manager const*, LogHook>>;
    return *v;
  }

  Engine& engine() { return engine_; }
  std::uint32_t nextGeneration() { return generation_.fetch_add(1, std::memory_order_relaxed); }
  std::chrono::milliseconds timeout() const { return config_.timeout; }
  /// How long past a request's deadline its waits may still run (agreement + slack).
  std::chrono::milliseconds grace() const {
    return (config_.agreement_bound.count() > 0 ? config_.agreement_bound : std::chrono::milliseconds(50)) + 1000ms;
  }
  CudaPointers const& cuda() const { return cuda_; }

  /// What the test build's probe reports (helpers/wrapper_probe.cpp): envelopes taken from the
  /// engine that no recvConnect has taken yet, per-thread entries, buffer advertisements queued
  /// and context-side requests held over the connections.
  size_t envelopesQueued() {
    std::lock_guard<std::mutex> g(mu_);
    return envelopes_.size();
  }
  size_t threadStates() {
    size_t n = 0;
    for (auto const* c : connections()) n += c->threadStates();
    return n;
  }
  size_t buffersQueued() {
    size_t n = 0;
    for (auto const* c : connections()) n += c->buffersQueued();
    return n;
  }
  size_t contextRequests() {
    size_t n = 0;
    for (auto const* c : connections()) n += c->contextRequests();
    return n;
  }

 private:
  void dispatch() {
    // The sweeps of what outlived its deadline run every 100 ms, not after each advertisement:
    // each walks every connection's requests, so under a burst of advertisements a sweep per
    // advertisement cost the dispatcher that walk each time.
    Clock::time_point swept{};
    while (!stop_.load(std::memory_order_acquire)) {
      try {
        dispatchOne();
        if (Clock::now() - swept >= 100ms) {
          swept = Clock::now();
          dropExpiredEnvelopes();
          for (auto const* c : connections()) c->tidy();
        }
      } catch (...) {
        // An advertisement that could not be taken or queued (an engine that refuses the call,
        // memory exhausted): not the end of the dispatcher, which no exception may leave (it
        // would end the process), and no spin on an error that repeats either.
        std::this_thread::sleep_for(10ms);
      }
    }
  }

  /// Takes the next advertisement (waiting up to 200 ms) and hands it to its connection.
  void dispatchOne() {
    std::optional<Advertisement> adv = engine_.next_advertisement(after(200ms), stop_);
    if (!adv) return;
    auto h = decode(adv->request_info);
    if (!h) {
      refuse(*adv);
      return;
    }
    if (h->kind == Kind::Envelope) {
      if (auto const fault = envelopeFault(h->messages, adv->key.request)) {
        // Refused (its generation rank reads ready == false) and told, never handed to the
        // host: upstream's context side ends its response loop for good on an exception, and
        // before, a bad envelope made recvConnect or the host's next recv throw, so one peer's
        // mistake stopped the rank serving every request after it.
        refuse(*adv);
        warn("a request envelope from rank " + std::to_string(adv->from_rank) + " is malformed (" + *fault +
             "): refused");
        return;
      }
      {
        std::lock_guard<std::mutex> g(mu_);
        std::size_t const bytes = adv->request_info.size();
        if (envelopes_.size() < kMaxEnvelopes && envelopeBytes_ + bytes <= kMaxEnvelopeBytes) {
          envelopes_.emplace_back(std::move(*adv), std::move(*h));
          envelopeBytes_ += bytes;
          adv.reset();
        }
      }
      if (adv) {
        // The host has not taken the envelopes before it (kMaxEnvelopes, kMaxEnvelopeBytes):
        // refused now, as the engine refuses an advertisement past its own queue's bounds.
        refuse(*adv);
        return;
      }
      envelopeCv_.notify_all();
    } else {
      if (!h->messages.empty()) {
        // A buffer advertisement carries no messages (the generation side sends none): one
        // that does is refused, or up to kMaxBuffersQueued of them per rank would keep a
        // megabyte of info each until a deadline the peer chose.
        refuse(*adv);
        warn("a buffer advertisement from rank " + std::to_string(adv->from_rank) + " carries " +
             std::to_string(h->messages.size()) + " messages: refused");
        return;
      }
      // Nothing reads a queued buffer advertisement's info again.
      adv->request_info = {};
      KvlinkConnection* c = nullptr;
      {
        std::unique_lock<std::mutex> g(mu_);
        c = connectionFor(adv->from_rank, g);
      }
      c->queueData(std::move(*adv), std::move(*h));
    }
  }

  /// Refuses the envelopes no recvConnect took by their request's deadline: their generation
  /// ranks have ended them, and a later recvConnect gets live ones, not these first (before,
  /// they stayed queued for good, oldest first).
  /// Taken from the front, oldest first, so a round costs only what it drops; one behind a
  /// request with a later deadline goes when that one has (or when recvConnect reaches it).
  void dropExpiredEnvelopes() {
    std::vector<Advertisement> expired;
    {
      std::lock_guard<std::mutex> g(mu_);
      auto const now = Clock::now();
      while (!envelopes_.empty() && now > envelopes_.front().first.deadline) {
        expired.push_back(popEnvelope().first);
      }
    }
    for (auto const& a : expired) refuse(a);
  }

  /// Takes the queued envelope at the front (there is one), with `mu_` held.
  std::pair<Advertisement, Header> popEnvelope() {
    std::pair<Advertisement, Header> e = std::move(envelopes_.front());
    envelopes_.pop_front();
    envelopeBytes_ -= e.first.request_info.size();
    return e;
  }

  /// The connections, alive until this manager's destructor has seen the last call leave.
  std::vector<KvlinkConnection const*> connections() {
    std::vector<KvlinkConnection const*> out;
    std::lock_guard<std::mutex> g(mu_);
    for (auto const& [rank, c] : connections_) {
      (void)rank;
      out.push_back(c.get());
    }
    return out;
  }

  void refuse(Advertisement const& adv) {
    try {
      engine_.accept(adv.key, adv.from_rank, false);
    } catch (Error const&) {
      // Already ended.
    }
  }

  KvlinkConnection* connectionFor(std::uint32_t rank, std::unique_lock<std::mutex>&) {
    auto& slot = connections_[rank];
    if (!slot) slot = std::make_unique<KvlinkConnection>(*this, rank);
    return slot.get();
  }

  kv::Connection const* connectTo(std::string const& address) {
    KvlinkConnection const* known = nullptr;
    {
      std::lock_guard<std::mutex> g(mu_);
      auto it = byAddress_.find(address);
      if (it != byAddress_.end()) known = it->second;
    }
    // Kept while its rank is connected. Otherwise the address is dialled again: the process
    // there may be a new one with a rank of its own (a context server restarted on a fixed
    // port), which the old rank's connection never reaches (before, every request to it failed
    // PeerLost); a dial to a rank being reconnected waits for that and returns its rank.
    if (known != nullptr && engine_.peer_state(known->remote()) == PeerState::Connected) return known;
    std::uint32_t const rank = engine_.connect(address, after(config_.timeout));
    std::unique_lock<std::mutex> g(mu_);
    KvlinkConnection* c = connectionFor(rank, g);
    byAddress_[address] = c;
    return c;
  }

  EngineConfig config_;
  Engine engine_;
  kv::CommState commState_;
  CudaPointers cuda_;
  std::optional<LogHook> hook_;  // this manager's, for warn(); set before the dispatcher starts
  mutable std::atomic<std::int64_t> lastWarnMs_{0};  // when warn() last told the hook (steady ms)
  mutable std::atomic<std::uint64_t> warnsHeld_{0};  // warnings held back since
  std::atomic<bool> running_{true};
  std::atomic<bool> stop_{false};
  std::atomic<std::uint32_t> generation_{1};
  std::mutex mu_;
  std::condition_variable envelopeCv_;
  std::condition_variable callsCv_;
  int calls_ = 0;  // host calls inside (Call), under mu_
  std::deque<std::pair<Advertisement, Header>> envelopes_;
  std::size_t envelopeBytes_ = 0;  // request info of envelopes_, bytes
  std::map<std::string, KvlinkConnection const*> byAddress_;
  std::map<std::uint32_t, std::unique_ptr<KvlinkConnection>> connections_;
  std::thread dispatcher_;
};

/// Accepts (or refuses) an advertised request. False when `accept` throws (answered already, or
/// forgotten); its verdict is then `ended`. A request that the other side cancelled or timed out
/// first is accepted without effect: the send that follows returns its end.
bool acceptOrEnded(Engine& e, RequestKey key, std::uint32_t from, bool ready, std::chrono::milliseconds grace,
                   Outcome& ended) {
  try {
    e.accept(key, from, ready);
    return true;
  } catch (Error const&) {
    try {
      ended = e.wait_sender(key, from, after(grace));
    } catch (Error const&) {
      ended = Outcome::Cancelled;  // already settled and taken: it did not complete here
    }
    if (ended == Outcome::Completed) ended = Outcome::Cancelled;
    return false;
  }
}

// --- KvlinkConnection -------------------------------------------------------------------------

ThreadStateOwner::~ThreadStateOwner() {
  auto& l = liveConnections();
  std::lock_guard<std::mutex> g(l.mu);  // a connection is not destroyed while its state goes
  for (KvlinkConnection const* c : touched) {
    if (l.live.count(c) != 0) c->threadEnded();  // else destroyed, its state with it
  }
}

void KvlinkConnection::threadEnded() const {
  auto const self = std::this_thread::get_id();
  std::lock_guard<std::mutex> g(mu_);
  outgoing_.erase(self);
  incoming_.erase(self);
  auto it = gen_.find(self);
  if (it == gen_.end()) return;
  if (it->second) retired_.push_back(std::move(it->second));
  gen_.erase(it);
}

void KvlinkConnection::tidy() const {
  std::vector<std::shared_ptr<GenRequest>> unsettled;
  {
    std::lock_guard<std::mutex> g(mu_);
    auto const now = Clock::now();
    auto const gone = [&](std::shared_ptr<GenRequest> const& r) { return r->settled && now > r->deadline + m_.grace(); };
    retired_.erase(std::remove_if(retired_.begin(), retired_.end(), gone), retired_.end());
    // A buffer no send took by its request's deadline never will (the generation rank's recv of
    // it has ended by then): only a next envelope of the same generation thread closed its
    // request, and nothing else ever removed it.
    auto const stale = [&](DataAdvert const& d) { return now > d.adv.deadline + m_.grace(); };
    data_.erase(std::remove_if(data_.begin(), data_.end(), stale), data_.end());
    // Context-side requests past their deadline: every wait on them has ended. Forgotten here,
    // not when a next envelope comes (a context rank that gets no more work kept them for good).
    for (auto it = ctx_.begin(); it != ctx_.end();) {
      it = now > it->second.deadline + m_.grace() ? ctx_.erase(it) : std::next(it);
    }
    for (auto const& r : retired_) {
      if (!r->settled) unsettled.push_back(r);
    }
  }
  for (auto const& r : unsettled) settle(*r);
}

KvlinkConnection::~KvlinkConnection() {
  {
    std::lock_guard<std::mutex> g(liveConnections().mu);  // no thread's exit is inside from here on
    liveConnections().live.erase(this);
  }
  for (auto& r : retired_) {
    if (!r->settled) settle(*r);
  }
  // Requests still holding a posted ready byte: settle them before the byte is freed.
  for (auto& [thread, r] : gen_) {
    (void)thread;
    if (r && !r->settled) settle(*r);
  }
  // Context side: a request taken and never answered is refused, so that the generation rank's
  // wait for its ready signal ends now, not at its deadline.
  for (auto const& [id, r] : ctx_) {
    (void)id;
    if (r.answered) continue;
    try {
      m_.engine().accept(r.envelope, remote_, false);
    } catch (...) {
      // Already ended (Error), or out of memory: its deadline still ends it.
    }
  }
  // Buffers advertised to this rank that no send took: no send ever will. Refused, as endCtx
  // refuses them, so that the generation rank's recv of each ends now, not at its deadline.
  for (auto const& d : data_) {
    try {
      m_.engine().accept(d.adv.key, remote_, false);
    } catch (...) {
      // Already ended (Error), or out of memory: its deadline still ends it.
    }
  }
}

void KvlinkConnection::settle(GenRequest& r) const {
  // Runs in the destructor too: nothing may leave it (an exception there is std::terminate).
  try {
    m_.engine().cancel(r.envelope);
  } catch (...) {
    // Already ended (Error), or out of memory: the wait below still bounds the buffer's use.
  }
  try {
    (void)m_.engine().wait_receiver(r.envelope, after(m_.grace()));
  } catch (...) {
    // Already taken.
  }
  r.settled = true;
}

void KvlinkConnection::send(kv::DataContext const& ctx, void const* data, size_t size) const {
  if (data == nullptr && size != 0) {
    throw Error(ErrorKind::InvalidArgument, "kvlink InvalidArgument: send of " + std::to_string(size) + " bytes from null");
  }
  Manager::Call const call(m_);
  int const tag = ctx.getTag();
  if (isEnvelopeTag(tag)) {
    ownThreadState(this);  // the envelope being built, then the request it sends
    std::vector<Message> done;
    {
      std::lock_guard<std::mutex> g(mu_);
      auto& out = outgoing_[std::this_thread::get_id()];
      // The id is an envelope's first part (upstream's sendRequestInfo: 19, 22, 32): it starts a
      // new one, whatever a send that failed halfway left of the last (before, a [19] left by a
      // refused send of 22 went out in front of the next envelope, and the context side's recv
      // of 22 found 19: the request was never answered).
      if (tag == kIdTag) out.clear();
      auto const* p = static_cast<std::uint8_t const*>(data);
      out.push_back(Message{tag, std::vector<std::uint8_t>(p, p + size)});
      if (tag != kInfoTag) return;  // the envelope goes out with its last part
      done = std::move(out);
      outgoing_.erase(std::this_thread::get_id());
    }
    sendEnvelope(std::move(done));
    return;
  }
  if (isReadyTag(tag)) {
    sendReady(ctx, data, size);
  } else {
    sendData(ctx, data, size);
  }
}

void KvlinkConnection::recv(kv::DataContext const& ctx, void* data, size_t size) const {
  int const tag = ctx.getTag();
  if (data == nullptr && size != 0) {  // before anything is taken: the recv can be made again
    throw Error(ErrorKind::InvalidArgument, "kvlink InvalidArgument: recv of " + std::to_string(size) +
                                                " bytes on tag " + std::to_string(tag) + " into null");
  }
  Manager::Call const call(m_);
  {
    std::lock_guard<std::mutex> g(mu_);
    auto it = incoming_.find(std::this_thread::get_id());
    if (it != incoming_.end() && !it->second.empty() && it->second.front().tag == tag) {
      // The rest of the envelope that recvConnect took on this thread. Its size checked before it
      // is taken: a wrong one takes nothing, and the recv can be made again.
      if (it->second.front().bytes.size() != size) {
        throw Error(ErrorKind::InvalidArgument, "kvlink InvalidArgument: recv of " + std::to_string(size) +
                                                    " bytes on tag " + std::to_string(tag) + ", message has " +
                                                    std::to_string(it->second.front().bytes.size()));
      }
      Message m = std::move(it->second.front());
      it->second.erase(it->second.begin());
      if (it->second.empty()) incoming_.erase(it);
      if (size > 0) std::memcpy(data, m.bytes.data(), size);
      return;
    }
  }
  if (isEnvelopeTag(tag)) {
    throw Error(ErrorKind::InvalidArgument,
                "kvlink InvalidArgument: recv on envelope tag " + std::to_string(tag) + " with no envelope taken");
  }
  if (isReadyTag(tag)) {
    recvReady(ctx, data, size);
  } else {
    recvData(ctx, data, size);
  }
}

// Generation side ------------------------------------------------------------------------------

void KvlinkConnection::sendEnvelope(std::vector<Message>&& msgs) const {
  auto const& info = msgs.back().bytes;
  if (info.size() < sizeof(std::uint64_t)) {
    throw Error(ErrorKind::InvalidArgument, "kvlink InvalidArgument: request info shorter than its request id");
  }
  std::uint64_t id = 0;
  std::memcpy(&id, info.data(), sizeof id);  // RequestInfo::serialize writes the id first
  auto const self = std::this_thread::get_id();
  std::shared_ptr<GenRequest> previous;
  auto r = std::make_shared<GenRequest>();
  r->id = id;
  r->deadline = after(m_.timeout());
  {
    // The check and the recording of this thread's request are ONE critical section: two threads
    // sending ids a tag cannot tell apart at the same time must not both pass the check (the
    // settle and the advertisement below run unlocked). Not usable by any recv until its ready
    // signal is taken; taken out again if it never goes out.
    std::lock_guard<std::mutex> g(mu_);
    auto const now = Clock::now();
    auto const refuseIfShared = [&](std::shared_ptr<GenRequest> const& r) {
      // Another thread's request, open on this connection until that thread sends its next one
      // or its deadline passes (a retired one: its thread is gone): their tags must stay distinct.
      // Compared on the 12 id bits every upstream release puts in a tag (a newer release's 23
      // bits would tell more apart).
      if (!r || now > r->deadline + m_.grace()) return;
      if (r->id == id || (r->id & 0xFFFu) == (id & 0xFFFu)) {
        throw AmbiguousTagError(static_cast<int>(((id & 0xFFFu) << 8) | 43u), id, r->id,
                                "kvlink: request " + std::to_string(id) + " would share its data tags with request " +
                                    std::to_string(r->id) + ", in flight on the same connection; refused");
      }
    };
    for (auto const& [thread, r] : gen_) {
      if (thread != self) refuseIfShared(r);
    }
    for (auto const& r : retired_) refuseIfShared(r);
    auto it = gen_.find(self);
    if (it != gen_.end()) previous = it->second;
    r->envelope = RequestKey{id, m_.nextGeneration()};
    gen_[self] = r;
  }
  try {
    if (previous && !previous->settled) settle(*previous);
    {
      std::lock_guard<std::mutex> g(mu_);
      r->deadline = after(m_.timeout());  // counted from when the request goes out
    }
    Header h;
    h.kind = Kind::Envelope;
    h.tag = kInfoTag;
    h.closes = previous ? previous->id + 1 : 0;
    h.messages = std::move(msgs);
    std::vector<Buffer> ready{Buffer{BufferKind::Kv, 0, r->readyByte.get(), 1, -1}};
    startTransfer(id, "kvlink: request " + std::to_string(id),
                  [&] { m_.engine().advertise(r->envelope, {}, remote_, ready, encode(h)); });
  } catch (...) {
    std::lock_guard<std::mutex> g(mu_);
    auto it = gen_.find(self);
    if (it != gen_.end() && it->second == r) gen_.erase(it);
    throw;
  }
}

void KvlinkConnection::recvReady(kv::DataContext const& ctx, void* data, size_t size) const {
  if (size != 1) throw Error(ErrorKind::InvalidArgument, "kvlink InvalidArgument: a ready signal is one byte");
  std::shared_ptr<GenRequest> r;
  {
    std::lock_guard<std::mutex> g(mu_);
    auto it = gen_.find(std::this_thread::get_id());
    if (it != gen_.end()) r = it->second;
  }
  if (!r) throw Error(ErrorKind::InvalidArgument, "kvlink InvalidArgument: ready signal awaited before a request was sent");
  if (!tagNames(ctx.getTag(), r->id)) {
    throw Error(ErrorKind::InvalidArgument, "kvlink InvalidArgument: ready tag " + std::to_string(ctx.getTag()) +
                                                " does not name " + describe(r->id, ctx.getTag()));
  }
  if (r->settled) throw Error(ErrorKind::InvalidArgument, "kvlink InvalidArgument: ready signal already taken");
  Outcome const o = m_.engine().wait_receiver(r->envelope, r->deadline + m_.grace(), ctx.getTransferTerminate());
  std::optional<bool> answer;
  if (o == Outcome::Completed) {
    answer = *r->readyByte != 0;
  } else if (o == Outcome::Rejected) {
    answer = false;
  }
  {
    // Under the lock: `recvData` on other threads (a formatter's helpers) reads `ready` there.
    std::lock_guard<std::mutex> g(mu_);
    r->settled = true;
    if (answer) r->ready = answer;
  }
  if (!answer) {
    throw TransferError(static_cast<int>(o), r->id,
                        "kvlink: ready signal of request " + std::to_string(r->id) + " ended " + to_string(o));
  }
  bool const ready = *answer;
  std::memcpy(data, &ready, 1);
}

void KvlinkConnection::recvData(kv::DataContext const& ctx, void* data, size_t size) const {
  // The request: the one this thread sent last on this connection if the tag names it (upstream
  // runs sendRequestInfo and unformat on one thread), else the one accepted request here that
  // the tag names (a formatter that receives on helper threads). Two: refused.
  int const tag = ctx.getTag();
  std::shared_ptr<GenRequest> r;
  {
    std::lock_guard<std::mutex> g(mu_);
    auto const now = Clock::now();
    // A request is its recv's even past its deadline: the recv then ends TimedOut below (a
    // TransferError), not UnknownRequest as if no request had been sent. This thread's own
    // request first; else the one accepted request here that the tag names (a formatter's
    // helper thread), where one past its deadline and grace gives way to one that is not
    // (`sendEnvelope` let that one in with the same tag bits only then). Found by review: a
    // helper's recv past the deadline was UnknownRequest.
    auto const named = [&](std::shared_ptr<GenRequest> const& q) {
      return q && q->ready.value_or(false) && tagNames(tag, q->id);
    };
    auto mine = gen_.find(std::this_thread::get_id());
    if (mine != gen_.end() && named(mine->second)) {
      r = mine->second;
    } else {
      // The live requests the tag names first, then (none live) those past it; two of one
      // group with different ids are ambiguous.
      std::shared_ptr<GenRequest> found[2];  // live, past
      std::optional<std::uint64_t> clash[2];
      for (auto const& [thread, q] : gen_) {
        (void)thread;
        if (!named(q)) continue;
        int const past = now <= q->deadline + m_.grace() ? 0 : 1;
        if (!found[past]) {
          found[past] = q;
        } else if (found[past]->id != q->id) {
          clash[past] = q->id;
        }
      }
      int const group = found[0] ? 0 : 1;
      r = found[group];
      if (clash[group]) {
        throw AmbiguousTagError(tag, r->id, *clash[group],
                                "kvlink: data tag " + std::to_string(tag) + " names requests " + std::to_string(r->id) +
                                    " and " + std::to_string(*clash[group]) + " on this connection; refused");
      }
    }
  }
  if (!r) {
    throw Error(ErrorKind::UnknownRequest, "kvlink UnknownRequest: data recv on tag " + std::to_string(tag) +
                                               " names no accepted request on this connection");
  }
  if (data == nullptr || size == 0) throw Error(ErrorKind::InvalidArgument, "kvlink InvalidArgument: empty recv");
  // Not cut to whole milliseconds: with 0.7 ms left the recv is still made (advertise rounds up).
  auto const left = r->deadline - Clock::now();
  if (left <= Clock::duration::zero()) {
    throw TransferError(static_cast<int>(Outcome::TimedOut), r->id,
                        "kvlink: request " + std::to_string(r->id) + " passed its deadline before this recv");
  }
  Header h;
  h.kind = Kind::Data;
  h.tag = tag;
  h.envelopeGeneration = r->envelope.generation;
  Buffer b{BufferKind::Kv, 0, data, size, m_.cuda().deviceOf(data)};
  // Each recv is a request of its own under the request's id, told apart by its generation.
  // Two recvs of one request on two threads (a formatter's helpers) take generations in one
  // order and may start in the other: the engine refuses to start one older than a receive of
  // that id already running (a retry's stale attempt), StaleGeneration, before anything is
  // posted. That one takes a newer generation and starts again (before, its recv failed).
  RequestKey key{r->id, m_.nextGeneration()};
  for (int tries = 1;; ++tries) {
    try {
      startTransfer(r->id, "kvlink: recv of " + describe(r->id, tag),
                    [&] { m_.engine().advertise(key, {}, remote_, {b}, encode(h), left); });
      break;
    } catch (Error const& e) {
      if (e.kind() != ErrorKind::StaleGeneration || tries >= 64) throw;
      key.generation = m_.nextGeneration();
    }
  }
  Outcome const o = m_.engine().wait_receiver(key, r->deadline + m_.grace(), ctx.getTransferTerminate());
  if (o != Outcome::Completed) {
    throw TransferError(static_cast<int>(o), r->id,
                        "kvlink: recv of " + describe(r->id, tag) + " ended " + to_string(o));
  }
}

// Context side ---------------------------------------------------------------------------------

void KvlinkConnection::adoptEnvelope(Advertisement const& adv, Header&& h) const {
  if (!h.messages.empty()) ownThreadState(this);  // before mu_: it takes the live connections' lock
  std::lock_guard<std::mutex> g(mu_);
  // The generation thread moved on: that request is over.
  if (h.closes != 0) endCtx(h.closes - 1);
  CtxRequest r;
  r.id = adv.key.request;
  r.envelope = adv.key;
  r.deadline = adv.deadline;
  r.adopted = ++adoptions_;
  ctx_[r.id] = r;
  if (!h.messages.empty()) incoming_[std::this_thread::get_id()] = std::move(h.messages);
}

void KvlinkConnection::queueData(Advertisement&& adv, Header&& h) const {
  {
    std::lock_guard<std::mutex> g(mu_);
    auto it = ctx_.find(adv.key.request);
    bool const ended = it != ctx_.end() && !it->second.open && it->second.envelope.generation == h.envelopeGeneration;
    if (ended || data_.size() >= kMaxBuffersQueued) {
      // A buffer of a request that already ended here: no send will fill it. Refused now, so the
      // generation rank's recv ends at once instead of at its deadline. Past the bound: refused.
      try {
        m_.engine().accept(adv.key, remote_, false);
      } catch (Error const&) {
        // Already ended.
      }
      return;
    }
    data_.push_back(DataAdvert{std::move(adv), h.tag});
  }
  cv_.notify_all();
}

void KvlinkConnection::endCtx(std::uint64_t id) const {
  // A send of it still running here ends Cancelled (not UnknownRequest); its buffers queued here
  // are refused, as are those that come later (queueData).
  auto it = ctx_.find(id);
  if (it != ctx_.end()) it->second.open = false;
  for (auto d = data_.begin(); d != data_.end();) {
    if (d->adv.key.request != id) {
      ++d;
      continue;
    }
    try {
      m_.engine().accept(d->adv.key, remote_, false);
    } catch (Error const&) {
      // Already ended.
    }
    d = data_.erase(d);
  }
  cv_.notify_all();
}

std::vector<KvlinkConnection::CtxRequest*> KvlinkConnection::openCtxNaming(int tag, bool answered) const {
  std::vector<CtxRequest*> out;
  auto const now = Clock::now();
  for (auto& [id, r] : ctx_) {
    (void)id;
    if (!r.open || r.answered != answered || now > r.deadline + m_.grace()) continue;
    if (tagNames(tag, r.id)) out.push_back(&r);
  }
  return out;
}

void KvlinkConnection::sendReady(kv::DataContext const& ctx, void const* data, size_t size) const {
  // Upstream sends the ready signal on the thread that takes every generation rank's requests
  // (CacheSender's response loop), which ends for good on an exception: every request after it,
  // from every rank, then fails. So only the host's own mistake throws here. A request that
  // ended (its generation rank gave up or died, its deadline and grace passed, the rank's next
  // envelope closed it) is told to the hook and left to its data sends, which fail for that
  // request alone, on the host's per-request path (TransferError, or UnknownRequest once it is
  // forgotten).
  if (size != 1) throw Error(ErrorKind::InvalidArgument, "kvlink InvalidArgument: a ready signal is one byte");
  bool const ready = *static_cast<std::uint8_t const*>(data) != 0;
  CtxRequest r;
  {
    std::lock_guard<std::mutex> g(mu_);
    auto found = openCtxNaming(ctx.getTag(), false);
    if (!found.empty()) {
      // Two open requests that the tag names. A request whose own tag it is comes first: in
      // newer releases one whose 23 id bits are all zero (id 0, 2^23) has tag 42, which by the
      // older releases' rule (their fixed ready tag) names every request. Otherwise (the older
      // fixed tag) the one adopted first, the order upstream takes them in.
      auto const bits = static_cast<std::uint64_t>(static_cast<std::uint32_t>(ctx.getTag()) >> 8);
      auto const rank = [bits](CtxRequest const* q) {
        bool const own = (q->id & 0x7FFFFFu) == bits || (q->id & 0xFFFu) == bits;
        return std::make_pair(own ? 0 : 1, q->adopted);
      };
      CtxRequest* pick = *std::min_element(found.begin(), found.end(), [&](CtxRequest const* a, CtxRequest const* b) {
        return rank(a) < rank(b);
      });
      pick->answered = true;
      if (!ready) pick->open = false;
      r = *pick;
    }
  }
  if (r.adopted == 0) {
    m_.warn("a ready signal on tag " + std::to_string(ctx.getTag()) +
            " names no request awaiting one here (ended, or past its deadline): not sent");
    return;
  }
  auto const ended = [&](Outcome o, char const* when) {
    {
      std::lock_guard<std::mutex> g(mu_);
      endCtx(r.id);
    }
    m_.warn("request " + std::to_string(r.id) + " ended " + to_string(o) + " " + when +
            "; its data sends will fail");
  };
  Outcome gone = Outcome::Cancelled;
  if (!acceptOrEnded(m_.engine(), r.envelope, remote_, ready, m_.grace(), gone)) {
    ended(gone, "before its ready signal");
    return;
  }
  if (!ready) return;
  std::uint8_t const one = 1;
  std::atomic<bool> const& terminate = ctx.getTransferTerminate();
  Outcome o = Outcome::Cancelled;
  try {
    o = m_.engine().send(r.envelope, remote_, 0, &one, 1, r.deadline, terminate);
  } catch (Error const& e) {
    // The request went from under the call (forgotten here, its generation rank's process
    // replaced): an end like the others, not the host's mistake.
    {
      std::lock_guard<std::mutex> g(mu_);
      endCtx(r.id);
    }
    m_.warn("the ready signal of request " + std::to_string(r.id) + " failed (" + e.what() +
            "); its data sends will fail");
    return;
  }
  if (o == Outcome::Completed) {
    // The byte is out. Its verdict (the generation rank's word that it landed) is taken by the
    // request's first data send, on the host's thread for this request: waited for here, on the
    // thread that takes every generation rank's requests (upstream's response thread), one rank
    // that never answers held up all others' requests until its deadline, and theirs ran out.
    std::lock_guard<std::mutex> g(mu_);
    auto it = ctx_.find(r.id);
    if (it != ctx_.end() && it->second.envelope == r.envelope) it->second.readyUnconfirmed = true;
    return;
  }
  Outcome verdict = Outcome::Cancelled;
  try {
    verdict = m_.engine().wait_sender(r.envelope, remote_, r.deadline + m_.grace());
  } catch (Error const&) {
    // Forgotten meanwhile: ended.
  }
  if (verdict != Outcome::Completed) ended(verdict, "with its ready signal");
}

void KvlinkConnection::sendData(kv::DataContext const& ctx, void const* data, size_t size) const {
  int const tag = ctx.getTag();
  std::atomic<bool> const& terminate = ctx.getTransferTerminate();
  std::unique_lock<std::mutex> g(mu_);
  auto found = openCtxNaming(tag, true);
  if (found.empty()) {
    for (auto const& [cid, c] : ctx_) {
      if (!c.open && tagNames(tag, cid)) {
        throw TransferError(static_cast<int>(Outcome::Cancelled), cid,
                            "kvlink: send of " + describe(cid, tag) + ": the request already ended");
      }
    }
    throw Error(ErrorKind::UnknownRequest,
                "kvlink UnknownRequest: no accepted request on this connection for tag " + std::to_string(tag));
  }
  if (found.size() > 1) {
    throw AmbiguousTagError(tag, found[0]->id, found[1]->id,
                            "kvlink: data tag " + std::to_string(tag) + " names requests " +
                                std::to_string(found[0]->id) + " and " + std::to_string(found[1]->id) +
                                ", both in flight on this connection; refused");
  }
  // As an empty recv is refused (it advertises no buffer), an empty send is refused at once,
  // taking nothing: it would wait for an advertisement that never comes, to the deadline.
  if (size == 0) throw Error(ErrorKind::InvalidArgument, "kvlink InvalidArgument: empty send");
  std::uint64_t const id = found[0]->id;
  Deadline const deadline = found[0]->deadline;
  if (found[0]->readyUnconfirmed) {
    // The verdict of the ready signal (sendReady): a generation rank that did not take it has
    // no buffer to advertise.
    found[0]->readyUnconfirmed = false;
    RequestKey const envelope = found[0]->envelope;
    g.unlock();
    Outcome verdict = Outcome::Cancelled;
    try {
      verdict = m_.engine().wait_sender(envelope, remote_, deadline + m_.grace(), CancelRef(terminate));
    } catch (Error const&) {
      // Already settled and taken: it did not complete here.
    }
    g.lock();
    if (verdict != Outcome::Completed) {
      endCtx(id);
      throw TransferError(static_cast<int>(verdict), id,
                          "kvlink: ready signal of request " + std::to_string(id) + " ended " + to_string(verdict));
    }
  }
  // Wait for the generation rank's advertisement of the buffer this send fills.
  std::optional<Advertisement> adv;
  // Since when only buffers of another size are queued under this tag.
  std::optional<Clock::time_point> othersSince;
  for (;;) {
    // One of this size first: another block of the same request and tag may be of another
    // size (before, a send took the first buffer of its tag, and when the other block's came
    // first, the request failed on the size). With only others queued, one of this size is
    // waited for a moment (kOtherSizeGrace: another thread's recv may not have advertised
    // yet); then the first of its tag is taken and refused below (a size the generation rank
    // does not expect is a mismatch upstream never retries, so both ranks end), as is a
    // malformed advertisement (not one buffer) at once.
    auto const mine = [&](DataAdvert const& d) { return d.adv.key.request == id && d.tag == tag; };
    auto it = std::find_if(data_.begin(), data_.end(), [&](DataAdvert const& d) {
      return mine(d) && (d.adv.buffers.size() != 1 || d.adv.buffers[0].size == size);
    });
    if (it == data_.end()) {
      auto const other = std::find_if(data_.begin(), data_.end(), mine);
      if (other == data_.end()) {
        othersSince.reset();
      } else if (!othersSince) {
        othersSince = Clock::now();
      } else if (Clock::now() - *othersSince >= kOtherSizeGrace) {
        it = other;
      }
    }
    if (it != data_.end()) {
      adv = std::move(it->adv);
      data_.erase(it);
      break;
    }
    // Given up before the buffer came: the request ends here, and the buffer it would have
    // filled is refused when it comes, not left queued for its recv to wait out its deadline.
    auto const self = ctx_.find(id);
    if (terminate.load(std::memory_order_acquire) || !m_.isRunning() || self == ctx_.end() || !self->second.open) {
      endCtx(id);
      throw TransferError(static_cast<int>(Outcome::Cancelled), id, "kvlink: send of " + describe(id, tag) + " cancelled");
    }
    if (Clock::now() >= deadline) {
      endCtx(id);
      throw TransferError(static_cast<int>(Outcome::TimedOut), id,
                          "kvlink: send of " + describe(id, tag) + ": no buffer advertised by the deadline");
    }
    // The generation rank's connection failed or it left (its manager destroyed) since its
    // request info came: its side of the request has ended PeerLost, and the buffer will never
    // be advertised. Ends now rather than at the deadline.
    if (m_.engine().peer_state(remote_) != PeerState::Connected) {
      endCtx(id);
      throw TransferError(static_cast<int>(Outcome::PeerLost), id,
                          "kvlink: send of " + describe(id, tag) + ": rank " + std::to_string(remote_) +
                              " is gone (its connection failed, or it left) before it advertised the buffer");
    }
    cv_.wait_for(g, 5ms);  // the terminate flag cannot notify: look every 5 ms
  }
  g.unlock();
  if (adv->buffers.size() != 1) {
    // The generation rank's mistake (its recv advertises one buffer): refused.
    Outcome ignored = Outcome::Rejected;
    (void)acceptOrEnded(m_.engine(), adv->key, remote_, false, m_.grace(), ignored);
    throw Error(ErrorKind::Protocol, "kvlink Protocol: the buffer advertisement for " + describe(id, tag) + " has " +
                                         std::to_string(adv->buffers.size()) + " buffers, not 1: refused");
  }
  if (adv->buffers[0].size != size) {
    Outcome ignored = Outcome::Rejected;
    (void)acceptOrEnded(m_.engine(), adv->key, remote_, false, m_.grace(), ignored);
    throw Error(ErrorKind::InvalidArgument, "kvlink InvalidArgument: send of " + std::to_string(size) + " bytes for " +
                                                describe(id, tag) + " into a buffer of " +
                                                std::to_string(adv->buffers[0].size) + ": refused");
  }
  Outcome ended = Outcome::Cancelled;
  if (!acceptOrEnded(m_.engine(), adv->key, remote_, true, m_.grace(), ended)) {
    std::lock_guard<std::mutex> lk(mu_);
    endCtx(id);
    throw TransferError(static_cast<int>(ended), id, "kvlink: send of " + describe(id, tag) + " ended " + to_string(ended));
  }
  int const device = m_.cuda().deviceOf(data);
  Outcome o = Outcome::Cancelled;
  if (!terminate.load(std::memory_order_acquire)) {
    try {
      o = device >= 0 ? m_.engine().send_device(adv->key, remote_, adv->buffers[0].segment, device,
                                                reinterpret_cast<std::uint64_t>(data), size, adv->deadline, terminate)
                      : m_.engine().send(adv->key, remote_, adv->buffers[0].segment, data, size, adv->deadline, terminate);
    } catch (Error const&) {
      // The send could not start (a CUDA error staging device memory, ...): the request it
      // accepted ends now, on both ranks, as the other failures here end it; before, it stayed
      // open and answered, and the generation rank's recv waited out its deadline.
      try {
        m_.engine().cancel(adv->key);
      } catch (Error const&) {
        // Already ended.
      }
      try {
        (void)m_.engine().wait_sender(adv->key, remote_, adv->deadline + m_.grace());
      } catch (Error const&) {
        // Already taken.
      }
      std::lock_guard<std::mutex> lk(mu_);
      endCtx(id);
      throw;
    }
  } else {
    try {
      m_.engine().cancel(adv->key);
    } catch (Error const&) {
      // Already ended.
    }
  }
  Outcome const verdict = m_.engine().wait_sender(adv->key, remote_, adv->deadline + m_.grace(),
                                                  o == Outcome::Completed ? CancelRef(terminate) : CancelRef());
  if (verdict != Outcome::Completed) {
    std::lock_guard<std::mutex> lk(mu_);
    endCtx(id);
    throw TransferError(static_cast<int>(verdict), id, "kvlink: send of " + describe(id, tag) + " ended " + to_string(verdict));
  }
}

// --- Options, logging ---------------------------------------------------------------------------

int levelFromEnv() {
  std::string const l = envOr(nullptr, "TRTLLM_LOG_LEVEL", "WARNING");
  if (l == "ERROR" || l == "error") return 1;
  if (l == "INFO" || l == "info") return 3;
  if (l == "DEBUG" || l == "debug" || l == "VERBOSE" || l == "verbose") return 4;
  if (l == "TRACE" || l == "trace") return 5;
  return 2;
}

std::string uniqueAgentName() {
  char host[256] = {0};
  if (gethostname(host, sizeof host - 1) != 0) std::strcpy(host, "host");
  std::random_device rd;
  return std::string(host) + "_" + std::to_string(getpid()) + "_" + std::to_string(rd());
}

/// `s` as a whole decimal number: digits only (no sign, space or suffix), within 64 bits.
std::optional<std::uint64_t> parseDigits(std::string const& s) {
  if (s.empty() || !std::all_of(s.begin(), s.end(), [](char c) { return std::isdigit(static_cast<unsigned char>(c)); })) {
    return std::nullopt;
  }
  errno = 0;
  unsigned long long const v = std::strtoull(s.c_str(), nullptr, 10);
  if (errno == ERANGE) return std::nullopt;
  return v;
}

std::uint32_t randomRankId() {
  std::random_device rd;
  std::uint32_t r = 0;
  while (r == 0) r = rd();
  return r;
}

}  // namespace
}  // namespace kvlink::trtllm

namespace {

/// Writes `what` into the host's error buffer (cut to fit, NUL-terminated; allocates nothing)
/// and returns the factory's failure, NULL.
void* failWith(char* error, size_t error_size, char const* what) noexcept {
  if (error != nullptr && error_size > 0) {
    std::strncpy(error, what, error_size - 1);
    error[error_size - 1] = '\0';
  }
  return nullptr;
}

/// The factory's work; `makeKvlinkConnectionManager` keeps every exception, even one its error
/// message throws, inside.
void* makeManager(KvlinkTrtllmOptions const* o, char* error, size_t error_size) {
  using namespace kvlink;
  using namespace kvlink::trtllm;
  auto const fail = [&](std::string const& what) { return failWith(error, error_size, what.c_str()); };
  if (o == nullptr || o->struct_size != sizeof(KvlinkTrtllmOptions)) return fail("kvlink: bad KvlinkTrtllmOptions");
  if (o->rank < 0 || o->world_size < 1 || o->rank >= o->world_size) {
    return fail("kvlink: rank " + std::to_string(o->rank) + " outside world_size " + std::to_string(o->world_size));
  }
  try {
    EngineConfig c;
    c.name = envOr(o->agent_name, "TRTLLM_KVLINK_AGENT_NAME", "");
    if (c.name.empty()) c.name = uniqueAgentName();
    // kvlink ranks must be unique across the context and generation instances, which TensorRT-LLM's
    // per-instance rank is not: a random 32-bit id (or TRTLLM_KVLINK_RANK_ID) names this engine.
    std::string const rankId = envOr(nullptr, "TRTLLM_KVLINK_RANK_ID", "");
    if (rankId.empty()) {
      c.rank = randomRankId();
    } else {
      // All digits and at most 2^32 - 1: never cut to 32 bits (4294967297 is not rank 1) nor
      // wrapped from a sign (strtoul takes "-1").
      std::optional<std::uint64_t> const v = parseDigits(rankId);
      if (!v || *v > UINT32_MAX) {
        return fail("kvlink: TRTLLM_KVLINK_RANK_ID=" + rankId + " is not a number from 0 to 4294967295");
      }
      c.rank = static_cast<std::uint32_t>(*v);
    }
    c.transport = envOr(o->transport, "TRTLLM_KVLINK_TRANSPORT", "tcp");
    // tcp listens, with or without devices (`tcp@eth1`), at the wildcard unless told where; the
    // engine publishes a wildcard listener at an address of one of this host's interfaces
    // (`Engine::address`). `auto` and UCX lists listen where told (never ignored), shared memory
    // never (it is reached by worker address).
    bool const tcp = c.transport == "tcp" || c.transport.rfind("tcp@", 0) == 0;
    std::string const base = c.transport.substr(0, c.transport.find('@'));
    bool const sm = base == "sm" || base == "shm" || base == "shared-memory";
    c.listen = tcp ? envOr(o->listen, "TRTLLM_KVLINK_LISTEN", "0.0.0.0:0")
                   : (sm ? "" : envOr(o->listen, "TRTLLM_KVLINK_LISTEN", ""));
    // The engine takes longer durations as a year; so does the wrapper, whose own deadlines
    // (`after(timeout)`, `deadline + grace`) would otherwise overflow the clock into the past.
    constexpr std::int64_t kYearMs = 365LL * 24 * 3600 * 1000;
    std::uint64_t timeout = o->kv_transfer_timeout_ms > 0 ? static_cast<std::uint64_t>(o->kv_transfer_timeout_ms) : 0;
    if (timeout == 0) {
      // Left out of the config: the environment, all digits and positive (never "5s" as 5 ms).
      std::string const env = envOr(nullptr, "TRTLLM_KVLINK_TIMEOUT_MS", "60000");
      std::optional<std::uint64_t> const v = parseDigits(env);
      if (!v || *v == 0) {
        return fail("kvlink: TRTLLM_KVLINK_TIMEOUT_MS=" + env + " is not a positive number of milliseconds");
      }
      timeout = *v;
    }
    c.timeout = std::chrono::milliseconds(static_cast<std::int64_t>(std::min<std::uint64_t>(timeout, kYearMs)));
    c.agreement_bound =
        std::chrono::milliseconds(static_cast<std::int64_t>(std::min<std::uint64_t>(o->agreement_ms, kYearMs)));
    if (o->fault_suppress_request >= 0) c.fault_suppress_request = static_cast<std::uint64_t>(o->fault_suppress_request);
    // The hook is installed before the manager is made, so that what making it logs reaches
    // the host too.
    std::optional<Manager::LogHook> const hook = Manager::hookOf(*o);
    if (hook) {
      std::lock_guard<std::mutex> g(Manager::logMutex());
      Manager::installLogHook(*hook);
    }
    std::unique_ptr<Manager> m;
    try {
      m = Manager::make(*o, c);
    } catch (...) {
      // The hook must not outlive this failed call (the host may free `log_user` once it has
      // NULL): the sink goes back to a live manager's hook, or nowhere.
      if (hook) {
        bool settle = false;
        {
          std::lock_guard<std::mutex> g(Manager::logMutex());
          settle = Manager::reinstallLogHookLocked();
        }
        if (settle) Manager::settleReplacedHook();
      }
      throw;
    }
    if (hook) {
      try {
        m->holdLogSink(*hook);
      } catch (...) {
        // As for a failed make: the hook must not outlive this call.
        bool settle = false;
        {
          std::lock_guard<std::mutex> g(Manager::logMutex());
          settle = Manager::reinstallLogHookLocked();
        }
        if (settle) Manager::settleReplacedHook();
        throw;
      }
    }
    return static_cast<::tensorrt_llm::executor::kv_cache::ConnectionManager*>(m.release());
  } catch (std::exception const& e) {
    return fail(e.what());
  } catch (...) {
    return fail("kvlink: unknown error");
  }
}

}  // namespace

extern "C" __attribute__((visibility("default"))) void* makeKvlinkConnectionManager(KvlinkTrtllmOptions const* o,
                                                                                  char* error, size_t error_size) {
  try {
    return makeManager(o, error, error_size);
  } catch (...) {
    // The message itself could not be built (memory exhausted): nothing may leave a C
    // function, so a fixed one, written without allocating.
    return failWith(error, error_size, "kvlink: out of memory");
  }
}
