// Fused lookup-reduce, CPU (OpenMP) kernels, bound through torch's extension API.
//
// Contract (see rmt/ops/lookup_reduce.py):
//   out[t, b, cD:(c+1)D'] = sum_{k : block[t,k]==b} scores[t,k,c] * table[idx[t,k], cD':(c+1)D']
// with D' = D / C. Inputs arrive validated and contiguous from Python; indices and block ids are
// int64. Accumulation is in fp32 (fp64 for fp64 tables).
//
// Backward is deterministic and atomic-free: the flat lookup positions are radix-sorted (stable)
// by row index, then each run of equal rows is reduced by one thread in position order. The same
// pass computes the score gradients, reading each touched table row once.
#include <torch/extension.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
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

constexpr int64_t kPrefetchDistance = 8;
constexpr int kRadixBits = 11;

inline void prefetch_row(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 0, 0);
}

template <typename scalar_t>
void forward_kernel(const scalar_t* table, const int64_t* idx, const scalar_t* scores,
                    const int64_t* blk, scalar_t* out, int64_t T, int64_t K, int64_t C,
                    int64_t D, int64_t E) {
  using acc_t = typename Acc<scalar_t>::type;
  const int64_t Dc = D / C;
  const int64_t row_bytes = D * static_cast<int64_t>(sizeof(scalar_t));
#pragma omp parallel num_threads(at::get_num_threads())
  {
    std::vector<acc_t> acc(E * D);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      std::fill(acc.begin(), acc.end(), acc_t(0));
      const int64_t* it = idx + t * K;
      for (int64_t k = 0; k < K; ++k) {
        if (k + kPrefetchDistance < K) prefetch_row(table + it[k + kPrefetchDistance] * D, row_bytes);
        const scalar_t* row = table + it[k] * D;
        acc_t* a = acc.data() + (blk ? blk[t * K + k] : 0) * D;
        const scalar_t* s = scores + (t * K + k) * C;
        for (int64_t c = 0; c < C; ++c) {
          const acc_t w = static_cast<acc_t>(s[c]);
          for (int64_t d = c * Dc; d < (c + 1) * Dc; ++d) a[d] += w * static_cast<acc_t>(row[d]);
        }
      }
      scalar_t* o = out + t * E * D;
      for (int64_t j = 0; j < E * D; ++j) o[j] = static_cast<scalar_t>(acc[j]);
    }
  }
}

// Stable LSD radix sort of (key, position) pairs; keys lie in [0, num_rows).
void radix_sort_pairs(std::vector<int64_t>& keys, std::vector<int64_t>& pos, int64_t num_rows) {
  const int64_t M = static_cast<int64_t>(keys.size());
  int bits = 0;
  while (bits < 63 && (int64_t(1) << bits) < num_rows) ++bits;
  std::vector<int64_t> keys_tmp(M), pos_tmp(M);
  std::vector<int64_t> hist(int64_t(1) << kRadixBits);
  const int64_t mask = (int64_t(1) << kRadixBits) - 1;
  for (int shift = 0; shift < bits; shift += kRadixBits) {
    std::fill(hist.begin(), hist.end(), 0);
    for (int64_t i = 0; i < M; ++i) ++hist[(keys[i] >> shift) & mask];
    int64_t sum = 0;
    for (auto& h : hist) {
      const int64_t n = h;
      h = sum;
      sum += n;
    }
    for (int64_t i = 0; i < M; ++i) {
      const int64_t dst = hist[(keys[i] >> shift) & mask]++;
      keys_tmp[dst] = keys[i];
      pos_tmp[dst] = pos[i];
    }
    keys.swap(keys_tmp);
    pos.swap(pos_tmp);
  }
}

template <typename scalar_t>
void segment_backward_kernel(const scalar_t* grad_out, const scalar_t* table,
                             const scalar_t* scores, const int64_t* blk,
                             const std::vector<int64_t>& sorted_pos,
                             const std::vector<int64_t>& seg_start, const int64_t* rows,
                             scalar_t* values, scalar_t* grad_scores, int64_t K, int64_t C,
                             int64_t D, int64_t E) {
  using acc_t = typename Acc<scalar_t>::type;
  const int64_t Dc = D / C;
  const int64_t U = static_cast<int64_t>(seg_start.size()) - 1;
  const int64_t row_bytes = D * static_cast<int64_t>(sizeof(scalar_t));
#pragma omp parallel num_threads(at::get_num_threads())
  {
    std::vector<acc_t> acc(D), trow(D);
#pragma omp for schedule(dynamic, 64)
    for (int64_t u = 0; u < U; ++u) {
      if (u + kPrefetchDistance < U) prefetch_row(table + rows[u + kPrefetchDistance] * D, row_bytes);
      const scalar_t* tr = table + rows[u] * D;
      for (int64_t d = 0; d < D; ++d) {
        trow[d] = static_cast<acc_t>(tr[d]);
        acc[d] = acc_t(0);
      }
      for (int64_t j = seg_start[u]; j < seg_start[u + 1]; ++j) {
        const int64_t p = sorted_pos[j];
        const int64_t b = blk ? blk[p] : 0;
        const scalar_t* g = grad_out + ((p / K) * E + b) * D;
        const scalar_t* s = scores + p * C;
        for (int64_t c = 0; c < C; ++c) {
          const acc_t w = static_cast<acc_t>(s[c]);
          acc_t dot = acc_t(0);
          for (int64_t d = c * Dc; d < (c + 1) * Dc; ++d) {
            const acc_t gd = static_cast<acc_t>(g[d]);
            dot += trow[d] * gd;
            acc[d] += w * gd;
          }
          grad_scores[p * C + c] = static_cast<scalar_t>(dot);
        }
      }
      scalar_t* v = values + u * D;
      for (int64_t d = 0; d < D; ++d) v[d] = static_cast<scalar_t>(acc[d]);
    }
  }
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
  const int64_t M = T * K;
  const int64_t* idx = indices.data_ptr<int64_t>();
  std::vector<int64_t> keys(idx, idx + M), pos(M);
  for (int64_t i = 0; i < M; ++i) pos[i] = i;
  radix_sort_pairs(keys, pos, table.size(0));

  std::vector<int64_t> seg_start;
  seg_start.reserve(M + 1);
  for (int64_t i = 0; i < M; ++i)
    if (i == 0 || keys[i] != keys[i - 1]) seg_start.push_back(i);
  seg_start.push_back(M);
  const int64_t U = static_cast<int64_t>(seg_start.size()) - 1;

  auto rows = at::empty({U}, indices.options());
  int64_t* r = rows.data_ptr<int64_t>();
  for (int64_t u = 0; u < U; ++u) r[u] = keys[seg_start[u]];
  auto values = at::empty({U, D}, table.options());
  auto grad_scores = at::empty_like(scores);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, table.scalar_type(), "lookup_reduce_backward", [&] {
    segment_backward_kernel<scalar_t>(grad_out.data_ptr<scalar_t>(), table.data_ptr<scalar_t>(),
                                      scores.data_ptr<scalar_t>(), block_ptr(block_ids), pos,
                                      seg_start, r, values.data_ptr<scalar_t>(),
                                      grad_scores.data_ptr<scalar_t>(), K, C, D, num_blocks);
  });
  return {rows, values, grad_scores};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "rmt fused lookup-reduce, CPU (OpenMP) kernels";
  m.def("forward", &lookup_reduce_forward, "lookup-reduce forward -> [T, num_blocks, D]");
  m.def("backward", &lookup_reduce_backward,
        "lookup-reduce backward -> (unique rows, row gradients, score gradients)");
}
