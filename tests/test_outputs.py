"""Every place a command writes is checked before it works (rmt.outputs): a parent that is a
file, a read-only directory (as another user when the tests run as root: permission bits do not
bind root), a path under /proc and a file system without room are one sentence and exit status
2, with nothing written; JSON is written whole or not at all; the benchmarks' reports share one
envelope (rmt.bench_report)."""

import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from rmt.bench_report import check_report, machine, write_report
from rmt.errors import UserError
from rmt.outputs import check_output, output_problem, write_json

from conftest import ROOT, _env, load_script, tiny_overrides

BENCHES = sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, "tools", "bench_*.py")))
PROC = "/proc/rmt-output-test/out"


def test_a_parent_that_is_a_file(tmp_path):
    (tmp_path / "f").write_text("")
    for directory in (False, True):
        assert output_problem(str(tmp_path / "f" / "a" / "b"), "--out", directory=directory) == (
            f"--out '{tmp_path}/f/a/b' cannot be created: '{tmp_path}/f' is a file, not a directory"
        )
    assert os.listdir(tmp_path) == ["f"]


def test_a_virtual_file_system_and_the_kind_of_an_existing_path(tmp_path):
    assert output_problem(PROC, "--json").startswith(
        f"--json '{PROC}' cannot be written: no file can be created in '/proc' ("
    )
    assert output_problem(str(tmp_path), "--json") == f"--json '{tmp_path}' is a directory; --json names a file"
    (tmp_path / "f").write_text("kept")
    assert output_problem(str(tmp_path / "f"), "train.save", directory=True) == (
        f"train.save '{tmp_path}/f' is a file; train.save names a directory"
    )
    assert output_problem(str(tmp_path / "f"), "--json") is None  # to be replaced
    assert output_problem(str(tmp_path / "new" / "dir"), "train.save", directory=True) is None
    assert sorted(os.listdir(tmp_path)) == ["f"] and (tmp_path / "f").read_text() == "kept"


