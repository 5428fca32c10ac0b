// The half-panel loops of the 8-bit-activation linears (cpu_int8act_linear.cpp, whose top
// comment describes the layouts): one half panel (8 output rows) times a block of tokens, on
// AVX2 or in portable loops that make the same integer sums and the same float steps per lane.
#pragma once

#include <vector>

#include "cpu_quant_common.h"

namespace {

constexpr int QB = 32;   // activations quantized per block of 32 inputs
constexpr int HALF = 8;  // rows of a half panel: 8 rows x 4 inputs fill a 256-bit register
// Tokens sharing one pass over a half panel: as many as the vector registers hold (a token's
// float and integer sums take two): 4 in AVX2's 16, 8 in AVX-512's 32 (VL: the upper 16 take
// 256-bit operands too), each weight load and unpack then serving twice the tokens.
#if defined(__AVX512VL__)
constexpr int ATB = 8;
#else
constexpr int ATB = 4;
#endif
// Without stored minimums (mins null) a group's minimum is its scale times these: GGUF's Q4_0
// (q - 8) d and Q5_0 (q - 16) d. Then the block's integer sum takes the offset itself,
// sum((q - 8) a) = sum(q a) - 8 sum(a), exact in int32, and the block needs one float
// multiply-add instead of two; not reading the minimums saves 1/10 of a Q4_0 weight's bytes.
constexpr int32_t kInt4Offset = 8, kInt5Offset = 16;
// Weight bytes read ahead of use: on Zen 3 one core's hardware prefetch alone streamed ~11 GB/s
// through these loops, with this ~16 (a plain read: 17); 1 and 4 KiB measured slower.
constexpr int64_t kPrefetchBytes = 2048;

// One call's quantized activations: q [T, K], per block d, d * sum(q) and sum(q) [T, K / 32].
struct QRows {
    std::vector<int8_t> q;
    std::vector<float> d, dsum;
    std::vector<int32_t> qsum;
};

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

// vpdpbusd (AVX512-VNNI on 256-bit registers, or AVX-VNNI): 4 u8 x s8 products added into each
// int32 lane in one instruction, where AVX2 takes vpmaddubsw (pairs, int16) and vpmaddwd.
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define BANYAN_DPBUSD(acc, u, s) _mm256_dpbusd_epi32(acc, u, s)
#elif defined(__AVXVNNI__)
#define BANYAN_DPBUSD(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#endif

// acc + per 32-bit lane the sum of its 4 u8 x s8 products, in int32 (the int8 weights' pairs
// reach 2 x 128 x 127: AVX2 widens them at once).
inline __m256i add_dot4(__m256i acc, __m256i u, __m256i s) {
#if defined(BANYAN_DPBUSD)
    return BANYAN_DPBUSD(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s),
                                                   _mm256_set1_epi16(1)));
#endif
}

// A block's sum of u8 x s8 products, 4 per 32-bit lane, for codes small enough that AVX2 may
// keep it in int16 (the callers' bounds) and widen it once in total(); with VNNI it is int32
// throughout. Both give the same integers.
class BlockDot {
   public:
    void add(__m256i u, __m256i s) {
#if defined(BANYAN_DPBUSD)
        sum_ = BANYAN_DPBUSD(sum_, u, s);
#else
        sum_ = _mm256_add_epi16(sum_, _mm256_maddubs_epi16(u, s));
#endif
    }
    __m256i total() const {
#if defined(BANYAN_DPBUSD)
        return sum_;
#else
        return _mm256_madd_epi16(sum_, _mm256_set1_epi16(1));
#endif
    }
    // Two chains' total (AVX2: one widening for both).
    static __m256i total(const BlockDot& a, const BlockDot& b) {
#if defined(BANYAN_DPBUSD)
        return _mm256_add_epi32(a.sum_, b.sum_);
#else
        return _mm256_madd_epi16(_mm256_add_epi16(a.sum_, b.sum_), _mm256_set1_epi16(1));
#endif
    }

   private:
    __m256i sum_ = _mm256_setzero_si256();
};

