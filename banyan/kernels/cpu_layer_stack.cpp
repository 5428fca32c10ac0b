// A whole decoder-layer stack in one call, for steps of a few tokens (decodes, small batches):
// the tokens' embedding rows and their positions' cos / sin rows gathered; for each layer, add
// + RMSNorm, the qkv projection, RoPE (with Qwen3's q/k norms), the K/V stored into the pool
// (as they are, or int8 / fp8 codes with scales), paged attention, the o projection, add +
// RMSNorm, gate/up, SiLU-and-mul, down; then the final add + RMSNorm. In float32 (any
// projection kernel), or in bf16 (the skinny bf16 kernel, or any float32 projection kernel
// between a widened copy of its input and a rounded copy of its output).
//
// Why: at one token the kernels themselves take ~half of a step; the rest was Python dispatch
// around them (~40 calls a layer, each allocating its output and checking its inputs). This
// calls the very same kernels (the other files of this library), in the same order, with the
// same thread count, so the values are bit for bit those of the per-op path; only the glue
// moved here. Each projection names its kernel (StackLinear::kind), set by its LinearMethod.
//
// The structs below are mirrored by ctypes (banyan/models/native_stack.py): 8-byte fields only.

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_dtypes.h"
#include "cpu_int4_api.h"
#include "cpu_paged_attention.h"
#include "cpu_stack_api.h"
#include "cpu_stack_kv.h"
#include "cpu_team.h"

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
    kQ8Int5 = 8,  // GGUF Q5_0 as 5-bit codes
    kSkinnyBf16 = 9,  // plain [N, K] bf16 weight (bf16 stacks only)
    kPairsBf16 = 10,  // bf16 weight in the GEMM's pairs: every step through the GEMM (gemm_from 1)
    kQ8Tiles = 11     // int8 per row x int8 activations on int8 tiles (cpu_int8_tiles.cpp)
};

struct StackLinear {
    int64_t kind;
    const void* weight;  // the packed codes (or the float32 weight)
    const void* scale;
    const void* mins;
    const void* bias;  // or null; float32 (bf16 for kSkinnyBf16)
    int64_t in, out, group;
    // bf16 stacks: steps of gemm_from tokens or more run the bf16 GEMM (cpu_quant_gemm_bf16.cpp)
    // with this kind, as the per-op path does (layers/quant.py decides both); -1: never
    int64_t gemm, gemm_from;
};

// Norm weights, embeddings, the RoPE tables and the stream are of the stack's element type.
struct StackLayer {
    const void* input_norm;
    const void* post_norm;
    const void* q_norm;  // Qwen3's per-head norms, or null
    const void* k_norm;
    StackLinear qkv, o, gate_up, down;
    void* k_pool;  // this layer's [slots, KVH, D]: of the element type, or codes with scales
    void* v_pool;
    float* k_scale;  // [slots, KVH] for a quantized pool, else null
    float* v_scale;
};

struct StackModel {
    int64_t layers, hidden, heads, kv_heads, head_dim, intermediate;
    double eps, scale;  // RMSNorm epsilon, attention softmax scale
    const StackLayer* layer;
    const void* final_norm;
    const void* embed;  // [vocab, hidden]: the step's tokens' rows are its stream
    // cos / sin of positions 0 .. rope_rows - 1 [rope_rows, D / 2], made by the model's own
    // rotary embedding (bit for bit what it gives a step; native_stack.py grows them)
    const void *rope_cos, *rope_sin;
    int64_t rope_rows;
    StackLinear head;  // the LM head (weight null: none runs here)
    // a bf16 head in pairs: its int8 copy and bounds for one-token greedy steps
    // (cpu_head_screen.cpp; null: none), and [2] counts of steps screened / fallen back
    const int8_t* screen_codes;
    const float *screen_scale, *screen_slack;
    int64_t screen_group;
    int64_t* screen_counts;
    KvStore kv;  // the pool's storage (cpu_stack_kv.h)
};

// One step: T tokens, the attention plan of the native backend (native_plan.py) covering all.
struct StackStep {
    int64_t tokens;
    const int64_t* input_ids;  // [T]
    const int64_t* positions;  // [T]
    void* out;                 // the final-normed hidden states [T, hidden]
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
    int64_t n_groups;  // 0: no request on the row kernel
    int64_t n_threads;
    // the prefill kernel's requests (longer chunks; PrefillPlan), each int64 [pf_reqs]
    const int64_t* pf_req_row;
    const int64_t* pf_req_len;
    const int64_t* pf_q_start;
    const int64_t* pf_n_new;
    int64_t pf_reqs;  // 0: none
    int64_t pf_tiles;  // their products (bf16 over bf16): 0 vector, 1 tiles emulated, 2 AMX's
    double* op_seconds;  // null, or [kStackOps]: each kind of op's seconds added (OpClock)
    // null, or [T]: each token's greedy next token (the LM head over every token's final
    // hidden state, then each row's argmax over its first `vocab` logits)
    int64_t* greedy_out;
    int64_t vocab;
};

