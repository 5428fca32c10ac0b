// An int8 KV pool's attention in integers on VNNI (vpdpbusd), for attend512 (cpu_attend512.h):
// each query row as int8 codes with one scale (q ~ code x qs, codes = round(q x 127 /
// max|q|)), each key row's codes as they are in the pool, their products summed in int32; the
// values likewise (below).
//
// Why: the bf16 route made every key's 64 codes bf16 first (eight instructions and two stores
// a key) and then paired them with the bf16 query, two vdpbf16ps and a tree of sums a row and
// key; on Zen 4 a 64 x 256 decode over an int8 pool took 1.03-1.16x a bf16 pool's time for
// half its bytes. Here a block's 16 key rows are transposed once (lane j of word i = dims 4i
// .. 4i + 3 of key j), and each row takes one vpdpbusd per four dims for all 16 keys, with no
// tree: integer sums are exact in any order, so a row's scores are the same bits alone, among
// other rows or in a speculative check. The query's rounding to int8 (at most half a step of
// max|q| / 127 a dim, as llama.cpp's q8_0 caches round their queries) and the probabilities'
// to 8 bits are the only changes from the bf16 route (perplexity of a bf16 model with the int8
// cache, every token through this kernel: within 0.3% of that route's, docs/performance.md).
//
// vpdpbusd multiplies unsigned by signed bytes: the keys go in as code + 128 (their top bit
// flipped), and 128 x sum(query codes) comes off each sum.
//
// The values likewise: each row's probabilities of a chunk, times their value rows' scales, as
// unsigned 8-bit codes with one scale (the largest / 255), against the value codes in fours of
// keys (one vpdpbusd takes 4 keys of 16 dims; vdpbf16ps took 2, after each code was made bf16
// and paired), summed in int32 over the chunk and added to the row's float32 accumulator.
#pragma once

#include <cstdint>

#include "cpu_attend.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define BANYAN_I8_ATTENTION 1

#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "cpu_avx512.h"

