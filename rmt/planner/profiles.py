"""The hardware profiles rmt ships (:mod:`rmt.planner.hardware` defines the fields): an H100 SXM
80 GB and an A100 SXM 80 GB in 8-GPU nodes (DGX H100 / DGX A100: NVSwitch inside the node, one
InfiniBand NIC per GPU across nodes), from public specifications and published measurements.
Each assumed efficiency and its source is in the profile's ``sources``.

fp32 training runs its GEMMs on the CUDA cores: torch leaves TF32 off for matrix products
(``torch.backends.cuda.matmul.allow_tf32`` is ``False`` by default) and rmt does not switch it
on, so the fp32 peak is the non-tensor FP32 rate. bf16 runs on the tensor cores at the dense
(not sparse) BF16 peak.

Derived, not stated: the elementwise kinds' rates are the FP32 peak over their arithmetic per
element (:data:`ELEMENTWISE_FLOPS`, twice that backward), far above the rate of their bytes: on
these GPUs they are memory-bound; the top-k selections' rate is the memory bandwidth over the bytes of a
radix select over fp32 keys (four 8-bit digit passes, each reading the 4-byte keys: 16 bytes an
element); an A100's lookup-reduce rates are the H100's measured ones scaled by the two HBM
bandwidths (the kernel is bound by the gathered rows' bytes).
"""

from __future__ import annotations

from typing import Dict

GIGA = 1e9
TERA = 1e12
RADIX_SELECT_BYTES = 16  # 4 passes (8-bit digits of a 32-bit key) x 4 bytes read per element
ELEMENTWISE_FLOPS = {"gelu": 20, "norm": 8, "softmax": 10, "dropout": 20}
"""FP32 operations per element forward: the GELU's ``erf`` (a polynomial of about 20), a norm's
two reductions, scale and shift (about 8), a softmax's max, ``exp``, sum and division (about 10),
a dropout's random draw (Philox-4x32-10: about 60 integer operations for four draws) with its
compare and scale (about 20)."""


def _elementwise(fp32_peak: float) -> Dict:
    """Elements per second of the elementwise kinds, both dtypes (their arithmetic is fp32)."""
    rates = {k: {"forward": fp32_peak / f, "backward": fp32_peak / (2 * f)} for k, f in ELEMENTWISE_FLOPS.items()}
    return {"fp32": rates, "bf16": rates}


def _collectives(nvlink_busbw: float, nic: float, intra_alpha: float, inter_alpha: float) -> Dict:
    """Alpha-beta of each collective kind inside a node (NVSwitch: the all-reduce's and the
    gathers' bus bandwidth ``nvlink_busbw``) and across nodes (``nic``: one GPU's NIC; a group
    with several ranks in a node uses as many NICs, :func:`rmt.planner.hardware.collective_seconds`)."""
    intra = {
        kind: {"alpha_s": intra_alpha, "busbw": nvlink_busbw}
        for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
    }
    intra["p2p"] = {"alpha_s": intra_alpha / 2, "busbw": nvlink_busbw}
    inter = {
        kind: {"alpha_s": inter_alpha, "busbw": nic} for kind in ("all_reduce", "all_gather", "reduce_scatter", "p2p")
    }
    inter["all_to_all"] = {"alpha_s": inter_alpha, "busbw": 0.75 * nic}
    return {"intra": intra, "inter": inter}


_COMMON_SOURCES = {
    "gemm_tile": "cuBLAS/CUTLASS's usual output tile for large half-precision GEMMs on Ampere and Hopper (128 x 256)",
    "attention_efficiency": (
        "the FlashAttention-2 generation of fused attention kernels (tiled, without Hopper's warpgroup "
        "instructions; torch's memory-efficient kernel, which rmt's explicit causal mask selects, is of it) "
        "at its published utilization: on an A100 50-73% of the BF16 peak (Dao, FlashAttention-2, 2023), "
        "taken as 0.6 forward and 0.5 backward; on an H100 35% forward (Shah et al., FlashAttention-3, "
        "2024) and 291 of 989 TFLOP/s backward at sequence 2k, head dim 128 (its backward figure): 0.29. "
        "fp32 (SIMT FMAs, the same tiling) assumed at the same fractions of the FP32 peak"
    ),
    "op_overhead_s": (
        "PyTorch eager issue cost of one operation from Python (dispatch and cudaLaunchKernel): about "
        "5 us on current hosts (public measurements: 4.2 us per op)"
    ),
    "async_launch": "CUDA kernels are launched asynchronously: the host issues ahead of the device",
    "topk_rate": "derived: memory bandwidth / 16 bytes per element (radix select, 4 passes over fp32 keys)",
    "elementwise_rate": (
        "derived: the FP32 peak over each kind's operations per element (GELU 20, norm 8, softmax 10, "
        "dropout 20; twice backward); above the rate of the element's bytes, so these kernels are memory-bound"
    ),
    "collectives": (
        "nccl-tests bus bandwidth as NVIDIA's DGX systems reach it: about 80% of one direction of NVLink "
        "inside a node (ring all-reduce without NVLS), 92% of an InfiniBand NIC's line rate across nodes "
        "(all-to-all at 75% of it); alpha: NCCL's small-message latency, about 20 us in a node and 30 us "
        "across nodes (p2p half inside a node)"
    ),
    "gpus_per_node": "DGX/HGX nodes of 8 GPUs",
    "host_memory_bandwidth": (
        "assumed: one host thread stepping a rank's host tables at 20 GB/s (a DDR5 channel's worth; the "
        "host's sockets are shared by 8 GPUs)"
    ),
}

