"""An mkdocs hook: a fence whose info string names its file (```` ```python file=myext/x.py ````, which
docs/extending.md's tests read) is shown with that file name as its title (superfences' `title=`)."""

import re

FILE_FENCE = re.compile(r"^(?P<indent> *)(?P<fence>```+)(?P<lang>\w+) file=(?P<file>\S+)[ \t]*$", re.M)


def on_page_markdown(markdown: str, **_) -> str:
    return FILE_FENCE.sub(lambda m: f'{m["indent"]}{m["fence"]}{m["lang"]} title="{m["file"]}"', markdown)
