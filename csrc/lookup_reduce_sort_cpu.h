// The backward's order of the lookups (lookup_reduce_sort_cpu.cpp): a stable radix sort of the
// lookups by row, positions ascending within a row, whatever the thread count.
#pragma once

#include <cstdint>
#include <vector>

namespace rmt_lookup {

// Lookup positions grouped by row: run u covers sorted slots [run_start[u], run_start[u + 1]),
// all with row rows[u] (ascending in u). Slot j of packed holds (row << 32) | position, positions
// ascending within a run. The vectors are grown, never shrunk: fresh multi-MB allocations
// page-fault on first touch.
struct SortedLookups {
  std::vector<uint64_t> packed, tmp;
  std::vector<int64_t> run_start, rows;
  std::vector<int64_t> count, slots, slice_runs;  // sort_lookups' scratch: digit counts, next slots, run starts
  int64_t num_runs = 0;
};

inline int64_t sorted_row(uint64_t v) { return static_cast<int64_t>(v >> 32); }
inline int64_t sorted_pos(uint64_t v) { return static_cast<int64_t>(v & 0xffffffffu); }

// The calling thread's sort scratch, kept between its calls (each thread its own: concurrent
// backwards on two threads share nothing).
SortedLookups& caller_sort_scratch();

// Sorts the M lookups into s: lookup j has row idx[j] < num_rows and position pos[j] (j itself
// where pos is null; positions must ascend with j); digits of at most max_bits bits (0: the
// default width, sort_digit_bits()).
void sort_lookups(const int64_t* idx, const int64_t* pos, int64_t M, int64_t num_rows, SortedLookups& s,
                  int max_bits = 0);

}  // namespace rmt_lookup
