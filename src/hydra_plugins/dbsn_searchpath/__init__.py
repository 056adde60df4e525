"""Hydra finds the config groups of dbsn's extensions (`dbsn.extensions`: installed packages'
`dbsn.extensions` entry points, and `DBSN_CONFIG_PATH`) after dbsn's own, in every app and every
compose, from a checkout or from an installed wheel."""

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin


class DbsnExtensions(SearchPathPlugin):
    """Appends each extension's config folder to Hydra's search path."""

    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        from dbsn.extensions import extension_dirs

        for folder in extension_dirs():
            search_path.append(provider="dbsn-extension", path=f"file://{folder}")
