// The prefill kernel's path for bf16 queries over a bf16 pool (or int8 / fp8 codes: see
// attend_pairs) on CPUs with AVX512-BF16: the same work items, key blocks and online softmax as
// attend_block (cpu_prefill_attention.cpp), but both products run as vdpbf16ps over bf16 pairs
// instead of float32 FMAs over widened copies, half the instructions for the same
// multiply-adds:
//
//   S^T = K Q^T: Q^T as pairs of dims (qp [d/2][rp] words: row r's dims 2p, 2p + 1), each key
//   row's pair of dims broadcast; float32 sums, times the scale after (Q is not rounded again);
//   O = O x corr + P V: the probabilities rounded to bf16 in pairs of keys (pp [pairs][rp]),
//   as the row kernel's bf16 path and a bf16 matmul of P and V round them; V as pairs of keys
//   per dim (vp [pairs][d], interleaved once per block for all rows).
//
// Each row's arithmetic is the same whatever tile or work item it falls in (pairs in order,
// key blocks from 0): the bits do not depend on the thread count. Head dims that are a
// multiple of 32 only (two 16-lane words of pairs per 64 bytes); others take the float path.
#pragma once

#include "cpu_prefill_common.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define BANYAN_PREFILL_PAIRS 1

#include <immintrin.h>

#include "cpu_avx512.h"
#include "cpu_dtypes.h"

