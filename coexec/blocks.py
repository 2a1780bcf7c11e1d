"""Which planned block the skeleton is in, op by op (DESIGN.md §3: "the skeleton maps a matched
site to a block launch with one lookup").

A Schedule lists its blocks by their sites (``planner.Block``). Several blocks may begin with
the same ops (two paths that part after a branch inside a block), so the skeleton learns which
block it is in only op by op: :class:`BlockIndex` is a trie over the blocks' sites, one dict
lookup per op. Each node knows the block to follow while the ops so far fit it (the one of the
newest path that passes through the node, which is the one that kept coming back in the
programs tried) and the least bytes any block through it allows; a node where a block ends
knows that block, for its launch.
"""

from __future__ import annotations

from collections.abc import Mapping

from planner import Block, BlockKey


class Node:
    """The ops of a block so far."""

    __slots__ = ("children", "follow", "bound", "block")

    def __init__(self) -> None:
        self.children: dict = {}  # Site -> Node
        self.follow: Block | None = None  # the block to run ahead in
        self.bound = 1 << 62  # the least bytes any block through here allows
        self.block: Block | None = None  # the block ending here, if any


class BlockIndex:
    """The trie of a Schedule's blocks; ``root`` is the start of any block."""

    def __init__(self, blocks: Mapping[BlockKey, Block]) -> None:
        self.root = Node()
        for key, block in blocks.items():  # in the order of the paths that have them
            node = self.root
            for site in key:
                nxt = node.children.get(site)
                if nxt is None:
                    nxt = node.children[site] = Node()
                node = nxt
                node.follow = block
                node.bound = min(node.bound, block.bound)
            node.block = block
