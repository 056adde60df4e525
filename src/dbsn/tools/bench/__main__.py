from dbsn.tools.bench import main

main()
