// Shared by the weight-only quantized linear kernels (cpu_quant_linear.cpp: int8 per row and
// int4 per group; cpu_int8g_linear.cpp: int8 per group, GGUF's Q8_0): the panel layout's
// constants, the threading rule, storing a panel's rows, token blocking and int8 loads.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#include <immintrin.h>
#endif

namespace {

constexpr int PANEL = 16;  // output rows side by side per input (banyan/layers/quant.py packs)
// Tokens sharing one pass over a panel: 4, so that a token's partial sums (kInt8Sums and the
// like: their count must not depend on the block) fit the registers with a decode's 4 chains
// (8 a pass had 4 sums for 1 token, 1 for 5+: a token's bits depended on its step's size).
constexpr int MAX_TB = 4;

// A decode step streams every weight from memory once, panel after panel on each thread. On its
// own the hardware prefetcher left the int4 loop stalled on its loads (perf: a third of its
// samples at the first load of each cache line); asking for the line kAheadBytes ahead, and for
// the group scales as many groups ahead, ran a SmolLM2 step's int4 projections (84 MB, cold)
// ~20% faster on Zen 5 (2.3-2.7 -> 1.9-2.1 ms; 2-8 KB ahead alike, 512 B slower). Past a
// panel's end it fetches the start of the next panel, which the same thread reads next.
constexpr int64_t kAheadBytes = 4096;

inline void fetch_ahead(const void* p, int64_t bytes = kAheadBytes) {
    __builtin_prefetch(static_cast<const char*>(p) + bytes, 0, 3);
}

// Once per 64-byte line of a panel's codes: `offset` bytes into the stream.
inline void fetch_codes_ahead(const void* base, int64_t offset) {
    if (offset % 64 == 0) fetch_ahead(static_cast<const char*>(base) + offset);
}

// A group's scales as many groups ahead as the codes are fetched.
inline void fetch_scales_ahead(const void* group_scales, int64_t code_bytes_per_group,
                               int64_t scale_bytes_per_group) {
    const int64_t groups_ahead = std::max<int64_t>(1, kAheadBytes / code_bytes_per_group);
    fetch_ahead(group_scales, groups_ahead * scale_bytes_per_group);
}

inline int threads_for(int64_t panels, int64_t n_threads) {
    return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(panels, n_threads)));
}

// Store 16 results of panel `p` for one token: only the rows below n_out exist.
inline void store_rows(float* out_row, const float* vals, int64_t p, int64_t n_out) {
    const int64_t base = p * PANEL;
    const int64_t count = std::min<int64_t>(PANEL, n_out - base);
    std::memcpy(out_row + base, vals, static_cast<size_t>(count) * sizeof(float));
}

// body(std::integral_constant<int, tb>) for a block of tb (1..TB) tokens: the block size as a
// template argument of the kernel body calls.
template <int TB = MAX_TB, typename Body>
inline void with_block(int64_t tb, Body&& body) {
    if constexpr (TB > 1) {
        if (tb < TB) return with_block<TB - 1>(tb, body);
    }
    body(std::integral_constant<int, TB>{});
}

// Run `body(t0, block)` over the tokens in blocks of MAX_TB, `block` the block's size as a
// std::integral_constant (for a template instance; a decode step is one block of 1).
template <typename Body>
void for_token_blocks(int64_t T, Body body) {
    for (int64_t t0 = 0; t0 < T; t0 += MAX_TB)
        with_block(std::min<int64_t>(MAX_TB, T - t0), [&](auto block) { body(t0, block); });
}

// Each token's sums of x over each group of `group` inputs (the int4 kernels' minimum term),
// in float32 over the values as `load` reads them: xsum [T, K / group]. Input k of a group goes
// into running sum k % 16, and the 16 are then added pairwise (8 + 8, 4 + 4, 2 + 2, 1 + 1): a
// fixed order (a token's sums are the same bits in a step of any size) of independent lanes,
// which the compiler vectorizes. One running sum was a chain of `group` dependent adds: ~2.5%
// of a batch-1 int4 step on Zen 5, run by the calling thread while the others waited.
template <typename X, typename Load>
inline void group_sums(const X* x, int64_t T, int64_t K, int64_t group, float* xsum, Load load) {
    const int64_t groups = K / group;
    for (int64_t t = 0; t < T; ++t)
        for (int64_t g = 0; g < groups; ++g) {
            const X* xg = x + t * K + g * group;
            float acc[16] = {};
            int64_t k = 0;
            for (; k + 16 <= group; k += 16)
                for (int l = 0; l < 16; ++l) acc[l] += load(xg[k + l]);
            for (int l = 0; k + l < group; ++l) acc[l] += load(xg[k + l]);
            for (int half = 8; half > 0; half /= 2)
                for (int l = 0; l < half; ++l) acc[l] += acc[l + half];
            xsum[t * groups + g] = acc[0];
        }
}

inline float f16_to_f32(uint16_t h) {  // IEEE half -> float, subnormals included
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu;
    float mag;
    if (exp == 0) mag = std::ldexp(static_cast<float>(mant), -24);
    else if (exp == 31) mag = mant ? NAN : INFINITY;
    else mag = std::ldexp(static_cast<float>(mant | 0x400u), static_cast<int>(exp) - 25);
    uint32_t u;
    std::memcpy(&u, &mag, 4);
    u |= sign;
    std::memcpy(&mag, &u, 4);
    return mag;
}

// int4 scales and minimums: float16 (made at load, Q4_0/Q4_1) or float32 (GGUF's K-quants)
inline float scale_value(uint16_t h) { return f16_to_f32(h); }
inline float scale_value(float f) { return f; }

// The end of a panel for one token: its 16 sums plus the bias, stored (rows below n_out only).
inline void store_biased(const float* acc, const float* bias, float* out_row, int64_t p,
                         int64_t n_out) {
    float vals[PANEL];
    for (int l = 0; l < PANEL; ++l) vals[l] = acc[l] + (bias ? bias[p * PANEL + l] : 0.0f);
    store_rows(out_row, vals, p, n_out);
}

#if defined(__AVX512F__)
inline __m512 load_i8x16(const int8_t* p) {
    return _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

inline __m512 load_scale16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load_scale16(const float* p) { return _mm512_loadu_ps(p); }

inline void store_biased(__m512 acc, const float* bias, float* out_row, int64_t p,
                         int64_t n_out) {
    const __m512 b = bias ? _mm512_loadu_ps(bias + p * PANEL) : _mm512_setzero_ps();
    alignas(64) float vals[PANEL];
    _mm512_store_ps(vals, _mm512_add_ps(acc, b));
    store_rows(out_row, vals, p, n_out);
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
inline __m256 load_i8x8(const int8_t* p) {
    return _mm256_cvtepi32_ps(
        _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// acc: the panel's two 8-lane halves.
inline void store_biased(const __m256* acc, const float* bias, float* out_row, int64_t p,
                         int64_t n_out) {
    alignas(32) float vals[PANEL];
    for (int h = 0; h < 2; ++h) {
        const __m256 b = bias ? _mm256_loadu_ps(bias + p * PANEL + 8 * h) : _mm256_setzero_ps();
        _mm256_store_ps(vals + 8 * h, _mm256_add_ps(acc[h], b));
    }
    store_rows(out_row, vals, p, n_out);
}
#endif

#if defined(__AVX2__) && defined(__F16C__)  // every AVX-512 CPU has both: the 8-lane loops need it
inline __m256 load_scale8(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load_scale8(const float* p) { return _mm256_loadu_ps(p); }
#endif

}  // namespace
