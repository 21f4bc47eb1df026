"""Clairvoyant prefetch: the epoch's order is known in advance, so remote samples are fetched
ahead of use, into a bounded buffer, by a thread in each process that reads.

`ClairvoyantSampler` is a `DistributedSampler` (same order, same `set_epoch`) that also hands
its plan to the dataset. A DataLoader gives batch j of an epoch to worker j % num_workers, so
each worker knows which batches it will get and fetches its next `depth` ones in the
background, one vectored read per node each. A request that does not match the plan (another
sampler) is simply read on demand: prediction affects speed, never data. A request that is
another batch of the plan (a resumed epoch, workers restarted) puts the prefetch back on it.

The samplers resume mid-epoch: `state_dict()` is the epoch and how far into it the sampler
has yielded, `load_state_dict()` makes the next iteration yield exactly the rest of that
epoch's order, as `torchdata.stateful_dataloader.StatefulDataLoader` expects of a sampler,
and the plan the dataset is told starts there too.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import weakref
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Generic, TypeVar

import numpy as np
from torch.utils.data import DistributedSampler, get_worker_info

log = logging.getLogger(__name__)

T = TypeVar("T")


class _Sized:
    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n


@dataclasses.dataclass(frozen=True)
class EpochPlan:
    """Picklable: what the sampler will yield this epoch on this rank."""

    length: int
    num_replicas: int
    rank: int
    shuffle: bool
    seed: int
    drop_last: bool
    epoch: int
    depth: int
    start: int = 0  # samples of the order already yielded before a resume

    def order(self) -> list[int]:
        # The sampler's own code computes it, so the plan cannot drift from what it yields.
        s: DistributedSampler[int] = DistributedSampler(
            _Sized(self.length),  # type: ignore[arg-type]
            num_replicas=self.num_replicas,
            rank=self.rank,
            shuffle=self.shuffle,
            seed=self.seed,
            drop_last=self.drop_last,
        )
        s.set_epoch(self.epoch)
        return list(s)

    def next_epoch(self) -> EpochPlan:
        return dataclasses.replace(self, epoch=self.epoch + 1, start=0)

    def remaining(self) -> np.ndarray:
        """The order from `start` on: what the sampler yields in this pass."""
        return np.asarray(self.order(), dtype=np.int64)[self.start :]


class ClairvoyantSampler(DistributedSampler[int]):
    """A DistributedSampler that tells its dataset the epoch's order, for prefetching.

    Without torch.distributed (or explicit num_replicas/rank) it is a seeded shuffle over the
    whole dataset. `depth` is how many batches each reader fetches ahead.
    """

    def __init__(
        self,
        dataset: Any,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        depth: int = 4,
    ):
        import torch.distributed as dist

        if num_replicas is None or rank is None:
            if dist.is_available() and dist.is_initialized():
                num_replicas = dist.get_world_size() if num_replicas is None else num_replicas
                rank = dist.get_rank() if rank is None else rank
            else:
                num_replicas = 1 if num_replicas is None else num_replicas
                rank = 0 if rank is None else rank
        super().__init__(dataset, num_replicas, rank, shuffle, seed, drop_last)
        self.depth = max(1, depth)
        self._resume_at = 0  # where the next iteration starts (a loaded state_dict)
        self._yielded = 0  # how far the current iteration has gone
        self._publish()

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self._resume_at = 0  # a resumed epoch is kept only until another one is set
        super().set_epoch(epoch)
        self._publish()

    def __iter__(self) -> Iterator[int]:
        start = self._resume_at
        order = self.plan().remaining().tolist()
        self._resume_at = 0  # a pass after this one is the whole epoch again
        return self._counted(start, order)

    def _counted(self, start: int, order: list[int]) -> Iterator[int]:
        self._yielded = start
        for i in order:
            self._yielded += 1
            yield i

    def state_dict(self) -> dict[str, Any]:
        """Where this sampler is: its epoch and how many of the epoch's indices it has yielded
        (with what the order depends on, checked when it is loaded)."""
        return {
            "epoch": self.epoch,
            "yielded": self._yielded,
            "seed": self.seed,
            "length": len(self.dataset),  # type: ignore[arg-type]
            "num_replicas": self.num_replicas,
            "rank": self.rank,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The next iteration yields the rest of the saved epoch's order, exactly; the plan
        the dataset is told starts there."""
        for key in ("seed", "length", "num_replicas", "rank"):
            mine = self.state_dict()[key]
            if state.get(key) != mine:
                raise ValueError(
                    f"sampler state is for {key}={state.get(key)!r}, this sampler has {mine!r}"
                )
        self.epoch = int(state["epoch"])
        self._resume_at = self._yielded = int(state["yielded"])
        self._publish()

    def plan(self) -> EpochPlan:
        return EpochPlan(
            length=len(self.dataset),  # type: ignore[arg-type]
            num_replicas=self.num_replicas,
            rank=self.rank,
            shuffle=self.shuffle,
            seed=self.seed,
            drop_last=self.drop_last,
            epoch=self.epoch,
            depth=self.depth,
            start=self._resume_at,
        )

    def _publish(self) -> None:
        set_plan = getattr(self.dataset, "set_plan", None)
        if set_plan is not None:
            set_plan(self.plan())


