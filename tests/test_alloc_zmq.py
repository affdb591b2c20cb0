"""Loopback ZMQ: a real publisher and subscriber; the index rebuilt from the stream equals the
allocator's cached (group, unit) -> parent map."""

from __future__ import annotations

import time

import pytest

from hybridkv import models
from hybridkv.alloc import CacheIndex, HybridAllocator, KVEventBatch
from hybridkv.alloc.zmq_events import EventPublisher, EventSubscriber
from hybridkv.layouts import make_plan

pytest.importorskip("zmq")


def test_zmq_loopback_index_matches_allocator():
    plan = make_plan(
        models.load("lfm2-350m"), "per_group", memory=4 << 20, max_num_seqs=3, block_size=16
    )
    a = HybridAllocator(plan, max_model_len=512, checkpoint_policy="last")
    pub = EventPublisher("tcp://127.0.0.1:*")
    sub = EventSubscriber(pub.endpoint)
    try:
        # PUB/SUB drops messages until the subscription propagates: probe until one arrives
        # (a hang guard, generous so that a busy machine does not fail it)
        deadline = time.monotonic() + 120
        while True:
            pub.publish(KVEventBatch(ts=0.0, events=[]))
            if sub.recv(timeout_ms=50) is not None:
                break
            assert time.monotonic() < deadline, "subscriber never connected"
        while sub.recv(timeout_ms=50) is not None:
            pass
        first = pub.seq
        removed = 0
        for i in range(16):  # enough traffic to cause evictions in the tiny pools
            prompt = list(range(i % 5 * 100, i % 5 * 100 + 40 + 16 * (i % 4)))
            done = a.add_request(i, prompt).num_cached_tokens
            # a chunk ends where the policy keeps the end state (the prompt's last hash
            # boundary): without a state, the request's KV could serve no hit and is dropped
            for end in (a.next_checkpoint(i), len(prompt)):
                if end is not None and end > done:
                    assert a.allocate_slots(i, end - done)
                    a.take_state_copies()  # the step's commit: full blocks become entries
                    done = end
            a.free(i)
            batch = a.take_events()
            removed += sum(type(e).__name__ == "BlockRemoved" for e in batch.events)
            pub.publish(batch)
        assert removed, "the pools were meant to be small enough to evict"
        index = CacheIndex()
        for seq in range(first, pub.seq):
            got = sub.recv(timeout_ms=2000)
            assert got is not None, "event batch lost on loopback"
            assert got[0] == seq
            index.apply(got[1])
        assert sub.missed == 0 and index.errors == 0
        assert index.parent == a.cached_units() and index.parent
    finally:
        sub.close()
        pub.close()
