// The per-row update rules of the row-wise optimizers (rmt/ops/sparse_optim.py), shared by the
// optimizer steps on a stored gradient (sparse_optim_cpu.cpp) and the backward that applies the
// step to each row once its gradient is summed (lookup_reduce_update_cpu.cpp), so the two compute
// the same operations in the same order. Both translation units are built with
// -ffp-contract=off: every product and sum is rounded on its own, as in torch's formulation, but
// for the squares of row-wise Adagrad's gradient, summed with one rounding per term (madd) as the
// fused backward sums the gradient norm's squares, so that without weight decay it sums them once.
//
// grad_t is the gradient row's element type: the table's (a stored gradient) or the fp32/fp64
// accumulator of the fused backward, which is never rounded to a narrow table's dtype.
#pragma once

#include <cmath>
#include <cstdint>

#include "cpu_numerics.h"

namespace rmt_cpu {

// SparseAdam (torch.optim.SparseAdam's lazy Adam), element by element in state_t:
//   m += (1 - beta1) (g - m);  v += (1 - beta2) (g^2 - v);  p <- rn(p - step_size m / (sqrt(v) + eps))
template <typename param_t, typename state_t, typename grad_t>
inline void adam_row(param_t* __restrict p, state_t* __restrict m, state_t* __restrict v,
                     const grad_t* __restrict g, int64_t D, state_t one_minus_beta1, state_t one_minus_beta2,
                     state_t eps, state_t step_size) {
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) {
    const state_t gd = static_cast<state_t>(g[d]);
    const state_t mn = m[d] + (gd - m[d]) * one_minus_beta1;
    const state_t vn = v[d] + (gd * gd - v[d]) * one_minus_beta2;
    m[d] = mn;
    v[d] = vn;
    p[d] = round_to<param_t>(static_cast<state_t>(p[d]) - step_size * (mn / (std::sqrt(vn) + eps)));
  }
}

// Partial sums of a row's squared gradient (row-wise Adagrad).
constexpr int64_t kSquareLanes = 8;

// Row-wise Adagrad's weight decay, added to the gradient: g + wd p (Decay), and no term at all
// where wd is 0 (NoDecay), as in torch's Adagrad and the Python reference: g + 0 p would turn the
// gradient of a row holding an infinite weight into NaN, and with it the row's sum. with_decay
// calls f with the one that wd asks for.
struct NoDecay {
  float operator()(float g, float) const { return g; }
};
struct Decay {
  float wd;
  float operator()(float g, float p) const { return g + wd * p; }
};
template <typename F>
inline void with_decay(float weight_decay, F&& f) {
  if (weight_decay == 0.f) {
    f(NoDecay{});
  } else {
    f(Decay{weight_decay});
  }
}

// Row-wise Adagrad (DLRM / FBGEMM), in fp32 with one fp32 accumulator *sum per row:
//   g' = decay(g, p);  sum += mean(g'^2);  p <- rn(p - lr g' / (sqrt(sum) + eps))
// in three steps, so that the fused backward can take a group of rows through each in turn (see
// fused_update_units in lookup_reduce_update_cpu.cpp): rowwise_adagrad_squares sums the squares of g'
// in kSquareLanes partial sums (multiply-adds), rowwise_adagrad_scale combines them in a fixed
// order, updates *sum and returns lr / (sqrt(sum) + eps), and rowwise_adagrad_apply steps the row
// by it. The partial sums vectorize for every dtype (GCC keeps a single in-order sum of
// converted bf16 values scalar) and do not depend on the threading.
template <typename param_t, typename grad_t, typename decay_t>
inline void rowwise_adagrad_squares(const param_t* __restrict p, const grad_t* __restrict g, int64_t D,
                                    decay_t decay, float* __restrict part) {
#pragma omp simd
  for (int64_t j = 0; j < kSquareLanes; ++j) part[j] = 0.f;
  int64_t d0 = 0;
  for (; d0 + kSquareLanes <= D; d0 += kSquareLanes)
#pragma omp simd
    for (int64_t j = 0; j < kSquareLanes; ++j) {
      const float gd = decay(static_cast<float>(g[d0 + j]), static_cast<float>(p[d0 + j]));
      part[j] = madd(gd, gd, part[j]);
    }
  for (int64_t d = d0; d < D; ++d) {
    const float gd = decay(static_cast<float>(g[d]), static_cast<float>(p[d]));
    part[0] = madd(gd, gd, part[0]);
  }
}

inline float rowwise_adagrad_scale(float* __restrict sum, const float* __restrict part, int64_t D, float lr,
                                   float eps) {
  float sq = 0.f;
  for (int64_t j = 0; j < kSquareLanes; ++j) sq += part[j];
  const float s = *sum + sq / static_cast<float>(D);
  *sum = s;
  return lr / (std::sqrt(s) + eps);
}

template <typename param_t, typename grad_t, typename decay_t>
inline void rowwise_adagrad_apply(param_t* __restrict p, const grad_t* __restrict g, int64_t D, float scale,
                                  decay_t decay) {
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) {
    const float old = static_cast<float>(p[d]);
    p[d] = round_to<param_t>(old - scale * decay(static_cast<float>(g[d]), old));
  }
}

template <typename param_t, typename grad_t, typename decay_t>
inline void rowwise_adagrad_row(param_t* __restrict p, float* __restrict sum, const grad_t* __restrict g, int64_t D,
                                float lr, float eps, decay_t decay) {
  float part[kSquareLanes];
  rowwise_adagrad_squares(p, g, D, decay, part);
  rowwise_adagrad_apply(p, g, D, rowwise_adagrad_scale(sum, part, D, lr, eps), decay);
}

}  // namespace rmt_cpu
