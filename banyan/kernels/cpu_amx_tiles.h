// AMX tiles for the attention kernels and the quantized GEMM (Intel Xeons from Sapphire Rapids
// on): the tile operations twice, as the instructions and emulated in memory, and a 2 x 2 block
// of tile products the kernels build on (cpu_prefill_tiles.h: the prefill kernel's S^T and O^T;
// cpu_attend_tiles.h: the row kernel's S and O; cpu_quant_gemm_tiles.h).
//
// Tiles: 0-3 accumulate (2 x 2 output tiles), 4-5 hold A (16 rows x 32 bf16 each), 6-7 B (16
// pairs x 16 columns), every tile 16 rows of 64 bytes: one configuration, loaded by each thread
// as a call starts; the thread's own configuration before it (oneDNN's, torch's) put back as
// it ends, or the tiles released where it had none.
//
// Two tile sets share the code: AmxTiles (the instructions, as inline assembly with literal
// tile numbers, so no -mamx flags are needed to build; GNU as 2.36 or later) and SoftTiles
// (the same operations on memory, in plain loops: what the tests run on CPUs without AMX, so
// the layouts and strides are checked everywhere; the Xeon run adds the instructions' own
// check). A tile's products sum in tdpbf16ps's order, not the vector paths', so their bits
// differ from those; they do not depend on the tile a row falls in.
#pragma once

#if defined(__x86_64__) && defined(__linux__)
#define BANYAN_AMX_TILES 1

#include <sys/syscall.h>
#include <unistd.h>

#include <cfloat>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

// What this process may do with AMX's tiles, decided once (cpu_amx_check.cpp): AmxState.
extern "C" int banyan_amx_state();

namespace {

constexpr int kTileRows = 16;  // rows of every tile; each row 64 bytes (16 floats, 32 bf16)

// Tiles in memory: each operation as the SDM's pseudocode defines it. tdpbf16ps: for each output
// element, the even inputs' products and the odd inputs' summed apart from zero (fused
// multiply-adds), then C + (even + odd); denormal inputs read as zero and denormal results
// flushed to zero at every step (DAZ = FTZ = 1, whatever MXCSR says).
struct SoftTiles {
    alignas(64) uint8_t t[8][kTileRows][64];

    void begin() {}
    void end() {}
    void shape(int) {}  // (every row of a tile is computed; the rows a caller reads are the same)
    template <int T>
    void zero() {
        std::memset(t[T], 0, sizeof t[T]);
    }
    template <int T>
    void load(const void* src, int64_t stride) {
        for (int r = 0; r < kTileRows; ++r)
            std::memcpy(t[T][r], static_cast<const char*>(src) + r * stride, 64);
    }
    template <int T>
    void store(void* dst, int64_t stride) const {
        for (int r = 0; r < kTileRows; ++r)
            std::memcpy(static_cast<char*>(dst) + r * stride, t[T][r], 64);
    }
    // tile C (C: 0-3, C = 2 (A - 4) + B - 6) += tile A (bf16 [16][32]) x tile B (pairs [16][16])
    template <int A, int B>
    void dot() {
        constexpr int C = 2 * (A - 4) + (B - 6);
        for (int m = 0; m < kTileRows; ++m) {
            float sum[2][16] = {};  // [even / odd inputs][column]
            for (int k = 0; k < 16; ++k)
                for (int n = 0; n < 16; ++n)
                    for (int i = 0; i < 2; ++i)
                        sum[i][n] = ftz(std::fma(bf16_at(t[A][m], 2 * k + i),
                                                 bf16_at(t[B][k], 2 * n + i), sum[i][n]));
            for (int n = 0; n < 16; ++n) {
                float c;
                std::memcpy(&c, &t[C][m][4 * n], 4);
                c = ftz(ftz(c) + ftz(sum[0][n] + sum[1][n]));
                std::memcpy(&t[C][m][4 * n], &c, 4);
            }
        }
    }

  private:
    static float ftz(float x) { return std::fabs(x) < FLT_MIN ? 0.0f * x : x; }  // (keeps -0)
    static float bf16_at(const uint8_t* row, int i) {
        uint16_t h;
        std::memcpy(&h, row + 2 * i, 2);
        const uint32_t bits = static_cast<uint32_t>(h) << 16;
        float f;
        std::memcpy(&f, &bits, 4);
        return ftz(f);
    }
};

// The AMX instructions. Tile numbers must be literals in the assembly, hence the chains.
#define BANYAN_TILE_CASE(N, ASM, ...) \
    if constexpr (T == N) __asm__ volatile(ASM : : __VA_ARGS__ : "memory");
struct AmxTiles {
    struct alignas(64) Config {
        uint8_t palette = 1, start_row = 0, reserved[14] = {};
        uint16_t colsb[16] = {};
        uint8_t rows[16] = {};
    };

