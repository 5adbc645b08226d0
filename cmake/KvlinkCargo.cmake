# The cargo build as one always-run custom target, and the `kvlink::kvlink` target on top of it.
#
# Why a custom target and not Corrosion: Corrosion is not packaged for Debian and its download step
# cannot run offline. One always-run target is enough: cargo does its own up-to-date checks (a
# no-op build costs about a second), and BYPRODUCTS tells Ninja and Make which file it produces so
# that everything linking the library is relinked after it changes.
#
# Inputs (cache variables):
#   KVLINK_CARGO             the cargo executable (found on PATH or in ~/.cargo/bin)
#   KVLINK_CARGO_TARGET_DIR  cargo's --target-dir; defaults to <build>/cargo. Point it at the
#                            repository's `target/` to share artifacts with plain `cargo test`
#                            (scripts/test-all.sh does, so CI compiles the crate once).
#   KVLINK_CARGO_FLAGS       extra arguments for `cargo build` (e.g. --features x)
#   KVLINK_DEBUG_INFO        keep debug info in Release / MinSizeRel builds (default OFF)
#   KVLINK_UCX_ROOT          prefix of the UCX (>= 1.13) to build against (defaults to the
#                            environment variable of the same name); empty: the system UCX that
#                            `pkg-config ucx` finds. Passed to cargo (build.rs binds that UCX's
#                            headers) and read the same way here (KvlinkUcx.cmake).
# Profile: Release, RelWithDebInfo, MinSizeRel -> cargo `release`; Debug or no build type -> `dev`.
# Works with multi-config generators too (the choice is a generator expression).
#
# Debug info: Release and MinSizeRel build the release profile without it (unless
# KVLINK_DEBUG_INFO is ON) and the install strips what the Rust standard library brings along
# (KvlinkInstall.cmake); RelWithDebInfo builds it with limited debug info (debug = 1), and Debug is
# cargo's dev profile as it is. KVLINK_DEBUG_INFO is passed to cargo as CARGO_PROFILE_RELEASE_DEBUG,
# so CMake decides, whatever Cargo.toml's [profile.release] says. A cargo target dir shared by
# builds that differ in this setting recompiles the crates each time it changes.
#
# C++ compiler and ABI: cargo compiles C++ too (cxx's runtime and the bridge, KvlinkCxxAbi.cmake)
# with the cc crate, which reads CXX and CXXFLAGS from the environment. The cargo command gets
# CXX=CMAKE_CXX_COMPILER when that is not the compiler cc would pick by itself, and
# CXXFLAGS=<the ABI flags> (-D_GLIBCXX_USE_CXX11_ABI=N, -stdlib=...) when the parent compiles with
# any, from CMAKE_CXX_FLAGS or its add_compile_definitions / add_compile_options; otherwise its
# environment is left as it is, the same as a plain `cargo build` sees, so that a shared target
# dir is not rebuilt for nothing. cc tells cargo to rerun the build scripts when CXX or CXXFLAGS
# change, so the C++ objects follow the setting (a shared target dir recompiles cxx and kvlink
# each time it changes). KVLINK_CXX11_ABI, the libstdc++ string ABI the .a's C++ is built with
# (empty: not libstdc++), goes into the installed package, which warns a consumer that differs.
#
# The cargo target is part of ALL: `cmake --build` followed by `cmake --install` must work even
# when nothing else (tests, demo, wrapper) links the library. A parent project that wants it built
# only on demand uses add_subdirectory(kvlink EXCLUDE_FROM_ALL).

find_program(KVLINK_CARGO cargo
  HINTS "$ENV{CARGO_HOME}/bin" "$ENV{HOME}/.cargo/bin"
  DOC "cargo executable used to build the kvlink Rust library")
if(NOT KVLINK_CARGO)
  message(FATAL_ERROR "kvlink: cargo not found. Install Rust (scripts/install-deps.sh does) "
                      "or set -DKVLINK_CARGO=/path/to/cargo.")
endif()

set(KVLINK_CARGO_TARGET_DIR "${CMAKE_CURRENT_BINARY_DIR}/cargo" CACHE PATH
    "cargo --target-dir for the kvlink build")
