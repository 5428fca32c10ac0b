// Fused element-wise ops of the Llama layer on CPU: RMSNorm with the residual add before it,
// SiLU-and-mul of the gate/up projection, and RoPE on the fused qkv projection (with Qwen3's
// per-head q/k RMSNorm before it).
//
// In PyTorch each of these is 3-9 ops, every one a pass over memory with its own dispatch and,
// in bf16, conversions to float32 and back; on a 2-core CPU they took a quarter of a prefill.
// Here each is one pass per row in float32 that rounds to the tensor's dtype exactly where the
// PyTorch composition (and the Hugging Face reference) rounds, i.e. after every op, so bf16
// results equal torch's up to the last bit of a float32 sum or exp.
//
// Plain loops the compiler vectorises, and AVX-512 intrinsics for SiLU, whose exp the compiler
// vectorises poorly (-O3 -march=native, -ffp-contract=off so no product is fused into an add
// that torch rounds separately); rows are split across torch's OpenMP threads when there are
// enough of them. bf16 conversions of the AVX-512 path flush subnormals to zero.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cpu_avx512.h"
#include "cpu_dtypes.h"
#include "cpu_team.h"

namespace {

// Fewer elements: one thread (a decode's rows). From 4,096 (8 rows of a 576-wide norm, 3 of a
// 1,536-wide SiLU) the threads share the rows: a speculative check of 12-13 tokens through the
// whole bf16 stack took 0.97-0.98x the time it took with the bar at 32,768 (Zen 4, the two
// builds alternated step by step), 1 and 64 tokens unchanged.
constexpr int64_t kParallelElems = 1 << 12;

inline int threads_for(int64_t elems, int64_t n_threads) {
    return static_cast<int>(elems >= kParallelElems ? n_threads : 1);
}

// Branch-free bf16 rounding of a float (NaN kept NaN), so the loops below vectorise.
inline float round_bf16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    const uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    const uint32_t out = (u & 0x7fffffffu) > 0x7f800000u ? (u | 0x00400000u) & 0xffff0000u : r;
    float g;
    std::memcpy(&g, &out, 4);
    return g;
}

template <typename C>
inline float rnd(float x) {
    if constexpr (std::is_same<C, BF16>::value) return round_bf16(x);
    return x;
}

template <typename C>
inline typename C::T st(float x) {  // x already rounded: exact
    if constexpr (std::is_same<C, BF16>::value) {
        uint32_t u;
        std::memcpy(&u, &x, 4);
        return static_cast<uint16_t>(u >> 16);
    } else {
        return x;
    }
}

// One row of HF's RMSNorm: w * (x * rsqrt(mean(x^2) + eps)) rounded after the normalisation and
// after the weight (x, the input, already in the dtype).
template <typename C>
inline void norm_row(const typename C::T* x, const typename C::T* w, typename C::T* out,
                     int64_t n, float eps) {
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t e = 0; e < n; ++e) {
        const float v = C::load(x[e]);
        ss += v * v;
    }
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
#pragma omp simd
    for (int64_t e = 0; e < n; ++e)
        out[e] = st<C>(rnd<C>(C::load(w[e]) * rnd<C>(C::load(x[e]) * inv)));
}

// residual (in place) = residual + add (when add is given); out = RMSNorm(residual) * w.
template <typename C>
void add_rms_norm(typename C::T* residual, const typename C::T* add, const typename C::T* w,
                  typename C::T* out, int64_t rows, int64_t n, float eps, int64_t n_threads) {
    banyan_team::parallel_for(rows, threads_for(rows * n, n_threads), [&](int64_t r) {
        typename C::T* x = residual + r * n;
        if (add != nullptr) {
            const typename C::T* a = add + r * n;
#pragma omp simd
            for (int64_t e = 0; e < n; ++e) x[e] = st<C>(rnd<C>(C::load(x[e]) + C::load(a[e])));
        }
        norm_row<C>(x, w, out + r * n, n, eps);
    });
}

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__) && \
    defined(__AVX512VL__)
