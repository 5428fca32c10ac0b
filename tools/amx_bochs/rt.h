// The harness's runtime, in two builds: rt.cpp on bare metal inside Bochs (text out on port
// 0xE9, power off over port 0x8900) and rt_host.cpp on the host (stdout, exit). Only what the
// harness needs: no printf, no allocator beyond a bump heap, no static constructors.
#pragma once
#include <cstdint>

extern "C" void bx_shutdown();
void put(const char* s);
void put_char(char c);
void hex32(uint32_t v);
void hex64(uint64_t v);
void dec(int64_t v);

// A case's name built from parts (CaseName() << "quant-K" << K << "-rows" << rows), since
// the bare-metal build has no snprintf. Characters past the buffer are dropped.
struct CaseName {
    char text[128] = {};
    int length = 0;

    CaseName& operator<<(const char* s) {
        while (*s && length < static_cast<int>(sizeof text) - 1) text[length++] = *s++;
        return *this;
    }
    CaseName& operator<<(int64_t v) {
        char digits[24];
        int n = 0;
        if (v < 0) {
            *this << "-";
            v = -v;
        }
        do digits[n++] = static_cast<char>('0' + v % 10); while (v /= 10);
        while (n && length < static_cast<int>(sizeof text) - 1) text[length++] = digits[--n];
        return *this;
    }
};

namespace harness {
// The cases' inputs: a xorshift generator, the same sequence on bare metal and on the host.
struct XorShift {
    uint64_t s;
    uint32_t next() {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        return static_cast<uint32_t>(s >> 11);
    }
    uint32_t below(uint32_t n) { return next() % n; }
};

// Compares n 32-bit outputs of the AMX run with the SoftTiles run (rows of `cols` words) and
// prints the CASE line compare.py reads (test_core.cpp).
void compare(const char* name, const void* amx, const void* soft, int n, int cols);
}  // namespace harness
