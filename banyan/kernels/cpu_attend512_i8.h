// An int8 KV pool's scores on VNNI (vpdpbusd), for attend512 (cpu_attend512.h): each query
// row as int8 codes with one scale (q ~ code x qs, codes = round(q x 127 / max|q|)), each key
// row's codes as they are in the pool, their products summed in int32.
//
// Why: the bf16 route made every key's 64 codes bf16 first (eight instructions and two stores
// a key) and then paired them with the bf16 query, two vdpbf16ps and a tree of sums a row and
// key; on Zen 4 a 64 x 256 decode over an int8 pool took 1.03-1.16x a bf16 pool's time for
// half its bytes. Here a block's 16 key rows are transposed once (lane j of word i = dims 4i
// .. 4i + 3 of key j), and each row takes one vpdpbusd per four dims for all 16 keys, with no
// tree: integer sums are exact in any order, so a row's scores are the same bits alone, among
// other rows or in a speculative check. The query's rounding to int8 (at most half a step of
// max|q| / 127 a dim, the error llama.cpp's q8_0 caches take too) is the only change from the
// bf16 route; perplexity with the int8 cache is measured in benchmarks/kv_quant.py.
//
// vpdpbusd multiplies unsigned by signed bytes: the keys go in as code + 128 (their top bit
// flipped), and 128 x sum(query codes) comes off each sum.
#pragma once

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define BANYAN_I8_SCORES 1

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "cpu_attend.h"
#include "cpu_avx512.h"

namespace {

// Rows [0, rows) of a call's bf16 queries (d values each, d % 16 == 0) -> sc.qi8 codes,
// sc.qsc scales, sc.qsum the codes' sums.
inline void quantize_query_rows(Scratch& sc, const uint16_t* qraw, int rows, int d) {
    sc.qi8.resize(static_cast<size_t>(rows) * d);
    sc.qsc.resize(rows);
    sc.qsum.resize(rows);
    const __m512 sign = _mm512_set1_ps(-0.0f);
    auto load = [](const uint16_t* p) {  // 16 bf16 -> float32, exactly
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
    };
    for (int r = 0; r < rows; ++r) {
        const uint16_t* q = qraw + static_cast<size_t>(r) * d;
        __m512 top = _mm512_setzero_ps();
        for (int e = 0; e < d; e += 16) top = _mm512_max_ps(top, _mm512_andnot_ps(sign, load(q + e)));
        const float mx = _mm512_reduce_max_ps(top);
        const __m512 inv = _mm512_set1_ps(mx > 0.0f ? 127.0f / mx : 0.0f);
        __m512i sum = _mm512_setzero_si512();
        int8_t* codes = sc.qi8.data() + static_cast<size_t>(r) * d;
        for (int e = 0; e < d; e += 16) {  // (round to nearest even, clamped to +-127)
            const __m512i c = _mm512_max_epi32(
                _mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(load(q + e), inv)),
                                 _mm512_set1_epi32(127)),
                _mm512_set1_epi32(-127));
            sum = _mm512_add_epi32(sum, c);
            _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + e), _mm512_cvtepi32_epi8(c));
        }
        sc.qsc[r] = mx / 127.0f;
        sc.qsum[r] = _mm512_reduce_add_epi32(sum);
    }
}

// Rows [r, r + NR): their raw scores against the block's 16 transposed keys kt ([d / 4]
// words), times each row's query scale and each key's scale (ks), into s[row * CHUNK + j].
template <int NR>
inline void rows_i8(const Scratch& sc, const __m512i* kt, __m512 ks, int r, int d, float* s) {
    __m512i a[NR][2];
    for (int t = 0; t < NR; ++t) a[t][0] = a[t][1] = _mm512_setzero_si512();
    const int8_t* q = sc.qi8.data() + static_cast<size_t>(r) * d;
    for (int i = 0; i < d / 4; i += 2) {  // two sums a row: half the chain's latency
        const __m512i k0 = _mm512_loadu_si512(kt + i), k1 = _mm512_loadu_si512(kt + i + 1);
        for (int t = 0; t < NR; ++t) {
            int32_t w[2];
            std::memcpy(w, q + static_cast<size_t>(t) * d + 4 * i, 8);
            a[t][0] = _mm512_dpbusd_epi32(a[t][0], k0, _mm512_set1_epi32(w[0]));
            a[t][1] = _mm512_dpbusd_epi32(a[t][1], k1, _mm512_set1_epi32(w[1]));
        }
    }
    for (int t = 0; t < NR; ++t) {
        const __m512i dot = _mm512_sub_epi32(_mm512_add_epi32(a[t][0], a[t][1]),
                                             _mm512_set1_epi32(128 * sc.qsum[r + t]));
        _mm512_storeu_ps(s + static_cast<size_t>(r + t) * CHUNK,
                         _mm512_mul_ps(_mm512_cvtepi32_ps(dot),
                                       _mm512_mul_ps(ks, _mm512_set1_ps(sc.qsc[r + t]))));
    }
}

// Rows [lo, rows) against the 16 int8 key rows kr with their scales ks (d % 64 == 0; the
// block at j0 of the chunk): s[r * CHUNK + j0 + j], as block_scores and the keys' scales give a
// bf16 pool's.
inline void block_scores_i8(Scratch& sc, int lo, int rows, const int8_t* const* kr,
                            const float* ks, int d, int j0) {
    __m512i* kt = reinterpret_cast<__m512i*>(sc.kt.data());
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));  // code + 128, unsigned
    for (int w0 = 0; w0 < d / 4; w0 += 16) {
        __m512i r[16];
        for (int j = 0; j < 16; ++j)
            r[j] = _mm512_xor_si512(_mm512_loadu_si512(kr[j] + 4 * w0), flip);
        transpose16(r);
        for (int i = 0; i < 16; ++i) _mm512_storeu_si512(kt + w0 + i, r[i]);
    }
    float* s = sc.s.data() + j0;
    const __m512 kv = _mm512_loadu_ps(ks);
    int r = lo;
    for (; r + 4 <= rows; r += 4) rows_i8<4>(sc, kt, kv, r, d, s);
    for (; r < rows; ++r) rows_i8<1>(sc, kt, kv, r, d, s);
}

}  // namespace

#endif
