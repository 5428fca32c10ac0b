// Weight-only int8 with one float32 scale per group of `group` inputs of a row (GGUF's Q8_0 at
// group 32, its blocks kept as they are): out[t, n] = sum_g scale[n, g] * sum_{k in g} x[t, k]
// * code[n, k] (+ bias[n]). Same panel layout as the per-row int8 kernel (cpu_quant_linear.cpp:
// a panel's 16 rows' codes for one input side by side), one 16-wide scale vector per group.
// Activations and sums in float32; AVX-512F, AVX2 + FMA, or plain loops.

#include "cpu_quant_common.h"
#include "cpu_team.h"

namespace {

#if defined(__AVX512F__)

template <int TB, int U>
void int8g_panel(const float* x, int64_t K, int64_t group, const int8_t* w, const float* scale,
                 const float* bias, float* out, int64_t n_out, int64_t p) {
    const int64_t groups = K / group;
    __m512 acc[TB];
    for (int i = 0; i < TB; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
        __m512 q[U][TB];
        for (int u = 0; u < U; ++u)
            for (int i = 0; i < TB; ++i) q[u][i] = _mm512_setzero_ps();
        const int8_t* wg = w + g * group * PANEL;
        const int64_t k0 = g * group;
        fetch_scales_ahead(scale + (p * groups + g) * PANEL, group * PANEL, PANEL * sizeof(float));
        for (int64_t j = 0; j < group; j += U) {
            fetch_codes_ahead(wg, j * PANEL);
            for (int u = 0; u < U; ++u) {
                const __m512 wv = load_i8x16(wg + (j + u) * PANEL);
                for (int i = 0; i < TB; ++i)
                    q[u][i] = _mm512_fmadd_ps(_mm512_set1_ps(x[i * K + k0 + j + u]), wv, q[u][i]);
            }
        }
        const __m512 s = _mm512_loadu_ps(scale + (p * groups + g) * PANEL);
        for (int i = 0; i < TB; ++i) {
            __m512 sum = q[0][i];
            for (int u = 1; u < U; ++u) sum = _mm512_add_ps(sum, q[u][i]);
            acc[i] = _mm512_fmadd_ps(sum, s, acc[i]);
        }
    }
    for (int i = 0; i < TB; ++i) store_biased(acc[i], bias, out + i * n_out, p, n_out);
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

// As the AVX-512 version, each 16-row step as two 8-lane halves (h).
template <int TB, int U>
void int8g_panel(const float* x, int64_t K, int64_t group, const int8_t* w, const float* scale,
                 const float* bias, float* out, int64_t n_out, int64_t p) {
    const int64_t groups = K / group;
    __m256 acc[TB][2];
    for (int i = 0; i < TB; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
        __m256 q[U][TB][2];
        for (int u = 0; u < U; ++u)
            for (int i = 0; i < TB; ++i) q[u][i][0] = q[u][i][1] = _mm256_setzero_ps();
        const int8_t* wg = w + g * group * PANEL;
        const int64_t k0 = g * group;
        fetch_scales_ahead(scale + (p * groups + g) * PANEL, group * PANEL, PANEL * sizeof(float));
        for (int64_t j = 0; j < group; j += U) {
            fetch_codes_ahead(wg, j * PANEL);
            for (int u = 0; u < U; ++u) {
                const int8_t* wk = wg + (j + u) * PANEL;
                const __m256 w0 = load_i8x8(wk), w1 = load_i8x8(wk + 8);
                for (int i = 0; i < TB; ++i) {
                    const __m256 xb = _mm256_set1_ps(x[i * K + k0 + j + u]);
                    q[u][i][0] = _mm256_fmadd_ps(xb, w0, q[u][i][0]);
                    q[u][i][1] = _mm256_fmadd_ps(xb, w1, q[u][i][1]);
                }
            }
        }
        for (int h = 0; h < 2; ++h) {
            const __m256 s = _mm256_loadu_ps(scale + (p * groups + g) * PANEL + 8 * h);
            for (int i = 0; i < TB; ++i) {
                __m256 sum = q[0][i][h];
                for (int u = 1; u < U; ++u) sum = _mm256_add_ps(sum, q[u][i][h]);
                acc[i][h] = _mm256_fmadd_ps(sum, s, acc[i][h]);
            }
        }
    }
    for (int i = 0; i < TB; ++i) store_biased(acc[i], bias, out + i * n_out, p, n_out);
}

#else  // portable loops, same layout and order of operations per lane

template <int TB, int U>
void int8g_panel(const float* x, int64_t K, int64_t group, const int8_t* w, const float* scale,
                 const float* bias, float* out, int64_t n_out, int64_t p) {
    const int64_t groups = K / group;
    float acc[TB][PANEL] = {};
    for (int64_t g = 0; g < groups; ++g) {
        float q[TB][PANEL] = {};
        for (int64_t j = 0; j < group; ++j) {
            const int64_t k = g * group + j;
            for (int i = 0; i < TB; ++i)
                for (int l = 0; l < PANEL; ++l) q[i][l] += x[i * K + k] * w[k * PANEL + l];
        }
        const float* s = scale + (p * groups + g) * PANEL;
        for (int i = 0; i < TB; ++i)
            for (int l = 0; l < PANEL; ++l) acc[i][l] += q[i][l] * s[l];
    }
    for (int i = 0; i < TB; ++i) store_biased(acc[i], bias, out + i * n_out, p, n_out);
}

#endif  // __AVX512F__, AVX2

// Partial sums a token keeps per group and panel lane, the same for every token block: a
// token's bits then do not depend on its step's size (a decode, a speculative check). The count
// once shrank as blocks grew, and a GGUF model's Q8_0 head gave a check's tokens other logits
// than their decodes (greedy text with a draft parted from the plain one).
#if defined(__AVX512F__)
constexpr int kGroupSums = 4;
#else
constexpr int kGroupSums = 2;  // (AVX2: half the registers)
#endif

}  // namespace

extern "C" {

// x [T, K] float32 (K % group == 0, group % 4 == 0), w [panels, K, 16] int8, scale
// [panels, K / group, 16] float32, bias [N] or null, out [T, N].
void banyan_int8g_linear_f32(const float* x, int64_t T, int64_t K, int64_t group,
                             const int8_t* w, const float* scale, const float* bias, float* out,
                             int64_t N, int64_t n_threads) {
    const int64_t panels = (N + PANEL - 1) / PANEL;
    banyan_team::parallel_for(panels, threads_for(panels, n_threads), [&](int64_t p) {
        const int8_t* wp = w + p * K * PANEL;
        for_token_blocks(T, [&](int64_t t0, auto b) {  // (kGroupSums whatever the block)
            int8g_panel<decltype(b)::value, kGroupSums>(x + t0 * K, K, group, wp, scale, bias,
                                                        out + t0 * N, N, p);
        });
    });
}

}  // extern "C"
