// Weight-only quantized linear layers on CPU: out[t, n] = sum_k x[t, k] * W[n, k] (+ bias[n]) with
// W stored as int8 with one scale per output row, or as 4-bit codes with a scale and a minimum per
// group of `group` inputs (W = code * scale + min, codes 0..15, scale and min float16). Activations and sums in float32.
//
// Layout (made once at load by banyan/layers/quant.py): the rows are cut into panels of 16; a
// panel stores, for each input k, its 16 rows' weights side by side (int8: 16 bytes; int4: one
// byte per row for each pair of inputs, k even in the low nibble). A step is then an outer
// product: one 16-wide weight vector is converted to float once and multiplied into every token
// of a block of up to 8 tokens, so there is no horizontal sum, the weights stream through memory
// once per token block (once per step for decode, where the bytes are the cost), and a panel
// stays in L1 while the token blocks reuse it. Panels are split across torch's OpenMP threads.
//
// AVX-512F/BW (no VNNI, BF16 or AMX needed), or AVX2 with FMA and F16C (a panel as two 8-lane
// halves: AMD Zen 2/3, Intel Haswell to Skylake client); a plain-loop path builds elsewhere.

#include <vector>

#include "cpu_int4_api.h"
#include "cpu_quant_common.h"
#include "cpu_team.h"

namespace {

#if defined(__AVX512F__)

// TB tokens x one int8 panel; U independent accumulators per token hide the FMA latency when
// TB is small (decode).
template <int TB, int U>
void int8_panel(const float* x, int64_t K, const int8_t* w, const float* scale, const float* bias,
                float* out, int64_t n_out, int64_t p) {
    __m512 acc[U][TB];
    for (int u = 0; u < U; ++u)
        for (int i = 0; i < TB; ++i) acc[u][i] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + U <= K; k += U) {
        fetch_codes_ahead(w, k * PANEL);
        for (int u = 0; u < U; ++u) {
            const __m512 wv = load_i8x16(w + (k + u) * PANEL);
            for (int i = 0; i < TB; ++i)
                acc[u][i] = _mm512_fmadd_ps(_mm512_set1_ps(x[i * K + k + u]), wv, acc[u][i]);
        }
    }
    for (; k < K; ++k) {
        const __m512 wv = load_i8x16(w + k * PANEL);
        for (int i = 0; i < TB; ++i)
            acc[0][i] = _mm512_fmadd_ps(_mm512_set1_ps(x[i * K + k]), wv, acc[0][i]);
    }
    const __m512 s = _mm512_loadu_ps(scale + p * PANEL);
    const __m512 b = bias ? _mm512_loadu_ps(bias + p * PANEL) : _mm512_setzero_ps();
    alignas(64) float vals[PANEL];
    for (int i = 0; i < TB; ++i) {
        __m512 sum = acc[0][i];
        for (int u = 1; u < U; ++u) sum = _mm512_add_ps(sum, acc[u][i]);
        _mm512_store_ps(vals, _mm512_fmadd_ps(sum, s, b));
        store_rows(out + i * n_out, vals, p, n_out);
    }
}

