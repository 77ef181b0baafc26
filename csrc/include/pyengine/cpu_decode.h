// The decoder layers of a small bf16 or fp32 batch (decode) in one call, with pyengine's own
// linear kernels (pyengine/cpu_linear.h; from kGemmMinRows rows, where gemm_preferred(), the GEMM
// of pyengine/cpu_gemm.h): per layer RMSNorm -> qkv -> (q/k norm) -> RoPE (on the layers
// that use it) -> KV store -> paged attention (the layer's sliding window, the model's logit
// soft-cap) -> o -> residual add + RMSNorm -> gate_up -> SiLU-mul -> down -> residual add,
// each step the kernel of pyengine/cpu_linear.h (cpu_gemm.h), cpu_elementwise.h or kernels.h with the same
// arguments the Python model would pass. At batch 1 a step's time otherwise goes largely to the
// per-call overhead of a few hundred Python calls.
#pragma once

#include <cstdint>

#include "pyengine/cpu_quant.h"
#include "pyengine/kernels.h"

namespace pyengine::kernels {

// One layer's row of the layer table, in this order (kDecodeLayerPointers entries per layer):
// the addresses of its tensors (q_norm, k_norm and qkv_bias are 0 when the model has none),
// then two plain integers, not addresses, since models vary them by layer (Gemma 2/3 alternate
// sliding-window and global layers, Qwen2 has max_window_layers, SmolLM3 skips RoPE on some):
//   kSlidingWindow  the layer's attention window as paged_attention's sliding_window
//                   (0 = full attention), in [0, 2^31);
//   kUseRope        1: RoPE on q and k; 0: none (NoPE layer).
enum DecodeLayerPointer : int32_t {
  kInputNorm = 0, kPostNorm, kQkv, kQkvBias, kQNorm, kKNorm, kO, kGateUp, kDown, kKCache, kVCache,
  kSlidingWindow, kUseRope,
  kDecodeLayerPointers
};

struct DecodeShape {
  int32_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate;
  float rms_norm_eps, scale;
  float attn_softcap;  // paged_attention's softcap for every layer (0 = off; Gemma 2: 50)
  int32_t max_position, tokens_per_block, max_blocks_per_seq;
  int32_t num_blocks;  // in each layer's k/v cache (the kernels check the indices against it)
  DType cache_dtype;
  DType dtype;  // of the activations and weights: kBFloat16 or kFloat32
  // The linear layers' weights (kQkv, kO, kGateUp, kDown) are quantized (pyengine/cpu_quant.h):
  // their pointers address QuantLinearDesc records; dtype must be kFloat32.
  bool quantized;
};

// A quantized linear layer as decode_layers reads it: consecutive groups of weight rows, each of
// one format (a GGUF file may store q and k in one format and v in another). Fields are 64-bit
// so that the records can be built in an int64 tensor.
constexpr int32_t kMaxQuantLinearParts = 4;
struct QuantLinearPart {
  int64_t type;  // QuantType
  int64_t rows;
  const void* data;
};
struct QuantLinearDesc {
  int64_t num_parts;
  QuantLinearPart parts[kMaxQuantLinearParts];
};

// Scratch elements (of shape.dtype) decode_layers needs for `num_tokens` rows.
int64_t decode_scratch_elements(const DecodeShape& shape, int32_t num_tokens);

// Runs every layer on the residual stream h [num_tokens, hidden] (shape.dtype, updated in place:
// on return h holds the last layer's output, before the final norm). layer_ptrs: num_layers x
// kDecodeLayerPointers entries (each layer's window and RoPE flag are checked before anything
// runs); cos/sin: [max_position, head_dim] tables of shape.dtype; the metadata as for
// paged_attention. 1 <= num_tokens <= kLinearMaxRows.
void decode_layers(void* h, int32_t num_tokens, const uintptr_t* layer_ptrs,
                   const DecodeShape& shape, const void* cos, const void* sin,
                   const int32_t* positions, const int32_t* slot_mapping,
                   const int32_t* query_start_loc, const int32_t* seq_lens,
                   const int32_t* block_tables, int32_t num_seqs, void* scratch,
                   int64_t scratch_elements, int32_t num_threads);

// The model's output head after decode_layers, for the rows that produce logits: the final
// RMSNorm (rms_norm, as the layers' norms) and the output projection (the linear kernel the
// layers take for that many rows, or the quantized one), in fp32 -- the Python model's _logits
// with fused elementwise kernels, without its Python calls.
struct DecodeHead {
  const void* norm;   // final RMSNorm weight [hidden] of shape.dtype
  uintptr_t lm_head;  // [vocab, hidden] of shape.dtype, or the address of a QuantLinearDesc (quantized)
  int32_t vocab;
  bool quantized;     // lm_head is quantized: shape.dtype must be kFloat32
};

// Scratch elements (of shape.dtype) decode_head needs for `num_rows` rows.
int64_t decode_head_scratch_elements(const DecodeShape& shape, const DecodeHead& head, int32_t num_rows);

// logits [num_rows, vocab] (fp32) of rows `rows` (indices into h's num_tokens rows, in any order,
// repeats allowed) of the residual stream h [num_tokens, hidden] as decode_layers leaves it;
// 1 <= num_rows <= kLinearMaxRows. Every argument is checked before anything is written.
void decode_head(float* logits, const void* h, int32_t num_tokens, const int32_t* rows, int32_t num_rows,
                 const DecodeShape& shape, const DecodeHead& head, void* scratch, int64_t scratch_elements,
                 int32_t num_threads);

}  // namespace pyengine::kernels
