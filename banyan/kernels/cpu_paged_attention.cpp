// Paged attention on CPU (decodes and short prefill chunks), reading K/V in place from the pool
// through the token table.
//
// The torch path gathers every decode's context into a padded block and runs SDPA on it; on a
// 2-core CPU that costs a copy of all the K/V plus a flash kernel whose per-(batch, head)
// overhead dominates at one query token. Here each work item (a slice of a group of requests,
// its KV heads one after the other) streams its keys straight from the pool in blocks and keeps
// an online softmax per query row, in float32 whatever the pool's dtype.
//
// Groups carry cascade attention: the members of a group share their first P slots (a cached
// system prompt), so the prefix block is converted once and attended by all members' query rows
// ([members x G] rows), then each member continues over its own slots [P, len) with its G rows.
// A request alone is a group of one with P = 0. Exact either way: one softmax over the whole
// context, computed online.
//
// Built at run time by banyan/kernels/native.py (g++ -O3 -march=native -fopenmp) and called
// through ctypes; it links the libgomp torch already loaded, so it shares torch's thread pool.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include <omp.h>

#include "cpu_attend.h"
#include "cpu_attend512.h"
#include "cpu_paged_attention.h"
// the prefill kernel's pair tiles, for a decode group's shared prefix (the vector-width pragma
// of their header confined to them)
#pragma GCC push_options
#include "cpu_prefill_pairs.h"
#pragma GCC pop_options

namespace {

// On the AVX-512 and AVX2 paths, keys of a quantized pool are dequantized this many at a time
// into rows of the queries' type, which those paths then attend as an unquantized pool (a few
// dozen KB per thread: they stay in cache). The portable loops convert codes as they load a
// block instead (on Zen 3 an extra pass before them measured 1.4x slower).
constexpr int64_t QCHUNK = 128;
// Rows from which a segment all of them see whole takes the pair tiles (AVX512-BF16, bf16).
constexpr int kPairRows = 12;
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
        const float s = scale[row];
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
#if defined(BANYAN_PREFILL_PAIRS)
    Buffers pairs;  // a decode group's shared keys through the prefill kernel's pair tiles
#endif

    // This call's pool and shape (the scratch keeps its capacity from call to call: see
    // thread_attender).
    void bind(const typename K::T* k, const typename K::T* v, const float* ks, const float* vs,
              int64_t kv_heads, int64_t dim, float sm_scale) {
        kpool = k, vpool = v, kscale = ks, vscale = vs, kvh = kv_heads, d = dim;
        scale = sm_scale;
        if (K::kScaled && (has_wide_paths || (has_avx2_paths && std::is_same<C, F32>::value))) {
            kq.resize(QCHUNK * d);
            vq.resize(QCHUNK * d);
            iota.resize(QCHUNK);
            for (size_t i = 0; i < iota.size(); ++i) iota[i] = static_cast<int32_t>(i);
        }
    }

