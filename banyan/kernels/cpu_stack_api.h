// The C entry points the layer stack (cpu_layer_stack.cpp) calls, defined in the other files
// of this library: its element-wise ops, fp8 K/V quantizers, attention and projection kernels
// (int4's are in cpu_int4_api.h), and which of them each element type's stack runs (Kernels,
// CodeKernels).
#pragma once

#include <cstdint>

#include "cpu_dtypes.h"
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
void banyan_add_rms_norm_bf16(uint16_t* residual, const uint16_t* add, const uint16_t* w,
                              uint16_t* out, int64_t rows, int64_t n, float eps,
                              int64_t n_threads);
void banyan_silu_and_mul_bf16(const uint16_t* gate_up, uint16_t* out, int64_t rows, int64_t n,
                              int64_t n_threads);
void banyan_rope_qk_bf16(const uint16_t* qkv, int64_t stride, const uint16_t* cos,
                         const uint16_t* sin, const uint16_t* q_norm, const uint16_t* k_norm,
                         float eps, uint16_t* q_out, uint16_t* k_out, int64_t rows,
                         int64_t heads, int64_t kvh, int64_t d, int64_t n_threads);
BANYAN_PAGED_ATTENTION_SIGNATURE(banyan_paged_attention_f32_f32, float, float);
BANYAN_PAGED_ATTENTION_SIGNATURE(banyan_paged_attention_f32_int8, float, int8_t);
BANYAN_PAGED_ATTENTION_SIGNATURE(banyan_paged_attention_f32_fp8_e4m3, float, uint8_t);
BANYAN_PAGED_ATTENTION_SIGNATURE(banyan_paged_attention_f32_fp8_e5m2, float, uint8_t);
BANYAN_PAGED_ATTENTION_SIGNATURE(banyan_paged_attention_bf16_bf16, uint16_t, uint16_t);
BANYAN_PAGED_ATTENTION_SIGNATURE(banyan_paged_attention_bf16_int8, uint16_t, int8_t);
BANYAN_PAGED_ATTENTION_SIGNATURE(banyan_paged_attention_bf16_fp8_e4m3, uint16_t, uint8_t);
BANYAN_PAGED_ATTENTION_SIGNATURE(banyan_paged_attention_bf16_fp8_e5m2, uint16_t, uint8_t);
BANYAN_PREFILL_ATTENTION_SIGNATURE(banyan_prefill_attention_f32_f32, float, float);
BANYAN_PREFILL_ATTENTION_SIGNATURE(banyan_prefill_attention_f32_int8, float, int8_t);
BANYAN_PREFILL_ATTENTION_SIGNATURE(banyan_prefill_attention_f32_fp8_e4m3, float, uint8_t);
BANYAN_PREFILL_ATTENTION_SIGNATURE(banyan_prefill_attention_f32_fp8_e5m2, float, uint8_t);
// bf16 queries: the tile mode after the arguments (cpu_prefill_attention.cpp)
void banyan_prefill_attention_stack_bf16(BANYAN_PREFILL_ATTENTION_PARAMS(uint16_t, uint16_t),
                                         int64_t tiles);
void banyan_prefill_attention_stack_bf16_int8(BANYAN_PREFILL_ATTENTION_PARAMS(uint16_t, int8_t),
                                              int64_t tiles);
void banyan_prefill_attention_stack_bf16_fp8_e4m3(
    BANYAN_PREFILL_ATTENTION_PARAMS(uint16_t, uint8_t), int64_t tiles);
void banyan_prefill_attention_stack_bf16_fp8_e5m2(
    BANYAN_PREFILL_ATTENTION_PARAMS(uint16_t, uint8_t), int64_t tiles);
void banyan_quant_gemm_bf16(const uint16_t* x, int64_t T, int64_t K, int64_t kind,
                            const void* codes, const void* scale, const void* mins, int64_t group,
                            const float* bias, uint16_t* out, int64_t N, int64_t n_threads);
void banyan_skinny_linear_f32(const float* x, int64_t T, int64_t K, const float* w,
                              const float* bias, float* out, int64_t N, int64_t n_threads);
void banyan_skinny_linear_bf16(const uint16_t* x, int64_t T, int64_t K, const uint16_t* w,
                               const uint16_t* bias, uint16_t* out, int64_t N,
                               int64_t n_threads);
