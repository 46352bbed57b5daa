"""``prefill=model``: a ctx rank's prefill is the model's own forward, and each layer writes its real cache.

The rank runs its transformers model (kvlab.rank.hf_models.build: the preset's family at the preset's width,
``kvlab.core.decode_spec.wide``, random weights from ``check.seed``, built before the clock) over the
request's prompt on the prefill thread (kvlab.rank.prefiller), on the clock. A forward hook on each decoder
layer takes that layer's cache as soon as the layer has run (``hf_models.pool_rows(only=layer)``: K/V, the MLA
latent and its RoPE part, the indexer's fp8 keys and scales, a recurrent state) and hands it to the prefill
thread, which writes it into this rank's pools through its layout (``PagedCache.fill`` reading
``DecodeCheck.expected``: the rank's own heads and layers, as check=decode's writers do) and marks the layer
done, so a layer-wise transfer of layer ``l`` overlaps the forward of layers after it. Each mark is the
layer's completion: host time on a CPU; on a GPU an event recorded after the layer's kernels and its write, the
stream synchronised before the thread goes on, so the per-layer times are the real forward's and not when the
thread ran again. A rank's share ends with its last layer's mark where it has no tensor-parallel peer to hear
from, and the prefill with the forward's (the LM head's included), marked the same way before its greedy token is
read back.

Every TP and PP rank of a ctx DP group runs the whole forward and writes its share: the bytes are exactly the
reference's (one process, one thread: the same bits), and the timeline is that of an unsharded forward (a
sharded forward with its collectives is not built: its per-layer time is what ``prefill=gpu`` estimates).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from kvlab.rank import hf_models


class ModelPrefill:
    """The model of one ctx rank; ``run`` prefills one request, calling ``on_layer(layer)`` after each layer's
    cache is in ``planes``."""

    def __init__(self, setup, device: torch.device):
        self.model, self.check = setup.model, setup.check
        # weights before the clock: loading a checkpoint is not the prefill's time either
        self.net, self.cfg = hf_models.build(self.model, self.check.seed, str(device))
        self.layers = _decoder_layers(self.net)
        if len(self.layers) != self.model.num_layers:
            raise RuntimeError(f"{type(self.net).__name__} has {len(self.layers)} decoder layers, the spec "
                               f"{self.model.num_layers}")
        self.pools = {p.name: p for p in self.model.pools("bf16")}

    def run(self, request: int, isl: int, planes: dict[str, list[torch.Tensor]],
            on_layer: Callable[[int], None], on_end: Callable[[], None] | None = None) -> int:
        """Prefill request ``request``'s prompt; ``planes`` (pool name -> per component ``[pool layers, heads,
        tokens, row]``, filled here) holds each layer's cache before ``on_layer(layer)`` is called, and
        ``on_end()`` is called once the whole forward is queued, before its greedy token is read back (which
        waits for the device). Returns that token."""
        ids = hf_models.prompt(self.check, self.model, request, isl)
        state: dict = {}

        def hook(layer: int):
            def after(_module, _args, _out):
                # kept on the model's device: a copy to the host and back per layer would be timed as the forward's
                for name, comps in hf_models.pool_rows(self.model, state["cache"], only=layer, on_device=True).items():
                    pool = self.pools[name]
                    i = pool.layers.index(layer)
                    if name not in planes:
                        planes[name] = [torch.zeros(len(pool.layers), *c.shape[1:], dtype=torch.uint8, device=c.device)
                                        for c in comps]
                    for whole, c in zip(planes[name], comps):
                        whole[i] = c[0]
                on_layer(layer)
            return after

        handles = [m.register_forward_hook(hook(g)) for g, m in enumerate(self.layers)]
        try:
            cache, last = hf_models.full_prefill(self.net, self.cfg, ids, on_cache=lambda c: state.update(cache=c))
        finally:
            for h in handles:
                h.remove()
        del cache
        if on_end is not None:
            on_end()
        return int(last.argmax())


def _decoder_layers(net) -> list:
    """The decoder layers of a transformers causal LM, in order (``model.layers`` or a backbone's)."""
    for owner in (getattr(net, "model", None), getattr(net, "backbone", None)):
        layers = getattr(owner, "layers", None)
        if layers is not None:
            return list(layers)
    raise RuntimeError(f"{type(net).__name__}: no decoder layers found")
