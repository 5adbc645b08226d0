# The TensorRT-LLM backend wrapper: libkvlink_trtllm_wrapper.so, a shared library that carries
# the whole of kvlink (the Rust static library included) and exports one C symbol,
# `makeKvlinkConnectionManager`, for TensorRT-LLM to dlopen the way it loads its UCX backend.
#
#   KVLINK_TRTLLM_INCLUDE_DIR  include directories where tensorrt_llm/executor/cacheCommunicator.h
#                              and tensorrt_llm/executor/dataTransceiverState.h resolve: inside a
#                              TensorRT-LLM tree, its cpp/include plus the CUDA and TensorRT
#                              include directories those headers pull in (docs/TENSORRT_LLM.md);
#                              defaults to kvlink's stand-ins (cpp_tests/trtllm_shapes).
#
# Linking a Rust staticlib into a shared object works because rustc builds x86_64/aarch64 Linux
# code position independent by default (relocation-model=pic) for staticlibs too. The static
# library's symbols are kept local (--exclude-libs,ALL) and the C++ is compiled with hidden
# visibility, so a process that also links kvlink statically (or a second Rust library) does not
# interpose on the copy inside the wrapper.
# Built by default only when kvlink is the top-level project (a parent project opts in).
option(KVLINK_BUILD_TRTLLM_WRAPPER "Build libkvlink_trtllm_wrapper.so" ${_kvlink_top_level})
if(NOT KVLINK_BUILD_TRTLLM_WRAPPER AND NOT KVLINK_BUILD_TESTS)
  return()
endif()

set(KVLINK_TRTLLM_INCLUDE_DIR "${PROJECT_SOURCE_DIR}/cpp_tests/trtllm_shapes" CACHE STRING
    "Include directories (a ;-list) where tensorrt_llm/executor/cacheCommunicator.h and dataTransceiverState.h resolve: TensorRT-LLM's cpp/include plus what those headers include (docs/TENSORRT_LLM.md); default: kvlink's stand-ins")

# The wrapper's one source: kvlink's ConnectionManager / Connection plus the extern "C" factory.
add_library(kvlink_trtllm_wrapper SHARED "${PROJECT_SOURCE_DIR}/wrapper/kvlink_trtllm_wrapper.cpp")
target_include_directories(kvlink_trtllm_wrapper PRIVATE ${KVLINK_TRTLLM_INCLUDE_DIR})
target_link_libraries(kvlink_trtllm_wrapper PRIVATE kvlink::kvlink ${CMAKE_DL_LIBS})
target_compile_features(kvlink_trtllm_wrapper PRIVATE cxx_std_17)
set_target_properties(kvlink_trtllm_wrapper PROPERTIES
  CXX_VISIBILITY_PRESET hidden
  VISIBILITY_INLINES_HIDDEN ON
  POSITION_INDEPENDENT_CODE ON)
target_link_options(kvlink_trtllm_wrapper PRIVATE "LINKER:--exclude-libs,ALL" "LINKER:--no-undefined"
  "LINKER:--version-script=${PROJECT_SOURCE_DIR}/wrapper/exports.map")
set_property(TARGET kvlink_trtllm_wrapper APPEND PROPERTY LINK_DEPENDS "${PROJECT_SOURCE_DIR}/wrapper/exports.map")
# The release profile builds kvlink without debug info, but the Rust standard library inside
# the .a brings its own (KvlinkInstall.cmake strips it from the installed .a): leave it out of the
# .so too, unless debug info is kept (KVLINK_DEBUG_INFO, Debug, RelWithDebInfo).
target_link_options(kvlink_trtllm_wrapper PRIVATE "$<$<NOT:${KVLINK_KEEP_DEBUG_INFO}>:LINKER:--strip-debug>")
if(KVLINK_INSTALL)
  include(GNUInstallDirs)
  install(TARGETS kvlink_trtllm_wrapper LIBRARY DESTINATION "${CMAKE_INSTALL_LIBDIR}")
endif()
