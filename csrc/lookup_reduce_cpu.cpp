// Fused lookup-reduce, CPU (OpenMP) kernels, bound through torch's extension API.
//
// Contract (see rmt/ops/lookup_reduce.py):
//   out[t, b, cD:(c+1)D'] = sum_{k : block[t,k]==b} scores[t,k,c] * table[idx[t,k], cD':(c+1)D']
// with D' = D / C. Inputs arrive validated and contiguous from Python; indices and block ids are
// int64.
//
// Dtypes: every kernel takes two element types, table_t (the table and its gradient) and scalar_t
// (scores, output, output gradient, score gradients): either one type for all (fp32, fp64, bf16,
// fp16), or a bf16/fp16 table with fp32 scores (see dispatch_dtypes). Table values are converted
// exactly to the accumulation type acc_t (fp64 for fp64 scores, else fp32) and every result is
// rounded once to its own type (cpu_numerics.h), so a narrow table adds no rounding beyond its
// storage and the final rounding of its gradient rows. Products are accumulated with explicit
// fused multiply-adds (madd), the same in every instantiation: a narrow table's results are the
// fp32 table's on the same values, bit for bit.
//
// Forward: tokens in order, the rows a few lookups ahead prefetched. With one virtual block and
// column groups of a multiple of kTile columns, each kTile-column output tile is accumulated in
// registers; otherwise one pass per token accumulates all E blocks in a small buffer.
//
// Backward is deterministic and atomic-free: a stable LSD radix sort orders packed (row, position)
// pairs by row (positions ascending within a row; each pass split into per-thread slices), then
// the sorted runs are cut into chunks at run boundaries and the threads take whole chunks. One
// thread reduces each run in sorted order, so every row's gradient is the same sum in the same
// order whatever the thread count; the same pass computes the score gradients, reading each
// touched table row once, in ascending address order. Where few lookups share their row with
// another (plan_token_order), the backward with the optimizer fused in takes the token order
// instead: two bitmaps over the rows find the rows looked up once and more than once; a lookup of
// a row looked up once is its row's whole gradient and steps the row in position order (its
// output-gradient row, scores and score-gradient slot read in order, no sort), and only the
// others are sorted and reduced run by run as above. Both orders give the same table, state and
// score gradients, bit for bit.
//
// Table gradient outputs:
//   sparse: the touched rows [U] and their gradients [U, D];
//   dense:  the [N, D] gradient written in one pass, each chunk of table rows zero-filled
//           between its touched rows, which are written directly (no [U, D] intermediate);
//   fused:  none: each row's gradient, once summed, steps the row and its optimizer state in place
//           (SparseAdam or row-wise Adagrad, the rules of row_optim.h), as FBGEMM's table-batched
//           embeddings do; the score gradients are computed before the row changes.
// All outputs (rows, row or dense table gradients, score gradients) come from small pools of
// buffers: a buffer is handed out again only once nothing but the pool references its storage (the
// gradient that aliased it was freed), so repeated steps skip the first-touch page faults of fresh
// multi-MB (for the dense gradient: table-sized) allocations.
#include <torch/extension.h>
#include <ATen/OpMathType.h>
#include <omp.h>
#if defined(__SSE2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <cstdint>
#include <limits>
#include <mutex>
#include <new>
#include <tuple>
#include <type_traits>
#include <vector>

#include "cpu_numerics.h"
#include "cpu_prefetch.h"
#include "row_optim.h"

namespace {

using rmt_cpu::madd;
using rmt_cpu::prefetch_l2;
using rmt_cpu::prefetch_row;
using rmt_cpu::round_to;

// The accumulation type of a kernel whose scores have type T.
template <typename T>
struct Acc {
  using type = float;
};
template <>
struct Acc<double> {
  using type = double;
};

// Rows (and their lookups' output-gradient rows, scores and block ids) prefetched 24 lookups ahead
// of use, into L2 (cpu_prefetch.h).
constexpr int64_t kPrefetchDistance = 24;
// Output columns accumulated in registers per pass (4 AVX-512 registers of fp32).
constexpr int64_t kTile = 64;
// Radix sort digit width (at most 2^bits buckets per pass): RMT_SORT_DIGIT_BITS where set, else 10
// bits on several threads and by CPU vendor on one, as measured. Every bucket is a stream of
// stores into a destination the other layers' work evicted from the cache. One thread stores
// straight into it: on a 2-core Xeon 32 buckets keep the hardware prefetchers ahead of every
// stream and 1024 do not (every line's read-for-ownership stalls): 131k lookups of a 2^20-row
// table sorted cold in 1.36 ms in 4 passes of 32 buckets against 2.59 ms in 2 of 1024. On a
// 2-core AVX2 EPYC the fewer passes win (one core, cold, medians of 30; 5 / 7 / 10 bits): 131k
// lookups of 2^20 rows 3.0 / 2.3 / 1.5 ms, 524k of 2^20 12.7 / 9.4 / 5.9, 131k of 2^24 3.5 / 3.0 /
// 1.9. Several threads write through line buffers (sort_lookups), which need no prefetcher, and
// every pass costs them two barriers: on the Xeon's 2 threads the same sort took 1.55-1.63 ms in 4
// passes of 5 bits stored straight, 1.66 in 2 of 10 stored straight, 1.15-1.20 in 2 of 10
// through line buffers (on one thread those took 1.67-1.70, and 5 bits through them 2.4). Timing
// the widths once per process picked 10 on the EPYC in 0.1 s, but its multi-MB scratch, malloc'd
// and freed, raised glibc's dynamic mmap threshold, so that the process's later allocations up
// to that size stayed in the heap (tests/test_bench_memory_scale.py measured 4-5 MB of growth for
// 12 predicted): a side effect on the user's process, so not kept.
int max_digit_bits(int threads) {
  static const int forced = [] {
    const char* env = std::getenv("RMT_SORT_DIGIT_BITS");
    if (env == nullptr || *env == '\0') return 0;
    char* end = nullptr;
    const long v = std::strtol(env, &end, 10);
    TORCH_CHECK(*end == '\0' && v >= 1 && v <= 16, "RMT_SORT_DIGIT_BITS must be an integer in [1, 16], got '", env,
                "'");
    return static_cast<int>(v);
  }();
  static const bool amd = [] {
    __builtin_cpu_init();
    return __builtin_cpu_is("amd") != 0;
  }();
  return forced ? forced : threads > 1 || amd ? 10 : 5;
}
// Per-thread digit counts are padded to separate cache lines: they are incremented for every
// element, and a line shared by two threads' counts would move between their caches each time.
constexpr int64_t kCountPad = 64 / sizeof(int64_t);
// Fewest sorted lookups whose runs (two 8-byte entries a run) are written around the cache: from
// 2^16 lookups on (1 MB and more, about a core's L2 cache) the lines of those arrays, evicted
// by the other layers' work, are not worth reading for ownership. 2^17 lookups of 2^20 rows (cold
// cache, medians of 30-40 interleaved calls): the sparse backward about 0.1 ms faster on two
// threads; on one the sort gained 0.08-0.11 ms and the kernel, which then reads those arrays from
// memory, gave it back (the backward -0.05 to +0.07 ms).
constexpr int64_t kStreamRunsMin = int64_t(1) << 16;
// Sort slots per 64-byte line.
constexpr int64_t kLine = 64 / sizeof(uint64_t);
// Fewest lookups per thread for a parallel sort pass.
constexpr int64_t kSortSliceMin = 16384;
// Work is handed out in small chunks (dynamic schedule), so a thread that the OS preempts (a
// shared machine) delays the others by at most one chunk. Forward: tokens per chunk; backward:
// chunks per thread (whole runs of one row each; any chunking gives equal results).
constexpr int64_t kTokensPerChunk = 16;
constexpr int64_t kChunksPerThread = 32;
// Gradient buffers kept for reuse (one per memory layer whose gradient is alive at once).
constexpr size_t kPoolSlots = 8;

// Calls f(kD, kC) with the row width D and score-column count C as compile-time constants
// (std::integral_constant) for the common small shapes, and as 0 (read them at run time)
// otherwise: loops over 32 or 64 columns of runtime length cost a fifth of the forward at
// D = 64, C = 2 (UltraMem's two score cores).
template <typename F>
void dispatch_row_shape(int64_t D, int64_t C, F&& f) {
  using std::integral_constant;
  if (D == 64 && C == 1) return f(integral_constant<int64_t, 64>(), integral_constant<int64_t, 1>());
  if (D == 64 && C == 2) return f(integral_constant<int64_t, 64>(), integral_constant<int64_t, 2>());
  if (D == 128 && C == 1) return f(integral_constant<int64_t, 128>(), integral_constant<int64_t, 1>());
  if (D == 128 && C == 2) return f(integral_constant<int64_t, 128>(), integral_constant<int64_t, 2>());
  f(integral_constant<int64_t, 0>(), integral_constant<int64_t, 0>());
}

// The row width: kD's value where dispatch_row_shape made it a compile-time constant, else D.
template <typename KD>
constexpr int64_t row_width(KD, int64_t D) {
  return KD::value ? KD::value : D;
}

// Forward of token t when E == 1 and kTile divides D/C: each kTile-column tile of the output is
// accumulated in a fixed-size local array, which the compiler keeps in vector registers. The
// first tile prefetches the rows kPrefetchDistance lookups ahead.
template <typename table_t, typename scalar_t>
inline void forward_token_tiles(const table_t* __restrict table, const int64_t* __restrict idx,
                                const scalar_t* __restrict scores, scalar_t* __restrict o, int64_t t,
                                int64_t M, int64_t K, int64_t C, int64_t D) {
  using acc_t = typename Acc<scalar_t>::type;
  const int64_t Dc = D / C, row_bytes = D * static_cast<int64_t>(sizeof(table_t));
  for (int64_t d0 = 0; d0 < D; d0 += kTile) {
    const int64_t c = d0 / Dc;
    acc_t acc[kTile] = {};
    for (int64_t i = t * K; i < (t + 1) * K; ++i) {
      if (d0 == 0 && i + kPrefetchDistance < M) prefetch_row(table + idx[i + kPrefetchDistance] * D, row_bytes);
      const acc_t w = static_cast<acc_t>(scores[i * C + c]);
      const table_t* __restrict row = table + idx[i] * D + d0;
#pragma omp simd
      for (int64_t d = 0; d < kTile; ++d) acc[d] = madd(w, static_cast<acc_t>(row[d]), acc[d]);
    }
    for (int64_t d = 0; d < kTile; ++d) o[d0 + d] = round_to<scalar_t>(acc[d]);
  }
}

// Forward of token t, general case (virtual blocks, narrow column groups): one pass over the
// token's lookups accumulating into acc[E * D] in memory. kD, kC: D and C fixed at compile time,
// or 0 (see dispatch_row_shape).
template <typename table_t, typename scalar_t, typename acc_t, int64_t kD, int64_t kC>
inline void forward_token_blocks(const table_t* __restrict table, const int64_t* __restrict idx,
                                 const scalar_t* __restrict scores, const int64_t* __restrict blk,
                                 acc_t* __restrict acc, scalar_t* __restrict o, int64_t t, int64_t M,
                                 int64_t K, int64_t runtime_C, int64_t runtime_D, int64_t E) {
  const int64_t C = kC ? kC : runtime_C, D = kD ? kD : runtime_D;
  const int64_t Dc = D / C, row_bytes = D * static_cast<int64_t>(sizeof(table_t));
  std::fill(acc, acc + E * D, acc_t(0));
  for (int64_t i = t * K; i < (t + 1) * K; ++i) {
    if (i + kPrefetchDistance < M) prefetch_row(table + idx[i + kPrefetchDistance] * D, row_bytes);
    const table_t* __restrict row = table + idx[i] * D;
    acc_t* __restrict a = acc + (blk ? blk[i] : 0) * D;
    for (int64_t c = 0; c < C; ++c) {
      const acc_t w = static_cast<acc_t>(scores[i * C + c]);
#pragma omp simd
      for (int64_t d = c * Dc; d < (c + 1) * Dc; ++d) a[d] = madd(w, static_cast<acc_t>(row[d]), a[d]);
    }
  }
#pragma omp simd
  for (int64_t j = 0; j < E * D; ++j) o[j] = round_to<scalar_t>(acc[j]);
}

template <typename table_t, typename scalar_t>
void forward_kernel(const table_t* __restrict table, const int64_t* __restrict idx,
                    const scalar_t* __restrict scores, const int64_t* __restrict blk,
                    scalar_t* __restrict out, int64_t T, int64_t K, int64_t C, int64_t D,
                    int64_t E) {
  using acc_t = typename Acc<scalar_t>::type;
  const int64_t M = T * K;
  const bool tiles = E == 1 && (D / C) % kTile == 0;
  dispatch_row_shape(D, C, [&](auto kD, auto kC) {
#pragma omp parallel num_threads(at::get_num_threads())
    {
      std::vector<acc_t> acc(tiles ? 0 : E * D);
#pragma omp for schedule(dynamic, kTokensPerChunk)
      for (int64_t t = 0; t < T; ++t) {
        if (tiles) {
          forward_token_tiles(table, idx, scores, out + t * D, t, M, K, C, D);
        } else {
          forward_token_blocks<table_t, scalar_t, acc_t, decltype(kD)::value, decltype(kC)::value>(
              table, idx, scores, blk, acc.data(), out + t * E * D, t, M, K, C, D, E);
        }
      }
    }
  });
}

// Stores of gradient bytes that bypass the cache (non-temporal stores of whole 64-byte lines with
// AVX-512, else of 16-byte pieces with SSE2, over the aligned part of the range): a gradient is written once and read back much later by the optimizer, so
// fetching its old cache lines first (read-for-ownership) would double the memory traffic.
// src == nullptr writes zeros. Callers issue stream_fence() before the data is read.
inline void stream_store(void* dst, const void* src, int64_t bytes) {
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
#if defined(__AVX512F__)
  const int64_t head = std::min<int64_t>(bytes, (64 - reinterpret_cast<uintptr_t>(d) % 64) % 64);
  if (s) std::memcpy(d, s, head); else std::memset(d, 0, head);
  int64_t off = head;
  for (; off + 64 <= bytes; off += 64) {
    const __m512i v = s ? _mm512_loadu_si512(s + off) : _mm512_setzero_si512();
    _mm512_stream_si512(reinterpret_cast<__m512i*>(d + off), v);
  }
  d += off;
  if (s) s += off;
  bytes -= off;
#elif defined(__SSE2__)
  const int64_t head = std::min<int64_t>(bytes, (16 - reinterpret_cast<uintptr_t>(d) % 16) % 16);
  if (s) std::memcpy(d, s, head); else std::memset(d, 0, head);
  int64_t off = head;
  for (; off + 16 <= bytes; off += 16) {
    const __m128i v = s ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + off)) : _mm_setzero_si128();
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + off), v);
  }
  d += off;
  if (s) s += off;
  bytes -= off;
