"""A worker's status over HTTP: the status source protocol and response models (``models``), the
FastAPI app (``api``), its metrics, body limits and connection bounds, the listening socket, the
source over a live serve worker (``source``) and the app served by a child process fed with
snapshots (``pushed``, an SGLang rank's endpoint).

Above ``worker``, below ``integrations`` and ``service``: both serve this one app.
"""
