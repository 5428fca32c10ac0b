// The loops that attend query rows to one segment of keys read from the pool, with an online
// softmax in float32: `attend` (portable, any pool element type, quantized codes included)
// and `attend512` (AVX-512; vdpbf16ps for bf16 pools). The per-request driver is
// cpu_paged_attention.cpp.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "cpu_avx512.h"
#include "cpu_dtypes.h"

namespace {

constexpr int BLK = 32;  // keys per block

// Per-thread scratch of one work item.
struct Scratch {
    std::vector<float> q, m, l, acc, s, kt, vb, corr;
    std::vector<int64_t> lim;  // keys of the current segment each row may see (causal extends)
    void fit(int rows, int d) {
        lim.resize(rows);
        q.resize(static_cast<size_t>(rows) * d);
        acc.resize(static_cast<size_t>(rows) * d);
        m.resize(rows);
        l.resize(rows);
        corr.resize(rows);
        s.resize(static_cast<size_t>(rows) * BLK);
        kt.resize(static_cast<size_t>(d) * BLK);
        vb.resize(static_cast<size_t>(BLK) * d);
    }
};

// Attend query rows [r0, r0 + rows) of `sc` to the keys at `slots[0, n)` of KV head h.
// K: the pool's element type (cpu_dtypes.h); a scaled (quantized) one multiplies each
// (slot, head) row by its scale as the block is converted.
template <typename K>
void attend(Scratch& sc, int r0, int rows, const int32_t* slots, int64_t n,
            const typename K::T* kpool, const typename K::T* vpool, const float* kscale,
            const float* vscale, int64_t kvh, int64_t h, int d, bool causal) {
    float* kb = sc.kt.data();  // [BLK][D] keys of the block
    float* vb = sc.vb.data();  // [BLK][D]
    for (int64_t j0 = 0; j0 < n; j0 += BLK) {
        const int nb = static_cast<int>(std::min<int64_t>(BLK, n - j0));
        for (int j = 0; j < nb; ++j) {
            const int64_t row = static_cast<int64_t>(slots[j0 + j]) * kvh + h;
            const typename K::T* kr = kpool + row * d;
            const typename K::T* vr = vpool + row * d;
            float* kj = kb + j * d;
            float* vj = vb + j * d;
            if constexpr (K::kScaled) {
                const float ks = kscale[row], vs = vscale[row];
#pragma omp simd
                for (int e = 0; e < d; ++e) kj[e] = K::load(kr[e]) * ks;
#pragma omp simd
                for (int e = 0; e < d; ++e) vj[e] = K::load(vr[e]) * vs;
            } else {
#pragma omp simd
                for (int e = 0; e < d; ++e) kj[e] = K::load(kr[e]);
#pragma omp simd
                for (int e = 0; e < d; ++e) vj[e] = K::load(vr[e]);
            }
        }
        for (int r = r0; r < r0 + rows; ++r) {
            float* sr = sc.s.data() + static_cast<size_t>(r) * BLK;
            const float* qr = sc.q.data() + static_cast<size_t>(r) * d;
            float acc_s[BLK];
            for (int j = 0; j < nb; ++j) {
                const float* kj = kb + j * d;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int e = 0; e < d; ++e) dot += qr[e] * kj[e];
                acc_s[j] = dot;
            }
            int nbr = nb;  // keys of the block this row sees
            if (causal) {
                const int64_t visible = sc.lim[r] - j0;
                if (visible <= 0) continue;
                nbr = static_cast<int>(std::min<int64_t>(nb, visible));
            }
            float mx = sc.m[r];
            for (int j = 0; j < nbr; ++j) mx = std::max(mx, acc_s[j]);
            // m starts at -inf: exp_nonpos clamps, so the first correction is ~0, never NaN.
            const float corr = exp_nonpos(std::max(sc.m[r] - mx, -87.0f));
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int j = 0; j < nbr; ++j) {
                sr[j] = exp_nonpos(acc_s[j] - mx);
                sum += sr[j];
            }
            sc.l[r] = sc.l[r] * corr + sum;
            sc.m[r] = mx;
            float* ar = sc.acc.data() + static_cast<size_t>(r) * d;
#pragma omp simd
            for (int e = 0; e < d; ++e) ar[e] *= corr;
            for (int j = 0; j < nbr; ++j) {
                const float p = sr[j];
                const float* vj = vb + j * d;
#pragma omp simd
                for (int e = 0; e < d; ++e) ar[e] += p * vj[e];
            }
        }
    }
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)

