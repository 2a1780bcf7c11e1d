"""Memory and time planning of TraceGraph blocks: operator order, rematerialisation,
offloading and arena addresses (DESIGN.md §2). Not implemented yet."""