set(KVLINK_CARGO_FLAGS "" CACHE STRING "Extra arguments for cargo build (a ;-list)")
set(KVLINK_UCX_ROOT "$ENV{KVLINK_UCX_ROOT}" CACHE PATH
    "Prefix of the UCX (>= 1.13) to build against (include/, lib/); empty: pkg-config ucx")
if(DEFINED ENV{KVLINK_UCX_ROOT} AND NOT "$ENV{KVLINK_UCX_ROOT}" STREQUAL "${KVLINK_UCX_ROOT}")
  message(WARNING "kvlink: the environment's KVLINK_UCX_ROOT ($ENV{KVLINK_UCX_ROOT}) differs from "
                  "the cache's ('${KVLINK_UCX_ROOT}'); the cache wins. Pass -DKVLINK_UCX_ROOT=... to change it.")
endif()
option(KVLINK_DEBUG_INFO "Keep debug info in the kvlink library of Release/MinSizeRel builds and installs" OFF)

include("${CMAKE_CURRENT_LIST_DIR}/KvlinkCxxAbi.cmake")
kvlink_cxx_abi_flags(KVLINK_CXX_ABI_FLAGS)
kvlink_cxx11_abi(KVLINK_CXX11_ABI ${KVLINK_CXX_ABI_FLAGS})
set(_kvlink_cxx_env "")
if(KVLINK_CXX_ABI_FLAGS)
  list(JOIN KVLINK_CXX_ABI_FLAGS " " _kvlink_cxxflags)
  list(APPEND _kvlink_cxx_env "CXXFLAGS=${_kvlink_cxxflags}")
endif()
# cc's default is c++ on PATH. Not $ENV{CXX}: CMake sets that itself while it configures
# (to CMAKE_CXX_COMPILER, given with -D), so here it does not say what the build will inherit.
set(_kvlink_cc_cxx "")
set(_kvlink_path "$ENV{PATH}")
string(REPLACE ":" ";" _kvlink_path "${_kvlink_path}")
foreach(_kvlink_dir IN LISTS _kvlink_path)
  if(_kvlink_dir AND NOT IS_DIRECTORY "${_kvlink_dir}/c++" AND EXISTS "${_kvlink_dir}/c++")
    file(REAL_PATH "${_kvlink_dir}/c++" _kvlink_cc_cxx)
    break()
  endif()
endforeach()
file(REAL_PATH "${CMAKE_CXX_COMPILER}" _kvlink_cmake_cxx)
if(NOT _kvlink_cc_cxx STREQUAL _kvlink_cmake_cxx)
  list(APPEND _kvlink_cxx_env "CXX=${CMAKE_CXX_COMPILER}")
endif()
if(_kvlink_cxx_env)
  list(JOIN _kvlink_cxx_env " " _kvlink_cxx_note)
  message(STATUS "kvlink: cargo compiles its C++ with ${_kvlink_cxx_note}")
endif()

# An empty KVLINK_UCX_ROOT is removed from cargo's environment, not set empty: build.rs reads both
# as "the system UCX", but cargo's rerun-if-env-changed tells them apart, and a plain `cargo test`
# in a shared target dir has it unset (set empty, each alternation reran build.rs and recompiled
# kvlink). Removed, not left alone: the cache wins over the environment (see the warning above).
if(KVLINK_UCX_ROOT)
  set(_kvlink_ucx_env "KVLINK_UCX_ROOT=${KVLINK_UCX_ROOT}")
else()
  set(_kvlink_ucx_env "--unset=KVLINK_UCX_ROOT")
endif()

set(_kvlink_is_release "$<CONFIG:Release,RelWithDebInfo,MinSizeRel>")
set(_kvlink_profile "$<IF:${_kvlink_is_release},release,dev>")
set(_kvlink_profile_dir "$<IF:${_kvlink_is_release},release,debug>")
# 1 when the library keeps debug info: asked for, or a build type that means it (Debug,
# RelWithDebInfo, none). Used here for the release profile and by the install's strip step.
set(KVLINK_KEEP_DEBUG_INFO "$<OR:$<BOOL:${KVLINK_DEBUG_INFO}>,$<NOT:$<CONFIG:Release,MinSizeRel>>>")
set(KVLINK_STATIC_LIBRARY
    "${KVLINK_CARGO_TARGET_DIR}/${_kvlink_profile_dir}/${CMAKE_STATIC_LIBRARY_PREFIX}kvlink${CMAKE_STATIC_LIBRARY_SUFFIX}")

