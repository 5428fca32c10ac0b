// --activation-quant int8_tiles (layers/int8_tiles.py): int8 weights with a float32 scale per
// output row times int8 activations with a float32 scale per 128 inputs of each token, the
// integer products on AMX-INT8 tiles where the CPU has them.
//
// Why: on an AMX Xeon a batched step's projections are bound by the tiles (#13 / #16: a
// 64-token step's tileloadd + tdpbf16ps ~85% of its samples), and weight-only int8 runs the
// same tdpbf16ps after dequantizing each panel, so it cannot beat bf16 there. tdpbssd takes 64
// inputs an instruction where tdpbf16ps takes 32, on the codes as stored (nothing dequantized).
// The int32 sums are folded into float32 once a block of 128 inputs (2 tile products): a tile
// store, then a convert and a multiply-add a row. With a block of 64 that fold came every
// product, and its vector work (which slows as the VM's vector units throttle under sustained
// load) made the kernel no faster than bf16's tiles; per token (no fold at all) costs too much
// perplexity (the activations' outlier channels; the figures: layers/int8_tiles.py).
//
// One order of float operations, on exact integer sums: out[t][n] = (sum over blocks b, in
// order, of fma(float(S_b[t][n]), d[t][b], .)) * s[n] (+ bias[n]), so AMX's tiles and their
// emulation in plain loops (CPUs without AMX-INT8, and the tests' check) give the same bits,
// whatever the step's size or company.
//
// Steps of fewer than kTilesFrom tokens (and every step where AVX512-VNNI is there but not
// AMX-INT8: Zen 4) take vpdpbusd instead (vnni_panel): the same integer sums and folds.
//
// Weights: [N / 16 panels][K / 4][16 rows][4 inputs] int8: a B tile per panel and 64 inputs is
// 16 rows of 64 contiguous bytes; N padded to whole panels with zero rows; K a multiple of 64.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_amx_tiles.h"
#include "cpu_avx512.h"
#include "cpu_dtypes.h"
#include "cpu_team.h"

#if defined(BANYAN_AMX_TILES) && defined(__AVX512F__) && defined(__AVX512BW__)
#include <cpuid.h>
#include <immintrin.h>

namespace {

constexpr int64_t kStep = 64;    // inputs a tile product takes: one int8 tile row
constexpr int64_t kBlock = 128;  // activation inputs per scale (a row's last block: K's rest)
constexpr int64_t kPanel = 16;   // weight rows per panel: one B tile's columns
constexpr int64_t kRows = 64;    // tokens a pass over a pair of panels

// Row x's codes and scales: d = max|x| / 127 per block (0 for a zero block), q =
// nearbyint(x * (1 / d)) within +-127; qs: each block's sum of codes (the vector path's).
template <typename X>
void quantize_row(const X* x, int64_t K, int8_t* q, float* d, int32_t* qs) {
    for (int64_t b = 0, k0 = 0; k0 < K; ++b, k0 += kBlock) {
        const int n = static_cast<int>(std::min(kBlock, K - k0) / 16);
        __m512 v[kBlock / 16], top = _mm512_setzero_ps();
        for (int i = 0; i < n; ++i) {
            v[i] = load16(x + k0 + 16 * i);
            top = _mm512_max_ps(top, _mm512_abs_ps(v[i]));
        }
        const float scale = _mm512_reduce_max_ps(top) / 127.0f;
        const __m512 inv = _mm512_set1_ps(scale > 0.0f ? 1.0f / scale : 0.0f);
        const __m512 lim = _mm512_set1_ps(127.0f);
        __m512i codes = _mm512_setzero_si512();
        for (int i = 0; i < n; ++i) {
            __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(v[i], inv),
                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            r = _mm512_min_ps(_mm512_max_ps(r, _mm512_sub_ps(_mm512_setzero_ps(), lim)), lim);
            const __m512i c = _mm512_cvtps_epi32(r);
            codes = _mm512_add_epi32(codes, c);
            _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k0 + 16 * i),
                             _mm512_cvtepi32_epi8(c));
        }
        d[b] = scale;
        qs[b] = _mm512_reduce_add_epi32(codes);
    }
}