#endif
  if (s) std::memcpy(d, s, bytes); else std::memset(d, 0, bytes);
}

// One 64-byte line from src to the line-aligned dst with a non-temporal store (a plain copy where
// the CPU has no streaming stores).
inline void stream_line(void* dst, const void* src) {
#if defined(__AVX512F__)
  _mm512_stream_si512(static_cast<__m512i*>(dst), _mm512_load_si512(src));
#elif defined(__SSE2__)
  for (int i = 0; i < 4; ++i)
    _mm_stream_si128(static_cast<__m128i*>(dst) + i, _mm_load_si128(static_cast<const __m128i*>(src) + i));
#else
  std::memcpy(dst, src, 64);
#endif
}

// One 8-byte value stored around the cache (a plain store where the CPU has no streaming stores).
inline void stream_int64(int64_t* dst, int64_t v) {
#if defined(__SSE2__)
  _mm_stream_si64(reinterpret_cast<long long*>(dst), static_cast<long long>(v));
#else
  *dst = v;
#endif
}

inline void stream_fence() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

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

// An allocator of cache-line-aligned storage: the sort's arrays are written a whole 64-byte line
// at a time (stream_line).
template <typename T>
struct LineAligned {
  using value_type = T;
  LineAligned() = default;
  template <typename U>
  LineAligned(const LineAligned<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <typename U>
  bool operator==(const LineAligned<U>&) const { return true; }
  template <typename U>
  bool operator!=(const LineAligned<U>&) const { return false; }
};

// Lookup positions grouped by row: run u covers sorted slots [run_start[u], run_start[u + 1]),
// all with row rows[u] (ascending in u). Slot j holds (row << 32) | position, positions
// ascending within a run. The vectors persist across calls (grown, never shrunk): fresh
// multi-MB allocations page-fault on first touch.
struct SortedLookups {
  std::vector<uint64_t, LineAligned<uint64_t>> packed, tmp, lines;  // lines: the scatter's line buffers
  std::vector<int64_t> run_start, rows;
  std::vector<int64_t> count, slots, firsts, slice_runs;  // sort_lookups' scratch: digit counts, next and first
                                                         // slots, run starts
  int64_t num_runs = 0;
};

inline int64_t sorted_row(uint64_t v) { return static_cast<int64_t>(v >> 32); }
inline int64_t sorted_pos(uint64_t v) { return static_cast<int64_t>(v & 0xffffffffu); }

// Stable LSD radix sort of the packed (row, position) pairs by row < num_rows, digits of at
// most max_bits bits (0: max_digit_bits for the thread count), then the runs of equal rows
// (s.run_start, s.rows, s.num_runs). Lookup j has row idx[j] and position pos[j] (j itself where
// pos is null; positions must ascend with j).
// Sorting the packed pairs reads every pass's input sequentially (a position-only sort would look
// the rows up at random). Each pass splits the pairs into contiguous per-thread slices with their
// own digit counts; slots are handed out by digit, then by thread, so the order is the one stable
// order whatever the thread count.
//
// All passes and the runs run in one parallel region with two barriers per pass, and every
// thread computes its own slots from all threads' counts (R x threads additions, the same work
// a single thread did between two barriers while the others waited). Under the passive OpenMP
// wait policy (rmt/__init__.py) a thread that waits sleeps, and waking it took 25-40 us on a
// 2-core Xeon VM. A region per pass (each with a barrier and a single) and one more for the runs
// made a thread wait about 20 times per sort, 11 times here: 2^17 lookups of 2^20 rows on 2
// threads sorted in 2.3-2.4 ms that way, 1.8-1.9 ms this way (one thread: the same).
//
// Several threads scatter through a 64-byte buffer line per bucket (software write-combining,
// Polychroniou and Ross, SIGMOD 2014): a slot's pair goes to its bucket's line, and a completed
// line is written with one non-temporal store, so the destination's lines are never read for
// ownership, and 1024 buckets cost 64 KB of buffer instead of 1024 store streams. A bucket's
// first and last lines, which it may share with other buckets or threads, are written pair by
// pair. With 10-bit digits that halves the passes and their barriers: the sparse backward of 2^17
// lookups of 2^20 rows on 2 threads took 4.98-5.01 ms against 5.34-5.40 with 4 passes of 5 bits
// stored straight (cold cache, medians of 30 interleaved calls); on one thread the line buffers
// gained nothing (their branch per pair costs what the passes save), so one thread stores
// straight.
//
// The runs: each thread takes a slice from its first run start to its last; with several
// threads it counts the run starts in it first, and writes them after the runs of the slices
// before it. The write loop has no branch: every slot writes itself to the next free run entry,
// and only a run start moves past it (the slots that continue a run are overwritten by the next
// start; none follow the slice's last start, so a thread writes only its own entries). A loop
// that branched on each run start, after a count pass also run by a single thread, took 0.26 ms
// of the 0.75 ms sort of 2^17 lookups of 2^20 rows on one core (the ~6% of slots that continue a
// run mispredict); this one 0.09.
void sort_lookups(const int64_t* __restrict idx, const int64_t* __restrict pos, int64_t M, int64_t num_rows,
                  SortedLookups& s, int max_bits = 0) {
  TORCH_CHECK(M <= std::numeric_limits<int32_t>::max(), "lookup_reduce CPU: at most 2^31-1 lookups; got ", M);
  TORCH_CHECK(num_rows <= (int64_t(1) << 32), "lookup_reduce CPU: at most 2^32 table rows; got ", num_rows);
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), M / kSortSliceMin)));
  if (max_bits == 0) max_bits = max_digit_bits(threads);
  const int bits = std::max(ceil_log2(num_rows), 1);
  const int passes = (bits + max_bits - 1) / max_bits;
  const int digit = (bits + passes - 1) / passes;
  const int64_t R = int64_t(1) << digit, mask = R - 1;
  uint64_t* __restrict packed = grown(s.packed, M);
  uint64_t* __restrict tmp = grown(s.tmp, M);
  const int64_t stride = R + kCountPad;
  int64_t* __restrict count = grown(s.count, stride * threads);
  int64_t* __restrict slots = grown(s.slots, stride * threads);
  int64_t* __restrict firsts = grown(s.firsts, stride * threads);
  // The line buffers serve several threads only (one stores straight, below).
  uint64_t* __restrict lines = threads > 1 ? grown(s.lines, R * kLine * threads) : nullptr;
  int64_t* __restrict before = grown(s.slice_runs, threads * kCountPad);
  int64_t* __restrict start = grown(s.run_start, M + 1);
  int64_t* __restrict rows = grown(s.rows, M);