inline __m256i broadcast4(const int8_t* p) {  // 4 activation bytes into every 32-bit lane
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

inline void prefetch_ahead(const void* p) {  // 128 bytes (an int4 block), kPrefetchBytes on
    const char* c = static_cast<const char*>(p) + kPrefetchBytes;
    _mm_prefetch(c, _MM_HINT_T0);
    _mm_prefetch(c + 64, _MM_HINT_T0);
}

// One token x one int4 half panel, the batch-1 decode's loop (int4_half's scheme): the block's
// 4 steps unrolled into two int16 sums (independent chains), the next weights prefetched.
template <typename S>
void int4_half1(const QRows& a, int64_t t, int64_t K, int64_t group, const uint8_t* w,
                const S* scale, const S* mins, float* res) {
    const int64_t blocks = K / QB, per = group / QB;
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    const int8_t* q = a.q.data() + t * K;
    const float* d = a.d.data() + t * blocks;
    const float* dsum = a.dsum.data() + t * blocks;
    const int32_t* qsum = a.qsum.data() + t * blocks;
    __m256 acc = _mm256_setzero_ps();
    int64_t g = 0, in_group = 0;
    for (int64_t b = 0; b < blocks; ++b, q += QB) {
        const uint8_t* wb = w + b * (QB * HALF / 2);
        prefetch_ahead(wb);
        BlockDot s0, s1;
        for (int j = 0; j < 4; ++j) {
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32 * j));
            const __m256i lo = _mm256_and_si256(v, low4);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
            s0.add(lo, broadcast4(q + 8 * j));
            s1.add(hi, broadcast4(q + 8 * j + 4));
        }
        __m256i isum = BlockDot::total(s0, s1);
        const __m256 sc = load_scale8(scale + g * PANEL);
        if (!mins) isum = _mm256_sub_epi32(isum, _mm256_set1_epi32(kInt4Offset * qsum[b]));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(sc, _mm256_set1_ps(d[b])),
                              acc);
        // the minimums into the same sum right after, as int4_half and the panels add them (a
        // second sum added at the end gave a decode other bits than the same token in a batch)
        if (mins)
            acc = _mm256_fmadd_ps(load_scale8(mins + g * PANEL), _mm256_set1_ps(dsum[b]), acc);
        if (++in_group == per) in_group = 0, ++g;  // g = b / per: an idiv cost as much
    }
    _mm256_storeu_ps(res, acc);
}

// TB tokens x one int4 half panel (w: its blocks; scale, mins: its 8 lanes of group 0, the
// next group PANEL further on) -> res [TB][8].
template <int TB, typename S>
void int4_half(const QRows& a, int64_t t0, int64_t K, int64_t group, const uint8_t* w,
               const S* scale, const S* mins, float* res) {
    const int64_t blocks = K / QB, per = group / QB;
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    __m256 acc[TB];
    for (int i = 0; i < TB; ++i) acc[i] = _mm256_setzero_ps();
    int64_t g = 0, in_group = 0;
    for (int64_t b = 0; b < blocks; ++b) {
        BlockDot dot[TB];
        const uint8_t* wb = w + b * (QB * HALF / 2);
        prefetch_ahead(wb);
#pragma GCC unroll 1  // unrolled, GCC hoisted all the block's products and spilled them
        for (int j = 0; j < 4; ++j) {
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32 * j));
            const __m256i lo = _mm256_and_si256(v, low4);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
            for (int i = 0; i < TB; ++i) {
                const int8_t* q = a.q.data() + (t0 + i) * K + b * QB + 8 * j;
                dot[i].add(lo, broadcast4(q));
                dot[i].add(hi, broadcast4(q + 4));
            }
        }
        const __m256 sc = load_scale8(scale + g * PANEL);
        const __m256 mn = mins ? load_scale8(mins + g * PANEL) : _mm256_setzero_ps();
        if (++in_group == per) in_group = 0, ++g;
        for (int i = 0; i < TB; ++i) {
            const int64_t at = (t0 + i) * blocks + b;
            __m256i isum = dot[i].total();
            if (!mins)
                isum = _mm256_sub_epi32(isum, _mm256_set1_epi32(kInt4Offset * a.qsum[at]));
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum),
                                     _mm256_mul_ps(sc, _mm256_set1_ps(a.d[at])), acc[i]);
            if (mins) acc[i] = _mm256_fmadd_ps(mn, _mm256_set1_ps(a.dsum[at]), acc[i]);
        }
    }
    for (int i = 0; i < TB; ++i) _mm256_storeu_ps(res + i * HALF, acc[i]);
}

