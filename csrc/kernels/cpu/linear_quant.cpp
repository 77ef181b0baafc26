// linear_quant: see pyengine/cpu_quant.h. The front end: argument checks, x quantized to 8-bit
// blocks once (shared by all threads), each thread taking a contiguous range of output columns
// (weight rows); the compute code is the active level's (linear_quant_<level>.cpp).
#include "parallel.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "column_split.h"
#include "isa_target.h"
#include "linear_quant_amx.h"
#include "linear_quant_common.h"
#include "pyengine/cpu_quant.h"

namespace pyengine::kernels {

namespace {

using cpu::QuantLinearArgs;

// Below this many weight bytes a call runs on one thread (a fork/join costs more).
constexpr int64_t kMinParallelBytes = 1 << 14;
// Output columns handed to a thread are a multiple of this (interleaved layouts: of their groups).
constexpr int32_t kColumnGrain = 4;
// Rows of x per pass over the weights.
constexpr int32_t kRowChunk = 32;

void fail(const std::string& msg) { throw std::invalid_argument(msg); }

// x spread for the block-pair kernels (spread_activation_pairs: 8 bytes a value), made by each
// thread that computes columns of a call, for itself, in a buffer of its own. Why: made once by
// the calling thread and read by the others, every line of it (16-48 KB a call at the W5 model's
// widths) crossed from the calling core's cache on each call -- 2-6 us a call at two threads on a
// Xeon, a third of a small matrix's time -- while x itself (1 byte a value) is cheap to share.
// A thread's buffer is remade when it first works on a new call; calls are numbered globally, so
// a thread that serves several callers never takes one call's spread for another's.
struct SpreadX {
  static uint64_t next_call() {
    static std::atomic<uint64_t> calls{0};
    return calls.fetch_add(1, std::memory_order_relaxed) + 1;
  }
  static const uint8_t* of_this_thread(uint64_t call, const uint8_t* xq, int32_t K) {
    static thread_local uint64_t made_for = 0;
    static thread_local std::vector<uint8_t> buffer;
    auto aligned = [] {
      return reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(buffer.data()) + 63) & ~uintptr_t{63});
    };
    if (made_for != call) {
      buffer.resize(static_cast<size_t>(cpu::spread_activation_bytes(K) + 64));
#if PYENGINE_ISA_X86  // (the avx512 level exists on x86 alone; elsewhere that namespace holds the portable build)
      cpu::isa_avx512_vnni::spread_activation_pairs(xq, K, aligned());
#endif
      made_for = call;
    }
    return aligned();
  }
};

void run_rows(const QuantLinearArgs& a, int32_t n0, int32_t n1, bool vnni) {
  if (vnni) {  // only at avx2 and avx512, on CPUs with their VNNI
    if (cpu_isa() == CpuIsa::kAvx512)
      cpu::isa_avx512_vnni::quant_linear_rows(a, n0, n1);
    else
      cpu::isa_avx2_vnni::quant_linear_rows(a, n0, n1);
    return;
  }
  PYENGINE_ISA_CALL(quant_linear_rows, a, n0, n1);
}

}  // namespace

void quantize_activation_blocks(const float* x, int64_t ldx, int32_t M, int32_t K, int32_t block, void* out) {
  if (block != cpu::kQK && block != cpu::kQKK) fail("block: must be 32 or 256, got " + std::to_string(block));
  if (M < 0) fail("M: must be >= 0, got " + std::to_string(M));
  if (K < 1 || K % block != 0)
    fail("K: must be a positive multiple of " + std::to_string(block) + ", got " + std::to_string(K));
  if (ldx < K) fail("ldx: must be >= K = " + std::to_string(K) + ", got " + std::to_string(ldx));
  if (M > 0 && (x == nullptr || out == nullptr)) fail("x/out: must not be null");
  (void)cpu_isa();
  PYENGINE_ISA_CALL(quantize_activations, x, ldx, 0, M, K, block, static_cast<uint8_t*>(out),
                    cpu::act_row_bytes(block, K));
}