// exp(x) for x <= 0 (clamped at -87): exp512's polynomial in 8 lanes.
inline __m256 exp256_nonpos(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 fx = _mm256_floor_ps(
        _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    __m256 r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), r);
    const __m256 z = _mm256_mul_ps(r, r);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, z, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i bits = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}

// The 8 lane sums of 8 vectors, as one vector (lane j = the sum of a[j]).
inline __m256 sum8x8(const __m256* a) {
    const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                         _mm256_permute2f128_ps(u0, u1, 0x31));
}

// ar[0, 8W) = ar * corr + sum_j p[j] * vr[j][e0, e0 + 8W): W accumulators held in registers
// (a width known only at run time kept them in memory, a load and a store per product).
template <int W>
inline void add_values256(float* ar, const float* const* vr, int e0, const float* p, int nbr,
                          __m256 corr) {
    __m256 a[W];
    for (int c = 0; c < W; ++c) a[c] = _mm256_mul_ps(_mm256_loadu_ps(ar + 8 * c), corr);
    for (int j = 0; j < nbr; ++j) {
        const __m256 pj = _mm256_set1_ps(p[j]);
        for (int c = 0; c < W; ++c)
            a[c] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vr[j] + e0 + 8 * c), a[c]);
    }
    for (int c = 0; c < W; ++c) _mm256_storeu_ps(ar + 8 * c, a[c]);
}

