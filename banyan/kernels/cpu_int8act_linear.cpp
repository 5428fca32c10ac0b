// Quantized linears with 8-bit activations (--activation-quant int8): the activation rows are
// quantized once per call to int8 with one float32 scale per block of 32 inputs (as llama.cpp
// quantizes them for Q8_0: d = max|x| / 127, q = x / d rounded half to even), and each weight
// block is multiplied by integer dot products: AVX2's vpmaddubsw (u8 x s8 -> pairs summed in
// int16) and vpmaddwd (int16 pairs -> int32), 32 multiply-adds an instruction where the float32
// path (cpu_quant_linear.cpp, cpu_int8g_linear.cpp) widens, converts and FMAs 8. Opt-in: its
// outputs are those of the quantized activations, no longer exact against float32.
//
// Layout (banyan/layers/int8_activations.py repacks the float path's panels into it at load):
// the float kernels' 16-row panels, each cut into two halves of 8 rows; a 256-bit register holds
// 8 rows x 4 consecutive inputs, so one broadcast of a token's 4 activation bytes multiplies all
// 8 rows (an outer product: no horizontal sums, and the weights loaded once per block of up to
// ATB tokens).
// - int4 (codes 0..15, scale and min per group of 32/64/128): per half, per block of 32 inputs,
//   4 x 32 bytes: byte (j, row, i) holds the code of input 8j + i in its low nibble and of
//   8j + 4 + i in its high one. Codes are unsigned, so vpmaddubsw takes them as they are; a
//   block's 8 products per lane stay below 8 x 2 x 15 x 127 = 30,480 and sum in int16.
// - int8 (codes -128..127, a float32 scale per group of 16/32 inputs, or per row: group = K):
//   per half, per 4 inputs, 8 rows x 4 bytes. vpmaddubsw wants one unsigned operand: |w| with
//   the sign moved onto the activation (llama.cpp's trick), pairs <= 2 x 128 x 127 < 2^15.
// - int5 (GGUF's Q5_0: codes -16..15 plus 16, float16 scale and min -16 d per 32 inputs): the
//   int4 layout plus a plane of fifth bits (int5_half), 0.75 bytes a weight instead of 1.25.
// A weight group's scale multiplies each block's int32 sum by (scale x d); an int4 minimum adds
// min x d x sum(q) of the block, and a fixed one (Q4_0's -8 d, Q5_0's -16 d) is taken into the
// int32 sum (cpu_int8act_halves.h). Each loop prefetches its weights 2 KiB ahead (at batch 1
// these kernels are read-bound: one Zen 3 core's hardware prefetch alone kept ~2/3 of a read).
//
// AVX2 (Zen 2/3, Intel Haswell on; AVX-512 machines take it too), with vpdpbusd in place of
// each vpmaddubsw + vpmaddwd pair where the CPU has AVX512-VNNI or AVX-VNNI (the same integer
// sums: the tests check both builds against one reference); a plain-loop path builds elsewhere.
// With AVX512-VNNI, int4 steps of 2 tokens or more and int8 steps of 4 or more take whole panels
// in 512-bit registers (cpu_int8act_panels512.h) on the same bytes.

#if defined(__SSE__)
#include <xmmintrin.h>
#endif

#include "cpu_dtypes.h"
#include "cpu_int8act_halves.h"
#include "cpu_int8act_panels512.h"
#include "cpu_team.h"

