"""Each node's network link, timed during training: what the ranks' step times leave out.

A rank's own step time (rayapp.train.timing) names a slow rank, but not a slow link: in a
collective every rank waits alike for the slowest path, so a host whose link is slow looks like
any other. So at the end of each epoch the first rank on every node (the node's leader) sends
:data:`PROBE_BYTES` to the leaders before and after it in a ring of the nodes, and times how long
the data from each of them takes to arrive. A node whose own link is slow receives slowly from
both sides; each of its neighbours has one fast side. A node's figure is its faster side, so the
slowest figure belongs to the node with the slow link. With fewer than :data:`MIN_NODES` nodes
a slow link cannot be told from its other end, and nothing is measured.

The leaders form a Gloo group of their own (CPU tensors over TCP, whatever the training
backend): on GPUs whose NCCL runs over InfiniBand this times the hosts' TCP network, not NCCL's
path (`rayapp doctor` times NCCL's).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

PROBE_BYTES = 2**20
"""Big enough that a link's bandwidth shows, not only its latency (about 1 ms at 10 Gbit/s)."""
MIN_NODES = 3


def node_leaders(node_ids: Sequence[str]) -> list[int]:
    """The first rank on each node, in rank order (node_ids: every rank's node, in rank order)."""
    seen: set[str] = set()
    leaders = []
    for rank, node in enumerate(node_ids):
        if node not in seen:
            seen.add(node)
            leaders.append(rank)
    return leaders


class LinkProbe:
    """Made by every rank at once (forming the leaders' group is a collective of all ranks);
    :meth:`measure` is called by every rank at each epoch's end."""

    def __init__(self, node_ids: Sequence[str], rank: int, timeout_s: float) -> None:
        self._leaders = node_leaders(node_ids)
        self._rank = rank
        self._group: Any = None
        if len(self._leaders) >= MIN_NODES:
            self._group = dist.new_group(
                self._leaders, timeout=timedelta(seconds=timeout_s), backend="gloo"
            )

    def measure(self) -> float:
        """Seconds for PROBE_BYTES from this node's faster ring neighbour to arrive; NaN on a
        rank that is not a leader, or with too few nodes."""
        if self._group is None or self._rank not in self._leaders:
            return math.nan
        place, count = self._leaders.index(self._rank), len(self._leaders)
        before = self._leaders[(place - 1) % count]
        after = self._leaders[(place + 1) % count]
        outgoing = torch.ones(PROBE_BYTES // 4)
        incoming = torch.empty_like(outgoing)
        seconds = []
        for send_to, receive_from in ((after, before), (before, after)):
            dist.barrier(group=self._group)  # every leader starts sending at once
            started = time.perf_counter()
            sending = dist.isend(outgoing, send_to, group=self._group)
            dist.recv(incoming, receive_from, group=self._group)
            seconds.append(time.perf_counter() - started)
            if sending is not None:  # None only where this rank is not in the group
                sending.wait()
        return min(seconds)
