# The C++ package: `cmake --install` puts the core libraries, the public headers and a CMake
# package config in the prefix, for find_package(pyengine CONFIG) and pyengine::core (see
# docs/cpp.md). Included only outside scikit-build: the wheel carries the extension alone.
#
# Libraries: libpyengine_core.a (target pyengine::core_static: the archive the extension and the
# tests link; its users also link OpenMP and, with CUDA, the CUDA runtime) and
# libpyengine_core.so (pyengine::core_shared: the same code plus those dependencies, one file).
# pyengine::core is the shared one, or the static one when PYENGINE_USE_STATIC is set before
# find_package (pyengineConfig.cmake).
include(CMakePackageConfigHelpers)

option(PYENGINE_BUILD_SHARED "Build libpyengine_core.so as well as the static library" ON)

set(_pe_export_targets pyengine_core)
if(TARGET pyengine_cuda)
  list(APPEND _pe_export_targets pyengine_cuda)
endif()
set_target_properties(pyengine_core PROPERTIES EXPORT_NAME core_static)

if(PYENGINE_BUILD_SHARED)
  # The static archive's objects (already position-independent), whole, in one shared library.
  add_library(pyengine_core_shared SHARED cmake/shared_library.cpp)
  target_link_libraries(pyengine_core_shared PRIVATE "$<LINK_LIBRARY:WHOLE_ARCHIVE,pyengine_core>")
  target_include_directories(pyengine_core_shared PUBLIC
    $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}/csrc/include> $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>)
  set_target_properties(pyengine_core_shared PROPERTIES
    OUTPUT_NAME pyengine_core EXPORT_NAME core_shared LINKER_LANGUAGE CXX
    VERSION ${PROJECT_VERSION} SOVERSION ${PROJECT_VERSION_MAJOR}.${PROJECT_VERSION_MINOR})
  list(APPEND _pe_export_targets pyengine_core_shared)
endif()

install(TARGETS ${_pe_export_targets} EXPORT pyengineTargets
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
# The public headers only (csrc/include/pyengine/*.h, and embed.hpp: header-only, needs pybind11);
# the private ones stay next to their sources.
install(DIRECTORY csrc/include/pyengine DESTINATION ${CMAKE_INSTALL_INCLUDEDIR} FILES_MATCHING PATTERN "*.h" PATTERN "*.hpp")

set(_pe_cmake_dir ${CMAKE_INSTALL_LIBDIR}/cmake/pyengine)
install(EXPORT pyengineTargets NAMESPACE pyengine:: DESTINATION ${_pe_cmake_dir})
set(PYENGINE_CONFIG_WITH_OPENMP ${PYENGINE_WITH_OPENMP})
set(PYENGINE_CONFIG_WITH_CUDA OFF)
if(TARGET pyengine_cuda)
  set(PYENGINE_CONFIG_WITH_CUDA ON)
endif()
set(PYENGINE_CONFIG_WITH_SHARED ${PYENGINE_BUILD_SHARED})
configure_package_config_file(cmake/pyengineConfig.cmake.in
  ${CMAKE_CURRENT_BINARY_DIR}/pyengineConfig.cmake INSTALL_DESTINATION ${_pe_cmake_dir})
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/pyengineConfigVersion.cmake
  VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/pyengineConfig.cmake
              ${CMAKE_CURRENT_BINARY_DIR}/pyengineConfigVersion.cmake
        DESTINATION ${_pe_cmake_dir})
