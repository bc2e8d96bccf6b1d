"""Display-only advice for DistributedDataParallel programs."""
from __future__ import annotations

from libcst.metadata import PositionProvider, ScopeProvider

from torchopt.rewrite.metadata import ParentProvider

_DEPS = (PositionProvider, ScopeProvider, ParentProvider)
_H = ("import torch\nimport torch.nn as nn\nfrom torch.nn.parallel import DistributedDataParallel as DDP\n"
      "model = nn.Linear(4, 2)\n")
