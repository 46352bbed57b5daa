"""A transport written from kvlab.transports' protocol alone, plugged in by ``_target_``, runs every
strategy verified: the seam is what its docstring says.

``StoreTransport`` moves each chunk as one value of the default group's store (the key-value store
torch.distributed's ranks already share): the ctx rank packs the chunk into a message of its own and
sets it under the chunk's key; the gen rank waits for the key under the run's deadline, takes the
value and unpacks it into its pool. Nothing else in kvlab knows it exists.
"""
from __future__ import annotations

import datetime
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import E2E, check_figures
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab.model.schedule import Chunk
from kvlab.transports import RankContext, Transport

HERE = Path(__file__).resolve().parent


class StoreTransport(Transport):
    link_reference = None  # no raw reference of its own: the run reports no link figures

    def connect(self, ctx: RankContext) -> None:
        super().connect(ctx)
        self.store = dist.distributed_c10d._get_default_store()

    def _key(self, c: Chunk) -> str:
        return f"seam/{c.request}/{c.seq}/{c.src}/{c.dst}"

    def _views(self, c: Chunk):
        store = self.ctx.cache.pools[c.rect.pool]
        table = self.ctx.cache.tables[c.request][c.rect.pool]
        return store, table

    def start(self, i: int, c: Chunk, rec) -> tuple:
        posted = self.ctx.clock.mark()
        if self.sending:  # the chunk's layers are written: pack them into a message of its own
            store, table = self._views(c)
            msg = torch.empty(c.nbytes, dtype=torch.uint8, device=self.device)
            self.ctx.ops.pack(store.storage, store.pool, store.num_blocks, c.rect, table.ids, table.base, msg)
            rec.pack.append((posted, self.ctx.clock.mark()))
            self.ctx.faults.flip(i, msg)  # on the message in flight, never on the cache
            self.store.set(self._key(c), msg.cpu().numpy().tobytes())
        return i, c, posted

    def finish(self, handle, rec) -> bool:
        i, c, posted = handle
        if self.sending:  # the message is the store's now: the pool's bytes are no longer needed
            rec.wire.append((posted, self.ctx.clock.mark()))
            return False
        try:
            self.store.wait([self._key(c)], datetime.timedelta(seconds=self.ctx.timeout_s))
        except RuntimeError as e:
            raise self.failed(c, f"not in the store within {self.ctx.timeout_s:g} s", e) from e
        msg = torch.frombuffer(bytearray(self.store.get(self._key(c))), dtype=torch.uint8).to(self.device)
        self.store.delete_key(self._key(c))
        rec.wire.append((posted, self.ctx.clock.mark()))
        self.ctx.faults.flip(i, msg)
        store, table = self._views(c)
        t0 = self.ctx.clock.mark()
        self.ctx.ops.unpack(msg, store.pool, store.num_blocks, c.rect, table.ids, table.base, store.storage)
        rec.pack.append((t0, self.ctx.clock.mark()))
        return False


def _run(kvlab_cli, run_dir: Path, *overrides: str):
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))}
    return kvlab_cli("run", f"hydra.run.dir={run_dir}", "logger=quiet", "transport=p2p",
                     "transport._target_=test_transport_seam.StoreTransport", "transport.name=store",
                     "workload.requests=3", "workload.isl=700", *overrides, env=env, timeout=240)


def test_a_transport_needs_start_and_finish():
    class Half(Transport):
        def start(self, i, c, rec):
            return None

    with pytest.raises(TypeError, match="finish"):
        Half(None, "ctx", 0, 0, torch.device("cpu"))


@pytest.mark.slow
@settings(max_examples=3, **E2E)
@given(strategy=st.sampled_from(["naive", "chunked", "layerwise", "zerocopy"]),
       sides=st.sampled_from([("1", "1", "block_major", "block_major"), ("2", "1", "block_major", "layer_major"),
                              ("1", "2", "layer_major", "block_major")]),
       model=st.sampled_from(["tiny_gqa", "tiny_mla", "tiny_swa"]))
def test_the_in_test_transport_moves_every_strategy_verified(tmp_path_factory, kvlab_cli, strategy, sides, model):
    ctx_tp, gen_tp, ctx_layout, gen_layout = sides
    run_dir = tmp_path_factory.mktemp("seam")
    p = _run(kvlab_cli, run_dir, f"transfer={strategy}", f"model={model}", f"ctx.tp={ctx_tp}", f"gen.tp={gen_tp}",
             f"ctx.layout={ctx_layout}", f"gen.layout={gen_layout}")
    assert p.returncode == 0, p.stderr[-3000:]
    import json

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["verified"] and summary["transport"] == "store", summary
    check_figures(run_dir, importable=HERE)


@pytest.mark.slow
def test_a_flip_on_the_in_test_transport_is_caught(tmp_path, kvlab_cli):
    p = _run(kvlab_cli, tmp_path, "transfer=chunked", "fault.flip_rank=0", "fault.flip_at=[5]")
    assert p.returncode == 1, p.stderr[-3000:]
    import json

    summary = json.loads((tmp_path / "summary.json").read_text())
    assert not summary["verified"] and summary["failed_requests"] == [0], summary
    rows = {r["request"]: r for r in map(json.loads, (tmp_path / "results.jsonl").read_text().splitlines())}
    assert rows[0]["error"].startswith("request 0: 1 wrong bytes from ctx0, first at pool "), rows[0]["error"]
