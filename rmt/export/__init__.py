"""Export of rmt checkpoints as Hugging Face ``transformers`` model directories (``rmt-export``).

* :mod:`rmt.export.standard`: the transformer baseline as a standard architecture (GPT-2 with
  learned positions, GPT-NeoX with RoPE), loadable without custom code;
* :mod:`rmt.export.tokenizer`: the dataset's tokenizer as Hugging Face tokenizer files;
* :mod:`rmt.export.cli`: the ``rmt-export`` command.
"""
