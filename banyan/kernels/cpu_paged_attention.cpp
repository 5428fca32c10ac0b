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
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_avx512.h"
#include "cpu_dtypes.h"

namespace {

constexpr int BLK = 32;  // keys per block

// Per-thread scratch of one work item.
struct Scratch {
    std::vector<float> q, m, l, acc, s, kt, vb;
    std::vector<int64_t> lim;  // keys of the current segment each row may see (causal extends)
    void fit(int rows, int d) {
        lim.resize(rows);
        q.resize(static_cast<size_t>(rows) * d);
        acc.resize(static_cast<size_t>(rows) * d);
        m.resize(rows);
        l.resize(rows);
        s.resize(static_cast<size_t>(rows) * BLK);
        kt.resize(static_cast<size_t>(d) * BLK);
        vb.resize(static_cast<size_t>(BLK) * d);
    }
};

// Attend query rows [r0, r0 + rows) of `sc` to the keys at `slots[0, n)` of KV head h.
// K: the pool's element type (cpu_dtypes.h); a scaled (quantized) one multiplies each
// (slot, head) row by its scale as the block is converted.
template <typename K>
void attend(Scratch& sc, int r0, int rows, const int32_t* slots, int64_t n,
            const typename K::T* kpool, const typename K::T* vpool, const float* kscale,
            const float* vscale, int64_t kvh, int64_t h, int d, bool causal) {
    float* kb = sc.kt.data();  // [BLK][D] keys of the block
    float* vb = sc.vb.data();  // [BLK][D]
    for (int64_t j0 = 0; j0 < n; j0 += BLK) {
        const int nb = static_cast<int>(std::min<int64_t>(BLK, n - j0));
        for (int j = 0; j < nb; ++j) {
            const int64_t row = static_cast<int64_t>(slots[j0 + j]) * kvh + h;
            const typename K::T* kr = kpool + row * d;
            const typename K::T* vr = vpool + row * d;
            float* kj = kb + j * d;
            float* vj = vb + j * d;
            if constexpr (K::kScaled) {
                const float ks = kscale[row], vs = vscale[row];
#pragma omp simd
                for (int e = 0; e < d; ++e) kj[e] = K::load(kr[e]) * ks;
#pragma omp simd
                for (int e = 0; e < d; ++e) vj[e] = K::load(vr[e]) * vs;
            } else {
#pragma omp simd
                for (int e = 0; e < d; ++e) kj[e] = K::load(kr[e]);
#pragma omp simd
                for (int e = 0; e < d; ++e) vj[e] = K::load(vr[e]);
            }
        }
        for (int r = r0; r < r0 + rows; ++r) {
            float* sr = sc.s.data() + static_cast<size_t>(r) * BLK;
            const float* qr = sc.q.data() + static_cast<size_t>(r) * d;
            float acc_s[BLK];
            for (int j = 0; j < nb; ++j) {
                const float* kj = kb + j * d;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int e = 0; e < d; ++e) dot += qr[e] * kj[e];
                acc_s[j] = dot;
            }
            int nbr = nb;  // keys of the block this row sees
            if (causal) {
                const int64_t visible = sc.lim[r] - j0;
                if (visible <= 0) continue;
                nbr = static_cast<int>(std::min<int64_t>(nb, visible));
            }
            float mx = sc.m[r];
            for (int j = 0; j < nbr; ++j) mx = std::max(mx, acc_s[j]);
            // m starts at -inf: exp_nonpos clamps, so the first correction is ~0, never NaN.
            const float corr = exp_nonpos(std::max(sc.m[r] - mx, -87.0f));
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int j = 0; j < nbr; ++j) {
                sr[j] = exp_nonpos(acc_s[j] - mx);
                sum += sr[j];
            }
            sc.l[r] = sc.l[r] * corr + sum;
            sc.m[r] = mx;
            float* ar = sc.acc.data() + static_cast<size_t>(r) * d;
#pragma omp simd
            for (int e = 0; e < d; ++e) ar[e] *= corr;
            for (int j = 0; j < nbr; ++j) {
                const float p = sr[j];
                const float* vj = vb + j * d;
#pragma omp simd
                for (int e = 0; e < d; ++e) ar[e] += p * vj[e];
            }
        }
    }
}