#pragma omp parallel num_threads(threads)
  {
    const int nth = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t lo = M * t / nth, hi = M * (t + 1) / nth;
    int64_t* __restrict mine = count + t * stride;
    int64_t* __restrict next = slots + t * stride;
    int64_t* __restrict bucket_first = firsts + t * stride;
    uint64_t* __restrict buffer = lines ? lines + R * kLine * t : nullptr;
    uint64_t* __restrict src = packed;
    uint64_t* __restrict dst = tmp;
    // One thread takes the next pass's digit counts while it scatters this pass, a sweep less per
    // pass (2^17 lookups of 2^20 rows, one core: 0.11-0.14 ms of a 1.8 ms sort). Several threads
    // count their own slice of each pass's input first: the writer of a slot is not its reader.
    const bool fold = nth == 1;
    for (int p = 0; p < passes; ++p) {
      const int shift = 32 + p * digit;
      if (p == 0 || !fold) {
        std::fill(mine, mine + R, int64_t(0));
        if (p == 0) {
          for (int64_t j = lo; j < hi; ++j) ++mine[idx[j] & mask];
        } else {
          for (int64_t j = lo; j < hi; ++j) ++mine[(src[j] >> shift) & mask];
        }
      }
#pragma omp barrier
      int64_t run = 0;
      for (int64_t r = 0; r < R; ++r)
        for (int u = 0; u < nth; ++u) {
          if (u == t) next[r] = bucket_first[r] = run;
          run += count[u * stride + r];
        }
      const bool count_next = fold && p + 1 < passes;
      if (count_next) std::fill(mine, mine + R, int64_t(0));
      auto value = [&](int64_t j, auto from_idx) -> uint64_t {
        if constexpr (decltype(from_idx)::value) {
          return (static_cast<uint64_t>(idx[j]) << 32) | static_cast<uint64_t>(pos ? pos[j] : j);
        } else {
          return src[j];
        }
      };
      auto scatter = [&](auto from_idx, auto counting) {
        for (int64_t j = lo; j < hi; ++j) {
          const uint64_t v = value(j, from_idx);
          dst[next[(v >> shift) & mask]++] = v;
          if constexpr (decltype(counting)::value) ++mine[(v >> (shift + digit)) & mask];
        }
      };
      // Several threads: through a buffer line per bucket (see above).
      auto scatter_lines = [&](auto from_idx) {
        for (int64_t j = lo; j < hi; ++j) {
          const uint64_t v = value(j, from_idx);
          const int64_t r = (v >> shift) & mask;
          const int64_t n = next[r]++;
          uint64_t* __restrict line = buffer + r * kLine;
          if ((n & (kLine - 1)) == 0 && n > bucket_first[r]) {  // the line before slot n is complete
            if (n - kLine >= bucket_first[r]) {
              stream_line(dst + n - kLine, line);
            } else {  // the bucket's first line, shared with the slots before it
              for (int64_t k = bucket_first[r]; k < n; ++k) dst[k] = line[k & (kLine - 1)];
            }
          }
          line[n & (kLine - 1)] = v;
        }
        for (int64_t r = 0; r < R; ++r) {  // each bucket's last line, complete or not (none if empty)
          const int64_t end = next[r];
          for (int64_t k = std::max((end - 1) & ~(kLine - 1), bucket_first[r]); k < end; ++k)
            dst[k] = buffer[r * kLine + (k & (kLine - 1))];
        }
        stream_fence();
      };
      if (!fold) {
        p == 0 ? scatter_lines(std::true_type()) : scatter_lines(std::false_type());
      } else if (p == 0) {
        count_next ? scatter(std::true_type(), std::true_type()) : scatter(std::true_type(), std::false_type());
      } else {
        count_next ? scatter(std::false_type(), std::true_type()) : scatter(std::false_type(), std::false_type());
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
    const bool stream_runs = M >= kStreamRunsMin;
    uint64_t prev = first < hi ? ~row(first) : 0;  // any row but the first slot's: it starts a run
    for (int64_t j = first; j <= last; ++j) {
      const uint64_t r = row(j);
      if (stream_runs) {
        stream_int64(start + u, j);
        stream_int64(rows + u, static_cast<int64_t>(r));
      } else {
        start[u] = j;
        rows[u] = static_cast<int64_t>(r);
      }
      u += r != prev;
      prev = r;
    }
    if (stream_runs) stream_fence();
    if (t == nth - 1) s.num_runs = u;
  }
  if (passes % 2) std::swap(s.packed, s.tmp);
  start[s.num_runs] = M;
}

// Exact q / d for 0 <= q < 2^32 and 1 <= d < 2^32 by one 64 x 64 -> 128-bit multiply (Lemire,
// Kaser and Kurz, "Faster remainder by direct computation", 2019: M = floor((2^64 - 1) / d) + 1,
// q / d = floor(M q / 2^64)), d = 1 passed through. The backward finds the token of every sorted
// lookup as position / K, twice per lookup (its output-gradient row and the prefetch's): a 64-bit
// division there took ~9% of the fused row-wise Adagrad backward (1M x 64, T=4096, K=32:
// 10.0-10.9 -> 8.6-9.4 ms on one core). Positions are < 2^31 (sort_lookups checks it).
class Divisor {
 public:
  explicit Divisor(int64_t d) : m_(d == 1 ? 0 : UINT64_MAX / static_cast<uint64_t>(d) + 1) {}
  int64_t operator()(int64_t q) const {
    return m_ ? static_cast<int64_t>((static_cast<unsigned __int128>(m_) * static_cast<uint64_t>(q)) >> 64) : q;
  }

 private:
  uint64_t m_;
};

// The backward in token order (see the header comment): the lookups whose row no other lookup
// shares ("single" lookups) are taken in position order, and only the others ("repeated") are
// sorted by row. Bit r of `seen` is set where some lookup has row r, of `repeated` where two or
// more do (words [0, W); while plan_token_order builds them, slice u of the lookups is marked in
// words [u W, (u + 1) W)). Built anew for every call, the vectors kept (grown, never shrunk) like
// SortedLookups'.
struct TokenPlan {
  std::vector<uint64_t> seen, repeated;
  std::vector<int64_t> rep_rows, rep_pos;  // the repeated lookups' rows and positions, in order
  std::vector<int64_t> count;              // per-thread counts (padded like the sort's)
  SortedLookups repeats;                   // the repeated lookups sorted by row
  int64_t num_repeated = 0;
  // Batch shapes (table rows, lookups) whose last batch had too many repeated lookups, and how many
  // more calls of that shape skip the plan (see plan_token_order).
  struct Skip {
    int64_t N, M, calls;
  };
  std::vector<Skip> skips;

  bool is_repeated(int64_t row) const { return (repeated[row >> 6] >> (row & 63)) & 1; }
};

// Calls of a batch shape that go straight to the sort after one of its batches had too many
// repeated lookups for the token order, before the next is counted; and most shapes remembered.
// Training batches of one table have about the same share of repeated lookups, so counting it
// only to sort anyway would cost every step of a table whose lookups repeat often: the fused
// row-wise Adagrad backward of 524k lookups of 2^20 rows (K=128, 39% repeated) took 36.4 ms with
// the count every call, 35.6 with these skips (one core, cold, medians of 20 interleaved calls).
constexpr int64_t kSkipCalls = 15;
constexpr size_t kSkipShapes = 16;

// Most repeated lookups, as a fraction 1/kMaxRepeatedShare of all, for which the token order is
// used. Where few rows repeat, the sorted order buys little locality and costs the sort and the
// random reads of the output-gradient rows, scores and score-gradient slots in row order; where
// many do, ascending rows stream and the sorted order wins. Measured (fused row-wise Adagrad
// backward, 1M x 64 fp32, T=4096, uniform rows, one core of a 2-core Xeon, a 520 MB flush and
// fresh indices before each call; sorted against token): K=32 (12% of the lookups repeated) 11.25
// against 10.45 ms, K=64 (22%) 18.8 against 18.9, K=96 (31%) 27.5 against 28.5, K=128 (39%) 34.4
// against 39.0.
constexpr int64_t kMaxRepeatedShare = 4;

// How the backward orders the lookups: RMT_BACKWARD_ORDER = "sorted" or "token" forces one (for
// tests and measurements); unset or "auto", the token order is considered on Intel CPUs and
// the lookups sorted on AMD ones, where a probe of random-order row updates on a 2-core EPYC
// (every lookup stepping its row as if its only one, in position order) took 8.3-11.4 ms against
// the sorted kernel's 7.3 (1M x 64 fp32, T=4096, K=32, one core).
enum class Order { kAuto, kSorted, kToken };
Order order_setting() {
  static const bool amd = [] {
    __builtin_cpu_init();
    return __builtin_cpu_is("amd");
  }();
  const char* env = std::getenv("RMT_BACKWARD_ORDER");
  if (env == nullptr || *env == '\0' || std::strcmp(env, "auto") == 0) return amd ? Order::kSorted : Order::kAuto;
  if (std::strcmp(env, "sorted") == 0) return Order::kSorted;
  TORCH_CHECK(std::strcmp(env, "token") == 0, "RMT_BACKWARD_ORDER must be auto, sorted or token, got '", env, "'");
  return Order::kToken;
}

// Fills tp for the M lookups idx[0:M] of rows < N and returns true where the token order is to be
// used (then tp.rep_rows and tp.rep_pos list the repeated lookups), false where the plain sort is:
// unforced, on AMD CPUs, and where the table has more 64-row words than there are lookups or more
// than 1/kMaxRepeatedShare of the lookups are repeated (then the next kSkipCalls batches of the
// same shape are sorted without counting them). (A 2^24-row table, 131k lookups, 1%
// repeated, one core of the Xeon with huge pages: 13.0 ms sorted against 15.4 in token order,
// 19.4 against 25.4 without huge pages.) Each thread marks a slice of the lookups in bitmaps of
// its own (tp.seen and tp.repeated hold one pair per slice; fewer slices than threads where the
// batch is small for the table), with no branch; then each thread merges a range of words of all
// pairs into the first: a row is repeated where one slice repeats it or two slices see it.
// Thread t reading every index and marking only its own range of words, as before, branched on
// every index and mispredicted half of the time on two threads: the bitmaps took 0.79 ms there
// against 0.37 on one thread (2^17 lookups of 2^20 rows). The repeated lookups are counted from
// the bitmaps and listed by slices of positions, in position order.
bool plan_token_order(const int64_t* __restrict idx, int64_t M, int64_t N, TokenPlan& tp) {
  const Order order = order_setting();
  const int64_t W = (N + 63) / 64;
  // bitmaps of more words than lookups (a table far larger than the batch) would make the
  // backward's cost, and its scratch, grow with the table rather than with the batch
  if (order == Order::kSorted || (order == Order::kAuto && W > M)) return false;
  auto skip = std::find_if(tp.skips.begin(), tp.skips.end(), [&](const TokenPlan::Skip& k) { return k.N == N && k.M == M; });
  if (order == Order::kAuto && skip != tp.skips.end() && skip->calls > 0) {
    --skip->calls;
    return false;
  }
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), M / kSortSliceMin)));
  // slices of at least W / 2 lookups each, so that all bitmaps together hold at most max(2 W, 4 M)
  // words (one slice per thread held 2 W words per thread, a GB for 2^20 lookups of 2^26 rows on
  // 64 threads). Clearing a slice's 2 W words is a memset, cheaper than marking its lookups: 2^17
  // lookups of 2^22 rows on 2 threads took 0.22 ms longer in one slice than in two.
  const int slices =
      static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, 2 * M / std::max<int64_t>(W, 1))));
  uint64_t* __restrict seen = grown(tp.seen, W * slices);
  uint64_t* __restrict rep = grown(tp.repeated, W * slices);
  int64_t* __restrict before = grown(tp.count, threads * kCountPad);
  // grown here, even where the plan goes unused: a resize inside the region would need a barrier
  int64_t* __restrict rows = grown(tp.rep_rows, M);
  int64_t* __restrict pos = grown(tp.rep_pos, M);
  bool use = true;
