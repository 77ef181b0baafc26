// What attention_impl.h includes, included by each level's translation unit before its target
// switch (see isa_target.h).
#pragma once

#include "parallel.h"
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "attention_common.h"
#include "dtype_convert.h"
#include "isa_target.h"
