"""A random prefix-caching workload shared by the KV-event tests (in-process pools and real servers).

Prompts are drawn from a few families that share long prefixes, with two tenants (salts), so
admissions hit, register and (the pool being small) evict cached pages all the time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

PS = 4                      # page size of the workload's pools


@dataclass
class Workload:
    rng: np.random.Generator
    max_tokens: int = 120
    live: dict[int, int] = field(default_factory=dict)      # seq id -> tokens held
    next_id: int = 1

    def __post_init__(self) -> None:
        self.families = [self.rng.integers(1, 50_000, self.max_tokens) for _ in range(4)]

    def prompt(self) -> np.ndarray:
        fam = self.families[int(self.rng.integers(len(self.families)))]
        keep = int(self.rng.integers(1, self.max_tokens // 2))
        tail = self.rng.integers(1, 50_000, int(self.rng.integers(0, 3 * PS)))
        return np.concatenate((fam[:keep], tail)).astype(np.int64)

    def step(self, pressure: bool = False) -> dict:
        """kwargs of the next Step: frees (all live when under pressure), extensions, admissions with token ids."""
        rng = self.rng
        live = list(self.live)
        free = live if pressure else [i for i in live if rng.random() < 0.3]
        ext = [i for i in live if i not in free and self.live[i] < self.max_tokens * 2 and rng.random() < 0.5]
        admit = [] if pressure else list(range(self.next_id, self.next_id + int(rng.integers(0, 4))))
        prompts = [self.prompt() for _ in admit]
        salts = [str(rng.choice(["", "tenant-b"])) for _ in admit]
        out: dict = {"free": free, "extend": ext, "extend_tokens": int(rng.integers(1, 2 * PS)), "admit": admit,
                     "prompts": prompts, "salts": salts}
        return out

    def applied(self, kw: dict) -> None:
        """The step happened: update the live model."""
        for i in kw["free"]:
            del self.live[i]
        for i in kw["extend"]:
            self.live[i] += kw["extend_tokens"]
        for i, p in zip(kw["admit"], kw["prompts"], strict=True):
            self.live[i] = len(p)
        self.next_id += len(kw["admit"])


def pool_step_args(kw: dict) -> dict:
    """Workload step -> Pool.step keyword arguments."""
    admit = kw["admit"]
    return {"free_ids": kw["free"] or None, "extend_ids": kw["extend"] or None,
            "extend_tokens": [kw["extend_tokens"]] * len(kw["extend"]) if kw["extend"] else None,
            "admit_ids": admit or None, "admit_tokens": [len(p) for p in kw["prompts"]] if admit else None,
            "admit_token_ids": np.concatenate(kw["prompts"]) if admit else None,
            "admit_salts": kw["salts"] or None}


def client_step_args(kw: dict) -> dict:
    """Workload step -> BlockManagerClient.step keyword arguments."""
    admit = kw["admit"]
    return {"free": kw["free"] or None, "extend": kw["extend"] or None,
            "extend_tokens": kw["extend_tokens"] if kw["extend"] else None,
            "admit": admit or None, "admit_tokens": [len(p) for p in kw["prompts"]] if admit else None,
            "admit_token_ids": np.concatenate(kw["prompts"]) if admit else None,
            "salts": kw["salts"] or None}
