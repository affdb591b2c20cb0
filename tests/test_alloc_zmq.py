"""Loopback ZMQ: a subscriber rebuilds the allocator's cached (group, hash) set."""

from __future__ import annotations

import time

import pytest

from hybridkv import models
from hybridkv.alloc import HybridAllocator, KVEventBatch
from hybridkv.alloc.zmq_events import CacheIndex, EventPublisher, EventSubscriber
from hybridkv.layouts import make_plan

pytest.importorskip("zmq")


def test_zmq_loopback_index_matches_allocator():
    plan = make_plan(
        models.load("lfm2-350m"), "per_group", memory=8 << 20, max_num_seqs=3, block_size=16
    )
    a = HybridAllocator(plan, max_model_len=512)
    pub = EventPublisher("tcp://127.0.0.1:*")
    sub = EventSubscriber(pub.endpoint)
    try:
        # PUB/SUB drops messages until the subscription propagates: probe until one arrives.
        deadline = time.monotonic() + 5
        while True:
            pub.publish(KVEventBatch(ts=0.0, events=[]))
            if sub.recv(timeout_ms=50) is not None:
                break
            assert time.monotonic() < deadline, "subscriber never connected"
        while sub.recv(timeout_ms=50) is not None:
            pass
        n = 0
        for i in range(12):  # enough traffic to cause evictions in the tiny pools
            prompt = list(range(i % 3 * 100, i % 3 * 100 + 40 + 16 * (i % 4)))
            hit = a.add_request(i, prompt)
            assert a.allocate_slots(i, len(prompt) - hit.num_cached_tokens)
            a.free(i)
            pub.publish(a.take_events())
            n += 1
        index = CacheIndex()
        for _ in range(n):
            batch = sub.recv(timeout_ms=2000)
            assert batch is not None, "event batch lost on loopback"
            index.apply(batch)
        assert index.keys == a.cached_hashes() and index.keys
    finally:
        sub.close()
        pub.close()