namespace {

// Row t's blocks: d = max|x| / 127 (0 for a zero block), q = nearbyint(x * (1 / d)) clamped to
// +-127, all in float32 so that the tests reproduce them exactly.
void quantize_row(const float* x, int64_t K, int8_t* q, float* d, float* dsum, int32_t* qsum) {
    for (int64_t b = 0; b < K / QB; ++b) {
        const float* xb = x + b * QB;
        float top = 0.0f;
        for (int k = 0; k < QB; ++k) top = std::max(top, std::fabs(xb[k]));
        const float scale = top / 127.0f;
        const float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
        int32_t sum = 0;
#if defined(__AVX2__) && defined(__FMA__)
        const __m256 iv = _mm256_set1_ps(inv), hi = _mm256_set1_ps(127.0f);
        __m256i codes[4];
        for (int v = 0; v < 4; ++v) {
            __m256 r = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xb + 8 * v), iv),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            r = _mm256_max_ps(_mm256_min_ps(r, hi), _mm256_sub_ps(_mm256_setzero_ps(), hi));
            codes[v] = _mm256_cvtps_epi32(r);
        }
        alignas(32) int32_t lanes[QB];
        for (int v = 0; v < 4; ++v)
            _mm256_store_si256(reinterpret_cast<__m256i*>(lanes + 8 * v), codes[v]);
        for (int k = 0; k < QB; ++k) {
            q[b * QB + k] = static_cast<int8_t>(lanes[k]);
            sum += lanes[k];
        }
#else
        for (int k = 0; k < QB; ++k) {
            const float r = std::min(127.0f, std::max(-127.0f, std::nearbyint(xb[k] * inv)));
            q[b * QB + k] = static_cast<int8_t>(r);
            sum += static_cast<int32_t>(r);
        }
#endif
        d[b] = scale;
        dsum[b] = scale * static_cast<float>(sum);
        qsum[b] = sum;
    }
}

// The activations of one call, quantized once (not per output tile); kept per calling thread
// between calls, as the layer stack keeps its scratch.
// Denormal operands and results make float instructions take microcode assists on Zen 4: 127
// 64-decode steps on random tokens ran the q8 stack 14% slower than bf16's (whose vdpbf16ps
// flushes them itself), on one repeated token 7% faster, and with the flush below 7-8% faster
// (which activations hold the denormals was not traced). While a thread runs these loops its
// float steps flush them (FTZ, DAZ), the caller's mode restored after: values under 1.2e-38
// count as zero.
#if defined(__SSE__)
struct FlushDenormals {
    const unsigned saved = _mm_getcsr();
    FlushDenormals() { _mm_setcsr(saved | 0x8040); }
    ~FlushDenormals() { _mm_setcsr(saved); }
};
#else
struct FlushDenormals {};  // (no assists to avoid, or no such mode)
#endif

// A row of x as float32: itself, or a bf16 row widened (exactly) into `wide`.
inline const float* as_f32(const float* x, int64_t, std::vector<float>&) { return x; }
inline const float* as_f32(const uint16_t* x, int64_t K, std::vector<float>& wide) {
    wide.resize(K);
    for (int64_t k = 0; k < K; ++k) wide[k] = bf16_to_f32(x[k]);
    return wide.data();
}

template <typename X>
const QRows& quantize(const X* x, int64_t T, int64_t K, int64_t n_threads) {
    static thread_local QRows r;
    const int64_t blocks = K / QB;
    r.q.resize(T * K);
    r.d.resize(T * blocks);
    r.dsum.resize(T * blocks);
    r.qsum.resize(T * blocks);
    QRows* rp = &r;
    banyan_team::parallel_for(T, (T > 4) ? threads_for(T, n_threads) : 1, [&](int64_t t) {
        const FlushDenormals flush;
        static thread_local std::vector<float> wide;
        quantize_row(as_f32(x + t * K, K, wide), K, rp->q.data() + t * K,
                     rp->d.data() + t * blocks, rp->dsum.data() + t * blocks,
                     rp->qsum.data() + t * blocks);
    });
    return r;
}

// A result stored as it is, or rounded to bf16 (to nearest even, as torch's .to(bfloat16)).
inline void put(float* out, float v) { *out = v; }
inline void put(uint16_t* out, float v) { *out = f32_to_bf16(v); }

