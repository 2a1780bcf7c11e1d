"""Random training programs as data: a seed chooses a :class:`Spec`, nothing is executed here.

A spec is a frozen description (blocks applied to an activation, a loss, an optimizer and what the
step does around them), so the same seed always gives the same program and a failing program can
be printed, shrunk to fewer features (``features=``) and rebuilt. :mod:`coexec.fuzz.interp`
turns it into modules and a step function.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass

# Blocks that hold a module.
MODULES = (
    "linear", "conv1d", "conv2d", "lstm", "gru", "embedding", "layernorm", "batchnorm", "dropout",
)  # fmt: skip
# Blocks of Python control flow or plain tensor code between modules.
CODE = ("branch", "loop", "inplace", "views", "floats", "stack", "try_index", "print")
OPTIMIZERS = ("sgd", "adam", "adamw", "rmsprop")
# Choices made around the blocks, per step.
STEP = (
    "loss_branch", "checkpoint", "lr_schedule", "lr_from_loss", "clip", "keep_grads",
    "batch_sizes",
)  # fmt: skip
# Drawn after everything else (so adding them kept the earlier draws, and programs, of a seed).
EXTRA = (
    "carry", "accumulate", "no_grad_eval", "param_clamp", "mask", "kept_losses",
    "grad_penalty", "retain_graph", "grad_hook", "fetches", "max_traces_2", "no_arena",
    "tape_gradient", "sync_none",
    # where the step's ``with tape:`` begins and ends (BOUNDARIES; at most one, the first drawn)
    "forward_outside", "optimizer_outside", "two_withs",
    "new_optimizer",  # the optimizer replaced by a fresh one holding its state, every 4th step
)  # fmt: skip
# The parts of the step a ``with tape:`` holds, other than the whole step: the forward (and the
# loss) before the tape; the clipping, learning rates and optimizer step after it; or the
# forward and backward in one ``with``, the optimizer in a second.
BOUNDARIES = ("forward_outside", "optimizer_outside", "two_withs")
FEATURES = MODULES + CODE + OPTIMIZERS + STEP + EXTRA


@dataclass(frozen=True)
class Block:
    """One stage of the forward pass: ``kind`` (a name of MODULES or CODE) and two knobs whose
    meaning is the kind's (a size, a threshold, a probability)."""

    kind: str
    k: int = 0
    t: float = 0.0


@dataclass(frozen=True)
class Spec:
    """A whole program. ``width`` is the activation's feature size (4, 8 or 16);
    ``batch_sizes`` the sizes steps cycle through (by a step-keyed draw)."""

    seed: int
    width: int
    batch_sizes: tuple[int, ...]
    blocks: tuple[Block, ...]
    loss: str  # "mse" | "ce"
    optimizer: str
    lr: float
    lr_mode: str  # "const" | "lr_schedule" | "lr_from_loss"
    clip: float | None
    set_to_none: bool
    loss_branch: float | None  # threshold of ``if loss.item() > t``
    checkpoint_every: int | None
    extra: frozenset[str] = frozenset()  # names of EXTRA the step uses

    def features(self) -> frozenset[str]:
        """The features this program uses (names of FEATURES)."""
        out = {b.kind for b in self.blocks} | {self.optimizer}
        if self.lr_mode != "const":
            out.add(self.lr_mode)
        flags = {
            "loss_branch": self.loss_branch is not None,
            "checkpoint": self.checkpoint_every is not None,
            "clip": self.clip is not None,
            "keep_grads": not self.set_to_none,
            "batch_sizes": len(self.batch_sizes) > 1,
        }
        return frozenset(out | self.extra | {name for name, on in flags.items() if on})

    def summary(self) -> str:
        """One line: blocks in order, then the step's choices."""
        blocks = " ".join(b.kind for b in self.blocks)
        extra = sorted(self.features() - {b.kind for b in self.blocks} - {self.optimizer})
        return (
            f"w{self.width} b{','.join(map(str, self.batch_sizes))} [{blocks}] {self.loss} "
            f"{self.optimizer} lr={self.lr:g} {' '.join(extra)}"
        ).rstrip()


def _block(rng: random.Random, kind: str, width: int) -> Block:
    if kind == "dropout":
        return Block(kind, t=rng.choice((0.1, 0.25, 0.5)))
    if kind in ("branch", "loop"):
        return Block(kind, k=rng.randrange(3), t=rng.choice((-0.1, 0.0, 0.05, 0.2)))
    if kind in ("views", "try_index", "embedding", "stack"):
        return Block(kind, k=rng.randrange(1, width), t=rng.choice((0.5, 1.0, 2.0)))
    return Block(kind, k=rng.randrange(3), t=rng.choice((0.5, 0.9, 1.5)))


def generate(seed: int, features: Iterable[str] | None = None) -> Spec:
    """The program of ``seed``. With ``features``, only those features are used (the draws are
    the same, so a seed's program with fewer features is the same program with parts removed)."""
    rng = random.Random(seed)
    allowed = set(FEATURES if features is None else features)
    unknown = allowed - set(FEATURES)
    if unknown:
        raise ValueError(f"unknown features {sorted(unknown)}; known: {', '.join(FEATURES)}")
    width = rng.choice((4, 8, 16))
    n_blocks = rng.randint(3, 7)
    kinds = [rng.choice(MODULES + CODE) for _ in range(n_blocks)]
    blocks = tuple(_block(rng, k, width) for k in kinds)
    blocks = tuple(b for b in blocks if b.kind in allowed)
    sizes = tuple(sorted(rng.sample((2, 3, 4, 6, 8), rng.randint(2, 3))))
    one, varying = rng.random() < 0.15, rng.random() < 0.6  # batch 1: BatchNorm raises
    sizes = ((1,) if one else ()) + sizes if varying and "batch_sizes" in allowed else sizes[-1:]
    optimizer = rng.choice(OPTIMIZERS)
    if optimizer not in allowed:
        optimizer = next((o for o in OPTIMIZERS if o in allowed), "sgd")
    lr_mode = rng.choice(("const", "const", "lr_schedule", "lr_from_loss"))
    clip = rng.choice((None, 0.5, 1.0))
    set_to_none = rng.random() < 0.5
    loss_branch = rng.choice((None, 0.3, 0.8, 1.2))
    checkpoint_every = rng.choice((None, None, 2, 3, 5))
    loss, lr = rng.choice(("mse", "ce")), rng.choice((0.001, 0.01, 0.03))
    extra = [f for f in EXTRA if rng.random() < 0.2 and f in allowed]
    bounds = [f for f in extra if f in BOUNDARIES]
    extra = frozenset(f for f in extra if f not in BOUNDARIES or f == bounds[0])
    return Spec(
        seed=seed,
        width=width,
        batch_sizes=sizes,
        blocks=blocks,
        loss=loss,
        optimizer=optimizer,
        lr=lr,
        lr_mode=lr_mode if lr_mode in allowed else "const",
        clip=clip if "clip" in allowed else None,
        set_to_none=set_to_none or "keep_grads" not in allowed,
        loss_branch=loss_branch if "loss_branch" in allowed else None,
        checkpoint_every=checkpoint_every if "checkpoint" in allowed else None,
        extra=extra,
    )