#pragma omp parallel num_threads(threads)
  {
    const int nth = omp_get_num_threads(), t = omp_get_thread_num();
    const int parts = std::min(nth, slices);
    // the bounds held in locals: M and W are shared, so the bitmaps' stores could change them for
    // all the compiler knows, which put a division into every pass of the loop (0.15 ms more)
    const int64_t lo = M * t / nth, hi = M * (t + 1) / nth, wlo = W * t / nth, whi = W * (t + 1) / nth;
    if (t < parts) {
      const int64_t first = M * t / parts, last = M * (t + 1) / parts;
      uint64_t* __restrict s = seen + t * W;
      uint64_t* __restrict r = rep + t * W;
      std::fill(s, s + W, uint64_t(0));
      std::fill(r, r + W, uint64_t(0));
      for (int64_t i = first; i < last; ++i) {
        const uint64_t w = static_cast<uint64_t>(idx[i]) >> 6, bit = uint64_t(1) << (idx[i] & 63);
        r[w] |= s[w] & bit;
        s[w] |= bit;
      }
    }
#pragma omp barrier
    // a row looked up once has one lookup, so the repeated lookups are all the others
    int64_t single = 0;
    for (int64_t w = wlo; w < whi; ++w) {
      uint64_t sw = seen[w], rw = rep[w];
      for (int u = 1; u < parts; ++u) {
        rw |= rep[u * W + w] | (sw & seen[u * W + w]);
        sw |= seen[u * W + w];
      }
      seen[w] = sw;
      rep[w] = rw;
      single += __builtin_popcountll(sw & ~rw);
    }
    before[t * kCountPad] = single;
#pragma omp barrier
    // every thread sums the counts (no single, whose barrier would put all but one to sleep)
    int64_t singles = 0;
    for (int u = 0; u < nth; ++u) singles += before[u * kCountPad];
    const bool listed = order == Order::kToken || (M - singles) * kMaxRepeatedShare <= M;
    if (t == 0) {
      tp.num_repeated = M - singles;
      use = listed;
    }
    if (listed) {
      // the repeated lookups of the thread's slice of positions, listed from the slice's start,
      // then moved down after those of the slices before it. Every lookup is written to the next
      // free slot, which only a repeated one keeps (j <= i, so the slice's slots suffice): no
      // branch, which mispredicted on the ~12% of repeated lookups (K=32) and took 0.14 ms more
      // of the 8.8 ms fused backward on one core.
      int64_t j = lo;
      for (int64_t i = lo; i < hi; ++i) {
        rows[j] = idx[i];
        pos[j] = i;
        j += tp.is_repeated(idx[i]);
      }
      before[t * kCountPad + 1] = j - lo;  // beside the singles count, which others may still read
#pragma omp barrier
#pragma omp single nowait
      for (int64_t u = 0, to = 0; u < nth; ++u) {
        const int64_t from = M * u / nth, n = before[u * kCountPad + 1];
        std::memmove(rows + to, rows + from, n * sizeof(int64_t));
        std::memmove(pos + to, pos + from, n * sizeof(int64_t));
        to += n;
      }
    }
  }
  if (skip != tp.skips.end()) {
    skip->calls = use ? 0 : kSkipCalls;
  } else if (!use && tp.skips.size() < kSkipShapes) {
    tp.skips.push_back({N, M, kSkipCalls});
  }
  return use;
}

// Dot product of a[0:n] and b[0:n] with kLanes independent partial sums (vectorizable without
// -ffast-math), combined in a fixed order so the result does not depend on threading.
constexpr int64_t kLanes = 8;

template <typename acc_t, typename a_t, typename b_t>
inline acc_t fixed_order_dot(const a_t* __restrict a, const b_t* __restrict b, int64_t n) {
  acc_t part[kLanes] = {};
  int64_t d = 0;
  for (; d + kLanes <= n; d += kLanes)
#pragma omp simd
    for (int64_t j = 0; j < kLanes; ++j)
      part[j] = madd(static_cast<acc_t>(a[d + j]), static_cast<acc_t>(b[d + j]), part[j]);
  for (; d < n; ++d) part[0] = madd(static_cast<acc_t>(a[d]), static_cast<acc_t>(b[d]), part[0]);
  acc_t sum = acc_t(0);
  for (int64_t j = 0; j < kLanes; ++j) sum += part[j];
  return sum;
}

