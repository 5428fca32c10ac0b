// The loops that attend query rows to one segment of keys read from the pool, with an online
// softmax in float32: `attend` (portable, any pool element type, quantized codes included)
// and `attend256` (AVX2); `attend512` (AVX-512) is in cpu_attend512.h. The per-request driver
// is cpu_paged_attention.cpp.
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
constexpr int CHUNK = 128;  // keys the AVX-512 loop scores at once (cpu_attend512.h)

// Read every cache line of the K and V rows of slots[0, n) (all KV heads: row_elems values a
// slot) in slot order, so that the head-by-head passes that follow find them in L2. Those passes
// read a head's rows with a stride (a slot's heads side by side), a pattern the hardware
// prefetchers of Zen 4 hardly follow and software prefetches (two blocks ahead, or a whole
// request ahead) did not help: 64 decodes x 192 keys of SmolLM2 (decode_attention.py) ran at
// ~22 ms a step cold against ~8 ms with the same K/V in cache; with this sequential read
// first, 16-17 ms (13 ms without those software prefetches, kept because they measured 1.1x
// on Zen 5). Every line, not every other one: the adjacent lines are not fetched with them
// (27 ms). The request's lines read ahead, spread over the one before (ReadAhead), beat this
// read; it stays for a thread's first request and the loops that do not read ahead.
template <typename T>
inline void stream_in(const T* kpool, const T* vpool, const int32_t* slots, int64_t n,
                      int64_t row_elems) {
    const int64_t row_bytes = row_elems * static_cast<int64_t>(sizeof(T));
    const char* k = reinterpret_cast<const char*>(kpool);
    const char* v = reinterpret_cast<const char*>(vpool);
    int sink = 0;
    for (int64_t j = 0; j < n; ++j) {
        const int64_t at = slots[j] * row_bytes;
        for (int64_t o = 0; o < row_bytes; o += 64)
            sink ^= *reinterpret_cast<const volatile int*>(k + at + o) ^
                    *reinterpret_cast<const volatile int*>(v + at + o);
    }
    static_cast<void>(sink);
}

// The K/V rows (every KV head) of the request a thread attends next, read ahead a few lines
// at each block of keys of the one it attends now (`issue`: attend512 calls it at each block of
// 16 keys it scores, and again at each block whose values it adds), so that they are in cache
// when the next request starts, instead of its stream_in waiting on memory. Spread out, not
// issued at once: 64 decodes x 192 keys (decode_attention.py) took 0.88x the time of
// stream_in alone on Zen 5; all of a request's lines in the first half of the one before
// took 1.16x the time of spreading them (bursts of prefetches stall the loads they share
// the miss buffers with). prefetcht1: into L2 on Intel (a request's K/V is ~3x an L1), all
// levels on AMD, where t0, t1 and t2 measured alike.
struct ReadAhead {
    static constexpr int64_t kBlock = 16;  // keys between issues (attend512's VBLK)
    const char* k = nullptr;
    const char* v = nullptr;
    const int32_t* slots = nullptr;
    int64_t n = 0, row_bytes = 0, j = 0, off = 0;
    int64_t per_issue = 0;  // lines of K (and as many of V) an issue

    // Rows slots[0, count) of the pools (row_elems values a slot, as stream_in takes them),
    // spread over the issues of the request attended meanwhile: `keys` keys walked for `heads`
    // KV heads, two issues per kBlock keys and head (its keys' blocks, then its values').
    template <typename T>
    void start(const T* kpool, const T* vpool, const int32_t* s, int64_t count,
               int64_t row_elems, int64_t keys, int64_t heads) {
        k = reinterpret_cast<const char*>(kpool), v = reinterpret_cast<const char*>(vpool);
        slots = s, n = count, j = 0, off = 0;
        row_bytes = row_elems * static_cast<int64_t>(sizeof(T));
        const int64_t issues = std::max<int64_t>(2 * heads * ((keys + kBlock - 1) / kBlock), 1);
        per_issue = (count * ((row_bytes + 63) / 64) + issues - 1) / issues;
    }
    void stop() { n = 0; }
    void issue() {
        for (int64_t i = 0; i < per_issue && j < n; ++i) {
            const int64_t at = slots[j] * row_bytes + off;
            __builtin_prefetch(k + at, 0, 2);
            __builtin_prefetch(v + at, 0, 2);
            off += 64;
            if (off >= row_bytes) off = 0, ++j;
        }
    }
};

#if defined(__AVX2__)
// Prefetch one KV head's rows of slots [j0, j1) of a pool (the AVX-512 loops'): the block
// after next, while this one is computed (one block ahead: 64 x 192-key decodes 1.1x slower
// on Zen 5; one line of a 128-byte row instead of both: 1.3x slower).
template <typename T, int kHint = _MM_HINT_T0>
inline void prefetch_rows(const T* pool, const int32_t* slots, int64_t j0, int64_t j1,
                          int64_t kvh, int64_t h, int d) {
    const int64_t width = d * static_cast<int64_t>(sizeof(T));
    for (int64_t j = j0; j < j1; ++j) {
        const char* p = reinterpret_cast<const char*>(pool + (slots[j] * kvh + h) * d);
        for (int64_t off = 0; off < width; off += 64)
            _mm_prefetch(p + off, static_cast<_mm_hint>(kHint));
    }
}
#endif

// Per-thread scratch of one work item.
struct Scratch {
    ReadAhead ahead;
    std::vector<float> q, m, l, acc, s, kt, vb, corr;
    std::vector<int64_t> lim;  // keys of the current segment each row may see (causal extends)
    std::vector<int> vis;  // keys of the current chunk each row sees (AVX-512)
    std::vector<uint32_t> pp;  // a chunk's probabilities as bf16 pairs, per row (AVX-512)
    // an int8 pool read in place (AVX512-BF16): a block's key codes as bf16, the chunk's
    // value scales
    std::vector<uint16_t> kc;
    std::vector<float> vsc;
    // ... and on VNNI (cpu_attend512_i8.h) the call's query rows as int8 codes, their scales
    // and sums; a chunk's probabilities as 8-bit codes per row, and their scales
    std::vector<int8_t> qi8;
    std::vector<float> qsc, psc;
    std::vector<int32_t> qsum;
    std::vector<uint8_t> pc;
    void fit(int rows, int d) {
        lim.resize(rows);
        vis.resize(rows);
        pp.resize(static_cast<size_t>(rows) * CHUNK / 2);
        q.resize(static_cast<size_t>(rows) * d);
        acc.resize(static_cast<size_t>(rows) * d);
        m.resize(rows);
        l.resize(rows);
        corr.resize(rows);
        s.resize(static_cast<size_t>(rows) * CHUNK);  // (>= BLK)
        kt.resize(static_cast<size_t>(d) * BLK);
        vb.resize(static_cast<size_t>(CHUNK) * d);
        kc.resize(static_cast<size_t>(BLK) * d);
        vsc.resize(CHUNK);
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
                const float ks = row_scale(kscale, row), vs = row_scale(vscale, row);
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

}  // namespace
