"""The compiler's work kept beside the run (`model.execution.compile.cache`), so that its next start is warm.

`torch.compile` spends minutes generating the kernels of a network's graphs (inductor: C++ on a CPU,
Triton on a GPU); a process that starts again -- a resumed run, a new run on a fresh machine -- would
spend them again. `torch.compiler.save_cache_artifacts()` serialises everything the compiler produced
or found in its caches in this process (graphs, kernels, autotuning results), and
`load_cache_artifacts` puts it back into the caches before anything compiles. `CompileCache`, a
Lightning callback, does both for a training run: it loads ``<run>/compile_cache.bin`` (or
``compile.cache_from``, an earlier run's file) when the fit is set up, before the first forward, and
writes the file after the first training step, the fifth (past a CUDA graph's capture), the first
validation, and the end of training and testing, whenever the set grew. A file that this torch cannot
read (corrupt, another version's) is noted and the run compiles cold; it never stops a run. The file
is written atomically (a temporary file renamed over it), so an interrupted write leaves the old one.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

from dbsn.runtime.rank import is_rank_zero

__all__ = ["CACHE_FILE", "CompileCache", "compile_cache_callbacks", "load_compile_cache", "save_compile_cache"]

#: the file in the run folder
CACHE_FILE = "compile_cache.bin"


def load_compile_cache(path: Path) -> int | None:
    """Load the compile cache in `path` into this process's compiler caches; its size in bytes, or
    None (with a printed Note) where the file cannot be read as one: the process then compiles cold."""
    try:
        data = Path(path).read_bytes()
        info = torch.compiler.load_cache_artifacts(data)
    except Exception as error:  # a torch that cannot read it must not stop the run
        info, data = None, b""
        reason = f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"
    else:
        reason = "not a compile cache this torch can read"
    if info is None:
        print(f"Note: {path} was not loaded ({reason}); compiling cold.", flush=True)
        return None
    return len(data)


def save_compile_cache(path: Path, larger_than: int = 0) -> int | None:
    """Write what the compiler produced or used in this process (`torch.compiler.save_cache_artifacts`)
    to `path`, atomically, if it holds more than `larger_than` bytes; the bytes written, or None."""
    saved = torch.compiler.save_cache_artifacts()
    if saved is None or len(saved[0]) <= larger_than:
        return None
    data = saved[0]
    path = Path(path)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as file:
            file.write(data)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(temporary, 0o666 & ~umask)  # a run's file like its others (mkstemp makes it private)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return len(data)


class CompileCache(Callback):
    """Load the run's compile cache when the fit is set up, save it as the compiler produces more (see
    the module docstring). ``folder``: the run folder; ``source``: a file to load when the folder
    holds none (``compile.cache_from``)."""

    #: training batches after which the cache is saved: the first compiles the training graphs, the
    #: fifth follows a CUDA graph's three warm-up steps and its capture
    SAVE_AFTER = (1, 5)

    def __init__(self, folder: Path, source: str | Path | None = None) -> None:
        self.path = Path(folder) / CACHE_FILE
        self.source = Path(source) if source else None
        self.loaded = False
        self.size = 0  # bytes in the file: a save replaces it only with more
        self.batches = 0
        self.validated = False

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.loaded:
            return
        self.loaded = True
        source = self.path if self.path.is_file() else self.source
        if source is None:
            return
        if not source.is_file():
            print(f"Note: model.execution.compile.cache_from={source} is not a file; compiling cold.", flush=True)
            return
        size = load_compile_cache(source)
        if size is not None and source == self.path:
            self.size = size  # the run's own file: kept until this process has at least as much

    def save(self) -> None:
        if not is_rank_zero():
            return
        written = save_compile_cache(self.path, self.size)
        if written is not None:
            self.size = written

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        self.batches += 1
        if self.batches in self.SAVE_AFTER:
            self.save()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.validated and not trainer.sanity_checking:
            self.validated = True
            self.save()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.save()

    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.save()


def compile_cache_callbacks(model: torch.nn.Module, folder: Path) -> list[CompileCache]:
    """A `CompileCache` for a model that compiles with ``compile.cache`` on (an ensemble's members
    too), else none."""
    from dbsn.methods import Execution

    for module in model.modules():
        execution = getattr(module, "execution", None)
        if isinstance(execution, Execution) and execution.compile.enabled and execution.compile.cache:
            return [CompileCache(folder, execution.compile.cache_from)]
    return []