// Adds lookup p's share to its row's gradient acc[0:D] (each column slice c of its output-gradient
// row g times its score c) and, where score_lo <= p < score_hi, writes its score gradients, the
// dot products of the slices of its table row tr and of g.
template <typename table_t, typename scalar_t, typename acc_t>
inline void add_lookup(int64_t p, const table_t* __restrict tr, const scalar_t* __restrict g,
                       const scalar_t* __restrict scores, acc_t* __restrict acc, scalar_t* __restrict grad_scores,
                       int64_t score_lo, int64_t score_hi, int64_t C, int64_t Dc) {
  for (int64_t c = 0; c < C; ++c) {
    const acc_t w = static_cast<acc_t>(scores[p * C + c]);
    acc_t* __restrict a = acc + c * Dc;
    const scalar_t* __restrict gc = g + c * Dc;
#pragma omp simd
    for (int64_t d = 0; d < Dc; ++d) a[d] = madd(w, static_cast<acc_t>(gc[d]), a[d]);
    if (p >= score_lo && p < score_hi)
      grad_scores[(p - score_lo) * C + c] = round_to<scalar_t>(fixed_order_dot<acc_t>(tr + c * Dc, gc, Dc));
  }
}

// Gradient of a single lookup p in the token order (its row's only lookup): acc[0:D] set to its
// share, the score gradients written as by add_lookup. The table row kPrefetchDistance positions
// ahead, and whatever ahead(row) fetches for it (the optimizer state), are prefetched; the
// output-gradient rows, scores and block ids are read in order. Returns the row, or -1 (acc
// untouched) where p's row is repeated: those lookups are summed in row order afterwards.
template <typename table_t, typename scalar_t, typename acc_t, int64_t kD, int64_t kC, typename Ahead>
inline int64_t single_gradient(int64_t p, const TokenPlan& tp, const int64_t* __restrict idx,
                               const scalar_t* __restrict grad_out, const table_t* __restrict table,
                               const scalar_t* __restrict scores, const int64_t* __restrict blk,
                               acc_t* __restrict acc, scalar_t* __restrict grad_scores, int64_t score_lo,
                               int64_t score_hi, int64_t M, const Divisor& token_of, int64_t runtime_C,
                               int64_t runtime_D, int64_t E, Ahead&& ahead) {
  const int64_t C = kC ? kC : runtime_C, D = kD ? kD : runtime_D;
  if (p + kPrefetchDistance < M) {
    const int64_t far = idx[p + kPrefetchDistance];
    prefetch_row(table + far * D, D * static_cast<int64_t>(sizeof(table_t)));
    ahead(far);
  }
  const int64_t row = idx[p];
  if (tp.is_repeated(row)) return -1;
  std::fill(acc, acc + D, acc_t(0));
  add_lookup(p, table + row * D, grad_out + (token_of(p) * E + (blk ? blk[p] : 0)) * D, scores, acc, grad_scores,
             score_lo, score_hi, C, D / C);
  return row;
}

// Gradient of run u (row s.rows[u]), kD and kC as in forward_token_blocks: accumulates the row
// gradient in acc[0:D] and writes the score gradients of the run's lookups at positions p in
// [score_lo, score_hi), to grad_scores[(p - score_lo) * C + c] (all lookups but in the fused
// update of several batches' lookups, whose other batches have theirs computed elsewhere). Lookup
// p belongs to token token_of(p) = p / K. For the sorted lookup kPrefetchDistance ahead it
// prefetches the table row, the output-gradient row, the score and the score-gradient slot (and
// the block id twice as far ahead), and calls ahead(row) (the optimizer state of the fused
// update): the last ones are read in sorted-row order, i.e. at random, and after the other layers'
// work they are not in cache.
template <typename table_t, typename scalar_t, typename acc_t, int64_t kD, int64_t kC, typename Ahead>
inline void run_gradient(int64_t u, const SortedLookups& s, const scalar_t* __restrict grad_out,
                         const table_t* __restrict table, const scalar_t* __restrict scores,
                         const int64_t* __restrict blk, acc_t* __restrict acc, scalar_t* __restrict grad_scores,
                         int64_t score_lo, int64_t score_hi, int64_t M, const Divisor& token_of,
                         int64_t runtime_C, int64_t runtime_D, int64_t E, Ahead&& ahead) {
  const int64_t C = kC ? kC : runtime_C, D = kD ? kD : runtime_D;
  const int64_t Dc = D / C;
  const int64_t row_bytes = D * static_cast<int64_t>(sizeof(table_t));
  const int64_t grad_row_bytes = D * static_cast<int64_t>(sizeof(scalar_t));
  const uint64_t* __restrict sorted = s.packed.data();
  const table_t* __restrict tr = table + s.rows[u] * D;
  std::fill(acc, acc + D, acc_t(0));
  for (int64_t j = s.run_start[u]; j < s.run_start[u + 1]; ++j) {
    // the block id is read to find the prefetched gradient row, so it is fetched first, further ahead
    if (blk && j + 2 * kPrefetchDistance < M) prefetch_l2(blk + sorted_pos(sorted[j + 2 * kPrefetchDistance]));
    if (j + kPrefetchDistance < M) {
      const uint64_t far = sorted[j + kPrefetchDistance];
      const int64_t q = sorted_pos(far);
      prefetch_row(table + sorted_row(far) * D, row_bytes);
      prefetch_row(grad_out + (token_of(q) * E + (blk ? blk[q] : 0)) * D, grad_row_bytes);
      prefetch_l2(scores + q * C);
      if (q >= score_lo && q < score_hi) prefetch_l2(grad_scores + (q - score_lo) * C);
      ahead(sorted_row(far));
    }
    const int64_t p = sorted_pos(sorted[j]);
    add_lookup(p, tr, grad_out + (token_of(p) * E + (blk ? blk[p] : 0)) * D, scores, acc, grad_scores, score_lo,
               score_hi, C, Dc);
  }
}

// Streams the gradient row acc[0:D] to dst[0:D], rounded once (into stage[0:D]) where table_t is
// narrower than the accumulator.
template <typename table_t, typename acc_t>
inline void store_row(table_t* __restrict dst, const acc_t* __restrict acc, table_t* __restrict stage, int64_t D) {
  const int64_t row_bytes = D * static_cast<int64_t>(sizeof(table_t));
  if (std::is_same<table_t, acc_t>::value) {
    stream_store(dst, acc, row_bytes);
  } else {
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) stage[d] = round_to<table_t>(acc[d]);
    stream_store(dst, stage, row_bytes);
  }
}

inline void no_prefetch(int64_t) {}

int64_t num_chunks(int64_t work) {
  return std::max<int64_t>(1, std::min<int64_t>(work, kChunksPerThread * at::get_num_threads()));
}

// Sparse output: rows[u] and values[u, :] for every run u. Chunks hold about equal lookup counts.
template <typename table_t, typename scalar_t>
void sparse_backward_kernel(const scalar_t* __restrict grad_out, const table_t* __restrict table,
                            const scalar_t* __restrict scores, const int64_t* __restrict blk,
                            const SortedLookups& s, int64_t* __restrict rows, table_t* __restrict values,
                            scalar_t* __restrict grad_scores, int64_t M, int64_t K, int64_t C,
                            int64_t D, int64_t E) {
  using acc_t = typename Acc<scalar_t>::type;
  const int64_t U = s.num_runs, chunks = num_chunks(U);
  const int64_t* start = s.run_start.data();
  const Divisor token_of(K);
  dispatch_row_shape(D, C, [&](auto kD, auto kC) {
#pragma omp parallel num_threads(at::get_num_threads())
    {
      std::vector<acc_t> acc(D);
      std::vector<table_t> stage(D);
#pragma omp for schedule(dynamic, 1) nowait
      for (int64_t ch = 0; ch < chunks; ++ch) {
        // the runs whose first lookup lies in the chunk's share of the M sorted lookups
        const int64_t lo = std::lower_bound(start, start + U, ch * M / chunks) - start;
        const int64_t hi = std::lower_bound(start, start + U, (ch + 1) * M / chunks) - start;
        std::copy(s.rows.data() + lo, s.rows.data() + hi, rows + lo);  // each chunk its runs' rows
        for (int64_t u = lo; u < hi; ++u) {
          run_gradient<table_t, scalar_t, acc_t, decltype(kD)::value, decltype(kC)::value>(
              u, s, grad_out, table, scores, blk, acc.data(), grad_scores, 0, M, M, token_of, C, D, E, no_prefetch);
          store_row(values + u * D, acc.data(), stage.data(), D);
        }
      }
      stream_fence();
    }
  });
}

// Dense output: grad_table [N, D]; chunk ch owns table rows [ch*N/chunks, (ch+1)*N/chunks) and
// writes each of them exactly once (zeros, or the gradient of the run with that row).
template <typename table_t, typename scalar_t>
void dense_backward_kernel(const scalar_t* __restrict grad_out, const table_t* __restrict table,
                           const scalar_t* __restrict scores, const int64_t* __restrict blk,
                           const SortedLookups& s, table_t* __restrict grad_table,
                           scalar_t* __restrict grad_scores, int64_t M, int64_t N, int64_t K, int64_t C,
                           int64_t D, int64_t E) {
  using acc_t = typename Acc<scalar_t>::type;
  const int64_t U = s.num_runs, chunks = num_chunks(N);
  const int64_t row_bytes = D * static_cast<int64_t>(sizeof(table_t));
  const int64_t* urows = s.rows.data();
  const Divisor token_of(K);
  dispatch_row_shape(D, C, [&](auto kD, auto kC) {
#pragma omp parallel num_threads(at::get_num_threads())
    {
      std::vector<acc_t> acc(D);
      std::vector<table_t> stage(D);
#pragma omp for schedule(dynamic, 1) nowait
      for (int64_t ch = 0; ch < chunks; ++ch) {
        const int64_t row_lo = ch * N / chunks, row_hi = (ch + 1) * N / chunks;
        int64_t zero_from = row_lo;
        for (int64_t u = std::lower_bound(urows, urows + U, row_lo) - urows; u < U && urows[u] < row_hi; ++u) {
          stream_store(grad_table + zero_from * D, nullptr, (urows[u] - zero_from) * row_bytes);
          run_gradient<table_t, scalar_t, acc_t, decltype(kD)::value, decltype(kC)::value>(
              u, s, grad_out, table, scores, blk, acc.data(), grad_scores, 0, M, M, token_of, C, D, E, no_prefetch);
          store_row(grad_table + urows[u] * D, acc.data(), stage.data(), D);
          zero_from = urows[u] + 1;
        }
        stream_store(grad_table + zero_from * D, nullptr, (row_hi - zero_from) * row_bytes);
      }
      stream_fence();
    }
  });
}

