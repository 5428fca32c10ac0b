// Weight-only quantized linears for a bf16 model's long steps (prefill chunks, batched decode):
// out[t, n] = bf16(sum_k x[t, k] * bf16(w[n, k]) + bias[n]), x and out bf16, the sums float32.
// w[n, k] is the layer's value (code x scale (+ min)), as the float32 kernels and
// banyan/layers/quant.py define it, rounded once to bf16: what a bf16 model's GEMM multiplies.
// int8 with a scale per row (kInt8Rows) multiplies its codes instead, exact in bf16:
// out[t, n] = bf16(fma(sum_k x[t, k] * code[n, k], scale[n], bias[n])) (sum_scales).
//
// Why not dequantize slabs and call torch's GEMM: oneDNN reorders a plain bf16 matrix into its
// blocked layout on every call, which made 64 tokens through one SmolLM2 layer cost 1.96 ms
// against 0.73 ms on the weights packed once (Zen 5). Here each thread dequantizes a group of
// NP panels (16 output rows each; the codes' own layout) straight into pairs of inputs, the
// layout vdpbf16ps reads, once per step, and multiplies every token by them while the group
// sits in L2: TB tokens x NP panels of float32 sums in registers, each pair of an activation row
// broadcast once per pass. A dense bf16 layer's weight is stored in those pairs at load
// (kBf16Pairs, layers/linear.py), read in place with no tile to fill: the one kernel of its
// steps of 1 to 256 tokens. Without AVX512-BF16 a scalar loop gives the same values (the tests'
// path on other CPUs; the engine takes this kernel only where the CPU has the instruction).

#include <cmath>
#include <cstdlib>
#include <vector>

#include "cpu_avx512.h"
#include "cpu_dtypes.h"
#include "cpu_quant_common.h"
#include "cpu_quant_fill.h"
#include "cpu_quant_gemm_tiles.h"
#include "cpu_team.h"

