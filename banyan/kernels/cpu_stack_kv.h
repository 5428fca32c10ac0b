// How the layer stack (cpu_layer_stack.cpp) stores a token's K and V rows into the pool: as
// they are, or as int8 / fp8 codes with a float32 scale per (slot, KV head) row, each exactly
// as mem/kv_pool.py's store makes them from the same values (a bf16 row widened to float32 as
// its `x.float()` does), so the pool holds what the per-op path would have stored, bit for bit.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_dtypes.h"
#include "cpu_stack_api.h"

namespace {

// The pool's storage (StackModel::kv_codes; native_stack.py: KV_CODES).
enum KvCodes : int64_t { kKvPlain = 0, kKvInt8 = 1, kKvE4M3 = 2, kKvE5M2 = 3 };

// A quantized pool's rule: its codes, and for fp8 the scale shifts tried (FP8_SCALE_SHIFTS).
struct KvStore {
    int64_t codes;
    const float* shifts;
    int64_t n_shifts;
};

// The kvh rows of d values at x into slot `slot` of pool (and its scales).
template <typename T>
void store_row(const T* x, int64_t slot, int64_t kvh, int64_t d, void* pool, float* scales,
               const KvStore& how) {
    const int64_t at = slot * kvh * d;
    if (how.codes == kKvPlain) {
        std::memcpy(static_cast<T*>(pool) + at, x, kvh * d * sizeof(T));
        return;
    }
    const float* xf;
    thread_local std::vector<float> wide;
    if constexpr (std::is_same<T, float>::value) {
        xf = x;
    } else {  // bf16: widened, exactly
        wide.resize(kvh * d);
        for (int64_t e = 0; e < kvh * d; ++e) wide[e] = bf16_to_f32(x[e]);
        xf = wide.data();
    }
    float* row_scales = scales != nullptr ? scales + slot * kvh : nullptr;  // null: fp8's unit
    if (how.codes == kKvE4M3 || how.codes == kKvE5M2) {  // (one thread: a few rows)
        auto* codes = static_cast<uint8_t*>(pool) + at;
        (how.codes == kKvE4M3 ? banyan_fp8_quantize_rows_e4m3 : banyan_fp8_quantize_rows_e5m2)(
            xf, kvh, d, how.shifts, how.n_shifts, codes, row_scales, 1);
        return;
    }
    // int8: scale = the row's largest magnitude (at least 1e-30) over 127; codes = x / scale
    // rounded half to even, clamped
    for (int64_t h = 0; h < kvh; ++h) {
        const float* xh = xf + h * d;
        float top = 0.0f;
        for (int64_t e = 0; e < d; ++e) top = std::max(top, std::fabs(xh[e]));
        const float scale = std::max(top, 1e-30f) / 127.0f;
        int8_t* codes = static_cast<int8_t*>(pool) + at + h * d;
        for (int64_t e = 0; e < d; ++e)
            codes[e] = static_cast<int8_t>(
                std::min(127.0f, std::max(-127.0f, std::nearbyint(xh[e] / scale))));
        row_scales[h] = scale;
    }
}

}  // namespace
