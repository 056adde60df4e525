"""Methods: LightningModules that join a network with a distribution and own loss and optimisers.

| config        | class                         | structure            | weights                    |
|---------------|-------------------------------|----------------------|----------------------------|
| dbsn          | DBSN                          | q(α ∣ θ), sampled     | point                      |
| fbn           | DBSN(weights=GaussianWeights) | q(α ∣ θ), sampled     | Gaussian (BBB)             |
| map           | MAP(learn_structure=True)     | softmax(θ)            | point                      |
| map_fixed     | MAP(learn_structure=False)    | uniform 1/K           | point                      |
| mc_dropout    | MAP(weights=MCDropoutWeights) | softmax(θ)            | dropout 0.2, on at test    |
| bbb           | MAP(weights=GaussianWeights)  | softmax(θ)            | Gaussian (BBB)             |
| deep_ensemble | DeepEnsemble(members)         | each member's         | each member's              |
| vogn          | VOGNMethod(structure="map")   | softmax(θ)            | VOGN (diagonal GGN)        |
| vogn_fbn      | VOGNMethod(structure="dbsn")  | q(α ∣ θ), sampled     | VOGN (diagonal GGN)        |
| nekfac        | NEKFACMethod (VGG16-BN)       | none                  | NEK-FAC (Kronecker eigenbasis) |
| sngp          | SNGP (spectral norm, GP head) | softmax(θ)            | point; GP output layer (Laplace) |
| mimo          | MIMO (M = 3, one pass)        | softmax(θ)            | point, M inputs and M heads |
| batch_ensemble | BatchEnsemble (M = 4, one pass) | softmax(θ)          | point, rank-1 fast weights per member |
| packed_ensemble | PackedEnsemble (M = 4, α = 2, γ = 2, one pass) | softmax(θ) | point, M narrow networks in grouped channels |
| rank1_bnn     | Rank1BNN (M = 4, one pass of M) | softmax(θ)          | point; Gaussian rank-1 factors, a mixture of M |
| ddu           | DDU (spectral norm, leaky ReLU) | softmax(θ)          | point; OOD score: the GDA density `gda` |
| masksembles   | Masksembles (M = 4, one pass of M) | softmax(θ)       | point, M fixed channel masks   |

Segmentation (`task: segmentation`): fcdensenet67 / fcdensenet67_mc_dropout (MAP on FCDenseNet) and
dbsn_seg (DBSN on DBSNSegNet).
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
