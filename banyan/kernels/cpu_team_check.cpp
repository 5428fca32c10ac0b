// The side reads' plumbing (cpu_team.h: SideReads, parallel_for), for tests
// (tests/test_side_reads.py): prefetches change no value, so a walk that skipped or repeated
// lines, or a loop that never took them, would show only as lost speed.
#include <cstdint>

#include "cpu_team.h"

extern "C" {

// The lines a cursor over the ranges (starts[i], bytes[i]) gives in `ticks` ticks, into out
// (ticks entries; 0 once none is left); returns how many it gave.
int64_t banyan_side_reads_walk(const int64_t* starts, const int64_t* bytes, int64_t n,
                               int64_t ticks, int64_t* out) {
    banyan_team::SideReads reads;
    for (int64_t i = 0; i < n; ++i)
        reads.add(reinterpret_cast<const void*>(static_cast<uintptr_t>(starts[i])), bytes[i]);
    banyan_team::SideReads::Cursor cursor(&reads);
    int64_t given = 0;
    for (int64_t t = 0; t < ticks; ++t) {
        const char* line = cursor.next();
        out[t] = static_cast<int64_t>(reinterpret_cast<uintptr_t>(line));
        given += line != nullptr;
    }
    return given;
}

// In a step's team of `threads`: side reads set, then two loops of `items` items. seen[0],
// seen[1]: the items of each loop that ran with a cursor (the first loop takes the reads, the
// second runs without); seen[2]: 1 if the team still held reads after the first loop.
void banyan_side_reads_loops(int64_t threads, int64_t items, int64_t* seen) {
    static const int64_t line[8] = {};  // (real memory: the loop's threads fetch it)
    banyan_team::SideReads reads;
    reads.add(line, sizeof line);
    seen[0] = seen[1] = seen[2] = 0;
    banyan_team::with_team(threads, [&] {
        banyan_team::Team* team = banyan_team::active;
        if (team != nullptr) team->set_side(&reads);
        for (int loop = 0; loop < 2; ++loop) {
            std::atomic<int64_t> with{0};
            banyan_team::parallel_for(items, threads, [&](int64_t) {
                with += banyan_team::side_cursor != nullptr;
                banyan_team::side_tick();
            });
            seen[loop] = with.load();
            if (loop == 0 && team != nullptr) seen[2] = team->take_side() != nullptr;
        }
    });
}

}  // extern "C"
