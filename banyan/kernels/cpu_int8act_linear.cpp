// Quantized linears with 8-bit activations (--activation-quant int8): the activation rows are
// quantized once per call to int8 with one float32 scale per block of 32 inputs (as llama.cpp
// quantizes them for Q8_0: d = max|x| / 127, q = x / d rounded half to even), and each weight
// block is multiplied by integer dot products: AVX2's vpmaddubsw (u8 x s8 -> pairs summed in
// int16) and vpmaddwd (int16 pairs -> int32), 32 multiply-adds an instruction where the float32
// path (cpu_quant_linear.cpp, cpu_int8g_linear.cpp) widens, converts and FMAs 8. Opt-in: its
// outputs are those of the quantized activations, no longer exact against float32.
//
// Layout (banyan/layers/int8_activations.py repacks the float path's panels into it at load):
// the float kernels' 16-row panels, each cut into two halves of 8 rows; a 256-bit register holds
// 8 rows x 4 consecutive inputs, so one broadcast of a token's 4 activation bytes multiplies all
// 8 rows (an outer product: no horizontal sums, and the weights loaded once per block of up to
// ATB tokens).
// - int4 (codes 0..15, scale and min per group of 32/64/128): per half, per block of 32 inputs,
//   4 x 32 bytes: byte (j, row, i) holds the code of input 8j + i in its low nibble and of
//   8j + 4 + i in its high one. Codes are unsigned, so vpmaddubsw takes them as they are; a
//   block's 8 products per lane stay below 8 x 2 x 15 x 127 = 30,480 and sum in int16.
// - int8 (codes -128..127, a float32 scale per group of 16/32 inputs, or per row: group = K):
//   per half, per 4 inputs, 8 rows x 4 bytes. vpmaddubsw wants one unsigned operand: |w| with
//   the sign moved onto the activation (llama.cpp's trick), pairs <= 2 x 128 x 127 < 2^15.
// - int5 (GGUF's Q5_0: codes -16..15 plus 16, float16 scale and min -16 d per 32 inputs): the
//   int4 layout plus a plane of fifth bits (int5_half), 0.75 bytes a weight instead of 1.25.
// A weight group's scale multiplies each block's int32 sum by (scale x d); an int4 minimum adds
// min x d x sum(q) of the block.
//
// AVX2 (Zen 2/3, Intel Haswell on; AVX-512 machines take it too); a plain-loop path builds
// elsewhere. No AVX512-VNNI variant: vpdpbusd would replace the maddubs + madd pairs, but this
// machine (Zen 3) could not test it.

#include <vector>

#include "cpu_quant_common.h"

namespace {

constexpr int QB = 32;   // activations quantized per block of 32 inputs
constexpr int HALF = 8;  // rows of a half panel: 8 rows x 4 inputs fill a 256-bit register
constexpr int ATB = 4;   // tokens sharing one pass over a half panel (AVX2's 16 registers)
// Without stored minimums (mins null) a group's minimum is its scale times these: GGUF's Q4_0
// (q - 8) d and Q5_0 (q - 16) d, whose minimums are exact multiples of d (the same float:
// a power of two times a float16), so not reading them saves 1/10 of a Q4_0 weight's bytes.
constexpr float kInt4Min = -8.0f, kInt5Min = -16.0f;

// One call's quantized activations: q [T, K], per block d and d * sum(q) [T, K / 32].
struct QRows {
    std::vector<int8_t> q;
    std::vector<float> d, dsum;
};

// Row t's blocks: d = max|x| / 127 (0 for a zero block), q = nearbyint(x * (1 / d)) clamped to
// +-127, all in float32 so that the tests reproduce them exactly.
void quantize_row(const float* x, int64_t K, int8_t* q, float* d, float* dsum) {
    for (int64_t b = 0; b < K / QB; ++b) {
        const float* xb = x + b * QB;
        float top = 0.0f;
        for (int k = 0; k < QB; ++k) top = std::max(top, std::fabs(xb[k]));
        const float scale = top / 127.0f;
        const float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
        int32_t sum = 0;
#if defined(__AVX2__) && defined(__FMA__)
        const __m256 iv = _mm256_set1_ps(inv), hi = _mm256_set1_ps(127.0f);
        __m256i codes[4];
        for (int v = 0; v < 4; ++v) {
            __m256 r = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xb + 8 * v), iv),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            r = _mm256_max_ps(_mm256_min_ps(r, hi), _mm256_sub_ps(_mm256_setzero_ps(), hi));
            codes[v] = _mm256_cvtps_epi32(r);
        }
        alignas(32) int32_t lanes[QB];
        for (int v = 0; v < 4; ++v)
            _mm256_store_si256(reinterpret_cast<__m256i*>(lanes + 8 * v), codes[v]);
        for (int k = 0; k < QB; ++k) {
            q[b * QB + k] = static_cast<int8_t>(lanes[k]);
            sum += lanes[k];
        }
#else
        for (int k = 0; k < QB; ++k) {
            const float r = std::min(127.0f, std::max(-127.0f, std::nearbyint(xb[k] * inv)));
            q[b * QB + k] = static_cast<int8_t>(r);
            sum += static_cast<int32_t>(r);
        }
#endif
        d[b] = scale;
        dsum[b] = scale * static_cast<float>(sum);
    }
}

