"""A min-heap of requests with lazy removal.

Why: the waiting and rotary sets may hold thousands of requests, while a step looks at
only the few at the head. VLT ordering within each class has a key that does not depend on
`now` (see vlt.py), so a heap per class gives the head in O(log N) and a step never sorts
everything.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator

from .request import Request


class RequestHeap:
    def __init__(self) -> None:
        self._heap: list[tuple[float, int, int, Request]] = []
        self._members: dict[Request, int] = {}  # request -> version of its live entry
        self._popped: list[tuple[float, int, int, Request]] = []
        self._version = 0

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, req: Request) -> bool:
        return req in self._members

    def push(self, req: Request, key: float) -> None:
        self._version += 1
        self._members[req] = self._version
        heapq.heappush(self._heap, (key, req.seq, self._version, req))
        if len(self._heap) > 2 * len(self._members) + 64:
            self._compact()

    def remove(self, req: Request) -> None:
        self._members.pop(req, None)

    def members(self) -> list[Request]:
        return list(self._members)

    def _valid(self, entry: tuple[float, int, int, Request]) -> bool:
        return self._members.get(entry[3]) == entry[2]

    def _compact(self) -> None:
        self._heap = [e for e in self._heap if self._valid(e)]
        heapq.heapify(self._heap)

    def peek(self) -> tuple[float, Request] | None:
        heap = self._heap
        while heap and not self._valid(heap[0]):
            heapq.heappop(heap)
        return (heap[0][0], heap[0][3]) if heap else None

    def iter_sorted(self) -> Iterator[tuple[float, Request]]:
        """Yield (key, request) in key order. Entries stay set aside until `restore()`;
        requests removed meanwhile are not put back."""
        while (head := self.peek()) is not None:
            self._popped.append(heapq.heappop(self._heap))
            yield head

    def restore(self) -> None:
        for entry in self._popped:
            if self._valid(entry):
                heapq.heappush(self._heap, entry)
        self._popped.clear()
