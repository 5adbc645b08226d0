# Driver for the ctest test kvlink.consumer.find_package_after_install (run with cmake -P):
#   1. cmake --install the current kvlink build into a fresh temporary prefix;
#   2. configure the consumer project against that prefix only (find_package(kvlink CONFIG));
#   3. build it and run its executable.
# Inputs: KVLINK_BINARY_DIR CONFIG CONSUMER_SOURCE_DIR WORK_DIR GENERATOR MAKE_PROGRAM
#         CXX_COMPILER EXPECTED_VERSION
foreach(v KVLINK_BINARY_DIR CONSUMER_SOURCE_DIR WORK_DIR GENERATOR)
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

set(prefix "${WORK_DIR}/prefix")
set(build "${WORK_DIR}/build")
file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")

set(config_args "")
if(CONFIG)
  set(config_args --config "${CONFIG}")
endif()
run_step(install "${CMAKE_COMMAND}" --install "${KVLINK_BINARY_DIR}" --prefix "${prefix}" ${config_args})

set(configure_args -S "${CONSUMER_SOURCE_DIR}" -B "${build}" -G "${GENERATOR}"
    "-DCMAKE_PREFIX_PATH=${prefix}"
    -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF -DCMAKE_FIND_USE_SYSTEM_PACKAGE_REGISTRY=OFF)
if(MAKE_PROGRAM)
  list(APPEND configure_args "-DCMAKE_MAKE_PROGRAM=${MAKE_PROGRAM}")
endif()
if(CXX_COMPILER)
  list(APPEND configure_args "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}")
endif()
if(CONFIG)
  list(APPEND configure_args "-DCMAKE_BUILD_TYPE=${CONFIG}")
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
