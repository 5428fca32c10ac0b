// The bf16 GEMM of quantized (and plain bf16) weights with its products on AMX tiles: for the
// long steps of a bf16 model on an Intel Xeon with AMX (cpu_quant_gemm_bf16.cpp calls it).
//
// Why: there a dense bf16 layer's long steps run oneDNN's GEMM on AMX tiles (~6x vdpbf16ps's
// bf16 peak on 2 cores of the Xeon, #13) while a quantized layer's ran the vdpbf16ps
// kernel, so int8 / int4 weights would lose to bf16 exactly where they should not (#16's
// batched target). The kernel's dequantized group of panels is already AMX's B layout (a panel's
// pair j: 16 rows x 2 bf16 = one 64-byte tile row), so the products change and nothing else:
// each thread dequantizes a group of panels as before, then multiplies every block of 32 tokens
// by it, two panels at a time (tile_block: 2 x 2 output tiles over K / 32 steps).
//
// Quantized weights only for steps of `gemm_tiles_from()` tokens or more (the Python side sets
// it past native.EXACT_STEP_TOKENS): a token's bits on tiles are not the vector loop's, and
// shorter steps (decodes, speculative checks) keep the bits a token gets alone from the short
// kernels, which multiply the weights' exact values. A dense weight in pairs takes the tiles
// from `gemm_tiles_pairs_from()` tokens (1: every step, decodes included): on tiles a token's
// outputs do not depend on the tile row it falls in, so the step's size or company does not
// change them either, and a decode's tiles shaped to its one row cost what the vector loop
// does while a speculative check of 13 tokens costs ~0.5x (figures: gemm_tiles.py's
// PAIRS_TILES_FROM). One mode a process (banyan_set_gemm_tiles): 0 the
// vector loop, 1 tiles emulated in memory (tests), 2 AMX's.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>

#include "cpu_amx_tiles.h"
#include "cpu_quant_common.h"
#include "cpu_quant_fill.h"
#include "cpu_team.h"

#if defined(BANYAN_AMX_TILES) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define BANYAN_GEMM_TILES 1