// Masked loads and stores only for a row's tail: on AMD a masked store costs several plain ones.
inline __m512 load16m(const float* p, __mmask16 m) {
    return m == 0xffff ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(m, p);
}
inline __m512 load16m(const uint16_t* p, __mmask16 m) {
    const __m256i h = m == 0xffff ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
                                  : _mm256_maskz_loadu_epi16(m, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 round16(__m512 v, float) { return v; }
inline __m512 round16(__m512 v, uint16_t) {  // to bf16 and back (nearest even)
    const __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline void store16m(float* p, __m512 v, __mmask16 m) {
    if (m == 0xffff)
        _mm512_storeu_ps(p, v);
    else
        _mm512_mask_storeu_ps(p, m, v);
}
inline void store16m(uint16_t* p, __m512 v, __mmask16 m) {
    const __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
    if (m == 0xffff)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h);
    else
        _mm256_mask_storeu_epi16(p, m, h);
}
#define BANYAN_SILU_AVX512 1
#endif

// out[r] = silu(gate[r]) * up[r] for gate_up [rows, 2 * n] (gate first): torch rounds silu's
// result, then the product.
template <typename C>
void silu_and_mul(const typename C::T* gate_up, typename C::T* out, int64_t rows, int64_t n,
                  int64_t n_threads) {
    banyan_team::parallel_for(rows, threads_for(rows * n, n_threads), [&](int64_t r) {
        const typename C::T* g = gate_up + r * 2 * n;
        const typename C::T* u = g + n;
        typename C::T* o = out + r * n;
#if defined(BANYAN_SILU_AVX512)
        // exp's range reduction needs floor, which the compiler only vectorises poorly here
        const typename C::T tag{};
        for (int64_t e = 0; e < n; e += 16) {
            const __mmask16 m = n - e >= 16 ? 0xffff : static_cast<__mmask16>((1u << (n - e)) - 1);
            const __m512 x = load16m(g + e, m);
            const __m512 ex = exp512(_mm512_sub_ps(_mm512_setzero_ps(), x));
            // below -87 exp(-x) is clamped: silu is ~0 there (torch: a subnormal or 0)
            const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
            const __m512 s = round16(
                _mm512_maskz_div_ps(live, x, _mm512_add_ps(_mm512_set1_ps(1.0f), ex)), tag);
            store16m(o + e, round16(_mm512_mul_ps(s, load16m(u + e, m)), tag), m);
        }
#else
        int64_t e = 0;
#if defined(__AVX2__) && defined(__F16C__)
        // float32 on AVX2: GCC's own vectorisation of the loop below took ~5 ns an element on
        // Zen 3 (a second division for the clamped case, blends); this is the same arithmetic
        // step for step (bit for bit the loop's results) with one division per 8.
        if constexpr (std::is_same<C, F32>::value)
            for (; e + 8 <= n; e += 8) {
                const __m256 x = _mm256_loadu_ps(g + e);
                const __m256 neg = _mm256_xor_ps(x, _mm256_set1_ps(-0.0f));
                const __m256 s = _mm256_div_ps(
                    x, _mm256_add_ps(_mm256_set1_ps(1.0f), exp256_clamped(neg)));
                const __m256 dead = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ);
                _mm256_storeu_ps(o + e, _mm256_mul_ps(_mm256_andnot_ps(dead, s),
                                                      _mm256_loadu_ps(u + e)));
            }
#endif
#pragma omp simd
        for (int64_t i = e; i < n; ++i) {
            const float x = C::load(g[i]);
            const float s = x < -87.0f ? 0.0f : rnd<C>(x / (1.0f + exp_clamped(-x)));
            o[i] = st<C>(rnd<C>(s * C::load(u[i])));
        }
#endif
    });
}

// One head vector in the NeoX half layout: [x1, x2] -> [x1 c - x2 s, x2 c + x1 s], each product
// and each sum rounded (HF: x * cos + rotate_half(x) * sin).
template <typename C>
inline void rotate(const typename C::T* x, const typename C::T* cos, const typename C::T* sin,
                   typename C::T* out, int64_t half) {
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
        const float a = C::load(x[i]), b = C::load(x[i + half]);
        const float c = C::load(cos[i]), s = C::load(sin[i]);
        out[i] = st<C>(rnd<C>(rnd<C>(a * c) - rnd<C>(b * s)));
        out[i + half] = st<C>(rnd<C>(rnd<C>(b * c) + rnd<C>(a * s)));
    }
}

// q_out [rows, H, D], k_out [rows, KVH, D] = RoPE of the q and k heads of qkv rows (stride
// `stride` elements; q heads first, then k). With q_norm/k_norm weights, each head is
// RMSNormed first (Qwen3).
template <typename C>
void rope_qk(const typename C::T* qkv, int64_t stride, const typename C::T* cos,
             const typename C::T* sin, const typename C::T* q_norm, const typename C::T* k_norm,
             float eps, typename C::T* q_out, typename C::T* k_out, int64_t rows, int64_t heads,
             int64_t kvh, int64_t d, int64_t n_threads) {
    const int64_t half = d / 2;
    const int threads = threads_for(rows * (heads + kvh) * d, n_threads);
    banyan_team::parallel_for(rows, threads, [&](int64_t r) {
        typename C::T normed[512];  // one head after its norm (d <= 512, checked by the caller)
        const typename C::T* c = cos + r * half;
        const typename C::T* s = sin + r * half;
        for (int64_t h = 0; h < heads + kvh; ++h) {
            const bool is_q = h < heads;
            const typename C::T* x = qkv + r * stride + h * d;
            typename C::T* o = is_q ? q_out + (r * heads + h) * d : k_out + (r * kvh + h - heads) * d;
            const typename C::T* w = is_q ? q_norm : k_norm;
            if (w != nullptr) {
                norm_row<C>(x, w, normed, d, eps);
                x = normed;
            }
            rotate<C>(x, c, s, o, half);
        }
    });
}

}  // namespace

extern "C" {

#define BANYAN_FUSED_OPS(SUFFIX, C)                                                            \
    void banyan_add_rms_norm_##SUFFIX(C::T* residual, const C::T* add, const C::T* w,         \
                                      C::T* out, int64_t rows, int64_t n, float eps,          \
                                      int64_t n_threads) {                                    \
        add_rms_norm<C>(residual, add, w, out, rows, n, eps, n_threads);                      \
    }                                                                                         \
    void banyan_silu_and_mul_##SUFFIX(const C::T* gate_up, C::T* out, int64_t rows,           \
                                      int64_t n, int64_t n_threads) {                         \
        silu_and_mul<C>(gate_up, out, rows, n, n_threads);                                    \
    }                                                                                         \
    void banyan_rope_qk_##SUFFIX(const C::T* qkv, int64_t stride, const C::T* cos,            \
                                 const C::T* sin, const C::T* q_norm, const C::T* k_norm,     \
                                 float eps, C::T* q_out, C::T* k_out, int64_t rows,           \
                                 int64_t heads, int64_t kvh, int64_t d, int64_t n_threads) {  \
        rope_qk<C>(qkv, stride, cos, sin, q_norm, k_norm, eps, q_out, k_out, rows, heads,     \
                   kvh, d, n_threads);                                                        \
    }

BANYAN_FUSED_OPS(f32, F32)
BANYAN_FUSED_OPS(bf16, BF16)

}  // extern "C"
