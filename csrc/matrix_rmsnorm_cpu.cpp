// RMSNorm over a token's whole residual matrix (RMT, Mak & Flanigan §2.2; rmt.ops.matrix_rmsnorm
// holds the formula and the torch reference), CPU, one pass over memory per direction:
//
//   forward   r_t = 1 / sqrt(mean_j x_tj^2 + eps),  y_tj = x_tj r_t g_j
//   backward  c_t = sum_j dy_tj g_j x_tj,
//             dx_tj = r_t (dy_tj g_j - x_tj c_t r_t^2 / n),  dg_j = sum_t r_t dy_tj x_tj
//
// A row (Dk*Dv entries, a few KiB) stays in L1 between its two passes, so x and dy are read from
// memory once and y / dx written once; the torch reference makes about 3 passes forward and 8
// backward over [T, n] tensors, and the residual matrix is Dk/R times wider than a
// transformer's residual vector. Sums are accumulated in float (double for double inputs).
// dg's partial sums are kept per block of kBlock rows and added in block order, so results do not
// depend on the number of threads.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kBlock = 64;

template <typename T>
using acc_t = typename std::conditional<std::is_same<T, double>::value, double, float>::type;

// sum_j a_j b_j c_j (kThree false: sum_j a_j b_j) over n entries, in kLanes interleaved partial sums
// added pairwise at the end: a fixed order the compiler can vectorize (a single running sum is a
// chain of dependent additions it may not reorder).
constexpr int64_t kLanes = 16;

template <typename A, bool kThree, typename scalar_t>
inline A dot(const scalar_t* a, const scalar_t* b, const scalar_t* c, int64_t n) {
  A lane[kLanes] = {};
  const int64_t full = n - n % kLanes;
  for (int64_t j = 0; j < full; j += kLanes)
    for (int64_t l = 0; l < kLanes; ++l)
      lane[l] += static_cast<A>(a[j + l]) * static_cast<A>(b[j + l]) * (kThree ? static_cast<A>(c[j + l]) : A(1));
  for (int64_t j = full; j < n; ++j)
    lane[j - full] += static_cast<A>(a[j]) * static_cast<A>(b[j]) * (kThree ? static_cast<A>(c[j]) : A(1));
  for (int64_t width = kLanes / 2; width > 0; width /= 2)
    for (int64_t l = 0; l < width; ++l) lane[l] += lane[l + width];
  return lane[0];
}

template <typename scalar_t>
void forward_rows(const scalar_t* x, const scalar_t* g, scalar_t* y, acc_t<scalar_t>* rstd, int64_t T, int64_t n,
                  double eps) {
  using A = acc_t<scalar_t>;
  at::parallel_for(0, T, kBlock, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const scalar_t* xr = x + t * n;
      const A ss = dot<A, false>(xr, xr, xr, n);
      const A r = A(1) / std::sqrt(ss / static_cast<A>(n) + static_cast<A>(eps));
      rstd[t] = r;
      scalar_t* yr = y + t * n;
      for (int64_t j = 0; j < n; ++j) yr[j] = static_cast<scalar_t>(static_cast<A>(xr[j]) * r * static_cast<A>(g[j]));
    }
  });
}

template <typename scalar_t>
void backward_rows(const scalar_t* dy, const scalar_t* x, const scalar_t* g, const acc_t<scalar_t>* rstd, scalar_t* dx,
                   acc_t<scalar_t>* partial, int64_t T, int64_t n, bool want_dg) {
  using A = acc_t<scalar_t>;
  const int64_t blocks = (T + kBlock - 1) / kBlock;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      A* dg = partial + b * n;
      if (want_dg)
        for (int64_t j = 0; j < n; ++j) dg[j] = 0;
      for (int64_t t = b * kBlock; t < std::min(T, (b + 1) * kBlock); ++t) {
        const scalar_t *dyr = dy + t * n, *xr = x + t * n;
        const A r = rstd[t];
        const A c = dot<A, true>(dyr, g, xr, n);
        const A k = c * r * r / static_cast<A>(n);
        scalar_t* dxr = dx + t * n;
        for (int64_t j = 0; j < n; ++j) {  // -O3 unswitches the loop on want_dg
          const A d = static_cast<A>(dyr[j]), v = static_cast<A>(xr[j]);
          dxr[j] = static_cast<scalar_t>(r * (d * static_cast<A>(g[j]) - v * k));
          if (want_dg) dg[j] += r * d * v;
        }
      }
    }
  });
}

void check(const torch::Tensor& x, const torch::Tensor& gain) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous(), "x must be a contiguous CPU [T, n] tensor");
  TORCH_CHECK(gain.dim() == 1 && gain.size(0) == x.size(1) && gain.is_contiguous() &&
                  gain.scalar_type() == x.scalar_type(),
              "gain must be a contiguous [n] tensor of x's dtype");
}

// The accumulation dtype of x's: float64 for float64, else float32.
torch::ScalarType acc_dtype(const torch::Tensor& x) {
  return x.scalar_type() == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32;
}

// -> (y [T, n] in x's dtype, rstd [T] in the accumulation dtype)
std::vector<torch::Tensor> forward(const torch::Tensor& x, const torch::Tensor& gain, double eps) {
  check(x, gain);
  auto y = torch::empty_like(x);
  auto rstd = torch::empty({x.size(0)}, x.options().dtype(acc_dtype(x)));
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "matrix_rmsnorm_forward", [&] {
    forward_rows<scalar_t>(x.data_ptr<scalar_t>(), gain.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(),
                           rstd.data_ptr<acc_t<scalar_t>>(), x.size(0), x.size(1), eps);
  });
  return {y, rstd};
}

// -> (dx [T, n] in x's dtype, dg [n] in gain's dtype, or an empty tensor when not wanted)
std::vector<torch::Tensor> backward(const torch::Tensor& dy, const torch::Tensor& x, const torch::Tensor& gain,
                                    const torch::Tensor& rstd, bool want_dg) {
  check(x, gain);
  TORCH_CHECK(dy.sizes() == x.sizes() && dy.is_contiguous() && dy.scalar_type() == x.scalar_type(),
              "dy must be a contiguous tensor of x's shape and dtype");
  TORCH_CHECK(rstd.scalar_type() == acc_dtype(x) && rstd.numel() == x.size(0), "rstd must be forward's [T] rstd");
  const int64_t T = x.size(0), n = x.size(1), blocks = (T + kBlock - 1) / kBlock;
  auto dx = torch::empty_like(x);
  torch::Tensor dg;
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "matrix_rmsnorm_backward", [&] {
    using A = acc_t<scalar_t>;
    auto partial = torch::empty({want_dg ? blocks : 0, n}, x.options().dtype(acc_dtype(x)));
    backward_rows<scalar_t>(dy.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), gain.data_ptr<scalar_t>(),
                            rstd.data_ptr<A>(), dx.data_ptr<scalar_t>(), partial.data_ptr<A>(), T, n, want_dg);
    if (want_dg) {
      auto total = torch::zeros({n}, partial.options());
      A* out = total.data_ptr<A>();
      const A* p = partial.data_ptr<A>();
      for (int64_t b = 0; b < blocks; ++b)
        for (int64_t j = 0; j < n; ++j) out[j] += p[b * n + j];
      dg = total.to(gain.scalar_type());
    }
  });
  return {dx, want_dg ? dg : torch::Tensor()};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &forward, "matrix RMSNorm forward -> (y, rstd)");
  m.def("backward", &backward, "matrix RMSNorm backward -> (dx, dgain)");
}
