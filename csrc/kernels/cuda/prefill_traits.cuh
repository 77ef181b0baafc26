// Tile shapes, shared-memory layouts and register-layout conversions of the tensor-core
// prefill kernel (prefill_attention.cu). A header so the host-side layout test
// (tests/cpp/test_cuda_layouts.cu) checks the very definitions the kernel uses.
#pragma once

#include <type_traits>

#include <cute/tensor.hpp>

#include "common.cuh"

namespace pyengine::kernels::cuda::detail::prefill {

using namespace cute;

constexpr int kThreads = 128;
constexpr int kBlockM = 64;
constexpr int kBlockN = 64;

template <class Elem, int HD>
struct PrefillTraits {
  static constexpr int kBlockKSmem = 64;  // head_dim 64 and 128: 128-byte swizzled rows
  using MmaOp = std::conditional_t<std::is_same_v<Elem, bf16>, SM80_16x8x16_F32BF16BF16F32_TN,
                                   SM80_16x8x16_F32F16F16F32_TN>;
  using TiledMma = TiledMMA<MMA_Atom<MmaOp>, Layout<Shape<_4, _1, _1>>, Tile<Int<64>, _16, _16>>;
  using SmemLayoutAtom = decltype(composition(
      Swizzle<3, 3, 3>{}, Layout<Shape<_8, Int<kBlockKSmem>>, Stride<Int<kBlockKSmem>, _1>>{}));
  using SmemLayoutQ = decltype(tile_to_shape(SmemLayoutAtom{}, Shape<Int<kBlockM>, Int<HD>>{}));
  using SmemLayoutKV = decltype(tile_to_shape(SmemLayoutAtom{}, Shape<Int<kBlockN>, Int<HD>>{}));
  // V^T (head_dim x tokens) as a view of the V tile
  using SmemLayoutVt = decltype(composition(
      SmemLayoutKV{}, make_layout(Shape<Int<HD>, Int<kBlockN>>{}, GenRowMajor{})));
  using SmemCopyAtom = Copy_Atom<SM75_U32x4_LDSM_N, Elem>;
  using SmemCopyAtomT = Copy_Atom<SM75_U16x8_LDSM_T, Elem>;
  static constexpr int kSmemBytes = (kBlockM + 2 * kBlockN) * HD * sizeof(Elem);
};

// (4, MMA_M, MMA_N) accumulator layout -> (rows = (2, MMA_M), cols = (2, MMA_N))
template <class L>
CUTE_HOST_DEVICE auto rowcol(L acc) {
  auto l = logical_divide(acc, Shape<_2>{});  // ((2, 2), MMA_M, MMA_N)
  return make_layout(make_layout(get<0, 1>(l), get<1>(l)), make_layout(get<0, 0>(l), get<2>(l)));
}

// (4, MMA_M, MMA_N) accumulator layout -> ((4, 2), MMA_M, MMA_N / 2): an m16n8k16 A operand
template <class L>
CUTE_HOST_DEVICE auto acc_as_a(L acc) {
  auto l = logical_divide(acc, Shape<Underscore, Underscore, _2>{});  // (4, MMA_M, (2, N/2))
  return make_layout(make_layout(get<0>(l), get<2, 0>(l)), get<1>(l), get<2, 1>(l));
}

}  // namespace pyengine::kernels::cuda::detail::prefill