// The activations of one call, quantized once (not per output tile); kept per calling thread
// between calls, as the layer stack keeps its scratch.
const QRows& quantize(const float* x, int64_t T, int64_t K, int64_t n_threads) {
    static thread_local QRows r;
    const int64_t blocks = K / QB;
    r.q.resize(T * K);
    r.d.resize(T * blocks);
    r.dsum.resize(T * blocks);
    QRows* rp = &r;
#pragma omp parallel for num_threads(threads_for(T, n_threads)) schedule(static) if (T > 4)
    for (int64_t t = 0; t < T; ++t)
        quantize_row(x + t * K, K, rp->q.data() + t * K, rp->d.data() + t * blocks,
                     rp->dsum.data() + t * blocks);
    return r;
}

// A half panel's results for TB tokens (res [TB][8]) plus the bias, stored.
void store_half(const float* res, int64_t tb, const float* bias, float* out, int64_t N,
                int64_t row0) {
    const int64_t count = std::min<int64_t>(HALF, N - row0);
    for (int64_t i = 0; i < tb; ++i)
        for (int64_t r = 0; r < count; ++r)
            out[i * N + row0 + r] = res[i * HALF + r] + (bias ? bias[row0 + r] : 0.0f);
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

inline __m256i broadcast4(const int8_t* p) {  // 4 activation bytes into every 32-bit lane
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

// TB tokens x one int4 half panel (w: its blocks; scale, mins: its 8 lanes of group 0, the
// next group PANEL further on) -> res [TB][8].
template <int TB, typename S>
void int4_half(const QRows& a, int64_t t0, int64_t K, int64_t group, const uint8_t* w,
               const S* scale, const S* mins, float* res) {
    const int64_t blocks = K / QB, per = group / QB;
    const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256 acc[TB];
    for (int i = 0; i < TB; ++i) acc[i] = _mm256_setzero_ps();
    int64_t g = 0, in_group = 0;
    for (int64_t b = 0; b < blocks; ++b) {
        __m256i s16[TB];
        for (int i = 0; i < TB; ++i) s16[i] = _mm256_setzero_si256();
        const uint8_t* wb = w + b * (QB * HALF / 2);
#pragma GCC unroll 1  // unrolled, GCC hoisted all the block's products and spilled them
        for (int j = 0; j < 4; ++j) {
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32 * j));
            const __m256i lo = _mm256_and_si256(v, low4);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
            for (int i = 0; i < TB; ++i) {
                const int8_t* q = a.q.data() + (t0 + i) * K + b * QB + 8 * j;
                s16[i] = _mm256_add_epi16(
                    s16[i], _mm256_add_epi16(_mm256_maddubs_epi16(lo, broadcast4(q)),
                                             _mm256_maddubs_epi16(hi, broadcast4(q + 4))));
            }
        }
        // g = b / per, counted: an idiv per block cost as much as its multiplies
        const __m256 sc = load_scale8(scale + g * PANEL);
        const __m256 mn = mins ? load_scale8(mins + g * PANEL)
                               : _mm256_mul_ps(sc, _mm256_set1_ps(kInt4Min));
        if (++in_group == per) in_group = 0, ++g;
        for (int i = 0; i < TB; ++i) {
            const int64_t at = (t0 + i) * blocks + b;
            const __m256 isum = _mm256_cvtepi32_ps(_mm256_madd_epi16(s16[i], ones));
            acc[i] = _mm256_fmadd_ps(isum, _mm256_mul_ps(sc, _mm256_set1_ps(a.d[at])), acc[i]);
            acc[i] = _mm256_fmadd_ps(mn, _mm256_set1_ps(a.dsum[at]), acc[i]);
        }
    }
    for (int i = 0; i < TB; ++i) _mm256_storeu_ps(res + i * HALF, acc[i]);
}

