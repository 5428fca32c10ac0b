// A draft model's guess from approximate logits (its LM head's 4-bit copy, spec/draft_head.py):
// per row, the largest approximate logit's neighbours (those within `margin` of it, the
// `max_candidates` largest if more) recomputed exactly from the head's rows, the best of them
// taken (the lowest id on a tie), and the probability the draft gives it: its exact logit's
// softmax over the approximate logits, the candidates' own replaced by their exact values.
//
// Why one call: in Python the same steps (topk, a gather, a batched product, a scatter, then
// numpy's argmax and exp-sum over 49,152 logits) took ~0.45 ms of a ~4.7 ms draft forward on
// Zen 4, as much as the bytes the 4-bit copy saves. Here: one pass for the maximum, one for the
// exp-sum and the candidates, a dot product per candidate.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "cpu_avx512.h"
#include "cpu_dtypes.h"

namespace {

float row_max(const uint16_t* a, int64_t n) {
    float m = -INFINITY;
    int64_t v = 0;
#if defined(__AVX512F__)
    __m512 mv = _mm512_set1_ps(-INFINITY);
    for (; v + 16 <= n; v += 16) mv = _mm512_max_ps(mv, load16(a + v));
    m = _mm512_reduce_max_ps(mv);
#endif
    for (; v < n; ++v) m = std::max(m, bf16_to_f32(a[v]));
    return m;
}

// sum_v exp(a[v] - m); the ids with a[v] >= floor into `found`
float exp_sum_and_near(const uint16_t* a, int64_t n, float m, float floor,
                       std::vector<std::pair<float, int64_t>>& found) {
    float s = 0.0f;
    int64_t v = 0;
#if defined(__AVX512F__)
    const __m512 mv = _mm512_set1_ps(m), fv = _mm512_set1_ps(floor);
    __m512 sv = _mm512_setzero_ps();
    for (; v + 16 <= n; v += 16) {
        const __m512 x = load16(a + v);
        sv = _mm512_add_ps(sv, exp512(_mm512_sub_ps(x, mv)));
        __mmask16 near = _mm512_cmp_ps_mask(x, fv, _CMP_GE_OQ);
        while (near) {  // rare: a few ids of the 49,152
            const int lane = __builtin_ctz(near);
            near &= near - 1;
            found.emplace_back(bf16_to_f32(a[v + lane]), v + lane);
        }
    }
    s = _mm512_reduce_add_ps(sv);
#endif
    for (; v < n; ++v) {
        const float x = bf16_to_f32(a[v]);
        s += exp_clamped(x - m);
        if (x >= floor) found.emplace_back(x, v);
    }
    return s;
}

float dot(const uint16_t* w, const uint16_t* x, int64_t k) {
    float s = 0.0f;
    for (int64_t i = 0; i < k; ++i) s += bf16_to_f32(w[i]) * bf16_to_f32(x[i]);
    return s;
}

}  // namespace

extern "C" {

// approx [T, V] and x [T, K] bf16; rows [V, K] bf16 (the head's values); out: token [T] int64,
// prob [T] float32.
void banyan_draft_pick(const uint16_t* approx, int64_t T, int64_t V, const uint16_t* x,
                       int64_t K, const uint16_t* rows, int64_t max_candidates, float margin,
                       int64_t* token, float* prob) {
    std::vector<std::pair<float, int64_t>> found;
    for (int64_t t = 0; t < T; ++t) {
        const uint16_t* a = approx + t * V;
        const uint16_t* xt = x + t * K;
        const float m = row_max(a, V);
        found.clear();
        float s = exp_sum_and_near(a, V, m, m - margin, found);
        if (static_cast<int64_t>(found.size()) > max_candidates) {
            std::nth_element(found.begin(), found.begin() + max_candidates, found.end(),
                             [](const auto& p, const auto& q) { return p.first > q.first; });
            found.resize(max_candidates);
        }
        int64_t best = -1;
        float best_logit = -INFINITY;
        for (const auto& [near, id] : found) {
            const float exact = dot(rows + id * K, xt, K);
            s += exp_clamped(exact - m) - exp_clamped(near - m);
            if (exact > best_logit || (exact == best_logit && id < best)) {
                best = id;
                best_logit = exact;
            }
        }
        token[t] = best;
        prob[t] = exp_clamped(best_logit - m) / std::max(s, 1e-30f);
    }
}

}  // extern "C"
