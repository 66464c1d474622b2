"""Sharded MemoryTable == local table, forward and backward, and bytes sent == the planner.

    python -m torch.distributed.run --nproc_per_node=P tests/dist/memory_parallel_table.py

Every rank draws the same full table and every rank's inputs (tokens, IVE blocks, multi-core
scores, output gradients), computes the single-table reference for all of them, then runs
its own tokens through each sharded partition and compares its output, its score gradients,
the reassembled table gradient and the fraction of slots hit (counted per shard at the owners,
reduced as a scalar). Balanced inputs (each rank's lookups spread evenly over
the row owners, equal token counts) must send exactly ``comm_volume``'s bytes (plain number-wise
requests each distinct row once: ``dedup=True`` with the measured unique fraction); ragged
token counts must still be exact numerically.
"""

from fractions import Fraction

import rmt

rmt.setup_process()  # as rmt's commands do (rmt.process), before torch is imported
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from rmt.memory.table import MemoryTable  # noqa: E402
from rmt.memory.comm_volume import comm_volume  # noqa: E402

N, D, K, C, E = 64, 16, 6, 2, 4


def inputs(P, counts, balanced, gen):
    per_rank = []
    for T in counts:
        if balanced:
            # lookup j goes to owner j % P; each owner serves the same number of distinct rows
            # (N / 2P of its N / P, repeated), so the deduplicated requests are balanced too
            j = torch.arange(T * K).view(T, K)
            rows = torch.randperm(N // P, generator=gen)[:N // (2 * P)]
            idx = (j % P) * (N // P) + rows[(j // P) % rows.numel()]
        else:
            idx = torch.randint(0, N, (T, K), generator=gen)
        per_rank.append((idx, torch.randn(T, K, C, generator=gen, dtype=torch.float64).float(),
                         torch.randint(0, E, (T, K), generator=gen), torch.randn(T, E, D, generator=gen)))
    return per_rank


def check(partition, owner_reduce, counts, balanced, split=False, dtype=torch.float32, score_dtype=torch.float32):
    """One sharded table against the local one. ``counts``: tokens of each data-parallel
    requester. ``split``: tensor-parallel pairs of consecutive ranks hold the same tokens (one
    requester per pair); each looks up its chunk and the pooled chunks are all-gathered.
    ``dtype``: the tables' (scores and outputs stay fp32, so a bf16 table sends 2-byte rows and
    4-byte scores and pooled slices; its row gradients are rounded to bf16 at different points
    of the two routes, so only the fp32 tables' are compared). ``score_dtype`` bf16: the scores
    as autocast's retrieval makes them, widened by the table to fp32 before any route (so 4-byte
    scores on the wire); their gradients come back rounded to bf16, where the two routes' fp32
    score gradients (equal to ~1e-6) can round to neighbouring values: one bf16 step, 2^-7
    relative, apart."""
    P, rank = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(1234 + sum(counts) + split)
    full = torch.randn(N, D, generator=gen).to(dtype)
    data = inputs(P, counts, balanced, gen)
    ref = MemoryTable(N, D, 0.02, dtype=dtype)
    ref.weight.data.copy_(full)
    ref_scores = [s.to(score_dtype, copy=True).requires_grad_() for _, s, _, _ in data]
    ref_out = [ref.lookup_reduce(i, s, b, E) for (i, _, b, _), s in zip(data, ref_scores)]
    sum((o * g).sum() for o, (_, _, _, g) in zip(ref_out, data)).backward()

    pairs = [dist.new_group([r, r + 1]) for r in range(0, P, 2)] if split else None
    me = rank // 2 if split else rank
    table = MemoryTable(N, D, 0.02, partition, dist.group.WORLD, owner_reduce=owner_reduce,
                        split_group=pairs[me] if split else None, dtype=dtype)
    table.weight.data.copy_(full[table.shard_index])
    table.train()  # training mode: lookups count slot hits at the rows' owners
    idx, scores, blocks, grad_out = data[me]
    scores = scores.to(score_dtype, copy=True).requires_grad_()
    out = table.lookup_reduce(idx, scores, blocks, E)
    (out * grad_out).sum().backward()
    grad = torch.zeros(N, D, dtype=dtype)
    grad[table.shard_index] = table.weight.grad
    dist.all_reduce(grad)
    bf16 = " bf16" if dtype == torch.bfloat16 else ""
    bf16 += " bf16-scores" if score_dtype == torch.bfloat16 else ""
    name = f"{partition}{'+owner_reduce' if owner_reduce else ''}{bf16} P={P} counts={counts} split={split}"
    assert out.dtype == torch.float32 and scores.grad.dtype == score_dtype, name
    torch.testing.assert_close(out, ref_out[me], rtol=1e-5, atol=1e-5, msg=f"{name}: output")
    score_tol = 2.0 ** -7 if score_dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(scores.grad, ref_scores[me].grad, rtol=score_tol, atol=1e-5,
                               msg=f"{name}: score grads")
    if dtype == torch.float32:  # a bf16 table's row gradients round at different points
        torch.testing.assert_close(grad, ref.weight.grad, rtol=1e-5, atol=1e-5, msg=f"{name}: table grads")
    # the reference ran every requester's lookups: its hits are the union the owners counted
    assert table.pop_hit_fraction() == ref.pop_hit_fraction(), name
    assert table.hits.sum() == 0, name  # reset
    if balanced:
        T = counts[me]
        looked_up = (idx[T // 2:] if rank % 2 else idx[:T // 2]) if split else idx
        dedup = partition == "number" and not owner_reduce
        unique = Fraction(looked_up.unique().numel(), looked_up.numel()) if dedup else None
        plan = comm_volume(partition, T, K, D, P, owner_reduce=owner_reduce, ive=E, cores=C, index_bytes=4,
                           value_bytes=full.element_size(), activation_bytes=4, dedup=dedup,
                           unique_fraction=unique, tensor_parallel=2 if split else 1)
        assert dict(table.counter.forward) == plan["forward"], (name, dict(table.counter.forward), plan)
        assert dict(table.counter.backward) == plan["backward"], (name, dict(table.counter.backward), plan)
    if rank == 0:
        print("OK", name, dict(table.counter.forward), dict(table.counter.backward), flush=True)


def main():
    dist.init_process_group("gloo")
    P = dist.get_world_size()
    for partition, owner_reduce in (("number", False), ("number", True), ("dimension", False)):
        check(partition, owner_reduce, [8] * P, balanced=True)
        check(partition, owner_reduce, [3 + 2 * r for r in range(P)], balanced=False)
        check(partition, owner_reduce, [8] * (P // 2), balanced=True, split=True)
        check(partition, owner_reduce, [8] * P, balanced=True, dtype=torch.bfloat16)
        check(partition, owner_reduce, [8] * P, balanced=True, score_dtype=torch.bfloat16)
    try:
        MemoryTable(N + 1, D, 0.02, "number", dist.group.WORLD)
    except ValueError as err:
        assert "num_slots (65) must be divisible by the memory-parallel group size" in str(err), err
    else:
        raise AssertionError("number-wise table with slots not divisible by the group size accepted")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
