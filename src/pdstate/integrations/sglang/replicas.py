"""Several decode ranks fed by one prefill rank: a decode attention TP wider than the prefill's.

DeepSeek-V4's KV is MLA-like: every attention-TP rank of a server holds all of it. With a decode
attention TP ``N`` times the prefill's, SGLang maps ``N`` decode ranks to each prefill rank
(``_resolve_rank_mapping``: ``target_tp_rank = rank // N``, ``required_dst_info_num = N``), and
that prefill rank sends each of them the whole request. The agents key a request by its room and
serve one decode per room, so each of those decode ranks asks for the request under a room of its
own, derived from SGLang's room, its place ``i`` among them and their number ``N``
(``replica_room``); with ``N == 1`` (every other topology) the room is SGLang's own. The prefill's
sender finds ``N`` from the first rank's request (``asked_rooms``) and sends every chunk to each.

The derived rooms stay in the protocol's 63-bit range; a derived room equals another request's
room no more often than two of SGLang's random rooms are equal.
"""

from __future__ import annotations

import functools
import hashlib

__all__ = ["MAX_REPLICAS", "asked_rooms", "refused_room", "replica_index", "replica_room"]

MAX_REPLICAS = 64  # the widest decode attention TP per prefill rank this backend looks for
ROOM_BITS = (1 << 63) - 1


@functools.cache
def _mask(index: int, count: int) -> int:
    digest = hashlib.blake2b(f"pdstate sglang replica {index}/{count}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") & ROOM_BITS


def replica_room(room: int, index: int, count: int) -> int:
    """The agents' room for decode rank ``index`` of the ``count`` a prefill rank feeds with SGLang's ``room``."""
    if not 0 <= index < count:
        raise ValueError(f"replica {index} of {count}")
    return room if count == 1 else room ^ _mask(index, count)


def replica_index(engine_rank: int, attn_tp_size: int, count: int) -> int:
    """Which of the ``count`` decode ranks fed by one prefill rank this one is (SGLang's mapping
    puts ranks ``k * count .. k * count + count - 1`` on prefill rank ``k``)."""
    return (engine_rank % attn_tp_size) % max(1, count)


def asked_rooms(agent, room: int) -> list[int] | None:
    """The agents' rooms of SGLang's ``room`` once every decode rank it goes to asked for it
    (``[room]`` for one decode rank), else ``None``."""
    if agent.requested(room):
        return [room]
    for count in range(2, MAX_REPLICAS + 1):
        if agent.requested(replica_room(room, 0, count)):
            rooms = [replica_room(room, i, count) for i in range(count)]
            return rooms if all(agent.requested(r) for r in rooms) else None
    return None


def refused_room(agent, room: int):
    """The refusal a decode gave SGLang's ``room`` up with (under its own room or a first
    replica's), else ``None``; taken: the sender it fails is the attempt it was meant for, so the
    room sent again later (a retracted request) starts clean, even if a decode rank's new request
    comes after the prefill's first look. Every replica's refusal of that count goes with it."""
    refusal = agent.take_refusal(room)
    for count in range(2, MAX_REPLICAS + 1):
        if refusal is not None:
            break
        refusal = agent.take_refusal(replica_room(room, 0, count))
        if refusal is not None:
            for i in range(1, count):
                agent.take_refusal(replica_room(room, i, count))
    return refusal
