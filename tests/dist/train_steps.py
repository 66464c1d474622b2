"""Train a few steps under the current launch (plain python or torchrun) and save, on global
rank 0, the loss history, the full (reassembled) parameters and gradients (``.grad``, which
the trainer points at megatron DDP's ``main_grad`` and which sharded or sparse-gradient memory
tables, outside DDP, fill directly; sparse ones are saved dense, with a host table's cached rows',
tables stepped in their backward as zeros), the value tables' optimizer states of every rank, the weight average (``train.ema_decay``) and every rank's running statistics.

    python -m torch.distributed.run --nproc_per_node=2 tests/dist/train_steps.py OUT.pt key=value... [-- OUT2.pt key=value...]

Runs separated by ``--`` train one after the other in the same processes (one launch's start-up
for all of them), each with megatron-core's groups built for its own layout. The tests'
single-process runs call :func:`record` in their own process instead (``conftest.train_runs``).
"""

import os
import sys
import warnings

import rmt

rmt.setup_process()  # as rmt's commands do (rmt.process), before torch is imported
import torch  # noqa: E402

from rmt.memory.descriptor import descriptor, is_table  # noqa: E402


def record(overrides):
    """Train the run ``overrides`` describe on this launch's processes; rank 0 gets the record
    (the others None). Megatron-core's groups are torn down again, whatever happens, unless they
    were there before (a single-process fixture of the calling test module: the run uses them);
    the default process group stays for the next run (``rmt.parallel.destroy`` ends it)."""
    from megatron.core import parallel_state

    from rmt import parallel
    from rmt.config import load_config
    from rmt.config_checks import validate
    from rmt.parallel.sharding import gather_full
    from rmt.training.trainer import Trainer

    config = validate(load_config(None, overrides))
    owned = not parallel_state.model_parallel_is_initialized()
    parallel.initialize(config)
    try:
        trainer = Trainer(config)
        history = trainer.train()
        grads = gather_full(trainer.chunks, step_gradients(trainer))
        params = gather_full(trainer.chunks)
        # the weight average (train.ema_decay), each parameter's own weights where none is kept
        averages = trainer.average.by_param() if trainer.average is not None else {}
        averaged = gather_full(trainer.chunks, lambda p: averages.get(p, p.data))
        # running statistics (query BatchNorm) of every rank, by global name
        stats = {n: b.clone() for c in trainer.chunks for n, b in c.module.named_buffers() if "running_" in n}
        every_rank = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(every_rank, stats)
        held = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(held, optimizer_held(trainer))
        host = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(host, host_tables(trainer))
        states = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(states, table_states(trainer))
        if torch.distributed.get_rank() != 0:
            return None
        return {
            "losses": [m["lm loss"] for m in history],
            "running_stats": every_rank,
            "optimizer_held": held,
            "host": host,
            "table_states": states,
            "grad_norms": [m["grad_norm"] for m in history],
            # the memory layers' scalars of each logged step (slot usage, cache hits)
            "memory_stats": [{k: v for k, v in m.items() if k.startswith("memory/")} for m in history],
            "val": [m.get("val_loss") for m in history],
            "grads": grads,
            "params": params,
            "averages": averaged,
        }
    finally:
        if owned:
            parallel_state.destroy_model_parallel()


def host_tables(trainer):
    """What each host-memory table of this rank moved and staged (memory.table_location: host),
    by global name: its link counters and its staged bytes now and at most; with a device cache
    (memory.host_cache_rows) also the cache's counters, the bytes its hits saved, the device bytes
    it holds and the rows it holds."""
    out = {}
    for c in trainer.chunks:
        for n, m in c.module.named_modules():
            storage = getattr(m, "storage", None)
            if storage is None or storage.location != "host":
                continue
            link = storage.link
            out[n] = {
                "forward": dict(link.forward),
                "backward": dict(link.backward),
                "other": {phase: dict(v) for phase, v in link.phases.items() if phase not in ("forward", "backward")},
                "staged_peak": storage.staged_peak,
                "staged_now": storage.staged_bytes,
            }
            cache = storage.cache
            if cache is not None:
                out[n]["cache"] = {
                    "counts": cache.pop_counts(),
                    "saved": {phase: dict(v) for phase, v in cache.saved.phases.items()},
                    "device_bytes": cache.device_bytes,
                    "rows": cache.rows.sorted_rows.tolist(),
                }
    return out


