// Causal attention of prefill chunks (extends of many tokens, over a cached prefix or none) on
// CPU, flash-style, reading K/V in place from the pool through the token table.
//
// The row kernel (cpu_paged_attention.cpp) attends each query row to each key block in turn:
// right for decodes, but a long chunk then does matrix products as row-by-row dot products.
// Here a work item is a block of BQ query positions of one request times the G query heads of
// one KV head (BQ x G rows), so each key block, converted to float32 once, serves all of them:
//
//   per block of BK keys: K, V rows -> float32 [BK][D] (bf16 widened, int8 / fp8 codes times
//   their (slot, head) scale as they are packed: no dequantized copy of the pool);
//   S^T = K Q^T (scores with keys as rows), a register tile of KM keys x 2 vectors of rows;
//   online softmax per row in float32 (running max and sum; masked on the diagonal only);
//   O = O x corr + P V, a register tile of PM rows x 2 vectors of head-dim columns.
//
// Scores are computed transposed so that Q (transposed once per item) is the vector operand and
// K is read by broadcasts in its natural layout: no per-block transpose of K, and the softmax
// then runs down the columns, vectorised over rows. The tiles are plain arrays with fixed trip
// counts that GCC keeps in registers and turns into FMAs for whatever -march=native offers
// (two 8-lane vectors on AVX2, two 16-lane on AVX-512): one code path on every x86-64.
// -ffp-contract=off is on, so the products are fused explicitly (fmadd below).
//
// Every row's arithmetic (dot products in head-dim order, key blocks from 0 in steps of BK,
// keys in order within them) is the same whatever BQ, the tile a row falls in, or the thread
// count: BQ adapts to the thread count and the output bits do not change with it.
//
// Built at run time by banyan/kernels/native.py; called through attention_kernels.py.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_dtypes.h"
#include "cpu_paged_attention.h"
#include "cpu_prefill_common.h"
#include "cpu_prefill_pairs.h"
#include "cpu_prefill_tiles.h"
#include "cpu_team.h"