// TB tokens x one int8 half panel (w: [K / 4][8 rows][4]; scale: its 8 lanes of group 0).
template <int TB>
void int8_half(const QRows& a, int64_t t0, int64_t K, int64_t group, const int8_t* w,
               const float* scale, float* res) {
    const int64_t blocks = K / QB, chunk = std::min<int64_t>(group, QB);
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[TB];
    for (int i = 0; i < TB; ++i) acc[i] = _mm256_setzero_ps();
    const int64_t chunks_per_group = group / chunk;  // 1, or K / 32 for a scale per row
    int64_t g = 0, in_group = 0;
    for (int64_t c0 = 0; c0 < K; c0 += chunk) {  // a weight group, or a 32-input block of one
        __m256i s32[TB];
        for (int i = 0; i < TB; ++i) s32[i] = _mm256_setzero_si256();
        for (int64_t k = c0; k < c0 + chunk; k += 4) {
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k * HALF));
            const __m256i mag = _mm256_abs_epi8(v);
            for (int i = 0; i < TB; ++i) {
                const __m256i q = _mm256_sign_epi8(broadcast4(a.q.data() + (t0 + i) * K + k), v);
                s32[i] = _mm256_add_epi32(
                    s32[i], _mm256_madd_epi16(_mm256_maddubs_epi16(mag, q), ones));
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
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[TB];
    for (int i = 0; i < TB; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
        __m256i s32[TB];
        for (int i = 0; i < TB; ++i) s32[i] = _mm256_setzero_si256();
        const uint8_t* wb = w + b * (QB * HALF / 2);
        const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(high + b * 32));
        for (int pair = 0; pair < 2; ++pair) {
            __m256i s16[TB];
            for (int i = 0; i < TB; ++i) s16[i] = _mm256_setzero_si256();
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
                    s16[i] = _mm256_add_epi16(
                        s16[i], _mm256_add_epi16(_mm256_maddubs_epi16(lo, broadcast4(q)),
                                                 _mm256_maddubs_epi16(hi, broadcast4(q + 4))));
                }
            }
            for (int i = 0; i < TB; ++i)
                s32[i] = _mm256_add_epi32(s32[i], _mm256_madd_epi16(s16[i], ones));
        }
        const __m256 sc = load_scale8(scale + b * PANEL);
        const __m256 mn = mins ? load_scale8(mins + b * PANEL)
                               : _mm256_mul_ps(sc, _mm256_set1_ps(kInt5Min));
        for (int i = 0; i < TB; ++i) {
            const int64_t at = (t0 + i) * blocks + b;
            const __m256 isum = _mm256_cvtepi32_ps(s32[i]);
            acc[i] = _mm256_fmadd_ps(isum, _mm256_mul_ps(sc, _mm256_set1_ps(a.d[at])), acc[i]);
            acc[i] = _mm256_fmadd_ps(mn, _mm256_set1_ps(a.dsum[at]), acc[i]);
        }
    }
    for (int i = 0; i < TB; ++i) _mm256_storeu_ps(res + i * HALF, acc[i]);
}

