"""The layout suite behind `channels_last=auto`: every case runs, on the tiny network, and the
ratios are the medians' (the measurement itself is docs/performance.md's, not a test's)."""

from dbsn.tools.bench import main


def test_the_layout_suite_times_every_case_and_reports_their_ratios(tmp_path):
    result = main(
        [
            "--suite",
            "layout",
            "--net",
            "tiny",
            "--batch",
            "4",
            "--repeats",
            "1",
            "--json",
            str(tmp_path / "layout.json"),
        ]
    )
    seconds = result["seconds"]
    assert set(seconds) == {"contiguous fp32", "contiguous bf16", "channels_last fp32", "channels_last bf16"}
    assert all(value > 0 for value in seconds.values())
    for precision in ("fp32", "bf16"):
        assert (
            result["channels_last / contiguous"][precision]
            == seconds[f"channels_last {precision}"] / seconds[f"contiguous {precision}"]
        )
    assert (tmp_path / "layout.json").is_file()
