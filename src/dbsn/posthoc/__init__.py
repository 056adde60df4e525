"""What is fitted after training, on top of a finished run: temperature scaling
(`temperature`), and the post-hoc posteriors `evaluate.py posthoc=...` evaluates as methods of
their own: a last-layer Laplace approximation (`laplace`) and SWAG (`swag`)."""

POSTHOC = ("laplace", "swag")  # the `posthoc=` choices, and those methods' names in reports and on W&B
