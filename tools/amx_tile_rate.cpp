// The AMX tile unit's rate on this core, over data in L1: one thread runs tile_block (the 2 x 2
// tiles of cpu_amx_tiles.h, the kernels' own) over a 32-row block of A and two panels of B of
// K inputs, again and again, and prints the time a step (4 tile loads, 4 tdpbf16ps) and a
// tdpbf16ps takes. Run it a few times minutes apart: on the 2-core AMX VMs of 2026-12-06 the
// same binary measured 11-13 ns and 30-32 ns a tdpbf16ps (the unit shared with a busy sibling,
// or a lower AMX clock), which is why the start-up probes time their paths in turns.
//
//   g++ -O2 -march=native -Ibanyan/kernels tools/amx_tile_rate.cpp -o /tmp/amx_tile_rate
//   /tmp/amx_tile_rate [K]        (K: inputs, a multiple of 32; 576 by default)
#include <sys/syscall.h>
#include <unistd.h>

#include <cfloat>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

extern "C" int banyan_amx_state() { return 4; }  // (this program asks Linux itself, below)
#define BANYAN_AMX_TILES 1
#include "cpu_amx_tiles.h"

int main(int argc, char** argv) {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0) {
        std::puts("AMX tile state refused by Linux");
        return 1;
    }
    const int K = argc > 1 ? std::atoi(argv[1]) : 576;
    const int64_t steps = K / 32, lda = 2 * K, ldb = 64, db = (K / 2) * 64;
    constexpr int reps = 20000;
    std::vector<char> a(32 * lda + 64, 1), b(2 * db + 64, 1);
    alignas(64) float c[32 * 32];
    char* a0 = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(a.data()) + 63) & ~63ull);
    char* b0 = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(b.data()) + 63) & ~63ull);
    AmxTiles tl;
    tl.begin();
    for (int round = 0; round < 3; ++round) {
        const auto t0 = std::chrono::steady_clock::now();
        for (int r = 0; r < reps; ++r)
            tile_block(tl, a0, 16 * lda, lda, 64, b0, db, ldb, 16 * ldb, steps,
                       reinterpret_cast<char*>(c), 128, false);
        const double ns =
            std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0)
                .count() / reps / steps;
        std::printf("K %d: %.1f ns a step, %.1f ns a tdpbf16ps\n", K, ns, ns / 4);
    }
    tl.end();
    return 0;
}
