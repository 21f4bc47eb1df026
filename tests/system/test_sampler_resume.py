"""Resumable samplers: state_dict() mid-epoch, load_state_dict() in a new sampler (or a new
process, through torchdata's StatefulDataLoader with workers) yields exactly the rest of the
epoch; the plan told to the dataset starts there, and the prefetch follows a resumed epoch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import kw, preload

from kspeedfs.sample import make_shards
from kspeedfs.testing.node import NodeProcess
from pytorch_ext import ClairvoyantSampler, MiniEpochSampler, PrioritySampler
from pytorch_ext.prefetch import PlanFollower


class Sized:
    def __init__(self, n: int):
        self.n = n
        self.plans: list[Any] = []

    def __len__(self) -> int:
        return self.n

    def set_plan(self, plan: Any) -> None:
        self.plans.append(plan)


def make(kind: str, ds: Any, seed: int = 1) -> ClairvoyantSampler:
    if kind == "clairvoyant":
        return ClairvoyantSampler(ds, seed=seed, depth=2)
    if kind == "mini-epoch":
        return MiniEpochSampler(ds, mini_epochs=3, seed=seed, depth=2)
    weights = np.arange(1, len(ds) + 1, dtype=np.float64)
    return PrioritySampler(ds, weights, seed=seed, depth=2)


KINDS = ["clairvoyant", "mini-epoch", "priority"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_loaded_state_yields_exactly_the_rest_of_the_epoch(kind: str) -> None:
    first = make(kind, Sized(50))
    first.set_epoch(3)
    whole = list(first)
    it = iter(first)
    head = [next(it) for _ in range(17)]
    state = first.state_dict()
    assert head == whole[:17] and state["epoch"] == 3 and state["yielded"] == 17
    data = Sized(50)
    again = make(kind, data)  # a new sampler, at epoch 0
    again.load_state_dict(state)
    assert data.plans[-1].start == 17 and data.plans[-1].epoch == 3
    assert data.plans[-1].remaining().tolist() == whole[17:]
    assert list(again) == whole[17:]
    assert list(again) == whole  # the pass after a resumed one is the whole epoch again
    again.set_epoch(4)
    assert list(again) == first_epoch(kind, 4)


def first_epoch(kind: str, epoch: int) -> list[int]:
    s = make(kind, Sized(50))
    s.set_epoch(epoch)
    return list(s)


def test_a_state_of_another_sampler_is_refused() -> None:
    state = make("clairvoyant", Sized(50)).state_dict()
    with pytest.raises(ValueError, match="seed"):
        make("clairvoyant", Sized(50), seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="length"):
        make("clairvoyant", Sized(51)).load_state_dict(state)
    with pytest.raises(ValueError, match="mini-epochs"):
        MiniEpochSampler(Sized(50), mini_epochs=2, seed=1).load_state_dict(
            make("mini-epoch", Sized(50)).state_dict()
        )


def test_a_priority_state_carries_the_weights_set_since() -> None:
    first = make("priority", Sized(40))
    assert isinstance(first, PrioritySampler)
    first.set_weights(np.linspace(5, 1, 40))
    whole = list(first)
    it = iter(first)
    for _ in range(9):
        next(it)
    again = make("priority", Sized(40))  # made with the original weights
    again.load_state_dict(first.state_dict())
    assert list(again) == whole[9:]


def test_the_prefetch_follows_a_batch_of_its_plan_asked_out_of_turn() -> None:
    sampler = make("clairvoyant", Sized(40))
    plan = sampler.plan()
    order = np.asarray(plan.order())
    fetched: list[list[int]] = []

    def fetch(batch: np.ndarray) -> list[int]:
        fetched.append(batch.tolist())
        return batch.tolist()

    follower = PlanFollower(plan, 4, fetch)
    # Resumed at batch 6 (its workers started before the sampler loaded the state): still read
    # ahead, from there on.
    for k in range(6, 10):
        assert follower.take(order[4 * k : 4 * k + 4]) == order[4 * k : 4 * k + 4].tolist()
    assert fetched[-1] == order[36:40].tolist()
    assert follower.take(np.array([999, 998])) is None  # not in the plan: read on demand
    follower.stop()


SCRIPT = r"""
import hashlib, json, pickle, sys
import numpy as np
from torchdata.stateful_dataloader import StatefulDataLoader
from pytorch_ext import ClairvoyantSampler, KSpeedWebDataset, MiniEpochSampler, PrioritySampler

mode, kind, state_path, root, nodes, token = sys.argv[1:]

def fingerprint(sample):
    h = hashlib.sha1()
    for k in sorted(sample):
        v = sample[k]
        h.update(k.encode() + b"=" + (v if isinstance(v, bytes) else str(v).encode()) + b";")
    return h.hexdigest()

def fingerprints(batch):
    return [fingerprint(s) for s in batch]

ds = KSpeedWebDataset(root, nodes=nodes, token=token)
if kind == "clairvoyant":
    sampler = ClairvoyantSampler(ds, seed=5, depth=2)
elif kind == "mini-epoch":
    sampler = MiniEpochSampler(ds, mini_epochs=3, seed=5, depth=2)
else:
    sampler = PrioritySampler(ds, np.arange(1, len(ds) + 1, dtype=np.float64), seed=5, depth=2)
sampler.set_epoch(1)
loader = StatefulDataLoader(
    ds, batch_size=3, sampler=sampler, num_workers=2, collate_fn=fingerprints
)
if mode == "rest":
    with open(state_path, "rb") as f:
        loader.load_state_dict(pickle.load(f))
got = []
for k, batch in enumerate(loader):
    got += batch
    if mode == "first" and k + 1 == 4:
        with open(state_path, "wb") as f:
            pickle.dump(loader.state_dict(), f)
        break
out = {"got": got}
if mode == "first":
    out["order"] = list(sampler)
    out["all"] = [fingerprint(ds[i]) for i in range(len(ds))]
print(json.dumps(out))
"""


def run(mode: str, kind: str, state: Path, root: Path, node: NodeProcess) -> dict[str, Any]:
    args = kw(node)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode, kind, str(state), str(root), args["nodes"]]
        + [args["token"]],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.parametrize("kind", KINDS)
def test_a_stateful_dataloader_resumed_in_a_new_process_yields_the_rest_of_the_epoch(
    node: NodeProcess, tmp_path: Path, kind: str
) -> None:
    root = tmp_path / "wds" / "train"
    make_shards(root, shards=3, per_shard=8, file_size=2000)
    preload(node, root.parent, "wds")
    state = tmp_path / "state.pickle"
    first = run("first", kind, state, root, node)
    rest = run("rest", kind, state, root, node)
    expected = [first["all"][i] for i in first["order"]]
    assert len(first["got"]) == 12
    assert first["got"] + rest["got"] == expected
    assert rest["got"]  # there was a rest
