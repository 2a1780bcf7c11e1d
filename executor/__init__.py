"""Background execution of plans: arena, op invocation without autograd, recompute,
offload/prefetch (DESIGN.md §2). Not implemented yet."""
