"""A job's torch.distributed rendezvous over the authenticated actor channel: torch's store semantics, members only."""

from __future__ import annotations

import asyncio
import datetime
import json
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack
from typing import Any

import pytest
import pytest_asyncio
import torch.distributed as dist

from actors import ActorTimeout, NotAllowed, RemoteError, Runtime, open_runtime
from stages import RendezvousActor
from stages.comm.rendezvous import ActorStore, StoreLimits
from transport.security import Keypair

pytestmark = [pytest.mark.timeout(60)]

NAME = "job0.rendezvous"
IDENTITIES = ("head:head", "node:a", "node:b", "node:outsider", "client:c")


class World:
    """A head runtime serving a rendezvous for nodes a and b, and one runtime per other key."""

    def __init__(self, runtimes: dict[str, Runtime], actor: RendezvousActor) -> None:
        self.runtimes = runtimes
        self.actor = actor

    def store(self, who: str, timeout_s: float = 20.0) -> ActorStore:
        runtime = self.runtimes[who]
        ref = runtime.ref(self.runtimes["head:head"].address, NAME)
        return ActorStore(ref, asyncio.get_running_loop(), datetime.timedelta(seconds=timeout_s))


@pytest_asyncio.fixture
async def world() -> AsyncIterator[World]:
    pairs = {who: Keypair.generate() for who in IDENTITIES}
    ring = {pair.public: who for who, pair in pairs.items()}
    async with AsyncExitStack() as stack:
        runtimes = {who: await stack.enter_async_context(open_runtime("ipc://", keys=pair, ring=lambda: ring))
                    for who, pair in pairs.items()}
        actor = RendezvousActor(["node:a", "node:b"], timeout_s=5.0, job="job0")
        await runtimes["head:head"].spawn(actor, NAME)
        yield World(runtimes, actor)


def script(store: dist.Store) -> list[Any]:
    """Every operation torch's rendezvous uses, with the answers a store gives."""
    out: list[Any] = []
    store.set("a", b"1")
    store.set("s", "text")
    out.append(store.get("a"))
    out.append(store.get("s"))
    out.append(store.add("n", 3))
    out.append(store.add("n", -1))
    out.append(store.get("n"))
    out.append(store.compare_set("c", b"", b"first"))
    out.append(store.compare_set("c", b"wrong", b"second"))
    out.append(store.compare_set("c", b"first", b"second"))
    out.append(store.compare_set("missing", b"x", b"y"))
    store.append("log", b"ab")
    store.append("log", b"cd")
    out.append(store.get("log"))
    out.append(store.check(["a", "n"]))
    out.append(store.check(["a", "nope"]))
    store.wait(["a", "s"])
    store.multi_set(["m1", "m2"], [b"x", b"y"])
    out.append(store.multi_get(["m1", "m2"]))
    out.append(store.delete_key("a"))
    out.append(store.delete_key("a"))
    out.append(store.check(["a"]))
    return out


async def test_the_store_answers_as_torchs_own_store(world: World) -> None:
    expected = script(dist.HashStore())
    got = await asyncio.to_thread(script, world.store("node:a"))
    assert got == expected
    assert await asyncio.to_thread(world.store("node:b").get, "log") == b"abcd"  # one store for the job


async def test_get_waits_for_a_key_another_member_sets(world: World) -> None:
    waiting = asyncio.create_task(asyncio.to_thread(world.store("node:a").get, "address-of-b"))
    await asyncio.sleep(0.3)
    assert not waiting.done()
    await asyncio.to_thread(world.store("node:b").set, "address-of-b", b"10.0.0.2:4000")
    assert await asyncio.wait_for(waiting, 5) == b"10.0.0.2:4000"


async def test_a_member_that_never_joins_is_a_named_error_at_the_jobs_timeout(world: World) -> None:
    store = world.store("node:a")
    started = time.monotonic()
    with pytest.raises(Exception, match="did not join"):
        await asyncio.to_thread(store.wait, ["never"], datetime.timedelta(seconds=0.5))
    assert time.monotonic() - started < 3


async def test_closing_the_rendezvous_wakes_its_waiters_at_once(world: World) -> None:
    waiting = asyncio.create_task(asyncio.to_thread(world.store("node:a").get, "never"))
    await asyncio.sleep(0.2)
    started = time.monotonic()
    await world.runtimes["head:head"].stop_actor(NAME)
    with pytest.raises(Exception, match="closed"):
        await asyncio.wait_for(waiting, 3)
    assert time.monotonic() - started < 2


