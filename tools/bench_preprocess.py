"""rmt-preprocess throughput (tokens/s, whole command: reading, tokenizing, writing, merging)
per number of workers, for the byte and the BPE tokenizer, beside the single-process baseline
(rmt-preprocess before ``--workers``: HF ``datasets.load_dataset`` into its Arrow cache, HF
tokenizers' batch encoding on its own threads, megatron-core's ``IndexedDatasetBuilder``).

The input is jsonl made of the default corpus (the standard library's modules, cut into
documents of 2,400 characters, as many as ``--mib`` / ``--byte-mib`` ask for: the byte
tokenizer is ~30x faster, so it gets more input, for seconds of work). Every worker count must write
the same bytes (checked). Each figure is the best of ``--repeat`` runs: the machine may be
shared, and the best run is the one least disturbed. Beside wall-clock tokens/s, tokens per
CPU-second (the process and its workers): on a loaded machine the wall-clock figures measure
the scheduler's shares, while a per-CPU-second figure that stays flat from 1 to N workers says
the work does not grow with the workers, so it scales with idle cores.

    python tools/bench_preprocess.py [--quick] [--mib 47] [--byte-mib 256] [--workers 1,2] [--repeat 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from rmt import setup_process  # noqa: E402

setup_process()  # rmt's process settings (rmt.process), before torch is imported

from rmt.bench_report import check_report, machine, write_report  # noqa: E402
from rmt.data.preprocess import preprocess, usable_cores  # noqa: E402
from rmt.data.tokenizers import HFTokenizer, build_tokenizer  # noqa: E402


def make_corpus(path: str, mib: float, doc_chars: int = 2400) -> int:
    """jsonl of default-corpus documents of ``doc_chars`` characters, ``mib`` MiB; its documents."""
    from rmt.data.corpus import corpus_documents

    pieces = [t[i : i + doc_chars] for t in corpus_documents() for i in range(0, len(t), doc_chars)]
    size, n = 0, 0
    with open(path, "w") as f:
        while size < mib * (1 << 20):
            line = json.dumps({"text": pieces[n % len(pieces)]}) + "\n"
            f.write(line)
            size += len(line.encode())
            n += 1
    return n


def baseline(src: str, prefix: str, tokenizer) -> int:
    """rmt-preprocess as it was: one process, HF datasets and HF tokenizers' own threads."""
    import datasets
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from rmt.data.shards import token_dtype

    datasets.disable_progress_bars()
    ds = datasets.load_dataset(
        "json", data_files=[src], split="train", cache_dir=tempfile.mkdtemp(dir=os.path.dirname(prefix))
    )
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=token_dtype(tokenizer.vocab_size).type)
    tokens = 0
    # as it was: HF tokenizers batch-encoded, the byte tokenizer went text by text
    encode = (
        tokenizer.tokenize_batch
        if isinstance(tokenizer, HFTokenizer)
        else (lambda texts: [tokenizer.tokenize(t) for t in texts])
    )
    for batch in ds.iter(batch_size=1024):
        for ids in encode([t for t in batch["text"] if t]):
            ids = list(ids) + [tokenizer.eod]
            builder.add_item(torch.tensor(ids, dtype=torch.int64))
            builder.end_document()
            tokens += len(ids)
    builder.finalize(prefix + ".idx")
    return tokens


