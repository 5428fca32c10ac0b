// The weights of the bf16 GEMM (cpu_quant_gemm_bf16.cpp) and their dequantizing into the
// layout its products read: a group of NP panels as pairs of inputs, panel q's pair j (16 rows
// x 2 bf16) at tile[j * np + q]. Shared by its vdpbf16ps passes, its AMX tiles
// (cpu_quant_gemm_tiles.h: that layout is AMX's B tile) and its plain-rows dequantizer.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "cpu_avx512.h"
#include "cpu_dtypes.h"
#include "cpu_quant_common.h"

namespace {

// NativeLinear kinds (banyan/layers/linear.py) this kernel reads; kBf16: a plain [N, K] bf16
// weight (a dense bf16 layer), its values taken as they are.
enum Kind : int64_t {
    kInt8Rows = 0, kInt8Groups = 1, kInt4 = 2, kInt4Wide = 3, kBf16 = 4,
    kBf16Pairs = 5  // bf16 already in pairs: [panel][K / 2][16 rows] (pack_bf16_pairs)
};

struct QuantWeight {
    int64_t kind, K, group;
    const void* codes;  // the panel layout's codes, or kBf16's rows
    const void* scale;  // float32; float16 for kInt4
    const void* mins;   // kInt4 / kInt4Wide only
    int64_t N;          // rows (kBf16 reads no row past the last)
};

// kInt8Rows's codes go into the tile as they are (exact in bf16) and the GEMM multiplies each
// sum by its row's scale (the row scales, else null): its products are then the float32
// kernels' own, code x activation, where rounding code x scale to bf16 first moved each weight
// by up to 2^-9 of itself; and its fill costs two operations a vector fewer (no products, no
// rounding). Scales per group of inputs cannot wait for the sum: those tiles hold values.
inline const float* sum_scales(const QuantWeight& w) {
    return w.kind == kInt8Rows ? static_cast<const float*>(w.scale) : nullptr;
}

#if defined(__AVX512BF16__)
// A tile's fill by kind (Fill::next): none (pairs read in place), kInt8Rows's codes, values of
// int8 codes with group scales (kInt8Groups; kInt8Rows for dequant_rows), values of 4-bit codes
// with float16 scales (kInt4) or float32 ones (kInt4Wide).
enum FillKind : int {
    kFillNone = 0, kFillCodes = 1, kFillInt8 = 2, kFillInt4 = 3, kFillInt4Wide = 4
};

// How a panel's 16 float32 sums for a token become outputs (rows n0 on, those below N): plus
// the bias, or fma(sum, the rows' scales, bias) where kInt8Rows's scales waited for the sum
// (sum_scales), rounded once to bf16. The GEMM's vector passes and its AMX tiles both end so.
struct PanelEnd {
    __mmask16 mask;  // the panel's rows below N
    __m512 bias, scale;

    PanelEnd(const float* b, const float* rs, int64_t n0, int64_t N)
        : mask(static_cast<__mmask16>((1u << std::min<int64_t>(PANEL, N - n0)) - 1u)),
          bias(b ? _mm512_maskz_loadu_ps(mask, b + n0) : _mm512_setzero_ps()),
          scale(rs ? _mm512_maskz_loadu_ps(mask, rs + n0) : _mm512_setzero_ps()) {}

