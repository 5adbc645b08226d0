// STAND-IN, written for kvlink (not TensorRT-LLM code). Mirrors the namespace macros of
// TensorRT-LLM's cpp/include/tensorrt_llm/common/config.h as used by
// cpp/include/tensorrt_llm/executor/cacheCommunicator.h @3585984b32cded5cc002d3087d3da4b0fd9fb8a5:
// declarations live in `tensorrt_llm`, inside an inline ABI namespace `_v1`, so code that names
// `tensorrt_llm::executor::kv_cache::Connection` still finds them.
#pragma once

#ifndef TRTLLM_NAMESPACE_BEGIN
#define TRTLLM_NAMESPACE_BEGIN \
  namespace tensorrt_llm {     \
  inline namespace _v1 {
#define TRTLLM_NAMESPACE_END \
  }                          \
  }
#endif
