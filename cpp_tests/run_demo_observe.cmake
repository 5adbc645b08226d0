# ctest driver for the demo's logs and metrics (cmake -P), one MODE per case:
#   MODE=log      KVLINK_LOG=debug: the demo passes and its stderr carries kvlink's events,
#                 among them the timed-out request 2's WARN with its request id.
#   MODE=metrics  --metrics-file: the demo passes, then cpp_tests/parse_metrics.py parses the
#                 file with prometheus_client and checks 2 completed and 1 timed_out.
# Inputs: DEMO, MODE, WORK_DIR, PYTHON, PARSER.
cmake_minimum_required(VERSION 3.20)
file(MAKE_DIRECTORY "${WORK_DIR}")
if(MODE STREQUAL "log")
  set(ENV{KVLINK_LOG} "debug")
  execute_process(COMMAND "${DEMO}" --transport tcp --timeout-ms 1000
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  message("--- stdout\n${out}")
  string(LENGTH "${err}" err_len)
  message("--- stderr: ${err_len} bytes")
  if(NOT rc EQUAL 0)
    message("${err}")
    message(FATAL_ERROR "the demo failed with KVLINK_LOG=debug (${rc})")
  endif()
  if(NOT err MATCHES "DEBUG kvlink" OR NOT err MATCHES "WARN kvlink[^\n]*request=2 ")
    message("${err}")
    message(FATAL_ERROR "KVLINK_LOG=debug: stderr lacks kvlink's DEBUG events or request 2's WARN")
  endif()
  message("KVLINK_LOG=debug: kvlink's events on stderr, request 2's WARN among them")
elseif(MODE STREQUAL "metrics")
  set(file "${WORK_DIR}/demo-metrics.prom")
  file(REMOVE "${file}")
  unset(ENV{KVLINK_LOG})
  execute_process(COMMAND "${DEMO}" --transport tcp --timeout-ms 1000 --metrics-file "${file}"
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  message("${out}${err}")
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "the demo failed (${rc})")
  endif()
  execute_process(COMMAND "${PYTHON}" "${PARSER}" "${file}" RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "parse_metrics.py failed (${rc}): see above")
  endif()
else()
  message(FATAL_ERROR "MODE must be log or metrics")
endif()
