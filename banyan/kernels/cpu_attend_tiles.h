// The row kernel's products on AMX tiles (cpu_amx_tiles.h), for bf16 queries over a bf16 pool:
// attend512's chunks of keys, its softmax (chunk_softmax) and its bf16 pairs of probabilities
// and values, with both products as tile dot products, 2 x 2 tiles of 16 x 16 at a time
// (1 x 2 for a block of up to 16 rows: a lone decode's few rows a KV head):
//
//   S = Q K^T, 32 rows x 32 keys a block: A = the rows' queries as they are (qraw, 32 dims a
//     step), B = the chunk's keys as pairs of dims (kt: [block of 16 keys][d / 2][16] words,
//     attend512's transposed layout kept for the whole chunk); raw scores into sc.s; a call
//     of few rows takes a block of 16 keys whose slots step evenly as S^T instead (below);
//   O += P V, 32 rows x 32 dims a block: A = the probabilities as chunk_softmax writes them (pp),
//     B = the values as pairs of keys (interleave_values: vdpbf16ps's layout is a tile's B); the
//     rows' sums staged through a buffer of 32 rows, so a block's rows past the call's own
//     (another KV head's state rows follow them in sc.acc) are never written.
//
// Why: a decode group's 24 rows a KV head over a 1,024-key shared prefix run ~35% of the
// vdpbf16ps peak on Zen 5 (the vector loop and the prefill kernel's pair path alike: the
// softmax, transposes and tree of sums around 64 products a row and key), and on an AMX Xeon
// vdpbf16ps is a sixth of the tiles' peak. Every row's arithmetic is the same whatever block,
// row of a tile or call it falls in, so the rule of the row kernel holds on tiles too: a row's
// bits depend on its query and keys alone (alone, in a group, in a speculative check). The
// process takes one path for every row (decode_tiles_mode), never both: the bits of the two
// differ.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu_amx_tiles.h"
#include "cpu_attend512.h"

#if defined(BANYAN_AMX_TILES) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define BANYAN_DECODE_TILES 1
#endif

namespace {

constexpr int kTileBlock = 32;  // rows (keys, dims) of a 2 x 2 block of tiles

// The row kernel's products in this process: 0 the vector loops, 1 on tiles emulated in memory
// (tests), 2 on AMX tiles (only once amx_granted()). Set by banyan_set_decode_tiles.
inline int& decode_tiles_mode() {
    static int mode = 0;
    return mode;
}

// Rows rounded up to whole tile blocks: the rows a tile pass reads and writes in the scratch.
inline int64_t tile_rows(int64_t rows) {
    return (rows + kTileBlock - 1) / kTileBlock * kTileBlock;
}

// A thread's tile configuration for one call: loaded as it starts, the one before put back as
// it ends (mode 2, AMX); nothing in other modes or builds.
struct TileSession {
    int mode;
#if defined(BANYAN_DECODE_TILES)
    AmxTiles amx;
#endif
    explicit TileSession(int m) : mode(m) {
#if defined(BANYAN_DECODE_TILES)
        if (mode == 2) amx.begin();
#endif
    }
    ~TileSession() {
#if defined(BANYAN_DECODE_TILES)
        if (mode == 2) amx.end();
#endif
    }
};

}  // namespace

