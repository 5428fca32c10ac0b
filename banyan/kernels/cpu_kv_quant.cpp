// fp8 K/V rows quantized as mem/kv_pool.py's quantize_rows does, bit for bit: the row's
// largest magnitude (at least 1e-30) over the format's largest finite, times each of the
// shifts tried (FP8_SCALE_SHIFTS, passed in as float32), the codes of x / that scale rounded
// to nearest even, and the shift whose dequantized row has the smallest squared error (summed
// in double; the first of equal ones). The torch composition of the same rule converts every
// candidate: a 2,048-token prefill's K or V took 10-21 ms a layer on Zen 4 (one max-scaled
// scale, 1.3 ms), a 64-token decode's 0.27 ms; here 0.75 ms and 0.036 ms.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "cpu_dtypes.h"
#include "cpu_quant_common.h"
#include "cpu_team.h"

namespace {

// float -> fp8 (kMant mantissa bits, bias kBias), rounded to nearest even, for |y| no larger
// than the format's largest finite (the caller's scale keeps it there). A normal result
// rounds float32's mantissa at its kMant-th bit (a carry moves into the exponent, as it
// should) and rebiases; a subnormal one is |y| in units of the smallest subnormal, rounded by
// nearbyint (a result of 2^kMant is the smallest normal's code, as it should be).
template <int kMant, int kBias>
inline uint8_t fp8_encode(float y) {
    uint32_t bits;
    std::memcpy(&bits, &y, 4);
    const uint32_t sign = (bits >> 24) & 0x80u;
    const uint32_t mag = bits & 0x7fffffffu;
    float a;
    std::memcpy(&a, &mag, 4);
    constexpr float kMinNormal = 1.0f / static_cast<float>(1u << (kBias - 1));
    if (a < kMinNormal) {
        const float units = a * static_cast<float>(1u << (kBias + kMant - 1));
        return static_cast<uint8_t>(sign | static_cast<uint32_t>(std::nearbyint(units)));
    }
    constexpr int kShift = 23 - kMant;
    const uint32_t rounded = (mag + (1u << (kShift - 1)) - 1u + ((mag >> kShift) & 1u)) >> kShift;
    return static_cast<uint8_t>(sign | (rounded - (static_cast<uint32_t>(127 - kBias) << kMant)));
}

#if defined(__AVX512F__)
// fp8_encode of 16 floats at once (the same integer and rounding steps, a mask choosing the
// subnormal ones), and the values the codes stand for, as floats (exact: fp8 values are).
template <int kMant, int kBias>
inline __m128i fp8_encode16(__m512 y, __m512* value) {
    const __m512i bits = _mm512_castps_si512(y);
    const __m512i mag = _mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff));
    const __m512 a = _mm512_castsi512_ps(mag);
    constexpr int kShift = 23 - kMant;
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(mag, kShift), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_srli_epi32(
        _mm512_add_epi32(mag, _mm512_add_epi32(_mm512_set1_epi32((1 << (kShift - 1)) - 1), odd)),
        kShift);
    const __m512 normal_value = _mm512_castsi512_ps(_mm512_slli_epi32(rounded, kShift));
    __m512i code = _mm512_sub_epi32(rounded, _mm512_set1_epi32((127 - kBias) << kMant));
    constexpr float kUnits = static_cast<float>(1u << (kBias + kMant - 1));
    const __m512 units = _mm512_roundscale_ps(_mm512_mul_ps(a, _mm512_set1_ps(kUnits)),
                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __mmask16 sub = _mm512_cmp_ps_mask(a, _mm512_set1_ps(1.0f / kUnits * (1u << kMant)),
                                             _CMP_LT_OQ);
    code = _mm512_mask_mov_epi32(code, sub, _mm512_cvtps_epi32(units));
    const __m512 v = _mm512_mask_mov_ps(normal_value, sub,
                                        _mm512_mul_ps(units, _mm512_set1_ps(1.0f / kUnits)));
    const __m512i sign = _mm512_and_si512(bits, _mm512_set1_epi32(static_cast<int>(0x80000000u)));
    *value = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(v), sign));
    code = _mm512_or_si512(code, _mm512_srli_epi32(sign, 24));
    return _mm512_cvtepi32_epi8(code);
}
#endif

