"""CIFAR-10-C / CIFAR-100-C in the published layout (dbsn.data.shift.published): each severity's
rows, missing and corrupt files, unknown names, and the constants of the published sets.
Published-layout files are written tiny (`tests.support.fakedata.write_published`: 7 images per severity).
"""

import numpy as np
import pytest
import torch

from dbsn.data import shift
from dbsn.data.base import CorruptDatasetError, DatasetNotFoundError
from tests.support.fakedata import PER_SEVERITY, write_published


# ----- reader ----------------------------------------------------------------------------------
@pytest.mark.parametrize("severity", shift.SEVERITIES)
def test_each_severity_reads_its_own_rows_as_nchw(tmp_path, severity):
    arrays, labels = write_published(tmp_path / "CIFAR-10-C")
    images, y = shift.corrupted_split(tmp_path / "CIFAR-10-C", "fog", severity)
    rows = slice((severity - 1) * PER_SEVERITY, severity * PER_SEVERITY)
    assert images.dtype == torch.uint8 and images.shape == (PER_SEVERITY, 3, 32, 32)
    assert torch.equal(images, torch.from_numpy(arrays["fog"][rows].transpose(0, 3, 1, 2)))
    assert y.dtype == torch.int64 and torch.equal(y, torch.from_numpy(labels[rows].astype(np.int64)))


def test_missing_files_fail_early_naming_each_one(tmp_path):
    folder = tmp_path / "CIFAR-10-C"
    write_published(folder, corruptions=("gaussian_noise",))
    (folder / "labels.npy").unlink()
    with pytest.raises(DatasetNotFoundError) as error:
        shift.check_corrupted_files(folder, ["gaussian_noise", "fog", "snow"])
    message = str(error.value)
    for name in ("labels.npy", "fog.npy", "snow.npy"):
        assert str(folder / name) in message
    assert "gaussian_noise.npy" not in message and "3 file(s) missing" in message
    assert "zenodo.org/records/2535967" in message and "3555552" not in message  # the folder says CIFAR-10-C
    assert "python -m dbsn.data.shift" in message
    with pytest.raises(DatasetNotFoundError, match="labels.npy"):
        shift.corrupted_split(folder, "gaussian_noise", 1)


def test_a_folder_of_unknown_name_lists_both_published_sets(tmp_path):
    with pytest.raises(DatasetNotFoundError) as error:
        shift.check_corrupted_files(tmp_path / "nowhere", ["fog"])
    assert "2535967" in str(error.value) and "3555552" in str(error.value)


@pytest.mark.parametrize(
    "name, array, problem",
    [
        ("fog.npy", np.zeros((35, 32, 32, 3), np.float32), "uint8"),
        ("fog.npy", np.zeros((35, 3, 32, 32), np.uint8), r"\(5n, 32, 32, 3\)"),
        ("fog.npy", np.zeros((36, 32, 32, 3), np.uint8), "multiple"),
        ("fog.npy", np.zeros((30, 32, 32, 3), np.uint8), "30 rows but labels.npy has 35"),
        ("labels.npy", np.zeros(35, np.float64), "integer"),
        ("labels.npy", np.zeros((35, 1), np.uint8), "integer labels"),
        ("fog.npy", b"not an npy file", "cannot be read"),
    ],
)
def test_wrong_arrays_fail_with_corrupt_dataset_error(tmp_path, name, array, problem):
    write_published(tmp_path, corruptions=("fog",))
    if isinstance(array, bytes):
        (tmp_path / name).write_bytes(array)
    else:
        np.save(tmp_path / name, array)
    with pytest.raises(CorruptDatasetError, match=problem):
        shift.check_corrupted_files(tmp_path, ["fog"])
    with pytest.raises(CorruptDatasetError, match=name):
        shift.corrupted_split(tmp_path, "fog", 1)


def test_unknown_corruption_and_severity_are_refused(tmp_path):
    write_published(tmp_path)
    with pytest.raises(ValueError, match="unknown corruption 'fogg'"):
        shift.corrupted_split(tmp_path, "fogg", 1)
    with pytest.raises(ValueError, match="severity"):
        shift.corrupted_split(tmp_path, "fog", 6)


def test_constants_match_the_published_sets():
    assert len(shift.CORRUPTIONS) == 15 and len(shift.EXTRA_CORRUPTIONS) == 4
    assert set(shift.GENERATED_CORRUPTIONS) == set(shift.ALL_CORRUPTIONS) - {"frost", "spatter"}
    assert set(shift.PARAMETERS) == set(shift.GENERATED_CORRUPTIONS)
    assert all(len(values) == 5 for values in shift.PARAMETERS.values())
    assert shift.PUBLISHED["cifar10"].url == "https://zenodo.org/records/2535967/files/CIFAR-10-C.tar"
    assert shift.PUBLISHED["cifar100"].folder == "CIFAR-100-C"
