from prepkit.cli import main

main()
