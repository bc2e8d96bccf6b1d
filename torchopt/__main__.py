from torchopt.cli import main

main()
