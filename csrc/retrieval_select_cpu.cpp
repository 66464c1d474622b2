// Fused retrieval's selection, CPU (OpenMP): the streaming top-m of the memory layers' keys
// (UltraMem arXiv 2411.12364 Eq. 2-3, 7-10) without the [T, H, r, n] score tensors. The contract,
// tie rule and arithmetic are rmt.ops.fused_retrieval's; rmt.ops.retrieval_reference states them
// in torch, and this kernel performs the same operations in the same order.
//
// Phase 1, one task per (block of token_block tokens, head, side), tasks handed out dynamically:
// the side's keys are read in tiles of key_tile; a tile's scores S_a = Q_a K_a^T (one GEMM per
// Tucker rank a: [Tb, D] x [D, tile], MKL's sgemm / dgemm through blas_gemm.h; bfloat16 inputs are
// widened to float first and the products rounded back to bfloat16, as torch's bf16 matmul rounds
// them) stay in cache while each token's running candidates absorb them. Product keys keep the m
// best S_0; TDQKR the m largest and the m smallest rank-1 objectives o = w_0 S_0 + w_1 S_1 + ...
// (Eq. 8-9), each with its r side scores, or every key while 2m >= n. A tile is first filtered
// against the lists' current bounds in a branch-free pass (only the few entries that can enter
// are inserted), and keys arrive in index order, so the tie rule is the insertion's: an entry
// enters the top list only above its m-th value (an equal one has a higher index), and the bottom
// list at or below its largest (an equal one with a higher index is further down the order).
//
// Phase 2, one task per (token, head): each side's candidates sorted by key index, the grid over
// them (s_row + s_col, or sum_b (sum_a s_row[a] C[a, b]) s_col[b] with the aggregated core C),
// visited in row-major order (= address order) and kept in a top-m whose ties go to the earlier
// entry. Outputs: addresses [T, H, m] int64, best first; the side scores at them [T, H, 2, r, m].
//
// Built with -ffp-contract=off: every product and sum is rounded on its own, as torch's elementwise
// operations in the reference round them, so the two select the same addresses from the same side
// scores. Working memory: per task r x Tb x key_tile scores (and the widened tiles for bfloat16);
// the candidates, T x H x 2 x c x (8 + 4 r) bytes (c = m, 2m or n), all from torch's allocator.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <numeric>
#include <vector>

#include "blas_gemm.h"
#include "ranked_list.h"

