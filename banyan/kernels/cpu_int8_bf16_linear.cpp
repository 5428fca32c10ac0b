// int8 linears (a scale per output row, or per group of inputs) of a bf16 model's short steps
// (decodes, speculative checks: up to EXACT_STEP_TOKENS tokens; longer steps take the bf16
// GEMM, cpu_quant_gemm_bf16.cpp): out[t, n] = bf16(scale[n] * sum_k x[t, k] code[n, k] +
// bias[n]), x and out bf16, on the int8 panels of cpu_quant_linear.cpp and cpu_int8g_linear.cpp
// (byte k * 16 + r: input k of the panel's row r; per group, each group's sums scaled).
//
// Why: the float32 kernel on x widened converts each code to a float and multiplies it into
// one token per FMA, 16 products an instruction: steps of 8-16 tokens over SmolLM2's int8
// projections took 1.6-1.9x bf16's time (Zen 4). Here one vdpbf16ps multiplies 32 codes into a
// token, and 64 codes become those bf16 pairs in eight byte instructions: each magnitude's bf16
// low and high byte from two 128-entry tables (every int8 is exact in bf16), the sign bit put
// back (and -128's high byte), two permutes pairing inputs (k, k + 1) of a row in one 32-bit
// lane. Products of bf16 values are exact in float32: the sums are float32 sums of the exact
// products, as the float32 kernel's (in another order). 8-16 tokens now take 0.64-0.75x the
// float32 route's time, one token 0.86-0.88x (benchmarks/quant_gemm_streaming.py).
//
// Token blocks of at most 8, 2 partial sums per token whatever the block: a token's sums are
// the same bits in a step of 1 as in a step of 16. Built where the bf16 int4 kernel is
// (cpu_int4_api.h: AVX512-BF16 and VBMI); inputs a multiple of 4, else the callers keep the
// float32 kernel.

#include <cstring>

#include "cpu_avx512.h"
#include "cpu_int4_api.h"
#include "cpu_quant_common.h"
#include "cpu_team.h"

#if defined(BANYAN_CODES_BF16)
namespace {

// Tokens a pass over a panel, two partial sums each: 16 sums in registers. (Four sums a token
// in blocks of four converted each panel's codes once per four tokens: 16 tokens took 1.4x
// bf16's time, 8 tokens 1.1x.)
constexpr int kTokens = 8;

// 64 codes (inputs k .. k + 3 of a panel's 16 rows) -> two words of bf16 pairs: lane r of
// `first` holds (code[k][r], code[k + 1][r]), of `second` (code[k + 2][r], code[k + 3][r]).
struct CodePairs {
    __m512i lo0, lo1, hi0, hi1, first_idx, second_idx;
    const __m512i sign = _mm512_set1_epi8(static_cast<char>(0x80));
    const __m512i minus128 = _mm512_set1_epi8(static_cast<char>(0xC3));  // bf16 -128's high byte

    CodePairs() {
        alignas(64) static const Tables t = tables();
        lo0 = _mm512_load_si512(t.lo), lo1 = _mm512_load_si512(t.lo + 64);
        hi0 = _mm512_load_si512(t.hi), hi1 = _mm512_load_si512(t.hi + 64);
        first_idx = _mm512_load_si512(t.first), second_idx = _mm512_load_si512(t.second);
    }
    void operator()(const int8_t* codes, __m512i& first, __m512i& second) const {
        const __m512i c = _mm512_loadu_si512(codes);
        const __m512i mag = _mm512_abs_epi8(c);  // (index bit 7 unread by the table permutes)
        const __m512i lo = _mm512_permutex2var_epi8(lo0, mag, lo1);
        const __m512i hi = _mm512_mask_mov_epi8(  // high byte | (code & 0x80); -128 (a GGUF
            _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(hi0, mag, hi1), c, sign, 0xF8),
            _mm512_movepi8_mask(mag), minus128);  // file's, |code| 0x80 here) 0xC3, low 0
        first = _mm512_permutex2var_epi8(lo, first_idx, hi);
        second = _mm512_permutex2var_epi8(lo, second_idx, hi);
    }

  private:
    struct Tables {
        alignas(64) uint8_t lo[128];
        alignas(64) uint8_t hi[128];
        alignas(64) uint8_t first[64];  // byte 4r + 2i + h: table h (0 lo, 1 hi) at input k + i
        alignas(64) uint8_t second[64];  // the same for inputs k + 2, k + 3
    };
    static Tables tables() {  // the magnitudes' bf16 as the KV pools' int8 codes get theirs
        Tables t;
        alignas(64) int8_t codes[128];
        alignas(64) uint16_t bf16[128];
        for (int m = 0; m < 128; ++m) codes[m] = static_cast<int8_t>(m);
        for (int i = 0; i < 128; i += 32)
            _mm512_store_si512(bf16 + i, codes_bf16x32<I8>(codes + i));
        for (int m = 0; m < 128; ++m) {
            t.lo[m] = static_cast<uint8_t>(bf16[m] & 0xff);
            t.hi[m] = static_cast<uint8_t>(bf16[m] >> 8);
        }
        for (int r = 0; r < PANEL; ++r)
            for (int i = 0; i < 2; ++i)
                for (int h = 0; h < 2; ++h) {
                    t.first[4 * r + 2 * i + h] = static_cast<uint8_t>(64 * h + 16 * i + r);
                    t.second[4 * r + 2 * i + h] = static_cast<uint8_t>(64 * h + 16 * (i + 2) + r);
                }
        return t;
    }
};

