"""Run folders (dbsn.evaluation.runs): a run's method read from its resolved config, without Hydra."""

from __future__ import annotations

from dbsn.evaluation.runs import infer_method


def test_method_inference_without_hydra():
    assert infer_method({"_target_": "dbsn.methods.DBSN", "weights": {"_target_": "dbsn.methods.GaussianWeights"}}) == "fbn"
    assert infer_method({"_target_": "dbsn.methods.DBSN", "weights": {"_target_": "dbsn.methods.PointWeights"}}) == "dbsn"
    assert infer_method({"_target_": "dbsn.methods.MAP", "learn_structure": True, "weights": None}) == "map"
    assert infer_method({"_target_": "dbsn.methods.MAP", "learn_structure": False}) == "map_fixed"
    assert infer_method({"_target_": "dbsn.methods.MAP", "learn_structure": False,
                         "weights": {"_target_": "dbsn.methods.weights.MCDropoutWeights"}}) == "mc_dropout"
    assert infer_method({"_target_": "dbsn.methods.MAP", "weights": {"_target_": "dbsn.methods.GaussianWeights"}}) == "bbb"
    assert infer_method({"_target_": "dbsn.methods.DeepEnsemble", "member": {}}) == "deep_ensemble"
    assert infer_method({"_target_": "dbsn.methods.natgrad.VOGNMethod", "structure": "map"}) == "vogn"
    assert infer_method({"_target_": "dbsn.methods.natgrad.VOGNMethod", "structure": "dbsn"}) == "vogn_fbn"
    assert infer_method({"_target_": "dbsn.methods.natgrad.NEKFACMethod"}) == "nekfac"
    assert infer_method({"_target_": "my.pkg.Laplace"}) == "Laplace"
