"""``python -m tracegraph show`` and the DOT export."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tracegraph.__main__ import main

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "variable_length_rnn.py"


def test_show_prints_a_summary_and_writes_dot(tmp_path, capsys):
    dot = tmp_path / "rnn.dot"
    assert main(["show", f"{SCRIPT}:train_step", "-n", "6", "-o", str(dot)]) == 0
    out = capsys.readouterr().out
    assert "recording 6 steps of train_step" in out
    assert "new traces: 2 of 6 steps; converged: every trace from step 2 on was covered" in out
    assert "loops" in out and "switches" in out and "fetch points" in out
    text = dot.read_text()
    assert text.startswith("digraph TraceGraph {") and text.rstrip().endswith("}")
    assert "body of loop" in text and "aten::lstm_cell" not in text  # ATen level, decomposed


@pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz not installed")
def test_dot_output_is_valid_graphviz(tmp_path):
    dot = tmp_path / "g.dot"
    main(["show", str(SCRIPT), "-n", "3", "-o", str(dot)])
    res = subprocess.run(["dot", "-Tsvg", str(dot)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert "<svg" in res.stdout


def test_show_explains_a_missing_function(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["show", f"{SCRIPT}:no_such_fn"])
    err = capsys.readouterr().err
    assert "defines no function 'no_such_fn'" in err and "train_step" in err


def test_show_explains_a_missing_script(capsys):
    with pytest.raises(SystemExit):
        main(["show", "no/such/script.py"])
    assert "no such script" in capsys.readouterr().err


def test_module_entry_point_runs(tmp_path):
    res = subprocess.run(
        [sys.executable, "-m", "tracegraph", "show", str(SCRIPT), "-n", "2", "-o", str(tmp_path / "x.dot")],
        capture_output=True, text=True, cwd=tmp_path,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "DOT written to" in res.stdout
