"""The rules. One package or module per family; each rule class carries its own examples."""