// bf16 inputs k, k + 1 of a token as one 32-bit word, for every lane.
inline __m512bh input_pair(const uint16_t* x) {
    int32_t xx;
    std::memcpy(&xx, x, 4);
    return (__m512bh)_mm512_set1_epi32(xx);
}

// One panel for TB tokens. group 0: a scale per row (scale [panels * 16]), each token's two
// sums over all inputs scaled once; else a float32 scale per group of `group` inputs (GGUF's
// Q8_0 and Q6_K, scale [panels, K / group, 16]), each group's two sums scaled into a total.
template <int TB>
void panel_bf16(const CodePairs& pairs, const uint16_t* x, int64_t K, int64_t group,
                const int8_t* w, const float* scale, const float* bias, uint16_t* out,
                int64_t n_out, int64_t p) {
    const int64_t span = group > 0 ? group : K, groups = K / span;
    __m512 total[TB];
    for (int t = 0; t < TB; ++t) total[t] = _mm512_setzero_ps();
    __m512i word[2];
    for (int64_t g = 0; g < groups; ++g) {
        const float* sg = scale + (group > 0 ? (p * groups + g) * PANEL : p * PANEL);
        if (group > 0) fetch_scales_ahead(sg, group * PANEL, PANEL * sizeof(float));
        __m512 part[TB][2];  // part u: input pairs 2j + u
        for (int t = 0; t < TB; ++t) part[t][0] = part[t][1] = _mm512_setzero_ps();
        for (int64_t k = g * span; k < (g + 1) * span; k += 4) {  // word u: k + 2u, k + 2u + 1
            fetch_codes_ahead(w, k * PANEL);
            if constexpr (TB == 1) banyan_team::side_tick();  // (a line of a later op's)
            pairs(w + k * PANEL, word[0], word[1]);
            for (int t = 0; t < TB; ++t)
                for (int u = 0; u < 2; ++u)
                    part[t][u] = _mm512_dpbf16_ps(part[t][u], input_pair(x + t * K + k + 2 * u),
                                                  (__m512bh)word[u]);
        }
        // (fused multiply-adds here and below, as the float32 kernels and the GEMM scale)
        const __m512 s = group > 0 ? _mm512_loadu_ps(sg) : _mm512_setzero_ps();
        for (int t = 0; t < TB; ++t)
            total[t] = group > 0 ? _mm512_fmadd_ps(_mm512_add_ps(part[t][0], part[t][1]), s,
                                                   total[t])
                                 : _mm512_add_ps(part[t][0], part[t][1]);
    }
    const __m512 b = bias ? _mm512_loadu_ps(bias + p * PANEL) : _mm512_setzero_ps();
    const __m512 per_row = group > 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(scale + p * PANEL);
    const int64_t rows = std::min<int64_t>(PANEL, n_out - p * PANEL);
    for (int t = 0; t < TB; ++t) {
        const __m512 vals =
            group > 0 ? _mm512_add_ps(total[t], b) : _mm512_fmadd_ps(total[t], per_row, b);
        alignas(32) uint16_t rounded[PANEL];
        _mm256_store_si256(reinterpret_cast<__m256i*>(rounded), (__m256i)_mm512_cvtneps_pbh(vals));
        std::memcpy(out + t * n_out + p * PANEL, rounded, rows * sizeof(uint16_t));
    }
}

}  // namespace

extern "C" {

// x [T, K] bf16; w [panels, K, 16] int8 codes; group 0: scale [panels * 16] float32, one a
// row; else K % group == 0, scale [panels, K / group, 16] float32; bias [N] float32 or null;
// out [T, N] bf16. Inputs go in fours (a code word's pairs): K or a group not a multiple of 4
// -> 0, nothing computed, and the caller (layers/quant.py, the layer stack: this is their one
// rule) widens x for the float32 kernel; else 1.
int64_t banyan_int8_linear_bf16(const uint16_t* x, int64_t T, int64_t K, int64_t group,
                                const int8_t* w, const float* scale, const float* bias,
                                uint16_t* out, int64_t N, int64_t n_threads) {
    if (K % 4 != 0 || group % 4 != 0) return 0;
    const int64_t panels = (N + PANEL - 1) / PANEL;
    const CodePairs pairs;
    banyan_team::parallel_for(panels, threads_for(panels, n_threads), [&](int64_t p) {
        const int8_t* wp = w + p * K * PANEL;
        for (int64_t t0 = 0; t0 < T; t0 += kTokens)
            with_block<kTokens>(std::min<int64_t>(kTokens, T - t0), [&](auto block) {
                panel_bf16<decltype(block)::value>(pairs, x + t0 * K, K, group, wp, scale, bias,
                                                   out + t0 * N, N, p);
            });
    });
    return 1;
}

}  // extern "C"
#endif  // BANYAN_CODES_BF16
