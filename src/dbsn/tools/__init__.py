"""Command-line tools on top of the runtime: the report's command line (`report`), the W&B
dashboard (`dashboard`), the all-methods comparison (`compare`), the refinement experiment
(`refine`) and the speed benchmarks (`bench`). Nothing below imports them."""
