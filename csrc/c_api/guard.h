// How every C API function turns C++ outcomes into a pe_status and the thread's message: no
// exception leaves a C API function.
#pragma once

#include <new>
#include <stdexcept>
#include <string>

#include "pyengine/c_api.h"

namespace pyengine::c_api {

// Sets the calling thread's message and returns `status`.
pe_status set_status(pe_status status, const std::string& message);
inline pe_status ok() { return set_status(PE_OK, ""); }

// An error the C API itself detects (a NULL pointer, an unknown id), with its status.
struct Error {
  pe_status status;
  std::string message;
};

// Runs `body` (which returns a pe_status), mapping what it throws to a status: Error as it says,
// std::invalid_argument -> INVALID_ARGUMENT, std::out_of_range -> NOT_FOUND, other
// std::logic_error -> INVALID_STATE, std::bad_alloc -> OUT_OF_MEMORY, anything else -> RUNTIME.
template <typename Body>
pe_status guarded(Body&& body) noexcept {
  try {
    return body();
  } catch (const Error& e) {
    return set_status(e.status, e.message);
  } catch (const std::invalid_argument& e) {
    return set_status(PE_ERR_INVALID_ARGUMENT, e.what());
  } catch (const std::out_of_range& e) {
    return set_status(PE_ERR_NOT_FOUND, e.what());
  } catch (const std::logic_error& e) {
    return set_status(PE_ERR_INVALID_STATE, e.what());
  } catch (const std::bad_alloc&) {
    return set_status(PE_ERR_OUT_OF_MEMORY, "out of memory");
  } catch (const std::exception& e) {
    return set_status(PE_ERR_RUNTIME, e.what());
  } catch (...) {
    return set_status(PE_ERR_RUNTIME, "unknown C++ exception");
  }
}

// Throws Error(INVALID_ARGUMENT, "<name>: must not be NULL") for a null pointer.
template <typename T>
void require(const T* p, const char* name) {
  if (p == nullptr) throw Error{PE_ERR_INVALID_ARGUMENT, std::string(name) + ": must not be NULL"};
}

}  // namespace pyengine::c_api
