"""The inputs of ``rmt-preprocess``: files and globs resolved to sources, each cut into chunks
that a worker reads on its own, and the texts of one chunk, streamed.

Formats: jsonl (``.jsonl``/``.json``, one JSON object per line), txt (``.txt``/``.text``, one
document per line), parquet (``.parquet``) and HF ``datasets`` saved with ``save_to_disk``
(a directory of Arrow files). A chunk is a byte range of a jsonl or txt file (cut at line ends,
near every ``chunk_bytes``), a row group of a parquet file, or a row range of a saved dataset:
the units each format can be read from independently. Chunks depend on the inputs and
``chunk_bytes`` only, never on the number of workers; documents come out in input order.

Reading holds one batch of texts at a time, so memory does not grow with the input. (Not
``datasets.load_dataset``: it first copies a whole jsonl/txt/parquet input into its Arrow
cache in one process, and its streaming mode cannot split one file between workers.)
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass
from typing import Iterator, List, Tuple

from rmt.errors import UserError

_FORMATS = {".jsonl": "jsonl", ".json": "jsonl", ".txt": "txt", ".text": "txt", ".parquet": "parquet"}
_BLOCK = 1 << 20  # bytes read at a time from a text file


@dataclass(frozen=True)
class Source:
    path: str  # absolute
    fmt: str  # jsonl | txt | parquet | arrow

    @property
    def name(self) -> str:
        """The input's name without directory and extension (``web`` for ``data/web.jsonl``)."""
        base = os.path.basename(self.path.rstrip("/"))
        return base if self.fmt == "arrow" else os.path.splitext(base)[0]


@dataclass(frozen=True)
class Chunk:
    source: int  # index into the sources
    start: int  # byte offset (jsonl, txt), row group (parquet) or row (arrow)
    stop: int
    size: int  # bytes of input it covers (for the progress bar)


def _is_saved_dataset(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "state.json")) and os.path.isfile(os.path.join(path, "dataset_info.json"))


def resolve_inputs(patterns: List[str]) -> List[Source]:
    """The sources that files, directories (saved HF datasets) and globs name, in the order
    given (a glob's matches sorted). Raises UserError for missing or unknown inputs."""
    paths: List[str] = []
    for pattern in patterns:
        if glob.has_magic(pattern):
            matches = sorted(glob.glob(pattern))
            if not matches:
                raise UserError(f"input pattern '{pattern}' matches no file")
            paths += matches
        elif not os.path.exists(pattern):
            raise UserError(f"input file '{pattern}' does not exist")
        else:
            paths.append(pattern)
    sources, seen = [], set()
    for path in paths:
        real = os.path.realpath(path)
        if real in seen:
            raise UserError(f"input '{path}' is given twice")
        seen.add(real)
        if os.path.isdir(path):
            if os.path.isfile(os.path.join(path, "dataset_dict.json")):
                splits = sorted(n for n in os.listdir(path) if _is_saved_dataset(os.path.join(path, n)))
                raise UserError(
                    f"input '{path}' is a HF DatasetDict (splits: {', '.join(splits)}); give the "
                    f"directory of one split, e.g. '{os.path.join(path, splits[0] if splits else 'train')}'"
                )
            if not _is_saved_dataset(path):
                raise UserError(f"input '{path}' is a directory but not a HF dataset saved with save_to_disk")
            sources.append(Source(os.path.abspath(path), "arrow"))
            continue
        fmt = _FORMATS.get(os.path.splitext(path)[1].lower())
        if fmt is None:
            raise UserError(
                f"input '{path}' is not .jsonl, .json, .txt or .parquet (nor a directory "
                f"written by HF datasets' save_to_disk)"
            )
        sources.append(Source(os.path.abspath(path), fmt))
    return sources


def check_source(source: Source, text_key: str) -> None:
    """What can be checked before any work: a text file holds more than white space, the first
    record of jsonl / the schema of parquet and saved datasets has the text field."""
    if source.fmt in ("jsonl", "txt"):
        _check_has_text(source.path)
    if source.fmt == "jsonl":
        with open(source.path, "rb") as f:
            offset = 0
            for line in f:
                if line.strip():
                    fields = _parse_line(line, source.path, offset)
                    break
                offset += len(line)
    elif source.fmt == "parquet":
        import pyarrow.parquet as pq

        try:
            fields = pq.ParquetFile(source.path).schema_arrow.names
        except Exception as err:
            raise UserError(f"could not read '{source.path}' as parquet ({_first_line(err)})") from None
    elif source.fmt == "arrow":
        fields = open_saved_dataset(source.path).column_names
    else:
        return
    if text_key not in fields:
        raise UserError(f"input '{source.path}' has no '{text_key}' field; its fields are: {', '.join(fields)}")


def _first_line(err: Exception) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def _check_has_text(path: str) -> None:
    """A jsonl or txt input with nothing but white space is a mistake."""
    with open(path, "rb") as f:
        while True:
            block = f.read(_BLOCK)
            if not block:
                raise UserError(
                    f"input file '{path}' is empty"
                    if f.tell() == 0
                    else f"input file '{path}' holds nothing but white space"
                )
            if block.strip():
                return


