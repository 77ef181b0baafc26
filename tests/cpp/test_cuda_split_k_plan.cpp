// The CUDA paged attention's kernel choice and split-K workspace arithmetic
// (csrc/kernels/cuda/split_k_plan.h and the public functions of pyengine/cuda_kernels.h), on
// the host: which batches reach the split-K kernel and whether an engine's workspace covers
// every one of them.
#include <cstddef>
#include <cstdint>

#include "kernels/cuda/split_k_plan.h"
#include "pyengine/cuda_kernels.h"
#include "test_harness.h"

using namespace pyengine::kernels;
using namespace pyengine::kernels::cuda::detail;

namespace {

// An engine's sizing, as the model runner does it.
size_t engine_workspace(DType dtype, int32_t head_dim, int32_t num_heads, int32_t max_batch_size,
                        int32_t max_num_tokens, int32_t max_seq_len) {
  const int32_t rows = cuda::paged_attention_split_k_rows(dtype, head_dim, max_batch_size, max_num_tokens);
  return cuda::paged_attention_workspace_bytes(rows, num_heads, head_dim, max_seq_len);
}

// What one batch needs, for a model's (aligned) queries.
size_t batch_need(DType dtype, int32_t head_dim, int32_t num_heads, int32_t num_tokens,
                  int32_t max_query_len, int32_t max_context_len) {
  return cuda::paged_attention_batch_workspace_bytes(dtype, num_tokens, num_heads, head_dim, max_query_len,
                                                     max_context_len, true);
}

}  // namespace

TEST(the_kernel_of_a_batch) {
  const auto tc = AttentionKernel::kTensorCorePrefill;
  const auto sk = AttentionKernel::kSplitKDecode;
  CHECK(choose_kernel(DType::kBFloat16, 128, 100, true) == tc);
  CHECK(choose_kernel(DType::kFloat16, 64, 2, true) == tc);
  CHECK(choose_kernel(DType::kBFloat16, 128, 1, true) == sk);    // decode
  CHECK(choose_kernel(DType::kFloat32, 128, 100, true) == sk);   // fp32 prefill
  CHECK(choose_kernel(DType::kBFloat16, 256, 100, true) == sk);  // head_dim 256 prefill
  CHECK(choose_kernel(DType::kFloat16, 128, 100, false) == sk);  // misaligned query
}

TEST(max_splits_by_length_rows_and_cap) {
  CHECK_EQ(max_splits(4, 100), 1);       // one split's worth of context
  CHECK_EQ(max_splits(4, 257), 2);
  CHECK_EQ(max_splits(1, 1 << 20), kMaxSplits);
  CHECK_EQ(max_splits(64, 1 << 20), kSplitRowBudget / 64);
  CHECK_EQ(max_splits(512, 1 << 20), 2);
  CHECK_EQ(max_splits(513, 1 << 20), 1);  // past the row budget: no split
  CHECK_EQ(max_splits(0, 0), 1);
}

TEST(workspace_covers_every_smaller_batch) {
  // the need is not monotone in the rows (512 rows: 2 splits, 513: 1), the sizing must be
  for (int32_t ctx : {0, 300, 1000, 5000, 40000}) {
    size_t prev = 0;
    for (int32_t n = 0; n <= 1100; ++n) {
      const size_t sized = cuda::paged_attention_workspace_bytes(n, 8, 128, ctx);
      CHECK(sized >= prev);
      CHECK(sized >= split_k_batch_workspace_bytes(n, 8, 128, ctx));
      prev = sized;
    }
  }
  CHECK(cuda::paged_attention_workspace_bytes(512, 8, 128, 40000) >
        split_k_batch_workspace_bytes(513, 8, 128, 40000));
  CHECK_EQ(cuda::paged_attention_workspace_bytes(513, 8, 128, 40000),
           cuda::paged_attention_workspace_bytes(512, 8, 128, 40000));
}