namespace {

constexpr int KP = 8;  // keys per score tile: 8 x 2 accumulators (32 rows)
constexpr int RP = 6;  // rows per P V tile: 6 x CV accumulators (CV <= 4 words of 16 dims)

inline bool pairs_fit(int64_t d) { return d % 32 == 0; }

// st[j][0, 32) = scale x kmul[j] x (key j . the 32 rows of qp), M keys of kb [.][d] (kmul:
// a quantized pool's key scales, or null for 1); kMax: and mx[0, 32) = max(mx, the scores).
template <int M, bool kMax>
inline void qk_pairs_tile(const uint16_t* kb, int64_t d, const uint32_t* qp, int64_t ldq,
                          float scale, const float* kmul, float* st, int64_t lds, float* mx) {
    __m512 acc[M][2];
    for (int j = 0; j < M; ++j) acc[j][0] = acc[j][1] = _mm512_setzero_ps();
    for (int64_t p = 0; p < d / 2; ++p) {
        const __m512bh q0 = (__m512bh)_mm512_loadu_si512(qp + p * ldq);
        const __m512bh q1 = (__m512bh)_mm512_loadu_si512(qp + p * ldq + 16);
        for (int j = 0; j < M; ++j) {
            int32_t w;
            std::memcpy(&w, kb + j * d + 2 * p, 4);
            const __m512bh kj = (__m512bh)_mm512_set1_epi32(w);
            acc[j][0] = _mm512_dpbf16_ps(acc[j][0], q0, kj);
            acc[j][1] = _mm512_dpbf16_ps(acc[j][1], q1, kj);
        }
    }
    const __m512 sv = _mm512_set1_ps(scale);
    __m512 m0 = _mm512_setzero_ps(), m1 = m0;
    if constexpr (kMax) m0 = _mm512_loadu_ps(mx), m1 = _mm512_loadu_ps(mx + 16);
    for (int j = 0; j < M; ++j) {
        const __m512 sj = kmul ? _mm512_mul_ps(sv, _mm512_set1_ps(kmul[j])) : sv;
        const __m512 s0 = _mm512_mul_ps(acc[j][0], sj), s1 = _mm512_mul_ps(acc[j][1], sj);
        _mm512_storeu_ps(st + j * lds, s0);
        _mm512_storeu_ps(st + j * lds + 16, s1);
        if constexpr (kMax) m0 = _mm512_max_ps(m0, s0), m1 = _mm512_max_ps(m1, s1);
    }
    if constexpr (kMax) _mm512_storeu_ps(mx, m0), _mm512_storeu_ps(mx + 16, m1);
}

// S^T for nk keys x 32 rows: tiles of KP keys, the last one of nk % KP.
template <bool kMax>
void qk_pairs_tiles(int64_t nk, const uint16_t* kb, int64_t d, const uint32_t* qp, int64_t ldq,
                    float scale, const float* kmul, float* st, int64_t lds, float* mx) {
    in_tiles<KP>(nk, [&](auto m, int64_t j0) {
        qk_pairs_tile<decltype(m)::value, kMax>(kb + j0 * d, d, qp, ldq, scale,
                                                kmul ? kmul + j0 : nullptr, st + j0 * lds, lds,
                                                mx);
    });
}

// softmax_block's update of rows [0, rp) for the pair path, each probability in one fused
// step from its score s and its row's new maximum m, 2^(s mul - m log2(e)) (mul: log2(e) for
// scores stored scaled, the scale x log2(e) for raw ones; exp2_bf16_512: six operations where
// exp_nonpos_fma takes seventeen, its error far below the bf16 rounding), written into pp as bf16
// pairs of keys, pp[q][r] = (bf16(p[2q][r] vmul[2q]), bf16(p[2q + 1][r] vmul[2q + 1])) (vmul:
// a quantized pool's value scales, as the row kernel applies them, or null for 1; a lone last
// key pairs with a probability of 0), with no float copy of them stored and read back. (A
// separate softmax and packing pass: ~20% of a 2,048-token prefill's attention on Zen 5.)
// kCausal (the diagonal blocks): keys past a row's limit get 0, whatever their scores; the
// caller merged the maxima of the keys each row sees first (mask_block, or the tiles' pass).
template <bool kCausal>
inline void softmax_pairs(Buffers& b, int64_t k0, int64_t nk, const float* vmul, float mul) {
    const int64_t rp = b.rp;
    const float* st = b.st.data();
    uint32_t* pp = b.pp.data();  // (b's members reloaded after every store otherwise)
    const __m512 smul = _mm512_set1_ps(mul);
    for (int64_t r = 0; r < rp; r += 16) {
        const __m512 off = _mm512_mul_ps(_mm512_loadu_ps(&b.corr[r]), _mm512_set1_ps(-kLog2e));
        const __m512i lim = _mm512_loadu_si512(&b.lim[r]);
        __m512 sum[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};  // even, odd keys
        auto prob = [&](int64_t j) {  // keys past a row's limit: 0 (their -inf: NaN there)
            __m512 p = exp2_bf16_512(_mm512_fmadd_ps(_mm512_loadu_ps(st + j * rp + r), smul,
                                                     off));
            if constexpr (kCausal)
                p = _mm512_maskz_mov_ps(
                    _mm512_cmplt_epi32_mask(_mm512_set1_epi32(static_cast<int32_t>(k0 + j)), lim),
                    p);
            sum[j % 2] = _mm512_add_ps(sum[j % 2], p);
            return vmul ? _mm512_mul_ps(p, _mm512_set1_ps(vmul[j])) : p;
        };
        for (int64_t q = 0; q < (nk + 1) / 2; ++q) {
            const __m512 pa = prob(2 * q);
            const __m512 pb = 2 * q + 1 < nk ? prob(2 * q + 1) : _mm512_setzero_ps();
            _mm512_storeu_si512(pp + q * rp + r, pair_bf16(pa, pb));
        }
        alignas(64) float sums[16];  // (two chains of adds: one waited on the other's latency)
        _mm512_store_ps(sums, _mm512_add_ps(sum[0], sum[1]));
        for (int i = 0; i < 16; ++i) move_max(b, r + i, sums[i]);
    }
}

// 32 values of a pool row as bf16: as they are, or a quantized pool's codes (Codes: I8, E4M3,
// E5M2), exact in bf16 (their scales are applied to the products).
template <typename Codes, typename P>
inline __m512i row_bf16x32(const P* p, const CodesBf16<Codes>& bf16) {
    if constexpr (std::is_same<Codes, void>::value)
        return _mm512_loadu_si512(p);
    else
        return bf16(p);
}

// The key rows of the block [k0, k0 + nk) of KV head h as bf16 (kb16 [nk][d]), a quantized
// pool's key and value scales (kmul, vmul; Codes void: not touched), and the next block's K and
// V rows requested meanwhile, into L2: a few dozen rows (a short chunk) do too little work a
// block to hide the loads of its slots, and a whole block requested at once into L1 was
// evicted before its turn (perf: half the time on the K loads). (A memcpy call a row cost
// more than the copy.)
template <typename Codes, typename P>
inline void key_block(Buffers& b, const P* kpool, const P* vpool, const float* kscale,
                      const float* vscale, const int32_t* slots, int64_t k0, int64_t nk,
                      int64_t kend, int64_t kvh, int64_t h, int64_t d, float* kmul, float* vmul) {
    const int64_t ahead = std::min<int64_t>(kend - k0 - nk, BK);
    const CodesBf16<Codes> bf16;
    for (int64_t j = 0; j < nk; ++j) {
        const int64_t row = static_cast<int64_t>(slots[k0 + j]) * kvh + h;
        const P* src = kpool + row * d;
        for (int64_t e = 0; e < d; e += 32)
            _mm512_storeu_si512(&b.kb16[j * d + e], row_bf16x32<Codes>(src + e, bf16));
        if constexpr (!std::is_same<Codes, void>::value) {
            kmul[j] = row_scale(kscale, row) * code_unit<Codes>;
            vmul[j] = row_scale(vscale, row) * code_unit<Codes>;
        }
        if (j < ahead) {
            const int64_t next = (static_cast<int64_t>(slots[k0 + nk + j]) * kvh + h) * d;
            const char* kn = reinterpret_cast<const char*>(kpool + next);
            const char* vn = reinterpret_cast<const char*>(vpool + next);
            for (int64_t off = 0; off < d * static_cast<int64_t>(sizeof(P)); off += 64) {
                _mm_prefetch(kn + off, _MM_HINT_T1);
                _mm_prefetch(vn + off, _MM_HINT_T1);
            }
        }
    }
}

// vp[q][x] = (V[2q][x], V[2q + 1][x]) for the nk keys of the block at k0 (a lone last key:
// zeros beside it), read from the pool rows of KV head h.
template <typename Codes, typename P>
inline void value_pairs(const P* vpool, const int32_t* slots, int64_t k0, int64_t nk,
                        int64_t kvh, int64_t h, int64_t d, uint32_t* vp) {
    const __m512i lo = _mm512_loadu_si512(kPairLo), hi = _mm512_loadu_si512(kPairHi);
    const CodesBf16<Codes> bf16;
    for (int64_t q = 0; q < (nk + 1) / 2; ++q) {
        const P* a = vpool + (static_cast<int64_t>(slots[k0 + 2 * q]) * kvh + h) * d;
        const bool lone = 2 * q + 1 >= nk;
        const P* b =
            lone ? a : vpool + (static_cast<int64_t>(slots[k0 + 2 * q + 1]) * kvh + h) * d;
        for (int64_t c = 0; c < d; c += 32) {
            const __m512i va = row_bf16x32<Codes>(a + c, bf16);
            const __m512i vb = lone ? _mm512_setzero_si512() : row_bf16x32<Codes>(b + c, bf16);
            _mm512_storeu_si512(vp + q * d + c, _mm512_permutex2var_epi16(va, lo, vb));
            _mm512_storeu_si512(vp + q * d + c + 16, _mm512_permutex2var_epi16(va, hi, vb));
        }
    }
}

// o[i][0, 16 CV) = o[i] x corr[i] + sum_q pp[q][i] . vp[q][0, 16 CV) for the M rows i.
template <int M, int CV>
inline void pv_pairs_tile(const uint32_t* pp, int64_t ldp, const uint32_t* vp, int64_t d,
                          int64_t pairs, const float* corr, float* o, int64_t ldo) {
    __m512 acc[M][CV];
    for (int i = 0; i < M; ++i) {
        const __m512 c = _mm512_set1_ps(corr[i]);
        for (int v = 0; v < CV; ++v)
            acc[i][v] = _mm512_mul_ps(_mm512_loadu_ps(o + i * ldo + 16 * v), c);
    }
    for (int64_t q = 0; q < pairs; ++q) {
        __m512bh vv[CV];
        for (int v = 0; v < CV; ++v) vv[v] = (__m512bh)_mm512_loadu_si512(vp + q * d + 16 * v);
        for (int i = 0; i < M; ++i) {
            const __m512bh pw = (__m512bh)_mm512_set1_epi32(static_cast<int>(pp[q * ldp + i]));
            for (int v = 0; v < CV; ++v) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], vv[v], pw);
        }
    }
    for (int i = 0; i < M; ++i)
        for (int v = 0; v < CV; ++v) _mm512_storeu_ps(o + i * ldo + 16 * v, acc[i][v]);
}

