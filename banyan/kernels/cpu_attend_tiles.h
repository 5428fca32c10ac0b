// The row kernel's products on AMX tiles (cpu_amx_tiles.h), for bf16 queries over a bf16 pool:
// attend512's chunks of keys, its softmax (chunk_softmax) and its bf16 pairs of probabilities
// and values, with both products as tile dot products, 2 x 2 tiles of 16 x 16 at a time
// (1 x 2 for a block of up to 16 rows: a lone decode's few rows a KV head):
//
//   S = Q K^T, 32 rows x 32 keys a block: A = the rows' queries as they are (qraw, 32 dims a
//     step), B = the chunk's keys as pairs of dims (kt: [block of 16 keys][d / 2][16] words,
//     attend512's transposed layout kept for the whole chunk); raw scores into sc.s;
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
    std::vector<float> stage;  // a block of 32 rows' sums [32][d]
    SoftTiles soft;            // the emulated tiles (mode 1)
};

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
    prefetch_rows(kpool, slots, 0, std::min<int64_t>(n, 2 * VBLK), kvh, h, d);
    if (rows < kTileRows) tl.shape(rows);
    for (int64_t c0 = 0; c0 < n; c0 += CHUNK) {
        const int cn = static_cast<int>(std::min<int64_t>(CHUNK, n - c0));
        const int32_t* cs = slots + c0;
        const int blocks = (cn + VBLK - 1) / VBLK;
        // 1. the chunk's keys as pairs of dims, a block of 16 at a time (padding keys repeat
        // the last one: their scores are never read)
        for (int b = 0; b < blocks; ++b) {
            const int j0 = b * VBLK, nb = std::min(VBLK, cn - j0);
            prefetch_rows(kpool, slots, c0 + j0 + 2 * VBLK,
                          std::min<int64_t>(n, c0 + j0 + 3 * VBLK), kvh, h, d);
            if (b == blocks - 1) prefetch_rows(vpool, cs, 0, std::min(cn, 2 * VBLK), kvh, h, d);
            sc.ahead.issue();
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
        for (int j0 = 0; j0 < cn; j0 += 2 * VBLK)
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
