// Prefill attention, FlashAttention-2 style, on tensor cores (CuTe, SM80 mma; runs on sm_90a).
//
// Tiling. Grid (sequence, M block, KV head); 128 threads = 4 warps. The M dimension packs the
// GQA group: tile row r of M block b is the query row (token j = (64 b + r) / G, head
// g = (64 b + r) % G) of KV head kvh, so one CTA reads each K/V tile once for all G heads and a
// decode row (q_len 1) is a tile with G live rows. Q tile 64 x head_dim, K / V tiles
// 64 tokens x head_dim, all in swizzled shared memory (Q + K + V = 48 KiB at head_dim 128).
// K / V rows are gathered through the block table with 16-byte cp.async (an fp8 cache is
// loaded through registers and converted to bf16 / fp16 exactly; its scales are folded into
// the softmax scale and the output). Loop over the KV tiles the rows can see (causal,
// sliding window): V(n) loads while S = Q K(n)^T runs, K(n+1) loads while O += P V(n) runs.
//   S = Q K^T:  TiledMMA of SM80_16x8x16 (F32 accumulate), warp w owns rows 16w..16w+15;
//               operands from shared memory with ldmatrix;
//   softmax:    online, in registers, row max / sum reduced over the 4 lanes sharing a row;
//   O += P V:   P converted to bf16 / fp16 in registers as the A operand, V^T via ldmatrix.trans.
// Out-of-range K / V rows are zero-filled and masked, so uninitialized cache slots never reach
// the math.
#include "attention.h"
#include "common.cuh"
#include "prefill_traits.cuh"

