"""The CPU lookup-reduce kernel keeps no state shared between calling threads: two threads'
backwards (a memory layer's on the async memory stream's thread beside the main thread's) run at
once and give the bits they give one after the other."""

import re
import threading
from pathlib import Path

import pytest
import torch

from rmt.ops import cpu_backend, lookup_reduce
from rmt.ops.fused_update import FusedValueUpdate
from rmt.ops.sparse_optim import RowWiseAdagrad

CSRC = Path(__file__).resolve().parents[1] / "csrc"
# the kernel's own files and the headers it shares with the other CPU kernels
KERNEL_FILES = sorted(CSRC.glob("lookup_reduce*_cpu.*")) + [
    CSRC / n for n in ("cpu_numerics.h", "cpu_prefetch.h", "row_optim.h")
]


def _code(path: Path) -> str:
    """The C++ source without its comments."""
    return re.sub(r"//[^\n]*|/\*.*?\*/", "", path.read_text(), flags=re.S)


def test_kernel_sources_hold_no_process_wide_mutable_state():
    """No mutex, and no static variable but constants: scratch is per call or thread_local."""
    assert len(KERNEL_FILES) >= 9 and all(p.exists() for p in KERNEL_FILES)
    for path in KERNEL_FILES:
        code = _code(path)
        assert "mutex" not in code, path.name
        assert re.findall(r"\bstatic\s+(?!const\b|constexpr\b|thread_local\b|inline\b)\w+", code) == [], path.name


def _steps(seed: int):
    """Forward, sparse and dense backward and a fused row-wise Adagrad step of one batch: 65536
    lookups of a 2^16-row table, enough for the sort's parallel passes."""
    gen = torch.Generator().manual_seed(seed)
    N, D, T, K, C, E = 1 << 16, 32, 2048, 32, 2, 2
    table = torch.randn(N, D, generator=gen)
    indices = torch.randint(0, N, (T, K), generator=gen)
    scores = torch.randn(T, K, C, generator=gen)
    blocks = torch.randint(0, E, (T, K), generator=gen)
    grad_out = torch.randn(T, E, D, generator=gen)
    out = []
    for sparse_grad in (True, False):
        t, s = table.clone().requires_grad_(True), scores.clone().requires_grad_(True)
        y = lookup_reduce(t, indices, s, blocks, E, backend="cpu", sparse_grad=sparse_grad)
        y.backward(grad_out)
        grad = t.grad.coalesce() if sparse_grad else t.grad
        out += [y.detach(), grad.to_dense() if sparse_grad else grad, s.grad]
    p = torch.nn.Parameter(table.clone())
    update = FusedValueUpdate(p, RowWiseAdagrad([p], lr=0.1, eps=1e-10))
    s = scores.clone().requires_grad_(True)
    lookup_reduce(p, indices, s, blocks, E, backend="cpu", update=update).backward(grad_out)
    out += [p.data, s.grad, torch.tensor(update.pop_sq_norm(), dtype=torch.float64)]
    return out


def test_concurrent_backwards_give_the_sequential_bits():
    if not cpu_backend.is_available(torch.device("cpu")):
        pytest.skip("the CPU extension did not build")
    seeds = (0, 1)
    want = [_steps(seed) for seed in seeds]
    got = [[] for _ in seeds]
    errors = []
    start = threading.Barrier(len(seeds))

    def work(i):
        try:
            start.wait()
            for _ in range(3):
                got[i].append(_steps(seeds[i]))
        except Exception as e:  # reported below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(seeds))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    for i in range(len(seeds)):
        assert len(got[i]) == 3
        for run in got[i]:
            assert all(torch.equal(a, b) for a, b in zip(run, want[i])), i
