// AVX-512 helpers of cpu_paged_attention.cpp: a vectorised exp, bf16/float loads, a 16-way
// transpose-and-add, partial dot products, and the bf16 pair-interleave tables; a 16 x 16
// transpose of 32-bit words (the attention's keys, the bf16 GEMM's plain weights); and a
// quantized pool's codes as bf16 (both attention kernels).
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

#include <cstdint>
#include <type_traits>

#include "cpu_dtypes.h"

namespace {

// exp(x) for x in [-87, 88] (clamped outside); the same polynomial as exp_clamped.
inline __m512 exp512(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    __m512 fx = _mm512_roundscale_ps(
        _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 z = _mm512_mul_ps(r, r);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(y, z, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    __m512i bits = _mm512_slli_epi32(
        _mm512_add_epi32(_mm512_cvttps_epi32(fx), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(y, _mm512_castsi512_ps(bits));
}

// 2^t as t's nearest integer n and its fraction f in [-0.5, 0.5]: 2^f by a polynomial in f
// (coefficients from the highest degree down, each step one fused multiply-add), times 2^n by
// one vscalefps. The two exp2s below differ only in their clamps and polynomial.
template <int N>
inline __m512 exp2_poly512(__m512 t, const float (&c)[N]) {
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 y = _mm512_set1_ps(c[0]);
    for (int k = 1; k < N; ++k) y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(c[k]));
    return _mm512_scalef_ps(y, n);
}

// 2^t for t <= 0 (t clamped to [-126, 0]: below, 2^-126 instead of ~0, as exp512's clamp at -87
// leaves ~1e-38): 2^f by a degree-5 polynomial (relative error under 2e-7, fitted to 2^f on
// [-0.5, 0.5]). Nine operations where exp512 takes seventeen (its reduction in natural
// logarithms, its power of two built by integer shifts): the attention's softmax calls it for
// every score (cpu_attend512.h).
inline __m512 exp2_nonpos512(__m512 t) {
    static constexpr float kDegree5[] = {1.3276429381e-3f, 9.6755335107e-3f, 5.5507134646e-2f,
                                         2.4022120237e-1f, 6.9314694405e-1f, 1.0000001192e+0f};
    t = _mm512_max_ps(_mm512_min_ps(t, _mm512_setzero_ps()), _mm512_set1_ps(-126.0f));
    return exp2_poly512(t, kDegree5);
}

// 2^t where the result is rounded to bf16 next (the softmaxes' probabilities that P V
// products take as bf16 pairs): a degree-3 polynomial for 2^f (relative error under 7.5e-5,
// 2^-13.7, well inside bf16's half unit of 2^-9; fitted to 2^f on [-0.5, 0.5]) and no clamps,
// six operations to exp2_nonpos512's nine (the softmax, not the tile products, bounds a
// prefill on AMX). t must be finite or its lane masked after: -inf gives NaN, not 0; a t far
// below -126 gives 0 through vscalefps; t above 0 (the tiles' lazy maxima) is as exact.
inline __m512 exp2_bf16_512(__m512 t) {
    static constexpr float kDegree3[] = {5.5171515793e-2f, 2.4261076748e-1f, 6.9326096773e-1f,
                                         9.9992811680e-1f};
    return exp2_poly512(t, kDegree3);
}

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
    __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}


// Lane j of the result = the sum of v[j]'s 16 lanes: a transpose-and-add tree, ~3 operations
// per vector instead of a full horizontal reduction each.
inline __m512 reduce16(__m512* v) {
    __m512 t[8], u[4], w[2];
    for (int k = 0; k < 8; ++k)
        t[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]),
                             _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
    for (int k = 0; k < 4; ++k) {
        __m512d a = _mm512_castps_pd(t[2 * k]), b = _mm512_castps_pd(t[2 * k + 1]);
        u[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    for (int k = 0; k < 2; ++k)
        w[k] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * k], u[2 * k + 1], 0x88),
                             _mm512_shuffle_f32x4(u[2 * k], u[2 * k + 1], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88),
                         _mm512_shuffle_f32x4(w[0], w[1], 0xdd));
}

// 16 lanes of partial products of q and k (d % 32 == 0); q in the pool's dtype.
inline __m512 dot_partial(const float* q, const float* k, int d) {
    __m512 acc = _mm512_mul_ps(load16(q), load16(k));
    for (int e = 16; e < d; e += 16) acc = _mm512_fmadd_ps(load16(q + e), load16(k + e), acc);
    return acc;
}
inline __m512 dot_partial(const uint16_t* q, const uint16_t* k, int d) {
#if defined(__AVX512BF16__)
    __m512 acc = _mm512_setzero_ps();
    for (int e = 0; e < d; e += 32)
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(q + e),
                               (__m512bh)_mm512_loadu_si512(k + e));
    return acc;
#else
    __m512 acc = _mm512_mul_ps(load16(q), load16(k));
    for (int e = 16; e < d; e += 16) acc = _mm512_fmadd_ps(load16(q + e), load16(k + e), acc);
    return acc;
#endif
}

