# ctests of the embedded engine (included by cmake/embed.cmake when it builds robot_loop). Both
# run the Python engine on the package's demo model through the python CMake found
# (PYENGINE_EMBED_PYTHON): pyengine must be installed in its environment, or they fail saying so.
enable_testing()
add_executable(test_embed ${CMAKE_CURRENT_LIST_DIR}/test_embed.cpp)
target_link_libraries(test_embed PRIVATE pyengine_embed)
target_compile_options(test_embed PRIVATE -Wall -Wextra)
add_test(NAME test_embed COMMAND test_embed)
# the robot loop's streamed tokens against the Python engine's for the same greedy request
add_test(NAME example_robot_loop
         COMMAND "${PYENGINE_EMBED_PYTHON}" ${CMAKE_CURRENT_LIST_DIR}/embed_robot_loop.py $<TARGET_FILE:robot_loop>)
set_tests_properties(test_embed example_robot_loop PROPERTIES
  ENVIRONMENT "PYENGINE_PYTHON=${PYENGINE_EMBED_PYTHON}" TIMEOUT 900)
# the embedded Python must take that python's environment (a venv's prefix, not its base's)
execute_process(COMMAND "${PYENGINE_EMBED_PYTHON}" -c "import sys; print(sys.prefix)"
                OUTPUT_VARIABLE _pe_embed_prefix OUTPUT_STRIP_TRAILING_WHITESPACE)
set_property(TEST test_embed APPEND PROPERTY ENVIRONMENT "PYENGINE_EXPECTED_PREFIX=${_pe_embed_prefix}")
