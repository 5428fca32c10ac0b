// rt.h on bare metal inside Bochs, plus what the compiler and Banyan's headers expect from a C
// and C++ runtime: mem* functions, stubs for the libc calls of cpu_amx_check.cpp's fork-based
// check (never reached here), a bump heap for std::vector, and the C++ runtime's hooks.
#include <cstddef>
#include <new>

#include "rt.h"

namespace {
// Bochs's port_e9_hack: each byte written to port 0xE9 goes to Bochs's stdout.
constexpr uint16_t kDebugPort = 0xE9;
// Bochs powers off when "Shutdown" is written to this port (its BIOS's shutdown port).
constexpr uint16_t kShutdownPort = 0x8900;

inline void outb(uint16_t port, uint8_t v) {
    __asm__ volatile("outb %0, %1" : : "a"(v), "Nd"(port));
}
}  // namespace

void put_char(char c) { outb(kDebugPort, static_cast<uint8_t>(c)); }
void put(const char* s) {
    while (*s) put_char(*s++);
}
void hex32(uint32_t v) {
    for (int i = 7; i >= 0; --i) put_char("0123456789abcdef"[(v >> (4 * i)) & 15]);
}
void hex64(uint64_t v) {
    hex32(static_cast<uint32_t>(v >> 32));
    hex32(static_cast<uint32_t>(v));
}
void dec(int64_t v) {
    char digits[24];
    int n = 0;
    if (v < 0) {
        put_char('-');
        v = -v;
    }
    do digits[n++] = static_cast<char>('0' + v % 10); while (v /= 10);
    while (n) put_char(digits[--n]);
}

extern "C" void bx_shutdown() {
    for (const char* s = "Shutdown"; *s; ++s) outb(kShutdownPort, static_cast<uint8_t>(*s));
    for (;;) __asm__ volatile("cli; hlt");
}

// start.S's fault handlers land here: frame = [vector, error code, rip, cs, rflags, ...].
extern "C" void on_exception(const uint64_t* frame) {
    put("\nEXCEPTION vector=");
    dec(static_cast<int64_t>(frame[0]));
    put(" error=");
    hex64(frame[1]);
    put(" rip=");
    hex64(frame[2]);
    put("\n");
    bx_shutdown();
}

namespace {
[[noreturn]] void fatal(const char* what) {
    put("\nFATAL ");
    put(what);
    put("\n");
    bx_shutdown();
    for (;;) {}
}
}  // namespace

// The byte loops read through volatile so that GCC cannot turn them back into calls to the
// functions being defined (build.sh also passes -fno-tree-loop-distribute-patterns).
extern "C" {
void* memcpy(void* dst, const void* src, size_t n) {
    void* ret = dst;
    __asm__ volatile("rep movsb" : "+D"(dst), "+S"(src), "+c"(n) : : "memory");
    return ret;
}
void* memmove(void* dst, const void* src, size_t n) {
    auto* d = static_cast<unsigned char*>(dst);
    auto* s = static_cast<const unsigned char*>(src);
    if (d < s) return memcpy(dst, src, n);
    for (size_t i = n; i > 0; --i) {
        volatile unsigned char byte = s[i - 1];
        d[i - 1] = byte;
    }
    return dst;
}
void* memset(void* dst, int c, size_t n) {
    void* ret = dst;
    __asm__ volatile("rep stosb" : "+D"(dst), "+c"(n) : "a"(c) : "memory");
    return ret;
}
int memcmp(const void* a, const void* b, size_t n) {
    auto* x = static_cast<const unsigned char*>(a);
    auto* y = static_cast<const unsigned char*>(b);
    for (size_t i = 0; i < n; ++i) {
        volatile unsigned char p = x[i], q = y[i];
        if (p != q) return p < q ? -1 : 1;
    }
    return 0;
}

// cpu_amx_check.cpp's fork-based check references these; the harness calls its pieces
// directly, so reaching one is a harness bug, reported as a STUB line.
static void stub(const char* name) {
    put("\nSTUB CALLED: ");
    put(name);
    put("\n");
    bx_shutdown();
}
long syscall(long, ...) { stub("syscall"); return -1; }
int fork() { stub("fork"); return -1; }
int waitpid(int, int*, int) { stub("waitpid"); return -1; }
void* mmap(void*, size_t, int, int, int, long) { stub("mmap"); return nullptr; }
int munmap(void*, size_t) { stub("munmap"); return -1; }
typedef void (*sighandler_t)(int);
sighandler_t signal(int, sighandler_t) { stub("signal"); return nullptr; }
int raise(int) { stub("raise"); return -1; }
void _exit(int) { stub("_exit"); for (;;) {} }
int* __errno_location() {
    static int error_number;
    return &error_number;
}
void* __dso_handle = nullptr;
int __cxa_atexit(void (*)(void*), void*, void*) { return 0; }
void abort() { fatal("abort"); }
}

// A bump heap for the kernels' std::vector buffers: never freed, the run is short. It starts at
// boot.S's stack top (16 MiB; the stack grows down) and stops below the 64 MiB of guest memory.
namespace {
char* heap_next = reinterpret_cast<char*>(0x1000000);
char* const heap_end = reinterpret_cast<char*>(0x3C00000);

void* bump(size_t n, size_t align) {
    if (align < 64) align = 64;  // cache lines, as the kernels' aligned buffers expect
    const uintptr_t p =
        (reinterpret_cast<uintptr_t>(heap_next) + align - 1) & ~static_cast<uintptr_t>(align - 1);
    if (p + n > reinterpret_cast<uintptr_t>(heap_end)) fatal("out of heap");
    heap_next = reinterpret_cast<char*>(p + n);
    return reinterpret_cast<void*>(p);
}
}  // namespace

void* operator new(size_t n) { return bump(n, 64); }
void* operator new[](size_t n) { return bump(n, 64); }
void* operator new(size_t n, std::align_val_t a) { return bump(n, static_cast<size_t>(a)); }
void* operator new[](size_t n, std::align_val_t a) { return bump(n, static_cast<size_t>(a)); }
void operator delete(void*) noexcept {}
void operator delete[](void*) noexcept {}
void operator delete(void*, size_t) noexcept {}
void operator delete[](void*, size_t) noexcept {}
void operator delete(void*, std::align_val_t) noexcept {}
void operator delete[](void*, std::align_val_t) noexcept {}
void operator delete(void*, size_t, std::align_val_t) noexcept {}
void operator delete[](void*, size_t, std::align_val_t) noexcept {}

// libstdc++'s containers call these on misuse; without exceptions the run stops and says so.
namespace std {
[[noreturn]] void __throw_length_error(const char* what) { fatal(what); }
[[noreturn]] void __throw_bad_alloc() { fatal("bad_alloc"); }
[[noreturn]] void __throw_bad_array_new_length() { fatal("bad_array_new_length"); }
}  // namespace std
