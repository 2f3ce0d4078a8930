"""The core's sequences by id, and by the client request each answers: one, or several for
`n > 1` samples and beam search (forked sequences join their parent's client request)."""

from __future__ import annotations

from zllm.core.request import Request


class SequenceTable:
    def __init__(self) -> None:
        self.requests: dict[str, Request] = {}  # sequence id -> sequence
        self._of_client: dict[str, list[str]] = {}  # client request id -> sequence ids

    def add(self, req: Request) -> None:
        """A new client request, as its one sequence (its id is unused)."""
        assert req.req_id not in self.requests and req.req_id not in self._of_client
        self.requests[req.req_id] = req
        self._of_client[req.client_req_id] = [req.req_id]

    def add_fork(self, child: Request) -> None:
        self.requests[child.req_id] = child
        self._of_client[child.client_req_id].append(child.req_id)

    def remove(self, req: Request) -> bool:
        """Forget a finished sequence; True when it was its client request's last."""
        del self.requests[req.req_id]
        seq_ids = self._of_client.get(req.client_req_id)
        if seq_ids is None:
            return False
        seq_ids.remove(req.req_id)
        if seq_ids:
            return False
        del self._of_client[req.client_req_id]
        return True

    def of_client(self, client_req_id: str) -> list[Request]:
        """The sequences of a client request (a copy: ending them changes the table)."""
        return [self.requests[i] for i in self._of_client.get(client_req_id, ())]

    def is_known(self, client_req_id: str) -> bool:
        return client_req_id in self._of_client

    def is_taken(self, req_id: str) -> bool:
        """Whether `req_id` names a client request or a sequence here."""
        return req_id in self._of_client or req_id in self.requests

    def client_requests_of(self, client_id: int) -> list[str]:
        """The client request ids sent by one client process."""
        return [
            client_req_id
            for client_req_id, seq_ids in self._of_client.items()
            if self.requests[seq_ids[0]].client_id == client_id
        ]
