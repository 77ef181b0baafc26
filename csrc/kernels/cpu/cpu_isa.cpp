// Run-time instruction-set level of the CPU kernels: see pyengine/cpu_isa.h.
#include "pyengine/cpu_isa.h"

#include "linear_quant_amx.h"

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
std::atomic<bool> vnni_on{true};  // PYENGINE_CPU_VNNI / set_cpu_vnni; used only where present
bool switch_env_bad = false;  // `error` is PYENGINE_CPU_VNNI's or _AMX's: set_cpu_isa() cannot clear it
std::atomic<bool> amx_on{true};    // PYENGINE_CPU_AMX / set_cpu_amx; used only where present

// Reads a 0/1 switch from the environment into `on`; false (and `error` set) for another value.
bool read_switch(const char* name, const char* meaning, std::atomic<bool>& on) {
  const char* env = std::getenv(name);
  if (env == nullptr || env[0] == '\0') return true;
  const std::string v(env);
  if (v != "0" && v != "1") {
    error = std::string(name) + "=" + v + ": must be 0 (off) or 1 (" + meaning + ")";
    return false;
  }
  on.store(v == "1");
  return true;
}

void decide_locked() {
  if (decided) return;
  decided = true;
  const std::vector<CpuIsa> have = supported_cpu_isas();
  if (!read_switch("PYENGINE_CPU_VNNI", "on where the CPU has it", vnni_on) ||
      !read_switch("PYENGINE_CPU_AMX", "on where the CPU has it", amx_on)) {
    switch_env_bad = true;
    return;
  }
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
  decide_locked();  // reads PYENGINE_CPU_VNNI and _AMX even when this is the process's first call
  if (switch_env_bad) throw std::invalid_argument(error);
  error.clear();
  reason = "set_cpu_isa()";
  level.store(static_cast<int32_t>(isa));
}

const char* cpu_vnni_flag(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kAvx2: return "avx_vnni";
    case CpuIsa::kAvx512: return "avx512_vnni";
    default: return "";
  }
}

bool cpu_vnni() {
  const CpuIsa isa = cpu_isa();  // decides (and reads PYENGINE_CPU_VNNI) on the first call
  if (!vnni_on.load(std::memory_order_relaxed)) return false;
  // per kernel call: the flags looked up once
  static const bool avx2_vnni = cpu_has_feature(cpu_vnni_flag(CpuIsa::kAvx2));
  static const bool avx512_vnni = cpu_has_feature(cpu_vnni_flag(CpuIsa::kAvx512));
  return isa == CpuIsa::kAvx512 ? avx512_vnni : isa == CpuIsa::kAvx2 && avx2_vnni;
}

bool set_cpu_vnni(bool enabled) {
  std::lock_guard<std::mutex> lock(mu);
  decide_locked();
  return vnni_on.exchange(enabled);
}

bool cpu_amx() {
  const CpuIsa isa = cpu_isa();  // decides (and reads PYENGINE_CPU_AMX) on the first call
  if (isa != CpuIsa::kAvx512 || !amx_on.load(std::memory_order_relaxed)) return false;
  static const bool have = cpu_has_feature("amx_tile") && cpu_has_feature("amx_bf16") &&
                           cpu_has_feature("avx512_bf16") && kernels::cpu::amx_permitted();
  return have;
}

bool set_cpu_amx(bool enabled) {
  std::lock_guard<std::mutex> lock(mu);
  decide_locked();
  return amx_on.exchange(enabled);
}

}  // namespace pyengine
