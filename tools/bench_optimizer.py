"""AdamW step time on the CPU: torch's AdamW as rmt builds it (``foreach``), torch's fused CPU
kernel, and DeepSpeed's ``DeepSpeedCPUAdam`` (its AVX C++ Adam, the optimizer of ZeRO-Offload),
side by side on the parameters of one rmt model, same gradients, same hyperparameters.

Each optimizer steps the same parameters from the same start; after the timed steps their
parameters must agree (checked: the three compute the same AdamW update), so the table compares
speed only. DeepSpeed's op is built with rmt's extensions (``launch/setup_env.sh``), else on its
first use (minutes).

    python tools/bench_optimizer.py [--quick] [--config configs/transformer_49m.yaml] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import rmt

rmt.setup_process()  # rmt's process settings (rmt.process), before torch is imported
import torch  # noqa: E402

from rmt.bench_report import check_report, write_report  # noqa: E402


def model_shapes(config_path: str, overrides):
    """Parameter shapes of the rmt model of ``config_path`` (built on one process)."""
    from rmt import parallel
    from rmt.config import load_config
    from rmt.config_checks import validate
    from rmt.models.build import build

    cfg = validate(load_config(config_path, overrides), world_size=1)
    parallel.initialize(cfg)
    shapes = [tuple(p.shape) for chunk in build(cfg) for p in chunk.parameters()]
    parallel.destroy()
    return shapes


def optimizers():
    """name -> factory(params) with rmt's AdamW hyperparameters (lr 3e-3, betas 0.9/0.95, wd 0.1)."""
    kw = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)

    def deepspeed(params):
        from rmt.ops.extensions import load_deepspeed_op
        from rmt.parallel import compat

        load_deepspeed_op("cpu_adam", compat.device().type)  # built by launch/setup_env.sh, else now
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(params, adamw_mode=True, **kw)

    return {
        "torch_foreach": lambda p: torch.optim.AdamW(p, foreach=True, **kw),
        "torch_fused": lambda p: torch.optim.AdamW(p, fused=True, **kw),
        "deepspeed_cpu_adam": deepspeed,
    }


def run(shapes, steps: int, threads: int):
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(s, generator=gen) * 0.02 for s in shapes]
    grads = [[torch.randn(s, generator=gen) * 1e-3 for s in shapes] for _ in range(2)]
    times, final = {}, {}
    for name, make in optimizers().items():
        params = [torch.nn.Parameter(t.clone()) for t in start]
        opt = make(params)
        for p, g in zip(params, grads[0]):
            p.grad = g.clone()
        opt.step()  # warm-up (and DeepSpeed's compile)
        spent = []
        for i in range(steps):
            for p, g in zip(params, grads[i % 2]):
                p.grad.copy_(g)
            t0 = time.perf_counter()
            opt.step()
            spent.append(time.perf_counter() - t0)
        times[name] = statistics.median(spent)
        final[name] = params
    worst = max(
        float((a - b).detach().abs().max()) for name in final for a, b in zip(final[name], final["torch_foreach"])
    )
    return times, worst


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a tiny model and 3 steps (the code path of the full run)")
    ap.add_argument("--config", default="configs/transformer_49m.yaml", help="model whose parameters are stepped")
    ap.add_argument("--steps", type=int, help="timed steps (default 10, quick 3)")
    ap.add_argument("--threads", default="1,2", help="comma-separated torch thread counts (default 1,2)")
    ap.add_argument("--json", help="write {benchmark, machine, rows, summary} here")
    args = ap.parse_args(argv)
    check_report(args.json, "bench_optimizer")
    overrides = ["model.vocab_size=50304"]
    if args.quick:
        overrides = [
            "model.vocab_size=512",
            "model.num_layers=2",
            "model.hidden_size=64",
            "model.num_attention_heads=4",
        ]
    shapes = model_shapes(args.config, overrides)
    count = sum(torch.Size(s).numel() for s in shapes)
    steps = args.steps or (3 if args.quick else 10)
    rows = []
    print(f"{count:,} parameters in {len(shapes)} tensors ({args.config}), median of {steps} steps")
    print(f"{'threads':>7} {'torch foreach ms':>17} {'torch fused ms':>15} {'DeepSpeed CPU Adam ms':>22}")
    for threads in (int(t) for t in args.threads.split(",")):
        times, worst = run(shapes, steps, threads)
        row = {
            "threads": threads,
            "params": count,
            "max_param_difference": worst,
            **{f"{k}_ms": v * 1e3 for k, v in times.items()},
        }
        rows.append(row)
        print(
            f"{threads:>7} {row['torch_foreach_ms']:>17.1f} {row['torch_fused_ms']:>15.1f} "
            f"{row['deepspeed_cpu_adam_ms']:>22.1f}",
            flush=True,
        )
    summary = {
        "deepspeed_over_torch_foreach": statistics.median(
            r["deepspeed_cpu_adam_ms"] / r["torch_foreach_ms"] for r in rows
        ),
        "torch_fused_over_torch_foreach": statistics.median(r["torch_fused_ms"] / r["torch_foreach_ms"] for r in rows),
        "max_param_difference": max(r["max_param_difference"] for r in rows),
    }
    print(json.dumps(summary))
    write_report(
        args.json,
        "bench_optimizer",
        rows,
        summary,
        config={"model": args.config, "steps": steps, "quick": args.quick},
    )


if __name__ == "__main__":
    main()
