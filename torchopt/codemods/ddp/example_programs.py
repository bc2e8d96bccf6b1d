"""Example programs of the DDP rules (their exact rewrites live next to them)."""
from __future__ import annotations

_HEAD = ("import torch\nimport torch.nn as nn\nfrom torch.utils.data import DataLoader, TensorDataset\n\n"
         "device = 'cuda' if torch.cuda.is_available() else 'cpu'\n"
         "train_ds = TensorDataset(torch.randn(16, 4), torch.randn(16, 2))\n")
_LOOP = ("loader = DataLoader(train_ds, batch_size=8, shuffle=True)\n"
         "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
         "for epoch in range(2):\n"
         "    for x, y in loader:\n"
         "        loss = nn.functional.mse_loss(model(x.to(device)), y.to(device))\n"
         "        optimizer.zero_grad()\n"
         "        loss.backward()\n"
         "        optimizer.step()\n"
         "    print(epoch, loss.item())\n"
         "torch.save(model.module.state_dict(), 'ckpt.pt')\n")
DP_SRC = _HEAD + "model = nn.DataParallel(nn.Linear(4, 2).to(device))\n" + _LOOP
DP_SUM = DP_SRC.replace("mse_loss(model(x.to(device)), y.to(device))",
                        "mse_loss(model(x.to(device)), y.to(device), reduction='sum')")
DP_AFTER = (
    'import torch\n'
    'import torch.nn as nn\n'
    'from torch.utils.data import DataLoader, TensorDataset\n'
    'import os\n'
    'import torch.distributed as dist\n'
    'from torch.nn.parallel import DistributedDataParallel\n'
    'from torch.utils.data.distributed import DistributedSampler\n'
    '\n'
    '\n'
    'def setup_distributed():\n'
    '    """Join the process group that torchrun describes in the environment (RANK,\n'
    '    LOCAL_RANK, WORLD_SIZE); started with plain `python`, the program is a group of one process."""\n'
    '    if not dist.is_initialized():\n'
    '        backend = "nccl" if torch.cuda.is_available() else "gloo"\n'
    '        if "WORLD_SIZE" in os.environ:\n'
    '            dist.init_process_group(backend=backend)\n'
    '        else:\n'
    '            dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)\n'
    '    local_rank = int(os.environ.get("LOCAL_RANK", "0"))\n'
    '    if torch.cuda.is_available():\n'
    '        torch.cuda.set_device(local_rank)  # before any CUDA allocation\n'
    '    return local_rank, dist.get_rank(), dist.get_world_size()\n'
    '\n'
    '\n'
    '# launch with `torchrun --standalone --nproc_per_node=N <script>`; `python <script>` runs one process\n'
    'local_rank, rank, world_size = setup_distributed()\n'
    '\n'
    "device = 'cuda' if torch.cuda.is_available() else 'cpu'\n"
    'train_ds = TensorDataset(torch.randn(16, 4), torch.randn(16, 2))\n'
    'model = nn.Linear(4, 2).to(device)\n'
    'model = DistributedDataParallel(model, device_ids=[local_rank] if next(model.parameters()).is_cuda else None)\n'
    '# each process loads its own shard; batch_size is per process\n'
    'assert 8 % world_size == 0, "the global batch size must divide by the number of processes"\n'
    'sampler = DistributedSampler(train_ds, shuffle=True) if world_size > 1 else None\n'
    'loader = DataLoader(train_ds, batch_size=8 // world_size, shuffle=sampler is None, sampler=sampler)\n'
    'optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n'
    'for epoch in range(2):\n'
    '    if sampler is not None:\n'
    '        sampler.set_epoch(epoch)  # a new shuffle every epoch\n'
    '    for x, y in loader:\n'
    '        loss = nn.functional.mse_loss(model(x.to(device)), y.to(device))\n'
    '        optimizer.zero_grad()\n'
    '        loss.backward()\n'
    '        optimizer.step()\n'
    '    if rank == 0:\n'
    '        print(epoch, loss.item())\n'
    'if rank == 0:\n'
    "    torch.save(model.module.state_dict(), 'ckpt.pt')\n"
    '\n'
    'dist.destroy_process_group()\n'
)
SINGLE_SRC = _HEAD + "model = nn.Linear(4, 2).to(device)\n" + _LOOP.replace("model.module.state_dict()",
                                                                              "model.state_dict()")
