# PYENGINE_SANITIZE: build the C++ core, and everything that links it (the C++ tests, the
# examples, the Python extension), with gcc's sanitizers. A comma-separated list for -fsanitize=:
# "address,undefined" (ASan + UBSan) or "thread" (TSan); empty (the default) builds without.
# scripts/sanitize.sh is the CI job that uses it.
set(PYENGINE_SANITIZE "" CACHE STRING "Sanitizers for -fsanitize= (e.g. address,undefined or thread); empty: none")

if(PYENGINE_SANITIZE)
  string(REPLACE "," ";" _pe_san_list "${PYENGINE_SANITIZE}")
  foreach(_san IN LISTS _pe_san_list)
    if(NOT _san MATCHES "^(address|undefined|thread|leak)$")
      message(FATAL_ERROR "PYENGINE_SANITIZE: unknown sanitizer '${_san}' (address, undefined, thread, leak)")
    endif()
  endforeach()
  if("thread" IN_LIST _pe_san_list AND ("address" IN_LIST _pe_san_list OR "leak" IN_LIST _pe_san_list))
    message(FATAL_ERROR "PYENGINE_SANITIZE: thread cannot be combined with address or leak")
  endif()
  # nvcc's host code and the CUDA runtime would not be instrumented, and the runtime's large
  # address-space reservations collide with ASan's shadow memory: sanitize the CPU build only.
  # (PYENGINE_CUDA is declared further down in CMakeLists.txt: unset here is its default, AUTO.)
  string(TOUPPER "${PYENGINE_CUDA}" _pe_san_cuda)
  if(NOT _pe_san_cuda STREQUAL "OFF")
    message(FATAL_ERROR "PYENGINE_SANITIZE needs -DPYENGINE_CUDA=OFF: only the CPU build is sanitized")
  endif()

  # -fno-sanitize-recover: a UBSan finding aborts (non-zero exit) instead of printing and going
  # on, so a test run cannot pass over it. Frame pointers and -g: whole, symbolized stacks.
  # PUBLIC: what links the core (tests, examples, the extension) is instrumented as well.
  set(_pe_san_flags -fsanitize=${PYENGINE_SANITIZE} -fno-sanitize-recover=all
                    -fno-omit-frame-pointer -g)
  target_compile_options(pyengine_core PUBLIC "$<$<COMPILE_LANGUAGE:CXX>:${_pe_san_flags}>")
  # -O1 instead of the core's -O3 (the flag given last wins): what the sanitizers' documentation
  # recommends, and instrumented -O3 compiles the intrinsics-heavy kernels ~5x slower (gcc 12:
  # attention_avx512.cpp 46 s against 9 s), the larger part of CI's sanitizer stage.
  target_compile_options(pyengine_core PRIVATE "$<$<COMPILE_LANGUAGE:CXX>:-O1>")
  target_link_options(pyengine_core PUBLIC -fsanitize=${PYENGINE_SANITIZE})
  message(STATUS "pyengine: sanitizers ON (-fsanitize=${PYENGINE_SANITIZE})")
endif()
