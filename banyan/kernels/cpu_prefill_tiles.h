// The prefill kernel's products on AMX tiles (Intel Xeons from Sapphire Rapids on): the work
// items, key blocks, online softmax and bf16 rounding of the pair path (cpu_prefill_pairs.h),
// with S^T = K Q^T and the P V update as tile dot products (tdpbf16ps: a 16 x 16 float32 tile
// += 16 x 32 bf16 times 32 x 16 bf16, 8,192 multiply-adds an instruction against vdpbf16ps's 32).
// On 2 cores of such a Xeon a bf16 matmul measured ~2,400 GFLOP/s through oneDNN's AMX path
// against ~400 for vdpbf16ps (#13), so there the pair path's products, not its softmax, bound
// a prefill; with them on tiles the softmax (AVX-512, unchanged) is most of what is left.
//
// The products (the tile sets and their 2 x 2 blocks: cpu_amx_tiles.h):
//   S^T [keys][rows]: A = the block's key rows (kb16, 32 dims a step), B = Q^T as pairs of dims
//     (qp), as the pair path lays them out; the scale (and a quantized pool's key scales) and
//     the rows' maxima in a pass over the tile's output after.
//   O^T [dims][rows] += V^T P^T: A = V^T as pairs of keys (vt [d][BK / 2] words: the pair
//     path's vp transposed), B = the probabilities as softmax_pairs writes them (pp [pairs]
//     [rp]); O^T is scaled by the rows' corrections in place before each block's products.
// A tile's products sum in tdpbf16ps's order, so the bits differ from the pair path's
// (tests: both against float64); they do not depend on the tile a row falls in, the thread
// count or the work items (the pair path's rule).
#pragma once

#include "cpu_amx_tiles.h"
#include "cpu_prefill_pairs.h"

#if defined(BANYAN_PREFILL_PAIRS) && defined(BANYAN_AMX_TILES)
#define BANYAN_PREFILL_TILES 1

