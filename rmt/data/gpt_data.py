"""Training and validation samples through megatron-core's GPTDataset.

:func:`resolve_data` finds (or builds, for the default corpus) the indexed dataset and checks it
against the model's vocabulary; :func:`build_datasets` makes the train/valid splits;
:func:`microbatches` yields the microbatches of one global batch for this data-parallel rank.
The order of samples depends only on the number consumed, so training resumes at the exact
position and a change of data-parallel size with the same global batch sees the same samples.
Document boundaries (``data.reset_position_ids``, ``reset_attention_mask``, ``eod_mask_loss``)
are megatron-core's: each sample then carries its position ids, loss mask and block-causal
attention mask (:mod:`rmt.models.documents`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, List

import numpy as np
import torch
import torch.distributed as dist
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

from rmt.config import RMTConfig
from rmt.data.blend import Blend, blend_prefixes, data_blends
from rmt.data.corpus import corpus_documents
from rmt.data.indexed import max_token_id, open_indexed
from rmt.data.metadata import DEFAULT, dataset_tokenizer, read_metadata, shared_tokenizer
from rmt.data.shards import write_indexed
from rmt.data.tokenizers import build_tokenizer
from rmt.errors import UserError


@dataclass
class DataSpec:
    blends: Dict[str, Blend]  # data_blends' form: {"all": ..} or {"train": .., "valid": ..}
    vocab_size: int
    eod: int

    @property
    def prefixes(self) -> List[str]:
        return blend_prefixes(self.blends)


class _TokenizerInfo:
    """What GPTDataset reads from a tokenizer."""

    def __init__(self, vocab_size: int, eod: int):
        self.vocab_size, self.eod = vocab_size, eod
        # Part of the dataset cache's identity (megatron-core hashes it into the cache name).
        self.unique_identifiers = {"vocab_size": vocab_size, "eod": eod}


def default_corpus_prefix(config: RMTConfig) -> str:
    d = config.data
    spec = d.tokenizer or DEFAULT
    tok = spec if spec in ("byte", "bpe") else "hf_" + os.path.basename(spec.rstrip("/"))
    if spec == "bpe":
        tok += str(d.bpe_vocab_size)
    return os.path.join(d.cache_dir, f"stdlib_{tok}_{d.max_documents or 'all'}", "corpus")


def prepare_default_corpus(config: RMTConfig) -> str:
    """Tokenize the default corpus into the cache once; returns its prefix."""
    prefix = default_corpus_prefix(config)
    if not os.path.isfile(prefix + ".idx"):
        d = config.data
        tok = build_tokenizer(d.tokenizer or DEFAULT, d.cache_dir, d.bpe_vocab_size, d.max_documents)
        ids = tok.tokenize_batch(list(corpus_documents(d.max_documents)))
        try:
            write_indexed(prefix, ids, tok)
        except OSError as err:
            raise UserError(
                f"cannot write the tokenized default corpus into data.cache_dir '{d.cache_dir}' "
                f"({err.strerror or err}); set data.cache_dir to a writable directory"
            ) from None
    return prefix


def resolve_data(config: RMTConfig) -> DataSpec:
    """Open and check the dataset (building the default corpus on global rank 0 first), take
    the tokenizer its metadata records (``data.tokenizer``, :mod:`rmt.data.metadata`) and fix
    ``model.vocab_size`` from it when unset. Raises UserError for bad data."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    blends = data_blends(config.data)
    if blends is None:
        if rank == 0:
            prepare_default_corpus(config)
        if dist.is_initialized():
            dist.barrier()
        blends = {"all": Blend((default_corpus_prefix(config),))}
    prefixes = blend_prefixes(blends)
    datasets = [open_indexed(p) for p in prefixes]
    config.data.tokenizer = dataset_tokenizer(config.data.tokenizer, prefixes)
    found = shared_tokenizer(prefixes)
    meta = read_metadata(found[0]) if found is not None else None
    if meta is not None:
        vocab, eod = int(meta["vocab_size"]), int(meta["eod"])
    else:
        tok = build_tokenizer(config.data.tokenizer, config.data.cache_dir, config.data.bpe_vocab_size)
        vocab, eod = tok.vocab_size, tok.eod
    if config.model.vocab_size is None:
        config.model.vocab_size = vocab
    for prefix, ds in zip(prefixes, datasets):
        top = max_token_id(prefix, ds)
        if top >= config.model.vocab_size:
            raise UserError(
                f"dataset '{prefix}' holds token id {top}, out of range for model.vocab_size {config.model.vocab_size}"
            )
    # prefixes without weights: weights in proportion to their tokens (megatron-core itself
    # would blend one epoch of each and no more, whatever the number of samples asked for)
    tokens = {p: int(ds.index.sequence_lengths.sum(dtype=np.int64)) for p, ds in zip(prefixes, datasets)}
    blends = {
        k: b
        if b.weights is not None or len(b.prefixes) == 1
        else Blend(b.prefixes, tuple(float(tokens[p]) for p in b.prefixes))
        for k, b in blends.items()
    }
    return DataSpec(blends, config.model.vocab_size, eod)