// Where a step's time goes inside the one call, by kind of op (native_stack.py: STACK_OPS, in
// this order), for the profile: torch.profiler sees only the call. No clock is read unless the
// caller passes op_seconds.
enum StackOp : int {
    kOpNorm, kOpQkv, kOpRope, kOpKvStore, kOpAttention, kOpO, kOpGateUp, kOpSilu, kOpDown,
    kOpHead, kStackOps
};

struct OpClock {
    double* sums;
    std::chrono::steady_clock::time_point last;
    explicit OpClock(double* op_seconds) : sums(op_seconds) {
        if (sums) last = std::chrono::steady_clock::now();
    }
    void lap(StackOp op) {  // the time since the last lap is op's
        if (!sums) return;
        const auto now = std::chrono::steady_clock::now();
        sums[op] += std::chrono::duration<double>(now - last).count();
        last = now;
    }
};

void linear(const StackLinear& l, const float* x, int64_t T, float* out, float* xsum,
            int64_t n_threads) {
    const float* bias = static_cast<const float*>(l.bias);
    switch (l.kind) {
        case kSkinnyF32:
            banyan_skinny_linear_f32(x, T, l.in, static_cast<const float*>(l.weight), bias,
                                     out, l.out, n_threads);
            break;
        case kInt8Rows:
            banyan_int8_linear_f32(x, T, l.in, static_cast<const int8_t*>(l.weight),
                                   static_cast<const float*>(l.scale), bias, out, l.out,
                                   n_threads);
            break;
        case kInt4:
            banyan_int4_linear_f32(x, T, l.in, l.group, static_cast<const uint8_t*>(l.weight),
                                   static_cast<const uint16_t*>(l.scale),
                                   static_cast<const uint16_t*>(l.mins), bias, out, l.out,
                                   xsum, n_threads);
            break;
        case kInt4Wide:
            banyan_int4s_linear_f32(x, T, l.in, l.group, static_cast<const uint8_t*>(l.weight),
                                    static_cast<const float*>(l.scale),
                                    static_cast<const float*>(l.mins), bias, out, l.out,
                                    xsum, n_threads);
            break;
        case kQ8Int4:
            banyan_q8_int4_linear_f32(x, T, l.in, l.group, static_cast<const uint8_t*>(l.weight),
                                      static_cast<const uint16_t*>(l.scale),
                                      static_cast<const uint16_t*>(l.mins), bias, out, l.out,
                                      n_threads);
            break;
        case kQ8Int4Wide:
            banyan_q8_int4s_linear_f32(x, T, l.in, l.group,
                                       static_cast<const uint8_t*>(l.weight),
                                       static_cast<const float*>(l.scale),
                                       static_cast<const float*>(l.mins), bias, out, l.out,
                                       n_threads);
            break;
        case kQ8Int8:
            banyan_q8_int8_linear_f32(x, T, l.in, l.group, static_cast<const int8_t*>(l.weight),
                                      static_cast<const float*>(l.scale), bias, out, l.out,
                                      n_threads);
            break;
        case kQ8Int5:
            banyan_q8_int5_linear_f32(x, T, l.in, static_cast<const uint8_t*>(l.weight),
                                      static_cast<const uint16_t*>(l.scale),
                                      static_cast<const uint16_t*>(l.mins), bias, out, l.out,
                                      n_threads);
            break;
        case kQ8Tiles:
            banyan_int8_tiles_linear_f32(x, T, l.in, static_cast<const int8_t*>(l.weight),
                                         static_cast<const float*>(l.scale), bias, out, l.out,
                                         1, n_threads);
            break;
        default:
            banyan_int8g_linear_f32(x, T, l.in, l.group, static_cast<const int8_t*>(l.weight),
                                    static_cast<const float*>(l.scale), bias, out, l.out,
                                    n_threads);
            break;
    }
}