namespace {

// A row keeps its running maximum while its scores stay within kLazyMax of it (FlashAttention
// 4's lazy rescaling): its probabilities then reach up to e^8 ~ 3,000 (bf16 and the float32
// sums hold them as they hold 1), and its O^T is not rescaled for that block. The sums are the
// same in exact arithmetic; what is saved is the pass over O^T (d x rows a block), which took
// ~6% of a 2,048-token prefill on tiles (perf; random scores, whose maxima move more often
// than a real model's).
constexpr float kLazyMax = 8.0f;

// Rows [0, rp) of a key block of nk keys from k0 (st [nk][rp], their raw scores): each
// row's maximum over the keys it sees (masked: the diagonal blocks, keys past b.lim[r] left out;
// kmul: a quantized pool's key scales, its scores scaled in place first) merged with its running
// maximum m into corr, in scaled units (max(s) x scale == max(s x scale): rounding keeps
// order), then back to m where within kLazyMax of it. A row's arithmetic is the same whether
// its block is a diagonal one of its work item or not: the bits do not depend on the items.
inline void block_maxima(Buffers& b, int64_t k0, int64_t nk, bool masked, float scale,
                         const float* kmul) {
    float* st = b.st.data();
    const int64_t rp = b.rp;
    const __m512 sv = _mm512_set1_ps(scale), slack = _mm512_set1_ps(kLazyMax);
    for (int64_t r = 0; r < rp; r += 16) {
        const __m512i lim = _mm512_loadu_si512(&b.lim[r]);
        __m512 top[4];  // (four chains: one max a key waited on the last one's latency)
        for (__m512& t : top) t = _mm512_set1_ps(-INFINITY);
        auto merge = [&](__m512& t, int64_t j) {
            __m512 sj = _mm512_loadu_ps(st + j * rp + r);
            if (kmul) {
                sj = _mm512_mul_ps(sj, _mm512_mul_ps(sv, _mm512_set1_ps(kmul[j])));
                _mm512_storeu_ps(st + j * rp + r, sj);
            }
            t = masked ? _mm512_mask_max_ps(
                             t, _mm512_cmplt_epi32_mask(
                                    _mm512_set1_epi32(static_cast<int32_t>(k0 + j)), lim),
                             t, sj)
                       : _mm512_max_ps(t, sj);
        };
        int64_t j = 0;
        for (; j + 4 <= nk; j += 4)
            for (int u = 0; u < 4; ++u) merge(top[u], j + u);
        for (; j < nk; ++j) merge(top[0], j);
        __m512 all = _mm512_max_ps(_mm512_max_ps(top[0], top[1]),
                                   _mm512_max_ps(top[2], top[3]));
        if (!kmul) all = _mm512_mul_ps(all, sv);
        const __m512 m = _mm512_loadu_ps(&b.m[r]), up = _mm512_max_ps(m, all);
        const __mmask16 keep = _mm512_cmp_ps_mask(up, _mm512_add_ps(m, slack), _CMP_LE_OQ);
        _mm512_storeu_ps(&b.corr[r], _mm512_mask_mov_ps(up, keep, m));
    }
}

// vt[x][q] = vp[q][x]: the block's value pairs [pairs][d] as [d][BK / 2] words, pairs past
// `pairs` zero (the P V products then take whole tiles of 16 pairs).
inline void transpose_values(const uint32_t* vp, int64_t pairs, int64_t d, uint32_t* vt) {
    constexpr int64_t kW = BK / 2;
    for (int64_t q0 = 0; q0 < kW; q0 += 16)
        for (int64_t x0 = 0; x0 < d; x0 += 16) {
            __m512i w[16];
            for (int i = 0; i < 16; ++i)
                w[i] = q0 + i < pairs ? _mm512_loadu_si512(vp + (q0 + i) * d + x0)
                                      : _mm512_setzero_si512();
            transpose16(w);
            for (int i = 0; i < 16; ++i) _mm512_storeu_si512(vt + (x0 + i) * kW + q0, w[i]);
        }
}

// attend_pairs on tiles: the online softmax of rows [0, b.rp) (set up by item_rows) over keys
// slots[0, kend) of KV head h; the output left as O^T in b.o ([d][rp], unnormalised).
template <typename Tiles, typename Codes = void, typename P = uint16_t>
inline void attend_tiles(Tiles& tl, Buffers& b, const P* kpool, const P* vpool,
                         const float* kscale, const float* vscale, const int32_t* slots,
                         int64_t kend, int64_t unmasked, int64_t kvh, int64_t h, int64_t d,
                         float scale) {
    constexpr bool kCodes = !std::is_same<Codes, void>::value;
    constexpr int64_t kW = BK / 2;
    const int64_t rp = b.rp, lds = rp * 4;  // (rp: a multiple of 32; st, pp, o rows in bytes)
    at_least(b.vt, d * kW);
    alignas(64) float kmul[BK], vmul[BK];
    float* st = b.st.data();
    float* ot = b.o.data();
    for (int64_t k0 = 0; k0 < kend; k0 += BK) {
        const int64_t nk = std::min<int64_t>(BK, kend - k0);
        key_block<Codes>(b, kpool, vpool, kscale, vscale, slots, k0, nk, kend, kvh, h, d, kmul,
                         vmul);
        value_pairs<Codes>(vpool, slots, k0, nk, kvh, h, d, b.vp.data());
        const int64_t pairs = (nk + 1) / 2;
        transpose_values(b.vp.data(), pairs, d, b.vt.data());
        // S^T: 32 keys x 32 rows a tile block (keys past nk: stale rows of kb16, never read).
        // (Each phase over all rows: taking 32 rows at a time through all four, so that their
        // scores and O^T stayed in L1, measured 1.03x the time.)
        const char* kb = reinterpret_cast<const char*>(b.kb16.data());
        const char* qp = reinterpret_cast<const char*>(b.qp.data());
        for (int64_t j0 = 0; j0 < nk; j0 += 32)
            for (int64_t r0 = 0; r0 < rp; r0 += 32)
                tile_block(tl, kb + j0 * d * 2, kTileRows * d * 2, d * 2, 64, qp + r0 * 4, 64,
                           lds, kTileRows * lds, d / 32,
                           reinterpret_cast<char*>(st + j0 * rp + r0), lds, false);
        const bool masked = k0 + nk > unmasked;
        block_maxima(b, k0, nk, masked, scale, kCodes ? kmul : nullptr);
        const float mul = kCodes ? kLog2e : scale * kLog2e;  // (raw scores: the scale in it)
        if (masked)
            softmax_pairs<true>(b, k0, nk, kCodes ? vmul : nullptr, mul);
        else
            softmax_pairs<false>(b, k0, nk, kCodes ? vmul : nullptr, mul);
        // O^T = O^T x corr + V^T P^T (pairs past the block's: zeros in vt; pp's rows there
        // are finite, from earlier blocks, and meet those zeros); rows whose maximum held
        // (corr 1: most rows after the first blocks) keep O^T as it is
        const __m512 one = _mm512_set1_ps(1.0f);
        for (int64_t r = 0; r < rp; r += 16) {
            const __m512 c = _mm512_loadu_ps(&b.corr[r]);
            if (_mm512_cmpneq_ps_mask(c, one) == 0) continue;
            for (int64_t x = 0; x < d; ++x)
                _mm512_storeu_ps(ot + x * rp + r,
                                 _mm512_mul_ps(_mm512_loadu_ps(ot + x * rp + r), c));
        }
        const char* vt = reinterpret_cast<const char*>(b.vt.data());
        const char* pp = reinterpret_cast<const char*>(b.pp.data());
        const int64_t steps = (pairs + 15) / 16;
        for (int64_t x0 = 0; x0 < d; x0 += 32)
            for (int64_t r0 = 0; r0 < rp; r0 += 32)
                tile_block(tl, vt + x0 * kW * 4, kTileRows * kW * 4, kW * 4, 64, pp + r0 * 4, 64,
                           lds, kTileRows * lds, steps,
                           reinterpret_cast<char*>(ot + x0 * rp + r0), lds, true);
    }
}

// One work item of attend_block on tiles (attend_block_pairs's, pairs_fit(d)).
template <typename Tiles, typename Codes = void, typename P = uint16_t>
inline void attend_block_tiles(Tiles& tl, Buffers& b, const uint16_t* q, const P* kpool,
                               const P* vpool, const float* kscale, const float* vscale,
                               const int32_t* slots, int64_t prefix, int64_t t0, int64_t bq,
                               int64_t h, int64_t heads, int64_t kvh, int64_t d, float scale,
                               uint16_t* out) {
    const int64_t g = heads / kvh, kend = prefix + t0 + bq;
    item_rows(b, q, prefix, t0, bq, h, heads, kvh, d);
    attend_tiles<Tiles, Codes>(tl, b, kpool, vpool, kscale, vscale, slots, kend,
                               prefix + t0 + 1, kvh, h, d, scale);
    const int64_t rp = b.rp;
    for (int64_t t = 0; t < bq; ++t)
        for (int64_t gh = 0; gh < g; ++gh) {
            const int64_t r = t * g + gh;
            const float inv = 1.0f / b.l[r];
            uint16_t* dst = out + ((t0 + t) * heads + h * g + gh) * d;
            for (int64_t e = 0; e < d; ++e) dst[e] = BF16::store(b.o[e * rp + r] * inv);
        }
}

}  // namespace

#endif  // BANYAN_PREFILL_PAIRS && BANYAN_AMX_TILES
