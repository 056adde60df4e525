"""A damaged checkpoint is named, not loaded (dbsn.runtime.integrity, dbsn.runtime.checkpoint).

Every checkpoint train.py writes carries the SHA-256 of its tensors (`dbsn_digest`), recorded in
the same atomic write; every reader checks the zip's CRC-32s (which torch.load ignores) and the
digest before it uses the file. Each test damages a copy of one trained run's checkpoint the way a
bad copy would (one flipped byte in a weight's storage or in the pickle, a truncated file) and
checks that every entry point refuses it in one line, while a checkpoint written before digests
existed still loads and says which version wrote it.
"""

from __future__ import annotations

import struct

import pytest
import torch

import dbsn.runtime.run
from dbsn.runtime.build import init_weights, load_method
from dbsn.runtime.checkpoint import DIGEST_KEY, CheckpointError, checkpoint_digest, load_checkpoint
from dbsn.tools.refine import structures_from_checkpoint
from tests.support.configs import QUIET, ROOT, TINY, compose_config
from tests.support.damage import entry_span, flip_byte, pickle_entry, storage_entry
from tests.support.scripts import run_python

RUN = [
    "data=digits",
    "data.train_subset=64",
    "data.batch_size=32",
    *TINY,
    "trainer.max_epochs=1",
    "test=false",
    "callbacks.structure_posterior.save_figures=false",
    "callbacks.structure_posterior.n_samples=10",
]
WEIGHT = "net.classifier.weight"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A one-epoch run: its folder and its last.ckpt."""
    folder = tmp_path_factory.mktemp("run")
    dbsn.runtime.run.train(compose_config("train", RUN, folder), folder)
    return folder, folder / "checkpoints" / "last.ckpt"


def _weight_byte(ckpt) -> int:
    """The offset in the file of a byte in the middle of the classifier's weight storage."""
    weight = torch.load(ckpt, weights_only=False)["state_dict"][WEIGHT]
    start, size = entry_span(ckpt, storage_entry(ckpt, weight))
    return start + size // 2 + 1  # a float's middle byte: a real change of the value, not a rounding


@pytest.fixture(scope="module")
def tensor_damaged(run, tmp_path_factory):
    """The checkpoint with one byte of a weight flipped and the zip's CRC made to agree: only the digest tells."""
    folder, ckpt = run
    return flip_byte(ckpt, _weight_byte(ckpt), tmp_path_factory.mktemp("damaged") / "last.ckpt", agreeing_crc=True)


def test_every_checkpoint_carries_the_digest_of_all_its_tensors(run):
    raw = torch.load(run[1], weights_only=False)
    assert raw[DIGEST_KEY] == {"algorithm": "sha256", "tensors": checkpoint_digest(raw)}
    # the digest covers the weights, the optimisers' states and the callbacks' tensors
    for tensor_of in (
        lambda c: c["state_dict"][WEIGHT],
        lambda c: next(iter(c["optimizer_states"][0]["state"].values()))["momentum_buffer"],
        lambda c: c["callbacks"]["RandomStateCallback"]["torch"],
    ):
        changed = torch.load(run[1], weights_only=False)
        tensor = tensor_of(changed)
        tensor[(-1,) * tensor.dim()] += 1
        assert checkpoint_digest(changed) != raw[DIGEST_KEY]["tensors"]


def test_the_digest_reads_raw_bytes_of_any_dtype_and_layout():
    x = torch.randn(4, 6)
    assert checkpoint_digest({"w": x.t()}) == checkpoint_digest({"w": x.t().contiguous()})  # values, not strides
    half = x.bfloat16()
    other = half.clone()
    other.view(torch.int16)[0, 0] ^= 1  # the last bit of one bf16 number
    assert checkpoint_digest({"w": half}) != checkpoint_digest({"w": other})
    assert checkpoint_digest({"w": x}) != checkpoint_digest({"v": x})  # where a tensor sits counts
    assert checkpoint_digest({"w": torch.zeros(2)}) != checkpoint_digest({"w": torch.zeros(2, 1)})


@pytest.mark.slow
def test_a_flipped_byte_in_a_weight_is_refused_by_evaluate_in_one_line(run, tmp_path):
    damaged = flip_byte(run[1], _weight_byte(run[1]), tmp_path / "copy.ckpt")
    entry = storage_entry(run[1], torch.load(run[1], weights_only=False)["state_dict"][WEIGHT])
    done = run_python(
        ROOT / "evaluate.py", f"ckpt_path={damaged}", *QUIET, f"hydra.run.dir={tmp_path / 'out'}", check=False
    )
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1] == (
        f"Error: Checkpoint {damaged} is corrupt: its entry {entry} fails its CRC-32 check (the bytes changed after it "
        "was written). Do not use it: copy it again from where it was written, or use another checkpoint of the run "
        "(checkpoints/epoch*.ckpt)."
    )
    assert "Traceback" not in done.stderr