// In the bf16 stack: long steps through the bf16 GEMM where the per-op path takes it; else the
// skinny bf16 kernel on a plain bf16 weight, the 8-bit-activation kernels' bf16 entry, int4 or
// int8 codes' bf16 kernels (cpu_int{4,8}_bf16_linear.cpp, where built), or another quantized
// weight's float32 kernel on x widened to float32, its output rounded back to bf16 (bias
// float32, added before the rounding), as the per-op path's x.float() and .to(bfloat16) do.
void linear(const StackLinear& l, const uint16_t* x, int64_t T, uint16_t* out, float* xsum,
            int64_t n_threads) {
    if (l.gemm >= 0 && T >= l.gemm_from) {  // (its bias, if any, float32)
        banyan_quant_gemm_bf16(x, T, l.in, l.gemm, l.weight, l.scale, l.mins, l.group,
                               static_cast<const float*>(l.bias), out, l.out, n_threads);
        return;
    }
    if (l.kind == kSkinnyBf16) {
        banyan_skinny_linear_bf16(x, T, l.in, static_cast<const uint16_t*>(l.weight),
                                  static_cast<const uint16_t*>(l.bias), out, l.out, n_threads);
        return;
    }
    if (l.kind == kQ8Tiles) {
        banyan_int8_tiles_linear_bf16(x, T, l.in, static_cast<const int8_t*>(l.weight),
                                      static_cast<const float*>(l.scale),
                                      static_cast<const float*>(l.bias), out, l.out, 1,
                                      n_threads);
        return;
    }
    if (l.kind >= kQ8Int4 && l.kind <= kQ8Int5) {  // bf16 in and out: no widened copies
        banyan_q8_linear_bf16(l.kind - kQ8Int4, x, T, l.in, l.group, l.weight, l.scale, l.mins,
                              static_cast<const float*>(l.bias), out, l.out, n_threads);
        return;
    }
#if defined(BANYAN_CODES_BF16)
    if (l.kind == kInt4 || l.kind == kInt4Wide) {
        banyan_int4_linear_bf16(x, T, l.in, l.group, static_cast<const uint8_t*>(l.weight),
                                l.scale, l.mins, l.kind == kInt4Wide,
                                static_cast<const float*>(l.bias), out, l.out, xsum, n_threads);
        return;
    }
    if ((l.kind == kInt8Rows || l.kind == kInt8Groups) &&
        banyan_int8_linear_bf16(x, T, l.in, l.kind == kInt8Rows ? 0 : l.group,
                                static_cast<const int8_t*>(l.weight),
                                static_cast<const float*>(l.scale),
                                static_cast<const float*>(l.bias), out, l.out, n_threads))
        return;
#endif
    static thread_local std::vector<float> wide_x, wide_out;
    wide_x.resize(T * l.in);
    wide_out.resize(T * l.out);
    for (int64_t i = 0; i < T * l.in; ++i) wide_x[i] = bf16_to_f32(x[i]);
    linear(l, wide_x.data(), T, wide_out.data(), xsum, n_threads);
    for (int64_t i = 0; i < T * l.out; ++i) out[i] = f32_to_bf16(wide_out[i]);
}

// The row kernel's requests, then the prefill kernel's (each writes its own rows of out), over
// a pool of P: T itself (no scales) or int8 / fp8 codes with their scales.
template <typename T, typename P, typename Paged, typename Prefill>
void attend_pool(const StackModel* m, const StackStep* s, const T* q, T* out, const void* k_pool,
                 const void* v_pool, const float* ks, const float* vs, Paged paged,
                 Prefill prefill) {
    const float sm = static_cast<float>(m->scale);
    const int64_t H = m->heads, KVH = m->kv_heads, D = m->head_dim, nt = s->n_threads;
    const P* k = static_cast<const P*>(k_pool);
    const P* v = static_cast<const P*>(v_pool);
    if (s->n_groups > 0)
        paged(q, k, v, ks, vs, s->table, s->table_stride, s->req_row, s->req_len, s->q_start,
              s->n_new, s->order, s->group_start, s->group_prefix, s->n_groups, out, H, KVH, D,
              sm, nt);
    if (s->pf_reqs > 0) {
        auto call = [&](auto... tiles) {  // bf16 queries: the step's tile mode as well
            prefill(q, k, v, ks, vs, s->table, s->table_stride, s->pf_req_row, s->pf_req_len,
                    s->pf_q_start, s->pf_n_new, s->pf_reqs, out, H, KVH, D, sm, nt, tiles...);
        };
        if constexpr (std::is_same<T, uint16_t>::value)
            call(s->pf_tiles);
        else
            call();
    }
}

