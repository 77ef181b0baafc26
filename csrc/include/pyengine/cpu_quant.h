// Quantized weights on the CPU: block formats, quantization, dequantization and the linear layer.
//
// The block layouts are llama.cpp's (GGUF's), byte for byte, so GGUF tensors load without
// re-quantizing and results can be checked against llama.cpp's:
//   Q8_0  32 weights: fp16 d, int8 q[32];                       w = d * q
//   Q4_0  32 weights: fp16 d, 16 bytes of nibbles (low nibble j = weight j, high nibble j =
//         weight 16 + j);                                       w = d * (q - 8)
//   Q5_0  32 weights: fp16 d, 32 fifth bits (bit j of a little-endian uint32 = weight j), 16
//         bytes of nibbles as Q4_0;                             w = d * (q - 16)
//   Q5_1  32 weights: fp16 d, fp16 m, the fifth bits and nibbles as Q5_0;  w = d * q + m
//   Q4_K  256 weights in 8 sub-blocks of 32: fp16 d, fp16 dmin, 12 bytes of 6-bit sub-block
//         scales and mins, 128 bytes of nibbles;                w = d * sc * q - dmin * m
//   Q5_K  256 weights: fp16 d, fp16 dmin, the 12 scale bytes and the nibbles as Q4_K's, and 32
//         bytes qh between them: the fifth bit of the weight whose nibble is byte l's low (high)
//         nibble in the c-th 32 bytes of nibbles is bit 2c (2c + 1) of qh[l];
//                                                               w = d * sc * q - dmin * m
//   Q6_K  256 weights in 16 sub-blocks of 16: 128 bytes of low nibbles, 64 bytes of high 2-bit
//         pairs, int8 scales[16], fp16 d;                       w = d * sc * (q - 32)
// and one of pyengine's own, for 4-bit checkpoints with zero points (AWQ, GPTQ):
//   Q4_Z  32 weights: fp16 d, uint8 zero point z (0..15), a pad byte, 16 bytes of nibbles as
//         Q4_0;                                                 w = d * (q - z)
// A weight matrix [N, K] is N rows of K / block_elems blocks each (K a multiple of the block).
//
// Interleaved layouts (pyengine's, made at load time, never stored in files): the same values
// with 8 rows side by side, so that the kernels multiply 8 rows at once, one row per 32-bit
// lane, with no horizontal sums. A matrix is N / 8 groups (N a multiple of 8); a group is
// K / block_elems group blocks; in a group block, "byte 4j + t of a 32-byte chunk" belongs to
// row j:
//   Q8_0x8  per 32 weights (272 bytes): fp16 d[8] (row j's), then 8 chunks c of 32 bytes, byte
//           4j + t = q(j, 4c + t)
//   Q4_0x8  per 32 weights (144 bytes): fp16 d[8] (row j's), then 4 chunks c of 32 bytes, byte
//           4j + t = level(j, 8c + t) | level(j, 8c + 4 + t) << 4 (levels 0..15 as in Q4_0)
//   Q5_0x8  per 32 weights (176 bytes): fp16 d[8], 32 bytes of fifth bits, then the low 4 bits of
//           the levels as Q4_0x8's nibbles; bit 2c (2c + 1) of byte 4j + t of the fifth bits is
//           the fifth bit of the level in the low (high) nibble of byte 4j + t of chunk c
//   Q5_1x8  per 32 weights (192 bytes): fp16 d[8], fp16 m[8], then as Q5_0x8's
//   Q4_Zx8  per 32 weights (152 bytes): fp16 d[8], uint8 z[8], then the nibbles as Q4_0x8's
//           (Q4_Z's pad byte is not kept: 19 bytes a row per 32 weights against 20)
//   Q4_Kx8  per 256 weights (1184 bytes): fp16 d[8], fp16 dmin[8], scales[8 sub-blocks][8 rows]
//           and mins[4 pairs of sub-blocks][8 rows][2] as plain 6-bit values, then per sub-block
//           s 4 chunks c as Q4_0x8's over positions 32s + 8c + (0..7)
//   Q5_Kx8  per 256 weights (1440 bytes): Q4_Kx8's 1184 bytes (the low 4 bits of each level in its
//           nibbles), then per sub-block s 32 bytes of fifth bits: bit 2c (2c + 1) of byte 4j + t
//           is the fifth bit of the level in the low (high) nibble of byte 4j + t of chunk c
//   Q6_Kx8  per 256 weights (1680 bytes): fp16 d[8], int8 scales[8 pairs of sub-blocks][8 rows]
//           [2], then per sub-block s of 16: ql chunks A, B and qh chunk H of 32 bytes; the
//           level (0..63) of row j at position 16s + 4v + t has its low 4 bits in the low (v =
//           0, 2) or high (v = 1, 3) nibble of byte 4j + t of A (v = 0, 1) or B (v = 2, 3) and its
//           top 2 bits in bits 2v, 2v + 1 of byte 4j + t of H
// A row of an interleaved matrix "has" K / block_elems * (group block bytes / 8) bytes, so a
// matrix takes N * row bytes in either layout (Q4_Kx8: 148 bytes a row per 256 weights against
// Q4_K's 144, Q5_Kx8: 180 against 176, their scales being unpacked).
//
// The linear layer quantizes the activations per block on the fly (to 8 bits: one fp32 scale
// per 32 values for Q8_0 / Q5_0 / Q5_1 / Q4_0 weights, per 256 for Q4_K / Q5_K / Q6_K, as llama.cpp does) and sums
// the integer products of each block exactly, in fp32 across blocks.
//
// Errors: invalid arguments throw std::invalid_argument naming the argument and the value.
#pragma once

