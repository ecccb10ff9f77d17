"""A chunkserver registers with every metaserver of a cluster of several: those it
was configured with, and those another names in its heartbeat replies (one added to
the cluster later). What a reply names is checked: host:port addresses only, and
at most MAX_METASERVERS in all."""

from kvfs.chunkserver.membership import MAX_METASERVERS, Metaservers


def test_metaservers_named_in_heartbeat_replies_are_registered_with_once_each():
    started = []
    ms = Metaservers(["a:7000", "b:7000"], store=None)
    ms.on_new = started.append
    ms.learn(["a:7000", "b:7000", "c:7000"], told_by="a:7000")
    ms.learn(["c:7000", "b:7000"], told_by="b:7000")
    assert started == ["c:7000"] and ms.addresses == ["a:7000", "b:7000", "c:7000"]


def test_what_a_reply_names_is_bounded_and_checked():
    started = []
    ms = Metaservers(["a:7000"], store=None)
    ms.on_new = started.append
    ms.learn(["no-port", "x" * 300 + ":1", "d:99999", "e:7000;rm -rf", "[::1]:7000"], told_by="a:7000")
    assert started == ["[::1]:7000"]
    ms.learn([f"m{i}.example:7000" for i in range(1000)], told_by="a:7000")
    assert len(ms.addresses) == MAX_METASERVERS and len(started) == MAX_METASERVERS - 1
