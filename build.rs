//! Two jobs, nothing else: compile the cxx bridge, and generate UCX bindings from the headers of
//! the UCX kvlink is built against (the crates.io `ucx-sys` binds UCX 1.3 and does not build).
//!
//! Which UCX: `KVLINK_UCX_ROOT`, when set and not empty, is the prefix of any UCX install >= 1.13
//! (`include/ucp/api/ucp.h`, `lib/libucp.so`, or `lib64/`), for instance the PyPI wheel
//! `libucx-cu12`'s `site-packages/libucx`. Its pkg-config files are read for the version only:
//! their `prefix=` is where the UCX was built (the wheel's is a CI path that does not exist
//! here), so paths come from the root itself. Binaries of this package get an rpath to its
//! `lib/`; dependents find it in `DEP_KVLINK_UCX_LIBDIR` (`links = "kvlink"`). Without
//! `KVLINK_UCX_ROOT`: the UCX that `pkg-config ucx` finds (Debian 12: libucx-dev, 1.13).
//!
//! Features newer than UCX 1.13 are gated on `cfg(kvlink_ucx_1_NN)`, set for every minor
//! version from 1.14 up to the one whose headers were read, or on a probe of the headers where
//! the version that added something is not certain (`cfg(kvlink_ucx_ep_transports)`).
use std::{
    env, fs,
    path::{Path, PathBuf},
};

/// Oldest UCX kvlink builds against.
const MIN_MINOR: u32 = 13;
/// Highest minor version a `kvlink_ucx_1_NN` cfg may name (check-cfg needs the list up front).
const MAX_GATE: u32 = 40;

struct Ucx {
    include: Vec<PathBuf>,
    /// The root's lib directory (None: the system UCX, found by the linker's default paths).
    libdir: Option<PathBuf>,
    version: String,
}

fn main() {
    cxx_build::bridge("src/bridge.rs")
        .std("c++17")
        .compile("kvlink-bridge");
    println!("cargo:rerun-if-changed=src/bridge.rs");
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=PKG_CONFIG_PATH");
    println!("cargo:rerun-if-env-changed=KVLINK_UCX_ROOT");

    let ucx = match env::var_os("KVLINK_UCX_ROOT").filter(|v| !v.is_empty()) {
        Some(root) => from_root(Path::new(&root)),
        None => from_pkg_config(),
    };
    let minor = header_minor(&ucx.include);
    if minor < MIN_MINOR {
        panic!(
            "kvlink needs UCX >= 1.{MIN_MINOR}; the headers in {:?} are UCX 1.{minor}",
            ucx.include
        );
    }
    for gate in 14..=MAX_GATE {
        println!("cargo::rustc-check-cfg=cfg(kvlink_ucx_1_{gate})");
        if gate <= minor {
            println!("cargo:rustc-cfg=kvlink_ucx_1_{gate}");
        }
    }
    println!("cargo::rustc-check-cfg=cfg(kvlink_ucx_ep_transports)");
    if header_has(&ucx.include, "UCP_EP_ATTR_FIELD_TRANSPORTS") {
        // ucp_ep_query can list the transports and devices an endpoint uses (not in 1.13).
        println!("cargo:rustc-cfg=kvlink_ucx_ep_transports");
    }
    if let Some(libdir) = &ucx.libdir {
        println!("cargo:rustc-link-search=native={}", libdir.display());
        for lib in ["ucp", "uct", "ucs", "ucm"] {
            println!("cargo:rustc-link-lib=dylib={lib}");
        }
        // Tests and binaries of this package load that UCX, not the system's.
        println!("cargo:rustc-link-arg=-Wl,-rpath,{}", libdir.display());
        println!("cargo:libdir={}", libdir.display());
    }
    for lib in ["pthread", "dl", "m", "rt"] {
        println!("cargo:rustc-link-lib={lib}");
    }
    println!("cargo:version={}", ucx.version);
    println!("cargo:rustc-env=KVLINK_UCX_BUILD_VERSION={}", ucx.version);
    println!(
        "cargo:rustc-env=KVLINK_UCX_BUILD_LIBDIR={}",
        ucx.libdir
            .as_ref()
            .map_or(String::from("(system)"), |d| d.display().to_string())
    );

    let mut builder = bindgen::Builder::default()
        .header_contents(
            "ucx_wrapper.h",
            "#include <ucp/api/ucp.h>\n#include <uct/api/uct.h>\n",
        )
        .allowlist_function("ucp_.*")
        .allowlist_function("ucs_status_string")
        // What the linked UCX has (transports, devices), to check a transport setting against.
        .allowlist_function("uct_query_components")
        .allowlist_function("uct_release_component_list")
        .allowlist_function("uct_component_query")
        .allowlist_function("uct_md_config_read")
        .allowlist_function("uct_config_release")
        .allowlist_function("uct_md_open")
        .allowlist_function("uct_md_close")
        .allowlist_function("uct_md_query_tl_resources")
        .allowlist_function("uct_release_tl_resource_list")
        .allowlist_type("uct_component_attr_field")
        .allowlist_type("ucp_.*")
        .allowlist_type("ucs_.*")
        .allowlist_var("UCP_.*")
        .allowlist_var("UCS_.*")
        .allowlist_var("UCT_.*")
        .prepend_enum_name(false)
        .derive_default(true)
        .layout_tests(false)
        .generate_comments(false);
    for path in &ucx.include {
        builder = builder.clang_arg(format!("-I{}", path.display()));
    }
    let bindings = builder
        .generate()
        .expect("bindgen failed on <ucp/api/ucp.h>, <uct/api/uct.h>");
    let out = PathBuf::from(env::var("OUT_DIR").unwrap()).join("ucx_bindings.rs");
    bindings.write_to_file(out).expect("writing UCX bindings");
}

