// Flash-decoding: SIMT paged attention of single query rows, split over the context.
//
// Tiling. Grid (query row, KV head x head chunk, split); 128 threads (4 warps). A CTA takes up
// to kDecodeMaxGroup query heads that share one KV head (the GQA group), so each KV tile is
// read from HBM once for all of them. Its split covers context tokens
// [split * split_len, (split + 1) * split_len) (the last split runs to the end) intersected
// with the row's causal / sliding-window range. The split is walked in tiles of kTile tokens
// (kTile * head_dim * sizeof(cache) <= 16 KiB, at most 128 tokens); K and V tiles are gathered
// through the block table with 16-byte cp.async into a two-stage shared-memory ring (tile i+1
// loads while tile i computes; out-of-range tokens are zero-filled). Per tile:
//   scores:  kLanes lanes share one token (each holds 16-byte chunks of its K row in fp32),
//            dot with every query head (q in shared memory, fp32), shuffle-reduce -> S[g][t];
//   softmax: warp w updates heads w, w+4, ... (running max / sum in the exp2 domain);
//   PV:      a thread owns 8 output columns of one head (of kHeadsPerThread heads when the
//            group is larger than 128 / (head_dim / 8)); with a small group the spare threads
//            split the tile's tokens (P partitions, summed through shared memory at the end),
//            acc += P[g][t] * V[t].
// Output: with one split, normalized rows straight into `out`; otherwise each split writes its
// normalized partial row and (max, sum) to the workspace for split_merge.cu.
#include "attention.h"
#include "common.cuh"

namespace pyengine::kernels::cuda::detail {
namespace {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kG = kDecodeMaxGroup;

template <class CT, int HD>
struct DecodeTraits {
  static constexpr int kElem = sizeof(CT);
  static constexpr int kVec = 16 / kElem;                 // elements per 16-byte chunk
  static constexpr int kChunks = HD / kVec;               // chunks per K/V row
  static constexpr int kTileRaw = 16384 / (HD * kElem);
  static constexpr int kTile = kTileRaw > 128 ? 128 : kTileRaw;  // tokens per smem tile
  static constexpr int kLanes = kChunks < 32 ? kChunks : 32;     // lanes per token (scores)
  static constexpr int kChunksPerLane = kChunks / kLanes;
  static constexpr int kTokPerWarp = 32 / kLanes;
  static constexpr int kCols = 8;                         // output columns per thread (PV)
  static constexpr int kColThreads = HD / kCols;
  static constexpr int kHeadSlots = kThreads / kColThreads;
  static constexpr int kHeadsPerThread = (kG + kHeadSlots - 1) / kHeadSlots;
  static constexpr int kLoads = kTile * kChunks / kThreads;  // 16-byte copies per thread per tile
  static_assert(kTile % (kWarps * kTokPerWarp) == 0, "score loop must be warp-uniform");
  static_assert((kTile * kChunks) % kThreads == 0, "tile copy must split evenly");
  static_assert(kThreads % kColThreads == 0, "PV thread layout");

