# The Python engine embedded in C++ (csrc/include/pyengine/embed.hpp): the robot_loop example
# and, with PYENGINE_BUILD_TESTS, its ctests (tests/cpp/embed.cmake).
# PYENGINE_EMBED = AUTO (build them when pybind11 and Python's embedding library are found),
# ON (require them), OFF. Nothing here links the C++ core: embed.hpp drives the Python package.
pyengine_tristate_option(PYENGINE_EMBED "Build the embedded-engine example and tests" _pe_embed)

set(_pe_embed_build OFF)
if(PYENGINE_SANITIZE AND NOT _pe_embed STREQUAL "OFF")
  # The programs would load the sanitized Python extension into an uninstrumented process
  # (ASan must come first); scripts/sanitize.sh covers the core through pytest instead.
  if(_pe_embed STREQUAL "ON")
    message(FATAL_ERROR "pyengine: PYENGINE_EMBED=ON cannot be combined with PYENGINE_SANITIZE")
  endif()
  message(STATUS "pyengine: embedded-engine example and tests OFF (PYENGINE_SANITIZE is set)")
elseif(NOT _pe_embed STREQUAL "OFF" AND (PYENGINE_BUILD_EXAMPLES OR PYENGINE_BUILD_TESTS))
  set(_pe_embed_missing "")
  find_package(Python 3.10 COMPONENTS Interpreter Development.Embed)
  if(NOT Python_Interpreter_FOUND OR NOT Python_Development.Embed_FOUND)
    list(APPEND _pe_embed_missing "Python's interpreter and embedding library (Development.Embed)")
  else()
    # pybind11 from the same interpreter's packages (pip install pybind11, in the test extra)
    execute_process(COMMAND "${Python_EXECUTABLE}" -m pybind11 --cmakedir
                    OUTPUT_VARIABLE _pe_pybind11_dir OUTPUT_STRIP_TRAILING_WHITESPACE
                    ERROR_QUIET RESULT_VARIABLE _pe_pybind11_rc)
    if(_pe_pybind11_rc EQUAL 0)
      find_package(pybind11 2.12 CONFIG QUIET HINTS "${_pe_pybind11_dir}")
    endif()
    if(NOT pybind11_FOUND)
      list(APPEND _pe_embed_missing "pybind11 >= 2.12 (pip install pybind11 into ${Python_EXECUTABLE}'s environment)")
    endif()
  endif()
  if(_pe_embed_missing)
    string(REPLACE ";" " and " _pe_embed_missing "${_pe_embed_missing}")
    if(_pe_embed STREQUAL "ON")
      message(FATAL_ERROR "pyengine: PYENGINE_EMBED=ON but CMake is missing ${_pe_embed_missing}")
    endif()
    message(STATUS "pyengine: embedded-engine example and tests OFF (missing ${_pe_embed_missing})")
  else()
    set(_pe_embed_build ON)
  endif()
elseif(PYENGINE_BUILD_EXAMPLES OR PYENGINE_BUILD_TESTS)
  message(STATUS "pyengine: embedded-engine example and tests OFF (PYENGINE_EMBED=OFF)")
endif()

if(_pe_embed_build)
  # The python the programs embed at run time (PYENGINE_PYTHON): sys.executable as that
  # interpreter reports it, not a launcher script (a pyenv shim) whose directory holds no
  # installation and no pyvenv.cfg.
  execute_process(COMMAND "${Python_EXECUTABLE}" -c "import sys; print(sys.executable)"
                  OUTPUT_VARIABLE PYENGINE_EMBED_PYTHON OUTPUT_STRIP_TRAILING_WHITESPACE)
  add_library(pyengine_embed INTERFACE)
  target_include_directories(pyengine_embed INTERFACE ${CMAKE_CURRENT_SOURCE_DIR}/csrc/include)
  find_package(Threads REQUIRED)
  target_link_libraries(pyengine_embed INTERFACE pybind11::embed Threads::Threads)
  add_executable(robot_loop examples/cpp/robot_loop.cpp)
  target_link_libraries(robot_loop PRIVATE pyengine_embed)
  target_compile_options(robot_loop PRIVATE -Wall -Wextra)
  message(STATUS "pyengine: embedded-engine example and tests ON (python ${PYENGINE_EMBED_PYTHON}, "
                 "pybind11 ${pybind11_VERSION})")
  if(PYENGINE_BUILD_TESTS)
    include(${CMAKE_CURRENT_SOURCE_DIR}/tests/cpp/embed.cmake)
  endif()
endif()
