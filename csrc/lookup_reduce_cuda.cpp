// Torch binding of the CUDA lookup-reduce kernels (lookup_reduce_cuda_kernels.cu). Inputs arrive
// validated and contiguous from rmt/ops/lookup_reduce.py, indices and block ids as int64.
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>

#include <tuple>

#include "lookup_reduce_cuda_kernels.h"

namespace {

int dtype_code(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return RMT_FLOAT32;
    case at::kBFloat16: return RMT_BFLOAT16;
    case at::kHalf: return RMT_FLOAT16;
    default: TORCH_CHECK(false, "lookup_reduce CUDA: unsupported dtype ", t);
  }
  return -1;
}

void check(int err) {
  TORCH_CHECK(err == 0, "lookup_reduce CUDA: ", cudaGetErrorString(static_cast<cudaError_t>(err)));
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
  check(rmt_lookup_reduce_forward_cuda(dtype_code(table.scalar_type()), table.data_ptr(),
                                       indices.data_ptr<int64_t>(), scores.data_ptr(),
                                       block_ptr(block_ids), out.data_ptr(), T, K, C, D, num_blocks,
                                       c10::cuda::getCurrentCUDAStream().stream()));
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> lookup_reduce_backward(
    const at::Tensor& grad_out, const at::Tensor& table, const at::Tensor& indices,
    const at::Tensor& scores, const c10::optional<at::Tensor>& block_ids, int64_t num_blocks) {
  const int64_t T = indices.size(0), K = indices.size(1), C = scores.size(2), D = table.size(1);
  const int64_t M = T * K;
  int end_bit = 1;
  while (end_bit < 63 && (int64_t(1) << end_bit) < table.size(0)) ++end_bit;
  auto stream = c10::cuda::getCurrentCUDAStream().stream();
  auto i64 = indices.options();
  auto positions_in = at::empty({M}, i64), sorted_keys = at::empty({M}, i64);
  auto sorted_positions = at::empty({M}, i64), unique_rows = at::empty({M}, i64);
  auto counts = at::empty({M}, i64), num_unique = at::empty({1}, i64);
  const size_t ws_bytes = rmt_lookup_reduce_sort_workspace_bytes(M);
  auto workspace = at::empty({static_cast<int64_t>(ws_bytes)}, indices.options().dtype(at::kByte));
  check(rmt_lookup_reduce_sort_cuda(indices.data_ptr<int64_t>(), M, end_bit,
                                    positions_in.data_ptr<int64_t>(), sorted_keys.data_ptr<int64_t>(),
                                    sorted_positions.data_ptr<int64_t>(), unique_rows.data_ptr<int64_t>(),
                                    counts.data_ptr<int64_t>(), num_unique.data_ptr<int64_t>(),
                                    workspace.data_ptr(), ws_bytes, stream));
  const int64_t U = num_unique.item<int64_t>();
  auto rows = unique_rows.slice(0, 0, U);
  auto seg_start = at::zeros({U + 1}, i64);
  seg_start.slice(0, 1).copy_(counts.slice(0, 0, U).cumsum(0));
  auto values = at::empty({U, D}, table.options());
  auto grad_scores = at::empty_like(scores);
  check(rmt_lookup_reduce_backward_cuda(
      dtype_code(table.scalar_type()), grad_out.data_ptr(), table.data_ptr(),
      indices.data_ptr<int64_t>(), scores.data_ptr(), block_ptr(block_ids),
      sorted_positions.data_ptr<int64_t>(), seg_start.data_ptr<int64_t>(), U, values.data_ptr(),
      grad_scores.data_ptr(), T, K, C, D, num_blocks, stream));
  return {rows, values, grad_scores};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "rmt fused lookup-reduce, CUDA kernels";
  m.def("forward", &lookup_reduce_forward, "lookup-reduce forward -> [T, num_blocks, D]");
  m.def("backward", &lookup_reduce_backward,
        "lookup-reduce backward -> (unique rows, row gradients, score gradients)");
}
