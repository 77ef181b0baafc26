// Quantized weights on the CPU: block formats, quantization, dequantization and the linear layer.
//
// The block layouts are llama.cpp's (GGUF's), byte for byte, so GGUF tensors load without
// re-quantizing and results can be checked against llama.cpp's:
//   Q8_0  32 weights: fp16 d, int8 q[32];                       w = d * q
//   Q4_0  32 weights: fp16 d, 16 bytes of nibbles (low nibble j = weight j, high nibble j =
//         weight 16 + j);                                       w = d * (q - 8)
//   Q5_0  32 weights: fp16 d, 32 fifth bits (bit j of a little-endian uint32 = weight j), 16
//         bytes of nibbles as Q4_0;                             w = d * (q - 16)
//   Q4_K  256 weights in 8 sub-blocks of 32: fp16 d, fp16 dmin, 12 bytes of 6-bit sub-block
//         scales and mins, 128 bytes of nibbles;                w = d * sc * q - dmin * m
//   Q6_K  256 weights in 16 sub-blocks of 16: 128 bytes of low nibbles, 64 bytes of high 2-bit
//         pairs, int8 scales[16], fp16 d;                       w = d * sc * (q - 32)
// and one of pyengine's own, for 4-bit checkpoints with zero points (AWQ, GPTQ):
//   Q4_Z  32 weights: fp16 d, uint8 zero point z (0..15), a pad byte, 16 bytes of nibbles as
//         Q4_0;                                                 w = d * (q - z)
// A weight matrix [N, K] is N rows of K / block_elems blocks each (K a multiple of the block).
//
// The linear layer quantizes the activations per block on the fly (to 8 bits: one fp32 scale
// per 32 values for Q8_0 / Q5_0 / Q4_0 weights, per 256 for Q4_K / Q6_K, as llama.cpp does) and sums
// the integer products of each block exactly, in fp32 across blocks.
//
// Errors: invalid arguments throw std::invalid_argument naming the argument and the value.
#pragma once

#include <cstdint>

namespace pyengine::kernels {

// The GGML type ids (the numbers in a GGUF file's tensor infos).
// (Q4_Z has no GGML id: 100 is pyengine's.)
enum class QuantType : int32_t { kQ4_0 = 2, kQ5_0 = 6, kQ8_0 = 8, kQ4_K = 12, kQ6_K = 14, kQ4_Z = 100 };

struct QuantFormat {
  const char* name;      // "q8_0", "q5_0", "q4_0", "q4_k", "q6_k", "q4_z"
  int32_t block_elems;   // weights per block
  int32_t block_bytes;   // bytes per block
};

// The format of `type`; throws for a type id this build does not know.
QuantFormat quant_format(QuantType type);

// Bytes of one quantized row of K weights; throws unless K is a positive multiple of the block.
int64_t quant_row_bytes(QuantType type, int64_t K);

// Quantizes rows [rows, K] of fp32 weights into `dst` (rows * quant_row_bytes bytes) by
// round-to-nearest, as llama.cpp's reference quantizers do without an importance matrix (Q4_K
// and Q6_K search each sub-block's scale, and min, for the least weighted squared error; Q4_Z:
// d = (max - min) / 15, z = round(-min / d), as AWQ and GPTQ do without calibration).
// Threads over rows (`num_threads` <= 0: OpenMP's default).
void quantize_rows(QuantType type, const float* src, void* dst, int64_t rows, int64_t K,
                   int32_t num_threads);

// The fp32 values of `rows` quantized rows of K weights.
void dequantize_rows(QuantType type, const void* src, float* dst, int64_t rows, int64_t K);

// dst[i, :] = the fp32 values of row ids[i] (0 <= ids[i] < num_rows): an embedding lookup.
void dequantize_gather(QuantType type, const void* src, int64_t num_rows, int64_t K,
                       const int64_t* ids, int64_t count, float* dst);

// y[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]) for a quantized W [N, K] (type `type`), fp32 x
// [M, K] (rows `ldx` floats apart) and y [M, N] (rows `ldy` floats apart, so one call can fill
// a column range of a wider output). Any M >= 1: the weights are read once, in tiles reused
// from cache for all rows of x. Threads over output columns (`num_threads` <= 0: OpenMP's
// default), with the compute code of the active instruction-set level (pyengine/cpu_isa.h).
void linear_quant(float* y, int64_t ldy, const float* x, int64_t ldx, int32_t M, const void* weight,
                  QuantType type, int32_t N, int32_t K, const float* bias, int32_t num_threads);

}  // namespace pyengine::kernels
