// Fused lookup-reduce, CPU (OpenMP) kernels: what the files of the kernel share.
//
// Contract (see rmt/ops/lookup_reduce.py):
//   out[t, b, cD:(c+1)D'] = sum_{k : block[t,k]==b} scores[t,k,c] * table[idx[t,k], cD':(c+1)D']
// with D' = D / C. Inputs arrive validated and contiguous from Python; indices and block ids are
// int64.
//
// The kernel, by job: lookup_reduce_sort_cpu.cpp orders the lookups by row (the backward's
// deterministic, atomic-free reduction), lookup_reduce_forward_cpu.cpp the forward,
// lookup_reduce_backward_cpu.cpp the table and score gradients (lookup_reduce_backward_cpu.h: one
// row's gradient), lookup_reduce_update_cpu.cpp the backward with the optimizer step fused into
// each row, lookup_reduce_cpu.cpp the Python bindings.
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
// State: none shared between calls of different threads. The sort's scratch belongs to the
// calling thread (thread_local), as do the pools of output buffers, so two memory layers'
// backwards (one on the async memory stream's thread) never wait for each other.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <omp.h>
#if defined(__SSE2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "cpu_numerics.h"
#include "cpu_prefetch.h"

namespace rmt_lookup {

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

// Rows (and their lookups' output-gradient rows, scores and block ids) prefetched this many
// lookups ahead of use, into L2 (cpu_prefetch.h): far enough to hide a memory access.
constexpr int64_t kPrefetchDistance = 24;
// Work is handed out in small chunks (dynamic schedule), so a thread that the OS preempts delays
// the others by at most one chunk. Forward: tokens per chunk; backward: chunks per thread (whole
// runs of one row each; any chunking gives equal results).
constexpr int64_t kTokensPerChunk = 16;
constexpr int64_t kChunksPerThread = 32;
// Per-thread counts are padded to separate cache lines: a line shared by two threads' counts
// would move between their caches on every increment.
constexpr int64_t kCountPad = 64 / sizeof(int64_t);
// Fewest lookups per thread for a parallel sort pass.
constexpr int64_t kSortSliceMin = 16384;
// Independent partial sums of a dot product or a sum of squares (vectorizable without
// -ffast-math), combined in a fixed order so the result does not depend on threading.
constexpr int64_t kLanes = 8;

// Calls f(kD, kC) with the row width D and score-column count C as compile-time constants
// (std::integral_constant) for the common small shapes, and as 0 (read them at run time)
// otherwise: loops of a compile-time length unroll and vectorize without a remainder.
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

inline const int64_t* block_ptr(const c10::optional<at::Tensor>& block_ids) {
  return block_ids.has_value() ? block_ids->data_ptr<int64_t>() : nullptr;
}

// Dot product of a[0:n] and b[0:n] in kLanes partial sums, combined in a fixed order.
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

// Stores of gradient bytes that bypass the cache (non-temporal stores of 16-byte pieces over the
// aligned part of the range): a gradient is written once and read back much later by the
// optimizer, so fetching its old cache lines first (read-for-ownership) would double the memory
// traffic. src == nullptr writes zeros. Callers issue stream_fence() before the data is read.
inline void stream_store(void* dst, const void* src, int64_t bytes) {
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
#if defined(__SSE2__)
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

inline void stream_fence() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

// Exact q / d for 0 <= q < 2^32 and 1 <= d < 2^32 by one 64 x 64 -> 128-bit multiply (Lemire,
// Kaser and Kurz, "Faster remainder by direct computation", 2019: M = floor((2^64 - 1) / d) + 1,
// q / d = floor(M q / 2^64)), d = 1 passed through: the backward finds the token of every sorted
// lookup as position / K, and a 64-bit division per lookup is a visible share of its time.
// Positions are < 2^31 (sort_lookups checks it).
class Divisor {
 public:
  explicit Divisor(int64_t d) : m_(d == 1 ? 0 : UINT64_MAX / static_cast<uint64_t>(d) + 1) {}
  int64_t operator()(int64_t q) const {
    return m_ ? static_cast<int64_t>((static_cast<unsigned __int128>(m_) * static_cast<uint64_t>(q)) >> 64) : q;
  }

 private:
  uint64_t m_;
};

inline int64_t num_chunks(int64_t work) {
  return std::max<int64_t>(1, std::min<int64_t>(work, kChunksPerThread * at::get_num_threads()));
}

// Output buffers kept for reuse by one calling thread (one per memory layer whose gradient is
// alive at once): repeated steps skip the first-touch page faults of fresh multi-MB allocations.
constexpr size_t kPoolSlots = 8;

// An uninitialised buffer of `numel` elements from `pool` (the calling thread's), reusing a pooled
// allocation whose storage nothing else holds; a new allocation reserves `reserve` >= numel elements.
inline at::Tensor pooled_buffer(std::vector<at::Tensor>& pool, int64_t numel, int64_t reserve,
                                const at::TensorOptions& options) {
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

// The entry points (bound in lookup_reduce_cpu.cpp).
at::Tensor lookup_reduce_forward(const at::Tensor& table, const at::Tensor& indices, const at::Tensor& scores,
                                 const c10::optional<at::Tensor>& block_ids, int64_t num_blocks);
std::tuple<at::Tensor, at::Tensor, at::Tensor> lookup_reduce_backward(
    const at::Tensor& grad_out, const at::Tensor& table, const at::Tensor& indices, const at::Tensor& scores,
    const c10::optional<at::Tensor>& block_ids, int64_t num_blocks);
std::tuple<at::Tensor, at::Tensor> lookup_reduce_backward_dense(
    const at::Tensor& grad_out, const at::Tensor& table, const at::Tensor& indices, const at::Tensor& scores,
    const c10::optional<at::Tensor>& block_ids, int64_t num_blocks);
at::Tensor lookup_reduce_score_gradients(const at::Tensor& grad_out, const at::Tensor& table, const at::Tensor& indices,
                                         const at::Tensor& scores, const c10::optional<at::Tensor>& block_ids,
                                         int64_t num_blocks);
std::tuple<at::Tensor, double> lookup_reduce_backward_update(
    const at::Tensor& grad_out, at::Tensor table, const at::Tensor& indices, const at::Tensor& scores,
    const c10::optional<at::Tensor>& block_ids, int64_t num_blocks, int64_t score_first, int64_t score_tokens,
    int64_t optimizer, at::Tensor state1, const c10::optional<at::Tensor>& state2, double lr, double beta1,
    double beta2, double eps, double weight_decay, int64_t step, double grad_scale);
at::Tensor sorted_lookups(const at::Tensor& indices, int64_t num_rows, int64_t digit_bits,
                          const c10::optional<at::Tensor>& positions);
int sort_digit_bits();

}  // namespace rmt_lookup
