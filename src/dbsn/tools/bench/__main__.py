from dbsn.tools.bench import cli

cli()
