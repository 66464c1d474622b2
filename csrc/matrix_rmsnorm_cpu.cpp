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
//
// norm_read_* fuse the norm with the read that always follows it (Eq. 13: n key vectors read the
// normalized matrix, out[t, v, h] = sum_k keys[h, k] y[t, v, k]): blocks of rows are normalized
// into a scratch buffer that stays in cache and read from there with one GEMM per block, so y
// never goes to memory; the backward recomputes y per block the same way. Forward reads x once
// (norm then GEMM: read x, write y, read y); backward reads x and the small read gradient once
// and writes dx once (unfused: write dy, read y, read dy and x, write dx). Only x and rstd are
// saved, not y. The read's GEMMs are MKL's, except the backward's token-major dy and its dkeys for
// float32 with Dk 16 or 32, which take the register tiles of key_tiles.h. dkeys is a GEMM per
// block (reduction length rows x Dv), so on MKL's path, like any torch weight gradient, its last
// bits may depend on the thread count; dx and dgain do not.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "blas_gemm.h"
#include "block_ops.h"
#include "key_tiles.h"

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

// y = x r g for one row.
template <typename scalar_t>
inline void scale_row(const scalar_t* xr, const scalar_t* g, acc_t<scalar_t> r, scalar_t* yr, int64_t n) {
  using A = acc_t<scalar_t>;
  for (int64_t j = 0; j < n; ++j) yr[j] = static_cast<scalar_t>(static_cast<A>(xr[j]) * r * static_cast<A>(g[j]));
}

// Normalizes one row: y = x r g; returns r.
template <typename scalar_t>
inline acc_t<scalar_t> normalize_row(const scalar_t* xr, const scalar_t* g, scalar_t* yr, int64_t n, double eps) {
  using A = acc_t<scalar_t>;
  const A ss = dot<A, false>(xr, xr, xr, n);
  const A r = A(1) / std::sqrt(ss / static_cast<A>(n) + static_cast<A>(eps));
  scale_row(xr, g, r, yr, n);
  return r;
}

// One row's backward: dx = r (dy g - x c r^2 / n); dg += r dy x when dg is given. Where add is
// given, add's row is then added to the stored dx (one more rounding): the bits of adding the two
// gradients afterwards, as autograd does for a residual that is also read. A second loop over the
// row (in L1): in the first, GCC contracts r * (...) + add into one fused multiply-add, which
// skips dx's rounding.
template <typename scalar_t>
inline void backward_row(const scalar_t* dyr, const scalar_t* xr, const scalar_t* g, acc_t<scalar_t> r, scalar_t* dxr,
                         acc_t<scalar_t>* dg, int64_t n, const scalar_t* add = nullptr) {
  using A = acc_t<scalar_t>;
  const A c = dot<A, true>(dyr, g, xr, n);
  const A k = c * r * r / static_cast<A>(n);
  for (int64_t j = 0; j < n; ++j) {  // -O3 unswitches the loop on dg
    const A d = static_cast<A>(dyr[j]), v = static_cast<A>(xr[j]);
    dxr[j] = static_cast<scalar_t>(r * (d * static_cast<A>(g[j]) - v * k));
    if (dg) dg[j] += r * d * v;
  }
  if (add)
    for (int64_t j = 0; j < n; ++j) dxr[j] = static_cast<scalar_t>(static_cast<A>(dxr[j]) + static_cast<A>(add[j]));
}

template <typename scalar_t>
void forward_rows(const scalar_t* x, const scalar_t* g, scalar_t* y, acc_t<scalar_t>* rstd, int64_t T, int64_t n,
                  double eps) {
  at::parallel_for(0, T, kBlock, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) rstd[t] = normalize_row(x + t * n, g, y + t * n, n, eps);
  });
}

template <typename scalar_t>
void backward_rows(const scalar_t* dy, const scalar_t* x, const scalar_t* g, const acc_t<scalar_t>* rstd, scalar_t* dx,
                   acc_t<scalar_t>* partial, int64_t T, int64_t n, bool want_dg) {
  using A = acc_t<scalar_t>;
  const int64_t blocks = (T + kBlock - 1) / kBlock;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      A* dg = want_dg ? partial + b * n : nullptr;
      if (dg) std::fill(dg, dg + n, A(0));
      for (int64_t t = b * kBlock; t < std::min(T, (b + 1) * kBlock); ++t)
        backward_row(dy + t * n, x + t * n, g, rstd[t], dx + t * n, dg, n);
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
  auto partial = torch::empty({want_dg ? blocks : 0, n}, x.options().dtype(acc_dtype(x)));
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "matrix_rmsnorm_backward", [&] {
    using A = acc_t<scalar_t>;
    backward_rows<scalar_t>(dy.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), gain.data_ptr<scalar_t>(),
                            rstd.data_ptr<A>(), dx.data_ptr<scalar_t>(), partial.data_ptr<A>(), T, n, want_dg);
  });
  return {dx, want_dg ? rmt_cpu::sum_blocks(partial).to(gain.scalar_type()) : torch::Tensor()};
}

