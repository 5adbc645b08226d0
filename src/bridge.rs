//! The only file that knows cxx: declarations and one-line forwarders. Every exported function
//! goes through [`guard`], the single panic boundary.
use crate::boundary::{guard, take_last_error_kind};
use crate::error::Error;

#[cxx::bridge(namespace = "kvlink::ffi")]
mod ffi {
    extern "Rust" {
        /// The library version (Cargo package version).
        fn version() -> String;
        /// Kind code (see `kvlink::ErrorKind`) of the last error thrown on this thread; 0 if none.
        /// Reading clears it.
        fn take_last_error_kind() -> u8;
        /// Stable name of an error kind code ("InvalidArgument", ...), "Unknown" for others.
        fn error_kind_name(code: u8) -> &'static str;
        /// Parses and checks an `ip:port` listen address; returns its canonical form.
        /// Throws InvalidArgument on anything else.
        fn check_listen_address(addr: &str) -> Result<String>;
    }
}

fn version() -> String {
    env!("CARGO_PKG_VERSION").to_string()
}

fn error_kind_name(code: u8) -> &'static str {
    crate::error::ErrorKind::from_code(code).map_or("Unknown", |k| k.name())
}

fn check_listen_address(addr: &str) -> Result<String, Error> {
    guard(|| crate::config::parse_listen_address(addr).map(|a| a.to_string()))
}
