"""Build models under several layouts in one torchrun launch of 4 ranks and compare every rank's
dense parameter elements with :func:`rmt.planner.rank.stage_params` for its pipeline stage.

    torchrun --nproc_per_node=4 tests/dist/rank_params.py OUT.json

Writes ``{layout: [[stage, built, planned], ...]}`` (one entry per rank) to OUT.json on rank 0.
"""

import json
import os
import sys

import rmt

rmt.setup_process()  # as rmt's commands do (rmt.process), before torch is imported
import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state  # noqa: E402

from rmt import parallel  # noqa: E402
from rmt.config import load_config  # noqa: E402
from rmt.config_checks import validate  # noqa: E402
from rmt.models.build import build  # noqa: E402
from rmt.planner.rank import layout_of, stage_params  # noqa: E402
from rmt.memory.descriptor import is_table  # noqa: E402

COMMON = ["model.num_layers=4", "model.seq_length=16", "model.vocab_size=64", "model.make_vocab_size_divisible_by=16",
          "model.ffn_hidden_size=32"]
TRANSFORMER = ["model.hidden_size=16", "model.num_attention_heads=4"]
RMT = ["model.arch=rmt", "model.dk=6", "model.dv=4", "model.rank=4", "model.position=alibi"]
ULTRAMEM = ["memory.type=ultramem", "memory.placement='1:2/3:4'", "memory.key_dim=8", "memory.num_keys=4",
            "memory.topk=3", "memory.init_samples=2", "memory.partition=number"]
LAYOUTS = {
    "transformer_tp2_pp2": TRANSFORMER + ["parallel.tensor_model_parallel_size=2",
                                          "parallel.pipeline_model_parallel_size=2"],
    "transformer_pp2_vpp2": TRANSFORMER + ["parallel.pipeline_model_parallel_size=2",
                                                   "parallel.virtual_pipeline_model_parallel_size=2",
                                                   "train.micro_batch_size=1", "train.global_batch_size=4"],
    "transformer_tp4_rmsnorm_ultramem": TRANSFORMER + ULTRAMEM + ["parallel.tensor_model_parallel_size=4",
                                                                  "model.normalization=RMSNorm"],
    "transformer_tp2_moe_mlp_ep2": TRANSFORMER + ["parallel.tensor_model_parallel_size=2", "memory.type=moe",
                                                  "memory.moe_placement=mlp", "memory.placement=1/3",
                                                  "memory.num_experts=4", "parallel.expert_model_parallel_size=2"],
    "rmt_tp2_pp2_ultramem": RMT + ULTRAMEM + ["parallel.tensor_model_parallel_size=2",
                                              "parallel.pipeline_model_parallel_size=2"],
    "rmt_tp4": RMT + ["parallel.tensor_model_parallel_size=4"],
}


def main(out: str) -> None:
    results = {}
    for name, overrides in LAYOUTS.items():
        config = validate(load_config(None, COMMON + overrides), int(os.environ["WORLD_SIZE"]))
        parallel.initialize(config)
        built = sum(p.numel() for chunk in build(config) for p in chunk.parameters() if not is_table(p))
        stage = parallel_state.get_pipeline_model_parallel_rank()
        row = [stage, built, stage_params(config, layout_of(config, dist.get_world_size()), stage)]
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, row)
        results[name] = every
        parallel_state.destroy_model_parallel()  # the process group stays for the next layout
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    parallel.destroy()


if __name__ == "__main__":
    main(sys.argv[1])
