//! Two jobs, nothing else: compile the cxx bridge, and generate UCX bindings from the system
//! headers that `pkg-config ucx` finds (the crates.io `ucx-sys` binds UCX 1.3 and does not build).
use std::{env, path::PathBuf};

fn main() {
    cxx_build::bridge("src/bridge.rs")
        .std("c++17")
        .compile("kvlink-bridge");
    println!("cargo:rerun-if-changed=src/bridge.rs");
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=PKG_CONFIG_PATH");

    let ucx = pkg_config::Config::new()
        .atleast_version("1.12")
        .probe("ucx")
        .expect("UCX development files not found: install libucx-dev (see README)");
    for lib in ["pthread", "dl", "m", "rt"] {
        println!("cargo:rustc-link-lib={lib}");
    }

    let mut builder = bindgen::Builder::default()
        .header_contents("ucx_wrapper.h", "#include <ucp/api/ucp.h>\n")
        .allowlist_function("ucp_.*")
        .allowlist_function("ucs_status_string")
        .allowlist_type("ucp_.*")
        .allowlist_type("ucs_.*")
        .allowlist_var("UCP_.*")
        .allowlist_var("UCS_.*")
        .allowlist_var("UCT_.*")
        .prepend_enum_name(false)
        .derive_default(true)
        .layout_tests(false)
        .generate_comments(false);
    for path in &ucx.include_paths {
        builder = builder.clang_arg(format!("-I{}", path.display()));
    }
    let bindings = builder
        .generate()
        .expect("bindgen failed on <ucp/api/ucp.h>");
    let out = PathBuf::from(env::var("OUT_DIR").unwrap()).join("ucx_bindings.rs");
    bindings.write_to_file(out).expect("writing UCX bindings");
}