#if defined(__AVX512F__)

template <typename T>
void attend512(Scratch& sc, const T* qraw, int r0, int rows, const int32_t* slots, int64_t n,
               const T* kpool, const T* vpool, int64_t kvh, int64_t h, int d, float scale,
               bool causal) {
    // [VBLK][D] float32 values of the block, or (bf16 pools) their interleaved pairs
    constexpr bool kPairs = kPairsFor<T>;
    float* vb = sc.vb.data();
    const T* kr[VBLK];
    const __m512 scale_v = _mm512_set1_ps(scale);
    for (int64_t j0 = 0; j0 < n; j0 += VBLK) {
        const int nb = static_cast<int>(std::min<int64_t>(VBLK, n - j0));
        // Prefetch the next block (measured: further ahead evicts lines before their use), on
        // the first head the whole slot (every head's K and V: the next heads of this slice
        // then find them in cache), else just this head's rows.
        const int64_t ahead0 = j0 + VBLK, ahead1 = std::min<int64_t>(n, ahead0 + VBLK);
        const int64_t head0 = h == 0 ? 0 : h, width = (h == 0 ? kvh : 1) * d * sizeof(T);
        for (int64_t j = ahead0; j < ahead1; ++j) {
            const char* kp = reinterpret_cast<const char*>(kpool + (slots[j] * kvh + head0) * d);
            const char* vp = reinterpret_cast<const char*>(vpool + (slots[j] * kvh + head0) * d);
            for (int64_t off = 0; off < width; off += 64) {
                _mm_prefetch(kp + off, _MM_HINT_T0);
                _mm_prefetch(vp + off, _MM_HINT_T0);
            }
        }
        if (j0 == 0) {  // the first block, before the loop reaches it
            for (int64_t j = 0; j < std::min<int64_t>(n, VBLK); ++j) {
                const char* kp =
                    reinterpret_cast<const char*>(kpool + (slots[j] * kvh + head0) * d);
                const char* vp =
                    reinterpret_cast<const char*>(vpool + (slots[j] * kvh + head0) * d);
                for (int64_t off = 0; off < width; off += 64) {
                    _mm_prefetch(kp + off, _MM_HINT_T0);
                    _mm_prefetch(vp + off, _MM_HINT_T0);
                }
            }
        }
        for (int j = 0; j < VBLK; ++j)  // padding keys repeat the last one (masked below)
            kr[j] = kpool + (static_cast<int64_t>(slots[j0 + std::min(j, nb - 1)]) * kvh + h) * d;
        const int pairs = (nb + 1) / 2;
#if defined(__AVX512BF16__) && defined(__AVX512BW__)  // vpermt2w needs BW (Skylake-X has no BF16)
        if constexpr (kPairs) {
            // bf16 values of keys (2i, 2i + 1) interleaved per dim, for vdpbf16ps (a lone last
            // key pairs with itself: its partner's probability is 0)
            __m512i* vi = reinterpret_cast<__m512i*>(vb);
            const __m512i lo = _mm512_loadu_si512(kPairLo), hi = _mm512_loadu_si512(kPairHi);
            for (int jp = 0; jp < pairs; ++jp) {
                const int64_t sa = slots[j0 + 2 * jp];
                const int64_t sb = slots[j0 + std::min(2 * jp + 1, nb - 1)];
                const T* va = vpool + (sa * kvh + h) * d;
                const T* vb2 = vpool + (sb * kvh + h) * d;
                for (int c2 = 0; c2 < d / 32; ++c2) {
                    const __m512i a = _mm512_loadu_si512(va + c2 * 32);
                    const __m512i b = _mm512_loadu_si512(vb2 + c2 * 32);
                    _mm512_storeu_si512(vi + jp * (d / 16) + 2 * c2,
                                        _mm512_permutex2var_epi16(a, lo, b));
                    _mm512_storeu_si512(vi + jp * (d / 16) + 2 * c2 + 1,
                                        _mm512_permutex2var_epi16(a, hi, b));
                }
            }
        } else
#endif
        {
            for (int j = 0; j < nb; ++j) {
                const T* vr = vpool + (static_cast<int64_t>(slots[j0 + j]) * kvh + h) * d;
                for (int e = 0; e < d; e += 16) _mm512_storeu_ps(vb + j * d + e, load16(vr + e));
            }
        }
        const __mmask16 live = static_cast<__mmask16>((1u << nb) - 1u);
        // bf16 with several rows: the block's keys transposed by bf16 pairs (lane j of word i
        // = dims 2i, 2i + 1 of key j, gathered), so each vdpbf16ps gives 16 keys' partial
        // scores of one row and no horizontal sums are needed.
        bool tiled = false;
        if constexpr (kPairs) {
            int64_t top = 0;
            for (int j = 0; j < VBLK; ++j) top = std::max<int64_t>(top, kr[j] - kpool);
            tiled = rows >= 4 && top / 2 + d / 2 < (int64_t{1} << 31);
            if (tiled) {
                alignas(64) int32_t base[VBLK];
                for (int j = 0; j < VBLK; ++j) base[j] = static_cast<int32_t>((kr[j] - kpool) / 2);
                const __m512i idx = _mm512_load_si512(reinterpret_cast<const void*>(base));
                __m512i* kt = reinterpret_cast<__m512i*>(sc.kt.data());  // [D/2] words
                for (int i = 0; i < d / 2; ++i)
                    _mm512_storeu_si512(kt + i, _mm512_i32gather_epi32(
                                                    _mm512_add_epi32(idx, _mm512_set1_epi32(i)),
                                                    kpool, 4));
                for (int r = 0; r < rows; r += 4) {
                    const int nr = std::min(4, rows - r);
                    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(),
                                     _mm512_setzero_ps(), _mm512_setzero_ps()};
                    const int32_t* qw[4];
                    for (int t = 0; t < 4; ++t)
                        qw[t] = reinterpret_cast<const int32_t*>(
                            qraw + static_cast<size_t>(r + std::min(t, nr - 1)) * d);
                    for (int i = 0; i < d / 2; ++i) {
                        const __m512bh k2 = (__m512bh)_mm512_loadu_si512(kt + i);
                        for (int t = 0; t < 4; ++t)
                            acc[t] = _mm512_dpbf16_ps(acc[t], k2,
                                                      (__m512bh)_mm512_set1_epi32(qw[t][i]));
                    }
                    for (int t = 0; t < nr; ++t)
                        _mm512_storeu_ps(sc.s.data() + static_cast<size_t>(r + t) * VBLK, acc[t]);
                }
            }
        }
        for (int r = 0; r < rows; ++r) {
            const int rr = r0 + r;
            __m512 raw;
            if (tiled) {
                raw = _mm512_loadu_ps(sc.s.data() + static_cast<size_t>(r) * VBLK);
            } else {
                const T* qr = qraw + static_cast<size_t>(r) * d;
                __m512 part[VBLK];
                if (d == 64)  // the common head sizes with q held in registers
                    scores_fixed<64>(qr, kr, part);
                else if (d == 128)
                    scores_fixed<128>(qr, kr, part);
                else
                    for (int j = 0; j < VBLK; ++j) part[j] = dot_partial(qr, kr[j], d);
                raw = reduce16(part);
            }
            __mmask16 seen = live;  // keys of the block this row sees
            if (causal) {
                const int64_t visible = sc.lim[rr] - j0;
                if (visible <= 0) continue;
                if (visible < VBLK) seen &= static_cast<__mmask16>((1u << visible) - 1u);
            }
            const __m512 sv =
                _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), seen, _mm512_mul_ps(raw, scale_v));
            const float mx = std::max(sc.m[rr], _mm512_reduce_max_ps(sv));
            // Past the first blocks the maximum rarely moves: no correction to compute then.
            // (m starts at -inf: exp_nonpos clamps, so the first correction is ~0, never NaN.)
            const float corr = mx > sc.m[rr] ? exp_nonpos(std::max(sc.m[rr] - mx, -87.0f)) : 1.0f;
            const __m512 pv = _mm512_maskz_mov_ps(
                seen, exp512_nonpos(_mm512_sub_ps(sv, _mm512_set1_ps(mx))));
            sc.l[rr] = sc.l[rr] * corr + _mm512_reduce_add_ps(pv);
            sc.m[rr] = mx;
            float* ar = sc.acc.data() + static_cast<size_t>(rr) * d;
            const __m512 cv = _mm512_set1_ps(corr);
            if constexpr (kPairs) {
                // probabilities rounded to bf16 for the PV products, as bf16 attention does
                alignas(32) uint32_t pp[VBLK / 2];
                _mm256_store_si256(reinterpret_cast<__m256i*>(pp),
                                   (__m256i)_mm512_cvtneps_pbh(pv));
                const __m512i* vi = reinterpret_cast<const __m512i*>(vb);
                for (int c = 0; c < d / 16; ++c) {
                    __m512 a = _mm512_mul_ps(_mm512_loadu_ps(ar + c * 16), cv);
                    for (int jp = 0; jp < pairs; ++jp)
                        a = _mm512_dpbf16_ps(
                            a, (__m512bh)_mm512_loadu_si512(vi + jp * (d / 16) + c),
                            (__m512bh)_mm512_set1_epi32(static_cast<int>(pp[jp])));
                    _mm512_storeu_ps(ar + c * 16, a);
                }
            } else {
                alignas(64) float p[VBLK];
                _mm512_store_ps(p, pv);
                for (int e = 0; e < d; e += 16) {
                    __m512 a = _mm512_mul_ps(_mm512_loadu_ps(ar + e), cv);
                    for (int j = 0; j < nb; ++j)
                        a = _mm512_fmadd_ps(_mm512_set1_ps(p[j]),
                                            _mm512_loadu_ps(vb + j * d + e), a);
                    _mm512_storeu_ps(ar + e, a);
                }
            }
        }
    }
}
#endif

