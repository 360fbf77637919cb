from aiayn.cli import main

main()