#if defined(BANYAN_DECODE_TILES)
namespace {

// One thread's buffers of the tile path, kept with its Attender.
struct TileScratch {
    std::vector<uint32_t> kt;  // the chunk's keys as pairs of dims, [block][d / 2][16] words
    std::vector<uint32_t> qt;  // few rows: their queries as pairs of dims, [d / 32][16][16]
    std::vector<float> st;     // few rows: a block's scores as S^T, [16 keys][16 rows]
    std::vector<float> stage;  // a block of 32 rows' sums [32][d]
    SoftTiles soft;            // the emulated tiles (mode 1)
};

// A call of at most this many rows a KV head (a lone decode's: SmolLM2's 3) scores a block of
// 16 keys whose slots step evenly (a prompt's run of slots; a batch's decoded tokens, one slot
// each a step, lowest free first) as S^T = K Q^T: A the 16 keys read from the pool in place
// (one tile load at the slots' stride), B the rows' queries as pairs of dims (once a call), then
// each row's 16 scores gathered from its column. The same products in the same order as S = Q
// K^T (tdpbf16ps is symmetric in A and B): the same bits. No key is transposed (two 16 x 16
// transposes of 32-bit words a block, at d = 64). On the AMX Xeon of #13 (`attention_ab.py
// --tiles`, three runs): 64 x 192-key decodes 0.91-0.94x the time, with the engine's slots (a
// prompt's run, then 64 decoded tokens at a stride of 64) 0.92-0.98x; with every block's keys
// copied out first and taken as A from there, 1.11x (the copy cost more than the transposes).
constexpr int kFewRows = 8;

// The slot step of keys [j0, j0 + nb) of cs if they step evenly up and fill a block, else 0.
inline int64_t even_step(const int32_t* cs, int j0, int nb) {
    if (nb != VBLK) return 0;
    const int64_t step = static_cast<int64_t>(cs[j0 + 1]) - cs[j0];
    for (int j = 2; j < VBLK; ++j)
        if (static_cast<int64_t>(cs[j0 + j]) - cs[j0 + j - 1] != step) return 0;
    return step > 0 ? step : 0;
}

// The rows' queries (qraw, `rows` of d) as B tiles of pairs of dims, qt[step][pair][row] (the
// columns past the rows zero).
inline void queries_as_pairs(TileScratch& ts, const uint16_t* qraw, int rows, int d) {
    ts.qt.assign(static_cast<size_t>(d / 32) * kTileRows * kTileRows, 0u);
    for (int r = 0; r < rows; ++r) {
        const uint32_t* qw = reinterpret_cast<const uint32_t*>(qraw + static_cast<size_t>(r) * d);
        for (int w = 0; w < d / 2; ++w)  // pair w: row w % 16 of step w / 16's tile
            ts.qt[(static_cast<size_t>(w / 16) * kTileRows + w % 16) * kTileRows + r] = qw[w];
    }
    ts.st.resize(static_cast<size_t>(kTileRows) * kTileRows);
}

// Few rows' raw scores against the 16 keys at k (ldk bytes apart) into s[r * CHUNK], on tiles
// 5 (A), 6 (B) and 2 (C), which keep their 16 rows while shape() narrows tiles 0, 1 and 4.
template <typename Tiles>
inline void few_rows_scores(Tiles& tl, TileScratch& ts, const uint16_t* k, int64_t ldk,
                            int rows, int d, float* s) {
    tl.template zero<2>();
    for (int step = 0; step < d / 32; ++step) {
        tl.template load<5>(k + 32 * step, ldk);
        tl.template load<6>(ts.qt.data() + static_cast<size_t>(step) * kTileRows * kTileRows,
                            64);
        tl.template dot<5, 6>();
    }
    tl.template store<2>(ts.st.data(), 64);
    const __m512i column = _mm512_set_epi32(240, 224, 208, 192, 176, 160, 144, 128, 112, 96, 80,
                                            64, 48, 32, 16, 0);  // key j's score: st[16 j + r]
    for (int r = 0; r < rows; ++r)
        _mm512_storeu_ps(s + static_cast<size_t>(r) * CHUNK,
                         _mm512_i32gather_ps(column, ts.st.data() + r, 4));
}

// attend512 for bf16 rows [r0, r0 + rows) over a bf16 pool on tiles: qraw the rows' queries
// from r0 on (unscaled; readable for tile_rows(rows) rows: rows past the call's are read, their
// results never used), sc sized for tile_rows(rows) rows from 0 (s, pp) and r0 + rows (state).
template <typename Tiles>
void attend_tiles512(Tiles& tl, TileScratch& ts, Scratch& sc, const uint16_t* qraw, int r0,
                     int rows, const int32_t* slots, int64_t n, const uint16_t* kpool,
                     const uint16_t* vpool, int64_t kvh, int64_t h, int d, float scale,
                     bool causal) {
    const int words = d / 2;  // 32-bit words (pairs of dims) a key
    const int64_t block_words = static_cast<int64_t>(words) * VBLK;
    if (ts.kt.size() < static_cast<size_t>(block_words * (CHUNK / VBLK)))
        ts.kt.assign(block_words * (CHUNK / VBLK), 0u);  // (zeros: an odd last block's partner)
    ts.stage.resize(static_cast<size_t>(kTileBlock) * d);
    // (a block of up to 16 rows, a lone decode's few a KV head, runs on one A tile: 16 rows)
    const int padded = rows <= kTileRows ? kTileRows : static_cast<int>(tile_rows(rows));
    const char* q = reinterpret_cast<const char*>(qraw);
    const char* kt = reinterpret_cast<const char*>(ts.kt.data());
    char* s = reinterpret_cast<char*>(sc.s.data());
    const char* pp = reinterpret_cast<const char*>(sc.pp.data());
    char* stage = reinterpret_cast<char*>(ts.stage.data());
    const int64_t lds = CHUNK * 4, ldp = CHUNK / 2 * 4, ldq = 2 * d, ldv = 4 * d;
    const bool few = rows <= kFewRows;
    if (few) queries_as_pairs(ts, qraw, rows, d);
    prefetch_rows(kpool, slots, 0, std::min<int64_t>(n, 2 * VBLK), kvh, h, d);
    if (rows < kTileRows) tl.shape(rows);
    for (int64_t c0 = 0; c0 < n; c0 += CHUNK) {
        const int cn = static_cast<int>(std::min<int64_t>(CHUNK, n - c0));
        const int32_t* cs = slots + c0;
        const int blocks = (cn + VBLK - 1) / VBLK;
        // 1. the chunk's keys as pairs of dims, a block of 16 at a time (padding keys repeat
        // the last one: their scores are never read); few rows: a pair of blocks (step 2's
        // unit) whose slots both step evenly scored now as S^T instead (`direct`)
        int64_t step[CHUNK / VBLK] = {};  // few rows: each block's slot step (0: uneven)
        bool direct[CHUNK / (2 * VBLK)] = {};
        for (int b = 0; few && b < blocks; ++b)
            step[b] = even_step(cs, b * VBLK, std::min(VBLK, cn - b * VBLK));
        for (int b = 0; few && b < blocks; b += 2)
            direct[b / 2] = step[b] > 0 && (b + 1 == blocks || step[b + 1] > 0);
        for (int b = 0; b < blocks; ++b) {
            const int j0 = b * VBLK, nb = std::min(VBLK, cn - j0);
            prefetch_rows(kpool, slots, c0 + j0 + 2 * VBLK,
                          std::min<int64_t>(n, c0 + j0 + 3 * VBLK), kvh, h, d);
            if (b == blocks - 1) prefetch_rows(vpool, cs, 0, std::min(cn, 2 * VBLK), kvh, h, d);
            sc.ahead.issue();
            if (direct[b / 2]) {
                few_rows_scores(tl, ts, kpool + (static_cast<int64_t>(cs[j0]) * kvh + h) * d,
                                step[b] * kvh * d * 2, rows, d, sc.s.data() + j0);
                continue;
            }
            __m512i* kb = reinterpret_cast<__m512i*>(ts.kt.data() + b * block_words);
            for (int w0 = 0; w0 < words; w0 += 16) {
                __m512i r[VBLK];
                for (int j = 0; j < VBLK; ++j)
                    r[j] = _mm512_loadu_si512(
                        kpool + (static_cast<int64_t>(cs[j0 + std::min(j, nb - 1)]) * kvh + h) *
                                    d + 2 * w0);
                transpose16(r);
                for (int i = 0; i < 16; ++i) _mm512_storeu_si512(kb + w0 + i, r[i]);
            }
        }
        // 2. every row's raw scores, 32 rows x 32 keys a block of tiles (an odd last block of
        // keys beside the next block's stale or zero words, scores never read)
        for (int j0 = 0; j0 < cn; j0 += 2 * VBLK) {
            if (direct[j0 / (2 * VBLK)]) continue;  // (scored in step 1)
            for (int r = 0; r < padded; r += kTileBlock) {
                const char* b = kt + j0 / VBLK * block_words * 4;
                char* c = s + (static_cast<int64_t>(r) * CHUNK + j0) * 4;
                if (rows - r <= kTileRows)  // (a lone decode's 3 rows a KV head: one A tile)
                    tile_row_block(tl, q + r * ldq, ldq, 64, b, block_words * 4, 64, 16 * 64,
                                   d / 32, c, lds, false);
                else
                    tile_block(tl, q + r * ldq, kTileRows * ldq, ldq, 64, b, block_words * 4,
                               64, 16 * 64, d / 32, c, lds, false);
            }
        }
        // 3. each row's softmax over the keys it sees, as attend512's; its probabilities past
        // them zero up to the chunk's last tile of 16 pairs (the tiles multiply whole tiles)
        const int pair_tiles = ((cn + 1) / 2 + 15) / 16;
        for (int r = 0; r < rows; ++r) {  // (rows past the call's: their sums never read)
            uint32_t* pr = sc.pp.data() + static_cast<size_t>(r) * (CHUNK / 2);
            int written = 0;
            const int rr = r0 + r;
            int seen = cn;
            if (causal) seen = static_cast<int>(std::min<int64_t>(cn, std::max<int64_t>(
                                                                     0, sc.lim[rr] - c0)));
            sc.vis[r] = seen;
            if (seen > 0) {
                const int seen_blocks = (seen + VBLK - 1) / VBLK;
                chunk_softmax(sc, rr, sc.s.data() + static_cast<size_t>(r) * CHUNK, seen,
                              seen_blocks, scale, d, pr);
                written = seen_blocks * VBLK / 2;
            }
            std::fill(pr + written, pr + pair_tiles * 16, 0u);
        }
        // 4. the values as pairs of keys, then O += P V, 32 rows x 32 dims a block of tiles
        // (pairs past the chunk's: stale finite values, times probabilities of 0)
        const char* vi = reinterpret_cast<const char*>(
            interleave_values<uint16_t, void>(sc, vpool, cs, cn, kvh, h, d, CodesBf16<void>{}));
        for (int r = 0; r < padded; r += kTileBlock) {
            const int real = std::min(kTileBlock, rows - r);
            float* acc = sc.acc.data() + static_cast<size_t>(r0 + r) * d;
            std::copy_n(acc, static_cast<size_t>(real) * d, ts.stage.data());
            for (int x0 = 0; x0 < d; x0 += 32) {
                const char* a = pp + static_cast<int64_t>(r) * ldp;
                if (real <= kTileRows)
                    tile_row_block(tl, a, ldp, 64, vi + x0 * 4, 64, ldv, 16 * ldv, pair_tiles,
                                   stage + x0 * 4, 4 * d, true);
                else
                    tile_block(tl, a, kTileRows * ldp, ldp, 64, vi + x0 * 4, 64, ldv,
                               16 * ldv, pair_tiles, stage + x0 * 4, 4 * d, true);
            }
            std::copy_n(ts.stage.data(), static_cast<size_t>(real) * d, acc);
        }
    }
    if (rows < kTileRows) tl.shape(kTileRows);
}

}  // namespace

#endif  // BANYAN_DECODE_TILES
