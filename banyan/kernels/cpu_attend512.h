// attend512: the AVX-512 loop of the CPU attention kernels (vdpbf16ps for bf16 pools), which
// attends query rows to one segment of keys read in place from the pool.
//
// Keys are taken a chunk (CHUNK keys) at a time in three passes: every row's scores for the
// whole chunk, then each row's softmax over them at once, then the chunk's values, interleaved
// once for all rows, added into each row's accumulator. The running maximum and sum are updated
// once a chunk. A 16-key online softmax per block chained every block on the last one's
// maximum, sum and accumulator (a row's exp, two horizontal reductions and its additions in
// sequence): 64 x 192-key decodes ran at ~60 cycles a key and KV head on Zen 5 with their K/V
// already in cache. Exact either way: one softmax over the whole context.
#pragma once

#if defined(__AVX512F__)

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "cpu_attend.h"
#include "cpu_attend512_i8.h"
#include "cpu_attend512_values.h"

namespace {

// Rows from which the scores of a block of keys take long enough to cover the loads of the
// chunk's values for that block, requested then (a decode group's shared prefix, a check).
constexpr int kFarRows = 8;

// Rows' raw scores against the 16 keys of kt (transposed: word i = dims 2i, 2i + 1 of the 16
// keys) in the very arithmetic of scores_fixed + reduce16 for one row: lane l of its partial
// sums holds pairs l, l + 16, ... of a key, added in that order by vdpbf16ps, then the 16 lanes
// are added in reduce16's tree. Here each partial lane is a register of 16 keys instead, and
// the tree adds registers: the same operations in the same order, so a row has the same scores
// in a pass of many rows (a speculative check, a chunk) as alone (a decode's 3 rows a KV head
// for SmolLM2), with the keys transposed once for all the pass's rows.
//
// Rows [r, r + NR) of a pass: W 64-byte words a row (d / 32; 0: d / 32 at run time, the head
// dims of no instance). The 16 lanes go 4 at a time (one 128-bit block of reduce16's), each
// key word loaded once for the NR rows. Out of line: inlined into block_scores, it cost the
// few-row loop there its register allocation (64 x 192-key decodes 1.10x slower, Zen 4).
template <int W, int NR, bool kScaled>
__attribute__((noinline)) void transposed_scores(const __m512i* kt, const uint16_t* qraw, int r,
                                                 int d, float* s, const float* ks) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    const int words = W > 0 ? W : d / 32;
    const int32_t* qw[NR];
    for (int t = 0; t < NR; ++t)
        qw[t] = reinterpret_cast<const int32_t*>(qraw + static_cast<size_t>(r + t) * d);
    __m512 low[NR], high[NR];  // the sums of blocks 0 + 1, then of block 2
    for (int b = 0; b < 4; ++b) {
        __m512 lane[NR][4];
        for (int t = 0; t < NR; ++t)
            for (int m = 0; m < 4; ++m) lane[t][m] = _mm512_setzero_ps();
        for (int w = 0; w < words; ++w)
            for (int m = 0; m < 4; ++m) {
                const int i = 16 * w + 4 * b + m;  // lane 4b + m of word w: pair i
                const __m512bh k = (__m512bh)_mm512_loadu_si512(kt + i);
                for (int t = 0; t < NR; ++t)
                    lane[t][m] = _mm512_dpbf16_ps(lane[t][m], k,
                                                  (__m512bh)_mm512_set1_epi32(qw[t][i]));
            }
        for (int t = 0; t < NR; ++t) {
            const __m512 block = _mm512_add_ps(_mm512_add_ps(lane[t][0], lane[t][2]),
                                               _mm512_add_ps(lane[t][1], lane[t][3]));
            if (b == 0) low[t] = block;
            else if (b == 1) low[t] = _mm512_add_ps(low[t], block);
            else if (b == 2) high[t] = block;
            else {
                const __m512 sum = _mm512_add_ps(low[t], _mm512_add_ps(high[t], block));
                _mm512_storeu_ps(s + static_cast<size_t>(r + t) * CHUNK,
                                 kScaled ? _mm512_mul_ps(sum, _mm512_load_ps(ks)) : sum);
            }
        }
    }
#else
    (void)kt, (void)qraw, (void)r, (void)d, (void)s, (void)ks;
#endif
}

