//! Built against `KVLINK_UCX_ROOT`, kvlink's build script reports that UCX's lib directory
//! (`DEP_KVLINK_LIBDIR`, through `links = "kvlink"`): give the bench an rpath to it, so it and
//! the peers it re-executes load that UCX, and tell it where that UCX's own `ucx_perftest` and
//! `ucx_info` are, so the baseline is the same UCX generation as what it measures.
fn main() {
    println!("cargo:rerun-if-env-changed=KVLINK_UCX_ROOT");
    let libdir = std::env::var("DEP_KVLINK_LIBDIR").unwrap_or_default();
    if !libdir.is_empty() {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{libdir}");
    }
    println!("cargo:rustc-env=KVLINK_BENCH_UCX_LIBDIR={libdir}");
}