namespace {

#if defined(__AVX512BF16__)
constexpr int TB = 8;

// tb (<= TB) tokens from row t0 through the tile of panels [p0, p0 + N_P); FILL: the kind of
// the next group's tile filled meanwhile (FillKind; Fill::next inlined into the pass: called out
// of line, it cost a vzeroupper and the sums' moves out of zmm0-15 per call, and int4 64-token
// steps ~1.25x the time on Zen 5), so that a pass with none (dense bf16 pairs) has none of its
// code either. SCALED: each sum times its row's scale, rs (sum_scales; kInt8Rows), so that the
// passes of other kinds carry none of it.
template <int N_P, int T_B, int FILL, bool SCALED>
void tile_gemm(const Panels& tile, const uint16_t* x, int64_t K, int64_t t0, int64_t p0,
               const float* bias, const float* rs, uint16_t* out, int64_t N, Ahead fetch,
               Fill* fill) {
    __m512 acc[T_B][N_P];
    for (int t = 0; t < T_B; ++t)
        for (int q = 0; q < N_P; ++q) acc[t][q] = _mm512_setzero_ps();
    const int32_t* rows[T_B];  // activation rows as pairs of inputs
    for (int t = 0; t < T_B; ++t) rows[t] = reinterpret_cast<const int32_t*>(x + (t0 + t) * K);
    // fetch's lines spread over the pass, a few every pair, not in one burst ahead of it
    const int64_t lines = fetch.bytes / 64, pairs = K / 2;
    const int64_t fills = FILL ? fill->end - fill->done : 0;  // spread over the pass alike
    Fill here;  // (the pass's own copy: Fill::next)
    if constexpr (FILL) here = *fill;
    int64_t owed = 0, filled = 0;
    for (int64_t j = 0; j < pairs; ++j) {
        for (owed += lines; owed >= pairs; owed -= pairs, fetch.codes += 64)
            _mm_prefetch(fetch.codes, _MM_HINT_T1);
        if constexpr (FILL)
            for (filled += fills; filled >= pairs; filled -= pairs) here.next<FILL>();
        __m512bh wv[N_P];
        for (int q = 0; q < N_P; ++q)
            wv[q] = (__m512bh)_mm512_load_si512(tile.base[q] + j * tile.stride);
        for (int t = 0; t < T_B; ++t) {
            const __m512bh xv = (__m512bh)_mm512_set1_epi32(rows[t][j]);
            for (int q = 0; q < N_P; ++q) acc[t][q] = _mm512_dpbf16_ps(acc[t][q], wv[q], xv);
        }
    }
    if constexpr (FILL) *fill = here;
    for (int q = 0; q < N_P; ++q) {
        const int64_t n0 = (p0 + q) * PANEL;
        const PanelEnd end(bias, SCALED ? rs : nullptr, n0, N);
        for (int t = 0; t < T_B; ++t) end.store<SCALED>(acc[t][q], out + (t0 + t) * N + n0);
    }
}

// The largest token count <= T_B that is tb, at compile time.
template <int N_P, int T_B, int FILL, bool SCALED>
void token_block(int tb, const Panels& tile, const uint16_t* x, int64_t K, int64_t t0,
                 int64_t p0, const float* bias, const float* rs, uint16_t* out, int64_t N,
                 Ahead fetch, Fill* fill) {
    if (tb == T_B)
        return tile_gemm<N_P, T_B, FILL, SCALED>(tile, x, K, t0, p0, bias, rs, out, N, fetch,
                                                 fill);
    if constexpr (T_B > 1)
        token_block<N_P, T_B - 1, FILL, SCALED>(tb, tile, x, K, t0, p0, bias, rs, out, N, fetch,
                                                fill);
}

// Every token block of T through the tile, and meanwhile the next group's codes prefetched into
// L2, a share a block (spread over the block's pass, tile_gemm): batched, fill_tile otherwise
// waited on DRAM for each group's codes between compute-bound passes (its share of a 64-token
// step's GEMM time was twice what it is with the codes in cache).
template <int N_P, int FILL, bool SCALED>
void panel_group(const Panels& tile, const uint16_t* x, int64_t T, int64_t K, int64_t p0,
                 const float* bias, const float* rs, uint16_t* out, int64_t N, Ahead next,
                 Fill* fill) {
    const int64_t vectors = FILL ? fill->np * fill->pairs : 0;
    // blocks of nearly equal size (12 tokens: 6 + 6, not 8 + 4): a short block's few chains of
    // sums wait on vdpbf16ps's latency (9 tokens took 1.17x the time of 8 with a block of 1)
    const int64_t blocks = (T + TB - 1) / TB;
    for (int64_t b = 0; b < blocks; ++b) {
        const int64_t t0 = T * b / blocks, t1 = T * (b + 1) / blocks;
        const int64_t from = next.bytes * t0 / T & ~int64_t{63};
        const int64_t to = std::min(next.bytes, next.bytes * t1 / T);
        const int tb = static_cast<int>(t1 - t0);
        if constexpr (FILL) fill->end = t1 >= T ? vectors : vectors * t1 / T;
        token_block<N_P, TB, FILL, SCALED>(tb, tile, x, K, t0, p0, bias, rs, out, N,
                                   Ahead{next.codes + from, std::max<int64_t>(to - from, 0)},
                                   fill);
    }
    if constexpr (FILL)
        while (fill->done < vectors) fill->next<FILL>();  // (a pass's rounding may leave one)
}

// panel_group's instance for np panels, with a tile to fill (FILL: FillKind) or none, its sums
// scaled by rs or not (SCALED).
// Each instance one function with everything it calls inlined (flatten). Left to GCC, once
// the fills had kinds, some passes were not inlined and kept their row and tile pointers and
// the fill's counters in memory: dense bf16 steps took 1.03-1.07x the time, 512-token int8
// steps 1.05x. Flattened, SmolLM2's 120 projections at 64 tokens (weights from memory) take
// 0.89x the time with int8 and 0.94x with int4 of the build before the kinds, bf16 1.00x.
template <int FILL, bool SCALED>
__attribute__((noinline, flatten)) void group(int np, const Panels& tile, const uint16_t* x,
                                              int64_t T, int64_t K, int64_t p0, const float* bias,
                                              const float* rs, uint16_t* out, int64_t N,
                                              Ahead next, Fill* fill) {
    if (np == 3) panel_group<3, FILL, SCALED>(tile, x, T, K, p0, bias, rs, out, N, next, fill);
    else if (np == 2) panel_group<2, FILL, SCALED>(tile, x, T, K, p0, bias, rs, out, N, next, fill);
    else panel_group<1, FILL, SCALED>(tile, x, T, K, p0, bias, rs, out, N, next, fill);
}

void quant_gemm(const uint16_t* x, int64_t T, const QuantWeight& w, const float* bias,
                uint16_t* out, int64_t N, int64_t n_threads) {
    const int64_t panels = (N + PANEL - 1) / PANEL;
#if defined(BANYAN_GEMM_TILES)
    // (cpu_quant_gemm_tiles.h) each group filled, then used
    if (gemm_takes_tiles(T, w.K, w.kind == kBf16Pairs)) {
        if (gemm_tiles_mode() == 2) tiles_gemm<AmxTiles>(x, T, w, bias, out, N, n_threads);
        else tiles_gemm<SoftTiles>(x, T, w, bias, out, N, n_threads);
        return;
    }
#endif
    banyan_team::parallel_team(threads_for(panels / NP, n_threads), [&](int64_t i, int64_t n) {
        const int64_t a = panels * i / n, b = panels * (i + 1) / n;
        // two tiles, this group's and the next's (filled meanwhile: Fill); none for pairs read
        // in place
        const int64_t pairs = w.K / 2;
        const bool plain = w.kind == kBf16Pairs || w.kind == kBf16;  // no Fill: kBf16 transposes
        __m512i* tiles = w.kind == kBf16Pairs ? nullptr : thread_tiles(2 * pairs * NP);
        if (!plain && a < b) fill_tile(w, a, static_cast<int>(std::min<int64_t>(NP, b - a)), tiles);
        for (int64_t p0 = a, k = 0; p0 < b; p0 += NP, ++k) {
            const int np = static_cast<int>(std::min<int64_t>(NP, b - p0));
            const int64_t next_np = std::clamp<int64_t>(b - p0 - np, 0, NP);
            __m512i* tile = tiles ? tiles + (k % 2) * pairs * NP : nullptr;
            if (plain && w.kind != kBf16Pairs) fill_tile(w, p0, np, tile);
            const Panels panels_at = panels_in(w, p0, np, tile);
            Fill fill;
            if (!plain && next_np > 0)
                fill = Fill(w, p0 + np, next_np, tiles + (k + 1) % 2 * pairs * NP);
            Fill* filling = fill.w ? &fill : nullptr;
            // the codes after the group being filled (the pairs after this group's, in place)
            const int64_t ahead = plain ? np : np + next_np;
            const Ahead next = codes_of(w, p0 + ahead, std::clamp<int64_t>(b - p0 - ahead, 0, NP));
            const float* rs = sum_scales(w);
            switch (filling ? filling->kind() : kFillNone) {
#define BANYAN_GROUP(KIND, SCALED) \
    group<KIND, SCALED>(np, panels_at, x, T, w.K, p0, bias, rs, out, N, next, filling)
                case kFillCodes: BANYAN_GROUP(kFillCodes, true); break;
                case kFillInt8: BANYAN_GROUP(kFillInt8, false); break;
                case kFillInt4: BANYAN_GROUP(kFillInt4, false); break;
                case kFillInt4Wide: BANYAN_GROUP(kFillInt4Wide, false); break;
                default:  // a thread's last group (or pairs read in place)
                    if (rs) BANYAN_GROUP(kFillNone, true);
                    else BANYAN_GROUP(kFillNone, false);
#undef BANYAN_GROUP
            }
        }
    });
}

// The layer's bf16 weight as plain rows [N, K]: each panel's pairs (fill_tile) transposed back
// into rows, 16 pairs (32 inputs) of 16 rows a time: for long prefill chunks on AMX CPUs, where
// torch's oneDNN GEMM runs on AMX tiles (layers/quant.py, ONEDNN_MIN_TOKENS).
void dequant_rows(const QuantWeight& w, uint16_t* out, int64_t n_threads) {
    const int64_t panels = (w.N + PANEL - 1) / PANEL, pairs = w.K / 2;
#pragma omp parallel num_threads(threads_for(panels, n_threads))
    {
        __m512i* tile = thread_tiles(pairs);
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; ++p) {
            fill_tile(w, p, 1, tile, /*values=*/true);
            const int64_t rows = std::min<int64_t>(PANEL, w.N - p * PANEL);
            int64_t j0 = 0;
            for (; j0 + 16 <= pairs; j0 += 16) {
                __m512i r[16];
                for (int k = 0; k < 16; ++k) r[k] = tile[j0 + k];
                transpose16(r);  // r[i]: row i's pairs j0..j0 + 15
                for (int64_t i = 0; i < rows; ++i)
                    _mm512_storeu_si512(out + (p * PANEL + i) * w.K + 2 * j0, r[i]);
            }
            for (; j0 < pairs; ++j0) {  // the last (K / 2) % 16 pairs
                alignas(64) uint32_t lanes[PANEL];
                _mm512_store_si512(lanes, tile[j0]);
                for (int64_t i = 0; i < rows; ++i)
                    std::memcpy(out + (p * PANEL + i) * w.K + 2 * j0, &lanes[i], 4);
            }
        }
    }
}
#else
}  // namespace

