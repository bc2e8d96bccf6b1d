"""The torchopt language server (`torchopt lsp`; needs the `torchopt[lsp]` extra: pygls 2)."""