// P V into 16 CV columns of O for `rows` rows: tiles of RP rows, the last one of rows % RP.
template <int CV>
void pv_pairs_tiles(int64_t rows, const uint32_t* pp, int64_t ldp, const uint32_t* vp,
                    int64_t d, int64_t pairs, const float* corr, float* o, int64_t ldo) {
    in_tiles<RP>(rows, [&](auto m, int64_t i0) {
        pv_pairs_tile<decltype(m)::value, CV>(pp + i0, ldp, vp, d, pairs, corr + i0,
                                              o + i0 * ldo, ldo);
    });
}

template <typename V>
inline void at_least(std::vector<V>& v, int64_t n) {
    if (static_cast<int64_t>(v.size()) < n) v.resize(n);
}

// Buffers for `rows` query rows in pairs; every row's state fresh (m = -inf, l = 0, o = 0).
inline void fit_pairs(Buffers& b, int64_t rows, int64_t d) {
    b.fit(rows, d);
    at_least(b.qp, d / 2 * b.rp);
    at_least(b.pp, BK / 2 * b.rp);
    at_least(b.vp, BK / 2 * d);
    at_least(b.kb16, BK * d);
    std::fill(b.m.begin(), b.m.begin() + b.rp, -INFINITY);
    std::fill(b.l.begin(), b.l.begin() + b.rp, 0.0f);
    std::fill(b.o.begin(), b.o.begin() + b.rp * b.dv, 0.0f);
}