// `attend` for a float32 pool on AVX2 CPUs (Zen 2/3, Intel client): keys read in place, 8 at a
// time; each row's 8 scores come from 8 lane-parallel dot products summed across lanes at once
// (no per-key horizontal sum), and the values are added straight from the pool (no block copy).
// Measured on Zen 3 for a lone decode of SmolLM2 at 190 tokens: see cpu_paged_attention.cpp.
inline void attend256(Scratch& sc, int r0, int rows, const int32_t* slots, int64_t n,
                      const float* kpool, const float* vpool, int64_t kvh, int64_t h, int d,
                      bool causal) {
    constexpr int B = 8;
    const float* kr[B];
    const float* vr[B];
    for (int64_t j0 = 0; j0 < n; j0 += B) {
        const int nb = static_cast<int>(std::min<int64_t>(B, n - j0));
        for (int j = 0; j < B; ++j) {  // padding keys repeat the last one (masked below)
            const int64_t row = static_cast<int64_t>(slots[j0 + std::min(j, nb - 1)]) * kvh + h;
            kr[j] = kpool + row * d;
            vr[j] = vpool + row * d;
        }
        // the block after next into cache while this one computes (one block ahead arrives
        // too late on Zen 3: the rows of one head are 4 lines in every KVH x 4)
        for (int64_t j = j0 + 2 * B; j < std::min(n, j0 + 3 * B); ++j) {
            const int64_t row = static_cast<int64_t>(slots[j]) * kvh + h;
            for (int off = 0; off < d; off += 16) {
                _mm_prefetch(reinterpret_cast<const char*>(kpool + row * d + off), _MM_HINT_T0);
                _mm_prefetch(reinterpret_cast<const char*>(vpool + row * d + off), _MM_HINT_T0);
            }
        }
        auto visible = [&](int r) {  // keys of the block row r sees
            if (!causal) return nb;
            const int64_t v = sc.lim[r] - j0;
            return v <= 0 ? 0 : static_cast<int>(std::min<int64_t>(nb, v));
        };
        // Three passes over the rows (scores, softmax, values) rather than one row at a time:
        // each row's chain (dot products -> sums -> max -> exp -> products) is long, and rows
        // side by side give the CPU independent work to overlap.
        for (int r = r0; r < r0 + rows; ++r) {
            const int nbr = visible(r);
            if (nbr == 0) continue;
            const float* qr = sc.q.data() + static_cast<size_t>(r) * d;
            __m256 part[B];
            for (int j = 0; j < B; ++j) part[j] = _mm256_setzero_ps();
            for (int e = 0; e < d; e += 8) {
                const __m256 qv = _mm256_loadu_ps(qr + e);
                for (int j = 0; j < B; ++j)
                    part[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr[j] + e), part[j]);
            }
            _mm256_storeu_ps(sc.s.data() + static_cast<size_t>(r) * BLK, sum8x8(part));
        }
        for (int r = r0; r < r0 + rows; ++r) {
            const int nbr = visible(r);
            if (nbr == 0) continue;
            float* sr = sc.s.data() + static_cast<size_t>(r) * BLK;
            // keys past the row's last (padding, or later tokens of a causal extend): -inf
            const __m256 seen = _mm256_castsi256_ps(_mm256_cmpgt_epi32(
                _mm256_set1_epi32(nbr), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
            const __m256 sv =
                _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), _mm256_loadu_ps(sr), seen);
            __m256 top = _mm256_max_ps(sv, _mm256_permute2f128_ps(sv, sv, 1));
            top = _mm256_max_ps(top, _mm256_shuffle_ps(top, top, 0x4e));
            top = _mm256_max_ps(top, _mm256_shuffle_ps(top, top, 0xb1));
            const float mx = std::max(sc.m[r], _mm256_cvtss_f32(top));
            // m starts at -inf: exp_nonpos clamps, so the first correction is ~0, never NaN.
            const float corr = mx > sc.m[r] ? exp_nonpos(std::max(sc.m[r] - mx, -87.0f)) : 1.0f;
            const __m256 pv = _mm256_and_ps(
                exp256_nonpos(_mm256_sub_ps(sv, _mm256_set1_ps(mx))), seen);
            _mm256_storeu_ps(sr, pv);
            __m256 s4 = _mm256_add_ps(pv, _mm256_permute2f128_ps(pv, pv, 1));
            s4 = _mm256_add_ps(s4, _mm256_shuffle_ps(s4, s4, 0x4e));
            s4 = _mm256_add_ps(s4, _mm256_shuffle_ps(s4, s4, 0xb1));
            sc.l[r] = sc.l[r] * corr + _mm256_cvtss_f32(s4);
            sc.m[r] = mx;
            sc.corr[r] = corr;
        }
        for (int r = r0; r < r0 + rows; ++r) {
            const int nbr = visible(r);
            if (nbr == 0) continue;
            const float* p = sc.s.data() + static_cast<size_t>(r) * BLK;
            float* ar = sc.acc.data() + static_cast<size_t>(r) * d;
            const __m256 cv = _mm256_set1_ps(sc.corr[r]);
            for (int e0 = 0; e0 < d; e0 += 64) {
                switch (std::min(64, d - e0) / 8) {  // a compile-time width: registers
                    case 8: add_values256<8>(ar + e0, vr, e0, p, nbr, cv); break;
                    case 7: add_values256<7>(ar + e0, vr, e0, p, nbr, cv); break;
                    case 6: add_values256<6>(ar + e0, vr, e0, p, nbr, cv); break;
                    case 5: add_values256<5>(ar + e0, vr, e0, p, nbr, cv); break;
                    case 4: add_values256<4>(ar + e0, vr, e0, p, nbr, cv); break;
                    case 3: add_values256<3>(ar + e0, vr, e0, p, nbr, cv); break;
                    case 2: add_values256<2>(ar + e0, vr, e0, p, nbr, cv); break;
                    default: add_values256<1>(ar + e0, vr, e0, p, nbr, cv); break;
                }
            }
        }
    }
}

#endif

#if defined(__AVX512F__)