// TB tokens x one int8 half panel (w: [K / 4][8 rows][4]; scale: its 8 lanes of group 0), in
// chunks of kChunk inputs (min(group, QB)): a count known at compile time, so the chunk's steps
// unroll whole (counted at run time, GCC copied each integer sum to another register and back
// every step, as in int8_panels).
template <int TB, int kChunk>
void int8_half_chunks(const QRows& a, int64_t t0, int64_t K, int64_t group, const int8_t* w,
                      const float* scale, float* res) {
    const int64_t blocks = K / QB, chunk = kChunk;
    __m256 acc[TB];
    for (int i = 0; i < TB; ++i) acc[i] = _mm256_setzero_ps();
    const int64_t chunks_per_group = group / chunk;  // 1, or K / 32 for a scale per row
    int64_t g = 0, in_group = 0;
    for (int64_t c0 = 0; c0 < K; c0 += chunk) {  // a weight group, or a 32-input block of one
        for (int64_t off = 0; off < chunk * HALF; off += 128) prefetch_ahead(w + c0 * HALF + off);
        __m256i s32[TB];
        for (int i = 0; i < TB; ++i) s32[i] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int step = 0; step < kChunk / 4; ++step) {
            const int64_t k = c0 + 4 * step;
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k * HALF));
            const __m256i mag = _mm256_abs_epi8(v);
            for (int i = 0; i < TB; ++i) {
                const __m256i q = _mm256_sign_epi8(broadcast4(a.q.data() + (t0 + i) * K + k), v);
                s32[i] = add_dot4(s32[i], mag, q);
            }
        }
        const __m256 sc = _mm256_loadu_ps(scale + g * PANEL);
        if (++in_group == chunks_per_group) in_group = 0, ++g;
        for (int i = 0; i < TB; ++i) {
            const float d = a.d[(t0 + i) * blocks + c0 / QB];
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32[i]),
                                     _mm256_mul_ps(sc, _mm256_set1_ps(d)), acc[i]);
        }
    }
    for (int i = 0; i < TB; ++i) _mm256_storeu_ps(res + i * HALF, acc[i]);
}

template <int TB>
void int8_half(const QRows& a, int64_t t0, int64_t K, int64_t group, const int8_t* w,
               const float* scale, float* res) {
    switch (std::min<int64_t>(group, QB)) {  // (groups divide QB or are a multiple of it)
        case QB: return int8_half_chunks<TB, QB>(a, t0, K, group, w, scale, res);
        case QB / 2: return int8_half_chunks<TB, QB / 2>(a, t0, K, group, w, scale, res);
        case QB / 4: return int8_half_chunks<TB, QB / 4>(a, t0, K, group, w, scale, res);
        default: return int8_half_chunks<TB, QB / 8>(a, t0, K, group, w, scale, res);
    }
}

// TB (<= 2) tokens x one int5 half panel: GGUF's Q5_0, value = (q - 16) d with q in 0..31 taken
// as q d + min (min = -16 d, exact): the int4 nibbles plus a plane of high bits (high: 32 bytes
// a block, bit 2j + s of byte (row, i) the fifth bit of input 8j + 4s + i). Codes up to 31 let
// int16 sums hold 2 of the 4 steps (2 x 2 x 2 x 31 x 127 = 31,496), so two vpmaddwd a block;
// the extra int32 sums fit the registers for 2 tokens, not 4.
template <int TB>
void int5_half(const QRows& a, int64_t t0, int64_t K, const uint8_t* w, const uint8_t* high,
               const uint16_t* scale, const uint16_t* mins, float* res) {
    static_assert(TB <= 2, "register budget");
    const int64_t blocks = K / QB;
    const __m256i low4 = _mm256_set1_epi8(0x0F), bit = _mm256_set1_epi8(1);
    __m256 acc[TB];
    for (int i = 0; i < TB; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
        __m256i s32[TB];
        for (int i = 0; i < TB; ++i) s32[i] = _mm256_setzero_si256();
        const uint8_t* wb = w + b * (QB * HALF / 2);
        prefetch_ahead(wb);
        const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(high + b * 32));
        for (int pair = 0; pair < 2; ++pair) {
            BlockDot dot[TB];
            for (int j = 2 * pair; j < 2 * pair + 2; ++j) {
                const __m256i v =
                    _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32 * j));
                // bit 2j (2j + 1) of each byte to bit 4: 16-bit shifts, then a byte mask
                const __m256i h_lo = _mm256_and_si256(_mm256_srli_epi16(hb, 2 * j), bit);
                const __m256i h_hi = _mm256_and_si256(_mm256_srli_epi16(hb, 2 * j + 1), bit);
                const __m256i lo = _mm256_or_si256(_mm256_and_si256(v, low4),
                                                   _mm256_slli_epi16(h_lo, 4));
                const __m256i hi = _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16(v, 4), low4), _mm256_slli_epi16(h_hi, 4));
                for (int i = 0; i < TB; ++i) {
                    const int8_t* q = a.q.data() + (t0 + i) * K + b * QB + 8 * j;
                    dot[i].add(lo, broadcast4(q));
                    dot[i].add(hi, broadcast4(q + 4));
                }
            }
            for (int i = 0; i < TB; ++i) s32[i] = _mm256_add_epi32(s32[i], dot[i].total());
        }
        const __m256 sc = load_scale8(scale + b * PANEL);
        const __m256 mn = mins ? load_scale8(mins + b * PANEL) : _mm256_setzero_ps();
        for (int i = 0; i < TB; ++i) {
            const int64_t at = (t0 + i) * blocks + b;
            if (!mins)
                s32[i] = _mm256_sub_epi32(s32[i], _mm256_set1_epi32(kInt5Offset * a.qsum[at]));
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32[i]),
                                     _mm256_mul_ps(sc, _mm256_set1_ps(a.d[at])), acc[i]);
            if (mins) acc[i] = _mm256_fmadd_ps(mn, _mm256_set1_ps(a.dsum[at]), acc[i]);
        }
    }
    for (int i = 0; i < TB; ++i) _mm256_storeu_ps(res + i * HALF, acc[i]);
}