// The rows' queries (d bf16, unscaled; row r's at row(r), rows past `rows` zero) as pairs of
// dims in qp's columns: 16 rows' words transposed at a time (a word stored per row and pair,
// strided across qp, took ~4% of a 2,048-token prefill's attention on Zen 5).
template <typename Row>
inline void set_queries(Buffers& b, int64_t rows, int64_t d, Row row) {
    for (int64_t r0 = 0; r0 < b.rp; r0 += 16) {
        const uint16_t* src[16];
        for (int i = 0; i < 16; ++i) src[i] = r0 + i < rows ? row(r0 + i) : nullptr;
        for (int64_t w0 = 0; w0 < d / 2; w0 += 16) {
            __m512i w[16];
            for (int i = 0; i < 16; ++i)
                w[i] = src[i] ? _mm512_loadu_si512(src[i] + 2 * w0) : _mm512_setzero_si512();
            transpose16(w);
            for (int i = 0; i < 16; ++i) _mm512_storeu_si512(&b.qp[(w0 + i) * b.rp + r0], w[i]);
        }
    }
}

// The online softmax of rows [0, rows) (set up by fit_pairs, set_queries and b.lim) over
// keys slots[0, kend) of KV head h, BK at a time; blocks past `unmasked` (the fewest keys any
// row sees) apply the rows' limits. Codes: void for a bf16 pool (P uint16_t), or a quantized
// pool's (I8, E4M3, E5M2) with their (slot, head) scales kscale, vscale: the codes are exact
// in bf16, each key's scale multiplies its scores and each value's its probabilities, as in
// the row kernel (no dequantized copy of the pool).
template <typename Codes = void, typename P = uint16_t>
inline void attend_pairs(Buffers& b, int64_t rows, const P* kpool, const P* vpool,
                         const float* kscale, const float* vscale, const int32_t* slots,
                         int64_t kend, int64_t unmasked, int64_t kvh, int64_t h, int64_t d,
                         float scale) {
    constexpr bool kCodes = !std::is_same<Codes, void>::value;
    const int64_t rp = b.rp, dv = b.dv;  // (dv == d)
    alignas(64) float kmul[BK], vmul[BK];
    for (int64_t k0 = 0; k0 < kend; k0 += BK) {
        const int64_t nk = std::min<int64_t>(BK, kend - k0);
        key_block<Codes>(b, kpool, vpool, kscale, vscale, slots, k0, nk, kend, kvh, h, d, kmul,
                         vmul);
        value_pairs<Codes>(vpool, slots, k0, nk, kvh, h, d, b.vp.data());
        const bool masked = k0 + nk > unmasked;  // some row stops inside the block
        std::copy_n(b.m.begin(), rp, b.corr.begin());
        for (int64_t r0 = 0; r0 < rp; r0 += 32) {
            if (masked)
                qk_pairs_tiles<false>(nk, b.kb16.data(), d, &b.qp[r0], rp, scale,
                                      kCodes ? kmul : nullptr, &b.st[r0], rp, &b.corr[r0]);
            else
                qk_pairs_tiles<true>(nk, b.kb16.data(), d, &b.qp[r0], rp, scale,
                                     kCodes ? kmul : nullptr, &b.st[r0], rp, &b.corr[r0]);
        }
        if (masked) {
            mask_block(b, k0, nk);
            softmax_pairs<true>(b, k0, nk, kCodes ? vmul : nullptr, kLog2e);
        } else {
            softmax_pairs<false>(b, k0, nk, kCodes ? vmul : nullptr, kLog2e);
        }
        const int64_t pairs = (nk + 1) / 2;
        if (d % 64 == 0)
            for (int64_t c0 = 0; c0 < d; c0 += 64)
                pv_pairs_tiles<4>(rows, b.pp.data(), rp, b.vp.data() + c0, d, pairs,
                                  b.corr.data(), &b.o[c0], dv);
        else
            for (int64_t c0 = 0; c0 < d; c0 += 32)
                pv_pairs_tiles<2>(rows, b.pp.data(), rp, b.vp.data() + c0, d, pairs,
                                  b.corr.data(), &b.o[c0], dv);
    }
}

