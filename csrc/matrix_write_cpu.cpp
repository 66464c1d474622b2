// The RMT's write (Mak & Flanigan Eq. 12 without the norm; rmt.ops.matrix_write holds the formula
// and the torch reference), CPU, float32, Dk 16 or 32:
//
//   forward   out[j, k] = sum_h data[j, h] keys[k, h]           data [M, n], keys [Dk, n], out [M, Dk]
//             (+ residual[j, k], where given: the layer's residual add, in the same pass)
//   backward  ddata[j, h] = sum_k grad[j, k] keys[k, h],   dkeys[k, h] = sum_j grad[j, k] data[j, h]
//
// with M = tokens x Dv rows and n (R, or R + position keys) of a few data vectors per row. As a
// GEMM this has a reduction side of n (forward), an output side of n (ddata) or an output of
// Dk x n (dkeys); through F.linear the backward of these shapes ran ~3x slower than this kernel's
// and the step's writes ~10x below the transformer's linear layers (docs/benchmarks.md). The
// forward and dkeys take the register tiles of key_tiles.h (the forward measured as fast as
// MKL's in the step), ddata MKL's sgemm laid out key-major (fast), transposed in place for
// token-major data. data comes token-major ([M, n] contiguous) or key-major (the transpose of a contiguous
// [n, M]: the attention's output, a view of the read's layout), and ddata is returned in the same
// layout. dkeys' partial sums are kept per block of kRows rows and added in block order, so no
// result depends on the thread count.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "blas_gemm.h"
#include "block_ops.h"
#include "key_tiles.h"

namespace {

constexpr int64_t kRows = 2048;

// True for key-major data (the transpose of a contiguous [n, M]); throws unless data is one of
// the two layouts.
bool check(const torch::Tensor& data, const torch::Tensor& keys) {
  TORCH_CHECK(data.device().is_cpu() && data.dim() == 2 && data.scalar_type() == torch::kFloat32,
              "data must be a CPU float32 [M, n] tensor");
  TORCH_CHECK(keys.dim() == 2 && keys.scalar_type() == torch::kFloat32 && keys.size(1) == data.size(1) &&
                  rmt_cpu::tiled_width(keys.size(0)),
              "keys must be a float32 [Dk, n] tensor with Dk 16 or 32 and data's n");
  const bool key_major = !data.is_contiguous();
  TORCH_CHECK(!key_major || data.t().is_contiguous(), "data must be contiguous or the transpose of a contiguous tensor");
  return key_major;
}

// residual: an undefined tensor, or a contiguous float32 [M, Dk] added to the product (each sum
// rounded, then the addition: the bits of adding the two tensors afterwards, without the product
// going to memory and being read back).
torch::Tensor forward(const torch::Tensor& data, const torch::Tensor& keys, const c10::optional<torch::Tensor>& residual) {
  const bool key_major = check(data, keys);
  const int64_t M = data.size(0), n = data.size(1), dk = keys.size(0);
  const int64_t sh = key_major ? M : 1, sj = key_major ? 1 : n;
  const auto keys_t = keys.t().contiguous();  // [n, Dk]
  const bool add = residual.has_value() && residual->defined();
  TORCH_CHECK(!add || (residual->scalar_type() == torch::kFloat32 && residual->is_contiguous() &&
                       residual->sizes() == at::IntArrayRef{M, dk}),
              "residual must be a contiguous float32 [M, Dk] tensor");
  auto out = torch::empty({M, dk}, data.options().memory_format(at::MemoryFormat::Contiguous));
  const float *a = data.data_ptr<float>(), *b = keys_t.data_ptr<float>();
  const float* r = add ? residual->data_ptr<float>() : nullptr;
  float* o = out.data_ptr<float>();
  at::parallel_for(0, (M + kRows - 1) / kRows, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t j0 = blk * kRows, m = std::min(kRows, M - j0);
      rmt_cpu::rows_by_keys(dk, a + j0 * sj, sh, sj, b, o + j0 * dk, n, m, r ? r + j0 * dk : nullptr);
    }
  });
  return out;
}

// -> (ddata in data's layout or empty, dkeys [Dk, n] or empty)
std::vector<torch::Tensor> backward(const torch::Tensor& grad, const torch::Tensor& data, const torch::Tensor& keys,
                                    bool want_data, bool want_keys) {
  const bool key_major = check(data, keys);
  const int64_t M = data.size(0), n = data.size(1), dk = keys.size(0), blocks = (M + kRows - 1) / kRows;
  TORCH_CHECK(grad.scalar_type() == torch::kFloat32 && grad.is_contiguous() && grad.dim() == 2 && grad.size(0) == M &&
                  grad.size(1) == dk,
              "grad must be a contiguous float32 [M, Dk] tensor");
  const int64_t sh = key_major ? M : 1, sj = key_major ? 1 : n;
  const auto keys_t = keys.t().contiguous();  // [n, Dk]
  auto ddata_km = want_data ? torch::empty({n, M}, data.options()) : torch::Tensor();  // key-major
  auto ddata_tm = want_data && !key_major ? torch::empty({M, n}, data.options()) : torch::Tensor();
  auto partial = torch::empty({want_keys ? blocks : 0, n * dk}, data.options());
  const float *a = data.data_ptr<float>(), *g = grad.data_ptr<float>(), *kt = keys_t.data_ptr<float>();
  float* km = want_data ? ddata_km.data_ptr<float>() : nullptr;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    const at::AutoDispatchBelowADInplaceOrView no_autograd;  // grad mode is per thread: workers have it on
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t j0 = blk * kRows, m = std::min(kRows, M - j0);
      if (want_data) {  // ddata's columns j0.. [n, m] = keys_t [n, Dk] times grad's rows j0.. [m, Dk] transposed
        rmt_cpu::gemm(false, true, n, m, dk, kt, dk, g + j0 * dk, dk, km + j0, M);
        if (!key_major) rmt_cpu::transpose(km + j0, M, ddata_tm.data_ptr<float>() + j0 * n, n, m);
      }
      if (want_keys)
        rmt_cpu::keys_by_rows(dk, a + j0 * sj, sh, sj, g + j0 * dk, partial.data_ptr<float>() + blk * n * dk, n, m);
    }
  });
  return {want_data ? (key_major ? ddata_km.t() : ddata_tm) : torch::Tensor(),
          want_keys ? rmt_cpu::sum_blocks(partial).view({n, dk}).t().contiguous() : torch::Tensor()};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &forward, "RMT write forward: data [M, n] (token- or key-major), keys [Dk, n], residual [M, Dk] or "
        "None -> [M, Dk]", py::arg("data"), py::arg("keys"), py::arg("residual") = py::none());
  m.def("backward", &backward, "RMT write backward -> (ddata in data's layout, dkeys)");
}