// The int8 tile product, emulated in memory (SoftTiles' int8 twin): C [16][16] int32 +=
// A [16][64] x B [16 quads][16 columns][4].
inline void soft_dot_s8(const int8_t* a, int64_t lda, const int8_t* b, int32_t* c) {
    for (int m = 0; m < 16; ++m)
        for (int n = 0; n < 16; ++n) {
            int32_t s = 0;
            for (int k = 0; k < 16; ++k)
                for (int i = 0; i < 4; ++i) s += a[m * lda + 4 * k + i] * b[64 * k + 4 * n + i];
            c[m * 32 + n] += s;
        }
}

// A row's blocks of kBlock inputs (the last one K's rest, whole tile rows).
inline int64_t blocks_of(int64_t K) { return (K + kBlock - 1) / kBlock; }

// A row's 16 sums of panel columns [n0, n0 + 16) -> out_row: times the rows' scales, plus
// bias, in Out's type (only the columns below N exist).
template <typename Out>
inline void finish(const float* sums, int64_t n0, const float* scale, const float* bias,
                   Out* out_row, int64_t N) {
    const __mmask16 mask = static_cast<__mmask16>(N - n0 >= 16 ? 0xFFFF : (1u << (N - n0)) - 1u);
    __m512 v = _mm512_mul_ps(_mm512_loadu_ps(sums), _mm512_maskz_loadu_ps(mask, scale + n0));
    if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias + n0));
    if constexpr (sizeof(Out) == 4)
        _mm512_mask_storeu_ps(out_row + n0, mask, v);
    else
        _mm256_mask_storeu_epi16(out_row + n0, mask, _mm512_cvtepi32_epi16(f32_to_bf16_16(v)));
}

#if defined(__AVX512VNNI__)
constexpr int64_t kVnniRows = 4;  // tokens a pass of the vector path over a panel
// Steps of fewer tokens take the vector path where AMX's tiles are there too: SmolLM2's 120
// projections from memory (the Xeon of #13, bf16 in, two runs each way): 1 token 5.8-7.5 ms
// against the tiles' 8.0-8.7, 2 tokens 6.3-7.3 / 9.7-10.2, 4 6.8-7.8 / 9.8-10.6, 8 11.2-12.5 /
// 10.7-11.0, 16 21-23 / 9.4-11.8.
constexpr int64_t kTilesFrom = 8;

// Tokens [t0, t0 + rows) (rows <= kVnniRows) x panel p with vpdpbusd: each 4 inputs' 16 codes a
// row of the panel's 64 bytes, read as unsigned (w + 128: one vpxord, shared by the rows) times
// the token's 4 activation codes broadcast; 128 x the block's sum of codes (qs) comes off after.
// Two sums a row (even and odd 4-input steps: vpdpbusd's latency). The same integer sums as the
// tiles', folded in the same order: the same bits.
template <typename Out>
void vnni_panel(const int8_t* q, const float* d, const int32_t* qs, int64_t t0, int64_t rows,
                int64_t K, const int8_t* w, int64_t p, const float* scale, const float* bias,
                Out* out, int64_t N) {
    const int64_t blocks = blocks_of(K);
    const int8_t* wp = w + p * K * kPanel;
    __m512 acc[kVnniRows];
    for (int64_t r = 0; r < rows; ++r) acc[r] = _mm512_setzero_ps();
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    for (int64_t b = 0; b < blocks; ++b) {
        const int64_t k0 = b * kBlock, k1 = std::min(K, k0 + kBlock);
        __m512i sum[2][kVnniRows];
        for (int64_t r = 0; r < rows; ++r)
            sum[0][r] = _mm512_setzero_si512(), sum[1][r] = _mm512_setzero_si512();
        for (int64_t k = k0; k < k1; k += 8) {  // (blocks are whole 64-input steps)
            const int8_t* wk = wp + k * kPanel;
            _mm_prefetch(reinterpret_cast<const char*>(wk) + 2048, _MM_HINT_T0);
            _mm_prefetch(reinterpret_cast<const char*>(wk) + 2048 + 64, _MM_HINT_T0);
            const __m512i w0 = _mm512_xor_si512(_mm512_loadu_si512(wk), flip);
            const __m512i w1 = _mm512_xor_si512(_mm512_loadu_si512(wk + 64), flip);
            for (int64_t r = 0; r < rows; ++r) {
                int32_t a[2];
                std::memcpy(a, q + (t0 + r) * K + k, 8);
                sum[0][r] = _mm512_dpbusd_epi32(sum[0][r], w0, _mm512_set1_epi32(a[0]));
                sum[1][r] = _mm512_dpbusd_epi32(sum[1][r], w1, _mm512_set1_epi32(a[1]));
            }
        }
        for (int64_t r = 0; r < rows; ++r) {
            const __m512i off = _mm512_set1_epi32(128 * qs[(t0 + r) * blocks + b]);
            const __m512i exact = _mm512_sub_epi32(_mm512_add_epi32(sum[0][r], sum[1][r]), off);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact),
                                     _mm512_set1_ps(d[(t0 + r) * blocks + b]), acc[r]);
        }
    }
    alignas(64) float row[16];
    for (int64_t r = 0; r < rows; ++r) {
        _mm512_store_ps(row, acc[r]);
        finish(row, p * kPanel, scale, bias, out + (t0 + r) * N, N);
    }
}
#endif

