"""Command-line tools on top of the runtime: the paper's tables from run folders (`report`), the
W&B dashboard (`dashboard`), the all-methods comparison (`compare`), the refinement experiment
(`refine`) and the speed benchmarks (`bench`). The runtime reaches them only through
`dbsn.runtime.reports`."""