@pytest.mark.parametrize("who", ["node:outsider", "client:c"])
async def test_a_key_outside_the_job_is_refused_and_counted(world: World, who: str) -> None:
    await asyncio.to_thread(world.store("node:a").set, "secret", b"x")
    before = world.actor.refused_calls
    with pytest.raises(NotAllowed):
        await asyncio.to_thread(world.store(who).get, "secret")
    with pytest.raises(NotAllowed):
        await asyncio.to_thread(world.store(who).set, "secret", b"forged")
    assert world.actor.refused_calls == before + 2
    assert await asyncio.to_thread(world.store("node:b").get, "secret") == b"x"


async def test_a_key_outside_the_cluster_gets_nothing(world: World) -> None:
    stranger = Keypair.generate()
    async with open_runtime("ipc://", keys=stranger, ring=lambda: {stranger.public: "node:me"}) as runtime:
        ref = runtime.ref(world.runtimes["head:head"].address, NAME)
        with pytest.raises(ActorTimeout):
            await ref.endpoint(RendezvousActor.get, timeout=1.0).call("secret")


@pytest.mark.parametrize("attempt", [
    lambda s: s.set("big", b"x" * (StoreLimits.max_value_bytes + 1)),
    lambda s: s.set("k" * (StoreLimits.max_key_chars + 1), b"x"),
    lambda s: s.add("text", 1),
])
async def test_bad_or_oversized_entries_are_refused_and_the_store_keeps_serving(
    world: World, attempt: Callable[[ActorStore], Any]
) -> None:
    store = world.store("node:a")
    await asyncio.to_thread(store.set, "text", b"not a number")
    with pytest.raises(RemoteError) as refused:
        await asyncio.to_thread(attempt, store)
    assert refused.value.remote_type == "ValueError"
    assert await asyncio.to_thread(store.get, "text") == b"not a number"


async def test_the_store_holds_a_bounded_number_of_keys(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(StoreLimits, "max_keys", 3)
    store = world.store("node:a")
    await asyncio.to_thread(store.multi_set, ["1", "2", "3"], [b"a", b"b", b"c"])
    with pytest.raises(RemoteError, match="keys already"):
        await asyncio.to_thread(store.set, "4", b"d")
    await asyncio.to_thread(store.set, "3", b"overwrite is fine")


async def test_calling_the_store_from_its_own_loop_is_an_error_not_a_deadlock(world: World) -> None:
    with pytest.raises(RuntimeError, match="deadlock"):
        world.store("node:a").set("k", b"v")


# Two processes form a gloo group through ActorStores on a third runtime, and all-reduce.
MEMBER = textwrap.dedent("""
    import asyncio, datetime, json, sys
    import torch, torch.distributed as dist
    from actors import open_runtime
    from stages.comm.rendezvous import ActorStore
    from transport.security import Keypair

    async def main(rank, head, ring_file):
        setup = json.load(open(ring_file))
        me = Keypair(public=setup["keys"][rank][0].encode(), secret=setup["keys"][rank][1].encode())
        ring = {public.encode(): who for public, who in setup["ring"].items()}
        async with open_runtime("ipc://", keys=me, ring=lambda: ring) as runtime:
            store = ActorStore(runtime.ref(head, "job0.rendezvous"), asyncio.get_running_loop(),
                               datetime.timedelta(seconds=30))
            def join():
                dist.init_process_group("gloo", store=dist.PrefixStore("job0", store), rank=rank, world_size=2)
                t = torch.tensor([float(rank + 1)])
                dist.all_reduce(t)
                dist.destroy_process_group()
                return t.item()
            print(await asyncio.to_thread(join), flush=True)

    asyncio.run(main(int(sys.argv[1]), sys.argv[2], sys.argv[3]))
""")


@pytest.mark.slow
@pytest.mark.multiprocess
async def test_a_gloo_group_forms_through_the_actor_store(tmp_path: Any) -> None:
    pairs = [Keypair.generate() for _ in range(2)]
    head = Keypair.generate()
    names = ["node:a", "node:b"]
    ring = {pairs[0].public: names[0], pairs[1].public: names[1], head.public: "head:head"}
    ring_file = tmp_path / "ring.json"
    ring_file.write_text(json.dumps({"keys": [[p.public.decode(), p.secret.decode()] for p in pairs],
                                     "ring": {k.decode(): v for k, v in ring.items()}}))
    async with open_runtime("ipc://", keys=head, ring=lambda: ring) as runtime:
        await runtime.spawn(RendezvousActor(names, timeout_s=30, job="job0"), NAME)
        procs = [await asyncio.create_subprocess_exec(
            sys.executable, "-c", MEMBER, str(rank), runtime.address, str(ring_file),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE) for rank in range(2)]
        try:
            outs = await asyncio.wait_for(asyncio.gather(*(p.communicate() for p in procs)), 50)
        finally:
            for p in procs:
                if p.returncode is None:
                    p.kill()
                    await p.wait()
        for p, (out, err) in zip(procs, outs):
            assert p.returncode == 0, err.decode()[-2000:]
            assert out.decode().split() == ["3.0"]
