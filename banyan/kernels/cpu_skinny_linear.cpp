// Skinny float32 linear: out[t, n] = sum_k x[t, k] * w[n, k] (+ bias[n]) for a few tokens, with w
// in its plain [N, K] layout. Each weight row is read once per block of up to 8 tokens and dotted
// with all of them (8-lane partial sums, then a horizontal sum), so a step of 2-8 tokens (a decode
// checking speculative guesses, a small decode batch) reads the weights once, as a single-token
// GEMV does. oneDNN/MKL switch to a GEMM kernel from 2 rows that measured ~2x a GEMV on a 2-core
// Zen 3 (LM head: 1 row 9.0 ms, 2-8 rows 20 ms; this: 5.1-5.8 ms). GCC vector extensions: AVX2
// or AVX-512 code from the same source (-march=native).
#include <algorithm>
#include <cstdint>

typedef float v8 __attribute__((vector_size(32)));

static inline v8 load8(const float* p) { v8 r; __builtin_memcpy(&r, p, sizeof r); return r; }
static inline float hsum(v8 v) {
    float s = 0.f;
    for (int i = 0; i < 8; ++i) s += v[i];
    return s;
}

template <int TB>
static void rows(const float* x, int64_t K, const float* w, const float* bias, float* out,
                 int64_t N, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
        const float* wn = w + n * K;
        v8 acc[TB];
        for (int i = 0; i < TB; ++i) acc[i] = v8{};
        int64_t k = 0;
        for (; k + 8 <= K; k += 8) {
            const v8 wv = load8(wn + k);
            for (int i = 0; i < TB; ++i) acc[i] += load8(x + i * K + k) * wv;
        }
        for (int i = 0; i < TB; ++i) {
            float s = hsum(acc[i]);
            for (int64_t kk = k; kk < K; ++kk) s += x[i * K + kk] * wn[kk];
            out[i * N + n] = s + (bias ? bias[n] : 0.f);
        }
    }
}

extern "C" void banyan_skinny_linear_f32(const float* x, int64_t T, int64_t K, const float* w,
                                  const float* bias, float* out, int64_t N, int64_t n_threads) {
    const int64_t chunk = 64;
    const int64_t chunks = (N + chunk - 1) / chunk;
#pragma omp parallel for num_threads(n_threads) schedule(static)
    for (int64_t c = 0; c < chunks; ++c) {
        const int64_t n0 = c * chunk, n1 = std::min(N, n0 + chunk);
        for (int64_t t0 = 0; t0 < T; t0 += 8) {
            const int64_t tb = std::min<int64_t>(8, T - t0);
            const float* xt = x + t0 * K;
            float* ot = out + t0 * N;
            switch (tb) {
                case 1: rows<1>(xt, K, w, bias, ot, N, n0, n1); break;
                case 2: rows<2>(xt, K, w, bias, ot, N, n0, n1); break;
                case 3: rows<3>(xt, K, w, bias, ot, N, n0, n1); break;
                case 4: rows<4>(xt, K, w, bias, ot, N, n0, n1); break;
                case 5: rows<5>(xt, K, w, bias, ot, N, n0, n1); break;
                case 6: rows<6>(xt, K, w, bias, ot, N, n0, n1); break;
                case 7: rows<7>(xt, K, w, bias, ot, N, n0, n1); break;
                default: rows<8>(xt, K, w, bias, ot, N, n0, n1); break;
            }
        }
    }
}
