"""Records the logits the engine samples from, per request and position, for oracle comparisons."""

from __future__ import annotations

from collections import defaultdict

import torch


class LogitsRecorder:
    def __init__(self, engine):
        self.by_request: dict[str, dict[int, torch.Tensor]] = defaultdict(dict)
        runner = engine.runtime.runner
        original = runner.run

        def run(batch):
            logits, rows = original(batch)
            sampled = [seq for seq, n in batch.items if seq.num_computed_tokens + n == seq.num_tokens]
            for seq, row in zip(sampled, logits):  # numpy rows (the native runtime) become tensors
                self.by_request[seq.request_id][seq.num_tokens - 1] = torch.as_tensor(row).clone()
            return logits, rows

        runner.run = run

    def stacked(self, request_id: str) -> tuple[list[int], torch.Tensor]:
        positions = sorted(self.by_request[request_id])
        return positions, torch.stack([self.by_request[request_id][p] for p in positions])
