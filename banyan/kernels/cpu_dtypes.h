// Element types of the CPU kernels (float32, bfloat16 as raw uint16; the quantized KV cache's
// int8 and fp8 codes) and a scalar exp, shared by the attention and element-wise sources.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

inline float bf16_to_f32(uint16_t x) {
    uint32_t u = static_cast<uint32_t>(x) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even, like torch
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<uint16_t>(u >> 16);
}

struct F32 {
    using T = float;
    static float load(T x) { return x; }
    static T store(float x) { return x; }
    static float round(float x) { return x; }  // a float32 tensor op's result
    static constexpr bool kScaled = false;
};

struct BF16 {
    using T = uint16_t;
    static float load(T x) { return bf16_to_f32(x); }
    static T store(float x) { return f32_to_bf16(x); }
    static float round(float x) { return bf16_to_f32(f32_to_bf16(x)); }  // a bf16 op's result
    static constexpr bool kScaled = false;
};

// Quantized KV codes: a row's value is load(code) x its (slot, head) scale (mem/kv_pool.py).
struct I8 {
    using T = int8_t;
    static float load(T x) { return static_cast<float>(x); }
    static constexpr bool kScaled = true;
};

// fp8 as torch's float8_e4m3fn (bias 7) and float8_e5m2 (bias 15), decoded with integer and
// float arithmetic that vectorises (a table lookup measured 1.8x slower than bf16 attention):
// a normal code's exponent and mantissa bits move into float32's fields with the bias
// adjusted; a subnormal one (exponent 0) is its mantissa times 2^(1 - bias - mantissa bits),
// computed from an integer so no float32 denormal is ever touched. The codes the pool holds
// are finite (quantize_rows scales into range), so infinities and NaN need no case.
template <int kMant, int kBias>
inline float fp8_decode(uint8_t code) {
    const uint32_t mag = code & 0x7fu;
    const uint32_t bits = (mag << (23 - kMant)) + (static_cast<uint32_t>(127 - kBias) << 23);
    float normal;
    std::memcpy(&normal, &bits, 4);
    const float sub = static_cast<float>(static_cast<int32_t>(mag)) *
                      (1.0f / static_cast<float>(1u << (kBias + kMant - 1)));
    const float v = (mag >> kMant) == 0 ? sub : normal;
    return (code & 0x80u) ? -v : v;
}

struct E4M3 {
    using T = uint8_t;
    static float load(T x) { return fp8_decode<3, 7>(x); }
    static constexpr bool kScaled = true;
};

struct E5M2 {
    using T = uint8_t;
    static float load(T x) { return fp8_decode<2, 15>(x); }
    static constexpr bool kScaled = true;
};

// exp(x) for x in [-87, 88] (clamped outside), Cephes' expf: ~1 ulp, vectorisable.
inline float exp_clamped(float x) {
    x = std::min(std::max(x, -87.0f), 88.0f);
    float fx = std::floor(x * 1.44269504088896341f + 0.5f);
    float r = x - fx * 0.693359375f + fx * 2.12194440e-4f;
    float z = r * r;
    float y = 1.9875691500e-4f;
    y = y * r + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * z + r + 1.0f;
    int32_t bits = (static_cast<int32_t>(fx) + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, 4);
    return y * scale;
}

// exp(x) for x <= 0 (scores minus their running max).
inline float exp_nonpos(float x) { return exp_clamped(x); }

}  // namespace
