"""The local task's data: ``rmt_local.json`` beside this file, read without a hub."""

import json
import os

import datasets

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rmt_local.json")


def load(part: str, **_metadata) -> datasets.DatasetDict:
    """The items of ``part`` (``multiple_choice``, ``cloze`` or ``documents``) as a test split."""
    with open(DATA, encoding="utf-8") as f:
        return datasets.DatasetDict({"test": datasets.Dataset.from_list(json.load(f)[part])})


def target_prefix(resps, docs):
    """Each generated text cut to its target's length (the gen task's filter): exact match
    then asks whether the greedy continuation starts with the target."""
    return [[r[: len(doc["target"])] for r in rs] for rs, doc in zip(resps, docs)]
