// The GEMM's compute code, one source for every level: y[:, n0:n1] = x . W^T (+ bias) from x
// packed in panels (gemm_common.h). Included by gemm_<level>.cpp inside an anonymous namespace
// in its level's namespace (after PYENGINE_ISA_BEGIN_<LEVEL>), which this header closes before
// it defines the level's entry points, after defining
//   struct Vec     L lanes of fp32: zero(), load(p), store(p, v), bcast(f), fma(a, b, c) = a*b + c
//   kMV, kNB       the micro-kernel's shape: kMV vectors of rows (P = kMV * L rows of x) by kNB
//                  weight rows (output columns); kMV * kNB accumulators must fit the registers
//   pack_rows8     (x86 only, kPackRows8 = true) 8 rows x 8 columns of x, transposed into a panel
// No include guard: once per level.
//
// The micro-kernel keeps an accumulator per (vector of rows, weight row) and, for each k, loads
// the panel's kMV vectors (column k of P rows) and broadcasts each weight row's element k:
// kMV * kNB multiply-adds per kMV + kNB loads. Weight rows are read in place (fp32) or widened
// to fp32 kNB rows at a time (bf16), once per chunk of panels that fits in L2 with them.

constexpr int32_t kP = kMV * Vec::L;
// Panels computed against one widened set of weight rows: their packed x stays in L2.
constexpr int64_t kChunkBytes = 512 * 1024;
// The most panels of x for which the next weight rows are prefetched (columns()).
constexpr int32_t kPrefetchPanels = 8;

static inline float load_elem(const float* p, int64_t i) { return p[i]; }
static inline float load_elem(const uint16_t* p, int64_t i) { return bf16_to_f32(p[i]); }

// tile[r * kP + i] = sum_k xp[k * kP + i] * wr[r][k] for r < NB, i < MV * L. With `pf`
// (kNB row pointers, `esize` bytes an element), the next weight rows' lines are prefetched into
// L2 as the k loop goes: weight rows are short streams (a few KB) that the hardware prefetcher
// barely catches before they end, and a first pass over a group waits on DRAM without this
// (the 32-64 row GEMM of a 30-layer model ran 35-40% below its in-cache speed).
template <int MV, int NB>
static inline void micro(const float* __restrict xp, int32_t K, const float* const* wr, float* tile,
                         const char* const* pf, int32_t esize) {
  typename Vec::reg acc[NB][MV];
  for (int r = 0; r < NB; ++r)
    for (int v = 0; v < MV; ++v) acc[r][v] = Vec::zero();
  const float* w[NB];
  for (int r = 0; r < NB; ++r) w[r] = wr[r];
  constexpr int32_t kStep = 16;  // k per prefetched line of an fp32 row
  for (int32_t k0 = 0; k0 < K; k0 += kStep) {
    if (pf != nullptr)
      for (int r = 0; r < kNB; ++r)
        if (pf[r] != nullptr) __builtin_prefetch(pf[r] + static_cast<int64_t>(k0) * esize, 0, 2);
    const int32_t k1 = std::min(K, k0 + kStep);
    for (int32_t k = k0; k < k1; ++k) {
      typename Vec::reg xv[MV];
      for (int v = 0; v < MV; ++v) xv[v] = Vec::load(xp + static_cast<int64_t>(k) * kP + v * Vec::L);
      for (int r = 0; r < NB; ++r) {
        const typename Vec::reg b = Vec::bcast(w[r][k]);
        for (int v = 0; v < MV; ++v) acc[r][v] = Vec::fma(b, xv[v], acc[r][v]);
      }
    }
  }
  for (int r = 0; r < NB; ++r)
    for (int v = 0; v < MV; ++v) Vec::store(tile + r * kP + v * Vec::L, acc[r][v]);
}

// micro<mv, nb> for run-time mv in [1, kMV], nb in [1, kNB].
template <int MV = kMV, int NB = kNB>
static inline void micro_upto(int mv, int nb, const float* xp, int32_t K, const float* const* wr, float* tile,
                              const char* const* pf, int32_t esize) {
  if constexpr (NB > 1) {
    if (nb < NB) return micro_upto<MV, NB - 1>(mv, nb, xp, K, wr, tile, pf, esize);
  }
  if constexpr (MV > 1) {
    if (mv < MV) return micro_upto<MV - 1, NB>(mv, nb, xp, K, wr, tile, pf, esize);
  }
  micro<MV, NB>(xp, K, wr, tile, pf, esize);
}

template <typename T>
static void store_tile(const GemmArgs& a, const float* tile, int32_t m0, int32_t rows, int32_t n, int32_t nb) {
  const T* bias = static_cast<const T*>(a.bias);
  T* y = static_cast<T*>(a.y);
  for (int32_t i = 0; i < rows; ++i) {
    T* yrow = y + static_cast<int64_t>(m0 + i) * a.N + n;
    for (int32_t r = 0; r < nb; ++r) {
      float v = tile[r * kP + i];
      if (bias != nullptr) v += load_elem(bias, n + r);
      if constexpr (sizeof(T) == 2)
        yrow[r] = f32_to_bf16(v);
      else
        yrow[r] = v;
    }
  }
}

