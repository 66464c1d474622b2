"""rmt: a megatron-core based pretraining framework for memory-centric language models.

Importing rmt changes nothing in the process; :func:`setup_process` installs the process-wide
settings its commands run with (:mod:`rmt.process`)."""

from rmt.process import setup_process

__version__ = "0.1.0"

__all__ = ["setup_process"]