// Adds the squares of acc[0:D], a row's share of the gradient norm that clipping reads, to the
// fp64 lanes sq[0:kLanes]: lane j gets the sum of the squares of elements j, j + kLanes, ... taken
// in the accumulation dtype (fp32 but for fp64 scores), which are left in part[0:kLanes] for the
// row rule. All terms are non-negative, so each lane's share is within gamma_(2 D / kLanes) of
// exact, relatively (about 1e-6 at D = 64): the precision of torch's and megatron's fp32 gradient
// norms. Squares summed in fp64 (every element converted, lanes half as wide, combined per row)
// took 1.4 ms of the 14.3 ms fused row-wise Adagrad backward (1M x 64 fp32, T=4096, K=32, one
// core of an AVX2 EPYC); fp32 lanes combined per row, 0.3 ms.
template <typename acc_t>
inline void add_squares(const acc_t* __restrict acc, int64_t D, acc_t* __restrict part, double* __restrict sq) {
  for (int64_t j = 0; j < kLanes; ++j) part[j] = acc_t(0);
  int64_t d = 0;
  for (; d + kLanes <= D; d += kLanes)
#pragma omp simd
    for (int64_t j = 0; j < kLanes; ++j) part[j] = madd(acc[d + j], acc[d + j], part[j]);
  for (; d < D; ++d) part[0] = madd(acc[d], acc[d], part[0]);
#pragma omp simd
  for (int64_t j = 0; j < kLanes; ++j) sq[j] += static_cast<double>(part[j]);
}

// Lookups per chunk of the fused backward (at least 256 chunks for 2^17 lookups).
constexpr int64_t kLookupsPerNormChunk = 512;

// Floats of per-row optimizer scratch the fused backward keeps for each row of a group.
constexpr int64_t kRowScratch = rmt_cpu::kSquareLanes;

// Units [lo, hi) of the fused backward (one chunk; see fused_backward_kernel), a unit being a run
// of the sorted lookups or a position of the token order, in groups of kGroup rows. For each unit,
// row = gradient(unit, acc_b) sums its row's gradient in acc_b = acc[b * D:(b + 1) * D] (no
// gradient row is stored) and returns the row, or -1 for a unit to skip. The gradient is then
// multiplied by grad_scale (the data-parallel mean; negative for a maximizing Adam), its squares
// added to the fp64 lanes sq, and prepare(row, acc_b, squares, scratch_b, kD) reads it and the
// fp32 partial sums of its squares that add_squares left (row-wise Adagrad: the partial sums of
// the squares of its decayed gradient, those same ones where it has no decay); once the group is
// full, f_b = factor(row, scratch_b) for its rows in turn (row-wise Adagrad: the row's scale, its
// state updated); then apply(row, acc_b, f_b, kD) steps each table row (kD as in
// dispatch_row_shape: the row rule runs at a compile-time width).
// Units have distinct rows, and each row's score gradients read it before it changes. Stepping
// each row as soon as its gradient was summed put the rule's dependent chain (sum of squares,
// square root, division) between one run's loads and the next's; in groups of 8 the chains run
// side by side, and the fused row-wise Adagrad backward took 8.1 instead of 8.8 ms (1M x 64 fp32,
// T=4096, K=32; 29 instead of 36 at K=128; one core of an AVX-512 EPYC). SparseAdam's update, a
// pass over two moment rows with no such chain, was 5-9% slower in groups of 8, so it steps each
// row at once (kGroup = 1). The row width is a template constant here: a trial build that read it
// from a variable shared by the parallel region took 2.4 ms more.
template <int64_t kGroup, typename acc_t, int64_t kD, typename Gradient, typename Prepare, typename Factor,
          typename Apply>
void fused_update_units(int64_t lo, int64_t hi, int64_t runtime_D, acc_t grad_scale, acc_t* __restrict acc,
                        double* __restrict sq, Gradient&& gradient, Prepare& prepare, Factor& factor, Apply& apply) {
  const int64_t D = kD ? kD : runtime_D;
  constexpr std::integral_constant<int64_t, kD> width{};
  float scratch[kGroup * kRowScratch];
  float f[kGroup];
  int64_t rows[kGroup];
  int64_t n = 0;
  auto step = [&] {
    for (int64_t b = 0; b < n; ++b) f[b] = factor(rows[b], scratch + b * kRowScratch);
    for (int64_t b = 0; b < n; ++b) apply(rows[b], acc + b * D, f[b], width);
    n = 0;
  };
  for (int64_t unit = lo; unit < hi; ++unit) {
    acc_t* __restrict a = acc + n * D;
    const int64_t row = gradient(unit, a);
    if (row < 0) continue;
    if (grad_scale != acc_t(1)) {
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) a[d] *= grad_scale;
    }
    acc_t squares[kLanes];
    add_squares(a, D, squares, sq);
    prepare(row, a, squares, scratch + n * kRowScratch, width);
    rows[n] = row;
    if (++n == kGroup) step();
  }
  step();
}

// The backward with the optimizer fused in (fused_update_units). Sorted order (tp null; s sorts
// all M lookups): the runs, cut into chunks of about kLookupsPerNormChunk lookups that the threads
// take in turn. Token order (tp from plan_token_order; s = tp->repeats): the positions in chunks of
// kLookupsPerNormChunk, their single lookups stepping their rows, then the runs of the repeated
// lookups as in the sorted order. Units own distinct rows, so the threads update disjoint rows and
// state. Returns the squared norm of the scaled gradient (the chunks' partials summed in chunk
// order: the same bits whatever the thread count).
template <int64_t kGroup, typename table_t, typename scalar_t, typename Prepare, typename Factor, typename Apply,
          typename Ahead>
double fused_backward_kernel(const scalar_t* __restrict grad_out, const table_t* __restrict table,
                             const scalar_t* __restrict scores, const int64_t* __restrict blk,
                             const int64_t* __restrict idx, const SortedLookups& s, const TokenPlan* tp,
                             scalar_t* __restrict grad_scores, int64_t score_lo, int64_t score_hi, int64_t M,
                             int64_t K, int64_t C, int64_t D, int64_t E, typename Acc<scalar_t>::type grad_scale,
                             Prepare&& prepare, Factor&& factor, Apply&& apply, Ahead&& ahead) {
  using acc_t = typename Acc<scalar_t>::type;
  // chunks of about kLookupsPerNormChunk lookups, whatever the thread count: the norm's partial
  // sums, and so its bits, do not depend on it
  const int64_t Ms = tp ? tp->num_repeated : M;  // lookups in s
  const int64_t U = s.num_runs, chunks = std::max<int64_t>(1, std::min<int64_t>(U, Ms / kLookupsPerNormChunk));
  const int64_t singles = tp ? std::max<int64_t>(1, M / kLookupsPerNormChunk) : 0;
  const int64_t* start = s.run_start.data();
  std::vector<double> chunk_sq(singles + chunks, 0.0);
  const Divisor token_of(K);
  dispatch_row_shape(D, C, [&](auto kD, auto kC) {
    constexpr int64_t kDv = decltype(kD)::value, kCv = decltype(kC)::value;
#pragma omp parallel num_threads(at::get_num_threads())
    {
      std::vector<acc_t> acc(kGroup * D);
#pragma omp for schedule(dynamic, 1) nowait
      for (int64_t ch = 0; ch < singles; ++ch) {
        double sq[kLanes] = {};
        fused_update_units<kGroup, acc_t, kDv>(
            ch * M / singles, (ch + 1) * M / singles, D, grad_scale, acc.data(), sq,
            [&](int64_t p, acc_t* a) {
              return single_gradient<table_t, scalar_t, acc_t, kDv, kCv>(p, *tp, idx, grad_out, table, scores, blk, a,
                                                                         grad_scores, score_lo, score_hi, M, token_of,
                                                                         C, D, E, ahead);
            },
            prepare, factor, apply);
        for (int64_t j = 0; j < kLanes; ++j) chunk_sq[ch] += sq[j];
      }
#pragma omp for schedule(dynamic, 1) nowait
      for (int64_t ch = 0; ch < chunks; ++ch) {
        const int64_t lo = std::lower_bound(start, start + U, ch * Ms / chunks) - start;
        const int64_t hi = std::lower_bound(start, start + U, (ch + 1) * Ms / chunks) - start;
        double sq[kLanes] = {};
        fused_update_units<kGroup, acc_t, kDv>(
            lo, hi, D, grad_scale, acc.data(), sq,
            [&](int64_t u, acc_t* a) {
              run_gradient<table_t, scalar_t, acc_t, kDv, kCv>(u, s, grad_out, table, scores, blk, a, grad_scores,
                                                               score_lo, score_hi, Ms, token_of, C, D, E, ahead);
              return s.rows[u];
            },
            prepare, factor, apply);
        for (int64_t j = 0; j < kLanes; ++j) chunk_sq[singles + ch] += sq[j];
      }
    }
  });
  double total = 0.0;
  for (double x : chunk_sq) total += x;
  return total;
}

