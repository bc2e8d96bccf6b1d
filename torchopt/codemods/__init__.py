"""The rules. One package or module per family; each rule class carries its own examples."""

# Catalogue entries (rules.md) that point at another rule instead of having a code of their own.
# The rule index (docs/rules/README.md) lists them, so no catalogue code is missing silently.
CATALOGUE_NOTES = {
    "DATA-004": ("TOP704", "distributed sharding of loaders is part of the DDP rewrite: TOP401 adds the "
                 "`DistributedSampler`, TOP403 its `set_epoch`"),
    "DBG-005": ("TOP815", "reproducibility switches left on are reported by TOP503"),
    "DEP-002": ("TOP822", "`torch.cuda.amp.*` / `torch.cpu.amp.*` are migrated by TOP201"),
    "ENV (§17)": ("TOP951", "the catalogue gives launcher/environment advice no family code; it is TOP951, "
                  "in the next free decade"),
}