#if defined(__AVX512F__)
// 16 of them under `mask`, with put's bits. (Plain stores for whole panels measured the same
// as masked ones here, Zen 5.)
inline void put16(float* out, __m512 v, __mmask16 mask) { _mm512_mask_storeu_ps(out, mask, v); }
inline void put16(uint16_t* out, __m512 v, __mmask16 mask) {
    _mm512_mask_cvtepi32_storeu_epi16(out, mask, f32_to_bf16_16(v));
}
#endif

// Results for tb tokens (token i's `count` rows at res[i * stride]) plus the bias, into rows
// row0.. of out: a vector of them a token where AVX-512 has one (the scalar store of each value
// cost ~16% of a 64-token int4 layer's panels on Zen 5).
template <typename O>
void store_rows(const float* res, int64_t stride, int64_t tb, const float* bias, O* out,
                int64_t N, int64_t row0, int64_t count) {
#if defined(__AVX512F__)
    const __mmask16 mask = static_cast<__mmask16>((1u << count) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + row0) : _mm512_setzero_ps();
    for (int64_t i = 0; i < tb; ++i)
        put16(out + i * N + row0, _mm512_add_ps(_mm512_maskz_loadu_ps(mask, res + i * stride), b),
              mask);
#else
    for (int64_t i = 0; i < tb; ++i)
        for (int64_t r = 0; r < count; ++r)
            put(out + i * N + row0 + r, res[i * stride + r] + (bias ? bias[row0 + r] : 0.0f));
#endif
}

// One block of tb (1..TB) tokens, through the loop instantiated for exactly tb.
template <int TB, typename Half>
void run_block(const Half& half, int64_t tb, int64_t t0, int64_t u, float* res) {
    if constexpr (TB > 1) {
        if (tb < TB) return run_block<TB - 1>(half, tb, t0, u, res);
    }
    half.template run<TB>(t0, u, res);
}

// The driver: every (panel, half) a unit of work split across threads, token blocks of ATB
// inside; half(TB, t0, p, h, res) computes one block's results.
template <typename Half, typename O>
void over_halves(int64_t T, int64_t N, const float* bias, O* out, int64_t n_threads,
                 Half half) {
    const int64_t units = 2 * ((N + PANEL - 1) / PANEL);
    banyan_team::parallel_for(units, threads_for(units, n_threads), [&](int64_t u) {
        const FlushDenormals flush;
        const int64_t row0 = u * HALF;
        if (row0 >= N) return;  // the padding half of the last panel
        alignas(32) float res[ATB * HALF];
        for (int64_t t0 = 0; t0 < T; t0 += ATB) {
            const int64_t tb = std::min<int64_t>(ATB, T - t0);
            run_block<ATB>(half, tb, t0, u, res);
            store_rows(res, HALF, tb, bias, out + t0 * N, N, row0,
                       std::min<int64_t>(HALF, N - row0));
        }
    });
}

template <typename S>
struct Int4Half {
    const QRows& a;
    int64_t K, group;
    const uint8_t* w;
    const S *scale, *mins;
    template <int TB>
    void run(int64_t t0, int64_t u, float* res) const {
        const int64_t p = u / 2, h = u % 2, groups = K / group;
        const int64_t at = p * groups * PANEL + h * HALF;
        const uint8_t* wu = w + u * (K * HALF / 2);
        if constexpr (TB == 1)  // a decode's own loop
            int4_half1(a, t0, K, group, wu, scale + at, mins ? mins + at : nullptr, res);
        else
            int4_half<TB>(a, t0, K, group, wu, scale + at, mins ? mins + at : nullptr, res);
    }
};

struct Int8Weights {  // an int8 layer's codes and scales, and one call's activations
    const QRows& a;
    int64_t K, group;
    const int8_t* w;
    const float* scale;
};