// Rows per block of the fused norm + read: a block's y (and dy) stay in L2 between the norm and
// the GEMM.
constexpr int64_t kReadBlockEntries = 1 << 15;

int64_t read_block_rows(int64_t n) { return std::max<int64_t>(1, kReadBlockEntries / n); }

void check_read(const torch::Tensor& x, const torch::Tensor& gain, const torch::Tensor& keys) {
  check(x, gain);
  TORCH_CHECK(keys.dim() == 2 && keys.scalar_type() == x.scalar_type() && keys.size(1) > 0 &&
                  x.size(1) % keys.size(1) == 0,
              "keys must be a [n, Dk] tensor of x's dtype with Dk dividing x's row length");
}

// The block [t0, t1) of the read's output (or its gradient): rows t0*Dv.. of [T*Dv, n], or
// columns t0*Dv.. of the key-major [n, T*Dv] layout.
torch::Tensor read_block(const torch::Tensor& out, int64_t t0, int64_t t1, int64_t dv, bool key_major) {
  return key_major ? out.narrow(1, t0 * dv, (t1 - t0) * dv) : out.narrow(0, t0 * dv, (t1 - t0) * dv);
}

// -> (out: [n, T*Dv] if key_major else [T*Dv, n], with out[t*Dv + v, h] = sum_k keys[h, k] y[t, v*Dk + k];
//     rstd [T] in the accumulation dtype)
std::vector<torch::Tensor> norm_read_forward(const torch::Tensor& x, const torch::Tensor& gain,
                                             const torch::Tensor& keys, double eps, bool key_major) {
  check_read(x, gain, keys);
  const int64_t T = x.size(0), n = x.size(1), dk = keys.size(1), dv = n / dk, heads = keys.size(0);
  const int64_t rows = read_block_rows(n), blocks = (T + rows - 1) / rows;
  auto out = key_major ? torch::empty({heads, T * dv}, x.options()) : torch::empty({T * dv, heads}, x.options());
  auto rstd = torch::empty({T}, x.options().dtype(acc_dtype(x)));
  const auto keys_c = keys.detach().contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "matrix_rmsnorm_read_forward", [&] {
    using A = acc_t<scalar_t>;
    const scalar_t *xp = x.data_ptr<scalar_t>(), *g = gain.data_ptr<scalar_t>();
    const scalar_t* kp = keys_c.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    A* r = rstd.data_ptr<A>();
    at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
      const at::AutoDispatchBelowADInplaceOrView no_autograd;  // grad mode is per thread: workers have it on
      auto y = torch::empty({rows * dv, dk}, x.options());
      scalar_t* yp = y.data_ptr<scalar_t>();
      // The token-major output is computed key-major and transposed into place: MKL's GEMM with
      // an n-wide output (n = R = 4 in the tiny RMT's feed-forward and unembedding reads) ran 3-5x
      // slower than the same product laid out key-major (docs/benchmarks.md). The backward's
      // GEMMs take the token-major gradient as it is: transposing it first measured slower.
      auto scratch = key_major ? torch::Tensor() : torch::empty({heads * rows * dv}, x.options());
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t t0 = b * rows, t1 = std::min(T, t0 + rows), m = (t1 - t0) * dv;
        for (int64_t t = t0; t < t1; ++t) r[t] = normalize_row(xp + t * n, g, yp + (t - t0) * n, n, eps);
        // the block's [heads, m] = keys [heads, Dk] times its y [m, Dk] transposed
        if (key_major) {
          rmt_cpu::gemm(false, true, heads, m, dk, kp, dk, yp, dk, op + t0 * dv, T * dv);
        } else {
          scalar_t* sp = scratch.data_ptr<scalar_t>();
          rmt_cpu::gemm(false, true, heads, m, dk, kp, dk, yp, dk, sp, m);
          rmt_cpu::transpose(sp, m, op + t0 * dv * heads, heads, m);
        }
      }
    });
  });
  return {out, rstd};
}

