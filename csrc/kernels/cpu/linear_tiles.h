// The tile loop shared by the hand-written linear kernels (linear_avx2.cpp, linear_avx512.cpp,
// linear_neon.cpp). Each includes this inside its level's anonymous namespace, after defining
//   kMaxMB                      x rows per tile,
//   rows_m1<W>(a, n0, n1)       the M == 1 loop,
//   tile<W, MB, R>(a, x, w, out) the dot products of MB x rows with R weight rows,
// so that the code below compiles for that level's target. No include guard: once per level.

constexpr int kR = 4;  // weight rows per tile

// tile<W, mb, R> for a run-time mb in [1, MB].
template <typename W, int R, int MB = kMaxMB>
inline void tile_upto(int32_t mb, const LinearArgs& a, const float* x, const W* w, float* out) {
  if constexpr (MB > 1) {
    if (mb < MB) return tile_upto<W, R, MB - 1>(mb, a, x, w, out);
  }
  tile<W, MB, R>(a, x, w, out);
}

// Weight rows [n, n + rows) (rows == R) against every x row, kMaxMB x rows at a time.
template <typename W, int R>
void run_tiles(const LinearArgs& a, int32_t n, int32_t rows) {
  const W* w = static_cast<const W*>(a.w) + static_cast<int64_t>(n) * a.K;
  float out[kMaxMB * R];
  for (int32_t m0 = 0; m0 < a.M; m0 += kMaxMB) {
    const int32_t mb = std::min(kMaxMB, a.M - m0);
    tile_upto<W, R>(mb, a, a.xf + m0 * a.kp, w, out);
    for (int32_t m = 0; m < mb; ++m)
      for (int32_t r = 0; r < rows; ++r) linear_store(a, m0 + m, n + r, out[m * rows + r]);
  }
}

// Weight rows [n0, n1), all rows of x.
template <typename W>
void rows(const LinearArgs& a, int32_t n0, int32_t n1) {
  if (a.M == 1) return rows_m1<W>(a, n0, n1);
  int32_t n = n0;
  for (; n + kR <= n1; n += kR) run_tiles<W, kR>(a, n, kR);
  for (; n < n1; ++n) run_tiles<W, 1>(a, n, 1);
}
