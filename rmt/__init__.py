"""rmt: a megatron-core based pretraining framework for memory-centric language models."""

from rmt import quiet

__version__ = "0.1.0"

quiet.install()
