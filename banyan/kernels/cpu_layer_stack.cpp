// A whole float32 decoder-layer stack in one call, for steps of a few tokens (decodes, small
// batches): for each layer, add + RMSNorm, the qkv projection, RoPE (with Qwen3's q/k norms),
// the K/V stored into the pool (float32, or int8 codes with scales), paged attention, the o projection, add + RMSNorm, gate/up,
// SiLU-and-mul, down; then the final add + RMSNorm.
//
// Why: at one token the kernels themselves take ~half of a step; the rest was Python dispatch
// around them (~40 calls a layer, each allocating its output and checking its inputs). This
// calls the very same kernels (the other files of this library), in the same order, with the
// same thread count, so the values are bit for bit those of the per-op path; only the glue
// moved here. Each projection names its kernel (StackLinear::kind), set by its LinearMethod.
//
// The structs below are mirrored by ctypes (banyan/models/native_stack.py): 8-byte fields only.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_paged_attention.h"

extern "C" {
void banyan_add_rms_norm_f32(float* residual, const float* add, const float* w, float* out,
                             int64_t rows, int64_t n, float eps, int64_t n_threads);
void banyan_silu_and_mul_f32(const float* gate_up, float* out, int64_t rows, int64_t n,
                             int64_t n_threads);
void banyan_rope_qk_f32(const float* qkv, int64_t stride, const float* cos, const float* sin,
                        const float* q_norm, const float* k_norm, float eps, float* q_out,
                        float* k_out, int64_t rows, int64_t heads, int64_t kvh, int64_t d,
                        int64_t n_threads);
BANYAN_PAGED_ATTENTION_SIGNATURE(banyan_paged_attention_f32_f32, float, float);
BANYAN_PAGED_ATTENTION_SIGNATURE(banyan_paged_attention_f32_int8, float, int8_t);
void banyan_skinny_linear_f32(const float* x, int64_t T, int64_t K, const float* w,
                              const float* bias, float* out, int64_t N, int64_t n_threads);
void banyan_int8_linear_f32(const float* x, int64_t T, int64_t K, const int8_t* w,
                            const float* scale, const float* bias, float* out, int64_t N,
                            int64_t n_threads);
void banyan_int4_linear_f32(const float* x, int64_t T, int64_t K, int64_t group,
                            const uint8_t* w, const uint16_t* scale, const uint16_t* mins,
                            const float* bias, float* out, int64_t N, float* xsum,
                            int64_t n_threads);
void banyan_int4s_linear_f32(const float* x, int64_t T, int64_t K, int64_t group,
                             const uint8_t* w, const float* scale, const float* mins,
                             const float* bias, float* out, int64_t N, float* xsum,
                             int64_t n_threads);
void banyan_int8g_linear_f32(const float* x, int64_t T, int64_t K, int64_t group,
                             const int8_t* w, const float* scale, const float* bias, float* out,
                             int64_t N, int64_t n_threads);
void banyan_q8_int4_linear_f32(const float* x, int64_t T, int64_t K, int64_t group,
                               const uint8_t* w, const uint16_t* scale, const uint16_t* mins,
                               const float* bias, float* out, int64_t N, int64_t n_threads);
void banyan_q8_int4s_linear_f32(const float* x, int64_t T, int64_t K, int64_t group,
                                const uint8_t* w, const float* scale, const float* mins,
                                const float* bias, float* out, int64_t N, int64_t n_threads);
void banyan_q8_int8_linear_f32(const float* x, int64_t T, int64_t K, int64_t group,
                               const int8_t* w, const float* scale, const float* bias,
                               float* out, int64_t N, int64_t n_threads);
void banyan_q8_int5_linear_f32(const float* x, int64_t T, int64_t K, const uint8_t* w,
                               const uint16_t* scale, const uint16_t* mins, const float* bias,
                               float* out, int64_t N, int64_t n_threads);
}

