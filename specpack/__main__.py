from specpack.cli import main

main()
