"""The training step's host waits for the device (rmt.training.host_syncs), found on the CPU: the
memory layers make none; the step waits for the gradient norm that clipping compares and for
the losses it reports."""

import pytest
import torch

from rmt import parallel
from rmt.config import load_config, validate
from rmt.training.host_syncs import HostSyncAudit

STEP = ["model.seq_length=64", "train.micro_batch_size=2", "train.global_batch_size=4", "train.steps=3",
        "train.warmup_steps=1", "train.eval_iters=0", "train.progress=false", "data.max_documents=64",
        "memory.async_stream=false"]  # the stream's CPU worker thread is outside the (thread-local) audit


def test_audit_records_the_operations_that_wait_and_their_callers():
    x = torch.randn(6, 3)
    tolist = torch.Tensor.tolist
    with HostSyncAudit() as audit:
        float(x.sum())
        x[x > 0] = 0.0
        x.index_select(0, torch.tensor([0, 2]))
        torch.linalg.svd(torch.randn(3, 3))
        torch.sort(x, dim=0)
        assert x[0].tolist() == [0.0 if v > 0 else v for v in x[0].numpy()] and x.cpu() is x
    assert torch.Tensor.tolist is tolist  # the copies' methods are restored
    # callers are frames of rmt or megatron: none here
    assert sorted(audit.waits) == [("Tensor.cpu", ""), ("Tensor.numpy", ""), ("Tensor.tolist", ""), ("_linalg_svd", ""),
                                   ("_local_scalar_dense", ""), ("index_put_", "")]
    from rmt.memory.retrieval import leading_singular_vectors

    with HostSyncAudit() as audit:
        leading_singular_vectors(torch.randn(2, 3, 3))  # rank 3: the SVD
    (name, where), = audit.waits
    assert name == "_linalg_svd" and where.startswith("rmt/memory/retrieval.py:")
    assert where.endswith(" leading_singular_vectors")
    with HostSyncAudit() as audit:
        leading_singular_vectors(torch.randn(2, 2, 2))  # rank 2: in closed form
    assert not audit.waits


@pytest.mark.parametrize("memory", [
    ["memory.value_optimizer=sparse_adam", "memory.fused_value_optimizer=true"],
    ["memory.value_optimizer=adamw"],
], ids=["fused-sparse-adam", "adamw"])
def test_memory_training_step_waits_only_for_the_gradient_norm(memory):
    """One training step of the tiny UltraMem model (Tucker retrieval at rank 2, IVE, two
    micro-batches): no operation of the memory layers, the lookup kernels or the fused value step
    waits for the device. Before: the rank-1 selector's and the auxiliary loss's SVDs (a solver
    status read on the host, one wait each per layer), the fused step's squared norm read per
    table and each micro-batch's loss read apart. What waits: megatron's vocabulary-parallel
    cross entropy (a boolean-mask index), the forward's check for document boundaries, and the
    gradient norm and, at the end, the step's losses, once each."""
    from rmt.training.trainer import Trainer

    config = validate(load_config("configs/ultramem_tiny.yaml", STEP + memory), 1)
    assert config.memory.retrieval == "tucker" and config.memory.tucker_rank == 2
    parallel.initialize(config)
    try:
        trainer = Trainer(config)
        trainer.train_step()
        with HostSyncAudit(depth=1) as audit:
            trainer.train_step()
    finally:
        parallel.destroy()
    waits = {where: n for (_, where), n in audit.device_waits().items()}
    assert len(audit.waits) > len(waits)  # data loading's, left out
    assert not [w for w in waits if w.startswith(("rmt/memory/", "rmt/ops/"))], waits
    functions = {where.split(" ")[-1] for where in waits}
    assert functions <= {"clip_gradients", "_reduce_losses", "document_starts", "calculate_predicted_logits"}, waits
    assert [n for where, n in waits.items() if where.endswith((" clip_gradients", " _reduce_losses"))] == [1, 1]
