"""The whole-rank planner (rmt.planner.rank) against the built models and measured runs, its CLI
(``rmt-plan memory --config``), and the layout search (``rmt-plan layouts``)."""

import itertools
import json

import pytest
import torch
from test_flops import CASES, COMMON, single_process  # noqa: F401  (a fixture)

from rmt.config import load_config
from rmt.config_checks import validate
from rmt.models.build import build
from rmt.planner import cli, rank_cli
from rmt.planner.dense import dense_bytes_per_param
from rmt.planner.hardware import load_profile
from rmt.planner.layouts import search
from rmt.planner.rank import (
    CPU_BF16_OVERSTATEMENT,
    CPU_BF16_SHORTFALL,
    in_flight,
    layout_of,
    loss_bytes_per_logit,
    plan_rank,
    rank_phases,
    stage_params,
    with_vocabulary,
)
from rmt.planner.time import stage_time
from rmt.profiling import step_peak_bytes
from rmt.training.optimizer import is_table

from conftest import load_script, run_python


@pytest.mark.parametrize("case", sorted(CASES))
def test_rank_params_equal_the_built_model(single_process, case):
    """One rank of every architecture and memory type: the dense parameters (all but the value
    tables) the planner counts are the built model's."""
    config = validate(load_config(None, COMMON + CASES[case]), world_size=1)
    built = sum(p.numel() for chunk in build(config) for p in chunk.parameters() if not is_table(p))
    assert stage_params(config, layout_of(config, 1), 0) == built


@pytest.mark.parametrize(
    "extra, buffered",
    [
        ([], True),
        (["train.distributed_optimizer=true"], False),
        (["memory.value_optimizer=sparse_adam"], False),
        (["memory.partition=number"], False),
    ],
)
def test_the_tables_ddp_buffers_are_those_the_plan_holds_from_init(single_process, extra, buffered):
    """megatron's DDP allocates its fp32 gradient buffer when it wraps the model: the value tables
    it buffers (local, dense-gradient, without the distributed optimizer) hold that buffer from
    ``init`` on, the others none."""
    from rmt.planner.memory import components
    from rmt.planner.rank import stage_table_plan
    from rmt.training.ddp import wrap_chunks

    config = validate(load_config(None, COMMON + CASES["transformer_ultramem"] + extra), world_size=1)
    wrapped = wrap_chunks(build(config), config)
    in_buffer = sum(
        p.main_grad.numel() * p.main_grad.element_size()
        for chunk in wrapped
        for p in chunk.module.parameters()
        if is_table(p) and getattr(p, "main_grad", None) is not None
    )
    plan = stage_table_plan(config, layout_of(config, 1), 0)
    assert plan.ddp_buffered is buffered and (in_buffer > 0) is buffered
    assert plan.layers * components(plan)["ddp_buffer"] == in_buffer


@pytest.mark.slow
@pytest.mark.parametrize(
    "precision, z_loss, arch", list(itertools.product(("bf16", "fp32"), (0.0, 1e-4), ("transformer", "mixer")))
)
def test_the_loss_holds_what_is_counted_per_logit(single_process, precision, z_loss, arch):
    """The output layer's logits through the trainer's loss, forward and backward: the peak of the
    allocated bytes (the profiler's running sum) is ``kept + workspace`` per logit element, plus
    the loss's per-token vectors (maxima, sums, targets, masks: at most 64 bytes a token). The
    transformer's logits come out ``[s, b]``-ordered and are copied into ``[b, s]`` order; the
    mixer's come out ``[b, s]``-ordered."""
    from rmt.training.loss import lm_loss

    config = load_config(None, [f"train.precision={precision}", f"train.z_loss={z_loss}", f"model.arch={arch}"])
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    s, b, hidden, vocab = 64, 2, 4, 4096
    torch.manual_seed(0)
    shape = (s, b, hidden) if arch == "transformer" else (b, s, hidden)
    h = torch.randn(*shape, dtype=dtype, requires_grad=True)
    w = torch.randn(vocab, hidden, dtype=dtype, requires_grad=True)
    labels, mask = torch.randint(0, vocab, (b, s)), torch.ones(b, s)

    def step():
        logits = h @ w.t()
        if arch == "transformer":
            logits = logits.transpose(0, 1).contiguous()  # megatron-core's GPTModel returns [b, s, V]
        loss, _ = lm_loss(logits, labels, mask, z_loss)
        del logits
        loss.backward()

    counted = loss_bytes_per_logit(config)
    measured = step_peak_bytes(step, torch.device("cpu")) - (counted["kept"] + counted["workspace"]) * s * b * vocab
    assert 0 <= measured <= 64 * s * b


