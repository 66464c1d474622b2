// TDQKR two-phase top-m selection (UltraMem arXiv 2411.12364 Eq. 7-10), CPU, fused per token and
// head: one pass computes the rank-1 objectives u^T S_row / t^T S_col (Eq. 8-9) and keeps, per
// side, the m largest and the m smallest candidates; a second scores the (2m)^2 candidate grid
// S_row^T C S_col with the aggregated core C (Eq. 10) and keeps its top m, best first.
//
// The same selection as rmt.memory.retrieval.tucker_topk's torch path, without the [T, H, 2m, 2m]
// grid tensors and the per-call overhead of about ten small torch ops (what a decoding step is
// made of). Selection only: the caller computes the selected scores differentiably.
//
// Inputs: s_row, s_col [T, H, r, n] (any strides), u, t [H, r], core [H, r, r]; all float32 or
// float64. Returns int64 rows, cols [T, H, m], ordered by decreasing grid score.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <vector>

namespace {


// The k largest (value, index) pairs seen so far, kept sorted in decreasing value; a new entry
// costs one comparison unless it enters (expected O(k log(n/k)) insertions over n entries).
template <typename scalar_t>
struct TopK {
  int64_t k, size = 0;
  scalar_t* val;
  int64_t* idx;
  TopK(int64_t k, scalar_t* val, int64_t* idx) : k(k), val(val), idx(idx) {}
  inline void push(scalar_t v, int64_t i) {
    if (size == k) {
      if (!(v > val[k - 1])) return;
      --size;
    }
    int64_t p = size++;
    while (p > 0 && val[p - 1] < v) {
      val[p] = val[p - 1];
      idx[p] = idx[p - 1];
      --p;
    }
    val[p] = v;
    idx[p] = i;
  }
};

// One side's scores of one token and head: r rows of n entries, row a at p + a * sa, entry i at
// stride si.
template <typename scalar_t>
struct Side {
  const scalar_t* p;
  int64_t sa, si;
  inline scalar_t at(int64_t a, int64_t i) const { return p[a * sa + i * si]; }
};

// Pushes into `top` (k = m) every entry of sign * x[0..n) that can be among its m largest.
// The entries are split into m disjoint strided groups (group g: x[g], x[g + m], ...; their
// maxima are elementwise vector maxima over contiguous rows): each group holds an entry at
// least as large as the smallest group maximum, which is therefore a lower bound of the m-th
// largest entry. A branch-free pass lists the entries reaching it (about 3m for random scores,
// of n in the hundreds) and only those are pushed: no data-dependent branch per entry (they
// mispredict on random scores) and few sorted insertions.
template <typename scalar_t>
void push_top(const scalar_t* x, int64_t n, scalar_t sign, TopK<scalar_t>& top,
              std::vector<scalar_t>& maxs, std::vector<int64_t>& hits) {
  const int64_t m = top.k;
  if (n < 2 * m) {
    for (int64_t i = 0; i < n; ++i) top.push(sign * x[i], i);
    return;
  }
  const int64_t rows = n / m, tail = n - rows * m;
  maxs.resize(m);
  scalar_t* mx = maxs.data();
  for (int64_t g = 0; g < m; ++g) mx[g] = sign * x[g];
  for (int64_t j = 1; j < rows; ++j) {
    const scalar_t* p = x + j * m;
    for (int64_t g = 0; g < m; ++g) mx[g] = sign * p[g] > mx[g] ? sign * p[g] : mx[g];
  }
  for (int64_t g = 0; g < tail; ++g) {  // the tail joins the first groups
    const scalar_t v = sign * x[rows * m + g];
    mx[g] = v > mx[g] ? v : mx[g];
  }
  scalar_t bound = mx[0];
  for (int64_t g = 1; g < m; ++g) bound = mx[g] < bound ? mx[g] : bound;
  hits.resize(n);
  int64_t* hit = hits.data();
  int64_t count = 0;
  for (int64_t i = 0; i < n; ++i) {
    hit[count] = i;
    count += sign * x[i] >= bound;
  }
  for (int64_t c = 0; c < count; ++c) top.push(sign * x[hit[c]], hit[c]);
}

// Per side, the indices of the m largest and the m smallest of the rank-1 objective
// w^T S (Eq. 8-9), largest first then smallest first; all n indices when 2m >= n.
template <typename scalar_t>
void candidates(const Side<scalar_t>& s, const scalar_t* w, int64_t r, int64_t n, int64_t m,
                std::vector<scalar_t>& obj, std::vector<scalar_t>& val, std::vector<int64_t>& out,
                std::vector<scalar_t>& maxs, std::vector<int64_t>& hits) {
  if (2 * m >= n) {
    out.resize(n);
    for (int64_t i = 0; i < n; ++i) out[i] = i;
    return;
  }
  scalar_t* o = obj.data();
  if (s.si == 1) {
    for (int64_t i = 0; i < n; ++i) o[i] = w[0] * s.p[i];
    for (int64_t a = 1; a < r; ++a) {
      const scalar_t wa = w[a];
      const scalar_t* q = s.p + a * s.sa;
      for (int64_t i = 0; i < n; ++i) o[i] += wa * q[i];
    }
  } else {
    for (int64_t i = 0; i < n; ++i) {
      scalar_t acc = 0;
      for (int64_t a = 0; a < r; ++a) acc += w[a] * s.at(a, i);
      o[i] = acc;
    }
  }
  out.resize(2 * m);
  TopK<scalar_t> hi(m, val.data(), out.data()), lo(m, val.data() + m, out.data() + m);
  push_top<scalar_t>(o, n, 1, hi, maxs, hits);
  push_top<scalar_t>(o, n, -1, lo, maxs, hits);
}

template <typename scalar_t>
void select(const at::Tensor& s_row, const at::Tensor& s_col, const at::Tensor& u,
            const at::Tensor& t, const at::Tensor& core, int64_t m, at::Tensor& rows,
            at::Tensor& cols) {
  const int64_t T = s_row.size(0), H = s_row.size(1), r = s_row.size(2), n = s_row.size(3);
  const scalar_t* Pr = s_row.data_ptr<scalar_t>();
  const scalar_t* Pc = s_col.data_ptr<scalar_t>();
  const auto sr_st = s_row.strides(), sc_st = s_col.strides();
  const scalar_t* U = u.data_ptr<scalar_t>();
  const scalar_t* V = t.data_ptr<scalar_t>();
  const scalar_t* Cr = core.data_ptr<scalar_t>();
  int64_t* R = rows.data_ptr<int64_t>();
  int64_t* Cc = cols.data_ptr<int64_t>();
  at::parallel_for(0, T * H, 8, [&](int64_t begin, int64_t end) {
    std::vector<scalar_t> obj(n), val(2 * m), row_vec, col_mat, best(m), grid, maxs;
    std::vector<int64_t> rc, cc, pos(m), hits;
    for (int64_t th = begin; th < end; ++th) {
      const int64_t tt = th / H, h = th % H;
      const Side<scalar_t> sr{Pr + tt * sr_st[0] + h * sr_st[1], sr_st[2], sr_st[3]};
      const Side<scalar_t> sc{Pc + tt * sc_st[0] + h * sc_st[1], sc_st[2], sc_st[3]};
      candidates<scalar_t>(sr, U + h * r, r, n, m, obj, val, rc, maxs, hits);
      candidates<scalar_t>(sc, V + h * r, r, n, m, obj, val, cc, maxs, hits);
      const int64_t nr = rc.size(), nc = cc.size();
      // row_vec[i, b] = sum_a S_row[a, rc[i]] C[a, b];  col_mat[b, j] = S_col[b, cc[j]]
      row_vec.assign(nr * r, 0);
      const scalar_t* Ch = Cr + h * r * r;
      for (int64_t i = 0; i < nr; ++i)
        for (int64_t a = 0; a < r; ++a) {
          const scalar_t x = sr.at(a, rc[i]);
          for (int64_t b = 0; b < r; ++b) row_vec[i * r + b] += x * Ch[a * r + b];
        }
      col_mat.resize(r * nc);
      for (int64_t b = 0; b < r; ++b)
        for (int64_t j = 0; j < nc; ++j) col_mat[b * nc + j] = sc.at(b, cc[j]);
      grid.resize(nr * nc);
      for (int64_t i = 0; i < nr; ++i) {
        scalar_t* g = grid.data() + i * nc;
        const scalar_t x0 = row_vec[i * r];
        for (int64_t j = 0; j < nc; ++j) g[j] = x0 * col_mat[j];
        for (int64_t b = 1; b < r; ++b) {
          const scalar_t x = row_vec[i * r + b];
          const scalar_t* cb = col_mat.data() + b * nc;
          for (int64_t j = 0; j < nc; ++j) g[j] += x * cb[j];
        }
      }
      TopK<scalar_t> top(m, best.data(), pos.data());
      push_top<scalar_t>(grid.data(), nr * nc, 1, top, maxs, hits);
      for (int64_t k = 0; k < m; ++k) {
        R[th * m + k] = rc[pos[k] / nc];
        Cc[th * m + k] = cc[pos[k] % nc];
      }
    }
  });
}

std::vector<at::Tensor> tucker_select(const at::Tensor& s_row, const at::Tensor& s_col,
                                      const at::Tensor& u, const at::Tensor& t,
                                      const at::Tensor& core, int64_t m) {
  TORCH_CHECK(s_row.dim() == 4 && s_row.sizes() == s_col.sizes(),
              "tucker_select: s_row and s_col must both be [T, H, r, n]");
  const int64_t T = s_row.size(0), H = s_row.size(1), r = s_row.size(2), n = s_row.size(3);
  TORCH_CHECK(u.sizes() == at::IntArrayRef({H, r}) && t.sizes() == u.sizes() &&
                  core.sizes() == at::IntArrayRef({H, r, r}),
              "tucker_select: u, t must be [H, r] and core [H, r, r]");
  const int64_t side = 2 * m >= n ? n : 2 * m;
  TORCH_CHECK(m >= 1 && side * side >= m, "tucker_select: m must be in [1, candidate grid size]");
  auto type = s_row.scalar_type();
  TORCH_CHECK(s_col.scalar_type() == type && u.scalar_type() == type && t.scalar_type() == type &&
                  core.scalar_type() == type,
              "tucker_select: all inputs must share one dtype");
  auto opts = s_row.options().dtype(at::kLong);
  at::Tensor rows = at::empty({T, H, m}, opts), cols = at::empty({T, H, m}, opts);
  at::Tensor uc = u.contiguous(), tc = t.contiguous(), cc = core.contiguous();
  AT_DISPATCH_FLOATING_TYPES(type, "tucker_select", [&] {
    select<scalar_t>(s_row, s_col, uc, tc, cc, m, rows, cols);
  });
  return {rows, cols};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.def("tucker_select", &tucker_select,
          "TDQKR two-phase top-m selection (rows, cols [T, H, m]), UltraMem Eq. 7-10");
}
