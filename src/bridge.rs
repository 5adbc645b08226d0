#[cxx::bridge(namespace = "kvlink::ffi")]
mod ffi {
    extern "Rust" {
        fn version() -> String;
    }
}
fn version() -> String { env!("CARGO_PKG_VERSION").to_string() }
