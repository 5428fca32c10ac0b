// Skinny float32 linear: out[t, n] = sum_k x[t, k] * w[n, k] (+ bias[n]) for a few tokens, with w
// in its plain [N, K] layout. Each weight row is read once per block of up to 8 tokens and dotted
// with all of them (8-lane partial sums, then a horizontal sum), so a step of 2-8 tokens (a decode
// checking speculative guesses, a small decode batch) reads the weights once, as a single-token
// GEMV does. oneDNN/MKL switch to a GEMM kernel from 2 rows that measured ~2x a GEMV on a 2-core
// Zen 3 (LM head: 1 row 9.0 ms, 2-8 rows 20 ms; this: 5.1-5.8 ms). GCC vector extensions: AVX2
// or AVX-512 code from the same source (-march=native). Below it, the same for bf16.
#include <algorithm>
#include <cstdint>
#include "cpu_team.h"

typedef float v8 __attribute__((vector_size(32)));

static inline float hsum(v8 v) {
    float s = 0.f;
    for (int i = 0; i < 8; ++i) s += v[i];
    return s;
}

// The bf16 twin: bf16 x and w, products summed in float32, each output rounded once to bf16
// (plus the bias first), as oneDNN's bf16 GEMM does; so a bf16 model's small steps (and the
// bf16 layer stack, which calls this same function) read the plain weight at the rate memory
// allows instead of going through oneDNN's GEMM with Python around every op. With AVX512_BF16,
// vdpbf16ps does two products a lane (exact in float32) and the masked loads take the tail;
// elsewhere the float32 loop below takes it, each value widened to float32 (a shift).
static inline float bf16_value(uint16_t v) {
    const uint32_t u = static_cast<uint32_t>(v) << 16;
    float f;
    __builtin_memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t round_to_bf16(float f) {  // nearest even, NaN kept (as torch)
    uint32_t u;
    __builtin_memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
    return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// 8 values as float32: float32 as they are, bf16 widened (a shift)
static inline v8 load8(const float* p) { v8 r; __builtin_memcpy(&r, p, sizeof r); return r; }
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
static inline v8 load8(const uint16_t* p) {
    u16x8 h;
    __builtin_memcpy(&h, p, sizeof h);
    const u32x8 u = __builtin_convertvector(h, u32x8) << 16;
    v8 r;
    __builtin_memcpy(&r, &u, sizeof r);
    return r;
}
static inline float value(float v) { return v; }
static inline float value(uint16_t v) { return bf16_value(v); }
static inline float stored(float s, const float*) { return s; }
static inline uint16_t stored(float s, const uint16_t*) { return round_to_bf16(s); }

// Weight rows [n0, n1) against TB tokens, 8-lane float32 sums: the float32 kernel, and the
// bf16 one where the CPU has no vdpbf16ps.
template <int TB, typename T>
static void rows(const T* x, int64_t K, const T* w, const T* bias, T* out, int64_t N, int64_t n0,
                 int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
        const T* wn = w + n * K;
        v8 acc[TB];
        for (int i = 0; i < TB; ++i) acc[i] = v8{};
        int64_t k = 0;
        for (; k + 8 <= K; k += 8) {
            const v8 wv = load8(wn + k);
            for (int i = 0; i < TB; ++i) acc[i] += load8(x + i * K + k) * wv;
        }
        for (int i = 0; i < TB; ++i) {
            float s = hsum(acc[i]);
            for (int64_t kk = k; kk < K; ++kk) s += value(x[i * K + kk]) * value(wn[kk]);
            out[i * N + n] = stored(s + (bias ? value(bias[n]) : 0.f), out);
        }
    }
}

#if defined(__AVX512BF16__)
#include <immintrin.h>

// 32 values; with Full false, only the first `left` (the rest read as 0)
template <bool Full>
static inline __m512bh load_pairs(const uint16_t* p, int64_t left) {
    if (Full) return (__m512bh)_mm512_loadu_si512(p);
    return (__m512bh)_mm512_maskz_loadu_epi16((1u << left) - 1u, p);
}

template <int TB, int RB, bool Full>
static inline void accumulate(__m512 (&acc)[RB][TB], const uint16_t* x, int64_t K,
                              const uint16_t* wn, int64_t k) {
    __m512bh wv[RB];
    for (int r = 0; r < RB; ++r) wv[r] = load_pairs<Full>(wn + r * K + k, K - k);
    for (int i = 0; i < TB; ++i) {
        const __m512bh xv = load_pairs<Full>(x + i * K + k, K - k);
        for (int r = 0; r < RB; ++r) acc[r][i] = _mm512_dpbf16_ps(acc[r][i], xv, wv[r]);
    }
}

// RB weight rows from row n against TB tokens: RB x TB independent sums in registers.
template <int TB, int RB>
static inline void block_bf16(const uint16_t* x, int64_t K, const uint16_t* w,
                              const uint16_t* bias, uint16_t* out, int64_t N, int64_t n) {
    const uint16_t* wn = w + n * K;
    __m512 acc[RB][TB];
    for (int r = 0; r < RB; ++r)
        for (int i = 0; i < TB; ++i) acc[r][i] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) accumulate<TB, RB, true>(acc, x, K, wn, k);
    if (k < K) accumulate<TB, RB, false>(acc, x, K, wn, k);
    for (int r = 0; r < RB; ++r) {
        const float b = bias ? bf16_value(bias[n + r]) : 0.f;
        for (int i = 0; i < TB; ++i)
            out[i * N + n + r] = round_to_bf16(_mm512_reduce_add_ps(acc[r][i]) + b);
    }
}

