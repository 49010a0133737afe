"""Map each row of an engine step's flat token batch to (request, absolute token index).

vLLM runs every scheduled token of every request in one flat batch with no batch
dimension. Rows ``query_start_loc[i]:query_start_loc[i+1]`` belong to the request in
batch slot ``i``, and the first of them is that request's token
``num_computed_tokens[i]`` (tokens already in the KV cache). The same arithmetic covers
a whole prompt, a chunk of a prompt (chunked prefill), one decode token, and batch
slots that a finished request vacated and a new one took over.

Pure functions: no torch, no vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


class TokenWindow(NamedTuple):
    """The rows ``[row_start, row_stop)`` of one step hold tokens
    ``[token_start, token_start + row_stop - row_start)`` of ``request_id``.
    (A named tuple: made for every request at every step, it costs a third of
    a frozen dataclass.)"""

    request_id: str
    row_start: int
    row_stop: int
    token_start: int
    slot: int = 0

    @property
    def token_stop(self) -> int:
        """One past the last absolute token index in this window."""
        return self.token_start + self.row_stop - self.row_start

    def row_of(self, token_index: int) -> int:
        """The flat batch row holding ``token_index`` (which must be in the window)."""
        if not self.token_start <= token_index < self.token_stop:
            raise IndexError(
                f"token {token_index} of {self.request_id!r} is not in this step "
                f"(tokens {self.token_start}..{self.token_stop - 1})"
            )
        return self.row_start + token_index - self.token_start


def step_windows(
    req_ids: Sequence[str | None],
    num_computed_tokens: Sequence[int],
    query_start_loc: Sequence[int],
    num_reqs: int | None = None,
) -> list[TokenWindow]:
    """One :class:`TokenWindow` per request that runs tokens in this step.

    ``req_ids[i]``, ``num_computed_tokens[i]`` and ``query_start_loc[i:i+2]``
    describe batch slot ``i`` (the runner's input batch and the step's attention
    metadata); ``num_reqs`` bounds the live slots (``len(req_ids)`` by default).
    Rows past ``query_start_loc[num_reqs]`` are padding and belong to nobody.

    >>> step_windows(["a-1", "b-2"], [0, 7], [0, 5, 6])
    [TokenWindow(request_id='a-1', row_start=0, row_stop=5, token_start=0, slot=0), \
TokenWindow(request_id='b-2', row_start=5, row_stop=6, token_start=7, slot=1)]
    """
    count = len(req_ids) if num_reqs is None else num_reqs
    if len(query_start_loc) < count + 1:
        raise ValueError(
            f"query_start_loc has {len(query_start_loc)} entries, needs num_reqs + 1 = "
            f"{count + 1}"
        )
    windows: list[TokenWindow] = []
    for slot in range(count):
        request_id = req_ids[slot]
        start, stop = int(query_start_loc[slot]), int(query_start_loc[slot + 1])
        if request_id is None or stop <= start:
            continue  # an empty slot, or a request with nothing scheduled this step
        windows.append(
            TokenWindow(request_id, start, stop, int(num_computed_tokens[slot]), slot)
        )
    return windows


def engine_request_id(internal_id: str) -> str:
    """The id a request was added with: vLLM appends ``-<random>`` to make its
    internal ids unique, and undercurrent's engine ids contain no dash.

    >>> engine_request_id("uc7-3f9a2b1c")
    'uc7'
    """
    return internal_id.split("-", 1)[0]