// A row of a pool with one scale for every row, 1 (scale_out null: `--kv-cache-dtype fp8`):
// x clamped to the format's largest finite, then its codes (kv_pool.quantize_rows' rule).
template <int kMant, int kBias>
void encode_unscaled_row(const float* xr, int64_t d, float code_max, uint8_t* cr) {
    int64_t e = 0;
#if defined(__AVX512F__)
    const __m512 hi = _mm512_set1_ps(code_max), lo = _mm512_set1_ps(-code_max);
    for (; e + 16 <= d; e += 16) {
        __m512 v;
        const __m512 x = _mm512_max_ps(_mm512_min_ps(_mm512_loadu_ps(xr + e), hi), lo);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(cr + e), fp8_encode16<kMant, kBias>(x, &v));
    }
#endif
    for (; e < d; ++e) cr[e] = fp8_encode<kMant, kBias>(std::fmax(-code_max,
                                                                  std::fmin(code_max, xr[e])));
}

// One row's codes and scale (d values).
template <int kMant, int kBias>
void quantize_row(const float* xr, int64_t d, const float* shifts, int64_t n_shifts,
                  float code_max, uint8_t* cr, float* scale_out) {
    if (scale_out == nullptr) {
        encode_unscaled_row<kMant, kBias>(xr, d, code_max, cr);
        return;
    }
    float top = 0.0f;
    for (int64_t e = 0; e < d; ++e) top = std::max(top, std::fabs(xr[e]));
    const float base = std::max(top, 1e-30f) / code_max;
    double best_err = INFINITY;
    float best = base;
    for (int64_t s = 0; s < n_shifts; ++s) {
        const float scale = base * shifts[s];
        double err = 0.0;
        int64_t e = 0;
#if defined(__AVX512F__)
        __m512d acc = _mm512_setzero_pd();
        const __m512d sd = _mm512_set1_pd(static_cast<double>(scale));
        for (; e + 16 <= d; e += 16) {
            const __m512 x = _mm512_loadu_ps(xr + e);
            __m512 v;
            fp8_encode16<kMant, kBias>(_mm512_div_ps(x, _mm512_set1_ps(scale)), &v);
            for (int half = 0; half < 2; ++half) {
                const __m256 vh = half ? _mm512_extractf32x8_ps(v, 1) : _mm512_castps512_ps256(v);
                const __m256 xh = half ? _mm512_extractf32x8_ps(x, 1) : _mm512_castps512_ps256(x);
                const __m512d diff = _mm512_sub_pd(_mm512_mul_pd(_mm512_cvtps_pd(vh), sd),
                                                   _mm512_cvtps_pd(xh));
                acc = _mm512_add_pd(acc, _mm512_mul_pd(diff, diff));
            }
        }
        err = _mm512_reduce_add_pd(acc);
#endif
        for (; e < d; ++e) {
            const uint8_t c = fp8_encode<kMant, kBias>(xr[e] / scale);
            const double diff = static_cast<double>(fp8_decode<kMant, kBias>(c)) *
                                static_cast<double>(scale) - static_cast<double>(xr[e]);
            err += diff * diff;
        }
        if (err < best_err) {
            best_err = err;
            best = scale;
        }
    }
    int64_t e = 0;
#if defined(__AVX512F__)
    for (; e + 16 <= d; e += 16) {
        __m512 v;
        _mm_storeu_si128(reinterpret_cast<__m128i*>(cr + e),
                         fp8_encode16<kMant, kBias>(
                             _mm512_div_ps(_mm512_loadu_ps(xr + e), _mm512_set1_ps(best)), &v));
    }
#endif
    for (; e < d; ++e) cr[e] = fp8_encode<kMant, kBias>(xr[e] / best);
    *scale_out = best;
}

