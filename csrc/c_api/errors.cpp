// The C API's status names and per-thread error message.
#include <string>

#include "c_api/guard.h"

namespace pyengine::c_api {

namespace {
thread_local std::string last_message;
}

pe_status set_status(pe_status status, const std::string& message) {
  try {
    last_message = message;
  } catch (...) {  // no memory for the message: keep the status
    last_message.clear();
  }
  return status;
}

}  // namespace pyengine::c_api

extern "C" {

const char* pe_last_error_message(void) { return pyengine::c_api::last_message.c_str(); }

const char* pe_status_name(pe_status status) {
  switch (status) {
    case PE_OK: return "PE_OK";
    case PE_ERR_INVALID_ARGUMENT: return "PE_ERR_INVALID_ARGUMENT";
    case PE_ERR_NOT_FOUND: return "PE_ERR_NOT_FOUND";
    case PE_ERR_INVALID_STATE: return "PE_ERR_INVALID_STATE";
    case PE_ERR_OUT_OF_MEMORY: return "PE_ERR_OUT_OF_MEMORY";
    case PE_ERR_RUNTIME: return "PE_ERR_RUNTIME";
  }
  return "unknown";
}

}  // extern "C"
