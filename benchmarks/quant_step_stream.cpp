// One batch-1 decode step's weight stream through Banyan's quantized GEMV kernels, in C++ (a
// ctypes call costs ~5 us, as much as a small layer's kernel): SmolLM2-135M's 120 projections
// and its LM head as int4 (group 32, float16 scales and minimums: 84 MB), int8 with a scale per
// row and int8 with a scale per group of 32 (GGUF's Q8_0), far more than the L3 holds, so every
// pass reads them from memory as a decode does; beside them a plain read of the int4 bytes, the
// bound. The kinds alternate pass by pass, so a machine whose bandwidth drifts slows all alike.
//
//   g++ -O3 -march=native -fopenmp -ffp-contract=off -std=c++17 -I banyan/kernels
//       benchmarks/quant_step_stream.cpp -o /tmp/qss     (one line)
//   /tmp/qss [passes] [threads]
//
// Builds against two checkouts' kernels (-I pointing at each), run one after the other,
// compare kernel versions. Prints one JSON object: milliseconds per step (best, median) and
// GB/s at the median.
#include "cpu_quant_linear.cpp"  // from -I: the kernels under test
#include "cpu_int8g_linear.cpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

namespace {

struct Layer {
    int64_t n, k;
    std::vector<uint8_t> codes;     // int4 pairs, or int8 codes
    std::vector<uint16_t> s16, m16;  // int4 scales and minimums
    std::vector<float> rows, groups;  // int8 scales: per row, per group
    std::vector<float> out;
};

constexpr int64_t kGroup = 32;
const char* const kNames[4] = {"int4_g32", "int8_rows", "int8_g32", "read_int4_bytes"};

}  // namespace

int main(int argc, char** argv) {
    const int passes = argc > 1 ? std::atoi(argv[1]) : 100;
    const int64_t threads = argc > 2 ? std::atoi(argv[2]) : 2;
    std::vector<std::pair<int64_t, int64_t>> shapes;
    for (int l = 0; l < 30; ++l)
        for (auto s : {std::pair<int64_t, int64_t>{960, 576}, {576, 576}, {3072, 576}, {576, 1536}})
            shapes.push_back(s);
    shapes.push_back({49152, 576});
    std::mt19937 rng(1);
    std::vector<Layer> int4(shapes.size()), int8(shapes.size());
    double bytes[4] = {0, 0, 0, 0};
    for (size_t i = 0; i < shapes.size(); ++i) {
        const auto [n, k] = shapes[i];
        const int64_t padded = (n + PANEL - 1) / PANEL * PANEL;
        Layer& a = int4[i];
        a.n = n, a.k = k, a.out.resize(n);
        a.codes.resize(padded * k / 2);
        for (auto& b : a.codes) b = static_cast<uint8_t>(rng());
        a.s16.assign(padded * k / kGroup, 0x2000);  // float16 2^-7
        a.m16.assign(padded * k / kGroup, 0xA000);
        Layer& b = int8[i];
        b.n = n, b.k = k, b.out.resize(n);
        b.codes.resize(padded * k);
        for (auto& c : b.codes) c = static_cast<uint8_t>(rng() % 255);
        b.rows.assign(padded, 0.01f);
        b.groups.assign(padded * k / kGroup, 0.01f);
        bytes[0] += a.codes.size() + 4.0 * a.s16.size();
        bytes[1] += b.codes.size() + 4.0 * b.rows.size();
        bytes[2] += b.codes.size() + 4.0 * b.groups.size();
    }
    bytes[3] = bytes[0];
    std::vector<float> x(1536), xsum(64);
    for (auto& v : x) v = static_cast<float>(rng() % 1000) / 1000.0f;
    std::vector<double> ms[4];
    volatile uint64_t sink = 0;
    for (int p = 0; p < passes; ++p)
        for (int kind = 0; kind < 4; ++kind) {
            const auto t0 = std::chrono::steady_clock::now();
            for (size_t i = 0; i < shapes.size(); ++i) {
                Layer& a = int4[i];
                Layer& b = int8[i];
                const auto* codes8 = reinterpret_cast<const int8_t*>(b.codes.data());
                if (kind == 0)
                    banyan_int4_linear_f32(x.data(), 1, a.k, kGroup, a.codes.data(), a.s16.data(),
                                           a.m16.data(), nullptr, a.out.data(), a.n, xsum.data(),
                                           threads);
                else if (kind == 1)
                    banyan_int8_linear_f32(x.data(), 1, b.k, codes8, b.rows.data(), nullptr,
                                           b.out.data(), b.n, threads);
                else if (kind == 2)
                    banyan_int8g_linear_f32(x.data(), 1, b.k, kGroup, codes8, b.groups.data(),
                                            nullptr, b.out.data(), b.n, threads);
                else {  // the int4 codes, scales and minimums read once, nothing computed
                    uint64_t s = 0;
                    const uint8_t* c = a.codes.data();
                    const int64_t nb = static_cast<int64_t>(a.codes.size());
#pragma omp parallel for num_threads(threads) reduction(+ : s) schedule(static)
                    for (int64_t j = 0; j < nb; j += 64) {
                        __builtin_prefetch(c + j + 4096);
                        s += c[j];
                    }
                    for (size_t j = 0; j < a.s16.size(); j += 32) s += a.s16[j] + a.m16[j];
                    sink = sink + s;
                }
            }
            ms[kind].push_back(std::chrono::duration<double, std::milli>(
                                   std::chrono::steady_clock::now() - t0).count());
        }
    std::printf("{\"passes\": %d, \"threads\": %ld, \"kinds\": {", passes,
                static_cast<long>(threads));
    for (int kind = 0; kind < 4; ++kind) {
        std::sort(ms[kind].begin(), ms[kind].end());
        const double median = ms[kind][ms[kind].size() / 2];
        std::printf("%s\"%s\": {\"mb\": %.1f, \"best_ms\": %.3f, \"median_ms\": %.3f, "
                    "\"gb_s_at_median\": %.1f}", kind ? ", " : "", kNames[kind],
                    bytes[kind] / 1e6, ms[kind][0], median, bytes[kind] / 1e6 / median);
    }
    std::printf("}}\n");
}
