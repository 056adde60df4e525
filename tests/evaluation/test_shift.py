"""The dataset-shift evaluation (dbsn.evaluation.shift): which corruptions it evaluates, and whether
it generates, on published and on missing files.
"""

import torch

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
    assert DatasetShift(generate=False).plan(tmp_path / "empty") == (
        False,
        list(CORRUPTIONS),
    )  # then refused, naming files
    assert DatasetShift(generate=True, corruptions=["fog"]).plan(published) == (False, ["fog"])


def test_the_intervals_of_the_shift_means_resample_every_corrupted_set_alike():
    from dbsn.evaluation.shift import _metrics, _resampled, shift_intervals, shift_summary
    from dbsn.evaluation.statistics import Statistics, intervals_of

    g = torch.Generator().manual_seed(0)
    labels = torch.randint(3, (200,), generator=g)
    sets = {(c, s): torch.log_softmax(s * torch.randn(200, 3, generator=g), 1) for c in ("a", "b") for s in (1, 2)}
    weights = Statistics(resamples=300).weights(200)
    resampled = [(s, _resampled(lp, labels, weights)) for (c, s), lp in sets.items()]
    for (_, rows), log_probs in zip(resampled, sets.values()):
        plain = _metrics(log_probs, labels)
        assert all(abs(float(rows[m][0]) - plain[m]) < 1e-6 for m in plain)
    intervals = shift_intervals(resampled, 0.95)
    means = shift_summary([{"corruption": c, "severity": s, **_metrics(lp, labels)} for (c, s), lp in sets.items()])
    assert set(intervals) == {k for k in means if k.startswith("shift/mean/")}
    for key, (low, high) in intervals.items():
        assert low <= means[key] + 1e-6 and means[key] <= high + 1e-6, key
    one = shift_intervals(resampled[:1], 0.95)  # one set: its own interval
    assert one["shift/mean/error"] == intervals_of({"e": resampled[0][1]["error"]}, 0.95)["e"]
