"""The torchopt language server (`torchopt lsp`; needs the `torchopt-rewrite[lsp]` extra: pygls 2)."""