struct Int8Half : Int8Weights {
    template <int TB>
    void run(int64_t t0, int64_t u, float* res) const {
        const int64_t p = u / 2, h = u % 2, groups = K / group;
        int8_half<TB>(a, t0, K, group, w + u * (K * HALF), scale + p * groups * PANEL + h * HALF,
                      res);
    }
};

struct Int5Half {  // groups of 32 (Q5_0): float16 scale and min per block
    const QRows& a;
    int64_t K;
    const uint8_t *w, *high;
    const uint16_t *scale, *mins;
    template <int TB>
    void run(int64_t t0, int64_t u, float* res) const {  // 2 tokens at a time at most
        const int64_t at = (u / 2) * (K / QB) * PANEL + (u % 2) * HALF;
        const uint8_t* wu = w + u * (K * HALF / 2);
        const uint8_t* hu = high + u * (K / QB) * 32;
        const uint16_t* mu = mins ? mins + at : nullptr;
        for (int i = 0; i < TB; i += 2) {
            if (TB - i >= 2)
                int5_half<2>(a, t0 + i, K, wu, hu, scale + at, mu, res + i * HALF);
            else
                int5_half<1>(a, t0 + i, K, wu, hu, scale + at, mu, res + i * HALF);
        }
    }
};

#if defined(BANYAN_Q8_PANELS)
// Steps of at least this many tokens take the 512-bit panel loops; fewer keep the halves', whose
// batch-1 loop streams the weights (twice the units to share among threads, prefetched).
constexpr int64_t kPanelMinTokens = 2;
// int8 codes from 4 (SmolLM2's 120 projections, Zen 4, halves -> panels: 2 tokens 6.0 -> 6.9
// ms, 4 tokens 8.2 -> 7.8, 8 tokens 11.4 -> 10.1, 64 tokens 46.7 -> 31.1): a byte a weight,
// short steps are read-bound, where the halves' loop prefetches its weights.
constexpr int64_t kInt8PanelMinTokens = 4;

template <typename S>
struct Int4Panel {  // run_block's unit: panel p (both its half panels), PTB tokens a pass
    const QRows& a;
    int64_t K, group;
    const uint8_t* w;
    const S *scale, *mins;
    template <int TB>
    void run(int64_t t0, int64_t p, float* res) const {
        const int64_t at = p * (K / group) * PANEL;
        const uint8_t* w0 = w + 2 * p * (K * HALF / 2);
        int4_panel<TB>(a, t0, K, group, w0, w0 + K * HALF / 2, scale + at,
                       mins ? mins + at : nullptr, res);
    }
};

template <typename S>
struct Int4PanelPair {  // run_block's unit: panels 2u and 2u + 1 of one's layer, TB2 a pass
    const Int4Panel<S>& one;
    template <int TB>
    void run(int64_t t0, int64_t u, float* res) const {
        const Int4Panel<S>& l = one;
        const int64_t p = 2 * u, at = p * (l.K / l.group) * PANEL;
        int4_panel2<TB>(l.a, t0, l.K, l.group, l.w + 2 * p * (l.K * HALF / 2), l.K * HALF,
                        l.scale + at, l.mins ? l.mins + at : nullptr, res);
    }
};

// Panel p's results of a token block (token i at res[i * PANEL]) into out.
template <typename O>
void store_panel(const float* res, int64_t p, int64_t tb, const float* bias, O* out,
                 int64_t N) {
    store_rows(res, PANEL, tb, bias, out, N, p * PANEL, std::min<int64_t>(PANEL, N - p * PANEL));
}

struct Int8Panel : Int8Weights {  // run_block's unit: panel p alone, PTB tokens a pass
    template <int TB>
    void run(int64_t t0, int64_t p, float* res) const {
        int8_panels<TB, 1>(a, t0, K, group, w + 2 * p * K * HALF, 0,
                           scale + p * (K / group) * PANEL, res, TB);
    }
};

