"""Memory (TOP71x): preallocate the caching allocator for variable-length inputs."""

FAMILY = "mem"