def test_room_for_what_the_command_predicts(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    assert output_problem(str(tmp_path / "x"), "--out", need=free // 2, directory=True) is None
    problem = output_problem(str(tmp_path / "x"), "--out", need=2**60, directory=True, hint="free some")
    assert problem.startswith(
        f"not enough free space for --out '{tmp_path}/x': it needs about 1,099,511,627,776.0 MiB, "
        f"the file system of '{tmp_path}' has "
    )
    assert problem.endswith(" MiB free (free some)")
    with pytest.raises(UserError, match="^not enough free space for --out "):
        check_output(str(tmp_path / "x"), "--out", need=2**60, directory=True)


def test_write_json_is_whole_or_absent(tmp_path):
    path = tmp_path / "doc.json"
    write_json(str(path), {"a": [1, 2]})
    assert json.loads(path.read_text()) == {"a": [1, 2]}
    with pytest.raises(TypeError):
        write_json(str(path), {"b": object()})  # fails midway: the old document stays, no temporary
    assert json.loads(path.read_text()) == {"a": [1, 2]} and os.listdir(tmp_path) == ["doc.json"]


def test_bench_report_envelope(tmp_path, capsys):
    path = tmp_path / "r.json"
    write_report(str(path), "bench_x", [{"n": 1}], {"s": 2.0}, machine(threads=3), config="c")
    doc = json.loads(path.read_text())
    assert list(doc) == ["benchmark", "machine", "config", "rows", "summary"]
    assert doc["benchmark"] == "bench_x" and doc["rows"] == [{"n": 1}] and doc["summary"] == {"s": 2.0}
    assert doc["machine"]["threads"] == 3 and doc["machine"]["cpus"] == os.cpu_count()
    write_report(None, "bench_x", [], {})  # no --json: nothing
    check_report(None, "bench_x")
    (tmp_path / "f").write_text("")
    with pytest.raises(SystemExit) as stop:
        check_report(str(tmp_path / "f" / "r.json"), "bench_x")
    assert stop.value.code == 2
    assert capsys.readouterr().err == (
        f"bench_x: error: --json '{tmp_path}/f/r.json' cannot be created: '{tmp_path}/f' is a file, not a directory\n"
    )


@pytest.mark.parametrize("bench", BENCHES)
def test_every_bench_checks_its_json_before_it_runs(bench, tmp_path, capsys):
    """Each benchmark stops on a --json below a file and one under /proc at once, before it
    measures anything (a measurement would take seconds to hours), and writes nothing."""
    main = load_script(f"tools/{bench}.py").main
    (tmp_path / "f").write_text("")
    for path, sentence in [
        (f"{tmp_path}/f/out.json", f"--json '{tmp_path}/f/out.json' cannot be created: '{tmp_path}/f' is a file"),
        (PROC, f"--json '{PROC}' cannot be written: no file can be created in '/proc' ("),
    ]:
        with pytest.raises(SystemExit) as stop:
            main(["--json", path])
        assert stop.value.code == 2
        (line,) = capsys.readouterr().err.splitlines()
        assert line.startswith(f"{bench}: error: {sentence}")
    assert os.listdir(tmp_path) == ["f"]


def test_rmt_train_checks_each_output_before_building_anything(tmp_path):
    """``train.save`` on every rank; ``train.log_file``, ``train.tensorboard_dir`` and ``--json``
    on global rank 0, which writes them."""
    from rmt.config import load_config
    from rmt.training.cli import check_outputs

    (tmp_path / "f").write_text("")
    below = f"{tmp_path}/f/x"
    for key, json_path in [("train.save", None), ("train.log_file", None), ("train.tensorboard_dir", None)]:
        config = load_config(None, [f"{key}={below}"])
        with pytest.raises(UserError) as err:
            check_outputs(config, json_path, eval_only=False)
        assert str(err.value) == f"{key} '{below}' cannot be created: '{tmp_path}/f' is a file, not a directory"
    with pytest.raises(UserError, match=f"^--json '{below}' cannot be created"):
        check_outputs(load_config(None, []), below, eval_only=False)
    check_outputs(load_config(None, [f"train.log_file={below}"]), None, eval_only=True)  # evaluation logs nothing


@pytest.fixture
def open_dir():
    """A directory every user can reach (pytest's tmp_path is private to its owner)."""
    path = tempfile.mkdtemp(prefix="rmt_open_")
    os.chmod(path, 0o777)
    yield Path(path)
    shutil.rmtree(path, ignore_errors=True)


def _as_another_user(env):
    """The command prefix that runs as a user without root's permissions (user 65534 when these
    tests run as root); skips when that user cannot import rmt from here."""
    if os.geteuid() != 0:
        return []
    nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    probe = subprocess.run(nobody + [sys.executable, "-c", "import rmt"], cwd=ROOT, env=env, capture_output=True)
    if probe.returncode:
        pytest.skip(f"running as root and user 65534 cannot import rmt from {ROOT} (a private clone directory)")
    return nobody


def _commands(cache, inputs):
    """``(prog, argv without the output, [(how the output is given, its name)])`` per command;
    rmt-train's outputs take turns (each is checked below a file in process, above)."""
    return [
        (
            "rmt-train",
            [sys.executable, "-m", "rmt.training.cli"] + tiny_overrides(cache),
            [
                (lambda p: ["--json", p], "--json"),
                (lambda p: [f"train.save={p}"], "train.save"),
                (lambda p: [f"train.tensorboard_dir={p}"], "train.tensorboard_dir"),
            ],
        ),
        (
            "rmt-preprocess",
            [sys.executable, "-m", "rmt.data.preprocess", "--input", inputs],
            [(lambda p: ["--output-prefix", p], "--output-prefix")],
        ),
        (
            "rmt-export",
            [sys.executable, "-m", "rmt.export.cli", "--checkpoint", "none"],
            [(lambda p: ["--out", p], "--out")],
        ),
        (
            "rmt-eval",
            [sys.executable, "-m", "rmt.evaluation.cli", "--checkpoint", "none", "--tasks", "rmt_local"],
            [(lambda p: ["--json", p], "--json")],
        ),
        (
            "rmt-generate",
            [sys.executable, "-m", "rmt.generate", "--checkpoint", "none"],
            [(lambda p: ["--json", p], "--json")],
        ),
        (
            "rmt-plan comm",
            [sys.executable, "-m", "rmt.planner.cli", "comm", "--tokens", "64", "--topm", "4", "--v-dim", "8"]
            + ["--group-size", "2"],
            [(lambda p: ["--json", p], "--json"), (lambda p: ["--plot", p], "--plot")],
        ),
        (
            "rmt-plan calibrate",
            [sys.executable, "-m", "rmt.planner.cli", "calibrate", "--quick"],
            [(lambda p: ["--out", p], "--out")],
        ),
        (
            "bench_optimizer",
            [sys.executable, "tools/bench_optimizer.py", "--quick"],
            [(lambda p: ["--json", p], "--json")],
        ),
    ]


@pytest.mark.slow
def test_every_command_refuses_an_output_it_cannot_write(cache_dir, open_dir):
    """Each command in a real process, as a user root's permissions do not help: an output below
    a file, in a read-only directory and under /proc is one sentence and exit status 2, and
    nothing is written."""
    cache = open_dir / "cache"
    shutil.copytree(cache_dir, cache)
    for folder, dirs, files in os.walk(cache):
        for name in dirs + files:
            os.chmod(os.path.join(folder, name), 0o777)
    os.chmod(cache, 0o777)
    (open_dir / "in.txt").write_text("some text\n")
    (open_dir / "file").write_text("")
    readonly = open_dir / "ro"
    readonly.mkdir()
    os.chmod(readonly, 0o555)
    env = dict(_env(), HOME=str(open_dir))
    user = _as_another_user(env)
    for prog, cmd, outputs in _commands(str(cache), str(open_dir / "in.txt")):
        for i, (path, sentence) in enumerate(
            [
                (
                    f"{open_dir}/file/out",
                    f"'{open_dir}/file/out' cannot be created: '{open_dir}/file' is a file",
                ),
                (f"{readonly}/out", f"'{readonly}/out' cannot be written: no file can be created in '{readonly}' ("),
                (PROC, f"'{PROC}' cannot be written: no file can be created in '/proc' ("),
            ]
        ):
            given, what = outputs[i % len(outputs)]
            sentence = f"{what} {sentence}"
            proc = subprocess.run(user + cmd + given(path), cwd=ROOT, env=env, capture_output=True, text=True)
            lines = [line for line in proc.stderr.splitlines() if line.strip()]
            assert proc.returncode == 2 and len(lines) == 1, (prog, path, proc.stderr[-3000:])
            assert lines[0].startswith(f"{prog}: error: {sentence}"), lines[0]
    assert os.listdir(readonly) == [] and sorted(os.listdir(open_dir)) == ["cache", "file", "in.txt", "ro"]