// TB tokens x one int4 panel. Per group: codes times x summed (lo/hi nibbles in separate
// accumulators), then acc += qsum * scale + xsum * min.
template <int TB, int U, typename S>
void int4_panel(const float* x, const float* xsum, int64_t K, int64_t group, const uint8_t* w,
                const S* scale, const S* mins, const float* bias, float* out,
                int64_t n_out, int64_t p) {
    const int64_t groups = K / group;
    const __m512i low4 = _mm512_set1_epi32(0xF);
    __m512 acc[TB];
    for (int i = 0; i < TB; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
        __m512 q[U][2][TB];
        for (int u = 0; u < U; ++u)
            for (int i = 0; i < TB; ++i) q[u][0][i] = q[u][1][i] = _mm512_setzero_ps();
        const uint8_t* wg = w + g * (group / 2) * PANEL;
        const int64_t k0 = g * group;
        fetch_scales_ahead(scale + (p * groups + g) * PANEL, group / 2 * PANEL, PANEL * sizeof(S));
        fetch_scales_ahead(mins + (p * groups + g) * PANEL, group / 2 * PANEL, PANEL * sizeof(S));
        for (int64_t j = 0; j < group / 2; j += U) {
            fetch_codes_ahead(wg, j * PANEL);
            for (int u = 0; u < U; ++u) {
                const __m512i bytes = _mm512_cvtepu8_epi32(
                    _mm_loadu_si128(reinterpret_cast<const __m128i*>(wg + (j + u) * PANEL)));
                const __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(bytes, low4));
                const __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4));
                const int64_t k = k0 + 2 * (j + u);
                for (int i = 0; i < TB; ++i) {
                    q[u][0][i] = _mm512_fmadd_ps(_mm512_set1_ps(x[i * K + k]), lo, q[u][0][i]);
                    q[u][1][i] = _mm512_fmadd_ps(_mm512_set1_ps(x[i * K + k + 1]), hi, q[u][1][i]);
                }
            }
        }
        const __m512 s = load_scale16(scale + (p * groups + g) * PANEL);
        const __m512 m = load_scale16(mins + (p * groups + g) * PANEL);
        for (int i = 0; i < TB; ++i) {
            __m512 sum = _mm512_add_ps(q[0][0][i], q[0][1][i]);
            for (int u = 1; u < U; ++u) sum = _mm512_add_ps(sum, _mm512_add_ps(q[u][0][i], q[u][1][i]));
            acc[i] = _mm512_fmadd_ps(sum, s, acc[i]);
            acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(xsum[i * groups + g]), m, acc[i]);
        }
    }
    for (int i = 0; i < TB; ++i) store_biased(acc[i], bias, out + i * n_out, p, n_out);
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

// As the AVX-512 int8_panel, each 16-row step as two 8-lane halves (h).
template <int TB, int U>
void int8_panel(const float* x, int64_t K, const int8_t* w, const float* scale, const float* bias,
                float* out, int64_t n_out, int64_t p) {
    __m256 acc[U][TB][2];
    for (int u = 0; u < U; ++u)
        for (int i = 0; i < TB; ++i) acc[u][i][0] = acc[u][i][1] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + U <= K; k += U) {
        fetch_codes_ahead(w, k * PANEL);
        for (int u = 0; u < U; ++u) {
            const __m256 w0 = load_i8x8(w + (k + u) * PANEL), w1 = load_i8x8(w + (k + u) * PANEL + 8);
            for (int i = 0; i < TB; ++i) {
                const __m256 xb = _mm256_set1_ps(x[i * K + k + u]);
                acc[u][i][0] = _mm256_fmadd_ps(xb, w0, acc[u][i][0]);
                acc[u][i][1] = _mm256_fmadd_ps(xb, w1, acc[u][i][1]);
            }
        }
    }
    for (; k < K; ++k) {
        const __m256 w0 = load_i8x8(w + k * PANEL), w1 = load_i8x8(w + k * PANEL + 8);
        for (int i = 0; i < TB; ++i) {
            const __m256 xb = _mm256_set1_ps(x[i * K + k]);
            acc[0][i][0] = _mm256_fmadd_ps(xb, w0, acc[0][i][0]);
            acc[0][i][1] = _mm256_fmadd_ps(xb, w1, acc[0][i][1]);
        }
    }
    alignas(32) float vals[PANEL];
    for (int i = 0; i < TB; ++i) {
        for (int h = 0; h < 2; ++h) {
            __m256 sum = acc[0][i][h];
            for (int u = 1; u < U; ++u) sum = _mm256_add_ps(sum, acc[u][i][h]);
            const __m256 sc = _mm256_loadu_ps(scale + p * PANEL + 8 * h);
            const __m256 b = bias ? _mm256_loadu_ps(bias + p * PANEL + 8 * h) : _mm256_setzero_ps();
            _mm256_store_ps(vals + 8 * h, _mm256_fmadd_ps(sum, sc, b));
        }
        store_rows(out + i * n_out, vals, p, n_out);
    }
}

