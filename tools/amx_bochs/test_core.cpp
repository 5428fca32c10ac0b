// The tile core: Banyan's tile_block and tile_row_block (cpu_amx_tiles.h) run with AmxTiles (the
// real AMX instructions) and with SoftTiles (their emulation) on the same inputs, compared bit
// for bit; cpu_amx_check.cpp's start-up block; and the tile configuration that begin()/end()
// must put back. cpu_amx_check.cpp is included as it is in the working tree.
#include "cpu_amx_check.cpp"
#include "rt.h"

// RUN_AMX=0: the host build (rt_host.cpp), SoftTiles only, whose hashes the guest's must equal.
#ifndef RUN_AMX
#define RUN_AMX 1
#endif

namespace harness {

bool is_nan(uint32_t u) { return (u & 0x7f800000u) == 0x7f800000u && (u & 0x7fffffu); }

// FNV-1a over n words' bytes; nans_merged: every NaN hashed as 0x7fc00000, for builds whose
// code generation may pick another NaN operand to propagate (compare.py, plain -O2)
uint64_t fnv1a(const uint32_t* words, int n, bool nans_merged = false) {
    uint64_t h = 1469598103934665603ull;
    for (int i = 0; i < n; ++i) {
        const uint32_t w = nans_merged && is_nan(words[i]) ? 0x7fc00000u : words[i];
        for (int byte = 0; byte < 4; ++byte)
            h = (h ^ ((w >> (8 * byte)) & 0xff)) * 1099511628211ull;
    }
    return h;
}
int cases_run = 0, cases_differing = 0;

void compare(const char* name, const void* amx, const void* soft, int n, int cols) {
    const uint32_t* a = static_cast<const uint32_t*>(amx);
    const uint32_t* s = static_cast<const uint32_t*>(soft);
    int diff = 0;
    int not_nan_pair = 0;  // differences other than NaN against NaN (any sign or payload)
    for (int i = 0; i < n; ++i) {
        diff += a[i] != s[i];
        not_nan_pair += a[i] != s[i] && !(is_nan(a[i]) && is_nan(s[i]));
    }
    ++cases_run;
    if (diff) ++cases_differing;
    put("CASE ");
    put(name);
    put(" n=");
    dec(n);
    put(" diff=");
    dec(diff);
    put(" soft=");
    hex64(fnv1a(s, n));
    put(" soft_nans_merged=");
    hex64(fnv1a(s, n, true));
#if RUN_AMX
    put(" amx=");
    hex64(fnv1a(a, n));
#endif
    put(diff ? " DIFFER" : " EQUAL");
    if (diff) {
        put(" non_nan_diff=");
        dec(not_nan_pair);
    }
    put("\n");
    int shown = 0;
    for (int i = 0; i < n && shown < 8; ++i)
        if (a[i] != s[i]) {
            put("   row ");
            dec(i / cols);
            put(" col ");
            dec(i % cols);
            put(": amx=");
            hex32(a[i]);
            put(" soft=");
            hex32(s[i]);
            put("\n");
            ++shown;
        }
}

using harness::XorShift;
uint16_t bf16_bits(float f) {  // truncated: the generators below only pass exact values
    uint32_t u;
    memcpy(&u, &f, 4);
    return static_cast<uint16_t>(u >> 16);
}
uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}
float pow2(int e) {  // 2^e for a normal exponent
    const uint32_t u = static_cast<uint32_t>(e + 127) << 23;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

// Input families, each aimed at a way the two implementations could part: the order of the
// additions (order, absorb), flushing of denormals (denorm), specials, and ordinary data.
enum Kind { kSmall, kWide, kOrder, kAbsorb, kDenorm, kSpecial, kGauss };
const char* kind_name[] = {"small", "wide", "order", "absorb", "denorm", "special", "gauss"};

// Fields drawn one statement at a time: C++ leaves the order of the operands of | unspecified,
// and the inputs must not depend on the compiler.
uint16_t bf16_fields(uint32_t sign, uint32_t exponent, uint32_t mantissa) {
    return static_cast<uint16_t>(sign << 15 | exponent << 7 | mantissa);
}
uint32_t f32_fields(uint32_t sign, uint32_t exponent, uint32_t mantissa) {
    return sign << 31 | exponent << 23 | mantissa;
}

// A's and B's bf16 bits; i and j: row and index in the row (used by kAbsorb only)
uint16_t gen_ab(Kind k, XorShift& r, bool is_a, int i, int j) {
    switch (k) {
    case kSmall: return bf16_bits(static_cast<float>(static_cast<int>(r.below(9)) - 4));
    case kWide: {  // |x| in 2^[-40, 40], random sign and mantissa
        const uint32_t e = 127 - 40 + r.below(81);
        const uint32_t sign = r.below(2);
        return bf16_fields(sign, e, r.below(128));
    }
    case kOrder: {  // sums whose value depends on the order: 2^24 + 1 - 2^24, and so on
        static const float av[] = {0, 1, -1, 4096, -4096, 16777216, -16777216, 3, 0.5f,
                                   1.0f / 4096};
        static const float bv[] = {1, 1, 1, -1, 4096, -4096, 0.5f, 3, 1.0f / 4096, 0};
        return bf16_bits(is_a ? av[r.below(10)] : bv[r.below(10)]);
    }
    case kAbsorb: {  // row i's pairs: (2^24, 1), (1, 2^24), (-2^24, -2^24), ... rotated by row
        if (!is_a) return bf16_bits(1.0f);
        static const float v[8] = {16777216, 1, 1, 16777216, -16777216, -16777216, 0, 0};
        return bf16_bits(v[(j + i) % 8]);
    }
    case kDenorm: {
        const uint32_t pick = r.below(7);
        if (pick >= 5) return bf16_bits(static_cast<float>(static_cast<int>(r.below(9)) - 4) *
                                        pow2(-60));
        const uint32_t sign = r.below(2);
        if (pick == 4) return bf16_fields(sign, 0, 0);                  // +-0
        if (pick == 0) return bf16_fields(sign, 0, 1 + r.below(127));   // bf16 denormal
        // 1: tiny normals; 2 and 3: ~2^-63, whose products lie near FLT_MIN
        const uint32_t e = pick == 1 ? 1 + r.below(10) : 127 - 70 + r.below(14);
        return bf16_fields(sign, e, r.below(128));
    }
    case kSpecial: {
        switch (r.below(10)) {
        case 0: return 0x7f80;  // +inf
        case 1: return 0xff80;  // -inf
        case 2: return 0x7fc0;  // qNaN
        case 3: return 0x7f7f;  // max bf16
        case 4: return 0xff00;  // -2^127
        default: return bf16_bits(static_cast<float>(static_cast<int>(r.below(9)) - 4));
        }
    }
    case kGauss:
    default: {
        float s = 0;
        for (int q = 0; q < 4; ++q) s += static_cast<float>(r.below(65536)) / 65536.0f - 0.5f;
        return bf16_bits(s * 2.0f);
    }
    }
}

// C's float bits at row i, column j
uint32_t gen_c(Kind k, XorShift& r, int i, int j) {
    switch (k) {
    case kSmall: return f32_bits(static_cast<float>(i - 2 * j));
    case kWide: {
        const uint32_t e = 127 - 60 + r.below(121);
        const uint32_t sign = r.below(2);
        return f32_fields(sign, e, r.next() & 0x7fffff);
    }
    case kOrder: {
        static const float cv[] = {0, 1, -1, 16777216, -16777216, 16777217.0f, 3, 0.5f};
        return f32_bits(cv[r.below(8)]);
    }
    case kAbsorb:
        return f32_bits((i + j) % 3 == 0 ? -16777216.0f : (i + j) % 3 == 1 ? 1.0f : 0.0f);
    case kDenorm: {
        const uint32_t pick = r.below(5);
        const uint32_t sign = r.below(2);
        if (pick == 0) return f32_fields(sign, 0, 1 + (r.next() & 0x7ffffe));  // float denormal
        if (pick == 1) return f32_fields(sign, 0, 0);                          // +-0
        if (pick == 2) return f32_fields(sign, 1, 0);                          // +-FLT_MIN
        const uint32_t e = 1 + r.below(8);
        return f32_fields(sign, e, r.next() & 0x7fffff);
    }
    case kSpecial: {
        switch (r.below(6)) {
        case 0: return 0x7f800000;
        case 1: return 0x7fc00000;
        case 2: return 0x7f7fffff;
        default: return f32_bits(static_cast<float>(static_cast<int>(r.below(9)) - 4));
        }
    }
    case kGauss:
    default: return f32_bits((static_cast<float>(r.below(65536)) / 32768.0f - 1.0f) * 8.0f);
    }
}

// A 2 x 2 block of tiles over kSteps steps of 32 inputs: A [32][kSteps * 32] bf16,
// B [kSteps * 16 pairs][32 outputs] (two bf16 per word), C [32][32] floats.
constexpr int kSteps = 4;
alignas(64) uint16_t A[32][kSteps * 32];
alignas(64) uint32_t B[kSteps * 16][32];
alignas(64) uint32_t C_in[32][32], C_amx[32][32], C_soft[32][32];

void fill(Kind k, uint64_t seed) {
    XorShift r{seed * 0x9E3779B97F4A7C15ull + 12345};
    for (int i = 0; i < 32; ++i)
        for (int j = 0; j < kSteps * 32; ++j) A[i][j] = gen_ab(k, r, true, i, j);
    for (int p = 0; p < kSteps * 16; ++p)
        for (int n = 0; n < 32; ++n) {
            const uint32_t lo = gen_ab(k, r, false, p, 2 * n);
            B[p][n] = lo | static_cast<uint32_t>(gen_ab(k, r, false, p, 2 * n + 1)) << 16;
        }
    for (int i = 0; i < 32; ++i)
        for (int n = 0; n < 32; ++n) C_in[i][n] = gen_c(k, r, i, n);
}

// row: tile_row_block (16 rows), else tile_block (32); load: C starts from C_in, else zero
template <typename Tiles>
void run_block(Tiles& tl, bool row, bool load, uint32_t (*c)[32]) {
    memcpy(c, C_in, sizeof C_in);
    const char* a = reinterpret_cast<const char*>(A);
    const char* b = reinterpret_cast<const char*>(B);
    char* out = reinterpret_cast<char*>(c);
    tl.begin();
    if (row)
        tile_row_block(tl, a, sizeof A[0], 64, b, 64, sizeof B[0], 16 * sizeof B[0], kSteps, out,
                       sizeof C_in[0], load);
    else
        tile_block(tl, a, 16 * sizeof A[0], sizeof A[0], 64, b, 64, sizeof B[0],
                   16 * sizeof B[0], kSteps, out, sizeof C_in[0], load);
    tl.end();
}

void block_cases() {
    static SoftTiles soft;
    for (int k = kSmall; k <= kGauss; ++k)
        for (int seed = 0; seed < 2; ++seed) {
            fill(static_cast<Kind>(k), static_cast<uint64_t>(k * 10 + seed));
            for (int variant = 0; variant < 4; ++variant) {
                const bool row = variant & 2, load = variant & 1;
                run_block(soft, row, load, C_soft);
#if RUN_AMX
                AmxTiles amx;
                run_block(amx, row, load, C_amx);
#else
                memcpy(C_amx, C_soft, sizeof C_soft);
#endif
                CaseName name;
                name << kind_name[k] << "-" << int64_t{seed} << (row ? "-row" : "-block")
                     << (load ? "-loadC" : "-zeroC");
                compare(name.text, C_amx, C_soft, row ? 16 * 32 : 32 * 32, 32);
            }
        }
}

// cpu_amx_check.cpp's start-up block, run as its check runs it (without the fork)
void startup_check() {
    put("cpu_has_amx_bf16() = ");
    dec(cpu_has_amx_bf16());
    put("\n");
    static Block soft, amx;
    soft.fill();
    amx.fill();
    static SoftTiles emulated;
    soft.run(emulated);
#if RUN_AMX
    AmxTiles tl;
    amx.run(tl);
#else
    amx.run(emulated);
#endif
    compare("startup-check-block", amx.c, soft.c, 32 * 32, 32);
    const bool same = memcmp(amx.c, soft.c, sizeof soft.c) == 0;
    put(same ? "startup memcmp: kAmxGranted\n" : "startup memcmp: kAmxWrong\n");
}

#if RUN_AMX
AmxTiles::Config stored_config() {
    AmxTiles::Config config;
    memset(&config, 0xAA, sizeof config);  // so that bytes sttilecfg leaves alone show
    __asm__ volatile("sttilecfg %0" : "=m"(config) : : "memory");
    return config;
}

// A configuration already loaded (oneDNN's, say) when begin() runs: end() must put it back.
// None loaded: end() releases the tiles (sttilecfg then stores zeros).
void config_restore() {
    AmxTiles::Config foreign;
    foreign.palette = 1;
    for (int i = 0; i < 8; ++i) {
        foreign.colsb[i] = static_cast<uint16_t>(4 * (i + 1));
        foreign.rows[i] = static_cast<uint8_t>(i + 2);
    }
    __asm__ volatile("ldtilecfg %0" : : "m"(foreign) : "memory");
    static Block with_foreign, without;
    with_foreign.fill();
    AmxTiles tl;
    with_foreign.run(tl);
    AmxTiles::Config after = stored_config();
    compare("config-restored", &after, &foreign, 16, 16);

    __asm__ volatile("tilerelease" ::: "memory");
    AmxTiles::Config none = stored_config();
    AmxTiles::Config zero;
    memset(&zero, 0, sizeof zero);
    compare("config-after-release-zero", &none, &zero, 16, 16);

    without.fill();
    AmxTiles t2;
    without.run(t2);
    none = stored_config();
    compare("config-released-by-end", &none, &zero, 16, 16);
}
#endif

}  // namespace harness

void kernel_cases();  // test_kernels.cpp

extern "C" int main() {
    put("BEGIN amx harness\n");
    harness::startup_check();
#if RUN_AMX
    harness::config_restore();
#endif
    harness::block_cases();
    kernel_cases();
    put("SUMMARY cases=");
    dec(harness::cases_run);
    put(" differing=");
    dec(harness::cases_differing);
    put("\nEND\n");
    return 0;
}
