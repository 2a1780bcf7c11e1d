"""Distributed training under the native tape: two ranks on gloo (spawned from the test, loopback
only), each running the same steps eagerly and under ``with tape:`` from the same seeds.

Each rank trains a fresh model eagerly, then a fresh one under the tape, and saves what both
ended with to a file the test compares with ``torch.equal``: DDP's gradient all-reduce (c10d's
``allreduce_`` launched from the reducer's autograd hooks), its buffer broadcast
(``broadcast_``), ``dist.all_reduce`` called in the step, and FSDP2's all-gathers and
reduce-scatters must give every rank eager's losses, parameters, gradients and optimizer state,
bit for bit. A third test checks that the
all-reduce still overlaps the backward: with rank 1 late to its backward, rank 0's backward
goes on past its first bucket's launch at once and waits only at its end.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.multiprocessing as mp

from executor import native

pytestmark = [
    pytest.mark.skipif(not native.enabled(), reason="the native backend needs the native module"),
    pytest.mark.skipif(
        not dist.is_available() or not dist.is_gloo_available(),
        reason="torch.distributed with gloo is not available",
    ),
]

WORLD = 2
STEPS = 4
TIMEOUT_S = 120.0  # the whole spawn: each rank loads the native module, then trains
LATE_S = 1.0  # (overlap) how late rank 1 comes to its backward


# -- what each rank runs ----------------------------------------------------------------------


def _model() -> torch.nn.Module:
    """The same initial model on every rank (DDP broadcasts rank 0's anyway); a BatchNorm's
    buffers make DDP's forward broadcast them (``broadcast_buffers``)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 16),
        torch.nn.BatchNorm1d(16),
        torch.nn.Tanh(),
        torch.nn.Linear(16, 16),
        torch.nn.Tanh(),
        torch.nn.Linear(16, 3),
    )


def _data(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each rank's own batches (another seed per rank: the all-reduce has something to do)."""
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)) for _ in range(STEPS)]


def _ddp(module: torch.nn.Module) -> torch.nn.Module:
    """DDP with tiny buckets: from the second step (the reducer rebuilds its buckets then) each
    parameter is a bucket of its own, so the backward launches several all-reduces."""
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(module, bucket_cap_mb=0.0001)


def _ddp_step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
              y: torch.Tensor) -> torch.Tensor:
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss.detach()


def _all_reduce_step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
                     y: torch.Tensor) -> torch.Tensor:
    """No DDP: the step averages the gradients itself with ``dist.all_reduce`` (placeholders made
    in the step, reduced in place), and reduces a real tensor made in it too."""
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad.div_(WORLD)
    total = loss.detach().clone()
    dist.all_reduce(total)
    count = torch.ones(())
    dist.all_reduce(count)
    opt.step()
    return total / count


def _fsdp2() -> torch.nn.Module:
    """FSDP2 (``fully_shard``) over each Linear and the whole: parameters are DTensor shards,
    all-gathered in the forward and the backward (fsdp's copy-in op, Python, then
    ``_allgather_base_``) and their gradients reduce-scattered."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)
    )
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    return fully_shard(model)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a plain tensor itself), copied."""
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


def _train(step: Callable[..., torch.Tensor], wrap: str, taped: bool, rank: int) -> dict[str, Any]:
    """STEPS steps of a fresh model (wrapped in DDP, in FSDP2 or not at all), eagerly or under a
    native tape."""
    import coexec

    model = {"ddp": lambda: _ddp(_model()), "fsdp2": _fsdp2, "": _model}[wrap]()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    tape = coexec.GradientTape(backend="native", key=("distributed", wrap, step.__name__)) if taped else None
    losses = []
    for x, y in _data(rank):
        if tape is None:
            losses.append(step(model, opt, x, y))
        else:
            with tape:
                losses.append(step(model, opt, x, y))
    module = model.module if wrap == "ddp" else model
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    out: dict[str, Any] = {
        "losses": [_local(t) for t in losses],
        "state_dict": {k: _local(v) for k, v in module.state_dict().items()},
        "grads": [_local(p.grad) for p in module.parameters()],
        "opt_state": [_local(t) for t in state],
    }
    if tape is not None:
        out["coexec_steps"] = tape.stats.coexec_steps
        out["native_ops"] = tape.stats.native_ops
    return out


def _overlap(rank: int) -> dict[str, Any]:
    """Rank 1 comes LATE_S late to each backward; rank 0 notes when each parameter's gradient is
    accumulated (after which DDP's hook launches the bucket's all-reduce) and when its backward
    returns (DDP waits for every bucket's reduction at its end). Eagerly, then under the tape."""
    import coexec

    out: dict[str, Any] = {}
    for taped in (False, True):
        model = _ddp(_model())
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        marks: list[float] = []
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(lambda _p: marks.append(time.perf_counter()))
        tape = coexec.GradientTape(backend="native", key=("distributed", "overlap")) if taped else None
        rows = []
        for x, y in _data(rank)[:3]:
            with tape if tape is not None else contextlib.nullcontext():
                opt.zero_grad()
                loss = torch.nn.functional.mse_loss(model(x), y)
                if rank == 1 and rows:  # (from the second step: one bucket a parameter)
                    time.sleep(LATE_S)
                marks.clear()
                t0 = time.perf_counter()
                loss.backward()
                t1 = time.perf_counter()
                opt.step()
            rows.append((marks[-1] - t0, t1 - t0, len(marks)))
        out["taped" if taped else "eager"] = rows
        if tape is not None:
            out["coexec_steps"] = tape.stats.coexec_steps
    return out


