"""A worker holds at most max_loras adapters: loaded on demand, least recently used unpinned one evicted, a request
waiting while every place is pinned; an adapter's prompt never hashes like the base model's or another's."""

from __future__ import annotations

import asyncio

import pytest

from kv_events.block_hash import chain_hashes, lora_cache_tokens
from worker.engine.lora import AdapterRef, LoraResidency, LoraUnavailable

A, B, C = (AdapterRef(name, f"/adapters/{name}", digest=i + 1) for i, name in enumerate("abc"))


def residency(max_loras: int = 2) -> tuple[LoraResidency, list[str]]:
    loads: list[str] = []

    def load(ref: AdapterRef, slot: int) -> str:
        loads.append(ref.name)
        return f"weights of {ref.name}"

    return LoraResidency(max_loras, load), loads


async def test_a_resident_adapter_is_loaded_once_and_the_least_recently_used_unpinned_one_evicted():
    loras, loads = residency(2)
    a = await loras.acquire(A)
    b = await loras.acquire(B)
    loras.release(b)
    assert a.slot != b.slot
    loras.release(await loras.acquire(A))  # B is now the least recently used
    loras.release(a)
    c = await loras.acquire(C)
    assert loads == ["a", "b", "c"] and list(loras.resident) == ["a", "c"] and c.weights == "weights of c"
    assert c.slot == b.slot  # the evicted adapter's place


async def test_a_request_waits_while_every_place_is_pinned_and_is_counted_as_waiting():
    loras, loads = residency(1)
    a = await loras.acquire(A)
    waiter = asyncio.create_task(loras.acquire(B))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert not waiter.done() and loras.waiting == {"b": 1} and loras.running == ["a"]
    loras.release(a)
    b = await asyncio.wait_for(waiter, 10)
    assert b.ref == B and loras.waiting == {} and list(loras.resident) == ["b"]


async def test_a_changed_folder_under_the_same_name_replaces_the_old_identity_once_unpinned():
    loras, loads = residency(2)
    old = await loras.acquire(A)
    changed = AdapterRef("a", A.path, digest=99)
    waiter = asyncio.create_task(loras.acquire(changed))
    await asyncio.sleep(0)
    assert not waiter.done()
    loras.release(old)
    new = await asyncio.wait_for(waiter, 10)
    assert new.ref.digest == 99 and loads == ["a", "a"]


async def test_requests_for_an_adapter_being_loaded_wait_for_that_one_load_and_others_go_on():
    started, finish = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()
    loads: list[str] = []

    def load(ref: AdapterRef, slot: int) -> str:
        loads.append(ref.name)
        if ref.name == "a":  # a slow disk: the load of `a` blocks until the test lets it end
            loop.call_soon_threadsafe(started.set)
            asyncio.run_coroutine_threadsafe(finish.wait(), loop).result(10)
        return f"weights of {ref.name}"

    loras = LoraResidency(3, load)
    first = asyncio.create_task(loras.acquire(A))
    await asyncio.wait_for(started.wait(), 10)
    second = asyncio.create_task(loras.acquire(A))
    b = await asyncio.wait_for(loras.acquire(B), 10)  # another adapter's request is not held up by a's load
    assert b.weights == "weights of b" and not first.done() and not second.done()
    finish.set()
    a1, a2 = await asyncio.wait_for(asyncio.gather(first, second), 10)
    assert a1 is a2 and a1.pins == 2 and loads == ["a", "b"]


async def test_a_failed_load_fails_its_waiters_and_frees_the_place():
    def load(ref: AdapterRef, slot: int) -> str:
        raise LoraUnavailable(f"{ref.name}: no such adapter folder")

    loras = LoraResidency(1, load)
    with pytest.raises(LoraUnavailable):
        await loras.acquire(A)
    assert not loras.resident and not loras.waiting


def test_a_prompt_under_an_adapter_shares_no_block_with_the_base_or_another_adapter():
    prompt = list(range(100, 164))
    base = chain_hashes(lora_cache_tokens(prompt, None), 16)
    under_a, under_b = (chain_hashes(lora_cache_tokens(prompt, d), 16) for d in (A.digest, B.digest))
    assert not set(base) & set(under_a) and not set(under_a) & set(under_b)
    assert under_a == chain_hashes(lora_cache_tokens(prompt, A.digest), 16)
    assert lora_cache_tokens(prompt, None) is prompt  # the base model's prompt is hashed as it is, uncopied


def test_media_stand_ins_stay_and_text_around_them_is_salted():
    ids = lora_cache_tokens([5, -7, 6], 1)
    assert ids[1] == -7 and ids[0] != 5 and ids[2] - ids[0] == 1