template <typename T>
void attend512(Scratch& sc, const T* qraw, int r0, int rows, const int32_t* slots, int64_t n,
               const T* kpool, const T* vpool, int64_t kvh, int64_t h, int d, float scale,
               bool causal) {
    // [VBLK][D] float32 values of the block, or (bf16 pools) their interleaved pairs
    constexpr bool kPairs = kPairsFor<T>;
    float* vb = sc.vb.data();
    const T* kr[VBLK];
    const __m512 scale_v = _mm512_set1_ps(scale);
    for (int64_t j0 = 0; j0 < n; j0 += VBLK) {
        const int nb = static_cast<int>(std::min<int64_t>(VBLK, n - j0));
        // Prefetch the next block (measured: further ahead evicts lines before their use), on
        // the first head the whole slot (every head's K and V: the next heads of this slice
        // then find them in cache), else just this head's rows.
        const int64_t ahead0 = j0 + VBLK, ahead1 = std::min<int64_t>(n, ahead0 + VBLK);
        const int64_t head0 = h == 0 ? 0 : h, width = (h == 0 ? kvh : 1) * d * sizeof(T);
        for (int64_t j = ahead0; j < ahead1; ++j) {
            const char* kp = reinterpret_cast<const char*>(kpool + (slots[j] * kvh + head0) * d);
            const char* vp = reinterpret_cast<const char*>(vpool + (slots[j] * kvh + head0) * d);
            for (int64_t off = 0; off < width; off += 64) {
                _mm_prefetch(kp + off, _MM_HINT_T0);
                _mm_prefetch(vp + off, _MM_HINT_T0);
            }
        }
        if (j0 == 0) {  // the first block, before the loop reaches it
            for (int64_t j = 0; j < std::min<int64_t>(n, VBLK); ++j) {
                const char* kp =
                    reinterpret_cast<const char*>(kpool + (slots[j] * kvh + head0) * d);
                const char* vp =
                    reinterpret_cast<const char*>(vpool + (slots[j] * kvh + head0) * d);
                for (int64_t off = 0; off < width; off += 64) {
                    _mm_prefetch(kp + off, _MM_HINT_T0);
                    _mm_prefetch(vp + off, _MM_HINT_T0);
                }
            }
        }
        for (int j = 0; j < VBLK; ++j)  // padding keys repeat the last one (masked below)
            kr[j] = kpool + (static_cast<int64_t>(slots[j0 + std::min(j, nb - 1)]) * kvh + h) * d;
        const int pairs = (nb + 1) / 2;
#if defined(__AVX512BF16__) && defined(__AVX512BW__)  // vpermt2w needs BW (Skylake-X has no BF16)
        if constexpr (kPairs) {
            // bf16 values of keys (2i, 2i + 1) interleaved per dim, for vdpbf16ps (a lone last
            // key pairs with itself: its partner's probability is 0)
            __m512i* vi = reinterpret_cast<__m512i*>(vb);
            const __m512i lo = _mm512_loadu_si512(kPairLo), hi = _mm512_loadu_si512(kPairHi);
            for (int jp = 0; jp < pairs; ++jp) {
                const int64_t sa = slots[j0 + 2 * jp];
                const int64_t sb = slots[j0 + std::min(2 * jp + 1, nb - 1)];
                const T* va = vpool + (sa * kvh + h) * d;
                const T* vb2 = vpool + (sb * kvh + h) * d;
                for (int c2 = 0; c2 < d / 32; ++c2) {
                    const __m512i a = _mm512_loadu_si512(va + c2 * 32);
                    const __m512i b = _mm512_loadu_si512(vb2 + c2 * 32);
                    _mm512_storeu_si512(vi + jp * (d / 16) + 2 * c2,
                                        _mm512_permutex2var_epi16(a, lo, b));
                    _mm512_storeu_si512(vi + jp * (d / 16) + 2 * c2 + 1,
                                        _mm512_permutex2var_epi16(a, hi, b));
                }
            }
        } else
#endif
        {
            for (int j = 0; j < nb; ++j) {
                const T* vr = vpool + (static_cast<int64_t>(slots[j0 + j]) * kvh + h) * d;
                for (int e = 0; e < d; e += 16) _mm512_storeu_ps(vb + j * d + e, load16(vr + e));
            }
        }
        const __mmask16 live = static_cast<__mmask16>((1u << nb) - 1u);
        // bf16 with several rows: the block's keys transposed by bf16 pairs (lane j of word i
        // = dims 2i, 2i + 1 of key j, gathered), so each vdpbf16ps gives 16 keys' partial
        // scores of one row and no horizontal sums are needed.
        bool tiled = false;
        if constexpr (kPairs) {
            int64_t top = 0;
            for (int j = 0; j < VBLK; ++j) top = std::max<int64_t>(top, kr[j] - kpool);
            tiled = rows >= 4 && top / 2 + d / 2 < (int64_t{1} << 31);
            if (tiled) {
                alignas(64) int32_t base[VBLK];
                for (int j = 0; j < VBLK; ++j) base[j] = static_cast<int32_t>((kr[j] - kpool) / 2);
                const __m512i idx = _mm512_load_si512(reinterpret_cast<const void*>(base));
                __m512i* kt = reinterpret_cast<__m512i*>(sc.kt.data());  // [D/2] words
                for (int i = 0; i < d / 2; ++i)
                    _mm512_storeu_si512(kt + i, _mm512_i32gather_epi32(
                                                    _mm512_add_epi32(idx, _mm512_set1_epi32(i)),
                                                    kpool, 4));
                for (int r = 0; r < rows; r += 4) {
                    const int nr = std::min(4, rows - r);
                    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(),
                                     _mm512_setzero_ps(), _mm512_setzero_ps()};
                    const int32_t* qw[4];
                    for (int t = 0; t < 4; ++t)
                        qw[t] = reinterpret_cast<const int32_t*>(
                            qraw + static_cast<size_t>(r + std::min(t, nr - 1)) * d);
                    for (int i = 0; i < d / 2; ++i) {
                        const __m512bh k2 = (__m512bh)_mm512_loadu_si512(kt + i);
                        for (int t = 0; t < 4; ++t)
                            acc[t] = _mm512_dpbf16_ps(acc[t], k2,
                                                      (__m512bh)_mm512_set1_epi32(qw[t][i]));
                    }
                    for (int t = 0; t < nr; ++t)
                        _mm512_storeu_ps(sc.s.data() + static_cast<size_t>(r + t) * VBLK, acc[t]);
                }
            }
        }
        for (int r = 0; r < rows; ++r) {
            const int rr = r0 + r;
            __m512 raw;
            if (tiled) {
                raw = _mm512_loadu_ps(sc.s.data() + static_cast<size_t>(r) * VBLK);
            } else {
                const T* qr = qraw + static_cast<size_t>(r) * d;
                __m512 part[VBLK];
                if (d == 64)  // the common head sizes with q held in registers
                    scores_fixed<64>(qr, kr, part);
                else if (d == 128)
                    scores_fixed<128>(qr, kr, part);
                else
                    for (int j = 0; j < VBLK; ++j) part[j] = dot_partial(qr, kr[j], d);
                raw = reduce16(part);
            }
            __mmask16 seen = live;  // keys of the block this row sees
            if (causal) {
                const int64_t visible = sc.lim[rr] - j0;
                if (visible <= 0) continue;
                if (visible < VBLK) seen &= static_cast<__mmask16>((1u << visible) - 1u);
            }
            const __m512 sv =
                _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), seen, _mm512_mul_ps(raw, scale_v));
            const float mx = std::max(sc.m[rr], _mm512_reduce_max_ps(sv));
            // Past the first blocks the maximum rarely moves: no correction to compute then.
            // (m starts at -inf: exp_nonpos clamps, so the first correction is ~0, never NaN.)
            const float corr = mx > sc.m[rr] ? exp_nonpos(std::max(sc.m[rr] - mx, -87.0f)) : 1.0f;
            const __m512 pv = _mm512_maskz_mov_ps(
                seen, exp512_nonpos(_mm512_sub_ps(sv, _mm512_set1_ps(mx))));
            sc.l[rr] = sc.l[rr] * corr + _mm512_reduce_add_ps(pv);
            sc.m[rr] = mx;
            float* ar = sc.acc.data() + static_cast<size_t>(rr) * d;
            const __m512 cv = _mm512_set1_ps(corr);
            if constexpr (kPairs) {
                // probabilities rounded to bf16 for the PV products, as bf16 attention does
                alignas(32) uint32_t pp[VBLK / 2];
                _mm256_store_si256(reinterpret_cast<__m256i*>(pp),
                                   (__m256i)_mm512_cvtneps_pbh(pv));
                const __m512i* vi = reinterpret_cast<const __m512i*>(vb);
                for (int c = 0; c < d / 16; ++c) {
                    __m512 a = _mm512_mul_ps(_mm512_loadu_ps(ar + c * 16), cv);
                    for (int jp = 0; jp < pairs; ++jp)
                        a = _mm512_dpbf16_ps(
                            a, (__m512bh)_mm512_loadu_si512(vi + jp * (d / 16) + c),
                            (__m512bh)_mm512_set1_epi32(static_cast<int>(pp[jp])));
                    _mm512_storeu_ps(ar + c * 16, a);
                }
            } else {
                alignas(64) float p[VBLK];
                _mm512_store_ps(p, pv);
                for (int e = 0; e < d; e += 16) {
                    __m512 a = _mm512_mul_ps(_mm512_loadu_ps(ar + e), cv);
                    for (int j = 0; j < nb; ++j)
                        a = _mm512_fmadd_ps(_mm512_set1_ps(p[j]),
                                            _mm512_loadu_ps(vb + j * d + e), a);
                    _mm512_storeu_ps(ar + e, a);
                }
            }
        }
    }
}
#endif

}  // namespace
