"""DataParallel and single-process training scripts to DistributedDataParallel launched by torchrun"""

from __future__ import annotations


from torchopt.analysis.statement_edits import Refusal
from torchopt.rewrite.rule import Rule

_SEMANTICS_DOC = """
    What changes (unsafe, semantics): the program is now a process group. Started with plain
    `python train.py` it is a group of one process (an in-memory store, no launcher, no port) and
    computes bitwise what it computed before (same data order: the DistributedSampler is only used
    with more than one process; DDP over one gloo/nccl process leaves gradients as they are).
    Launched with `torchrun --standalone --nproc_per_node=N train.py ...` (one machine) or
    `torchrun --nnodes=M --nproc_per_node=N --rdzv_id=JOB --rdzv_backend=c10d
    --rdzv_endpoint=HOST:29400 train.py ...` (M machines), every process trains on its shard of the
    training set. `batch_size` is per process: the rewrite divides it by the world size (asserting
    that it divides) so the global batch, and the learning rate that goes with it, stay those of
    the original; gradients are averaged across processes, which for a mean-reduced loss equals the
    full-batch gradient up to rounding. Scripts with `reduction="sum"` losses are refused.
    The sampler pads the training set to a multiple of the world size (a few samples repeat);
    `set_epoch(epoch)` gives every epoch a new shuffle. Evaluation loaders are left alone: every
    process evaluates the whole evaluation set (same numbers on every rank, rank 0 prints them).
    BatchNorm computes statistics per process (use `SyncBatchNorm` on GPUs to emulate one big
    batch); buffers are broadcast from rank 0 at each training forward. Every process seeds the
    same: dropout and augmentation draw the same streams on different data. Output side effects
    (print, logging, tqdm, TensorBoard, wandb, file writes, `torch.save`) run on rank 0 only;
    checkpoints hold `model.module.state_dict()` (no `module.` prefix) and loading accepts both
    forms. Statements that print the result of a function of the file are not guarded (it may
    run collectives) and are listed in the fix's note."""


def _report_refusal(rule: Rule, r: Refusal, what: str) -> None:
    rule.report(r.node or rule.ctx.module, message=f"{what} not converted to DistributedDataParallel: {r.reason}")