void banyan_int8_linear_f32(const float* x, int64_t T, int64_t K, const int8_t* w,
                            const float* scale, const float* bias, float* out, int64_t N,
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
void banyan_argmax_rows_f32(const float* x, int64_t rows, int64_t n, int64_t stride,
                            int64_t* out, int64_t n_threads);
void banyan_argmax_rows_bf16(const uint16_t* x, int64_t rows, int64_t n, int64_t stride,
                             int64_t* out, int64_t n_threads);
int64_t banyan_head_screen_bf16(const uint16_t* x, int64_t K, const int32_t* pairs,
                                int64_t kind, const int8_t* codes, const float* scale,
                                int64_t group, const float* slack, int64_t N, int64_t vocab,
                                int64_t n_threads);
void banyan_fp8_quantize_rows_e4m3(const float* x, int64_t rows, int64_t d, const float* shifts,
                                   int64_t n_shifts, uint8_t* codes, float* scales,
                                   int64_t n_threads);
void banyan_fp8_quantize_rows_e5m2(const float* x, int64_t rows, int64_t d, const float* shifts,
                                   int64_t n_shifts, uint8_t* codes, float* scales,
                                   int64_t n_threads);
void banyan_int8_tiles_linear_f32(const float* x, int64_t T, int64_t K, const int8_t* w,
                                  const float* scale, const float* bias, float* out, int64_t N,
                                  int64_t fast, int64_t n_threads);
void banyan_int8_tiles_linear_bf16(const uint16_t* x, int64_t T, int64_t K, const int8_t* w,
                                   const float* scale, const float* bias, uint16_t* out,
                                   int64_t N, int64_t fast, int64_t n_threads);
void banyan_q8_linear_bf16(int64_t kind, const uint16_t* x, int64_t T, int64_t K,
                           int64_t group, const void* w, const void* scale, const void* mins,
                           const float* bias, uint16_t* out, int64_t N, int64_t n_threads);
}

// The element-wise kernels and attention of each element type (cpu_fused_ops.cpp,
// cpu_paged_attention.cpp, cpu_prefill_attention.cpp, cpu_argmax.cpp).
template <typename T>
struct Kernels;

template <>
struct Kernels<float> {
    static constexpr auto add_rms_norm = banyan_add_rms_norm_f32;
    static constexpr auto silu_and_mul = banyan_silu_and_mul_f32;
    static constexpr auto rope_qk = banyan_rope_qk_f32;
    static constexpr auto attention = banyan_paged_attention_f32_f32;
    static constexpr auto prefill = banyan_prefill_attention_f32_f32;
    static constexpr auto argmax = banyan_argmax_rows_f32;
};

template <>
struct Kernels<uint16_t> {
    static constexpr auto add_rms_norm = banyan_add_rms_norm_bf16;
    static constexpr auto silu_and_mul = banyan_silu_and_mul_bf16;
    static constexpr auto rope_qk = banyan_rope_qk_bf16;
    static constexpr auto attention = banyan_paged_attention_bf16_bf16;
    static constexpr auto prefill = banyan_prefill_attention_stack_bf16;  // (+ a tile mode)
    static constexpr auto argmax = banyan_argmax_rows_bf16;
};

// Attention over a quantized pool (codes K: cpu_dtypes.h's I8, E4M3, E5M2) for each element
// type's queries.
template <typename T, typename K>
struct CodeKernels;

#define BANYAN_CODE_KERNELS(T_, K_, PAGED, PREFILL)  \
    template <>                                      \
    struct CodeKernels<T_, K_> {                     \
        static constexpr auto attention = PAGED;     \
        static constexpr auto prefill = PREFILL;     \
    };

BANYAN_CODE_KERNELS(float, I8, banyan_paged_attention_f32_int8, banyan_prefill_attention_f32_int8)
BANYAN_CODE_KERNELS(float, E4M3, banyan_paged_attention_f32_fp8_e4m3,
                    banyan_prefill_attention_f32_fp8_e4m3)
BANYAN_CODE_KERNELS(float, E5M2, banyan_paged_attention_f32_fp8_e5m2,
                    banyan_prefill_attention_f32_fp8_e5m2)
BANYAN_CODE_KERNELS(uint16_t, I8, banyan_paged_attention_bf16_int8,
                    banyan_prefill_attention_stack_bf16_int8)
BANYAN_CODE_KERNELS(uint16_t, E4M3, banyan_paged_attention_bf16_fp8_e4m3,
                    banyan_prefill_attention_stack_bf16_fp8_e4m3)
BANYAN_CODE_KERNELS(uint16_t, E5M2, banyan_paged_attention_bf16_fp8_e5m2,
                    banyan_prefill_attention_stack_bf16_fp8_e5m2)
#undef BANYAN_CODE_KERNELS
