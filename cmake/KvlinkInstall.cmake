# Install rules and the CMake package, so a consumer can do:
#   find_package(kvlink CONFIG REQUIRED)      # with CMAKE_PREFIX_PATH=<install prefix>
#   target_link_libraries(app PRIVATE kvlink::kvlink)
#
# Layout:  <prefix>/lib/libkvlink.a
#          <prefix>/include/kvlink/{kvlink.hpp,bridge.h}, <prefix>/include/rust/cxx.h
#          <prefix>/lib/cmake/kvlink/kvlinkConfig.cmake, kvlinkConfigVersion.cmake,
#          KvlinkUcx.cmake, KvlinkCxxAbi.cmake (helpers it includes)
#
# The installed package is written by hand (cmake/kvlinkConfig.cmake.in) instead of exported:
# the build tree's target is an INTERFACE wrapper around a cargo byproduct, while an installed
# consumer wants a plain IMPORTED STATIC library with the same usage requirements.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(KVLINK_INSTALL_CMAKEDIR "${CMAKE_INSTALL_LIBDIR}/cmake/kvlink" CACHE STRING
    "Where kvlinkConfig.cmake is installed, relative to the prefix")

set(_kvlink_installed_name "${CMAKE_STATIC_LIBRARY_PREFIX}kvlink${CMAKE_STATIC_LIBRARY_SUFFIX}")
install(FILES "${KVLINK_STATIC_LIBRARY}"
        DESTINATION "${CMAKE_INSTALL_LIBDIR}"
        RENAME "${_kvlink_installed_name}")

# No debug info in the installed library unless asked (KVLINK_DEBUG_INFO, or a Debug /
# RelWithDebInfo build: KVLINK_KEEP_DEBUG_INFO in KvlinkCargo.cmake). The release profile then
# builds kvlink's own code without it, but the .a also carries the Rust standard library's
# objects, which rustup ships with debug info; `strip --strip-debug` drops those and keeps every
# symbol the linker needs. `cmake --install --strip` strips debug info in any configuration.
if(CMAKE_STRIP)
  set(_kvlink_strip_code [[
if(NOT "@KVLINK_KEEP_DEBUG_INFO@" OR CMAKE_INSTALL_DO_STRIP)
  set(_kvlink_lib "@CMAKE_INSTALL_LIBDIR@/@_kvlink_installed_name@")
  if(NOT IS_ABSOLUTE "${_kvlink_lib}")
    set(_kvlink_lib "${CMAKE_INSTALL_PREFIX}/${_kvlink_lib}")
  endif()
  set(_kvlink_lib "$ENV{DESTDIR}${_kvlink_lib}")
  message(STATUS "Stripping debug info: ${_kvlink_lib}")
  execute_process(COMMAND "@CMAKE_STRIP@" --strip-debug "${_kvlink_lib}" RESULT_VARIABLE _kvlink_rc)
  if(NOT _kvlink_rc EQUAL 0)
    message(FATAL_ERROR "kvlink: '@CMAKE_STRIP@ --strip-debug ${_kvlink_lib}' failed (${_kvlink_rc})")
  endif()
endif()
]])
  string(CONFIGURE "${_kvlink_strip_code}" _kvlink_strip_code @ONLY)
  install(CODE "${_kvlink_strip_code}")
else()
  message(WARNING "kvlink: no strip tool (CMAKE_STRIP) found; the installed libkvlink.a keeps "
                  "the Rust standard library's debug info")
endif()
install(DIRECTORY "${PROJECT_SOURCE_DIR}/include/"
        DESTINATION "${CMAKE_INSTALL_INCLUDEDIR}"
        FILES_MATCHING PATTERN "*.h" PATTERN "*.hpp")

configure_package_config_file(
  "${CMAKE_CURRENT_LIST_DIR}/kvlinkConfig.cmake.in"
  "${PROJECT_BINARY_DIR}/kvlinkConfig.cmake"
  INSTALL_DESTINATION "${KVLINK_INSTALL_CMAKEDIR}"
  PATH_VARS CMAKE_INSTALL_LIBDIR CMAKE_INSTALL_INCLUDEDIR)
# 0.x: only the same minor version is compatible. The .a is architecture specific, so the
# pointer size check stays on.
write_basic_package_version_file(
  "${PROJECT_BINARY_DIR}/kvlinkConfigVersion.cmake"
  VERSION "${PROJECT_VERSION}"
  COMPATIBILITY SameMinorVersion)
install(FILES "${PROJECT_BINARY_DIR}/kvlinkConfig.cmake"
              "${PROJECT_BINARY_DIR}/kvlinkConfigVersion.cmake"
              "${CMAKE_CURRENT_LIST_DIR}/KvlinkUcx.cmake"
              "${CMAKE_CURRENT_LIST_DIR}/KvlinkCxxAbi.cmake"
        DESTINATION "${KVLINK_INSTALL_CMAKEDIR}")
