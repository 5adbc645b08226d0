// libkvlink_trtllm_wrapper.so as TensorRT-LLM loads a backend: dlopen, dlsym the extern "C"
// factory, build managers, move data. This binary does not link kvlink: it only calls virtual
// functions, so every line of kvlink that runs comes out of the shared library.
#include <kvlink/trtllm_adapter.h>

#include <dlfcn.h>
#include <gtest/gtest.h>

#include <memory>
#include <thread>

namespace kv = tensorrt_llm::executor::kv_cache;
namespace bm = tensorrt_llm::batch_manager;
using kvlink::trtllm::AgentConnection;
using kvlink::trtllm::AgentConnectionManager;

namespace {

struct Library {
  void* handle = dlopen(KVLINK_WRAPPER_PATH, RTLD_NOW | RTLD_LOCAL);
  ~Library() {
    if (handle != nullptr) dlclose(handle);
  }
};

std::unique_ptr<kv::ConnectionManager> make(KvlinkMakeConnectionManagerFn fn, const char* name, uint32_t rank,
                                            const char* transport, std::string& error) {
  KvlinkManagerOptions o{};
  o.struct_size = sizeof o;
  o.name = name;
  o.rank = rank;
  o.transport = transport;
  o.listen = std::string(transport) == "tcp" ? "127.0.0.1:0" : "";
  o.kv_transfer_timeout_ms = 5000;
  o.agreement_ms = 500;
  o.fault_suppress_request = -1;
  char err[256] = {0};
  kv::ConnectionManager* m = fn(&o, err, sizeof err);
  error = err;
  return std::unique_ptr<kv::ConnectionManager>(m);
}

class WrapperTest : public testing::TestWithParam<std::string> {};

TEST_P(WrapperTest, DlopenFactoryBuildsAWorkingManager) {
  Library lib;
  ASSERT_NE(lib.handle, nullptr) << dlerror();
  auto fn = reinterpret_cast<KvlinkMakeConnectionManagerFn>(dlsym(lib.handle, "makeKvlinkConnectionManager"));
  ASSERT_NE(fn, nullptr) << dlerror();
  // Only the factory is exported: the Rust library inside stays private to the wrapper.
  EXPECT_EQ(dlsym(lib.handle, "cxxbridge1$string$new"), nullptr);

  std::string error;
  KvlinkManagerOptions bad{};
  bad.struct_size = sizeof bad;
  bad.transport = "tcp";
  bad.kv_transfer_timeout_ms = 0;  // invalid: the factory reports, does not throw across dlsym
  char err[256] = {0};
  EXPECT_EQ(fn(&bad, err, sizeof err), nullptr);
  EXPECT_NE(std::string(err).find("timeout"), std::string::npos) << err;

  {
    auto ctxBase = make(fn, "ctx", 0, GetParam().c_str(), error);
    ASSERT_TRUE(ctxBase) << error;
    auto genBase = make(fn, "gen", 1, GetParam().c_str(), error);
    ASSERT_TRUE(genBase) << error;
    EXPECT_TRUE(genBase->isRunning());
    ASSERT_EQ(genBase->getCommState().getAgentState().size(), 1u);
    // The object is the adapter's manager; its methods are virtual and run in the library.
    auto* ctx = static_cast<AgentConnectionManager*>(ctxBase.get());
    auto* gen = static_cast<AgentConnectionManager*>(genBase.get());

    std::vector<std::uint8_t> recvBuf(1024, 0), src(1024);
    for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<std::uint8_t>(i * 7 + 3);
    gen->registerReceiveBuffer(0, 0, recvBuf.data(), recvBuf.size());
    auto conns = gen->getConnections(ctx->getCommState());
    ASSERT_EQ(conns.size(), 1u);
    auto* toCtx = const_cast<AgentConnection*>(static_cast<AgentConnection const*>(conns[0]));
    bm::RequestInfo req(4242, "state");
    toCtx->sendRequestAndBufferInfo(req, {std::optional<size_t>(0)}, 0);
    bm::RequestInfo got;
    std::atomic<bool> never{false};
    auto const* fromGen = ctx->recvConnectionAndRequestInfo(got, never);
    ASSERT_NE(fromGen, nullptr);
    EXPECT_EQ(got, req);
    fromGen->sendReadySignal(kv::DataContext(42), true);
    EXPECT_EQ(toCtx->recvReadySignalWithStatus(kv::DataContext(42)), std::optional<bool>(true));
    kv::DataContext const data(kvlink::trtllm::dataTag(4242));
    std::thread t([&] { fromGen->send(data, src.data(), src.size()); });
    toCtx->recv(data, recvBuf.data(), recvBuf.size());
    t.join();
    EXPECT_EQ(recvBuf, src);
    EXPECT_EQ(gen->health().buffers_leased, 0u);
    EXPECT_EQ(gen->buffersReserved(), 0u);
  }
}

INSTANTIATE_TEST_SUITE_P(Transports, WrapperTest, testing::Values("tcp", "sm"),
                         [](const testing::TestParamInfo<std::string>& i) { return i.param; });

}  // namespace
