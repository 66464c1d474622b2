// The backward's sort: a stable LSD radix sort of packed (row, position) pairs by row, then the
// runs of equal rows (lookup_reduce_sort_cpu.h).
//
// Sorting the packed pairs reads every pass's input sequentially (a position-only sort would look
// the rows up at random). Each pass splits the pairs into contiguous per-thread slices with their
// own digit counts; slots are handed out by digit, then by thread, so the order is the one stable
// order whatever the thread count. All passes and the runs run in one parallel region with two
// barriers per pass: under the passive OpenMP wait policy a waiting thread sleeps, and waking it
// costs tens of microseconds, so a region per pass would cost more than its work.
//
// The runs: each thread takes a slice from its first run start to its last; with several threads
// it counts the run starts in it first, and writes them after the runs of the slices before it.
// The write loop has no branch: every slot writes itself to the next free run entry, and only a
// run start moves past it (the slots that continue a run are overwritten by the next start; none
// follow the slice's last start, so a thread writes only its own entries), as a branch on each
// run start would mispredict on the slots that continue a run.
#include "lookup_reduce_sort_cpu.h"

#include <algorithm>
#include <cstdlib>
#include <limits>

#include "lookup_reduce_cpu.h"

namespace rmt_lookup {

namespace {

// Radix digit width: at most 2^10 buckets per pass, two passes for tables up to 2^20 rows.
// RMT_SORT_DIGIT_BITS (1-16) sets another width, for measurements on other machines.
constexpr int kDigitBits = 10;

int ceil_log2(int64_t n) {
  int bits = 0;
  while (bits < 63 && (int64_t(1) << bits) < n) ++bits;
  return bits;
}

template <typename Vector>
typename Vector::value_type* grown(Vector& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(n);
  return v.data();
}

}  // namespace

int sort_digit_bits() {
  static const int bits = [] {
    const char* env = std::getenv("RMT_SORT_DIGIT_BITS");
    if (env == nullptr || *env == '\0') return kDigitBits;
    char* end = nullptr;
    const long v = std::strtol(env, &end, 10);
    TORCH_CHECK(*end == '\0' && v >= 1 && v <= 16, "RMT_SORT_DIGIT_BITS must be an integer in [1, 16], got '", env,
                "'");
    return static_cast<int>(v);
  }();
  return bits;
}

SortedLookups& caller_sort_scratch() {
  thread_local SortedLookups scratch;
  return scratch;
}

void sort_lookups(const int64_t* __restrict idx, const int64_t* __restrict pos, int64_t M, int64_t num_rows,
                  SortedLookups& s, int max_bits) {
  TORCH_CHECK(M <= std::numeric_limits<int32_t>::max(), "lookup_reduce CPU: at most 2^31-1 lookups; got ", M);
  TORCH_CHECK(num_rows <= (int64_t(1) << 32), "lookup_reduce CPU: at most 2^32 table rows; got ", num_rows);
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), M / kSortSliceMin)));
  if (max_bits == 0) max_bits = sort_digit_bits();
  const int bits = std::max(ceil_log2(num_rows), 1);
  const int passes = (bits + max_bits - 1) / max_bits;
  const int digit = (bits + passes - 1) / passes;
  const int64_t R = int64_t(1) << digit, mask = R - 1;
  uint64_t* __restrict packed = grown(s.packed, M);
  uint64_t* __restrict tmp = grown(s.tmp, M);
  const int64_t stride = R + kCountPad;
  int64_t* __restrict count = grown(s.count, stride * threads);
  int64_t* __restrict slots = grown(s.slots, stride * threads);
  int64_t* __restrict before = grown(s.slice_runs, threads * kCountPad);
  int64_t* __restrict start = grown(s.run_start, M + 1);
  int64_t* __restrict rows = grown(s.rows, M);