#include <immintrin.h>
namespace {

inline int& gemm_tiles_mode() {
    static int mode = 0;
    return mode;
}

inline int64_t& gemm_tiles_from() {
    static int64_t tokens = 0;
    return tokens;
}

inline int64_t& gemm_tiles_pairs_from() {
    static int64_t tokens = 0;
    return tokens;
}

// Whether a step of T tokens over K inputs takes the tiles (whole 32-input tile rows only);
// pairs: a dense weight in the GEMM's pairs, else a quantized one.
inline bool gemm_takes_tiles(int64_t T, int64_t K, bool pairs) {
    const int64_t from = pairs ? gemm_tiles_pairs_from() : gemm_tiles_from();
    return gemm_tiles_mode() != 0 && from > 0 && T >= from && K % 32 == 0;
}

// Tokens [t0, t0 + rows) (rows <= 32) times panels q, q1 of a group (q1 == q: one panel, its
// tile computed twice and stored once), times the rows' scales (rs: sum_scales, or null), plus
// bias, rounded to bf16 into out. A panel's pairs are a B tile's rows (16 rows x 2 bf16, 64
// bytes each).
template <typename Tiles, typename Step>
void tile_pair(Tiles& tl, const char* a, int64_t lda, int64_t rows, const Panels& panels,
               int q, int q1, int64_t K, int64_t p0, const float* bias, const float* rs,
               uint16_t* out, int64_t t0, int64_t N, float* c, Step& step) {
    const char* b0 = reinterpret_cast<const char*>(panels.base[q]);
    const int64_t db = reinterpret_cast<const char*>(panels.base[q1]) - b0;
    const int64_t ldb = panels.stride * 64, steps = K / 32;
    constexpr int64_t ldc = 32 * sizeof(float);  // c: [32 tokens][2 panels x 16 rows] floats
    if (rows > kTileRows)
        tile_block(tl, a, kTileRows * lda, lda, 64, b0, db, ldb, kTileRows * ldb, steps,
                   reinterpret_cast<char*>(c), ldc, false, std::ref(step));
    else  // (the same bits per element as a row of tile_block's)
        tile_row_block(tl, a, lda, 64, b0, db, ldb, kTileRows * ldb, steps,
                       reinterpret_cast<char*>(c), ldc, false, std::ref(step));
    for (int qq = q; qq <= q1; ++qq) {
        const int64_t n0 = (p0 + qq) * PANEL;
        const PanelEnd end(bias, rs, n0, N);
        for (int64_t t = 0; t < rows; ++t) {
            const __m512 sum = _mm512_loadu_ps(c + t * 32 + (qq - q) * PANEL);
            uint16_t* at = out + (t0 + t) * N + n0;
            if (rs) end.store<true>(sum, at);
            else end.store<false>(sum, at);
        }
    }
}

// The next group's codes (or pairs) into L2, a share of their lines at each tile step of this
// group. Without it every group's first B tiles waited on memory: at 64 tokens the tile
// loads of the weights and the products behind them took ~70% of a dense layer's samples
// (perf; SmolLM2's layers from memory, the Xeon of #13), at ~510 GFLOP/s.
struct SpreadAhead {
    const char* at;
    int64_t lines, steps, owed = 0;
    void operator()() {
        for (owed += lines; owed >= steps; owed -= steps, at += 64) _mm_prefetch(at, _MM_HINT_T1);
    }
};

// out [T, N] = x [T, K] (bf16) times the weight, a group of NP panels at a time per thread:
// dequantized into a tile (fill_tile), or the weight's own pairs read in place.
template <typename Tiles>
void tiles_gemm(const uint16_t* x, int64_t T, const QuantWeight& w, const float* bias,
                uint16_t* out, int64_t N, int64_t n_threads) {
    // Groups of two panels, a thread's range whole groups: an odd group's panel would take as
    // many tile products as two (tile_pair), and the products are what a step waits for.
    constexpr int kGroup = 2;
    static_assert(kGroup <= NP, "a group's panels fit a Panels");
    const int64_t K = w.K, panels = (N + PANEL - 1) / PANEL, pairs = K / 2;
    const int64_t groups = (panels + kGroup - 1) / kGroup;
    banyan_team::parallel_team(threads_for(groups, n_threads), [&](int64_t i, int64_t n) {
        const int64_t a = groups * i / n * kGroup;
        const int64_t b = std::min(panels, groups * (i + 1) / n * kGroup);
        // (a group's dequantized panels; none for pairs read in place)
        __m512i* tile = w.kind == kBf16Pairs ? nullptr : thread_tiles(pairs * kGroup);
        // A last block of fewer than 32 tokens (tile loads read 16 whole rows), zeros past T:
        // copied once a call into this thread's buffer, which is all zeros between calls (its
        // rows are cleared after use), not once a group: at a decode's one token the copy and
        // the 31 rows of zeros per group cost more than the products (a step 1.3x a vector
        // loop's on the Xeon of #13; each group's at a token, 15-16 KB of writes per 1-2 KB
        // of weights).
        const int64_t tail = T % 32, tail0 = T - tail;
        thread_local std::vector<uint16_t> pad;
        if (tail) {
            if (pad.size() < static_cast<size_t>(32 * K)) pad.assign(32 * K, 0);
            std::memcpy(pad.data(), x + tail0 * K, tail * K * sizeof(uint16_t));
        }
        alignas(64) float c[32 * 32];
        Tiles tl;
        tl.begin();
        // a step of fewer than 16 tokens (a decode, a short check): its one block's tiles of
        // its own rows (the same bits per element, fewer rows multiplied and moved)
        if (T < kTileRows) tl.shape(static_cast<int>(T));
        for (int64_t p0 = a; p0 < b; p0 += kGroup) {
            const int np = static_cast<int>(std::min<int64_t>(kGroup, b - p0));
            const Ahead next = codes_of(w, p0 + np, std::clamp<int64_t>(b - p0 - np, 0, kGroup));
            SpreadAhead ahead{next.codes, next.bytes / 64,
                              std::max<int64_t>(1, (T + 31) / 32 * ((np + 1) / 2) * (K / 32))};
            if (w.kind != kBf16Pairs) fill_tile(w, p0, np, tile);
            const Panels group = panels_in(w, p0, np, tile);
            for (int64_t t0 = 0; t0 < T; t0 += 32) {
                const int64_t rows = std::min<int64_t>(32, T - t0);
                const char* at = reinterpret_cast<const char*>(rows < 32 ? pad.data()
                                                                          : x + t0 * K);
                for (int q = 0; q < np; q += 2)
                    tile_pair(tl, at, K * static_cast<int64_t>(sizeof(uint16_t)), rows, group, q,
                              std::min(q + 1, np - 1), K, p0, bias, sum_scales(w), out, t0, N,
                              c, ahead);
            }
        }
        tl.end();
        if (tail) std::memset(pad.data(), 0, tail * K * sizeof(uint16_t));
    });
}

}  // namespace

#endif  // BANYAN_GEMM_TILES
