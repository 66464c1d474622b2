"""Tiny byte-token models of every architecture and memory type, shared by the evaluation and
export tests: random weights with non-trivial biases, gains and decays."""

import torch

from rmt import parallel
from rmt.config import load_config
from rmt.config_checks import validate
from rmt.models.build import build

TINY = [
    "model.vocab_size=257",
    "model.seq_length=40",
    "model.hidden_size=16",
    "model.num_attention_heads=2",
    "model.num_layers=2",
    "model.block_width=8",
    "model.dk=8",
    "model.dv=8",
    "model.rank=2",
    "model.make_vocab_size_divisible_by=128",
]
MEMORY = ["memory.placement='1:2'", "memory.num_heads=2", "memory.topk=4", "memory.key_dim=8", "memory.num_keys=6"]
MODELS = {
    "transformer": ["model.arch=transformer"],
    "transformer_rope": ["model.arch=transformer", "model.position=rope"],
    "rmt": ["model.arch=rmt", "model.position=alibi"],
    "rmt_learned": ["model.arch=rmt", "model.position=learned"],
    "recurrent": ["model.arch=recurrent"],
    "mixer_mixed_decay": ["model.arch=mixer", "model.mixer_kind=mixed", "model.mixer_decay=true"],
    "mixer_masked": ["model.arch=mixer", "model.mixer_kind=masked"],
    "ultramem": [
        "model.arch=transformer",
        "memory.type=ultramem",
        "memory.tucker_rank=2",
        "memory.num_cores=2",
        "memory.ive_blocks=4",
    ]
    + MEMORY,
    "pkm": ["model.arch=transformer", "memory.type=pkm", "memory.query_batchnorm=true", "memory.query_bias=true"]
    + MEMORY,
    "moe": [
        "model.arch=transformer",
        "memory.type=moe",
        "memory.placement='1:2'",
        "memory.num_experts=4",
        "memory.moe_topk=2",
        "memory.expert_hidden_size=8",
    ],
    "moe_mlp": [
        "model.arch=transformer",
        "memory.type=moe",
        "memory.moe_placement=mlp",
        "memory.placement=1-2",
        "memory.num_experts=4",
        "memory.moe_topk=2",
    ],
    "rmt_ultramem": [
        "model.arch=rmt",
        "memory.type=ultramem",
        "memory.tucker_rank=2",
        "memory.num_cores=2",
        "memory.ive_blocks=4",
    ]
    + MEMORY,
}


def tiny_config(name, extra=()):
    return validate(load_config(None, TINY + MODELS[name] + list(extra)), 1)


def tiny_model(name, extra=()):
    """``(model, config)`` on one process (the caller runs ``parallel.destroy()``)."""
    config = tiny_config(name, extra)
    parallel.initialize(config)
    model = build(config)[0].eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn_like(p))
    return model, config


def train_tiny(root, name, extra=(), steps=2):
    """A checkpoint of ``name`` after ``steps`` steps on a few documents of the default corpus
    (byte tokens), saved under ``root/ckpt``; returns that save root."""
    from rmt.training.trainer import Trainer

    save = f"{root}/ckpt"
    config = tiny_config(
        name,
        [
            f"train.steps={steps}",
            "train.warmup_steps=0",
            "train.micro_batch_size=2",
            "train.eval_iters=0",
            "train.progress=false",
            "data.max_documents=4",
            f"data.cache_dir={root}/cache",
            f"train.save={save}",
        ]
        + list(extra),
    )
    parallel.initialize(config)
    try:
        Trainer(config).train()
    finally:
        parallel.destroy()
    return save


def causal_logits(model, tokens, vocab: int = 257):
    """rmt's logits of ``tokens`` ``[b, s]`` under the causal mask, cut to the ``vocab`` real rows."""
    s = tokens.shape[1]
    return model(
        tokens,
        torch.arange(s)[None].expand(tokens.shape[0], -1),
        torch.ones(s, s, dtype=torch.bool).triu(1)[None, None],
    )[..., :vocab]