H100_SXM_80GB = {
    "name": "H100 SXM 80GB",
    "device": "gpu",
    "peak_flops": {"bf16": 989.4 * TERA, "fp32": 66.9 * TERA},
    "gemm_efficiency": {"bf16": [[6144, 17920, 2816, 0.801]], "fp32": [[4096, 4096, 4096, 0.754]]},
    "gemm_tile": [128, 256],
    "units": 132,
    "attention_efficiency": {
        "bf16": {"forward": 0.35, "backward": 0.29},
        "fp32": {"forward": 0.35, "backward": 0.29},
    },
    "memory_bandwidth": [[1e6, 0.906 * 3.35 * TERA]],
    "elementwise_rate": _elementwise(66.9 * TERA),
    "op_overhead_s": 5e-6,
    "async_launch": True,
    "lookup_bandwidth": {"forward": 33554432 / 25.8e-6, "backward": 33554432 / 44.3e-6},
    "topk_rate": 0.906 * 3.35 * TERA / RADIX_SELECT_BYTES,
    "collectives": _collectives(0.8 * 450 * GIGA, 0.92 * 50 * GIGA, 20e-6, 30e-6),
    "gpus_per_node": 8,
    "host_link": 50 * GIGA,
    "host_memory_bandwidth": 20 * GIGA,
    "sources": dict(
        _COMMON_SOURCES,
        name="NVIDIA H100 Tensor Core GPU datasheet (SXM5, 80 GB HBM3)",
        peak_flops="datasheet: BF16 989.4 TFLOP/s dense (1,979 with sparsity), FP32 66.9 TFLOP/s",
        gemm_efficiency=(
            "BF16: 792.1 of 989 TFLOP/s, the maximum achievable matmul FLOPS measured on an H100 SXM "
            "(S. Bekman, Machine Learning Engineering, mamf-finder, CUDA 12.1); FP32: 45.5 of 60.3 "
            "TFLOP/s measured for a 4096-cube SGEMM on an H100-class card (75.4%)"
        ),
        units="132 streaming multiprocessors (datasheet)",
        memory_bandwidth="3.35 TB/s HBM3 (datasheet), of which a large copy reaches 90.6% (public measurement)",
        lookup_bandwidth=(
            "measured here on an H100 (tools/bench_lookup_reduce.py, docs/benchmarks.md): 4096 x 32 lookups of "
            "64 fp32 values (33.5 MB of rows) in 25.8 us forward and 44.3 us backward"
        ),
        host_link="PCIe 5.0 x16: 63 GB/s per direction after coding, about 50 GB/s for pinned copies",
    ),
}

A100_SXM_80GB = {
    "name": "A100 SXM 80GB",
    "device": "gpu",
    "peak_flops": {"bf16": 312 * TERA, "fp32": 19.5 * TERA},
    "gemm_efficiency": {"bf16": [[6912, 16384, 2048, 0.859]], "fp32": [[6912, 16384, 2048, 0.859]]},
    "gemm_tile": [128, 256],
    "units": 108,
    "attention_efficiency": {
        "bf16": {"forward": 0.6, "backward": 0.5},
        "fp32": {"forward": 0.6, "backward": 0.5},
    },
    "memory_bandwidth": [[1e6, 0.906 * 2.039 * TERA]],
    "elementwise_rate": _elementwise(19.5 * TERA),
    "op_overhead_s": 5e-6,
    "async_launch": True,
    "lookup_bandwidth": {
        "forward": 33554432 / 25.8e-6 * 2.039 / 3.35,
        "backward": 33554432 / 44.3e-6 * 2.039 / 3.35,
    },
    "topk_rate": 0.906 * 2.039 * TERA / RADIX_SELECT_BYTES,
    "collectives": _collectives(0.8 * 300 * GIGA, 0.92 * 25 * GIGA, 20e-6, 30e-6),
    "gpus_per_node": 8,
    "host_link": 25 * GIGA,
    "host_memory_bandwidth": 20 * GIGA,
    "sources": dict(
        _COMMON_SOURCES,
        name="NVIDIA A100 Tensor Core GPU datasheet (SXM4, 80 GB HBM2e)",
        peak_flops="datasheet: BF16 312 TFLOP/s dense, FP32 19.5 TFLOP/s",
        gemm_efficiency=(
            "BF16: 267.9 of 312 TFLOP/s, the maximum achievable matmul FLOPS measured on an A100 SXM "
            "(S. Bekman, Machine Learning Engineering, mamf-finder, CUDA 12.1); FP32 assumed at the same fraction"
        ),
        units="108 streaming multiprocessors (datasheet)",
        memory_bandwidth="2,039 GB/s HBM2e (datasheet), at the H100's measured copy fraction (90.6%)",
        lookup_bandwidth="the H100's measured rates scaled by the HBM bandwidths (2.039 / 3.35)",
        host_link="PCIe 4.0 x16: 31.5 GB/s per direction after coding, about 25 GB/s for pinned copies",
    ),
}

PROFILES = {"h100": H100_SXM_80GB, "a100": A100_SXM_80GB}
"""Shipped profiles by the name ``--hardware`` takes."""