namespace {

// Which kernel a projection runs (banyan/models/native_stack.py: LINEAR_KINDS).
enum LinearKind : int64_t {
    kSkinnyF32 = 0,  // plain [N, K] float32 weight
    kInt8Rows = 1,   // int8, a scale per output row
    kInt4 = 2,       // int4, float16 scale and minimum per group
    kInt4Wide = 3,   // int4, float32 scale and minimum per group (GGUF K-quants)
    kInt8Groups = 4,  // int8, a float32 scale per group (GGUF Q8_0 / Q5_0 / Q6_K)
    // the same weights with 8-bit activations (--activation-quant int8, cpu_int8act_linear.cpp)
    kQ8Int4 = 5,
    kQ8Int4Wide = 6,
    kQ8Int8 = 7,  // int8 per group or per row (group = K)
    kQ8Int5 = 8   // GGUF Q5_0 as 5-bit codes
};

struct StackLinear {
    int64_t kind;
    const void* weight;  // the packed codes (or the float32 weight)
    const void* scale;
    const void* mins;
    const float* bias;  // or null
    int64_t in, out, group;
};

struct StackLayer {
    const float* input_norm;
    const float* post_norm;
    const float* q_norm;  // Qwen3's per-head norms, or null
    const float* k_norm;
    StackLinear qkv, o, gate_up, down;
    void* k_pool;  // this layer's [slots, KVH, D]: float32, or int8 codes with scales
    void* v_pool;
    float* k_scale;  // [slots, KVH] for an int8 pool, else null
    float* v_scale;
};

struct StackModel {
    int64_t layers, hidden, heads, kv_heads, head_dim, intermediate;
    double eps, scale;  // RMSNorm epsilon, attention softmax scale
    const StackLayer* layer;
    const float* final_norm;
};

// One step: T tokens, the attention plan of the native backend (native_plan.py) covering all.
struct StackStep {
    int64_t tokens;
    float* hidden;  // in: the embeddings [T, hidden]; used as the residual stream (clobbered)
    float* out;     // the final-normed hidden states [T, hidden]
    const float* cos;
    const float* sin;  // [T, D / 2]
    const int64_t* slots;  // [T] where each token's K/V goes
    const int32_t* table;
    int64_t table_stride;
    const int64_t* req_row;
    const int64_t* req_len;
    const int64_t* q_start;
    const int64_t* n_new;
    const int64_t* order;
    const int64_t* group_start;
    const int64_t* group_prefix;
    int64_t n_groups;
    int64_t n_threads;
};

void linear(const StackLinear& l, const float* x, int64_t T, float* out, float* xsum,
            int64_t n_threads) {
    switch (l.kind) {
        case kSkinnyF32:
            banyan_skinny_linear_f32(x, T, l.in, static_cast<const float*>(l.weight), l.bias,
                                     out, l.out, n_threads);
            break;
        case kInt8Rows:
            banyan_int8_linear_f32(x, T, l.in, static_cast<const int8_t*>(l.weight),
                                   static_cast<const float*>(l.scale), l.bias, out, l.out,
                                   n_threads);
            break;
        case kInt4:
            banyan_int4_linear_f32(x, T, l.in, l.group, static_cast<const uint8_t*>(l.weight),
                                   static_cast<const uint16_t*>(l.scale),
                                   static_cast<const uint16_t*>(l.mins), l.bias, out, l.out,
                                   xsum, n_threads);
            break;
        case kInt4Wide:
            banyan_int4s_linear_f32(x, T, l.in, l.group, static_cast<const uint8_t*>(l.weight),
                                    static_cast<const float*>(l.scale),
                                    static_cast<const float*>(l.mins), l.bias, out, l.out,
                                    xsum, n_threads);
            break;
        case kQ8Int4:
            banyan_q8_int4_linear_f32(x, T, l.in, l.group, static_cast<const uint8_t*>(l.weight),
                                      static_cast<const uint16_t*>(l.scale),
                                      static_cast<const uint16_t*>(l.mins), l.bias, out, l.out,
                                      n_threads);
            break;
        case kQ8Int4Wide:
            banyan_q8_int4s_linear_f32(x, T, l.in, l.group,
                                       static_cast<const uint8_t*>(l.weight),
                                       static_cast<const float*>(l.scale),
                                       static_cast<const float*>(l.mins), l.bias, out, l.out,
                                       n_threads);
            break;
        case kQ8Int8:
            banyan_q8_int8_linear_f32(x, T, l.in, l.group, static_cast<const int8_t*>(l.weight),
                                      static_cast<const float*>(l.scale), l.bias, out, l.out,
                                      n_threads);
            break;
        case kQ8Int5:
            banyan_q8_int5_linear_f32(x, T, l.in, static_cast<const uint8_t*>(l.weight),
                                      static_cast<const uint16_t*>(l.scale),
                                      static_cast<const uint16_t*>(l.mins), l.bias, out, l.out,
                                      n_threads);
            break;
        default:
            banyan_int8g_linear_f32(x, T, l.in, l.group, static_cast<const int8_t*>(l.weight),
                                    static_cast<const float*>(l.scale), l.bias, out, l.out,
                                    n_threads);
            break;
    }
}

// One token's K (or V) rows into the pool: float32 as they are, or int8 codes with a scale
// per (slot, head) row exactly as kv_pool.quantize_rows makes them (scale = the row's largest
// magnitude, at least 1e-30, over 127; codes = x / scale rounded half to even, clamped), so the
// pool holds what the per-op path would have stored, bit for bit.
void store_row(const float* x, int64_t slot, int64_t kvh, int64_t d, void* pool, float* scales) {
    if (scales == nullptr) {
        std::memcpy(static_cast<float*>(pool) + slot * kvh * d, x, kvh * d * sizeof(float));
        return;
    }
    for (int64_t h = 0; h < kvh; ++h) {
        const float* xh = x + h * d;
        float top = 0.0f;
        for (int64_t e = 0; e < d; ++e) top = std::max(top, std::fabs(xh[e]));
        const float scale = std::max(top, 1e-30f) / 127.0f;
        int8_t* codes = static_cast<int8_t*>(pool) + (slot * kvh + h) * d;
        for (int64_t e = 0; e < d; ++e)
            codes[e] = static_cast<int8_t>(
                std::min(127.0f, std::max(-127.0f, std::nearbyint(xh[e] / scale))));
        scales[slot * kvh + h] = scale;
    }
}

// Scratch of one step, kept per thread between calls (a decode step's few KiB are reused).
struct Scratch {
    std::vector<float> x, qkv, q, k, attn, a, gate_up, act, mlp, xsum;
};

}  // namespace

