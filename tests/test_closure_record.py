"""The closure's port recheck (closure/record.py): a port something listens on is named open, a closed one refused."""

import socket

from glm52_jax.closure.record import _port_bindable, _port_refused


def test_a_listening_port_is_open_and_a_closed_one_refused():
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen()
    address = f"127.0.0.1:{server.getsockname()[1]}"
    try:
        assert _port_refused(address, wait_s=0.3) == (False, "still accepting connections 0.3 s after the shutdown")
        assert not _port_bindable(address)
    finally:
        server.close()
    assert _port_refused(address, wait_s=0.3) == (True, "connection refused") and _port_bindable(address)
