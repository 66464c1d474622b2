"""rmt-eval: lm-evaluation-harness on the shipped local task, its numbers equal to rmt's own
log-likelihoods computed directly (every architecture and memory type), batched equal to
unbatched, generation equal to rmt's decoding, and the command end to end from a checkpoint."""

import json
import warnings

import pytest
import torch

pytest.importorskip("lm_eval")

import lm_eval  # noqa: E402

from rmt import parallel  # noqa: E402
from rmt.data.tokenizers import ByteTokenizer  # noqa: E402
from rmt.decoding import generate  # noqa: E402
from rmt.evaluation.cli import main, task_manager  # noqa: E402
from rmt.evaluation.harness import RMTLM  # noqa: E402

from conftest import fast_cases  # noqa: E402
from eval_models import MODELS, tiny_model  # noqa: E402

warnings.filterwarnings("ignore")

SCORED = ["rmt_local_mc", "rmt_local_cloze", "rmt_local_rolling"]
EOD = ByteTokenizer.eod


@pytest.fixture
def model_of():
    yield tiny_model
    parallel.destroy()


def evaluate(lm, tasks, limit=None):
    return lm_eval.simple_evaluate(
        model=lm,
        tasks=tasks,
        task_manager=task_manager([], defaults=False),
        log_samples=True,
        bootstrap_iters=0,
        limit=limit,
    )


def direct_logprob(model, tokens, n):
    """rmt's log-probability of the last ``n`` of ``tokens``, one forward pass of this row alone."""
    x = torch.tensor([tokens[:-1]])
    s = x.shape[1]
    logits = model(x, torch.arange(s)[None], torch.ones(s, s, dtype=torch.bool).triu(1)[None, None])
    logp = torch.log_softmax(logits[0, :, :257].float(), -1)[s - n :]
    target = torch.tensor(tokens[-n:])
    return float(logp.gather(-1, target[:, None]).sum()), bool(torch.equal(logp.argmax(-1), target))


def direct_rolling(model, text, max_length):
    """A document's log-probability in windows of ``max_length`` predictions, each window
    conditioned on the ``max_length`` tokens before its last prediction (lm-eval's definition)."""
    full = [EOD] + list(text.encode())
    n, total, start = len(full) - 1, 0.0, 0
    while start < n:
        end = min(start + max_length, n)  # predicts full[start + 1 : end + 1]
        first = max(0, end - max_length)
        total += direct_logprob(model, full[first : end + 1], end - start)[0]
        start = end
    return total


def samples_by_request(results, task):
    """``{request arguments: response}`` of a task's logged samples."""
    out = {}
    for sample in results["samples"][task]:
        for args, resp in zip(sample["arguments"], sample["resps"]):
            out[tuple(a if isinstance(a, str) else json.dumps(a, sort_keys=True) for a in args)] = resp[0]
    return out


@pytest.mark.parametrize("name", fast_cases(sorted(MODELS), {"rmt_ultramem"}))
def test_harness_equals_direct_logprobs(model_of, name):
    model, config = model_of(name)
    lm = RMTLM(model=model, config=config, tokenizer=ByteTokenizer(), batch_size=1)
    limit = None if name == "transformer" else 10  # every item once, the first ten for the others
    results = evaluate(lm, SCORED, limit)
    mc = samples_by_request(results, "rmt_local_mc")
    cloze = samples_by_request(results, "rmt_local_cloze")
    assert (len(mc), len(cloze)) == ((32 * 4, 24) if limit is None else (10 * 4, 10))
    for (context, continuation), answer in {**mc, **cloze}.items():
        tokens = list((context + continuation).encode())[-(config.model.seq_length + 1) :]  # the last that fit
        scored = len(continuation) + len(context) - len(context.rstrip())  # lm-eval scores a context's trailing spaces
        # exact: the harness's batch of one is the same forward pass as the direct one
        assert tuple(answer) == direct_logprob(model, tokens, scored), (context, continuation)
    rolling = samples_by_request(results, "rmt_local_rolling")
    assert len(rolling) == 8
    for (text,), total in rolling.items():
        assert total == direct_rolling(model, text, config.model.seq_length)
    # batched: rows padded together (the recurrent transformer's only with as many blocks)
    batched = evaluate(RMTLM(model=model, config=config, tokenizer=ByteTokenizer(), batch_size=7), SCORED, limit)
    for task in SCORED:
        got, want = samples_by_request(batched, task), samples_by_request(results, task)
        assert got.keys() == want.keys()
        for key in want:
            a, b = (got[key], want[key]) if task == "rmt_local_rolling" else (got[key][0], want[key][0])
            # fp32 GEMMs of other widths round differently: ~1e-6 per log-probability of
            # magnitude ~6 (one ulp ~5e-7), summed over at most ~100 tokens
            assert abs(a - b) <= 1e-4, (task, key, a, b)