namespace {

template <typename T>
using acc_of = typename std::conditional<std::is_same<T, double>::value, double, float>::type;

template <typename A, bool kTop>
using Ranked = rmt_select::Ranked<A, int64_t, kTop>;

template <typename scalar_t>
inline acc_of<scalar_t> rounded(acc_of<scalar_t> x) {
  if constexpr (std::is_same<scalar_t, c10::BFloat16>::value)
    return static_cast<float>(c10::BFloat16(x));
  else
    return x;
}

struct Shape {
  int64_t T, H, r, D, n, m, c, tile, block;
  bool tucker, keep_all;
};

// Phase 1 for one (token block, head, side): writes the block's candidates to cand_idx [T, H, 2, c]
// and cand_side [T, H, 2, r, c].
template <typename scalar_t>
void stream_side(const Shape& s, const at::Tensor& q, const scalar_t* keys, const acc_of<scalar_t>* weights, int64_t t0,
                 int64_t h, int64_t side, int64_t* cand_idx, acc_of<scalar_t>* cand_side) {
  using A = acc_of<scalar_t>;
  const int64_t Tb = std::min(s.block, s.T - t0), r = s.r, D = s.D, n = s.n, m = s.m, c = s.c, tile = s.tile;
  const bool widen = !std::is_same<scalar_t, A>::value;
  auto opts = at::TensorOptions().dtype(c10::CppTypeToScalarType<A>::value);
  at::Tensor work = at::empty({r * Tb * D + r * Tb * tile + (widen ? tile * D : 0) + tile}, opts);
  A* Q = work.data_ptr<A>();
  A* S = Q + r * Tb * D;
  A* K = S + r * Tb * tile;  // the widened tile (bfloat16)
  A* obj = K + (widen ? tile * D : 0);
  at::Tensor hit_buf = at::empty({tile}, at::TensorOptions().dtype(at::kLong));
  int64_t* hits = hit_buf.data_ptr<int64_t>();
  const int64_t lists = s.keep_all ? 1 : (s.tucker ? 2 : 1), width = s.keep_all ? n : m;
  at::Tensor list_buf = at::empty({Tb * lists * width * (1 + r)}, opts);
  at::Tensor list_idx = at::empty({Tb * lists * width}, at::TensorOptions().dtype(at::kLong));
  A* lv = list_buf.data_ptr<A>();
  A* ls = lv + Tb * lists * width;
  int64_t* li = list_idx.data_ptr<int64_t>();
  std::vector<Ranked<A, true>> top;
  std::vector<Ranked<A, false>> bottom;
  for (int64_t i = 0; i < Tb; ++i) {
    const int64_t base = i * lists * width;
    top.push_back({width, r, 0, lv + base, li + base, ls + base * r});
    if (lists == 2) bottom.push_back({width, r, 0, lv + base + width, li + base + width, ls + (base + width) * r});
  }
  // the block's queries, widened: Q[a, i, :] = q[t0 + i, h, a, :]
  const auto qs = q.strides();
  const scalar_t* qp = q.data_ptr<scalar_t>();
  for (int64_t a = 0; a < r; ++a)
    for (int64_t i = 0; i < Tb; ++i) {
      const scalar_t* row = qp + (t0 + i) * qs[0] + h * qs[1] + a * qs[2];
      for (int64_t d = 0; d < D; ++d) Q[(a * Tb + i) * D + d] = static_cast<A>(row[d * qs[3]]);
    }
  A w[16];
  if (s.tucker)
    for (int64_t a = 0; a < r; ++a) w[a] = weights[h * r + a];
  int64_t kept = 0;  // keep_all: keys stored so far
  for (int64_t j0 = 0; j0 < n; j0 += tile) {
    const int64_t L = std::min(tile, n - j0);
    for (int64_t a = 0; a < r; ++a) {
      const scalar_t* kp = keys + (((h * 2 + side) * r + a) * n + j0) * D;
      const A* kt;
      if constexpr (std::is_same<scalar_t, A>::value) {
        kt = kp;
      } else {
        for (int64_t e = 0; e < L * D; ++e) K[e] = static_cast<A>(kp[e]);
        kt = K;
      }
      rmt_cpu::gemm<A>(false, true, Tb, L, D, Q + a * Tb * D, D, kt, D, S + a * Tb * tile, tile);
      if (widen)
        for (int64_t i = 0; i < Tb; ++i)
          for (int64_t j = 0; j < L; ++j) S[(a * Tb + i) * tile + j] = rounded<scalar_t>(S[(a * Tb + i) * tile + j]);
    }
    const int64_t sstride = Tb * tile;  // between ranks in S
    for (int64_t i = 0; i < Tb; ++i) {
      const A* si = S + i * tile;
      if (s.keep_all) {
        for (int64_t j = 0; j < L; ++j) {
          top[i].idx[kept + j] = j0 + j;
          for (int64_t a = 0; a < r; ++a) top[i].side[(kept + j) * r + a] = si[a * sstride + j];
        }
        continue;
      }
      const A* o = si;
      if (s.tucker) {
        for (int64_t j = 0; j < L; ++j) obj[j] = w[0] * si[j];
        for (int64_t a = 1; a < r; ++a) {
          const A* sa = si + a * sstride;
          for (int64_t j = 0; j < L; ++j) obj[j] = obj[j] + w[a] * sa[j];
        }
        o = obj;
      }
      const A hi = top[i].bound();
      int64_t count = 0;
      for (int64_t j = 0; j < L; ++j) {
        hits[count] = j;
        count += o[j] > hi;
      }
      for (int64_t e = 0; e < count; ++e) top[i].push(o[hits[e]], j0 + hits[e], si + hits[e], sstride);
      if (lists == 2) {
        const A lo = bottom[i].bound();
        count = 0;
        for (int64_t j = 0; j < L; ++j) {
          hits[count] = j;
          count += o[j] <= lo;
        }
        for (int64_t e = 0; e < count; ++e) bottom[i].push(o[hits[e]], j0 + hits[e], si + hits[e], sstride);
      }
    }
    kept += L;
  }
  for (int64_t i = 0; i < Tb; ++i) {
    const int64_t row = ((t0 + i) * s.H + h) * 2 + side;
    int64_t* ci = cand_idx + row * c;
    A* cs = cand_side + row * r * c;
    int64_t e = 0;
    for (int64_t l = 0; l < lists; ++l) {
      const int64_t* idx = l == 0 ? top[i].idx : bottom[i].idx;
      const A* sv = l == 0 ? top[i].side : bottom[i].side;
      for (int64_t p = 0; p < width; ++p, ++e) {
        ci[e] = idx[p];
        for (int64_t a = 0; a < r; ++a) cs[a * c + e] = sv[p * r + a];
      }
    }
  }
}

// A phase-2 task's working memory, kept by its thread between tokens (a few (2m)^2-grid rows).
template <typename A>
struct GridWork {
  std::vector<int64_t> order, index, pos;
  std::vector<A> sides, rv, best;
  void fit(int64_t c, int64_t r, int64_t m) {
    order.resize(c);
    index.resize(2 * c);
    pos.resize(m);
    sides.resize(2 * r * c);
    rv.resize(c * r);
    best.resize(m);
  }
};

// Phase 2 for one (token, head): the grid top-m over both sides' candidates.
template <typename scalar_t>
void finish(const Shape& s, const acc_of<scalar_t>* core, int64_t th, const int64_t* cand_idx,
            const acc_of<scalar_t>* cand_side, int64_t* addr, scalar_t* sel, GridWork<acc_of<scalar_t>>& w) {
  using A = acc_of<scalar_t>;
  const int64_t r = s.r, c = s.c, m = s.m, h = th % s.H;
  w.fit(c, r, m);
  for (int64_t side = 0; side < 2; ++side) {  // each side's candidates by key index
    const int64_t* ci = cand_idx + (th * 2 + side) * c;
    const A* cs = cand_side + (th * 2 + side) * r * c;
    std::iota(w.order.begin(), w.order.end(), 0);
    std::sort(w.order.begin(), w.order.end(), [&](int64_t x, int64_t y) { return ci[x] < ci[y]; });
    for (int64_t e = 0; e < c; ++e) {
      w.index[side * c + e] = ci[w.order[e]];
      for (int64_t a = 0; a < r; ++a) w.sides[(side * r + a) * c + e] = cs[a * c + w.order[e]];
    }
  }
  const A* sr = w.sides.data();
  const A* sc = sr + r * c;
  if (core != nullptr) {  // rv[i, b] = sum_a s_row[a, i] C[a, b], in order of a
    const A* C = core + h * r * r;
    for (int64_t i = 0; i < c; ++i)
      for (int64_t b = 0; b < r; ++b) {
        A v = C[b] * sr[i];
        for (int64_t a = 1; a < r; ++a) v = v + C[a * r + b] * sr[a * c + i];
        w.rv[i * r + b] = v;
      }
  }
  Ranked<A, true> top{m, 0, 0, w.best.data(), w.pos.data(), nullptr};
  for (int64_t i = 0; i < c; ++i) {
    if (core == nullptr) {
      const A x = sr[i];
      for (int64_t j = 0; j < c; ++j) {
        const A g = x + sc[j];
        if (top.enters(g)) top.push(g, i * c + j, nullptr, 0);
      }
    } else {
      const A* v = w.rv.data() + i * r;
      for (int64_t j = 0; j < c; ++j) {
        A g = v[0] * sc[j];
        for (int64_t b = 1; b < r; ++b) g = g + v[b] * sc[b * c + j];
        if (top.enters(g)) top.push(g, i * c + j, nullptr, 0);
      }
    }
  }
  for (int64_t k = 0; k < m; ++k) {
    const int64_t i = w.pos[k] / c, j = w.pos[k] % c;
    addr[th * m + k] = w.index[i] * s.n + w.index[c + j];
    for (int64_t a = 0; a < r; ++a) {
      sel[((th * 2 + 0) * r + a) * m + k] = static_cast<scalar_t>(sr[a * c + i]);
      sel[((th * 2 + 1) * r + a) * m + k] = static_cast<scalar_t>(sc[a * c + j]);
    }
  }
}

template <typename scalar_t>
void select(const Shape& s, const at::Tensor& q_row, const at::Tensor& q_col, const at::Tensor& keys,
            const at::Tensor& core, const at::Tensor& u, const at::Tensor& t, at::Tensor& addr, at::Tensor& sel) {
  using A = acc_of<scalar_t>;
  auto opts = at::TensorOptions().dtype(c10::CppTypeToScalarType<A>::value);
  at::Tensor cand_idx = at::empty({s.T * s.H * 2 * s.c}, at::TensorOptions().dtype(at::kLong));
  at::Tensor cand_side = at::empty({s.T * s.H * 2 * s.r * s.c}, opts);
  const scalar_t* kp = keys.data_ptr<scalar_t>();
  const A* up = s.tucker ? u.data_ptr<A>() : nullptr;
  const A* tp = s.tucker ? t.data_ptr<A>() : nullptr;
  const int64_t blocks = (s.T + s.block - 1) / s.block, tasks = blocks * s.H * 2;
  int64_t* ci = cand_idx.data_ptr<int64_t>();
  A* cs = cand_side.data_ptr<A>();
#pragma omp parallel for schedule(dynamic, 1) num_threads(at::get_num_threads())
  for (int64_t task = 0; task < tasks; ++task) {
    const int64_t side = task % 2, h = (task / 2) % s.H, b = task / (2 * s.H);
    stream_side<scalar_t>(s, side == 0 ? q_row : q_col, kp, side == 0 ? up : tp, b * s.block, h, side, ci, cs);
  }
  const A* cp = s.tucker ? core.data_ptr<A>() : nullptr;
  int64_t* ap = addr.data_ptr<int64_t>();
  scalar_t* sp = sel.data_ptr<scalar_t>();
  const int64_t pairs = s.T * s.H;
#pragma omp parallel num_threads(at::get_num_threads())
  {
    GridWork<A> work;
#pragma omp for schedule(dynamic, 16)
    for (int64_t th = 0; th < pairs; ++th) finish<scalar_t>(s, cp, th, ci, cs, ap, sp, work);
  }
}

std::vector<at::Tensor> retrieval_select(const at::Tensor& q_row, const at::Tensor& q_col, const at::Tensor& keys_in,
                                         int64_t m, const c10::optional<at::Tensor>& core_in,
                                         const c10::optional<at::Tensor>& u_in, const c10::optional<at::Tensor>& t_in,
                                         int64_t key_tile, int64_t token_block) {
  TORCH_CHECK(keys_in.dim() == 5 && keys_in.size(1) == 2, "retrieval_select: keys must be [H, 2, r, n, D]");
  const at::Tensor keys = keys_in.contiguous();
  Shape s{};
  s.H = keys.size(0);
  s.r = keys.size(2);
  s.n = keys.size(3);
  s.D = keys.size(4);
  s.T = q_row.size(0);
  s.m = m;
  s.tucker = core_in.has_value();
  TORCH_CHECK(s.r <= 16, "retrieval_select: Tucker rank above 16");
  for (const auto* q : {&q_row, &q_col})
    TORCH_CHECK(q->dim() == 4 && q->size(0) == s.T && q->size(1) == s.H && q->size(2) == s.r && q->size(3) == s.D &&
                    q->scalar_type() == keys.scalar_type(),
                "retrieval_select: queries must be [T, H, r, D] of the keys' dtype");
  s.keep_all = s.tucker && 2 * m >= s.n;
  s.c = s.keep_all ? s.n : (s.tucker ? 2 * m : m);
  TORCH_CHECK(m >= 1 && m <= (s.tucker ? s.c * s.c : s.n), "retrieval_select: m out of range");
  s.tile = std::max<int64_t>(1, std::min(key_tile, s.n));
  s.block = std::max<int64_t>(1, token_block);
  at::Tensor core, u, t;
  if (s.tucker) {
    core = core_in->contiguous();
    u = u_in->contiguous();
    t = t_in->contiguous();
    TORCH_CHECK(core.sizes() == at::IntArrayRef({s.H, s.r, s.r}) && u.sizes() == at::IntArrayRef({s.H, s.r}) &&
                    t.sizes() == u.sizes(),
                "retrieval_select: the selector must be C [H, r, r], u and t [H, r]");
    const auto acc = keys.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
    TORCH_CHECK(core.scalar_type() == acc && u.scalar_type() == acc && t.scalar_type() == acc,
                "retrieval_select: the selector must have the accumulation dtype (float64 for float64 keys, else "
                "float32)");
  }
  at::Tensor addr = at::empty({s.T, s.H, m}, keys.options().dtype(at::kLong));
  at::Tensor sel = at::empty({s.T, s.H, 2, s.r, m}, keys.options());
  if (s.T == 0) return {addr, sel};
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, keys.scalar_type(), "retrieval_select",
                                 [&] { select<scalar_t>(s, q_row, q_col, keys, core, u, t, addr, sel); });
  return {addr, sel};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.def("select", &retrieval_select,
          "fused retrieval's streaming selection -> (addresses [T, H, m], side scores [T, H, 2, r, m])",
          py::arg("q_row"), py::arg("q_col"), py::arg("keys"), py::arg("m"), py::arg("core"), py::arg("u"),
          py::arg("t"), py::arg("key_tile"), py::arg("token_block"), py::call_guard<py::gil_scoped_release>());
}