#pragma omp parallel num_threads(threads)
  {
    const int nth = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t lo = M * t / nth, hi = M * (t + 1) / nth;
    int64_t* __restrict mine = count + t * stride;
    int64_t* __restrict next = slots + t * stride;
    uint64_t* __restrict src = packed;
    uint64_t* __restrict dst = tmp;
    for (int p = 0; p < passes; ++p) {
      const int shift = 32 + p * digit;
      std::fill(mine, mine + R, int64_t(0));
      if (p == 0) {
        for (int64_t j = lo; j < hi; ++j) ++mine[idx[j] & mask];
      } else {
        for (int64_t j = lo; j < hi; ++j) ++mine[(src[j] >> shift) & mask];
      }
#pragma omp barrier
      // every thread computes its own slots from all threads' counts (no single, whose barrier
      // would put all but one thread to sleep)
      int64_t slot = 0;
      for (int64_t r = 0; r < R; ++r)
        for (int u = 0; u < nth; ++u) {
          if (u == t) next[r] = slot;
          slot += count[u * stride + r];
        }
      if (p == 0) {
        for (int64_t j = lo; j < hi; ++j) {
          const uint64_t v = (static_cast<uint64_t>(idx[j]) << 32) | static_cast<uint64_t>(pos ? pos[j] : j);
          dst[next[(v >> shift) & mask]++] = v;
        }
      } else {
        for (int64_t j = lo; j < hi; ++j) {
          const uint64_t v = src[j];
          dst[next[(v >> shift) & mask]++] = v;
        }
      }
#pragma omp barrier
      std::swap(src, dst);
    }
    auto row = [&](int64_t j) { return src[j] >> 32; };
    int64_t first = lo, last = hi - 1;
    while (first < hi && first > 0 && row(first) == row(first - 1)) ++first;
    while (last > first && row(last) == row(last - 1)) --last;
    int64_t u = 0;  // the slice's next free run entry: the run starts of the slices before it
    if (nth > 1) {
      int64_t n = first < hi;
      for (int64_t j = first + 1; j <= last; ++j) n += row(j) != row(j - 1);
      before[t * kCountPad] = n;
#pragma omp barrier
      for (int v = 0; v < t; ++v) u += before[v * kCountPad];
    }
    uint64_t prev = first < hi ? ~row(first) : 0;  // any row but the first slot's: it starts a run
    for (int64_t j = first; j <= last; ++j) {
      const uint64_t r = row(j);
      start[u] = j;
      rows[u] = static_cast<int64_t>(r);
      u += r != prev;
      prev = r;
    }
    if (t == nth - 1) s.num_runs = u;
  }
  if (passes % 2) std::swap(s.packed, s.tmp);
  start[s.num_runs] = M;
}

// The backward's sort on its own, for tests and inspection (see lookup_reduce_cpu.cpp).
at::Tensor sorted_lookups(const at::Tensor& indices, int64_t num_rows, int64_t digit_bits,
                          const c10::optional<at::Tensor>& positions) {
  TORCH_CHECK(indices.scalar_type() == at::kLong && indices.is_contiguous() && digit_bits >= 0 && digit_bits <= 16,
              "sorted_lookups: contiguous int64 indices and 0 <= digit_bits <= 16");
  const int64_t M = indices.numel();
  if (M) {
    const auto range = at::aminmax(indices);  // one pass for both ends
    TORCH_CHECK(std::get<0>(range).item<int64_t>() >= 0 && std::get<1>(range).item<int64_t>() < num_rows,
                "sorted_lookups: indices must lie in [0, num_rows)");
  }
  const int64_t* pos = nullptr;
  if (positions.has_value()) {
    const at::Tensor& p = *positions;
    TORCH_CHECK(p.scalar_type() == at::kLong && p.is_contiguous() && p.numel() == M,
                "sorted_lookups: positions must be contiguous int64, one per lookup");
    TORCH_CHECK(M < 2 || (at::diff(p) > 0).all().item<bool>(), "sorted_lookups: positions must ascend");
    TORCH_CHECK(M == 0 || (p[0].item<int64_t>() >= 0 && p[M - 1].item<int64_t>() <= UINT32_MAX),
                "sorted_lookups: positions must lie in [0, 2^32)");
    pos = p.data_ptr<int64_t>();
  }
  SortedLookups& s = caller_sort_scratch();
  sort_lookups(indices.data_ptr<int64_t>(), pos, M, num_rows, s, static_cast<int>(digit_bits));
  auto out = at::empty({M}, indices.options());
  std::memcpy(out.data_ptr<int64_t>(), s.packed.data(), M * sizeof(uint64_t));
  return out;
}

}  // namespace rmt_lookup
