"""Values of any size through torch.distributed's key-value store, which takes at most 8 MiB in one value (its
libuv server refuses a larger payload and drops the connection): a value goes in pieces, and its count is set
last, so that a reader that finds the count finds every piece."""
from __future__ import annotations

PIECE = 4 << 20


def put(store, key: str, data: bytes) -> None:
    n = max(1, -(-len(data) // PIECE))
    view = memoryview(data)
    for i in range(n):
        store.set(f"{key}/{i}", bytes(view[i * PIECE:(i + 1) * PIECE]))
    store.set(key, str(n))


def get(store, key: str, remove: bool = False) -> bytes:
    """What ``put`` set under ``key``, waiting for it as ``store.get`` does; ``remove``: then deleted, for a value
    one reader takes (the store's host keeps every value until then)."""
    n = int(store.get(key))
    data = b"".join(store.get(f"{key}/{i}") for i in range(n))
    if remove:
        for k in [*(f"{key}/{i}" for i in range(n)), key]:
            store.delete_key(k)
    return data