// On the AVX-512 paths, keys of a quantized pool are dequantized this many at a time into rows
// of the queries' type, which those paths then attend as an unquantized pool (a few dozen KB per
// thread: they stay in cache). The portable loops convert codes as they load a block instead
// (on Zen 3 the extra pass measured 1.4x slower).
constexpr int64_t QCHUNK = 128;
#if defined(__AVX512F__)
constexpr bool has_wide_paths = true;
#else
constexpr bool has_wide_paths = false;
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
#pragma omp simd
        for (int e = 0; e < d; ++e) dst[e] = C::store(K::load(src[e]) * s);
    }
}

// C: the queries' and outputs' type; K: the pool's (C's own, or a quantized one with scales).
template <typename C, typename K>
void paged_attention(const typename C::T* q, const typename K::T* kpool,
                     const typename K::T* vpool, const float* kscale, const float* vscale,
                     const int32_t* table, int64_t table_stride,
                     const int64_t* req_row, const int64_t* req_len, const int64_t* q_start,
                     const int64_t* n_new, const int64_t* order, const int64_t* group_start,
                     const int64_t* group_prefix, int64_t n_groups, typename C::T* out,
                     int64_t heads, int64_t kvh, int64_t d, float scale, int64_t n_threads) {
    const int64_t g_heads = heads / kvh;  // query heads per KV head
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
    // Fewer slices than threads (one long decode, say): each KV head of a slice is a work
    // item of its own, so the threads share them (a lone decode: 2.2x faster on 2 Zen 3 cores).
    const int64_t split = slices < n_threads ? kvh : 1;
#pragma omp parallel num_threads(static_cast<int>(n_threads))
    {
        Scratch sc;
        std::vector<typename C::T> qraw;
        // a quantized pool's keys and values of one chunk, dequantized, and their "slots"
        const bool chunked = K::kScaled && has_wide_paths;
        std::vector<typename C::T> kq(chunked ? QCHUNK * d : 0), vq(kq.size());
        std::vector<int32_t> iota(chunked ? QCHUNK : 0);
        for (size_t i = 0; i < iota.size(); ++i) iota[i] = static_cast<int32_t>(i);
        std::vector<int64_t> offset;  // first state row of each member of the slice
#pragma omp for schedule(dynamic, 1)
        // Otherwise a slice's KV heads run one after the other on one thread: a slot's K (V)
        // for all heads is one contiguous run, so heads 1.. find the rows head 0 pulled in cache.
        for (int64_t wi = 0; wi < slices * split; ++wi)
        for (int64_t it = wi / split, h = wi % split * (kvh / split);
             h < (wi % split + 1) * (kvh / split); ++h) {
            const int64_t g = item_group[it];
            const int64_t first = item_first[it];
            const int64_t members = item_count[it];
            const int64_t prefix = group_prefix[g];
            offset.assign(1, 0);
            for (int64_t i = 0; i < members; ++i)
                offset.push_back(offset.back() + n_new[order[first + i]] * g_heads);
            const int rows = static_cast<int>(offset.back());
            sc.fit(rows, static_cast<int>(d));
#if defined(__AVX512F__)
            const bool wide = d % 32 == 0;
            if (wide) qraw.resize(static_cast<size_t>(rows) * d);
#else
            const bool wide = false;
#endif
            for (int64_t i = 0; i < members; ++i) {
                const int64_t b = order[first + i];
                const int64_t own = req_len[b] - prefix;  // keys of its own segment
                for (int64_t t = 0; t < n_new[b]; ++t) {
                    const typename C::T* qs = q + ((q_start[b] + t) * heads + h * g_heads) * d;
                    const int64_t r0 = offset[i] + t * g_heads;
                    if (wide) std::copy_n(qs, g_heads * d, qraw.data() + r0 * d);
                    for (int64_t gh = 0; gh < g_heads; ++gh) {
                        const int64_t r = r0 + gh;
                        float* qd = sc.q.data() + r * d;
                        for (int64_t e = 0; e < d; ++e) qd[e] = C::load(qs[gh * d + e]) * scale;
                        sc.m[r] = -INFINITY;
                        sc.l[r] = 0.0f;
                        sc.lim[r] = own - n_new[b] + t + 1;  // causal: its own position
                        std::fill_n(sc.acc.data() + r * d, d, 0.0f);
                    }
                }
            }
            // Attend rows [r0, r0 + nrows) to keys slots[0, n) of an unquantized pool (or of
            // dequantized rows: kvh 1, head 0) on the AVX-512 paths.
            auto wide_plain = [&](int r0, int nrows, const int32_t* slots, int64_t n, bool causal,
                                  const typename C::T* kp, const typename C::T* vp,
                                  int64_t kv_heads, int64_t head) {
#if defined(__AVX512F__)
                attend512<typename C::T>(sc, qraw.data() + static_cast<size_t>(r0) * d, r0,
                                         nrows, slots, n, kp, vp, kv_heads, head,
                                         static_cast<int>(d), scale, causal);
#else  // never called: `wide` is false without AVX-512
                (void)r0, (void)nrows, (void)slots, (void)n, (void)causal, (void)kp, (void)vp;
                (void)kv_heads, (void)head;
#endif
            };
            auto segment = [&](int r0, int nrows, const int32_t* slots, int64_t n, bool causal) {
                if (!wide) {
                    attend<K>(sc, r0, nrows, slots, n, kpool, vpool, kscale, vscale, kvh, h,
                              static_cast<int>(d), causal);
                } else if constexpr (!K::kScaled) {
                    wide_plain(r0, nrows, slots, n, causal, kpool, vpool, kvh, h);
                } else {
                    // Chunk by chunk; the causal limits count keys from the chunk's start.
                    for (int64_t c0 = 0; c0 < n; c0 += QCHUNK) {
                        const int64_t cn = std::min(QCHUNK, n - c0);
                        const int di = static_cast<int>(d);
                        dequantize<C, K>(slots + c0, cn, kpool, kscale, kvh, h, di, kq.data());
                        dequantize<C, K>(slots + c0, cn, vpool, vscale, kvh, h, di, vq.data());
                        wide_plain(r0, nrows, iota.data(), cn, causal, kq.data(), vq.data(), 1,
                                   0);
                        if (causal)
                            for (int r = r0; r < r0 + nrows; ++r) sc.lim[r] -= cn;
                    }
                    if (causal)
                        for (int r = r0; r < r0 + nrows; ++r) sc.lim[r] += n;
                }
            };
            if (prefix > 0)  // the shared part, once for all members, seen whole by every row
                segment(0, rows, table + req_row[order[first]] * table_stride, prefix, false);
            for (int64_t i = 0; i < members; ++i) {
                const int64_t b = order[first + i];
                const int32_t* slots = table + req_row[b] * table_stride;
                const int nrows = static_cast<int>(offset[i + 1] - offset[i]);
                segment(static_cast<int>(offset[i]), nrows, slots + prefix, req_len[b] - prefix,
                        true);
                for (int64_t t = 0; t < n_new[b]; ++t)
                    for (int64_t gh = 0; gh < g_heads; ++gh) {
                        const int64_t r = offset[i] + t * g_heads + gh;
                        const float inv = 1.0f / sc.l[r];
                        const float* ar = sc.acc.data() + r * d;
                        typename C::T* os = out + ((q_start[b] + t) * heads + h * g_heads + gh) * d;
                        for (int64_t e = 0; e < d; ++e) os[e] = C::store(ar[e] * inv);
                    }
            }
        }
    }
}

}  // namespace