/// The system UCX, through `pkg-config ucx` (which emits the link flags itself).
fn from_pkg_config() -> Ucx {
    let lib = pkg_config::Config::new()
        .atleast_version(&format!("1.{MIN_MINOR}"))
        .probe("ucx")
        .unwrap_or_else(|e| {
            panic!(
                "UCX >= 1.{MIN_MINOR} development files not found by `pkg-config ucx` ({e}). \
                 Install libucx-dev (see README), or set KVLINK_UCX_ROOT to a UCX install prefix."
            )
        });
    let mut include = lib.include_paths.clone();
    if include.is_empty() {
        include.push(PathBuf::from("/usr/include"));
    }
    Ucx {
        include,
        libdir: None,
        version: lib.version,
    }
}

/// A UCX install at `root`: paths from the root, the version from its `ucx.pc` when there is
/// one (its prefix is not trusted), else from the headers.
fn from_root(root: &Path) -> Ucx {
    let root = root
        .canonicalize()
        .unwrap_or_else(|e| panic!("KVLINK_UCX_ROOT={}: not a directory ({e})", root.display()));
    let include = root.join("include");
    if !include.join("ucp/api/ucp.h").is_file() {
        panic!(
            "KVLINK_UCX_ROOT={}: no include/ucp/api/ucp.h (the UCX headers) there",
            root.display()
        );
    }
    let libdir = ["lib", "lib64"]
        .iter()
        .map(|d| root.join(d))
        .find(|d| d.join("libucp.so").exists() || d.join("libucp.so.0").exists())
        .unwrap_or_else(|| {
            panic!(
                "KVLINK_UCX_ROOT={}: no lib/libucp.so or lib64/libucp.so there",
                root.display()
            )
        });
    if !libdir.join("libucp.so").exists() {
        // Only the runtime soname: link it by full name.
        panic!(
            "KVLINK_UCX_ROOT={}: {} has libucp.so.0 but no libucp.so to link against",
            root.display(),
            libdir.display()
        );
    }
    let pc = libdir.join("pkgconfig/ucx.pc");
    println!("cargo:rerun-if-changed={}", pc.display());
    let version = fs::read_to_string(&pc)
        .ok()
        .and_then(|text| {
            text.lines()
                .find_map(|l| l.strip_prefix("Version:").map(|v| v.trim().to_string()))
        })
        .unwrap_or_else(|| format!("1.{}", header_minor(std::slice::from_ref(&include))));
    Ucx {
        include: vec![include],
        libdir: Some(libdir),
        version,
    }
}

/// `UCP_API_MINOR` from `ucp/api/ucp_version.h` in the first include directory that has it.
fn header_minor(include: &[PathBuf]) -> u32 {
    for dir in include {
        let file = dir.join("ucp/api/ucp_version.h");
        println!("cargo:rerun-if-changed={}", file.display());
        if let Ok(text) = fs::read_to_string(&file) {
            for line in text.lines() {
                let mut words = line.split_whitespace();
                if words.next() == Some("#define") && words.next() == Some("UCP_API_MINOR") {
                    if let Some(n) = words.next().and_then(|w| w.parse().ok()) {
                        return n;
                    }
                }
            }
        }
    }
    panic!("no UCP_API_MINOR in ucp/api/ucp_version.h under {include:?}");
}

/// Whether `ucp/api/ucp.h` in the first include directory that has it mentions `word`.
fn header_has(include: &[PathBuf], word: &str) -> bool {
    include
        .iter()
        .find_map(|dir| fs::read_to_string(dir.join("ucp/api/ucp.h")).ok())
        .is_some_and(|text| text.contains(word))
}
