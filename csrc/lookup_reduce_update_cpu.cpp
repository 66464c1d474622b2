// The backward with the optimizer step fused in: each touched row's gradient, once summed from
// its sorted lookups (lookup_reduce_backward_cpu.h), steps the row and its optimizer state in
// place (SparseAdam or row-wise Adagrad, the rules of row_optim.h), as FBGEMM's table-batched
// embeddings do; the score gradients are computed before the row changes. No gradient is stored.
#include <ATen/OpMathType.h>

#include <cmath>

#include "lookup_reduce_backward_cpu.h"
#include "row_optim.h"

namespace rmt_lookup {

namespace {

// Adds the squares of acc[0:D], a row's share of the gradient norm that clipping reads, to the
// fp64 lanes sq[0:kLanes]: lane j gets the sum of the squares of elements j, j + kLanes, ... taken
// in the accumulation dtype (fp32 but for fp64 scores), which are left in part[0:kLanes] for the
// row rule. All terms are non-negative, so each lane's share is within gamma_(2 D / kLanes) of
// exact, relatively (about 1e-6 at D = 64): the precision of torch's and megatron's fp32 gradient
// norms, at a fraction of the cost of converting every element to fp64.
template <typename acc_t>
inline void add_squares(const acc_t* __restrict acc, int64_t D, acc_t* __restrict part, double* __restrict sq) {
  for (int64_t j = 0; j < kLanes; ++j) part[j] = acc_t(0);
  int64_t d = 0;
  for (; d + kLanes <= D; d += kLanes)
#pragma omp simd
    for (int64_t j = 0; j < kLanes; ++j) part[j] = madd(acc[d + j], acc[d + j], part[j]);
  for (; d < D; ++d) part[0] = madd(acc[d], acc[d], part[0]);
#pragma omp simd
  for (int64_t j = 0; j < kLanes; ++j) sq[j] += static_cast<double>(part[j]);
}

// Lookups per chunk of the fused backward (at least 256 chunks for 2^17 lookups).
constexpr int64_t kLookupsPerNormChunk = 512;

// Floats of per-row optimizer scratch the fused backward keeps for each row of a group.
constexpr int64_t kRowScratch = rmt_cpu::kSquareLanes;

// Units [lo, hi) of the fused backward (one chunk; see fused_backward_kernel), a unit being a run
// of the sorted lookups, in groups of kGroup rows. For each unit,
// row = gradient(unit, acc_b) sums its row's gradient in acc_b = acc[b * D:(b + 1) * D] (no
// gradient row is stored) and returns the row. The gradient is then
// multiplied by grad_scale (the data-parallel mean; negative for a maximizing Adam), its squares
// added to the fp64 lanes sq, and prepare(row, acc_b, squares, scratch_b, kD) reads it and the
// fp32 partial sums of its squares that add_squares left (row-wise Adagrad: the partial sums of
// the squares of its decayed gradient, those same ones where it has no decay); once the group is
// full, f_b = factor(row, scratch_b) for its rows in turn (row-wise Adagrad: the row's scale, its
// state updated); then apply(row, acc_b, f_b, kD) steps each table row (kD as in
// dispatch_row_shape: the row rule runs at a compile-time width).
// Units have distinct rows, and each row's score gradients read it before it changes. Row-wise
// Adagrad's rule is a dependent chain (sum of squares, square root, division), so its rows are
// stepped in groups of 8 whose chains run side by side; SparseAdam's, a pass over two moment rows
// with no such chain, steps each row at once (kGroup = 1). The row width is a template constant.
template <int64_t kGroup, typename acc_t, int64_t kD, typename Gradient, typename Prepare, typename Factor,
          typename Apply>
void fused_update_units(int64_t lo, int64_t hi, int64_t runtime_D, acc_t grad_scale, acc_t* __restrict acc,
                        double* __restrict sq, Gradient&& gradient, Prepare& prepare, Factor& factor, Apply& apply) {
  const int64_t D = kD ? kD : runtime_D;
  constexpr std::integral_constant<int64_t, kD> width{};
  float scratch[kGroup * kRowScratch];
  float f[kGroup];
  int64_t rows[kGroup];
  int64_t n = 0;
  auto step = [&] {
    for (int64_t b = 0; b < n; ++b) f[b] = factor(rows[b], scratch + b * kRowScratch);
    for (int64_t b = 0; b < n; ++b) apply(rows[b], acc + b * D, f[b], width);
    n = 0;
  };
  for (int64_t unit = lo; unit < hi; ++unit) {
    acc_t* __restrict a = acc + n * D;
    const int64_t row = gradient(unit, a);
    if (grad_scale != acc_t(1)) {
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) a[d] *= grad_scale;
    }
    acc_t squares[kLanes];
    add_squares(a, D, squares, sq);
    prepare(row, a, squares, scratch + n * kRowScratch, width);
    rows[n] = row;
    if (++n == kGroup) step();
  }
  step();
}

// The backward with the optimizer fused in (fused_update_units): the runs of the sorted lookups s,
// cut into chunks of about kLookupsPerNormChunk lookups that the threads take in turn. Runs own
// distinct rows, so the threads update disjoint rows and state. Returns the squared norm of the
// scaled gradient (the chunks' partials summed in chunk order: the same bits whatever the thread
// count).
template <int64_t kGroup, typename table_t, typename scalar_t, typename Prepare, typename Factor, typename Apply,
          typename Ahead>
double fused_backward_kernel(const scalar_t* __restrict grad_out, const table_t* __restrict table,
                             const scalar_t* __restrict scores, const int64_t* __restrict blk, const SortedLookups& s,
                             scalar_t* __restrict grad_scores, int64_t score_lo, int64_t score_hi, int64_t M,
                             int64_t K, int64_t C, int64_t D, int64_t E, typename Acc<scalar_t>::type grad_scale,
                             Prepare&& prepare, Factor&& factor, Apply&& apply, Ahead&& ahead) {
  using acc_t = typename Acc<scalar_t>::type;
  // chunks of about kLookupsPerNormChunk lookups, whatever the thread count: the norm's partial
  // sums, and so its bits, do not depend on it
  const int64_t U = s.num_runs, chunks = std::max<int64_t>(1, std::min<int64_t>(U, M / kLookupsPerNormChunk));
  const int64_t* start = s.run_start.data();
  std::vector<double> chunk_sq(chunks, 0.0);
  const Divisor token_of(K);
  dispatch_row_shape(D, C, [&](auto kD, auto kC) {
    constexpr int64_t kDv = decltype(kD)::value, kCv = decltype(kC)::value;
#pragma omp parallel num_threads(at::get_num_threads())
    {
      std::vector<acc_t> acc(kGroup * D);
#pragma omp for schedule(dynamic, 1) nowait
      for (int64_t ch = 0; ch < chunks; ++ch) {
        const int64_t lo = std::lower_bound(start, start + U, ch * M / chunks) - start;
        const int64_t hi = std::lower_bound(start, start + U, (ch + 1) * M / chunks) - start;
        double sq[kLanes] = {};
        fused_update_units<kGroup, acc_t, kDv>(
            lo, hi, D, grad_scale, acc.data(), sq,
            [&](int64_t u, acc_t* a) {
              run_gradient<table_t, scalar_t, acc_t, kDv, kCv>(u, s, grad_out, table, scores, blk, a, grad_scores,
                                                               score_lo, score_hi, M, token_of, C, D, E, ahead);
              return s.rows[u];
            },
            prepare, factor, apply);
        for (int64_t j = 0; j < kLanes; ++j) chunk_sq[ch] += sq[j];
      }
    }
  });
  double total = 0.0;
  for (double x : chunk_sq) total += x;
  return total;
}

// Prefetches the n elements at a and at b into L2 (a row of both Adam moments; see cpu_prefetch.h),
// one prefetch per 64-byte line of each, in one loop (GCC dropped the prefetches of two separate
// loops, one per moment).
template <typename T>
inline void prefetch_pair(const T* a, const T* b, int64_t n) {
  constexpr int64_t kPerLine = 64 / static_cast<int64_t>(sizeof(T));
  for (int64_t i = 0; i < n; i += kPerLine) {
    prefetch_l2(a + i);
    prefetch_l2(b + i);
  }
}

}  // namespace

