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
        // S^T: 32 keys x 32 rows a tile block (keys past nk: stale rows of kb16, never read)
        const char* kb = reinterpret_cast<const char*>(b.kb16.data());
        const char* qp = reinterpret_cast<const char*>(b.qp.data());
        for (int64_t j0 = 0; j0 < nk; j0 += 32)
            for (int64_t r0 = 0; r0 < rp; r0 += 32)
                tile_block(tl, kb + j0 * d * 2, kTileRows * d * 2, d * 2, 64, qp + r0 * 4, 64,
                           lds, kTileRows * lds, d / 32,
                           reinterpret_cast<char*>(st + j0 * rp + r0), lds, false);
        // the scale, and (no row stops inside the block) the rows' maxima: qk_pairs_tile's
        const bool masked = k0 + nk > unmasked;
        std::copy_n(b.m.begin(), rp, b.corr.begin());
        const __m512 sv = _mm512_set1_ps(scale);
        for (int64_t j = 0; j < nk; ++j) {
            const __m512 sj = kCodes ? _mm512_mul_ps(sv, _mm512_set1_ps(kmul[j])) : sv;
            for (int64_t r = 0; r < rp; r += 16) {
                const __m512 s = _mm512_mul_ps(_mm512_loadu_ps(st + j * rp + r), sj);
                _mm512_storeu_ps(st + j * rp + r, s);
                if (!masked)
                    _mm512_storeu_ps(&b.corr[r], _mm512_max_ps(_mm512_loadu_ps(&b.corr[r]), s));
            }
        }
        if (masked)
            softmax_pairs<true>(b, k0, nk, kCodes ? vmul : nullptr);
        else
            softmax_pairs<false>(b, k0, nk, kCodes ? vmul : nullptr);
        // O^T = O^T x corr + V^T P^T (pairs past the block's: zeros in vt; pp's rows there
        // are finite, from earlier blocks, and meet those zeros)
        for (int64_t x = 0; x < d; ++x)
            for (int64_t r = 0; r < rp; r += 16)
                _mm512_storeu_ps(ot + x * rp + r, _mm512_mul_ps(_mm512_loadu_ps(ot + x * rp + r),
                                                                _mm512_loadu_ps(&b.corr[r])));
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