SINGLE_AFTER = (
    'import torch\n'
    'import torch.nn as nn\n'
    'from torch.utils.data import DataLoader, TensorDataset\n'
    'import os\n'
    'import torch.distributed as dist\n'
    'from torch.nn.parallel import DistributedDataParallel\n'
    'from torch.utils.data.distributed import DistributedSampler\n'
    '\n'
    '\n'
    'def setup_distributed():\n'
    '    """Join the process group that torchrun describes in the environment (RANK,\n'
    '    LOCAL_RANK, WORLD_SIZE); started with plain `python`, the program is a group of one process."""\n'
    '    if not dist.is_initialized():\n'
    '        backend = "nccl" if torch.cuda.is_available() else "gloo"\n'
    '        if "WORLD_SIZE" in os.environ:\n'
    '            dist.init_process_group(backend=backend)\n'
    '        else:\n'
    '            dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)\n'
    '    local_rank = int(os.environ.get("LOCAL_RANK", "0"))\n'
    '    if torch.cuda.is_available():\n'
    '        torch.cuda.set_device(local_rank)  # before any CUDA allocation\n'
    '    return local_rank, dist.get_rank(), dist.get_world_size()\n'
    '\n'
    '\n'
    '# launch with `torchrun --standalone --nproc_per_node=N <script>`; `python <script>` runs one process\n'
    'local_rank, rank, world_size = setup_distributed()\n'
    '\n'
    "device = 'cuda' if torch.cuda.is_available() else 'cpu'\n"
    'train_ds = TensorDataset(torch.randn(16, 4), torch.randn(16, 2))\n'
    'model = nn.Linear(4, 2).to(device)\n'
    '# each process loads its own shard; batch_size is per process\n'
    'assert 8 % world_size == 0, "the global batch size must divide by the number of processes"\n'
    'sampler = DistributedSampler(train_ds, shuffle=True) if world_size > 1 else None\n'
    'loader = DataLoader(train_ds, batch_size=8 // world_size, shuffle=sampler is None, sampler=sampler)\n'
    'model = DistributedDataParallel(model, device_ids=[local_rank] if next(model.parameters()).is_cuda else None)\n'
    'optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n'
    'for epoch in range(2):\n'
    '    if sampler is not None:\n'
    '        sampler.set_epoch(epoch)  # a new shuffle every epoch\n'
    '    for x, y in loader:\n'
    '        loss = nn.functional.mse_loss(model(x.to(device)), y.to(device))\n'
    '        optimizer.zero_grad()\n'
    '        loss.backward()\n'
    '        optimizer.step()\n'
    '    if rank == 0:\n'
    '        print(epoch, loss.item())\n'
    'if rank == 0:\n'
    "    torch.save(model.module.state_dict(), 'ckpt.pt')\n"
    '\n'
    'dist.destroy_process_group()\n'
)

_DDP_HEAD = ("import torch\nimport torch.distributed as dist\nimport torch.nn as nn\n"
             "from torch.nn.parallel import DistributedDataParallel as DDP\n\n")
EPOCH_SRC = ("import torch\nfrom torch.utils.data import DataLoader\n"
             "from torch.utils.data.distributed import DistributedSampler\n\n"
             "sampler = DistributedSampler(train_ds)\nloader = DataLoader(train_ds, batch_size=8, sampler=sampler)\n"
             "for epoch in range(3):\n    for x, y in loader:\n        loss = model(x).mean()\n"
             "        loss.backward()\n        optimizer.step()\n")
EPOCH_AFTER = (
    'import torch\n'
    'from torch.utils.data import DataLoader\n'
    'from torch.utils.data.distributed import DistributedSampler\n'
    '\n'
    'sampler = DistributedSampler(train_ds)\n'
    'loader = DataLoader(train_ds, batch_size=8, sampler=sampler)\n'
    'for epoch in range(3):\n'
    '    sampler.set_epoch(epoch)  # a new shuffle every epoch\n'
    '    for x, y in loader:\n'
    '        loss = model(x).mean()\n'
    '        loss.backward()\n'
    '        optimizer.step()\n'
)
GUARD_SRC = (_DDP_HEAD + 'dist.init_process_group("gloo")\nmodel = DDP(nn.Linear(4, 2))\n'
             "for epoch in range(2):\n    loss = model(torch.randn(3, 4)).mean()\n    loss.backward()\n"
             '    print(f"epoch {epoch}: {loss.item():.4f}")\n'
             '    torch.save(model.module.state_dict(), "ckpt.pt")\n')