// out rows [t0, t0 + rows) (rows <= kRows) x panels p, p1 (p1 == p: one panel) over all of K.
// Each 16 rows' sums over a block of inputs accumulate in two tiles of int32 (the block's tile
// products: its 64-input steps), are stored (cs) and folded into acc by their rows' scales.
// Consecutive blocks' tiles alternate between two sets (A 4, C 0-1; A 5, C 2-3) and each fold
// runs one block behind, so a block's products need not wait on the last one's stores and its
// fold's vector work overlaps the next products. ahead: the next pair's weights (or null),
// brought into L2 a tile step at a time (tile loads wait for memory; the hardware prefetchers
// do not see them coming).
template <bool kAmx, typename Out>
void panel_pair(AmxTiles& tl, const int8_t* q, const float* d, int64_t K, int64_t t0,
                int64_t rows, const int8_t* w, int64_t p, int64_t p1, const float* scale,
                const float* bias, Out* out, int64_t N, const int8_t* ahead) {
    const int64_t blocks = blocks_of(K), panel_bytes = K * kPanel, units = (rows + 15) / 16;
    const int8_t* b0 = w + p * panel_bytes;
    const int8_t* b1 = w + p1 * panel_bytes;
    alignas(64) int32_t cs[2][16 * 32];
    alignas(64) float acc[kRows * 32];
    std::fill(acc, acc + rows * 32, 0.0f);
    auto fold = [&](int64_t b, int64_t u, const int32_t* c) {
        for (int64_t t = 16 * u; t < std::min(rows, 16 * u + 16); ++t) {
            const __m512 dt = _mm512_set1_ps(d[(t0 + t) * blocks + b]);
            for (int h = 0; h < 2; ++h) {
                float* at = acc + t * 32 + 16 * h;
                const __m512 sum = _mm512_cvtepi32_ps(_mm512_load_si512(c + (t - 16 * u) * 32 +
                                                                        16 * h));
                _mm512_store_ps(at, _mm512_fmadd_ps(sum, dt, _mm512_load_ps(at)));
            }
        }
    };
    int64_t seq = 0, last_b = 0, last_u = 0;  // blocks issued; the one not yet folded
    for (int64_t b = 0; b < blocks; ++b) {
        const int64_t s0 = b * kBlock / kStep, steps = std::min(kBlock, K - b * kBlock) / kStep;
        if (ahead)
            for (int64_t i = 0; i < 32 * steps; ++i)
                _mm_prefetch(reinterpret_cast<const char*>(ahead + (s0 + i / 32) * 1024 +
                                                           (i & 16 ? panel_bytes : 0)) +
                                 64 * (i & 15),
                             _MM_HINT_T1);
        for (int64_t u = 0; u < units; ++u, ++seq) {
            const int8_t* a = q + (t0 + 16 * u) * K + b * kBlock;
            int32_t* c = cs[seq & 1];
            if constexpr (kAmx) {
                const bool even = (seq & 1) == 0;
                if (even) tl.zero<0>(), tl.zero<1>();
                else tl.zero<2>(), tl.zero<3>();
                for (int64_t st = 0; st < steps; ++st) {
                    tl.load<6>(b0 + (s0 + st) * 1024, 64), tl.load<7>(b1 + (s0 + st) * 1024, 64);
                    if (even) tl.load<4>(a + st * kStep, K), tl.dot_s8<4, 6>(), tl.dot_s8<4, 7>();
                    else tl.load<5>(a + st * kStep, K), tl.dot_s8<5, 6>(), tl.dot_s8<5, 7>();
                }
                if (even) tl.store<0>(c, 128), tl.store<1>(c + 16, 128);
                else tl.store<2>(c, 128), tl.store<3>(c + 16, 128);
            } else {  // (rows past T are zero codes: their sums are never read)
                std::fill(c, c + 16 * 32, 0);
                for (int64_t st = 0; st < steps; ++st) {
                    soft_dot_s8(a + st * kStep, K, b0 + (s0 + st) * 1024, c);
                    soft_dot_s8(a + st * kStep, K, b1 + (s0 + st) * 1024, c + 16);
                }
            }
            if (seq > 0) fold(last_b, last_u, cs[(seq - 1) & 1]);
            last_b = b, last_u = u;
        }
    }
    fold(last_b, last_u, cs[(seq - 1) & 1]);
    for (int64_t pp = p; pp <= p1; ++pp)
        for (int64_t t = 0; t < rows; ++t)
            finish(acc + t * 32 + 16 * (pp - p), pp * kPanel, scale, bias, out + (t0 + t) * N, N);
}

