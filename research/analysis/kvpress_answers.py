"""
Answer by answer: a press in kvpress's pipeline (research/kvpress_eval.py's results.jsonl, protocol "inside")
against one of our methods on our model (research/evaluate.py's results.json), on the same RULER rows, budgets
and prompt. Parity of kept slots is tested (tests/test_kvpress.py for kvpress's presses, tests/test_lookahead_press.py
for extensions/lookaheadkv_press.py, kvpress_eval's "lookahead"); this checks that it carries through the whole
answer, HF's model and kvpress's decoding on one side, model.py and ours on the other.

    python -m research.analysis.kvpress_answers runs/kvpress-ruler4k runs/snap-window64 --press snapkv \\
        --method snapkv

FullKV is compared too (kvpress_eval's "full" against evaluate's "full"); for LookaheadKVPress, --press lookahead
--method lookahead (both the paper's form, the same adapter: kvpress_eval's --adapter is its export). Prints each answer that differs and
the count of equal ones (answers compared after stripping white space).
"""
import argparse
import json
import sys
from pathlib import Path


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("kvpress_run", type=Path, help="research.kvpress_eval's --out (results.jsonl)")
    p.add_argument("our_run", type=Path, help="research.evaluate's --out (results.json)")
    p.add_argument("--press", required=True, help="the kvpress_eval press, e.g. snapkv")
    p.add_argument("--method", required=True, help="our research.evaluate method, e.g. snapkv")
    args = p.parse_args(argv)
    for path in (args.kvpress_run / "results.jsonl", args.our_run / "results.json"):
        if not path.is_file():
            sys.exit(f"error: {path} is missing: run research.kvpress_eval / research.evaluate with that --out")
    ours = {}
    for r in json.loads((args.our_run / "results.json").read_text())["results"]:
        ours[r["id"], r["method"], 0 if r["method"] == "full" else r["budget"]] = r["output"]  # FullKV: any budget
    equal, differ = 0, []
    for line in (args.kvpress_run / "results.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r["protocol"] != "inside" or r["press"] not in ("full", args.press):
            continue
        key = (r["id"], "full" if r["press"] == "full" else args.method, r["budget"])
        if key not in ours:
            continue
        if ours[key].strip() == r["answer"].strip():
            equal += 1
        else:
            differ.append(f"{key[0]} {r['press']} C={r['budget'] or '-'}: ours {ours[key]!r}, kvpress {r['answer']!r}")
    if differ:
        print("\n".join(differ))
    print(f"{equal} answers equal, {len(differ)} differ ({args.press} in kvpress's pipeline against our "
          f"{args.method}, and FullKV)")
    return len(differ)


if __name__ == "__main__":
    main()