namespace pyengine::kernels::cuda::detail {
namespace {

using namespace cute;
using namespace prefill;

// acc += A B^T with both operands in shared memory, k-slices loaded one ahead.
template <class Acc, class RA, class RB, class SA, class SB, class Mma, class CA, class CB,
          class TA, class TB>
__device__ __forceinline__ void gemm_ss(Acc& acc, RA& rA, RB& rB, SA const& sA, SB const& sB,
                                        Mma& mma, CA const& cpA, CB const& cpB, TA const& thrA,
                                        TB const& thrB) {
  auto rA_v = thrA.retile_D(rA);
  auto rB_v = thrB.retile_D(rB);
  copy(cpA, sA(_, _, _0{}), rA_v(_, _, _0{}));
  copy(cpB, sB(_, _, _0{}), rB_v(_, _, _0{}));
  CUTE_UNROLL
  for (int k = 0; k < size<2>(rA); ++k) {
    if (k < size<2>(rA) - 1) {
      copy(cpA, sA(_, _, k + 1), rA_v(_, _, k + 1));
      copy(cpB, sB(_, _, k + 1), rB_v(_, _, k + 1));
    }
    cute::gemm(mma, rA(_, _, k), rB(_, _, k), acc);
  }
}

// acc += A B^T with A in registers and B in shared memory.
template <class Acc, class RA, class RB, class SB, class Mma, class CB, class TB>
__device__ __forceinline__ void gemm_rs(Acc& acc, RA const& rA, RB& rB, SB const& sB, Mma& mma,
                                        CB const& cpB, TB const& thrB) {
  auto rB_v = thrB.retile_D(rB);
  copy(cpB, sB(_, _, _0{}), rB_v(_, _, _0{}));
  CUTE_UNROLL
  for (int k = 0; k < size<2>(rA); ++k) {
    if (k < size<2>(rA) - 1) copy(cpB, sB(_, _, k + 1), rB_v(_, _, k + 1));
    cute::gemm(mma, rA(_, _, k), rB(_, _, k), acc);
  }
}

// Gathers K or V rows n0 .. n0 + kBlockN - 1 of KV head kvh into the shared tile `s`; rows
// outside [n_lo, n_hi) are zero-filled.
template <class Elem, class CT, int HD, class STensor>
__device__ __forceinline__ void load_kv_tile(STensor& s, const CT* cache, const int32_t* bt,
                                             int n0, int n_lo, int n_hi, int kvh,
                                             const AttnArgs& a) {
  constexpr int kChunks = HD / 8;  // 8 elements (16 bytes of Elem) per chunk
  constexpr int kIters = kBlockN * kChunks / kThreads;
  static_assert(kBlockN * kChunks % kThreads == 0, "tile copy must split evenly");
#pragma unroll
  for (int i = 0; i < kIters; ++i) {
    const int idx = threadIdx.x + i * kThreads;
    const int r = idx / kChunks;
    const int c = idx % kChunks;
    const int p = n0 + r;
    const bool valid = p >= n_lo && p < n_hi;
    int64_t off = 0;
    if (valid) off = kv_offset(bt, p, kvh, a.num_kv_heads, a.tpb_shift, HD) + c * 8;
    Elem* dst = &s(r, c * 8);
    if constexpr (std::is_same_v<CT, Elem>) {
      cp_async16(dst, cache + off, valid);
    } else {
      // fp8 e4m3 -> bf16 / fp16 is exact; the scale is applied by the caller
      uint2 raw = make_uint2(0u, 0u);
      if (valid) raw = *reinterpret_cast<const uint2*>(cache + off);
      const CT* e = reinterpret_cast<const CT*>(&raw);
      alignas(16) Elem conv[8];
#pragma unroll
      for (int k = 0; k < 8; ++k) conv[k] = static_cast<Elem>(static_cast<float>(e[k]));
      *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(conv);
    }
  }
}

template <class Elem, class CT, int HD, bool kSoftcap>
__global__ void __launch_bounds__(kThreads) prefill_kernel(const AttnArgs a) {
  using Tr = PrefillTraits<Elem, HD>;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  Elem* sQp = reinterpret_cast<Elem*>(smem_raw);
  Elem* sKp = sQp + kBlockM * HD;
  Elem* sVp = sKp + kBlockN * HD;
  Tensor sQ = make_tensor(make_smem_ptr(sQp), typename Tr::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(sKp), typename Tr::SmemLayoutKV{});
  Tensor sV = make_tensor(make_smem_ptr(sVp), typename Tr::SmemLayoutKV{});
  Tensor sVt = make_tensor(make_smem_ptr(sVp), typename Tr::SmemLayoutVt{});

  const int tid = threadIdx.x;
  const int seq = blockIdx.x;
  const int m_block = blockIdx.y;
  const int kvh = blockIdx.z;
  const int G = a.group;
  const int q_start = a.qsl[seq];
  const int q_len = a.qsl[seq + 1] - q_start;
  const int rows = q_len * G;
  const int row0 = m_block * kBlockM;
  if (row0 >= rows) return;
  const int len = a.seq_lens[seq];
  const int base = len - q_len;  // position of query row 0
  const int last = min(rows, row0 + kBlockM) - 1;
  const int pos_min = base + row0 / G;
  const int pos_max = base + last / G;
  const int n_hi = min(pos_max + 1, len);
  const int n_lo = a.sliding_window > 0 ? max(0, pos_min - a.sliding_window + 1) : 0;
  const int32_t* bt = a.block_tables + static_cast<int64_t>(seq) * a.max_blocks_per_seq;
  const CT* kc = static_cast<const CT*>(a.k_cache);
  const CT* vc = static_cast<const CT*>(a.v_cache);

  // ---- Q tile (rows past the sequence's are zero) ----
  {
    constexpr int kChunks = HD / 8;
    const Elem* q = static_cast<const Elem*>(a.q);
#pragma unroll
    for (int i = 0; i < kBlockM * kChunks / kThreads; ++i) {
      const int idx = tid + i * kThreads;
      const int r = idx / kChunks;
      const int c = idx % kChunks;
      const int gr = row0 + r;
      const bool valid = gr < rows;
      const Elem* src = q;
      if (valid)
        src = q + static_cast<int64_t>(q_start + gr / G) * a.q_stride +
              static_cast<int64_t>(kvh * G + gr % G) * HD + c * 8;
      cp_async16(&sQ(r, c * 8), src, valid);
    }
  }

  typename Tr::TiledMma mma;
  auto thr_mma = mma.get_thread_slice(tid);
  Tensor tSrQ = thr_mma.partition_fragment_A(sQ);   // (MMA, MMA_M, MMA_K)
  Tensor tSrK = thr_mma.partition_fragment_B(sK);   // (MMA, MMA_N, MMA_K)
  Tensor tOrVt = thr_mma.partition_fragment_B(sVt);  // (MMA, MMA_K=HD, MMA_N)
  Tensor acc_o = partition_fragment_C(mma, Shape<Int<kBlockM>, Int<HD>>{});
  clear(acc_o);

  auto cp_q = make_tiled_copy_A(typename Tr::SmemCopyAtom{}, mma);
  auto thr_cp_q = cp_q.get_thread_slice(tid);
  Tensor tSsQ = thr_cp_q.partition_S(sQ);
  auto cp_k = make_tiled_copy_B(typename Tr::SmemCopyAtom{}, mma);
  auto thr_cp_k = cp_k.get_thread_slice(tid);
  Tensor tSsK = thr_cp_k.partition_S(sK);
  auto cp_v = make_tiled_copy_B(typename Tr::SmemCopyAtomT{}, mma);
  auto thr_cp_v = cp_v.get_thread_slice(tid);
  Tensor tOsVt = thr_cp_v.partition_S(sVt);

  // Coordinates (row, col) of this thread's accumulator elements.
  Tensor cS = make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{});
  Tensor tScS = thr_mma.partition_C(cS);
  Tensor tScS_rc = make_tensor(tScS.data(), rowcol(tScS.layout()));
  constexpr int kRows = decltype(size<0>(tScS_rc))::value;  // rows per thread (2)
  constexpr int kCols = decltype(size<1>(tScS_rc))::value;