struct Int8PanelPair {  // run_block's unit: panels 2u and 2u + 1, TB2 tokens a pass
    const Int8Panel& one;
    template <int TB>
    void run(int64_t t0, int64_t u, float* res) const {
        const Int8Panel& l = one;
        const int64_t p = 2 * u;
        int8_panels<TB, 2>(l.a, t0, l.K, l.group, l.w + 2 * p * l.K * HALF, 2 * l.K * HALF,
                           l.scale + p * (l.K / l.group) * PANEL, res, TB2);
    }
};

// over_halves with pairs of whole panels as the units (TB2 tokens a pass: pair.run), a last
// odd panel alone (PTB tokens a pass: one.run).
template <typename Pair, typename One, typename O>
void over_panels(const Pair& pair, const One& one, int64_t T, const float* bias, O* out,
                 int64_t N, int64_t n_threads) {
    const int64_t panels = (N + PANEL - 1) / PANEL, units = (panels + 1) / 2;
    banyan_team::parallel_for(units, threads_for(units, n_threads), [&](int64_t u) {
        const FlushDenormals flush;
        alignas(64) float res[std::max(PTB, 2 * TB2) * PANEL];
        const int64_t p = 2 * u;
        const int64_t step = p + 1 < panels ? TB2 : PTB;
        for (int64_t t0 = 0; t0 < T; t0 += step) {
            const int64_t tb = std::min<int64_t>(step, T - t0);
            if (p + 1 < panels) {
                run_block<TB2>(pair, tb, t0, u, res);
                store_panel(res, p, tb, bias, out + t0 * N, N);
                store_panel(res + TB2 * PANEL, p + 1, tb, bias, out + t0 * N, N);
            } else {
                run_block<PTB>(one, tb, t0, p, res);
                store_panel(res, p, tb, bias, out + t0 * N, N);
            }
        }
    });
}
#endif

template <typename S, typename X, typename O>
void q8_int4(const X* x, int64_t T, int64_t K, int64_t group, const uint8_t* w,
             const S* scale, const S* mins, const float* bias, O* out, int64_t N,
             int64_t n_threads) {
    const QRows& a = quantize(x, T, K, n_threads);
#if defined(BANYAN_Q8_PANELS)
    if (T >= kPanelMinTokens) {
        const Int4Panel<S> panel{a, K, group, w, scale, mins};
        return over_panels(Int4PanelPair<S>{panel}, panel, T, bias, out, N, n_threads);
    }
#endif
    over_halves(T, N, bias, out, n_threads, Int4Half<S>{a, K, group, w, scale, mins});
}

template <typename X, typename O>
void q8_int8(const X* x, int64_t T, int64_t K, int64_t group, const int8_t* w,
             const float* scale, const float* bias, O* out, int64_t N, int64_t n_threads) {
    const QRows& a = quantize(x, T, K, n_threads);
#if defined(BANYAN_Q8_PANELS)
    if (T >= kInt8PanelMinTokens && group % QB == 0) {  // (groups of 16: the halves)
        const Int8Panel panel{{a, K, group, w, scale}};
        return over_panels(Int8PanelPair{panel}, panel, T, bias, out, N, n_threads);
    }
#endif
    over_halves(T, N, bias, out, n_threads, Int8Half{{a, K, group, w, scale}});
}

template <typename X, typename O>
void q8_int5(const X* x, int64_t T, int64_t K, const uint8_t* w, const uint16_t* scale,
             const uint16_t* mins, const float* bias, O* out, int64_t N, int64_t n_threads) {
    const uint8_t* high = w + (N + PANEL - 1) / PANEL * PANEL * K / 2;
    const QRows& a = quantize(x, T, K, n_threads);
    over_halves(T, N, bias, out, n_threads, Int5Half{a, K, w, high, scale, mins});
}

}  // namespace

