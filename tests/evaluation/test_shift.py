"""The dataset-shift evaluation (dbsn.evaluation.shift): which corruptions it evaluates, and whether
it generates, on published and on missing files.
"""

from tests.support.fakedata import write_published


def test_published_files_win_over_generate_and_keep_all_fifteen_corruptions(tmp_path):
    """`evaluations.shift.generate=true` generates only where the folder has no files; on the
    published files the default is the 15 standard corruptions (frost included), on a generated
    set the 14 the generator makes."""
    from dbsn.data.shift import CORRUPTIONS, GENERATED_STANDARD
    from dbsn.evaluation.shift import DatasetShift

    published = tmp_path / "CIFAR-10-C"
    write_published(published)
    assert DatasetShift(generate=True).plan(published) == (False, list(CORRUPTIONS))
    assert "frost" in CORRUPTIONS and "frost" not in GENERATED_STANDARD and len(GENERATED_STANDARD) == 14
    assert DatasetShift(generate=True).plan(tmp_path / "empty") == (True, list(GENERATED_STANDARD))
    assert DatasetShift(generate=False).plan(tmp_path / "empty") == (False, list(CORRUPTIONS))  # then refused, naming files
    assert DatasetShift(generate=True, corruptions=["fog"]).plan(published) == (False, ["fog"])
