// The interleaved layouts' conversions (pyengine/cpu_quant.h describes the layouts), one group of
// 8 rows at a time: used by interleave_rows / deinterleave_rows, by dequantization and by the
// portable kernel, which computes an interleaved group from its plain rows.
#pragma once

#include <cstdint>

#include "pyengine/cpu_quant.h"

namespace pyengine::kernels::cpu {

// 8 plain rows of K weights (`plain` holds them one after another, row_bytes apart) into one
// interleaved group of `interleaved` type, and back (rows [r0, r1) of the 8; the others are not
// written).
void interleave_group(QuantType interleaved, const uint8_t* plain, int64_t row_bytes, uint8_t* group, int64_t K);
void deinterleave_group(QuantType interleaved, const uint8_t* group, uint8_t* plain, int64_t row_bytes, int64_t K,
                        int r0 = 0, int r1 = 8);

}  // namespace pyengine::kernels::cpu
