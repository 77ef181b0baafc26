// Run-time instruction-set level of the CPU kernels: see pyengine/cpu_isa.h.
#include "pyengine/cpu_isa.h"

#include <atomic>
#include <cstdlib>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

namespace pyengine {

namespace {

constexpr CpuIsa kAllLevels[] = {CpuIsa::kGeneric, CpuIsa::kAvx2, CpuIsa::kAvx512, CpuIsa::kNeon};

bool cpu_supports(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kGeneric:
      return true;
#if defined(__x86_64__)
    case CpuIsa::kAvx2:
      return cpu_has_feature("avx2") && cpu_has_feature("fma") && cpu_has_feature("f16c");
    case CpuIsa::kAvx512:
      return cpu_supports(CpuIsa::kAvx2) && cpu_has_feature("avx512f") && cpu_has_feature("avx512bw") &&
             cpu_has_feature("avx512vl") && cpu_has_feature("avx512dq");
#endif
#if defined(__aarch64__)
    case CpuIsa::kNeon:
      return true;  // Advanced SIMD is part of every armv8-a CPU
#endif
    default:
      return false;
  }
}

std::string level_list(const std::vector<CpuIsa>& levels) {
  std::string s;
  for (CpuIsa l : levels) s += (s.empty() ? "" : ", ") + std::string(cpu_isa_name(l));
  return s;
}

// The chosen level, or the error that PYENGINE_CPU_ISA caused. Written under `mu`; the level is
// also kept in an atomic so that the kernels' per-call read takes no lock.
std::mutex mu;
bool decided = false;
std::string reason;
std::string error;
std::atomic<int32_t> level{-1};

void decide_locked() {
  if (decided) return;
  decided = true;
  const std::vector<CpuIsa> have = supported_cpu_isas();
  const char* env = std::getenv("PYENGINE_CPU_ISA");
  if (env != nullptr && env[0] != '\0') {
    const std::string name(env);
    CpuIsa want;
    try {
      want = parse_cpu_isa(name);
    } catch (const std::invalid_argument& e) {
      error = "PYENGINE_CPU_ISA=" + name + ": " + e.what() + "; this CPU has " + level_list(have);
      return;
    }
    if (!cpu_supports(want)) {
      error = "PYENGINE_CPU_ISA=" + name + ": this CPU does not support " + name + "; this CPU has " +
              level_list(have);
      return;
    }
    reason = "PYENGINE_CPU_ISA=" + name;
    level.store(static_cast<int32_t>(want));
    return;
  }
  reason = "the highest level this CPU supports";
  level.store(static_cast<int32_t>(have.back()));
}

}  // namespace

const char* cpu_isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kGeneric: return "generic";
    case CpuIsa::kAvx2: return "avx2";
    case CpuIsa::kAvx512: return "avx512";
    case CpuIsa::kNeon: return "neon";
  }
  return "unknown";
}

CpuIsa parse_cpu_isa(const std::string& name) {
  for (CpuIsa l : kAllLevels)
    if (name == cpu_isa_name(l)) return l;
  throw std::invalid_argument("unknown CPU instruction-set level '" + name +
                              "' (known: generic, avx2, avx512, neon)");
}

std::vector<CpuIsa> supported_cpu_isas() {
  std::vector<CpuIsa> out;
  for (CpuIsa l : kAllLevels)
    if (cpu_supports(l)) out.push_back(l);
  return out;
}

CpuIsa cpu_isa() {
  const int32_t l = level.load(std::memory_order_relaxed);
  if (l >= 0) return static_cast<CpuIsa>(l);
  std::lock_guard<std::mutex> lock(mu);
  decide_locked();
  if (!error.empty()) throw std::invalid_argument(error);
  return static_cast<CpuIsa>(level.load());
}

std::string cpu_isa_reason() {
  std::lock_guard<std::mutex> lock(mu);
  decide_locked();
  return error.empty() ? reason : error;
}

void set_cpu_isa(CpuIsa isa) {
  if (!cpu_supports(isa))
    throw std::invalid_argument(std::string("set_cpu_isa: this CPU does not support ") +
                                cpu_isa_name(isa) + "; this CPU has " + level_list(supported_cpu_isas()));
  std::lock_guard<std::mutex> lock(mu);
  decided = true;
  error.clear();
  reason = "set_cpu_isa()";
  level.store(static_cast<int32_t>(isa));
}

}  // namespace pyengine
