// Fused row-wise optimizer steps for tables with sparse (touched-row) gradients, CPU (OpenMP).
//
// Both take the coalesced gradient as (rows [U] int64, unique; values [U, D]) and update only
// those rows, in one pass per row over the parameter row and its state, where the torch
// formulations (rmt/ops/sparse_optim.py, torch.optim.SparseAdam) make several passes through
// gathered copies (sparse_mask, index_select, index_add_, index_copy_). The rows are unique, so
// the threads own disjoint rows: no atomics, and the result does not depend on the thread count.
// The Adam step follows torch.optim.SparseAdam's operation order and scalar roundings; it
// differs from torch's only where torch's vectorized sqrt is not correctly rounded (1 ulp).
//
// sparse_adam_step: torch.optim.SparseAdam's update (lazy Adam), step_size = lr * sqrt(1 - beta2^t)
//   / (1 - beta1^t); rowwise_adagrad_step: one accumulator per row (DLRM / FBGEMM row-wise
//   Adagrad). The per-row rules are in row_optim.h, shared with the fused backward.
//
// Dtypes: the gradient rows have the parameter's dtype. Adam's moments are fp32 for bf16/fp16
// tables (at::opmath_type: the parameter's own dtype for fp32/fp64) and row-wise Adagrad's
// accumulator is always fp32. Each step reads the stored row and gradient, computes in the
// state's type (fp32 for Adagrad), and rounds the new row once to the parameter's dtype (to
// nearest even for bf16/fp16, c10's conversion).
#include <torch/extension.h>
#include <ATen/OpMathType.h>

#include <cmath>

#include "cpu_prefetch.h"
#include "row_optim.h"

namespace {

// Rows prefetched ahead of use: the touched rows are ascending but far apart, so the hardware
// prefetchers do not see them coming.
constexpr int64_t kPrefetchDistance = 8;

void check_rows(const at::Tensor& param, const at::Tensor& rows, const at::Tensor& values) {
  TORCH_CHECK(param.dim() == 2 && param.is_contiguous() && param.device().is_cpu(),
              "sparse optimizer step: the parameter must be a contiguous 2-D CPU tensor");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.is_contiguous(),
              "sparse optimizer step: rows must be a contiguous 1-D int64 tensor");
  TORCH_CHECK(values.dim() == 2 && values.size(0) == rows.size(0) && values.size(1) == param.size(1) &&
                  values.scalar_type() == param.scalar_type() && values.is_contiguous(),
              "sparse optimizer step: values must be [rows, D] of the parameter's dtype");
}

// param_t: the table's element type; state_t: the moments' and the arithmetic's.
template <typename param_t, typename state_t>
void sparse_adam_kernel(param_t* __restrict p, state_t* __restrict m, state_t* __restrict v,
                        const int64_t* __restrict rows, const param_t* __restrict g, int64_t U, int64_t D,
                        state_t one_minus_beta1, state_t one_minus_beta2, state_t eps, state_t step_size) {
#pragma omp parallel for schedule(static) num_threads(at::get_num_threads())
  for (int64_t u = 0; u < U; ++u) {
    if (u + kPrefetchDistance < U) {
      const int64_t ahead = rows[u + kPrefetchDistance] * D;
      rmt_cpu::prefetch_row(p + ahead, D * static_cast<int64_t>(sizeof(*p)));
      rmt_cpu::prefetch_row(m + ahead, D * static_cast<int64_t>(sizeof(*m)));
      rmt_cpu::prefetch_row(v + ahead, D * static_cast<int64_t>(sizeof(*v)));
    }
    const int64_t off = rows[u] * D;
    rmt_cpu::adam_row(p + off, m + off, v + off, g + u * D, D, one_minus_beta1, one_minus_beta2, eps, step_size);
  }
}

