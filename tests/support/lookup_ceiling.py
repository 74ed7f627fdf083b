#!/usr/bin/env python3
"""How fast could context look-up drafting be on a prompt set, given what a verify costs?

Reads each prompt's token ids and the target's greedy output (collected from a running
`dflash2 serve --no-lookup` with --server, or a JSONL of {"prompt": ids, "out": ids}), and a
verify-cost curve (ms for a decode of b rows, b -> ms, as `dflash2 inspect --check` prints),
then simulates, on the true output:

- copy oracle: a drafter that knows the output drafts, at each position, the longest run of
  coming tokens found anywhere in the context, with the best draft length (the ceiling of any
  drafting that copies from the context);
- look-up, oracle lengths: the engine's own proposals (longest suffix of <= NGRAM tokens
  matched, most supported continuation, most recent on ties), with the draft length chosen
  knowing how many the target will accept (the ceiling of these proposals);
- look-up, fixed policies: draft min(proposal, D) tokens when the repeat behind the proposal is
  at least M tokens long;
- look-up, best stationary policy from the repeat length: acceptance tables fitted on the
  set itself (in-sample, so an upper bound for any policy that reads only the repeat length,
  as the engine's calibration does).

    python3 tests/support/lookup_ceiling.py --server http://127.0.0.1:8080 \\
        --prompts models/edit-heldout.jsonl --save work/edit-q40.jsonl
    python3 tests/support/lookup_ceiling.py --tokens work/edit-q40.jsonl --costs '{"1":5.6,"2":11.8,"4":15.2,"8":24.1,"16":38.5}'
"""
import argparse
import json
import urllib.request
from collections import Counter, defaultdict

MAX_DRAFT = 15