def _funcol_step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
                 y: torch.Tensor) -> torch.Tensor:
    """Functional collectives: ``funcol.all_reduce`` returns an AsyncCollectiveTensor (a tensor
    subclass that calls its ops through ``torch.ops``), which the next op waits for."""
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    for p in model.parameters():
        p.grad.copy_(funcol.all_reduce(p.grad, "sum", dist.group.WORLD) / WORLD)
    opt.step()
    return funcol.all_reduce(loss.detach(), "sum", dist.group.WORLD) + 0.0


SCENARIOS = ("ddp", "all_reduce", "fsdp2", "funcol", "overlap")
STEP_OF = {
    "ddp": (_ddp_step, "ddp"), "all_reduce": (_all_reduce_step, ""), "fsdp2": (_ddp_step, "fsdp2"),
    "funcol": (_funcol_step, ""),
}  # fmt: skip


def _rank(rank: int, port: int, out_dir: str) -> None:
    """One rank: join the gloo group, wait for the native module, run every scenario (one spawn:
    starting the ranks costs more than training) and save what they gave (the parent compares)."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        assert native.wait(600) is not None, "the native module did not load"
        result: dict[str, Any] = {}
        for scenario in SCENARIOS:
            if scenario == "overlap":
                result[scenario] = _overlap(rank)
            else:
                step, wrap = STEP_OF[scenario]
                result[scenario] = {"eager": _train(step, wrap, False, rank), "taped": _train(step, wrap, True, rank)}
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


# -- the parent ---------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Every scenario run on WORLD spawned ranks: their results, by rank. Killed past TIMEOUT_S."""
    out = tmp_path_factory.mktemp("ranks")
    ctx = mp.start_processes(_rank, args=(_free_port(), str(out)), nprocs=WORLD, join=False, start_method="spawn")
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                pytest.fail(f"the ranks did not finish in {TIMEOUT_S:.0f} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    return [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]


def _assert_equal(want: Any, got: Any, where: str) -> None:
    if isinstance(want, torch.Tensor):
        assert torch.equal(want, got), f"{where}: taped {got} is not eager's {want}"
    elif isinstance(want, dict):
        assert want.keys() == got.keys(), where
        for k in want:
            _assert_equal(want[k], got[k], f"{where}.{k}")
    else:
        assert len(want) == len(got), where
        for i, (w, g) in enumerate(zip(want, got)):
            _assert_equal(w, g, f"{where}[{i}]")


@pytest.mark.parametrize("scenario", ["ddp", "all_reduce", "fsdp2", "funcol"])
def test_each_rank_is_bit_equal_to_eager(scenario: str, ranks: list[dict[str, Any]]) -> None:
    """ddp: DistributedDataParallel's step (bucketed all-reduce from the backward's hooks, its
    buffers broadcast in the forward); all_reduce: ``dist.all_reduce`` in the step; fsdp2:
    ``fully_shard``'s all-gathers and reduce-scatters (each rank holds its own shards)."""
    results = [r[scenario] for r in ranks]
    for rank, r in enumerate(results):
        taped = r["taped"]
        assert taped.pop("coexec_steps") == STEPS and taped.pop("native_ops") > 0, f"rank {rank}"
        _assert_equal(r["eager"], taped, f"rank {rank}")
    if scenario != "fsdp2":  # (the ranks agree on the reduced gradients; a BatchNorm's running
        # statistics are each rank's own after its last forward, as eagerly)
        _assert_equal(results[0]["taped"]["grads"], results[1]["taped"]["grads"], "rank 0 vs 1")


def test_all_reduce_overlaps_the_backward(ranks: list[dict[str, Any]]) -> None:
    """Rank 1 is LATE_S late: rank 0's backward launches its buckets' all-reduces (from the second
    step on, one a parameter) and goes on without waiting for them (its last gradient is made
    soon after the backward began), and waits for the reductions only at its end, as eagerly."""
    rank0 = ranks[0]["overlap"]
    assert rank0["coexec_steps"] == 3
    for mode in ("eager", "taped"):
        for step, (last_grad_s, backward_s, grads) in enumerate(rank0[mode][1:], start=1):
            where = f"{mode} step {step}: last gradient at {last_grad_s:.3f} s, backward {backward_s:.3f} s"
            assert grads == 8, where  # (one per parameter)
            assert backward_s > 0.5 * LATE_S, where  # (it waited for rank 1: the check means something)
            assert last_grad_s < 0.25 * LATE_S, where  # (no bucket's reduction was waited for)
