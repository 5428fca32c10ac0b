// One thread's state of the paged-attention kernel (cpu_paged_attention.cpp): query rows, their
// online softmax, and the dispatch of a segment of keys to the loops of cpu_attend.h,
// cpu_attend512.h; a request's keys in parts (kPartKeys).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "cpu_attend.h"
#include "cpu_attend512.h"
#include "cpu_attend_tiles.h"
// exp_nonpos_fma and fmadd, which fold parts' states as the prefill kernel merges its blocks
// (the vector-width pragma of that header confined to it)
#pragma GCC push_options
#include "cpu_prefill_common.h"
#pragma GCC pop_options

namespace {

// On the AVX-512 and AVX2 paths, keys of a quantized pool are dequantized this many at a time
// into rows of the queries' type, which those paths then attend as an unquantized pool (a few
// dozen KB per thread: they stay in cache). The portable loops convert codes as they load a
// block instead (on Zen 3 an extra pass before them measured 1.4x slower).
constexpr int64_t QCHUNK = 128;
// A request's keys are attended in parts of this many from its first (one part up to here),
// each part from a fresh softmax state, the parts' states folded in order: a row's bits then
// depend on its query and keys alone, whether it is a lone request's (a decode or a
// speculative check, whose parts the threads share: its KV heads are too few for them), in a
// step of many requests, or in a decode group (its shared prefix taken in whole parts, once
// for all members). A lone decode once split its keys into parts of its own length and merged
// them another way, and its text parted from the same text speculated.
constexpr int64_t kPartKeys = 256;
#if defined(__AVX512F__)
constexpr bool has_wide_paths = true;
#else
constexpr bool has_wide_paths = false;
#endif
// bf16 queries over a quantized pool with AVX512-BF16: the codes read in place
// (cpu_attend512.h).
#if defined(__AVX512F__)
template <typename C, typename K>
constexpr bool codes_in_place = K::kScaled && kPairsFor<typename C::T>;
#else
template <typename C, typename K>
constexpr bool codes_in_place = false;
#endif
// The AVX2 loops (attend256) take float32 rows: a float32 model's quantized pool is
// dequantized chunk by chunk for them, as for the AVX-512 paths.
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
constexpr bool has_avx2_paths = true;
#else
constexpr bool has_avx2_paths = false;
#endif

// Rows slots[0, n) of KV head h of a quantized pool -> out [n][d] in C's type: code x scale,
// rounded once to C (a bf16 model attends bf16 values, as with a bf16 pool).
template <typename C, typename K>
void dequantize(const int32_t* slots, int64_t n, const typename K::T* pool, const float* scale,
                int64_t kvh, int64_t h, int d, typename C::T* out) {
    for (int64_t j = 0; j < n; ++j) {
        const int64_t row = static_cast<int64_t>(slots[j]) * kvh + h;
        const typename K::T* src = pool + row * d;
        const float s = row_scale(scale, row);
        typename C::T* dst = out + j * d;
#if defined(__AVX2__) && defined(__F16C__)
        if constexpr (std::is_same<C, F32>::value &&
                      (std::is_same<K, E4M3>::value || std::is_same<K, E5M2>::value)) {
            if (d % 16 == 0) {
                fp8_row_to_f32<K>(src, s, d, dst);
                continue;
            }
        }
#endif
#pragma omp simd
        for (int e = 0; e < d; ++e) dst[e] = C::store(K::load(src[e]) * s);
    }
}

// A part's softmax state (m, l, acc) folded into the state of the parts before it (fm, fl,
// facc): both rescaled to the larger maximum and added. A part whose row saw no key (m -inf)
// changes nothing; into an empty fold (fm -inf) a part comes as it is.
inline void fold(float& fm, float& fl, float* facc, float m, float l, const float* acc,
                 int64_t d) {
    const float top = std::max(fm, m);
    const float wa = exp_nonpos_fma(fm - top), wb = exp_nonpos_fma(m - top);
    fl = fmadd(fl, wa, l * wb);
    for (int64_t e = 0; e < d; ++e) facc[e] = fmadd(facc[e], wa, acc[e] * wb);
    fm = top;
}

// The tile mode of a call's rows (decode_tiles_mode where it applies: bf16 queries over a bf16
// pool, head dims of whole 64-byte tile rows), else 0.
template <typename C, typename K>
inline int tiles_for(int64_t d) {
#if defined(BANYAN_DECODE_TILES)
    if constexpr (std::is_same<C, BF16>::value && std::is_same<K, BF16>::value)
        return d % 32 == 0 ? decode_tiles_mode() : 0;
#endif
    (void)d;
    return 0;
}

// One thread's attention state and the dispatch to the block loops of cpu_attend.h: rows of
// queries (scaled, with their online-softmax state in `sc`) attended to segments of keys.
// C: the queries' and outputs' type; K: the pool's (C's own, or a quantized one with scales).
template <typename C, typename K>
struct Attender {
    const typename K::T* kpool = nullptr;
    const typename K::T* vpool = nullptr;
    const float* kscale = nullptr;
    const float* vscale = nullptr;
    int64_t kvh = 0, d = 0;
    float scale = 0.0f;
    Scratch sc;
    std::vector<typename C::T> qraw;  // the rows unscaled, for the AVX-512 paths
    // a quantized pool's keys and values of one chunk, dequantized, and their "slots"
    std::vector<typename C::T> kq, vq;
    std::vector<int32_t> iota;
    bool wide = false;
    // The products on tiles (decode_tiles_mode: 1 emulated, 2 AMX), for bf16 queries over a
    // bf16 pool; 0 the vector loops.
    int tiles = 0;
#if defined(BANYAN_DECODE_TILES)
    TileScratch ts;
#endif

