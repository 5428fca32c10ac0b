// Decode attention on CPU, reading K/V in place from the paged pool through the token table.
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

namespace {

constexpr int BLK = 32;  // keys per block

inline float bf16_to_f32(uint16_t x) {
    uint32_t u = static_cast<uint32_t>(x) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even, like torch
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<uint16_t>(u >> 16);
}

struct F32 {
    using T = float;
    static float load(T x) { return x; }
    static T store(float x) { return x; }
};

struct BF16 {
    using T = uint16_t;
    static float load(T x) { return bf16_to_f32(x); }
    static T store(float x) { return f32_to_bf16(x); }
};

// exp(x) for x <= 0 (scores minus their running max), Cephes' expf: ~1 ulp, vectorisable.
inline float exp_nonpos(float x) {
    x = std::max(x, -87.0f);
    float fx = std::floor(x * 1.44269504088896341f + 0.5f);
    float r = x - fx * 0.693359375f + fx * 2.12194440e-4f;
    float z = r * r;
    float y = 1.9875691500e-4f;
    y = y * r + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * z + r + 1.0f;
    int32_t bits = (static_cast<int32_t>(fx) + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, 4);
    return y * scale;
}

// Per-thread scratch of one work item.
struct Scratch {
    std::vector<float> q, m, l, acc, s, kt, vb;
    void fit(int rows, int d) {
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
template <typename C>
void attend(Scratch& sc, int r0, int rows, const int32_t* slots, int64_t n,
            const typename C::T* kpool, const typename C::T* vpool, int64_t kvh, int64_t h,
            int d) {
    float* kb = sc.kt.data();  // [BLK][D] keys of the block
    float* vb = sc.vb.data();  // [BLK][D]
    for (int64_t j0 = 0; j0 < n; j0 += BLK) {
        const int nb = static_cast<int>(std::min<int64_t>(BLK, n - j0));
        for (int j = 0; j < nb; ++j) {
            const int64_t base = (static_cast<int64_t>(slots[j0 + j]) * kvh + h) * d;
            const typename C::T* kr = kpool + base;
            const typename C::T* vr = vpool + base;
            float* kj = kb + j * d;
            float* vj = vb + j * d;
#pragma omp simd
            for (int e = 0; e < d; ++e) kj[e] = C::load(kr[e]);
#pragma omp simd
            for (int e = 0; e < d; ++e) vj[e] = C::load(vr[e]);
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
            float mx = sc.m[r];
            for (int j = 0; j < nb; ++j) mx = std::max(mx, acc_s[j]);
            // m starts at -inf: exp_nonpos clamps, so the first correction is ~0, never NaN.
            const float corr = exp_nonpos(std::max(sc.m[r] - mx, -87.0f));
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int j = 0; j < nb; ++j) {
                sr[j] = exp_nonpos(acc_s[j] - mx);
                sum += sr[j];
            }
            sc.l[r] = sc.l[r] * corr + sum;
            sc.m[r] = mx;
            float* ar = sc.acc.data() + static_cast<size_t>(r) * d;
#pragma omp simd
            for (int e = 0; e < d; ++e) ar[e] *= corr;
            for (int j = 0; j < nb; ++j) {
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
               const T* kpool, const T* vpool, int64_t kvh, int64_t h, int d, float scale) {
    // [VBLK][D] float32 values of the block, or (bf16 pools) their interleaved pairs
    constexpr bool kPairs = kPairsFor<T>;
    float* vb = sc.vb.data();
    const T* kr[VBLK];
    const __m512 scale_v = _mm512_set1_ps(scale);
    for (int64_t j0 = 0; j0 < n; j0 += VBLK) {
        const int nb = static_cast<int>(std::min<int64_t>(VBLK, n - j0));
        // Prefetch two blocks ahead, on the first head the whole slot (every head's K and V:
        // the next heads of this slice then find them in cache), else just this head's rows.
        const int64_t ahead0 = j0 + 2 * VBLK, ahead1 = std::min<int64_t>(n, ahead0 + VBLK);
        const int64_t head0 = h == 0 ? 0 : h, width = (h == 0 ? kvh : 1) * d * sizeof(T);
        for (int64_t j = ahead0; j < ahead1; ++j) {
            const char* kp = reinterpret_cast<const char*>(kpool + (slots[j] * kvh + head0) * d);
            const char* vp = reinterpret_cast<const char*>(vpool + (slots[j] * kvh + head0) * d);
            for (int64_t off = 0; off < width; off += 64) {
                _mm_prefetch(kp + off, _MM_HINT_T0);
                _mm_prefetch(vp + off, _MM_HINT_T0);
            }
        }
        if (j0 == 0) {  // the first two blocks, before the loop reaches them
            for (int64_t j = 0; j < std::min<int64_t>(n, 2 * VBLK); ++j) {
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
        } else {
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
                for (int j = 0; j < VBLK; ++j) part[j] = dot_partial(qr, kr[j], d);
                raw = reduce16(part);
            }
            const __m512 sv =
                _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), live, _mm512_mul_ps(raw, scale_v));
            const float mx = std::max(sc.m[rr], _mm512_reduce_max_ps(sv));
            const float corr = exp_nonpos(std::max(sc.m[rr] - mx, -87.0f));
            const __m512 pv = _mm512_maskz_mov_ps(
                live, exp512_nonpos(_mm512_sub_ps(sv, _mm512_set1_ps(mx))));
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

template <typename C>
void decode_attention(const typename C::T* q, const typename C::T* kpool,
                      const typename C::T* vpool, const int32_t* table, int64_t table_stride,
                      const int64_t* req_row, const int64_t* req_len, const int64_t* order,
                      const int64_t* group_start, const int64_t* group_prefix, int64_t n_groups,
                      typename C::T* out, int64_t heads, int64_t kvh, int64_t d, float scale,
                      int64_t n_threads) {
    const int64_t g_heads = heads / kvh;  // query heads per KV head
    // Work items: (group, KV head, slice of the group's members). A big group is sliced so two
    // cores share it (a group of 64 over 3 KV heads would otherwise be 3 items for 2 threads);
    // each slice re-reads the shared prefix, from cache.
    const int64_t slice_members = std::max<int64_t>(1, 48 / g_heads);
    std::vector<int64_t> item_group, item_first;
    for (int64_t g = 0; g < n_groups; ++g)
        for (int64_t m = group_start[g]; m < group_start[g + 1]; m += slice_members) {
            item_group.push_back(g);
            item_first.push_back(m);
        }
    const int64_t slices = static_cast<int64_t>(item_group.size());
#pragma omp parallel num_threads(static_cast<int>(n_threads))
    {
        Scratch sc;
        std::vector<typename C::T> qraw;
#pragma omp for schedule(dynamic, 1)
        // A slice's KV heads run one after the other on one thread: a slot's K (V) for all
        // heads is one contiguous run, so heads 1.. find the rows head 0 pulled in cache.
        for (int64_t it = 0; it < slices; ++it)
        for (int64_t h = 0; h < kvh; ++h) {
            const int64_t g = item_group[it];
            const int64_t first = item_first[it];
            const int64_t members = std::min(group_start[g + 1] - first, slice_members);
            const int64_t prefix = group_prefix[g];
            const int rows = static_cast<int>(members * g_heads);
            sc.fit(rows, static_cast<int>(d));
            for (int64_t i = 0; i < members; ++i) {
                const int64_t b = order[first + i];
                for (int64_t gh = 0; gh < g_heads; ++gh) {
                    const int64_t r = i * g_heads + gh;
                    const typename C::T* qs = q + (b * heads + h * g_heads + gh) * d;
                    float* qd = sc.q.data() + r * d;
                    for (int64_t e = 0; e < d; ++e) qd[e] = C::load(qs[e]) * scale;
                    sc.m[r] = -INFINITY;
                    sc.l[r] = 0.0f;
                    std::fill_n(sc.acc.data() + r * d, d, 0.0f);
                }
            }
#if defined(__AVX512F__)
            const bool wide = d % 32 == 0;
            if (wide) {
                qraw.resize(static_cast<size_t>(rows) * d);
                for (int64_t i = 0; i < members; ++i)
                    std::copy_n(q + (order[first + i] * heads + h * g_heads) * d, g_heads * d,
                                qraw.data() + i * g_heads * d);
            }
#else
            const bool wide = false;
#endif
            auto segment = [&](int r0, int nrows, const int32_t* slots, int64_t n) {
#if defined(__AVX512F__)
                if (wide) {
                    attend512<typename C::T>(sc, qraw.data() + static_cast<size_t>(r0) * d, r0,
                                             nrows, slots, n, kpool, vpool, kvh, h,
                                             static_cast<int>(d), scale);
                    return;
                }
#endif
                attend<C>(sc, r0, nrows, slots, n, kpool, vpool, kvh, h, static_cast<int>(d));
            };
            if (prefix > 0)  // the shared part, once for all members
                segment(0, rows, table + req_row[order[first]] * table_stride, prefix);
            for (int64_t i = 0; i < members; ++i) {
                const int64_t b = order[first + i];
                const int32_t* slots = table + req_row[b] * table_stride;
                segment(static_cast<int>(i * g_heads), static_cast<int>(g_heads), slots + prefix,
                        req_len[b] - prefix);
                for (int64_t gh = 0; gh < g_heads; ++gh) {
                    const int64_t r = i * g_heads + gh;
                    const float inv = 1.0f / sc.l[r];
                    const float* ar = sc.acc.data() + r * d;
                    typename C::T* os = out + (b * heads + h * g_heads + gh) * d;
                    for (int64_t e = 0; e < d; ++e) os[e] = C::store(ar[e] * inv);
                }
            }
        }
    }
}

}  // namespace

extern "C" {

// q, out: [B, H, D]; k, v: one layer of the pool, [slots, KVH, D]; table: [rows, stride] int32;
// req_row/req_len: per request (len = context including the new token); order: request indices
// grouped, group g = order[group_start[g] .. group_start[g + 1]), sharing its first
// group_prefix[g] slots (0 for a request alone).
void banyan_decode_attention_f32(const float* q, const float* k, const float* v,
                                 const int32_t* table, int64_t table_stride,
                                 const int64_t* req_row, const int64_t* req_len,
                                 const int64_t* order, const int64_t* group_start,
                                 const int64_t* group_prefix, int64_t n_groups, float* out,
                                 int64_t heads, int64_t kvh, int64_t d, float scale,
                                 int64_t n_threads) {
    decode_attention<F32>(q, k, v, table, table_stride, req_row, req_len, order, group_start,
                          group_prefix, n_groups, out, heads, kvh, d, scale, n_threads);
}

void banyan_decode_attention_bf16(const uint16_t* q, const uint16_t* k, const uint16_t* v,
                                  const int32_t* table, int64_t table_stride,
                                  const int64_t* req_row, const int64_t* req_len,
                                  const int64_t* order, const int64_t* group_start,
                                  const int64_t* group_prefix, int64_t n_groups, uint16_t* out,
                                  int64_t heads, int64_t kvh, int64_t d, float scale,
                                  int64_t n_threads) {
    decode_attention<BF16>(q, k, v, table, table_stride, req_row, req_len, order, group_start,
                           group_prefix, n_groups, out, heads, kvh, d, scale, n_threads);
}

}  // extern "C"
