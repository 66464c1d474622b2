// Torch binding of the CUDA lookup-reduce kernels (lookup_reduce_cuda_kernels.cu). Inputs arrive
// validated and contiguous from rmt/ops/lookup_reduce.py, indices and block ids as int64. The
// output has the scores' dtype, the table gradient the table's (a bf16/fp16 table may come with
// fp32 scores; see lookup_reduce_cuda_kernels.h).
//
// The backward's sort of the lookups by row depends only on the indices, so a forward that will
// be differentiated issues it at once on a side stream, where it runs beside the forward kernel,
// and copies the unique-row count U into pinned host memory. The backward finds the sort done:
// it reads U without draining the device queue (a plain device-to-host copy there would wait for
// all work queued before it, the dense layers' backward included) and is one kernel launch. All
// of this lives here rather than in Python because the host time of issuing the work is, at
// UltraMem's sizes, as long as the kernels themselves.
#include <torch/extension.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <memory>
#include <mutex>
#include <tuple>
#include <unordered_map>

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

cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

// cub's workspace query is host work of its own (device attribute look-ups): cached for the last M.
size_t sort_workspace_bytes(int64_t M) {
  static thread_local int64_t last_m = -1;
  static thread_local size_t last_bytes = 0;
  if (M != last_m) {
    last_bytes = rmt_lookup_reduce_sort_workspace_bytes(M);
    last_m = M;
  }
  return last_bytes;
}

// A CUDA event without timing. Written here rather than taken from ATen/cuda/CUDAEvent.h, whose
// includes (cuBLAS, cuSPARSE) are not in every CUDA toolkit, so the binding can be compile-checked
// on a machine with nvcc alone.
class Event {
 public:
  Event() { check(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming)); }
  ~Event() { cudaEventDestroy(event_); }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  void record(cudaStream_t stream) { check(cudaEventRecord(event_, stream)); }
  void block(cudaStream_t stream) { check(cudaStreamWaitEvent(stream, event_, 0)); }
  void synchronize() { check(cudaEventSynchronize(event_)); }

 private:
  cudaEvent_t event_;
};

// The device's stream for the backward's sort: always the same one, so the caching allocator,
// whose pools are per stream, reuses the sort's blocks from call to call.
c10::cuda::CUDAStream side_stream(c10::DeviceIndex device) {
  static std::mutex mutex;
  static std::unordered_map<c10::DeviceIndex, c10::cuda::CUDAStream> streams;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = streams.find(device);
  if (it == streams.end()) it = streams.emplace(device, c10::cuda::getStreamFromPool(false, device)).first;
  return it->second;
}

}  // namespace

// The lookups sorted by row, on the device: positions [M], unique rows (the first U of [M]),
// segment starts [M + 1], U as a [1] tensor and in pinned host memory, and the event after which
// all of them are set.
struct SortedLookups {
  at::Tensor sorted_positions, unique_rows, seg_start, num_unique, host_count;
  Event ready;

  // U, waiting on the host for the sort alone.
  int64_t count() {
    ready.synchronize();
    return host_count.data_ptr<int64_t>()[0];
  }
};
using SortedPtr = std::shared_ptr<SortedLookups>;

