// The value half of attend512 (cpu_attend512.h): a chunk's values added into each row's
// accumulator, weighted by the row's probabilities, float32 values or bf16 pairs
// (vdpbf16ps), one row at a time or three rows over the same keys.
#pragma once

#if defined(__AVX512F__)

#include <immintrin.h>

#include <cstdint>

namespace {

// acc += sum_j p[j] v[j] over the C 16-wide chunks of a row (D = 16 C), all chunks at once
// and even and odd keys in separate sums: 2C independent chains (one chain a chunk waited on
// the instruction's latency). vb: [n][D] float32 values.
template <int C>
inline void add_values(float* ar, const float* vb, const float* p, int n) {
    __m512 a[C], b[C];
    for (int c = 0; c < C; ++c) {
        a[c] = _mm512_loadu_ps(ar + c * 16);
        b[c] = _mm512_setzero_ps();
    }
    int j = 0;
    for (; j + 2 <= n; j += 2) {
        const __m512 p0 = _mm512_set1_ps(p[j]), p1 = _mm512_set1_ps(p[j + 1]);
        for (int c = 0; c < C; ++c) {
            a[c] = _mm512_fmadd_ps(p0, _mm512_loadu_ps(vb + (j * C + c) * 16), a[c]);
            b[c] = _mm512_fmadd_ps(p1, _mm512_loadu_ps(vb + ((j + 1) * C + c) * 16), b[c]);
        }
    }
    if (j < n)
        for (int c = 0; c < C; ++c)
            a[c] = _mm512_fmadd_ps(_mm512_set1_ps(p[j]), _mm512_loadu_ps(vb + (j * C + c) * 16),
                                   a[c]);
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(ar + c * 16, _mm512_add_ps(a[c], b[c]));
}

// acc += sum_j p[j] v[j] over bf16 values interleaved by key pairs (vi: [pairs][words] words)
// and probabilities rounded to bf16 pairs (pp), for R rows over the same keys, CW words (16
// dims each) from word c0: even and odd pairs in separate sums (two chains a word), each word
// of values loaded once for the R rows. A row's sums are the same for any R and any split of
// its words into passes: the same bits alone (R = 1) as three at a time. Called only where
// kPairsFor holds (AVX512-BF16).
template <int R, int CW>
inline void add_pairs_rows(float* const* ar, const __m512i* vi, int words, int c0,
                           const uint32_t* const* pp, int pairs) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    __m512 a[R][CW], b[R][CW];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < CW; ++c) {
            a[r][c] = _mm512_loadu_ps(ar[r] + (c0 + c) * 16);
            b[r][c] = _mm512_setzero_ps();
        }
    int jp = 0;
    for (; jp + 2 <= pairs; jp += 2) {
        __m512bh v[CW];
        for (int c = 0; c < CW; ++c) v[c] = (__m512bh)_mm512_loadu_si512(vi + jp * words + c0 + c);
        for (int r = 0; r < R; ++r) {
            const __m512bh p0 = (__m512bh)_mm512_set1_epi32(static_cast<int>(pp[r][jp]));
            for (int c = 0; c < CW; ++c) a[r][c] = _mm512_dpbf16_ps(a[r][c], v[c], p0);
        }
        for (int c = 0; c < CW; ++c)
            v[c] = (__m512bh)_mm512_loadu_si512(vi + (jp + 1) * words + c0 + c);
        for (int r = 0; r < R; ++r) {
            const __m512bh p1 = (__m512bh)_mm512_set1_epi32(static_cast<int>(pp[r][jp + 1]));
            for (int c = 0; c < CW; ++c) b[r][c] = _mm512_dpbf16_ps(b[r][c], v[c], p1);
        }
    }
    if (jp < pairs) {
        __m512bh v[CW];
        for (int c = 0; c < CW; ++c) v[c] = (__m512bh)_mm512_loadu_si512(vi + jp * words + c0 + c);
        for (int r = 0; r < R; ++r) {
            const __m512bh p0 = (__m512bh)_mm512_set1_epi32(static_cast<int>(pp[r][jp]));
            for (int c = 0; c < CW; ++c) a[r][c] = _mm512_dpbf16_ps(a[r][c], v[c], p0);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < CW; ++c)
            _mm512_storeu_ps(ar[r] + (c0 + c) * 16, _mm512_add_ps(a[r][c], b[r][c]));
#else
    (void)ar, (void)vi, (void)words, (void)c0, (void)pp, (void)pairs;
#endif
}

}  // namespace

#endif  // __AVX512F__