extern "C" {

// x [T, K] float32 (K % 32 == 0, group % 32 == 0), w: the int4 half panels (see the top),
// scale and mins [panels, K / group, 16] float16 (or float32 for _q8_int4s_; mins null: -8 x
// scale, Q4_0), bias [N] or null,
// out [T, N].
void banyan_q8_int4_linear_f32(const float* x, int64_t T, int64_t K, int64_t group,
                               const uint8_t* w, const uint16_t* scale, const uint16_t* mins,
                               const float* bias, float* out, int64_t N, int64_t n_threads) {
    q8_int4(x, T, K, group, w, scale, mins, bias, out, N, n_threads);
}

void banyan_q8_int4s_linear_f32(const float* x, int64_t T, int64_t K, int64_t group,
                                const uint8_t* w, const float* scale, const float* mins,
                                const float* bias, float* out, int64_t N, int64_t n_threads) {
    q8_int4(x, T, K, group, w, scale, mins, bias, out, N, n_threads);
}

// x [T, K] float32 (K % 32 == 0; group 16, a multiple of 32, or K for a scale per row), w: the
// int8 half panels, scale [panels, K / group, 16] float32, bias [N] or null, out [T, N].
void banyan_q8_int8_linear_f32(const float* x, int64_t T, int64_t K, int64_t group,
                               const int8_t* w, const float* scale, const float* bias,
                               float* out, int64_t N, int64_t n_threads) {
    q8_int8(x, T, K, group, w, scale, bias, out, N, n_threads);
}

// As banyan_q8_int4_linear_f32 for 5-bit codes (group 32; mins null: -16 x scale, Q5_0): w the
// low nibbles as int4, then the fifth bits, [panels * 2, K / 32, 32] (see int5_half): one
// buffer, as the layer stack passes one pointer a weight.
void banyan_q8_int5_linear_f32(const float* x, int64_t T, int64_t K, const uint8_t* w,
                               const uint16_t* scale, const uint16_t* mins, const float* bias,
                               float* out, int64_t N, int64_t n_threads) {
    q8_int5(x, T, K, w, scale, mins, bias, out, N, n_threads);
}

// Any of the above on a bf16 x [T, K] (widened exactly) with out [T, N] bf16 (each float32
// result rounded to nearest even): the bits of the float32 entry between x.float() and
// .to(bfloat16), without those passes. kind: 0 int4, 1 int4 with float32 scales, 2 int8, 3 int5
// (whose group is 32); the scale, mins and weight of that kind's entry.
void banyan_q8_linear_bf16(int64_t kind, const uint16_t* x, int64_t T, int64_t K,
                           int64_t group, const void* w, const void* scale, const void* mins,
                           const float* bias, uint16_t* out, int64_t N, int64_t n_threads) {
    const auto* codes = static_cast<const uint8_t*>(w);
    const auto* half_scale = static_cast<const uint16_t*>(scale);
    const auto* half_mins = static_cast<const uint16_t*>(mins);
    switch (kind) {
        case 0:
            return q8_int4(x, T, K, group, codes, half_scale, half_mins, bias, out, N, n_threads);
        case 1:
            return q8_int4(x, T, K, group, codes, static_cast<const float*>(scale),
                           static_cast<const float*>(mins), bias, out, N, n_threads);
        case 2:
            return q8_int8(x, T, K, group, static_cast<const int8_t*>(w),
                           static_cast<const float*>(scale), bias, out, N, n_threads);
        default:
            return q8_int5(x, T, K, codes, half_scale, half_mins, bias, out, N, n_threads);
    }
}

// The activation quantization alone (for the tests): q [T, K] int8, d [T, K / 32] float32.
void banyan_q8_quantize_f32(const float* x, int64_t T, int64_t K, int8_t* q, float* d) {
    const QRows& a = quantize(x, T, K, 1);
    std::memcpy(q, a.q.data(), static_cast<size_t>(T * K));
    std::memcpy(d, a.d.data(), static_cast<size_t>(T * (K / QB)) * sizeof(float));
}

}  // extern "C"