# COMMENT cannot hold generator expressions before CMake 3.26: name the profile at configure time
# where it is known (single-config generators).
if(CMAKE_CONFIGURATION_TYPES)
  set(_kvlink_profile_note "per configuration")
elseif(CMAKE_BUILD_TYPE MATCHES "^(Release|RelWithDebInfo|MinSizeRel)$")
  set(_kvlink_profile_note "release")
else()
  set(_kvlink_profile_note "dev")
endif()

# --locked: Cargo.lock is committed and must not change during a build. Nothing here runs at
# configure time; cargo reads crates from its local registry cache and only reaches the network
# when a locked crate has never been downloaded on this machine.
add_custom_target(kvlink_cargo ALL
  COMMAND "${CMAKE_COMMAND}" -E env "${_kvlink_ucx_env}"
          "CARGO_PROFILE_RELEASE_DEBUG=$<IF:${KVLINK_KEEP_DEBUG_INFO},1,0>" ${_kvlink_cxx_env}
          "${KVLINK_CARGO}" build --locked --lib
          --profile "${_kvlink_profile}"
          --manifest-path "${PROJECT_SOURCE_DIR}/Cargo.toml"
          --target-dir "${KVLINK_CARGO_TARGET_DIR}"
          ${KVLINK_CARGO_FLAGS}
  BYPRODUCTS "${KVLINK_STATIC_LIBRARY}"
  WORKING_DIRECTORY "${PROJECT_SOURCE_DIR}"
  COMMENT "cargo build kvlink (profile ${_kvlink_profile_note})"
  USES_TERMINAL
  COMMAND_EXPAND_LISTS
  VERBATIM)

# System libraries the Rust static library needs at final link. UCX (ucp uct ucs ucm) from
# KVLINK_UCX_ROOT, or else via pkg-config; pthread, dl, m and rt are what Rust's std and UCX use.
# Either way KVLINK_UCX_VERSION is the UCX this build compiles against (build.rs reads the same
# one); the installed kvlinkConfig.cmake records it, and KVLINK_UCX_ROOT.
if(KVLINK_UCX_ROOT)
  include("${CMAKE_CURRENT_LIST_DIR}/KvlinkUcx.cmake")
  kvlink_ucx_from_root(kvlink::ucx "${KVLINK_UCX_ROOT}" _kvlink_ucx)
  if(NOT _kvlink_ucx_FOUND)
    message(FATAL_ERROR "kvlink: KVLINK_UCX_ROOT=${KVLINK_UCX_ROOT}: ${_kvlink_ucx_ERROR}")
  endif()
  set(KVLINK_UCX_VERSION "${_kvlink_ucx_VERSION}")
  set(KVLINK_UCX_LIBDIR "${_kvlink_ucx_LIBDIR}")
  set(_kvlink_ucx_target kvlink::ucx)
  set(KVLINK_UCX_ROOT_REAL "${_kvlink_ucx_ROOT}")
  message(STATUS "kvlink: UCX ${KVLINK_UCX_VERSION} from KVLINK_UCX_ROOT (${KVLINK_UCX_LIBDIR})")
else()
  find_package(PkgConfig REQUIRED)
  pkg_check_modules(KVLINK_UCX REQUIRED IMPORTED_TARGET ucx>=1.13)
  set(KVLINK_UCX_LIBDIR "")
  set(KVLINK_UCX_ROOT_REAL "")
  set(_kvlink_ucx_target PkgConfig::KVLINK_UCX)
endif()
set(THREADS_PREFER_PTHREAD_FLAG ON)
find_package(Threads REQUIRED)

# An INTERFACE library rather than an IMPORTED one: its link item can be a generator expression
# (the per-config .a path) and add_dependencies on it is followed by everything that links it.
add_library(kvlink INTERFACE)
add_library(kvlink::kvlink ALIAS kvlink)
target_include_directories(kvlink INTERFACE "$<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}/include>")
target_compile_features(kvlink INTERFACE cxx_std_17)
target_link_libraries(kvlink INTERFACE
  "$<BUILD_INTERFACE:${KVLINK_STATIC_LIBRARY}>"
  ${_kvlink_ucx_target} Threads::Threads ${CMAKE_DL_LIBS} m rt)
add_dependencies(kvlink kvlink_cargo)
