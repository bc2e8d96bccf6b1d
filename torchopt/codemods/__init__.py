"""The rules. One package or module per family; each rule class carries its own examples."""

# Topics of the PyTorch tuning guide that have no rule of their own because another rule already
# handles them: topic -> (codes of the rules that handle it, how). The rule index
# (docs/rules/README.md) lists them, so a reader looking for the topic finds the rule.
SHARED_TOPICS = {
    "Sharding a DataLoader across processes": (
        ("TOP401", "TOP403"),
        (
            "part of the DistributedDataParallel rewrite: TOP401 adds the `DistributedSampler`, "
            "TOP403 calls its `set_epoch` every epoch"
        ),
    ),
    "Reproducibility switches left on in training code": (
        ("TOP503",),
        "`cudnn.deterministic`, `use_deterministic_algorithms` and friends are reported by TOP503",
    ),
    "Deprecated `torch.cuda.amp.*` / `torch.cpu.amp.*`": (
        ("TOP201",),
        "migrated to `torch.amp` by TOP201, with the rest of the AMP family",
    ),
}
