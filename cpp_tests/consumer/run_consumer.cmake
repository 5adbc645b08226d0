# Driver for the consumer ctest tests (run with cmake -P). MODE=install (default):
#   1. cmake --install the current kvlink build into a fresh temporary prefix;
#   2. configure the consumer project against that prefix only (find_package(kvlink CONFIG));
#   3. build it and run its executable.
# MODE=prefix: 2-3 against an existing install, PREFIX (scripts/package-check.sh).
# MODE=subdirectory: the consumer does add_subdirectory(KVLINK_SOURCE_DIR) instead of 1-2,
# sharing CARGO_TARGET_DIR with the current build so cargo has nothing to recompile.
# Inputs: MODE KVLINK_BINARY_DIR PREFIX KVLINK_SOURCE_DIR CARGO_TARGET_DIR CONFIG
#         CONSUMER_SOURCE_DIR WORK_DIR GENERATOR MAKE_PROGRAM CXX_COMPILER EXPECTED_VERSION
#         EXPECTED_UCX_VERSION UCX_ROOT EXPECTED_UCX_LIBDIR (if set: the executable must load libucp from it)
#         CXX_FLAGS (the consumer's CMAKE_CXX_FLAGS, e.g. -D_GLIBCXX_USE_CXX11_ABI=0)
cmake_minimum_required(VERSION 3.20)  # policies of this century (CMP0054: "prefix" is a string)
if(NOT MODE)
  set(MODE install)
endif()
foreach(v CONSUMER_SOURCE_DIR WORK_DIR GENERATOR)
  if(NOT DEFINED ${v} OR "${${v}}" STREQUAL "")
    message(FATAL_ERROR "run_consumer.cmake: -D${v}=... is required")
  endif()
endforeach()

function(run_step name)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "consumer test: step '${name}' failed (${rc})")
  endif()
endfunction()

if(MODE STREQUAL "prefix")
  if(NOT PREFIX OR NOT EXISTS "${PREFIX}")
    message(FATAL_ERROR "run_consumer.cmake: MODE=prefix needs -DPREFIX=<an install prefix>")
  endif()
  set(prefix "${PREFIX}")
else()
  set(prefix "${WORK_DIR}/prefix")
endif()
set(build "${WORK_DIR}/build")
file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")

set(config_args "")
if(CONFIG)
  set(config_args --config "${CONFIG}")
endif()
set(configure_args -S "${CONSUMER_SOURCE_DIR}" -B "${build}" -G "${GENERATOR}"
    "-DKVLINK_EXPECTED_VERSION=${EXPECTED_VERSION}"
    "-DKVLINK_EXPECTED_UCX_VERSION=${EXPECTED_UCX_VERSION}")
if(MODE STREQUAL "install" OR MODE STREQUAL "prefix")
  if(MODE STREQUAL "install")
    run_step(install "${CMAKE_COMMAND}" --install "${KVLINK_BINARY_DIR}" --prefix "${prefix}" ${config_args})
  endif()
  list(APPEND configure_args "-DCMAKE_PREFIX_PATH=${prefix}"
       -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF -DCMAKE_FIND_USE_SYSTEM_PACKAGE_REGISTRY=OFF)
elseif(MODE STREQUAL "subdirectory")
  list(APPEND configure_args "-DKVLINK_SOURCE_DIR=${KVLINK_SOURCE_DIR}")
  if(CARGO_TARGET_DIR)
    list(APPEND configure_args "-DKVLINK_CARGO_TARGET_DIR=${CARGO_TARGET_DIR}")
  endif()
  # The same UCX as the outer build (else cargo rebuilds the crate against another one). An
  # install records its UCX root itself: that mode passes nothing.
  list(APPEND configure_args "-DKVLINK_UCX_ROOT=${UCX_ROOT}")
else()
  message(FATAL_ERROR "run_consumer.cmake: unknown MODE '${MODE}'")
endif()
if(MAKE_PROGRAM)
  list(APPEND configure_args "-DCMAKE_MAKE_PROGRAM=${MAKE_PROGRAM}")
endif()
if(CXX_COMPILER)
  list(APPEND configure_args "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}")
endif()
if(CONFIG)
  list(APPEND configure_args "-DCMAKE_BUILD_TYPE=${CONFIG}")
endif()
if(CXX_FLAGS)
  list(APPEND configure_args "-DCMAKE_CXX_FLAGS=${CXX_FLAGS}")
endif()
run_step(configure "${CMAKE_COMMAND}" ${configure_args})
run_step(build "${CMAKE_COMMAND}" --build "${build}" ${config_args})

# Single-config generators put the executable at the top of the build dir, multi-config ones
# under <build>/<config>/.
set(exe "${build}/kvlink_consumer")
if(NOT EXISTS "${exe}" AND CONFIG)
  set(exe "${build}/${CONFIG}/kvlink_consumer")
endif()
execute_process(COMMAND "${exe}" RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
message(STATUS "consumer says: ${out}${err}")
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "consumer executable failed (${rc})")
endif()
if(EXPECTED_VERSION AND NOT out MATCHES "kvlink ${EXPECTED_VERSION}")
  message(FATAL_ERROR "consumer did not report kvlink ${EXPECTED_VERSION}")
endif()
# Built against KVLINK_UCX_ROOT: the executable finds that UCX at run time by itself (rpath),
# with no LD_LIBRARY_PATH, even though a system UCX may be installed too.
if(EXPECTED_UCX_LIBDIR)
  execute_process(COMMAND ldd "${exe}" OUTPUT_VARIABLE ldd_out RESULT_VARIABLE rc)
  string(REGEX MATCH "libucp\\.so\\.0 => [^ ]+" ucp_line "${ldd_out}")
  message(STATUS "consumer loads ${ucp_line}")
  if(NOT ucp_line STREQUAL "libucp.so.0 => ${EXPECTED_UCX_LIBDIR}/libucp.so.0")
    message(FATAL_ERROR "consumer loads '${ucp_line}', expected libucp.so.0 from ${EXPECTED_UCX_LIBDIR}")
  endif()
endif()
