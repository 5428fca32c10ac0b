// The 8-bit-activation int4 and int8 linears on AVX512-VNNI, for steps of several tokens: a whole
// panel (16 output rows) at a time in 512-bit registers, vpdpbusd making 64 u8 x s8 products an
// instruction, twice the 256-bit loops' (cpu_int8act_halves.h) and twice vdpbf16ps's 32, which
// caps the bf16 path's GEMM (cpu_quant_gemm_bf16.cpp). The weights are the halves' own layout
// (cpu_int8act_linear.cpp's top comment): a panel's two half panels side by side, one 256-bit load
// each, so batch-1 steps keep the halves' loops on the same bytes. The integer sums and the float
// steps per lane are those of the halves' loops (int4_half, int8_half): the tests' one reference
// checks both. Measured (Zen 5, 2 threads, a 3,072 x 576 layer, float32 activations): 4 tokens 554
// against the halves' 352 GOP/s, 16 tokens 868 against 425, 64 tokens 925 against 389.
#pragma once

#include "cpu_int8act_halves.h"

namespace {

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__) && \
    defined(__F16C__)
#define BANYAN_Q8_PANELS 1

// Tokens sharing one pass over a panel: a float sum and an integer one each (16 registers);
// the weights unpacked once per block of 32 inputs serve all of them. (Two integer chains a
// token, or the previous block's float steps interleaved with this one's products, measured no
// faster on Zen 5: ~1.2 vpdpbusd a cycle either way, the float steps a block costing ~25%.)
constexpr int PTB = 8;

// 32 bytes of each half panel: rows 0-7 in the low half of the register, 8-15 in the high one.
inline __m512i both_halves(const uint8_t* h0, const uint8_t* h1) {
    const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(h0));
    const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(h1));
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

// acc + u x (p's 4 bytes in every lane). (An embedded-broadcast operand in place of the
// vpbroadcastd, written in asm since GCC does not fold it, measured the same.)
inline __m512i dot4_broadcast(__m512i acc, __m512i u, const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm512_dpbusd_epi32(acc, u, _mm512_set1_epi32(v));
}

// TB tokens x one int4 panel (w0, w1: its half panels' blocks; scale, mins: its 16 lanes of
// group 0, the next group PANEL further on; mins null: -8 x scale) -> res [TB][16].
template <int TB, typename S>
void int4_panel(const QRows& a, int64_t t0, int64_t K, int64_t group, const uint8_t* w0,
                const uint8_t* w1, const S* scale, const S* mins, float* res) {
    const int64_t blocks = K / QB, per = group / QB;
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    const int8_t* q0 = a.q.data() + t0 * K;
    __m512 acc[TB];
    for (int i = 0; i < TB; ++i) acc[i] = _mm512_setzero_ps();
    int64_t g = 0, in_group = 0;
    for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* b0 = w0 + b * (QB * HALF / 2);
        const uint8_t* b1 = w1 + b * (QB * HALF / 2);
        __m512i dot[TB];
        for (int i = 0; i < TB; ++i) dot[i] = _mm512_setzero_si512();
        for (int j = 0; j < 4; ++j) {
            const __m512i v = both_halves(b0 + 32 * j, b1 + 32 * j);
            const __m512i lo = _mm512_and_si512(v, low4);
            const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
            const int8_t* q = q0 + b * QB + 8 * j;
            for (int i = 0; i < TB; ++i)
                dot[i] = dot4_broadcast(dot[i], lo, q + i * K);
            for (int i = 0; i < TB; ++i)
                dot[i] = dot4_broadcast(dot[i], hi, q + i * K + 4);
        }
        const __m512 sc = load_scale16(scale + g * PANEL);
        const __m512 mn = mins ? load_scale16(mins + g * PANEL) : _mm512_setzero_ps();
        if (++in_group == per) in_group = 0, ++g;
        for (int i = 0; i < TB; ++i) {
            const int64_t at = (t0 + i) * blocks + b;
            __m512i isum = dot[i];
            if (!mins)
                isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(kInt4Offset * a.qsum[at]));
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum),
                                     _mm512_mul_ps(sc, _mm512_set1_ps(a.d[at])), acc[i]);
            if (mins) acc[i] = _mm512_fmadd_ps(mn, _mm512_set1_ps(a.dsum[at]), acc[i]);
        }
    }
    for (int i = 0; i < TB; ++i) _mm512_storeu_ps(res + i * PANEL, acc[i]);
}

