"""``runtime.mailbox.Mailbox``: order, wake-ups of a blocked or polling owner, close."""

from __future__ import annotations

import threading

import zmq

from pdstate.runtime.mailbox import Mailbox


def test_blocking_owner_gets_everything_in_order():
    box = Mailbox()
    assert box.get(timeout_s=0.01) == []
    for i in range(5):
        box.put(i)
    assert box.get() == [0, 1, 2, 3, 4]
    assert box.drain() == []
    box.close()


def test_polling_owner_is_woken_by_every_producer():
    box = Mailbox(pollable=True)
    poller = zmq.Poller()
    poller.register(box.socket, zmq.POLLIN)
    assert not dict(poller.poll(0))
    producers = [threading.Thread(target=lambda k=k: [box.put((k, i)) for i in range(200)]) for k in range(4)]
    for t in producers:
        t.start()
    got: list = []
    while len(got) < 800:
        assert dict(poller.poll(5000)), "no wake-up while messages were waiting"
        got += box.drain()
    for t in producers:
        t.join()
    for k in range(4):  # each producer's messages arrive in the order it put them
        assert [i for kk, i in got if kk == k] == list(range(200))
    assert box.drain() == [] and not dict(poller.poll(0))  # every wake-up was consumed
    box.close()


def test_close_is_idempotent_and_later_puts_are_dropped():
    box = Mailbox(pollable=True)
    box.close()
    box.close()
    box.put("late")  # never raises into a sender that lost the race with stop()