// Prefetches the n elements at a and at b into L2 (a row of both Adam moments; see cpu_prefetch.h),
// one prefetch per 64-byte line of each, in one loop. Two such loops, one per moment (a helper
// called twice, or written out), compiled (GCC 12, -O3) to no moment prefetch at all in the fused
// backward: the moments were read cold, and the fused SparseAdam step took 26.4 ms against 9.9 ms
// in this form (1M x 64 fp32, T=4096, K=32, one thread).
template <typename T>
inline void prefetch_pair(const T* a, const T* b, int64_t n) {
  constexpr int64_t kPerLine = 64 / static_cast<int64_t>(sizeof(T));
  for (int64_t i = 0; i < n; i += kPerLine) {
    prefetch_l2(a + i);
    prefetch_l2(b + i);
  }
}

// An uninitialised buffer of `numel` elements from `pool`, reusing a pooled allocation whose
// storage nothing else holds; a new allocation reserves `reserve` >= numel elements.
at::Tensor pooled_buffer(std::vector<at::Tensor>& pool, int64_t numel, int64_t reserve,
                         const at::TensorOptions& options) {
  static std::mutex mutex;
  std::lock_guard<std::mutex> lock(mutex);
  at::Tensor* spare = nullptr;
  for (auto& buf : pool) {
    if (buf.storage().use_count() != 1 || buf.scalar_type() != options.dtype().toScalarType()) continue;
    if (buf.numel() >= numel) return buf.narrow(0, 0, numel);
    if (!spare) spare = &buf;
  }
  at::Tensor fresh = at::empty({reserve}, options);
  if (spare) {
    *spare = fresh;
  } else if (pool.size() < kPoolSlots) {
    pool.push_back(fresh);
  }
  return fresh.narrow(0, 0, numel);
}

at::Tensor score_gradient_buffer(const at::Tensor& scores) {
  static std::vector<at::Tensor> pool;
  return pooled_buffer(pool, scores.numel(), scores.numel(), scores.options()).view(scores.sizes());
}

const int64_t* block_ptr(const c10::optional<at::Tensor>& block_ids) {
  return block_ids.has_value() ? block_ids->data_ptr<int64_t>() : nullptr;
}

// Calls f(table_t(), scalar_t()) with the element types of the table and of the scores: one of
// fp32, fp64, bf16, fp16 for both, or a bf16/fp16 table with fp32 scores.
template <typename F>
void dispatch_dtypes(const at::Tensor& table, const at::Tensor& scores, const char* name, F&& f) {
  const at::ScalarType t = table.scalar_type(), s = scores.scalar_type();
  if (t == s) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, t, "lookup_reduce_cpu", [&] { f(scalar_t(), scalar_t()); });
  } else if (t == at::kBFloat16 && s == at::kFloat) {
    f(c10::BFloat16(), float());
  } else if (t == at::kHalf && s == at::kFloat) {
    f(c10::Half(), float());
  } else {
    TORCH_CHECK(false, name, ": scores of dtype ", s, " with a table of dtype ", t,
                " (need one dtype, or a bf16/fp16 table with fp32 scores)");
  }
}

// The persistent sort scratch, locked for one backward call.
struct SortScope {
  static std::mutex& mutex() {
    static std::mutex m;
    return m;
  }
  std::lock_guard<std::mutex> lock{mutex()};
  SortedLookups& sorted() {
    static SortedLookups s;
    return s;
  }
  TokenPlan& plan() {
    static TokenPlan p;
    return p;
  }
  // Orders the M lookups idx of rows < N for a backward: returns the token-order plan where
  // plan_token_order picks it, else nullptr with all lookups sorted. runs(order) then holds the
  // sorted lookups the kernels take run by run (the repeated ones, or all).
  const TokenPlan* order(const int64_t* idx, int64_t M, int64_t N) {
    TokenPlan& tp = plan();
    if (plan_token_order(idx, M, N, tp)) {
      if (tp.num_repeated) sort_lookups(tp.rep_rows.data(), tp.rep_pos.data(), tp.num_repeated, N, tp.repeats);
      else tp.repeats.num_runs = 0;
      return &tp;
    }
    sort_lookups(idx, nullptr, M, N, sorted());
    return nullptr;
  }
  const SortedLookups& runs(const TokenPlan* tp) { return tp ? tp->repeats : sorted(); }
};

}  // namespace

