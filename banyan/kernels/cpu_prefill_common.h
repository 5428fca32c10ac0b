// What both paths of cpu_prefill_attention.cpp share: the tile width, one thread's buffers and
// the online-softmax update of a block of scores (float32, vectorised over rows).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

// GCC vectorises for 256-bit registers on most AVX-512 CPUs unless told otherwise; the tiles
// below are sized for two registers of the widest kind (12 accumulators), so ask for 512.
#if defined(__AVX512F__) && defined(__GNUC__) && !defined(__clang__)
#pragma GCC target("prefer-vector-width=512")
#endif

namespace {

#if defined(__AVX512F__)
constexpr int VLEN = 16;  // floats per vector register
#else
constexpr int VLEN = 8;  // AVX2 (and the SSE / portable builds: GCC splits the tiles)
#endif
constexpr int NV = 2 * VLEN;  // the vector width of a tile: rows of S^T, columns of O
constexpr int BK = 64;        // keys per block
constexpr float kLog2e = 1.44269504088896341f;  // the softmax's exponentials in base 2

// Both always inlined: the softmax's `omp simd` loops call them per lane, and an out-of-line
// call leaves those loops scalar. (GCC stopped inlining exp_nonpos_fma into attend_pairs when
// the tile dispatch became in_tiles' lambdas: the shared-prefix 8 x 8 decode step of
// benchmarks/decode_attention.py went from 21-26 to 49-66 ms on Zen 5.)
#define BANYAN_ALWAYS_INLINE inline __attribute__((always_inline))

BANYAN_ALWAYS_INLINE float fmadd(float a, float b, float c) {
#if defined(__FMA__) || defined(__AVX512F__) || defined(__ARM_FEATURE_FMA)
    return __builtin_fmaf(a, b, c);
#else
    return a * b + c;  // no FMA unit: a library fmaf call would be far slower
#endif
}

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

template <int M, typename F>
inline void last_tile(int64_t left, int64_t i0, F& tile) {
    if constexpr (M > 0) {
        if (left == M)
            tile(std::integral_constant<int, M>{}, i0);
        else
            last_tile<M - 1>(left, i0, tile);
    }
}

// tile(std::integral_constant<int, M>{}, i0) over [0, n): tiles of Full, then one of the
// n % Full left, so every tile's size is a compile-time constant (its sums stay in registers).
template <int Full, typename F>
inline void in_tiles(int64_t n, F&& tile) {
    int64_t i0 = 0;
    for (; i0 + Full <= n; i0 += Full) tile(std::integral_constant<int, Full>{}, i0);
    last_tile<Full - 1>(n - i0, i0, tile);
}

// One thread's buffers. rp: rows padded to NV; dv: head dim padded to NV (the padding columns
// of V stay zero, so the padding columns of O are zero and never written out).
struct Buffers {
    std::vector<float> qt, kb, vb, st, o, m, l, corr;
    std::vector<int32_t> lim;  // keys each row sees (contexts < 2^31)
    // the bf16 pair path's (cpu_prefill_pairs.h): Q^T, probabilities and values as bf16 pairs
    // in 32-bit words, and the block's key rows copied out of the pool; on tiles
    // (cpu_prefill_tiles.h) the values' pairs transposed too
    std::vector<uint32_t> qp, pp, vp, vt;
    std::vector<uint16_t> kb16;
    int64_t rp = 0, dv = 0;  // this item's; the arrays hold `cap` rows
    int64_t cap = 0;
    void fit(int64_t rows, int64_t d) {
        // rp is the item's own (a short last block of a chunk after full ones computes its own
        // padded rows, not the widest item's); the arrays grow only
        const int64_t dv_new = round_up(d, NV);
        rp = round_up(rows, NV);
        if (rp <= cap && dv_new == dv) return;
        cap = std::max(cap, rp);
        dv = dv_new;
        qt.assign(d * cap, 0.0f);
        kb.assign(BK * d, 0.0f);
        vb.assign(BK * dv, 0.0f);
        st.assign(BK * cap, 0.0f);
        o.assign(cap * dv, 0.0f);
        m.assign(cap, 0.0f);
        l.assign(cap, 0.0f);
        corr.assign(cap, 0.0f);
        lim.assign(cap, 0);
    }
};

// exp(x) for x <= 0 (clamped at -87): exp_clamped's polynomial with fused multiply-adds,
// as the AVX2 row kernel's exp256_nonpos computes it.
BANYAN_ALWAYS_INLINE float exp_nonpos_fma(float x) {
    x = x > -87.0f ? x : -87.0f;
    const float fx = std::floor(fmadd(x, 1.44269504088896341f, 0.5f));
    float r = fmadd(fx, -0.693359375f, x);
    r = fmadd(fx, 2.12194440e-4f, r);
    const float z = r * r;
    float y = 1.9875691500e-4f;
    y = fmadd(y, r, 1.3981999507e-3f);
    y = fmadd(y, r, 8.3334519073e-3f);
    y = fmadd(y, r, 4.1665795894e-2f);
    y = fmadd(y, r, 1.6666665459e-1f);
    y = fmadd(y, r, 5.0000001201e-1f);
    y = fmadd(y, z, r + 1.0f);
    const int32_t bits = (static_cast<int32_t>(fx) + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, 4);
    return y * scale;
}

// A diagonal block's scores (st [nk][rp], keys from k0): those of keys a row does not see
// (key >= lim[r]) become -inf, the others taken into the rows' maxima (corr).
inline void mask_block(Buffers& b, int64_t k0, int64_t nk) {
    const int64_t rp = b.rp;
    float* mx = b.corr.data();
    const int32_t* lim = b.lim.data();
    for (int64_t j = 0; j < nk; ++j) {
        float* s = b.st.data() + j * rp;
        const int32_t key = static_cast<int32_t>(k0 + j);
#pragma omp simd
        for (int64_t r = 0; r < rp; ++r) {
            const float v = key < lim[r] ? s[r] : -INFINITY;
            s[r] = v;
            mx[r] = mx[r] > v ? mx[r] : v;
        }
    }
}

// The rows' state after a block whose maxima corr holds: m moves to them, corr becomes the
// correction exp(m_old - m_new) of their sums l (sum: this block's) and accumulators. Rows that
// have seen no key yet hold m = -inf: the correction clamps to ~1e-38 and multiplies l = 0 and
// o = 0 (never NaN). A row whose max stays: exactly 1.
BANYAN_ALWAYS_INLINE void move_max(Buffers& b, int64_t r, float sum) {
    const float c = exp_nonpos_fma(b.m[r] - b.corr[r]);
    b.m[r] = b.corr[r];
    b.corr[r] = c;
    b.l[r] = fmadd(b.l[r], c, sum);
}

// The online-softmax update of rows [0, rp) for one block of nk keys starting at key k0:
// st [nk][rp] scores in, probabilities out (0 where masked); corr: the rows' new maxima in
// (merged by the score tiles, unless kCausal), exp(m_old - m_new) out. kCausal (the diagonal
// blocks only): row r sees keys < lim[r]; the scores of the others become -inf.
template <bool kCausal>
void softmax_block(Buffers& b, int64_t k0, int64_t nk) {
    const int64_t rp = b.rp;
    float* st = b.st.data();
    float* mx = b.corr.data();
    const int32_t* lim = b.lim.data();
    if constexpr (kCausal) mask_block(b, k0, nk);
    // NV rows at a time, their maxima and sums in registers
    for (int64_t r0 = 0; r0 < rp; r0 += NV) {
        float mv[NV], sum[NV];
#pragma omp simd
        for (int r = 0; r < NV; ++r) {
            mv[r] = mx[r0 + r];
            sum[r] = 0.0f;
        }
        for (int64_t j = 0; j < nk; ++j) {
            float* s = st + j * rp + r0;
            const int32_t key = static_cast<int32_t>(k0 + j);
            // exp(-inf - max) clamps to exp(-87), not 0: masked keys are zeroed explicitly
#pragma omp simd
            for (int r = 0; r < NV; ++r) {
                const float p = exp_nonpos_fma(s[r] - mv[r]);
                s[r] = (!kCausal || key < lim[r0 + r]) ? p : 0.0f;
                sum[r] += s[r];
            }
        }
#pragma omp simd
        for (int r = 0; r < NV; ++r) move_max(b, r0 + r, sum[r]);
    }
}

}  // namespace
