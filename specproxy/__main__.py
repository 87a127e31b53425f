from specproxy.cli import main

main()