// As the AVX-512 int4_panel, in two halves, with both nibbles of a byte summed into one
// accumulator (AVX2 has 16 vector registers, not 32).
template <int TB, int U, typename S>
void int4_panel(const float* x, const float* xsum, int64_t K, int64_t group, const uint8_t* w,
                const S* scale, const S* mins, const float* bias, float* out,
                int64_t n_out, int64_t p) {
    const int64_t groups = K / group;
    const __m256i low4 = _mm256_set1_epi32(0xF);
    __m256 acc[TB][2];
    for (int i = 0; i < TB; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
        __m256 q[U][TB][2];
        for (int u = 0; u < U; ++u)
            for (int i = 0; i < TB; ++i) q[u][i][0] = q[u][i][1] = _mm256_setzero_ps();
        const uint8_t* wg = w + g * (group / 2) * PANEL;
        const int64_t k0 = g * group;
        fetch_scales_ahead(scale + (p * groups + g) * PANEL, group / 2 * PANEL, PANEL * sizeof(S));
        fetch_scales_ahead(mins + (p * groups + g) * PANEL, group / 2 * PANEL, PANEL * sizeof(S));
        for (int64_t j = 0; j < group / 2; j += U) {
            fetch_codes_ahead(wg, j * PANEL);
            for (int u = 0; u < U; ++u) {
                const int64_t k = k0 + 2 * (j + u);
                for (int h = 0; h < 2; ++h) {
                    const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(
                        reinterpret_cast<const __m128i*>(wg + (j + u) * PANEL + 8 * h)));
                    const __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(bytes, low4));
                    const __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4));
                    for (int i = 0; i < TB; ++i) {
                        q[u][i][h] = _mm256_fmadd_ps(_mm256_set1_ps(x[i * K + k]), lo, q[u][i][h]);
                        q[u][i][h] = _mm256_fmadd_ps(_mm256_set1_ps(x[i * K + k + 1]), hi, q[u][i][h]);
                    }
                }
            }
        }
        for (int h = 0; h < 2; ++h) {
            const __m256 sc = load_scale8(scale + (p * groups + g) * PANEL + 8 * h);
            const __m256 m = load_scale8(mins + (p * groups + g) * PANEL + 8 * h);
            for (int i = 0; i < TB; ++i) {
                __m256 sum = q[0][i][h];
                for (int u = 1; u < U; ++u) sum = _mm256_add_ps(sum, q[u][i][h]);
                acc[i][h] = _mm256_fmadd_ps(sum, sc, acc[i][h]);
                acc[i][h] = _mm256_fmadd_ps(_mm256_set1_ps(xsum[i * groups + g]), m, acc[i][h]);
            }
        }
    }
    for (int i = 0; i < TB; ++i) store_biased(acc[i], bias, out + i * n_out, p, n_out);
}

// Longer steps: one panel's codes widened to float once ([K][16], `codes`), then TB tokens x
// the panel with the products and sums of int4_panel in the same order (a code is the same
// float either way, so every token keeps its bits). int4_panel widens the codes again for each
// block of MAX_TB tokens, as many instructions as its FMAs on AVX2.
template <int TB, typename S>
void int4_panel_widened(const float* x, const float* xsum, int64_t K, int64_t group,
                        const float* codes, const S* scale, const S* mins, const float* bias,
                        float* out, int64_t n_out, int64_t p) {
    const int64_t groups = K / group;
    __m256 acc[TB][2];
    for (int i = 0; i < TB; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
        __m256 q[TB][2];
        for (int i = 0; i < TB; ++i) q[i][0] = q[i][1] = _mm256_setzero_ps();
        for (int64_t k = g * group; k < (g + 1) * group; k += 2) {
            const float* c = codes + k * PANEL;
            const __m256 lo0 = _mm256_loadu_ps(c), lo1 = _mm256_loadu_ps(c + 8);
            const __m256 hi0 = _mm256_loadu_ps(c + PANEL), hi1 = _mm256_loadu_ps(c + PANEL + 8);
            for (int i = 0; i < TB; ++i) {
                const __m256 x0 = _mm256_set1_ps(x[i * K + k]);
                const __m256 x1 = _mm256_set1_ps(x[i * K + k + 1]);
                q[i][0] = _mm256_fmadd_ps(x1, hi0, _mm256_fmadd_ps(x0, lo0, q[i][0]));
                q[i][1] = _mm256_fmadd_ps(x1, hi1, _mm256_fmadd_ps(x0, lo1, q[i][1]));
            }
        }
        for (int h = 0; h < 2; ++h) {
            const __m256 sc = load_scale8(scale + (p * groups + g) * PANEL + 8 * h);
            const __m256 m = load_scale8(mins + (p * groups + g) * PANEL + 8 * h);
            for (int i = 0; i < TB; ++i) {
                acc[i][h] = _mm256_fmadd_ps(q[i][h], sc, acc[i][h]);
                acc[i][h] = _mm256_fmadd_ps(_mm256_set1_ps(xsum[i * groups + g]), m, acc[i][h]);
            }
        }
    }
    for (int i = 0; i < TB; ++i) store_biased(acc[i], bias, out + i * n_out, p, n_out);
}

