// The portable vector of the GEMM's compute code (gemm_impl.h): 4 fp32 lanes as a gcc/clang
// vector, which the compiler maps to the level's registers (SSE2 on baseline x86-64); no FMA
// (a multiply and an add, each rounded). Used by the generic level, and by the builds of other
// architectures' levels, which are never dispatched to.
#pragma once

struct Vec {
  static constexpr int L = 4;
  typedef float reg __attribute__((vector_size(16)));
  static inline reg zero() { return reg{0.0f, 0.0f, 0.0f, 0.0f}; }
  static inline reg load(const float* p) {
    reg v;
    std::memcpy(&v, p, sizeof(v));
    return v;
  }
  static inline void store(float* p, reg v) { std::memcpy(p, &v, sizeof(v)); }
  static inline reg bcast(float f) { return reg{f, f, f, f}; }
  static inline reg fma(reg a, reg b, reg c) { return a * b + c; }
};

constexpr int kMV = 2;
constexpr int kNB = 4;
constexpr bool kPackRows8 = false;
template <typename T>
static inline void pack_rows8(const T*, int64_t, float*, int32_t) {}
