// A greedy token from a bf16 LM head stored in the GEMM's pairs, reading about half its bytes:
// an int8 copy of the head (a scale per 32 inputs) gives every logit approximately, a bound
// proves which rows cannot be the argmax, and only the panels of the rest are computed exactly,
// by the same kernel and with the same bits as the whole head. The token is the whole head's.
//
// The bound, per row j (z_j: the exact kernel's float32 logit, y_j: the copy's):
//   |z_j - y_j| <= ||x|| (||w_j - w'_j|| + 2 (K + K / 32) 2^-24 (||w_j|| + ||w'_j||))
// Cauchy-Schwarz on the copy's rounding, and both kernels' float32 sums (each within
// (K + groups) 2^-24 sum |x_k w_k| of the real product); `slack` holds the bracket per row,
// rounded up (native_stack.py). L, the largest y_j - bound_j, is below the true maximum; a row
// whose y_j + bound_j falls a bf16 ulp of |L| (doubled) short of L cannot reach the maximum even
// after the logits' rounding to bf16, so the first maximal row is among the candidates.
// Anything unexpected (a non-finite input or logit, more candidates than kMaxPanels panels)
// returns -1 and the caller computes the whole head.
//
// Why: at one token the head is the largest single read of a bf16 step (SmolLM2: 56.6 MB of
// 270); its int8 copy is 31.6 MB (benchmarks/head_screen_bound.py: 1-5 candidates of 49,152).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_dtypes.h"
#include "cpu_quant_common.h"
#include "cpu_stack_api.h"

namespace {

constexpr int64_t kMaxPanels = 8;  // panels worth recomputing; more: the whole head

// A bf16 ulp of values up to twice |v|: the most rounding can move a logit near v, doubled.
float bf16_margin(float v) {
    int e = 0;
    std::frexp(std::max(std::fabs(v), 1e-30f), &e);  // |v| = m 2^e, m in [0.5, 1)
    return std::ldexp(1.0f, e + 1 - 8);  // 8 significant bits
}

}  // namespace

extern "C" {

// x: one bf16 row [K]; pairs: the head [ceil(N / 16), K / 2, 16] of bf16 pairs, no bias, which
// banyan_quant_gemm_bf16 reads as `kind`; codes, scale: the int8 copy as GroupInt8Method keeps
// it (a scale per `group` inputs); slack [N]; the argmax over the first `vocab` rows (numpy's:
// the first of equal maxima), or -1.
int64_t banyan_head_screen_bf16(const uint16_t* x, int64_t K, const int32_t* pairs,
                                int64_t kind, const int8_t* codes, const float* scale,
                                int64_t group, const float* slack, int64_t N, int64_t vocab,
                                int64_t n_threads) {
    static thread_local std::vector<float> wide, approx;
    wide.resize(K);
    approx.resize(N);
    double norm2 = 0.0;
    for (int64_t k = 0; k < K; ++k) {
        wide[k] = bf16_to_f32(x[k]);
        norm2 += static_cast<double>(wide[k]) * wide[k];
    }
    const float norm = static_cast<float>(std::sqrt(norm2) * (1.0 + 1e-6));
    if (!std::isfinite(norm)) return -1;
    banyan_int8g_linear_f32(wide.data(), 1, K, group, codes, scale, nullptr, approx.data(), N,
                            n_threads);
    float low = -INFINITY;
    bool finite = true;
    for (int64_t j = 0; j < vocab; ++j) {
        finite = finite && std::isfinite(approx[j]);
        low = std::max(low, approx[j] - norm * slack[j]);
    }
    if (!finite || !std::isfinite(low)) return -1;
    const float floor = low - bf16_margin(low);
    int64_t panels[kMaxPanels];
    int64_t count = 0;
    for (int64_t j = 0; j < vocab; ++j) {
        if (approx[j] + norm * slack[j] < floor) continue;
        const int64_t p = j / PANEL;
        if (count > 0 && panels[count - 1] == p) continue;
        if (count == kMaxPanels) return -1;
        panels[count++] = p;
    }
    int64_t best = -1;
    float best_logit = 0.0f;
    for (int64_t i = 0; i < count; ++i) {  // in row order: a tie keeps the first
        alignas(64) uint16_t exact[PANEL];
        banyan_quant_gemm_bf16(x, 1, K, kind, pairs + panels[i] * (K / 2) * PANEL, nullptr,
                               nullptr, 0, nullptr, exact, PANEL, 1);
        for (int64_t r = 0; r < PANEL && panels[i] * PANEL + r < vocab; ++r) {
            const float v = bf16_to_f32(exact[r]);
            if (std::isnan(v)) return -1;
            if (best < 0 || v > best_logit) {
                best = panels[i] * PANEL + r;
                best_logit = v;
            }
        }
    }
    return best;
}

}  // extern "C"
