"""Host memory of ``rmt-export`` with a large memory table: streamed (the table goes from its
checkpoint blocks to the weights file in chunks of ``--chunk-mib``) beside the plain path (the table loaded
whole, as rmt-generate loads it), at two table sizes: the growth of the peak resident set
between them is what the table costs the export.

    python tools/bench_export.py --table-gib 2 --json bench_export.json
    python tools/bench_export.py --quick

A PKM transformer (hidden 256) with a table of ``--table-gib`` / 8 and ``--table-gib`` GiB is saved
(no optimizer state); each export then runs in a fresh process that reports its peak resident
set (``ru_maxrss``) and wall time. The exported table is checked against the saved one.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from rmt.bench_report import check_report, write_report  # noqa: E402

HIDDEN = 256


def overrides(keys: int):
    return [
        "model.arch=transformer",
        "model.num_layers=2",
        f"model.hidden_size={HIDDEN}",
        "model.num_attention_heads=4",
        "model.seq_length=64",
        "model.vocab_size=257",
        "memory.type=pkm",
        "memory.placement='1:2'",
        f"memory.num_keys={keys}",
        "memory.num_heads=2",
        "memory.topk=8",
        "memory.key_dim=32",
    ]


def save(ckpt: str, keys: int) -> None:
    """A checkpoint of the PKM model, weights only (as a trained one's, without Adam state)."""
    from rmt import parallel
    from rmt.config import load_config, to_dict
    from rmt.config_checks import validate
    from rmt.models.build import build
    from rmt.training.checkpoint import save_checkpoint

    config = validate(load_config(None, overrides(keys)), 1)
    parallel.initialize(config)
    try:
        save_checkpoint(
            ckpt, 0, build(config), None, {"config": to_dict(config), "iteration": 0, "consumed_samples": 0}
        )
    finally:
        parallel.destroy()


def child(mode: str, ckpt: str, out: str) -> None:
    """One step in this process: the checkpoint (``save``), or a measurement that prints
    {"peak_rss_bytes", "seconds"} as JSON."""
    import resource

    if mode == "save":
        save(ckpt, int(out))
        return
    start = time.perf_counter()
    from rmt.export.cli import export

    mode, chunk_mib = mode.split(":")
    export(ckpt, out, fmt="remote", stream_tables=mode == "streamed", chunk_bytes=int(chunk_mib) << 20)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    print(json.dumps({"peak_rss_bytes": peak, "seconds": time.perf_counter() - start}))


def run_child(mode: str, a: str, b: str) -> str:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), PYTHONWARNINGS="ignore")
    proc = subprocess.run(
        [sys.executable, __file__, "--child", mode, a, b], env=env, cwd=ROOT, capture_output=True, text=True
    )
    if proc.returncode:
        raise SystemExit(f"bench_export: the {mode} step failed:\n{proc.stderr[-3000:]}")
    return proc.stdout


def measure(mode: str, ckpt: str, out: str) -> dict:
    return json.loads(run_child(mode, ckpt, out).strip().splitlines()[-1])


def check(out: str, ckpt: str) -> None:
    """The exported table equals the saved one (first and last rows)."""
    import torch
    from safetensors import safe_open

    from rmt.training.checkpoint import find_checkpoint
    from rmt.training.table_checkpoint import saved_blocks

    block = saved_blocks(find_checkpoint(ckpt), "memory.0.values.weight", "weight")[0]
    rows, cols = block["rows"], block["cols"]
    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        table = f.get_slice("model.memory.0.values.weight")
        first, last = table[:4], table[rows - 4 : rows]
    raw = torch.from_file(block["path"], size=rows * cols, dtype=torch.float32).view(rows, cols)
    assert torch.equal(first, raw[:4]) and torch.equal(last, raw[-4:]), "exported table differs from the saved one"


def keys_for(gib: float) -> int:
    return max(2, int(math.sqrt(gib * 2**30 / (HIDDEN * 4))))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--table-gib", type=float, default=2.0, help="the larger memory table in GiB (default 2)")
    ap.add_argument("--chunk-mib", type=int, default=64, help="streaming chunk in MiB (default 64, rmt-export's)")
    ap.add_argument("--quick", action="store_true", help="tables of 2 and 16 MiB, 1 MiB chunks: seconds")
    ap.add_argument("--json", metavar="FILE", help="write {benchmark, machine, rows, summary}")
    ap.add_argument("--child", nargs=3, metavar=("MODE", "CKPT", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(*args.child)
        return 0
    check_report(args.json, "bench_export")
    big, chunk = (1 / 64, 1) if args.quick else (args.table_gib, args.chunk_mib)
    rows = []
    for gib in (big / 8, big):  # the growth of the peak with the table is the export's cost of it
        keys = keys_for(gib)
        with tempfile.TemporaryDirectory() as tmp:
            ckpt = os.path.join(tmp, "ckpt")
            run_child("save", ckpt, str(keys))
            for mode in ("streamed", "whole"):
                out = os.path.join(tmp, f"hf_{mode}")
                result = measure(f"{mode}:{chunk}", ckpt, out)
                check(out, ckpt)
                rows.append(
                    {"mode": mode, "table_bytes": keys * keys * HIDDEN * 4, "chunk_bytes": chunk << 20, **result}
                )
    print(f"{'export':<10}{'table GiB':>11}{'peak RSS GiB':>14}{'seconds':>10}")
    for r in rows:
        print(
            f"{r['mode']:<10}{r['table_bytes'] / 2**30:>11.3f}{r['peak_rss_bytes'] / 2**30:>14.2f}{r['seconds']:>10.1f}"
        )
    growth = {}
    for mode in ("streamed", "whole"):
        small, large = [r for r in rows if r["mode"] == mode]
        growth[mode] = (large["peak_rss_bytes"] - small["peak_rss_bytes"]) / (
            large["table_bytes"] - small["table_bytes"]
        )
    print(f"peak RSS growth per table byte: streamed {growth['streamed']:.3f}, whole {growth['whole']:.3f}")
    summary = {
        "table_gib": rows[-1]["table_bytes"] / 2**30,
        "streamed_rss_per_table_byte": growth["streamed"],
        "whole_rss_per_table_byte": growth["whole"],
    }
    write_report(args.json, "bench_export", rows, summary)
    return 0


if __name__ == "__main__":
    from rmt import setup_process

    setup_process()
    sys.exit(main())