    // This call's pool and shape (the scratch keeps its capacity from call to call: see
    // thread_attender).
    void bind(const typename K::T* k, const typename K::T* v, const float* ks, const float* vs,
              int64_t kv_heads, int64_t dim, float sm_scale) {
        kpool = k, vpool = v, kscale = ks, vscale = vs, kvh = kv_heads, d = dim;
        scale = sm_scale;
        tiles = tiles_for<C, K>(dim);
        if (K::kScaled && (has_wide_paths || (has_avx2_paths && std::is_same<C, F32>::value))) {
            kq.resize(QCHUNK * d);
            vq.resize(QCHUNK * d);
            iota.resize(QCHUNK);
            for (size_t i = 0; i < iota.size(); ++i) iota[i] = static_cast<int32_t>(i);
        }
    }

    void fit(int rows) {
        // (a tile pass reads and writes whole blocks of 32 rows from a call's first row)
        const int64_t padded = tiles ? tile_rows(rows) : rows;
        sc.fit(static_cast<int>(padded), static_cast<int>(d));
        wide = has_wide_paths && d % 32 == 0;
        if (wide) qraw.resize(static_cast<size_t>(rows + (tiles ? kTileBlock : 0)) * d);
    }

    // Row r: query qs (d values), no keys seen yet, causal limit lim.
    void start_row(int64_t r, const typename C::T* qs, int64_t lim) {
        if (wide) std::copy_n(qs, d, qraw.data() + r * d);
        float* qd = sc.q.data() + r * d;
        for (int64_t e = 0; e < d; ++e) qd[e] = C::load(qs[e]) * scale;
        sc.m[r] = -INFINITY;
        sc.l[r] = 0.0f;
        sc.lim[r] = lim;
        std::fill_n(sc.acc.data() + r * d, d, 0.0f);
    }

    // Attend rows [r0, r0 + nrows) to keys slots[0, n) of KV head h of an unquantized pool
    // (or of dequantized rows: kvh 1, head 0) on the AVX-512 paths.
    void wide_plain(int r0, int nrows, const int32_t* slots, int64_t n, bool causal,
                    const typename C::T* kp, const typename C::T* vp, int64_t kv_heads,
                    int64_t head) {
#if defined(BANYAN_DECODE_TILES)
        if constexpr (std::is_same<C, BF16>::value && std::is_same<K, BF16>::value) {
            if (tiles) {  // (a bf16 pool: never a dequantized chunk's rows here)
                auto run = [&](auto& tl) {
                    attend_tiles512(tl, ts, sc, qraw.data() + static_cast<size_t>(r0) * d, r0,
                                    nrows, slots, n, kp, vp, kv_heads, head,
                                    static_cast<int>(d), scale, causal);
                };
                AmxTiles amx;
                tiles == 2 ? run(amx) : run(ts.soft);
                return;
            }
        }
#endif
#if defined(__AVX512F__)
        attend512<typename C::T>(sc, qraw.data() + static_cast<size_t>(r0) * d, r0, nrows,
                                 slots, n, kp, vp, kv_heads, head, static_cast<int>(d), scale,
                                 causal);
#else  // never called: `wide` is false without AVX-512
        (void)r0, (void)nrows, (void)slots, (void)n, (void)causal, (void)kp, (void)vp;
        (void)kv_heads, (void)head;
#endif
    }

