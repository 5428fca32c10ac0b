// The C entry points of the int4 linear kernels, declared once for the files that call them:
// float32 activations (cpu_quant_linear.cpp) and bf16 ones (cpu_int4_bf16_linear.cpp); and
// the bf16 one of int8 codes (cpu_int8_bf16_linear.cpp), built alike.
#pragma once

#include <cstdint>

// The bf16 kernels are built where the CPU has AVX512-BF16 and VBMI; elsewhere its callers (the
// layer stack, layers/quant.py) keep the float32 kernel on x widened.
#if defined(__AVX512BF16__) && defined(__AVX512VBMI__)
#define BANYAN_CODES_BF16 1
#endif

extern "C" {
void banyan_int4_linear_f32(const float* x, int64_t T, int64_t K, int64_t group,
                            const uint8_t* w, const uint16_t* scale, const uint16_t* mins,
                            const float* bias, float* out, int64_t N, float* xsum,
                            int64_t n_threads);
void banyan_int4s_linear_f32(const float* x, int64_t T, int64_t K, int64_t group,
                             const uint8_t* w, const float* scale, const float* mins,
                             const float* bias, float* out, int64_t N, float* xsum,
                             int64_t n_threads);
#if defined(BANYAN_CODES_BF16)
void banyan_int4_linear_bf16(const uint16_t* x, int64_t T, int64_t K, int64_t group,
                             const uint8_t* w, const void* scale, const void* mins, int64_t wide,
                             const float* bias, uint16_t* out, int64_t N, float* xsum,
                             int64_t n_threads);
int64_t banyan_int8_linear_bf16(const uint16_t* x, int64_t T, int64_t K, int64_t group,
                                const int8_t* w, const float* scale, const float* bias,
                                uint16_t* out, int64_t N, int64_t n_threads);
#endif
int64_t banyan_int4_linear_bf16_vector();
}
