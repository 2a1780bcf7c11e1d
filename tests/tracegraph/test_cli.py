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


def test_show_says_why_traces_were_new_and_converges_after_three_covered_steps(tmp_path, capsys):
    index = (
        "argument 2 (index) of aten::select at variable_length_rnn.py:29 was 1, the graph has 0 "
        "(a Python scalar that varies)"
    )
    main(["show", f"{SCRIPT}:train_step", "-n", "6", "-o", str(tmp_path / "a.dot")])
    out = capsys.readouterr().out
    assert "new -> merged: the first trace: the graph was empty" in out
    assert f"new -> merged: {index}" in out
    main(["show", f"{SCRIPT}:train_step", "-n", "4", "-o", str(tmp_path / "b.dot")])
    out = capsys.readouterr().out  # two covered steps after the new ones: not yet
    assert (
        "not converged after 4 steps (converged: 3 covered steps in a row at the end); reasons: "
        f"step 0: the first trace: the graph was empty; step 1: {index}"
    ) in out


TRAINING_SCRIPT = '''\
import sys

import torch

import coexec


def main() -> None:
    torch.manual_seed(0)
    w = torch.randn(4, 1, requires_grad=True)
    odd = int(sys.argv[1])
    tape = coexec.GradientTape(backend="interpret")  # (its traces and fallbacks are reported)
    for step in range(100):
        n = 5 if step == odd else 8
        with tape:
            x = torch.ones(n, 4)
            loss = (x @ w).pow(2).mean()
            loss.backward()
            with torch.no_grad():
                w.sub_(w.grad * 0.1)
            w.grad = None
        print(f"loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
'''


def test_record_watches_the_tapes_of_a_script_run_as_main(tmp_path, capsys):
    script = tmp_path / "train_loop.py"
    script.write_text(TRAINING_SCRIPT)
    assert main(["show", "--record", str(script), "--steps", "6", "--", "2"]) == 0
    out = capsys.readouterr().out
    size = (
        "argument 0 (size) of aten::ones at train_loop.py:16 was [5, 4], the graph has [8, 4] "
        "(a size that varies)"
    )
    report = out[out.index("stopped after") :].splitlines()
    assert report == [
        "stopped after 6 steps (--steps 6)",
        f"with at {tmp_path.name}/train_loop.py:15 (main):",
        "  step   0  tracing  new trace: the first trace: the graph was empty",
        "  step   1  tracing  covered: co-executes from the next step",
        f"  step   2  coexec   fell back: {size}",
        "  step   3  coexec   covered",
        "  step   4  coexec   covered",
        "  step   5  coexec   covered",
        "  converged at step 3",
    ]
    assert out.count("loss ") == 5  # the script ran; the sixth step stopped it
    # the fallback two steps before the end: not converged
    main(["show", "--record", str(script), "--steps", "6", "--", "4"])
    out = capsys.readouterr().out
    assert out.rstrip().endswith(
        "  not converged after 6 steps (3 co-executed steps in a row without fallback needed); "
        f"reasons: step 0: the first trace: the graph was empty; step 4: {size}"
    )


NATIVE_SCRIPT = '''\
import torch

import coexec


def main() -> None:
    torch.manual_seed(0)
    w = torch.randn(4, 1, requires_grad=True)
    tape = coexec.GradientTape(backend="native")
    for step in range(100):
        with tape:
            x = torch.ones(8, 4)
            h = x @ w
            if step == 5:
                h = h.sin()
            loss = h.pow(2).mean()
            loss.backward()
            with torch.no_grad():
                w.sub_(w.grad * 0.1)
            w.grad = None
        print(f"loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
'''


def test_record_reports_the_native_backends_traces(tmp_path, capsys):
    from executor import native

    if native.wait() is None:
        pytest.skip("the native module is not available")
    script = tmp_path / "native_loop.py"
    script.write_text(NATIVE_SCRIPT)
    assert main(["show", "--record", str(script), "--steps", "12"]) == 0
    out = capsys.readouterr().out
    report = out[out.index("stopped after") :].splitlines()
    assert report[:3] == [
        "stopped after 12 steps (--steps 12)",
        f"with at {tmp_path.name}/native_loop.py:11 (main):",
        "  step   0  coexec   new trace: the first trace: the graph was empty",
    ]
    # steps 1-3 traced and covered; step 5, untraced, took a new branch (ops called from a line
    # no traced step had), which the traced steps after it look for in vain
    untraced = (
        "new path, not traced: it called ops from a line no traced step had (a branch not traced yet), "
        "and it was not traced: the steps after it are, until one meets such a line"
    )
    assert report[3:] == [f"  step {i:>3}  coexec   covered" for i in range(1, 5)] + [
        f"  step   5  coexec   {untraced}"
    ] + [f"  step {i:>3}  coexec   covered" for i in range(6, 12)] + ["  converged at step 6"]