    void fit(int rows) {
        sc.fit(rows, static_cast<int>(d));
        wide = has_wide_paths && d % 32 == 0;
        if (wide) qraw.resize(static_cast<size_t>(rows) * d);
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
#if defined(BANYAN_PREFILL_PAIRS)
        // many rows over the same keys (a decode group's shared prefix): register tiles of 32
        // rows x 8 keys and 6 rows x 64 dims, where the row loop takes 8 rows a pass
        if constexpr (std::is_same<C, BF16>::value && std::is_same<K, BF16>::value) {
            if (wide && !causal && nrows >= kPairRows && n >= BK && pairs_fit(d)) {
                const size_t at = static_cast<size_t>(r0);
                shared_segment_pairs(pairs, qraw.data() + at * d, nrows, slots, n, kpool, vpool,
                                     kvh, h, d, scale, sc.m.data() + at, sc.l.data() + at,
                                     sc.acc.data() + at * d);
                return;
            }
        }
#endif
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

    // Row r's output: its accumulated values over its softmax sum.
    void finish_row(int64_t r, typename C::T* os) const {
        const float inv = 1.0f / sc.l[r];
        const float* ar = sc.acc.data() + r * d;
        for (int64_t e = 0; e < d; ++e) os[e] = C::store(ar[e] * inv);
    }
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

// A lone decode of a long context (one request, one token; the batch-1 case): its keys are
// cut into parts (flash-decoding) shared by the threads; each part attends every KV head over
// one contiguous run of slots (a slot's heads side by side: the memory streams in order), and
// the parts' softmax states are merged in part order at the end. Splitting by KV head instead
// left one thread two of SmolLM2's three heads and read each head's rows with a stride.
// The parts depend on the context length only, never on the thread count, so a step gives the
// same bits on 1 thread as on 2: the engine may change its thread count between steps (a shared
// CPU) without changing any output.
constexpr int64_t kSplitMinKeys = 64;  // per part; shorter contexts are not split
constexpr int64_t kMaxParts = 64;

// Parts for n keys: about n / kSplitMinKeys, an even count (2 threads balance) and from 8 on a
// multiple of 8 (so do 4 and 8); 1 when the context is too short to split.
inline int64_t split_parts(int64_t n) {
    const int64_t p = std::min(kMaxParts, n / kSplitMinKeys);
    if (p >= 8) return p / 8 * 8;
    return p >= 2 ? p / 2 * 2 : 1;
}

template <typename C, typename K>
void split_decode(const typename C::T* q, const typename K::T* kpool, const typename K::T* vpool,
                  const float* kscale, const float* vscale, const int32_t* slots, int64_t n,
                  typename C::T* out, int64_t heads, int64_t kvh, int64_t d, float scale,
                  int64_t n_threads) {
    const int64_t g_heads = heads / kvh, parts = split_parts(n);
    // every part's state, written whole before the merge reads it: the calling thread's
    // buffers, kept between calls, shared with the team through these pointers
    static thread_local std::vector<float> states, accs;
    states.resize(2 * parts * heads);
    accs.resize(parts * heads * d);
    float* part_m = states.data();
    float* part_l = part_m + parts * heads;
    float* part_acc = accs.data();
#pragma omp parallel num_threads(static_cast<int>(std::min(n_threads, parts)))
    {
        const int64_t team = omp_get_num_threads(), c = omp_get_thread_num();
        Attender<C, K>& at = thread_attender<C, K>(kpool, vpool, kscale, vscale, kvh, d, scale);
        at.fit(static_cast<int>(g_heads));
        for (int64_t p = parts * c / team; p < parts * (c + 1) / team; ++p) {
            const int64_t k0 = n * p / parts, k1 = n * (p + 1) / parts;
            stream_in(kpool, vpool, slots + k0, k1 - k0, kvh * d);
            for (int64_t h = 0; h < kvh; ++h) {
                for (int64_t gh = 0; gh < g_heads; ++gh)
                    at.start_row(gh, q + (h * g_heads + gh) * d, n);
                at.segment(0, static_cast<int>(g_heads), slots + k0, k1 - k0, false, h);
                for (int64_t gh = 0; gh < g_heads; ++gh) {
                    const int64_t row = p * heads + h * g_heads + gh;
                    part_m[row] = at.sc.m[gh];
                    part_l[row] = at.sc.l[gh];
                    std::copy_n(at.sc.acc.data() + gh * d, d, part_acc + row * d);
                }
            }
        }
#pragma omp barrier
#pragma omp for schedule(static)
        for (int64_t hr = 0; hr < heads; ++hr) {  // merge: rescale each part to the top max
            float top = -INFINITY;
            for (int64_t t = 0; t < parts; ++t) top = std::max(top, part_m[t * heads + hr]);
            static thread_local std::vector<float> acc;  // (this thread's)
            acc.assign(d, 0.0f);
            float l = 0.0f;
            for (int64_t t = 0; t < parts; ++t) {
                const int64_t row = t * heads + hr;
                const float w = exp_nonpos(std::max(part_m[row] - top, -87.0f));
                l += part_l[row] * w;
                for (int64_t e = 0; e < d; ++e) acc[e] += part_acc[row * d + e] * w;
            }
            typename C::T* os = out + hr * d;
            for (int64_t e = 0; e < d; ++e) os[e] = C::store(acc[e] * (1.0f / l));
        }
    }
}

template <typename C, typename K>
void paged_attention(const typename C::T* q, const typename K::T* kpool,
                     const typename K::T* vpool, const float* kscale, const float* vscale,
                     const int32_t* table, int64_t table_stride,
                     const int64_t* req_row, const int64_t* req_len, const int64_t* q_start,
                     const int64_t* n_new, const int64_t* order, const int64_t* group_start,
                     const int64_t* group_prefix, int64_t n_groups, typename C::T* out,
                     int64_t heads, int64_t kvh, int64_t d, float scale, int64_t n_threads) {
    const int64_t g_heads = heads / kvh;  // query heads per KV head
    if (n_groups == 1 && group_start[1] - group_start[0] == 1 && n_new[order[0]] == 1 &&
        split_parts(req_len[order[0]]) > 1) {
        const int64_t b = order[0];
        split_decode<C, K>(q + q_start[b] * heads * d, kpool, vpool, kscale, vscale,
                           table + req_row[b] * table_stride, req_len[b],
                           out + q_start[b] * heads * d, heads, kvh, d, scale, n_threads);
        return;
    }
    // Work items: slices of a group's members of about 48 query rows per KV head (a member has
    // n_new x G rows), the KV heads one after the other. A big group is sliced so the cores
    // share it; each slice re-reads the shared prefix, from cache.
    std::vector<int64_t> item_group, item_first, item_count;
    for (int64_t g = 0; g < n_groups; ++g) {
        int64_t m = group_start[g];
        while (m < group_start[g + 1]) {
            int64_t count = 0, rows = 0;
            while (m + count < group_start[g + 1] && (count == 0 || rows < 48)) {
                rows += n_new[order[m + count]] * g_heads;
                ++count;
            }
            item_group.push_back(g);
            item_first.push_back(m);
            item_count.push_back(count);
            m += count;
        }
    }
    const int64_t slices = static_cast<int64_t>(item_group.size());
    // Fewer slices than threads (a few short decodes): each KV head of a slice is a work item
    // of its own, so the threads share them.
    const int64_t split = slices < n_threads ? kvh : 1;
#pragma omp parallel num_threads(static_cast<int>(n_threads))
    {
        Attender<C, K>& at = thread_attender<C, K>(kpool, vpool, kscale, vscale, kvh, d, scale);
        std::vector<int64_t> offset;  // first state row of each member of the slice
#pragma omp for schedule(dynamic, 1)
        // Otherwise a slice's KV heads all run on one thread, and each member's own keys are
        // walked for every head before the next member's: a slot's K (V) for all heads is one
        // contiguous run, so heads 1.. find the rows head 0 pulled still in cache (a member's
        // few hundred keys; a whole slice's, walked head by head, had left the L2 by then:
        // decodes of 64 x 192 read K/V at a third of the memory's rate on Zen 5).
        for (int64_t wi = 0; wi < slices * split; ++wi) {
            const int64_t it = wi / split, nh = kvh / split, h0 = wi % split * nh;
            const int64_t g = item_group[it];
            const int64_t first = item_first[it];
            const int64_t members = item_count[it];
            const int64_t prefix = group_prefix[g];
            offset.assign(1, 0);
            for (int64_t i = 0; i < members; ++i)
                offset.push_back(offset.back() + n_new[order[first + i]] * g_heads);
            // state rows of a KV head (head hh: from hh x rows)
            const int64_t rows = offset.back();
            at.fit(static_cast<int>(rows * nh));
            for (int64_t hh = 0; hh < nh; ++hh)
                for (int64_t i = 0; i < members; ++i) {
                    const int64_t b = order[first + i];
                    const int64_t own = req_len[b] - prefix;  // keys of its own segment
                    for (int64_t t = 0; t < n_new[b]; ++t)
                        for (int64_t gh = 0; gh < g_heads; ++gh)  // causal: up to its position
                            at.start_row(hh * rows + offset[i] + t * g_heads + gh,
                                         q + ((q_start[b] + t) * heads + (h0 + hh) * g_heads +
                                              gh) * d,
                                         own - n_new[b] + t + 1);
                }
            if (prefix > 0)  // the shared part, once for all members, seen whole by every row
                for (int64_t hh = 0; hh < nh; ++hh)
                    at.segment(static_cast<int>(hh * rows), static_cast<int>(rows),
                               table + req_row[order[first]] * table_stride, prefix, false,
                               h0 + hh);
            for (int64_t i = 0; i < members; ++i) {
                const int64_t b = order[first + i];
                const int32_t* slots = table + req_row[b] * table_stride;
                if (nh == kvh)  // (a work item of one head leaves the others' lines alone)
                    stream_in(kpool, vpool, slots + prefix, req_len[b] - prefix, kvh * d);
                for (int64_t hh = 0; hh < nh; ++hh) {
                    const int64_t r0 = hh * rows + offset[i];
                    at.segment(static_cast<int>(r0), static_cast<int>(offset[i + 1] - offset[i]),
                               slots + prefix, req_len[b] - prefix, true, h0 + hh);
                    for (int64_t t = 0; t < n_new[b]; ++t)
                        for (int64_t gh = 0; gh < g_heads; ++gh)
                            at.finish_row(r0 + t * g_heads + gh,
                                          out + ((q_start[b] + t) * heads + (h0 + hh) * g_heads +
                                                 gh) * d);
                }
            }
        }
    }
}

}  // namespace

extern "C" {

// The entry points: their arguments are described in cpu_paged_attention.h.
#define BANYAN_PAGED_ATTENTION(NAME, C, K)                                                     \
    BANYAN_PAGED_ATTENTION_SIGNATURE(NAME, C::T, K::T) {                                      \
        paged_attention<C, K>(q, k, v, kscale, vscale, table, table_stride, req_row, req_len, \
                              q_start, n_new, order, group_start, group_prefix, n_groups,     \
                              out, heads, kvh, d, scale, n_threads);                          \
    }

BANYAN_PAGED_ATTENTION(banyan_paged_attention_f32_f32, F32, F32)
BANYAN_PAGED_ATTENTION(banyan_paged_attention_bf16_bf16, BF16, BF16)
BANYAN_PAGED_ATTENTION(banyan_paged_attention_f32_int8, F32, I8)
BANYAN_PAGED_ATTENTION(banyan_paged_attention_bf16_int8, BF16, I8)
BANYAN_PAGED_ATTENTION(banyan_paged_attention_f32_fp8_e4m3, F32, E4M3)
BANYAN_PAGED_ATTENTION(banyan_paged_attention_bf16_fp8_e4m3, BF16, E4M3)
BANYAN_PAGED_ATTENTION(banyan_paged_attention_f32_fp8_e5m2, F32, E5M2)
BANYAN_PAGED_ATTENTION(banyan_paged_attention_bf16_fp8_e5m2, BF16, E5M2)

// 512 when this build has the AVX-512 paths, 256 with the AVX2 + FMA ones (attend256: float32
// pools), else 0 (the portable loops).
int64_t banyan_vector_bits() {
#if defined(__AVX512F__)
    return 512;
#elif defined(__AVX2__) && defined(__FMA__)
    return 256;
#else
    return 0;
#endif
}

}  // extern "C"
