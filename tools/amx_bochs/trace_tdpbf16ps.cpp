// Host tool for when a block case differs beyond NaNs: one output of test_core.cpp's 2 x 2
// block computed step by step twice, as Bochs's tdpbf16ps does it (Bochs's own softfloat:
// f32_mulAdd into the even and odd sums, f32_add to C) and as SoftTiles does (host fma with
// DAZ/FTZ), printing every partial sum where the two part and each step's C.
//
// Usage: trace_tdpbf16ps KIND SEED ROW COL [LOADC]
//   KIND: 0 small, 1 wide, 2 order, 3 absorb, 4 denorm, 5 special, 6 gauss (test_core.cpp)
//   SEED 0 or 1; ROW 0-31, COL 0-31 (the case's "row R col C" lines); LOADC 1 for -loadC
// Built by build.sh when the Bochs build folder has its source link (build_bochs.sh).
#define main harness_main
#include "test_core.cpp"
#undef main

#include <cstdio>
#include <cstdlib>

#include "config.h"
#include "cpu/softfloat3e/include/softfloat.h"

void kernel_cases() {}  // test_kernels.cpp is not linked in: test_core.cpp's main needs one

namespace {
float bf16_to_float(uint16_t h) {
    const uint32_t u = static_cast<uint32_t>(h) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
float flush(float x) { return std::fabs(x) < FLT_MIN ? 0.0f * x : x; }
uint32_t bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}
float from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}
}  // namespace

int main(int argc, char** argv) {
    if (argc < 5) {
        std::fprintf(stderr, "usage: %s KIND SEED ROW COL [LOADC]\n", argv[0]);
        return 2;
    }
    using namespace harness;
    const int kind = atoi(argv[1]), seed = atoi(argv[2]), row = atoi(argv[3]);
    const int col = atoi(argv[4]);
    const bool load = argc > 5 && atoi(argv[5]);
    fill(static_cast<Kind>(kind), static_cast<uint64_t>(kind * 10 + seed));
    // tdpbf16ps's status: round to nearest even, DAZ and FTZ, all exceptions masked
    softfloat_status_t status;
    status.softfloat_roundingMode = softfloat_round_near_even;
    status.softfloat_exceptionFlags = 0;
    status.softfloat_exceptionMasks = softfloat_all_exceptions_mask;
    status.softfloat_suppressException = softfloat_all_exceptions_mask;
    status.softfloat_flush_underflow_to_zero = true;
    status.softfloat_denormals_are_zeros = true;
    uint32_t c_bochs = load ? C_in[row][col] : 0;
    float c_soft = from_bits(c_bochs);
    for (int step = 0; step < kSteps; ++step) {
        uint32_t sum_bochs[2] = {0, 0};  // even and odd products' sums
        float sum_soft[2] = {0, 0};
        for (int k = 0; k < 16; ++k)
            for (int half = 0; half < 2; ++half) {
                const uint16_t a = A[row][step * 32 + 2 * k + half];
                const uint32_t pair = B[step * 16 + k][col];
                const uint16_t b = static_cast<uint16_t>(half ? pair >> 16 : pair & 0xffff);
                sum_bochs[half] = f32_mulAdd(static_cast<uint32_t>(a) << 16,
                                             static_cast<uint32_t>(b) << 16, sum_bochs[half], 0,
                                             &status);
                sum_soft[half] = flush(std::fma(flush(bf16_to_float(a)),
                                                flush(bf16_to_float(b)), sum_soft[half]));
                if (sum_bochs[half] != bits(sum_soft[half]))
                    std::printf("step %d k %d half %d: a=%04x b=%04x product=%.9g bochs=%08x "
                                "(%.9g) soft=%08x (%.9g)\n", step, k, half, a, b,
                                double(bf16_to_float(a)) * bf16_to_float(b), sum_bochs[half],
                                from_bits(sum_bochs[half]), bits(sum_soft[half]),
                                sum_soft[half]);
            }
        const uint32_t both_bochs = f32_add(sum_bochs[0], sum_bochs[1], &status);
        const float both_soft = flush(sum_soft[0] + sum_soft[1]);
        std::printf("  even=%08x odd=%08x: bochs even+odd=%08x soft even+odd=%08x\n",
                    sum_bochs[0], sum_bochs[1], both_bochs, bits(both_soft));
        c_bochs = f32_add(c_bochs, both_bochs, &status);
        c_soft = flush(flush(c_soft) + both_soft);
        std::printf("step %d: bochs C=%08x soft C=%08x\n", step, c_bochs, bits(c_soft));
    }
    return 0;
}
