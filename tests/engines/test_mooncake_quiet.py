"""Mooncake over TCP does not probe RDMA devices: no "No RDMA devices found" on stderr, errors still there.

One fresh interpreter (its fd 2 captured whole: glog writes there from C++) runs, split by markers:
two pdstate engines over TCP on 127.0.0.1 moving 4 KiB, a connect to a dead session (Mooncake's own
error line must come through), then a bare native engine initialised the way pdstate used to, the
control that shows this host does print the warning when asked to probe.
"""

from __future__ import annotations

import re

import pytest

from tests.support.engines import require_engine
from tests.support.paths import run_python

pytestmark = [pytest.mark.mooncake, pytest.mark.timeout(60)]

WARNING = "No RDMA devices found, check your device installation"

SCRIPT = r"""
import ctypes, os
import numpy as np
from pdstate.errors import NativeEngineError
from pdstate.pools.memory import Region
from pdstate.transfer.engines.mooncake import MooncakeEngine
from pdstate.transfer.plan import TransferPlan

def mark(name):
    os.write(2, f"@@{name}\n".encode())

n = 4096
src = ctypes.create_string_buffer(bytes(range(256)) * (n // 256), n)
dst = ctypes.create_string_buffer(n)
mark("engines")
decode = MooncakeEngine(host="127.0.0.1")
decode.start()
decode.register([Region("dst", ctypes.addressof(dst), n)])
prefill = MooncakeEngine(host="127.0.0.1")
prefill.start()
prefill.register([Region("src", ctypes.addressof(src), n)])
print("env after start:", os.environ.get("MC_CUSTOM_TOPO_JSON"))
print("hcas:", prefill.hcas, "in use:", prefill.transport().in_use)
peer = prefill.connect(decode.endpoint())
handle = prefill.submit(peer, TransferPlan.from_arrays([ctypes.addressof(src)], [ctypes.addressof(dst)], [n]))
prefill.wait(handle, 20.0)
print("landed:", dst.raw == src.raw)
mark("error")
try:
    prefill.connect({**decode.endpoint(), "session_id": "127.0.0.1:1"})
except NativeEngineError as exc:
    print("refused:", exc)
mark("control")
from mooncake.engine import TransferEngine
raw = TransferEngine()
print("raw rc:", raw.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", ""))
mark("end")
prefill.close()
decode.close()
"""


def _phases(stderr: str) -> dict[str, str]:
    parts = re.split(r"^@@(\w+)\n", stderr, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def test_tcp_engines_do_not_probe_rdma_and_errors_still_print() -> None:
    require_engine("mooncake")
    out = run_python(SCRIPT, timeout_s=50)
    assert out.returncode == 0, out.stderr[-3000:]
    phases = _phases(out.stderr)
    assert list(phases) == ["engines", "error", "control", "end"], out.stderr[-3000:]
    if WARNING not in phases["control"]:
        pytest.skip("this host has RDMA devices: Mooncake's probe does not warn here")
    assert out.stdout.splitlines() == [
        "env after start: None",  # the variable lived only as long as each initialize
        "hcas: 0 in use: tcp",
        "landed: True",
        "refused: mooncake send_probe to 127.0.0.1:1 (connect) failed: code -102",
        "raw rc: 0",
    ]
    # both engines started on TCP, quietly: Mooncake read the empty topology instead of probing
    assert WARNING not in out.stderr.replace(phases["control"], "")
    assert len(re.findall(r"Using custom topology from: \S+/topology\.json$", phases["engines"], re.M)) == 2
    assert phases["engines"].count("TcpTransport: listen on port") == 2  # no second engine for the topology
    # Mooncake's own error for a refused connection still reaches stderr, as glog's E line
    assert re.search(r"^E\d{4} .*connect\(\)127\.0\.0\.1:1: Connection refused", phases["error"], re.M), phases["error"]
