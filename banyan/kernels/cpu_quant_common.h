// Shared by the weight-only quantized linear kernels (cpu_quant_linear.cpp: int8 per row and
// int4 per group; cpu_int8g_linear.cpp: int8 per group, GGUF's Q8_0): the panel layout's
// constants, the threading rule, storing a panel's rows, token blocking and int8 loads.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#include <immintrin.h>
#endif

namespace {

constexpr int PANEL = 16;  // output rows side by side per input (banyan/layers/quant.py packs)
constexpr int MAX_TB = 8;  // tokens sharing one pass over a panel

inline int threads_for(int64_t panels, int64_t n_threads) {
    return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(panels, n_threads)));
}

// Store 16 results of panel `p` for one token: only the rows below n_out exist.
inline void store_rows(float* out_row, const float* vals, int64_t p, int64_t n_out) {
    const int64_t base = p * PANEL;
    const int64_t count = std::min<int64_t>(PANEL, n_out - base);
    std::memcpy(out_row + base, vals, static_cast<size_t>(count) * sizeof(float));
}

// Run `body(t0, tb)` over the tokens in blocks of MAX_TB, dispatching the block size to a
// template instance (a decode step is one block of 1).
template <typename Body>
void for_token_blocks(int64_t T, Body body) {
    for (int64_t t0 = 0; t0 < T; t0 += MAX_TB) body(t0, std::min<int64_t>(MAX_TB, T - t0));
}

#if defined(__AVX512F__)
inline __m512 load_i8x16(const int8_t* p) {
    return _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
inline __m256 load_i8x8(const int8_t* p) {
    return _mm256_cvtepi32_ps(
        _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
#endif

}  // namespace