template <int kMant, int kBias>
void quantize_rows(const float* x, int64_t rows, int64_t d, const float* shifts, int64_t n_shifts,
                   float code_max, uint8_t* codes, float* scales, int64_t n_threads) {
    banyan_team::parallel_for(rows, threads_for(rows * d / 4096 + 1, n_threads), [&](int64_t r) {
        quantize_row<kMant, kBias>(x + r * d, d, shifts, n_shifts, code_max, codes + r * d,
                                   scales != nullptr ? scales + r : nullptr);
    });
}

// Rows of fp8 codes times their scales -> float32 or bf16 (kv_pool.dequantize_rows' rule: the
// code's value times the row's scale in float32, then rounded once to bf16), d % 16 == 0.
// torch's float8 -> float conversion made this ~10x the time of quantizing the rows.
template <typename K>
void dequantize_rows(const uint8_t* codes, const float* scales, int64_t rows, int64_t d,
                     void* out, bool bf16, int64_t n_threads) {
#if defined(__AVX2__) && defined(__F16C__)
    banyan_team::parallel_team(threads_for(rows * d / 4096 + 1, n_threads), [&](int t, int n) {
        std::vector<float> row(bf16 ? d : 0);
        const banyan_team::Share share(rows, t, n);
        for (int64_t r = share.begin; r < share.end; ++r) {
            float* dst = bf16 ? row.data() : static_cast<float*>(out) + r * d;
            fp8_row_to_f32<K>(codes + r * d, row_scale(scales, r), static_cast<int>(d), dst);
            if (bf16)
                for (int64_t e = 0; e < d; ++e)
                    static_cast<uint16_t*>(out)[r * d + e] = f32_to_bf16(dst[e]);
        }
    });
#else
    (void)codes, (void)scales, (void)rows, (void)d, (void)out, (void)bf16, (void)n_threads;
#endif
}

}  // namespace

extern "C" {

// 1 where banyan_fp8_dequantize_rows_* run (AVX2 + F16C builds), else 0.
int64_t banyan_fp8_dequantize_here() {
#if defined(__AVX2__) && defined(__F16C__)
    return 1;
#else
    return 0;
#endif
}

// codes: [rows, d] bytes (d % 16 == 0); scales: [rows] float32 (null: 1 each); out: [rows, d]
// float32, or bf16 (uint16) where bf16 is nonzero.
void banyan_fp8_dequantize_rows_e4m3(const uint8_t* codes, const float* scales, int64_t rows,
                                     int64_t d, void* out, int64_t bf16, int64_t n_threads) {
    dequantize_rows<E4M3>(codes, scales, rows, d, out, bf16 != 0, n_threads);
}

void banyan_fp8_dequantize_rows_e5m2(const uint8_t* codes, const float* scales, int64_t rows,
                                     int64_t d, void* out, int64_t bf16, int64_t n_threads) {
    dequantize_rows<E5M2>(codes, scales, rows, d, out, bf16 != 0, n_threads);
}

// x: [rows, d] float32; codes: [rows, d] bytes (torch's float8_e4m3fn / float8_e5m2 bits);
// scales: [rows] float32, or null for the unit scale of every row (x clamped, no search).
void banyan_fp8_quantize_rows_e4m3(const float* x, int64_t rows, int64_t d, const float* shifts,
                                   int64_t n_shifts, uint8_t* codes, float* scales,
                                   int64_t n_threads) {
    quantize_rows<3, 7>(x, rows, d, shifts, n_shifts, 448.0f, codes, scales, n_threads);
}

void banyan_fp8_quantize_rows_e5m2(const float* x, int64_t rows, int64_t d, const float* shifts,
                                   int64_t n_shifts, uint8_t* codes, float* scales,
                                   int64_t n_threads) {
    quantize_rows<2, 15>(x, rows, d, shifts, n_shifts, 57344.0f, codes, scales, n_threads);
}

}  // extern "C"
