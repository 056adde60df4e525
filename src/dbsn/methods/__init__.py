"""Methods: LightningModules that join a network with a distribution and own loss and optimisers.

Every `model=` config builds one of these classes: `DBSN` (q(α ∣ θ) sampled; FBN with
`GaussianWeights`), `MAP` (softmax(θ) or a fixed uniform α; MC dropout and BBB with their weight
posteriors), `DeepEnsemble`, the natural-gradient `VOGNMethod` and `NEKFACMethod`, `CSGMCMC` and
`StructureCSGMCMC`, and the field's `SNGP`, `MIMO`, `BatchEnsemble`, `PackedEnsemble`, `Rank1BNN`,
`DDU` and `Masksembles`. Segmentation (`task: segmentation`): fcdensenet67 /
fcdensenet67_mc_dropout (MAP on FCDenseNet) and dbsn_seg (DBSN on DBSNSegNet). A method differs
from DBSN only in how it treats the structure and the weights. Every config with its class,
structure and weights: the table of docs/methods.md.
"""

from dbsn.methods.base import Method
from dbsn.methods.batch_ensemble import BatchEnsemble
from dbsn.methods.dbsn import DBSN, BatchNormRecalibration
from dbsn.methods.ddu import DDU
from dbsn.methods.ensemble import DeepEnsemble
from dbsn.methods.features import FeaturesUnavailable
from dbsn.methods.map import MAP
from dbsn.methods.masksembles import Masksembles
from dbsn.methods.mimo import MIMO
from dbsn.methods.natgrad import NEKFACMethod, VOGNMethod
from dbsn.methods.packed import PackedEnsemble
from dbsn.methods.rank1_bnn import Rank1BNN
from dbsn.methods.settings import Compilation, Execution, Prediction, StructureOptimizer, WeightOptimizer
from dbsn.methods.sngp import SNGP
from dbsn.methods.step import NonFiniteLossError
from dbsn.methods.weights import GaussianWeights, MCDropoutWeights, PointWeights, WeightPosterior

__all__ = [
    "BatchEnsemble",
    "PackedEnsemble",
    "BatchNormRecalibration",
    "Compilation",
    "DBSN",
    "DDU",
    "DeepEnsemble",
    "Execution",
    "FeaturesUnavailable",
    "GaussianWeights",
    "MAP",
    "Masksembles",
    "MCDropoutWeights",
    "MIMO",
    "Method",
    "NEKFACMethod",
    "NonFiniteLossError",
    "PointWeights",
    "Prediction",
    "Rank1BNN",
    "SNGP",
    "StructureOptimizer",
    "VOGNMethod",
    "WeightOptimizer",
    "WeightPosterior",
]
