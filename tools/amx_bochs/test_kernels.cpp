// Banyan's tile kernels, one call (or a few) each, run with AmxTiles and with SoftTiles on the
// same inputs: cpu_quant_gemm_tiles.h's tile_pair, cpu_prefill_tiles.h's attend_block_tiles and
// cpu_attend_tiles.h's attend_tiles512; and probes of the AVX-512 helpers they use.
#include "cpu_attend_tiles.h"
#include "cpu_prefill_tiles.h"
#include "cpu_quant_gemm_tiles.h"
#include "rt.h"

// A kernel compiled out (its header's CPU-feature guard) would silently leave its cases out.
#if !defined(BANYAN_GEMM_TILES) || !defined(BANYAN_PREFILL_TILES) || !defined(BANYAN_DECODE_TILES)
#error "a tile kernel is compiled out"
#endif
#ifndef RUN_AMX
#define RUN_AMX 1
#endif

namespace {

using harness::compare;

using harness::XorShift;

// roughly normal bf16 (a sum of 4 uniforms) times scale, rounded to nearest even
uint16_t random_bf16(XorShift& r, float scale = 1.0f) {
    float s = 0;
    for (int q = 0; q < 4; ++q) s += static_cast<float>(r.next() % 65536) / 65536.0f - 0.5f;
    s *= scale;
    uint32_t u;
    std::memcpy(&u, &s, 4);
    u += 0x7fff + ((u >> 16) & 1);
    return static_cast<uint16_t>(u >> 16);
}

// The same computation with both tile implementations: run(tiles, result) fills result.
template <typename Result, typename Run>
void run_both(Run run, Result& amx_result, Result& soft_result) {
    static SoftTiles soft;
    run(soft, soft_result);
#if RUN_AMX
    AmxTiles amx;
    run(amx, amx_result);
#else
    amx_result = soft_result;
#endif
}

// ---- quantized GEMM: tile_pair over a group of NP panels, the panels' bf16 pairs read in
// place (stride 1) or in the dequantized tile layout (stride NP); rows 32 (tile_block), 20
// (tile_block over a zero-padded block) and 13 (tile_row_block); with or without row scales.
void quant_case(int64_t K, int64_t rows, bool tile_layout, int seed, bool scaled = false) {
    XorShift r{0x1234567ull + static_cast<uint64_t>(seed)};
    const int np = NP;
    const int64_t N = np * PANEL, pairs = K / 2;
    std::vector<uint16_t> x(32 * K, 0);
    for (int64_t i = 0; i < rows * K; ++i) x[i] = random_bf16(r);
    // panel q's pair j is a 64-byte row (16 outputs x 2 inputs)
    auto* weights = static_cast<__m512i*>(::operator new(pairs * np * 64, std::align_val_t(64)));
    uint16_t* weight_bits = reinterpret_cast<uint16_t*>(weights);
    for (int64_t i = 0; i < pairs * np * 32; ++i) weight_bits[i] = random_bf16(r, 0.25f);
    Panels group{};
    for (int q = 0; q < np; ++q) group.base[q] = tile_layout ? weights + q : weights + q * pairs;
    group.stride = tile_layout ? np : 1;
    std::vector<float> bias(N), row_scales(N);
    for (auto& b : bias) b = static_cast<float>(static_cast<int>(r.next() % 17) - 8) / 16.0f;
    for (auto& v : row_scales) v = static_cast<float>(static_cast<int>(r.next() % 255) + 1) / 64.0f;
    alignas(64) static float c[32 * 32];
    auto run = [&](auto& tl, std::vector<uint16_t>& out) {
        out.assign(rows * N, 0);
        tl.begin();
        for (int q = 0; q < np; q += 2)
            tile_pair(tl, reinterpret_cast<const char*>(x.data()), K * 2, rows, group, q,
                      std::min(q + 1, np - 1), K, 0, bias.data(),
                      scaled ? row_scales.data() : nullptr, out.data(), 0, N, c);
        tl.end();
    };
    std::vector<uint16_t> out_amx, out_soft;
    run_both(run, out_amx, out_soft);
    CaseName name;
    name << "quant-tile_pair-K" << K << "-rows" << rows
         << (tile_layout ? "-tilelayout" : "-inplace") << (scaled ? "-scaled" : "");
    // bf16 outputs compared as 32-bit words: two outputs a word
    compare(name.text, out_amx.data(), out_soft.data(), static_cast<int>(rows * N / 2),
            static_cast<int>(N / 2));
    ::operator delete(weights, std::align_val_t(64));
}

// ---- prefill: attend_block_tiles over bf16 queries and pool, one work item per KV head; the
// pool's slots permuted (kend not a multiple of 7) so that gathers are tested
void prefill_case(int64_t d, int64_t heads, int64_t kv_heads, int64_t prefix, int64_t block,
                  int seed) {
    XorShift r{0xabcdefull + static_cast<uint64_t>(seed)};
    const int64_t tokens = block, kend = prefix + block;
    std::vector<uint16_t> q(tokens * heads * d), k_pool(kend * kv_heads * d);
    std::vector<uint16_t> v_pool(kend * kv_heads * d);
    for (auto& v : q) v = random_bf16(r, 2.0f);
    for (auto& v : k_pool) v = random_bf16(r, 2.0f);
    for (auto& v : v_pool) v = random_bf16(r);
    std::vector<int32_t> slots(kend);
    for (int64_t i = 0; i < kend; ++i) slots[i] = static_cast<int32_t>((i * 7) % kend);
    const float scale = 1.0f / 8.0f;
    auto run = [&](auto& tl, std::vector<uint16_t>& out) {
        out.assign(tokens * heads * d, 0);
        Buffers buffers;
        tl.begin();
        for (int64_t h = 0; h < kv_heads; ++h)
            attend_block_tiles(tl, buffers, q.data(), k_pool.data(), v_pool.data(), nullptr,
                               nullptr, slots.data(), prefix, 0, block, h, heads, kv_heads, d,
                               scale, out.data());
        tl.end();
    };
    std::vector<uint16_t> out_amx, out_soft;
    run_both(run, out_amx, out_soft);
    CaseName name;
    name << "prefill-attend_block_tiles-d" << d << "-h" << heads << "-kvh" << kv_heads
         << "-prefix" << prefix << "-bq" << block;
    compare(name.text, out_amx.data(), out_soft.data(), static_cast<int>(tokens * heads * d / 2),
            static_cast<int>(d / 2));
}

// ---- decode: attend_tiles512 over n keys of KV head 0 for `rows` query rows; its state
// (acc, l, m) compared as three cases
void decode_case(int d, int rows, int64_t n, bool causal, int seed) {
    XorShift r{0x777ull + static_cast<uint64_t>(seed)};
    const int64_t kv_heads = 2, head = 1;
    std::vector<uint16_t> k_pool(n * kv_heads * d), v_pool(n * kv_heads * d);
    for (auto& v : k_pool) v = random_bf16(r, 2.0f);
    for (auto& v : v_pool) v = random_bf16(r);
    std::vector<int32_t> slots(n);
    for (int64_t i = 0; i < n; ++i) slots[i] = static_cast<int32_t>((i * 5) % n);
    std::vector<uint16_t> queries(static_cast<size_t>(rows + kTileBlock) * d, 0);
    for (int64_t i = 0; i < rows * d; ++i) queries[i] = random_bf16(r, 2.0f);
    const float scale = 1.0f / 8.0f;
    struct State {
        std::vector<float> acc, l, m;
    };
    auto run = [&](auto& tl, State& state) {
        Scratch sc;
        TileScratch ts;
        sc.fit(static_cast<int>(tile_rows(rows)), d);
        for (int i = 0; i < rows; ++i) {
            sc.m[i] = -INFINITY;
            sc.l[i] = 0.0f;
            sc.lim[i] = causal ? n - rows + i + 1 : n;
            std::fill_n(sc.acc.data() + static_cast<size_t>(i) * d, d, 0.0f);
        }
        tl.begin();
        attend_tiles512(tl, ts, sc, queries.data(), 0, rows, slots.data(), n, k_pool.data(),
                        v_pool.data(), kv_heads, head, d, scale, causal);
        tl.end();
        state.acc.assign(sc.acc.begin(), sc.acc.begin() + static_cast<size_t>(rows) * d);
        state.l.assign(sc.l.begin(), sc.l.begin() + rows);
        state.m.assign(sc.m.begin(), sc.m.begin() + rows);
    };
    State amx, soft;
    run_both(run, amx, soft);
    auto name = [&](const char* part) {
        CaseName name;
        name << "decode-attend_tiles512-d" << int64_t{d} << "-rows" << int64_t{rows} << "-keys"
             << n << (causal ? "-causal" : "-full") << part;
        return name;
    };
    compare(name("-acc").text, amx.acc.data(), soft.acc.data(), rows * d, d);
    compare(name("-l").text, amx.l.data(), soft.l.data(), rows, rows);
    compare(name("-m").text, amx.m.data(), soft.m.data(), rows, rows);
}

// The kernels' AVX-512 helpers alone on a sweep of inputs. There is no AMX here: each case
// compares a result with itself, and what counts is its hash against the host's (compare.py),
// Bochs's emulation of these instructions against the host CPU's.
void vector_probes() {
    static float in[4096], o1[4096], o2[4096], o3[4096], o4[4096];
    for (int i = 0; i < 4096; ++i) in[i] = -100.0f + 100.0f * static_cast<float>(i) / 4096.0f;
    constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    for (int i = 0; i < 4096; i += 16) {
        const __m512 x = _mm512_loadu_ps(in + i);
        const __m512 rounded = _mm512_roundscale_ps(x, kNearest);
        _mm512_storeu_ps(o1 + i, exp2_nonpos512(x));
        _mm512_storeu_ps(o2 + i, rounded);
        _mm512_storeu_ps(o3 + i, _mm512_scalef_ps(_mm512_set1_ps(1.5f), rounded));
        _mm512_storeu_ps(o4 + i, exp512(x));
    }
    compare("probe-exp2_nonpos512", o1, o1, 4096, 16);
    compare("probe-roundscale", o2, o2, 4096, 16);
    compare("probe-scalef", o3, o3, 4096, 16);
    compare("probe-exp512", o4, o4, 4096, 16);
    static uint16_t b1[4096];
    for (int i = 0; i < 4096; i += 16) {
        const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(in + i), _mm512_set1_ps(1.0001f));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(b1 + i), (__m256i)_mm512_cvtneps_pbh(x));
    }
    compare("probe-cvtneps2bf16", b1, b1, 2048, 8);

    static uint32_t bits[16 * 16 * 4], o5[16 * 16 * 4], o6[64 * 32], o7[64 * 16];
    for (int i = 0; i < 16 * 16 * 4; ++i) bits[i] = 0x01000000u * (i & 0xff) + 0x9e3779b9u * i;
    for (int b = 0; b < 4; ++b) {
        __m512i w[16];
        for (int i = 0; i < 16; ++i) w[i] = _mm512_loadu_si512(bits + b * 256 + i * 16);
        transpose16(w);
        for (int i = 0; i < 16; ++i) _mm512_storeu_si512(o5 + b * 256 + i * 16, w[i]);
    }
    compare("probe-transpose16", o5, o5, 1024, 16);
    const __m512i lo = _mm512_loadu_si512(kPairLo), hi = _mm512_loadu_si512(kPairHi);
    for (int i = 0; i < 32; ++i) {
        const __m512i a = _mm512_loadu_si512(bits + 16 * i);
        const __m512i b = _mm512_loadu_si512(bits + 16 * (i + 32));
        _mm512_storeu_si512(o6 + 32 * i, _mm512_permutex2var_epi16(a, lo, b));
        _mm512_storeu_si512(o6 + 32 * i + 16, _mm512_permutex2var_epi16(a, hi, b));
    }
    compare("probe-permutex2var_epi16", o6, o6, 1024, 16);
    for (int i = 0; i < 32; ++i) {  // bits >> 2: floats of every sign-free exponent
        const __m512i wa = _mm512_srli_epi32(_mm512_loadu_si512(bits + 16 * i), 2);
        const __m512i wb = _mm512_srli_epi32(_mm512_loadu_si512(bits + 16 * (i + 16)), 2);
        const __m512 a = _mm512_mul_ps(_mm512_castsi512_ps(wa), _mm512_set1_ps(1.0f));
        _mm512_storeu_si512(o7 + 16 * i, pair_bf16(a, _mm512_castsi512_ps(wb)));
    }
    compare("probe-pair_bf16", o7, o7, 512, 16);
}

}  // namespace

void kernel_cases() {
    vector_probes();
    quant_case(128, 32, false, 1);
    quant_case(128, 32, true, 2);
    quant_case(256, 20, false, 3);
    quant_case(64, 13, true, 4);
    quant_case(128, 32, true, 5, true);
    quant_case(64, 13, true, 6, true);
    prefill_case(64, 4, 2, 70, 30, 1);
    prefill_case(128, 2, 1, 0, 5, 2);
    prefill_case(128, 8, 2, 100, 17, 3);
    decode_case(64, 3, 200, false, 1);
    decode_case(128, 24, 300, false, 2);
    decode_case(64, 40, 150, true, 3);
}
