// Errors cross from Rust as kvlink::Error with a stable kind, tested without parsing text.
#include <kvlink/kvlink.hpp>

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <thread>

TEST(Errors, BadAddressThrowsInvalidArgument) {
  try {
    kvlink::check_listen_address("not-an-address");
    FAIL() << "expected kvlink::Error";
  } catch (const kvlink::Error& e) {
    EXPECT_EQ(e.kind(), kvlink::ErrorKind::InvalidArgument);
    EXPECT_EQ(e.code(), 1);
  }
}

TEST(Errors, IsAStdRuntimeError) {
  EXPECT_THROW(kvlink::check_listen_address("127.0.0.1"), std::runtime_error);
}

TEST(Errors, KindSlotIsClearedAfterTheFacadeReadsIt) {
  EXPECT_THROW(kvlink::check_listen_address(""), kvlink::Error);
  EXPECT_EQ(kvlink::ffi::take_last_error_kind(), 0);
}

TEST(Errors, KindIsPerThread) {
  // A failure on another thread must not leak its kind into this one.
  std::thread([] { EXPECT_THROW(kvlink::check_listen_address("x:1"), kvlink::Error); }).join();
  EXPECT_EQ(kvlink::ffi::take_last_error_kind(), 0);
}

TEST(Errors, NonUtf8ArgumentIsInvalidArgument) {
  try {
    kvlink::check_listen_address(std::string("127.0.0.1:\xff\xfe", 12));
    FAIL() << "expected kvlink::Error";
  } catch (const kvlink::Error& e) {
    EXPECT_EQ(e.kind(), kvlink::ErrorKind::InvalidArgument);
  }
}

// The C++ enum and the Rust enum must agree number by number: ask Rust for the name of each code.
TEST(Errors, KindNumbersMatchRust) {
  for (std::uint8_t code = 1; code <= 17; ++code) {
    const auto kind = static_cast<kvlink::ErrorKind>(code);
    EXPECT_EQ(std::string(kvlink::ffi::error_kind_name(code)), kvlink::to_string(kind))
        << "code " << int(code);
  }
  EXPECT_EQ(std::string(kvlink::ffi::error_kind_name(0)), "Unknown");
  EXPECT_EQ(std::string(kvlink::ffi::error_kind_name(18)), "Unknown")
      << "Rust has a kind C++ does not know: add it to kvlink::ErrorKind";
  EXPECT_STREQ(kvlink::to_string(static_cast<kvlink::ErrorKind>(200)), "Unknown");
}

TEST(Errors, OutcomeNames) {
  EXPECT_STREQ(kvlink::to_string(kvlink::Outcome::Completed), "Completed");
  EXPECT_EQ(static_cast<int>(kvlink::Outcome::TimedOut), 1);
  EXPECT_EQ(static_cast<int>(kvlink::Outcome::Rejected), 4);
}