// A panel's codes [K / 2][16] bytes as floats [K][16] (input k even in the low nibble).
inline void widen_codes(const uint8_t* w, int64_t K, float* codes) {
    for (int64_t j = 0; j < K / 2; ++j)
        for (int l = 0; l < PANEL; ++l) {
            codes[(2 * j) * PANEL + l] = static_cast<float>(w[j * PANEL + l] & 0xF);
            codes[(2 * j + 1) * PANEL + l] = static_cast<float>(w[j * PANEL + l] >> 4);
        }
}

#define BANYAN_INT4_WIDENED 1

#else  // portable loops, same layout and order of operations per lane

template <int TB, int U>
void int8_panel(const float* x, int64_t K, const int8_t* w, const float* scale, const float* bias,
                float* out, int64_t n_out, int64_t p) {
    float acc[TB][PANEL] = {};
    for (int64_t k = 0; k < K; ++k)
        for (int i = 0; i < TB; ++i)
            for (int l = 0; l < PANEL; ++l) acc[i][l] += x[i * K + k] * w[k * PANEL + l];
    float vals[PANEL];
    for (int i = 0; i < TB; ++i) {
        for (int l = 0; l < PANEL; ++l)
            vals[l] = acc[i][l] * scale[p * PANEL + l] + (bias ? bias[p * PANEL + l] : 0.0f);
        store_rows(out + i * n_out, vals, p, n_out);
    }
}

template <int TB, int U, typename S>
void int4_panel(const float* x, const float* xsum, int64_t K, int64_t group, const uint8_t* w,
                const S* scale, const S* mins, const float* bias, float* out,
                int64_t n_out, int64_t p) {
    const int64_t groups = K / group;
    float acc[TB][PANEL] = {};
    for (int64_t g = 0; g < groups; ++g) {
        float q[TB][PANEL] = {};
        for (int64_t j = 0; j < group / 2; ++j) {
            const int64_t k = g * group + 2 * j;
            const uint8_t* b = w + (g * (group / 2) + j) * PANEL;
            for (int i = 0; i < TB; ++i)
                for (int l = 0; l < PANEL; ++l)
                    q[i][l] += x[i * K + k] * (b[l] & 0xF) + x[i * K + k + 1] * (b[l] >> 4);
        }
        const S* s = scale + (p * groups + g) * PANEL;
        const S* m = mins + (p * groups + g) * PANEL;
        for (int i = 0; i < TB; ++i)
            for (int l = 0; l < PANEL; ++l)
                acc[i][l] += q[i][l] * scale_value(s[l]) + xsum[i * groups + g] * scale_value(m[l]);
    }
    for (int i = 0; i < TB; ++i) store_biased(acc[i], bias, out + i * n_out, p, n_out);
}

#endif  // __AVX512F__, AVX2

// Partial sums a token keeps per panel lane (int8: over all inputs; int4: per group, besides
// its low and high nibbles' own): the same for every token block, so that a token's sums, and
// its bits, are the same in a step of 1 as of 13 (a decode and a speculative check). The count
// once shrank as blocks grew (4 sums for 1 token, 1 for 5+), and the same token came out of a
// check with other last bits than decoded alone. AVX2 has half the registers.
#if defined(__AVX512F__)
constexpr int kInt8Sums = 4, kInt4Sums = 2;
#else
constexpr int kInt8Sums = 2, kInt4Sums = 1;
#endif