namespace {

constexpr int KM = 6;         // keys per S^T tile (6 x 2 accumulator registers)
constexpr int PM = 6;         // rows per P V tile

// A thread's tile set: none (the vector paths), or SoftTiles / AmxTiles (cpu_prefill_tiles.h).
struct NoTiles {
    void begin() {}
    void end() {}
};

// st[j][0, NV) = sum_e kb[j][e] * qt[e][0, NV) for the M keys j of the tile; kMax: and
// mx[0, NV) = max(mx, the tile's scores) (a block no row stops inside: no mask to apply).
template <int M, bool kMax>
inline void qk_tile(const float* kb, int64_t ldk, const float* qt, int64_t ldq, int64_t d,
                    float* st, int64_t lds, float* mx) {
    float acc[M][NV];
#pragma GCC unroll 6
    for (int j = 0; j < M; ++j)
#pragma omp simd
        for (int r = 0; r < NV; ++r) acc[j][r] = 0.0f;
    for (int64_t e = 0; e < d; ++e) {
        const float* qe = qt + e * ldq;
#pragma GCC unroll 6
        for (int j = 0; j < M; ++j) {
            const float kj = kb[j * ldk + e];
#pragma omp simd
            for (int r = 0; r < NV; ++r) acc[j][r] = fmadd(kj, qe[r], acc[j][r]);
        }
    }
#pragma GCC unroll 6
    for (int j = 0; j < M; ++j)
#pragma omp simd
        for (int r = 0; r < NV; ++r) st[j * lds + r] = acc[j][r];
    if constexpr (kMax) {
#pragma GCC unroll 6
        for (int j = 0; j < M; ++j)
#pragma omp simd
            for (int r = 0; r < NV; ++r) mx[r] = mx[r] > acc[j][r] ? mx[r] : acc[j][r];
    }
}

// o[i][0, NV) = o[i][0, NV) * corr[i] + sum_{j < nk} pt[j][i] * vb[j][0, NV) for the M rows i.
template <int M>
inline void pv_tile(const float* pt, int64_t ldp, const float* vb, int64_t ldv, int64_t nk,
                    const float* corr, float* o, int64_t ldo) {
    float acc[M][NV];
#pragma GCC unroll 6
    for (int i = 0; i < M; ++i) {
        const float c = corr[i];
#pragma omp simd
        for (int x = 0; x < NV; ++x) acc[i][x] = o[i * ldo + x] * c;
    }
    for (int64_t j = 0; j < nk; ++j) {
        const float* vj = vb + j * ldv;
#pragma GCC unroll 6
        for (int i = 0; i < M; ++i) {
            const float p = pt[j * ldp + i];
#pragma omp simd
            for (int x = 0; x < NV; ++x) acc[i][x] = fmadd(p, vj[x], acc[i][x]);
        }
    }
#pragma GCC unroll 6
    for (int i = 0; i < M; ++i)
#pragma omp simd
        for (int x = 0; x < NV; ++x) o[i * ldo + x] = acc[i][x];
}

// S^T for nk keys (kb [nk][d]) x NV rows (qt [d][..] from its column 0): tiles of KM keys,
// the last one of nk % KM (each tile size a compile-time constant: registers).
template <bool kMax>
void qk_tiles(int64_t nk, const float* kb, int64_t d, const float* qt, int64_t ldq, float* st,
              int64_t lds, float* mx) {
    in_tiles<KM>(nk, [&](auto m, int64_t j0) {
        qk_tile<decltype(m)::value, kMax>(kb + j0 * d, d, qt, ldq, d, st + j0 * lds, lds, mx);
    });
}

// P V into NV columns of O for `rows` rows: tiles of PM rows, the last one of rows % PM.
inline void pv_tiles(int64_t rows, const float* pt, int64_t ldp, const float* vb, int64_t ldv,
                     int64_t nk, const float* corr, float* o, int64_t ldo) {
    in_tiles<PM>(rows, [&](auto m, int64_t i0) {
        pv_tile<decltype(m)::value>(pt + i0, ldp, vb, ldv, nk, corr + i0, o + i0 * ldo, ldo);
    });
}

// A pool row (one slot, one KV head) -> d float32 values: codes times the row's scale.
template <typename K>
inline void load_row(const typename K::T* src, float s, int64_t d, float* dst) {
    if constexpr (K::kScaled) {
#if defined(__AVX2__) && defined(__F16C__)
        if constexpr (std::is_same<K, E4M3>::value || std::is_same<K, E5M2>::value) {
            if (d % 16 == 0) {
                fp8_row_to_f32<K>(src, s, static_cast<int>(d), dst);
                return;
            }
        }
#endif
#pragma omp simd
        for (int64_t e = 0; e < d; ++e) dst[e] = K::load(src[e]) * s;
    } else {
#pragma omp simd
        for (int64_t e = 0; e < d; ++e) dst[e] = K::load(src[e]);
    }
}

// One work item: query positions [t0, t0 + bq) of a request, the G query heads of KV head h.
template <typename C, typename K>
void attend_block(Buffers& b, const typename C::T* q, const typename K::T* kpool,
                  const typename K::T* vpool, const float* kscale, const float* vscale,
                  const int32_t* slots, int64_t prefix, int64_t t0, int64_t bq, int64_t h,
                  int64_t heads, int64_t kvh, int64_t d, float scale, typename C::T* out) {
#if defined(BANYAN_PREFILL_PAIRS)
    if constexpr (std::is_same<C, BF16>::value) {  // vdpbf16ps over bf16 pairs
        if (pairs_fit(d)) {  // (cpu_prefill_pairs.h)
            if constexpr (std::is_same<K, BF16>::value)
                attend_block_pairs(b, q, kpool, vpool, nullptr, nullptr, slots, prefix, t0, bq,
                                   h, heads, kvh, d, scale, out);
            else  // int8 / fp8 codes
                attend_block_pairs<K>(b, q, kpool, vpool, kscale, vscale, slots, prefix, t0,
                                      bq, h, heads, kvh, d, scale, out);
            return;
        }
    }
#endif
    const int64_t g = heads / kvh, rows = bq * g;
    b.fit(rows, d);
    const int64_t rp = b.rp, dv = b.dv;
    const int64_t kend = prefix + t0 + bq;  // keys the block's last row sees
    // Q^T [d][rp], scaled; row r = (position t, head gh) = t * g + gh sees keys < lim[r].
    // Padding rows (zeros) see every key, so their state stays finite; never written out.
    for (int64_t r = 0; r < rp; ++r) {
        b.lim[r] = static_cast<int32_t>(r < rows ? prefix + t0 + r / g + 1 : kend);
        b.m[r] = -INFINITY;
        b.l[r] = 0.0f;
    }
    for (int64_t t = 0; t < bq; ++t)
        for (int64_t gh = 0; gh < g; ++gh) {
            const typename C::T* src = q + ((t0 + t) * heads + h * g + gh) * d;
            for (int64_t e = 0; e < d; ++e) b.qt[e * rp + t * g + gh] = C::load(src[e]) * scale;
        }
    for (int64_t r = rows; r < rp; ++r)
        for (int64_t e = 0; e < d; ++e) b.qt[e * rp + r] = 0.0f;
    std::fill(b.o.begin(), b.o.begin() + rp * dv, 0.0f);

    // (Software prefetching of the next block's rows measured no faster on Zen 3, even over
    // slots scattered through a pool larger than L3: a block's products hide its loads.)
    for (int64_t k0 = 0; k0 < kend; k0 += BK) {
        const int64_t nk = std::min<int64_t>(BK, kend - k0);
        for (int64_t j = 0; j < nk; ++j) {
            const int64_t row = static_cast<int64_t>(slots[k0 + j]) * kvh + h;
            const float ks = K::kScaled ? row_scale(kscale, row) : 1.0f;
            const float vs = K::kScaled ? row_scale(vscale, row) : 1.0f;
            load_row<K>(kpool + row * d, ks, d, &b.kb[j * d]);
            load_row<K>(vpool + row * d, vs, d, &b.vb[j * dv]);
        }
        // causal masking only where some row stops inside the block
        const bool diagonal = k0 + nk > prefix + t0 + 1;
        std::copy_n(b.m.begin(), rp, b.corr.begin());  // the maxima so far
        // S^T: rows in vectors of NV, keys in tiles of KM (the key block stays in L1)
        for (int64_t r0 = 0; r0 < rp; r0 += NV) {
            if (diagonal)
                qk_tiles<false>(nk, b.kb.data(), d, &b.qt[r0], rp, &b.st[r0], rp, &b.corr[r0]);
            else
                qk_tiles<true>(nk, b.kb.data(), d, &b.qt[r0], rp, &b.st[r0], rp, &b.corr[r0]);
        }
        if (diagonal)
            softmax_block<true>(b, k0, nk);
        else
            softmax_block<false>(b, k0, nk);
        for (int64_t c0 = 0; c0 < dv; c0 += NV)
            pv_tiles(rows, b.st.data(), rp, &b.vb[c0], dv, nk, b.corr.data(), &b.o[c0], dv);
    }
    for (int64_t t = 0; t < bq; ++t)
        for (int64_t gh = 0; gh < g; ++gh) {
            const int64_t r = t * g + gh;
            const float inv = 1.0f / b.l[r];
            typename C::T* dst = out + ((t0 + t) * heads + h * g + gh) * d;
            const float* src = &b.o[r * dv];
            for (int64_t e = 0; e < d; ++e) dst[e] = C::store(src[e] * inv);
        }
}

// Tiles: NoTiles, or the tile set (cpu_prefill_tiles.h) bf16 queries' items take where the
// head dim fits the pairs.
template <typename C, typename K, typename Tiles = NoTiles>
void prefill_attention(const typename C::T* q, const typename K::T* kpool,
                       const typename K::T* vpool, const float* kscale, const float* vscale,
                       const int32_t* table, int64_t table_stride, const int64_t* req_row,
                       const int64_t* req_len, const int64_t* q_start, const int64_t* n_new,
                       int64_t n_reqs, typename C::T* out, int64_t heads, int64_t kvh, int64_t d,
                       float scale, int64_t n_threads) {
    const int64_t g = heads / kvh;
    // Query positions per item: up to about 192 rows (each key block, converted once, serves
    // them all; on Zen 3 192 rows measured up to 10% faster than 96 on one core), a power of two
    // in [8, 64]; halved while there are fewer items than threads (a short chunk on many cores).
    // Each row's result does not depend on it (see the top).
    int64_t bq = 64;
    while (bq > 8 && bq * g > 192) bq /= 2;
    auto count = [&](int64_t block) {
        int64_t n = 0;
        for (int64_t i = 0; i < n_reqs; ++i) n += (n_new[i] + block - 1) / block * kvh;
        return n;
    };
    while (bq > 8 && count(bq) < n_threads) bq /= 2;
    struct Item {
        int64_t req, t0, h, cost;
    };
    std::vector<Item> items;
    for (int64_t i = 0; i < n_reqs; ++i)
        for (int64_t t0 = 0; t0 < n_new[i]; t0 += bq)
            for (int64_t h = 0; h < kvh; ++h) {
                const int64_t prefix = req_len[i] - n_new[i];
                items.push_back({i, t0, h, prefix + t0 + std::min(bq, n_new[i] - t0)});
            }
    // the longest items first (the diagonal's last blocks), so the dynamic schedule ends even
    std::stable_sort(items.begin(), items.end(),
                     [](const Item& a, const Item& b) { return a.cost > b.cost; });
    const int64_t n_items = static_cast<int64_t>(items.size());
    std::atomic<int64_t> claimed{0};  // items go to threads as they come free
    banyan_team::parallel_team(n_threads, [&](int, int) {
        Buffers buf;
        Tiles tl;
        tl.begin();
        for (int64_t it = claimed.fetch_add(1); it < n_items; it = claimed.fetch_add(1)) {
            const Item& w = items[it];
            const int64_t i = w.req, prefix = req_len[i] - n_new[i];
            const int64_t bqi = std::min(bq, n_new[i] - w.t0);
            const int32_t* slots = table + req_row[i] * table_stride;
#if defined(BANYAN_PREFILL_TILES)
            if constexpr (!std::is_same<Tiles, NoTiles>::value) {
                static_assert(std::is_same<C, BF16>::value, "tiles take bf16 queries");
                if (pairs_fit(d)) {
                    constexpr bool kCodes = !std::is_same<K, BF16>::value;
                    using Codes = typename std::conditional<kCodes, K, void>::type;
                    attend_block_tiles<Tiles, Codes>(tl, buf, q + q_start[i] * heads * d, kpool,
                                                     vpool, kscale, vscale, slots, prefix, w.t0,
                                                     bqi, w.h, heads, kvh, d, scale,
                                                     out + q_start[i] * heads * d);
                    continue;
                }
            }
#endif
            attend_block<C, K>(buf, q + q_start[i] * heads * d, kpool, vpool, kscale, vscale,
                               slots, prefix, w.t0, bqi, w.h, heads, kvh, d, scale,
                               out + q_start[i] * heads * d);
        }
        tl.end();
    });
}

}  // namespace

