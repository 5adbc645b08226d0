# Install rules and the CMake package, so a consumer can do:
#   find_package(kvlink CONFIG REQUIRED)      # with CMAKE_PREFIX_PATH=<install prefix>
#   target_link_libraries(app PRIVATE kvlink::kvlink)
#
# Layout:  <prefix>/lib/libkvlink.a
#          <prefix>/include/kvlink/{kvlink.hpp,bridge.h}, <prefix>/include/rust/cxx.h
#          <prefix>/lib/cmake/kvlink/kvlinkConfig.cmake, kvlinkConfigVersion.cmake
#
# The installed package is written by hand (cmake/kvlinkConfig.cmake.in) instead of exported:
# the build tree's target is an INTERFACE wrapper around a cargo byproduct, while an installed
# consumer wants a plain IMPORTED STATIC library with the same usage requirements.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(KVLINK_INSTALL_CMAKEDIR "${CMAKE_INSTALL_LIBDIR}/cmake/kvlink" CACHE STRING
    "Where kvlinkConfig.cmake is installed, relative to the prefix")

install(FILES "${KVLINK_STATIC_LIBRARY}"
        DESTINATION "${CMAKE_INSTALL_LIBDIR}"
        RENAME "${CMAKE_STATIC_LIBRARY_PREFIX}kvlink${CMAKE_STATIC_LIBRARY_SUFFIX}")
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
        DESTINATION "${KVLINK_INSTALL_CMAKEDIR}")
