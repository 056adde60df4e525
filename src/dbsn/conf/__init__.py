"""dbsn's Hydra config tree (train.yaml, evaluate.yaml and their groups), a package so that Hydra finds it
as `pkg://dbsn.conf` wherever dbsn is installed; code that reads its files uses `dbsn.CONF_DIR`."""
