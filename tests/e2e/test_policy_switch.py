"""A live policy switch in the middle of concurrent engine traffic loses no resident block."""

from __future__ import annotations

import os
import threading
import time

from kvoffload_client.client import KVOffloadAdminClient, KVOffloadClient

from testsupport.server import TOKEN, ServerProcess
from testsupport.shm_device import ShmDevice

WORKERS = 4
PRESTORED = 64
PER_WORKER = 16  # new keys each worker offloads; all fit: no eviction is needed


def test_live_switch_under_traffic(server: ServerProcess) -> None:
    with (
        KVOffloadClient(server.url, timeout=10) as c,
        KVOffloadAdminClient(server.admin_url, token=TOKEN) as admin,
        ShmDevice(PRESTORED + PER_WORKER * WORKERS, 4096) as dev,
    ):
        admin.clear_cache()
        evictions_before = admin.stats()["counters"]["evictions"]
        cache = c.register_kv_cache(dev.spec())
        base = [os.urandom(16) for _ in range(PRESTORED)]
        c.start_request("seed")
        job = c.offload("seed", cache.cache_id, base, list(range(PRESTORED))).job_id
        assert job is not None
        assert c.wait_jobs([job]).jobs[0].state == "done"
        c.finish_request("seed")

        stop = threading.Event()
        errors: list[BaseException] = []
        stored: list[list[bytes]] = [[] for _ in range(WORKERS)]

        def engine(w: int) -> None:
            try:
                with KVOffloadClient(server.url, timeout=10) as ec:
                    i = 0
                    while not stop.is_set() or i < PER_WORKER:
                        req = f"w{w}-{i}"
                        ec.start_request(req)
                        look = ec.lookup(req, base)
                        assert look.hit_prefix == PRESTORED, look
                        ec.prepare_load(req, base[w::WORKERS])
                        ec.complete_load(req, base[w::WORKERS])
                        ec.touch(req, base[: 8 + w])
                        if i < PER_WORKER:
                            key = os.urandom(16)
                            block = PRESTORED + w * PER_WORKER + i
                            started = ec.offload(req, cache.cache_id, [key], [block])
                            assert started.job_id is not None
                            assert ec.wait_jobs([started.job_id]).jobs[0].state == "done"
                            stored[w].append(key)
                        ec.finish_request(req)
                        i += 1
            except BaseException as exc:
                errors.append(exc)
                stop.set()

        threads = [threading.Thread(target=engine, args=(w,)) for w in range(WORKERS)]
        for t in threads:
            t.start()
        switches = 0
        for name in ["arc", "lru", "arc", "lru", "arc"]:
            time.sleep(0.15)
            answer = admin.set_policy(name)
            assert answer["changed"] is True
            assert answer["to"]["name"] == name
            switches += 1
        stop.set()
        for t in threads:
            t.join(timeout=60)
        assert not errors, errors[0]

        every = base + [k for keys in stored for k in keys]
        c.start_request("check")
        final = c.lookup("check", every)
        assert final.hit_prefix == len(every)
        stats = admin.stats()
        assert stats["blocks"]["ready"] == len(every)
        assert stats["blocks"]["pinned"] == 0
        assert stats["counters"]["evictions"] == evictions_before
        assert stats["policy"]["name"] == "arc"
        assert switches == 5
        c.finish_request("check")
        admin.set_policy("lru")