    Config saved;  // the thread's configuration before begin(): put back by end()

    // The configuration a thread had is kept and put back: a library that configured its tiles
    // once for many calls (torch's cpublas::brgemm caches which kernel set them up, per thread)
    // then finds it as it left it, not released (its next tile instruction would fault).
    void begin() {
        __asm__ volatile("sttilecfg %0" : "=m"(saved) : : "memory");  // (all zero if none)
        Config c;
        for (int i = 0; i < 8; ++i) c.colsb[i] = 64, c.rows[i] = kTileRows;
        __asm__ volatile("ldtilecfg %0" : : "m"(c) : "memory");
    }
    // Tiles 0, 1 (C) and 4 (A) of `m` rows from now (between begin() and end(); their
    // contents are lost): a block of fewer than 16 rows multiplies and moves only its own, each
    // output element by the same instructions (so the same bits).
    void shape(int m) {
        Config c;
        for (int i = 0; i < 8; ++i) c.colsb[i] = 64, c.rows[i] = kTileRows;
        c.rows[0] = c.rows[1] = c.rows[4] = static_cast<uint8_t>(m);
        __asm__ volatile("ldtilecfg %0" : : "m"(c) : "memory");
    }
    // The same for tiles 0-5 (C and A): the int8 GEMM's two alternating sets (cpu_int8_tiles.cpp)
    void shape_rows(int m) {
        Config c;
        for (int i = 0; i < 8; ++i) c.colsb[i] = 64, c.rows[i] = i < 6 ? m : kTileRows;
        __asm__ volatile("ldtilecfg %0" : : "m"(c) : "memory");
    }
    void end() {
        if (saved.palette != 0)
            __asm__ volatile("ldtilecfg %0" : : "m"(saved) : "memory");
        else
            __asm__ volatile("tilerelease" : : : "memory");
    }
    template <int T>
    void zero() {
        if constexpr (T == 0) __asm__ volatile("tilezero %%tmm0" : : : "memory");
        if constexpr (T == 1) __asm__ volatile("tilezero %%tmm1" : : : "memory");
        if constexpr (T == 2) __asm__ volatile("tilezero %%tmm2" : : : "memory");
        if constexpr (T == 3) __asm__ volatile("tilezero %%tmm3" : : : "memory");
    }
    template <int T>
    void load(const void* src, int64_t stride) {
        BANYAN_TILE_CASE(0, "tileloadd (%0,%1,1), %%tmm0", "r"(src), "r"(stride))
        BANYAN_TILE_CASE(1, "tileloadd (%0,%1,1), %%tmm1", "r"(src), "r"(stride))
        BANYAN_TILE_CASE(2, "tileloadd (%0,%1,1), %%tmm2", "r"(src), "r"(stride))
        BANYAN_TILE_CASE(3, "tileloadd (%0,%1,1), %%tmm3", "r"(src), "r"(stride))
        BANYAN_TILE_CASE(4, "tileloadd (%0,%1,1), %%tmm4", "r"(src), "r"(stride))
        BANYAN_TILE_CASE(5, "tileloadd (%0,%1,1), %%tmm5", "r"(src), "r"(stride))
        BANYAN_TILE_CASE(6, "tileloadd (%0,%1,1), %%tmm6", "r"(src), "r"(stride))
        BANYAN_TILE_CASE(7, "tileloadd (%0,%1,1), %%tmm7", "r"(src), "r"(stride))
    }
    template <int T>
    void store(void* dst, int64_t stride) const {
        BANYAN_TILE_CASE(0, "tilestored %%tmm0, (%0,%1,1)", "r"(dst), "r"(stride))
        BANYAN_TILE_CASE(1, "tilestored %%tmm1, (%0,%1,1)", "r"(dst), "r"(stride))
        BANYAN_TILE_CASE(2, "tilestored %%tmm2, (%0,%1,1)", "r"(dst), "r"(stride))
        BANYAN_TILE_CASE(3, "tilestored %%tmm3, (%0,%1,1)", "r"(dst), "r"(stride))
    }
    // (AT&T order: B, A, C; tmmC += tmmA x tmmB)
    template <int A, int B>
    void dot() {
        if constexpr (A == 4 && B == 6) __asm__ volatile("tdpbf16ps %%tmm6, %%tmm4, %%tmm0" ::);
        if constexpr (A == 4 && B == 7) __asm__ volatile("tdpbf16ps %%tmm7, %%tmm4, %%tmm1" ::);
        if constexpr (A == 5 && B == 6) __asm__ volatile("tdpbf16ps %%tmm6, %%tmm5, %%tmm2" ::);
        if constexpr (A == 5 && B == 7) __asm__ volatile("tdpbf16ps %%tmm7, %%tmm5, %%tmm3" ::);
    }
    // The same with AMX-INT8's tdpbssd: int32 C += int8 A [16][64] x int8 B [16 quads][16][4]
    template <int A, int B>
    void dot_s8() {
        if constexpr (A == 4 && B == 6) __asm__ volatile("tdpbssd %%tmm6, %%tmm4, %%tmm0" ::);
        if constexpr (A == 4 && B == 7) __asm__ volatile("tdpbssd %%tmm7, %%tmm4, %%tmm1" ::);
        if constexpr (A == 5 && B == 6) __asm__ volatile("tdpbssd %%tmm6, %%tmm5, %%tmm2" ::);
        if constexpr (A == 5 && B == 7) __asm__ volatile("tdpbssd %%tmm7, %%tmm5, %%tmm3" ::);
    }
};
#undef BANYAN_TILE_CASE
// (ldtilecfg's 64-byte layout: palette, start row, 14 reserved, 16 x colsb, 16 x rows)
static_assert(sizeof(AmxTiles::Config) == 64 && offsetof(AmxTiles::Config, colsb) == 16 &&
                  offsetof(AmxTiles::Config, rows) == 48,
              "tile configuration layout");

enum AmxState : int {
    kAmxNoCpu = 0,    // CPUID: no AMX-TILE and AMX-BF16
    kAmxRefused = 1,  // Linux did not grant the tile state (a kernel before 5.16)
    kAmxFaulted = 2,  // a first 2 x 2 tile block died in a child process (or none started)
    kAmxWrong = 3,    // it ran, and its output was not the emulated tiles' exact one
    kAmxGranted = 4,  // it ran and came out exact: the tile paths may run AMX's instructions
};

inline bool amx_granted() { return banyan_amx_state() == kAmxGranted; }

// What a tile block does at each of its steps besides the products (a caller's prefetches).
struct NoStep {
    void operator()() const {}
};

// 2 x 2 output tiles: C[0..3] = (a0, a1) x (b0, b1) over `steps` steps of 32 bf16 (A) / 16
// pairs (B); load: C starts from memory (c, ldc bytes a row, tiles at c, c + 64 bytes, c + 16
// rows, both), else from zero. a1 / b1 at a fixed distance from a0 / b0 (da, db bytes).
template <typename Tiles, typename Step = NoStep>
inline void tile_block(Tiles& tl, const char* a0, int64_t da, int64_t lda, int64_t astep,
                       const char* b0, int64_t db, int64_t ldb, int64_t bstep, int64_t steps,
                       char* c, int64_t ldc, bool load, Step step = {}) {
    if (load) {
        tl.template load<0>(c, ldc);
        tl.template load<1>(c + 64, ldc);
        tl.template load<2>(c + kTileRows * ldc, ldc);
        tl.template load<3>(c + kTileRows * ldc + 64, ldc);
    } else {
        tl.template zero<0>(), tl.template zero<1>(), tl.template zero<2>(), tl.template zero<3>();
    }
    for (int64_t s = 0; s < steps; ++s) {
        step();
        tl.template load<4>(a0 + s * astep, lda);
        tl.template load<5>(a0 + da + s * astep, lda);
        tl.template load<6>(b0 + s * bstep, ldb);
        tl.template load<7>(b0 + db + s * bstep, ldb);
        tl.template dot<4, 6>(), tl.template dot<4, 7>();
        tl.template dot<5, 6>(), tl.template dot<5, 7>();
    }
    tl.template store<0>(c, ldc);
    tl.template store<1>(c + 64, ldc);
    tl.template store<2>(c + kTileRows * ldc, ldc);
    tl.template store<3>(c + kTileRows * ldc + 64, ldc);
}

// The same for one A tile: C[0..1] = a0 x (b0, b1) (16 rows; tiles 2, 3 and 5 untouched),
// each output element by the same instructions as in tile_block (so the same bits).
template <typename Tiles, typename Step = NoStep>
inline void tile_row_block(Tiles& tl, const char* a0, int64_t lda, int64_t astep,
                           const char* b0, int64_t db, int64_t ldb, int64_t bstep, int64_t steps,
                           char* c, int64_t ldc, bool load, Step step = {}) {
    if (load) {
        tl.template load<0>(c, ldc);
        tl.template load<1>(c + 64, ldc);
    } else {
        tl.template zero<0>(), tl.template zero<1>();
    }
    for (int64_t s = 0; s < steps; ++s) {
        step();
        tl.template load<4>(a0 + s * astep, lda);
        tl.template load<6>(b0 + s * bstep, ldb);
        tl.template load<7>(b0 + db + s * bstep, ldb);
        tl.template dot<4, 6>(), tl.template dot<4, 7>();
    }
    tl.template store<0>(c, ldc);
    tl.template store<1>(c + 64, ldc);
}

}  // namespace

#endif  // __x86_64__ && __linux__