bool cpu_has_amx_int8() {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    return (d >> 24 & 1u) && (d >> 25 & 1u);  // AMX-TILE, AMX-INT8
}

#if defined(__AVX512VNNI__)
// A step of fewer than kTilesFrom tokens on the vector path in one parallel region: each
// thread quantizes the few rows itself (K x T codes: ~1 us) and runs its share of the panels,
// where a region for the quantization and another for the products woke the team twice a
// projection, 240 times a decode (#16's batch 1 in this mode, the Xeon of #13, round by round
// over bf16: 1.36x before, 1.55x / 1.58x after: -1207d / e / f).
template <typename X>
void short_step(const X* x, int64_t T, int64_t K, const int8_t* w, const float* scale,
                const float* bias, X* out, int64_t N, int64_t n_threads) {
    const int64_t blocks = blocks_of(K), panels = (N + kPanel - 1) / kPanel;
    banyan_team::parallel_team(std::min(panels, n_threads), [&](int tid, int n) {
        thread_local std::vector<int8_t> q;
        thread_local std::vector<float> d;
        thread_local std::vector<int32_t> qs;
        q.resize(T * K), d.resize(T * blocks), qs.resize(T * blocks);
        for (int64_t t = 0; t < T; ++t)
            quantize_row(x + t * K, K, q.data() + t * K, d.data() + t * blocks,
                         qs.data() + t * blocks);
        const banyan_team::Share share(panels, tid, n);
        for (int64_t p = share.begin; p < share.end; ++p)
            for (int64_t t0 = 0; t0 < T; t0 += kVnniRows)
                vnni_panel(q.data(), d.data(), qs.data(), t0, std::min(kVnniRows, T - t0), K,
                           w, p, scale, bias, out, N);
    });
}
#endif