// Two panels a pass (p and p + 1, the second's half panels `next` bytes further on), TB2
// tokens: each activation broadcast feeds both panels' vpdpbusd. On Zen 4 a broadcast from
// memory per vpdpbusd held the one-panel loop to ~0.5 of them a cycle, half the rate of the
// instructions themselves (280-340 GOP/s over SmolLM2's layers, below bf16's GEMM). The integer
// sums and float steps of each (token, panel) are int4_panel's, in its order: the same bits.
constexpr int TB2 = 6;  // 2 x 6 integer sums + 2 x 6 float ones + 4 weights in registers

template <int TB, typename S>
void int4_panel2(const QRows& a, int64_t t0, int64_t K, int64_t group, const uint8_t* w0,
                 int64_t next, const S* scale, const S* mins, float* res) {
    const int64_t blocks = K / QB, per = group / QB, half = K * HALF / 2;
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    const int8_t* q0 = a.q.data() + t0 * K;
    const int64_t groups = K / group;
    __m512 acc[2][TB];
    for (int c = 0; c < 2; ++c)
        for (int i = 0; i < TB; ++i) acc[c][i] = _mm512_setzero_ps();
    int64_t g = 0, in_group = 0;
    for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* b0 = w0 + b * (QB * HALF / 2);
        __m512i dot[2][TB];
        for (int c = 0; c < 2; ++c)
            for (int i = 0; i < TB; ++i) dot[c][i] = _mm512_setzero_si512();
        for (int j = 0; j < 4; ++j) {
            const __m512i v0 = both_halves(b0 + 32 * j, b0 + half + 32 * j);
            const __m512i v1 = both_halves(b0 + next + 32 * j, b0 + next + half + 32 * j);
            const __m512i lo0 = _mm512_and_si512(v0, low4), lo1 = _mm512_and_si512(v1, low4);
            const int8_t* q = q0 + b * QB + 8 * j;
            for (int i = 0; i < TB; ++i) {
                int32_t x;
                std::memcpy(&x, q + i * K, 4);
                const __m512i xv = _mm512_set1_epi32(x);
                dot[0][i] = _mm512_dpbusd_epi32(dot[0][i], lo0, xv);
                dot[1][i] = _mm512_dpbusd_epi32(dot[1][i], lo1, xv);
            }
            const __m512i hi0 = _mm512_and_si512(_mm512_srli_epi16(v0, 4), low4);
            const __m512i hi1 = _mm512_and_si512(_mm512_srli_epi16(v1, 4), low4);
            for (int i = 0; i < TB; ++i) {
                int32_t x;
                std::memcpy(&x, q + i * K + 4, 4);
                const __m512i xv = _mm512_set1_epi32(x);
                dot[0][i] = _mm512_dpbusd_epi32(dot[0][i], hi0, xv);
                dot[1][i] = _mm512_dpbusd_epi32(dot[1][i], hi1, xv);
            }
        }
        __m512 sc[2], mn[2];
        for (int c = 0; c < 2; ++c) {  // panel p + c's lanes of group g
            sc[c] = load_scale16(scale + (c * groups + g) * PANEL);
            mn[c] = mins ? load_scale16(mins + (c * groups + g) * PANEL) : _mm512_setzero_ps();
        }
        for (int i = 0; i < TB; ++i) {  // a token's block scale broadcast once for both panels
            const int64_t ai = (t0 + i) * blocks + b;
            const __m512 d = _mm512_set1_ps(a.d[ai]);
            const __m512 dsum = mins ? _mm512_set1_ps(a.dsum[ai]) : d;
            const __m512i offset = _mm512_set1_epi32(mins ? 0 : kInt4Offset * a.qsum[ai]);
            for (int c = 0; c < 2; ++c) {
                __m512i isum = dot[c][i];
                if (!mins) isum = _mm512_sub_epi32(isum, offset);
                acc[c][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(sc[c], d),
                                            acc[c][i]);
                if (mins) acc[c][i] = _mm512_fmadd_ps(mn[c], dsum, acc[c][i]);
            }
        }
        if (++in_group == per) in_group = 0, ++g;
    }
    for (int c = 0; c < 2; ++c)
        for (int i = 0; i < TB; ++i) _mm512_storeu_ps(res + (c * TB2 + i) * PANEL, acc[c][i]);
}

