#!/usr/bin/env python3
"""Would the look-up choose its draft lengths better from more than the repeat length?

Replays the target's greedy outputs saved by `lookup_ceiling.py --save` (the engine's look-up
proposals along the true output, as that script computes them) and fits, per feature set, the
probability that a proposed token is accepted given that the ones before it were: the repeat
length behind the proposal, the token's depth in the draft, and its kind (newline, punctuation,
word, word after a space, space); and, as the engine estimates it, the repeat the token would
extend (the repeat behind the proposal plus the proposed tokens before the token, in the engine's
calibration buckets). Each policy then drafts the length with the best expected
tokens per ms under the verify-cost curve. Fitted on one half of the prompts and timed on the
other (cross), and in-sample for comparison. Also prints how often each kind of proposed token is
where a copy breaks.

    python3 tests/support/lookup_features.py edit-q40.jsonl models/SmolLM2-135M-Instruct.Q4_0.gguf \\
        '{"1":5.6,"2":11.8,"4":15.2,"8":24.1,"16":38.5}'
"""
import importlib.util
import json
import os
import sys
from collections import Counter, defaultdict

import gguf

here = os.path.dirname(os.path.abspath(__file__))
spec = importlib.util.spec_from_file_location("lookup_ceiling", os.path.join(here, "lookup_ceiling.py"))
lc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lc)

tokens_path, model_path = sys.argv[1], sys.argv[2]
cost = lc.Costs(json.loads(sys.argv[3]) if len(sys.argv) > 3 else {"1": 5.6, "2": 11.8, "4": 15.2, "8": 24.1, "16": 38.5})
field = gguf.GGUFReader(model_path).fields["tokenizer.ggml.tokens"]
vocab = [bytes(field.parts[i]).decode("utf-8", "replace") for i in field.data]
rows = [json.loads(line) for line in open(tokens_path) if line.strip()]


def kind(t):
    s = vocab[t]
    if "Ċ" in s:  # GPT-2 byte-level newline
        return "nl"
    text = s.replace("Ġ", " ")
    if text.strip() == "":
        return "space"
    if any(c.isalnum() or c == "_" for c in text):
        return "sword" if text.startswith(" ") else "word"
    return "punct"


seqs = lc.replay(rows, 4)

accepted, broke = Counter(), Counter()
for s in seqs:
    for path, a, _ in s:
        for j in range(min(a, len(path))):
            accepted[kind(path[j])] += 1
        if a < len(path):
            broke[kind(path[a])] += 1
print("proposed token  accepted  broke there  P(break)")
for k in sorted(set(accepted) | set(broke)):
    print(f"{k:<15} {accepted[k]:8d} {broke[k]:12d} {broke[k] / (accepted[k] + broke[k]):9.3f}")


def features(path, j, repeat):
    return min(repeat, 16), kind(path[j]), j


def fit(part, use):
    """P(token accepted | the ones before it were), by use(features), with add-one smoothing."""
    took, seen = defaultdict(int), defaultdict(int)
    for s in part:
        for path, a, repeat in s:
            for j in range(min(a + 1, len(path))):
                key = use(features(path, j, repeat))
                seen[key] += 1
                took[key] += j < a
    return lambda key: (took[key] + 1) / (seen[key] + 2)


def time_of(part, p_next, use):
    def choose(path, repeat):
        at_least, reach = [], 1.0
        for j in range(len(path)):
            reach *= p_next(use(features(path, j, repeat)))
            at_least.append(reach)
        return lc.best_length(at_least, cost)

    return sum(lc.policy_time(s, cost, choose) for s in part)


uses = {
    "repeat": lambda k: (k[0],),
    "repeat + depth": lambda k: (k[0], min(k[2], 4)),
    "repeat + kind": lambda k: (k[0], k[1]),
    "repeat + kind + depth": lambda k: (k[0], k[1], min(k[2], 4)),
    "repeat extended (engine)": lambda k: (lc.bucket(k[0] + k[2]),),
}
half = len(seqs) // 2
A, B = seqs[:half], seqs[half:]
plain_a, plain_b = sum(map(len, A)) * cost(1), sum(map(len, B)) * cost(1)
print("features (x plain)         in-sample A / B   fitted on the other half A / B")
for name, use in uses.items():
    ins = plain_a / time_of(A, fit(A, use), use), plain_b / time_of(B, fit(B, use), use)
    cross = plain_a / time_of(A, fit(B, use), use), plain_b / time_of(B, fit(A, use), use)
    print(f"{name:<26} {ins[0]:.3f} / {ins[1]:.3f}     {cross[0]:.3f} / {cross[1]:.3f}")