extern "C" {

// q, out: [T, H, D] (the step's flat tokens; only the listed requests' rows are read and
// written); k, v: one layer of the pool [slots, KVH, D]; kscale, vscale: [slots, KVH] float32
// for a quantized pool, else null; table: [rows, stride] int32. Per request (int64 [n_reqs]):
// req_row, req_len (context with its new tokens, all stored), q_start (its first token in q),
// n_new (its new tokens, attending causally).
#define BANYAN_PREFILL_ATTENTION(NAME, C, K)                                                  \
    BANYAN_PREFILL_ATTENTION_SIGNATURE(NAME, C::T, K::T) {                                    \
        prefill_attention<C, K>(q, k, v, kscale, vscale, table, table_stride, req_row,       \
                                req_len, q_start, n_new, n_reqs, out, heads, kvh, d, scale,  \
                                n_threads);                                                  \
    }

BANYAN_PREFILL_ATTENTION(banyan_prefill_attention_f32_f32, F32, F32)
BANYAN_PREFILL_ATTENTION(banyan_prefill_attention_bf16_bf16, BF16, BF16)
BANYAN_PREFILL_ATTENTION(banyan_prefill_attention_f32_int8, F32, I8)
BANYAN_PREFILL_ATTENTION(banyan_prefill_attention_bf16_int8, BF16, I8)
BANYAN_PREFILL_ATTENTION(banyan_prefill_attention_f32_fp8_e4m3, F32, E4M3)
BANYAN_PREFILL_ATTENTION(banyan_prefill_attention_bf16_fp8_e4m3, BF16, E4M3)
BANYAN_PREFILL_ATTENTION(banyan_prefill_attention_f32_fp8_e5m2, F32, E5M2)
BANYAN_PREFILL_ATTENTION(banyan_prefill_attention_bf16_fp8_e5m2, BF16, E5M2)

#if defined(BANYAN_PREFILL_TILES)
// The same for bf16 queries with the products on tiles (cpu_prefill_tiles.h): hardware 1,
// AMX's (only where banyan_prefill_tiles() is 2; else emulated, never a fault), else 0, the
// tiles emulated in memory (tests).
#define BANYAN_PREFILL_TILES_ENTRY(NAME, K)                                                    \
    void NAME(BANYAN_PREFILL_ATTENTION_PARAMS(BF16::T, K::T), int hardware) {                  \
        auto run = [&](auto tiles) {                                                           \
            prefill_attention<BF16, K, decltype(tiles)>(q, k, v, kscale, vscale, table,        \
                                                        table_stride, req_row, req_len,        \
                                                        q_start, n_new, n_reqs, out, heads,    \
                                                        kvh, d, scale, n_threads);             \
        };                                                                                     \
        hardware && amx_granted() ? run(AmxTiles{}) : run(SoftTiles{});                        \
    }

BANYAN_PREFILL_TILES_ENTRY(banyan_prefill_attention_tiles_bf16_bf16, BF16)
BANYAN_PREFILL_TILES_ENTRY(banyan_prefill_attention_tiles_bf16_int8, I8)
BANYAN_PREFILL_TILES_ENTRY(banyan_prefill_attention_tiles_bf16_fp8_e4m3, E4M3)
BANYAN_PREFILL_TILES_ENTRY(banyan_prefill_attention_tiles_bf16_fp8_e5m2, E5M2)
#endif

// The layer stack's calls for bf16 queries (cpu_layer_stack.cpp), one per pool type, their
// products where the per-op path's are (CpuNativeBackend.tiles: 0 the vector paths, 1 tiles
// emulated, 2 AMX's; only 0 in a build without the tile path), so a chunk has one set of bits
// either way.
#if defined(BANYAN_PREFILL_TILES)
#define BANYAN_PREFILL_STACK_ENTRY(NAME, K, SFX)                                               \
    void NAME(BANYAN_PREFILL_ATTENTION_PARAMS(BF16::T, K::T), int64_t tiles) {                 \
        if (tiles > 0)                                                                         \
            return banyan_prefill_attention_tiles_bf16_##SFX(                                  \
                q, k, v, kscale, vscale, table, table_stride, req_row, req_len, q_start,       \
                n_new, n_reqs, out, heads, kvh, d, scale, n_threads, tiles == 2);              \
        banyan_prefill_attention_bf16_##SFX(q, k, v, kscale, vscale, table, table_stride,      \
                                            req_row, req_len, q_start, n_new, n_reqs, out,     \
                                            heads, kvh, d, scale, n_threads);                  \
    }
