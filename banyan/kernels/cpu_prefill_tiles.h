// The prefill kernel's products on AMX tiles (Intel Xeons from Sapphire Rapids on): the work
// items, key blocks, online softmax and bf16 rounding of the pair path (cpu_prefill_pairs.h),
// with S^T = K Q^T and the P V update as tile dot products (tdpbf16ps: a 16 x 16 float32 tile
// += 16 x 32 bf16 times 32 x 16 bf16, 8,192 multiply-adds an instruction against vdpbf16ps's 32).
// On 2 cores of such a Xeon a bf16 matmul measured ~2,400 GFLOP/s through oneDNN's AMX path
// against ~400 for vdpbf16ps (#13), so there the pair path's products, not its softmax, bound
// a prefill; with them on tiles the softmax (AVX-512, unchanged) is most of what is left.
//
// Tiles: 0-3 accumulate (2 x 2 output tiles), 4-5 hold A (16 rows x 32 bf16 each), 6-7 B (16
// pairs x 16 columns), every tile 16 rows of 64 bytes: one configuration, loaded by each thread
// as a call starts and released as it ends. (oneDNN's and torch's tile code, in the same
// threads, are expected to load theirs before using tiles, as torch's flash attention releases
// its tiles at the end of its regions: to be confirmed by the first AMX run.)
//   S^T [keys][rows]: A = the block's key rows (kb16, 32 dims a step), B = Q^T as pairs of dims
//     (qp), as the pair path lays them out; the scale (and a quantized pool's key scales) and
//     the rows' maxima in a pass over the tile's output after.
//   O^T [dims][rows] += V^T P^T: A = V^T as pairs of keys (vt [d][BK / 2] words: the pair
//     path's vp transposed), B = the probabilities as softmax_pairs writes them (pp [pairs]
//     [rp]); O^T is scaled by the rows' corrections in place before each block's products.
// A tile's products run in the hardware's order, so the bits differ from the pair path's
// (tests: both against float64); they do not depend on the tile a row falls in, the thread
// count or the work items (the pair path's rule).
//
// Two tile sets share the code: AmxTiles (the instructions, as inline assembly with literal
// tile numbers, so no -mamx flags are needed to build) and SoftTiles (the same operations on
// memory, in plain loops: what the tests run on CPUs without AMX, so the layouts and strides
// are checked everywhere; the Xeon run adds the instructions' own check).
#pragma once

#include "cpu_prefill_pairs.h"

#if defined(BANYAN_PREFILL_PAIRS) && defined(__x86_64__) && defined(__linux__)
#define BANYAN_PREFILL_TILES 1

#include <sys/syscall.h>
#include <unistd.h>

#include <cstddef>
#include <cstring>

namespace {

constexpr int kTileRows = 16;  // rows of every tile; each row 64 bytes (16 floats, 32 bf16)

// Tiles in memory: each operation as the instruction defines it (products of bf16 pairs summed
// into float32, pair by pair).
struct SoftTiles {
    alignas(64) uint8_t t[8][kTileRows][64];

    void begin() {}
    void end() {}
    template <int T>
    void zero() {
        std::memset(t[T], 0, sizeof t[T]);
    }
    template <int T>
    void load(const void* src, int64_t stride) {
        for (int r = 0; r < kTileRows; ++r)
            std::memcpy(t[T][r], static_cast<const char*>(src) + r * stride, 64);
    }
    template <int T>
    void store(void* dst, int64_t stride) const {
        for (int r = 0; r < kTileRows; ++r)
            std::memcpy(static_cast<char*>(dst) + r * stride, t[T][r], 64);
    }
    // tile C (C: 0-3, C = 2 (A - 4) + B - 6) += tile A (bf16 [16][32]) x tile B (pairs [16][16])
    template <int A, int B>
    void dot() {
        constexpr int C = 2 * (A - 4) + (B - 6);
        for (int m = 0; m < kTileRows; ++m)
            for (int n = 0; n < 16; ++n) {
                float acc;
                std::memcpy(&acc, &t[C][m][4 * n], 4);
                for (int k = 0; k < 16; ++k)
                    for (int i = 0; i < 2; ++i)
                        acc += bf16_at(t[A][m], 2 * k + i) * bf16_at(t[B][k], 2 * n + i);
                std::memcpy(&t[C][m][4 * n], &acc, 4);
            }
    }

  private:
    static float bf16_at(const uint8_t* row, int i) {
        uint16_t h;
        std::memcpy(&h, row + 2 * i, 2);
        const uint32_t bits = static_cast<uint32_t>(h) << 16;
        float f;
        std::memcpy(&f, &bits, 4);
        return f;
    }
};

// The AMX instructions. Tile numbers must be literals in the assembly, hence the chains.
#define BANYAN_TILE_CASE(N, ASM, ...) \
    if constexpr (T == N) __asm__ volatile(ASM : : __VA_ARGS__ : "memory");
struct AmxTiles {
    struct alignas(64) Config {
        uint8_t palette = 1, start_row = 0, reserved[14] = {};
        uint16_t colsb[16] = {};
        uint8_t rows[16] = {};
    };