extern "C" {  // the float32 dequantizers (cpu_quant_dequant.cpp): the values, one panel at a time
void banyan_int8_dequant_f32(const int8_t*, const float*, int64_t, int64_t, int64_t, float*,
                             int64_t);
void banyan_int8g_dequant_f32(const int8_t*, const float*, int64_t, int64_t, int64_t, int64_t,
                              float*, int64_t);
void banyan_int4_dequant_f32(const uint8_t*, const uint16_t*, const uint16_t*, int64_t, int64_t,
                             int64_t, int64_t, float*, int64_t);
void banyan_int4s_dequant_f32(const uint8_t*, const float*, const float*, int64_t, int64_t,
                              int64_t, int64_t, float*, int64_t);
}

namespace {

// Panel p's 16 rows of values [16, K] in float32, exactly as the float32 paths compute them.
void panel_values(const QuantWeight& w, int64_t p, float* rows) {
    const auto* c8 = static_cast<const int8_t*>(w.codes);
    const auto* c4 = static_cast<const uint8_t*>(w.codes);
    switch (w.kind) {
        case kBf16:
            for (int64_t i = 0; i < PANEL; ++i)
                for (int64_t k = 0; k < w.K; ++k)
                    rows[i * w.K + k] = p * PANEL + i < w.N ? bf16_to_f32(
                        static_cast<const uint16_t*>(w.codes)[(p * PANEL + i) * w.K + k]) : 0.0f;
            break;
        case kBf16Pairs:  // lane i of pair j: row i's inputs 2j (low half) and 2j + 1
            for (int64_t i = 0; i < PANEL; ++i)
                for (int64_t k = 0; k < w.K; ++k)
                    rows[i * w.K + k] = bf16_to_f32(static_cast<const uint16_t*>(
                        w.codes)[((p * (w.K / 2) + k / 2) * PANEL + i) * 2 + k % 2]);
            break;
        case kInt8Rows:
            banyan_int8_dequant_f32(c8, static_cast<const float*>(w.scale), w.K, p, p + 1, rows, 1);
            break;
        case kInt8Groups:
            banyan_int8g_dequant_f32(c8, static_cast<const float*>(w.scale), w.K, w.group, p,
                                     p + 1, rows, 1);
            break;
        case kInt4:
            banyan_int4_dequant_f32(c4, static_cast<const uint16_t*>(w.scale),
                                    static_cast<const uint16_t*>(w.mins), w.K, w.group, p, p + 1,
                                    rows, 1);
            break;
        default:
            banyan_int4s_dequant_f32(c4, static_cast<const float*>(w.scale),
                                     static_cast<const float*>(w.mins), w.K, w.group, p, p + 1,
                                     rows, 1);
    }
}

void quant_gemm(const uint16_t* x, int64_t T, const QuantWeight& w, const float* bias,
                uint16_t* out, int64_t N, int64_t n_threads) {
    const int64_t K = w.K, panels = (N + PANEL - 1) / PANEL;
    banyan_team::parallel_for(panels, threads_for(panels, n_threads), [&](int64_t p) {
        std::vector<float> rows(static_cast<size_t>(PANEL * K));
        const float* rs = sum_scales(w);
        if (rs)  // the codes themselves
            for (int64_t i = 0; i < PANEL * K; ++i)
                rows[i] = static_cast<const int8_t*>(w.codes)[(p * K + i % K) * PANEL + i / K];
        else
            panel_values(w, p, rows.data());
        for (float& v : rows) v = bf16_to_f32(f32_to_bf16(v));  // the bf16 weights
        for (int64_t n = p * PANEL; n < std::min(N, (p + 1) * PANEL); ++n) {
            const float* row = rows.data() + (n - p * PANEL) * K;
            for (int64_t t = 0; t < T; ++t) {
                float sum = 0.0f;
                for (int64_t k = 0; k < K; ++k) sum += bf16_to_f32(x[t * K + k]) * row[k];
                const float b = bias ? bias[n] : 0.0f;
                out[t * N + n] = f32_to_bf16(rs ? std::fma(sum, rs[n], b) : sum + b);
            }
        }
    });
}
#endif

}  // namespace

