// rt.h on the host: the same harness built natively prints the SoftTiles results the guest's
// SoftTiles results must equal (the host CPU's float arithmetic against Bochs's).
#include <cstdio>
#include <cstdlib>

#include "rt.h"

void put_char(char c) { std::putchar(c); }
void put(const char* s) { std::fputs(s, stdout); }
void hex32(uint32_t v) { std::printf("%08x", v); }
void hex64(uint64_t v) { std::printf("%016llx", static_cast<unsigned long long>(v)); }
void dec(int64_t v) { std::printf("%lld", static_cast<long long>(v)); }
extern "C" void bx_shutdown() { std::exit(0); }