  // The positions each of this thread's rows sees: [row_lo, row_pos].
  int row_pos[kRows], row_lo[kRows];
  float row_m[kRows], row_l[kRows];
#pragma unroll
  for (int mi = 0; mi < kRows; ++mi) {
    const int gr = row0 + get<0>(tScS_rc(mi, 0));
    row_pos[mi] = base + gr / G;
    row_lo[mi] = a.sliding_window > 0 ? row_pos[mi] - a.sliding_window + 1 : INT_MIN;
    row_m[mi] = -INFINITY;
    row_l[mi] = 0.f;
  }

  if (n_lo < n_hi) {
    const int nb_first = n_lo / kBlockN;
    const int nb_last = (n_hi - 1) / kBlockN;
    load_kv_tile<Elem, CT, HD>(sK, kc, bt, nb_first * kBlockN, n_lo, n_hi, kvh, a);
    cp_async_commit();

    for (int nb = nb_first; nb <= nb_last; ++nb) {
      const int n0 = nb * kBlockN;
      cp_async_wait<0>();
      __syncthreads();  // K(nb) (and Q) landed; every thread is done with V(nb - 1)
      load_kv_tile<Elem, CT, HD>(sV, vc, bt, n0, n_lo, n_hi, kvh, a);
      cp_async_commit();

      Tensor acc_s = partition_fragment_C(mma, Shape<Int<kBlockM>, Int<kBlockN>>{});
      clear(acc_s);
      gemm_ss(acc_s, tSrQ, tSrK, tSsQ, tSsK, mma, cp_q, cp_k, thr_cp_q, thr_cp_k);

      // ---- mask, online softmax (exp2 domain) ----
      Tensor s = make_tensor(acc_s.data(), rowcol(acc_s.layout()));
#pragma unroll
      for (int mi = 0; mi < kRows; ++mi) {
        float mx = -INFINITY;
#pragma unroll
        for (int ni = 0; ni < kCols; ++ni) {
          const int kp = n0 + get<1>(tScS_rc(mi, ni));
          const bool ok = kp <= row_pos[mi] && kp >= row_lo[mi] && kp < n_hi && kp >= n_lo;
          const float x = ok ? score_log2<kSoftcap>(s(mi, ni), a) : -INFINITY;
          s(mi, ni) = x;
          mx = fmaxf(mx, x);
        }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_new = fmaxf(row_m[mi], mx);
        const float m_ref = m_new == -INFINITY ? 0.f : m_new;
        const float alpha = exp2f(row_m[mi] - m_ref);
        row_m[mi] = m_new;
        float sum = 0.f;
#pragma unroll
        for (int ni = 0; ni < kCols; ++ni) {
          const float pr = exp2f(s(mi, ni) - m_ref);
          s(mi, ni) = pr;
          sum += pr;
        }
        row_l[mi] = row_l[mi] * alpha + sum;  // this thread's share; reduced at the end
        Tensor o = make_tensor(acc_o.data(), rowcol(acc_o.layout()));
#pragma unroll
        for (int ni = 0; ni < size<1>(o); ++ni) o(mi, ni) *= alpha;
      }

      // P as the A operand of the second GEMM
      Tensor rP = make_tensor<Elem>(acc_s.layout());
#pragma unroll
      for (int i = 0; i < size(rP); ++i) rP(i) = static_cast<Elem>(acc_s(i));
      Tensor tOrP = make_tensor(rP.data(), acc_as_a(rP.layout()));

      cp_async_wait<0>();
      __syncthreads();  // V(nb) landed; every thread is done with K(nb)
      if (nb < nb_last) {
        load_kv_tile<Elem, CT, HD>(sK, kc, bt, n0 + kBlockN, n_lo, n_hi, kvh, a);
        cp_async_commit();
      }
      gemm_rs(acc_o, tOrP, tOrVt, tOsVt, mma, cp_v, thr_cp_v);
    }
  }
  cp_async_wait<0>();