template <typename T, typename K>
void attend_codes(const StackModel* m, const StackLayer& L, const StackStep* s, const T* q,
                  T* out) {
    attend_pool<T, typename K::T>(m, s, q, out, L.k_pool, L.v_pool, L.k_scale, L.v_scale,
                                  CodeKernels<T, K>::attention, CodeKernels<T, K>::prefill);
}

template <typename T>
void attend(const StackModel* m, const StackLayer& L, const StackStep* s, const T* q, T* out) {
    switch (m->kv.codes) {
        case kKvInt8: return attend_codes<T, I8>(m, L, s, q, out);
        case kKvE4M3: return attend_codes<T, E4M3>(m, L, s, q, out);
        case kKvE5M2: return attend_codes<T, E5M2>(m, L, s, q, out);
        default:
            attend_pool<T, T>(m, s, q, out, L.k_pool, L.v_pool, nullptr, nullptr,
                              Kernels<T>::attention, Kernels<T>::prefill);
    }
}

// Scratch of one step, kept per thread between calls (a decode step's few KiB are reused).
template <typename T>
struct Scratch {
    std::vector<T> stream, cos, sin, x, qkv, q, k, attn, a, gate_up, act, mlp, logits;
    std::vector<float> xsum;
};

// The step's stream (its tokens' embeddings) and its positions' cos / sin rows, here rather
// than by torch ops before the call, which ran on caches the weights had just streamed through.
template <typename T>
void gather_inputs(const StackModel* m, const StackStep* s, Scratch<T>& b) {
    const int64_t T_ = s->tokens, H = m->hidden, half = m->head_dim / 2;
    b.stream.resize(T_ * H), b.cos.resize(T_ * half), b.sin.resize(T_ * half);
    const T* embed = static_cast<const T*>(m->embed);
    const T* cos = static_cast<const T*>(m->rope_cos);
    const T* sin = static_cast<const T*>(m->rope_sin);
    for (int64_t t = 0; t < T_; ++t) {
        std::memcpy(b.stream.data() + t * H, embed + s->input_ids[t] * H, H * sizeof(T));
        std::memcpy(b.cos.data() + t * half, cos + s->positions[t] * half, half * sizeof(T));
        std::memcpy(b.sin.data() + t * half, sin + s->positions[t] * half, half * sizeof(T));
    }
}

// A one-token bf16 step's greedy token through the head's int8 screen (cpu_head_screen.cpp):
// false where the stack has none, or where it could not decide (then the whole head runs).
template <typename T>
bool screened(const StackModel* m, const StackStep* s) {
    if constexpr (std::is_same<T, uint16_t>::value) {
        if (s->tokens != 1 || m->screen_codes == nullptr) return false;
        const int64_t token = banyan_head_screen_bf16(
            static_cast<const uint16_t*>(s->out), m->hidden,
            static_cast<const int32_t*>(m->head.weight), m->head.gemm, m->screen_codes,
            m->screen_scale, m->screen_group, m->screen_slack, m->head.out, s->vocab,
            s->n_threads);
        ++m->screen_counts[token < 0];  // [screened, fallen back]
        if (token >= 0) s->greedy_out[0] = token;
        return token >= 0;
    }
    return false;
}