extern "C" void banyan_layer_stack_f32(const StackModel* m, const StackStep* s) {
    const int64_t T = s->tokens, H = m->hidden, D = m->head_dim;
    const int64_t q_size = m->heads * D, kv_size = m->kv_heads * D;
    const int64_t qkv_n = q_size + 2 * kv_size, nt = s->n_threads;
    const float eps = static_cast<float>(m->eps);
    static thread_local Scratch b;
    b.x.resize(T * H);
    b.qkv.resize(T * qkv_n);
    b.q.resize(T * q_size);
    b.k.resize(T * kv_size);
    b.attn.resize(T * q_size);
    b.a.resize(T * H);
    b.gate_up.resize(T * 2 * m->intermediate);
    b.act.resize(T * m->intermediate);
    b.mlp.resize(T * H);
    b.xsum.resize(T * (std::max(H, m->intermediate) / 16 + 1));  // int4 group sums (group >= 16)
    float* stream = s->hidden;
    for (int64_t i = 0; i < m->layers; ++i) {
        const StackLayer& L = m->layer[i];
        // the first layer's stream is the embeddings themselves (nothing to add yet)
        banyan_add_rms_norm_f32(stream, i == 0 ? nullptr : b.mlp.data(), L.input_norm,
                                b.x.data(), T, H, eps, nt);
        linear(L.qkv, b.x.data(), T, b.qkv.data(), b.xsum.data(), nt);
        banyan_rope_qk_f32(b.qkv.data(), qkv_n, s->cos, s->sin, L.q_norm, L.k_norm, eps,
                           b.q.data(), b.k.data(), T, m->heads, m->kv_heads, D, nt);
        for (int64_t t = 0; t < T; ++t) {  // rotated k and the untouched v into the pool
            store_row(b.k.data() + t * kv_size, s->slots[t], m->kv_heads, D, L.k_pool,
                      L.k_scale);
            store_row(b.qkv.data() + t * qkv_n + q_size + kv_size, s->slots[t], m->kv_heads, D,
                      L.v_pool, L.v_scale);
        }
        const float sm = static_cast<float>(m->scale);
        if (L.k_scale == nullptr)
            banyan_paged_attention_f32_f32(
                b.q.data(), static_cast<const float*>(L.k_pool),
                static_cast<const float*>(L.v_pool), nullptr, nullptr, s->table,
                s->table_stride, s->req_row, s->req_len, s->q_start, s->n_new, s->order,
                s->group_start, s->group_prefix, s->n_groups, b.attn.data(), m->heads,
                m->kv_heads, D, sm, nt);
        else
            banyan_paged_attention_f32_int8(
                b.q.data(), static_cast<const int8_t*>(L.k_pool),
                static_cast<const int8_t*>(L.v_pool), L.k_scale, L.v_scale, s->table,
                s->table_stride, s->req_row, s->req_len, s->q_start, s->n_new, s->order,
                s->group_start, s->group_prefix, s->n_groups, b.attn.data(), m->heads,
                m->kv_heads, D, sm, nt);
        linear(L.o, b.attn.data(), T, b.a.data(), b.xsum.data(), nt);
        banyan_add_rms_norm_f32(stream, b.a.data(), L.post_norm, b.x.data(), T, H, eps, nt);
        linear(L.gate_up, b.x.data(), T, b.gate_up.data(), b.xsum.data(), nt);
        banyan_silu_and_mul_f32(b.gate_up.data(), b.act.data(), T, m->intermediate, nt);
        linear(L.down, b.act.data(), T, b.mlp.data(), b.xsum.data(), nt);
    }
    banyan_add_rms_norm_f32(stream, m->layers ? b.mlp.data() : nullptr, m->final_norm, s->out,
                            T, H, eps, nt);
}