def table_states(trainer):
    """The value tables' optimizer state on this rank, by global name (host tables' after their
    caches were written back, as a checkpoint reads it)."""
    out = {}
    for c in trainer.chunks:
        names = {p: n for n, p in c.module.named_parameters()}
        for p, name in names.items():
            if is_table(p) and p in trainer.optimizer.state:
                state = trainer.optimizer.state[p]
                out[name] = {k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()}
    return out


def optimizer_held(trainer):
    """What this rank holds for megatron's optimizer: elements and bytes of each state kind
    (``exp_avg``, ``exp_avg_sq``, ``main_param``), and its DDP buffers' parameter elements before
    and after megatron's padding (non-expert parameters)."""
    from rmt.training.dense_state import dense_states

    buffers = [b for c in trainer.chunks for b in c.buffers]
    held = {
        "buffer_numel": sum(b.numel for b in buffers),
        "buffer_numel_unpadded": sum(b.numel_unpadded for b in buffers),
        "param_bytes": sum(p.numel() * p.element_size() for b in buffers for p in b.params),
        "grad_bytes": sum(b.grad_data.numel() * b.grad_data.element_size() for b in buffers),
    }
    for state in dense_states(trainer.optimizer.dense_optimizers).values():
        for name, t in state.tensors.items():
            held[name] = held.get(name, 0) + t.numel()
            held[name + "_bytes"] = held.get(name + "_bytes", 0) + t.numel() * t.element_size()
    return held


def step_gradients(trainer):
    """``param -> gradient`` of the last step as applied: a dense parameter's is that of the
    tensor megatron's optimizer steps (the parameter, or its fp32 main copy, or with the
    distributed optimizer this rank's range of it, the ranges summed over the data-parallel
    group); a table's is its ``.grad`` (sparse ones made dense; a table stepped in its
    backward, memory.fused_value_optimizer, has none: zeros)."""
    from megatron.core import parallel_state

    from rmt.training.dense_state import dense_states

    states = dense_states(trainer.optimizer.dense_optimizers)
    distributed = trainer.config.train.distributed_optimizer
    full = {}
    for chunk in trainer.chunks:
        for p in chunk.parameters():
            if is_table(p):
                full[p] = (
                    torch.zeros_like(p) if p.grad is None else p.grad.to_dense() if p.grad.is_sparse else p.grad
                ).float()
                cache = descriptor(p).storage.cache
                if cache is not None and cache.grad is not None:  # the cached rows' part, disjoint
                    full[p] += cache.grad.to_dense().to(full[p].device).float()
                continue
            grad = torch.zeros(p.numel(), dtype=torch.float32)
            if p in states:
                grad[states[p].flat_range or slice(None)] = states[p].main.grad.reshape(-1).float()
            if distributed:  # every rank of the group calls it, with or without a range
                group = (
                    parallel_state.get_data_parallel_group()
                    if getattr(p, "allreduce", True)
                    else parallel_state.get_expert_data_parallel_group()
                )
                torch.distributed.all_reduce(grad, group=group)
            full[p] = grad.view(p.shape)
    return lambda p: full[p]


def runs(argv):
    """``OUT.pt key=value... -- OUT2.pt key=value...`` as [(OUT.pt, [key=value, ...]), ...]."""
    out, run = [], []
    for arg in argv + ["--"]:
        if arg != "--":
            run.append(arg)
        elif run:
            out.append((run[0], run[1:]))
            run = []
    return out


def main():
    warnings.filterwarnings("ignore")
    from rmt import parallel

    todo = runs(sys.argv[1:])
    try:
        for i, (path, overrides) in enumerate(todo):
            if int(os.environ.get("RANK", "0")) == 0:  # which run a failure belongs to
                print(f"train_steps: run {i + 1} of {len(todo)}: {path}", file=sys.stderr, flush=True)
            result = record(overrides)
            if result is not None:
                torch.save(result, path)
    finally:
        parallel.destroy()


if __name__ == "__main__":
    main()