    void begin() {
        Config c;
        for (int i = 0; i < 8; ++i) c.colsb[i] = 64, c.rows[i] = kTileRows;
        __asm__ volatile("ldtilecfg %0" : : "m"(c) : "memory");
    }
    void end() { __asm__ volatile("tilerelease" : : : "memory"); }
    template <int T>
    void zero() {
        if constexpr (T == 0) __asm__ volatile("tilezero %%tmm0" : : : "memory");
        if constexpr (T == 1) __asm__ volatile("tilezero %%tmm1" : : : "memory");
        if constexpr (T == 2) __asm__ volatile("tilezero %%tmm2" : : : "memory");
        if constexpr (T == 3) __asm__ volatile("tilezero %%tmm3" : : : "memory");
    }
    template <int T>
    void load(const void* src, int64_t stride) {
        BANYAN_TILE_CASE(0, "tileloadd (%0,%1,1), %%tmm0", "r"(src), "r"(stride))
        BANYAN_TILE_CASE(1, "tileloadd (%0,%1,1), %%tmm1", "r"(src), "r"(stride))
        BANYAN_TILE_CASE(2, "tileloadd (%0,%1,1), %%tmm2", "r"(src), "r"(stride))
        BANYAN_TILE_CASE(3, "tileloadd (%0,%1,1), %%tmm3", "r"(src), "r"(stride))
        BANYAN_TILE_CASE(4, "tileloadd (%0,%1,1), %%tmm4", "r"(src), "r"(stride))
        BANYAN_TILE_CASE(5, "tileloadd (%0,%1,1), %%tmm5", "r"(src), "r"(stride))
        BANYAN_TILE_CASE(6, "tileloadd (%0,%1,1), %%tmm6", "r"(src), "r"(stride))
        BANYAN_TILE_CASE(7, "tileloadd (%0,%1,1), %%tmm7", "r"(src), "r"(stride))
    }
    template <int T>
    void store(void* dst, int64_t stride) const {
        BANYAN_TILE_CASE(0, "tilestored %%tmm0, (%0,%1,1)", "r"(dst), "r"(stride))
        BANYAN_TILE_CASE(1, "tilestored %%tmm1, (%0,%1,1)", "r"(dst), "r"(stride))
        BANYAN_TILE_CASE(2, "tilestored %%tmm2, (%0,%1,1)", "r"(dst), "r"(stride))
        BANYAN_TILE_CASE(3, "tilestored %%tmm3, (%0,%1,1)", "r"(dst), "r"(stride))
    }
    // (AT&T order: B, A, C; tmmC += tmmA x tmmB)
    template <int A, int B>
    void dot() {
        if constexpr (A == 4 && B == 6) __asm__ volatile("tdpbf16ps %%tmm6, %%tmm4, %%tmm0" ::);
        if constexpr (A == 4 && B == 7) __asm__ volatile("tdpbf16ps %%tmm7, %%tmm4, %%tmm1" ::);
        if constexpr (A == 5 && B == 6) __asm__ volatile("tdpbf16ps %%tmm6, %%tmm5, %%tmm2" ::);
        if constexpr (A == 5 && B == 7) __asm__ volatile("tdpbf16ps %%tmm7, %%tmm5, %%tmm3" ::);
    }
};
#undef BANYAN_TILE_CASE
// (ldtilecfg's 64-byte layout: palette, start row, 14 reserved, 16 x colsb, 16 x rows)
static_assert(sizeof(AmxTiles::Config) == 64 && offsetof(AmxTiles::Config, colsb) == 16 &&
                  offsetof(AmxTiles::Config, rows) == 48,
              "tile configuration layout");

// Asks Linux for the tile registers' state (once a process; without it the first tile
// instruction faults): true where granted (a kernel before 5.16, or no AMX, refuses).
inline bool amx_granted() {
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;  // ARCH_REQ_XCOMP_PERM, XTILEDATA
    static const bool granted = syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
    return granted;
}

// 2 x 2 output tiles: C[0..3] = (a0, a1) x (b0, b1) over `steps` steps of 32 bf16 (A) / 16
// pairs (B); load: C starts from memory (c, ldc bytes a row, tiles at c, c + 64 bytes, c + 16
// rows, both), else from zero. a1 / b1 at a fixed distance from a0 / b0 (da, db bytes).
template <typename Tiles>
inline void tile_block(Tiles& tl, const char* a0, int64_t da, int64_t lda, int64_t astep,
                       const char* b0, int64_t db, int64_t ldb, int64_t bstep, int64_t steps,
                       char* c, int64_t ldc, bool load) {
    if (load) {
        tl.template load<0>(c, ldc);
        tl.template load<1>(c + 64, ldc);
        tl.template load<2>(c + kTileRows * ldc, ldc);
        tl.template load<3>(c + kTileRows * ldc + 64, ldc);
    } else {
        tl.template zero<0>(), tl.template zero<1>(), tl.template zero<2>(), tl.template zero<3>();
    }
    for (int64_t s = 0; s < steps; ++s) {
        tl.template load<4>(a0 + s * astep, lda);
        tl.template load<5>(a0 + da + s * astep, lda);
        tl.template load<6>(b0 + s * bstep, ldb);
        tl.template load<7>(b0 + db + s * bstep, ldb);
        tl.template dot<4, 6>(), tl.template dot<4, 7>();
        tl.template dot<5, 6>(), tl.template dot<5, 7>();
    }
    tl.template store<0>(c, ldc);
    tl.template store<1>(c + 64, ldc);
    tl.template store<2>(c + kTileRows * ldc, ldc);
    tl.template store<3>(c + kTileRows * ldc + 64, ldc);
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

#endif  // BANYAN_PREFILL_PAIRS && __x86_64__ && __linux__