class Prefetcher(Generic[T]):
    """Fetches `batches` in order on a thread, at most `depth` ahead of the consumer."""

    def __init__(self, batches: Sequence[np.ndarray], fetch: Callable[[np.ndarray], T], depth: int):
        self.batches = batches
        self.fetch = fetch
        self.depth = depth
        self._done: dict[int, T] = {}
        self._consumed = 0
        self._failed: BaseException | None = None
        self._stopped = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="kspeedfs-prefetch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for k, batch in enumerate(self.batches):
                with self._cond:
                    while not self._stopped and k >= self._consumed + self.depth:
                        self._cond.wait()
                    if self._stopped:
                        return
                data = self.fetch(batch)
                with self._cond:
                    self._done[k] = data
                    self._cond.notify_all()
        except BaseException as e:  # reported to the consumer, which reads on demand instead
            with self._cond:
                self._failed = e
                self._cond.notify_all()

    def take(self, k: int) -> T | None:
        """Batch k's data (waiting for it), or None when the prefetcher failed or stopped."""
        with self._cond:
            while k not in self._done and self._failed is None and not self._stopped:
                self._cond.wait()
            data = self._done.pop(k, None)
            self._consumed = max(self._consumed, k + 1)
            self._cond.notify_all()
            if data is None and self._failed is not None:
                log.warning("prefetch failed, reading on demand: %s", self._failed)
            return data

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._done.clear()
            self._cond.notify_all()


