"""Trainer pieces in one process: loss with z-loss, parameter groups, LR schedule, clipping."""

import math

import pytest
import torch

from rmt import parallel
from rmt.config import load_config
from rmt.config_checks import validate


@pytest.fixture(scope="module")
def config():
    cfg = validate(
        load_config(
            None,
            [
                "model.vocab_size=300",
                "train.steps=100",
                "train.warmup_steps=10",
                "train.lr=1e-3",
                "train.min_lr_ratio=0.1",
            ],
        )
    )
    parallel.initialize(cfg)
    yield cfg
    parallel.destroy()


def test_lm_loss_with_z_loss_matches_formula(config):
    from rmt.training.loss import lm_loss

    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11, requires_grad=True)
    labels = torch.randint(0, 11, (2, 5))
    mask = torch.ones(2, 5)
    mask[1, 3:] = 0
    loss, ce = lm_loss(logits, labels, mask, z_loss=1e-2)
    lse = torch.logsumexp(logits, -1)
    ref_ce = ((lse - logits.gather(-1, labels[..., None])[..., 0]) * mask).sum() / mask.sum()
    ref = ref_ce + 1e-2 * (lse**2 * mask).sum() / mask.sum()
    torch.testing.assert_close(ce, ref_ce.detach())
    torch.testing.assert_close(loss, ref)
    loss.backward()
    grad = logits.grad.clone()
    logits.grad = None
    ref.backward()
    torch.testing.assert_close(grad, logits.grad)


def test_param_groups_exclude_norms_biases_embeddings(config):
    from rmt.models.build import build
    from rmt.training.optimizer import param_groups

    chunks = build(config)
    names = {id(p): n for n, p in chunks[0].named_parameters()}
    decay, no_decay = param_groups(chunks, config)
    assert decay["weight_decay"] == config.train.weight_decay and no_decay["weight_decay"] == 0.0
    decayed = {names[id(p)] for p in decay["params"]}
    assert decayed and all(
        n.endswith("weight") and "norm" not in n and "embedding" not in n and "output_layer" not in n for n in decayed
    )
    assert any("embedding" in names[id(p)] for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(names)


def test_warmup_then_cosine_schedule(config):
    from rmt.training.optimizer import build_scheduler

    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    sched = build_scheduler(opt, config)
    lrs = []
    for _ in range(101):
        lrs.append(opt.param_groups[0]["lr"])
        sched.step(1)
    assert lrs[0] == 0.0 and lrs[5] == pytest.approx(5e-4) and lrs[10] == pytest.approx(1e-3)
    mid = 1e-4 + 0.5 * (1e-3 - 1e-4) * (1 + math.cos(math.pi * 45 / 90))
    assert lrs[55] == pytest.approx(mid) and lrs[100] == pytest.approx(1e-4)


def test_clip_scales_every_gradient_to_max_norm(config):
    """:meth:`Optimizers.clip` scales dense, table and sparse table gradients by one factor."""
    from rmt.training.optimizer import Optimizers

    params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(4))]
    params[0].grad = torch.tensor([3.0, 0.0, 0.0])
    params[1].grad = torch.sparse_coo_tensor([[1]], [4.0], (4,))
    dense = type("Dense", (), {"chained_optimizers": [], "param_groups": []})()
    optimizers = Optimizers(dense, [torch.optim.SGD([params[0]], lr=1.0), torch.optim.SGD([params[1]], lr=1.0)])
    optimizers.clip(1.0, 5.0)
    assert torch.linalg.vector_norm(torch.cat([params[0].grad, params[1].grad.to_dense()])).item() == pytest.approx(
        1.0, abs=1e-5
    )
    optimizers.clip(2.0, 1.0)  # below the bound: unchanged
    assert params[0].grad.tolist() == pytest.approx([0.6, 0.0, 0.0], abs=1e-6)


def test_step_lines_printed_without_progress_bar(capsys):
    """``train.progress=false`` (batch jobs): the periodic step line still reaches stdout, and
    only on logging steps."""
    from rmt.training.trainer import _emit

    m = {
        "step": 20,
        "lm loss": 3.25,
        "loss": 3.25,
        "lr": 1e-3,
        "grad_norm": 0.5,
        "tokens_per_s": 1000.0,
        "val_loss": 3.5,
    }
    _emit(dict(m, step=19), None, None, None, False)
    assert capsys.readouterr().out == ""
    _emit(m, None, None, None, True)
    assert capsys.readouterr().out == (
        "step    20 loss 3.2500 val_loss 3.5000 lr 1.000e-03 grad_norm 0.500 tok/s 1000\n"
    )
    _emit(dict(m, tflops_per_gpu=412.5, mfu=0.417), None, None, None, True)
    assert capsys.readouterr().out.endswith("tok/s 1000 TFLOP/s/GPU 412 MFU 41.7%\n")


def test_the_trainer_is_told_the_model_flops_and_the_predicted_step(tmp_path, monkeypatch):
    """rmt.training.fit.step_prediction: the step's model FLOPs per token always (three times
    rmt-plan model's forward), and with a calibrated profile at its default path (here through
    $RMT_HARDWARE_PROFILE) that profile's peak and rmt-plan time's predicted step."""
    import json

    from rmt.config import load_config
    from rmt.planner.flops import plan_model
    from rmt.planner.hardware import load_profile
    from rmt.planner.profiles import PROFILES
    from rmt.planner.time import plan_time
    from rmt.training.fit import step_prediction

    config = load_config("configs/tiny.yaml", ["model.vocab_size=257"])
    monkeypatch.setenv("RMT_HARDWARE_PROFILE", str(tmp_path / "absent.json"))
    bare = step_prediction(config, 1, "cpu")
    assert bare["flops_per_token"] == 3 * plan_model(config)["flops_per_token"]
    assert bare["profile"] is bare["peak_flops"] is bare["predicted_step_s"] is None
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps(dict(PROFILES["a100"], name="a calibrated machine", device="cpu")))
    monkeypatch.setenv("RMT_HARDWARE_PROFILE", str(path))
    told = step_prediction(config, 1, "cpu")
    profile = load_profile(str(path))
    assert told["profile"] == "a calibrated machine" and told["peak_flops"] == profile.peak_flops["fp32"]
    assert told["predicted_step_s"] == plan_time(config, 1, profile)["step_s"]