GUARD_AFTER = (
    'import torch\n'
    'import torch.distributed as dist\n'
    'import torch.nn as nn\n'
    'from torch.nn.parallel import DistributedDataParallel as DDP\n'
    '\n'
    'dist.init_process_group("gloo")\n'
    'model = DDP(nn.Linear(4, 2))\n'
    'for epoch in range(2):\n'
    '    loss = model(torch.randn(3, 4)).mean()\n'
    '    loss.backward()\n'
    '    if dist.get_rank() == 0:\n'
    '        print(f"epoch {epoch}: {loss.item():.4f}")\n'
    '        torch.save(model.module.state_dict(), "ckpt.pt")\n'
)
ACC_SRC = (_DDP_HEAD + "if not dist.is_initialized():\n"
           '    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)\n'
           "torch.manual_seed(0)\nmodel = DDP(nn.Linear(4, 2))\n"
           "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\ndata = torch.randn(4, 3, 4)\n"
           "for i in range(4):\n    loss = model(data[i]).pow(2).mean() / 2\n    loss.backward()\n"
           "    if (i + 1) % 2 == 0:\n        optimizer.step()\n        optimizer.zero_grad()\n")
ACC_AFTER = (
    'import torch\n'
    'import torch.distributed as dist\n'
    'import torch.nn as nn\n'
    'from torch.nn.parallel import DistributedDataParallel as DDP\n'
    'import contextlib\n'
    '\n'
    'if not dist.is_initialized():\n'
    '    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)\n'
    'torch.manual_seed(0)\n'
    'model = DDP(nn.Linear(4, 2))\n'
    'optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n'
    'data = torch.randn(4, 3, 4)\n'
    'for i in range(4):\n'
    '    sync_grads = (i + 1) % 2 == 0\n'
    '    with (contextlib.nullcontext() if sync_grads else model.no_sync()):\n'
    '        loss = model(data[i]).pow(2).mean() / 2\n'
    '        loss.backward()\n'
    '    if sync_grads:\n'
    '        optimizer.step()\n'
    '        optimizer.zero_grad()\n'
)
ACC_DONE = ACC_SRC.replace(
    "    loss = model(data[i]).pow(2).mean() / 2\n    loss.backward()\n",
    "    with model.no_sync():\n        loss = model(data[i]).pow(2).mean() / 2\n        loss.backward()\n")
SAVE_SRC = _DDP_HEAD + 'model = DDP(nn.Linear(4, 2))\ntorch.save(model.state_dict(), "ckpt.pt")\n'
SAVE_AFTER = (
    'import torch\n'
    'import torch.distributed as dist\n'
    'import torch.nn as nn\n'
    'from torch.nn.parallel import DistributedDataParallel as DDP\n'
    '\n'
    'model = DDP(nn.Linear(4, 2))\n'
    'torch.save(model.module.state_dict(), "ckpt.pt")\n'
)
LOAD_SRC = _DDP_HEAD + 'model = DDP(nn.Linear(4, 2))\nmodel.load_state_dict(torch.load("ckpt.pt"))\n'
LOAD_AFTER = (
    'import torch\n'
    'import torch.distributed as dist\n'
    'import torch.nn as nn\n'
    'from torch.nn.parallel import DistributedDataParallel as DDP\n'
    'from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present\n'
    '\n'
    'model = DDP(nn.Linear(4, 2))\n'
    'state_dict = torch.load("ckpt.pt")\n'
    'consume_prefix_in_state_dict_if_present(state_dict, "module.")  # also load checkpoints saved from the wrapper\n'
    'model.module.load_state_dict(state_dict)\n'
)
DP_INIT = DP_SRC.replace("device = ", "torch.distributed.init_process_group('gloo')\ndevice = ")
ACC_MAYBE_SRC = (_DDP_HEAD + "model = nn.Linear(4, 2)\nmodel = DDP(model) if dist.is_initialized() else model\n"
                 "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
                 "for i, (x, y) in enumerate(batches):\n    loss = (model(x) - y).pow(2).mean()\n    loss.backward()\n"
                 "    if (i + 1) % 4 == 0 or i == len(batches) - 1:\n        optimizer.step()\n        optimizer.zero_grad()\n")
ACC_MAYBE_AFTER = (
    'import torch\n'
    'import torch.distributed as dist\n'
    'import torch.nn as nn\n'
    'from torch.nn.parallel import DistributedDataParallel as DDP\n'
    'import contextlib\n'
    '\n'
    'model = nn.Linear(4, 2)\n'
    'model = DDP(model) if dist.is_initialized() else model\n'
    'optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n'
    'for i, (x, y) in enumerate(batches):\n'
    '    sync_grads = (i + 1) % 4 == 0 or i == len(batches) - 1\n'
    '    with (contextlib.nullcontext() if sync_grads else getattr(model, "no_sync", contextlib.nullcontext)()):\n'
    '        loss = (model(x) - y).pow(2).mean()\n'
    '        loss.backward()\n'
    '    if sync_grads:\n'
    '        optimizer.step()\n'
    '        optimizer.zero_grad()\n'
)
