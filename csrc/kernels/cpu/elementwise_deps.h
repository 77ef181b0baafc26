// What elementwise_impl.h includes, included by each level's translation unit before its
// target switch (see isa_target.h).
#pragma once

#include "parallel.h"

#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "dtype_convert.h"
#include "elementwise_common.h"
#include "isa_target.h"
