"""What a run prints: each message once, and nothing the user cannot act on.

Hydra sends every log record to the console (the message alone: `conf/hydra/default.yaml`'s
`brief` format) and to the run's log file (`<run>/<train|evaluate>.log`, with time and logger).
`quiet_console()`, called when a command starts, takes away what would repeat or distract:

- Lightning's own console handlers (the `lightning` loggers print their records themselves and
  pass them on to Hydra's, so every INFO line appeared twice);
- Lightning's advertisements for its cloud products ("💡 Tip: ... litlogger / litmodels"), and its
  note that the trainer already has a model summary (ours, `summary_callback`);
- the deprecation warning Lightning's own `_pytree` module raises on every fit (a Lightning
  matter, nothing in this project or a user's run can change it).

`summary_callback()` is Lightning's model summary without its FLOPs column and total: Lightning
counts FLOPs only by running `example_input_array`, which no method here sets (a forward takes
structures too), so it printed "0 Total Flops" for every run. A run's real counts are in
metrics.json's `cost` (`dbsn.evaluation.cost`).
"""

from __future__ import annotations

import logging
import warnings

__all__ = ["quiet_console", "summary_callback"]

LIGHTNING_LOGGERS = ("lightning", "lightning.pytorch", "lightning.fabric")


#: Lightning's records that say nothing a user can act on: its product tips, and its note that the
#: trainer has a model summary already (`summary_callback`'s, on every run).
DROPPED = ("💡 Tip", "Trainer already configured with model summary callbacks")


class _NoTips(logging.Filter):
    """Drops Lightning's records that begin as one of `DROPPED`."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(DROPPED)


def quiet_console() -> None:
    """Each Lightning message once (through the handlers Hydra configured), no product tips, no
    `_pytree` deprecation warning, no warning for a learning rate that is a tensor. Without
    handlers on the root logger (no Hydra: tests, a notebook) Lightning keeps its own, so its
    messages still show. Calling it again changes nothing."""
    import lightning.pytorch  # noqa: F401 - its import adds the handlers taken away here

    if logging.getLogger().handlers:
        for name in LIGHTNING_LOGGERS:
            logger = logging.getLogger(name)
            for handler in [h for h in logger.handlers if type(h) is logging.StreamHandler]:
                logger.removeHandler(handler)
            logger.propagate = True
    tips = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    if not any(isinstance(f, _NoTips) for f in tips.filters):
        tips.addFilter(_NoTips())
    warnings.filterwarnings(
        "ignore",
        message=r".*isinstance\(treespec, LeafSpec\)` is deprecated",
        module=r"lightning\.pytorch\.utilities\._pytree",
    )
    # the learning-rate monitor copies each rate with torch.tensor(): a rate that is a tensor (every rate under
    # the CUDA graph, which the schedule writes in place) warned once per run
    warnings.filterwarnings(
        "ignore", message="To copy construct from a tensor", module=r"lightning\.pytorch\.callbacks\.lr_monitor"
    )


def _without_flops(summary_data: list[tuple[str, list[str]]]) -> list[tuple[str, list[str]]]:
    return [(name, column) for name, column in summary_data if name != "FLOPs"]


def summary_callback(rich: bool):
    """Lightning's model summary (rich: the table `RichModelSummary` draws) without FLOPs (module docstring)."""
    from lightning.pytorch.callbacks import ModelSummary, RichModelSummary
    from lightning.pytorch.utilities.model_summary.model_summary import get_human_readable_count

    class PlainSummary(ModelSummary):
        @staticmethod
        def summarize(
            summary_data,
            total_parameters,
            trainable_parameters,
            model_size,
            total_training_modes,
            total_flops,
            **summarize_kwargs,
        ):
            from lightning.pytorch.utilities.model_summary.model_summary import _format_summary_table
            from lightning.pytorch.utilities.rank_zero import rank_zero_info

            table = _format_summary_table(
                total_parameters,
                trainable_parameters,
                model_size,
                total_training_modes,
                total_flops,
                *_without_flops(summary_data),
            )
            rank_zero_info("\n" + "\n".join(line for line in table.splitlines() if "total flops" not in line.lower()))

    class RichSummary(RichModelSummary):
        @staticmethod
        def summarize(
            summary_data,
            total_parameters,
            trainable_parameters,
            model_size,
            total_training_modes,
            total_flops,
            **summarize_kwargs,
        ):
            from lightning.pytorch.utilities.model_summary.model_summary import get_formatted_model_size
            from rich import get_console
            from rich.table import Table

            data = _without_flops(summary_data)
            table = Table(header_style=summarize_kwargs.get("header_style", "bold magenta"))
            for name, _ in data:
                table.add_column(
                    name,
                    style="dim" if name == " " else None,
                    justify="right" if name in ("Params", "Params per Device", "In sizes", "Out sizes") else "left",
                )
            for row in zip(*(column for _, column in data)):
                table.add_row(*row)
            console = get_console()
            console.print(table)
            grid = Table.grid(expand=True)
            grid.add_column()
            for label, value in (
                ("Trainable params", get_human_readable_count(int(trainable_parameters))),
                ("Non-trainable params", get_human_readable_count(int(total_parameters - trainable_parameters))),
                ("Total params", get_human_readable_count(int(total_parameters))),
                ("Total estimated model params size (MB)", get_formatted_model_size(model_size)),
                ("Modules in train mode", total_training_modes["train"]),
                ("Modules in eval mode", total_training_modes["eval"]),
            ):
                grid.add_row(f"[bold]{label}[/]: {value}")
            console.print(grid)

    return RichSummary() if rich else PlainSummary()
