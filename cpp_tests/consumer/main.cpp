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
  std::cout << "kvlink consumer ok (kvlink " << version << ", built against UCX " << KVLINK_PACKAGE_UCX_VERSION
            << ")\n";
  return 0;
}