// The int8 codes (cpu_int8act_linear.cpp's top comment: per half panel, per 4 inputs, 8 rows x 4
// bytes) on the same panels: vpdpbusd wants one operand unsigned, so each weight byte is taken
// as w + 128 (its top bit flipped, once a load for all tokens) and 128 x the block's activation
// sum comes off the integer sum after: sum((w + 128) q) - 128 sum(q) = sum(w q), exact in
// int32. The halves' loop moves each weight's sign onto the activation instead, one more
// instruction a token and 4 inputs (int8 weights with 8-bit activations ran 64 tokens through
// SmolLM2's 120 projections in 67 ms, 1.8x bf16's GEMM and 1.9x int4's panels, Zen 4). Groups of
// 32 inputs or a multiple (a scale a row: group K); the float steps per lane are int8_half's, in
// its order: the same bits.
template <int TB, int NPAN>
void int8_panels(const QRows& a, int64_t t0, int64_t K, int64_t group, const int8_t* w0,
                 int64_t next, const float* scale, float* res, int64_t res_stride) {
    const int64_t blocks = K / QB, per = group / QB, half = K * HALF, groups = K / group;
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    const int8_t* q0 = a.q.data() + t0 * K;
    __m512 acc[NPAN][TB];
    for (int c = 0; c < NPAN; ++c)
        for (int i = 0; i < TB; ++i) acc[c][i] = _mm512_setzero_ps();
    int64_t g = 0, in_group = 0;
    for (int64_t b = 0; b < blocks; ++b) {
        __m512i dot[NPAN][TB];
        for (int c = 0; c < NPAN; ++c)
            for (int i = 0; i < TB; ++i) dot[c][i] = _mm512_setzero_si512();
        // (a count known at compile time, unrolled whole: over k from b QB, GCC copied every
        // integer sum to another register and back each pass, two moves a vpdpbusd)
#pragma GCC unroll 8
        for (int step = 0; step < QB / 4; ++step) {
            const int64_t k = b * QB + 4 * step;
            __m512i u[NPAN];
            for (int c = 0; c < NPAN; ++c) {
                const auto* h0 = reinterpret_cast<const uint8_t*>(w0 + c * next + k * HALF);
                u[c] = _mm512_xor_si512(both_halves(h0, h0 + half), flip);
            }
            for (int i = 0; i < TB; ++i) {
                int32_t x;
                std::memcpy(&x, q0 + i * K + k, 4);
                const __m512i xv = _mm512_set1_epi32(x);
                for (int c = 0; c < NPAN; ++c)
                    dot[c][i] = _mm512_dpbusd_epi32(dot[c][i], u[c], xv);
            }
        }
        __m512 sc[NPAN];
        for (int c = 0; c < NPAN; ++c) sc[c] = _mm512_loadu_ps(scale + (c * groups + g) * PANEL);
        for (int i = 0; i < TB; ++i) {
            const int64_t ai = (t0 + i) * blocks + b;
            const __m512 d = _mm512_set1_ps(a.d[ai]);
            const __m512i offset = _mm512_set1_epi32(128 * a.qsum[ai]);
            for (int c = 0; c < NPAN; ++c)
                acc[c][i] = _mm512_fmadd_ps(
                    _mm512_cvtepi32_ps(_mm512_sub_epi32(dot[c][i], offset)),
                    _mm512_mul_ps(sc[c], d), acc[c][i]);
        }
        if (++in_group == per) in_group = 0, ++g;
    }
    for (int c = 0; c < NPAN; ++c)
        for (int i = 0; i < TB; ++i)
            _mm512_storeu_ps(res + (c * res_stride + i) * PANEL, acc[c][i]);
}

#endif  // AVX512-VNNI

}  // namespace
