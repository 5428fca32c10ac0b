// Element types of the CPU kernels (float32, bfloat16 as raw uint16) and a scalar exp, shared by
// the attention and element-wise sources.
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
};

struct BF16 {
    using T = uint16_t;
    static float load(T x) { return bf16_to_f32(x); }
    static T store(float x) { return f32_to_bf16(x); }
    static float round(float x) { return bf16_to_f32(f32_to_bf16(x)); }  // a bf16 op's result
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