    template <bool SCALED>
    __attribute__((always_inline)) void store(__m512 sum, uint16_t* at) const {
        const __m512 y = SCALED ? _mm512_fmadd_ps(sum, scale, bias) : _mm512_add_ps(sum, bias);
        _mm256_mask_storeu_epi16(at, mask, (__m256i)_mm512_cvtneps_pbh(y));
    }
};

// This thread's tile memory (at least `vectors` 64-byte vectors, 64-byte aligned: a std::vector
// of __m512i drops the alignment attribute), kept from call to call and grown as needed, for
// the GEMM's tiles and the dequantizers' (no call of them runs inside another). Allocated and
// freed each call, a down projection's 295 KB of tiles went back to the system and came back as
// fresh pages (~1.5 page faults a call); kept, int4 64-token steps through SmolLM2's stack took
// 0.985-0.998x the time (Zen 4).
inline __m512i* thread_tiles(int64_t vectors) {
    struct Buffer {
        __m512i* at = nullptr;
        int64_t size = 0;
        ~Buffer() { std::free(at); }
    };
    static thread_local Buffer buf;
    if (buf.size < vectors) {
        std::free(buf.at);
        buf.at = static_cast<__m512i*>(std::aligned_alloc(64, vectors * 64));
        buf.size = vectors;
    }
    return buf.at;
}

constexpr int NP = 3;  // panels a group (a vector pass: 3 x 8 sums + 3 weights + a broadcast)

// Where the products read panel q's pair j: base[q] + j * stride (a filled tile, or the weight
// itself when it is stored in pairs).
struct Panels {
    const __m512i* base[NP];
    int64_t stride;
};

// Panels [p0, p0 + np) as the products read them: the weight's own pairs (kBf16Pairs), or tile.
inline Panels panels_in(const QuantWeight& w, int64_t p0, int np, const __m512i* tile) {
    Panels at{};
    const bool in_place = w.kind == kBf16Pairs;
    for (int q = 0; q < np; ++q)
        at.base[q] = in_place ? static_cast<const __m512i*>(w.codes) + (p0 + q) * (w.K / 2)
                              : tile + q;
    at.stride = in_place ? 1 : np;
    return at;
}

// A span of memory the next group reads (codes fill_tile dequantizes, or pairs read in place),
// to be fetched into L2 while this group computes.
struct Ahead {
    const char* codes;
    int64_t bytes;
};

// The codes (the bulk of the bytes) of panels [p, p + np): contiguous in every kind's layout.
inline Ahead codes_of(const QuantWeight& w, int64_t p, int64_t np) {
    const int64_t per_panel = (w.kind == kBf16 || w.kind == kBf16Pairs ? 2 * w.K
                               : w.kind == kInt8Rows || w.kind == kInt8Groups ? w.K  // a byte
                               : w.K / 2) * PANEL;  // 4 bits a code
    return {static_cast<const char*>(w.codes) + p * per_panel, np * per_panel};
}

inline __m512 scale16(const void* s, int64_t at, bool half) {
    return half ? load_scale16(static_cast<const uint16_t*>(s) + at)
                : _mm512_loadu_ps(static_cast<const float*>(s) + at);
}

// A plain bf16 panel into its pairs: 16 rows' 16 pairs (32 words each) transposed as 32-bit
// words, each register then one pair of inputs across the rows (rows past N repeat the last).
void fill_plain(const QuantWeight& w, int64_t p, int q, int np, __m512i* tile) {
    const auto* rows = static_cast<const uint16_t*>(w.codes);
    const int64_t pairs = w.K / 2;
    const uint16_t* row[PANEL];
    for (int i = 0; i < PANEL; ++i) row[i] = rows + std::min(p * PANEL + i, w.N - 1) * w.K;
    int64_t j0 = 0;
    for (; j0 + 16 <= pairs; j0 += 16) {
        __m512i r[16];
        for (int i = 0; i < PANEL; ++i) r[i] = _mm512_loadu_si512(row[i] + 2 * j0);
        transpose16(r);
        for (int k = 0; k < 16; ++k) tile[(j0 + k) * np + q] = r[k];
    }
    for (; j0 < pairs; ++j0) {  // the last (K / 2) % 16 pairs
        alignas(64) uint32_t lanes[PANEL];
        for (int i = 0; i < PANEL; ++i) std::memcpy(&lanes[i], row[i] + 2 * j0, 4);
        tile[j0 * np + q] = _mm512_load_si512(lanes);
    }
}

// Panels [p0, p0 + np) of a quantized kind (not kBf16) dequantized into tile[j * np + q] (panel
// p0 + q's 16 rows at inputs 2j, 2j + 1) one vector a call, panel by panel, pairs in order (the
// codes' order); a group's scales (and minimums) are loaded at its first vector. All at once
// for a thread's first group (fill_tile); for each next one a few vectors at a time in between
// the current group's products (tile_gemm), where the dequantizing's shuffles and conversions
// overlap the vdpbf16ps stream instead of running alone between groups (a 64-token int4 step
// spent 7-16% over bf16's on it, SmolLM2's layers, Zen 4).
struct Fill {
    const QuantWeight* w = nullptr;
    int64_t np = 0, pairs = 0;
    __m512i* tile = nullptr;
    // Every kind's codes and scales run on from panel to panel, so the next vector's are found
    // by stepping pointers, not by working out its panel's and group's offsets each vector.
    const uint8_t* code = nullptr;  // the next vector's codes
    int64_t step = 0;               // code bytes a vector: 2 x 16 (int8) or 16 (int4)
    int64_t at = 0;                 // the next group's first scale (and minimum)
    int64_t group_pairs = 0;        // pairs a group
    bool int8 = false, half = false;
    bool codes = false;  // kInt8Rows's codes as they are (sum_scales), not values
    int64_t q = 0, j = 0;       // the next vector: the group's panel q, pair j
    __m512i* dst = nullptr;     // ... and its place, tile[j * np + q]
    int64_t done = 0, end = 0;  // vectors filled; this pass fills up to `end`
    int64_t left = 0;           // pairs left in the current group (0: at a group's start)
    __m512 s, m;

