// Instruction-set levels of the CPU kernels, chosen once at run time, and the CPU's features.
//
// Every CPU kernel (paged attention, KV store, linear, the fused elementwise kernels, the
// one-call decode layers) is compiled once per level; the binary itself stays baseline x86-64
// (or baseline armv8-a), so one build runs on every CPU of its architecture. At the first kernel
// call the highest level the CPU supports is taken, unless the PYENGINE_CPU_ISA environment
// variable names a lower one (for tests, and for measuring a lower level's speed on a bigger
// CPU). set_cpu_isa() changes the level later in the process.
//
// Levels, lowest first:
//   x86-64:  generic (portable C++, baseline SSE2), avx2 (AVX2 + FMA + F16C),
//            avx512 (AVX-512 F/BW/VL/DQ)
//   aarch64: generic (portable C++, baseline armv8-a), neon (Advanced SIMD intrinsics)
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace pyengine {

enum class CpuIsa : int32_t { kGeneric = 0, kAvx2 = 1, kAvx512 = 2, kNeon = 3 };

// "generic", "avx2", "avx512" or "neon".
const char* cpu_isa_name(CpuIsa isa);

// The level named `name`; throws std::invalid_argument naming the known names otherwise.
CpuIsa parse_cpu_isa(const std::string& name);

// The levels this CPU supports, lowest first (always starting with generic).
std::vector<CpuIsa> supported_cpu_isas();

// The level the kernels run at. The first call decides it (PYENGINE_CPU_ISA, else the highest
// supported level); if PYENGINE_CPU_ISA names an unknown level, or one this CPU lacks, this and
// every kernel call throw std::invalid_argument naming the value and the levels the CPU has,
// until set_cpu_isa() picks a valid one.
CpuIsa cpu_isa();

// Why cpu_isa() is what it is: "the highest level this CPU supports", "PYENGINE_CPU_ISA=avx2"
// or "set_cpu_isa()".
std::string cpu_isa_reason();

// Runs the kernels at `isa` from now on (for all threads); throws std::invalid_argument if this
// CPU does not support it. Not meant to be called while kernels run on other threads.
void set_cpu_isa(CpuIsa isa);

// VNNI (vpdpbusd: four unsigned-by-signed byte products summed into each int32 lane), which the
// quantized linear kernels use where their level has it: AVX-VNNI at avx2 (Alder Lake and later,
// Zen 5), AVX512-VNNI at avx512 (Ice Lake and later, Zen 4 and later); generic and neon have none.
// Results are the same bits either way (the integer sums are exact in both). In use wherever the
// CPU has it, unless the PYENGINE_CPU_VNNI environment variable is "0" (any value other than
// "0" and "1" makes cpu_isa(), set_cpu_isa() and every kernel call throw, naming it) or
// set_cpu_vnni(false) turned it off.
//
// The feature flag of `isa`'s VNNI ("avx_vnni", "avx512_vnni"), or "" where the level has none.
const char* cpu_vnni_flag(CpuIsa isa);

// True if the kernels use VNNI now: the active level has it, the CPU has it, and it is not off.
bool cpu_vnni();

// Turns VNNI off (false) or back on where the active level and the CPU have it (true), for all
// threads, and returns the previous setting; not meant to be called while kernels run on other
// threads.
bool set_cpu_vnni(bool enabled);

// AMX-BF16 (tile multiplies of bf16 pairs with fp32 sums), which the quantized linear kernel uses
// at level avx512 for batches of 16 rows of x or more (prompts, batched decoding): the weights
// dequantized to bf16 a tile at a time, x rounded to bf16 (pyengine/cpu_quant.h: linear_quant).
// Unlike VNNI it changes results (bf16 activations instead of 8-bit blocks), within the same
// error bounds. In use where the level is avx512, the CPU has amx_tile, amx_bf16 and avx512_bf16
// and Linux grants the process the tile state, unless the PYENGINE_CPU_AMX environment variable
// is "0" (any value other than "0" and "1" makes cpu_isa(), set_cpu_isa() and every kernel call
// throw, naming it) or set_cpu_amx(false) turned it off.
bool cpu_amx();

// Turns AMX off (false) or back on where the CPU has it (true), for all threads, and returns the
// previous setting; not meant to be called while kernels run on other threads.
bool set_cpu_amx(bool enabled);

// The CPU features that matter to the kernels, named as Linux's /proc/cpuinfo names them, in this
// order -- x86-64: sse4_2 avx avx2 fma f16c avx512f avx512bw avx512vl avx512dq avx512_bf16
// avx512_vnni avx_vnni amx_tile amx_bf16 (from cpuid; AVX, AVX-512 and AMX features only when the OS saves
// their registers, per xgetbv); aarch64 Linux: asimd fphp asimdhp asimddp sve bf16 i8mm (from the
// kernel's HWCAP words). Other platforms: none. Detected once; thread-safe.
const std::vector<std::string>& cpu_feature_flags();

// True if `flag` (a name above) is among cpu_feature_flags().
bool cpu_has_feature(const std::string& flag);

// The CPU's model name as /proc/cpuinfo's "model name" shows it (x86-64: the cpuid brand string,
// trimmed); "" where the CPU does not say (aarch64). Detected once; thread-safe.
const std::string& cpu_model_name();

// The CPU's vendor as cpuid leaf 0 names it ("GenuineIntel", "AuthenticAMD", ...); "" where the
// CPU does not say (aarch64). For the few tuning choices that differ between the two x86 vendors'
// cores. Detected once; thread-safe.
const std::string& cpu_vendor();

// The x86 display family (cpuid leaf 1: the base family, plus the extended family where the base
// is 15): 6 for Intel's cores, 0x19 for AMD Zen 3 and Zen 4, 0x1a for Zen 5; 0 where there is
// none (aarch64). Detected once; thread-safe.
int cpu_family();

}  // namespace pyengine