#else
#define BANYAN_PREFILL_STACK_ENTRY(NAME, K, SFX)                                               \
    void NAME(BANYAN_PREFILL_ATTENTION_PARAMS(BF16::T, K::T), int64_t) {                       \
        banyan_prefill_attention_bf16_##SFX(q, k, v, kscale, vscale, table, table_stride,      \
                                            req_row, req_len, q_start, n_new, n_reqs, out,     \
                                            heads, kvh, d, scale, n_threads);                  \
    }
#endif

BANYAN_PREFILL_STACK_ENTRY(banyan_prefill_attention_stack_bf16, BF16, bf16)
BANYAN_PREFILL_STACK_ENTRY(banyan_prefill_attention_stack_bf16_int8, I8, int8)
BANYAN_PREFILL_STACK_ENTRY(banyan_prefill_attention_stack_bf16_fp8_e4m3, E4M3, fp8_e4m3)
BANYAN_PREFILL_STACK_ENTRY(banyan_prefill_attention_stack_bf16_fp8_e5m2, E5M2, fp8_e5m2)

// 2: this build has the tile path and Linux granted this process AMX's tile state; 1: the
// tile path only emulated (no AMX here, or not granted); 0: no tile path in this build.
int banyan_prefill_tiles() {
#if defined(BANYAN_PREFILL_TILES)
    return amx_granted() ? 2 : 1;
#else
    return 0;
#endif
}

// 1 when bf16 queries over a bf16 pool take the vdpbf16ps pair path (cpu_prefill_pairs.h).
int banyan_prefill_pairs() {
#if defined(BANYAN_PREFILL_PAIRS)
    return 1;
#else
    return 0;
#endif
}

}  // extern "C"
