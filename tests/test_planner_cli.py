"""rmt-plan: output, JSON schema, plot, exit status 2 on bad input, registry."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rmt.planner import cli

ROOT = Path(__file__).resolve().parents[1]
COMM = ["comm", "--tokens", "4096", "--topm", "32", "--v-dim", "64", "--group-size", "8"]


def run_module(*args):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "-m", "rmt.planner.cli", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )


def test_comm_table(capsys):
    assert cli.main(COMM) == 0
    out = capsys.readouterr().out
    assert "all_to_all_values" in out and "14,680,064" in out
    assert "all_gather_scores" in out and "1,835,008" in out
    assert "choice (forward): dimension-wise" in out


def test_comm_json_schema(tmp_path):
    path = tmp_path / "comm.json"
    assert cli.main(COMM + ["--json", str(path)]) == 0
    doc = json.loads(path.read_text())
    assert type(doc["number_bytes"]) is int and type(doc["dimension_bytes"]) is int
    assert doc["number_bytes"] == 4 * 4096 * 32 * 7 // 8 + 2 * 4096 * 32 * 64 * 7 // 8
    assert doc["dimension_bytes"] == 4 * 4096 * 32 * 7 + 2 * 4096 * 32 * 7 + 2 * 4096 * 64 * 7 // 8
    assert doc["choice"] == "dimension" and doc["phase"] == "forward"
    for part in ("number", "dimension"):
        vol = doc["collectives"][part]
        assert set(vol) == {"forward", "backward", "forward_total", "backward_total", "forward_backward_total"}
        assert all(type(v) is int for v in vol["forward"].values())
    assert doc["collectives"]["number"]["forward_total"] == doc["number_bytes"]


def test_comm_options_and_phase(tmp_path):
    path = tmp_path / "c.json"
    args = COMM + ["--owner-reduce", "--ive", "2", "--cores", "2", "--phase", "forward_backward", "--json", str(path)]
    assert cli.main(args) == 0
    doc = json.loads(path.read_text())
    assert "all_to_all_partial_sums" in doc["collectives"]["number"]["forward"]
    assert doc["number_bytes"] == doc["collectives"]["number"]["forward_backward_total"]
    assert cli.main(COMM + ["--dedup", "--slots", "1000000", "--json", str(path)]) == 0
    assert json.loads(path.read_text())["number_bytes"] < 458752 + 14680064


def test_comm_plot_png(tmp_path):
    png = tmp_path / "fig9.png"
    assert cli.main(COMM + ["--plot", str(png), "--plot-p-max", "16", "--plot-v-dim-max", "128"]) == 0
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000


def test_memory_ten_billion_slots(tmp_path, capsys):
    """10^10 slots (100,000^2) x 64 with row-wise Adagrad: the per-phase plan and the smallest
    group of 80 GiB ranks, with the numbers of rmt.planner.memory."""
    from rmt.planner.memory import TablePlan, min_group_size, phases

    path = tmp_path / "mem.json"
    argv = [
        "memory",
        "--slots",
        "10000000000",
        "--dim",
        "64",
        "--group-size",
        "64",
        "--value-optimizer",
        "rowwise_adagrad",
        "--tokens",
        "4096",
        "--json",
        str(path),
    ]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    plan = TablePlan(slots=10**10, dim=64, group_size=64, value_optimizer="rowwise_adagrad", tokens=4096)
    p_min = min_group_size(plan, 80 * 2**30)
    assert f"smallest group that fits: P={p_min} " in out and "a 156,250,000 x 64 shard per rank" in out
    doc = json.loads(path.read_text())
    assert doc["phases"] == phases(plan) and doc["min_group_size"] == p_min
    assert doc["checkpoint_bytes"] == 10**10 * (64 * 4 + 4)


def test_memory_from_a_config(capsys):
    """The table terms come from the config: UltraMem-1.6B-x12 has 6 memory layers of 1,792^2 slots
    of 1,024; on 64 ranks (one memory-parallel group) each holds 1/64 of each table."""
    assert (
        cli.main(
            [
                "memory",
                "--config",
                "configs/ultramem_1.6b_x12.yaml",
                "--world-size",
                "64",
                "memory.partition=number",
                "memory.value_optimizer=sparse_adam",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "6 memory table(s) of 3,211,264 slots (1,792^2) x 1024, fp32, sparse_adam, number-wise over P=64" in out
    assert "32 micro-batch(es) of 2,048 tokens, 2 heads x top-42" in out


@pytest.mark.parametrize(
    "argv, match",
    [
        (["comm", "--tokens", "-3", "--topm", "4", "--v-dim", "8", "--group-size", "2"], "positive integer"),
        (["comm", "--tokens", "3", "--topm", "0", "--v-dim", "8", "--group-size", "2"], "positive integer"),
        (COMM + ["--cores", "3"], "divisible"),
        (COMM + ["--slots", "16"], "cannot exceed"),
        (COMM + ["--dedup"], "needs exactly one"),
        (COMM + ["--frobnicate"], "unrecognized arguments"),
        (["comm", "--tokens", "3"], "required"),
        (["memory", "--slots", "64", "--dim", "4", "--group-size", "5"], "divisible by the group size"),
        (["memory", "--slots", "10", "--dim", "4"], "not a square"),
        (["memory", "--slots", "64", "--dim", "4", "--value-dtype", "int3"], "invalid choice"),
        (["memory", "--slots", "64", "--dim", "4", "--reserve-gib", "90"], "reserve"),
        (["memory", "--dim", "4"], "give --slots and --dim"),
        (["memory", "--config", "configs/ultramem_tiny.yaml"], "--world-size"),
        (
            [
                "memory",
                "--config",
                "configs/ultramem_tiny.yaml",
                "--world-size",
                "2",
                "memory.partition=number",
                "memory.group_size=3",
            ],
            "memory.group_size",
        ),
        (["memory", "--config", "configs/ultramem_tiny.yaml", "--slots", "64"], "come from the config"),
        ([], "required"),
    ],
)
def test_bad_input_exit_2_one_line(argv, match, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and match in err
    assert err.startswith("rmt-plan")


def test_subprocess_entry_point(tmp_path):
    ok = run_module(*COMM, "--json", str(tmp_path / "c.json"))
    assert ok.returncode == 0 and "choice" in ok.stdout
    for argv in (
        ["comm", "--tokens", "0", "--topm", "1", "--v-dim", "1", "--group-size", "1"],
        COMM + ["--bogus"],
        COMM + ["--cores", "5"],
    ):
        bad = run_module(*argv)
        assert bad.returncode == 2
        assert "Traceback" not in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


def test_help_documents_every_option(capsys):
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for name, subparser in sub.choices.items():
        assert cli.main([name, "--help"]) == 0
        text = capsys.readouterr().out
        for action in subparser._actions:
            assert action.help, (name, action.dest)
            for flag in action.option_strings:
                assert flag in text


def test_one_line_registration(monkeypatch, capsys):
    def add_arguments(p):
        p.add_argument("--layers", type=cli.positive_int, required=True, help="layers")

    def run(args):
        print(f"layers={args.layers}")
        return 0

    monkeypatch.setattr(cli, "SUBCOMMANDS", list(cli.SUBCOMMANDS))
    cli.SUBCOMMANDS.append(cli.Subcommand("example", "parameters and FLOPs", add_arguments, run))
    assert cli.main(["example", "--layers", "3"]) == 0
    assert "layers=3" in capsys.readouterr().out
    assert cli.main(["example", "--layers", "x"]) == 2


def test_comm_activation_bytes(capsys):
    """--activation-bytes prices the scores and pooled slices; the rows keep --value-bytes."""
    assert cli.main(COMM + ["--activation-bytes", "4"]) == 0
    out = capsys.readouterr().out
    assert "2 B/value, 4 B/score and pooled element" in out
    assert "14,680,064" in out  # all_to_all_values: 2 T K D (P-1)/P, unchanged
    assert "3,670,016" in out  # all_gather_scores: 4 T K (P-1), twice the bf16 figure


OUTPUTS = [
    (COMM, "--json"),
    (COMM, "--plot"),
    (["memory", "--slots", "64", "--dim", "4"], "--json"),
    (["memory", "--config", "configs/ultramem_tiny.yaml", "--world-size", "2"], "--json"),
    (["model", "--config", "configs/tiny.yaml"], "--json"),
    (["layouts", "--config", "configs/tiny.yaml", "--gpus", "2"], "--json"),
    (["time", "--config", "configs/tiny.yaml", "--world-size", "2"], "--json"),
    (["calibrate", "--quick"], "--out"),
]


@pytest.mark.parametrize("argv, flag", OUTPUTS, ids=[f"{a[0]}{f}" for a, f in OUTPUTS])
def test_every_output_is_checked_before_the_work(argv, flag, tmp_path, monkeypatch, capsys):
    """An output below a file or under /proc is one sentence and exit status 2 before the
    subcommand runs (its run fails here if called), and nothing is written."""

    def work(args):
        raise AssertionError("the subcommand ran")

    monkeypatch.setattr(cli, "SUBCOMMANDS", [c._replace(run=work) for c in cli.SUBCOMMANDS])
    (tmp_path / "f").write_text("")
    proc = "/proc/rmt-output-test/out"
    for path, sentence in [
        (
            f"{tmp_path}/f/out",
            f"{flag} '{tmp_path}/f/out' cannot be created: '{tmp_path}/f' is a file, not a directory",
        ),
        (proc, f"{flag} '{proc}' cannot be written: no file can be created in '/proc' ("),
    ]:
        assert cli.main(argv + [flag, path]) == 2
        (line,) = capsys.readouterr().err.splitlines()
        assert line.startswith(f"rmt-plan {argv[0]}: error: {sentence}"), line
    assert os.listdir(tmp_path) == ["f"]


def test_every_option_that_writes_is_checked():
    """The options whose help says they write a file are exactly the checked ones
    (:data:`cli.OUTPUT_OPTIONS`), in every subcommand; each is exercised above."""
    sub = next(a for a in cli.build_parser()._actions if a.dest == "command")
    for name, parser in sub.choices.items():
        for action in parser._actions:
            writes = action.help.startswith(("write ", "draw ", "where to write "))
            assert writes == (action.dest in cli.OUTPUT_OPTIONS), (name, action.dest)
            if writes:
                assert any(a[0] == name and f == action.option_strings[0] for a, f in OUTPUTS), (name, action.dest)


def test_the_json_outputs_are_written_whole(tmp_path):
    """Each subcommand's --json (and calibrate's profile) goes through rmt.outputs.write_json:
    the document, and no temporary beside it."""
    for argv, flag in OUTPUTS:
        if flag != "--json":
            continue
        path = tmp_path / f"{argv[0]}.json"
        assert cli.main(argv + ["--json", str(path)]) == 0, argv
        assert isinstance(json.loads(path.read_text()), dict)
    assert sorted(os.listdir(tmp_path)) == sorted({f"{a[0]}.json" for a, f in OUTPUTS if f == "--json"})