// 0, or (doing nothing) the rows the RoPE tables must have for this step's positions.
template <typename T>
int64_t run_layers(const StackModel* m, const StackStep* s) {
    using K = Kernels<T>;
    const int64_t T_ = s->tokens, H = m->hidden, D = m->head_dim;
    const int64_t needed = T_ ? *std::max_element(s->positions, s->positions + T_) + 1 : 0;
    if (needed > m->rope_rows) return needed;
    const int64_t q_size = m->heads * D, kv_size = m->kv_heads * D;
    const int64_t qkv_n = q_size + 2 * kv_size, nt = s->n_threads;
    const float eps = static_cast<float>(m->eps);
    static thread_local Scratch<T> b;
    b.x.resize(T_ * H);
    b.qkv.resize(T_ * qkv_n);
    b.q.resize(T_ * q_size);
    b.k.resize(T_ * kv_size);
    b.attn.resize(T_ * q_size);
    b.a.resize(T_ * H);
    b.gate_up.resize(T_ * 2 * m->intermediate);
    b.act.resize(T_ * m->intermediate);
    b.mlp.resize(T_ * H);
    b.xsum.resize(T_ * (std::max(H, m->intermediate) / 16 + 1));  // int4 group sums (group >= 16)
    gather_inputs(m, s, b);
    T* stream = b.stream.data();
    const int64_t value_bytes = m->kv.codes == kKvPlain ? int64_t{sizeof(T)} : 1;
    KvAhead kv_ahead(s, m->kv_heads * D * value_bytes, m->kv_heads);
    banyan_team::Team* team = banyan_team::active;
    OpClock clock(s->op_seconds);
    for (int64_t i = 0; i < m->layers; ++i) {
        const StackLayer& L = m->layer[i];
        // the first layer's stream is the embeddings themselves (nothing to add yet)
        K::add_rms_norm(stream, i == 0 ? nullptr : b.mlp.data(),
                        static_cast<const T*>(L.input_norm), b.x.data(), T_, H, eps, nt);
        clock.lap(kOpNorm);
        linear(L.qkv, b.x.data(), T_, b.qkv.data(), b.xsum.data(), nt);
        clock.lap(kOpQkv);
        K::rope_qk(b.qkv.data(), qkv_n, b.cos.data(), b.sin.data(),
                   static_cast<const T*>(L.q_norm), static_cast<const T*>(L.k_norm), eps,
                   b.q.data(), b.k.data(), T_, m->heads, m->kv_heads, D, nt);
        clock.lap(kOpRope);
        // rotated k and the untouched v into the pool; codes of many tokens (a batched step's)
        // quantized on all threads
        // (b is this thread's: the team's threads take its rows through these pointers)
        const T *k_rows = b.k.data(), *v_rows = b.qkv.data() + q_size + kv_size;
        const int64_t store_threads = m->kv.codes != kKvPlain && T_ >= 8 ? nt : 1;
        banyan_team::parallel_for(T_, store_threads, [&](int64_t t) {
            store_row(k_rows + t * kv_size, s->slots[t], m->kv_heads, D, L.k_pool, L.k_scale,
                      m->kv);
            store_row(v_rows + t * qkv_n, s->slots[t], m->kv_heads, D, L.v_pool, L.v_scale,
                      m->kv);
        });
        clock.lap(kOpKvStore);
        attend(m, L, s, b.q.data(), b.attn.data());
        clock.lap(kOpAttention);
        linear(L.o, b.attn.data(), T_, b.a.data(), b.xsum.data(), nt);
        clock.lap(kOpO);
        K::add_rms_norm(stream, b.a.data(), static_cast<const T*>(L.post_norm), b.x.data(), T_,
                        H, eps, nt);
        clock.lap(kOpNorm);
        linear(L.gate_up, b.x.data(), T_, b.gate_up.data(), b.xsum.data(), nt);
        clock.lap(kOpGateUp);
        K::silu_and_mul(b.gate_up.data(), b.act.data(), T_, m->intermediate, nt);
        clock.lap(kOpSilu);
        // the next layer's K/V fetched beside down's weights (the last loop before its attention
        // but the small qkv: what is fetched earlier leaves the L2 with the weights after it)
        if (team != nullptr && i + 1 < m->layers) team->set_side(kv_ahead.of(m->layer[i + 1]));
        linear(L.down, b.act.data(), T_, b.mlp.data(), b.xsum.data(), nt);
        if (team != nullptr) team->set_side(nullptr);
        clock.lap(kOpDown);
    }
    K::add_rms_norm(stream, m->layers ? b.mlp.data() : nullptr,
                    static_cast<const T*>(m->final_norm), static_cast<T*>(s->out), T_, H, eps,
                    nt);
    clock.lap(kOpNorm);
    if (s->greedy_out != nullptr && m->head.weight != nullptr) {
        if (!screened<T>(m, s)) {
            b.logits.resize(T_ * m->head.out);
            linear(m->head, static_cast<const T*>(s->out), T_, b.logits.data(), b.xsum.data(),
                   nt);
            K::argmax(b.logits.data(), T_, s->vocab, m->head.out, s->greedy_out, nt);
        }
        clock.lap(kOpHead);
    }
    return 0;
}

// The step on one team of threads held from its first op to its last (cpu_team.h): its
// kernels' loops are handed to the team's waiting threads instead of each opening an OpenMP
// region (about 150 a one-token step of SmolLM2).
template <typename T>
int64_t layer_stack(const StackModel* m, const StackStep* s) {
    int64_t result = 0;
    banyan_team::with_team(s->n_threads, [&] { result = run_layers<T>(m, s); });
    return result;
}

}  // namespace

extern "C" {

int64_t banyan_layer_stack_f32(const StackModel* m, const StackStep* s) {
    return layer_stack<float>(m, s);
}

int64_t banyan_layer_stack_bf16(const StackModel* m, const StackStep* s) {
    return layer_stack<uint16_t>(m, s);
}

}  // extern "C"