constexpr int VBLK = 16;

// part[j] = dot_partial(q, k[j], D) for the 16 keys of a block, q loaded into registers once.
template <int D, typename T>
inline void scores_fixed(const T* q, const T* const* k, __m512* part) {
    constexpr int W = D * static_cast<int>(sizeof(T)) / 64;  // 64-byte words per row
    __m512i qw[W];
    for (int w = 0; w < W; ++w) qw[w] = _mm512_loadu_si512(q + w * (64 / sizeof(T)));
    for (int j = 0; j < VBLK; ++j) {
        const T* kj = k[j];
        if constexpr (sizeof(T) == 2) {
#if defined(__AVX512BF16__)
            __m512 acc = _mm512_setzero_ps();
            for (int w = 0; w < W; ++w)
                acc = _mm512_dpbf16_ps(acc, (__m512bh)qw[w], (__m512bh)_mm512_loadu_si512(kj + w * 32));
            part[j] = acc;
#else
            part[j] = dot_partial(q, kj, D);
#endif
        } else {
            __m512 acc = _mm512_mul_ps(_mm512_castsi512_ps(qw[0]), _mm512_loadu_ps(kj));
            for (int w = 1; w < W; ++w)
                acc = _mm512_fmadd_ps(_mm512_castsi512_ps(qw[w]), _mm512_loadu_ps(kj + w * 16), acc);
            part[j] = acc;
        }
    }
}

