"""``AgentLoop.post`` by the loop's own thread: while the thread takes its queue (a posted step's
own posts, as the prefill agent's chunk pump; an ``again`` check's), the post runs in that same turn
and writes no wake-up (each cost a write and one more empty turn of the loop); from a socket
handler (after the queue) it still wakes the next poll, which else would wait for the tick (60 s
here)."""

from __future__ import annotations

import os
import threading
import types

import pytest
import zmq

from pdstate.agent.common import AgentLoop


@pytest.fixture
def loop():
    lp = AgentLoop("self-posts", 60.0, lambda: None)
    yield lp
    lp.stop(lambda: None)


@pytest.fixture
def loop_writes(monkeypatch):
    """The wake-up writes made on one thread (``watch(ident)`` names it), counted from then on."""
    real = os.write
    rec = types.SimpleNamespace(seen=[], who=[])
    rec.watch = rec.who.append

    def counting(fd, data):
        if rec.who and threading.get_ident() == rec.who[0]:
            rec.seen.append(fd)
        return real(fd, data)

    monkeypatch.setattr(os, "write", counting)
    return rec


def test_the_threads_own_posts_while_it_takes_its_queue_run_in_that_turn_without_a_wake_up(loop, loop_writes):
    loop.start()
    loop_writes.watch(loop.call(threading.get_ident))
    order: list[str] = []
    done = threading.Event()

    def first() -> None:
        order.append("first")
        loop.post(lambda: order.append("second"))
        loop.post(done.set)

    def check() -> None:  # an again check runs before the queue is taken: its posts need none either
        order.append("check")
        loop.post(lambda: order.append("checked"))

    loop.call(lambda: loop.again("k", check))
    loop.post(first)
    assert done.wait(10), "the thread's own posts waited for the tick"
    seen = loop.call(lambda: list(order))
    assert sorted(seen) == ["check", "checked", "first", "second"]
    assert seen.index("check") < seen.index("checked") and seen.index("first") < seen.index("second")
    assert loop_writes.seen == []


def test_a_post_from_a_socket_handler_still_wakes_the_next_poll(loop, loop_writes):
    server = loop.socket(zmq.PAIR)
    server.bind("inproc://self-posts")
    client = loop.ctx.socket(zmq.PAIR)
    client.setsockopt(zmq.LINGER, 0)
    client.connect("inproc://self-posts")
    ran = threading.Event()

    def handler(sock: zmq.Socket) -> None:
        sock.recv()
        loop.post(ran.set)  # after the queue was taken this turn: the next poll must wake for it

    loop.watch(server, handler)
    loop.start()
    ident = loop.call(threading.get_ident)
    loop_writes.watch(ident)
    try:
        client.send(b"x")
        assert ran.wait(10), "the handler's post waited for the 60 s tick"
        assert len(loop_writes.seen) == 1
    finally:
        client.close(0)
