"""The runtime's parts, one object per job, each built by ``VTokenRuntime``'s constructor: request rows, page
accounting over SGLang's allocator, where reclaim plans come from, attention scores, copy-on-write of tree pages,
the admission arithmetic, the TP group."""