class PlanFollower(Generic[T]):
    """One process's view of a plan: the batches it will be asked for, fetched ahead.

    A DataLoader deals batches round-robin: this worker gets batches w, w + W, w + 2W, ... of
    the plan (from the plan's start). A request that is a batch of the plan or of the next
    epoch, but not the one expected (a new pass, persistent workers past set_epoch, a resumed
    epoch whose workers started before the sampler loaded its state), moves the prefetch to
    that batch and every W-th after it. Each plan it starts is also handed to `announce` (on
    a thread of its own), which tells the node the order its segments will be read in.
    """

    def __init__(
        self,
        plan: EpochPlan,
        batch_size: int,
        fetch: Callable[[np.ndarray], T],
        announce: Callable[[EpochPlan], None] | None = None,
    ):
        self.given = plan  # the plan set by the sampler; `plan` may run an epoch ahead of it
        self.plan = plan
        self.batch_size = batch_size
        self.fetch = fetch
        self.announce = announce
        self.pid = os.getpid()
        self.pos = 0
        self.prefetcher: Prefetcher[T] | None = None
        self.mine: list[np.ndarray] = []
        self._batches: dict[EpochPlan, tuple[list[np.ndarray], dict[int, list[int]]]] = {}
        self._start(plan)

    def _worker(self) -> tuple[int, int]:
        info = get_worker_info()
        return (info.id, info.num_workers) if info is not None else (0, 1)

    def _all_batches(self, plan: EpochPlan) -> tuple[list[np.ndarray], dict[int, list[int]]]:
        """The plan's batches as a DataLoader cuts them from its start (the order before it in
        batches too, for a later whole pass), and batch numbers by first index. Computing an
        order costs a shuffle of the whole dataset: once per plan, the last two kept."""
        got = self._batches.get(plan)
        if got is None:
            order = np.asarray(plan.order(), dtype=np.int64)
            bs = self.batch_size
            head = plan.start % bs
            cuts = ([0] if head else []) + list(range(head, len(order), bs))
            batches = [order[a : a + bs if a >= head else head] for a in cuts]
            by_first: dict[int, list[int]] = {}
            for k, batch in enumerate(batches):
                by_first.setdefault(int(batch[0]), []).append(k)
            got = (batches, by_first)
            if len(self._batches) >= 2:
                self._batches.pop(next(iter(self._batches)))
            self._batches[plan] = got
        return got

    def _start(self, plan: EpochPlan, first: int | None = None) -> None:
        if self.prefetcher is not None:
            self.prefetcher.stop()
        batches, _ = self._all_batches(plan)
        wid, nw = self._worker()
        if first is None:
            head = plan.start % self.batch_size
            first = (1 if head else 0) + plan.start // self.batch_size + wid
        self.plan = plan
        self.mine = batches[first::nw]
        self.pos = 0
        self.prefetcher = Prefetcher(self.mine, self.fetch, plan.depth)
        if self.announce is not None:
            threading.Thread(
                target=_announce, args=(self.announce, plan), name="kspeedfs-plan", daemon=True
            ).start()

    def restart(self, plan: EpochPlan) -> None:
        self.given = plan
        self._start(plan)

    def _find(self, plan: EpochPlan, indices: np.ndarray) -> int | None:
        if not len(indices):
            return None
        batches, by_first = self._all_batches(plan)
        for k in by_first.get(int(indices[0]), []):
            if np.array_equal(batches[k], indices):
                return k
        return None

    def take(self, indices: np.ndarray) -> T | None:
        """The prefetched data for this request, or None when it is not the predicted one."""
        if self.pos < len(self.mine) and np.array_equal(self.mine[self.pos], indices):
            return self._take_next()
        for plan in (self.plan, self.plan.next_epoch()):
            k = self._find(plan, indices)
            if k is not None:
                self._start(plan, first=k)
                return self._take_next()
        if self.prefetcher is not None:
            log.debug("request off the plan; prefetch stopped for this pass")
            self.prefetcher.stop()
            self.prefetcher = None
        return None

    def _take_next(self) -> T | None:
        assert self.prefetcher is not None
        data = self.prefetcher.take(self.pos)
        self.pos += 1
        return data

    def stop(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.stop()


def _announce(announce: Callable[[EpochPlan], None], plan: EpochPlan) -> None:
    try:
        announce(plan)
    except Exception as e:  # a plan only helps the node's eviction: reads go on without it
        log.debug("could not send the plan to the node: %s", e)


class PrefetchMixin:
    """Plan handling shared by the datasets: `set_plan`, `statistics`, `_prefetched`."""

    _plan: EpochPlan | None = None
    _follower: PlanFollower[Any] | None = None
    _stats: Counter[str] | None = None

    def set_plan(self, plan: EpochPlan | None) -> None:
        """Called by ClairvoyantSampler; workers started afterwards inherit the plan."""
        self._plan = plan

    def statistics(self) -> dict[str, int]:
        """This process's counts: local, prefetched and fetched (on demand) samples."""
        return dict(self._counts())

    def _counts(self) -> Counter[str]:
        if self._stats is None:
            self._stats = Counter()
        return self._stats

    def _prefetched(self, indices: np.ndarray, fetch: Callable[[np.ndarray], T]) -> T | None:
        plan = self._plan
        if plan is None or len(indices) == 0:
            return None
        f = self._follower
        if f is None or f.pid != os.getpid():
            f = self._follower = PlanFollower(plan, len(indices), fetch, self._plan_announcer())
        elif f.given != plan:
            f.restart(plan)
        return f.take(indices)

    def _plan_announcer(self) -> Callable[[EpochPlan], None] | None:
        """What tells the node a plan (None: nothing to tell; datasets over a cache say it)."""
        return None

    def _weak_fetch(self, method: str) -> Callable[[np.ndarray], Any]:
        """`self.method` for the prefetch thread, without keeping the dataset alive."""
        ref = weakref.ref(self)

        def fetch(indices: np.ndarray) -> Any:
            me = ref()
            if me is None:
                raise ReferenceError("the dataset is gone")
            return getattr(me, method)(indices)

        return fetch

    def _drop_prefetch_state(self, state: dict[str, Any]) -> dict[str, Any]:
        state.pop("_follower", None)
        state.pop("_stats", None)
        return state
