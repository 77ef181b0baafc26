# cmake -DEMULATOR=<runner or ""> -DA=<program> -DB=<program> -P same_output.cmake
# Runs both programs; both must succeed and print the same text (the C API drives the same
# schedule as the C++ API).
cmake_minimum_required(VERSION 3.24)
foreach(_p A B)
  execute_process(COMMAND ${EMULATOR} ${${_p}} RESULT_VARIABLE _rc OUTPUT_VARIABLE _out_${_p} ERROR_VARIABLE _err)
  if(NOT _rc EQUAL 0)
    message(FATAL_ERROR "${${_p}} failed (${_rc}): ${_err}")
  endif()
endforeach()
if(NOT _out_A STREQUAL _out_B)
  message(FATAL_ERROR "outputs differ:\n--- ${A}\n${_out_A}\n--- ${B}\n${_out_B}")
endif()
if(NOT _out_A MATCHES "free blocks 64 of 64; reused tokens 16")
  message(FATAL_ERROR "unexpected output:\n${_out_A}")
endif()
message(STATUS "same output:\n${_out_A}")
