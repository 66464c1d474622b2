// Fused lookup-reduce, CPU (OpenMP) kernels, bound through torch's extension API.
//
// Contract (see rmt/ops/lookup_reduce.py):
//   out[t, b, cD:(c+1)D'] = sum_{k : block[t,k]==b} scores[t,k,c] * table[idx[t,k], cD':(c+1)D']
// with D' = D / C. Inputs arrive validated and contiguous from Python; indices and block ids are
// int64. Accumulation is in fp32 (fp64 for fp64 tables).
//
// Backward is deterministic and atomic-free: the flat lookup positions are bucketed by the high
// bits of their row index with a stable counting sort, then each bucket (about 8 lookups) is
// insertion-sorted by row, so every run of equal rows lists its positions in increasing order.
// The sort is serial on purpose: on a shared 2-core machine each OpenMP barrier costs a scheduler
// time slice (~5 ms) when the other thread is preempted, more than the whole sort (~2 ms). One thread reduces each run
// in that order and writes the row's gradient once into a compact [U, D] buffer; the same pass
// computes the score gradients, reading each touched table row once.
//
// The [U, D] row-gradient buffers come from a small pool: a buffer is handed out again only once
// nothing but the pool references its storage (the sparse gradient that aliased it was freed), so
// repeated steps skip the first-touch page faults of a fresh multi-MB allocation.
#include <torch/extension.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <tuple>
#include <vector>

namespace {

template <typename T>
struct Acc {
  using type = float;
};
template <>
struct Acc<double> {
  using type = double;
};

// Rows prefetched ahead of use, into L1 (locality 3): measured best for 256-byte rows on 2 cores.
constexpr int64_t kPrefetchDistance = 16;
// Counting-sort buckets: at most 2^kMaxBucketBits.
constexpr int kMaxBucketBits = 18;
constexpr int kBucketLogSize = 3;  // about 8 lookups per bucket
// Row-gradient buffers kept for reuse (one per memory layer whose gradient is alive at once).
constexpr size_t kPoolSlots = 8;

inline void prefetch_row(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 0, 3);
}

template <typename scalar_t>
void forward_kernel(const scalar_t* __restrict table, const int64_t* __restrict idx,
                    const scalar_t* __restrict scores, const int64_t* __restrict blk,
                    scalar_t* __restrict out, int64_t T, int64_t K, int64_t C, int64_t D,
                    int64_t E) {
  using acc_t = typename Acc<scalar_t>::type;
  const int64_t Dc = D / C, M = T * K;
  const int64_t row_bytes = D * static_cast<int64_t>(sizeof(scalar_t));
#pragma omp parallel num_threads(at::get_num_threads())
  {
    std::vector<acc_t> acc_buf(E * D);
    acc_t* __restrict acc = acc_buf.data();
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      std::fill(acc, acc + E * D, acc_t(0));
      for (int64_t i = t * K; i < (t + 1) * K; ++i) {
        if (i + kPrefetchDistance < M) prefetch_row(table + idx[i + kPrefetchDistance] * D, row_bytes);
        const scalar_t* __restrict row = table + idx[i] * D;
        acc_t* __restrict a = acc + (blk ? blk[i] : 0) * D;
        for (int64_t c = 0; c < C; ++c) {
          const acc_t w = static_cast<acc_t>(scores[i * C + c]);
#pragma omp simd
          for (int64_t d = c * Dc; d < (c + 1) * Dc; ++d) a[d] += w * static_cast<acc_t>(row[d]);
        }
      }
      scalar_t* __restrict o = out + t * E * D;
#pragma omp simd
      for (int64_t j = 0; j < E * D; ++j) o[j] = static_cast<scalar_t>(acc[j]);
    }
  }
}

int ceil_log2(int64_t n) {
  int bits = 0;
  while (bits < 63 && (int64_t(1) << bits) < n) ++bits;
  return bits;
}

// Lookup positions grouped by row: key[j] (row) ascending, pos[j] ascending within equal keys;
// bucket b (rows with the same high bits) spans [bucket_start[b], bucket_start[b + 1]) and its
// distinct rows get gradient slots [unique_start[b], unique_start[b + 1]). The vectors persist
// across calls (grown, never shrunk): fresh multi-MB allocations page-fault on first touch.
struct SortedLookups {
  std::vector<int64_t> key, pos, next, bucket_start, unique_start;
  int64_t num_buckets = 0, num_unique = 0;
};