// The int4 driver over panels and token blocks, for float16 or float32 scales (S).
template <typename S>
void int4_linear(const float* x, int64_t T, int64_t K, int64_t group, const uint8_t* w,
                 const S* scale, const S* mins, const float* bias, float* out, int64_t N,
                 float* xsum, int64_t n_threads) {
    const int64_t panels = (N + PANEL - 1) / PANEL;
    const int64_t groups = K / group;
    group_sums(x, T, K, group, xsum, [](float v) { return v; });
#if defined(BANYAN_INT4_WIDENED)
    // Widened once per panel from 6 token blocks on: below that, widening a panel (up to 96 KiB
    // of floats, in L2) cost what it saved (measured on Zen 1: 1.0x at 16-32 tokens, 1.24-1.39x
    // at 512).
    if (T >= 6 * MAX_TB) {
        banyan_team::parallel_team(threads_for(panels, n_threads), [&](int tid, int n) {
            std::vector<float> codes(static_cast<size_t>(K) * PANEL);
            const banyan_team::Share share(panels, tid, n);
            for (int64_t p = share.begin; p < share.end; ++p) {
                widen_codes(w + p * (K / 2) * PANEL, K, codes.data());
                for_token_blocks(T, [&](int64_t t0, auto b) {
                    int4_panel_widened<decltype(b)::value>(x + t0 * K, xsum + t0 * groups, K,
                                                           group, codes.data(), scale, mins,
                                                           bias, out + t0 * N, N, p);
                });
            }
        });
        return;
    }
#endif
    banyan_team::parallel_for(panels, threads_for(panels, n_threads), [&](int64_t p) {
        const uint8_t* wp = w + p * (K / 2) * PANEL;
        for_token_blocks(T, [&](int64_t t0, auto b) {  // (kInt4Sums whatever the block)
            int4_panel<decltype(b)::value, kInt4Sums>(x + t0 * K, xsum + t0 * groups, K, group,
                                                       wp, scale, mins, bias, out + t0 * N, N, p);
        });
    });
}


}  // namespace

extern "C" {

// x [T, K] float32, w [panels, K, 16] int8, scale [panels * 16], bias [N] or null, out [T, N].
void banyan_int8_linear_f32(const float* x, int64_t T, int64_t K, const int8_t* w,
                            const float* scale, const float* bias, float* out, int64_t N,
                            int64_t n_threads) {
    const int64_t panels = (N + PANEL - 1) / PANEL;
    banyan_team::parallel_for(panels, threads_for(panels, n_threads), [&](int64_t p) {
        const int8_t* wp = w + p * K * PANEL;
        for_token_blocks(T, [&](int64_t t0, auto b) {  // (kInt8Sums whatever the block)
            int8_panel<decltype(b)::value, kInt8Sums>(x + t0 * K, K, wp, scale, bias,
                                                       out + t0 * N, N, p);
        });
    });
}

// x [T, K] float32 (K % group == 0, group even), w [panels, K / 2, 16] bytes, scale and mins
// [panels, K / group, 16] (float16, or float32 for the _s variant), bias [N] or null,
// out [T, N]; xsum: scratch [T, K / group].
void banyan_int4_linear_f32(const float* x, int64_t T, int64_t K, int64_t group,
                            const uint8_t* w, const uint16_t* scale, const uint16_t* mins,
                            const float* bias, float* out, int64_t N, float* xsum,
                            int64_t n_threads) {
    int4_linear(x, T, K, group, w, scale, mins, bias, out, N, xsum, n_threads);
}

void banyan_int4s_linear_f32(const float* x, int64_t T, int64_t K, int64_t group,
                             const uint8_t* w, const float* scale, const float* mins,
                             const float* bias, float* out, int64_t N, float* xsum,
                             int64_t n_threads) {
    int4_linear(x, T, K, group, w, scale, mins, bias, out, N, xsum, n_threads);
}

}  // extern "C"