  struct Smem {
    CT k[2][kTile * HD];
    CT v[2][kTile * HD];
    float q[kG][HD];
    float s[kG][kTile];
    float m[kG];
    float l[kG];
    float alpha[kG];
  };
};

template <class QT, class CT, int HD, bool kSoftcap>
__global__ void __launch_bounds__(kThreads) decode_kernel(const AttnArgs a) {
  using Tr = DecodeTraits<CT, HD>;
  using Smem = typename Tr::Smem;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Smem& sm = *reinterpret_cast<Smem*>(smem_raw);

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int row = blockIdx.x;
  const int kvh = blockIdx.y / a.head_chunks;
  const int g0 = (blockIdx.y % a.head_chunks) * kG;
  const int gc = min(kG, a.group - g0);
  const int split = blockIdx.z;
  const int head0 = kvh * a.group + g0;  // first query head of this CTA

  int seq, j;
  if (!find_row(a.qsl, a.num_seqs, row, seq, j)) return;
  const int len = a.seq_lens[seq];
  const int q_len = a.qsl[seq + 1] - a.qsl[seq];
  const int pos = len - q_len + j;  // this row's position; it sees [lo_row, pos]
  const int lo_row = a.sliding_window > 0 ? max(0, pos - a.sliding_window + 1) : 0;
  const int s_begin = split * a.split_len;
  const int s_end = split == a.num_splits - 1 ? INT_MAX : s_begin + a.split_len;
  const int lo = max(lo_row, s_begin);
  const int hi = min(pos + 1, s_end);

  // q rows of this CTA's heads, fp32, in shared memory
  const QT* q = static_cast<const QT*>(a.q) + static_cast<int64_t>(row) * a.q_stride +
                static_cast<int64_t>(head0) * HD;
  for (int i = tid; i < gc * HD; i += kThreads) sm.q[i / HD][i % HD] = to_float(q[i]);
  if (tid < kG) {
    sm.m[tid] = -INFINITY;
    sm.l[tid] = 0.f;
  }

  // PV ownership: a thread owns 8 columns (ct) of one head slot. With fewer heads than slots
  // (a small GQA group), the idle slots take token partitions instead: slot = tp * gc + g, and
  // partition tp sums tokens tp, tp + P, ... of every tile (reduced across tp at the end).
  // Otherwise (P = 1) it owns heads slot, slot + kHeadSlots, ...
  const int ct = tid % Tr::kColThreads;
  const int slot = tid / Tr::kColThreads;
  const int P = gc >= Tr::kHeadSlots ? 1 : Tr::kHeadSlots / gc;  // token partitions
  const int tp = P > 1 ? slot / gc : 0;
  const int gbase = P > 1 ? slot % gc : slot;
  const bool pv_active = tp < P;
  float acc[Tr::kHeadsPerThread][Tr::kCols];
#pragma unroll
  for (int h = 0; h < Tr::kHeadsPerThread; ++h)
#pragma unroll
    for (int c = 0; c < Tr::kCols; ++c) acc[h][c] = 0.f;

  if (lo < hi) {
    const CT* kc = static_cast<const CT*>(a.k_cache);
    const CT* vc = static_cast<const CT*>(a.v_cache);
    const int32_t* bt = a.block_tables + static_cast<int64_t>(seq) * a.max_blocks_per_seq;
    const int tile_first = lo / Tr::kTile;
    const int tile_last = (hi - 1) / Tr::kTile;

    auto load_tile = [&](int tile, int stage) {
#pragma unroll
      for (int i = 0; i < Tr::kLoads; ++i) {
        const int idx = tid + i * kThreads;
        const int t = idx / Tr::kChunks;
        const int c = idx % Tr::kChunks;
        const int p = tile * Tr::kTile + t;
        const bool valid = p >= lo && p < hi;
        int64_t off = 0;
        if (valid) off = kv_offset(bt, p, kvh, a.num_kv_heads, a.tpb_shift, HD) + c * Tr::kVec;
        cp_async16(&sm.k[stage][t * HD + c * Tr::kVec], kc + off, valid);
        cp_async16(&sm.v[stage][t * HD + c * Tr::kVec], vc + off, valid);
      }
      cp_async_commit();
    };

    load_tile(tile_first, 0);
    for (int tile = tile_first; tile <= tile_last; ++tile) {
      const int stage = (tile - tile_first) & 1;
      if (tile < tile_last) {
        load_tile(tile + 1, stage ^ 1);
        cp_async_wait<1>();
      } else {
        cp_async_wait<0>();
      }
      __syncthreads();

      // ---- scores S[g][t] = q_g . k_t (exp2 domain), -inf outside [lo, hi) ----
      {
        const int li = lane % Tr::kLanes;
        const int tsub = lane / Tr::kLanes;
        for (int t0 = warp * Tr::kTokPerWarp; t0 < Tr::kTile; t0 += kWarps * Tr::kTokPerWarp) {
          const int t = t0 + tsub;
          float kf[Tr::kChunksPerLane * Tr::kVec];
#pragma unroll
          for (int ci = 0; ci < Tr::kChunksPerLane; ++ci)
            load_float<CT, Tr::kVec>(&sm.k[stage][t * HD + (li + ci * Tr::kLanes) * Tr::kVec],
                                     kf + ci * Tr::kVec);
          const int p = tile * Tr::kTile + t;
          const bool valid = p >= lo && p < hi;
#pragma unroll
          for (int g = 0; g < kG; ++g) {
            if (g < gc) {  // uniform over the CTA
              float d = 0.f;
#pragma unroll
              for (int ci = 0; ci < Tr::kChunksPerLane; ++ci) {
                const float* qg = &sm.q[g][(li + ci * Tr::kLanes) * Tr::kVec];
#pragma unroll
                for (int e = 0; e < Tr::kVec; ++e) d = fmaf(kf[ci * Tr::kVec + e], qg[e], d);
              }
#pragma unroll
              for (int o = Tr::kLanes / 2; o > 0; o >>= 1)
                d += __shfl_xor_sync(0xffffffffu, d, o);
              if (li == 0) sm.s[g][t] = valid ? score_log2<kSoftcap>(d, a) : -INFINITY;
            }
          }
        }
      }
      __syncthreads();

      // ---- online softmax per head ----
      for (int g = warp; g < gc; g += kWarps) {
        float mx = -INFINITY;
        for (int t = lane; t < Tr::kTile; t += 32) mx = fmaxf(mx, sm.s[g][t]);
        mx = warp_max(mx);
        const float m_old = sm.m[g];
        const float m_new = fmaxf(m_old, mx);
        const float m_ref = m_new == -INFINITY ? 0.f : m_new;
        float sum = 0.f;
        for (int t = lane; t < Tr::kTile; t += 32) {
          const float pr = exp2f(sm.s[g][t] - m_ref);
          sm.s[g][t] = pr;
          sum += pr;
        }
        sum = warp_sum(sum);
        if (lane == 0) {
          const float alpha = exp2f(m_old - m_ref);
          sm.alpha[g] = alpha;
          sm.l[g] = sm.l[g] * alpha + sum;
          sm.m[g] = m_new;
        }
      }
      __syncthreads();

      // ---- acc = acc * alpha + P V ----
#pragma unroll
      for (int h = 0; h < Tr::kHeadsPerThread; ++h) {
        const int g = gbase + h * Tr::kHeadSlots;
        if (g < gc) {
          const float al = sm.alpha[g];
#pragma unroll
          for (int c = 0; c < Tr::kCols; ++c) acc[h][c] *= al;
        }
      }
#pragma unroll 4
      for (int t = pv_active ? tp : Tr::kTile; t < Tr::kTile; t += P) {
        float vf[Tr::kCols];
        load_float<CT, Tr::kCols>(&sm.v[stage][t * HD + ct * Tr::kCols], vf);
#pragma unroll
        for (int h = 0; h < Tr::kHeadsPerThread; ++h) {
          const int g = gbase + h * Tr::kHeadSlots;
          if (g < gc) {
            const float pr = sm.s[g][t];
#pragma unroll
            for (int c = 0; c < Tr::kCols; ++c) acc[h][c] = fmaf(pr, vf[c], acc[h][c]);
          }
        }
      }
      __syncthreads();  // the stage is reloaded by the next iteration's prefetch
    }
  }
  __syncthreads();  // m / l visible even when this split had nothing to do

  // ---- reduce the token partitions (the K tile buffer is free now) ----
  if (P > 1) {  // uniform over the CTA; then kHeadsPerThread's h = 0 is the only live head
    float* red = reinterpret_cast<float*>(&sm.k[0][0]);  // [P][gc][HD], <= 4 KiB
    if (pv_active) {
      float* mine = red + (tp * gc + gbase) * HD + ct * Tr::kCols;
#pragma unroll
      for (int c = 0; c < Tr::kCols; ++c) mine[c] = acc[0][c];
    }
    __syncthreads();
    if (pv_active && tp == 0) {
      for (int q = 1; q < P; ++q) {
        const float* other = red + (q * gc + gbase) * HD + ct * Tr::kCols;
#pragma unroll
        for (int c = 0; c < Tr::kCols; ++c) acc[0][c] += other[c];
      }
    }
  }

  // ---- epilogue ----
#pragma unroll
  for (int h = 0; h < Tr::kHeadsPerThread; ++h) {
    const int g = gbase + h * Tr::kHeadSlots;
    if (g >= gc || !pv_active || tp != 0) continue;
    const float l = sm.l[g];
    const float inv = l > 0.f ? a.v_scale / l : 0.f;
    if (a.num_splits == 1) {
      QT* o = static_cast<QT*>(a.out) + static_cast<int64_t>(row) * a.out_stride +
              static_cast<int64_t>(head0 + g) * HD + ct * Tr::kCols;
#pragma unroll
      for (int c = 0; c < Tr::kCols; ++c) o[c] = static_cast<QT>(acc[h][c] * inv);
    } else {
      const int64_t idx =
          (static_cast<int64_t>(row) * a.num_heads + head0 + g) * a.num_splits + split;
      if (l > 0.f) {
        float* o = a.ws_o + idx * HD + ct * Tr::kCols;
#pragma unroll
        for (int c = 0; c < Tr::kCols; c += 4)
          *reinterpret_cast<float4*>(o + c) =
              make_float4(acc[h][c] * inv, acc[h][c + 1] * inv, acc[h][c + 2] * inv,
                          acc[h][c + 3] * inv);
      }
      if (ct == 0) {
        a.ws_ml[idx * 2] = sm.m[g];
        a.ws_ml[idx * 2 + 1] = l;
      }
    }
  }
}

template <class QT, class CT, int HD>
void launch(const AttnArgs& a, cudaStream_t stream) {
  using Tr = DecodeTraits<CT, HD>;
  constexpr int smem = static_cast<int>(sizeof(typename Tr::Smem));
  // the soft-cap is a template flag: the uncapped kernel stays as it was
  auto kernel = a.softcap > 0.f ? decode_kernel<QT, CT, HD, true> : decode_kernel<QT, CT, HD, false>;
  allow_smem(kernel, smem);
  const dim3 grid(a.num_tokens, a.num_kv_heads * a.head_chunks, a.num_splits);
  kernel<<<grid, kThreads, smem, stream>>>(a);
  check_launch("decode_attention");
}

template <class QT, class CT>
void launch_hd(const AttnArgs& a, int head_dim, cudaStream_t stream) {
  switch (head_dim) {
    case 64:
      return launch<QT, CT, 64>(a, stream);
    case 128:
      return launch<QT, CT, 128>(a, stream);
    case 256:
      return launch<QT, CT, 256>(a, stream);
    default:
      fail("head_dim: " + std::to_string(head_dim) + " is not supported (64, 128 or 256)");
  }
}

}  // namespace

void launch_decode(const AttnArgs& a, DType q_dtype, DType cache_dtype, int head_dim,
                   cudaStream_t stream) {
  const bool is_fp8 = cache_dtype == DType::kFloat8E4M3;
  switch (q_dtype) {
    case DType::kFloat32:
      return launch_hd<float, float>(a, head_dim, stream);
    case DType::kBFloat16:
      return is_fp8 ? launch_hd<bf16, fp8>(a, head_dim, stream)
                 : launch_hd<bf16, bf16>(a, head_dim, stream);
    case DType::kFloat16:
      return is_fp8 ? launch_hd<fp16, fp8>(a, head_dim, stream)
                 : launch_hd<fp16, fp16>(a, head_dim, stream);
    default:
      fail("q_dtype: unsupported");
  }
}

}  // namespace pyengine::kernels::cuda::detail
