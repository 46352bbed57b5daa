from kvlab.cli.commands import main

main()