def test_rank_params_under_tensor_pipeline_expert_parallelism(tmp_path):
    """Every rank of TP2 x PP2, PP2 x VPP2, TP4 with UltraMem, TP2 with MoE experts over EP2, the
    RMT at TP2 x PP2 and TP4 (4 gloo ranks): exact."""
    out = tmp_path / "params.json"
    run_python(["tests/dist/rank_params.py", str(out)], nproc=4)
    results = json.loads(out.read_text())
    assert set(results) == set(load_script("tests/dist/rank_params.py").LAYOUTS)
    for name, ranks in results.items():
        for stage, built, planned in ranks:
            assert built == planned, (name, stage)
        if "pp2" in name:
            assert {r[0] for r in ranks} == {0, 1}


def _config(*overrides, world=4):
    return validate(load_config(None, ["model.vocab_size=512"] + list(overrides)), world_size=world)


def test_distributed_optimizer_state_falls_as_one_over_dp():
    """Adam's moments and the bf16 main copies shrink as 1/DP; parameters and gradients do not."""
    per = {}
    for dp in (1, 2, 4):
        c = _config("train.distributed_optimizer=true", "train.precision=bf16", world=dp)
        step = rank_phases(c, layout_of(c, dp), 0)["step"]
        per[dp] = step
    n = stage_params(c, layout_of(c, 1), 0)
    for dp in (1, 2, 4):
        want = dense_bytes_per_param("bf16", True, dp)
        assert per[dp]["optimizer_states"] == int(n * (want["exp_avg"] + want["exp_avg_sq"]))
        assert per[dp]["main_params"] == int(n * 4 / dp) and per[dp]["grads"] == n * 4
    assert per[1]["optimizer_states"] == 2 * per[2]["optimizer_states"] == 4 * per[4]["optimizer_states"]


def test_pipeline_stages_hold_the_schedule_in_flight_microbatches():
    """1F1B: stage s of PP holds min(PP - s, m) micro-batches; interleaved adds the warm-up of the
    virtual stages; the first and last stages differ (embedding, logits)."""
    c = _config(
        "model.num_layers=8",
        "parallel.pipeline_model_parallel_size=4",
        "train.micro_batch_size=1",
        "train.global_batch_size=8",
        world=4,
    )
    layout = layout_of(c, 4)
    assert [in_flight(layout, s) for s in range(4)] == [4, 3, 2, 1]
    doc = plan_rank(c, 4)
    assert set(doc["stages"]) == {"0", "1", "2", "3"}
    acts = [doc["stages"][str(s)]["phases"]["step"]["activations"] for s in range(4)]
    assert acts[1] > acts[2]  # more micro-batches in flight on the earlier middle stage
    assert doc["stages"]["3"]["phases"]["step"]["transient"] > 0 == doc["stages"]["0"]["phases"]["step"]["transient"]
    v = _config(
        "model.num_layers=8",
        "parallel.pipeline_model_parallel_size=2",
        "parallel.virtual_pipeline_model_parallel_size=2",
        "train.micro_batch_size=1",
        "train.global_batch_size=8",
        world=2,
    )
    assert [in_flight(layout_of(v, 2), s) for s in range(2)] == [5, 3]


