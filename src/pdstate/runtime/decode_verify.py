"""The decode's check of what landed: a request is SUCCESS only once its ``TransferDone`` arrived
*and* the bytes in its pages verified against the room's deterministic content.

``VerifyMixin`` is a part of ``DecodeWorker`` (runtime.decode); its methods run on the control
thread. What a request will be checked against depends only on its room and its own indices, so
it is worked out (``_prepare_checks``) as soon as the request is sent, while the prefill computes
and copies: the sampled check's expected words and where to read them, and the digest of the
request's logical layout. ``TransferDone`` then costs the reads of the landed bytes and a
comparison. (A request whose expectation was not ready, e.g. answered at once, works it out then.)
"""

from __future__ import annotations

from collections import deque

from pdstate.protocol import wire
from pdstate.protocol.lifecycle import RequestState, move
from pdstate.protocol.report import ErrorInfo
from pdstate.runtime import synth
from pdstate.runtime.records import Request
from pdstate.runtime.worker import log, now


class VerifyMixin:
    """Expectations of sent requests and the handling of ``TransferDone``, for ``DecodeWorker``."""

    _unprepared: deque  # sent requests whose expectation is not worked out yet (control thread)

    def _sent(self, req: Request) -> None:
        """``req``'s ``TransferRequest`` is on its way: its expectation is due."""
        if req.expected is None:
            self._unprepared.append(req)

    def _prepare_checks(self, _arg: object = None) -> None:
        """Work out the expectation of every request sent since the last call (control loop)."""
        while self._unprepared:
            req = self._unprepared.popleft()
            if req.expected is None and not req.state.terminal:
                req.expected = self._expectation(req)

    def _expectation(self, req: Request) -> tuple:
        """``(sampled check or None, layout digest)``: the check is prepared for ``verify="sample"``
        (a full check reads every byte and has nothing to prepare)."""
        check = None
        if req.verify == "sample":
            check = synth.sample_check(self.kv_args, req.room, req.alloc.lists, self._spans)
        return check, synth.plan_digest(req.room, req.alloc.lists, self.kv_args)

    def _on_done(self, link, msg: wire.TransferDone) -> None:
        if (link.endpoint, msg.room) in self.quarantine:
            with self._lock:
                alloc = self.quarantine.pop((link.endpoint, msg.room))
            self._free(alloc)
            self._admit()
            return
        req = self._mine(link, msg.room)
        if req is None:
            log.debug("late transfer_done for room %s ignored", msg.room)
            return
        if msg.status != "success":
            self._finish(
                req, "failed", error=msg.error or ErrorInfo(type="TransferFailed", message="prefill reported failure")
            )
            return
        with self._lock:
            move(req, RequestState.TRANSFERRING)
        t0 = now()
        check, digest = req.expected or self._expectation(req)
        if check is not None:
            problem = check.run()
        else:
            problem = synth.verify_destination(self.kv_args, req.room, req.alloc.lists)
        if problem is None and msg.digest != digest:
            problem = "digest of the request's logical layout differs from the prefill's"
        t1 = now()
        if problem is not None:
            self._finish(
                req, "failed", error=ErrorInfo(type="TransferFailed", message=f"verification failed: {problem}")
            )
            return
        self._finish(
            req,
            "success",
            nbytes=msg.bytes,
            descriptors=msg.descriptors,
            verified=True,
            compute_s=msg.compute_s,
            copy_s=msg.copy_s,
            verify_s=t1 - t0,
            transfer_s=t1 - (req.sent_at if req.sent_at is not None else req.started),
        )