extern "C" {

// x [T, K] bf16 through a quantized weight of N rows in the panel layout (`kind` as Kind above;
// group: inputs per scale, 0 for kInt8Rows), or a plain bf16 one (kBf16: codes [N, K];
// kBf16Pairs: codes [ceil(N / 16)][K / 2][16] 32-bit pairs, 64-byte aligned; scale and mins
// null) -> out [T, N] bf16. bias: float32 [N] or null.
// K even (the vector loop reads inputs in pairs; quant.py sends odd widths elsewhere).
void banyan_quant_gemm_bf16(const uint16_t* x, int64_t T, int64_t K, int64_t kind,
                            const void* codes, const void* scale, const void* mins, int64_t group,
                            const float* bias, uint16_t* out, int64_t N, int64_t n_threads) {
    quant_gemm(x, T, QuantWeight{kind, K, group, codes, scale, mins, N}, bias, out, N, n_threads);
}

#if defined(__AVX512BF16__)
// A quantized weight (kinds and layouts as banyan_quant_gemm_bf16's; not kBf16 / kBf16Pairs)
// -> out [N, K] bf16, its values rounded once (kInt8Rows too: code x scale, where that kernel
// multiplies the codes and scales the sums). Built with AVX512-BF16 only.
void banyan_quant_dequant_bf16(int64_t K, int64_t kind, const void* codes, const void* scale,
                               const void* mins, int64_t group, uint16_t* out, int64_t N,
                               int64_t n_threads) {
    dequant_rows(QuantWeight{kind, K, group, codes, scale, mins, N}, out, n_threads);
}
#endif

// The GEMM's products for steps of `from` tokens or more (a dense weight in pairs: of
// `pairs_from`; cpu_quant_gemm_tiles.h), for the whole process from now on: 0 vdpbf16ps, 1 tiles
// emulated in memory (tests), 2 AMX tiles (only where granted); other modes only ask. Returns the
// mode in effect (0 where this build has no tiles).
int64_t banyan_set_gemm_tiles(int64_t mode, int64_t from, int64_t pairs_from) {
#if defined(BANYAN_GEMM_TILES)
    if (mode == 0 || mode == 1 || (mode == 2 && amx_granted())) {
        gemm_tiles_mode() = static_cast<int>(mode);
        gemm_tiles_from() = from, gemm_tiles_pairs_from() = pairs_from;
    }
    return gemm_tiles_mode();
#else
    (void)mode, (void)from, (void)pairs_from;
    return 0;
#endif
}

// Whether banyan_quant_gemm_bf16 runs on vdpbf16ps here (else the scalar loop).
int banyan_quant_gemm_bf16_vector() {
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

}  // extern "C"
