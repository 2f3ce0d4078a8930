"""The queue of requests waiting for blocks, in the order they are admitted.

FIFO by default: a new request joins at the end, a preempted one goes to the front (it
resumes first; its prefix is usually still cached). Under `--scheduling-policy priority`
and `fair` the queue is in (priority, arrival) order instead, a preempted request finding
its place by that key like any other (vLLM's request_queue.py).
"""

from __future__ import annotations

from collections import deque

from zllm.core.request import Request


class WaitingQueue(deque[Request]):
    def __init__(self, by_priority: bool) -> None:
        super().__init__()
        self.by_priority = by_priority

    def add(self, req: Request, front: bool = False) -> None:
        """Queue `req`: at the end (a new request) or the front (a preempted one); by its
        priority key when the queue is in priority order."""
        if not self.by_priority:
            if front:
                self.appendleft(req)
            else:
                self.append(req)
            return
        key = req.priority_key
        i = len(self)
        while i > 0 and self[i - 1].priority_key > key:
            i -= 1
        self.insert(i, req)
