"""The default corpus: the source text of Python's standard library.

Real English-and-code text that is present offline on every machine that runs rmt, in a fixed
order (the top-level modules of the running interpreter's ``stdlib``, sorted by name). Each
module is one document.
"""

from __future__ import annotations

import glob
import os
import sysconfig
from typing import Iterator, List, Optional


def corpus_files(max_documents: Optional[int] = None) -> List[str]:
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    return files[:max_documents] if max_documents else files


def corpus_documents(max_documents: Optional[int] = None) -> Iterator[str]:
    for path in corpus_files(max_documents):
        with open(path, encoding="utf-8", errors="replace") as f:
            yield f.read()