template <typename T>
static void columns(const GemmArgs& a, int32_t n0, int32_t n1, float* wide) {
  const int32_t K = a.K;
  const int32_t panels = (a.M + kP - 1) / kP;
  const int64_t panel_floats = static_cast<int64_t>(K) * kP;
  const int32_t chunk = static_cast<int32_t>(
      std::max<int64_t>(1, kChunkBytes / (panel_floats * static_cast<int64_t>(sizeof(float)))));
  alignas(64) float tile[kNB * kP];
  const float* wr[kNB];
  const char* next[kNB];  // the next group's weight rows, prefetched during the first panel
  // Prefetch where the hardware does not: rows within a page (the hardware prefetcher stops
  // at page boundaries, and a shorter stream ends before it ramps up), for x of at most
  // kPrefetchPanels panels (more amortize the first pass over the weights). Measured from
  // DRAM on an Intel Xeon: 2.3 KB rows (K = 576, fp32) at 17-64 rows 25-40% faster; 6 KB rows
  // and larger batches moved within the run-to-run spread, so they are left to the hardware.
  const bool prefetch =
      static_cast<int64_t>(K) * static_cast<int64_t>(sizeof(T)) <= 4096 && panels <= kPrefetchPanels;
  for (int32_t p0 = 0; p0 < panels; p0 += chunk) {
    const int32_t p1 = std::min(panels, p0 + chunk);
    for (int32_t n = n0; n < n1; n += kNB) {
      const int32_t nb = std::min(kNB, n1 - n);
      for (int32_t r = 0; prefetch && r < kNB; ++r) {
        const int32_t nr = n + kNB + r;
        next[r] = nr < n1 ? reinterpret_cast<const char*>(static_cast<const T*>(a.w) + static_cast<int64_t>(nr) * K)
                          : nullptr;
      }
      for (int32_t r = 0; r < nb; ++r) {
        const T* row = static_cast<const T*>(a.w) + static_cast<int64_t>(n + r) * K;
        if constexpr (sizeof(T) == 2) {
          float* dst = wide + static_cast<int64_t>(r) * K;
          for (int32_t k = 0; k < K; ++k) dst[k] = bf16_to_f32(row[k]);
          wr[r] = dst;
        } else {
          wr[r] = row;
        }
      }
      for (int32_t p = p0; p < p1; ++p) {
        const int32_t rows = std::min(kP, a.M - p * kP);
        const int mv = (rows + Vec::L - 1) / Vec::L;
        micro_upto(mv, nb, a.xp + p * panel_floats, K, wr, tile, prefetch && p == p0 ? next : nullptr,
                   static_cast<int32_t>(sizeof(T)));
        store_tile<T>(a, tile, p * kP, rows, n, nb);
      }
    }
  }
}

// Panel p of xp: xp[k * kP + i] = x[p * kP + i, k], rows past M zero.
template <typename T>
static void pack(const GemmArgs& a, int32_t p) {
  const int32_t K = a.K;
  const int32_t m0 = p * kP;
  const int32_t rows = std::min(kP, a.M - m0);
  const T* x = static_cast<const T*>(a.x) + static_cast<int64_t>(m0) * K;
  float* dst = a.xp + static_cast<int64_t>(p) * K * kP;
  int32_t i = 0;
  int32_t k8 = 0;
  if constexpr (kPackRows8) {
    k8 = K / 8 * 8;
    for (; i + 8 <= rows; i += 8)
      for (int32_t k = 0; k < k8; k += 8) pack_rows8(x + static_cast<int64_t>(i) * K + k, K, dst + k * kP + i, kP);
    for (int32_t r = 0; r < i; ++r)  // the columns past the last multiple of 8
      for (int32_t k = k8; k < K; ++k) dst[k * kP + r] = load_elem(x, static_cast<int64_t>(r) * K + k);
  }
  for (int32_t k = 0; k < K; ++k) {
    float* col = dst + static_cast<int64_t>(k) * kP;
    for (int32_t r = i; r < rows; ++r) col[r] = load_elem(x, static_cast<int64_t>(r) * K + k);
    for (int32_t r = rows; r < kP; ++r) col[r] = 0.0f;
  }
}

}  // namespace

int32_t gemm_panel_rows() { return kP; }

int32_t gemm_column_grain() { return kNB; }

void gemm_pack(const GemmArgs& a, int32_t p) {
  if (a.bf16)
    pack<uint16_t>(a, p);
  else
    pack<float>(a, p);
}

void gemm_columns(const GemmArgs& a, int32_t n0, int32_t n1, float* wide) {
  if (a.bf16)
    columns<uint16_t>(a, n0, n1, wide);
  else
    columns<float>(a, n0, n1, wide);
}
