"""rmt: a megatron-core based pretraining framework for memory-centric language models."""

__version__ = "0.1.0"
