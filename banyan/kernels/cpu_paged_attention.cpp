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
// system prompt), so the prefix is read once and attended by all members' query rows
// ([members x G] rows), then each member continues over its own slots [P, len) with its G rows.
// A request alone is a group of one with P = 0. A request's keys go in parts (kPartKeys,
// cpu_paged_attender.h) whose states are folded, and a group's P is taken down to whole parts,
// so a row's bits depend on its query and keys alone: a decode alone, among other decodes, in a
// group, or in a speculative check gets the same output.
//
// Built at run time by banyan/kernels/native.py (g++ -O3 -march=native -fopenmp) and called
// through ctypes; it links the libgomp torch already loaded, so it shares torch's thread pool.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpu_attend.h"
#include "cpu_attend512.h"
#include "cpu_paged_attention.h"
#include "cpu_paged_attender.h"
#include "cpu_team.h"

namespace {

// A lone request over more than kPartKeys keys (a batch-1 decode, or a speculative check of a
// few tokens): its parts of every KV head shared by the threads (its heads alone are too few
// for them: SmolLM2's 3 on 2 threads, one thread taking two), each computed from a fresh state
// as own_keys computes it, then folded in part order per row: the bits own_keys gives those
// rows in any step, on any thread count. q, out: the request's e tokens' rows.
template <typename C, typename K>
void lone_request(const typename C::T* q, const typename K::T* kpool,
                  const typename K::T* vpool, const float* kscale, const float* vscale,
                  const int32_t* slots, int64_t n, int64_t e, typename C::T* out, int64_t heads,
                  int64_t kvh, int64_t d, float scale, int64_t n_threads) {
    const int64_t g = heads / kvh, parts = (n + kPartKeys - 1) / kPartKeys, width = d + 2;
    const int64_t rows = e * g;  // a KV head's rows: token t's query head gh at t * g + gh
    // every part's states (m, l, acc per row: [part][token][head]), written whole before the
    // fold reads them: the calling thread's buffer, kept between calls, shared with the team
    static thread_local std::vector<float> states;
    states.resize(parts * e * heads * width);
    float* st = states.data();
    // Work items: whole parts (every KV head, the part's rows read in order and streamed in
    // first) where there are parts enough to share, else a part's KV heads apart. A decode's
    // few rows wait on its K/V, cold in a step (the weights streamed through the caches since
    // the layer before): its parts go whole once they share out evenly (batch-1 decodes over
    // 600 keys, 3 parts: 1.13x the speed, int4 weights, Zen 4); 2 parts of 256 keys and a
    // short last one go by head (whole, the last part's thread idles: a decode over 300 keys
    // 1.41x the time with its K/V in cache). A check's rows (13 tokens: 39 a head) make its
    // parts compute-bound: whole from 2 a thread.
    const int64_t last = n - (parts - 1) * kPartKeys;  // the last part's keys
    const bool even = parts > n_threads || (parts == n_threads && 2 * last >= kPartKeys);
    const bool whole = parts >= 2 * n_threads || (e == 1 && even);
    const int64_t per = whole ? kvh : 1, items = parts * kvh / per;
    const int64_t threads = std::min(n_threads, items);
    std::atomic<int64_t> claimed{0};  // items go to threads as they come free
    banyan_team::parallel_team(threads, [&](int, int) {
        Attender<C, K>& at = thread_attender<C, K>(kpool, vpool, kscale, vscale, kvh, d, scale);
        const TileSession session(at.tiles);
        at.fit(static_cast<int>(rows));
        for (int64_t it = claimed.fetch_add(1); it < items; it = claimed.fetch_add(1)) {
            const int64_t p = it * per / kvh, h0 = it * per % kvh, p0 = p * kPartKeys;
            const int64_t len = std::min(kPartKeys, n - p0);
            // tokens before the part see none of its keys (a long chunk's first ones)
            const int64_t t0 = std::max<int64_t>(0, p0 - (n - e));
            if (per == kvh) stream_in(kpool, vpool, slots + p0, len, kvh * d);
            for (int64_t h = h0; h < h0 + per; ++h) {
                for (int64_t t = t0; t < e; ++t)
                    for (int64_t gh = 0; gh < g; ++gh)  // causal: up to its position
                        at.start_row(t * g + gh, q + (t * heads + h * g + gh) * d,
                                     n - e + t + 1 - p0);
                at.segment(static_cast<int>(t0 * g), static_cast<int>(rows - t0 * g),
                           slots + p0, len, true, h);
                for (int64_t t = t0; t < e; ++t)
                    for (int64_t gh = 0; gh < g; ++gh)
                        at.save_state(t * g + gh,
                                      st + ((p * e + t) * heads + h * g + gh) * width);
            }
        }
    });
    // then each row's parts folded in order, once every part is in
    banyan_team::parallel_for(e * heads, threads, [&](int64_t tr) {  // (token, query head)
        static thread_local std::vector<float> acc;  // (this thread's)
        acc.assign(d, 0.0f);
        float fm = -INFINITY, fl = 0.0f;
        const int64_t seen = n - e + tr / heads + 1;  // its keys: the parts it has alone
        for (int64_t p = 0; p * kPartKeys < seen; ++p) {
            const float* state = st + (p * e * heads + tr) * width;
            fold(fm, fl, acc.data(), state[0], state[1], state + 2, d);
        }
        Attender<C, K>::finish(acc.data(), fl, out + tr * d, d);
    });
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
    if (n_groups == 1 && group_start[1] - group_start[0] == 1 && req_len[order[0]] > kPartKeys) {
        const int64_t b = order[0];
        lone_request<C, K>(q + q_start[b] * heads * d, kpool, vpool, kscale, vscale,
                           table + req_row[b] * table_stride, req_len[b], n_new[b],
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
    // A group's shared part in whole parts, so that each member's parts are those it has alone:
    // its bits do not depend on whom it shares a step with.
    auto shared_keys = [&](int64_t g) { return group_prefix[g] / kPartKeys * kPartKeys; };
    // The keys of member i of slice `it` past that part: (their slots, how many).
    auto own_span = [&](int64_t it, int64_t i) {
        const int64_t b = order[item_first[it] + i], prefix = shared_keys(item_group[it]);
        return std::make_pair(table + req_row[b] * table_stride + prefix, req_len[b] - prefix);
    };
    const int64_t slices = static_cast<int64_t>(item_group.size());
    // Items go to threads one at a time as they come free (a dynamic schedule), each thread
    // claiming its next item as it starts one, so that it reads that one's keys ahead (below).
    std::atomic<int64_t> claimed{0};
    // Fewer slices than threads (a few short decodes): each KV head of a slice is a work item
    // of its own, so the threads share them.
    const int64_t split = slices < n_threads ? kvh : 1, items = slices * split;
    banyan_team::parallel_team(n_threads, [&](int, int) {
        Attender<C, K>& at = thread_attender<C, K>(kpool, vpool, kscale, vscale, kvh, d, scale);
        const TileSession session(at.tiles);
        std::vector<int64_t> offset;  // first state row of each member of the slice
        bool read_ahead = false;  // the next member's K/V read ahead
        // Otherwise a slice's KV heads all run on one thread, and each member's own keys are
        // walked for every head before the next member's: a slot's K (V) for all heads is one
        // contiguous run, so heads 1.. find the rows head 0 pulled still in cache (a member's
        // few hundred keys; a whole slice's, walked head by head, had left the L2 by then:
        // decodes of 64 x 192 read K/V at a third of the memory's rate on Zen 5).
        for (int64_t wi = claimed.fetch_add(1), next; wi < items; wi = next) {
            next = claimed.fetch_add(1);
            const int64_t it = wi / split, nh = kvh / split, h0 = wi % split * nh;
            const int64_t g = item_group[it];
            const int64_t first = item_first[it];
            const int64_t members = item_count[it];
            const int64_t prefix = shared_keys(g);
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
                    at.parts(static_cast<int>(hh * rows), static_cast<int>(rows),
                             table + req_row[order[first]] * table_stride, prefix, false,
                             h0 + hh);
            for (int64_t i = 0; i < members; ++i) {
                const int64_t b = order[first + i];
                const auto [own, n_own] = own_span(it, i);
                if (nh == kvh) {  // (a work item of one head leaves the others' lines alone)
                    // its K/V into cache: read ahead while this thread's member before it was
                    // attended (the AVX-512 loops), else now (and after a shared prefix, which
                    // may have pushed them out)
                    if (!read_ahead || (i == 0 && prefix > 0))
                        stream_in(kpool, vpool, own, n_own, kvh * d);
                    // then the next member's, or (split is 1 here) the first of the item this
                    // thread attends next, read ahead meanwhile
                    const bool last = i + 1 == members;
                    read_ahead = at.wide && (!last || next < items);
                    if (read_ahead) {
                        const auto [ahead, count] = last ? own_span(next, 0) : own_span(it, i + 1);
                        at.sc.ahead.start(kpool, vpool, ahead, count, kvh * d, n_own, nh);
                    }
                }
                for (int64_t hh = 0; hh < nh; ++hh) {
                    const int64_t r0 = hh * rows + offset[i];
                    at.own_keys(static_cast<int>(r0), static_cast<int>(offset[i + 1] - offset[i]),
                                own, n_own, h0 + hh, prefix == 0);
                    for (int64_t t = 0; t < n_new[b]; ++t)
                        for (int64_t gh = 0; gh < g_heads; ++gh)
                            at.finish_row(r0 + t * g_heads + gh,
                                          out + ((q_start[b] + t) * heads + (h0 + hh) * g_heads +
                                                 gh) * d);
                }
                at.sc.ahead.stop();
            }
        }
    });
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

// The row kernel's products for bf16 queries over a bf16 pool in this process, from now on:
// mode 0 the vector loops, 1 tiles emulated in memory (tests), 2 AMX tiles (refused where
// banyan_prefill_tiles() is not 2: the instructions would fault). Every row of the process
// takes the same path, so a row's bits stay those of its query and keys alone (the two paths'
// bits differ). Returns the mode in effect (any other mode only asks it); a build without
// tiles stays at 0.
int64_t banyan_set_decode_tiles(int64_t mode) {
#if defined(BANYAN_DECODE_TILES)
    if (mode == 0 || mode == 1 || (mode == 2 && amx_granted()))
        decode_tiles_mode() = static_cast<int>(mode);
    return decode_tiles_mode();
#else
    (void)mode;
    return 0;
#endif
}

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
