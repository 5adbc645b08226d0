// The facade's wrappers call into Rust and return plain C++ values.
#include <kvlink/kvlink.hpp>

#include <gtest/gtest.h>

#include <string>

TEST(Api, Version) {
  const std::string v = kvlink::version();
  EXPECT_FALSE(v.empty());
  EXPECT_EQ(v, KVLINK_EXPECTED_VERSION);
}

TEST(Api, RunsOnTheUcxItWasBuiltAgainst) {
  // KVLINK_UCX_ROOT builds link that UCX with an rpath: the loader must not pick another one
  // (the system's) at run time.
  // A version from headers alone is major.minor: compare as a prefix.
  const std::string built = KVLINK_TEST_UCX_VERSION;
  EXPECT_EQ(kvlink::ucx_version().rfind(built, 0), 0u) << kvlink::ucx_version() << " vs " << built;
}

TEST(Api, GoodAddressReturnsCanonicalForm) {
  EXPECT_EQ(kvlink::check_listen_address("127.0.0.1:5000"), "127.0.0.1:5000");
  EXPECT_EQ(kvlink::check_listen_address(" 127.0.0.1:5000 "), "127.0.0.1:5000");
}

TEST(Api, AnIpv6AddressIsRefused) {
  // UCX's tcp transport corrupts memory on IPv6 connections (README, "Which UCX, which
  // transport"): refused as the engine refuses it.
  try {
    kvlink::check_listen_address(std::string("[::1]:0"));
    FAIL() << "[::1]:0 was accepted";
  } catch (const kvlink::Error& e) {
    EXPECT_EQ(e.kind(), kvlink::ErrorKind::InvalidArgument);
    EXPECT_NE(std::string(e.what()).find("IPv6"), std::string::npos) << e.what();
  }
}