def test_torch_load_alone_would_use_the_damaged_weights(run, tensor_damaged):
    """Why the check is needed: the damaged file loads without a word, with another weight."""
    good = torch.load(run[1], weights_only=False)["state_dict"][WEIGHT]
    bad = torch.load(tensor_damaged, weights_only=False)["state_dict"][WEIGHT]
    assert not torch.equal(good, bad) and torch.isfinite(bad).all()


@pytest.mark.parametrize(
    "reader", ["load_checkpoint", "evaluate", "train ckpt_path", "train resume", "init_from", "load_method", "refine"]
)
def test_every_reader_refuses_tensors_that_do_not_match_their_digest(reader, run, tensor_damaged, tmp_path):
    folder, _ = run
    if reader == "train resume":  # the run folder's own last.ckpt, damaged
        (tmp_path / "checkpoints").mkdir()
        copy = tmp_path / "checkpoints" / "last.ckpt"
        copy.write_bytes(tensor_damaged.read_bytes())
        tensor_damaged = copy
    with pytest.raises(
        CheckpointError,
        match=rf"Checkpoint {tensor_damaged} is corrupt: its tensors do not match "
        r"the digest \(sha256\) its writer recorded\. Do not use it",
    ):
        if reader == "load_checkpoint":
            load_checkpoint(tensor_damaged)
        elif reader == "evaluate":
            dbsn.runtime.run.evaluate(
                compose_config("evaluate", [f"ckpt_path={tensor_damaged}", *QUIET], tmp_path), tmp_path
            )
        elif reader == "train ckpt_path":
            dbsn.runtime.run.train(compose_config("train", [*RUN, f"ckpt_path={tensor_damaged}"], tmp_path), tmp_path)
        elif reader == "train resume":
            dbsn.runtime.run.train(compose_config("train", [*RUN, "resume=true"], tmp_path), tmp_path)
        elif reader == "init_from":
            init_weights(load_method(folder / "checkpoints" / "last.ckpt", 10), tensor_damaged)
        elif reader == "load_method":
            load_method(tensor_damaged, 10)
        else:
            structures_from_checkpoint(tensor_damaged, n=2, seed=0)


def test_a_flipped_byte_in_the_pickle_is_refused(run, tmp_path):
    """A byte of the learning rate in the pickled optimiser state: torch.load takes it silently (a
    value changes, no tensor does, so the digest cannot tell), the zip's CRC-32 does not."""
    ckpt = run[1]
    original = torch.load(ckpt, weights_only=False)
    lr = original["optimizer_states"][0]["param_groups"][0]["lr"]
    start, size = entry_span(ckpt, pickle_entry(ckpt))
    position = ckpt.read_bytes()[start : start + size].index(b"G" + struct.pack(">d", lr))  # BINFLOAT, big-endian
    damaged = flip_byte(ckpt, start + position + 8, tmp_path / "copy.ckpt")  # the mantissa's last byte
    loaded = torch.load(damaged, weights_only=False)
    assert checkpoint_digest(loaded) == original[DIGEST_KEY]["tensors"]
    assert loaded["optimizer_states"][0]["param_groups"] != original["optimizer_states"][0]["param_groups"]
    with pytest.raises(CheckpointError, match=r"data\.pkl fails its CRC-32 check"):
        load_checkpoint(damaged)
    # and with a CRC that agrees, where the byte breaks the pickle, torch's own error is named
    broken = flip_byte(ckpt, start + 1, tmp_path / "broken.ckpt", agreeing_crc=True)
    with pytest.raises(CheckpointError, match=r"Could not read checkpoint .*broken\.ckpt .*corrupt"):
        load_checkpoint(broken)


def test_a_truncated_checkpoint_is_refused(run, tmp_path):
    data = run[1].read_bytes()
    for size in (len(data) // 2, len(data) - 10):
        (tmp_path / "cut.ckpt").write_bytes(data[:size])
        with pytest.raises(CheckpointError, match="cut.ckpt is corrupt: it is not a whole zip file"):
            load_checkpoint(tmp_path / "cut.ckpt")


def test_a_checkpoint_written_before_digests_loads_and_says_which_version_wrote_it(run, tmp_path, capsys):
    old = {k: v for k, v in torch.load(run[1], weights_only=False).items() if k != DIGEST_KEY}
    old["dbsn_version"] = "0.0.9"
    torch.save(old, tmp_path / "old.ckpt")
    method = load_method(tmp_path / "old.ckpt", 10)
    assert torch.equal(method.state_dict()[WEIGHT], old["state_dict"][WEIGHT])
    load_checkpoint(tmp_path / "old.ckpt")  # said once per file
    assert capsys.readouterr().err.splitlines() == [
        f"Note: {tmp_path / 'old.ckpt'} was written by dbsn 0.0.9, before checkpoints carried a digest of their "
        "tensors: loaded without checking its content."
    ]