extern "C" {

// q, out: [T, H, D], the step's flat tokens (only the requests below are read and written);
// k, v: one layer of the pool, [slots, KVH, D]; kscale, vscale: [slots, KVH] float32 for a
// quantized pool (row = codes x scale), else null; table: [rows, stride] int32. Per request:
// req_row, req_len (context including its new tokens, all stored), q_start (its first new
// token in q), n_new (its new tokens: 1 for a decode; each attends causally). order: request
// indices grouped, group g = order[group_start[g] .. group_start[g + 1]), sharing its first
// group_prefix[g] slots (0 for a request alone).
#define BANYAN_PAGED_ATTENTION(NAME, C, K)                                                     \
    void NAME(const C::T* q, const K::T* k, const K::T* v, const float* kscale,               \
              const float* vscale, const int32_t* table, int64_t table_stride,                \
              const int64_t* req_row, const int64_t* req_len, const int64_t* q_start,         \
              const int64_t* n_new, const int64_t* order, const int64_t* group_start,         \
              const int64_t* group_prefix, int64_t n_groups, C::T* out, int64_t heads,        \
              int64_t kvh, int64_t d, float scale, int64_t n_threads) {                       \
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

// 512 when this build has the AVX-512 paths, else 0 (the portable loops: AVX2 CPUs).
int64_t banyan_vector_bits() {
#if defined(__AVX512F__)
    return 512;
#else
    return 0;
#endif
}

}  // extern "C"