def test_recomputation_and_sequence_parallelism_lower_the_activations():
    base = _config("model.num_layers=4", "parallel.tensor_model_parallel_size=2", world=2)
    acts = {}
    for name, extra in {
        "none": [],
        "selective": ["train.recompute_granularity=selective"],
        "full": ["train.recompute_granularity=full", "train.recompute_method=uniform", "train.recompute_num_layers=1"],
        "sp": ["parallel.sequence_parallel=true"],
    }.items():
        c = _config("model.num_layers=4", "parallel.tensor_model_parallel_size=2", *extra, world=2)
        acts[name] = rank_phases(c, layout_of(c, 2), 0)["step"]["activations"]
    assert acts["none"] > acts["selective"] > acts["full"] and acts["none"] > acts["sp"]
    assert rank_phases(base, layout_of(base, 2), 0)["step"]["activations"] == acts["none"]


def test_memory_from_a_config_prints_the_whole_rank(capsys, tmp_path):
    path = tmp_path / "plan.json"
    assert cli.main(["memory", "--config", "configs/ultramem_tiny.yaml", "--world-size", "2", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "whole rank on 2 CPU ranks: TP1 x PP1 x DP2" in out and "pipeline stage 0" in out
    doc = json.loads(path.read_text())
    step = doc["stages"]["0"]["phases"]["step"]
    assert doc["stages"]["0"]["totals"]["step"] == sum(step.values())
    assert step["tables"] > 0 and doc["peak"] == max(doc["stages"]["0"]["totals"].values())


@pytest.mark.parametrize(
    "extra, gib, note",
    [
        ([], 1.5, True),  # a CPU plan: this machine's 3 GiB of RAM and swap over the run's 2 ranks
        (["--device", "gpu"], 80, False),
        (["--gpu-mem-gib", "0.5"], 0.5, False),
    ],
)
def test_memory_from_a_config_is_held_against_the_rank_memory(capsys, tmp_path, monkeypatch, extra, gib, note):
    """Without --gpu-mem-gib a CPU plan is held against what rmt-train's start-up check gives a rank
    of a run on this machine, a GPU plan against an 80 GB GPU."""
    monkeypatch.setattr(rank_cli, "machine_memory", lambda: 3 * 2**30)
    path = tmp_path / "plan.json"
    argv = ["memory", "--config", "configs/tiny.yaml", "--world-size", "2", "--json", str(path), *extra]
    assert cli.main(argv) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    doc = json.loads(path.read_text())
    assert doc["gib"] == gib
    assert last == (
        f"fits {doc['gib']:.3g} GiB per rank" + (" (this machine's RAM and swap over the run's ranks)" if note else "")
    )


def test_memory_from_a_config_without_tables(capsys):
    assert (
        cli.main(
            ["memory", "--config", "configs/tiny.yaml", "--world-size", "2", "parallel.pipeline_model_parallel_size=2"]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "pipeline stage 0" in out and "pipeline stage 1" in out and "memory table(s)" not in out


@pytest.mark.parametrize(
    "argv, match",
    [
        (
            ["memory", "--config", "configs/tiny.yaml", "--world-size", "3", "parallel.tensor_model_parallel_size=2"],
            "not divisible by tensor x pipeline",
        ),
        (["memory", "--config", "configs/tiny.yaml", "--world-size", "2", "--reserve-gib", "1"], "every byte"),
        (["layouts", "--config", "configs/tiny.yaml", "model.nonsense=1"], "nonsense"),
        (["layouts", "--config", "configs/tiny.yaml", "--gpus", "0"], "positive integer"),
    ],
)
def test_bad_input_exit_2_one_line(argv, match, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and match in err


def test_layout_search_lists_runnable_fitting_layouts_by_predicted_step_time():
    """Every layout listed validates and fits; the ranking is by the predicted step time, each
    layout's tokens per second its tokens over that time."""
    doc = search("configs/ultramem_tiny.yaml", [], 4, 80.0, device="cpu")
    assert doc["fitting"] and doc["rejected"] > 0 and doc["hardware"] == "H100 SXM 80GB"
    steps = [r["time"]["step_s"] for r in doc["fitting"]]
    assert steps == sorted(steps)
    for r in doc["fitting"]:  # configs/ultramem_tiny.yaml: 8 sequences of 128 per data-parallel rank
        assert r["time"]["tokens_per_s"] == pytest.approx(8 * r["layout"]["dp"] * 128 / r["time"]["step_s"])
    for r in doc["fitting"][:5]:
        c = with_vocabulary(validate(load_config("configs/ultramem_tiny.yaml", r["overrides"]), world_size=4))
        assert plan_rank(c, 4, "cpu")["peak"] == r["peak"] <= 80 * 2**30


def test_layout_search_offers_ultramem_v2_with_full_recompute_and_sequence_parallelism():
    """UltraMemV2 (a memory inside every layer) takes both switches: on 2 ranks the fitting
    layouts include full recompute, sequence parallelism and both together, and nothing is
    rejected but the pipeline splits the 2 layers cannot take."""
    doc = search("configs/ultramem_v2_tiny.yaml", [], 2, 80.0, device="cpu")
    layouts = [r["layout"] for r in doc["fitting"]]
    full = [x for x in layouts if x["recompute"] == "full"]
    sp = [x for x in layouts if x["sequence_parallel"]]
    assert full and sp and [x for x in full if x["sequence_parallel"]]
    assert list(doc["rejected_reasons"]) == [
        "model.num_layers (2) must be divisible by the number of pipeline stages (2 x virtual 2 = 4)"
    ]


@pytest.mark.parametrize(
    "memory",
    [
        ["memory.type=ultramem", "memory.placement='1:2'"],
        ["memory.type=ultramem_v2"],
        ["memory.type=pkm", "memory.placement='1:2'"],
        ["memory.type=moe", "memory.placement='1:2'"],
    ],
    ids=["ultramem", "ultramem_v2", "pkm", "skip-moe"],
)
def test_full_recompute_costs_the_dense_layers_only(memory):
    """Memory layers are never recomputed (their links are replayed): full recomputation costs
    the time of the same model's dense layers without them, while an MoE replacing the MLPs is
    recomputed."""
    full = ["train.recompute_granularity=full", "train.recompute_method=uniform", "train.recompute_num_layers=1"]

    def flops(overrides):
        config = with_vocabulary(validate(load_config("configs/tiny.yaml", full + overrides), world_size=1))
        return stage_time(config, layout_of(config, 1, "gpu"), load_profile("h100"), 0)["recompute_s"]

    assert flops(memory) == flops([]) > 0
    moe_mlp = ["memory.type=moe", "memory.moe_placement=mlp", "memory.placement=1-2", "memory.num_experts=4"]
    assert flops(moe_mlp) > flops([])


@pytest.mark.parametrize(
    "precision, device, said", [("bf16", "cpu", True), ("fp32", "cpu", False), ("bf16", "gpu", False)]
)
def test_memory_from_a_config_says_where_the_plan_falls_short(capsys, tmp_path, precision, device, said):
    """A bf16 plan on a CPU states the phases measured above and below it (rank.CPU_BF16_SHORTFALL,
    CPU_BF16_OVERSTATEMENT), in its lines and its JSON; no other plan claims a shortfall it was not
    measured with."""
    path = tmp_path / "plan.json"
    argv = ["memory", "--config", "configs/tiny.yaml", "--world-size", "1", "--device", device, "--json", str(path)]
    assert cli.main(argv + [f"train.precision={precision}"]) == 0
    out = capsys.readouterr().out
    doc = json.loads(path.read_text())
    assert ("known_shortfall" in doc) == said and ("measured above this plan" in out) == said
    if said:
        assert doc["known_shortfall"] == CPU_BF16_SHORTFALL
        assert doc["known_overstatement"] == CPU_BF16_OVERSTATEMENT
        assert "init up to +26%, step up to +5%, save up to +24%, load up to +36%; below it: save down to -23%" in out