#else  // portable loops: the same integer sums and the same float steps per lane

// TB tokens x one half panel of 4-bit codes, with a plane of fifth bits when `high` is given
// (int5: the layout of the AVX2 int5_half above), scale and min per group (mins null: the
// codes less `offset`, in the integer sum).
template <int TB, typename S>
void nibble_half(const QRows& a, int64_t t0, int64_t K, int64_t group, const uint8_t* w,
                 const uint8_t* high, const S* scale, const S* mins, int32_t offset,
                 float* res) {
    const int64_t blocks = K / QB, per = group / QB;
    for (int i = 0; i < TB * HALF; ++i) res[i] = 0.0f;
    for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* wb = w + b * (QB * HALF / 2);
        const uint8_t* hb = high ? high + b * 32 : nullptr;
        for (int i = 0; i < TB; ++i) {
            const int8_t* q = a.q.data() + (t0 + i) * K + b * QB;
            const int64_t at = (t0 + i) * blocks + b;
            for (int r = 0; r < HALF; ++r) {
                int32_t sum = 0;
                for (int j = 0; j < 4; ++j)
                    for (int e = 0; e < 4; ++e) {
                        const int byte = wb[(j * HALF + r) * 4 + e], bits = hb ? hb[r * 4 + e] : 0;
                        const int lo = (byte & 0xF) | ((bits >> (2 * j)) & 1) << 4;
                        const int hi = (byte >> 4) | ((bits >> (2 * j + 1)) & 1) << 4;
                        sum += lo * q[8 * j + e] + hi * q[8 * j + 4 + e];
                    }
                const int64_t lane = (b / per) * PANEL + r;
                if (!mins) sum -= offset * a.qsum[at];
                res[i * HALF + r] += static_cast<float>(sum) * (scale_value(scale[lane]) * a.d[at]);
                if (mins) res[i * HALF + r] += scale_value(mins[lane]) * a.dsum[at];
            }
        }
    }
}

template <int TB, typename S>
void int4_half(const QRows& a, int64_t t0, int64_t K, int64_t group, const uint8_t* w,
               const S* scale, const S* mins, float* res) {
    nibble_half<TB>(a, t0, K, group, w, nullptr, scale, mins, kInt4Offset, res);
}

template <typename S>
void int4_half1(const QRows& a, int64_t t, int64_t K, int64_t group, const uint8_t* w,
                const S* scale, const S* mins, float* res) {
    nibble_half<1>(a, t, K, group, w, nullptr, scale, mins, kInt4Offset, res);
}

template <int TB>
void int5_half(const QRows& a, int64_t t0, int64_t K, const uint8_t* w, const uint8_t* high,
               const uint16_t* scale, const uint16_t* mins, float* res) {
    nibble_half<TB>(a, t0, K, QB, w, high, scale, mins, kInt5Offset, res);
}

template <int TB>
void int8_half(const QRows& a, int64_t t0, int64_t K, int64_t group, const int8_t* w,
               const float* scale, float* res) {
    const int64_t blocks = K / QB, chunk = std::min<int64_t>(group, QB);
    for (int i = 0; i < TB * HALF; ++i) res[i] = 0.0f;
    for (int64_t c0 = 0; c0 < K; c0 += chunk)
        for (int i = 0; i < TB; ++i) {
            const int8_t* q = a.q.data() + (t0 + i) * K;
            const float d = a.d[(t0 + i) * blocks + c0 / QB];
            for (int r = 0; r < HALF; ++r) {
                int32_t sum = 0;
                for (int64_t k = c0; k < c0 + chunk; ++k)
                    sum += w[(k / 4 * HALF + r) * 4 + k % 4] * q[k];
                const float sc = scale[(c0 / group) * PANEL + r];
                res[i * HALF + r] += static_cast<float>(sum) * (sc * d);
            }
        }
}

#endif  // AVX2

}  // namespace
