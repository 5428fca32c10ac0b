// Dequantizing panels of the weight-only quantized layouts back to float32 rows, for long
// steps (prefill chunks): there a GEMM on float32 weights beats the GEMV-style kernels, and a
// slab of rows dequantized into a buffer that stays in cache costs a few percent of the GEMM.
// Values are exactly the layer's (code x scale (+ min)), as banyan/layers/quant.py defines them.
// Panels [p0, p1) -> out [(p1 - p0) * 16, K] float32, row-major (padding rows included).

#include "cpu_quant_common.h"

namespace {

template <typename S>
void int4_dequant(const uint8_t* w, const S* scale, const S* mins, int64_t K, int64_t group,
                  int64_t p0, int64_t p1, float* out, int64_t n_threads) {
    const int64_t groups = K / group;
#pragma omp parallel for num_threads(threads_for(p1 - p0, n_threads)) schedule(static)
    for (int64_t p = p0; p < p1; ++p) {
        const uint8_t* wp = w + p * (K / 2) * PANEL;
        for (int l = 0; l < PANEL; ++l) {
            float* row = out + ((p - p0) * PANEL + l) * K;
            for (int64_t g = 0; g < groups; ++g) {
                const float s = scale_value(scale[(p * groups + g) * PANEL + l]);
                const float m = scale_value(mins[(p * groups + g) * PANEL + l]);
                for (int64_t j = g * group / 2; j < (g + 1) * group / 2; ++j) {
                    const uint8_t b = wp[j * PANEL + l];
                    row[2 * j] = static_cast<float>(b & 0xF) * s + m;
                    row[2 * j + 1] = static_cast<float>(b >> 4) * s + m;
                }
            }
        }
    }
}

}  // namespace

extern "C" {

// int8, one float32 scale per row (scale [panels * 16]).
void banyan_int8_dequant_f32(const int8_t* w, const float* scale, int64_t K, int64_t p0,
                             int64_t p1, float* out, int64_t n_threads) {
#pragma omp parallel for num_threads(threads_for(p1 - p0, n_threads)) schedule(static)
    for (int64_t p = p0; p < p1; ++p) {
        const int8_t* wp = w + p * K * PANEL;
        for (int l = 0; l < PANEL; ++l) {
            float* row = out + ((p - p0) * PANEL + l) * K;
            const float s = scale[p * PANEL + l];
            for (int64_t k = 0; k < K; ++k) row[k] = static_cast<float>(wp[k * PANEL + l]) * s;
        }
    }
}

// int8 with a float32 scale per group (scale [panels, K / group, 16]).
void banyan_int8g_dequant_f32(const int8_t* w, const float* scale, int64_t K, int64_t group,
                              int64_t p0, int64_t p1, float* out, int64_t n_threads) {
    const int64_t groups = K / group;
#pragma omp parallel for num_threads(threads_for(p1 - p0, n_threads)) schedule(static)
    for (int64_t p = p0; p < p1; ++p) {
        const int8_t* wp = w + p * K * PANEL;
        for (int l = 0; l < PANEL; ++l) {
            float* row = out + ((p - p0) * PANEL + l) * K;
            for (int64_t g = 0; g < groups; ++g) {
                const float s = scale[(p * groups + g) * PANEL + l];
                for (int64_t k = g * group; k < (g + 1) * group; ++k)
                    row[k] = static_cast<float>(wp[k * PANEL + l]) * s;
            }
        }
    }
}

// int4 pairs (input k even in the low nibble) with a scale and min per group (scale, mins
// [panels, K / group, 16]): float16 (banyan_int4_dequant_f32) or float32 (the _s variant).
void banyan_int4_dequant_f32(const uint8_t* w, const uint16_t* scale, const uint16_t* mins,
                             int64_t K, int64_t group, int64_t p0, int64_t p1, float* out,
                             int64_t n_threads) {
    int4_dequant(w, scale, mins, K, group, p0, p1, out, n_threads);
}

void banyan_int4s_dequant_f32(const uint8_t* w, const float* scale, const float* mins,
                              int64_t K, int64_t group, int64_t p0, int64_t p1, float* out,
                              int64_t n_threads) {
    int4_dequant(w, scale, mins, K, group, p0, p1, out, n_threads);
}

}  // extern "C"