template <typename T>
T* grown(std::vector<T>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(n);
  return v.data();
}

void sort_lookups(const int64_t* __restrict idx, int64_t M, int64_t num_rows, SortedLookups& s) {
  const int bits = ceil_log2(num_rows);
  const int bucket_bits = std::min({bits, std::max(ceil_log2(M) - kBucketLogSize, 1), kMaxBucketBits});
  const int shift = bits - bucket_bits;
  const int64_t B = int64_t(1) << bucket_bits;
  s.num_buckets = B;
  int64_t* __restrict key = grown(s.key, M);
  int64_t* __restrict pos = grown(s.pos, M);
  int64_t* __restrict start = grown(s.bucket_start, B + 1);
  int64_t* __restrict ustart = grown(s.unique_start, B + 1);
  int64_t* __restrict next = grown(s.next, B);
  std::fill(next, next + B, int64_t(0));
  for (int64_t i = 0; i < M; ++i) ++next[idx[i] >> shift];
  for (int64_t b = 0, run = 0; b < B; ++b) {
    start[b] = run;
    run += next[b];
    next[b] = start[b];
  }
  start[B] = M;
  for (int64_t i = 0; i < M; ++i) {
    const int64_t dst = next[idx[i] >> shift]++;
    key[dst] = idx[i];
    pos[dst] = i;
  }
  ustart[0] = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t first = start[b], last = start[b + 1];
    for (int64_t j = first + 1; j < last; ++j) {  // stable insertion sort: buckets are tiny
      const int64_t k = key[j], p = pos[j];
      int64_t m = j;
      for (; m > first && key[m - 1] > k; --m) {
        key[m] = key[m - 1];
        pos[m] = pos[m - 1];
      }
      key[m] = k;
      pos[m] = p;
    }
    int64_t unique = 0;
    for (int64_t j = first; j < last; ++j) unique += (j == first || key[j] != key[j - 1]);
    ustart[b + 1] = ustart[b] + unique;
  }
  s.num_unique = ustart[B];
}

// Dot product of a[0:n] and b[0:n] with kLanes independent partial sums (vectorizable without
// -ffast-math), combined in a fixed order so the result does not depend on threading.
constexpr int64_t kLanes = 8;

template <typename acc_t, typename scalar_t>
inline acc_t fixed_order_dot(const scalar_t* __restrict a, const scalar_t* __restrict b, int64_t n) {
  acc_t part[kLanes] = {};
  int64_t d = 0;
  for (; d + kLanes <= n; d += kLanes)
#pragma omp simd
    for (int64_t j = 0; j < kLanes; ++j)
      part[j] += static_cast<acc_t>(a[d + j]) * static_cast<acc_t>(b[d + j]);
  for (; d < n; ++d) part[0] += static_cast<acc_t>(a[d]) * static_cast<acc_t>(b[d]);
  acc_t sum = acc_t(0);
  for (int64_t j = 0; j < kLanes; ++j) sum += part[j];
  return sum;
}

template <typename scalar_t>
void segment_backward_kernel(const scalar_t* __restrict grad_out, const scalar_t* __restrict table,
                             const scalar_t* __restrict scores, const int64_t* __restrict blk,
                             const SortedLookups& s, int64_t* __restrict rows, scalar_t* __restrict values,
                             scalar_t* __restrict grad_scores, int64_t K, int64_t C, int64_t D,
                             int64_t E) {
  using acc_t = typename Acc<scalar_t>::type;
  const int64_t Dc = D / C, M = s.bucket_start[s.num_buckets];
  const int64_t row_bytes = D * static_cast<int64_t>(sizeof(scalar_t));
  const int64_t* __restrict key = s.key.data();
  const int64_t* __restrict pos = s.pos.data();
#pragma omp parallel num_threads(at::get_num_threads())
  {
    std::vector<acc_t> acc_buf(D);
    acc_t* __restrict acc = acc_buf.data();
#pragma omp for schedule(dynamic, 64)
    for (int64_t b = 0; b < s.num_buckets; ++b) {
      int64_t u = s.unique_start[b];
      const int64_t last = s.bucket_start[b + 1];
      for (int64_t first = s.bucket_start[b]; first < last; ++u) {
        const int64_t r = key[first];
        const scalar_t* __restrict tr = table + r * D;
        std::fill(acc, acc + D, acc_t(0));
        int64_t j = first;
        for (; j < last && key[j] == r; ++j) {
          if (j + kPrefetchDistance < M) prefetch_row(table + key[j + kPrefetchDistance] * D, row_bytes);
          const int64_t p = pos[j];
          const scalar_t* __restrict g = grad_out + ((p / K) * E + (blk ? blk[p] : 0)) * D;
          for (int64_t c = 0; c < C; ++c) {
            const acc_t w = static_cast<acc_t>(scores[p * C + c]);
#pragma omp simd
            for (int64_t d = c * Dc; d < (c + 1) * Dc; ++d) acc[d] += w * static_cast<acc_t>(g[d]);
            grad_scores[p * C + c] =
                static_cast<scalar_t>(fixed_order_dot<acc_t>(tr + c * Dc, g + c * Dc, Dc));
          }
        }
        rows[u] = r;
        scalar_t* __restrict v = values + u * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) v[d] = static_cast<scalar_t>(acc[d]);
        first = j;
      }
    }
  }
}

