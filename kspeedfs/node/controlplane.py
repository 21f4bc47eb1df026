"""The node's side of the etcd control plane: membership lease, catalog convergence, healing.

Everything that talks to etcd runs in worker threads (the event loop never waits on etcd), and
the data plane never depends on it: with etcd away, reads go on and only control ops fail.
Read-through datasets are cataloged too (their segments placed over the members, filled on
demand), but not healed: a lost owner's segments are filled again by the next one on a miss.
"""

from __future__ import annotations

import base64
import functools
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

import trio
import xxhash

from kspeedfs.client.clusterstate import UNAVAILABLE, ClusterState, Record
from kspeedfs.format import placement
from kspeedfs.format.config import Settings
from kspeedfs.format.errors import DataError, KSpeedError, NodeUnreachable, NoSpace, NotFound
from kspeedfs.format.manifest import Manifest, plan_layout
from kspeedfs.format.names import validate_name
from kspeedfs.format.readthrough_view import READTHROUGH
from kspeedfs.format.tls import client_context
from kspeedfs.node import sourceio
from kspeedfs.node.metrics import segment_seconds
from kspeedfs.node.peers import Call, PeerPool
from kspeedfs.node.preload import Plan, Stager
from kspeedfs.node.readthrough import ReadThroughCache
from kspeedfs.node.store import SegmentStore
from kspeedfs.sources.source import open_source

log = logging.getLogger(__name__)

SYNC_INTERVAL = 0.5  # seconds between reads of the members and the catalog
READ_PIECE = 8 * 1024 * 1024  # a segment is copied from a peer in ranges of this size,
READ_REQUEST = 64 * 1024 * 1024  # up to this much in one request
# Segment copies in flight per node: receiving one while hashing and storing another overlap
# (bench_cluster.py on 2 CPUs: 2 in flight healed fastest; 1 and 4 were slower).
HEAL_PARALLEL = 2

UnloadLocal = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


def placed(name: str, entry: Record) -> placement.Placement:
    """Where a catalog record's segments are: placed over its members, the lost ones' copies
    on the next members by weight."""
    return placement.Placement(
        name,
        int(entry.get("segments", 0)),
        entry.get("members", []),
        int(entry.get("replicas", 1)),
        entry.get("lost", []),
    )