// A work item's rows (query positions [t0, t0 + bq) of a request after `prefix` cached keys,
// the G query heads of KV head h: row r = (position t, head gh) = t * g + gh) set up for
// attend_pairs: fresh states, each row's key limit, the queries as pairs of dims.
inline void item_rows(Buffers& b, const uint16_t* q, int64_t prefix, int64_t t0, int64_t bq,
                      int64_t h, int64_t heads, int64_t kvh, int64_t d) {
    const int64_t g = heads / kvh, rows = bq * g, kend = prefix + t0 + bq;
    fit_pairs(b, rows, d);
    for (int64_t r = 0; r < b.rp; ++r)
        b.lim[r] = static_cast<int32_t>(r < rows ? prefix + t0 + r / g + 1 : kend);
    set_queries(b, rows, d, [&](int64_t r) {
        return q + ((t0 + r / g) * heads + h * g + r % g) * d;
    });
}

// One work item of attend_block (query positions [t0, t0 + bq) of a request, the G query
// heads of KV head h), bf16 queries over a bf16 pool or a quantized one (attend_pairs),
// pairs_fit(d).
template <typename Codes = void, typename P = uint16_t>
inline void attend_block_pairs(Buffers& b, const uint16_t* q, const P* kpool, const P* vpool,
                               const float* kscale, const float* vscale, const int32_t* slots,
                               int64_t prefix, int64_t t0, int64_t bq, int64_t h, int64_t heads,
                               int64_t kvh, int64_t d, float scale, uint16_t* out) {
    const int64_t g = heads / kvh, rows = bq * g, kend = prefix + t0 + bq;
    item_rows(b, q, prefix, t0, bq, h, heads, kvh, d);
    attend_pairs<Codes>(b, rows, kpool, vpool, kscale, vscale, slots, kend, prefix + t0 + 1,
                        kvh, h, d, scale);
    for (int64_t t = 0; t < bq; ++t)
        for (int64_t gh = 0; gh < g; ++gh) {
            const int64_t r = t * g + gh;
            const float inv = 1.0f / b.l[r];
            uint16_t* dst = out + ((t0 + t) * heads + h * g + gh) * d;
            const float* src = &b.o[r * b.dv];
            for (int64_t e = 0; e < d; ++e) dst[e] = BF16::store(src[e] * inv);
        }
}

}  // namespace

#endif  // __AVX512BF16__ && __AVX512BW__