// Rows a pass: as many as the registers hold beside the tokens' sums (RB x TB sums, RB weight
// vectors and one token's): enough loads in flight to stream the weights at the memory's rate.
// 2 rows a pass at 5-8 tokens ran 1.5-1.7x slower than 3-5 on Zen 5 (12.6 vs 7.3 ms for SmolLM2's
// 120 projections at 5 tokens). Rows left over go through halving passes.
template <int TB, int RB>
static void rows_bf16_by(const uint16_t* x, int64_t K, const uint16_t* w, const uint16_t* bias,
                         uint16_t* out, int64_t N, int64_t n, int64_t n1) {
    for (; n + RB <= n1; n += RB) block_bf16<TB, RB>(x, K, w, bias, out, N, n);
    if constexpr (RB > 1) rows_bf16_by<TB, RB / 2>(x, K, w, bias, out, N, n, n1);
}

template <int TB>
static void rows_bf16(const uint16_t* x, int64_t K, const uint16_t* w, const uint16_t* bias,
                      uint16_t* out, int64_t N, int64_t n0, int64_t n1) {
    constexpr int RB = TB <= 2 ? 8 : TB <= 4 ? 6 : TB == 5 ? 5 : TB <= 7 ? 4 : 3;
    rows_bf16_by<TB, RB>(x, K, w, bias, out, N, n0, n1);
}
#else
template <int TB>
static void rows_bf16(const uint16_t* x, int64_t K, const uint16_t* w, const uint16_t* bias,
                      uint16_t* out, int64_t N, int64_t n0, int64_t n1) {
    rows<TB>(x, K, w, bias, out, N, n0, n1);
}
#endif

// A step's tokens in blocks of 8 against every weight row; the rows split evenly across the
// threads in multiples of 8 (chunks of 64 left one thread 5 of 9 chunks at N = 576).
struct F32Rows {
    using T = float;
    template <int TB>
    static void run(const T* x, int64_t K, const T* w, const T* bias, T* out, int64_t N,
                    int64_t n0, int64_t n1) {
        rows<TB>(x, K, w, bias, out, N, n0, n1);
    }
};

struct Bf16Rows {
    using T = uint16_t;
    template <int TB>
    static void run(const T* x, int64_t K, const T* w, const T* bias, T* out, int64_t N,
                    int64_t n0, int64_t n1) {
        rows_bf16<TB>(x, K, w, bias, out, N, n0, n1);
    }
};

template <typename R>
static void skinny(const typename R::T* x, int64_t T, int64_t K, const typename R::T* w,
                   const typename R::T* bias, typename R::T* out, int64_t N,
                   int64_t n_threads) {
    const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(n_threads, (N + 7) / 8));
    const int64_t chunk = (N + parts * 8 - 1) / (parts * 8) * 8;
    banyan_team::parallel_for(parts, parts, [&](int64_t c) {
        const int64_t n0 = c * chunk, n1 = std::min(N, n0 + chunk);
        for (int64_t t0 = 0; t0 < T; t0 += 8) {
            const int64_t tb = std::min<int64_t>(8, T - t0);
            const typename R::T* xt = x + t0 * K;
            typename R::T* ot = out + t0 * N;
            switch (tb) {
                case 1: R::template run<1>(xt, K, w, bias, ot, N, n0, n1); break;
                case 2: R::template run<2>(xt, K, w, bias, ot, N, n0, n1); break;
                case 3: R::template run<3>(xt, K, w, bias, ot, N, n0, n1); break;
                case 4: R::template run<4>(xt, K, w, bias, ot, N, n0, n1); break;
                case 5: R::template run<5>(xt, K, w, bias, ot, N, n0, n1); break;
                case 6: R::template run<6>(xt, K, w, bias, ot, N, n0, n1); break;
                case 7: R::template run<7>(xt, K, w, bias, ot, N, n0, n1); break;
                default: R::template run<8>(xt, K, w, bias, ot, N, n0, n1); break;
            }
        }
    });
}

extern "C" {

void banyan_skinny_linear_f32(const float* x, int64_t T, int64_t K, const float* w,
                              const float* bias, float* out, int64_t N, int64_t n_threads) {
    skinny<F32Rows>(x, T, K, w, bias, out, N, n_threads);
}

void banyan_skinny_linear_bf16(const uint16_t* x, int64_t T, int64_t K, const uint16_t* w,
                               const uint16_t* bias, uint16_t* out, int64_t N,
                               int64_t n_threads) {
    skinny<Bf16Rows>(x, T, K, w, bias, out, N, n_threads);
}

}  // extern "C"