#include <cstdint>

namespace pyengine::kernels {

// The GGML type ids (the numbers in a GGUF file's tensor infos).
// (Q4_Z has no GGML id: 100 is pyengine's; so are the interleaved layouts', 200 + the id of the
// format they hold.)
enum class QuantType : int32_t {
  kQ4_0 = 2, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14, kQ4_Z = 100,
  kQ4_0x8 = 202, kQ5_0x8 = 206, kQ5_1x8 = 207, kQ8_0x8 = 208, kQ4_Kx8 = 212, kQ5_Kx8 = 213, kQ6_Kx8 = 214,
  kQ4_Zx8 = 300,
};

// Rows per group of an interleaved layout.
constexpr int32_t kInterleaveRows = 8;

struct QuantFormat {
  const char* name;      // "q8_0", "q5_0", "q5_1", "q4_0", "q4_k", "q5_k", "q6_k", "q4_z"; "q4_0x8", "q8_0x8", ...
  int32_t block_elems;   // weights per block
  int32_t block_bytes;   // bytes per block (interleaved layouts: per row, a group block's / 8)
};

// The format of `type`; throws for a type id this build does not know.
QuantFormat quant_format(QuantType type);

// Bytes of one quantized row of K weights; throws unless K is a positive multiple of the block.
int64_t quant_row_bytes(QuantType type, int64_t K);

// The interleaved layout of `type` (Q4_0 -> Q4_0x8, ...), or `type` itself where there is none
// (an interleaved layout).
QuantType interleaved_type(QuantType type);
// The format an interleaved layout holds (Q4_0x8 -> Q4_0); other types: themselves.
QuantType plain_type(QuantType type);

// Copies `rows` rows of K weights of `type` (any plain format; rows a multiple
// of 8) into its interleaved layout at `dst` (rows * quant_row_bytes(interleaved_type(type), K)
// bytes); deinterleave_rows undoes it, byte for byte (Q4_Z: with its pad bytes 0).
void interleave_rows(QuantType type, const void* src, void* dst, int64_t rows, int64_t K);
void deinterleave_rows(QuantType interleaved, const void* src, void* dst, int64_t rows, int64_t K);

// Quantizes rows [rows, K] of fp32 weights into `dst` (rows * quant_row_bytes bytes) by
// round-to-nearest, as llama.cpp's reference quantizers do without an importance matrix (Q4_K,
// Q5_K and Q6_K search each sub-block's scale, and min, for the least weighted squared error; Q4_Z:
// d = (max - min) / 15, z = round(-min / d), as AWQ and GPTQ do without calibration).
// Threads over rows (`num_threads` <= 0: OpenMP's default).
void quantize_rows(QuantType type, const float* src, void* dst, int64_t rows, int64_t K,
                   int32_t num_threads);

// The fp32 values of `rows` quantized rows of K weights (interleaved layouts: rows a multiple of
// 8).
void dequantize_rows(QuantType type, const void* src, float* dst, int64_t rows, int64_t K);

// dst[i, :] = the fp32 values of row ids[i] (0 <= ids[i] < num_rows): an embedding lookup.
void dequantize_gather(QuantType type, const void* src, int64_t num_rows, int64_t K,
                       const int64_t* ids, int64_t count, float* dst);
// The same with int32 ids (a token id tensor as the engine holds it).
void dequantize_gather(QuantType type, const void* src, int64_t num_rows, int64_t K,
                       const int32_t* ids, int64_t count, float* dst);

// The activation blocks linear_quant multiplies a weight block of `block` (32 or 256) weights
// with: M rows of K fp32 values (rows ldx apart) into `out`, row after row, per block d = max|x|
// / 127 and q = nearest-even(x * (1 / d)) (each step rounded in fp32), stored as
//   block 32:  float d, float s8 = 8 * d * sum(q), int8 q[32]          (40 bytes)
//   block 256: float d, int16 sums of each 16 q, int8 q[256]           (292 bytes)
// The same bytes at every instruction-set level.
void quantize_activation_blocks(const float* x, int64_t ldx, int32_t M, int32_t K, int32_t block, void* out);

// Rows of x from which linear_quant multiplies an interleaved layout with AMX-BF16 where
// pyengine::cpu_amx() says so (pyengine/cpu_isa.h).
constexpr int32_t kQuantAmxMinRows = 16;

// y[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]) for a quantized W [N, K] (type `type`), fp32 x
// [M, K] (rows `ldx` floats apart) and y [M, N] (rows `ldy` floats apart, so one call can fill
// a column range of a wider output; N a multiple of 8 for an interleaved layout). Any M >= 1: the weights are read once, in tiles reused
// from cache for all rows of x. Threads over output columns (`num_threads` <= 0: OpenMP's
// default), with the compute code of the active instruction-set level (pyengine/cpu_isa.h).
// With AMX (M >= kQuantAmxMinRows, an interleaved layout, cpu_amx()): the weights dequantized to
// bf16 a tile at a time (in cache; no copy of the matrix), x rounded to bf16 (round to nearest
// even), the products summed in fp32 by the tile unit. Either way a row's result depends only on
// its own row of x (batch invariance) within each of the two ranges of M.
void linear_quant(float* y, int64_t ldy, const float* x, int64_t ldx, int32_t M, const void* weight,
                  QuantType type, int32_t N, int32_t K, const float* bias, int32_t num_threads);

}  // namespace pyengine::kernels
