"""The shuffle of implicit value expansion (UltraMem §3.2 item 7, Eq. 14) as a computed bijection.

IVE maps a virtual address ``v`` of the ``n x n`` key grid to the physical slot ``v mod N`` and
the virtual block ``v div N``; the addresses are shuffled first so that the virtual blocks of a
physical slot are not neighbours on the key grid. A stored permutation costs ``8 E`` bytes per
physical slot on every rank, more than a sharded table's own share of many slots, so the shuffle
is computed instead: a keyed Feistel network on the grid coordinates ``(a, b) = divmod(v, n)``
(Luby and Rackoff 1988; the square grid makes it a bijection of ``[0, n^2)`` with no cycle walking).
Each of :data:`ROUNDS` rounds maps

    (a, b) -> (b, (a + F_i(b)) mod n),   F_i(x) = ((((x * M + k_i) mod 2^64) >> 32) * n) >> 32

with ``M`` SplitMix64's odd multiplier and ``k_i`` a 64-bit key per round drawn from the layer's
seed; ``F_i`` maps the high 32 hash bits onto ``[0, n)`` by a multiply and a shift (Lemire's
range reduction; ``n < 2^31``) and the sum is reduced by one conditional subtraction, so a round
has no integer division. Integer arithmetic only, so every device and every layout computes the
same permutation.
"""

from __future__ import annotations

import torch

from rmt.ops.counter_normal import MIX1, as_signed64, mix64, shift_right, stream_key

ROUNDS = 3


class AddressShuffle:
    """The keyed bijection of ``[0, n * n)`` for the grid side ``n`` (see the module docstring)."""

    def __init__(self, n: int, seed: int):
        if not 0 < n < 2**31:
            raise ValueError(f"AddressShuffle: the grid side must be in [1, 2^31), got {n}")
        self.n = n
        self.keys = [as_signed64(mix64(stream_key(seed, "ive_shuffle") + i)) for i in range(ROUNDS)]

    def _round(self, x: torch.Tensor, key: int) -> torch.Tensor:
        return (shift_right(x * as_signed64(MIX1) + key, 32) * self.n) >> 32

    def __call__(self, addr: torch.Tensor) -> torch.Tensor:
        a, b = torch.div(addr, self.n, rounding_mode="floor"), addr % self.n
        for key in self.keys:
            s = a + self._round(b, key)
            a, b = b, torch.where(s >= self.n, s - self.n, s)
        return a * self.n + b

    def inverse(self, addr: torch.Tensor) -> torch.Tensor:
        a, b = torch.div(addr, self.n, rounding_mode="floor"), addr % self.n
        for key in reversed(self.keys):
            s = b - self._round(a, key)
            a, b = torch.where(s < 0, s + self.n, s), a
        return a * self.n + b