template <typename scalar_t, typename decay_t>
void rowwise_adagrad_kernel(scalar_t* __restrict p, float* __restrict sum, const int64_t* __restrict rows,
                            const scalar_t* __restrict g, int64_t U, int64_t D, float lr, float eps,
                            decay_t decay) {
#pragma omp parallel for schedule(static) num_threads(at::get_num_threads())
  for (int64_t u = 0; u < U; ++u) {
    if (u + kPrefetchDistance < U) {
      rmt_cpu::prefetch_row(p + rows[u + kPrefetchDistance] * D, D * static_cast<int64_t>(sizeof(*p)));
      rmt_cpu::prefetch_l2(sum + rows[u + kPrefetchDistance]);
    }
    rmt_cpu::rowwise_adagrad_row(p + rows[u] * D, sum + rows[u], g + u * D, D, lr, eps, decay);
  }
}

}  // namespace

void sparse_adam_step(at::Tensor param, at::Tensor exp_avg, at::Tensor exp_avg_sq, const at::Tensor& rows,
                      const at::Tensor& values, double lr, double beta1, double beta2, double eps, int64_t step) {
  check_rows(param, rows, values);
  const auto state_type = at::toOpMathType(param.scalar_type());
  TORCH_CHECK(exp_avg.sizes() == param.sizes() && exp_avg_sq.sizes() == param.sizes() &&
                  exp_avg.is_contiguous() && exp_avg_sq.is_contiguous() &&
                  exp_avg.scalar_type() == state_type && exp_avg_sq.scalar_type() == state_type,
              "sparse_adam_step: the moments must be contiguous, shaped like the parameter, of dtype ", state_type);
  const double step_size = lr * std::sqrt(1 - std::pow(beta2, step)) / (1 - std::pow(beta1, step));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, param.scalar_type(), "sparse_adam_step", [&] {
    using state_t = at::opmath_type<scalar_t>;
    sparse_adam_kernel<scalar_t, state_t>(param.data_ptr<scalar_t>(), exp_avg.data_ptr<state_t>(),
                                          exp_avg_sq.data_ptr<state_t>(), rows.data_ptr<int64_t>(),
                                          values.data_ptr<scalar_t>(), rows.size(0), param.size(1),
                                          static_cast<state_t>(1 - beta1), static_cast<state_t>(1 - beta2),
                                          static_cast<state_t>(eps), static_cast<state_t>(step_size));
  });
}

void rowwise_adagrad_step(at::Tensor param, at::Tensor state_sum, const at::Tensor& rows, const at::Tensor& values,
                          double lr, double eps, double weight_decay) {
  check_rows(param, rows, values);
  TORCH_CHECK(state_sum.dim() == 1 && state_sum.size(0) == param.size(0) && state_sum.scalar_type() == at::kFloat &&
                  state_sum.is_contiguous(),
              "rowwise_adagrad_step: the accumulator must be a contiguous fp32 vector with one entry per row");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, param.scalar_type(), "rowwise_adagrad_step", [&] {
    rmt_cpu::with_decay(static_cast<float>(weight_decay), [&](auto decay) {
      rowwise_adagrad_kernel<scalar_t>(param.data_ptr<scalar_t>(), state_sum.data_ptr<float>(),
                                       rows.data_ptr<int64_t>(), values.data_ptr<scalar_t>(), rows.size(0),
                                       param.size(1), static_cast<float>(lr), static_cast<float>(eps), decay);
    });
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "rmt fused row-wise optimizer steps (sparse Adam, row-wise Adagrad), CPU (OpenMP)";
  // The GIL is released: a host-memory table steps on a thread of its own (rmt.memory.host_table)
  // while the main thread runs the dense model.
  using release = py::call_guard<py::gil_scoped_release>;
  m.def("sparse_adam_step", &sparse_adam_step, "in-place SparseAdam step on the given unique rows", release());
  m.def("rowwise_adagrad_step", &rowwise_adagrad_step, "in-place row-wise Adagrad step on the given unique rows",
        release());
}
