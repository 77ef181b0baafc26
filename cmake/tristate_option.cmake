# pyengine_tristate_option(NAME DOC OUT_VAR): NAME is a cache string AUTO (the default), ON or OFF
# (any case); OUT_VAR receives it upper-cased. Any other value stops the configure, naming it.
function(pyengine_tristate_option name doc out_var)
  set(${name} AUTO CACHE STRING "${doc}: AUTO, ON or OFF")
  set_property(CACHE ${name} PROPERTY STRINGS AUTO ON OFF)
  string(TOUPPER "${${name}}" _value)
  if(NOT _value MATCHES "^(AUTO|ON|OFF)$")
    message(FATAL_ERROR "${name} must be AUTO, ON or OFF (got '${${name}}')")
  endif()
  set(${out_var} "${_value}" PARENT_SCOPE)
endfunction()
