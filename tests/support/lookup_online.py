#!/usr/bin/env python3
"""The engine's look-up calibration learned online, replayed: how fast would the saved greedy
outputs of `lookup_ceiling.py --save` be produced if each draft's length were chosen as the engine
chooses it (the best expected tokens per ms under a verify-cost curve, from acceptance rates that
start at a prior and follow what the target took so far), for these ways of keeping the rates:

- by the repeat behind the match, every run from the built-in prior (the engine before (k));
- by the repeat each token would extend (match plus the proposed tokens before it), every run
  from the built-in prior;
- the same, each run starting from what earlier runs showed (weight w, at least 2 and at most the
  observations behind it), as the engine keeps them since (k).

    python3 tests/support/lookup_online.py edit-q40.jsonl '{"1":5.6,"2":11.8,"4":15.2,"8":24.1,"16":38.5}'
"""
import importlib.util
import json
import os
import sys

here = os.path.dirname(os.path.abspath(__file__))
spec = importlib.util.spec_from_file_location("lookup_ceiling", os.path.join(here, "lookup_ceiling.py"))
lc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lc)


class Calibration:
    def __init__(self, learned=None, most=2.0):
        self.tested, self.accepted = [0] * 8, [0] * 8
        if learned is None:
            self.prior, self.weight = [min(0.3 + 0.1 * b, 0.9) for b in range(8)], [2.0] * 8
        else:
            self.prior = [learned.bucket_rate(b) for b in range(8)]
            self.weight = [min(max(learned.tested[b], 2.0), most) for b in range(8)]

    def bucket_rate(self, b):
        w = self.weight[b]
        return min((self.accepted[b] + w * self.prior[b]) / (self.tested[b] + w), 0.98)

    def record(self, repeat, taken):
        self.tested[lc.bucket(repeat)] += 1
        self.accepted[lc.bucket(repeat)] += taken


def speedup(seqs, cost, extend, shared, most=8.0):
    learned, total = Calibration(), 0.0
    for s in seqs:
        cal = Calibration(learned, most) if shared else Calibration()
        i = 0
        while i < len(s):
            path, a, repeat = s[i]
            d = 0
            if path:
                at_least, reach = [], 1.0
                for j in range(len(path)):
                    reach *= cal.bucket_rate(lc.bucket(repeat + j if extend else repeat))
                    at_least.append(reach)
                d = lc.best_length(at_least, cost)
            total += cost(d + 1)
            tested = [(j, True) for j in range(min(d, a))] + ([(a, False)] if a < d else [])
            for j, taken in tested:
                for c in (cal, learned):
                    c.record(repeat + j if extend else repeat, taken)
            i += min(d, a) + 1
    return sum(map(len, seqs)) * cost(1) / total


def main():
    rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
    cost = lc.Costs(json.loads(sys.argv[2]) if len(sys.argv) > 2 else {"1": 5.6, "2": 11.8, "4": 15.2, "8": 24.1, "16": 38.5})
    seqs = lc.replay(rows, 4)
    print(f"by the repeat behind the match, per run          {speedup(seqs, cost, False, False):.3f}x plain")
    print(f"by the repeat each token extends, per run        {speedup(seqs, cost, True, False):.3f}x plain")
    for most in (4, 8, 16):
        print(f"  ... starting from earlier runs, w <= {most:<2}         {speedup(seqs, cost, True, True, most):.3f}x plain")


if __name__ == "__main__":
    main()
