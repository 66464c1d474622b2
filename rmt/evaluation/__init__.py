"""Downstream evaluation of rmt checkpoints with lm-evaluation-harness (``rmt-eval``).

* :mod:`rmt.evaluation.scoring`: summed log-probabilities of continuations, batched;
* :mod:`rmt.evaluation.harness`: the ``lm_eval`` model class ``rmt`` on top of it;
* :mod:`rmt.evaluation.cli`: the ``rmt-eval`` command;
* ``rmt/evaluation/tasks/``: a small local task (``rmt_local``) that needs no hub.

lm-eval is the optional extra ``eval`` (``pip install -e .[eval]``).
"""
