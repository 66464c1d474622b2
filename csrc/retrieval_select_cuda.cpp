// Torch binding of the CUDA selection of the fused retrieval (retrieval_select_cuda_kernels.cu):
// checks the inputs, allocates the candidate buffers and the outputs from torch's allocator and
// launches the candidates of both grid sides, then the grid top-m, on the current stream.
#include <torch/extension.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <vector>

#include "retrieval_select_cuda_kernels.h"

namespace {

void check(int err) {
  TORCH_CHECK(err == 0, "retrieval_select CUDA: ", cudaGetErrorString(static_cast<cudaError_t>(err)));
}

std::vector<at::Tensor> retrieval_select(const at::Tensor& q_row, const at::Tensor& q_col, const at::Tensor& keys_in,
                                         int64_t m, const c10::optional<at::Tensor>& core_in,
                                         const c10::optional<at::Tensor>& u_in, const c10::optional<at::Tensor>& t_in) {
  TORCH_CHECK(keys_in.is_cuda() && keys_in.dim() == 5 && keys_in.size(1) == 2,
              "retrieval_select CUDA: keys must be a CUDA tensor [H, 2, r, n, D]");
  const c10::cuda::CUDAGuard guard(keys_in.device());
  const at::Tensor keys = keys_in.contiguous();
  const int64_t H = keys.size(0), r = keys.size(2), n = keys.size(3), D = keys.size(4), T = q_row.size(0);
  const auto type = keys.scalar_type();
  TORCH_CHECK(type == at::kFloat || type == at::kBFloat16, "retrieval_select CUDA: float32 or bfloat16 inputs");
  TORCH_CHECK(r <= 16, "retrieval_select CUDA: Tucker rank above 16");
  TORCH_CHECK(n < (int64_t(1) << 31), "retrieval_select CUDA: 2^31 keys per side or more");
  for (const auto* q : {&q_row, &q_col})
    TORCH_CHECK(q->dim() == 4 && q->size(0) == T && q->size(1) == H && q->size(2) == r && q->size(3) == D &&
                    q->scalar_type() == type && q->device() == keys.device() && q->stride(3) == 1,
                "retrieval_select CUDA: queries must be [T, H, r, D] of the keys' dtype and device, unit last stride");
  const bool tucker = core_in.has_value();
  const bool keep_all = tucker && 2 * m >= n;
  const int64_t width = keep_all ? n : m, lists = tucker && !keep_all ? 2 : 1, c = width * lists;
  TORCH_CHECK(m >= 1 && m <= (tucker ? c * c : n), "retrieval_select CUDA: m out of range");
  at::Tensor core, u, t;
  if (tucker) {
    core = core_in->contiguous();
    u = u_in->contiguous();
    t = t_in->contiguous();
    TORCH_CHECK(core.sizes() == at::IntArrayRef({H, r, r}) && u.sizes() == at::IntArrayRef({H, r}) &&
                    t.sizes() == u.sizes() && core.scalar_type() == at::kFloat && u.scalar_type() == at::kFloat &&
                    t.scalar_type() == at::kFloat,
                "retrieval_select CUDA: the selector must be C [H, r, r], u and t [H, r], float32");
  }
  const auto opts = keys.options();
  at::Tensor addr = at::empty({T, H, m}, opts.dtype(at::kLong));
  at::Tensor sel = at::empty({T, H, 2, r, m}, opts);
  if (T == 0) return {addr, sel};
  at::Tensor cand_idx = at::empty({T, H, 2, c}, opts.dtype(at::kInt));
  at::Tensor cand_val = at::empty({T, H, 2, c}, opts.dtype(at::kFloat));
  at::Tensor cand_side = at::empty({T, H, 2, c, r}, opts.dtype(at::kFloat));
  at::Tensor best_val = at::empty({T, H, m}, opts.dtype(at::kFloat));
  const int dtype = type == at::kFloat ? RMT_SELECT_FLOAT32 : RMT_SELECT_BFLOAT16;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  for (int side = 0; side < 2; ++side) {
    const at::Tensor& q = side == 0 ? q_row : q_col;
    const float* w = tucker ? (side == 0 ? u : t).data_ptr<float>() : nullptr;
    check(rmt_retrieval_candidates_cuda(dtype, q.data_ptr(), q.stride(0), q.stride(1), q.stride(2), keys.data_ptr(),
                                        w, side, T, H, r, n, D, width, int(lists), c, cand_idx.data_ptr<int32_t>(),
                                        cand_val.data_ptr<float>(), cand_side.data_ptr<float>(), stream));
  }
  check(rmt_retrieval_grid_cuda(dtype, cand_idx.data_ptr<int32_t>(), cand_side.data_ptr<float>(),
                                tucker ? core.data_ptr<float>() : nullptr, T, H, r, n, m, c,
                                best_val.data_ptr<float>(), addr.data_ptr<int64_t>(), sel.data_ptr(), stream));
  return {addr, sel};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.def("select", &retrieval_select,
          "fused retrieval's streaming selection on the GPU -> (addresses [T, H, m], side scores [T, H, 2, r, m])",
          py::arg("q_row"), py::arg("q_col"), py::arg("keys"), py::arg("m"), py::arg("core"), py::arg("u"),
          py::arg("t"));
}
