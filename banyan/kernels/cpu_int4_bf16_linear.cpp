// int4 linears of a bf16 model's short steps (decode, a speculative check: T < 9 tokens; longer
// steps take the bf16 GEMM, cpu_quant_gemm_bf16.cpp): out[t, n] = bf16(sum_k x[t, k] * W[n, k]
// + bias[n]), x and out bf16, W = code * scale + min per group as in cpu_quant_linear.cpp, on
// the same panels (16 rows; byte (j, row) holds inputs 2j and 2j + 1 in its low / high nibble).
//
// Why: on Zen 4 (512-bit ops on 256-bit units) the float32 kernel widens each code to a float
// and FMAs it, ~7 vector instructions per 16 bytes of codes, and a decode's int4 projections
// ran at ~17 GB/s where bf16 weights stream at ~25. Here 16 bytes of codes become 16 bf16
// pairs in two instructions, and one vdpbf16ps multiplies them into a token: vpmultishiftqb
// puts each row's low nibble in the low byte of one bf16 word and its high nibble in the other,
// and one vpternlogd keeps the nibbles and sets the high bytes to 0x43, the exponent of 128,
// so that each word reads 128 + code exactly. The 128 x sum(x) that adds is taken out with the
// group minimum: sum x (code s + m) = s sum x (128 + code) + sum(x) (m - 128 s).
//
// The multishift picks bytes only within a quadword, so the 16 bytes are broadcast to each
// 128-bit lane and lane L of the sums holds row kRowOfLane[L] (lanes 4m + 2h + i hold row
// 8h + 2m + i); scales, minimums and the results are permuted once per group / panel.
//
// Token blocks of at most 4, with 4 partial sums per token per group whatever the block: a
// token's sums are the same in a step of 1 as in a step of 8. Built only with AVX512-BF16 and
// VBMI (cpu_int4_api.h's BANYAN_CODES_BF16).

#include <omp.h>

#include "cpu_dtypes.h"
#include "cpu_int4_api.h"
#include "cpu_quant_common.h"
#include "cpu_team.h"


#if defined(BANYAN_CODES_BF16)
namespace {

constexpr int kTokens = 4;  // tokens a pass over a panel: 4 x 4 partial sums in registers

// Lane L = 4m + 2h + i of the sums holds row 8h + 2m + i (see nibble_shifts), and back.
constexpr int row_of_lane(int lane) { return 8 * (lane / 2 % 2) + 2 * (lane / 4) + lane % 2; }
constexpr int lane_of_row(int row) { return 4 * (row % 8 / 2) + 2 * (row / 8) + row % 2; }
template <int (*F)(int)>
struct LaneTable {
    alignas(64) int32_t v[PANEL] = {};
    constexpr LaneTable() {
        for (int l = 0; l < PANEL; ++l) v[l] = F(l);
    }
};
constexpr LaneTable<row_of_lane> kRowOfLane;
constexpr LaneTable<lane_of_row> kLaneOfRow;

// Quadword 2m + h of the broadcast holds rows 8h..8h+7; its two lanes take rows 8h + 2m and
// 8h + 2m + 1: low nibble (bit 16m, 16m + 8) into bytes 0 / 4, high (+4) into bytes 2 / 6.
inline __m512i nibble_shifts() {
    alignas(64) uint8_t c[64] = {};
    for (int q = 0; q < 8; ++q) {
        const int m = q / 2;
        c[8 * q + 0] = static_cast<uint8_t>(16 * m);
        c[8 * q + 2] = static_cast<uint8_t>(16 * m + 4);
        c[8 * q + 4] = static_cast<uint8_t>(16 * m + 8);
        c[8 * q + 6] = static_cast<uint8_t>(16 * m + 12);
    }
    return _mm512_load_si512(c);
}

// A group's 16 scales (or minimums), from row order into the sums' lanes.
template <typename S>
inline __m512 scales_by_lane(const S* s) {
    return _mm512_permutexvar_ps(_mm512_load_si512(kRowOfLane.v), load_scale16(s));
}

template <int TB, typename S>
void panel_bf16(const uint16_t* x, const float* xsum, int64_t K, int64_t group, const uint8_t* w,
                const S* scale, const S* mins, const float* bias, uint16_t* out, int64_t n_out,
                int64_t p) {
    const int64_t groups = K / group;
    const __m512i shifts = nibble_shifts();
    const __m512i keep = _mm512_set1_epi32(0x000F000F), exponent = _mm512_set1_epi32(0x43004300);
    __m512 total[TB];
    for (int t = 0; t < TB; ++t) total[t] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* wg = w + g * (group / 2) * PANEL;
        const int64_t k0 = g * group;
        fetch_scales_ahead(scale + (p * groups + g) * PANEL, group / 2 * PANEL, PANEL * sizeof(S));
        fetch_scales_ahead(mins + (p * groups + g) * PANEL, group / 2 * PANEL, PANEL * sizeof(S));
        __m512 part[TB][4];
        for (int t = 0; t < TB; ++t)
            for (int u = 0; u < 4; ++u) part[t][u] = _mm512_setzero_ps();
        for (int64_t j = 0; j < group / 2; j += 4) {
            fetch_codes_ahead(wg, j * PANEL);
            if constexpr (TB == 1) banyan_team::side_tick();  // (a line of a later op's)
            for (int u = 0; u < 4; ++u) {
                const __m512i bytes = _mm512_broadcast_i32x4(
                    _mm_loadu_si128(reinterpret_cast<const __m128i*>(wg + (j + u) * PANEL)));
                const __m512i pairs = _mm512_ternarylogic_epi32(
                    _mm512_multishift_epi64_epi8(shifts, bytes), keep, exponent, 0xEA);
                for (int t = 0; t < TB; ++t) {
                    int32_t xx;
                    std::memcpy(&xx, x + t * K + k0 + 2 * (j + u), 4);
                    part[t][u] = _mm512_dpbf16_ps(part[t][u], (__m512bh)_mm512_set1_epi32(xx),
                                                  (__m512bh)pairs);
                }
            }
        }
        const __m512 s = scales_by_lane(scale + (p * groups + g) * PANEL);
        const __m512 m = _mm512_fnmadd_ps(_mm512_set1_ps(128.0f), s,
                                          scales_by_lane(mins + (p * groups + g) * PANEL));
        for (int t = 0; t < TB; ++t) {
            const __m512 sum = _mm512_add_ps(_mm512_add_ps(part[t][0], part[t][1]),
                                             _mm512_add_ps(part[t][2], part[t][3]));
            total[t] = _mm512_fmadd_ps(sum, s, total[t]);
            total[t] = _mm512_fmadd_ps(_mm512_set1_ps(xsum[t * groups + g]), m, total[t]);
        }
    }
    const __m512 b = bias ? _mm512_loadu_ps(bias + p * PANEL) : _mm512_setzero_ps();
    const int64_t rows = std::min<int64_t>(PANEL, n_out - p * PANEL);
    const __m512i back = _mm512_load_si512(kLaneOfRow.v);
    for (int t = 0; t < TB; ++t) {
        const __m512 vals = _mm512_add_ps(_mm512_permutexvar_ps(back, total[t]), b);
        alignas(32) uint16_t rounded[PANEL];
        _mm256_store_si256(reinterpret_cast<__m256i*>(rounded), (__m256i)_mm512_cvtneps_pbh(vals));
        std::memcpy(out + t * n_out + p * PANEL, rounded, rows * sizeof(uint16_t));
    }
}

