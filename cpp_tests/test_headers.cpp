// The header-alone check's result: every public header got its own translation unit (see
// cpp_tests/CMakeLists.txt); if one did not compile, this binary would not have linked.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

std::vector<std::string> kvlink_headers_checked_alone();

TEST(PublicHeaders, EachCompilesAlone) {
  const auto headers = kvlink_headers_checked_alone();
  for (const char* expected :
       {"kvlink/kvlink.hpp", "kvlink/engine.hpp", "kvlink/trtllm_adapter.h", "kvlink/bridge.h", "rust/cxx.h"}) {
    EXPECT_NE(std::find(headers.begin(), headers.end(), expected), headers.end())
        << expected << " was not compiled on its own";
  }
}
