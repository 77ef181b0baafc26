// libpyengine_core.so is the static archive's objects linked whole (cmake/install.cmake); CMake
// wants at least one source file per library, and this is it.
