"""``rmt-preprocess``: jsonl / txt / parquet files and saved HF datasets -> megatron-core indexed
datasets (``PREFIX.bin/.idx`` plus ``PREFIX.json``), on every core, in bounded memory.

The inputs are cut into chunks (:mod:`rmt.data.sources`: independent of the number of
workers); ``--workers`` processes each tokenize one chunk at a time into a shard of their own
in megatron-core's indexed format (:func:`rmt.data.shards.write_indexed`), and the shards are
merged in input order (:func:`rmt.data.shards.merge_indexed`): the output
is the same, byte for byte, whatever the number of workers. Shards live in
``PREFIX.partial/`` until the merge; an interrupted run keeps the finished ones, and the same
command run again does only the rest. (Megatron-LM's ``tools/preprocess_data.py`` splits and
merges its inputs the same way.)

Neither torch nor megatron-core is imported (HF ``datasets`` only for saved datasets), so the
command starts at once."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import queue
import shutil
import signal
import sys
import time
import traceback
from typing import List, Optional, Tuple

from rmt.data.blend import BLEND_SUFFIX, format_blend
from rmt.data.sources import Chunk, Source, check_source, chunk_texts, plan_chunks, resolve_inputs
from rmt.data.tokenizers import build_tokenizer
from rmt.errors import JobError, UserError, cli_entry
from rmt.outputs import check_output
from rmt.process import setup_process

_PLAN_VERSION = 1


class Interrupted(Exception):
    """The run was stopped (Ctrl-C, SIGTERM); the message says what is done and what is left."""


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, as a job scheduler sets it)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def preprocess(
    inputs: List[str],
    output_prefix: str,
    tokenizer_spec: str = "byte",
    text_key: str = "text",
    cache_dir: str = ".rmt_cache",
    bpe_vocab_size: int = 2048,
    workers: Optional[int] = None,
    per_input: bool = False,
    chunk_mib: Optional[float] = None,
    progress: bool = True,
) -> List[Tuple[str, dict]]:
    """Tokenize ``inputs`` (files, globs, saved-dataset directories) into ``output_prefix`` (one
    merged dataset), or with ``per_input`` into ``output_prefix_NAME`` per input plus the blend
    ``output_prefix.blend``. Returns ``[(prefix, metadata)]`` of the datasets written."""
    sources = resolve_inputs(inputs)
    for source in sources:
        check_source(source, text_key)
    outputs = _output_prefixes(sources, output_prefix, per_input)
    check_output(output_prefix, "--output-prefix", _bytes_written(sources, tokenizer_spec))
    tokenizer = build_tokenizer(tokenizer_spec, cache_dir, bpe_vocab_size)
    workers = workers or usable_cores()
    work = output_prefix + ".partial"
    identity = {
        "version": _PLAN_VERSION,
        "inputs": [_fingerprint(s) for s in sources],
        "text_key": text_key,
        "tokenizer": tokenizer.spec,
        "tokenizer_sha256": _file_sha256(tokenizer.spec),
        "per_input": per_input,
    }
    chunks = _resumable_chunks(work, identity)
    if chunks is None:
        if chunk_mib is None:  # some 16 chunks per worker (balance), 1 to 256 MiB each
            total = sum(_fingerprint(s)[2] for s in sources)
            chunk_bytes = min(256 << 20, max(1 << 20, total // (16 * workers)))
        else:
            chunk_bytes = max(1, int(chunk_mib * (1 << 20)))
        chunks = plan_chunks(sources, chunk_bytes)
        _start_afresh(work, dict(identity, chunks=[[c.source, c.start, c.stop, c.size] for c in chunks]))
    shard = lambda k: _shard(work, k)  # noqa: E731
    done = _complete_shards(work, len(chunks))
    if done:
        print(
            f"rmt-preprocess: resuming the run in '{work}': {len(done)} of {len(chunks)} chunks are done",
            file=sys.stderr,
            flush=True,
        )
    from rmt.data.metadata import read_metadata
    from rmt.data.shards import merge_indexed

    todo = [(k, c, shard(k)) for k, c in enumerate(chunks) if k not in done]
    if todo:
        _run(todo, sources, chunks, done, tokenizer.spec, text_key, min(workers, len(todo)), progress, work)
    metas = {k: read_metadata(shard(k)) for k in range(len(chunks))}
    groups = [[k for k, c in enumerate(chunks) if not per_input or c.source == i] for i in range(len(outputs))]
    for i, group in enumerate(groups):
        if not sum(metas[k]["num_documents"] for k in group):
            shutil.rmtree(work, ignore_errors=True)
            raise UserError(
                f"input '{sources[i].path}' holds no text: every '{text_key}' is empty"
                if per_input
                else f"the inputs hold no text: every '{text_key}' is empty"
            )
    written = [(out, merge_indexed(out, [shard(k) for k in group])) for out, group in zip(outputs, groups)]
    if per_input:
        blend = output_prefix + BLEND_SUFFIX
        base = os.path.dirname(os.path.abspath(blend))
        with open(blend + ".tmp", "w") as f:
            f.write(
                format_blend(
                    [m["num_tokens"] for _, m in written],
                    [os.path.relpath(os.path.abspath(p), base) for p, _ in written],
                )
            )
        os.replace(blend + ".tmp", blend)
    shutil.rmtree(work)
    return written


def _bytes_written(sources: List[Source], tokenizer_spec: str) -> int:
    """Free space a run needs at its end, as far as it can be told before tokenizing: with the
    byte tokenizer a txt or jsonl input gives at most one token (2 bytes, uint16) per byte, held
    twice at the end (the chunks' shards beside the merged dataset); other tokenizers and the
    compressed parquet and arrow inputs give an unknown number of tokens per input byte, so they
    count nothing."""
    if tokenizer_spec != "byte":
        return 0
    return 2 * 2 * sum(_fingerprint(s)[2] for s in sources if s.fmt in ("txt", "jsonl"))


def _output_prefixes(sources: List[Source], output_prefix: str, per_input: bool) -> List[str]:
    if not per_input:
        return [output_prefix]
    outputs = [f"{output_prefix}_{s.name}" for s in sources]
    for i, out in enumerate(outputs):
        if out in outputs[:i]:
            raise UserError(
                f"inputs '{sources[outputs.index(out)].path}' and '{sources[i].path}' would both "
                f"write '{out}' with --per-input; rename one"
            )
    return outputs


def _fingerprint(source: Source) -> list:
    """What identifies an input's contents for resuming: path, format, sizes and times."""
    files = (
        [source.path]
        if source.fmt != "arrow"
        else sorted(os.path.join(source.path, n) for n in os.listdir(source.path))
    )
    stats = [os.stat(f) for f in files]
    return [source.path, source.fmt, sum(s.st_size for s in stats), max(s.st_mtime_ns for s in stats)]


def _file_sha256(path: str) -> Optional[str]:
    if not os.path.isfile(path):
        return None  # byte
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _resumable_chunks(work: str, identity: dict) -> Optional[List[Chunk]]:
    """The chunks of an earlier run of the same command (inputs, tokenizer, settings) left in
    ``work``, whatever its number of workers; None when there is none to resume."""
    if not os.path.isdir(work):
        return None
    try:
        with open(os.path.join(work, "plan.json")) as f:
            plan = json.load(f)
        chunks = plan.pop("chunks")
    except (OSError, ValueError, KeyError, AttributeError):
        plan = None
    if plan != identity:
        print(
            f"rmt-preprocess: starting afresh: '{work}' holds an unfinished run of other inputs or settings",
            file=sys.stderr,
            flush=True,
        )
        return None
    return [Chunk(*c) for c in chunks]


def _shard(work: str, k: int) -> str:
    return os.path.join(work, f"{k:06d}")


def _complete_shards(work: str, count: int) -> set:
    """The chunks of ``work``'s ``count`` whose shards are complete there: what a resumed run
    reuses (a shard's files are renamed into place once written)."""
    return {k for k in range(count) if all(os.path.isfile(_shard(work, k) + e) for e in (".bin", ".idx", ".json"))}


def _start_afresh(work: str, plan: dict) -> None:
    """A new ``work`` directory holding ``plan``. A shard's files are renamed into place once
    complete, so a shard present there is done."""
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    path = os.path.join(work, "plan.json")
    with open(path + ".tmp", "w") as f:
        json.dump(plan, f)
    os.replace(path + ".tmp", path)


def _work(tokenizer_spec: str, sources: List[Source], text_key: str, tasks, events, parent: int) -> None:
    """A worker process: tokenize the chunks it takes from ``tasks`` into their shards,
    reporting progress, completions and errors on ``events``; it leaves when the parent
    process ``parent`` is gone (killed: no one would take its results)."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker: the workers are the parallelism
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops the run and ends its workers:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # at once (not as the parent's Ctrl-C)
    from rmt.data.shards import write_indexed

    tokenizer = build_tokenizer(tokenizer_spec)  # 'byte' or a tokenizer file: nothing to train
    encode = tokenizer.tokenize_batch

    def documents(chunk: Chunk):
        for texts, nbytes in chunk_texts(sources[chunk.source], chunk, text_key):
            ids = encode(texts) if texts else []
            events.put(("progress", len(ids), sum(len(x) for x in ids) + len(ids), nbytes))
            yield from ids

    while True:
        try:
            task = tasks.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != parent:
                return
            continue
        if task is None:
            return
        k, chunk, shard = task
        try:
            events.put(("done", k, write_indexed(shard, documents(chunk), tokenizer)))
        except UserError as err:
            events.put(("error", k, str(err)))
            return
        except Exception:  # a bug: its traceback, to the parent
            events.put(("crash", k, traceback.format_exc()))
            return


def _run(todo, sources, chunks, done, tokenizer_spec, text_key, workers, progress, work) -> None:
    """Tokenize the chunks ``todo`` on ``workers`` forked processes, with a progress bar."""
    import multiprocessing

    from tqdm import tqdm

    # spawned (not forked): a fork of a process with threads (numpy's OpenBLAS pool, a test
    # runner's) may inherit a held lock and hang; the workers import numpy and tokenizers only
    ctx = multiprocessing.get_context("spawn")
    tasks, events = ctx.Queue(), ctx.Queue()
    procs = [
        ctx.Process(target=_work, args=(tokenizer_spec, sources, text_key, tasks, events, os.getpid()), daemon=True)
        for _ in range(workers)
    ]
    for p in procs:
        p.start()
    for task in todo:
        tasks.put(task)
    for _ in procs:
        tasks.put(None)
    bar = tqdm(
        total=sum(c.size for c in chunks),
        initial=sum(chunks[k].size for k in done),
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc="rmt-preprocess",
        disable=None if progress else True,
        file=sys.stderr,
        dynamic_ncols=True,
    )
    docs = tokens = 0
    start, finished = time.perf_counter(), 0

    def left() -> str:
        # the shards on disk, not the chunks reported here: a worker may have finished one whose
        # report had not arrived when the run was stopped
        kept = len(_complete_shards(work, len(chunks)))
        return (
            f"{kept} of {len(chunks)} chunks are done and kept in '{work}'; the same "
            f"command resumes with the other {len(chunks) - kept}"
        )

    try:
        while finished < len(todo):
            try:
                kind, *rest = events.get(timeout=0.5)
            except queue.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    how = (
                        f"was killed by signal {-dead[0]} ({signal.Signals(-dead[0]).name}"
                        f"{', often the system out of memory' if -dead[0] == signal.SIGKILL else ''})"
                        if dead[0] < 0
                        else f"exited with status {dead[0]}"
                    )
                    raise JobError(f"a worker process {how}; {left()}")
                continue
            if kind == "progress":
                docs += rest[0]
                tokens += rest[1]
                bar.update(rest[2])
                rate = tokens / max(time.perf_counter() - start, 1e-9)
                bar.set_postfix_str(
                    f"{docs:,} docs, {tokens / 1e6:,.1f}M tokens, {rate / 1e6:.2f}M tokens/s", refresh=False
                )
            elif kind == "done":
                finished += 1
            elif kind == "error":
                raise UserError(rest[1])
            else:
                raise RuntimeError(f"rmt-preprocess worker failed on chunk {rest[0]}:\n{rest[1]}")
    except KeyboardInterrupt:
        raise Interrupted(left()) from None
    finally:
        bar.close()
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join()
        # a stopped run leaves tasks no worker will take: without this the process would wait at
        # exit for the queue's feeder thread to flush them into a pipe no one reads (more than its
        # 64 KiB buffer of tasks: a few hundred chunks)
        tasks.cancel_join_thread()


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="rmt-preprocess",
        description="Tokenize jsonl/txt/parquet files and saved HF datasets into megatron-core indexed "
        "datasets, on every core.",
    )
    ap.add_argument(
        "--input",
        nargs="+",
        required=True,
        help="input files or globs: .jsonl/.json (one object per line), .txt (one document per "
        "line), .parquet, or directories written by HF datasets' save_to_disk",
    )
    ap.add_argument(
        "--output-prefix", required=True, help="writes PREFIX.bin, PREFIX.idx and PREFIX.json (tokenizer metadata)"
    )
    ap.add_argument(
        "--per-input",
        action="store_true",
        help="one dataset per input, PREFIX_NAME (NAME: the input's file name without extension), "
        "and PREFIX.blend, their blend by tokens, for data.path",
    )
    ap.add_argument(
        "--workers",
        type=int,
        default=None,
        help=f"worker processes, each one core (default: the usable cores, {usable_cores()} here)",
    )
    ap.add_argument(
        "--tokenizer",
        default="byte",
        help="'byte' (default), 'bpe' (trained on the default corpus) or a path to a HF tokenizer.json / directory",
    )
    ap.add_argument("--text-key", default="text", help="field holding the text (jsonl, parquet, saved datasets)")
    ap.add_argument("--bpe-vocab-size", type=int, default=2048, help="vocabulary of the 'bpe' tokenizer")
    ap.add_argument("--cache-dir", default=".rmt_cache", help="where trained tokenizers live")
    ap.add_argument(
        "--chunk-mib",
        type=float,
        default=None,
        help="input per unit of work, MiB (default: about 1/16 of a worker's share, 1 to 256; "
        "parquet: one row group); the output does not depend on it",
    )
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    return ap


@cli_entry("rmt-preprocess")
def main(argv: Optional[List[str]] = None) -> int:
    setup_process()
    args = build_parser().parse_args(argv)
    if args.bpe_vocab_size < 1:
        raise UserError("--bpe-vocab-size must be positive")
    if args.workers is not None and args.workers < 1:
        raise UserError(f"--workers must be at least 1, got {args.workers}")
    if args.chunk_mib is not None and not args.chunk_mib > 0:
        raise UserError(f"--chunk-mib must be positive, got {args.chunk_mib}")
    start = time.perf_counter()
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM stops as Ctrl-C does
    try:
        written = preprocess(
            args.input,
            args.output_prefix,
            args.tokenizer,
            args.text_key,
            args.cache_dir,
            args.bpe_vocab_size,
            args.workers,
            args.per_input,
            args.chunk_mib,
            not args.no_progress,
        )
    except Interrupted as err:
        print(f"rmt-preprocess: interrupted: {err}", file=sys.stderr, flush=True)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    seconds = time.perf_counter() - start
    for prefix, meta in written:
        print(
            f"wrote {prefix}.bin/.idx: {meta['num_documents']} documents, {meta['num_tokens']} tokens, "
            f"vocab {meta['vocab_size']}",
            file=sys.stderr,
        )
    total = sum(m["num_tokens"] for _, m in written)
    print(
        f"{total} tokens in {seconds:.1f} s ({total / seconds / 1e6:.2f}M tokens/s)"
        + (f"; blend for data.path: {args.output_prefix}{BLEND_SUFFIX}" if args.per_input else ""),
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
