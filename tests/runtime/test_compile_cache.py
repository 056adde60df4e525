"""The compile cache beside the run (`dbsn.runtime.compile_cache`): written atomically and only when
it grew, loaded before anything compiles, and a file this torch cannot read noted, never fatal."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dbsn.methods import DBSN, Compilation, Execution
from dbsn.nets import StructureNet
from dbsn.runtime.compile_cache import (
    CACHE_FILE,
    CompileCache,
    compile_cache_callbacks,
    load_compile_cache,
    save_compile_cache,
)


def _serialised(monkeypatch, data: bytes | None) -> None:
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: None if data is None else (data, None))


def test_a_save_writes_the_file_atomically_and_only_when_it_grew(tmp_path, monkeypatch):
    path = tmp_path / CACHE_FILE
    _serialised(monkeypatch, None)
    assert save_compile_cache(path) is None and not path.exists()  # nothing compiled (eager backends)
    _serialised(monkeypatch, b"abcd")
    assert save_compile_cache(path) == 4 and path.read_bytes() == b"abcd"
    _serialised(monkeypatch, b"xyz")
    assert save_compile_cache(path, larger_than=4) is None and path.read_bytes() == b"abcd"
    assert sorted(p.name for p in tmp_path.iterdir()) == [CACHE_FILE]  # no temporary file left


def test_a_file_this_torch_cannot_read_is_noted_and_the_run_compiles_cold(tmp_path, monkeypatch, capsys):
    path = tmp_path / CACHE_FILE
    path.write_bytes(b"not a cache")
    assert load_compile_cache(path) is None
    assert "was not loaded" in capsys.readouterr().out

    def broken(data):
        raise RuntimeError("another torch's format")

    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", broken)
    assert load_compile_cache(path) is None
    assert "RuntimeError: another torch's format" in capsys.readouterr().out


def test_the_callback_loads_the_runs_own_file_first_and_replaces_it_only_with_more(tmp_path, monkeypatch):
    loaded = []
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", lambda data: loaded.append(data) or object())
    earlier = tmp_path / "earlier.bin"
    earlier.write_bytes(b"earlier run")
    run = tmp_path / "run"
    run.mkdir()
    fresh = CompileCache(run, source=earlier)  # a new run: starts from the earlier run's file
    fresh.setup(None, None, "fit")
    assert loaded == [b"earlier run"] and fresh.size == 0
    (run / CACHE_FILE).write_bytes(b"own cache")
    resumed = CompileCache(run, source=earlier)  # a resumed run: its own file
    resumed.setup(None, None, "fit")
    resumed.setup(None, None, "validate")  # loaded once
    assert loaded[1:] == [b"own cache"] and resumed.size == 9
    _serialised(monkeypatch, b"less")
    resumed.on_train_batch_end(None, None, None, None, 0)  # the first batch: saves, if it grew
    assert (run / CACHE_FILE).read_bytes() == b"own cache"
    _serialised(monkeypatch, b"the compiled graphs and more")
    resumed.on_train_end(None, None)
    assert (run / CACHE_FILE).read_bytes() == b"the compiled graphs and more"


def test_a_run_that_compiles_with_the_cache_on_gets_the_callback(tmp_path):
    net = StructureNet(num_classes=5, num_nodes=3, cells_per_stage=1, num_stages=2, growth=4, stem_channels=8)
    for compile, expected in (
        (Compilation(), 0),
        (Compilation(enabled=True, backend="eager", cache=False), 0),
        (Compilation(enabled=True, backend="eager", cache_from="x.bin"), 1),
    ):
        method = DBSN(net, train_samples=2, dataset_size=10, execution=Execution(compile=compile))
        callbacks = compile_cache_callbacks(method, tmp_path)
        assert len(callbacks) == expected
    assert callbacks[0].path == tmp_path / CACHE_FILE and callbacks[0].source == Path("x.bin")
    torch._dynamo.reset()


@pytest.mark.slow
def test_a_saved_cache_makes_a_fresh_process_compile_warm(tmp_path, monkeypatch):
    # inductor on a tiny function: compiled with one cache folder, saved; then a fresh dynamo state and an
    # empty cache folder (a new machine) that only the loaded file fills
    from torch._dynamo.utils import counters

    def f(x):
        return (x.sin() * 2 + 1).relu().sum(1)

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "first"))
    torch._dynamo.reset()
    counters.clear()
    x = torch.randn(4, 8)
    expected = torch.compile(f, backend="inductor", dynamic=False)(x)
    assert counters["inductor"]["fxgraph_cache_miss"] >= 1
    assert save_compile_cache(tmp_path / CACHE_FILE) is not None

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "second"))
    torch._dynamo.reset()
    counters.clear()
    assert load_compile_cache(tmp_path / CACHE_FILE) is not None
    torch.testing.assert_close(torch.compile(f, backend="inductor", dynamic=False)(x), expected)
    assert counters["inductor"]["fxgraph_cache_hit"] >= 1 and counters["inductor"]["fxgraph_cache_miss"] == 0
    torch._dynamo.reset()
