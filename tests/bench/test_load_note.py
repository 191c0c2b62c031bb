"""The bench says above its headline when the host was busy with other work while it ran."""

from minedraft.bench.report import host_load_note


def test_loaded_host_is_named_above_the_headline():
    note = host_load_note([4.2, 6.9], 2)
    assert note is not None and "load average 4.2-6.9 on 2 usable cores" in note and "quiet host" in note
    assert host_load_note([0.3, 1.4], 2) is None      # a quiet 2-core host
    assert host_load_note([1.0, 0.9], 1) is not None  # one core, fully busy elsewhere