    void segment(int r0, int nrows, const int32_t* slots, int64_t n, bool causal, int64_t h) {
        if (!wide) {
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
            if constexpr (std::is_same<K, F32>::value) {
                if (d % 8 == 0) {
                    attend256(sc, r0, nrows, slots, n, kpool, vpool, kvh, h,
                              static_cast<int>(d), causal);
                    return;
                }
            } else if constexpr (K::kScaled && std::is_same<C, F32>::value) {
                if (d % 8 == 0) {  // (Zen 3, 64 x 256 decodes: 1.2-1.7x the portable loops)
                    dequantized(r0, nrows, slots, n, causal, h,
                                [&](const int32_t* at, int64_t cn) {
                                    attend256(sc, r0, nrows, at, cn, kq.data(), vq.data(), 1,
                                              0, static_cast<int>(d), causal);
                                });
                    return;
                }
            }
#endif
            attend<K>(sc, r0, nrows, slots, n, kpool, vpool, kscale, vscale, kvh, h,
                      static_cast<int>(d), causal);
        } else if constexpr (!K::kScaled) {
            wide_plain(r0, nrows, slots, n, causal, kpool, vpool, kvh, h);
        } else if constexpr (codes_in_place<C, K>) {
#if defined(__AVX512F__)
            attend512<uint16_t, typename K::T, K>(
                sc, qraw.data() + static_cast<size_t>(r0) * d, r0, nrows, slots, n, kpool, vpool,
                kvh, h, static_cast<int>(d), scale, causal, kscale, vscale);
#endif
        } else {
            dequantized(r0, nrows, slots, n, causal, h, [&](const int32_t* at, int64_t cn) {
                wide_plain(r0, nrows, at, cn, causal, kq.data(), vq.data(), 1, 0);
            });
        }
    }

    // A quantized pool's keys slots[0, n) of head h, QCHUNK at a time dequantized into kq / vq
    // and attended there by `attend_chunk(slots of the chunk's rows, rows)`; the causal limits
    // count keys from each chunk's start meanwhile.
    template <typename F>
    void dequantized(int r0, int nrows, const int32_t* slots, int64_t n, bool causal, int64_t h,
                     F&& attend_chunk) {
        for (int64_t c0 = 0; c0 < n; c0 += QCHUNK) {
            const int64_t cn = std::min(QCHUNK, n - c0);
            const int di = static_cast<int>(d);
#if defined(__AVX2__)
            // Every row of the chunk, K and V, requested at once: read row by row, each miss was
            // waited out in turn (perf: the dequantizing loop stalled on its loads). 64 x 256
            // decodes on Zen 5: int8 pool ~1.2x, fp8 ~2.3x faster (kv-quant-prefetch-ab-zen5).
            const int64_t bytes = d * static_cast<int64_t>(sizeof(typename K::T));
            for (int64_t j = c0; j < c0 + cn; ++j) {
                const int64_t row = static_cast<int64_t>(slots[j]) * kvh + h;
                const char* k_row = reinterpret_cast<const char*>(kpool + row * d);
                const char* v_row = reinterpret_cast<const char*>(vpool + row * d);
                for (int64_t off = 0; off < bytes; off += 64) {
                    _mm_prefetch(k_row + off, _MM_HINT_T0);
                    _mm_prefetch(v_row + off, _MM_HINT_T0);
                }
            }
#endif
            dequantize<C, K>(slots + c0, cn, kpool, kscale, kvh, h, di, kq.data());
            dequantize<C, K>(slots + c0, cn, vpool, vscale, kvh, h, di, vq.data());
            attend_chunk(iota.data(), cn);
            if (causal)
                for (int r = r0; r < r0 + nrows; ++r) sc.lim[r] -= cn;
        }
        if (causal)
            for (int r = r0; r < r0 + nrows; ++r) sc.lim[r] += n;
    }

