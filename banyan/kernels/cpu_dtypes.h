// Element types of the CPU kernels (float32, bfloat16 as raw uint16; the quantized KV cache's
// int8 and fp8 codes) and a scalar exp, shared by the attention and element-wise sources.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if (defined(__AVX2__) && defined(__F16C__)) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

inline float bf16_to_f32(uint16_t x) {
    uint32_t u = static_cast<uint32_t>(x) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even, like torch
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<uint16_t>(u >> 16);
}

#if defined(__AVX512F__)
// f32_to_bf16 of 16 values, each in the low half of its 32-bit lane (vpmovdw packs them).
inline __m512i f32_to_bf16_16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(
        _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
    return _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
}
#endif

struct F32 {
    using T = float;
    static float load(T x) { return x; }
    static T store(float x) { return x; }
    static float round(float x) { return x; }  // a float32 tensor op's result
    static constexpr bool kScaled = false;
};

struct BF16 {
    using T = uint16_t;
    static float load(T x) { return bf16_to_f32(x); }
    static T store(float x) { return f32_to_bf16(x); }
    static float round(float x) { return bf16_to_f32(f32_to_bf16(x)); }  // a bf16 op's result
    static constexpr bool kScaled = false;
};

// Quantized KV codes: a row's value is load(code) x its (slot, head) scale (mem/kv_pool.py).
struct I8 {
    using T = int8_t;
    static float load(T x) { return static_cast<float>(x); }
    static constexpr bool kScaled = true;
};

// The scale of row `row` of a quantized pool: its own, or 1 where the pool keeps one scale for
// every row (scales null: `--kv-cache-dtype fp8`, vLLM's per-tensor layout with scale 1).
inline float row_scale(const float* scales, int64_t row) {
    return scales != nullptr ? scales[row] : 1.0f;
}

// fp8 as torch's float8_e4m3fn (bias 7) and float8_e5m2 (bias 15), decoded with integer and
// float arithmetic that vectorises (a table lookup measured 1.8x slower than bf16 attention):
// a normal code's exponent and mantissa bits move into float32's fields with the bias
// adjusted; a subnormal one (exponent 0) is its mantissa times 2^(1 - bias - mantissa bits),
// computed from an integer so no float32 denormal is ever touched. The codes the pool holds
// are finite (quantize_rows scales into range), so infinities and NaN need no case.
template <int kMant, int kBias>
inline float fp8_decode(uint8_t code) {
    const uint32_t mag = code & 0x7fu;
    const uint32_t bits = (mag << (23 - kMant)) + (static_cast<uint32_t>(127 - kBias) << 23);
    float normal;
    std::memcpy(&normal, &bits, 4);
    const float sub = static_cast<float>(static_cast<int32_t>(mag)) *
                      (1.0f / static_cast<float>(1u << (kBias + kMant - 1)));
    const float v = (mag >> kMant) == 0 ? sub : normal;
    return (code & 0x80u) ? -v : v;
}

struct E4M3 {
    using T = uint8_t;
    static float load(T x) { return fp8_decode<3, 7>(x); }
    static constexpr bool kScaled = true;
};

struct E5M2 {
    using T = uint8_t;
    static float load(T x) { return fp8_decode<2, 15>(x); }
    static constexpr bool kScaled = true;
};

#if defined(__AVX2__) && defined(__F16C__)
// A row of d fp8 codes (d % 16 == 0) times `scale` -> float32, through half precision: an e5m2
// code is a half's top byte; an e4m3 code's sign, exponent and mantissa land in a half's
// fields by a shift, its bias (7 against 15) a factor 2^8 folded into the scale. Every code
// is a half exactly and the factor is a power of two, so the floats equal fp8_decode's x scale
// bit for bit; 16 codes take 6 instructions where fp8_decode's selects take ~4 per 8.
template <typename K>
inline void fp8_row_to_f32(const uint8_t* src, float scale, int d, float* dst) {
    constexpr bool kE5M2 = std::is_same<K, E5M2>::value;
    const __m256 s = _mm256_set1_ps(kE5M2 ? scale : scale * 256.0f);
    for (int e = 0; e < d; e += 16) {
        const __m256i w = _mm256_cvtepu8_epi16(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + e)));
        __m256i h;
        if constexpr (kE5M2) {
            h = _mm256_slli_epi16(w, 8);
        } else {
            h = _mm256_or_si256(
                _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8),
                _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7f)), 7));
        }
        _mm256_storeu_ps(dst + e, _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), s));
        _mm256_storeu_ps(dst + e + 8,
                         _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), s));
    }
}
#endif

// exp(x) for x in [-87, 88] (clamped outside), Cephes' expf: ~1 ulp, vectorisable.
inline float exp_clamped(float x) {
    x = std::min(std::max(x, -87.0f), 88.0f);
    float fx = std::floor(x * 1.44269504088896341f + 0.5f);
    float r = x - fx * 0.693359375f + fx * 2.12194440e-4f;
    float z = r * r;
    float y = 1.9875691500e-4f;
    y = y * r + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * z + r + 1.0f;
    int32_t bits = (static_cast<int32_t>(fx) + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, 4);
    return y * scale;
}

// exp(x) for x <= 0 (scores minus their running max).
inline float exp_nonpos(float x) { return exp_clamped(x); }

#if defined(__AVX2__) && defined(__F16C__)
// exp_clamped in 8 lanes, the same operations in the same order (no fused multiply-adds), so
// each lane equals exp_clamped of it bit for bit; NaN stays NaN as there.
inline __m256 exp256_clamped(__m256 x) {
    x = _mm256_min_ps(_mm256_set1_ps(88.0f), _mm256_max_ps(_mm256_set1_ps(-87.0f), x));
    const __m256 fx = _mm256_floor_ps(
        _mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                      _mm256_set1_ps(0.5f)));
    const __m256 r = _mm256_add_ps(
        _mm256_sub_ps(x, _mm256_mul_ps(fx, _mm256_set1_ps(0.693359375f))),
        _mm256_mul_ps(fx, _mm256_set1_ps(2.12194440e-4f)));
    const __m256 z = _mm256_mul_ps(r, r);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f,
                          1.6666665459e-1f, 5.0000001201e-1f})
        y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(c));
    y = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(y, z), r), _mm256_set1_ps(1.0f));
    const __m256i bits = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}
#endif

}  // namespace