def build_datasets(config: RMTConfig, spec: DataSpec, num_train: int, num_valid: int):
    """``(train, valid)`` datasets with ``num_*`` samples each (valid may be None): a GPTDataset
    for one prefix, megatron-core's BlendedDataset over GPTDatasets for a blend (its sample
    ``i`` is a function of ``i`` and the blend alone: the weights' deterministic interleave).
    Global rank 0 builds the index caches first; the other ranks then load them."""
    t = config.train
    blends = spec.blends
    if "all" in blends:
        for prefix in blends["all"].prefixes:
            _check_split(prefix, config.data.split, bool(num_valid))
        where = dict(blend=blends["all"].as_megatron(), split=config.data.split)
    else:
        where = dict(
            blend_per_split=[
                blends["train"].as_megatron(),
                blends["valid"].as_megatron() if num_valid and "valid" in blends else None,
                None,
            ],
            split=None,
        )
    weighted = any(b.weights is not None for b in blends.values())
    gcfg = GPTDatasetConfig(
        random_seed=t.seed,
        sequence_length=config.model.seq_length,
        path_to_cache=os.path.join(os.path.dirname(os.path.abspath(spec.prefixes[0])), "index_cache"),
        tokenizer=_TokenizerInfo(spec.vocab_size, spec.eod),
        reset_position_ids=config.data.reset_position_ids,
        reset_attention_mask=config.data.reset_attention_mask,
        eod_mask_loss=config.data.eod_mask_loss,
        # per-sample block-causal masks only where documents restart attention
        create_attention_mask=config.data.reset_attention_mask,
        mid_level_dataset_surplus=0.005,
        **where,
    )
    # megatron-core draws weighted blends to a size; a split not needed is drawn to none
    sizes = [num_train, num_valid or (0 if weighted else None), 0 if weighted else None]
    # megatron-core builds on global rank 0 first, then on the other ranks (it barriers itself).
    train, valid, _ = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, gcfg).build()
    name = " + ".join(f"'{p}'" for p in spec.prefixes)
    if train is None or len(train) == 0:
        raise UserError(f"dataset {name} is too small for sequences of {config.model.seq_length} tokens")
    if num_valid and (valid is None or len(valid) == 0):
        what = f"with split '{config.data.split}'" if "all" in blends else "from data.valid_path"
        raise UserError(f"dataset {name} gives no validation samples {what}")
    return train, valid if num_valid else None


def _check_split(prefix: str, split: str, need_valid: bool) -> None:
    """Reject splits that leave the train (or a needed validation) part without documents;
    megatron-core would loop forever looking for tokens there. Bounds as megatron computes them."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )

    num_docs = len(open_indexed(prefix))
    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    for i, name in enumerate(("train", "validation")):
        if i == 1 and not need_valid:
            continue
        bounds = matrix[i]
        count = 0 if bounds is None else int(round(bounds[1] * num_docs)) - int(round(bounds[0] * num_docs))
        if count == 0:
            raise UserError(
                f"data.split '{split}' leaves no {name} documents out of the {num_docs} in "
                f"'{prefix}'; use more data or a larger {name} share"
            )


def microbatches(
    dataset, first_sample: int, micro_batch_size: int, num_microbatches: int, dp_rank: int, dp_size: int
) -> List[Dict[str, torch.Tensor]]:
    """The microbatches of the global batch that starts at sample ``first_sample``, for one
    data-parallel rank: microbatch j holds samples ``first + j*mbs*dp + dp_rank*mbs + [0, mbs)``
    (megatron's pretraining sampler order)."""
    out = []
    for j in range(num_microbatches):
        start = first_sample + (j * dp_size + dp_rank) * micro_batch_size
        samples = [dataset[(start + i) % len(dataset)] for i in range(micro_batch_size)]
        # a blend's samples also carry the index of their dataset ("dataset_id", an integer)
        out.append({k: torch.stack([torch.as_tensor(s[k]) for s in samples]) for k in samples[0]})
    return out