    // An output row: accumulated values acc [d] over their softmax sum l.
    static void finish(const float* acc, float l, typename C::T* os, int64_t d) {
        const float inv = 1.0f / l;
        for (int64_t e = 0; e < d; ++e) os[e] = C::store(acc[e] * inv);
    }

    // Row r's output.
    void finish_row(int64_t r, typename C::T* os) const {
        finish(sc.acc.data() + r * d, sc.l[r], os, d);
    }

    // Row r's softmax state (m, l, acc: d + 2 floats) out into `state`, or in from it.
    void save_state(int64_t r, float* state) const {
        state[0] = sc.m[r];
        state[1] = sc.l[r];
        std::copy_n(sc.acc.data() + r * d, d, state + 2);
    }
    void load_state(int64_t r, const float* state) {
        sc.m[r] = state[0];
        sc.l[r] = state[1];
        std::copy_n(state + 2, d, sc.acc.data() + r * d);
    }

    // Row r's state back to none (as start_row leaves it), its query kept.
    void reset_row(int64_t r) {
        sc.m[r] = -INFINITY;
        sc.l[r] = 0.0f;
        std::fill_n(sc.acc.data() + r * d, d, 0.0f);
    }

    // Rows [r0, r0 + nrows) of KV head h over keys slots[0, n) part by part (kPartKeys), each
    // part from a fresh state, folded into the rows' states so far (none, or the parts of a
    // group's shared prefix before); causal: up to the rows' limits (start_row, counted from
    // slots[0]), else every row sees every key (a shared prefix).
    void parts(int r0, int nrows, const int32_t* slots, int64_t n, bool causal, int64_t h) {
        folded.resize(static_cast<size_t>(nrows) * (d + 2));  // per row: m, l, acc
        fold_lim.resize(nrows);
        for (int i = 0; i < nrows; ++i) {
            fold_lim[i] = sc.lim[r0 + i];
            save_state(r0 + i, folded.data() + i * (d + 2));
        }
        for (int64_t p0 = 0; p0 < n; p0 += kPartKeys) {
            // causal rows before the part (a long chunk's first tokens) see none of its keys:
            // left out, not folded (as a decode of that token has no such part)
            int i0 = 0;
            while (causal && i0 < nrows && fold_lim[i0] <= p0) ++i0;
            for (int i = i0; i < nrows; ++i) {
                reset_row(r0 + i);
                sc.lim[r0 + i] = fold_lim[i] - p0;
            }
            segment(r0 + i0, nrows - i0, slots + p0, std::min(kPartKeys, n - p0), causal, h);
            for (int i = i0; i < nrows; ++i) {
                float* f = folded.data() + i * (d + 2);
                fold(f[0], f[1], f + 2, sc.m[r0 + i], sc.l[r0 + i], sc.acc.data() + (r0 + i) * d,
                     d);
            }
        }
        for (int i = 0; i < nrows; ++i) {
            load_state(r0 + i, folded.data() + i * (d + 2));
            sc.lim[r0 + i] = fold_lim[i];
        }
    }

    // The same over a request's own keys, causally; `fresh`: the rows have seen no key yet,
    // so one part is attended as it is (a fold into nothing leaves it as it is).
    void own_keys(int r0, int nrows, const int32_t* slots, int64_t n, int64_t h, bool fresh) {
        if (fresh && n <= kPartKeys) return segment(r0, nrows, slots, n, true, h);
        parts(r0, nrows, slots, n, true, h);
    }

    std::vector<float> folded;  // own_keys' states of the parts so far
    std::vector<int64_t> fold_lim;
};

// The calling thread's Attender of this instantiation, bound to this call: one per thread kept
// across calls, so its dozen scratch vectors are not allocated and freed in every layer of
// every step (a batch-1 decode's attention is a few microseconds a layer).
template <typename C, typename K>
Attender<C, K>& thread_attender(const typename K::T* k, const typename K::T* v, const float* ks,
                                const float* vs, int64_t kv_heads, int64_t dim, float sm_scale) {
    static thread_local Attender<C, K> at;
    at.bind(k, v, ks, vs, kv_heads, dim, sm_scale);
    return at;
}

}  // namespace
