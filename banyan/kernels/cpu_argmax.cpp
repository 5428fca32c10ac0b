// Greedy tokens without leaving the layer stack's call (cpu_layer_stack.cpp): each row's index
// of its first largest logit, as numpy's argmax gives it over the float32 values the sampler
// would see (sampling/greedy.py): equal values (0 and -0 too) keep the first, and a NaN counts
// as the largest (the first NaN's index).
//
// Why native: a batch-1 greedy step's logits went through the head's Python, .float(), numpy
// and the sampler's checks, ~140 us of an int4 step's ~2.2 ms on Zen 5, on caches the weights
// had just streamed through.

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "cpu_avx512.h"
#include "cpu_dtypes.h"
#include "cpu_team.h"

namespace {

inline float value(float x) { return x; }
inline float value(uint16_t x) { return bf16_to_f32(x); }

template <typename T>
int64_t argmax_row(const T* x, int64_t n) {
    float best = -INFINITY;
    bool nan = false;
    int64_t v = 0;
#if defined(__AVX512F__)
    __m512 top = _mm512_set1_ps(-INFINITY);
    __mmask16 unordered = 0;
    for (; v + 16 <= n; v += 16) {
        const __m512 a = load16(x + v);
        unordered |= _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q);
        top = _mm512_max_ps(top, a);
    }
    nan = unordered != 0;
    best = _mm512_reduce_max_ps(top);
#endif
    for (; v < n; ++v) {
        const float a = value(x[v]);
        nan = nan || std::isnan(a);
        best = std::max(best, a);
    }
    if (nan) {
        for (int64_t i = 0; i < n; ++i)
            if (std::isnan(value(x[i]))) return i;
    }
    int64_t i = 0;
#if defined(__AVX512F__)
    const __m512 b = _mm512_set1_ps(best);
    for (; i + 16 <= n; i += 16) {
        const __mmask16 hit = _mm512_cmp_ps_mask(load16(x + i), b, _CMP_EQ_OQ);
        if (hit) return i + __builtin_ctz(hit);
    }
#endif
    for (; i < n; ++i)
        if (value(x[i]) == best) return i;
    return 0;  // (unreachable: some value equals the largest)
}

template <typename T>
void argmax_rows(const T* x, int64_t rows, int64_t n, int64_t stride, int64_t* out,
                 int64_t n_threads) {
    // (a thread a row at most, parallel_for's own cap)
    banyan_team::parallel_for(rows, n_threads,
                              [&](int64_t r) { out[r] = argmax_row(x + r * stride, n); });
}

}  // namespace

extern "C" {

// x [rows, stride]: each row's argmax over its first n values into out [rows].
void banyan_argmax_rows_f32(const float* x, int64_t rows, int64_t n, int64_t stride,
                            int64_t* out, int64_t n_threads) {
    argmax_rows(x, rows, n, stride, out, n_threads);
}

void banyan_argmax_rows_bf16(const uint16_t* x, int64_t rows, int64_t n, int64_t stride,
                             int64_t* out, int64_t n_threads) {
    argmax_rows(x, rows, n, stride, out, n_threads);
}

}  // extern "C"