    Fill() = default;
    // Which next<KIND>() this fill's vectors take (never kFillNone).
    int kind() const {
        return codes ? kFillCodes : int8 ? kFillInt8 : half ? kFillInt4 : kFillInt4Wide;
    }

    // values: kInt8Rows's code x scale too (dequant_rows' plain rows), not its codes
    Fill(const QuantWeight& weight, int64_t first, int64_t panels, __m512i* into,
         bool values = false)
        : w(&weight), np(panels), pairs(weight.K / 2), tile(into), dst(into) {
        int8 = weight.kind == kInt8Rows || weight.kind == kInt8Groups;
        half = weight.kind == kInt4;
        codes = sum_scales(weight) != nullptr && !values;
        const int64_t group = weight.kind == kInt8Rows ? weight.K : weight.group;
        group_pairs = group / 2;
        step = int8 ? 2 * PANEL : PANEL;
        code = static_cast<const uint8_t*>(weight.codes) + first * pairs * step;
        at = first * (weight.K / group) * PANEL;
    }

    // The next vector, of a kind known when compiled (FillKind): a pass inlines one kind only.
    // With kInt8Rows's codes beside the others in one pass, int4 64-token steps took 1.1-1.3x
    // the time (the other kinds' constants held in vector registers the products need, and the
    // int4 branch laid out of the loop). A pass calls it on its own copy (tile_gemm): through
    // a pointer every field was reloaded after each vector's store (a vector type may alias
    // anything), a chain of dependent loads and stores per vector. With the copy, an int4
    // 17-token step through SmolLM2's layer stack took 0.976x the time (Zen 4), 32 and 64 even.
    template <int KIND>
    __attribute__((always_inline)) void next() {
        if constexpr (KIND == kFillCodes) {  // no group, no scale
            const int8_t* c = reinterpret_cast<const int8_t*>(code);
            *dst = pair_exact_bf16(load_i8x16(c), load_i8x16(c + PANEL));
            code += 2 * PANEL;
            ++done;
            advance();
            return;
        }
        constexpr bool kHalf = KIND == kFillInt4;
        const QuantWeight& W = *w;
        if (left == 0) {
            s = scale16(W.scale, at, kHalf);
            if constexpr (KIND == kFillInt4 || KIND == kFillInt4Wide)
                m = scale16(W.mins, at, kHalf);
            at += PANEL;
            left = group_pairs;
        }
        if constexpr (KIND == kFillInt8) {
            const int8_t* c = reinterpret_cast<const int8_t*>(code);
            tile[j * np + q] = pair_bf16(_mm512_mul_ps(load_i8x16(c), s),
                                         _mm512_mul_ps(load_i8x16(c + PANEL), s));
        } else {
            const __m512i b =
                _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(code)));
            const __m512 even = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(0xF)));
            const __m512 odd = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
            // kInt4's scales are float16: a 4-bit code times one is exact in float32, so one
            // fused multiply-add rounds where the product and the sum rounded once between them
            // (the same bits, two operations fewer a vector); kInt4Wide's float32 scales not
            if constexpr (kHalf)
                *dst = pair_bf16(_mm512_fmadd_ps(even, s, m), _mm512_fmadd_ps(odd, s, m));
            else
                *dst = pair_bf16(_mm512_add_ps(_mm512_mul_ps(even, s), m),
                                 _mm512_add_ps(_mm512_mul_ps(odd, s), m));
        }
        code += step;
        --left, ++done;
        advance();
    }

  private:
    // On to the next vector's place: the next pair of this panel, or the next panel's first
    // (a panel's end is a group's: its scales are loaded afresh).
    __attribute__((always_inline)) void advance() {
        dst += np;
        if (++j == pairs) j = 0, ++q, dst = tile + q, left = 0;
    }
};

// Panels [p0, p0 + np) into tile[j * np + q]: panel p0 + q's 16 rows at inputs 2j, 2j + 1
// (kInt8Rows's codes unless `values`: Fill).
void fill_tile(const QuantWeight& w, int64_t p0, int np, __m512i* tile, bool values = false) {
    if (w.kind == kBf16) {
        for (int q = 0; q < np; ++q) fill_plain(w, p0 + q, q, np, tile);
        return;
    }
    Fill fill(w, p0, np, tile, values);
    const int64_t vectors = np * fill.pairs;
    switch (fill.kind()) {
        case kFillCodes: while (fill.done < vectors) fill.next<kFillCodes>(); break;
        case kFillInt8: while (fill.done < vectors) fill.next<kFillInt8>(); break;
        case kFillInt4: while (fill.done < vectors) fill.next<kFillInt4>(); break;
        default: while (fill.done < vectors) fill.next<kFillInt4Wide>();
    }
}

#endif  // __AVX512BF16__

}  // namespace
