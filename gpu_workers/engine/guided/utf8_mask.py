"""Guided output that is valid UTF-8: a mask on top of the grammar's.

xgrammar 0.2.8 matches byte tokens leniently: inside a JSON string it accepts the bytes of a surrogate
(``ED A0 80``), which a client decodes as three U+FFFD, so a string the grammar counted as one character reads as
three and breaks ``maxLength``. The engine therefore keeps, per guided request, where it stands in a UTF-8
sequence (a small DFA over the bytes sampled so far) and allows only tokens whose bytes continue it validly: no
stray continuation byte, no overlong form, no surrogate (U+D800-DFFF), nothing above U+10FFFF, no special
token in the middle of a character, and no special token the text leaves out (other than a stop token). The
allowed set per DFA state is precomputed once per tokenizer as xgrammar-packed bitmask rows, so a step costs
one AND per guided row.
"""

from __future__ import annotations

from collections.abc import Collection

import numpy as np
import torch

#: DFA states: what the next byte must be. ACCEPT: between characters.
ACCEPT, CONT1, CONT2, CONT3, AFTER_E0, AFTER_ED, AFTER_F0, AFTER_F4 = range(8)
NUM_STATES = 8
ERROR = -1

# (lowest, highest, next state) for the byte after a non-ACCEPT state.
_CONTINUATION: dict[int, tuple[int, int, int]] = {
    CONT1: (0x80, 0xBF, ACCEPT),
    CONT2: (0x80, 0xBF, CONT1),
    CONT3: (0x80, 0xBF, CONT2),
    AFTER_E0: (0xA0, 0xBF, CONT1),  # E0 80..9F would be overlong
    AFTER_ED: (0x80, 0x9F, CONT1),  # ED A0..BF would be a surrogate
    AFTER_F0: (0x90, 0xBF, CONT2),  # F0 80..8F would be overlong
    AFTER_F4: (0x80, 0x8F, CONT2),  # F4 90.. would be above U+10FFFF
}


def _lead(byte: int) -> int:
    if byte < 0x80:
        return ACCEPT
    if 0xC2 <= byte <= 0xDF:
        return CONT1
    if byte == 0xE0:
        return AFTER_E0
    if byte == 0xED:
        return AFTER_ED
    if 0xE1 <= byte <= 0xEF:
        return CONT2
    if byte == 0xF0:
        return AFTER_F0
    if 0xF1 <= byte <= 0xF3:
        return CONT3
    if byte == 0xF4:
        return AFTER_F4
    return ERROR  # 80..BF as a lead, C0/C1 (overlong), F5..FF


def step(state: int, byte: int) -> int:
    """The state after ``byte``; ``ERROR`` when the byte cannot come next in valid UTF-8."""
    if state == ACCEPT:
        return _lead(byte)
    low, high, after = _CONTINUATION[state]
    return after if low <= byte <= high else ERROR


def run(state: int, data: bytes) -> int:
    """The state after ``data`` from ``state``; ``ERROR`` as soon as a byte is invalid."""
    for byte in data:
        state = step(state, byte)
        if state == ERROR:
            return ERROR
    return state


def pack_bits(allowed: np.ndarray) -> torch.Tensor:
    """Boolean rows [n, vocab] -> xgrammar's packed int32 bitmask (bit ``t % 32`` of word ``t // 32``)."""
    rows, vocab = allowed.shape
    words = -(-vocab // 32)
    padded = np.zeros((rows, words * 32), dtype=np.uint64)
    padded[:, :vocab] = allowed
    weights = np.left_shift(np.uint64(1), np.arange(32, dtype=np.uint64))
    packed = (padded.reshape(rows, words, 32) * weights).sum(axis=2).astype(np.uint32)
    return torch.from_numpy(packed.view(np.int32).copy())


class Utf8Table:
    """Per DFA state: which tokens may come next (packed rows) and the state each leads to."""

    def __init__(self, token_bytes: list[bytes], refused: Collection[int] = ()) -> None:
        """``refused``: tokens never allowed (special tokens the detokenizer leaves out of the text: the grammar
        would count their text, the client never sees it)."""
        vocab, refused = len(token_bytes), set(refused)
        self.next_state = np.full((NUM_STATES, vocab), ERROR, dtype=np.int8)
        for token, data in enumerate(token_bytes):
            if token in refused:
                continue
            if data.isascii():
                # Most tokens: whole characters that only fit between characters (an empty one fits anywhere).
                self.next_state[ACCEPT, token] = ACCEPT
                if not data:
                    self.next_state[:, token] = np.arange(NUM_STATES)
                continue
            for state in range(NUM_STATES):
                self.next_state[state, token] = run(state, data)
        self.packed = pack_bits(self.next_state != ERROR)

    def advance(self, state: int, token: int) -> int:
        """The state after ``token`` (``ERROR`` for a token the mask would not have allowed)."""
        if not 0 <= token < self.next_state.shape[1]:
            return ERROR
        return int(self.next_state[state, token])


class Utf8Cursor:
    """One request's place in its output's UTF-8 sequence."""

    __slots__ = ("state", "table")

    def __init__(self, table: Utf8Table, state: int = ACCEPT) -> None:
        self.table = table
        self.state = state

    def fork(self) -> Utf8Cursor:
        return Utf8Cursor(self.table, self.state)

    def accept(self, token: int) -> bool:
        """Advance by ``token``; False when its bytes would make the output invalid UTF-8."""
        after = self.table.advance(self.state, token)
        if after == ERROR:
            return False
        self.state = after
        return True

    def restrict(self, bitmask: torch.Tensor, row: int) -> None:
        """AND the tokens valid here into ``bitmask[row]`` (xgrammar's packed layout)."""
        allowed = self.table.packed[self.state]
        width = min(bitmask.shape[1], allowed.shape[0])
        bitmask[row, :width] &= allowed[:width]