// The rows [r, r + nr) of a pass (nr <= 4), through the instance of exactly nr rows.
template <int W, bool kScaled, int NR = 4>
inline void transposed_rows(int nr, const __m512i* kt, const uint16_t* qraw, int r, int d,
                            float* s, const float* ks) {
    if constexpr (NR > 1) {
        if (nr < NR) return transposed_rows<W, kScaled, NR - 1>(nr, kt, qraw, r, d, s, ks);
    }
    transposed_scores<W, NR, kScaled>(kt, qraw, r, d, s, ks);
}

// Raw scores of rows [lo, rows) against the 16 keys kr (the block at j0 of the chunk), times
// the keys' scales ks where kScaled (a quantized pool's): s[r * CHUNK + j0 + j]. (A pass of
// their own over the rows' scores after took ~1 ms of a 64 x 192-key decode step over an int8
// pool on Zen 4.)
template <typename T, bool kScaled>
inline void block_scores(Scratch& sc, const T* qraw, int lo, int rows, const T* const* kr,
                         int d, int j0, const float* ks) {
    float* s = sc.s.data() + j0;
    if constexpr (kPairsFor<T>) {
        // bf16 with several rows: the block's keys transposed by bf16 pairs (lane j of word i
        // = dims 2i, 2i + 1 of key j), so each vdpbf16ps gives 16 keys' partial scores of one
        // row; transposed 16 words at a time with shuffles (gathers, 16 lanes each, took a
        // fifth of the loop's time on Zen 5). Each row's scores those of the per-row loop
        // below (transposed_scores).
        if (rows - lo >= 4) {
            __m512i* kt = reinterpret_cast<__m512i*>(sc.kt.data());  // [D/2] words
            for (int w0 = 0; w0 < d / 2; w0 += 16) {
                __m512i r[VBLK];
                for (int j = 0; j < VBLK; ++j) r[j] = _mm512_loadu_si512(kr[j] + 2 * w0);
                transpose16(r);
                for (int i = 0; i < 16; ++i) _mm512_storeu_si512(kt + w0 + i, r[i]);
            }
            for (int r = lo; r < rows; r += 4) {
                const int nr = std::min(4, rows - r);
                if (d == 64)
                    transposed_rows<2, kScaled>(nr, kt, qraw, r, d, s, ks);
                else if (d == 128)
                    transposed_rows<4, kScaled>(nr, kt, qraw, r, d, s, ks);
                else
                    transposed_rows<0, kScaled>(nr, kt, qraw, r, d, s, ks);
            }
            return;
        }
    }
    for (int r = lo; r < rows; ++r) {
        const T* qr = qraw + static_cast<size_t>(r) * d;
        __m512 part[VBLK];
        if (d == 64)  // the common head sizes with q held in registers
            scores_fixed<64>(qr, kr, part);
        else if (d == 128)
            scores_fixed<128>(qr, kr, part);
        else
            for (int j = 0; j < VBLK; ++j) part[j] = dot_partial(qr, kr[j], d);
        const __m512 sum = reduce16(part);
        _mm512_storeu_ps(s + static_cast<size_t>(r) * CHUNK,
                         kScaled ? _mm512_mul_ps(sum, _mm512_load_ps(ks)) : sum);
    }
}