def open_saved_dataset(path: str):
    """A HF dataset saved with ``save_to_disk`` (memory-mapped Arrow files, never loaded)."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import datasets

    datasets.disable_progress_bars()
    try:
        ds = datasets.load_from_disk(path)
    except Exception as err:
        raise UserError(f"could not read '{path}' as a saved HF dataset ({_first_line(err)})") from None
    return ds


def plan_chunks(sources: List[Source], chunk_bytes: int) -> List[Chunk]:
    """Every source's chunks, in input order (module docstring)."""
    chunks: List[Chunk] = []
    for i, source in enumerate(sources):
        if source.fmt in ("jsonl", "txt"):
            bounds = _line_bounds(source.path, chunk_bytes)
            chunks += [Chunk(i, a, b, b - a) for a, b in zip(bounds, bounds[1:])]
        elif source.fmt == "parquet":
            import pyarrow.parquet as pq

            meta = pq.ParquetFile(source.path).metadata
            chunks += [Chunk(i, g, g + 1, meta.row_group(g).total_byte_size) for g in range(meta.num_row_groups)]
        else:
            ds = open_saved_dataset(source.path)
            rows, nbytes = len(ds), max(1, ds.data.nbytes)
            step = max(1, int(rows * chunk_bytes // nbytes))
            chunks += [
                Chunk(i, a, min(a + step, rows), (min(a + step, rows) - a) * nbytes // max(rows, 1))
                for a in range(0, rows, step)
            ]
    return chunks


def _line_bounds(path: str, chunk_bytes: int) -> List[int]:
    """Offsets ``0 = b0 < b1 < ... = size`` where each ``bk`` (k > 0) is the start of the first
    line that begins at or after ``k * chunk_bytes``."""
    size = os.path.getsize(path)
    bounds = [0]
    with open(path, "rb") as f:
        for target in range(chunk_bytes, size, chunk_bytes):
            if target <= bounds[-1]:
                continue  # a line longer than a chunk: its chunk already reaches past here
            f.seek(target - 1)
            pos = target - 1
            while True:
                block = f.read(1 << 16)
                if not block:
                    pos = size
                    break
                nl = block.find(b"\n")
                if nl >= 0:
                    pos += nl + 1
                    break
                pos += len(block)
            if pos >= size:
                break
            bounds.append(pos)
    bounds.append(size)
    return bounds


def _parse_line(line: bytes, path: str, offset: int) -> dict:
    try:
        record = json.loads(line)
    except ValueError as err:
        raise UserError(f"input '{path}' is not JSON lines: the line at byte {offset} does not parse ({err})") from None
    if not isinstance(record, dict):
        raise UserError(
            f"input '{path}' is not JSON lines of objects: the line at byte {offset} is a {type(record).__name__}"
        )
    return record


def _lines(path: str, start: int, stop: int) -> Iterator[bytes]:
    """The lines of bytes ``[start, stop)`` (a range of whole lines), without their line end."""
    with open(path, "rb") as f:
        f.seek(start)
        pos, rest = start, b""
        while pos < stop:
            block = f.read(min(_BLOCK, stop - pos))
            if not block:
                break
            pos += len(block)
            lines = (rest + block).split(b"\n")
            rest = lines.pop()
            yield from lines
        if rest:
            yield rest


def chunk_texts(source: Source, chunk: Chunk, text_key: str, batch_size: int = 1024) -> Iterator[Tuple[List[str], int]]:
    """``(texts, bytes)``: batches of the chunk's non-empty texts, in order, and the input bytes
    each batch covers (for progress). Empty texts (blank lines) are left out."""
    if source.fmt in ("jsonl", "txt"):
        batch, covered, offset = [], 0, chunk.start
        for line in _lines(source.path, chunk.start, chunk.stop):
            covered += len(line) + 1
            text = _line_text(source, line, offset, text_key)
            offset += len(line) + 1
            if text:
                batch.append(text)
                if len(batch) == batch_size:
                    yield batch, covered
                    batch, covered = [], 0
        if batch or covered:
            yield batch, covered
    elif source.fmt == "parquet":
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(source.path)
        rows = pf.metadata.row_group(chunk.start).num_rows
        for rb in pf.iter_batches(batch_size=batch_size, row_groups=[chunk.start], columns=[text_key]):
            yield _texts(rb.column(0).to_pylist(), source, text_key), chunk.size * rb.num_rows // max(rows, 1)
    else:
        ds = open_saved_dataset(source.path)
        rows = chunk.stop - chunk.start
        for a in range(chunk.start, chunk.stop, batch_size):
            b = min(a + batch_size, chunk.stop)
            yield _texts(ds[a:b][text_key], source, text_key), chunk.size * (b - a) // max(rows, 1)


def _line_text(source: Source, line: bytes, offset: int, text_key: str):
    if source.fmt == "txt":
        line = line[:-1] if line.endswith(b"\r") else line
        try:
            return line.decode("utf-8")
        except UnicodeDecodeError as err:
            raise UserError(f"input '{source.path}' is not UTF-8 text (byte {offset + err.start})") from None
    if not line.strip():
        return None
    texts = _texts([_parse_line(line, source.path, offset).get(text_key)], source, text_key)
    return texts[0] if texts else None


def _texts(values: list, source: Source, text_key: str) -> List[str]:
    bad = [v for v in values if v is not None and not isinstance(v, str)]
    if bad:
        raise UserError(f"input '{source.path}' holds a '{text_key}' that is not text ({type(bad[0]).__name__})")
    return [v for v in values if v]
