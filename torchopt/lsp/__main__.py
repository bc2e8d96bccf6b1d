from torchopt.lsp.server import main

main()