class ControlPlane:
    """Registers this node in etcd, keeps its lease, and converges the node to the catalog."""

    def __init__(
        self,
        settings: Settings,
        store: SegmentStore,
        call: Call,
        unload: UnloadLocal,
        stager: Stager | None = None,
        readthrough: ReadThroughCache | None = None,
    ):
        self.settings = settings
        self.state = ClusterState.of(settings)
        self.store = store
        self.stager = stager  # its staged parts are rolled back when their claim is gone
        self.readthrough = readthrough  # read-through datasets: adopted, not healed
        self._adopt_lock = trio.Lock()  # one adoption at a time: the sync and an op may race
        self.call = call
        self.unload_local = unload
        self.address = ""
        self.lease_id = 0
        self.live: list[str] = []
        self.catalog: dict[str, Record] = {}
        self.reachable = False
        self.heal = {
            "segments": 0,
            "bytes": 0,
            "failed": 0,
            "pending": 0,
            "seconds": 0.0,
            "dropped": 0,  # segments given up after a rebalance moved them
            "dropped_bytes": 0,
            "from_source": 0,  # copies no live member could give (read from the source)
        }
        self.under_replicated: dict[str, int] = {}
        # Heal copies read whole segments from worker threads over kept connections.
        self.readers = PeerPool(settings.token_file, settings.timeout, tls=client_context(settings))
        self._heal_due = 0.0  # when a member down now is to be declared lost (time.time())
        self.copy_seconds = segment_seconds(
            "kspeedfs_heal_copy_seconds",
            "time to copy one segment for healing or rebalance, by where it came from",
            ("peer", "source"),
        )
        self._warned = False

    # Membership.

    async def run(
        self, address: str, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        self.address = address
        try:
            await self._register()
        except UNAVAILABLE as e:
            log.warning("%s; serving anyway, joining when it answers", e)
            self._warned = True  # said once: the loops below repeat it only after a success
        task_status.started()
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._keep_alive)
                nursery.start_soon(self._sync_forever)
        finally:
            with trio.move_on_after(2) as scope:
                scope.shield = True
                await self.readers.aclose()
                if self.lease_id:
                    try:
                        # Leaving on purpose: everyone sees it at once, not after the TTL.
                        await trio.to_thread.run_sync(self.state.revoke, self.lease_id)
                    except KSpeedError:
                        pass

    async def _register(self) -> None:
        self.lease_id = await trio.to_thread.run_sync(
            self.state.register, self.address, self.settings.member_ttl, os.getpid()
        )
        log.info("joined cluster %r in etcd as %s", self.settings.cluster, self.address)

    async def _keep_alive(self) -> None:
        while True:
            await trio.sleep(max(0.5, self.settings.member_ttl / 3))
            try:
                if not self.lease_id:  # not joined yet: etcd did not answer at start
                    await self._register()
                elif not await trio.to_thread.run_sync(self.state.keep_alive, self.lease_id):
                    log.warning("membership lease lost; joining again")
                    await self._register()
                self._warned = False
            except UNAVAILABLE as e:
                if not self._warned:
                    log.warning("%s; data keeps being served", e)
                    self._warned = True

    def members(self) -> list[str]:
        """The live members to place new data over (this node always among them)."""
        return sorted(set(self.live) | {self.address})

    async def members_now(self) -> list[str]:
        """`members` read from etcd now, not at the last sync (a node that joined a moment
        ago counts); the last sync's view when etcd does not answer."""
        try:
            self.live = sorted(await trio.to_thread.run_sync(self.state.live_members))
        except UNAVAILABLE as e:
            log.warning("%s; placing over the members seen last", e)
        return self.members()

    # The catalog: claims and records.

    async def claim(self, record: Record) -> None:
        if not self.lease_id:
            await self._register()
        await trio.to_thread.run_sync(self.state.claim, record, self.lease_id)

    async def publish(self, name: str, uuid: str, more: Record) -> None:
        """The preload committed everywhere: the record becomes ready and outlives its
        coordinator."""

        def ready(r: Record) -> Record:
            return {**r, **more, "state": "ready"}

        if not await trio.to_thread.run_sync(self.state.update, name, uuid, ready):
            raise NodeUnreachable(f"etcd: the claim on {name} is gone (lease lost?)")

    async def forget(self, name: str, uuid: str) -> bool:
        return await trio.to_thread.run_sync(self.state.remove, name, uuid)

    async def replace(self, name: str, uuid: str, more: Record) -> bool:
        """Change the ready record of instance `uuid` (a refresh: `more` names the new one)."""

        def change(r: Record) -> Record:
            return {**r, **more, "state": "ready"}

        return await trio.to_thread.run_sync(self.state.update, name, uuid, change)

    async def entry_now(self, name: str) -> Record | None:
        """The catalog record of `name` read from etcd now."""
        found = await trio.to_thread.run_sync(self.state.dataset, name)
        return found[0] if found else None

    async def announce(self, name: str, uuid: str) -> None:
        """Ask the live members to adopt a ready instance now, not at their next sync."""
        for member in self.live:
            if member == self.address:
                continue
            try:
                await self.call(member, "adopt", {"name": name, "uuid": uuid})
            except KSpeedError as e:
                log.info("%s: %s adopts it at its next sync (%s)", name, member, e)

    async def op_adopt(self, msg: Record) -> Record:
        """Take the catalog's ready instance of a dataset now (dropping another one held)."""
        name = validate_name(msg.get("name", ""))
        entry = await self.entry_now(name)
        if entry is None or entry.get("state") != "ready" or entry.get("uuid") != msg.get("uuid"):
            raise NotFound(f"no ready instance {str(msg.get('uuid'))[:8]} of {name!r} in etcd")
        await self.adopt(name, entry)
        record = self.store.datasets.get(name)
        return {"name": name, "adopted": record is not None and record.uuid == entry["uuid"]}

    # Converging.

    async def _sync_forever(self) -> None:
        while True:
            try:
                await self.sync_once()
            except UNAVAILABLE as e:
                self.reachable = False
                if not self._warned:
                    log.warning("%s; data keeps being served", e)
                    self._warned = True
            except Exception:
                log.exception("control plane sync failed; trying again")
            # Awake when a down member is due to be declared lost: every survivor reads the same
            # down-since time, so they all start healing then, not up to a sync later.
            due = self._heal_due - time.time()
            await trio.sleep(min(SYNC_INTERVAL, due) if due > 0 else SYNC_INTERVAL)

    async def sync_once(self) -> None:
        live, down, datasets = await trio.to_thread.run_sync(self._snapshot)
        self.reachable = True
        self.live = sorted(live)
        self.catalog = {name: rec for name, (rec, _rev) in datasets.items()}
        now = time.time()
        for entry in self.catalog.values():
            for m in entry.get("members", []):
                if m not in live and m not in down:
                    await trio.to_thread.run_sync(self.state.note_down, m, now)
                    down[m] = now
        after = self.settings.heal_after
        due = [t + after for m, t in down.items() if m not in live and t + after > now]
        self._heal_due = min(due, default=0.0)
        await self._converge()
        await self._roll_back_orphans()
        await self._adopt_all()
        await self._heal(down, now)

    def _snapshot(self) -> tuple[dict[str, Record], dict[str, float], dict[str, Any]]:
        return self.state.live_members(), self.state.down_since(), self.state.datasets()

    async def _converge(self) -> None:
        """Drop the instances the catalog does not know (unloaded while this node was away,
        a preload whose coordinator died) and those of which this node was declared lost."""
        for name, record in list(self.store.datasets.items()):
            if self._busy(name):
                continue  # being listed or refreshed here: the catalog learns it next
            if self._keeps(self.catalog.get(name), record.uuid, record.held):
                continue
            # Read again: a preload may have claimed and published since the snapshot.
            found = await trio.to_thread.run_sync(self.state.dataset, name)
            entry = found[0] if found else None
            if entry is not None and entry.get("uuid") == record.uuid:
                if self.address not in entry.get("lost", []) or not record.held:
                    continue
                why = "its copies were made again elsewhere while this node was down"
            else:
                why = "the catalog does not have this instance (unloaded, or never finished)"
            log.info("dropping %s (instance %s): %s", name, record.uuid[:8], why)
            await self.unload_local({"name": name, "uuid": record.uuid})

    async def _roll_back_orphans(self) -> None:
        """Abort the parts staged here for a preload whose claim is gone from the catalog: its
        coordinator died (the claim was on the coordinator's lease) or gave up. A claim is
        made before any member stages, so a stage with no claim has no coordinator."""
        if self.stager is None:
            return
        for name, stage in list(self.stager.stages.items()):
            entry = self.catalog.get(name)
            if entry is not None and entry.get("uuid") == stage.uuid:
                continue
            found = await trio.to_thread.run_sync(self.state.dataset, name)
            if found is not None and found[0].get("uuid") == stage.uuid:
                continue  # claimed since the snapshot
            log.warning(
                "rolling back the preload of %s (instance %s): its claim is gone from the "
                "catalog (the coordinator died)",
                name,
                stage.uuid[:8],
            )
            await self.stager.abort(name, stage.uuid)

    async def _adopt_all(self) -> None:
        """Every member lists every ready dataset of the catalog: one that holds no part of it
        (it was down during the preload, or joined later) takes its manifest, no segment, so
        readers that ask it find the dataset and read from its owners."""
        for name, entry in sorted(self.catalog.items()):
            if entry.get("state") != "ready" or name in self.store.datasets:
                continue
            if self.stager is not None and name in self.stager.stages:
                continue  # a preload of this name is being staged here
            if self._busy(name):
                continue
            await self._adopt(name, entry)

    def _busy(self, name: str) -> bool:
        return self.readthrough is not None and name in self.readthrough.busy

    def _keeps(self, entry: Record | None, uuid: str, held: list[int]) -> bool:
        """A copy the catalog knows, and not one of a member declared lost (an empty copy,
        the manifest alone, is kept: the member lists the dataset)."""
        return (
            entry is not None
            and entry.get("uuid") == uuid
            and (self.address not in entry.get("lost", []) or not held)
        )

    # Healing and rebalancing.

    async def _heal(self, down: dict[str, float], now: float) -> None:
        live = set(self.live)
        self.heal["pending"] = 0
        for name, entry in sorted(self.catalog.items()):
            if entry.get("state") != "ready":
                continue
            uuid = entry["uuid"]
            segments = int(entry.get("segments", 0))
            members = entry.get("members", [])
            lost = set(entry.get("lost", []))
            gone = [
                m
                for m in members
                if m not in live
                and m not in lost
                and now - down.get(m, now) >= self.settings.heal_after
            ]
            if gone:
                log.warning(
                    "%s: %s down for %.0fs or more; making its copies again on the others",
                    name,
                    ", ".join(gone),
                    self.settings.heal_after,
                )

                def lose(r: Record, gone: list[str] = gone) -> Record:
                    return {**r, "lost": sorted(set(r.get("lost", [])) | set(gone))}

                if not await trio.to_thread.run_sync(self.state.update, name, uuid, lose):
                    continue  # unloaded or loaded again meanwhile
                entry = {**entry, "lost": sorted(lost | set(gone))}  # healed from this round
            if entry.get("lifetime") == READTHROUGH:
                continue  # filled on demand: a lost owner's segments refill on the next one
            where = placed(name, entry)
            self.under_replicated[name] = sum(
                1 for seg in range(segments) if any(m not in live for m in where.owners(seg))
            )
            if self.address not in where.members or self.address in where.lost:
                continue
            record = self.store.datasets.get(name)
            if record is None:
                await self._adopt(name, entry)
                record = self.store.datasets.get(name)
                if record is None:
                    continue
            if record.uuid != uuid:
                continue
            held = set(record.held)
            missing = [
                seg
                for seg in range(segments)
                if seg not in held and self.address in where.owners(seg)
            ]
            if missing:
                await self._copy_all(name, entry, missing)
            unowned = [seg for seg in record.held if self.address not in where.owners(seg)]
            if unowned and not missing:
                await self._drop_moved(name, uuid, unowned, where)

    async def _drop_moved(
        self, name: str, uuid: str, unowned: list[int], where: placement.Placement
    ) -> None:
        """After a rebalance: drop the segments this node no longer owns, each only once all
        of its new owners are up and hold it (so no copy is ever the last one dropped)."""
        held_by: dict[str, set[int]] = {}
        for peer in sorted({o for s in unowned for o in where.owners(s)}):
            if peer not in self.live:
                continue
            try:
                listing = await self.call(peer, "list", {})
            except KSpeedError as e:
                log.debug("%s: cannot ask %s what it holds: %s", name, peer, e)
                continue
            for d in listing.get("datasets", []):
                if d.get("name") == name and d.get("uuid") == uuid and d.get("state") == "ready":
                    held_by[peer] = set(d.get("held", []))
        dropped = 0
        for seg in unowned:
            owners = where.owners(seg)
            if all(seg in held_by.get(o, ()) for o in owners):
                freed = await trio.to_thread.run_sync(self.store.drop_segment, name, seg)
                self.heal["dropped"] += 1
                self.heal["dropped_bytes"] += freed
                dropped += 1
        if dropped:
            log.info("%s: dropped %d segments now held by their new owners", name, dropped)

    async def adopt(self, name: str, entry: Record) -> None:
        """`_adopt` at once, after dropping an instance the catalog no longer has (a
        read-through dataset refreshed on another member)."""
        held = self.store.datasets.get(name)
        if held is not None and held.uuid != entry.get("uuid") and not self._busy(name):
            log.info("dropping %s (instance %s): the catalog has another", name, held.uuid[:8])
            await self.unload_local({"name": name, "uuid": held.uuid})
        await self._adopt(name, entry)

    async def _adopt(self, name: str, entry: Record) -> None:
        """A member that holds no part of a dataset yet (joined, then `rebalance`): fetch its
        manifest from a member that has it and publish it holding no segment."""
        async with self._adopt_lock:
            if name not in self.store.datasets:
                await self._adopt_unlocked(name, entry)

    async def _adopt_unlocked(self, name: str, entry: Record) -> None:
        for peer in entry.get("members", []):
            if peer == self.address or peer not in self.live:
                continue
            try:
                blob = await self._fetch_manifest(peer, name, entry["uuid"])
            except KSpeedError as e:
                log.info("manifest of %s from %s: %s", name, peer, e)
                continue
            meta = {
                k: entry[k]
                for k in ("name", "uuid", "source", "lifetime", "replicas", "files", "bytes")
            }
            meta.update(
                segment_size=entry.get("segment_size", 0),
                created=entry.get("created", time.time()),
                members=entry["members"],
                segments=entry["segments"],
                stored=len(blob),
                held=[],
                endpoint=entry.get("endpoint", ""),
            )
            if entry.get("lifetime") == READTHROUGH and self.readthrough is not None:
                await self.readthrough.adopt(name, blob, meta)
            else:
                await trio.to_thread.run_sync(self._publish_empty, name, blob, meta)
            log.info("%s: joined its members (manifest from %s)", name, peer)
            return

    def _publish_empty(self, name: str, blob: bytes, meta: Record) -> None:
        staging = self.store.new_staging(name)
        try:
            with open(staging / "manifest.ksm", "wb") as f:
                f.write(blob)
            self.store.publish(staging, meta)
        except BaseException:
            self.store.discard_staging(staging)
            raise

    async def _fetch_manifest(self, peer: str, name: str, uuid: str) -> bytes:
        parts: list[bytes] = []
        offset = 0
        while True:
            reply = await self.call(peer, "manifest", {"name": name, "offset": offset})
            if reply["uuid"] != uuid:
                raise NodeUnreachable(f"{peer} holds another instance of {name}")
            data = base64.b64decode(reply["data"])
            parts.append(data)
            offset += len(data)
            if not data or offset >= int(reply["total"]):
                return b"".join(parts)

    async def _copy_all(self, name: str, entry: Record, missing: list[int]) -> None:
        """The missing copies, HEAL_PARALLEL at a time; heal["seconds"] is the time taken."""
        started = time.monotonic()
        self.heal["pending"] += len(missing)
        manifest = self.store.open(name).manifest
        todo = iter(missing)  # shared by the workers: each takes the next segment

        async def worker() -> None:
            for seg in todo:
                try:
                    await self._copy(name, entry, manifest, seg)
                finally:
                    self.heal["pending"] -= 1

        async with trio.open_nursery() as nursery:
            for _ in range(min(HEAL_PARALLEL, len(missing))):
                nursery.start_soon(worker)
        self.heal["seconds"] += time.monotonic() - started

    async def _copy(self, name: str, entry: Record, manifest: Manifest, seg: int) -> None:
        """One missing copy: from the members that may hold it (best ranked first), else the
        source; kept only when its checksum matches the manifest's."""
        started = time.monotonic()
        length = int(manifest.seg_len[seg])
        expected = int(manifest.seg_checksum[seg])
        ranked = placed(name, entry).ranked(seg, len(entry["members"]))
        origin = ""
        for peer in ranked:
            if peer == self.address or peer not in self.live:
                continue
            try:
                await trio.to_thread.run_sync(
                    self.store.add_segment,
                    name,
                    seg,
                    length,
                    functools.partial(self._read_peer, peer, name, entry["uuid"], seg, expected),
                )
                origin = "peer"
                break
            except DataError as e:
                log.warning("segment %d of %s from %s: %s", seg, name, peer, e)
            except KSpeedError as e:
                if isinstance(e, NoSpace) or name not in self.store.datasets:
                    raise  # this node cannot take it (full, or unloaded meanwhile): no peer helps
                log.debug("segment %d of %s not from %s: %s", seg, name, peer, e)
        if not origin:
            origin = "source"
            self.heal["from_source"] += 1
            try:
                src = open_source(entry["source"], str(entry.get("endpoint", "")))
                data = await sourceio.run_sync(src.read_segment, manifest, manifest.layout, seg)
            except (KSpeedError, OSError) as e:
                self.heal["failed"] += 1
                log.error("segment %d of %s: no copy left and the source fails: %s", seg, name, e)
                return
            if xxhash.xxh3_64_intdigest(data) != expected:
                self.heal["failed"] += 1
                log.error("segment %d of %s: the source no longer matches", seg, name)
                return
            await trio.to_thread.run_sync(
                self.store.add_segment, name, seg, length, functools.partial(_copy_in, data)
            )
        self.heal["segments"] += 1
        self.heal["bytes"] += length
        self.copy_seconds.labels(origin).observe(time.monotonic() - started)

    def _read_peer(
        self, peer: str, name: str, uuid: str, seg: int, expected: int, out: memoryview
    ) -> None:
        """A whole segment from `peer` (in a worker thread), received straight into `out`
        (the new segment's mapping); DataError when it fails the manifest's checksum."""
        length = len(out)
        ranges = [(seg, pos, min(READ_PIECE, length - pos)) for pos in range(0, length, READ_PIECE)]
        per_request = max(1, READ_REQUEST // READ_PIECE)
        with self.readers.reader(peer) as c:
            for k in range(0, len(ranges), per_request):
                chunk = ranges[k : k + per_request]
                start, end = chunk[0][1], chunk[-1][1] + chunk[-1][2]
                c.receive_read(c.send_read(name, uuid, chunk), out[start:end])
        if xxhash.xxh3_64_intdigest(out) != expected:
            raise DataError("it fails its checksum")

    async def rebalance(self, name: str | None) -> list[str]:
        """Place datasets over the live members as they are now: new members get their share
        (each node copies what it now owns and lacks), lost ones are no longer counted."""
        live = await self.members_now()
        found = await trio.to_thread.run_sync(self.state.datasets)
        self.catalog = {n: r for n, (r, _rev) in found.items()}
        names = [name] if name else sorted(self.catalog)
        done = []
        for n in names:
            entry = self.catalog.get(n)
            if entry is None or entry.get("state") != "ready":
                continue

            def replace(r: Record) -> Record:
                return {**r, "members": live, "lost": []}

            if await trio.to_thread.run_sync(self.state.update, n, entry["uuid"], replace):
                done.append(n)
        return done

    def status(self) -> Record:
        return {
            "etcd": self.state.endpoints,
            "cluster": self.settings.cluster,
            "reachable": self.reachable,
            "live": self.live,
            "heal": dict(self.heal),
            "under_replicated": dict(self.under_replicated),
        }


def loading_record(plan: Plan, coordinator: str) -> Record:
    """The catalog record a preload claims its name with (ready once committed)."""
    _offsets, seg_len = plan_layout(plan.tree, plan.segment_size)
    return {
        "name": plan.name,
        "uuid": plan.uuid,
        "state": "loading",
        "source": plan.source,
        "endpoint": plan.endpoint,
        "lifetime": plan.lifetime,
        "replicas": plan.replicas,
        "members": plan.members,
        "segment_size": plan.segment_size,
        "segments": len(seg_len),
        "files": plan.tree.file_count,
        "bytes": plan.tree.data_bytes,
        "coordinator": coordinator,
        "created": time.time(),
    }


def _copy_in(data: bytes | bytearray, out: memoryview) -> None:
    out[:] = data