// x [T, K] (float32 or bf16) -> out [T, N] (the same type); K a multiple of 64. fast: 1 AMX's
// tiles where this process may run them (steps of kTilesFrom tokens or more) or else the
// vpdpbusd path, 0 the emulated tiles (the tests' check of the tiles' layout): the same bits.
template <typename X>
void int8_tiles_linear(const X* x, int64_t T, int64_t K, const int8_t* w, const float* scale,
                       const float* bias, X* out, int64_t N, int64_t fast, int64_t n_threads) {
    const int64_t blocks = blocks_of(K), padded = (T + kRows - 1) / kRows * kRows;
    const bool tiles = fast != 0 && amx_granted() && cpu_has_amx_int8();
    const int64_t panels = (N + kPanel - 1) / kPanel, pairs = (panels + 1) / 2;
#if defined(__AVX512VNNI__)
    if (fast != 0 && T < kTilesFrom) {  // (at most a few rows: see short_step)
        short_step(x, T, K, w, scale, bias, out, N, n_threads);
        return;
    }
#endif
    thread_local std::vector<int8_t> q;
    thread_local std::vector<float> d;
    thread_local std::vector<int32_t> qs;
    q.resize(padded * K);
    d.resize(T * blocks);
    qs.resize(T * blocks);
    std::memset(q.data() + T * K, 0, (padded - T) * K);
    int8_t* qp = q.data();
    float* dp = d.data();
    int32_t* qsp = qs.data();
    banyan_team::parallel_for(T, n_threads, [&](int64_t t) {
        quantize_row(x + t * K, K, qp + t * K, dp + t * blocks, qsp + t * blocks);
    });
#if defined(__AVX512VNNI__)
    if (fast != 0 && !tiles) {
        banyan_team::parallel_for(panels, n_threads, [&](int64_t p) {
            for (int64_t t0 = 0; t0 < T; t0 += kVnniRows)
                vnni_panel(qp, dp, qsp, t0, std::min(kVnniRows, T - t0), K, w, p, scale, bias,
                           out, N);
        });
        return;
    }
#endif
    const int threads = static_cast<int>(std::max<int64_t>(1, std::min(pairs, n_threads)));
    banyan_team::parallel_team(threads, [&](int64_t i, int64_t n) {
        const int64_t first = pairs * i / n * 2, last = std::min(panels, pairs * (i + 1) / n * 2);
        AmxTiles tl;
        if (tiles) tl.begin();
        if (tiles && T < 16) tl.shape_rows(static_cast<int>(T));
        for (int64_t p = first; p < last; p += 2)
            for (int64_t t0 = 0; t0 < T; t0 += kRows) {
                const int64_t rows = std::min(kRows, T - t0), p1 = std::min(p + 1, last - 1);
                // (a lone last panel's pair: itself and the next, within the padded panels)
                const int8_t* ahead = t0 == 0 && p + 2 < last ? w + (p + 2) * K * kPanel
                                                              : nullptr;
                if (tiles)
                    panel_pair<true>(tl, qp, dp, K, t0, rows, w, p, p1, scale, bias, out, N,
                                     ahead);
                else
                    panel_pair<false>(tl, qp, dp, K, t0, rows, w, p, p1, scale, bias, out, N,
                                      nullptr);
            }
        if (tiles) tl.end();
    });
}

}  // namespace

extern "C" {

// 3: AMX-INT8's tiles (and the vector path for short steps), 2: the vector path (AVX512-VNNI, no
// AMX-INT8), 1: only the emulated tiles (slow: a warning at start-up)
int64_t banyan_int8_tiles_here() {
#if defined(__AVX512VNNI__)
    return amx_granted() && cpu_has_amx_int8() ? 3 : 2;
#else
    return 1;
#endif
}

void banyan_int8_tiles_linear_f32(const float* x, int64_t T, int64_t K, const int8_t* w,
                                  const float* scale, const float* bias, float* out, int64_t N,
                                  int64_t fast, int64_t n_threads) {
    int8_tiles_linear(x, T, K, w, scale, bias, out, N, fast, n_threads);
}

void banyan_int8_tiles_linear_bf16(const uint16_t* x, int64_t T, int64_t K, const int8_t* w,
                                   const float* scale, const float* bias, uint16_t* out,
                                   int64_t N, int64_t fast, int64_t n_threads) {
    int8_tiles_linear(x, T, K, w, scale, bias, out, N, fast, n_threads);
}

// The activation quantization alone (for the tests): q [T, K] int8, d [T, blocks] float32.
void banyan_int8_tiles_quantize_f32(const float* x, int64_t T, int64_t K, int8_t* q, float* d) {
    std::vector<int32_t> qs(blocks_of(K));
    for (int64_t t = 0; t < T; ++t)
        quantize_row(x + t * K, K, q + t * K, d + t * qs.size(), qs.data());
}

}  // extern "C"

#else  // no AMX tile code or no AVX-512 here: the mode is refused at start-up (0)

#include <cstdlib>

extern "C" {
int64_t banyan_int8_tiles_here() { return 0; }
// (the layer stack links these; no layer of this kind exists where here() is 0)
void banyan_int8_tiles_linear_f32(const float*, int64_t, int64_t, const int8_t*, const float*,
                                  const float*, float*, int64_t, int64_t, int64_t) {
    std::abort();
}
void banyan_int8_tiles_linear_bf16(const uint16_t*, int64_t, int64_t, const int8_t*,
                                   const float*, const float*, uint16_t*, int64_t, int64_t,
                                   int64_t) {
    std::abort();
}
}

#endif