def collect(server, prompts, n_predict):
    def post(path, body):
        req = urllib.request.Request(server + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        return json.load(urllib.request.urlopen(req, timeout=600))

    rows = []
    for line in open(prompts):
        if not line.strip():
            continue
        row = json.loads(line)
        text = post("/apply-template", {"messages": [{"role": "user", "content": row["prompt"]}]})["prompt"]
        ids = post("/tokenize", {"content": text, "add_special": False})["tokens"]
        done = post("/completion", {"prompt": ids, "n_predict": n_predict, "temperature": 0, "return_tokens": True, "cache_prompt": False})
        rows.append({"prompt": ids, "out": done["tokens"]})
    return rows


class Costs:
    def __init__(self, table):
        self.points = sorted((int(b), float(ms)) for b, ms in table.items())

    def __call__(self, b):
        """ms of a decode of b rows, linear between measured sizes."""
        for (lo, a), (hi, c) in zip(self.points, self.points[1:]):
            if lo <= b <= hi:
                return a + (c - a) * (b - lo) / (hi - lo)
        return self.points[-1][1] * b / self.points[-1][0]


def longest_copy(ctx, fut):
    best = 0
    for s, t in enumerate(ctx):
        if fut and t == fut[0]:
            n = 0
            while n < MAX_DRAFT and n < len(fut) and s + n < len(ctx) and ctx[s + n] == fut[n]:
                n += 1
            best = max(best, n)
    return best


def propose(ctx, max_ngram, max_matches=8, long_match=16):
    """(the engine's look-up path, the repeat length behind it); ([], 0) when nothing matches."""
    n_ctx = len(ctx)
    for n in range(min(max_ngram, n_ctx - 1), 0, -1):
        suffix = ctx[n_ctx - n:]
        ends = [e for e in range(n_ctx - 1, n - 1, -1) if ctx[e - n:e] == suffix][:max_matches]
        if not ends:
            continue

        def repeat(e):
            k = n
            while k < long_match and e - k - 1 >= 0 and ctx[e - k - 1] == ctx[n_ctx - k - 1]:
                k += 1
            return k

        alive, path = [ctx[e:e + MAX_DRAFT] for e in ends], []
        for d in range(MAX_DRAFT):
            votes = Counter(c[d] for c in alive if len(c) > d)
            if not votes:
                break
            top = max(votes.values())
            token = next(c[d] for c in alive if len(c) > d and votes[c[d]] == top)
            path.append(token)
            alive = [c for c in alive if len(c) > d and c[d] == token]
        return path, max(repeat(e) for e in ends)
    return [], 0


def accepted(path, out, i):
    a = 0
    while a < len(path) and i + a < len(out) and path[a] == out[i + a]:
        a += 1
    return a


def best_time(n, cost, options):
    """Least time to produce n tokens when position i offers drafts of lengths options(i), each
    accepting accepted(i, d) tokens: dynamic programming from the end."""
    t = [0.0] * (n + 1)
    for i in range(n - 1, -1, -1):
        t[i] = cost(1) + t[i + 1]
        for d, a in options(i):
            t[i] = min(t[i], cost(d + 1) + t[min(n, i + a + 1)])
    return t[0]


def replay(rows, ngram):
    """Per prompt, every position's look-up proposal along the true output (the context does
    not depend on how the output was drafted): [(path, tokens of it accepted, repeat length)]."""
    steps = []
    for r in rows:
        p, o = r["prompt"], r["out"]
        seq = []
        for i in range(len(o)):
            path, repeat = propose(p + o[:i], ngram)
            seq.append((path, accepted(path, o, i), repeat))
        steps.append(seq)
    return steps


def bucket(repeat):
    """The engine's look-up calibration buckets (`src/draft/lookup.rs`)."""
    return repeat if repeat <= 4 else 5 if repeat <= 7 else 6 if repeat <= 11 else 7


def best_length(at_least, cost):
    """The draft length with the most expected tokens per ms, given at_least[d - 1] = P(at
    least d drafted tokens accepted); 0 (a plain step) when none beats it."""
    best_d, best_rate, expected = 0, 1.0 / cost(1), 0.0
    for d, p in enumerate(at_least, 1):
        expected += p
        if (1 + expected) / cost(d + 1) > best_rate:
            best_d, best_rate = d, (1 + expected) / cost(d + 1)
    return best_d


def policy_time(steps, cost, choose):
    """Time of one prompt's replay when choose(path, repeat) sets each draft's length."""
    t, i = 0.0, 0
    while i < len(steps):
        path, a, repeat = steps[i]
        d = choose(path, repeat) if path else 0
        t += cost(d + 1)
        i += min(d, a) + 1
    return t


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--server", help="a running `dflash2 serve --no-lookup` to collect outputs from")
    ap.add_argument("--prompts", help="with --server: JSONL with a \"prompt\" field")
    ap.add_argument("-n", type=int, default=128, help="tokens generated per prompt (--server)")
    ap.add_argument("--save", help="with --server: write the collected token ids here")
    ap.add_argument("--tokens", help="JSONL of {\"prompt\": ids, \"out\": ids} (instead of --server)")
    ap.add_argument("--costs", default='{"1": 5.6, "2": 11.8, "4": 15.2, "8": 24.1, "16": 38.5}',
                    help="verify cost in ms by rows, JSON (default: SmolLM2 Q4_0 on the AMX Xeon, BENCHMARKS (h))")
    ap.add_argument("--lookup-ngram", type=int, default=4)
    ap.add_argument("--limit", type=int, help="only the first N prompts")
    args = ap.parse_args()
    if args.server:
        rows = collect(args.server, args.prompts, args.n)
        if args.save:
            with open(args.save, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)
    else:
        rows = [json.loads(line) for line in open(args.tokens) if line.strip()]
    rows = rows[:args.limit]
    cost = Costs(json.loads(args.costs))
    plain = sum(len(r["out"]) for r in rows) * cost(1)

    steps = replay(rows, args.lookup_ngram)

    def report(name, total):
        print(f"{name:<58} {plain / total:5.2f}x plain")

    copy = 0.0
    for r in rows:
        p, o = r["prompt"], r["out"]
        longest = [longest_copy(p + o[:i], o[i:]) for i in range(len(o))]
        copy += best_time(len(o), cost, lambda i: [(d, d) for d in range(1, longest[i] + 1)])
    report("copy oracle (any run of the context, best lengths)", copy)
    report("look-up proposals, oracle lengths",
           sum(best_time(len(s), cost, lambda i, s=s: [(d, min(d, s[i][1])) for d in range(1, len(s[i][0]) + 1)]) for s in steps))
    fixed = {(D, M): sum(policy_time(s, cost, lambda path, rep: min(len(path), D) if rep >= M else 0) for s in steps)
             for D in (1, 3, 5, 7, 11, 15) for M in (1, 2, 4, 6, 8, 12, 16)}
    (D, M), total = min(fixed.items(), key=lambda kv: kv[1])
    report(f"look-up, best fixed policy (draft <= {D} when the repeat >= {M})", total)

    # acceptance by repeat length, fitted on the set: P(at least k accepted | repeat)
    reach, seen = defaultdict(lambda: [0] * (MAX_DRAFT + 1)), Counter()
    for s in steps:
        for path, a, repeat in s:
            if path:
                seen[repeat] += 1
                for k in range(1, a + 1):
                    reach[repeat][k] += 1

    def stationary(path, repeat):
        return best_length([reach[repeat][d] / seen[repeat] for d in range(1, len(path) + 1)], cost)

    report("look-up, best policy reading the repeat length (in-sample)", sum(policy_time(s, cost, stationary) for s in steps))


if __name__ == "__main__":
    main()