  // ---- epilogue: normalize, write the live rows ----
  Tensor o = make_tensor(acc_o.data(), rowcol(acc_o.layout()));
  Tensor cO = make_identity_tensor(Shape<Int<kBlockM>, Int<HD>>{});
  Tensor tOcO = thr_mma.partition_C(cO);
  Tensor tOcO_rc = make_tensor(tOcO.data(), rowcol(tOcO.layout()));
  Elem* out = static_cast<Elem*>(a.out);
#pragma unroll
  for (int mi = 0; mi < kRows; ++mi) {
    float l = row_l[mi];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const float inv = l > 0.f ? a.v_scale / l : 0.f;
    const int gr = row0 + get<0>(tOcO_rc(mi, 0));
    if (gr >= rows) continue;
    Elem* orow = out + static_cast<int64_t>(q_start + gr / G) * a.out_stride +
                 static_cast<int64_t>(kvh * G + gr % G) * HD;
#pragma unroll
    for (int ni = 0; ni < size<1>(o); ++ni)
      orow[get<1>(tOcO_rc(mi, ni))] = static_cast<Elem>(o(mi, ni) * inv);
  }
}

template <class Elem, class CT, int HD>
void launch(const AttnArgs& a, int32_t max_query_len, cudaStream_t stream) {
  using Tr = PrefillTraits<Elem, HD>;
  const int64_t m_blocks = prefill_m_blocks(max_query_len, a.group);
  // the soft-cap is a template flag: the uncapped kernel stays as it was
  auto kernel = a.softcap > 0.f ? prefill_kernel<Elem, CT, HD, true> : prefill_kernel<Elem, CT, HD, false>;
  allow_smem(kernel, Tr::kSmemBytes);
  const dim3 grid(a.num_seqs, static_cast<unsigned>(m_blocks), a.num_kv_heads);
  kernel<<<grid, kThreads, Tr::kSmemBytes, stream>>>(a);
  check_launch("prefill_attention");
}

template <class Elem, class CT>
void launch_hd(const AttnArgs& a, int32_t max_query_len, int head_dim, cudaStream_t stream) {
  switch (head_dim) {
    case 64:
      return launch<Elem, CT, 64>(a, max_query_len, stream);
    case 128:
      return launch<Elem, CT, 128>(a, max_query_len, stream);
    default:
      fail("head_dim: " + std::to_string(head_dim) +
           " is not supported by the tensor-core prefill kernel (64 or 128)");
  }
}

}  // namespace

void launch_prefill(const AttnArgs& a, int32_t max_query_len, DType q_dtype, DType cache_dtype,
                    int head_dim, cudaStream_t stream) {
  const bool is_fp8 = cache_dtype == DType::kFloat8E4M3;
  switch (q_dtype) {
    case DType::kBFloat16:
      return is_fp8 ? launch_hd<bf16, fp8>(a, max_query_len, head_dim, stream)
                 : launch_hd<bf16, bf16>(a, max_query_len, head_dim, stream);
    case DType::kFloat16:
      return is_fp8 ? launch_hd<fp16, fp8>(a, max_query_len, head_dim, stream)
                 : launch_hd<fp16, fp16>(a, max_query_len, head_dim, stream);
    default:
      fail("q_dtype: the tensor-core prefill kernel takes bfloat16 or float16");
  }
}

}  // namespace pyengine::kernels::cuda::detail
