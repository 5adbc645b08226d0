# The C++ ABI settings that must agree between the C++ compiled inside libkvlink.a and the code
# that includes kvlink's headers. cargo compiles that C++ (cxx's runtime, cxx.cc, with its
# out-of-line `rust::String` <-> `std::string` conversions, and the bridge from build.rs) through
# the cc crate, which reads CXX and CXXFLAGS, not CMake. Used by KvlinkCargo.cmake (what to pass to
# cargo) and, installed, by kvlinkConfig.cmake (does the consumer compile the same way).
#
# Only flags that change what the headers' inline code links against are taken: the libstdc++
# string ABI (-D_GLIBCXX_USE_CXX11_ABI=N) and Clang's standard library (-stdlib=...). The rest of
# the C++ flags are not ABI (optimization, debug info, warnings, -fsanitize, whose runtime the
# consumer's link brings) or would fight cc's own (-std=, -Werror on code that is not ours).

# kvlink_cxx_abi_flags(<out>): the ABI flags the current directory compiles C++ with, as a list:
# its COMPILE_DEFINITIONS (a parent's add_compile_definitions), then CMAKE_CXX_FLAGS, then its
# COMPILE_OPTIONS (add_compile_options), the order the compiler sees them in (the last -D wins).
function(kvlink_cxx_abi_flags out)
  set(flags "")
  get_directory_property(defs COMPILE_DEFINITIONS)
  foreach(d IN LISTS defs)
    if(d MATCHES "^_GLIBCXX_USE_CXX11_ABI=[0-9]+$")
      list(APPEND flags "-D${d}")
    endif()
  endforeach()
  separate_arguments(cxx_flags UNIX_COMMAND "${CMAKE_CXX_FLAGS}")
  get_directory_property(opts COMPILE_OPTIONS)
  foreach(f IN LISTS cxx_flags opts)
    if(f MATCHES "^-D_GLIBCXX_USE_CXX11_ABI=[0-9]+$" OR f MATCHES "^-stdlib=[A-Za-z0-9+_]+$")
      list(APPEND flags "${f}")
    endif()
  endforeach()
  set(${out} "${flags}" PARENT_SCOPE)
endfunction()

# kvlink_cxx11_abi(<out> [flags...]): _GLIBCXX_USE_CXX11_ABI as CMAKE_CXX_COMPILER sees it with
# <flags> alone (the other CMAKE_CXX_FLAGS do not reach cargo): 1 or 0, or empty where the
# standard library is not libstdc++. One or two compile-only try_compiles, cached per compiler and
# flags. The flags go in as CMAKE_CXX_FLAGS, which keeps their order (COMPILE_DEFINITIONS sorts
# them, and of two -D_GLIBCXX_USE_CXX11_ABI the last one counts).
function(kvlink_cxx11_abi out)
  string(MD5 key "${CMAKE_CXX_COMPILER};${ARGN}")
  set(var "_KVLINK_CXX11_ABI_${key}")
  if(NOT DEFINED CACHE{${var}})
    set(dir "${CMAKE_BINARY_DIR}${CMAKE_FILES_DIRECTORY}/kvlink_cxx11_abi")
    set(CMAKE_TRY_COMPILE_TARGET_TYPE STATIC_LIBRARY)
    list(JOIN ARGN " " CMAKE_CXX_FLAGS)
    set(value "")
    foreach(candidate 1 0)
      file(WRITE "${dir}/abi${candidate}.cpp"
           "#include <string>\n#if !defined(__GLIBCXX__) || _GLIBCXX_USE_CXX11_ABI != ${candidate}\n"
           "#error not this ABI\n#endif\nint kvlink_cxx11_abi_probe() { return 0; }\n")
      try_compile(matches "${dir}/build${candidate}" "${dir}/abi${candidate}.cpp")
      if(matches)
        set(value ${candidate})
        break()
      endif()
    endforeach()
    set(${var} "${value}" CACHE INTERNAL "kvlink: _GLIBCXX_USE_CXX11_ABI for ${CMAKE_CXX_COMPILER} ${ARGN}")
  endif()
  set(${out} "${${var}}" PARENT_SCOPE)
endfunction()