#else  // portable loops: the same integer sums and the same float steps per lane

// TB tokens x one half panel of 4-bit codes, with a plane of fifth bits when `high` is given
// (int5: the layout of the AVX2 int5_half above), scale and min per group (mins null: k_min x
// scale).
template <int TB, typename S>
void nibble_half(const QRows& a, int64_t t0, int64_t K, int64_t group, const uint8_t* w,
                 const uint8_t* high, const S* scale, const S* mins, float k_min, float* res) {
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
                const float sc = scale_value(scale[(b / per) * PANEL + r]);
                const float mn = mins ? scale_value(mins[(b / per) * PANEL + r]) : k_min * sc;
                res[i * HALF + r] += static_cast<float>(sum) * (sc * a.d[at]) + mn * a.dsum[at];
            }
        }
    }
}

template <int TB, typename S>
void int4_half(const QRows& a, int64_t t0, int64_t K, int64_t group, const uint8_t* w,
               const S* scale, const S* mins, float* res) {
    nibble_half<TB>(a, t0, K, group, w, nullptr, scale, mins, kInt4Min, res);
}

template <int TB>
void int5_half(const QRows& a, int64_t t0, int64_t K, const uint8_t* w, const uint8_t* high,
               const uint16_t* scale, const uint16_t* mins, float* res) {
    nibble_half<TB>(a, t0, K, QB, w, high, scale, mins, kInt5Min, res);
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

// The driver: every (panel, half) a unit of work split across threads, token blocks of ATB
// inside; half(TB, t0, p, h, res) computes one block's results.
template <typename Half>
void over_halves(int64_t T, int64_t N, const float* bias, float* out, int64_t n_threads,
                 Half half) {
    const int64_t units = 2 * ((N + PANEL - 1) / PANEL);
#pragma omp parallel for num_threads(threads_for(units, n_threads)) schedule(static)
    for (int64_t u = 0; u < units; ++u) {
        const int64_t row0 = u * HALF;
        if (row0 >= N) continue;  // the padding half of the last panel
        alignas(32) float res[ATB * HALF];
        for (int64_t t0 = 0; t0 < T; t0 += ATB) {
            const int64_t tb = std::min<int64_t>(ATB, T - t0);
            switch (tb) {
                case 1: half.template run<1>(t0, u, res); break;
                case 2: half.template run<2>(t0, u, res); break;
                case 3: half.template run<3>(t0, u, res); break;
                default: half.template run<4>(t0, u, res); break;
            }
            store_half(res, tb, bias, out + t0 * N, N, row0);
        }
    }
}

template <typename S>
struct Int4Half {
    const QRows& a;
    int64_t K, group;
    const uint8_t* w;
    const S *scale, *mins;
    template <int TB>
    void run(int64_t t0, int64_t u, float* res) const {
        const int64_t p = u / 2, h = u % 2, groups = K / group;
        const int64_t at = p * groups * PANEL + h * HALF;
        int4_half<TB>(a, t0, K, group, w + u * (K * HALF / 2), scale + at,
                      mins ? mins + at : nullptr, res);
    }
};

struct Int8Half {
    const QRows& a;
    int64_t K, group;
    const int8_t* w;
    const float* scale;
    template <int TB>
    void run(int64_t t0, int64_t u, float* res) const {
        const int64_t p = u / 2, h = u % 2, groups = K / group;
        int8_half<TB>(a, t0, K, group, w + u * (K * HALF), scale + p * groups * PANEL + h * HALF,
                      res);
    }
};

struct Int5Half {  // groups of 32 (Q5_0): float16 scale and min per block
    const QRows& a;
    int64_t K;
    const uint8_t *w, *high;
    const uint16_t *scale, *mins;
    template <int TB>
    void run(int64_t t0, int64_t u, float* res) const {  // 2 tokens at a time at most
        const int64_t at = (u / 2) * (K / QB) * PANEL + (u % 2) * HALF;
        const uint8_t* wu = w + u * (K * HALF / 2);
        const uint8_t* hu = high + u * (K / QB) * 32;
        const uint16_t* mu = mins ? mins + at : nullptr;
        for (int i = 0; i < TB; i += 2) {
            if (TB - i >= 2)
                int5_half<2>(a, t0 + i, K, wu, hu, scale + at, mu, res + i * HALF);
            else
                int5_half<1>(a, t0 + i, K, wu, hu, scale + at, mu, res + i * HALF);
        }
    }
};

template <typename S>
void q8_int4(const float* x, int64_t T, int64_t K, int64_t group, const uint8_t* w,
             const S* scale, const S* mins, const float* bias, float* out, int64_t N,
             int64_t n_threads) {
    const QRows& a = quantize(x, T, K, n_threads);
    over_halves(T, N, bias, out, n_threads, Int4Half<S>{a, K, group, w, scale, mins});
}

}  // namespace

