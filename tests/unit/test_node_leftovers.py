"""A deploy-tier node killed before its ``stop()`` (a CI timeout, a killed session) leaves
its directory behind: containerd's images and layers and etcd's data, gigabytes a run. The
next node, holding the one-node lock, removes all of it but the logs, and never touches its
own freshly made directory. (Only the directory step runs here: the rest of reaping kills
whatever process serves the node's bridge address, a running deploy tier's included.)"""

from __future__ import annotations

from pathlib import Path

import node


def _populate(root: Path) -> None:
    (root / "containerd" / "io.containerd.content.v1.content").mkdir(parents=True)
    (root / "containerd" / "io.containerd.content.v1.content" / "blob").write_bytes(b"x" * 4096)
    (root / "kubelet").mkdir()
    (root / "Corefile").write_text(". {}\n")
    (root / "kubelet.log").write_text("the last words\n")


def test_a_dead_nodes_directories_lose_all_but_their_logs(tmp_path: Path) -> None:
    dead, dead_cp, own = (tmp_path / n for n in ("dcr-node-dead", "dcr-node-cp-dead",
                                                  "dcr-node-own"))
    for d in (dead, dead_cp, own):
        d.mkdir()
        _populate(d)
    unrelated = tmp_path / "other"
    unrelated.mkdir()
    (unrelated / "data").write_text("not a node's")
    (tmp_path / "dcr-node-link").symlink_to(unrelated)  # anyone may plant one in /tmp

    node._clear_dead_workdirs(tmp_path, own)

    for d in (dead, dead_cp):
        assert sorted(p.name for p in d.iterdir()) == ["kubelet.log"]
        assert (d / "kubelet.log").read_text() == "the last words\n"
    assert sorted(p.name for p in own.iterdir()) == ["Corefile", "containerd", "kubelet",
                                                     "kubelet.log"]
    assert (own / "containerd" / "io.containerd.content.v1.content" / "blob").stat().st_size \
        == 4096
    assert (unrelated / "data").read_text() == "not a node's"  # the link was not followed
