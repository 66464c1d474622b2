// Fused lookup-reduce, CPU (OpenMP) kernels, bound through torch's extension API (the kernel's
// files: lookup_reduce_cpu.h). The kernels release the GIL: two Python threads (a memory layer's
// backward on the async memory stream's thread beside the main thread's work) run side by side.
#include <torch/extension.h>

#include "lookup_reduce_cpu.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace rmt_lookup;
  using release = py::call_guard<py::gil_scoped_release>;
  m.doc() = "rmt fused lookup-reduce, CPU (OpenMP) kernels";
  m.def("forward", &lookup_reduce_forward, "lookup-reduce forward -> [T, num_blocks, D]", release());
  m.def("backward", &lookup_reduce_backward,
        "lookup-reduce backward -> (unique rows, row gradients, score gradients)", release());
  m.def("backward_dense", &lookup_reduce_backward_dense,
        "lookup-reduce backward -> (dense [N, D] table gradient, score gradients)", release());
  m.def("score_gradients", &lookup_reduce_score_gradients,
        "lookup-reduce score gradients alone -> [T, K, C] (no table gradient)", release());
  m.def("backward_update", &lookup_reduce_backward_update,
        "lookup-reduce backward with the optimizer step fused in -> (score gradients, squared gradient norm)",
        release());
  m.def("sorted_lookups", &sorted_lookups, "the backward's sort alone -> packed (row << 32 | position), by row",
        py::arg("indices"), py::arg("num_rows"), py::arg("digit_bits"), py::arg("positions") = py::none());
  m.def("sort_digit_bits", [](int) { return sort_digit_bits(); },
        "the sort's digit width, the same on any thread count: RMT_SORT_DIGIT_BITS, else 10 bits",
        py::arg("threads") = 1);
}
