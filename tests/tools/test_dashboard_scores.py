"""The dashboard's OOD bars name the scores the OOD evaluation's config builds (no hand list): a score
added to conf/ood_score/ and to the evaluation's default choice gets its bars, `_members` variant
included, and a score of your own package comes in by name."""

from __future__ import annotations

import shutil

from dbsn.tools import dashboard
from tests.support.configs import CONF


def _ood_bar(sections) -> tuple[str, ...]:
    ood = next(s for s in sections if s.name == "OOD")
    return next(p for p in ood.panels if p.title.startswith("AUROC, noise")).metrics


def test_the_ood_bars_follow_the_configured_scores(tmp_path, monkeypatch):
    assert dashboard.ood_score_names() == [
        "entropy",
        "mutual_information",
        "max_probability",
        "max_logit",
        "max_logit_members",
        "energy",
        "energy_members",
        "mahalanobis",
        "gda",
        "knn",
        "vim",
        "odin",
        "odin_members",
    ]
    conf = tmp_path / "conf"
    shutil.copytree(CONF, conf)
    (conf / "ood_score" / "hot_energy.yaml").write_text(
        "hot_energy:\n  _target_: dbsn.evaluation.detection.EnergyScore\n  temperature: 10.0\n  members: mean_logits\n"
    )
    ood = conf / "evaluations" / "ood.yaml"
    ood.write_text(ood.read_text().replace("knn, vim, odin]", "knn, vim, odin, hot_energy]"))
    monkeypatch.setattr(dashboard, "CONF_DIR", conf)
    bars = _ood_bar(dashboard.sections(("noise",), ood_scores=("gram",)))
    assert bars[-4:] == (
        "ood/noise/odin_members/auroc",
        "ood/noise/hot_energy/auroc",
        "ood/noise/hot_energy_members/auroc",
        "ood/noise/gram/auroc",
    )
