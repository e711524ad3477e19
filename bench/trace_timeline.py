"""One line per sample of a traced admission bench round: the gateway's line and ledger against the
backend's pool and sequences.

`python bench/trace_timeline.py DUMP [--every S] [--from T] [--to T]`, where DUMP is the `--dump`
file of `bench/admission_bench.py ... --trace`. Per line: seconds into the round; the gateway's
queued requests, committed, held back, lendable and free MB; the backend's free blocks, blocks
promised, and its sequences as (reserved tokens, used tokens): running, then waiting (R: waiting
to resume after a preemption, N: new).
"""

import argparse
import json


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("dump")
    p.add_argument("--every", type=float, default=2.5, help="seconds between lines")
    p.add_argument("--from", dest="start", type=float, default=0.0)
    p.add_argument("--to", type=float, default=float("inf"))
    a = p.parse_args()
    mb = 1e6
    with open(a.dump) as fh:
        for line in fh:
            rec = json.loads(line)
            if "trace" not in rec:
                continue
            print(f"# {rec['arm']} round {rec['round']}")
            last = float("-inf")
            for s in rec["trace"]:
                if s["t"] - last < a.every or not a.start <= s["t"] <= a.to:
                    continue
                last = s["t"]
                g, b = s["gateway"], s["backend"]
                pool = b.get("pool", {})
                seqs = b.get("leases", [])
                run = [(x["reserved_tokens"], x["used_tokens"]) for x in seqs if x["state"] == "running"]
                wait = [(x["reserved_tokens"], x["used_tokens"], "R" if x.get("resuming") else "N")
                        for x in seqs if x["state"] != "running"]
                print(f"{s['t']:6.1f} gw q={g.get('queued')} com={g.get('committed_bytes', 0) / mb:5.1f} "
                      f"hb={g.get('held_back_bytes', 0) / mb:5.1f} lend={g.get('lendable_bytes', 0) / mb:4.1f} "
                      f"free={g.get('free_bytes', 0) / mb:4.1f} | be free={pool.get('blocks_free')} "
                      f"prom={pool.get('promised_bytes', 0) / pool.get('block_bytes', 1):4.1f} run={run} wait={wait}")


if __name__ == "__main__":
    main()
