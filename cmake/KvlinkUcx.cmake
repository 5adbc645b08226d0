# A UCX install given by its prefix (KVLINK_UCX_ROOT), as an IMPORTED INTERFACE target. Used by
# the build (KvlinkCargo.cmake) and, installed next to it, by kvlinkConfig.cmake, so both read a
# root the same way build.rs does:
#   headers   <root>/include/ucp/api/ucp.h
#   libraries <root>/lib/libucp.so (or lib64/), with libuct, libucs, libucm beside it
#   version   the Version: line of <libdir>/pkgconfig/ucx.pc, else UCP_API_MAJOR.MINOR from
#             <root>/include/ucp/api/ucp_version.h
# The pkg-config files are not used for paths: their prefix= is where the UCX was built (the
# PyPI wheel's is a CI directory that does not exist on the user's machine).
#
# kvlink_ucx_from_root(<target> <root> <out>) sets <out>_FOUND, and then <out>_VERSION,
# <out>_LIBDIR, <out>_ROOT (the real path), or <out>_ERROR. The target carries the include
# directory, the four libraries by full path, and an rpath to <libdir> (LINKER:-rpath) so that
# executables linking it load this UCX at run time, in the build tree and after installing.
function(kvlink_ucx_from_root target root out)
  set(${out}_FOUND FALSE PARENT_SCOPE)
  get_filename_component(root "${root}" REALPATH)
  if(NOT EXISTS "${root}/include/ucp/api/ucp.h")
    set(${out}_ERROR "no include/ucp/api/ucp.h under ${root}" PARENT_SCOPE)
    return()
  endif()
  set(libdir "")
  foreach(d lib lib64)
    if(EXISTS "${root}/${d}/libucp.so")
      set(libdir "${root}/${d}")
      break()
    endif()
  endforeach()
  if(NOT libdir)
    set(${out}_ERROR "no lib/libucp.so or lib64/libucp.so under ${root}" PARENT_SCOPE)
    return()
  endif()
  set(libs "")
  foreach(l ucp uct ucs ucm)
    if(NOT EXISTS "${libdir}/lib${l}.so")
      set(${out}_ERROR "no lib${l}.so in ${libdir}" PARENT_SCOPE)
      return()
    endif()
    list(APPEND libs "${libdir}/lib${l}.so")
  endforeach()
  set(version "")
  if(EXISTS "${libdir}/pkgconfig/ucx.pc")
    file(STRINGS "${libdir}/pkgconfig/ucx.pc" _line REGEX "^Version:" LIMIT_COUNT 1)
    string(REGEX MATCH "[0-9]+\\.[0-9]+(\\.[0-9]+)?" version "${_line}")
  endif()
  if(NOT version)
    file(STRINGS "${root}/include/ucp/api/ucp_version.h" _lines REGEX "define UCP_API_(MAJOR|MINOR) ")
    string(REGEX MATCH "UCP_API_MAJOR +([0-9]+)" _m "${_lines}")
    set(_major "${CMAKE_MATCH_1}")
    string(REGEX MATCH "UCP_API_MINOR +([0-9]+)" _m "${_lines}")
    set(version "${_major}.${CMAKE_MATCH_1}")
  endif()
  if(version VERSION_LESS 1.13)
    set(${out}_ERROR "UCX ${version} under ${root} is older than 1.13" PARENT_SCOPE)
    return()
  endif()
  if(NOT TARGET ${target})
    add_library(${target} INTERFACE IMPORTED)
    set_target_properties(${target} PROPERTIES
      INTERFACE_INCLUDE_DIRECTORIES "${root}/include"
      INTERFACE_LINK_LIBRARIES "${libs}"
      INTERFACE_LINK_OPTIONS "LINKER:-rpath,${libdir}")
  endif()
  set(${out}_FOUND TRUE PARENT_SCOPE)
  set(${out}_VERSION "${version}" PARENT_SCOPE)
  set(${out}_LIBDIR "${libdir}" PARENT_SCOPE)
  set(${out}_ROOT "${root}" PARENT_SCOPE)
endfunction()