namespace {

// Rows [0, rows) of a call's bf16 queries (d values each, d % 16 == 0) -> sc.qi8 codes,
// sc.qsc scales, sc.qsum the codes' sums; the rows' probability codes sized.
inline void quantize_query_rows(Scratch& sc, const uint16_t* qraw, int rows, int d) {
    sc.qi8.resize(static_cast<size_t>(rows) * d);
    sc.qsc.resize(rows);
    sc.qsum.resize(rows);
    sc.pc.resize(static_cast<size_t>(rows) * CHUNK);
    sc.psc.resize(rows);
    const __m512 sign = _mm512_set1_ps(-0.0f);
    for (int r = 0; r < rows; ++r) {
        const uint16_t* q = qraw + static_cast<size_t>(r) * d;
        __m512 top = _mm512_setzero_ps();
        for (int e = 0; e < d; e += 16)
            top = _mm512_max_ps(top, _mm512_andnot_ps(sign, load16(q + e)));
        const float mx = _mm512_reduce_max_ps(top);
        const __m512 inv = _mm512_set1_ps(mx > 0.0f ? 127.0f / mx : 0.0f);
        __m512i sum = _mm512_setzero_si512();
        int8_t* codes = sc.qi8.data() + static_cast<size_t>(r) * d;
        for (int e = 0; e < d; e += 16) {  // (round to nearest even, clamped to +-127)
            const __m512i c = _mm512_max_epi32(
                _mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(load16(q + e), inv)),
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

// Row r's probabilities of the chunk (sr: float32, 0 past the keys it sees, up to `blocks`
// blocks of 16) times the value rows' scales (sc.vsc; the products left in sr) -> sc.pc[r]
// codes 0..255, sc.psc[r] the scale: the largest / 255.
inline void probability_codes(Scratch& sc, int r, float* sr, int blocks) {
    __m512 top = _mm512_setzero_ps();
    for (int v = 0; v < blocks; ++v) {
        const __m512 p = _mm512_mul_ps(_mm512_loadu_ps(sr + v * VBLK),
                                       _mm512_loadu_ps(sc.vsc.data() + v * VBLK));
        _mm512_storeu_ps(sr + v * VBLK, p);
        top = _mm512_max_ps(top, p);
    }
    const float mx = _mm512_reduce_max_ps(top);
    const __m512 inv = _mm512_set1_ps(mx > 0.0f ? 255.0f / mx : 0.0f);
    uint8_t* pc = sc.pc.data() + static_cast<size_t>(r) * CHUNK;
    for (int v = 0; v < blocks; ++v)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(pc + v * VBLK),
                         _mm512_cvtusepi32_epi8(_mm512_cvtps_epi32(
                             _mm512_mul_ps(_mm512_loadu_ps(sr + v * VBLK), inv))));
    sc.psc[r] = mx / 255.0f;
}

// The chunk's value codes (slots cs[0, cn) of KV head h; d % 64 == 0) in fours of keys into
// sc.vb, [quad][d / 16] words: word w of 64-dim block c, lane 4L + i = dim 64c + 16L + 4w + i,
// its 4 bytes keys 4q .. 4q + 3 (past cn the last key again: its probability code is 0).
inline const __m512i* interleave_values_i8(Scratch& sc, const int8_t* vpool, const int32_t* cs,
                                           int cn, int64_t kvh, int64_t h, int d) {
    __m512i* vi = reinterpret_cast<__m512i*>(sc.vb.data());
    const int words = d / 16;
    for (int q = 0; q < (cn + 3) / 4; ++q) {
        if (q % (VBLK / 4) == 0) {
            sc.ahead.issue();
            prefetch_rows(vpool, cs, 4 * q + 2 * VBLK, std::min(cn, 4 * q + 3 * VBLK), kvh, h,
                          d);
        }
        const int8_t* v[4];
        for (int i = 0; i < 4; ++i)
            v[i] = vpool + (static_cast<int64_t>(cs[std::min(4 * q + i, cn - 1)]) * kvh + h) * d;
        for (int c = 0; c < d / 64; ++c) {
            const __m512i v0 = _mm512_loadu_si512(v[0] + 64 * c),
                          v1 = _mm512_loadu_si512(v[1] + 64 * c),
                          v2 = _mm512_loadu_si512(v[2] + 64 * c),
                          v3 = _mm512_loadu_si512(v[3] + 64 * c);
            const __m512i a = _mm512_unpacklo_epi8(v0, v1), b = _mm512_unpackhi_epi8(v0, v1),
                          e = _mm512_unpacklo_epi8(v2, v3), f = _mm512_unpackhi_epi8(v2, v3);
            __m512i* out = vi + q * words + 4 * c;
            _mm512_storeu_si512(out, _mm512_unpacklo_epi16(a, e));
            _mm512_storeu_si512(out + 1, _mm512_unpackhi_epi16(a, e));
            _mm512_storeu_si512(out + 2, _mm512_unpacklo_epi16(b, f));
            _mm512_storeu_si512(out + 3, _mm512_unpackhi_epi16(b, f));
        }
    }
    return vi;
}

// Rows [r, r + NR) (scratch rows; accumulators at r0 + r): their probability codes' `quads`
// fours of keys times the interleaved values vi, per 64-dim block in int32 (S sums a row and
// word over alternate quads: more chains in flight for a lone row; exact either way), then
// the words' lanes put back in dim order (a 4 x 4 transpose of 128-bit lanes) and added to
// the rows' accumulators times their scales.
template <int NR, int S>
inline void add_rows_i8(Scratch& sc, const __m512i* vi, int r0, int r, int d, int quads) {
    const int words = d / 16;
    for (int c = 0; c < d / 64; ++c) {
        __m512i a[NR][4][S];
        for (int t = 0; t < NR; ++t)
            for (int w = 0; w < 4; ++w)
                for (int u = 0; u < S; ++u) a[t][w][u] = _mm512_setzero_si512();
        for (int q = 0; q < quads; q += S) {
            for (int u = 0; u < S && q + u < quads; ++u) {
                const __m512i* x = vi + (q + u) * words + 4 * c;
                const __m512i x0 = _mm512_loadu_si512(x), x1 = _mm512_loadu_si512(x + 1),
                              x2 = _mm512_loadu_si512(x + 2), x3 = _mm512_loadu_si512(x + 3);
                for (int t = 0; t < NR; ++t) {
                    int32_t p4;
                    std::memcpy(&p4, sc.pc.data() + static_cast<size_t>(r + t) * CHUNK +
                                         4 * (q + u), 4);
                    const __m512i p = _mm512_set1_epi32(p4);
                    a[t][0][u] = _mm512_dpbusd_epi32(a[t][0][u], p, x0);
                    a[t][1][u] = _mm512_dpbusd_epi32(a[t][1][u], p, x1);
                    a[t][2][u] = _mm512_dpbusd_epi32(a[t][2][u], p, x2);
                    a[t][3][u] = _mm512_dpbusd_epi32(a[t][3][u], p, x3);
                }
            }
        }
        for (int t = 0; t < NR; ++t) {
            __m512i w[4];
            for (int k = 0; k < 4; ++k) {
                w[k] = a[t][k][0];
                for (int u = 1; u < S; ++u) w[k] = _mm512_add_epi32(w[k], a[t][k][u]);
            }
            const __m512i t0 = _mm512_shuffle_i32x4(w[0], w[1], 0x44),
                          t1 = _mm512_shuffle_i32x4(w[2], w[3], 0x44),
                          t2 = _mm512_shuffle_i32x4(w[0], w[1], 0xee),
                          t3 = _mm512_shuffle_i32x4(w[2], w[3], 0xee);
            const __m512i dims[4] = {_mm512_shuffle_i32x4(t0, t1, 0x88),
                                     _mm512_shuffle_i32x4(t0, t1, 0xdd),
                                     _mm512_shuffle_i32x4(t2, t3, 0x88),
                                     _mm512_shuffle_i32x4(t2, t3, 0xdd)};
            const __m512 ps = _mm512_set1_ps(sc.psc[r + t]);
            float* ar = sc.acc.data() + static_cast<size_t>(r0 + r + t) * d + 64 * c;
            for (int n = 0; n < 4; ++n)
                _mm512_storeu_ps(ar + 16 * n, _mm512_fmadd_ps(_mm512_cvtepi32_ps(dims[n]), ps,
                                                              _mm512_loadu_ps(ar + 16 * n)));
        }
    }
}

// Step 3 of attend512 over an int8 pool: the chunk's values (slots cs[0, cn) of KV head h)
// into the accumulators of rows [0, rows) (at r0) by their probability codes, three rows at a
// time while they see the same keys, else one by one: each row's sums the same either way.
inline void add_values_i8(Scratch& sc, const int8_t* vpool, const int32_t* cs, int cn,
                          int64_t kvh, int64_t h, int d, int r0, int rows) {
    const __m512i* vi = interleave_values_i8(sc, vpool, cs, cn, kvh, h, d);
    int r = 0;
    while (r < rows && sc.vis[r] == 0) ++r;
    for (; r + 3 <= rows && sc.vis[r + 1] == sc.vis[r] && sc.vis[r + 2] == sc.vis[r]; r += 3)
        add_rows_i8<3, 1>(sc, vi, r0, r, d, (sc.vis[r] + 3) / 4);
    for (; r < rows; ++r)
        if (sc.vis[r] != 0) add_rows_i8<1, 2>(sc, vi, r0, r, d, (sc.vis[r] + 3) / 4);
}

}  // namespace

#else
namespace {
// Never called: attend512 names them in `if constexpr` branches that a build without VNNI
// discards.
inline void quantize_query_rows(Scratch&, const uint16_t*, int, int) {}
inline void block_scores_i8(Scratch&, int, int, const int8_t* const*, const float*, int, int) {}
inline void probability_codes(Scratch&, int, float*, int) {}
inline void add_values_i8(Scratch&, const int8_t*, const int32_t*, int, int64_t, int64_t, int,
                          int, int) {}
}  // namespace
#endif