at::Tensor lookup_reduce_forward(const at::Tensor& table, const at::Tensor& indices,
                                 const at::Tensor& scores,
                                 const c10::optional<at::Tensor>& block_ids, int64_t num_blocks) {
  const int64_t T = indices.size(0), K = indices.size(1), C = scores.size(2), D = table.size(1);
  auto out = at::empty({T, num_blocks, D}, scores.options());
  dispatch_dtypes(table, scores, "lookup_reduce_forward", [&](auto table_tag, auto score_tag) {
    using table_t = decltype(table_tag);
    using scalar_t = decltype(score_tag);
    forward_kernel<table_t, scalar_t>(table.data_ptr<table_t>(), indices.data_ptr<int64_t>(),
                                      scores.data_ptr<scalar_t>(), block_ptr(block_ids),
                                      out.data_ptr<scalar_t>(), T, K, C, D, num_blocks);
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> lookup_reduce_backward(
    const at::Tensor& grad_out, const at::Tensor& table, const at::Tensor& indices,
    const at::Tensor& scores, const c10::optional<at::Tensor>& block_ids, int64_t num_blocks) {
  static std::vector<at::Tensor> row_pool, value_pool;
  const int64_t T = indices.size(0), K = indices.size(1), C = scores.size(2), D = table.size(1);
  SortScope scope;
  SortedLookups& sorted = scope.sorted();
  sort_lookups(indices.data_ptr<int64_t>(), nullptr, T * K, table.size(0), sorted);
  const int64_t U = sorted.num_runs;
  // 25% headroom: the next batch's unique-row count differs a little
  auto rows = pooled_buffer(row_pool, U, U + U / 4, indices.options());
  auto values = pooled_buffer(value_pool, U * D, U * D + U * D / 4, table.options()).view({U, D});
  auto grad_scores = score_gradient_buffer(scores);
  dispatch_dtypes(table, scores, "lookup_reduce_backward", [&](auto table_tag, auto score_tag) {
    using table_t = decltype(table_tag);
    using scalar_t = decltype(score_tag);
    sparse_backward_kernel<table_t, scalar_t>(grad_out.data_ptr<scalar_t>(), table.data_ptr<table_t>(),
                                              scores.data_ptr<scalar_t>(), block_ptr(block_ids), sorted,
                                              rows.data_ptr<int64_t>(), values.data_ptr<table_t>(),
                                              grad_scores.data_ptr<scalar_t>(), T * K, K, C, D, num_blocks);
  });
  return {rows, values, grad_scores};
}

std::tuple<at::Tensor, at::Tensor> lookup_reduce_backward_dense(
    const at::Tensor& grad_out, const at::Tensor& table, const at::Tensor& indices,
    const at::Tensor& scores, const c10::optional<at::Tensor>& block_ids, int64_t num_blocks) {
  static std::vector<at::Tensor> pool;
  const int64_t T = indices.size(0), K = indices.size(1), C = scores.size(2);
  const int64_t N = table.size(0), D = table.size(1);
  SortScope scope;
  SortedLookups& sorted = scope.sorted();
  sort_lookups(indices.data_ptr<int64_t>(), nullptr, T * K, N, sorted);
  auto grad_table = pooled_buffer(pool, N * D, N * D, table.options()).view({N, D});
  auto grad_scores = score_gradient_buffer(scores);
  dispatch_dtypes(table, scores, "lookup_reduce_backward_dense", [&](auto table_tag, auto score_tag) {
    using table_t = decltype(table_tag);
    using scalar_t = decltype(score_tag);
    dense_backward_kernel<table_t, scalar_t>(grad_out.data_ptr<scalar_t>(), table.data_ptr<table_t>(),
                                             scores.data_ptr<scalar_t>(), block_ptr(block_ids), sorted,
                                             grad_table.data_ptr<table_t>(), grad_scores.data_ptr<scalar_t>(),
                                             T * K, N, K, C, D, num_blocks);
  });
  return {grad_table, grad_scores};
}

// Score gradients alone, grad_scores[t, k, c] = <table row, output-gradient row> over column slice
// c, tokens in order (no sort): the backward of a batch whose table gradient the fused update
// sums later. The same fixed-order dot products as the backward's, so the same bits.
at::Tensor lookup_reduce_score_gradients(const at::Tensor& grad_out, const at::Tensor& table, const at::Tensor& indices,
                                         const at::Tensor& scores, const c10::optional<at::Tensor>& block_ids,
                                         int64_t num_blocks) {
  const int64_t T = indices.size(0), K = indices.size(1), C = scores.size(2), D = table.size(1);
  const int64_t M = T * K, E = num_blocks, Dc = D / C;
  auto grad_scores = at::empty_like(scores);
  dispatch_dtypes(table, scores, "lookup_reduce_score_gradients", [&](auto table_tag, auto score_tag) {
    using table_t = decltype(table_tag);
    using scalar_t = decltype(score_tag);
    using acc_t = typename Acc<scalar_t>::type;
    const table_t* __restrict tab = table.data_ptr<table_t>();
    const scalar_t* __restrict g = grad_out.data_ptr<scalar_t>();
    const int64_t* __restrict idx = indices.data_ptr<int64_t>();
    const int64_t* __restrict blk = block_ptr(block_ids);
    scalar_t* __restrict out = grad_scores.data_ptr<scalar_t>();
    const int64_t row_bytes = D * static_cast<int64_t>(sizeof(table_t));
#pragma omp parallel for schedule(dynamic, kTokensPerChunk) num_threads(at::get_num_threads())
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t i = t * K; i < (t + 1) * K; ++i) {
        if (i + kPrefetchDistance < M) prefetch_row(tab + idx[i + kPrefetchDistance] * D, row_bytes);
        const table_t* row = tab + idx[i] * D;
        const scalar_t* gr = g + (t * E + (blk ? blk[i] : 0)) * D;
        for (int64_t c = 0; c < C; ++c)
          out[i * C + c] = round_to<scalar_t>(fixed_order_dot<acc_t>(row + c * Dc, gr + c * Dc, Dc));
      }
    }
  });
  return grad_scores;
}

// Optimizers the fused backward applies (rmt/ops/sparse_optim.py; kinds as in rmt/ops/fused_update.py).
constexpr int64_t kSparseAdam = 0, kRowwiseAdagrad = 1;

// The backward with the optimizer step fused in: score gradients of the lookups of tokens
// [score_first, score_first + score_tokens) (returned, [score_tokens, K, C]) and, for every touched row, the gradient
// summed over its lookups times grad_scale, stepped into the table row and its optimizer state
// in place (SparseAdam: state1/state2 the moments, of the table's opmath dtype; row-wise Adagrad:
// state1 the fp32 per-row sums), and the squared norm of those gradients.
std::tuple<at::Tensor, double> lookup_reduce_backward_update(
    const at::Tensor& grad_out, at::Tensor table, const at::Tensor& indices, const at::Tensor& scores,
    const c10::optional<at::Tensor>& block_ids, int64_t num_blocks, int64_t score_first, int64_t score_tokens,
    int64_t optimizer,
    at::Tensor state1, const c10::optional<at::Tensor>& state2, double lr, double beta1, double beta2, double eps,
    double weight_decay, int64_t step, double grad_scale) {
  const int64_t T = indices.size(0), K = indices.size(1), C = scores.size(2);
  const int64_t N = table.size(0), D = table.size(1);
  TORCH_CHECK(table.is_contiguous() && score_first >= 0 && score_tokens >= 0 && score_first + score_tokens <= T,
              "lookup_reduce_backward_update: a contiguous table and score tokens within [0, T)");
  TORCH_CHECK(optimizer == kSparseAdam || optimizer == kRowwiseAdagrad,
              "lookup_reduce_backward_update: unknown optimizer ", optimizer);
  SortScope scope;
  const int64_t* idx = indices.data_ptr<int64_t>();
  const TokenPlan* tp = scope.order(idx, T * K, N);
  const SortedLookups& runs = scope.runs(tp);
  auto grad_scores = at::empty({score_tokens, K, C}, scores.options());
  double sq = 0.0;
  dispatch_dtypes(table, scores, "lookup_reduce_backward_update", [&](auto table_tag, auto score_tag) {
    using table_t = decltype(table_tag);
    using scalar_t = decltype(score_tag);
    using acc_t = typename Acc<scalar_t>::type;
    table_t* __restrict p = table.data_ptr<table_t>();
    auto run = [&](auto group, auto&& prepare, auto&& factor, auto&& apply, auto&& ahead) {
      sq = fused_backward_kernel<decltype(group)::value, table_t, scalar_t>(
          grad_out.data_ptr<scalar_t>(), p, scores.data_ptr<scalar_t>(), block_ptr(block_ids), idx, runs, tp,
          grad_scores.data_ptr<scalar_t>(), score_first * K, (score_first + score_tokens) * K, T * K, K, C, D,
          num_blocks, static_cast<acc_t>(grad_scale), prepare, factor, apply, ahead);
    };
    if (optimizer == kSparseAdam) {
      using state_t = at::opmath_type<table_t>;
      const auto state_type = c10::CppTypeToScalarType<state_t>::value;
      TORCH_CHECK(state2.has_value() && state1.sizes() == table.sizes() && state2->sizes() == table.sizes() &&
                      state1.is_contiguous() && state2->is_contiguous() && state1.scalar_type() == state_type &&
                      state2->scalar_type() == state_type,
                  "lookup_reduce_backward_update: the Adam moments must be contiguous, shaped like the table, of dtype ",
                  state_type);
      state_t* __restrict m = state1.data_ptr<state_t>();
      state_t* __restrict v = state2->data_ptr<state_t>();
      const double step_size = lr * std::sqrt(1 - std::pow(beta2, step)) / (1 - std::pow(beta1, step));
      const auto omb1 = static_cast<state_t>(1 - beta1), omb2 = static_cast<state_t>(1 - beta2);
      const auto eps_s = static_cast<state_t>(eps), step_s = static_cast<state_t>(step_size);
      run(std::integral_constant<int64_t, 1>(), [](int64_t, const acc_t*, const acc_t*, float*, auto) {},
          [](int64_t, const float*) { return 0.f; },
          [&](int64_t row, const acc_t* g, float, auto kD) {
            const int64_t w = row_width(kD, D);
            rmt_cpu::adam_row(p + row * w, m + row * w, v + row * w, g, w, omb1, omb2, eps_s, step_s);
          },
          [&](int64_t row) { prefetch_pair(m + row * D, v + row * D, D); });
    } else {
      TORCH_CHECK(state1.dim() == 1 && state1.size(0) == N && state1.scalar_type() == at::kFloat &&
                      state1.is_contiguous(),
                  "lookup_reduce_backward_update: the row-wise Adagrad sums must be a contiguous fp32 vector, one per row");
      float* __restrict sum = state1.data_ptr<float>();
      const float lr_f = static_cast<float>(lr), eps_f = static_cast<float>(eps);
      rmt_cpu::with_decay(static_cast<float>(weight_decay), [&](auto decay) {
        run(std::integral_constant<int64_t, 8>(),
            [&](int64_t row, const acc_t* g, const acc_t* squares, float* part, auto kD) {
              // without decay the rule's squares are the norm's, summed the same way (FMA into
              // kLanes fp32 lanes): taken once, 0.07-0.19 ms of a 9.5 ms backward (one core)
              if constexpr (std::is_same_v<decltype(decay), rmt_cpu::NoDecay> && std::is_same_v<acc_t, float>) {
                static_assert(rmt_cpu::kSquareLanes == kLanes, "the norm's and the rule's lanes must match");
                std::copy(squares, squares + kLanes, part);
              } else {
                const int64_t w = row_width(kD, D);
                rmt_cpu::rowwise_adagrad_squares(p + row * w, g, w, decay, part);
              }
            },
            [&](int64_t row, const float* part) { return rmt_cpu::rowwise_adagrad_scale(sum + row, part, D, lr_f, eps_f); },
            [&](int64_t row, const acc_t* g, float scale, auto kD) {
              const int64_t w = row_width(kD, D);
              rmt_cpu::rowwise_adagrad_apply(p + row * w, g, w, scale, decay);
            },
            // the one prefetch for writing (into L1, see cpu_prefetch.h): into L2 it measured the
            // same (7.5 against 7.3 ms at K=32, 23.8 against 24.1 at K=128)
            [&](int64_t row) { __builtin_prefetch(sum + row, 1, 2); });
      });
    }
  });
  return {grad_scores, sq};
}

// The backward's sort on its own: the packed (row << 32 | position) pairs of indices ordered by
// row, positions ascending within a row, sorted in digits of at most digit_bits bits (0: the
// default for the thread count, max_digit_bits()). Positions are the lookups' own (0, 1, ...) or
// the given ascending ones (as the token order's repeated lookups have); for tests and inspection.
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
  SortScope scope;
  SortedLookups& s = scope.sorted();
  sort_lookups(indices.data_ptr<int64_t>(), pos, M, num_rows, s, static_cast<int>(digit_bits));
  auto out = at::empty({M}, indices.options());
  std::memcpy(out.data_ptr<int64_t>(), s.packed.data(), M * sizeof(uint64_t));
  return out;
}

// The order the backward takes for these lookups: "token" or "sorted" (RMT_BACKWARD_ORDER, else
// by the share of repeated lookups); for tests and inspection.
std::string lookup_backward_order(const at::Tensor& indices, int64_t num_rows) {
  TORCH_CHECK(indices.scalar_type() == at::kLong && indices.is_contiguous(), "backward_order: contiguous int64 indices");
  SortScope scope;
  return plan_token_order(indices.data_ptr<int64_t>(), indices.numel(), num_rows, scope.plan()) ? "token" : "sorted";
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "rmt fused lookup-reduce, CPU (OpenMP) kernels";
  m.def("forward", &lookup_reduce_forward, "lookup-reduce forward -> [T, num_blocks, D]");
  m.def("backward", &lookup_reduce_backward,
        "lookup-reduce backward -> (unique rows, row gradients, score gradients)");
  m.def("backward_dense", &lookup_reduce_backward_dense,
        "lookup-reduce backward -> (dense [N, D] table gradient, score gradients)");
  m.def("score_gradients", &lookup_reduce_score_gradients,
        "lookup-reduce score gradients alone -> [T, K, C] (no table gradient)");
  m.def("backward_update", &lookup_reduce_backward_update,
        "lookup-reduce backward with the optimizer step fused in -> (score gradients, squared gradient norm)");
  m.def("sorted_lookups", &sorted_lookups, "the backward's sort alone -> packed (row << 32 | position), by row",
        py::arg("indices"), py::arg("num_rows"), py::arg("digit_bits"), py::arg("positions") = py::none());
  m.def("backward_order", &lookup_backward_order, "the backward's order of the lookups: 'token' or 'sorted'");
  m.def("sort_digit_bits", &max_digit_bits, "the sort's digit width on this many threads: RMT_SORT_DIGIT_BITS, else "
        "10 bits on several threads, by CPU vendor on one", py::arg("threads") = 1);
}
