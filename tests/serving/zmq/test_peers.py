"""Peers: which identities a closed connection carried, with descriptors reused by later connections."""

from minedraft.serving.zmq.peers import Peers


def test_a_closed_connection_returns_only_its_own_identities():
    p = Peers()
    p.accepted(7)
    p.accepted(8)
    assert p.seen(b"a", 7) and p.seen(b"b", 7) and p.seen(b"c", 8)
    assert p.open == 2
    assert p.disconnected(7) == {b"a", b"b"}
    assert p.open == 1
    assert p.disconnected(8) == {b"c"}


def test_a_reused_descriptor_is_a_new_connection():
    p = Peers()
    p.accepted(7)
    assert p.seen(b"old", 7)
    assert p.disconnected(7) == {b"old"}
    assert not p.seen(b"old", 7)        # read after its connection closed: no one can hear a reply
    p.accepted(7)                        # the descriptor now carries another connection
    assert p.seen(b"new", 7)
    p.accepted(9)
    assert p.seen(b"new2", 9)
    assert p.disconnected(7) == {b"new"}  # not the old identity, nor the one on fd 9


def test_an_identity_that_moves_connection_is_tracked_on_the_new_one():
    p = Peers()
    p.accepted(7)
    p.accepted(8)
    assert p.seen(b"x", 7)
    assert p.seen(b"x", 8)  # the same routing id reconnected (a client may choose its own)
    assert p.disconnected(7) == set()
    assert p.disconnected(8) == {b"x"}


def test_unknown_descriptor_is_not_tracked():
    p = Peers()
    assert p.seen(b"x", None) and p.seen(b"x", -1)


def test_ban_expires(monkeypatch):
    import minedraft.serving.zmq.peers as sp
    now = [100.0]
    monkeypatch.setattr(sp.time, "monotonic", lambda: now[0])
    p = Peers()
    assert p.ban(b"slow") and not p.ban(b"slow")
    assert p.banned(b"slow") and not p.banned(b"other")
    now[0] += sp.DROP_S + 1
    assert not p.banned(b"slow")