void linear_quant(float* y, int64_t ldy, const float* x, int64_t ldx, int32_t M, const void* weight,
                  QuantType type, int32_t N, int32_t K, const float* bias, int32_t num_threads) {
  if (y == nullptr) fail("y: must not be null");
  if (x == nullptr) fail("x: must not be null");
  if (weight == nullptr) fail("weight: must not be null");
  if (M < 1) fail("M: must be > 0, got " + std::to_string(M));
  if (N < 1) fail("N: must be > 0, got " + std::to_string(N));
  const int64_t wrow = quant_row_bytes(type, K);  // checks the type and K
  const bool interleaved = plain_type(type) != type;
  if (interleaved && N % kInterleaveRows != 0)
    fail("N: " + std::string(quant_format(type).name) + " holds groups of " + std::to_string(kInterleaveRows) +
         " rows, got " + std::to_string(N));
  if (ldx < K) fail("ldx: must be >= K = " + std::to_string(K) + ", got " + std::to_string(ldx));
  if (ldy < N) fail("ldy: must be >= N = " + std::to_string(N) + ", got " + std::to_string(ldy));
  // throws here, before any thread starts, if PYENGINE_CPU_ISA or PYENGINE_CPU_VNNI is invalid
  const bool vnni = cpu_vnni();

  const int nt_max = cpu::resolve_threads(num_threads);
  if (M >= kQuantAmxMinRows && cpu::amx_supports(type) && cpu_amx()) {
    cpu::linear_quant_amx(y, ldy, x, ldx, M, static_cast<const uint8_t*>(weight), wrow, type, N, K, bias, nt_max);
    return;
  }
  // x -> 8-bit blocks once; reused across calls by the calling thread.
  static thread_local std::vector<uint8_t> xq;
  const int32_t act = cpu::act_block_elems(type);
  const int64_t xrow = cpu::act_row_bytes(act, K);
  xq.resize(static_cast<size_t>(M * xrow));
  uint8_t* xqp = xq.data();
  if (M >= 16 && nt_max > 1) {
PYENGINE_OMP(parallel num_threads(nt_max))
    {
      const cpu::GroupRange rows = cpu::thread_groups(M, cpu::thread_id(), cpu::team_size());
      PYENGINE_ISA_CALL(quantize_activations, x, ldx, rows.begin, rows.end, K, act, xqp, xrow);
    }
  } else {
    PYENGINE_ISA_CALL(quantize_activations, x, ldx, 0, M, K, act, xqp, xrow);
  }

  const QuantLinearArgs a{y, ldy, xqp, xrow, static_cast<const uint8_t*>(weight), wrow, type, bias, M, N, K};
  // One row of x, avx512 with VNNI, Q4_K or Q6_K interleaved: x spread for the kernels that sum two
  // blocks at once (QuantLinearArgs::xspread), by each thread for itself (SpreadX)
  const bool spread = M == 1 && vnni && cpu_isa() == CpuIsa::kAvx512 &&
                      (type == QuantType::kQ4_Kx8 || type == QuantType::kQ6_Kx8);
  const uint64_t call = spread ? SpreadX::next_call() : 0;
  int nt = nt_max;
  if (static_cast<int64_t>(N) * wrow * std::max<int64_t>(1, M / 8) < kMinParallelBytes) nt = 1;
  // Many rows of x (prefill): a chunk of them at a time, so that the chunk's activation blocks stay
  // in cache while each thread streams its weight rows past them (rather than every weight row
  // streaming all of x).
  const int32_t grain = interleaved ? kInterleaveRows : kColumnGrain;
  cpu::split_columns(N, nt, grain, grain * wrow, [&](int32_t n0, int32_t n1) {
    QuantLinearArgs mine = a;
    if (spread) mine.xspread = SpreadX::of_this_thread(call, xqp, K);
    for (int32_t m0 = 0; m0 < M; m0 += kRowChunk) {
      QuantLinearArgs chunk = mine;
      chunk.y = y + m0 * ldy;
      chunk.xq = xqp + m0 * xrow;
      chunk.M = std::min(kRowChunk, M - m0);
      run_rows(chunk, n0, n1, vnni);
    }
  });
}

}  // namespace pyengine::kernels
