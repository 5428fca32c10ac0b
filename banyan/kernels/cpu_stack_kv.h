// How the layer stack (cpu_layer_stack.cpp) stores a token's K and V rows into the pool: as
// they are, or as int8 / fp8 codes with a float32 scale per (slot, KV head) row, each exactly
// as mem/kv_pool.py's store makes them from the same values (a bf16 row widened to float32 as
// its `x.float()` does), so the pool holds what the per-op path would have stored, bit for bit;
// and which of a layer's K/V rows a step will read (KvAhead).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_dtypes.h"
#include "cpu_stack_api.h"
#include "cpu_team.h"

namespace {

// The pool's storage (StackModel::kv_codes; native_stack.py: KV_CODES).
enum KvCodes : int64_t { kKvPlain = 0, kKvInt8 = 1, kKvE4M3 = 2, kKvE5M2 = 3 };

// A quantized pool's rule: its codes, and for fp8 the scale shifts tried (FP8_SCALE_SHIFTS).
struct KvStore {
    int64_t codes;
    const float* shifts;
    int64_t n_shifts;
};

// The kvh rows of d values at x into slot `slot` of pool (and its scales).
template <typename T>
void store_row(const T* x, int64_t slot, int64_t kvh, int64_t d, void* pool, float* scales,
               const KvStore& how) {
    const int64_t at = slot * kvh * d;
    if (how.codes == kKvPlain) {
        std::memcpy(static_cast<T*>(pool) + at, x, kvh * d * sizeof(T));
        return;
    }
    const float* xf;
    thread_local std::vector<float> wide;
    if constexpr (std::is_same<T, float>::value) {
        xf = x;
    } else {  // bf16: widened, exactly
        wide.resize(kvh * d);
        for (int64_t e = 0; e < kvh * d; ++e) wide[e] = bf16_to_f32(x[e]);
        xf = wide.data();
    }
    float* row_scales = scales != nullptr ? scales + slot * kvh : nullptr;  // null: fp8's unit
    if (how.codes == kKvE4M3 || how.codes == kKvE5M2) {  // (one thread: a few rows)
        auto* codes = static_cast<uint8_t*>(pool) + at;
        (how.codes == kKvE4M3 ? banyan_fp8_quantize_rows_e4m3 : banyan_fp8_quantize_rows_e5m2)(
            xf, kvh, d, how.shifts, how.n_shifts, codes, row_scales, 1);
        return;
    }
    // int8: scale = the row's largest magnitude (at least 1e-30) over 127; codes = x / scale
    // rounded half to even, clamped
    for (int64_t h = 0; h < kvh; ++h) {
        const float* xh = xf + h * d;
        float top = 0.0f;
        for (int64_t e = 0; e < d; ++e) top = std::max(top, std::fabs(xh[e]));
        const float scale = std::max(top, 1e-30f) / 127.0f;
        int8_t* codes = static_cast<int8_t*>(pool) + at + h * d;
        for (int64_t e = 0; e < d; ++e)
            codes[e] = static_cast<int8_t>(
                std::min(127.0f, std::max(-127.0f, std::nearbyint(xh[e] / scale))));
        row_scales[h] = scale;
    }
}

// A one-token step's cached K/V (all but its new token's) of a layer, for the layer stack to
// fetch during the layer before (banyan_team::SideReads); none where K and V together pass
// kSideBytes (each core fetches them all: more would evict what they lead; SmolLM2 over 341
// keys of a bf16 pool fills it). Only one token: steps of 4 and 13 (speculative checks over
// 192 keys, Zen 4) ran 1.3-1.4% slower with them, their attention a smaller share.
class KvAhead {
  public:
    static constexpr int64_t kSideBytes = 256 << 10;

    // slot_bytes: a slot's K (or V) bytes in the pool, its KV heads' rows of codes or values
    template <typename Step>  // (StackStep)
    KvAhead(const Step* s, int64_t slot_bytes, int64_t kvh) : slot_bytes_(slot_bytes), kvh_(kvh) {
        if (s->tokens != 1 || s->n_groups == 0) return;
        const int64_t* first = s->order + s->group_start[0];
        const int64_t* last = s->order + s->group_start[s->n_groups];
        int64_t total = 0;
        for (const int64_t* r = first; r < last; ++r) total += s->req_len[*r] - s->n_new[*r];
        if (2 * total * slot_bytes > kSideBytes) return;
        for (const int64_t* r = first; r < last; ++r) {  // runs of consecutive slots
            const int32_t* slots = s->table + s->req_row[*r] * s->table_stride;
            for (int64_t j = 0; j < s->req_len[*r] - s->n_new[*r]; ++j) {
                if (!runs_.empty() && runs_.back().first + runs_.back().count == slots[j])
                    ++runs_.back().count;
                else
                    runs_.push_back(Run{slots[j], 1});
            }
        }
    }

    // Layer L's K and V (and their scales) at those slots, or null where there are none.
    template <typename Layer>  // (StackLayer)
    const banyan_team::SideReads* of(const Layer& L) {
        if (runs_.empty()) return nullptr;
        reads_.clear();
        const int64_t scale_bytes = kvh_ * int64_t{sizeof(float)};
        for (const Run& run : runs_) {
            reads_.add(static_cast<const char*>(L.k_pool) + run.first * slot_bytes_,
                       run.count * slot_bytes_);
            reads_.add(static_cast<const char*>(L.v_pool) + run.first * slot_bytes_,
                       run.count * slot_bytes_);
            if (L.k_scale == nullptr) continue;
            reads_.add(L.k_scale + run.first * kvh_, run.count * scale_bytes);
            reads_.add(L.v_scale + run.first * kvh_, run.count * scale_bytes);
        }
        return &reads_;
    }

  private:
    struct Run {
        int64_t first, count;
    };
    int64_t slot_bytes_, kvh_;
    std::vector<Run> runs_;
    banyan_team::SideReads reads_;
};

}  // namespace