// vpermt2w indices interleaving two rows of 32 bf16: (a[i], b[i]) for i < 16, then i >= 16.
alignas(64) constexpr uint16_t kPairLo[32] = {0,  32, 1,  33, 2,  34, 3,  35, 4,  36, 5,
                                              37, 6,  38, 7,  39, 8,  40, 9,  41, 10, 42,
                                              11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
alignas(64) constexpr uint16_t kPairHi[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53,
                                              22, 54, 23, 55, 24, 56, 25, 57, 26, 58, 27, 59,
                                              28, 60, 29, 61, 30, 62, 31, 63};
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
template <typename T>
constexpr bool kPairsFor = std::is_same<T, uint16_t>::value;
#else
template <typename T>
constexpr bool kPairsFor = false;
#endif

// r[i] <- the 16 lanes i of r[0..15] (a 16 x 16 transpose of 32-bit words). Always inline: once
// the int8 attention called it too, GCC made it a function of its own, its 16 registers passed
// through memory both ways (a bf16 pool's shared-prefix decode step 1.05-1.08x the time, Zen 4).
__attribute__((always_inline)) inline void transpose16(__m512i (&r)[16]) {
    __m512i t[16];
    for (int i = 0; i < 8; ++i) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) {
        r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int i = 0; i < 2; ++i)
        for (int k = 0; k < 4; ++k) {
            t[8 * i + k] = _mm512_shuffle_i32x4(r[8 * i + k], r[8 * i + 4 + k], 0x88);
            t[8 * i + 4 + k] = _mm512_shuffle_i32x4(r[8 * i + k], r[8 * i + 4 + k], 0xdd);
        }
    for (int k = 0; k < 8; ++k) {
        r[k] = _mm512_shuffle_i32x4(t[k], t[8 + k], 0x88);
        r[8 + k] = _mm512_shuffle_i32x4(t[k], t[8 + k], 0xdd);
    }
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// 16 lanes' values at inputs 2j and 2j + 1 (a weight's rows; a softmax's rows at two keys)
// -> 16 bf16 pairs, input 2j in each lane's low half (the order of a broadcast pair in memory):
// both rounded by one vcvtne2ps2bf16 (even in the low 16 words, odd in the high) and
// interleaved by one word permute, 2 instructions where rounding each and widening took 6.
inline __m512i pair_bf16(__m512 even, __m512 odd) {
    const __m512i interleave = _mm512_set_epi16(
        31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
        23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(odd, even));
}

// pair_bf16 of values exact in bf16 (integers of 8 bits or fewer: an int8 code): each float's
// top half is its bf16, so one two-source word permute interleaves them, with no rounding.
inline __m512i pair_exact_bf16(__m512 even, __m512 odd) {
    const __m512i tops = _mm512_set_epi16(
        63, 31, 61, 29, 59, 27, 57, 25, 55, 23, 53, 21, 51, 19, 49, 17,
        47, 15, 45, 13, 43, 11, 41, 9, 39, 7, 37, 5, 35, 3, 33, 1);
    return _mm512_permutex2var_epi16((__m512i)even, tops, (__m512i)odd);
}

// 32 codes of a quantized pool (cpu_dtypes.h: I8, E4M3, E5M2) -> 32 bf16, in order, exactly:
// int8 |code| <= 127; an fp8 code through half precision as fp8_row_to_f32 does it (e4m3 at
// 2^-8 of its value: code_unit). Every such value has at most 4 significant bits.
template <typename Codes>
inline __m512i codes_bf16x32(const typename Codes::T* p) {
    __m512 lo, hi;
    if constexpr (std::is_same<Codes, I8>::value) {
        lo = _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
        hi = _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
    } else {
        const __m512i w = _mm512_cvtepu8_epi16(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
        __m512i half;
        if constexpr (std::is_same<Codes, E5M2>::value) {
            half = _mm512_slli_epi16(w, 8);
        } else {
            half = _mm512_or_si512(
                _mm512_slli_epi16(_mm512_and_si512(w, _mm512_set1_epi16(0x80)), 8),
                _mm512_slli_epi16(_mm512_and_si512(w, _mm512_set1_epi16(0x7f)), 7));
        }
        lo = _mm512_cvtph_ps(_mm512_castsi512_si256(half));
        hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(half, 1));
    }
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}
#endif

// codes_bf16x32 as the kernels call it, once a call set up (`const CodesBf16<Codes> bf16;`,
// then `bf16(p)`): an fp8 code's bf16 from two 128-entry byte tables (low and high byte of each
// magnitude; the sign bit put back), built once from codes_bf16x32 itself and so its bits, with
// three byte permutes and one ternary-logic op for 32 codes where the half-precision route
// takes ten (AVX512-VBMI: Zen 4 and 5, Ice Lake and later Xeons). int8 codes, and fp8 without
// VBMI, take codes_bf16x32.
template <typename Codes>
struct CodesBf16 {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    __m512i operator()(const typename Codes::T* p) const { return codes_bf16x32<Codes>(p); }
#endif
};
template <>
struct CodesBf16<void> {};  // (an unquantized pool: nothing to convert)

#if defined(__AVX512VBMI__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
template <typename Fp8>
struct Fp8Bf16 {
    __m512i lo0, lo1, hi0, hi1;
    __m512i sign = _mm512_set1_epi8(static_cast<char>(0x80));
    // word i of the result: byte 2i the low byte of code i, byte 2i + 1 its high byte
    __m512i words = _mm512_set_epi8(
        95, 31, 94, 30, 93, 29, 92, 28, 91, 27, 90, 26, 89, 25, 88, 24,
        87, 23, 86, 22, 85, 21, 84, 20, 83, 19, 82, 18, 81, 17, 80, 16,
        79, 15, 78, 14, 77, 13, 76, 12, 75, 11, 74, 10, 73, 9, 72, 8,
        71, 7, 70, 6, 69, 5, 68, 4, 67, 3, 66, 2, 65, 1, 64, 0);

    Fp8Bf16() {
        static const Tables t = tables();
        lo0 = _mm512_loadu_si512(t.lo), lo1 = _mm512_loadu_si512(t.lo + 64);
        hi0 = _mm512_loadu_si512(t.hi), hi1 = _mm512_loadu_si512(t.hi + 64);
    }
    __m512i operator()(const uint8_t* p) const {
        const __m512i c = _mm512_castsi256_si512(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
        const __m512i lo = _mm512_permutex2var_epi8(lo0, c, lo1);  // (index bit 7 unread)
        // high byte | (code & 0x80)
        const __m512i hi =
            _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(hi0, c, hi1), c, sign, 0xF8);
        return _mm512_permutex2var_epi8(lo, words, hi);
    }

  private:
    struct Tables {
        alignas(64) uint8_t lo[128];
        alignas(64) uint8_t hi[128];
    };
    static Tables tables() {
        alignas(64) uint8_t codes[128];
        alignas(64) uint16_t bf16[128];
        for (int m = 0; m < 128; ++m) codes[m] = static_cast<uint8_t>(m);
        for (int i = 0; i < 128; i += 32)
            _mm512_storeu_si512(bf16 + i, codes_bf16x32<Fp8>(codes + i));
        Tables t;
        for (int m = 0; m < 128; ++m) {
            t.lo[m] = static_cast<uint8_t>(bf16[m] & 0xff);
            t.hi[m] = static_cast<uint8_t>(bf16[m] >> 8);
        }
        return t;
    }
};
template <>
struct CodesBf16<E4M3> : Fp8Bf16<E4M3> {};
template <>
struct CodesBf16<E5M2> : Fp8Bf16<E5M2> {};
#endif

// What one unit of codes_bf16x32's output is worth before the row's scale.
template <typename Codes>
constexpr float code_unit = std::is_same<Codes, E4M3>::value ? 256.0f : 1.0f;

}  // namespace

#endif  // __AVX512F__
