// Whether this process may run AMX's tile instructions (cpu_amx_tiles.h: AmxState), decided
// once: the CPU has AMX-TILE and AMX-BF16 (CPUID), Linux grants the tile state, and a first
// 2 x 2 tile block, run in a child process, neither faults nor comes out other than the
// emulated tiles' block. The tile paths were written without an AMX machine: a layout or
// encoding wrong there would otherwise kill the server in its start-up checks (SIGILL) or
// reach them as wrong numbers; this way such a CPU keeps the vector paths and says why.
#include "cpu_amx_tiles.h"

#if defined(BANYAN_AMX_TILES)
#include <cpuid.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>

#include <cerrno>
#include <initializer_list>
#include <new>

namespace {

bool cpu_has_amx_bf16() {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    return (d >> 24 & 1u) && (d >> 22 & 1u);  // AMX-TILE, AMX-BF16
}

// One tile_block over two steps: A [32 rows][64 bf16], B [32 pairs][32 columns] in pairs, C
// [32][32] loaded from memory. Small integers: every sum is exact in any order, so the
// instructions' output must equal the emulation's bit for bit (a swapped operand, layout or
// stride would not).
struct Block {
    alignas(64) uint16_t a[32][64];
    alignas(64) uint16_t b[32][64];
    alignas(64) float c[32][32];

    void fill() {
        for (int i = 0; i < 32; ++i)
            for (int k = 0; k < 64; ++k) a[i][k] = bf16_bits((i * 7 + k * 3) % 9 - 4);
        for (int k = 0; k < 32; ++k)
            for (int x = 0; x < 64; ++x) b[k][x] = bf16_bits((k * 5 + x * 11) % 7 - 3);
        for (int i = 0; i < 32; ++i)
            for (int n = 0; n < 32; ++n) c[i][n] = static_cast<float>(i - 2 * n);
    }
    template <typename Tiles>
    void run(Tiles& tl) {
        tl.begin();
        tile_block(tl, reinterpret_cast<const char*>(a), 16 * sizeof a[0], sizeof a[0], 64,
                   reinterpret_cast<const char*>(b), 64, sizeof b[0], 16 * sizeof b[0], 2,
                   reinterpret_cast<char*>(c), sizeof c[0], true);
        tl.end();
    }
    static uint16_t bf16_bits(int v) {  // small integers are exact in bf16
        const float f = static_cast<float>(v);
        uint32_t bits;
        std::memcpy(&bits, &f, 4);
        return static_cast<uint16_t>(bits >> 16);
    }
};

// The block run by child_run(Block&) in a child process against the emulated tiles' run here.
template <typename ChildRun>
int first_block_state(ChildRun child_run) {
    void* mem = mmap(nullptr, sizeof(Block), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS,
                     -1, 0);
    if (mem == MAP_FAILED) return kAmxFaulted;
    Block* child = new (mem) Block;
    child->fill();
    static Block soft;  // (SoftTiles and the block: ~30 KB, off the stack)
    soft.fill();
    static SoftTiles emulated;
    soft.run(emulated);
    const pid_t pid = fork();
    if (pid == 0) {  // the child: default signal actions (no handler of the parent's runs)
        for (int sig : {SIGILL, SIGSEGV, SIGBUS, SIGFPE}) signal(sig, SIG_DFL);
        child_run(*child);
        _exit(0);
    }
    int status = 0, state = kAmxFaulted;
    if (pid > 0) {
        while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
        }
        if (WIFEXITED(status) && WEXITSTATUS(status) == 0)
            state = std::memcmp(child->c, soft.c, sizeof soft.c) == 0 ? kAmxGranted : kAmxWrong;
    }
    munmap(mem, sizeof(Block));
    return state;
}

}  // namespace

extern "C" int banyan_amx_state() {
    static const int state = [] {
        if (!cpu_has_amx_bf16()) return static_cast<int>(kAmxNoCpu);
        constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;  // ARCH_REQ_XCOMP_PERM
        if (syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) != 0)
            return static_cast<int>(kAmxRefused);
        return first_block_state([](Block& b) {
            AmxTiles tl;
            b.run(tl);
        });
    }();
    return state;
}

// The check's plumbing, for tests on any CPU: the child runs the emulated tiles (how 0), dies
// of SIGILL (1) or changes one output (2): kAmxGranted, kAmxFaulted, kAmxWrong.
extern "C" int banyan_amx_check_plumbing(int how) {
    return first_block_state([how](Block& b) {
        static SoftTiles tl;
        if (how == 1) raise(SIGILL);
        b.run(tl);
        if (how == 2) b.c[5][7] += 1.0f;
    });
}
#else
extern "C" int banyan_amx_state() { return 0; }  // (no tile code in this build)
extern "C" int banyan_amx_check_plumbing(int) { return 0; }
#endif
