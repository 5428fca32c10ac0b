// The kernels' parallel loops, and a step's threads kept together between them.
//
// The kernels the layer stack calls share their work out through parallel_for / parallel_team
// below. Called on their own (the per-op path), each opens an OpenMP region as before. Inside
// the layer stack's step (cpu_layer_stack.cpp) one region holds the threads for the whole step:
// its thread 0 runs the step, and the others wait on a spin flag for each loop's share (Team).
// An empty libgomp region of 2 threads costs ~1 us (its two barriers and the team's
// bookkeeping); two threads streaming 160 KB (an int4 qkv projection's weights) took 5.0 us a
// region and 4.5 us a Team job (Zen 5); a one-token step has five such loops a layer, ~150 a
// step. Which thread computes what changes no bit: every kernel gives the same bits on any
// thread count.
#pragma once

#include <omp.h>

#include <atomic>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace banyan_team {

// One loop's share for thread `tid` of `n`: a contiguous run of [0, count), as OpenMP's
// schedule(static) cuts it (the first count % n threads one item more).
struct Share {
    int64_t begin, end;
    Share(int64_t count, int tid, int n) {
        const int64_t q = count / n, r = count % n;
        begin = tid * q + (tid < r ? tid : r);
        end = begin + q + (tid < r ? 1 : 0);
    }
};

// One turn of a spin-wait: x86's `pause` (less power, and the core to a sibling thread).
inline void spin_pause() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

// Memory a later op will read, fetched into cache during an earlier op's loop: a line at a
// time as that loop's kernel fetches its own data ahead (side_tick), by every thread of it.
// Why: a lone decode's attention reads its K/V cold (the weights streamed through every cache
// since the last step), by KV head, ~0.2 ms of a 3.5 ms int4 step over 200 keys more than
// from cache; beside a projection's weight stream, whose loads wait on memory anyway, the same
// lines cost little. Paced, not in a burst: a burst of prefetches overflows the core's miss
// buffers and is partly dropped (Zen 4: a burst over 150 KB warmed about half of it).
class SideReads {
    struct Range {
        const char *begin, *end;
    };

  public:
    void clear() { ranges_.clear(); }
    void add(const void* at, int64_t bytes) {  // whole 64-byte lines from at's line
        if (bytes <= 0) return;
        const auto first = reinterpret_cast<uintptr_t>(at) & ~uintptr_t{63};
        const auto end = reinterpret_cast<uintptr_t>(at) + static_cast<uintptr_t>(bytes);
        ranges_.push_back(Range{reinterpret_cast<const char*>(first),
                                reinterpret_cast<const char*>((end + 63) & ~uintptr_t{63})});
    }

    // One thread's walk over the lines, range by range.
    class Cursor {
      public:
        explicit Cursor(const SideReads* reads)
            : range_(reads->ranges_.data()), last_(range_ + reads->ranges_.size()),
              line_(range_ != last_ ? range_->begin : nullptr) {}
        const char* next() {  // the next line, or null once none is left
            if (range_ == last_) return nullptr;
            const char* line = line_;
            if ((line_ += 64) == range_->end && ++range_ != last_) line_ = range_->begin;
            return line;
        }
        void fetch_one() {  // (a prefetch changes no value: any line, any thread, any order)
            if (const char* line = next()) __builtin_prefetch(line, 0, 2);
        }

      private:
        const Range *range_, *last_;
        const char* line_;
    };

  private:
    std::vector<Range> ranges_;
};

// This thread's side reads while it runs its share of a loop that took some (else null). Read
// once per kernel call (a panel of weights), through __tls_get_addr: the initial-exec model,
// one load, leaves the library unloadable beside torch ("cannot allocate memory in static TLS
// block"), and the call is ~5 ns a panel of 4.6-24 KB.
inline thread_local SideReads::Cursor* side_cursor = nullptr;

// Called by kernels as they fetch their own data ahead, once per 64-byte line of weights: the
// one-token loops of the int4 / int8 bf16 kernels (their other loops would carry the check for
// nothing, and steps of 4 / 13 tokens measured 3-4.5% slower with it there).
inline void side_tick() {
    if (side_cursor != nullptr) side_cursor->fetch_one();
}

class Team;

// The team the calling thread runs a step for (its thread 0), or null; null while it runs its
// own share of a job, so that a loop nested in a job's body runs on that thread alone, as a
// region nested in a region did.
inline thread_local Team* active = nullptr;

class Team {
  public:
    explicit Team(int threads) : n_(threads) {}

    int size() const { return n_; }
    void resize(int threads) { n_ = threads; }

