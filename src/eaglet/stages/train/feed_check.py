"""The teacher check of the states a :class:`eaglet.stages.train.stream.StateFeed` receives:
each sample's teacher argmax, and, where the target answered greedily, its agreement with the
target's answers held to ``extract.min_teacher_agreement`` as extraction holds each shard's.
"""

from __future__ import annotations

import torch

from eaglet.target.states import TeacherHead, answer_rows, enforce_agreement, recorded_answer

# answer positions between two checks of the streamed teacher agreement (greedy data), as
# extraction checks each shard's: a wrong capture stops training early, not after an epoch
AGREEMENT_EVERY = 2048


class TeacherCheck:
    """The teacher's argmax of each streamed sample, computed once, and the agreement check.

    ``records``: the training samples; ``dtype``: ``extract.dtype``, the states' stored
    dtype the teacher reads."""

    def __init__(self, head: TeacherHead, records: list[dict], dtype: str):
        self.head, self.records, self.dtype = head, records, dtype
        # extract.min_teacher_agreement where the target answered greedily (None: sampled
        # answers, whose argmax the sample need not be); each sample's first check, by sample
        self.min_agreement: float | None = None
        self.agreement: dict[int, tuple[int, int]] = {}
        # each sample's teacher argmax, computed at its first epoch and reused after it, as
        # shard mode computes it once at extraction (int32: 4 bytes a token, beside the
        # states' thousands)
        self.teacher: dict[int, torch.Tensor] = {}
        self.agreed = [0, 0]  # their sums: agreements, positions
        self._next_check, self._checked_at_end = AGREEMENT_EVERY, 0

    def expect(self, order: list[int], masks: list[list[int]]) -> None:
        """The samples of ``order`` whose agreement is checked (the target's own answers):
        all of them in, the last check."""
        self._checked_at_end = sum(
            1 for i in set(order) if not recorded_answer(self.records[i]) and any(masks[i][1:])
        )

    def argmax(self, i: int, final: torch.Tensor, ids: list[int], mask: list[int]) -> torch.Tensor:
        """Sample ``i``'s teacher argmax (-1 except where it predicts an answer token) from
        its final-norm states ``final``; checked against the target's own answers."""
        known = self.teacher.get(i)
        if known is not None:  # a later epoch: the head's product once a sample, as a shard's
            return known.long()
        argmax = torch.full((len(ids),), -1, dtype=torch.int64)
        rows, checked, nxt = answer_rows(final, ids, mask, self.dtype)
        argmax[rows], _ = self.head(checked, nxt)  # a chunk of rows at a time
        self.teacher[i] = argmax.to(torch.int32)
        if rows.numel() and not recorded_answer(self.records[i]):  # the target's answers
            agree = int((argmax[rows] == nxt).sum())
            self.agreement[i] = (agree, rows.numel())
            self.agreed[0] += agree
            self.agreed[1] += rows.numel()
            self._check_agreement()
        return argmax

    def _check_agreement(self) -> None:
        """Greedy data: the samples' teacher agreement so far against
        ``extract.min_teacher_agreement``, every AGREEMENT_EVERY answer positions and once every
        sample is in, as extraction checks each shard (:func:`enforce_agreement`'s error)."""
        agreed, positions = self.agreed
        if self.min_agreement is None or not positions:
            return
        if positions < self._next_check and len(self.agreement) < self._checked_at_end:
            return
        self._next_check = positions + AGREEMENT_EVERY
        if agreed / positions >= self.min_agreement:
            return
        per_sample = [
            {"id": self.records[i]["id"], "agreement": a / n, "positions": n}
            for i, (a, n) in self.agreement.items()
        ]
        enforce_agreement(
            {
                "greedy": True,
                "backend": "vllm",
                "file": f"the {len(per_sample)} samples streamed so far",
                "teacher": {
                    "agreement": agreed / positions,
                    "worst": sorted(per_sample, key=lambda r: r["agreement"])[:3],
                },
            },
            self.min_agreement,
        )
