// The CPU's feature flags and model name, from the CPU itself (cpuid/xgetbv on x86-64, the
// kernel's hardware capability words on aarch64 Linux): see pyengine/cpu_isa.h.
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "pyengine/cpu_isa.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#endif
#if defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#endif

namespace pyengine {

namespace {

#if defined(__x86_64__) && defined(__GNUC__)
struct Cpuid {
  uint32_t a = 0, b = 0, c = 0, d = 0;
};

Cpuid cpuid(uint32_t leaf, uint32_t subleaf) {
  Cpuid r;
  if (!__get_cpuid_count(leaf, subleaf, &r.a, &r.b, &r.c, &r.d)) r = Cpuid{};
  return r;
}

// The register state the OS saves on context switches (XCR0): a feature is usable only if the
// OS saves its registers -- Linux's /proc/cpuinfo drops the flag otherwise, and so do we.
uint64_t xcr0() {
  uint32_t lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));  // no -mxsave needed, unlike _xgetbv
  return (uint64_t{hi} << 32) | lo;
}

bool bit(uint32_t reg, int n) { return (reg >> n) & 1u; }

std::vector<std::string> detect_flags() {
  std::vector<std::string> flags;
  const Cpuid l1 = cpuid(1, 0);
  const uint32_t max_leaf = cpuid(0, 0).a;
  const Cpuid l7 = max_leaf >= 7 ? cpuid(7, 0) : Cpuid{};
  const Cpuid l7_1 = max_leaf >= 7 && l7.a >= 1 ? cpuid(7, 1) : Cpuid{};
  const uint64_t xcr = bit(l1.c, 27) ? xcr0() : 0;  // OSXSAVE: xgetbv is available
  const bool os_avx = (xcr & 0x6) == 0x6;           // XMM and YMM state
  const bool os_avx512 = os_avx && (xcr & 0xe0) == 0xe0;  // opmask, ZMM_Hi256, Hi16_ZMM
  const bool os_amx = (xcr & 0x60000) == 0x60000;         // XTILECFG, XTILEDATA
  auto add = [&](bool have, const char* name) {
    if (have) flags.emplace_back(name);
  };
  add(bit(l1.c, 20), "sse4_2");
  add(os_avx && bit(l1.c, 28), "avx");
  add(os_avx && bit(l7.b, 5), "avx2");
  add(os_avx && bit(l1.c, 12), "fma");
  add(os_avx && bit(l1.c, 29), "f16c");
  add(os_avx512 && bit(l7.b, 16), "avx512f");
  add(os_avx512 && bit(l7.b, 30), "avx512bw");
  add(os_avx512 && bit(l7.b, 31), "avx512vl");
  add(os_avx512 && bit(l7.b, 17), "avx512dq");
  add(os_avx512 && bit(l7_1.a, 5), "avx512_bf16");
  add(os_avx512 && bit(l7.c, 11), "avx512_vnni");
  add(os_avx && bit(l7_1.a, 4), "avx_vnni");
  add(os_amx && bit(l7.d, 24), "amx_tile");
  add(os_amx && bit(l7.d, 22), "amx_bf16");
  return flags;
}

std::string detect_model_name() {
  if (cpuid(0x80000000u, 0).a < 0x80000004u) return "";
  char brand[49] = {};
  for (uint32_t i = 0; i < 3; ++i) {
    const Cpuid r = cpuid(0x80000002u + i, 0);
    std::memcpy(brand + 16 * i, &r, 16);  // eax, ebx, ecx, edx in order
  }
  std::string s(brand);
  // trimmed at both ends, as /proc/cpuinfo shows it
  const size_t first = s.find_first_not_of(' ');
  if (first == std::string::npos) return "";
  return s.substr(first, s.find_last_not_of(' ') - first + 1);
}

std::string detect_vendor() {
  const Cpuid r = cpuid(0, 0);
  char id[13] = {};
  std::memcpy(id, &r.b, 4);  // ebx, edx, ecx
  std::memcpy(id + 4, &r.d, 4);
  std::memcpy(id + 8, &r.c, 4);
  return id;
}

int detect_family() {
  const uint32_t a = cpuid(1, 0).a;
  const int base = static_cast<int>((a >> 8) & 0xf);
  return base == 0xf ? base + static_cast<int>((a >> 20) & 0xff) : base;
}

#elif defined(__aarch64__) && defined(__linux__)
std::vector<std::string> detect_flags() {
  std::vector<std::string> flags;
  const unsigned long hwcap = getauxval(AT_HWCAP);
  auto add = [&](bool have, const char* name) {
    if (have) flags.emplace_back(name);
  };
  // Linux's uapi bit numbers (asm/hwcap.h), spelled out: older headers lack some names.
  add(hwcap & (1ul << 1), "asimd");
  add(hwcap & (1ul << 9), "fphp");
  add(hwcap & (1ul << 10), "asimdhp");
  add(hwcap & (1ul << 20), "asimddp");
  add(hwcap & (1ul << 22), "sve");
#if defined(AT_HWCAP2)
  const unsigned long hwcap2 = getauxval(AT_HWCAP2);
  add(hwcap2 & (1ul << 14), "bf16");
  add(hwcap2 & (1ul << 13), "i8mm");
#endif
  return flags;
}

std::string detect_model_name() { return ""; }
std::string detect_vendor() { return ""; }
int detect_family() { return 0; }

#else
std::vector<std::string> detect_flags() { return {}; }
std::string detect_model_name() { return ""; }
std::string detect_vendor() { return ""; }
int detect_family() { return 0; }
#endif

}  // namespace

const std::vector<std::string>& cpu_feature_flags() {
  static const std::vector<std::string> flags = detect_flags();
  return flags;
}

bool cpu_has_feature(const std::string& flag) {
  for (const std::string& f : cpu_feature_flags())
    if (f == flag) return true;
  return false;
}

const std::string& cpu_model_name() {
  static const std::string name = detect_model_name();
  return name;
}

const std::string& cpu_vendor() {
  static const std::string vendor = detect_vendor();
  return vendor;
}

int cpu_family() {
  static const int family = detect_family();
  return family;
}

}  // namespace pyengine
