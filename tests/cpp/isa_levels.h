// Runs a test body once at every instruction-set level this CPU supports (pyengine/cpu_isa.h),
// passing the level's name, and restores the level that was active before.
#pragma once

#include <iostream>
#include <string>

#include "pyengine/cpu_isa.h"

template <typename F>
void at_every_level(F&& f) {
  const pyengine::CpuIsa previous = pyengine::cpu_isa();
  for (pyengine::CpuIsa level : pyengine::supported_cpu_isas()) {
    pyengine::set_cpu_isa(level);
    f(pyengine::cpu_isa_name(level));
  }
  pyengine::set_cpu_isa(previous);
}

// at_every_level for a body that takes no argument, printing each level before running it.
template <typename F>
void at_every_level_logged(F&& body) {
  at_every_level([&](const char* level) {
    std::cout << "  level " << level << "\n";
    body();
  });
}

// at_every_level, and again with VNNI at each level whose VNNI this CPU has ("avx512+vnni"):
// for the quantized kernels, the only ones that use it; their 8-bit paths, with AMX off (its
// path has tests of its own). VNNI and AMX are back to their previous states after.
template <typename F>
void at_every_level_and_vnni(F&& f) {
  const bool previous = pyengine::set_cpu_vnni(false);
  const bool previous_amx = pyengine::set_cpu_amx(false);
  at_every_level([&](const char* level) {
    pyengine::set_cpu_vnni(false);
    f(level);
    pyengine::set_cpu_vnni(true);
    if (pyengine::cpu_vnni()) f((std::string(level) + "+vnni").c_str());
  });
  pyengine::set_cpu_vnni(previous);
  pyengine::set_cpu_amx(previous_amx);
}