@pytest.mark.parametrize(
    "name", fast_cases(["transformer", "rmt", "recurrent", "mixer_mixed_decay", "ultramem"], {"transformer"})
)
def test_generate_until_equals_rmt_decoding(model_of, name):
    model, config = model_of(name)
    results = {}
    for batch_size in (1, 5):
        lm = RMTLM(model=model, config=config, tokenizer=ByteTokenizer(), batch_size=batch_size)
        results[batch_size] = samples_by_request(evaluate(lm, ["rmt_local_gen"]), "rmt_local_gen")
    assert results[1] == results[5] and len(results[1]) == 24
    for (context, gen_kwargs), text in results[1].items():
        prompt = torch.tensor([list(context.encode())[-(config.model.seq_length - 8) :]])  # room for 8 new
        ids = generate(model, prompt, 8, 257, config.model.seq_length)[0, prompt.shape[1] :].tolist()
        ids = ids[: ids.index(EOD)] if EOD in ids else ids
        assert text == ByteTokenizer().detokenize(ids).split("\n")[0]


def test_cli_from_checkpoint(tmp_path, capsys):
    """rmt-eval on a trained checkpoint equals the model class on the same loaded model."""
    from rmt.generate import load_model

    from eval_models import train_tiny

    train_tiny(tmp_path, "transformer")
    out = tmp_path / "eval.json"
    assert (
        main(
            [
                "--checkpoint",
                str(tmp_path / "ckpt"),
                "--tasks",
                "rmt_local_mc,rmt_local_cloze",
                "--batch-size",
                "4",
                "--log-samples",
                "--json",
                str(out),
                "--bootstrap-iters",
                "0",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "rmt_local_mc" in printed and "acc" in printed
    saved = json.loads(out.read_text())
    model, loaded, _ = load_model(str(tmp_path / "ckpt"), [])
    try:
        lm = RMTLM(model=model, config=loaded, tokenizer=ByteTokenizer(), batch_size=4)
        again = evaluate(lm, ["rmt_local_mc", "rmt_local_cloze"])
    finally:
        parallel.destroy()
    for task in ("rmt_local_mc", "rmt_local_cloze"):
        assert saved["results"][task]["acc,none"] == again["results"][task]["acc,none"]
        got = samples_by_request(saved, task)
        assert got == {k: list(v) for k, v in samples_by_request(again, task).items()}


@pytest.mark.slow
@pytest.mark.parametrize(
    "argv,message",
    [
        (["--tasks", "no_such_task"], "unknown lm-eval task 'no_such_task'"),
        (["--tasks", "rmt_local", "--batch-size", "0"], "--batch-size and --max-gen-toks must be positive"),
        (["--tasks", " , "], "--tasks names no task"),
    ],
)
def test_cli_errors(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as err:
        main(["--checkpoint", str(tmp_path / "nothing")] + argv)
    assert err.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"rmt-eval: error: {message}") and err.count("\n") == 1, err