// A [U, D] row-gradient buffer, reusing a pooled allocation whose storage nothing else holds.
at::Tensor row_buffer(int64_t U, int64_t D, const at::TensorOptions& options) {
  static std::mutex mutex;
  static std::vector<at::Tensor> pool;
  const int64_t need = U * D;
  std::lock_guard<std::mutex> lock(mutex);
  at::Tensor* spare = nullptr;
  for (auto& buf : pool) {
    if (buf.storage().use_count() != 1 || buf.scalar_type() != options.dtype().toScalarType()) continue;
    if (buf.numel() >= need) return buf.narrow(0, 0, need).view({U, D});
    if (!spare) spare = &buf;
  }
  at::Tensor fresh = at::empty({need + need / 4}, options);  // headroom for the next batch's U
  if (spare) {
    *spare = fresh;
  } else if (pool.size() < kPoolSlots) {
    pool.push_back(fresh);
  }
  return fresh.narrow(0, 0, need).view({U, D});
}

const int64_t* block_ptr(const c10::optional<at::Tensor>& block_ids) {
  return block_ids.has_value() ? block_ids->data_ptr<int64_t>() : nullptr;
}

}  // namespace

at::Tensor lookup_reduce_forward(const at::Tensor& table, const at::Tensor& indices,
                                 const at::Tensor& scores,
                                 const c10::optional<at::Tensor>& block_ids, int64_t num_blocks) {
  const int64_t T = indices.size(0), K = indices.size(1), C = scores.size(2), D = table.size(1);
  auto out = at::empty({T, num_blocks, D}, table.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, table.scalar_type(), "lookup_reduce_forward", [&] {
    forward_kernel<scalar_t>(table.data_ptr<scalar_t>(), indices.data_ptr<int64_t>(),
                             scores.data_ptr<scalar_t>(), block_ptr(block_ids),
                             out.data_ptr<scalar_t>(), T, K, C, D, num_blocks);
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> lookup_reduce_backward(
    const at::Tensor& grad_out, const at::Tensor& table, const at::Tensor& indices,
    const at::Tensor& scores, const c10::optional<at::Tensor>& block_ids, int64_t num_blocks) {
  const int64_t T = indices.size(0), K = indices.size(1), C = scores.size(2), D = table.size(1);
  static std::mutex mutex;  // guards the persistent sort scratch
  static SortedLookups sorted;
  std::lock_guard<std::mutex> lock(mutex);
  sort_lookups(indices.data_ptr<int64_t>(), T * K, table.size(0), sorted);
  const int64_t U = sorted.num_unique;

  auto rows = at::empty({U}, indices.options());
  auto values = row_buffer(U, D, table.options());
  auto grad_scores = at::empty_like(scores);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, table.scalar_type(), "lookup_reduce_backward", [&] {
    segment_backward_kernel<scalar_t>(grad_out.data_ptr<scalar_t>(), table.data_ptr<scalar_t>(),
                                      scores.data_ptr<scalar_t>(), block_ptr(block_ids), sorted,
                                      rows.data_ptr<int64_t>(),
                                      values.data_ptr<scalar_t>(), grad_scores.data_ptr<scalar_t>(),
                                      K, C, D, num_blocks);
  });
  return {rows, values, grad_scores};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "rmt fused lookup-reduce, CPU (OpenMP) kernels";
  m.def("forward", &lookup_reduce_forward, "lookup-reduce forward -> [T, num_blocks, D]");
  m.def("backward", &lookup_reduce_backward,
        "lookup-reduce backward -> (unique rows, row gradients, score gradients)");
}