extern "C" {

// x [T, K] float32 (K % 32 == 0, group % 32 == 0), w: the int4 half panels (see the top),
// scale and mins [panels, K / group, 16] float16 (or float32 for _q8_int4s_; mins null: -8 x
// scale, Q4_0), bias [N] or null,
// out [T, N].
void banyan_q8_int4_linear_f32(const float* x, int64_t T, int64_t K, int64_t group,
                               const uint8_t* w, const uint16_t* scale, const uint16_t* mins,
                               const float* bias, float* out, int64_t N, int64_t n_threads) {
    q8_int4(x, T, K, group, w, scale, mins, bias, out, N, n_threads);
}

void banyan_q8_int4s_linear_f32(const float* x, int64_t T, int64_t K, int64_t group,
                                const uint8_t* w, const float* scale, const float* mins,
                                const float* bias, float* out, int64_t N, int64_t n_threads) {
    q8_int4(x, T, K, group, w, scale, mins, bias, out, N, n_threads);
}

// x [T, K] float32 (K % 32 == 0; group 16, a multiple of 32, or K for a scale per row), w: the
// int8 half panels, scale [panels, K / group, 16] float32, bias [N] or null, out [T, N].
void banyan_q8_int8_linear_f32(const float* x, int64_t T, int64_t K, int64_t group,
                               const int8_t* w, const float* scale, const float* bias,
                               float* out, int64_t N, int64_t n_threads) {
    const QRows& a = quantize(x, T, K, n_threads);
    over_halves(T, N, bias, out, n_threads, Int8Half{a, K, group, w, scale});
}

// As banyan_q8_int4_linear_f32 for 5-bit codes (group 32; mins null: -16 x scale, Q5_0): w the
// low nibbles as int4, then the fifth bits, [panels * 2, K / 32, 32] (see int5_half): one
// buffer, as the layer stack passes one pointer a weight.
void banyan_q8_int5_linear_f32(const float* x, int64_t T, int64_t K, const uint8_t* w,
                               const uint16_t* scale, const uint16_t* mins, const float* bias,
                               float* out, int64_t N, int64_t n_threads) {
    const uint8_t* high = w + (N + PANEL - 1) / PANEL * PANEL * K / 2;
    const QRows& a = quantize(x, T, K, n_threads);
    over_halves(T, N, bias, out, n_threads, Int5Half{a, K, w, high, scale, mins});
}

// The activation quantization alone (for the tests): q [T, K] int8, d [T, K / 32] float32.
void banyan_q8_quantize_f32(const float* x, int64_t T, int64_t K, int8_t* q, float* d) {
    const QRows& a = quantize(x, T, K, 1);
    std::memcpy(q, a.q.data(), static_cast<size_t>(T * K));
    std::memcpy(d, a.d.data(), static_cast<size_t>(T * (K / QB)) * sizeof(float));
}

}  // extern "C"
