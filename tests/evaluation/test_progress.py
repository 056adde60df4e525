"""Progress of the evaluation loops (dbsn.evaluation.progress): whole lines in a log file."""

from __future__ import annotations

import io

from tqdm.auto import tqdm

from dbsn.evaluation.progress import LineBar, progress


def test_a_loop_prints_a_line_at_start_every_tenth_and_end():
    out = io.StringIO()
    items = list(LineBar(range(20), desc="ood svhn", file=out))
    assert items == list(range(20))
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert lines[0] == "ood svhn: started, 20 steps"
    steps = [line.split(": ")[1].split(" |")[0] for line in lines[1:-1]]
    assert steps == [f"{n}/20" for n in range(2, 20, 2)]  # one line at every tenth, none at the end twice
    assert lines[-1].startswith("ood svhn: done, 20 steps in 0:00:0")


def test_an_update_loop_without_a_total_prints_after_every_s_seconds_and_closes_once():
    out = io.StringIO()
    with LineBar(total=None, desc="attack", file=out, every_s=0.0) as bar:
        bar.update(3)
        bar.update(2)
    bar.close()
    lines = out.getvalue().splitlines()
    assert (
        lines[0] == "attack: started"
        and lines[1].startswith("attack: 3 | elapsed")
        and lines[2].startswith("attack: 5 |")
    )
    assert sum(line.startswith("attack: done, 5 steps") for line in lines) == 1


def test_progress_is_tqdm_on_a_terminal_lines_in_a_file_and_silent_when_disabled(monkeypatch):
    monkeypatch.setattr("sys.stderr.isatty", lambda: False)
    assert isinstance(progress(range(3), desc="x"), LineBar)
    monkeypatch.setattr("sys.stderr.isatty", lambda: True)
    bar = progress(range(3), desc="x")
    assert isinstance(bar, tqdm)
    bar.close()
    off = progress(range(3), desc="x", enabled=False)
    assert isinstance(off, tqdm) and off.disable and list(off) == [0, 1, 2]
