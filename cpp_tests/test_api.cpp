// The facade's wrappers call into Rust and return plain C++ values.
#include <kvlink/kvlink.hpp>

#include <gtest/gtest.h>

#include <string>

TEST(Api, Version) {
  const std::string v = kvlink::version();
  EXPECT_FALSE(v.empty());
  EXPECT_EQ(v, KVLINK_EXPECTED_VERSION);
}

TEST(Api, GoodAddressReturnsCanonicalForm) {
  EXPECT_EQ(kvlink::check_listen_address("127.0.0.1:5000"), "127.0.0.1:5000");
  EXPECT_EQ(kvlink::check_listen_address(" 127.0.0.1:5000 "), "127.0.0.1:5000");
  EXPECT_EQ(kvlink::check_listen_address(std::string("[::1]:0")), "[::1]:0");
}
