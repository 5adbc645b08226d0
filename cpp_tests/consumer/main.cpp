// Calls kvlink through the installed package and checks the results; exit code 0 means the
// package works for a consumer.
#include <kvlink/kvlink.hpp>

#include <iostream>
#include <string>

int main() {
  const std::string version = kvlink::version();
  if (version != KVLINK_EXPECTED_VERSION) {
    std::cerr << "library version " << version << " != expected version " << KVLINK_EXPECTED_VERSION << "\n";
    return 1;
  }
  if (kvlink::check_listen_address("127.0.0.1:7000") != "127.0.0.1:7000") {
    std::cerr << "good address not returned in canonical form\n";
    return 2;
  }
  try {
    kvlink::check_listen_address("not-an-address");
    std::cerr << "bad address did not throw\n";
    return 3;
  } catch (const kvlink::Error& e) {
    if (e.kind() != kvlink::ErrorKind::InvalidArgument) {
      std::cerr << "bad address threw kind " << kvlink::to_string(e.kind()) << "\n";
      return 4;
    }
  }
  // The UCX it runs on is the one the package says it was built against (rpath to
  // KVLINK_UCX_ROOT, or the system UCX), not another one the loader happened to find.
  if (kvlink::ucx_version().rfind(KVLINK_PACKAGE_UCX_VERSION, 0) != 0) {
    std::cerr << "runs on UCX " << kvlink::ucx_version() << ", built against " << KVLINK_PACKAGE_UCX_VERSION << "\n";
    return 5;
  }
  std::cout << "kvlink consumer ok (kvlink " << version << ", built against UCX " << KVLINK_PACKAGE_UCX_VERSION
            << ")\n";
  return 0;
}
