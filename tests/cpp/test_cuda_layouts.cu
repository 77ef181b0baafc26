// Host-side checks of the tensor-core prefill kernel's CuTe layouts (prefill_traits.cuh); no GPU
// needed. The kernel relies on these facts:
//   1. rowcol(acc): thread t of warp w holds rows 16w + lane/4 (+8) of the S / O tiles, one row
//      per row index, and the 4 lanes of a quad (lane % 4) split each row's columns -- so row
//      max / sum reductions are two xor-shuffles (1, 2);
//   2. acc_as_a(acc): the S accumulator's registers, regrouped, hold exactly the (row, k)
//      elements the m16n8k16 A operand of P . V expects in each register slot;
//   3. the swizzled shared-memory tiles keep 8-element (16-byte) chunks contiguous (cp.async /
//      16-byte stores write them whole), and the V^T view is the transpose of the V tile.
#include <cstdio>

#include "prefill_traits.cuh"

using namespace cute;
using namespace pyengine::kernels::cuda::detail;
using namespace pyengine::kernels::cuda::detail::prefill;

namespace {

int failures = 0;

void expect(bool ok, const char* what, int tid, int a, int b) {
  if (!ok && failures++ < 20) std::printf("FAIL %s (thread %d: %d vs %d)\n", what, tid, a, b);
}

template <class Elem, int HD>
void check() {
  using Tr = PrefillTraits<Elem, HD>;
  typename Tr::TiledMma mma;
  for (int tid = 0; tid < kThreads; ++tid) {
    auto thr = mma.get_thread_slice(tid);
    const int lane = tid % 32, warp = tid / 32;
    Tensor cS = make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{});
    Tensor tScS = thr.partition_C(cS);
    Tensor rc = make_tensor(tScS.data(), rowcol(tScS.layout()));
    for (int mi = 0; mi < size<0>(rc); ++mi) {
      const int r0 = get<0>(rc(mi, 0));
      expect(r0 == warp * 16 + lane / 4 + 8 * mi, "row of rowcol(acc)", tid, r0,
             warp * 16 + lane / 4 + 8 * mi);
      for (int ni = 0; ni < size<1>(rc); ++ni) {
        expect(get<0>(rc(mi, ni)) == r0, "one row per rowcol row", tid, get<0>(rc(mi, ni)), r0);
        const int c = get<1>(rc(mi, ni));
        expect((c % 8) / 2 == lane % 4, "quad lane owns the column", tid, c, lane);
      }
    }
    // O accumulator (64 x HD): same row ownership
    Tensor cO = make_identity_tensor(Shape<Int<kBlockM>, Int<HD>>{});
    Tensor tOcO = thr.partition_C(cO);
    Tensor orc = make_tensor(tOcO.data(), rowcol(tOcO.layout()));
    for (int mi = 0; mi < size<0>(orc); ++mi)
      for (int ni = 0; ni < size<1>(orc); ++ni)
        expect(get<0>(orc(mi, ni)) == warp * 16 + lane / 4 + 8 * mi, "row of rowcol(acc_o)", tid,
               get<0>(orc(mi, ni)), warp * 16 + lane / 4 + 8 * mi);
    // P as the A operand
    Tensor tPcA = thr.partition_A(cS);
    Tensor asA = make_tensor(tScS.data(), acc_as_a(tScS.layout()));
    expect(size(tPcA) == size(asA), "A operand size", tid, int(size(tPcA)), int(size(asA)));
    for (int i = 0; i < size<0>(tPcA); ++i)
      for (int m = 0; m < size<1>(tPcA); ++m)
        for (int k = 0; k < size<2>(tPcA); ++k) {
          auto want = tPcA(i, m, k);
          auto got = asA(i, m, k);
          expect(get<0>(want) == get<0>(got) && get<1>(want) == get<1>(got), "acc_as_a slot",
                 tid, get<0>(got) * 1000 + get<1>(got), get<0>(want) * 1000 + get<1>(want));
        }
  }
  typename Tr::SmemLayoutQ lq;
  typename Tr::SmemLayoutKV lkv;
  typename Tr::SmemLayoutVt lvt;
  for (int r = 0; r < kBlockM; ++r)
    for (int c = 0; c < HD; c += 8) {
      const int o = lq(r, c);
      expect(o % 8 == 0, "Q chunk aligned", r, o, c);
      for (int e = 1; e < 8; ++e) expect(lq(r, c + e) == o + e, "Q chunk contiguous", r, c, e);
    }
  for (int r = 0; r < kBlockN; ++r)
    for (int c = 0; c < HD; c += 8) {
      const int o = lkv(r, c);
      expect(o % 8 == 0, "K/V chunk aligned", r, o, c);
      for (int e = 1; e < 8; ++e) expect(lkv(r, c + e) == o + e, "K/V chunk contiguous", r, c, e);
    }
  for (int d = 0; d < HD; ++d)
    for (int n = 0; n < kBlockN; ++n)
      expect(lvt(d, n) == lkv(n, d), "V^T view", d, int(lvt(d, n)), int(lkv(n, d)));
  expect(cosize(lq) == kBlockM * HD && cosize(lkv) == kBlockN * HD, "tile sizes", 0,
         int(cosize(lq)), int(cosize(lkv)));
}

}  // namespace

int main() {
  check<bf16, 64>();
  check<bf16, 128>();
  check<fp16, 64>();
  check<fp16, 128>();
  std::printf("%s: %d failure(s)\n", failures ? "FAILED" : "ok", failures);
  return failures ? 1 : 0;
}
