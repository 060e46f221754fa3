#!/usr/bin/env bash
# A/B of two GPU bundles' benchmarks in one device run: the decode and prefill cases the speed
# promises are about, old and new alternated ROUNDS times, then a table of the medians (criterion's
# middle estimate) and new/old per case.
#
#   bash scripts/ab_bench.sh OLD_BUNDLE NEW_BUNDLE [ROUNDS] [OUT_DIR]
#
# OLD_BUNDLE and NEW_BUNDLE are folders made by `cargo xtask gpu-bundle` (only their benches/decode
# and benches/prefill executables are used). Logs go to OUT_DIR (default ab-reports/).
set -u -o pipefail
old="$1"
new="$2"
rounds="${3:-2}"
out="${4:-ab-reports}"
mkdir -p "$out"

# The decode and prefill cases the speed promises are about (AB_DECODE_CASES / AB_PREFILL_CASES
# replace them, e.g. to time only the side a change touches).
DECODE_CASES="${AB_DECODE_CASES:-attention/dense/b1/131072,attention/dense/b1/262144,attention/dense/b16/131072,attention/dense/b16/262144,attention/static/b1/4096,step/lserve/b1/16384,step/lserve/b1/262144,step/lserve/b16/262144,step/dynamic/b1/262144}"
PREFILL_CASES="${AB_PREFILL_CASES:-prefill/dense/4096,prefill/dense/16384,prefill/dense/65536,prefill/streaming50/65536,prefill_block_sparse/sparsity_percent/80}"

run_bench() { # label bundle bench cases
    local label="$1" bundle="$2" bench="$3" cases="$4"
    echo "=== $label $bench"
    LSERVE_BENCH_ONLY="$cases" "$bundle/benches/$bench" --bench 2>&1 | tee -a "$out/$label-$bench.txt"
}

for r in $(seq 1 "$rounds"); do
    for side in old new; do
        bundle="$old"
        [ "$side" = new ] && bundle="$new"
        run_bench "$side" "$bundle" decode "$DECODE_CASES"
        run_bench "$side" "$bundle" prefill "$PREFILL_CASES"
    done
done

python3 - "$out" <<'EOF'
import re, sys, pathlib, statistics
out = pathlib.Path(sys.argv[1])
unit = {"ns": 1e-3, "µs": 1.0, "us": 1.0, "ms": 1e3, "s": 1e6}
def cases(path):
    found, name = {}, None
    for line in path.read_text(errors="replace").splitlines():
        m = re.match(r"^(\S+/\S+)\s*$", line.strip()) if "time:" not in line else None
        if m and not line.startswith(" "):
            name = m.group(1)
        t = re.search(r"time:\s+\[\S+ \S+ (\S+) (\S+) \S+ \S+\]", line)
        if t:
            # `name   time: [...]` on one line, or the name on the line before.
            head = line.split("time:")[0].strip()
            key = head or name
            found.setdefault(key, []).append(float(t.group(1)) * unit[t.group(2)])
    return found
rows = {}
for side in ("old", "new"):
    for f in sorted(out.glob(f"{side}-*.txt")):
        for k, v in cases(f).items():
            rows.setdefault(k, {}).setdefault(side, []).extend(v)
print(f"{'case':45} {'old µs (each round)':>28} {'new µs (each round)':>28} {'new/old':>8}")
for k in sorted(rows):
    o, n = rows[k].get("old", []), rows[k].get("new", [])
    ratio = statistics.median(n) / statistics.median(o) if o and n else float("nan")
    fmt = lambda xs: " / ".join(f"{x:.2f}" for x in xs)
    print(f"{k:45} {fmt(o):>28} {fmt(n):>28} {ratio:8.3f}")
EOF
