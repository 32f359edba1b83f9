from qkit.cli import main

main()
