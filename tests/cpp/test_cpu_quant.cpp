// The quantized-weight kernels through the C++ API (pyengine/cpu_quant.h), at every
// instruction-set level this CPU has: quantize -> dequantize round trips, linear_quant against a
// double-precision reference on activations that the 8-bit blocks represent exactly (llama.cpp's
// layouts and the interleaved ones), batch invariance, no read past the last weight row (a guard
// page), argument errors.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include <sys/mman.h>
#include <unistd.h>

#include "isa_levels.h"
#include "pyengine/cpu_quant.h"
#include "test_harness.h"

using namespace pyengine::kernels;

namespace {

const QuantType kTypes[] = {QuantType::kQ8_0, QuantType::kQ5_0, QuantType::kQ5_1, QuantType::kQ4_0,
                            QuantType::kQ4_K, QuantType::kQ5_K, QuantType::kQ6_K, QuantType::kQ4_Z};

const QuantType kInterleavable[] = {QuantType::kQ8_0, QuantType::kQ5_0, QuantType::kQ5_1, QuantType::kQ4_0,
                                    QuantType::kQ4_K, QuantType::kQ5_K, QuantType::kQ6_K, QuantType::kQ4_Z};

std::vector<float> gaussian(std::mt19937& rng, size_t n) {
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

// Activations whose every block of 256 (hence of 32) holds integers in [-127, 127] times a
// power of two, with 127 in it: the kernel's 8-bit blocks represent them exactly.
std::vector<float> exact_activations(std::mt19937& rng, int32_t M, int32_t K) {
  std::uniform_int_distribution<int> q(-127, 127);
  std::vector<float> x(static_cast<size_t>(M) * K);
  for (int32_t m = 0; m < M; ++m)
    for (int32_t k = 0; k < K; ++k) {
      const float scale = std::ldexp(1.0f, (m + k / 256) % 5 - 9);
      x[m * K + k] = static_cast<float>(k % 32 == 0 ? 127 : q(rng)) * scale;
    }
  return x;
}

struct Quantized {
  std::vector<uint8_t> data;
  std::vector<float> values;  // dequantized
};

Quantized quantize(QuantType t, const std::vector<float>& w, int32_t N, int32_t K) {
  Quantized q;
  q.data.resize(static_cast<size_t>(N * quant_row_bytes(t, K)));
  quantize_rows(t, w.data(), q.data.data(), N, K, 2);
  q.values.resize(w.size());
  dequantize_rows(t, q.data.data(), q.values.data(), N, K);
  return q;
}

// The blocks of `q` (N rows of `t`) in t's interleaved layout.
std::vector<uint8_t> interleaved(QuantType t, const Quantized& q, int32_t N, int32_t K) {
  std::vector<uint8_t> out(static_cast<size_t>(N * quant_row_bytes(interleaved_type(t), K)));
  interleave_rows(t, q.data.data(), out.data(), N, K);
  return out;
}

// x8: compute from the interleaved layout of the same blocks.
void check_against_reference(QuantType t, int32_t M, int32_t N, int32_t K, std::mt19937& rng, const char* level,
                             bool x8 = false) {
  Quantized w = quantize(t, gaussian(rng, static_cast<size_t>(N) * K), N, K);
  const std::vector<uint8_t> plain = w.data;
  if (x8) w.data = interleaved(t, w, N, K);
  const QuantType lt = x8 ? interleaved_type(t) : t;
  const std::vector<float> x = exact_activations(rng, M, K);
  std::vector<float> bias = gaussian(rng, N), y(static_cast<size_t>(M) * N);
  linear_quant(y.data(), N, x.data(), K, M, w.data.data(), lt, N, K, bias.data(), 2);
  const int32_t block = quant_format(t).block_elems;
  const double u = std::ldexp(1.0, -24), gamma = (K / block + 6) * u;
  // Q4_K and Q5_K subtract their sub-block offsets (dmin * m), Q5_1 adds its block's m, apart
  // from the scaled levels: the rounding errors scale with |w| + 2 |offset| there. The offsets:
  // the values with every level zeroed (the bytes after the block's scales).
  std::vector<float> offsets(w.values.size(), 0.0f);
  const size_t levels_at = t == QuantType::kQ5_1 ? 4 : 16;
  if (t == QuantType::kQ4_K || t == QuantType::kQ5_K || t == QuantType::kQ5_1) {
    const size_t block_bytes = quant_format(t).block_bytes;
    std::vector<uint8_t> zeroed = plain;
    for (size_t b = 0; b < zeroed.size(); b += block_bytes)
      std::memset(&zeroed[b + levels_at], 0, block_bytes - levels_at);
    dequantize_rows(t, zeroed.data(), offsets.data(), N, K);
  }
  for (int32_t m = 0; m < M; ++m)
    for (int32_t n = 0; n < N; ++n) {
      double exact = bias[n], terms = std::fabs(bias[n]);
      for (int32_t k = 0; k < K; ++k) {
        const size_t i = static_cast<size_t>(n) * K + k;
        exact += static_cast<double>(x[m * K + k]) * w.values[i];
        terms += std::fabs(static_cast<double>(x[m * K + k])) * (std::fabs(w.values[i]) + 2 * std::fabs(offsets[i]));
      }
      const double err = std::fabs(y[m * N + n] - exact);
      if (!(err <= gamma * terms))
        test::fail(__FILE__, __LINE__, std::string(level) + " " + quant_format(lt).name + " M=" + std::to_string(M) +
                                           " N=" + std::to_string(N) + ": error " + std::to_string(err) +
                                           " > bound " + std::to_string(gamma * terms));
    }
  // batch invariance: the first row alone gives bit for bit what it gave in the batch
  std::vector<float> y1(N);
  linear_quant(y1.data(), N, x.data(), K, 1, w.data.data(), lt, N, K, bias.data(), 2);
  CHECK(std::memcmp(y1.data(), y.data(), sizeof(float) * N) == 0);
}

}  // namespace

TEST(round_trip_error_is_within_the_format_grid) {
  std::mt19937 rng(1);
  const int32_t N = 4, K = 512;
  const std::vector<float> w = gaussian(rng, N * K);
  for (QuantType t : kTypes) {
    const Quantized q = quantize(t, w, N, K);
    double se = 0, ss = 0;
    for (size_t i = 0; i < w.size(); ++i) se += (q.values[i] - w[i]) * (q.values[i] - w[i]), ss += w[i] * w[i];
    const double rel = std::sqrt(se / ss);
    const double bound = t == QuantType::kQ8_0 ? 0.007
                         : t == QuantType::kQ6_K ? 0.022
                         : t == QuantType::kQ5_0 || t == QuantType::kQ5_1 || t == QuantType::kQ5_K ? 0.05
                                                                                                   : 0.1;
    CHECK(rel < bound);
  }
}

TEST(linear_matches_double_reference_at_every_level) {
  at_every_level_and_vnni([](const char* level) {
    std::mt19937 rng(2);
    for (QuantType t : kTypes)
      for (int32_t M : {1, 2, 3, 5, 9})
        for (int32_t N : {1, 3, 4, 7})
          check_against_reference(t, M, N, 768, rng, level);
  });
}

TEST(interleaved_layouts_hold_the_same_blocks_and_compute_the_same_products) {
  std::mt19937 rng(4);
  const int32_t N = 16, K = 512;
  for (QuantType t : kInterleavable) {
    const Quantized q = quantize(t, gaussian(rng, static_cast<size_t>(N) * K), N, K);
    const std::vector<uint8_t> x8 = interleaved(t, q, N, K);
    std::vector<uint8_t> back(q.data.size());
    deinterleave_rows(interleaved_type(t), x8.data(), back.data(), N, K);
    CHECK(back == q.data);
    std::vector<float> values(q.values.size());
    dequantize_rows(interleaved_type(t), x8.data(), values.data(), N, K);
    CHECK(values == q.values);
    CHECK(plain_type(interleaved_type(t)) == t);
  }
  at_every_level_and_vnni([](const char* level) {
    std::mt19937 rng(5);
    for (QuantType t : kInterleavable)
      for (int32_t M : {1, 2, 3, 4, 5, 9})
        for (int32_t N : {8, 16, 24})
          check_against_reference(t, M, N, 768, rng, level, true);
  });
}

TEST(no_read_past_the_last_weight_row) {
  // the weights end exactly at a PROT_NONE page: any read beyond them faults
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  void* mem = mmap(nullptr, 4 * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  CHECK(mem != MAP_FAILED);
  CHECK_EQ(mprotect(static_cast<char*>(mem) + 3 * page, page, PROT_NONE), 0);
  at_every_level_and_vnni([&](const char*) {
    std::mt19937 rng(3);
    for (QuantType t : kTypes)
      for (int32_t N : {1, 2, 5}) {
        const int32_t K = 512;
        const Quantized w = quantize(t, gaussian(rng, static_cast<size_t>(N) * K), N, K);
        uint8_t* at = static_cast<uint8_t*>(mem) + 3 * page - w.data.size();
        std::memcpy(at, w.data.data(), w.data.size());
        for (int32_t M : {1, 2, 4}) {
          const std::vector<float> x = exact_activations(rng, M, K);
          std::vector<float> y(static_cast<size_t>(M) * N), ref(y.size());
          linear_quant(y.data(), N, x.data(), K, M, at, t, N, K, nullptr, 2);
          linear_quant(ref.data(), N, x.data(), K, M, w.data.data(), t, N, K, nullptr, 2);
          CHECK(y == ref);
        }
      }
    for (QuantType t : kInterleavable)  // the last group of 8 rows of an interleaved layout
      for (int32_t N : {8, 16}) {
        const int32_t K = 512;
        const Quantized w = quantize(t, gaussian(rng, static_cast<size_t>(N) * K), N, K);
        const std::vector<uint8_t> x8 = interleaved(t, w, N, K);
        uint8_t* at = static_cast<uint8_t*>(mem) + 3 * page - x8.size();
        std::memcpy(at, x8.data(), x8.size());
        for (int32_t M : {1, 2, 5}) {
          const std::vector<float> x = exact_activations(rng, M, K);
          std::vector<float> y(static_cast<size_t>(M) * N), ref(y.size());
          linear_quant(y.data(), N, x.data(), K, M, at, interleaved_type(t), N, K, nullptr, 2);
          linear_quant(ref.data(), N, x.data(), K, M, x8.data(), interleaved_type(t), N, K, nullptr, 2);
          CHECK(y == ref);
        }
      }
  });
  munmap(mem, 4 * page);
}

// VNNI's vpdpbusd sums the same integers as vpmaddubsw + vpmaddwd: every format, plain and
// interleaved, gives the same bits with and without it, on activations that are not exact in 8 bits.
TEST(vnni_gives_the_same_bits) {
  bool ran = false;
  const bool previous = pyengine::set_cpu_vnni(true);
  const bool previous_amx = pyengine::set_cpu_amx(false);  // M = 33 would take the AMX path
  at_every_level([&](const char* level) {
    pyengine::set_cpu_vnni(true);
    if (!pyengine::cpu_vnni()) return;  // this level has no VNNI, or this CPU lacks it
    ran = true;
    std::cout << "  level " << level << ": with and without VNNI\n";
    std::mt19937 rng(6);
    const int32_t N = 24, K = 1024;
    for (QuantType t : kTypes)
      for (bool x8 : {false, true}) {
        if (x8 && interleaved_type(t) == t) continue;  // (a format without an interleaved layout)
        const Quantized q = quantize(t, gaussian(rng, static_cast<size_t>(N) * K), N, K);
        const std::vector<uint8_t> w = x8 ? interleaved(t, q, N, K) : q.data;
        const QuantType lt = x8 ? interleaved_type(t) : t;
        for (int32_t M : {1, 2, 3, 4, 5, 8, 33}) {
          // activations of every magnitude, blocks at the extremes of the 8-bit range
          std::vector<float> x = gaussian(rng, static_cast<size_t>(M) * K);
          for (size_t i = 0; i < x.size(); i += 97) x[i] *= 1000.0f;
          std::vector<float> with(static_cast<size_t>(M) * N), without(with.size());
          pyengine::set_cpu_vnni(true);
          linear_quant(with.data(), N, x.data(), K, M, w.data(), lt, N, K, nullptr, 2);
          pyengine::set_cpu_vnni(false);
          linear_quant(without.data(), N, x.data(), K, M, w.data(), lt, N, K, nullptr, 2);
          CHECK(std::memcmp(with.data(), without.data(), sizeof(float) * with.size()) == 0);
        }
      }
  });
  pyengine::set_cpu_vnni(previous);
  pyengine::set_cpu_amx(previous_amx);
  if (!ran) std::cout << "  SKIPPED: this CPU has neither AVX-VNNI nor AVX512-VNNI\n";
}

// fp32 -> bf16 -> fp32, rounding to nearest even (finite values), as the AMX path rounds x and the
// dequantized weights.
float bf16_round(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  std::memcpy(&f, &u, 4);
  return f;
}

// The AMX path (M >= kQuantAmxMinRows, interleaved layouts, at avx512 on a CPU with AMX-BF16):
// against the fp64 product of x and the weights rounded to bf16 (the tile unit's products are
// exact in fp32; only its K additions and the bias's round), into a column range of a wider
// output (the columns around it untouched), with the x rows split over several passes (K = 3072),
// batch invariance among row counts that take the path, and no read past the last weight row.
TEST(amx_path_matches_the_bf16_reference) {
  const pyengine::CpuIsa previous_isa = pyengine::cpu_isa();
  const bool previous = pyengine::set_cpu_amx(true);
  bool avx512 = false;
  for (pyengine::CpuIsa l : pyengine::supported_cpu_isas()) avx512 = avx512 || l == pyengine::CpuIsa::kAvx512;
  if (avx512) pyengine::set_cpu_isa(pyengine::CpuIsa::kAvx512);
  if (!pyengine::cpu_amx()) {
    std::cout << "  SKIPPED: this CPU (or the OS) lacks AMX-BF16\n";
  } else {
    std::mt19937 rng(8);
    struct Shape {
      int32_t M, N, K;
    };
    for (QuantType t : kInterleavable)
      for (const Shape s : {Shape{16, 8, 256}, Shape{17, 24, 768}, Shape{33, 40, 512}, Shape{170, 64, 3072}}) {
        const Quantized q = quantize(t, gaussian(rng, static_cast<size_t>(s.N) * s.K), s.N, s.K);
        const std::vector<uint8_t> w = interleaved(t, q, s.N, s.K);
        std::vector<float> x = gaussian(rng, static_cast<size_t>(s.M) * s.K);
        for (size_t i = 0; i < x.size(); i += 101) x[i] *= 300.0f;
        const std::vector<float> bias = gaussian(rng, s.N);
        const int64_t ldy = s.N + 5;  // columns 2 .. N + 1 of a wider output
        std::vector<float> y(static_cast<size_t>(s.M) * ldy, -7.0f);
        linear_quant(y.data() + 2, ldy, x.data(), s.K, s.M, w.data(), interleaved_type(t), s.N, s.K, bias.data(), 2);
        const double u = std::ldexp(1.0, -24), gamma = (s.K + 2) * u / (1 - (s.K + 2) * u);
        for (int32_t m = 0; m < s.M; ++m) {
          for (int64_t c = 0; c < ldy; ++c)
            if (c < 2 || c >= s.N + 2) CHECK(y[m * ldy + c] == -7.0f);
          for (int32_t n = 0; n < s.N; ++n) {
            double exact = bias[n], terms = std::fabs(bias[n]);
            for (int32_t k = 0; k < s.K; ++k) {
              const double p = static_cast<double>(bf16_round(x[m * s.K + k])) * bf16_round(q.values[n * s.K + k]);
              exact += p;
              terms += std::fabs(p);
            }
            const double err = std::fabs(y[m * ldy + 2 + n] - exact);
            if (!(err <= gamma * terms))
              test::fail(__FILE__, __LINE__, std::string("amx ") + quant_format(interleaved_type(t)).name +
                                                 " M=" + std::to_string(s.M) + " N=" + std::to_string(s.N) +
                                                 ": error " + std::to_string(err) + " > bound " +
                                                 std::to_string(gamma * terms));
          }
        }
        // the first 16 rows alone: the same bits
        std::vector<float> y16(static_cast<size_t>(16) * s.N);
        linear_quant(y16.data(), s.N, x.data(), s.K, 16, w.data(), interleaved_type(t), s.N, s.K, bias.data(), 2);
        for (int32_t m = 0; m < 16; ++m)
          CHECK(std::memcmp(y16.data() + m * s.N, y.data() + m * ldy + 2, sizeof(float) * s.N) == 0);
      }
    // the weights end exactly at a PROT_NONE page
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    void* mem = mmap(nullptr, 4 * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    CHECK(mem != MAP_FAILED);
    CHECK_EQ(mprotect(static_cast<char*>(mem) + 3 * page, page, PROT_NONE), 0);
    for (QuantType t : kInterleavable) {
      const int32_t N = 8, K = 512, M = 20;
      const Quantized q = quantize(t, gaussian(rng, static_cast<size_t>(N) * K), N, K);
      const std::vector<uint8_t> x8 = interleaved(t, q, N, K);
      uint8_t* at = static_cast<uint8_t*>(mem) + 3 * page - x8.size();
      std::memcpy(at, x8.data(), x8.size());
      const std::vector<float> x = gaussian(rng, static_cast<size_t>(M) * K);
      std::vector<float> y(static_cast<size_t>(M) * N), ref(y.size());
      linear_quant(y.data(), N, x.data(), K, M, at, interleaved_type(t), N, K, nullptr, 2);
      linear_quant(ref.data(), N, x.data(), K, M, x8.data(), interleaved_type(t), N, K, nullptr, 2);
      CHECK(y == ref);
    }
    munmap(mem, 4 * page);
  }
  pyengine::set_cpu_isa(previous_isa);
  pyengine::set_cpu_amx(previous);
}

TEST(argument_errors_name_the_argument) {
  std::vector<float> x(512), y(8);
  std::vector<uint8_t> w(8 * 18 * 16);
  CHECK_THROWS((linear_quant(y.data(), 8, x.data(), 512, 1, w.data(), QuantType::kQ4_K, 8, 96, nullptr, 1)), std::invalid_argument,
               "K: q4_k rows must hold a positive multiple of 256 weights, got 96");
  CHECK_THROWS((linear_quant(y.data(), 8, x.data(), 512, 0, w.data(), QuantType::kQ4_0, 8, 512, nullptr, 1)), std::invalid_argument,
               "M: must be > 0, got 0");
  CHECK_THROWS((linear_quant(y.data(), 4, x.data(), 512, 1, w.data(), QuantType::kQ4_0, 8, 512, nullptr, 1)), std::invalid_argument,
               "ldy: must be >= N = 8, got 4");
  CHECK_THROWS(quant_format(static_cast<QuantType>(3)), std::invalid_argument,
               "type: unknown quantization type id 3 (known: 2 = q4_0, 6 = q5_0, 7 = q5_1, 8 = q8_0, 12 = q4_k, "
               "13 = q5_k, 14 = q6_k, 100 = q4_z; interleaved: 202 = q4_0x8, 206 = q5_0x8, 207 = q5_1x8, 208 = q8_0x8, "
               "212 = q4_kx8, 213 = q5_kx8, 214 = q6_kx8, 300 = q4_zx8)");
  CHECK_THROWS((linear_quant(y.data(), 8, x.data(), 512, 1, w.data(), QuantType::kQ4_0x8, 4, 512, nullptr, 1)),
               std::invalid_argument, "N: q4_0x8 holds groups of 8 rows, got 4");
  CHECK_THROWS((interleave_rows(QuantType::kQ4_0, w.data(), w.data(), 12, 32)), std::invalid_argument,
               "rows: must be a multiple of 8, got 12");
  const int64_t ids[] = {0, 9};
  CHECK_THROWS((dequantize_gather(QuantType::kQ4_0, w.data(), 8, 512, ids, 2, y.data())), std::invalid_argument,
               "ids[1]: 9 is out of range [0, 8)");
}

TEST_MAIN()
