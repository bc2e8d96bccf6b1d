"""Memory (TOP71x, rules.md §12 MEM): preallocate the caching allocator for variable-length inputs."""

FAMILY = "mem"
