"""The training step's host waits for the device (rmt.training.host_syncs), found on the CPU: the
memory layers make none; the step waits once, to read its losses and the gradient norm that
clipping compares."""

import os
import warnings

import pytest
import torch

from rmt import parallel
from rmt.config import load_config
from rmt.config_checks import validate
from rmt.training.host_syncs import HostSyncAudit

STEP = [
    "model.seq_length=64",
    "train.micro_batch_size=2",
    "train.global_batch_size=4",
    "train.steps=3",
    "train.warmup_steps=1",
    "train.eval_iters=0",
    "train.progress=false",
    "data.max_documents=64",
    "memory.async_stream=false",
]  # the stream's CPU worker thread is outside the (thread-local) audit


def test_audit_records_the_operations_that_wait_and_their_callers():
    x = torch.randn(6, 3)
    tolist = torch.Tensor.tolist
    with HostSyncAudit() as audit:
        float(x.sum())
        x[x > 0] = 0.0  # torch runs it as masked_fill_: no wait
        x[x < -5] = torch.full((int((x < -5).sum()),), 2.0)  # values of the mask's size: its nonzero waits
        x[x < 0]  # a result whose size the mask sets
        x.index_select(0, torch.tensor([0, 2]))
        torch.linalg.svd(torch.randn(3, 3))
        torch.sort(x, dim=0)
        assert x[0].tolist() == [0.0 if v > 0 else v for v in x[0].numpy()] and x.cpu() is x
    assert torch.Tensor.tolist is tolist  # the copies' methods are restored
    # callers are frames of rmt or megatron: none here
    assert audit.waits == {
        ("Tensor.cpu", ""): 1,
        ("Tensor.numpy", ""): 1,
        ("Tensor.tolist", ""): 1,
        ("_linalg_svd", ""): 1,
        ("_local_scalar_dense", ""): 2,
        ("index_put_", ""): 1,
        ("index", ""): 1,
    }
    from rmt.memory.retrieval import leading_singular_vectors

    with HostSyncAudit() as audit:
        leading_singular_vectors(torch.randn(2, 3, 3))  # rank 3: the SVD
    ((name, where),) = audit.waits
    assert name == "_linalg_svd" and where.startswith("rmt/memory/retrieval.py:")
    assert where.endswith(" leading_singular_vectors")
    with HostSyncAudit() as audit:
        leading_singular_vectors(torch.randn(2, 2, 2))  # rank 2: in closed form
    assert not audit.waits


def _trainer(memory, path="configs/ultramem_tiny.yaml"):
    from rmt.training.trainer import Trainer

    config = validate(load_config(path, STEP + memory), 1)
    assert config.memory.retrieval == "tucker" and config.memory.tucker_rank == 2
    parallel.initialize(config)
    return Trainer(config)


@pytest.mark.parametrize(
    "memory,path",
    [
        (["memory.value_optimizer=sparse_adam", "memory.fused_value_optimizer=true"], "configs/ultramem_tiny.yaml"),
        (["memory.value_optimizer=adamw"], "configs/ultramem_tiny.yaml"),
        (["memory.value_optimizer=sparse_adam", "memory.fused_value_optimizer=true"], "configs/ultramem_v2_tiny.yaml"),
    ],
    ids=["fused-sparse-adam", "adamw", "ultramem-v2-fused-sparse-adam"],
)
def test_memory_training_step_waits_once(memory, path):
    """One training step of the tiny UltraMem model (Tucker retrieval at rank 2, IVE, two
    micro-batches; and of the tiny UltraMemV2 model, its value and pre-value tables): no operation of the memory layers, the lookup kernels or the fused value step
    waits for the device. Before: the rank-1 selector's and the auxiliary loss's SVDs (a solver
    status read on the host, one wait each per layer), the fused step's squared norm read per
    table, each micro-batch's loss read apart, its causal mask read for document boundaries, and
    the losses and the gradient norm read one after the other. What waits: one read of the step's
    losses and gradient norm together, which clipping needs before the optimizer step."""
    try:
        trainer = _trainer(memory, path)
        trainer.train_step()
        with HostSyncAudit(depth=1) as audit:
            trainer.train_step()
    finally:
        parallel.destroy()
    waits = audit.device_waits()
    ((name, where),) = waits  # one kind of wait, from one place
    assert name == "Tensor.tolist" and where.startswith("rmt/training/trainer.py:"), waits
    assert where.endswith(" train_step") and waits[(name, where)] == 1, waits


def test_document_starts_reads_only_masks_that_may_hold_boundaries():
    """The trainer's causal mask (no ``data.reset_attention_mask``) is known to hold one document
    per row; a per-document mask is read (one wait on a GPU)."""
    from rmt.models.documents import causal_mask, document_starts

    mask = causal_mask(16, "cpu")
    with HostSyncAudit() as audit:
        assert document_starts(mask) is None
    assert not audit.waits
    blocks = mask.expand(2, 1, 16, 16).clone()
    blocks[1, :, 8:, :8] = True  # a second document from position 8 in row 1
    with HostSyncAudit() as audit:
        assert document_starts(blocks).tolist() == [[0] * 16, [0] * 8 + [8] * 8]
    assert [name for name, _ in audit.waits] == ["_local_scalar_dense", "Tensor.tolist"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
def test_on_a_gpu_torchs_detector_finds_no_wait_in_the_memory_layers():
    """torch's own detector (``torch.cuda.set_sync_debug_mode``, a warning at each synchronizing
    CUDA call, attributed to the Python line that made it) over a training step of the tiny
    UltraMem model with the fused value optimizer on the GPU: none from the memory layers or the
    lookup kernels; the read of the losses and gradient norm, from the trainer."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        trainer = _trainer(["memory.value_optimizer=sparse_adam", "memory.fused_value_optimizer=true"])
        trainer.train_step()
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                trainer.train_step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
    finally:
        parallel.destroy()
    files = [os.path.relpath(w.filename, root) for w in caught if "synchroniz" in str(w.message)]
    assert not [f for f in files if f.startswith(("rmt/memory/", "rmt/ops/"))], files
    assert "rmt/training/trainer.py" in files, files
