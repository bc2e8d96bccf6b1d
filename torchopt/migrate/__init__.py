"""Batch migration of many git repositories (`torchopt migrate`): one pinned rule selection, a
`git apply`-able patch per repository (or, with --commit, a branch with one commit), a roll-up report
in Markdown and JSON, --resume, and a local or Ray executor. See docs/migrate.md."""
