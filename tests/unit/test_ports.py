"""Ports chosen for services that bind them later: outside the kernel's ephemeral range (where
no outgoing connection can take one first), distinct, free, and a busy one is passed over."""

from __future__ import annotations

import random
import socket

import pytest

from common.ports import LOWEST, ephemeral_range, free_ports


def test_ports_are_distinct_free_and_below_the_ephemeral_range() -> None:
    low, high = ephemeral_range()
    assert LOWEST < low <= high
    ports = free_ports(8)
    assert len(set(ports)) == 8
    for port in ports:
        assert LOWEST <= port < low
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # free: this raises otherwise


def test_a_busy_port_is_passed_over() -> None:
    first = free_ports(1, rng=random.Random(7))[0]
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", first))
        busy.listen()
        again = free_ports(1, rng=random.Random(7))[0]
    assert again != first


def test_too_many_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("common.ports.ephemeral_range", lambda: (LOWEST + 10, 60999))
    assert len(free_ports(2)) == 2
    with pytest.raises(OSError, match="no 3 free ports"):
        free_ports(3)