// Row rr's softmax over its `seen` raw scores of the chunk (sr): the probabilities go to pp as
// bf16 pairs (bf16 pools: the raw scores stay) or replace the scores in sr (0 past seen, up to
// the chunk's 16-key blocks); the row's maximum and sum move on, and its accumulator is
// rescaled to the new maximum. Two passes: the largest raw score (scale > 0, so the largest
// scaled one, bit for bit), then each probability in one fused step from its raw score,
// 2^(s scale log2(e) - max log2(e)). (A first pass storing the scaled scores and exp512 on
// their differences from the maximum took ~1.6 ms more of a 19 ms shared-prefix 8 x 8 decode
// step on Zen 5.)
inline void chunk_softmax(Scratch& sc, int rr, float* sr, int seen, int blocks, float scale,
                          int d, uint32_t* pp, const float* vmul = nullptr) {
    auto live = [seen](int v) {  // keys of block v the row sees
        const int left = seen - v * VBLK;
        return left >= VBLK ? static_cast<__mmask16>(0xffff)
                            : static_cast<__mmask16>((1u << std::max(left, 0)) - 1u);
    };
    const __m512 none = _mm512_set1_ps(-INFINITY);
    __m512 top = none;
    for (int v = 0; v < blocks; ++v)
        top = _mm512_max_ps(top, _mm512_mask_loadu_ps(none, live(v), sr + v * VBLK));
    const float mx = std::max(sc.m[rr], _mm512_reduce_max_ps(top) * scale);
    // (m starts at -inf: exp_nonpos clamps, so the first correction is ~0, never NaN.)
    const float corr = mx > sc.m[rr] ? exp_nonpos(std::max(sc.m[rr] - mx, -87.0f)) : 1.0f;
    constexpr float kLog2e = 1.44269504088896341f;
    const __m512 mul = _mm512_set1_ps(scale * kLog2e), off = _mm512_set1_ps(-mx * kLog2e);
    __m512 sum = _mm512_setzero_ps();
    for (int v = 0; v < blocks; ++v) {
        // keys past the row's last: probability 0 (probabilities rounded to bf16 next take
        // the short exp2, any lane past the last masked whatever it holds)
        const __m512 t = _mm512_fmadd_ps(_mm512_loadu_ps(sr + v * VBLK), mul, off);
        const __m512 p = _mm512_maskz_mov_ps(live(v), pp != nullptr ? exp2_bf16_512(t)
                                                                    : exp2_nonpos512(t));
        sum = _mm512_add_ps(sum, p);
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
        if (pp != nullptr) {  // probabilities rounded to bf16 for the PV products, as bf16 does
            _mm256_storeu_si256(  // (a quantized pool's: times each value row's scale first)
                reinterpret_cast<__m256i*>(pp + v * VBLK / 2),
                (__m256i)_mm512_cvtneps_pbh(
                    vmul ? _mm512_mul_ps(p, _mm512_loadu_ps(vmul + v * VBLK)) : p));
            continue;
        }
#endif
        _mm512_storeu_ps(sr + v * VBLK, p);
    }
    sc.l[rr] = sc.l[rr] * corr + _mm512_reduce_add_ps(sum);
    sc.m[rr] = mx;
    if (corr != 1.0f) {
        float* ar = sc.acc.data() + static_cast<size_t>(rr) * d;
        const __m512 cv = _mm512_set1_ps(corr);
        for (int e = 0; e < d; e += 16)
            _mm512_storeu_ps(ar + e, _mm512_mul_ps(_mm512_loadu_ps(ar + e), cv));
    }
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// Row r's values of the chunk (vi: bf16 pairs of keys, `words` 16-lane words a pair) added
// into its accumulator, weighted by its probabilities as bf16 pairs (sc.pp): alone.
inline void add_row_pairs(Scratch& sc, const __m512i* vi, int r0, int r, int d, int words) {
    float* ar = sc.acc.data() + static_cast<size_t>(r0 + r) * d;
    const uint32_t* pp = sc.pp.data() + static_cast<size_t>(r) * (CHUNK / 2);
    const int pairs = (sc.vis[r] + 1) / 2;
    if (d == 64) {
        add_pairs_rows<1, 4>(&ar, vi, words, 0, &pp, pairs);
    } else if (d == 128) {
        add_pairs_rows<1, 8>(&ar, vi, words, 0, &pp, pairs);
    } else {
        for (int c = 0; c < d / 16; ++c) {
            __m512 a = _mm512_loadu_ps(ar + c * 16);
            for (int jp = 0; jp < pairs; ++jp)
                a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(vi + jp * (d / 16) + c),
                                     (__m512bh)_mm512_set1_epi32(static_cast<int>(pp[jp])));
            _mm512_storeu_ps(ar + c * 16, a);
        }
    }
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// The chunk's values (slots cs[0, cn) of KV head h) as bf16 pairs of keys (2i, 2i + 1) per dim
// into sc.vb, for vdpbf16ps and the tiles (a lone last key pairs with itself: its partner's
// probability is 0): [pair][d / 16] words of 16 dims. P, Codes: attend512's.
template <typename P, typename Codes>
inline const __m512i* interleave_values(Scratch& sc, const P* vpool, const int32_t* cs, int cn,
                                        int64_t kvh, int64_t h, int d,
                                        const CodesBf16<Codes>& bf16) {
    __m512i* vi = reinterpret_cast<__m512i*>(sc.vb.data());
    const __m512i lo = _mm512_loadu_si512(kPairLo), hi = _mm512_loadu_si512(kPairHi);
    for (int jp = 0; jp < (cn + 1) / 2; ++jp) {
        if (jp % (VBLK / 2) == 0) {
            sc.ahead.issue();
            prefetch_rows(vpool, cs, 2 * jp + 2 * VBLK, std::min(cn, 2 * jp + 3 * VBLK), kvh, h,
                          d);
        }
        const P* va = vpool + (static_cast<int64_t>(cs[2 * jp]) * kvh + h) * d;
        const P* vb2 =
            vpool + (static_cast<int64_t>(cs[std::min(2 * jp + 1, cn - 1)]) * kvh + h) * d;
        for (int c2 = 0; c2 < d / 32; ++c2) {
            __m512i a, b;
            if constexpr (!std::is_same<Codes, void>::value) {
                a = bf16(va + c2 * 32);
                b = bf16(vb2 + c2 * 32);
            } else {
                a = _mm512_loadu_si512(va + c2 * 32);
                b = _mm512_loadu_si512(vb2 + c2 * 32);
            }
            _mm512_storeu_si512(vi + jp * (d / 16) + 2 * c2, _mm512_permutex2var_epi16(a, lo, b));
            _mm512_storeu_si512(vi + jp * (d / 16) + 2 * c2 + 1,
                                _mm512_permutex2var_epi16(a, hi, b));
        }
    }
    return vi;
}
#endif

// T: the queries' type; P: the pool's, T itself or (bf16 queries with AVX512-BF16) the codes
// of a quantized pool (Codes: I8, E4M3 or E5M2) with a float32 scale per (slot, head) row
// (kscale, vscale), read in place: the codes are exact in bf16, each key's scale multiplies
// its scores and each value's its probabilities. (A dequantized copy of every chunk first ran
// 64 x 256 decodes at ~1.8x a bf16 pool's time with int8, ~2x with fp8.)
template <typename T, typename P = T, typename Codes = void>
void attend512(Scratch& sc, const T* qraw, int r0, int rows, const int32_t* slots, int64_t n,
               const P* kpool, const P* vpool, int64_t kvh, int64_t h, int d, float scale,
               bool causal, const float* kscale = nullptr, const float* vscale = nullptr) {
    constexpr bool kPairs = kPairsFor<T>;
    constexpr bool kCodes = !std::is_same<Codes, void>::value;
    static_assert(std::is_same<P, T>::value || (kCodes && kPairs), "codes: bf16 pairs only");
    // an int8 pool's scores and values in integers (cpu_attend512_i8.h), its codes in place;
    // every branch of it under `if constexpr (kI8)`, so the other instances compile as before
    // (their register allocation moved with a run-time flag: bf16 pools 1.02-1.06x the time)
#if defined(BANYAN_I8_ATTENTION)
    constexpr bool kI8 = std::is_same<Codes, I8>::value;
#else
    constexpr bool kI8 = false;
#endif
    [[maybe_unused]] const bool in_integers = kI8 && d % 64 == 0;
    if constexpr (kI8) {
        if (in_integers) quantize_query_rows(sc, qraw, rows, d);
    }
    const T* kr[VBLK];
    [[maybe_unused]] const P* kp[VBLK];
    alignas(64) float ks[VBLK];
    [[maybe_unused]] const CodesBf16<Codes> bf16;
    prefetch_rows(kpool, slots, 0, std::min<int64_t>(n, 2 * VBLK), kvh, h, d);
    for (int64_t c0 = 0; c0 < n; c0 += CHUNK) {
        const int cn = static_cast<int>(std::min<int64_t>(CHUNK, n - c0));
        const int32_t* cs = slots + c0;
        const int blocks = (cn + VBLK - 1) / VBLK;
        // a causal chunk's first rows that see none of these keys (a long extend's, before
        // its diagonal) are not scored: step 2 gives them no keys either way
        int first = 0;
        while (causal && first < rows && sc.lim[r0 + first] <= c0) ++first;
        // 1. every row's raw scores for the chunk
        for (int b = 0; b < blocks; ++b) {
            const int j0 = b * VBLK, nb = std::min(VBLK, cn - j0);
            if (rows >= kFarRows) {  // keys 4 blocks ahead into L2, the next into L1, and
                                     // this block's values (step 3) into L2
                prefetch_rows<P, _MM_HINT_T1>(kpool, slots, c0 + j0 + 4 * VBLK,
                                              std::min<int64_t>(n, c0 + j0 + 5 * VBLK), kvh, h, d);
                prefetch_rows(kpool, slots, c0 + j0 + VBLK,
                              std::min<int64_t>(n, c0 + j0 + 2 * VBLK), kvh, h, d);
                prefetch_rows<P, _MM_HINT_T1>(vpool, cs, j0, j0 + nb, kvh, h, d);
            } else {  // keys 2 blocks ahead; at the last block, the chunk's first values
                prefetch_rows(kpool, slots, c0 + j0 + 2 * VBLK,
                              std::min<int64_t>(n, c0 + j0 + 3 * VBLK), kvh, h, d);
                if (b == blocks - 1) prefetch_rows(vpool, cs, 0, std::min(cn, 2 * VBLK), kvh, h, d);
            }
            for (int j = 0; j < VBLK; ++j) {  // padding keys repeat the last one (masked below)
                const int64_t row = static_cast<int64_t>(cs[j0 + std::min(j, nb - 1)]) * kvh + h;
                if constexpr (kCodes) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
                    if (in_integers) {
                        kp[j] = kpool + row * d;
                    } else {
                        uint16_t* kc = sc.kc.data() + static_cast<size_t>(j) * d;
                        for (int e = 0; e < d; e += 32)
                            _mm512_storeu_si512(kc + e, bf16(kpool + row * d + e));
                        kr[j] = kc;
                    }
                    ks[j] = row_scale(kscale, row) * code_unit<Codes>;
                    sc.vsc[j0 + j] = row_scale(vscale, row) * code_unit<Codes>;
#endif
                } else {
                    kr[j] = kpool + row * d;
                }
            }
            static_assert(VBLK == ReadAhead::kBlock, "an issue per block of keys");
            sc.ahead.issue();
            if constexpr (kI8) {
                if (in_integers) {  // (the keys' scales with the query's)
                    block_scores_i8(sc, first, rows, kp, ks, d, j0);
                    continue;
                }
            }
            block_scores<T, kCodes>(sc, qraw, first, rows, kr, d, j0, kCodes ? ks : nullptr);
        }
        // 2. each row's softmax over the keys it sees (a causal extend's rows: up to their own)
        for (int r = 0; r < rows; ++r) {
            const int rr = r0 + r;
            int seen = cn;
            if (causal) seen = static_cast<int>(std::min<int64_t>(cn, std::max<int64_t>(
                                                                     0, sc.lim[rr] - c0)));
            sc.vis[r] = seen;
            if (seen == 0) continue;
            if constexpr (kI8) {
                if (in_integers) {  // (the probabilities as 8-bit codes)
                    float* sr = sc.s.data() + static_cast<size_t>(r) * CHUNK;
                    const int blocks = (seen + VBLK - 1) / VBLK;
                    chunk_softmax(sc, rr, sr, seen, blocks, scale, d, nullptr);
                    probability_codes(sc, r, sr, blocks);
                    continue;
                }
            }
            chunk_softmax(sc, rr, sc.s.data() + static_cast<size_t>(r) * CHUNK, seen,
                          (seen + VBLK - 1) / VBLK, scale, d,
                          kPairs ? sc.pp.data() + static_cast<size_t>(r) * (CHUNK / 2) : nullptr,
                          kCodes ? sc.vsc.data() : nullptr);
        }
        // 3. the chunk's values, converted once, into every row's accumulator
        if constexpr (kI8) {
            if (in_integers) {
                add_values_i8(sc, vpool, cs, cn, kvh, h, d, r0, rows);
                continue;
            }
        }
        if constexpr (kPairs) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
            const __m512i* vi = interleave_values<P, Codes>(sc, vpool, cs, cn, kvh, h, d, bf16);
            const int words = d / 16;
            int r = 0;
            // past the rows that see none of the chunk, three rows at a time while they see the
            // same keys (all but a causal chunk's last rows), four words of them a pass, for the
            // head sizes add_pairs_rows serves; the rest one by one (add_row_pairs): each row's
            // sums the same either way. (Threes taken further, per token of a causal chunk's
            // diagonal, ran 13-token checks 2-5% slower.)
            while (r < rows && sc.vis[r] == 0) ++r;
            for (; r + 3 <= rows && (d == 64 || d == 128); r += 3) {
                if (sc.vis[r] == 0 || sc.vis[r + 1] != sc.vis[r] || sc.vis[r + 2] != sc.vis[r])
                    break;
                float* ar[3];
                const uint32_t* pr[3];
                for (int i = 0; i < 3; ++i) {
                    ar[i] = sc.acc.data() + static_cast<size_t>(r0 + r + i) * d;
                    pr[i] = sc.pp.data() + static_cast<size_t>(r + i) * (CHUNK / 2);
                }
                const int pairs = (sc.vis[r] + 1) / 2;
                for (int c0 = 0; c0 < words; c0 += 4)
                    add_pairs_rows<3, 4>(ar, vi, words, c0, pr, pairs);
            }
            for (; r < rows; ++r)
                if (sc.vis[r] != 0) add_row_pairs(sc, vi, r0, r, d, words);
#endif
        } else {
            float* vb = sc.vb.data();  // [cn][D] float32
            for (int j = 0; j < cn; ++j) {
                if (j % VBLK == 0)
                    prefetch_rows(vpool, cs, j + VBLK, std::min(cn, j + 2 * VBLK), kvh, h, d);
                const T* vr = vpool + (static_cast<int64_t>(cs[j]) * kvh + h) * d;
                for (int e = 0; e < d; e += 16) _mm512_storeu_ps(vb + j * d + e, load16(vr + e));
            }
            for (int r = 0; r < rows; ++r) {
                const int seen = sc.vis[r];
                if (seen == 0) continue;
                float* ar = sc.acc.data() + static_cast<size_t>(r0 + r) * d;
                const float* p = sc.s.data() + static_cast<size_t>(r) * CHUNK;
                if (d == 64)
                    add_values<4>(ar, vb, p, seen);
                else if (d == 128)
                    add_values<8>(ar, vb, p, seen);
                else
                    for (int e = 0; e < d; e += 16) {
                        __m512 a = _mm512_loadu_ps(ar + e);
                        for (int j = 0; j < seen; ++j)
                            a = _mm512_fmadd_ps(_mm512_set1_ps(p[j]),
                                                _mm512_loadu_ps(vb + j * d + e), a);
                        _mm512_storeu_ps(ar + e, a);
                    }
            }
        }
    }
}

}  // namespace

#endif  // __AVX512F__
