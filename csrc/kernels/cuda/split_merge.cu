// Flash-decoding merge: combines the per-split partial rows of decode_attention.cu.
//
// Tiling. Grid (query row, query head); 128 threads, each owning columns tid, tid + 128 of the
// row. Split s wrote o_s (already normalized by its own sum l_s and scaled by v_scale) and
// (m_s, l_s) with m_s in the exp2 domain; the result is
//   sum_s w_s o_s / sum_s w_s,   w_s = l_s * 2^(m_s - max_s m_s),
// skipping empty splits (l_s == 0, whose o_s was never written).
#include "attention.h"
#include "common.cuh"

namespace pyengine::kernels::cuda::detail {
namespace {

constexpr int kThreads = 128;

template <class QT>
__global__ void __launch_bounds__(kThreads) merge_kernel(const AttnArgs a, int head_dim) {
  const int row = blockIdx.x;
  const int head = blockIdx.y;
  int seq, j;
  if (!find_row(a.qsl, a.num_seqs, row, seq, j)) return;
  const int ns = a.num_splits;
  const int64_t base = (static_cast<int64_t>(row) * a.num_heads + head) * ns;
  const float* ml = a.ws_ml + base * 2;

  float m_max = -INFINITY;
  for (int s = 0; s < ns; ++s)
    if (ml[2 * s + 1] > 0.f) m_max = fmaxf(m_max, ml[2 * s]);
  float wsum = 0.f;
  for (int s = 0; s < ns; ++s) {
    const float l = ml[2 * s + 1];
    if (l > 0.f) wsum += l * exp2f(ml[2 * s] - m_max);
  }
  const float inv = wsum > 0.f ? 1.f / wsum : 0.f;
  QT* out = static_cast<QT*>(a.out) + static_cast<int64_t>(row) * a.out_stride +
            static_cast<int64_t>(head) * head_dim;
  for (int c = threadIdx.x; c < head_dim; c += kThreads) {
    float acc = 0.f;
    for (int s = 0; s < ns; ++s) {
      const float l = ml[2 * s + 1];
      if (l > 0.f) acc += l * exp2f(ml[2 * s] - m_max) * a.ws_o[(base + s) * head_dim + c];
    }
    out[c] = static_cast<QT>(acc * inv);
  }
}

}  // namespace

void launch_merge(const AttnArgs& a, DType q_dtype, int head_dim, cudaStream_t stream) {
  const dim3 grid(a.num_tokens, a.num_heads);
  switch (q_dtype) {
    case DType::kFloat32:
      merge_kernel<float><<<grid, kThreads, 0, stream>>>(a, head_dim);
      break;
    case DType::kBFloat16:
      merge_kernel<bf16><<<grid, kThreads, 0, stream>>>(a, head_dim);
      break;
    case DType::kFloat16:
      merge_kernel<fp16><<<grid, kThreads, 0, stream>>>(a, head_dim);
      break;
    default:
      fail("q_dtype: unsupported");
  }
  check_launch("split_merge");
}

}  // namespace pyengine::kernels::cuda::detail
