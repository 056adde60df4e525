"""The paper's refinement experiment: `python refine.py DBSN_CKPT [--members 10] [overrides...]`.

See dbsn.tools.refine: trains M fixed-structure networks on structures drawn from the DBSN posterior
and M networks sharing one structure, and reports both ensembles' test metrics.
"""

from dbsn.runtime.errors import one_line_errors
from dbsn.tools.refine import main

if __name__ == "__main__":
    one_line_errors(main)()