template <typename S>
void linear_bf16(const uint16_t* x, int64_t T, int64_t K, int64_t group, const uint8_t* w,
                 const S* scale, const S* mins, const float* bias, uint16_t* out, int64_t N,
                 float* xsum, int64_t n_threads) {
    const int64_t panels = (N + PANEL - 1) / PANEL;
    const int64_t groups = K / group;
    // the bf16 values the dot products see, summed in float32
    group_sums(x, T, K, group, xsum, [](uint16_t v) { return bf16_to_f32(v); });
    banyan_team::parallel_for(panels, threads_for(panels, n_threads), [&](int64_t p) {
        const uint8_t* wp = w + p * (K / 2) * PANEL;
        for (int64_t t0 = 0; t0 < T; t0 += kTokens) {
            const uint16_t* xt = x + t0 * K;
            const float* st = xsum + t0 * groups;
            uint16_t* ot = out + t0 * N;
            switch (std::min<int64_t>(kTokens, T - t0)) {
                case 1: panel_bf16<1>(xt, st, K, group, wp, scale, mins, bias, ot, N, p); break;
                case 2: panel_bf16<2>(xt, st, K, group, wp, scale, mins, bias, ot, N, p); break;
                case 3: panel_bf16<3>(xt, st, K, group, wp, scale, mins, bias, ot, N, p); break;
                default: panel_bf16<4>(xt, st, K, group, wp, scale, mins, bias, ot, N, p); break;
            }
        }
    });
}

}  // namespace

extern "C" {

// x [T, K] bf16 (K % group == 0, group 32 / 64 / 128), w [panels, K / 2, 16] bytes, scale and
// mins [panels, K / group, 16]: float16, or float32 where `wide`; bias [N] float32 or null;
// out [T, N] bf16; xsum: scratch [T, K / group] float32.
void banyan_int4_linear_bf16(const uint16_t* x, int64_t T, int64_t K, int64_t group,
                             const uint8_t* w, const void* scale, const void* mins, int64_t wide,
                             const float* bias, uint16_t* out, int64_t N, float* xsum,
                             int64_t n_threads) {
    if (wide)
        linear_bf16(x, T, K, group, w, static_cast<const float*>(scale),
                    static_cast<const float*>(mins), bias, out, N, xsum, n_threads);
    else
        linear_bf16(x, T, K, group, w, static_cast<const uint16_t*>(scale),
                    static_cast<const uint16_t*>(mins), bias, out, N, xsum, n_threads);
}

}  // extern "C"
#endif  // BANYAN_CODES_BF16

// Whether banyan_int4_linear_bf16 is built here.
extern "C" int64_t banyan_int4_linear_bf16_vector() {
#if defined(BANYAN_CODES_BF16)
    return 1;
#else
    return 0;
#endif
}
