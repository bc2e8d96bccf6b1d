"""What a DistributedDataParallel program needs per rank: `set_epoch`,
`no_sync()` while accumulating gradients, rank-0 guards for output, portable checkpoints."""

from __future__ import annotations

from libcst.metadata import PositionProvider, ScopeProvider

from torchopt.rewrite.metadata import ParentProvider

_DEPS = (PositionProvider, ScopeProvider, ParentProvider)