TEST(workspace_is_bounded_by_the_row_budget) {
  const size_t per_row = size_t{16} * (128 + 2) * sizeof(float);
  CHECK(cuda::paged_attention_workspace_bytes(100000, 16, 128, 1 << 20) <= per_row * kSplitRowBudget);
  CHECK(cuda::paged_attention_workspace_bytes(100000, 16, 128, 1 << 20) >= per_row * kSplitRowBudget * 9 / 10);
}

TEST(rows_reaching_split_k) {
  CHECK_EQ(cuda::paged_attention_split_k_rows(DType::kBFloat16, 128, 8, 512), 8);
  CHECK_EQ(cuda::paged_attention_split_k_rows(DType::kFloat16, 64, 8, 512), 8);
  CHECK_EQ(cuda::paged_attention_split_k_rows(DType::kFloat32, 128, 8, 512), 512);
  CHECK_EQ(cuda::paged_attention_split_k_rows(DType::kBFloat16, 256, 8, 512), 512);
  CHECK_EQ(cuda::paged_attention_split_k_rows(DType::kFloat32, 64, 64, 16), 64);
}

// The start-up failure: the KV-capacity estimate's dummy batch (one long prompt plus a full
// batch of one-token prompts, max_num_tokens in all) on an engine sized for max_batch_size rows.
TEST(an_engine_covers_its_worst_prefill_batch) {
  struct Config {
    DType dtype;
    int32_t head_dim;
  };
  for (const Config c : {Config{DType::kFloat32, 128}, Config{DType::kFloat32, 64},
                         Config{DType::kBFloat16, 256}, Config{DType::kBFloat16, 128},
                         Config{DType::kFloat16, 64}}) {
    const int32_t heads = 16, max_batch_size = 8, max_seq_len = 4096;
    for (int32_t max_num_tokens : {64, 300, 512, 1024, 2048}) {
      const size_t sized = engine_workspace(c.dtype, c.head_dim, heads, max_batch_size, max_num_tokens, max_seq_len);
      // every prefill batch of up to max_num_tokens tokens, contexts up to max_seq_len
      for (int32_t tokens = 2; tokens <= max_num_tokens; tokens += 7)
        for (int32_t ctx : {257, 1000, max_seq_len})
          CHECK(batch_need(c.dtype, c.head_dim, heads, tokens, tokens, ctx) <= sized);
      // and every decode batch
      for (int32_t rows = 1; rows <= max_batch_size; ++rows)
        CHECK(batch_need(c.dtype, c.head_dim, heads, rows, 1, max_seq_len) <= sized);
    }
  }
}

TEST(the_old_sizing_was_short_for_fp32_prefill) {
  // fp32, max_batch_size 8, max_num_tokens 512, max_seq_len 340 (tests/gpu's engine): the
  // dummy batch has 346 tokens over a 339-token context
  const size_t old_sizing = split_k_batch_workspace_bytes(8, 4, 64, 340);
  const size_t need = batch_need(DType::kFloat32, 64, 4, 346, 339, 339);
  CHECK(need > old_sizing);
  CHECK(need <= engine_workspace(DType::kFloat32, 64, 4, 8, 512, 340));
  // bf16 prefill of the same batch takes the tensor cores and needs nothing
  CHECK_EQ(batch_need(DType::kBFloat16, 64, 4, 346, 339, 339), size_t{0});
}

TEST(arguments_are_checked) {
  CHECK_THROWS(cuda::paged_attention_workspace_bytes(-1, 16, 128, 4096), std::invalid_argument, "num_tokens");
  CHECK_THROWS(cuda::paged_attention_workspace_bytes(1, 16, 128, -5), std::invalid_argument, "max_context_len");
  CHECK_THROWS(cuda::paged_attention_batch_workspace_bytes(DType::kFloat32, 1, 16, 128, -1, 5, true),
               std::invalid_argument, "max_query_len");
  CHECK_THROWS(cuda::paged_attention_split_k_rows(DType::kFloat32, 128, -1, 5), std::invalid_argument, "max_seqs");
  CHECK_THROWS(cuda::paged_attention_split_k_rows(DType::kFloat32, 128, 1, -5), std::invalid_argument, "max_tokens");
}

TEST_MAIN()