def _cpu_seconds() -> float:
    """CPU time of this process and of its finished children (rmt-preprocess's workers)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def best_seconds(fn, repeat: int):
    """``(wall seconds, CPU seconds, result)`` of the fastest of ``repeat`` calls."""
    best, result = None, None
    for _ in range(repeat):
        start, cpu = time.perf_counter(), _cpu_seconds()
        result = fn()
        run = (time.perf_counter() - start, _cpu_seconds() - cpu)
        best = run if best is None or run[0] < best[0] else best
    return best[0], best[1], result


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2 MiB of input, one run each (the code path of the full run)")
    ap.add_argument("--mib", type=float, help="input size for the BPE, MiB (default 47, quick 2)")
    ap.add_argument(
        "--byte-mib",
        type=float,
        help="input size for the byte tokenizer, MiB (default 256, quick 2: it is ~30x faster)",
    )
    ap.add_argument("--workers", help=f"comma-separated worker counts (default 1..{usable_cores()}, the usable cores)")
    ap.add_argument("--tokenizers", default="byte,bpe", help="comma-separated: byte, bpe (default both)")
    ap.add_argument("--repeat", type=int, help="runs per figure, the best kept (default 3, quick 1)")
    ap.add_argument("--baseline-repeat", type=int, default=1, help="runs of the (slow) baseline (default 1)")
    ap.add_argument("--cache-dir", default=os.path.join(ROOT, ".rmt_cache"), help="where the BPE is trained once")
    ap.add_argument("--json", help="write {benchmark, machine, rows, summary} here")
    args = ap.parse_args(argv)
    check_report(args.json, "bench_preprocess")
    mib = {"bpe": args.mib or (2.0 if args.quick else 47.0), "byte": args.byte_mib or (2.0 if args.quick else 256.0)}
    repeat = args.repeat or (1 if args.quick else 3)
    counts = [int(w) for w in args.workers.split(",")] if args.workers else list(range(1, usable_cores() + 1))
    work = tempfile.mkdtemp(prefix="bench_preprocess_")
    load = os.getloadavg()[0]
    print(f"{usable_cores()} usable cores, load average {load:.2f} at the start; best of {repeat}")
    print(
        f"{'tokenizer':>9} {'input MiB':>10} {'workers':>8} {'tokens':>11} {'seconds':>8} {'M tokens/s':>11} "
        f"{'vs 1 worker':>12} {'M tokens/CPU s':>14}"
    )
    rows, outputs, docs = [], {}, {}
    for name in args.tokenizers.split(","):
        tok = build_tokenizer(name, args.cache_dir)
        src = os.path.join(work, f"corpus_{name}.jsonl")
        docs[name] = make_corpus(src, mib[name])
        size = f"{os.path.getsize(src) / (1 << 20):.1f}"
        seconds, cpu, tokens = best_seconds(
            lambda: baseline(src, os.path.join(work, f"base_{name}"), tok), args.baseline_repeat
        )
        rows.append(
            {
                "tokenizer": name,
                "workers": "baseline",
                "tokens": tokens,
                "seconds": seconds,
                "tokens_per_s": tokens / seconds,
                "cpu_seconds": cpu,
                "tokens_per_cpu_s": tokens / cpu,
            }
        )
        print(
            f"{name:>9} {size:>10} {'baseline':>8} {tokens:>11} {seconds:>8.2f} {tokens / seconds / 1e6:>11.2f} "
            f"{'':>12} {tokens / cpu / 1e6:>13.2f}",
            flush=True,
        )
        one = None
        for w in counts:
            prefix = os.path.join(work, f"{name}_{w}", "ds")
            seconds, cpu, written = best_seconds(
                lambda: preprocess([src], prefix, tok.spec, cache_dir=args.cache_dir, workers=w, progress=False), repeat
            )
            tokens = written[0][1]["num_tokens"]
            with open(prefix + ".bin", "rb") as a, open(prefix + ".idx", "rb") as b:
                outputs.setdefault(name, set()).add((hash(a.read()), hash(b.read())))
            one = one or tokens / seconds
            rows.append(
                {
                    "tokenizer": name,
                    "workers": w,
                    "tokens": tokens,
                    "seconds": seconds,
                    "tokens_per_s": tokens / seconds,
                    "speedup": tokens / seconds / one,
                    "cpu_seconds": cpu,
                    "tokens_per_cpu_s": tokens / cpu,
                }
            )
            print(
                f"{name:>9} {size:>10} {w:>8} {tokens:>11} {seconds:>8.2f} {tokens / seconds / 1e6:>11.2f} "
                f"{tokens / seconds / one:>11.2f}x {tokens / cpu / 1e6:>13.2f}",
                flush=True,
            )
        if len({r["tokens"] for r in rows if r["tokenizer"] == name}) != 1:
            raise SystemExit(f"{name}: the baseline and rmt-preprocess wrote different numbers of tokens")
    if any(len(v) != 1 for v in outputs.values()):
        raise SystemExit("different worker counts wrote different bytes")
    by = {(r["tokenizer"], r["workers"]): r for r in rows}
    summary = {}
    for name in args.tokenizers.split(","):
        if (name, 1) in by and (name, 2) in by:
            summary[f"{name}_speedup_1_to_2"] = by[(name, 2)]["tokens_per_s"] / by[(name, 1)]["tokens_per_s"]
        if (name, 1) in by:
            summary[f"{name}_1_worker_over_baseline"] = (
                by[(name, 1)]["tokens_per_s"] / by[(name, "baseline")]["tokens_per_s"]
            )
    if ("bpe", 1) in by:
        summary["bpe_1_worker_tokens_per_s"] = by[("bpe", 1)]["tokens_per_s"]
    print(json.dumps(summary))
    write_report(
        args.json,
        "bench_preprocess",
        rows,
        summary,
        machine(usable_cores=usable_cores(), load_average_at_start=load),
        config={"mib": mib, "documents": docs, "repeat": repeat, "quick": args.quick},
    )
    import shutil

    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