    // Reads for the next parallel_for to fetch beside its items (null: none). The caller keeps
    // them alive until that loop is done, and clears them if no loop took them.
    void set_side(const SideReads* reads) { side_ = reads; }
    const SideReads* take_side() {
        const SideReads* reads = side_;
        side_ = nullptr;
        return reads;
    }

    // fn(ctx, tid, threads) on threads 0 .. threads - 1 (this thread is 0), back when all are
    // done. Called by thread 0 only.
    void run(int threads, void (*fn)(void*, int, int), void* ctx) {
        job_ = Job{fn, ctx, threads};
        done_.store(0, std::memory_order_relaxed);
        seq_.fetch_add(1, std::memory_order_release);
        active = nullptr;
        fn(ctx, 0, threads);
        active = this;
        wait_done();
    }

    // The other threads' loop until stop().
    void serve(int tid) {
        uint64_t seen = 0;
        for (;;) {
            uint64_t s;
            while ((s = seq_.load(std::memory_order_acquire)) == seen) spin_pause();
            seen = s;
            const Job job = job_;
            if (job.fn == nullptr) return;
            if (tid < job.threads) job.fn(job.ctx, tid, job.threads);
            // every thread acknowledges, taking part or not, so that none reads job_ while
            // thread 0 writes the next one
            done_.fetch_add(1, std::memory_order_acq_rel);
        }
    }

    void stop() {
        job_ = Job{nullptr, nullptr, 0};
        done_.store(0, std::memory_order_relaxed);
        seq_.fetch_add(1, std::memory_order_release);
    }

  private:
    struct Job {
        void (*fn)(void*, int, int);
        void* ctx;
        int threads;
    };
    void wait_done() {
        while (done_.load(std::memory_order_acquire) != n_ - 1) spin_pause();
    }
    alignas(64) std::atomic<uint64_t> seq_{0};
    alignas(64) std::atomic<int> done_{0};
    alignas(64) Job job_{nullptr, nullptr, 0};
    int n_;
    const SideReads* side_ = nullptr;
};

// body(tid, n) once on each of n threads, n = min(threads, the team's size) inside a step,
// else what OpenMP gives for `threads`; one thread: here, without a region.
template <typename F>
void parallel_team(int64_t threads, F&& body) {
    if (threads <= 1) {
        body(0, 1);
        return;
    }
    if (Team* team = active) {
        const int n = static_cast<int>(threads < team->size() ? threads : team->size());
        if (n > 1) {
            using Body = std::remove_reference_t<F>;
            team->run(n, [](void* ctx, int tid, int m) { (*static_cast<Body*>(ctx))(tid, m); },
                      const_cast<void*>(static_cast<const void*>(&body)));
            return;
        }
        body(0, 1);
        return;
    }
#pragma omp parallel num_threads(static_cast<int>(threads))
    body(omp_get_thread_num(), omp_get_num_threads());
}

// body(i) for i in [0, count), the items cut among the threads as schedule(static) cuts them;
// inside a step, the team's side reads (if set) fetched by each thread beside its items.
template <typename F>
void parallel_for(int64_t count, int64_t threads, F&& body) {
    const SideReads* side = active != nullptr ? active->take_side() : nullptr;
    parallel_team(threads < count ? threads : count, [&](int tid, int n) {
        const Share share(count, tid, n);
        if (side == nullptr) {
            for (int64_t i = share.begin; i < share.end; ++i) body(i);
            return;
        }
        // every thread fetches every line: which thread reads which is the later op's business
        // (a lone decode's attention hands out its KV heads as threads come free); half the
        // lines a thread, interleaved, measured no better (Zen 4)
        SideReads::Cursor cursor(side);
        side_cursor = &cursor;
        for (int64_t i = share.begin; i < share.end; ++i) body(i);
        side_cursor = nullptr;  // (lines left unfetched: a kernel that does not tick fetches none)
    });
}

// The step: fn() on thread 0 of a region of `threads` threads, the others serving its loops.
template <typename F>
void with_team(int64_t threads, F&& fn) {
    if (threads <= 1 || active != nullptr) {
        fn();
        return;
    }
    Team team(static_cast<int>(threads));  // (shared by the region's threads)
#pragma omp parallel num_threads(static_cast<int>(threads))
    {
        if (omp_get_thread_num() == 0) {
            team.resize(omp_get_num_threads());  // (only thread 0 reads the size)
            active = &team;
            fn();
            active = nullptr;
            team.stop();
        } else {
            team.serve(omp_get_thread_num());
        }
    }
}

}  // namespace banyan_team
