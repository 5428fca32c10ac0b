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

// fp8 as torch's float8_e4m3fn (bias 7, no infinities, 0x7f/0xff NaN) and float8_e5m2 (bias
// 15, IEEE-like): decoded through a 256-entry table, built once.
struct Fp8Table {
    float v[256];
    Fp8Table(int mant_bits, int bias, bool ieee_specials) {
        const int exp_max = (1 << (7 - mant_bits)) - 1;
        for (int b = 0; b < 256; ++b) {
            const int e = (b & 0x7f) >> mant_bits, m = b & ((1 << mant_bits) - 1);
            const float frac = static_cast<float>(m) / static_cast<float>(1 << mant_bits);
            float x;
            if (e == 0)
                x = std::ldexp(frac, 1 - bias);
            else if (e == exp_max && ieee_specials)
                x = m == 0 ? INFINITY : NAN;
            else if (e == exp_max && m == (1 << mant_bits) - 1)
                x = NAN;  // e4m3fn's only NaN
            else
                x = std::ldexp(1.0f + frac, e - bias);
            v[b] = (b & 0x80) ? -x : x;
        }
    }
};
inline const Fp8Table kE4M3Table(3, 7, false);
inline const Fp8Table kE5M2Table(2, 15, true);

struct E4M3 {
    using T = uint8_t;
    static float load(T x) { return kE4M3Table.v[x]; }
    static constexpr bool kScaled = true;
};

struct E5M2 {
    using T = uint8_t;
    static float load(T x) { return kE5M2Table.v[x]; }
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