// -> (dx [T, n] (+ grad_residual, a contiguous [T, n] of x's dtype, where given: the gradient that
// reaches x past the norm, added in the same pass), dgain [n] or empty, dkeys [n_keys, Dk] or empty)
std::vector<torch::Tensor> norm_read_backward(const torch::Tensor& grad, const torch::Tensor& x, const torch::Tensor& gain,
                                              const torch::Tensor& keys, const torch::Tensor& rstd, bool key_major,
                                              bool want_dg, bool want_dkeys,
                                              const c10::optional<torch::Tensor>& grad_residual) {
  check_read(x, gain, keys);
  const bool add = grad_residual.has_value() && grad_residual->defined();
  TORCH_CHECK(!add || (grad_residual->scalar_type() == x.scalar_type() && grad_residual->is_contiguous() &&
                       grad_residual->sizes() == x.sizes()),
              "grad_residual must be a contiguous tensor of x's shape and dtype");
  const int64_t T = x.size(0), n = x.size(1), dk = keys.size(1), dv = n / dk, heads = keys.size(0);
  TORCH_CHECK(grad.scalar_type() == x.scalar_type() && grad.dim() == 2 && grad.is_contiguous() &&
                  grad.sizes() == (key_major ? at::IntArrayRef{heads, T * dv} : at::IntArrayRef{T * dv, heads}),
              "grad must be a contiguous tensor of the forward output's shape and x's dtype");
  TORCH_CHECK(rstd.scalar_type() == acc_dtype(x) && rstd.numel() == T, "rstd must be forward's [T] rstd");
  const int64_t rows = read_block_rows(n), blocks = (T + rows - 1) / rows;
  auto dx = torch::empty_like(x);
  auto partial_dg = torch::empty({want_dg ? blocks : 0, n}, x.options().dtype(acc_dtype(x)));
  auto partial_dkeys = torch::empty({want_dkeys ? blocks : 0, heads * dk}, x.options().dtype(acc_dtype(x)));
  const auto keys_c = keys.detach().contiguous();
  const bool hand = x.scalar_type() == torch::kFloat32 && rmt_cpu::tiled_width(dk);
  const float* keys_f = hand ? keys_c.data_ptr<float>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "matrix_rmsnorm_read_backward", [&] {
    using A = acc_t<scalar_t>;
    const scalar_t *xp = x.data_ptr<scalar_t>(), *g = gain.data_ptr<scalar_t>();
    const scalar_t *kp = keys_c.data_ptr<scalar_t>(), *gp = grad.data_ptr<scalar_t>();
    const scalar_t* res = add ? grad_residual->data_ptr<scalar_t>() : nullptr;
    scalar_t* dxp = dx.data_ptr<scalar_t>();
    const A* r = rstd.data_ptr<A>();
    at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
      const at::AutoDispatchBelowADInplaceOrView no_autograd;
      auto y = torch::empty({rows * dv, dk}, x.options());
      auto dy = torch::empty({rows * dv, dk}, x.options());
      scalar_t *yp = y.data_ptr<scalar_t>(), *dyp = dy.data_ptr<scalar_t>();
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t t0 = b * rows, t1 = std::min(T, t0 + rows), m = (t1 - t0) * dv;
        // The block's gradient: columns t0*Dv.. of the key-major [heads, T*Dv], rows of the
        // token-major [T*Dv, heads]; a[h, j] = gb[h*sh + j*sj].
        const scalar_t* gb = gp + t0 * dv * (key_major ? 1 : heads);
        const float* go = hand ? reinterpret_cast<const float*>(gb) : nullptr;
        const int64_t sh = key_major ? T * dv : 1, sj = key_major ? 1 : heads;
        // dy [m, Dk] = the block's gradient as [m, heads] times keys [heads, Dk]. Token-major by
        // the register tile (key_tiles.h); key-major, MKL's sgemm measured as fast as the tile.
        if (!hand || key_major)
          rmt_cpu::gemm(key_major, false, m, dk, heads, gb, key_major ? T * dv : heads, kp, dk, dyp, dk);
        else
          rmt_cpu::rows_by_keys(dk, go, sh, sj, keys_f, reinterpret_cast<float*>(dyp), heads, m);
        A* dg = want_dg ? partial_dg.data_ptr<A>() + b * n : nullptr;
        if (dg) std::fill(dg, dg + n, A(0));
        for (int64_t t = t0; t < t1; ++t) {
          const int64_t i = (t - t0) * n;
          backward_row(dyp + i, xp + t * n, g, r[t], dxp + t * n, dg, n, res ? res + t * n : nullptr);
          if (want_dkeys) scale_row(xp + t * n, g, r[t], yp + i, n);
        }
        if (want_dkeys) {
          if (!hand) {  // [heads, Dk] = the block's gradient as [heads, m] times its y [m, Dk]
            const auto g_blk = read_block(grad, t0, t1, dv, key_major);
            const auto yb = y.narrow(0, 0, m);
            partial_dkeys[b].copy_((key_major ? at::mm(g_blk, yb) : at::mm(g_blk.t(), yb)).view(-1));
          } else {
            rmt_cpu::keys_by_rows(dk, go, sh, sj, reinterpret_cast<const float*>(yp),
                                  partial_dkeys.data_ptr<float>() + b * heads * dk, heads, m);
          }
        }
      }
    });
  });
  return {dx, want_dg ? rmt_cpu::sum_blocks(partial_dg).to(gain.scalar_type()) : torch::Tensor(),
          want_dkeys ? rmt_cpu::sum_blocks(partial_dkeys).view({heads, dk}).to(keys.scalar_type()) : torch::Tensor()};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &forward, "matrix RMSNorm forward -> (y, rstd)");
  m.def("backward", &backward, "matrix RMSNorm backward -> (dx, dgain)");
  m.def("norm_read_forward", &norm_read_forward, "matrix RMSNorm + read forward -> (out, rstd)");
  m.def("norm_read_backward", &norm_read_backward, "matrix RMSNorm + read backward -> (dx (+ grad_residual), dgain, dkeys)",
        py::arg("grad"), py::arg("x"), py::arg("gain"), py::arg("keys"), py::arg("rstd"), py::arg("key_major"),
        py::arg("want_dg"), py::arg("want_dkeys"), py::arg("grad_residual") = py::none());
}