// Sort on the current stream: one allocation for the results, one for cub's workspace and the
// temporaries (freed on return; the caching allocator reuses them only behind this stream's work).
SortedPtr lookup_reduce_sort(const at::Tensor& indices, int64_t num_rows) {
  const int64_t M = indices.numel();
  int end_bit = 1;
  while (end_bit < 63 && (int64_t(1) << end_bit) < num_rows) ++end_bit;
  const size_t ws_bytes = (sort_workspace_bytes(M) + 255) / 256 * 256;
  auto scratch = at::empty({static_cast<int64_t>(ws_bytes + (3 * M + 1) * sizeof(int64_t))},
                           indices.options().dtype(at::kByte));
  auto* positions_in = reinterpret_cast<int64_t*>(static_cast<char*>(scratch.data_ptr()) + ws_bytes);
  int64_t* sorted_keys = positions_in + M;
  int64_t* counts = sorted_keys + M;
  auto results = at::empty({3 * M + 2}, indices.options());
  auto s = std::make_shared<SortedLookups>();
  s->sorted_positions = results.narrow(0, 0, M);
  s->unique_rows = results.narrow(0, M, M);
  s->seg_start = results.narrow(0, 2 * M, M + 1);
  s->num_unique = results.narrow(0, 3 * M + 1, 1);
  check(rmt_lookup_reduce_sort_cuda(indices.data_ptr<int64_t>(), M, end_bit, positions_in, sorted_keys,
                                    s->sorted_positions.data_ptr<int64_t>(), s->unique_rows.data_ptr<int64_t>(),
                                    counts, s->seg_start.data_ptr<int64_t>(), s->num_unique.data_ptr<int64_t>(),
                                    scratch.data_ptr(), ws_bytes, current_stream()));
  s->host_count = at::empty({1}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  s->host_count.copy_(s->num_unique, /*non_blocking=*/true);
  s->ready.record(current_stream());
  return s;
}

// (out [T, num_blocks, D], the backward's sort or None). With prepare_backward the sort is issued
// on a pool stream ordered after the current stream's work so far.
std::tuple<at::Tensor, SortedPtr> lookup_reduce_forward(const at::Tensor& table, const at::Tensor& indices,
                                                        const at::Tensor& scores,
                                                        const c10::optional<at::Tensor>& block_ids,
                                                        int64_t num_blocks, bool prepare_backward) {
  const int64_t T = indices.size(0), K = indices.size(1), C = scores.size(2), D = table.size(1);
  SortedPtr sorted;
  if (prepare_backward) {
    auto main = c10::cuda::getCurrentCUDAStream();
    auto side = side_stream(main.device_index());
    Event issued;
    issued.record(main.stream());
    issued.block(side.stream());
    {
      c10::cuda::CUDAStreamGuard guard(side);
      sorted = lookup_reduce_sort(indices, table.size(0));
    }
    sorted->sorted_positions.record_stream(main);  // one storage holds all four results
    indices.record_stream(side);
  }
  auto out = at::empty({T, num_blocks, D}, scores.options());
  check(rmt_lookup_reduce_forward_cuda(dtype_code(table.scalar_type()), dtype_code(scores.scalar_type()),
                                       table.data_ptr(), indices.data_ptr<int64_t>(), scores.data_ptr(),
                                       block_ptr(block_ids), out.data_ptr(), T, K, C, D, num_blocks,
                                       current_stream()));
  return {out, sorted};
}

// Gradient rows of the first max_unique unique rows (groups past U exit) into dst, the compact
// [U, D] buffer (dense = false) or the zeroed [N, D] table gradient (dense = true), and the score
// gradients into grad_scores; the current stream first waits for the sort.
void lookup_reduce_backward(const at::Tensor& grad_out, const at::Tensor& table, const at::Tensor& scores,
                            const c10::optional<at::Tensor>& block_ids, int64_t num_blocks, int64_t K,
                            SortedLookups& sorted, int64_t max_unique, at::Tensor& dst, bool dense,
                            at::Tensor& grad_scores) {
  sorted.ready.block(current_stream());
  check(rmt_lookup_reduce_backward_cuda(
      dtype_code(table.scalar_type()), dtype_code(scores.scalar_type()), grad_out.data_ptr(), table.data_ptr(),
      scores.data_ptr(), block_ptr(block_ids), sorted.sorted_positions.data_ptr<int64_t>(),
      sorted.seg_start.data_ptr<int64_t>(), sorted.unique_rows.data_ptr<int64_t>(),
      sorted.num_unique.data_ptr<int64_t>(), max_unique, dst.data_ptr(), dense, grad_scores.data_ptr(), K,
      scores.size(2), table.size(1), num_blocks, current_stream()));
}

// The backward with the optimizer fused in (rmt/ops/fused_update.py): after the sort, every row's
// gradient steps the table row and its fp32 state in place (adam: SparseAdam with moments
// state1/state2 and the bias-corrected step size lr; else row-wise Adagrad with per-row sums
// state1); score gradients of positions [score_lo, score_hi) into grad_scores; each row's
// squared gradient norm into row_sq. Launched over max_unique rows (groups past U exit): no host
// wait. Returns false where the kernel does not take the row width (D > 512).
bool lookup_reduce_backward_update(const at::Tensor& grad_out, at::Tensor& table, const at::Tensor& scores,
                                   const c10::optional<at::Tensor>& block_ids, int64_t num_blocks, int64_t K,
                                   SortedLookups& sorted, int64_t max_unique, at::Tensor& grad_scores,
                                   int64_t score_lo, int64_t score_hi, bool adam, at::Tensor& state1,
                                   const c10::optional<at::Tensor>& state2, at::Tensor& row_sq, double grad_scale,
                                   double lr, double beta1, double beta2, double eps, double weight_decay) {
  if (table.size(1) > 512) return false;
  TORCH_CHECK(state1.scalar_type() == at::kFloat && (!adam || (state2.has_value() && state2->scalar_type() == at::kFloat)),
              "lookup_reduce CUDA: the fused update keeps fp32 state");
  sorted.ready.block(current_stream());
  check(rmt_lookup_reduce_backward_update_cuda(
      dtype_code(table.scalar_type()), dtype_code(scores.scalar_type()), grad_out.data_ptr(), table.data_ptr(),
      scores.data_ptr(), block_ptr(block_ids), sorted.sorted_positions.data_ptr<int64_t>(),
      sorted.seg_start.data_ptr<int64_t>(), sorted.unique_rows.data_ptr<int64_t>(),
      sorted.num_unique.data_ptr<int64_t>(), max_unique, grad_scores.data_ptr(), score_lo, score_hi, adam ? 1 : 0,
      state1.data_ptr<float>(), adam ? state2->data_ptr<float>() : nullptr, row_sq.data_ptr<float>(), K,
      scores.size(2), table.size(1), num_blocks, static_cast<float>(grad_scale), static_cast<float>(lr),
      static_cast<float>(1 - beta1), static_cast<float>(1 - beta2), static_cast<float>(eps),
      static_cast<float>(weight_decay), current_stream()));
  return true;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "rmt fused lookup-reduce, CUDA kernels";
  pybind11::class_<SortedLookups, SortedPtr>(m, "SortedLookups")
      .def_readonly("sorted_positions", &SortedLookups::sorted_positions)
      .def_readonly("unique_rows", &SortedLookups::unique_rows)
      .def_readonly("seg_start", &SortedLookups::seg_start)
      .def_readonly("num_unique", &SortedLookups::num_unique)
      .def("count", &SortedLookups::count, "U, after waiting for the sort alone");
  m.def("forward", &lookup_reduce_forward,
        "lookup-reduce forward -> ([T, num_blocks, D], the backward's sort if prepare_backward else None)");
  m.def("sort", &lookup_reduce_sort, "lookups sorted by row on the current stream -> SortedLookups");
  m.def("backward", &lookup_reduce_backward,
        "lookup-reduce backward into dst (compact [U, D] or dense [N, D]) and grad_scores");
  m.def("backward_update", &lookup_reduce_backward_update,
        "lookup-reduce backward with the optimizer step fused in (false: row width not taken)");
}