// Optimizers the fused backward applies (rmt/ops/sparse_optim.py; kinds as in rmt/ops/fused_update.py).
constexpr int64_t kSparseAdam = 0, kRowwiseAdagrad = 1;

// The backward with the optimizer step fused in: score gradients of the lookups of tokens
// [score_first, score_first + score_tokens) (returned, [score_tokens, K, C]) and, for every touched row, the gradient
// summed over its lookups times grad_scale, stepped into the table row and its optimizer state
// in place (SparseAdam: state1/state2 the moments, of the table's opmath dtype; row-wise Adagrad:
// state1 the fp32 per-row sums), and the squared norm of those gradients.
std::tuple<at::Tensor, double> lookup_reduce_backward_update(
    const at::Tensor& grad_out, at::Tensor table, const at::Tensor& indices, const at::Tensor& scores,
    const c10::optional<at::Tensor>& block_ids, int64_t num_blocks, int64_t score_first, int64_t score_tokens,
    int64_t optimizer,
    at::Tensor state1, const c10::optional<at::Tensor>& state2, double lr, double beta1, double beta2, double eps,
    double weight_decay, int64_t step, double grad_scale) {
  const int64_t T = indices.size(0), K = indices.size(1), C = scores.size(2);
  const int64_t N = table.size(0), D = table.size(1);
  TORCH_CHECK(table.is_contiguous() && score_first >= 0 && score_tokens >= 0 && score_first + score_tokens <= T,
              "lookup_reduce_backward_update: a contiguous table and score tokens within [0, T)");
  TORCH_CHECK(optimizer == kSparseAdam || optimizer == kRowwiseAdagrad,
              "lookup_reduce_backward_update: unknown optimizer ", optimizer);
  SortedLookups& runs = caller_sort_scratch();
  sort_lookups(indices.data_ptr<int64_t>(), nullptr, T * K, N, runs);
  auto grad_scores = at::empty({score_tokens, K, C}, scores.options());
  double sq = 0.0;
  dispatch_dtypes(table, scores, "lookup_reduce_backward_update", [&](auto table_tag, auto score_tag) {
    using table_t = decltype(table_tag);
    using scalar_t = decltype(score_tag);
    using acc_t = typename Acc<scalar_t>::type;
    table_t* __restrict p = table.data_ptr<table_t>();
    auto run = [&](auto group, auto&& prepare, auto&& factor, auto&& apply, auto&& ahead) {
      sq = fused_backward_kernel<decltype(group)::value, table_t, scalar_t>(
          grad_out.data_ptr<scalar_t>(), p, scores.data_ptr<scalar_t>(), block_ptr(block_ids), runs,
          grad_scores.data_ptr<scalar_t>(), score_first * K, (score_first + score_tokens) * K, T * K, K, C, D,
          num_blocks, static_cast<acc_t>(grad_scale), prepare, factor, apply, ahead);
    };
    if (optimizer == kSparseAdam) {
      using state_t = at::opmath_type<table_t>;
      const auto state_type = c10::CppTypeToScalarType<state_t>::value;
      TORCH_CHECK(state2.has_value() && state1.sizes() == table.sizes() && state2->sizes() == table.sizes() &&
                      state1.is_contiguous() && state2->is_contiguous() && state1.scalar_type() == state_type &&
                      state2->scalar_type() == state_type,
                  "lookup_reduce_backward_update: the Adam moments must be contiguous, shaped like the table, of dtype ",
                  state_type);
      state_t* __restrict m = state1.data_ptr<state_t>();
      state_t* __restrict v = state2->data_ptr<state_t>();
      const double step_size = lr * std::sqrt(1 - std::pow(beta2, step)) / (1 - std::pow(beta1, step));
      const auto omb1 = static_cast<state_t>(1 - beta1), omb2 = static_cast<state_t>(1 - beta2);
      const auto eps_s = static_cast<state_t>(eps), step_s = static_cast<state_t>(step_size);
      run(std::integral_constant<int64_t, 1>(), [](int64_t, const acc_t*, const acc_t*, float*, auto) {},
          [](int64_t, const float*) { return 0.f; },
          [&](int64_t row, const acc_t* g, float, auto kD) {
            const int64_t w = row_width(kD, D);
            rmt_cpu::adam_row(p + row * w, m + row * w, v + row * w, g, w, omb1, omb2, eps_s, step_s);
          },
          [&](int64_t row) { prefetch_pair(m + row * D, v + row * D, D); });
    } else {
      TORCH_CHECK(state1.dim() == 1 && state1.size(0) == N && state1.scalar_type() == at::kFloat &&
                      state1.is_contiguous(),
                  "lookup_reduce_backward_update: the row-wise Adagrad sums must be a contiguous fp32 vector, one per row");
      float* __restrict sum = state1.data_ptr<float>();
      const float lr_f = static_cast<float>(lr), eps_f = static_cast<float>(eps);
      rmt_cpu::with_decay(static_cast<float>(weight_decay), [&](auto decay) {
        run(std::integral_constant<int64_t, 8>(),
            [&](int64_t row, const acc_t* g, const acc_t* squares, float* part, auto kD) {
              // without decay the rule's squares are the norm's, summed the same way (FMA into
              // kLanes fp32 lanes): taken once
              if constexpr (std::is_same_v<decltype(decay), rmt_cpu::NoDecay> && std::is_same_v<acc_t, float>) {
                static_assert(rmt_cpu::kSquareLanes == kLanes, "the norm's and the rule's lanes must match");
                std::copy(squares, squares + kLanes, part);
              } else {
                const int64_t w = row_width(kD, D);
                rmt_cpu::rowwise_adagrad_squares(p + row * w, g, w, decay, part);
              }
            },
            [&](int64_t row, const float* part) { return rmt_cpu::rowwise_adagrad_scale(sum + row, part, D, lr_f, eps_f); },
            [&](int64_t row, const acc_t* g, float scale, auto kD) {
              const int64_t w = row_width(kD, D);
              rmt_cpu::rowwise_adagrad_apply(p + row * w, g, w, scale, decay);
            },
            // the one prefetch for writing (into L1): a single float per row
            [&](int64_t row) { __builtin_prefetch(sum + row, 1, 2); });
      });
    }
  });
  return {grad_scores, sq};
}

}  // namespace rmt_lookup
