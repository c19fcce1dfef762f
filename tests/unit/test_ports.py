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


def test_ports_chosen_for_other_services_are_passed_over() -> None:
    first = free_ports(2, rng=random.Random(7))
    again = free_ports(2, rng=random.Random(7), exclude=first[:1])
    assert again[0] == first[1] and first[0] not in again


def _twelve_free_ports(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A range of twelve ports below an ephemeral range moved down to end it, every one of them
    free and chosen."""
    monkeypatch.setattr("common.ports.ephemeral_range", lambda: (LOWEST + 12, 60999))
    free: list[int] = []
    for _ in range(4):  # at most a quarter of the range at once
        free += free_ports(3, exclude=free)
    assert len(set(free)) == 12
    return free


def test_a_stacks_metrics_ports_are_none_of_the_ports_it_chose_before(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`pdserve up` chooses its services' metrics ports while its gateway's and scheduler's,
    chosen before, are not bound yet. In a range of twelve free ports with nine of them taken
    so, the three metrics ports are the other three."""
    from services import launcher
    free = _twelve_free_ports(monkeypatch)
    taken = tuple(free[:9])
    assert sorted(launcher._metrics_ports(0, 3, taken)) == sorted(free[9:])
    assert launcher._metrics_ports(9100, 3, taken) == [9100, 9101, 9102]
    assert launcher._metrics_ports(-1, 3, taken) == []


def test_ports_named_in_the_services_flags_are_none_of_the_metrics_ports(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A port named in the flags passed through to a service (a decode worker's --kv-port and
    --kv-advertise-port, a prefill worker's own --metrics-port) is not bound yet when `pdserve
    up` chooses the metrics ports. In a range of twelve free ports, the gateway's, the
    scheduler's and three such ones taken, the three metrics ports are among the other seven."""
    from services import cli, launcher
    free = _twelve_free_ports(monkeypatch)
    gateway, scheduler, kv, advertised, listed = free[:5]
    assert launcher._ports_named(f"--kv-port {kv} --kv-advertise-port={advertised}") == \
        [kv, advertised]
    assert launcher._ports_named(f"--metrics-port {listed} --max-num-seqs 8") == [listed]
    assert launcher._ports_named("--port-range 9 --kv-port") == []
    # a worker group's ranks listen on consecutive KV ports from the one named
    assert launcher._ports_named("--kv-port 31000 --metrics-port 9100", 2) == \
        [31000, 31001, 9100]
    assert launcher._ports_named("--kv-port=31000 -tp 2 --pipeline-parallel-size 2", 1) == \
        [31000, 31001, 31002, 31003]
    assert launcher._ports_named("--kv-port 31000 --tensor-parallel-size 1", 4) == [31000]
    for _ in range(20):  # the ports are drawn at random: a chance to meet each time
        args = cli.parse_args([
            "up", "--model", "m", "--port", str(gateway), "--scheduler-port", str(scheduler),
            f"--decode-worker-args=--kv-port {kv} --kv-advertise-port={advertised}",
            f"--prefill-worker-args=--metrics-port {listed}"])
        launcher.commands(args)
        assert len(args.metrics_ports) == 3
        assert set(args.metrics_ports) <= set(free[5:]), args.metrics_ports
